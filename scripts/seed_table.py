"""Does a first run learn in every seed? Run a preset over seeds (and rollout backends) and print
one row per seed with the criterion its docs state.

    .venv/bin/python scripts/seed_table.py grpo --backends hf vllm   # grpo.py tiny, seeds 1-8
    .venv/bin/python scripts/seed_table.py ppo_rlhf                  # ppo_rlhf.py tiny, seeds 1-8
    .venv/bin/python scripts/seed_table.py rewards                   # rewards.py tiny, seeds 1-8
    .venv/bin/python scripts/seed_table.py grpo --seeds 4 5 --name n16 -- --rollout-n 16
    .venv/bin/python scripts/seed_table.py grpo --preset tiny_dapo --seeds 1 2 3 --name dapo
    .venv/bin/python scripts/seed_table.py grpo --nproc 2 --name fsdp2 -- --sharding fsdp2

(grpo.py flags after "--" change the preset for every run of the table; --nproc N starts each run
under torchrun with N processes.)

The criteria (CRITERIA below) are the ones docs/grpo.md, docs/ppo_rlhf.md and docs/rewards.md state:

    grpo      mean reward/mean of the last 10 steps >= 0.8 and the final greedy val/accuracy >= 0.8
    ppo_rlhf  mean objective/scores of the last 10 updates >= 0.5 (a random policy: about -0.7)
              and their mean objective/kl within [2, 8] (the preset's target is 4)
    rewards   final test/accuracy >= 0.7 (256 held-out best-of-4 labels; chance 0.25)

A run that ends with an error but logged metrics (grpo.py --dynamic-sampling stops at
--max-num-gen-batches) counts with what it logged (the "steps" row says where it stopped).

Runs go one after another (2 cores: a second run in parallel would slow both and change the timing
column) into runs/seed_table/<name>_<backend>_s<seed>/ (<name>: --name, default the script); a run
that finished there with the same command is read again instead of rerun (--no-reuse reruns it).
The table (markdown) is printed and written to runs/seed_table/<name>.md with the command that
made it.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mean(values):
    return sum(values) / len(values) if values else float("nan")


def grpo_result(rows):
    """Last-10 training reward, final greedy validation accuracy, and the final response length."""
    train = [r for r in rows if "reward/mean" in r]
    val = [r for r in rows if "val/accuracy" in r]
    last10 = mean([r["reward/mean"] for r in train[-10:]])
    final_val = val[-1]["val/accuracy"] if val else float("nan")
    result = {
        "last-10 reward": last10,
        "val": final_val,
        "last-10 length": mean([r["response_length/mean"] for r in train[-10:]]),
    }
    if any("filter_groups/gen_batches" in r for r in train):  # --dynamic-sampling
        result["gen batches per step"] = mean([r["filter_groups/gen_batches"] for r in train])
        # a run stops early (exit 1) where --max-num-gen-batches found too few groups with signal
        result["steps"] = train[-1]["step"] if train else 0
    if any("tools/call_frequency" in r for r in train):  # --tools: the base's and the end's
        result["val before training"] = val[0]["val/accuracy"] if val else float("nan")
        result["last-10 tool calls per response"] = mean(
            [r["tools/call_frequency"] for r in train[-10:]]
        )
    result["learns"] = last10 >= 0.8 and final_val >= 0.8
    return result


def ppo_rlhf_result(rows):
    """Last-10 score and KL of the PPO updates (rows with objective/scores)."""
    updates = [r for r in rows if "objective/scores" in r]
    score = mean([r["objective/scores"] for r in updates[-10:]])
    kl = mean([r["objective/kl"] for r in updates[-10:]])
    return {
        "first-3 score": mean([r["objective/scores"] for r in updates[:3]]),
        "last-10 score": score,
        "last-10 kl": kl,
        "learns": score >= 0.5 and 2.0 <= kl <= 8.0,
    }


def rewards_result(rows):
    """The last test/accuracy the reward model logged."""
    tests = [r for r in rows if "test/accuracy" in r]
    accuracy = tests[-1]["test/accuracy"] if tests else float("nan")
    return {"test/accuracy": accuracy, "learns": accuracy >= 0.7}


# script -> (the file, its preset, how to read a finished run's metrics.jsonl, whether it has a
# --backend)
CRITERIA = {
    "grpo": ("grpo.py", "tiny", grpo_result, True),
    "ppo_rlhf": ("ppo_rlhf.py", "tiny", ppo_rlhf_result, False),
    "rewards": ("rewards.py", "tiny", rewards_result, False),
}


def read_rows(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_one(script, preset, backend, seed, extra, out, reuse, nproc=1):
    """Runs one seed (under torchrun with nproc processes if nproc > 1), unless a run of the same
    command finished there, and returns (rows, seconds the run took)."""
    file, _, _, has_backend = CRITERIA[script]
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += [os.path.join(ROOT, file), preset, "--seed", str(seed)]
    cmd += ["--output-dir", out]
    if has_backend:
        cmd += ["--backend", backend]
    cmd += extra
    done_marker = os.path.join(out, "seed_table_done.json")
    if reuse and os.path.exists(done_marker):
        with open(done_marker) as f:
            done = json.load(f)
        if done["command"][1:] == cmd[1:]:  # the interpreter's path may differ
            return read_rows(os.path.join(out, "metrics.jsonl")), done["seconds"]
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    start = time.time()
    with open(os.path.join(out, "stdout.log"), "w") as log:
        code = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.time() - start
    if code != 0:
        print(f"{' '.join(cmd)} ended with exit code {code}; see {out}/stdout.log", flush=True)
        if not os.path.exists(os.path.join(out, "metrics.jsonl")):
            sys.exit(1)
    with open(done_marker, "w") as f:
        json.dump({"seconds": seconds, "command": cmd}, f)
    return read_rows(os.path.join(out, "metrics.jsonl")), seconds


def format_value(value):
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, int):
        return str(value)
    return f"{value:.2f}"


def table(results, seeds):
    """Markdown: one row per (backend, quantity), one column per seed, and the count that learn."""
    lines = ["| | " + " | ".join(str(s) for s in seeds) + " | learns |"]
    lines.append("| --- " * (len(seeds) + 2) + "|")
    for backend, per_seed in results.items():
        learned = sum(per_seed[s]["learns"] for s in seeds)
        quantities = [k for k in per_seed[seeds[0]] if k not in ("learns", "seconds")]
        for i, key in enumerate(quantities + ["seconds"]):
            if key == "seconds":
                cells = [f"{per_seed[s]['seconds']:.0f}" for s in seeds]
            else:
                cells = [format_value(per_seed[s][key]) for s in seeds]
            count = f"{learned} of {len(seeds)}" if i == 0 else ""
            lines.append(f"| {backend}: {key} | " + " | ".join(cells) + f" | {count} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", choices=sorted(CRITERIA))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--backends", nargs="+", default=["hf"], choices=["hf", "vllm"])
    parser.add_argument("--preset", help="another preset of the script (default: tiny)")
    parser.add_argument("--name", default="", help="table name (default: <script>)")
    parser.add_argument("--runs-dir", default="runs/seed_table")
    parser.add_argument("--no-reuse", dest="reuse", action="store_false")
    parser.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun)")
    # flags for every run come after "--"
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.extra = argv[split + 1 :]
    file, preset, result_of, has_backend = CRITERIA[args.script]
    preset = args.preset or preset
    name = args.name or args.script
    backends = args.backends if has_backend else ["-"]
    results = {}
    for backend in backends:
        results[backend] = {}
        for seed in args.seeds:
            tag = f"{name}_{backend}_s{seed}" if has_backend else f"{name}_s{seed}"
            out = os.path.join(ROOT, args.runs_dir, tag)
            rows, seconds = run_one(
                args.script, preset, backend, seed, args.extra, out, args.reuse, args.nproc
            )
            result = result_of(rows)
            result["seconds"] = seconds
            results[backend][seed] = result
            shown = {k: format_value(v) for k, v in result.items()}
            print(f"{tag}: {shown}", flush=True)
    command = " ".join(["python scripts/seed_table.py"] + sys.argv[1:])
    text = f"`{command}` ({file} {preset})\n\n" + table(results, args.seeds)
    print("\n" + text)
    with open(os.path.join(ROOT, args.runs_dir, f"{name}.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
