"""Benchmark: the whole correction pipeline (IS + RS + veto + metrics) at B=512, T=4096 on CPU.

Reported as ratios against baselines run in the same process:
  * time: apply_rollout_correction vs a naive per-sequence Python loop computing the same weights, mask and
    (a subset of) the metrics;
  * memory: the peak of live bytes the pipeline allocates beyond its inputs (torch profiler memory events), in units
    of one (B, T) float32 tensor, next to a single (B, T) elementwise op as a yardstick (which measures 1.0).

    .venv/bin/python bench/bench_corrections.py [--batch 512 --length 4096 --repeats 3]
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import corrections as C  # noqa: E402

CONFIG = C.RolloutCorrection(
    rollout_is="token",
    rollout_is_threshold=2.0,
    rollout_rs="seq_mean_k1,seq_max_k3",
    rollout_rs_threshold="0.9995_1.0005,0.005",
    rollout_token_veto_threshold=1e-4,
)


def make_batch(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, T, generator=g) * 2
    train = rollout + torch.randn(B, T, generator=g) * 0.02
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return train, rollout, mask


def naive_loop(train, rollout, mask):
    """One sequence at a time, the way a first implementation often looks: the same weights, mask
    and metrics as apply_rollout_correction(CONFIG) (IS, the two RS options, the veto, the
    off-policy diagnostics), accumulated in Python over sequences."""
    B, T = train.shape
    weights, new_mask = torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool)
    acc = dict(
        n=0,
        w_sum=0.0,
        w_sq=0.0,
        w_max=-math.inf,
        w_min=math.inf,
        high=0,
        low=0,
        kl=0.0,
        k3=0.0,
        chi2=0.0,
        diff_sum=0.0,
        diff_max=0.0,
        rejected=0,
        k1=0.0,
    )
    seq = dict(w_mean=[], train_ppl=[], rollout_ppl=[], log_ppl_diff=[], chi2=[], k3max=[], veto=[])
    for i in range(B):
        n = int(mask[i].sum())
        tr, ro = train[i, :n], rollout[i, :n]
        lr = (tr - ro).clamp(-20, 20)
        raw = torch.exp(lr)
        w = raw.clamp(max=2.0)
        weights[i, :n] = w
        acc["n"] += n
        acc["w_sum"] += float(w.sum())
        acc["w_sq"] += float(w.clamp(min=0.0, max=2.0).square().sum())
        acc["w_max"], acc["w_min"] = (
            max(acc["w_max"], float(w.max())),
            min(acc["w_min"], float(w.min())),
        )
        acc["high"] += int((raw > 2.0).sum())
        acc["low"] += int((raw < 0.5).sum())
        seq["w_mean"].append(float(w.mean()))
        geo = math.exp(float(lr.mean()))
        k3 = torch.expm1(lr) - lr
        vetoed = bool((lr < math.log(1e-4)).any())
        keep = (0.9995 <= geo <= 1.0005) and float(k3.max()) <= 0.005 and not vetoed
        new_mask[i, :n] = keep
        acc["rejected"] += 0 if keep else n
        # k1 = -log rho; seq_mean_k1's metric mean is token-weighted (verl)
        acc["k1"] += -float(lr.sum())
        seq["k3max"].append(float(k3.max()))
        seq["veto"].append(vetoed)
        acc["kl"] += float((ro - tr).sum())
        acc["k3"] += float(k3.sum())
        acc["chi2"] += float(torch.exp(2 * lr).sum())
        seq["chi2"].append(math.exp(2 * max(-20.0, min(20.0, float((tr - ro).sum())))))
        seq["train_ppl"].append(float(-tr.mean()))
        seq["rollout_ppl"].append(float(-ro.mean()))
        seq["log_ppl_diff"].append(float(ro.mean() - tr.mean()))
        # probabilities <= 1, as the pipeline
        diff = (ro.clamp(max=0).exp() - tr.clamp(max=0).exp()).abs()
        acc["diff_sum"] += float(diff.sum())
        acc["diff_max"] = max(acc["diff_max"], float(diff.max()))
    n = acc["n"]
    mean_w = acc["w_sum"] / n
    seq_w = torch.tensor(seq["w_mean"])
    metrics = {
        "rollout_corr/rollout_is_mean": mean_w,
        "rollout_corr/rollout_is_std": math.sqrt(max(acc["w_sq"] / n - mean_w**2, 0.0)),
        "rollout_corr/rollout_is_max": acc["w_max"],
        "rollout_corr/rollout_is_min": acc["w_min"],
        "rollout_corr/rollout_is_ratio_fraction_high": acc["high"] / n,
        "rollout_corr/rollout_is_ratio_fraction_low": acc["low"] / n,
        "rollout_corr/rollout_is_eff_sample_size": 1.0 / ((acc["w_sq"] / n) / (mean_w + 1e-8) ** 2),
        "rollout_corr/rollout_is_seq_mean": float(seq_w.mean()),
        "rollout_corr/rollout_is_seq_std": float(seq_w.std()),
        "rollout_corr/rollout_rs_masked_fraction": acc["rejected"] / n,
        "rollout_corr/rollout_is_veto_fraction": sum(seq["veto"]) / B,
        "rollout_corr/kl": acc["kl"] / n,
        "rollout_corr/k3_kl": acc["k3"] / n,
        "rollout_corr/chi2_token": acc["chi2"] / n - 1,
        "rollout_corr/chi2_seq": sum(seq["chi2"]) / B - 1,
        "rollout_corr/training_ppl": sum(math.exp(v) for v in seq["train_ppl"]) / B,
        "rollout_corr/rollout_ppl": sum(math.exp(v) for v in seq["rollout_ppl"]) / B,
        "rollout_corr/log_ppl_diff": sum(seq["log_ppl_diff"]) / B,
        "rollout_corr/log_ppl_abs_diff": sum(abs(v) for v in seq["log_ppl_diff"]) / B,
        "rollout_corr/ppl_ratio": sum(math.exp(v) for v in seq["log_ppl_diff"]) / B,
        "training/rollout_probs_diff_mean": acc["diff_sum"] / n,
        "training/rollout_probs_diff_max": acc["diff_max"],
        "rollout_corr/rollout_rs_seq_mean_k1_mean": acc["k1"] / n,
        "rollout_corr/rollout_rs_seq_max_k3_max": max(seq["k3max"]),
    }
    return weights, new_mask, metrics


def timeit(fn, repeats):
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def peak_extra_bytes(fn):
    """Peak of (allocated - freed) CPU bytes while fn runs, from the profiler's memory events in
    time order (each op's own allocations, and the frees). One (B, T) elementwise op measures
    exactly 1 x (B, T)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    events = sorted(
        (e for e in prof.events() if e.self_cpu_memory_usage != 0), key=lambda e: e.time_range.start
    )
    current = peak = 0
    for event in events:
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    B, T = args.batch, args.length

    train, rollout, mask = make_batch(B, T)
    t_pipe, (weights, new_mask, metrics) = timeit(
        lambda: C.apply_rollout_correction(train, rollout, mask, CONFIG), args.repeats
    )
    t_loop, (loop_w, loop_mask, loop_m) = timeit(lambda: naive_loop(train, rollout, mask), 1)
    # the two must agree before their times mean anything
    assert torch.allclose(weights, loop_w, atol=1e-6), "IS weights differ"
    assert torch.equal(new_mask.bool(), loop_mask), "masks differ"
    for key, value in loop_m.items():
        assert abs(metrics[key] - value) <= 1e-4 * max(1.0, abs(value)), (key, metrics[key], value)

    one_tensor = B * T * 4
    mem = {
        "one_op": peak_extra_bytes(lambda: train - rollout),
        "pipeline": peak_extra_bytes(
            lambda: C.apply_rollout_correction(train, rollout, mask, CONFIG)
        ),
    }
    rejected = 1 - float(new_mask.sum()) / float(mask.sum())
    print(
        f"B={B} T={T} ({B * T / 1e6:.1f}M tokens, {mask.sum().item() / 1e6:.2f}M valid), torch threads "
        f"{torch.get_num_threads()}, rejected token fraction {rejected:.3f}"
    )
    print("| measurement | value |\n|---|---|")
    print(f"| pipeline time (IS + RS x2 + veto + all metrics) | {t_pipe:.3f} s |")
    print(
        f"| naive per-sequence loop time (same weights, mask and {len(loop_m)} of its metrics) | {t_loop:.3f} s |"
    )
    print(f"| speed-up vs loop | {t_loop / t_pipe:.1f}x |")
    print(
        f"| peak extra memory, one (B,T) elementwise op (yardstick) | {mem['one_op'] / one_tensor:.2f} x (B,T) fp32 |"
    )
    print(
        f"| peak extra memory, whole pipeline (outputs included) | {mem['pipeline'] / one_tensor:.2f} x (B,T) fp32 |"
    )


if __name__ == "__main__":
    main()
