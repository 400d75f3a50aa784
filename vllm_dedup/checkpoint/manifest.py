"""The manifest cache: source keys of a weight file, remembered across scans and loads.

Hashing a 100 GB checkpoint costs seconds even at memory speed, and a cold read costs far
more; a scan of files already scanned should read no tensor bytes at all.  A manifest holds one
file's tensor entries and source keys (BLAKE3-256, `content.keys.source_key`), stored under the user's cache directory and looked up
by the file's identity:

    (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns, XXH3-128 of the file's header bytes)

The header (safetensors' JSON header, GGUF's metadata and tensor table) changes whenever names,
dtypes, shapes or offsets do; size and mtime change on every ordinary rewrite.  ``st_ctime_ns``
is what catches the rest: the kernel sets it on every write and on every change of the file's
metadata, mtime included, and no user tool can set it back.  A checkpoint rewritten in place
with its size, header and mtime restored therefore gets a new identity and is hashed again.
(vLLM's own weight cache keys on file headers and would serve such a file stale.)  The engine
trusts these keys without reading the file (docs/architecture.md, "Loading only what is not
resident"), which is why the identity must catch every rewrite.

An identity is taken only once the tick of the file's last change has passed (Note [racily
clean files]).

A manifest is never trusted blindly: its JSON carries the identity it was made for and an
XXH3-128 checksum over its body.  An entry that does not parse, whose checksum fails, or whose
identity differs from the file's is recomputed and rewritten (atomically: write to a temporary
file, then ``os.replace``).
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..content.keys import ContentKey, content_keys, source_key_of_chunks
from ..errors import CheckpointError
from ..log import init_logger
from .readers import TensorEntry, open_weight_file

__all__ = ["FileIdentity", "Manifest", "ManifestCache", "default_cache_dir", "file_manifest", "settled"]

logger = init_logger(__name__)

_VERSION = 4  # 2: identity carries st_ctime_ns; 3: source keys are BLAKE3-256; 4: a pickle's views each listed

# Note [racily clean files]
# A file's times come from the kernel's coarse clock, which moves one tick at a time (a jiffy,
# 1 to 10 ms, on ext4, XFS, btrfs and tmpfs before Linux 6.13's fine-grained timestamps).  A
# write within the tick of the ctime we saw would leave the identity as it was, and a manifest
# stored then could be served for bytes it was not made from.  Git calls such index entries
# "racily clean".  Here an identity whose ctime lies less than `RACY_WINDOW_NS` before now is
# taken again once that much time has passed: any later write then lands in a later tick and
# changes the ctime.  A file still changing then is hashed, and its manifest is not stored.
RACY_WINDOW_NS = 100_000_000  # ten ticks at HZ=100; only a file changed that recently waits


def default_cache_dir() -> Path:
    """``$VLLM_DEDUP_CACHE_DIR``, else ``$XDG_CACHE_HOME/vllm-dedup``, else ``~/.cache/vllm-dedup``;
    where neither gives an absolute path (a relative ``XDG_CACHE_HOME`` is to be ignored, the
    XDG Base Directory spec says; a process without ``HOME`` whose uid has no passwd entry, as
    containers run with an arbitrary uid), ``vllm-dedup-<uid>`` in the temporary directory,
    which `ManifestCache` uses only while it is this user's alone."""
    if env := os.environ.get("VLLM_DEDUP_CACHE_DIR"):
        return Path(env)
    xdg, home = os.environ.get("XDG_CACHE_HOME", ""), os.path.expanduser("~")
    if os.path.isabs(xdg):
        return Path(xdg) / "vllm-dedup"
    if os.path.isabs(home):
        return Path(home) / ".cache" / "vllm-dedup"
    return Path(tempfile.gettempdir()) / f"vllm-dedup-{os.getuid()}"


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What a file is, without reading its tensor bytes."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    header_digest: str

    @classmethod
    def of(cls, path: Path, header: bytes, fd: int | None = None) -> FileIdentity:
        """The identity of ``path`` now, given its header bytes (`WeightFile.header`); with
        ``fd``, of the file open there (what a reader of ``fd`` reads, whatever ``path`` names
        by now)."""
        st = os.stat(path) if fd is None else os.fstat(fd)
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                   xxhash.xxh3_128_hexdigest(header))

    def cache_name(self) -> str:
        return xxhash.xxh3_128_hexdigest(repr(self).encode()) + ".json"


@dataclass(frozen=True, slots=True)
class Manifest:
    """One file's tensors and their content keys, in file order."""

    identity: FileIdentity
    entries: tuple[TensorEntry, ...]
    keys: tuple[ContentKey, ...]

    def to_json(self) -> str:
        body = {
            "version": _VERSION,
            "identity": [getattr(self.identity, f) for f in FileIdentity.__slots__],
            "tensors": [
                [e.name, e.dtype, list(e.shape), e.nbytes, str(k)]
                for e, k in zip(self.entries, self.keys)
            ],
        }
        text = json.dumps(body, separators=(",", ":"), sort_keys=True)
        return json.dumps({"body": body, "checksum": xxhash.xxh3_128_hexdigest(text.encode())})

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and check a stored manifest (its file's bytes, or their text).

        Raises:
            ValueError: it is not UTF-8 JSON (`UnicodeDecodeError` is one), its checksum
                fails, its version is not ours, or a field is not of its type.
        """
        outer = json.loads(text)
        body = outer["body"]
        canonical = json.dumps(body, separators=(",", ":"), sort_keys=True)
        if xxhash.xxh3_128_hexdigest(canonical.encode()) != outer["checksum"]:
            raise ValueError("checksum mismatch")
        if body["version"] != _VERSION:
            raise ValueError(f"manifest version {body['version']}, expected {_VERSION}")
        identity = FileIdentity(*body["identity"])
        entries, keys = [], []
        for name, dtype, shape, nbytes, key in body["tensors"]:
            if not all(isinstance(s, str) for s in (name, dtype, key)):  # a checksum proves no type
                raise ValueError(f"a tensor entry's name, dtype and key must be strings: {[name, dtype, key]!r}")
            entries.append(TensorEntry(name, dtype, tuple(shape), int(nbytes)))
            keys.append(ContentKey.parse(key))
        return cls(identity, tuple(entries), tuple(keys))


class ManifestCache:
    """Manifests stored as one JSON file per weight-file identity under ``root/manifests``.

    ``root=None`` disables the cache (every lookup misses, nothing is written), and so does a
    ``root`` or ``manifests`` folder that is not this user's or that its group or every user may
    write: a manifest's keys are trusted without reading the file they name, so one written by
    somebody else could make an engine map bytes its checkpoint does not hold.
    """

    def __init__(self, root: Path | None):
        self.dir = None if root is None else Path(root) / "manifests"
        self.rejected = 0  # entries found damaged or stale, then recomputed
        self._checked = False

    def _usable(self) -> bool:
        """Whether the cache is on and its folders are this user's (created here, mode 0700, where
        missing), writable by no one else (neither its group, a team's folder, nor all); else the
        cache is turned off for good, once said."""
        if self.dir is None or self._checked:
            return self.dir is not None
        try:
            for folder in (self.dir.parent, self.dir):
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                info = os.lstat(folder)
                if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                        or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
                    raise PermissionError(f"{folder} is not a folder of uid {os.getuid()} that no one else can write "
                                          f"(if it is yours: chmod go-w {folder})")
        except OSError as e:
            logger.warning("manifest cache %s not used (%s); checkpoints are hashed again", self.dir, e)
            self.dir = None
            return False
        self._checked = True
        return True

    def get(self, identity: FileIdentity) -> Manifest | None:
        """The stored manifest for ``identity``, or None if absent, damaged or stale."""
        if not self._usable():
            return None
        path = self.dir / identity.cache_name()
        try:
            text = path.read_bytes()  # decoded by the parse below: a damaged byte is a damaged entry
        except FileNotFoundError:
            return None
        except OSError:
            self.rejected += 1
            return None
        try:
            manifest = Manifest.from_json(text)
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            self.rejected += 1
            return None
        if manifest.identity != identity:
            self.rejected += 1
            return None
        return manifest

    def put(self, manifest: Manifest) -> None:
        """Store ``manifest`` atomically.  A cache that cannot be written is skipped."""
        if not self._usable():
            return
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(manifest.to_json())
                os.replace(tmp, self.dir / manifest.identity.cache_name())
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            logger.warning("manifest cache %s not written (%s); the next scan hashes again", self.dir, e)


def _stat_part(st) -> tuple:
    """The part of a `FileIdentity` a ``stat`` gives (from an ``os.stat_result`` or an identity)."""
    if isinstance(st, FileIdentity):
        return st.dev, st.ino, st.size, st.mtime_ns, st.ctime_ns
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def settled(identity: FileIdentity, taken_ns: int) -> bool:
    """Whether no write after ``identity`` was taken (at ``taken_ns``, `time.time_ns`, or
    before) could leave it unchanged: the file's last change lies `RACY_WINDOW_NS` or more
    before then (Note [racily clean files])."""
    return taken_ns - identity.ctime_ns >= RACY_WINDOW_NS


def _settled_identity(path: Path, wf) -> tuple[FileIdentity, bool]:
    """(identity of the open weight file ``wf``, whether no write could go unseen by it): Note
    [racily clean files], Note [one descriptor per weight file]."""
    taken_ns = time.time_ns()
    identity = FileIdentity.of(path, wf.header(), wf.descriptor())
    if settled(identity, taken_ns):
        return identity, True
    if identity.ctime_ns > taken_ns:  # changed "in the future": another machine's clock (NFS); no wait would tell
        return identity, False
    time.sleep((identity.ctime_ns + RACY_WINDOW_NS - taken_ns) / 1e9)
    again = FileIdentity.of(path, wf.header(), wf.descriptor())
    return again, again == identity


def file_manifest(path: Path, cache: ManifestCache, threads: int | None = None,
                  progress=None) -> tuple[Manifest, int]:
    """The manifest of one weight file: from the cache, or by hashing its tensors (then cached).

    Args:
        path: a weight file (`readers.open_weight_file` reads it).
        cache: where manifests are kept (``ManifestCache(None)``: nowhere).
        threads: hashing threads (`content.keys.content_keys`).
        progress: a tqdm-like bar updated with bytes, or None.

    Returns:
        (manifest, tensor bytes hashed: 0 when the cache had it).

    Raises:
        CheckpointError: the file cannot be read, or changed while it was (its size, times or
            inode).  A file changed within `RACY_WINDOW_NS` is looked at again after that
            wait, and its manifest is not stored if it changed meanwhile.
    """
    try:
        before = _stat_part(os.stat(path))  # for readers that open by path (below)
    except OSError:
        before = None  # `open_weight_file` says what is wrong; a file that appears meanwhile: changed
    with open_weight_file(path) as wf:
        identity, storable = _settled_identity(path, wf)
        if wf.descriptor() is None and before != _stat_part(identity):
            # GGUF and pickle readers open the path themselves: replaced between their open and
            # this identity, the keys would be the old file's under the new one's identity.
            raise CheckpointError(path, "the file changed while it was opened; read it again once it is written")
        manifest = cache.get(identity)
        if manifest is not None:
            if progress is not None:
                progress.update(sum(e.nbytes for e in manifest.entries))
            return manifest, 0
        entries = wf.entries()

        def key_of(e: TensorEntry):
            def compute() -> ContentKey:
                return source_key_of_chunks(wf.chunks(e.name), e.dtype, e.shape)  # Note [reading, not mapping, to hash]

            return compute

        done = (lambda i: progress.update(entries[i].nbytes)) if progress is not None else None
        keys = content_keys([key_of(e) for e in entries], threads=threads, on_done=done)
        if FileIdentity.of(path, wf.header(), wf.descriptor()) != identity:  # written meanwhile: keys of neither version
            raise CheckpointError(path, "the file changed while it was read; read it again once it is written")
    manifest = Manifest(identity, tuple(entries), tuple(keys))
    if storable:
        cache.put(manifest)
    return manifest, sum(e.nbytes for e in entries)
