"""GRPO (Group Relative Policy Optimization) the way verl and TRL train it, in one file you can step
through.

    python grpo.py tiny --output-dir runs/grpo_tiny                      # offline, 2 CPU cores
    python grpo.py tiny --backend vllm --output-dir runs/grpo_tiny_vllm  # the same, vLLM rollouts
    torchrun --standalone --nproc_per_node 2 grpo.py tiny --output-dir runs/grpo_ddp     # 2 CPUs
    torchrun --standalone --nproc_per_node 8 grpo.py gsm8k_qwen05b --output-dir runs/gsm8k  # 8 GPUs

Read it top to bottom: Args (the knobs, in the order the algorithm uses them) -> rollouts and
scores -> pi_old, the correction and pi_ref -> advantages -> the objective (grpo_loss) and the
update -> train() -> checks, setup and logging -> PRESETS -> main(). train() is the table of
contents; one training step, numbered as there:
    1. roll out: n samples per prompt from the rollout engine (rollout.py), with the sampler's
       logprobs (pi_rollout); with --tools, turn after turn with the tools' answers between the
       turns (rollout.sample_turns, tools.py), the response mask 1 on the policy's tokens only
    2. score: each response's rule-based reward (tasks.py), minus DAPO's overlong penalty when it
       is on; DAPO's dynamic sampling repeats steps 1-2 on more prompts until train_batch_size
       groups whose rewards differ are in hand
    3. pi_old, the correction, pi_ref: the trainer's no-grad recompute of pi_old (decoupled),
       corrected against pi_rollout once per batch: IS weights and an RS/veto mask that replaces
       the response mask; or pi_rollout itself (bypass); pi_ref when the KL loss is on. verl's
       order: its fit loop corrects before it computes the advantages (ray_trainer.py)
    4. advantages, from the corrected mask: per prompt group (score - mean) / (std + eps),
       objectives.grpo_advantages (std off for Dr.GRPO), or another estimator of objectives.py
       (--adv-estimator: RLOO, REINFORCE++, ReMax, OPO, pass@k, GPG, GDPO, the optimal token
       baseline from pi_old)
    5. update: grpo_loss, one micro-batch's whole objective: PPO's clipped surrogate
       (objectives.ppo_clip_token_loss; another loss of objectives.py with --policy-loss) times the
       correction's IS weights, over the tokens its rejection mask keeps, + the KL-to-reference and
       entropy terms; update_policy runs it over minibatches of micro-batches, averages the
       gradients over ranks, clips them and takes one optimizer step per minibatch
    6. sync: publish the updated weights to where the rollouts come from: the engine gets them for
       the next rollout (with --rollout-staleness K, the weights K updates older; with
       --async-rollouts, the producer keeps them for its coming batches)
    7. log (metrics.jsonl, wandb), validate every val_every steps, checkpoint every save_every steps

Plumbing a first read can skip: every `harness.` call (processes, checkpoints and logs live in
harness.py), every `memory.` call (the GPU memory plan, recomputed and compiled layers), and the
section "Checks, setup, validation and logging" after train(). `source` (rollout.RolloutSource) is
where each step's rollouts come from, whichever engine samples them (the engine synced after every
update, a copy K updates behind it, or a producer thread sampling ahead): train() asks it in steps
1 and 6. log pi itself is logprobs.py: its first function is the definition, which a tiny run on a
CPU calls.

Sources: verl's GRPO (verl/trainer/ppo/core_algos.py: compute_grpo_outcome_advantage,
compute_policy_loss_vanilla, agg_loss; verl/trainer/ppo/ray_trainer.py: the loop and the masks),
verl's "Mathematical Formulations of Rollout Correction Methods" (docs/algo/rollout_corr_math.md:
decoupled vs bypass, presets, metrics) and Yao et al. 2025, "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training" (the rollout/trainer mismatch), DAPO (Yu et al. 2025,
arXiv:2503.14476: dynamic sampling, overlong shaping, clip-higher) and Qi et al. 2025
(arXiv:2510.26788, --precision fp16). The objective's terms live in objectives.py (the GRPO family:
estimators and losses), the rollout correction in corrections.py, log pi in logprobs.py, the tasks
in tasks.py.
"""

import collections
import functools
import math
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

import corrections
import harness
import logprobs
import lora
import memory
import objectives
import rollout
import tasks
import tools

LR_SCHEDULERS = ("constant", "cosine")
# model_name_or_path value that means: build tasks.build_tiny_model into <output_dir>/tiny_model
TINY_MODEL = "tiny"
TINY_MAX_POSITIONS = 256  # max_position_embeddings of the tiny model (checked before building it)


# --------------------------------------------------------------------------------------------------
# Arguments (the presets are at the end of the file, beside main())
# --------------------------------------------------------------------------------------------------


@dataclass
class GRPOArgs:
    """GRPO's own flags, grouped in the order the algorithm uses them. Args below adds the flags of
    the rooms that read them, flat on the command line and in args.json: the run's
    (harness.CheckpointedRunArgs), the rollout engine's and asynchrony's (rollout.EngineArgs,
    rollout.AsyncArgs), memory's (memory.MemoryArgs) and LoRA's (lora.LoraArgs)."""

    # --- group sampling (step 1): n responses per prompt, their temperature and lengths
    rollout_n: int = 8
    """Samples per prompt: the GRPO group size (verl rollout.n; not `--n`, which torchrun takes for
    --nnodes)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's logprobs use the same log_softmax(logits / T)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the most likely tokens whose probability reaches top_p (1: off;
    Qwen2.5-Instruct's generation config ships 0.8)."""
    top_k: int = 0
    """Draw from the k most likely tokens only (0: off; Qwen2.5-Instruct ships 20)."""
    min_p: float = 0.0
    """Drop the tokens below min_p x the most likely token's probability (0: off)."""
    replay_sampling_mask: bool = True
    """With --top-p/--top-k/--min-p: score each sampled token over the kept set the sampler drew
    from (recomputed from the trainer's logits by the engine's rules, logprobs.truncation_mask),
    so pi_train / pi_rollout is 1 before any update; --no-replay-sampling-mask scores it over the
    whole vocabulary, as most frameworks do, a ratio of S (the kept mass, < 1) on every token."""
    max_prompt_length: int = 16
    """Prompts longer than this (in tokens) are dropped (verl filter_overlong_prompts)."""
    max_response_length: int = 6
    """max_new_tokens; responses are padded to exactly this length (as verl pads them)."""
    val_temperature: float = 0.0
    """Validation sampling temperature; 0 = greedy (verl val_kwargs do_sample=False)."""

    # --- batch sizes (global, over all ranks, like verl)
    train_batch_size: int = 32
    """Prompts per step (verl data.train_batch_size); sequences per step = train_batch_size * n."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step (verl ppo_mini_batch_size; times n inside, as in verl)."""
    ppo_micro_batch_size_per_gpu: int = 32
    """Sequences per forward/backward on one rank (gradient accumulation over a minibatch)."""
    ppo_epochs: int = 1
    """Passes over each step's data (verl ppo_epochs)."""

    # --- the loss (step 5: grpo_loss)
    policy_loss: str = "vanilla"
    """objectives.POLICY_LOSSES (verl loss_mode): vanilla (PPO-clip), gspo, cispo, gpg, sapo,
    geo_mean, clip_cov, kl_cov, dppo_tv, dppo_kl or dro (sapo, geo_mean: --loss-agg-mode
    seq-mean-token-mean only; dro: --dro-beta > 0; dppo_*: the clip ratios are probability / KL
    bounds)."""
    dro_beta: float = 0.0
    """DRO's quadratic log-ratio penalty coefficient (verl policy_loss.dro_beta; > 0 with
    --policy-loss dro, unused otherwise)."""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio lower bound 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio upper bound 1 + clip_ratio_high (DAPO's clip-higher: > clip_ratio_low, e.g.
    0.28)."""
    clip_ratio_c: Optional[float] = 3.0
    """Dual-clip constant for negative advantages (verl default 3.0); None turns dual-clip off."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm | token-sum
    (verl)."""
    kl_loss_coef: float = 0.0
    """beta of the KL-to-reference loss (verl use_kl_loss); 0 skips the reference model entirely
    (not even loaded)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator (objectives.kl_penalty kinds): k1/kl, abs, k2/mse, k3/low_var_kl; with "+"
    (e.g. k3+) its value with k2's gradient (verl)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (verl default 0); entropy is always logged."""
    off_policy_mask_threshold: Optional[float] = None
    """DeepSeek-V3.2's off-policy sequence mask (TRL's name): drop the negative-advantage sequences
    whose mean log(pi_rollout / pi_theta) exceeds this (e.g. 0.5); None = off
    (corrections.off_policy_sequence_mask)."""
    use_bias_correction_kl: bool = False
    """DeepSeek-V3.2's unbiased KL loss (TRL's name): each token's KL estimate times pi_theta /
    pi_old, since the tokens were sampled from pi_old, not pi_theta (needs --kl-loss-coef > 0)."""

    # --- advantages (step 4)
    adv_estimator: str = "grpo"
    """objectives.ADV_ESTIMATORS (verl adv_estimator): grpo, rloo, reinforce_plus_plus(_baseline),
    remax (baseline: the greedy answer's score, generated each step), opo, grpo_passk, gpg, gdpo
    (each reward component normalised in its group: tasks.py's format and answer),
    optimal_token_baseline (a baseline per token from step 3's pi_old probabilities) or
    tir_optimal_token_baseline (the same over each response's model tokens: multi-turn)."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group std (grpo, grpo_passk); False is Dr.GRPO (score - group mean)."""

    # --- DAPO (Yu et al. 2025, arXiv:2503.14476): dynamic sampling, overlong reward shaping
    dynamic_sampling: bool = False
    """Drop prompt groups whose rewards are all equal (no gradient signal; verl filter_groups with
    metric "reward") and roll out more prompts until train_batch_size groups remain."""
    max_num_gen_batches: int = 10
    """Dynamic sampling: at most this many rollouts per step; if they hold too few groups with
    signal the run ends there, saved, in one line (verl filter_groups.max_num_gen_batches; 0 = no
    cap)."""
    overlong_buffer_len: int = 0
    """Overlong shaping: the last this-many tokens before max_response_length cost up to
    overlong_penalty_factor of reward, linearly (verl overlong_buffer.len; 0 = off)."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at max_response_length tokens (verl overlong_buffer.penalty_factor)."""

    # --- optimisation
    total_steps: int = 150
    """Training steps (one step = one rollout batch and the updates on it)."""
    lr: float = 1e-3
    """AdamW peak learning rate (see lr_scheduler_type; verl actor.optim.lr)."""
    lr_warmup_steps: int = -1
    """Linear warmup from lr 0 over this many steps; <= 0 defers to lr_warmup_steps_ratio (verl
    actor.optim)."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup steps = int(ratio * total_steps) if lr_warmup_steps <= 0 (verl's default: 0)."""
    lr_scheduler_type: str = "constant"
    """After warmup: constant (verl's default) or cosine (to lr * min_lr_ratio at the end)."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr (verl actor.optim.min_lr_ratio)."""
    num_cycles: float = 0.5
    """Cosine waves over the decay (verl's 0.5: one half-cosine from lr down to the floor)."""
    weight_decay: float = 0.0
    """AdamW weight decay (verl's actor default is 0.01)."""
    max_grad_norm: float = 1.0
    """Gradient clipping (verl grad_clip=1.0); a non-finite norm stops the run before the step
    (verl skips the step and goes on); under --precision fp16 it is the loss scaler's overflow: the
    step is skipped."""
    lm_head_precision: str = "auto"
    """The LM head's product (the log-softmax is float32 always): auto (TF32 on CUDA under bf16 or
    fp16 autocast, else IEEE fp32), fp32, tf32, or bf16 (bfloat16 inputs, float32 logits); a CPU
    always runs IEEE fp32 (docs/logprobs.md#lm-head-precision measures each)."""
    precision: str = "auto"
    """Forward dtype over fp32 master weights: auto (bf16 on CUDA, fp32 on CPU), fp32, bf16 (verl's
    FSDP mixed precision) or fp16 (float16 autocast + a gradient scaler, Qi et al. 2025); the
    rollout engine follows (--vllm-dtype auto)."""

    # --- the model and the task (tasks.py)
    model_name_or_path: str = TINY_MODEL
    """HF hub name or local directory of the policy; "tiny" builds an offline tiny random-init model
    (tasks.build_tiny_model, --tiny-arch)."""
    tiny_arch: str = "qwen2"
    """Architecture of the "tiny" model: qwen2 (RoPE positions, as the Qwen2.5 presets) or gpt2
    (learned absolute positions: the tiny preset's, docs/grpo.md "Does the first run learn")."""
    tiny_tied_embeddings: bool = True
    """The "tiny" model's LM head shares the input embedding matrix (as gpt2 and the small Qwen2.5
    models); False gives it its own, which LoRA may then adapt."""
    tiny_pretrain_steps: int = 0
    """Supervised steps that pretrain the "tiny" model before RL (tasks.pretrain_tiny_model): on
    two other maps of the copy task's words, reversing and shifting them, a base for LoRA to adapt
    (tiny_lora); on the lookup task's format, a call in 1 example of 10 (tiny_tools). 0: the
    random-init model."""
    task: str = "copy"
    """copy (offline), lookup (offline: the answer is the lookup tool's, --tools lookup), arith
    (offline word problems), gsm8k (openai/gsm8k) or countdown (Countdown-Tasks-3to4)."""
    use_chat_template: bool = False
    """Wrap each prompt with the tokenizer's chat template (verl's gsm8k/countdown preprocessing
    does)."""
    train_size: int = 4096
    """Training prompts: copy/arith make this many, countdown takes the dataset's first N rows,
    gsm8k all of train."""
    val_size: int = 64
    """Held-out prompts: copy/arith make this many (never in training); gsm8k/countdown: the first N
    of the test split (0 = all of it)."""
    copy_length: int = 3
    """copy task: letters per prompt."""
    arith_max_steps: int = 1
    """arith task: operations per problem, 1..arith_max_steps."""
    arith_max_number: int = 20
    """arith task: numbers in the problems are drawn from 2..arith_max_number."""
    gsm8k_reward_mode: str = "strict"
    """gsm8k/arith answer extraction (tasks.gsm8k_reward): strict (verl's default), flexible,
    normalized."""

    # --- the rollout/trainer mismatch (rollout.py) and its correction (corrections.py)
    mismatch: str = "none"
    """Round the rollout weights (rollout.apply_mismatch): a controlled rollout/trainer mismatch to
    correct."""
    correction: str = "disabled"
    """A corrections.PRESET_SETTINGS name; disabled (verl's default) = plain PPO against the
    recomputed pi_old."""

    # --- validation (step 7)
    val_every: int = 10
    """Validate every N steps (and at the end); 0 = never."""
    val_before_train: bool = True
    """Validate once before the first step, logged as step 0 (verl trainer.val_before_train); not on
    resume."""


@dataclass
class Args(
    lora.LoraArgs,
    memory.MemoryArgs,
    rollout.AsyncArgs,
    tools.ToolArgs,
    rollout.EngineArgs,
    harness.CheckpointedRunArgs,
    GRPOArgs,
):
    """grpo.py's flags: GRPO's own (GRPOArgs) first in --help, a dataclass listing its last base's
    fields first, then the run's (--seed, --output-dir, --save-every, --resume-from, --track, ...),
    the rollout engine's (--backend, --vllm-*), multi-turn tool use (--tools, ...), staleness and
    asynchrony (--rollout-staleness, --async-rollouts, ...), memory (--gradient-checkpointing, ...)
    and LoRA (--lora-rank, ...)."""

    # grpo.py's defaults of the shared run flags
    exp_name: str = "grpo"
    output_dir: str = "runs/grpo"
    wandb_project: str = "grpo"
    num_log_samples: int = 4


# --------------------------------------------------------------------------------------------------
# Steps 1-2: prompts, rollouts and scores (DAPO's dynamic sampling)
# --------------------------------------------------------------------------------------------------


def step_prompt_indices(step, n_train, args, rank, world_size, gen_batch=0):
    """Indices of this rank's prompts at `step`: a function of (seed, step) only, so resume replays
    the data order. Epoch e visits the training set in the order torch.randperm(n_train, seed + e);
    the last partial batch of an epoch is dropped (verl's dataloader drop_last). Rank r takes the
    r-th contiguous slice of the global batch. Dynamic sampling's extra generation batches
    (gen_batch >= 1) take the first train_batch_size prompts of a permutation seeded by (seed, step,
    gen_batch): a function of (seed, step) too."""
    steps_per_epoch = n_train // args.train_batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"train_batch_size={args.train_batch_size} is larger than the training set ({n_train})"
        )
    epoch, index = divmod(step, steps_per_epoch)
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed + epoch))
    batch = perm[index * args.train_batch_size : (index + 1) * args.train_batch_size]
    if gen_batch > 0:
        seed = 1_000_003 * args.seed + 1009 * step + gen_batch
        perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed))
        batch = perm[: args.train_batch_size]
    per_rank = args.train_batch_size // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank].tolist()


def sampling_seed(args, step, rank, gen_batch=0):
    """A distinct sampling seed per (rank, step, generation batch) (seed + rank * 100003 style),
    independent of the RNG state."""
    return args.seed + 100003 * rank + 7919 * (step + 1) + 1_000_033 * gen_batch


def roll_out(backend, task, tokenizer, indices, seed, args):
    """Steps 1-2 for the training prompts `indices`: (response_ids, rollout_logprobs,
    finish_reasons, scores, tool_use). Responses come grouped by prompt (prompt j's n samples are
    rows j*n .. j*n+n-1), each with the sampler's logprob of every token (pi_rollout)."""
    # 1. Rollout: n samples per prompt from the rollout engine, with pi_rollout's logprobs
    response_ids, rollout_logprobs, finish_reasons, tool_use = sample_responses(
        backend,
        task,
        [task.train_prompt_ids[i] for i in indices],
        args.rollout_n,
        args.temperature,
        seed,
        args,
    )
    # 2. Rewards: each response's rule-based score against its prompt's example
    examples = [task.train[i] for i in indices for _ in range(args.rollout_n)]
    scores = score_responses(response_ids, examples, tokenizer, task.reward_fn, args, tool_use)
    return response_ids, rollout_logprobs, finish_reasons, scores, tool_use


def sample_responses(engine, task, prompt_ids, n, temperature, seed, args):
    """n responses per prompt from `engine`: (response_ids, rollout_logprobs, finish_reasons,
    tool_use). One turn each (engine.generate: tool_use None); with --tools, turn after turn
    (rollout.sample_turns: the policy's turns with the tools' answers between them), tool_use
    then a dict of per-response lists: model_masks (1 on a sampled token, 0 on a tool's: the
    batch's response_mask), tool_calls, tool_failures."""
    if task.environment is None:
        response_ids, rollout_logprobs, finish_reasons = engine.generate(
            prompt_ids, n, args.max_response_length, temperature, seed
        )
        return response_ids, rollout_logprobs, finish_reasons, None
    response_ids, rollout_logprobs, model_masks, finish_reasons, calls, failures = (
        rollout.sample_turns(
            engine,
            task.environment,
            prompt_ids,
            n,
            args.max_response_length,
            temperature,
            seed,
            args.max_assistant_turns,
        )
    )
    tool_use = {"model_masks": model_masks, "tool_calls": calls, "tool_failures": failures}
    return response_ids, rollout_logprobs, finish_reasons, tool_use


def answer_ids(response_ids, tool_use):
    """What a reward reads of each response: all of it, or with --tools its last turn
    (tools.final_turn): the policy's answer, never a tool's output."""
    if tool_use is None:
        return response_ids
    return [tools.final_turn(ids, mask) for ids, mask in zip(response_ids, tool_use["model_masks"])]


def score_responses(response_ids, examples, tokenizer, reward_fn, args, tool_use=None):
    """(B,) float scores: the rule-based reward of each response for its example, minus DAPO's
    overlong penalty when --overlong-buffer-len is on. A multi-turn response is scored on its last
    turn (tools.final_turn): the policy's answer, not what a tool wrote."""
    texts = [tasks.response_text(tokenizer, ids) for ids in answer_ids(response_ids, tool_use)]
    scores = torch.tensor([reward_fn(text, example) for text, example in zip(texts, examples)])
    if args.overlong_buffer_len:
        scores += tasks.overlong_penalty(
            torch.tensor([len(ids) for ids in response_ids]),
            args.max_response_length,
            args.overlong_buffer_len,
            args.overlong_penalty_factor,
        )
    return scores


def has_reward_signal(group_scores):
    """DAPO's dynamic-sampling rule as verl 0.9.1 applies it (trainer/ppo/v1/replay_buffer.py,
    _dapo_filtered_keys): a group of more than one response whose rewards are all equal (all right,
    or all wrong) gives every response advantage 0, so no gradient; it is dropped. Every other group
    is kept. verl tests np.std == 0, which the rounding of the mean can miss (np.std of 64 scores of
    2.2 is 4.4e-16); max == min cannot."""
    return not (len(group_scores) > 1 and max(group_scores) == min(group_scores))


def dynamic_sampling(step, backend, task, tokenizer, args, rank, world_size):
    """DAPO's dynamic sampling (Yu et al. 2025, section 3.2; verl filter_groups): steps 1-2 on one
    generation batch of fresh prompts after another, keeping the groups whose rewards differ
    (has_reward_signal), until train_batch_size groups are kept over all ranks. The batch is the
    first train_batch_size kept groups in the order they were drawn (generation batch by generation
    batch, rank by rank), rank r the r-th slice: every rank gets the same number of groups, hence
    of micro-batches (one with fewer would leave the others waiting in a collective); the surplus
    is discarded, as in verl.

    Returns (indices, what roll_out returns for them, metrics); (None, None, metrics) when
    --max-num-gen-batches generation batches held too few groups with signal."""
    n = args.rollout_n
    kept = []  # this rank's groups with signal, tagged with where they were drawn
    gen_batch = 0
    while True:
        indices = step_prompt_indices(step, len(task.train), args, rank, world_size, gen_batch)
        seed = sampling_seed(args, step, rank, gen_batch)
        response_ids, rollout_logprobs, finish_reasons, scores, tool_use = roll_out(
            backend, task, tokenizer, indices, seed, args
        )
        for g, index in enumerate(indices):
            rows = slice(g * n, (g + 1) * n)
            group = {
                "gen_batch": gen_batch,
                "rank": rank,
                "prompt": index,
                "responses": response_ids[rows],
                "logprobs": rollout_logprobs[rows],
                "finish_reasons": finish_reasons[rows],
                "scores": scores[rows].tolist(),
                "tool_use": None
                if tool_use is None
                else {key: values[rows] for key, values in tool_use.items()},
            }
            if has_reward_signal(group["scores"]):
                kept.append(group)
        gen_batch += 1
        kept_groups = harness.all_sum(torch.tensor(len(kept))).item()
        if kept_groups >= args.train_batch_size or gen_batch == args.max_num_gen_batches:
            break
    metrics = {"filter_groups/gen_batches": gen_batch, "filter_groups/kept_groups": kept_groups}
    if kept_groups < args.train_batch_size:
        return None, None, metrics
    everyone = harness.all_gather_objects(kept)  # [rank 0's kept groups, rank 1's, ...]
    ordered = sorted(
        (group for rank_groups in everyone for group in rank_groups),
        key=lambda group: (group["gen_batch"], group["rank"]),
    )
    per_rank = args.train_batch_size // world_size
    mine = ordered[: args.train_batch_size][rank * per_rank : (rank + 1) * per_rank]
    tool_use = None
    if task.environment is not None:
        tool_use = {
            key: [value for group in mine for value in group["tool_use"][key]]
            for key in ("model_masks", "tool_calls", "tool_failures")
        }
    rollout_batch = (
        [ids for group in mine for ids in group["responses"]],
        [logprobs for group in mine for logprobs in group["logprobs"]],
        [reason for group in mine for reason in group["finish_reasons"]],
        torch.tensor([score for group in mine for score in group["scores"]]),
        tool_use,
    )
    return [group["prompt"] for group in mine], rollout_batch, metrics


def sample_step(step, backend, task, tokenizer, args, rank, world_size):
    """Steps 1-2 of training step `step` with `backend`: (prompt indices, roll_out's result for
    them, the rollout's metrics: DAPO's filter's, and with --tools the turns' and the calls',
    tools.tool_metrics). With --dynamic-sampling, DAPO's batch; else the step's prompts."""
    if args.dynamic_sampling:
        indices, rollout_batch, metrics = dynamic_sampling(
            step, backend, task, tokenizer, args, rank, world_size
        )
    else:
        indices = step_prompt_indices(step, len(task.train), args, rank, world_size)
        seed = sampling_seed(args, step, rank)
        rollout_batch = roll_out(backend, task, tokenizer, indices, seed, args)
        metrics = {}
    tool_use = rollout_batch[4] if rollout_batch is not None else None
    if tool_use is not None:  # --tools: the turns, the calls and their failures
        metrics |= tools.tool_metrics(**tool_use)
    return indices, rollout_batch, metrics


# --------------------------------------------------------------------------------------------------
# Step 3: pi_old and pi_ref, with the run's log pi settings (logprobs.py computes log pi); the
# rollout correction between them is corrections.py's, called in train()
# --------------------------------------------------------------------------------------------------


def logprob_settings(args, model, rank=0):
    """The run's logprobs.LogprobSettings, built once in train(): every log pi of the run (pi_old,
    pi_ref, pi_theta) scores the sampled tokens with the same temperature, chunk size, forward and
    LM-head precision, sampler to replay, and layout of a micro-batch: with --use-remove-padding
    its real tokens packed, where the policy's attention keeps packed sequences apart
    (logprobs.packing_is_exact: a tiny forward on every rank), else its padding-only columns cut,
    said once."""
    layout = "padded"
    if args.use_remove_padding:
        layout = "packed" if logprobs.packing_is_exact(model) else "trimmed"
        if layout == "trimmed" and rank == 0:
            print(
                "--use-remove-padding: this model's attention does not keep packed sequences "
                "apart (logprobs.packing_is_exact), so each micro-batch is trimmed to its longest "
                "prompt and response instead",
                flush=True,
            )
    return logprobs.LogprobSettings(
        temperature=args.temperature,
        chunk_size=args.logprob_chunk_size,
        precision=args.precision,
        head_precision=args.lm_head_precision,
        truncation=replayed_truncation(args),
        layout=layout,
    )


def replayed_truncation(args):
    """What the trainer's logprobs replay of a truncated sampler (--top-p/--top-k/--min-p with
    --replay-sampling-mask): (top_k, top_p, min_p, the engine's order), or None (the whole
    vocabulary)."""
    if not args.replay_sampling_mask:
        return None
    return rollout.sampling_truncation(args, args.backend)


@torch.no_grad()
def batch_logprobs(model, batch, args, log_pi, sum_pi_squared=False, left_out_of_kept_set=False):
    """{"logprobs": (B, R), "entropy": (B, R)} of the whole local batch under `model`, no
    gradient, one micro-batch at a time (logprobs.response_logprobs); with sum_pi_squared also
    "sum_pi_squared" (B, R), sum_v pi(v)^2, and with left_out_of_kept_set "left_out_of_kept_set"
    (B, R), 1.0 where the replayed kept set leaves out the sampled token."""
    names = ["logprobs", "entropy"]
    names += ["sum_pi_squared"] if sum_pi_squared else []
    names += ["left_out_of_kept_set"] if left_out_of_kept_set else []
    stats = {name: torch.zeros_like(batch["response_mask"]) for name in names}
    # --ppo-micro-batch-size-per-gpu rows at a time, or groups by --ppo-max-token-len-per-gpu
    for rows in memory.micro_batches(batch["attention_mask"], 0, len(batch["responses"]), args):
        micro_batch = {name: value[rows] for name, value in batch.items()}
        part = logprobs.response_logprobs(
            model,
            micro_batch,
            log_pi,
            sum_pi_squared=sum_pi_squared,
            left_out_of_kept_set=left_out_of_kept_set,
        )
        for name, value in zip(names, part):
            stats[name][rows] = value
    return stats


def compute_pi_old(model, batch, args, log_pi, correction, world_size=1):
    """Step 3's pi_old, the PPO anchor: (old_logprobs (B, R), sum_pi_squared (B, R) or None,
    metrics).

    decoupled ("disabled" included): the trainer's no-grad recompute before the update; its
        metrics are actor/entropy, pi_old's entropy over the response mask of the whole batch (all
        ranks) with loss_agg_mode, as verl logs it (ray_trainer.py, after compute_old_log_prob),
        and with a replayed truncated sampler training/sampled_outside_kept_set: the sampled
        tokens that the kept set, recomputed from the trainer's logits, leaves out (the sampler
        kept them, so there the two sets differ; the engine's own set is not read, see
        docs/logprobs.md)
    bypass: pi_rollout itself, no recompute (that forward is saved) and no metrics
    sum_pi_squared: sum_v pi_old(v)^2 of each token from the same pass, for the optimal token
        baseline (verl actor.calculate_sum_pi_squared); None for every other estimator."""
    model.eval()
    if correction.bypass_mode:
        return batch["rollout_logprobs"], None, {}
    token_level = args.adv_estimator in objectives.TOKEN_LEVEL_ESTIMATORS
    replayed = log_pi.truncation is not None
    old = batch_logprobs(
        model, batch, args, log_pi, sum_pi_squared=token_level, left_out_of_kept_set=replayed
    )
    whole_batch = dict(
        dp_size=world_size,
        batch_num_tokens=harness.all_sum(batch["response_mask"].sum().double()).item(),
        global_batch_size=args.train_batch_size * args.rollout_n,
    )
    old_entropy = objectives.agg_loss(
        old["entropy"], batch["response_mask"], args.loss_agg_mode, **whole_batch
    )
    metrics = {"actor/entropy": old_entropy.item()}
    if replayed:
        metrics["training/sampled_outside_kept_set"] = corrections.masked_mean(
            old["left_out_of_kept_set"], batch["response_mask"]
        ).item()
    return old["logprobs"], old.get("sum_pi_squared"), metrics


def reference_logprobs(model, ref_model, batch, args, log_pi):
    """Step 3's pi_ref, the KL loss's anchor: log pi_ref (B, R) of the initial policy, no gradient.
    The frozen reference model, or with --lora-rank the policy itself with its adapter switched off
    (the base is the initial policy: one model in memory, verl's ref_in_actor)."""
    if ref_model is not None:
        return batch_logprobs(ref_model, batch, args, log_pi)["logprobs"]
    with lora.adapter_disabled(model):
        return batch_logprobs(model, batch, args, log_pi)["logprobs"]


# --------------------------------------------------------------------------------------------------
# Step 4: advantages, from the corrected mask
# --------------------------------------------------------------------------------------------------


def greedy_baselines(backend, task, tokenizer, indices, step, args, rank):
    """ReMax's baseline (Li et al. 2024, arXiv:2310.10505): the score of the policy's greedy answer
    to each prompt, one per response (B,), generated with the same engine and weights as step 1."""
    greedy_ids, _, _, tool_use = sample_responses(
        backend,
        task,
        [task.train_prompt_ids[i] for i in indices],
        1,
        0.0,
        sampling_seed(args, step, rank) + 2,
        args,
    )
    examples = [task.train[i] for i in indices]
    greedy_scores = score_responses(greedy_ids, examples, tokenizer, task.reward_fn, args, tool_use)
    return greedy_scores.repeat_interleave(args.rollout_n)


def reward_components(response_ids, indices, task, tokenizer, args):
    """GDPO's scores: each response's named reward components (task.components_fn: format and
    answer for gsm8k, arith, countdown; the reward itself for copy), and DAPO's overlong penalty as
    one more when it is on. Returns ((B, K) float tensor, metrics: each component's mean as
    reward/<name>/mean)."""
    examples = [task.train[i] for i in indices for _ in range(args.rollout_n)]
    texts = [tasks.response_text(tokenizer, ids) for ids in response_ids]
    if task.components_fn is None:
        rows = [{"reward": task.reward_fn(t, e)} for t, e in zip(texts, examples)]
    else:
        rows = [task.components_fn(t, e) for t, e in zip(texts, examples)]
    names = list(rows[0])
    components = torch.tensor([[row[name] for name in names] for row in rows])
    if args.overlong_buffer_len:
        names.append("overlong")
        penalty = tasks.overlong_penalty(
            torch.tensor([len(ids) for ids in response_ids]),
            args.max_response_length,
            args.overlong_buffer_len,
            args.overlong_penalty_factor,
        )
        components = torch.cat([components, penalty[:, None]], dim=1)
    metrics = {
        f"reward/{name}/mean": components[:, k].mean().item() for k, name in enumerate(names)
    }
    return components, metrics


def compute_advantages(scores, group_ids, kept_lengths, baselines, args, device):
    """Step 4: one advantage per response, (B,) float32, on the device (REINFORCE++'s whitening
    all-reduces its sums, and NCCL needs CUDA tensors). A response's return is its score at every
    token (outcome reward, gamma = 1). kept_lengths (B,): the tokens of each response that step 3's
    corrected mask keeps, what the length-dependent estimators count (OPO's weights, the
    whitening of REINFORCE++ and GDPO), as verl's compute_advantage reads the response mask that
    its correction replaced.

    GRPO (objectives.grpo_advantages, verl compute_grpo_outcome_advantage):
        A_i = (score_i - mean of its group) / (std of its group + eps)   (no std: Dr.GRPO)
    --adv-estimator names another estimator of objectives.ADV_ESTIMATORS (each with its formula)."""
    scores = scores.to(device)
    kept_lengths = kept_lengths.to(device)
    if args.adv_estimator == "grpo":
        return objectives.grpo_advantages(
            scores, group_ids, kept_lengths, norm_by_std=args.norm_adv_by_std_in_grpo
        )
    estimator = objectives.ADV_ESTIMATORS[args.adv_estimator]
    return estimator(
        scores, group_ids, kept_lengths, baselines, norm_by_std=args.norm_adv_by_std_in_grpo
    )


# --------------------------------------------------------------------------------------------------
# Step 5: the objective of one micro-batch (grpo_loss) and the update
# --------------------------------------------------------------------------------------------------


def grpo_loss(new_logprobs, entropy, micro_batch, args, correction, global_info):
    """GRPO's objective on one micro-batch, every term in this one frame (verl dp_actor.py
    update_policy; core_algos.py compute_policy_loss_vanilla, agg_loss). Per response token t, with
    A the response's advantage (step 4) and r_t = pi_theta(a_t) / pi_old(a_t) (pi_old: step 3):

        l_t     = max(-A r_t, -A clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)),
                  at most -A clip_ratio_c when A < 0 (dual-clip)    (objectives.ppo_clip_token_loss)
        pg_loss = agg over M of (w_t l_t)     w: the correction's IS weights (none: w = 1),
                                              M: the response tokens its rejection mask keeps
        loss    = pg_loss - entropy_coeff agg over M of (H_t)
                          + kl_loss_coef agg over M of (KL_t(pi_theta || pi_ref))

    agg is --loss-agg-mode over the minibatch's global counts (`global_info`, see update_policy).
    The other objectives of objectives.py swap l_t: another loss of the catalogue (--policy-loss,
    named_policy_loss), bypass mode's (pi_old = pi_rollout, w and M from this micro-batch's
    pi_theta: bypass_mode_loss). DeepSeek-V3.2 (arXiv:2512.02556): --off-policy-mask-threshold
    masks l_t by sequence, --use-bias-correction-kl weights KL_t by r_t.

    new_logprobs, entropy: (b, R) of the current policy. micro_batch: its rows of the step's batch.
    Returns (loss, the terms to log, the policy loss's metrics, bypass mode's correction metrics).
    """
    # (b,) -> (b, R): each response's advantage at its tokens (the token-level baseline: (b, R))
    advantages = micro_batch["advantages"]
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(new_logprobs)
    old_logprobs = micro_batch["old_logprobs"]
    # step 3's correction: the tokens its rejection mask keeps (all, without one) and the IS
    # weights pi_old / pi_rollout (absent without IS)
    loss_mask = micro_batch["loss_mask"]
    is_weights = micro_batch.get("is_weights")

    # The policy-gradient term per token: PPO's clipped surrogate of r = pi_theta / pi_old, with
    # clip-higher and dual-clip (the default), or another objective of objectives.py.
    clip = (args.clip_ratio_low, args.clip_ratio_high, args.clip_ratio_c)
    pg_mask, corr_metrics = loss_mask, {}
    if args.policy_loss == "vanilla" and not correction.bypass_mode:
        pg_losses, pg_metrics = objectives.ppo_clip_token_loss(
            new_logprobs, old_logprobs, advantages, loss_mask, *clip
        )
    elif correction.bypass_mode:
        pg_losses, pg_mask, is_weights, pg_metrics, corr_metrics = objectives.bypass_mode_loss(
            new_logprobs, old_logprobs, advantages, loss_mask, correction, *clip
        )
    else:
        pg_losses, pg_metrics = objectives.named_policy_loss(
            args.policy_loss,
            new_logprobs,
            old_logprobs,
            advantages,
            loss_mask,
            *clip,
            args.dro_beta,
        )
    if args.off_policy_mask_threshold is not None:
        # DeepSeek-V3.2: drop the negative-advantage sequences the policy has drifted far from
        keep, mask_metrics = corrections.off_policy_sequence_mask(
            new_logprobs,
            micro_batch["rollout_logprobs"],
            advantages,
            pg_mask,
            args.off_policy_mask_threshold,
        )
        pg_losses = pg_losses * keep
        pg_metrics = {**pg_metrics, **mask_metrics}
    if is_weights is not None:
        # the IS weights multiply the clipped term (decoupled PPO)
        pg_losses = pg_losses * is_weights
    pg_loss = objectives.agg_loss(pg_losses, pg_mask, args.loss_agg_mode, **global_info)

    # Entropy and KL terms over the same mask (decoupled: the corrected one, as verl's
    # compute_rollout_correction_and_add_to_batch replaces response_mask for every loss term).
    entropy_loss = objectives.agg_loss(entropy, loss_mask, args.loss_agg_mode, **global_info)
    loss = pg_loss - args.entropy_coeff * entropy_loss
    terms = {"actor/pg_loss": pg_loss, "actor/entropy_loss": entropy_loss}
    if args.kl_loss_coef > 0:
        # verl use_kl_loss: KL(pi_theta || pi_ref) as a loss, not a reward
        kl = objectives.kl_penalty(new_logprobs, micro_batch["ref_logprobs"], args.kl_loss_type)
        if args.use_bias_correction_kl:
            # DeepSeek-V3.2's unbiased estimate: the tokens came from pi_old, so each token's KL
            # estimate under pi_theta is weighted by r = pi_theta / pi_old (gradient through r)
            bound = corrections.SAFETY_BOUND
            kl = kl * torch.exp((new_logprobs - old_logprobs).clamp(-bound, bound))
        kl_loss = objectives.agg_loss(kl, loss_mask, args.loss_agg_mode, **global_info)
        loss = loss + args.kl_loss_coef * kl_loss
        terms["actor/kl_loss"] = kl_loss
    return loss, terms, pg_metrics, corr_metrics


def update_policy(
    model, optimizer, batch, args, correction, log_pi, world_size=1, scaler=None, step=0
):
    """Step 5: ppo_epochs x minibatches (one optimizer step each) x micro-batches (one
    forward/backward of grpo_loss each) over this rank's batch (rollout.make_batch's tensors, step
    3's old_logprobs, loss_mask, is_weights, ref_logprobs, step 4's advantages); log pi of the
    current policy is logprobs.response_logprobs with the run's `log_pi` settings. Returns the
    metrics averaged over optimizer steps. Each minibatch ends in one optimizer step
    (harness.OptimizerStep: the gradients averaged over ranks, clipped to --max-grad-norm,
    applied); scaler: --precision fp16's torch.amp.GradScaler, else None. A non-finite loss or
    gradient norm stops the run (harness.check_finite, naming `step`) before the optimizer applies
    it; with fp16's scaler an inf gradient is an overflow, skipped as torch does.

    One loss normalisation for any micro-batch size or number of ranks (verl 0.9.1 agg_loss with
    global_batch_info, workers/engine/fsdp/transformer_impl.py forward_backward_batch): each
    micro-batch's loss is divided by the minibatch's GLOBAL count (valid tokens, or
    ppo_mini_batch_size * n sequences) and multiplied by the world size; backward sums the
    micro-batches and the ranks' gradients are averaged: exactly the gradient of the minibatch's
    loss (tests/test_grpo.py: micro-batch 8 vs 64, 2 ranks vs 1).
    """
    B = batch["responses"].shape[0]
    _, mini = local_batch_sizes(args, world_size)
    optimizer_step = harness.OptimizerStep(optimizer, world_size, args.max_grad_norm, scaler)
    logged = collections.defaultdict(list)  # name -> values, averaged at the end
    bypass_metrics = None  # bypass mode: the correction's metrics of the first micro-batch

    model.train()  # (dropout is off in these configs; train() enables gradient checkpointing)
    for _ in range(args.ppo_epochs):
        for mini_start in range(0, B, mini):
            mini_end = min(mini_start + mini, B)
            # verl's global_batch_info: the loss mask's valid tokens over the whole minibatch on all
            # ranks (the corrected mask in decoupled mode: verl replaces response_mask with it, so
            # every term counts the same tokens), and its sequences
            minibatch_mask = batch["loss_mask"][mini_start:mini_end]
            global_info = dict(
                dp_size=world_size,
                batch_num_tokens=harness.all_sum(minibatch_mask.sum().double()).item(),
                global_batch_size=args.ppo_mini_batch_size * args.rollout_n,
            )
            minibatch_losses = collections.defaultdict(float)
            # --ppo-micro-batch-size-per-gpu rows at a time, or by --ppo-max-token-len-per-gpu
            for rows in memory.micro_batches(batch["attention_mask"], mini_start, mini_end, args):
                micro_batch = {name: value[rows] for name, value in batch.items()}
                # log pi and the entropy of the current policy, (b, R) each
                new_logprobs, entropy = logprobs.response_logprobs(
                    model, micro_batch, log_pi, entropy_grad=args.entropy_coeff != 0
                )
                loss, terms, pg_metrics, corr_metrics = grpo_loss(
                    new_logprobs, entropy, micro_batch, args, correction, global_info
                )
                if correction.bypass_mode and bypass_metrics is None:
                    bypass_metrics = corr_metrics
                harness.check_finite("loss", loss.item(), step)
                # every term is divided by the global count and multiplied by the world size
                # already: backward sums the micro-batches (fp16: from loss x S)
                optimizer_step.backward(loss)
                # the minibatch's loss terms: the sum of its micro-batches' (then the mean of ranks)
                for name, value in terms.items():
                    minibatch_losses[name] += value.item()
                for name, value in pg_metrics.items():  # pg_clipfrac, pg_clipfrac_lower, ppo_kl
                    logged[f"actor/{name}"].append(value)
            for name, value in minibatch_losses.items():
                logged[name].append(value)
            # one optimizer step: the gradients averaged over ranks, clipped (a non-finite norm
            # stops the run), applied; returns grad_norm (and fp16's loss_scale)
            for name, value in optimizer_step.apply(step).items():
                logged[f"actor/{name}"].append(value)
    metrics = {name: sum(values) / len(values) for name, values in logged.items()}
    # bypass mode: verl logs the off-policy metrics of the first micro-batch, where pi_theta is
    # still the pi_old a recompute would give: they measure the mismatch alone
    metrics.update(bypass_metrics or {})
    metrics.setdefault("actor/kl_loss", 0.0)
    return metrics


def lr_factor(step, args):
    """The lr multiplier of the update of 0-based `step`, as verl's LambdaLR schedules stepped once
    per training step (utils/torch_functional.py get_constant/cosine_schedule_with_warmup). W =
    lr_warmup_steps or int(ratio * total):
        step < W    step / W                   (the first update runs at lr 0)
        constant    1
        cosine      max(c, c + (1 - c) * 0.5 * (1 + cos(2 pi num_cycles p))),  c = min_lr_ratio,
                    p = (step - W) / max(1, total_steps - W)
    """
    warmup = args.lr_warmup_steps
    if warmup <= 0:
        warmup = int(args.lr_warmup_steps_ratio * args.total_steps)
    if step < warmup:
        return step / max(1, warmup)
    if args.lr_scheduler_type == "constant":
        return 1.0
    progress = (step - warmup) / max(1, args.total_steps - warmup)
    cosine = math.cos(math.pi * args.num_cycles * 2.0 * progress)
    return max(
        args.min_lr_ratio,
        cosine * (1 - args.min_lr_ratio) * 0.5 + (1 + args.min_lr_ratio) * 0.5,
    )


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def train(args, backend=None):
    """Run GRPO; returns the path of <output_dir>/metrics.jsonl. backend: a rollout engine built by
    the caller (tests share one vLLM engine this way), synced from the trainer before the first
    rollout, closed by the caller."""
    # 0. Setup. Every check that needs no weights first (bad input fails in seconds); then the task,
    #    a checkpoint, the policy (and pi_ref), the optimizer, the rollout engine, the logs.
    harness.check_command_line(check_args, args)
    rank, world_size, device = harness.setup_distributed(args.cuda, args.sharding)
    if args.torch_threads and device.type == "cpu":
        torch.set_num_threads(args.torch_threads)
    # one run per output folder (a second one is refused in one line)
    harness.lock_output_dir(args.output_dir, rank)
    # a checkpoint, verified, written with these settings (or with others that may change)
    checkpoint = harness.checkpoint_to_resume(args, changeable=changeable_settings(args))
    correction = corrections.RolloutCorrection.from_name(args.correction)
    task = tasks.load_task(args)
    harness.seed_everything(args.seed)
    model_path = policy_path(args, rank, world_size)
    inputs = pinned_inputs(args, model_path, checkpoint)
    tokenizer, model, ref_model, optimizer, scaler, start_step, saved = load_models(
        args, model_path, checkpoint, device, rank, world_size
    )
    # what every log pi of the run shares (temperature, chunk size, precisions, a replayed sampler,
    # packed or padded micro-batches)
    log_pi = logprob_settings(args, model, rank)
    # the prompts tokenized, those over --max-prompt-length dropped (verl filter_overlong_prompts);
    # with --tools, the tools the policy may call between its turns (tools.ToolEnvironment)
    task = prompts_that_fit(task, tokenizer, args)
    # Where every step's rollouts come from (rollout.RolloutSource): sample_step (steps 1-2) with
    # the rollout engine of --backend, which loads model_path and then gets the trainer's (resumed,
    # --mismatch-rounded) weights; or with a copy K updates behind, or ahead of time in a producer
    # thread (--rollout-staleness, --async-rollouts: an asynchronous rollout worker). A resume
    # hands it what the checkpoint saved for it (`saved`: batches sampled ahead, lagged weights).
    source = rollout_source(
        args, model, model_path, tokenizer, task, start_step, saved, rank, world_size, backend
    )
    resume_step = start_step if checkpoint else None
    log = harness.start_logs(args, "grpo", rank, world_size, resume_step, inputs)

    # Validation before training (verl val_before_train): the initial policy, as step 0.
    if args.val_every and args.val_before_train and start_step == 0:
        val_metrics = validate(source, model, tokenizer, task, args, -1, rank, world_size)
        log_step(log, {"step": 0, **val_metrics}, args.total_steps, rank)

    # SIGTERM / Ctrl-C from here on: the step in progress ends, is saved, and the run stops
    harness.catch_stop_signals()
    for step in range(start_step, args.total_steps):
        t_step = time.time()
        # verl's warmup/cosine schedule, a pure function of step
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(step, args)

        # 1-2. Rollout and rewards (sample_step): this rank's prompts, n samples each with
        #      pi_rollout's logprobs (--tools: turn after turn, a tool's answer between turns), and
        #      each response's score. With --dynamic-sampling (DAPO) both repeat on fresh prompts
        #      until train_batch_size groups whose rewards differ are in hand. (--async-rollouts:
        #      sampled while the trainer was busy with earlier steps.)
        t0 = time.time()
        indices, rollout_batch, rollout_metrics = source.take(step)
        timing = {"timing/generate": time.time() - t0}
        if rollout_batch is None:
            # DAPO's cap (verl filter_groups.max_num_gen_batches): too few prompts still give a
            # signal (the policy answers nearly every prompt the same way, right or wrong), so the
            # run ends after `step` steps, saved; it resumes from there with a larger cap
            save(args, rank, model, tokenizer, optimizer, scaler, step, inputs, source)
            raise harness.RunError(
                f"stopping after step {step}: --max-num-gen-batches "
                f"{rollout_metrics['filter_groups/gen_batches']} gave "
                f"{rollout_metrics['filter_groups/kept_groups']} of --train-batch-size "
                f"{args.train_batch_size} prompt groups whose rewards differ (saved: rerun with a "
                "larger --max-num-gen-batches to go on)"
            )
        response_ids, rollout_logprobs, finish_reasons, scores, tool_use = rollout_batch
        # group g's responses are rows g*n .. g*n+n-1; --tools: response_mask 1 on sampled tokens
        prompt_ids = [task.train_prompt_ids[i] for i in indices]
        group_ids = torch.arange(len(indices)).repeat_interleave(args.rollout_n)
        batch = rollout.make_batch(
            [ids for ids in prompt_ids for _ in range(args.rollout_n)],
            response_ids,
            rollout_logprobs,
            tokenizer.pad_token_id,
            args.max_response_length,
            device,
            model_masks=None if tool_use is None else tool_use["model_masks"],
        )
        lengths = torch.tensor([len(ids) for ids in response_ids])  # a tool's tokens included

        # 3. pi_old, the rollout correction and pi_ref, before the advantages (verl's fit loop
        #    rejects from the response mask, then computes the advantages with it). Decoupled:
        #    pi_old is the trainer's no-grad recompute; bypass: pi_rollout, corrected in grpo_loss.
        t0 = time.time()
        old_logprobs, sum_pi_squared, corr_metrics = compute_pi_old(
            model, batch, args, log_pi, correction, world_size
        )
        is_weights, loss_mask = None, batch["response_mask"]
        if not correction.bypass_mode:
            # once per batch: IS weights pi_old / pi_rollout and the RS/veto mask, which masks
            # every loss term and the advantages (verl compute_rollout_correction_and_add_to_batch)
            is_weights, loss_mask, batch_corr_metrics = corrections.apply_rollout_correction(
                old_logprobs, batch["rollout_logprobs"], batch["response_mask"], correction
            )
            corr_metrics.update(batch_corr_metrics)
        batch["old_logprobs"] = old_logprobs
        batch["loss_mask"] = loss_mask
        if is_weights is not None:
            batch["is_weights"] = is_weights
        if args.kl_loss_coef > 0:  # pi_ref, for the KL loss
            batch["ref_logprobs"] = reference_logprobs(model, ref_model, batch, args, log_pi)
        timing["timing/logprobs"] = time.time() - t0

        # 4. Advantages from the corrected mask: one per response (GRPO: normalised within its
        #    prompt's group), the length-dependent estimators counting the tokens it keeps. ReMax's
        #    baseline is the score of the policy's greedy answer to the same prompt; the optimal
        #    token baseline gives one advantage per token, from pi_old.
        baselines = None
        if args.adv_estimator == "remax":
            # (source.engine sampled step 1: the lagged copy's weights with --rollout-staleness)
            baselines = greedy_baselines(source.engine, task, tokenizer, indices, step, args, rank)
        advantage_scores, component_metrics = scores, {}
        if args.adv_estimator == "gdpo":  # each named reward component normalised on its own
            advantage_scores, component_metrics = reward_components(
                response_ids, indices, task, tokenizer, args
            )
        if args.adv_estimator in objectives.TOKEN_LEVEL_ESTIMATORS:
            # optimal_token_baseline (tir_: over each response's model tokens, for --tools)
            batch["advantages"] = objectives.ADV_ESTIMATORS[args.adv_estimator](
                scores.to(device),
                group_ids,
                lengths,
                old_logprobs,
                sum_pi_squared,
                loss_mask,
                is_weights,
            )
        else:
            batch["advantages"] = compute_advantages(
                advantage_scores, group_ids, loss_mask.sum(-1), baselines, args, device
            )

        # 5. Update: grpo_loss (the policy loss with the correction's weights and mask, entropy and
        #    KL terms) over minibatches of micro-batches, one optimizer step per minibatch.
        t0 = time.time()
        actor_metrics = update_policy(
            model, optimizer, batch, args, correction, log_pi, world_size, scaler, step + 1
        )
        timing["timing/update"] = time.time() - t0

        # 6. Sync: the next rollouts sample with the updated weights. The rollout engine gets
        #    them (HF: nothing to do, or a copy through rollout.apply_mismatch; vLLM: load_weights
        #    + a prefix-cache reset); with --rollout-staleness K, the weights after update
        #    step + 1 - K; with --async-rollouts, the producer keeps them for its coming batches.
        t0 = time.time()
        source.publish(model, step + 1)
        timing["timing/sync_weights"] = time.time() - t0

        # 7. Metrics (averaged over ranks), validation, samples, checkpoint.
        metrics = step_metrics(step, args, scores, batch, finish_reasons, prompt_ids)
        metrics |= {**component_metrics, **rollout_metrics, **timing, **corr_metrics}
        metrics = harness.reduce_metrics(metrics | actor_metrics, world_size)
        last = step + 1 == args.total_steps
        if last:  # every rank must hold the same parameters (0.0 when in sync)
            spread = harness.rank_checksum_spread(model.parameters(), world_size)
            metrics["debug/rank_param_checksum_max_diff"] = spread
        if args.val_every and ((step + 1) % args.val_every == 0 or last):
            metrics |= validate(source, model, tokenizer, task, args, step, rank, world_size)
        metrics["timing/step"] = time.time() - t_step
        log_step(log, {"step": step + 1, **metrics}, args.total_steps, rank)
        # what the policy writes (after the first step and every --log-samples-every steps)
        samples = sample_rows(step + 1, args, tokenizer, prompt_ids, response_ids, scores, batch)
        log.samples(samples)
        stop_signal = harness.stop_signal(world_size)  # SIGTERM or SIGINT on any rank
        if (args.save_every and (step + 1) % args.save_every == 0) or last or stop_signal:
            save(args, rank, model, tokenizer, optimizer, scaler, step + 1, inputs, source)
        if stop_signal and not last:
            raise harness.stopped(stop_signal, step + 1, args.output_dir)

    log.close()
    # the engines it built (vLLM's shutdown also ends the process group: after the last collective)
    source.close()
    harness.end_processes(world_size, args.sharding)
    return os.path.join(args.output_dir, "metrics.jsonl")


# --------------------------------------------------------------------------------------------------
# Checks, setup, validation and logging (plumbing: a first read can skip this section)
# --------------------------------------------------------------------------------------------------


def local_batch_sizes(args, world_size):
    """(prompts per rank per step, sequences per rank per minibatch); ValueError if a size does not
    divide."""
    # verl: ppo_mini_batch_size *= rollout_n, then //= the world size
    mini_seqs = args.ppo_mini_batch_size * args.rollout_n
    if args.train_batch_size % world_size:
        raise ValueError(
            f"--train-batch-size {args.train_batch_size} must be divisible by the world size "
            f"{world_size} (each rank rolls out whole groups)"
        )
    if args.train_batch_size % args.ppo_mini_batch_size:
        raise ValueError(
            f"--train-batch-size {args.train_batch_size} must be divisible by "
            f"--ppo-mini-batch-size {args.ppo_mini_batch_size}"
        )
    micro = args.ppo_micro_batch_size_per_gpu
    # (with --use-dynamic-bsz the micro-batches are groups by tokens: the row count is not read)
    if mini_seqs % world_size or (not args.use_dynamic_bsz and (mini_seqs // world_size) % micro):
        raise ValueError(
            f"--ppo-mini-batch-size x --rollout-n = {mini_seqs} sequences must be divisible by the "
            f"world size {world_size} x --ppo-micro-batch-size-per-gpu {micro}"
        )
    return args.train_batch_size // world_size, mini_seqs // world_size


def check_args(args, world_size=1):
    """Every check that needs no weights: a bad flag fails here, in seconds, with one line that
    names it (main prints it and exits 2), before any model loads. GRPO's own flags here, each
    room's in its own check (rollout, memory, lora), then the rules that tie flags of several rooms
    together."""

    choices = {
        "task": tasks.GRPO_TASKS,
        "mismatch": rollout.MISMATCH_KINDS,
        "loss_agg_mode": objectives.AGG_MODES,
        "kl_loss_type": objectives.KL_PENALTY_KINDS,
        "lr_scheduler_type": LR_SCHEDULERS,
        "gsm8k_reward_mode": ("strict", "flexible", "normalized"),
        "precision": logprobs.PRECISIONS,
        "correction": corrections.ALL_PRESET_NAMES,
        "policy_loss": tuple(objectives.POLICY_LOSSES),
        "adv_estimator": tuple(objectives.ADV_ESTIMATORS),
        "tiny_arch": ("qwen2", "gpt2"),
        "lm_head_precision": logprobs.HEAD_PRECISIONS,
    }
    ranges = {
        ">= 1": "rollout_n train_batch_size ppo_mini_batch_size ppo_micro_batch_size_per_gpu "
        "ppo_epochs total_steps max_response_length max_prompt_length train_size copy_length "
        "arith_max_steps",
        ">= 0": "val_every save_every log_samples_every num_log_samples val_size top_k dro_beta "
        "tiny_pretrain_steps weight_decay kl_loss_coef val_temperature torch_threads "
        "clip_ratio_high max_num_gen_batches overlong_buffer_len overlong_penalty_factor",
        "> 0": "lr temperature max_grad_norm num_cycles off_policy_mask_threshold",
        "in [0, 1]": "min_lr_ratio lr_warmup_steps_ratio",
        "in [0, 1)": "clip_ratio_low min_p",
        "in (0, 1]": "top_p",
        ">= 2": "arith_max_number",
    }
    # finite numbers, --track able to log, then the choices and ranges above
    harness.check_flags(args, choices, ranges)
    # each room's own flags (the mixins Args inherits), then the rules across rooms below
    rollout.check_engine_args(args)
    rollout.check_async_args(args)
    memory.check_memory_args(args)
    lora.check_lora_args(args)
    tools.check_tool_args(args)
    if args.task in ("copy", "arith", "lookup") and args.val_size < 1:
        harness.refuse(args, "val_size", ">= 1 for the copy, arith and lookup tasks")
    pretrainable = args.model_name_or_path == TINY_MODEL and args.task in ("copy", "lookup")
    if args.tiny_pretrain_steps and not pretrainable:
        rule = "0 unless --model-name-or-path tiny --task copy or lookup"
        harness.refuse(args, "tiny_pretrain_steps", rule)
    if args.overlong_buffer_len > args.max_response_length:
        rule = f"<= --max-response-length {args.max_response_length}"
        harness.refuse(args, "overlong_buffer_len", rule)
    if args.use_bias_correction_kl and not args.kl_loss_coef > 0:
        harness.refuse(args, "kl_loss_coef", "> 0 with --use-bias-correction-kl (no KL loss)")
    if args.clip_ratio_c is not None and args.clip_ratio_c <= 1:
        harness.refuse(args, "clip_ratio_c", "> 1 (or None: no dual-clip)")
    # the rules that tie --policy-loss / --adv-estimator to other flags (objectives.py, section 5)
    objectives.check_objective(args, corrections.RolloutCorrection.from_name(args.correction))
    if args.vllm_lora_sync == "adapter":
        check_adapter_sync(args)
    if args.async_rollouts:
        check_async_rollouts(args)
    if args.tools:
        check_multi_turn(args)
    if args.sharding == "fsdp2":
        # what keeps a whole copy of the model beside the shards, or scales sharded gradients
        if args.precision == "fp16":
            harness.refuse(args, "precision", "auto, fp32 or bf16 with --sharding fsdp2")
        if args.rollout_staleness:
            harness.refuse(args, "rollout_staleness", "0 with --sharding fsdp2 (a whole copy)")
        if args.mismatch != "none" and args.backend == "hf":
            harness.refuse(args, "mismatch", "none with --sharding fsdp2 --backend hf")
    local_batch_sizes(args, world_size)
    if args.backend == "vllm":
        # a clear message before any model loads; vllm is imported later
        rollout.check_vllm_available()
    if tasks.smollm2_problem(args.model_name_or_path):
        raise ValueError(tasks.smollm2_problem(args.model_name_or_path))
    # the model's config is readable (the tiny model's, before it is built), and prompt + response
    # fit its context
    if args.model_name_or_path == TINY_MODEL:
        config = tasks.tiny_model_config(
            tasks.build_tiny_tokenizer(),
            args.tiny_arch,
            max_positions=TINY_MAX_POSITIONS,
            tied_embeddings=args.tiny_tied_embeddings,
        )
    else:
        config = harness.model_config("--model-name-or-path", args.model_name_or_path)
    max_positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if args.lora_rank:
        # the adapter's modules exist in this model (on the meta device: no weights, a second)
        try:
            memory.count_adapter_parameters(
                config, args.lora_rank, args.lora_alpha, args.lora_target_modules
            )
        except harness.RunError as error:
            raise ValueError(str(error)) from None
    needed = args.max_prompt_length + args.max_response_length
    if max_positions is not None and needed > max_positions:
        raise ValueError(
            f"--max-prompt-length + --max-response-length = {needed} exceeds the model's context "
            f"(max_position_embeddings = {max_positions})"
        )
    harness.check_paths(args)


def check_multi_turn(args):
    """What --tools cannot run with yet, each refused in one line: a producer thread's and
    in-flight updates' version ledger is kept per batch of one turn; a sharded HF engine's
    generate is a collective, and ranks run different numbers of turns; DAPO's overlong shaping
    is defined for one sampled response, not turns with a tool's tokens between them."""
    if args.async_rollouts:
        harness.refuse(args, "async_rollouts", "off with --tools (multi-turn rollouts)")
    if args.sharding == "fsdp2" and args.backend == "hf":
        harness.refuse(args, "sharding", "ddp with --tools --backend hf")
    if args.overlong_buffer_len:
        harness.refuse(args, "overlong_buffer_len", "0 with --tools")


def check_async_rollouts(args):
    """What --async-rollouts cannot run with in the other rooms, each refused in one line: what its
    producer thread cannot share with the trainer's (the global RNG, collectives, a whole copy);
    rollout.check_async_args has the rules among the engine's and asynchrony's own flags."""
    if args.policy_loss == "clip_cov":
        # its token draw (torch.randperm) would take from the producer's sampling RNG
        harness.refuse(args, "policy_loss", "not clip_cov with --async-rollouts")
    if args.adv_estimator == "remax":
        harness.refuse(args, "adv_estimator", "not remax with --async-rollouts (a greedy rollout)")
    if args.sharding == "fsdp2":
        harness.refuse(args, "sharding", "ddp with --async-rollouts (a whole copy)")
    if args.dynamic_sampling:
        # its group counts are collectives, which would interleave with the trainer's
        harness.refuse(args, "dynamic_sampling", "off with --async-rollouts")
    # what makes the trainer's thread reseed, rewind or draw from the global RNG mid-batch: the
    # recompute of a checkpointed layer (it restores the forward's RNG state), a compile (dynamo
    # saves and restores the RNG state), sampled validation (it seeds)
    if args.gradient_checkpointing:
        harness.refuse(args, "gradient_checkpointing", "off with --async-rollouts")
    if args.compile_layers:
        harness.refuse(args, "compile_layers", "off with --async-rollouts")
    if args.val_temperature > 0:
        harness.refuse(args, "val_temperature", "0 with --async-rollouts (greedy draws nothing)")


def check_adapter_sync(args):
    """--vllm-lora-sync adapter: what vLLM 0.32's LoRA layers take (rollout.VLLMBackend), each
    refused in one line: an adapter to sync, no LM head adapter, no GPT-2, the engine's own base."""
    if args.backend != "vllm" or not args.lora_rank:
        harness.refuse(args, "vllm_lora_sync", "merged without --backend vllm and --lora-rank")
    if "lm_head" in args.lora_target_modules.split(","):
        rule = "without lm_head with --vllm-lora-sync adapter (vLLM adapts no LM head)"
        harness.refuse(args, "lora_target_modules", rule)
    if args.model_name_or_path == TINY_MODEL and args.tiny_arch == "gpt2":
        harness.refuse(args, "tiny_arch", "qwen2 with --vllm-lora-sync adapter (no GPT-2 LoRA)")
    if args.mismatch != "none":
        # the engine computes with the base it loaded; a rounded copy would need a merged sync
        harness.refuse(args, "mismatch", "none with --vllm-lora-sync adapter")
    if args.lora_rank > 512:
        harness.refuse(args, "lora_rank", "<= 512 with --vllm-lora-sync adapter (vLLM's bound)")


def changeable_settings(args):
    """The settings a resume may change (harness.checkpoint_to_resume): the number of steps where
    the learning-rate schedule does not depend on it, dynamic sampling's cap (a run stopped by it
    resumes with a larger one), the layers recomputed (memory, not the numbers) and compiled (the
    same arithmetic, rounded as fused kernels round it). Not the steps of an --async-rollouts run:
    its checkpoint holds no batch sampled ahead past its last step."""
    schedule_uses_total = args.lr_scheduler_type != "constant" or (
        args.lr_warmup_steps <= 0 and args.lr_warmup_steps_ratio > 0
    )
    changeable = ("max_num_gen_batches", "recompute_num_layers", "compile_layers")
    # the micro-batches' layout and grouping: the same gradient, summed in another order
    changeable += ("use_remove_padding", "use_dynamic_bsz", "ppo_max_token_len_per_gpu")
    # --async-rollouts: a checkpoint holds the batches sampled ahead up to the last step only
    fixed_total = schedule_uses_total or args.async_rollouts
    return changeable + (() if fixed_total else ("total_steps",))


def policy_path(args, rank, world_size):
    """Where the policy loads from: --model-name-or-path, or for "tiny" the offline tiny model,
    built into <output_dir>/tiny_model (an engine such as vLLM loads it from disk too) once per
    settings: its built_with.json records them and its files' hashes."""
    if args.model_name_or_path != TINY_MODEL:
        return args.model_name_or_path
    path = os.path.join(args.output_dir, "tiny_model")
    settings = {"tiny_arch": args.tiny_arch, "max_positions": TINY_MAX_POSITIONS, "seed": args.seed}
    # (these keys only when set: older runs' marks stay valid)
    if not args.tiny_tied_embeddings:
        settings["tied_embeddings"] = False
    if args.tiny_pretrain_steps:
        settings["pretrain_steps"] = args.tiny_pretrain_steps
        if args.task != "copy":  # (a copy base's folder, written before the lookup task, says none)
            settings["pretrain_task"] = args.task
        settings["copy_length"] = args.copy_length

    def build(folder):
        model, tokenizer = tasks.build_tiny_model(
            folder,
            arch=args.tiny_arch,
            max_positions=TINY_MAX_POSITIONS,
            seed=args.seed,
            tied_embeddings=args.tiny_tied_embeddings,
        )
        if args.tiny_pretrain_steps:
            tasks.pretrain_tiny_model(
                model,
                tokenizer,
                args.tiny_pretrain_steps,
                args.seed,
                length=args.copy_length,
                task=args.task,
            )
            model.save_pretrained(folder)

    # a tiny model an earlier run built with other settings (another --tiny-arch or --seed), or
    # whose files changed since, is built again, in a new folder swapped in with its mark: a fresh
    # start never trains another experiment's model, a kill mid-build leaves the old one whole
    if rank == 0 and harness.built_with(path) != settings:
        harness.write_folder(path, build, settings)
    if world_size > 1:
        harness.barrier()
    return path


def pinned_inputs(args, model_path, checkpoint):
    """What the run loads from outside its checkpoint (the model folder or Hub name the tokenizer
    and the reference come from, a task's Hub dataset), pinned by harness.input_digests: recorded
    in every checkpoint and in args.json, and on a resume checked against the checkpoint's
    (harness.check_inputs: the same experiment, or refused in one line)."""
    inputs = harness.input_digests(
        {"model": model_path, "task data": tasks.TASK_DATASETS.get(args.task)}
    )
    harness.check_inputs(checkpoint, inputs, args)
    return inputs


def load_models(args, model_path, checkpoint, device, rank, world_size):
    """(tokenizer, policy, reference or None, AdamW, fp16's gradient scaler or None, first step,
    what the checkpoint saved for the rollouts: {} on a fresh start):
    fp32 master weights (autocast to --precision's dtype for the forward), from the checkpoint when
    resuming, with the optimizer and scaler state and this rank's RNG state. --sharding fsdp2:
    each rank keeps its shard of both models (harness.build_sharded: the ranks load in turns)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if device.type == "cuda":
        # a model whose training state alone overflows a GPU: refused before any weight loads
        config = AutoConfig.from_pretrained(model_path)
        n_params = memory.count_parameters(config)
        gpu_bytes = memory.gpu_memory_bytes()
        if problem := memory.resident_problem(n_params, args, gpu_bytes, world_size):
            raise harness.RunError(problem)

    def build_policy():
        # fp32 masters; a crafted pickle or diverged weights in the folder end the run in one line.
        # LoRA: the base from model_path, the adapter (and only the adapter) from the checkpoint
        model = harness.load_model_folder(
            functools.partial(AutoModelForCausalLM.from_pretrained, dtype=torch.float32),
            model_path if args.lora_rank else checkpoint or model_path,
        )
        if args.lora_rank:
            model = lora.add_adapter(
                model, args.lora_rank, args.lora_alpha, args.lora_target_modules, args.seed
            )
            if checkpoint:
                lora.load_adapter(model, checkpoint)
            # the frozen base's linears in bf16 under bf16 autocast (the same forward, half the
            # bytes); the adapter, embeddings and norms stay fp32
            if logprobs.resolve_precision(args.precision, device) == "bf16":
                logprobs.bf16_frozen_linears_(model)
        if args.use_remove_padding and not args.compile_layers:
            # packed micro-batches: each sequence's own attention, not a row-wide mask
            logprobs.use_varlen_attention(model)
        if args.gradient_checkpointing:
            memory.recompute_layers(model, args, device, rank, world_size)
        if args.compile_layers:
            compiled = memory.compile_decoder_layers(model)
            if rank == 0:
                print(f"torch.compile: {compiled} decoder layers (the first steps pay the compile)")
        return model

    def build_reference():
        ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        ref_model.requires_grad_(False)
        if args.use_remove_padding and not args.compile_layers:
            logprobs.use_varlen_attention(ref_model)
        # under bf16 autocast: same logprobs, ~half the memory
        if logprobs.resolve_precision(args.precision, device) == "bf16":
            logprobs.bf16_frozen_linears_(ref_model)  # (verl keeps its reference in bf16 too)
        return ref_model

    model = harness.build_sharded(build_policy, args.sharding, device, rank, world_size)
    ref_model = None
    # pi_ref = the initial policy, frozen; beta = 0 never loads it; LoRA: the adapter switched off
    if args.kl_loss_coef > 0 and not args.lora_rank:
        ref_model = harness.build_sharded(build_reference, args.sharding, device, rank, world_size)
    # the weights it trains: all of them, or with LoRA the adapter's A and B only
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trained, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay
    )
    scaler = None
    if logprobs.resolve_precision(args.precision, device) == "fp16":
        # torch's defaults: S starts at 2^16
        scaler = torch.amp.GradScaler(device.type)
    start_step, saved = 0, {}
    if checkpoint:
        state = harness.load_checkpoint(checkpoint, rank)
        # what the rollouts need to go on exactly (rollout.RolloutSource.checkpoint_state)
        saved = {name: state[name] for name in rollout.ROLLOUT_STATE if name in state}
        if "shard" in state:  # FSDP2: this rank's shard of the optimizer state
            harness.load_local_optimizer_state(optimizer, state["shard"])
        else:
            optimizer.load_state_dict(state["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
        start_step = state["step"]
        if start_step >= args.total_steps:
            raise harness.RunError(
                f"{checkpoint} is at step {start_step} and --total-steps is {args.total_steps}: "
                "nothing to train (raise --total-steps to continue it)"
            )
        if rank == 0:
            print(f"resuming from {checkpoint} at step {start_step}")
    return tokenizer, model, ref_model, optimizer, scaler, start_step, saved


def prompts_that_fit(task, tokenizer, args):
    """The task with its prompts tokenized (tasks.with_prompt_ids), those longer than
    --max-prompt-length dropped (verl's filter_overlong_prompts); a RunError in one line when fewer
    than one batch remain."""
    train_prompts = len(task.train)
    task = tasks.with_prompt_ids(task, tokenizer, args)
    if len(task.train) < args.train_batch_size:
        raise harness.RunError(
            f"{len(task.train)} of the {train_prompts} training prompts fit --max-prompt-length "
            f"{args.max_prompt_length}: fewer than --train-batch-size {args.train_batch_size}"
        )
    if args.tools:
        environment = tools.ToolEnvironment(
            tokenizer,
            tools.make_tools(args.tools),
            "chat" if args.use_chat_template else "tags",
            args.max_tool_response_length,
            args.tool_timeout,
            args.tool_history_mismatch,
        )
        task = replace(task, environment=environment)
    return task


def make_rollout_backend(args, model_path, rollout_model, tokenizer, world_size):
    """The rollout engine of --backend (rollout.make_backend), sized for prompt + response."""
    context = (
        getattr(rollout_model.config.get_text_config(), "max_position_embeddings", None) or math.inf
    )
    # vLLM refuses more
    max_model_len = min(args.max_prompt_length + args.max_response_length, context)
    return rollout.make_backend(
        args.backend, model_path, rollout_model, args, tokenizer, max_model_len, world_size
    )


def rollout_source(
    args, model, model_path, tokenizer, task, first_step, saved, rank, world_size, engine=None
):
    """train()'s rollout.RolloutSource: steps 1-2 (sample_step) of this rank, with engines of
    --backend that sample with a model's weights (make_rollout_backend) or with `engine` (a test's);
    the --rollout-staleness and --async-rollouts flags choose what sits behind it. saved: what a
    resumed checkpoint holds for the rollouts (the batches sampled ahead, the lagged weights)."""
    sample = functools.partial(
        sample_step, task=task, tokenizer=tokenizer, args=args, rank=rank, world_size=world_size
    )
    make_engine = functools.partial(
        make_rollout_backend, args, model_path, tokenizer=tokenizer, world_size=world_size
    )
    if saved and "rollout_queue" in saved:
        # a checkpoint written before multi-turn rollouts queued rollouts without tool_use
        saved["rollout_queue"] = [
            {
                step: (versions, (indices, (*batch, None) if len(batch) == 4 else batch, metrics))
                for step, (versions, (indices, batch, metrics)) in queue.items()
            }
            for queue in saved["rollout_queue"]
        ]
    return rollout.RolloutSource(model, make_engine, sample, args, first_step, saved, engine, rank)


@torch.no_grad()
def validate(source, model, tokenizer, task, args, step, rank, world_size):
    """val/accuracy (the fraction answered exactly: reward 1.0) and val/score_mean on the task's
    held-out split, sampled with the trainer's current weights (source.validation_engine: also when
    the rollouts lag); rank r answers prompts r, r + W, ...; greedy by default (val_temperature 0:
    verl's val do_sample=False)."""
    t0 = time.time()
    mine = list(range(rank, len(task.val_prompt_ids), world_size))
    prompts = [task.val_prompt_ids[i] for i in mine]
    if args.sharding == "fsdp2":
        # a sharded model's forward is a collective: every rank generates as many rows (rank 0's
        # count; a repeated prompt, not scored)
        prompts += [task.val_prompt_ids[0]] * (
            len(range(0, len(task.val_prompt_ids), world_size)) - len(mine)
        )
    responses, tool_use = [], None
    with source.validation_engine(model) as engine:
        if prompts:
            responses, _, _, tool_use = sample_responses(
                engine,
                task,
                prompts,
                1,
                args.val_temperature,
                sampling_seed(args, step, rank) + 1,
                args,
            )
    scores = [
        task.reward_fn(tasks.response_text(tokenizer, ids), task.val[i])
        for i, ids in zip(mine, answer_ids(responses, tool_use))
    ]
    counts = {
        "val/correct": sum(score == 1.0 for score in scores),
        "val/total": len(scores),
        "val/score_sum": float(sum(scores)),
    }
    counts = harness.reduce_metrics(counts, world_size, sum_keys=tuple(counts))
    return {
        "val/accuracy": counts["val/correct"] / max(counts["val/total"], 1),
        "val/score_mean": counts["val/score_sum"] / max(counts["val/total"], 1),
        "timing/validate": time.time() - t0,
    }


def step_metrics(step, args, scores, batch, finish_reasons, prompt_ids):
    """Step 7's metrics of the rollout, named as verl logs them (reward/*, response_length/*:
    the policy's tokens, as verl's response_mask counts them, ...), and DAPO's overlong penalty
    when it is on."""
    response_mask, advantages = batch["response_mask"], batch["advantages"]
    lengths = response_mask.sum(-1).long().cpu()
    if advantages.dim() == 2:
        # per-token advantages (the optimal token baseline): their mean over the response tokens
        advantages = advantages[response_mask.bool().to(advantages.device)]
    metrics = {
        "reward/mean": scores.mean().item(),
        "reward/max": scores.max().item(),
        "reward/min": scores.min().item(),
        "critic/advantages/mean": advantages.mean().item(),
        "response_length/mean": lengths.float().mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": sum(f == "length" for f in finish_reasons)
        / len(finish_reasons),
        "prompt_length/mean": sum(len(p) for p in prompt_ids) / len(prompt_ids),
        # the next step's lr, as verl logs it (engine_workers.train_batch)
        "actor/lr": args.lr * lr_factor(step + 1, args),
    }
    if args.overlong_buffer_len:
        penalty = tasks.overlong_penalty(
            lengths,
            args.max_response_length,
            args.overlong_buffer_len,
            args.overlong_penalty_factor,
        )
        metrics["overlong/reward_mean"] = penalty.mean().item()
        metrics["overlong/fraction"] = (penalty < 0).float().mean().item()
    return metrics


def log_step(log, metrics, total_steps, rank):
    """One row of metrics.jsonl (and wandb), and one line printed by rank 0."""
    log.metrics(metrics)
    if rank != 0:
        return
    line = [f"step {metrics['step']}/{total_steps}"]
    # pi_old's entropy; bypass mode recomputes no pi_old, so there the update's
    entropy_key = "actor/entropy" if "actor/entropy" in metrics else "actor/entropy_loss"
    shown = [
        ("reward/mean", "reward", ".3f"),
        ("val/accuracy", "val_acc", ".3f"),
        ("response_length/mean", "len", ".2f"),
        ("actor/pg_loss", "pg_loss", "+.4f"),
        (entropy_key, "entropy", ".3f"),
        ("actor/grad_norm", "grad_norm", ".3f"),
    ]
    for key, short, fmt in shown:
        if key in metrics:
            line.append(f"{short} {metrics[key]:{fmt}}")
    if "timing/step" in metrics:
        line.append(f"{metrics['timing/step']:.2f}s")
    print(" | ".join(line), flush=True)


def sample_rows(step, args, tokenizer, prompt_ids, response_ids, scores, batch):
    """A few of rank 0's prompts and responses with their scores and advantages (samples.jsonl),
    after the first step and every --log-samples-every steps; [] after the others."""
    if not (args.log_samples_every and args.num_log_samples):
        return []
    if step % args.log_samples_every and step != 1:
        return []
    advantages = batch["advantages"]
    return [
        {
            "step": step,
            "prompt": tasks.response_text(tokenizer, prompt_ids[i // args.rollout_n]),
            "response": tasks.response_text(tokenizer, response_ids[i]),
            "score": scores[i].item(),
            # one per response, or one per token (the optimal token baseline)
            "advantage": advantages[i].item()
            if advantages.dim() == 1
            else advantages[i, : len(response_ids[i])].tolist(),
        }
        for i in range(min(args.num_log_samples, len(response_ids)))
    ]


def save(args, rank, model, tokenizer, optimizer, scaler, step, inputs, source):
    """<output_dir>/checkpoint: the HF policy and tokenizer, the optimizer (and fp16's loss scale)
    and the step (harness.py adds every rank's RNG and the pinned inputs, and swaps it in
    atomically). --sharding fsdp2: the weights gathered whole onto rank 0 for the HF files, the
    optimizer state saved by each rank, its own shard. --lora-rank: the adapter alone, in peft's
    format (its base is pinned), and after the last step the merged policy
    as an HF model in <output_dir>/merged_model too. What the rollouts need to go on exactly
    (source.checkpoint_state): --async-rollouts' batches already sampled with older weights than
    these, handed over first on a resume; --rollout-staleness' K older weight versions."""
    if args.lora_rank:
        weights = lora.adapter_weights(model)  # gathered under FSDP2: every rank takes part
    else:
        weights = harness.full_state_dict(model)  # None unless sharded: every rank takes part

    def write_files(folder):
        if args.lora_rank:
            lora.save_adapter(folder, model, weights)
        else:
            model.save_pretrained(folder, state_dict=weights)
        tokenizer.save_pretrained(folder)

    state = {"step": step, "args": asdict(args)}
    shard = None
    if harness.is_sharded(model):
        shard = harness.local_optimizer_state(optimizer)
    else:
        state["optimizer"] = optimizer.state_dict()
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    # what the rollouts need to go on exactly: the batches sampled ahead (--async-rollouts), the
    # weights a lagged engine samples with next (--rollout-staleness); a collective
    state.update(source.checkpoint_state(step))
    harness.save_checkpoint(args.output_dir, rank, write_files, state, args, inputs, shard)
    if args.lora_rank and step == args.total_steps:
        save_merged_model(args, rank, model, tokenizer)


def save_merged_model(args, rank, model, tokenizer):
    """<output_dir>/merged_model: the LoRA policy as one HF model, W + (alpha / r) B A in each
    adapted layer (lora.merged_named_weights, float32; gathered one weight at a time under FSDP2,
    rank 0 keeping them), written atomically; the trainer's weights are not touched."""
    merged = {}
    for name, tensor in lora.merged_named_weights(model):
        if rank == 0:
            merged[name] = tensor.cpu()
    if rank == 0:

        def write_files(folder):
            model.save_pretrained(folder, state_dict=merged)
            tokenizer.save_pretrained(folder)

        harness.write_folder(os.path.join(args.output_dir, "merged_model"), write_files)


# --------------------------------------------------------------------------------------------------
# Presets and the command line
# --------------------------------------------------------------------------------------------------


# Each preset's settings and where they come from; what was measured with them is in docs/grpo.md.
PRESETS = {
    # The copy task from scratch: 3 letters + EOS in up to 6 new tokens, a GPT-2-architecture tiny
    # model (its learned position embeddings let each answer position find its own letter; the
    # RoPE-only Qwen2 often settles on repeating one letter first and learns the copy in about half
    # the seeds, docs/grpo.md), AdamW 1e-3 (a random-init model needs a large lr), groups of 32
    # samples for 16 prompts (larger groups sample EOS and a fading letter in time), two optimizer
    # steps per rollout batch, no KL (beta = 0: no reference model). CPU, so fp32.
    "tiny": (
        "Offline CPU run: a tiny random-init GPT-2 learns the copy task from scratch.",
        Args(
            exp_name="grpo_tiny",
            tiny_arch="gpt2",
            torch_threads=1,
            rollout_n=32,
            train_batch_size=16,
            ppo_mini_batch_size=8,
        ),
    ),
    # verl examples/grpo_trainer/run_qwen2-7b.sh (the GRPO example of verl docs/algo/grpo.md) with
    # the 0.5B model: train_batch_size 1024, max_prompt_length 512, max_response_length 1024, lr
    # 1e-6, ppo_mini_batch_size 256, use_kl_loss, kl_loss_coef 0.001, low_var_kl, entropy_coeff 0,
    # rollout.n 5, total_epochs 15 (7 steps per epoch -> 105 steps), test_freq 5, save_freq 20,
    # gradient checkpointing, weight_decay 0.01 (verl's default); bf16 autocast over fp32 master
    # weights with a bf16 vLLM rollout, as verl's FSDP mixed precision. Compiled decoder layers: the
    # same arithmetic, fused kernels, faster than the plain bf16 loss on one GPU (bench/RESULTS.md).
    "gsm8k_qwen05b": (
        "verl's GRPO example on GSM8K with Qwen2.5-0.5B-Instruct (GPU).",
        Args(
            exp_name="grpo_gsm8k_qwen05b",
            model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct",
            task="gsm8k",
            use_chat_template=True,
            max_prompt_length=512,
            max_response_length=1024,
            rollout_n=5,
            temperature=1.0,
            train_batch_size=1024,
            ppo_mini_batch_size=256,
            ppo_micro_batch_size_per_gpu=16,
            generation_batch_size=256,
            val_size=0,
            total_steps=105,
            lr=1e-6,
            weight_decay=0.01,
            kl_loss_coef=0.001,
            kl_loss_type="low_var_kl",
            val_every=5,
            save_every=20,
            gradient_checkpointing=True,
            compile_layers=True,
        ),
    ),
    # TinyZero (github.com/Jiayi-Pan/TinyZero, scripts/train_tiny_zero.sh, README's "3B+ model"
    # run): Qwen2.5-3B base, train_batch_size 256, max_prompt_length 256, max_response_length 1024,
    # lr 1e-6, ppo_mini_batch_size 128, micro-batch 8, kl 0.001;
    # examples/data_preprocess/countdown.py: the first 327680 rows train, the next 1024 test,
    # template_type "base" (a plain-text prompt, no chat template). TinyZero's own run trained PPO
    # with a critic; this preset is its GRPO option (rollout.n 5, low_var_kl KL loss). Compiled
    # decoder layers, as gsm8k_qwen05b.
    "countdown": (
        "TinyZero's Countdown (base-model prompt, no chat template) with Qwen2.5-3B base, GRPO "
        "(GPU).",
        Args(
            exp_name="grpo_countdown",
            model_name_or_path="Qwen/Qwen2.5-3B",
            task="countdown",
            use_chat_template=False,
            train_size=327680,  # TinyZero's TRAIN_SIZE; the next 1024 rows are the test split
            val_size=0,
            max_prompt_length=256,
            max_response_length=1024,
            rollout_n=5,
            train_batch_size=256,
            ppo_mini_batch_size=128,
            ppo_micro_batch_size_per_gpu=8,
            generation_batch_size=256,
            total_steps=300,
            lr=1e-6,
            weight_decay=0.01,
            kl_loss_coef=0.001,
            kl_loss_type="low_var_kl",
            val_every=20,
            save_every=50,
            gradient_checkpointing=True,
            compile_layers=True,
        ),
    ),
    # A real pretrained model on 2 CPU cores (<= 30 min with --backend vllm): SmolLM2-135M-Instruct
    # (Q4_1 de-quantised by scripts/get_smollm2.py) on one-step word problems with the chat
    # template, scored as gsm8k (strict). Sized for a 135M model and 20 steps (docs/grpo.md,
    # smol_arith): T 0.7, lr 1e-5, and bypass mode (verl's bypass_ppo_clip: pi_old = pi_rollout,
    # which matches the trainer to ~3e-5 in fp32).
    "smol_arith": (
        "Offline CPU run: SmolLM2-135M-Instruct learns arithmetic word problems (needs the "
        "converted model: bash scripts/setup_cpu.sh).",
        Args(
            exp_name="grpo_smol_arith",
            model_name_or_path=tasks.SMOLLM2_PATH,
            task="arith",
            use_chat_template=True,
            arith_max_steps=1,
            arith_max_number=20,
            max_prompt_length=160,
            max_response_length=64,
            rollout_n=8,
            temperature=0.7,
            train_batch_size=4,
            ppo_mini_batch_size=2,
            ppo_micro_batch_size_per_gpu=8,
            total_steps=20,
            lr=1e-5,
            correction="bypass_ppo_clip",
            val_every=5,
            save_every=0,
            output_dir="runs/grpo_smol_arith",
        ),
    ),
}
# DAPO (Yu et al. 2025, arXiv:2503.14476): the paper's four changes to GRPO together: clip-higher
# (eps_high 0.28), the token-mean loss (grpo.py's default), dynamic sampling and overlong reward
# shaping (penalty factor 1.0), no KL (beta = 0). The overlong buffer is 1 of the 6 tokens (the
# paper's 4096 of 20480 is 20%): a response that never stops within 5 tokens loses 1.
PRESETS["tiny_dapo"] = (
    "Offline CPU run: the tiny copy task with DAPO (clip-higher, dynamic sampling, overlong "
    "shaping).",
    replace(
        PRESETS["tiny"][1],
        exp_name="grpo_tiny_dapo",
        clip_ratio_high=0.28,
        dynamic_sampling=True,
        overlong_buffer_len=1,
        overlong_penalty_factor=1.0,
    ),
)
# The gsm8k preset with DAPO's changes, sized as verl's DAPO GSM8K example for Qwen2.5-0.5B-Instruct
# (overlong_buffer_len 128, max_num_gen_batches 10, kl 0); verl draws 3-4x train_batch_size prompts
# per generation batch, grpo.py draws train_batch_size (docs/grpo.md, DAPO).
PRESETS["gsm8k_dapo"] = (
    "GSM8K with Qwen2.5-0.5B-Instruct and DAPO (GPU).",
    replace(
        PRESETS["gsm8k_qwen05b"][1],
        exp_name="grpo_gsm8k_dapo",
        kl_loss_coef=0.0,
        clip_ratio_high=0.28,
        dynamic_sampling=True,
        max_num_gen_batches=10,
        overlong_buffer_len=128,
        overlong_penalty_factor=1.0,
    ),
)
PRESETS["gsm8k_qwen15b"] = (
    "The same with Qwen2.5-1.5B-Instruct (GPU).",
    replace(
        PRESETS["gsm8k_qwen05b"][1],
        exp_name="grpo_gsm8k_qwen15b",
        model_name_or_path="Qwen/Qwen2.5-1.5B-Instruct",
        ppo_micro_batch_size_per_gpu=8,
    ),
)

# verl's GSM8K GRPO run of Qwen2-7B-Instruct with FSDP2 on 8 GPUs (docs/algo/baseline.md: "GRPO
# (FSDP2)", test score 89.8, its log: eric-haibin-lin/verl-data, experiments/gsm8k/
# qwen2-7b-fsdp2.log): the gsm8k_qwen05b settings (run_qwen2-7b.sh) at 7.6B parameters, which
# 8 x 80 GiB hold only sharded (scripts/plan_memory.py: 113 GiB of fp32 weights, gradients and
# AdamW per GPU under ddp). vLLM as verl's rollout, with its gpu_memory_utilization 0.6, asleep
# while the trainer runs (verl's hybrid engine frees its cache the same way; here one engine per
# GPU, verl's had 2 GPUs).
PRESETS["gsm8k_qwen2_7b"] = (
    "verl's FSDP2 GRPO run on GSM8K with Qwen2-7B-Instruct (8 GPUs of 80 GiB, --sharding fsdp2).",
    replace(
        PRESETS["gsm8k_qwen05b"][1],
        exp_name="grpo_gsm8k_qwen2_7b",
        model_name_or_path="Qwen/Qwen2-7B-Instruct",
        sharding="fsdp2",
        backend="vllm",
        vllm_gpu_memory_utilization=0.6,
        vllm_sleep_mode=True,
    ),
)
PRESETS["gsm8k_qwen25_7b"] = (
    "The same with Qwen2.5-7B-Instruct (8 GPUs of 80 GiB, --sharding fsdp2).",
    replace(
        PRESETS["gsm8k_qwen2_7b"][1],
        exp_name="grpo_gsm8k_qwen25_7b",
        model_name_or_path="Qwen/Qwen2.5-7B-Instruct",
    ),
)

# LoRA (lora.py). LoRA adapts a pretrained model, so the tiny model is first pretrained (300
# supervised steps, about 14 s on one CPU thread) to reverse and to shift the copy task's words
# (tasks.pretrain_tiny_model); RL then teaches it to copy with a rank-8 adapter on every linear
# layer of the decoder, alpha 32 at every rank (Schulman et al. 2025, "LoRA Without Regret"),
# lr 2e-3: twice the full model's, from four pilot seeds outside the seed table (9-12). On the
# random-init model LoRA learned the copy in 2 of 8 seeds (docs/lora.md).
PRESETS["tiny_lora"] = (
    "Offline CPU run: a tiny model pretrained to reverse and shift words learns to copy them, "
    "through a LoRA adapter of rank 8.",
    replace(
        PRESETS["tiny"][1],
        exp_name="grpo_tiny_lora",
        tiny_pretrain_steps=300,
        lora_rank=8,
        lora_alpha=32.0,
        lr=2e-3,
    ),
)
# Multi-turn tool use (tools.py, rollout.sample_turns). The lookup task's answer is in no prompt:
# the policy must call the lookup tool, "(lookup abcd)", and copy its answer. The tiny model is
# first pretrained on the task's format with random values (300 supervised steps; a call in 1 of
# 10 examples, less likely than each of the 4 letters an answer starts with: its greedy answer
# calls nothing, so held-out accuracy starts near 1/64), RL then
# teaches it to call. 24 tokens hold the call (14), the tool's line (5) and the answer (4); two
# model turns: the call, then the answer.
PRESETS["tiny_tools"] = (
    "Offline CPU run: a tiny model learns to call a lookup tool, whose answer no prompt holds, "
    "over two turns.",
    replace(
        PRESETS["tiny"][1],
        exp_name="grpo_tiny_tools",
        task="lookup",
        tools=("lookup",),
        max_response_length=24,
        max_assistant_turns=2,
        tiny_pretrain_steps=300,
        total_steps=50,
    ),
)
# smol_arith with the calculator: the instruction's worked example calls it in the Hermes format
# (tasks.ARITH_TOOL_INSTRUCTION), SmolLM2's chat template wraps its answer as a tool message (its
# template renders any role), up to 3 model turns in 128 tokens.
PRESETS["smol_tools"] = (
    "Offline CPU run: SmolLM2-135M-Instruct on arithmetic word problems with a calculator tool "
    "(needs the converted model: bash scripts/setup_cpu.sh).",
    replace(
        PRESETS["smol_arith"][1],
        exp_name="grpo_smol_tools",
        tools=("calculator",),
        max_assistant_turns=3,
        max_prompt_length=256,
        max_response_length=128,
        output_dir="runs/grpo_smol_tools",
    ),
)
# verl's GSM8K GRPO-LoRA run for Qwen2.5-0.5B-Instruct (docs/algo/baseline.md: 54.3): the GRPO
# example's settings with rank 32, alpha 32, all-linear and lr 3e-5 (docs/advance/ppo_lora.rst's
# reference configuration: an order of magnitude above full fine-tuning's).
PRESETS["gsm8k_qwen05b_lora"] = (
    "verl's GSM8K GRPO-LoRA run with Qwen2.5-0.5B-Instruct, rank 32 (GPU).",
    replace(
        PRESETS["gsm8k_qwen05b"][1],
        exp_name="grpo_gsm8k_qwen05b_lora",
        lora_rank=32,
        lora_alpha=32.0,
        lr=3e-5,
    ),
)
# A 7B policy on one GPU: the 0.5B LoRA run's settings with Qwen2.5-7B-Instruct (verl's
# baseline.md lists 93.4 for its GRPO-LoRA at rank 32), the frozen base in bf16 beside a colocated
# vLLM engine that sleeps while the trainer runs (scripts/plan_memory.py: one GPU of 80 GiB).
PRESETS["gsm8k_qwen25_7b_lora"] = (
    "GSM8K GRPO-LoRA with Qwen2.5-7B-Instruct, rank 32, on one GPU of 80 GiB.",
    replace(
        PRESETS["gsm8k_qwen05b_lora"][1],
        exp_name="grpo_gsm8k_qwen25_7b_lora",
        model_name_or_path="Qwen/Qwen2.5-7B-Instruct",
        backend="vllm",
        vllm_gpu_memory_utilization=0.5,
        vllm_sleep_mode=True,
    ),
)


def main(argv=None):
    """`python grpo.py <preset> [--overrides]`: a bad flag is refused in one line (exit code 2)
    before any model loads, and a fault during the run in one line (exit code 1): harness.run."""
    harness.run("grpo.py", PRESETS, train, argv)


if __name__ == "__main__":
    main()
