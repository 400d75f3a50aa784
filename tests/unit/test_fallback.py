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


def test_the_warning_says_vllm_dedup_once_and_advises_fallback_only_where_it_is_not_set(monkeypatch, tmp_path):
    """A registry that cannot be reached (a socket folder where no daemon can start: a file
    stands in its way), under each setting: the raised error advises ``fallback``; the warning
    of an engine that has it does not, and carries the logger's prefix only."""
    from vllm_dedup.engine.session import EngineSession

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(blocked))
    with pytest.raises(RegistryUnavailable, match="on_registry_error='fallback'"):
        EngineSession().connect(DedupConfig(registry_address="local", on_registry_error="fail"), "m", "cpu", "sig")
    said = []
    monkeypatch.setattr(fallback.logger, "warning", lambda fmt, *args: said.append(fmt % args))
    assert EngineSession().connect(DedupConfig(registry_address="local"), "m", "cpu", "sig") is None
    (warning,) = said
    assert warning.startswith("cannot reach the weight registry") and "on_registry_error" not in warning, warning
