"""Every objective of objectives.py on the tiny copy task, side by side: one table row and one
curve (the mean over seeds) per objective, from runs that scripts/seed_table.py made.

    # the runs (seeds 1-3 each, HF backend): one seed_table call per objective, e.g.
    .venv/bin/python scripts/seed_table.py grpo --seeds 1 2 3 --name rloo -- --adv-estimator rloo
    # the table and the figure (docs/objectives.md): LABEL=NAME for runs/seed_table/NAME_hf_sS
    .venv/bin/python scripts/objectives_figure.py grpo=grpo8 rloo=rloo ... --out docs/img/objectives_tiny.png

Per objective: the last-10 mean of reward/mean and the final greedy val/accuracy of each seed, how
many seeds learn (both >= 0.8, the criterion of docs/grpo.md), and actor/entropy at step 30 (how
fast the policy became deterministic). The figure has two panels, reward/mean and actor/entropy
against the step, one line per objective: the mean over its seeds at each step all of them logged.
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_rows(run_dir):
    """The training rows of a grpo.py run (those with reward/mean) and its last val/accuracy."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    return [r for r in rows if "reward/mean" in r], (val[-1] if val else float("nan"))


def mean(values):
    return sum(values) / len(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("objectives", nargs="+", help="LABEL=NAME (runs/seed_table/NAME_hf_sS)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "seed_table"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "objectives_tiny.png"))
    args = parser.parse_args()

    figure, (reward_axis, entropy_axis) = plt.subplots(1, 2, figsize=(14, 5))
    colors = plt.get_cmap("tab20").colors  # 20 distinct colours; solid and dashed alternate
    seeds = " / ".join(str(s) for s in args.seeds)
    print(
        f"| objective | last-10 reward (seeds {seeds}) | final greedy val | learns | "
        "`actor/entropy` at step 30 |"
    )
    print("| --- | --- | --- | --- | --- |")
    for index, item in enumerate(args.objectives):
        label, name = item.split("=", 1)
        runs = [read_rows(os.path.join(args.runs_dir, f"{name}_hf_s{s}")) for s in args.seeds]
        last10 = [mean([r["reward/mean"] for r in rows[-10:]]) for rows, _ in runs]
        vals = [val for _, val in runs]
        learns = sum(r >= 0.8 and v >= 0.8 for r, v in zip(last10, vals))
        entropy30 = [
            next((r["actor/entropy"] for r in rows if r["step"] == 30), float("nan"))
            for rows, _ in runs
        ]
        print(
            f"| {label} | {' / '.join(f'{x:.2f}' for x in last10)} | "
            f"{' / '.join(f'{x:.2f}' for x in vals)} | {learns} of {len(runs)} | "
            f"{' / '.join(f'{x:.2f}' for x in entropy30)} |"
        )
        common = set.intersection(*({r["step"] for r in rows} for rows, _ in runs))
        steps = sorted(common)
        for axis, key in ((reward_axis, "reward/mean"), (entropy_axis, "actor/entropy")):
            by_step = [{r["step"]: r[key] for r in rows} for rows, _ in runs]
            axis.plot(
                steps,
                [mean([run[s] for run in by_step]) for s in steps],
                label=label,
                color=colors[(2 * index) % 20 + (index // 10) % 2],
                linestyle="-" if index % 2 == 0 else "--",
                linewidth=1.2,
            )
    reward_axis.set(xlabel="step", ylabel="reward/mean (mean of seeds)", ylim=(0, 1.02))
    entropy_axis.set(xlabel="step", ylabel="actor/entropy (mean of seeds)", yscale="log")
    entropy_axis.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    figure.suptitle(f"grpo.py tiny, every objective, seeds {seeds} (HF rollouts)")
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
