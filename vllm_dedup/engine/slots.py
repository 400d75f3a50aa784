"""A model's tensors grouped by storage, and the swap that rebinds them to shared memory.

A *slot* is one storage of the model (identified by data pointer and size, dtype, shape and
stride, as safetensors identifies shared storage) and every place that refers to it: a
parameter of a module, or a buffer.  Tied weights are one slot with several places.

Swapping keeps every ``nn.Parameter`` object (its class, its attributes such as
``weight_loader``, and every module that refers to it, so tied weights stay tied): only
``param.data`` is rebound.  Buffers are replaced in their modules' ``_buffers``.  A tensor that
is only a view into a larger storage stays private: swapping it would free nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .attributes import closure_contents, module_attributes

__all__ = ["Slot", "attribute_tensors", "collect_slots", "swap"]


@dataclass
class Slot:
    """One storage of the model and every place (module, attribute name, is a parameter) that
    refers to it.  ``tensor`` is the tensor currently bound there."""

    tensor: object
    refs: list[tuple[object, str, bool]]

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
        another device, on the meta device, non-contiguous, or views of a larger storage.
    """
    slots: dict[tuple, Slot] = {}
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is None or id(t) in exclude:
                    continue
                ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else (id(t),)
                slot = slots.setdefault(ident, Slot(t, []))
                slot.refs.append((module, name, is_param))
    candidates, private_n, private_b = [], 0, 0
    for slot in slots.values():
        t = slot.tensor
        ok = (
            t.device.type == device_type
            and not t.is_meta
            and t.is_contiguous()
            and slot.nbytes >= max(min_bytes, 1)
            and t.untyped_storage().nbytes() == slot.nbytes  # covers its whole storage
        )
        if ok:
            candidates.append(slot)
        else:
            private_n += 1
            private_b += slot.nbytes
    return candidates, private_n, private_b


def swap(slot: Slot, new) -> None:
    """Bind every place of ``slot`` to the tensor ``new`` (same dtype, shape and stride) and make
    it the slot's tensor; the slot no longer references the old one."""
    done = set()
    for module, name, is_param in slot.refs:
        if is_param:
            param = module._parameters[name]
            if id(param) not in done:
                param.data = new
                done.add(id(param))
        else:
            module._buffers[name] = new
    slot.tensor = new


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
