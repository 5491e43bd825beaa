"""The per-GPU memory plan of a grpo.py, ppo_rlhf.py or rewards.py preset, from the model's config
alone (no weights are read), per rank under --sharding ddp or fsdp2.

    python scripts/plan_memory.py grpo countdown --gpus 8 --gpu-memory-gib 80
    python scripts/plan_memory.py grpo gsm8k_qwen05b --gpus 8 --ppo-micro-batch-size-per-gpu 8 --backend vllm
    python scripts/plan_memory.py ppo_rlhf gpt2_sentiment --gpus 1
    python scripts/plan_memory.py grpo gsm8k_qwen2_7b --gpus 8 --gpu-memory-gib 80 --sharding ddp   # refused: names fsdp2
    python scripts/plan_memory.py --all    # every GPU preset at 1 and 8 GPUs of 80 GiB, the sharded ones at 8: the README's tables

Any flag after the preset that is not this script's is the trainer's (`python grpo.py PRESET --help`
lists them) and changes the plan as it would change the run. Exit status 0 if the plan fits (or no
GPU size is known: no
--gpu-memory-gib and no GPU seen), 2 with one line `plan_memory.py: error: ...` if an argument is bad or the plan
does not fit. No vLLM is needed: the trainers' modules import it only to run an engine.

What one rank holds, in three phases that do not overlap in time (the plan's peak is the largest
phase):
  train           fp32 weights, fp32 gradients, the optimizer's fp32 m and v, autocast's bf16 weight copies, the
                  frozen models (the reference with bf16 Linear weights, logprobs.bf16_frozen_linears_;
                  ppo_rlhf's fp32 reward model), activations of one micro-batch (an estimate: activation_bytes),
                  vLLM's share while it stays awake
  optimizer step  the same without activations and bf16 copies, plus the step's temporaries: torch's foreach
                  AdamW/Adam (the default on CUDA) computes sqrt(v) of every parameter at once, one more fp32 copy of
                  the weights; adam_tf.AdamTF goes one parameter at a time
  rollout         weights, m and v, frozen models (gradients are freed before it) + the rollout engine: HF generate's
                  KV cache, or vLLM's whole --vllm-gpu-memory-utilization share
plus 1 GiB for the CUDA context and allocator slack (an estimate) in each. Under --sharding fsdp2 the weights,
gradients, optimizer state and frozen models are 1/N per rank, and what FSDP2 gathers is added (memory.sharded_rows:
the root group, embeddings + final norm + LM head, and two decoder layers, weights and gradients in fp32; a frozen
model's root group stays gathered after its forward); autocast's bf16 copies and vLLM's engine stay whole. A plan
that does not fit under ddp and fits sharded says to use --sharding fsdp2.

Two differences from the trainers' former `--dry-run` (and corrections.memory_plan) it replaces:
- both trainers average gradients by an in-place all_reduce of each p.grad (no DDP, no bucket), so more GPUs add no
  gradient buffer: the rows "gradient all-reduce bucket (fp32)" (grpo.py) and "DDP gradient buckets (fp32)"
  (ppo_rlhf.py) are gone;
- the optimizer step is its own phase. On an H100 (torch 2.11, scripts/gpu_check.py's micro-batch: random-init
  Qwen2.5-3B, countdown preset) the peak, 63.82 GiB, was reached inside AdamW's step (54.65 GiB with foreach=False),
  not in forward/backward (54.17 GiB): resident 52.33 GiB + one fp32 copy of the weights, 11.50 GiB. The train phase
  alone said 63.06 GiB (issue 20); the optimizer step phase says 63.81 GiB. Every other row keeps its bytes. The
  other presets measured below their plan there: gsm8k_qwen05b 10.39 / 13.69 GiB, gsm8k_qwen15b 32.07 / 33.28.

Model configs: a local directory is read as is; the hub names of the GPU presets are read from
tests/model_configs (the published config.json values, offline); any other name through AutoConfig
(hub or cache).
"""

import argparse
import contextlib
import copy
import io
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


import grpo  # noqa: E402
import memory  # noqa: E402
from memory import (  # noqa: E402  (the byte model the trainer reads too)
    CONTEXT_ROW,
    GIB,
    REFERENCE_GPU_GIB,
    activation_bytes,
    count_parameters,
    gpu_memory_bytes,
    kv_cache_bytes_per_token,
    memory_plan,
    model_shape,
    optimizer_step_rows,
    plan_grpo,
)
import ppo_rlhf  # noqa: E402
import rewards  # noqa: E402
import tasks  # noqa: E402

# hub name -> tests/model_configs folder (values of the published config.json, no weights)
PUBLISHED_CONFIGS = {
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen2.5-1.5B-Instruct": "Qwen2.5-1.5B-Instruct",
    "Qwen/Qwen2.5-3B": "Qwen2.5-3B",
    "Qwen/Qwen2-7B-Instruct": "Qwen2-7B-Instruct",
    "Qwen/Qwen2.5-7B-Instruct": "Qwen2.5-7B-Instruct",
    "EleutherAI/gpt-j-6b": "gpt-j-6b",
    "gpt2": "gpt2",
    "openai-community/gpt2": "gpt2",
}
TRAINERS = {"grpo": grpo, "ppo_rlhf": ppo_rlhf, "rewards": rewards}
# --all: (trainer, preset, trainer flags); the GPU presets as they are, then grpo's with vLLM
ALL_PLANS = [
    ("grpo", "gsm8k_qwen05b", ()),
    ("grpo", "gsm8k_qwen15b", ()),
    ("grpo", "countdown", ()),
    ("grpo", "gsm8k_qwen05b", ("--backend", "vllm")),
    ("grpo", "gsm8k_qwen15b", ("--backend", "vllm")),
    ("grpo", "countdown", ("--backend", "vllm", "--vllm-sleep-mode")),
    # LoRA (--lora-rank): the 0.5B run at verl's GRPO-LoRA settings, and a 7B policy on one GPU
    ("grpo", "gsm8k_qwen05b_lora", ()),
    ("grpo", "gsm8k_qwen25_7b_lora", ()),
    ("ppo_rlhf", "gpt2_sentiment", ()),
    ("ppo_rlhf", "gpt2_descriptiveness", ()),
    ("ppo_rlhf", "gpt2_tldr", ()),
    # LoRA: GPT-J-6B's PPO policy on one GPU
    ("ppo_rlhf", "gptj6b_tldr_lora", ()),
]
# --all, second table: the presets that need --sharding fsdp2, at 8 GPUs sharded and not
SHARDED_PLANS = [
    ("grpo", "gsm8k_qwen2_7b"),
    ("grpo", "gsm8k_qwen25_7b"),
    ("ppo_rlhf", "gptj6b_tldr"),
    ("rewards", "gptj6b_tldr"),
]


# ---------------------------------------------------------------------------------------------------------------
# 1. The model: its config and the sizes the plan needs
# ---------------------------------------------------------------------------------------------------------------


def read_config(name):
    """An HF config from a local directory, tests/model_configs for the presets' hub names, else
    AutoConfig."""
    from transformers import AutoConfig

    if not os.path.isdir(name) and name in PUBLISHED_CONFIGS:
        name = os.path.join(ROOT, "tests", "model_configs", PUBLISHED_CONFIGS[name])
    try:
        return AutoConfig.from_pretrained(name)
    # not on the hub / not cached offline: one line, not a traceback
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the config of {name!r}: {str(e).splitlines()[0]}") from e


def load_model_config(trainer, args):
    """(the policy's name, its config): the trainers' tiny models are built in memory
    (tasks.build_tiny_model, as grpo.py builds its tiny model of --tiny-arch and `rewards.py tiny`
    saves ppo_rlhf's tiny gpt2), anything else is read_config."""
    if trainer == "grpo":
        if args.model_name_or_path == grpo.TINY_MODEL:
            model = tasks.build_tiny_model(
                None, arch=args.tiny_arch, max_positions=grpo.TINY_MAX_POSITIONS
            )[0]
            return f"tiny {args.tiny_arch}", model.config
        return args.model_name_or_path, read_config(args.model_name_or_path)
    if not args.base_model or args.base_model == "tiny":  # ppo_rlhf's "" and rewards.py's "tiny"
        return "tiny gpt2", tasks.build_tiny_model(None, arch="gpt2")[0].config
    return args.base_model, read_config(args.base_model)


# ---------------------------------------------------------------------------------------------------------------
# 2. One rank of ppo_rlhf.py (grpo.py's, memory.plan_grpo, is read by the trainer itself: it chooses
# the layers to recompute; the bytes of KV cache, activations and the optimizer step are memory.py's too)
# ---------------------------------------------------------------------------------------------------------------


def three_phase_plan(gpu_bytes, train_rows, step_rows, rollout_rows, n_params):
    """memory_plan of the three phases, each with the CUDA context row, and the policy's size."""
    phases = {"train": train_rows, "optimizer step": step_rows, "rollout": rollout_rows}
    plan = memory_plan(
        gpu_bytes, {name: {**rows, CONTEXT_ROW: GIB} for name, rows in phases.items()}
    )
    plan["n_params"] = n_params
    return plan


def plan_ppo_rlhf(args, config, world_size, gpu_bytes):
    """Per-GPU bytes of one PPO rank (ppo_rlhf.train):
    train:   policy + value head (fp32 weights, gradients, Adam m and v), autocast's bf16 weight copies, the frozen
             reference (bf16 linears under bf16 autocast) and reward model (fp32; its backbone assumed the policy's
             architecture, as in OpenAI's setup), activations of one micro-batch (no gradient checkpointing; the
             (micro, response, vocab) logits counted 3x in fp32)
    step:    the resident models, gradients and the optimizer's temporaries (--optimizer adam_tf or adam)
    rollout: the resident models + generate's KV cache and scores for one micro-batch of query + response.
    --sharding fsdp2 (memory.sharded_rows): the three LMs, the gradients and Adam 1/world_size each (the value head
    whole), the policy's gathered groups, and the reference's and reward model's root groups, which stay gathered
    after their forward.
    --lora-rank (lora.py): the policy's frozen base (bf16 linears under bf16 autocast), and gradients, Adam state,
    temporaries and autocast copies of the adapter and the value head alone; no reference model (the adapter
    switched off)."""
    shape, n_lm = model_shape(config), count_parameters(config)
    shards, sharded, gathered, gathered_generate = memory.sharded_rows(
        shape, n_lm, world_size, args.sharding
    )
    n = n_lm / shards + shape["hidden"] + 1  # + the value head (whole)
    n_rm = n_lm / shards + shape["hidden"] + 1  # backbone + scalar head
    bf16 = args.precision != "fp32"  # ppo_rlhf.py: auto or bf16
    embeddings = shape["vocab"] * shape["hidden"] * (1 if shape["tied"] else 2)
    # a frozen LM under bf16 autocast: bf16 linears, fp32 embeddings (logprobs.bf16_frozen_linears_)
    frozen = (2 * (n_lm - embeddings) + 4 * embeddings if bf16 else 4 * n_lm) / shards
    frozen_name = f"bf16 linears{sharded}" if bf16 else f"fp32{sharded}"
    micro = ppo_rlhf.batch_sizes(args, world_size)["micro"]
    seq = args.query_length + args.response_length
    # the weights the optimizer holds: the policy and its value head, or (LoRA) the adapter and it
    trained = n
    # what autocast casts to bf16 for the forward: the trained weights' whole copy (a frozen bf16
    # base needs none)
    autocast_copied = n_lm
    if args.lora_rank:
        adapter = memory.count_adapter_parameters(
            config, args.lora_rank, args.lora_alpha, args.lora_target_modules
        )
        trained = adapter / shards + shape["hidden"] + 1
        # the adapter and the value head, whole under fsdp2 (autocast keeps the cast of every
        # layer's gathered weights)
        autocast_copied = adapter + shape["hidden"] + 1
        resident = {
            f"policy's frozen base ({frozen_name})": frozen,
            f"LoRA adapter (fp32 A and B, r = {args.lora_rank}{sharded}) + value head": 4 * trained,
        }
    else:
        resident = {
            f"policy + value head weights (fp32{sharded})": 4 * n,
            f"reference policy ({frozen_name})": frozen,
        }
    resident[f"Adam state (fp32 m and v{sharded})"] = 8 * trained
    resident[f"reward model (fp32{sharded})"] = 4 * n_rm
    if shards > 1:
        frozen_models = (
            "reward model root group" if args.lora_rank else "reference + reward model root groups"
        )
        resident[f"{frozen_models}, gathered after their forward (fp32)"] = (
            4 * (1 if args.lora_rank else 2) * (embeddings + shape["hidden"])
        )
    train_rows = {**resident, f"gradients (fp32{sharded})": 4 * trained}
    step_rows = {
        **train_rows,
        **optimizer_step_rows("adam_tf" if args.optimizer == "adam_tf" else "Adam", trained, shape),
    }
    train_rows.update(gathered)
    if bf16:
        train_rows["autocast bf16 weight copies"] = 2 * autocast_copied
    train_rows[f"activations ({micro} x {seq} tokens, estimate)"] = activation_bytes(
        shape, micro * seq, 0, micro * args.response_length
    )
    rollout_rows = dict(resident)
    rollout_rows[f"KV cache + scores (generate, {micro} x {seq} tokens)"] = (
        micro * seq * kv_cache_bytes_per_token(shape, 2 if bf16 else 4)
        + 2 * micro * args.response_length * shape["vocab"] * 4
    )
    rollout_rows.update(gathered_generate)
    return three_phase_plan(gpu_bytes, train_rows, step_rows, rollout_rows, n_lm)


def plan_rewards(args, config, world_size, gpu_bytes):
    """Per-GPU bytes of one rewards.py rank (rewards.train, float32, no autocast):
    train:   the reward model (backbone + scalar head: fp32 weights, gradients, Adam m and v), the frozen policy
             (fp32), the activations of this rank's labels (each: the query once and its 4 samples, under autograd)
    step:    the resident models, gradients and the optimizer's temporaries
    rollout: the resident models + generate's KV cache and scores for the normalisation samples
    --sharding fsdp2: both LMs, the gradients and Adam 1/world_size each (the head whole), the reward model's gathered
    groups, the frozen policy's root group gathered after its forward."""
    shape, n_lm = model_shape(config), count_parameters(config)
    shards, sharded, gathered, gathered_generate = memory.sharded_rows(
        shape, n_lm, world_size, args.sharding
    )
    n = n_lm / shards + shape["hidden"] + 3  # + the scalar head, gain and bias (whole)
    labels = max(1, args.batch_size // world_size)
    tokens = labels * (args.query_length + rewards.NUM_SAMPLES * args.response_length)
    resident = {
        f"reward model weights (fp32{sharded})": 4 * n,
        f"Adam state (fp32 m and v{sharded})": 8 * n,
        f"frozen policy (fp32{sharded})": 4 * n_lm / shards,
    }
    if shards > 1:
        embeddings = shape["vocab"] * shape["hidden"] * (1 if shape["tied"] else 2)
        resident["frozen policy root group, gathered after its forward (fp32)"] = 4 * (
            embeddings + shape["hidden"]
        )
    train_rows = {**resident, f"gradients (fp32{sharded})": 4 * n}
    step_rows = {**train_rows, **optimizer_step_rows(args.optimizer, n, shape)}
    train_rows.update(gathered)
    # fp32 activations: twice activation_bytes' bf16 estimate of the same tokens, as an upper bound
    train_rows[f"activations ({labels} labels, {tokens} tokens, fp32 estimate)"] = (
        2 * activation_bytes(shape, tokens, 0, 0)
    )
    samples = max(1, args.rollout_batch_size // world_size)
    seq = args.query_length + args.response_length
    rollout_rows = dict(resident)
    rollout_rows[f"KV cache + scores (generate, {samples} x {seq} tokens)"] = (
        samples * seq * kv_cache_bytes_per_token(shape, 4) + samples * shape["vocab"] * 4
    )
    rollout_rows.update(gathered_generate)
    return three_phase_plan(gpu_bytes, train_rows, step_rows, rollout_rows, n_lm)


# ---------------------------------------------------------------------------------------------------------------
# 3. A preset's plan, printed
# ---------------------------------------------------------------------------------------------------------------


def preset_args(trainer, preset, flags=()):
    """The preset's Args with the trainer's own flags applied (tyro, as the trainer parses them).
    PRESETS entries are (description, Args) or (description, a function returning Args). A bad flag:
    ValueError with tyro's message."""
    import tyro

    presets = TRAINERS[trainer].PRESETS
    if preset not in presets:
        raise ValueError(f"unknown {trainer} preset {preset!r}; allowed: {', '.join(presets)}")
    args = presets[preset][1]
    args = args() if callable(args) else copy.deepcopy(args)
    if not flags:
        return args
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            args, unknown = tyro.cli(
                type(args), default=args, args=list(flags), return_unknown_args=True
            )
    # tyro's boxed message: its first section (between the first two rules), on one line
    except SystemExit:
        lines = [line.strip(" │") for line in text.getvalue().splitlines()]
        rules = [i for i, line in enumerate(lines) if line and set(line) <= set("-─")] + [
            len(lines)
        ] * 2
        message = " ".join(line for line in lines[rules[0] + 1 : rules[1]] if line) or "bad value"
        raise ValueError(f"{trainer}.py flags {' '.join(flags)!r}: {message}")
    if unknown:
        raise ValueError(
            f"unknown flag(s) {' '.join(unknown)} (not plan_memory.py's, not {trainer}.py's)"
        )
    return args


def check_plan_args(trainer, args, world_size, shape):
    """What the plan reads must make sense: the trainers' batch arithmetic (their own check,
    ValueError), the rollout options, and prompt + response within the model's context."""
    if trainer == "grpo":
        grpo.local_batch_sizes(args, world_size)
        seq = args.max_prompt_length + args.max_response_length
        if args.backend not in ("hf", "vllm"):
            raise ValueError(f"unknown --backend {args.backend!r}; allowed: hf, vllm")
        if args.vllm_sleep_mode and args.backend != "vllm":
            raise ValueError("--vllm-sleep-mode needs --backend vllm")
        if not 0 < args.vllm_gpu_memory_utilization <= 1:
            raise ValueError(
                f"--vllm-gpu-memory-utilization must be in (0, 1], got {args.vllm_gpu_memory_utilization}"
            )
    else:
        if trainer == "ppo_rlhf":
            ppo_rlhf.batch_sizes(args, world_size)
        else:
            for name in ("batch_size", "rollout_batch_size"):
                if getattr(args, name) % world_size:
                    raise ValueError(f"--{name.replace('_', '-')} must be divisible by --gpus")
        seq = args.query_length + args.response_length
        if args.optimizer not in ("adam_tf", "adam"):
            raise ValueError(f"unknown --optimizer {args.optimizer!r}; allowed: adam_tf, adam")
    if args.sharding not in ("ddp", "fsdp2"):
        raise ValueError(f"unknown --sharding {args.sharding!r}; allowed: ddp, fsdp2")
    if shape["max_positions"] is not None and seq > shape["max_positions"]:
        raise ValueError(
            f"prompt + response = {seq} tokens exceeds the model's context (max_position_embeddings = "
            f"{shape['max_positions']})"
        )


def plan_preset(trainer, preset, world_size, gpu_bytes, flags=()):
    """The plan of one preset (+ trainer flags) on `world_size` GPUs of gpu_bytes (None = unknown),
    with its title and the Args it was made from; ValueError (one line) for a bad argument."""
    if trainer not in TRAINERS:
        raise ValueError(f"unknown trainer {trainer!r}; allowed: {', '.join(TRAINERS)}")
    if world_size < 1:
        raise ValueError(f"--gpus must be >= 1, got {world_size}")
    args = preset_args(trainer, preset, flags)
    model_name, config = load_model_config(trainer, args)
    check_plan_args(trainer, args, world_size, model_shape(config))
    planner = {"grpo": plan_grpo, "ppo_rlhf": plan_ppo_rlhf, "rewards": plan_rewards}[trainer]
    plan = planner(args, config, world_size, gpu_bytes)
    if trainer == "grpo":
        setting = f"backend {args.backend}{' + sleep mode' if args.vllm_sleep_mode else ''}"
    else:
        setting = "fp32" if trainer == "rewards" or args.precision == "fp32" else "bf16 autocast"
    setting += f", --sharding {args.sharding}"
    plan["title"] = (
        f"{trainer}.py {preset}{''.join(' ' + f for f in flags)}: {model_name} "
        f"({plan['n_params'] / 1e6:.1f}M parameters), {world_size} GPU(s), {setting}"
    )
    plan["args"], plan["model"] = args, model_name
    return plan


def format_memory_plan(plan):
    """The plan as a small table in GiB (one column per phase), then the verdict line."""
    names = list(plan["phases"])
    rows = list(
        dict.fromkeys(r for rows_of_phase in plan["phases"].values() for r in rows_of_phase)
    )
    rows = [r for r in rows if r != CONTEXT_ROW] + [CONTEXT_ROW]  # the context row last
    width = [max(10, len(n) + 2) for n in names]
    lines = [
        plan["title"],
        f"  {'GiB per GPU':<48}" + "".join(f"{n:>{w}}" for n, w in zip(names, width)),
    ]
    for r in rows:
        lines.append(
            f"  {r:<48}"
            + "".join(
                f"{plan['phases'][n][r] / GIB:>{w}.2f}" if r in plan["phases"][n] else f"{'-':>{w}}"
                for n, w in zip(names, width)
            )
        )
    lines.append(
        f"  {'total':<48}"
        + "".join(f"{plan['totals'][n] / GIB:>{w}.2f}" for n, w in zip(names, width))
    )
    if plan["gpu_bytes"] is None:
        lines.append(
            f"  peak {plan['peak'] / GIB:.2f} GiB (no GPU seen: pass --gpu-memory-gib to check a size)"
        )
    else:
        verdict = "fits" if plan["fits"] else "does NOT fit"
        lines.append(
            f"  peak {plan['peak'] / GIB:.2f} GiB of {plan['gpu_bytes'] / GIB:.2f} GiB: {verdict}"
        )
    if "recompute_num_layers" in plan:
        recomputed, layers = plan["recompute_num_layers"]
        lines.append(
            f"  gradient checkpointing: {recomputed} of {layers} decoder layers recomputed "
            "(grpo.py --recompute-num-layers; -1 chooses the fewest that fit "
            f"{memory.PLAN_FILL:.0%} of the GPU)"
        )
    if "note" in plan:
        lines.append("  " + plan["note"])
    return "\n".join(lines)


def format_all_plans(gpu_bytes):
    """--all: one markdown row per ALL_PLANS entry, its peak at 1 and 8 GPUs with each phase's
    total. Returns (table, the titles of the plans that do not fit)."""
    lines = [
        f"Per-GPU plans on GPUs of {gpu_bytes / GIB:.0f} GiB (`python scripts/plan_memory.py --all`), GiB: peak "
        "(train / optimizer step / rollout)",
        "",
        "| preset | model (parameters) | 1 GPU | 8 GPUs, per GPU | layers recomputed | fits |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    refused = []
    for trainer, preset, flags in ALL_PLANS:
        plans = [plan_preset(trainer, preset, gpus, gpu_bytes, flags) for gpus in (1, 8)]
        cells = [
            f"{p['peak'] / GIB:.2f} ({' / '.join(f'{t / GIB:.2f}' for t in p['totals'].values())})"
            for p in plans
        ]
        fits = " / ".join("yes" if p["fits"] else "NO" for p in plans)
        refused += [p["title"] for p in plans if not p["fits"]]
        command = f"`{trainer} {preset}{''.join(' ' + f for f in flags)}`"
        recompute = " / ".join(
            f"{p['recompute_num_layers'][0]} of {p['recompute_num_layers'][1]}"
            if "recompute_num_layers" in p
            else "-"
            for p in plans
        )
        lines.append(
            f"| {command} | {plans[0]['model']} ({plans[0]['n_params'] / 1e6:.1f}M) | {cells[0]} | "
            f"{cells[1]} | {recompute} | {fits} |"
        )
    lines += [
        "",
        f"The presets that need `--sharding fsdp2`, on 8 GPUs of {gpu_bytes / GIB:.0f} GiB, GiB per GPU: peak "
        "(train / optimizer step / rollout)",
        "",
        "| preset | model (parameters) | --sharding fsdp2 | --sharding ddp | fits (fsdp2 / ddp) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for trainer, preset in SHARDED_PLANS:
        plans = [
            plan_preset(trainer, preset, 8, gpu_bytes, ("--sharding", sharding))
            for sharding in ("fsdp2", "ddp")
        ]
        cells = [
            f"{p['peak'] / GIB:.2f} ({' / '.join(f'{t / GIB:.2f}' for t in p['totals'].values())})"
            for p in plans
        ]
        fits = " / ".join("yes" if p["fits"] else "NO" for p in plans)
        if not plans[0]["fits"]:  # under ddp these are meant not to fit
            refused.append(plans[0]["title"])
        lines.append(
            f"| `{trainer} {preset}` | {plans[0]['model']} ({plans[0]['n_params'] / 1e6:.1f}M) | {cells[0]} | "
            f"{cells[1]} | {fits} |"
        )
    return "\n".join(lines), refused


# ---------------------------------------------------------------------------------------------------------------
# 4. The command line
# ---------------------------------------------------------------------------------------------------------------


def fail(message):
    """One line on stderr and exit status 2 (argparse's convention, the trainers' `<script>.py:
    error: ...`)."""
    print(f"plan_memory.py: error: {message}".replace("\n", " "), file=sys.stderr)
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints its usage too; every script here says one line
        fail(message)


def main(argv=None):
    parser = OneLineParser(
        prog="plan_memory.py",
        allow_abbrev=False,
        description=__doc__.splitlines()[0],
        epilog="Any other flag is the trainer's: python grpo.py PRESET --help lists grpo's.",
    )
    parser.add_argument("trainer", nargs="?", help="grpo or ppo_rlhf")
    parser.add_argument("preset", nargs="?", help="a name in the trainer's PRESETS")
    parser.add_argument(
        "--gpus", type=int, default=1, help="GPUs (torchrun processes) to plan for (default 1)"
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=0.0,
        help="GPU size in GiB (default: the GPU torch sees; none: no verdict; --all: 80)",
    )
    parser.add_argument(
        "--all", action="store_true", help="every GPU preset at 1 and 8 GPUs, as a markdown table"
    )
    opts, flags = parser.parse_known_args(argv)
    if opts.gpu_memory_gib < 0:
        fail(f"--gpu-memory-gib must be >= 0, got {opts.gpu_memory_gib}")
    try:
        if opts.all:
            if opts.trainer or flags:
                fail("--all takes no trainer, preset or trainer flag")
            table, refused = format_all_plans(
                gpu_memory_bytes(opts.gpu_memory_gib or REFERENCE_GPU_GIB)
            )
            print(table)
            if refused:
                fail(f"{len(refused)} plan(s) do not fit: {'; '.join(refused)}")
            return 0
        if not opts.preset:
            fail("give a trainer and a preset (e.g. grpo countdown) or --all")
        plan = plan_preset(
            opts.trainer, opts.preset, opts.gpus, gpu_memory_bytes(opts.gpu_memory_gib), flags
        )
    except ValueError as e:
        fail(e)
    print(format_memory_plan(plan))
    if plan["fits"] is False:
        hint = {
            "grpo": "lower --ppo-micro-batch-size-per-gpu or --generation-batch-size, use --vllm-sleep-mode",
            "ppo_rlhf": "lower --local-micro-batch-size",
            "rewards": "lower --batch-size or --rollout-batch-size",
        }[opts.trainer]
        if plan["args"].sharding == "ddp" and opts.gpus > 1:
            sharded = plan_preset(
                opts.trainer,
                opts.preset,
                opts.gpus,
                plan["gpu_bytes"],
                [*flags, "--sharding", "fsdp2"],
            )
            if sharded["fits"]:
                hint = f"use --sharding fsdp2 (its plan: {sharded['peak'] / GIB:.2f} GiB per GPU)"
        fail(
            f"the plan needs {plan['peak'] / GIB:.2f} GiB per GPU, more than {plan['gpu_bytes'] / GIB:.2f} GiB: "
            f"{hint}, or use more/larger GPUs"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
