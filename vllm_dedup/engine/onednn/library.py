"""vLLM's extension as a library: its oneDNN functions and vtables, and safe reads of this process.

Note [symbols from the library's own symbol table]
    vLLM links oneDNN statically into ``vllm/_C*.abi3.so`` with hidden visibility: the C API is
    not exported, but the wheel keeps its ELF ``.symtab``.  `Library` reads the addresses of
    ``dnnl_memory_*`` functions and of three vtables (``MatMulPrimitiveHandler``,
    ``W8A8MatMulPrimitiveHandler``, ``dnnl_memory``) from it and relocates them by the load
    address of an exported symbol (``release_dnnl_matmul_handler``).  A stripped build has no
    ``.symtab``: `probe` says so and the loader keeps vLLM's private packed copies.  The same
    file's GNU build id (``.note.gnu.build-id``) names the code in a packed weight's identity;
    a build without one declines the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import struct

from ...errors import PackedWeightError
from ..proc_maps import mappings

__all__ = ["Library", "elf_build_id", "elf_symbols", "library", "memcmp"]

# oneDNN's C API constants (include/oneapi/dnnl/dnnl_common_types.h, dnnl_types.h; stable in v3).
ARG_SRC, ARG_WEIGHTS, ARG_DST = 1, 33, 17
SUCCESS = 0
BLOCKED = 2                         # dnnl_format_kind_t: dnnl_blocked
QUERY_STRIDES = 14                  # dnnl_query_t: dnnl_query_strides
QUERY_NDIMS, QUERY_DIMS, QUERY_DATA_TYPE, QUERY_SUBMEMORY_OFFSET = 256, 257, 258, 259
QUERY_PADDED_DIMS, QUERY_PADDED_OFFSETS, QUERY_FORMAT_KIND = 260, 261, 262
QUERY_INNER_NBLKS, QUERY_INNER_BLKS, QUERY_INNER_IDXS = 263, 264, 265
MAX_NDIMS = 12                      # DNNL_MAX_NDIMS
DATA_TYPES = {1: ("float16", 2), 2: ("bfloat16", 2), 3: ("float32", 4), 4: ("int32", 4), 5: ("int8", 1),
              6: ("uint8", 1)}      # dnnl_data_type_t -> (torch dtype name, bytes)
ALIGNMENT = 64                      # oneDNN allocates with the cache line size (cpu_memory_storage.hpp)

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
_USER_SPACE_END = 1 << 56  # x86-64 user addresses lie below, with 5-level paging too (os.pread: OverflowError at 2**63)
_VTABLE_ADDRESS_POINT = 16          # Itanium C++ ABI: vptr = vtable + offset-to-top + RTTI pointer


class Library:
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
        self.path, self.name = loaded_extension()
        found = elf_symbols(self.path, _SYMBOLS.values())
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
        executable = executable_ranges(self.path)
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
        self.build_id = elf_build_id(self.path)
        version = ctypes.CFUNCTYPE(ctypes.POINTER(_Version))(addr["version"])().contents
        self.onednn = f"{version.major}.{version.minor}.{version.patch}+{(version.hash or b'').decode()[:12]}"
        if version.major < 3:  # 2.x zero-pads a new data handle: it would write into a read-only segment
            raise PackedWeightError(f"{self.name}: oneDNN {self.onednn} is older than 3.0")
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
        if nbytes == 0:
            return b""
        if not 0 < address < _USER_SPACE_END:  # a word that is no pointer: a layout not understood
            raise PackedWeightError(f"address {address:#x} is not in user space")
        try:
            data = os.pread(self._mem_fd(), nbytes, address)
        except OSError as e:
            raise PackedWeightError(f"address {address:#x} cannot be read ({e.strerror})") from None
        if len(data) != nbytes:
            raise PackedWeightError(f"address {address:#x} cannot be read ({len(data)} of {nbytes} bytes)")
        return data

    def words(self, address: int, fmt: str) -> tuple:
        return struct.unpack("<" + fmt, self.read(address, struct.calcsize("<" + fmt)))

    def memory_desc(self, memory: int) -> int:
        md = ctypes.c_void_p()
        if self.get_memory_desc(memory, ctypes.byref(md)) != SUCCESS or not md.value:
            raise PackedWeightError("oneDNN refused to describe a memory of the handler")
        return md.value

    def data_handle(self, memory: int) -> int:
        handle = ctypes.c_void_p()
        if self.get_data_handle(memory, ctypes.byref(handle)) != SUCCESS:
            raise PackedWeightError("oneDNN refused to give a memory's data handle")
        return handle.value or 0

    def descriptor_blob(self, md: int) -> bytes:
        """oneDNN's serialization of the memory descriptor ``md`` (``dnnl_memory_desc_get_blob``:
        called once for the size, once to fill)."""
        size = ctypes.c_size_t(0)
        if self.desc_get_blob(None, ctypes.byref(size), md) != SUCCESS or not 0 < size.value <= 1 << 16:
            raise PackedWeightError("oneDNN refused to serialize the packed weight's memory descriptor")
        blob = (ctypes.c_uint8 * size.value)()
        if self.desc_get_blob(blob, ctypes.byref(size), md) != SUCCESS:
            raise PackedWeightError("oneDNN refused to serialize the packed weight's memory descriptor")
        return bytes(blob)[: size.value]

    def query_int(self, md: int, what: int) -> int:
        out = ctypes.c_int32()
        if self.desc_query(md, what, ctypes.byref(out)) != SUCCESS:
            raise PackedWeightError(f"oneDNN refused memory descriptor query {what}")
        return out.value

    def query_s64(self, md: int, what: int) -> int:
        out = ctypes.c_int64()
        if self.desc_query(md, what, ctypes.byref(out)) != SUCCESS:
            raise PackedWeightError(f"oneDNN refused memory descriptor query {what}")
        return out.value

    def query_dims(self, md: int, what: int, n: int) -> tuple[int, ...]:
        out = ctypes.POINTER(ctypes.c_int64)()
        if self.desc_query(md, what, ctypes.byref(out)) != SUCCESS or not out:
            raise PackedWeightError(f"oneDNN refused memory descriptor query {what}")
        return tuple(out[i] for i in range(n))


class _Version(ctypes.Structure):  # dnnl_version_t (dnnl_common_types.h)
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


@functools.cache
def library() -> Library:
    """This process's `Library`, made once (raises `PackedWeightError` where it cannot be)."""
    return Library()


def loaded_extension() -> tuple[str, str]:
    """(path, name) of the vLLM extension this process loaded: vllm/_C, _C_AVX512 or _C_AVX2
    (``platforms/cpu.py``, ``import_kernels``, picks one by the CPU's ISA)."""
    paths = {(m.path, m.device, m.inode) for m in mappings() if "/vllm/_C" in m.path and ".abi3.so" in m.path}
    if len(paths) != 1:
        raise PackedWeightError(f"expected one vLLM _C extension loaded, found {sorted(paths) or 'none'}")
    path, device, inode = paths.pop()
    # the symbol table is read from the file: it must be the very file mapped (not replaced since)
    info = os.stat(path) if os.path.exists(path) else None
    major, minor = (int(x, 16) for x in device.split(":"))
    if info is None or info.st_ino != inode or (os.major(info.st_dev), os.minor(info.st_dev)) != (major, minor):
        raise PackedWeightError(f"{path} on disk is not the file this process loaded (replaced since?)")
    return path, os.path.basename(path).split(".")[0]


def executable_ranges(path: str) -> list[tuple[int, int]]:
    return [(m.start, m.end) for m in mappings() if m.path == path and "x" in m.perms]


def elf_build_id(path: str) -> str:
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


def elf_symbols(path: str, names) -> dict[str, int]:
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
            try:
                defined = syms[syms["shndx"] != 0]  # a copy: it holds no export of the mapping
            finally:
                del syms  # else closing the mapping would raise BufferError over any error here
            for name in wanted:
                offsets, at = [], strings.find(b"\0" + name + b"\0")
                while at >= 0:
                    offsets.append(at + 1)
                    at = strings.find(b"\0" + name + b"\0", at + 1)
                if strings.startswith(name + b"\0"):
                    offsets.append(0)
                for value in defined["value"][np.isin(defined["name"], offsets)]:
                    found.setdefault(name.decode(), []).append(int(value))
    return {name: values[0] for name, values in found.items() if len(set(values)) == 1}


@functools.cache
def _libc():
    libc = ctypes.CDLL(None)
    libc.memcmp.restype = ctypes.c_int
    libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return libc


def memcmp(a: int, b: int, nbytes: int) -> int:
    """libc's ``memcmp`` of ``nbytes`` at two addresses of this process: 0 where equal."""
    return _libc().memcmp(a, b, nbytes)

