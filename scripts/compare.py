"""Compare our training curves (one config, several seeds) with a published baseline.

    python scripts/compare.py runs/sent_s1 runs/sent_s2 runs/sent_s3 --baseline gpt2_sentiment
    python scripts/compare.py runs/sent_s1 runs/sent_s2 --baseline gpt2_sentiment --metrics objective/scores objective/kl
    python scripts/compare.py runs/sent_s1 --baseline gpt2_sentiment --x episode --band std
    python scripts/compare.py runs/grpo_s1 runs/grpo_s2 --baseline rollout_corr_health
    python scripts/compare.py runs/ppo_s1 --baseline adam_table      # a table, not a curve: printed, not plotted
    python scripts/compare.py runs/tiny_s1 runs/tiny_s2 --baseline none --metrics objective/scores objective/kl
    python scripts/compare.py runs/grpo_s1 runs/grpo_s2          # no baseline: our seeds' headline curves

It writes `<output_dir>/compare_<baseline>.png` (one panel per metric: each seed faint, the seed
mean bold, a min-max or mean±std band, the published curve in black, published final values as
dotted lines, healthy ranges as green bands) and `<output_dir>/compare_<baseline>.md` (a table of
final values), and prints the table.

Inputs
------
RUN_DIR/metrics.jsonl: one JSON object per line, each with an integer `step` and flat metric keys
(`objective/scores`, `rollout_corr/kl`, ...). A line may lack keys other lines have (e.g.
`val/accuracy` every N steps): a metric's curve is made of the lines that have it (a null value
counts as absent). Blank lines are skipped. If a step appears twice (a resumed run), the later line
wins. RUN_DIR/args.json is optional (see "x-axis kinds").

Baseline CSV (baselines/NAME.csv, or a path to any .csv)
--------------------------------------------------------
Lines starting with `#` are header comments: `# x: KIND` (required: the x-axis kind, see below),
optionally `# episodes_per_x: 512` (lets `--x episode` convert the baseline's x), and free text (`#
source: ...`, `# note: ...`) that is copied under the markdown table. Then a CSV header
`x,metric,value,low,high,label` and one row per point:

    x      the baseline's x (e.g. PPO update). Empty: the row is not a point of a curve (see below).
    metric our metric name, so the curve lands on the panel of the same metric.
    value  the published value. low, high: optional range (a value read off a figure as "2.25-2.3").
    label  which published series the row belongs to (one file may hold e.g. a PPO curve and a GRPO final value).

Per (metric, label), the rows are one of three shapes:
    curve      rows with x                -> a line with markers (low/high as error bars)
    reference  one row, no x, a value     -> a final value only (x unknown): a dotted horizontal line
    band       one row, no x, no value    -> a healthy range [low, high] (one side may be empty = unbounded): a
                                             shaded band, not a curve
The first curve/reference label of a metric in the file is the "main" baseline whose final value
(the curve's point with the largest x) goes in the table; other labels are listed under the table.
`# x: table` marks a file that is a table of numbers and not a curve (adam_table.csv): compare.py
prints it and plots nothing.

`--baseline none` (the default): no published curve exists (the offline `tiny` presets) or none is
wanted: only our seeds, their mean and band are drawn (`--metrics`, or else the script's headline
metrics that every run logs: HEADLINE_METRICS), the x kind is not checked against anything (the
runs must still agree with each other), and the table gives our final values with "no published
baseline" in the baseline column.

x-axis kinds
------------
Each trainer counts its own step: ppo_rlhf.py -> `ppo_update`, grpo.py -> `grpo_step` (verl's
"training step" is the same unit: one rollout batch, then the policy updates on it), rewards.py ->
`rm_step` (reward-model training step). `# x: any` (health ranges) matches every kind. The kind of a
run is decided by, in order:
    1. args.json, if it has a `script` or `exp_name` field naming ppo_rlhf / grpo / rewards;
    2. else the metrics it logs: any `objective/*` or `ppo/*` key -> ppo_update; else `reward/mean` or
       `response_length/mean` -> grpo_step; else `test/accuracy` or `train/loss` -> rm_step;
    3. else it is unknown and compare.py refuses (add args.json with `"script": "grpo"`).

Several seeds
-------------
Seeds are aligned on the steps every run logged the metric at (the intersection of steps): runs of
different lengths are compared only where all of them have a value, so the mean never mixes 3 seeds
at one step and 1 at the next. On those steps: mean, min and max over seeds, and std over seeds
(population std, ddof=0: one run has std 0). Each run is also drawn faintly over all its own steps.
The "final value" of a metric is the value at the last common step; the table gives mean ± std of it
over seeds. With `--x episode`, x is the `ppo/episode` value the run logged at that step (the first
run's, for the mean curve: seeds of one config see the same number of episodes).

Refusals (exit status 1, a one-line reason on stderr, nothing written): a missing or malformed
metrics.jsonl (the file and line are named), a requested metric that some run never logs or that the
baseline does not have, runs whose x kind differs from the baseline's (or from each other's), seeds
that share no step, an unknown baseline.
"""

import csv
import json
import math
import os
from dataclasses import dataclass
from typing import Annotated, Literal

import matplotlib

matplotlib.use("Agg")  # no display: write files only (also keeps tests headless)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import tyro  # noqa: E402

BASELINES_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "baselines"
)
X_KINDS = ("ppo_update", "grpo_step", "rm_step", "any", "table")
X_LABELS = {
    "ppo_update": "PPO update",
    "grpo_step": "GRPO step",
    "rm_step": "reward-model training step",
}
# args.json script -> kind
SCRIPT_X_KIND = {"ppo_rlhf": "ppo_update", "grpo": "grpo_step", "rewards": "rm_step"}
# --baseline none without --metrics: each kind's headline curves (those every run logs are shown)
HEADLINE_METRICS = {
    "grpo_step": ("reward/mean", "val/accuracy", "response_length/mean", "actor/entropy"),
    "ppo_update": ("objective/scores", "objective/kl", "objective/kl_coef", "objective/entropy"),
    "rm_step": ("train/loss", "train/accuracy", "test/accuracy"),
}


@dataclass
class Args:
    run_dirs: tyro.conf.Positional[
        Annotated[list[str], tyro.conf.arg(metavar="RUN_DIR [RUN_DIR ...]")]
    ]
    """run directories (each with a metrics.jsonl): several seeds of one config"""
    baseline: str = "none"
    """a baseline name under baselines/ (e.g. gpt2_sentiment), a path to a .csv file, or `none` (our
    seeds only, the default)"""
    metrics: tuple[str, ...] = ()
    """metrics to plot; default: every metric the baseline has (`none`: the script's headline
    metrics, HEADLINE_METRICS, that every run logs)"""
    output_dir: str = "runs/compare"
    """where compare_<baseline>.png and compare_<baseline>.md are written"""
    x: Literal["step", "episode"] = "step"
    """x-axis: the trainer's step, or episodes seen (`ppo/episode`; the baseline needs `#
    episodes_per_x`)"""
    band: Literal["minmax", "std"] = "minmax"
    """the band around the seed mean: min-max over seeds, or mean ± one std"""
    title: str | None = None
    """the figure's title (default: "ours vs <baseline>"), e.g. to name the runs or to mark
    synthetic data"""


def fail(reason: str):
    """Refuse: exit status 1 with a one-line reason on stderr (SystemExit with a string does exactly
    that)."""
    raise SystemExit(f"compare.py: error: {reason}")


# ---------------------------------------------------------------------------------------------------------------
# 1. Reading our runs
# ---------------------------------------------------------------------------------------------------------------
def load_metrics(path: str) -> list[dict]:
    """Parse a metrics.jsonl into a list of records (dicts with an int `step`); each remembers its
    line number."""
    if not os.path.isfile(path):
        fail(f"{path}: no such file (a run directory needs a metrics.jsonl)")
    records = []
    with open(path) as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{path}:{line_number}: malformed JSON ({e.msg})")
            if not isinstance(record, dict):
                fail(f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}")
            # null = not logged here
            record = {key: value for key, value in record.items() if value is not None}
            step = record.get("step")
            if isinstance(step, float) and step.is_integer():
                step = int(step)  # 3.0 is step 3 (some loggers write floats)
            if not isinstance(step, int) or isinstance(step, bool):
                fail(f"{path}:{line_number}: missing or non-integer 'step' field (got {step!r})")
            record["step"] = step
            record["_line"] = line_number
            records.append(record)
    if not records:
        fail(f"{path}: no records")
    return records


def metric_series(records: list[dict], metric: str, path: str) -> dict[int, float]:
    """{step: value} for the lines that have `metric` (later lines win on a repeated step)."""
    series = {}
    for record in records:
        if metric not in record:
            continue
        value = record[metric]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(f"{path}:{record['_line']}: '{metric}' is not a number (got {value!r})")
        series[record["step"]] = float(value)
    return series


def run_x_kind(run_dir: str, records: list[dict]) -> str | None:
    """Which step a run counts (see "x-axis kinds" in the module docstring); None if we cannot
    tell."""
    args_path = os.path.join(run_dir, "args.json")
    if os.path.isfile(args_path):
        with open(args_path) as f:
            try:
                run_args = json.load(f)
            except json.JSONDecodeError as e:
                fail(f"{args_path}: malformed JSON ({e.msg})")
        for key in ("script", "exp_name"):
            name = run_args.get(key) if isinstance(run_args, dict) else None
            if isinstance(name, str):
                stem = os.path.splitext(os.path.basename(name))[0]
                for script, kind in SCRIPT_X_KIND.items():
                    if stem.startswith(script):
                        return kind
    keys = set().union(*records)
    if any(k.startswith(("objective/", "ppo/")) for k in keys):
        return "ppo_update"
    if keys & {"reward/mean", "response_length/mean"}:
        return "grpo_step"
    if keys & {"test/accuracy", "train/loss"}:
        return "rm_step"
    return None


# ---------------------------------------------------------------------------------------------------------------
# 2. Reading a baseline
# ---------------------------------------------------------------------------------------------------------------
def baseline_path(name: str) -> str:
    if name.endswith(".csv") or os.sep in name:
        path = name
    else:
        path = os.path.join(BASELINES_DIR, name + ".csv")
    if not os.path.isfile(path):
        known = sorted(f[:-4] for f in os.listdir(BASELINES_DIR) if f.endswith(".csv"))
        fail(f"unknown baseline {name!r} (no {path}); known: {', '.join(known)}")
    return path


def load_baseline(name: str) -> dict:
    """Read a baseline CSV: {"name", "path", "x_kind", "episodes_per_x", "notes", "rows"} (format:
    module docstring)."""
    path = baseline_path(name)
    x_kind, episodes_per_x, notes, data_lines = None, None, [], []
    with open(path) as f:
        for line_number, line in enumerate(f, start=1):
            if line.startswith("#"):
                text = line[1:].strip()
                key, _, value = text.partition(":")
                if key.strip() == "x":
                    x_kind = value.strip()
                elif key.strip() == "episodes_per_x":
                    episodes_per_x = float(value)
                elif text:
                    notes.append(text)
            elif line.strip():
                data_lines.append((line_number, line))
    if x_kind not in X_KINDS:
        fail(f"{path}: header needs '# x: KIND' with KIND in {X_KINDS} (got {x_kind!r})")

    def number(text: str, line_number: int, column: str) -> float | None:
        if text is None or text.strip() == "":
            return None
        try:
            return float(text)
        except ValueError:
            fail(f"{path}:{line_number}: column '{column}' is not a number ({text!r})")

    reader = csv.DictReader([line for _, line in data_lines])
    if reader.fieldnames is None or not {"x", "metric", "value"} <= set(reader.fieldnames):
        fail(f"{path}: the CSV header must have at least x,metric,value (got {reader.fieldnames})")
    rows = []
    for (line_number, _), row in zip(data_lines[1:], reader):
        rows.append(
            {
                "x": number(row["x"], line_number, "x"),
                "metric": row["metric"].strip(),
                "value": number(row["value"], line_number, "value"),
                "low": number(row.get("low"), line_number, "low"),
                "high": number(row.get("high"), line_number, "high"),
                "label": (row.get("label") or "").strip() or "baseline",
            }
        )
    base = os.path.splitext(os.path.basename(path))[0]
    return {
        "name": base,
        "path": path,
        "x_kind": x_kind,
        "episodes_per_x": episodes_per_x,
        "notes": notes,
        "rows": rows,
    }


def no_baseline() -> dict:
    """`--baseline none`: an empty baseline that matches every x kind (the tiny presets have no
    published curve)."""
    return {
        "name": "none",
        "path": None,
        "x_kind": "any",
        "episodes_per_x": None,
        "rows": [],
        "notes": ["no published baseline: only our seeds are shown (e.g. a tiny offline preset)"],
    }


def baseline_metrics(baseline: dict) -> list[str]:
    """The metrics a baseline has, in file order."""
    return list(dict.fromkeys(row["metric"] for row in baseline["rows"]))


def baseline_groups(baseline: dict, metric: str) -> list[dict]:
    """The published series of one metric: [{"label", "shape": curve|reference|band, "rows"}] in
    file order."""
    groups = {}
    for row in baseline["rows"]:
        if row["metric"] == metric:
            groups.setdefault(row["label"], []).append(row)
    out = []
    for label, rows in groups.items():
        if all(r["x"] is not None for r in rows):
            shape = "curve"
            rows = sorted(rows, key=lambda r: r["x"])
        elif len(rows) == 1 and rows[0]["value"] is not None:
            shape = "reference"
        elif len(rows) == 1 and (rows[0]["low"] is not None or rows[0]["high"] is not None):
            shape = "band"
        else:
            fail(
                f"{baseline['path']}: '{metric}' / '{label}' mixes rows with and without x, or has no value/range"
            )
        out.append({"label": label, "shape": shape, "rows": rows})
    return out


# ---------------------------------------------------------------------------------------------------------------
# 3. Seeds: align on common steps, then mean and band
# ---------------------------------------------------------------------------------------------------------------
def align_seeds(series_per_run: list[dict[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Keep the steps every run has (intersection). Returns steps (S,) and values (n_runs, S)."""
    common = set(series_per_run[0])
    for series in series_per_run[1:]:
        common &= set(series)
    steps = np.array(sorted(common), dtype=np.int64)
    values = np.array([[series[s] for s in steps] for series in series_per_run], dtype=np.float64)
    return steps, values.reshape(len(series_per_run), len(steps))


def seed_band(values: np.ndarray, band: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """values (n_runs, S) -> mean, low, high (each (S,)): min-max over seeds, or mean ± population
    std."""
    mean = values.mean(axis=0)
    if band == "minmax":
        return mean, values.min(axis=0), values.max(axis=0)
    std = values.std(axis=0, ddof=0)
    return mean, mean - std, mean + std


def steps_to_x(steps, episode_of_step: dict[int, float] | None, run_dir: str) -> np.ndarray:
    """Our x values: the steps themselves, or (--x episode) the `ppo/episode` the run logged at
    those steps."""
    if episode_of_step is None:
        return np.asarray(steps, dtype=np.float64)
    missing = [int(s) for s in steps if int(s) not in episode_of_step]
    if missing:
        fail(
            f"{run_dir}: --x episode needs 'ppo/episode' at every step; missing at step {missing[0]}"
        )
    return np.array([episode_of_step[int(s)] for s in steps], dtype=np.float64)


# ---------------------------------------------------------------------------------------------------------------
# 4. Outputs: the plot and the table of final values
# ---------------------------------------------------------------------------------------------------------------
def draw_band_rows(ax, row: dict, label: str):
    """A healthy range as a green band; an unbounded side extends to the panel's edge."""
    ymin, ymax = ax.get_ylim()
    edges = [e for e in (row["low"], row["high"]) if e is not None]
    pad = 0.1 * (max(ymax, *edges) - min(ymin, *edges) or 1.0)
    lo_view, hi_view = min(ymin, *edges) - pad, max(ymax, *edges) + pad
    low = row["low"] if row["low"] is not None else lo_view
    high = row["high"] if row["high"] is not None else hi_view
    ax.axhspan(low, high, color="tab:green", alpha=0.15, label=label, zorder=0)
    for edge in edges:
        ax.axhline(edge, color="tab:green", linestyle="--", linewidth=1)
    ax.set_ylim(lo_view, hi_view)


def plot_comparison(
    panels: list[dict],
    baseline: dict,
    x_axis_label: str,
    band: str,
    png_path: str,
    title: str | None = None,
):
    n = len(panels)
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        # each seed, faintly, over all of its own steps
        for i, (x, y) in enumerate(panel["runs"]):
            ax.plot(
                x,
                y,
                color="tab:blue",
                alpha=0.25,
                linewidth=0.8,
                label="each seed" if i == 0 else None,
            )
        # seed mean and band on the common steps
        n_runs = len(panel["runs"])
        band_name = "min-max" if band == "minmax" else "±1 std"
        ax.fill_between(
            panel["x"],
            panel["low"],
            panel["high"],
            color="tab:blue",
            alpha=0.2,
            label=f"ours {band_name} ({n_runs} seed{'s' if n_runs > 1 else ''})",
        )
        ax.plot(panel["x"], panel["mean"], color="tab:blue", linewidth=2, label="ours, seed mean")
        # the published series
        other_colors = iter(["tab:orange", "tab:purple", "tab:brown", "tab:gray", "tab:olive"])
        bands = []
        for group in panel["baseline"]:
            rows, label = group["rows"], group["label"]
            if group["shape"] == "curve":
                bx = np.array([r["x"] for r in rows]) * panel["baseline_x_scale"]
                by = np.array([r["value"] for r in rows])
                lows = np.array([r["low"] if r["low"] is not None else r["value"] for r in rows])
                highs = np.array([r["high"] if r["high"] is not None else r["value"] for r in rows])
                ax.errorbar(
                    bx,
                    by,
                    yerr=[by - lows, highs - by],
                    color="black",
                    marker="o",
                    markersize=4,
                    linestyle="--",
                    linewidth=1.2,
                    capsize=3,
                    label=label,
                    zorder=5,
                )
            elif group["shape"] == "reference":
                ax.axhline(
                    rows[0]["value"],
                    color=next(other_colors, "tab:gray"),
                    linestyle=":",
                    linewidth=1.5,
                    label=f"{label}: {rows[0]['value']:g} (final)",
                )
            else:
                bands.append(group)
        for group in bands:  # after the data, so an unbounded side knows where the panel ends
            row = group["rows"][0]
            low = f"{row['low']:g}" if row["low"] is not None else "-inf"
            high = f"{row['high']:g}" if row["high"] is not None else "+inf"
            draw_band_rows(ax, row, f"{group['label']} [{low}, {high}]")
        ax.set_title(panel["metric"], fontsize=10)
        ax.set_xlabel(x_axis_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if title is None:
        title = (
            "ours (no published baseline)"
            if baseline["name"] == "none"
            else f"ours vs {baseline['name']}"
        )
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def final_table(panels: list[dict], baseline: dict) -> str:
    """Markdown: per metric, our final value (mean ± std over seeds) / the baseline's final value /
    ratio."""
    lines = [
        "# ours (no published baseline)"
        if baseline["name"] == "none"
        else f"# ours vs `{baseline['name']}`",
        "",
        "| metric | ours: final value, mean ± std over seeds (step) | baseline final (x) | ours / "
        "baseline |",
        "| --- | --- | --- | --- |",
    ]
    others = []
    for panel in panels:
        finals = panel["values"][:, -1]  # the value at the last common step, one per seed
        mean, std = finals.mean(), finals.std(ddof=0)
        ours = f"{mean:.4g} ± {std:.2g} (n={len(finals)}, step {panel['steps'][-1]})"
        main = next((g for g in panel["baseline"] if g["shape"] != "band"), None)
        if main is not None:
            last = main["rows"][-1]  # curves are sorted by x: the last point is the final one
            where = f"x={last['x']:g}" if last["x"] is not None else "final"
            ratio = f"{mean / last['value']:.3f}" if last["value"] != 0 else "n/a"
            lines.append(f"| {panel['metric']} | {ours} | {last['value']:g} ({where}) | {ratio} |")
        elif not panel["baseline"]:
            lines.append(f"| {panel['metric']} | {ours} | no published baseline | - |")
        for group in panel["baseline"]:
            if group["shape"] == "band":
                row = group["rows"][0]
                inside = (row["low"] is None or mean >= row["low"]) and (
                    row["high"] is None or mean <= row["high"]
                )
                low = f"{row['low']:g}" if row["low"] is not None else "-inf"
                high = f"{row['high']:g}" if row["high"] is not None else "+inf"
                if main is None:
                    lines.append(
                        f"| {panel['metric']} | {ours} | healthy [{low}, {high}] | "
                        f"{'inside' if inside else 'OUTSIDE'} |"
                    )
                else:
                    others.append(
                        f"- {panel['metric']}: {group['label']} [{low}, {high}]: "
                        f"ours {'inside' if inside else 'OUTSIDE'}"
                    )
            elif group is not main:
                last = group["rows"][-1]
                where = f"x={last['x']:g}" if last["x"] is not None else "final"
                others.append(f"- {panel['metric']}: {group['label']}: {last['value']:g} ({where})")
    if others:
        lines += ["", "Other published values:", *others]
    lines += ["", "Baseline notes:", *[f"- {note}" for note in baseline["notes"]]]
    return "\n".join(lines) + "\n"


def table_baseline_markdown(baseline: dict) -> str:
    """A `# x: table` baseline (e.g. adam_table.csv) as markdown: one row per metric, one column per
    label."""
    labels = list(dict.fromkeys(row["label"] for row in baseline["rows"]))
    lines = [
        f"# `{baseline['name']}` (a published table, not a curve: nothing to plot)",
        "",
        "| metric | " + " | ".join(labels) + " |",
        "| --- |" + " --- |" * len(labels),
    ]
    for metric in baseline_metrics(baseline):
        cells = {
            row["label"]: f"{row['value']:g}" for row in baseline["rows"] if row["metric"] == metric
        }
        lines.append(f"| {metric} | " + " | ".join(cells.get(label, "") for label in labels) + " |")
    lines += ["", "Baseline notes:", *[f"- {note}" for note in baseline["notes"]]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# 5. The whole comparison: every check first, then the outputs
# ---------------------------------------------------------------------------------------------------------------
def compare(args: Args) -> dict:
    """Check everything, then write the PNG and the markdown table. Returns their paths."""
    if not args.run_dirs:
        fail("give at least one RUN_DIR")

    # 1. load our runs (a malformed metrics.jsonl stops here, naming the file and line)
    runs = []
    for run_dir in args.run_dirs:
        path = os.path.join(run_dir, "metrics.jsonl")
        records = load_metrics(path)
        runs.append(
            {
                "dir": run_dir,
                "path": path,
                "records": records,
                "x_kind": run_x_kind(run_dir, records),
            }
        )

    # 2. load the baseline (`none`: our seeds only); a table baseline is printed, not plotted
    baseline = no_baseline() if args.baseline == "none" else load_baseline(args.baseline)
    md_path = os.path.join(args.output_dir, f"compare_{baseline['name']}.md")
    if baseline["x_kind"] == "table":
        markdown = table_baseline_markdown(baseline)
        os.makedirs(args.output_dir, exist_ok=True)
        with open(md_path, "w") as f:
            f.write(markdown)
        print(markdown)
        return {"png": None, "markdown": md_path}

    # 3. the x axes must count the same thing (a GRPO step is not a PPO update)
    for run in runs:
        if run["x_kind"] is None:
            fail(
                f'{run["dir"]}: cannot tell which script wrote it (add args.json with "script": '
                f'"ppo_rlhf" | "grpo" | "rewards")'
            )
    kinds = sorted({run["x_kind"] for run in runs})
    if len(kinds) > 1:
        fail(f"the runs count different steps ({', '.join(kinds)}): compare seeds of one config")
    if baseline["x_kind"] != "any" and kinds[0] != baseline["x_kind"]:
        fail(
            f"x-axis mismatch: the runs count {kinds[0]} but baseline {baseline['name']} counts "
            f"{baseline['x_kind']}"
        )

    # 4. every requested metric must be in the baseline and in every run
    metrics = list(args.metrics) or baseline_metrics(baseline)
    if baseline["name"] == "none" and not args.metrics:
        metrics = [
            metric
            for metric in HEADLINE_METRICS[kinds[0]]
            if all(any(metric in record for record in run["records"]) for run in runs)
        ]
        if not metrics:
            fail(f"no run logs any of {', '.join(HEADLINE_METRICS[kinds[0]])}: pass --metrics")
    for metric in metrics:
        if baseline["name"] != "none" and metric not in baseline_metrics(baseline):
            fail(
                f"metric '{metric}' is not in baseline {baseline['name']} (it has: "
                f"{', '.join(baseline_metrics(baseline))})"
            )
        for run in runs:
            if not any(metric in record for record in run["records"]):
                fail(f"metric '{metric}' is missing from {run['path']} (no line logs it)")

    # 5. the x axis in episodes, if asked
    baseline_x_scale = 1.0
    episodes = [None] * len(runs)
    if args.x == "episode":
        if baseline["x_kind"] != "any":
            if baseline["episodes_per_x"] is None:
                fail(f"--x episode: baseline {baseline['name']} has no '# episodes_per_x' header")
            baseline_x_scale = baseline["episodes_per_x"]
        for i, run in enumerate(runs):
            episodes[i] = metric_series(run["records"], "ppo/episode", run["path"])
            if not episodes[i]:
                fail(f"--x episode: {run['path']} logs no 'ppo/episode'")

    # 6. per metric: align the seeds and compute mean and band
    panels = []
    for metric in metrics:
        series = [metric_series(run["records"], metric, run["path"]) for run in runs]
        steps, values = align_seeds(series)
        if len(steps) == 0:
            fail(f"metric '{metric}': the runs share no step (seeds are aligned on common steps)")
        mean, low, high = seed_band(values, args.band)
        panels.append(
            {
                "metric": metric,
                "steps": steps,
                "values": values,
                "x": steps_to_x(steps, episodes[0], runs[0]["dir"]),
                "mean": mean,
                "low": low,
                "high": high,
                "runs": [
                    (steps_to_x(sorted(s), episodes[i], runs[i]["dir"]), [s[k] for k in sorted(s)])
                    for i, s in enumerate(series)
                ],
                "baseline": baseline_groups(baseline, metric),
                "baseline_x_scale": baseline_x_scale,
            }
        )

    # 7. outputs (only now: a refusal above leaves nothing behind)
    os.makedirs(args.output_dir, exist_ok=True)
    png_path = os.path.join(args.output_dir, f"compare_{baseline['name']}.png")
    x_axis_label = "episode" if args.x == "episode" else X_LABELS[kinds[0]]
    plot_comparison(panels, baseline, x_axis_label, args.band, png_path, args.title)
    markdown = final_table(panels, baseline)
    with open(md_path, "w") as f:
        f.write(markdown)
    print(markdown)
    print(f"wrote {png_path} and {md_path}")
    return {"png": png_path, "markdown": md_path}


if __name__ == "__main__":
    compare(tyro.cli(Args))
