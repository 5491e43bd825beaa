"""The LM head's precision, measured: how far each way of computing the head's product moves the
logprobs, against a float64 product, on SmolLM2-135M-Instruct's real weights (Q4_1-de-quantised) and
a real forward's hidden states.

    .venv/bin/python bench/head_precision.py         # CPU: TF32 and bf16 emulated (below); prints the table
    .venv/bin/python bench/head_precision.py --cuda  # on a GPU: also logprobs.py's real TF32 and bf16 paths
    .venv/bin/python bench/head_precision.py --save-inputs   # write HEAD_INPUTS (32 MB) from the model
    python bench/head_precision.py --inputs --cuda   # a GPU machine without the model: read HEAD_INPUTS

Emulated on CPU, with the rounding applied to the fp32 bit pattern (round to nearest, ties to even)
and the sums in fp32, as tensor cores accumulate:
    fp32 (IEEE)                 the float32 product: logprobs.py's head on CPU and with --no-bf16
    TF32                        both inputs rounded to TF32 (10 explicit mantissa bits), float32 matmul
    bf16 inputs, fp32 output    both inputs rounded to bfloat16, float32 matmul (torch.mm(..., out_dtype=float32))
    bf16 logits                 the float32 logits rounded to bfloat16: a head under bf16 autocast (verl, TRL)
The logprob is log_softmax(logits)[token] of the text's own next tokens; the error is |logprob -
float64 logprob|. tests/test_logprobs.py runs this on every CI run; the table is in
docs/logprobs.md#lm-head-precision.
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import logprobs  # noqa: E402

SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
# the hidden states, next tokens and head weight of smollm2_hidden, small enough to carry to a
# machine that lacks the 538 MB model (the weight stored exactly as its GGUF form, below)
HEAD_INPUTS = os.path.join(ROOT, "models", "smollm2_head_inputs.pt")
BLOCK = 32  # GGUF Q8_0: one float16 scale per 32 weights of a row
CHATS = [  # (question, answer): the kind of text grpo.py's smol_arith preset trains SmolLM2 on
    (
        "Tom has 3 apples and buys 5 more. How many apples does he have?",
        "Tom starts with 3 apples. He buys 5 more, so he has 3 + 5 = 8 apples.\n#### 8",
    ),
    (
        "A box holds 12 pens. Sara gives 4 pens to Ali. How many pens are left?",
        "12 - 4 = 8, so 8 pens are left in the box.\n#### 8",
    ),
]


def round_mantissa(x, bits):
    """float32 x rounded to `bits` explicit mantissa bits (round to nearest, ties to even), as
    float32."""
    drop = 23 - bits
    b = x.float().contiguous().view(torch.int32)
    b = (b + ((1 << (drop - 1)) - 1) + ((b >> drop) & 1)) & ~((1 << drop) - 1)
    return b.view(torch.float32)


def smollm2_hidden(path=SMOLLM2):
    """(hidden (N, H) float32, head weight (V, H) float32, next tokens (N,)) from one fp32 forward
    of CHATS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hidden, tokens = [], []
    with torch.no_grad():
        for question, answer in CHATS:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                tokenize=False,
            )
            ids = tokenizer(text, return_tensors="pt").input_ids
            # position t predicts token t+1
            hidden.append(model.model(input_ids=ids).last_hidden_state[0, :-1])
            tokens.append(ids[0, 1:])
    return torch.cat(hidden), model.get_output_embeddings().weight.detach(), torch.cat(tokens)


def save_head_inputs(path, hidden, weight, tokens):
    """Write (hidden, weight, tokens) to `path`, the weight as one scale per block of 32 times an
    int8 (GGUF's Q8_0 layout, which the wheel's token embedding is stored in: 32 MB where float32
    takes 113 MB). The factorisation is checked to give back every float32 bit of the weight."""
    blocks = weight.reshape(weight.shape[0], -1, BLOCK)
    # Q8_0 picks scale = max |w| / 127, so the block's largest weight is +-127 x scale exactly
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block
    q = torch.round(blocks / scale)
    if not torch.equal(q * scale, blocks) or q.abs().max() > 127:
        raise ValueError(
            "the head weight is not a per-block scale x int8: it cannot be stored exactly"
        )
    torch.save({"hidden": hidden, "tokens": tokens, "scale": scale, "q": q.to(torch.int8)}, path)


def load_head_inputs(path):
    """(hidden, weight, tokens) as save_head_inputs wrote them: the weight bit for bit."""
    saved = torch.load(path)
    weight = (saved["q"].float() * saved["scale"]).reshape(saved["q"].shape[0], -1)
    return saved["hidden"], weight, saved["tokens"]


def emulated_logits(hidden, weight):
    """{name: (N, V) logits} of the four products above, on CPU."""
    with torch.no_grad():
        fp32 = hidden @ weight.T
        return {
            "fp32 (IEEE)": fp32,
            "TF32": round_mantissa(hidden, 10) @ round_mantissa(weight, 10).T,
            "bf16 inputs, fp32 output": round_mantissa(hidden, 7) @ round_mantissa(weight, 7).T,
            "bf16 logits": fp32.to(torch.bfloat16).float(),
        }


def logprob_errors(logits, hidden, weight, tokens):
    """{name: (max, mean) |logprob - float64 logprob|} over the tokens."""
    with torch.no_grad():
        exact = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(
            -1, tokens[:, None]
        )[:, 0]
        out = {}
        for name, z in logits.items():
            err = (
                torch.log_softmax(z.float(), -1).gather(-1, tokens[:, None])[:, 0].double() - exact
            ).abs()
            out[name] = (err.max().item(), err.mean().item())
    return out


def cuda_logprobs(hidden, weight, tokens, precision):
    """The trainer's own path on a GPU: logprobs.token_logprobs_and_entropy under bf16 autocast
    with --lm-head-precision `precision` (auto: TF32)."""
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        head.weight.copy_(weight)
        token_logprobs, _ = logprobs.token_logprobs_and_entropy(
            hidden.cuda(),
            tokens.cuda(),
            head,
            logprobs.LogprobSettings(temperature=1.0, head_precision=precision),
        )
    return token_logprobs.cpu()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cuda", action="store_true", help="also measure the real TF32 path on this GPU"
    )
    parser.add_argument(
        "--save-inputs", action="store_true", help=f"write {HEAD_INPUTS} from the model and stop"
    )
    parser.add_argument(
        "--inputs", action="store_true", help=f"read {HEAD_INPUTS} instead of the model"
    )
    opts = parser.parse_args()
    if opts.inputs:
        hidden, weight, tokens = load_head_inputs(HEAD_INPUTS)
    else:
        hidden, weight, tokens = smollm2_hidden()
    if opts.save_inputs:
        save_head_inputs(HEAD_INPUTS, hidden, weight, tokens)
        print(f"wrote {HEAD_INPUTS} ({os.path.getsize(HEAD_INPUTS) / 1e6:.0f} MB)")
        return
    errors = logprob_errors(emulated_logits(hidden, weight), hidden, weight, tokens)
    if opts.cuda:
        exact = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(
            -1, tokens[:, None]
        )[:, 0]
        for precision, label in (("tf32", "TF32"), ("bf16", "bf16 inputs, fp32 output")):
            err = (cuda_logprobs(hidden, weight, tokens, precision).double() - exact).abs()
            errors[f"{label} on {torch.cuda.get_device_name()} (corrections.py)"] = (
                err.max().item(),
                err.mean().item(),
            )
    bf16_max, bf16_mean = errors["bf16 logits"]
    tf32_max, tf32_mean = errors["TF32"]
    print(
        f"SmolLM2-135M-Instruct (Q4_1-de-quantised), {len(tokens)} tokens, max |logit| "
        f"{(hidden @ weight.T).abs().max().item():.1f}; torch {torch.__version__}\n"
    )
    print(
        "| head product | max abs logprob error | mean abs logprob error | max / bf16 logits' "
        "| mean / bf16 logits' | max / TF32's | mean / TF32's |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, (mx, mean) in errors.items():
        print(
            f"| {name} | {mx:.2e} | {mean:.2e} | {mx / bf16_max:.3f} | {mean / bf16_mean:.3f} "
            f"| {mx / tf32_max:.3g} | {mean / tf32_mean:.3g} |"
        )


if __name__ == "__main__":
    main()
