"""The GPU measurements in one command (issue 20), each next to its baseline run in the same
process; the table is appended to bench/RESULTS.md with the machine and the versions.

    python bench/bench_gpu.py              # one CUDA GPU: the real sizes below, < 10 min on an H100
    python bench/bench_gpu.py --no-write   # print the table only
    python bench/bench_gpu.py --tiny       # tiny sizes (what a CPU always runs: a few seconds; CI runs it)

Sizes: random-init models from the published configs (tests/model_configs, no weights),
Qwen2.5-0.5B-Instruct at micro-batch 16 and Qwen2.5-1.5B-Instruct at micro-batch 8, 512 prompt +
1024 response tokens, gradient checkpointing as the gsm8k presets. Rows:
  update      one training micro-batch, forward + backward, of grpo.compute_logprobs (the chunked logprob head: TF32
              under bf16 autocast on CUDA), of the same with the IEEE fp32 head (corrections.LM_HEAD_TF32 = False:
              the head's precision before issue 20), and of the plain-loss baseline: HF's causal-LM loss
              (labels=input_ids, bf16 logits) under the same bf16 autocast on the same tokens. Seconds (median of 3
              after a warm-up), tokens/s, MFU = (6 x parameters + PaLM's 12 x layers x attention width x sequence)
              x tokens / seconds / 989 TFLOP/s (H100 SXM dense bf16), peak memory above the weights, and each as a
              multiple of the plain loss's.
  rollout     HF generate (rollout.HFBackend) tokens/s: 64 prompts of 512 tokens, 256 new tokens, bf16 autocast.
  grpo vs TRL the GRPO step of bench/bench_smollm2.py (SmolLM2-135M-Instruct) against TRL's GRPOTrainer on the
              same work, when trl is importable (GPU only).
  ppo update  ppo_rlhf.train's gpt2_sentiment setting (512 rollouts of 64 + 24 tokens, 4 epochs) on a random-init gpt2
              with an untrained gpt2 reward model, the character tokenizer and local random queries: seconds per
              update (after the first) per micro-batch size, the hours 1M episodes (1953 updates) take, peak memory.
On a CPU every row runs at tiny sizes and says so: the numbers show that the command works, not GPU
speed.
"""

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import plan_memory  # noqa: E402  (scripts/plan_memory.py: the published configs, offline)

import corrections  # noqa: E402
import grpo  # noqa: E402
import ppo_rlhf  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402

PEAK_FLOPS = 989e12  # H100 SXM, dense bf16 (NVIDIA's datasheet; 1979 is with 2:4 sparsity)
GIB = 2**30
ROWS = []  # (row, setting, seconds, tokens/s or "-", MFU, peak GiB, vs baseline)


def row(*cells):
    ROWS.append(tuple(str(c) for c in cells))
    print("  " + " | ".join(ROWS[-1]), flush=True)


def sizes(tiny):
    """[(name, config, micro-batch, prompt, response)] of the update rows."""
    from transformers import Qwen2Config

    if tiny:
        config = Qwen2Config(
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        )
        return [("tiny qwen2", config, 4, 32, 64)]
    return [
        (name, plan_memory.read_config(name), micro, 512, 1024)
        for name, micro in (("Qwen/Qwen2.5-0.5B-Instruct", 16), ("Qwen/Qwen2.5-1.5B-Instruct", 8))
    ]


def random_batch(vocab, micro, prompt, response, device):
    """The tensors grpo.compute_logprobs reads, every token valid (fixed lengths, no padding)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab - 1, (micro, prompt + response), generator=g).to(device)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(prompt + response, device=device).expand(micro, -1),
        "responses": ids[:, prompt:],
        "response_mask": torch.ones(micro, response, device=device),
    }


def measure(fn, device, repeats=3):
    """(median seconds of `repeats` runs after one warm-up, peak bytes allocated above the start; 0
    on CPU)."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, peak = [], 0
    for _ in range(repeats):
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated() - start)
    return statistics.median(times), peak


def update_rows(name, config, micro, prompt, response, device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()
    model.gradient_checkpointing_enable()  # the gsm8k presets' setting, for every row alike
    model.config.use_cache = False
    batch = random_batch(config.vocab_size, micro, prompt, response, device)
    tokens = micro * (prompt + response)
    # a tied LM head once: its product is counted in 6 x n
    n = sum(p.numel() for p in model.parameters())
    attention_width = config.num_attention_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    flops = tokens * (6 * n + 12 * config.num_hidden_layers * attention_width * (prompt + response))

    def ours():
        logprobs, _ = grpo.compute_logprobs(model, batch, 1.0)  # bf16 autocast on CUDA inside
        (-logprobs.mean()).backward()
        model.zero_grad(set_to_none=True)

    def fp32_head():
        corrections.LM_HEAD_TF32 = False
        try:
            ours()
        finally:
            corrections.LM_HEAD_TF32 = True

    def plain_loss():
        with rollout.autocast_context(device):
            loss = model(
                input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False
            ).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    results = {
        label: measure(fn, device)
        for label, fn in (
            ("plain HF loss", plain_loss),
            ("ours (TF32 head on CUDA)", ours),
            ("ours, IEEE fp32 head", fp32_head),
        )
    }
    base_s, base_peak = results["plain HF loss"]
    for label, (seconds, peak) in results.items():
        mfu = f"{flops / seconds / PEAK_FLOPS:.1%}" if device.type == "cuda" else "-"
        vs = (
            f"{base_s / seconds:.2f}x tokens/s, {peak / base_peak:.2f}x memory"
            if base_peak
            else f"{base_s / seconds:.2f}x tokens/s"
        )
        row(
            "update",
            f"{name}, {micro} x ({prompt} + {response}), {label}",
            f"{seconds:.3f}",
            f"{tokens / seconds:,.0f}",
            mfu,
            f"{peak / GIB:.2f}" if peak else "-",
            vs,
        )
    return model


def rollout_row(name, model, prompt, device, tiny):
    rows, new = (4, 16) if tiny else (64, 256)
    # no EOS: every row samples `new`
    backend = rollout.HFBackend(model.eval(), eos_token_id=None, pad_token_id=0)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, model.config.vocab_size - 1, (rows, prompt), generator=g).tolist()
    seconds, peak = measure(
        lambda: backend.generate(prompts, 1, new, 1.0, seed=0), device, repeats=1
    )
    row(
        "rollout",
        f"{name}, HF generate, {rows} x ({prompt} + {new} new)",
        f"{seconds:.2f}",
        f"{rows * new / seconds:,.0f}",
        "-",
        f"{peak / GIB:.2f}" if peak else "-",
        "-",
    )


def trl_rows(device, tiny):
    if importlib.util.find_spec("trl") is None:
        return row("grpo vs TRL", "skipped: trl is not importable", "-", "-", "-", "-", "-")
    if device.type != "cuda" or tiny:
        return row(
            "grpo vs TRL",
            "skipped: GPU sizes only (bench/bench_smollm2.py runs it on CPU)",
            "-",
            "-",
            "-",
            "-",
            "-",
        )
    if tasks.smollm2_problem(tasks.SMOLLM2_PATH):
        return row(
            "grpo vs TRL", tasks.smollm2_problem(tasks.SMOLLM2_PATH), "-", "-", "-", "-", "-"
        )
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_smollm2

    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "TRL GRPOTrainer": bench_smollm2.trl(3, tmp),
            "grpo.py --backend hf": bench_smollm2.ours("hf", 3, tmp),
        }
    base = results["TRL GRPOTrainer"]["step_s"]
    for label, r in results.items():
        row(
            "grpo vs TRL",
            f"SmolLM2-135M, {bench_smollm2.PROMPTS} x {bench_smollm2.N} x <= {bench_smollm2.MAX_NEW} "
            f"new, {label}",
            f"{r['step_s']:.2f}",
            f"{r['tokens_per_s']:,.0f} (rollout)",
            "-",
            "-",
            f"{base / r['step_s']:.2f}x TRL's speed",
        )


def ppo_rows(device, tiny):
    """ppo_rlhf's gpt2_sentiment update (or a tiny one) per micro-batch size: seconds per update
    after the first."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        policy_dir, rm_dir, queries = (
            os.path.join(tmp, n) for n in ("policy", "rm", "queries.jsonl")
        )
        # the character tokenizer: offline, "." is one token
        tokenizer = tasks.build_tiny_tokenizer(policy_dir)
        if tiny:
            config = tasks.build_tiny_model(None, arch="gpt2")[0].config
        else:
            config = plan_memory.read_config("gpt2")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(policy_dir)
        rewards.save_reward_model(
            rewards.RewardModel(AutoModelForCausalLM.from_config(config)), rm_dir, tokenizer
        )
        rng = random.Random(0)
        with open(queries, "w") as f:
            for _ in range(4096):
                f.write(
                    json.dumps(
                        {
                            "text": " ".join(
                                rng.choice(
                                    [
                                        "the",
                                        "a",
                                        "day",
                                        "was",
                                        "long",
                                        "and",
                                        "we",
                                        "went",
                                        "home",
                                        ".",
                                    ]
                                )
                                for _ in range(40)
                            )
                        }
                    )
                    + "\n"
                )
        rollouts, micros = (16, (8, 16)) if tiny else (512, (64, 128, 256, 512))
        for micro in micros:
            args = dataclasses.replace(
                ppo_rlhf.PRESETS["gpt2_sentiment"][1],
                base_model=policy_dir,
                reward_model_path=rm_dir,
                query_dataset=queries,
                rollout_batch_size=rollouts,
                total_episodes=3 * rollouts,
                local_micro_batch_size=micro,
                whiten_group_size=min(64, rollouts),
                save_every=0,
                output_dir=os.path.join(tmp, f"ppo_{micro}"),
                log_samples_every=0,
                cuda=device.type == "cuda",
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                ppo_rlhf.train(args)
            except torch.OutOfMemoryError:
                row(
                    "ppo update",
                    f"{'tiny gpt2' if tiny else 'gpt2'}, micro-batch {micro}",
                    "out of memory",
                    "-",
                    "-",
                    "-",
                    "-",
                )
                continue
            with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
                elapsed = [json.loads(line)["time/elapsed_s"] for line in f]
            seconds = (elapsed[-1] - elapsed[0]) / (len(elapsed) - 1)  # the updates after the first
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
            row(
                "ppo update",
                f"{'tiny gpt2' if tiny else 'gpt2'}, {rollouts} rollouts, micro-batch {micro}",
                f"{seconds:.2f}",
                f"{rollouts / seconds:,.0f} episodes/s",
                "-",
                f"{peak / GIB:.2f}" if peak else "-",
                f"1M episodes: {1_000_000 // rollouts * seconds / 3600:.2f} h",
            )


def versions():
    out = [f"torch {torch.__version__}"]
    for package in ("transformers", "vllm", "trl"):
        try:
            out.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tiny sizes (always on a CPU): a few seconds"
    )
    parser.add_argument(
        "--no-write", action="store_true", help="do not append the table to bench/RESULTS.md"
    )
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = opts.tiny or device.type == "cpu"
    machine = (
        torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    )
    print(
        f"bench_gpu: {machine}; {versions()}" + ("; tiny sizes (not GPU numbers)" if tiny else ""),
        flush=True,
    )
    t0 = time.time()
    for name, config, micro, prompt, response in sizes(tiny):
        model = update_rows(name, config, micro, prompt, response, device)
        rollout_row(name, model, prompt, device, tiny)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    trl_rows(device, tiny)
    ppo_rows(device, tiny)
    header = ("row", "setting", "seconds", "tokens/s", "MFU", "peak GiB", "vs baseline")
    lines = [
        f"## bench/bench_gpu.py on {machine}" + (" (tiny sizes: not GPU numbers)" if tiny else ""),
        "",
        f"`python bench/bench_gpu.py{' --tiny' if opts.tiny else ''}` ({versions()}; "
        f"{time.time() - t0:.0f} s). update: one micro-batch forward + backward; vs baseline: "
        "tokens/s and peak memory as multiples of the "
        "plain HF loss's in the same process.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in ROWS]
    text = "\n".join(lines) + "\n"
    print("\nbench_gpu table\n" + text)
    if not opts.no_write:
        with open(os.path.join(ROOT, "bench", "RESULTS.md"), "a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
