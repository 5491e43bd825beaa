"""How far the rollout engine's token probabilities sit from the trainer's under each --precision
(issue 34; Qi et al. 2025, "Defeating the Training-Inference Mismatch via FP16", arXiv:2510.26788).

The same fp32 weights and the same prompts, twice per precision, as grpo.py computes them:
  rollout   rollout.HFBackend samples n responses per prompt with KV-cache decoding under the
            precision's autocast; its logits come out of the LM head in that dtype, as an inference
            engine's do (vLLM computes them in its model dtype)
  trainer   logprobs.response_logprobs recomputes the sampled tokens' logprobs with one full forward
            under the same autocast, the LM head in fp32 (TF32 on CUDA)
and compares them with corrections.offpolicy_metrics: KL(rollout || trainer) as k1
(rollout_corr/kl) and k3, and |p_rollout - p_trainer| over the sampled tokens (Yao et al. 2025's
mismatch, training/rollout_probs_diff_*).

    python scripts/precision_mismatch.py       # SmolLM2-135M-Instruct on CPU: CPU autocast runs
                                               # real bfloat16 / float16 kernels (~4 min, 2 cores)
    python scripts/precision_mismatch.py --device cuda          # the same on a GPU
    python scripts/precision_mismatch.py --model-config tests/model_configs/Qwen2.5-0.5B-Instruct
                                               # a random-init model of that config, random prompts

scripts/gpu_check.sh runs it on the GPU (SmolLM2 when converted, else the random-init Qwen2.5-0.5B).
"""

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import corrections  # noqa: E402
import grpo  # noqa: E402
import logprobs  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402

SHOWN = (
    ("rollout_corr/kl", "KL k1"),
    ("rollout_corr/k3_kl", "KL k3"),
    ("training/rollout_probs_diff_mean", "mean abs(dp)"),
    ("training/rollout_probs_diff_max", "max abs(dp)"),
)


def smollm2_prompts(tokenizer, count):
    """The smol_arith preset's held-out prompts (chat template, one worked example), token ids."""
    args = grpo.PRESETS["smol_arith"][1]
    val = tasks.load_task(args).val
    _, prompt_ids = tasks.drop_overlong(val, tokenizer, args)
    return prompt_ids[:count]


@torch.no_grad()
def measure(model, prompt_ids, precision, n, max_new_tokens, temperature, seed, eos_id, pad_id):
    """corrections.offpolicy_metrics of one rollout (n samples per prompt) against the trainer's
    recompute of the same tokens, both under `precision` (logprobs.PRECISIONS)."""
    device = next(model.parameters()).device
    backend = rollout.HFBackend(model, eos_id, pad_id, precision=precision)
    responses, rollout_logprobs, _ = backend.generate(
        prompt_ids, n, max_new_tokens, temperature, seed
    )
    batch = rollout.make_batch(
        [p for p in prompt_ids for _ in range(n)],
        responses,
        rollout_logprobs,
        pad_id,
        max_new_tokens,
        device,
    )
    model.eval()
    settings = logprobs.LogprobSettings(temperature=temperature, precision=precision)
    train_logprobs = []
    for start in range(0, len(responses), 16):  # micro-batches of 16 rows
        rows = slice(start, start + 16)
        lp, _ = logprobs.response_logprobs(model, {k: v[rows] for k, v in batch.items()}, settings)
        train_logprobs.append(lp)
    return corrections.offpolicy_metrics(
        torch.cat(train_logprobs), batch["rollout_logprobs"], batch["response_mask"]
    )


def load(model_path, model_config, device, prompts, prompt_length, seed):
    """(model, prompt ids, eos id, pad id, name): a converted checkpoint with the smol_arith
    prompts, or a random-init model of a config.json with random prompt tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if model_config:
        config = AutoConfig.from_pretrained(model_config)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, config.vocab_size - 1, (prompts, prompt_length), generator=g)
        # no EOS: every response runs to max_new_tokens
        name = f"random-init {os.path.basename(model_config.rstrip('/'))}"
        return model, ids.tolist(), None, 0, name
    problem = tasks.smollm2_problem(model_path)
    if problem:
        raise SystemExit(problem)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    name = os.path.basename(model_path.rstrip("/"))
    return model, smollm2_prompts(tokenizer, prompts), tokenizer.eos_token_id, pad_id, name


def run(opts):
    """{precision: metrics} for opts.precisions, and the model's name; prints a table."""
    device = torch.device(opts.device)
    model, prompt_ids, eos_id, pad_id, name = load(
        opts.model, opts.model_config, device, opts.prompts, opts.prompt_length, opts.seed
    )
    results = {}
    for precision in opts.precisions:
        t0 = time.time()
        results[precision] = measure(
            model,
            prompt_ids,
            precision,
            opts.n,
            opts.max_new_tokens,
            opts.temperature,
            opts.seed,
            eos_id,
            pad_id,
        )
        shown = ", ".join(f"{short} {results[precision][key]:.3g}" for key, short in SHOWN)
        print(f"{precision}: {shown} ({time.time() - t0:.0f} s)", flush=True)
    header = "| precision | " + " | ".join(short for _, short in SHOWN) + " |"
    print(f"\n{name}, {device.type}: {len(prompt_ids)} prompts x {opts.n}, T {opts.temperature}")
    print(header + "\n" + "| --- " * (len(SHOWN) + 1) + "|")
    for precision, metrics in results.items():
        cells = " | ".join(f"{metrics[key]:.2e}" for key, _ in SHOWN)
        print(f"| {precision} | {cells} |")
    return results, name


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=tasks.SMOLLM2_PATH, help="a converted HF folder")
    parser.add_argument("--model-config", help="instead: a folder with a config.json (random init)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "fp16"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt-length", type=int, default=64, help="random prompts' length")
    parser.add_argument("--temperature", type=float, default=0.7, help="smol_arith's")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output", help="also write the metrics as JSON here")
    opts = parser.parse_args(argv)
    for precision in opts.precisions:
        if precision not in logprobs.PRECISIONS[1:]:
            parser.error(f"--precisions: {precision!r} is not one of fp32, bf16, fp16")
    return opts


def main(argv=None):
    opts = parse(argv)
    results, name = run(opts)
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump({"model": name, "settings": vars(opts), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
