"""Reading weight tensors out of checkpoint files, zero-copy, in every format we scan.

One reader class per file format behind `WeightFile`; a dict and a decorator map a file suffix
to its reader (like vLLM's loader registry).  Each reader gives the file's tensors as (name,
dtype, shape, bytes) and a zero-copy byte view of each tensor's data, and a `header` of bytes
that change whenever the layout of the file changes (the manifest cache keys on it).

Every problem with an input raises `errors.CheckpointError`, whose message names the file and
says what is wrong and what to do.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import stat
import struct
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..content.views import dtype_name, tensor_bytes
from ..errors import CheckpointError

__all__ = ["TensorEntry", "WeightFile", "index_shards", "open_weight_file", "register_reader", "WEIGHT_SUFFIXES"]


READ_CHUNK_BYTES = 1 << 20  # `WeightFile.chunks`: one buffer this large per hashing thread

# Note [reading, not mapping, to hash]
#     A file mapped and read past its end faults with SIGBUS, which kills the process: a model
#     being saved in place (``open(path, "wb")`` truncates first) while an engine or `scan`
#     hashes it.  Hashing reads safetensors and GGUF files' bytes with ``pread`` instead
#     (`WeightFile.chunks`; a pickle is still read through ``torch.load``'s mapping): a file
#     shortened meanwhile reads short, a `CheckpointError`, and one rewritten meanwhile is
#     caught by the identity check after (`manifest.file_manifest`).  The copy costs no more
#     than the page faults of mapping the bytes: the 1.2B model's 2.34 GB, page cache warm,
#     two threads, took 0.69-0.89 s read and keyed, 0.84-0.96 s mapped (four runs each).

# Note [one descriptor per weight file]
#     A safetensors file is opened once, and its header, its size, its mapping and its `chunks`
#     all go through that descriptor; its identity (`manifest.FileIdentity.of` given
#     `WeightFile.descriptor`) is that descriptor's ``fstat``.  Opening the path again for
#     each of them let a file replaced in between (a model saved by rename over the old one)
#     pair one file's header with another's bytes or identity: a replay could check the
#     identity of one version and map another.  GGUF and pickles are opened by their own
#     libraries, so their identity is the path's ``stat``, taken before and after hashing (a
#     file swapped by rename before the first look goes unseen there).  A closed file is never
#     opened again by its path: reading it then is an error.


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
        self._fd: int | None = None  # for `chunks`, opened on first use
        self._fd_lock = threading.Lock()  # `content_keys` runs `chunks` in several threads

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

    def byte_range(self, name: str) -> tuple[int, int] | None:
        """Where tensor ``name``'s bytes lie in the file as they are (first byte, one past the
        last), or None where the format does not store them so (a pickle)."""
        return None

    def descriptor(self) -> int | None:
        """The descriptor every read of this file goes through, header and tensors alike, or
        None where the format's library opens the file itself (GGUF, pickles).  Its ``fstat``
        is the identity of what was read (`manifest.FileIdentity.of`), whatever the path
        names by now (Note [one descriptor per weight file])."""
        return None

    def chunks(self, name: str, chunk_bytes: int = READ_CHUNK_BYTES) -> Iterator[memoryview]:
        """Tensor ``name``'s bytes in order, read out of the file (``pread``) into one buffer
        ``chunk_bytes`` long: each view is good until the next is asked for.  For hashing a
        file that may change meanwhile (Note [reading, not mapping, to hash]); a format whose
        `byte_range` is None (a pickle) yields `data` itself, a view of ``torch.load``'s
        mapping, which that Note's protection does not cover.  Safe to run in several threads
        over one file.

        Raises:
            CheckpointError: the file ends before the tensor does (it was shortened), or
                cannot be read.
        """
        where = self.byte_range(name)
        if where is None:
            yield self.data(name)
            return
        start, end = where
        buffer = memoryview(bytearray(min(chunk_bytes, end - start)))
        fd = self._descriptor()
        while start < end:
            want = buffer[: min(len(buffer), end - start)]
            try:
                got = os.preadv(fd, [want], start)
            except OSError as e:
                raise CheckpointError(self.path, f"cannot read tensor {name!r}: {e.strerror or e}") from None
            if got == 0:
                raise CheckpointError(self.path, f"the file ends at byte {start}, inside tensor {name!r}: it was "
                                                 "shortened while it was read; read it again once it is written")
            yield want[:got]
            start += got

    def _descriptor(self) -> int:
        """The file, opened once for `chunks` (closed by `close`)."""
        with self._fd_lock:
            if self._fd is None:
                try:
                    self._fd = open_regular(self.path)
                except OSError as e:
                    raise CheckpointError(self.path, f"cannot read: {e.strerror or e}") from None
            return self._fd

    def close(self) -> None:
        """Release the file's mappings and descriptor."""
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

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


# The safetensors format's dtype names and torch's dtypes of one element each (the format's
# spec, safetensors/src/tensor.rs `Dtype`); torch's name where this torch has the dtype.  The
# sub-byte types (F4, F6_E2M3, F6_E3M2) are left out: torch holds two F4 in one element, so a
# safetensors shape would not be a torch shape.
_SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}


def safetensors_dtype(name):
    """torch's dtype for a safetensors dtype name (``"BF16"``), or None: a name the format does
    not have, a sub-byte type, or one this torch lacks."""
    import torch

    return getattr(torch, _SAFETENSORS_DTYPES.get(name, ""), None) if isinstance(name, str) else None


@register_reader(".safetensors")
class SafetensorsFile(WeightFile):
    """A ``.safetensors`` file, per the format's documented layout: an 8-byte little-endian
    header size, a JSON header giving each tensor's ``dtype``, ``shape`` and ``data_offsets``
    (relative to the end of the header), then the data.

    Opening reads only the header (and checks it against the file's size); tensor bytes are
    zero-copy slices of one read-only mmap of the file, made on first use of `data`.  This is
    what lets a cached scan or an engine read no tensor byte at all: safetensors' own
    ``safe_open`` maps the whole file (the kernel then reads ahead megabytes) and its
    ``get_tensor`` copies each tensor.
    """

    format = "safetensors"
    MAX_HEADER = 100_000_000  # bytes; safetensors' own limit (MAX_HEADER_SIZE)
    MAX_RANK = 64  # dimensions of one tensor: far above any model's, and a shape's product stays cheap

    def __init__(self, path: Path):
        super().__init__(path)
        self._map: mmap.mmap | None = None
        self._fd = open_regular(path)  # Note [one descriptor per weight file]
        try:
            self._header = self._read_header()
            self._data_start = 8 + len(self._header)
            self._layout = self._check_layout(os.fstat(self._fd).st_size - self._data_start)
        except BaseException:
            self.close()
            raise
        self._names = list(self._layout)

    def _corrupt(self, why: str) -> CheckpointError:
        return CheckpointError(self.path, f"corrupt or truncated safetensors file ({why}); re-download or re-save it")

    def _read_header(self) -> bytes:
        fd = self._fd
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past the header
        prefix = os.pread(fd, 8, 0)
        if len(prefix) < 8:
            raise self._corrupt("shorter than its 8-byte header size")
        (size,) = struct.unpack("<Q", prefix)
        if size > self.MAX_HEADER:
            raise self._corrupt(f"header size {size} is over the {self.MAX_HEADER}-byte limit")
        header = os.pread(fd, size, 8)
        # The descriptor lives on for `data` and `chunks`: hashing a cold file wants readahead.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_NORMAL)
        if len(header) < size:
            raise self._corrupt(f"the file ends inside its {size}-byte header")
        return header

    def _check_layout(self, data_bytes: int) -> dict[str, dict]:
        """name -> {"dtype", "shape", "data_offsets"}, checked as the format requires (what
        the safetensors library refuses is refused here too): a UTF-8 JSON object without
        repeated names, NaN or infinities, names that are valid Unicode, ``__metadata__`` if
        any a map of strings to strings; each entry a known dtype, a shape of at most
        `MAX_RANK` non-negative integers and two integer offsets inside the data section whose
        distance is the shape's size; the tensors, in order of their offsets, covering the data
        section with neither gap nor overlap.  The checked values are what is kept (a string or
        a float where an integer belongs is refused, never converted)."""
        def no_constant(name: str):
            raise ValueError(f"{name} is not a number JSON allows")

        def unique(pairs):
            seen = set()
            for name, _ in pairs:
                if name in seen:
                    raise ValueError(f"a name is repeated ({name!r})")
                seen.add(name)
            return dict(pairs)

        try:  # strict UTF-8 (json.loads of bytes would also take UTF-16 and a byte-order mark)
            raw = json.loads(self._header.decode("utf-8"), object_pairs_hook=unique, parse_constant=no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise self._corrupt(f"its header is not a JSON object safetensors can read: {e}") from None
        if not isinstance(raw, dict):
            raise self._corrupt("its header is not a JSON object")
        metadata = raw.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._corrupt("its __metadata__ is not a map of strings to strings")
        layout: dict[str, dict] = {}
        for name, info in raw.items():
            try:
                name.encode("utf-8")  # a lone surrogate (an escaped \ud800) is no Unicode name
            except UnicodeEncodeError:
                raise self._corrupt(f"a tensor name is not valid Unicode ({name!r})") from None
            try:
                if not isinstance(info, dict):
                    raise TypeError("not an object")
                dtype = info["dtype"]
                torch_dtype = safetensors_dtype(dtype)
                if torch_dtype is None:  # the format's sub-byte types (F4, F6_*), or one newer than this code
                    raise CheckpointError(self.path, f"tensor {name!r} has dtype {str(dtype)[:40]!r}, which vllm-dedup "
                                          "does not read (not a whole number of bytes per element in torch, or "
                                          "unknown here): an engine loads such a file as usual, unshared")
                itemsize = torch_dtype.itemsize
                shape, offsets = info["shape"], info["data_offsets"]
                if not isinstance(shape, list) or len(shape) > self.MAX_RANK or not _naturals(shape):
                    raise ValueError(f"shape {str(shape)[:80]} is not a list of at most {self.MAX_RANK} "
                                     "non-negative integers")
                if not isinstance(offsets, list) or len(offsets) != 2 or not _naturals(offsets):
                    raise ValueError(f"data_offsets {str(offsets)[:80]} are not two non-negative integers")
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise self._corrupt(f"header entry {name!r} is malformed ({type(e).__name__}: {e})") from None
            begin, end = offsets
            numel = 1
            for dim in shape:  # in order, as safetensors does, which refuses a product past 64 bits
                numel *= dim
                if numel >= 1 << 64:  # even where a later dimension is 0
                    raise self._corrupt(f"tensor {name!r} has shape {str(shape)[:80]}, whose element count "
                                        "overflows 64 bits")
            if not begin <= end <= data_bytes or end - begin != numel * itemsize:
                raise self._corrupt(f"tensor {name!r} at bytes {begin}..{end} does not fit its shape or the "
                                    f"{data_bytes}-byte data section")
            layout[name] = {"dtype": info["dtype"], "shape": list(shape), "data_offsets": (begin, end)}
        reach, last = 0, None  # where the previous tensor ends, and which it is
        for (begin, end), name in sorted((info["data_offsets"], name) for name, info in layout.items()):
            if begin < reach:
                raise self._corrupt(f"tensors {last!r} and {name!r} overlap")
            if begin > reach:
                raise self._corrupt(f"{begin - reach} bytes before tensor {name!r} belong to no tensor")
            reach, last = end, name
        if reach != data_bytes:
            raise self._corrupt(f"the last {data_bytes - reach} bytes of the data section belong to no tensor")
        return layout

    def header(self) -> bytes:
        return self._header

    def entries(self) -> list[TensorEntry]:
        out = []
        for name in self._names:
            info = self._layout[name]
            start, end = info["data_offsets"]
            out.append(TensorEntry(name, dtype_name(safetensors_dtype(info["dtype"])), tuple(info["shape"]),
                                   end - start))
        return out

    def byte_range(self, name: str) -> tuple[int, int]:
        """Where tensor ``name``'s bytes lie in the file: (first byte, one past the last)."""
        start, end = self._layout[name]["data_offsets"]
        return self._data_start + start, self._data_start + end

    def descriptor(self) -> int:
        return self._descriptor()

    def _descriptor(self) -> int:
        """The descriptor opened with the file; never the path opened again (Note [one
        descriptor per weight file])."""
        fd = self._fd
        if fd is None:
            raise CheckpointError(self.path, "read after the file was closed; open it again")
        return fd

    def data(self, name: str) -> memoryview:
        start, end = self._layout[name]["data_offsets"]
        if self._map is None:
            try:
                self._map = mmap.mmap(self._descriptor(), 0, prot=mmap.PROT_READ)
            except (OSError, ValueError) as e:  # ValueError: an empty file now
                raise CheckpointError(self.path, f"cannot map the file: {e}") from None
        if len(self._map) < self._data_start + end:  # shortened since its header was read
            raise self._corrupt(f"tensor {name!r} ends at byte {self._data_start + end}, past the file's "
                                f"{len(self._map)} bytes now")
        return memoryview(self._map)[self._data_start + start : self._data_start + end]

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still alive: the map goes when it does
                pass
            self._map = None
        super().close()


def index_shards(index: Path) -> set[str] | None:
    """The shard file names a ``*.index.json`` lists (its ``weight_map``'s values), or None
    where it cannot be read or is not such an index: not JSON, no ``weight_map`` object, or a
    value that is not the plain name of a file beside it (a path elsewhere, ``..``).  An index
    is untrusted input like the weights: it never makes a reader open a file outside the
    model's folder."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError):
        return None
    if not isinstance(weight_map, dict):
        return None
    names = list(weight_map.values())
    if not all(isinstance(n, str) and n and n not in (".", "..") and "/" not in n and "\\" not in n
               for n in names):
        return None
    return set(names)


def _naturals(values: list) -> bool:
    """Whether every value is a non-negative JSON integer (not a bool, float or string)."""
    return all(type(v) is int and v >= 0 for v in values)


@register_reader(".gguf")
class GGUFFile(WeightFile):
    """A GGUF file, read with the ``gguf`` package.  Quantized blocks count as raw bytes."""

    format = "gguf"

    # Elements of the metadata's arrays, in all: the gguf reader builds numpy objects for each
    # (about 1.6 KB of memory per string, 0.7 KB per number), so a sparse file claiming 2**40
    # strings took gigabytes before it failed.  A tokenizer's tokens, scores, types and merges
    # are at most about 1.1 million together (Llama 3, Gemma 3).
    MAX_METADATA_ITEMS = 1 << 21
    MAX_NESTING = 8  # arrays of arrays
    MAX_METADATA_KEYS = 1 << 16  # a model's file has about fifty
    MAX_TENSORS = 1 << 20  # a mixture of experts with a tensor per expert has tens of thousands
    # Tensor types ggml no longer reads (commented out in ``enum ggml_type``, ggml/include/ggml.h):
    # no gguf package reads them either, so upgrading it cannot help.
    REMOVED_TYPES = {4: "Q4_2", 5: "Q4_3", 31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8",
                     36: "IQ4_NL_4_4", 37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8"}

    def __init__(self, path: Path):
        super().__init__(path)
        import gguf

        self._check_metadata()
        try:
            self._reader = gguf.GGUFReader(str(path))
        except ValueError as e:
            if "GGMLQuantizationType" in str(e):
                raise CheckpointError(path, self._unknown_type(e)) from None
            raise CheckpointError(path, f"corrupt or truncated GGUF file ({e})") from None
        except Exception as e:  # the reader raises bare errors on garbage input
            raise CheckpointError(path, f"not a readable GGUF file ({type(e).__name__}: {e})")
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_no_overlap()

    def _check_no_overlap(self) -> None:
        """Every tensor's bytes are its own: a writer lays them out one after another (ggml's
        ``gguf_write``), and the reader does not check.  Tensors made to overlap would be read and
        hashed once each, so a small file could claim any number of bytes.

        Raises:
            CheckpointError: two tensors' bytes overlap.
        """
        end, last = 0, None
        for begin, stop, name in sorted((*self.byte_range(n), n) for n in self._tensors):
            if begin < end:
                raise CheckpointError(self.path, f"tensors {last!r} and {name!r} overlap; the file is corrupt or crafted")
            end, last = max(end, stop), name

    @classmethod
    def _unknown_type(cls, e: ValueError) -> str:
        """What to do about a tensor type the ``gguf`` package refused (``e``: "4 is not a valid
        GGMLQuantizationType", the number as numpy prints it)."""
        number = re.search(r"(\d+)\)? is not a valid", str(e))
        removed = cls.REMOVED_TYPES.get(int(number.group(1))) if number else None
        if removed:
            return (f"tensor type {number.group(1)} ({removed}) is one ggml removed: no reader loads it; "
                    "convert the model again with a current llama.cpp")
        return (f"unknown GGML tensor type ({e}); the installed gguf package {_version('gguf')} does not know "
                "it: upgrade gguf, or re-export the file")

    def _check_metadata(self) -> None:
        """Walk the key-value section as the GGUF spec lays it out (ggml/docs/gguf.md; in the
        byte order the version field shows, as the ``gguf`` reader tells it), each count checked
        against the bytes left in the file, the elements of its arrays (nested ones too) against
        `MAX_METADATA_ITEMS` and the counts of keys and tensors against theirs, before the
        reader builds objects for each (a crafted file of a few KB on disk, sparse, made it use
        gigabytes).  What is not GGUF v2 or v3 is left to the reader to refuse.

        Raises:
            CheckpointError: a count the file cannot hold, or past a limit.
        """
        fixed = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType sizes
        STRING, ARRAY = 8, 9
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                return  # the reader says what is missing
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with data:
            (magic,) = struct.unpack_from("<4s", data, 0)
            (version,) = struct.unpack_from("<I", data, 4)
            order = ">" if version & 0xFFFF == 0 else "<"  # the reader's own test of a file of the other order
            (version,) = struct.unpack_from(order + "I", data, 4)
            if magic != b"GGUF" or version not in (2, 3):
                return
            offset, items = 24, 0
            tensor_count, kv_count = struct.unpack_from(order + "QQ", data, 8)
            if kv_count > self.MAX_METADATA_KEYS or tensor_count > self.MAX_TENSORS:
                raise CheckpointError(self.path, f"it claims {kv_count} metadata keys and {tensor_count} tensors (at "
                                                 f"most {self.MAX_METADATA_KEYS} and {self.MAX_TENSORS} are read); "
                                                 "the file is corrupt or crafted")

            def take(nbytes: int, what: str) -> int:
                nonlocal offset
                if nbytes > size - offset:
                    raise CheckpointError(self.path, f"its metadata's {what} runs past the end of the file "
                                                     f"({nbytes} bytes at byte {offset}); the file is corrupt")
                offset += nbytes
                return offset - nbytes

            def number(fmt: str, what: str) -> tuple:
                return struct.unpack_from(order + fmt, data, take(struct.calcsize(order + fmt), what))

            def value(kind: int, depth: int) -> bool:  # False: a type the reader will name and refuse
                nonlocal items
                if kind == STRING:
                    take(number("Q", "string length")[0], "string")
                elif kind in fixed:
                    take(fixed[kind], "value")
                elif kind == ARRAY and depth < self.MAX_NESTING:
                    item, count = number("IQ", "array header")
                    items += count
                    if items > self.MAX_METADATA_ITEMS:
                        raise CheckpointError(self.path, f"its metadata's arrays hold over {self.MAX_METADATA_ITEMS} "
                                                         "elements (a tokenizer's hold about a million); the file "
                                                         "is corrupt or crafted")
                    if item in fixed:
                        take(count * fixed[item], "array")
                    else:
                        for _ in range(count):
                            if not value(item, depth + 1):
                                return False
                else:
                    return False
                return True

            for _ in range(kv_count):
                take(number("Q", "key length")[0], "key")
                if not value(number("I", "value type")[0], 0):
                    return

    def header(self) -> bytes:
        with open(self.path, "rb") as f:
            return f.read(self._reader.data_offset)

    def entries(self) -> list[TensorEntry]:
        # The dtype names the byte order where it is big-endian: the same bytes are other
        # values there, so they must not get the same content key as a little-endian file's.
        order = "gguf" if self._reader.endianess == self._reader.endianess.LITTLE else "gguf-be"
        return [
            TensorEntry(
                t.name,
                f"{order}:{t.tensor_type.name}",
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

    def byte_range(self, name: str) -> tuple[int, int]:
        t = self._tensors[name]
        return int(t.data_offset), int(t.data_offset) + int(t.n_bytes)

    def close(self) -> None:
        self._tensors = {}
        self._reader = None
        super().close()


@register_reader(".bin", ".pt", ".pth")
class TorchFile(WeightFile):
    """PyTorch pickled weights, loaded with ``torch.load(weights_only=True)``.

    Zipfile checkpoints are mmapped; legacy (pre-1.6) ones are read into memory.  Nested
    dicts (``{"state_dict": {...}}``) are flattened with dotted names (`_flatten`: walked as a
    tree, with limits; two tensors that flatten to one name are refused); one view of a storage
    saved under two names (tied weights) is listed once; other views of it are tensors of their
    own.  A view that is not contiguous is copied to be read, and the copies together may not
    exceed the file's size (a crafted file of many views of one storage would need any amount).
    """

    format = "torch"
    # Bytes of the tensors listed, at most this many per byte of the file: a fused weight saved
    # beside views of its parts is twice its bytes; 1000 overlapping slices of one storage made
    # a 4 MB file 4 GB of hashing.
    MAX_BYTES_PER_FILE_BYTE = 4

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
                f"cannot load PyTorch weights ({type(e).__name__}: {_torch_load_reason(str(e))}): the file is "
                "truncated, corrupt or holds Python objects besides tensors; re-save its tensors alone "
                "(a state_dict, or safetensors)",
            ) from None
        self._tensors: dict[str, object] = {}
        seen: set[tuple] = set()
        copied, listed, budget = 0, 0, os.path.getsize(path)
        for name, t in _flatten(obj, path):
            kind = _not_plain(t)
            if kind:  # its bytes are not its values, or it has no bytes here: refused, never misread
                raise CheckpointError(path, f"tensor {name!r} is {kind}; re-save it as a plain dense tensor")
            nbytes = t.numel() * t.element_size()
            if nbytes > t.untyped_storage().nbytes():  # an expanded view: contiguous() would allocate it all
                raise CheckpointError(path, f"tensor {name!r} views {nbytes} bytes of a "
                                            f"{t.untyped_storage().nbytes()}-byte storage; re-save it contiguous")
            view = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
            if view in seen and nbytes > 0:
                continue
            seen.add(view)
            if name in self._tensors:  # {"a.b": x, "a": {"b": y}}, or {1: x, "1": y}
                raise CheckpointError(path, f"two different tensors flatten to the name {name!r}; re-save them "
                                            "as a flat state_dict with unique names")
            listed += nbytes  # each is hashed: overlapping views would make a small file any amount of work
            if listed > self.MAX_BYTES_PER_FILE_BYTE * budget:
                raise CheckpointError(path, f"its tensors add up to more than {self.MAX_BYTES_PER_FILE_BYTE} times the "
                                            f"file's {budget} bytes (at {name!r}): views of one storage overlap; "
                                            "re-save each tensor on its own (e.g. as safetensors)")
            if not t.is_contiguous():
                copied += nbytes
                if copied > budget:
                    raise CheckpointError(path, f"its views that are not contiguous add up to more than the file's "
                                                f"{budget} bytes (at {name!r}); re-save its tensors contiguous")
                t = t.contiguous()
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
        super().close()


def _not_plain(t) -> str:
    """What makes ``t`` other than a dense CPU tensor whose bytes are its values (else ""): a
    sparse layout, a device other than the CPU (meta), quantization (its scale is not in the
    bytes), or a conjugate or negative bit (the values are the bytes transformed)."""
    import torch

    if t.layout != torch.strided:
        return f"{t.layout} (not dense)"
    if t.device.type != "cpu":
        return f"on {t.device}"
    if t.is_quantized:
        return "quantized (its scale and zero point are not in its bytes)"
    if t.is_conj() or t.is_neg():
        return "a conjugate or negative view"
    return ""


def _torch_load_reason(message: str) -> str:
    """The line of ``torch.load``'s error that says what is wrong, without its advice: torch's
    weights-only refusal spans several lines, in terminal colours, and suggests loading again
    with ``weights_only=False`` or allow-listing the class it refused, both of which would run
    whatever an untrusted file's pickle names."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", message)
    lines = [line.split(". Please")[0].strip() for line in plain.splitlines()]
    advice = ("weights_only", "trust", "Alternatively", "can still be loaded")
    said = [line for line in lines if line and not any(word in line for word in advice)]
    return (said or ["no reason given"])[0].removeprefix("WeightsUnpickler error: ").rstrip(".")


MAX_NESTING = 64  # dicts and lists within each other in a .bin; a state_dict has one or two
# Containers and values a .bin's walk may visit: a pickle may point at one list from many places
# (40 levels of [x, x] in 1.9 KB are 2**40 visits); a model's and its optimizer's state are a
# few per parameter.
MAX_VISITS = 1 << 21


def _flatten(obj, path: Path):
    """``(dotted name, tensor)`` for each tensor in the dicts, lists and tuples of a loaded
    ``.bin`` (other leaves are left out), walked as a tree without recursion.  A container may
    be reached more than once (an optimizer's parameter groups share one ``betas`` tuple; every
    ``()`` is one object): its tensors are listed under each name, which the caller reads once.

    Raises:
        CheckpointError: a container within itself, nesting deeper than `MAX_NESTING`, or
            more than `MAX_VISITS` values visited (shared containers multiply the visits).
    """
    import torch

    stack = [("", obj, ())]  # (name, value, ids of the containers it lies in)
    visits = 0
    while stack:
        prefix, node, within = stack.pop()
        visits += 1
        if visits > MAX_VISITS:
            raise CheckpointError(path, f"walking its containers visits over {MAX_VISITS} values (containers "
                                        "reached from many places); re-save its tensors as a flat state_dict")
        if isinstance(node, torch.Tensor):
            yield prefix, node
            continue
        if isinstance(node, dict):
            items = [(str(k), v) for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            items = [(str(i), v) for i, v in enumerate(node)]
        else:
            continue
        if id(node) in within:
            raise CheckpointError(path, f"{prefix or 'its top level'!r} lies within itself; re-save its tensors as "
                                        "a flat state_dict")
        if len(within) >= MAX_NESTING:
            raise CheckpointError(path, f"its containers nest deeper than {MAX_NESTING} (at {prefix!r}); re-save "
                                        "its tensors as a flat state_dict")
        inner = (*within, id(node))
        # Reversed onto the stack, so tensors come out in the file's order.
        stack.extend((f"{prefix}.{key}" if prefix else key, value, inner) for key, value in reversed(items))


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


def open_regular(path: Path) -> int:
    """``path`` opened for reading (a descriptor the caller closes), if it is a regular file.
    Opened with ``O_NONBLOCK``, which changes nothing for a regular file and keeps a FIFO from
    waiting for a writer forever.

    Raises:
        CheckpointError: ``path`` is a folder, FIFO, device or socket.
        OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(path, "a folder, not a weight file" if stat.S_ISDIR(mode) else
                              "not a regular file (a FIFO, device or socket); point at the model's own weight files")
    return fd


def _check_readable(path: Path) -> None:
    """Open and read one byte (a folder or an unreadable file fails here, with a clear
    message), without the kernel reading ahead into the tensor data."""
    try:
        fd = open_regular(path)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, 1, 0)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise CheckpointError(path, "no such file or directory") from None
    except OSError as e:
        raise CheckpointError(path, f"cannot read: {e.strerror or e}") from None
