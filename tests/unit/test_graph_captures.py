"""`segments.cuda.GraphCaptures`: a CUDA graph capture on one thread is seen from every thread,
so that a mapping's finalizer running elsewhere defers its unmap (tests/integration/
test_cuda_model.py checks that `segments.vmm` defers when told so)."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_dedup.segments.cuda import GraphCaptures


class Graph:
    """The two methods of ``torch.cuda.CUDAGraph`` that `GraphCaptures` wraps, with the calling
    convention torch uses (``torch.cuda.graph`` calls ``capture_begin(pool, capture_error_mode=)``
    on entry and ``capture_end()`` on exit); torch's own cannot capture without a GPU."""

    def capture_begin(self, pool=None, capture_error_mode="global"):
        if capture_error_mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(f"bad capture_error_mode {capture_error_mode!r}")

    def capture_end(self):
        pass


def test_a_capture_on_one_thread_is_seen_from_another():
    captures = GraphCaptures()
    captures.track(Graph)
    captures.track(Graph)  # idempotent: one count per capture
    seen: list[bool] = []
    began, checked = threading.Event(), threading.Event()

    def capture():
        g = Graph()
        g.capture_begin(None, capture_error_mode="thread_local")
        began.set()
        checked.wait(10)
        g.capture_end()

    other = threading.Thread(target=capture)
    other.start()
    assert began.wait(10)
    seen.append(captures.underway())  # this thread's stream captures nothing; another's does
    checked.set()
    other.join(10)
    seen.append(captures.underway())
    assert seen == [True, False]


def test_a_capture_that_fails_to_begin_or_ends_invalid_is_not_counted_as_underway():
    captures = GraphCaptures()
    captures.track(Graph)
    with pytest.raises(RuntimeError):
        Graph().capture_begin(capture_error_mode="nonsense")
    assert not captures.underway()

    class Invalid(Graph):
        def capture_end(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    captures.track(Invalid)
    g = Invalid()
    g.capture_begin()
    assert captures.underway()
    with pytest.raises(RuntimeError):
        g.capture_end()
    assert not captures.underway()


def test_torch_cuda_graph_is_tracked_and_a_begin_without_a_gpu_counts_nothing():
    """The real class: on this CPU build of torch a capture's begin raises; the count stays 0."""
    class Tracked(torch.cuda.CUDAGraph):  # a subclass, so that torch's own class is left as it is
        pass

    captures = GraphCaptures()
    captures.track(Tracked)
    assert Tracked.capture_begin is not torch.cuda.CUDAGraph.capture_begin
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: benchmarks/gpu_check.py captures for real")
    # This CPU build cannot make a graph (a dummy class), so the begin is called on an
    # uninitialised object: torch's capture_begin raises, and the wrapper counts nothing.
    with pytest.raises(AttributeError, match="_tracker|CUDAGraph"):
        Tracked.capture_begin(object.__new__(Tracked))
    assert not captures.underway()
