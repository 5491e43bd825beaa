"""Rollout correction: importance sampling (IS), rejection sampling (RS) and the veto, as small
functions, with the padding-safe reductions they need.

Why this file exists. A fast rollout engine (vLLM) and the trainer compute different token
probabilities for the same weights (other kernels, other precision, quantised rollouts), so the
tokens we train on were sampled from pi_rollout, not from the policy we differentiate. On-policy RL
has silently become off-policy RL (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"). The fixes below re-weight (IS), drop (RS, veto) or both.

Notation (verl, "Mathematical Formulations of Rollout Correction Methods", Nov 2025, section 2.4):
    pi_rollout  the behaviour policy that sampled the tokens (vLLM)
    pi_old      the proximal policy, the PPO anchor: the trainer's recompute before the update
                (decoupled mode), or pi_rollout itself (bypass mode)
    pi_theta    the policy being optimised
    rho_t     = pi_train(a_t) / pi_rollout(a_t), pi_train = pi_old (decoupled) or pi_theta (bypass)
    log_ratio = log rho_t = train_logprobs - rollout_logprobs, clamped to +-SAFETY_BOUND before any
                exp()

Every tensor is (B, T) over response tokens with a (B, T) 0/1 `mask` (bool or float) unless said
otherwise. Padding is sacred: values at padded positions (which may be NaN or inf) never reach a
result or a gradient.

Reading order: masked reductions -> divergences -> IS weights -> rejection masks -> veto ->
diagnostics -> RolloutCorrection presets -> apply_rollout_correction (IS weights, mask and metrics
in one call). The logprobs the ratios compare are logprobs.py's (the trainer's) and rollout.py's
(the engine's); the loss terms the weights multiply (PPO-clip, REINFORCE, the KL penalty, the
aggregation) are in objectives.py; each trainer composes its objective in one function
(grpo.grpo_loss, ppo_rlhf.ppo_loss).
"""

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

# exp(20) ~ 4.9e8, exp(-20) ~ 2.1e-9: log-ratios are clamped here before exponentiating (verl)
SAFETY_BOUND = 20.0


# --------------------------------------------------------------------------------------------------
# 1. Padding-safe masked reductions
# --------------------------------------------------------------------------------------------------


def masked_sum(x, mask, dim=None):
    """sum of x over positions where mask is set; NaN/inf at masked-out positions never leak
    (torch.where, not x*mask: NaN * 0 is NaN). An empty selection sums to 0."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    x = torch.where(mask.bool(), x, zero)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x, mask, dim=None):
    """mean of x over positions where mask is set; an all-padding row (or batch) gives 0, never
    NaN."""
    # no int64 copy of the mask
    count = mask.count_nonzero() if dim is None else mask.count_nonzero(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x, mask, unbiased=True):
    """variance of the masked entries. unbiased=False is tf.nn.moments (the OpenAI code); True is
    torch.var. Fewer than two entries give 0 (unbiased) instead of NaN."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.bool().sum()
        var = var * count / (count - 1) if count > 1 else torch.zeros_like(var)
    return var


def masked_whiten(x, mask, shift_mean=True, unbiased=False, eps=1e-8):
    """(x - mean) / sqrt(var + eps) over the masked entries; shift_mean=False adds the mean back
    (lm-human-preferences whitens rewards that way, RLHF blog detail 5.1). Padded positions come out
    as 0."""
    mean, var = masked_mean(x, mask), masked_var(x, mask, unbiased=unbiased)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=x.dtype, device=x.device))


# --------------------------------------------------------------------------------------------------
# 2. Divergences: per-token statistics for RS and the diagnostics
# --------------------------------------------------------------------------------------------------


def token_divergences(log_ratio):
    """Per-token k1, k2, k3 of log_ratio = log rho (clamped to +-SAFETY_BOUND), each estimating
    KL(pi_rollout || pi_train) from tokens sampled by pi_rollout (Schulman, "Approximating KL
    Divergence"):
        k1 = -log rho            unbiased, can be negative
        k2 = 0.5 * (log rho)^2   biased, >= 0, ~ 0.5 Var(log rho) for small drift (verl math doc
                                 3.3.4)
        k3 = rho - 1 - log rho   unbiased, >= 0 (verl math doc 3.3.5)
    Returns (k1, k2, k3)."""
    log_rho = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return -log_rho, 0.5 * log_rho.square(), torch.expm1(log_rho) - log_rho


# --------------------------------------------------------------------------------------------------
# 3. Importance-sampling weights
# --------------------------------------------------------------------------------------------------


def parse_is_threshold(threshold, field="rollout_is_threshold"):
    """An IS threshold is an upper bound C (float or "2.0"), or "lower_upper" (e.g. "0.5_5.0") for
    masked IS (IcePop): weights outside [lower, upper] become 0 instead of being truncated. C = inf
    ("inf") is vanilla, untruncated IS (verl accepts it; the TIS paper's ablation compares TIS with
    it). Returns (lower or None, upper)."""
    lower = None
    try:
        if isinstance(threshold, str) and "_" in threshold:
            lower_str, upper_str = threshold.split("_", 1)
            lower, upper = float(lower_str), float(upper_str)
        else:
            upper = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(
            f"{field} must be a positive number or 'lower_upper' (e.g. '0.5_5.0'), got "
            f"{threshold!r}"
        )
    if not upper > 0 or (lower is not None and not (0 < lower < math.inf)):  # also refuses NaN
        raise ValueError(
            f"{field} bounds must be positive (a finite lower bound, an upper bound up to inf), "
            f"got {threshold!r}"
        )
    if lower is not None and lower > upper:
        raise ValueError(f"{field}: lower bound {lower} is above the upper bound {upper}")
    return lower, upper


def _log_bound(x):
    """log of a bound; 0 (the lower bound 1/C of C = inf) gives -inf, as torch.log does in verl."""
    return math.log(x) if x > 0 else -math.inf


def _weight_stats(weights, raw_weights, seq_log_ratio, mask, level, lower, upper):
    """verl 0.9.1's compute_is_metrics: statistics of the truncated (or IcePop-masked) weights; the
    fractions above and below the bounds count the raw weights. Names `rollout_is_*`."""
    m, valid = mask.bool(), mask.bool().any()
    zero = weights.new_zeros(())
    metrics = {"rollout_is_mean": masked_mean(weights, mask)}
    # per-sequence log weights, so max/min are exact even beyond the safety clamp
    if level == "sequence":
        metrics["rollout_is_max"] = torch.exp(seq_log_ratio.max().clamp(max=SAFETY_BOUND))
        metrics["rollout_is_min"] = torch.exp(seq_log_ratio.min().clamp(max=SAFETY_BOUND))
        metrics["rollout_is_ratio_fraction_high"] = (
            (seq_log_ratio > _log_bound(upper)).float().mean()
        )
        metrics["rollout_is_ratio_fraction_low"] = (
            (seq_log_ratio < _log_bound(lower)).float().mean()
        )
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((raw_weights > upper).float(), mask)
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw_weights < lower).float(), mask)
        metrics["rollout_is_max"] = weights.masked_fill(~m, -math.inf).max() if valid else zero
        metrics["rollout_is_min"] = weights.masked_fill(~m, math.inf).min() if valid else zero
    clamped = weights.clamp(min=0.0, max=upper)
    clamped_mean = masked_mean(clamped, mask)
    var = masked_mean(clamped.square(), mask) - clamped_mean.square()
    metrics["rollout_is_std"] = var.clamp(min=0).sqrt() if m.sum() > 1 else zero
    # ESS = 1 / E[(w / E[w])^2], in (0, 1]: the fraction of samples that effectively carry the
    # gradient
    second_moment = masked_mean((clamped / (clamped_mean + 1e-8)).square(), mask)
    # all zero: none
    metrics["rollout_is_eff_sample_size"] = 1.0 / second_moment if second_moment > 0 else zero
    # (B,) mean weight per sequence (0 for an empty row, as verl)
    seq_mean = masked_mean(weights, mask, dim=-1)
    raw_seq_mean = masked_mean(raw_weights, mask, dim=-1)
    metrics["rollout_is_seq_mean"] = seq_mean.mean()
    metrics["rollout_is_seq_std"] = seq_mean.std() if seq_mean.numel() > 1 else zero
    metrics["rollout_is_seq_max"] = seq_mean.max()
    metrics["rollout_is_seq_min"] = seq_mean.min()
    metrics["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max()
    metrics["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).float().mean()
    metrics["rollout_is_seq_fraction_low"] = (raw_seq_mean < lower).float().mean()
    return metrics


def _global_mean(values, mask):
    """masked mean over every rank's values (the batch-normalisation factor must be the same on all
    ranks)."""
    total = torch.stack([masked_sum(values, mask), mask.bool().sum().to(values.dtype)])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total[0] / total[1].clamp(min=1)


def compute_is_weights(log_ratio, mask, level="token", threshold=2.0, batch_normalize=False):
    """Truncated importance-sampling weights, detached (stop-gradient) and 0 on padding.

        token level     w_t = min(rho_t, C)                        (token-TIS; verl math doc 3.3.1)
        sequence level  w_t = min(prod_{s in T} rho_s, C) for all t  (seq-TIS; 3.3.2), via
                                                                     exp(sum log rho)
        "lower_upper"   w = rho if lower <= rho <= upper else 0    (masked IS / IcePop: no
                                                                     truncation bias inside the
                                                                     band, no gradient outside it)
        batch_normalize w <- w / mean(w): over valid tokens (token level) or over sequences
                        (sequence level; verl math doc 3.4), all ranks together under
                        torch.distributed.

    When to use: token-TIS when the rollout policy stays close to the trainer (lower variance,
    O(T^2) bias); seq-TIS when the mismatch is larger (unbiased before truncation, higher variance);
    typical C: 1.5-5 (token), 2-10 (sequence). The weight is a constant: IS changes the measure, not
    the objective (verl math doc 3.2.2), so the gradient is w * grad log pi and never log pi * grad
    w. Returns (weights (B, T), metrics): verl 0.9.1's names without the rollout_corr/ prefix, of
    the truncated weights (the fractions out of bounds: raw ratios).
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_is must be 'token' or 'sequence', got {level!r}")
    lower, upper = parse_is_threshold(threshold)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    valid = mask.bool()
    if level == "token":
        log_for_max = None
        raw_weights = (
            torch.where(valid, log_ratio.detach(), zero).clamp_(-SAFETY_BOUND, SAFETY_BOUND).exp_()
        )
    else:
        # (B, 1) log prod rho
        log_for_max = masked_sum(log_ratio.detach(), valid, dim=-1).unsqueeze(-1)
        raw_weights = torch.exp(log_for_max.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    # padding (maybe NaN in the input) -> weight 0
    raw_weights = torch.where(valid, raw_weights, zero)
    if lower is None:
        weights = raw_weights.clamp(max=upper)  # TIS: truncate
    else:
        in_band = (raw_weights >= lower) & (raw_weights <= upper)
        weights = torch.where(in_band, raw_weights, zero)  # IcePop: mask
    metrics = _weight_stats(
        weights, raw_weights, log_for_max, mask, level, lower or 1.0 / upper, upper
    )
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean((~in_band).float(), mask)
    if batch_normalize:
        if level == "token":
            norm = _global_mean(weights, mask)
        else:
            seq_weights = masked_mean(weights, mask, dim=-1)  # one weight per sequence
            norm = _global_mean(seq_weights, mask.bool().any(-1))
        if norm > 1e-8:
            weights = weights / norm
        metrics["rollout_is_batch_norm_factor"] = norm if norm > 1e-8 else torch.ones_like(norm)
    return weights.detach(), metrics


# --------------------------------------------------------------------------------------------------
# 4. Rejection masks
# --------------------------------------------------------------------------------------------------

RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
# The older verl modes (the 2025-11-04 version of verl's rollout-correction math doc, section 3.4)
# are the same ratio bounds under other names.
RS_LEGACY_ALIASES = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}


def parse_rs_options(option, field="rollout_rs"):
    """ "token_k1,seq_mean_k3" -> ["token_k1", "seq_mean_k3"] (duplicates dropped, legacy names
    mapped)."""
    if not isinstance(option, str) or not option.strip():
        raise ValueError(
            f"{field} must be a non-empty string of options from {RS_OPTIONS} (comma-separated)"
        )
    options = []
    for name in (part.strip() for part in option.split(",")):
        name = RS_LEGACY_ALIASES.get(name, name)
        if name not in RS_OPTIONS:
            allowed = RS_OPTIONS + tuple(RS_LEGACY_ALIASES)
            raise ValueError(f"{field}: unknown option {name!r}; allowed: {', '.join(allowed)}")
        if name not in options:
            options.append(name)
    return options


def parse_rs_thresholds(options, threshold, field="rollout_rs_threshold"):
    """One threshold shared by all options, or one per option ("0.5_2.0,0.01"). For k1 options a
    bound is "lower_upper" on the ratio, or a single upper with lower = 1/upper; k2/k3 take a single
    upper bound. Returns {option: (lower or None, upper)}."""
    if threshold is None:
        raise ValueError(f"{field} is required when rollout_rs is set")
    specs = (
        [s.strip() for s in str(threshold).split(",") if s.strip()]
        if isinstance(threshold, str)
        else [threshold]
    )
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(
            f"{field} needs 1 or {len(options)} comma-separated values for {options}, got "
            f"{threshold!r}"
        )
    bounds = {}
    for name, spec in zip(options, specs):
        where = f"{field} for {name}"
        if name.endswith("k1"):
            lower, upper = parse_is_threshold(spec, field=where)
            bounds[name] = (1.0 / upper if lower is None else lower, upper)
        else:
            if isinstance(spec, str) and "_" in spec:
                raise ValueError(
                    f"{where} takes a single upper bound (k2/k3 are >= 0), got {spec!r}"
                )
            _, upper = parse_is_threshold(spec, field=where)
            bounds[name] = (None, upper)
    return bounds


def rejection_mask(log_ratio, mask, option, threshold):
    """Rejection sampling: a new mask that keeps a token only if every listed option accepts it. It
    only ever turns 1s into 0s. Options (verl math doc 3.3-3.5), with k1/k2/k3 from
    `token_divergences` (k1 = -log rho):

        token_k1       keep token t if   lower <= rho_t <= upper
        seq_sum_k1     keep sequence if  lower <= prod_t rho_t <= upper            (seq-MIS)
        seq_mean_k1    keep sequence if  lower <= exp(mean_t log rho_t) <= upper   (Geo-RS)
        token_k2/k3    keep token t if   k_t <= upper
        seq_sum_k2/k3  keep sequence if  sum_t k_t <= upper
        seq_mean_k2/k3 keep sequence if  mean_t k_t <= upper                       (K3-RS)
        seq_max_k2/k3  keep sequence if  max_t k_t <= upper     (isolates single-token spikes)

    `threshold`: see parse_rs_thresholds ("0.5_2.0", 2.0, or "0.999_1.001,0.01" for two options). On
    k1 the acceptance set is the math document's, lower <= rho <= upper; verl's code compares -log
    rho with [log lower, log upper], i.e. accepts rho in [1/upper, 1/lower]: the same for symmetric
    bounds (the default), not for "0.5_3.0".

    Metrics: verl 0.9.1's compute_rs_metrics (names and values, for symmetric bounds) per option
    `rollout_rs_<option>_`: mean, max, min, fraction_high, fraction_low (k1 only), std (of the
    statistic clamped to its bounds), seq_mean/std/max/min/max_deviation/fraction_high/fraction_low,
    masked_fraction, seq_masked_fraction (token-weighted unless seq_*; "high" is about the
    statistic: for k1 = -log rho, rho below its lower bound); and rollout_rs_masked_fraction,
    rollout_rs_seq_masked_fraction over all options.

    When to use: seq_mean_k1 (Geo-RS) or seq_mean_k3 for long sequences (length-invariant: no
    "length trap"); seq_sum_k1 to drop whole sequences whose product ratio explodes (toxic tails);
    seq_max_k* against single catastrophic tokens. Returns (new_mask with mask's dtype, metrics).
    """
    options = parse_rs_options(option)
    bounds = parse_rs_thresholds(options, threshold)
    valid = mask.bool()
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    log_ratio = torch.where(valid, log_ratio.detach(), zero).clamp_(-SAFETY_BOUND, SAFETY_BOUND)
    seq_valid = valid.any(-1)
    keep = valid.clone()
    metrics = {}
    for name in options:
        lower, upper = bounds[name]
        if name.endswith("k1"):
            stat = -log_ratio  # token_divergences' k1 = -log rho
        elif name.endswith("k2"):
            # token_divergences' k2, computed only when an option needs it
            stat = 0.5 * log_ratio.square()
        else:
            stat = torch.expm1(log_ratio).sub_(log_ratio)  # k3
        if name.startswith("token"):
            seq_values = masked_mean(stat, valid, dim=-1)  # (B,) only for the seq_* metrics
        elif name.startswith("seq_sum"):
            seq_values = masked_sum(stat, valid, dim=-1)
        elif name.startswith("seq_mean"):
            seq_values = masked_mean(stat, valid, dim=-1)
        else:  # seq_max
            seq_values = stat.masked_fill(~valid, -math.inf).amax(-1).masked_fill(~seq_valid, 0.0)
        token_stat = stat if name.startswith("token") else seq_values.unsqueeze(-1).expand_as(stat)
        # rho in [lower, upper]  <=>  k1 = -log rho in [-log upper, -log lower]
        if name.endswith("k1"):
            lo, hi = -_log_bound(upper), -_log_bound(lower)
            option_keep = (token_stat >= lo) & (token_stat <= hi)
        else:
            lo, hi = 0.0, upper  # k2, k3 >= 0: the lower bound only clamps the std below
            option_keep = token_stat <= hi
        rejected = valid & ~option_keep
        keep &= option_keep
        metrics.update(
            _rs_option_metrics(
                f"rollout_rs_{name}",
                stat,
                seq_values,
                valid,
                seq_valid,
                lo,
                hi,
                name.startswith("token"),
                name.endswith("k1"),
            )
        )
        metrics[f"rollout_rs_{name}_masked_fraction"] = masked_mean(rejected.float(), valid)
        metrics[f"rollout_rs_{name}_seq_masked_fraction"] = masked_mean(
            rejected.any(-1).float(), seq_valid
        )
    rejected = valid & ~keep
    metrics["rollout_rs_masked_fraction"] = masked_mean(rejected.float(), valid)
    metrics["rollout_rs_seq_masked_fraction"] = rejected.any(-1).float().mean()
    return (mask.bool() & keep).to(mask.dtype), metrics


def _rs_option_metrics(prefix, stat, seq_values, valid, seq_valid, lo, hi, token_level, has_lower):
    """verl 0.9.1's compute_rs_metrics for one option (see rejection_mask). stat (B, T): the
    per-token statistic of a token option; seq_values (B,): one value per sequence (a sequence
    option tests every token with its sequence's value, so its token-weighted statistics are
    count-weighted sums over sequences: no extra (B, T) tensor). An all-padding batch gives zeros
    (verl raises)."""
    zero = seq_values.new_zeros(())
    seqs = seq_values[seq_valid]  # valid sequences only
    counts = valid.sum(-1).to(seq_values.dtype)  # (B,) tokens per sequence
    n_tokens = counts.sum()
    # the std clamps the statistic to its bounds (k2/k3: to [0, upper])
    floor = lo if has_lower else 0.0
    if token_level:
        clamped = stat.clamp(min=floor, max=hi)
        token_mean, clamped_mean = masked_mean(stat, valid), masked_mean(clamped, valid)
        clamped_sq_mean = masked_mean(clamped.square(), valid)
    else:
        clamped = seq_values.clamp(min=floor, max=hi)
        token_mean, clamped_mean, clamped_sq_mean = (
            (v * counts).sum() / n_tokens.clamp(min=1)
            for v in (seq_values, clamped, clamped.square())
        )
    m = {f"{prefix}_mean": token_mean}
    if not token_level and seqs.numel():  # a sequence option: extremes and fractions over sequences
        m[f"{prefix}_max"], m[f"{prefix}_min"] = seqs.max(), seqs.min()
        m[f"{prefix}_fraction_high"] = (seqs > hi).float().mean()
        m[f"{prefix}_fraction_low"] = (seqs < lo).float().mean() if has_lower else zero
    elif token_level and n_tokens:
        m[f"{prefix}_max"] = stat.masked_fill(~valid, -math.inf).max()
        m[f"{prefix}_min"] = stat.masked_fill(~valid, math.inf).min()
        m[f"{prefix}_fraction_high"] = masked_mean((stat > hi).float(), valid)
        m[f"{prefix}_fraction_low"] = masked_mean((stat < lo).float(), valid) if has_lower else zero
    else:
        for k in ("max", "min", "fraction_high", "fraction_low"):
            m[f"{prefix}_{k}"] = zero
    # std of the clamped statistic over tokens (verl: one outlier cannot dominate it); 0 for fewer
    # than 2 tokens
    m[f"{prefix}_std"] = (
        (clamped_sq_mean - clamped_mean.square()).clamp(min=0).sqrt() if n_tokens > 1 else zero
    )
    if seqs.numel():
        m[f"{prefix}_seq_mean"] = seqs.mean()
        m[f"{prefix}_seq_std"] = seqs.std() if seqs.numel() > 1 else zero
        m[f"{prefix}_seq_max"], m[f"{prefix}_seq_min"] = seqs.max(), seqs.min()
        m[f"{prefix}_seq_max_deviation"] = seqs.abs().max()  # deviation from the ideal value 0
        m[f"{prefix}_seq_fraction_high"] = (seqs > hi).float().mean()
        if has_lower:  # verl adds this key for k1 options only
            m[f"{prefix}_seq_fraction_low"] = (seqs < lo).float().mean()
    else:
        for k in (
            "seq_mean",
            "seq_std",
            "seq_max",
            "seq_min",
            "seq_max_deviation",
            "seq_fraction_high",
            "seq_fraction_low",
        ):
            m[f"{prefix}_{k}"] = zero
    return m


# --------------------------------------------------------------------------------------------------
# 5. The catastrophic-token veto
# --------------------------------------------------------------------------------------------------


def veto_mask(log_ratio, mask, threshold=1e-4):
    """Reject a whole sequence if any valid token has rho_t < C_veto (verl's rollout-correction math
    doc, the 2025-11-04 version, section 3.5):   keep sequence  iff  min_{t in T} rho_t >= C_veto

    A token the rollout engine found likely but the trainer finds nearly impossible (rho ~ 0)
    signals a broken sample (e.g. a kernel bug); IS can't repair it, since the weight ~0 silences
    one token while the rest of the sequence still trains. Independent of IS and RS. Returns
    (new_mask, metrics)."""
    if not threshold > 0:
        raise ValueError(f"rollout_token_veto_threshold must be positive, got {threshold!r}")
    valid = mask.bool()
    # NaN compares False: padding can't veto
    catastrophic = valid & (log_ratio.detach() < math.log(threshold))
    vetoed = catastrophic.any(-1, keepdim=True)
    metrics = {
        "rollout_is_veto_fraction": vetoed.float().mean(),
        "rollout_is_catastrophic_token_fraction": masked_mean(catastrophic.float(), valid),
    }
    return (valid & ~vetoed).to(mask.dtype), metrics


def off_policy_sequence_mask(logprobs, sampling_logprobs, advantages, mask, threshold):
    """DeepSeek-V3.2's off-policy sequence masking (DeepSeek-AI 2025, arXiv:2512.02556, "keeping
    RL stable", Equation 9; TRL GRPOTrainer.get_off_policy_mask, --off-policy-mask-threshold):

        d_i    = mean over the valid tokens t of (log pi_sampling(a_t) - log pi_theta(a_t))
        keep_i = A_i >= 0  or  d_i <= threshold

    A sequence with a negative advantage whose current policy has drifted from the one that sampled
    it (d_i, the sequence's mean k1 estimate of KL(pi_sampling || pi_theta), above the threshold)
    is dropped: pushing down a sample the policy no longer resembles mostly adds noise. Sequences
    with a non-negative advantage are always kept. pi_sampling is pi_rollout (what vLLM sampled
    with), so the rule sees both the drift of the updates and the rollout/trainer mismatch.
    logprobs: pi_theta's, no gradient is taken through the mask; advantages (B, T) or (B, 1).

    Returns (keep (B, 1) float, metrics): the fraction of sequences masked and the mean d_i, as
    floats. The caller multiplies the per-token policy loss by keep (the normaliser still counts
    the masked tokens, as TRL)."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    divergence = torch.where(valid, sampling_logprobs - logprobs.detach(), zero)
    mean_divergence = masked_mean(divergence, valid, dim=-1)[:, None]
    advantage = advantages if advantages.dim() == 1 else advantages[:, :1]
    keep = (advantage.reshape(-1, 1) >= 0) | (mean_divergence <= threshold)
    sequences = valid.any(-1, keepdim=True)
    metrics = {
        "off_policy_mask/masked_seq_fraction": masked_mean((~keep).float(), sequences),
        "off_policy_mask/seq_kl_mean": masked_mean(mean_divergence, sequences),
    }
    return keep.to(logprobs.dtype), {k: float(v) for k, v in metrics.items()}


# --------------------------------------------------------------------------------------------------
# 6. Diagnostics: how far apart are the two policies?
# --------------------------------------------------------------------------------------------------


def offpolicy_metrics(train_logprobs, rollout_logprobs, mask):
    """Off-policy diagnostics (verl math doc section 4; names as verl logs them) and the TIS paper's
    mismatch:

        rollout_corr/kl             E[log pi_rollout - log pi_train]  (k1 of KL(rollout || train))
        rollout_corr/k3_kl          E[rho - log rho - 1]
        rollout_corr/training_ppl   mean over sequences of exp(-mean_t log pi_train); *_log_ppl
                                    without the exp
        rollout_corr/rollout_ppl    the same for pi_rollout
        rollout_corr/log_ppl_diff   mean over sequences of (mean_t log pi_rollout - mean_t log
                                    pi_train); also _abs_diff (log_ppl_abs_diff), _max, _min
        rollout_corr/ppl_ratio      mean over sequences of training_ppl / rollout_ppl
        rollout_corr/chi2_token     E_t[rho_t^2] - 1
        rollout_corr/chi2_seq       E_seq[(prod_t rho_t)^2] - 1
        training/rollout_probs_diff_max    max over valid tokens of |p_rollout - p_train| (Yao et
                                           al. 2025's mismatch)
        training/rollout_probs_diff_mean   its mean over valid tokens; also _std (unbiased,
                                           torch.std as in verl's utils/debug/metrics.py)
        training/rollout_actor_probs_pearson_corr   Pearson correlation of p_train and p_rollout
                                           over valid tokens (verl; arXiv:2506.13585); NaN when
                                           undefined, as torch.corrcoef gives
        training/rollout_probs_diff_valid  1 if the batch has a valid token, else 0 (verl)
    Returns a dict of Python floats. An empty batch gives zeros where verl gives NaN.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=train_logprobs.dtype, device=train_logprobs.device)
    train, rollout = train_logprobs.detach(), rollout_logprobs.detach()
    seq_valid = valid.any(-1)
    seq_train = masked_mean(train, valid, dim=-1)  # (B,) mean log prob per sequence
    seq_rollout = masked_mean(rollout, valid, dim=-1)
    log_ppl_diff = seq_rollout - seq_train
    # (B, T); at most two more (B, T) temporaries below
    log_ratio = torch.where(valid, train - rollout, zero)
    kl = -masked_mean(log_ratio, valid)
    seq_log_ratio = log_ratio.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    safe = log_ratio.clamp_(-SAFETY_BOUND, SAFETY_BOUND)
    k3_kl = masked_mean(torch.expm1(safe).sub_(safe), valid)
    chi2_token = masked_mean(torch.exp(2 * safe), valid) - 1.0
    del log_ratio, safe
    # probabilities <= 1
    probs_diff = torch.exp(rollout.clamp(max=0)).sub_(torch.exp(train.clamp(max=0))).abs_()
    probs_diff.masked_fill_(~valid, 0.0)
    metrics = {
        "rollout_corr/training_ppl": masked_mean(torch.exp(-seq_train), seq_valid),
        "rollout_corr/training_log_ppl": masked_mean(-seq_train, seq_valid),
        "rollout_corr/kl": kl,
        "rollout_corr/k3_kl": k3_kl,
        "rollout_corr/rollout_ppl": masked_mean(torch.exp(-seq_rollout), seq_valid),
        "rollout_corr/rollout_log_ppl": masked_mean(-seq_rollout, seq_valid),
        "rollout_corr/log_ppl_diff": masked_mean(log_ppl_diff, seq_valid),
        "rollout_corr/log_ppl_abs_diff": masked_mean(log_ppl_diff.abs(), seq_valid),
        "rollout_corr/log_ppl_diff_max": log_ppl_diff.masked_fill(~seq_valid, -math.inf).max(),
        "rollout_corr/log_ppl_diff_min": log_ppl_diff.masked_fill(~seq_valid, math.inf).min(),
        "rollout_corr/ppl_ratio": masked_mean(torch.exp(log_ppl_diff), seq_valid),
        "rollout_corr/chi2_token": chi2_token,
        "rollout_corr/chi2_seq": masked_mean(torch.exp(2 * seq_log_ratio), seq_valid) - 1.0,
        "training/rollout_probs_diff_max": probs_diff.max(),
        "training/rollout_probs_diff_mean": masked_mean(probs_diff, valid),
        # torch.std (verl)
        "training/rollout_probs_diff_std": masked_var(probs_diff, valid, unbiased=True).sqrt(),
        "training/rollout_actor_probs_pearson_corr": _masked_pearson(train, rollout, valid),
        "training/rollout_probs_diff_valid": seq_valid.any().float(),
    }
    out = {k: float(v) for k, v in metrics.items()}
    if not seq_valid.any():  # an empty batch: report zeros rather than +-inf
        out = {k: (0.0 if not math.isfinite(v) else v) for k, v in out.items()}
    return out


def _masked_pearson(train_logprobs, rollout_logprobs, valid):
    """Pearson correlation of the token probabilities exp(logprob) over the valid tokens
    (torch.corrcoef, as verl)."""
    train_p = torch.exp(train_logprobs.clamp(max=0))[valid]
    rollout_p = torch.exp(rollout_logprobs.clamp(max=0))[valid]
    if train_p.numel() < 2:
        return torch.tensor(math.nan)
    return torch.corrcoef(torch.stack([train_p, rollout_p]))[0, 1]


# --------------------------------------------------------------------------------------------------
# 7. Presets: RolloutCorrection (verl's RolloutCorrectionConfig)
# --------------------------------------------------------------------------------------------------

LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclass
class RolloutCorrection:
    """Which correction to apply (verl's RolloutCorrectionConfig); PRESET_SETTINGS below names
    verl's presets.

    Decoupled mode (bypass_mode=False, three policies): pi_old is the trainer's recompute, IS
    weights are pi_old / pi_rollout, PPO clips pi_theta / pi_old. Bypass mode (two policies): pi_old
    = pi_rollout, no recompute; loss_type "ppo_clip" clips pi_theta / pi_rollout (only the RS mask
    applies; IS weights would double count) and "reinforce" uses stopgrad(w) * log pi with w from
    pi_theta / pi_rollout.
    """

    rollout_is: Optional[str] = None
    """IS level: None (off), "token" or "sequence"."""
    rollout_is_threshold: Union[float, str] = 2.0
    """Upper truncation C, or "lower_upper" for masked IS (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Normalise the IS weights to mean 1 over the batch (tokens or sequences, by level)."""
    rollout_rs: Optional[str] = None
    """Rejection options, comma-separated (token_k1, seq_mean_k3, ...; legacy
    token/sequence/geometric)."""
    rollout_rs_threshold: Optional[Union[float, str]] = None
    """RS bounds: "lower_upper" or an upper for k1 options; an upper for k2/k3; comma-separated per
    option."""
    rollout_token_veto_threshold: Optional[float] = None
    """Veto a sequence containing any token with rho_t below this (e.g. 1e-4); None disables the
    veto."""
    bypass_mode: bool = False
    """True: pi_old = pi_rollout (skip the trainer's recompute of pi_old)."""
    loss_type: str = "ppo_clip"
    """Bypass-mode loss: "ppo_clip" or "reinforce"."""

    def __post_init__(self):
        """Raise ValueError naming the field and the allowed values for any invalid setting."""
        if self.rollout_is is not None and self.rollout_is not in ("token", "sequence"):
            raise ValueError(
                f"rollout_is must be None, 'token' or 'sequence', got {self.rollout_is!r}"
            )
        if self.rollout_is is not None:
            parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold)
        if (
            self.rollout_token_veto_threshold is not None
            and not self.rollout_token_veto_threshold > 0
        ):
            raise ValueError(
                f"rollout_token_veto_threshold must be positive or None, got "
                f"{self.rollout_token_veto_threshold!r}"
            )
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.loss_type == "reinforce" and not self.bypass_mode:
            raise ValueError(
                "loss_type='reinforce' requires bypass_mode=True (REINFORCE weights "
                "pi_theta/pi_rollout computed in the loss; decoupled mode uses "
                "loss_type='ppo_clip')"
            )

    @classmethod
    def from_name(cls, name, **overrides):
        """A preset by name, e.g. RolloutCorrection.from_name("decoupled_seq_is_rs"); keyword
        arguments override its settings (from_name("decoupled_token_is",
        rollout_is_threshold=5.0))."""
        name = PRESET_ALIASES.get(name, name)
        if name not in PRESET_SETTINGS:
            raise ValueError(
                f"unknown correction preset {name!r}; allowed: {', '.join(ALL_PRESET_NAMES)}"
            )
        return cls(**{**PRESET_SETTINGS[name], **overrides})


# verl 0.9.1's presets (verl/trainer/config/algorithm.py, RolloutCorrectionConfig's classmethods;
# math doc 3.6, 5.1), then the older document's (the 2025-11-04 version of verl's rollout-correction
# math doc, section 3.7), then ours.
TOKEN_IS = dict(rollout_is="token", rollout_is_threshold=2.0)  # token-TIS, C = 2
SEQ_IS = dict(rollout_is="sequence", rollout_is_threshold=2.0)  # seq-TIS, C = 2
# Geo-RS: geometric-mean ratio in the band
GEO = dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001")
K3 = dict(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01)  # K3-RS: mean_t k3 <= 0.01
BYPASS, BYPASS_PG = (
    dict(bypass_mode=True, loss_type="ppo_clip"),
    dict(bypass_mode=True, loss_type="reinforce"),
)
# token weights outside [0.5, 5] zeroed (IcePop)
ICEPOP = dict(rollout_is="token", rollout_is_threshold="0.5_5.0")
PRESET_SETTINGS = {
    # Decoupled PPO (three policies)
    "decoupled_token_is": TOKEN_IS,
    "decoupled_seq_is": SEQ_IS,
    # seq-MIS
    "decoupled_seq_is_rs": dict(**SEQ_IS, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
    "decoupled_geo_rs": GEO,
    "decoupled_geo_rs_seq_tis": dict(**SEQ_IS, **GEO),
    "decoupled_geo_rs_token_tis": dict(**TOKEN_IS, **GEO),
    "decoupled_k3_rs": K3,
    "decoupled_k3_rs_seq_tis": dict(**SEQ_IS, **K3),
    "decoupled_k3_rs_token_tis": dict(**TOKEN_IS, **K3),
    "decoupled_token_icepop": ICEPOP,
    # Bypass mode, PPO-clip loss (the ratio against pi_rollout is the IS ratio; RS masks outliers)
    "bypass_ppo_clip": BYPASS,
    "bypass_ppo_clip_geo_rs": dict(**GEO, **BYPASS),
    "bypass_ppo_clip_k3_rs": dict(**K3, **BYPASS),
    # Bypass mode, REINFORCE loss (explicit stop-gradient weights, no clipping)
    "bypass_pg_is": dict(**SEQ_IS, **BYPASS_PG),
    "bypass_pg_geo_rs": dict(**GEO, **BYPASS_PG),
    "bypass_pg_geo_rs_seq_tis": dict(**SEQ_IS, **GEO, **BYPASS_PG),
    "bypass_pg_geo_rs_token_tis": dict(**TOKEN_IS, **GEO, **BYPASS_PG),
    "bypass_pg_token_icepop": dict(**ICEPOP, **BYPASS_PG),
    # no correction: metrics only (plain decoupled PPO against the trainer's pi_old)
    "disabled": {},
    # The older document's names, with its definitions. ppo_is_bypass: bypass PPO-clip with token IS
    # configured; the loss is bypass_ppo_clip's (the older verl computed the weights from pi_old =
    # pi_rollout, so they were 1), only the rollout_is_* metrics (of pi_theta / pi_rollout) differ.
    # pg_rs: "geometric RS + veto" with REINFORCE, bounds 1/1.001..1.001 and veto 1e-4 (the newer
    # bypass_pg_geo_rs has 0.999_1.001 and no veto).
    "ppo_is_bypass": dict(**TOKEN_IS, **BYPASS),
    "pg_is": dict(**SEQ_IS, **BYPASS_PG),  # = bypass_pg_is in both documents
    "pg_rs": dict(
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold=1.001,
        rollout_token_veto_threshold=1e-4,
        **BYPASS_PG,
    ),
    # Ours, named so that a run can select them with --correction. decoupled_geo_rs_veto: the older
    # document's decoupled_geo_rs (the name decoupled_geo_rs keeps verl 0.9.1's definition);
    # decoupled_token_vanilla_is: untruncated token IS in the PPO form (C = inf), the ablation
    # baseline of Yao et al. 2025.
    "decoupled_geo_rs_veto": dict(
        rollout_rs="seq_mean_k1", rollout_rs_threshold=1.001, rollout_token_veto_threshold=1e-4
    ),
    "decoupled_token_vanilla_is": dict(rollout_is="token", rollout_is_threshold=math.inf),
}
PRESETS = tuple(PRESET_SETTINGS)[: list(PRESET_SETTINGS).index("disabled") + 1]  # verl 0.9.1's own
PRESET_ALIASES = {  # names the documents use for an existing preset
    # verl docs/algo/rollout_corr_math.md 3.6: "Pure RS (bypass_pg_rs)"
    "bypass_pg_rs": "bypass_pg_geo_rs",
    "geo_rs_seq_tis": "decoupled_geo_rs_seq_tis",
}
ALL_PRESET_NAMES = tuple(PRESET_SETTINGS) + tuple(PRESET_ALIASES)


# --------------------------------------------------------------------------------------------------
# 8. The whole pipeline: what the trainers call
# --------------------------------------------------------------------------------------------------


def apply_rollout_correction(old_logprobs, rollout_logprobs, mask, config):
    """IS weights + rejection mask + veto + diagnostics in one call (verl
    compute_rollout_correction_and_rejection_mask):

        log_ratio = old_logprobs - rollout_logprobs
        weights   = compute_is_weights(log_ratio, ...)     if config.rollout_is else None
        mask      = rejection_mask(log_ratio, mask, ...)   if config.rollout_rs
        mask      = veto_mask(log_ratio, mask, ...)        if config.rollout_token_veto_threshold
    IS weights and RS are computed on the original mask (independent filters), then combined.
    Decoupled mode: once per batch with the trainer's recompute of pi_old (grpo.py step 3,
    ppo_rlhf.py step 7); bypass: per micro-batch with the current logprobs (grpo_loss, ppo_loss).
    Returns (weights or None, new_mask, metrics with the rollout_corr/ prefix as floats).
    """
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: old {tuple(old_logprobs.shape)}, rollout "
            f"{tuple(rollout_logprobs.shape)}, mask {tuple(mask.shape)}"
        )
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    metrics, weights, new_mask = {}, None, mask
    if config.rollout_is is not None:
        weights, is_metrics = compute_is_weights(
            log_ratio,
            mask,
            config.rollout_is,
            config.rollout_is_threshold,
            config.rollout_is_batch_normalize,
        )
        metrics.update(is_metrics)
    if config.rollout_rs is not None:
        new_mask, rs_metrics = rejection_mask(
            log_ratio, mask, config.rollout_rs, config.rollout_rs_threshold
        )
        metrics.update(rs_metrics)
    if config.rollout_token_veto_threshold is not None:
        veto, veto_metrics = veto_mask(log_ratio, mask, config.rollout_token_veto_threshold)
        new_mask = (new_mask.bool() & veto.bool()).to(mask.dtype)
        metrics.update(veto_metrics)
    out = {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}
    out.update(offpolicy_metrics(old_logprobs, rollout_logprobs, mask))
    return weights, new_mask, out
