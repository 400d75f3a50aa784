"""Source keys: the content key of every checkpoint tensor an engine loads, and which module of
the model each one went into.

A *source key* is a checkpoint tensor's key as stored (BLAKE3-256 of its bytes, with its dtype
and shape: `content.keys.source_key`): the same key ``vllm-dedup scan`` computes, kept in the same manifest cache
(`checkpoint.manifest`), so an engine learns a checkpoint's keys without reading tensor bytes once
any engine or scan has seen the file (docs/architecture.md, "Loading only what is not resident").

`SourceRecorder` runs during a load.  It wraps the inner loader's weight iterator: every tensor
it yields is hashed zero-copy in a thread pool, overlapped with the load.  And it wraps every
parameter's (and buffer's) ``weight_loader``: a call attributes the tensor just yielded to the
module owning that parameter: the tensor just yielded, when the tensor the weight loader
receives shares its storage (the loader passed it on, possibly as a view); else the checkpoint
tensors its values came from, as `provenance.Provenance` traced them through the torch calls of
``load_weights`` (a ``torch.cat`` of views of the tensor just read, tensors drained into a list
and loaded later).  A write outside any weight loader that the provenance mode saw (a
``param.copy_`` by hand, a decoder copied from the word embedding) attributes its provenance
too; one made while a checkpoint tensor was current and only from it counts as that tensor's
loading, any other (after the iterator was drained, from other tensors) makes its module
*eager*: loaded whenever a load is partial, since ``load_weights`` writes it whatever it is fed
(`recipe.Match.settle`).  Whatever provenance cannot say (unknown, or from no checkpoint
tensor) marks the module *untraced* (`recipe.py`: loaded only with everything, mapped only from
an unchanged checkpoint), and so does a write no torch call explains, which a witness taken
before the load, after each of its weight loader calls and tracked writes, and after the load
reveals, and a parameter nothing filled.

Use `SourceRecorder.tracing` around ``load_weights``: without it, only storage identity
attributes.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

from ..content.keys import source_key
from ..content.views import dtype_name, tensor_bytes
from .proc_maps import AnonymousRanges
from .provenance import Provenance

__all__ = ["SourceRecorder", "write_witness"]

_MAX_PENDING = 32  # tensors yielded but not hashed yet, at most (bounds the memory they keep alive)


class SourceRecorder:
    """Hashes the tensors a load reads and records which module each went into, and whether
    each module is traced (module docstring).  Use `wrap` before ``load_weights``, `iterate`
    around the weight iterator, `unwrap` as soon as ``load_weights`` returned (the recorder
    then holds no tensor of the model: post-processing frees what it replaces, as in a plain
    load), and `finish` for the keys.

    Args:
        hash_keys: hash the tensors read (source keys); False records attribution only.
        threads: hashing threads (default ``min(8, cpu_count)``).
        known: tensor name -> source key known already (from the manifest cache, for a file
            whose identity the caller checks after the load): such tensors are not hashed.

    Attributes:
        module_sources: module name -> names of the checkpoint tensors its weight loaders got.
        untraced: module name -> why its inputs are not exactly its recorded sources: a weight
            loader got a tensor other than the one just read, a parameter or buffer was written
            outside a weight loader (e.g. copied from another module's tensor, or from a
            checkpoint tensor by hand), or a parameter was never filled from the checkpoint.
        loaded: ``id`` of every wrapped tensor some recorded weight loader call (or traced write)
            went to.
        eager: module name -> why ``load_weights`` writes it whatever it is fed (module docstring).
        provenance: the `provenance.Provenance` mode of this load (`tracing`).
        consumed: names of every tensor the iterator yielded, in order.
        bytes_read: bytes of those tensors.
        unhashable: names whose source key this load cannot say: a tensor off the CPU or not
            contiguous, one whose bytes could not be hashed (`_source_key_or_none`), or a name
            yielded twice (two files of the checkpoint hold it: which
            bytes the model got is the weight loaders' business, so neither key is kept).
    """

    def __init__(self, hash_keys: bool = True, threads: int | None = None, known: dict[str, str] | None = None):
        self.hash_keys = hash_keys
        self.known = dict(known or {})  # name -> source key already known (the manifest cache): not hashed
        self.module_sources: dict[str, set[str]] = defaultdict(set)
        self.untraced: dict[str, str] = {}
        self.eager: dict[str, str] = {}
        self.loaded: set[int] = set()
        self.consumed: list[str] = []
        self.bytes_read = 0
        self.unhashable: list[str] = []
        self._current: tuple[str, int] | None = None  # (name, storage address) of the last tensor yielded
        self._pool = ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1),
                                        thread_name_prefix="vllm-dedup-source") if hash_keys else None
        self._futures: dict[str, Future] = {}
        self._pending: list[Future] = []
        # (tensor, its module, its name, weight_loader before (None: had none), param?)
        self._wrapped: list[tuple[object, str, str, object, bool]] = []
        self._seen: dict[int, bytes] = {}  # id(tensor) -> write witness when it last legitimately changed
        self._sharers: dict[int, list[tuple[object, str]]] = {}  # storage address -> (tensor, module) wrapped over it
        self._loading: list[int | None] = []  # storage of each recorded weight loader call's target, innermost last
        self.provenance = Provenance(on_write=self._traced_write)

    @contextlib.contextmanager
    def tracing(self, protect: Iterable[tuple[object, str]] = ()) -> Iterator[None]:
        """Trace provenance through the torch calls of the block (``load_weights``), in this
        thread; refuse (`provenance.ProtectedWrite`) a write into any of the ``protect`` tensors
        (tensor, what it is)."""
        for t, what in protect:
            self.provenance.protect(t, what)
        with self.provenance:
            yield

    # weight loaders ------------------------------------------------------------------------
    def wrap(self, model, modules: Iterable[str] | None = None, holds_no_data=None) -> None:
        """Wrap the ``weight_loader`` of every parameter and buffer of ``model`` (of the named
        ``modules`` only, when given), and take each one's `write_witness`.  A tensor owned by
        several modules (tied weights) is attributed to the first name `named_modules` gives it.
        ``holds_no_data(address, nbytes)``: whether the tensor whose first byte is there reads
        zeros throughout (`in_place.InPlace.holds_no_data`; Note [reading a parameter before it is
        written])."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        only = set(modules) if modules is not None else None
        seen: set[int] = set()
        unwritten = AnonymousRanges(holds_no_data)  # Note [reading a parameter before it is written]
        for module_name, module in model.named_modules(remove_duplicate=False):
            tables = [(module._parameters, True), (module._buffers, False)]
            for name, t, is_param in [(n, t, p) for table, p in tables for n, t in table.items()]:
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                if only is not None and module_name not in only:
                    continue
                try:
                    original = getattr(t, "weight_loader", None)
                except Exception:  # vLLM parameters raise when their loader was deleted
                    original = None
                self._wrapped.append((t, module_name, name, original, is_param))
                self._seen[id(t)] = write_witness(t, unwritten=unwritten)
                if not t.is_meta and t.numel():
                    self._sharers.setdefault(_storage_address(t), []).append((t, module_name))
                    self.provenance.reset(t)
                t.weight_loader = RecordedLoader(self, module_name, t, original or default_weight_loader)

    def _record_call(self, module_name: str, target, original, args: tuple, kwargs: dict):
        """Run ``original(*args, **kwargs)``, a weight loader of ``target`` (a tensor of
        ``module_name``), attributing what it got before and taking ``target``'s witness after."""
        loaded = args[1] if len(args) > 1 else kwargs.get("loaded_weight")
        with self.provenance.quiet():
            sources = self._attribute(module_name, loaded)
            self._loading.append(_storage_address(target))
        try:
            out = original(*args, **kwargs)
        finally:
            self._loading.pop()
        with self.provenance.quiet():
            self.loaded.add(id(target))
            self._seen[id(target)] = write_witness(target)
            self._wrote_sharers(target, sources)
        return out

    def _attribute(self, module_name: str, loaded) -> frozenset[str] | None:
        """Attribute to ``module_name`` the tensor just read, if ``loaded`` shares its storage,
        else the checkpoint tensors ``loaded``'s values came from (returns their names); or mark
        the module untraced (returns None)."""
        import torch

        current = self._current
        if current is not None and _storage_address(loaded) == current[1]:
            # the tensor just read (or a view of it), into which load_weights may have mixed
            # others in place (``x.add_(y)``): those are its sources too
            sources = frozenset((current[0],)) | (self.provenance.of(loaded) or frozenset())
        else:
            sources = self.provenance.of(loaded) if isinstance(loaded, torch.Tensor) else None
        if sources:
            self.module_sources[module_name] |= sources
            return sources
        why = self.provenance.lost or "its values came from no checkpoint tensor it could trace"
        self.untraced.setdefault(module_name, f"a weight loader got a tensor other than the checkpoint tensor "
                                              f"just read ({why})")
        return None

    def _traced_write(self, written, sources: frozenset[str] | None) -> None:
        """`provenance.Provenance`'s report of a torch call that wrote into ``written``: into a
        wrapped tensor's storage, with known checkpoint sources, it counts as that tensor's
        loading (module docstring); else the witness at `unwrap` judges it.  A write into the
        storage a weight loader now running was called for is that call's (`_record_call`
        attributes it); a weight loader's write into *another* wrapped tensor is judged here
        like a write outside loaders, since a witness of 256 samples can miss a few rows."""
        if not sources:
            return
        with self.provenance.quiet():
            address = _storage_address(written)
            if address in self._loading:
                return
            sharers = self._sharers.get(address, ())
            current = self._current
            conditional = current is not None and sources <= {current[0]}
            for t, module_name in sharers:
                self.module_sources[module_name] |= sources
                self.loaded.add(id(t))
                self._seen[id(t)] = write_witness(t)
                if not conditional:
                    self.eager.setdefault(module_name, "load_weights writes it outside a weight loader from "
                                                       f"{', '.join(sorted(sources)[:2])}")

    def _wrote_sharers(self, target, sources: frozenset[str] | None) -> None:
        """A weight loader wrote ``target``: every other wrapped tensor over its storage (Mamba2's
        mixer views its conv layer's weight as a ``conv_weights`` buffer) was written with it,
        from the same checkpoint tensor, which goes into the sharer's module too."""
        if target.is_meta or not target.numel():
            return
        for sharer, module_name in self._sharers.get(_storage_address(target), ()):
            if sharer is target:
                continue
            self._seen[id(sharer)] = write_witness(sharer)
            if sources is None:
                self.untraced.setdefault(module_name, "a tensor over the storage of another module's parameter "
                                                      "was filled from a transformed checkpoint tensor")
            else:
                self.module_sources[module_name] |= sources

    # the weight iterator -------------------------------------------------------------------
    def iterate(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """Yield ``weights`` unchanged, hashing each tensor (in threads) and noting it as the
        one weight loaders may receive until the next."""
        seen: set[str] = set()
        for name, tensor in weights:
            with self.provenance.quiet():
                if name in seen:
                    self.unhashable.append(name)
                seen.add(name)
                self.consumed.append(name)
                self.bytes_read += tensor.numel() * tensor.element_size()
                self._current = (name, _storage_address(tensor))
                self.provenance.mark(tensor, (name,))
                if self._pool is not None:
                    self._submit(name, tensor)
            yield name, tensor
        self._current = None

    def _submit(self, name: str, tensor) -> None:
        if name in self.known:
            return
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            self.unhashable.append(name)
            return
        while len(self._pending) >= _MAX_PENDING:
            self._pending.pop(0).result()
        try:
            fut = self._pool.submit(_source_key_or_none, tensor)
        except RuntimeError:  # no thread to be had (a pids limit): no key, never an error in the load
            self.unhashable.append(name)
            return
        self._futures[name] = fut
        self._pending.append(fut)

    def unwrap(self) -> None:
        """Restore the weight loaders, mark what was written outside them (`untraced`), and let
        go of every tensor of the model.  Idempotent."""
        for t, module_name, name, original, is_param in self._wrapped:
            if original is None:
                del t.weight_loader
            else:
                t.weight_loader = original
            if write_witness(t) != self._seen[id(t)]:
                self.untraced.setdefault(module_name, f"{name} was written outside a weight loader (copied from "
                                                      "another tensor, or from the checkpoint by hand)")
            elif is_param and id(t) not in self.loaded:
                self.untraced.setdefault(module_name, f"{name} is not filled from the checkpoint")
        self._wrapped.clear()
        self._seen.clear()
        self._sharers.clear()

    def finish(self) -> dict[str, str]:
        """`unwrap` (if not done yet); return the source keys (name -> key string): those hashed
        and the ``known`` ones of the tensors read."""
        self.unwrap()
        keys = {name: str(key) for name, fut in self._futures.items() if (key := fut.result()) is not None}
        self.unhashable += [name for name in self._futures if name not in keys]
        keys.update({name: self.known[name] for name in self.consumed if name in self.known})
        if self._pool is not None:
            self._pool.shutdown()
        unhashable = set(self.unhashable)
        return {name: key for name, key in keys.items() if name not in unhashable}


class RecordedLoader:
    """A tensor's ``weight_loader`` while `SourceRecorder` records a load: calls the loader it
    wraps (``__wrapped__``) through `SourceRecorder._record_call`.

    Note [a recorded weight loader is still the same loader]
        vLLM's models look at the loader they are given: ``weight_loader ==
        default_weight_loader`` chooses the arguments of the call (gpt-oss, Llama 4), a
        ``supports_moe_loading`` attribute on it chooses the expert path (Llama 4), and the
        layerwise reload reads its ``__name__`` and ``__wrapped__``.  A plain closure answered
        none of them as the loader would, and those models then called it with arguments it
        does not take.  So this object compares and hashes as the loader it wraps, answers every
        other attribute from it, and ``inspect.signature`` follows ``__wrapped__`` to its
        signature.
    """

    def __init__(self, recorder: SourceRecorder, module_name: str, target, original):
        self.__wrapped__ = original
        self._call = (recorder, module_name, target)

    def __call__(self, *args, **kwargs):
        recorder, module_name, target = self._call
        return recorder._record_call(module_name, target, self.__wrapped__, args, kwargs)

    def __getattr__(self, name: str):  # only what the instance itself lacks
        if name in ("__wrapped__", "_call"):  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)

    def __eq__(self, other) -> bool:
        return other is self or self.__wrapped__ == other

    def __hash__(self) -> int:
        return hash(self.__wrapped__)


def _source_key_or_none(tensor):
    """``tensor``'s source key, or None where its bytes cannot be hashed (a tensor subclass
    with no plain storage): that name then has no key, and the load goes on."""
    try:
        return source_key(tensor_bytes(tensor), dtype_name(tensor.dtype), tuple(tensor.shape))
    except Exception:
        return None


def write_witness(t, samples: int = 256, unwritten: AnonymousRanges | None = None) -> bytes:
    """A cheap digest of a tensor's current values, to see whether something wrote into it
    (not a content key: `content.fingerprint` names bytes on a GPU): XXH3-64 of all its bytes up to 64 KiB, else of ``samples`` elements spread evenly over
    it (and its size).  A write that changes no sampled element goes unseen; the writes this
    looks for (a tensor copied over another, a parameter filled by hand) change them all.
    Meta and empty tensors have an empty witness.

    Few samples on purpose, and with ``unwritten`` (this process's private anonymous ranges,
    taken before the load) none read from a page not present yet: each is zero, as reading it
    would have said (Note [reading a parameter before it is written]).

    Note [reading a parameter before it is written]
        A large parameter is fresh anonymous memory until its weight loader writes it.  Reading
        one of its pages maps the kernel's shared zero page there, and the loader's write then
        has to replace that mapping (a copy-on-write fault with a TLB flush) instead of taking
        a fresh page: sampling 8192 elements of every parameter before and between loader calls
        touched every page of the model and made a 1.2B model's ``load_weights`` three times
        slower than a plain load's.  With 256 samples it still cost 0.15 s of a 1.2B model's
        load (51,000 such pages).  So the witness taken before the load reads no page that is
        not present (``/proc/self/pagemap``, `proc_maps.present_runs`): in a private anonymous
        mapping such a page reads as zeros, so its samples are zeros without being read, and
        the witness is the same value.  Publishing in place moves such a parameter into a
        memfd first (`in_place`), where a read allocates a page too: there the witness reads
        nothing of a memfd that holds no data yet (``holds_no_data``).  The 1.2B model's first
        engine (91 such parameters, 256 pages each read before) then spent 3.03 s in the kernel
        against 3.38 s, and loaded in 3.49 s against 3.91 s, medians of five alternating loads
        on a noisy VM whose rounds spread by more than that (AVX2, 2026-11-28)."""
    import torch

    if t.is_meta or t.numel() == 0:
        return b""
    flat = t.detach().reshape(-1)
    if flat.numel() * flat.element_size() > 65536:
        idx = torch.arange(samples, device=flat.device, dtype=torch.int64) * (flat.numel() - 1) // (samples - 1)
        flat = _samples(t, flat, idx, unwritten)
    data = flat.cpu().contiguous().view(torch.uint8)
    return xxhash.xxh3_64_digest(memoryview(data.numpy())) + t.numel().to_bytes(8, "little")


def _samples(t, flat, idx, unwritten: AnonymousRanges | None):
    """``flat[idx]``, reading none of the pages of ``t`` that are not present where
    ``unwritten`` says they read as zeros (Note [reading a parameter before it is written])."""
    import torch

    if unwritten is None or t.device.type != "cpu" or not t.is_contiguous():
        return flat[idx]
    runs = unwritten.written_runs(t.data_ptr(), t.numel() * t.element_size())
    if runs is None:
        return flat[idx]
    out = torch.zeros(len(idx), dtype=flat.dtype)
    if runs:
        offsets = idx * flat.element_size()
        starts, ends = torch.tensor([r[0] for r in runs]), torch.tensor([r[1] for r in runs])
        run = torch.searchsorted(starts, offsets, right=True) - 1  # the run starting at or before each
        present = (run >= 0) & (offsets < ends[run.clamp(min=0)])
        out[present] = flat[idx[present]]
    return out


def _storage_address(t) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        return None
