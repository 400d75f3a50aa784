"""Recipes through a real registry: kept per share group and signature, handed to later engines as
sealed memfds, refused when they are not what they claim."""

from __future__ import annotations

import json
import os

import pytest

from harness.procs import fd_targets
from vllm_dedup.engine.recipe import ModuleRecipe, Recipe, TensorRecipe
from vllm_dedup.errors import RegistryUnavailable
from vllm_dedup.registry.client import RegistryClient, registry_stats


def recipe(norm_key: str) -> Recipe:
    return Recipe("sig", {"norm": norm_key}, {
        "norm": ModuleRecipe(["norm"], [TensorRecipe("weight", True, "bfloat16", (1024,), (1,), key=f"K-{norm_key}")]),
    })


def memfds() -> int:
    return sum(t.startswith("/memfd:") for t in fd_targets())


def test_recipes_are_kept_per_group_and_signature_and_handed_out_newest_first(registry_server):
    before = memfds()
    with RegistryClient(registry_server.path) as a, RegistryClient(registry_server.path) as b, RegistryClient(registry_server.path) as other:
        a.hello("base", "cpu", "default", "sig")
        b.hello("tuned", "cpu", "default", "sig")
        other.hello("x", "cpu", "elsewhere", "sig")
        a.put_recipe(recipe("n0").to_bytes())
        b.put_recipe(recipe("n1").to_bytes())
        got = [Recipe.from_bytes(data) for data in b.get_recipes("sig")]
        assert [r.sources["norm"] for r in got] == ["n1", "n0"]
        assert other.get_recipes("sig") == [] and a.get_recipes("another-signature") == []
        a.put_recipe(recipe("n0").to_bytes())  # the same checkpoint again: replaces, becomes newest
        assert [Recipe.from_bytes(d).sources["norm"] for d in a.get_recipes("sig")] == ["n0", "n1"]
    # Engines gone: the recipes stay (they name keys, not holds); the registry keeps one memfd each.
    assert registry_stats(registry_server.path).engines == []
    assert len(registry_server.registry.recipes[("default", "sig")]) == 2
    assert memfds() == before + 2  # the registry runs in this process: its two, none of ours leaked


def test_a_recipe_that_is_not_a_sealed_memfd_or_not_a_recipe_is_refused(registry_server):
    with RegistryClient(registry_server.path) as client:
        client.hello("m", "cpu", "default", "sig")
        with pytest.raises(RegistryUnavailable, match="not a recipe"):
            client.put_recipe(json.dumps({"signature": "sig"}).encode())
        unsealed = os.memfd_create("not-sealed", os.MFD_CLOEXEC)
        os.write(unsealed, b"{}")
        from vllm_dedup.registry import messages as m

        with pytest.raises(RegistryUnavailable, match="sealed memfd"):
            client._call(m.PutRecipe(2), m.Empty, [unsealed])
        os.close(unsealed)
        assert client.get_recipes("sig") == []
    assert registry_server.registry.recipes == {}
