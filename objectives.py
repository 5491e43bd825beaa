"""The GRPO family's objectives: every advantage estimator and every policy loss grpo.py can use,
and the loss terms both trainers share (PPO-clip, REINFORCE, the KL penalty, the aggregation), one
small function each, with its formula, its paper and the verl 0.9.1 function it follows
(verl/trainer/ppo/core_algos.py).

An objective has two halves:

    advantage estimator   outcome scores of a step's responses -> one advantage A_i per response
                          (--adv-estimator NAME; grpo_advantages by default)
    policy loss           logprobs, pi_old's logprobs, A, mask -> a loss per token
                          (--policy-loss NAME; ppo_clip_token_loss, "vanilla", by default)

grpo.py calls the defaults by name (compute_advantages in step 4, grpo_loss in step 5) and looks
the others up in ADV_ESTIMATORS and POLICY_LOSSES on the same lines, so the loop's story stays the
same whichever is chosen; ppo_rlhf.py's ppo_loss calls ppo_clip_token_loss and agg_loss too. The
rules that tie a flag to an objective (the aggregation a loss requires, the group size an estimator
needs, the corrections a loss refuses) are data here (section 5), so an objective is added in this
file alone. The rollout correction whose IS weights and masks multiply every loss here is
corrections.py; ppo_rlhf.py's GAE is in ppo_rlhf.py.

Every estimator assumes what grpo.py trains with: one outcome reward per response, on its last
token, and gamma = 1 (verl's default), so a response's return is its score at every token and one
number per response says everything. Shapes: scores (B,) float, group_ids (B,) ints (which prompt
a response answers; responses of a group need not be adjacent), lengths (B,) response lengths in
tokens, baselines (B,) or None. Each returns advantages (B,) float32; grpo.py broadcasts them over
the response's tokens, as verl's (B, T) advantages are. The one exception is the optimal token
baseline, a baseline per token from pi_old's probabilities: it returns (B, T).
"""

import functools

import torch
import torch.distributed as dist

import harness

from corrections import SAFETY_BOUND, apply_rollout_correction, masked_mean, masked_sum

# --------------------------------------------------------------------------------------------------
# 1. Advantage estimators (verl algorithm.adv_estimator)
# --------------------------------------------------------------------------------------------------


def _group_stats(scores, group_ids):
    """(group (B,) 0..G-1, count (G,), mean (G,), unbiased std (G,)) of each prompt's group,
    vectorised with index_add (group ids may be any ints, in any order): the sums of verl's
    vectorised GRPO (utils/groupwise.py group_mean_std), so a mixed group's mean rounds as there.

    A group whose scores are all equal gets that score itself as its mean (and so std 0), not the
    rounded mean of a float32 sum: 16 scores of 0.7 summed and divided by 16 differ from 0.7 in
    the last bits, and dividing that difference by (std + eps) would give every response of a
    group that carries no signal an advantage of +-0.1 (+-0.6 for 64 scores of 2.2). verl's mean
    rounds (docs/objectives.md, "Where this differs from verl")."""
    _, group = torch.unique(torch.as_tensor(group_ids, device=scores.device), return_inverse=True)
    count = torch.bincount(group).to(scores.dtype)
    mean = torch.zeros_like(count).index_add_(0, group, scores) / count
    lowest = torch.full_like(count, torch.inf).scatter_reduce(0, group, scores, "amin")
    highest = torch.full_like(count, -torch.inf).scatter_reduce(0, group, scores, "amax")
    mean = torch.where(lowest == highest, lowest, mean)
    sq_dev = torch.zeros_like(count).index_add_(0, group, (scores - mean[group]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))  # torch.std (unbiased), as verl
    return group, count, mean, std


def _global_whiten(values, lengths, eps=1e-8):
    """verl's masked_whiten of a (B, T) tensor whose rows are constant (value i on each of the
    lengths[i] tokens of row i), computed per row: token-weighted mean and unbiased variance over
    the whole batch, (v - mean) / sqrt(var + eps). With torchrun the sums run over every rank, so
    the result is the one a single process would give on the global batch (verl computes
    advantages on the driver, over the whole batch)."""
    weights = lengths.to(values.dtype)
    totals = torch.stack([(weights * values).sum(), weights.sum()])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    mean = totals[0] / (totals[1] + 1e-8)  # verl masked_mean's + 1e-8
    sq_dev = (weights * (values - mean) ** 2).sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq_dev)
    var = sq_dev / (totals[1] + 1e-8) * totals[1] / (totals[1] - 1)  # Bessel, as masked_var
    return (values - mean) * torch.rsqrt(var + eps)


def grpo_advantages(scores, group_ids, lengths=None, baselines=None, eps=1e-6, norm_by_std=True):
    """GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, section 4.1.2; verl
    compute_grpo_outcome_advantage):

        A_i = (s_i - mean_g) / (std_g + eps)     GRPO (std unbiased, as torch.std)
        A_i =  s_i - mean_g                      Dr.GRPO (norm_by_std=False; Liu et al. 2025,
                                                 arXiv:2503.20783, section 3.1)

    A group of one gets mean 0 and std 1 (verl), so its advantage is s_i / (1 + eps); an all-equal
    group gets exactly 0, for any scores (_group_stats)."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    group, count, mean, std = _group_stats(scores, group_ids)
    mean = mean.masked_fill(count == 1, 0.0)
    std = std.masked_fill(count == 1, 1.0)
    advantages = scores - mean[group]
    if norm_by_std:
        advantages = advantages / (std[group] + eps)
    return advantages


def rloo_advantages(scores, group_ids, lengths=None, baselines=None, eps=1e-6, norm_by_std=True):
    """RLOO, REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics",
    arXiv:2402.14740, section 3.3; verl compute_rloo_outcome_advantage): the baseline of a response
    is the mean score of the other n - 1 responses of its group,

        A_i = s_i - (sum_g - s_i) / (n - 1) = n / (n - 1) * (s_i - mean_g)

    A group of one keeps its raw score (verl). Not divided by a std: norm_by_std is not used."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    group, count, mean, _ = _group_stats(scores, group_ids)
    n = count[group]
    return torch.where(n > 1, (scores - mean[group]) * n / (n - 1).clamp(min=1), scores)


def reinforce_plus_plus_advantages(
    scores, group_ids, lengths, baselines=None, eps=1e-6, norm_by_std=True
):
    """REINFORCE++ (Hu et al. 2025, arXiv:2501.03262, section 3; verl
    compute_reinforce_plus_plus_outcome_advantage): no per-prompt baseline; the return (the score,
    with gamma = 1) is whitened over every response token of the batch,

        A_i = (s_i - mean_tokens) / sqrt(var_tokens + 1e-8)

    where each response counts once per token (a long response weighs more in the mean and
    variance), as verl's masked_whiten of the (B, T) returns. Global: over every rank's batch."""
    return _global_whiten(torch.as_tensor(scores, dtype=torch.float32), lengths)


def reinforce_plus_plus_baseline_advantages(
    scores, group_ids, lengths, baselines=None, eps=1e-6, norm_by_std=True
):
    """REINFORCE++ with a group baseline (Hu et al. 2025, arXiv:2501.03262, "REINFORCE++-baseline";
    verl compute_reinforce_plus_plus_baseline_outcome_advantage): subtract the group's mean score,
    then whiten over every response token of the batch (as reinforce_plus_plus_advantages),

        A_i = whiten_tokens(s_i - mean_g)

    A group of one has mean 0 (verl)."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    group, count, mean, _ = _group_stats(scores, group_ids)
    centred = scores - mean.masked_fill(count == 1, 0.0)[group]
    return _global_whiten(centred, lengths)


def remax_advantages(scores, group_ids, lengths, baselines, eps=1e-6, norm_by_std=True):
    """ReMax (Li et al. 2024, arXiv:2310.10505, Algorithm 1; verl compute_remax_outcome_advantage):
    the baseline is the score of the policy's greedy answer to the same prompt, generated in the
    same step (grpo.py step 4 makes it when --adv-estimator remax),

        A_i = s_i - s_greedy(prompt_i)

    Not whitened, not divided by a std."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    return scores - torch.as_tensor(baselines, dtype=torch.float32, device=scores.device)


def opo_advantages(scores, group_ids, lengths, baselines=None, eps=1e-6, norm_by_std=True):
    """OPO, on-policy RL with the optimal baseline (Hao et al. 2025, arXiv:2505.23585, section 3.2;
    verl compute_opo_outcome_advantage): the baseline is the group's length-weighted mean score,

        A_i = s_i - sum_g(len_j s_j) / sum_g(len_j)

    A group of one keeps its raw score (verl). Not divided by a std."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    weights = torch.as_tensor(lengths, dtype=torch.float32, device=scores.device)
    group, count, mean, std = _group_stats(scores, group_ids)
    weighted = torch.zeros_like(count).index_add_(0, group, weights * scores)
    total_length = torch.zeros_like(count).index_add_(0, group, weights)
    # an all-equal group's weighted mean is its score, exactly (as _group_stats' mean)
    baseline = torch.where(std == 0, mean, weighted / total_length).masked_fill(count == 1, 0.0)
    return scores - baseline[group]


def grpo_passk_advantages(
    scores, group_ids, lengths=None, baselines=None, eps=1e-6, norm_by_std=True
):
    """GRPO for pass@k (Chen et al. 2025, "Pass@k Training", arXiv:2503.19595; verl
    compute_grpo_passk_outcome_advantage): only the best response of each group is pushed, by how
    much it beats the second best,

        A_best = (s_max - s_second) / (std_g + eps)     (no division when norm_by_std=False)
        A_i    = 0 for every other response

    so a prompt contributes only when its best answer is better than all the others. Needs groups
    of at least 2 (verl raises; grpo.py refuses --rollout-n 1). With a tie at the top the advantage
    is 0 whichever of them is "best"."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    group, count, _, std = _group_stats(scores, group_ids)
    if bool((count < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses per prompt group")
    minus_inf = torch.full_like(count, -torch.inf)
    best = minus_inf.scatter_reduce(0, group, scores, "amax")  # (G,)
    is_best = scores == best[group]
    best_count = torch.zeros_like(count).index_add_(0, group, is_best.to(count.dtype))
    second = minus_inf.scatter_reduce(0, group, scores.masked_fill(is_best, -torch.inf), "amax")
    # a tie at the top: the second best equals the best, so the gap is 0
    gap = torch.where(best_count > 1, torch.zeros_like(best), best - second)
    if norm_by_std:
        gap = gap / (std + eps)
    return torch.where(is_best, gap[group], torch.zeros_like(scores))


GPG_F_NORM = 1.0  # verl compute_gpg_outcome_advantage's f_norm default


def gpg_advantages(scores, group_ids, lengths=None, baselines=None, eps=1e-6, norm_by_std=True):
    """GPG's outcome advantage (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning
    Baseline for Model Reasoning", arXiv:2504.02546, section 3; verl
    compute_gpg_outcome_advantage): the group mean as baseline, no std, scaled up by how few
    responses scored at all,

        A_i   = alpha (s_i - mean_g) / f_norm,    f_norm = 1
        alpha = B / #{j : s_j != 0}                (B responses; the count at least 1)

    so a batch where few responses earn a reward still moves the policy as much as one where many
    do. alpha counts the whole batch, over every rank (verl computes advantages on the whole batch;
    call it on every rank). A group of one has mean 0 (verl). norm_by_std is not used."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    group, count, mean, _ = _group_stats(scores, group_ids)
    counts = torch.stack([torch.tensor(float(len(scores))), (scores != 0).sum().float().cpu()])
    counts = counts.to(scores.device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    alpha = counts[0] / counts[1].clamp(min=1)
    return alpha * (scores - mean.masked_fill(count == 1, 0.0)[group]) / GPG_F_NORM


def gdpo_advantages(scores, group_ids, lengths, baselines=None, eps=1e-6, norm_by_std=True):
    """GDPO, group reward-decoupled normalisation (arXiv:2601.05242; verl
    compute_gdpo_outcome_advantage): with scores (B, K), one column per named reward component
    (tasks.py: format and answer), each component is normalised within its group before they are
    added, so a component that varies a lot (or is large) cannot drown one that varies little,

        A_k,i = (s_k,i - mean_g(s_k)) / (std_g(s_k) + eps)     (grpo_advantages, per component)
        A_i   = whiten_tokens(sum_k A_k,i)                      (weights 1, verl's default)

    then whitened over every response token of the batch, over every rank (as
    reinforce_plus_plus_advantages). Scores (B,) are one component: GRPO, then the whitening."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    components = scores if scores.dim() == 2 else scores[:, None]
    total = torch.zeros(len(components), device=components.device)
    for k in range(components.shape[1]):
        total = total + grpo_advantages(
            components[:, k], group_ids, eps=eps, norm_by_std=norm_by_std
        )
    return _global_whiten(total, lengths)


def optimal_token_baseline_advantages(
    scores, group_ids, lengths, old_logprobs, sum_pi_squared, mask, is_weights=None, eps=1e-8
):
    """The optimal token baseline, OTB (verl compute_optimal_token_baseline_advantage): one
    baseline per token position of each group, the return weighted by how much gradient the path
    to that position carries. The variance-minimising constant baseline of a score-function
    estimator is b* = E[G |grad log pi|^2] / E[|grad log pi|^2] (Greensmith, Bartlett and Baxter
    2004, "Variance Reduction Techniques for Gradient Estimates in RL", JMLR 5, section 6); with
    respect to the logits z_j of token j, |d log pi(a_j) / dz_j|^2 = |onehot(a_j) - pi_j|^2, so

        w_j    = 1 - 2 pi_old(a_j) + sum_v pi_old(v)^2     (times rho_j^2 with IS weights rho)
        W_i,t  = sum_{j <= t} w_i,j                         (the path's energy up to token t)
        B_t    = sum_i G_i,t W_i,t / (sum_i W_i,t + eps)    (over the group's responses valid at t)
        A_i,t  = G_i,t - B_t

    G_i,t is the return from token t: the score sits on the response's last token (of `lengths`,
    the responses as sampled) and gamma = 1, so G is the score at every token if the mask keeps
    that last token and 0 if it does not (verl's reward-to-go of the masked rewards). Where only
    the group's longest response reaches (beyond the second longest) B = 0, and a group of one has
    B = 0 (verl's handle_zero_tail): one sample cannot be its own baseline. Where every response of
    the group has the same return at t, B_t is that return exactly (so an all-equal group gets 0,
    as _group_stats; verl's sum rounds).

    old_logprobs, sum_pi_squared, mask, is_weights: (B, T), pi_old's (grpo.py step 3; sum_v
    pi_old(v)^2 from the same chunked pass, logprobs.token_logprobs_and_entropy); mask: the
    response mask after the correction's rejection (verl passes the RS-modified response_mask).
    Returns advantages (B, T) float32, 0 outside the mask."""
    mask = mask.float()
    scores = torch.as_tensor(scores, dtype=torch.float32, device=mask.device)
    batch, T = mask.shape
    positions = torch.arange(T, device=mask.device)
    # the score on each response's last token, then the (B, T) reward-to-go of the masked rewards
    lengths = torch.as_tensor(lengths, device=mask.device).long()
    last = (lengths - 1).clamp(min=0)
    rewards = torch.zeros_like(mask).scatter_(1, last[:, None], scores[:, None])
    rewards = rewards * (lengths > 0)[:, None]
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    w = 1 - 2 * old_logprobs.exp() + sum_pi_squared
    if is_weights is not None:
        w = w * is_weights**2
    path_energy = (w * mask).cumsum(-1)
    _, group = torch.unique(torch.as_tensor(group_ids, device=mask.device), return_inverse=True)
    groups = int(group.max()) + 1 if batch else 0
    # (G, T) sums over each group's responses valid at t
    numerator = torch.zeros(groups, T, device=mask.device).index_add_(
        0, group, returns * path_energy * mask
    )
    denominator = torch.zeros(groups, T, device=mask.device).index_add_(
        0, group, path_energy * mask
    )
    baseline = numerator / (denominator + eps)
    # exact where the group's valid returns at t are all equal
    rows = group[:, None].expand(-1, T)
    lowest = torch.full((groups, T), torch.inf, device=mask.device).scatter_reduce(
        0, rows, torch.where(mask.bool(), returns, torch.inf), "amin"
    )
    highest = torch.full((groups, T), -torch.inf, device=mask.device).scatter_reduce(
        0, rows, torch.where(mask.bool(), returns, -torch.inf), "amax"
    )
    same = (lowest == highest) & torch.isfinite(lowest)
    baseline = torch.where(same, lowest, baseline)[group]
    # no baseline for a group of one, nor where the longest response is alone (lengths after the
    # rejection: the mask's)
    count = torch.bincount(group, minlength=groups)[group]
    kept_lengths = mask.sum(-1)
    longest = torch.full((groups,), -1.0, device=mask.device).scatter_reduce(
        0, group, kept_lengths, "amax"
    )[group]
    at_longest = kept_lengths == longest
    alone = at_longest & (torch.bincount(group, weights=at_longest.float())[group] == 1)
    second = torch.full((groups,), -1.0, device=mask.device).scatter_reduce(
        0, group, kept_lengths.masked_fill(at_longest, -1.0), "amax"
    )[group]
    tail = alone[:, None] & (positions[None, :] >= second[:, None])
    baseline = baseline.masked_fill(tail | (count == 1)[:, None], 0.0)
    return (returns - baseline) * mask


def tir_optimal_token_baseline_advantages(
    scores, group_ids, lengths, old_logprobs, sum_pi_squared, mask, is_weights=None, eps=1e-8
):
    """The optimal token baseline of multi-turn responses (verl
    compute_multi_turn_optimal_token_baseline_advantage; TIR: tool-integrated reasoning): the
    same B_t, with t counted over each response's model tokens only. In a multi-turn response the
    policy's k-th token sits at a different position in every response (the tools' answers
    between its turns differ in length), and OTB's B_t would average over tokens of different
    turns; here each response's masked-in tokens move left in order (a tool's tokens and the
    rejected ones left out), so the k-th model token of every response of a group shares one
    baseline, OTB runs on those columns, and the advantages go back to their positions.

    The return is that of the response as sampled: the score sits on its last token, so every
    kept token's G is the score if the mask keeps that last token and 0 if it does not (verl
    computes the returns before it compacts). With no holes in the mask (one turn, no token-level
    rejection) the compaction changes nothing: it is OTB. Arguments and result as
    optimal_token_baseline_advantages'."""
    mask = mask.float()
    kept = mask.bool()
    batch, T = mask.shape
    kept_counts = kept.sum(-1)
    # the kept positions of each row first, in order (a stable sort of "not kept")
    order = torch.sort((~kept).to(torch.int8), dim=-1, stable=True).indices
    compact_mask = (torch.arange(T, device=mask.device)[None, :] < kept_counts[:, None]).float()

    def compact(x):
        return None if x is None else x.gather(1, order)

    # the score on the last compacted token when the mask keeps the sampled last one, else none
    lengths = torch.as_tensor(lengths, device=mask.device).long()
    last = (lengths - 1).clamp(min=0)
    last_kept = kept[torch.arange(batch, device=mask.device), last] & (lengths > 0)
    compact_lengths = torch.where(last_kept, kept_counts, torch.zeros_like(kept_counts))
    compact_advantages = optimal_token_baseline_advantages(
        scores,
        group_ids,
        compact_lengths,
        compact(old_logprobs),
        compact(sum_pi_squared),
        compact_mask,
        compact(is_weights),
        eps,
    )
    return torch.zeros_like(mask).scatter(1, order, compact_advantages) * mask


# --adv-estimator: verl's algorithm.adv_estimator names
ADV_ESTIMATORS = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
    "remax": remax_advantages,
    "opo": opo_advantages,
    "grpo_passk": grpo_passk_advantages,
    "gpg": gpg_advantages,
    "gdpo": gdpo_advantages,
    # per token, from step 3's pi_old: grpo.py calls it by name in step 4
    "optimal_token_baseline": optimal_token_baseline_advantages,
    # the same over each response's model tokens (multi-turn, --tools)
    "tir_optimal_token_baseline": tir_optimal_token_baseline_advantages,
}
# estimators that need pi_old's logprobs (and sum_v pi_old(v)^2), so run after step 3
TOKEN_LEVEL_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")

# --------------------------------------------------------------------------------------------------
# 2. Policy losses (verl actor.policy_loss.loss_mode). Each takes (logprobs, old_logprobs,
#    advantages, mask, clip_low, clip_high, clip_c) as (B, T) tensors and returns (loss per token
#    (B, T), metrics); the caller multiplies by the correction's IS weights and reduces with
#    agg_loss, as verl does after its loss function. PPO's clip first (the default, "vanilla"),
#    then bypass mode's REINFORCE, then the rest of the family.
# --------------------------------------------------------------------------------------------------


def ppo_clip_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None
):
    """PPO's clipped surrogate per token, with clip-higher and dual-clip (verl
    core_algos.compute_policy_loss_vanilla before its IS weights and aggregation):

        r_t = pi_theta / pi_old = exp(logprobs - old_logprobs)      (log-ratio clamped to +-20)
        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
        l_t = min(l_t, -A_t * clip_c)    where A_t < 0, if clip_c is set

    The clip is Schulman et al. 2017's (DAPO's clip-higher: clip_high > clip_low); the dual clip (Ye
    et al. 2020) bounds the loss of a huge ratio on a bad action.

    The caller multiplies l_t by the IS weights (after clipping: decoupled PPO) and reduces it with
    agg_loss. `advantages` is (B, T): broadcast a per-sequence advantage with adv[:, None]. Padded
    entries are zeroed before any arithmetic, so NaN/inf there reach neither the loss nor the
    gradient. Returns (l (B, T), metrics): pg_clipfrac (tokens where clipping was active),
    pg_clipfrac_lower (dual-clip active), ppo_kl (mean of old - new log prob), as floats.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    advantages = torch.where(valid, advantages, zero)
    ratio = torch.exp(log_ratio)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(losses_unclipped, losses_clipped)
    metrics = {
        "pg_clipfrac": masked_mean((losses_clipped > losses_unclipped).float(), valid),
        "ppo_kl": masked_mean(-log_ratio.detach(), valid),
        "pg_clipfrac_lower": zero,
    }
    if clip_c is not None:
        if clip_c <= 1.0:
            raise ValueError(f"clip_ratio_c (dual-clip) must be > 1, got {clip_c}")
        losses_dual = -advantages * clip_c
        negative = advantages < 0
        metrics["pg_clipfrac_lower"] = masked_mean(
            ((losses > losses_dual) & negative).float(), valid
        )
        losses = torch.where(negative, torch.minimum(losses, losses_dual), losses)
    return losses, {k: float(v) for k, v in metrics.items()}


def reinforce_token_loss(logprobs, advantages, mask):
    """The REINFORCE term per token (verl core_algos.compute_policy_loss_reinforce, bypass mode
    loss_type "reinforce"):

        l_t = -A_t * log pi_theta(a_t)     with IS weights: -stopgrad(w_t) * A_t * log pi_theta(a_t)

    The caller multiplies by the weights, which compute_is_weights returns detached: the gradient is
    then -w_t * A_t * grad log pi_theta, without the log pi * grad w term that would optimise the
    correction factor instead of the objective (verl math doc 3.2.2). Padded entries are zeroed.
    Returns (l (B, T), {})."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return -torch.where(valid, advantages, zero) * torch.where(valid, logprobs, zero), {}


def gspo_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None
):
    """GSPO's clipped surrogate with one ratio per sequence (Zheng et al. 2025, "Group Sequence
    Policy Optimization", arXiv:2507.18071; verl core_algos.compute_policy_loss_gspo before its IS
    weights and aggregation):

        s_i   = exp(mean_t (log pi_theta(a_t) - log pi_old(a_t)))    the geometric-mean ratio
        s_i,t = sg(s_i) * pi_theta(a_t) / sg(pi_theta(a_t))     value s_i, gradient s_i grad log pi
        l_t   = max(-A_t s_i,t, -A_t clip(s_i,t, 1 - clip_low, 1 + clip_high))

    So every token of a sequence is clipped together, by how far the whole sequence moved. log s_i,t
    is capped at 10 (verl); there is no dual clip (clip_c is ignored, as in verl). The paper clips
    at about 3e-4 / 4e-4 with seq-mean-token-mean; verl's defaults are the PPO clip and the
    trainer's loss_agg_mode. Padded entries are zeroed first. Returns (l (B, T), metrics):
    pg_clipfrac (tokens whose sequence is clipped), ppo_kl (mean of old - new log prob, per token),
    pg_clipfrac_lower = 0.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(valid, logprobs, zero)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero)
    advantages = torch.where(valid, advantages, zero)
    lengths = valid.sum(-1).clamp(min=1)
    seq_log_ratio = log_ratio.sum(-1) / lengths  # (B,)
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    metrics = {
        "pg_clipfrac": masked_mean((losses_clipped > losses_unclipped).float(), valid),
        "ppo_kl": masked_mean(-log_ratio.detach(), valid),
        "pg_clipfrac_lower": zero,
    }
    losses = torch.maximum(losses_unclipped, losses_clipped)
    return losses, {k: float(v) for k, v in metrics.items()}


def cispo_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None
):
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio (MiniMax 2025,
    "MiniMax-M1", arXiv:2506.13585, section 3.1; verl core_algos.compute_policy_loss_cispo):

        r_t = exp(log pi_theta(a_t) - log pi_old(a_t))        (log-ratio clamped to +-20)
        l_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * log pi_theta(a_t)

    Unlike PPO's clip, which drops the gradient of a clipped token, every token keeps its gradient;
    the clip only bounds its weight. The loss value holds log pi itself, so its size is not
    comparable with the ratio losses'. No dual clip (clip_c is ignored, as in verl). Returns
    (l (B, T), metrics): pg_clipfrac (tokens whose weight was clipped, either side), ppo_kl,
    pg_clipfrac_lower = 0.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    advantages = torch.where(valid, advantages, zero)
    losses = -clipped_ratio * advantages * torch.where(valid, logprobs, zero)
    metrics = {
        "pg_clipfrac": masked_mean((ratio != clipped_ratio).float(), valid),
        "ppo_kl": masked_mean(-log_ratio.detach(), valid),
        "pg_clipfrac_lower": zero,
    }
    return losses, {k: float(v) for k, v in metrics.items()}


def gpg_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None
):
    """GPG's policy loss (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning
    Baseline for Model Reasoning", arXiv:2504.02546; verl core_algos.compute_policy_loss_gpg):
    plain REINFORCE, l_t = -A_t log pi_theta(a_t) (reinforce_token_loss). pi_old, the clip and
    clip_c are not used, so nothing bounds an update on data from an older policy (ppo_epochs > 1,
    several minibatches per step). Returns (l (B, T), {}): no clip metrics, as verl."""
    return reinforce_token_loss(logprobs, advantages, mask)


SAPO_TAU_POS = 1.0  # verl ActorConfig.tau_pos
SAPO_TAU_NEG = 1.05  # verl ActorConfig.tau_neg


def sapo_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None
):
    """SAPO, soft adaptive policy optimisation: a smooth gate on the ratio instead of a hard clip
    (Gao et al. 2025, arXiv:2511.20347; verl core_algos.compute_policy_loss_sapo):

        r_t   = exp(log pi_theta(a_t) - log pi_old(a_t))          (log-ratio clamped to +-20)
        tau_t = SAPO_TAU_POS if A_t > 0 else SAPO_TAU_NEG          (1.0 and 1.05, verl's defaults)
        l_t   = -A_t * (4 / tau_t) * sigmoid(tau_t (r_t - 1))

    At r = 1 the gate's gradient is 1 (that of the ratio itself), and it fades smoothly as r moves
    away, faster for negative advantages (tau_neg > tau_pos), where PPO's clip cuts the gradient
    off at once. The clip settings are not used. verl always aggregates SAPO with
    seq-mean-token-mean, whatever loss_agg_mode says; grpo.py refuses another --loss-agg-mode
    with it instead. Returns (l (B, T), metrics): ppo_kl, and pg_clipfrac = pg_clipfrac_lower = 0
    (as verl: nothing is clipped)."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    advantages = torch.where(valid, advantages, zero)
    # the constants in the input's dtype (float64 inputs: 1.05 exactly, not float32's 1.0499999523)
    tau_pos = torch.tensor(SAPO_TAU_POS, dtype=logprobs.dtype, device=logprobs.device)
    tau_neg = torch.tensor(SAPO_TAU_NEG, dtype=logprobs.dtype, device=logprobs.device)
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    metrics = {
        "pg_clipfrac": zero,
        "ppo_kl": masked_mean(-log_ratio.detach(), valid),
        "pg_clipfrac_lower": zero,
    }
    return -gates * advantages, {k: float(v) for k, v in metrics.items()}


def geo_mean_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None
):
    """GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv:2507.20673; verl
    core_algos.compute_policy_loss_geo_mean): one ratio per sequence, the geometric mean of its
    tokens' ratios, each clipped in log space on the side its advantage's sign makes pessimistic:

        d_t   = log pi_theta(a_t) - log pi_old(a_t)
        d'_t  = sgn(A) min(sgn(A) d_t, sgn(A) clip(d_t, -clip_low, clip_high))
        L_i   = -A_i exp(mean_t d'_t)                      (A_i: the sequence's mean advantage)

    Returned as L_i on every valid token of sequence i, so that seq-mean-token-mean (the only
    --loss-agg-mode grpo.py allows with it) gives the mean over sequences, verl's torch.mean. Two
    differences from verl, both refused or avoided in grpo.py rather than copied: verl multiplies
    L_i by the geometric mean of token IS weights (grpo.py multiplies per token, which for the
    sequence-level weights it allows here is the same number), and verl's plain mean over each
    micro-batch ignores its global normalisation, so its gradient grows with the number of
    micro-batches (ours: seq-mean-token-mean over the minibatch, micro-batch invariant). No
    log-ratio clamp (verl). Returns (l (B, T), metrics): pg_clipfrac / pg_clipfrac_lower (tokens
    whose log-ratio was clipped, with A > 0 / A < 0), ppo_kl."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero)
    advantages = torch.where(valid, advantages, zero)
    sign = torch.sign(advantages)
    clipped = log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    lengths = valid.sum(-1)
    seq_ratio = torch.exp(torch.where(valid, pessimistic, zero).sum(-1) / (lengths + 1e-8))
    seq_advantage = advantages.sum(-1) / (lengths + 1e-8)
    seq_loss = -seq_advantage * seq_ratio  # (B,)
    was_clipped = (log_ratio != clipped).float()
    metrics = {
        "pg_clipfrac": masked_mean(was_clipped * (advantages > 0), valid),
        "ppo_kl": masked_mean(-log_ratio.detach(), valid),
        "pg_clipfrac_lower": masked_mean(was_clipped * (advantages < 0), valid),
    }
    losses = torch.where(valid, seq_loss[:, None], zero)
    return losses, {k: float(v) for k, v in metrics.items()}


# the cap with --clip-ratio-c None: the fallback of verl's DPPO losses (`config.get("clip_ratio_c",
# 20.0)`), which verl's actor config never reaches: it always sets clip_ratio_c (3.0, as here)
DPPO_RATIO_CAP = 20.0


def _dppo_token_loss(logprobs, old_logprobs, advantages, valid, keep, clip_c):
    """DPPO's per-token loss once its trust region `keep` is known: REINFORCE with the ratio as a
    stop-gradient weight truncated at clip_c, over the tokens the region keeps."""
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    ratio = torch.exp(log_ratio)
    # the ratio weight truncated at clip_c (3.0 by default); None: 20, a large cap as DPPO section
    # 5.4 favours (truncation biases the gradient)
    cap = DPPO_RATIO_CAP if clip_c is None else clip_c
    keep = (keep & valid).to(logprobs.dtype).detach()
    advantages = torch.where(valid, advantages, zero)
    losses = -advantages * ratio.clamp(max=cap).detach() * torch.where(valid, logprobs, zero) * keep
    metrics = {
        "pg_clipfrac": masked_mean(1.0 - keep, valid),
        "ppo_kl": masked_mean(-log_ratio.detach(), valid),
        "pg_clipfrac_lower": masked_mean((ratio > cap).to(logprobs.dtype) * keep, valid),
    }
    return losses, {k: float(v) for k, v in metrics.items()}


def dppo_tv_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None
):
    """DPPO-Binary-TV: a trust region on the change of each sampled token's probability instead of
    on the ratio (arXiv:2602.04879; verl core_algos.compute_policy_loss_dppo_tv). With
    p = pi_theta(a_t), p_old = pi_old(a_t), r_t = p / p_old:

        keep_t = p - p_old <= clip_high     if A_t > 0    (may not raise p by more than clip_high)
                 p - p_old >= -clip_low     otherwise      (may not lower p by more than clip_low)
        l_t    = -A_t * sg(min(r_t, clip_c)) * log pi_theta(a_t) * keep_t

    so clip_ratio_low / clip_ratio_high are probability distances here (a total-variation bound on
    the binary distribution {a_t, not a_t}), not ratio bounds; clip_c truncates the ratio weight
    (grpo.py passes --clip-ratio-c, 3.0 by default as verl's actor config; None: 20). Returns
    (l (B, T), metrics): pg_clipfrac (tokens outside the region), ppo_kl, pg_clipfrac_lower (kept
    tokens whose weight was truncated)."""
    valid = mask.bool()
    change = torch.exp(logprobs) - torch.exp(old_logprobs)
    keep = torch.where(advantages > 0, change <= clip_high, change >= -clip_low)
    return _dppo_token_loss(logprobs, old_logprobs, advantages, valid, keep, clip_c)


def dppo_kl_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None
):
    """DPPO-Binary-KL: DPPO's trust region measured by the KL divergence between the binary
    distributions {a_t, not a_t} of pi_old and pi_theta (arXiv:2602.04879; verl
    core_algos.compute_policy_loss_dppo_kl). With p, p_old as in dppo_tv_token_loss:

        d_t    = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        keep_t = d_t <= clip_high or p <= p_old     if A_t > 0   (only a rise of p is bounded)
                 d_t <= clip_low  or p >= p_old     otherwise    (only a fall of p is bounded)
        l_t    = -A_t * sg(min(r_t, clip_c)) * log pi_theta(a_t) * keep_t

    Returns (l (B, T), metrics) as dppo_tv_token_loss."""
    valid = mask.bool()
    p = torch.exp(logprobs)
    p_old = torch.exp(old_logprobs)
    binary_kl = p_old * (old_logprobs - logprobs) + (1 - p_old) * torch.log(
        (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
    )
    keep_rise = (binary_kl <= clip_high) | (p <= p_old)
    keep_fall = (binary_kl <= clip_low) | (p >= p_old)
    keep = torch.where(advantages > 0, keep_rise, keep_fall)
    return _dppo_token_loss(logprobs, old_logprobs, advantages, valid, keep, clip_c)


def dro_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None, beta=None
):
    """DRO, direct reward optimisation with a quadratic log-ratio penalty (Richemond et al. 2024,
    "Offline Regularised Reinforcement Learning for Large Language Models Alignment",
    arXiv:2405.19107; verl core_algos.compute_policy_loss_dro):

        l_t = -(A_t log pi_theta(a_t) - beta / 2 (log pi_theta(a_t) - log pi_old(a_t))^2)

    REINFORCE with a penalty that keeps the policy near pi_old, no clip (the clip settings are not
    used); beta is --dro-beta (verl policy_loss.dro_beta, which must be set > 0). Returns
    (l (B, T), metrics): ppo_kl only, as verl."""
    if beta is None or beta <= 0:
        raise ValueError(f"dro_token_loss: beta (--dro-beta) must be > 0, got {beta}")
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(valid, logprobs, zero)
    log_ratio = logprobs - torch.where(valid, old_logprobs, zero)
    advantages = torch.where(valid, advantages, zero)
    losses = -(logprobs * advantages - 0.5 * beta * log_ratio.square())
    return losses, {"ppo_kl": float(masked_mean(-log_ratio.detach(), valid))}


# Clip-Cov and KL-Cov settings: verl's actor.yaml policy_loss defaults
CLIP_COV_RATIO = 0.0002  # share of the tokens whose gradient Clip-Cov cuts
CLIP_COV_LB = 1.0  # ... chosen among tokens whose covariance lies in (lb, ub)
CLIP_COV_UB = 5.0
KL_COV_RATIO = 0.0002  # share of the tokens KL-Cov penalises (those of largest covariance)
PPO_KL_COEF = 0.1  # KL-Cov's penalty coefficient on |log r|


def _token_covariance(logprobs, advantages, valid):
    """Each valid token's centred product (A_t - mean A) (log pi_t - mean log pi), the means over
    the valid tokens of the call: its share of Cov(log pi, A), which drives the entropy down
    (Cui et al. 2025, section 4). Detached; padded entries are -inf."""
    logprobs = logprobs.detach()
    centred = (advantages - masked_mean(advantages, valid)) * (
        logprobs - masked_mean(logprobs, valid)
    )
    return torch.where(valid, centred, torch.full_like(centred, -torch.inf))


def clip_cov_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None
):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv:2505.22617, section 5; verl core_algos.compute_policy_loss_clip_cov):
    PPO's clipped surrogate, and the gradient of a few more tokens cut, drawn at random among the
    tokens PPO did not clip whose covariance (A_t - mean A)(log pi_t - mean log pi) lies in
    (CLIP_COV_LB, CLIP_COV_UB): those that push the entropy down the most.

        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high)) * c_t
        c_t = 0 for max(1, int(CLIP_COV_RATIO * tokens)) such tokens, else 1

    The means, the token count and the draw (torch.randperm, the global RNG) are over the tokens of
    one call, i.e. one micro-batch, as in verl: the loss is NOT micro-batch invariant (the
    invariance test leaves it out by name). No dual clip and no log-ratio clamp (verl). Returns
    (l (B, T), metrics): pg_clipfrac (the share of tokens cut by the covariance rule), ppo_kl.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero)
    advantages = torch.where(valid, advantages, zero)
    ratio = torch.exp(log_ratio)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    covariance = _token_covariance(torch.where(valid, logprobs, zero), advantages, valid)
    clipped_by_ppo = (losses_clipped > losses_unclipped) & valid
    candidates = (covariance > CLIP_COV_LB) & (covariance < CLIP_COV_UB) & ~clipped_by_ppo
    candidates = torch.nonzero(candidates)  # (K, 2) row, column
    count = max(int(CLIP_COV_RATIO * valid.sum().item()), 1)
    chosen = candidates[torch.randperm(len(candidates))[:count]] if len(candidates) else candidates
    keep = torch.ones_like(advantages)
    keep[chosen[:, 0], chosen[:, 1]] = 0.0
    metrics = {
        "pg_clipfrac": masked_mean((keep == 0).float(), valid),
        "ppo_kl": masked_mean(-log_ratio.detach(), valid),
    }
    losses = torch.maximum(losses_unclipped, losses_clipped) * keep
    return losses, {k: float(v) for k, v in metrics.items()}


def kl_cov_token_loss(
    logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, clip_c=None
):
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617, section 5; verl
    core_algos.compute_policy_loss_kl_cov): the unclipped surrogate -A_t r_t, plus a penalty on
    how far the ratio moved, PPO_KL_COEF * |log r_t|, on the max(1, int(KL_COV_RATIO * tokens))
    tokens of largest covariance (A_t - mean A)(log pi_t - mean log pi):

        l_t = -A_t r_t + PPO_KL_COEF * |log r_t| * [t among the top tokens]

    No clip at all (the clip settings are not used, as in verl). The means and the top-k are over
    one call (one micro-batch): NOT micro-batch invariant (left out of the invariance test by
    name). Returns (l (B, T), metrics): ppo_kl = the mean |log r| (verl logs the absolute value
    under this name)."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(valid, logprobs - old_logprobs, zero)
    advantages = torch.where(valid, advantages, zero)
    losses = -advantages * torch.exp(log_ratio)
    covariance = _token_covariance(torch.where(valid, logprobs, zero), advantages, valid)
    count = max(1, int(valid.sum().item() * KL_COV_RATIO))
    top = torch.topk(covariance.flatten(), min(count, int(valid.sum().item()))).indices
    penalised = torch.zeros(covariance.numel(), dtype=torch.bool, device=covariance.device)
    penalised[top] = True
    penalty = PPO_KL_COEF * log_ratio.abs()
    losses = torch.where(penalised.view_as(losses), losses + penalty, losses)
    return losses, {"ppo_kl": float(masked_mean(log_ratio.abs().detach(), valid))}


# --policy-loss: the policy losses a decoupled update can use, looked up by named_policy_loss where
# grpo.py's update computes its policy loss (verl's policy_loss.loss_mode names); vanilla is PPO's
# clip
POLICY_LOSSES = {
    "vanilla": ppo_clip_token_loss,
    "gspo": gspo_token_loss,
    "cispo": cispo_token_loss,
    "gpg": gpg_token_loss,
    "sapo": sapo_token_loss,
    "geo_mean": geo_mean_token_loss,
    "clip_cov": clip_cov_token_loss,
    "kl_cov": kl_cov_token_loss,
    "dppo_tv": dppo_tv_token_loss,
    "dppo_kl": dppo_kl_token_loss,
    "dro": dro_token_loss,
}


def named_policy_loss(
    name, logprobs, old_logprobs, advantages, mask, clip_low, clip_high, clip_c, dro_beta=0.0
):
    """The loss --policy-loss names, looked up in POLICY_LOSSES with the trainer's clip settings
    (each loss's own formula is its docstring); DRO also takes its penalty coefficient, --dro-beta.
    Returns (losses (B, T), metrics). grpo.grpo_loss calls PPO-clip, the default, by name and
    comes here for the others."""
    policy_loss = POLICY_LOSSES[name]
    if name == "dro":
        policy_loss = functools.partial(policy_loss, beta=dro_beta)
    return policy_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, clip_c)


def bypass_mode_loss(
    logprobs,
    rollout_logprobs,
    advantages,
    mask,
    correction,
    clip_low=0.2,
    clip_high=0.2,
    clip_c=None,
):
    """The policy loss of bypass mode (two policies: pi_old = pi_rollout, no recompute; verl
    core_algos.compute_policy_loss_bypass_mode, rollout_corr_math.md 3.1). Without a recompute,
    the correction runs here, per micro-batch, against the current policy:

        w, M      = corrections.apply_rollout_correction(pi_theta, pi_rollout)   (stop-gradient)
        reinforce l_t = -A_t log pi_theta(a_t), weighted by w (w carries the ratio)
        ppo_clip  l_t = PPO-clip of r_t = pi_theta(a_t) / pi_rollout(a_t), not weighted: r is the
                  IS ratio already, w would count it twice (verl)

    over the tokens M keeps (correction.loss_type chooses; clip settings as ppo_clip_token_loss).
    Returns (losses (B, T), M, w or None: what multiplies the losses, the loss's metrics, the
    correction's metrics)."""
    is_weights, mask, corr_metrics = apply_rollout_correction(
        logprobs.detach(), rollout_logprobs, mask, correction
    )
    if correction.loss_type == "reinforce":
        losses, metrics = reinforce_token_loss(logprobs, advantages, mask)
        return losses, mask, is_weights, metrics, corr_metrics
    losses, metrics = ppo_clip_token_loss(
        logprobs, rollout_logprobs, advantages, mask, clip_low, clip_high, clip_c
    )
    return losses, mask, None, metrics, corr_metrics


# --------------------------------------------------------------------------------------------------
# 3. The KL-to-reference penalty (GRPO's KL loss, ppo_rlhf.py's per-token KL reward)
# --------------------------------------------------------------------------------------------------

KL_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
# each with "+": its value, k2's gradient (verl kl_penalty)
KL_PENALTY_KINDS = KL_ESTIMATORS + tuple(kind + "+" for kind in KL_ESTIMATORS)


def kl_penalty(logprobs, ref_logprobs, kind="k1"):
    """Per-token KL(pi_theta || pi_ref) estimate for a loss or a reward penalty (verl
    core_algos.kl_penalty), with d = logprobs - ref_logprobs on tokens sampled from pi_theta:
        "k1" / "kl"         d                (the RLHF reward penalty, RLHF blog detail 5.2)
        "abs"               |d|
        "k2" / "mse"        0.5 * d^2
        "k3" / "low_var_kl" exp(-d) - 1 + d  (-d clamped to +-20, the result to [-10, 10], as verl)
    A kind ending in "+" (e.g. "k3+") is straight-through: the value of its estimator, the gradient
    of k2 (value: k, gradient: d(0.5 d^2)/dtheta = d * grad log pi_theta). k1 and k3 are unbiased
    estimates of the KL's value but their gradients are not the KL's gradient in expectation; k2's
    is (Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html; verl
    core_algos.py kl_penalty).
    """
    if kind.endswith("+") and kind[:-1] in KL_ESTIMATORS:
        value = kl_penalty(logprobs, ref_logprobs, kind[:-1])
        k2 = kl_penalty(logprobs, ref_logprobs, "k2")
        return k2 - k2.detach() + value.detach()
    d = logprobs - ref_logprobs
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("k2", "mse"):
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        neg_d = (-d).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        return (torch.exp(neg_d) - neg_d - 1).clamp(-10.0, 10.0)
    raise ValueError(f"kl penalty kind must be one of {KL_PENALTY_KINDS}, got {kind!r}")


# --------------------------------------------------------------------------------------------------
# 4. Loss aggregation: a (B, T) per-token loss to the scalar that is differentiated
# --------------------------------------------------------------------------------------------------

AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "token-sum",
)


def agg_loss(
    loss_mat,
    mask,
    mode="token-mean",
    norm_constant=None,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
):
    """Reduce a (B, T) per-token loss to a scalar (verl core_algos.agg_loss):

        token-mean               sum_{i,t} l / #valid tokens           (DAPO; verl's default)
        seq-mean-token-sum       sum_i (sum_t l) / #sequences          (a sequence with no valid
                                                                        token adds nothing)
        seq-mean-token-mean      sum_i (sum_t l / T_i) / #sequences    (original GRPO; an empty
                                                                        sequence adds nothing)
        seq-mean-token-sum-norm  sum_i (sum_t l) / #sequences / norm_constant   (Dr.GRPO: a
                                 constant instead of T_i; norm_constant defaults to T, the padded
                                 length: keep it fixed during training)
        token-sum                sum_{i,t} l

    With the defaults the counts are this batch's. For one micro-batch of a minibatch spread over
    micro-batches and dp_size ranks (verl's global_batch_info) they are the whole minibatch's:
    batch_num_tokens (valid tokens, all ranks; token-mean) and global_batch_size (sequences, all
    ranks; verl passes ppo_mini_batch_size * n), and the result is multiplied by dp_size (the ranks'
    gradients are averaged): the micro-batch losses then simply add up and give the gradient of the
    minibatch's loss whatever the micro-batch size or number of ranks (token-sum: the local sum
    times dp_size). Rejected or padded tokens contribute nothing; an all-rejected batch gives
    exactly 0.
    """
    valid = mask.bool()
    if mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError(
                    "agg_loss: token-mean over dp_size > 1 ranks needs the global batch_num_tokens"
                )
            return masked_mean(loss_mat, valid)
        return masked_sum(loss_mat, valid) / max(float(batch_num_tokens), 1.0) * dp_size
    if mode == "token-sum":
        return masked_sum(loss_mat, valid) * dp_size
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    seq_sums = masked_sum(loss_mat, valid, dim=-1)  # (B,)
    seq_valid = valid.any(-1)
    if mode == "seq-mean-token-mean":
        seq_sums = seq_sums / valid.sum(-1).clamp(min=1)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(
                "agg_loss: the seq-mean modes over dp_size > 1 ranks need the global_batch_size"
            )
        loss = masked_mean(seq_sums, seq_valid)
    else:
        loss = masked_sum(seq_sums, seq_valid) / max(float(global_batch_size), 1.0) * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mat.shape[-1] if norm_constant is None else norm_constant)
    return loss


# --------------------------------------------------------------------------------------------------
# 5. The flags an objective ties together, as data (grpo.check_args calls check_objective before
#    any model loads)
# --------------------------------------------------------------------------------------------------

# the --loss-agg-mode a loss is defined with: verl's SAPO and GMPO average each sequence's tokens
# first (their per-sequence gate and geometric mean need it)
REQUIRED_AGG_MODE = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
# the --rollout-n an estimator needs, and why
MIN_GROUP_SIZE = {"grpo_passk": (2, "it compares the two best")}
# losses that refuse token-level IS weights: verl weights GMPO by the geometric mean of the token
# weights of each sequence, which per-token weights are not
NO_TOKEN_IS_WEIGHTS = ("geo_mean",)
# a setting a loss needs, > 0 (verl raises without it)
REQUIRED_POSITIVE = {"dro": "dro_beta"}


def check_objective(args, correction):
    """Refuse (ValueError, one line naming the flag) a --policy-loss / --adv-estimator whose rules
    above the other flags break; `correction` is the corrections.RolloutCorrection of
    --correction."""

    required_mode = REQUIRED_AGG_MODE.get(args.policy_loss, args.loss_agg_mode)
    if args.loss_agg_mode != required_mode:
        harness.refuse(
            args, "loss_agg_mode", f"{required_mode} with --policy-loss {args.policy_loss}"
        )
    min_group, why = MIN_GROUP_SIZE.get(args.adv_estimator, (1, ""))
    if args.rollout_n < min_group:
        harness.refuse(
            args, "rollout_n", f">= {min_group} for --adv-estimator {args.adv_estimator} ({why})"
        )
    if args.policy_loss != "vanilla" and correction.bypass_mode:
        # verl's bypass mode silently swaps in its own loss (apply_bypass_mode); refused here
        raise ValueError(
            f"--policy-loss {args.policy_loss} needs a decoupled --correction (bypass presets "
            f"bring their own loss), got {args.correction!r}"
        )
    if args.adv_estimator in TOKEN_LEVEL_ESTIMATORS and correction.bypass_mode:
        # sum_v pi_old(v)^2 comes from pi_old's recompute, which bypass skips (verl asserts)
        harness.refuse(
            args, "correction", f"a decoupled preset with --adv-estimator {args.adv_estimator}"
        )
    if args.adv_estimator in TOKEN_LEVEL_ESTIMATORS and args.off_policy_mask_threshold:
        # the mask keeps a sequence by the sign of its one advantage; these have one per token
        harness.refuse(
            args, "off_policy_mask_threshold", f"None with --adv-estimator {args.adv_estimator}"
        )
    setting = REQUIRED_POSITIVE.get(args.policy_loss)
    if setting and not getattr(args, setting) > 0:
        harness.refuse(args, setting, f"> 0 with --policy-loss {args.policy_loss}")
    if args.policy_loss in NO_TOKEN_IS_WEIGHTS and correction.rollout_is == "token":
        harness.refuse(
            args,
            "correction",
            f"a preset without token-level IS weights with --policy-loss {args.policy_loss}",
        )


# --------------------------------------------------------------------------------------------------
# 6. The TIS paper's estimators side by side (Yao et al. 2025; per-token losses, aggregate with
#    agg_loss) sampler = pi_rollout (vLLM), learner = the trainer; old = the learner before this
#    update (pi_old)
# --------------------------------------------------------------------------------------------------


def naive_ppo_token_loss(logprobs, old_logprobs, advantages, clip=0.2):
    """Incorrect: PPO as if the trainer had sampled the tokens. r = pi_learner / pi_old_learner;
    pi_rollout ignored."""
    ratio = torch.exp(logprobs - old_logprobs)
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))


def vanilla_is_token_loss(logprobs, rollout_logprobs, advantages):
    """Vanilla IS (REINFORCE): -(pi_learner / pi_sampler) * A * log pi_learner, the weight a
    stop-gradient. Unbiased but a token sampled with low probability gets a huge weight: variance
    grows with its square."""
    weight = torch.exp((logprobs.detach() - rollout_logprobs).clamp(max=SAFETY_BOUND))
    return -weight * advantages * logprobs


def ppo_is_token_loss(logprobs, rollout_logprobs, advantages, clip=0.2):
    """PPO-IS: PPO whose ratio is taken against the sampler, r = pi_learner / pi_sampler. Even at
    theta = theta_old r != 1 under mismatch, so clipping fires on the mismatch itself and the update
    loses information."""
    ratio = torch.exp((logprobs - rollout_logprobs).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))


def tis_ppo_token_loss(logprobs, old_logprobs, rollout_logprobs, advantages, clip=0.2, cap=2.0):
    """TIS (the paper's fix): min(pi_old_learner / pi_sampler, C) * naive PPO term. The two ratios
    are clipped separately: r = pi_learner / pi_old_learner is exactly 1 at theta = theta_old, so
    PPO's trust region is intact. cap=math.inf is vanilla IS in the PPO form, the paper's ablation
    (preset decoupled_token_vanilla_is)."""
    weight = (
        torch.exp((old_logprobs - rollout_logprobs).clamp(max=SAFETY_BOUND)).clamp(max=cap).detach()
    )
    return weight * naive_ppo_token_loss(logprobs, old_logprobs, advantages, clip)
