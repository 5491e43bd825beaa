"""The GPU measurements in one command (issue 20), each next to its baseline run in the same
process; the table is appended to bench/RESULTS.md with the machine and the versions.

    python bench/bench_gpu.py              # one CUDA GPU: the real sizes below, < 10 min on an H100
    python bench/bench_gpu.py --no-write   # print the table only
    python bench/bench_gpu.py --tiny       # tiny sizes (what a CPU always runs: a few seconds; CI runs it)
    python bench/bench_gpu.py --update-only --no-write   # the update rows alone (132 s on an H200,
                                                         # the compiles of the compiled rows included)

Sizes: random-init models from the published configs (tests/model_configs, no weights),
Qwen2.5-0.5B-Instruct at micro-batch 16 and Qwen2.5-1.5B-Instruct at micro-batch 8, 512 prompt +
1024 response tokens. Rows:
  update      one training micro-batch, forward + backward, of the plain-loss baseline (HF's causal-LM loss,
              labels=input_ids, bf16 logits, under bf16 autocast, every layer recomputed as the gsm8k presets did)
              and of logprobs.response_logprobs on the same tokens: the chunked logprob head with its gradient written out
              (logprobs._ChunkedHead, compiled element-wise kernels on CUDA) with --lm-head-precision auto (TF32),
              fp32 (IEEE) and bf16 (bf16 inputs, float32 logits), with eager element-wise kernels, and with fewer
              layers recomputed: as many as keep the peak within one third of the plain loss's (the plan's
              activation estimate, memory.activation_bytes, over the measured rest), and the number grpo.py
              chooses for the preset on this GPU (memory.plan_grpo); the plain loss again (the spread of one
              setting within the call); then with the decoder layers compiled
              (grpo.py --compile-layers, memory.compile_decoder_layers): the plain loss (a peer row: what
              compiling alone buys), ours with the TF32 and bf16 heads, and bf16 at a third of the plain peak.
              Seconds (median of 3 after a warm-up),
              tokens/s, MFU = (6 x parameters + PaLM's 12 x layers x attention width x sequence) x tokens / seconds
              / 989 TFLOP/s (H100 SXM dense bf16), peak memory above the weights, and each as a multiple of the
              plain loss's.
  lora update one micro-batch (forward, backward, AdamW step) of a random-init Qwen2.5-7B with a frozen bf16 base and a
              rank-32 adapter (grpo.py gsm8k_qwen25_7b_lora), next to full fine-tuning of Qwen2.5-1.5B on the same
              16 x 1536 tokens, every layer recomputed: seconds, absolute peak, and the plan's train phase.
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

import logprobs  # noqa: E402
import lora  # noqa: E402
import memory  # noqa: E402
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
    """[(name, config, micro-batch, prompt, response, the preset of that model)] of the update
    rows."""
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
        return [("tiny qwen2", config, 4, 32, 64, "tiny")]
    return [
        (name, plan_memory.read_config(name), micro, 512, 1024, preset)
        for name, micro, preset in (
            ("Qwen/Qwen2.5-0.5B-Instruct", 16, "gsm8k_qwen05b"),
            ("Qwen/Qwen2.5-1.5B-Instruct", 8, "gsm8k_qwen15b"),
        )
    ]


def random_batch(vocab, micro, prompt, response, device):
    """The tensors logprobs.response_logprobs reads, every token valid (fixed lengths, no padding)."""
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


def update_rows(name, config, micro, prompt, response, device, preset):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import GradientCheckpointingLayer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()
    model.gradient_checkpointing_enable()  # every layer, for the rows that say so
    model.config.use_cache = False
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    batch = random_batch(config.vocab_size, micro, prompt, response, device)
    tokens = micro * (prompt + response)
    # a tied LM head once: its product is counted in 6 x n
    n = sum(p.numel() for p in model.parameters())
    attention_width = config.num_attention_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    flops = tokens * (6 * n + 12 * config.num_hidden_layers * attention_width * (prompt + response))

    def recompute(k):
        # what memory.recompute_layers does: the first k layers recompute, the others keep
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i < k

    def ours(head="auto", k=len(layers), chunk=512, compiled=True):
        recompute(k)
        logprobs.COMPILE_ON_CUDA = compiled
        try:
            # bf16 autocast on CUDA inside
            lp, _ = logprobs.response_logprobs(
                model,
                batch,
                logprobs.LogprobSettings(temperature=1.0, chunk_size=chunk, head_precision=head),
            )
            (-lp.mean()).backward()
        finally:
            logprobs.COMPILE_ON_CUDA = True
        model.zero_grad(set_to_none=True)

    def plain_loss():
        recompute(len(layers))
        with logprobs.autocast_context(device):
            loss = model(
                input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False
            ).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    L = len(layers)
    results = {
        "plain HF loss": measure(plain_loss, device),
        f"ours, {L} of {L} layers recomputed, TF32 head (auto)": measure(ours, device),
    }
    base_s, base_peak = results["plain HF loss"]
    # the layers to recompute for one third of the plain loss's peak: the memory plan's estimate
    # of the activations (memory.activation_bytes), the rest of the peak as measured with every
    # layer recomputed
    shape = memory.model_shape(config)
    measured_rest = results[f"ours, {L} of {L} layers recomputed, TF32 head (auto)"][1] - (
        memory.activation_bytes(shape, tokens, L, 512)
    )
    third = memory.layers_to_recompute(shape, tokens, 512, base_peak / 3 - measured_rest)
    # what grpo.py chooses by itself for the preset's micro-batch on this GPU (PLAN_FILL)
    preset_args = plan_memory.preset_args("grpo", preset)
    gpu_bytes = memory.gpu_memory_bytes() if device.type == "cuda" else None
    chosen = memory.plan_grpo(preset_args, config, 1, gpu_bytes)["recompute_num_layers"][0]
    variants = [
        (f"ours, {L} of {L}, IEEE fp32 head", dict(head="fp32")),
        (f"ours, {L} of {L}, bf16-input head", dict(head="bf16")),
        (f"ours, {L} of {L}, TF32 head, eager element-wise", dict(compiled=False)),
        (f"ours, {third} of {L} (1/3 of the plain peak), TF32 head", dict(k=third)),
        (
            f"ours, {third} of {L} (1/3 of the plain peak), bf16-input head",
            dict(head="bf16", k=third),
        ),
        (f"ours, {chosen} of {L} (grpo.py's plan for {preset}, this GPU), TF32", dict(k=chosen)),
        # the first row's setting again: a difference between rows smaller than this row's from
        # 1.00x is noise
        ("plain HF loss, again", plain_loss),
    ]
    # then with every decoder layer compiled (grpo.py --compile-layers); the plain loss with
    # compiled layers is a peer row: what compiling alone buys
    compiled = [
        ("plain HF loss, compiled layers", plain_loss),
        (f"ours, {L} of {L}, TF32 head, compiled layers", dict()),
        (f"ours, {L} of {L}, bf16-input head, compiled layers", dict(head="bf16")),
        (
            f"ours, {third} of {L} (1/3 of the plain peak), bf16-input head, compiled layers",
            dict(head="bf16", k=third),
        ),
    ]

    def measure_rows(rows):
        for label, settings in rows:
            try:
                if callable(settings):
                    results[label] = measure(settings, device)
                else:
                    results[label] = measure(lambda: ours(**settings), device)
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                row(
                    "update",
                    f"{name}, {micro} x ({prompt} + {response}), {label}",
                    "out of memory",
                    "-",
                    "-",
                    "-",
                    "-",
                )

    measure_rows(variants)
    memory.compile_decoder_layers(model)
    measure_rows(compiled)
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
    recompute(L)
    return model


def lora_rows(device, tiny):
    """The LoRA update (grpo.py gsm8k_qwen25_7b_lora, issue 63): one micro-batch forward + backward
    + AdamW step of a random-init Qwen2.5-7B-Instruct with a frozen bf16 base and a rank-32
    adapter on every linear layer (16 x (512 + 1024) tokens, every layer recomputed, eager
    layers), against the same update with full fine-tuning of Qwen2.5-1.5B-Instruct (fp32
    masters, AdamW over every weight). Peak memory is absolute (weights included) and stands next
    to the train phase memory.plan_grpo plans for the preset (without vLLM's share, asleep while
    the trainer runs)."""
    micro, prompt, response = (4, 32, 64) if tiny else (16, 512, 1024)
    if tiny:
        config_7b = config_15b = sizes(tiny)[0][1]
    else:
        config_7b = plan_memory.read_config("Qwen/Qwen2.5-7B-Instruct")
        config_15b = plan_memory.read_config("Qwen/Qwen2.5-1.5B-Instruct")
    preset = plan_memory.preset_args("grpo", "gsm8k_qwen25_7b_lora")
    rank = 4 if tiny else preset.lora_rank
    shape = (micro, prompt, response)
    full_label = "full fine-tuning, Qwen2.5-1.5B-Instruct size"
    full = lora_update_row(full_label, config_15b, 0, preset, shape, device, None)
    label = f"LoRA r = {rank}, bf16 base, Qwen2.5-7B-Instruct size"
    plan = None
    if not tiny:
        train = memory.plan_grpo(preset, config_7b, 1, None)["phases"]["train"]
        plan = sum(v for k, v in train.items() if "vLLM" not in k)
    lora_update_row(label, config_7b, rank, preset, shape, device, full, plan)


def lora_update_row(label, config, rank, preset, shape, device, baseline_seconds, plan=None):
    """One row of lora_rows: the update's median seconds (returned) and absolute peak memory."""
    from transformers import AutoModelForCausalLM

    micro, prompt, response = shape
    if device.type == "cuda":
        torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if rank:
        model = lora.add_adapter(model, rank, preset.lora_alpha, "all-linear")
        logprobs.bf16_frozen_linears_(model)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    batch = random_batch(config.vocab_size, micro, prompt, response, device)
    # bf16 autocast (grpo.py's on CUDA; on a CPU too here: the bf16 base needs it)
    settings = logprobs.LogprobSettings(temperature=1.0, chunk_size=512, precision="bf16")

    def update():
        lp, _ = logprobs.response_logprobs(model, batch, settings)
        (-lp.mean()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    setting = f"{label}, {micro} x ({prompt} + {response})"
    try:
        update()  # the warm-up allocates AdamW's state: resident from here on
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds, _ = measure(update, device)
    except torch.OutOfMemoryError:
        row("lora update", setting, "out of memory", "-", "-", "-", "-")
        return None
    peak = torch.cuda.max_memory_allocated() - start if device.type == "cuda" else 0
    versus = "1.00x (the baseline)"
    if baseline_seconds:
        versus = f"{baseline_seconds / seconds:.2f}x the full 1.5B update's tokens/s"
    if plan:
        versus += f"; the plan's train phase {plan / GIB:.2f} GiB"
    row(
        "lora update",
        setting,
        f"{seconds:.3f}",
        f"{micro * (prompt + response) / seconds:,.0f}",
        "-",
        f"{peak / GIB:.2f}" if peak else "-",
        versus,
    )
    return seconds


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
    parser.add_argument(
        "--update-only", action="store_true", help="only the update rows (~1 min on a GPU)"
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
    for name, config, micro, prompt, response, preset in sizes(tiny):
        model = update_rows(name, config, micro, prompt, response, device, preset)
        if not opts.update_only:
            rollout_row(name, model, prompt, device, tiny)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lora_rows(device, tiny)
    if not opts.update_only:
        trl_rows(device, tiny)
        ppo_rows(device, tiny)
    header = ("row", "setting", "seconds", "tokens/s", "MFU", "peak GiB", "vs baseline")
    lines = [
        f"## bench/bench_gpu.py on {machine}" + (" (tiny sizes: not GPU numbers)" if tiny else ""),
        "",
        f"`python bench/bench_gpu.py{' --tiny' if opts.tiny else ''}"
        f"{' --update-only' if opts.update_only else ''}` ({versions()}; "
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
