"""Recipes: what a recipe says a checkpoint may map, and the recipe's bytes on the wire.  Real
engines build and use recipes in tests/e2e/test_fast_path.py; here the matching rules."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_dedup.content.keys import ContentKey
from vllm_dedup.content.views import contiguous_stride
from vllm_dedup.engine.recipe import ModuleRecipe, Recipe, RecipeDeclined, TensorRecipe, choose

MB = 1 << 20


def key_of(tag: str, dtype: str, shape: tuple[int, ...]) -> str:
    """A content key of that layout, its digest made from ``tag`` (recipes are matched by
    their keys' strings; `match` checks each layout against its key's)."""
    return str(ContentKey(tag.encode().ljust(16, b"."), dtype, shape, contiguous_stride(shape)))


def weight(name: str, key: str, rows: int = 512) -> TensorRecipe:
    return TensorRecipe(name, True, "bfloat16", (rows, 1024), (1024, 1), key=key_of(key, "bfloat16", (rows, 1024)))


def base_recipe() -> Recipe:
    """Two layers (qkv fed by q, k, v), a norm kept inline, a tied head aliasing the embedding,
    a rotary cache made at construction (no sources)."""
    return Recipe(
        signature="sig",
        sources={"embed": "e0", "l0.q": "q0", "l0.k": "k0", "l0.v": "v0", "l1.q": "q1", "l1.k": "k1", "l1.v": "v1",
                 "norm": "n0"},
        modules={
            "embed": ModuleRecipe(["embed"], [weight("weight", "E", rows=4096)]),
            "layers.0.qkv": ModuleRecipe(["l0.k", "l0.q", "l0.v"], [weight("weight", "QKV0")]),
            "layers.1.qkv": ModuleRecipe(["l1.k", "l1.q", "l1.v"], [weight("weight", "QKV1")]),
            "norm": ModuleRecipe(["norm"], [TensorRecipe("weight", True, "bfloat16", (4,), (1,), inline=b"\x01" * 8)]),
            "head": ModuleRecipe([], [TensorRecipe("weight", True, "bfloat16", (4096, 1024), (1024, 1),
                                                   alias="embed.weight")]),
            "rotary": ModuleRecipe([], [TensorRecipe("cos_sin_cache", False, "float32", (8192, 64), (64, 1),
                                                     key=key_of("ROT", "float32", (8192, 64)))]),
        },
    )


def test_the_same_checkpoint_matches_every_module():
    recipe = base_recipe()
    match, why = choose([recipe], dict(recipe.sources))
    assert why == "" and match.unmatched == {} and match.matched == set(recipe.modules)
    assert match.read() == set()
    assert match.mapped_bytes == (4096 + 512 + 512) * 1024 * 2 + 8192 * 64 * 4


def test_a_changed_tensor_unmatches_exactly_the_modules_it_went_into():
    recipe = base_recipe()
    tuned = {**recipe.sources, "l1.v": "v1-tuned"}
    match, _ = choose([recipe], tuned)
    assert set(match.unmatched) == {"layers.1.qkv"}
    assert match.read() == {"l1.q", "l1.k", "l1.v"}  # the module needs all its inputs again
    assert "head" in match.matched and "rotary" in match.matched


def test_no_match_when_names_differ_or_a_changed_tensor_went_nowhere_recorded():
    recipe = base_recipe()
    match, why = choose([recipe], {**recipe.sources, "extra": "x"})
    assert match is None and "names differ" in why
    recipe.unattributed = ["norm"]
    match, why = choose([recipe], {**recipe.sources, "norm": "n1"})
    assert match is None and "went into no recorded module" in why
    assert choose([], recipe.sources) == (None, "no recipe for this load signature yet")


def test_a_changed_tensor_of_a_module_the_recipe_left_out_rules_it_out():
    """A module post-processing left without a tensor is in no entry of the recipe: its sources
    are unattributed (the builder), and a recipe naming a source in neither place (a peer's, an
    older build's) is ruled out by a change to it too (`match`)."""
    from types import SimpleNamespace

    from torch import nn

    from vllm_dedup.engine.context import Placement
    from vllm_dedup.engine.recipe_builder import build_recipe

    model = nn.Module()
    model.x, model.y = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    model.y.register_parameter("weight", None)  # post-processing dropped y's only tensor
    recording = SimpleNamespace(module_sources={"x": {"x.weight"}, "y": {"y.weight"}}, untraced={}, eager={})
    built = Recipe.from_bytes(build_recipe(model, "sig", {"x.weight": "K1", "y.weight": "K2"}, recording,
                                           {id(model.x.weight): Placement(key_of("X", "float32", (4, 4)), "u")},
                                           0, {}).checked_bytes())
    assert sorted(built.modules) == ["x"] and built.unattributed == ["y.weight"]
    match, why = choose([built], {"x.weight": "K1", "y.weight": "K2-tuned"})
    assert match is None and "went into no recorded module" in why
    built.unattributed = []  # as a recipe that does not say so
    match, why = choose([built], {"x.weight": "K1", "y.weight": "K2-tuned"})
    assert match is None and "in none of the recipe's modules" in why
    assert choose([built], {"x.weight": "K1", "y.weight": "K2"})[0].matched == {"x"}


def test_a_tensor_in_a_segment_as_small_as_the_inline_limit_is_kept_inline():
    """Post-processing may write a small tensor whatever the pre-processed mode (attention's
    ``_k_scale.fill_(1.0)``): mapped read-only, the replay would refuse that write and decline
    every time.  One no larger than the recipe's inline limit is kept inline; larger ones map."""
    from types import SimpleNamespace

    from torch import nn

    from vllm_dedup.engine.context import Placement
    from vllm_dedup.engine.recipe_builder import build_recipe

    attn = nn.Module()
    attn.register_buffer("_k_scale", torch.tensor(1.0))
    attn.register_buffer("table", torch.ones(4))
    model = nn.Module()
    model.attn = attn
    placement = {id(attn._k_scale): Placement(key_of("K", "float32", ()), "u"),
                 id(attn.table): Placement(key_of("T", "float32", (4,)), "u")}
    recording = SimpleNamespace(module_sources={}, untraced={}, eager={})
    built = build_recipe(model, "sig", {}, recording, placement, 4, {})
    scale, table = built.modules["attn"].tensors
    assert (scale.name, scale.key, scale.inline) == ("_k_scale", None, torch.tensor(1.0).numpy().tobytes())
    assert (table.name, table.key, table.inline) == ("table", placement[id(attn.table)].key, None)


def test_unreplayable_modules_and_recipes_are_loaded():
    recipe = base_recipe()
    recipe.modules["layers.0.qkv"].replayable = False
    recipe.modules["layers.0.qkv"].why = "repacked into oneDNN memory"
    match, _ = choose([recipe], dict(recipe.sources))
    assert match.unmatched == {"layers.0.qkv": "repacked into oneDNN memory"}
    recipe.replayable, recipe.why = False, "the model has its own process_weights_after_loading"
    match, why = choose([recipe], dict(recipe.sources))
    assert match is None and "own process_weights_after_loading" in why


def test_the_recipe_that_maps_the_most_wins_and_demotion_accounts_for_it():
    base, tuned = base_recipe(), base_recipe()
    tuned.sources["l1.q"] = "q1-tuned"
    checkpoint = dict(tuned.sources)
    match, _ = choose([base, tuned], checkpoint)  # the base recipe would reload layer 1
    assert match.recipe is tuned and match.unmatched == {}
    before = match.mapped_bytes
    match.demote({"embed": "no longer resident"})
    assert match.unmatched == {"embed": "no longer resident"}
    assert match.mapped_bytes == before - 4096 * 1024 * 2 and match.read() == {"embed"}


def test_a_recipe_survives_its_bytes_and_names_its_final_keys():
    recipe = base_recipe()
    back = Recipe.from_bytes(recipe.to_bytes())
    assert back == recipe and back.id == recipe.id
    assert back.modules["norm"].tensors[0].inline == b"\x01" * 8
    assert recipe.final() == {key_of("E", "bfloat16", (4096, 1024)): 4096 * 1024 * 2,
                              key_of("QKV0", "bfloat16", (512, 1024)): 512 * 1024 * 2,
                              key_of("QKV1", "bfloat16", (512, 1024)): 512 * 1024 * 2,
                              key_of("ROT", "float32", (8192, 64)): 8192 * 64 * 4}
    other = base_recipe()
    other.sources["norm"] = "n1"
    assert other.id != recipe.id  # another checkpoint content, another recipe
    with pytest.raises(ValueError, match="recipe version"):
        Recipe.from_bytes(b'{"version": 0}')
    with pytest.raises(ValueError, match="not a recipe"):
        Recipe.from_bytes(b'{"version": 1}')


# The recipe contract (issue 30): whatever a recipe holds, what the writer checks is what every
# reader reads.  Hypothesis builds recipes from every kind of entry: keyed, inline, aliased and
# private tensors (the last only in modules that are not replayable), zero-size and empty ones,
# strided views, inline attribute tensors, packed weights keyed or inline with their layout.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_NAMES = st.text("abcdefghijklmnopqrstuvwxyz_.0123456789", min_size=1, max_size=12)
_DTYPES = st.sampled_from(["bfloat16", "float16", "float32", "int8", "uint8", "int32", "bool"])
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**53, 2**53), st.text(max_size=8),
                     st.floats(allow_nan=False, allow_infinity=False))


@st.composite
def _tensor(draw, place: str | None = None, placed: bool = True) -> TensorRecipe:
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    stride = tuple(draw(st.lists(st.integers(0, 64), min_size=len(shape), max_size=len(shape))))
    places = ["key", "inline", "alias", "view"] + ([] if placed else ["none"])
    place = place or draw(st.sampled_from(places))
    t = TensorRecipe(draw(_NAMES), draw(st.booleans()), draw(_DTYPES), shape, stride)
    if place == "key":
        t.key, t.uid = draw(_NAMES), draw(st.one_of(st.just(""), _NAMES))
    elif place == "inline":  # a dense tensor's bytes, as the builder keeps them (size-1 strides address nothing)
        t.stride = tuple(s if n == 1 else c for n, s, c in zip(shape, stride, contiguous_stride(shape)))
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=getattr(torch, t.dtype)).element_size()
        t.inline = draw(st.binary(min_size=nbytes, max_size=nbytes))
    elif place == "alias":
        t.alias = draw(_NAMES)
    elif place == "view":  # MLA's W_UV: a view of kv_b_proj's weight
        t.alias, t.view = draw(_NAMES), draw(st.integers(0, 1 << 40))
    return t


@st.composite
def _packed(draw) -> TensorRecipe:
    n = draw(st.integers(0, 4096))
    t = TensorRecipe("weight", True, "uint8", (n,), (1,))
    if draw(st.booleans()):
        t.key, t.uid = draw(_NAMES), draw(_NAMES)
    else:
        t.inline, t.layout = draw(st.binary(max_size=64)), "onednn:" + draw(st.text("0123456789abcdef", max_size=16))
        t.shape = (len(t.inline),)
    return t


@st.composite
def _module(draw) -> ModuleRecipe:
    replayable = draw(st.booleans())
    return ModuleRecipe(
        draw(st.lists(_NAMES, max_size=4, unique=True).map(sorted)),  # as `build_recipe` writes them
        draw(st.lists(_tensor(placed=replayable), max_size=4, unique_by=lambda t: t.name)), replayable,
        "" if replayable else draw(st.text(max_size=20)), traced := draw(st.booleans()),
        "" if traced else draw(st.text(max_size=20)), draw(st.lists(_tensor(place="inline"), max_size=2, unique_by=lambda t: t.name)),
        draw(st.one_of(st.none(), _packed())), draw(st.text(max_size=20)) if traced else "")


_RECIPES = st.builds(
    Recipe, signature=st.text(max_size=20), sources=st.dictionaries(_NAMES, _NAMES, max_size=6),
    modules=st.dictionaries(_NAMES, _module(), max_size=5), attrs=st.dictionaries(_NAMES, _SCALARS, max_size=3),
    unattributed=st.lists(_NAMES, max_size=3).map(sorted), replayable=st.booleans(), why=st.text(max_size=20))


@settings(max_examples=300, deadline=None)
@given(_RECIPES)
def test_every_recipe_the_writer_checks_reads_back_as_the_same_recipe(recipe):
    data = recipe.checked_bytes()
    back = Recipe.from_bytes(data)
    assert back == recipe
    assert back.id == recipe.id and back.final() == recipe.final()
    assert back.to_bytes() == data


@settings(max_examples=100, deadline=None)
@given(_module(), st.data())
def test_a_replayable_module_with_a_tensor_in_no_place_is_refused_by_the_writer(module, data):
    module.replayable, module.why = True, ""
    module.tensors.append(data.draw(_tensor(place="none", placed=False)))
    with pytest.raises(ValueError, match="must have exactly one of key, inline and alias"):
        Recipe("sig", {}, {"m": module}).checked_bytes()


@settings(max_examples=100, deadline=None)
@given(_tensor(place="view"))
def test_a_view_names_what_it_views_at_an_offset_of_at_least_zero(view):
    module = ModuleRecipe([], [view])
    Recipe("sig", {}, {"m": module}).checked_bytes()  # well formed: accepted
    for broken in ({"alias": None}, {"view": -1}):
        for k, v in broken.items():
            setattr(view, k, v)
        with pytest.raises(ValueError, match="must have exactly one|a view names the tensor it views"):
            Recipe("sig", {}, {"m": module}).checked_bytes()
        view.alias, view.view = "base.weight", 0


# --- a causal-conv weight vLLM's CPU path packed: recorded as the weight it was before ------------
def _placed(*tensors):
    from vllm_dedup.engine.context import Placement

    out = {}
    for i, t in enumerate(tensors):
        out.setdefault((t.dtype, t.numel()), []).append((t, Placement(f"key{i}", f"uid{i}")))
    return out


def test_a_packed_conv_weight_is_recorded_before_packing_from_a_segment_holding_its_bytes():
    import torch

    unpacked = torch.arange(24, dtype=torch.bfloat16).reshape(6, 4)
    other = unpacked.clone()
    other[5, 3] += 1  # same size, one element differs: never taken for it
    from vllm_dedup.engine.recipe_builder import conv_weight_recipe

    entry, why = conv_weight_recipe(unpacked, _placed(other, unpacked.clone()), inline_max=0)
    assert why == ""
    assert (entry.name, entry.param, entry.dtype, entry.shape, entry.stride) == ("weight", True, "bfloat16",
                                                                               (6, 1, 4), (4, 4, 1))
    assert (entry.key, entry.uid, entry.inline) == ("key1", "uid1", None)  # the equal one, not key0
    assert entry.nbytes == unpacked.numel() * 2


def test_a_packed_conv_weight_in_no_segment_is_inline_or_refused_with_its_size():
    import torch

    from vllm_dedup.engine.recipe_builder import conv_weight_recipe

    unpacked = torch.randn(6, 4).to(torch.bfloat16)
    entry, why = conv_weight_recipe(unpacked, {}, inline_max=48)
    assert why == "" and entry.key is None
    restored = torch.frombuffer(bytearray(entry.inline), dtype=torch.bfloat16).as_strided(entry.shape, entry.stride)
    assert torch.equal(restored.view(6, 4), unpacked)
    entry, why = conv_weight_recipe(unpacked, {}, inline_max=47)
    assert entry is None and "48 bytes" in why and "segment" in why


def test_a_recipe_sets_only_plain_attributes_of_the_model():
    from torch import nn

    from vllm_dedup.engine.replay import settable_attribute

    class Model(nn.Module):
        supports_pp = False  # a class flag an instance may shadow

        def __init__(self):
            super().__init__()
            self.config = object()
            self.logits_as_input = None
            self.inner = nn.Linear(2, 2)

        def compute_logits(self, x):
            return x

        @property
        def size(self):
            return 1

    model = Model()
    assert settable_attribute(model, "logits_as_input", True)
    assert settable_attribute(model, "supports_pp", True) and settable_attribute(model, "new_flag", 3)
    for key, value in [("compute_logits", 1), ("size", 2), ("config", "x"), ("inner", None), ("_private", 1),
                       ("logits_as_input", [1]), ("logits_as_input", object())]:
        assert not settable_attribute(model, key, value), key


def test_a_replay_gives_back_every_segment_nothing_it_bound_reads():
    """A segment acquired whose every hit went unused (a demoted module's, a layout refused, a
    tensor post-processing replaced, an embedding's packed copy no handler took) is released at
    the end of the build; the segments of tensors and handlers bound stay held."""
    from types import SimpleNamespace

    from vllm_dedup.engine.context import Placement
    from vllm_dedup.engine.replay import Replay

    released = []
    replay = Replay(SimpleNamespace(lease=SimpleNamespace(release=released.extend)), match=None, where={})
    replay._segment_of = {"u-tensor": 1, "u-demoted": 2, "u-handler": 3}
    replay.held = [1, 2, 3]
    replay.placement = {101: Placement("k-weight", "u-tensor"), 102: Placement("k-packed", "u-handler")}
    replay._release_unused()
    assert released == [2] and replay.held == [1, 3]


def test_a_view_is_bound_only_within_a_contiguous_base():
    """A view's bounds are its base's elements: a base the recipe made stride-0 over a few
    elements would let a view reach the bytes beyond them in the segment."""
    from types import SimpleNamespace

    import pytest
    import torch
    from torch import nn

    from vllm_dedup.engine.recipe import RecipeDeclined
    from vllm_dedup.engine.replay import Replay

    def bind(base: torch.Tensor) -> nn.Module:
        model = nn.Module()
        model.layer = nn.Module()
        model.layer.register_buffer("base", base)
        view = TensorRecipe("view", False, "float32", (4,), (1,), alias="layer.base", view=2)
        recipe = SimpleNamespace(modules={"layer": SimpleNamespace(tensors=[view])})
        Replay(SimpleNamespace(), match=SimpleNamespace(matched=["layer"], recipe=recipe), where={})._bind_views(model)
        return model

    segment = torch.arange(16, dtype=torch.float32)
    model = bind(segment[:8])
    assert torch.equal(model.layer.view, segment[2:6])
    with pytest.raises(RecipeDeclined):
        bind(segment[:1].expand(8))  # eight elements by its shape, one in memory


def test_a_chain_of_modules_sharing_sources_is_loaded_whole_in_one_pass():
    """A changed tensor at the head of a chain (each module shares a source name with the next)
    demotes the whole chain, and an eager module with it; modules off the chain stay mapped.
    `Match.settle` walks the chain through an index: a recipe is a peer's input, and a pass
    over every module per link made an 8000-module chain (2 MB) cost 12 s; now 0.3 s."""
    n = 3000
    sources = {f"s{i}": f"k{i}" for i in range(n + 1)} | {"x": "kx"}
    modules = {f"m{i}": ModuleRecipe([f"s{i}", f"s{i + 1}"], [weight("weight", f"K{i}", rows=1)]) for i in range(n)}
    modules["off"] = ModuleRecipe(["x"], [weight("weight", "KX", rows=1)])
    modules["eager"] = ModuleRecipe([], [weight("weight", "KE", rows=1)], eager="writes it after the loop")
    recipe = Recipe("sig", sources, modules)
    match, why = choose([Recipe.from_bytes(recipe.checked_bytes())], dict(sources, s0="changed"))
    assert match is not None, why
    assert match.matched == {"off"} and len(match.unmatched) == n + 1
    assert match.unmatched["m0"] == "its checkpoint tensors changed"
    assert "shares a checkpoint tensor" in match.unmatched[f"m{n - 1}"]
    assert "partial load writes it" in match.unmatched["eager"]
    assert match.read() == set(sources) - {"x"}


@pytest.mark.parametrize("shape, stride, nbytes, why", [
    ((1 << 40,), (0,), 2, "dense tensor's, not strided"),  # 2 bytes over a terabyte of elements
    ((4, 4), (1, 1), 28, "dense tensor's, not strided"),  # rows overlapping
    ((4,), (1,), 1000, "1000 inline bytes for 4 float32"),  # bytes past the tensor's
    ((4,), (1,), 15, "15 inline bytes for 4 float32"),
    ((-1,), (1,), 0, "one stride per dimension"),
])
def test_inline_bytes_are_exactly_a_dense_tensors(shape, stride, nbytes, why):
    """A recipe is a peer's input: inline bytes bind with ``as_strided``, so only the dense
    layout the builder writes, over exactly its bytes, is read."""
    bad = TensorRecipe("weight", True, "float32", shape, stride, inline=b"\0" * nbytes)
    with pytest.raises(ValueError, match=why):
        Recipe("sig", {}, {"m": ModuleRecipe([], [bad])}).checked_bytes()
    ok = TensorRecipe("weight", True, "float32", (1, 4), (7, 1), inline=b"\0" * 16)  # a size-1 dimension's stride
    Recipe("sig", {}, {"m": ModuleRecipe([], [ok])}).checked_bytes()


def test_a_module_naming_a_tensor_twice_is_refused():
    """A replay binds a module's tensors by name: of two entries of one name the last would be
    bound and the first's segment held for nothing."""
    twice = ModuleRecipe([], [weight("weight", "A"), weight("weight", "B")])
    with pytest.raises(ValueError, match="names a tensor twice"):
        Recipe("sig", {}, {"m": twice}).checked_bytes()


def test_a_mapped_tensor_that_loading_replaced_gives_its_segment_back():
    """A partial replay maps a head and loads an embedding with equal bytes; vLLM's
    ``maybe_retie_word_embeddings`` then binds the head to the embedding's parameter, and the
    mapped head weight dies.  Its placement goes (a dead object's id would name the next object
    made with it) and so does its segment's hold; a mapped tensor still bound keeps both."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from vllm_dedup.engine.replay import Replay

    released = []
    ctx = SimpleNamespace(config=SimpleNamespace(verify=True), device=torch.device("cpu"),
                          lease=SimpleNamespace(release=released.extend))
    model = nn.Module()
    model.head, model.norm, model.embed = nn.Module(), nn.Module(), nn.Module()
    with torch.device("meta"):
        model.head.weight = nn.Parameter(torch.empty(16))
        model.norm.weight = nn.Parameter(torch.empty(16))
    recipe = SimpleNamespace(modules={
        "head": ModuleRecipe([], [TensorRecipe("weight", True, "float32", (16,), (1,), key="K-head", uid="u-head")]),
        "norm": ModuleRecipe([], [TensorRecipe("weight", True, "float32", (16,), (1,), key="K-norm", uid="u-norm")])})
    replay = Replay(ctx, match=SimpleNamespace(recipe=recipe, matched={"head", "norm"}), where={})
    resident = {("K-head", "u-head"): (torch.arange(16.0), "u-head"), ("K-norm", "u-norm"): (torch.ones(16), "u-norm")}
    replay._segment_of, replay.held = {"u-head": 7, "u-norm": 8}, [7, 8]
    for name in ("head", "norm"):
        replay._bind(getattr(model, name), name, resident, {})
    resident.clear()
    model.embed.weight = nn.Parameter(torch.arange(16.0), requires_grad=False)  # loaded, equal bytes
    model.head.weight = model.embed.weight  # the retie
    replay._forget_replaced()
    replay._release_unused()
    assert list(replay.placement.values()) == [replay.placement[id(model.norm.weight)]]
    assert released == [7] and replay.held == [8]
    assert replay.mapped_bytes == 64  # the norm's


def test_a_recipe_naming_layouts_its_keys_do_not_allow_never_outranks_a_sound_one():
    """Recipes are ranked by the bytes they map, which their own layouts claim: a layout its
    content key does not allow (here 10**12 elements over a 4096 x 4096 key) would count bytes
    no segment holds.  Such a module is loaded, not mapped, so the sound recipe wins; a
    squeezed conv layout (dimensions of size 1) and a oneDNN packed weight's bytes fit."""
    key = "bfloat16[4096,4096]/[4096,1]:" + "ab" * 16

    def one(t: TensorRecipe) -> Recipe:
        return Recipe("s", {"a.w": "k1"}, {"a": ModuleRecipe(["a.w"], [t])})

    sound = one(TensorRecipe("weight", True, "bfloat16", (4096, 4096), (4096, 1), key=key, uid="u1"))
    bogus = one(TensorRecipe("weight", True, "bfloat16", (10**12,), (1,), key=key, uid="u2"))
    best, _ = choose([bogus, sound], {"a.w": "k1"})
    assert best.recipe is sound and best.mapped_bytes == 4096 * 4096 * 2
    best, why = choose([bogus], {"a.w": "k1"})
    assert best is None and "maps no module" in why
    for fits in (TensorRecipe("weight", True, "bfloat16", (4096, 1, 4096), (4096, 4096, 1), key=key),
                 TensorRecipe("weight", True, "uint8", (512,), (1,), key="onednn:ab12[512]/[1]:" + "cd" * 16)):
        assert fits.fits(fits.key)
    for misfit in (TensorRecipe("weight", True, "float16", (4096, 4096), (4096, 1), key=key),  # another type
                   TensorRecipe("weight", True, "bfloat16", (4096, 4096), (1, 4096), key=key),  # transposed
                   TensorRecipe("weight", True, "bfloat16", (4096, 4096), (4096, 1), key="not a key")):
        assert not misfit.fits(misfit.key)


def test_buffers_of_one_key_are_tensors_of_their_own_over_the_same_bytes():
    """Two modules' buffers of one content key (equal rotary caches) are bound as two tensors
    over the segment's bytes, as a plain load makes two: post-processing that rebinds one's
    data leaves the other as it was, and forgetting that one keeps the other's placement."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from vllm_dedup.engine.replay import Replay

    ctx = SimpleNamespace(config=SimpleNamespace(verify=True), device=torch.device("cpu"))
    model = nn.Module()
    model.a, model.b = nn.Module(), nn.Module()
    for module in (model.a, model.b):
        module.register_buffer("cache", torch.empty(4, device="meta"))
    entry = ModuleRecipe([], [TensorRecipe("cache", False, "float32", (4,), (1,), key="K", uid="u")])
    recipe = SimpleNamespace(modules={"a": entry, "b": entry})
    replay = Replay(ctx, match=SimpleNamespace(recipe=recipe, matched={"a", "b"}), where={})
    segment = torch.arange(4.0)
    for name in ("a", "b"):
        replay._bind(getattr(model, name), name, {("K", "u"): (segment, "u")}, {})
    assert model.a.cache is not model.b.cache and model.a.cache.data_ptr() == model.b.cache.data_ptr()
    model.a.cache.data = torch.ones(4)  # a's post-processing makes its own
    assert torch.equal(model.b.cache, torch.arange(4.0))
    replay._forget_replaced()
    assert list(replay.placement) == [id(model.b.cache)]


@pytest.mark.parametrize("recorded", [("float32", (16,), (1,)), ("float32", (4, 4), (4, 1)), ("float16", (16,), (1,)),
                                      ("float32", (8,), (2,))])
def test_a_tied_weight_is_replayed_only_as_the_recipe_recorded_it(recorded):
    """A recipe ties the head to the embedding (an alias).  The replay binds it without looking,
    so after post-processing it checks the head is the embedding's tensor in the dtype, shape
    and stride the recipe recorded: a peer's recipe naming another layout is declined (the
    engine then loads as usual), never replayed as a model no plain load makes."""
    from types import SimpleNamespace

    import torch
    from torch import nn

    from vllm_dedup.engine.replay import Replay

    dtype, shape, stride = recorded
    ctx = SimpleNamespace(config=SimpleNamespace(verify=True), device=torch.device("cpu"),
                          lease=SimpleNamespace(release=lambda held: None))
    model = nn.Module()
    model.embed, model.head = nn.Module(), nn.Module()
    with torch.device("meta"):
        model.embed.weight = nn.Parameter(torch.empty(16))
        model.head.weight = nn.Parameter(torch.empty(16))
    recipe = SimpleNamespace(modules={
        "embed": ModuleRecipe([], [TensorRecipe("weight", True, "float32", (16,), (1,), key="K", uid="u")]),
        "head": ModuleRecipe([], [TensorRecipe("weight", True, dtype, shape, stride, alias="embed.weight")])})
    replay = Replay(ctx, match=SimpleNamespace(recipe=recipe, matched={"embed", "head"}), where={})
    replay._segment_of, replay.held = {"u": 7}, [7]
    replay._bind(model.embed, "embed", {("K", "u"): (torch.arange(16.0), "u")}, {})
    replay._alias(model)
    assert model.head.weight is model.embed.weight
    if recorded == ("float32", (16,), (1,)):
        replay._check_aliases(model)
    else:
        with pytest.raises(RecipeDeclined, match="head: weight is not embed.weight in the recipe's"):
            replay._check_aliases(model)
