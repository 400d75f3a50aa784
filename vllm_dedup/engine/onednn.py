"""vLLM's oneDNN handlers (CPU backend): their packed weights, found, checked and shared.

On vLLM's CPU backend, ``process_weights_after_loading`` hands every unquantized linear weight
to ``ops.create_onednn_mm`` (``vllm/model_executor/layers/utils.py``,
``dispatch_cpu_unquantized_gemm``; the vocabulary head through
``vocab_parallel_embedding.py``), and W8A8 int8 weights to ``ops.create_onednn_scaled_mm``
(``model_executor/kernels/linear/scaled_mm/cpu.py``).  Each returns a ``CPUDNNLGEMMHandler``
(``vllm/_custom_ops.py``) whose ``handler_tensor.item()`` is a C++ ``MatMulPrimitiveHandler*``
or ``W8A8MatMulPrimitiveHandler*`` (vLLM ``csrc/cpu/dnnl_helper.h``).  The handler reorders
the weight into the layout oneDNN's kernel wants, into memory oneDNN allocates
(``DNNLMatMulPrimitiveHandler::prepack_weight``, ``csrc/cpu/dnnl_helper.cpp``), and vLLM drops
the torch weight.  This module finds that packed buffer, checks it, and puts a segment's
read-only mapping in its place, so that every engine runs vLLM's own kernel on one copy.

- `probe`: does this CPU and vLLM build support it (a self-test on a small handler); the
  reason when not.
- `find_packed`: a handler's packed weight (`PackedWeight`: address, bytes, `PackedLayout`),
  validated step by step; `check_packing` compares it with the plain weight.
- `install`: a segment's bytes in place of the private buffer, which oneDNN frees.
- `handlers_in`: the handlers a model's layers hold.

Note [how the packed buffer is replaced]
    oneDNN's own C function ``dnnl_memory_set_data_handle`` (``src/common/memory.cpp``) does
    it: it calls ``cpu_memory_storage_t::set_data_handle`` (``src/cpu/cpu_memory_storage.hpp``),
    which assigns ``data_ = unique_ptr(handle, release)``: the buffer oneDNN allocated is freed
    with the deleter it had (``destroy``, i.e. ``free``), and the new one gets the no-op
    ``release`` that oneDNN gives every user-provided buffer.  The matmul primitive reads the
    weights' address from ``memory_cache_`` at every ``execute`` (``matmul.execute(stream,
    memory_cache_)``), so the kernel reads the segment from the next call on.  Nothing of
    oneDNN's is written by us; the function does not zero-pad (its body calls only the
    storage's virtual get/set and verbose logging in oneDNN 3.13, bundled with vLLM 0.32).
    The other ways, and why not, are in docs/architecture.md ("Packed linear weights on the
    CPU").

Note [symbols from the library's own symbol table]
    vLLM links oneDNN statically into ``vllm/_C*.abi3.so`` with hidden visibility: the C API is
    not exported, but the wheel keeps its ELF ``.symtab``.  `_Library` reads the addresses of
    ``dnnl_memory_*`` functions and of three vtables (``MatMulPrimitiveHandler``,
    ``W8A8MatMulPrimitiveHandler``, ``dnnl_memory``) from it and relocates them by the load
    address of an exported symbol (``release_dnnl_matmul_handler``).  A stripped build has no
    ``.symtab``: `probe` says so and the loader keeps vLLM's private packed copies.  The same
    file's GNU build id (``.note.gnu.build-id``) names the code in a packed weight's identity;
    a build without one declines the same way.

Note [reading another library's objects]
    The only private layout read is vLLM's handler (``DNNLMatMulPrimitiveHandler``: vptr, N, N
    stride, K, K stride, b/c types, ``memory_cache_`` (a libstdc++ ``unordered_map<int,
    dnnl::memory>``), ``runtime_memory_ptrs_`` (a vector of 8 pairs)) and the map's nodes.
    Every word is read through ``/proc/self/mem`` (a bad address is an error, not a crash) and
    checked before use: vtables by address, N and K against the Python handler, the map's
    bucket and node counts, exactly one ``DNNL_ARG_WEIGHTS`` entry, every ``dnnl_memory`` by its
    vtable, ``runtime_memory_ptrs_[0..1]`` against the descriptors oneDNN reports for the
    source and destination memories, and the weights' descriptor (2-D, ``{K, N}``, the
    handler's type, blocked, dense) through oneDNN's own queries.  Anything unexpected raises
    `PackedWeightError` before anything is written.

Note [lifetimes]
    After `install` the handler's storage does not own the segment's mapping (``release`` is a
    no-op), so the mapping must outlive the C++ handler: `install` keeps the mapping's tensor
    on the Python ``CPUDNNLGEMMHandler``, whose ``__del__`` deletes the C++ handler before the
    instance's attributes (and so the mapping) go.  Destroying a handler is therefore safe and
    leaks nothing.  W8A8 handlers also keep a raw pointer to the layer's ``weight_scale``
    tensor (``W8A8MatMulPrimitiveHandler::Args::b_scales_ptr``, wrapped as a user-memory
    ``dnnl::memory`` under ``DNNL_ARG_ATTR_SCALES | DNNL_ARG_WEIGHTS``): once the handler exists,
    that tensor's storage must never be swapped or freed (sharing it would leave the handler
    reading freed memory).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import struct
from dataclasses import dataclass, field

import xxhash

from ..errors import PackedWeightError
from ..log import init_logger

__all__ = ["PackedLayout", "PackedWeight", "Support", "check_packing", "find_packed", "handlers_in",
           "holds_handler", "install", "module_handlers", "pinned_tensors", "probe", "vllm_packs"]

logger = init_logger(__name__)

# oneDNN's C API constants (include/oneapi/dnnl/dnnl_common_types.h, dnnl_types.h; stable in v3).
_ARG_SRC, _ARG_WEIGHTS, _ARG_DST = 1, 33, 17
_SUCCESS = 0
_BLOCKED = 2                        # dnnl_format_kind_t: dnnl_blocked
_QUERY_STRIDES = 14                 # dnnl_query_t: dnnl_query_strides
_QUERY_NDIMS, _QUERY_DIMS, _QUERY_DATA_TYPE, _QUERY_SUBMEMORY_OFFSET = 256, 257, 258, 259
_QUERY_PADDED_DIMS, _QUERY_PADDED_OFFSETS, _QUERY_FORMAT_KIND = 260, 261, 262
_QUERY_INNER_NBLKS, _QUERY_INNER_BLKS, _QUERY_INNER_IDXS = 263, 264, 265
_MAX_NDIMS = 12                     # DNNL_MAX_NDIMS
_DATA_TYPES = {1: ("float16", 2), 2: ("bfloat16", 2), 3: ("float32", 4), 4: ("int32", 4), 5: ("int8", 1),
               6: ("uint8", 1)}     # dnnl_data_type_t -> (torch dtype name, bytes)
_ALIGNMENT = 64                     # oneDNN allocates with the cache line size (cpu_memory_storage.hpp)

# vLLM's handler (csrc/cpu/dnnl_helper.h, DNNLMatMulPrimitiveHandler) as laid out by g++ on
# x86-64 with libstdc++: byte offsets of the fields read (Note [reading another library's objects]).
_H_N, _H_N_STRIDE, _H_K, _H_K_STRIDE, _H_TYPES = 8, 16, 24, 32, 40
_H_MAP = 48                         # std::unordered_map<int, dnnl::memory>: 56 bytes
_H_RUNTIME_PTRS = 104               # std::vector<std::pair<memory_storage_t*, dnnl_memory_desc*>>
_RUNTIME_PTRS = 8                   # runtime_memory_ptrs_(8) in the constructor (dnnl_helper.cpp)
_MAX_MAP_ENTRIES = 16

_SYMBOLS = {
    "anchor": "_Z27release_dnnl_matmul_handlerl",  # exported (dynsym): relocates the others
    "get_data_handle": "dnnl_memory_get_data_handle",
    "set_data_handle": "dnnl_memory_set_data_handle",
    "get_memory_desc": "dnnl_memory_get_memory_desc",
    "desc_query": "dnnl_memory_desc_query",
    "desc_get_size": "dnnl_memory_desc_get_size",
    "desc_get_blob": "dnnl_memory_desc_get_blob",
    "version": "dnnl_version",
    "effective_isa": "dnnl_get_effective_cpu_isa",
    "vtable_matmul": "_ZTV22MatMulPrimitiveHandler",
    "vtable_w8a8": "_ZTV26W8A8MatMulPrimitiveHandler",
    "vtable_memory": "_ZTV11dnnl_memory",
}
_VTABLE_ADDRESS_POINT = 16          # Itanium C++ ABI: vptr = vtable + offset-to-top + RTTI pointer


@dataclass(frozen=True)
class PackedLayout:
    """How a packed weight's bytes are laid out, and what made them: the packing identity.

    Two packed buffers with equal bytes and equal ``identity`` are interchangeable in a handler
    of this vLLM build on this machine.  ``dims`` are oneDNN's ``{K, N}`` (vLLM passes the
    weight transposed, ``csrc/cpu/dnnl_helper.cpp``); ``strides`` are the outer blocks' strides
    in elements; ``inner_blks``/``inner_idxs`` the inner blocks (``tag`` spells them the way
    oneDNN's format tags do, e.g. ``BA16a64b2a``); ``nbytes`` is oneDNN's
    ``dnnl_memory_desc_get_size`` (padding, and any extra such as int8 compensation, included).
    """

    kind: str                       # "matmul" (unquantized) or "w8a8"
    dtype: str                      # torch dtype name of the elements
    dims: tuple[int, ...]
    padded_dims: tuple[int, ...]
    strides: tuple[int, ...]
    inner_blks: tuple[int, ...]
    inner_idxs: tuple[int, ...]
    nbytes: int
    library: str                    # which vLLM extension holds the kernel: _C, _C_AVX512, _C_AVX2
    onednn: str                     # oneDNN's version and commit (dnnl_version)
    isa: int                        # dnnl_get_effective_cpu_isa
    vllm: str
    descriptor: str = ""            # XXH3-128 of oneDNN's serialized memory descriptor (dnnl_memory_desc_get_blob)
    build_id: str = ""              # the extension's GNU build id (ELF .note.gnu.build-id), hex

    @property
    def tag(self) -> str:
        """oneDNN's name for the layout, e.g. ``BA16a64b2a`` (outer dims by stride, blocked ones
        upper case, then the inner blocks)."""
        letters = "abcdefghijkl"
        order = sorted(range(len(self.dims)), key=lambda d: -self.strides[d])
        blocked = set(self.inner_idxs)
        outer = "".join(letters[d].upper() if d in blocked else letters[d] for d in order)
        return outer + "".join(f"{b}{letters[d]}" for b, d in zip(self.inner_blks, self.inner_idxs))

    @property
    def identity(self) -> str:
        """Everything that decides how the bytes are read, as one string: part of a packed
        buffer's content key.  The layout is oneDNN's own exact memory descriptor (its
        serialized blob, which holds every field oneDNN reads, padding and extra flags such as
        int8 compensation included), and the code that reads it is the extension's build id
        (one binary, whatever its path) on the ISA oneDNN dispatches to here."""
        return f"onednn-packed/2|{self.kind}|md={self.descriptor}|build={self.build_id}|isa={self.isa:#x}"


@dataclass(frozen=True)
class PackedWeight:
    """One handler's packed weight, as `find_packed` found and checked it.

    Attributes:
        handler: vLLM's ``CPUDNNLGEMMHandler`` (Python object).
        memory: address of the ``dnnl_memory`` holding the weights (``DNNL_ARG_WEIGHTS``).
        address: the packed bytes' address when found.
        layout: their `PackedLayout`.
    """

    handler: object
    memory: int
    address: int
    layout: PackedLayout

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def view(self) -> memoryview:
        """The packed bytes, zero-copy (a read-only view at ``address``), valid until `install`
        replaces them (this object keeps the handler alive).

        Raises:
            PackedWeightError: `install` replaced them since this was found.
        """
        if _library().data_handle(self.memory) != self.address:
            raise PackedWeightError("the handler's packed weight moved since it was found")
        return memoryview((ctypes.c_uint8 * self.nbytes).from_address(self.address)).toreadonly()

    @property
    def shared(self) -> bool:
        """Whether `install` put a segment's bytes in this handler."""
        return bool(getattr(self.handler, _HOLDS, None))


@dataclass(frozen=True)
class Support:
    """`probe`'s answer: ``supported``, else ``reason`` says why not (one line)."""

    supported: bool
    reason: str = ""
    details: dict = field(default_factory=dict)


_HOLDS = "_vllm_dedup_segments"     # attribute of the Python handler: the mappings it reads


class _Library:
    """The loaded vLLM extension's oneDNN: function pointers and vtables from its symbol table
    (Note [symbols from the library's own symbol table]), and safe reads of this process."""

    def __init__(self):
        import torch
        import vllm
        from vllm import _custom_ops as ops

        if not ops._supports_onednn:
            raise PackedWeightError("this vLLM build has no oneDNN GEMM (ops._supports_onednn is false)")
        if hasattr(torch.ops._C, "is_onednn_acl_supported") and ops.is_onednn_acl_supported():
            raise PackedWeightError("vLLM's oneDNN runs on ACL here, which re-packs weights at run time")
        self.path, self.name = _loaded_extension()
        found = _elf_symbols(self.path, _SYMBOLS.values())
        missing = [s for s in _SYMBOLS.values() if s not in found]
        if missing:
            raise PackedWeightError(f"{self.name}: no symbol table entry for {', '.join(missing)} "
                                    "(a stripped build, or another vLLM)")
        try:
            lib = ctypes.CDLL(self.path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            anchor = ctypes.cast(getattr(lib, _SYMBOLS["anchor"]), ctypes.c_void_p).value
        except (OSError, AttributeError) as e:
            raise PackedWeightError(f"{self.name}: cannot resolve {_SYMBOLS['anchor']} ({e})") from None
        base = anchor - found[_SYMBOLS["anchor"]]
        addr = {key: base + found[sym] for key, sym in _SYMBOLS.items()}
        executable = _executable_ranges(self.path)
        for key in ("get_data_handle", "set_data_handle", "get_memory_desc", "desc_query", "desc_get_size",
                    "desc_get_blob", "version", "effective_isa"):
            if not any(lo <= addr[key] < hi for lo, hi in executable):
                raise PackedWeightError(f"{self.name}: {_SYMBOLS[key]} does not resolve into its code")
        vp, i32 = ctypes.c_void_p, ctypes.c_int
        self.get_data_handle = ctypes.CFUNCTYPE(i32, vp, ctypes.POINTER(vp))(addr["get_data_handle"])
        self.set_data_handle = ctypes.CFUNCTYPE(i32, vp, vp)(addr["set_data_handle"])
        self.get_memory_desc = ctypes.CFUNCTYPE(i32, vp, ctypes.POINTER(vp))(addr["get_memory_desc"])
        self.desc_query = ctypes.CFUNCTYPE(i32, vp, i32, vp)(addr["desc_query"])
        self.desc_get_size = ctypes.CFUNCTYPE(ctypes.c_size_t, vp)(addr["desc_get_size"])
        self.desc_get_blob = ctypes.CFUNCTYPE(i32, vp, ctypes.POINTER(ctypes.c_size_t), vp)(addr["desc_get_blob"])
        self.build_id = _elf_build_id(self.path)
        version = ctypes.CFUNCTYPE(ctypes.POINTER(_Version))(addr["version"])().contents
        self.onednn = f"{version.major}.{version.minor}.{version.patch}+{(version.hash or b'').decode()[:12]}"
        self.isa = ctypes.CFUNCTYPE(i32)(addr["effective_isa"])()
        self.vtables = {addr["vtable_matmul"] + _VTABLE_ADDRESS_POINT: "matmul",
                        addr["vtable_w8a8"] + _VTABLE_ADDRESS_POINT: "w8a8"}
        self.memory_vptr = addr["vtable_memory"] + _VTABLE_ADDRESS_POINT
        self.vllm = vllm.__version__
        self._mem, self._mem_pid = -1, -1

    def _mem_fd(self) -> int:
        """This process's ``/proc/self/mem``, opened once per process.  The file names the
        process that opened it: after ``fork`` the inherited descriptor reads the parent's
        memory, so a child opens its own (checked by pid, which covers every way to fork)."""
        if self._mem_pid != os.getpid():
            if self._mem >= 0 and self._mem_pid != -1:
                with contextlib.suppress(OSError):
                    os.close(self._mem)  # the parent's, inherited: not ours to read through
            self._mem = os.open("/proc/self/mem", os.O_RDONLY | os.O_CLOEXEC)
            self._mem_pid = os.getpid()
        return self._mem

    def read(self, address: int, nbytes: int) -> bytes:
        """``nbytes`` at ``address`` of this process; an unmapped address raises."""
        try:
            data = os.pread(self._mem_fd(), nbytes, address) if address > 0 else b""
        except OSError as e:
            raise PackedWeightError(f"address {address:#x} cannot be read ({e.strerror})") from None
        if len(data) != nbytes:
            raise PackedWeightError(f"address {address:#x} cannot be read ({len(data)} of {nbytes} bytes)")
        return data

    def words(self, address: int, fmt: str) -> tuple:
        return struct.unpack("<" + fmt, self.read(address, struct.calcsize("<" + fmt)))

    def memory_desc(self, memory: int) -> int:
        md = ctypes.c_void_p()
        if self.get_memory_desc(memory, ctypes.byref(md)) != _SUCCESS or not md.value:
            raise PackedWeightError("oneDNN refused to describe a memory of the handler")
        return md.value

    def data_handle(self, memory: int) -> int:
        handle = ctypes.c_void_p()
        if self.get_data_handle(memory, ctypes.byref(handle)) != _SUCCESS:
            raise PackedWeightError("oneDNN refused to give a memory's data handle")
        return handle.value or 0

    def descriptor_blob(self, md: int) -> bytes:
        """oneDNN's serialization of the memory descriptor ``md`` (``dnnl_memory_desc_get_blob``:
        called once for the size, once to fill)."""
        size = ctypes.c_size_t(0)
        if self.desc_get_blob(None, ctypes.byref(size), md) != _SUCCESS or not 0 < size.value <= 1 << 16:
            raise PackedWeightError("oneDNN refused to serialize the packed weight's memory descriptor")
        blob = (ctypes.c_uint8 * size.value)()
        if self.desc_get_blob(blob, ctypes.byref(size), md) != _SUCCESS:
            raise PackedWeightError("oneDNN refused to serialize the packed weight's memory descriptor")
        return bytes(blob)[: size.value]

    def query_int(self, md: int, what: int) -> int:
        out = ctypes.c_int32()
        if self.desc_query(md, what, ctypes.byref(out)) != _SUCCESS:
            raise PackedWeightError(f"oneDNN refused memory descriptor query {what}")
        return out.value

    def query_s64(self, md: int, what: int) -> int:
        out = ctypes.c_int64()
        if self.desc_query(md, what, ctypes.byref(out)) != _SUCCESS:
            raise PackedWeightError(f"oneDNN refused memory descriptor query {what}")
        return out.value

    def query_dims(self, md: int, what: int, n: int) -> tuple[int, ...]:
        out = ctypes.POINTER(ctypes.c_int64)()
        if self.desc_query(md, what, ctypes.byref(out)) != _SUCCESS or not out:
            raise PackedWeightError(f"oneDNN refused memory descriptor query {what}")
        return tuple(out[i] for i in range(n))


class _Version(ctypes.Structure):  # dnnl_version_t (dnnl_common_types.h)
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


@functools.cache
def _library() -> _Library:
    return _Library()


def _loaded_extension() -> tuple[str, str]:
    """(path, name) of the vLLM extension this process loaded: vllm/_C, _C_AVX512 or _C_AVX2
    (``platforms/cpu.py``, ``import_kernels``, picks one by the CPU's ISA)."""
    paths = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) == 6 and "/vllm/_C" in parts[5] and ".abi3.so" in parts[5]:
                paths.add((parts[5].rstrip(), parts[3], int(parts[4])))
    if len(paths) != 1:
        raise PackedWeightError(f"expected one vLLM _C extension loaded, found {sorted(paths) or 'none'}")
    path, device, inode = paths.pop()
    # the symbol table is read from the file: it must be the very file mapped (not replaced since)
    info = os.stat(path) if os.path.exists(path) else None
    major, minor = (int(x, 16) for x in device.split(":"))
    if info is None or info.st_ino != inode or (os.major(info.st_dev), os.minor(info.st_dev)) != (major, minor):
        raise PackedWeightError(f"{path} on disk is not the file this process loaded (replaced since?)")
    return path, os.path.basename(path).split(".")[0]


def _executable_ranges(path: str) -> list[tuple[int, int]]:
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].rstrip() == path and "x" in parts[1]:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    return out


def _elf_build_id(path: str) -> str:
    """The GNU build id of an ELF64 little-endian file (the ``NT_GNU_BUILD_ID`` note, in
    ``.note.gnu.build-id``), hex: what names one build of a binary, wherever it lies.  (ELF
    format: the System V gABI, "Note Section".)

    Raises:
        PackedWeightError: the file has no build id (a build made without ``--build-id``).
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        shoff, = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
        for i in range(shnum):
            _, sh_type, _, _, offset, size, _, _, _, _ = struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize)
            end = offset + size
            while sh_type == 7 and offset + 12 <= end:  # SHT_NOTE: namesz, descsz, type, name, desc
                namesz, descsz, kind = struct.unpack_from("<III", m, offset)
                name_at = offset + 12
                desc_at = name_at + (namesz + 3) // 4 * 4
                if kind == 3 and m[name_at:name_at + namesz] == b"GNU\0" and desc_at + descsz <= end:
                    return m[desc_at:desc_at + descsz].hex()
                offset = desc_at + (descsz + 3) // 4 * 4
    raise PackedWeightError(f"{os.path.basename(path)} has no GNU build id, which names the code that packed a "
                            "weight: packed weights are not shared with such a build")


def _elf_symbols(path: str, names) -> dict[str, int]:
    """The values (addresses relative to the load base) of the named symbols in an ELF64
    little-endian file's ``.symtab``, for names defined exactly once; absent names are left out.
    (ELF format: the System V gABI, "Sections" and "Symbol Table".)"""
    import numpy as np

    wanted = {n.encode() for n in names}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"\x7fELF" or m[4] != 2 or m[5] != 1:
            raise PackedWeightError(f"{path} is not a 64-bit little-endian ELF file")
        shoff, = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize) for i in range(shnum)]
        sym_type = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                             ("value", "<u8"), ("size", "<u8")])
        found: dict[str, list[int]] = {}
        for sh_name, sh_type, _, _, sh_offset, sh_size, sh_link, _, _, _ in sections:
            if sh_type != 2:  # SHT_SYMTAB
                continue
            str_offset, str_size = sections[sh_link][4], sections[sh_link][5]
            strings = m[str_offset:str_offset + str_size]
            syms = np.frombuffer(m, dtype=sym_type, count=sh_size // sym_type.itemsize, offset=sh_offset)
            defined = syms[syms["shndx"] != 0]
            for name in wanted:
                offsets, at = [], strings.find(b"\0" + name + b"\0")
                while at >= 0:
                    offsets.append(at + 1)
                    at = strings.find(b"\0" + name + b"\0", at + 1)
                if strings.startswith(name + b"\0"):
                    offsets.append(0)
                for value in defined["value"][np.isin(defined["name"], offsets)]:
                    found.setdefault(name.decode(), []).append(int(value))
            del syms, defined
    return {name: values[0] for name, values in found.items() if len(set(values)) == 1}


def find_packed(handler) -> PackedWeight:
    """The packed weight of one of vLLM's ``CPUDNNLGEMMHandler`` objects, validated (Note
    [reading another library's objects]).  Reads only; writes nothing.

    Raises:
        PackedWeightError: this build is not supported (`probe`), or a check failed: the
            message names it.
    """
    lib = _library()
    tensor = getattr(handler, "handler_tensor", None)
    if tensor is None or getattr(handler, "n", -1) <= 0 or getattr(handler, "k", -1) <= 0:
        raise PackedWeightError("not a live vLLM oneDNN handler")
    h = int(tensor.item())
    vptr, = lib.words(h, "Q")
    kind = lib.vtables.get(vptr)
    if kind is None:
        raise PackedWeightError(f"the object at {h:#x} is neither a MatMulPrimitiveHandler nor a "
                                "W8A8MatMulPrimitiveHandler of this library")
    n, n_stride, k, k_stride, b_type, c_type = lib.words(h + _H_N, "qqqqii")
    if (n, k) != (handler.n, handler.k):
        raise PackedWeightError(f"the handler says N={n}, K={k}; vLLM's Python side {handler.n}, {handler.k}")
    if b_type not in _DATA_TYPES or c_type not in _DATA_TYPES:
        raise PackedWeightError(f"unexpected data types {b_type}, {c_type} in the handler")
    entries = _map_entries(lib, h + _H_MAP)
    if list(entries).count(_ARG_WEIGHTS) != 1 or _ARG_SRC not in entries or _ARG_DST not in entries:
        raise PackedWeightError(f"the handler's memory map has keys {sorted(entries)}, expected one weights "
                                "entry and the source and destination")
    for key, memory in entries.items():
        if lib.words(memory, "Q")[0] != lib.memory_vptr:
            raise PackedWeightError(f"map entry {key} is not a dnnl_memory")
    begin, end, _cap = lib.words(h + _H_RUNTIME_PTRS, "QQQ")
    if end - begin != _RUNTIME_PTRS * 16:
        raise PackedWeightError(f"the handler's runtime pointers are {(end - begin) // 16}, not {_RUNTIME_PTRS}")
    _, src_md, _, dst_md = lib.words(begin, "QQQQ")
    if (src_md, dst_md) != (lib.memory_desc(entries[_ARG_SRC]), lib.memory_desc(entries[_ARG_DST])):
        raise PackedWeightError("the handler's runtime pointers do not match its source and destination memories")
    memory = entries[_ARG_WEIGHTS]
    layout = _layout(lib, lib.memory_desc(memory), kind, b_type, k, n)
    address = lib.data_handle(memory)
    if not address or address % _ALIGNMENT:
        raise PackedWeightError(f"the packed weight's address {address:#x} is not {_ALIGNMENT}-byte aligned")
    lib.read(address, 1)
    lib.read(address + layout.nbytes - 1, 1)
    return PackedWeight(handler, memory, address, layout)


def _map_entries(lib: _Library, table: int) -> dict[int, int]:
    """key -> dnnl_memory* of a libstdc++ ``unordered_map<int, dnnl::memory>`` at ``table``:
    ``_M_buckets, _M_bucket_count, _M_before_begin._M_nxt, _M_element_count, _M_rehash_policy
    (16 bytes), _M_single_bucket``; nodes ``{next, int key, dnnl::memory (a shared_ptr, raw
    pointer first)}`` (``dnnl.hpp``: ``handle<T>`` holds a ``std::shared_ptr``)."""
    buckets, bucket_count, node, count = lib.words(table, "QQQQ")
    if not 1 <= count <= _MAX_MAP_ENTRIES or not 1 <= bucket_count <= 1 << 16:
        raise PackedWeightError(f"the handler's memory map has {count} entries in {bucket_count} buckets")
    if bucket_count == 1 and buckets != table + 48:
        raise PackedWeightError("the handler's memory map is not laid out as libstdc++'s")
    out: dict[int, int] = {}
    for _ in range(count):
        if not node:
            break
        node, key, _pad, memory, _control = lib.words(node, "QiiQQ")
        if key in out or not memory:
            raise PackedWeightError(f"the handler's memory map repeats key {key} or holds an empty memory")
        out[key] = memory
    if len(out) != count or node:
        raise PackedWeightError(f"the handler's memory map lists {len(out)} nodes, not {count}")
    return out


def _layout(lib: _Library, md: int, kind: str, b_type: int, k: int, n: int) -> PackedLayout:
    """The weights' descriptor, checked: 2-D ``{K, N}`` of the handler's type, blocked, no
    offsets, and dense (its size is what its strides and blocks span)."""
    ndims = lib.query_int(md, _QUERY_NDIMS)
    if ndims != 2:
        raise PackedWeightError(f"the packed weight has {ndims} dimensions, not 2")
    dims = lib.query_dims(md, _QUERY_DIMS, 2)
    dtype = lib.query_int(md, _QUERY_DATA_TYPE)
    if dims != (k, n) or dtype != b_type:
        raise PackedWeightError(f"the packed weight is {dims} of type {dtype}, expected {(k, n)} of {b_type}")
    if lib.query_int(md, _QUERY_FORMAT_KIND) != _BLOCKED:
        raise PackedWeightError("the packed weight's format is not a blocked one")
    if lib.query_s64(md, _QUERY_SUBMEMORY_OFFSET) or any(lib.query_dims(md, _QUERY_PADDED_OFFSETS, 2)):
        raise PackedWeightError("the packed weight has offsets")
    padded = lib.query_dims(md, _QUERY_PADDED_DIMS, 2)
    strides = lib.query_dims(md, _QUERY_STRIDES, 2)
    nblks = lib.query_int(md, _QUERY_INNER_NBLKS)
    if not 0 <= nblks <= _MAX_NDIMS:
        raise PackedWeightError(f"the packed weight has {nblks} inner blocks")
    blks = lib.query_dims(md, _QUERY_INNER_BLKS, nblks)
    idxs = lib.query_dims(md, _QUERY_INNER_IDXS, nblks)
    name, size = _DATA_TYPES[dtype]
    nbytes = lib.desc_get_size(md)
    layout = PackedLayout(kind, name, dims, padded, strides, blks, idxs, nbytes, lib.name, lib.onednn,
                          lib.isa, lib.vllm, xxhash.xxh3_128_hexdigest(lib.descriptor_blob(md)), lib.build_id)
    per_dim = [_product(b for b, d in zip(blks, idxs) if d == dim) for dim in range(2)]
    if any(i not in (0, 1) for i in idxs) or any(p % b or p < d for p, b, d in zip(padded, per_dim, dims)):
        raise PackedWeightError(f"the packed weight's blocks {layout.tag} do not divide its padded dims {padded}")
    span = _product(blks)
    for d in sorted(range(2), key=lambda d: strides[d]):  # dense: each outer stride spans what lies inside
        if padded[d] == per_dim[d]:
            continue  # one outer block: its stride is never used
        if strides[d] != span:
            raise PackedWeightError(f"the packed weight ({layout.tag}, strides {strides}) is not dense")
        span *= padded[d] // per_dim[d]
    if nbytes < span * size:
        raise PackedWeightError(f"the packed weight's size {nbytes} is below its {span * size} elements' bytes")
    return layout


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def packed_offsets(layout: PackedLayout, k_index, n_index):
    """Element offsets in the packed buffer of the logical elements ``(k_index[i], n_index[i])``
    (int64 tensors) of the ``{K, N}`` weight: outer block indices times ``strides``, plus the
    position within the inner blocks (oneDNN's blocked layout: ``doc/advanced/understanding_memory_formats``)."""
    index = (k_index, n_index)
    per_dim = [_product(b for b, d in zip(layout.inner_blks, layout.inner_idxs) if d == dim) for dim in range(2)]
    offset = sum((index[d] // per_dim[d]) * layout.strides[d] for d in range(2))
    inner = 0
    for i, (blk, dim) in enumerate(zip(layout.inner_blks, layout.inner_idxs)):
        # the digit of this block: the dim's remainder over the blocks of the same dim inside it
        below = _product(b for b, d in zip(layout.inner_blks[i + 1:], layout.inner_idxs[i + 1:]) if d == dim)
        inner = inner * blk + (index[dim] % per_dim[dim]) // below % blk
    return offset + inner


def check_packing(packed: PackedWeight, weight, sample: int | None = 4096, seed: int = 0) -> None:
    """Check that the packed bytes are ``weight`` in ``packed.layout``: ``weight`` is the
    ``{K, N}`` tensor vLLM gave the handler (``layer.weight.t()``).  ``sample``: that many
    random elements (and the four corners); ``None``: every element, and every padding
    element is zero.  Bit-exact (the bytes are compared, not the values).

    Raises:
        PackedWeightError: a mismatch (the first one is named), or the weight's shape or type
            is not the layout's.
    """
    import torch

    layout = packed.layout
    if tuple(weight.shape) != layout.dims or str(weight.dtype).removeprefix("torch.") != layout.dtype:
        raise PackedWeightError(f"a {tuple(weight.shape)} {weight.dtype} weight is not a {layout.dims} {layout.dtype} packing")
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[weight.element_size()]
    plain = weight.detach().view(bits)
    raw = torch.frombuffer(bytearray(packed.view()), dtype=torch.uint8)[: _product(layout.padded_dims) * weight.element_size()]
    stored = raw.view(bits)
    k, n = layout.dims
    if sample is None:
        seen = torch.zeros(stored.numel(), dtype=torch.bool)
        for start in range(0, k, max(1, (1 << 22) // n)):
            stop = min(k, start + max(1, (1 << 22) // n))
            ks = torch.arange(start, stop).repeat_interleave(n)
            ns = torch.arange(n).repeat(stop - start)
            _compare(stored, plain, layout, ks, ns)
            seen[packed_offsets(layout, ks, ns)] = True
        if bool((stored[~seen] != 0).any()):
            raise PackedWeightError("the packed weight's padding is not zero")
        return
    generator = torch.Generator().manual_seed(seed)
    ks = torch.cat([torch.tensor([0, 0, k - 1, k - 1]), torch.randint(0, k, (sample,), generator=generator)])
    ns = torch.cat([torch.tensor([0, n - 1, 0, n - 1]), torch.randint(0, n, (sample,), generator=generator)])
    _compare(stored, plain, layout, ks, ns)


def _compare(stored, plain, layout, ks, ns) -> None:
    got = stored[packed_offsets(layout, ks, ns)]
    want = plain[ks, ns]
    bad = (got != want).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise PackedWeightError(f"packed element ({int(ks[i])}, {int(ns[i])}) of {layout.tag} holds other bits "
                                "than the weight")


def install(packed: PackedWeight, data, compare: bool = True) -> int:
    """Make ``packed``'s handler read ``data`` (a CPU uint8 tensor of ``packed.nbytes`` bytes
    over a sealed segment's read-only mapping, ``HostSegment.tensor``) instead of its private
    buffer, which oneDNN frees (Note [how the packed buffer is replaced]).  ``data`` is kept on
    the handler for as long as it lives (Note [lifetimes]).

    Args:
        packed: from `find_packed`, for a handler nothing runs on meanwhile.
        data: the segment's bytes; 64-byte aligned.
        compare: first check that ``data`` holds exactly the handler's current bytes (never a
            wrong weight).  ``False`` only for a handler built from placeholder bytes (e.g. zero
            pages) whose segment was matched by content key.

    Returns:
        The bytes of private memory given back (0 if the handler already read a segment).

    Raises:
        PackedWeightError: ``data`` does not fit (size, alignment, device), differs from the
            packed bytes, or oneDNN refused; the handler is unchanged.
    """
    import torch

    lib = _library()
    if (not isinstance(data, torch.Tensor) or data.device.type != "cpu" or data.dtype != torch.uint8
            or not data.is_contiguous() or data.numel() != packed.nbytes):
        raise PackedWeightError(f"the replacement must be a contiguous CPU uint8 tensor of {packed.nbytes} bytes")
    address = data.data_ptr()
    if address % _ALIGNMENT:
        raise PackedWeightError(f"the replacement at {address:#x} is not {_ALIGNMENT}-byte aligned")
    current = lib.data_handle(packed.memory)
    if current != packed.address:
        raise PackedWeightError("the handler's packed weight moved since it was found")
    if compare and _memcmp(current, address, packed.nbytes) != 0:
        raise PackedWeightError("the replacement's bytes differ from the handler's packed weight")
    was_private = not packed.shared
    if lib.set_data_handle(packed.memory, address) != _SUCCESS or lib.data_handle(packed.memory) != address:
        raise PackedWeightError("oneDNN refused the new data handle")
    # The handler reads ``data`` alone from now on: a segment it read before (one this engine
    # staged, `staging.py`) is let go of here, and freed with its last mapping.
    setattr(packed.handler, _HOLDS, [data])
    return packed.nbytes if was_private else 0


@functools.cache
def _libc():
    libc = ctypes.CDLL(None)
    libc.memcmp.restype = ctypes.c_int
    libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _memcmp(a: int, b: int, nbytes: int) -> int:
    return _libc().memcmp(a, b, nbytes)


def handlers_in(model) -> list[tuple[str, object]]:
    """Every vLLM ``CPUDNNLGEMMHandler`` a model's modules hold, once each, with the name of
    the first module that holds it: in a layer's ``cpu_linear`` closure (unquantized linears
    and the vocabulary head, ``layers/utils.py``) or as ``dnnl_handler`` of an object the layer
    holds (W8A8 kernels, ``kernels/linear/scaled_mm/cpu.py``)."""
    from vllm._custom_ops import CPUDNNLGEMMHandler

    out, seen = [], set()
    for name, module in model.named_modules():
        for handler in _handlers_of(vars(module), CPUDNNLGEMMHandler, 0):
            if id(handler) not in seen:
                seen.add(id(handler))
                out.append((name, handler))
    return out


def module_handlers(module) -> list:
    """The vLLM ``CPUDNNLGEMMHandler`` objects ``module`` itself (not its children) holds, once each."""
    from vllm._custom_ops import CPUDNNLGEMMHandler

    return list({id(h): h for h in _handlers_of(vars(module), CPUDNNLGEMMHandler, 0)}.values())


def pinned_tensors(model) -> list:
    """The tensors whose storage must stay where it is (Note [lifetimes]): every parameter and
    buffer of a module holding a oneDNN handler that is not an unquantized matmul's (a W8A8
    handler keeps a raw pointer to the layer's ``weight_scale``).  Small tensors: the scales,
    zero points and biases of such layers.  Empty where vLLM has no oneDNN handlers, or was
    never imported (a plain ``nn.Module`` shared without vLLM: nothing is imported for it)."""
    import sys

    if "vllm._custom_ops" not in sys.modules:  # where CPUDNNLGEMMHandler lives: no handler exists
        return []
    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    except ImportError:
        return []
    out = []
    try:
        for module in model.modules():
            unquantized = isinstance(getattr(module, "quant_method", None),
                                     (UnquantizedLinearMethod, UnquantizedEmbeddingMethod))
            if not unquantized and module_handlers(module):
                out += [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]
    except ImportError:  # a vLLM build without its CPU extension: no handlers
        return []
    return out


def holds_handler(module) -> bool:
    """Whether ``module`` itself (not its children) holds a vLLM ``CPUDNNLGEMMHandler``."""
    return bool(module_handlers(module))


def _handlers_of(attributes: dict, cls, depth: int):
    from torch import nn

    for key, value in attributes.items():
        if key in ("_parameters", "_buffers", "_modules") or isinstance(value, nn.Module):
            continue
        if isinstance(value, cls):
            yield value
        elif callable(value) and getattr(value, "__closure__", None):
            for cell in value.__closure__:
                try:
                    if isinstance(cell.cell_contents, cls):
                        yield cell.cell_contents
                except ValueError:  # an empty cell
                    pass
        elif depth < 2 and hasattr(value, "__dict__") and type(value).__module__.startswith("vllm"):
            yield from _handlers_of(vars(value), cls, depth + 1)


@functools.cache
def vllm_packs(dtype_name: str = "bfloat16") -> bool:
    """Whether vLLM's CPU backend packs linear weights of this dtype for oneDNN here: its
    ``create_onednn_mm`` makes a handler (``dispatch_cpu_unquantized_gemm`` falls back to
    ``F.linear`` when it raises, e.g. for bfloat16 on AVX2).  Cached."""
    try:
        import torch
        from vllm import _custom_ops as ops

        if not ops._supports_onednn:
            return False
        ops.create_onednn_mm(torch.zeros(64, 32, dtype=getattr(torch, dtype_name)).t(), 32)
        return True
    except Exception:  # vLLM's own test: any failure means F.linear
        return False


@functools.cache
def probe(dtype_name: str = "bfloat16") -> Support:
    """Whether packed weights can be shared here, for linear layers of this dtype: this
    process's vLLM extension is found with its symbol table, and a small handler passes the
    whole cycle (find, check every element, put a sealed memfd's mapping in place, bit-identical
    ``onednn_mm`` results before and after, destroy).  Takes milliseconds; cached.  Call it
    where the loader chooses between packed sharing and ``F.linear`` (model creation).

    Returns:
        `Support`: ``supported``, or the reason why not (one line, for the log).
    """
    try:
        import torch
        from vllm import _custom_ops as ops

        from ..segments.host import HostSegment

        lib = _library()
        dtype = getattr(torch, dtype_name)
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 320, generator=generator).to(dtype)  # N=96, K=320: padded on some ISAs
        handler = ops.create_onednn_mm(weight.t(), 32)
        packed = find_packed(handler)
        check_packing(packed, weight.t(), sample=None)
        x = torch.randn(5, 320, generator=generator).to(dtype)
        before = [ops.onednn_mm(handler, x[:m], None) for m in (1, 5)]
        segment = HostSegment.create_packed([(torch.frombuffer(bytearray(packed.view()), dtype=torch.uint8), 0)],
                                            packed.nbytes)
        segment.close_fd()
        install(packed, segment.tensor(0, torch.uint8, (packed.nbytes,), (1,)))
        after = [ops.onednn_mm(handler, x[:m], None) for m in (1, 5)]
        if not all(torch.equal(a, b) for a, b in zip(before, after)):
            return Support(False, "oneDNN's results changed after the packed weight moved to a segment")
        del handler, packed
        return Support(True, details={"library": lib.name, "onednn": lib.onednn, "isa": hex(lib.isa),
                                      "vllm": lib.vllm})
    except PackedWeightError as e:
        return Support(False, str(e))
    except Exception as e:  # anything else from vLLM or oneDNN: not supported, say what
        return Support(False, f"{type(e).__name__}: {e}")
