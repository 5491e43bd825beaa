"""The per-GPU memory plan of a grpo.py or ppo_rlhf.py preset, from the model's config alone (no
weights are read).

    python scripts/plan_memory.py grpo countdown --gpus 8 --gpu-memory-gib 80
    python scripts/plan_memory.py grpo gsm8k_qwen05b --gpus 8 --ppo-micro-batch-size-per-gpu 8 --backend vllm
    python scripts/plan_memory.py ppo_rlhf gpt2_sentiment --gpus 1
    python scripts/plan_memory.py --all    # every GPU preset at 1 and 8 GPUs of 80 GiB: the README's table

Any flag after the preset that is not this script's is the trainer's (`python grpo.py PRESET --help`
lists them) and changes the plan as it would change the run. Exit status 0 if the plan fits (or no
GPU size is known: no
--gpu-memory-gib and no GPU seen), 2 with one line `plan_memory.py: error: ...` if an argument is bad or the plan
does not fit. No vLLM is needed: the trainers' modules import it only to run an engine.

What one rank holds, in three phases that do not overlap in time (the plan's peak is the largest
phase):
  train           fp32 weights, fp32 gradients, the optimizer's fp32 m and v, autocast's bf16 weight copies, the
                  frozen models (the reference with bf16 Linear weights, rollout.bf16_frozen_linears_;
                  ppo_rlhf's fp32 reward model), activations of one micro-batch (an estimate: activation_bytes),
                  vLLM's share while it stays awake
  optimizer step  the same without activations and bf16 copies, plus the step's temporaries: torch's foreach
                  AdamW/Adam (the default on CUDA) computes sqrt(v) of every parameter at once, one more fp32 copy of
                  the weights; adam_tf.AdamTF goes one parameter at a time
  rollout         weights, m and v, frozen models (gradients are freed before it) + the rollout engine: HF generate's
                  KV cache, or vLLM's whole --vllm-gpu-memory-utilization share
plus 1 GiB for the CUDA context and allocator slack (an estimate) in each.

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

import torch  # noqa: E402

import grpo  # noqa: E402
import ppo_rlhf  # noqa: E402
import tasks  # noqa: E402

GIB = 2**30
# the GPU size for vLLM's share when none is given or seen, and --all's GPU size
REFERENCE_GPU_GIB = 80.0
CONTEXT_ROW = "CUDA context + allocator slack (estimate)"
# hub name -> tests/model_configs folder (values of the published config.json, no weights)
PUBLISHED_CONFIGS = {
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen2.5-1.5B-Instruct": "Qwen2.5-1.5B-Instruct",
    "Qwen/Qwen2.5-3B": "Qwen2.5-3B",
    "gpt2": "gpt2",
    "openai-community/gpt2": "gpt2",
}
TRAINERS = {"grpo": grpo, "ppo_rlhf": ppo_rlhf}
# --all: (trainer, preset, trainer flags); the GPU presets as they are, then grpo's with vLLM
ALL_PLANS = [
    ("grpo", "gsm8k_qwen05b", ()),
    ("grpo", "gsm8k_qwen15b", ()),
    ("grpo", "countdown", ()),
    ("grpo", "gsm8k_qwen05b", ("--backend", "vllm")),
    ("grpo", "gsm8k_qwen15b", ("--backend", "vllm")),
    ("grpo", "countdown", ("--backend", "vllm", "--vllm-sleep-mode")),
    ("ppo_rlhf", "gpt2_sentiment", ()),
    ("ppo_rlhf", "gpt2_descriptiveness", ()),
    ("ppo_rlhf", "gpt2_tldr", ()),
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
    if not args.base_model:
        return "tiny gpt2", tasks.build_tiny_model(None, arch="gpt2")[0].config
    return args.base_model, read_config(args.base_model)


def model_shape(config):
    """The sizes the plan needs, from an HF config (gpt2's n_embd/n_layer/n_inner or llama/qwen2
    names): dict(hidden, layers, intermediate, vocab, heads, kv_dim, gated_mlp, tied,
    max_positions)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, heads = config.hidden_size, config.num_attention_heads
    intermediate = (
        getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    )
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return dict(
        hidden=hidden,
        layers=config.num_hidden_layers,
        intermediate=intermediate,
        vocab=config.vocab_size,
        heads=heads,
        kv_dim=kv_heads * head_dim,
        gated_mlp=hasattr(config, "intermediate_size"),
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        max_positions=getattr(config, "max_position_embeddings", None),
    )


def count_parameters(config):
    """Exact number of parameters of AutoModelForCausalLM.from_config(config), built on the meta
    device (no memory, no weights read); a tied LM head is counted once (module.parameters()
    de-duplicates shared tensors)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# 2. Bytes: KV cache, activations, the optimizer step, and a plan's phases
# ---------------------------------------------------------------------------------------------------------------


def gpu_memory_bytes(gpu_memory_gib=0.0):
    """A plan's GPU size: --gpu-memory-gib if given, else the total memory of the GPU torch sees,
    else None."""
    if gpu_memory_gib > 0:
        return int(gpu_memory_gib * GIB)
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1]
    return None


def kv_cache_bytes_per_token(shape, dtype_bytes=2):
    """K and V of every layer for one token: 2 * layers * kv_dim * bytes (bf16 on GPU: 2)."""
    return 2 * shape["layers"] * shape["kv_dim"] * dtype_bytes


def activation_bytes(shape, tokens, gradient_checkpointing, logprob_rows):
    """Estimated activation memory of one training micro-batch of `tokens` = micro_batch * padded
    length, under bf16 autocast with fp32 weights (the residual stream stays fp32). Per layer and
    token, what backward keeps:
        fp32: the inputs of the two norms and their normalised fp32 copies        16 * hidden bytes
        bf16: two norm outputs, q/k/v, attention output, o_proj input              8 * hidden + 4 * kv_dim
        bf16: MLP  (gated: gate, up, act(gate), product = 8 * I; gpt2: fc out, gelu out = 4 * I)
    (the attention matrix is not stored: SDPA/flash recompute it). With gradient checkpointing only
    each layer's fp32 input (4 * hidden per token) is kept, plus one layer's full set while it is
    recomputed. The LM head runs in chunks of `logprob_rows` positions
    (corrections.token_logprobs_and_entropy): 3 fp32 (rows, V) tensors at a time."""
    h, kv, inter = shape["hidden"], shape["kv_dim"], shape["intermediate"]
    per_token_layer = 16 * h + 8 * h + 4 * kv + (8 if shape["gated_mlp"] else 4) * inter
    if gradient_checkpointing:
        layers = shape["layers"] * tokens * 4 * h + tokens * per_token_layer
    else:
        layers = shape["layers"] * tokens * per_token_layer
    return layers + 3 * logprob_rows * shape["vocab"] * 4


def optimizer_step_rows(name, n, shape):
    """The step's temporaries: torch's foreach Adam/AdamW (CUDA's default) takes sqrt(v) of all n
    parameters in one fp32 list before dividing (torch/optim/adam.py, _multi_tensor_adam);
    adam_tf.AdamTF runs torch's fused kernel, which updates theta, m and v in place element by
    element: no temporaries."""
    if name == "adam_tf":
        return {"AdamTF step temporaries (fused kernel: none)": 0}
    return {f"{name} step temporaries (foreach sqrt(v), fp32)": 4 * n}


def memory_plan(gpu_bytes, phases):
    """Per-GPU memory plan: `phases` maps a phase name to an ordered dict {row: bytes}; a phase's
    total is the sum of its rows, and the plan's peak is the largest phase total (the phases do not
    overlap in time). Returns dict(phases, totals, peak, gpu_bytes, fits); gpu_bytes None = unknown
    (fits is None)."""
    totals = {name: sum(rows.values()) for name, rows in phases.items()}
    peak = max(totals.values())
    return dict(
        phases=phases,
        totals=totals,
        peak=peak,
        gpu_bytes=gpu_bytes,
        fits=None if gpu_bytes is None else peak <= gpu_bytes,
    )


# ---------------------------------------------------------------------------------------------------------------
# 3. One rank of each trainer
# ---------------------------------------------------------------------------------------------------------------


def plan_grpo(args, config, world_size, gpu_bytes):
    """Per-GPU bytes of one GRPO rank (grpo.train: AdamW over fp32 weights, bf16 (or fp16) autocast
    unless --precision fp32):
      train:   weights, gradients, AdamW (m, v), autocast's bf16 weight copies, the reference model (kl_loss_coef > 0),
               activations of one micro-batch, vLLM's share unless --vllm-sleep-mode
      step:    weights, gradients, AdamW (m, v), the reference, AdamW's temporaries, vLLM's share unless asleep
      rollout: weights, AdamW (m, v), the reference + HF generate's KV cache for generation_batch_size rows (and one
               fp32 row of logits each), or vLLM's whole share
      all:     with --rollout-staleness K, the lagging rollout copy and K + 1 weight snapshots (fp32)."""
    shape, n = model_shape(config), count_parameters(config)
    bf16 = args.precision != "fp32"  # fp16 autocast holds the same 2-byte copies
    # bf16_frozen_linears_ (only under bf16: under fp16 the reference stays fp32)
    ref_bf16 = args.precision in ("auto", "bf16")
    seq = args.max_prompt_length + args.max_response_length
    # kept fp32 by bf16_frozen_linears_
    embeddings = shape["vocab"] * shape["hidden"] * (1 if shape["tied"] else 2)
    ref = (
        0
        if args.kl_loss_coef <= 0
        else (2 * (n - embeddings) + 4 * embeddings if ref_bf16 else 4 * n)
    )
    share = (
        args.vllm_gpu_memory_utilization * (gpu_bytes or REFERENCE_GPU_GIB * GIB)
        if args.backend == "vllm"
        else 0
    )
    resident = {"policy weights (fp32)": 4 * n, "AdamW state (fp32 m and v)": 8 * n}
    if ref:
        resident["reference model (bf16 linears)" if ref_bf16 else "reference model (fp32)"] = ref
    # the lagging rollout copy and its K + 1 snapshots, fp32 on the trainer's device
    if args.rollout_staleness:
        resident[f"rollout copy + {args.rollout_staleness + 1} weight snapshots (fp32)"] = (
            4 * n * (args.rollout_staleness + 2)
        )
    # asleep the engine holds ~0: level 1 offloads its weights, drops its KV cache, and
    # (rollout.VLLMBackend passes sleep_mode_offload_cudagraph) offloads its CUDA-graph pool too,
    # which vLLM otherwise keeps on the GPU
    awake = {"vLLM share, awake": share} if share and not args.vllm_sleep_mode else {}
    train_rows = {**resident, "gradients (fp32)": 4 * n}
    step_rows = {**train_rows, **optimizer_step_rows("AdamW", n, shape), **awake}
    if bf16:
        train_rows["autocast bf16 weight copies"] = 2 * n
    micro = args.ppo_micro_batch_size_per_gpu
    train_rows[f"activations ({micro} x {seq} tokens, estimate)"] = activation_bytes(
        shape, micro * seq, args.gradient_checkpointing, args.logprob_chunk_size
    )
    train_rows.update(awake)
    rollout_rows = dict(resident)
    if args.backend == "vllm":
        rollout_rows[f"vLLM share ({args.vllm_gpu_memory_utilization:g} of the GPU)"] = share
    else:
        seqs = args.generation_batch_size or args.train_batch_size // world_size * args.rollout_n
        rollout_rows[f"KV cache (HF generate, {seqs} x {seq} tokens)"] = (
            seqs * seq * kv_cache_bytes_per_token(shape, 2 if bf16 else 4)
            + seqs * shape["vocab"] * 4
        )
    phases = {"train": train_rows, "optimizer step": step_rows, "rollout": rollout_rows}
    plan = memory_plan(
        gpu_bytes, {name: {**rows, CONTEXT_ROW: GIB} for name, rows in phases.items()}
    )
    plan["n_params"] = n
    # what vLLM's share must hold: its bf16 weights, then KV cache (more runs in waves)
    if args.backend == "vllm":
        seqs = args.train_batch_size // world_size * args.rollout_n
        plan["note"] = (
            f"vLLM share {share / GIB:.2f} GiB = bf16 weights {2 * n / GIB:.2f} + KV cache/activations "
            f"{(share - 2 * n) / GIB:.2f}; the whole rollout ({seqs} x {seq} tokens) "
            f"needs {seqs * seq * kv_cache_bytes_per_token(shape) / GIB:.2f} GiB of KV"
        )
    return plan


def plan_ppo_rlhf(args, config, world_size, gpu_bytes):
    """Per-GPU bytes of one PPO rank (ppo_rlhf.train):
    train:   policy + value head (fp32 weights, gradients, Adam m and v), autocast's bf16 weight copies, the frozen
             reference (bf16 linears under bf16 autocast) and reward model (fp32; its backbone assumed the policy's
             architecture, as in OpenAI's setup), activations of one micro-batch (no gradient checkpointing; the
             (micro, response, vocab) logits counted 3x in fp32)
    step:    the resident models, gradients and the optimizer's temporaries (--optimizer adam_tf or adam)
    rollout: the resident models + generate's KV cache and scores for one micro-batch of query + response."""
    shape, n_lm = model_shape(config), count_parameters(config)
    n = n_lm + shape["hidden"] + 1  # + the value head
    n_rm = n_lm + shape["hidden"] + 1  # backbone + scalar head
    bf16 = args.precision != "fp32"  # ppo_rlhf.py: auto or bf16
    embeddings = shape["vocab"] * shape["hidden"] * (1 if shape["tied"] else 2)
    ref = 2 * (n_lm - embeddings) + 4 * embeddings if bf16 else 4 * n_lm
    micro = ppo_rlhf.batch_sizes(args, world_size)["micro"]
    seq = args.query_length + args.response_length
    resident = {
        "policy + value head weights (fp32)": 4 * n,
        "Adam state (fp32 m and v)": 8 * n,
        "reference policy (bf16 linears)" if bf16 else "reference policy (fp32)": ref,
        "reward model (fp32)": 4 * n_rm,
    }
    train_rows = {**resident, "gradients (fp32)": 4 * n}
    step_rows = {
        **train_rows,
        **optimizer_step_rows("adam_tf" if args.optimizer == "adam_tf" else "Adam", n, shape),
    }
    if bf16:
        train_rows["autocast bf16 weight copies"] = 2 * n
    train_rows[f"activations ({micro} x {seq} tokens, estimate)"] = activation_bytes(
        shape, micro * seq, False, micro * args.response_length
    )
    rollout_rows = dict(resident)
    rollout_rows[f"KV cache + scores (generate, {micro} x {seq} tokens)"] = (
        micro * seq * kv_cache_bytes_per_token(shape, 2 if bf16 else 4)
        + 2 * micro * args.response_length * shape["vocab"] * 4
    )
    phases = {"train": train_rows, "optimizer step": step_rows, "rollout": rollout_rows}
    plan = memory_plan(
        gpu_bytes, {name: {**rows, CONTEXT_ROW: GIB} for name, rows in phases.items()}
    )
    plan["n_params"] = n_lm
    return plan


# ---------------------------------------------------------------------------------------------------------------
# 4. A preset's plan, printed
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
        ppo_rlhf.batch_sizes(args, world_size)
        seq = args.query_length + args.response_length
        if args.optimizer not in ("adam_tf", "adam"):
            raise ValueError(f"unknown --optimizer {args.optimizer!r}; allowed: adam_tf, adam")
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
    plan = (plan_grpo if trainer == "grpo" else plan_ppo_rlhf)(args, config, world_size, gpu_bytes)
    if trainer == "grpo":
        setting = f"backend {args.backend}{' + sleep mode' if args.vllm_sleep_mode else ''}"
    else:
        setting = "fp32" if args.precision == "fp32" else "bf16 autocast"
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
        "| preset | model (parameters) | 1 GPU | 8 GPUs, per GPU | fits |",
        "| --- | --- | --- | --- | --- |",
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
        lines.append(
            f"| {command} | {plans[0]['model']} ({plans[0]['n_params'] / 1e6:.1f}M) | {cells[0]} | "
            f"{cells[1]} | {fits} |"
        )
    return "\n".join(lines), refused


# ---------------------------------------------------------------------------------------------------------------
# 5. The command line
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
        hint = (
            "lower --ppo-micro-batch-size-per-gpu or --generation-batch-size, use --vllm-sleep-mode"
            if opts.trainer == "grpo"
            else "lower --local-micro-batch-size"
        )
        fail(
            f"the plan needs {plan['peak'] / GIB:.2f} GiB per GPU, more than {plan['gpu_bytes'] / GIB:.2f} GiB: "
            f"{hint}, or use more/larger GPUs"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
