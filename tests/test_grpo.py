"""grpo.py: rollout parity, chunked logprobs, advantages, every correction preset, pi_old, loss
aggregation, learning, resume, bad input, and a 2-process torchrun run (gloo). One tiny model is
shared by the module (budget: 180 s)."""

import copy
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tests"))  # tests/minibatch_gradient.py

from tolerances import EPS32, assert_float32_close  # noqa: E402
from verl_source import verl_root  # noqa: E402

import corrections  # noqa: E402
import grpo  # noqa: E402
import harness  # noqa: E402
import logprobs  # noqa: E402
import memory  # noqa: E402
import objectives  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
from minibatch_gradient import pi_old_and_ref  # noqa: E402

CPU = torch.device("cpu")
TOL = 1e-4  # max |rollout logprob - trainer recompute| in fp32 (measured ~1e-6)
# int8 rollouts, first steps of the near-uniform random-init tiny model:
# training/rollout_probs_diff_max measured ~1e-4 (fp32 rollouts: < 1e-6)
INT8_MIN_PROBS_DIFF = 3e-5


def _prompts(tokenizer):
    # different lengths: left padding matters
    texts = ["abc=", "hello world=", "x=", "the quick brown fox="]
    return [tokenizer(t)["input_ids"] for t in texts]


def _tiny_cpu():
    """The tiny preset pinned to the CPU (--no-cuda): these tests need exact fp32 CPU numerics even
    on a GPU machine."""
    return dataclasses.replace(grpo.PRESETS["tiny"][1], cuda=False)


def _small_args(**kw):
    base = dict(
        train_batch_size=4,
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=4,
        rollout_n=4,
        max_response_length=8,
        lr=1e-3,
        val_every=0,
        save_every=0,
    )
    base.update(kw)
    return dataclasses.replace(_tiny_cpu(), **base)


def unpadded_logprobs(model, prompt, response, temperature):
    """Reference: one unpadded fp32 forward per sequence, full log_softmax (no position/mask
    conventions involved)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[
        :, 0
    ]


# ------------------------------------------------------------------------------------------------ rollouts / parity


def test_chunked_logprobs_and_entropy_match_full_softmax(tiny):
    """The chunked, checkpointed routine equals a plain (B, T, V) log_softmax: values, entropy and
    gradients, each within 128 eps32 of its tensor's largest entry (tests/tolerances.py: sums of up
    to 128 terms, the hidden size, in another order)."""
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    prompts = _prompts(tokenizer)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 50, (k,), generator=g).tolist() for k in (1, 5, 3, 6)]
    batch = rollout.make_batch(
        prompts, responses, [[0.0] * len(r) for r in responses], tokenizer.pad_token_id, 6, CPU
    )
    T, weights = 0.8, torch.randn(4, 6, generator=g)
    mask = batch["response_mask"]

    def naive():
        logits = (
            model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            ).logits[:, -7:-1]
            / T
        )
        logp = torch.log_softmax(logits, -1)
        return logp.gather(-1, batch["responses"][..., None])[..., 0] * mask, -(
            logp.exp() * logp
        ).sum(-1) * mask

    ref_lp, ref_ent = naive()
    (ref_lp * weights + ref_ent).sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    for chunk in (1, 4, 1024):
        model.zero_grad()
        lp, ent = logprobs.response_logprobs(
            model,
            batch,
            logprobs.LogprobSettings(temperature=T, chunk_size=chunk),
            entropy_grad=True,
        )
        assert_float32_close(lp, ref_lp, terms=128, what="logprobs")
        assert_float32_close(ent, ref_ent, terms=128, what="entropy")
        (lp * weights + ent).sum().backward()
        for (name, p), r in zip(model.named_parameters(), ref_grads):
            assert_float32_close(p.grad, r, terms=128, what=name)


def test_logprobs_under_bf16_autocast_use_an_fp32_lm_head(tiny):
    """Under bf16 autocast the LM head, log-softmax and entropy run in float32
    (logprobs.fp32_project).

    The tiny model's LM head (tied to the embedding) is scaled by 40 so its logits reach 117 in
    magnitude, like gpt2/Qwen logits. Measured on this batch (torch 2.13 CPU, bf16 autocast,
    reference = a float64 head on the same hidden states): a bf16 LM head (before this change) was
    off by 0.20 max / 0.11 mean nats per token; the float32 head is off by 4e-5. Against a whole
    float32 forward the difference is 4e-3, the backbone's own bf16 rounding (which the bf16 rollout
    engine shares)."""
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.weight.mul_(40.0)
    g = torch.Generator().manual_seed(0)
    prompts = _prompts(tokenizer)
    responses = [torch.randint(3, 50, (k,), generator=g).tolist() for k in (8, 5, 3, 8)]
    batch = rollout.make_batch(
        prompts, responses, [[0.0] * len(r) for r in responses], tokenizer.pad_token_id, 8, CPU
    )
    mask, tokens = batch["response_mask"].bool(), batch["responses"][..., None]
    with torch.no_grad():
        full_fp32, _ = logprobs.response_logprobs(model, batch, logprobs.LogprobSettings())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours, entropy = logprobs.response_logprobs(
                model, batch, logprobs.LogprobSettings(chunk_size=5)
            )
            hidden = model.get_decoder()(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            ).last_hidden_state[:, -9:-1]
            # what compute_logprobs computed before: the head under autocast
            bf16_logits = head(hidden)
        assert bf16_logits.dtype == torch.bfloat16 and bf16_logits.abs().max() > 100
        exact = torch.log_softmax(hidden.double() @ head.weight.double().T, -1)
        before = torch.log_softmax(bf16_logits.double(), -1).gather(-1, tokens)[..., 0]
    assert ours.dtype == torch.float32 and entropy.dtype == torch.float32
    assert (before - exact.gather(-1, tokens)[..., 0])[mask].abs().max() > 0.1  # the effect is real
    assert (ours.double() - exact.gather(-1, tokens)[..., 0])[mask].abs().max() < 1e-3
    exact_entropy = -(exact.exp() * exact).sum(-1)
    assert (entropy.double() - exact_entropy)[mask].abs().max() < 1e-3
    # the rest: the bf16 backbone (measured 4e-3)
    assert (ours - full_fp32)[mask].abs().max() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [True, False])
def test_cuda_logprobs_use_an_fp32_lm_head(tiny, bf16):
    """On CUDA: bf16 autocast (--precision bf16) runs the LM head's product in TF32 and the log-softmax in
    fp32: against a float64 head on the same hidden states (logits ~100) its error is <= 1/4 of
    bf16-rounded logits' (emulated on CPU:
    0.016 vs 0.20 nats; docs/logprobs.md#lm-head-precision); --precision fp32 matches the CPU fp32 forward to ~1e-5."""
    model, tokenizer = tiny
    cpu_model = copy.deepcopy(model)
    with torch.no_grad():
        cpu_model.get_output_embeddings().weight.mul_(40.0)
    cuda_model = copy.deepcopy(cpu_model).cuda()
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 50, (k,), generator=g).tolist() for k in (8, 5, 3, 8)]
    batch = rollout.make_batch(
        _prompts(tokenizer),
        responses,
        [[0.0] * len(r) for r in responses],
        tokenizer.pad_token_id,
        8,
        CPU,
    )
    mask, tokens = batch["response_mask"].bool(), batch["responses"][..., None]
    with torch.no_grad():
        cuda_batch = {k: v.cuda() for k, v in batch.items()}
        ours, _ = logprobs.response_logprobs(
            cuda_model,
            cuda_batch,
            logprobs.LogprobSettings(temperature=1.0, precision="bf16" if bf16 else "fp32"),
        )
        if bf16:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                hidden = cuda_model.get_decoder()(
                    input_ids=cuda_batch["input_ids"],
                    attention_mask=cuda_batch["attention_mask"],
                    position_ids=cuda_batch["position_ids"],
                ).last_hidden_state[:, -9:-1]
            head = cuda_model.get_output_embeddings().weight
            exact_logits = hidden.double() @ head.double().T
            reference = torch.log_softmax(exact_logits, -1).gather(-1, tokens.cuda())[..., 0]
            bf16_logits = torch.log_softmax(exact_logits.float().bfloat16().double(), -1).gather(
                -1, tokens.cuda()
            )
            tol = (bf16_logits[..., 0] - reference)[mask.cuda()].abs().max().item() / 4
        else:
            reference, _ = logprobs.response_logprobs(cpu_model, batch, logprobs.LogprobSettings())
            tol = 1e-4
    assert ours.dtype == torch.float32
    assert (ours.cpu().double() - reference.cpu().double())[mask].abs().max() < tol


# ------------------------------------------------------------------------------------------------ advantages


def _reference_advantages(scores, ids, eps=1e-6, norm=True):
    """verl's compute_grpo_outcome_advantage, loop form."""
    out = []
    for s, i in zip(scores, ids):
        group = [x for x, j in zip(scores, ids) if j == i]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = (sum((x - mean) ** 2 for x in group) / (len(group) - 1)) ** 0.5
        out.append((s - mean) / (std + eps) if norm else s - mean)
    return out


def test_grpo_advantages_hand_computed():
    # groups: 7 -> {1, 0, 0.5} interleaved, 42 -> singleton, 9 -> all equal, -3 -> {1, 0}
    scores = [1.0, 0.3, 0.0, 0.3, 0.5, 1.0, 0.3, 0.0]
    ids = [7, 9, 7, 9, 7, -3, 42, -3]
    adv = objectives.grpo_advantages(torch.tensor(scores), torch.tensor(ids))
    # group 7: mean 0.5, unbiased std 0.5 -> (1, -1, 0); group -3: mean 0.5, std sqrt(0.5)
    s2 = 0.5**0.5
    expected = [
        0.5 / (0.5 + 1e-6),
        0.0,
        -0.5 / (0.5 + 1e-6),
        0.0,
        0.0,
        0.5 / (s2 + 1e-6),
        0.3 / (1 + 1e-6),
        -0.5 / (s2 + 1e-6),
    ]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    assert torch.allclose(adv, torch.tensor(_reference_advantages(scores, ids)), atol=1e-6)
    # Dr.GRPO
    dr = objectives.grpo_advantages(torch.tensor(scores), torch.tensor(ids), norm_by_std=False)
    assert torch.allclose(dr, torch.tensor([0.5, 0.0, -0.5, 0.0, 0.0, 0.5, 0.3, -0.5]), atol=1e-6)
    g = torch.Generator().manual_seed(1)
    many_scores = torch.rand(200, generator=g)
    many_ids = torch.randint(-1000, 1000, (200,), generator=g) * 37
    assert torch.allclose(
        objectives.grpo_advantages(many_scores, many_ids),
        torch.tensor(_reference_advantages(many_scores.tolist(), many_ids.tolist())),
        atol=1e-5,
    )


# ------------------------------------------------------------------------------------------------ the update


def _rollout(model, tokenizer, args, seed):
    """(responses, batch): one HF-engine rollout of _prompts at T 1, rollout_n samples each, as
    the trainer's tensors."""
    backend = rollout.make_backend("hf", None, model, args, tokenizer)
    prompts = _prompts(tokenizer)
    responses, logprobs, _ = backend.generate(
        prompts, args.rollout_n, args.max_response_length, 1.0, seed=seed
    )
    batch = rollout.make_batch(
        [p for p in prompts for _ in range(args.rollout_n)],
        responses,
        logprobs,
        tokenizer.pad_token_id,
        args.max_response_length,
        CPU,
    )
    return responses, batch


@pytest.fixture(scope="module")
def rollout_batch(tiny):
    """One rollout of a tiny GRPO step from an int8 rollout copy (so pi_rollout != pi_old), with
    advantages."""
    model, tokenizer = tiny
    args = _small_args(mismatch="int8")
    responses, batch = _rollout(model, tokenizer, args, seed=11)
    # any non-constant score
    scores = torch.tensor([len(r) / args.max_response_length for r in responses])
    group_ids = torch.arange(len(responses) // args.rollout_n).repeat_interleave(args.rollout_n)
    batch["advantages"] = objectives.grpo_advantages(scores, group_ids)
    return args, batch


@torch.no_grad()
def _response_logits(model, batch, args):
    """(N, V) logits / T at the positions that predict the N valid response tokens, from a plain
    forward with the whole LM head (no chunks, no kept set)."""
    hidden = model.get_decoder()(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).last_hidden_state[:, -args.max_response_length - 1 : -1]
    mask = batch["response_mask"].bool()
    return model.get_output_embeddings()(hidden)[mask] / args.temperature


@pytest.mark.parametrize(
    "flags", [{"top_p": 0.8}, {"top_k": 5}, {"min_p": 0.05}, {"top_k": 5, "top_p": 0.8}]
)
def test_replay_scores_each_sampled_token_as_the_truncated_sampler_did(tiny, flags):
    """--top-p 0.8 / --top-k 5 / --min-p 0.05 on the HF engine: with --replay-sampling-mask (the
    default) the trainer's fp32 logprobs of the sampled tokens equal the sampler's (generate's
    cached forward, one token at a time) within 128 eps32 of the largest |logprob|, so the ratio at
    the first minibatch is 1 to rounding; without it the trainer scores them over the whole
    vocabulary and the per-token log-ratio is log S, S the mass of the kept set (the trainer's own
    full softmax over the sampler's rules), never > 0 (to the same rounding)."""
    model, tokenizer = tiny
    args = _small_args(**flags)
    _, batch = _rollout(model, tokenizer, args, seed=5)
    mask = batch["response_mask"].bool()
    replayed = grpo.batch_logprobs(model, batch, args, grpo.logprob_settings(args, model))[
        "logprobs"
    ]
    assert_float32_close(replayed[mask], batch["rollout_logprobs"][mask], terms=128)
    full_vocabulary = dataclasses.replace(args, replay_sampling_mask=False)
    full = grpo.batch_logprobs(
        model, batch, full_vocabulary, grpo.logprob_settings(full_vocabulary, model)
    )["logprobs"]
    log_ratio = (full - batch["rollout_logprobs"])[mask]
    assert (log_ratio <= 128 * EPS32 * batch["rollout_logprobs"][mask].abs().max()).all()
    # (min-p 0.05 keeps every token of the tiny random model's flat distributions: S = 1 there)
    assert "min_p" in flags or (log_ratio < -1e-3).any()
    # log S by hand: the full softmax's mass on the kept set, token by token
    logits = _response_logits(model, batch, args)
    kept = logprobs.truncation_mask(logits, *rollout.sampling_truncation(args, "hf"))
    log_kept_mass = torch.log((torch.softmax(logits, -1) * kept).sum(-1))
    assert torch.allclose(log_ratio, log_kept_mass, atol=1e-5)


def test_replay_keeps_the_sampled_token_for_every_model_that_scores_it(tiny):
    """With replay each model scores a sampled token over the kept set recomputed from its own
    logits plus that token (the sampler kept it). A reference model other than the sampler (a
    re-initialised copy) leaves some sampled tokens out of its own top-5: their pi_ref is then
    over K_ref + the token, by hand, finite, and the KL loss's update is finite (without the
    token kept, log 0 = -inf: `grpo.py tiny --top-k 5 --kl-loss-coef 0.01` stopped at step 3 on
    a NaN loss). The pass reports which tokens its set left out: those by hand for the
    reference, none for the sampler's own weights (training/sampled_outside_kept_set 0)."""
    model, tokenizer = tiny
    args = _small_args(top_k=5, kl_loss_coef=0.01)
    responses, batch = _rollout(model, tokenizer, args, seed=5)
    scores = torch.tensor([len(r) / args.max_response_length for r in responses])
    group_ids = torch.arange(len(responses) // args.rollout_n).repeat_interleave(args.rollout_n)
    batch["advantages"] = objectives.grpo_advantages(scores, group_ids)
    ref_model = copy.deepcopy(model)
    torch.manual_seed(3)
    ref_model.apply(ref_model._init_weights)
    ref_stats = grpo.batch_logprobs(
        ref_model, batch, args, grpo.logprob_settings(args, model), left_out_of_kept_set=True
    )
    ref_logprobs = ref_stats["logprobs"]
    mask = batch["response_mask"].bool()
    assert torch.isfinite(ref_logprobs).all()
    # by hand: the reference's full softmax, its own top-5 set, the sampled token added
    logits = _response_logits(ref_model, batch, args)
    tokens = batch["responses"][mask]
    rows = torch.arange(tokens.shape[0])
    kept = logprobs.truncation_mask(logits, *rollout.sampling_truncation(args, "hf"))
    left_out = ~kept[rows, tokens]
    # the case this test is about happens in this batch
    assert left_out.sum() >= 3
    assert torch.equal(ref_stats["left_out_of_kept_set"][mask], left_out.float())
    assert (ref_stats["left_out_of_kept_set"][~mask] == 0).all()
    kept[rows, tokens] = True
    by_hand = torch.log_softmax(logits.masked_fill(~kept, -math.inf), -1)[rows, tokens]
    assert_float32_close(ref_logprobs[mask], by_hand, terms=128, what="pi_ref over the kept set")
    _, metrics = _run_update(model, args, batch, "disabled", ref_model=ref_model)
    assert all(math.isfinite(value) for value in metrics.values()), metrics
    assert metrics["actor/kl_loss"] > 0
    assert metrics["training/sampled_outside_kept_set"] == 0


def _run_update(model, args, batch, preset, ref_model=None):
    model = copy.deepcopy(model)
    batch = dict(batch)
    correction = corrections.RolloutCorrection.from_name(preset)
    corr_metrics = pi_old_and_ref(model, ref_model, batch, args, correction)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    metrics = grpo.update_policy(
        model, optimizer, batch, args, correction, grpo.logprob_settings(args, model)
    )
    return model, {**corr_metrics, **metrics}


@pytest.mark.parametrize("preset", corrections.PRESETS)
def test_every_correction_preset_runs_a_step(tiny, rollout_batch, preset):
    model, _ = tiny
    args, batch = rollout_batch
    new_model, metrics = _run_update(model, args, batch, preset)
    # pi_old's entropy comes from the recompute, which bypass mode skips (verl logs none there)
    bypass = corrections.RolloutCorrection.from_name(preset).bypass_mode
    assert ("actor/entropy" in metrics) != bypass
    for key in (
        "actor/pg_loss",
        "actor/entropy_loss",
        "actor/grad_norm",
        "rollout_corr/kl",
        "rollout_corr/chi2_token",
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_mean",
    ):
        assert key in metrics, key
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    # int8 rollouts really differ from the trainer
    assert metrics["training/rollout_probs_diff_max"] > 0
    # (a rejection preset may mask every token of this small batch)
    if metrics["actor/grad_norm"] > 0:
        assert any(
            not torch.equal(p, q) for p, q in zip(model.parameters(), new_model.parameters())
        )


def test_decoupled_uses_recompute_and_bypass_uses_rollout_as_pi_old(
    tiny, rollout_batch, monkeypatch
):
    """The anchor of the clipped surrogate in update_policy: the trainer's recompute (decoupled) or
    pi_rollout (bypass); and in decoupled mode the IS weights multiply the clipped term."""
    model, _ = tiny
    args, batch = rollout_batch
    seen = []
    real = objectives.ppo_clip_token_loss

    def spy(logprobs, old_logprobs, *a, **kw):
        seen.append((logprobs.detach().clone(), old_logprobs.detach().clone()))
        return real(logprobs, old_logprobs, *a, **kw)

    # grpo_loss calls the default loss by name (objectives.ppo_clip_token_loss)
    monkeypatch.setattr(objectives, "ppo_clip_token_loss", spy)
    _run_update(model, args, batch, "decoupled_token_is")
    decoupled, seen[:] = list(seen), []
    _run_update(model, args, batch, "bypass_ppo_clip")
    bypass = list(seen)
    assert decoupled and bypass
    mask = batch["response_mask"].bool()
    rollout = batch["rollout_logprobs"]
    # Decoupled: pi_old = the trainer's recompute, which under int8 rollouts differs from
    # pi_rollout; in the first microbatch the current logprobs equal pi_old exactly (nothing has
    # been updated yet).
    current, old = decoupled[0]
    m = mask[: old.shape[0]]
    assert torch.equal(old[m], current[m])
    assert (old - rollout[: old.shape[0]]).abs()[m].max() > 1e-3
    # Bypass: pi_old = pi_rollout, no recompute.
    current, old = bypass[0]
    assert torch.equal(old, rollout[: old.shape[0]])
    assert (current - old).abs()[m].max() > 1e-3


def test_loss_aggregation_modes_and_kl_loss(tiny, rollout_batch):
    model, _ = tiny
    args, batch = rollout_batch
    ref = copy.deepcopy(model)
    with torch.no_grad():  # a reference that differs from the policy, so the KL term is non-zero
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    losses = {}
    for mode in objectives.AGG_MODES:
        a = dataclasses.replace(
            args, loss_agg_mode=mode, kl_loss_coef=0.1, kl_loss_type="k3", entropy_coeff=0.01
        )
        _, metrics = _run_update(model, a, batch, "disabled", ref_model=ref)
        assert metrics["actor/kl_loss"] > 0
        losses[mode] = metrics["actor/pg_loss"]
    # the modes aggregate differently
    assert len({round(v, 8) for v in losses.values()}) == len(losses), losses


def test_entropy_and_kl_terms_use_the_corrected_mask_in_decoupled_mode(tiny, rollout_batch):
    """verl replaces response_mask with the RS/veto-corrected mask before the update, and its
    ppo_loss (workers/utils/losses.py) aggregates the entropy and the KL terms over that same mask.
    lr = 0 keeps the model fixed, so the logged terms can be recomputed here with the corrected
    mask, and differ from the plain one."""
    model, _ = tiny
    args, batch = rollout_batch
    args = dataclasses.replace(
        args, lr=0.0, entropy_coeff=0.01, kl_loss_coef=0.1, kl_loss_type="k3"
    )
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    batch = dict(batch)
    pi_old_and_ref(model, ref, batch, args, corrections.RolloutCorrection.from_name("disabled"))
    corrected = batch["response_mask"].clone()
    corrected[::2] = 0  # as if RS had rejected every other sequence
    corrected[1::4, 0] = 0  # and some single tokens
    batch["loss_mask"] = corrected
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    disabled = corrections.RolloutCorrection.from_name("disabled")
    metrics = grpo.update_policy(
        copy.deepcopy(model), optimizer, batch, args, disabled, grpo.logprob_settings(args, model)
    )
    new_logprobs, entropy = logprobs.response_logprobs(
        model.eval(),
        batch,
        logprobs.LogprobSettings(temperature=args.temperature, chunk_size=args.logprob_chunk_size),
    )
    kld = objectives.kl_penalty(new_logprobs, batch["ref_logprobs"], "k3")
    # the logged terms are whole-minibatch losses (global normalisation)
    _, mini = grpo.local_batch_sizes(args, 1)
    expected = {"actor/entropy_loss": [], "actor/kl_loss": [], "plain_entropy": []}
    for start in range(0, new_logprobs.shape[0], mini):
        rows = slice(start, start + mini)
        expected["actor/entropy_loss"].append(
            objectives.agg_loss(entropy[rows], corrected[rows]).item()
        )
        expected["actor/kl_loss"].append(objectives.agg_loss(kld[rows], corrected[rows]).item())
        expected["plain_entropy"].append(
            objectives.agg_loss(entropy[rows], batch["response_mask"][rows]).item()
        )
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert metrics["actor/entropy_loss"] == pytest.approx(
        mean(expected["actor/entropy_loss"]), rel=1e-5
    )
    assert metrics["actor/kl_loss"] == pytest.approx(mean(expected["actor/kl_loss"]), rel=1e-5)
    # the mask made a difference
    assert abs(metrics["actor/entropy_loss"] - mean(expected["plain_entropy"])) > 1e-4


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_actor_entropy_is_pi_olds_over_the_whole_batch_before_the_update(tiny, rollout_batch, mode):
    """verl 0.9.1 logs two entropies (ray_trainer.py after compute_old_log_prob; losses.py):
    actor/entropy, pi_old's over the whole batch's response mask with loss_agg_mode, before any
    update; actor/entropy_loss, the update's. With two minibatches and lr > 0 the second
    minibatch's forward sees updated weights, so the two differ."""
    model, _ = tiny
    args, batch = rollout_batch
    args = dataclasses.replace(args, loss_agg_mode=mode, lr=1e-2)
    _, entropy = logprobs.response_logprobs(
        model.eval(),
        batch,
        logprobs.LogprobSettings(temperature=args.temperature, chunk_size=args.logprob_chunk_size),
    )
    by_hand = objectives.agg_loss(entropy, batch["response_mask"], mode).item()
    _, metrics = _run_update(model, args, batch, "disabled")
    assert metrics["actor/entropy"] == pytest.approx(by_hand, rel=1e-6)
    assert abs(metrics["actor/entropy_loss"] - by_hand) > 1e-5


def test_verl_source_uses_one_corrected_mask_for_every_loss_term():
    """What the test above reproduces, read from verl 0.9.1's source:
    compute_rollout_correction_and_add_to_batch overwrites batch["response_mask"] with the RS mask,
    and ppo_loss passes that one response_mask to the policy loss, the entropy agg_loss and the KL
    agg_loss."""
    import ast

    root = verl_root()
    if root is None:
        pytest.skip("no verl source (scripts/setup_cpu.sh unpacks it)")

    def function(relpath, name):
        tree = ast.parse((root / relpath).read_text())
        return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)

    add = function(
        "trainer/ppo/rollout_corr_helper.py", "compute_rollout_correction_and_add_to_batch"
    )
    targets = [
        ast.unparse(t) for n in ast.walk(add) if isinstance(n, ast.Assign) for t in n.targets
    ]
    assert "batch.batch['response_mask']" in targets
    loss = function("workers/utils/losses.py", "ppo_loss")
    masks = [
        (ast.unparse(call.func), ast.unparse(kw.value))
        for call in ast.walk(loss)
        if isinstance(call, ast.Call)
        for kw in call.keywords
        if kw.arg in ("loss_mask", "response_mask")
    ]
    assert [f for f, _ in masks] == ["policy_loss_fn", "agg_loss", "agg_loss"]  # pg, entropy, kl
    assert {m for _, m in masks} == {"response_mask"}


def _verl_lr_schedules():
    """verl 0.9.1's get_constant_schedule_with_warmup / get_cosine_schedule_with_warmup, parsed from
    its source (importing verl would pull ray), or None if verl is not installed."""
    import ast
    import math

    root = verl_root()
    if root is None:
        return None
    path = root / "utils" / "torch_functional.py"
    names = {"get_constant_schedule_with_warmup", "get_cosine_schedule_with_warmup"}
    body = [
        n
        for n in ast.parse(path.read_text()).body
        if isinstance(n, ast.FunctionDef) and n.name in names
    ]
    ns = {
        "math": math,
        "LambdaLR": torch.optim.lr_scheduler.LambdaLR,
        "Optimizer": torch.optim.Optimizer,
    }
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    return ns


@pytest.mark.parametrize(
    "kw",
    [
        dict(lr_warmup_steps=3),
        dict(lr_warmup_steps_ratio=0.25),
        dict(lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.1),
        dict(lr_scheduler_type="cosine"),
        dict(lr_warmup_steps_ratio=0.1, lr_scheduler_type="cosine", num_cycles=1.0),
    ],
)
def test_lr_schedule_matches_verl(kw):
    verl = _verl_lr_schedules()
    if verl is None:
        pytest.skip("verl not installed (scripts/setup_cpu.sh installs it)")
    args = dataclasses.replace(grpo.PRESETS["tiny"][1], total_steps=12, lr=0.5, **kw)
    warmup = (
        args.lr_warmup_steps
        if args.lr_warmup_steps > 0
        else int(args.lr_warmup_steps_ratio * args.total_steps)
    )
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.lr)
    if args.lr_scheduler_type == "constant":
        scheduler = verl["get_constant_schedule_with_warmup"](optimizer, warmup)
    else:
        scheduler = verl["get_cosine_schedule_with_warmup"](
            optimizer, warmup, args.total_steps, args.min_lr_ratio, args.num_cycles
        )
    theirs = []
    # verl: one scheduler.step() after each training step's updates
    for _ in range(args.total_steps):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    ours = [args.lr * grpo.lr_factor(step, args) for step in range(args.total_steps)]
    assert ours == pytest.approx(theirs, abs=1e-12)
    if warmup:
        assert ours[0] == 0.0 and ours[warmup] == args.lr  # the first update runs at lr 0


def test_cli_bad_flag_is_one_line_exit_2_before_any_model_loads(tmp_path):
    out = tmp_path / "bad"
    proc = subprocess.run(
        [sys.executable, "grpo.py", "tiny", "--output-dir", str(out), "--loss-agg-mode", "mean"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "grpo.py: error: --loss-agg-mode must be one of "
        + ", ".join(objectives.AGG_MODES)
        + ", got 'mean'"
    ]
    assert not out.exists()  # nothing was built or loaded


def _relative_difference(a, b):
    """|a - b| / |b|: two float32 gradients of the same minibatch, summed in another order (other
    micro-batches, ranks), agree to a few eps32 of their norm; the invariance tests allow 64
    (7.6e-6), far below what a wrong normalisation gives (0.118 and 0.875 measured)."""
    return ((a - b).norm() / b.norm()).item()


# the invariance bound of the minibatch-gradient tests below, relative to the gradient's norm
INVARIANCE_BOUND = 64 * EPS32


@pytest.mark.parametrize("mode", objectives.AGG_MODES)
def test_one_minibatch_gradient_does_not_depend_on_the_micro_batch_size(mode):
    """verl's global normalisation: the same minibatch (64 sequences of 1..8 tokens) gives the same
    gradient with micro-batch 8 or 64. Measured before it (each micro-batch averaged on its own,
    then weighted by its share of the sequences): token-mean 0.118 and token-sum 0.875 relative
    difference; now ~2e-7 (float32 summation order), within INVARIANCE_BOUND (64 eps32 of the
    norm)."""
    import minibatch_gradient

    a, b = (
        minibatch_gradient.minibatch_gradient(8, mode),
        minibatch_gradient.minibatch_gradient(64, mode),
    )
    assert b.norm() > 0 and _relative_difference(a, b) < INVARIANCE_BOUND


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_micro_batches_give_the_row_micro_batches_gradient(mode):
    """--use-dynamic-bsz: the minibatch of 64 sequences (3 to 13 real tokens each) cut into groups
    of at most 40 tokens (memory.token_budget_micro_batches: 15 groups of 4 or 5 rows, in another
    order than the batch's) gives micro-batch 8's gradient within INVARIANCE_BOUND, packed both
    ways; and the padded layout (--no-use-remove-padding) gives it too."""
    import minibatch_gradient

    rows = minibatch_gradient.minibatch_gradient(8, mode)
    budget = minibatch_gradient.minibatch_gradient(
        8, mode, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40
    )
    padded = minibatch_gradient.minibatch_gradient(8, mode, use_remove_padding=False)
    assert rows.norm() > 0
    assert _relative_difference(budget, rows) < INVARIANCE_BOUND
    assert _relative_difference(padded, rows) < INVARIANCE_BOUND


@pytest.mark.parametrize(
    "policy_loss, mode",
    [
        ("gspo", "token-mean"),
        ("cispo", "token-mean"),
        ("gpg", "token-mean"),
        ("sapo", "seq-mean-token-mean"),
        ("dppo_tv", "token-mean"),
        ("dppo_kl", "seq-mean-token-mean"),
        ("dro", "token-mean"),
        ("opsm", "token-mean"),
    ],
)
def test_the_other_policy_losses_are_micro_batch_invariant_too(policy_loss, mode):
    """GSPO's ratio is per sequence and a sequence never spans two micro-batches; CISPO, GPG, SAPO,
    DPPO and DRO are per token, DeepSeek-V3.2's off-policy mask ("opsm", over PPO-clip) per
    sequence: micro-batch 8 and 64 give the same minibatch gradient (SAPO with the only aggregation
    it allows)."""
    import minibatch_gradient

    settings = {"policy_loss": policy_loss}
    if policy_loss == "opsm":  # the fixed batch's rollout logprobs are 0.05 nats off
        settings = {"off_policy_mask_threshold": 0.01}
    a, b = (
        minibatch_gradient.minibatch_gradient(8, mode, **settings),
        minibatch_gradient.minibatch_gradient(64, mode, **settings),
    )
    assert b.norm() > 0 and _relative_difference(a, b) < INVARIANCE_BOUND


def test_one_minibatch_gradient_is_the_same_on_two_ranks_as_on_one(tmp_path):
    """2 gloo processes with 32 sequences and micro-batch 8 each == 1 process with all 64 at
    micro-batch 64 (the global token count is all-reduced, the loss multiplied by the world size,
    the gradients averaged)."""
    import minibatch_gradient

    modes = ["token-mean", "seq-mean-token-mean"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(ROOT, "tests", "minibatch_gradient.py"),
        str(tmp_path / "grads.pt"),
        "8",
        *modes,
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two_ranks = torch.load(tmp_path / "grads.pt")
    for mode in modes:
        assert (
            _relative_difference(two_ranks[mode], minibatch_gradient.minibatch_gradient(64, mode))
            < INVARIANCE_BOUND
        ), mode


# ------------------------------------------------------------------------------------------------ end to end


def _read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_tiny_run_with_truncated_sampling_and_a_kl_to_the_reference_is_finite(tmp_path):
    """`grpo.py tiny --top-k 5 --kl-loss-coef 0.01` stopped on a NaN loss at step 3 while a kept
    set recomputed from the reference's logits could leave out the sampled token (log 0); its
    first steps now run, and the HF sampler's kept sets are the trainer's in every step
    (training/sampled_outside_kept_set 0)."""
    args = dataclasses.replace(
        _tiny_cpu(),
        output_dir=str(tmp_path),
        total_steps=5,
        val_every=0,
        save_every=0,
        top_k=5,
        kl_loss_coef=0.01,
    )
    rows = _read_metrics(grpo.train(args))
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    assert all(row["training/sampled_outside_kept_set"] == 0 for row in rows)
    assert all(row["actor/kl_loss"] > 0 for row in rows[2:])


def test_tiny_run_learns(tmp_path):
    args = dataclasses.replace(
        _tiny_cpu(), output_dir=str(tmp_path), total_steps=24, val_every=12, save_every=0
    )
    val0, *rows = _read_metrics(grpo.train(args))
    assert val0["step"] == 0 and set(val0) == {
        "step",
        "val/accuracy",
        "val/score_mean",
        "timing/validate",
    }
    # the tiny preset's policy is the GPT-2-architecture tiny model (--tiny-arch gpt2)
    with open(tmp_path / "tiny_model" / "config.json") as f:
        assert json.load(f)["model_type"] == "gpt2"
    rewards_ = [r["reward/mean"] for r in rows]
    first, last = sum(rewards_[:4]) / 4, sum(rewards_[-4:]) / 4
    print(f"tiny: first-4 reward {first:.3f}, last-4 {last:.3f}")
    assert last - first > 0.15, rewards_
    required = [
        "step",
        "reward/mean",
        "response_length/mean",
        "response_length/max",
        "response_length/min",
        "response_length/clip_ratio",
        "timing/generate",
        "timing/logprobs",
        "timing/update",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/entropy_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/lr",
        "rollout_corr/kl",
        "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_mean",
    ]
    for key in required:
        assert key in rows[0], key
    assert (
        "val/accuracy" in rows[11] and "val/accuracy" in rows[-1] and "val/accuracy" not in rows[0]
    )
    assert os.path.isfile(tmp_path / "args.json") and os.path.isfile(
        tmp_path / "checkpoint" / "trainer_state.pt"
    )
    # steps 1, 10, 20: num_log_samples rows each
    samples = _read_metrics(tmp_path / "samples.jsonl")
    assert [r["step"] for r in samples] == [
        s for s in (1, 10, 20) for _ in range(args.num_log_samples)
    ]
    assert set(samples[0]) == {"step", "prompt", "response", "score", "advantage"}
    assert samples[0]["prompt"].endswith("=") and 0.0 <= samples[0]["score"] <= 1.0


def test_rollout_probs_diff_fp32_exact_and_int8_visible(tmp_path):
    """HF backend through grpo.train: with nothing injected pi_rollout is the trainer's own fp32
    distribution (training/rollout_probs_diff_max <= 1e-3 at every step, measured ~1e-7); --mismatch
    int8 samples from a fake- quantised copy, and the difference is clearly non-zero at every
    step."""
    small = dict(
        train_batch_size=16,
        ppo_mini_batch_size=8,
        total_steps=3,
        lr=1e-3,
        val_every=0,
        save_every=0,
    )
    base = dataclasses.replace(_tiny_cpu(), **small)
    fp32 = _read_metrics(grpo.train(dataclasses.replace(base, output_dir=str(tmp_path / "fp32"))))
    int8 = _read_metrics(
        grpo.train(dataclasses.replace(base, output_dir=str(tmp_path / "int8"), mismatch="int8"))
    )
    fp32_diffs = [r["training/rollout_probs_diff_max"] for r in fp32]
    int8_diffs = [r["training/rollout_probs_diff_max"] for r in int8]
    print(f"hf probs_diff_max fp32 {fp32_diffs}, int8 {int8_diffs}")
    assert max(fp32_diffs) <= 1e-3, fp32_diffs
    assert min(int8_diffs) > INT8_MIN_PROBS_DIFF and min(int8_diffs) > 100 * max(fp32_diffs), (
        int8_diffs
    )
    assert all("timing/sync_weights" in r for r in fp32 + int8)


def weights_digest(model):
    """sha256 of every parameter's bytes, in name order: equal iff the weights are bit-identical."""
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_rollout_staleness_samples_with_the_weights_k_updates_old(tmp_path, monkeypatch):
    """--rollout-staleness 2: the rollouts of step t (0-based) come from the weights after update t
    - 2 (the initial ones while t < 2) and validation from the current weights, checked by the
    checksum of the engine's weights at every generate() against the trainer's after every update;
    the trainer/rollout difference is then visible."""
    trainer_after, engine_at = [], []
    real_update, real_generate = grpo.update_policy, rollout.HFBackend.generate

    def update_policy(model, *a, **kw):
        out = real_update(model, *a, **kw)
        trainer_after.append(weights_digest(model))
        return out

    def generate(self, prompt_token_ids, n, max_new_tokens, temperature, seed):
        engine_at.append(weights_digest(self.model))
        return real_generate(self, prompt_token_ids, n, max_new_tokens, temperature, seed)

    monkeypatch.setattr(grpo, "update_policy", update_policy)
    monkeypatch.setattr(rollout.HFBackend, "generate", generate)
    # entropy_coeff > 0: a non-zero gradient at every step even where every reward is 0, so every
    # update counts
    args = _small_args(
        output_dir=str(tmp_path),
        total_steps=5,
        val_every=2,
        rollout_staleness=2,
        entropy_coeff=0.01,
    )
    rows = _read_metrics(grpo.train(args))
    # theta[j]: the weights after j updates (engine_at[0]: validation at 0)
    theta = [engine_at[0]] + trainer_after
    assert len(set(theta)) == 6  # every update changed the weights
    # val(0), rollouts 0-1, val after 2 updates, rollouts 2-3, val after 4, rollout 4, val after 5
    # (the last step)
    assert engine_at == [theta[j] for j in (0, 0, 0, 2, 0, 1, 4, 2, 5)]
    diffs = [r.get("training/rollout_probs_diff_max") for r in rows if r["step"] > 0]
    # step 1: same weights; later steps: stale rollouts
    assert diffs[0] < 1e-5 < min(diffs[1:]), diffs


@pytest.mark.parametrize(
    "setting",
    [
        dict(),
        dict(precision="fp16"),
        dict(dynamic_sampling=True),
        dict(rollout_staleness=2),
        dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40),
    ],
    ids=["fp32", "fp16", "dynamic_sampling", "staleness", "token_budget"],
)
def test_resume_continues_the_same_run(tmp_path, setting):
    """A run stopped after step 2 and resumed gives the same metrics and weights as one run (every
    one packed, --use-remove-padding's default; with --use-dynamic-bsz in micro-batches of at most
    40 tokens, grouped the same way after the resume); with
    --precision fp16 the checkpoint carries the gradient scaler's state (the loss scale); with
    --dynamic-sampling the extra prompts drawn are a function of (seed, step), so they replay; with
    --rollout-staleness 2 the checkpoint carries the two weight versions the engine samples the next
    steps with (the lagged copy's, rollout.RolloutSource.checkpoint_state)."""
    precision = setting.get("precision", "auto")
    small = dict(
        train_batch_size=8,
        ppo_mini_batch_size=4,
        rollout_n=4,
        ppo_micro_batch_size_per_gpu=8,
        val_every=0,
        save_every=2,
        train_size=64,
        **setting,
    )
    base = dataclasses.replace(_tiny_cpu(), **small)
    full = _read_metrics(
        grpo.train(dataclasses.replace(base, output_dir=str(tmp_path / "a"), total_steps=4))
    )
    # "crash" after step 2
    grpo.train(dataclasses.replace(base, output_dir=str(tmp_path / "b"), total_steps=2))
    resumed = _read_metrics(
        grpo.train(dataclasses.replace(base, output_dir=str(tmp_path / "b"), total_steps=4))
    )
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    # step 1 only, as in the uninterrupted run: a resume logs no extra table at its first step
    samples = _read_metrics(tmp_path / "b" / "samples.jsonl")
    assert [r["step"] for r in samples] == [1] * base.num_log_samples
    assert samples == _read_metrics(tmp_path / "a" / "samples.jsonl")
    for a, b in zip(full, resumed):
        for key in a:
            if not key.startswith("timing"):
                assert a[key] == b[key], (a["step"], key, a[key], b[key])
    from safetensors.torch import load_file

    pa = load_file(str(tmp_path / "a" / "checkpoint" / "model.safetensors"))
    pb = load_file(str(tmp_path / "b" / "checkpoint" / "model.safetensors"))
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    if setting.get("dynamic_sampling"):  # extra generation batches happened before the resume
        assert max(r["filter_groups/gen_batches"] for r in full[:2]) > 1
        assert max(r["filter_groups/gen_batches"] for r in full[2:]) > 1
    state = torch.load(tmp_path / "b" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert ("scaler" in state) == (precision == "fp16")
    assert len(state.get("lagged_weights", [])) == setting.get("rollout_staleness", 0)
    if precision == "fp16":
        assert state["scaler"]["scale"] == 2.0**16 and full[-1]["actor/loss_scale"] == 2.0**16


def test_precision_reaches_the_forward_the_rollout_and_the_engine_dtype(tiny, rollout_batch):
    """--precision: auto is bf16 on CUDA and fp32 on CPU; each value sets the autocast dtype of the
    trainer's forward (on CPU too: real bf16/fp16 kernels) and vLLM's dtype; the logprobs stay
    float32 and differ from fp32's by the format's rounding alone."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert logprobs.resolve_precision("auto", cpu) == "fp32"
    assert logprobs.resolve_precision("auto", cuda) == "bf16"
    assert logprobs.resolve_precision("fp16", cpu) == "fp16"
    engine = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    model, _ = tiny
    args, batch = rollout_batch
    reference, _ = logprobs.response_logprobs(
        model, batch, logprobs.LogprobSettings(temperature=1.0, precision="fp32")
    )
    mask = batch["response_mask"].bool()
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with logprobs.autocast_context(cpu, precision):
            assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == dtype
        assert (
            rollout.vllm_dtype(dataclasses.replace(args, precision=precision), cpu)
            == engine[precision]
        )
        with torch.no_grad():
            lp, _ = logprobs.response_logprobs(
                model, batch, logprobs.LogprobSettings(temperature=1.0, precision=precision)
            )
        error = (lp - reference)[mask].abs().max().item()
        # fp16 keeps 10 mantissa bits, bf16 7
        assert lp.dtype == torch.float32 and 0 < error < (0.3 if precision == "bf16" else 0.05)
    assert rollout.vllm_dtype(args, cuda) == "bfloat16"  # auto on a GPU
    assert rollout.vllm_dtype(args, cpu) == "float32"
    assert rollout.vllm_dtype(dataclasses.replace(args, vllm_dtype="float32"), cuda) == "float32"


def _fp16_update(model, args, batch, make_inf):
    """One optimizer step of update_policy under --precision fp16 with a fresh GradScaler; with
    make_inf, a hook turns one parameter's gradient into inf. Returns (model, scaler, metrics)."""
    model = copy.deepcopy(model)
    batch = dict(batch)
    args = dataclasses.replace(args, precision="fp16", ppo_mini_batch_size=args.train_batch_size)
    correction = corrections.RolloutCorrection.from_name("disabled")
    pi_old_and_ref(model, None, batch, args, correction)
    if make_inf:
        next(model.parameters()).register_hook(lambda grad: torch.full_like(grad, float("inf")))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cpu")
    metrics = grpo.update_policy(
        model, optimizer, batch, args, correction, grpo.logprob_settings(args, model), scaler=scaler
    )
    return model, scaler, metrics


def test_fp16_scaler_steps_on_finite_gradients_and_skips_and_backs_off_on_inf(tiny, rollout_batch):
    """The loss scale S = 2^16 (torch's default) multiplies the loss; unscale_ divides the
    gradients before clipping, so the clipped norm is the true one; a finite step moves the
    weights and keeps S; an inf gradient skips the step (every weight unchanged) and halves S."""
    model, _ = tiny
    args, batch = rollout_batch
    stepped, scaler, metrics = _fp16_update(model, args, batch, make_inf=False)
    assert metrics["actor/loss_scale"] == 2.0**16 and scaler.get_scale() == 2.0**16
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] < 100
    moved = [not torch.equal(a, b) for a, b in zip(model.parameters(), stepped.parameters())]
    assert all(moved)
    skipped, scaler, metrics = _fp16_update(model, args, batch, make_inf=True)
    assert not math.isfinite(metrics["actor/grad_norm"]) and scaler.get_scale() == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), skipped.parameters()))


def test_bad_input_fails_before_any_model_loads(tmp_path, monkeypatch):
    import transformers

    def boom(*a, **kw):
        raise AssertionError("a model was loaded before the bad input was rejected")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(tasks, "build_tiny_model", boom)
    base = dataclasses.replace(_tiny_cpu(), output_dir=str(tmp_path))
    bad = [
        (dict(correction="nope"), ValueError, "^--correction must be one of"),
        (dict(mismatch="int2"), ValueError, "^--mismatch must be one of"),
        (dict(loss_agg_mode="mean"), ValueError, "^--loss-agg-mode must be one of"),
        (dict(precision="fp8"), ValueError, "^--precision must be one of auto, fp32, bf16, fp16"),
        (dict(policy_loss="ppo"), ValueError, "^--policy-loss must be one of vanilla, gspo, cis"),
        (
            dict(policy_loss="gspo", correction="bypass_ppo_clip"),
            ValueError,
            "^--policy-loss gspo needs a decoupled --correction",
        ),
        (dict(adv_estimator="ppo"), ValueError, "^--adv-estimator must be one of grpo, rloo, "),
        (dict(tiny_arch="llama"), ValueError, "^--tiny-arch must be one of qwen2, gpt2"),
        (
            dict(
                policy_loss="geo_mean",
                loss_agg_mode="seq-mean-token-mean",
                correction="decoupled_token_is",
            ),
            ValueError,
            "^--correction must be a preset without token-level IS weights with --policy-loss geo",
        ),
        (
            dict(policy_loss="sapo"),
            ValueError,
            "^--loss-agg-mode must be seq-mean-token-mean with --policy-loss sapo, got",
        ),
        (
            dict(adv_estimator="grpo_passk", rollout_n=1),
            ValueError,
            "^--rollout-n must be >= 2 for --adv-estimator grpo_passk",
        ),
        (dict(policy_loss="dro"), ValueError, "^--dro-beta must be > 0 with --policy-loss dro"),
        (
            dict(use_bias_correction_kl=True),
            ValueError,
            "^--kl-loss-coef must be > 0 with --use-bias-correction-kl",
        ),
        (
            dict(off_policy_mask_threshold=0.0),
            ValueError,
            "^--off-policy-mask-threshold must be > 0, got 0.0",
        ),
        (dict(train_batch_size=6, ppo_mini_batch_size=4), ValueError, "divisible"),
        (dict(ppo_micro_batch_size_per_gpu=7), ValueError, "--ppo-micro-batch-size-per-gpu 7"),
        (
            dict(max_prompt_length=200, max_response_length=100),
            ValueError,
            "max_position_embeddings",
        ),
    ]
    for overrides, exc, match in bad:
        with pytest.raises(exc, match=match):
            grpo.train(dataclasses.replace(base, **overrides))
    with pytest.raises(ValueError, match="world size"):
        grpo.check_args(
            dataclasses.replace(base, train_batch_size=33, ppo_mini_batch_size=33), world_size=2
        )
    import importlib.util

    real_find_spec = importlib.util.find_spec
    for overrides, match in [
        (dict(vllm_dtype="fp8"), "^--vllm-dtype must be one of"),
        (dict(vllm_gpu_memory_utilization=1.5), "^--vllm-gpu-memory-utilization must be in"),
    ]:
        with pytest.raises(ValueError, match=match):
            grpo.train(dataclasses.replace(base, backend="vllm", **overrides))
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real_find_spec(name),
    )
    with pytest.raises(ValueError, match="needs the vllm package"):
        grpo.train(dataclasses.replace(base, backend="vllm"))
    with pytest.raises(SystemExit):
        grpo.main(["no_such_preset"])


def _torchrun_tiny(out, *flags):
    """grpo.py tiny on 2 gloo CPU processes (even on a GPU machine), 8 prompts x 4 per step; the
    rows of its metrics.jsonl once it exited cleanly."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [os.path.join(ROOT, "grpo.py"), "tiny", "--output-dir", str(out), *flags]
    cmd += ["--train-batch-size", "8", "--ppo-mini-batch-size", "4", "--rollout-n", "4"]
    cmd += ["--ppo-micro-batch-size-per-gpu", "4"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _read_metrics(out / "metrics.jsonl")


def test_torchrun_two_cpu_processes_keep_identical_parameters(tmp_path):
    rows = _torchrun_tiny(
        tmp_path / "ddp", "--backend", "hf", "--total-steps", "2", "--val-every", "2"
    )
    # the ranks hold identical parameters
    assert rows[-1]["debug/rank_param_checksum_max_diff"] == 0.0
    assert (
        [r["step"] for r in rows] == [0, 1, 2]
        and "val/accuracy" in rows[0]
        and "val/accuracy" in rows[-1]
    )


def test_torchrun_a_failing_rank_ends_both_ranks_within_seconds(tmp_path):
    """Rank 1 raises at its first update while rank 0 waits in the update's all-reduce: both
    processes end, the run exits non-zero, well before any collective timeout
    (harness.setup_distributed sets sys.excepthook to print the error and os._exit(1)). Measured 30 s
    in all, most of it start-up. On gloo rank 0's all-reduce also fails by itself once rank 1's
    socket closes; the hook is for NCCL, where a dead peer is noticed only by the watchdog and an
    exiting rank can block in the process group's destructor; this test pins the behaviour on
    CPU."""
    import time

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(ROOT, "tests", "crash_rank1.py"),
        "tiny",
        "--backend",
        "hf",
        "--total-steps",
        "2",
        "--output-dir",
        str(tmp_path / "crash"),
        "--train-batch-size",
        "8",
        "--ppo-mini-batch-size",
        "4",
        "--rollout-n",
        "4",
        "--ppo-micro-batch-size-per-gpu",
        "4",
        "--val-every",
        "0",
    ]
    t0 = time.time()
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr + proc.stdout
    # startup (imports, model build) included; the failure itself ends it in seconds
    assert time.time() - t0 < 120


def test_gsm8k_and_countdown_tasks_offline(monkeypatch):
    """The real dataset code paths, with datasets.load_dataset replaced by a few local rows (no
    download)."""
    import datasets

    gsm8k = {
        "train": [{"question": "What is 2+3?", "answer": "2+3=5\n#### 5"}],
        "test": [{"question": "Total of 1,000 and 234?", "answer": "... #### 1,234"}],
    }
    countdown = [{"nums": [3, 5, 7], "target": 22}] * 1030

    def fake_load_dataset(name, config=None, split=None):
        return countdown if name == "Jiayi-Pan/Countdown-Tasks-3to4" else gsm8k

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = tasks.load_task(grpo.PRESETS["gsm8k_qwen05b"][1])
    train, val, reward_fn = task.train, task.val, task.reward_fn
    assert train[0]["prompt"] == (
        'What is 2+3? Let\'s think step by step and output the final answer after "####".'
    )
    assert val[0]["answer"] == "1234"  # verl's extract_solution drops the thousands separator
    assert reward_fn("so 2+3=5 #### 5", train[0]) == 1.0 and reward_fn("#### 6", train[0]) == 0.0
    args = grpo.PRESETS["countdown"][1]
    task = tasks.load_task(dataclasses.replace(args, train_size=4))
    train, val, reward_fn = task.train, task.val, task.reward_fn
    assert len(train) == 4 and len(val) == 1024 and "equals 22" in train[0]["prompt"]
    # TinyZero's 3B run: the "base" template as plain text, no chat template (its rl_dataset.py
    # tokenizes it as is)
    assert not args.use_chat_template
    assert train[0]["prompt"].startswith("A conversation between User and Assistant.")
    assert "\nUser: Using the numbers [3, 5, 7], create" in train[0]["prompt"]
    assert train[0]["prompt"].endswith("\nAssistant: Let me solve this step by step.\n<think>")
    assert reward_fn("<think>ok</think> <answer>3 * 5 + 7</answer>", train[0]) == 1.0


def test_response_text_strips_only_the_final_eos_and_keeps_other_special_tokens():
    """A policy must not be able to hide tokens that decode to nothing: "abc" + [UNK] is not
    "abc"."""
    import tasks

    tokenizer = tasks.build_tiny_tokenizer()
    abc = tokenizer("abc").input_ids
    eos, unk = tokenizer.eos_token_id, tokenizer.unk_token_id
    assert tasks.response_text(tokenizer, abc + [eos]) == "abc"
    assert tasks.response_text(tokenizer, abc) == "abc"
    assert tasks.response_text(tokenizer, abc + [unk]) == "abc[UNK]"
    assert tasks.copy_reward(tasks.response_text(tokenizer, abc + [unk]), "abc") < 1.0


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--lr", "-1"], "--lr must be > 0"),
        (["--clip-ratio-low", "-1"], "--clip-ratio-low must be in [0, 1)"),
        (["--kl-loss-coef", "-1"], "--kl-loss-coef must be >= 0"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--recompute-num-layers", "-2"], "--recompute-num-layers must be >= -1"),
        (["--lm-head-precision", "fp16"], "--lm-head-precision must be one of"),
        (
            ["--model-name-or-path", "/no/such/model_dir"],
            "--model-name-or-path '/no/such/model_dir': not a local directory",
        ),
        (
            ["--output-dir", "/proc/no_such_dir/run"],
            "--output-dir '/proc/no_such_dir/run': cannot be created",
        ),
    ],
)
def test_main_refuses_a_bad_flag_in_one_line_before_any_model_loads(
    flags, named, capsys, monkeypatch, tmp_path
):
    """The flags a new user got wrong (issue: a traceback in AdamW after loading, or accepted and
    trained): each ends in `grpo.py: error: --flag ...` and exit status 2, with model loading made
    impossible."""
    import transformers

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: pytest.fail("a model was loaded before the bad flag was refused"),
    )
    argv = ["tiny", "--output-dir", str(tmp_path / "run"), *flags]
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        exit_info.value.code == 2
        and len(err) == 1
        and err[0].startswith("grpo.py: error: " + named)
    ), err


def _random_batch(vocab_size):
    """The tensors logprobs.response_logprobs reads: 3 rows of 4 prompt + 8 response tokens, no padding."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (3, 12), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(12).expand(3, -1),
        "responses": ids[:, 4:],
        "response_mask": torch.ones(3, 8),
    }


def test_recomputed_layers_change_memory_not_gradients(tmp_path):
    """--gradient-checkpointing with --recompute-num-layers k: the first k decoder layers recompute
    in backward, the others keep their activations (memory.recompute_layers); -1 on a CPU recomputes
    every layer (no GPU size to plan for). Whichever layers recompute, the loss and every gradient
    are those of no checkpointing, bit for bit (a CPU's recompute is deterministic)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = tasks.build_tiny_model(None, arch="qwen2", seed=3)[0].float()
    batch = _random_batch(model.config.vocab_size)

    def gradients(recompute):
        m = copy.deepcopy(model).train()
        flags = {"gradient_checkpointing": recompute is not None}
        if recompute is not None:
            flags["recompute_num_layers"] = recompute
        args = grpo.Args(**flags)
        if recompute is not None:
            memory.recompute_layers(m, args, torch.device("cpu"), rank=1)
        layers = [x for x in m.modules() if isinstance(x, GradientCheckpointingLayer)]
        lp, _ = logprobs.response_logprobs(m, batch, logprobs.LogprobSettings(chunk_size=5))
        lp.sum().backward()
        return [x.gradient_checkpointing for x in layers], [p.grad for p in m.parameters()]

    recomputing, expected = gradients(None)
    assert recomputing == [False, False]
    for recompute, pattern in ((0, [False, False]), (1, [True, False]), (-1, [True, True])):
        recomputing, got = gradients(recompute)
        assert recomputing == pattern
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.native_kernels
def test_compiled_layers_give_the_eager_logprobs_and_gradients():
    """--compile-layers (memory.compile_decoder_layers): the logprobs and every gradient of the
    compiled layers equal eager's to float32 rounding, with one layer recomputed in backward and
    the other not; every layer runs the one compiled graph; HF generate (a KV cache) stays eager
    and gives eager's tokens; a deepcopy (rollout.HFBackend's rollout copy) computes with its own
    weights, not the original's."""
    from torch._dynamo.utils import counters

    model = tasks.build_tiny_model(None, arch="qwen2", seed=3)[0].float().train()
    memory.recompute_layers(
        model,
        grpo.Args(gradient_checkpointing=True, recompute_num_layers=1),
        torch.device("cpu"),
        1,
    )
    batch = _random_batch(model.config.vocab_size)

    def logprobs_and_gradients(m):
        lp, _ = logprobs.response_logprobs(m, batch, logprobs.LogprobSettings(chunk_size=5))
        lp.sum().backward()
        gradients = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return lp.detach(), gradients

    def generate(m):
        m.eval()
        prompts = batch["input_ids"][:, :4]
        tokens = m.generate(prompts, max_new_tokens=4, do_sample=False, use_cache=True)
        m.train()
        return tokens

    compiled = copy.deepcopy(model)
    assert memory.compile_decoder_layers(compiled) == 2
    graphs = counters["stats"]["unique_graphs"]
    expected_logprobs, expected = logprobs_and_gradients(model)
    compiled_logprobs, got = logprobs_and_gradients(compiled)
    # one graph for both layers (a cached one if another test compiled this layer before)
    assert counters["stats"]["unique_graphs"] - graphs <= 1
    assert (compiled_logprobs - expected_logprobs).abs().max() < 1e-5
    for a, b in zip(got, expected):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(generate(compiled), generate(model))
    assert counters["stats"]["unique_graphs"] == graphs  # generate ran eager

    copied = copy.deepcopy(compiled)
    halved = copy.deepcopy(model)
    with torch.no_grad():
        for m in (copied, halved):
            for p in m.parameters():
                p.mul_(0.5)
    logprobs_copy, _ = logprobs_and_gradients(copied)
    logprobs_halved, _ = logprobs_and_gradients(halved)
    assert (logprobs_copy - logprobs_halved).abs().max() < 1e-5
    assert (logprobs_copy - compiled_logprobs).abs().max() > 0.1


@pytest.mark.native_kernels
def test_compiled_layers_stay_under_the_recompile_limit_over_a_runs_batches():
    """What a real run feeds the compiled layers: batches whose padded prompt width changes every
    step (make_batch pads prompts to the batch's longest), with and without left padding, each
    through the no-grad pi_old pass and the update's forward and backward, one of two layers
    recomputed. The layer's compiled code keeps fewer graphs than torch's recompile limit (past it
    torch runs the layer eager, silently slower): a changed width is a dynamic size after the
    first, not a new graph per length (measured: 6 graphs over 12 batches, the limit 8)."""
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    torch._dynamo.reset()  # this test's graphs only
    model = tasks.build_tiny_model(None, arch="qwen2", seed=3)[0].float().train()
    memory.recompute_layers(
        model,
        grpo.Args(gradient_checkpointing=True, recompute_num_layers=1),
        torch.device("cpu"),
        1,
    )
    memory.compile_decoder_layers(model)
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        width = 3 + step % 7
        # odd steps: rows shorter than the widest, so their prompts are left-padded
        prompts = [
            torch.randint(3, 20, (width - (row % 3) * (step % 2),), generator=g).tolist()
            for row in range(4)
        ]
        responses = [torch.randint(3, 20, (5,), generator=g).tolist() for _ in range(4)]
        batch = rollout.make_batch(prompts, responses, [[0.0] * 5] * 4, 0, 6, torch.device("cpu"))
        settings = logprobs.LogprobSettings(chunk_size=5)
        with torch.no_grad():
            logprobs.response_logprobs(model, batch, settings)
        lp, _ = logprobs.response_logprobs(model, batch, settings)
        lp.sum().backward()
        model.zero_grad(set_to_none=True)
    graphs = len(_debug_get_cache_entry_list(Qwen2DecoderLayer.forward.__code__))
    assert 2 <= graphs < torch._dynamo.config.recompile_limit


# ------------------------------------------------------------------------------------------------ DAPO


def _verl_dapo_rules():
    """verl 0.9.1's two DAPO rules, taken from its source (never imported): the group filter's
    expression in ReplayBuffer._dapo_filtered_keys and the overlong block of DAPORewardManager."""
    import ast
    import types

    root = verl_root()
    if root is None:
        pytest.skip("no verl source (scripts/setup_cpu.sh unpacks it)")
    tree = ast.parse((root / "trainer/ppo/v1/replay_buffer.py").read_text())
    cache_assign = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "classification_cache[uid]"
    )
    filter_expr = compile(ast.Expression(cache_assign.value), "replay_buffer.py", "eval")

    def verl_drops(values):  # a shared value (the group is dropped) or None (kept)
        return eval(filter_expr, {"np": np, "float": float, "len": len, "values": values})

    tree = ast.parse((root / "workers/reward_manager/dapo.py").read_text())
    block = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.If)
        and "overlong_buffer_cfg.enable" in ast.unparse(n.test)
        and any("overlong_reward" in ast.unparse(b) for b in n.body)
    )
    body = [b for b in block.body if not isinstance(b, ast.If)]  # without the logging branch
    shaping = compile(ast.Module(body=body, type_ignores=[]), "dapo.py", "exec")

    def verl_shaped(reward, length, max_len, buffer_len, factor):
        cfg = types.SimpleNamespace(len=buffer_len, penalty_factor=factor)
        scope = {
            "self": types.SimpleNamespace(overlong_buffer_cfg=cfg, max_resp_len=max_len),
            "valid_response_length": length,
            "reward": reward,
            "min": min,
        }
        exec(shaping, scope)
        return scope["reward"]

    return verl_drops, verl_shaped


def test_dapo_group_filter_and_overlong_penalty_match_verl():
    """has_reward_signal drops exactly the groups verl's filter drops (groups of 1 to 8, rewards
    from a few levels so that many groups are all equal, float32 like our scores), and
    tasks.overlong_penalty adds what verl's reward manager adds, on random lengths and
    settings."""
    verl_drops, verl_shaped = _verl_dapo_rules()
    g = torch.Generator().manual_seed(0)
    dropped = 0
    for _ in range(2000):
        size = int(torch.randint(1, 9, (), generator=g))
        levels = torch.tensor([0.0, 1.0, 0.1, 1 / 3])[: int(torch.randint(1, 5, (), generator=g))]
        scores = levels[torch.randint(0, len(levels), (size,), generator=g)]
        if torch.rand((), generator=g) < 0.2:
            scores = torch.rand(size, generator=g)
        values = scores.tolist()
        assert grpo.has_reward_signal(values) == (verl_drops(values) is None), values
        dropped += not grpo.has_reward_signal(values)
    assert 300 < dropped < 1700  # both outcomes were exercised
    for _ in range(500):
        max_len = int(torch.randint(2, 40, (), generator=g))
        buffer_len = int(torch.randint(1, max_len + 1, (), generator=g))
        factor = float(torch.rand((), generator=g) * 2)
        lengths = torch.randint(0, max_len + 1, (8,), generator=g)
        ours = tasks.overlong_penalty(lengths, max_len, buffer_len, factor)
        for length, penalty in zip(lengths.tolist(), ours.tolist()):
            theirs = verl_shaped(0.0, length, max_len, buffer_len, factor)
            assert penalty == pytest.approx(theirs, rel=1e-6, abs=1e-6), (length, max_len)
    # hand-computed: max 6, buffer 2 -> free up to 4 tokens, -0.5 at 5, -1.0 at 6
    assert tasks.overlong_penalty(torch.tensor([3, 4, 5, 6]), 6, 2).tolist() == [0, 0, -0.5, -1]


def test_dynamic_sampling_trains_only_groups_with_signal_and_stops_at_the_cap(
    tmp_path, monkeypatch, capsys
):
    """--dynamic-sampling: every update sees exactly train_batch_size groups, none of them all-equal
    (each group's advantages differ), after extra generation batches where needed; once every
    reward is equal no group survives, and the run ends at --max-num-gen-batches with a checkpoint
    of its last step and one line that says why."""
    trained = []
    real_update = grpo.update_policy

    def update_policy(model, optimizer, batch, args, *a, **kw):
        trained.append(batch["advantages"].view(-1, args.rollout_n).clone())
        return real_update(model, optimizer, batch, args, *a, **kw)

    monkeypatch.setattr(grpo, "update_policy", update_policy)
    args = _small_args(
        output_dir=str(tmp_path / "a"),
        total_steps=4,
        dynamic_sampling=True,
        overlong_buffer_len=2,
        train_size=64,
    )
    rows = _read_metrics(grpo.train(args))
    assert len(trained) == 4 and all(a.shape == (args.train_batch_size, 4) for a in trained)
    assert all((a.std(dim=1) > 0).all() for a in trained)
    assert max(r["filter_groups/gen_batches"] for r in rows) > 1
    assert all(r["filter_groups/kept_groups"] >= args.train_batch_size for r in rows)
    assert all(-1 <= r["overlong/reward_mean"] <= 0 for r in rows)

    # rewards that differ within every group for two steps (4 x 4 responses each), then all equal:
    # the run stops after step 2, saved, and says why in one line
    calls = []

    def copy_reward(response, target):
        calls.append(1)
        return len(calls) % 4 / 4 if len(calls) <= 32 else 0.5

    monkeypatch.setattr(tasks, "copy_reward", copy_reward)
    capped = dataclasses.replace(
        args, output_dir=str(tmp_path / "b"), max_num_gen_batches=3, overlong_buffer_len=0
    )
    # an unfinished run: a RunError (one line, exit code 1 from the command line), after the save
    with pytest.raises(harness.RunError) as stop:
        grpo.train(capped)
    assert str(stop.value) == (
        "stopping after step 2: --max-num-gen-batches 3 gave 0 of --train-batch-size 4 prompt "
        "groups whose rewards differ (saved: rerun with a larger --max-num-gen-batches to go on)"
    )
    rows = _read_metrics(os.path.join(capped.output_dir, "metrics.jsonl"))
    assert rows[-1]["step"] == 2
    state = torch.load(tmp_path / "b" / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 2
    # it resumes from that checkpoint with a larger cap (not refused as a changed setting)
    with pytest.raises(harness.RunError, match="--max-num-gen-batches 4 gave 0"):
        grpo.train(dataclasses.replace(capped, max_num_gen_batches=4))
    assert _read_metrics(os.path.join(capped.output_dir, "metrics.jsonl"))[-1]["step"] == 2


def test_torchrun_dynamic_sampling_gives_every_rank_the_same_batch_size(tmp_path):
    """Two CPU processes with --dynamic-sampling: the kept groups are pooled over the ranks and
    split evenly, so both ranks run the same micro-batches (no hang), end with identical
    parameters, and extra generation batches happened."""
    flags = ["--dynamic-sampling", "--total-steps", "3", "--val-every", "0"]
    rows = _torchrun_tiny(tmp_path / "ddp", *flags)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["debug/rank_param_checksum_max_diff"] == 0.0
    assert max(r["filter_groups/gen_batches"] for r in rows) > 1


def test_copy_positions_counts_matches_and_repeats():
    """scripts/copy_positions.py (docs/grpo.md's table of what the tiny models sample early) on
    four hand-made samples: per-position matches, repeats among prompts whose letters differ, and
    the mean score."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import copy_positions

    samples = [
        {"prompt": "abc=", "response": "abc", "score": 1.0},
        # one letter repeated: right at the first position only
        {"prompt": "abc=", "response": "aaaaaa", "score": 1 / 6},
        # the prompt repeats its letter: not counted among the repeat candidates
        {"prompt": "aaa=", "response": "aaa", "score": 1.0},
        # too short to repeat
        {"prompt": "dcb=", "response": "d", "score": 1 / 3},
    ]
    rates, repeats, score = copy_positions.window_stats(samples)
    assert rates == [1.0, 0.5, 0.5]
    assert repeats == pytest.approx(1 / 3)
    assert score == pytest.approx(0.625)


def test_use_bias_correction_kl_weights_each_tokens_kl_by_the_ratio():
    """DeepSeek-V3.2's unbiased KL (TRL's use_bias_correction_kl): the k3 estimate of KL(pi_theta ||
    pi_ref) of each token, sampled from pi_old, times r = pi_theta / pi_old, then token-mean over
    the mask (the values TRL's compute_loss gives: per_token_kl * coef_1); the plain KL loss without
    the flag; a gradient through r."""
    g = torch.Generator().manual_seed(2)
    logprobs = (-torch.rand(3, 5, generator=g) * 2).requires_grad_(True)
    old_logprobs = logprobs.detach() + 0.2 * torch.randn(3, 5, generator=g)
    ref_logprobs = logprobs.detach() + 0.3 * torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] + [0.0] * 4])
    micro_batch = {
        "advantages": torch.zeros(3),
        "old_logprobs": old_logprobs,
        "loss_mask": mask,
        "ref_logprobs": ref_logprobs,
        "rollout_logprobs": old_logprobs,
    }
    correction = corrections.RolloutCorrection.from_name("disabled")
    info = dict(dp_size=1, batch_num_tokens=mask.sum().item(), global_batch_size=3)
    d = (ref_logprobs - logprobs).detach()
    k3 = torch.exp(d) - d - 1
    ratio = torch.exp(logprobs.detach() - old_logprobs)
    args = dataclasses.replace(grpo.Args(), kl_loss_coef=0.1, use_bias_correction_kl=True)
    loss, terms, _, _ = grpo.grpo_loss(
        logprobs, torch.zeros(3, 5), micro_batch, args, correction, info
    )
    tokens = mask.sum()
    assert terms["actor/kl_loss"].item() == pytest.approx(
        ((k3 * ratio * mask).sum() / tokens).item()
    )
    loss.backward()
    assert logprobs.grad.abs().sum() > 0
    plain = dataclasses.replace(args, use_bias_correction_kl=False)
    _, terms, _, _ = grpo.grpo_loss(
        logprobs, torch.zeros(3, 5), micro_batch, plain, correction, info
    )
    assert terms["actor/kl_loss"].item() == pytest.approx(((k3 * mask).sum() / tokens).item())
