"""grpo.py's command line with a failing write injected on rank 1: its RNG file of the first checkpoint
cannot be written (no space left), while rank 0 waits at the barrier that follows (for
tests/test_faults.py). `torchrun --nproc_per_node 2 tests/fail_rank1_write.py tiny --output-dir DIR ...`."""

import errno
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import grpo  # noqa: E402

real_save = torch.save


def save_failing_on_rank_1(obj, f, *args, **kwargs):
    # harness.save_plain passes a file object: its name is the path
    path = str(getattr(f, "name", f))
    if int(os.environ.get("RANK", 0)) == 1 and path.endswith("rng_rank1.pt"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return real_save(obj, f, *args, **kwargs)


if __name__ == "__main__":
    torch.save = save_failing_on_rank_1
    grpo.main(sys.argv[1:])
