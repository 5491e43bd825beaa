"""Run grpo.py's smol_arith preset with --backend vllm and record what the docs show: the run's metrics.jsonl (its
step-0 row is grpo's validation before training) and a few greedy held-out answers before and after.

    python scripts/smol_arith_experiment.py --seed 1 --output-dir runs/smol_arith_s1 [--total-steps 24 ...]

Writes <output_dir>/metrics.jsonl (grpo.train) and <output_dir>/examples.json. One engine serves all three: grpo.train(args, backend=...) syncs the trainer's weights
into it before its first rollout, and after train() returns it holds the trained weights.
"""

import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpo  # noqa: E402

N_EXAMPLES = 4


def greedy_answers(backend, tokenizer, prompt_ids, examples, reward_fn, args):
    responses, _, _ = backend.generate(prompt_ids, 1, args.max_response_length, 0.0, seed=0)
    return [{"question": ex["prompt"], "answer": ex["answer"], "response": grpo.response_text(tokenizer, r),
             "reward": reward_fn(grpo.response_text(tokenizer, r), ex)} for r, ex in zip(responses, examples)]


def main(argv=None):
    import tyro

    args = tyro.cli(grpo.Args, default=dataclasses.replace(grpo.PRESETS["smol_arith"][1](), backend="vllm"),
                    args=argv)
    from transformers import AutoTokenizer

    grpo.check_args(args)
    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    _, val_examples, reward_fn = grpo.load_task(args)
    val_ids = grpo.tokenize_prompts(tokenizer, val_examples, args)
    max_model_len = max([args.max_prompt_length] + [len(p) for p in val_ids]) + args.max_response_length
    backend = grpo.VLLMBackend(args.model_name_or_path, tokenizer.eos_token_id, max_model_len=max_model_len,
                               max_num_seqs=args.vllm_max_num_seqs, dtype="float32", seed=args.seed)
    before = greedy_answers(backend, tokenizer, val_ids[:N_EXAMPLES], val_examples[:N_EXAMPLES], reward_fn, args)
    with open(os.path.join(args.output_dir, "examples.json"), "w") as f:  # now: a run stopped early keeps these
        json.dump({"before": before}, f, indent=1)
    grpo.train(args, backend=backend)
    after = greedy_answers(backend, tokenizer, val_ids[:N_EXAMPLES], val_examples[:N_EXAMPLES], reward_fn, args)
    with open(os.path.join(args.output_dir, "examples.json"), "w") as f:
        json.dump({"before": before, "after": after}, f, indent=1)
    backend.close()


if __name__ == "__main__":
    main()
