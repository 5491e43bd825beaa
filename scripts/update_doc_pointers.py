"""Re-point stale `[name](../file.py#L123)` links in docs/*.md after the code moved.

tests/test_docs.py fails when a pointer's line no longer contains its name. Pointers were right at some commit
(default HEAD), so this script maps each pointed line from that commit's version of the file to the working tree
with difflib (the same line, wherever it moved); a line that was edited falls back to the name's definition, else to
the nearest line containing the name. Run it once per commit (the pointers must be right at --base). It prints what it changed and what it could not fix.

    .venv/bin/python scripts/update_doc_pointers.py [--base HEAD]
"""

import argparse
import difflib
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(\[`?([^\]`]+?)`?\]\(\.\./([\w/.]+\.py)#L)(\d+)(\))")


def line_map(path, base):
    """{old line number: new line number} for the lines unchanged between `base` and the working tree."""
    try:
        old = subprocess.run(["git", "show", f"{base}:{path}"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.splitlines()
    except subprocess.CalledProcessError:
        return {}
    new = (ROOT / path).read_text().splitlines()
    mapping = {}
    for block in difflib.SequenceMatcher(None, old, new, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            mapping[block.a + k + 1] = block.b + k + 1
    return mapping


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD", help="the commit at which the pointers were right")
    base = parser.parse_args().base
    maps = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()

        def fix(match):
            prefix, name, path, line, suffix = match.groups()
            lines = (ROOT / path).read_text().splitlines()
            key, old = name.split("(")[0].split(".")[-1].strip(), int(line)
            if old <= len(lines) and key in lines[old - 1]:
                return match.group(0)
            if path not in maps:
                maps[path] = line_map(path, base)
            new = maps[path].get(old)
            if new is None or key not in lines[new - 1]:  # edited line: the definition, else the nearest use
                near = [i for i, text_line in enumerate(lines, 1)
                        if re.match(rf"\s*(def|class)\s+{re.escape(key)}\b", text_line)]
                near = near or [i for i, text_line in enumerate(lines, 1) if key in text_line]
                new = min(near, key=lambda i: abs(i - (new or old))) if near else None
            if new is None:
                print(f"{page.name}: cannot find {key!r} in {path} (left at L{old})")
                return match.group(0)
            print(f"{page.name}: {key} {path}#L{old} -> #L{new}")
            return f"{prefix}{new}{suffix}"

        new_text = LINK.sub(fix, text)
        if new_text != text:
            page.write_text(new_text)


if __name__ == "__main__":
    main()
