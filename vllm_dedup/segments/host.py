"""Host segments: ``memfd_create`` + ``mmap``, read-only for everyone once sealed.

The creator copies the tensor's bytes into a fresh memfd and then seals it
(``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``).  After that the kernel refuses
any writable shared mapping and any ``write`` to it, in every process, the creator's included:
a stray in-place write into a shared weight faults instead of silently changing another
engine's model.  All processes map it ``PROT_READ``, ``MAP_SHARED``, so its pages exist once
and are counted once across processes (PSS splits them; ENV-NOTES.md).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings

from . import Segment

__all__ = ["HostSegment"]

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL


class HostSegment(Segment):
    """A sealed memfd and one read-only mapping of it in this process."""

    def __init__(self, fd: int, nbytes: int, device: str = "cpu"):
        self._fd = fd
        self.nbytes = nbytes
        self.device = device
        # MAP_POPULATE fills the page tables now: no page faults in the first forward passes,
        # and the pages show in this process's PSS like a private copy's would.  An empty
        # tensor still needs a (1-byte) mapping: mmap of length 0 is an error.
        self._map = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)

    @classmethod
    def create(cls, data, device: str = "cpu", name: str = "vllm-dedup") -> HostSegment:
        """Copy ``data`` (a contiguous CPU torch tensor) into a new sealed memfd.

        Raises:
            OSError: memfd_create, write or sealing failed (e.g. out of memory).
        """
        from ..keys import tensor_bytes

        view = tensor_bytes(data)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, max(view.nbytes, 1))
            done = 0
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], done)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            return cls(fd, view.nbytes, device)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, nbytes: int, device: str = "cpu") -> HostSegment:
        """Map a received memfd read-only.

        Raises:
            ValueError: the descriptor is not a fully sealed memfd of at least ``nbytes``
                (a peer could otherwise change the bytes under us after the compare).
        """
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            size = os.fstat(fd).st_size
        except OSError as e:
            os.close(fd)
            raise ValueError(f"received descriptor is not a memfd ({e})") from None
        if seals & _SEALS != _SEALS or size < nbytes:
            os.close(fd)
            raise ValueError(f"received memfd is not sealed read-only or is too small ({size} < {nbytes} bytes)")
        return cls(fd, nbytes, device)

    def fileno(self) -> int:
        return self._fd

    def tensor(self, offset: int, dtype, shape, stride):
        import torch

        with warnings.catch_warnings():
            # torch warns that the buffer is read-only: that is the point.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(self._map, dtype=torch.uint8)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not a multiple of the {dtype} item size {itemsize}")
        flat = raw[: self.nbytes].view(dtype)
        return flat.as_strided(tuple(shape), tuple(stride), offset // itemsize)

    def close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close_fd()
        except Exception:
            pass
