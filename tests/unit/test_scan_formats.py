"""Every input format `scan` takes, on real weights: GGUF, PyTorch .bin, Diffusers pipelines."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file

from helpers import scan_json


@pytest.mark.heavy
def test_gguf_counts_raw_quantized_blocks_and_two_copies_share_everything(gguf_path, smollm2, tmp_path):
    """One scan (parsing a GGUF's 49k-token vocabulary takes the gguf library about 3 s)."""
    reader = gguf.GGUFReader(str(gguf_path))
    copy = tmp_path / "copy.gguf"
    shutil.copy(gguf_path, copy)
    data = scan_json(gguf_path, smollm2, copy, cache=tmp_path / "c")
    model = data["models"][0]
    assert model["tensors"] == len(reader.tensors) == 272
    assert model["bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    pairs = {(p["a"], p["b"]): p["shared_bytes"] for p in data["pairs"]}
    # Q4_1 blocks are not the dequantized bf16 tensors: nothing is shared by content.
    assert pairs[(str(gguf_path), str(smollm2))] == 0
    assert pairs[(str(gguf_path), str(copy))] == model["bytes"]


def test_pytorch_bin_matches_the_same_weights_in_safetensors(minilm, tmp_path):
    tensors = load_file(minilm / "model.safetensors")
    folder = tmp_path / "bin-model"
    folder.mkdir()
    torch.save(tensors, folder / "pytorch_model.bin")
    data = scan_json(minilm, folder, cache=tmp_path / "c")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert data["models"][1] == {**data["models"][1], "tensors": 104, "bytes": total}
    assert data["pairs"][0]["shared_bytes"] == total


def test_diffusers_pipeline_folder_scans_every_component(minilm, smollm2, tmp_path):
    """A pipeline whose text encoder is a frozen copy of MiniLM (like IF's shared T5)."""
    pipe = tmp_path / "pipeline"
    (pipe / "text_encoder").mkdir(parents=True)
    (pipe / "decoder").mkdir()
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "TestPipeline"}))
    shutil.copy(minilm / "model.safetensors", pipe / "text_encoder" / "model.safetensors")
    shutil.copy(minilm / "config.json", pipe / "text_encoder" / "config.json")
    torch.save(load_file(smollm2 / "model.safetensors"), pipe / "decoder" / "diffusion_pytorch_model.bin")
    data = scan_json(pipe, minilm, smollm2, cache=tmp_path / "c")
    assert data["models"][0]["tensors"] == 104 + 272
    pairs = {(p["a"], p["b"]): p["shared_bytes"] for p in data["pairs"]}
    assert pairs[(str(pipe), str(minilm))] == data["models"][1]["bytes"]
    assert pairs[(str(pipe), str(smollm2))] == data["models"][2]["bytes"]


def test_single_safetensors_file(minilm, tmp_path):
    data = scan_json(minilm / "model.safetensors", minilm, cache=tmp_path)
    assert data["pairs"][0]["shared_bytes"] == data["models"][0]["bytes"] == data["models"][1]["bytes"]
