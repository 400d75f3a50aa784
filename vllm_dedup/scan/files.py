"""A model's weight files, and its tensors with their content keys.

`model_files` turns a model path (HF folder, sharded folder with an index, Diffusers pipeline,
single file) into the weight files it consists of, choosing formats as transformers does.
`scan_model` gives every tensor of those files with its content key, reading keys from the
manifest cache where it can (`manifest.file_manifest`).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.manifest import ManifestCache, file_manifest
from ..checkpoint.readers import WEIGHT_SUFFIXES, TensorEntry, index_shards
from ..content.keys import ContentKey
from ..errors import CheckpointError

__all__ = ["ModelScan", "ScannedTensor", "model_files", "scan_model"]


@dataclass(frozen=True, slots=True)
class ScannedTensor:
    """A tensor of a model, with where it lives and its content key."""

    file: str
    entry: TensorEntry
    key: ContentKey


@dataclass
class ModelScan:
    """One model's tensors, and what the scan cost.

    Attributes:
        path: the model path as given.
        tensors: every tensor of every weight file of the model.
        hashed_bytes: tensor bytes read and hashed by this scan (0 when every file's manifest
            was cached).
        cached_files: files whose keys came from the manifest cache.
        seconds: wall time of the scan.
    """

    path: str
    tensors: list[ScannedTensor] = field(default_factory=list)
    hashed_bytes: int = 0
    cached_files: int = 0
    seconds: float = 0.0


def model_files(path: str | os.PathLike) -> list[Path]:
    """The weight files that make up the model at ``path``.

    ``path`` is a single weight file, or a folder: an HF model folder (one file, or shards
    listed by a ``*.index.json``), or a Diffusers-style pipeline whose components sit in
    subfolders.  In each folder safetensors win over ``.bin``/``.pt`` (as in transformers),
    and those over ``.gguf``; files an index names are taken alone when an index exists.
    Subfolders are read only for a pipeline (``model_index.json``) or a folder without
    weights of its own: a model folder's own weights are what a loader reads, and its
    subfolders hold other models (a Trainer's ``checkpoint-500/``, Meta's ``original/``).
    A Trainer's other files (``training_args.bin``, ``optimizer.pt``, ``rng_state.pth``...)
    are never weights, nor is a Diffusers variant beside its file (``NAME.fp16.safetensors``
    beside ``NAME.safetensors``); a file two paths reach is listed once.

    Raises:
        CheckpointError: the path does not exist, cannot be read, or holds no weights.
    """
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise CheckpointError(path, "no such file or directory") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        if path.suffix.lower() not in WEIGHT_SUFFIXES:
            raise CheckpointError(
                path,
                f"unknown weight format {path.suffix or '(no suffix)'!r}; "
                f"expected one of {', '.join(WEIGHT_SUFFIXES)}, or a model folder",
            )
        return [path]
    files = _weights_in_folder(path)
    if files and not (path / "model_index.json").exists():
        return files
    try:
        folders = sorted(p for p in path.rglob("*") if p.is_dir())
    except OSError as e:
        raise CheckpointError(path, f"cannot list folder: {e.strerror or e}") from None
    for folder in folders:
        files += _weights_in_folder(folder)
    if not files:
        raise CheckpointError(
            path, f"holds no weight files ({', '.join(WEIGHT_SUFFIXES)}) in it or its subfolders"
        )
    return _each_file_once(files)


def _each_file_once(files: list[Path]) -> list[Path]:
    """``files`` without a second path to a file listed already (a symlinked subfolder, a hard
    link): counted twice, one model's bytes would be "shared" with themselves."""
    seen, once = set(), []
    for f in files:
        try:
            st = f.stat()
            ident = (st.st_dev, st.st_ino)
        except OSError:  # the reader says what is wrong with it
            ident = f
        if ident not in seen:
            seen.add(ident)
            once.append(f)
    return once


def _weights_in_folder(folder: Path) -> list[Path]:
    try:
        names = sorted(p for p in folder.iterdir() if p.is_file() and not _trainer_state(p.name))
    except OSError as e:
        raise CheckpointError(folder, f"cannot list folder: {e.strerror or e}") from None
    for group in ((".safetensors",), (".bin", ".pt", ".pth"), (".gguf",)):
        chosen = [p for p in names if p.suffix.lower() in group]
        if not chosen:
            continue
        indexed = _indexed_files(folder, names, group)
        if indexed is not None:
            return indexed
        if group == (".gguf",) and len(chosen) > 1 and not _one_split_gguf(chosen):
            raise CheckpointError(folder, f"holds {len(chosen)} GGUF files that are not one split model "
                                          f"({', '.join(p.name for p in chosen[:3])}{', ...' if len(chosen) > 3 else ''}), "
                                          "e.g. several quantisations; scan one .gguf file at a time")
        return _without_variants(chosen)
    return []


_GGUF_SPLIT = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf", re.IGNORECASE)  # llama.cpp's gguf-split names


def _one_split_gguf(files: list[Path]) -> bool:
    """Whether ``files`` are the parts of one GGUF split by llama.cpp (``NAME-00001-of-00003.gguf``)."""
    parts = [_GGUF_SPLIT.fullmatch(f.name) for f in files]
    return all(parts) and len({(m[1], m[3]) for m in parts}) == 1


def _without_variants(files: list[Path]) -> list[Path]:
    """``files`` less each variant of a file that is there itself: Diffusers saves a
    component's variants beside it as ``NAME.VARIANT.SUFFIX`` (``diffusion_pytorch_model.fp16
    .safetensors``, ``.non_ema``), and loads ``NAME.SUFFIX`` unless asked for a variant.  Files
    whose base is not there stay (``consolidated.00.pth`` and ``.01``: shards, not variants)."""
    names = {f.name for f in files}

    def is_variant(f: Path) -> bool:
        base, dot, _ = f.stem.rpartition(".")
        return bool(dot) and f"{base}{f.suffix}" in names

    return [f for f in files if not is_variant(f)]


def _trainer_state(name: str) -> bool:
    """Whether a file is one of the HF Trainer's own, saved beside the weights but holding none
    (its arguments, optimizer, scheduler, grad scaler and random generators)."""
    return name in _TRAINER_FILES or (name.startswith("rng_state") and name.endswith(".pth"))


_TRAINER_FILES = frozenset({"training_args.bin", "optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt"})


def _indexed_files(folder: Path, names: list[Path], group: tuple[str, ...]) -> list[Path] | None:
    for index in (p for p in names if p.name.endswith(".index.json")):
        named = index_shards(index)
        if named is None:
            continue
        shards = sorted(folder / f for f in named)
        if shards and all(p.suffix.lower() in group for p in shards):
            missing = [p.name for p in shards if not p.exists()]
            if missing:
                raise CheckpointError(index, f"names missing shards: {', '.join(missing)}")
            return shards
    return None


def scan_model(
    path: str | Path,
    cache: ManifestCache | None = None,
    threads: int | None = None,
    progress: bool | None = None,
) -> ModelScan:
    """Content keys of every tensor of the model at ``path``.

    Args:
        path: a model folder or a single weight file (see `model_files`).
        cache: manifest cache; None disables caching.
        threads: hashing threads (see `keys.content_keys`).
        progress: show a tqdm bar in bytes on stderr; None shows it on a terminal only.

    Raises:
        CheckpointError: the model or one of its files cannot be read.
    """
    from tqdm import tqdm

    cache = cache or ManifestCache(None)
    start = time.perf_counter()
    files = model_files(path)
    scan = ModelScan(str(path))
    total = sum(f.stat().st_size for f in files)
    # tqdm's disable=None means "only on a terminal"; it writes to stderr.
    disable = None if progress is None else not progress
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"scan {Path(path).name}", disable=disable, leave=False)
    with contextlib.closing(bar):
        for f in files:
            manifest, hashed = file_manifest(f, cache, threads, bar)
            scan.hashed_bytes += hashed
            scan.cached_files += hashed == 0
            scan.tensors += [ScannedTensor(str(f), e, k) for e, k in zip(manifest.entries, manifest.keys)]
    scan.seconds = time.perf_counter() - start
    return scan
