"""LoRA's own rollout/training mismatch: the trainer computes W x + s B (A x) (the adapter
unmerged), the engine computes (W + s B A) x with one merged matrix. Per response token, the
difference of the two log-probabilities of the sampled token, in fp32 and under bf16 (the trainer
under bf16 autocast over a bf16 base; the engine with the merged weights rounded to bf16, as a bf16
vLLM engine holds them). Printed for docs/lora.md.

    .venv/bin/python scripts/lora_mismatch.py                    # SmolLM2-135M-Instruct, r = 32
    .venv/bin/python scripts/lora_mismatch.py --model tiny --rank 8

The adapter: peft's A, and B drawn at the size a trained adapter reaches (std --b-std; at B = 0
both compute the base and nothing differs). The tokens: --samples responses of --length tokens
sampled from the merged fp32 model at T = 1 after short prompts. Reported per token over the
responses: max and mean |delta log p| and k3 = exp(d) - 1 - d, d = log p_engine - log p_trainer
(the k3 estimator of KL(engine || trainer) that rollout_corr/k3_kl logs). For scale, the same
numbers for the plain model (no adapter) between a bf16 engine and the bf16-autocast trainer.
"""

import argparse
import contextlib
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import logprobs  # noqa: E402
import lora  # noqa: E402
import tasks  # noqa: E402


def token_logprobs(model, ids, prompt_length, bf16):
    """log p of ids[:, prompt_length:] under model (B, R): logprobs.py's definition on the
    forward's logits, under bf16 autocast if bf16."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        logits = model(input_ids=ids).logits[:, prompt_length - 1 : -1]
    tokens = ids[:, prompt_length:]
    lp, _ = logprobs.reference_logprobs_and_entropy(logits.flatten(0, 1), tokens.flatten())
    return lp.view(tokens.shape)


def differences(engine, trainer):
    d = engine - trainer
    k3 = torch.exp(d) - 1 - d
    return f"max {d.abs().max():.2e}  mean {d.abs().mean():.2e}  k3 mean {k3.mean():.2e}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 or tiny")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--b-std", type=float, default=0.01)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    if args.model == "tiny":
        base, tokenizer = tasks.build_tiny_model(arch="qwen2", seed=args.seed)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = AutoModelForCausalLM.from_pretrained(tasks.SMOLLM2_PATH, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(tasks.SMOLLM2_PATH)
    base.eval()
    trainer = lora.add_adapter(copy.deepcopy(base), args.rank, args.alpha, "all-linear")
    with torch.no_grad():
        for layer in lora.adapter_layers(trainer).values():
            b = layer.lora_B[lora.ADAPTER].weight
            b.copy_(torch.randn(b.shape) * args.b_std)
    engine = copy.deepcopy(base)
    engine.load_state_dict(dict(lora.merged_named_weights(trainer)), strict=False)

    prompt = tokenizer("The weather today is")["input_ids"]
    with torch.no_grad():
        ids = engine.generate(
            torch.tensor([prompt] * args.samples),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=args.length,
            min_new_tokens=args.length,
            pad_token_id=tokenizer.eos_token_id,
        )
    print(
        f"{args.model}, r = {args.rank}, alpha = {args.alpha:g}, B std {args.b_std:g}: "
        f"{args.samples} x {args.length} sampled tokens"
    )
    rows = {}
    rows["fp32: merged engine vs unmerged trainer"] = (
        token_logprobs(engine, ids, len(prompt), bf16=False),
        token_logprobs(trainer, ids, len(prompt), bf16=False),
    )
    # bf16: the trainer's base in bf16 under autocast (grpo.py --lora-rank under bf16), the
    # engine's merged weights rounded to bf16
    trainer_bf16, engine_bf16, base_bf16 = (copy.deepcopy(m) for m in (trainer, engine, base))
    logprobs.bf16_frozen_linears_(trainer_bf16)
    logprobs.bf16_frozen_linears_(engine_bf16.requires_grad_(False))
    logprobs.bf16_frozen_linears_(base_bf16.requires_grad_(False))
    rows["bf16: merged engine vs unmerged trainer"] = (
        token_logprobs(engine_bf16, ids, len(prompt), bf16=True),
        token_logprobs(trainer_bf16, ids, len(prompt), bf16=True),
    )
    rows["bf16, no adapter: engine vs trainer (scale)"] = (
        token_logprobs(base_bf16, ids, len(prompt), bf16=True),
        token_logprobs(base, ids, len(prompt), bf16=True),
    )
    rows["bf16 engine vs fp32 trainer, merged (bf16 alone)"] = (
        token_logprobs(engine_bf16, ids, len(prompt), bf16=True),
        token_logprobs(engine, ids, len(prompt), bf16=False),
    )
    for name, (engine_lp, trainer_lp) in rows.items():
        print(f"  {name:50s} {differences(engine_lp, trainer_lp)}")


if __name__ == "__main__":
    main()
