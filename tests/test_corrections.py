"""corrections.py: hand-computed values, parity with verl 0.9.1's own source, gradients, and padding
properties."""

import math
import types
from typing import Any, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl_source import load_functions, verl_root

import corrections as C
import objectives as O


@pytest.fixture(autouse=True)
def float64_default():
    """Hand-computed values below are exact in float64; restore the default so other test files are
    unaffected."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# ---------------------------------------------------------------------------------------------------------------
# verl 0.9.1 as the trusted reference. scripts/setup_cpu.sh unpacks its wheel (tests/verl_source.py);
# importing verl would pull ray, so we parse the functions we need out of its source files and run
# them with their own helpers.
# ---------------------------------------------------------------------------------------------------------------


class VerlActorConfig(types.SimpleNamespace):
    """Stands in for verl's ActorConfig (gspo and cispo assert isinstance(config, ActorConfig);
    DPPO reads clip_ratio_c with config.get)."""

    def get(self, key, default=None):
        return getattr(self, key, default)


def _load_verl():
    root = verl_root()
    if root is None:
        return None

    def extract(relpath, names, namespace):
        # rollout_corr_helper.py's functions read its SAFETY_BOUND and option sets
        constants = relpath.endswith("rollout_corr_helper.py")
        return load_functions(root, relpath, names, namespace, keep_assignments=constants)

    base = {
        "torch": torch,
        "math": math,
        "Optional": Optional,
        "Any": Any,
        "ActorConfig": VerlActorConfig,
        "DictConfig": Any,
        "DataProto": Any,
        "RolloutCorrectionConfig": Any,
        "PolicyLossConfig": Any,
    }
    verl_F = types.SimpleNamespace(
        **{
            k: v
            for k, v in extract(
                "utils/torch_functional.py", {"masked_sum", "masked_mean"}, dict(base)
            ).items()
            if k in ("masked_sum", "masked_mean")
        }
    )
    ns = dict(base, verl_F=verl_F)
    extract(
        "trainer/ppo/rollout_corr_helper.py",
        {
            "_parse_rollout_is_threshold",
            "_parse_rollout_rs_thresholds",
            "compute_rollout_rejection_mask",
            "compute_rs_metrics",
            "compute_rollout_correction_weights",
            "compute_is_metrics",
            "compute_offpolicy_metrics",
        },
        ns,
    )
    extract(
        "trainer/ppo/core_algos.py",
        {
            "agg_loss",
            "compute_policy_loss_vanilla",
            "compute_policy_loss_gspo",
            "compute_policy_loss_cispo",
            "compute_policy_loss_gpg",
            "compute_policy_loss_sapo",
            "compute_policy_loss_clip_cov",
            "compute_policy_loss_geo_mean",
            "compute_policy_loss_kl_cov",
            "compute_policy_loss_dppo_tv",
            "compute_policy_loss_dppo_kl",
            "compute_policy_loss_dro",
            "kl_penalty_forward",
            "kl_penalty",
        },
        ns,
    )
    extract(
        "utils/debug/metrics.py", {"pearson_correlation_coefficient", "calculate_log_prob_diff"}, ns
    )
    ns["AlgoConfig"] = type("AlgoConfig", (), {})
    return ns


VERL = _load_verl()
needs_verl = pytest.mark.skipif(
    VERL is None, reason="no verl source (scripts/setup_cpu.sh unpacks it)"
)


def random_batch(B=6, T=9, scale=0.3, seed=0, empty_rows=False):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 3
    train = rollout + torch.randn(B, T, generator=g) * scale
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    if empty_rows:
        mask[0] = 0
    return train, rollout, mask


def close(t, expected, atol=1e-9):
    return torch.allclose(t.double(), torch.tensor(expected, dtype=torch.float64), atol=atol)


def assert_metrics_match(ours, theirs, prefix="", atol=1e-6):
    for key, value in theirs.items():
        mine = ours[prefix + key]
        assert float(mine) == pytest.approx(float(value), abs=atol, rel=1e-6), key


# ---------------------------------------------------------------------------------------------------------------
# 1. masked reductions
# ---------------------------------------------------------------------------------------------------------------


def test_masked_reductions_hand_values_and_nan_padding():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    assert C.masked_sum(x, mask).item() == 13.0
    assert C.masked_mean(x, mask).item() == 13.0 / 4
    assert C.masked_mean(x, mask, dim=-1).tolist() == [1.5, 5.0, 0.0]  # all-padding row -> 0
    assert C.masked_sum(x, mask, dim=-1).tolist() == [3.0, 10.0, 0.0]
    assert C.masked_var(x, mask, unbiased=False).item() == pytest.approx(
        ((1 - 3.25) ** 2 + (2 - 3.25) ** 2 + (4 - 3.25) ** 2 + (6 - 3.25) ** 2) / 4
    )
    assert C.masked_var(x, mask).item() == pytest.approx(
        ((1 - 3.25) ** 2 + (2 - 3.25) ** 2 + (4 - 3.25) ** 2 + (6 - 3.25) ** 2) / 3
    )
    white = C.masked_whiten(x, mask, shift_mean=False)
    assert torch.isfinite(white).all() and white[0, 2] == 0
    assert C.masked_mean(white, mask).item() == pytest.approx(3.25)  # mean kept
    assert C.masked_mean(C.masked_whiten(x, mask), mask).item() == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# 2. divergences and KL penalties
# ---------------------------------------------------------------------------------------------------------------


def test_token_divergences_and_kl_penalty_hand_values():
    lr = torch.tensor([0.0, math.log(2.0), -100.0])
    k1, k2, k3 = C.token_divergences(lr)
    assert k1.tolist() == pytest.approx([0.0, -math.log(2), 20.0])  # clamped at the safety bound
    assert k2.tolist() == pytest.approx([0.0, 0.5 * math.log(2) ** 2, 200.0])
    assert k3.tolist() == pytest.approx([0.0, 1 - math.log(2), math.exp(-20) - 1 + 20])
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert O.kl_penalty(lp, ref, "k1").tolist() == [0.5, -1.0]
    assert O.kl_penalty(lp, ref, "abs").tolist() == [0.5, 1.0]
    assert O.kl_penalty(lp, ref, "mse").tolist() == [0.125, 0.5]
    assert O.kl_penalty(lp, ref, "low_var_kl").tolist() == pytest.approx(
        [math.exp(-0.5) - 1 + 0.5, math.exp(1) - 1 - 1]
    )
    with pytest.raises(ValueError, match="kl penalty kind"):
        O.kl_penalty(lp, ref, "k4")


@needs_verl
@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_penalty_matches_verl(kind):
    train, rollout, _ = random_batch(scale=1.0)
    assert torch.allclose(
        O.kl_penalty(train, rollout, kind),
        VERL["kl_penalty_forward"](train, rollout, kind),
        atol=1e-12,
    )


def test_straight_through_kl_has_the_estimators_value_and_k2s_gradient():
    """ "k3+": the k3 value, the gradient of 0.5 d^2, i.e. d (hand values, d = logprobs - ref)."""
    ref = torch.tensor([-1.5, -1.0])
    for kind, value in [
        ("k3+", [math.exp(-0.5) - 1 + 0.5, math.exp(1) - 1 - 1]),
        ("k1+", [0.5, -1.0]),
    ]:
        lp = torch.tensor([-1.0, -2.0], requires_grad=True)
        kl = O.kl_penalty(lp, ref, kind)
        assert kl.tolist() == pytest.approx(value)
        kl.sum().backward()
        assert lp.grad.tolist() == pytest.approx([0.5, -1.0])
    with pytest.raises(ValueError, match="kl penalty kind"):
        O.kl_penalty(lp, ref, "k4+")


@needs_verl
@pytest.mark.parametrize("kind", ["k1+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+", "low_var_kl"])
def test_kl_penalty_values_and_gradients_match_verl(kind):
    train, rollout, _ = random_batch(scale=1.0)
    ours_input = train.clone().requires_grad_(True)
    verl_input = train.clone().requires_grad_(True)
    ours = O.kl_penalty(ours_input, rollout, kind)
    theirs = VERL["kl_penalty"](verl_input, rollout, kind)
    assert torch.allclose(ours, theirs, atol=1e-12)
    upstream = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1), dtype=ours.dtype)
    (ours * upstream).sum().backward()
    (theirs * upstream).sum().backward()
    assert torch.allclose(ours_input.grad, verl_input.grad, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# 3. IS weights
# ---------------------------------------------------------------------------------------------------------------


def test_is_weights_hand_values():
    log_ratio = torch.log(torch.tensor([[0.5, 3.0, 1.0], [1.5, 1.2, 9.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    w, _ = C.compute_is_weights(log_ratio, mask, "token", 2.0)
    assert close(w, [[0.5, 2.0, 1.0], [1.5, 1.2, 0.0]])  # truncated at 2, 0 on padding
    w, _ = C.compute_is_weights(log_ratio, mask, "sequence", 2.0)
    assert close(w, [[1.5, 1.5, 1.5], [1.8, 1.8, 0.0]])  # 0.5*3*1 and 1.5*1.2
    w, _ = C.compute_is_weights(log_ratio, mask, "sequence", 1.6)
    assert close(w, [[1.5, 1.5, 1.5], [1.6, 1.6, 0.0]])
    # IcePop: outside the band -> 0
    w, m = C.compute_is_weights(log_ratio, mask, "token", "0.8_2.0")
    assert close(w, [[0.0, 0.0, 1.0], [1.5, 1.2, 0.0]])
    assert m["rollout_is_oob_ratio"].item() == pytest.approx(2 / 5)
    w, m = C.compute_is_weights(log_ratio, mask, "token", 2.0, batch_normalize=True)
    assert C.masked_mean(w, mask).item() == pytest.approx(1.0)
    assert m["rollout_is_batch_norm_factor"].item() == pytest.approx((0.5 + 2 + 1 + 1.5 + 1.2) / 5)
    w, m = C.compute_is_weights(log_ratio, mask, "sequence", 2.0, batch_normalize=True)
    # over sequences
    assert ((1.5 + 1.8) / 2) == pytest.approx(m["rollout_is_batch_norm_factor"].item())
    assert w[0, 0].item() == pytest.approx(1.5 / 1.65)


def test_is_weight_is_a_stop_gradient():
    """autograd through the REINFORCE term times the IS weights (as the trainers apply them) gives
    w * grad log pi, without the log pi * grad w term."""
    logprobs = torch.tensor([[-0.7, -1.2]], requires_grad=True)
    rollout = torch.tensor([[-0.9, -1.0]])
    adv, mask = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)
    w, _ = C.compute_is_weights(logprobs - rollout, mask, "token", 5.0)
    token_losses, _ = O.reinforce_token_loss(logprobs, adv, mask)
    loss = O.agg_loss(token_losses * w, mask, "token-sum")
    loss.backward()
    # d/dlogp of -w * A * logp with w constant
    expected = -(torch.exp(logprobs.detach() - rollout) * adv)
    assert torch.allclose(logprobs.grad, expected)
    # the naive version (no detach) would differ: it adds -A * logp * w
    naive_grad = expected - adv * logprobs.detach() * torch.exp(logprobs.detach() - rollout)
    assert not torch.allclose(logprobs.grad, naive_grad)


@needs_verl
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.1, "0.8_1.25"])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_match_verl(level, threshold, normalize):
    train, rollout, mask = random_batch(scale=0.4, seed=3)
    ours, ours_m = C.compute_is_weights(train - rollout, mask, level, threshold, normalize)
    theirs, theirs_m = VERL["compute_rollout_correction_weights"](
        train - rollout, mask, level, threshold, normalize
    )
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert_metrics_match(ours_m, theirs_m)


@needs_verl
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [math.inf, "inf"])
def test_infinite_is_threshold_is_vanilla_is_and_matches_verl(level, threshold):
    # large ratios: any truncation would show
    train, rollout, mask = random_batch(scale=1.0, seed=3)
    ours, ours_m = C.compute_is_weights(train - rollout, mask, level, threshold)
    raw = (
        torch.exp(train - rollout)
        if level == "token"
        else torch.exp(C.masked_sum(train - rollout, mask, dim=-1))[:, None].expand_as(mask)
    )
    assert raw[mask.bool()].max() > 5  # far above a usual C = 2
    assert torch.allclose(ours, torch.where(mask.bool(), raw, torch.zeros(())), rtol=1e-12)
    theirs, theirs_m = VERL["compute_rollout_correction_weights"](
        train - rollout, mask, level, threshold
    )
    assert torch.allclose(ours, theirs, rtol=1e-6)
    assert_metrics_match(ours_m, theirs_m)
    assert (
        C.RolloutCorrection.from_name("decoupled_token_vanilla_is").rollout_is_threshold == math.inf
    )


@pytest.mark.parametrize("threshold", ["nan", "-inf", "inf_inf", 0.0])
def test_is_threshold_still_refuses_nonsense(threshold):
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        C.parse_is_threshold(threshold)


# ---------------------------------------------------------------------------------------------------------------
# 4. rejection masks
# ---------------------------------------------------------------------------------------------------------------


def test_rejection_hand_values():
    rho = torch.tensor([[1.0, 3.0, 1.0], [1.1, 0.9, 1.0], [0.2, 1.0, 1.0]])
    log_ratio, mask = torch.log(rho), torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    m, metrics = C.rejection_mask(log_ratio, mask, "token_k1", 2.0)  # keep 0.5 <= rho <= 2
    assert m.tolist() == [[1, 0, 1], [1, 1, 1], [0, 1, 0]]
    assert metrics["rollout_rs_masked_fraction"].item() == pytest.approx(2 / 8)
    assert metrics["rollout_rs_seq_masked_fraction"].item() == pytest.approx(2 / 3)
    m, _ = C.rejection_mask(log_ratio, mask, "seq_sum_k1", "0.5_2.0")  # products 3, 0.99, 0.2
    assert m.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0]]
    # legacy name of seq_mean_k1: 3^(1/3) fails
    m, _ = C.rejection_mask(log_ratio, mask, "geometric", "0.9_1.1")
    assert m.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0]]
    k3 = torch.expm1(log_ratio) - log_ratio
    # max k3: 3-1-ln3=0.90, 0.0053, 0.2-1-ln0.2=0.81
    m, _ = C.rejection_mask(log_ratio, mask, "seq_max_k3", 0.5)
    assert m.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0]]
    seq_mean_k3 = C.masked_mean(k3, mask, dim=-1)
    # 0.30 vs 0.0035, 0.40
    m, _ = C.rejection_mask(log_ratio, mask, "seq_mean_k3", float(seq_mean_k3[0]) + 1e-9)
    assert m.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 0]]
    m, _ = C.rejection_mask(log_ratio, mask, "token_k2", 0.5 * math.log(0.9) ** 2 + 1e-9)
    assert m.tolist() == [[1, 0, 1], [1, 1, 1], [0, 1, 0]]
    # both must pass
    m, _ = C.rejection_mask(log_ratio, mask, "token_k1,seq_sum_k2", "0.5_2.0,0.02")
    assert m.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0]]


def test_rejection_asymmetric_k1_follows_the_math_document():
    """rho = 2.5 with bounds 0.5_3.0: accepted by C_lower <= rho <= C_upper; verl would test 1/rho =
    0.4 instead."""
    log_ratio, mask = torch.log(torch.tensor([[2.5, 0.4]])), torch.ones(1, 2)
    m, _ = C.rejection_mask(log_ratio, mask, "token_k1", "0.5_3.0")
    assert m.tolist() == [[1, 0]]


@pytest.mark.parametrize(
    "option, threshold, match",
    [
        ("token_k4", 2.0, "unknown option"),
        ("token_k2", "0.5_2.0", "single upper bound"),
        ("token_k1", "2.0_0.5", "lower bound"),
        ("token_k1", -1.0, "positive"),
        ("token_k1", "abc", "rollout_rs_threshold"),
        ("token_k1,seq_mean_k3", "1_2,3,4", "1 or 2"),
        ("seq_mean_k3", None, "required"),
        ("", 1.0, "non-empty"),
    ],
)
def test_rejection_bad_settings_raise(option, threshold, match):
    with pytest.raises(ValueError, match=match):
        C.rejection_mask(torch.zeros(1, 2), torch.ones(1, 2), option, threshold)


@needs_verl
@pytest.mark.parametrize(
    "option, threshold",
    [
        ("token_k1", 1.3),
        ("token_k1", "0.8_1.25"),
        ("seq_sum_k1", "0.8_1.25"),
        ("seq_mean_k1", "0.95_1.0526315789"),
        ("token_k2", 0.02),
        ("token_k3", 0.02),
        ("seq_sum_k2", 0.1),
        ("seq_sum_k3", 0.1),
        ("seq_mean_k2", 0.02),
        ("seq_mean_k3", 0.02),
        ("seq_max_k2", 0.05),
        ("seq_max_k3", 0.05),
        ("token_k1,seq_mean_k3", "0.7_1.4285714286,0.03"),
    ],
)
def test_rejection_masks_and_metrics_match_verl_for_symmetric_bounds(option, threshold):
    """The mask and verl's whole metric set: the same keys, names, signs (k1 = -log rho) and
    values."""
    train, rollout, mask = random_batch(B=16, T=12, scale=0.25, seed=5)
    ours, ours_m = C.rejection_mask(train - rollout, mask, option, threshold)
    theirs, theirs_m = VERL["compute_rollout_rejection_mask"](
        train - rollout, mask, option, threshold
    )
    assert torch.equal(ours.bool(), theirs.bool())
    assert 0 < ours.sum() < mask.sum()  # the case is not trivial
    assert set(ours_m) == set(theirs_m)
    assert_metrics_match(ours_m, theirs_m)
    # not trivially zero: some values are above, some below the bounds
    for name in C.parse_rs_options(option):
        assert theirs_m[f"rollout_rs_{name}_std"] > 0 and theirs_m[f"rollout_rs_{name}_seq_std"] > 0


def test_rejection_k1_metrics_use_the_k1_sign_and_name_high_for_small_rho():
    """k1 = -log rho: a token with rho = 1/3 has k1 = log 3 > log 2, above its upper bound
    ("fraction_high")."""
    log_ratio, mask = torch.log(torch.tensor([[1.0 / 3.0, 1.0, 1.0, 1.0]])), torch.ones(1, 4)
    _, m = C.rejection_mask(log_ratio, mask, "token_k1", 2.0)
    assert m["rollout_rs_token_k1_max"].item() == pytest.approx(math.log(3))
    assert m["rollout_rs_token_k1_mean"].item() == pytest.approx(math.log(3) / 4)
    assert m["rollout_rs_token_k1_fraction_high"].item() == pytest.approx(0.25)
    assert m["rollout_rs_token_k1_fraction_low"].item() == 0.0
    # clamped to log 2
    assert m["rollout_rs_token_k1_std"].item() == pytest.approx(math.sqrt(3) / 4 * math.log(2))


# ---------------------------------------------------------------------------------------------------------------
# 5. veto
# ---------------------------------------------------------------------------------------------------------------


def test_veto_rejects_whole_sequences():
    rho = torch.tensor([[1.0, 1e-5, 1.0], [1.0, 0.5, 1e-6]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the 1e-6 of row 2 is padding: no veto
    m, metrics = C.veto_mask(torch.log(rho), mask, 1e-4)
    assert m.tolist() == [[0, 0, 0], [1, 1, 0]]
    assert metrics["rollout_is_veto_fraction"].item() == 0.5
    assert metrics["rollout_is_catastrophic_token_fraction"].item() == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="veto"):
        C.veto_mask(torch.zeros(1, 1), torch.ones(1, 1), 0.0)


# ---------------------------------------------------------------------------------------------------------------
# 6. diagnostics
# ---------------------------------------------------------------------------------------------------------------


def test_offpolicy_metrics_hand_values():
    train = torch.log(torch.tensor([[0.5, 0.25]]))
    rollout = torch.log(torch.tensor([[0.25, 0.25]]))
    m = C.offpolicy_metrics(train, rollout, torch.ones(1, 2))
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.25)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.125)
    assert m["rollout_corr/kl"] == pytest.approx(-math.log(2) / 2)
    assert m["rollout_corr/chi2_token"] == pytest.approx((4 + 1) / 2 - 1)
    assert m["rollout_corr/chi2_seq"] == pytest.approx(4 - 1)
    assert m["rollout_corr/training_ppl"] == pytest.approx(
        math.exp(-(math.log(0.5) + math.log(0.25)) / 2)
    )


@needs_verl
def test_offpolicy_metrics_match_verl():
    train, rollout, mask = random_batch(B=8, T=10, scale=0.3, seed=11)
    train = train.clamp(max=0)  # real log-probabilities (random_batch's noise can push one above 0)
    ours = C.offpolicy_metrics(train, rollout, mask)
    assert_metrics_match(
        ours, VERL["compute_offpolicy_metrics"](train, rollout, mask), prefix="rollout_corr/"
    )
    # verl utils/debug/metrics.py calculate_debug_metrics, step by step on the same tensors
    valid = mask.bool()
    train_p, rollout_p = torch.exp(train), torch.exp(rollout)
    diff = VERL["calculate_log_prob_diff"](train_p, rollout_p, valid)
    assert ours["training/rollout_probs_diff_max"] == pytest.approx(torch.max(diff).item())
    assert ours["training/rollout_probs_diff_mean"] == pytest.approx(torch.mean(diff).item())
    # unbiased
    assert ours["training/rollout_probs_diff_std"] == pytest.approx(torch.std(diff).item())
    assert ours["training/rollout_actor_probs_pearson_corr"] == pytest.approx(
        VERL["pearson_correlation_coefficient"](train_p, rollout_p, valid)
    )
    assert 0.5 < ours["training/rollout_actor_probs_pearson_corr"] < 1.0
    assert ours["training/rollout_probs_diff_valid"] == 1.0


# ---------------------------------------------------------------------------------------------------------------
# 7. losses and aggregation
# ---------------------------------------------------------------------------------------------------------------


def test_agg_loss_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert O.agg_loss(loss, mask, "token-mean").item() == pytest.approx(18 / 5)
    assert O.agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)
    assert O.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5) / 2)
    assert O.agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(
        (3 + 15) / 2 / 3
    )
    assert O.agg_loss(loss, mask, "token-sum").item() == pytest.approx(18)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        O.agg_loss(loss, mask, "seq-sum")


@needs_verl
@pytest.mark.parametrize("mode", O.AGG_MODES)
def test_agg_loss_matches_verl(mode):
    train, _, mask = random_batch(B=7, T=8, seed=2)
    assert O.agg_loss(train, mask, mode).item() == pytest.approx(
        VERL["agg_loss"](train, mask, mode).item(), abs=1e-6
    )
    # with global_batch_info, as grpo.update_policy calls it: one rank's micro-batch of a global
    # minibatch on 2 ranks (its tokens and sequences counted over both)
    world = dict(dp_size=2, batch_num_tokens=int(mask.sum()) + 11, global_batch_size=16)
    assert O.agg_loss(train, mask, mode, **world).item() == pytest.approx(
        VERL["agg_loss"](train, mask, mode, **world).item(), abs=1e-6
    )


def decoupled_pg_loss(logprobs, old_logprobs, advantages, mask, is_weights=None, mode="token-mean"):
    """The decoupled policy-gradient term as grpo.update_policy and ppo_rlhf.update_policy compose it
    from corrections.py: the clipped surrogate (clip 0.2 / 0.28, dual-clip 3), times the IS weights,
    aggregated over the mask."""
    losses, metrics = O.ppo_clip_token_loss(
        logprobs, old_logprobs, advantages, mask, 0.2, 0.28, 3.0
    )
    if is_weights is not None:
        losses = losses * is_weights
    return O.agg_loss(losses, mask, mode), metrics


def test_ppo_clip_token_loss_hand_values():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    losses, m = O.ppo_clip_token_loss(new, old, adv, torch.ones(1, 4), 0.2, 0.28, clip_c=3.0)
    # token 1: max(-1.5, -1.28) = -1.28 (clipped); 2: max(-0.5, -0.8) = -0.5; 3: max(1.1, 1.1) =
    # 1.1; 4: max(5, 1.28) = 5 -> dual-clip min(5, 3) = 3
    assert losses[0].tolist() == pytest.approx([-1.28, -0.5, 1.1, 3.0])
    assert m["pg_clipfrac"] == pytest.approx(1 / 4)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 4)
    # the IS weights multiply after clipping
    w = torch.tensor([[2.0, 1.0, 1.0, 0.5]])
    loss_w, _ = decoupled_pg_loss(new, old, adv, torch.ones(1, 4), w, "token-sum")
    assert loss_w.item() == pytest.approx(-2.56 - 0.5 + 1.1 + 1.5)
    # the anchor decides what is clipped: against pi_rollout (bypass) r = e is clipped, no gradient
    lp = torch.zeros(1, 2, requires_grad=True)
    rollout = torch.full((1, 2), -1.0)
    losses, _ = O.ppo_clip_token_loss(lp, rollout, torch.ones(1, 2), torch.ones(1, 2))
    losses.sum().backward()
    assert losses[0].tolist() == pytest.approx([-1.2, -1.2]) and torch.all(lp.grad == 0)


@needs_verl
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_ppo_clip_loss_matches_verl(mode):
    train, rollout, mask = random_batch(B=8, T=10, scale=0.4, seed=9)
    adv = torch.randn(8, 10, generator=torch.Generator().manual_seed(1))
    w, _ = C.compute_is_weights(train - rollout, mask, "token", 2.0)
    config = types.SimpleNamespace(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        global_batch_info={},
        get=lambda key, default: 3.0,
    )
    theirs, theirs_m = VERL["compute_policy_loss_vanilla"](
        rollout, train, adv, mask, mode, config, w
    )
    ours, ours_m = decoupled_pg_loss(train, rollout, adv, mask, w, mode)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6)
    for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        assert ours_m[key] == pytest.approx(theirs_m[f"actor/{key}"], abs=1e-6)


def assert_loss_matches_verl(ours, ours_lp, ours_m, theirs, theirs_lp, theirs_m, dtype):
    """A policy loss and verl's agree: the value, the (non-zero) gradient with respect to the
    current logprobs, and the metrics, key for key (verl's carry an "actor/" prefix); float32
    rounding for bf16-rounded inputs."""
    tol = 1e-6 if dtype == torch.float64 else 1e-5
    assert ours.item() == pytest.approx(theirs.item(), abs=tol, rel=tol)
    assert torch.allclose(ours_lp.grad, theirs_lp.grad, atol=tol, rtol=tol)
    assert ours_lp.grad.abs().sum() > 0
    assert set(ours_m) == {k.removeprefix("actor/") for k in theirs_m}
    for key in ours_m:
        assert ours_m[key] == pytest.approx(float(theirs_m[f"actor/{key}"]), abs=tol)


@needs_verl
@pytest.mark.parametrize(
    "name", ["gspo", "cispo", "gpg", "sapo", "clip_cov", "kl_cov", "dppo_tv", "dppo_kl", "dro"]
)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_policy_losses_match_verl_values_and_gradients(name, mode, dtype):
    """objectives.POLICY_LOSSES[name], times decoupled IS weights and aggregated with agg_loss,
    against verl 0.9.1's compute_policy_loss_<name> run from its source: the loss, its gradient
    with respect to the current logprobs, and the metrics, on padded rows of different lengths
    (an empty one included), clip-higher, per-sequence advantages with all-equal groups, and inputs
    rounded to bf16 (then computed in float32, as a bf16 forward's fp32 logprobs)."""
    train, rollout, mask = random_batch(B=8, T=10, scale=0.4, seed=11, empty_rows=True)
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(8, generator=g)
    adv[4:6] = 0.0  # an all-equal group: advantage 0
    adv = adv[:, None].expand(8, 10).clone()
    if name in ("clip_cov", "kl_cov"):
        # larger advantages: some tokens' covariance falls in Clip-Cov's (1, 5) window
        adv = adv * 3
    if dtype == torch.bfloat16:
        train, rollout = train.to(dtype).float(), rollout.to(dtype).float()
        adv, mask = adv.float(), mask.float()
    w, _ = C.compute_is_weights(train - rollout, mask, "token", 2.0)
    function = VERL[f"compute_policy_loss_{name}"]
    config = VerlActorConfig(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        global_batch_info={},
        tau_pos=O.SAPO_TAU_POS,
        tau_neg=O.SAPO_TAU_NEG,
        policy_loss=types.SimpleNamespace(
            clip_cov_ratio=0.05,  # 0.0002 (the default) x 72 tokens would cut only one
            clip_cov_lb=O.CLIP_COV_LB,
            clip_cov_ub=O.CLIP_COV_UB,
            kl_cov_ratio=0.05,
            ppo_kl_coef=O.PPO_KL_COEF,
            dro_beta=0.1,
        ),
    )
    ours_lp = train.clone().requires_grad_(True)
    torch.manual_seed(5)  # Clip-Cov's random draw (the global RNG, as verl)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(O, "CLIP_COV_RATIO", 0.05)
        patch.setattr(O, "KL_COV_RATIO", 0.05)
        extra = {"beta": 0.1} if name == "dro" else {}  # --dro-beta
        losses, ours_m = O.POLICY_LOSSES[name](ours_lp, rollout, adv, mask, 0.2, 0.28, **extra)
    # verl aggregates SAPO with seq-mean-token-mean whatever the mode (grpo.py refuses the others)
    ours_mode = "seq-mean-token-mean" if name == "sapo" else mode
    ours = O.agg_loss(losses * w, mask, ours_mode)
    ours.backward()
    theirs_lp = train.clone().requires_grad_(True)
    torch.manual_seed(5)
    theirs, theirs_m = function(
        old_log_prob=rollout,
        log_prob=theirs_lp,
        advantages=adv,
        response_mask=mask.bool(),
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=w,
    )
    theirs.backward()
    assert_loss_matches_verl(ours, ours_lp, ours_m, theirs, theirs_lp, theirs_m, dtype)
    if name in ("clip_cov", "dppo_tv", "dppo_kl"):  # the rule cut some tokens
        assert ours_m["pg_clipfrac"] > 0
    if name == "kl_cov":  # the penalised tokens changed the loss
        plain = O.agg_loss(-adv * torch.exp(train - rollout) * mask * w, mask, mode)
        assert abs(ours.item() - plain.item()) > 1e-6


def test_gspo_clips_whole_sequences_and_cispo_keeps_clipped_gradients():
    """Hand-checked: GSPO's ratio is one per sequence (the geometric mean of its tokens' ratios),
    so a sequence whose mean log-ratio is beyond the clip has no gradient on any token, though
    one token alone moved little; CISPO's clipped token keeps the gradient -w A grad log pi with
    w the clipped ratio."""
    lp = torch.tensor([[0.0, 0.0], [0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-0.5, 0.0], [-0.1, 0.0]])  # mean log-ratios 0.25 (e^.25 = 1.28) and 0.05
    adv = torch.ones(2, 2)
    mask = torch.ones(2, 2)
    losses, metrics = O.gspo_token_loss(lp, old, adv, mask, 0.2, 0.2)
    assert losses.detach().flatten().tolist() == pytest.approx([-1.2, -1.2] + [-math.exp(0.05)] * 2)
    losses.sum().backward()
    assert lp.grad[0].tolist() == [0.0, 0.0]
    assert lp.grad[1].tolist() == pytest.approx([-math.exp(0.05)] * 2)
    assert metrics["pg_clipfrac"] == 0.5
    lp.grad = None
    losses, metrics = O.cispo_token_loss(lp, old, adv, mask, 0.2, 0.2)
    losses.sum().backward()
    # token (0, 0): r = e^0.5 = 1.65 -> weight 1.2, still a gradient; the others r <= e^0.1
    assert lp.grad.flatten().tolist() == pytest.approx([-1.2, -1.0, -math.exp(0.1), -1.0])
    assert metrics["pg_clipfrac"] == 0.25


@pytest.mark.parametrize("name", sorted(O.POLICY_LOSSES))
def test_on_policy_every_loss_but_clip_cov_is_reinforce(name):
    """Where pi_theta is pi_old (the first optimizer step on a batch, before any weight moved)
    every ratio is 1, no clip is active and no penalty has a gradient: each policy loss's gradient
    with respect to log pi_theta is -A on every valid token, REINFORCE's. So the losses differ
    only from a batch's second optimizer step on (docs/objectives.md, "One or two optimizer steps
    per batch"). Clip-Cov is the exception: it cuts tokens by their covariance, not their ratio."""
    g = torch.Generator().manual_seed(4)
    old = -2.0 * torch.rand(8, 10, generator=g)
    adv = 3.0 * torch.randn(8, generator=g)[:, None].expand(8, 10).clone()
    mask = torch.ones(8, 10)
    mask[2, 6:] = 0.0
    lp = old.clone().requires_grad_(True)
    extra = {"beta": 0.1} if name == "dro" else {}
    with pytest.MonkeyPatch.context() as patch:
        # Clip-Cov and KL-Cov act on 5% of the 76 tokens (with their default, 0.02%, on one)
        patch.setattr(O, "CLIP_COV_RATIO", 0.05)
        patch.setattr(O, "KL_COV_RATIO", 0.05)
        torch.manual_seed(5)
        losses, metrics = O.POLICY_LOSSES[name](lp, old.clone(), adv, mask, 0.2, 0.28, **extra)
    (losses * mask).sum().backward()
    reinforce = -adv * mask
    if name == "clip_cov":
        assert metrics["pg_clipfrac"] > 0
        assert not torch.allclose(lp.grad, reinforce, atol=1e-6)
    else:
        assert torch.allclose(lp.grad, reinforce, atol=1e-6)


def test_tis_paper_estimators_at_equal_policies():
    """With pi_sampler = pi_learner = pi_old every estimator is plain REINFORCE-like PPO: same
    value, same gradient."""
    lp = torch.tensor([[-0.3, -1.4]], requires_grad=True)
    adv = torch.tensor([[0.5, -1.0]])
    grads = []
    for fn in (
        lambda: O.naive_ppo_token_loss(lp, lp.detach(), adv),
        lambda: O.vanilla_is_token_loss(lp, lp.detach(), adv),
        lambda: O.ppo_is_token_loss(lp, lp.detach(), adv),
        lambda: O.tis_ppo_token_loss(lp, lp.detach(), lp.detach(), adv),
    ):
        lp.grad = None
        fn().sum().backward()
        grads.append(lp.grad.clone())
    for g in grads[1:]:
        assert torch.allclose(g, grads[0])
    # under mismatch PPO-IS clips already at theta = theta_old while TIS does not
    rollout = lp.detach() - torch.tensor([[0.5, 0.5]])  # ratio pi_learner/pi_sampler = e^0.5 > 1.2
    lp.grad = None
    O.ppo_is_token_loss(lp, rollout, torch.tensor([[1.0, 1.0]])).sum().backward()
    assert torch.all(lp.grad == 0)  # clipped: no gradient
    lp.grad = None
    O.tis_ppo_token_loss(lp, lp.detach(), rollout, torch.tensor([[1.0, 1.0]])).sum().backward()
    assert torch.all(lp.grad != 0)
    # cap = inf is vanilla IS in the PPO form: the weight e^0.5 = 1.65 survives; the default C = 2
    # caps a larger one
    far = lp.detach() - torch.tensor([[0.5, 1.5]])  # weights e^0.5, e^1.5 = 4.48
    vanilla = O.tis_ppo_token_loss(lp.detach(), lp.detach(), far, torch.ones(1, 2), cap=math.inf)
    assert torch.allclose(vanilla, -torch.exp(torch.tensor([[0.5, 1.5]])))
    assert O.tis_ppo_token_loss(lp.detach(), lp.detach(), far, torch.ones(1, 2))[
        0, 1
    ].item() == pytest.approx(-2.0)


# ---------------------------------------------------------------------------------------------------------------
# 9. presets and the pipeline
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", C.ALL_PRESET_NAMES)
def test_every_preset_runs_and_gives_finite_gradients(name):
    config = C.RolloutCorrection.from_name(name)
    train, rollout, mask = random_batch(B=5, T=7, scale=0.2, seed=4)
    adv = torch.randn(5, 1, generator=torch.Generator().manual_seed(2)).expand(5, 7)
    weights, new_mask, metrics = C.apply_rollout_correction(train, rollout, mask, config)
    assert (new_mask <= mask).all()
    assert "training/rollout_probs_diff_max" in metrics and "rollout_corr/kl" in metrics
    assert all(k.startswith(("rollout_corr/", "training/")) for k in metrics)
    logprobs = train.clone().requires_grad_()
    loss = preset_pg_loss(config, logprobs, train, rollout, adv, mask, weights, new_mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


def test_presets_match_verl_definitions():
    p = C.RolloutCorrection
    assert p.from_name("decoupled_seq_is_rs") == p(
        rollout_is="sequence",
        rollout_is_threshold=2.0,
        rollout_rs="seq_sum_k1",
        rollout_rs_threshold="0.5_2.0",
    )
    assert p.from_name("bypass_pg_geo_rs_token_tis") == p(
        rollout_is="token",
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.999_1.001",
        bypass_mode=True,
        loss_type="reinforce",
    )
    assert p.from_name("decoupled_token_icepop").rollout_is_threshold == "0.5_5.0"


def test_older_document_presets_keep_their_definitions():
    """The 2025-11-04 version of verl's rollout-correction math doc, section 3.7: pg_rs and
    decoupled_geo_rs are "geometric RS + veto" with bounds 1/1.001..1.001 and veto 1e-4;
    ppo_is_bypass is bypass PPO with token IS; pg_is is bypass_pg_is. The newer document's
    bypass_pg_rs is bypass_pg_geo_rs; every name either document uses is accepted."""
    p = C.RolloutCorrection
    assert p.from_name("pg_rs") == p(
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold=1.001,
        rollout_token_veto_threshold=1e-4,
        bypass_mode=True,
        loss_type="reinforce",
    )
    assert p.from_name("decoupled_geo_rs_veto") == p(
        rollout_rs="seq_mean_k1", rollout_rs_threshold=1.001, rollout_token_veto_threshold=1e-4
    )
    assert p.from_name("ppo_is_bypass") == p(
        rollout_is="token", rollout_is_threshold=2.0, bypass_mode=True
    )
    assert p.from_name("pg_is") == p.from_name("bypass_pg_is")
    assert p.from_name("bypass_pg_rs") == p.from_name("bypass_pg_geo_rs")
    assert p.from_name("geo_rs_seq_tis") == p.from_name("decoupled_geo_rs_seq_tis")
    for name in (
        "decoupled_token_is",
        "decoupled_seq_is",
        "decoupled_seq_is_rs",
        "decoupled_geo_rs",
        "ppo_is_bypass",
        # every name in the two documents
        "pg_rs",
        "pg_is",
        "disabled",
        "bypass_pg_rs",
        "geo_rs_seq_tis",
    ):
        p.from_name(name)
    # pg_rs's bounds really are 1/1.001 .. 1.001 (geometric mean) and its veto drops a sequence with
    # rho_t < 1e-4
    log_ratio = torch.log(torch.tensor([[1.0009, 1.0009], [0.9990005, 0.9990005], [1e-5, 1e5]]))
    _, mask, metrics = C.apply_rollout_correction(
        log_ratio, torch.zeros(3, 2), torch.ones(3, 2), p.from_name("pg_rs")
    )
    # 0.9990005 < 1/1.001 = 0.999000999; row 3: vetoed
    assert mask.tolist() == [[1, 1], [0, 0], [0, 0]]
    bypass_pg_geo_rs = p.from_name("bypass_pg_geo_rs")
    _, mask, _ = C.apply_rollout_correction(
        log_ratio, torch.zeros(3, 2), torch.ones(3, 2), bypass_pg_geo_rs
    )
    # the newer preset: 0.999 <= rho_geo, no veto (row 3: 1)
    assert mask.tolist() == [[1, 1], [1, 1], [1, 1]]
    assert metrics["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_type="reinforce"), "bypass_mode"),
        (dict(rollout_is="tokens"), "rollout_is"),
        (dict(rollout_is="token", rollout_is_threshold="3_1"), "lower bound"),
        (dict(loss_type="pg"), "loss_type"),
        (dict(rollout_is="token", rollout_is_threshold=0), "positive"),
        (dict(rollout_rs="seq_mean_k3"), "required"),
        (dict(rollout_token_veto_threshold=-1.0), "veto"),
    ],
)
def test_invalid_settings_raise_value_error_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        C.RolloutCorrection(**kwargs)
    with pytest.raises(ValueError, match="unknown correction preset"):
        C.RolloutCorrection.from_name("decoupled_tis")


def preset_pg_loss(config, logprobs, old, rollout, adv, mask, weights, new_mask, mode="token-mean"):
    """A preset's policy-gradient term as the trainers' update_policy composes it: decoupled, the
    weights and mask of apply_rollout_correction(old, rollout); bypass, the correction of the
    current logprobs against pi_rollout (no weights for PPO-clip: its ratio is the IS ratio)."""
    if config.bypass_mode:
        weights, new_mask, _ = C.apply_rollout_correction(logprobs.detach(), rollout, mask, config)
        old = rollout
    if config.loss_type == "reinforce":
        losses, _ = O.reinforce_token_loss(logprobs, adv, new_mask)
    else:
        losses, _ = O.ppo_clip_token_loss(logprobs, old, adv, new_mask, 0.2, 0.2, 3.0)
        weights = None if config.bypass_mode else weights
    if weights is not None:
        losses = losses * weights
    return O.agg_loss(losses, new_mask, mode)


# ---------------------------------------------------------------------------------------------------------------
# properties (hypothesis)
# ---------------------------------------------------------------------------------------------------------------

log_ratios = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False)


@st.composite
def batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    values = torch.tensor(draw(st.lists(log_ratios, min_size=B * T, max_size=B * T))).reshape(B, T)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).reshape(B, T)
    return values, mask


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(C.RS_OPTIONS), st.sampled_from(["token", "sequence"]))
def test_property_padding_never_changes_a_result(batch, option, level):
    log_ratio, mask = batch
    garbage = torch.where(mask, log_ratio, torch.tensor(float("nan")))
    other = torch.where(mask, log_ratio, torch.tensor(123.0))
    threshold = "0.5_2.0" if option.endswith("k1") else 0.1
    for a, b in [
        (
            C.rejection_mask(garbage, mask, option, threshold)[0],
            C.rejection_mask(other, mask, option, threshold)[0],
        ),
        (
            C.compute_is_weights(garbage, mask, level)[0],
            C.compute_is_weights(other, mask, level)[0],
        ),
        (C.veto_mask(garbage, mask)[0], C.veto_mask(other, mask)[0]),
    ]:
        assert torch.equal(a, b)
    adv = torch.ones_like(log_ratio)
    assert torch.equal(
        O.ppo_clip_token_loss(garbage, torch.zeros_like(garbage), adv, mask)[0],
        O.ppo_clip_token_loss(other, torch.zeros_like(other), adv, mask)[0],
    )
    assert torch.equal(
        O.reinforce_token_loss(garbage, adv, mask)[0], O.reinforce_token_loss(other, adv, mask)[0]
    )


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(C.PRESETS), st.sampled_from(O.AGG_MODES))
def test_property_masks_never_gain_ones_and_outputs_stay_finite(batch, preset, mode):
    log_ratio, mask = batch
    mask = mask.double()
    config = C.RolloutCorrection.from_name(preset)
    rollout = torch.zeros_like(log_ratio)
    weights, new_mask, metrics = C.apply_rollout_correction(log_ratio, rollout, mask, config)
    assert (new_mask <= mask).all()
    bad = [
        k
        for k, v in metrics.items()
        if not math.isfinite(v)
        and "ppl" not in k
        and "chi2" not in k
        # NaN when undefined (one token or a constant), as torch.corrcoef in verl
        and "pearson" not in k
    ]
    assert not bad, (bad, metrics)
    if weights is not None:
        assert torch.isfinite(weights).all() and (weights[mask == 0] == 0).all()
    logprobs = log_ratio.clone().requires_grad_()
    adv = torch.ones_like(mask)
    loss = preset_pg_loss(config, logprobs, rollout, rollout, adv, mask, weights, new_mask, mode)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    if (new_mask if not config.bypass_mode else mask).sum() == 0:
        assert loss.item() == 0.0  # empty rows / all-rejected batch: a zero loss, never NaN


def test_sapo_gate_has_the_ratios_gradient_at_one_and_fades_away_from_it():
    """Hand-checked SAPO: at r = 1 the loss is -A * 2 / tau and its gradient -A (the ratio's own),
    for either sign of A; at r = e^2 (a token that moved far) the gradient is far smaller, and
    smaller still for a negative advantage (tau_neg > tau_pos)."""
    lp = torch.zeros(2, 2, requires_grad=True)
    old = torch.tensor([[0.0, -2.0], [0.0, -2.0]])  # r = 1 and r = e^2
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    losses, metrics = O.sapo_token_loss(lp, old, adv, torch.ones(2, 2))
    losses.sum().backward()
    tau_pos, tau_neg = O.SAPO_TAU_POS, O.SAPO_TAU_NEG
    assert losses[0, 0].item() == pytest.approx(-2 / tau_pos)
    assert losses[1, 0].item() == pytest.approx(2 / tau_neg)
    assert lp.grad[:, 0].tolist() == pytest.approx([-1.0, 1.0])

    def gate_slope(tau):  # d/dlogpi of (4 / tau) sigmoid(tau (r - 1)) at r = e^2
        r = math.exp(2.0)
        sig = torch.sigmoid(torch.tensor(tau * (r - 1))).item()
        return 4 * sig * (1 - sig) * r

    assert lp.grad[0, 1].item() == pytest.approx(-gate_slope(tau_pos))
    assert lp.grad[1, 1].item() == pytest.approx(gate_slope(tau_neg))
    assert abs(lp.grad[1, 1].item()) < abs(lp.grad[0, 1].item()) < 0.1
    assert metrics["pg_clipfrac"] == 0.0 and metrics["ppo_kl"] == pytest.approx(-1.0)


@needs_verl
@pytest.mark.parametrize("weights", [None, "sequence"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_geo_mean_matches_verl_values_gradients_and_metrics(weights, dtype):
    """GMPO: O.geo_mean_token_loss aggregated with seq-mean-token-mean (the only mode grpo.py
    allows with it) against verl 0.9.1's compute_policy_loss_geo_mean, on one micro-batch with no
    empty row (verl's plain torch.mean over rows is then the same mean), clip-higher, mixed-sign
    advantages (both clip sides), with no IS weights and with sequence-level ones (whose
    geometric mean per sequence, verl's, is the weight itself)."""
    train, rollout, mask = random_batch(B=8, T=10, scale=0.4, seed=12)
    g = torch.Generator().manual_seed(4)
    adv = torch.randn(8, generator=g)[:, None].expand(8, 10).clone()
    if dtype == torch.bfloat16:
        train, rollout = train.to(dtype).float(), rollout.to(dtype).float()
        adv, mask = adv.float(), mask.float()
    w = None
    if weights == "sequence":
        w, _ = C.compute_is_weights(train - rollout, mask, "sequence", 2.0)
    config = VerlActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    ours_lp = train.clone().requires_grad_(True)
    losses, ours_m = O.geo_mean_token_loss(ours_lp, rollout, adv, mask, 0.2, 0.28)
    if w is not None:
        losses = losses * w
    ours = O.agg_loss(losses, mask, "seq-mean-token-mean")
    ours.backward()
    theirs_lp = train.clone().requires_grad_(True)
    theirs, theirs_m = VERL["compute_policy_loss_geo_mean"](
        old_log_prob=rollout,
        log_prob=theirs_lp,
        advantages=adv,
        response_mask=mask,
        config=config,
        rollout_is_weights=w,
    )
    theirs.backward()
    assert_loss_matches_verl(ours, ours_lp, ours_m, theirs, theirs_lp, theirs_m, dtype)
    assert ours_m["pg_clipfrac"] > 0 and ours_m["pg_clipfrac_lower"] > 0


def _load_trl_off_policy_mask():
    """TRL 1.16's GRPOTrainer.get_off_policy_mask, run from its source (scripts/setup_cpu.sh
    unpacks the wheel; never imported)."""
    from verl_source import load_method, trl_root

    root = trl_root()
    if root is None:
        return None
    return load_method(
        root, "trainer/grpo_trainer.py", "GRPOTrainer", "get_off_policy_mask", {"torch": torch}
    )


TRL_OFF_POLICY_MASK = _load_trl_off_policy_mask()


@pytest.mark.skipif(TRL_OFF_POLICY_MASK is None, reason="no TRL source (scripts/setup_cpu.sh)")
@pytest.mark.parametrize("threshold", [0.01, 0.05, 0.2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_off_policy_sequence_mask_matches_trl(threshold, dtype):
    """DeepSeek-V3.2's off-policy sequence mask against TRL's own function on padded rows of
    different lengths (an empty one included), advantages of both signs and zero, and inputs
    rounded to bf16: the same sequences kept."""
    train, rollout, mask = random_batch(B=12, T=10, scale=0.4, seed=21, empty_rows=True)
    advantages = torch.randn(12, 1, generator=torch.Generator().manual_seed(4))
    advantages[3] = 0.0
    # a negative-advantage sequence far from its sampler (dropped at every threshold) and one on it
    advantages[5:7] = -1.0
    rollout[5] = train[5]
    rollout[6] = train[6] + 0.5
    if dtype == torch.bfloat16:
        train, rollout = train.to(dtype).float(), rollout.to(dtype).float()
        mask = mask.float()
    ours, metrics = C.off_policy_sequence_mask(train, rollout, advantages, mask, threshold)
    theirs = TRL_OFF_POLICY_MASK(advantages, train, rollout, mask, threshold)
    assert torch.equal(ours, theirs.to(ours.dtype))
    assert 0 < metrics["off_policy_mask/masked_seq_fraction"] < 1


def test_off_policy_sequence_mask_hand_values():
    """Two sequences, mean log(pi_rollout / pi_theta) 0.5 over their 2 valid tokens (NaN in the
    padding): the negative-advantage one is dropped at a threshold of 0.4 and kept at 0.6; the
    positive one is kept whatever its divergence."""
    rollout = torch.tensor([[-1.0, -1.0, float("nan")], [-1.0, -1.0, 5.0]])
    train = torch.tensor([[-1.2, -1.8, float("nan")], [-1.2, -1.8, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([-1.0, 1.0])
    keep, metrics = C.off_policy_sequence_mask(train, rollout, advantages, mask, 0.4)
    assert keep.tolist() == [[0.0], [1.0]]
    assert metrics["off_policy_mask/masked_seq_fraction"] == 0.5
    assert metrics["off_policy_mask/seq_kl_mean"] == pytest.approx(0.5)
    keep, _ = C.off_policy_sequence_mask(train, rollout, advantages, mask, 0.6)
    assert keep.tolist() == [[1.0], [1.0]]
