"""Shared test setup."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Every test model is tiny: one thread is faster, and on a shared 2-core machine a second OpenMP thread only
    spins (measured 13-15x slower per forward). The tiny presets set torch_threads=1 for the same reason."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """@pytest.mark.gpu tests run only where CUDA is available; elsewhere they are skipped (with the reason shown)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
