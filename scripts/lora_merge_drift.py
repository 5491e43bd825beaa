"""What merging a LoRA adapter into a bf16 base in place, and unmerging it after, does to the base
(peft's merge / unmerge: TRL's GRPOTrainer syncs vLLM this way), against lora.py's out-of-place
merge, which never writes the base. Printed for docs/lora.md.

    .venv/bin/python scripts/lora_merge_drift.py            # one 256 x 256 projection, r = 16
    .venv/bin/python scripts/lora_merge_drift.py --size 576 --rank 32 --cycles 1000

A bf16 nn.Linear gets peft's LoRA layer (alpha = 2r); B is drawn at the size a trained adapter
reaches (std --b-std; peft starts it at 0). Then `cycles` times merge() + unmerge(): W += s B A
rounded to bf16, then W -= s B A rounded again, so W comes back only where both roundings cancel.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lora  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="the projection is size x size")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--b-std", type=float, default=0.01, help="std of the trained B's entries")
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(args.size, args.size, bias=False))
    model = lora.add_adapter(model, args.rank, 2.0 * args.rank, "0", seed=args.seed)
    layer = lora.adapter_layers(model)["0"]
    base = layer.get_base_layer().weight
    with torch.no_grad():
        base.data = base.data.to(torch.bfloat16)
        b = layer.lora_B[lora.ADAPTER].weight
        b.copy_(torch.randn(b.shape) * args.b_std)
    original = base.detach().clone()

    # lora.py's sync: W + s B A out of place, in float32
    for _ in range(args.cycles):
        lora.merged_weight(layer)
    print(f"out of place, {args.cycles} merges: base changed in {(base != original).sum()} entries")

    for cycle in range(1, args.cycles + 1):
        layer.merge()
        layer.unmerge()
        if cycle in (1, 10, args.cycles):
            changed = (base != original).float().mean().item()
            drift = (base.float() - original.float()).abs().max().item()
            print(
                f"in place, {cycle} merge/unmerge cycles: {changed:.1%} of the base's entries "
                f"changed, max |change| {drift:.2e} (base entries' max {original.abs().max():.2e})"
            )


if __name__ == "__main__":
    main()
