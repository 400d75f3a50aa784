"""Where a benchmark's JSON goes.  Not shipped.

Every benchmark writes its result as one indented JSON file under ``benchmarks/results/`` (or a
folder it is told), and with ``--json`` also prints it as its last line, for scripts to read.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_results"]


def write_results(path: Path, result: dict, print_json: bool = False) -> Path:
    """Write ``result`` to ``path`` as indented JSON (its folder made where missing); with
    ``print_json``, also print it on one line.

    Returns:
        ``path``.

    Raises:
        OSError: the file cannot be written.
        TypeError: ``result`` holds something JSON cannot encode.
    """
    text = json.dumps(result, indent=2) + "\n"  # encoded first: a TypeError leaves no half-written file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if print_json:
        print(json.dumps(result))
    return path
