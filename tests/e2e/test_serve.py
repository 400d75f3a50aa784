"""Ray Serve deployments with the dedup loader: real Ray, real Serve, real vLLM engines (CPU).

The example runs as a user runs it (its own Ray cluster); the lifecycle test drives Serve from
this process on the tests' Ray cluster: deploy, query, metrics, scale to zero and back, kill a
replica's process.  There each model is an application of its own (``serve.run`` of a rebuilt
application gives every deployment in it a new code version, so Serve would restart them all).
The two are first deployed in one ``serve.run_many``: ``serve.run`` returns only once its
application runs, so two calls would start the second replica after the first is up (75 s to
the first answers, against 63 s together: the test alone took 188 s and 169 s, 2-core
machine).  Loading together, the engine that reaches the sharing pass second maps the other's
tensors (the publish lock).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from helpers import run_cli, wait_for
from vllm_dedup.config import DedupConfig
from harness.engines import openai_complete
from harness.procs import descendants, memfd_holders, serve_replica_pids
from vllm_dedup.scan.files import scan_model
from vllm_dedup.scan.report import Report

ROOT = Path(__file__).resolve().parents[2]
ENGINE_KWARGS = {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "seed": 0,
                 "kv_cache_memory_bytes": 32 << 20}
pytestmark = pytest.mark.timeout(900)


def expected_shared_bytes(models) -> int:
    """Bytes of tensors (>= min_tensor_bytes) whose content another of ``models`` holds too,
    from the checkpoints' keys: the same total whatever order the engines load in."""
    report = Report([scan_model(m, progress=False) for m in models], DedupConfig().min_tensor_bytes)
    return sum(report.shared_with_earlier_bytes())


EMBEDDING = 49152 * 576 * 2  # SmolLM2's, bf16


def mapped_as_predicted(mapped: int, expected: int, engines: int) -> bool:
    """Whether ``engines`` engines mapped what the checkpoints predict (``expected``, within 2%).
    With cpu_linear="packed" (the default) an engine also maps oneDNN's packed copies of a
    vocabulary embedding it shares, and its tied head's packed copy from its own segment: up to
    three embedding-sized copies each, which a scan of the checkpoints cannot see."""
    return 0.98 * expected <= mapped <= 1.02 * expected + 3 * EMBEDDING * engines


def result_models(result: dict) -> list[str]:
    return [r["model"] for r in result["models"]]


def test_serve_example_smoke_shares_memory_and_every_model_answers(smollm2, registry, tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths are long
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled", "HOME": ray_tmp}
    # Two of the family (the base and its last-layers fine-tune): each model is two Serve
    # replicas' start-ups (plain, then dedup), about a minute of CI each; the third, the
    # vocab-extended variant, shares as the variants test shows (tests/e2e/test_engines.py).
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "serve_finetunes.py"), "--smoke", "--json",
                           "--models", "2"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

    assert result["models_answered"] == 2
    assert result["same_text"]
    # Different engines answered: the first token's logprob differs where the weights that
    # produce it differ (the vocab-extended variant's extra rows barely move it; not checked).
    logprob = {r["model"]: r["first_token_logprob"] for r in result["models"]}
    assert logprob["smollm2"] != logprob["smollm2-last-layers"]
    from harness.variants import smollm2_family

    expected = expected_shared_bytes(list(smollm2_family(2).values()))
    assert mapped_as_predicted(result["mapped_from_others_bytes"], expected, 2), (result, expected)
    # The dedup replicas' PSS is lower by at least 90% of it.  The registry actor is a Ray
    # worker process of its own, a fixed cost per node (about 70 MB of PSS here, mostly Ray's):
    # with it the application still holds less than plain's.  (Where vLLM packs linear weights,
    # AVX-512, the replicas also share oneDNN's packed copies of the embedding, which the
    # checkpoints do not show, so they save more than this; on AVX2 they save about this.)
    # Without file-backed pages (torch's libraries), whose PSS moves with other tests' engines
    # between the plain and the dedup phase (CI once saw 218 MB saved in total so).
    replicas_saved = sum((r["pss_plain_bytes"] - r["file_pss_plain_bytes"]) - (r["pss_dedup_bytes"] - r["file_pss_dedup_bytes"])
                         for r in result["models"])
    assert replicas_saved >= 0.9 * expected, result
    assert result["registry_pss_bytes"] < 128 << 20, result
    assert result["pss_dedup_bytes"] < result["pss_plain_bytes"], result
    # Torn down: no replica, no segment, no registry left on this machine.
    assert wait_for(lambda: not any(serve_replica_pids(app, f"LLMServer:{m}") for app in ("plain", "dedup")
                                    for m in result_models(result)), 30)
    assert wait_for(lambda: memfd_holders() == [], 30)
    subprocess.run(["rm", "-rf", ray_tmp])


# --- lifecycle on the tests' Ray cluster ----------------------------------------------------------
def _complete(port: int, model: str) -> dict:
    reply = openai_complete(port, model, "The capital of France is", max_tokens=8, logprobs=1, route=f"/{model}")
    choice = reply["choices"][0]
    return {"model": reply["model"], "text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"]}


def _prometheus(port: int) -> dict[tuple[str, str], float]:
    """``ray_vllm_dedup_*`` samples on Ray's metrics endpoint: (name, share group) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("ray_vllm_dedup_") and "{" in line:
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            tags = dict(part.split("=", 1) for part in labels.split(",") if "=" in part)
            out[(name, tags.get("share_group", "").strip('"'))] = float(value)
    return out


def test_serve_deploy_query_metrics_scale_to_zero_and_back_kill_a_replica(smollm2, variants, registry,
                                                                          ray_address):
    import ray
    from ray import serve
    from ray.serve.llm import build_openai_app

    from harness.procs import free_port
    from vllm_dedup.serve import dedup_llm_config, ensure_registry

    models = {"base": smollm2, "last": variants["last-layers"]}
    expected = expected_shared_bytes(list(models.values()))
    port = free_port()

    # Serve refuses num_replicas=0; a deployment reaches zero through its autoscaler.
    to_zero = {"autoscaling_config": {"min_replicas": 0, "max_replicas": 1, "initial_replicas": 0,
                                      "downscale_delay_s": 0, "downscale_to_zero_delay_s": 0}}

    def app(model: str, replicas: int) -> serve.RunTarget:
        """``model``'s application ``t-<model>`` at ``/<model>``."""
        config = dedup_llm_config(model, models[model], engine_kwargs=ENGINE_KWARGS, replicas_per_device=2,
                                  deployment_config=to_zero if replicas == 0 else {"num_replicas": replicas})
        return serve.RunTarget(build_openai_app({"llm_configs": [config]}), name=f"t-{model}",
                               route_prefix=f"/{model}")

    def deploy(model: str, replicas: int) -> None:
        """Redeploy ``model``'s application; the other's stays as it is."""
        serve.run_many([app(model, replicas)])

    def replicas(model: str) -> list[int]:
        return serve_replica_pids(f"t-{model}", f"LLMServer:{model}")

    def engines() -> dict[str, dict]:
        """model folder -> the registry's record of its engine."""
        return {e.model: e for e in registry.stats().engines}

    def consistent() -> None:
        """Every segment is held by a live engine, and only live engines and the registry hold
        segment descriptors."""
        stats = registry.stats()
        live = {e.pid for e in stats.engines}
        assert all(os.path.exists(f"/proc/{p}") for p in live)
        assert set(memfd_holders()) <= live | {stats.registry_pid}
        (group,) = stats.groups
        assert group.engines == len(live)

    ray.init(address=ray_address, logging_level="WARNING", log_to_driver=False)
    try:
        registry_path = ensure_registry()
        assert registry_path == registry.socket
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([app(m, 1) for m in models])

        # Both answer, each from its own engine; the pair shares what the checkpoints say.
        first = {m: _complete(port, m) for m in models}
        assert [first[m]["model"] for m in models] == list(models)
        assert first["base"]["logprobs"] != first["last"]["logprobs"]
        loads = engines()
        assert set(loads) == {str(p) for p in models.values()}
        shared = sum(e.load["shared_bytes"] for e in loads.values())
        assert mapped_as_predicted(shared, expected, 2), (shared, expected)
        consistent()
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        assert len([n for n in names if n.startswith("vllm-dedup-registry")]) == 1

        # The same figures as Ray metrics (Prometheus) and in `vllm-dedup status`.
        metrics_port = ray.nodes()[0]["MetricsExportPort"]
        (group,) = registry.stats().groups
        assert wait_for(lambda: _prometheus(metrics_port).get(("ray_vllm_dedup_saved_bytes", "default"))
                        == group.saved_bytes, 60), _prometheus(metrics_port)
        samples = _prometheus(metrics_port)
        for field in ("engines", "segments", "resident_bytes", "shared_bytes"):
            assert samples[(f"ray_vllm_dedup_{field}", "default")] == getattr(group, field), field
        status = json.loads(run_cli("status", "--json", check=True).stdout)
        assert status["groups"] == [dataclasses.asdict(group)]

        # Scale "base" to zero: its engine goes, its lease with it; "last" keeps its engine.
        base_pids = [p for pid in replicas("base") for p in descendants(pid)]
        survivor = engines()[str(models["last"])].pid
        deploy("base", 0)
        assert wait_for(lambda: set(engines()) == {str(models["last"])}, 180), engines()
        assert wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in base_pids), 60)
        assert engines()[str(models["last"])].pid == survivor
        consistent()
        assert _complete(port, "last") == first["last"]

        # And back: the new engine maps what the survivor holds.
        deploy("base", 1)
        assert wait_for(lambda: len(engines()) == 2 and all("shared_bytes" in e.load for e in engines().values()),
                        180), engines()
        assert mapped_as_predicted(engines()[str(models["base"])].load["shared_bytes"], expected, 1)
        assert _complete(port, "base") == first["base"]
        consistent()

        # SIGKILL the replica's process: its vLLM processes go with it, the registry drops the
        # engine, Serve starts a new replica, which maps again and answers the same.
        (replica,) = replicas("base")
        victims = descendants(replica)
        old_engine = engines()[str(models["base"])].pid
        survivor = engines()[str(models["last"])].pid
        os.kill(replica, signal.SIGKILL)
        assert wait_for(lambda: not any(os.path.exists(f"/proc/{p}") for p in victims), 120), victims
        assert wait_for(lambda: getattr(engines().get(str(models["base"])), "pid", None) not in (None, old_engine), 300)
        assert wait_for(lambda: engines()[str(models["base"])].load.get("shared_bytes") is not None, 60)
        assert _complete(port, "base") == first["base"]
        # The survivor kept its engine and its mappings; the new one mapped the common tensors.
        assert engines()[str(models["last"])].pid == survivor
        assert _complete(port, "last") == first["last"]
        assert mapped_as_predicted(engines()[str(models["base"])].load["shared_bytes"], expected, 1)
        consistent()
    finally:
        serve.shutdown()
        ray.shutdown()
    assert wait_for(lambda: not any(replicas(m) for m in models), 60)
    assert wait_for(lambda: registry.stats().engines == [], 60)
    registry.shutdown()
    assert wait_for(lambda: memfd_holders() == [], 30)
