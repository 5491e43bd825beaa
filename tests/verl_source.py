"""Where the parity tests read verl 0.9.1's source (not a test file itself: no test_ prefix).

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
