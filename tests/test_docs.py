"""The docs match the code.

1. Every `[name](../file.py#L123)` pointer lands inside the definition of `name`, and every
   `[x in function](../file.py#L123)` pointer on a line of `function` that uses `x` in code (not in
   a comment or a docstring), as scripts/update_doc_pointers.py resolves them with `ast`.
2. There is a page per concept file.
3. Glossaries: a page's "## Glossary" table names exactly the metrics its script logs. The logged
   keys come from a real, very short run made here (not from reading the source), so a renamed or
   new metric fails this test: every key of metrics.jsonl must be in the glossary, and every name in
   the glossary must be logged.

Glossary format (docs/ppo_rlhf.md is an example): a markdown table under a heading that starts with
"## Glossary"; the FIRST cell of each row holds one or more backticked metric names. A name with a
`*` is a family (fnmatch-style, e.g. `rollout_corr/*` for the verl diagnostics, documented in
docs/corrections.md): it covers every logged key it matches and must match at least one. Every other
name must be logged exactly.

Budget (2 CPU cores): about 10-15 s measured, mostly imports, the tiny runs and adam_experiment (the
grpo run adds about 1 s). A page joins by adding a fixture that returns its logged keys and a row to
GLOSSARY_RUNS.
"""

import dataclasses
import fnmatch
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
CONCEPT_PAGES = (
    "corrections",
    "ppo_rlhf",
    "rewards",
    "adam_tf",
    "grpo",
    "rollout",
    "objectives",
    "tasks",
    "tools",
)
GLOSSARY_ROW = re.compile(r"^\|([^|]*)\|")
BACKTICKED = re.compile(r"`([^`]+)`")


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


POINTERS = load_script("update_doc_pointers")


def test_there_is_a_page_per_concept_file():
    names = {p.stem for p in DOCS}
    for concept in CONCEPT_PAGES:
        assert concept in names, f"docs/{concept}.md is missing"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_line_pointers_open_what_they_name(page):
    bad = []
    for match in POINTERS.LINK.finditer(page.read_text()):
        _, text, path, line, _ = match.groups()
        why = POINTERS.check_pointer(text, path, int(line))
        if why:
            bad.append(f"[{text}]({path}#L{line}): {why}")
    assert not bad, (
        "doc pointers that do not open what they name (scripts/update_doc_pointers.py re-points "
        "moved ones):\n" + "\n".join(bad)
    )


def test_pointer_resolution_rejects_comments_docstrings_and_other_functions(tmp_path):
    """The resolver itself: a name mentioned only in a docstring or a comment, or a line outside the
    function the pointer names, is not a use; a line inside a definition is, except a class field's
    docstring (a pointer to an Args field opens the field's line)."""
    (tmp_path / "m.py").write_text(
        "LIMIT = 3  # a constant\n"  # 1
        "\n"  # 2
        "def f(x):\n"  # 3
        '    """Uses y, says the docstring."""\n'  # 4
        "    # y is mentioned here too\n"  # 5
        "    y = x + LIMIT\n"  # 6
        "    return y\n"  # 7
        "\n"  # 8
        "def g():\n"  # 9
        "    return f(1)\n"  # 10
        "\n"  # 11
        "class Args:\n"  # 12
        "    lr: float = 1e-3\n"  # 13
        '    """The learning rate."""\n'  # 14
    )
    check = POINTERS.check_pointer
    assert check("`f`", "m.py", 5, tmp_path) is None  # inside f's definition
    assert check("`LIMIT`", "m.py", 1, tmp_path) is None
    assert check("`f`", "m.py", 10, tmp_path) is not None  # a use of f, not its definition
    assert check("`f` in `g`", "m.py", 10, tmp_path) is None
    assert check("`y` in `f`", "m.py", 6, tmp_path) is None
    assert check("`y` in `f`", "m.py", 4, tmp_path) is not None  # the docstring
    assert check("`y` in `f`", "m.py", 5, tmp_path) is not None  # the comment
    assert check("`y` in `g`", "m.py", 6, tmp_path) is not None  # outside g
    assert check("`y`", "m.py", 6, tmp_path) is not None  # a local is a use, not a definition
    assert check("`LIMIT` in `f`", "m.py", 6, tmp_path) is None
    # an Args field: its own line, not its docstring
    assert check("`lr`", "m.py", 13, tmp_path) is None
    assert check("`Args.lr`", "m.py", 13, tmp_path) is None
    assert check("`lr`", "m.py", 14, tmp_path) is not None


# ---------------------------------------------------------------------------------------------------------------
# glossaries
# ---------------------------------------------------------------------------------------------------------------
def glossary_names(text):
    """The backticked names in the first cell of every table row under the page's "## Glossary..."
    heading."""
    names, inside = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            inside = line.startswith("## Glossary")
            continue
        match = GLOSSARY_ROW.match(line) if inside else None
        if match and not set(match.group(1).strip()) <= set("-: "):
            names += BACKTICKED.findall(match.group(1))
    return names


def glossary_mismatches(names, logged):
    """(logged keys no glossary name covers, glossary names that match no logged key)."""
    undocumented = sorted(k for k in logged if not any(fnmatch.fnmatchcase(k, n) for n in names))
    never_logged = sorted(n for n in names if not any(fnmatch.fnmatchcase(k, n) for k in logged))
    return undocumented, never_logged


def test_glossary_parser_and_families():
    text = (
        "## Glossary\n\n| metric | meaning |\n| --- | --- |\n| `a/x` | one |\n| `b/*` | family |\n"
        "| `c`, `d` | two names |\n\n## Next\n\n| `not/a/metric` | outside the glossary |\n"
    )
    names = glossary_names(text)
    assert names == ["a/x", "b/*", "c", "d"]
    assert glossary_mismatches(names, {"a/x", "b/1", "b/2", "c", "d"}) == ([], [])
    assert glossary_mismatches(names, {"a/x", "b/1", "c", "d", "e"}) == (["e"], [])
    assert glossary_mismatches(names, {"a/x", "c", "d"}) == ([], ["b/*"])


def logged_keys(path):
    keys = set()
    with open(path) as f:
        for line in f:
            if line.strip():
                keys |= set(json.loads(line))
    return keys


@pytest.fixture(scope="module")
def ppo_rlhf_keys(tiny_assets, tmp_path_factory):
    """Two updates of the tiny preset at rollout batch 16, with the random reward model of
    tests/test_ppo_rlhf.py (no `python rewards.py tiny`) and --correction decoupled_token_is, so the
    IS-weight keys of the rollout_corr/* family are logged too (the rest of it is logged with the
    default --correction disabled as well)."""
    import ppo_rlhf

    out = tmp_path_factory.mktemp("ppo_docs")
    args = dataclasses.replace(
        ppo_rlhf.PRESETS["tiny"][1],
        reward_model_path=str(tiny_assets / "reward_model"),
        output_dir=str(out),
        total_episodes=32,
        rollout_batch_size=16,
        local_micro_batch_size=16,
        noptepochs=1,
        save_every=0,
        log_samples_every=1,
        correction="decoupled_token_is",
    )
    ppo_rlhf.train(args)
    return logged_keys(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def rewards_keys(tmp_path_factory):
    """One training step of the tiny reward-model preset, with evaluation and both
    normalisations."""
    import rewards

    out = tmp_path_factory.mktemp("rm_docs")
    args = dataclasses.replace(
        rewards.PRESETS["tiny"][1],
        output_dir=str(out),
        num_train=32,
        num_test=8,
        normalize_samples=16,
        debug_normalize=16,
        rollout_batch_size=64,
        eval_every=1,
        save_model=False,
    )
    rewards.train(args)
    return logged_keys(out / "metrics.jsonl")


@pytest.fixture(scope="module")
def adam_tf_keys(tmp_path_factory):
    """scripts/adam_experiment.py (the experiment of docs/adam_tf.md) on a 16-sequence batch: its
    per-step metrics.jsonl keys and the rows of its table (results.json)."""
    spec = importlib.util.spec_from_file_location(
        "adam_experiment", ROOT / "scripts" / "adam_experiment.py"
    )
    experiment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experiment)
    out = tmp_path_factory.mktemp("adam_docs")
    results = experiment.main(
        experiment.Args(
            batch_size=16,
            num_mini_batches=2,
            ppo_epochs=1,
            response_length=4,
            n_embd=32,
            output_dir=str(out),
        )
    )
    return logged_keys(out / "metrics.jsonl") | set(results["adam_tf"])


@pytest.fixture(scope="module")
def grpo_keys(tmp_path_factory):
    """Two steps of grpo.py's tiny preset at 4 prompts x 4 samples (the small sizes of
    tests/test_grpo.py), with validation at every step (val/*, timing/validate), --correction
    decoupled_token_is (the IS-weight keys of the rollout_corr/* family), DAPO's dynamic sampling
    and overlong shaping (filter_groups/*, overlong/*) and --precision fp16 (actor/loss_scale).
    timing/sync_weights is logged at every step by every backend."""
    import grpo
    from test_grpo import _small_args

    out = tmp_path_factory.mktemp("grpo_docs")
    args = _small_args(
        output_dir=str(out),
        total_steps=2,
        val_every=1,
        train_size=64,
        val_size=8,
        correction="decoupled_token_is",
        dynamic_sampling=True,
        overlong_buffer_len=2,
        precision="fp16",
    )
    grpo.train(args)
    # and a multi-turn run with a tool (tools/*, num_turns/*, the token counts of each kind)
    tools_out = tmp_path_factory.mktemp("grpo_docs_tools")
    tools_args = dataclasses.replace(
        grpo.PRESETS["tiny_tools"][1],
        cuda=False,
        output_dir=str(tools_out),
        total_steps=1,
        val_every=1,
        train_size=64,
        val_size=8,
        tiny_pretrain_steps=0,
        rollout_n=4,
        train_batch_size=4,
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=4,
    )
    grpo.train(tools_args)
    return logged_keys(out / "metrics.jsonl") | logged_keys(tools_out / "metrics.jsonl")


GLOSSARY_RUNS = {
    "ppo_rlhf": "ppo_rlhf_keys",
    "rewards": "rewards_keys",
    "adam_tf": "adam_tf_keys",
    "grpo": "grpo_keys",
}


@pytest.mark.parametrize("page", sorted(GLOSSARY_RUNS))
def test_glossary_names_exactly_the_logged_metrics(page, request):
    logged = request.getfixturevalue(GLOSSARY_RUNS[page])
    names = glossary_names((ROOT / "docs" / f"{page}.md").read_text())
    assert names, f"docs/{page}.md has no '## Glossary' table"
    undocumented, never_logged = glossary_mismatches(names, logged)
    assert not undocumented, f"docs/{page}.md: logged but not in the glossary: {undocumented}"
    assert not never_logged, f"docs/{page}.md: in the glossary but never logged: {never_logged}"


# ---------------------------------------------------------------------------------------------------------------
# step numbers: what a comment or docstring calls "step N" is what grpo.py's train() numbers N
# ---------------------------------------------------------------------------------------------------------------
# each of train()'s numbered steps and the words that name what it does; a "step N" elsewhere must
# stand near one of step N's words (the same line, or the one before or after it)
STEP_WORDS = {
    1: ("roll", "sampl", "prompt"),
    2: ("score", "reward"),
    3: ("pi_old", "pi_ref", "correct", "reference", "logprob"),
    4: ("advantage", "baseline"),
    5: ("update", "loss", "objective"),
    6: ("sync", "publish", "weights"),
    7: ("metric", "log", "validat", "checkpoint", "sample"),
}
STEP_MENTION = re.compile(r"\b[Ss]teps? ([1-7])(?:-([1-7]))?\b")


def numbered_steps_of_train():
    """{N: the text of train()'s comment `# N. ...` (or `# N-M. ...`)} in grpo.py."""
    import ast

    source = (ROOT / "grpo.py").read_text()
    train = next(
        n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "train"
    )
    lines = source.splitlines()[train.lineno - 1 : train.end_lineno]
    steps = {}
    for line in lines:
        match = re.match(r"\s*# ([1-7])(?:-([1-7]))?\. (.*)", line)
        if match:
            first, last = int(match.group(1)), int(match.group(2) or match.group(1))
            for n in range(first, last + 1):
                steps[n] = match.group(3).lower()
    return steps


def stale_step_mentions(path, only_after=None):
    """(line number, line) of each "step N" in `path` that stands near none of step N's words;
    only_after: look only at mentions that follow this text on their line (e.g. "grpo.py")."""
    lines = path.read_text().splitlines()
    stale = []
    for i, line in enumerate(lines):
        for match in STEP_MENTION.finditer(line):
            if only_after is not None and only_after not in line[: match.start()]:
                continue
            near = " ".join(lines[max(0, i - 1) : i + 2]).lower()
            numbers = range(int(match.group(1)), int(match.group(2) or match.group(1)) + 1)
            words = [word for n in numbers for word in STEP_WORDS[n]]
            if not any(word in near for word in words):
                stale.append((i + 1, line.strip()))
    return stale


def test_step_numbers_in_comments_are_train_s_numbers():
    """train()'s numbered comments 1-7 each name what their step does (STEP_WORDS), and every
    "step N" in grpo.py and objectives.py, and every "grpo.py ... step N" in the other concept
    files, stands near a word of step N: "advantages (step 3)" or "grpo.py step 4's pi_old" (the
    labels issue 71 found stale) fail here."""
    steps = numbered_steps_of_train()
    assert sorted(steps) == list(range(1, 8)), steps
    for n, text in steps.items():
        assert any(word in text for word in STEP_WORDS[n]), (n, text)
    stale = {}
    for name in ("grpo.py", "objectives.py"):
        stale[name] = stale_step_mentions(ROOT / name)
    for name in ("corrections.py", "rollout.py", "logprobs.py", "memory.py", "tasks.py"):
        stale[name] = stale_step_mentions(ROOT / name, only_after="grpo.py")
    stale = {name: found for name, found in stale.items() if found}
    assert not stale, f"step numbers that name another step than train()'s: {stale}"


def test_the_step_label_check_catches_a_stale_label(tmp_path):
    """The check itself: a label of the wrong step fails, a right one passes."""
    page = tmp_path / "m.py"
    page.write_text("# --- advantages (step 3)\n\n\n# --- advantages (step 4)\n")
    assert stale_step_mentions(page) == [(1, "# --- advantages (step 3)")]
