"""objectives.py: every advantage estimator against verl 0.9.1's own function (run from its source),
hand-computed values, and the estimators inside a GRPO step."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import types
from collections import defaultdict
from typing import Any, Optional

import numpy as np
import pytest
import torch

import corrections
import grpo
import objectives as O
from tolerances import EPS32, assert_float32_close
from verl_source import load_functions, verl_root

VERL_ESTIMATORS = {
    "grpo": "compute_grpo_outcome_advantage",
    "rloo": "compute_rloo_outcome_advantage",
    "reinforce_plus_plus": "compute_reinforce_plus_plus_outcome_advantage",
    "reinforce_plus_plus_baseline": "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "remax": "compute_remax_outcome_advantage",
    "opo": "compute_opo_outcome_advantage",
    "grpo_passk": "compute_grpo_passk_outcome_advantage",
    "gpg": "compute_gpg_outcome_advantage",
    "gdpo": "compute_gdpo_outcome_advantage",
    "optimal_token_baseline": "compute_optimal_token_baseline_advantage",
    "tir_optimal_token_baseline": "compute_multi_turn_optimal_token_baseline_advantage",
}
# estimators with the (scores, group_ids, lengths, baselines) signature
OUTCOME_ESTIMATORS = [n for n in O.ADV_ESTIMATORS if n not in O.TOKEN_LEVEL_ESTIMATORS]


def _load_verl():
    """verl's estimators and the masked reductions they use, run from its source
    (verl_source.load_functions)."""
    root = verl_root()
    if root is None:
        return None

    base = {"torch": torch, "np": np, "defaultdict": defaultdict, "Optional": Optional}
    reductions = {"masked_sum", "masked_mean", "masked_var", "masked_whiten"}
    functional = load_functions(root, "utils/torch_functional.py", reductions, dict(base))
    verl_F = types.SimpleNamespace(**{name: functional[name] for name in reductions})
    ns = dict(base, verl_F=verl_F, AlgoConfig=Any)
    names = set(VERL_ESTIMATORS.values()) | {"compute_grpo_vectorized_outcome_advantage"}
    # verl's second GRPO (AdvantageEstimator.GRPO_VECTORIZED) sums each group with index_add, in
    # utils/groupwise.py's group_mean_std
    groupwise = {"_resolve_device", "_to_1d_numpy_object_array", "as_torch_index", "group_mean_std"}
    ns.update(Any=Any, os=os, get_device_name=lambda: "cpu")
    load_functions(root, "utils/groupwise.py", groupwise, ns)
    return load_functions(root, "trainer/ppo/core_algos.py", names, ns)


VERL = _load_verl()
needs_verl = pytest.mark.skipif(
    VERL is None, reason="no verl source (scripts/setup_cpu.sh unpacks it)"
)


def advantage_bound(scores, group_ids, terms=16):
    """(B,): how far two float32 computations of a group-normalised advantage, (s - group mean) /
    (group std + eps), may differ when they sum in another order (ours with index_add, verl's loop
    with torch.mean): the mean's rounding, `terms` eps32 of the largest |score| (a group sums at most
    8, the whitening of REINFORCE++ and GDPO a batch's tokens once more), divided by the row's
    group std (1 for a group of one). Per row, since a group of near-equal scores has a small std
    and large advantages."""
    std = torch.ones_like(scores)
    for group in group_ids.unique():
        rows = group_ids == group
        if rows.sum() > 1:
            std[rows] = scores[rows].std()
    return terms * EPS32 * scores.abs().max() / (std + 1e-6)


def assert_advantages_close(ours, theirs, bound, what):
    """|ours - theirs| <= bound (B,) row by row, over (B,) or (B, T) advantages."""
    bound = bound[:, None] if theirs.dim() == 2 else bound
    excess = ((ours - theirs).abs() - bound).max().item()
    assert excess <= 0, f"{what}: beyond the bound by {excess:.2e}"


def random_rollout(seed, min_group=1, T=12, bf16=False):
    """A step's responses: groups of 1-8 in a shuffled order (group ids are not adjacent), scores
    from a few levels so that some groups are all equal, response lengths 1..T (padded rows), and
    the outcome score on each response's last token, as grpo.py places it."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(min_group, 9, (10,), generator=g).tolist()
    sizes[3] = max(sizes[3], 3)
    group_ids = torch.tensor([i for i, size in enumerate(sizes) for _ in range(size)])
    group_ids = group_ids[torch.randperm(len(group_ids), generator=g)]
    B = len(group_ids)
    levels = torch.tensor([0.0, 0.25, 0.5, 1.0])
    scores = levels[torch.randint(0, 4, (B,), generator=g)]
    scores[group_ids == 3] = 0.5  # an all-equal group
    scores = scores + 0.1 * torch.randn(B, generator=g) * (group_ids % 2 == 0)
    if bf16:
        scores = scores.to(torch.bfloat16).float()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    token_level_rewards = torch.zeros(B, T)
    token_level_rewards[torch.arange(B), lengths - 1] = scores
    baselines = levels[torch.randint(0, 4, (int(group_ids.max()) + 1,), generator=g)][group_ids]
    return scores, group_ids, lengths, mask, token_level_rewards, baselines


def verl_advantages(name, token_level_rewards, mask, group_ids, baselines, norm_by_std):
    function = VERL[VERL_ESTIMATORS[name]]
    index = group_ids.numpy()
    if name in ("grpo", "gdpo"):  # gdpo without its components: one, the score
        return function(
            token_level_rewards.clone(), mask, index, norm_adv_by_std_in_grpo=norm_by_std
        )[0]
    if name == "reinforce_plus_plus":
        return function(token_level_rewards.clone(), mask, config=types.SimpleNamespace(gamma=1.0))[
            0
        ]
    if name == "remax":
        return function(token_level_rewards.clone(), baselines, mask)[0]
    if name == "grpo_passk":
        config = {"norm_adv_by_std_in_grpo": norm_by_std}
        return function(token_level_rewards.clone(), mask, index, config=config)[0]
    return function(token_level_rewards.clone(), mask, index, config=None)[0]


def verl_gdpo(components, mask, group_ids, norm_by_std, names=("format", "answer")):
    """verl's GDPO with its per-component inputs as its trainer passes them: the component scores
    in non_tensor_batch under algorithm.gdpo_reward_keys, placed on each response's last token
    (from the attention mask after a 3-token prompt)."""
    B = len(components)
    batch = {
        "prompts": torch.zeros(B, 3, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(B, 3), mask], dim=1).long(),
    }
    non_tensor_batch = {name: components[:, k].numpy() for k, name in enumerate(names)}
    return VERL[VERL_ESTIMATORS["gdpo"]](
        torch.zeros_like(mask),
        mask,
        group_ids.numpy(),
        norm_adv_by_std_in_grpo=norm_by_std,
        config={"gdpo_reward_keys": list(names)},
        non_tensor_batch=non_tensor_batch,
        batch=batch,
    )[0]


@needs_verl
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("bf16", [False, True])
def test_gdpo_matches_verl_with_two_reward_components(norm_by_std, bf16):
    """GDPO with a format and an answer component against verl 0.9.1's
    compute_gdpo_outcome_advantage, given the components as verl's trainer gives them: groups of
    1-8 shuffled, an all-equal group, padded responses, bf16-rounded scores; then one component
    (scores (B,)) equals GRPO whitened over the tokens. Within advantage_bound of each component,
    summed, then whitened (std about 1)."""
    for seed in range(5):
        scores, group_ids, lengths, mask, _, _ = random_rollout(seed, bf16=bf16)
        g = torch.Generator().manual_seed(seed + 100)
        formats = (torch.rand(len(scores), generator=g) > 0.3).float()
        components = torch.stack([formats, scores], dim=1)
        ours = O.ADV_ESTIMATORS["gdpo"](components, group_ids, lengths, norm_by_std=norm_by_std)
        theirs = verl_gdpo(components, mask, group_ids, norm_by_std)
        bound = sum(advantage_bound(c, group_ids, terms=64) for c in components.unbind(1))
        assert_advantages_close(ours[:, None] * mask, theirs.float(), bound, seed)
    one = O.ADV_ESTIMATORS["gdpo"](scores, group_ids, lengths)
    grpo_then_whiten = O._global_whiten(O.grpo_advantages(scores, group_ids), lengths)
    assert torch.equal(one, grpo_then_whiten)


def test_reward_components_of_the_rule_rewards():
    """GDPO's components: format (an answer the rule can read) and answer (right), which add up to
    what the plain reward gives where it has a format score (Countdown: 0.1 and 1.0)."""
    import tasks

    assert tasks.gsm8k_reward_components("so #### 42", "42") == {"format": 1.0, "answer": 1.0}
    assert tasks.gsm8k_reward_components("so #### 41", "42") == {"format": 1.0, "answer": 0.0}
    assert tasks.gsm8k_reward_components("so 42", "42") == {"format": 0.0, "answer": 0.0}
    assert tasks.gsm8k_reward_components(None, "42") == {"format": 0.0, "answer": 0.0}
    right, wrong = "<answer> (1 + 2) * 3 </answer>", "<answer> 1 + 2 + 3 </answer>"
    assert tasks.countdown_reward_components(right, [1, 2, 3], 9) == {"format": 1.0, "answer": 1.0}
    assert tasks.countdown_reward_components(wrong, [1, 2, 3], 9) == {"format": 1.0, "answer": 0.0}
    assert tasks.countdown_reward_components("9", [1, 2, 3], 9) == {"format": 0.0, "answer": 0.0}
    assert tasks.countdown_reward(right, [1, 2, 3], 9) == 1.0
    assert tasks.countdown_reward(wrong, [1, 2, 3], 9) == 0.1


@needs_verl
@pytest.mark.parametrize("name", OUTCOME_ESTIMATORS)
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("bf16", [False, True])
def test_estimators_match_verl(name, norm_by_std, bf16):
    """objectives.ADV_ESTIMATORS[name] against verl 0.9.1's compute_<name>_outcome_advantage on 5
    random steps each: groups of different sizes (of one too, except pass@k, which needs two) in
    a shuffled order, an all-equal group, padded responses of different lengths, scores rounded
    to bf16. verl's (B, T) advantages must be ours broadcast over each response's tokens, to
    float32 rounding."""
    for seed in range(5):
        min_group = 2 if name == "grpo_passk" else 1
        scores, group_ids, lengths, mask, token_rewards, baselines = random_rollout(
            seed, min_group, bf16=bf16
        )
        ours = O.ADV_ESTIMATORS[name](
            scores, group_ids, lengths, baselines, norm_by_std=norm_by_std
        )
        theirs = verl_advantages(name, token_rewards, mask, group_ids, baselines, norm_by_std)
        assert ours.shape == scores.shape and ours.dtype == torch.float32
        bound = advantage_bound(scores, group_ids, terms=64 if "plus" in name else 16)
        assert_advantages_close(ours[:, None] * mask, theirs.float(), bound, (name, seed))
        if name in ("grpo", "rloo", "opo", "grpo_passk", "gpg"):
            assert (ours[group_ids == 3] == 0).all()  # all-equal group: no signal


def otb_inputs(seed, T=12, bf16=False, rejection=False, is_weights=False):
    """random_rollout's step with what the optimal token baseline also takes from step 3:
    pi_old's logprobs of the sampled tokens, sum_v pi_old(v)^2 (at least pi_old(a)^2, at most 1),
    the mask after a token-level rejection (holes, one response rejected whole) and IS weights."""
    scores, group_ids, lengths, mask, token_rewards, _ = random_rollout(seed, T=T, bf16=bf16)
    g = torch.Generator().manual_seed(seed + 7)
    B = len(scores)
    pi = torch.rand(B, T, generator=g) * 0.98 + 0.01
    sum_sq = pi**2 + (1 - pi) ** 2 * torch.rand(B, T, generator=g)
    old_logprobs = pi.log() * mask
    if rejection:
        mask = mask * (torch.rand(B, T, generator=g) > 0.15).float()
        mask[0] = 0.0
    weights = (torch.rand(B, T, generator=g) * 2).clamp(max=2.0) * mask if is_weights else None
    return scores, group_ids, lengths, mask, token_rewards, old_logprobs, sum_sq, weights


@needs_verl
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("rejection", [False, True])
@pytest.mark.parametrize("is_weights", [False, True])
def test_optimal_token_baseline_matches_verl(bf16, rejection, is_weights):
    """objectives.optimal_token_baseline_advantages against verl 0.9.1's
    compute_optimal_token_baseline_advantage (run from its source) on 5 random steps: groups of
    1-8 shuffled, an all-equal group, padded responses of different lengths (so the longest of a
    group is often alone beyond the second longest: verl's zero tail), bf16-rounded scores, the
    mask after a token-level rejection (verl passes the RS-modified response mask; the reward
    stays on each response's sampled last token) and the IS weights' rho^2 factor."""
    for seed in range(5):
        scores, group_ids, lengths, mask, token_rewards, old, sum_sq, weights = otb_inputs(
            seed, bf16=bf16, rejection=rejection, is_weights=is_weights
        )
        ours = O.optimal_token_baseline_advantages(
            scores, group_ids, lengths, old, sum_sq, mask, weights
        )
        theirs, _ = VERL[VERL_ESTIMATORS["optimal_token_baseline"]](
            token_rewards.clone(),
            mask,
            group_ids.numpy(),
            old_log_probs=old,
            sum_pi_squared=sum_sq,
            rollout_is_weights=weights,
        )
        assert ours.shape == mask.shape and ours.dtype == torch.float32
        # a baseline per token: sums over a group's responses (at most 8) of pi_old's terms, each
        # of at most T = 12 positions
        assert_float32_close(ours, theirs.float(), terms=128, what=seed)
        assert (ours[mask == 0] == 0).all()


def multi_turn_mask(seed, mask, lengths):
    """`mask` with the holes of a multi-turn response: in most responses one or two runs of a
    tool's tokens (mask 0) between model turns, never on the last sampled token."""
    g = torch.Generator().manual_seed(seed + 11)
    mask = mask.clone()
    for i, length in enumerate(lengths.tolist()):
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):
            if length < 4:
                break
            start = int(torch.randint(1, length - 2, (1,), generator=g))
            run = int(torch.randint(1, 3, (1,), generator=g))
            mask[i, start : min(start + run, length - 1)] = 0.0
    return mask


@needs_verl
@pytest.mark.parametrize("rejection", [False, True])
@pytest.mark.parametrize("is_weights", [False, True])
def test_multi_turn_optimal_token_baseline_matches_verl(rejection, is_weights):
    """objectives.tir_optimal_token_baseline_advantages against verl 0.9.1's
    compute_multi_turn_optimal_token_baseline_advantage (run from its source) on 5 random steps:
    otb_inputs' groups, padding and lengths with a tool's tokens cut out of most responses (one
    or two runs of mask 0 between model turns), after a token-level rejection or not, with IS
    weights or not. With no holes it is optimal_token_baseline itself, bit for bit; with holes
    they differ (the k-th model token no longer sits at one position)."""
    for seed in range(5):
        scores, group_ids, lengths, mask, token_rewards, old, sum_sq, weights = otb_inputs(
            seed, rejection=rejection, is_weights=is_weights
        )
        single_turn = O.tir_optimal_token_baseline_advantages(
            scores, group_ids, lengths, old, sum_sq, mask, weights
        )
        if not rejection:
            otb = O.optimal_token_baseline_advantages(
                scores, group_ids, lengths, old, sum_sq, mask, weights
            )
            assert torch.equal(single_turn, otb)
        mask = multi_turn_mask(seed, mask, lengths)
        weights = None if weights is None else weights * mask
        ours = O.tir_optimal_token_baseline_advantages(
            scores, group_ids, lengths, old, sum_sq, mask, weights
        )
        theirs, _ = VERL[VERL_ESTIMATORS["tir_optimal_token_baseline"]](
            token_rewards.clone(),
            mask,
            group_ids.numpy(),
            old_log_probs=old,
            sum_pi_squared=sum_sq,
            rollout_is_weights=weights,
        )
        assert ours.shape == mask.shape and ours.dtype == torch.float32
        assert_float32_close(ours, theirs.float(), terms=128, what=seed)
        assert (ours[mask == 0] == 0).all()
        otb = O.optimal_token_baseline_advantages(
            scores, group_ids, lengths, old, sum_sq, mask, weights
        )
        assert not torch.allclose(ours, otb, atol=1e-4)


def test_optimal_token_baseline_hand_values():
    """One group of two: scores 1 and 0, lengths 2 and 3, pi_old(a_t) and sum_v pi_old(v)^2 given.
    w = 1 - 2 pi + sum pi^2: (0.5, 0.5) and (0.75, 0.5, 0); W = (0.5, 1.0) and (0.75, 1.25, 1.25);
    B_0 = (1 x 0.5 + 0 x 0.75) / 1.25 = 0.4, B_1 = 1.0 / 2.25; beyond the second longest (t = 2)
    the longest response is alone: B = 0. An all-equal group of equal lengths gets exactly 0, for
    scores that are not binary fractions and groups of 16 and 512."""
    pi = torch.tensor([[0.5, 0.5, 1.0], [0.25, 0.5, 1.0]])
    sum_sq = torch.tensor([[0.5, 0.5, 1.0], [0.25, 0.5, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    advantages = O.optimal_token_baseline_advantages(
        torch.tensor([1.0, 0.0]), torch.tensor([4, 4]), torch.tensor([2, 3]), pi.log(), sum_sq, mask
    )
    b1 = 1.0 / 2.25
    expected = torch.tensor([[0.6, 1 - b1, 0.0], [-0.4, -b1, 0.0]])
    assert torch.allclose(advantages, expected, atol=1e-6)
    for value in (0.7, 2.2, 1 / 3):
        for n in (16, 512):
            g = torch.Generator().manual_seed(n)
            pi = torch.rand(n, 5, generator=g) * 0.9 + 0.05
            same = O.optimal_token_baseline_advantages(
                torch.full((n,), value),
                torch.zeros(n, dtype=torch.long),
                torch.full((n,), 5),
                pi.log(),
                pi**2 + 0.01,
                torch.ones(n, 5),
            )
            assert (same == 0.0).all(), (value, n)


def test_sum_pi_squared_comes_from_the_chunked_pass():
    """logprobs.token_logprobs_and_entropy(sum_pi_squared=True): a third output, sum_v p_v^2 of
    softmax(logits / T), chunk by chunk (3 chunks here), equal to the full softmax's; with a
    replayed truncation, of the renormalised distribution over the kept set and the sampled token
    (these random tokens are often outside the top 5); refused with a gradient."""
    import logprobs

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(40, 16, generator=g)
    tokens = torch.randint(0, 50, (40,), generator=g)
    settings = logprobs.LogprobSettings(temperature=0.7, chunk_size=16)
    with torch.no_grad():
        token_logprobs, entropy, sum_sq = logprobs.token_logprobs_and_entropy(
            hidden, tokens, head, settings, sum_pi_squared=True
        )
        p = torch.softmax(head(hidden) / 0.7, -1)
        assert_float32_close(sum_sq, (p * p).sum(-1), terms=50)  # a sum over the 50 tokens
        plain = logprobs.token_logprobs_and_entropy(hidden, tokens, head, settings)
        assert torch.equal(plain[0], token_logprobs) and torch.equal(plain[1], entropy)
        truncation = (5, 1.0, 0.0, "hf")
        _, _, kept_sq = logprobs.token_logprobs_and_entropy(
            hidden,
            tokens,
            head,
            logprobs.LogprobSettings(temperature=0.7, chunk_size=16, truncation=truncation),
            sum_pi_squared=True,
        )
        z = head(hidden) / 0.7
        kept = logprobs.truncation_mask(z, *truncation)
        kept[torch.arange(40), tokens] = True
        p_kept = torch.softmax(z.masked_fill(~kept, -math.inf), -1)
        assert_float32_close(kept_sq, (p_kept * p_kept).sum(-1), terms=50)
    with pytest.raises(ValueError, match="without a gradient"):
        logprobs.token_logprobs_and_entropy(hidden, tokens, head, settings, sum_pi_squared=True)


def test_optimal_token_baseline_refuses_what_it_cannot_run():
    """In one line, before any model loads: a bypass correction (verl computes sum_v pi^2 in the
    pi_old recompute that bypass skips, and asserts) and the off-policy sequence mask (it keeps a
    sequence by the sign of one advantage; OTB's are per token)."""
    base = dataclasses.replace(grpo.PRESETS["tiny"][1], adv_estimator="optimal_token_baseline")
    with pytest.raises(ValueError, match="--correction must be a decoupled preset"):
        grpo.check_args(dataclasses.replace(base, correction="bypass_ppo_clip"))
    with pytest.raises(ValueError, match="--off-policy-mask-threshold must be None"):
        grpo.check_args(dataclasses.replace(base, off_policy_mask_threshold=0.5))
    grpo.check_args(base)


def test_estimators_hand_values():
    """One group {1, 0, 0.5} (lengths 2, 4, 2) and a group of one (score 0.3, length 4)."""
    scores = torch.tensor([1.0, 0.0, 0.5, 0.3])
    ids = torch.tensor([5, 5, 5, 9])
    lengths = torch.tensor([2, 4, 2, 4])
    baselines = torch.tensor([0.5, 0.5, 0.5, 1.0])
    get = O.ADV_ESTIMATORS
    # RLOO: the mean of the other two; a group of one keeps its score
    assert get["rloo"](scores, ids, lengths).tolist() == pytest.approx([0.75, -0.75, 0.0, 0.3])
    # OPO: baseline (2*1 + 4*0 + 2*0.5) / 8 = 0.375
    assert get["opo"](scores, ids, lengths).tolist() == pytest.approx([0.625, -0.375, 0.125, 0.3])
    # ReMax: score - the greedy answer's score
    assert get["remax"](scores, ids, lengths, baselines).tolist() == pytest.approx(
        [0.5, -0.5, 0.0, -0.7]
    )
    # pass@k: only the best of the group moves, by (1 - 0.5) / std = 0.5 / 0.5
    passk = get["grpo_passk"](scores[:3], ids[:3], lengths[:3])
    assert passk.tolist() == pytest.approx([1.0, 0.0, 0.0], abs=1e-5)
    # REINFORCE++: whitened over 12 tokens, each response once per token
    token_scores = torch.tensor([1.0] * 2 + [0.0] * 4 + [0.5] * 2 + [0.3] * 4)
    mean, std = token_scores.mean(), token_scores.std()
    expected = (scores - mean) / torch.sqrt(std**2 + 1e-8)
    assert torch.allclose(get["reinforce_plus_plus"](scores, ids, lengths), expected, atol=1e-6)
    # REINFORCE++-baseline: centred in the group first (the group of one: mean 0)
    centred = torch.tensor([0.5] * 2 + [-0.5] * 4 + [0.0] * 2 + [0.3] * 4)
    expected = (torch.tensor([0.5, -0.5, 0.0, 0.3]) - centred.mean()) / centred.std()
    out = get["reinforce_plus_plus_baseline"](scores, ids, lengths)
    assert torch.allclose(out, expected, atol=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        get["grpo_passk"](scores, ids, lengths)


@pytest.mark.parametrize("name", [n for n in O.ADV_ESTIMATORS if n != "grpo"])
def test_every_estimator_runs_grpo_tiny(tmp_path, name):
    """`grpo.py tiny --adv-estimator NAME` on a small batch for 3 steps: every step logs finite
    metrics and the weights move (ReMax generates its greedy baseline answers in the step). The
    logged samples (4 of the first prompt's group) carry the estimator's advantages: RLOO's
    differences are n / (n - 1) times the scores'; pass@k's at most one non-zero."""
    args = dataclasses.replace(
        grpo.PRESETS["tiny"][1],
        cuda=False,
        output_dir=str(tmp_path),
        adv_estimator=name,
        train_batch_size=8,
        ppo_mini_batch_size=4,
        rollout_n=8,
        total_steps=3,
        val_every=0,
        save_every=0,
        log_samples_every=1,
    )
    metrics_path = grpo.train(args)
    rows = [json.loads(line) for line in open(metrics_path)]
    rows = [r for r in rows if "reward/mean" in r]
    assert len(rows) == 3
    for row in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/advantages/mean", "reward/mean"):
            assert math.isfinite(row[key]), (key, row)
    assert any(row["actor/grad_norm"] > 0 for row in rows)
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    for step in (1, 2, 3):
        group = [r for r in samples if r["step"] == step][:4]
        scores = [r["score"] for r in group]
        advantages = [r["advantage"] for r in group]
        if name == "rloo":
            assert advantages[0] - advantages[1] == pytest.approx(
                (scores[0] - scores[1]) * 8 / 7, abs=1e-6
            )
        if name == "grpo_passk":
            assert sum(a != 0 for a in advantages) <= 1
        if name == "remax":  # score - the greedy answer's score: one baseline per prompt
            assert len({round(a - s, 6) for s, a in zip(scores, advantages)}) == 1


def test_whitening_estimators_use_the_whole_batch_over_two_ranks(tmp_path):
    """REINFORCE++ (and its baseline variant) whiten over every response token of the batch: two
    gloo processes holding half a batch each give the advantages one process gives for the whole
    batch, to the rounding of sums all-reduced in another order (256 eps32 of the largest; local
    statistics would be off by more than 1e-3) (tests/objective_ranks.py)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [os.path.join(root, "tests", "objective_ranks.py"), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    sys.path.insert(0, os.path.join(root, "tests"))
    from objective_ranks import whole_batch

    scores, group_ids, lengths = whole_batch()
    reports = [json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1)]
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        two_ranks = torch.tensor(reports[0][name] + reports[1][name])
        one_rank = O.ADV_ESTIMATORS[name](scores, group_ids, lengths)
        # the same whitening, its sums all-reduced over two ranks (16 + 16 rows): rounding only
        assert_float32_close(two_ranks, one_rank, terms=256, what=name)
        halves = O.ADV_ESTIMATORS[name](scores[:16], group_ids[:16], lengths[:16])
        assert not torch.allclose(halves, one_rank[:16], atol=1e-3)  # local stats would differ


# the estimators whose baseline is a statistic of the response's own group
GROUP_BASELINE_ESTIMATORS = ("grpo", "rloo", "opo", "grpo_passk", "gpg")


@pytest.mark.parametrize("value", [0.7, 0.1, 2.2, 1 / 3])
def test_all_equal_groups_give_exactly_zero_and_are_filtered(value):
    """A group whose scores are all equal carries no signal: every group-baseline estimator gives
    it advantage exactly 0.0 (GRPO and Dr.GRPO too) for scores that are not binary fractions and
    groups of 2 to 512, where a float32 group mean rounds (verl's GRPO: +-0.06 for 16 x 0.7), and
    DAPO's filter drops it. A group of the same size whose scores differ is unchanged: equal to
    verl's advantages to float32 rounding."""
    for n in (2, 3, 5, 16, 64, 100, 512):
        same = torch.full((n,), value)
        mixed = same.clone()
        mixed[0] = value + 0.5
        scores = torch.cat([same, mixed])
        group_ids = torch.tensor([0] * n + [1] * n)
        lengths = torch.arange(2 * n) % 7 + 1
        for name in GROUP_BASELINE_ESTIMATORS:
            for norm_by_std in (True, False):
                advantages = O.ADV_ESTIMATORS[name](
                    scores, group_ids, lengths, norm_by_std=norm_by_std
                )
                assert (advantages[:n] == 0.0).all(), (name, value, n, advantages[:n].abs().max())
                if VERL is not None:
                    T = int(lengths.max())
                    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
                    token_rewards = torch.zeros(2 * n, T)
                    token_rewards[torch.arange(2 * n), lengths - 1] = scores
                    theirs = verl_advantages(
                        name, token_rewards, mask, group_ids, None, norm_by_std
                    )
                    # verl's loop estimators take each group's torch.mean; ours sums with
                    # index_add, as verl's vectorised GRPO does (below). The two orders round the
                    # mean differently in the last bits, which the std divides: at most 6.7e-6 of
                    # the largest advantage (groups of 512 scores near 2.2), within 1e-6 up to 16
                    difference = (advantages[n:, None] * mask[n:] - theirs[n:].float()).abs()
                    assert difference.max() <= 1e-5 * theirs[n:].abs().max(), (name, value, n)
                    if name == "grpo":
                        # verl's GRPO_VECTORIZED: the same sums, so the same advantages, bit for
                        # bit, and the same gap to verl's loop GRPO as ours
                        vectorised = VERL["compute_grpo_vectorized_outcome_advantage"](
                            token_rewards.clone(),
                            mask,
                            group_ids.numpy(),
                            norm_adv_by_std_in_grpo=norm_by_std,
                        )[0]
                        assert torch.equal(advantages[n:, None] * mask[n:], vectorised[n:])
        assert not grpo.has_reward_signal(same.tolist())
        assert grpo.has_reward_signal(mixed.tolist())


# the estimators whose advantages depend on which tokens the mask keeps (lengths or whitening)
LENGTH_DEPENDENT = ("opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo")


class VerlConfig(dict):
    """verl's AlgoConfig as its estimators read it: config.gamma and config.get(...)."""

    __getattr__ = dict.__getitem__


class VerlBatch:
    """The parts of verl's DataProto that its trainer's correction and compute_advantage use."""

    def __init__(self, batch, non_tensor_batch=None):
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch or {}

    @classmethod
    def from_dict(cls, tensors):
        return cls(dict(tensors))

    def union(self, other):
        self.batch.update(other.batch)
        return self


def _load_verl_trainer_order():
    """verl 0.9.1's fit-loop steps after the recompute, run from its source: the rollout correction
    (trainer/ppo/rollout_corr_helper.py compute_rollout_correction_and_add_to_batch, which replaces
    response_mask with the rejected one) and compute_advantage (trainer/ppo/ray_trainer.py)."""
    if VERL is None:
        return None
    root = verl_root()
    ns = dict(VERL, DataProto=VerlBatch, RolloutCorrectionConfig=Any, math=math)
    helpers = {
        "_parse_rollout_is_threshold",
        "_parse_rollout_rs_thresholds",
        "compute_rollout_rejection_mask",
        "compute_rs_metrics",
        "compute_rollout_correction_weights",
        "compute_is_metrics",
        "compute_offpolicy_metrics",
        "compute_rollout_correction_and_rejection_mask",
        "compute_rollout_correction_and_add_to_batch",
    }
    load_functions(root, "trainer/ppo/rollout_corr_helper.py", helpers, ns, keep_assignments=True)
    load_functions(root, "utils/debug/metrics.py", {"calculate_log_prob_diff"}, ns)
    estimators = {name: VERL[function] for name, function in VERL_ESTIMATORS.items()}
    ns["core_algos"] = types.SimpleNamespace(
        compute_grpo_outcome_advantage=VERL["compute_grpo_outcome_advantage"],
        get_adv_estimator_fn=estimators.__getitem__,
    )
    ns["AdvantageEstimator"] = types.SimpleNamespace(
        GAE="gae",
        GRPO="grpo",
        GDPO="gdpo",
        OPTIMAL_TOKEN_BASELINE="optimal_token_baseline",
        TIR_OPTIMAL_TOKEN_BASELINE="tir_optimal_token_baseline",
    )
    ns["AlgoConfig"] = Any
    ns["compute_response_mask"] = None  # the batch has its response_mask
    load_functions(root, "trainer/ppo/ray_trainer.py", {"compute_advantage"}, ns)
    return ns


VERL_TRAINER = _load_verl_trainer_order()


def test_opo_counts_the_tokens_the_rejection_keeps():
    """The example of the change to verl's order: one group with lengths [4, 2, 1, 3], scores
    [1, 0, 1, 0] and 3 of response 0's tokens rejected. OPO's baseline is the kept-length-weighted
    mean score, (1 x 1 + 1 x 1) / (1 + 2 + 1 + 3) = 2/7, so the advantages are [5/7, -2/7, 5/7,
    -2/7] (with the sampled lengths: 5/10, [0.5, -0.5, 0.5, -0.5], what grpo.py computed before
    it corrected first)."""
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    kept = torch.tensor([1, 2, 1, 3])
    advantages = O.opo_advantages(scores, [0, 0, 0, 0], kept)
    assert torch.allclose(advantages, torch.tensor([5.0, -2.0, 5.0, -2.0]) / 7)
    sampled = O.opo_advantages(scores, [0, 0, 0, 0], torch.tensor([4, 2, 1, 3]))
    assert torch.allclose(sampled, torch.tensor([0.5, -0.5, 0.5, -0.5]))


@needs_verl
@pytest.mark.parametrize("name", LENGTH_DEPENDENT)
def test_advantages_follow_verls_trainer_order_under_rejection(tmp_path, monkeypatch, name):
    """grpo.py corrects before it computes the advantages, as verl 0.9.1's fit loop does. A step of
    `grpo.py tiny --correction decoupled_geo_rs_seq_tis --mismatch int8` (int8 rollouts: Geo-RS rejects
    some responses whole) with a length-dependent estimator: the advantages update_policy receives,
    over the mask it receives, equal what verl's trainer computes from the same step's pi_old and
    pi_rollout, run from its source: compute_rollout_correction_and_add_to_batch (its rejected
    response_mask equals ours), then compute_advantage reading that mask (the score on each
    response's sampled last token, GDPO's one component in non_tensor_batch). Computed from the
    sampled lengths instead, they differ."""
    captured = {}
    real_update, real_score = grpo.update_policy, grpo.score_responses

    def update(model, optimizer, batch, *rest, **kwargs):
        captured["batch"] = {k: v.clone() for k, v in batch.items()}
        return real_update(model, optimizer, batch, *rest, **kwargs)

    def score(*args, **kwargs):
        captured["scores"] = real_score(*args, **kwargs)
        return captured["scores"]

    monkeypatch.setattr(grpo, "update_policy", update)
    monkeypatch.setattr(grpo, "score_responses", score)
    args = dataclasses.replace(
        grpo.PRESETS["tiny"][1],
        cuda=False,
        output_dir=str(tmp_path),
        adv_estimator=name,
        correction="decoupled_geo_rs_seq_tis",
        mismatch="int8",
        rollout_n=8,
        train_batch_size=8,
        ppo_mini_batch_size=4,
        total_steps=1,
        val_every=0,
        log_samples_every=0,
    )
    grpo.train(args)
    batch, scores = captured["batch"], captured["scores"]
    response_mask = batch["response_mask"]
    lengths = response_mask.sum(-1).long()
    kept = batch["loss_mask"].sum(-1)
    assert 0 < int((kept == 0).sum()) < len(kept)  # some responses rejected, not all

    B, R = response_mask.shape
    P = batch["input_ids"].shape[1] - R
    token_level_rewards = torch.zeros(B, R)
    token_level_rewards[torch.arange(B), lengths - 1] = scores
    verl_batch = VerlBatch(
        {
            "old_log_probs": batch["old_logprobs"],
            "rollout_log_probs": batch["rollout_logprobs"],
            "response_mask": response_mask.clone(),
            "token_level_rewards": token_level_rewards,
            "prompts": batch["input_ids"][:, :P],
            "attention_mask": batch["attention_mask"],
        },
        {
            "uid": torch.arange(B // 8).repeat_interleave(8).numpy(),
            "reward": scores.numpy(),
        },
    )
    rollout_corr = corrections.PRESET_SETTINGS["decoupled_geo_rs_seq_tis"]
    verl_batch, _ = VERL_TRAINER["compute_rollout_correction_and_add_to_batch"](
        verl_batch, rollout_corr
    )
    assert torch.equal(verl_batch.batch["response_mask"], batch["loss_mask"])
    config = VerlConfig(gamma=1.0, norm_adv_by_std_in_grpo=True, gdpo_reward_keys=["reward"])
    verl_batch = VERL_TRAINER["compute_advantage"](
        verl_batch, name, gamma=1.0, lam=1.0, num_repeat=8, config=config
    )
    theirs = verl_batch.batch["advantages"]
    ours = batch["advantages"][:, None] * batch["loss_mask"]
    bound = advantage_bound(scores, torch.arange(B // 8).repeat_interleave(8), terms=64)
    assert_advantages_close(ours, theirs.float(), bound, name)
    # from the sampled lengths (the order before): not verl's
    group_ids = torch.arange(B // 8).repeat_interleave(8)
    before = O.ADV_ESTIMATORS[name](scores, group_ids, lengths)
    assert not torch.allclose(before[:, None] * batch["loss_mask"], theirs.float(), atol=1e-4)
