"""One ``load_model`` call, as the engine side sees it: what it knows before loading
(`LoadContext`) and what it did (`LoadReport`).

The loader builds one `LoadContext` per call (configs, device, device key, load signature,
the registry lease) and hands it to every step: the fast path's decision, building from a
recipe, the usual load, sharing, the recipe left behind.  The steps fill one `LoadReport`,
which the engine reports to the registry and logs.  Nothing crosses between steps through
attributes of the loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .handlers import HandlerRecord

__all__ = ["LoadContext", "LoadReport", "Placement"]


@dataclass(frozen=True)
class Placement:
    """Where a tensor bound in the model lives: its content ``key`` in the segment ``uid``."""

    key: str
    uid: str


@dataclass
class LoadContext:
    """What one load knows before it loads (module docstring).

    Attributes:
        config: the load format's options (`config.DedupConfig`).
        lease: this engine's registry connection (`registry.lease.Lease`, or a bare
            `registry.client.RegistryClient` in tests).
        device: the torch device the weights live on.
        device_key: the registry's name of that device (`segments.Segment.device_key`).
        signature: the load signature (`signature.load_signature`); empty outside vLLM.
        vllm_config, model_config, prefix: as vLLM passes them to ``load_model`` (None in
            tests that share a plain ``nn.Module``).
        create_model: builds the model under the current default device (the loader's
            ``create_model`` for this call); None outside vLLM.
        share_packed: share the packed weights of vLLM's oneDNN handlers too (CPU backend,
            ``cpu_linear="packed"``, or ``vllm`` where it can: `packed.py`,
            `loader.DedupModelLoader.shares_packed`).
        handlers: the oneDNN handlers this load created, recorded where vLLM made them, with
            the tensors they read through raw pointers (`handlers.recorded_handlers`).
    """

    config: object
    lease: object
    device: object
    device_key: str
    signature: str = ""
    vllm_config: object = None
    model_config: object = None
    prefix: str = ""
    create_model: Callable[[], object] | None = None
    share_packed: bool = False
    handlers: HandlerRecord = field(default_factory=HandlerRecord)

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def model_name(self) -> str:
        return str(getattr(self.model_config, "model", "model"))

    @property
    def failures_stop_the_engine(self) -> bool:
        """Whether a failure inside vllm-dedup stops the engine (``on_registry_error="fail"``)."""
        return self.config.on_registry_error == "fail"


@dataclass
class LoadReport:
    """What one engine's load did, in tensors and bytes (what it reports to the registry).

    ``load_path``: ``full`` (every module mapped from a recipe), ``modules`` (some mapped, the
    others loaded), ``none`` (loaded, then shared).  ``placement`` (``id`` of a tensor bound in
    the model -> its `Placement`) is for the recipe, not reported.
    """

    shared_tensors: int = 0  # mapped from another engine's segment
    shared_bytes: int = 0
    published_tensors: int = 0  # moved into a new segment of this engine's
    published_bytes: int = 0
    private_tensors: int = 0
    private_bytes: int = 0
    collisions: int = 0  # equal keys, different bytes: caught by the exact compare
    packed_tensors: int = 0  # of the shared and published: oneDNN packed weights (`packed.py`)
    padding_bytes: int = 0  # bytes of the segments this engine created that hold no tensor
    share_seconds: float = 0.0  # wall time of the sharing pass
    load_path: str = "none"
    checkpoint_bytes_read: int = 0
    load_seconds: float = 0.0  # wall time of load_model
    peak_bytes: int = 0  # `meter.LoadMeter.peak_bytes`
    created_bytes: int = 0  # segments the sharing pass made (live: the load meter samples it)
    unpublished_bytes: int = 0  # private, yet read-only: sealed where they lie for a publish that failed
    private_linears: str = ""  # oneDNN linears that keep private packed copies, and why ("" when none)
    errors: list[str] = field(default_factory=list)
    placement: dict[int, Placement] = field(default_factory=dict, repr=False)

    @property
    def segment_bytes(self) -> int:
        """Bytes of this engine's tensors that live in segments, read-only: shared with other
        engines, or sealed for them (`share.SharingPass.adopt_published`)."""
        return self.shared_bytes + self.published_bytes + self.unpublished_bytes

    def figures(self) -> dict:
        """The figures the registry keeps (numbers and the load path)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, (int, float, str))}

    def summary(self) -> str:
        mb = 1e6
        return (
            f"load_path={self.load_path}, {self.checkpoint_bytes_read / mb:.1f} MB of checkpoint read, "
            f"load {self.load_seconds:.2f} s, peak +{self.peak_bytes / mb:.1f} MB; "
            f"{self.shared_tensors} tensors / {self.shared_bytes / mb:.1f} MB shared, "
            f"{self.published_tensors} / {self.published_bytes / mb:.1f} MB published, "
            f"{self.private_tensors} / {self.private_bytes / mb:.1f} MB private "
            f"({self.packed_tensors} of the shared and published are oneDNN packed weights), "
            f"{self.collisions} collisions, {self.padding_bytes / mb:.1f} MB padding, sharing {self.share_seconds:.2f} s"
        )
