"""log pi: the log-probability the trainer gives each sampled token, and the entropy of the
distribution it was sampled from. Both trainers' losses start here (grpo.py's update_policy and
pi_old recompute, ppo_rlhf.py's rollout and update, rewards.py's train/kl).

Read section 1 first: the definition, a dozen lines of plain torch. Every other function of this
file computes exactly that, for a real model in a real batch, where the definition's float32
(N, V) log-softmax would not fit (16 x 1,536 tokens x Qwen2.5's 151,936-token vocabulary: 15 GB):

    1. the definition        reference_logprobs_and_entropy: log_softmax(z / T)[token] and
                             -sum p log p over the whole vocabulary, in float32
    2. a run's settings      LogprobSettings: temperature, chunk size, forward and LM-head
                             precision, a truncated sampler to replay; built once from the flags
    3. the entry points      response_logprobs (a policy's forward over a rollout batch -> (B, R),
                             padded, or packed: pack_sequences, varlen_sdpa_attention,
                             packing_is_exact) and token_logprobs_and_entropy (hidden states + LM
                             head -> (N,))
    4. forward precision     --precision: autocast over fp32 master weights (resolve_precision,
                             autocast_context), a bf16 frozen reference (bf16_frozen_linears_),
                             heads in fp32 (fp32_project)
    5. the LM head's product --lm-head-precision: IEEE fp32, TF32 or bf16 inputs with fp32 output
                             (head_mm), forward and backward
    6. a sampler's kept set  truncation_mask: top-k / top-p / min-p as transformers and vLLM apply
                             them, so a truncated sampler's tokens are scored over what it drew from
    7. the chunked pass      the log-softmax chunk by chunk, its gradient written out
                             (_ChunkedHead: backward recomputes each chunk's logits), compiled
                             element-wise kernels on CUDA

A first read can stop after section 3: where one chunk of plain float32 logits is scored (a tiny
run on a CPU), section 3 calls section 1 itself. tests/test_logprobs.py holds sections 3-7 equal to
section 1.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch

# --precision: the forward dtype of the trainers and of the rollout engine (auto = bf16 on CUDA,
# fp32 on CPU); the master weights, optimizer state, logprobs, values and rewards stay float32
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = ("auto", *AUTOCAST_DTYPES)
# --lm-head-precision's choices (head_mm; docs/logprobs.md#lm-head-precision)
HEAD_PRECISIONS = ("auto", "fp32", "tf32", "bf16")


# --------------------------------------------------------------------------------------------------
# 1. The definition
# --------------------------------------------------------------------------------------------------


def reference_logprobs_and_entropy(logits, tokens, temperature=1.0):
    """For N positions with logits z (N, V) and the sampled tokens a (N,):

        log pi(a) = log_softmax(z / T)[a]
        H         = -sum_v pi(v) log pi(v)

    one float32 log-softmax over the whole vocabulary serving both. Dividing by the sampling
    temperature T scores each token under the distribution that sampled it (RLHF blog detail
    policy 1; verl's logprobs_from_logits after logits.div_(temperature)). Returns (logprobs (N,),
    entropy (N,)) in float32, for finite logits (a token the sampler can never emit is the chunked
    path's `banned`). It holds all N x V logits at once: the trainers run it where one chunk of
    logits is scored (token_logprobs_and_entropy), the chunked path elsewhere, which
    tests/test_logprobs.py holds to it."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    p = logp.exp()
    logprobs = logp.gather(-1, tokens[:, None]).squeeze(-1)
    entropy = -(p * logp).sum(-1)
    return logprobs, entropy


# --------------------------------------------------------------------------------------------------
# 2. What a run holds constant about log pi
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class LogprobSettings:
    """The settings every log pi of a run shares, built once from its flags in train() and passed
    down as one record (eq=False: `banned` is a tensor)."""

    temperature: float = 1.0
    """T: logits / T, the distribution the sampler drew from."""
    chunk_size: int = 512
    """Tokens per LM-head chunk: the largest float32 tensor is (chunk_size, V), not (N, V)."""
    precision: str = "auto"
    """The backbone's forward dtype over fp32 weights (PRECISIONS; response_logprobs' autocast)."""
    head_precision: str = "auto"
    """The LM head's product (HEAD_PRECISIONS, head_precision); the log-softmax is float32."""
    truncation: Optional[tuple] = None
    """(top_k, top_p, min_p, order) of a truncated sampler: each token scored over the kept set it
    was drawn from (truncation_mask); None: over the whole vocabulary."""
    banned: Optional[torch.Tensor] = None
    """(V,) bool: tokens the sampler can never emit (ppo_rlhf.py's padding token), or None."""
    layout: str = "padded"
    """How response_logprobs lays a rollout batch out for the backbone (LAYOUTS): "padded" as
    rollout.make_batch pads it; "packed" its real tokens only (pack_sequences); "trimmed" the
    columns some row fills (trim_padding), where this model cannot pack exactly."""


# response_logprobs' layouts of a rollout batch (LogprobSettings.layout; grpo.py's
# --use-remove-padding chooses packed, or trimmed where packing_is_exact says no)
LAYOUTS = ("padded", "packed", "trimmed")


# --------------------------------------------------------------------------------------------------
# 3. The entry points
# --------------------------------------------------------------------------------------------------


def response_logprobs(
    model, batch, settings, entropy_grad=False, sum_pi_squared=False, left_out_of_kept_set=False
):
    """(logprobs, entropy), each (B, R), of a rollout batch's response tokens under `model` (an HF
    causal LM; batch: rollout.make_batch's input_ids, attention_mask, position_ids, responses,
    response_mask). The definition applied to the LM head's logits at the positions that predict a
    response token (position t predicts token t + 1), without a (B, T, V) float32 log-softmax: the
    backbone's hidden states of the valid response tokens go through token_logprobs_and_entropy,
    chunk by chunk. Padding gets logprob 0 and entropy 0. The backbone runs in settings.precision,
    over the batch laid out as settings.layout says: padded, packed (the real tokens only, no
    position computed for padding) or trimmed; the three give the same numbers up to float32
    summation order (tests/test_logprobs.py).

    sum_pi_squared (no gradient): a third (B, R) output, sum_v pi(v)^2 of each token's
    distribution (the optimal token baseline's); left_out_of_kept_set (no gradient, with
    settings.truncation): a last (B, R) output, 1.0 where the replayed kept set leaves out the
    sampled token."""
    lm_head = model.get_output_embeddings()
    # (B, R): where the outputs go back, whatever the layout
    valid = batch["response_mask"].bool()
    if settings.layout == "trimmed":
        batch = trim_padding(batch)
    # (B, R'): the response tokens scored, the same ones in the same order (R' < R if trimmed)
    scored = batch["response_mask"].bool()
    R = batch["responses"].shape[1]
    with autocast_context(batch["input_ids"].device, settings.precision):
        if settings.layout == "packed":
            # (rows, width): every sequence's real tokens side by side, its position ids from 0;
            # with no attention mask the model reads where a sequence starts from its position ids
            # and attends within each sequence only
            packed = pack_sequences(batch, packed_width(model, batch))
            hidden = backbone_output(
                model,
                input_ids=packed["input_ids"],
                position_ids=packed["position_ids"],
                use_cache=False,
                **packed.get("varlen", {}),
            ).last_hidden_state
            # (N, H): the packed places that predict the valid response tokens
            hidden = hidden.flatten(0, 1)[packed["predicts"][scored]]
        else:
            # (B, P+R, H): the backbone's last hidden state (the whole model's forward, no logits)
            hidden = backbone_output(
                model,
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
                use_cache=False,
            ).last_hidden_state
            # (B, R, H): the positions that predict the R response tokens
            hidden = hidden[:, -R - 1 : -1]
            # (N, H): the valid response tokens only
            hidden = hidden[scored]
        # (N,)
        tokens = batch["responses"][scored]
        token_stats = token_logprobs_and_entropy(
            hidden,
            tokens,
            lm_head,
            settings,
            entropy_grad=entropy_grad,
            sum_pi_squared=sum_pi_squared,
            left_out_of_kept_set=left_out_of_kept_set,
        )
    # (B, R) each: logprobs, entropy[, sum_v pi(v)^2][, left out]
    return tuple(
        torch.zeros(valid.shape, device=hidden.device).masked_scatter(valid, stat)
        for stat in token_stats
    )


def pack_sequences(batch, width):
    """A rollout batch's real tokens (attention_mask 1: the prompt's, the response's, a tool's)
    packed into rows of `width` positions with no padding between sequences (verl's
    use_remove_padding, TRL's padding_free):

        input_ids     (rows, width)  the sequences one after another, the longest first, each
                                     in the first row with room; a row's unused tail is filler
        position_ids  (rows, width)  each sequence's own positions 0 .. n-1 (make_batch's at its
                                     real tokens); the filler's 0, 1, ... as one more sequence
        predicts      (B, R)         for response token j of row i, the place in the flattened
                                     rows of the token that predicts it (padded column P + j - 1)
        varlen        (one row only) cu_seq_lens_q/k, max_length_q/k: the sequences' boundaries,
                                     for a variable-length attention (flash's, VARLEN_SDPA)

    Given no attention mask, transformers reads where a sequence starts from the position ids (a
    position that is not the one before plus 1: masking_utils.find_packed_sequence_indices) and
    masks attention block-causally, within each sequence: every sequence's hidden states are its
    padded row's. The position ids are the one detail that makes it right: with the padded
    layout's mask gone they are all that keeps sequences apart, and a row's positions count from
    its own first token, as make_batch's do."""
    real = batch["attention_mask"].bool()
    lengths = real.sum(1).tolist()
    # first fit, longest first: the flat place of each sequence's first token
    starts = [0] * len(lengths)
    filled = []  # tokens placed in each packed row
    placed = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for i in placed:
        row = next((r for r, n in enumerate(filled) if n + lengths[i] <= width), len(filled))
        if row == len(filled):
            filled.append(0)
        starts[i] = row * width + filled[row]
        filled[row] += lengths[i]
    device = real.device
    # (B, P+R): the flat packed place of each real token
    flat_index = torch.tensor(starts, device=device)[:, None] + real.long().cumsum(1) - 1
    # the filler counts 0, 1, ... from the end of its row's last sequence
    columns = torch.arange(width, device=device)
    position_ids = (columns[None] - torch.tensor(filled, device=device)[:, None]).clamp(min=0)
    # the filler's token: any (its outputs are never read), a real one (transformers warns of a
    # padding token in a batch without an attention mask)
    input_ids = torch.full_like(position_ids, int(batch["input_ids"][real][0]))
    input_ids.view(-1)[flat_index[real]] = batch["input_ids"][real]
    position_ids.view(-1)[flat_index[real]] = batch["position_ids"][real]
    P = real.shape[1] - batch["responses"].shape[1]
    packed = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "predicts": flat_index[:, P - 1 : -1],
    }
    if len(filled) == 1:
        # one row: where each sequence starts and ends in it, as flash attention's varlen kernel
        # (and varlen_sdpa_attention) read it, and the longest
        ends = torch.tensor([lengths[i] for i in placed], device=device).cumsum(0)
        cu_seq_lens = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        packed["varlen"] = dict(
            cu_seq_lens_q=cu_seq_lens,
            cu_seq_lens_k=cu_seq_lens,
            max_length_q=max(lengths),
            max_length_k=max(lengths),
        )
    return packed


# the attention implementation of a packed forward (use_varlen_attention): each sequence's own
# causal attention, flash attention's variable-length kernel written out with sdpa
VARLEN_SDPA = "varlen_sdpa"


def varlen_sdpa_attention(module, query, key, value, attention_mask, cu_seq_lens_q=None, **kwargs):
    """transformers' sdpa attention (query (1, heads, N, d), key/value (1, kv_heads, N, d)) for one
    packed row of sequences whose boundaries are cu_seq_lens_q ([0, n_1, n_1 + n_2, ..., N], the
    argument flash attention's varlen kernel reads): each sequence attends causally to its own
    tokens, no N x N mask, no product across sequences. Without cu_seq_lens_q (a padded batch,
    HF generate) it is transformers' sdpa attention itself, the same call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    bounds = cu_seq_lens_q.tolist()
    window = getattr(module, "sliding_window", None)
    if window and max(b - a for a, b in zip(bounds, bounds[1:])) > window:
        raise ValueError(f"varlen attention keeps no sliding window ({window} tokens)")
    # (1, n_i, heads, d) each, in order: the sequences' attention outputs side by side again
    outputs = [
        sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None)[0]
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(outputs, dim=1), None


def use_varlen_attention(model):
    """Switch an sdpa model's attention to VARLEN_SDPA (registered with transformers' attention
    and mask interfaces as sdpa's own mask): the same numbers on a padded batch, and on a packed
    row each sequence's attention alone, at the cost of its own length squared (the row's length
    squared with sdpa's block-causal mask). Any other implementation is left as it is (flash
    attention reads cu_seq_lens_q itself). Returns whether it switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
    model.set_attn_implementation(VARLEN_SDPA)
    return True


def packed_width(model, batch):
    """The packed rows' width: the longest sequence, so no row's attention is wider than the
    padded batch's (the mask-based attention of sdpa and eager computes every pair of a row); one
    row of every token for flash attention, whose variable-length kernel reads sequences of one
    row only, and spends nothing across them; one row for VARLEN_SDPA too."""
    lengths = batch["attention_mask"].sum(1)
    implementation = str(getattr(model.config, "_attn_implementation", ""))
    if "flash" in implementation or implementation == VARLEN_SDPA:
        return int(lengths.sum())
    return int(lengths.max())


def trim_padding(batch):
    """The columns of a rollout batch that some row fills: the longest prompt's and the longest
    response's (at least one), every other column padding in every row. The padded layout on
    fewer columns, the fallback where packing is not exact (packing_is_exact)."""
    real = batch["attention_mask"].bool()
    R = batch["responses"].shape[1]
    P = real.shape[1] - R
    prompt_width = int(real[:, :P].sum(1).max())
    response_width = max(1, int(real[:, P:].sum(1).max()))
    columns = slice(P - prompt_width, P + response_width)
    trimmed = {k: batch[k][:, columns] for k in ("input_ids", "attention_mask", "position_ids")}
    for k in ("responses", "response_mask"):
        trimmed[k] = batch[k][:, :response_width]
    return trimmed


@torch.no_grad()
def packing_is_exact(model):
    """Whether `model` keeps packed sequences apart: two sequences of 3 and 5 tokens in one row
    with restarting position ids (no attention mask) against each in a forward of its own, the
    last hidden states within 1% of their largest (measured on the tiny Qwen2 and GPT-2 and
    SmolLM2: 4e-7 to 1.3e-5 when kept apart, 0.52 to 1.0 when the second sequence attends to the
    first). False for an attention implementation that builds no mask from position ids. Every
    rank of a sharded model calls it (a forward)."""
    device = model.get_input_embeddings().weight.device
    first = torch.arange(1, 4, device=device)[None]
    second = torch.arange(4, 9, device=device)[None]

    def hidden(ids, positions, **varlen):
        out = backbone_output(
            model, input_ids=ids, position_ids=positions, use_cache=False, **varlen
        )
        return out.last_hidden_state.float()

    alone = torch.cat([hidden(first, first - 1), hidden(second, second - 4)], dim=1)
    # the one-row layout, as pack_sequences gives it: its position ids and its boundaries
    bounds = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    varlen = dict(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=5, max_length_k=5)
    together = hidden(
        torch.cat([first, second], 1), torch.cat([first - 1, second - 4], 1), **varlen
    )
    return bool((together - alone).abs().max() <= 0.01 * alone.abs().max())


def backbone_output(model, **inputs):
    """The output of an HF causal LM's backbone (model.get_decoder(): last_hidden_state (B, T, H),
    and the KV cache when asked for one) from the whole model's forward on `inputs`, its LM head
    switched off for the call (no (B, T, V) logits, and no bf16 copy of the head's matrix under
    autocast): the chunked head applies it later, in float32. The whole model's forward, not the
    backbone's alone: under FSDP2 (harness.shard_model) the model's root gathers the embeddings,
    final norm and LM head as its forward starts, and keeps them gathered for the chunked head and
    the backward."""
    captured = {}

    def keep(module, module_inputs, output):
        captured["output"] = output

    head = model.get_output_embeddings()
    handle = model.get_decoder().register_forward_hook(keep)
    head.forward = _no_logits
    try:
        model(**inputs)
    finally:
        handle.remove()
        del head.forward  # the class's forward again
    return captured["output"]


def head_weight(head):
    """W (V, H) of an LM head: a bias-free nn.Linear's weight, or for a head LoRA adapts
    (--lora-target-modules with lm_head) W + (alpha / r) B A with its gradient (lora.head_weight);
    None for None (the hidden states are the logits)."""
    if head is None:
        return None
    if isinstance(head, torch.nn.Linear) and head.bias is None:
        return head.weight
    base = getattr(head, "base_layer", None)
    if isinstance(base, torch.nn.Linear) and base.bias is None:
        import lora

        return lora.head_weight(head)
    raise ValueError("head must be None or a bias-free nn.Linear (an LM head), LoRA's or not")


def _no_logits(hidden):
    """backbone_output's LM head: an empty (..., 0) tensor, nothing computed."""
    return hidden.new_empty(*hidden.shape[:-1], 0)


def token_logprobs_and_entropy(
    hidden,
    tokens,
    head,
    settings,
    entropy_grad=False,
    sum_pi_squared=False,
    left_out_of_kept_set=False,
):
    """The definition (reference_logprobs_and_entropy) for N positions, from their hidden states
    (N, H) and the LM head W (`head`: a bias-free nn.Linear, LoRA-adapted or not, head_weight;
    None: `hidden` are the logits):

        z_t       = W hidden_t / T
        logprob_t = log_softmax(z_t)[token_t]
        entropy_t = -sum_v p_t,v log p_t,v

    One chunk of plain float32 logits (no banned token, no truncation, IEEE fp32: a CPU, N <=
    chunk_size) is scored by the definition itself, reference_logprobs_and_entropy. Otherwise the
    work goes chunk by chunk over N (settings.chunk_size rows), so the largest float32 tensor
    is (chunk_size, V). Under autograd with several chunks the gradient is written out
    (_ChunkedHead: backward recomputes each chunk's logits instead of keeping all N x V of them); a
    single chunk keeps its one (N, V) log-softmax, no more than the recompute would hold at once,
    and skips a second LM-head product (5-8% of a SmolLM2 PPO micro-step on CPU,
    bench/bench_ppo_cpu.py). The entropy is a constant (no gradient) unless entropy_grad. The
    head's product runs in settings.head_precision (head_precision: IEEE fp32 on a CPU), the
    softmax always in float32 with autocast off. settings.banned (V,) removes tokens the sampler
    can never emit; settings.truncation scores each token over the kept set K of a truncated
    sampler (replay: truncation_mask, recomputed from these logits with the engine's rules, the
    sampled token always kept), the distribution it was drawn from, so pi_train / pi_rollout
    carries no log S. Returns (logprobs (N,), entropy (N,)) in float32 (float64 stays float64).

    sum_pi_squared (no gradient): a third output, sum_v p_t,v^2 (N,), from the same chunks (the
    optimal token baseline's w_t, objectives.optimal_token_baseline_advantages; over K with a
    truncation). left_out_of_kept_set (no gradient, with a truncation): a last output (N,), 1.0
    where the kept set recomputed from these logits leaves out the sampled token (it is scored over
    K + the token: the sampler's set and this one differ there)."""
    weight = head_weight(head)
    temperature = settings.temperature
    chunk_size = settings.chunk_size
    banned = settings.banned
    truncation = settings.truncation
    precision = head_precision(settings.head_precision, hidden) if weight is not None else "fp32"
    # float32 (float64 stays float64), autocast off: the softmax never sees bf16 logits
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    with torch.autocast(hidden.device.type, enabled=False):
        hidden = hidden.to(dtype)
        weight = weight.to(dtype) if weight is not None else None
        # several chunks (or CUDA, whose no-gradient path is compiled): the written-out gradient
        several = tokens.shape[0] > chunk_size or hidden.is_cuda
        differentiable = torch.is_grad_enabled() and (
            hidden.requires_grad or (weight is not None and weight.requires_grad)
        )
        if (sum_pi_squared or left_out_of_kept_set) and differentiable:
            raise ValueError(
                "sum_pi_squared and left_out_of_kept_set are computed without a gradient"
                " (torch.no_grad())"
            )
        if left_out_of_kept_set and truncation is None:
            raise ValueError("left_out_of_kept_set needs a truncation (the kept set's rules)")
        # one chunk of float32 logits scored over the whole vocabulary (a tiny run's every micro-
        # batch on a CPU): the definition itself (section 1) with autograd's gradient, bit for bit
        # the values of the chunked pass below
        if (
            not (several or sum_pi_squared or left_out_of_kept_set)
            and banned is None
            and truncation is None
            and precision == "fp32"
            and dtype == torch.float32
        ):
            logits = _head_product(weight, hidden, precision)
            token_logprobs, entropy = reference_logprobs_and_entropy(logits, tokens, temperature)
            if not entropy_grad:
                entropy = entropy.detach()
            return token_logprobs, entropy
        if torch.is_grad_enabled() and hidden.requires_grad and several:
            return _ChunkedHead.apply(
                hidden,
                weight,
                tokens,
                temperature,
                banned,
                entropy_grad,
                precision,
                chunk_size,
                truncation,
            )
        # no gradient: the bf16 head's weight cast once (with one, _HeadLinear's own cast keeps
        # the weight's gradient in float32)
        operand = weight if torch.is_grad_enabled() else _operand(weight, precision)
        return _chunked_stats(
            operand,
            hidden,
            tokens,
            temperature,
            banned,
            entropy_grad,
            precision,
            truncation,
            chunk_size,
            sum_pi_squared,
            left_out_of_kept_set,
        )


# --------------------------------------------------------------------------------------------------
# 4. The trainer's forward precision (--precision): autocast over fp32 master weights
# --------------------------------------------------------------------------------------------------


def resolve_precision(precision, device):
    """--precision auto: bf16 on CUDA (verl's FSDP mixed precision), fp32 on CPU (the exact path the
    parity tests hold to HF and vLLM). Any other value is kept, on either device: CPU autocast runs
    real bfloat16 / float16 kernels too (slowly; the tests and the CPU mismatch table use it)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast_context(device, precision="auto"):
    """Autocast to the forward dtype of `precision` over fp32 master weights: bf16 (verl's FSDP
    mixed precision) or fp16 (Qi et al. 2025, "Defeating the Training-Inference Mismatch via
    FP16"); fp32: none. The heads inside run in fp32 anyway (logprobs.fp32_project)."""
    dtype = AUTOCAST_DTYPES[resolve_precision(precision, device)]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def bf16_frozen_linears_(model):
    """Store a model's frozen nn.Linear weights (and biases) in bf16, in place, except the output
    embedding (the LM head; with tied embeddings it is the embedding matrix) and everything that is
    not a Linear (embeddings, norms). Under bf16 autocast a Linear casts its fp32 weight to bf16
    before the matmul anyway, so the forward is bit-for-bit the one of the fp32 model
    (tests/test_logprobs.py checks it) at about half the memory; verl keeps its reference model
    in bf16 for the same reason (fsdp_workers.py, ref param_dtype bf16). Use only under autocast:
    without it the fp32 activations meet bf16 weights. Returns the number of parameters now in
    bf16."""
    output_embedding = (
        model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    )
    n = 0
    for module in model.modules():
        # gpt2's Conv1D: addmm
        is_linear = isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
        if is_linear and module is not output_embedding:
            for name in ("weight", "bias"):
                p = getattr(module, name)
                # a trained weight (a LoRA adapter's A and B) keeps its float32 master
                if p is not None and p.dtype == torch.float32 and not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
                    n += p.numel()
    return n


def fp32_project(project, hidden):
    """project(hidden) in float32 with autocast off (float64 stays float64). Under bf16 autocast an
    LM head returns bf16 logits: for logits of magnitude 30-130 that rounds each one by up to 0.25
    and the logprobs by ~0.1 nats (tests/test_grpo.py measures it), so heads run in float32 here, as
    TRL's GRPOConfig.cast_lm_head_to_fp32 keeps lm_head in float32 (by casting the module and its
    input; under autocast that is not enough). A module with a weight (nn.Linear, a value/reward
    head) is applied as F.linear on float32 copies of its weight and bias, so a bf16 module works
    too; any other callable gets the float32 hidden states."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    with torch.autocast(hidden.device.type, enabled=False):
        hidden = hidden.to(dtype)
        weight = getattr(project, "weight", None)
        if isinstance(project, torch.nn.Linear) and weight is not None:
            bias = project.bias.to(dtype) if project.bias is not None else None
            out = torch.nn.functional.linear(hidden, weight.to(dtype), bias)
        else:
            out = project(hidden)
    return out.to(torch.promote_types(out.dtype, torch.float32))


# --------------------------------------------------------------------------------------------------
# 5. The LM head's product (--lm-head-precision), forward and backward
# --------------------------------------------------------------------------------------------------


def _product(a, b, total):
    """a @ b, or total += a @ b in place (no (V, H) temporary per chunk for the LM head's weight
    gradient)."""
    return a @ b if total is None else total.addmm_(a, b)


def _tf32_mm(a, b, total=None):
    """_product on TF32 tensor cores (CUDA), then the previous setting back: scoped, as vLLM's
    in-process worker resets torch's float32 matmul precision to "highest" when it starts
    (fp32_precision: torch >= 2.9's API). On a CPU, IEEE fp32."""
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        return _product(a, b, total)
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def head_mm(a, b, precision, total=None):
    """a @ b for the LM head (or total += a @ b, in place), float32 out (in: float32, or bfloat16
    for bf16), in `precision`:
    fp32  IEEE float32 (the CPU path; --precision fp32)
    tf32  TF32 tensor cores on CUDA (inputs rounded to 10 mantissa bits, fp32 sums); IEEE on a CPU
    bf16  bfloat16 inputs, float32 output (torch.mm / addmm's out_dtype): bf16 tensor-core speed
          without rounding the logits to bf16; a CPU emulates it exactly (inputs rounded to bf16,
          fp32 sums)
    Autocast is off inside (the callers' products are float32 by construction)."""
    with torch.autocast(a.device.type, enabled=False):
        if precision == "tf32":
            return _tf32_mm(a, b, total)
        if precision == "bf16" and a.is_cuda:
            a_bf16 = a.bfloat16()
            b_bf16 = b.bfloat16()
            if total is None:
                return torch.mm(a_bf16, b_bf16, out_dtype=torch.float32)
            return torch.addmm(total, a_bf16, b_bf16, out_dtype=torch.float32, out=total)
        if precision == "bf16":
            # the emulation's sums in float32 (float64 stays float64)
            dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
            return _product(a.bfloat16().to(dtype), b.bfloat16().to(dtype), total)
        return _product(a, b, total)


class _HeadLinear(torch.autograd.Function):
    """hidden @ weight.T in `precision` (head_mm), forward and both backward products (which
    autograd runs later, outside any scope the caller set)."""

    @staticmethod
    def forward(ctx, hidden, weight, precision):
        ctx.save_for_backward(hidden, weight)
        ctx.precision = precision
        return head_mm(hidden, weight.T, precision)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad_hidden = head_mm(grad, weight, ctx.precision)
        grad_weight = head_mm(grad.T, hidden, ctx.precision)
        return grad_hidden, grad_weight, None


def _operand(weight, precision):
    """The LM head's weight as its products read it: bfloat16 for the bf16 head (cast once per
    call, not once per chunk: a (V, H) cast costs about as much as the product), else itself."""
    if weight is None or precision != "bf16":
        return weight
    return weight.bfloat16()


def _head_product(weight, hidden, precision):
    """(n, V) float32 logits of n hidden states through the LM head in `precision` (weight None:
    `hidden` are the logits)."""
    if weight is None:
        return hidden
    if precision == "fp32":
        return torch.nn.functional.linear(hidden, weight)
    return _HeadLinear.apply(hidden, weight, precision)


def head_precision(requested, hidden):
    """The LM head product's precision (head_mm) for --lm-head-precision `requested`: auto is tf32
    on CUDA under bf16 or fp16 autocast (docs/logprobs.md#lm-head-precision) and IEEE fp32
    otherwise; a CPU always gets IEEE fp32."""
    if not hidden.is_cuda:
        return "fp32"
    if requested == "auto":
        return "tf32" if torch.is_autocast_enabled("cuda") else "fp32"
    return requested


# --------------------------------------------------------------------------------------------------
# 6. A truncated sampler's kept set (top-k, top-p, min-p), as the engines apply it
# --------------------------------------------------------------------------------------------------


def truncation_mask(scaled_logits, top_k=0, top_p=1.0, min_p=0.0, order="hf"):
    """(n, V) bool, the kept set K of a truncated sampler, from logits / T (banned tokens already
    -inf), each rule as transformers' warpers and vLLM's sampler apply it:
        top-k  keep z >= the k-th largest z (ties at the k-th kept; k = 0: off)
        top-p  sort ascending, drop the tokens whose cumulative probability is <= 1 - p (the most
               likely token always stays; p = 1: off)
        min-p  keep p_v >= min_p * max_v p_v (min_p = 0: off)
    in the engine's order: "hf" top-k, top-p, min-p (transformers' warper order); "vllm" min-p,
    then top-k and top-p (vLLM v1's Sampler.sample: min-p is an argmax-invariant logits processor
    that runs before its top-k/top-p sampler). Each rule sees the logits the previous one left.
    The sampler draws from p_K = softmax over K, so for a sampled token
        log pi_K(a) = log pi(a) - log S,   S = sum_{v in K} pi(v)   (the kept mass, <= 1)
    and a trainer that scores the token over the full vocabulary sees a ratio pi / pi_K = S before
    any update (TRL issue 6789; vLLM PR 49577 returns K for that reason)."""
    z = scaled_logits
    V = z.shape[-1]
    top_k_on = 0 < top_k < V

    def unsort(sorted_z, sorted_ids):
        return torch.empty_like(sorted_z).scatter_(-1, sorted_ids, sorted_z)

    def top_p_rule(sorted_z):
        # ascending: drop what leaves the cumulative probability at or below 1 - p; the most
        # likely token always stays
        drop = torch.softmax(sorted_z, dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[:, -1] = False
        return sorted_z.masked_fill(drop, -math.inf)

    def min_p_rule(z):
        p = torch.softmax(z, dim=-1)
        return z.masked_fill(p < min_p * p.amax(dim=-1, keepdim=True), -math.inf)

    if order == "hf":
        # TopKLogitsWarper (torch.topk), TopPLogitsWarper (its own sort of what top-k left),
        # MinPLogitsWarper
        if top_k_on:
            z = z.masked_fill(z < torch.topk(z, top_k, dim=-1).values[:, -1:], -math.inf)
        if top_p < 1.0:
            sorted_z, sorted_ids = torch.sort(z, dim=-1)
            z = unsort(top_p_rule(sorted_z), sorted_ids)
        if min_p > 0.0:
            z = min_p_rule(z)
        return z > -math.inf
    # vLLM: its min-p processor, then apply_top_k_top_p (one ascending sort for both)
    if min_p > 0.0:
        z = min_p_rule(z)
    if top_k_on or top_p < 1.0:
        sorted_z, sorted_ids = torch.sort(z, dim=-1)
        if top_k_on:
            kth = sorted_z[:, V - top_k : V - top_k + 1]
            sorted_z = sorted_z.masked_fill(sorted_z < kth, -math.inf)
        if top_p < 1.0:
            sorted_z = top_p_rule(sorted_z)
        z = unsort(sorted_z, sorted_ids)
    return z > -math.inf


# --------------------------------------------------------------------------------------------------
# 7. The chunked pass: the log-softmax chunk by chunk, its gradient written out
# --------------------------------------------------------------------------------------------------


def _scaled(logits, tokens, temperature, banned, truncation):
    # logits / T with the tokens the sampler cannot emit at -inf: `banned` (V,) always, and with
    # `truncation` (top_k, top_p, min_p, order) the tokens outside its kept set (replay); and
    # left_out (n,) bool, the sampled tokens that kept set leaves out (None without truncation)
    logits = logits / temperature
    if banned is not None:
        logits = logits.masked_fill(banned, -math.inf)
    if truncation is None:
        return logits, None
    kept = truncation_mask(logits, *truncation)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    left_out = ~kept[rows, tokens]
    # the sampled token was in the sampler's kept set, so it stays in this one: the set is
    # recomputed from these logits, whose boundary can leave it out (rounding at the top-p cut;
    # pi_theta after an update; pi_ref, a different model), and log 0 = -inf would turn the
    # ratio or the KL into inf / NaN (prime-rl PR 2601 keeps the label's logit)
    kept[rows, tokens] = True
    return logits.masked_fill(~kept, -math.inf), left_out


def _softmax_stats(
    logits,
    tokens,
    temperature,
    banned,
    entropy_grad,
    truncation=None,
    sum_squares=False,
    left_out=False,
):
    # (n, V) float32, one chunk at a time: one log-softmax of logits / T for the logprob and the
    # entropy (and, for the optimal token baseline, sum_v p_v^2; with left_out, 1.0 where the
    # replayed kept set leaves out the sampled token)
    logits, left_out_tokens = _scaled(logits, tokens, temperature, banned, truncation)
    logp = torch.log_softmax(logits, dim=-1)
    z = logp if entropy_grad else logp.detach()
    p = z.exp()
    logprobs = logp.gather(-1, tokens[:, None])[:, 0]
    if banned is not None or truncation is not None:
        z = z.masked_fill(logits == -math.inf, 0.0)  # p = 0 there; avoids 0 * -inf = NaN
    entropy = -(p * z).sum(-1)
    stats = (logprobs, entropy)
    if sum_squares:
        stats += ((p * p).sum(-1),)
    if left_out:
        stats += (left_out_tokens.float(),)
    return stats


def _softmax_grad(
    logits,
    tokens,
    temperature,
    banned,
    grad_logprobs,
    grad_entropy,
    entropy,
    entropy_grad,
    dtype,
    truncation=None,
):
    # d (g logprob + e H) / d logits = (g onehot(token) - p (g + e (log p + H))) / T, (n, V), in
    # `dtype`: the products' input dtype (bf16 for the bf16 head: rounded here, in the same kernel)
    logits, _ = _scaled(logits, tokens, temperature, banned, truncation)
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    coefficient = grad_logprobs[:, None]
    if entropy_grad:
        if banned is not None or truncation is not None:
            logp = logp.masked_fill(logits == -math.inf, 0.0)  # p = 0 there
        coefficient = coefficient + grad_entropy[:, None] * (logp + entropy[:, None])
    grad = (p * -coefficient).scatter_add(1, tokens[:, None], grad_logprobs[:, None])
    return (grad / temperature).to(dtype)


# On CUDA the two element-wise functions above run compiled (torch.compile: one fused kernel reads
# a chunk's (n, V) logits once or twice, where eager torch makes ~12 passes over them); a CPU runs
# them as written. False: eager everywhere.
COMPILE_ON_CUDA = True
_COMPILED = {}


def _fused(function, tensor, truncation=None):
    """`function`, compiled once per process when `tensor` is on CUDA (dynamic shapes: a chunk's
    row count varies), else as written; a truncation's sort runs eager (not measured compiled)."""
    if not (tensor.is_cuda and COMPILE_ON_CUDA) or truncation is not None:
        return function
    if function not in _COMPILED:
        _COMPILED[function] = torch.compile(function, dynamic=True)
    return _COMPILED[function]


def _logprob_entropy_chunk(
    weight,
    hidden,
    tokens,
    temperature,
    banned,
    entropy_grad,
    precision,
    truncation=None,
    sum_squares=False,
    left_out=False,
):
    """(logprobs (n,), entropy (n,)[, sum_v p_v^2 (n,)][, left out (n,)]) of one chunk: the LM
    head's product, then the float32 log-softmax (no gradient through the compiled path:
    _ChunkedHead writes it out)."""
    logits = _head_product(weight, hidden, precision)
    stats = (
        _softmax_stats if torch.is_grad_enabled() else _fused(_softmax_stats, logits, truncation)
    )
    return stats(
        logits, tokens, temperature, banned, entropy_grad, truncation, sum_squares, left_out
    )


def _chunked_stats(
    weight,
    hidden,
    tokens,
    temperature,
    banned,
    entropy_grad,
    precision,
    truncation,
    chunk,
    sum_squares=False,
    left_out=False,
):
    """(logprobs (N,), entropy (N,)[, sum_v p_v^2 (N,)][, left out (N,)]):
    _logprob_entropy_chunk over chunks of `chunk` rows."""
    outputs = 2 + int(sum_squares) + int(left_out)
    if tokens.shape[0] == 0:
        return (hidden.new_zeros(0),) * outputs
    parts = [
        _logprob_entropy_chunk(
            weight,
            hidden[start : start + chunk],
            tokens[start : start + chunk],
            temperature,
            banned,
            entropy_grad,
            precision,
            truncation,
            sum_squares,
            left_out,
        )
        for start in range(0, tokens.shape[0], chunk)
    ]
    return tuple(torch.cat([part[k] for part in parts]) for k in range(outputs))


class _ChunkedHead(torch.autograd.Function):
    """Logprobs and entropies of N tokens through the LM head, chunk by chunk, with the gradient
    written out, so backward recomputes each chunk's logits and keeps nothing (N, V) in between:

        z = h W^T / T,  p = softmax(z),  logprob = log p[token],  H = -sum_v p_v log p_v
        d logprob / d z = onehot(token) - p
        d H / d z       = -p * (log p + H)
        d h = (d z / T) W,  d W = (d z / T)^T h        (the products in head_mm's precision)

    What autograd's checkpoint of each chunk (which this replaces) did with the same four
    products: run the chunk's forward again, then autograd's backward of every element-wise step
    of it. The forward is _logprob_entropy_chunk itself, so the values are bit for bit those of the
    no-gradient path (pi_old's recompute): the PPO ratio is exactly 1 on-policy."""

    @staticmethod
    def forward(
        ctx, hidden, weight, tokens, temperature, banned, entropy_grad, precision, chunk, truncation
    ):
        with torch.no_grad():
            logprobs, entropy = _chunked_stats(
                _operand(weight, precision),
                hidden,
                tokens,
                temperature,
                banned,
                False,
                precision,
                truncation,
                chunk,
            )
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, tokens, entropy, banned)
        ctx.settings = (temperature, entropy_grad, precision, chunk, truncation)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, tokens, entropy, banned = ctx.saved_tensors
        temperature, entropy_grad, precision, chunk, truncation = ctx.settings
        grad_hidden = torch.empty_like(hidden)
        needs_weight_grad = weight is not None and ctx.needs_input_grad[1]
        grad_weight = torch.zeros_like(weight) if needs_weight_grad else None
        softmax_grad = _fused(_softmax_grad, hidden, truncation)
        operand = _operand(weight, precision)
        for start in range(0, tokens.shape[0], chunk):
            rows = slice(start, start + chunk)
            h = hidden[rows]
            grad_z = softmax_grad(
                _head_product(operand, h, precision),
                tokens[rows],
                temperature,
                banned,
                grad_logprobs[rows],
                grad_entropy[rows],
                entropy[rows],
                entropy_grad,
                operand.dtype if operand is not None else hidden.dtype,
                truncation,
            )
            if weight is None:
                grad_hidden[rows] = grad_z
                continue
            grad_hidden[rows] = head_mm(grad_z, operand, precision)
            if grad_weight is not None:
                head_mm(grad_z.T, h, precision, total=grad_weight)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None
