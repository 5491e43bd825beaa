"""Tests for scripts/compare.py: parsing, the seed band, the refusals, a full-size synthetic gpt2
run, health bands.

Offline, no model: every run here is a hand-written metrics.jsonl. Budget: a few seconds
(scripts/docs <= 30 s).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "compare", os.path.join(ROOT, "scripts", "compare.py")
)
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)

PPO_METRICS = [
    "objective/scores",
    "objective/kl",
    "objective/kl_coef",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/score_total",
    "ppo/policy/approxkl_avg",
    "ppo/policy/clipfrac_avg",
    "ppo/loss/policy_avg",
    "ppo/loss/value_avg",
    "ppo/lr",
    "ppo/episode",
]


def write_run(run_dir, records, args=None):
    """A run directory: metrics.jsonl from a list of dicts (or raw strings, written as they are),
    optional args.json."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    if args is not None:
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(args, f)
    return str(run_dir)


def gpt2_like_records(seed, n_updates=1953, batch=512):
    """A synthetic run shaped like a full gpt2 sentiment run: every ppo_rlhf.py metric at every PPO
    update."""
    rng = np.random.default_rng(seed)
    records = []
    for step in range(1, n_updates + 1):
        t = step / n_updates
        score = (
            1.8 * (1 - math.exp(-4 * t)) / (1 - math.exp(-4))
            + 0.05 * rng.standard_normal()
            + 0.02 * seed
        )
        kl = 6 * (1 - math.exp(-step / 100)) + 0.3 * rng.standard_normal()
        kl_coef = 0.15 + 0.1 * t
        records.append(
            {
                "step": step,
                "objective/scores": score,
                "objective/kl": kl,
                "objective/kl_coef": kl_coef,
                "objective/entropy": 60 - 16 * t + rng.standard_normal(),
                "objective/non_score_reward": -kl_coef * kl,
                "objective/score_total": score - kl_coef * kl,
                "ppo/policy/approxkl_avg": 4e-4,
                "ppo/policy/clipfrac_avg": 5e-3,
                "ppo/loss/policy_avg": -0.01,
                "ppo/loss/value_avg": 0.1,
                "ppo/lr": 1e-5,
                "ppo/episode": step * batch,
            }
        )
    return records


def make_args(run_dirs, baseline, out, **kw):
    return compare.Args(run_dirs=list(run_dirs), baseline=baseline, output_dir=str(out), **kw)


def assert_refused(args, *fragments):
    """compare() must exit with a one-line reason containing every fragment, and write nothing."""
    with pytest.raises(SystemExit) as e:
        compare.compare(args)
    message = str(e.value.code)
    assert message.startswith("compare.py: error: ") and "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert not os.path.exists(args.output_dir), "a refusal must not write anything"
    return message


# ---------------------------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------------------------
def test_parsing_missing_keys_blank_lines_and_repeated_steps(tmp_path):
    # an integral float step is a step
    run = write_run(
        tmp_path / "r",
        [
            {"step": 0, "reward/mean": 0.1},
            {"step": 1, "reward/mean": 0.2, "val/accuracy": 0.5},
            "",  # blank line: skipped
            {"step": 2, "reward/mean": 0.3, "val/accuracy": None},  # null = not logged on this line
            {
                "step": 3.0,
                "reward/mean": 0.4,
                "val/accuracy": 0.6,
            },
            {"step": 3, "reward/mean": 0.45},  # a repeated step (resumed run): the later line wins
        ],
    )
    path = os.path.join(run, "metrics.jsonl")
    records = compare.load_metrics(path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 3]
    assert [r["_line"] for r in records] == [1, 2, 4, 5, 6]
    assert compare.metric_series(records, "reward/mean", path) == {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.45}
    # only the lines that have it
    assert compare.metric_series(records, "val/accuracy", path) == {1: 0.5, 3: 0.6}
    assert compare.metric_series(records, "nope", path) == {}


@pytest.mark.parametrize(
    "bad_line, expected",
    [
        ('{"step": 2, "reward/mean": 0.3', "malformed JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"reward/mean": 0.3}', "non-integer 'step'"),
        ('{"step": "2", "reward/mean": 0.3}', "non-integer 'step'"),
        ('{"step": 2.5, "reward/mean": 0.3}', "non-integer 'step'"),
    ],
)
def test_malformed_metrics_file_names_file_and_line(tmp_path, bad_line, expected):
    run = write_run(
        tmp_path / "r", [{"step": 0, "reward/mean": 0.1}, {"step": 1, "reward/mean": 0.2}, bad_line]
    )
    message = assert_refused(make_args([run], "verl_gsm8k_qwen05b", tmp_path / "out"), expected)
    assert os.path.join(run, "metrics.jsonl") + ":3:" in message


def test_non_numeric_metric_value_names_line(tmp_path):
    run = write_run(
        tmp_path / "r",
        [
            {"step": 0, "val/accuracy": 0.1, "reward/mean": 0.0},
            {"step": 1, "val/accuracy": "n/a", "reward/mean": 0.0},
        ],
    )
    assert_refused(
        make_args([run], "verl_gsm8k_qwen05b", tmp_path / "out"), "metrics.jsonl:2:", "val/accuracy"
    )


def test_missing_or_empty_metrics_file(tmp_path):
    os.makedirs(tmp_path / "empty_dir")
    assert_refused(
        make_args([str(tmp_path / "empty_dir")], "gpt2_sentiment", tmp_path / "out"), "no such file"
    )
    run = write_run(tmp_path / "r", [""])
    assert_refused(make_args([run], "gpt2_sentiment", tmp_path / "out"), "no records")


def test_every_shipped_baseline_parses():
    names = sorted(f[:-4] for f in os.listdir(compare.BASELINES_DIR) if f.endswith(".csv"))
    assert {
        "gpt2_sentiment",
        "gpt2_descriptiveness",
        "rm_sentiment",
        "rm_descriptiveness",
        "adam_table",
        "verl_gsm8k_qwen05b",
        "rollout_corr_health",
    } <= set(names)
    for name in names:
        baseline = compare.load_baseline(name)
        assert any("source" in note for note in baseline["notes"]), (
            f"{name}: every baseline names its sources"
        )
        if baseline["x_kind"] == "table":
            continue
        for metric in compare.baseline_metrics(baseline):
            groups = compare.baseline_groups(baseline, metric)
            assert groups and all(g["shape"] in ("curve", "reference", "band") for g in groups)
    # spot checks of the published numbers
    sentiment = compare.load_baseline("gpt2_sentiment")
    assert sentiment["x_kind"] == "ppo_update" and sentiment["episodes_per_x"] == 512
    curve = compare.baseline_groups(sentiment, "objective/scores")[0]
    assert curve["shape"] == "curve" and [(r["x"], r["value"]) for r in curve["rows"]][-1] == (
        1953,
        1.8,
    )
    verl = compare.baseline_groups(compare.load_baseline("verl_gsm8k_qwen05b"), "val/accuracy")
    assert verl[0]["rows"][-1]["x"] == 429 and verl[0]["rows"][-1]["value"] == 0.543
    assert max(r["value"] for r in verl[0]["rows"]) == 0.579
    health = compare.baseline_groups(
        compare.load_baseline("rollout_corr_health"), "rollout_corr/rollout_is_mean"
    )
    assert health[0]["shape"] == "band" and (
        health[0]["rows"][0]["low"],
        health[0]["rows"][0]["high"],
    ) == (0.5, 2.0)


# ---------------------------------------------------------------------------------------------------------------
# the seed band
# ---------------------------------------------------------------------------------------------------------------
def test_align_seeds_keeps_common_steps_and_band_is_right():
    # three seeds of different lengths (and one with a hole at step 2): common steps are 0, 1, 3
    series = [
        {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0},
        {0: 3.0, 1: 4.0, 3: 8.0},
        {0: 2.0, 1: 6.0, 2: 0.0, 3: 6.0},
    ]
    steps, values = compare.align_seeds(series)
    assert steps.tolist() == [0, 1, 3]
    assert values.tolist() == [[1, 2, 4], [3, 4, 8], [2, 6, 6]]
    mean, low, high = compare.seed_band(values, "minmax")
    assert mean.tolist() == [2.0, 4.0, 6.0]
    assert low.tolist() == [1.0, 2.0, 4.0] and high.tolist() == [3.0, 6.0, 8.0]
    mean, low, high = compare.seed_band(values, "std")
    # population std at step 0: sqrt(2/3)
    std = math.sqrt(((1 - 2) ** 2 + (3 - 2) ** 2 + (2 - 2) ** 2) / 3)
    assert low[0] == pytest.approx(2 - std) and high[0] == pytest.approx(2 + std)
    std_step1 = math.sqrt((4 + 0 + 4) / 3)  # values 2, 4, 6 around 4
    assert high[1] == pytest.approx(4 + std_step1)


def test_final_value_is_taken_at_the_last_common_step(tmp_path):
    # seed a runs to step 4, seed b stops at step 2: the final value compared is at step 2 for both
    a = write_run(
        tmp_path / "a",
        [
            {"step": s, "reward/mean": 0, "val/accuracy": v}
            for s, v in [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.9), (4, 0.95)]
        ],
    )
    b = write_run(
        tmp_path / "b",
        [
            {"step": s, "reward/mean": 0, "val/accuracy": v}
            for s, v in [(0, 0.1), (1, 0.3), (2, 0.5)]
        ],
    )
    out = compare.compare(make_args([a, b], "verl_gsm8k_qwen05b", tmp_path / "out"))
    table = open(out["markdown"]).read()
    # mean of 0.3 and 0.5 = 0.4, population std 0.1, baseline final 0.543 at x=429 -> ratio 0.4 /
    # 0.543
    assert "| val/accuracy | 0.4 ± 0.1 (n=2, step 2) | 0.543 (x=429) | 0.737 |" in table
    # the other published values are listed
    assert "verl GRPO-LoRA Qwen2.5-1.5B-Instruct: 0.779 (final)" in table
    assert os.path.getsize(out["png"]) > 10_000


# ---------------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------------
def test_refuses_metric_missing_from_a_run(tmp_path):
    good = write_run(tmp_path / "a", gpt2_like_records(0, n_updates=5))
    bad = write_run(
        tmp_path / "b",
        [
            {k: v for k, v in r.items() if k != "objective/entropy"}
            for r in gpt2_like_records(1, n_updates=5)
        ],
    )
    assert_refused(
        make_args([good, bad], "gpt2_sentiment", tmp_path / "out"),
        "'objective/entropy' is missing from",
        os.path.join(bad, "metrics.jsonl"),
    )


def test_refuses_metric_missing_from_the_baseline(tmp_path):
    run = write_run(tmp_path / "a", gpt2_like_records(0, n_updates=5))
    assert_refused(
        make_args([run], "gpt2_sentiment", tmp_path / "out", metrics=("ppo/lr",)),
        "'ppo/lr' is not in baseline gpt2_sentiment",
    )


def test_refuses_x_axis_kind_mismatch(tmp_path):
    # a GRPO run (told by its metrics) against a PPO-update baseline
    grpo_run = write_run(
        tmp_path / "g",
        [{"step": s, "reward/mean": 0.1 * s, "objective/scores": 1.0} for s in range(3)],
        args={"script": "grpo"},
    )
    assert_refused(
        make_args([grpo_run], "gpt2_sentiment", tmp_path / "out", metrics=("objective/scores",)),
        "x-axis mismatch",
        "grpo_step",
        "ppo_update",
    )
    # args.json wins over the metrics: the same lines, but the run says it is ppo_rlhf.py ->
    # accepted
    ppo_run = write_run(
        tmp_path / "p",
        [{"step": s, "reward/mean": 0.1 * s, "objective/scores": 1.0} for s in range(3)],
        args={"exp_name": "ppo_rlhf", "seed": 1},
    )
    assert compare.compare(
        make_args([ppo_run], "gpt2_sentiment", tmp_path / "ok", metrics=("objective/scores",))
    )["png"]
    # a PPO run (told by its metrics, no args.json) against the GSM8K (grpo_step) baseline
    ppo_by_metrics = write_run(
        tmp_path / "q", [dict(r, **{"val/accuracy": 0.5}) for r in gpt2_like_records(0, 3)]
    )
    assert_refused(
        make_args([ppo_by_metrics], "verl_gsm8k_qwen05b", tmp_path / "out"), "x-axis mismatch"
    )


def test_refuses_runs_of_different_kinds_and_unknown_kind(tmp_path):
    ppo = write_run(tmp_path / "p", gpt2_like_records(0, n_updates=3))
    grpo = write_run(tmp_path / "g", [{"step": 0, "reward/mean": 0.1, "rollout_corr/kl": 0.0}])
    assert_refused(
        make_args([ppo, grpo], "rollout_corr_health", tmp_path / "out"), "count different steps"
    )
    unknown = write_run(tmp_path / "u", [{"step": 0, "rollout_corr/kl": 0.0}])
    assert_refused(
        make_args([unknown], "rollout_corr_health", tmp_path / "out"), "cannot tell which script"
    )


def test_refuses_unknown_baseline_and_seeds_without_common_step(tmp_path):
    run = write_run(tmp_path / "a", gpt2_like_records(0, n_updates=3))
    assert_refused(
        make_args([run], "no_such_baseline", tmp_path / "out"), "unknown baseline", "gpt2_sentiment"
    )
    a = write_run(tmp_path / "x", [{"step": 0, "reward/mean": 0.1, "val/accuracy": 0.1}])
    b = write_run(tmp_path / "y", [{"step": 5, "reward/mean": 0.1, "val/accuracy": 0.1}])
    assert_refused(make_args([a, b], "verl_gsm8k_qwen05b", tmp_path / "out"), "share no step")


def test_refuses_episode_axis_without_episodes(tmp_path):
    run = write_run(
        tmp_path / "a",
        [
            {k: v for k, v in r.items() if k != "ppo/episode"}
            for r in gpt2_like_records(0, n_updates=3)
        ],
    )
    assert_refused(make_args([run], "gpt2_sentiment", tmp_path / "out", x="episode"), "ppo/episode")


def test_cli_refusal_is_one_line_and_nonzero(tmp_path):
    run = write_run(
        tmp_path / "a", ['{"step": 0, "reward/mean": 0.1}', '{"step": 1, "reward/mean": oops}']
    )
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "compare.py"),
            run,
            "--baseline",
            "verl_gsm8k_qwen05b",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert (
        result.stderr.strip().count("\n") == 0
        and "metrics.jsonl:2: malformed JSON" in result.stderr
    )
    assert not os.path.exists(tmp_path / "out")


# ---------------------------------------------------------------------------------------------------------------
# a full-size gpt2 run, the episode axis, the table baseline
# ---------------------------------------------------------------------------------------------------------------
def test_full_gpt2_run_writes_png_and_table(tmp_path):
    runs = [
        write_run(
            tmp_path / f"seed{s}", gpt2_like_records(s), args={"exp_name": "ppo_rlhf", "seed": s}
        )
        for s in range(3)
    ]
    out = compare.compare(make_args(runs, "gpt2_sentiment", tmp_path / "out"))
    with open(out["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(out["png"]) > 30_000
    table = open(out["markdown"]).read()
    # the final value row, computed here from the same records
    finals = np.array([gpt2_like_records(s)[-1]["objective/scores"] for s in range(3)])
    row = next(line for line in table.splitlines() if line.startswith("| objective/scores |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == f"{finals.mean():.4g} ± {finals.std():.2g} (n=3, step 1953)"
    assert cells[2] == "1.8 (x=1953)" and cells[3] == f"{finals.mean() / 1.8:.3f}"
    for metric in ("objective/kl", "objective/kl_coef", "objective/entropy"):
        assert f"| {metric} |" in table
    assert "openai lm-human-preferences (original TF1 run): 1.85 (final)" in table
    assert "APPROXIMATE" in table  # the baseline's notes travel with the numbers


def test_episode_axis_runs_through_cli(tmp_path):
    run = write_run(tmp_path / "a", gpt2_like_records(0, n_updates=40))
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "compare.py"),
            run,
            "--baseline",
            "gpt2_descriptiveness",
            "--metrics",
            "objective/scores",
            "objective/kl",
            "--x",
            "episode",
            "--band",
            "std",
            "--output-dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert os.path.isfile(tmp_path / "out" / "compare_gpt2_descriptiveness.png")
    assert "| objective/scores |" in result.stdout and "| objective/entropy |" not in result.stdout


def test_table_baseline_is_printed_not_plotted(tmp_path, capsys):
    run = write_run(tmp_path / "a", gpt2_like_records(0, n_updates=3))
    out = compare.compare(make_args([run], "adam_table", tmp_path / "out"))
    assert out["png"] is None and not any(f.endswith(".png") for f in os.listdir(tmp_path / "out"))
    printed = capsys.readouterr().out
    assert "| approxkl | 0.00037 | 0.00237 | 0.000375 |" in printed
    assert "| ratio_min | 0.74 | 0.401 | 0.73 |" in printed


# ---------------------------------------------------------------------------------------------------------------
# health bands
# ---------------------------------------------------------------------------------------------------------------
def test_health_bands_in_table_and_plot(tmp_path):
    def grpo_records(seed, is_mean):
        return [
            {
                "step": s,
                "reward/mean": 0.1 * s,
                "rollout_corr/rollout_is_mean": is_mean + 0.01 * seed,
                "rollout_corr/rollout_is_eff_sample_size": 0.9,
                "rollout_corr/rollout_is_std": 0.2,
                "rollout_corr/kl": 0.3,
                "rollout_corr/chi2_token": 0.05,
            }
            for s in range(20)
        ]

    runs = [write_run(tmp_path / f"s{s}", grpo_records(s, 1.0)) for s in range(2)]
    out = compare.compare(make_args(runs, "rollout_corr_health", tmp_path / "out"))
    table = open(out["markdown"]).read()
    assert (
        "| rollout_corr/rollout_is_mean | 1.005 ± 0.005 (n=2, step 19) | healthy [0.5, 2] | inside |"
        in table
    )
    assert (
        "| rollout_corr/rollout_is_eff_sample_size |" in table
        and "healthy [0.3, +inf] | inside |" in table
    )
    assert "healthy [-0.1, 0.1] | OUTSIDE |" in table  # kl = 0.3 is outside |kl| <= 0.1
    assert os.path.getsize(out["png"]) > 10_000


def test_band_is_drawn_where_the_range_is():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 10], [0.8, 0.9])  # ESS data well above its lower bound 0.3
    compare.draw_band_rows(ax, {"low": 0.3, "high": None}, "healthy")
    (span,) = [p for p in ax.patches]  # axhspan draws one rectangle
    y0, y1 = span.get_extents().transformed(ax.transData.inverted()).get_points()[:, 1]
    ymin, ymax = ax.get_ylim()
    assert y0 == pytest.approx(0.3, abs=1e-6)  # starts at the bound
    # unbounded above: up to the panel's top edge
    assert y1 == pytest.approx(ymax, abs=1e-6) and ymax > 0.9
    assert ymin < 0.3  # the bound itself is visible
    plt.close(fig)


def test_reward_model_run_against_final_only_baseline(tmp_path):
    # rewards.py logs train/loss every step and test/* now and then; the baseline has only a final
    # value (x unknown)
    records = [{"step": s, "train/loss": 1.386 - 0.002 * s} for s in range(100)]
    records += [{"step": 99, "test/accuracy": 0.6, "test/loss": 1.2}]
    run = write_run(tmp_path / "rm", records)
    out = compare.compare(make_args([run], "rm_sentiment", tmp_path / "out"))
    table = open(out["markdown"]).read()
    # final train/loss = 1.386 - 0.198 = 1.188; ratio to the published 1.23
    assert f"| train/loss | 1.188 ± 0 (n=1, step 99) | 1.23 (final) | {1.188 / 1.23:.3f} |" in table
    assert "chance (ln 4): 1.386 (final)" in table
    # the same run against a PPO baseline is refused: a reward-model step is not a PPO update
    assert_refused(
        make_args([run], "gpt2_sentiment", tmp_path / "out2", metrics=("objective/scores",)),
        "x-axis mismatch",
        "rm_step",
    )


# ---------------------------------------------------------------------------------------------------------------
# --baseline none: our seeds only (the tiny presets have no published curve)
# ---------------------------------------------------------------------------------------------------------------
def test_baseline_none_plots_only_our_seed_band(tmp_path):
    runs = [
        write_run(
            tmp_path / f"s{s}",
            [
                {"step": step, "objective/scores": 0.1 * step + s, "objective/kl": 1.0}
                for step in range(1, 11)
            ],
        )
        for s in range(3)
    ]
    out = compare.compare(
        make_args(runs, "none", tmp_path / "out", metrics=("objective/scores", "objective/kl"))
    )
    assert out["png"].endswith("compare_none.png") and os.path.getsize(out["png"]) > 10_000
    table = open(out["markdown"]).read()
    # final scores 1.0, 2.0, 3.0 at step 10: mean 2, population std sqrt(2/3) = 0.82
    assert "| objective/scores | 2 ± 0.82 (n=3, step 10) | no published baseline | - |" in table
    assert "| objective/kl | 1 ± 0 (n=3, step 10) | no published baseline | - |" in table
    assert table.startswith("# ours (no published baseline)")
    titled = compare.compare(
        make_args(runs, "none", tmp_path / "titled", metrics=("objective/kl",), title="tiny")
    )
    assert os.path.getsize(titled["png"]) > 10_000
    # without --metrics (and without --baseline: none is the default), the script's headline
    # metrics that every run logs: here objective/scores and objective/kl of ppo_rlhf.py's four
    headline = compare.compare(compare.Args(run_dirs=runs, output_dir=str(tmp_path / "out2")))
    table = open(headline["markdown"]).read()
    assert "| objective/scores | 2 ± 0.82" in table and "| objective/kl | 1 ± 0" in table
    assert "objective/kl_coef" not in table and "objective/entropy" not in table
    lacking = write_run(tmp_path / "lacking", [{"step": 1, "ppo/lr": 1e-5}])
    assert_refused(make_args([lacking], "none", tmp_path / "out5"), "no run logs any of")
    # a metric some run lacks is still refused, and so are runs of different kinds
    assert_refused(
        make_args(runs, "none", tmp_path / "out3", metrics=("objective/entropy",)),
        "'objective/entropy' is missing from",
    )
    rm = write_run(
        tmp_path / "rm",
        [{"step": 1, "train/loss": 1.3, "objective/kl": 1.0}],
        args={"script": "rewards"},
    )
    assert_refused(
        make_args([runs[0], rm], "none", tmp_path / "out4", metrics=("objective/kl",)),
        "count different steps",
    )


def test_objectives_figure_table_columns(tmp_path):
    """scripts/objectives_figure.py's table from hand-written grpo.py runs: the learns criterion,
    the entropy at --entropy-step, a --mean-of column ("-" where one seed did not log the key) and
    --solved-at (the first step of 5 in a row at or above the level; "-" where none)."""

    def run(rewards, clipfrac=None):
        rows = [{"step": 0, "val/accuracy": 0.0}]
        for step, reward in enumerate(rewards, start=1):
            row = {"step": step, "reward/mean": reward, "actor/entropy_loss": 1.0 / step}
            if clipfrac is not None:
                row["actor/pg_clipfrac"] = clipfrac * step
            rows.append(row)
        rows.append({"step": len(rewards), "val/accuracy": 0.9})
        return rows

    # a: solved from step 3 (steps 3-7 >= 0.95) in seed 1, never 5 in a row in seed 2
    write_run(tmp_path / "a_hf_s1", run([0.1, 0.5, 0.95, 1, 1, 1, 0.96, 0.9, 1, 1], 0.01))
    write_run(tmp_path / "a_hf_s2", run([0.1, 1, 1, 1, 1, 0.5, 1, 1, 1, 1], 0.02))
    write_run(tmp_path / "b_hf_s1", run([0.5] * 10, 0.01))
    write_run(tmp_path / "b_hf_s2", run([0.5] * 10))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "objectives_figure.py")]
        + ["A=a", "B=b", "--seeds", "1", "2", "--runs-dir", str(tmp_path), "--entropy-step", "4"]
        + ["--mean-of", "actor/pg_clipfrac", "--solved-at", "0.95"]
        + ["--out", str(tmp_path / "figure.png")],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ")]
    assert rows[0][-2:] == ["mean `actor/pg_clipfrac`", "reward >= 0.95 from step |"]
    a_row = rows[2]
    b_row = rows[3]
    # a: last-10 rewards 8.41 / 10 and 8.6 / 10, both >= 0.8 with val 0.9; b: 0.5
    assert a_row[1:5] == ["0.84 / 0.86", "0.00 / 0.00", "0.90 / 0.90", "2 of 2"]
    assert b_row[4] == "0 of 2"
    assert a_row[5] == "0.25 / 0.25"
    # the mean of clipfrac x step over steps 1-10: 5.5 x 0.01 and 5.5 x 0.02
    assert a_row[6] == "0.055 / 0.110"
    assert b_row[6] == "-"
    assert a_row[7] == "3 / - |"
    assert b_row[7] == "- / - |"
    assert os.path.exists(tmp_path / "figure.png")
