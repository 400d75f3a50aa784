"""Provenance: which checkpoint tensors the values of each tensor made during a load came from.

`Provenance` is a ``TorchFunctionMode``.  While it is active, every torch function and tensor
method called in the loading thread passes through it (torch function modes are thread-local:
the hashing threads of `sources.SourceRecorder` are not seen), and it gives what the call makes
and what it writes the union of its tensor arguments' provenance: the names of the checkpoint
tensors their values were computed from.  A checkpoint tensor yielded to ``load_weights`` is
marked with its own name (`Provenance.mark`); so a loader that concatenates three views of the
tensor just read (Falcon's ``query_key_value``), copies into a parameter by hand (gpt-oss's
experts) or copies one parameter into another (BERT's MLM decoder from the word embedding)
leaves exact provenance on what it wrote, where storage identity alone knows nothing.

It is conservative: where it cannot know, it says so (``None``), never a smaller set.

Note [provenance lives on storages]
    Provenance is kept per storage (the preserved ``UntypedStorage`` object, held by weak
    reference so that a storage freed and another made at its address is not mistaken for it),
    not per tensor: a write into any view of a parameter (``param.data[e].copy_(w)``) is a write
    into its storage, and ``param.data = t`` makes the parameter's values ``t``'s, whose storage
    already carries ``t``'s provenance.  A call's output over an input's storage (a view) adds
    to that storage's provenance; a fresh output starts with the call's.

Note [unknown is not empty]
    An empty set means "computed from no checkpoint tensor" (``torch.zeros``, ``arange``); a
    tensor the mode never saw made (a module constant, a tensor read from a file by the model's
    own code) has *unknown* provenance, and so has everything computed from it.  A caller must
    treat unknown, and empty where a checkpoint tensor is expected, as "not traced".

Note [values that leave torch]
    ``.item()``, ``.tolist()``, ``.numpy()``, ``bool(t)``, ``data_ptr()``: values that leave
    torch as Python objects (or raw memory) can come back in a tensor the mode sees made from
    nothing.  The first such call (other than metadata: shapes, dtypes, strides) makes every
    provenance unknown for the rest of the load (``lost`` says which call).
"""

from __future__ import annotations

import contextlib
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..log import init_logger

__all__ = ["Provenance", "ProtectedWrite", "WriteGuard"]

logger = init_logger(__name__)

# Calls whose non-tensor results are facts about a tensor, not its values.
_METADATA = frozenset({
    "size", "dim", "ndimension", "stride", "numel", "nelement", "is_contiguous", "element_size",
    "storage_offset", "__len__", "get_device", "is_floating_point", "is_complex", "is_signed", "is_pinned",
    "is_shared", "is_inference", "__hash__", "type", "dtype.__get__", "shape.__get__", "device.__get__",
    "ndim.__get__", "is_meta.__get__", "is_cuda.__get__", "is_cpu.__get__", "layout.__get__",
    "requires_grad.__get__", "names.__get__", "itemsize.__get__", "nbytes.__get__", "is_sparse.__get__",
    "is_quantized.__get__", "is_leaf.__get__", "grad_fn.__get__", "is_nested.__get__", "is_mkldnn.__get__",
})
_INPLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "data.__set__",
})

# Tensor methods named like in-place ops that write no byte of the tensor's storage: they
# change its metadata (or rebind it, ``set_``); ``resize_`` past a mapping's end raises.
_METADATA_ONLY = frozenset({
    "requires_grad_", "as_strided_", "t_", "transpose_", "swapdims_", "swapaxes_", "squeeze_", "unsqueeze_",
    "detach_", "share_memory_", "set_", "resize_", "rename_", "retain_grad",
})

Names = frozenset[str] | None  # None: unknown (Note [unknown is not empty])


class ProtectedWrite(RuntimeError):
    """A call would write into a tensor `Provenance.protect` named (a module mapped read-only from a
    segment); it was not made."""


class WriteGuard(TorchFunctionMode):
    """Refuse (`ProtectedWrite`) every torch call that would write into the bytes of one of
    ``protect``'s tensors (tensor, what it is); nothing else is traced.  Rebinding a tensor
    (``.data =``, ``set_``) or changing only its metadata (``requires_grad_``, ``as_strided_``,
    ``t_``, ...: `_METADATA_ONLY`) writes no byte and goes through, and so does an op outside
    ATen whose schema marks an argument it only reads as mutated (vLLM's
    ``_C::convert_weight_packed(Tensor($0! -> ) weight)``, which its CPU embeddings call on a
    weight of 1 MiB or less on AMX): the guard refuses what would fault, not what might.

    `replay.py` runs vLLM's post-processing under it: a tensor mapped read-only there faults
    at a write (SIGSEGV; on CUDA an illegal address that poisons the context), which no
    fallback can catch, and vLLM's attention layers write their scales in post-processing
    whatever the pre-processed mode (``set_default_quant_scales``: ``_k_scale.fill_(1.0)``).
    """

    def __init__(self, protect: Iterable[tuple[torch.Tensor, str]]):
        super().__init__()
        self._protected: dict[int, tuple[weakref.ref, str]] = {}
        for t, what in protect:
            _protect(self._protected, t, what)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if self._protected and name != "data.__set__" and name.split(".")[0] not in _METADATA_ONLY:
            for t in _written(func, name, args, kwargs, aten_schemas_only=True):
                _refuse_protected(self._protected, t, name)
        return func(*args, **kwargs)


class Provenance(TorchFunctionMode):
    """The provenance of every storage a load's torch calls make or write (module docstring).

    Use as a context manager around ``load_weights`` in the loading thread.

    Args:
        on_write: called after every call that wrote into a tensor, with that tensor and the
            provenance of what was written into it: the call's inputs other than the tensors it
            wrote (``None``: unknown).

    Attributes:
        lost: why provenance became unknown for the rest of the load ("" while it is known).
        calls: torch calls traced.
        overhead_s: seconds spent tracing them (the calls themselves not counted).
    """

    def __init__(self, on_write: Callable[[torch.Tensor, Names], None] | None = None):
        super().__init__()
        self.on_write = on_write
        self.lost = ""
        self._storages: dict[int, tuple[weakref.ref, Names]] = {}  # id(storage) -> (it, provenance)
        self._protected: dict[int, tuple[weakref.ref, str]] = {}  # id(storage) -> (it, what it is)
        self._quiet = 0
        self.calls = 0
        self.overhead_s = 0.0

    # what callers say and ask ----------------------------------------------------------------
    def mark(self, t: torch.Tensor, names: Iterable[str]) -> None:
        """``t``'s storage holds (also) the values of these checkpoint tensors, and nothing but
        checkpoint tensors: a storage of unknown provenance (made by a call the mode does not
        see, such as ``torch.frombuffer`` over a file's mapping) gets these names."""
        with self.quiet():
            storage = _storage(t)
            if storage is not None:
                self._add(storage, frozenset(names), fresh_known=True)

    def reset(self, t: torch.Tensor) -> None:
        """``t``'s storage holds values from no checkpoint tensor (a parameter before loading)."""
        with self.quiet():
            storage = _storage(t)
            if storage is not None:
                self._storages[id(storage)] = (weakref.ref(storage), frozenset())

    def of(self, t: torch.Tensor) -> Names:
        """The checkpoint tensors ``t``'s values came from; ``None``: unknown."""
        if self.lost:
            return None
        with self.quiet():
            return self._get(_storage(t))

    def protect(self, t: torch.Tensor, what: str) -> None:
        """Refuse (`ProtectedWrite`) any call that would write into ``t``'s storage."""
        with self.quiet():
            _protect(self._protected, t, what)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Calls in the block are not traced (the caller's own bookkeeping)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    # the mode --------------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._quiet:
            return func(*args, **kwargs)
        began = time.perf_counter()
        self.calls += 1
        name = _name(func)
        inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        written = _written(func, name, args, kwargs)
        if self._protected:
            with self.quiet():
                for t in written:
                    _refuse_protected(self._protected, t, name)
        called = time.perf_counter()
        result = func(*args, **kwargs)
        returned = time.perf_counter()
        self._quiet += 1
        try:
            leaves = tree_leaves(result)
            if inputs and name not in _METADATA and any(
                    x is not None and not isinstance(x, torch.Tensor) for x in leaves) and not self.lost:
                self.lost = f"{name} took a tensor's values out of torch"
                logger.debug("provenance is unknown from here on: %s, at\n%s", self.lost,
                             "".join(traceback.format_stack(limit=12)[:-1]))
            # Storages after the call: ``param.data = t`` gives ``param`` another one.
            in_storages = [_storage(x) for x in inputs]
            names = self._union(in_storages)
            input_ids = {id(s) for s in in_storages if s is not None}
            for out in (x for x in leaves if isinstance(x, torch.Tensor)):
                storage = _storage(out)
                if storage is None:
                    continue
                if id(storage) in input_ids:
                    self._add(storage, names)
                else:
                    self._storages[id(storage)] = (weakref.ref(storage), names)
            written_storages = [s for s in map(_storage, written) if s is not None]
            for storage in written_storages:
                self._add(storage, names)
            if written and self.on_write is not None:
                # What was written in: the call's other inputs (a write keeps the rest of the
                # destination, whose provenance its storage has already).
                into = {id(s) for s in written_storages}
                sources = self._union([s for s in in_storages if s is None or id(s) not in into])
        finally:
            self._quiet -= 1
        if written and self.on_write is not None:
            for t in written:
                self.on_write(t, sources)
        self.overhead_s += (called - began) + (time.perf_counter() - returned)
        return result

    # storages --------------------------------------------------------------------------------
    def _get(self, storage) -> Names:
        if storage is None:
            return None
        entry = self._storages.get(id(storage))
        if entry is None or entry[0]() is not storage:
            return None
        return entry[1]

    def _add(self, storage, names: Names, fresh_known: bool = False) -> None:
        """Add ``names`` to the provenance of ``storage``.  A storage of unknown provenance stays
        unknown (its other bytes), unless ``fresh_known`` (`mark`: it holds checkpoint tensors
        only)."""
        before = self._get(storage)
        if before is None:
            merged = names if fresh_known else None
        else:
            merged = None if names is None else before | names
        self._storages[id(storage)] = (weakref.ref(storage), merged)

    def _union(self, storages: list) -> Names:
        """The union of these storages' provenance (None: any is unknown, or a storage is None)."""
        if self.lost:
            return None
        out: set[str] = set()
        for storage in storages:
            names = self._get(storage)
            if names is None:
                return None
            out |= names
        return frozenset(out)


def _protect(protected: dict[int, tuple[weakref.ref, str]], t: torch.Tensor, what: str) -> None:
    storage = _storage(t)
    if storage is not None:
        protected[id(storage)] = (weakref.ref(storage), what)


def _refuse_protected(protected: dict[int, tuple[weakref.ref, str]], t: torch.Tensor, name: str) -> None:
    """Raise `ProtectedWrite` where ``t``'s storage is one of ``protected``'s (``name``: the call)."""
    storage = _storage(t)
    entry = protected.get(id(storage)) if storage is not None else None
    if entry is not None and entry[0]() is storage:
        raise ProtectedWrite(f"{name} would write into {entry[1]}")


def _storage(t: torch.Tensor):
    """``t``'s preserved storage object, or None (a meta tensor, a tensor without storage)."""
    try:
        if t.is_meta:
            return None
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _name(func) -> str:
    """A call's name: ``copy_``, ``add_.Tensor`` (an op overload), ``shape.__get__`` (a property)."""
    name = getattr(func, "__name__", "") or str(func)
    if name in ("__get__", "__set__"):
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        return f"{owner}.{name}"
    return name


def _written(func, name: str, args: tuple, kwargs: dict, aten_schemas_only: bool = False) -> list[torch.Tensor]:
    """The tensors a call writes into: by its schema (an op overload; with
    ``aten_schemas_only``, ATen's only, as other libraries' schemas may mark what they only
    read), an in-place method (``copy_``), an in-place operator (``__setitem__``,
    ``__iadd__``), ``.data =``, ``out=``."""
    written = []
    overloads = []
    if isinstance(func, torch._ops.OpOverload):
        overloads = [func]
    elif isinstance(func, torch._ops.OpOverloadPacket):
        overloads = [getattr(func, o) for o in func.overloads()]
    schemas = [o._schema for o in overloads if not aten_schemas_only or o.namespace == "aten"]
    for schema in schemas:
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                written += [x for x in tree_leaves(value) if isinstance(x, torch.Tensor)]
    base = name.split(".")[0]
    if not schemas and args and isinstance(args[0], torch.Tensor) and (
            name in _INPLACE_DUNDERS or (base.endswith("_") and not base.startswith("_"))):
        written.append(args[0])
    written += [x for x in tree_leaves(kwargs.get("out")) if isinstance(x, torch.Tensor)]
    unique = {id(t): t for t in written}
    return list(unique.values())
