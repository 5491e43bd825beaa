"""harness.py on two processes (for tests/test_harness.py; not a test file itself: no test_ prefix).

    torchrun --nproc_per_node 2 tests/harness_ranks.py OUT_DIR

Each rank writes OUT_DIR/rank<r>.json with what it saw: the reduced metrics, its averaged gradient,
the parameter checksum spread, and the random numbers it drew right after saving a checkpoint and
again after loading it (with every generator scrambled in between): equal when every RNG of every
rank was restored.
"""

import dataclasses
import json
import os
import random
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402


@dataclasses.dataclass
class Settings:
    """The fields of a script's Args that a checkpoint records (any dataclass will do)."""

    output_dir: str
    seed: int = 100


def draws():
    """One number from each generator a run uses: python, numpy, torch's CPU and CUDA ones."""
    numbers = [random.random(), float(np.random.rand()), torch.rand(1).item()]
    if torch.cuda.is_available():
        numbers.append(torch.rand(1, device="cuda").item())
    return numbers


def main(out_dir):
    rank, world_size, _ = harness.setup_distributed(use_cuda=False)
    harness.seed_everything(100 + rank)
    report = {}

    metrics = {
        "loss": float(rank),
        "ratio_max": float(rank),
        "ratio_min": float(rank),
        "count": 1.0,
    }
    report["reduced"] = harness.reduce_metrics(metrics, world_size, sum_keys=("count",))

    layer = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(layer.weight)
    layer.weight.grad = torch.full_like(layer.weight, float(rank + 1))
    harness.average_gradients(layer.parameters(), world_size)
    report["gradient"] = layer.weight.grad.tolist()
    report["spread_equal"] = harness.rank_checksum_spread(layer.parameters(), world_size)
    with torch.no_grad():
        layer.weight.add_(rank)
    report["spread_different"] = harness.rank_checksum_spread(layer.parameters(), world_size)

    draws()  # move every generator away from its seed

    def write_files(folder):
        open(os.path.join(folder, "model.txt"), "w").close()

    harness.save_checkpoint(out_dir, rank, write_files, {"step": 3}, Settings(out_dir))
    report["after_save"] = draws()
    harness.seed_everything(999)  # scramble every generator, as a fresh process would have them
    path = harness.find_checkpoint(out_dir)
    report["state_step"] = harness.load_checkpoint(path, rank)["step"]
    report["after_load"] = draws()
    report["files"] = sorted(os.listdir(path))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    harness.barrier()
    harness.end_processes(world_size)


if __name__ == "__main__":
    main(sys.argv[1])
