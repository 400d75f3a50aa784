"""The plugin in real vLLM: the entry point, the load format, its configuration, greedy output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
from vllm.config.load import LoadConfig

from vllm_dedup.loader import DedupModelLoader


def test_entry_point_is_in_vllms_plugin_group():
    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "dedup"]
    assert ep.value == "vllm_dedup.plugin:register"


def test_vllm_loads_the_plugin_and_knows_the_format():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    load_general_plugins()  # idempotent
    loader = get_model_loader(LoadConfig(load_format="dedup"))
    assert isinstance(loader, DedupModelLoader)
    assert type(loader.inner).__name__ == "DefaultModelLoader"


def test_unknown_config_key_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config={"share_grup": "a"}))
    assert "'share_grup'" in str(err.value) and "inner_load_format" in str(err.value)


def test_inner_loader_gets_only_its_own_config():
    loader = DedupModelLoader(
        LoadConfig(
            load_format="dedup",
            model_loader_extra_config={"inner_load_format": "safetensors", "inner_extra_config": {"num_threads": 2}},
        )
    )
    assert loader.inner.load_config.load_format == "safetensors"
    assert loader.inner.load_config.model_loader_extra_config == {"num_threads": 2}
    with pytest.raises(ValueError, match="cannot be 'dedup'"):
        DedupModelLoader(LoadConfig(load_format="dedup", model_loader_extra_config={"inner_load_format": "dedup"}))


GENERATE = textwrap.dedent(
    """
    import json, sys
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams
        model, fmt = sys.argv[1], sys.argv[2]
        llm = LLM(model, load_format=fmt, dtype="bfloat16", max_model_len=256, enforce_eager=True,
                  kv_cache_memory_bytes=64 << 20, seed=0)
        prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
        print("RESULT " + json.dumps([o.outputs[0].token_ids for o in outs]))
    """
)


@pytest.mark.slow
def test_dedup_greedy_output_equals_auto_through_llm(smollm2, tmp_path):
    script = tmp_path / "generate.py"
    script.write_text(GENERATE)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    tokens = {}
    for fmt in ("auto", "dedup"):
        proc = subprocess.run(
            [sys.executable, str(script), str(smollm2), fmt], capture_output=True, text=True, env=env, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        tokens[fmt] = json.loads(line[len("RESULT ") :])
    assert tokens["dedup"] == tokens["auto"]
    assert all(len(t) == 24 for t in tokens["auto"])
