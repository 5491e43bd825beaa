"""tools.py and the multi-turn rollout (rollout.sample_turns): the tokens between two model turns
are the chat template's (SmolLM2's and the tiny model's), the model's tokens are the sampled ids,
a tool's tokens are invisible to every correction, loss term, metric and gradient, every failing
call gives its documented output, and a tiny_tools run learns to call the tool and resumes exactly
after SIGKILL (budget: 150 s)."""

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tests"))

import corrections  # noqa: E402
import grpo  # noqa: E402
import logprobs  # noqa: E402
import objectives  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
import tools  # noqa: E402
from minibatch_gradient import pi_old_and_ref  # noqa: E402

CPU = torch.device("cpu")


class ScriptedEngine:
    """An engine whose turns are given: request k returns turns[k] for every row it is asked
    for, with logprob -(position + 1) / 10 per token; it records every request's prompts."""

    def __init__(self, turns, eos_token_id):
        self.turns = turns
        self.eos_token_id = eos_token_id
        self.requests = []

    def generate(self, prompt_token_ids, n, max_new_tokens, temperature, seed):
        turn = self.turns[len(self.requests)]
        self.requests.append([list(p) for p in prompt_token_ids])
        rows = len(prompt_token_ids) * n
        ids = turn[:max_new_tokens]
        logprobs = [-(i + 1) / 10 for i in range(len(ids))]
        reason = "stop" if ids and ids[-1] == self.eos_token_id else "length"
        return [list(ids)] * rows, [list(logprobs)] * rows, [reason] * rows


def _environment(tokenizer, syntax, names=("calculator", "lookup"), max_output_tokens=64):
    return tools.ToolEnvironment(tokenizer, tools.make_tools(names), syntax, max_output_tokens, 5.0)


# --------------------------------------------------------------------------------------------------
# (a) token in, token out: the tokens between two model turns are the chat template's
# --------------------------------------------------------------------------------------------------


def _conversation_tokens(tokenizer, prompt_ids, turn_texts, output, environment):
    """sample_turns on a scripted two-turn conversation: the call, then the answer."""
    eos = tokenizer.eos_token_id
    turns = [tokenizer.encode(text, add_special_tokens=False) + [eos] for text in turn_texts]
    engine = ScriptedEngine(turns, eos)
    result = rollout.sample_turns(engine, environment, [prompt_ids], 1, 256, 1.0, 0, 4)
    return turns, engine, result


def test_the_tokens_between_turns_are_smollm2s_chat_template_token_for_token():
    """SmolLM2's template on user -> assistant (a calculator call) -> tool -> assistant: the
    rollout's prompt + response is the template's rendering of those four messages, token for
    token (its final newline after the last <|im_end|> is not sampled), the model's tokens are the
    sampled ids with their logprobs, the tool's are mask 0 with the placeholder. The same with the
    turn separator dropped (verl #6921's bug: the newline after the assistant's <|im_end|>) differs
    from the template: the test that would have caught it."""
    from transformers import AutoTokenizer

    if not os.path.isdir(tasks.SMOLLM2_PATH):
        pytest.skip("needs the converted SmolLM2 (bash scripts/setup_cpu.sh)")
    tokenizer = AutoTokenizer.from_pretrained(tasks.SMOLLM2_PATH)
    environment = _environment(tokenizer, "chat")
    user = {"role": "user", "content": "What is 3 * (4 + 5)?"}
    prompt_ids = tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=True)
    prompt_ids = list(getattr(prompt_ids, "input_ids", prompt_ids))
    call = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>'
    )
    answer = "The answer is 27."
    turns, engine, result = _conversation_tokens(
        tokenizer, prompt_ids, [call, answer], "27", environment
    )
    response_ids, rollout_logprobs, masks, reasons, calls, failures = result
    assert (reasons, calls, failures) == (["stop"], [1], [0])
    messages = [
        user,
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "27"},
        {"role": "assistant", "content": answer},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.endswith("<|im_end|>\n")
    template_ids = tokenizer.encode(rendered[: -len("\n")], add_special_tokens=False)
    assert prompt_ids + response_ids[0] == template_ids
    # the model's tokens are the sampled ids, each turn where it was sampled, with its logprobs
    first, second = turns
    mask = masks[0]
    assert response_ids[0][: len(first)] == first
    assert response_ids[0][-len(second) :] == second
    assert mask == [1] * len(first) + [0] * (len(mask) - len(first) - len(second)) + [1] * len(
        second
    )
    model_logprobs = [lp for lp, m in zip(rollout_logprobs[0], mask) if m]
    assert model_logprobs == [-(i + 1) / 10 for i in range(len(first))] + [
        -(i + 1) / 10 for i in range(len(second))
    ]
    assert all(
        lp == rollout.TOOL_TOKEN_LOGPROB for lp, m in zip(rollout_logprobs[0], mask) if not m
    )
    inserted = tokenizer.decode([t for t, m in zip(response_ids[0], mask) if not m])
    assert inserted == "\n<|im_start|>tool\n27<|im_end|>\n<|im_start|>assistant\n"
    # the second request is the whole prefix so far: the prompt, the call, the tool's tokens
    assert engine.requests[1] == [prompt_ids + response_ids[0][: -len(second)]]

    class DroppedSeparator(tools.ToolEnvironment):
        def suffix_ids(self, output):
            return super().suffix_ids(output)[1:]  # the "\n" after <|im_end|> left out

    dropped = DroppedSeparator(tokenizer, environment.tools, "chat", 64, 5.0)
    _, _, (dropped_ids, *_) = _conversation_tokens(
        tokenizer, prompt_ids, [call, answer], "27", dropped
    )
    assert prompt_ids + dropped_ids[0] != template_ids


def test_the_tiny_template_is_the_format_the_tiny_base_is_pretrained_on(tiny):
    """The tiny tokenizer's tag syntax: "abcd=" "(lookup abcd)[EOS]" "#<value>\\n" "<value>[EOS]",
    the transcript tasks.pretrain_tiny_model writes for the lookup task, and the tool's answer is
    lookup_table's value."""
    _, tokenizer = tiny
    environment = _environment(tokenizer, "tags", ("lookup",))
    value = tasks.lookup_table()["abcd"]
    prompt_ids = tokenizer.encode("abcd=", add_special_tokens=False)
    _, _, (response_ids, _, masks, reasons, calls, _) = _conversation_tokens(
        tokenizer, prompt_ids, ["(lookup abcd)", value], value, environment
    )
    assert (reasons, calls) == (["stop"], [1])
    text = tokenizer.decode(response_ids[0], skip_special_tokens=False)
    assert text == f"(lookup abcd)[EOS]#{value}\n{value}[EOS]"
    assert masks[0] == [1] * 14 + [0] * 5 + [1] * 4
    assert tokenizer.decode(tools.final_turn(response_ids[0], masks[0])) == value + "[EOS]"


def test_the_labs_dropped_separator_changes_the_engines_history_only(tiny):
    """--tool-history-mismatch drop_separator: the engine's second request continues a history
    without the first inserted token ("#"), while the response (what the trainer trains on) holds
    the template's tokens, exactly as without the mismatch."""
    _, tokenizer = tiny
    prompt_ids = tokenizer.encode("abcd=", add_special_tokens=False)
    value = tasks.lookup_table()["abcd"]
    results = {}
    for mismatch in ("none", "drop_separator"):
        environment = tools.ToolEnvironment(
            tokenizer, tools.make_tools(["lookup"]), "tags", 64, 5.0, mismatch
        )
        results[mismatch] = _conversation_tokens(
            tokenizer, prompt_ids, ["(lookup abcd)", value], value, environment
        )
    (_, exact_engine, exact), (_, lab_engine, lab) = results["none"], results["drop_separator"]
    assert lab == exact  # the same response ids, logprobs, masks, reasons, calls
    first_turn = prompt_ids + tokenizer.encode("(lookup abcd)", add_special_tokens=False)
    first_turn += [tokenizer.eos_token_id]
    separator = tokenizer.encode("#", add_special_tokens=False)
    rest = tokenizer.encode(value + "\n", add_special_tokens=False)
    assert exact_engine.requests[1] == [first_turn + separator + rest]
    assert lab_engine.requests[1] == [first_turn + rest]


def test_the_turn_limit_the_length_limit_and_a_turn_without_a_call_end_a_response(tiny):
    """A third call with --max-assistant-turns 3 ends the response there (max_turns, the call
    unanswered), a tool's answer that does not fit ends it (length), a turn that calls nothing
    ends it (stop)."""
    _, tokenizer = tiny
    environment = _environment(tokenizer, "tags", ("lookup",))
    prompt = [tokenizer.encode("abcd=", add_special_tokens=False)]
    eos = tokenizer.eos_token_id
    call = tokenizer.encode("(lookup abcd)", add_special_tokens=False) + [eos]
    engine = ScriptedEngine([call, call, call], eos)
    _, _, masks, reasons, calls, _ = rollout.sample_turns(
        engine, environment, prompt, 2, 100, 1.0, 0, 3
    )
    assert reasons == ["max_turns"] * 2 and calls == [2, 2]
    assert masks[0] == [1] * 14 + [0] * 5 + [1] * 14 + [0] * 5 + [1] * 14
    engine = ScriptedEngine([call, call], eos)
    response_ids, _, masks, reasons, calls, _ = rollout.sample_turns(
        engine, environment, prompt, 1, 14 + 5, 1.0, 0, 3
    )
    assert reasons == ["length"] and calls == [0] and masks[0] == [1] * 14
    engine = ScriptedEngine([tokenizer.encode("bca", add_special_tokens=False) + [eos]], eos)
    _, _, masks, reasons, calls, _ = rollout.sample_turns(
        engine, environment, prompt, 1, 100, 1.0, 0, 3
    )
    assert reasons == ["stop"] and calls == [0] and len(engine.requests) == 1


# --------------------------------------------------------------------------------------------------
# (e) every failing call gives its documented output, never an exception
# --------------------------------------------------------------------------------------------------


def test_every_failing_call_gives_its_documented_output(tiny):
    _, tokenizer = tiny
    chat = _environment(tokenizer, "chat")
    tags = _environment(tokenizer, "tags")

    def chat_call(body):
        return chat.respond(f"sure <tool_call>{body}</tool_call>")

    assert chat.respond("no call here") is None and tags.respond("bca") is None
    assert chat_call('{"name": "calculator", "arguments": {"expression": "1/3 + 0.5"}}') == (
        "5/6",
        False,
    )
    assert chat_call('[{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}]') == (
        "6",
        False,
    )
    assert tags.respond("(calculator 2*(3+4))") == ("14", False)
    malformed = "error: malformed tool call: "
    assert chat.respond("<tool_call>{") == (
        malformed + "a <tool_call> without its </tool_call>",
        True,
    )
    assert chat_call("{not json") == (malformed + "the tool call is not valid JSON", True)
    assert chat_call('{"arguments": {}}') == (malformed + 'the tool call has no "name"', True)
    assert chat_call('{"name": "lookup", "arguments": 3}') == (
        malformed + 'the tool call\'s "arguments" is not an object',
        True,
    )
    assert chat_call("[" * 100_000) == (malformed + "the tool call is not valid JSON", True)
    assert tags.respond("(lookup abcd") == (malformed + "expected (name argument)", True)
    assert tags.respond("(search abcd)") == (
        "error: unknown tool 'search' (tools: calculator, lookup)",
        True,
    )
    assert chat_call('{"name": "lookup", "arguments": {"query": "abcd"}}') == (
        "error: lookup takes one argument, 'key'",
        True,
    )
    assert tags.respond("(lookup zzzz)") == (
        "error: lookup failed: KeyError: \"no entry 'zzzz'\"",
        True,
    )
    assert tags.respond("(calculator 1/0)") == (
        "error: calculator failed: ValueError: cannot evaluate '1/0'",
        True,
    )

    def slow(argument):
        time.sleep(2)
        return "late"

    def long(argument):
        return "ab" * 100

    extra = {
        "slow": tools.Tool("slow", "x", slow, "sleeps"),
        "long": tools.Tool("long", "x", long, "talks"),
    }
    limited = tools.ToolEnvironment(tokenizer, extra, "tags", 40, 0.2)
    start = time.time()
    assert limited.respond("(slow 1)") == ("error: slow did not finish in 0.2 s", True)
    assert time.time() - start < 1.5
    assert limited.respond("(long 1)") == (
        "ab" * 20 + tools.ToolEnvironment.TRUNCATED_MARK,
        False,
    )


# --------------------------------------------------------------------------------------------------
# (b, c) a tool's tokens are read by nothing: placeholders change no number, their gradient is 0
# --------------------------------------------------------------------------------------------------

PROMPTS, N, R = 4, 4, 12


def _multi_turn_batch(model, tokenizer, placeholder, seed=0):
    """A fixed batch of multi-turn responses: random tokens, each response with one or two runs of
    tool tokens (mask 0), rollout logprobs = the model's + noise on model tokens, `placeholder`
    (a float, or "random") on tool tokens; advantages from random scores."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 40, (int(k),), generator=g).tolist() for k in (2, 3, 4, 5)]
    responses, masks = [], []
    for _ in range(PROMPTS * N):
        length = int(torch.randint(6, R + 1, (1,), generator=g))
        mask = [1] * length
        start = int(torch.randint(1, length - 3, (1,), generator=g))
        for i in range(start, start + int(torch.randint(1, 3, (1,), generator=g))):
            mask[i] = 0
        if length > 9:
            mask[length - 3] = 0
        responses.append(torch.randint(3, 40, (length,), generator=g).tolist())
        masks.append(mask)
    batch = rollout.make_batch(
        [p for p in prompts for _ in range(N)],
        responses,
        [[0.0] * len(r) for r in responses],
        tokenizer.pad_token_id,
        R,
        CPU,
        model_masks=masks,
    )
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits[:, -R - 1 : -1]
        exact = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"][..., None])[
            ..., 0
        ]
    noise = 0.3 * torch.randn(exact.shape, generator=g)
    model_token = batch["response_mask"].bool()
    if placeholder == "random":
        tool_values = 5 * torch.randn(exact.shape, generator=torch.Generator().manual_seed(99))
    else:
        tool_values = torch.full(exact.shape, float(placeholder))
    padding = batch["attention_mask"][:, -R:] == 0
    batch["rollout_logprobs"] = torch.where(
        model_token, exact + noise, torch.where(padding, 0.0, tool_values)
    )
    scores = torch.rand(PROMPTS * N, generator=g)
    return batch, scores


def _step(model, ref_model, batch, scores, args, preset):
    """grpo.train()'s steps 3-5 on `batch`: pi_old, the correction, pi_ref, advantages, one update;
    returns (every metric, the updated parameters)."""
    model = copy.deepcopy(model)
    batch = dict(batch)
    correction = corrections.RolloutCorrection.from_name(preset)
    metrics = pi_old_and_ref(model, ref_model, batch, args, correction)
    group_ids = torch.arange(PROMPTS).repeat_interleave(N)
    if args.adv_estimator in objectives.TOKEN_LEVEL_ESTIMATORS:
        _, sum_pi_squared, _ = grpo.compute_pi_old(
            model, batch, args, grpo.logprob_settings(args, model), correction
        )
        lengths = batch["attention_mask"][:, -R:].sum(-1)
        batch["advantages"] = objectives.optimal_token_baseline_advantages(
            scores,
            group_ids,
            lengths,
            batch["old_logprobs"],
            sum_pi_squared,
            batch["loss_mask"],
            batch.get("is_weights"),
        )
    else:
        batch["advantages"] = grpo.compute_advantages(
            scores, group_ids, batch["loss_mask"].sum(-1), None, args, CPU
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    metrics |= grpo.update_policy(
        model, optimizer, batch, args, correction, grpo.logprob_settings(args, model)
    )
    metrics |= grpo.step_metrics(0, args, scores, batch, ["stop"] * len(scores), [[1]])
    for key in ("advantages", "loss_mask"):
        metrics[key] = batch[key]
    # (bypass mode: pi_old is pi_rollout, the placeholders included; read under the mask only)
    metrics["old_logprobs"] = torch.where(batch["response_mask"].bool(), batch["old_logprobs"], 0)
    return metrics, [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b) or (a.isnan().all() and b.isnan().all())
    return a == b or (a != a and b != b)


COMBINATIONS = (
    [(preset, "vanilla", "grpo") for preset in corrections.PRESETS]
    + [
        (preset, loss, "grpo")
        for loss in objectives.POLICY_LOSSES
        if loss != "vanilla"
        for preset in ("decoupled_token_is", "bypass_ppo_clip")
    ]
    + [("decoupled_geo_rs_token_tis", "vanilla", "optimal_token_baseline")]
)


@pytest.fixture(scope="module")
def models(tiny):
    model, tokenizer = tiny
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref_model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    return model, ref_model, tokenizer


@pytest.mark.parametrize("preset, policy_loss, estimator", COMBINATIONS)
def test_tool_token_placeholders_change_no_number(models, preset, policy_loss, estimator):
    """With the tool tokens' placeholder logprobs 0.0, 1.0 and random (N(0, 25)), every
    correction output, metric, advantage and updated weight is bitwise the same, for every
    correction preset (the vanilla loss) and every policy loss (decoupled and bypass), with the
    KL and entropy terms on."""
    model, ref_model, tokenizer = models
    args = dataclasses.replace(
        grpo.PRESETS["tiny"][1],
        cuda=False,
        rollout_n=N,
        train_batch_size=PROMPTS,
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=4,
        max_response_length=R,
        policy_loss=policy_loss,
        adv_estimator=estimator,
        correction=preset,
        kl_loss_coef=0.01,
        entropy_coeff=0.01,
        dro_beta=0.1 if policy_loss == "dro" else 0.0,
    )
    results = []
    for placeholder in (0.0, 1.0, "random"):
        batch, scores = _multi_turn_batch(model, tokenizer, placeholder)
        results.append(_step(model, ref_model, batch, scores, args, preset))
    (metrics, weights), others = results[0], results[1:]
    for other_metrics, other_weights in others:
        assert metrics.keys() == other_metrics.keys()
        for key in metrics:
            assert _same(metrics[key], other_metrics[key]), key
        assert all(torch.equal(a, b) for a, b in zip(weights, other_weights))
    # the batch really has tool tokens, and the update moved the weights
    assert (batch["response_mask"] == 0).logical_and(batch["attention_mask"][:, -R:] == 1).any()
    assert any(not torch.equal(a, b) for a, b in zip(weights, model.parameters()))


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_the_gradient_at_tool_token_positions_is_exactly_zero(models, remove_padding):
    """The hidden states (hence the logits) that predict a tool's token get gradient exactly 0
    from every loss term, and those that predict a model token do not: in the padded layout and
    in the packed one (its places found through logprobs.pack_sequences' `predicts`)."""
    model, ref_model, tokenizer = models
    model = copy.deepcopy(model)
    args = dataclasses.replace(
        grpo.PRESETS["tiny"][1],
        use_remove_padding=remove_padding,
        cuda=False,
        rollout_n=N,
        train_batch_size=PROMPTS,
        ppo_mini_batch_size=PROMPTS,
        ppo_micro_batch_size_per_gpu=PROMPTS * N,
        max_response_length=R,
        correction="decoupled_token_is",
        kl_loss_coef=0.01,
        entropy_coeff=0.01,
    )
    batch, scores = _multi_turn_batch(model, tokenizer, "random")
    correction = corrections.RolloutCorrection.from_name(args.correction)
    pi_old_and_ref(model, ref_model, batch, args, correction)
    group_ids = torch.arange(PROMPTS).repeat_interleave(N)
    batch["advantages"] = grpo.compute_advantages(
        scores, group_ids, batch["loss_mask"].sum(-1), None, args, CPU
    )
    captured = {}

    def keep_logits(module, inputs, output):
        if output.requires_grad:  # the update's forward (not a no-grad one)
            output.retain_grad()
            captured["logits"] = output

    # the decoder's last hidden states: the LM head (applied in chunks by logprobs.py) reads them
    handle = model.model.norm.register_forward_hook(keep_logits)

    class Recorder:  # the optimizer: keeps the gradient, changes nothing
        param_groups = [{"params": list(model.parameters()), "lr": 0.0}]

        def zero_grad(self, set_to_none=True):
            pass

        def step(self):
            pass

    grpo.update_policy(
        model, Recorder(), batch, args, correction, grpo.logprob_settings(args, model)
    )
    handle.remove()
    grad = captured["logits"].grad
    if remove_padding:  # (rows, width, H): the packed places that predict each response token
        packed = logprobs.pack_sequences(batch, logprobs.packed_width(model, batch))
        per_position = grad.flatten(0, 1)[packed["predicts"]].abs().sum(-1)
    else:  # (B, P + R, H): position t predicts token t + 1
        per_position = grad[:, -R - 1 : -1].abs().sum(-1)
    tool_token = (batch["response_mask"] == 0) & (batch["attention_mask"][:, -R:] == 1)
    assert tool_token.any()
    assert (per_position[tool_token] == 0).all()
    assert (per_position[batch["response_mask"].bool()] > 0).all()


# --------------------------------------------------------------------------------------------------
# A tiny_tools run: it learns to call the tool; (f) killed with SIGKILL, it resumes exactly
# --------------------------------------------------------------------------------------------------


def _rows(path):
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(("timing/", "time/"))}
        for line in open(path)
    ]


def _tiny_tools_command(output_dir):
    flags = ["--total-steps", "8", "--val-every", "4", "--save-every", "2", "--no-cuda"]
    return [sys.executable, "grpo.py", "tiny_tools", "--output-dir", str(output_dir), *flags]


ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


@pytest.fixture(scope="module")
def tiny_tools_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_tools") / "run"
    subprocess.run(
        _tiny_tools_command(out), cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300
    )
    return out


def test_tiny_tools_learns_to_call_the_lookup_tool(tiny_tools_run):
    """The pretrained base answers without a call (held-out accuracy near 1/64) and calls in about
    1 response of 10 when it samples; in 8 GRPO steps it calls in most responses and answers the
    held-out keys, whose values only the tool knows."""
    rows = _rows(tiny_tools_run / "metrics.jsonl")
    val = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    calls = [r["tools/call_frequency"] for r in rows if "tools/call_frequency" in r]
    assert val[0] <= 0.1 and val[-1] >= 0.8, val
    assert calls[0] <= 0.4 and calls[-1] >= 0.8, calls
    last = rows[-1]
    assert last["num_turns/mean"] > 2.5  # the call, the tool, the answer
    assert last["response_length/tool_tokens_mean"] > 4


def test_a_tiny_tools_run_killed_with_sigkill_resumes_exactly(tiny_tools_run, tmp_path):
    out = tmp_path / "killed"
    process = subprocess.Popen(
        _tiny_tools_command(out),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline:  # kill it after step 3's row: its checkpoint is step 2's
        if metrics.exists() and len(open(metrics).read().splitlines()) >= 4:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(open(metrics).read().splitlines()) < 9
    subprocess.run(
        _tiny_tools_command(out), cwd=ROOT, env=ENV, check=True, capture_output=True, timeout=300
    )
    assert _rows(metrics) == _rows(tiny_tools_run / "metrics.jsonl")
    from safetensors.torch import load_file

    ours = load_file(out / "checkpoint" / "model.safetensors")
    theirs = load_file(tiny_tools_run / "checkpoint" / "model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tools", "search"], "--tools: unknown tool 'search'"),
        (["--async-rollouts"], "--async-rollouts must be off with --tools"),
        (["--sharding", "fsdp2"], "--sharding must be ddp with --tools --backend hf"),
        (["--overlong-buffer-len", "2"], "--overlong-buffer-len must be 0 with --tools"),
        (["--max-assistant-turns", "0"], "--max-assistant-turns must be >= 1"),
        (["--tool-timeout", "0"], "--tool-timeout must be > 0"),
    ],
)
def test_tools_are_refused_where_multi_turn_cannot_run(flags, named, capsys, monkeypatch, tmp_path):
    """Each in one line naming the flag, exit status 2, before any model loads."""
    import transformers

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, **k: pytest.fail("a model was loaded before the bad flag was refused"),
    )
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(["tiny_tools", "--output-dir", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("grpo.py: error: " + named), err
