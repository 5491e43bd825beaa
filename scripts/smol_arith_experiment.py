"""Run grpo.py's smol_arith preset with --backend vllm and record what the docs show: the run's
metrics.jsonl (its step-0 row is grpo's validation before training) and every greedy held-out answer
before and after, with the accuracy per kind of problem (a policy that learned one trick, e.g.
always subtracting, shows up there).

    python scripts/smol_arith_experiment.py --seed 1 --output-dir runs/smol_arith_s1 [--total-steps 20 ...]

Writes <output_dir>/metrics.jsonl (grpo.train) and <output_dir>/examples.json ({"before": [...],
"after": [...], "by_operation": {"before": {op: [correct, total]}, "after": ...}}). One engine
serves all three: grpo.train(args, backend=...) syncs the trainer's weights into it before its first
rollout, and after train() returns it holds the trained weights.
"""

import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpo  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402

# the operation of a one-step tasks.make_arith_task problem, read off its wording
OPERATIONS = {"add": " more ", "bags": " bags with ", "give": " gives ", "share": " equal groups "}


def operation(question):
    return next((op for op, words in OPERATIONS.items() if words in question), "other")


def greedy_answers(backend, tokenizer, prompt_ids, examples, reward_fn, args):
    """Greedy answers (as grpo's validation) to every example, each with its operation and
    reward."""
    responses, _, _ = backend.generate(prompt_ids, 1, args.max_response_length, 0.0, seed=0)
    out = []
    for r, ex in zip(responses, examples):
        # the instruction's own example says "more"
        question = ex["prompt"].removeprefix(tasks.ARITH_INSTRUCTION)
        text = tasks.response_text(tokenizer, r)
        out.append(
            {
                "question": question,
                "operation": operation(question),
                "answer": ex["answer"],
                "response": text,
                "reward": reward_fn(text, ex),
            }
        )
    return out


def by_operation(answers):
    """{operation: [correct, total]} over greedy answers."""
    out = {}
    for a in answers:
        counts = out.setdefault(a["operation"], [0, 0])
        counts[0] += int(a["reward"] == 1.0)
        counts[1] += 1
    return dict(sorted(out.items()))


def main(argv=None):
    import tyro

    args = tyro.cli(
        grpo.Args,
        default=dataclasses.replace(grpo.PRESETS["smol_arith"][1], backend="vllm"),
        args=argv,
    )
    from transformers import AutoTokenizer

    grpo.check_args(args)
    os.makedirs(args.output_dir, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    task = tasks.load_task(args)
    val_examples, reward_fn = task.val, task.reward_fn
    val_ids = tasks.tokenize_prompts(tokenizer, val_examples, args)
    max_model_len = (
        max([args.max_prompt_length] + [len(p) for p in val_ids]) + args.max_response_length
    )
    backend = rollout.VLLMBackend(
        args.model_name_or_path,
        tokenizer.eos_token_id,
        max_model_len=max_model_len,
        max_num_seqs=args.vllm_max_num_seqs,
        dtype="float32",
        seed=args.seed,
    )
    before = greedy_answers(backend, tokenizer, val_ids, val_examples, reward_fn, args)
    # now: a run stopped early keeps these
    with open(os.path.join(args.output_dir, "examples.json"), "w") as f:
        json.dump({"before": before, "by_operation": {"before": by_operation(before)}}, f, indent=1)
    grpo.train(args, backend=backend)
    after = greedy_answers(backend, tokenizer, val_ids, val_examples, reward_fn, args)
    with open(os.path.join(args.output_dir, "examples.json"), "w") as f:
        json.dump(
            {
                "before": before,
                "after": after,
                "by_operation": {"before": by_operation(before), "after": by_operation(after)},
            },
            f,
            indent=1,
        )
    for when, answers in (("before", before), ("after", after)):
        print(
            when,
            " ".join(f"{op} {c}/{n}" for op, (c, n) in by_operation(answers).items()),
            flush=True,
        )
    backend.close()


if __name__ == "__main__":
    main()
