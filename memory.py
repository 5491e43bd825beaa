"""GPU memory and speed of the trainer's forward and backward: the per-rank memory plan, how many
decoder layers recompute their activations in backward, which layers run compiled, and how rows
are grouped into micro-batches. Nothing here changes a number the trainers compute beyond float
rounding; a first read of grpo.py can skip every `memory.` call.

    1. the byte model    model_shape, count_parameters (from a config, no weights),
                         activation_bytes (one micro-batch's activations under bf16 autocast),
                         kv_cache_bytes_per_token, optimizer_step_rows
    2. the plan          memory_plan (phases that do not overlap in time; the peak is the
                         largest), plan_grpo (one grpo.py rank); scripts/plan_memory.py prints a
                         preset's plan (and plans ppo_rlhf.py's ranks)
    3. recompute         recompute_choice (the fewest layers whose recompute makes the train phase
                         fit PLAN_FILL of the GPU), recompute_layers (grpo.py's
                         --gradient-checkpointing, applied to the first k layers)
    4. compiled layers   compile_decoder_layers (--compile-layers: each decoder layer through
                         torch.compile; HF generate's KV-cache forward stays eager)
    5. micro-batches     micro_batches (a row count, or with --use-dynamic-bsz
                         token_budget_micro_batches: at most N real tokens per forward)
    6. the flags         MemoryArgs (--logprob-chunk-size, --gradient-checkpointing,
                         --recompute-num-layers, --compile-layers, --use-remove-padding,
                         --use-dynamic-bsz, --ppo-max-token-len-per-gpu: the mixin grpo.py's
                         Args inherits) and check_memory_args

Measured against the plan on an H100 and an H200: bench/RESULTS.md, scripts/gpu_check.py.
"""

import types
from dataclasses import dataclass

import torch

import harness


# --------------------------------------------------------------------------------------------------
# 1. The byte model: what one rank holds, from a model's config
# --------------------------------------------------------------------------------------------------


GIB = 2**30
# the GPU size for vLLM's share when none is given or seen (and plan_memory.py --all's GPU size)
REFERENCE_GPU_GIB = 80.0
CONTEXT_ROW = "CUDA context + allocator slack (estimate)"
# the share of a GPU the train phase's plan may fill when grpo.py chooses how many layers to
# recompute (the rest: the estimate's error and the allocator's fragmentation)
PLAN_FILL = 0.85


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


def count_adapter_parameters(config, rank, alpha, target_modules):
    """Exact number of LoRA parameters (A and B of every adapted layer) lora.add_adapter gives
    AutoModelForCausalLM.from_config(config) at this rank, on the meta device (no memory)."""
    import lora
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = lora.add_adapter(
            AutoModelForCausalLM.from_config(config), rank, alpha, target_modules
        )
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


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


def activation_bytes(shape, tokens, recomputed_layers, logprob_rows):
    """Estimated activation memory of one training micro-batch of `tokens` = micro_batch * padded
    length, under bf16 autocast with fp32 weights (the residual stream stays fp32). Per layer and
    token, what backward keeps of a layer that is not recomputed (bytes):
        fp32: the inputs of the two norms and their normalised copies   16 * hidden
        bf16: two norm outputs, q/k/v, attention output, o_proj input   8 * hidden + 4 * kv_dim
        bf16: q and k after RoPE, the attention kernel's own copies     8 * hidden (measured)
        bf16: MLP (gated: gate, up, act(gate), product; gpt2: fc out, gelu out)   8 or 4 * I
    (the attention matrix is not stored: SDPA/flash recompute it; the third row is what an H100
    measured beyond the first two: 1.466 GiB per kept Qwen2.5-0.5B layer at 16 x 1536 tokens,
    bench/RESULTS.md). Of each of the `recomputed_layers` (gradient checkpointing) only its fp32
    input (4 * hidden per token) is kept, plus one layer's full set while it is recomputed. The LM
    head runs in chunks of `logprob_rows` positions (logprobs.token_logprobs_and_entropy): 3
    fp32 (rows, V) tensors at a time."""
    h, kv, inter = shape["hidden"], shape["kv_dim"], shape["intermediate"]
    # the four rows above, in order
    per_token_layer = 16 * h + (8 * h + 4 * kv) + 8 * h + (8 if shape["gated_mlp"] else 4) * inter
    kept = (shape["layers"] - recomputed_layers) * tokens * per_token_layer
    recomputed = recomputed_layers * tokens * 4 * h
    if recomputed_layers:
        recomputed += tokens * per_token_layer
    return kept + recomputed + 3 * logprob_rows * shape["vocab"] * 4


def layers_to_recompute(shape, tokens, logprob_rows, activation_budget):
    """The fewest decoder layers to recompute (gradient checkpointing) for one micro-batch's
    activations (activation_bytes) to fit `activation_budget` bytes: 0 if all fit kept, every layer
    if even that does not fit. Every recomputed layer costs about a third of its forward-backward
    again, every kept one ~40 x hidden bytes per token more; the recomputed are the first ones
    (Megatron-LM's --recompute-method block), whose activations would wait longest for backward."""
    for layers in range(shape["layers"] + 1):
        if activation_bytes(shape, tokens, layers, logprob_rows) <= activation_budget:
            return layers
    return shape["layers"]


def optimizer_step_rows(name, n, shape):
    """The step's temporaries: torch's foreach Adam/AdamW (CUDA's default) takes sqrt(v) of all n
    parameters in one fp32 list before dividing (torch/optim/adam.py, _multi_tensor_adam);
    adam_tf.AdamTF runs torch's fused kernel, which updates theta, m and v in place element by
    element: no temporaries."""
    if name == "adam_tf":
        return {"AdamTF step temporaries (fused kernel: none)": 0}
    return {f"{name} step temporaries (foreach sqrt(v), fp32)": 4 * n}


# --------------------------------------------------------------------------------------------------
# 2. The plan: phases that do not overlap in time
# --------------------------------------------------------------------------------------------------


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


def sharded_rows(shape, n, world_size, sharding):
    """What --sharding changes in a rank's plan: (shards, suffix for a sharded row's name, the
    gathered rows of the train phase, the gathered rows of an HF generate). ddp: 1, no suffix,
    nothing gathered. fsdp2 (harness.shard_model): each rank keeps 1/world_size of the weights,
    gradients and optimizer state; the root group (embeddings, final norm, LM head: `root`
    parameters) stays gathered from its forward to the end of its backward, with its whole fp32
    gradient before the reduce-scatter, and two decoder layers are gathered at a time (the one
    running and the one FSDP2 prefetches), weights and gradients in fp32."""
    if sharding != "fsdp2":
        return 1, "", {}, {}
    root = shape["vocab"] * shape["hidden"] * (1 if shape["tied"] else 2) + shape["hidden"]
    layer = (n - root) / shape["layers"]
    train = {
        "gathered: the root group + 2 decoder layers (fp32 weights, gradients)": 8
        * (root + 2 * layer)
    }
    generate = {
        "gathered: the root group + 2 decoder layers (fp32 weights)": 4 * (root + 2 * layer)
    }
    return world_size, f", 1/{world_size} per rank", train, generate


def plan_grpo(args, config, world_size, gpu_bytes):
    """Per-GPU bytes of one GRPO rank (grpo.train: AdamW over fp32 weights, bf16 (or fp16) autocast
    unless --precision fp32):
      train:   weights, gradients, AdamW (m, v), autocast's bf16 weight copies, the reference model
               (kl_loss_coef > 0), vLLM's share unless --vllm-sleep-mode, activations of one
               micro-batch with the layers recompute_choice recomputes
      step:    weights, gradients, AdamW (m, v), the reference, AdamW's temporaries, vLLM's share
               unless asleep
      rollout: weights, AdamW (m, v), the reference + HF generate's KV cache for
               generation_batch_size rows (and one fp32 row of logits each), or vLLM's whole share
      all:     with --rollout-staleness K, the lagging rollout copy and K + 1 weight snapshots
               (fp32).
    --sharding fsdp2 (sharded_rows): weights, gradients, AdamW and the reference are 1/world_size
    each, the gathered groups are added, and the reference's root group stays gathered after its
    forward (no backward reshards it); autocast's bf16 copies stay whole (autocast keeps the cast
    of every layer's gathered weights until the forward ends), and so does vLLM's engine.
    --lora-rank (lora.py): the frozen base (bf16 linears under bf16 autocast, as the reference's),
    and gradients, AdamW state, temporaries and autocast copies of the adapter alone; no reference
    model (the adapter switched off)."""
    shape, n = model_shape(config), count_parameters(config)
    shards, sharded, gathered, gathered_generate = sharded_rows(shape, n, world_size, args.sharding)
    # --lora-rank: the optimizer's weights are the adapter's (`trained`), the base is frozen
    trained = n
    if args.lora_rank:
        trained = count_adapter_parameters(
            config, args.lora_rank, args.lora_alpha, args.lora_target_modules
        )
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
    if args.lora_rank:
        # no reference model (the adapter switched off); bf16_frozen_linears_ under bf16
        base = 2 * (n - embeddings) + 4 * embeddings if ref_bf16 else 4 * n
        ref = 0
        resident = {
            f"frozen base ({'bf16 linears' if ref_bf16 else 'fp32'}{sharded})": base / shards,
            f"LoRA adapter (fp32 A and B, r = {args.lora_rank}{sharded})": 4 * trained / shards,
        }
    else:
        resident = {f"policy weights (fp32{sharded})": 4 * n / shards}
    resident[f"AdamW state (fp32 m and v{sharded})"] = 8 * trained / shards
    if ref:
        name = "reference model (bf16 linears" if ref_bf16 else "reference model (fp32"
        resident[f"{name}{sharded})"] = ref / shards
        if shards > 1:
            root = shape["vocab"] * shape["hidden"] * (1 if shape["tied"] else 2) + shape["hidden"]
            resident["reference root group, gathered after its forward (fp32)"] = 4 * root
    # the lagging rollout copy and its K + 1 snapshots, fp32 on the trainer's device
    if args.rollout_staleness:
        resident[f"rollout copy + {args.rollout_staleness + 1} weight snapshots (fp32)"] = (
            4 * n * (args.rollout_staleness + 2)
        )
    # asleep the engine holds ~0: level 1 offloads its weights, drops its KV cache, and
    # (rollout.VLLMBackend passes sleep_mode_offload_cudagraph) offloads its CUDA-graph pool too,
    # which vLLM otherwise keeps on the GPU
    awake = {"vLLM share, awake": share} if share and not args.vllm_sleep_mode else {}
    train_rows = {**resident, f"gradients (fp32{sharded})": 4 * trained / shards}
    step_rows = {**train_rows, **optimizer_step_rows("AdamW", trained / shards, shape), **awake}
    train_rows.update(gathered)
    if bf16:
        # LoRA under bf16: the base is bf16 already, autocast copies the adapter alone
        copied = trained if args.lora_rank and ref_bf16 else n
        train_rows["autocast bf16 weight copies"] = 2 * copied
    # one forward's tokens: the budget with --use-dynamic-bsz, else a micro-batch of the longest
    # sequences (packing saves nothing when every sequence is as long as it may be)
    tokens = args.ppo_max_token_len_per_gpu
    label = f"activations (at most {tokens} tokens, estimate)"
    if not args.use_dynamic_bsz:
        micro = args.ppo_micro_batch_size_per_gpu
        tokens = micro * seq
        label = f"activations ({micro} x {seq} tokens, estimate)"
    train_rows.update(awake)
    recompute = recompute_choice(args, shape, tokens, gpu_bytes, train_rows)
    train_rows[label] = activation_bytes(shape, tokens, recompute, args.logprob_chunk_size)
    rollout_rows = dict(resident)
    if args.backend == "vllm":
        rollout_rows[f"vLLM share ({args.vllm_gpu_memory_utilization:g} of the GPU)"] = share
    else:
        seqs = args.generation_batch_size or args.train_batch_size // world_size * args.rollout_n
        rollout_rows[f"KV cache (HF generate, {seqs} x {seq} tokens)"] = (
            seqs * seq * kv_cache_bytes_per_token(shape, 2 if bf16 else 4)
            + seqs * shape["vocab"] * 4
        )
        rollout_rows.update(gathered_generate)
    phases = {"train": train_rows, "optimizer step": step_rows, "rollout": rollout_rows}
    plan = memory_plan(
        gpu_bytes, {name: {**rows, CONTEXT_ROW: GIB} for name, rows in phases.items()}
    )
    plan["n_params"] = n
    plan["recompute_num_layers"] = (recompute, shape["layers"])
    # what vLLM's share must hold: its bf16 weights, then KV cache (more runs in waves)
    if args.backend == "vllm":
        seqs = args.train_batch_size // world_size * args.rollout_n
        plan["note"] = (
            f"vLLM share {share / GIB:.2f} GiB = bf16 weights {2 * n / GIB:.2f} + KV "
            f"cache/activations {(share - 2 * n) / GIB:.2f}; the whole rollout ({seqs} x {seq} "
            f"tokens) needs {seqs * seq * kv_cache_bytes_per_token(shape) / GIB:.2f} GiB of KV"
        )
    return plan


def resident_problem(n, args, gpu_bytes, world_size):
    """A one-line refusal, naming --sharding fsdp2, when the weights, gradients and Adam state of
    the trained model (16 bytes per parameter, n) cannot fit one GPU under --sharding ddp, whatever
    the batch; None when they fit, under fsdp2 or LoRA (the plan counts them), or without a GPU
    size."""
    if gpu_bytes is None or args.sharding != "ddp" or args.lora_rank or 16 * n <= gpu_bytes:
        return None
    return (
        f"--sharding ddp: the fp32 weights, gradients and Adam state alone need {16 * n / GIB:.1f} "
        f"GiB on every GPU, more than its {gpu_bytes / GIB:.1f} GiB: use --sharding fsdp2 "
        f"({16 * n / world_size / GIB:.1f} GiB of them per GPU on {world_size}; docs/sharding.md)"
    )


# --------------------------------------------------------------------------------------------------
# 3. Recompute: how many decoder layers recompute their activations
# --------------------------------------------------------------------------------------------------


def recompute_choice(args, shape, tokens, gpu_bytes, train_rows):
    """How many decoder layers grpo.py recomputes in backward: none without
    --gradient-checkpointing; --recompute-num-layers if >= 0; else (-1) the fewest for the train
    phase to fit PLAN_FILL of the GPU with everything else it holds (train_rows, the context row
    included), or all of them where no GPU size is known (a CPU)."""
    if not args.gradient_checkpointing:
        return 0
    if args.recompute_num_layers >= 0:
        return min(args.recompute_num_layers, shape["layers"])
    if gpu_bytes is None:
        return shape["layers"]
    budget = PLAN_FILL * gpu_bytes - sum(train_rows.values()) - GIB
    return layers_to_recompute(shape, tokens, args.logprob_chunk_size, budget)


def recompute_layers(model, args, device, rank, world_size=1):
    """--gradient-checkpointing: the first k decoder layers recompute their activations in
    backward, the others keep them; k = --recompute-num-layers, or the memory plan's choice for
    this GPU (plan_grpo, recompute_choice; per rank under --sharding fsdp2)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    gpu_bytes = gpu_memory_bytes() if device.type == "cuda" else None
    plan = plan_grpo(args, model.config, world_size, gpu_bytes)
    recomputed, total = plan["recompute_num_layers"]
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers[recomputed:]:
        layer.gradient_checkpointing = False
    if rank == 0:
        print(
            f"gradient checkpointing: {recomputed} of {total} decoder layers recomputed, planned "
            f"train-phase peak {plan['totals']['train'] / GIB:.2f} GiB"
        )


# --------------------------------------------------------------------------------------------------
# 4. Compiled decoder layers (--compile-layers)
# --------------------------------------------------------------------------------------------------


def compile_decoder_layers(model):
    """--compile-layers: torch.compile each decoder layer on its own, so that its element-wise
    work (RMSNorm, rotary, SiLU x up, the residual adds, the casts autocast inserts) runs as fused
    kernels. The layers share one compiled graph (the same code; the parameters are its inputs):
    one compile per shape, not one per layer (torchtitan's apply_compile compiles per block for
    this reason). A forward with a KV cache (HF generate) stays eager: its shapes change at every
    token. Returns the number of layers compiled."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    compiled = {}
    for layer in layers:
        eager_forward = type(layer).forward
        if eager_forward not in compiled:
            compiled[eager_forward] = torch.compile(eager_forward)
        # a bound method: a deepcopy of the model (rollout.HFBackend's copy) binds it to the copy
        layer.forward = types.MethodType(
            layer_forward(eager_forward, compiled[eager_forward]), layer
        )
    return len(layers)


def layer_forward(eager_forward, compiled_forward):
    """A decoder layer's forward that runs `compiled_forward` unless a KV cache is passed in."""
    from transformers.cache_utils import Cache

    def forward(self, *args, **kwargs):
        if any(isinstance(value, Cache) for value in (*args, *kwargs.values())):
            return eager_forward(self, *args, **kwargs)
        return compiled_forward(self, *args, **kwargs)

    return forward


# --------------------------------------------------------------------------------------------------
# 5. Micro-batches: a row count, or a token budget
# --------------------------------------------------------------------------------------------------


def micro_batches(attention_mask, start, end, args):
    """The rows of each forward over rows start .. end of a rank's batch (a minibatch, or the whole
    batch for pi_old and pi_ref): slices of --ppo-micro-batch-size-per-gpu rows, in order, or with
    --use-dynamic-bsz token_budget_micro_batches' groups."""
    if not args.use_dynamic_bsz:
        micro = args.ppo_micro_batch_size_per_gpu
        return [slice(i, min(i + micro, end)) for i in range(start, end, micro)]
    tokens = attention_mask[start:end].sum(1).tolist()
    groups = token_budget_micro_batches(tokens, args.ppo_max_token_len_per_gpu)
    return [torch.tensor(group, device=attention_mask.device) + start for group in groups]


def token_budget_micro_batches(tokens, budget):
    """Rows grouped so that each group's real tokens (tokens[i]: row i's prompt and response) sum
    to at most `budget`, in as few groups as verl's rule gives (utils/seqlen_balancing.py,
    rearrange_micro_batches): k = ceil(total / budget) groups to start with, k + 1 while a
    balanced split into k breaks the budget, every rank the same k (each forward of a sharded
    model is a collective: verl's same_micro_num_in_dp). The split: longest row first, into the
    group with the fewest tokens (ties: the lower index), each group's rows in batch order; verl
    balances with Karmarkar-Karp on a FLOP estimate instead, which moves no gradient (the loss is
    normalised by the minibatch's counts), only the time of each forward. Deterministic: a
    resumed run groups as the uninterrupted one."""
    k = min(len(tokens), -(-sum(tokens) // budget))
    while True:
        k = max(harness.all_gather_objects(k))  # the largest of every rank's
        groups, loads = [[] for _ in range(k)], [0] * k
        for i in sorted(range(len(tokens)), key=lambda i: -tokens[i]):
            g = min(range(k), key=lambda g: loads[g])
            groups[g].append(i)
            loads[g] += tokens[i]
        if all(harness.all_gather_objects(max(loads) <= budget)):
            return [sorted(group) for group in groups]
        k += 1


# --------------------------------------------------------------------------------------------------
# 6. The flags: what the trainer's forward and backward may spend (grpo.py's Args inherits them)
# --------------------------------------------------------------------------------------------------


@dataclass
class MemoryArgs:
    """Memory and speed of the trainer's forward and backward: none of them changes what is
    computed beyond float rounding; flat on grpo.py's command line and in its args.json."""

    logprob_chunk_size: int = 512
    """Response tokens per LM-head chunk for logprobs/entropy (~3 x chunk x vocab x 4 bytes, not a
    (B, R, V))."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (verl enable_gradient_checkpointing), in the layers
    --recompute-num-layers says."""
    recompute_num_layers: int = -1
    """With --gradient-checkpointing: how many decoder layers (the first ones) recompute their
    activations in backward; the others keep them (Megatron-LM's --recompute-num-layers, block
    method). -1: the memory plan's choice for this GPU (memory.recompute_choice: the fewest that
    fit; all of them without a GPU); scripts/plan_memory.py prints it."""
    compile_layers: bool = False
    """torch.compile each decoder layer (memory.compile_decoder_layers): fused element-wise
    kernels in the trainer's forward and backward; the first steps pay the compile, HF generate
    stays eager. The GPU presets turn it on (an update 1.19-1.27x the plain bf16 loss's speed on an
    H200, bench/RESULTS.md); --no-compile-layers turns it off."""
    use_remove_padding: bool = True
    """Compute log pi on real tokens only (verl's actor_rollout_ref.model.use_remove_padding): each
    micro-batch's sequences packed side by side with their own position ids
    (logprobs.pack_sequences), an sdpa model's attention switched to each sequence's own
    (logprobs.use_varlen_attention; with --compile-layers a block-causal mask instead), or its
    padding-only columns cut where this model cannot pack exactly (logprobs.packing_is_exact,
    said once); --no-use-remove-padding: the padded batch."""
    use_dynamic_bsz: bool = False
    """Micro-batches by a token budget instead of a row count (verl's use_dynamic_bsz):
    --ppo-max-token-len-per-gpu real tokens per forward at most (token_budget_micro_batches);
    --ppo-micro-batch-size-per-gpu is then not read. The same gradient either way (the loss is
    normalised by the minibatch's global counts)."""
    ppo_max_token_len_per_gpu: int = 16384
    """With --use-dynamic-bsz: the most real tokens (prompt + response) one forward holds, at least
    --max-prompt-length + --max-response-length (verl's default 16384)."""


def check_memory_args(args):
    """A chunk of at least one token, -1 (the plan's choice) or a layer count to recompute, and a
    token budget that holds the longest sequence."""
    harness.check_rules(args, {}, {">= 1": "logprob_chunk_size", ">= -1": "recompute_num_layers"})
    longest = args.max_prompt_length + args.max_response_length
    if args.use_dynamic_bsz and args.ppo_max_token_len_per_gpu < longest:
        raise ValueError(
            f"--ppo-max-token-len-per-gpu {args.ppo_max_token_len_per_gpu} must hold the longest "
            f"sequence: --max-prompt-length + --max-response-length = {longest}"
        )
