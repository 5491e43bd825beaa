"""Can a LoRA adapter fit the copy task on grpo.py's tiny model at all? A supervised check, no RL:
the tiny GPT-2 model (random init, as `grpo.py tiny` builds it) trained with teacher forcing on
copy-task examples (3 letters of "abcd" + "=" -> the same letters + EOS), the loss on the answer
tokens, full fine-tuning against a LoRA adapter (lora.add_adapter, every linear layer). Printed for
docs/lora.md.

    .venv/bin/python scripts/lora_capacity.py                      # full fine-tuning, lr 1e-3
    .venv/bin/python scripts/lora_capacity.py --rank 8 --lr 1e-2
    .venv/bin/python scripts/lora_capacity.py --rank 8 --lr 1e-2 --also-train ln_f   # + the final norm
    .venv/bin/python scripts/lora_capacity.py --rank 8 --lr 3e-3 --untied \
        --target c_attn,c_proj,c_fc,lm_head                       # + the LM head (untied)

The loss is the mean negative log-likelihood of the answer tokens, the accuracy the share of answer
tokens the argmax gets right; both on the step's own batch.
"""

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lora  # noqa: E402
import tasks  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=0, help="0: full fine-tuning")
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--also-train", default="", help="also train parameters with this in name")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target", default="all-linear", help="--lora-target-modules")
    parser.add_argument("--untied", action="store_true", help="the LM head its own matrix")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    model, tokenizer = tasks.build_tiny_model(
        arch="gpt2", seed=args.seed, max_positions=64, tied_embeddings=not args.untied
    )
    if args.rank:
        model = lora.add_adapter(model, args.rank, args.alpha, args.target, seed=args.seed)
        for name, p in model.named_parameters():
            if args.also_train and args.also_train in name:
                p.requires_grad_(True)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trained, lr=args.lr)
    print(f"rank {args.rank}, lr {args.lr:g}: {sum(p.numel() for p in trained)} trained weights")

    for step in range(1, args.steps + 1):
        rows = []
        for _ in range(args.batch):
            word = "".join(rng.choice(tasks.COPY_ALPHABET) for _ in range(3))
            prompt = tokenizer(word + "=")["input_ids"]
            rows.append(prompt + tokenizer(word)["input_ids"] + [tokenizer.eos_token_id])
        ids = torch.tensor(rows)
        logits = model(input_ids=ids).logits[:, :-1]
        answer = slice(len(prompt) - 1, None)  # the positions that predict the answer tokens
        targets = ids[:, 1:][:, answer]
        logprobs = torch.log_softmax(logits[:, answer], -1)
        loss = -logprobs.gather(-1, targets[..., None]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == 1:
            accuracy = (logits[:, answer].argmax(-1) == targets).float().mean().item()
            print(f"step {step}: loss {loss.item():.3f}, accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
