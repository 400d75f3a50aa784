"""What vLLM's default loader reads of a local model folder, for the fast paths: its
safetensors files, their tensors' source keys (from the manifest cache, `manifest.py`, or hashed
as ``pread`` reads them: Note [reading, not mapping, to hash] in `readers.py`), and chosen tensors read without touching the others
(docs/architecture.md, "Loading only what is not resident").
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import CheckpointError
from ..log import init_logger
from .manifest import FileIdentity, Manifest, ManifestCache, file_manifest, settled
from .readers import SafetensorsFile, index_shards

__all__ = ["changed_files", "checkpoint_files", "checkpoint_keys", "read_tensors", "write_manifests"]

logger = init_logger(__name__)


def checkpoint_files(model_dir: str | os.PathLike) -> list[Path] | None:
    """The safetensors files vLLM's default loader reads for a local HF model folder: the
    folder's ``*.safetensors`` (not its subfolders), only those a ``model.safetensors.index.json``
    names when there is one.  None when the folder holds no safetensors (the fast paths then do
    not apply)."""
    folder = Path(model_dir)
    if not folder.is_dir():
        return None
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if files and index.is_file():
        named = index_shards(index)
        if named is None:
            return None
        files = [f for f in files if f.name in named]
    return files or None


def checkpoint_keys(files: list[Path], cache: ManifestCache
                    ) -> tuple[dict[str, str], dict[str, Path], int, dict[Path, FileIdentity]]:
    """Source keys of every tensor of ``files``, from the manifest cache where it knows them,
    else by hashing the files (read a MiB at a time per thread: `readers.WeightFile.chunks`).

    Returns:
        (tensor name -> source key as a string, tensor name -> its file, tensor bytes hashed,
        file -> its identity the keys describe: `changed_files` tells whether it still is).

    Raises:
        CheckpointError: a file cannot be read, or two files hold a tensor of the same name.
    """
    keys: dict[str, str] = {}
    where: dict[str, Path] = {}
    identities: dict[Path, FileIdentity] = {}
    hashed = 0
    for path in files:
        manifest, n = file_manifest(path, cache)
        hashed += n
        identities[path] = manifest.identity
        for entry, key in zip(manifest.entries, manifest.keys):
            if entry.name in keys:
                raise CheckpointError(path, f"tensor {entry.name!r} is also in {where[entry.name]}")
            keys[entry.name] = str(key)
            where[entry.name] = path
    return keys, where, hashed, identities


def changed_files(identities: dict[Path, FileIdentity]) -> list[Path]:
    """The files whose identity (`FileIdentity`: inode, size, times, header) is no longer the
    one given: rewritten, replaced or gone since.  What was read from them may be neither
    version, so no recipe may say it came from the keys taken before."""
    changed = []
    for path, before in identities.items():
        try:
            with SafetensorsFile(path) as f:
                same = FileIdentity.of(path, f.header(), f.descriptor()) == before
        except (CheckpointError, OSError):
            same = False
        if not same:
            changed.append(path)
    return changed


def read_tensors(names: Iterable[str], where: dict[str, Path],
                 identities: dict[Path, FileIdentity] | None = None) -> Iterator[tuple[str, object]]:
    """``(name, tensor)`` for exactly ``names``, in checkpoint order, read from safetensors files
    through private copy-on-write mappings: no other tensor's bytes are touched, and the tensor
    handed to vLLM's weight loader is the file's pages themselves (it copies them once, into the
    parameter).  A loader writing into a tensor it was given gets a private copy of that page.

    With ``identities`` (each file's `FileIdentity` when its keys were taken), a file is read
    only if the file mapped is still that one when it is opened: a replay's loaded modules then
    come from the checkpoint its mapped modules' keys describe.  A file rewritten in place
    while it is read shows the new bytes through the mapping (a private mapping shares the
    pages it has not copied yet), as vLLM's own mapped read would; `changed_files` after the
    load catches that, and no recipe is left from it (`fast_path.leave_recipe`).  A file
    truncated meanwhile raises SIGBUS, as under vLLM's own read.

    Raises:
        CheckpointError: a file cannot be read, or is no longer the one ``identities`` names.
    """
    import mmap

    import torch

    wanted = set(names)
    page = mmap.PAGESIZE
    for path in sorted({where[n] for n in wanted}):
        with SafetensorsFile(path) as layout:  # Note [one descriptor per weight file]
            fd = layout.descriptor()
            if identities is not None and FileIdentity.of(path, layout.header(), fd) != identities.get(path):
                raise CheckpointError(path, "the file changed since its keys were taken (written or replaced "
                                            "meanwhile); the load reads it as usual")
            whole = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            # No readahead around what is read (its neighbours are mapped already, or not
            # wanted); the wanted ranges are asked for ahead instead.
            whole.madvise(mmap.MADV_RANDOM)
            entries = [e for e in layout.entries() if e.name in wanted]
            for entry in entries:
                start, end = layout.byte_range(entry.name)
                if end > start:
                    first = start - start % page
                    whole.madvise(mmap.MADV_WILLNEED, first, end - first)
            for entry in entries:
                start, end = layout.byte_range(entry.name)
                raw = (torch.frombuffer(whole, dtype=torch.uint8, count=end - start, offset=start) if end > start
                       else torch.empty(0, dtype=torch.uint8))
                yield entry.name, raw.view(getattr(torch, entry.dtype)).reshape(entry.shape)


def write_manifests(files: list[Path], identities: dict[Path, FileIdentity], keys: dict[str, str],
                    cache: ManifestCache, taken_ns: int) -> int:
    """Store a manifest for each of ``files`` whose every tensor was hashed during the load and
    whose identity is still the one taken before the load, at ``taken_ns`` (`time.time_ns`) or
    later (a file changed meanwhile is left out: its keys might describe neither version; so
    is one changed too shortly before to tell, `manifest.settled`).  ``keys`` names tensors, not files, so a
    file holding a name another of ``files`` holds too is left out: the key may be the other's
    tensor's.  Returns the number written."""
    from ..content.keys import ContentKey

    read = {}
    for path in files:
        try:
            with SafetensorsFile(path) as wf:
                read[path] = (FileIdentity.of(path, wf.header(), wf.descriptor()), wf.entries())
        except (CheckpointError, OSError) as e:
            logger.debug("no manifest for %s (%s)", path, e)
    holders = Counter(e.name for _, entries in read.values() for e in entries)
    written = 0
    for path, (now, entries) in read.items():
        if (now != identities.get(path) or not settled(now, taken_ns)
                or any(e.name not in keys or holders[e.name] > 1 for e in entries)):
            continue
        cache.put(Manifest(now, tuple(entries), tuple(ContentKey.parse(keys[e.name]) for e in entries)))
        written += 1
    return written
