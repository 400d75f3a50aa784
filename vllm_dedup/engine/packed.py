"""oneDNN packed weights as the sharing pass sees them (CPU backend, ``cpu_linear="packed"``).

vLLM's CPU backend packs each linear weight (and the vocabulary head's) into memory its oneDNN
handler owns, and drops the torch weight (`onednn/` finds the packed bytes).  A `PackedSlot`
is such a buffer in the role a `slots.Slot` plays for a tensor: it is keyed, compared, and
published or mapped like any tensor, and *adopted* by `onednn.install`, which points the
handler at a segment's read-only mapping and lets oneDNN free its private copy.

Note [a packed weight's content key]
    ``dtype`` is ``onednn:<digest of PackedLayout.identity>`` (oneDNN's exact memory descriptor,
    serialized; the extension's GNU build id; the ISA oneDNN dispatches to), ``shape`` the byte count, ``digest`` the XXH3-128 of the
    packed bytes.  Equal bytes would compute the same in any handler of this build; the
    layout's identity in the key keeps packings of different layouts, machines or builds apart
    in the registry all the same, so a lookup never even finds them.  The bytes are compared
    exactly before a segment is installed, as for every tensor.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import xxhash

from ..content.keys import ContentKey, content_key, content_keys
from ..content.views import tensor_bytes
from ..errors import PackedWeightError
from ..log import init_logger
from . import onednn

__all__ = ["PackedSlot", "collect_packed", "installed_handlers", "packed_dtype", "packed_key", "packed_keys"]

logger = init_logger(__name__)


def packed_dtype(layout: onednn.PackedLayout) -> str:
    """The ``dtype`` field of a packed weight's content key (Note [a packed weight's content key])."""
    return "onednn:" + xxhash.xxh3_64_hexdigest(layout.identity.encode())


@dataclass
class PackedSlot:
    """One handler's packed weight in the sharing pass.

    Attributes:
        module: the qualified name of the first module holding the handler.
        packed: the handler's packed weight (`onednn.find_packed`).
        tensor: a uint8 CPU tensor of ``packed.nbytes`` over the packed bytes, zero-copy; it
            dangles once `install` has run (oneDNN frees those bytes), so nothing reads it
            after.  A staged weight's is the staged segment's mapping, which stays valid.
        staged: the segment of this engine's that the handler already reads and that holds
            ``tensor`` (`staging.Staging`), or None while oneDNN's own buffer holds it.
    """

    module: str
    packed: onednn.PackedWeight
    tensor: object
    staged: object = None

    refs = ()  # no parameter or buffer holds it (`slots.Slot.refs`)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def install(self, shared) -> None:
        """Point the handler at ``shared`` (a segment's uint8 tensor, compared by the caller).

        Raises:
            PackedWeightError: oneDNN refused, or the handler changed since it was found.
        """
        onednn.install(self.packed, shared, compare=False)


def collect_packed(model, min_bytes: int) -> tuple[list[PackedSlot], int, int, list[str]]:
    """The packed weights of ``model``'s oneDNN handlers that can be shared.

    A handler whose packed weight cannot be found or checked (`onednn.PackedWeightError`: a
    layout not understood) keeps its private packed copy (vLLM's own speed and numerics); one
    log line says how many and why.

    Returns:
        (slots, private handlers, their bytes when known, "<module>: <why>" of each handler
        kept private for a reason other than its size): slots of at least ``min_bytes``, not
        shared yet.
    """
    import torch

    slots, private_n, private_b, declined = [], 0, 0, []
    for name, handler in onednn.handlers_in(model):
        try:
            packed = onednn.find_packed(handler)
        except PackedWeightError as e:
            private_n += 1
            declined.append(f"{name}: {e}")
            continue
        if packed.shared:
            continue
        if packed.nbytes < min_bytes:
            private_n += 1
            private_b += packed.nbytes
            continue
        raw = (ctypes.c_uint8 * packed.nbytes).from_address(packed.address)
        slots.append(PackedSlot(name, packed, torch.frombuffer(raw, dtype=torch.uint8)))
    if declined:
        logger.warning("%d oneDNN packed weight(s) stay private: their layout is not understood (first: %s)",
                       len(declined), declined[0])
    return slots, private_n, private_b, declined


def installed_handlers(model, placement: dict) -> list[onednn.PackedWeight]:
    """The packed weights of ``model``'s handlers that ``placement`` (``id`` -> `Placement`)
    names: those a recipe's replay installed from segments."""
    out = []
    for _, handler in onednn.handlers_in(model):
        if id(handler) in placement:
            try:
                out.append(onednn.find_packed(handler))
            except PackedWeightError:  # it was read moments ago; count what can be counted
                continue
    return out


def packed_key(packed: onednn.PackedWeight, data) -> ContentKey:
    """The content key of a packed weight (Note [a packed weight's content key]): ``data``, its
    ``packed.nbytes`` bytes (any buffer), hashed in place."""
    return content_key(data, packed_dtype(packed.layout), (packed.nbytes,), (1,))


def packed_keys(slots: list[PackedSlot]) -> list[ContentKey]:
    """Content keys of packed weights (`packed_key`), hashed in parallel."""
    return content_keys([lambda s=s: packed_key(s.packed, tensor_bytes(s.tensor)) for s in slots])
