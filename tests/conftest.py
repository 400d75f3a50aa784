"""Shared fixtures: the real checkpoints and their variants, built once per test session.

Everything a test writes lives under pytest's temporary directories: the manifest cache and
the converted models are pointed there through ``VLLM_DEDUP_CACHE_DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_dedup.sample_models import minilm_dir, smollm2_gguf, smollm2_hf
from vllm_dedup.variants import VARIANT_KINDS, build_variant


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm-dedup-cache")
    os.environ["VLLM_DEDUP_CACHE_DIR"] = str(root)
    return root


@pytest.fixture(scope="session")
def smollm2(cache_root) -> Path:
    """SmolLM2-135M-Instruct converted from the packaged GGUF (bfloat16 HF folder)."""
    return smollm2_hf(cache_root)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def minilm() -> Path:
    return minilm_dir()


@pytest.fixture(scope="session")
def variants(smollm2, tmp_path_factory) -> dict[str, Path]:
    """Every kind in `VARIANT_KINDS`, built from the converted SmolLM2."""
    root = tmp_path_factory.mktemp("variants")
    return {kind: build_variant(smollm2, kind, root / kind) for kind in VARIANT_KINDS}

