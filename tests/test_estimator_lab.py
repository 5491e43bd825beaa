"""The estimator lab's claims, asserted on exact numbers (scripts/estimator_lab.py: every
expectation is a sum over all V^L responses, nothing is sampled). Each test names the section of the
source document whose claim it checks: 004 = verl's docs/algo/rollout_corr_math.md (the
rollout-correction math doc), 000 = its 2025-11-04 version (with the veto), 002 = Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"."""

import json
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import estimator_lab as lab  # noqa: E402

ARGS = lab.Args()
L = ARGS.length  # 6: 729 responses


@pytest.fixture(scope="module")
def table():
    """The doc's table: every method under every perturbation at L = 6."""
    return {
        lab.label(r): r
        for r in (
            lab.evaluate(ARGS, L, kind, size)
            for kind, size in [(k, None) for k in lab.ROUNDINGS]
            + [("temperature", 1.2), ("noise", 0.2), ("noise", 1.0), ("spike", None)]
        )
    }


@pytest.fixture(scope="module")
def length_sweep():
    """L = 1 .. 8 at logit noise 1.0 (the doc's length figure stops at 10; 8 keeps the test
    fast)."""
    names = ["naive", "seq IS (vanilla)", "token TIS", "seq TIS", "bypass PPO-clip"]
    return [lab.evaluate(ARGS, n, "noise", ARGS.length_noise, methods=names) for n in range(1, 9)]


def test_enumeration_is_a_distribution():
    theta, noise = lab.make_policy(ARGS)
    tokens, prev = lab.all_responses(3, 4)
    assert tokens.shape == (81, 4) and len({tuple(t.tolist()) for t in tokens}) == 81
    for table, temperature in (
        (theta, 1.0),
        (theta + noise, 1.0),
        (theta, 1.3),
        (lab.round_table(theta, "int4"), 1.0),
    ):
        assert (
            abs(
                float(lab.token_logprobs(table, tokens, prev, temperature).sum(1).exp().sum()) - 1.0
            )
            < 1e-12
        )


def test_no_mismatch_every_method_is_the_on_policy_gradient():
    """004 section 1.1 (REINFORCE is unbiased on-policy) and 3.1: with pi_rollout = pi_old every IS
    weight is 1 and every rejection test passes, so every method reduces to the on-policy policy
    gradient."""
    r = lab.evaluate(ARGS, 4, "noise", 0.0)
    assert r["kl_seq"] == 0.0
    for name, m in r["methods"].items():
        assert m["bias"] < 1e-12 and m["kept"] == pytest.approx(1.0), name
        assert m["variance_ratio"] == pytest.approx(1.0, rel=1e-9), name


def test_vanilla_sequence_is_is_unbiased_under_every_mismatch(table):
    """004 section 3.2.2 (IS changes the measure: E_rollout[w grad log pi A] = grad J with w the
    sequence ratio) and
    3.3.2 ("Sequence-level correction is unbiased"): zero bias, to float64 rounding, under every perturbation, while
    naive is biased under all of them."""
    for label, r in table.items():
        assert r["methods"]["seq IS (vanilla)"]["bias"] < 1e-12, label
        assert r["methods"]["naive"]["bias"] > 5e-4, label


def test_naive_bias_grows_with_the_mismatch():
    """004 section 2.3 (the rollout -> old drift is what the correction is for) and 002 (the gap,
    and the harm of ignoring it, grows from BF16 to FP8/INT8 rollouts): naive's bias grows with
    every size knob we turn."""
    noise = [
        lab.evaluate(ARGS, L, "noise", s, methods=["naive"]) for s in (0.05, 0.1, 0.2, 0.5, 1.0)
    ]
    temps = [
        lab.evaluate(ARGS, L, "temperature", t, methods=["naive"]) for t in (1.05, 1.1, 1.2, 1.5)
    ]
    for sweep in (noise, temps):
        kl = [r["kl_seq"] for r in sweep]
        bias = [r["methods"]["naive"]["bias"] for r in sweep]
        assert kl == sorted(kl) and bias == sorted(bias) and bias[-1] > 5 * bias[0]


def test_rounding_kinds_order_bf16_int8_fp8_int4(table):
    """002 (rollout precision bf16 < INT8/FP8 in mismatch): on this table the per-row roundings
    order bf16 < int8 < fp8 (e4m3) < int4, in the sequence KL and in naive's bias."""
    kl = [table[k]["kl_seq"] for k in lab.ROUNDINGS]
    bias = [table[k]["methods"]["naive"]["bias"] for k in lab.ROUNDINGS]
    assert kl == sorted(kl) and bias == sorted(bias)


def test_token_level_is_is_biased_and_single_token_is_not(table):
    """004 section 3.3.1: token-level IS has a bias (O(T^2 Delta_max)) that sequence-level IS does
    not; it corrects each token's probability but not the distribution of its prefix. With one
    token, token = sequence: no bias."""
    one = lab.evaluate(ARGS, 1, "noise", 1.0, methods=["token IS (vanilla)", "naive"])
    assert (
        one["methods"]["token IS (vanilla)"]["bias"]
        < 1e-12
        < 0.05
        < one["methods"]["naive"]["bias"]
    )
    for label in ("int4", "temperature 1.2", "noise 0.2", "noise 1"):
        m = table[label]["methods"]
        assert m["token IS (vanilla)"]["bias"] > 1e-2, label
        # but it removes part of naive's bias
        assert m["token IS (vanilla)"]["bias"] < m["naive"]["bias"], label


def test_sequence_is_variance_explodes_with_length_token_tis_stays_low(length_sweep):
    """004 section 3.3.1 (token-level: "Lower variance than sequence-level (product of ratios
    bounded individually)") and 3.3.3 (the product ratio is multiplicative in the length): at a
    fixed per-token mismatch the sequence chi^2 and the variance of sequence IS grow with L at every
    step; token TIS's stays below 2x on-policy REINFORCE and below sequence IS from L = 3 on."""
    chi2 = [r["chi2_seq"] for r in length_sweep]
    seq_var = [r["methods"]["seq IS (vanilla)"]["variance_ratio"] for r in length_sweep]
    tok_var = [r["methods"]["token TIS"]["variance_ratio"] for r in length_sweep]
    assert all(b > a for a, b in zip(chi2, chi2[1:])) and chi2[-1] > 100 * chi2[0]
    assert all(b > a for a, b in zip(seq_var, seq_var[1:])) and seq_var[-1] > 5
    assert max(tok_var) < 2.0
    assert all(t < s for t, s in zip(tok_var[2:], seq_var[2:]))


def test_truncation_trades_bias_for_variance(table, length_sweep):
    """002, "Vanilla-IS vs. TIS": truncating the ratio at C bounds the variance that vanilla IS's
    large weights blow up, at the price of a bias; 004 section 3.3.2 (Seq-TIS). When no weight
    reaches C, truncation changes nothing."""
    big = table["noise 1"]["methods"]
    assert big["seq TIS"]["variance_ratio"] < 0.5 * big["seq IS (vanilla)"]["variance_ratio"]
    assert big["seq TIS"]["bias"] > 0.1 and big["seq IS (vanilla)"]["bias"] < 1e-12
    small = table["int4"]["methods"]  # every sequence ratio below 2
    assert small["seq TIS"]["bias"] < 1e-12
    assert small["seq TIS"]["variance_ratio"] == pytest.approx(
        small["seq IS (vanilla)"]["variance_ratio"]
    )
    last = length_sweep[-1]["methods"]  # L = 8: seq TIS is the lowest-variance method there
    assert last["seq TIS"]["variance_ratio"] < min(last["token TIS"]["variance_ratio"], 1.0)


def test_geometric_rs_tight_band_rejects_most_responses(table):
    """004 section 3.3.3: the typical Geo-RS band "0.999_1.001" rejects a response whose average
    per-token log-ratio leaves +-0.1%: nearly everything once the rollout is rounded to fp8 or int4;
    K3-RS (section 3.3.5, threshold 0.01) keeps them all there."""
    for label in ("fp8", "int4"):
        m = table[label]["methods"]
        assert m["geo RS"]["kept"] < 0.2 and m["K3 RS"]["kept"] > 0.99, label
    assert table["bf16"]["methods"]["geo RS"]["kept"] > 0.9


def test_veto_removes_the_catastrophic_token_that_is_cannot(table):
    """000 section 3.5: a token with rho_t < 1e-4 vetoes its whole sequence; IS weights ~0 silence
    only that token while the rest of the sequence still trains on the wrong distribution. With the
    "spike" (pi_train ~ 1e-5, the rollout not) the veto drops exactly the responses that start with
    the spiked token, and its bias vanishes (up to the 1e-5 of pi_train's mass it cannot see); token
    TIS and naive keep a large bias."""
    spike = table["spike"]
    m = spike["methods"]
    theta, _ = lab.make_policy(ARGS)
    p_spiked_first = float(torch.softmax(theta[ARGS.vocab_size], -1)[0])  # pi_rollout(y_0 = 0)
    assert m["veto"]["kept"] == pytest.approx(1 - p_spiked_first, abs=1e-12)
    assert m["veto"]["bias"] < 1e-4
    assert m["naive"]["bias"] > 0.5 and m["token TIS"]["bias"] > 0.2
    # sequence IS also handles it: the whole-sequence weight is ~0
    assert m["seq IS (vanilla)"]["bias"] < 1e-12


def test_bypass_ppo_clip_clips_on_the_mismatch_itself(table, length_sweep):
    """002, "PPO-IS vs. TIS": PPO whose ratio is pi_theta / pi_rollout is still biased: at theta =
    theta_old the ratio is not 1 under mismatch, and clipping [0.8, 1.2] zeroes tokens for the
    mismatch alone. Inside the clip range (int4) it equals unclipped token IS; outside it
    (temperature 1.2, noise) its bias is several times token IS's and grows with L."""
    inside = table["int4"]["methods"]
    assert inside["bypass PPO-clip"]["bias"] == pytest.approx(
        inside["token IS (vanilla)"]["bias"], rel=1e-9
    )
    for label in ("temperature 1.2", "noise 0.2"):
        m = table[label]["methods"]
        assert m["bypass PPO-clip"]["bias"] > 3 * m["token IS (vanilla)"]["bias"], label
    bias = [r["methods"]["bypass PPO-clip"]["bias"] for r in length_sweep]
    assert all(b > a for a, b in zip(bias[1:], bias[2:])) and bias[-1] > 3 * bias[1]


def test_script_writes_json_and_figures(tmp_path):
    """The script end to end at a toy size: the JSON has every sweep, the figures exist."""
    args = lab.Args(
        length=3,
        max_length=3,
        noise_sizes=(0.0, 0.5),
        temperatures=(1.0, 1.2),
        out_json=str(tmp_path / "lab.json"),
        img_dir=str(tmp_path / "img"),
    )
    lab.main(args)
    results = json.load(open(tmp_path / "lab.json"))
    assert [len(results[k]) for k in ("noise", "temperature", "length", "table")] == [2, 2, 3, 8]
    assert set(results["table"][0]["methods"]) == set(lab.METHODS)
    assert all(math.isfinite(m["bias"]) for r in results["table"] for m in r["methods"].values())
    for name in ("estimator_lab_mismatch.png", "estimator_lab_length.png"):
        assert (tmp_path / "img" / name).stat().st_size > 10_000
