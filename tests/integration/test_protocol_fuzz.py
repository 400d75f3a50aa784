"""Property-based tests of the registry protocol (Hypothesis): arbitrary bytes, arbitrary JSON
objects, valid requests with mutated fields, and any number of descriptors of any kind, each
sent on a raw socket to a real `RegistryServer` serving from this process.

After every message: the registry answered with a JSON object (an ``"error"`` string, or the
valid reply of an accepted request); no descriptor leaked or was lost in this process; a
rejected request left the registry exactly as it was; and a well-behaved client still gets
its stats, hello and acquire answered.  (Targeted cases: test_hostile_clients.py.)

``VLLM_DEDUP_FUZZ_EXAMPLES=5000`` runs each property on that many examples (default 100; about
5 ms an example).
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers import wait_for
from rawclient import (DESCRIPTOR_KINDS, KEY, NBYTES, RawClient, descriptor, engine_ids, fd_kind, fd_kinds, publisher,
                       registry_state, well_behaved)
from vllm_dedup.registry import messages as m
from vllm_dedup.registry import wire
from vllm_dedup.registry.server import RegistryServer
from vllm_dedup.registry.state import Registry, RegistryStats

# Generous deadlines: the machine is shared, and a stalled registry fails on its socket timeout.
FUZZ = settings(max_examples=int(os.environ.get("VLLM_DEDUP_FUZZ_EXAMPLES", "100")), deadline=5000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# A valid body of every request but shutdown (a forced one would stop the registry under test).
VALID = {
    "hello": {"pid": 4242, "model": "m", "device": "cpu", "group": "default", "signature": "s"},
    "acquire": {"keys": [KEY, "absent"]},
    "publish": {"nbytes": NBYTES, "keys": [["fuzz-key", 0, NBYTES // 2], ["fuzz-key-2", NBYTES // 2, NBYTES // 2]]},
    "release": {"segments": [1, 99]},
    "report": {"load": {"shared_tensors": 1, "shared_bytes": 2, "collisions": 0, "seconds": 0.5, "errors": []}},
    "lock": {"names": ["fuzz-lock"], "owner": None},
    "unlock": {"names": ["fuzz-lock"]},
    "expect": {},
    "stats": {},
}
REPLIES = {"hello": m.HelloReply, "acquire": m.AcquireReply, "publish": m.PublishReply, "release": m.Empty,
           "report": m.Empty, "lock": m.LockReply, "unlock": m.Empty, "expect": m.ExpectReply, "shutdown": m.ShutdownReply}


@pytest.fixture(scope="module")
def fuzz_registry(tmp_path_factory):
    """One registry for every example (it must survive them all), with ``KEY`` published by an
    engine that stays connected."""
    server = RegistryServer(Registry(), tmp_path_factory.mktemp("fuzz") / "run" / "fuzz.sock").start()
    with publisher(server):
        yield server
    server.stop()


def exchange(server: RegistryServer, payload: bytes | dict, kinds: list[str] = (), hello: bool = True) -> dict:
    """Send one message with descriptors of ``kinds`` (`rawclient.descriptor`) on a fresh
    connection (that said hello first, with ``hello``); check everything the module docstring
    promises and return the reply."""
    engines_before = engine_ids(server)
    with RawClient(server.path) as raw:
        if hello:
            raw.hello()
        else:
            raw.ask({"op": "stats"})  # the registry has accepted the connection: its socket is counted
        fds_before, state_before = fd_kinds(), registry_state(server)
        fds = [descriptor(kind, NBYTES) for kind in kinds]
        try:
            raw.send(payload, fds)
        finally:
            for fd in fds:
                os.close(fd)
        reply, got = raw.recv()
        got_kinds = [fd_kind(fd) for fd in got]
        for fd in got:
            os.close(fd)
        assert isinstance(reply, dict), "the registry hung up instead of answering"
        event("refused" if "error" in reply else "accepted")  # --hypothesis-show-statistics
        assert got_kinds == ["memfd"] * len(reply.get("segments", ()))
        if "error" in reply:
            assert isinstance(reply["error"], str) and 0 < len(reply["error"]) < 1000
            assert registry_state(server) == state_before, "a rejected request changed the registry"
        # The registry kept exactly the descriptor of a segment it accepted, nothing else.
        expected = fds_before + Counter(memfd=1) if "segment" in reply else fds_before
        assert fd_kinds() == expected, f"{fd_kinds() - expected} leaked, {expected - fd_kinds()} lost"
    assert wait_for(lambda: engine_ids(server) == engines_before, timeout_s=10, poll_s=0.001), \
        "the raw connection's lease outlived it"
    well_behaved(server)
    return reply


def check_reply(op: str, reply: dict) -> None:
    """An accepted request's reply has the shape of its type."""
    if op == "stats":
        RegistryStats.from_dict(reply)
    else:
        REPLIES[op].from_wire(reply)


def is_json_object(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=15,
)
FIELDS = sorted({name for body in VALID.values() for name in body} | {"force", "op"})


@FUZZ
@given(payload=st.binary(max_size=2048))
def test_arbitrary_bytes_are_answered(fuzz_registry, payload):
    reply = exchange(fuzz_registry, payload)
    if not is_json_object(payload):
        assert reply["error"].startswith("bad request: ")


@FUZZ
@given(msg=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=12), json_values, max_size=6),
       op=st.sampled_from([*VALID, "shutdown"]) | st.text(max_size=12) | json_values)
def test_arbitrary_json_objects_are_answered(fuzz_registry, msg, op):
    msg = {**msg, "op": op}
    if op == "shutdown" and msg.get("force") is True:
        msg["force"] = False
    reply = exchange(fuzz_registry, msg)
    if not isinstance(op, str) or op not in m.REQUESTS:
        assert reply["error"].startswith("unknown op")
    elif "error" not in reply:
        check_reply(op, reply)


BOUNDARY_INTS = st.sampled_from([-1, 0, 1, NBYTES - 1, NBYTES, NBYTES + 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**40])
HOSTILE = (json_values | BOUNDARY_INTS | st.integers() | st.sampled_from(["", "x" * 5000, "é" * 4097])
           | st.builds(lambda n: ["k"] * n, st.sampled_from([0, 1, 250, 251, 70_000])))


@st.composite
def mutated_requests(draw):
    """A valid request with one or two of its values (at any depth) replaced or removed, or a
    field added."""
    op = draw(st.sampled_from(list(VALID)))
    msg = json.loads(json.dumps(VALID[op]))  # a deep copy
    for _ in range(draw(st.integers(1, 2))):
        paths = list(_paths(msg))
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"] if paths else ["add"]))
        if action == "add":
            msg[draw(st.text(max_size=8))] = draw(HOSTILE)
            continue
        path = draw(st.sampled_from(paths))
        parent = msg
        for k in path[:-1]:
            parent = parent[k]
        if action == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(HOSTILE)
    return {**msg, "op": op}


def _paths(obj, prefix=()):
    """The path (keys and indexes) of every value inside ``obj``."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield (*prefix, k)
        yield from _paths(v, (*prefix, k))


@FUZZ
@given(msg=mutated_requests())
def test_requests_with_mutated_fields_are_refused_or_valid(fuzz_registry, msg):
    op = msg["op"]
    reply = exchange(fuzz_registry, msg, ["sealed memfd"] if op == "publish" else [])
    if "error" in reply:
        return
    check_reply(op, reply)
    if op == "publish":  # accepted: every tensor lies inside the segment, which is big enough
        assert 0 <= msg["nbytes"] <= NBYTES and msg["keys"]
        assert all(0 <= off and 0 <= n and off + n <= msg["nbytes"] and len(k) <= 4096 for k, off, n in msg["keys"])
    if op == "acquire":
        assert len(msg["keys"]) <= wire.MAX_FDS
    if op == "report":
        collisions = msg["load"].get("collisions", 0)
        assert type(collisions) is int and collisions >= 0 and len(msg["load"]) <= 64


@FUZZ
@given(op=st.sampled_from([op for op in VALID if op != "hello"]),
       kinds=st.lists(st.sampled_from(DESCRIPTOR_KINDS), max_size=4)
       | st.builds(lambda kind, n: [kind] * n, st.sampled_from(DESCRIPTOR_KINDS), st.integers(0, 253)))
def test_any_number_of_descriptors_of_any_kind(fuzz_registry, op, kinds):
    reply = exchange(fuzz_registry, {"op": op, **VALID[op]}, kinds)
    cls = m.REQUESTS[op]
    valid = len(kinds) == cls.fds and (op != "publish" or kinds == ["sealed memfd"])
    assert ("error" not in reply) == valid, reply
    if len(kinds) != cls.fds:
        assert f"carries exactly {cls.fds} descriptor(s), got {len(kinds)}" in reply["error"]


@FUZZ
@given(op=st.sampled_from([op for op in VALID if op not in ("hello", "stats")]))
def test_requests_before_hello_are_refused(fuzz_registry, op):
    reply = exchange(fuzz_registry, {"op": op, **VALID[op]}, ["sealed memfd"] if op == "publish" else [], hello=False)
    assert reply == {"error": f"op {op!r} needs a hello first"}
