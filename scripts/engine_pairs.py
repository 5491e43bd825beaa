"""Do the two rollout engines sample the same thing? Replay one GRPO run's weights, step by step,
through transformers' generate() and vLLM with many samples per prompt, and compare the EOS rate,
the response length, the reward and the variety within a prompt's samples.

    .venv/bin/python scripts/engine_pairs.py --seed 1 --output-dir runs/engine_pairs_s1

1. Train `grpo.py tiny` (HF rollouts) in segments of --every steps. After each segment the
   checkpoint's weights are kept: a resumed run continues the uninterrupted one exactly
   (tests/test_faults.py), so these are the weights the run had after those steps. Step 0 is the
   initial model.
2. For each kept state both engines sample --samples responses for each of --prompts copy prompts
   (the validation draw), at the preset's temperature (1.0), from the same fp32 weights (vLLM gets
   them through sync_weights, as in training).
3. Per state and statistic (EOS rate, mean length, mean reward, and the share of samples that
   differ from their prompt's most common one: the variety GRPO learns from) the z of the
   difference between the engines, stratified by prompt: both engines see the same prompts, so
   the variance of the difference is the within-prompt variance only. Per state and distribution
   (lengths, rewards) a chi-square test of homogeneity. If the engines sample the same
   distribution, each p-value is uniform: about 5% fall below 0.05, and the smallest stays above
   0.05 / (number of tests) (Bonferroni) in 95% of replays. A small systematic difference would be
   in every state: the mean difference over all states, with its standard error, bounds it.

Writes <output-dir>/pairs.jsonl (one row per state) and prints a markdown table (every
--table-every steps) and the summary. docs/grpo.md's "vLLM vs HF" section reports a run.
"""

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpo  # noqa: E402
import harness  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402

# vLLM in this process, so sync_weights reaches the engine's model (must be set before vllm loads)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


# --------------------------------------------------------------------------------------------------
# The statistics
# --------------------------------------------------------------------------------------------------


def stratified_z(a, b):
    """z of mean(a) - mean(b) where a[p] and b[p] are the values both engines drew for prompt p:
    difference = mean over prompts of (mean a[p] - mean b[p]), variance = sum over prompts of
    (var a[p] / len a[p] + var b[p] / len b[p]) / P^2 (sample variances). Returns (difference,
    standard error, z); z = 0 when both sides are constant and equal."""
    num_prompts = len(a)
    difference, variance = 0.0, 0.0
    for values_a, values_b in zip(a, b):
        for values, sign in ((values_a, 1.0), (values_b, -1.0)):
            t = torch.tensor(values, dtype=torch.float64)
            difference += sign * t.mean().item() / num_prompts
            variance += t.var(unbiased=True).item() / len(values) / num_prompts**2
    standard_error = math.sqrt(variance)
    if standard_error == 0.0:
        return difference, 0.0, 0.0 if difference == 0.0 else math.inf
    return difference, standard_error, difference / standard_error


def two_sided_p(z):
    return math.erfc(abs(z) / math.sqrt(2.0))


def chi_square_homogeneity(a, b):
    """Chi-square test that two samples of a discrete variable come from one distribution: the 2 x k
    table of counts over the values seen, expected counts from the pooled margins. Returns
    (statistic, degrees of freedom, p); p = 1 when only one value occurs."""
    values = sorted(set(a) | set(b))
    if len(values) < 2:
        return 0.0, 0, 1.0
    statistic = 0.0
    total = len(a) + len(b)
    for value in values:
        pooled = (a.count(value) + b.count(value)) / total
        for sample in (a, b):
            expected = pooled * len(sample)
            statistic += (sample.count(value) - expected) ** 2 / expected
    dof = len(values) - 1
    # the chi-square survival function: the regularised upper incomplete gamma Q(dof / 2, x / 2)
    p = torch.special.gammaincc(
        torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
    ).item()
    return statistic, dof, p


# per-sample statistics compared by their means
STATISTICS = ("eos", "length", "reward", "off_mode")


def sample_statistics(backend, prompt_ids, examples, tokenizer, reward_fn, args, samples, seed):
    """Per prompt: lists of EOS (1/0), response length (tokens, EOS included, as
    response_length/mean), reward, and off-mode (1 if the sample differs from the prompt's most
    common sample: what GRPO learns from once the policy is nearly deterministic) of `samples`
    draws."""
    responses, _, finish_reasons = backend.generate(
        prompt_ids, samples, args.max_response_length, args.temperature, seed
    )
    per_prompt = []
    for p, example in enumerate(examples):
        rows = range(p * samples, (p + 1) * samples)
        texts = [tasks.response_text(tokenizer, responses[k]) for k in rows]
        drawn = [tuple(responses[k]) for k in rows]
        mode = max(set(drawn), key=drawn.count)
        per_prompt.append(
            {
                "eos": [float(finish_reasons[k] == "stop") for k in rows],
                "length": [float(len(responses[k])) for k in rows],
                "reward": [reward_fn(text, example) for text in texts],
                "off_mode": [float(response != mode) for response in drawn],
            }
        )
    return per_prompt


def compare(hf, vllm):
    """One state's comparison: per statistic the two means, their difference, its standard error, z
    and p; per distribution the chi-square statistic, dof and p."""
    row = {}
    for key in STATISTICS:
        a = [p[key] for p in hf]
        b = [p[key] for p in vllm]
        difference, standard_error, z = stratified_z(a, b)
        row[key] = {
            "hf": sum(map(sum, a)) / sum(map(len, a)),
            "vllm": sum(map(sum, b)) / sum(map(len, b)),
            "difference": difference,
            "standard_error": standard_error,
            "z": z,
            "p": two_sided_p(z),
        }
    for key in ("length", "reward"):
        a = [round(v, 6) for p in hf for v in p[key]]
        b = [round(v, 6) for p in vllm for v in p[key]]
        statistic, dof, p = chi_square_homogeneity(a, b)
        row[f"{key}_distribution"] = {"chi_square": statistic, "dof": dof, "p": p}
    return row


def p_values(row):
    return [value["p"] for value in row.values() if isinstance(value, dict) and "p" in value]


# --------------------------------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------------------------------


def train_in_segments(args, every, out):
    """Step 1: the run, every `every` steps resumed from its own checkpoint; returns {step: weights
    file} with step 0 = the initial model. Weights kept by an earlier call are reused only if they
    come from a run with the same settings."""
    snapshots = os.path.join(out, "weights")
    os.makedirs(snapshots, exist_ok=True)
    settings = json.dumps(dataclasses.asdict(args), sort_keys=True, default=str)
    settings_file = os.path.join(snapshots, "settings.json")
    if os.path.exists(settings_file):
        with open(settings_file) as f:
            if f.read() != settings:
                sys.exit(f"{snapshots} holds another run's weights; use a new --output-dir")
    with open(settings_file, "w") as f:
        f.write(settings)
    states = {0: os.path.join(grpo.policy_path(args, 0, 1), "model.safetensors")}
    ends = sorted(set(range(every, args.total_steps, every)) | {args.total_steps})
    for end in ends:
        kept = os.path.join(snapshots, f"step_{end:04d}.safetensors")
        if not os.path.exists(kept):
            grpo.train(dataclasses.replace(args, total_steps=end))
            shutil.copyfile(os.path.join(args.output_dir, "checkpoint", "model.safetensors"), kept)
        states[end] = kept
    return states


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="the training run's seed")
    parser.add_argument("--output-dir", default="runs/engine_pairs")
    parser.add_argument("--every", type=int, default=1, help="keep the weights every N steps")
    parser.add_argument(
        "--prompts", type=int, default=64, help="copy prompts (the validation draw)"
    )
    parser.add_argument("--samples", type=int, default=32, help="samples per prompt and engine")
    parser.add_argument("--table-every", type=int, default=10, help="table rows every N steps")
    # grpo.py flags for the run come after "--"
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    cli = parser.parse_args(argv[:split])
    cli.extra = argv[split + 1 :]
    out = os.path.abspath(cli.output_dir)
    args = harness.parse_args("grpo.py", grpo.PRESETS, grpo.check_args, ["tiny", *cli.extra])
    args = dataclasses.replace(
        args,
        seed=cli.seed,
        output_dir=os.path.join(out, "run"),
        backend="hf",
        cuda=False,
        val_every=0,
        log_samples_every=0,
        save_every=0,
    )
    torch.set_num_threads(args.torch_threads or torch.get_num_threads())

    # 1. the run's weights after every segment
    t0 = time.time()
    states = train_in_segments(args, cli.every, out)
    print(f"training: {len(states) - 1} segments, {time.time() - t0:.0f} s", flush=True)

    # 2. both engines on every state
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = grpo.policy_path(args, 0, 1)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    # the replay's prompts: the first --prompts of the validation draw (the training run keeps the
    # preset's held-out split)
    task = tasks.load_task(dataclasses.replace(args, val_size=cli.prompts))
    val_examples, reward_fn = task.val, task.reward_fn
    val_examples, val_prompt_ids = tasks.drop_overlong(val_examples, tokenizer, args)
    max_model_len = args.max_prompt_length + args.max_response_length
    engines = {
        name: rollout.make_backend(name, model_path, model, args, tokenizer, max_model_len)
        for name in ("hf", "vllm")
    }
    rows = []
    with open(os.path.join(out, "pairs.jsonl"), "w") as log:
        for step, weights in states.items():
            # tied LM head: the file holds the embedding only
            missing, unexpected = model.load_state_dict(load_file(weights), strict=False)
            assert not unexpected and all("lm_head" in name for name in missing), missing
            per_engine = {}
            for name, engine in engines.items():
                engine.sync_weights(model)
                per_engine[name] = sample_statistics(
                    engine,
                    val_prompt_ids,
                    val_examples,
                    tokenizer,
                    reward_fn,
                    args,
                    cli.samples,
                    seed=1000 * step + 17,
                )
            row = {"step": step, **compare(per_engine["hf"], per_engine["vllm"])}
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            smallest = min(p_values(row))
            print(f"step {step}: smallest p {smallest:.3f}", flush=True)
    engines["vllm"].close()

    # 3. the table and the summary
    print(markdown_table([r for r in rows if r["step"] % cli.table_every == 0]))
    print(summary(rows, cli))


def markdown_table(rows):
    lines = [
        "| step | EOS rate HF / vLLM (z) | length HF / vLLM (z) | reward HF / vLLM (z) "
        "| off-mode HF / vLLM (z) | chi-square p: lengths, rewards |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        cells = [
            f"{row[k]['hf']:.3f} / {row[k]['vllm']:.3f} ({row[k]['z']:+.2f})" for k in STATISTICS
        ]
        chi = f"{row['length_distribution']['p']:.2f}, {row['reward_distribution']['p']:.2f}"
        lines.append(f"| {row['step']} | " + " | ".join(cells) + f" | {chi} |")
    return "\n".join(lines)


def pooled(rows, key):
    """A systematic difference would show in every state: the mean over states of one statistic's
    difference, its standard error (the states are independent samples) and z."""
    difference = sum(row[key]["difference"] for row in rows) / len(rows)
    standard_error = math.sqrt(sum(row[key]["standard_error"] ** 2 for row in rows)) / len(rows)
    return difference, standard_error, difference / standard_error if standard_error else 0.0


def summary(rows, cli):
    over_states = "; ".join(
        "{} {:+.5f} ± {:.5f} (z {:+.2f})".format(key, *pooled(rows, key)) for key in STATISTICS
    )
    all_p = [p for row in rows for p in p_values(row)]
    below = sum(p < 0.05 for p in all_p)
    largest_z = max(abs(row[k]["z"]) for row in rows for k in STATISTICS)
    # the smallest difference in EOS rate this replay could detect: 3 standard errors at p = 0.5
    detectable = 3 * math.sqrt(2 * 0.25 / (cli.prompts * cli.samples))
    return (
        f"{len(rows)} states x {len(all_p) // len(rows)} tests = {len(all_p)} p-values; "
        f"{below} below 0.05 ({below / len(all_p):.1%}; 5% expected if the engines agree); "
        f"smallest p {min(all_p):.2g} (Bonferroni 0.05 / {len(all_p)} = {0.05 / len(all_p):.2g}); "
        f"largest |z| {largest_z:.2f}; {cli.prompts} prompts x {cli.samples} samples per engine "
        f"and state: an EOS-rate difference of {detectable:.3f} is 3 standard errors\n"
        f"HF - vLLM, mean over the {len(rows)} states: {over_states}"
    )


if __name__ == "__main__":
    main()
