"""The rollout/training mismatch lab: `grpo.py tiny` (the GPT-2 tiny copy task) under each named
mismatch source, trained naively and with each remedy, 8 seeds per arm.

    .venv/bin/python scripts/mismatch_experiment.py                       # the default arms
    .venv/bin/python scripts/mismatch_experiment.py --arms lag4/naive lag4/bypass --seeds 1 2
    .venv/bin/python scripts/mismatch_experiment.py --summarise-only      # table and figure again
    .venv/bin/python scripts/mismatch_experiment.py --arms lora --json docs/mismatch_lab_lora.json \
        --plot docs/img/mismatch_lab_lora.png       # LoRA's arms (LORA_ARMS, grpo.py tiny_lora)
    .venv/bin/python scripts/mismatch_experiment.py --arms async --json docs/mismatch_lab_async.json \
        --plot docs/img/mismatch_lab_async.png      # real asynchrony (ASYNC_ARMS)
    .venv/bin/python scripts/mismatch_experiment.py --arms tools --json docs/mismatch_lab_tools.json \
        --plot docs/img/mismatch_lab_tools.png      # multi-turn tokenisation (TOOL_ARMS, tiny_tools)

An arm is "source/remedy". A source makes pi_rollout differ from pi_train (SOURCES); a remedy
either removes the difference or corrects the update for it (REMEDIES, labelled as which). The
cells of "none" are the reference (no mismatch at all), and two of the removals are that same
reference: fp32 rollouts remove int8 rounding, K = 0 removes a lag. The LoRA sources run
`grpo.py tiny_lora` and are held against "lora/naive", the adapter without a mismatch.

The criterion was fixed before the runs and is the seed tables' (scripts/seed_table.py,
docs/grpo.md): a run learns if its mean reward/mean over the last 10 steps is >= 0.8 and its final
greedy val/accuracy is >= 0.8. reward/mean is the sampler's own policy (stale, rounded or
truncated); val/accuracy is the trainer's current weights, greedy on 64 held-out prompts.

Each run is `grpo.py tiny --seed S <source flags> <remedy flags>` in its own process (the preset's
one torch thread), `--parallel` at a time, into runs/mismatch_lab/<source>__<remedy>_s<seed>/
(gitignored); a finished run of the same command is read again instead of rerun. The script
prints the table (markdown), writes its numbers (--json) and the figure (--plot);
docs/mismatch_experiment.md reports them.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from seed_table import grpo_result  # noqa: E402  (the seed tables' criterion, one definition)

# source -> grpo.py flags that make pi_rollout != pi_train
SOURCES = {
    "none": [],
    # an asynchronous rollout worker: step t samples with the weights after update t - K
    "lag1": ["--rollout-staleness", "1"],
    "lag2": ["--rollout-staleness", "2"],
    "lag4": ["--rollout-staleness", "4"],
    # truncated sampling scored over the full vocabulary: every token's ratio is its kept mass S
    "top_p": ["--top-p", "0.8", "--no-replay-sampling-mask"],
    "top_k": ["--top-k", "5", "--no-replay-sampling-mask"],
    # W8A16 rollouts: the engine samples from an int8 fake-quantised copy of the weights
    "int8": ["--mismatch", "int8"],
    # LoRA (grpo.py tiny_lora): the trainer computes W x + s B A x in fp32, the engine samples with
    # the merged W + s B A rounded to bf16; "lora" alone is its reference (no mismatch)
    "lora": [],
    "lora_bf16": ["--mismatch", "bf16"],
    # real asynchrony (rollout.AsyncRollouts): a producer thread samples step t with the weights
    # after update t - K while the trainer trains (exact: the same numbers as lagK, bit for bit)
    "async1": ["--async-rollouts", "--max-staleness", "1"],
    "async4": ["--async-rollouts", "--max-staleness", "4"],
    # in-flight updates: step t's first 2 tokens from version t - 1, the rest from version t
    "inflight": ["--async-rollouts", "--max-staleness", "1", "--in-flight-updates"],
    # multi-turn tool use (grpo.py tiny_tools): "tools" alone is its reference (token in, token
    # out); tools_sep samples each next turn from a history without the separator the template
    # inserts after a turn, while the trainer trains on the template's (verl #6921)
    "tools": [],
    "tools_sep": ["--tool-history-mismatch", "drop_separator"],
}
TRUNCATION_SOURCES = ("top_p", "top_k")
# the preset a source runs (tiny otherwise), and the reference its arms are held against
LORA_SOURCES = ("lora", "lora_bf16")
LORA_ARMS = ["lora/naive", "lora_bf16/naive", "lora_bf16/token_tis", "lora_bf16/seq_mis"]
ASYNC_SOURCES = ("async1", "async4", "inflight")
ASYNC_ARMS = ["none/naive"]
ASYNC_ARMS += ["async1/naive", "async1/seq_mis", "async1/bypass"]
ASYNC_ARMS += ["async4/naive", "async4/seq_mis", "async4/bypass"]
ASYNC_ARMS += ["inflight/naive", "inflight/token_tis"]
TOOL_SOURCES = ("tools", "tools_sep")
TOOL_ARMS = ["tools/naive", "tools_sep/naive", "tools_sep/token_tis", "tools_sep/seq_mis"]
TOOL_ARMS += ["tools_sep/bypass"]


def preset_and_reference(source):
    if source in LORA_SOURCES:
        return "tiny_lora", "lora/naive"
    if source in TOOL_SOURCES:
        return "tiny_tools", "tools/naive"
    return "tiny", "none/naive"


# remedy -> (what it is, grpo.py flags)
REMEDIES = {
    # PPO against the trainer's recompute of pi_old; pi_rollout is ignored (the TIS paper's naive)
    "naive": ("none", ["--correction", "disabled"]),
    # removes the mismatch: the trainer scores each token over the sampler's kept set
    "replay": ("removes", ["--replay-sampling-mask"]),
    # correct for it (corrections.PRESET_SETTINGS; the off-policy mask is DeepSeek-V3.2's)
    "token_tis": ("corrects", ["--correction", "decoupled_token_is"]),
    "seq_mis": ("corrects", ["--correction", "decoupled_seq_is_rs"]),
    "icepop": ("corrects", ["--correction", "decoupled_token_icepop"]),
    "bypass": ("corrects", ["--correction", "bypass_ppo_clip"]),
    "offpolicy_mask": ("corrects", ["--off-policy-mask-threshold", "0.5"]),
}

DEFAULT_ARMS = (
    ["none/naive"]
    + [
        f"{source}/naive"
        for source in SOURCES
        if source not in ("none",) + LORA_SOURCES + ASYNC_SOURCES + TOOL_SOURCES
    ]
    + [f"{source}/replay" for source in TRUNCATION_SOURCES]
    + [
        f"{source}/{remedy}"
        for source in SOURCES
        if source != "none" and source not in LORA_SOURCES + ASYNC_SOURCES + TOOL_SOURCES
        for remedy, (kind, _) in REMEDIES.items()
        if kind == "corrects"
    ]
)

# the early metrics the summary compares between runs that learn and runs that do not:
# (metric, first step, last step, column heading), each the mean over those steps
EARLY_METRICS = (
    ("rollout_corr/k3_kl", 1, 20, "k3 KL(rollout, train) per token, steps 1-20"),
    ("rollout_corr/chi2_token", 1, 20, "chi2_token E[rho^2] - 1, steps 1-20"),
    ("actor/grad_norm", 1, 20, "grad norm, steps 1-20"),
    ("actor/pg_clipfrac", 1, 20, "pg_clipfrac, steps 1-20"),
    ("actor/entropy_loss", 21, 30, "entropy, steps 21-30"),
    ("response_length/mean", 21, 30, "response length, steps 21-30"),
)


def parse_arm(arm):
    source, _, remedy = arm.partition("/")
    if source not in SOURCES or remedy not in REMEDIES:
        raise SystemExit(
            f"--arms: {arm!r} is not source/remedy; sources: {', '.join(SOURCES)}; "
            f"remedies: {', '.join(REMEDIES)}"
        )
    if remedy == "replay" and source not in TRUNCATION_SOURCES:
        raise SystemExit(f"--arms: {arm!r}: replay removes truncated sampling only")
    return source, remedy


def command(arm, seed, out):
    source, remedy = parse_arm(arm)
    flags = SOURCES[source] + REMEDIES[remedy][1]
    if remedy == "replay":
        # the source's --no-replay-sampling-mask is overridden by the later flag
        flags = [flag for flag in flags if flag != "--no-replay-sampling-mask"]
    return (
        [sys.executable, os.path.join(ROOT, "grpo.py"), preset_and_reference(source)[0]]
        + ["--seed", str(seed)]
        + flags
        + [
            "--output-dir",
            out,
        ]
    )


def read_rows(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
        # the update's entropy is actor/entropy_loss; runs logged before grpo.py logged verl's
        # actor/entropy (pi_old's) called it actor/entropy
        if "actor/entropy_loss" not in row and "actor/entropy" in row:
            row["actor/entropy_loss"] = row["actor/entropy"]
    return rows


def run_dir(args, arm, seed):
    return os.path.join(ROOT, args.runs_dir, arm.replace("/", "__") + f"_s{seed}")


def is_done(out, cmd):
    """A finished run of the same command (its done-file), which is read instead of rerun."""
    path = os.path.join(out, "lab_done.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return json.load(f)["command"][1:] == cmd[1:]


def run_all(args, arms):
    todo = []
    for arm in arms:
        for seed in args.seeds:
            out = run_dir(args, arm, seed)
            cmd = command(arm, seed, out)
            if not is_done(out, cmd):
                todo.append((arm, seed, out, cmd))
    print(f"{len(todo)} runs to do, {args.parallel} at a time", flush=True)
    running = []
    while todo or running:
        while todo and len(running) < args.parallel:
            arm, seed, out, cmd = todo.pop(0)
            if os.path.isdir(out):
                # a half-finished run of this lab's own folder (grpo.py refuses a used output dir)
                subprocess.run(["rm", "-rf", out], check=True)
            os.makedirs(out)
            log = open(os.path.join(out, "stdout.log"), "w")
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            running.append((arm, seed, out, cmd, proc, log, time.time()))
        for item in list(running):
            arm, seed, out, cmd, proc, log, started = item
            if proc.poll() is None:
                continue
            log.close()
            running.remove(item)
            seconds = time.time() - started
            if proc.returncode != 0:
                print(f"{arm} seed {seed} FAILED (exit {proc.returncode}); see {out}/stdout.log")
                continue
            with open(os.path.join(out, "lab_done.json"), "w") as f:
                json.dump({"seconds": seconds, "command": cmd}, f)
            result = grpo_result(read_rows(os.path.join(out, "metrics.jsonl")))
            print(
                f"{arm} seed {seed}: reward {result['last-10 reward']:.2f} val "
                f"{result['val']:.2f} learns {result['learns']} ({seconds:.0f} s)",
                flush=True,
            )
        time.sleep(1)


def early_mean(rows, key, first, last):
    values = [r[key] for r in rows if key in r and first <= r["step"] <= last]
    return sum(values) / len(values) if values else float("nan")


def summarise(args, arms):
    """Per arm: which seeds learn, the last-10 reward (the sampler's) and final val (the trainer's),
    and the early metrics (EARLY_METRICS) of the runs that learn and of those that do not."""
    table = {}
    for arm in arms:
        runs = {}
        for seed in args.seeds:
            out = run_dir(args, arm, seed)
            if is_done(out, command(arm, seed, out)):
                rows = read_rows(os.path.join(out, "metrics.jsonl"))
                runs[seed] = (rows, grpo_result(rows))
        if not runs:
            continue
        learned = [seed for seed, (_, result) in runs.items() if result["learns"]]
        early = {}
        for key, first, last, _ in EARLY_METRICS:
            for group, seeds in (
                ("learn", learned),
                ("fail", [s for s in runs if s not in learned]),
            ):
                values = [early_mean(runs[s][0], key, first, last) for s in seeds]
                early[f"{key} ({group})"] = sum(values) / len(values) if values else None
        table[arm] = {
            "seeds": sorted(runs),
            "learned": learned,
            "last10_reward": [round(runs[s][1]["last-10 reward"], 4) for s in sorted(runs)],
            "final_val": [round(runs[s][1]["val"], 4) for s in sorted(runs)],
            "early": early,
        }
    return table


def mean(values):
    return sum(values) / len(values)


def markdown(table):
    lines = [
        "| source | remedy | what the remedy does | learns | reward, last 10 (sampler) | "
        "final greedy val (trainer) | seeds that fail |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm, t in table.items():
        source, remedy = parse_arm(arm)
        kind = REMEDIES[remedy][0] if arm != preset_and_reference(source)[1] else "reference"
        failed = [s for s in t["seeds"] if s not in t["learned"]]
        lines.append(
            f"| {source} | {remedy} | {kind} | {len(t['learned'])} of {len(t['seeds'])} | "
            f"{mean(t['last10_reward']):.3f} | {mean(t['final_val']):.3f} | "
            f"{', '.join(map(str, failed)) or '-'} |"
        )
    lines += [
        "",
        "Early metrics, each the mean over its steps (runs that learn / runs that fail):",
        "",
        "| arm | " + " | ".join(heading for *_, heading in EARLY_METRICS) + " |",
        "| --- " * (len(EARLY_METRICS) + 1) + "|",
    ]
    for arm, t in table.items():
        cells = []
        for key, *_ in EARLY_METRICS:
            pair = [t["early"][f"{key} ({group})"] for group in ("learn", "fail")]
            cells.append(" / ".join("-" if v is None else f"{v:.3g}" for v in pair))
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# the figure's rows: (metric, label, y scale, y range)
PLOT_ROWS = (
    ("reward/mean", "reward/mean (sampler)", "linear", (0, 1.02)),
    ("val/accuracy", "greedy val/accuracy (trainer)", "linear", (0, 1.02)),
    ("actor/entropy_loss", "entropy (the update's)", "log", (1e-3, 5)),
    ("response_length/mean", "response length (6 = never stops)", "linear", (3.8, 6.1)),
    # below 1e-4 the two policies are the same up to rounding (no mismatch)
    ("rollout_corr/k3_kl", "k3 KL(rollout, train) per token", "log", (1e-4, 3)),
)


def plot(args, arms, path):
    """One column per source, one row per PLOT_ROWS metric: the mean across seeds of each remedy,
    beside the reference (no mismatch, dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = [s for s in SOURCES if any(a.startswith(s + "/") for a in arms)]
    fig, axes = plt.subplots(
        len(PLOT_ROWS),
        len(sources),
        figsize=(3.6 * len(sources), 2.8 * len(PLOT_ROWS)),
        sharex=True,
        squeeze=False,
    )
    for column, source in enumerate(sources):
        reference = preset_and_reference(source)[1]
        shown = [a for a in arms if a.startswith(source + "/")]
        if not shown[0] == reference and reference in arms:
            shown = [reference] + shown
        for arm in shown:
            runs = []
            for seed in args.seeds:
                out = run_dir(args, arm, seed)
                if is_done(out, command(arm, seed, out)):
                    runs.append(read_rows(os.path.join(out, "metrics.jsonl")))
            if not runs:
                continue
            # one colour per remedy in every column, the reference dashed black
            _, remedy = parse_arm(arm)
            style = {"color": f"C{list(REMEDIES).index(remedy)}"}
            label = remedy
            if arm == reference:
                style = {"color": "black", "linestyle": "--"}
                label = "reference (no mismatch)"
            for row, (key, *_) in enumerate(PLOT_ROWS):
                steps = sorted({r["step"] for r in runs[0] if key in r})
                per_step = [
                    [r[key] for run in runs for r in run if r["step"] == step and key in r]
                    for step in steps
                ]
                average = [mean(values) if values else float("nan") for values in per_step]
                axes[row][column].plot(steps, average, label=f"{label} ({len(runs)})", **style)
        axes[0][column].set_title(source)
        axes[0][column].legend(fontsize=6, loc="lower right")
    for row, (_, label, scale, limits) in enumerate(PLOT_ROWS):
        axes[row][0].set_ylabel(label, fontsize=8)
        for ax in axes[row]:
            ax.grid(alpha=0.3)
            ax.set_yscale(scale)
            ax.set_ylim(*limits)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle("grpo.py tiny: mismatch source x remedy, mean over seeds (seeds in brackets)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, help="source/remedy pairs")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--runs-dir", default="runs/mismatch_lab")
    parser.add_argument("--json", default="docs/mismatch_lab.json", help="the table's numbers")
    parser.add_argument("--plot", default="docs/img/mismatch_lab.png")
    parser.add_argument("--summarise-only", action="store_true", help="run nothing new")
    args = parser.parse_args()
    groups = {"lora": LORA_ARMS, "async": ASYNC_ARMS, "tools": TOOL_ARMS}
    arms = (
        groups[args.arms[0]] if args.arms in (["lora"], ["async"], ["tools"]) else list(args.arms)
    )
    for arm in arms:
        parse_arm(arm)
    if not args.summarise_only:
        run_all(args, arms)
    table = summarise(args, arms)
    print(markdown(table))
    with open(os.path.join(ROOT, args.json), "w") as f:
        json.dump({"seeds": args.seeds, "arms": table}, f, indent=1)
    plot(args, [a for a in arms if a in table], os.path.join(ROOT, args.plot))


if __name__ == "__main__":
    main()
