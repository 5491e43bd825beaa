"""logprobs.py: the chunked log pi the trainers run equals its definition (section 1), values and
gradients, and a learner stepping from an update into log pi lands on that definition's file."""

import ast
import copy
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

import grpo
import logprobs
import rollout
from tolerances import assert_float32_close, float32_error

CPU = torch.device("cpu")


def padded_batch(tokenizer, seed=0):
    """rollout.make_batch's tensors for 4 left-padded prompts and right-padded responses of 1, 5, 3
    and 6 tokens (R = 6): padding on both sides, as a GRPO step has it."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 50, (k,), generator=g).tolist() for k in (2, 4, 3, 1)]
    responses = [torch.randint(3, 50, (k,), generator=g).tolist() for k in (1, 5, 3, 6)]
    zeros = [[0.0] * len(r) for r in responses]
    return rollout.make_batch(prompts, responses, zeros, tokenizer.pad_token_id, 6, CPU)


def definition(model, batch, temperature):
    """logprobs.reference_logprobs_and_entropy on the full forward's logits of the valid response
    tokens, scattered into (B, R) (0 at padding)."""
    R = batch["responses"].shape[1]
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits[:, -R - 1 : -1]
    valid = batch["response_mask"].bool()
    lp, entropy = logprobs.reference_logprobs_and_entropy(
        logits[valid], batch["responses"][valid], temperature
    )
    zeros = torch.zeros(valid.shape)
    return zeros.masked_scatter(valid, lp), zeros.masked_scatter(valid, entropy)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, 512])
def test_the_chunked_path_equals_the_definition(tiny, temperature, chunk_size):
    """response_logprobs (the backbone, then the LM head chunk by chunk: one chunk, or several with
    the written-out gradient) against the definition, one float32 log-softmax over the whole
    vocabulary of the full forward's logits, on CPU fp32, with and without temperature, without and
    with autograd: the logprobs, the entropies and the gradient of a weighted sum of both
    (entropy_grad) to float32 rounding, each tensor within 128 eps32 of its largest entry
    (tests/tolerances.py: sums of up to 128 terms, the tiny model's hidden size, in another order;
    the gradients measured at most 9 eps32 on AVX512, AVX2 and the default kernels)."""
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    batch = padded_batch(tokenizer)
    settings = logprobs.LogprobSettings(temperature=temperature, chunk_size=chunk_size)
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(batch["responses"].shape, generator=g)

    ref_lp, ref_entropy = definition(model, batch, temperature)
    (ref_lp * weights + ref_entropy).sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.no_grad():
        lp, entropy = logprobs.response_logprobs(model, batch, settings)
    assert_float32_close(lp, ref_lp, terms=128, what="logprobs")
    assert_float32_close(entropy, ref_entropy, terms=128, what="entropy")
    assert (lp[batch["response_mask"] == 0] == 0).all()

    lp, entropy = logprobs.response_logprobs(model, batch, settings, entropy_grad=True)
    assert_float32_close(lp, ref_lp, terms=128, what="logprobs")
    assert_float32_close(entropy, ref_entropy, terms=128, what="entropy")
    (lp * weights + entropy).sum().backward()
    for (name, p), ref in zip(model.named_parameters(), ref_grads):
        assert_float32_close(p.grad, ref, terms=128, what=name)


def test_the_definition_by_hand():
    """Two positions over a vocabulary of 3, logits (0, ln 2, ln 5) and (0, 0, 0) at T = 1, and the
    first at T = 2: log pi and the entropy written out from the probabilities (1, 2, 5) / 8 and
    1/3 each."""
    logits = torch.tensor([[1.0, 2.0, 5.0], [1.0, 1.0, 1.0]]).log()
    tokens = torch.tensor([2, 0])
    lp, entropy = logprobs.reference_logprobs_and_entropy(logits, tokens)
    p = torch.tensor([1.0, 2.0, 5.0]) / 8
    assert torch.allclose(lp, torch.tensor([p[2].log(), torch.tensor(1 / 3).log()]))
    assert torch.allclose(entropy, torch.stack([-(p * p.log()).sum(), torch.tensor(3.0).log()]))
    # T = 2: logits / 2 is log sqrt(1, 2, 5)
    lp, _ = logprobs.reference_logprobs_and_entropy(logits[:1], tokens[:1], temperature=2.0)
    root = torch.tensor([1.0, 2.0, 5.0]).sqrt()
    assert torch.allclose(lp, (root[2] / root.sum()).log()[None])


def test_a_learner_stepping_from_update_policy_lands_in_logprobs_py(tiny):
    """Stepping into grpo.update_policy's first log pi call (a tracer records every Python call),
    the first frame of logprobs.py is at most 2 calls below update_policy, in the file whose first
    function is the definition (reference_logprobs_and_entropy). ppo_rlhf.py reaches it in 2 (its
    update_policy -> logprobs_from_hidden -> logprobs.token_logprobs_and_entropy, read from the
    source)."""
    model, tokenizer = tiny
    model = copy.deepcopy(model)
    batch = padded_batch(tokenizer)
    args = grpo.Args(
        rollout_n=4,
        train_batch_size=1,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=4,
        cuda=False,
    )
    batch["old_logprobs"] = torch.zeros(batch["responses"].shape)
    batch["loss_mask"] = batch["response_mask"]
    batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    correction = grpo.corrections.RolloutCorrection.from_name("disabled")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    depths = []

    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith("logprobs.py") and not depths:
            # calls between update_policy and this frame, this one included
            depth = 0
            outer = frame
            while outer is not None and outer.f_code is not grpo.update_policy.__code__:
                depth += 1
                outer = outer.f_back
            depths.append((depth, frame.f_code.co_name))
        return None

    log_pi = grpo.logprob_settings(args, model)
    sys.settrace(tracer)
    try:
        grpo.update_policy(model, optimizer, batch, args, correction, log_pi)
    finally:
        sys.settrace(None)
    assert depths and depths[0][0] <= 2, depths
    first = next(n for n in ast.parse(open(logprobs.__file__).read()).body if hasattr(n, "name"))
    assert first.name == "reference_logprobs_and_entropy"

    # ppo_rlhf.py: update_policy calls logprobs_from_hidden, which calls the entry point
    import ppo_rlhf

    source = ast.parse(open(ppo_rlhf.__file__).read())
    functions = {n.name: n for n in source.body if isinstance(n, ast.FunctionDef)}

    def calls(function):
        return {
            ast.unparse(n.func) for n in ast.walk(functions[function]) if isinstance(n, ast.Call)
        }

    assert "logprobs_from_hidden" in calls("update_policy")
    assert "logprobs.token_logprobs_and_entropy" in calls("logprobs_from_hidden")


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_plain_chunk_is_the_definition_bit_for_bit_as_the_chunked_pass(
    monkeypatch, entropy_grad, temperature
):
    """token_logprobs_and_entropy on one chunk of float32 logits over the whole vocabulary (a tiny
    run's micro-batches on a CPU) calls the definition itself, reference_logprobs_and_entropy, and
    gives the chunked pass's values (logprobs._chunked_stats, the path it takes for everything
    else) and gradients bit for bit: runs log what they logged before the definition took over."""
    calls = []
    definition_itself = logprobs.reference_logprobs_and_entropy

    def recording(*args, **kwargs):
        calls.append(args[0].shape)
        return definition_itself(*args, **kwargs)

    monkeypatch.setattr(logprobs, "reference_logprobs_and_entropy", recording)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=g)
    hidden = torch.randn(30, 16, generator=g)
    tokens = torch.randint(0, 50, (30,), generator=g)
    weights_of_terms = torch.randn(2, 30, generator=g)
    settings = logprobs.LogprobSettings(temperature=temperature, chunk_size=512)
    results = []
    for path in ("definition", "chunked"):
        head = torch.nn.Linear(16, 50, bias=False)
        head.weight = torch.nn.Parameter(weight.clone())
        h = hidden.clone().requires_grad_(True)
        if path == "definition":
            stats = logprobs.token_logprobs_and_entropy(
                h, tokens, head, settings, entropy_grad=entropy_grad
            )
        else:
            stats = logprobs._chunked_stats(
                head.weight, h, tokens, temperature, None, entropy_grad, "fp32", None, 512
            )
        loss = (weights_of_terms[0] * stats[0]).sum()
        if entropy_grad:
            loss = loss + (weights_of_terms[1] * stats[1]).sum()
        loss.backward()
        results.append((stats[0], stats[1], h.grad, head.weight.grad))
    assert calls == [torch.Size([30, 50])]  # the definition ran once, on all 30 positions
    for ours, chunked in zip(*results):
        assert torch.equal(ours.detach(), chunked.detach())
    # no gradient through the entropy unless entropy_grad, as the chunked pass
    assert results[0][1].requires_grad == entropy_grad


def test_a_tiny_run_steps_into_the_definition(monkeypatch, tmp_path):
    """A tiny GRPO run (one step of grpo.train on the CPU) computes pi_old and every log pi of the
    update through logprobs.py's first function, the definition, called from compute_pi_old and
    from update_policy: a learner stepping into log pi from a run lands on it (the frames between
    them: response_logprobs -> token_logprobs_and_entropy)."""
    from test_grpo import _small_args

    callers = []
    definition_itself = logprobs.reference_logprobs_and_entropy

    def recording(*args, **kwargs):
        frame = sys._getframe(1)
        chain = []
        while frame is not None:
            chain.append(frame.f_code.co_name)
            frame = frame.f_back
        callers.append(chain)
        return definition_itself(*args, **kwargs)

    monkeypatch.setattr(logprobs, "reference_logprobs_and_entropy", recording)
    grpo.train(_small_args(output_dir=str(tmp_path), total_steps=1))
    # pi_old once per micro-batch of 4 sequences (16 rows), then the update's forward per
    # micro-batch (2 minibatches of 8 rows, 2 micro-batches each)
    from_pi_old = [chain for chain in callers if "compute_pi_old" in chain]
    from_update = [chain for chain in callers if "update_policy" in chain]
    assert len(from_pi_old) == 4 and len(from_update) == 4, [c[:4] for c in callers]
    assert from_update[0][:3] == [
        "token_logprobs_and_entropy",
        "response_logprobs",
        "update_policy",
    ]
    first = next(n for n in ast.parse(open(logprobs.__file__).read()).body if hasattr(n, "name"))
    assert first.name == "reference_logprobs_and_entropy"


# --------------------------------------------------------------------------------------------------
# The chunked pass and the LM head's product (moved here from tests/test_corrections.py with
# logprobs.py's code)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def float64_default():
    """The tests below compare against float64 products (their hand and autograd references are
    exact there); the default dtype is restored after each."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _tiny_head_and_tokens(g, hidden_size, banned_id):
    """A bias-free (11, hidden_size) LM head, 13 hidden states that require grad, 13 tokens, and
    the (11,) banned mask (None, or token banned_id, which no token then is)."""
    head = torch.nn.Linear(hidden_size, 11, bias=False)
    head.weight = torch.nn.Parameter(torch.randn(11, hidden_size, generator=g))
    hidden = torch.randn(13, hidden_size, generator=g).requires_grad_()
    tokens = torch.randint(0, 11, (13,), generator=g)
    banned = None
    if banned_id is not None:
        banned = torch.zeros(11, dtype=torch.bool)
        banned[banned_id] = True
        tokens[tokens == banned_id] = 0
    return head, hidden, tokens, banned


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("banned_id", [None, 3])
def test_token_logprobs_and_entropy_match_a_full_log_softmax_with_gradients(banned_id):
    g = torch.Generator().manual_seed(0)
    head, hidden, tokens, banned = _tiny_head_and_tokens(g, 5, banned_id)
    weight = head.weight
    token_logprobs, entropy = logprobs.token_logprobs_and_entropy(
        hidden, tokens, head, logprobs.LogprobSettings(temperature=0.7, chunk_size=4, banned=banned)
    )
    logits = (hidden @ weight.T) / 0.7
    if banned is not None:
        logits = logits.masked_fill(banned, -math.inf)
    full = torch.log_softmax(logits, -1)
    expected_entropy = -(full.exp() * full.masked_fill(torch.isinf(full), 0.0)).sum(-1)
    assert torch.allclose(token_logprobs, full.gather(-1, tokens[:, None])[:, 0], atol=1e-10)
    assert torch.allclose(entropy, expected_entropy, atol=1e-10) and not entropy.requires_grad
    grad_chunked = torch.autograd.grad(token_logprobs.sum(), (hidden, weight))
    grad_full = torch.autograd.grad(full.gather(-1, tokens[:, None]).sum(), (hidden, weight))
    for a, b in zip(grad_chunked, grad_full):
        assert torch.allclose(a, b, atol=1e-10)
    assert logprobs.token_logprobs_and_entropy(
        hidden[:0], tokens[:0], None, logprobs.LogprobSettings()
    )[0].shape == (0,)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_bf16_reference_linears_give_bit_identical_logits_under_autocast(arch):
    """bf16_frozen_linears_ halves a frozen model's Linear/Conv1D weights; under bf16 autocast the
    forward is the fp32 model's bit for bit (autocast casts those weights to bf16 anyway), on CPU
    here as on CUDA."""
    import copy

    import tasks

    # fp32 (this file's default: fp64)
    model = tasks.build_tiny_model(None, arch=arch, seed=3)[0].float().eval()
    ref = copy.deepcopy(model).requires_grad_(False)  # frozen, as the trainers' references
    n_bf16 = logprobs.bf16_frozen_linears_(ref)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert 0 < n_bf16 < total - embedding + 1  # the tied embedding / LM head stays fp32
    assert ref.get_output_embeddings().weight.dtype == torch.float32
    ids = torch.randint(
        0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = model(ids).logits, ref(ids).logits
    assert torch.equal(expected, got)


# ---------------------------------------------------------------------------------------------------------------
# The LM head's precision: TF32 under bf16 autocast on CUDA (--lm-head-precision auto), bf16 inputs
# with float32 logits, measured on real weights
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("float64_default")
def test_head_linear_gives_the_linear_product_and_gradients_and_restores_the_setting():
    """logprobs._HeadLinear, the LM head's product in TF32 or bf16 (the single-chunk path under
    autograd): in tf32 its forward and both backward products are the plain ones (a CPU has no
    TF32: exactly F.linear's), and the CUDA matmul precision it sets around each product is put
    back (never left on for the rest of the program); in bf16 (emulated on a CPU: inputs rounded to
    bfloat16, float32 sums) each product is the float32 product of the bf16-rounded operands."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=g, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(11, 5, generator=g, dtype=torch.float32, requires_grad=True)
    upstream = torch.randn(7, 11, generator=g, dtype=torch.float32)
    before = torch.backends.cuda.matmul.fp32_precision
    out = logprobs._HeadLinear.apply(hidden, weight, "tf32")
    got = torch.autograd.grad(out, (hidden, weight), upstream)
    expected = torch.nn.functional.linear(hidden, weight)
    assert torch.equal(out, expected)
    for a, b in zip(got, torch.autograd.grad(expected, (hidden, weight), upstream)):
        assert torch.equal(a, b)
    assert torch.backends.cuda.matmul.fp32_precision == before

    def bf16(x):
        return x.detach().bfloat16().float()

    out = logprobs._HeadLinear.apply(hidden, weight, "bf16")
    grad_hidden, grad_weight = torch.autograd.grad(out, (hidden, weight), upstream)
    assert torch.equal(out, bf16(hidden) @ bf16(weight).T)
    assert torch.equal(grad_hidden, bf16(upstream) @ bf16(weight))
    assert torch.equal(grad_weight, bf16(upstream).T @ bf16(hidden))
    assert not torch.equal(out, expected)  # the rounding is real


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("banned_id", [None, 3])
def test_chunked_head_gradient_is_autograds(precision, entropy_grad, banned_id):
    """logprobs._ChunkedHead, the written-out gradient of the chunked LM head (several chunks
    under autograd): logprobs and entropies bit for bit those of the no-gradient path (the same
    chunks), and d/d(hidden, W) of sum(a * logprob + b * entropy) equal to autograd's through one
    full log-softmax of the same products (float64 for fp32: 1e-12; bf16, emulated: 1e-4), with
    banned tokens and a temperature."""
    g = torch.Generator().manual_seed(1)
    head, hidden, tokens, banned = _tiny_head_and_tokens(g, 6, banned_id)
    a, b = torch.randn(13, generator=g), torch.randn(13, generator=g)
    args = (hidden, head.weight, tokens, 0.7, banned, entropy_grad, precision, 4, None)
    token_logprobs, entropy = logprobs._ChunkedHead.apply(*args)
    assert entropy.requires_grad == entropy_grad
    with torch.no_grad():
        if precision == "fp32":  # the trainer's own no-gradient path (a CPU: IEEE fp32)
            no_grad = logprobs.token_logprobs_and_entropy(
                hidden,
                tokens,
                head,
                logprobs.LogprobSettings(temperature=0.7, chunk_size=4, banned=banned),
            )
        else:
            chunks = [
                logprobs._logprob_entropy_chunk(
                    head.weight, hidden[i : i + 4], tokens[i : i + 4], 0.7, banned, False, precision
                )
                for i in range(0, 13, 4)
            ]
            no_grad = [torch.cat(values) for values in zip(*chunks)]
    assert torch.equal(token_logprobs, no_grad[0]) and torch.equal(entropy, no_grad[1])
    objective = (a * token_logprobs).sum() + ((b * entropy).sum() if entropy_grad else 0)
    got = torch.autograd.grad(objective, (hidden, head.weight))
    token_logprobs, entropy = logprobs._logprob_entropy_chunk(
        head.weight, hidden, tokens, 0.7, banned, entropy_grad, precision
    )
    objective = (a * token_logprobs).sum() + ((b * entropy).sum() if entropy_grad else 0)
    expected = torch.autograd.grad(objective, (hidden, head.weight))
    # bf16: each side rounds d/dz to bf16 before the products, and a last-digit difference in
    # float64 can flip a rounding (one bf16 ulp of one element: ~1e-5 here)
    tolerance = 1e-12 if precision == "fp32" else 1e-4
    for x, y in zip(got, expected):
        assert torch.allclose(x, y.to(x.dtype), atol=tolerance, rtol=0)


@pytest.mark.usefixtures("float64_default")
def test_head_precision_rounding_emulation():
    """bench/head_precision.py's rounding: 7 mantissa bits is bfloat16 exactly (torch rounds to
    nearest even); 10 bits (TF32) keeps the top 19 bits, within half a TF32 ulp, ties to even."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import head_precision as H

    x = torch.randn(10000, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 50
    assert torch.equal(H.round_mantissa(x, 7), x.to(torch.bfloat16).float())
    tf32 = H.round_mantissa(x, 10)
    assert (tf32.view(torch.int32) & 0x1FFF == 0).all()
    assert ((tf32 - x).abs() <= x.abs() * 2.0**-11).all() and (tf32 != x).any()
    # halfway: to the even neighbour
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11], dtype=torch.float32)
    assert H.round_mantissa(ties, 10).tolist() == [1.0, 1 + 4 * 2**-11]


@pytest.mark.usefixtures("float64_default")
def test_head_inputs_file_gives_back_the_weight_bit_for_bit(tmp_path):
    """bench/head_precision.py's HEAD_INPUTS file (what a GPU machine without the model reads):
    a weight that is a float16 scale per 32 weights times an int8 (GGUF Q8_0, SmolLM2's token
    embedding) comes back with every float32 bit, the hidden states and tokens unchanged; a weight
    of another form is refused, not stored approximately."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import head_precision as H

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (64, 3, 32), generator=g).float()
    q[:, :, 0] = 127  # Q8_0 maps each block's largest |w| to +-127
    q[5, 1] = 0  # an all-zero block
    scale = (torch.rand(64, 3, 1, generator=g) * 1e-2).half().float()
    weight = (q * scale).reshape(64, 96)
    hidden = torch.randn(7, 96, generator=g)
    tokens = torch.randint(0, 64, (7,), generator=g)
    H.save_head_inputs(tmp_path / "inputs.pt", hidden, weight, tokens)
    got_hidden, got_weight, got_tokens = H.load_head_inputs(tmp_path / "inputs.pt")
    assert torch.equal(got_weight.view(torch.int32), weight.view(torch.int32))
    assert torch.equal(got_hidden, hidden) and torch.equal(got_tokens, tokens)
    with pytest.raises(ValueError, match="cannot be stored exactly"):
        H.save_head_inputs(tmp_path / "no.pt", hidden, torch.randn(64, 96, generator=g), tokens)


@pytest.mark.usefixtures("float64_default")
def test_lm_head_tf32_error_on_smollm2_is_within_a_quarter_of_bf16_logits():
    """The head precision choice, measured on SmolLM2-135M-Instruct's real weights
    (Q4_1-de-quantised) and a real forward's hidden states, against a float64 head: the logprob
    error of TF32 (the CUDA bf16 path) is <= 1/4 of what bf16-rounded logits (verl's and TRL's head
    under autocast) cost, max and mean; bf16 inputs with an fp32 output are not (why TF32); the
    CPU's IEEE fp32 head is ~1e-5. CPU emulation (bench/head_precision.py); the numbers are in
    docs/logprobs.md#lm-head-precision, the real TF32 product is checked by
    scripts/gpu_check.sh."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import head_precision as H

    if not os.path.isfile(os.path.join(H.SMOLLM2, "model.safetensors")):
        pytest.skip(f"SmolLM2 is not converted at {H.SMOLLM2}: run python scripts/get_smollm2.py")
    hidden, weight, tokens = H.smollm2_hidden()
    errors = H.logprob_errors(H.emulated_logits(hidden, weight), hidden, weight, tokens)
    print({name: f"max {mx:.2e} mean {mean:.2e}" for name, (mx, mean) in errors.items()})
    bf16 = errors["bf16 logits"]
    # the real weights' logits (up to ~43) make bf16 rounding visible: measured 0.108
    assert bf16[0] > 0.05
    assert errors["fp32 (IEEE)"][0] < 1e-4
    assert errors["TF32"][0] <= bf16[0] / 4 and errors["TF32"][1] <= bf16[1] / 4
    assert errors["bf16 inputs, fp32 output"][0] > bf16[0] / 4


# ---------------------------------------------------------------------------------------------------------------
# Truncated sampling (--top-k / --top-p / --min-p): the kept set and its replay
# ---------------------------------------------------------------------------------------------------------------

TRUNCATIONS = [(5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.05), (5, 0.8, 0.05), (3, 0.5, 0.2)]


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("top_k, top_p, min_p", TRUNCATIONS)
def test_truncation_mask_is_transformers_and_vllms_rules(top_k, top_p, min_p):
    """logprobs.truncation_mask keeps exactly the tokens transformers' warpers keep (TopK,
    TopP, MinP, in generate()'s order) and exactly those vLLM's sampler keeps (its min-p logits
    processor, then apply_top_k_top_p), on float32 logits / T with ties at the k-th value."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    z = (torch.randn(64, 50, generator=g, dtype=torch.float32) * 2).round(decimals=1)
    ids = torch.zeros(64, 1, dtype=torch.long)
    hf = z.clone()
    if top_k:
        hf = TopKLogitsWarper(top_k)(ids, hf)
    if top_p < 1:
        hf = TopPLogitsWarper(top_p)(ids, hf)
    if min_p:
        hf = MinPLogitsWarper(min_p)(ids, hf)
    ours = logprobs.truncation_mask(z, top_k, top_p, min_p, "hf")
    assert torch.equal(ours, hf > -math.inf)
    assert (ours.sum(-1) >= 1).all() and not ours.all()
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    engine = z.clone()
    if min_p:
        processor = object.__new__(MinPLogitsProcessor)
        processor.min_p_count = 1
        processor.min_p = torch.full((64, 1), min_p)
        engine = processor.apply(engine)
    k = torch.full((64,), top_k) if top_k else None
    p = torch.full((64,), top_p) if top_p < 1 else None
    engine = apply_top_k_top_p_pytorch(engine, k, p)
    assert torch.equal(logprobs.truncation_mask(z, top_k, top_p, min_p, "vllm"), engine > -math.inf)


@pytest.mark.usefixtures("float64_default")
def test_truncated_logprob_is_the_full_one_minus_log_kept_mass():
    """The closed form of the mismatch: a token drawn from the kept set K has log pi_K = log pi -
    log S (S = the kept mass), so scoring it over the whole vocabulary gives a log-ratio of log S
    before any update; replay (truncation=...) gives log pi_K. Logits 2, 1, 0, -1 at T = 1, top-k
    2: K = {0, 1}, S = (e^2 + e) / (e^2 + e + 1 + e^-1), by hand."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 2, dtype=torch.float64)
    tokens = torch.tensor([0, 1])
    full, _ = logprobs.token_logprobs_and_entropy(logits, tokens, None, logprobs.LogprobSettings())
    kept, entropy = logprobs.token_logprobs_and_entropy(
        logits,
        tokens,
        None,
        logprobs.LogprobSettings(temperature=1.0, truncation=(2, 1.0, 0.0, "hf")),
    )
    e = math.e
    log_s = math.log((e**2 + e) / (e**2 + e + 1 + 1 / e))
    assert torch.allclose(full - kept, torch.full((2,), log_s, dtype=torch.float64), atol=1e-12)
    assert math.isclose(kept[0].item(), math.log(e**2 / (e**2 + e)), abs_tol=1e-12)
    # the entropy of the distribution sampled from: two tokens, p = e / (e + 1) and 1 / (e + 1)
    p = e / (e + 1)
    assert math.isclose(entropy[0].item(), -(p * math.log(p) + (1 - p) * math.log(1 - p)))


@pytest.mark.usefixtures("float64_default")
def test_a_sampled_token_outside_the_recomputed_kept_set_stays_in_it():
    """Replay recomputes K from the scoring model's logits; a sampled token that this K leaves out
    (rounding at a boundary, or another model: pi_theta after an update, pi_ref) is scored over K
    + the token, never log 0. Logits 2, 1, 0, -1, top-k 2, token 3: K = {0, 1, 3}, by hand."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    token_logprobs, entropy = logprobs.token_logprobs_and_entropy(
        logits,
        torch.tensor([3]),
        None,
        logprobs.LogprobSettings(temperature=1.0, truncation=(2, 1.0, 0.0, "hf")),
    )
    e = math.e
    assert math.isclose(
        token_logprobs.item(), math.log((1 / e) / (e**2 + e + 1 / e)), abs_tol=1e-12
    )
    p = torch.tensor([e**2, e, 1 / e], dtype=torch.float64) / (e**2 + e + 1 / e)
    assert math.isclose(entropy.item(), -(p * p.log()).sum().item(), abs_tol=1e-12)


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_head_gradient_with_a_replayed_kept_set_is_autograds(entropy_grad):
    """The written-out gradient with truncation (top-k 3, top-p 0.8, min-p 0.05): d/dz is zero
    outside the kept set (+ the sampled token) and equals autograd's through the masked
    log-softmax (float64)."""
    g = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(6, 11, bias=False)
    head.weight = torch.nn.Parameter(torch.randn(11, 6, generator=g))
    hidden = torch.randn(13, 6, generator=g).requires_grad_()
    truncation = (3, 0.8, 0.05, "hf")
    with torch.no_grad():
        kept = logprobs.truncation_mask((hidden @ head.weight.T) / 0.7, *truncation)
    # each token one its sampler could have drawn, and three the recomputed set leaves out
    tokens = kept.float().multinomial(1, generator=g)[:, 0]
    tokens[:3] = (~kept[:3]).float().multinomial(1, generator=g)[:, 0]
    a, b = torch.randn(13, generator=g), torch.randn(13, generator=g)
    args = (hidden, head.weight, tokens, 0.7, None, entropy_grad, "fp32", 4, truncation)
    token_logprobs, entropy = logprobs._ChunkedHead.apply(*args)
    objective = (a * token_logprobs).sum() + ((b * entropy).sum() if entropy_grad else 0)
    got = torch.autograd.grad(objective, (hidden, head.weight))
    token_logprobs, entropy = logprobs._logprob_entropy_chunk(
        head.weight, hidden, tokens, 0.7, None, entropy_grad, "fp32", truncation
    )
    objective = (a * token_logprobs).sum() + ((b * entropy).sum() if entropy_grad else 0)
    expected = torch.autograd.grad(objective, (hidden, head.weight))
    for x, y in zip(got, expected):
        assert torch.allclose(x, y, atol=1e-12, rtol=0)


# --------------------------------------------------------------------------------------------------
# Padding-free micro-batches: the packed and trimmed layouts give the padded path's numbers
# --------------------------------------------------------------------------------------------------


def ragged_batch(pad_id, vocab, seed=0):
    """rollout.make_batch's tensors for 6 rows: left-padded prompts of 1 to 7 tokens, responses of
    0 (all padding) to R = 6 tokens, one a multi-turn response whose middle tokens a tool inserted
    (response_mask 0 there, attended to)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths, response_lengths = (2, 7, 3, 1, 5, 4), (1, 6, 3, 0, 4, 6)
    prompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in prompt_lengths]
    responses = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in response_lengths]
    masks = [[1] * len(r) for r in responses]
    masks[5] = [1, 1, 0, 0, 1, 1]  # tokens 2-3: a tool's answer
    zeros = [[0.0] * len(r) for r in responses]
    return rollout.make_batch(prompts, responses, zeros, pad_id, 6, CPU, model_masks=masks)


def smollm2():
    """SmolLM2-135M-Instruct in float32 and its tokenizer (skips where it is not converted)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"SmolLM2 is not converted at {path}: run python scripts/get_smollm2.py")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize(
    "arch, attention",
    [
        ("qwen2", "sdpa"),
        ("qwen2", logprobs.VARLEN_SDPA),
        ("gpt2", "sdpa"),
        ("gpt2", logprobs.VARLEN_SDPA),
        ("smollm2", logprobs.VARLEN_SDPA),
    ],
)
def test_packed_and_trimmed_layouts_equal_the_padded_path(arch, attention):
    """response_logprobs over the packed layout (logprobs.pack_sequences: the real tokens side by
    side, position ids restarting per sequence; sdpa's block-causal mask over rows as wide as the
    longest sequence, or one row and each sequence's own attention, VARLEN_SDPA) and the trimmed
    one against the padded batch, for the tiny Qwen2 (grpo.py tiny's), the tiny GPT-2 (learned
    absolute positions) and SmolLM2 (Llama), CPU fp32: logprobs and entropies within 16 eps32 of
    their largest entry (measured: bit-identical with sdpa's mask, at most 4.8 eps32 with
    VARLEN_SDPA); the gradient of a weighted sum of both as close to the float64 gradient as the
    padded path's is, within 2x over every tensor (measured on SmolLM2: padded 1818 eps32 off the
    float64 one at worst, a norm weight's gradient summing terms that cancel; packed 1834). The
    padded path is the same under VARLEN_SDPA, bit for bit; trimmed is the padded path's numbers,
    bit for bit."""
    if arch == "smollm2":
        model, tokenizer = smollm2()
    else:
        torch.manual_seed(0)
        model, tokenizer = __import__("tasks").build_tiny_model(None, arch=arch)
        model.eval()
    batch = ragged_batch(tokenizer.pad_token_id, min(len(tokenizer), 200))
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))

    def run(model, layout):
        model.zero_grad()
        settings = logprobs.LogprobSettings(layout=layout)
        lp, entropy = logprobs.response_logprobs(model, batch, settings, entropy_grad=True)
        (lp * weights.to(lp.dtype) + entropy).sum().backward()
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        return lp.detach(), entropy.detach(), grads

    torch.set_default_dtype(torch.float64)
    try:
        float64 = run(copy.deepcopy(model).double(), "padded")[2]
    finally:
        torch.set_default_dtype(torch.float32)
    padded_lp, padded_entropy, padded_grads = run(model, "padded")
    assert (padded_lp[batch["response_mask"] == 0] == 0).all() and padded_lp[3].eq(0).all()
    if attention == logprobs.VARLEN_SDPA:
        assert logprobs.use_varlen_attention(model)
        again = run(model, "padded")
        assert torch.equal(again[0], padded_lp) and torch.equal(again[1], padded_entropy)
        assert all(torch.equal(a, b) for a, b in zip(again[2], padded_grads))
    assert logprobs.packing_is_exact(model)
    padded_error = max(float32_error(g, g64) for g, g64 in zip(padded_grads, float64))
    for layout in ("packed", "trimmed"):
        lp, entropy, grads = run(model, layout)
        assert_float32_close(lp, padded_lp, terms=16, what=f"{layout} logprobs")
        assert_float32_close(entropy, padded_entropy, terms=16, what=f"{layout} entropy")
        assert len(grads) == len(padded_grads)
        if layout == "trimmed":
            assert torch.equal(lp, padded_lp) and torch.equal(entropy, padded_entropy)
            assert all(torch.equal(a, b) for a, b in zip(grads, padded_grads))
        error = max(float32_error(g, g64) for g, g64 in zip(grads, float64))
        assert error <= 2 * padded_error, (layout, error, padded_error)


def test_pack_sequences_by_hand():
    """Three sequences of 3, 2 and 4 real tokens (prompt + response) in rows of width 5: the
    longest first (row 0: the 4-token one and a filler), then the 3- and 2-token ones together
    (row 1); each sequence's positions from 0, the filler's from 0; `predicts` points at the
    packed place of the token before each response token."""
    # prompts 2, 1, 3 tokens (P = 3), responses 1, 1, 1 token (R = 2)
    batch = rollout.make_batch(
        [[11, 12], [21], [31, 32, 33]], [[13], [22], [34]], [[0.0]] * 3, 0, 2, CPU
    )
    packed = logprobs.pack_sequences(batch, width=5)
    # (the filler's token: the batch's first real one)
    assert packed["input_ids"].tolist() == [[31, 32, 33, 34, 11], [11, 12, 13, 21, 22]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    # response token 0 of row 0 (13) is predicted by 12, at flat place 5 + 1 = 6; row 1's (22) by
    # 21 at 5 + 3 = 8; row 2's (34) by 33 at 2
    valid = batch["response_mask"].bool()
    assert packed["predicts"][valid].tolist() == [6, 8, 2]
    # width = every token: one row
    assert logprobs.pack_sequences(batch, width=9)["input_ids"].shape == (1, 9)


def test_the_packing_probe_refuses_attention_that_crosses_sequences(tiny, monkeypatch, capsys):
    """A model whose attention ignores the position ids' sequence boundaries (here: an all-ones
    attention mask handed to every forward, so transformers builds a plain causal mask over the
    packed row) fails logprobs.packing_is_exact, and grpo.py then trims instead of packing, said
    once; the tiny model as it is passes."""
    model, _ = tiny
    args = grpo.PRESETS["tiny"][1]
    assert logprobs.packing_is_exact(model)
    assert grpo.logprob_settings(args, model).layout == "packed"
    import dataclasses

    unpacked = dataclasses.replace(args, use_remove_padding=False)
    assert grpo.logprob_settings(unpacked, model).layout == "padded"
    original = model.forward

    def forward_with_a_full_mask(input_ids=None, **kwargs):
        kwargs["attention_mask"] = torch.ones_like(input_ids)
        return original(input_ids=input_ids, **kwargs)

    monkeypatch.setattr(model, "forward", forward_with_a_full_mask)
    assert not logprobs.packing_is_exact(model)
    assert grpo.logprob_settings(args, model).layout == "trimmed"
    assert "does not keep packed sequences apart" in capsys.readouterr().out
