"""Offline report: how much memory would co-serving these checkpoints save?

`files.scan_model` gives each model's tensors with their content keys (through the manifest
cache).  `Report` matches the models' tensors by content key, never by name or file hash, and
counts:

- ``total_bytes``: every tensor's bytes, every model, as each engine would load them alone;
- ``unique_bytes``: the bytes of distinct content keys: what is resident when every tensor
  with the same content is stored once;
- ``saved_bytes`` = total - unique;
- per pair of models, the bytes of the distinct keys both hold: what the second engine need
  not store when the first is resident.

Tensors below ``min_bytes`` are left out of every count (the loader leaves them private).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..content.keys import ContentKey
from ..errors import CheckpointError
from .files import ModelScan, ScannedTensor

__all__ = ["Report"]


@dataclass
class Report:
    """What co-serving the scanned models would share.  See the module docstring."""

    models: list[ModelScan]
    min_bytes: int = 0
    errors: list[CheckpointError] = field(default_factory=list)

    def _counted(self, scan: ModelScan) -> list[ScannedTensor]:
        return [t for t in scan.tensors if t.entry.nbytes >= self.min_bytes]

    def _key_sets(self) -> list[dict[ContentKey, int]]:
        return [{t.key: t.entry.nbytes for t in self._counted(m)} for m in self.models]

    def model_bytes(self, scan: ModelScan) -> int:
        return sum(t.entry.nbytes for t in self._counted(scan))

    @property
    def total_bytes(self) -> int:
        return sum(self.model_bytes(m) for m in self.models)

    @property
    def unique_bytes(self) -> int:
        merged: dict[ContentKey, int] = {}
        for keys in self._key_sets():
            merged.update(keys)
        return sum(merged.values())

    @property
    def saved_bytes(self) -> int:
        return self.total_bytes - self.unique_bytes

    def pair_shared_bytes(self) -> list[list[int]]:
        """``m[i][j]``: bytes of distinct content keys held by both model i and model j."""
        sets = self._key_sets()
        n = len(sets)
        out = [[0] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                small, big = sorted((sets[i], sets[j]), key=len)
                out[i][j] = sum(b for k, b in small.items() if k in big)
        return out

    def shared_with_earlier_bytes(self) -> list[int]:
        """Per model, bytes of its distinct content keys that an earlier model holds: what
        engine i need not store when engines 0..i-1 are already resident."""
        seen: set[ContentKey] = set()
        out = []
        for keys in self._key_sets():
            out.append(sum(n for k, n in keys.items() if k in seen))
            seen |= keys.keys()
        return out

    def shared_with_others_bytes(self) -> list[int]:
        """Per model, bytes of its tensors whose content at least one other scanned model also
        holds (the rest of `model_bytes` is content only that model holds)."""
        holders: dict[ContentKey, int] = defaultdict(int)
        for keys in self._key_sets():
            for k in keys:
                holders[k] += 1
        return [sum(t.entry.nbytes for t in self._counted(m) if holders[t.key] > 1) for m in self.models]

    def largest_shared(self, n: int = 10) -> list[dict]:
        """The ``n`` largest content keys held more than once, with every place they occur."""
        places: dict[ContentKey, list[str]] = defaultdict(list)
        size: dict[ContentKey, int] = {}
        for m in self.models:
            for t in self._counted(m):
                places[t.key].append(f"{m.path}:{t.entry.name}")
                size[t.key] = t.entry.nbytes
        shared = [k for k, p in places.items() if len(p) > 1]
        shared.sort(key=lambda k: (-size[k], str(k)))
        return [
            {"key": str(k), "bytes": size[k], "dtype": k.dtype, "shape": list(k.shape), "places": places[k]}
            for k in shared[:n]
        ]

    def to_dict(self, largest: int = 10) -> dict:
        """The report as JSON-ready data (the ``--json`` output)."""
        pairs = self.pair_shared_bytes()
        return {
            "models": [
                {
                    "path": m.path,
                    "tensors": len(self._counted(m)),
                    "bytes": self.model_bytes(m),
                    "hashed_bytes": m.hashed_bytes,
                    "cached_files": m.cached_files,
                    "seconds": round(m.seconds, 4),
                }
                for m in self.models
            ],
            "pairs": [
                {"a": a.path, "b": b.path, "shared_bytes": pairs[i][j]}
                for i, a in enumerate(self.models)
                for j, b in enumerate(self.models)
                if i < j
            ],
            "total_bytes": self.total_bytes,
            "unique_bytes": self.unique_bytes,
            "saved_bytes": self.saved_bytes,
            "min_bytes": self.min_bytes,
            "largest_shared": self.largest_shared(largest),
            "errors": [{"path": e.path, "error": e.reason} for e in self.errors],
        }

