"""Starting several real engines for a test (see `vllm_dedup.measure.EngineProcess`)."""

from __future__ import annotations

import os

from vllm_dedup.measure import EngineProcess


def start_engines(specs: list[dict]) -> list[EngineProcess]:
    """Start engines one after another (each waits for the previous: the first publishes,
    the next ones map), each bound to its own core."""
    engines = []
    try:
        for i, spec in enumerate(specs):
            engines.append(EngineProcess(core=i % (os.cpu_count() or 1), **spec).wait_ready())
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines
