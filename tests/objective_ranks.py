"""objectives.py's batch-wide estimators on two processes (for tests/test_objectives.py; not a test
file itself: no test_ prefix).

    torchrun --nproc_per_node 2 tests/objective_ranks.py OUT_DIR

Rank r takes half of a fixed batch of scores, groups and lengths and writes OUT_DIR/rank<r>.json
with its REINFORCE++ and REINFORCE++-baseline advantages: the two halves together must equal one
process's advantages of the whole batch (the whitening statistics are global).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import objectives  # noqa: E402


def whole_batch():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(32, generator=g)
    group_ids = torch.arange(32) // 4  # groups of 4; each rank holds whole groups
    lengths = torch.randint(1, 9, (32,), generator=g)
    return scores, group_ids, lengths


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    scores, group_ids, lengths = whole_batch()
    mine = slice(16 * rank, 16 * (rank + 1))
    report = {
        name: objectives.ADV_ESTIMATORS[name](scores[mine], group_ids[mine], lengths[mine]).tolist()
        for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
    }
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
