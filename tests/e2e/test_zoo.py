"""The model zoo's CI subset: on every dedup load path, an engine's final tensors are exactly a
plain load's with the same options, or the fast path was declined, saying why; never a wrong
weight.

The whole zoo (27 architectures) is ``benchmarks/zoo.py``; here `harness.zoo.CI_SUBSET`, the
riskiest cases: a tied head (Qwen2), untied heads with MoE experts filled through ``copy_`` and
attention sinks (gpt-oss), a tensor of one module derived from another's checkpoint tensor
(BertForMaskedLM: the MLM decoder is the word embedding), an SSM whose mixer views a
parameter of another module (Mamba2), and MLA with MoE (DeepSeek-V3: W_UV and W_UK_T are views
of kv_b_proj's weight).  For each: the references (a dedup engine alone with the
fast path off, `harness.references`) of the base checkpoint and of its last-layers
fine-tune, then a first dedup engine (path ``none``), a second (``full``) and the fine-tune
(``modules``) while the first is up (`harness.zoo.run_arch`).

The oracle (`harness.oracle`) digests every parameter, buffer and attribute tensor of the
engine's model.  That it can see a wrong weight is checked on the same run: the fine-tune's
reference differs from the base's reference in exactly the perturbed layers.
"""

from __future__ import annotations

import time

import pytest

from harness.procs import processes_matching
from harness.zoo import CI_SUBSET, MODULES_DECLINES, SECOND_DECLINES, layer_indices, run_arch


def _why(row: dict) -> str:
    return "\n".join([row.get("error", ""), *row.get("differences", [])[:20], *row.get("log", [])])


@pytest.mark.parametrize("name", CI_SUBSET)
def test_every_load_path_leaves_a_plain_loads_final_tensors(name, tmp_path, monkeypatch, cache_root):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "no-ray"))  # no local Ray cluster to find
    embeddings = name == "bert_mlm"  # the fine-tune that matters there; the benchmark runs the others
    result = run_arch(name, tmp_path, plain=False, embeddings=embeddings)
    assert not result["errors"], result["errors"]

    # The oracle sees the fine-tune's changed layers, and nothing else, as different.
    changed_layers = layer_indices(result["changed_tensors"])
    seen = result["reference"]["base_vs_last_layers"]
    assert seen and layer_indices(n.split(":", 1)[1] for n in seen) == changed_layers, seen
    assert all(layer_indices([n.split(":", 1)[1]]) for n in seen), seen  # no head, embedding or final norm

    rows = result["engines"]
    roles = {"first", "second", "last-layers"} | ({"embeddings"} if embeddings else set())
    assert set(rows) == roles, rows.keys()
    for role, row in rows.items():
        assert row["verdict"] in ("equal", "declined"), f"{name} {role}: {row['verdict']}\n{_why(row)}"
        assert not row["meta_tensors"], f"{name} {role}: meta tensors {row['meta_tensors']}"
        if row["verdict"] == "declined":  # said why, in one line
            assert any("loading from the checkpoint:" in line or "recipe maps" in line for line in row["log"]), \
                _why(row)
    assert rows["first"]["path"] == "none"
    # A second engine of the unchanged checkpoint maps everything, wherever it can (the known
    # exceptions say why: harness.zoo.SECOND_DECLINES).
    if name not in SECOND_DECLINES:
        assert (rows["second"]["verdict"], rows["second"]["path"]) == ("equal", "full"), _why(rows["second"])
    # A fine-tune maps its unchanged modules and loads the rest (harness.zoo.MODULES_DECLINES).
    if name not in MODULES_DECLINES:
        for role in roles - {"first", "second"}:
            assert (rows[role]["verdict"], rows[role]["path"]) == ("equal", "modules"), _why(rows[role])
    # Greedy tokens (or pooled outputs) of the dedup engines of one checkpoint are equal, and
    # the fine-tune's equal its reference's.
    assert all(rows[role]["outputs_equal"] for role in roles - {"first"})
    assert rows["first"]["outputs"] == result["reference"]["base"]["outputs"]
    # run_arch stopped its registry: no daemon of it is left.
    sock = str(tmp_path / name / "run" / "vllm-dedup.sock").encode()
    deadline = time.monotonic() + 15
    while processes_matching(b"vllm_dedup.registry.daemon", sock) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_matching(b"vllm_dedup.registry.daemon", sock)
