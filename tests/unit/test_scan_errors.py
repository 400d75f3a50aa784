"""Bad input: one clear line naming the file, a non-zero exit, nothing written but the cache."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch

from helpers import cli, run_cli


def _tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*") if p.is_file())


class _Reduces:
    """Pickled as a call of ``os.getcwd``: what a hostile ``.bin`` does with ``os.system``."""

    def __reduce__(self):
        return (os.getcwd, ())


@pytest.fixture
def bad_inputs(minilm, gguf_path, tmp_path):
    """name -> (path, words the error line must contain)."""
    root = tmp_path / "inputs"
    root.mkdir()
    data = (minilm / "model.safetensors").read_bytes()

    (root / "truncated.safetensors").write_bytes(data[: len(data) // 2])

    corrupt = bytearray(data)
    corrupt[12:15] = b"\xff\xff\xff"
    (root / "corrupt-header.safetensors").write_bytes(bytes(corrupt))

    (root / "weights.npz").write_bytes(b"PK\x03\x04 not weights")
    (root / "empty-folder").mkdir()

    gdata = gguf_path.read_bytes()
    (root / "truncated.gguf").write_bytes(gdata[: len(gdata) // 3])

    writer = gguf.GGUFWriter(str(root / "unknown-type.gguf"), "llama")
    writer.add_tensor("t", np.arange(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(root / "unknown-type.gguf"), "r+")
    reader.tensors[0].field.parts[4][0] = 999  # the tensor-info's GGML type field
    del reader

    (root / "truncated.bin").write_bytes(b"PK\x03\x04" + os.urandom(100))
    torch.save({"weight": torch.ones(4), "run": _Reduces()}, root / "pickle-with-a-call.bin")

    return {
        "missing": (root / "does-not-exist", "no such file or directory"),
        "truncated safetensors": (root / "truncated.safetensors", "corrupt or truncated safetensors"),
        "corrupt header": (root / "corrupt-header.safetensors", "header"),
        "unknown format": (root / "weights.npz", "unknown weight format '.npz'"),
        "folder without weights": (root / "empty-folder", "holds no weight files"),
        "truncated gguf": (root / "truncated.gguf", "GGUF"),
        "unknown gguf tensor type": (root / "unknown-type.gguf", "unknown GGML tensor type"),
        "truncated bin": (root / "truncated.bin", "cannot load PyTorch weights"),
        # torch's advice (weights_only=False, allow-listing the global) would run the file's pickle
        "pickle naming a call": (root / "pickle-with-a-call.bin",
                                 "cannot load PyTorch weights (UnpicklingError: Trying to load unsupported GLOBAL "
                                 "posix.getcwd whose module posix is blocked): "),
    }


@pytest.mark.heavy
def test_each_bad_input_gives_one_clear_line_and_exit_2(bad_inputs, tmp_path):
    cache = tmp_path / "cache"
    for name, (path, words) in bad_inputs.items():
        before = _tree(path.parent)
        proc = cli("scan", str(path), cache=cache)
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (name, proc.stderr)
        assert lines[0].startswith(f"vllm-dedup scan: error: {path}: "), (name, lines[0])
        assert words in lines[0], (name, lines[0])
        assert "Traceback" not in proc.stderr and "weights_only" not in proc.stderr
        assert _tree(path.parent) == before, name
    # Nothing but manifests (of no file at all here) was written to the cache.
    assert not cache.exists() or all(p.suffix == ".json" for p in cache.rglob("*") if p.is_file())


@pytest.mark.heavy
def test_keep_going_reports_the_readable_models(bad_inputs, minilm, tmp_path):
    bad = [str(p) for p, _ in bad_inputs.values()]
    proc = cli("scan", "--json", "--keep-going", str(minilm), *bad, str(minilm), cache=tmp_path / "c")
    assert proc.returncode == 1
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [m["path"] for m in data["models"]] == [str(minilm), str(minilm)]
    assert data["pairs"][0]["shared_bytes"] == data["models"][0]["bytes"]
    assert sorted(e["path"] for e in data["errors"]) == sorted(bad)
    assert len([line for line in proc.stderr.splitlines() if "error:" in line]) == len(bad)


def test_unreadable_file_is_reported(minilm, tmp_path):
    """A file the user may not read (as root, checked without the capabilities that override
    file permissions)."""
    folder = tmp_path / "unreadable"
    folder.mkdir()
    shutil.copy(minilm / "model.safetensors", folder / "model.safetensors")
    (folder / "model.safetensors").chmod(0)
    try:
        proc = run_cli("scan", "--no-cache", str(folder), obey_permissions=True)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == (
            f"vllm-dedup scan: error: {folder / 'model.safetensors'}: cannot read: Permission denied"
        )

        folder.chmod(0)  # now the folder itself cannot be entered
        proc = run_cli("scan", "--no-cache", str(folder / "model.safetensors"), obey_permissions=True)
        assert proc.returncode == 2, proc.stderr
        assert "cannot read: Permission denied" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        folder.chmod(0o700)


def test_negative_min_bytes_is_a_usage_error(minilm):
    proc = run_cli("scan", "--min-bytes", "-1", str(minilm))
    assert proc.returncode == 2 and "must be >= 0" in proc.stderr


def test_a_model_folders_subfolders_and_trainer_files_are_not_its_weights(tmp_path):
    """What a loader reads of a model folder is its own weights: a Trainer's ``checkpoint-500/``
    and Meta's ``original/`` beside them are other copies (counted twice, they would double
    the model), and ``training_args.bin`` is a pickled object, not tensors.  A pipeline
    (``model_index.json``) and a folder without weights of its own still read subfolders."""
    from vllm_dedup.scan.files import model_files

    def touch(*names):
        for name in names:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_bytes(b"")

    touch("m/model.safetensors", "m/checkpoint-500/model.safetensors", "m/original/consolidated.00.pth",
          "t/pytorch_model.bin", "t/training_args.bin", "t/optimizer.pt", "t/rng_state_0.pth",
          "p/model_index.json", "p/unet/diffusion_pytorch_model.safetensors", "p/vae/model.safetensors",
          "p/unet/diffusion_pytorch_model.fp16.safetensors", "p/unet/diffusion_pytorch_model.non_ema.safetensors",
          "p/text_encoder/model.fp16.safetensors", "o/consolidated.00.pth", "o/consolidated.01.pth",
          "n/a/model.safetensors")
    names = {folder: [str(p.relative_to(tmp_path / folder)) for p in model_files(tmp_path / folder)]
             for folder in "mtpon"}
    # A component's variants beside it (Diffusers' NAME.VARIANT.SUFFIX) are not loaded with it; a
    # variant alone is all there is of its component, and numbered files without a base are shards.
    assert names == {"m": ["model.safetensors"], "t": ["pytorch_model.bin"],
                     "p": ["text_encoder/model.fp16.safetensors", "unet/diffusion_pytorch_model.safetensors",
                           "vae/model.safetensors"],
                     "o": ["consolidated.00.pth", "consolidated.01.pth"],
                     "n": ["a/model.safetensors"]}


def test_a_file_reached_by_two_paths_is_one_models_once(tmp_path):
    """A symlinked subfolder (or a hard link) reaches the same file again: counted twice, one
    model's bytes would be "shared" with themselves."""
    from vllm_dedup.scan.files import model_files

    (tmp_path / "n" / "a").mkdir(parents=True)
    (tmp_path / "n" / "a" / "model.safetensors").write_bytes(b"")
    (tmp_path / "n" / "b").symlink_to(tmp_path / "n" / "a")
    (tmp_path / "n" / "c").mkdir()
    os.link(tmp_path / "n" / "a" / "model.safetensors", tmp_path / "n" / "c" / "model.safetensors")
    assert [str(p.relative_to(tmp_path / "n")) for p in model_files(tmp_path / "n")] == ["a/model.safetensors"]


def test_a_folder_of_several_gguf_quantisations_is_refused_and_a_split_one_is_read(tmp_path):
    """A GGUF repository's folder often holds several quantisations of one model: summed, they
    would be counted as one model several times its size.  A model split by llama.cpp's
    gguf-split is one model."""
    from vllm_dedup.errors import CheckpointError
    from vllm_dedup.scan.files import model_files

    for name in ("q/model-Q8_0.gguf", "q/model-F16.gguf",
                 "s/model-00001-of-00002.gguf", "s/model-00002-of-00002.gguf"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(CheckpointError, match="2 GGUF files that are not one split model.*one .gguf file at a time"):
        model_files(tmp_path / "q")
    assert [p.name for p in model_files(tmp_path / "q" / "model-F16.gguf")] == ["model-F16.gguf"]
    assert [p.name for p in model_files(tmp_path / "s")] == ["model-00001-of-00002.gguf", "model-00002-of-00002.gguf"]
