"""The docs match the code: every `[name](../file.py#L123)` pointer lands on the line that defines or uses `name`."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[`?([^\]`]+?)`?\]\(\.\./([\w/.]+\.py)#L(\d+)\)")


def test_there_is_a_page_per_concept_file():
    names = {p.stem for p in DOCS}
    for concept in ("corrections",):
        assert concept in names


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_line_pointers_land_on_their_names(page):
    links = LINK.findall(page.read_text())
    bad = []
    for name, path, line in links:
        lines = (ROOT / path).read_text().splitlines()
        target = lines[int(line) - 1] if int(line) <= len(lines) else ""
        key = name.split("(")[0].split(".")[-1].strip()
        if key not in target:
            bad.append(f"{name} -> {path}#L{line}: {target.strip()[:80]!r}")
    assert not bad, "stale doc pointers (update the line numbers):\n" + "\n".join(bad)
