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


def pytest_collection_modifyitems(config, items):
    """@pytest.mark.gpu tests run only where CUDA is available; elsewhere they are skipped (with the
    reason shown)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
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
