"""grpo.py's command line with a failure injected on rank 1 at its first update (for
tests/test_grpo.py): rank 0 is then inside a collective. `torchrun --nproc_per_node 2
tests/crash_rank1.py tiny --output-dir DIR ...`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo  # noqa: E402

real_update_policy = grpo.update_policy


def update_policy_failing_on_rank_1(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 1:
        raise RuntimeError("injected failure on rank 1")
    return real_update_policy(*args, **kwargs)


if __name__ == "__main__":
    grpo.update_policy = update_policy_failing_on_rank_1
    grpo.main(sys.argv[1:])
