"""Three pieces of the smol_sentiment pipeline on SmolLM2-135M-Instruct, each against how it ran before, in one process.

    .venv/bin/python bench/bench_ppo_cpu.py [--repeats 5]

1. The optimizer step: adam_tf.AdamTF (torch's fused Adam kernel with eps_hat / sqrt(1 - b2^t)) against the explicit
   TF1 formula in six tensor ops per parameter (lerp, mul, addcmul, sqrt, add, addcdiv; AdamTF.step until Nov 2026),
   on the policy's 135M parameters + value head with the same gradients. Also the largest relative difference of the
   parameters after `repeats` steps of each (float rounding only).
2. One PPO micro-step of the preset (16 rollouts x (14 + 20) tokens: ppo_rlhf.PolicyAndValue forward, the LM head's
   logprobs of the 320 response tokens, a loss, backward): the LM-head chunk as logprobs.token_logprobs_and_entropy
   runs it now for a single chunk (not checkpointed) against the same chunk under torch.utils.checkpoint (as it ran
   for any chunk count until Nov 2026: backward recomputes the LM-head product and log-softmax).
3. One reward-model step of rewards.py smol_sentiment (8 labels x 4 samples of the shipped labels, 4-way softmax loss,
   backward, AdamTF step): each query's forward shared by its 4 samples (RewardModel.shared_query_forward, 14 + 4 x 20
   tokens a label) against one forward per left-padded query + sample (4 x 34 tokens a label; until Nov 2026). Also
   the largest difference of the 4-way logits between the two (float rounding only).

Reported: the median seconds of `repeats` timed calls after one warm-up, and the ratio. Run it on idle cores; times
on a shared 2-core machine vary by tens of percent between hours, the ratios much less.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import logprobs  # noqa: E402
import ppo_rlhf  # noqa: E402
import rewards  # noqa: E402
import tasks  # noqa: E402
from adam_tf import AdamTF  # noqa: E402


@torch.no_grad()
def explicit_adam_tf_step(params, state, lr, beta1=0.9, beta2=0.999, eps=1e-5):
    """TF1's update in six ops per parameter: the baseline AdamTF replaced."""
    t = state["t"] = state.get("t", 0) + 1
    for p in params:
        m, v = state.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p)))
        m.lerp_(p.grad, 1 - beta1)
        v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        lr_t = lr * (1 - beta2**t) ** 0.5 / (1 - beta1**t)
        p.addcdiv_(m, v.sqrt().add_(eps), value=-lr_t)


def timed(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def policy_pieces(args, repeats):
    """Pieces 1 and 2 on the policy (its SmolLM2 is freed when this returns)."""
    model = ppo_rlhf.PolicyAndValue(ppo_rlhf.load_policy(tasks.SMOLLM2_PATH, "cpu"))
    lm = model.lm

    # 1. the optimizer step on two copies of the parameters with the same gradients
    params = list(model.parameters())
    copies = [p.detach().clone().requires_grad_() for p in params]
    for p, c in zip(params, copies):
        p.grad = torch.randn_like(p) * 1e-3
        c.grad = p.grad.clone()
    optimizer, state = AdamTF(params, lr=args.lr), {}
    fused_s = timed(optimizer.step, repeats)
    explicit_s = timed(lambda: explicit_adam_tf_step(copies, state, args.lr), repeats)
    rel = max(
        ((p - c).abs().max() / c.abs().max().clamp_min(1e-12)).item()
        for p, c in zip(params, copies)
    )
    model.zero_grad(set_to_none=True)

    # 2. one PPO micro-step of the preset
    micro, context = args.rollout_batch_size // args.nminibatches, args.query_length
    query_responses = torch.randint(
        100, lm.config.vocab_size, (micro, context + args.response_length)
    )
    responses = query_responses[:, context:]
    # a new [PAD] outside the vocabulary, so nothing is banned, as in the preset
    pad = ppo_rlhf.load_tokenizer(tasks.SMOLLM2_PATH).pad_token_id
    banned = ppo_rlhf.banned_vocab_mask(lm.config.vocab_size, pad, "cpu")

    def micro_step(checkpointed):
        hidden, values = model(query_responses, context, pad)
        flat, tokens = hidden.reshape(-1, hidden.shape[-1]), responses.reshape(-1)
        # logprobs._logprob_entropy_chunk's arguments: the head's weight, IEEE fp32 (a CPU)
        chunk_args = (
            lm.get_output_embeddings().weight,
            flat,
            tokens,
            args.temperature,
            banned,
            False,
            "fp32",
        )
        if checkpointed:
            token_logprobs, _ = torch.utils.checkpoint.checkpoint(
                logprobs._logprob_entropy_chunk, *chunk_args, use_reentrant=False
            )
        else:
            token_logprobs, _ = logprobs.token_logprobs_and_entropy(
                flat,
                tokens,
                lm.get_output_embeddings(),
                logprobs.LogprobSettings(
                    temperature=args.temperature,
                    chunk_size=args.logprob_chunk_rows,
                    banned=banned,
                ),
            )
        (token_logprobs.mean() + values.square().mean()).backward()
        model.zero_grad(set_to_none=True)

    single_s = timed(lambda: micro_step(False), repeats)
    checkpointed_s = timed(lambda: micro_step(True), repeats)
    return dict(
        fused_s=fused_s,
        explicit_s=explicit_s,
        rel=rel,
        single_s=single_s,
        checkpointed_s=checkpointed_s,
        n_params=sum(p.numel() for p in params),
        micro=micro,
        tokens=query_responses.shape[1],
        pad=pad,
    )


def reward_model_piece(repeats, pad):
    """Piece 3: one reward-model step of the preset on the shipped labels."""
    rm_args = rewards.PRESETS["smol_sentiment"][1]
    labels = rewards.load_labels(rewards.lexicon_label_path(rm_args, rm_args.base_model))
    reward_model = rewards.RewardModel(ppo_rlhf.load_policy(tasks.SMOLLM2_PATH, "cpu"))
    rm_optimizer = AdamTF([p for p in reward_model.parameters() if p.requires_grad], lr=rm_args.lr)
    indices = list(range(rm_args.batch_size))
    query, samples, best = rewards.label_batch(labels, indices, pad)

    def per_row_logits():  # the rows best_of_4_logits ran until Nov 2026: [pads, query, sample k] for every k
        rows = rewards.left_pad(
            torch.cat([query.repeat_interleave(4, 0), samples.flatten(0, 1)], 1), pad
        )
        return reward_model(rows, rows != pad).view(-1, 4)

    def reward_step(shared):
        logits = (
            reward_model.shared_query_forward(query, samples, pad) if shared else per_row_logits()
        )
        torch.nn.functional.cross_entropy(logits, best).backward()
        rm_optimizer.step()
        rm_optimizer.zero_grad(set_to_none=True)

    with torch.no_grad():
        shared_logits = reward_model.shared_query_forward(query, samples, pad)
        logit_diff = (shared_logits - per_row_logits()).abs().max().item()
    shared_s = timed(lambda: reward_step(True), repeats)
    per_row_s = timed(lambda: reward_step(False), repeats)
    return shared_s, per_row_s, logit_diff


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    repeats = parser.parse_args().repeats
    torch.manual_seed(0)
    args = ppo_rlhf.PRESETS["smol_sentiment"][1]
    policy = policy_pieces(args, repeats)  # one SmolLM2 at a time in memory
    shared_s, per_row_s, logit_diff = reward_model_piece(repeats, policy["pad"])

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {repeats} after a warm-up\n"
    )
    print("| piece | now (s) | before (s) | before / now |")
    print("| --- | --- | --- | --- |")
    print(
        f"| AdamTF step, {policy['n_params'] / 1e6:.1f}M parameters: fused kernel vs six ops | "
        f"{policy['fused_s']:.3f} | {policy['explicit_s']:.3f} | "
        f"{policy['explicit_s'] / policy['fused_s']:.2f} |"
    )
    print(
        f"| PPO micro-step, {policy['micro']} x {policy['tokens']} tokens: single LM-head chunk vs "
        f"checkpointed | {policy['single_s']:.3f} | {policy['checkpointed_s']:.3f} | "
        f"{policy['checkpointed_s'] / policy['single_s']:.2f} |"
    )
    print(
        f"| reward-model step, 8 labels x 4 samples: shared query forward vs one forward per row | {shared_s:.3f} | "
        f"{per_row_s:.3f} | {per_row_s / shared_s:.2f} |"
    )
    print(
        f"\nAdamTF fused vs six ops after {repeats + 1} steps: largest relative parameter difference "
        f"{policy['rel']:.1e}"
    )
    print(
        f"reward-model logits, shared query vs one forward per row: largest difference {logit_diff:.1e}"
    )


if __name__ == "__main__":
    main()
