"""Shared fixtures: the real checkpoints and their variants (built once per test session), a
private registry location per test, an in-process registry_server, and a real Ray cluster on loopback.

Everything a test writes lives under pytest's temporary directories: the manifest cache and
the converted models are pointed there through ``VLLM_DEDUP_CACHE_DIR``.

Layout: ``unit/`` (no engine, no child process beyond the CLI; seconds), ``integration/`` (real
processes sharing real memory through a real registry), ``e2e/`` (real vLLM engines, Ray, Ray
Serve).  ``slow`` marks every e2e test, every test that starts a Ray cluster, and the few
others that import vLLM in a child process or run a whole benchmark script (marked where they
are); ``bash tests/run.sh -m "not slow"`` runs the rest in under two minutes, and CI runs all.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import xxhash

from harness.procs import ROOT, SESSION_ENV, mark_session, processes_matching
from harness.sample_models import MODELS_ENV, minilm_dir, smollm2_gguf, smollm2_hf
from harness.variants import VARIANT_KINDS, cached_variant
from vllm_dedup.registry.client import registry_stats, shutdown_registry
from vllm_dedup.registry.server import RegistryServer
from vllm_dedup.registry.state import Registry, RegistryStats

E2E = Path(__file__).parent / "e2e"

# Every process a test starts inherits this; leak checks count only those (harness.procs).  Under
# pytest-xdist each worker is a session of its own (the mark the controller set is replaced), so
# one worker's leak checks never count another's engines.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop(SESSION_ENV, None)
mark_session(f"pytest-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}")


def pytest_collection_modifyitems(items):
    """Every end-to-end test (real vLLM engines, Ray) and every test that starts a Ray cluster
    is ``slow``."""
    for item in items:
        if E2E in Path(item.fspath).parents or "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


# Converted models and variants outlive a test run (converting takes ~20 s), under .venv/ with the
# code that makes them in the folder's name: a change to that code builds them anew.
_MAKERS = [ROOT / "harness" / "sample_models.py", ROOT / "harness" / "variants.py"]
os.environ[MODELS_ENV] = str(ROOT / ".venv" / "test-models" /
                             xxhash.xxh3_64_hexdigest(b"".join(p.read_bytes() for p in _MAKERS)))


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory) -> Path:
    """The manifest cache of this test session (empty at its start)."""
    root = tmp_path_factory.mktemp("vllm-dedup-cache")
    os.environ["VLLM_DEDUP_CACHE_DIR"] = str(root)
    return root


@pytest.fixture(scope="session")
def smollm2(cache_root) -> Path:
    """SmolLM2-135M-Instruct converted from the packaged GGUF (bfloat16 HF folder: 272 tensors,
    the embedding 49152 x 576)."""
    return smollm2_hf()


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def minilm() -> Path:
    return minilm_dir()


@pytest.fixture(scope="session")
def variants(smollm2) -> dict[str, Path]:
    """Every kind in `VARIANT_KINDS`, built from the converted SmolLM2."""
    return {kind: cached_variant(smollm2, kind) for kind in VARIANT_KINDS}



class RegistryEnv:
    """A private registry location for one test: its own runtime dir (so its own socket and
    daemon), no Ray unless the test asks for it."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir

    @property
    def socket(self) -> Path:
        return self.run_dir / "vllm-dedup.sock"

    def stats(self) -> RegistryStats:
        return registry_stats(self.socket)

    def engine_loads(self) -> dict[int, dict]:
        """pid -> that engine's reported load (tensors and bytes shared/published/private)."""
        return {e.pid: e.load for e in self.stats().engines}

    def daemon_pids(self) -> list[int]:
        return processes_matching(b"vllm_dedup.registry.daemon", str(self.socket).encode())

    def shutdown(self) -> None:
        shutdown_registry(self.socket)


@pytest.fixture
def registry(tmp_path, monkeypatch) -> RegistryEnv:
    # Short: a socket's path has at most 107 bytes, and a node's registry nests two levels below.
    run = Path(tempfile.mkdtemp(prefix="vd-run-", dir="/tmp"))
    monkeypatch.setenv("VLLM_DEDUP_RUNTIME_DIR", str(run))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "no-ray"))  # no local cluster to find
    env = RegistryEnv(run)
    yield env
    env.shutdown()
    deadline = time.monotonic() + 15
    while env.daemon_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    for made in (run, *run.parent.glob(f"{run.name}-node-*")):  # and other nodes' directories beside it
        shutil.rmtree(made, ignore_errors=True)
    assert not env.daemon_pids(), "the registry daemon did not exit"


@pytest.fixture(scope="session")
def model_lib(tmp_path_factory) -> Path:
    """The CUDA driver model (tests/cuda_model: NVIDIA's documented contract over host memory,
    not a GPU) as a ``libcuda.so.1``, compiled once per session."""
    import cuda_model

    return cuda_model.build(tmp_path_factory.mktemp("cuda-model"))


@pytest.fixture
def registry_server(tmp_path):
    """A real registry serving a fresh `Registry` on a socket of this test's own, in this process."""
    server = RegistryServer(Registry(), tmp_path / "run" / "test.sock").start()
    yield server
    server.stop()


# Ray on loopback only (single-machine mode), and no auth token written into a home directory.
# Serve's controller gives a new HTTP proxy 5 s (RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S) to start
# its worker process and answer; on 2 cores beside a loading engine that can take longer, and
# then the controller kills it and `serve.start` fails with ActorDiedError ("killed by
# `ray.kill`", "never ran"), as CI saw.  The holder's environment is every Ray process's.
RAY_TEST_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}
# The tests' own process too, before anything imports Ray: Ray reads this switch once, at
# import (``ray_constants.ENABLE_RAY_CLUSTER``), and with it on, ray.init turns a 127.0.0.1
# address into the address this machine reaches the internet from
# (``services.resolve_ip_for_localhost``), where the test clusters, on loopback, do not listen.
# Without a default route that was 127.0.0.1 again; on a machine with one, every ray.init of
# the tests' process went to 192.0.2.2:<port> and failed after minutes.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = RAY_TEST_ENV["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]

RAY_HOLDER = """
import os, signal, sys, time, ray
ray.init(num_cpus=8, include_dashboard=False, _temp_dir=sys.argv[1], logging_level="WARNING")
print("ADDRESS " + ray.get_runtime_context().gcs_address, flush=True)
signal.signal(signal.SIGTERM, lambda *a: (ray.shutdown(), sys.exit(0)))
while True:
    time.sleep(1)
"""


# Two nodes on this machine, as `ray start` twice would make them: the head and a worker, each
# with its own raylet and the same address, 127.0.0.1, and 3 logical CPUs: room for one Ray
# Serve LLM replica (2: its engine's bundle and the replica actor), not two, and for the OpenAI
# ingress (1).
RAY_TWO_NODE_HOLDER = """
import json, signal, sys, time
from ray.cluster_utils import Cluster
node = {"num_cpus": 3, "node_ip_address": "127.0.0.1", "include_dashboard": False}
cluster = Cluster(initialize_head=True, head_node_args={**node, "temp_dir": sys.argv[1] + "/ray"})
worker = cluster.add_node(**node)
cluster.wait_for_nodes()
print("ADDRESS " + json.dumps({"address": cluster.address, "head": cluster.head_node.node_id,
                               "worker": worker.node_id, "tmp": sys.argv[1]}), flush=True)
signal.signal(signal.SIGTERM, lambda *a: (cluster.shutdown(), sys.exit(0)))
while True:
    time.sleep(1)
"""


@contextlib.contextmanager
def _ray_holder(script: str, own_ray_tmpdir: bool = False):
    """Run a holder ``script`` with a temp dir of its own (its HOME; with ``own_ray_tmpdir``
    also the RAY_TMPDIR of every process the cluster starts); gives what it prints after
    ``ADDRESS``, then stops it and removes the dir."""
    tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths are long
    env = {**os.environ, **RAY_TEST_ENV, "HOME": str(tmp)}
    if own_ray_tmpdir:
        env["RAY_TMPDIR"] = str(tmp)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = "-"
        while line and not line.startswith("ADDRESS "):
            line = proc.stdout.readline()
        assert line.startswith("ADDRESS "), f"Ray did not start (exit {proc.poll()})"
        yield line.split(" ", 1)[1].strip()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A real single-node Ray cluster on loopback, started by a holder process; yields its
    address.  Stopping the holder stops the cluster (never `ray stop`: it kills every Ray)."""
    with _ray_holder(RAY_HOLDER) as address:
        yield address


@pytest.fixture(scope="module")
def two_ray_nodes() -> dict:
    """A real two-node Ray cluster on this machine (`RAY_TWO_NODE_HOLDER`); yields
    ``{"address", "head", "worker", "tmp"}`` (node ids in hex; ``tmp``: its temp dir, also the
    ``RAY_TMPDIR`` of every process it starts, so that they can be told from others')."""
    with _ray_holder(RAY_TWO_NODE_HOLDER, own_ray_tmpdir=True) as line:
        yield json.loads(line)


@pytest.fixture
def two_nodes_address(two_ray_nodes, registry, monkeypatch) -> dict:
    """`two_ray_nodes`, exported to the engines and commands this test starts (as `ray_address`)."""
    for key, value in {**RAY_TEST_ENV, "RAY_ADDRESS": two_ray_nodes["address"]}.items():
        monkeypatch.setenv(key, value)
    assert two_ray_nodes["address"].startswith("127.0.0.1:"), two_ray_nodes
    return two_ray_nodes


@pytest.fixture
def ray_address(ray_cluster, registry, monkeypatch) -> str:
    """The test cluster's address, exported to the engines this test starts."""
    for key, value in {**RAY_TEST_ENV, "RAY_ADDRESS": ray_cluster}.items():
        monkeypatch.setenv(key, value)
    assert ray_cluster.startswith("127.0.0.1:"), ray_cluster
    return ray_cluster
