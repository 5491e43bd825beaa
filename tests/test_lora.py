"""LoRA (lora.py, grpo.py --lora-rank): the gradient identity at peft's initialisation, a weight
sync that never writes the base (and the in-place merge cycle that would), the reference policy as
the disabled adapter, the files (peft's adapter, the merged HF model), a SIGKILLed run that resumes
exactly, LoRA under FSDP2 at 2 ranks equal to unsharded LoRA, the memory plan of a 7B policy on one
GPU, tiny_lora's pretrained base, and the refusals. The vLLM engine's logprobs after a merged
sync: tests/test_vllm_backend.py. Budget: ~90 s."""

import copy
import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpo  # noqa: E402
import harness  # noqa: E402
import logprobs  # noqa: E402
import lora  # noqa: E402
import memory  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
from tolerances import EPS32  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
# grpo.py tiny with LoRA, small: 8 prompts x 8 samples per step, two optimizer steps of 4 prompts
LORA_SMALL = ["--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2", "--val-every", "0"]
LORA_SMALL += ["--train-batch-size", "8", "--ppo-mini-batch-size", "4", "--rollout-n", "8"]
LORA_SMALL += ["--train-size", "64", "--log-samples-every", "0"]


def adapted_tiny(arch, seed=0, rank=4, alpha=8.0):
    """(the tiny model, a copy with LoRA added, its tokenizer)."""
    model, tokenizer = tasks.build_tiny_model(arch=arch, seed=seed)
    return model, lora.add_adapter(copy.deepcopy(model), rank, alpha, "all-linear"), tokenizer


def randomise_b(model, scale=0.05, seed=0):
    """Give every B a random value (peft starts it at 0), so that the adapter changes the model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.adapter_layers(model).values():
            b = layer.lora_B[lora.ADAPTER].weight
            b.copy_(torch.randn(b.shape, generator=generator) * scale)


def sequence_loss(model, ids):
    """The mean log-likelihood of ids[:, 1:] (any differentiable function of the logits would do)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_the_first_backward_gives_dl_da_zero_and_dl_db_s_g_a_transposed(arch):
    """At peft's initialisation (B = 0) one backward gives dL/dA = 0 exactly and dL/dB = (alpha /
    r) G A^T, G being the full model's gradient of that layer's weight (gpt2's Conv1D stores W
    transposed: G^T), in every adapted layer within 64 eps32 of its norm (7.6e-6: the same
    products re-associated, sums of up to 512 terms; measured 3.1e-7 and 4.3e-7)."""
    full, adapted, _ = adapted_tiny(arch, seed=3)
    ids = torch.randint(
        0, full.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1)
    )
    sequence_loss(full, ids).backward()
    sequence_loss(adapted, ids).backward()
    layers = lora.adapter_layers(adapted)
    assert len(layers) == 2 * (4 if arch == "gpt2" else 7)  # every linear layer of 2 decoder layers
    worst = 0.0
    for name, layer in layers.items():
        g = full.get_submodule(name).weight.grad
        g = g.T if layer.fan_in_fan_out else g  # (out, in)
        a, b = layer.lora_A[lora.ADAPTER].weight, layer.lora_B[lora.ADAPTER].weight
        assert torch.equal(a.grad, torch.zeros_like(a))
        expected = layer.scaling[lora.ADAPTER] * g @ a.detach().T
        worst = max(worst, ((b.grad - expected).norm() / expected.norm()).item())
    print(f"{arch}: largest relative difference of dL/dB from s G A^T: {worst:.1e}")
    assert worst <= 64 * EPS32
    # only the adapter is trained
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)


def test_a_hundred_merged_syncs_leave_the_base_bitwise_unchanged_and_in_place_cycles_do_not():
    """A bf16 base (as under bf16 autocast) with a trained adapter: 100 syncs of each engine's
    kind (vLLM's named weights, HF's own copy rounded to bf16) leave every trainer weight bitwise
    as it was, and the copy computes what the merged model does. Merging into the base in place
    and unmerging after (peft's merge / unmerge, as TRL's sync does) changes it."""
    _, model, tokenizer = adapted_tiny("qwen2", seed=2)
    logprobs.bf16_frozen_linears_(model)
    # the frozen base's linears in bf16, the adapter's float32 masters kept
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert all(dtypes[n] == torch.bfloat16 for n in dtypes if ".base_layer.weight" in n)
    assert all(dtypes[n] == torch.float32 for n in dtypes if ".lora_" in n)
    randomise_b(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = rollout.HFBackend(model, tokenizer.eos_token_id, tokenizer.pad_token_id, "bf16")
    assert not lora.has_adapter(engine.model)  # the engine's copy is the plain HF model
    adapted = {f"{name}.weight" for name in lora.adapter_layers(model)}
    for _ in range(100):
        engine.sync_weights(model)
        for name, tensor in rollout._trainer_named_weights(model):
            if name in adapted:  # merged in float32; the engine casts it
                assert tensor.dtype == torch.float32
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    # the engine's copy holds the merged weights rounded to bf16
    merged = dict(lora.merged_named_weights(model))
    copy_params = dict(engine.model.named_parameters())
    assert set(copy_params) == set(merged)
    for name, tensor in merged.items():
        assert torch.equal(copy_params[name], tensor.to(torch.bfloat16).float()), name
    # the in-place cycle, 100 times
    layers = lora.adapter_layers(model).values()
    for _ in range(100):
        for layer in layers:
            layer.merge()
            layer.unmerge()
    base_names = [n for n in before if ".base_layer.weight" in n]
    changed = sum((dict(model.named_parameters())[n] != before[n]).sum().item() for n in base_names)
    total = sum(before[n].numel() for n in base_names)
    print(f"100 in-place merge/unmerge cycles changed {changed} of {total} base entries")
    assert changed > 0


def test_tiny_lora_s_base_reverses_and_shifts_words_and_does_not_copy_them(tmp_path):
    """grpo.py tiny_lora's policy folder holds the tiny model after tasks.pretrain_tiny_model's 300
    steps: asked greedily for each of the 64 three-letter words, it answers the reversed or the
    shifted word for most of them (55 of 64 measured at seed 1) and the copy for few (4: the
    palindromes it reverses), so the copy is left for RL to teach; the folder's mark records the
    pretraining, and a random-init build is not reused for it."""
    args = dataclasses.replace(
        grpo.PRESETS["tiny_lora"][1], cuda=False, seed=1, output_dir=str(tmp_path)
    )
    # built on one thread, as the preset's runs build it (--torch-threads 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    plain = grpo.policy_path(dataclasses.replace(args, tiny_pretrain_steps=0), 0, 1)
    assert "pretrain_steps" not in harness.built_with(plain)
    model_path = grpo.policy_path(args, 0, 1)
    torch.set_num_threads(threads)
    assert harness.built_with(model_path)["pretrain_steps"] == 300
    model = AutoModelForCausalLM.from_pretrained(model_path)
    tokenizer = tasks.build_tiny_tokenizer()
    words = ["".join(letters) for letters in itertools.product(tasks.COPY_ALPHABET, repeat=3)]
    prompts = torch.tensor([tokenizer.encode(w + "=", add_special_tokens=False) for w in words])
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    answers = [tokenizer.decode(row[4:], skip_special_tokens=True) for row in out]
    shift = tasks.TINY_PRETRAIN_MAPS["shift"]
    learned = sum(a in (w[::-1], shift(w)) for a, w in zip(answers, words))
    copied = sum(a == w for a, w in zip(answers, words))
    print(f"pretrained tiny base: {learned} of 64 reversed or shifted, {copied} copied")
    assert learned >= 48 and copied <= 8


def test_the_reference_is_the_base_with_the_adapter_off_and_no_second_model(tmp_path):
    """With --kl-loss-coef > 0 and --lora-rank, load_models builds no reference model, and
    grpo.reference_logprobs (the policy with its adapter switched off) equals the base model's
    logprobs exactly while the adapted policy's differ; the adapter is on again afterwards."""
    args = dataclasses.replace(
        grpo.PRESETS["tiny_lora"][1],
        cuda=False,
        kl_loss_coef=0.01,
        output_dir=str(tmp_path),
        tiny_pretrain_steps=5,  # a base that is not the random init; 5 steps suffice for that
    )
    model_path = grpo.policy_path(args, 0, 1)
    tokenizer, model, ref_model, optimizer, _, _, _ = grpo.load_models(
        args, model_path, None, torch.device("cpu"), 0, 1
    )
    assert ref_model is None
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(trained) == 2 * len(lora.adapter_layers(model))
    randomise_b(model)
    base = AutoModelForCausalLM.from_pretrained(model_path)
    prompts = [tokenizer("abc=")["input_ids"], tokenizer("dab=")["input_ids"]]
    responses = [tokenizer("abc")["input_ids"], tokenizer("dd")["input_ids"]]
    batch = rollout.make_batch(prompts, responses, [[0.0] * 3, [0.0] * 2], 0, 4, "cpu")
    log_pi = grpo.logprob_settings(args, model)
    reference = grpo.reference_logprobs(model, None, batch, args, log_pi)
    of_base = grpo.batch_logprobs(base, batch, args, log_pi)["logprobs"]
    of_policy = grpo.batch_logprobs(model, batch, args, log_pi)["logprobs"]
    assert torch.equal(reference, of_base)
    assert (of_policy - of_base).abs().max() > 1e-3


def run_grpo(out, *extra, steps=3):
    """grpo.py tiny with LoRA, small, as a user starts it; returns the output folder."""
    argv = [str(ROOT / "grpo.py"), "tiny", "--output-dir", str(out), "--total-steps", str(steps)]
    done = subprocess.run(
        [sys.executable, *argv, *LORA_SMALL, *extra],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def rows(out):
    with open(out / "metrics.jsonl") as f:
        return [
            {k: v for k, v in json.loads(line).items() if not k.startswith(("timing/", "time/"))}
            for line in f
        ]


def adapter(folder):
    from safetensors.torch import load_file

    return load_file(folder / lora.ADAPTER_FILE)


def kill_after_two_rows(command, metrics, timeout=300):
    """Start `command`, SIGKILL it once `metrics` (its metrics.jsonl) holds two rows; returns how
    many rows it held then."""
    process = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while time.time() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return len(metrics.read_text().splitlines())


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """grpo.py tiny --lora-rank 4, 3 steps, saving every step."""
    return run_grpo(tmp_path_factory.mktemp("lora") / "run", "--save-every", "1")


def test_the_run_writes_the_adapter_in_peft_format_and_the_merged_model(lora_run):
    """The checkpoint holds the adapter alone (no base weights), which peft.PeftModel loads onto
    the base; <output_dir>/merged_model is an HF model; both compute the same logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    checkpoint = lora_run / "checkpoint"
    assert not (checkpoint / "model.safetensors").exists()
    assert lora.adapter_settings(checkpoint) == (4, 8.0)
    base = AutoModelForCausalLM.from_pretrained(lora_run / "tiny_model")
    base_logits_ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    base_logits = base(input_ids=base_logits_ids).logits
    with_adapter = PeftModel.from_pretrained(base, checkpoint)
    merged = AutoModelForCausalLM.from_pretrained(lora_run / "merged_model")
    logits_adapter = with_adapter(input_ids=base_logits_ids).logits
    logits_merged = merged(input_ids=base_logits_ids).logits
    assert (logits_adapter - logits_merged).abs().max() < 1e-5
    assert (logits_adapter - base_logits).abs().max() > 1e-4  # the adapter was trained


def test_a_lora_run_killed_with_sigkill_resumes_exactly(lora_run, tmp_path):
    """The same run, its process killed with SIGKILL after step 2's row, then rerun: every logged
    number and the adapter equal the uninterrupted run's."""
    out = tmp_path / "killed"
    argv = [str(ROOT / "grpo.py"), "tiny", "--output-dir", str(out), "--total-steps", "3"]
    argv += [*LORA_SMALL, "--save-every", "1"]
    logged = kill_after_two_rows([sys.executable, *argv], out / "metrics.jsonl")
    assert logged < 3  # killed before the last step
    run_grpo(out, "--save-every", "1")
    assert rows(out) == rows(lora_run)
    ours, theirs = adapter(out / "checkpoint"), adapter(lora_run / "checkpoint")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_lora_under_fsdp2_equals_unsharded_lora_at_two_ranks(tmp_path):
    """2 processes, 3 steps with a KL loss, one micro-batch per rank per optimizer step and no
    clipping (FSDP2 then reduces in DDP's order, docs/sharding.md): the adapters and the merged
    models end equal bit for bit; the logged numbers within sharding's bound (1e-5 over max(1,
    size)): the rollout_corr diagnostics, differences of float32 logprobs, differ in their last
    bits."""
    runs = {}
    for sharding in ("ddp", "fsdp2"):
        out = tmp_path / sharding
        argv = ["tiny", "--output-dir", str(out), "--total-steps", "3", *LORA_SMALL]
        argv += ["--sharding", sharding, "--ppo-micro-batch-size-per-gpu", "16"]
        # with a KL loss: pi_ref is the sharded policy with its adapter switched off
        argv += ["--max-grad-norm", "1e9", "--kl-loss-coef", "0.01"]
        cmd = [*TORCHRUN, "2", str(ROOT / "grpo.py"), *argv]
        done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        runs[sharding] = out
    ddp, fsdp2 = adapter(runs["ddp"] / "checkpoint"), adapter(runs["fsdp2"] / "checkpoint")
    assert sorted(ddp) == sorted(fsdp2) and all(torch.equal(ddp[k], fsdp2[k]) for k in ddp)
    worst = 0.0
    for row_ddp, row_fsdp2 in zip(rows(runs["ddp"]), rows(runs["fsdp2"]), strict=True):
        assert sorted(row_ddp) == sorted(row_fsdp2)
        for name, value in row_ddp.items():
            scale = max(abs(value), abs(row_fsdp2[name]), 1.0)
            worst = max(worst, abs(value - row_fsdp2[name]) / scale)
    print(f"largest difference of a logged number over max(1, its size): {worst:.1e}")
    assert worst <= 1e-5
    merged_ddp = lora.adapter_settings(runs["ddp"] / "checkpoint")
    assert merged_ddp == (4, 8.0)
    from safetensors.torch import load_file

    whole_ddp = load_file(runs["ddp"] / "merged_model" / "model.safetensors")
    whole_fsdp2 = load_file(runs["fsdp2"] / "merged_model" / "model.safetensors")
    assert all(torch.equal(whole_ddp[k], whole_fsdp2[k]) for k in whole_ddp)


def test_the_plan_fits_a_7b_lora_policy_on_one_80_gib_gpu_and_counts_the_adapter():
    """plan_grpo for the gsm8k_qwen25_7b_lora preset on one GPU of 80 GiB fits; the same preset
    without LoRA does not (fp32 weights, gradients and AdamW alone are 16 bytes per parameter);
    the adapter's count is the model's own."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ROOT / "tests" / "model_configs" / "Qwen2.5-7B-Instruct")
    args = grpo.PRESETS["gsm8k_qwen25_7b_lora"][1]
    plan = memory.plan_grpo(args, config, 1, 80 * memory.GIB)
    assert plan["fits"], plan["totals"]
    full = memory.plan_grpo(dataclasses.replace(args, lora_rank=0), config, 1, 80 * memory.GIB)
    assert not full["fits"]
    model, _ = tasks.build_tiny_model(arch="qwen2")
    counted = memory.count_adapter_parameters(model.config, 8, 16.0, "all-linear")
    adapted = lora.add_adapter(model, 8, 16.0, "all-linear")
    assert counted == sum(p.numel() for p in adapted.parameters() if p.requires_grad)


def test_an_adapted_lm_head_scores_tokens_as_the_model_s_own_forward_and_trains_its_b():
    """LoRA on the LM head of a model with untied embeddings (--no-tiny-tied-embeddings):
    logprobs.py's chunked head multiplies by W + s B A (logprobs.head_weight), which equals the HF
    forward's own logits (1e-5), the gradient reaches the head's B, and with the adapter off it is
    the base's head."""
    model, _ = tasks.build_tiny_model(arch="gpt2", tied_embeddings=False, max_positions=64)
    adapted = lora.add_adapter(copy.deepcopy(model), 4, 8.0, "c_attn,c_proj,c_fc,lm_head")
    randomise_b(adapted)
    head = adapted.get_output_embeddings()
    assert head in lora.adapter_layers(adapted).values()
    ids = torch.randint(3, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(10).expand(2, -1),
        "responses": ids[:, 4:],
        "response_mask": torch.ones(2, 6),
    }
    settings = logprobs.LogprobSettings(temperature=1.0, chunk_size=4)
    ours, _ = logprobs.response_logprobs(adapted, batch, settings)
    logits = adapted(input_ids=ids).logits[:, 3:-1]
    reference = torch.log_softmax(logits, -1).gather(-1, ids[:, 4:, None])[..., 0]
    assert (ours - reference).abs().max() < 1e-5
    ours.sum().backward()
    assert head.lora_B[lora.ADAPTER].weight.grad.abs().max() > 0
    with lora.adapter_disabled(adapted), torch.no_grad():
        off, _ = logprobs.response_logprobs(adapted, batch, settings)
        base, _ = logprobs.response_logprobs(model, batch, settings)
    assert torch.equal(off, base)


def test_a_tied_lm_head_is_not_adapted():
    """A tied head is the embedding matrix: its merged weight would need a second matrix that a
    tied engine or a tied saved model cannot hold, so add_adapter refuses it in one line."""
    model, _ = tasks.build_tiny_model(arch="gpt2", max_positions=64)
    with pytest.raises(harness.RunError, match="tied") as caught:
        lora.add_adapter(model, 4, 8.0, "c_attn,lm_head")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora-rank", "-1"], "--lora-rank"),
        (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha"),
        (["--lora-rank", "4", "--lora-target-modules", "nothing_here"], "--lora-target-modules"),
    ],
)
def test_bad_lora_flags_end_in_one_line(flags, message, tmp_path):
    argv = [str(ROOT / "grpo.py"), "tiny", "--output-dir", str(tmp_path), *flags]
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert done.returncode in (1, 2)
    last = done.stderr.strip().splitlines()[-1]
    assert message in last and "Traceback" not in done.stderr, done.stderr[-2000:]


ADAPTER_SYNC = ["--vllm-lora-sync", "adapter"]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--backend", "vllm", *ADAPTER_SYNC], "--vllm-lora-sync"),
        (["--lora-rank", "8", *ADAPTER_SYNC], "--vllm-lora-sync"),
        (["--backend", "vllm", "--lora-rank", "8", "--tiny-arch", "gpt2"], "--tiny-arch"),
        (["--backend", "vllm", "--lora-rank", "8", "--mismatch", "bf16"], "--mismatch"),
        (["--backend", "vllm", "--lora-rank", "8", "--lora-target-modules", "lm_head"], "--lora"),
        (["--backend", "vllm", "--lora-rank", "1024"], "--lora-rank"),
    ],
)
def test_what_vllm_adapter_sync_cannot_take_is_refused_in_one_line(
    flags, named, capsys, monkeypatch, tmp_path
):
    """--vllm-lora-sync adapter needs vLLM and an adapter, and vLLM 0.32's LoRA layers take no
    GPT-2, no LM head, no rounded base, no rank past 512: each ends in `grpo.py: error: --flag
    ...` and exit status 2, before any model loads."""
    import transformers

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: pytest.fail("a model was loaded before the bad flag was refused"),
    )
    monkeypatch.setattr(rollout, "check_vllm_available", lambda: None)  # vllm need not be here
    extra = ADAPTER_SYNC if "--backend" in flags and "--vllm-lora-sync" not in flags else []
    argv = ["tiny", "--tiny-arch", "qwen2", "--output-dir", str(tmp_path / "run"), *flags, *extra]
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert err[0].startswith("grpo.py: error: " + named), err


@pytest.mark.parametrize(
    "flags", [["--task", "arith"], ["--model-name-or-path", "HuggingFaceTB/SmolLM2-135M"]]
)
def test_pretraining_a_model_other_than_the_tiny_copy_base_is_refused(flags, capsys, tmp_path):
    """--tiny-pretrain-steps pretrains the tiny model on the copy task's words: with another task
    or another model it is refused in one line (exit 2) before anything loads."""
    argv = ["tiny_lora", "--output-dir", str(tmp_path / "run"), *flags]
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert err[0].startswith("grpo.py: error: --tiny-pretrain-steps must be 0 unless"), err


def test_an_adapter_of_other_settings_is_refused_in_one_line(tmp_path):
    """load_adapter: a file whose weights are not this model's adapter's (another rank) ends in a
    RunError naming the file."""
    _, model, _ = adapted_tiny("qwen2", rank=4)
    lora.save_adapter(tmp_path, model, lora.adapter_weights(model))
    _, other, _ = adapted_tiny("qwen2", rank=2)
    with pytest.raises(harness.RunError, match="adapter"):
        lora.load_adapter(other, tmp_path)


def ppo_lora_command(out):
    argv = [sys.executable, str(ROOT / "ppo_rlhf.py"), "tiny_lora", "--output-dir", str(out)]
    return argv + ["--lora-rank", "8", "--total-episodes", "192", "--save-every", "1"]


def test_ppo_rlhf_trains_a_lora_policy_and_a_whole_value_head_and_resumes_exactly(tmp_path):
    """ppo_rlhf.py tiny_lora (rank 8), 3 updates: the first update's KL to the reference is exactly
    0 (the reference is the policy with its adapter off, and B starts at 0), the value head is
    trained whole beside the adapter, the checkpoint holds the adapter in peft's format with
    value_head.pt, and <output_dir>/policy is the merged HF model, which PeftModel on the base
    matches. The same run killed with SIGKILL after update 2 and rerun logs the same numbers and
    ends with the same adapter and value head."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ppo"
    done = subprocess.run(
        ppo_lora_command(out), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    updates = [row for row in rows(out) if "objective/kl" in row]
    assert len(updates) == 3 and updates[0]["objective/kl"] == 0.0
    assert updates[-1]["objective/kl"] > 0
    value_head = torch.load(out / "checkpoint" / "value_head.pt", weights_only=True)
    assert value_head["weight"].abs().max() > 0  # [policy 2] starts it at exactly 0
    assert lora.adapter_settings(out / "checkpoint") == (8, 32.0)
    base = AutoModelForCausalLM.from_pretrained(out / "reward_model_run" / "tiny_policy")
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with_adapter = PeftModel.from_pretrained(base, out / "checkpoint")(input_ids=ids).logits
    merged = AutoModelForCausalLM.from_pretrained(out / "policy")(input_ids=ids).logits
    assert (with_adapter - merged).abs().max() < 1e-5

    killed = tmp_path / "killed"
    # the reward model is built once per folder (its mark and hashes): the same one, copied
    shutil.copytree(out / "reward_model_run", killed / "reward_model_run", symlinks=False)
    logged = kill_after_two_rows(ppo_lora_command(killed), killed / "metrics.jsonl")
    assert logged < 3  # killed before the last update
    done = subprocess.run(
        ppo_lora_command(killed), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert rows(killed) == rows(out)
    ours, theirs = adapter(killed / "checkpoint"), adapter(out / "checkpoint")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    resumed_head = torch.load(killed / "checkpoint" / "value_head.pt", weights_only=True)
    assert all(torch.equal(resumed_head[k], value_head[k]) for k in value_head)


def test_recomputed_layers_give_a_lora_run_the_same_numbers(tmp_path):
    """--gradient-checkpointing with a frozen base: the recomputed layers' inputs need no gradient
    of their own, and the adapter inside them still gets its gradient (non-reentrant
    checkpointing), so 2 steps log the same numbers as without it."""
    base = dataclasses.replace(
        grpo.PRESETS["tiny_lora"][1],
        cuda=False,
        tiny_pretrain_steps=5,
        total_steps=2,
        val_every=0,
        train_batch_size=8,
        ppo_mini_batch_size=4,
        rollout_n=8,
        train_size=64,
        log_samples_every=0,
    )
    logged = []
    for recompute in (False, True):
        out = tmp_path / f"recompute_{recompute}"
        args = dataclasses.replace(base, gradient_checkpointing=recompute, output_dir=str(out))
        grpo.train(args)
        logged.append(rows(out))
    assert logged[0] == logged[1]
    assert all(row["actor/grad_norm"] > 0 for row in logged[0])
