#!/usr/bin/env bash
# Everything that needs a GPU, in one command, one table (scripts/gpu_check.py says what each row checks):
#   bash scripts/gpu_check.sh          # on one GPU, < 10 min: GRPO bf16 + fp32 steps, a ppo_rlhf bf16 update,
#                                      # plan vs measured peak memory per preset, vLLM parity if vllm is importable,
#                                      # the TF32 LM head's error on SmolLM2; with 2+ GPUs and vllm also a 1-step
#                                      # torchrun smoke (each rank's engine on cuda:LOCAL_RANK, external_launcher)
#   bash scripts/gpu_check.sh --cpu    # the CPU-checkable part (CI: tests/test_gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
exec "$PYTHON" scripts/gpu_check.py "$@"
