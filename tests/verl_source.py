"""Where the parity tests read verl 0.9.1's (and TRL 1.16's) source (not a test file itself: no test_
prefix).

scripts/setup_cpu.sh unpacks verl's wheel into <venv>/verl_source/ without installing it (installed, pip
reports that its dependencies are missing; importing it would pull ray). The tests parse the functions they
need out of its files with `ast` and never import verl. An installed verl is used where there is one.
"""

import importlib.util
import sys
from pathlib import Path


def verl_root():
    """The folder of verl's package (with trainer/, utils/, ...), or None when neither is there."""
    unpacked = Path(sys.prefix) / "verl_source" / "verl"
    if (unpacked / "trainer" / "ppo" / "core_algos.py").is_file():
        return unpacked
    spec = importlib.util.find_spec("verl")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent
    return None


def load_functions(root, relpath, names, namespace, keep_assignments=False):
    """Run the top-level functions `names` of verl's file `relpath` (under `root`) in `namespace`,
    decorators dropped (verl's registries would import its config classes), and return it. With
    keep_assignments, the file's top-level assignments run too (module constants the functions
    read, e.g. rollout_corr_helper.py's SAFETY_BOUND)."""
    import ast

    tree = ast.parse((root / relpath).read_text())
    keep = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            keep.append(node)
        elif keep_assignments and isinstance(node, (ast.Assign, ast.AnnAssign)):
            keep.append(node)
    code = compile(ast.Module(body=keep, type_ignores=[]), str(root / relpath), "exec")
    exec(code, namespace)
    return namespace


def trl_root():
    """The folder of TRL's package, unpacked by scripts/setup_cpu.sh into <venv>/trl_source/, or
    None."""
    unpacked = Path(sys.prefix) / "trl_source" / "trl"
    return unpacked if (unpacked / "trainer" / "grpo_trainer.py").is_file() else None


def load_method(root, relpath, class_name, name, namespace):
    """A method of a class in `relpath` (a staticmethod: no self), run as a plain function in
    `namespace`, decorators dropped; returns it."""
    import ast

    tree = ast.parse((root / relpath).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    item.decorator_list = []
                    code = compile(
                        ast.Module(body=[item], type_ignores=[]), str(root / relpath), "exec"
                    )
                    exec(code, namespace)
                    return namespace[name]
    raise LookupError(f"{class_name}.{name} not in {relpath}")
