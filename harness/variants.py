"""Variants of an HF model folder, built the way users end up with them.

Nothing on PyPI ships a real base model together with a fine-tune of it, so the
tests, the demo and the benchmarks derive variants from a real model.  Each kind mimics how such
checkpoints arise; the text says what a content-matching scan or loader should find shared with
the base:

``renamed-resharded``
    The same weights saved again as a headless base model (``LlamaModel.save_pretrained``: no
    ``model.`` prefix) in shards of at most 64 MB.  Every file's bytes differ; every tensor is
    shared.  For scans only: vLLM's causal-LM classes expect the prefixed names.
``last-layers``
    The last two decoder layers retrained (here: perturbed with seeded noise of 1% of each
    tensor's standard deviation).  Shared: everything except those layers' tensors.
``retrained``
    Every floating-point tensor retrained (perturbed as ``last-layers`` perturbs its layers): a
    full fine-tune, which shares nothing bit for bit with its base but has its names, dtypes and
    shapes.  The trust tests craft collisions with it.
``vocab-extended``
    A few tokens added to the vocabulary: the embedding matrix (and an untied head) grows by
    that many rows, the tokenizer and ``vocab_size`` follow.  Shared: everything except the
    embedding and head.
``fp16``
    A float16 copy.  Shared: nothing (a different dtype is different content).
``fp32``
    A float32 copy (twice the bytes: the load benchmark's model of at least 500 MB).
``w8a8-int8``
    Quantized as llm-compressor saves a W8A8 int8 ``compressed-tensors`` checkpoint: the decoder
    layers' linear weights as per-output-channel symmetric int8 with float32 ``weight_scale``,
    activations quantized per token at run time; embeddings and norms as they were.  vLLM's CPU
    backend serves it (oneDNN int8 kernels).

``fp32``, ``w8a8-int8`` and ``retrained`` are not in `VARIANT_KINDS`, which the session fixtures
build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

__all__ = ["VARIANT_KINDS", "build_variant", "cached_variant", "load_state_dict", "save_state_dict"]

VARIANT_KINDS = ("renamed-resharded", "last-layers", "vocab-extended", "fp16")
_DTYPES = {"fp16": "float16", "fp32": "float32"}
_OTHER_KINDS = ("w8a8-int8", "retrained")
_LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")

_ADDED_TOKENS = [f"<|variant_token_{i}|>" for i in range(8)]


def load_state_dict(model_dir: Path) -> dict:
    """Every tensor of an HF folder's safetensors files, read into memory (name -> tensor)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def save_state_dict(tensors: dict, out_dir: Path, max_shard_size: str | int | None = None) -> None:
    """Write tensors as ``model.safetensors``, or as shards plus ``model.safetensors.index.json``.

    Sharding uses huggingface_hub's ``split_torch_state_dict_into_shards`` (the same rule
    transformers uses); ``max_shard_size`` is bytes or a string like ``"64MB"``.
    """
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if max_shard_size is None:
        save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
        return
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, out_dir / filename, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def staging_copy(base: Path, out: Path) -> Path:
    """A fresh temporary folder beside ``out`` holding ``base``'s files other than its weights
    (config, tokenizer): the caller writes the weights into it, then renames it to ``out``
    (``os.replace``), so that ``out`` appears whole or not at all."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy2(f, tmp / f.name)
    return tmp


def _layer_count(config: dict) -> int:
    return int(config.get("num_hidden_layers") or config["text_config"]["num_hidden_layers"])


def build_variant(base: Path, kind: str, out_dir: Path, seed: int = 0) -> Path:
    """Build variant ``kind`` (one of `VARIANT_KINDS`) of the HF folder ``base`` in ``out_dir``.

    Non-weight files (config, tokenizer, templates) are copied.  The folder appears atomically.

    Raises:
        ValueError: ``kind`` is not a known variant kind.
    """
    import torch

    if kind not in VARIANT_KINDS and kind not in _DTYPES and kind not in _OTHER_KINDS:
        raise ValueError(f"unknown variant kind {kind!r}; choose one of "
                         f"{', '.join([*VARIANT_KINDS, 'fp32', *_OTHER_KINDS])}")
    base, out_dir = Path(base), Path(out_dir)
    tmp = staging_copy(base, out_dir)
    config = json.loads((base / "config.json").read_text())
    tensors = load_state_dict(base)
    shard = None

    if kind == "renamed-resharded":
        tensors = {re.sub(r"^model\.", "", k): v for k, v in tensors.items()}
        shard = "64MB"
    elif kind in ("last-layers", "retrained"):
        n = _layer_count(config)
        changed = re.compile(rf"\.layers\.({n - 2}|{n - 1})\." if kind == "last-layers" else "")
        gen = torch.Generator().manual_seed(seed)
        for name, t in tensors.items():
            if changed.search(name) and t.is_floating_point():
                tensors[name] = perturbed(t, gen)
    elif kind == "vocab-extended":
        from transformers import AutoTokenizer

        extra = len(_ADDED_TOKENS)
        for name, t in tensors.items():
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                # New rows start at the mean embedding, as transformers' resize does by default.
                tensors[name] = torch.cat([t, t.float().mean(0, keepdim=True).to(t.dtype).expand(extra, -1)])
        config["vocab_size"] = int(config["vocab_size"]) + extra
        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.add_tokens(_ADDED_TOKENS)
        tokenizer.save_pretrained(tmp)
    elif kind == "w8a8-int8":
        for name in [n for n in tensors if _LINEAR.search(n)]:
            weight = tensors[name].float()
            scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
            tensors[name] = torch.round(weight / scale).clamp(-128, 127).to(torch.int8)
            tensors[name.replace(".weight", ".weight_scale")] = scale
        int8 = {"num_bits": 8, "type": "int", "symmetric": True}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {**int8, "strategy": "channel", "dynamic": False},
                                          "input_activations": {**int8, "strategy": "token", "dynamic": True}}},
        }
    elif kind in _DTYPES:
        dtype = getattr(torch, _DTYPES[kind])
        tensors = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
        config["torch_dtype"] = config["dtype"] = _DTYPES[kind]

    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_state_dict(tensors, tmp, shard)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def perturbed(t, gen):
    """``t`` (a floating-point tensor) plus seeded Gaussian noise of 1% of its standard deviation,
    computed in float32 and rounded to ``t``'s dtype: a fine-tune's change to one tensor.  The
    same ``gen`` state gives the same bytes, so cached variants stay valid."""
    import torch

    noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
    return (t.float() + 0.01 * t.float().std() * noise).to(t.dtype)


def cached_variant(base: Path, kind: str) -> Path:
    """Variant ``kind`` of ``base``, built once under ``<models_dir>/variants/`` and reused after
    (`sample_models.models_dir`), in a folder named by the base's identity (`_identity`): two
    bases of one folder name, or a base rewritten since, never get each other's variant.

    Concurrent callers (pytest-xdist workers) build it once: `sample_models.build_lock`.

    Raises:
        ValueError: ``kind`` is not a known variant kind.
    """
    from .sample_models import build_lock, models_dir

    out = models_dir() / "variants" / f"{Path(base).name}-{_identity(Path(base))}-{kind}"
    if (out / "config.json").exists():
        return out
    with build_lock(out.parent):
        return out if (out / "config.json").exists() else build_variant(base, kind, out)


def _identity(base: Path) -> str:
    """16 hex digits naming a model folder as it is now: its resolved path, and the name, size
    and modification time of each file in it."""
    import xxhash

    digest = xxhash.xxh3_64(str(base.resolve()).encode())
    for f in sorted(p for p in base.iterdir() if p.is_file()):
        info = f.stat()
        digest.update(f"\0{f.name}\0{info.st_size}\0{info.st_mtime_ns}".encode())
    return digest.hexdigest()


def smollm2_family(n: int = 3) -> dict[str, Path]:
    """The demo's model family: SmolLM2-135M-Instruct and up to two of its variants
    (``last-layers``, ``vocab-extended``), as model id -> folder, built once and cached.

    Raises:
        ValueError: ``n`` is not 1, 2 or 3.
    """
    from .sample_models import smollm2_hf

    if not 1 <= n <= 3:
        raise ValueError(f"the SmolLM2 family has 1 to 3 members, asked for {n}")
    base = smollm2_hf()
    family = {"smollm2": base}
    for kind in ("last-layers", "vocab-extended")[: n - 1]:
        family[f"smollm2-{kind}"] = cached_variant(base, kind)
    return family
