"""The dedup load format's configuration, read from ``--model-loader-extra-config`` JSON.

vLLM's convention: each load format takes its options as one JSON object,
``--model-loader-extra-config '{"inner_load_format": "safetensors"}'`` on the command line or
``LLM(..., model_loader_extra_config={...})`` in Python.  Options meant for the inner loader go
in ``inner_extra_config``, so the two loaders' keys can never be confused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

__all__ = ["CPU_LINEAR_MODES", "DedupConfig", "is_finite_number", "is_registry_namespace"]

CPU_LINEAR_MODES = ("packed", "plain", "private")  # DedupConfig.cpu_linear


@dataclass(frozen=True)
class DedupConfig:
    """Options of ``--load-format dedup``.

    Attributes:
        inner_load_format: the vLLM load format that reads the checkpoint (``auto``,
            ``safetensors``, ``pt``, ``runai_streamer``, ...: a name this vLLM registers).  Not
            ``dedup``.
        inner_extra_config: the inner loader's own ``model_loader_extra_config``.
        share_group: engines share only within the same group (and device).
        min_tensor_bytes: tensors smaller than this stay private (bytes).  A segment costs a
            descriptor and at least one page; norms and biases are a tiny share of the bytes.
        verify: compare the bytes exactly before mapping a shared tensor in.  Turning it off
            trusts the key alone: XXH3-128 on the CPU, but on a GPU a fingerprint of row and
            column sums (`content.fingerprint`) that a few crafted element changes collide;
            a collision would then serve wrong weights.
        on_registry_error: ``fallback`` (load privately, with a warning) or ``fail`` (stop
            the engine at start-up) when the registry cannot be reached.
        keep_warm_s: seconds a segment nobody maps stays resident, so that a restarting engine
            maps instead of loading (applies to a registry this engine starts).
        cpu_linear: how linear layers run and share on vLLM's CPU backend: ``packed`` (vLLM's
            own oneDNN kernels; the packed weights vLLM makes are what is shared, mapped in
            place of each engine's private copy, `engine.onednn`), ``plain`` (plain weights run
            by ``F.linear``, shared like any tensor; slower, and rounded unlike a plain engine
            on some CPUs), ``private`` (vLLM's oneDNN, packed weights not shared).  Where
            ``packed`` cannot work (a vLLM build without its symbol table, a handler layout not
            understood: `onednn.probe`), the engine runs ``private`` (plain vLLM's speed and
            numerics) and says why in one log line and its load report's ``private_linears``;
            where vLLM itself runs ``F.linear`` for the model's dtype (bfloat16 on AVX2),
            ``vllm``: each layer as vLLM runs it (``F.linear`` on shared weights; a float32
            router gate, which vLLM packs there, on its packed copy, shared as ``packed``
            shares them).
        cpu_share_linear: deprecated spelling: ``true`` is ``cpu_linear="plain"``, ``false``
            ``cpu_linear="private"``.
        registry_address: ``None`` (find or start one: see `registry.discovery.connect_registry`),
            ``"local"`` (standalone daemon, no Ray), or a Ray address.
        registry_namespace: the registry's Ray namespace and socket name.
        accounting: where the memory saved on a GPU goes (`engine.session`): ``kv_cache`` (a
            bigger KV cache) or ``external`` (the KV cache of a plain load; the engine's
            footprint shrinks instead, leaving room for more engines).
        startup_lock_timeout_s: seconds to wait for the GPU's start-up lock (another engine
            is profiling its memory) before starting without it (or failing, with
            ``on_registry_error="fail"``).
        fast_path: map the modules a recipe of an earlier engine matches instead of reading
            the checkpoint (`engine.fast_path`).  Nothing is compared byte for byte on that
            path: the trust is the source keys and the load signature, within a share group.
        in_place: a load that reads the checkpoint loads its tensors into segments of its own
            and publishes them where they lie, with no copy: memfds on the host
            (`engine.in_place`), packed allocations where segments come in granules (CUDA,
            `engine.in_place_packed`); ``false`` loads into private memory and copies into
            segments after post-processing.
        huge_pages: on the host, ask for 2 MiB pages for the segments a load fills in place
            (``MADV_HUGEPAGE``; Note [huge pages for segments] in `segments/host.py`).  Only
            where the machine's ``transparent_hugepage/shmem_enabled`` is ``advise`` does
            asking change anything.  Later engines then map the model in 512 times fewer
            page-table entries; the first engine pays for allocating huge pages, which on a
            VM giving free memory back to its host cost more than twice plain's load
            (README, "Huge pages").
        registry_timeout_s: seconds an engine waits for the registry: for any one reply (a
            hung or stopped registry costs one such wait, then the engine loads privately what
            it has not mapped yet), and for a registry that died mid-load to be back.
    """

    inner_load_format: str = "auto"
    inner_extra_config: dict = field(default_factory=dict)
    share_group: str = "default"
    min_tensor_bytes: int = 1 << 16
    verify: bool = True
    on_registry_error: str = "fallback"
    keep_warm_s: float = 0.0
    cpu_linear: str = "packed"
    cpu_share_linear: bool | None = None
    registry_address: str | None = None
    registry_namespace: str = "vllm-dedup"
    accounting: str = "kv_cache"
    startup_lock_timeout_s: float = 900.0
    fast_path: bool = True
    in_place: bool = True
    huge_pages: bool = False
    registry_timeout_s: float = 10.0

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> DedupConfig:
        """Parse and check ``model_loader_extra_config``.

        Raises:
            ValueError: not a JSON object, an unknown key (the message lists the valid ones),
                or a value of the wrong type.
        """
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise ValueError(
                f"--model-loader-extra-config for load format dedup must be a JSON object, "
                f"got {type(extra).__name__}"
            )
        valid = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(valid))
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join(map(repr, unknown))} in --model-loader-extra-config "
                f"for load format dedup; valid keys: {', '.join(valid)} "
                "(options for the inner loader go inside 'inner_extra_config')"
            )
        config = cls(**extra)
        if not isinstance(config.inner_load_format, str) or not config.inner_load_format.strip():
            raise ValueError(f"inner_load_format must be a load format name, got {config.inner_load_format!r}")
        # vLLM's names are lower case; the fast path and the load signature compare them as given.
        config = replace(config, inner_load_format=config.inner_load_format.strip().lower())
        if config.inner_load_format == "dedup":
            raise ValueError("inner_load_format cannot be 'dedup' itself; use 'auto' or another vLLM load format")
        if not isinstance(config.inner_extra_config, dict):
            raise ValueError(
                f"inner_extra_config must be a JSON object, got {type(config.inner_extra_config).__name__}"
            )
        from .registry.messages import MAX_STRING  # (wire.py imports this module)

        c = config
        checks = [  # (key, value is valid, what it must be)
            ("share_group", isinstance(c.share_group, str) and 0 < len(c.share_group) <= MAX_STRING,
             f"a non-empty string of at most {MAX_STRING} characters"),
            ("min_tensor_bytes", is_finite_number(c.min_tensor_bytes, int) and c.min_tensor_bytes >= 0,
             "an integer >= 0 (bytes)"),
            ("verify", isinstance(c.verify, bool), "true or false"),
            ("on_registry_error", c.on_registry_error in ("fallback", "fail"), "'fallback' or 'fail'"),
            ("keep_warm_s", is_finite_number(c.keep_warm_s) and c.keep_warm_s >= 0,
             "a finite number >= 0 (seconds)"),
            ("cpu_linear", c.cpu_linear in CPU_LINEAR_MODES, "'packed', 'plain' or 'private'"),
            ("cpu_share_linear", c.cpu_share_linear is None or isinstance(c.cpu_share_linear, bool),
             "true or false (deprecated: use cpu_linear)"),
            ("registry_address", c.registry_address is None or (
                isinstance(c.registry_address, str) and c.registry_address.strip() == c.registry_address != ""
                and (c.registry_address == "local" or c.registry_address.lower() != "local")),
             "null, 'local' (lower case) or a Ray address ('auto', 'host:port', 'ray://host:port'), without spaces"),
            ("registry_namespace", is_registry_namespace(c.registry_namespace),
             "a name of letters, digits, '-', '_' and '.' (it names the registry's socket file)"),
            ("accounting", c.accounting in ("kv_cache", "external"), "'kv_cache' or 'external'"),
            ("startup_lock_timeout_s", is_finite_number(c.startup_lock_timeout_s) and c.startup_lock_timeout_s > 0,
             "a finite number > 0 (seconds)"),
            ("fast_path", isinstance(c.fast_path, bool), "true or false"),
            ("in_place", isinstance(c.in_place, bool), "true or false"),
            ("huge_pages", isinstance(c.huge_pages, bool), "true or false"),
            ("registry_timeout_s", is_finite_number(c.registry_timeout_s) and 0 < c.registry_timeout_s <= 3600,
             "a number of seconds > 0 and <= 3600"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(c, name)!r}")
        if c.cpu_share_linear is not None:
            if "cpu_linear" in extra:
                raise ValueError("give cpu_linear alone: cpu_share_linear is its deprecated spelling")
            config = replace(config, cpu_linear="plain" if c.cpu_share_linear else "private", cpu_share_linear=None)
        return config


def is_registry_namespace(name) -> bool:
    """Whether ``name`` can name a registry: letters, digits, '-', '_' and '.', not dots alone
    (it names the registry's socket file, `registry.wire.socket_path`)."""
    return isinstance(name, str) and name.replace("-", "").replace("_", "").replace(".", "").isalnum()


def is_finite_number(value, kinds=(int, float)) -> bool:
    """Whether ``value`` is a finite number of ``kinds``; JSON's true and false are not (Python's
    bools are ints), nor infinity (vLLM's ``json.loads`` reads ``1e999`` and ``Infinity`` as
    ``inf``: a registry kept warm forever could not even encode its stats), nor an integer past
    a float's range (``10**400``: ``time.monotonic() + timeout`` would raise ``OverflowError``)."""
    if not isinstance(value, kinds) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
