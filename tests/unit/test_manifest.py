"""The manifest cache: a re-scan reads no tensor bytes; damaged or stale entries are redone."""

from __future__ import annotations

import os
import shutil

import pytest

from harness.procs import evict_from_page_cache, resident_bytes
from helpers import scan_json


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_rescan_reads_no_tensor_bytes(minilm, tmp_path):
    model = _copy(minilm, tmp_path / "m")
    cache = tmp_path / "cache"
    first = scan_json(model, cache=cache)["models"][0]
    assert first["hashed_bytes"] == first["bytes"] > 0 and first["cached_files"] == 0

    # Proof that no tensor byte is read: with the file's pages dropped from the page cache, a
    # cached scan brings back only the header's pages.
    f = model / "model.safetensors"
    evict_from_page_cache(f)
    second = scan_json(model, cache=cache)["models"][0]
    assert second["hashed_bytes"] == 0 and second["cached_files"] == 1
    assert resident_bytes(f) <= 64 << 10, resident_bytes(f)  # the header: 12 kB here, in pages

    # A rewrite in place that keeps size, header and mtime still changes the ctime: hashed again.
    st = os.stat(f)
    with open(f, "r+b") as fh:
        fh.seek(st.st_size // 2)
        fh.write(b"\x5a" * 4096)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(f).st_size, os.stat(f).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    third = scan_json(model, minilm, cache=cache)
    assert third["models"][0]["hashed_bytes"] == third["models"][0]["bytes"]
    assert third["pairs"][0]["shared_bytes"] < third["models"][0]["bytes"]  # the new bytes' keys


def test_rewritten_file_is_rescanned(minilm, tmp_path):
    model = _copy(minilm, tmp_path / "m")
    cache = tmp_path / "cache"
    scan_json(model, cache=cache)
    f = model / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))  # a normal rewrite: new mtime
    again = scan_json(model, minilm, cache=cache)
    assert again["models"][0]["hashed_bytes"] > 0
    assert again["pairs"][0]["shared_bytes"] < again["models"][0]["bytes"]


def _damage_invalid_json(text: str, other: str) -> str:
    return text[: len(text) // 2]


def _damage_a_key_digit(text: str, other: str) -> str:
    # Valid JSON, wrong content: one hex digit of a content key flipped, checksum kept.
    i = text.index(":", text.index("bfloat16[") if "bfloat16[" in text else text.index("float32[")) + 1
    return text[:i] + ("0" if text[i] != "0" else "1") + text[i + 1 :]


def _damage_other_files_manifest(text: str, other: str) -> str:
    # A well-formed manifest, but made for another file: its identity does not match.
    return other


def _damage_a_byte_not_utf8(text: str, other: str) -> bytes:
    # One byte of the file damaged on disk: not UTF-8 any more.
    data = bytearray(text.encode())
    data[10] = 0xFF
    return bytes(data)


def _damage_a_key_not_a_string(text: str, other: str) -> str:
    # Crafted: a content key that is a number, under a checksum made to match.
    import json

    import xxhash

    outer = json.loads(text)
    outer["body"]["tensors"][0][4] = 5
    canonical = json.dumps(outer["body"], separators=(",", ":"), sort_keys=True)
    outer["checksum"] = xxhash.xxh3_128_hexdigest(canonical.encode())
    return json.dumps(outer)


def _scan(*models, cache, no_cache: bool = False) -> dict:
    """What ``vllm-dedup scan --json`` reports, computed in this process (same code, no
    interpreter start-up per scan)."""
    from vllm_dedup.scan.files import scan_model
    from vllm_dedup.checkpoint.manifest import ManifestCache
    from vllm_dedup.scan.report import Report

    store = ManifestCache(None if no_cache else cache)
    return Report([scan_model(m, cache=store, progress=False) for m in models]).to_dict()


@pytest.mark.parametrize("damage", [_damage_invalid_json, _damage_a_key_digit, _damage_other_files_manifest,
                                    _damage_a_byte_not_utf8, _damage_a_key_not_a_string])
def test_damaged_or_stale_manifest_is_detected_and_recomputed(minilm, tmp_path, damage):
    model = _copy(minilm, tmp_path / "m")
    other_cache = tmp_path / "other"
    _scan(minilm, cache=other_cache)
    (other_entry,) = (other_cache / "manifests").glob("*.json")

    cache = tmp_path / "cache"
    clean = _scan(model, minilm, cache=cache, no_cache=True)
    _scan(model, cache=cache)
    (entry,) = (cache / "manifests").glob("*.json")
    damaged = damage(entry.read_text(), other_entry.read_text())
    entry.write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())

    again = _scan(model, minilm, cache=cache)
    assert again["models"][0]["hashed_bytes"] == again["models"][0]["bytes"]
    assert again["pairs"] == clean["pairs"]
    # ...and the entry was rewritten, so the next scan trusts it again.
    assert _scan(model, cache=cache)["models"][0]["hashed_bytes"] == 0


def test_a_file_changed_a_moment_ago_is_cached_only_once_its_tick_has_passed(minilm, tmp_path, monkeypatch):
    """Note [racily clean files]: a file whose ctime is under `RACY_WINDOW_NS` old is looked at
    again after that wait.  If it changed meanwhile (here a write during the wait, standing in
    for one within the same timestamp tick, which this kernel's fine-grained times do not
    allow), its manifest is not stored and the next look hashes it again; if it did not, the
    manifest is stored and the next look reads no tensor bytes."""
    from vllm_dedup.checkpoint import manifest as mf

    model = _copy(minilm, tmp_path / "m")
    f = model / "model.safetensors"
    real_sleep, waits = mf.time.sleep, []

    def write_while_waiting(seconds):
        waits.append(seconds)
        real_sleep(seconds)
        with open(f, "r+b") as fh:  # the same bytes again: only the times change
            fh.seek(os.stat(f).st_size - 4096)
            tail = fh.read(4096)
            fh.seek(-4096, os.SEEK_END)
            fh.write(tail)

    cache = mf.ManifestCache(tmp_path / "cache")
    monkeypatch.setattr(mf.time, "sleep", write_while_waiting)
    os.utime(f)  # changed just now
    _, hashed = mf.file_manifest(f, cache)
    assert hashed > 0 and len(waits) == 1 and 0 < waits[0] <= mf.RACY_WINDOW_NS / 1e9
    monkeypatch.setattr(mf.time, "sleep", lambda s: (waits.append(s), real_sleep(s)))
    os.utime(f)
    _, hashed = mf.file_manifest(f, cache)  # not stored above: hashed again, after a wait
    assert hashed > 0 and len(waits) == 2
    _, hashed = mf.file_manifest(f, cache)  # settled and stored: no wait, no bytes read
    assert hashed == 0 and len(waits) == 2


@pytest.mark.parametrize("whose", ["writable by all", "writable by its group", "another user's"])
def test_a_cache_folder_others_can_write_is_not_used(minilm, tmp_path, whose):
    """A manifest's keys are trusted without reading the file they name: a cache folder another
    user owns or may write (its group too: a team's folder) is neither read nor written, and
    the file is hashed instead."""
    from vllm_dedup.checkpoint.manifest import ManifestCache, file_manifest

    cache_root = tmp_path / "cache"
    warm = ManifestCache(cache_root)
    manifest, hashed = file_manifest(minilm / "model.safetensors", warm)
    assert hashed > 0 and len(list((cache_root / "manifests").iterdir())) == 1
    if whose == "writable by all":
        os.chmod(cache_root / "manifests", 0o777)
    elif whose == "writable by its group":
        os.chmod(cache_root, 0o2775)
    else:
        os.chown(cache_root, 12345, 12345)  # the tests run as root, who may give it away
    again = ManifestCache(cache_root)
    assert again.get(manifest.identity) is None and again.dir is None
    assert file_manifest(minilm / "model.safetensors", again)[1] == hashed


@pytest.mark.parametrize("xdg, home, want", [
    ("/var/cache/x", "/home/u", "/var/cache/x/vllm-dedup"),
    ("relative/cache", "/home/u", "/home/u/.cache/vllm-dedup"),  # the XDG spec: a relative path is ignored
    ("", "/home/u", "/home/u/.cache/vllm-dedup"),
    ("", "~", None),  # no HOME and no passwd entry: expanduser leaves "~"
])
def test_the_cache_folder_is_always_an_absolute_path(monkeypatch, xdg, home, want):
    from vllm_dedup.checkpoint import manifest

    monkeypatch.delenv("VLLM_DEDUP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.setattr(manifest.os.path, "expanduser", lambda path: home if path == "~" else path)
    got = manifest.default_cache_dir()
    assert got.is_absolute()
    if want is None:
        assert got.parent == manifest.Path(manifest.tempfile.gettempdir()) and got.name == f"vllm-dedup-{os.getuid()}"
    else:
        assert str(got) == want
