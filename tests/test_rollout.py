"""rollout.py: the rollout engine without vLLM (tests/test_vllm_backend.py starts the one vLLM
engine its tests share). The HF backend's logprobs equal the trainer's recompute and the model's own
generation config cannot leak in; its seeding leaves the global RNG alone; make_batch's tensors,
hand-checked; the simulated mismatch (apply_mismatch) and staleness (LaggedWeights); OpenAI's
fixed-length sampling for ppo_rlhf.py. Budget: ~10 s on 2 cores."""

import copy
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import logprobs  # noqa: E402
import ppo_rlhf  # noqa: E402
import rollout  # noqa: E402
from test_grpo import _prompts, _small_args, unpadded_logprobs  # noqa: E402

CPU = torch.device("cpu")
TOL = 1e-4  # max |rollout logprob - trainer recompute| in fp32 (measured ~1e-6)


# --------------------------------------------------------------------------------------------------
# make_batch: a rollout as the trainer's tensors
# --------------------------------------------------------------------------------------------------


def test_make_batch_by_hand():
    """[left-padded prompt | right-padded response], verl's position ids (cumsum - 1, clamped at 0:
    a pad after the response repeats the last position), the response mask with EOS in it, and each
    response token's rollout logprob in place (0 at padding)."""
    pad, eos = 0, 1
    batch = rollout.make_batch(
        prompt_ids=[[5, 6], [7]],
        response_ids=[[8, eos], [9, 10, 11]],
        rollout_logprobs=[[-0.5, -0.25], [-1.0, -2.0, -3.0]],
        pad_id=pad,
        response_length=3,
        device=CPU,
    )
    assert batch["input_ids"].tolist() == [[5, 6, 8, eos, pad], [pad, 7, 9, 10, 11]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 3], [0, 0, 1, 2, 3]]
    assert batch["responses"].tolist() == [[8, eos, pad], [9, 10, 11]]
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["rollout_logprobs"].tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]


# --------------------------------------------------------------------------------------------------
# the HF backend
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_backend_logprobs_match_trainer_recompute(tiny, temperature):
    model, tokenizer = tiny
    # The model's own generation config must not leak into sampling (Qwen-Instruct ships
    # top_k/top_p/penalties).
    from transformers import GenerationConfig

    leaky = copy.deepcopy(model)
    leaky.generation_config = GenerationConfig(
        do_sample=True,
        top_k=2,
        top_p=0.5,
        temperature=0.3,
        repetition_penalty=2.0,
        min_new_tokens=3,
        suppress_tokens=[5],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
    )
    prompts, n, max_new = _prompts(tokenizer), 8, 12
    backend = rollout.make_backend("hf", None, leaky, _small_args(), tokenizer)
    responses, sampled_logprobs, finish = backend.generate(prompts, n, max_new, temperature, seed=3)
    assert len(responses) == len(sampled_logprobs) == len(finish) == len(prompts) * n
    assert set(finish) == {"stop", "length"}  # responses of different lengths, some ending in EOS
    eos = tokenizer.eos_token_id
    for r, lp, f in zip(responses, sampled_logprobs, finish):
        assert len(r) == len(lp)
        assert (f == "stop") == (r[-1] == eos) and eos not in r[:-1]  # EOS kept as the last action
        assert f == "stop" or len(r) == max_new
    # Trainer recompute on the padded batch (left-padded prompts, right-padded responses), chunked
    # lm_head.
    batch = rollout.make_batch(
        [p for p in prompts for _ in range(n)],
        responses,
        sampled_logprobs,
        tokenizer.pad_token_id,
        max_new,
        CPU,
    )
    with torch.no_grad():
        recomputed, _ = logprobs.response_logprobs(
            model, batch, logprobs.LogprobSettings(temperature=temperature, chunk_size=7)
        )
    mask = batch["response_mask"].bool()
    diff = (recomputed - batch["rollout_logprobs"]).abs()[mask].max().item()
    assert diff < TOL, diff
    # ... and against unpadded forwards, sample k belonging to prompt k // n (the grouping
    # contract).
    worst = max(
        (unpadded_logprobs(model, prompts[k // n], r, temperature) - torch.tensor(lp))
        .abs()
        .max()
        .item()
        for k, (r, lp) in enumerate(zip(responses, sampled_logprobs))
    )
    assert worst < TOL, worst
    if temperature != 1.0:  # processed (tempered) logprobs, not raw ones
        raw = max(
            (unpadded_logprobs(model, prompts[k // n], r, 1.0) - torch.tensor(lp))
            .abs()
            .max()
            .item()
            for k, (r, lp) in enumerate(zip(responses, sampled_logprobs))
        )
        assert raw > 100 * TOL


@pytest.mark.parametrize("prompt_lengths", [(5, 5, 5), (2, 5, 3)])
def test_hf_generate_loses_no_attention_mask(tiny, prompt_lengths):
    """transformers' "We strongly recommend passing in an `attention_mask`" warning at step 1 of
    `grpo.py tiny` comes from generate's own forwards, and no mask is lost. Prompts of equal length
    (the copy task's): generate drops the all-ones mask (transformers 5, generation/utils.py: "We can
    drop the mask altogether if it's all 1s"), so its forwards get none, and after a row samples EOS
    it is fed the pad token, which the warning sees; rows are independent and a finished row's later
    tokens are discarded, so every logprob still equals an unpadded forward's. Left-padded prompts:
    every forward of generate gets the mask."""
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 50, (k,), generator=g).tolist() for k in prompt_lengths]
    masks = []
    real_forward = model.model.forward

    def forward(*args, **kwargs):
        masks.append(kwargs.get("attention_mask"))
        return real_forward(*args, **kwargs)

    model.model.forward = forward
    backend = rollout.make_backend("hf", None, model, _small_args(), tokenizer)
    responses, sampled_logprobs, finish = backend.generate(prompts, 8, 12, 1.0, seed=1)
    assert "stop" in finish and "length" in finish  # some rows finish early, some run on
    padded = len(set(prompt_lengths)) > 1
    assert all((mask is not None) == padded for mask in masks) and len(masks) > 1
    worst = max(
        (unpadded_logprobs(model, prompts[k // 8], r, 1.0) - torch.tensor(lp)).abs().max().item()
        for k, (r, lp) in enumerate(zip(responses, sampled_logprobs))
    )
    assert worst < TOL, worst


def test_hf_backend_seeding(tiny):
    model, tokenizer = tiny
    backend = rollout.make_backend("hf", None, model, _small_args(), tokenizer)
    prompts = _prompts(tokenizer)
    state = torch.get_rng_state()
    a = backend.generate(prompts, 2, 6, 1.0, seed=5)
    # sampling never touches the global RNG (resume depends on it)
    assert torch.equal(state, torch.get_rng_state())
    assert a[0] == backend.generate(prompts, 2, 6, 1.0, seed=5)[0]
    assert a[0] != backend.generate(prompts, 2, 6, 1.0, seed=6)[0]
    greedy = backend.generate(prompts, 1, 6, 0.0, seed=1)[0]
    assert greedy == backend.generate(prompts, 1, 6, 0.0, seed=2)[0]


def test_hf_backend_mismatch_keeps_a_rounded_copy(tiny):
    model, tokenizer = tiny
    trainer = copy.deepcopy(model)
    backend = rollout.make_backend("hf", None, trainer, _small_args(mismatch="bf16"), tokenizer)
    assert backend.model is not trainer
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01)
    backend.sync_weights(trainer)
    for (name, p), (_, q) in zip(trainer.named_parameters(), backend.model.named_parameters()):
        assert torch.equal(q, p.to(torch.bfloat16).float()), name
    # none: no copy
    assert rollout.make_backend("hf", None, trainer, _small_args(), tokenizer).model is trainer


def test_apply_mismatch():
    g = torch.Generator().manual_seed(0)
    named = [
        ("model.embed_tokens.weight", torch.randn(10, 8, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(6, 8, generator=g) * 3),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(6, generator=g)),
        ("model.norm.weight", torch.randn(8, generator=g)),
    ]
    before = [t.clone() for _, t in named]
    none = dict(rollout.apply_mismatch(named, "none"))
    bf16 = dict(rollout.apply_mismatch(named, "bf16"))
    int8 = dict(rollout.apply_mismatch(named, "int8"))
    for (name, t), b in zip(named, before):
        assert torch.equal(t, b)  # the trainer's tensors are never modified
        assert torch.equal(none[name], t)
        assert torch.equal(bf16[name], t.to(torch.bfloat16).float()) and not torch.equal(
            bf16[name], t
        )
    w, q = named[1][1], int8["model.layers.0.mlp.up_proj.weight"]
    scale = w.abs().amax(1, keepdim=True) / 127
    assert ((q - w).abs() <= scale / 2 + 1e-6).all() and not torch.equal(q, w)
    assert ((q / scale).round() - q / scale).abs().max() < 1e-4  # on the per-row int8 grid
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.norm.weight",
    ):
        assert torch.equal(int8[name], dict(named)[name])  # embeddings / 1-D tensors untouched
    with pytest.raises(ValueError):
        rollout.apply_mismatch(named, "int2")


def test_apply_mismatch_fp8_and_int4():
    """fp8: e4m3 values times a per-row scale max|w_row| / 448; int4: the per-row grid max|w_row| /
    7. Both coarser than int8 on the same weights (the ordering the mismatch experiment relies on),
    embeddings untouched."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=g) * 3
    named = [
        ("model.embed_tokens.weight", torch.randn(10, 8, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", w),
    ]
    out = {kind: dict(rollout.apply_mismatch(named, kind)) for kind in ("int8", "fp8", "int4")}
    name = "model.layers.0.mlp.up_proj.weight"
    scale8 = w.abs().amax(1, keepdim=True) / 448
    fp8 = out["fp8"][name]
    # on the scaled e4m3 grid
    assert torch.equal((fp8 / scale8).to(torch.float8_e4m3fn).float() * scale8, fp8)
    assert ((fp8 - w).abs() <= w.abs() / 16 + 1e-6).all()  # 3 mantissa bits: relative error <= 2^-4
    scale4 = w.abs().amax(1, keepdim=True) / 7
    int4 = out["int4"][name]
    assert ((int4 / scale4).round() - int4 / scale4).abs().max() < 1e-4 and (
        int4 / scale4
    ).abs().max() <= 7 + 1e-4
    assert ((int4 - w).abs() <= scale4 / 2 + 1e-6).all()
    err = {kind: (out[kind][name] - w).abs().mean() for kind in out}
    assert err["int8"] < err["fp8"] < err["int4"]
    for kind in out:
        assert torch.equal(out[kind]["model.embed_tokens.weight"], named[0][1])


# --------------------------------------------------------------------------------------------------
# staleness and fixed-length sampling
# --------------------------------------------------------------------------------------------------


def test_lagged_weights_trail_by_k_updates_and_validation_sees_the_newest(tiny):
    """LaggedWeights(k=2): the copy holds the initial weights until two updates are done, then the
    weights of two updates ago; inside current() it holds the trainer's newest and syncs them."""
    model = copy.deepcopy(tiny[0])
    lag = rollout.LaggedWeights(model, 2)
    first = [p.detach().clone() for p in model.parameters()]
    versions = [first]
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        lag.push(model)
        versions.append([p.detach().clone() for p in model.parameters()])
    # three updates done: the copy has the weights after update 1 (three minus two)
    for p, expected in zip(lag.model.parameters(), versions[1]):
        assert torch.equal(p, expected)

    class Recorder:
        synced = []

        def sync_weights(self, m):
            self.synced.append([p.detach().clone() for p in m.parameters()])

    backend = Recorder()
    with lag.current(backend):
        for p, expected in zip(lag.model.parameters(), versions[3]):
            assert torch.equal(p, expected)
    for p, expected in zip(lag.model.parameters(), versions[1]):  # lagging again afterwards
        assert torch.equal(p, expected)
    assert [
        torch.equal(a[0], b[0]) for a, b in zip(backend.synced, (versions[3], versions[1]))
    ] == [
        True,
        True,
    ]


def test_sampling_is_fixed_length_ignores_eos_and_matches_forward_logprobs(tiny_lm):
    """rollout.sample_fixed_length with OpenAI's settings: exactly R tokens although EOS is likely,
    the in-vocabulary pad never sampled, the same tokens as a plain HF generate() with those
    settings under the same seed (the global RNG, as before the move to rollout.py), and rollout
    logprobs equal to the training forward's."""
    import copy

    from transformers import GenerationConfig

    model, tok = tiny_lm
    model = copy.deepcopy(model)
    eos = tok.eos_token_id
    # make EOS likely (logit ~ +4 above the rest) so an EOS-stopping generate would stop early
    with torch.no_grad():
        h = model.base_model(
            input_ids=torch.randint(3, len(tok), (8, 12))
        ).last_hidden_state.flatten(0, 1)
        direction = h.mean(0) / h.mean(0).square().sum()
        # untie from the input
        head = torch.nn.Parameter(model.get_output_embeddings().weight.detach().clone())
        head[eos] = 4.0 * direction
        model.get_output_embeddings().weight = head
    banned = ppo_rlhf.banned_vocab_mask(model.config.vocab_size, tok.pad_token_id, "cpu")
    assert banned is not None  # the tiny tokenizer's [PAD] is id 0, inside the vocabulary
    queries = ppo_rlhf.left_pad_queries([[5, 6, 7], [8, 9]], 4, tok.pad_token_id)
    # with the model's own EOS id, HF would mask EOS (min_new_tokens): refused
    with pytest.raises(ValueError, match="never_stop_at_eos"):
        rollout.sample_fixed_length(model, queries, tok.pad_token_id, 10, 0.7)
    rollout.never_stop_at_eos(model)  # as load_policy does
    torch.manual_seed(0)
    responses, rollout_lp = rollout.sample_fixed_length(
        model, queries, tok.pad_token_id, 10, 0.7, banned_token=tok.pad_token_id, precision="fp32"
    )
    assert responses.shape == rollout_lp.shape == (2, 10)
    assert (responses == eos).any() and not (responses == tok.pad_token_id).any()
    reference = GenerationConfig(
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=0.7,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
        suppress_tokens=[tok.pad_token_id],
    )
    attention_mask = queries != tok.pad_token_id
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=queries.masked_fill(~attention_mask, 0),
            attention_mask=attention_mask,
            generation_config=reference,
        )
    assert torch.equal(out[:, 4:], responses)
    with torch.no_grad():
        hidden = ppo_rlhf.response_hidden(
            model, torch.cat([queries, responses], 1), 4, tok.pad_token_id
        )
        forward_lp, _ = ppo_rlhf.logprobs_from_hidden(
            model,
            hidden,
            responses,
            logprobs.LogprobSettings(temperature=0.7, chunk_size=1024, banned=banned),
        )
    assert torch.allclose(rollout_lp, forward_lp, atol=1e-4)
