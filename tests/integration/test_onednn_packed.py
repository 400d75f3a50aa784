"""Packed oneDNN weights shared between real processes (`vllm_dedup.engine.onednn`, peers in
tests/peers/onednn_peer.py): two processes' handlers read one sealed memfd segment, PSS counts
its pages once, results stay bit-identical, and a write to a shared packed page faults."""

from __future__ import annotations

import signal

import pytest

from harness.procs import ChildExited, PeerProcess

pytest.importorskip("vllm._custom_ops")
pytestmark = pytest.mark.slow  # each peer imports vLLM's CPU kernels (about 6 s a test)

PEER = "tests/peers/onednn_peer.py"
N, K = 5632, 2048  # a 1B Llama's MLP projection: 23 MB packed


@pytest.fixture(scope="module", autouse=True)
def _supported():
    from vllm_dedup.engine import onednn

    support = onednn.probe("bfloat16")
    if not support.supported:
        pytest.skip(f"packed sharing is not supported here: {support.reason}")


def _peer(seed: int = 0) -> tuple[PeerProcess, dict]:
    peer = PeerProcess([PEER, N, K, seed], f"onednn peer {seed}")
    return peer, peer.read_json(timeout_s=180)


def _ask(peer: PeerProcess, request: dict) -> dict:
    peer.send(request)
    return peer.read_json(timeout_s=120)


def test_two_processes_run_on_one_segment():
    a, info = _peer()
    b, _ = _peer()
    with a, b:
        want = _ask(a, {"run": True})["digest"]
        assert _ask(b, {"run": True})["digest"] == want
        private_before = _ask(b, {"memory": True})["private"]
        fd = _ask(a, {"publish": True})["fd"]
        assert _ask(b, {"attach": [a.pid, fd]})["freed"] == info["nbytes"]
        for peer in (a, b):
            assert _ask(peer, {"run": True})["digest"] == want  # bit-identical on the segment
        nbytes = info["nbytes"]
        for peer in (a, b):
            mem = _ask(peer, {"memory": True})
            assert mem["segment_rss"] >= nbytes  # populated, read-only, shared
            assert abs(mem["segment_pss"] - nbytes / 2) <= 16 << 10  # its pages are counted once
        assert private_before - _ask(b, {"memory": True})["private"] >= nbytes * 0.95  # its copy is gone


def test_a_write_to_a_shared_packed_page_faults():
    a, _ = _peer()
    b, _ = _peer()
    with a, b:
        want = _ask(a, {"run": True})["digest"]
        fd = _ask(a, {"publish": True})["fd"]
        _ask(b, {"attach": [a.pid, fd]})
        b.send({"write": True})
        with pytest.raises(ChildExited):
            b.read(timeout_s=60)
        assert b.proc.wait() == -signal.SIGSEGV
        assert _ask(a, {"run": True})["digest"] == want  # the other process's weight is unchanged


def test_a_private_packed_page_is_writable():
    """The control: the same write into a handler's own buffer does not fault (so the fault
    above is the segment's read-only mapping, not the address)."""
    a, _ = _peer()
    with a:
        assert _ask(a, {"write": True})["wrote"]
