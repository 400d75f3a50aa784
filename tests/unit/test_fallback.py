"""`engine.fallback.fail_or_fall_back`: the one rule for a failure inside vllm-dedup.  Under
``on_registry_error="fail"`` the error is raised as the `DedupError` it is; otherwise one
warning says what failed and what the engine does instead, and the engine goes on."""

from __future__ import annotations

import pytest

from vllm_dedup.config import DedupConfig
from vllm_dedup.engine import fallback
from vllm_dedup.errors import DedupError, LockTimeout, RegistryUnavailable, SegmentError


@pytest.mark.parametrize("error", [RegistryUnavailable("no registry at x"), SegmentError("memfd: EFBIG"),
                                   LockTimeout("lock held by pid 7")], ids=lambda e: type(e).__name__)
def test_fail_raises_the_error_as_it_is_and_fallback_warns_once(error, monkeypatch):
    with pytest.raises(type(error)) as raised:
        fallback.fail_or_fall_back(DedupConfig(on_registry_error="fail"), error, "loading without sharing")
    assert raised.value is error and isinstance(raised.value, DedupError)
    said = []
    monkeypatch.setattr(fallback.logger, "warning", lambda fmt, *args: said.append(fmt % args))
    assert fallback.fail_or_fall_back(DedupConfig(), error, "loading without sharing") is None
    assert said == [f"{error}; loading without sharing"]


def test_a_lock_timeout_is_still_a_timeout():
    assert issubclass(LockTimeout, TimeoutError) and issubclass(LockTimeout, DedupError)
