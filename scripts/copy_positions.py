"""What a grpo.py copy-task run samples early on: per answer position, how often the sampled letter
is the prompt's letter there, and how often a response only repeats one letter.

    .venv/bin/python grpo.py tiny --seed 4 --tiny-arch qwen2 --log-samples-every 1 \
        --num-log-samples 64 --output-dir runs/copy_qwen2_s4
    .venv/bin/python scripts/copy_positions.py runs/copy_qwen2_s4 --steps 11 30

The run must log many samples per step (`--log-samples-every 1 --num-log-samples 64`: two prompts'
groups of 32 per step); samples.jsonl holds each prompt, response and score. Printed per window of
steps: the three positions' match rates, the repeat rate (the first three characters are one letter
while the prompt's are not) and the mean reward of those samples.
"""

import argparse
import json
import os


def window_stats(samples):
    """(match rate at positions 0, 1, 2; repeat rate; mean score) over a list of sample rows."""
    matches = [0, 0, 0]
    repeats = 0
    candidates = 0
    for row in samples:
        target = row["prompt"].rstrip("=")
        response = row["response"]
        for i in range(3):
            matches[i] += len(response) > i and response[i] == target[i]
        if len(set(target[:3])) > 1:
            candidates += 1
            repeats += len(response) >= 3 and len(set(response[:3])) == 1
    n = max(len(samples), 1)
    rates = [m / n for m in matches]
    return rates, repeats / max(candidates, 1), sum(r["score"] for r in samples) / n


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders with samples.jsonl")
    parser.add_argument("--steps", type=int, nargs=2, default=[1, 30], help="first and last step")
    parser.add_argument("--window", type=int, default=10, help="steps per row")
    args = parser.parse_args()
    print("| run | steps | match pos 0 / 1 / 2 | repeats one letter | mean score |")
    print("| --- | --- | --- | --- | --- |")
    for run in args.runs:
        with open(os.path.join(run, "samples.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        first, last = args.steps
        for start in range(first, last + 1, args.window):
            end = min(start + args.window - 1, last)
            window = [r for r in rows if start <= r["step"] <= end]
            rates, repeats, score = window_stats(window)
            shown = " / ".join(f"{r:.2f}" for r in rates)
            name = os.path.basename(os.path.normpath(run))
            print(f"| {name} | {start}-{end} | {shown} | {repeats:.2f} | {score:.3f} |")


if __name__ == "__main__":
    main()
