"""Recipes: what a recipe says a checkpoint may map, and the recipe's bytes on the wire.  Real
engines build and use recipes in tests/e2e/test_fast_path.py; here the matching rules."""

from __future__ import annotations

import pytest

from vllm_dedup.engine.recipe import ModuleRecipe, Recipe, TensorRecipe, choose

MB = 1 << 20


def weight(name: str, key: str, rows: int = 512) -> TensorRecipe:
    return TensorRecipe(name, True, "bfloat16", (rows, 1024), (1024, 1), key=key)


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
                                                     key="ROT")]),
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
    match.demote("embed", "no longer resident")
    assert match.unmatched == {"embed": "no longer resident"}
    assert match.mapped_bytes == before - 4096 * 1024 * 2 and match.read() == {"embed"}


def test_a_recipe_survives_its_bytes_and_names_its_final_keys():
    recipe = base_recipe()
    back = Recipe.from_bytes(recipe.to_bytes())
    assert back == recipe and back.id == recipe.id
    assert back.modules["norm"].tensors[0].inline == b"\x01" * 8
    assert recipe.final() == {"E": 4096 * 1024 * 2, "QKV0": 512 * 1024 * 2, "QKV1": 512 * 1024 * 2,
                              "ROT": 8192 * 64 * 4}
    other = base_recipe()
    other.sources["norm"] = "n1"
    assert other.id != recipe.id  # another checkpoint content, another recipe
    with pytest.raises(ValueError, match="recipe version"):
        Recipe.from_bytes(b'{"version": 0}')
    with pytest.raises(ValueError, match="not a recipe"):
        Recipe.from_bytes(b'{"version": 1}')
