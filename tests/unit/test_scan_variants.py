"""`vllm-dedup scan` on the real SmolLM2 and its variants reports exactly the shared bytes.

The expected numbers are computed here independently of `vllm_dedup.content.keys`: every tensor is
read with safetensors and identified by (dtype, shape, SHA-256 of its bytes); where two such
identities match, the tensors are also compared element for element with ``torch.equal``.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from helpers import cli, scan_json
from vllm_dedup.scan.files import model_files


def identities(model_dir) -> dict[tuple, int]:
    """(dtype, shape, sha256) -> nbytes for every distinct tensor content of a model."""
    out = {}
    for f in model_files(model_dir):
        for t in load_file(f).values():
            raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            out[(str(t.dtype), tuple(t.shape), hashlib.sha256(raw).hexdigest())] = len(raw)
    return out


def all_tensors(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in model_files(model_dir):
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module")
def report(smollm2, variants, tmp_path_factory):
    order = [smollm2, *variants.values()]
    return order, scan_json(*order, cache=tmp_path_factory.mktemp("manifests"))


def test_each_variant_shares_exactly_the_unchanged_bytes(report, smollm2, variants):
    order, data = report
    ids = [identities(p) for p in order]
    # A real checkpoint: no two tensors of the base have the same content, so "shared bytes"
    # cannot be inflated by within-model repeats.
    assert sum(ids[0].values()) == data["models"][0]["bytes"]
    pairs = {(p["a"], p["b"]): p["shared_bytes"] for p in data["pairs"]}
    for i in range(len(order)):
        for j in range(i + 1, len(order)):
            expected = sum(n for k, n in ids[i].items() if k in ids[j])
            assert pairs[(str(order[i]), str(order[j]))] == expected, (order[i], order[j])


def test_variant_shares_match_how_each_variant_was_made(report, smollm2, variants):
    """The independent counts above agree with what each variant kind must share."""
    _, data = report
    base = all_tensors(smollm2)
    total = sum(t.numel() * t.element_size() for t in base.values())
    shared = {p["b"]: p["shared_bytes"] for p in data["pairs"] if p["a"] == str(smollm2)}

    assert shared[str(variants["renamed-resharded"])] == total
    assert len(model_files(variants["renamed-resharded"])) > 1

    last = {n: t for n, t in base.items() if ".layers.28." in n or ".layers.29." in n}
    assert len(last) == 18
    assert shared[str(variants["last-layers"])] == total - sum(t.numel() * t.element_size() for t in last.values())
    changed = all_tensors(variants["last-layers"])
    assert all(not torch.equal(changed[n], t) for n, t in last.items())

    embed = base["model.embed_tokens.weight"]
    assert shared[str(variants["vocab-extended"])] == total - embed.numel() * embed.element_size()
    extended = all_tensors(variants["vocab-extended"])["model.embed_tokens.weight"]
    assert extended.shape == (49160, 576) and torch.equal(extended[:49152], embed)

    assert shared[str(variants["fp16"])] == 0


def test_totals_unique_and_saved_bytes(report):
    order, data = report
    ids = [identities(p) for p in order]
    everything = {}
    for m in ids:
        everything.update(m)
    assert data["total_bytes"] == sum(m["bytes"] for m in data["models"])
    assert data["unique_bytes"] == sum(everything.values())
    assert data["saved_bytes"] == data["total_bytes"] - data["unique_bytes"]
    assert [m["tensors"] for m in data["models"]] == [272] * len(order)


def test_largest_shared_is_the_embedding(report, smollm2):
    _, data = report
    top = data["largest_shared"][0]
    assert top["shape"] == [49152, 576] and top["dtype"] == "bfloat16"
    assert Counter(p.rsplit(":", 1)[1] for p in top["places"]) == Counter(
        {"model.embed_tokens.weight": 2, "embed_tokens.weight": 1}
    )


def test_min_bytes_leaves_small_tensors_out(smollm2, variants, tmp_path):
    data = scan_json(smollm2, variants["last-layers"], cache=tmp_path, extra=("--min-bytes", "100000"))
    base = all_tensors(smollm2)
    big = {n: t for n, t in base.items() if t.numel() * t.element_size() >= 100000}
    assert data["models"][0]["tensors"] == len(big) < len(base)
    assert data["models"][0]["bytes"] == sum(t.numel() * t.element_size() for t in big.values())


def test_human_report_names_models_and_totals(smollm2, variants, tmp_path):
    proc = cli("scan", str(smollm2), str(variants["last-layers"]), cache=tmp_path, check=True)
    assert "bytes shared by each pair" in proc.stdout
    assert "saved bytes" in proc.stdout and str(variants["last-layers"]) in proc.stdout


def test_shared_with_earlier_counts_each_model_against_those_before_it(smollm2, variants, tmp_path):
    from vllm_dedup.scan.files import scan_model
    from vllm_dedup.checkpoint.manifest import ManifestCache
    from vllm_dedup.scan.report import Report

    models = [smollm2, variants["last-layers"], variants["vocab-extended"], variants["fp16"]]
    report = Report([scan_model(m, cache=ManifestCache(tmp_path), progress=False) for m in models])
    ids = [identities(m) for m in models]
    expected = [sum(n for k, n in ids[i].items() if any(k in ids[j] for j in range(i))) for i in range(len(models))]
    assert report.shared_with_earlier_bytes() == expected
    assert expected[0] == 0 and expected[3] == 0 and expected[2] > expected[1] * 0.8


def test_variants_of_two_bases_of_one_folder_name_are_kept_apart(tmp_path):
    """`harness.variants.cached_variant` names a variant's folder by its base's identity:
    teamA/model and teamB/model, or a base rewritten since, never get each other's variant."""
    import os

    from harness.variants import _identity

    a, b = tmp_path / "teamA" / "model", tmp_path / "teamB" / "model"
    for folder, value in ((a, 1.0), (b, 1.0)):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(bytes([int(value)]) * 64)
        (folder / "config.json").write_text("{}")
    assert _identity(a) != _identity(b)  # same name, same bytes, another place
    before = _identity(a)
    (a / "model.safetensors").write_bytes(b"\2" * 64)
    os.utime(a / "model.safetensors", ns=(1, 1))
    assert _identity(a) != before
