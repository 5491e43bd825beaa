"""Shared test setup."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Every test model is tiny: one thread is faster, and on a shared 2-core machine a second
    OpenMP thread only spins (measured 13-15x slower per forward). The tiny presets set
    torch_threads=1 for the same reason."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def lowered_kernel_set():
    """ATEN_CPU_CAPABILITY=avx2 (or default) on a CPU with AVX512: the suite's check that its float
    tolerances hold on another kernel set (README, Tests). Two parts of torch 2.13 fail there that
    a CPU whose own kernel set it is runs (tests marked native_kernels): inductor's compiled kernels
    (NaN outputs, a C++ compile error, a segmentation fault: measured) and bfloat16
    scaled-dot-product attention ("pack_vnni2 is only supported when avx512 is supported")."""
    import os

    lowered = os.environ.get("ATEN_CPU_CAPABILITY") in ("avx2", "default")
    return lowered and torch.cpu._is_avx512_supported()


def pytest_collection_modifyitems(config, items):
    """@pytest.mark.gpu tests run only where CUDA is available, @pytest.mark.native_kernels ones
    only on the CPU's own kernel set (lowered_kernel_set); elsewhere they are skipped (with the
    reason shown)."""
    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA GPU")
    if lowered_kernel_set():
        reason = "torch's compiled and bf16-attention CPU kernels fail under a lowered kernel set"
        skips["native_kernels"] = pytest.mark.skip(reason=reason)
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """A tiny gpt2 policy and a random reward model normalised to mean 0 / std 1 on random
    query-responses (built once per test session, for the ppo_rlhf.py runs of several test files), saved as rewards.py saves them (<dir>/tiny_policy next to <dir>/reward_model,
    as the tiny preset expects)."""
    from transformers import AutoModelForCausalLM

    import rewards
    import tasks

    root = tmp_path_factory.mktemp("ppo_assets")
    _, tok = tasks.build_tiny_model(str(root / "tiny_policy"), arch="gpt2")
    torch.manual_seed(1)
    rm = rewards.RewardModel(AutoModelForCausalLM.from_pretrained(str(root / "tiny_policy"))).eval()
    x = torch.randint(3, len(tok), (256, 24))
    with torch.no_grad():
        raw = rm(x, torch.ones_like(x))
        # parameters (trainable in rewards.train): set without grad
        rm.reward_gain.fill_(1.0 / raw.std().item())
        rm.reward_bias.fill_(-raw.mean().item() / raw.std().item())
    rewards.save_reward_model(rm, str(root / "reward_model"), tok)
    return root


@pytest.fixture(scope="session")
def tiny():
    """The tiny random-init Qwen2 (tasks.build_tiny_model, seed 0) and its tokenizer, in eval mode;
    tests that change it work on a copy."""
    import tasks

    torch.manual_seed(0)
    model, tokenizer = tasks.build_tiny_model(None, arch="qwen2")
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def tiny_lm():
    """The tiny random-init gpt2 (ppo_rlhf.py's architecture) and its tokenizer, in eval mode."""
    import tasks

    model, tokenizer = tasks.build_tiny_model(None, arch="gpt2")
    return model.eval(), tokenizer
