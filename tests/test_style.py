"""The code is formatted, not compressed: one formatter (ruff format, 100 columns), a small lint set
(pyflakes and pycodestyle errors, pyproject.toml), and a check ruff lacks: no expression statement that
is a tuple (`optimizer.zero_grad(), loss.backward()` joins two statements to save a line). Budget:
~2 s."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON_FILES = sorted(
    p
    for pattern in ("*.py", "tests/*.py", "scripts/*.py", "bench/*.py")
    for p in ROOT.glob(pattern)
)


def ruff(*args):
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_ruff_format_leaves_every_file_as_it_is():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_lint_passes():
    """pyflakes (unused and undefined names), pycodestyle errors, and lines of at most 100 columns
    in the top-level files a reader steps through (tests, scripts and bench are exempt from the
    length only)."""
    result = ruff("check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def tuple_statements(source):
    """Line numbers of expression statements whose value is a tuple: `a(), b()`."""
    tree = ast.parse(source)
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Tuple)
    ]


def test_the_tuple_statement_check_finds_joined_statements():
    assert tuple_statements("a = 1\nf(a), g(a)\nx, y = 1, 2\nh((1, 2))\n") == [2]


@pytest.mark.parametrize("path", PYTHON_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_statements_joined_as_tuples(path):
    lines = tuple_statements(path.read_text())
    assert not lines, f"{path.name}: statements joined as a tuple at lines {lines}"
