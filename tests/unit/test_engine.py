"""The engine side on a tiny ``nn.Module``, no vLLM engine: tied weights through collect and
swap, source attribution and what makes a module untraced, recipes built from a load and
matched against changed checkpoints (what is mapped, what is loaded, what is declined), and
the load signature's inputs.  Real engines run these paths in tests/e2e/test_fast_path.py and
tests/e2e/test_zoo.py."""

from __future__ import annotations

import contextlib
import json
import types

import pytest
import torch
from torch import nn

from vllm_dedup.content.keys import ContentKey
from vllm_dedup.content.views import dtype_name
from vllm_dedup.engine.context import Placement
from vllm_dedup.engine.recipe import Recipe, RecipeDeclined, choose, match
from vllm_dedup.engine.recipe_builder import build_recipe
from vllm_dedup.engine.slots import attribute_tensors, collect_slots, swap
from vllm_dedup.engine.sources import SourceRecorder, write_witness


def default_loader(param, loaded):
    param.data.copy_(loaded)


def stacked_loader(param, loaded, shard: int):
    param.data[shard * 2:(shard + 1) * 2].copy_(loaded)


class Tiny(nn.Module):
    """embed (tied to head), a stacked ``qkv`` fed by q and k, an MLM-like ``decoder`` whose
    weight loading copies from the embedding, and a norm."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv, self.head, self.decoder, self.norm = (nn.Module() for _ in range(5))
        self.embed.weight = nn.Parameter(torch.empty(8, 4), requires_grad=False)
        self.head.weight = self.embed.weight
        self.qkv.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)
        self.decoder.weight = nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.decoder.bias = nn.Parameter(torch.empty(8), requires_grad=False)
        self.norm.weight = nn.Parameter(torch.empty(4), requires_grad=False)
        for p in (self.embed.weight, self.decoder.bias, self.norm.weight, self.decoder.weight):
            p.weight_loader = default_loader
        self.qkv.weight.weight_loader = stacked_loader

    def load_weights(self, weights, copy_decoder: bool = True, transform: str = "", by: str = ""):
        """``transform``: the bias's weight loader gets a copy made by torch ("clone") or through
        Python ("python"); ``by``: this tensor is copied into its parameter by hand."""
        for name, t in weights:
            if name in ("q", "k"):
                self.qkv.weight.weight_loader(self.qkv.weight, t, ["q", "k"].index(name))
            else:
                param = {"embed": self.embed.weight, "bias": self.decoder.bias, "norm": self.norm.weight,
                         "dec": self.decoder.weight}[name]
                if name == "bias" and transform == "clone":  # a copy made by torch: its provenance is traced
                    t = t.clone()
                elif name == "bias" and transform == "python":  # values through Python: no provenance
                    t = torch.tensor(t.tolist())
                param.weight_loader(param, t) if name != by else param.data.copy_(t)  # by hand
        if copy_decoder:  # as BertForMaskedLM ties its decoder by hand
            self.decoder.weight.data.copy_(self.embed.weight)


def checkpoint(seed: int = 0, untied: bool = False, **changed) -> dict[str, torch.Tensor]:
    """The tiny model's checkpoint; ``untied``: the decoder has a weight of its own."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {"embed": torch.randn(8, 4, generator=gen), "q": torch.randn(2, 4, generator=gen),
               "k": torch.randn(2, 4, generator=gen), "bias": torch.randn(8, generator=gen),
               "norm": torch.randn(4, generator=gen)}
    if untied:
        tensors["dec"] = torch.randn(8, 4, generator=gen)
    tensors.update(changed)
    return tensors


def recorded_load(model: Tiny, tensors: dict, trace: bool = True, **kwargs) -> SourceRecorder:
    """Load as an engine does (``trace``: through `SourceRecorder.tracing`, as the loader does)."""
    recorder = SourceRecorder(hash_keys=True, threads=1)
    recorder.wrap(model)
    with recorder.tracing() if trace else contextlib.nullcontext():
        model.load_weights(recorder.iterate(tensors.items()), **kwargs)
    recorder.keys = recorder.finish()
    return recorder


def test_sources_are_attributed_to_the_modules_their_weight_loaders_fill():
    model = Tiny()
    recorder = recorded_load(model, checkpoint(), copy_decoder=False)
    assert dict(recorder.module_sources) == {"embed": {"embed"}, "qkv": {"q", "k"}, "decoder": {"bias"},
                                             "norm": {"norm"}}
    assert set(recorder.keys) == {"embed", "q", "k", "bias", "norm"}
    assert all(len(bytes.fromhex(k.rsplit(":", 1)[1])) == 32 for k in recorder.keys.values())  # BLAKE3-256
    assert torch.equal(model.qkv.weight[2:], checkpoint()["k"])


def test_a_copy_from_another_parameter_after_the_loop_is_traced_and_makes_its_module_eager():
    """BERT's MLM decoder: copied from the word embedding once the checkpoint is drained.  Its
    provenance is the embedding's source; ``load_weights`` writes it whatever it is fed."""
    recorder = recorded_load(Tiny(), checkpoint())
    assert recorder.untraced == {} and recorder.module_sources["decoder"] == {"bias", "embed"}
    assert set(recorder.eager) == {"decoder"} and "from embed" in recorder.eager["decoder"]
    # Without the provenance mode, only the write witness sees that copy.
    recorder = recorded_load(Tiny(), checkpoint(), trace=False)
    assert set(recorder.untraced) == {"decoder"}
    assert "weight was written outside a weight loader" in recorder.untraced["decoder"]


def test_a_copy_by_hand_of_the_tensor_just_read_counts_as_its_loading():
    """gpt-oss's experts: ``param.copy_`` of the checkpoint tensor just read, no weight loader."""
    recorder = recorded_load(Tiny(), checkpoint(untied=True), copy_decoder=False, by="norm")
    assert recorder.untraced == {} and recorder.eager == {} and recorder.module_sources["norm"] == {"norm"}


def test_a_recorded_weight_loader_is_still_the_loader_models_look_at():
    """Note [a recorded weight loader is still the same loader]: gpt-oss and Llama 4 compare the
    loader with vLLM's ``default_weight_loader`` to choose its arguments and read
    ``supports_moe_loading`` from it; the layerwise reload reads its ``__name__`` and signature."""
    import inspect

    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    def expert_loader(param, loaded, weight_name: str, shard_id: str, expert_id: int):
        param.data.copy_(loaded)

    expert_loader.supports_moe_loading = True
    model = nn.Module()
    model.plain = nn.Parameter(torch.zeros(4), requires_grad=False)  # no loader of its own
    model.experts = nn.Parameter(torch.zeros(4), requires_grad=False)
    model.experts.weight_loader = expert_loader
    recorder = SourceRecorder(hash_keys=True, threads=1)
    recorder.wrap(model)
    plain, experts = model.plain.weight_loader, model.experts.weight_loader
    assert plain == default_weight_loader and default_weight_loader == plain and not plain != default_weight_loader
    assert hash(plain) == hash(default_weight_loader) and plain.__name__ == "default_weight_loader"
    assert experts == expert_loader and experts != default_weight_loader
    assert getattr(experts, "supports_moe_loading", False) is True and experts.__name__ == "expert_loader"
    assert inspect.signature(experts) == inspect.signature(expert_loader)
    tensors = {"plain": torch.ones(4), "experts": torch.full((4,), 2.0)}
    for name, loaded in recorder.iterate(tensors.items()):  # as gpt-oss chooses the call
        loader = getattr(model, name).weight_loader
        if loader == default_weight_loader:
            loader(getattr(model, name), loaded)
        else:
            loader(getattr(model, name), loaded, "w13_weight", shard_id="w1", expert_id=0)
    keys = recorder.finish()
    assert dict(recorder.module_sources) == {"": {"plain", "experts"}} and recorder.untraced == {}
    assert set(keys) == {"plain", "experts"} and torch.equal(model.experts, tensors["experts"])
    assert model.experts.weight_loader is expert_loader and not hasattr(model.plain, "weight_loader")


def test_a_weight_loader_writing_a_row_of_another_parameter_makes_that_one_of_its_sources():
    """A weight loader that also writes into another module's parameter (one row of 4096: the
    256-sample write witness would most likely miss it): the torch call is traced, so the
    checkpoint tensor it came from is a source of that module too, and a fine-tune changing
    only that tensor loads the other module again instead of mapping its stale row."""
    model = nn.Module()
    model.a, model.b = nn.Module(), nn.Module()
    model.a.weight = nn.Parameter(torch.zeros(4), requires_grad=False)
    model.b.weight = nn.Parameter(torch.zeros(4096, 4), requires_grad=False)

    def a_loader(param, loaded):
        param.data.copy_(loaded)
        model.b.weight.data[7].copy_(loaded)

    model.a.weight.weight_loader, model.b.weight.weight_loader = a_loader, default_loader
    recorder = SourceRecorder(hash_keys=False)
    recorder.wrap(model)
    tensors = {"b": torch.ones(4096, 4), "a": torch.full((4,), 2.0)}
    with recorder.tracing():
        for name, loaded in recorder.iterate(tensors.items()):
            param = getattr(model, name).weight
            param.weight_loader(param, loaded)
    recorder.finish()
    assert recorder.module_sources["b"] == {"b", "a"} and recorder.module_sources["a"] == {"a"}
    assert recorder.untraced == {} and recorder.eager == {}  # written from the tensor just read: its loading
    assert torch.equal(model.b.weight[7], tensors["a"])


def test_a_tensor_read_and_changed_in_place_from_another_takes_both_as_sources():
    """``load_weights`` adds an earlier checkpoint tensor into the one just read, in place, and
    hands that to the weight loader: both are the module's sources (a fine-tune changing only
    the earlier one must load the module again, not map its stale bytes)."""
    model = nn.Module()
    model.bias, model.out = nn.Module(), nn.Module()
    model.bias.weight = nn.Parameter(torch.zeros(4), requires_grad=False)
    model.out.weight = nn.Parameter(torch.zeros(4), requires_grad=False)
    for p in (model.bias.weight, model.out.weight):
        p.weight_loader = default_loader
    recorder = SourceRecorder(hash_keys=False)
    recorder.wrap(model)
    tensors = {"bias": torch.ones(4), "out": torch.full((4,), 2.0)}
    with recorder.tracing():
        kept = None
        for name, loaded in recorder.iterate(tensors.items()):
            if name == "bias":
                kept = loaded
                model.bias.weight.weight_loader(model.bias.weight, loaded)
            else:
                loaded.add_(kept)  # the tensor just read, changed in place from another
                model.out.weight.weight_loader(model.out.weight, loaded)
    recorder.finish()
    assert recorder.module_sources["out"] == {"out", "bias"} and recorder.module_sources["bias"] == {"bias"}
    assert torch.equal(model.out.weight, torch.full((4,), 3.0))


def test_a_tensor_whose_bytes_cannot_be_hashed_has_no_key_and_the_load_goes_on(monkeypatch):
    """A hashing thread's failure (a tensor subclass with no plain storage) is that name's
    missing key, never an error inside vLLM's ``load_weights``."""
    import vllm_dedup.engine.sources as sources

    real = sources.tensor_bytes
    monkeypatch.setattr(sources, "tensor_bytes",
                        lambda t: (_ for _ in ()).throw(RuntimeError("no storage")) if t.numel() == 32 else real(t))
    model = Tiny()
    recorder = recorded_load(model, checkpoint(), copy_decoder=False)
    assert set(recorder.keys) == {"q", "k", "bias", "norm"} and "embed" in recorder.unhashable
    assert torch.equal(model.embed.weight, checkpoint()["embed"])


def test_a_parameter_nothing_filled_and_values_through_python_are_untraced():
    recorder = recorded_load(Tiny(), {k: v for k, v in checkpoint().items() if k != "norm"}, copy_decoder=False,
                             transform="python")
    assert recorder.untraced["norm"] == "weight is not filled from the checkpoint"
    assert "other than the checkpoint tensor just read" in recorder.untraced["decoder"]
    assert "tolist took a tensor's values out of torch" in recorder.untraced["decoder"]
    # A copy made by torch carries its provenance: traced.
    recorder = recorded_load(Tiny(), checkpoint(untied=True), copy_decoder=False, transform="clone")
    assert recorder.untraced == {} and recorder.module_sources["decoder"] == {"bias", "dec"}


def test_write_witnesses_see_a_copy_over_a_large_tensor():
    big = torch.randn(1 << 16)
    before = write_witness(big)
    big.copy_(torch.randn(1 << 16))
    assert write_witness(big) != before and write_witness(torch.empty(0)) == b""


def test_a_witness_before_the_load_reads_no_page_not_written_yet():
    """Note [reading a parameter before it is written]: the witness of fresh memory is the one
    reading it gives, and it leaves the pages nobody wrote unmapped (its samples span 256 of
    the 4096 pages here; two were written)."""
    import mmap
    import warnings

    from vllm_dedup.engine.proc_maps import AnonymousRanges, present_runs

    pages = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(pages, dtype=torch.uint8)
    t = raw.view(torch.bfloat16)
    sample = [i * (t.numel() - 1) // 255 * 2 for i in range(256)]  # byte offsets of write_witness's samples
    raw[sample[255] + 1] = 7
    raw[sample[3] + 1] = 5
    unwritten = AnonymousRanges()
    witness = write_witness(t, unwritten=unwritten)
    present = sum(hi - lo for lo, hi in present_runs(t.data_ptr(), 16 << 20)) // 4096
    assert present == 2
    assert witness == write_witness(t)  # reading every sample gives the same value
    assert sum(hi - lo for lo, hi in present_runs(t.data_ptr(), 16 << 20)) // 4096 > 200  # and maps the pages
    raw[sample[128]] = 1  # a write where a sample lies is seen either way
    assert write_witness(t, unwritten=unwritten) != witness


def test_tied_weights_are_one_slot_and_a_swap_keeps_the_parameter_objects():
    model = Tiny()
    recorded_load(model, checkpoint())
    slots, _, _ = collect_slots(model, "cpu", min_bytes=1)
    (tied,) = [s for s in slots if len(s.refs) == 2]
    assert {(type(m), n) for m, n, _ in tied.refs} == {(nn.Module, "weight")}
    param = model.embed.weight
    swap(tied, tied.tensor.clone())
    assert model.embed.weight is param and model.head.weight is param
    assert param.weight_loader is default_loader


def mla_like() -> nn.Module:
    """As vLLM's MLA attention after post-processing: ``attn.W_UV`` and ``attn.W_UK_T`` are a
    transpose and a permute of views of ``kv_b_proj.weight`` (``split_kv_b_proj``)."""
    model = nn.Module()
    model.kv_b_proj, model.attn = nn.Module(), nn.Module()
    model.kv_b_proj.weight = nn.Parameter(torch.randn(2 * (3 + 5), 16), requires_grad=False)  # [N*(P+V), L]
    uk, uv = model.kv_b_proj.weight.T.view(16, 2, 8).split([3, 5], dim=-1)
    model.attn.W_UV = nn.Parameter(uv.transpose(0, 1), requires_grad=False)
    model.attn.W_UK_T = nn.Parameter(uk.permute(1, 2, 0), requires_grad=False)
    return model


def test_a_conjugate_or_negative_view_is_neither_a_slot_nor_a_view_that_follows():
    """A conjugate view of a complex parameter reads its bytes as other values: it must not
    merge with the parameter's slot, be keyed by those bytes, or be rebound as a plain view
    (``as_strided`` drops the conjugate bit)."""
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(64, dtype=torch.complex64), requires_grad=False)
    model.register_buffer("w_conj", model.w.conj())
    model.register_buffer("z_conj", torch.randn(64, dtype=torch.complex64).conj())
    slots, private_n, _ = collect_slots(model, "cpu", min_bytes=1)
    (slot,) = slots
    assert [n for _, n, _ in slot.refs] == ["w"] and slot.views == []
    assert private_n == 2  # w_conj and z_conj stay where they are, their values intact


def test_views_follow_their_storage_into_the_shared_copy_and_the_private_one_is_freed():
    model = mla_like()
    before = {n: (p.clone(), p.stride()) for n, p in model.named_parameters()}
    slots, private_n, _ = collect_slots(model, "cpu", min_bytes=1)
    (slot,) = slots
    assert private_n == 0 and {n for _, n, _ in slot.views} == {"W_UV", "W_UK_T"}
    old = slot.tensor.untyped_storage()
    shared = torch.empty(1000).narrow(0, 24, slot.tensor.numel()).view_as(slot.tensor)  # at an offset, as in a pack
    shared.copy_(slot.tensor)
    swap(slot, shared)
    storage = shared.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name][0]) and p.stride() == before[name][1], name
        assert p.untyped_storage().data_ptr() == storage, name  # nothing holds the private copy
    assert old.data_ptr() != storage
    # a recipe names each view by its base and element offset, and reads back as written
    placement = {id(model.kv_b_proj.weight): Placement("key-kv", "uid-kv")}
    recipe = build_recipe(model, "sig", {}, types.SimpleNamespace(module_sources={}, untraced={}, eager={}), placement, 0, {})
    views = {t.name: t for t in recipe.modules["attn"].tensors}
    assert {(t.alias, t.view) for t in views.values()} == {("kv_b_proj.weight", 3 * 16), ("kv_b_proj.weight", 0)}  # V after P, in columns of 16
    assert recipe.modules["attn"].replayable
    assert Recipe.from_bytes(recipe.checked_bytes()) == recipe
    # a view of a tensor that is shared already (a replay mapped it) is neither a slot nor private
    slots, private_n, _ = collect_slots(model, "cpu", min_bytes=1, exclude={id(model.kv_b_proj.weight)})
    assert slots == [] and private_n == 0


def test_mla_on_amx_is_not_replayed():
    """On AMX, vLLM's MLA packs W_UK/W_UV into its implementation and empties kv_b_proj's weight
    (``amx_mla.py``): nothing a recipe records; this machine may not have AMX, so the flag is set."""
    from vllm_dedup.engine.recipe_builder import unreplayable_reason

    module = mla_like().attn
    assert unreplayable_reason(module) is None
    module.is_amx_bmm_enabled = True
    assert "AMX" in unreplayable_reason(module)


def recipe_of(model: Tiny, recorder: SourceRecorder) -> Recipe:
    """A recipe as an engine leaves it: every tensor of 64 bytes or more in a segment."""
    def key(name: str, p: torch.Tensor) -> str:  # of the tensor's layout (`match` checks it), a digest of its name
        return str(ContentKey(name.encode().ljust(16, b".")[:16], dtype_name(p.dtype), tuple(p.shape), p.stride()))

    placement = {id(p): Placement(key(name, p), f"uid-{name}") for name, p in model.named_parameters()
                 if p.numel() * p.element_size() >= 64}
    return build_recipe(model, "sig", dict(recorder.keys), recorder, placement, 32, {})


def source_keys(tensors: dict) -> dict[str, str]:
    recorder = recorded_load(Tiny(), tensors, copy_decoder="dec" not in tensors)
    return dict(recorder.keys)


def test_a_recipe_records_keys_with_their_segments_aliases_and_what_is_traced():
    model = Tiny()
    recipe = recipe_of(model, recorded_load(model, checkpoint()))
    embed = recipe.modules["embed"].tensors[0]
    assert embed.key.endswith(":" + b"embed.weight....".hex()) and embed.uid == "uid-embed.weight"
    assert recipe.modules["head"].tensors[0].alias == "embed.weight"
    assert recipe.modules["norm"].tensors[0].inline is not None  # 16 bytes: kept inline
    assert recipe.modules["decoder"].traced and recipe.modules["decoder"].eager and not recipe.modules["qkv"].eager
    again = Recipe.from_bytes(recipe.to_bytes())
    assert again.modules["decoder"].eager == recipe.modules["decoder"].eager and again.id == recipe.id
    untraced = recipe_of(Tiny(), recorded_load(Tiny(), checkpoint(), transform="python"))
    assert not untraced.modules["decoder"].traced
    assert Recipe.from_bytes(untraced.to_bytes()).modules["decoder"].why_untraced == untraced.modules["decoder"].why_untraced


def test_the_same_checkpoint_maps_every_module_even_untraced_ones():
    model = Tiny()
    recipe = recipe_of(model, recorded_load(model, checkpoint(), transform="python"))
    assert not recipe.modules["decoder"].traced
    found, why = choose([recipe], source_keys(checkpoint()))
    assert why == "" and found.unmatched == {} and "decoder" in found.matched


def test_a_changed_tensor_loads_its_module_and_every_module_sharing_its_inputs():
    model = Tiny()
    recipe = recipe_of(model, recorded_load(model, checkpoint(untied=True), copy_decoder=False))
    assert all(m.traced for m in recipe.modules.values())
    changed = source_keys(checkpoint(untied=True, k=torch.zeros(2, 4)))
    found = match(recipe, changed)
    assert set(found.unmatched) == {"qkv"} and found.read() == {"q", "k"}
    # A module that shares a checkpoint tensor with one loaded is loaded too.
    recipe.modules["norm"].sources = ["norm", "q"]
    found = match(recipe, changed)
    assert set(found.unmatched) == {"qkv", "norm"} and "shares a checkpoint tensor" in found.unmatched["norm"]


def test_a_tie_made_after_loading_is_decided_again_when_either_side_changes():
    """Note [a tie made after loading] (`recipe_builder.py`): the checkpoint ships a redundant
    head equal to the embedding, and vLLM ties the two after loading.  A fine-tune whose
    embedding changed must load the head again (vLLM then keeps it untied): binding it to
    the new embedding would be a wrong weight."""
    base = checkpoint(untied=True, dec=checkpoint()["embed"])
    model = Tiny()
    recorder = recorded_load(model, base, copy_decoder=False)
    model.decoder.weight = model.embed.weight  # as maybe_retie_word_embeddings ties equal bytes
    recipe = recipe_of(model, recorder)
    assert next(t for t in recipe.modules["decoder"].tensors if t.name == "weight").alias == "embed.weight"
    assert {"dec", "embed"} <= set(recipe.modules["decoder"].sources)
    assert match(recipe, source_keys(base)).unmatched == {}
    found = match(recipe, source_keys(dict(base, embed=torch.zeros(8, 4))))
    assert {"embed", "decoder"} <= set(found.unmatched)
    # A tie made when the model was built (the head loads nothing of its own) holds whatever
    # the embedding's bytes: the head stays mapped, aliasing it.
    model = Tiny()
    recipe = recipe_of(model, recorded_load(model, checkpoint(untied=True), copy_decoder=False))
    assert recipe.modules["head"].sources == []
    assert "head" in match(recipe, source_keys(checkpoint(untied=True, embed=torch.zeros(8, 4)))).matched


def test_an_eager_module_is_loaded_whenever_anything_is():
    model = Tiny()
    recipe = recipe_of(model, recorded_load(model, checkpoint()))
    found = match(recipe, source_keys(checkpoint(k=torch.zeros(2, 4))))
    # qkv changed; the decoder is eager, and takes the embedding (its source) along.
    assert set(found.unmatched) == {"qkv", "decoder", "embed"} and "partial load writes it" in found.unmatched["decoder"]
    assert found.read() == {"q", "k", "bias", "embed"} and found.matched == {"head", "norm"}
    assert match(recipe, source_keys(checkpoint())).unmatched == {}  # nothing loaded: nothing written


def test_a_change_an_untraced_module_may_depend_on_declines_the_recipe():
    model = Tiny()
    recipe = recipe_of(model, recorded_load(model, checkpoint(), transform="python"))
    with pytest.raises(RecipeDeclined, match="decoder .* cannot be loaded on its own"):
        match(recipe, source_keys(checkpoint(embed=torch.zeros(8, 4))))
    found, why = choose([recipe], source_keys(checkpoint(embed=torch.zeros(8, 4))))
    assert found is None and "decoder" in why


def test_a_derived_tensor_in_no_segment_makes_its_module_load_and_the_recipe_stays_readable():
    """Issue 30: post-processing derives a tensor from a module's parameters (MLA's ``W_UV``)
    that is neither in a segment nor small enough to keep inline.  The module is recorded as
    not replayable (a later engine loads it), and the recipe is one every reader accepts: the
    writer checks it with the reader's own parser (`Recipe.checked_bytes`)."""
    model = Tiny()
    recorder = recorded_load(model, checkpoint(untied=True), copy_decoder=False)
    model.qkv.register_buffer("W_UV", model.qkv.weight.detach().t().contiguous().repeat(4, 1))  # 256 bytes
    recipe = recipe_of(model, recorder)
    qkv = recipe.modules["qkv"]
    derived = next(t for t in qkv.tensors if t.name == "W_UV")
    assert (derived.key, derived.inline, derived.alias) == (None, None, None)
    assert not qkv.replayable and "W_UV" in qkv.why
    back = Recipe.from_bytes(recipe.checked_bytes())
    assert back == recipe
    found, why = choose([back], source_keys(checkpoint(untied=True)))
    assert why == "" and set(found.unmatched) == {"qkv"} and "embed" in found.matched
    # A replayable module's tensor must have a place: such a recipe is refused by the writer.
    qkv.replayable = True
    with pytest.raises(ValueError, match="'W_UV' must have exactly one of key, inline and alias"):
        recipe.checked_bytes()


def test_malformed_recipes_are_declined_never_raised():
    model = Tiny()
    recipe = recipe_of(model, recorded_load(model, checkpoint()))
    with pytest.raises(ValueError, match="not a recipe"):
        Recipe.from_bytes(recipe.to_bytes().replace(b'"traced":true', b'"traced":[]', 1)[:-3])
    recipe.modules["qkv"].sources = None  # not a list: what a damaged recipe could hold
    found, why = choose([recipe], source_keys(checkpoint()))
    assert found is None and "malformed" in why


class Impl:
    """Stands for a vLLM attention implementation (which keeps ``sinks``)."""


Impl.__module__ = "vllm.v1.attention.backends.cpu_attn"  # objects of vLLM's are looked into


def test_attribute_tensors_reach_module_attributes_and_plain_objects_they_hold():
    model = Tiny()
    model.qkv.impl = Impl()
    model.qkv.impl.sinks = torch.empty(4, device="meta")
    model.qkv.other = types.SimpleNamespace(hidden=torch.ones(2))  # not vLLM's: not looked into
    model.norm.cached = torch.ones(3)
    model.norm.kv_cache = torch.ones(3)  # runtime state, not a weight
    found = dict(attribute_tensors(model))
    assert found["qkv.impl.sinks"].is_meta and "norm.cached" in found
    assert "norm.kv_cache" not in found and "qkv.other.hidden" not in found


def test_the_attribute_walk_leaves_out_inert_values_and_nothing_a_caller_looks_for():
    from collections import OrderedDict

    from vllm_dedup.engine.attributes import module_attributes

    layer = nn.Linear(4, 4)  # nn.Module's own hook dicts and flags: all inert
    weight = torch.ones(2)
    layer.cpu_linear = lambda x, w=None, b=None: weight + x  # a closure over a tensor, as vLLM's dispatch makes
    layer.impl = Impl()
    layer.impl.sinks, layer.impl.scale, layer.impl.name = torch.zeros(1), 0.5, "attn"
    layer.sizes, layer.flags, layer.dtype = [4, 4], {"a": weight}, torch.bfloat16
    layer.hooks = OrderedDict(h=lambda: None)
    found = {a.path: a.value for a in module_attributes(layer)}
    assert set(found) == {"cpu_linear", "impl", "impl.sinks"}, sorted(found)
    assert dict(attribute_tensors(layer)).keys() == {"<model>.cpu_linear[0]", "<model>.impl.sinks"}


def vllm_config(tmp_path, **changes):
    """The parts of a VllmConfig the load signature reads, for a model folder ``tmp_path``."""
    from transformers import LlamaConfig

    hf = LlamaConfig(vocab_size=changes.pop("vocab_size", 100), hidden_size=64, num_hidden_layers=1,
                     num_attention_heads=2, architectures=["LlamaForCausalLM"], _name_or_path=changes.pop("name", "a"))
    model = types.SimpleNamespace(model=str(tmp_path), hf_config=hf, dtype="bfloat16", quantization=None,
                                  model_impl="auto", convert_type="none", runner_type="generate",
                                  trust_remote_code=False, max_model_len=changes.pop("max_model_len", 2048))
    parallel = types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                     decode_context_parallel_size=changes.pop("dcp", 1),
                                     data_parallel_size=changes.pop("dp", 1), data_parallel_rank=changes.pop("dp_rank", 0),
                                     prefill_context_parallel_size=changes.pop("pcp", 1))
    from vllm.config import KernelConfig, LoRAConfig

    lora = changes.pop("lora", None)
    return types.SimpleNamespace(
        model_config=model, parallel_config=parallel,
        device_config=types.SimpleNamespace(device_type="cpu"),
        cache_config=types.SimpleNamespace(cache_dtype=changes.pop("kv", "auto")),
        kernel_config=KernelConfig(**changes.pop("kernels", {})), lora_config=LoRAConfig(**lora) if lora else None)


def test_a_model_folder_file_that_cannot_be_read_is_an_error_of_the_signature_not_a_guess(tmp_path):
    """A ``*.py`` of the folder whose bytes cannot be read (here a real read error: EIO from
    ``/proc/self/mem`` at offset 0, which root cannot read either) raises, never digests as
    something else; `unreadable` turns it into the `CheckpointError` the loader falls back on."""
    from vllm_dedup.engine.signature import load_signature, unreadable
    from vllm_dedup.errors import CheckpointError

    (tmp_path / "modeling_m.py").symlink_to("/proc/self/mem")
    with pytest.raises(OSError) as raised:
        load_signature(vllm_config(tmp_path))
    error = unreadable(raised.value)
    assert isinstance(error, CheckpointError) and "cannot read it for the load signature" in str(error)
    assert str(tmp_path / "modeling_m.py") in str(error)  # read's EIO names no file: the reader does


def test_the_signature_follows_what_changes_final_tensors_and_nothing_else(tmp_path):
    from vllm_dedup.engine.signature import load_signature

    base = load_signature(vllm_config(tmp_path))
    assert load_signature(vllm_config(tmp_path, name="other")) == base  # a name changes no tensor
    assert load_signature(vllm_config(tmp_path, kv="fp8")) != base  # FP8 k/v scales
    assert load_signature(vllm_config(tmp_path, vocab_size=101)) != base  # vocabulary-sized buffers
    # PLaMo 3 and MiniMax-M2 size their rotary caches by the engine's maximum length.
    assert load_signature(vllm_config(tmp_path, max_model_len=4096)) != base
    assert load_signature(vllm_config(tmp_path, dcp=2)) != base  # DCPGroupColumnParallelLinear shards by it
    # A mixture of experts is sharded across DP and PCP ranks too (Note [data-parallel ranks
    # hold other shards]): each rank of a DP=2 deployment differs from the other and from DP=1.
    dp = {load_signature(vllm_config(tmp_path, dp=2, dp_rank=rank)) for rank in (0, 1)}
    assert len(dp) == 2 and base not in dp
    assert load_signature(vllm_config(tmp_path, pcp=2)) != base
    # vLLM's MoE and linear kernels may lay weights out otherwise (flashinfer_cutlass swaps the
    # halves of w13), and it picks MoE kernels by LoRA's configuration.
    kernels = {load_signature(vllm_config(tmp_path, kernels={"moe_backend": backend}))
               for backend in ("triton", "flashinfer_cutlass")}
    assert len(kernels) == 2 and base not in kernels
    assert load_signature(vllm_config(tmp_path, kernels={"linear_backend_per_quant": {"fp8": "cutlass"}})) != base
    loras = {load_signature(vllm_config(tmp_path, lora={"max_lora_rank": rank})) for rank in (8, 16)}
    assert len(loras) == 2 and base not in loras
    # Which norm and activation kernels run changes no weight (and differs, on CUDA, between
    # eager and compiled engines that share them).
    assert load_signature(vllm_config(tmp_path, kernels={"ir_op_priority": {"rms_norm": ["native"]}})) == base
    assert load_signature(vllm_config(tmp_path, kernels={"ir_op_priority": {"rms_norm": ["vllm_c", "native"]}})) == base
    modes = {load_signature(vllm_config(tmp_path), cpu_linear=mode) for mode in ("packed", "plain", "private", "vllm")}
    assert len(modes) == 4  # on the CPU backend, each mode leaves other final tensors
    for name, value in [("VLLM_CPU_OMP_THREADS_BIND", "1"), ("VLLM_LOGGING_LEVEL", "DEBUG"),
                        ("VLLM_NIXL_SIDE_CHANNEL_PORT", "5601"), ("VLLM_RAY_BUNDLE_INDICES", "1"), ("VLLM_DP_RANK", "1")]:
        with pytest.MonkeyPatch.context() as env:  # another core, log level, Serve replica: the same tensors
            env.setenv(name, value)
            assert load_signature(vllm_config(tmp_path)) == base, name
    for name, value in [("VLLM_USE_DEEP_GEMM", "0"), ("VLLM_MARLIN_INPUT_DTYPE", "fp8"), ("VLLM_ZENTORCH_WEIGHT_PREPACK", "0")]:
        with pytest.MonkeyPatch.context() as env:  # another kernel's layout of the weights
            env.setenv(name, value)
            assert load_signature(vllm_config(tmp_path)) != base, name
    (tmp_path / "preprocessor_config.json").write_text('{"image_mean": [0.5]}')
    assert load_signature(vllm_config(tmp_path)) != base  # folded into some models' modules
    # A sentence-transformers Dense projector: vLLM's pooler loads it while building the model.
    dense = tmp_path / "2_Dense"
    dense.mkdir()
    (dense / "config.json").write_text('{"in_features": 4, "out_features": 2}')
    (dense / "model.safetensors").write_bytes(b"one projector")
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    before = load_signature(vllm_config(tmp_path))
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with_dense = load_signature(vllm_config(tmp_path))
    (dense / "model.safetensors").write_bytes(b"another one")
    assert len({before, with_dense, load_signature(vllm_config(tmp_path))}) == 3
    (tmp_path / "modules.json").write_text(json.dumps({"modules": modules}))  # the other form vLLM reads
    as_dict = load_signature(vllm_config(tmp_path))
    (dense / "model.safetensors").write_bytes(b"a third one")
    assert load_signature(vllm_config(tmp_path)) != as_dict
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"outside")
    (tmp_path / "modules.json").write_text(json.dumps([*modules, {"idx": 2, "path": f"../{elsewhere.name}"}]))
    outside = load_signature(vllm_config(tmp_path))
    (elsewhere / "model.safetensors").write_bytes(b"changed outside")
    assert load_signature(vllm_config(tmp_path)) == outside  # a module outside the folder is not read
    drafter = vllm_config(tmp_path, vocab_size=7).model_config
    assert load_signature(vllm_config(tmp_path), drafter) == load_signature(vllm_config(tmp_path, vocab_size=7))


def test_post_processing_hooks_run_before_and_after_each_hooked_module_only():
    """`post_processing_hooks` calls ``before`` and ``after`` around a hooked module's own
    post-processing (the replay gives the heap back before an embedding's packing, and installs
    the segment after), in that order, and leaves every other module's untouched."""
    from vllm_dedup.engine.post_processing import post_processing_hooks

    calls = []

    class Method:
        def process_weights_after_loading(self, layer):
            calls.append(("process", layer.tag))

    hooked, other = nn.Module(), nn.Module()
    hooked.tag, other.tag = "hooked", "other"
    hooked.quant_method, other.quant_method = Method(), Method()
    with post_processing_hooks({"h": hooked}, after=lambda name, m: calls.append(("after", name)),
                               before=lambda name, m: calls.append(("before", name))):
        for module in (hooked, other):
            module.quant_method.process_weights_after_loading(module)
    assert calls == [("before", "h"), ("process", "hooked"), ("after", "h"), ("process", "other")]
    assert "process_weights_after_loading" not in vars(hooked.quant_method)  # unwrapped after the block


def test_a_mapped_module_whose_method_does_not_support_pre_processed_weights_declines_the_replay():
    """vLLM refuses its pre-processed mode for a quant method without
    ``supports_pre_processed_weights`` before calling it; the hooks enter that mode only around
    the call, so they check it themselves: a recipe that calls such a module replayable (another
    engine's data) must not have its transform run again on the final, mapped tensors."""
    import torch
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from vllm_dedup.engine.post_processing import post_processing_hooks
    from vllm_dedup.engine.recipe import RecipeDeclined

    class Doubles(QuantizeMethodBase):  # supports_pre_processed_weights: the base's False
        def create_weights(self, *args, **kwargs):
            pass

        def apply(self, *args, **kwargs):
            pass

        def process_weights_after_loading(self, layer):
            layer.weight.data.mul_(2)

    layer = nn.Module()
    layer.weight = nn.Parameter(torch.ones(2), requires_grad=False)
    layer.quant_method = Doubles()
    with pytest.raises(RecipeDeclined, match="Doubles of layer does not support"):
        with post_processing_hooks({"layer": layer}, pre_processed=True):
            layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.tolist() == [1.0, 1.0]
    with post_processing_hooks({"layer": layer}):  # a usual load: it runs
        layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.tolist() == [2.0, 2.0]


class Mixer(nn.Module):
    """As vLLM's Mamba2 mixer: a ``conv_weights`` buffer registered over its conv layer's
    (dim, 1, width) weight, viewed as (dim, width); only the conv layer has a weight loader."""

    def __init__(self):
        super().__init__()
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(6, 1, 4), requires_grad=False)
        self.conv1d.weight.weight_loader = default_loader
        self.register_buffer("conv_weights", self.conv1d.weight.view(6, 4), persistent=False)
        self.D = nn.Parameter(torch.empty(6), requires_grad=False)
        self.D.weight_loader = default_loader

    def load_weights(self, weights):
        for name, t in weights:
            param = {"conv": self.conv1d.weight, "D": self.D}[name]
            param.weight_loader(param, t)


def test_a_buffer_over_another_modules_parameter_takes_its_source_and_is_its_view():
    model = Mixer()
    recorder = SourceRecorder(hash_keys=True, threads=1)
    recorder.wrap(model)
    tensors = {"conv": torch.randn(6, 1, 4), "D": torch.randn(6)}
    model.load_weights(recorder.iterate(tensors.items()))
    keys = recorder.finish()
    # Written through the conv layer's loader: traced, and the conv tensor goes into both modules
    # (so a change to it loads both, and the mixer is never mapped over a stale view).
    assert recorder.untraced == {}
    assert dict(recorder.module_sources) == {"": {"conv", "D"}, "conv1d": {"conv"}}
    # The parameter is the base and the buffer its view, never each the other's (a replay binds
    # views after post-processing, which reads the conv layer's weight).
    recipe = build_recipe(model, "sig", keys, recorder, {}, 1 << 10, {})
    buffer = next(t for t in recipe.modules[""].tensors if t.name == "conv_weights")
    weight = next(t for t in recipe.modules["conv1d"].tensors if t.name == "weight")
    assert (buffer.alias, buffer.view) == ("conv1d.weight", 0)
    assert weight.alias is None and weight.inline is not None


def test_a_name_two_files_hold_has_no_source_key_and_leaves_no_manifest(tmp_path):
    """Two shards of one checkpoint (no index) both holding ``norm``: vLLM yields it twice and
    its weight loader keeps the last.  Neither key describes "the" tensor of that name, so the
    load keeps none (the recipe is not left, `fast_path.leave_recipe`), and neither file's
    manifest is cached with the other's key, whichever of them was cached before."""
    from safetensors.torch import save_file

    from vllm_dedup.checkpoint.loading import write_manifests
    from vllm_dedup.checkpoint.manifest import RACY_WINDOW_NS, FileIdentity, ManifestCache
    from vllm_dedup.checkpoint.readers import SafetensorsFile

    tensors = checkpoint()
    twin = torch.randn(4, generator=torch.Generator().manual_seed(7))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"embed": tensors["embed"], "norm": tensors["norm"]}, a)
    save_file({"q": tensors["q"], "k": tensors["k"], "bias": tensors["bias"], "norm": twin}, b)
    model = Tiny()
    recorder = SourceRecorder(hash_keys=True, threads=1)
    recorder.wrap(model)
    stream = [("embed", tensors["embed"]), ("norm", tensors["norm"]), ("q", tensors["q"]), ("k", tensors["k"]),
              ("bias", tensors["bias"]), ("norm", twin)]
    model.load_weights(recorder.iterate(stream), copy_decoder=False)
    keys = recorder.finish()
    assert recorder.unhashable == ["norm"] and "norm" not in keys and {"embed", "q", "k", "bias"} <= set(keys)

    identities = {}
    for path in (a, b):
        with SafetensorsFile(path) as wf:
            identities[path] = FileIdentity.of(path, wf.header())
    cache = ManifestCache(tmp_path / "cache")
    # Even handed a key for the name, neither file is cached: the key may be the other's tensor's.
    settled_ns = max(i.ctime_ns for i in identities.values()) + RACY_WINDOW_NS
    assert write_manifests([a, b], identities, {**keys, "norm": keys["embed"]}, cache, settled_ns) == 0
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("when", ["during", "just_before", "never"])
def test_a_file_hashed_during_a_load_and_rewritten_in_place_leaves_no_keys(tmp_path, when):
    """vLLM's iterator yields views of the file's pages: a tensor hashed at one moment may be
    copied into the model at another, after a rewrite in place (same size, ``rsync
    --inplace``).  Its keys must not describe what the model got, so the load keeps none,
    whether its keys were hashed then or came from the cache; nor does a file changed too
    shortly before the load for a later write to show (`manifest.settled`)."""
    import time

    from safetensors import safe_open
    from safetensors.torch import save_file

    from vllm_dedup.checkpoint.manifest import RACY_WINDOW_NS, ManifestCache
    from vllm_dedup.engine.fast_path import RecordedLoad

    path = tmp_path / "model.safetensors"
    save_file(checkpoint(), path)
    if when != "just_before":
        time.sleep(2 * RACY_WINDOW_NS / 1e9)
    recorded = RecordedLoad([path], ManifestCache(tmp_path / "cache"))
    with safe_open(path, framework="pt") as f:
        stream = [(name, f.get_tensor(name)) for name in f.keys()]
    model = Tiny()
    recorded.recorder.wrap(model)
    model.load_weights(recorded.recorder.iterate(stream), copy_decoder=False)
    if when == "during":
        with open(path, "r+b") as f:  # the same size, other bytes: the header stays as it was
            f.seek(-4, 2)
            f.write(b"\x01\x02\x03\x04")
    recorded.finish()
    manifests = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    if when == "never":  # the check can pass: an untouched, settled file keeps its keys
        assert set(recorded.keys) == {"embed", "q", "k", "bias", "norm"} and len(manifests) == 1
    else:
        assert recorded.keys == {} and str(path) in recorded.recorder.unhashable and manifests == []


def test_a_recipe_of_another_signature_is_never_chosen(tmp_path):
    """The registry files recipes by the signature their writer gave; the reader checks it too."""
    from safetensors.torch import save_file

    from vllm_dedup.checkpoint.manifest import ManifestCache
    from vllm_dedup.engine.fast_path import decide

    tensors = checkpoint()
    save_file(tensors, tmp_path / "model.safetensors")
    model = Tiny()
    recipe = recipe_of(model, recorded_load(model, tensors))  # signature "sig"
    lease = types.SimpleNamespace(get_recipes=lambda signature: [recipe.to_bytes()])
    cache = ManifestCache(tmp_path / "cache")

    def ctx(signature):
        return types.SimpleNamespace(lease=lease, signature=signature, model_name="tiny")

    chosen = decide(ctx("sig"), [tmp_path / "model.safetensors"], cache)
    assert chosen.match is not None and chosen.match.recipe.id == recipe.id
    other = decide(ctx("another"), [tmp_path / "model.safetensors"], cache)
    assert other.match is None and "another load signature" in other.why


def test_of_several_recipes_the_one_mapping_the_most_is_chosen_one_parsed_at_a_time(tmp_path):
    """`decide` parses and matches the registry's recipes one by one, keeping the best so far:
    a malformed one is passed over, one whose source for a tensor is not the checkpoint's maps
    less, and the chosen recipe's bytes are those the registry gave."""
    from safetensors.torch import save_file

    from vllm_dedup.checkpoint.manifest import ManifestCache
    from vllm_dedup.engine.fast_path import decide

    tensors = checkpoint()
    save_file(tensors, tmp_path / "model.safetensors")
    model = Tiny()
    full = recipe_of(model, recorded_load(model, tensors))
    partial = Recipe.from_bytes(full.to_bytes())
    name = next(iter(sorted(partial.sources)))
    partial.sources[name] = "0" * len(partial.sources[name])  # another tensor there: its module loads
    cache = ManifestCache(tmp_path / "cache")
    for given in ([b"{not json", partial.to_bytes(), full.to_bytes()], [full.to_bytes(), partial.to_bytes()]):
        lease = types.SimpleNamespace(get_recipes=lambda signature, given=given: list(given))
        chosen = decide(types.SimpleNamespace(lease=lease, signature="sig", model_name="tiny"),
                        [tmp_path / "model.safetensors"], cache)
        assert chosen.match is not None and chosen.why == "", chosen.why
        assert chosen.match.recipe.id == full.id and chosen.recipe_bytes == full.to_bytes()
    only_partial = decide(types.SimpleNamespace(lease=types.SimpleNamespace(get_recipes=lambda s: [partial.to_bytes()]),
                                                signature="sig", model_name="tiny"),
                          [tmp_path / "model.safetensors"], cache)
    assert 0 < only_partial.match.mapped_bytes < chosen.match.mapped_bytes
    broken = decide(types.SimpleNamespace(lease=types.SimpleNamespace(get_recipes=lambda s: [b"{not json"]),
                                          signature="sig", model_name="tiny"), [tmp_path / "model.safetensors"], cache)
    assert broken.match is None and broken.why.startswith("a recipe cannot be read") and broken.checkpoint is None


def test_an_engine_stores_no_manifest_for_a_file_changed_just_before_it_took_its_identity(tmp_path):
    """Note [racily clean files]: a load's identities taken within `RACY_WINDOW_NS` of a file's
    last change could miss a write in the same timestamp tick, so its keys are not cached."""
    from safetensors.torch import save_file

    from vllm_dedup.checkpoint.loading import write_manifests
    from vllm_dedup.checkpoint.manifest import RACY_WINDOW_NS, FileIdentity, ManifestCache, file_manifest
    from vllm_dedup.checkpoint.readers import SafetensorsFile

    path = tmp_path / "model.safetensors"
    save_file(checkpoint(), path)
    manifest, _ = file_manifest(path, ManifestCache(None))
    keys = {e.name: str(k) for e, k in zip(manifest.entries, manifest.keys)}
    with SafetensorsFile(path) as wf:
        identity = FileIdentity.of(path, wf.header())
    cache = ManifestCache(tmp_path / "cache")
    racy_ns = identity.ctime_ns + RACY_WINDOW_NS - 1
    assert write_manifests([path], {path: identity}, keys, cache, racy_ns) == 0
    assert write_manifests([path], {path: identity}, keys, cache, racy_ns + 1) == 1
    assert cache.get(identity) is not None


def test_a_mistral_format_folder_takes_no_fast_path_under_auto(tmp_path):
    """vLLM's ``auto`` format reads ``consolidated*.safetensors`` (Mistral names, q and k
    permuted) wherever the folder has one, not the HF files beside it, so keys taken from those
    would describe files vLLM never reads; an explicit ``safetensors`` format reads the HF files."""
    import types

    from safetensors.torch import save_file
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from vllm_dedup.config import DedupConfig
    from vllm_dedup.engine.fast_path import fast_path_files

    save_file({"w": torch.ones(4)}, tmp_path / "model-00001-of-00001.safetensors")
    save_file({"w": torch.ones(4)}, tmp_path / "consolidated.safetensors")

    def files(inner_format: str):
        ctx = types.SimpleNamespace(
            config=DedupConfig(inner_load_format=inner_format), model_config=types.SimpleNamespace(model=str(tmp_path)),
            vllm_config=types.SimpleNamespace(parallel_config=types.SimpleNamespace(enable_expert_parallel=False)))
        return fast_path_files(ctx, DefaultModelLoader(LoadConfig(load_format=inner_format)))

    found, why = files("auto")
    assert found is None and "Mistral-format folder" in why
    found, why = files("safetensors")
    assert why == "" and [f.name for f in found] == ["consolidated.safetensors", "model-00001-of-00001.safetensors"]
