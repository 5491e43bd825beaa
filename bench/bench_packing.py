"""The update's forward and backward over one micro-batch, padded against packed, on SmolLM2-135M
in one process: the time logprobs.response_logprobs and its backward take per layout, at the
lengths of a run's batches.

    .venv/bin/python bench/bench_packing.py                    # smol_arith's lengths and 128 tokens
    .venv/bin/python bench/bench_packing.py --write            # and append the table to RESULTS.md

One micro-batch of 16 sequences (bench_smollm2.py's and smol_arith's micro-batch): prompts of 45
to 70 tokens (smol_arith's chat prompts), responses drawn uniformly between a shortest and a
longest length, padded to --max-response-length as rollout.make_batch pads them. Layouts: padded
(--no-use-remove-padding), trimmed, packed under sdpa's block-causal mask (rows as wide as the
longest sequence: --compile-layers' layout), packed in one row under varlen_sdpa
(--use-remove-padding's default). fp32 on CPU, the mean of --repeats timed passes after one
warm-up; the ratio is padded / layout.
"""

import argparse
import copy
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import logprobs  # noqa: E402
import rollout  # noqa: E402

SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
# (name, shortest response, longest response, --max-response-length)
SHAPES = [
    ("smol_arith (10-64 of 64 tokens)", 10, 64, 64),
    ("bench_smollm2 (40-128 of 128 tokens)", 40, 128, 128),
]


def micro_batch(shortest, longest, response_length, rows=16, seed=0):
    """rollout.make_batch's tensors for `rows` random prompts and responses of the given lengths."""
    g = torch.Generator().manual_seed(seed)

    def tokens(low, high):
        length = int(torch.randint(low, high + 1, (1,), generator=g))
        return torch.randint(3, 1000, (length,), generator=g).tolist()

    prompts = [tokens(45, 70) for _ in range(rows)]
    responses = [tokens(shortest, longest) for _ in range(rows)]
    zeros = [[0.0] * len(r) for r in responses]
    return rollout.make_batch(prompts, responses, zeros, 2, response_length, torch.device("cpu"))


def seconds(model, batch, layout, repeats):
    """Mean seconds of response_logprobs + backward over `batch` in `layout`, after a warm-up."""
    settings = logprobs.LogprobSettings(layout=layout)
    times = []
    for i in range(repeats + 1):
        t0 = time.time()
        lp, _ = logprobs.response_logprobs(model, batch, settings)
        lp.sum().backward()
        model.zero_grad()
        if i:
            times.append(time.time() - t0)
    return sum(times) / len(times)


def main():
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per layout")
    parser.add_argument("--write", action="store_true", help="append the table to RESULTS.md")
    opts = parser.parse_args()
    sdpa = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32).train()
    varlen = copy.deepcopy(sdpa)
    logprobs.use_varlen_attention(varlen)
    layouts = [
        ("padded", sdpa, "padded"),
        ("trimmed", sdpa, "trimmed"),
        ("packed, sdpa block mask", sdpa, "packed"),
        ("packed, varlen_sdpa (default)", varlen, "packed"),
    ]
    lines = [
        "## Padded and packed micro-batches: the update's forward + backward (bench/bench_packing.py)",
        "",
        f"Measured by `.venv/bin/python bench/bench_packing.py --repeats {opts.repeats}` (torch "
        f"{torch.__version__}, CPU, {torch.get_num_threads()} torch threads): SmolLM2-135M-Instruct"
        ", fp32, one micro-batch of 16 sequences (prompts of 45-70 tokens); seconds per forward"
        " + backward of logprobs.response_logprobs, and padded / layout.",
        "",
        "| lengths | padding | " + " | ".join(name for name, _, _ in layouts) + " |",
        "| --- | --- | " + " | ".join("---" for _ in layouts) + " |",
    ]
    for shape, shortest, longest, response_length in SHAPES:
        batch = micro_batch(shortest, longest, response_length)
        padding = 1 - batch["attention_mask"].sum().item() / batch["attention_mask"].numel()
        times = [seconds(model, batch, layout, opts.repeats) for _, model, layout in layouts]
        cells = [f"{t:.2f} s ({times[0] / t:.2f}x)" for t in times]
        lines.append(f"| {shape} | {padding:.0%} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.write:
        with open(os.path.join(ROOT, "bench", "RESULTS.md"), "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
