"""Tests for rewards.py: reward-model math (head init, last-token reward under left padding,
normalisation), the rule-based rewards (verl's GSM8K scorer, TinyZero's Countdown with our
evaluator), their totality under fuzzing, and end-to-end reward-model training (1 process
in-process, 2 processes with torchrun/gloo). All offline."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import rewards  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
from tolerances import assert_float32_close  # noqa: E402

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
hostile_text = st.one_of(
    st.text(),
    st.binary(max_size=2000).map(lambda b: b.decode("latin-1")),
    st.text(alphabet="0123456789#$,.-+*/() <>answerAsistn:\n", max_size=400),
)


# ---------------------------------------------------------------------------------------------------------------
# Reward model: head init, last-token reward with left padding, normalisation
# ---------------------------------------------------------------------------------------------------------------


def tiny_gpt2(hidden_size=32, num_layers=1, num_heads=2, seed=0):
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(
        vocab_size=56,
        n_embd=hidden_size,
        n_layer=num_layers,
        n_head=num_heads,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def test_reward_head_init_statistics():
    """[reward 2]: weight ~ N(0, 1/sqrt(d+1)), bias 0, gain 1, bias buffer 0. d=1024 gives 1024
    weights: the sample std is within ~2.2% (1 sigma) of the truth, the 10% tolerance is > 4 sigma,
    and it excludes the 1/(d+1) typo."""
    d = 1024
    # no blocks: only the head matters
    model = rewards.RewardModel(tiny_gpt2(hidden_size=d, num_layers=0))
    w = model.scalar_head.weight.detach().flatten()
    expected_std = 1 / math.sqrt(d + 1)
    assert w.numel() == d
    assert abs(w.std().item() / expected_std - 1) < 0.10
    assert abs(w.mean().item()) < 4 * expected_std / math.sqrt(d)
    assert model.scalar_head.bias.item() == 0.0
    assert model.reward_gain.item() == 1.0 and model.reward_bias.item() == 0.0


def test_reward_gain_and_bias_are_trainable():
    """The original trains reward_norm/gain and /bias with the network (rewards.py get_params()
    includes them; lm-human-preference-details: nn.Parameter). Hand-computed gradients of sum(gain *
    raw + bias): d/dgain = sum(raw), d/dbias = B; and one Adam step moves each by ~lr (Adam's first
    step is lr * sign(grad))."""
    model = rewards.RewardModel(tiny_gpt2())
    params = dict(model.named_parameters())
    assert params["reward_gain"].requires_grad and params["reward_bias"].requires_grad
    x = torch.randint(0, 50, (5, 7))
    reward = model(x, torch.ones_like(x))
    reward.sum().backward()
    with torch.no_grad():
        raw = model.raw_reward(x, torch.ones_like(x))
    assert model.reward_gain.grad.item() == pytest.approx(raw.sum().item(), rel=1e-5, abs=1e-6)
    assert model.reward_bias.grad.item() == pytest.approx(5.0)
    from adam_tf import AdamTF

    AdamTF(model.parameters(), lr=1e-3, eps=1e-5).step()
    assert model.reward_bias.item() == pytest.approx(-1e-3, rel=1e-3)  # grad +5 -> moves down by lr
    assert abs(model.reward_gain.item() - 1.0) == pytest.approx(1e-3, rel=1e-2)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_last_token_reward_left_padding_equals_unpadded(arch):
    """The reward of a left-padded batch equals each row's reward alone (exclusive-cumsum position
    ids, padding ids zeroed). The pad id is OUTSIDE the vocabulary, like gpt2's added [PAD]: it must
    never reach the embedding."""
    backbone, _ = tasks.build_tiny_model(None, arch=arch, hidden_size=64, num_layers=2, num_heads=1)
    model = rewards.RewardModel(backbone).eval()
    with torch.no_grad():
        model.reward_gain.fill_(1.7)
        model.reward_bias.fill_(-0.3)
    pad = backbone.config.vocab_size + 5
    torch.manual_seed(0)
    rows = [torch.randint(3, 50, (n,)) for n in (7, 3, 11, 1)]
    width = max(len(r) for r in rows)
    batch = torch.stack([torch.cat([torch.full((width - len(r),), pad), r]) for r in rows])
    with torch.no_grad():
        batched = model(batch, batch != pad)
        alone = torch.cat([model(r[None], torch.ones(1, len(r), dtype=torch.bool)) for r in rows])
        # the same rows RIGHT-padded read a padding position: a different number (the test can fail)
        right = torch.stack([torch.cat([r, torch.full((width - len(r),), pad)]) for r in rows])
        right_padded = model(right, right != pad)
    assert batched.shape == (4,)
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    assert not torch.allclose(right_padded[:3], alone[:3], atol=1e-3)
    # normalised reward = gain * raw + bias
    torch.testing.assert_close(
        batched, 1.7 * model.raw_reward(batch, batch != pad) - 0.3, atol=1e-6, rtol=0
    )


def test_reward_head_runs_in_fp32_under_bf16_autocast():
    """Under bf16 autocast the scalar head runs in fp32 (logprobs.fp32_project): the reward
    equals a float64 head on the same hidden state. Measured here (rewards up to 85): a bf16 head
    (before) was 0.15 off, the fp32 head 7e-6."""
    backbone, _ = tasks.build_tiny_model(
        None, arch="gpt2", hidden_size=64, num_layers=2, num_heads=1
    )
    model = rewards.RewardModel(backbone).eval()
    with torch.no_grad():
        model.scalar_head.weight.mul_(30.0)
    torch.manual_seed(0)
    ids = torch.randint(3, 50, (16, 9))
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        raw = model.raw_reward(ids, mask)
        hidden = backbone.base_model(input_ids=ids, attention_mask=mask.long()).last_hidden_state[
            :, -1
        ]
        before = model.scalar_head(hidden).squeeze(-1)  # the head under autocast: bf16
    exact = hidden.double() @ model.scalar_head.weight.double()[0] + model.scalar_head.bias.double()
    assert raw.dtype == torch.float32 and before.dtype == torch.bfloat16 and exact.abs().max() > 50
    assert (before.double() - exact).abs().max() > 0.05  # the effect is real
    assert (raw.double() - exact).abs().max() < 1e-3


def test_left_pad_and_label_batch_replace_openai_padding():
    pad, P = 0, rewards.OPENAI_PAD_TOKEN_ID
    ids = torch.tensor([[5, 6, pad, 7, pad], [pad, 8, 9, 10, 11]])
    assert rewards.left_pad(ids, pad).tolist() == [[0, 0, 5, 6, 7], [0, 8, 9, 10, 11]]
    labels = [
        {
            "query": [P, 5, 6],
            "sample0": [7, P],
            "sample1": [8, 9],
            "sample2": [P, P],
            "sample3": [3, 3],
            "best": 1,
        }
    ]
    query, samples, best = rewards.label_batch(labels, [0], pad)
    assert query.tolist() == [[0, 5, 6]] and samples.tolist() == [[[7, 0], [8, 9], [0, 0], [3, 3]]]
    assert best.tolist() == [1]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_shared_query_forward_equals_a_forward_per_left_padded_row(arch):
    """The best-of-4 path computes each query once and shares its keys/values with the 4 samples:
    its rewards AND its gradients equal one forward per left-padded query + sample
    (rewards.left_pad, the reward at the last token), with OpenAI-style pads: left-padded queries,
    samples ending in pads, a sample that is all pads."""
    backbone, _ = tasks.build_tiny_model(None, arch=arch, hidden_size=64, num_layers=2, num_heads=1)
    model = rewards.RewardModel(backbone)
    with torch.no_grad():
        model.reward_gain.fill_(1.7)
        model.reward_bias.fill_(-0.3)
    pad = backbone.config.vocab_size + 5  # outside the vocabulary, as gpt2's [PAD]
    torch.manual_seed(0)
    b, n, query_length, response_length = 3, 4, 6, 5
    query = torch.randint(3, 50, (b, query_length))
    query[0, :2], query[2, :4] = pad, pad
    samples = torch.randint(3, 50, (b, n, response_length))
    # trailing pads, all pads, a pad inside
    samples[0, 1, 3:], samples[1, 2, :], samples[2, 3, 1] = pad, pad, pad
    shared = model.shared_query_forward(query, samples, pad)
    rows = rewards.left_pad(
        torch.cat([query.repeat_interleave(n, 0), samples.reshape(b * n, -1)], 1), pad
    )
    per_row = model(rows, rows != pad).view(b, n)
    torch.testing.assert_close(shared, per_row, atol=1e-5, rtol=0)
    params = list(model.parameters())
    for got, want in zip(
        torch.autograd.grad(shared.square().sum(), params),
        torch.autograd.grad(per_row.square().sum(), params),
    ):
        # the same sums over the hidden size (64) in another order: shared keys and values
        assert_float32_close(got, want, terms=64)
    # reading the last position of the unshifted rows instead (a sample's trailing pad) gives other
    # numbers
    unshifted = torch.cat([query.repeat_interleave(n, 0), samples.reshape(b * n, -1)], 1)
    assert (model(unshifted, unshifted != pad).view(b, n) - per_row).abs().max().item() > 0.1


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_policy"))
    policy, tokenizer = tasks.build_tiny_model(path, arch="gpt2")
    return rollout.never_stop_at_eos(policy).eval(), tokenizer


def test_normalization_gives_mean_0_std_1_on_fresh_samples(tiny_policy):
    """[reward 3]. On the samples it was fitted on, mean 0 / std 1 hold exactly (up to float error).
    On 256 FRESH samples they hold statistically: the fitted mean and std have errors ~ 1/sqrt(256)
    = 0.06 and ~0.045, and the fresh sample mean another 0.06, so |mean| < 0.3 and |std - 1| < 0.25
    are > 3 sigma (the reward is not Gaussian and different queries shift it, hence loose
    bounds)."""
    policy, tokenizer = tiny_policy
    model = rewards.RewardModel(tasks.build_tiny_model(None, arch="gpt2", seed=1)[0]).eval()
    pad = tokenizer.pad_token_id
    torch.manual_seed(0)

    def sample(seed):
        queries = rewards.query_token_batch(iter(tasks.tiny_queries(256, seed)), tokenizer, 256, 8)
        return rewards.sample_query_responses(policy, queries, pad, 16, 0.7, 256)

    fit, fresh = sample(1), sample(2)
    # fixed-length responses, never padding
    assert fit.shape == (256, 24) and (fit[:, 8:] != pad).all()
    with torch.no_grad():
        model.reward_gain.fill_(5.0)  # normalisation must reset these first
    stats = rewards.normalize_reward_model(model, fit, pad)
    mean, std = rewards.reward_stats(model, fit, pad)
    assert abs(mean) < 1e-5 and abs(std - 1) < 1e-5
    assert stats["gain"] == pytest.approx(1 / stats["std_before"]) and stats["std_before"] > 0
    assert stats["bias"] == pytest.approx(-stats["gain"] * stats["mean_before"])
    mean, std = rewards.reward_stats(model, fresh, pad)
    assert abs(mean) < 0.3 and abs(std - 1) < 0.25
    # reward_stats is the population std, as the original
    with torch.no_grad():
        r = model(fresh, fresh != pad).double()
    assert std == pytest.approx(r.std(unbiased=False).item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# GSM8K: verl's scorer, quirks included, plus parity with a transcription of verl's code
# ---------------------------------------------------------------------------------------------------------------


def verl_gsm8k_compute_score(solution_str, ground_truth, method="strict"):
    """Transcription of verl/utils/reward_score/gsm8k.py (extract_solution + compute_score, defaults
    format_score=0.0, score=1.0): the trusted reference for the parity test."""
    if len(solution_str) > 300:
        solution_str = solution_str[-300:]
    if method == "strict":
        solutions = re.findall("#### (\\-?[0-9\\.\\,]+)", solution_str)
        final_answer = (
            None if len(solutions) == 0 else solutions[-1].replace(",", "").replace("$", "")
        )
    else:
        answer = re.findall("(\\-?[0-9\\.\\,]+)", solution_str)
        final_answer = None
        if len(answer) > 0:
            for final_answer in reversed(answer):
                if final_answer not in ["", "."]:
                    break
    if final_answer is None:
        return 0
    return 1.0 if final_answer == ground_truth else 0.0


GSM8K_CASES = [
    # (response, ground truth, mode, expected)
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", "strict", 1.0),
    ("#### 72", "73", "strict", 0.0),
    ("#### 42.", "42", "strict", 0.0),  # verl quirk: the capture is "42."
    ("#### 42.", "42", "normalized", 1.0),
    ("#### 1,000", "1000", "strict", 1.0),  # commas stripped after capture
    ("#### $42", "42", "strict", 0.0),  # the strict regex does not allow "$" after "#### "
    ("#### $42", "42", "normalized", 1.0),
    ("#### $1,000.", "1000", "normalized", 1.0),
    ("#### 42.0", "42", "normalized", 1.0),  # compared numerically
    ("#### 42.0", "42", "strict", 0.0),
    ("#### -5", "-5", "strict", 1.0),
    ("####42", "42", "strict", 0.0),  # needs the space
    ("#### 41 no wait #### 42", "42", "strict", 1.0),  # the LAST match
    ("#### 42 no wait #### 41", "42", "strict", 0.0),
    ("#### 42" + "x" * 293, "42", "strict", 1.0),  # 300 characters in total: inside the window
    # the first "#" falls out of the last 300 characters
    ("#### 42" + "x" * 294, "42", "strict", 0.0),
    ("#### 42" + "x" * 294, "42", "normalized", 0.0),
    ("the answer is 72", "72", "strict", 0.0),
    ("the answer is 72", "72", "flexible", 1.0),
    ("so she has 7 .", "7", "flexible", 1.0),  # a lone "." is skipped
    ("so she has 7.", "7", "flexible", 0.0),  # ... but "7." is a number string != "7"
    ("it is 1,000", "1000", "flexible", 0.0),  # flexible keeps commas
    ("3 apples then -12", "-12", "flexible", 1.0),
    ("", "0", "strict", 0.0),
    ("", "0", "flexible", 0.0),
    ("#### 7", 7, "strict", 1.0),  # non-string ground truth compared through str()
]


@pytest.mark.parametrize("response,truth,mode,expected", GSM8K_CASES)
def test_gsm8k_cases(response, truth, mode, expected):
    assert tasks.gsm8k_reward(response, truth, mode=mode) == expected
    if mode != "normalized" and isinstance(truth, str):
        assert verl_gsm8k_compute_score(response, truth, mode) == expected


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="#### 0123456789.,$-ab\n", max_size=340),
    st.sampled_from(["42", "-3", "1000", "4.5", "."]),
    st.sampled_from(["strict", "flexible"]),
)
def test_gsm8k_parity_with_verl(response, truth, mode):
    assert tasks.gsm8k_reward(response, truth, mode) == verl_gsm8k_compute_score(
        response, truth, mode
    )


def test_gsm8k_hostile_inputs_are_fast_and_zero():
    hostile = [
        "9" * 10**7,
        "#### " + "1" * 10**6,
        "\x00\xff" * 10**5,
        "#" * 10**6,
        "١٢٣",
        None,
        b"#### 42",
        42,
    ]
    start = time.perf_counter()
    for response in hostile:
        for mode in ("strict", "flexible", "normalized"):
            assert tasks.gsm8k_reward(response, "42", mode) == 0.0
    assert time.perf_counter() - start < 2.0
    with pytest.raises(ValueError, match="mode"):
        tasks.gsm8k_reward("#### 1", "1", mode="lenient")


# ---------------------------------------------------------------------------------------------------------------
# Countdown: TinyZero's scheme, our evaluator
# ---------------------------------------------------------------------------------------------------------------

COUNTDOWN_CASES = [
    # (response, numbers, target, expected)
    ("Assistant: <think>...</think> <answer>(1 + 2) * 3</answer>", [1, 2, 3], 9, 1.0),
    # no "Assistant:" marker: the whole response
    ("<answer>(1 + 2) * 3</answer>", [3, 2, 1], 9, 1.0),
    ("<answer> 6 / 4 * 2 </answer>", [6, 4, 2], 3, 1.0),  # float division
    ("<answer>1 + 2 + 3</answer>", [1, 2, 3], 9, 0.1),  # wrong value
    ("<answer>3 * 3</answer>", [3, 1], 9, 0.1),  # 3 reused, 1 unused
    ("<answer>3 * 3</answer>", [3, 3, 1], 9, 0.1),  # a number missing
    ("<answer>3 * 3 * 1</answer>", [3, 3, 1], 9, 1.0),
    ("<answer>1+1</answer> then <answer>(1+2)*3</answer>", [1, 2, 3], 9, 1.0),  # the last answer
    ("<answer>(1+2)*3</answer> then <answer>1+1</answer>", [1, 2, 3], 9, 0.1),
    # only after "Assistant:"
    ("User: <answer>(1+2)*3</answer> Assistant: no idea", [1, 2, 3], 9, 0.0),
    ("(1 + 2) * 3", [1, 2, 3], 9, 0.0),  # no answer tag
    # an answer does not span lines (TinyZero's regex)
    ("<answer>(1 + 2)\n* 3</answer>", [1, 2, 3], 9, 0.0),
    # "**" is not an operator: refused instantly
    ("<answer>9**9**9**9</answer>", [9, 9, 9, 9], 1, 0.1),
    ("<answer>2 / (1 - 1)</answer>", [2, 1, 1], 2, 0.1),  # division by zero
    ("<answer>" + "(" * 100 + "1" + ")" * 100 + "</answer>", [1], 1, 0.1),  # too deep
    ("<answer>" + "(" * 10**5 + "1" + ")" * 10**5 + "</answer>", [1], 1, 0.1),  # too long
    ("<answer>" + "1" * 10**6 + "</answer>", [1], 1, 0.1),  # 10**6-digit literal
    ("<answer>٣ + 5</answer>", [3, 5], 8, 0.1),  # Arabic-Indic digit is not a number here
    ("<answer>３ + 5</answer>", [3, 5], 8, 0.1),  # fullwidth digit
    ("<answer>1 + 2 × 3</answer>", [1, 2, 3], 7, 0.1),
    ("<answer>__import__('os').system('true')</answer>", [1], 1, 0.1),
    ("<answer>🙂</answer>", [1], 1, 0.1),
    ("", [1, 2], 3, 0.0),
    (None, [1, 2], 3, 0.0),
]


@pytest.mark.parametrize("response,numbers,target,expected", COUNTDOWN_CASES)
def test_countdown_cases(response, numbers, target, expected):
    start = time.perf_counter()
    assert tasks.countdown_reward(response, numbers, target) == expected
    # each is microseconds to milliseconds; 0.5 s is for a loaded machine
    assert time.perf_counter() - start < 0.5


def test_countdown_scores_are_configurable_and_bad_arguments_score_zero():
    assert (
        tasks.countdown_reward("<answer>1+2</answer>", [1, 2], 3, format_score=0.0, score=2.0)
        == 2.0
    )
    assert tasks.countdown_reward("<answer>1+1</answer>", [1, 2], 3, format_score=0.0) == 0.0
    assert tasks.countdown_reward("<answer>1+2</answer>", None, 3) == 0.0
    assert tasks.countdown_reward("<answer>1+2</answer>", [1, 2], "x") == 0.0


@pytest.mark.parametrize(
    "expression,value",
    [
        ("2+3*4", 14.0),
        ("(2+3)*4", 20.0),
        ("-3+5", 2.0),
        ("8/2/2", 2.0),
        ("2-3-4", -5.0),
        ("--1", 1.0),
        ("3.5*2", 7.0),
        (" ( 1 ) ", 1.0),
        ("", None),
        ("1 2", None),
        ("()", None),
        ("1+", None),
        ("(1", None),
        ("1)", None),
        ("2**3", None),
        ("1/0", None),
        ("1/(2-2)", None),
        ("-" * 40 + "1", None),
        ("1e5", None),
        ("999999999999*999999999999", 999999999999.0 * 999999999999.0),
        ("9999999999999", None),
    ],
)
def test_evaluate_arithmetic(expression, value):
    assert tasks.evaluate_arithmetic(expression) == value


def random_expression(draw, depth=0):
    kind = draw(st.integers(0, 3 if depth < 4 else 0))
    if kind == 0:
        return str(draw(st.integers(0, 100)))
    if kind == 1:
        return "(" + random_expression(draw, depth + 1) + ")"
    if kind == 2:
        return "-" + random_expression(draw, depth + 1)
    op = draw(st.sampled_from(["+", "-", "*", "/"]))
    return random_expression(draw, depth + 1) + f" {op} " + random_expression(draw, depth + 1)


@FUZZ
@given(st.data())
def test_evaluate_arithmetic_parity_with_python(data):
    """On expressions WE generate (numbers, + - * /, parentheses), the evaluator agrees with
    Python's arithmetic."""
    expression = random_expression(data.draw)
    try:
        # safe: the test built this string
        expected = float(eval(expression, {"__builtins__": {}}, {}))
    except ZeroDivisionError:
        expected = None
    got = tasks.evaluate_arithmetic(expression)
    if expected is None or len(expression) > tasks.COUNTDOWN_MAX_EQUATION_CHARS:
        assert got is None  # division by zero, or longer than the evaluator accepts
    else:
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# Totality: every reward function returns a number in [0, 1] for any string, quickly
# ---------------------------------------------------------------------------------------------------------------


def assert_score(value, low=0.0, high=1.0):
    assert isinstance(value, (int, float)) and not isinstance(value, bool)
    assert math.isfinite(value) and low <= value <= high


@FUZZ
@given(hostile_text, hostile_text)
def test_fuzz_every_reward_function(response, other):
    start = time.perf_counter()
    for mode in ("strict", "flexible", "normalized"):
        assert_score(tasks.gsm8k_reward(response, "42", mode))
        assert_score(tasks.gsm8k_reward(response, other, mode))
    assert_score(tasks.countdown_reward(response, [1, 2, 3], 6))
    assert_score(
        tasks.countdown_reward("Assistant: <answer>" + response + "</answer>", [1, 2, 3], 6)
    )
    assert_score(tasks.copy_reward(response, "abc"))
    assert_score(tasks.copy_reward(response, other))
    assert_score(tasks.tiny_hidden_score(response))
    value = tasks.evaluate_arithmetic(response)
    assert value is None or math.isfinite(value)
    assert time.perf_counter() - start < 1.0


def test_copy_task_and_tiny_task_rewards():
    pairs = tasks.make_copy_task(5, seed=0)
    assert all(p == t + "=" for p, t in pairs) and pairs == tasks.make_copy_task(5, seed=0)
    assert tasks.copy_reward("abc", "abc") == 1.0 and tasks.copy_reward("abcd", "abc") == 0.75
    assert tasks.tiny_hidden_score("aeiou") == 1.0 and tasks.tiny_hidden_score("xyz ") == 0.0
    assert tasks.tiny_hidden_score("ab") == 0.5 and tasks.tiny_hidden_score("") == 0.0
    queries = tasks.tiny_queries(50, seed=3)
    assert queries == tasks.tiny_queries(50, seed=3) and queries != tasks.tiny_queries(50, seed=4)
    assert all(4 <= len(q) <= 8 and set(q) <= set(tasks.TINY_QUERY_ALPHABET) for q in queries)


# ---------------------------------------------------------------------------------------------------------------
# Training end to end
# ---------------------------------------------------------------------------------------------------------------


def read_metrics(path):
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_bad_arguments_fail_before_loading(tmp_path):
    tiny = replace(rewards.PRESETS["tiny"][1], output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="^--num-train 100 must be divisible by --batch-size 32$"):
        rewards.train(replace(tiny, num_train=100))
    with pytest.raises(ValueError, match="must all be 'tiny' or none"):
        rewards.train(replace(tiny, label_source="labels.json"))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lr": -1.0}, "--lr must be > 0, got -1.0"),
        ({"temperature": 0.0}, "--temperature must be > 0, got 0.0"),
        ({"batch_size": 0}, "--batch-size must be >= 1, got 0"),
        ({"num_test": -1}, "--num-test must be >= 0, got -1"),
        ({"kl_samples": -2}, "--kl-samples must be >= 0, got -2"),
        ({"batch_size": 3, "num_train": 9}, "--batch-size 3 must be divisible by the world size 2"),
        ({"rollout_batch_size": 5}, "--rollout-batch-size 5 must be divisible by the world size 2"),
        (
            {"normalize_samples": 3},
            "--normalize-samples must be >= 2 per rank to estimate a std, got 3",
        ),
        ({"optimizer": "sgd"}, "--optimizer must be one of adam_tf, adam, got 'sgd'"),
        ({"num_test": None}, "--num-test must be set with --label-source tiny"),
        (
            {"query_suffix": "x"},
            "--start-text, --end-text, --query-prefix and --query-suffix must be empty",
        ),
        (
            {"output_dir": "/proc/no_such_dir/x"},
            "--output-dir '/proc/no_such_dir/x': cannot be created",
        ),
    ],
)
def test_check_args_refuses_every_bad_flag_in_one_line(tmp_path, overrides, message):
    """Every flag with a meaningful range is refused by check_args (2 ranks here), the message
    starting with the flag as typed on the command line, before anything is loaded or written."""
    args = replace(rewards.PRESETS["tiny"][1], **{"output_dir": str(tmp_path / "out"), **overrides})
    with pytest.raises(ValueError) as error:
        rewards.check_args(args, 2)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)
    assert not (tmp_path / "out").exists()


def test_check_args_refuses_missing_models_labels_and_query_files(tmp_path):
    gpt2 = replace(
        rewards.PRESETS["gpt2_sentiment"][1], output_dir=str(tmp_path / "out"), num_train=32
    )
    labels = tmp_path / "labels.json"
    # 40 best-of-4 records (check_args reads and checks a local label file)
    samples = {f"sample{k}": [2, 3] for k in range(rewards.NUM_SAMPLES)}
    labels.write_text(json.dumps([{"query": [1], **samples, "best": 0}] * 40))
    model_dir = str(tmp_path / "model")
    os.makedirs(model_dir)
    ok = replace(gpt2, base_model=model_dir, label_source=str(labels))
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(
        ValueError,
        match=f"^--base-model '{missing}': not a local directory, and its config could "
        "not be read from the Hub",
    ):
        rewards.check_args(replace(ok, base_model=missing), 1)
    with pytest.raises(
        ValueError, match="^--label-source 'nolabels.json' must be tiny, lexicon, a label file or"
    ):
        rewards.check_args(replace(ok, label_source="nolabels.json"), 1)
    with pytest.raises(
        ValueError, match=f"^--num-train \\+ --num-test = 4992 exceeds the 40 labels of {labels}"
    ):
        rewards.check_args(replace(ok, num_train=4992), 1)
    with pytest.raises(ValueError, match="^--query-dataset 'nothing.parquet' must be one of"):
        rewards.check_args(replace(ok, query_dataset="nothing.parquet"), 1)
    assert not (tmp_path / "out").exists()
    rewards.check_args(ok, 1)
    assert (tmp_path / "out").is_dir()  # the last check creates the output directory


@pytest.fixture(scope="module")
def trained_tiny(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rm_tiny"))
    # rollout batches of 256 (not the preset's 512): normalisation draws whole batches, so the
    # 256-sample check would otherwise sample 512; 32 KL samples per evaluation. Keeps this fixture
    # near its old cost.
    args = replace(
        rewards.PRESETS["tiny"][1],
        output_dir=out,
        num_train=512,
        num_test=256,
        eval_every=8,
        rollout_batch_size=256,
        kl_samples=32,
    )
    return rewards.train(args), out


def test_train_tiny_learns_and_checkpoint_reloads(trained_tiny):
    path, out = trained_tiny
    assert path == os.path.join(out, "reward_model")
    records = read_metrics(out)
    train_steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train_steps] == list(range(1, 17))
    assert train_steps[-1]["train/lr"] == pytest.approx(1e-3 / 16)  # annealed linearly towards 0
    final_accuracy = [r["test/accuracy"] for r in records if "test/accuracy" in r][-1]
    assert final_accuracy >= 0.5, final_accuracy  # chance is 0.25
    after = next(r for r in records if "normalize_after/mean_after" in r)
    assert (
        abs(after["normalize_after/mean_after"]) < 0.5
        and abs(after["normalize_after/std_after"] - 1) < 0.35
    )
    # train/kl at each evaluation (steps 8 and 16): the backbone drifted from the pretrained policy,
    # KL > 0
    kl = [(r["step"], r["train/kl"]) for r in records if "train/kl" in r]
    assert [step for step, _ in kl] == [8, 16] and all(value > 0 for _, value in kl), kl
    with open(os.path.join(out, "args.json")) as f:
        assert json.load(f)["script"] == "rewards"

    # reload: identical outputs, gain/bias from the after-training normalisation
    from transformers import AutoTokenizer

    model = rewards.load_reward_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    pad = tokenizer.pad_token_id
    assert model.reward_gain.item() == pytest.approx(after["normalize_after/gain"])
    assert model.reward_bias.item() == pytest.approx(after["normalize_after/bias"])
    with open(os.path.join(out, "tiny_labels.json")) as f:
        labels = json.load(f)
    reloaded = rewards.load_reward_model(path)
    with torch.no_grad():
        logits, best = rewards.best_of_4_logits(model, labels, list(range(512, 576)), pad, "cpu")
        torch.testing.assert_close(
            logits,
            rewards.best_of_4_logits(reloaded, labels, list(range(512, 576)), pad, "cpu")[0],
            atol=0,
            rtol=0,
        )
        # and it ranks held-out samples like the hidden rule far above chance
        accuracy = (logits.argmax(1) == best).float().mean().item()
    assert accuracy >= 0.5


def test_a_reward_head_file_that_does_not_match_is_refused(trained_tiny, tmp_path):
    """load_reward_model loads the head, gain and bias by name: a file that lacks one or holds
    another is refused, rather than leaving a freshly initialised parameter in a model that looks
    loaded."""
    path = str(tmp_path / "reward_model")
    shutil.copytree(trained_tiny[0], path)
    head_file = os.path.join(path, rewards.REWARD_HEAD_FILE)
    head = torch.load(head_file, weights_only=True)
    del head["reward_bias"]
    torch.save({**head, "value_head.weight": torch.zeros(1)}, head_file)
    with pytest.raises(ValueError, match=r"\['value_head.weight', 'reward_bias'\]"):
        rewards.load_reward_model(path)


def test_torchrun_two_processes(tmp_path):
    out = str(tmp_path / "ddp")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(ROOT, "rewards.py"),
        "tiny",
        "--output-dir",
        out,
        "--num-train",
        "128",
        "--num-test",
        "64",
        "--normalize-samples",
        "64",
        "--debug-normalize",
        "64",
        "--eval-every",
        "2",
        "--rollout-batch-size",
        "64",
        "--kl-samples",
        "16",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(out)
    with open(os.path.join(out, "args.json")) as f:
        assert json.load(f)["world_size"] == 2
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4]
    assert any("test/accuracy" in r for r in records)
    # both ranks end with the same parameters: the all-reduced gradients kept them in sync
    checksum = [
        r["debug/rank_param_checksum_max_diff"]
        for r in records
        if "debug/rank_param_checksum_max_diff" in r
    ]
    assert checksum == [0.0]
    assert os.path.exists(os.path.join(out, "reward_model", rewards.REWARD_HEAD_FILE))


# ---------------------------------------------------------------------------------------------------------------
# OpenAI fidelity: normalisation sample counts, query trimming/formatting, query sources (bookcorpus
# Parquet, TL;DR JSON) read offline from tiny local files in the same formats, the backbone KL
# metric
# ---------------------------------------------------------------------------------------------------------------


def test_normalization_draws_whole_rollout_batches():
    """train_reward.py sample_policy_responses: ceil(n / rollout_batch_size) whole batches.
    launch.py's books tasks ask 256 with rollout batches of 512, so 512 are drawn; TL;DR asks 256 of
    128, so 256."""
    assert rewards.normalization_sample_count(256, 512) == 512
    assert rewards.normalization_sample_count(256, 128) == 256
    assert rewards.normalization_sample_count(300, 128) == 384
    assert rewards.normalization_sample_count(1024, 512) == 1024
    assert rewards.normalization_sample_count(0, 512) == 0


def test_trim_query_tokens_follows_openai_datasets_py():
    """Hand-worked cases of language/datasets.py (start token ".", end token "." as launch.py's
    books task; tokens are ints, 9 stands for ".")."""
    trim = rewards.trim_query_tokens
    # after first ".", up to last
    assert trim([1, 2, 9, 3, 4, 9, 5], 10, start_token=9, end_token=9) == [3, 4, 9]
    assert trim([1, 2, 3], 10, start_token=9) is None  # no start token: skipped
    assert trim([1, 2, 9], 10, start_token=9) == [1, 2, 9]  # "." is the last token: kept whole
    # [1, 2, 3] has no end token: skipped
    assert trim([9, 1, 2, 3, 9, 4], 3, start_token=9, end_token=9) is None
    # cut to 3, then at the last "."
    assert trim([9, 1, 9, 3, 9, 4], 3, start_token=9, end_token=9) == [1, 9]
    assert trim([5, 6, 7, 8], 2) == [5, 6]  # no trimming: just the first query_length tokens


def test_format_queries_puts_prefix_and_suffix_around_the_real_tokens():
    pad = 0
    raw = torch.tensor([[pad, pad, 5, 6], [7, 8, 9, 10]])
    out = rewards.format_queries(raw, [1], [2, 3], pad)
    assert out.tolist() == [[pad, pad, 1, 5, 6, 2, 3], [1, 7, 8, 9, 10, 2, 3]]
    assert rewards.format_queries(raw, [], [], pad).tolist() == raw.tolist()


def write_bookcorpus_parquet(path, n=40):
    """A tiny file with the schema of the Hub's bookcorpus Parquet files: one string column
    "text"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"sentence number {i} ." for i in range(n)]}), path)


def test_bookcorpus_parquet_loader_shuffles_once_and_shards_by_rank(tmp_path):
    """The query stream on a local Parquet file of bookcorpus's schema, read by the same code as the
    Hub's files: one shuffle with the shared seed, rank r of W takes rows r, r+W, ...: the two
    ranks' first 20 queries are disjoint and together are exactly the single process's first 40 (so
    8 ranks never share a query, unlike independent per-rank shuffles)."""
    path = str(tmp_path / "train-00000-of-00001.parquet")
    write_bookcorpus_parquet(path)
    assert len(rewards.load_query_dataset(path)) == 40
    take = lambda it, n: [next(it) for _ in range(n)]  # noqa: E731
    single = take(rewards.query_texts(path, 3, local_seed=0), 40)
    rank0 = take(rewards.query_texts(path, 3, local_seed=0, rank=0, world_size=2), 20)
    rank1 = take(rewards.query_texts(path, 3, local_seed=100003, rank=1, world_size=2), 20)
    # a permutation of the corpus
    assert sorted(single) == sorted(f"sentence number {i} ." for i in range(40))
    assert single != [f"sentence number {i} ." for i in range(40)]  # shuffled
    assert not set(rank0) & set(rank1) and sorted(rank0 + rank1) == sorted(single)
    assert rank0 == single[0::2] and rank1 == single[1::2]
    other_seed = take(rewards.query_texts(path, 4, local_seed=0), 40)
    assert other_seed != single


# OpenAI's tldr/{train,valid}-subset.json: a JSON list of posts; "content" is the query text
TLDR_POSTS = [
    {
        "id": "a1",
        "subreddit": "relationships",
        "title": "t1",
        "content": "my cat sat\n\n\n\non the mat  ",
        "summary": "cat",
    },
    {
        "id": "a2",
        "subreddit": "tifu",
        "title": "t2",
        "content": "  i ate the cake",
        "summary": "cake",
    },
]


def test_tldr_loader_reads_openai_json_and_cleans_text(tmp_path, monkeypatch):
    """The TL;DR code path offline: OPENAI_TLDR_URL pointed at a local file of the same format; as
    datasets/tldr.py, 3+ newlines become 2 and the text is stripped."""
    path = tmp_path / "train-subset.json"
    path.write_text(json.dumps(TLDR_POSTS))
    monkeypatch.setattr(rewards, "OPENAI_TLDR_URL", str(path))
    dataset = rewards.load_query_dataset("tldr")
    assert sorted(dataset["text"]) == ["i ate the cake", "my cat sat\n\non the mat"]


def test_tldr_normalization_samples_raw_query_plus_response(tiny_policy, tmp_path, monkeypatch):
    """The gpt2_tldr preset's normalisation path with the tiny policy: the policy samples from query
    + suffix, the returned rows (what the reward model scores) are the RAW query + response, as
    train_reward.py."""
    policy, tokenizer = tiny_policy
    path = tmp_path / "train-subset.json"
    path.write_text(json.dumps(TLDR_POSTS * 4))
    monkeypatch.setattr(rewards, "OPENAI_TLDR_URL", str(path))
    args = replace(rewards.PRESETS["gpt2_tldr"][1], query_length=12, response_length=5)
    assert args.query_suffix == "\n\nTL;DR:" and args.query_dataset == "tldr"
    pad = tokenizer.pad_token_id
    raw, queries = rewards.next_query_batch(
        rewards.query_texts(args.query_dataset, args.seed, 0),
        tokenizer,
        4,
        args.query_length,
        query_suffix=args.query_suffix,
    )
    # the policy sees the suffix
    assert queries.shape[1] == 12 + len(tokenizer.encode(args.query_suffix))
    rows = rewards.sample_normalization_batch(
        policy, raw, queries, pad, args.response_length, args.temperature, 4
    )
    assert rows.shape == (4, 12 + 5)
    queries = {tokenizer.decode(r[:12][r[:12] != pad]) for r in rows}
    assert queries <= {"i ate the cake"[:12], "my cat sat\n\non the mat"[:12]}  # raw, no suffix
    assert (rows[:, 12:] != pad).all()


def test_backbone_kl_is_zero_for_the_pretrained_weights_and_grows_with_drift(tiny_policy):
    """train/kl ([repro] train_reward_accelerate.py): sum over response tokens of log p_backbone -
    log p_policy on samples of the backbone. Same weights: exactly 0. Perturbed backbone: positive
    (a KL, estimated on 64 samples of 16 tokens; the perturbation makes it large compared with its
    sampling noise)."""
    policy, tokenizer = tiny_policy
    import copy

    reward_model = rewards.RewardModel(copy.deepcopy(policy))
    texts, pad = rewards.query_texts("tiny", 1, local_seed=5), tokenizer.pad_token_id

    def kl():  # 64 fresh tiny queries, 16-token responses at temperature 0.7, as the tiny preset
        queries = rewards.next_query_batch(texts, tokenizer, 64, 8)[1]
        return rewards.backbone_kl(reward_model, policy, queries, pad, 16, 0.7, 64)

    torch.manual_seed(0)
    assert kl() == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        for p in reward_model.backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert kl() > 0.5


def test_cli_bad_flag_is_one_line_exit_2_before_any_model_loads(tmp_path):
    out = tmp_path / "bad"
    proc = subprocess.run(
        [sys.executable, "rewards.py", "tiny", "--output-dir", str(out), "--num-train", "7"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2  # argparse's convention for bad input, as grpo.py and ppo_rlhf.py
    lines = proc.stderr.strip().splitlines()
    assert lines == ["rewards.py: error: --num-train 7 must be divisible by --batch-size 32"]
    assert not out.exists()  # nothing was built or loaded
