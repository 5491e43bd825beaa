"""Benchmark: the whole correction pipeline (IS + RS + veto + metrics) at B=512, T=4096 on CPU.

Reported as ratios against baselines run in the same process:
  * time: apply_rollout_correction vs a naive per-sequence Python loop computing the same weights, mask and
    (a subset of) the metrics;
  * memory: peak resident memory added by the pipeline, in units of one (B, T) float32 tensor, measured in a fresh
    subprocess per measurement (ru_maxrss), next to the peak added by a single (B, T) elementwise op as a yardstick.

    .venv/bin/python bench/bench_corrections.py [--batch 512 --length 4096 --repeats 3]
"""

import argparse
import ctypes
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corrections as C  # noqa: E402

CONFIG = C.RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1,seq_max_k3",
                             rollout_rs_threshold="0.99_1.0101,0.5", rollout_token_veto_threshold=1e-4)


def make_batch(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 2
    train = rollout + torch.randn(B, T, generator=g) * 0.02
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return train, rollout, mask


def naive_loop(train, rollout, mask):
    """One sequence at a time, the way a first implementation often looks."""
    B, T = train.shape
    weights, new_mask = torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool)
    kl_sum, k3_sum, n_tokens, diff_max = 0.0, 0.0, 0, 0.0
    for i in range(B):
        n = int(mask[i].sum())
        lr = (train[i, :n] - rollout[i, :n]).clamp(-20, 20)
        weights[i, :n] = torch.exp(lr).clamp(max=2.0)
        geo = math.exp(float(lr.mean()))
        k3_max = float((torch.expm1(lr) - lr).max())
        vetoed = bool((lr < math.log(1e-4)).any())
        keep = (0.99 <= geo <= 1.0101) and k3_max <= 0.5 and not vetoed
        new_mask[i, :n] = keep
        kl_sum += float((rollout[i, :n] - train[i, :n]).sum())
        k3_sum += float((torch.expm1(lr) - lr).sum())
        n_tokens += n
        diff_max = max(diff_max, float((rollout[i, :n].exp() - train[i, :n].exp()).abs().max()))
    return weights, new_mask, {"kl": kl_sum / n_tokens, "k3_kl": k3_sum / n_tokens, "diff_max": diff_max}


def timeit(fn, repeats):
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def peak_memory_child(what, B, T):
    """Runs in a fresh process: peak RSS growth (bytes) caused by `what` after the inputs exist. ru_maxrss is the
    high-water mark of the process, so the growth is what the step allocated at its peak beyond what was resident."""
    torch.set_num_threads(1)
    torch.manual_seed(0)  # inputs built in place, so that building them leaves no higher high-water mark behind
    rollout = torch.empty(B, T).uniform_(-2.0, 0.0)
    train = torch.empty(B, T).normal_(0.0, 0.02).add_(rollout)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[: B // 2, T // 2:] = False
    if what == "pipeline":  # warm up code paths on a tiny batch so import-time allocations don't count
        C.apply_rollout_correction(*[x[:2, :8] for x in (train, rollout)], mask[:2, :8], CONFIG)
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed warm-up memory back
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * resource.getpagesize() // 1024  # resident now, in KiB like ru_maxrss
    if what == "pipeline":
        C.apply_rollout_correction(train, rollout, mask, CONFIG)
    elif what == "one_op":
        _ = train - rollout  # exactly one new (B, T) float32 tensor
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"delta_bytes": (peak - base) * 1024}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    B, T = args.batch, args.length
    if args.child:
        return peak_memory_child(args.child, B, T)

    train, rollout, mask = make_batch(B, T)
    t_pipe, (weights, new_mask, metrics) = timeit(lambda: C.apply_rollout_correction(train, rollout, mask, CONFIG),
                                                  args.repeats)
    t_loop, (loop_w, loop_mask, loop_m) = timeit(lambda: naive_loop(train, rollout, mask), 1)
    # the two must agree before their times mean anything
    assert torch.allclose(weights, loop_w, atol=1e-6), "IS weights differ"
    assert torch.equal(new_mask.bool(), loop_mask), "masks differ"
    assert abs(metrics["rollout_corr/kl"] - loop_m["kl"]) < 1e-5

    one_tensor = B * T * 4
    mem = {}
    for what in ("one_op", "pipeline"):  # the smallest of 3 fresh processes: RSS is noisy on a loaded machine
        runs = [subprocess.run([sys.executable, __file__, "--child", what, "--batch", str(B), "--length", str(T)],
                               capture_output=True, text=True, check=True) for _ in range(3)]
        mem[what] = min(json.loads(r.stdout.strip().splitlines()[-1])["delta_bytes"] for r in runs)
    rejected = 1 - float(new_mask.sum()) / float(mask.sum())
    print(f"B={B} T={T} ({B * T / 1e6:.1f}M tokens, {mask.sum().item() / 1e6:.2f}M valid), torch threads "
          f"{torch.get_num_threads()}, rejected token fraction {rejected:.3f}")
    print(f"| measurement | value |\n|---|---|")
    print(f"| pipeline time (IS + RS x2 + veto + all metrics) | {t_pipe:.3f} s |")
    print(f"| naive per-sequence loop time (subset of metrics) | {t_loop:.3f} s |")
    print(f"| speed-up vs loop | {t_loop / t_pipe:.1f}x |")
    print(f"| peak RSS growth, one (B,T) elementwise op | {mem['one_op'] / one_tensor:.2f} x (B,T) fp32 |")
    print(f"| peak RSS growth, whole pipeline (1 thread) | {mem['pipeline'] / one_tensor:.2f} x (B,T) fp32 |")


if __name__ == "__main__":
    main()
