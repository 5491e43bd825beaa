"""Every objective of objectives.py on the tiny copy task, side by side: one table row and one
curve (the mean over seeds) per objective, from runs that scripts/seed_table.py made.

    # the runs (seeds 1-3 each, HF backend): one seed_table call per objective, e.g.
    .venv/bin/python scripts/seed_table.py grpo --seeds 1 2 3 --name rloo -- --adv-estimator rloo
    # the table and the figure (docs/objectives.md): LABEL=NAME for runs/seed_table/NAME_hf_sS
    .venv/bin/python scripts/objectives_figure.py grpo=grpo8 rloo=rloo ... --out docs/img/objectives_tiny.png

Per objective: the last-10 mean of reward/mean and the greedy val/accuracy before training and at
the end, for each seed; how many seeds learn (last-10 reward and final val both >= 0.8, the
criterion of docs/grpo.md for the tiny task); the update's entropy (actor/entropy_loss) at
--entropy-step (how fast the policy became deterministic); with --mean-of KEY, the run's mean of
KEY (e.g. actor/pg_clipfrac: how much of the update the clip held back), "-" where not logged;
with --solved-at X, the first step from which reward/mean stays >= X for 5 steps ("-": never).
The figure has two panels (--metrics, default reward/mean and actor/entropy_loss) against the
step, one line per objective: the mean over its seeds at each step all of them logged.
Other runs (the SmolLM2 rows of docs/objectives.md) name their folders with --pattern.
"""

import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")  # no display: write the file only
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_rows(run_dir):
    """The training rows of a grpo.py run (those with reward/mean) and its val/accuracy rows."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        # the update's entropy is actor/entropy_loss; runs logged before grpo.py logged verl's
        # actor/entropy (pi_old's) called it actor/entropy
        if "actor/entropy_loss" not in row and "actor/entropy" in row:
            row["actor/entropy_loss"] = row["actor/entropy"]
    return [r for r in rows if "reward/mean" in r], [r for r in rows if "val/accuracy" in r]


def mean(values):
    return sum(values) / len(values)


def solved_step(rows, level, run_of=5):
    """The first step from which reward/mean stays >= level for run_of steps in a row, or "-"."""
    rewards = [r["reward/mean"] for r in rows]
    for i in range(len(rows) - run_of + 1):
        if min(rewards[i : i + run_of]) >= level:
            return str(rows[i]["step"])
    return "-"


def joined(values, digits=2):
    return " / ".join(f"{x:.{digits}f}" for x in values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("objectives", nargs="+", help="LABEL=NAME (runs/seed_table/NAME_hf_sS)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "seed_table"))
    parser.add_argument("--pattern", default="{name}_hf_s{seed}", help="a run's folder name")
    parser.add_argument("--metrics", nargs=2, default=["reward/mean", "actor/entropy_loss"])
    parser.add_argument("--entropy-step", type=int, default=30)
    parser.add_argument("--mean-of", nargs="*", default=[], help="columns: a run's mean of KEY")
    parser.add_argument("--solved-at", type=float, help="a column: when reward/mean reaches X")
    parser.add_argument(
        "--no-criterion",
        dest="criterion",
        action="store_false",
        help="leave out the learns column (the tiny task's criterion)",
    )
    parser.add_argument("--title", default="grpo.py tiny, every objective (HF rollouts)")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "img", "objectives_tiny.png"))
    args = parser.parse_args()

    figure, axes = plt.subplots(1, 2, figsize=(14, 5))
    colors = plt.get_cmap("tab20").colors  # 20 distinct colours; solid and dashed alternate
    seeds = " / ".join(str(s) for s in args.seeds)
    columns = ["objective", f"last-10 reward (seeds {seeds})", "greedy val before"]
    columns += ["final greedy val"] + (["learns"] if args.criterion else [])
    columns += [f"`actor/entropy_loss` at step {args.entropy_step}"]
    columns += [f"mean `{key}`" for key in args.mean_of]
    if args.solved_at is not None:
        columns += [f"reward >= {args.solved_at} from step"]
    print("| " + " | ".join(columns) + " |")
    print("| --- " * len(columns) + "|")
    for index, item in enumerate(args.objectives):
        label, name = item.split("=", 1)
        folders = [args.pattern.format(name=name, seed=s) for s in args.seeds]
        runs = [read_rows(os.path.join(args.runs_dir, folder)) for folder in folders]
        last10 = [mean([r["reward/mean"] for r in rows[-10:]]) for rows, _ in runs]
        first_val = [val[0]["val/accuracy"] for _, val in runs]
        final_val = [val[-1]["val/accuracy"] for _, val in runs]
        learns = sum(r >= 0.8 and v >= 0.8 for r, v in zip(last10, final_val))
        entropy = [
            next(
                (r["actor/entropy_loss"] for r in rows if r["step"] == args.entropy_step), math.nan
            )
            for rows, _ in runs
        ]
        cells = [label, joined(last10), joined(first_val), joined(final_val)]
        cells += [f"{learns} of {len(runs)}"] if args.criterion else []
        cells += [joined(entropy)]
        for key in args.mean_of:
            logged = [[r[key] for r in rows if key in r] for rows, _ in runs]
            cells += [joined([mean(values) for values in logged], 3) if all(logged) else "-"]
        if args.solved_at is not None:
            cells += [" / ".join(solved_step(rows, args.solved_at) for rows, _ in runs)]
        print("| " + " | ".join(cells) + " |")
        for axis, key in zip(axes, args.metrics):
            by_step = [{r["step"]: r[key] for r in rows + val if key in r} for rows, val in runs]
            steps = sorted(set.intersection(*(set(run) for run in by_step)))
            axis.plot(
                steps,
                [mean([run[s] for run in by_step]) for s in steps],
                label=label,
                color=colors[(2 * index) % 20 + (index // 10) % 2],
                linestyle="-" if index % 2 == 0 else "--",
                linewidth=1.2,
                marker="o" if len(steps) < 30 else None,
                markersize=3,
            )
    for axis, key in zip(axes, args.metrics):
        axis.set(xlabel="step", ylabel=f"{key} (mean of seeds)")
        if key.startswith("actor/entropy"):
            axis.set_yscale("log")
    axes[1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    figure.suptitle(f"{args.title}, seeds {seeds}")
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
