"""The status table, from a real `Registry`'s stats: several registries one after another,
and each engine's load path (``"-"`` when it reported none) and registry restarts it re-registered
through."""

from __future__ import annotations

from vllm_dedup.registry.state import Registry, RegistryStats
from vllm_dedup.status import format_status

MB = 1_000_000


def stats_with(loads: list[dict], group: str = "default") -> RegistryStats:
    """A registry where one engine publishes a 4 MB segment and the others map it; each engine
    then reports its load (``loads[i]``, which may hold fields the registry does not keep yet,
    such as ``load_path``: they are added the way they come over the socket, in the stats' dict)."""
    registry = Registry(close=lambda fd: None)
    ids = [registry.add_engine(1000 + i, 0, f"model-{i}", "cpu", group) for i in range(len(loads))]
    registry.publish(ids[0], fd=-1, nbytes=4 * MB, keys=[("k", 0, 4 * MB)])
    for engine_id in ids[1:]:
        registry.acquire(engine_id, ["k"])
    for engine_id, load in zip(ids, loads):
        registry.report(engine_id, load)
    data = registry.stats().to_dict()
    for engine, load in zip(data["engines"], loads):
        engine["load"] = dict(load)
    return RegistryStats.from_dict(data)


def rows(text: str, first: str) -> list[list[str]]:
    """The rows of the table whose header starts with ``first``, split on runs of 2+ spaces."""
    import re

    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(first))
    out = []
    for line in lines[start:]:
        if not line.strip():
            break
        out.append(re.split(r"\s{2,}", line.strip()))
    return out


def test_engine_rows_show_the_load_path_and_bytes():
    stats = stats_with([{"published_bytes": 4 * MB, "load_path": "full"},
                        {"shared_bytes": 4 * MB, "private_bytes": 250_000, "load_path": "modules"},
                        {"shared_bytes": 4 * MB, "load_path": "none", "reregistered": 2}])
    text = format_status([("/run/r.sock", stats)])
    header, _rule, *engines = rows(text, "pid")
    assert header == ["pid", "device", "share group", "segments", "shared", "published", "private", "load path",
                      "re-registered", "model"]
    assert engines == [
        ["1000", "cpu", "default", "1", "0 B", "4.0 MB", "0 B", "full", "-", "model-0"],
        ["1001", "cpu", "default", "1", "4.0 MB", "0 B", "250.0 kB", "modules", "-", "model-1"],
        ["1002", "cpu", "default", "1", "4.0 MB", "0 B", "0 B", "none", "2", "model-2"],
    ]
    header, _rule, group = rows(text, "device")
    assert header == ["device", "share group", "engines", "segments", "resident", "shared", "saved"]
    assert group == ["cpu", "default", "3", "1", "4.0 MB", "4.0 MB", "8.0 MB"]


def test_several_registries_are_listed_one_after_another():
    a = stats_with([{"published_bytes": 4 * MB}], group="prod-group")
    b = stats_with([{"published_bytes": 4 * MB}, {"shared_bytes": 4 * MB}], group="staging-group")
    b.registry_pid = a.registry_pid + 1
    text = format_status([("node-a:/run/a.sock", a), ("node-b:/run/b.sock", b)])
    headings = [line for line in text.splitlines() if line.startswith("registry ")]
    assert [h.split("   ")[0] for h in headings] == [f"registry pid {a.registry_pid} at node-a:/run/a.sock",
                                                     f"registry pid {b.registry_pid} at node-b:/run/b.sock"]
    first, second = text.split(headings[1])
    assert "prod-group" in first and "staging-group" not in first
    assert "staging-group" in second and "prod-group" not in second
    assert format_status([]) == ""
    # One registry's stats alone: the same table, its location not named.
    alone = format_status(a)
    assert alone.splitlines()[0].startswith(f"registry pid {a.registry_pid}   keep_warm_s 0")
    assert alone.split("\n", 1)[1] == format_status([("x", a)]).split("\n", 1)[1]


def test_an_empty_registry_says_so():
    stats = Registry().stats()
    text = format_status([("/run/r.sock", stats)])
    assert "no segments resident" in text and "no engines connected" in text


def test_linears_kept_private_are_named_with_why():
    why = "every linear: packed sharing cannot work here (no bfloat16 matmul on this CPU)"
    text = format_status(stats_with([{"published_bytes": 4 * MB, "private_linears": why}, {"shared_bytes": 4 * MB}]))
    assert f"pid 1000: oneDNN linears kept private: {why}" in text.splitlines()
    assert "pid 1001" not in text
