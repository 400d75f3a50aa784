"""oneDNN packed weights as the engine sees them (CPU backend, ``cpu_linear="packed"``, and
``vllm`` where it shares the packed weights vLLM still makes: `loader.DedupModelLoader.shares_packed`): in the
sharing pass, and in a recipe's replay.

vLLM's CPU backend packs each linear weight (and the vocabulary head's) into memory its oneDNN
handler owns, and drops the torch weight (`onednn/` finds the packed bytes).  A `PackedSlot`
is such a buffer in the role a `slots.Slot` plays for a tensor: it is keyed, compared, and
published or mapped like any tensor, and *adopted* by `onednn.install`, which points the
handler at a segment's read-only mapping and lets oneDNN free its private copy.  A replay
lets vLLM pack placeholders over `ZeroPages`, then puts the recipe's segment in place of each
packing (`install_replayed`).

Note [a packed weight's content key]
    ``dtype`` is ``onednn:<digest of PackedLayout.identity>`` (oneDNN's exact memory descriptor,
    serialized; the extension's GNU build id; the ISA oneDNN dispatches to), ``shape`` the byte
    count, ``digest`` the XXH3-128 of the packed bytes.  Equal bytes would compute the same in any handler of this build; the
    layout's identity in the key keeps packings of different layouts, machines or builds apart
    in the registry all the same, so a lookup never even finds them.  The bytes are compared
    exactly before a segment is installed, as for every tensor.

Note [packed weights replayed]
    vLLM's CPU backend packs an unquantized linear weight into its oneDNN handler
    (``dispatch_cpu_unquantized_gemm``) and drops it; only the handler can run the layer, and
    only vLLM's post-processing makes one.  So a replay lets it: the layer's ``weight`` is a
    view of the layer's shape whose rows all read the same row (stride 0 over the rows) of one
    anonymous private mapping, mapped read-only (every page reads as the kernel's shared zero
    page: no memory; every layer's placeholder views it, so a write would change what the next
    layer packs: it faults instead), vLLM packs those zeros into a private buffer, and the
    segment holding the first engine's packed bytes takes its place at once (`onednn.install`,
    which frees the buffer: one layer's packed copy at a time is the peak).  The packed
    layout does not depend on the source's strides: vLLM's handler asks oneDNN's matmul for
    its weights' layout (``format_tag::any``, ``csrc/cpu/dnnl_helper.cpp``) and reorders the
    source into it, and a broadcast row halves that reorder (19 ms against 35 ms for a
    2048 x 8192 bf16 weight here, the rest being the buffer's writes).  The handler's layout must be the one the
    recipe's content key names (`packed.packed_dtype`), else the recipe is declined.  The zeros
    are never compared with the segment (they differ by design): the trust is the recipe's, as
    for every tensor mapped here.  A small packed weight (a router's gate) travels inline in the
    recipe and is installed from a private copy.  A vocabulary embedding (or head) keeps its
    weight (mapped), so its handler packs the real bytes: they are compared with the recipe's
    segment and replaced by it at once when equal.  (Packing a placeholder there too, for the
    length of its own post-processing, was measured and gains nothing in an engine: 0.10 s
    for the 1.2B model's two 201 MB packings either way, their writes to new pages being
    the cost.)  When they differ (a tied head packs the
    embedding it is tied to, which a fine-tune may have loaded from a changed checkpoint), the
    copy stays for the sharing pass, which keys, compares and maps it as after a usual load.
"""

from __future__ import annotations

import ctypes
import mmap
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import xxhash

from ..content.keys import ContentKey, content_key, content_keys
from ..content.views import tensor_bytes
from ..errors import PackedWeightError
from ..log import init_logger
from . import onednn

__all__ = ["PackedCensus", "PackedSlot", "ZeroPages", "collect_packed", "install_replayed", "keeps_weight",
           "packed_and_dropped", "packed_dtype", "packed_key", "packed_keys"]

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


@dataclass
class PackedCensus:
    """What the sharing pass finds in a model's oneDNN handlers (`collect_packed`).

    Attributes:
        slots: packed weights of at least ``min_bytes`` that can be shared, not shared yet.
        installed: packed weights a recipe's replay installed from segments already.
        private_n: handlers that keep their private packed copy (too small, or a layout not
            understood).
        private_bytes: those copies' bytes, where known.
        declined: ``"<module>: <why>"`` of each handler kept private for a reason other than
            its size.
    """

    slots: list[PackedSlot]
    installed: list[onednn.PackedWeight]
    private_n: int = 0
    private_bytes: int = 0
    declined: list[str] = field(default_factory=list)


def collect_packed(handlers: onednn.ModelHandlers, min_bytes: int, placement: dict) -> PackedCensus:
    """The packed weights of a model's oneDNN handlers (``handlers``), each read once.

    A handler whose packed weight cannot be found or checked (`errors.PackedWeightError`: a
    layout not understood) keeps its private packed copy (vLLM's own speed and numerics); one
    log line says how many and why.  A handler that ``placement`` (``id`` -> `Placement`)
    names was installed from a segment by a recipe's replay: counted, left alone.
    """
    census = PackedCensus([], [])
    for name, handler in handlers.named():
        try:
            packed = onednn.find_packed(handler)
        except Exception as e:  # PackedWeightError: a layout not understood; anything else too
            census.private_n += 1
            census.declined.append(f"{name}: {e}" if isinstance(e, PackedWeightError) else
                                   f"{name}: {type(e).__name__}: {e}")
            continue
        if id(handler) in placement:
            census.installed.append(packed)
        elif packed.shared:
            continue
        elif packed.nbytes < min_bytes:
            census.private_n += 1
            census.private_bytes += packed.nbytes
        else:
            raw = (ctypes.c_uint8 * packed.nbytes).from_address(packed.address)
            census.slots.append(PackedSlot(name, packed, torch.frombuffer(raw, dtype=torch.uint8)))
    if census.declined:
        logger.warning("%d oneDNN packed weight(s) stay private: they could not be found or checked (first: %s)",
                       len(census.declined), census.declined[0])
    return census


def packed_key(packed: onednn.PackedWeight, data) -> ContentKey:
    """The content key of a packed weight (Note [a packed weight's content key]): ``data``, its
    ``packed.nbytes`` bytes (any buffer), hashed in place."""
    return content_key(data, packed_dtype(packed.layout), (packed.nbytes,), (1,))


def packed_keys(slots: list[PackedSlot]) -> list[ContentKey]:
    """Content keys of packed weights (`packed_key`), hashed in parallel."""
    return content_keys([lambda s=s: packed_key(s.packed, tensor_bytes(s.tensor)) for s in slots])


# replaying a recipe (Note [packed weights replayed]) ----------------------------------------
class ZeroPages:
    """Placeholders that read zeros, over one anonymous private mapping mapped read-only (Note
    [packed weights replayed]): every page is the kernel's shared zero page (no memory), and a
    write faults (SIGSEGV) instead of changing what the next layer packs from the same pages."""

    def __init__(self):
        self._pages = None
        # (first byte, one past the last, the mapping) of every mapping made and still alive: an
        # address of one unmapped may be another allocation's by now
        self._spans: list[tuple[int, int, weakref.ref]] = []

    def tensor(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """A tensor of ``shape`` (2-D: ``[rows, columns]``) and ``dtype`` reading zeros: one row
        of the zero pages, broadcast over the rows (strides ``(0, 1)``).  The mapping grows, by
        a new one, when a longer row is asked for; the old stays while a tensor views it."""
        rows, columns = shape
        nbytes = columns * torch.empty((), dtype=dtype).element_size()
        grown = self._pages is None or len(self._pages) < nbytes
        if grown:
            self._pages = mmap.mmap(-1, max(nbytes, 1 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                    prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # torch warns that the buffer is not writable: the point
            warnings.simplefilter("ignore", UserWarning)
            row = torch.frombuffer(self._pages, dtype=torch.uint8, count=nbytes).view(dtype)
        if grown:  # a read-only mapping's address is known only through a view of it
            self._spans.append((row.data_ptr(), row.data_ptr() + len(self._pages), weakref.ref(self._pages)))
        return row.expand(rows, columns)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s first byte lies in one of these placeholders' mappings."""
        if tensor.is_meta or tensor.device.type != "cpu":
            return False
        address = tensor.data_ptr()
        self._spans = [span for span in self._spans if span[2]() is not None]
        return any(begin <= address < end for begin, end, _ in self._spans)


def packed_and_dropped(module, name: str) -> bool:
    """Whether vLLM's CPU post-processing packs ``module``'s tensor ``name`` for oneDNN and drops
    it: a linear layer's weight (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``),
    unless the layer is marked ``_cpu_skip_gemm_dispatch`` (``cpu_linear="vllm"`` marks the
    layers vLLM runs by ``F.linear``: their weights stay)."""
    from vllm.model_executor.layers.linear import LinearBase

    return name == "weight" and isinstance(module, LinearBase) and not getattr(module, "_cpu_skip_gemm_dispatch", False)


def keeps_weight(recipe) -> bool:
    """Whether a module with a packed weight keeps the weight it packs (a vocabulary embedding
    or head: its lookup reads it) rather than dropping it (a linear layer)."""
    return recipe.packed is not None and any(t.name == recipe.packed.name and t.nbytes for t in recipe.tensors)


def install_replayed(name: str, module, recipe, tensor):
    """Right after ``module``'s post-processing in a replay: its one oneDNN handler reads
    ``tensor`` (uint8, the recipe's packed bytes: a segment's mapping, or a private copy of
    inline bytes) instead of what vLLM packed (Note [packed weights replayed]).

    Args:
        name: the module's qualified name (for messages).
        module: the module, post-processed.
        recipe: its `recipe.ModuleRecipe`, whose ``packed`` entry names the bytes.
        tensor: those bytes, ``recipe.packed.nbytes`` long.

    Returns:
        The handler now reading ``tensor``; None for an embedding (or head) whose own packing
        differs from ``tensor`` (it keeps its copy, for the sharing pass), or that has no
        handler.

    Raises:
        RecipeDeclined: a linear layer's handler is not one, has another layout than the
            recipe's content key names, or oneDNN refused the replacement.
    """
    from .recipe import RecipeDeclined

    entry = recipe.packed
    handlers = onednn.module_handlers(module)
    if keeps_weight(recipe):  # its handler packed the real (mapped) weight: compare, exactly
        if len(handlers) != 1:
            return None
        try:
            onednn.install(onednn.find_packed(handlers[0]), tensor, compare=True)
        except PackedWeightError as e:
            logger.debug("module %s: the recipe's packed copy is not this one (%s); the sharing pass keys it", name, e)
            return None
        return handlers[0]
    if len(handlers) != 1:
        raise RecipeDeclined(f"module {name}: {len(handlers)} oneDNN handlers after post-processing, not one")
    layout = entry.layout if entry.inline is not None else ContentKey.parse(entry.key).dtype
    try:
        packed = onednn.find_packed(handlers[0])
        if (packed_dtype(packed.layout), (packed.nbytes,)) != (layout, entry.shape):
            raise RecipeDeclined(f"module {name}: oneDNN packed {packed.layout.tag} ({packed.nbytes} bytes), "
                                 f"not the layout of the recipe's {entry.key or entry.layout}")
        onednn.install(packed, tensor, compare=False)  # packed from zeros: the bytes differ by design
    except PackedWeightError as e:
        raise RecipeDeclined(f"module {name}: its packed weight cannot be replaced ({e})") from e
    return handlers[0]
