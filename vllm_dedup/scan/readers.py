"""Reading weight tensors out of checkpoint files, zero-copy, in every format we scan.

One reader class per file format behind `WeightFile`; a dict and a decorator map a file suffix
to its reader (like vLLM's loader registry).  Each reader gives the file's tensors as (name,
dtype, shape, bytes) and a zero-copy byte view of each tensor's data, and a `header` of bytes
that change whenever the layout of the file changes (the manifest cache keys on it).

Every problem with an input raises `errors.CheckpointError`, whose message names the file and
says what is wrong and what to do.
"""

from __future__ import annotations

import os
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..content.views import dtype_name, tensor_bytes
from ..errors import CheckpointError

__all__ = ["TensorEntry", "WeightFile", "open_weight_file", "register_reader", "WEIGHT_SUFFIXES"]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor stored in a weight file.

    Attributes:
        name: the tensor's name in the file.
        dtype: torch's dtype name (``"bfloat16"``), or ``"gguf:<TYPE>"`` for GGUF blocks.
        shape: shape in elements, as the format records it (GGUF: numpy order).
        nbytes: bytes the tensor's data occupies in the file.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class WeightFile(ABC):
    """An open weight file.  Use as a context manager; views die with it."""

    format: str = ""

    def __init__(self, path: Path):
        self.path = path

    @abstractmethod
    def header(self) -> bytes:
        """Bytes that describe the file's layout (names, dtypes, shapes, offsets)."""

    @abstractmethod
    def entries(self) -> list[TensorEntry]:
        """The file's tensors, in file order."""

    @abstractmethod
    def data(self, name: str) -> memoryview:
        """Zero-copy bytes of tensor ``name`` (``TensorEntry.nbytes`` long).

        Raises:
            CheckpointError: the data lies outside the file (truncated) or cannot be read.
        """

    def close(self) -> None:
        """Release the file's mappings."""

    def __enter__(self) -> WeightFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_READERS: dict[str, type[WeightFile]] = {}


def register_reader(*suffixes: str) -> Callable[[type[WeightFile]], type[WeightFile]]:
    """Class decorator: read files ending in ``suffixes`` with this reader."""

    def wrap(cls: type[WeightFile]) -> type[WeightFile]:
        for suffix in suffixes:
            _READERS[suffix] = cls
        return cls

    return wrap


@register_reader(".safetensors")
class SafetensorsFile(WeightFile):
    """A ``.safetensors`` file, read through safetensors' own mmap (``safe_open``)."""

    format = "safetensors"

    def __init__(self, path: Path):
        super().__init__(path)
        from safetensors import SafetensorError, safe_open

        try:
            self._file = safe_open(str(path), framework="pt")
        except SafetensorError as e:
            raise CheckpointError(
                path, f"corrupt or truncated safetensors file ({e}); re-download or re-save it"
            ) from None
        self._names = list(self._file.keys())

    def header(self) -> bytes:
        with open(self.path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            return f.read(size)

    def entries(self) -> list[TensorEntry]:
        out = []
        for name in self._names:
            t = self._file.get_tensor(name)  # lazy mmap view: reads no bytes yet
            out.append(
                TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
            )
        return out

    def data(self, name: str) -> memoryview:
        return tensor_bytes(self._file.get_tensor(name))

    def close(self) -> None:
        self._file = None


@register_reader(".gguf")
class GGUFFile(WeightFile):
    """A GGUF file, read with the ``gguf`` package.  Quantized blocks count as raw bytes."""

    format = "gguf"

    def __init__(self, path: Path):
        super().__init__(path)
        import gguf

        try:
            self._reader = gguf.GGUFReader(str(path))
        except ValueError as e:
            if "GGMLQuantizationType" in str(e):
                raise CheckpointError(
                    path,
                    f"unknown GGML tensor type ({e}); the installed gguf package "
                    f"{_version('gguf')} does not know it: upgrade gguf, or re-export the file",
                ) from None
            raise CheckpointError(path, f"corrupt or truncated GGUF file ({e})") from None
        except Exception as e:  # the reader raises bare errors on garbage input
            raise CheckpointError(path, f"not a readable GGUF file ({type(e).__name__}: {e})")
        self._tensors = {t.name: t for t in self._reader.tensors}

    def header(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read(self._reader.data_offset)

    def entries(self) -> list[TensorEntry]:
        return [
            TensorEntry(
                t.name,
                f"gguf:{t.tensor_type.name}",
                tuple(int(d) for d in reversed(t.shape.tolist())),
                int(t.n_bytes),
            )
            for t in self._tensors.values()
        ]

    def data(self, name: str) -> memoryview:
        t = self._tensors[name]
        view = memoryview(t.data.reshape(-1).view("uint8"))
        if view.nbytes != t.n_bytes:
            raise CheckpointError(self.path, f"tensor {name!r} runs past the end of the file")
        return view

    def close(self) -> None:
        self._tensors = {}
        self._reader = None


@register_reader(".bin", ".pt", ".pth")
class TorchFile(WeightFile):
    """PyTorch pickled weights, loaded with ``torch.load(weights_only=True)``.

    Zipfile checkpoints are mmapped; legacy (pre-1.6) ones are read into memory.  Nested
    dicts (``{"state_dict": {...}}``) are flattened with dotted names; tensors that alias one
    storage (tied weights) are listed once.
    """

    format = "torch"

    def __init__(self, path: Path):
        super().__init__(path)
        import torch

        try:
            try:
                obj = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                obj = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                path,
                f"cannot load PyTorch weights with weights_only=True ({type(e).__name__}: {e}); "
                "the file is truncated, corrupt or holds more than tensors",
            ) from None
        self._tensors: dict[str, object] = {}
        seen: set[tuple[int, int]] = set()
        for name, t in _flatten(obj):
            t = t.contiguous()
            alias = (t.data_ptr(), t.numel() * t.element_size())
            if alias in seen and alias[1] > 0:
                continue
            seen.add(alias)
            self._tensors[name] = t
        if not self._tensors:
            raise CheckpointError(path, "holds no tensors")

    def header(self) -> bytes:
        return b""

    def entries(self) -> list[TensorEntry]:
        return [
            TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
            for name, t in self._tensors.items()
        ]

    def data(self, name: str) -> memoryview:
        return tensor_bytes(self._tensors[name])

    def close(self) -> None:
        self._tensors = {}


def _flatten(obj, prefix: str = ""):
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flatten(v, f"{prefix}.{i}" if prefix else str(i))


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


WEIGHT_SUFFIXES = tuple(_READERS)


def open_weight_file(path: str | os.PathLike) -> WeightFile:
    """Open one weight file with the reader its suffix names.

    Raises:
        CheckpointError: missing, unreadable, of an unknown format, corrupt or truncated.
    """
    path = Path(path)
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise CheckpointError(
            path,
            f"unknown weight format {path.suffix or '(no suffix)'!r}; "
            f"expected one of {', '.join(WEIGHT_SUFFIXES)}",
        )
    _check_readable(path)
    return reader(path)


def _check_readable(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except FileNotFoundError:
        raise CheckpointError(path, "no such file or directory") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror or e}") from None
