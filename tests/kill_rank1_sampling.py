"""grpo.py's command line with rank 1 killed (SIGKILL, by itself) in the middle of its first
rollout, after its second new token (for tests/test_faults.py): under --sharding fsdp2 rank 0 is
then inside the all-gather of a forward of generate. `torchrun --nproc_per_node 2
tests/kill_rank1_sampling.py tiny --sharding fsdp2 --output-dir DIR ...`."""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpo  # noqa: E402
import rollout  # noqa: E402

real_call = rollout._LogprobRecorder.__call__


def call_then_die_on_rank_1(self, input_ids, scores):
    # the recorder runs once per new token; the third call: two tokens sampled
    if int(os.environ.get("RANK", 0)) == 1 and len(self.gathered) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_call(self, input_ids, scores)


if __name__ == "__main__":
    rollout._LogprobRecorder.__call__ = call_then_die_on_rank_1
    grpo.main(sys.argv[1:])
