"""Publish in place: a usual load's oneDNN packed weights go into segments as vLLM makes them.

On vLLM's CPU backend with ``cpu_linear="packed"`` (or ``vllm`` sharing its packed weights,
`loader.DedupModelLoader.shares_packed`) the bytes every kernel reads are the packed
weights oneDNN allocates in ``process_weights_after_loading``, one linear layer at a time.  The
sharing pass used to meet them only after the whole model was post-processed, so for a while
the load held every packed weight twice (oneDNN's copy and the segment's), and paid a second
pass over the bytes to key them.  Staging moves each one into a segment right after its own
layer's post-processing, while the next layers are still plain:

1. the handler's packed bytes are keyed (XXH3-128, `packed.packed_key`) where they lie;
2. a packed weight equal to one staged earlier in this model (a tied head packs the embedding
   it is tied to) is compared exactly and takes that segment: no second copy;
3. otherwise they are copied once into a new sealed memfd (`HostSegment.from_bytes`; a large
   one chunk by chunk, Note [moving a packed weight]) and
   the handler is pointed at its read-only mapping (`onednn.install`), which frees oneDNN's
   buffer at once; a linear layer's copy runs beside the next layer's post-processing (Note
   [one copy in flight]).

So the load holds at most two layers' packed weights twice, never the model's; a large one
(Note [moving a packed weight]) not even that.  The staged
segments are this engine's own and not yet published: the sharing pass then acquires their
keys like any other, maps another engine's copy where one is resident (compared exactly, and
the staged segment is dropped), and publishes the staged segment itself otherwise, with no
copy and no second hashing pass (`share.SharingPass`).

Staging never stops a load: a handler whose packed weight cannot be found or replaced, or a
segment that cannot be made, stays as vLLM made it and the sharing pass takes it as before.
It runs on the host backend only; CUDA segments come in 2 MiB granules that the sharing pass
packs (`segments.packing`), and vLLM's GPU kernels read plain parameters.

Note [why the packed bytes are copied once]
    oneDNN allocates a handler's packed buffer itself (``posix_memalign``) and offers no
    allocator hook, so the bytes cannot be born in a memfd; anonymous pages cannot become a
    memfd's either.  One copy per layer, right after packing while the bytes are warm, is the
    least that is left.  (``patches/0005`` lets a handler read a caller's buffer, as
    `onednn.install` does; a handler is still made by packing into oneDNN's own.)  Packing
    into the memfd itself was measured and is no faster: vLLM makes the handler from a
    zero-page placeholder, and oneDNN's own reorder (``dnnl_reorder_primitive_desc_create``
    and ``dnnl_primitive_execute``, from the library's symbol table, with the handler's
    memory descriptor) writes the real weight into a writable memfd mapping.  The bytes
    equal vLLM's for every shape tried, bfloat16 and float32, but 16 linear weights of the
    1.2B model (0.35 GB, one thread) took 0.47-0.51 s that way against 0.41-0.47 s packed
    and copied: the kernel allocating shmem pages is the cost either way, and the copy
    keeps the packing's writes in pages the heap already has.  Copying into the memfd the
    dropped plain weight was loaded in (linear weights loaded in place too, each memfd
    claimed before its layer's post-processing and written once vLLM dropped the weight)
    was built and measured as well: the copy then allocates no pages, but the weight
    loaders fault a memfd's pages instead of anonymous ones, which costs more per page (0.37
    against 0.25 s per GiB here), while ``pwrite`` into a new memfd allocates pages without
    zeroing them.  The 1.2B model's first engine, six rounds side by side: 4.35 s and 7.24 s
    of CPU time with it, 4.40 s and 7.45 s without (plain 3.11 s), within this VM's noise.
    Not kept.

Note [one copy in flight]
    Copying a packed weight into a memfd is mostly the kernel allocating and filling shmem
    pages (``pwrite``, the GIL released), which vLLM's packing of the next layer neither
    reads nor waits for.  So a linear layer's copy and install run in one worker thread while
    the load goes on with the next layer, and the next layer's staging waits for it once it
    has keyed its own bytes, before it looks for a twin: one copy in flight at a time, adopted
    in layer order, and a twin (a tied head) always finds the segment it would share.  (A
    module without a packed weight to stage waits for nothing: the heap may be trimmed
    meanwhile, which touches only free blocks.)  Nothing runs the handler meanwhile (vLLM runs none
    before post-processing ends); the install frees oneDNN's buffer from the worker, and
    glibc returns it to the heap it came from.  One exception: vLLM's deferred attention pass,
    after the linear layers', may run a linear layer's handler (MLA's
    ``get_and_maybe_dequant_weights`` of a quantized ``kv_b_proj``, through its
    ``quant_method.apply``): the copy in flight ends before each such layer
    (`before_post_processing`).  A module that keeps the weight it packs (an
    embedding) is staged in the load's own thread, its chunks too (Note [moving a packed
    weight]): it is the load's peak moment.  `finish` waits for the last copy when
    post-processing ends (`loader._UsualLoad`).  More copies in flight were measured and not
    kept (1.2B model, first engine, five rounds each, alternating, 2026-11-27): two copies
    queued for the one worker took 4.13 s against 4.22 s for one (plain 3.38 s) and held
    92 MB more at the peak; two or three queued for two workers took 4.37 and 4.99 s against
    4.59 s for one (plain 3.28 s), all within single rounds' spread (3.9 to 5.3 s).

Note [the heap while staging]
    Post-processing runs inside `heap.reused_heap`, where glibc keeps every freed block for
    reuse.  In a plain load each layer frees its plain weight and allocates its packed one:
    the heap stays level.  Staging also frees oneDNN's buffer, so each layer leaves a block
    more than the next one takes, and the free blocks (resident, counted in the peak) would
    grow by a plain weight per layer, up to the model's size.  Every `_TRIM_EVERY_BYTES` of
    buffers freed into the heap, `heap.trim` gives the free pages back: the layers in between
    still reuse each other's blocks, and the growth stays bounded.

Note [moving a packed weight]
    A vocabulary embedding's packed weight (hundreds of MB) is staged first, while every plain
    weight is still loaded: the moment of a plain load's peak.  Copying it whole would add its
    size to that peak.  So a packed weight of at least `heap.MAPPED_BLOCK_BYTES` of a module
    that keeps the weight it packs (an embedding, a head) is copied in chunks, and each chunk's
    whole pages are given back (`heap.drop_pages`) as soon as the memfd holds them: the copy
    adds one chunk.  Nobody reads the buffer meanwhile (the handler is only used after
    post-processing); until `onednn.install` points the handler at the segment, any failure
    copies the bytes back from the memfd first, so the handler never reads a dropped page.
    A linear layer's packing is made as vLLM drops its plain weight, so copying it whole
    holds no more than vLLM's own post-processing of the layer held a moment before; its
    buffer, whatever its size, then goes back to glibc's heap (`heap.reused_heap` with large
    blocks, Note [large blocks from the heap]), which hands its pages to the next layer's
    packing: dropping them would only fault them in again.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import PackedWeightError, SegmentError, SharedWeightsError
from ..log import init_logger
from ..segments.host import SEGMENT_MEMFD_NAME, HostSegment, seal, write_all
from . import onednn
from .heap import MAPPED_BLOCK_BYTES, PAGE_BYTES, drop_pages, trim
from .packed import PackedSlot, packed_and_dropped, packed_key

__all__ = ["Staged", "Staging"]

logger = init_logger(__name__)

_CHUNK_BYTES = 16 << 20  # Note [moving a packed weight]: what the copy of a large buffer adds
_TRIM_EVERY_BYTES = 128 << 20  # Note [the heap while staging]


@dataclass
class Staged:
    """One handler's packed weight, moved into a segment during post-processing.

    Attributes:
        module: the qualified name of the module holding the handler.
        handler: vLLM's ``CPUDNNLGEMMHandler``.
        key: its content key (Note [a packed weight's content key] in `packed.py`), as a string.
        segment: the `HostSegment` holding the bytes; shared with an earlier `Staged` of equal
            bytes (``owner`` False).
        tensor: a uint8 tensor over the segment's read-only mapping, installed in the handler.
        owner: whether this entry made ``segment`` (the others reuse it).
    """

    module: str
    handler: object
    key: str
    segment: HostSegment
    tensor: object
    owner: bool


class Staging:
    """The packed weights one usual load moves into segments (module docstring).

    Args:
        min_bytes: packed weights smaller than this stay with oneDNN (``min_tensor_bytes``).
        device_key: the segments' device key (``"cpu"``).
        colliding: maps a list of `ContentKey` to the keys used (the sharing pass's test hook
            that forces collisions; identity otherwise).

    Attributes:
        staged: every `Staged` entry, in the order the layers were post-processed.
        created_bytes: bytes of the segments made here and not dropped yet (live; the load
            meter samples it).
        failures: the first few reasons a packed weight stayed with oneDNN.
    """

    def __init__(self, min_bytes: int, device_key: str = "cpu", colliding=None):
        self.min_bytes, self.device_key = min_bytes, device_key
        self.colliding = colliding or (lambda keys: keys)
        self.staged: list[Staged] = []
        self.created_bytes = 0
        self.failures: list[str] = []
        self._by_key: dict[str, Staged] = {}  # key -> the entry owning a segment of those bytes
        self._freed_since_trim = 0  # bytes of oneDNN buffers freed into the heap since the last trim
        self._copier: ThreadPoolExecutor | None = None  # Note [one copy in flight]
        self._no_thread = False  # no worker could be started: copies run in the load's thread
        self._in_flight = None  # (future, module name, handler, key, bytes) of the copy running

    def before_post_processing(self, name: str, module) -> None:
        """Called right before ``module``'s post-processing: before an attention layer's
        deferred one, which may run a handler, the copy in flight ends (Note [one copy in
        flight]).  Raises only `_finish_copy`'s SharedWeightsError."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        if is_deferred_attention_layer(module):
            self._finish_copy()

    def after_post_processing(self, name: str, module) -> None:
        """Stage every packed weight ``module`` itself holds; called right after its
        post-processing.  What cannot be staged stays with oneDNN.

        Raises:
            SharedWeightsError: a failed move could not give the handler its bytes back (the
                load must stop: `_copy_back`); nothing else.
        """
        self._stage_all(name, module)
        if self._freed_since_trim >= _TRIM_EVERY_BYTES:  # Note [the heap while staging]
            trim()
            self._freed_since_trim = 0

    def _stage_all(self, name: str, module) -> None:
        keeps_weight = not packed_and_dropped(module, "weight")  # Note [moving a packed weight]
        try:
            handlers = onednn.module_handlers(module)
        except Exception as e:  # an attribute walk that fails: the module stays with oneDNN
            if len(self.failures) < 3:
                self.failures.append(f"{name}: {type(e).__name__}: {e}")
            return
        for handler in handlers:
            try:
                self._stage(name, handler, keeps_weight)
            except (PackedWeightError, SegmentError) as e:
                if len(self.failures) < 3:
                    self.failures.append(f"{name}: {e}")
            except SharedWeightsError:  # its handler would read a wrong weight: stop the load
                raise
            except Exception as e:  # never stop a load that vLLM itself completes
                if len(self.failures) < 3:
                    self.failures.append(f"{name}: {type(e).__name__}: {e}")

    def _stage(self, name: str, handler, keeps_weight: bool = True) -> None:
        if self._in_flight is not None and self._in_flight[2] is handler:  # met again: its buffer is being freed
            self._finish_copy()
        packed = onednn.find_packed(handler)
        if packed.shared or packed.nbytes < self.min_bytes:
            return
        view = packed.view()
        (key,) = self.colliding([packed_key(packed, view)])
        key = str(key)
        self._finish_copy()  # Note [one copy in flight]: in layer order, and a twin is found
        twin = self._by_key.get(key)
        if twin is not None:
            try:  # (a handle oneDNN took, then read another from, stops the load: SharedWeightsError)
                onednn.install(packed, twin.tensor, compare=True)  # equal bytes only: else it stays
            except PackedWeightError:
                pass
            else:
                self.staged.append(Staged(name, handler, key, twin.segment, twin.tensor, owner=False))
                return
        self.created_bytes += packed.nbytes  # from now on: the meter samples it while copying
        if not keeps_weight and self._worker() is not None:  # copied beside the next layer's post-processing
            try:
                future = self._copier.submit(_copied, packed, view, False)
            except BaseException:  # the handler keeps its buffer
                self.created_bytes -= packed.nbytes
                raise
            self._in_flight = (future, name, handler, key, packed.nbytes)
            return
        moved = keeps_weight and packed.nbytes >= MAPPED_BLOCK_BYTES  # a linear layer's is copied whole
        try:
            segment, tensor = _copied(packed, view, moved)
        except BaseException:
            self.created_bytes -= packed.nbytes
            raise
        if not moved:  # its pages stay in the heap (a moved one's were given back)
            self._freed_since_trim += packed.nbytes
        self._adopt(name, handler, key, segment, tensor)

    def _worker(self) -> ThreadPoolExecutor | None:
        """The copy worker, its thread started on first use; None where no thread can be had (a
        pids limit: ``RuntimeError: can't start new thread``), and linear layers' copies then run
        in the load's own thread.  Started by a task waited for, so that a copy is never queued
        for a thread that did not start (``submit`` queues before it starts one: that copy
        would run later, unseen, and install a segment nothing records)."""
        if self._copier is None and not self._no_thread:
            copier = ThreadPoolExecutor(1, thread_name_prefix="vllm-dedup-staging")
            try:
                copier.submit(int).result()
            except RuntimeError as e:
                copier.shutdown(wait=False, cancel_futures=True)
                self._no_thread = True
                logger.info("packed weights are copied into segments in the load's own thread (%s)", e)
            else:
                self._copier = copier
        return self._copier

    def _finish_copy(self) -> None:
        """Wait for the copy in flight, if any, and adopt its segment (a failure: the handler
        keeps its own buffer, and the reason is kept in ``failures``).

        Raises:
            SharedWeightsError: the handler may read bytes nobody owns (`onednn.install`, or a
                moved buffer that could not be put back): the load stops.
        """
        if self._in_flight is None:
            return
        future, name, handler, key, nbytes = self._in_flight
        self._in_flight = None
        try:
            segment, tensor = future.result()
        except SharedWeightsError:  # the handler may read bytes nobody owns: the load stops
            raise
        except Exception as e:
            self.created_bytes -= nbytes
            if len(self.failures) < 3:
                self.failures.append(f"{name}: {type(e).__name__}: {e}")
            return
        self._freed_since_trim += nbytes  # oneDNN's buffer went back to the heap, pages and all
        self._adopt(name, handler, key, segment, tensor)

    def _adopt(self, name: str, handler, key: str, segment: HostSegment, tensor) -> None:
        entry = Staged(name, handler, key, segment, tensor, owner=True)
        self.staged.append(entry)
        self._by_key.setdefault(key, entry)

    def finish(self) -> None:
        """Wait for the copy in flight and stop the worker thread (post-processing is over).
        Idempotent; raises only `_finish_copy`'s SharedWeightsError (the thread stopped)."""
        try:
            self._finish_copy()
        finally:
            if self._copier is not None:
                self._copier.shutdown()
                self._copier = None

    def slots(self) -> list[tuple[PackedSlot, str]]:
        """The staged packed weights as the sharing pass takes them: (slot, content key), the
        entry owning each segment first among equal keys.  A handler changed since it was
        staged (it no longer reads its segment) is left out."""
        self.finish()
        out = []
        for entry in sorted(self.staged, key=lambda e: not e.owner):
            try:
                packed = onednn.find_packed(entry.handler)
            except PackedWeightError:
                continue
            if packed.address != entry.tensor.data_ptr():
                continue
            out.append((PackedSlot(entry.module, packed, entry.tensor,
                                   staged=entry.segment if entry.owner else None), entry.key))
        return out

    def release(self) -> None:
        """Let go of every staged segment: a published one lives on in the handlers that read
        it (and the registry); one that was not (another engine's copy was mapped instead) is
        freed as its last mapping goes.  Idempotent; raises only `finish`'s SharedWeightsError,
        after every descriptor is closed."""
        try:
            self.finish()
        finally:
            in_use = {id(e.segment) for e in self.staged if _reads(e)}
            for entry in self.staged:
                if entry.owner and entry.segment.fileno() >= 0:  # never published: its descriptor is still ours
                    with contextlib.suppress(OSError):
                        entry.segment.close_fd()
                    if id(entry.segment) not in in_use:  # another engine's copy took its place: freed
                        self.created_bytes -= entry.segment.size
            self.staged.clear()
            self._by_key.clear()

    def read_only(self) -> tuple[int, int]:
        """(segments, bytes) of the staged packed weights whose handler still reads its staged
        segment (read-only), each segment once (a twin reads its owner's: `keep_private` counts
        the owner's slot only), for a sharing pass that failed before it took them: they count
        as private and unpublished (`context.LoadReport.unpublished_bytes`)."""
        reading = [e for e in self.staged if e.owner and _reads(e)]
        return len(reading), sum(e.tensor.numel() for e in reading)  # uint8: one element a byte

    def summary(self) -> str:
        """One line: how many packed weights were staged, in how many segments and bytes."""
        owned = [e for e in self.staged if e.owner]
        return (f"{len(self.staged)} packed weights staged in {len(owned)} segments "
                f"({sum(e.segment.size for e in owned) / 1e6:.1f} MB)")


def _copied(packed, view: memoryview, moved: bool):
    """``packed``'s bytes (``view``) copied into a new sealed memfd segment, whole or moved
    (Note [moving a packed weight]), and installed in its handler: ``(segment, tensor over
    it)``.  Runs in the load's thread or in the staging worker (Note [one copy in flight]).

    Raises:
        SegmentError: the segment could not be made (the handler keeps its bytes).
        PackedWeightError: the install failed (the handler keeps its bytes; the segment is
            closed).
        SharedWeightsError: a moved buffer's bytes could not be put back (`_copy_back`).
    """
    import torch

    segment = _moved(packed, view) if moved else HostSegment.from_bytes(view, name=SEGMENT_MEMFD_NAME)
    try:
        tensor = segment.tensor(0, torch.uint8, (packed.nbytes,), (1,))
        # The segment was copied from these very bytes a moment ago: comparing them again
        # would be a second pass over the model for nothing.
        onednn.install(packed, tensor, compare=False)
    except BaseException:
        try:
            if moved and packed.reads_own_buffer():  # its dropped pages get their bytes back
                _copy_back(packed, segment.fileno(), packed.nbytes)
        finally:
            with contextlib.suppress(OSError):
                segment.close_fd()
        raise
    return segment, tensor


def _moved(packed, view: memoryview) -> HostSegment:
    """A new sealed memfd segment holding ``view`` (the bytes of ``packed``, a
    `onednn.PackedWeight`), whose source pages are given back as it fills (Note [moving a
    packed weight]).  On failure the source holds its bytes again.

    Raises:
        SegmentError: the memfd could not be made, filled, sealed or mapped.
    """
    nbytes, written = packed.nbytes, 0
    try:
        fd = os.memfd_create(SEGMENT_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as e:
        raise SegmentError(f"cannot create a {nbytes}-byte memfd segment: {e}") from None
    try:
        os.ftruncate(fd, nbytes)
        low = packed.address  # the first byte whose page may still hold bytes
        while written < nbytes:
            end = min(written + _CHUNK_BYTES, nbytes)
            write_all(fd, view[written:end], written)
            written = end
            drop_pages(low, packed.address + end - low)
            low = max(low, (packed.address + end) // PAGE_BYTES * PAGE_BYTES)
        seal(fd)
        return HostSegment(os.dup(fd), nbytes)  # closes that descriptor if it cannot be mapped
    except BaseException as e:
        if written:  # the pages dropped so far are in the memfd
            _copy_back(packed, fd, written)
        if isinstance(e, (OSError, SegmentError)):
            raise SegmentError(f"cannot fill a {nbytes}-byte memfd segment: {e}") from None
        raise
    finally:
        os.close(fd)


def _copy_back(packed, fd: int, nbytes: int) -> None:
    """Read the first ``nbytes`` of the memfd ``fd`` back into ``packed``'s own buffer, whose
    pages were dropped as the memfd took them (Note [moving a packed weight]).  The handler
    reads that buffer again after a failed move; if its bytes cannot be brought back, the
    load must not go on with the zeros it would read.

    Raises:
        SharedWeightsError: the bytes could not be read back (the load stops: a wrong weight
            otherwise).
    """
    source = memoryview((ctypes.c_uint8 * nbytes).from_address(packed.address))
    done = 0
    try:
        while done < nbytes:
            got = os.preadv(fd, [source[done:]], done)
            if got <= 0:
                raise OSError(f"end of the memfd at byte {done}")
            done += got
    except OSError as e:
        raise SharedWeightsError(f"a packed weight moved into shared memory could not be restored after a failed "
                                 f"move ({e}); its handler would read zeros, so the load stops (the engine "
                                 "loads again without sharing, unless on_registry_error='fail'); if it recurs, "
                                 "set cpu_linear='private' (packed weights stay private) in the dedup config") from None


def _reads(entry: Staged) -> bool:
    """Whether ``entry``'s handler still reads its staged segment; where that cannot be told
    (an error other than a layout not understood), yes: it then counts as read-only, which
    refuses writes into it (`read_only`), rather than as private."""
    try:
        return onednn.find_packed(entry.handler).address == entry.tensor.data_ptr()
    except PackedWeightError:
        return False
    except Exception:
        return True
