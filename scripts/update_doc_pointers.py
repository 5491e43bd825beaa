"""Check and re-point the line pointers of docs/*.md, resolved with `ast` (tests/test_docs.py uses the check).

A pointer is a markdown link to a line of a Python file, in one of two forms:

    [`name`](../file.py#L123)            a definition: the line lies inside the definition of `name` in
                                         file.py: a function, class or method (`Class.method`), a field
                                         or attribute of a class (`Args.lr`, or `lr` when one class has
                                         it: its own lines, not the docstring below it), a module-level
                                         constant, or one entry of a module-level
                                         dict keyed by that string (a preset: `smol_arith`)
    [`x` in `function`](../file.py#L123) a use: the line lies inside `function` (or `Class.method`) and
                                         uses `x` in code (a name, an attribute, a keyword argument, a
                                         string key or value), not in a comment or a docstring

The backticks are optional. `x` may be dotted (`rollout.sample_fixed_length`): its last part must be
used on the line. There is no nearest-name fallback: a pointer that resolves nowhere is reported.

    .venv/bin/python scripts/update_doc_pointers.py [--base HEAD]    # re-point, print what changed
    .venv/bin/python scripts/update_doc_pointers.py --check          # report, change nothing

Re-pointing: a definition pointer moves to its definition's first line unless it already lies inside
it; a use pointer moves to the use inside its function nearest to where the pointed line went (the
line as it was at --base, followed through the working tree's edits with difflib).
"""

import argparse
import ast
import difflib
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(\[([^\[\]]+?)\]\(\.\./([\w/.]+\.py)#L)(\d+)(\))")


def parse_link_text(text):
    """`name`  ->  (name, None);  `x` in `function`  ->  (x, function)."""
    text = " ".join(text.replace("`", "").split())
    if " in " in text:
        name, function = text.rsplit(" in ", 1)
        return name.strip(), function.strip()
    return text, None


class Source:
    """One Python file: its lines, its definitions (qualified name -> (first, last) line), and for each
    line the identifiers it uses in code."""

    def __init__(self, path):
        self.text = Path(path).read_text()
        self.tree = ast.parse(self.text)
        self.definitions = {}
        self.uses = {}
        self._collect(self.tree.body, prefix="")
        self._collect_uses()

    def _span(self, node):
        first = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
        return first, node.end_lineno

    def _add(self, name, span):
        self.definitions.setdefault(name, span)

    def _collect(self, body, prefix, in_function=False):
        for i, node in enumerate(body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self._add(prefix + node.name, self._span(node))
                # a class's methods and fields, a function's nested functions (Outer.inner); a
                # function's local variables are not definitions: point at them as uses
                is_function = not isinstance(node, ast.ClassDef)
                self._collect(node.body, prefix + node.name + ".", in_function=is_function)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and not in_function:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                first, last = node.lineno, node.end_lineno
                # a constant's docstring (the string statement right after it) belongs to it; a
                # class field's does not: a pointer to an Args field opens the field's own line
                following = body[i + 1] if i + 1 < len(body) else None
                if prefix == "" and isinstance(following, ast.Expr):
                    if isinstance(following.value, ast.Constant):
                        if isinstance(following.value.value, str):
                            last = following.end_lineno
                for target in targets:
                    if isinstance(target, ast.Name):
                        self._add(prefix + target.id, (first, last))
                if prefix == "" and isinstance(node.value, ast.Dict):  # PRESETS = {"tiny": ...}
                    for key, value in zip(node.value.keys, node.value.values):
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            self._add(key.value, (key.lineno, value.end_lineno))
            elif isinstance(node, (ast.If, ast.With, ast.Try, ast.For, ast.While)) and in_function:
                self._collect(getattr(node, "body", []), prefix, in_function=True)

    def _collect_uses(self):
        docstrings = set()
        for node in ast.walk(self.tree):
            body = getattr(node, "body", None)
            if isinstance(body, list):
                for child in body:
                    if isinstance(child, ast.Expr) and isinstance(child.value, ast.Constant):
                        if isinstance(child.value.value, str):
                            docstrings.add(id(child.value))
        for node in ast.walk(self.tree):
            names = []
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.keyword) and node.arg:
                names = [node.arg]
            elif isinstance(node, ast.arg):
                names = [node.arg]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) not in docstrings and len(node.value) < 200:
                    names = [node.value]
            elif isinstance(node, ast.alias):
                names = [node.asname or node.name.split(".")[-1]]
            for name in names:
                # an attribute or keyword spans the lines of its expression: count its last line
                line = getattr(node, "end_lineno", None) or getattr(node, "lineno", None)
                if line is None:
                    continue
                first = getattr(node, "lineno", line)
                for n in {first, line}:
                    self.uses.setdefault(n, set()).add(name)

    def definition(self, name):
        """(first, last) lines of `name`'s definition, or None. `Class.attr`, or a bare attribute
        name that only one class defines, are found too."""
        if name in self.definitions:
            return self.definitions[name]
        matches = [span for qual, span in self.definitions.items() if qual.endswith("." + name)]
        return matches[0] if len(matches) == 1 else None

    def uses_on(self, line, name):
        return name.split(".")[-1] in self.uses.get(line, set())


_SOURCES = {}


def source(path):
    path = Path(path)
    key = (path, path.stat().st_mtime_ns)
    if key not in _SOURCES:
        _SOURCES[key] = Source(path)
    return _SOURCES[key]


def check_pointer(text, path, line, root=ROOT):
    """None if the pointer resolves, else one line saying why not (path relative to root)."""
    file = Path(root) / path
    if not file.is_file():
        return f"{path} does not exist"
    src = source(file)
    name, function = parse_link_text(text)
    if function is None:
        span = src.definition(name)
        if span is None:
            return (
                f"{name!r} is not defined in {path} (point at a use as `[{name} in FUNCTION](...)`)"
            )
        if not span[0] <= line <= span[1]:
            return f"line {line} is outside {name!r} (lines {span[0]}-{span[1]})"
        return None
    span = src.definition(function)
    if span is None:
        return f"{function!r} is not defined in {path}"
    if not span[0] <= line <= span[1]:
        return f"line {line} is outside {function!r} (lines {span[0]}-{span[1]})"
    if not src.uses_on(line, name):
        return f"line {line} does not use {name!r} in code"
    return None


def line_map(path, base):
    """{old line number: new line number} for the lines unchanged between `base` and the work tree."""
    try:
        old = subprocess.run(
            ["git", "show", f"{base}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    except subprocess.CalledProcessError:
        return {}
    new = (ROOT / path).read_text().splitlines()
    mapping = {}
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            mapping[block.a + k + 1] = block.b + k + 1
    return mapping


def repoint(text, path, line, mapping):
    """The line the pointer should have, or None if it resolves nowhere."""
    src = source(ROOT / path)
    name, function = parse_link_text(text)
    guess = mapping.get(line, line)
    if function is None:
        span = src.definition(name)
        if span is None:
            return None
        return guess if span[0] <= guess <= span[1] else span[0]
    span = src.definition(function)
    if span is None:
        return None
    candidates = [n for n in range(span[0], span[1] + 1) if src.uses_on(n, name)]
    return min(candidates, key=lambda n: abs(n - guess)) if candidates else None


def pages():
    return sorted((ROOT / "docs").glob("*.md"))


def all_problems():
    """[(page name, link text, path, line, why)] for every pointer that does not resolve."""
    problems = []
    for page in pages():
        for match in LINK.finditer(page.read_text()):
            _, text, path, line, _ = match.groups()
            why = check_pointer(text, path, int(line))
            if why:
                problems.append((page.name, text, path, int(line), why))
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base", default="HEAD", help="the commit at which the pointers were right"
    )
    parser.add_argument("--check", action="store_true", help="report only, change nothing")
    args = parser.parse_args()
    if args.check:
        problems = all_problems()
        for page, text, path, line, why in problems:
            print(f"{page}: [{text}]({path}#L{line}): {why}")
        print(f"{len(problems)} pointers do not resolve")
        raise SystemExit(1 if problems else 0)
    maps = {}
    for page in pages():
        text = page.read_text()

        def fix(match):
            prefix, link_text, path, line, suffix = match.groups()
            if check_pointer(link_text, path, int(line)) is None:
                return match.group(0)
            if path not in maps:
                maps[path] = line_map(path, args.base)
            new = repoint(link_text, path, int(line), maps[path])
            if new is None:
                print(f"{page.name}: cannot resolve [{link_text}]({path}#L{line}) (left as it is)")
                return match.group(0)
            print(f"{page.name}: [{link_text}] {path}#L{line} -> #L{new}")
            return f"{prefix}{new}{suffix}"

        new_text = LINK.sub(fix, text)
        if new_text != text:
            page.write_text(new_text)


if __name__ == "__main__":
    main()
