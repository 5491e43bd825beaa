"""Fixed-seed runs whose every logged value must stay the same when code only moves.

A refactor changes no behaviour: record these runs before it, again after it, and compare. Each run
is a command line of the scripts themselves, in a fresh folder; what is recorded is every row of
metrics.jsonl and samples.jsonl (without the wall-clock keys timing/* and time/*) and a digest of
the final weights (the tensors, not the file bytes, so a change of checkpoint layout alone does not
count).

    .venv/bin/python scripts/fixed_seed_metrics.py --output runs/fixed_before.json
    (change the code)
    .venv/bin/python scripts/fixed_seed_metrics.py --output runs/fixed_after.json --compare runs/fixed_before.json

--only NAME [NAME ...] runs a subset. About 8 minutes on 2 CPU cores for all of them (vLLM and SmolLM2 included).
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable

# grpo.py tiny's groups and model before the preset took groups of 32 and the GPT-2 tiny model
# (docs/grpo.md, "Does the first run learn in every seed?"): pinned, so records made before those
# changes still compare
GRPO_PINNED = ["--rollout-n", "8", "--train-batch-size", "32", "--ppo-mini-batch-size", "16"]
GRPO_PINNED += ["--tiny-arch", "qwen2"]

# name -> (script and arguments, the weight files whose tensors are digested, relative to the output
# folder)
RUNS = {
    "grpo_tiny_hf_20": (
        ["grpo.py", "tiny", "--total-steps", "20", *GRPO_PINNED],
        ["checkpoint/model.safetensors"],
    ),
    "grpo_tiny_vllm_10": (
        ["grpo.py", "tiny", "--backend", "vllm", "--total-steps", "10", *GRPO_PINNED],
        ["checkpoint/model.safetensors"],
    ),
    "grpo_seq_is_rs_int8_6": (
        ["grpo.py", "tiny", "--total-steps", "6", "--correction", "decoupled_seq_is_rs"]
        + ["--mismatch", "int8", *GRPO_PINNED],
        ["checkpoint/model.safetensors"],
    ),
    "grpo_bypass_pg_staleness_kl_6": (
        ["grpo.py", "tiny", "--total-steps", "6", "--correction", "bypass_pg_geo_rs_token_tis"]
        + ["--rollout-staleness", "1", "--kl-loss-coef", "0.01", *GRPO_PINNED],
        ["checkpoint/model.safetensors"],
    ),
    "grpo_named_losses_4": (
        ["grpo.py", "tiny", "--total-steps", "4", "--policy-loss", "dro", "--dro-beta", "0.1"]
        + ["--adv-estimator", "reinforce_plus_plus", *GRPO_PINNED],
        ["checkpoint/model.safetensors"],
    ),
    "grpo_gspo_gdpo_4": (
        ["grpo.py", "tiny", "--total-steps", "4", "--policy-loss", "gspo"]
        + ["--adv-estimator", "gdpo", *GRPO_PINNED],
        ["checkpoint/model.safetensors"],
    ),
    "ppo_rlhf_tiny_10": (
        ["ppo_rlhf.py", "tiny", "--total-episodes", "640"],
        ["policy/model.safetensors", "policy/value_head.pt"],
    ),
    "ppo_rlhf_token_is_5": (
        ["ppo_rlhf.py", "tiny", "--total-episodes", "320", "--correction", "decoupled_token_is"],
        ["policy/model.safetensors", "policy/value_head.pt"],
    ),
    "ppo_rlhf_bypass_pg_is_5": (
        ["ppo_rlhf.py", "tiny", "--total-episodes", "320", "--correction", "bypass_pg_is"],
        ["policy/model.safetensors", "policy/value_head.pt"],
    ),
    "rewards_tiny": (
        ["rewards.py", "tiny"],
        ["reward_model/model.safetensors", "reward_model/reward_head.pt"],
    ),
    "grpo_smol_arith_1": (
        ["grpo.py", "smol_arith", "--total-steps", "1"],
        [],
    ),
    # the scale features' paths through train() and update_policy: the async producer (exact,
    # in-flight, vLLM's), fp16's loss scaler with ReMax's greedy baseline, FSDP2 in one process with
    # a LoRA adapter, DAPO's dynamic sampling, ppo_rlhf.py's LoRA policy
    "grpo_async_k1_6": (
        ["grpo.py", "tiny", "--total-steps", "6", "--async-rollouts", *GRPO_PINNED],
        ["checkpoint/model.safetensors"],
    ),
    "grpo_in_flight_6": (
        ["grpo.py", "tiny", "--total-steps", "6", "--async-rollouts", "--in-flight-updates"]
        + GRPO_PINNED,
        ["checkpoint/model.safetensors"],
    ),
    "grpo_vllm_async_6": (
        ["grpo.py", "tiny", "--backend", "vllm", "--total-steps", "6", "--async-rollouts"]
        + GRPO_PINNED,
        ["checkpoint/model.safetensors"],
    ),
    "grpo_fp16_remax_4": (
        ["grpo.py", "tiny", "--total-steps", "4", "--precision", "fp16"]
        + ["--adv-estimator", "remax", *GRPO_PINNED],
        ["checkpoint/model.safetensors"],
    ),
    "grpo_fsdp2_lora_4": (
        ["grpo.py", "tiny_lora", "--total-steps", "4", "--sharding", "fsdp2"],
        ["checkpoint/adapter_model.safetensors", "merged_model/model.safetensors"],
    ),
    "grpo_dapo_6": (
        ["grpo.py", "tiny_dapo", "--total-steps", "6"],
        ["checkpoint/model.safetensors"],
    ),
    "ppo_rlhf_lora_5": (
        ["ppo_rlhf.py", "tiny_lora", "--total-episodes", "320"],
        ["policy/model.safetensors", "policy/value_head.pt"],
    ),
}
CLOCK_KEYS = ("timing/", "time/")


def read_rows(path):
    """The rows of a jsonl file without wall-clock keys ([] if the file is absent)."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows.append({k: v for k, v in row.items() if not k.startswith(CLOCK_KEYS)})
    return rows


def weights_digest(path):
    """sha256 over the tensors of a .safetensors or torch .pt file, in name order."""
    import torch

    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        tensors = load_file(path)
    else:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(
            tensors[name].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()


def run(name, workdir, grpo_flags=()):
    command, weight_files = RUNS[name]
    if command[0] == "grpo.py":
        command = [*command, *grpo_flags]
    output_dir = os.path.join(workdir, name)
    start = time.time()
    result = subprocess.run(
        [PYTHON, *command, "--output-dir", output_dir], cwd=ROOT, capture_output=True, text=True
    )
    if result.returncode != 0:
        sys.exit(f"{name} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    # the reward model that ppo_rlhf.py trains first has its own metrics
    reward_run = os.path.join(output_dir, "reward_model_run")
    return {
        "command": command,
        "seconds": round(time.time() - start, 1),
        "metrics": read_rows(os.path.join(output_dir, "metrics.jsonl")),
        "samples": read_rows(os.path.join(output_dir, "samples.jsonl")),
        "reward_model_metrics": read_rows(os.path.join(reward_run, "metrics.jsonl")),
        "weights": {f: weights_digest(os.path.join(output_dir, f)) for f in weight_files},
    }


def differences(before, after):
    """Lines that say where two recordings of the same run differ (empty: identical)."""
    out = []
    for part in ("metrics", "samples", "reward_model_metrics"):
        rows_a, rows_b = before[part], after[part]
        if len(rows_a) != len(rows_b):
            out.append(f"{part}: {len(rows_a)} rows before, {len(rows_b)} after")
        for i, (a, b) in enumerate(zip(rows_a, rows_b)):
            if a != b:
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                shown = ", ".join(f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys[:4])
                out.append(f"{part} row {i + 1}: {len(keys)} keys differ ({shown})")
                break
    if before["weights"] != after["weights"]:
        out.append(f"weights differ: {before['weights']} -> {after['weights']}")
    if out:
        out.append(largest_difference(before["metrics"], after["metrics"]))
    return out


def largest_difference(rows_a, rows_b):
    """Where two runs' logged numbers differ most: |a - b| / max(|a|, |b|) over every number of
    every row (the two runs' rows in step order), and that number's key and step."""
    worst = (0.0, None, None)
    for a, b in zip(rows_a, rows_b):
        for key in set(a) & set(b):
            x, y = a[key], b[key]
            if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x != y:
                relative = abs(x - y) / max(abs(x), abs(y))
                worst = max(worst, (relative, key, a.get("step")), key=lambda w: w[0])
    relative, key, step = worst
    return f"largest relative difference {relative:.2e} ({key} at step {step})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="where the recording (JSON) goes")
    parser.add_argument("--compare", help="an earlier recording to compare with")
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), help="run only these")
    parser.add_argument(
        "--grpo-flag",
        action="append",
        default=[],
        help="a flag added to every grpo.py run (repeat it): --grpo-flag=--no-use-remove-padding",
    )
    args = parser.parse_args()
    names = args.only or list(RUNS)
    recording = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            recording[name] = run(name, workdir, args.grpo_flag)
            print(f"{name}: {recording[name]['seconds']} s", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(recording, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            earlier = json.load(f)
        failed = False
        for name in names:
            if name not in earlier:
                print(f"{name}: not in {args.compare}")
                continue
            diff = differences(earlier[name], recording[name])
            failed |= bool(diff)
            rows = len(recording[name]["metrics"]) + len(recording[name]["samples"])
            print(f"{name}: " + ("; ".join(diff) if diff else f"identical ({rows} rows, weights)"))
        sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
