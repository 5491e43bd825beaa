"""Tests for the smol_sentiment task (rewards.py + ppo_rlhf.py presets on SmolLM2-135M-Instruct):
the lexicon labeller on hand-computed cases, the seeded template openers, the label file it writes
(on the tiny offline model), the presets' batch arithmetic, and the pad token chosen for SmolLM2's
pad = eos tokenizer. Only the last test reads the converted SmolLM2 folder (its tokenizer and
config, not the weights); without it, it fails with the command."""

import dataclasses
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ppo_rlhf  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", 0),
        ("The table is made of wood.", 0),
        ("It was great!", 1),
        ("Great, GREAT, great.", 3),  # case-insensitive, every occurrence counts
        ("a lovely day, but a terrible, terrible night", 1 - 2),
        ("not good", 1),  # no negation handling: a bag of words
        ("goodness greatly", 0),  # whole words only: "goodness" is not "good"
        ("I don't hate it", -1),  # "don't" -> "don", "t"; "hate" counts
        ("happy123sad", 1 - 1),  # digits split words: "happy", "sad"
        (None, 0),
    ],
)
def test_lexicon_sentiment_score_hand_computed(text, expected):
    assert tasks.lexicon_sentiment_score(text) == expected


def test_lexicon_best_of_4_picks_the_highest_and_breaks_ties_at_the_lowest_index():
    assert tasks.lexicon_best_of_4(["bad day", "a day", "good day", "sad day"]) == 2
    assert tasks.lexicon_best_of_4(["a", "b", "c", "d"]) == 0  # all tied at 0
    # tie at +1: the first one
    assert tasks.lexicon_best_of_4(["sad", "good", "sad", "nice"]) == 1
    # all negative
    assert tasks.lexicon_best_of_4(["awful awful", "bad", "awful", "worst worst worst"]) == 1
    # deterministic: the same texts give the same index every time
    texts = ["nice", "lovely", "warm", "calm"]
    assert {tasks.lexicon_best_of_4(texts) for _ in range(5)} == {0}


def test_lexicon_word_lists_are_disjoint_lowercase_words():
    assert not tasks.SENTIMENT_POSITIVE & tasks.SENTIMENT_NEGATIVE
    for word in tasks.SENTIMENT_POSITIVE | tasks.SENTIMENT_NEGATIVE:
        assert tasks.SENTIMENT_WORD.fullmatch(word), word


def test_sentiment_queries_are_seeded_deterministic_and_varied():
    a, b = tasks.sentiment_queries(200, seed=3), tasks.sentiment_queries(200, seed=3)
    assert a == b
    assert tasks.sentiment_queries(50, seed=3) == a[:50]  # a prefix of a longer draw
    assert tasks.sentiment_queries(200, seed=4) != a
    assert len(set(a)) > 150  # 6 x 25 x 8 = 1200 possible openers
    for q in a:
        assert (
            q[0].isupper()
            and not q.endswith(" ")
            and q.split()[-1] in {w.split()[-1] for w in tasks.SENTIMENT_PREDICATES}
        )
    # no opener carries sentiment itself: the continuation has to
    assert all(tasks.lexicon_sentiment_score(q) == 0 for q in tasks.sentiment_queries(2000, seed=0))


def test_make_labels_lexicon_on_the_tiny_model(tmp_path, monkeypatch):
    """The label file has OpenAI's format, `best` is the lexicon labeller's pick, and only decisive
    queries (one sample holds the best score) become labels, in query order, sampled round after
    round until there are enough."""
    policy, tokenizer = tasks.build_tiny_model(str(tmp_path / "policy"), arch="gpt2")
    rollout.never_stop_at_eos(policy)
    # the tiny model writes letters, not English: score a text by its count of "a" (ties happen, as
    # with the lexicon)
    monkeypatch.setattr(tasks, "lexicon_sentiment_score", lambda text: text.count("a"))
    path = tmp_path / "labels.json"
    # 8 labels, seed 1, query 12, response 8, temperature 0.7, rounds of 8 openers
    labels = rewards.make_labels(
        "lexicon", policy.eval(), tokenizer, str(path), 8, 1, 12, 8, 0.7, 8
    )
    assert json.loads(path.read_text()) == labels and len(labels) == 8
    query_ids = [tokenizer.encode(q)[:12] for q in tasks.sentiment_queries(400, seed=1)]
    positions = [-1]
    for label in labels:
        assert len(label["query"]) == 12 and all(len(label[f"sample{k}"]) == 8 for k in range(4))
        real = [t for t in label["query"] if t != tokenizer.pad_token_id]
        # in query order
        positions.append(next(i for i in range(positions[-1] + 1, 400) if query_ids[i] == real))
        texts = [tokenizer.decode(label[f"sample{k}"], skip_special_tokens=True) for k in range(4)]
        scores = [t.count("a") for t in texts]
        # decisive only
        assert scores.count(max(scores)) == 1 and label["best"] == scores.index(max(scores))
    assert positions[-1] >= 8  # some queries were skipped as ties, so more than one round was drawn
    # seeded by args.seed alone: the same file again
    assert (
        rewards.make_labels(
            "lexicon", policy.eval(), tokenizer, str(tmp_path / "again.json"), 8, 1, 12, 8, 0.7, 8
        )
        == labels
    )


def test_smol_presets_batch_arithmetic_validates(tmp_path):
    args = ppo_rlhf.PRESETS["smol_sentiment"][1]
    sizes = ppo_rlhf.batch_sizes(args, 1)
    # 2 minibatches of 16 per epoch (8 Adam steps per update), each one forward/backward
    assert (sizes["local_batch"], sizes["micro"], sizes["grad_accum"], sizes["num_updates"]) == (
        32,
        16,
        1,
        20,
    )
    assert ppo_rlhf.batch_sizes(args, 2)["local_batch"] == 16  # same experiment on 2 ranks
    rm = dataclasses.replace(rewards.PRESETS[args.reward_preset][1], output_dir=str(tmp_path))
    rewards.check_args(rm, 1)
    assert (
        rm.num_train // rm.batch_size == 112 and rm.num_test == 128 and rm.label_backend == "vllm"
    )
    # the two halves must agree on the task shape: the reward model reads what the policy writes
    assert (rm.query_length, rm.response_length, rm.base_model) == (
        args.query_length,
        args.response_length,
        args.base_model,
    )
    assert args.truncate_after < args.response_length
    with pytest.raises(ValueError, match="^--num-test must be set with --label-source lexicon"):
        rewards.check_args(dataclasses.replace(rm, num_test=None), 1)
    with pytest.raises(
        ValueError, match="^--base-model must be a real model for --label-source lexicon"
    ):
        rewards.check_args(dataclasses.replace(rm, base_model="tiny"), 1)
    with pytest.raises(ValueError, match="needs a real --base-model"):
        ppo_rlhf.check_args(
            dataclasses.replace(args, base_model="", output_dir=str(tmp_path / "p")), 1
        )
    # torchrun: the shipped labels are read by every rank; new ones (here another label seed,
    # nothing cached) would be sampled by rank 0 alone, and a vLLM engine must start on every rank
    # at once, so it is refused before any load
    rewards.check_args(rm, 2)
    other_labels = dataclasses.replace(rm, label_seed=12345)
    assert not os.path.exists(rewards.lexicon_label_path(other_labels, rm.base_model))
    rewards.check_args(other_labels, 1)
    with pytest.raises(ValueError, match="^--label-backend vllm samples new labels in one process"):
        rewards.check_args(other_labels, 2)
    rewards.check_args(dataclasses.replace(other_labels, label_backend="hf"), 2)


def test_smollm2_pad_token_is_distinct_from_eos_and_never_sampled():
    """SmolLM2 saves pad = eos = <|im_end|> (2). Both scripts add a [PAD] at id = vocab size:
    outside the embedding (rewards.forward_inputs maps it to 0), so generate() can never sample it, and an
    <|im_end|> the policy writes stays a real token. The longest template opener fits
    query_length."""
    from transformers import AutoConfig

    path = tasks.SMOLLM2_PATH
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        pytest.fail(f"SmolLM2 is not converted at {path}; run: {tasks.SMOLLM2_SETUP}")
    tokenizer = ppo_rlhf.load_tokenizer(path)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == vocab_size == 49152
    # nothing to ban
    assert ppo_rlhf.banned_vocab_mask(vocab_size, tokenizer.pad_token_id, "cpu") is None
    query = ppo_rlhf.left_pad_queries([[5, 6]], 4, tokenizer.pad_token_id)
    inputs = rewards.forward_inputs(query, query != tokenizer.pad_token_id)
    assert inputs["input_ids"].tolist() == [[0, 0, 5, 6]]
    assert inputs["position_ids"].tolist() == [[0, 0, 0, 1]]
    # the truncate token is one token
    assert tokenizer.encode(".", add_special_tokens=False) == [30]
    args = ppo_rlhf.PRESETS["smol_sentiment"][1]
    longest = max(
        len(tokenizer.encode(q, add_special_tokens=False))
        for q in tasks.sentiment_queries(4000, seed=0)
    )
    assert longest <= args.query_length


def test_a_missing_smollm2_is_refused_in_one_line_by_every_script(monkeypatch, tmp_path):
    """tasks.smollm2_problem is what the three scripts' checks call before any model loads: with
    the folder absent, each refuses with the setup command; any other model path is not its
    business."""
    import grpo

    missing = str(tmp_path / "SmolLM2-135M-Instruct")
    monkeypatch.setattr(tasks, "SMOLLM2_PATH", missing)
    assert (
        tasks.smollm2_problem(missing)
        == f"SmolLM2 is not converted at {missing}; run: {tasks.SMOLLM2_SETUP}"
    )
    assert tasks.smollm2_problem(str(tmp_path)) is None
    with pytest.raises(ValueError, match="scripts/setup_cpu.sh"):
        grpo.check_args(
            dataclasses.replace(grpo.PRESETS["smol_arith"][1], model_name_or_path=missing)
        )
    with pytest.raises(ValueError, match="scripts/setup_cpu.sh"):
        ppo_rlhf.check_args(
            dataclasses.replace(
                ppo_rlhf.PRESETS["smol_sentiment"][1],
                base_model=missing,
                output_dir=str(tmp_path / "p"),
            ),
            1,
        )
    with pytest.raises(ValueError, match="scripts/setup_cpu.sh"):
        rewards.check_args(
            dataclasses.replace(
                rewards.PRESETS["smol_sentiment"][1],
                base_model=missing,
                output_dir=str(tmp_path / "out"),
            ),
            1,
        )


# Measured over seeds 1-8 (docs/rewards.md, "the CI check"): held-out 0.39-0.45 (25-29 of 64) with
# 64 labels at peak lr 4e-4; 0.34 = 22 of 64, 6 above the 16 that chance expects.
CI_NUM_TRAIN = 64
CI_LR = 4e-4
CI_MIN_ACCURACY = 0.34


def preset_label_path():
    args = rewards.PRESETS["smol_sentiment"][1]
    return rewards.lexicon_label_path(args, args.base_model)


def test_smol_sentiment_labels_ship_with_the_repo_and_are_the_lexicon_labellers_choices():
    """The preset's 1024 labels are the file in data/ (so `ppo_rlhf.py smol_sentiment` does not
    sample them first), and each is what make_labels writes: a decisive lexicon best-of-4 over 4
    fixed-length SmolLM2 samples."""
    path = preset_label_path()
    assert path == os.path.join(ROOT, "data", os.path.basename(path)) and path.endswith(".json.gz")
    labels = rewards.load_labels(path)
    assert len(labels) == 1024
    if not os.path.isfile(os.path.join(tasks.SMOLLM2_PATH, "tokenizer.json")):
        pytest.fail(f"SmolLM2 is not converted at {tasks.SMOLLM2_PATH}; run: {tasks.SMOLLM2_SETUP}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tasks.SMOLLM2_PATH)
    for label in labels:
        texts = [
            tokenizer.decode(label[f"sample{k}"], skip_special_tokens=True)
            for k in range(rewards.NUM_SAMPLES)
        ]
        scores = [tasks.lexicon_sentiment_score(t) for t in texts]
        assert (
            all(len(label[f"sample{k}"]) == 20 for k in range(rewards.NUM_SAMPLES))
            and len(label["query"]) == 14
        )
        assert scores.count(max(scores)) == 1 and label["best"] == tasks.lexicon_best_of_4(texts), (
            texts,
            label,
        )


def test_shortened_smol_reward_model_beats_chance_on_smollm2(tmp_path):
    """The smol_sentiment reward model on SmolLM2, shortened to fit CI: 64 labels, one epoch of 8
    steps of 8 at a higher peak lr than the preset's (8 steps instead of 112), no normalisation or
    train/kl (they do not change the accuracy); the held-out best-of-4 accuracy on 64 labels must
    clear chance (0.25) by the margin measured (see docs/rewards.md, "the CI check")."""
    if not os.path.isfile(os.path.join(tasks.SMOLLM2_PATH, "model.safetensors")):
        pytest.fail(f"SmolLM2 is not converted at {tasks.SMOLLM2_PATH}; run: {tasks.SMOLLM2_SETUP}")
    # its first 64 and 64 of its held-out 128 (896..1023)
    labels = rewards.load_labels(preset_label_path())
    with open(tmp_path / "labels.json", "w") as f:
        json.dump(labels[:CI_NUM_TRAIN] + labels[896:960], f)
    args = dataclasses.replace(
        rewards.PRESETS["smol_sentiment"][1],
        output_dir=str(tmp_path),
        label_source=str(tmp_path / "labels.json"),
        num_train=CI_NUM_TRAIN,
        num_test=64,
        lr=CI_LR,
        normalize_before=False,
        normalize_after=False,
        kl_samples=0,
        save_model=False,
        eval_every=10**6,
        # a 135M model, unlike the tiny ones conftest.py runs on one thread: a second thread makes
        # this test 1.7x faster (71 s against 121 s), and the table in the docs was measured so
        torch_threads=2,
    )
    threads_before = torch.get_num_threads()
    try:
        rewards.train(args)
    finally:
        torch.set_num_threads(threads_before)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    accuracy = [r["test/accuracy"] for r in rows if "test/accuracy" in r]
    assert len(accuracy) == 1 and accuracy[0] >= CI_MIN_ACCURACY, accuracy
