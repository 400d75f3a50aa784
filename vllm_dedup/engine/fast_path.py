"""One engine's use of recipes: whether it can map instead of loading, and the recipe it leaves
for the next engine (docs/architecture.md, "Loading only what is not resident").

`FastPath` is made per load by the loader.  `build` fetches the recipes of the engine's load
signature, learns the checkpoint's source keys from the manifest cache (hashing a file the cache
does not know: its bytes are read, never loaded), chooses the recipe that maps the most, and
builds the model from it (`mapped.MappedBuild`).  Without a usable recipe the loader loads as
usual with a `sources.SourceRecorder` from `recorder_for_usual_load`, and `after_usual_load`
writes the manifests of the files it hashed.  `give_recipe` then records what this load did.

The fast paths apply to local model folders of safetensors files read by vLLM's default loader
(load formats ``auto``, ``safetensors``, ``hf``), without expert parallelism; everything else
loads as usual, and still shares.
"""

from __future__ import annotations

import logging

from ..errors import CheckpointError, RegistryUnavailable, SegmentError
from ..scan.manifest import FileIdentity, ManifestCache, default_cache_dir
from ..scan.readers import SafetensorsFile
from .mapped import FallBack, MappedBuild
from .recipe import Recipe, build_recipe, choose, model_attrs
from .sources import SourceRecorder, checkpoint_files, checkpoint_keys, write_manifests

__all__ = ["FastPath"]

logger = logging.getLogger("vllm.dedup")

FORMATS = ("auto", "safetensors", "hf")  # inner load formats whose files `sources.read_tensors` reads
INLINE_MAX = 1 << 20  # bytes: private tensors up to this size travel inside a recipe


class FastPath:
    """Recipes for one load (module docstring).

    Attributes:
        usable: the fast paths may apply to this load at all.
        path: ``full``, ``modules`` or ``none`` (the loader's report).
        bytes_read: checkpoint bytes read (hashed or loaded).
        mapped: ``id`` of each tensor bound from a segment by a recipe -> its content key.
    """

    def __init__(self, loader, vllm_config, model_config, client, device, device_key: str, signature: str):
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        self.loader, self.vllm_config, self.model_config = loader, vllm_config, model_config
        self.client, self.device, self.device_key, self.signature = client, device, device_key, signature
        self.config = loader.config
        self.cache = ManifestCache(default_cache_dir())
        self.path, self.bytes_read, self.mapped = "none", 0, {}
        self.files = None
        self.recorder: SourceRecorder | None = None
        self._build: MappedBuild | None = None
        self._checkpoint: dict[str, str] | None = None
        self._attrs_before: dict = {}
        why = None
        if not self.config.fast_path:
            why = "fast_path is off"
        elif not isinstance(loader.inner, DefaultModelLoader) or self.config.inner_load_format not in FORMATS:
            why = f"inner load format {self.config.inner_load_format!r} has no recipes"
        elif vllm_config.parallel_config.enable_expert_parallel:
            why = "expert parallelism filters the checkpoint per rank"
        else:
            self.files = checkpoint_files(model_config.model)
            why = None if self.files else "not a local folder of safetensors files"
        self.usable, self.why = why is None, why or ""

    # the fast paths --------------------------------------------------------------------------
    def build(self, prefix: str):
        """The model built from the best recipe, or None (then: load as usual)."""
        import torch

        from ..segments import segment_class

        try:
            raw = self.client.get_recipes(self.signature)
            recipes = [Recipe.from_bytes(data) for data in raw]
        except (RegistryUnavailable, SegmentError, ValueError) as e:
            return self._decline(f"the registry's recipes cannot be read ({e})")
        if not recipes:
            return self._decline("no recipe for this load signature yet")
        try:
            self._checkpoint, where, hashed = checkpoint_keys(self.files, self.cache)
        except (CheckpointError, OSError) as e:
            return self._decline(f"the checkpoint's keys cannot be had ({e})")
        self.bytes_read += hashed
        match, why = choose(recipes, self._checkpoint)
        if match is None:
            return self._decline(why)
        build = MappedBuild(self.loader, self.vllm_config, self.model_config, prefix, self.client,
                            segment_class(self.device.type), self.device_key, torch.device(self.device), match, where)
        try:
            model = build.build()
        except FallBack as e:
            return self._decline(f"the recipe could not be used ({e})")
        self._build, self.mapped, self.bytes_read = build, build.placement, self.bytes_read + build.bytes_read
        self.client.keep_recipe(raw[recipes.index(match.recipe)])  # given again to a registry that comes back
        self.path = "modules" if match.unmatched else "full"
        if match.unmatched:
            first, reason = sorted(match.unmatched.items())[0]
            logger.info("vllm-dedup: %s: a recipe maps %d of %d modules (%.1f MB); %d loaded from the checkpoint "
                        "(%s: %s)", self.model_config.model, len(match.matched), len(match.recipe.modules),
                        build.mapped_bytes / 1e6, len(match.unmatched), first, reason)
        else:
            logger.info("vllm-dedup: %s: a recipe maps every module (%.1f MB); no checkpoint tensor read",
                        self.model_config.model, build.mapped_bytes / 1e6)
        return model

    def _decline(self, why: str):
        self.why = why
        logger.info("vllm-dedup: %s: loading from the checkpoint: %s", self.model_config.model, why)
        return None

    # the usual load, recorded ------------------------------------------------------------------
    def recorder_for_usual_load(self) -> SourceRecorder | None:
        """A recorder for the loader's usual load (None when no recipe can come of it).  The
        files' identities are taken now, before any byte is read."""
        if self.files is None or not self.config.fast_path:
            return None
        self._identities = {}
        for path in self.files:
            try:
                with SafetensorsFile(path) as f:
                    self._identities[path] = FileIdentity.of(path, f.header())
            except (CheckpointError, OSError):
                return None
        self.recorder = SourceRecorder(hash_keys=True)
        return self.recorder

    def after_usual_load(self, attrs_before: dict) -> None:
        """Collect the keys the recorder hashed; store the manifests of fully hashed files."""
        if self.recorder is None:
            return
        self._keys = self.recorder.finish()
        self._attrs_before = attrs_before
        self.bytes_read += self.recorder.bytes_read
        write_manifests(self.files, self._identities, self._keys, self.cache)

    # the recipe left behind ----------------------------------------------------------------------
    def give_recipe(self, model, result) -> None:
        """Give the registry the recipe of this load (a full mapping changes nothing)."""
        if self.path == "full":
            return
        if self.path == "modules":
            build, match = self._build, self._build.match
            sources, recorder = self._checkpoint, build.recorder
            inherited = {m: match.recipe.modules[m] for m in match.matched}
            attrs_before = {k: v for k, v in model_attrs(model).items() if k not in match.recipe.attrs}
        elif self.recorder is not None and not self.recorder.unhashable:
            recorder, inherited, attrs_before = self.recorder, {}, self._attrs_before
            sources = {n: self._keys[n] for n in recorder.consumed}
        else:
            return
        recipe = build_recipe(model, self.signature, sources, recorder.module_sources, recorder.unrecorded,
                              result.placement, min(self.config.min_tensor_bytes, INLINE_MAX), attrs_before, inherited)
        try:
            self.client.put_recipe(recipe.to_bytes())
        except (RegistryUnavailable, SegmentError) as e:
            logger.warning("vllm-dedup: %s: the recipe of this load was not kept (%s); the next engine loads as "
                           "usual", self.model_config.model, e)
