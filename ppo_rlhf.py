"""RLHF with PPO, the OpenAI way: a one-file reproduction of openai/lm-human-preferences (Ziegler et
al., 2019).

Read it top to bottom: `Args` -> helpers -> `ppo_loss` (one micro-batch's objective) and
`update_policy` -> `train()` -> presets -> `main()`.
train() is the table of contents; its numbered steps:
    1. setup: the reward model (rewards.py trains one first if none is given), the frozen reference
       policy, the policy + value head, TF1 Adam; resume from <output_dir>/checkpoint
    then once per PPO update:
    2. anneal the learning rate linearly to 0
    3. rollout: sample fixed-length responses (rollout.sample_fixed_length), policy logprobs
       + values and reference logprobs of query + response, truncate each response and score it
       with the reward model
    4. rewards: the per-token KL penalty, the score added at the last token
    5. whiten the rewards without shifting their mean
    6. GAE, then whitened advantages
    7. pi_old and the rollout correction ("disabled" = the original's PPO, with the correction's
       metrics)
    8. PPO epochs: the clipped surrogate and the clipped value loss (ppo_loss); a minibatch is an
       optimizer step, a micro-batch a forward/backward (update_policy)
    9. metrics (averaged over ranks) and the adaptive KL controller
    10. a sample table
    11. checkpoint
    and at the end: 12. the final policy and a checksum per rank.

Plumbing a first read can skip: every `harness.` call (processes, checkpoints and logs live in
harness.py), and the section "Models, data, checkpoints, metrics" before update_policy.

Every implementation detail is commented where it happens with a pointer into "The N Implementation
Details of RLHF with PPO" (Huang, Liu, von Werra, Hugging Face blog, 2023). The blog numbers its
details per section; we cite them as
    [general N]  "General implementation details": 1 query+response, 2 pad token, 3 position ids,
                 4 fixed-length sampling, 5 lr annealing, 6 per-rank seeds
    [reward N]   "Reward model implementation details": 1 last-token reward, 2 head init,
                 3 normalisation
    [policy N]   "Policy training implementation details": 1 temperature, 2 value head init,
                 3 query text, 4 no dropout, 5 truncation/rejection, 6 gamma=1, 7 batch/minibatch
                 loop, 8 per-token KL, 9 whitening, 10 value clipping, 11 adaptive KL
    [adam]       "PyTorch Adam optimizer numerical issues w.r.t RLHF"
and the PyTorch reproduction as [repro] (vwxyzjn/lm-human-preference-details,
train_policy_accelerate.py).

Run:
    python ppo_rlhf.py tiny --output-dir runs/ppo_tiny            # offline CPU, whole pipeline
    python ppo_rlhf.py smol_sentiment --output-dir runs/ppo_smol  # offline CPU, SmolLM2-135M
    torchrun --standalone --nproc_per_node 2 ppo_rlhf.py tiny --output-dir runs/ppo_ddp  # 2 CPUs
    torchrun --standalone --nproc_per_node 8 ppo_rlhf.py gpt2_sentiment --output-dir runs/gpt2
"""

import dataclasses
import functools
import gc
import glob
import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

import corrections
import harness
import logprobs
import lora
import memory
import objectives
import rewards
import rollout
import tasks
from adam_tf import AdamTF


@dataclass
class PPOArgs:
    """ppo_rlhf.py's own flags, grouped in the order the algorithm uses them. Args below adds the
    run's (harness.CheckpointedRunArgs) and LoRA's (lora.LoraArgs), flat on the command line and in
    args.json."""

    # ---- models ----
    base_model: str = "gpt2"
    """the pretrained policy (HF hub name or path); empty = the tiny policy rewards.py saved next to
    the reward model"""
    reward_model_path: Optional[str] = None
    """a reward model saved by rewards.py (`<run>/reward_model`); None = train one first with
    `reward_preset`"""
    reward_preset: str = "gpt2_sentiment"
    """the rewards.PRESETS entry trained (into <output_dir>/reward_model_run) when reward_model_path
    is None"""

    # ---- task ([repro] TaskHParams; OpenAI launch.py stylistic tasks) ----
    query_dataset: str = "books"
    """the queries: "books" (the Hub's bookcorpus Parquet files, [policy 3]), "tldr" (OpenAI's TL;DR
    posts), a .parquet/.json/.jsonl path/URL/glob (rewards.load_query_dataset), or offline "tiny" /
    "openers" (rewards.py)"""
    query_length: int = 64
    """queries are truncated / left-padded to exactly this many tokens ([general 2])"""
    response_length: int = 24
    """every response has exactly this many sampled tokens, EOS does not stop sampling ([general
    4])"""
    truncate_token: str = "."
    """responses are cut at the first occurrence of this token at or after `truncate_after` ([policy
    5])"""
    truncate_after: int = 16
    """the truncate token only counts from this response position on ([policy 5])"""
    penalty_reward_value: float = -1.0
    """the score of a response that has no truncate token at or after `truncate_after` ([policy
    5])"""
    temperature: float = 0.7
    """sampling temperature; logits are divided by it wherever logprobs/entropy are computed
    ([policy 1])"""
    start_text: Optional[str] = None
    """start each query after the first occurrence of this one-token text, skip texts without it
    (OpenAI's trimming, rewards.trim_query_tokens; launch.py books: "."; None as
    lm-human-preference-details' benchmark)"""
    end_text: Optional[str] = None
    """end each query at the last occurrence of this one-token text, skip texts without it (as
    start_text)"""
    query_prefix: str = ""
    """text before every query the policy sees (lm_tasks.py query_formatter); the reward model
    scores the raw query"""
    query_suffix: str = ""
    """text after every query the policy sees ("\\n\\nTL;DR:" for summarisation); not shown to the
    reward model"""

    # ---- PPO ([repro] PpoHParams) ----
    total_episodes: int = 1_000_000
    """total number of sampled responses (all ranks together)"""
    rollout_batch_size: int = 512
    """responses per PPO update, summed over ranks (the original: 8 GPUs x 64)"""
    nminibatches: int = 1
    """optimizer steps per epoch over the rollout batch ([policy 7]; 1 in the original)"""
    noptepochs: int = 4
    """PPO epochs over each rollout batch ([policy 7])"""
    local_micro_batch_size: int = 64
    """per-rank forward/backward size; gradient accumulation = per-rank minibatch / this (a memory
    knob only)"""
    lr: float = 1e-5
    """peak learning rate, annealed linearly to 0 ([general 5])"""
    eps: float = 1e-5
    """Adam epsilon (TF-style epsilon-hat for adam_tf, [adam])"""
    optimizer: str = "adam_tf"
    """adam_tf = TF1 Adam as in the original ([adam]); adam = torch.optim.Adam"""
    vf_coef: float = 0.1
    """value loss coefficient"""
    cliprange: float = 0.2
    """PPO ratio clip"""
    cliprange_value: float = 0.2
    """value-function clip around the rollout values ([policy 10])"""
    gamma: float = 1.0
    """discount ([policy 6])"""
    lam: float = 0.95
    """GAE lambda"""
    whiten_rewards: bool = True
    """whiten the per-token rewards without shifting the mean ([policy 9])"""
    whiten_group_size: int = 0
    """whiten rewards and advantages in groups of this many consecutive rollouts of a rank (0 = the
    per-rank batch); OpenAI's 8 ranks each whitened their own 64, so 64 on one GPU computes what
    they computed ([policy 9])"""

    # ---- KL penalty ([policy 8], [policy 11]) ----
    kl_coef: float = 0.15
    """initial beta of the per-token KL penalty"""
    adaptive_kl: bool = True
    """adapt beta towards `kl_target` ([policy 11])"""
    kl_target: float = 6.0
    """target KL(pi || pi_ref) per response, in nats"""
    kl_horizon: int = 10000
    """adaptive KL horizon, in episodes"""

    # ---- rollout correction (corrections.py; not in the original) ----
    correction: str = "disabled"
    """a corrections.RolloutCorrection preset (e.g. decoupled_token_is) for the
    generate()-vs-forward mismatch; "disabled" = the original's loss, with the rollout_corr/*
    metrics logged"""

    # ---- precision and memory ----
    precision: str = "auto"
    """forward dtype over fp32 weights: auto (bf16 autocast on CUDA, fp32 on CPU), fp32 or bf16
    (fp16 with loss scaling is grpo.py's)"""
    logprob_chunk_rows: int = 1024
    """rows (batch x time) per chunk when computing logprobs, so no float32 (B, T, V) log-softmax
    exists"""


@dataclass
class Args(lora.LoraArgs, harness.CheckpointedRunArgs, PPOArgs):
    """ppo_rlhf.py's flags: PPO's own (PPOArgs) first in --help, a dataclass listing its last base's
    fields first, then the run's (--seed, --output-dir, --save-every, --resume-from, --track, ...;
    the seed: rank r samples with seed + r * 100003, [general 6], and the queries are shuffled with
    the seed itself) and LoRA's for the policy (--lora-rank, ...; the value head is trained
    whole)."""

    # ppo_rlhf.py's defaults of the shared run flags
    exp_name: str = "ppo_rlhf"
    output_dir: str = "runs/ppo_rlhf"
    wandb_project: str = "ppo_rlhf"


# ==================================================================================================
# Helpers: checks and batch arithmetic (before any model loads), seeds, schedules
# ==================================================================================================


def batch_sizes(args, world_size):
    """Global batch sizes -> per-rank sizes (dict: local_batch, local_mini, micro, grad_accum,
    num_updates).

    The preset gives the *global* rollout batch (512 in the original), so the same preset is the
    same experiment on 1 GPU or 8: only gradient accumulation changes ([policy 7], micro-batches
    added by [repro]).
    """

    def divide(a, what, b, by):
        if a % b:
            raise ValueError(f"{what} {a} must be divisible by {by} {b}")
        return a // b

    for name in ("rollout_batch_size", "nminibatches", "local_micro_batch_size", "total_episodes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.total_episodes < args.rollout_batch_size:
        raise ValueError(
            f"--total-episodes {args.total_episodes} must be >= --rollout-batch-size "
            f"{args.rollout_batch_size}"
        )
    if args.whiten_group_size < 0:
        raise ValueError(
            "--whiten-group-size must be >= 0 (0 = the per-rank batch), got "
            f"{args.whiten_group_size}"
        )
    local_batch = divide(
        args.rollout_batch_size, "--rollout-batch-size", world_size, "the world size"
    )
    local_mini = divide(
        local_batch, "--rollout-batch-size / world size =", args.nminibatches, "--nminibatches"
    )
    micro = min(args.local_micro_batch_size, local_mini)
    grad_accum = divide(
        local_mini,
        "--rollout-batch-size / world size / --nminibatches =",
        micro,
        "--local-micro-batch-size",
    )
    group = args.whiten_group_size or local_batch
    divide(local_batch, "--rollout-batch-size / world size =", group, "--whiten-group-size")
    if args.whiten_rewards and group < 8:
        raise ValueError(
            "--whiten-group-size must be >= 8 to whiten rewards (OpenAI's train_policy.py asserts "
            f"a per-rank minibatch >= 8), got groups of {group} rollouts"
        )
    return dict(
        local_batch=local_batch,
        local_mini=local_mini,
        micro=micro,
        grad_accum=grad_accum,
        num_updates=args.total_episodes // args.rollout_batch_size,
    )


def check_args(args, world_size):
    """Every flag with a meaningful range, before any model loads: a ValueError starting with the
    flag as typed (main prints it in one line, exit 2). Returns batch_sizes(args, world_size); the
    last check creates --output-dir."""

    choices = {
        "optimizer": ("adam_tf", "adam"),
        "correction": corrections.ALL_PRESET_NAMES,
        "reward_preset": tuple(rewards.PRESETS),
        # fp16 needs a loss scaler, which this trainer's update does not have (grpo.py's does)
        "precision": ("auto", "fp32", "bf16"),
    }
    ranges = {
        ">= 1": "query_length response_length noptepochs kl_horizon logprob_chunk_rows",
        ">= 0": "torch_threads log_samples_every num_log_samples save_every truncate_after kl_coef "
        "vf_coef cliprange_value",
        "> 0": "lr eps temperature kl_target",
        "in [0, 1]": "gamma lam",
        "in [0, 1)": "cliprange",
    }
    # finite numbers, --track able to log, then the choices and ranges above, then LoRA's flags
    harness.check_flags(args, choices, ranges)
    lora.check_lora_args(args)
    # else no response can be truncated: every score is -1
    if args.truncate_after >= args.response_length:
        raise ValueError(
            f"--truncate-after {args.truncate_after} must be < --response-length "
            f"{args.response_length} (the truncate token must be able to occur)"
        )
    sizes = batch_sizes(args, world_size)
    names = ("tiny", "openers", "bookcorpus", "books", "tldr")
    dataset = args.query_dataset
    if dataset not in names and "://" not in dataset and not glob.glob(dataset):
        raise ValueError(
            f"--query-dataset {dataset!r} must be one of {', '.join(names)}, a file or a URL"
        )
    # a local query file is read and checked now (rewards.py's checks: empty, no text column, nulls,
    # not UTF-8, no text at all); the Hub's and a URL's when the run reads them
    if dataset not in names and "://" not in dataset:
        rewards.load_query_dataset(dataset)
    if dataset != "tiny" and args.base_model == "":
        raise ValueError(
            f"--query-dataset {dataset!r} needs a real --base-model (e.g. gpt2), got ''"
        )
    if dataset == "tiny" and (
        args.start_text or args.end_text or args.query_prefix or args.query_suffix
    ):
        raise ValueError(
            "--start-text, --end-text, --query-prefix and --query-suffix must be empty for the "
            "tiny task"
        )
    if tasks.smollm2_problem(args.base_model):
        raise ValueError(tasks.smollm2_problem(args.base_model))
    if args.base_model and not os.path.isdir(args.base_model):
        harness.model_config("--base-model", args.base_model)
    if args.lora_rank:
        # the adapter's modules exist in the policy (the tiny one rewards.py builds is a gpt2), on
        # the meta device: no weights, before any reward model trains
        config = (
            harness.model_config("--base-model", args.base_model)
            if args.base_model
            else tasks.tiny_model_config(tasks.build_tiny_tokenizer(), "gpt2")
        )
        try:
            memory.count_adapter_parameters(
                config, args.lora_rank, args.lora_alpha, args.lora_target_modules
            )
        except harness.RunError as error:
            raise ValueError(str(error)) from None
    if args.reward_model_path is not None and not os.path.isdir(args.reward_model_path):
        raise ValueError(
            f"--reward-model-path {args.reward_model_path!r} must be a directory (rewards.py's "
            "output)"
        )
    harness.check_paths(args)
    return sizes


def local_seed(seed, rank):
    """[general 6]: every rank gets its own seed, so the 8 processes sample different responses (OAI
    core.py)."""
    return seed + rank * 100003  # 100003 is prime


def linear_lr(update, num_updates, lr):
    """[general 5]: lr annealed linearly to 0; update counts from 1, so the first update uses the
    full lr."""
    return (1.0 - (update - 1.0) / num_updates) * lr


def adaptive_kl_update(kl_coef, current_kl, n_steps, target, horizon):
    """[policy 11] OpenAI's AdaptiveKLController.update:
    beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon."""
    proportional_error = float(np.clip(current_kl / target - 1, -0.2, 0.2))
    return kl_coef * (1 + proportional_error * n_steps / horizon)


def minibatch_schedule(perm, local_mini, micro):
    """[policy 7]: one epoch = a fresh permutation cut into minibatches (one optimizer step each),
    each cut into micro-batches (one forward/backward each, gradients accumulated). Returns
    [[micro_inds, ...], ...]."""
    minibatches = [perm[start : start + local_mini] for start in range(0, len(perm), local_mini)]
    return [[mini[s : s + micro] for s in range(0, local_mini, micro)] for mini in minibatches]


# ==================================================================================================
# Helpers: tensors (padding, position ids, truncation, whitening, GAE, value clipping), the policy's
# two heads
# ==================================================================================================


def left_pad_queries(token_lists, query_length, pad_token_id):
    """[general 2]: truncate each query to `query_length` tokens and LEFT-pad it with the distinct
    pad token (the original right-pads and [repro] converts to left padding; padding left directly
    gives the same tensor)."""
    out = torch.full((len(token_lists), query_length), pad_token_id, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        tokens = tokens[:query_length]
        if len(tokens) > 0:
            out[i, query_length - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
    return out


def truncate_responses(responses, truncate_token_id, truncate_after, pad_token_id):
    """[policy 5] step 1: keep each response up to and including the first `truncate_token` found at
    position >= truncate_after; replace everything after it with pad (OAI: "central example: replace
    all tokens after the truncate token with the pad token"). Responses without such a token are
    returned unchanged."""
    is_trunc = responses == truncate_token_id
    is_trunc[:, :truncate_after] = False  # the token only counts from position truncate_after on
    after_first = (is_trunc.cumsum(1) - is_trunc.long()) > 0  # strictly after the first match
    return torch.masked_fill(responses, after_first, pad_token_id)


def penalise_untruncated(
    scores, postprocessed_responses, truncate_token_id, truncate_after, penalty
):
    """[policy 5] step 3: a response with no truncate token at or after truncate_after gets the
    fixed penalty (-1) instead of the reward model's score (OAI: "only query humans on responses
    that pass that filter")."""
    has_token = (postprocessed_responses[:, truncate_after:] == truncate_token_id).any(dim=1)
    return torch.where(has_token, scores, torch.full_like(scores, penalty))


def banned_vocab_mask(vocab_size, pad_token_id, device):
    """OAI's pad is outside the vocabulary, so it is never sampled. A pad id inside the vocabulary
    (the tiny tokenizer) is banned from every logprob and from sampling (sample_fixed_length's
    banned_token), so the same holds: the logprobs sum over exactly what generate() can sample. None
    when nothing is banned."""
    if pad_token_id >= vocab_size:
        return None
    banned = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    banned[pad_token_id] = True
    return banned


def whiten(values, shift_mean=True, group_size=0):
    """[policy 9] OAI's whiten with tf.nn.moments semantics: (x - mean) / sqrt(var + 1e-8) with the
    BIASED variance (/N, not torch.var's /(N-1)); shift_mean=False adds the mean back. Every
    response token is valid (all-ones mask). group_size > 0: rows [0, g), [g, 2g), ... are whitened
    separately, as each OpenAI rank whitened its own rollouts (utils.whiten inside PPOTrainer.loss);
    0 = all rows."""
    group_size = group_size or values.shape[0]
    return torch.cat(
        [
            corrections.masked_whiten(
                chunk, torch.ones_like(chunk), shift_mean=shift_mean, unbiased=False
            )
            for chunk in values.split(group_size)
        ]
    )


def compute_gae(rewards, values, gamma, lam):
    """GAE over the response tokens: delta_t = r_t + gamma V_{t+1} - V_t (V after the last token =
    0), A_t = delta_t + gamma lam A_{t+1}; returns = A + V. gamma = 1 in the original ([policy
    6])."""
    T = rewards.shape[1]
    lastgaelam = torch.zeros_like(rewards[:, 0])
    advantages_reversed = []
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else torch.zeros_like(values[:, t])
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def clipped_value_loss(vpred, values, returns, cliprange_value):
    """[policy 10] value clipping as in PPO2 / OAI train_policy.py: the new value may move at most
    cliprange_value from the rollout value; the loss is the max of the clipped and unclipped squared
    errors. Returns (vf_loss, vf_clipfrac, vf_losses1)."""
    vpredclipped = torch.clamp(vpred, values - cliprange_value, values + cliprange_value)
    vf_losses1 = torch.square(vpred - returns)
    vf_losses2 = torch.square(vpredclipped - returns)
    vf_loss = 0.5 * torch.max(vf_losses1, vf_losses2).mean()
    vf_clipfrac = (vf_losses2 > vf_losses1).float().mean()
    return vf_loss, vf_clipfrac, vf_losses1


def response_hidden(lm, query_responses, context_length, pad_token_id):
    """The backbone's last hidden states (B, R, H) at the response positions, from a forward with
    our masking and position ids ([general 3]): position t predicts response token t, so
    [context_length - 1, -1) of query_response."""
    # OpenAI's position ids (rewards.forward_inputs): the exclusive cumsum of the mask, pads -> id 0
    inputs = rewards.forward_inputs(query_responses, query_responses != pad_token_id)
    out = logprobs.backbone_output(lm, **inputs, use_cache=False)
    return out.last_hidden_state[:, context_length - 1 : -1]


class PolicyAndValue(nn.Module):
    """The policy LM and a scalar value head on the SAME backbone, as OAI's policy.py and [repro]'s
    AutoModelForCausalLMWithScalarHead (one transformer, two heads). forward returns the response
    hidden states (B, R, H) and values (B, R) ([general 1]: the value head sees query + response);
    the LM head is applied later, in chunks and in float32 (logprobs_from_hidden): no (B, L, V)
    logits, and none in bf16."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.hidden_size, 1)
        # [policy 2]: value head weights ~ N(0, 0) and bias 0, i.e. the value starts at exactly 0
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, query_responses, context_length, pad_token_id):
        hidden = response_hidden(self.lm, query_responses, context_length, pad_token_id)
        # the value head in fp32, autocast off
        values = logprobs.fp32_project(self.value_head, hidden).squeeze(-1)
        return hidden, values


def logprobs_from_hidden(lm, hidden, tokens, log_pi):
    """(logprobs, entropy), each (B, R), of `tokens` from response hidden states, logits / T
    ([policy 1]): logprobs.token_logprobs_and_entropy with the LM head, in chunks of
    log_pi.chunk_size rows (B x R), recomputed in backward, so no float32 (B, R, V) log-softmax
    exists; the LM head, log-softmax and entropy in float32 with autocast off: a bf16 LM head
    rounds gpt2's logits (30-130) by up to 0.25, ~0.1 nats of logprob error that would inflate
    approxkl, clipfrac and the KL reward (tests/test_grpo.py measures it). log_pi: the run's
    logprobs.LogprobSettings (temperature, chunk size, the banned pad token). The entropy carries
    no gradient (a metric here)."""
    B, R, H = hidden.shape
    token_logprobs, entropy = logprobs.token_logprobs_and_entropy(
        hidden.reshape(B * R, H),
        tokens.reshape(B * R),
        lm.get_output_embeddings(),
        log_pi,
    )
    return token_logprobs.reshape(B, R), entropy.reshape(B, R)


def reference_logprobs(
    lm, ref_policy, query_response, response, context_length, pad_token_id, log_pi
):
    """log pi_ref (b, R) of the response tokens: the frozen reference policy, or with --lora-rank
    the policy's own LM with its adapter switched off (the base is the initial policy: no second
    model in memory, as grpo.py's reference_logprobs)."""
    if ref_policy is not None:
        hidden = response_hidden(ref_policy, query_response, context_length, pad_token_id)
        return logprobs_from_hidden(ref_policy, hidden, response, log_pi)[0]
    with lora.adapter_disabled(lm):
        hidden = response_hidden(lm, query_response, context_length, pad_token_id)
        return logprobs_from_hidden(lm, hidden, response, log_pi)[0]


def forward_and_score(
    model, ref_policy, reward_model, raw_queries, queries, responses, args, micro, tokens, log_pi
):
    """Steps 3b-3e of train(), no gradient, in micro-batches to bound memory: (policy_logprobs,
    ref_logprobs, values, scores, postprocessed responses), each (B, R) except the scores (B,);
    log pi with the run's settings (log_pi)."""
    context_length = queries.shape[1]
    policy_logprobs, ref_logprobs, values, scores, postprocessed = [], [], [], [], []
    for start in range(0, queries.shape[0], micro):
        query = queries[start : start + micro]
        response = responses[start : start + micro]
        # [general 1]: query + response is the input of every forward
        query_response = torch.cat([query, response], dim=1)
        # 3b. policy logprobs and values, reference logprobs (logits / T: [policy 1]; heads in fp32)
        hidden, value = model(query_response, context_length, tokens.pad)
        policy_logprobs.append(logprobs_from_hidden(model.lm, hidden, response, log_pi)[0])
        values.append(value)
        del hidden
        ref_logprobs.append(
            reference_logprobs(
                model.lm, ref_policy, query_response, response, context_length, tokens.pad, log_pi
            )
        )
        # 3c. truncate at the first "." at or after position truncate_after, pad the tail
        #     ([policy 5])
        truncated = truncate_responses(response, tokens.truncate, args.truncate_after, tokens.pad)
        # 3d. the reward model scores the RAW query (no prefix/suffix, as OpenAI's score_fn) + the
        #     TRUNCATED response at the last position ([reward 1]), its pads moved left first; PPO
        #     trains on the untruncated response. The score is normalised ([reward 3]).
        raw_query = raw_queries[start : start + micro]
        scored = rewards.left_pad(torch.cat([raw_query, truncated], dim=1), tokens.pad)
        score = reward_model(scored, scored != tokens.pad).float().flatten()
        # 3e. no "." after truncate_after: the fixed penalty -1 instead of the score ([policy 5])
        score = penalise_untruncated(
            score, truncated, tokens.truncate, args.truncate_after, args.penalty_reward_value
        )
        scores.append(score)
        postprocessed.append(truncated)
    cat = torch.cat
    return cat(policy_logprobs), cat(ref_logprobs), cat(values), cat(scores), cat(postprocessed)


# ==================================================================================================
# Models, data, checkpoints, metrics (plumbing around the algorithm: a first read can skip this
# section)
# ==================================================================================================


def load_policy(path, device="cpu"):
    """An HF causal LM in float32 with dropout off ([policy 4]) that samples through EOS ([general
    4]: rollout.never_stop_at_eos), on `device`."""
    from transformers import AutoModelForCausalLM

    # a crafted pickle or diverged weights in the folder end the run in one line
    lm = harness.load_model_folder(
        functools.partial(AutoModelForCausalLM.from_pretrained, dtype=torch.float32), path
    )
    # [policy 4] no dropout (rewards.py's helper also resets the config)
    rewards.disable_dropout(lm)
    rollout.never_stop_at_eos(lm)
    return lm.to(device)


def load_tokenizer(path):
    """[general 2]: a distinct [PAD] token, never EOS. gpt2 has none, so we add "[PAD]" (id 50257,
    outside gpt2's 50257-row embedding, like OAI's out-of-vocabulary pad: rewards.forward_inputs
    replaces it by 0 before every forward)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return tokenizer


def reward_model_paths(args, resume=None):
    """(reward model dir, policy path: --base-model, or the tiny policy rewards.py saved next to the
    reward model). With no --reward-model-path, rewards.train trains one first on every rank (it is
    torchrun-aware), once per settings, into <output_dir>/reward_model_run, whose built_with.json
    records the preset, the seed and its files' hashes; the reward model is always that folder's
    reward_model/ (derived, never read back from a file). A resume reuses it (check_inputs then
    holds it to the checkpoint's); a fresh start with another preset or seed, or one that finds
    its files changed, trains it again (never another experiment's reward model)."""
    rm_path = args.reward_model_path
    if rm_path is None:
        rm_run = os.path.join(args.output_dir, "reward_model_run")
        settings = {"reward_preset": args.reward_preset, "seed": args.seed}
        if not resume and harness.built_with(rm_run) != settings:
            train_reward_model(args, rm_run, settings)
        rm_path = os.path.join(rm_run, "reward_model")
    policy_path = args.base_model or os.path.join(
        os.path.dirname(os.path.normpath(rm_path)), "tiny_policy"
    )
    return rm_path, policy_path


def train_reward_model(args, rm_run, settings):
    """rewards.train for this run, on every rank, into a new <rm_run>.tmp that rank 0 marks with
    the settings and swaps in for rm_run once every rank is done: a run stopped mid-way leaves the
    previous reward model run whole under its own mark (the reward model trained in the .tmp
    folder records that folder as its output_dir). The reward model gets the policy's seed, as
    lm-human-preference-details' train_both script, so a seed sweep varies it too (launch.py pinned
    run.seed 1 for both)."""
    tmp = rm_run + ".tmp"
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        harness.remove_path(tmp)
    harness.barrier()
    preset = rewards.PRESETS[args.reward_preset][1]
    rewards.train(
        dataclasses.replace(preset, output_dir=tmp, seed=args.seed, sharding=args.sharding)
    )
    # a sharded model is freed by the cycle collector: before this run loads its own
    gc.collect()
    harness.barrier()
    if rank == 0:
        harness.mark_built(tmp, settings)
        harness.swap_in(tmp, rm_run)
    harness.barrier()


def pinned_inputs(args, rm_path, policy_path, resume):
    """What the run loads from outside its checkpoint (the reward model, the policy folder or Hub
    name the tokenizer and the reference come from, a local query file), pinned by
    harness.input_digests: recorded in every checkpoint and in args.json (which so names the reward
    model used), and on a resume checked against the checkpoint's (harness.check_inputs)."""
    generated = args.query_dataset in ("tiny", "openers")
    inputs = harness.input_digests(
        {
            "reward model": rm_path,
            "policy": policy_path,
            "queries": None if generated else args.query_dataset,
        }
    )
    harness.check_inputs(resume, inputs, args)
    return inputs


def query_batches(args, tokenizer, seed, local_batch, start_update, rank=0, world_size=1):
    """Per-rank (B, query_length) left-padded RAW query batches for updates start_update,
    start_update + 1, ... (the reward model scores these; the policy sees them with prefix/suffix,
    rewards.format_queries). tiny/openers: drawn from the rank's seed. Datasets, as the original
    (language/datasets.py): shuffled once with the seed shared by all ranks and sharded by rank
    (rewards.query_texts), trimmed by start_text/end_text. A resume at update u replays the stream
    to the same position: the batches of an uninterrupted run."""
    if args.query_dataset in ("tiny", "openers"):
        make_queries = (
            tasks.tiny_queries if args.query_dataset == "tiny" else tasks.sentiment_queries
        )
        update = start_update
        while True:
            texts = make_queries(local_batch, seed=seed * 1_000_003 + update)
            token_lists = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
            yield left_pad_queries(token_lists, args.query_length, tokenizer.pad_token_id)
            update += 1
    # [policy 3]: bookcorpus is already sentence-split, so [repro] uses start_text=end_text=None: no
    # "." trimming (our default); OpenAI's books task trimmed at "." (--start-text . --end-text .).
    texts = rewards.query_texts(args.query_dataset, args.seed, seed, rank, world_size)
    start_token = rewards.single_token_id(tokenizer, args.start_text)
    end_token = rewards.single_token_id(tokenizer, args.end_text)
    update = 1
    while True:
        batch = rewards.query_token_batch(
            texts, tokenizer, local_batch, args.query_length, start_token, end_token
        )
        if update >= start_update:
            yield batch
        update += 1


def save(args, rank, model, tokenizer, optimizer, update, global_step, kl_coef, inputs):
    """Step 11: <output_dir>/checkpoint with the HF policy + tokenizer, value_head.pt, and the
    update, episodes, beta and optimizer (harness.py adds every rank's RNG and the pinned inputs,
    and swaps it in atomically). --sharding fsdp2: the policy gathered whole onto rank 0 for the HF
    files, the optimizer state saved by each rank, its own shard. --lora-rank: the adapter in
    peft's format instead of the policy (its base is pinned)."""
    if args.lora_rank:  # the adapter alone, in peft's format (the base is pinned)
        weights = lora.adapter_weights(model.lm)  # gathered under FSDP2: every rank takes part
    else:
        weights = harness.full_state_dict(model.lm)  # None unless sharded: every rank takes part

    def write_files(folder):
        if args.lora_rank:
            lora.save_adapter(folder, model.lm, weights)
        else:
            model.lm.save_pretrained(folder, state_dict=weights)
        tokenizer.save_pretrained(folder)
        harness.save_plain(model.value_head.state_dict(), os.path.join(folder, "value_head.pt"))

    state = dict(
        step=update, global_step=global_step, kl_coef=kl_coef, args=dataclasses.asdict(args)
    )
    shard = None
    if harness.is_sharded(model.lm):
        shard = harness.local_optimizer_state(optimizer)
    else:
        state["optimizer"] = optimizer.state_dict()
    harness.save_checkpoint(args.output_dir, rank, write_files, state, args, inputs, shard)


def rollout_metrics(args, stats, extra_stats, corr_metrics, tensors, tokenizer, tokens, world_size):
    """Step 9's metrics under [repro]'s names, averaged over the ranks: the rollout's (objective/*),
    the PPO epochs' (ppo/*; `stats` holds one tensor per micro-batch, the mean and the last are
    logged as [repro] does) and the correction's (rollout_corr/*, training/*)."""
    kl, non_score_reward, scores = tensors["kl"], tensors["non_score_reward"], tensors["scores"]
    logprobs, values, returns = tensors["logprobs"], tensors["values"], tensors["returns"]
    advantages, postprocessed = tensors["advantages"], tensors["postprocessed"]
    responses, pad_id = tensors["responses"], tokens.pad
    truncated = postprocessed[:, args.truncate_after :] == tokens.truncate
    eos_id = tokenizer.eos_token_id
    local = {
        "objective/kl": kl.sum(1).mean(),
        "objective/entropy": (-logprobs).sum(1).mean(),  # sampled-token estimate, as [repro]
        "objective/non_score_reward": non_score_reward.sum(1).mean(),
        "objective/score_total": non_score_reward.sum(1).mean() + scores.mean(),
        "objective/scores": scores.mean(),
        "objective/scores_std": scores.std(),
        "objective/truncated_frac": truncated.any(1).float().mean(),
        "ppo/policy/approxkl_avg": torch.stack(stats["approxkl"]).mean(),
        "ppo/policy/clipfrac_avg": torch.stack(stats["clipfrac"]).float().mean(),
        "ppo/policy/entropy_avg": torch.stack(stats["entropy"]).mean(),
        "ppo/loss/policy_avg": torch.stack(stats["pg_loss"]).mean(),
        "ppo/loss/value_avg": torch.stack(stats["vf_loss"]).mean(),
        "ppo/val/clipfrac_avg": torch.stack(stats["vf_clipfrac"]).mean(),
        # point metrics of the last micro-batch, as [repro]
        "ppo/loss/policy": stats["pg_loss"][-1],
        "ppo/loss/value": stats["vf_loss"][-1],
        "ppo/loss/total": stats["loss"][-1],
        "ppo/policy/approxkl": stats["approxkl"][-1],
        "ppo/policy/clipfrac": stats["clipfrac"][-1].float(),
        "ppo/policy/entropy": stats["entropy"][-1],
        "ppo/returns/mean": returns.mean(),
        "ppo/returns/var": returns.var(),
        "ppo/val/vpred": stats["vpred"][-1],
        "ppo/val/error": stats["vf_error"][-1],
        "ppo/val/clipfrac": stats["vf_clipfrac"][-1],
        "ppo/val/mean": values.mean(),
        "ppo/val/var": values.var(),
        "ppo/val/ratio": stats["ratio"][-1],
        "ppo/val/advantage": advantages.mean(),
        "ppo/val/num_eos_tokens": (responses == eos_id).sum().float()
        if eos_id is not None
        else 0.0,
    }
    if rewards.PRESETS[args.reward_preset][1].label_source == "lexicon":
        # ours, not OpenAI's (their labellers were people): the programmatic labeller's own score of
        # the (truncated) responses, so a reader sees whether what the reward model rewards is what
        # it imitates
        texts = tokenizer.batch_decode(
            [p[p != pad_id] for p in postprocessed], skip_special_tokens=True
        )
        local["objective/lexicon_score"] = float(
            np.mean([tasks.lexicon_sentiment_score(t) for t in texts])
        )
    for name, values_list in extra_stats.items():
        local[f"ppo/policy/{name}"] = float(np.mean(values_list))
    # rollout_corr/*, training/*: once per batch (decoupled) or bypass's first
    local.update(corr_metrics)
    # every value as float32, as [repro] logs them; then the mean over ranks (max / min for *_max /
    # *_min)
    local = {
        name: torch.as_tensor(value, dtype=torch.float32).item() for name, value in local.items()
    }
    metrics = harness.reduce_metrics(local, world_size)
    # [repro]: variance of the per-micro-batch mean ratios (all epochs, all ranks; unbiased), and
    # the variance of the advantage means of each whitening group (each rank, in [repro]; unbiased);
    # 0.0 for a single value
    ratio_means = harness.all_gather_cat(torch.stack(stats["ratio"]).float())
    metrics["ppo/val/ratio_var"] = ratio_means.var().item() if ratio_means.numel() > 1 else 0.0
    group = args.whiten_group_size or advantages.shape[0]
    group_means = advantages.reshape(-1, group, advantages.shape[1]).mean((1, 2)).float()
    group_means = harness.all_gather_cat(group_means)
    metrics["ppo/val/advantage_var"] = group_means.var().item() if group_means.numel() > 1 else 0.0
    # OAI train_policy.py: var_explained = 1 - error / returns var, from the rank-averaged error
    # (mean over every PPO step) and the per-rank population variance of the returns (tf.nn.moments)
    error_var = torch.stack([torch.stack(stats["vf_error"]).mean(), returns.var(unbiased=False)])
    error_var = harness.all_sum(error_var) / world_size
    metrics["ppo/val/var_explained"] = 1.0 - (error_var[0] / error_var[1]).item()
    return metrics


def sample_rows(update, tokenizer, queries, postprocessed, scores, kl, n):
    """Step 10, [repro]'s sample table: query, (truncated) response, score and summed KL of the
    first n rollouts of rank 0."""
    pad_id = tokenizer.pad_token_id
    rows = []
    for i in range(min(n, len(queries))):
        rows.append(
            dict(
                step=update,
                query=tokenizer.decode(queries[i][queries[i] != pad_id]),
                response=tokenizer.decode(postprocessed[i][postprocessed[i] != pad_id]),
                score=float(scores[i]),
                kl=float(kl[i].sum()),
            )
        )
    return rows


@dataclass
class Tokens:
    """The token ids a rollout needs: the pad ([general 2]), the truncate token ([policy 5]), the
    query prefix and suffix (lm_tasks.py query_formatter), and the vocabulary the sampler can never
    emit (banned_vocab_mask; None when nothing is banned)."""

    pad: int
    truncate: int
    prefix: list
    suffix: list
    banned: Optional[torch.Tensor]


def load_models(args, rm_path, policy_path, resume, device, rank, world_size):
    """Step 1's models: (tokenizer, Tokens, the run's logprobs.LogprobSettings, reward model, frozen
    reference policy, policy + value head). The reward model is normalised ([reward 3]); all three
    run without dropout ([policy 4]). The policy's weights come from the checkpoint when
    resuming."""
    tokenizer = load_tokenizer(policy_path)
    truncate_ids = tokenizer.encode(args.truncate_token, add_special_tokens=False)
    if len(truncate_ids) != 1:
        raise ValueError(
            f"--truncate-token {args.truncate_token!r} must be a single token, got {truncate_ids}"
        )
    shards = (args.sharding, device, rank, world_size)
    reward_model = rewards.load_reward_model(rm_path, device, args.sharding, rank, world_size)
    reward_model = rewards.disable_dropout(reward_model).to(device).eval()

    def build_reference():
        # frozen before its linears go bf16 (a trainable bf16 weight is refused by FSDP2's sharding)
        ref_policy = load_policy(policy_path).eval().requires_grad_(False)
        # under bf16 autocast: the same logprobs, half the memory
        if logprobs.resolve_precision(args.precision, device) == "bf16":
            logprobs.bf16_frozen_linears_(ref_policy)
        return ref_policy

    def build_policy():
        if not args.lora_rank:
            return load_policy(resume or policy_path)
        # LoRA: the base from policy_path, the adapter (and only the adapter) from the checkpoint;
        # under bf16 autocast the frozen base's linears in bf16 (the same forward, half the bytes)
        lm = lora.add_adapter(
            load_policy(policy_path),
            args.lora_rank,
            args.lora_alpha,
            args.lora_target_modules,
            args.seed,
        )
        if resume:
            lora.load_adapter(lm, resume)
        if logprobs.resolve_precision(args.precision, device) == "bf16":
            logprobs.bf16_frozen_linears_(lm)
        return lm

    # --sharding fsdp2: each rank keeps its shard of the three LMs (harness.build_sharded); the
    # value head and the reward model's head stay whole on every rank. LoRA: no reference model
    ref_policy = None
    if not args.lora_rank:
        ref_policy = harness.build_sharded(build_reference, *shards)
    lm = harness.build_sharded(build_policy, *shards)
    model = PolicyAndValue(lm).to(device).eval()
    reward_model.requires_grad_(False)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False) if text else []

    tokens = Tokens(
        pad=tokenizer.pad_token_id,
        truncate=truncate_ids[0],  # "." is id 13 in gpt2 ([repro] truncate_token=13)
        prefix=encode(args.query_prefix),
        suffix=encode(args.query_suffix),
        banned=banned_vocab_mask(model.lm.config.vocab_size, tokenizer.pad_token_id, device),
    )
    # every log pi of the run: logits / T ([policy 1]), in chunks, never the pad token
    log_pi = logprobs.LogprobSettings(
        temperature=args.temperature,
        chunk_size=args.logprob_chunk_rows,
        precision=args.precision,
        banned=tokens.banned,
    )
    return tokenizer, tokens, log_pi, reward_model, ref_policy, model


def load_checkpoint(resume, rank, model, optimizer, args):
    """Resume from a checkpoint (the policy's weights are loaded with the model): the value head,
    the optimizer and this rank's RNG; returns (kl_coef, first update, episodes so far). A
    checkpoint of the last update whose final policy was not written (a full disk at step 12)
    resumes to write it; one already at or past --total-episodes' last update with its final
    policy written is refused in one line: nothing to train."""
    state = harness.load_checkpoint(resume, rank)
    value_head_path = os.path.join(resume, "value_head.pt")
    try:
        model.value_head.load_state_dict(harness.load_plain(value_head_path))
    except (RuntimeError, KeyError, AttributeError) as error:  # other names or shapes, no dict
        reason = harness.first_line(error, 120)
        raise harness.RunError(f"{value_head_path}: not this policy's value head ({reason})")
    if "shard" in state:  # FSDP2: this rank's shard of the optimizer state
        harness.load_local_optimizer_state(optimizer, state["shard"])
    else:
        optimizer.load_state_dict(state["optimizer"])
    num_updates = args.total_episodes // args.rollout_batch_size
    final = [os.path.join(args.output_dir, "policy"), final_checksum_path(args, rank)]
    finished = all(os.path.exists(path) for path in final)
    if state["step"] > num_updates or (state["step"] == num_updates and finished):
        raise harness.RunError(
            f"{resume} is at update {state['step']} and --total-episodes {args.total_episodes} "
            f"makes {num_updates}: nothing to train (raise --total-episodes to continue it)"
        )
    if rank == 0:
        print(
            f"resumed from {resume} at update {state['step'] + 1} (kl_coef {state['kl_coef']:.4f})"
        )
    return state["kl_coef"], state["step"] + 1, state["global_step"]


def print_sizes(world_size, sizes):
    """Step 1's line on rank 0: the per-rank batch sizes and the number of updates."""
    print(
        f"world_size {world_size}: per-rank batch {sizes['local_batch']}, "
        f"minibatch {sizes['local_mini']}, micro-batch {sizes['micro']}, "
        f"gradient accumulation {sizes['grad_accum']}, {sizes['num_updates']} updates"
    )


def print_update(metrics, update, num_updates, start_update, args, start_time):
    """One line per update on rank 0."""
    episodes_per_s = (
        (update - start_update + 1) * args.rollout_batch_size / (time.time() - start_time)
    )
    print(
        f"update {update}/{num_updates} episode {metrics['ppo/episode']} "
        f"score {metrics['objective/scores']:.3f} kl {metrics['objective/kl']:.3f} "
        f"beta {metrics['objective/kl_coef']:.4f} "
        f"approxkl {metrics['ppo/policy/approxkl_avg']:.4f} "
        f"clipfrac {metrics['ppo/policy/clipfrac_avg']:.3f} {episodes_per_s:.0f} episodes/s",
        flush=True,
    )


def save_final_policy(args, rank, model, tokenizer, kl_coef):
    """Step 12: the final policy in HF format (<output_dir>/policy, with value_head.pt; LoRA: the
    merged policy, the adapter being in the checkpoint), and a checksum of the parameters per rank
    (final_rank<r>.json: the 2-process test compares them; sharded weights gathered whole
    first)."""
    if args.lora_rank:
        # LoRA: W + (alpha / r) B A per adapted layer, out of place (gathered one weight at a time)
        merged = lora.merged_named_weights(model.lm)
        weights = {name: t.cpu() for name, t in merged if rank == 0}
    else:
        weights = harness.full_state_dict(model.lm)  # None unless sharded: every rank takes part
    if rank == 0:

        def write_files(folder):
            model.lm.save_pretrained(folder, state_dict=weights)
            tokenizer.save_pretrained(folder)
            harness.save_plain(model.value_head.state_dict(), os.path.join(folder, "value_head.pt"))

        harness.write_folder(os.path.join(args.output_dir, "policy"), write_files)
    checksum, abs_checksum = 0.0, 0.0
    with torch.no_grad():
        for p in model.parameters():  # one whole tensor at a time (a shard gathered in its turn)
            values = harness.whole(p).double()
            checksum += values.sum().item()
            abs_checksum += values.abs().sum().item()
    final = dict(rank=rank, checksum=checksum, abs_checksum=abs_checksum, kl_coef=kl_coef)
    harness.write_atomically(final_checksum_path(args, rank), json.dumps(final))
    harness.barrier()


def final_checksum_path(args, rank):
    """<output_dir>/final_rank<r>.json: this rank's parameter checksums at the end of the run."""
    return os.path.join(args.output_dir, f"final_rank{rank}.json")


# ==================================================================================================
# The PPO update (step 8): the objective of one micro-batch (ppo_loss), then the loop over epochs,
# minibatches and micro-batches
# ==================================================================================================


def ppo_loss(new_logprobs, vpred, micro_batch, args, correction, pg_info, num_micro_batches):
    """The PPO objective of one micro-batch, every term in this one frame (OpenAI's
    train_policy.py, [repro] train_policy_accelerate.py; the rollout correction as in grpo.py and
    verl). Per response token t, with r_t = pi_theta(a_t) / pi_old(a_t) and A_t from step 6:

        l_t     = max(-A_t r_t, -A_t clip(r_t, 1 - cliprange, 1 + cliprange))
                                                            (objectives.ppo_clip_token_loss)
        pg_loss = token-mean over M of (w_t l_t)   w: the correction's IS weights (none: w = 1),
                                                   M: the response tokens its rejection mask keeps
        vf_loss = 0.5 mean(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))   [policy 10]
        loss    = pg_loss + vf_coef vf_loss

    The KL to the reference policy is in the reward (step 4), not here. pg_loss is divided by the
    minibatch's valid tokens over all ranks (`pg_info`, see update_policy); vf_loss (every token
    valid, equal micro-batches) is a micro-batch mean, divided by the number of micro-batches.
    Bypass mode (pi_old = pi_rollout) weights and masks with this micro-batch's current logprobs,
    and its REINFORCE loss is l_t = -A_t log pi_theta(a_t).

    Returns (loss, (pg_loss, vf_loss, vf_clipfrac, vf_losses1), the policy loss's metrics, bypass
    mode's correction metrics).
    """
    old_logprobs = micro_batch["old_logprobs"]
    advantages = micro_batch["advantages"]
    # decoupled: step 7's RS/veto mask and IS weights pi_old / pi_rollout; "disabled": the response
    # mask and no weights (the original's PPO)
    pg_mask = micro_batch["pg_mask"]
    is_weights = micro_batch.get("is_weights")

    # The policy-gradient term per token: PPO's clipped surrogate of r = pi_theta / pi_old, clipped
    # to 1 +- eps; bypass mode (pi_old = pi_rollout) corrects against this micro-batch's pi_theta
    # in objectives.bypass_mode_loss (as grpo.py).
    corr_metrics = {}
    if not correction.bypass_mode:
        pg_losses, pg_metrics = objectives.ppo_clip_token_loss(
            new_logprobs, old_logprobs, advantages, pg_mask, args.cliprange, args.cliprange
        )
    else:
        pg_losses, pg_mask, is_weights, pg_metrics, corr_metrics = objectives.bypass_mode_loss(
            new_logprobs,
            old_logprobs,
            advantages,
            pg_mask,
            correction,
            args.cliprange,
            args.cliprange,
        )
    if is_weights is not None:  # the IS weights multiply the clipped term
        pg_losses = pg_losses * is_weights
    pg_loss = objectives.agg_loss(pg_losses, pg_mask, "token-mean", **pg_info)

    # [policy 10]: the value loss, the new value clipped around the rollout value
    vf_loss, vf_clipfrac, vf_losses1 = clipped_value_loss(
        vpred, micro_batch["values"], micro_batch["returns"], args.cliprange_value
    )
    # pg_loss is this micro-batch's share of the minibatch's loss already; the value loss is a
    # micro-batch mean, so it is divided by the number of micro-batches
    loss = pg_loss + args.vf_coef * vf_loss / num_micro_batches
    return loss, (pg_loss, vf_loss, vf_clipfrac, vf_losses1), pg_metrics, corr_metrics


def update_policy(
    model,
    optimizer,
    batch,
    correction,
    corr_metrics,
    args,
    sizes,
    world_size,
    tokens,
    log_pi,
    update=0,
):
    """Step 8 of train(), [policy 7]: `noptepochs` epochs over this rank's rollouts, each a fresh
    permutation cut into minibatches (one optimizer step each) cut into micro-batches (one
    forward/backward of ppo_loss each). `batch` holds the (B, ...) tensors of steps 3-7; `tokens`
    the pad id; log_pi the run's logprobs.LogprobSettings. Returns (stats: per-micro-batch tensors,
    extra: per-micro-batch floats of the clipped surrogate); in bypass mode the first micro-batch's
    rollout_corr/* and training/* go to corr_metrics. A non-finite loss stops the run (naming
    `update`) before the optimizer applies it.
    """
    stats, extra = {}, {}
    # one optimizer step per minibatch: the gradients averaged over ranks, not clipped (OpenAI's
    # train_policy.py clips nothing), applied
    optimizer_step = harness.OptimizerStep(optimizer, world_size)
    context_length = batch["query_responses"].shape[1] - batch["responses"].shape[1]
    autocast = logprobs.autocast_context(batch["responses"].device, args.precision)
    for _ in range(args.noptepochs):
        perm = np.random.permutation(sizes["local_batch"])
        perm = torch.from_numpy(perm).to(batch["responses"].device)
        for micro_batches in minibatch_schedule(perm, sizes["local_mini"], sizes["micro"]):
            # One loss normalisation for any micro-batch size or rank count (verl's
            # global_batch_info, as grpo.py): the policy loss / the minibatch's valid tokens over
            # all ranks (one all-reduce; not local_mini * R only when a rejection mask drops
            # tokens) x the world size, since the gradients are averaged over the ranks.
            pg_tokens = sum(batch["pg_mask"][mb].sum() for mb in micro_batches).double()
            pg_info = dict(dp_size=world_size, batch_num_tokens=float(harness.all_sum(pg_tokens)))
            minibatch_loss = 0.0
            for mb in micro_batches:
                micro_batch = {
                    name: batch[name][mb]
                    for name in ("old_logprobs", "advantages", "pg_mask", "values", "returns")
                }
                if batch["is_weights"] is not None:
                    micro_batch["is_weights"] = batch["is_weights"][mb]
                with autocast:
                    hidden, vpred = model(batch["query_responses"][mb], context_length, tokens.pad)
                    # [policy 1]: logits / T; the LM head in fp32
                    new_logprobs, new_entropy = logprobs_from_hidden(
                        model.lm, hidden, batch["responses"][mb], log_pi
                    )
                    loss, terms, pg_metrics, metrics = ppo_loss(
                        new_logprobs,
                        vpred,
                        micro_batch,
                        args,
                        correction,
                        pg_info,
                        len(micro_batches),
                    )
                    # bypass mode: the correction's metrics of the first micro-batch
                    for name, value in metrics.items():
                        corr_metrics.setdefault(name, value)
                    optimizer_step.backward(loss)
                minibatch_loss = minibatch_loss + loss.detach()
                pg_loss, vf_loss, vf_clipfrac, vf_losses1 = terms
                with torch.no_grad():
                    logprobs_diff = new_logprobs.detach() - batch["logprobs"][mb]
                    # pg_loss scaled back to this micro-batch's own token mean (exact when every
                    # token is valid: global tokens = world x micro-batches x own tokens)
                    pg_loss_micro = pg_loss.detach() * len(micro_batches)
                    micro_stats = dict(
                        approxkl=0.5 * (logprobs_diff**2).mean(),
                        clipfrac=torch.as_tensor(float(pg_metrics.get("pg_clipfrac", 0.0))),
                        pg_loss=pg_loss_micro,
                        vf_loss=vf_loss.detach(),
                        vf_clipfrac=vf_clipfrac,
                        loss=pg_loss_micro + args.vf_coef * vf_loss.detach(),
                        ratio=torch.exp(logprobs_diff).mean(),  # [repro] ratio_stats
                        vf_error=vf_losses1.detach().mean(),  # OAI's ppo/val/error, every step
                        vpred=vpred.detach().mean(),
                        entropy=new_entropy.mean(),
                    )
                    for name, value in micro_stats.items():
                        stats.setdefault(name, []).append(value)
                    for name, value in pg_metrics.items():  # ppo_kl, pg_clipfrac, pg_clipfrac_lower
                        extra.setdefault(name, []).append(float(value))
            # one check per minibatch (one device sync), before the optimizer applies it
            harness.check_finite("loss", float(minibatch_loss), update)
            optimizer_step.apply(update)
    return stats, extra


# ==================================================================================================
# train(): the loop, and the command line
# ==================================================================================================


def train(args: Args):
    # 1. setup: batch sizes (checked before any model loads), processes, seeds, the three models,
    #    the optimizer, a checkpoint to resume from, the logs
    sizes = harness.check_command_line(check_args, args)
    rank, world_size, device = harness.setup_distributed(args.cuda, args.sharding)
    local_batch, micro, num_updates = sizes["local_batch"], sizes["micro"], sizes["num_updates"]
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    autocast = logprobs.autocast_context(device, args.precision)
    # one run per output folder; a verified checkpoint of these settings (before any reward model)
    harness.lock_output_dir(args.output_dir, rank)
    resume = harness.checkpoint_to_resume(args)
    # trains a reward model first if none is given (or one built with other settings); what the
    # run loads from outside its checkpoint, pinned (a resume with other inputs is refused)
    rm_path, policy_path = reward_model_paths(args, resume)
    inputs = pinned_inputs(args, rm_path, policy_path, resume)
    seed = local_seed(args.seed, rank)  # [general 6] (after rewards.train, which seeds itself)
    harness.seed_everything(seed)
    # the models, and what every log pi of the run shares (logits / T, chunk size, banned pad)
    tokenizer, tokens, log_pi, reward_model, ref_policy, model = load_models(
        args, rm_path, policy_path, resume, device, rank, world_size
    )
    adam = AdamTF if args.optimizer == "adam_tf" else torch.optim.Adam  # [adam]: OAI used TF1's
    # the weights it trains: all of them, or with LoRA the adapter's A and B and the value head
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = adam(harness.parameter_groups(trained), lr=args.lr, eps=args.eps)
    kl_coef, start_update, global_step = args.kl_coef, 1, 0
    if resume:  # the policy's weights came from the checkpoint; the rest and this rank's RNG here
        kl_coef, start_update, global_step = load_checkpoint(resume, rank, model, optimizer, args)
    correction = corrections.RolloutCorrection.from_name(args.correction)
    batches = query_batches(args, tokenizer, seed, local_batch, start_update, rank, world_size)
    resume_update = start_update - 1 if resume else None
    log = harness.start_logs(args, "ppo_rlhf", rank, world_size, resume_update, inputs)
    if rank == 0:
        print_sizes(world_size, sizes)
    start_time = time.time()
    # SIGTERM / Ctrl-C from here on: the update in progress ends, is saved, and the run stops
    harness.catch_stop_signals()
    for update in range(start_update, num_updates + 1):
        global_step += args.rollout_batch_size
        # 2. anneal the learning rate linearly to 0 ([general 5])
        lrnow = linear_lr(update, num_updates, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lrnow

        # 3. rollout: sample fixed-length responses, score them, compute logprobs and values
        raw_queries = next(batches).to(device)  # (B, query_length), left-padded ([general 2])
        # the policy sees prefix + query + suffix (lm_tasks.py query_formatter; empty for books),
        # the reward model the raw query
        queries = rewards.format_queries(raw_queries, tokens.prefix, tokens.suffix, tokens.pad)
        with torch.no_grad(), autocast:
            # 3a. sample exactly response_length tokens ([general 4]: top_k 0, EOS does not stop,
            #     the pad is never sampled), with each token's logprob under the sampling
            #     distribution pi_rollout; the whole batch in one call, as the original (2 CPU
            #     cores: 6.8 s for 32 rows x 20 tokens, 2 x 5.1 s for 2 calls of 16)
            banned_token = None if tokens.banned is None else tokens.pad
            responses, rollout_logprobs = rollout.sample_fixed_length(
                model.lm,
                queries,
                tokens.pad,
                args.response_length,
                args.temperature,
                banned_token,
                args.precision,
            )
            # 3b-3e. policy and reference logprobs, values, truncation, scores, in micro-batches
            policy_logprobs, ref_logprobs, values, scores, postprocessed = forward_and_score(
                model,
                ref_policy,
                reward_model,
                raw_queries,
                queries,
                responses,
                args,
                micro,
                tokens,
                log_pi,
            )

            # 4. rewards: per-token KL penalty, the score added at the last token ([policy 8])
            kl = policy_logprobs - ref_logprobs  # (B, R) log pi - log pi_ref of the sampled tokens
            non_score_reward = -kl_coef * kl
            rewards_t = non_score_reward.clone()
            rewards_t[:, -1] += scores

            # 5. whiten the rewards WITHOUT shifting the mean ([policy 9], biased variance), once
            #    per batch as [repro] (OpenAI: per minibatch, its one minibatch); each rank its own
            #    rollouts, in groups of whiten_group_size (64: one GPU does OpenAI's 8 ranks of 64)
            if args.whiten_rewards:
                rewards_t = whiten(rewards_t, shift_mean=False, group_size=args.whiten_group_size)

            # 6. GAE (gamma=1 [policy 6], lam=0.95), returns, then whitened advantages (mean
            #    shifted, [policy 9]), per whitening group as the rewards
            advantages, returns = compute_gae(rewards_t, values, args.gamma, args.lam)
            advantages = whiten(advantages, group_size=args.whiten_group_size)

            # 7. pi_old and the rollout correction (verl's, not in the original). Decoupled
            #    ("disabled" included): pi_old = the step-3b forward, corrected against pi_rollout
            #    once per batch (IS weights, RS/veto mask; "disabled": only its metrics). Bypass:
            #    pi_old = pi_rollout, corrected per micro-batch in ppo_loss. Fixed length: every
            #    response token is trained on.
            mask = torch.ones_like(policy_logprobs)
            old_logprobs, is_weights, pg_mask, corr_metrics = rollout_logprobs, None, mask, {}
            if not correction.bypass_mode:
                old_logprobs = policy_logprobs
                is_weights, pg_mask, corr_metrics = corrections.apply_rollout_correction(
                    old_logprobs, rollout_logprobs, mask, correction
                )

        # 8. PPO epochs: a fresh permutation each, minibatch = optimizer step, micro-batch =
        #    accumulation ([policy 7]); the clipped surrogate with the correction's weights and
        #    mask, and the clipped value loss
        batch = dict(
            query_responses=torch.cat([queries, responses], dim=1),
            responses=responses,
            logprobs=policy_logprobs,
            old_logprobs=old_logprobs,
            values=values,
            returns=returns,
            advantages=advantages,
            pg_mask=pg_mask,
            is_weights=is_weights,
        )
        stats, extra_stats = update_policy(
            model,
            optimizer,
            batch,
            correction,
            corr_metrics,
            args,
            sizes,
            world_size,
            tokens,
            log_pi,
            update,
        )

        # 9. metrics (averaged over ranks) and the adaptive KL controller
        with torch.no_grad():
            rollout_tensors = dict(
                kl=kl,
                non_score_reward=non_score_reward,
                scores=scores,
                logprobs=policy_logprobs,
                values=values,
                returns=returns,
                advantages=advantages,
                postprocessed=postprocessed,
                responses=responses,
            )
            metrics = rollout_metrics(
                args,
                stats,
                extra_stats,
                corr_metrics,
                rollout_tensors,
                tokenizer,
                tokens,
                world_size,
            )
        # [policy 11]: adapt beta with the KL averaged over ALL ranks. [repro] passed each rank's
        # own mean_kl, so the ranks' betas (and hence their rewards) drifted apart; the all-reduced
        # value keeps them equal.
        kl_coef_used = kl_coef
        if args.adaptive_kl:
            mean_kl = metrics["objective/kl"]
            kl_coef = adaptive_kl_update(
                kl_coef, mean_kl, args.rollout_batch_size, args.kl_target, args.kl_horizon
            )
        metrics["objective/kl_coef"] = kl_coef_used
        metrics["ppo/lr"] = lrnow
        metrics["ppo/episode"] = global_step
        metrics["step"] = update
        metrics["time/elapsed_s"] = time.time() - start_time
        log.metrics(metrics)
        if rank == 0:
            print_update(metrics, update, num_updates, start_update, args, start_time)

        # 10. a sample table: query, (truncated) response, score, kl
        if args.log_samples_every and (update % args.log_samples_every == 0 or update == 1):
            rows = sample_rows(
                update, tokenizer, queries, postprocessed, scores, kl, args.num_log_samples
            )
            log.samples(rows)

        # 11. checkpoint (HF policy + value head + optimizer + kl_coef + RNG) every save_every
        #     updates, at the end, and when SIGTERM or SIGINT asks the run to stop
        stop_signal = harness.stop_signal(world_size)
        last = update == num_updates
        if (args.save_every and update % args.save_every == 0) or last or stop_signal:
            save(args, rank, model, tokenizer, optimizer, update, global_step, kl_coef, inputs)
        if stop_signal and not last:
            raise harness.stopped(stop_signal, update, args.output_dir)

    # 12. the final policy in HF format, and a checksum per rank (the 2-process test compares them)
    save_final_policy(args, rank, model, tokenizer, kl_coef)
    log.close()
    harness.end_processes(world_size, args.sharding)
    return args.output_dir


# ==================================================================================================
# Presets (each a paper-faithful or an offline run, with where its settings come from) and the
# command line
# ==================================================================================================

PRESETS = {
    # Offline CPU: rewards.py's tiny reward model, then PPO on the tiny random-init gpt2-arch policy
    # it saves; query 8 / response 16 as that preset; KL target 4 = 6 nats per 24 tokens scaled to
    # 16; horizon 1000 so beta can move within 120 updates of 64 (the original: 1953 of 512); lr
    # 3e-4 for a small random-init policy (gpt2: 1e-5).
    "tiny": (
        "offline CPU run on the tiny synthetic task (minutes on 2 cores)",
        Args(
            exp_name="ppo_rlhf_tiny",
            base_model="",
            reward_preset="tiny",
            query_dataset="tiny",
            query_length=8,
            response_length=16,
            truncate_after=8,
            temperature=0.7,
            total_episodes=64 * 120,
            rollout_batch_size=64,
            local_micro_batch_size=64,
            noptepochs=4,
            lr=3e-4,
            kl_coef=0.15,
            kl_target=4.0,
            kl_horizon=1000,
            log_samples_every=20,
            save_every=50,
            precision="fp32",
            torch_threads=1,
        ),
    ),
    # Ziegler et al. (2019) stylistic continuation, launch.py settings as reproduced by [repro]:
    # gpt2 (124M), query 64, response 24, truncate "." after 16, penalty -1, T=0.7, 512 rollouts x
    # 1M episodes, lr 1e-5, beta 0.15 adaptive (target 6, horizon 10000), 4 epochs, 1 minibatch,
    # gamma 1, lambda 0.95, cliprange 0.2, cliprange_value 0.2, vf_coef 0.1; whitening in groups of
    # 64 rollouts (each of OpenAI's 8 ranks whitened its own 64).
    "gpt2_sentiment": (
        "gpt2 sentiment (Ziegler et al. 2019; published: score ~1.8, KL ~6, beta ~0.25 at 1M "
        "episodes)",
        Args(
            exp_name="ppo_rlhf_gpt2_sentiment", reward_preset="gpt2_sentiment", whiten_group_size=64
        ),
    ),
    "gpt2_descriptiveness": (
        "gpt2 descriptiveness (Ziegler et al. 2019; published: score ~2.3, KL ~6, beta ~0.33 at 1M "
        "episodes)",
        Args(
            exp_name="ppo_rlhf_gpt2_descriptiveness",
            reward_preset="gpt2_descriptiveness",
            whiten_group_size=64,
        ),
    ),
    # OpenAI's TL;DR summarisation (launch.py summarize_tldr_task + get_experiments()["tldr"]):
    # query = the first 500 tokens of a post + "\n\nTL;DR:" (the reward model sees the post without
    # the suffix), response 75 tokens, truncated at the first "\n" (gpt2 id 198) from token 55 on,
    # T=0.7; a FIXED KL coefficient 0.03 ("0.01 too low"; adaptive KL commented out), no reward
    # whitening (launch.py binds `rewards.whiten`, a field its RewardHParams lacks, so the config as
    # written fails its type lookup: read as ppo.whiten_rewards=False, the field that exists),
    # rollout batch 32 (4 per rank on 8 GPUs, hence advantage whitening in groups of 4),
    # lr 2e-6, 1M episodes; the reward model is rewards.py's gpt2_tldr.
    "gpt2_tldr": (
        "gpt2 TL;DR summarisation (lm-human-preferences launch.py tldr; not run here, see "
        "docs/ppo_rlhf.md)",
        Args(
            exp_name="ppo_rlhf_gpt2_tldr",
            reward_preset="gpt2_tldr",
            query_dataset="tldr",
            query_length=500,
            response_length=75,
            query_suffix="\n\nTL;DR:",
            truncate_token="\n",
            truncate_after=55,
            temperature=0.7,
            total_episodes=1_000_000,
            rollout_batch_size=32,
            local_micro_batch_size=16,
            lr=2e-6,
            kl_coef=0.03,
            adaptive_kl=False,
            whiten_rewards=False,
            whiten_group_size=4,
        ),
    ),
    # The sentiment pipeline on a real model, offline: SmolLM2-135M-Instruct (Q4_1 de-quantised to
    # fp32) continuing raw template openers (no chat template, as the original task); reward model:
    # rewards.py smol_sentiment (lexicon best-of-4 labels). Every detail is the original's, scaled:
    # query 14 / response 20 / truncate after 10 (books: 64 / 24 / 16), 20 updates of 32, KL target
    # 6 (books': 6), horizon 256 so beta moves within 20 updates (books: 10000); lr 2.5e-5, 2
    # minibatches (books: 1e-5, 1) so 640 episodes move the policy. Why: docs/ppo_rlhf.md.
    "smol_sentiment": (
        "offline CPU: SmolLM2-135M-Instruct (Q4_1 de-quantised), sentiment from a lexicon "
        "labeller (sized for 30 min)",
        Args(
            exp_name="ppo_rlhf_smol_sentiment",
            output_dir="runs/ppo_smol_sentiment",
            base_model=tasks.SMOLLM2_PATH,
            reward_preset="smol_sentiment",
            query_dataset="openers",
            query_length=14,
            response_length=20,
            truncate_after=10,
            temperature=0.7,
            total_episodes=32 * 20,
            rollout_batch_size=32,
            nminibatches=2,
            local_micro_batch_size=32,
            noptepochs=4,
            lr=2.5e-5,
            kl_coef=0.15,
            kl_target=6.0,
            kl_horizon=256,
            log_samples_every=4,
            save_every=0,
            precision="fp32",
        ),
    ),
}

# gpt2_tldr's task at 6B with the PPO settings of the N+ paper's 6.9B run ("The N+ Implementation
# Details of RLHF with PPO", Huang et al. 2024; summarize_from_feedback_details
# ppo_left_padding6b.sbatch and ppo_left_padding.py): lr 3e-6, 512 rollouts per update (8 GPUs x
# 64), one minibatch, 4 epochs, a fixed KL coefficient 0.05, rewards whitened. The policy is
# GPT-J-6B, not Pythia 6.9B: OpenAI's TL;DR labels and queries are GPT-2 token ids, and GPT-J's
# tokenizer is GPT-2's (Pythia's is not). Its weights, gradients and Adam state (97 GiB) fit 8 GPUs
# of 80 GiB only sharded (scripts/plan_memory.py).
PRESETS["gptj6b_tldr"] = (
    "GPT-J-6B TL;DR summarisation (8 GPUs of 80 GiB, --sharding fsdp2; not run here)",
    dataclasses.replace(
        PRESETS["gpt2_tldr"][1],
        exp_name="ppo_rlhf_gptj6b_tldr",
        base_model="EleutherAI/gpt-j-6b",
        reward_preset="gptj6b_tldr",
        sharding="fsdp2",
        lr=3e-6,
        rollout_batch_size=512,
        local_micro_batch_size=4,
        kl_coef=0.05,
        whiten_rewards=True,
        whiten_group_size=64,
    ),
)
# gptj6b_tldr on one GPU of 80 GiB: the policy a rank-32 adapter (alpha 32) on every linear layer
# over a frozen bf16 base, the value head whole, no reference copy (the adapter switched off), the
# lr 10x the full run's ("LoRA Without Regret", Schulman et al. 2025). scripts/plan_memory.py: 49.6
# GiB, against 150 GiB for the full policy on one GPU.
PRESETS["gptj6b_tldr_lora"] = (
    "GPT-J-6B TL;DR summarisation with a LoRA policy (rank 32) on one GPU of 80 GiB; not run here",
    dataclasses.replace(
        PRESETS["gptj6b_tldr"][1],
        exp_name="ppo_rlhf_gptj6b_tldr_lora",
        sharding="ddp",
        lora_rank=32,
        lora_alpha=32.0,
        lr=3e-5,
    ),
)
# LoRA (lora.py): the tiny preset's policy trained as a rank-8 adapter (every linear layer), the
# value head whole; the lr 10x tiny's (Schulman et al. 2025, "LoRA Without Regret") with alpha 32.
PRESETS["tiny_lora"] = (
    "offline CPU run: the tiny task with a LoRA policy (rank 8, the lr 10x tiny's)",
    dataclasses.replace(
        PRESETS["tiny"][1], exp_name="ppo_rlhf_tiny_lora", lora_rank=8, lora_alpha=32.0, lr=3e-3
    ),
)


def main(argv=None):
    """The command line: a preset name and overrides (tyro); a bad flag is refused in one line (exit
    code 2) before any model loads, a fault during the run ends it in one line (exit code 1), and
    under torchrun a failing rank ends the job at once (harness.run)."""
    harness.run("ppo_rlhf.py", PRESETS, train, argv)


if __name__ == "__main__":
    main()
