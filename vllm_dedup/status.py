"""`vllm-dedup status`: what the registries hold, as text, once or refreshed in place.

`format_status` lays out one or more registries one after another, each headed by where it
is (its socket; later, its node) and its pid: the bytes per device and share group, then one
row per connected engine.  `watch` redraws a frame every few seconds until Ctrl-C: on a
terminal in place (cursor home, each line cleared to its end, the rest of the screen cleared:
no flicker, no scrolling), elsewhere (a pipe, a log) one frame after another.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

from .registry.state import RegistryStats
from .text import size_text, table

__all__ = ["format_registry", "format_status", "watch"]

_HOME, _CLEAR_LINE, _CLEAR_BELOW, _CLEAR_SCREEN = "\x1b[H", "\x1b[K", "\x1b[J", "\x1b[2J"


def format_registry(where: str | None, stats: RegistryStats) -> str:
    """One registry's status: a heading with its pid and ``where`` it is (left out when None),
    the bytes per device and share group (resident: stored once; shared: in segments two or
    more engines map; saved: mapped from others instead of stored again), and per engine its pid, device,
    share group, segments held, bytes shared/published/private, the load path it took
    (``load["load_path"]``, ``-`` when it reported none), how many times it re-registered with a
    registry that came back (``load["reregistered"]``, ``-`` for never) and its model."""
    at = f" at {where}" if where is not None else ""
    out = [f"registry pid {stats.registry_pid}{at}   keep_warm_s {stats.keep_warm_s:g}   "
           f"hash collisions caught {stats.collisions}", ""]
    if stats.groups:
        out.append(table(
            [[g.device, g.share_group, g.engines, g.segments, size_text(g.resident_bytes), size_text(g.shared_bytes),
              size_text(g.saved_bytes)] for g in stats.groups],
            ["device", "share group", "engines", "segments", "resident", "shared", "saved"], "llrrrrr",
        ))
    else:
        out.append("no segments resident")
    out.append("")
    if stats.engines:
        out.append(table(
            [[e.pid, e.device, e.share_group, e.segments, size_text(e.load.get("shared_bytes", 0)),
              size_text(e.load.get("published_bytes", 0)), size_text(e.load.get("private_bytes", 0)),
              e.load.get("load_path") or "-", e.load.get("reregistered") or "-", e.model] for e in stats.engines],
            ["pid", "device", "share group", "segments", "shared", "published", "private", "load path",
             "re-registered", "model"],
            "rllrrrrlrl",
        ))
        out += [f"pid {e.pid}: oneDNN linears kept private: {e.load['private_linears']}"
                for e in stats.engines if e.load.get("private_linears")]
    else:
        out.append("no engines connected")
    out += [f"lock {name} held by pid {pid}" for name, pid in stats.locks.items()]
    deferred = sum(g.deferred_segments for g in stats.groups)
    if deferred:
        out.append(f"{deferred} unheld segment(s) kept until a start-up on their device ends")
    return "\n".join(out)


def format_status(stats_by_registry: Sequence[tuple[str | None, RegistryStats]] | RegistryStats) -> str:
    """The human-readable status of several registries (what ``vllm-dedup status`` prints):
    `format_registry` of each ``(where, stats)`` pair, in order, separated by a blank line.
    ``where`` names the registry's location (a socket path, a node).  A single `RegistryStats`
    is shown as one registry whose location is not named."""
    if isinstance(stats_by_registry, RegistryStats):
        stats_by_registry = [(None, stats_by_registry)]
    return "\n\n".join(format_registry(where, stats) for where, stats in stats_by_registry)


def watch(frame: Callable[[], str], interval_s: float, out: TextIO | None = None) -> int:
    """Show ``frame()`` every ``interval_s`` seconds until Ctrl-C (SIGINT), then return 0.

    ``frame`` must not raise for a passing failure (a registry that went away): it returns
    text saying so, and the next refresh tries again.  On a terminal each frame replaces the
    last in place; otherwise frames follow one another, each under a heading line.  A closed
    output (``| head``) ends the watch quietly (returns 0).
    """
    out = out or sys.stdout
    in_place = out.isatty()
    try:
        if in_place:
            out.write(_CLEAR_SCREEN)
        while True:
            heading = (f"vllm-dedup status, every {interval_s:g}s (Ctrl-C to stop)   "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
            text = f"{heading}\n\n{frame()}"
            if in_place:
                out.write(_HOME + "".join(line + _CLEAR_LINE + "\n" for line in text.split("\n")) + _CLEAR_BELOW)
            else:
                out.write(text + "\n\n")
            out.flush()
            time.sleep(interval_s)
    except KeyboardInterrupt:
        if in_place:
            out.write("\n")
        return 0
    except BrokenPipeError:
        # Nothing more can be written; point stdout at /dev/null so the interpreter's final
        # flush does not fail again.
        if out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
