"""A model's tensors grouped by storage, and the swap that rebinds them to shared memory.

A *slot* is one storage of the model (identified by data pointer and size, dtype, shape and
stride, as safetensors identifies shared storage) and every place that refers to it: a
parameter of a module, or a buffer.  Tied weights are one slot with several places.

Swapping keeps every ``nn.Parameter`` object (its class, its attributes such as
``weight_loader``, and every module that refers to it, so tied weights stay tied): only
``param.data`` is rebound.  Buffers are replaced in their modules' ``_buffers``.

Note [views into a shared storage]
    Post-processing can make a tensor that is a view into another one's storage: vLLM's MLA
    attention keeps ``W_UV`` and ``W_UK_T`` as a transpose and a permute of ``kv_b_proj``'s
    weight (``split_kv_b_proj``, ``mla_attention.py``).  Such a view belongs to the slot of the
    tensor that covers the whole storage (`Slot.views`) and is rebound into the shared copy at
    the same element offset, shape and stride when that slot is swapped: the private storage is
    then freed with its last reference, and the view reads the shared bytes.  A view of a
    storage no candidate covers stays private (swapping it alone would free nothing); a view of
    a tensor already shared (mapped by a replay) is shared already, and left alone.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from .attributes import closure_contents, module_attributes

__all__ = ["Slot", "attribute_tensors", "collect_slots", "covers_storage", "has_storage", "storage_id", "swap", "swap_out"]


@dataclass
class Slot:
    """One storage of the model and every place (module, attribute name, is a parameter) that
    refers to it.  ``tensor`` is the tensor currently bound there; ``views``, the places that
    hold a view into its storage with another offset, shape or stride (Note [views into a
    shared storage])."""

    tensor: object
    refs: list[tuple[object, str, bool]]
    views: list[tuple[object, str, bool]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def collect_slots(model, device_type: str, min_bytes: int, exclude: set[int] = frozenset()
                  ) -> tuple[list[Slot], int, int]:
    """Group ``model``'s parameters and buffers by storage.

    Args:
        model: an ``nn.Module``.
        device_type: only tensors on this torch device type are candidates.
        min_bytes: smaller tensors stay private.
        exclude: ``id``s of tensor objects to leave out altogether.

    Returns:
        (candidate slots, private tensors, private bytes): private are the slots too small, on
        another device, on the meta device, without a plain storage (a sparse or oneDNN
        layout), non-contiguous, conjugate or negative views (their bytes are not their
        values), or views of a larger storage.
    """
    slots: dict[tuple, Slot] = {}
    shared_storages = set()  # storages of the excluded tensors (a replay's mapped ones)
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is not None and id(t) in exclude and not t.is_meta:
                    shared_storages.add(storage_id(t))
                if t is None or id(t) in exclude:
                    continue
                # A conjugate or negative view reads the same bytes as other values: never one slot.
                ident = ((t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.is_conj(), t.is_neg())
                         if t.numel() and has_storage(t) else (id(t),))
                slot = slots.setdefault(ident, Slot(t, []))
                slot.refs.append((module, name, is_param))
    candidates, others, covering = [], [], {}  # covering: storage -> the candidate covering it
    for slot in slots.values():
        t = slot.tensor
        ok = (
            t.device.type == device_type
            and has_storage(t)
            and t.is_contiguous()
            and not t.is_conj() and not t.is_neg()  # its bytes are not its values
            and slot.nbytes >= max(min_bytes, 1)
            and covers_storage(t)
        )
        if ok:
            candidates.append(slot)
            covering[storage_id(t)] = slot
        else:
            others.append(slot)
    private_n, private_b = 0, 0
    for slot in others:  # Note [views into a shared storage]
        t = slot.tensor
        storage = storage_id(t) if t.numel() and has_storage(t) else None
        base = covering.get(storage)
        if base is not None and t.dtype == base.tensor.dtype and not t.is_conj() and not t.is_neg():
            base.views += slot.refs  # (a conjugate or negative view would lose its bit when rebound)
        elif storage is None or storage not in shared_storages:
            private_n += 1
            private_b += slot.nbytes
    return candidates, private_n, private_b


def has_storage(t) -> bool:
    """Whether a tensor's elements lie in one plain storage with strides: not on the meta device,
    not sparse and not in oneDNN's own layout, whose ``data_ptr`` and storage torch refuses."""
    import torch

    return t.layout == torch.strided and not t.is_meta


def storage_id(t) -> tuple:
    """A tensor's storage: (device, address of its first byte)."""
    return (str(t.device), t.untyped_storage().data_ptr())


def covers_storage(t) -> bool:
    """Whether a tensor's elements are its whole storage (nothing else can view more of it)."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def swap(slot: Slot, new) -> None:
    """Bind every place of ``slot`` to the tensor ``new`` (same dtype, shape and stride) and make
    it the slot's tensor; the slot no longer references the old one."""
    old, done = slot.tensor, set()
    # each view at its element offset into the new storage (Note [views into a shared storage]),
    # computed before anything is rebound
    views = []
    for module, name, is_param in slot.views:
        view = module._parameters[name] if is_param else module._buffers[name]
        offset = new.storage_offset() + view.storage_offset() - old.storage_offset()
        views.append((module, name, is_param, view, new.as_strided(view.shape, view.stride(), offset)))
    for module, name, is_param in slot.refs:
        if is_param:
            param = module._parameters[name]
            if id(param) not in done:
                param.data = new
                done.add(id(param))
        else:
            module._buffers[name] = new
    for module, name, is_param, view, rebound in views:
        if is_param:
            if id(view) not in done:
                view.data = rebound
                done.add(id(view))
        else:
            module._buffers[name] = rebound
    slot.tensor = new


def swap_out(slot: Slot, new):
    """`swap` ``slot`` to ``new`` and return the storage its places held if something outside
    them still holds it, else None: a tensor of vLLM's kept elsewhere (an attribute, a closure)
    would go on reading the old storage (`engine.in_place`, Note [a storage held elsewhere]).
    torch keeps a storage's Python object while the storage lives, so a weak reference tells.
    The caller must hold no reference to the slot's old tensor."""
    old = weakref.ref(slot.tensor.untyped_storage())
    swap(slot, new)
    return old()


def attribute_tensors(model):
    """Tensors the model's modules keep outside ``_parameters`` and ``_buffers``: in their own
    attributes, one level into plain objects they hold (an attention layer's implementation),
    and captured by a layer's ``cpu_linear`` closure (vLLM's CPU GEMM dispatch).  Kernels read
    them too, and a model built on the meta device can leave a stale meta tensor there
    (`attributes.module_attributes`).

    Yields:
        ``("<module>.<attribute>[...]", tensor)``, where a tensor is reachable from several
        modules once per place.  Parameters too: an attribute holding a parameter object (CPU
        attention's ``impl.sinks``) keeps the old one when a loader puts a new object in its
        module.
    """
    import torch

    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = module_name or "<model>"
        for a in module_attributes(module):
            if isinstance(a.value, torch.Tensor):
                yield f"{prefix}.{a.path}", a.value
            elif a.name == "cpu_linear":
                for i, content in closure_contents(a.value):
                    if isinstance(content, torch.Tensor):
                        yield f"{prefix}.{a.path}[{i}]", content
