"""scripts/gpu_check.sh --cpu: the CPU-checkable part of the GPU check runs end to end and every row
passes (a fp32 GRPO step with trainer-vs-rollout logprob difference < 1e-5, a ppo_rlhf update, each
GPU preset's memory plan fits 80 GiB, the LoRA ones included; the GPU-only rows, fp16 vs bf16 included, are skipped). ~25 s on 2 shared cores (one
subprocess: the script is a command, so it is tested as one)."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_cpu_part_passes():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = out.stdout[out.stdout.index("gpu_check table") :].splitlines()
    rows = [line for line in table if line.startswith("| ") and "status" not in line]
    assert len(rows) == 12 and not any("FAIL" in r for r in rows)
    # skipped on CPU: vLLM (without --vllm), 2-GPU vLLM, fp16 vs bf16, TF32 head
    assert sum("PASS" in r for r in rows) == 8
    # the 7B LoRA policy's plan on one GPU (issue 63)
    assert any("gsm8k_qwen25_7b_lora" in r and "PASS" in r for r in rows)
    assert any("trainer vs rollout" in r and "PASS" in r for r in rows)
