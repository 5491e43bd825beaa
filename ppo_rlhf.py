"""RLHF with PPO, the OpenAI way: a one-file reproduction of openai/lm-human-preferences (Ziegler et al., 2019).

Read it top to bottom: `Args` -> helpers -> `train()` (numbered steps) -> `__main__`.

Every implementation detail is commented where it happens with a pointer into "The N Implementation Details of RLHF
with PPO" (Huang, Liu, von Werra, Hugging Face blog, 2023). The blog numbers its details per section; we cite them as
    [general N]  "General implementation details"        (1 query+response, 2 pad token, 3 position ids,
                                                           4 fixed-length sampling, 5 lr annealing, 6 per-rank seeds)
    [reward N]   "Reward model implementation details"   (1 last-token reward, 2 head init, 3 normalisation)
    [policy N]   "Policy training implementation details" (1 temperature, 2 value head init, 3 query text,
                                                           4 no dropout, 5 truncation/rejection, 6 gamma=1,
                                                           7 batch/minibatch loop, 8 per-token KL, 9 whitening,
                                                           10 value clipping, 11 adaptive KL)
    [adam]       "PyTorch Adam optimizer numerical issues w.r.t RLHF"
and the PyTorch reproduction as [repro] (vwxyzjn/lm-human-preference-details, train_policy_accelerate.py).

Run:
    python ppo_rlhf.py tiny --output-dir runs/ppo_tiny                       # offline CPU, whole pipeline, minutes
    python ppo_rlhf.py smol_sentiment --output-dir runs/ppo_smol    # offline CPU, SmolLM2-135M, real model
    torchrun --standalone --nproc_per_node 2 ppo_rlhf.py tiny --output-dir runs/ppo_tiny_ddp   # 2 CPU procs (gloo)
    torchrun --standalone --nproc_per_node 8 ppo_rlhf.py gpt2_sentiment --output-dir runs/sentiment  # the paper
"""

import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import tyro

import corrections
import rewards


@dataclass
class Args:
    # ---- run ----
    exp_name: str = "ppo_rlhf"
    """the name of this experiment (wandb run name prefix)"""
    seed: int = 1
    """base seed; rank r uses seed + r * 100003 ([general 6])"""
    output_dir: str = "runs/ppo_rlhf"
    """where metrics.jsonl, samples.jsonl, checkpoints/ and the final policy go"""
    track: bool = False
    """log to Weights and Biases (wandb is imported only then)"""
    wandb_project_name: str = "ppo_rlhf"
    """the wandb project"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team)"""
    cuda: bool = True
    """use CUDA when available"""
    bf16: bool = True
    """bf16 autocast for all forwards on CUDA (ignored on CPU, where everything is float32)"""
    torch_threads: int = 0
    """CPU threads per process (0 = torch's default); the tiny preset uses 1: its small matmuls gain nothing
    from more threads, and on a shared 2-core machine extra threads only spin (measured 13x slower forwards)"""

    # ---- models ----
    base_model: str = "gpt2"
    """the pretrained policy (HF hub name or path); empty = the tiny policy saved next to the reward model
    (`python rewards.py tiny` writes it to <reward model run>/tiny_policy)"""
    reward_model_path: Optional[str] = None
    """a reward model saved by rewards.py (`<run>/reward_model`); None = train one first with `reward_preset`"""
    reward_preset: str = "gpt2_sentiment"
    """the rewards.PRESETS entry trained (into <output_dir>/reward_model_run) when reward_model_path is None"""

    # ---- task ([repro] TaskHParams; OpenAI launch.py stylistic tasks) ----
    query_dataset: str = "books"
    """where queries come from (rewards.load_query_dataset): "books" = the Hub's bookcorpus Parquet files
    ([policy 3]), "tldr" = OpenAI's TL;DR posts, a path/URL/glob of .parquet/.json/.jsonl files with a "text" or
    "content" column, "tiny" = rewards.tiny_queries or "openers" = rewards.sentiment_queries (template sentence
    openers; both offline)"""
    query_length: int = 64
    """queries are truncated / left-padded to exactly this many tokens ([general 2])"""
    response_length: int = 24
    """every response has exactly this many sampled tokens, EOS does not stop sampling ([general 4])"""
    truncate_token: str = "."
    """responses are cut at the first occurrence of this token at or after `truncate_after` ([policy 5])"""
    truncate_after: int = 16
    """the truncate token only counts from this response position on ([policy 5])"""
    penalty_reward_value: float = -1.0
    """the score of a response that has no truncate token at or after `truncate_after` ([policy 5])"""
    temperature: float = 0.7
    """sampling temperature; logits are divided by it wherever logprobs/entropy are computed ([policy 1])"""
    start_text: Optional[str] = None
    """OpenAI's query trimming (rewards.trim_query_tokens): start after the first occurrence of this one-token text,
    skip texts without it. launch.py books task: "."; default None as lm-human-preference-details' benchmark"""
    end_text: Optional[str] = None
    """OpenAI's query trimming: end at the last occurrence of this one-token text, skip texts without it.
    launch.py books task: "."; default None as lm-human-preference-details' benchmark"""
    query_prefix: str = ""
    """text before every query the policy sees (lm_tasks.py query_formatter); the reward model scores the raw query"""
    query_suffix: str = ""
    """text after every query the policy sees ("\\n\\nTL;DR:" for summarisation); not shown to the reward model"""

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
    """per-rank forward/backward size; gradient accumulation = per-rank minibatch / this (a memory knob only)"""
    lr: float = 1e-5
    """peak learning rate, annealed linearly to 0 ([general 5])"""
    eps: float = 1e-5
    """Adam epsilon (TF-style epsilon-hat for adam_tf, [adam])"""
    optimizer: Literal["adam_tf", "adam"] = "adam_tf"
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
    """whiten rewards and advantages within groups of this many consecutive rollouts of a rank; 0 = the whole
    per-rank batch. OpenAI whitened each of its 8 ranks' own 64 rollouts, so 64 (rollout_batch_size / 8) on one
    GPU computes what the 8-GPU run computed; the gpt2 presets set it ([policy 9])"""

    # ---- KL penalty ([policy 8], [policy 11]) ----
    kl_coef: float = 0.15
    """initial beta of the per-token KL penalty"""
    adaptive_kl: bool = True
    """adapt beta towards `kl_target` ([policy 11])"""
    kl_target: float = 6.0
    """target KL(pi || pi_ref) per response, in nats"""
    kl_horizon: int = 10000
    """adaptive KL horizon, in episodes"""

    # ---- optional rollout correction (corrections.py; not in the original) ----
    correction: Optional[str] = None
    """a RolloutCorrection preset name (e.g. decoupled_token_is); corrects for generate()-vs-forward mismatch"""

    # ---- memory ----
    logprob_chunk_rows: int = 1024
    """rows (batch x time) per chunk when computing logprobs, so no float32 (B, T, V) log-softmax exists"""

    # ---- logging / checkpoints ----
    sample_freq: int = 10
    """write a sample table (query, response, score, kl) every this many updates (0 = never)"""
    num_samples: int = 8
    """rows in each sample table"""
    save_freq: int = 50
    """checkpoint every this many updates (and always at the end)"""
    keep_checkpoints: int = 2
    """how many recent checkpoints to keep"""
    resume_from: Optional[str] = None
    """a checkpoint directory to resume from; None = the latest one in <output_dir>/checkpoints, if any"""

    # ---- memory plan ----
    dry_run: bool = False
    """check every argument, read the policy's config (no weights), print the per-GPU memory plan and exit: status 0
    if it fits, 2 (one line) if it does not or an argument is bad"""
    gpu_memory_gib: float = 0.0
    """GPU memory to plan for in GiB (0 = what torch.cuda sees; no GPU and 0: the plan without a verdict)"""
    dry_run_gpus: int = 0
    """--dry-run only: the number of GPUs (torchrun processes) to plan for (0 = WORLD_SIZE, or 1)"""


PRESETS = {
    # Offline CPU: the tiny reward model from rewards.py is trained first (one command runs the whole pipeline),
    # the policy is the tiny random-init gpt2-arch model rewards.py saved next to it; query 8 / response 16 match the
    # reward model's tiny preset. KL target 4 = the original 6 nats per 24 tokens scaled to 16 tokens (same KL per
    # response token); horizon 1000 so beta can move within 120 updates of 64 (the original: 1953 updates of 512);
    # lr 3e-4 because the tiny policy is small and random-init (gpt2 uses 1e-5). Measured: scores -0.7 -> +0.9,
    # KL 3-6 around the target of 4 over the second half, ~2 minutes on 2 CPU cores including the reward model.
    "tiny": (
        "offline CPU run on the tiny synthetic task (minutes on 2 cores)",
        Args(
            exp_name="ppo_rlhf_tiny", base_model="", reward_preset="tiny", query_dataset="tiny",
            query_length=8, response_length=16, truncate_after=8, temperature=0.7,
            total_episodes=64 * 120, rollout_batch_size=64, local_micro_batch_size=64, noptepochs=4,
            lr=3e-4, kl_coef=0.15, kl_target=4.0, kl_horizon=1000, sample_freq=20, save_freq=50, bf16=False,
            torch_threads=1,
        ),
    ),
    # Ziegler et al. (2019) stylistic continuation, launch.py settings as reproduced by [repro]:
    # gpt2 (124M), query 64, response 24, truncate "." after 16, penalty -1, T=0.7, 512 rollouts x 1M episodes,
    # lr 1e-5, beta 0.15 adaptive (target 6, horizon 10000), 4 epochs, 1 minibatch, gamma 1, lambda 0.95,
    # cliprange 0.2, cliprange_value 0.2, vf_coef 0.1. Whitening in groups of 64 rollouts: on 8 GPUs that is each
    # rank's own batch (as OpenAI), on 1 GPU it computes what the 8 ranks computed.
    "gpt2_sentiment": (
        "gpt2 sentiment (Ziegler et al. 2019; published: score ~1.8, KL ~6, beta ~0.25 at 1M episodes)",
        Args(exp_name="ppo_rlhf_gpt2_sentiment", reward_preset="gpt2_sentiment", whiten_group_size=64),
    ),
    "gpt2_descriptiveness": (
        "gpt2 descriptiveness (Ziegler et al. 2019; published: score ~2.3, KL ~6, beta ~0.33 at 1M episodes)",
        Args(exp_name="ppo_rlhf_gpt2_descriptiveness", reward_preset="gpt2_descriptiveness", whiten_group_size=64),
    ),
    # OpenAI's TL;DR summarisation (launch.py summarize_tldr_task + get_experiments()["tldr"]): query = the first
    # 500 tokens of a post + "\n\nTL;DR:" (the reward model sees the post without the suffix), response 75 tokens,
    # truncated at the first "\n" (gpt2 id 198) from token 55 on, T=0.7; a FIXED KL coefficient 0.03 ("0.01 too
    # low"; adaptive KL commented out), no reward whitening, rollout batch 32 (4 per rank on 8 GPUs, hence
    # advantage whitening in groups of 4), lr 2e-6, 1M episodes; the reward model is rewards.py's gpt2_tldr.
    "gpt2_tldr": (
        "gpt2 TL;DR summarisation (lm-human-preferences launch.py tldr; not run here, see docs/ppo_rlhf.md)",
        Args(exp_name="ppo_rlhf_gpt2_tldr", reward_preset="gpt2_tldr", query_dataset="tldr", query_length=500,
             response_length=75, query_suffix="\n\nTL;DR:", truncate_token="\n", truncate_after=55,
             temperature=0.7, total_episodes=1_000_000, rollout_batch_size=32, local_micro_batch_size=16, lr=2e-6,
             kl_coef=0.03, adaptive_kl=False, whiten_rewards=False, whiten_group_size=4),
    ),
    # The sentiment pipeline on a real pretrained model, offline, on 2 CPU cores (measured, one command: seed 1 22.6
    # min = labels 5.9 + reward model 5.1 + PPO 11.6, seed 2 21.7 min; docs/ppo_rlhf.md). Reward model: rewards.py's
    # smol_sentiment preset (decisive lexicon best-of-4 labels on template openers). Policy = SmolLM2-135M-Instruct
    # (Q4_1 de-quantised to fp32), continuing raw openers (no chat template: the task is continuation, as the
    # original). Pad: SmolLM2 saves pad = eos = <|im_end|> (2), a token the model writes; like gpt2, load_tokenizer
    # adds a distinct [PAD] at id 49152 = vocab size, outside the embedding, so it is never sampled and
    # masked_inputs maps it to 0 before every forward; sampling stays fixed-length and EOS does not stop it
    # ([general 2], [general 4]). Every other detail is the original's (truncate "." penalty -1, whitening, value
    # head at 0, TF Adam, 4 epochs, gamma 1, lambda 0.95, adaptive KL); scaled: query 14 / response 20 / truncate
    # after 10 (books: 64 / 24 / 16), 16 updates of 32 (books: 1953 of 512; ~43 s each here), KL target 2 nats per
    # response with horizon 256 episodes so beta can move within 16 updates (books: 6 nats, 10000). 512 episodes
    # instead of 1M need larger steps than the original's: lr 3e-5 and 2 minibatches (8 Adam steps per update).
    # Measured with one reward model: lr 1e-5 and 1 minibatch left the KL at 0.2-0.7 and the scores flat over 20
    # updates; lr 3e-5 x 2 minibatches brought the KL to its target of 2 by update ~11 (first update: approxkl
    # 0.21-0.23, clipfrac 0.33, then 0.01-0.05). lr 5e-5 and 1 minibatch: approxkl 0.69 at update 1.
    "smol_sentiment": (
        "offline CPU: SmolLM2-135M-Instruct (Q4_1 de-quantised), sentiment from a lexicon labeller (sized for 30 min)",
        Args(
            exp_name="ppo_rlhf_smol_sentiment", output_dir="runs/ppo_smol_sentiment", base_model=rewards.SMOLLM2_PATH,
            reward_preset="smol_sentiment", query_dataset="openers", query_length=14, response_length=20,
            truncate_after=10, temperature=0.7, total_episodes=32 * 16, rollout_batch_size=32, nminibatches=2,
            local_micro_batch_size=32, noptepochs=4, lr=3e-5, kl_coef=0.15, kl_target=2.0, kl_horizon=256,
            sample_freq=4, save_freq=0, keep_checkpoints=1, bf16=False,
        ),
    ),
}


# =====================================================================================================================
# Helpers: batch arithmetic, seeds, schedules
# =====================================================================================================================


def exact_div(a, b, what):
    """a / b, or a clear error naming the two quantities that must divide."""
    if b <= 0 or a % b != 0:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


def batch_sizes(args, world_size):
    """Global batch sizes -> per-rank sizes; fails with a clear message before any model is loaded.

    The preset gives the *global* rollout batch (512 in the original), so the same preset is the same experiment on
    1 GPU or 8: only gradient accumulation changes ([policy 7], micro-batches added by [repro]).
    """
    if args.truncate_after >= args.response_length:
        raise ValueError(
            f"truncate_after ({args.truncate_after}) must be < response_length ({args.response_length}): "
            "otherwise no response can ever contain the truncate token and every score is the penalty"
        )
    if args.total_episodes < args.rollout_batch_size:
        raise ValueError(f"total_episodes ({args.total_episodes}) < rollout_batch_size ({args.rollout_batch_size})")
    local_batch = exact_div(args.rollout_batch_size, world_size, "rollout_batch_size over world_size (ranks)")
    local_mini = exact_div(local_batch, args.nminibatches, "per-rank rollout batch over nminibatches")
    micro = min(args.local_micro_batch_size, local_mini)
    grad_accum = exact_div(local_mini, micro, "per-rank minibatch over local_micro_batch_size")
    if args.whiten_group_size < 0:
        raise ValueError(f"whiten_group_size must be >= 0 (0 = the whole per-rank batch), got {args.whiten_group_size}")
    group = args.whiten_group_size or local_batch
    exact_div(local_batch, group, "per-rank rollout batch over whiten_group_size")
    if args.whiten_rewards and group < 8:
        raise ValueError(f"whitening group of {group} rollouts is too small to whiten rewards (need >= 8, OpenAI "
                         "train_policy.py asserts a per-rank minibatch >= 8)")
    num_updates = args.total_episodes // args.rollout_batch_size
    return dict(local_batch=local_batch, local_mini=local_mini, micro=micro, grad_accum=grad_accum,
                num_updates=num_updates)


def validate_args(args, world_size):
    """All checks that need no model: batch arithmetic, option names. Raises ValueError."""
    sizes = batch_sizes(args, world_size)
    if args.correction is not None:

        try:
            corrections.RolloutCorrection.from_name(args.correction)
        except Exception as e:  # unknown preset name
            raise ValueError(f"unknown --correction {args.correction!r}: {e}") from e
    if args.query_dataset != "tiny" and args.base_model == "":
        raise ValueError(f"query_dataset {args.query_dataset!r} needs a real --base-model (e.g. gpt2)")
    if args.query_dataset == "tiny" and (args.start_text or args.end_text or args.query_prefix or args.query_suffix):
        raise ValueError("the tiny task has no start_text/end_text/query_prefix/query_suffix")
    if rewards.smollm2_problem(args.base_model):
        raise ValueError(rewards.smollm2_problem(args.base_model))
    for name in ("temperature", "lr", "sample_freq", "save_freq", "noptepochs", "logprob_chunk_rows"):
        if getattr(args, name) < 0 or (name in ("temperature", "noptepochs", "logprob_chunk_rows")
                                       and getattr(args, name) == 0):
            raise ValueError(f"{name} must be positive, got {getattr(args, name)}")
    return sizes


def local_seed(seed, rank):
    """[general 6]: every rank gets its own seed, so the 8 processes sample different responses (OAI core.py)."""
    return seed + rank * 100003  # 100003 is prime


def linear_lr(update, num_updates, lr):
    """[general 5]: lr annealed linearly to 0; update counts from 1, so the first update uses the full lr."""
    frac = 1.0 - (update - 1.0) / num_updates
    return frac * lr


def adaptive_kl_update(kl_coef, current_kl, n_steps, target, horizon):
    """[policy 11] OpenAI's AdaptiveKLController.update: beta *= 1 + clip(kl/target - 1, -0.2, 0.2) * n/horizon."""
    proportional_error = float(np.clip(current_kl / target - 1, -0.2, 0.2))
    mult = 1 + proportional_error * n_steps / horizon
    return kl_coef * mult


def minibatch_schedule(perm, local_mini, micro):
    """[policy 7]: one epoch = a fresh permutation cut into minibatches (one optimizer step each), each cut into
    micro-batches (one forward/backward each, gradients accumulated). Returns [[micro_inds, ...], ...]."""
    schedule = []
    for mini_start in range(0, len(perm), local_mini):
        mini_inds = perm[mini_start : mini_start + local_mini]
        schedule.append([mini_inds[s : s + micro] for s in range(0, local_mini, micro)])
    return schedule


# =====================================================================================================================
# Helpers: padding, position ids, truncation
# =====================================================================================================================


def left_pad_queries(token_lists, query_length, pad_token_id):
    """[general 2]: truncate each query to `query_length` tokens and LEFT-pad it with the distinct pad token.

    (The original right-pads and [repro] converts to left padding; padding left directly gives the same tensor.)
    """
    out = torch.full((len(token_lists), query_length), pad_token_id, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        tokens = tokens[:query_length]
        if len(tokens) > 0:
            out[i, query_length - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
    return out


def masked_inputs(query_responses, pad_token_id):
    """[general 3]: attention mask from the pad token, position ids = exclusive cumsum of the mask, pads -> id 0.

    So a left-padded row gets positions 0, 1, 2, ... on its real tokens exactly as if it had no padding, and the pad
    id (which for gpt2 is outside the embedding, OAI's out-of-vocabulary pad) is never looked up.
    """
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()  # exclusive cumsum
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    return input_ids, attention_mask, position_ids


def backbone_hidden(backbone, query_responses, pad_token_id):
    """Last hidden state (B, L, H) of a non-generation forward with our masking and position ids ([general 3])."""
    input_ids, attention_mask, position_ids = masked_inputs(query_responses, pad_token_id)
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


def truncate_responses(responses, truncate_token_id, truncate_after, pad_token_id):
    """[policy 5] step 1: keep each response up to and including the first `truncate_token` found at position
    >= truncate_after; replace everything after it with pad (OAI: "central example: replace all tokens after the
    truncate token with the pad token"). Responses without such a token are returned unchanged."""
    is_trunc = responses == truncate_token_id
    is_trunc[:, :truncate_after] = False  # the token only counts from position truncate_after on
    after_first = (is_trunc.cumsum(1) - is_trunc.long()) > 0  # strictly after the first match
    return torch.masked_fill(responses, after_first, pad_token_id)


def penalise_untruncated(scores, postprocessed_responses, truncate_token_id, truncate_after, penalty):
    """[policy 5] step 3: a response with no truncate token at or after truncate_after gets the fixed penalty
    (-1) instead of the reward model's score (OAI: "only query humans on responses that pass that filter")."""
    has_token = (postprocessed_responses[:, truncate_after:] == truncate_token_id).any(dim=1)
    return torch.where(has_token, scores, torch.full_like(scores, penalty))


# =====================================================================================================================
# Helpers: logprobs without a float32 (B, T, V) log-softmax, GAE, whitening
# =====================================================================================================================


def banned_vocab_mask(vocab_size, pad_token_id, device):
    """OAI's pad token is outside the vocabulary, so the policy can never sample it. Where the tokenizer's pad id is
    inside the model's vocabulary (the tiny tokenizer), we ban it from the distribution (here and in generate) so
    the same holds: the logprobs sum over exactly the tokens generate() can sample. None when nothing is banned."""
    if pad_token_id >= vocab_size:
        return None
    banned = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    banned[pad_token_id] = True
    return banned


def logprobs_from_logits(logits, tokens, temperature, banned=None, chunk_rows=1024):
    """log softmax(logits / T)[token] for (B, T, V) logits ([policy 1]: logits /= temperature, as OAI policy.py),
    chunked over the B*T rows by corrections.token_logprobs_and_entropy: the largest float32 tensor is
    (chunk_rows, V), and with grad enabled each chunk is checkpointed instead of keeping B*T*V floats alive."""
    B, T, V = logits.shape
    logprobs, _ = corrections.token_logprobs_and_entropy(logits.reshape(B * T, V), tokens.reshape(B * T), temperature,
                                                         chunk_size=chunk_rows, banned=banned)
    return logprobs.reshape(B, T)


def whiten(values, shift_mean=True, group_size=0):
    """[policy 9] OAI's whiten with tf.nn.moments semantics: (x - mean) / sqrt(var + 1e-8) with the BIASED variance
    (/N, not torch.var's /(N-1)); shift_mean=False adds the mean back, so only the scale changes. Every response
    token is valid here (fixed-length responses), so the mask is all ones.

    group_size > 0: rows [0, g), [g, 2g), ... are whitened separately, each with its own moments -- what OpenAI's
    ranks did, each whitening its own rollouts (utils.whiten inside PPOTrainer.loss, per rank). 0 = all rows."""
    group_size = group_size or values.shape[0]
    return torch.cat([corrections.masked_whiten(chunk, torch.ones_like(chunk), shift_mean=shift_mean, unbiased=False)
                      for chunk in values.split(group_size)])


def compute_gae(rewards, values, gamma, lam):
    """GAE over the response tokens: delta_t = r_t + gamma V_{t+1} - V_t (V after the last token = 0),
    A_t = delta_t + gamma lam A_{t+1}; returns = A + V. gamma = 1 in the original ([policy 6])."""
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
    """[policy 10] value clipping as in PPO2 / OAI train_policy.py: the new value may move at most cliprange_value
    from the rollout value; the loss is the max of the clipped and unclipped squared errors.
    Returns (vf_loss, vf_clipfrac, vf_losses1)."""
    vpredclipped = torch.clamp(vpred, values - cliprange_value, values + cliprange_value)
    vf_losses1 = torch.square(vpred - returns)
    vf_losses2 = torch.square(vpredclipped - returns)
    vf_loss = 0.5 * torch.max(vf_losses1, vf_losses2).mean()
    vf_clipfrac = (vf_losses2 > vf_losses1).float().mean()
    return vf_loss, vf_clipfrac, vf_losses1


# =====================================================================================================================
# Helpers: the policy with its value head
# =====================================================================================================================


class PolicyAndValue(nn.Module):
    """The policy LM and a scalar value head on the SAME backbone, as OAI's policy.py and [repro]'s
    AutoModelForCausalLMWithScalarHead (one transformer, two heads; OAI did not use a separate value network).

    forward returns the response-position hidden states (B, R, H) and values (B, R): position t predicts response
    token t from everything before it, so we slice [context_length - 1, -1) of the query_response ([general 1]: the
    value head sees query + response). The LM head is applied later, chunk by chunk and in float32
    (logprobs_from_hidden): no (B, L, V) logits, and none in bf16.
    """

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.hidden_size, 1)
        # [policy 2]: value head weights ~ N(0, 0) and bias 0, i.e. the value starts at exactly 0
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, query_responses, context_length, pad_token_id):
        hidden = backbone_hidden(self.lm.base_model, query_responses, pad_token_id)[:, context_length - 1 : -1]
        values = corrections.fp32_project(self.value_head, hidden).squeeze(-1)  # value head in fp32, autocast off
        return hidden, values


def response_hidden(lm, query_responses, context_length, pad_token_id):
    """Hidden states (B, R, H) at the response positions for a plain LM (the reference policy)."""
    return backbone_hidden(lm.base_model, query_responses, pad_token_id)[:, context_length - 1 : -1]


def logprobs_from_hidden(lm, hidden, tokens, temperature, banned=None, chunk_rows=1024):
    """(logprobs, entropy), each (B, R), of `tokens` from response hidden states: the LM head, log-softmax and
    entropy in float32 with autocast off (corrections.token_logprobs_and_entropy with the LM head as `project`, as
    grpo.compute_logprobs), logits / T ([policy 1]). Under bf16 autocast a bf16 LM head rounds gpt2's logits (30-130
    in magnitude) by up to 0.25, ~0.1 nats of logprob error, which would inflate approxkl, clipfrac and the
    per-token KL reward (tests/test_grpo.py measures it). The entropy carries no gradient (a metric here)."""
    B, R, H = hidden.shape
    logprobs, entropy = corrections.token_logprobs_and_entropy(
        hidden.reshape(B * R, H), tokens.reshape(B * R), temperature, project=lm.get_output_embeddings(),
        chunk_size=chunk_rows, banned=banned)
    return logprobs.reshape(B, R), entropy.reshape(B, R)


def generation_config(args, pad_token_id, banned, output_scores):
    """[general 4]: fixed-length sampling: exactly response_length tokens, top_k=0, top_p=1, temperature T, and
    EOS does NOT stop sampling (eos_token_id=None; the model's own generation_config is overridden too, see
    `load_policy`, because HF would otherwise put its eos back)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=args.response_length, min_new_tokens=args.response_length,
        do_sample=True, top_k=0, top_p=1.0, temperature=args.temperature,
        eos_token_id=None, pad_token_id=None, bos_token_id=None,
        suppress_tokens=[pad_token_id] if banned is not None else None,  # see banned_vocab_mask
        return_dict_in_generate=True, output_scores=output_scores,
    )


@torch.no_grad()
def generate(lm, queries, pad_token_id, gen_config):
    """Sample responses for left-padded queries. Returns (responses (B, R), processed scores or None).

    [general 3.4]: position ids are NOT passed to generate: HF generate derives them from the attention mask itself
    (cumsum - 1 on the left-padded rows), and [repro] found generations collapse when they were passed as well.
    """
    attention_mask = queries != pad_token_id
    input_ids = torch.masked_fill(queries, ~attention_mask, 0)  # the pad id may be outside the embedding (gpt2)
    out = lm.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_config)
    responses = out.sequences[:, queries.shape[1] :]
    scores = torch.stack(out.scores, dim=1) if out.scores is not None else None  # (B, R, V): logits / T, processed
    return responses, scores


# =====================================================================================================================
# Helpers: data, distributed, logging, checkpoints
# =====================================================================================================================


def query_batches(args, tokenizer, seed, local_batch, start_update, rank=0, world_size=1):
    """Yield per-rank (B, query_length) left-padded RAW query batches for updates start_update, start_update+1, ...
    (the reward model scores these; the policy sees them through `rewards.format_queries` with prefix/suffix).

    tiny: each rank draws its own queries from its local seed. Datasets: as the original (language/datasets.py),
    the corpus is shuffled once with ONE seed shared by all ranks (`args.seed`; OpenAI used 0) and sharded by rank,
    so the 8 ranks never see the same query (rewards.query_texts, the stream the reward model's normalisation read
    too); queries are trimmed by start_text/end_text (rewards.trim_query_tokens). Resuming at update u replays the
    stream to the same position, so the batches are exactly those of an uninterrupted run.
    """
    if args.query_dataset in ("tiny", "openers"):
        make_queries = rewards.tiny_queries if args.query_dataset == "tiny" else rewards.sentiment_queries
        update = start_update
        while True:
            texts = make_queries(local_batch, seed=seed * 1_000_003 + update)
            token_lists = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
            yield left_pad_queries(token_lists, args.query_length, tokenizer.pad_token_id)
            update += 1
    # [policy 3]: bookcorpus is already sentence-split, so [repro] uses start_text=end_text=None: no "." trimming
    # (our default); OpenAI's books task trimmed at "." (--start-text . --end-text .).
    texts = rewards.query_texts(args, seed, rank, world_size)
    start_token = rewards.single_token_id(tokenizer, args.start_text)
    end_token = rewards.single_token_id(tokenizer, args.end_text)
    update = 1
    while True:
        batch = rewards.query_token_batch(texts, tokenizer, local_batch, args.query_length, start_token, end_token)
        if update >= start_update:
            yield batch
        update += 1


def setup_distributed(args):
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; without them this is a single process. NCCL on GPU, gloo on CPU."""
    use_cuda = args.cuda and torch.cuda.is_available()
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size, local_rank = 0, 1, 0
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    return rank, world_size, device


def all_mean(tensor):
    """Mean of a tensor over ranks (identity on one process)."""
    if dist.is_available() and dist.is_initialized():
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        tensor /= dist.get_world_size()
    return tensor


def all_gather_cat(tensor):
    """1-D tensors of the same length on every rank -> their concatenation, rank by rank (identity on one process)."""
    if dist.is_available() and dist.is_initialized():
        gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor.contiguous())
        return torch.cat(gathered)
    return tensor


def all_sum(tensor):
    """Sum of a tensor over ranks (identity on one process)."""
    if dist.is_available() and dist.is_initialized():
        tensor = tensor.clone()
        dist.all_reduce(tensor)
    return tensor


def barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def write_jsonl(path, record):
    """Append one JSON line and flush, so nothing is lost on a crash."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def drop_records_after(path, step):
    """On resume: drop the jsonl lines a crashed run wrote after its last checkpoint (they will be redone)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        keep = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


def latest_checkpoint(output_dir):
    path = os.path.join(output_dir, "checkpoints", "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    ckpt = os.path.join(output_dir, "checkpoints", name)
    return ckpt if os.path.isdir(ckpt) else None


def save_checkpoint(output_dir, update, global_step, model, tokenizer, optimizer, kl_coef, args, rank, keep):
    """HF-format policy + value head + trainer state, written to a temp dir and renamed (a crash mid-save never
    leaves a half checkpoint as `latest`). Rank 0 writes weights/optimizer (identical on all ranks); every rank
    writes its own RNG state."""
    ckpt_root = os.path.join(output_dir, "checkpoints")
    name = f"update_{update:07d}"
    tmp = os.path.join(ckpt_root, name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    rng = dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
               cuda=torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
    torch.save(rng, os.path.join(tmp, f"rng_rank{rank}.pt"))
    barrier()
    if rank == 0:
        model.lm.save_pretrained(os.path.join(tmp, "policy"))
        tokenizer.save_pretrained(os.path.join(tmp, "policy"))
        torch.save(model.value_head.state_dict(), os.path.join(tmp, "value_head.pt"))
        torch.save(dict(update=update, global_step=global_step, kl_coef=kl_coef, optimizer=optimizer.state_dict(),
                        args=dataclasses.asdict(args)), os.path.join(tmp, "trainer_state.pt"))
        final = os.path.join(ckpt_root, name)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with open(os.path.join(ckpt_root, "latest.tmp"), "w") as f:
            f.write(name)
        os.replace(os.path.join(ckpt_root, "latest.tmp"), os.path.join(ckpt_root, "latest"))
        old = sorted(d for d in os.listdir(ckpt_root) if d.startswith("update_") and not d.endswith(".tmp"))
        for d in old[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(ckpt_root, d), ignore_errors=True)
    barrier()


def load_policy(path, device):
    """An HF causal LM in float32 with dropout off and the model's own eos/pad removed from its generation_config
    ([general 4]: a GenerationConfig(eos_token_id=None) alone is not enough, the model's config would re-add it)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rewards.disable_dropout(lm)  # [policy 4] no dropout (rewards.py's helper also resets the config)
    lm.generation_config.eos_token_id = None
    lm.generation_config.pad_token_id = None
    return lm.to(device)


def load_tokenizer(path):
    """[general 2]: a distinct [PAD] token, never EOS. gpt2 has none, so we add "[PAD]" (id 50257, outside gpt2's
    50257-row embedding, like OAI's out-of-vocabulary pad: masked_inputs replaces it by 0 before every forward)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return tokenizer


def reward_model_paths(args):
    """The reward model dir and the policy path. With no --reward-model-path, train one first with rewards.py (every
    rank calls rewards.train: it is itself a torchrun-aware script). Trained once: an existing
    <output_dir>/reward_model_run/DONE is reused, e.g. when resuming."""
    rm_path = args.reward_model_path
    if rm_path is None:

        rm_run = os.path.join(args.output_dir, "reward_model_run")
        done = os.path.join(rm_run, "DONE")
        if not os.path.exists(done):  # no race: DONE is written only after every rank finished rewards.train
            # the reward model gets the policy's seed, as lm-human-preference-details' train_both script, so a
            # seed sweep varies the reward model too (launch.py pinned run.seed 1 for both)
            rm_path = rewards.train(dataclasses.replace(rewards.PRESETS[args.reward_preset], output_dir=rm_run,
                                                        seed=args.seed))
            barrier()
            if int(os.environ.get("RANK", "0")) == 0:
                with open(done, "w") as f:
                    f.write(rm_path)
        barrier()
        with open(done) as f:
            rm_path = f.read().strip()
    # the tiny policy is the model rewards.py's tiny preset saved next to the reward model
    policy_path = args.base_model or os.path.join(os.path.dirname(os.path.normpath(rm_path)), "tiny_policy")
    return rm_path, policy_path


# =====================================================================================================================
# Memory plan (--dry-run): the arithmetic is corrections.memory_plan, shared with grpo.py
# =====================================================================================================================


def load_model_config(args):
    """The policy's config alone (AutoConfig, no weights); the tiny preset's gpt2-arch policy is built in memory
    (rewards.build_tiny_model with its defaults, what `rewards.py tiny` saves)."""
    if not args.base_model:
        return rewards.build_tiny_model(None, arch="gpt2")[0].config
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(args.base_model)
    except OSError as e:  # not on the hub / not cached offline: one line, not a traceback
        raise ValueError(f"cannot read the config of {args.base_model!r}: {str(e).splitlines()[0]}") from e


def plan_memory(args, config, world_size, gpu_bytes):
    """Per-GPU bytes of one PPO rank, in two phases that do not overlap in time:
      train:   policy + value head (fp32 weights, gradients, Adam m and v), DDP's gradient bucket copy (more than one
               GPU), autocast's bf16 weight copies, the frozen reference (bf16 linears under bf16 autocast) and reward
               model (fp32; its backbone assumed the policy's architecture, as in OpenAI's setup), activations of one
               micro-batch (no gradient checkpointing; the (micro, response, vocab) logits counted 3x in fp32)
      rollout: the same resident models + generate's KV cache and scores for one micro-batch of query + response
    plus 1 GiB for the CUDA context and allocator slack (an estimate)."""
    gib = corrections.GIB
    shape = corrections.model_shape(config)
    n_lm = corrections.count_parameters(config)
    n = n_lm + shape["hidden"] + 1  # + the value head
    n_rm = n_lm + shape["hidden"] + 1  # backbone + scalar head
    bf16 = args.bf16
    embeddings = shape["vocab"] * shape["hidden"] * (1 if shape["tied"] else 2)
    ref = 2 * (n_lm - embeddings) + 4 * embeddings if bf16 else 4 * n_lm
    micro = batch_sizes(args, world_size)["micro"]
    seq = args.query_length + args.response_length
    resident = {"policy + value head weights (fp32)": 4 * n, "Adam state (fp32 m and v)": 8 * n,
                "reference policy (bf16 linears)" if bf16 else "reference policy (fp32)": ref,
                "reward model (fp32)": 4 * n_rm}
    context = {"CUDA context + allocator slack (estimate)": 1 * gib}
    train_rows = dict(resident)
    train_rows["gradients (fp32)"] = 4 * n
    if world_size > 1:
        train_rows["DDP gradient buckets (fp32)"] = 4 * n
    if bf16:
        train_rows["autocast bf16 weight copies"] = 2 * n
    train_rows[f"activations ({micro} x {seq} tokens, estimate)"] = corrections.activation_bytes(
        shape, micro * seq, False, micro * args.response_length)
    rollout_rows = dict(resident)
    rollout_rows[f"KV cache + scores (generate, {micro} x {seq} tokens)"] = (
        micro * seq * corrections.kv_cache_bytes_per_token(shape, 2 if bf16 else 4)
        + 2 * micro * args.response_length * shape["vocab"] * 4)
    train_rows.update(context), rollout_rows.update(context)
    plan = corrections.memory_plan(gpu_bytes, {"train": train_rows, "rollout": rollout_rows})
    plan["n_params"] = n_lm
    return plan


def dry_run(args):
    """--dry-run: check every argument, read the config, print the per-GPU plan. Returns the exit status: 0 if it fits
    (or no GPU size is known), 2 with a one-line reason if an argument is bad or the plan does not fit."""
    try:
        world_size = args.dry_run_gpus or int(os.environ.get("WORLD_SIZE", "1"))
        validate_args(args, world_size)
        config = load_model_config(args)
    except ValueError as e:
        print(f"ppo_rlhf.py: error: {e}".replace("\n", " "), file=sys.stderr)
        return 2
    plan = plan_memory(args, config, world_size, corrections.gpu_memory_bytes(args.gpu_memory_gib))
    title = (f"ppo_rlhf.py {args.exp_name}: {args.base_model or 'tiny gpt2'} ({plan['n_params'] / 1e6:.1f}M "
             f"parameters), {world_size} GPU(s), {'bf16 autocast' if args.bf16 else 'fp32'}")
    print(corrections.format_memory_plan(plan, title))
    if plan["fits"] is False:
        print(f"ppo_rlhf.py: error: the plan needs {plan['peak'] / corrections.GIB:.2f} GiB per GPU, more than "
              f"{plan['gpu_bytes'] / corrections.GIB:.2f} GiB: lower --local-micro-batch-size or use more/larger GPUs",
              file=sys.stderr)
        return 2
    return 0


# =====================================================================================================================
# train()
# =====================================================================================================================


def train(args: Args):
    # 0. setup: distributed, batch sizes (checked before any model loads), seeds ----------------------------------
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = validate_args(args, world_size)
    rank, world_size, device = setup_distributed(args)
    local_batch, local_mini, micro, grad_accum, num_updates = (
        sizes["local_batch"], sizes["local_mini"], sizes["micro"], sizes["grad_accum"], sizes["num_updates"])
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    os.makedirs(args.output_dir, exist_ok=True)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and args.bf16
                else contextlib.nullcontext())

    from adam_tf import AdamTF

    # 1. models: reward model (normalised, [reward 3]), reference policy, policy + value head -------------------
    rm_path, policy_path = reward_model_paths(args)
    seed = local_seed(args.seed, rank)  # [general 6] (seeded after rewards.train, which seeds for itself)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(policy_path)
    pad_id = tokenizer.pad_token_id
    truncate_ids = tokenizer.encode(args.truncate_token, add_special_tokens=False)
    if len(truncate_ids) != 1:
        raise ValueError(f"truncate_token {args.truncate_token!r} is not a single token: {truncate_ids}")
    truncate_token_id = truncate_ids[0]  # "." is id 13 in gpt2 ([repro] truncate_token=13)
    reward_model = rewards.disable_dropout(rewards.load_reward_model(rm_path, device=str(device))).to(device).eval()
    ref_policy = load_policy(policy_path, device).eval()
    if device.type == "cuda" and args.bf16:  # under bf16 autocast: the same logprobs at ~half the memory (verl)
        corrections.bf16_frozen_linears_(ref_policy)
    resume = args.resume_from or latest_checkpoint(args.output_dir)
    model = PolicyAndValue(load_policy(os.path.join(resume, "policy") if resume else policy_path, device)).to(device)
    model.eval()  # dropout is already 0; eval() changes nothing else for these models
    for p in list(reward_model.parameters()) + list(ref_policy.parameters()):
        p.requires_grad_(False)
    banned = banned_vocab_mask(model.lm.config.vocab_size, pad_id, device)
    # [adam]: TF1-style Adam (eps on sqrt(v) without bias correction) is what OAI trained with
    if args.optimizer == "adam_tf":
        optimizer = AdamTF(model.parameters(), lr=args.lr, eps=args.eps)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, eps=args.eps)
    kl_coef, start_update, global_step = args.kl_coef, 1, 0
    if resume:
        model.value_head.load_state_dict(torch.load(os.path.join(resume, "value_head.pt"), map_location=device))
        state = torch.load(os.path.join(resume, "trainer_state.pt"), map_location=device, weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        kl_coef, start_update, global_step = state["kl_coef"], state["update"] + 1, state["global_step"]
        rng_path = os.path.join(resume, f"rng_rank{rank}.pt")
        if os.path.exists(rng_path):
            rng = torch.load(rng_path, weights_only=False)
            random.setstate(rng["python"]), np.random.set_state(rng["numpy"]), torch.set_rng_state(rng["torch"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        if rank == 0:
            print(f"resumed from {resume} at update {start_update} (kl_coef {kl_coef:.4f})")
    # DDP averages gradients over ranks; generation and rollout forwards use the unwrapped `model`
    ddp_model = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    correction = corrections.RolloutCorrection.from_name(args.correction) if args.correction else None
    gen_config = generation_config(args, pad_id, banned, output_scores=correction is not None)
    batches = query_batches(args, tokenizer, seed, local_batch, start_update, rank, world_size)
    # the policy sees prefix + query + suffix (lm_tasks.py query_formatter); empty for the books tasks
    prefix_ids = tokenizer.encode(args.query_prefix, add_special_tokens=False) if args.query_prefix else []
    suffix_ids = tokenizer.encode(args.query_suffix, add_special_tokens=False) if args.query_suffix else []
    wandb = None
    if args.track and rank == 0:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=dataclasses.asdict(args),
                   name=f"{args.exp_name}__{args.seed}__{int(time.time())}", resume="allow")
    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    samples_path = os.path.join(args.output_dir, "samples.jsonl")
    if rank == 0 and resume:
        for path in (metrics_path, samples_path):
            drop_records_after(path, start_update - 1)
    if rank == 0:
        print(f"world_size {world_size}: per-rank batch {local_batch}, minibatch {local_mini}, micro-batch {micro}, "
              f"gradient accumulation {grad_accum}, {num_updates} updates")
    start_time = time.time()

    for update in range(start_update, num_updates + 1):
        global_step += args.rollout_batch_size
        # 2. anneal the learning rate linearly to 0 ([general 5]) -------------------------------------------------
        lrnow = linear_lr(update, num_updates, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lrnow

        # 3. rollout: sample fixed-length responses, score them, compute logprobs/values --------------------------
        raw_queries = next(batches).to(device)  # (B, query_length), left-padded ([general 2]): the RM's query
        queries = rewards.format_queries(raw_queries, prefix_ids, suffix_ids, pad_id)  # (B, context): the policy's
        context_length = queries.shape[1]
        with torch.no_grad(), autocast:
            responses, rollout_logprobs = [], []
            logprobs, ref_logprobs, values, scores, postprocessed = [], [], [], [], []
            for s in range(0, local_batch, micro):  # rollout in micro-batch chunks to bound memory
                q = queries[s : s + micro]
                # 3a. sample ([general 4]); the processed generate() scores give the rollout logprobs
                r, gen_scores = generate(model.lm, q, pad_id, gen_config)
                if gen_scores is not None:
                    rollout_logprobs.append(logprobs_from_logits(gen_scores, r, 1.0, banned, args.logprob_chunk_rows))
                qr = torch.cat([q, r], dim=1)  # [general 1]: query + response is the input of every forward
                # 3b. policy logprobs and values, reference logprobs (logits / T: [policy 1]; heads in fp32)
                hidden, v = model(qr, context_length, pad_id)
                logprobs.append(logprobs_from_hidden(model.lm, hidden, r, args.temperature, banned,
                                                     args.logprob_chunk_rows)[0])
                values.append(v)
                ref_hidden = response_hidden(ref_policy, qr, context_length, pad_id)
                ref_logprobs.append(logprobs_from_hidden(ref_policy, ref_hidden, r, args.temperature, banned,
                                                         args.logprob_chunk_rows)[0])
                del hidden, ref_hidden
                # 3c. truncate at the first "." at or after position truncate_after, pad the tail ([policy 5])
                pr = truncate_responses(r, truncate_token_id, args.truncate_after, pad_id)
                # 3d. the reward model scores query + TRUNCATED response; it reads the last position ([reward 1]),
                #     so the tail pads are moved to the left first. PPO still trains on the raw response `r`.
                #     The RM scores the RAW query (no prefix/suffix), as OpenAI's score_fn(queries, responses).
                pqr = rewards.left_pad(torch.cat([raw_queries[s : s + micro], pr], dim=1), pad_id)  # pads first
                input_ids, attention_mask, _ = masked_inputs(pqr, pad_id)
                score = reward_model(input_ids, attention_mask).float().flatten()  # normalised ([reward 3])
                # 3e. no "." after truncate_after: fixed penalty -1 instead of the score ([policy 5])
                scores.append(penalise_untruncated(score, pr, truncate_token_id, args.truncate_after,
                                                   args.penalty_reward_value))
                responses.append(r)
                postprocessed.append(pr)
            responses, logprobs, ref_logprobs = torch.cat(responses), torch.cat(logprobs), torch.cat(ref_logprobs)
            values, scores, postprocessed = torch.cat(values), torch.cat(scores), torch.cat(postprocessed)
            rollout_logprobs = torch.cat(rollout_logprobs) if rollout_logprobs else None
            query_responses = torch.cat([queries, responses], dim=1)

            # 4. rewards: per-token KL penalty, the score added at the last token ([policy 8]) -------------------
            kl = logprobs - ref_logprobs  # (B, R) log pi - log pi_ref of the sampled tokens
            non_score_reward = -kl_coef * kl
            rewards_t = non_score_reward.clone()
            rewards_t[:, -1] += scores

            # 5. whiten the rewards WITHOUT shifting the mean (biased variance as tf.nn.moments; [policy 9]).
            #    nminibatches=1 in the original, so whitening the whole rollout batch once is whitening "per
            #    minibatch"; as in OAI and [repro] each rank whitens its own rollouts, and whiten_group_size=64
            #    whitens groups of 64, so one GPU computes what OpenAI's 8 ranks of 64 computed.
            if args.whiten_rewards:
                rewards_t = whiten(rewards_t, shift_mean=False, group_size=args.whiten_group_size)

            # 6. GAE (gamma=1 [policy 6], lam=0.95), returns, then whitened advantages (mean shifted, [policy 9])
            advantages, returns = compute_gae(rewards_t, values, args.gamma, args.lam)
            advantages = whiten(advantages, group_size=args.whiten_group_size)  # per group, as rewards
            mask = torch.ones_like(logprobs)  # fixed-length responses: every response token is trained on
            is_weights, pg_mask = None, mask
            if correction is not None and not correction.bypass_mode:
                # decoupled PPO (three policies): IS weights pi_old / pi_rollout and rejection mask, once per batch;
                # old logprobs = the training forward (step 3b), rollout logprobs = generate()'s scores (step 3a)
                is_weights, pg_mask, rollout_corr_metrics = corrections.apply_rollout_correction(
                    logprobs, rollout_logprobs, mask, correction)
            elif correction is not None:  # bypass: policy_loss corrects per micro-batch; log the mismatch here
                rollout_corr_metrics = corrections.offpolicy_metrics(logprobs, rollout_logprobs, mask)

        # 7. PPO epochs: fresh permutation each epoch, minibatch = optimizer step, micro-batch = accumulation ([policy 7])
        stats = {k: [] for k in ("approxkl", "clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "loss",
                                 "ratio", "vf_error")}
        extra_stats = {}
        for epoch in range(args.noptepochs):
            perm = torch.from_numpy(np.random.permutation(local_batch)).to(device)
            for micro_batches in minibatch_schedule(perm, local_mini, micro):
                # One loss normalisation for any micro-batch size or rank count (verl's global_batch_info, as
                # grpo.update_policy): the policy loss is divided by the minibatch's valid tokens over all ranks
                # (one all-reduce; it differs from local_mini * R only when a rejection mask drops tokens) and
                # multiplied by the world size, since DDP averages the gradients.
                pg_tokens = all_sum(torch.stack([pg_mask[mb].sum() for mb in micro_batches]).sum().double())
                pg_info = dict(dp_size=world_size, batch_num_tokens=float(pg_tokens))
                for i, mb in enumerate(micro_batches):
                    # DDP: all-reduce the gradients only on the last micro-batch of the minibatch
                    sync = ddp_model.no_sync() if (world_size > 1 and i < len(micro_batches) - 1) \
                        else contextlib.nullcontext()
                    with sync, autocast:
                        hidden, vpred = ddp_model(query_responses[mb], context_length, pad_id)
                        new_logprobs, new_entropy = logprobs_from_hidden(
                            model.lm, hidden, responses[mb], args.temperature, banned,
                            args.logprob_chunk_rows)  # [policy 1]; LM head in fp32
                        # [policy 10]: value loss with the value clipped around the rollout value
                        vf_loss, vf_clipfrac, vf_losses1 = clipped_value_loss(
                            vpred, values[mb], returns[mb], args.cliprange_value)
                        # the PPO clipped objective, token-mean over the (all valid) response tokens
                        if correction is None:
                            pg_loss, pg_metrics = corrections.ppo_clip_loss(
                                new_logprobs, logprobs[mb], advantages[mb], mask[mb],
                                clip_low=args.cliprange, clip_high=args.cliprange, agg_mode="token-mean",
                                global_batch_info=pg_info)
                        else:  # optional: correct for the generate()-vs-forward mismatch (not in the original)
                            pg_loss, pg_metrics = corrections.policy_loss(
                                correction, new_logprobs, logprobs[mb], rollout_logprobs[mb], advantages[mb],
                                pg_mask[mb], is_weights=None if is_weights is None else is_weights[mb],
                                clip_low=args.cliprange, clip_high=args.cliprange, clip_c=None,
                                agg_mode="token-mean", global_batch_info=pg_info)
                        # pg_loss is already this micro-batch's share of the minibatch's loss; the value loss (every
                        # token valid, equal micro-batches) is a micro-batch mean: / number of micro-batches
                        loss = pg_loss + args.vf_coef * vf_loss / len(micro_batches)
                        loss.backward()
                    with torch.no_grad():
                        logprobs_diff = new_logprobs.detach() - logprobs[mb]
                        stats["approxkl"].append(0.5 * (logprobs_diff**2).mean())
                        stats["clipfrac"].append(torch.as_tensor(float(pg_metrics.get("pg_clipfrac", 0.0))))
                        # per micro-batch values, as before: pg_loss scaled back to this micro-batch's own token
                        # mean (exact when every token is valid: global tokens = world x micro-batches x own tokens)
                        pg_loss_micro = pg_loss.detach() * len(micro_batches)
                        stats["pg_loss"].append(pg_loss_micro)
                        stats["vf_loss"].append(vf_loss.detach())
                        stats["vf_clipfrac"].append(vf_clipfrac)
                        stats["loss"].append(pg_loss_micro + args.vf_coef * vf_loss.detach())
                        stats["ratio"].append(torch.exp(logprobs_diff).mean())  # [repro] ratio_stats
                        stats["vf_error"].append(vf_losses1.detach().mean())  # OAI's ppo/val/error, every step
                        stats["entropy"].append(new_entropy.mean())
                        for k, v in pg_metrics.items():
                            if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1):
                                extra_stats.setdefault(k, []).append(float(v))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # last micro-batch tensors, for the ppo/val/* point metrics as in [repro]
            last = dict(vpred=vpred.detach().mean(), error=vf_losses1.detach().mean(), vf_clipfrac=vf_clipfrac,
                        ratio=torch.exp(logprobs_diff).mean())

        # 8. metrics (averaged over ranks) and the adaptive KL controller -----------------------------------------
        with torch.no_grad():
            mean_kl = kl.sum(1).mean()
            local = {
                "objective/kl": mean_kl,
                "objective/entropy": (-logprobs).sum(1).mean(),  # sampled-token estimate, as [repro]
                "objective/non_score_reward": non_score_reward.sum(1).mean(),
                "objective/score_total": non_score_reward.sum(1).mean() + scores.mean(),
                "objective/scores": scores.mean(),
                "objective/scores_std": scores.std(),
                "objective/truncated_frac": (postprocessed[:, args.truncate_after :] == truncate_token_id)
                .any(1).float().mean(),
                "ppo/policy/approxkl_avg": torch.stack(stats["approxkl"]).mean(),
                "ppo/policy/clipfrac_avg": torch.stack(stats["clipfrac"]).float().mean(),
                "ppo/policy/entropy_avg": torch.stack(stats["entropy"]).mean(),
                "ppo/loss/policy_avg": torch.stack(stats["pg_loss"]).mean(),
                "ppo/loss/value_avg": torch.stack(stats["vf_loss"]).mean(),
                "ppo/val/clipfrac_avg": torch.stack(stats["vf_clipfrac"]).mean(),
                "ppo/loss/policy": stats["pg_loss"][-1],
                "ppo/loss/value": stats["vf_loss"][-1],
                "ppo/loss/total": stats["loss"][-1],
                "ppo/policy/approxkl": stats["approxkl"][-1],
                "ppo/policy/clipfrac": stats["clipfrac"][-1].float(),
                "ppo/policy/entropy": stats["entropy"][-1],
                "ppo/returns/mean": returns.mean(),
                "ppo/returns/var": returns.var(),
                "ppo/val/vpred": last["vpred"],
                "ppo/val/error": last["error"],
                "ppo/val/clipfrac": last["vf_clipfrac"],
                "ppo/val/mean": values.mean(),
                "ppo/val/var": values.var(),
                "ppo/val/ratio": last["ratio"],
                "ppo/val/advantage": advantages.mean(),
                "ppo/val/num_eos_tokens": (responses == tokenizer.eos_token_id).sum().float()
                if tokenizer.eos_token_id is not None else torch.tensor(0.0),
            }
            if getattr(rewards.PRESETS.get(args.reward_preset), "label_source", None) == "lexicon":
                # ours, not OpenAI's (their labellers were people): the programmatic labeller's own score of the
                # (truncated) responses, so a reader sees whether what the reward model rewards is what it imitates
                texts = tokenizer.batch_decode([p[p != pad_id] for p in postprocessed], skip_special_tokens=True)
                local["objective/lexicon_score"] = torch.tensor(
                    float(np.mean([rewards.lexicon_sentiment_score(t) for t in texts])))
            for k, v in extra_stats.items():  # ppo_kl, pg_clipfrac_lower; rollout_corr/* per micro-batch (bypass)
                local[k if "/" in k else f"ppo/policy/{k}"] = torch.tensor(float(np.mean(v)))
            if correction is not None:
                for k, v in rollout_corr_metrics.items():
                    if isinstance(v, (int, float)) or (torch.is_tensor(v) and v.numel() == 1):
                        local[k] = torch.as_tensor(float(v))
            keys = sorted(local)
            reduced = all_mean(torch.stack([torch.as_tensor(local[k], dtype=torch.float32, device=device).reshape(())
                                            for k in keys])).tolist()
            metrics = dict(zip(keys, reduced))
            # [repro]: variance of the per-micro-batch mean ratios (all epochs, all ranks; unbiased), and the variance
            # of the advantage means of each whitening group (each rank, in [repro]; unbiased); 0.0 for a single value
            ratio_means = all_gather_cat(torch.stack(stats["ratio"]).float())
            metrics["ppo/val/ratio_var"] = ratio_means.var().item() if ratio_means.numel() > 1 else 0.0
            group = args.whiten_group_size or local_batch
            group_means = advantages.reshape(-1, group, advantages.shape[1]).mean((1, 2))
            group_means = all_gather_cat(group_means.float())
            metrics["ppo/val/advantage_var"] = group_means.var().item() if group_means.numel() > 1 else 0.0
            # OAI train_policy.py: var_explained = 1 - error / returns var, from the rank-averaged error (mean over
            # every PPO step) and the per-rank population variance of the returns (tf.nn.moments)
            error_var = all_mean(torch.stack([torch.stack(stats["vf_error"]).mean(), returns.var(unbiased=False)]))
            metrics["ppo/val/var_explained"] = 1.0 - (error_var[0] / error_var[1]).item()
        # [policy 11]: adapt beta with the KL averaged over ALL ranks. [repro] passed each rank's own mean_kl, so the
        # ranks' betas (and hence their rewards) drifted apart; the all-reduced value keeps them identical.
        kl_coef_used = kl_coef
        if args.adaptive_kl:
            kl_coef = adaptive_kl_update(kl_coef, metrics["objective/kl"], args.rollout_batch_size,
                                         args.kl_target, args.kl_horizon)
        metrics.update({"objective/kl_coef": kl_coef_used, "ppo/lr": lrnow, "ppo/episode": global_step,
                        "step": update, "time/elapsed_s": time.time() - start_time})
        if rank == 0:
            write_jsonl(metrics_path, metrics)
            if wandb is not None:
                wandb.log(metrics, step=update)
            eps_per_s = (update - start_update + 1) * args.rollout_batch_size / (time.time() - start_time)
            print(f"update {update}/{num_updates} episode {global_step} score {metrics['objective/scores']:.3f} "
                  f"kl {metrics['objective/kl']:.3f} beta {kl_coef_used:.4f} "
                  f"approxkl {metrics['ppo/policy/approxkl_avg']:.4f} "
                  f"clipfrac {metrics['ppo/policy/clipfrac_avg']:.3f} {eps_per_s:.0f} episodes/s", flush=True)

            # 9. a sample table: query, (truncated) response, score, kl --------------------------------------------
            if args.sample_freq and (update % args.sample_freq == 0 or update == start_update):
                rows = []
                for i in range(min(args.num_samples, local_batch)):
                    rows.append(dict(
                        step=update,
                        query=tokenizer.decode(queries[i][queries[i] != pad_id]),
                        response=tokenizer.decode(postprocessed[i][postprocessed[i] != pad_id]),
                        score=float(scores[i]), kl=float(kl[i].sum())))
                    write_jsonl(samples_path, rows[-1])
                if wandb is not None:
                    wandb.log({"samples": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])},
                              step=update)

        # 10. checkpoint (HF policy + value head + optimizer + kl_coef + RNG) every save_freq updates and at the end
        if (args.save_freq and update % args.save_freq == 0) or update == num_updates:
            save_checkpoint(args.output_dir, update, global_step, model, tokenizer, optimizer, kl_coef, args, rank,
                            args.keep_checkpoints)

    # 11. the final policy in HF format, plus a checksum every rank writes (the 2-process test compares them) -----
    if rank == 0:
        final = os.path.join(args.output_dir, "policy")
        model.lm.save_pretrained(final)
        tokenizer.save_pretrained(final)
        torch.save(model.value_head.state_dict(), os.path.join(final, "value_head.pt"))
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in model.parameters()))
        abs_checksum = float(sum(p.double().abs().sum() for p in model.parameters()))
    with open(os.path.join(args.output_dir, f"final_rank{rank}.json"), "w") as f:
        json.dump(dict(rank=rank, checksum=checksum, abs_checksum=abs_checksum, kl_coef=kl_coef), f)
    barrier()
    if wandb is not None:
        wandb.finish()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return args.output_dir


if __name__ == "__main__":
    cli_args = tyro.extras.overridable_config_cli(PRESETS)
    if cli_args.dry_run:  # the plan only: no model, no data, no process group
        sys.exit(dry_run(cli_args))
    try:  # bad input: one line on stderr and exit code 2 (argparse's convention), before any model loads
        validate_args(cli_args, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        print(f"ppo_rlhf.py: error: {e}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    corrections.train_or_fail_fast(train, cli_args)  # under torchrun a failing rank ends the job at once
