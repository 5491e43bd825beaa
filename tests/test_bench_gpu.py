"""bench/bench_gpu.py --tiny --no-write (the GPU bench at its CPU size, issue 20) runs end to end in
one process and prints every row with sane numbers, and leaves bench/RESULTS.md alone. ~50 s on 2
shared cores, most of it the two compiles of the compiled-layer rows (one subprocess: the bench is a
command, so it is tested as one; pinned to the CPU so a GPU machine runs the same quick check)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def number(text):
    return float(re.match(r"[\d,.]+", text).group(0).replace(",", ""))


@pytest.mark.native_kernels
def test_bench_gpu_tiny_prints_sane_rows_and_writes_nothing():
    results = os.path.join(ROOT, "bench", "RESULTS.md")
    before = open(results).read()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "bench/bench_gpu.py", "--tiny", "--no-write"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert open(results).read() == before
    table = out.stdout[out.stdout.index("bench_gpu table") :]
    assert "tiny sizes" in table  # it says these are not GPU numbers
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| row")
    ]
    kinds = [r[0] for r in rows]
    # plain loss, ours with every layer recomputed, fp32 / bf16 heads, eager element-wise, the
    # layers for a third of the plain peak (TF32, bf16), grpo.py's own choice, the plain loss
    # again; then with compiled layers: the plain loss, ours with TF32 / bf16 heads, a third of the
    # plain peak (bf16)
    assert (
        kinds.count("update") == 13
        and kinds.count("rollout") == 1
        and kinds.count("grpo vs TRL") == 1
    )
    assert kinds.count("ppo update") == 2
    # the LoRA update (a frozen bf16 base, the adapter trained) and its full fine-tuning peer
    assert kinds.count("lora update") == 2
    for r in rows:
        if r[0] in ("update", "rollout", "ppo update", "lora update"):
            assert number(r[2]) > 0 and number(r[3]) > 0, r  # seconds, tokens/s (episodes/s)
    updates = {r[1].split(", ", 2)[-1]: r for r in rows if r[0] == "update"}
    assert updates["plain HF loss"][6].startswith("1.00x")
    assert sum(label.endswith("compiled layers") for label in updates) == 4
    # throughput against the plain loss on the same tokens: a plausible multiple
    for r in updates.values():
        assert 0.1 < number(r[6]) < 10, r
    trl = next(r for r in rows if r[0] == "grpo vs TRL")
    assert trl[1].startswith("skipped") or number(trl[2]) > 0
    for r in rows:
        if r[0] == "ppo update":
            assert number(r[6].split(": ")[1]) > 0  # hours for 1M episodes
