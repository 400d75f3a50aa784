"""One load's use of recipes (docs/architecture.md, "Loading only what is not resident"):

- `decide`: whether a recipe of the engine's load signature lets this load map instead of
  loading, and which (a `Decision`).  It learns the checkpoint's source keys from the manifest
  cache, hashing a file the cache does not know (its bytes are read, never loaded);
- `RecordedLoad`: the usual load, recorded (`sources.SourceRecorder`), when no recipe applies;
  it writes the manifests of the files it hashed;
- `leave_recipe`: the recipe of what this load did, given to the registry for the next engine.

The fast paths apply to local model folders of safetensors files read by vLLM's default loader
(load formats ``auto``, ``safetensors``, ``hf``), without expert parallelism; everything else
loads as usual, and still shares.  None of these steps raises out of a load: each failure is
one log line, and the load goes on without the fast path (or without leaving a recipe).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.loading import changed_files, checkpoint_files, checkpoint_keys, write_manifests
from ..checkpoint.manifest import FileIdentity, ManifestCache, default_cache_dir, settled
from ..checkpoint.readers import SafetensorsFile
from ..errors import CheckpointError, RegistryUnavailable, SegmentError
from ..log import init_logger
from .context import LoadContext, LoadReport
from .recipe import Match, Recipe, choose
from .recipe_builder import build_recipe, model_attrs
from .sources import SourceRecorder

__all__ = ["Decision", "RecordedLoad", "decide", "fast_path_files", "leave_recipe"]

logger = init_logger(__name__)

FORMATS = ("auto", "safetensors", "hf")  # inner load formats whose files `sources.read_tensors` reads
INLINE_MAX = 1 << 20  # bytes: private tensors up to this size travel inside a recipe


@dataclass
class Decision:
    """What `decide` found: a match to build from, or why not.

    Attributes:
        match: the recipe's match, or None (load as usual).
        why: why not, or "" when there is a match.
        checkpoint: the checkpoint's tensor name -> source key (when they could be had).
        where: tensor name -> its file.
        recipe_bytes: the chosen recipe as the registry gave it (kept by the lease, to give a
            registry that comes back).
        bytes_hashed: checkpoint bytes read to learn source keys the cache did not have.
        identities: each file's identity that ``checkpoint`` describes (a replay that loads
            modules checks it again before leaving a recipe: `leave_recipe`).
    """

    match: Match | None = None
    why: str = ""
    checkpoint: dict[str, str] | None = None
    where: dict = field(default_factory=dict)
    recipe_bytes: bytes = b""
    bytes_hashed: int = 0
    identities: dict = field(default_factory=dict)


def fast_path_files(ctx: LoadContext, inner) -> tuple[list[Path] | None, str]:
    """The checkpoint files the fast paths would use for this load, or (None, why not).

    Args:
        ctx: the load.
        inner: the inner vLLM loader.
    """
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    config = ctx.config
    if not config.fast_path:
        return None, "fast_path is off"
    if not isinstance(inner, DefaultModelLoader) or config.inner_load_format not in FORMATS:
        return None, f"inner load format {config.inner_load_format!r} has no recipes"
    if ctx.vllm_config.parallel_config.enable_expert_parallel:
        return None, "expert parallelism filters the checkpoint per rank"
    if config.inner_load_format == "auto" and any(Path(ctx.model_config.model).glob("consolidated*.safetensors")):
        # vLLM's auto format then reads the Mistral layout (DefaultModelLoader._prepare_weights:
        # consolidated*.safetensors, other names, q/k permuted), not the HF files beside it.
        return None, "a Mistral-format folder (consolidated*.safetensors), which vLLM reads in place of its HF files"
    files = checkpoint_files(ctx.model_config.model)
    return (files, "") if files else (None, "not a local folder of safetensors files")


def decide(ctx: LoadContext, files: list[Path], cache: ManifestCache | None = None) -> Decision:
    """The recipe that maps the most of this checkpoint, and its match (module docstring).
    Never raises: every failure is a `Decision` without a match, saying why.

    The registry keeps up to 8 recipes of a signature, each up to 64 MiB of JSON, and a parsed
    recipe is several times its JSON: they are parsed and matched one at a time, keeping only
    the best so far (`recipe.choose`'s order: the most bytes mapped, the newest of equals)."""
    cache = cache or ManifestCache(default_cache_dir())
    decision = Decision()
    try:
        raw = ctx.lease.get_recipes(ctx.signature)
    except (RegistryUnavailable, SegmentError) as e:
        decision.why = f"the registry's recipes cannot be read ({e})"
        return decision
    why = "no recipe for this load signature yet"
    for i in range(len(raw)):
        data, raw[i] = raw[i], b""  # gone with its recipe unless it is the best
        try:
            recipe = Recipe.from_bytes(data)
        except ValueError as e:
            why = f"a recipe cannot be read ({e})"
            continue
        if recipe.signature != ctx.signature:  # the registry files recipes by what their writer said
            why = "a recipe the registry gave is of another load signature"
            continue
        if decision.checkpoint is None:  # read once, for the first recipe worth matching
            try:
                decision.checkpoint, decision.where, decision.bytes_hashed, decision.identities = \
                    checkpoint_keys(files, cache)
            except (CheckpointError, OSError) as e:
                decision.why = f"the checkpoint's keys cannot be had ({e})"
                return decision
        found, declined = choose([recipe], decision.checkpoint)
        del recipe
        if found is None:
            why = declined
        elif decision.match is None or found.mapped_bytes > decision.match.mapped_bytes:
            decision.match, decision.recipe_bytes = found, data
    decision.why = "" if decision.match is not None else why
    return decision


class RecordedLoad:
    """The usual load of a checkpoint that may leave a recipe: its files' identities (taken
    before any byte is read), the `sources.SourceRecorder` the loader's ``load_weights`` runs
    under, and the model's attributes before loading.

    Args:
        files: the checkpoint's safetensors files (`fast_path_files`).
        cache: the manifest cache to write.

    Raises:
        CheckpointError, OSError: a file cannot be read (then no recipe can come of the load).
    """

    def __init__(self, files: list[Path], cache: ManifestCache | None = None):
        self.files, self.cache = files, cache or ManifestCache(default_cache_dir())
        self.identities = {}
        known: dict[str, str] = {}  # keys the manifest cache has: not hashed again while loading
        self.cached: list[Path] = []
        self.taken_ns = time.time_ns()  # before the identities: Note [racily clean files]
        for path in files:
            with SafetensorsFile(path) as f:
                self.identities[path] = FileIdentity.of(path, f.header(), f.descriptor())
            manifest = self.cache.get(self.identities[path])
            if manifest is not None:
                self.cached.append(path)
                known.update((e.name, str(k)) for e, k in zip(manifest.entries, manifest.keys))
        self.recorder = SourceRecorder(hash_keys=True, known=known)
        self.attrs_before: dict = {}
        self.keys: dict[str, str] = {}

    def finish(self) -> None:
        """Collect the keys; store the manifests of files hashed in full.  A file whose
        identity changed during the load, whether its keys came from the cache or were hashed
        now, leaves no keys: the loader's tensors are views of the file's pages, hashed at one
        moment and copied at another, so what the model got may be neither version, and no
        recipe may say it came from those keys.  Nor does a file changed too shortly before the
        load for a later write to show in its identity (`manifest.settled`)."""
        self.keys = self.recorder.finish()
        changed = changed_files(self.identities) or [p for p in self.files
                                                     if not settled(self.identities[p], self.taken_ns)]
        if changed:
            logger.warning("%s changed during the load (or just before it); this load leaves no recipe", changed[0])
            self.recorder.unhashable.extend(map(str, changed))
            self.keys = {}
        uncached = [p for p in self.files if p not in self.cached]
        write_manifests(uncached, self.identities, self.keys, self.cache, self.taken_ns)


def leave_recipe(ctx: LoadContext, model, report: LoadReport, recorded: RecordedLoad | None = None,
                 replay=None, decision: Decision | None = None) -> None:
    """Give the registry the recipe of this load: of a recorded usual load, or of a partial
    replay (its loaded modules recorded, the mapped ones taken over).  A full replay changes
    nothing and leaves none.  Never raises: a recipe that cannot be made or kept is one
    warning, and the next engine loads as usual."""
    try:
        if replay is not None:
            if not decision.match.unmatched:
                return
            match = decision.match
            changed = changed_files(decision.identities)
            if changed:  # the modules loaded may hold bytes the keys taken before do not describe
                logger.warning("%s: %s changed during the load; this load leaves no recipe", ctx.model_name,
                               changed[0])
                return
            sources, recording = decision.checkpoint, replay.recorder
            inherited = {m: match.recipe.modules[m] for m in match.matched}
            attrs_before = {k: v for k, v in model_attrs(model).items() if k not in match.recipe.attrs}
        elif recorded is not None and not recorded.recorder.unhashable:
            recording, inherited, attrs_before = recorded.recorder, {}, recorded.attrs_before
            sources = {n: recorded.keys[n] for n in recording.consumed}
        else:
            return
        recipe = build_recipe(model, ctx.signature, sources, recording, report.placement,
                              min(ctx.config.min_tensor_bytes, INLINE_MAX), attrs_before, inherited)
        try:
            data = recipe.checked_bytes()
        except ValueError as e:
            logger.warning("%s: the recipe of this load is not kept: a reader would refuse it (%s); the next "
                           "engine loads as usual", ctx.model_name, e)
            return
        ctx.lease.put_recipe(data)
    except (RegistryUnavailable, SegmentError) as e:
        logger.warning("%s: the recipe of this load was not kept (%s); the next engine loads as "
                       "usual", ctx.model_name, e)
    except Exception as e:  # building a recipe must never stop an engine that loaded
        logger.warning("%s: no recipe could be made of this load (%s: %s); the next engine loads as "
                       "usual", ctx.model_name, type(e).__name__, e)
