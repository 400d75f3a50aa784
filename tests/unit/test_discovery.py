"""How an engine decides a Ray cluster runs on its machine, in a fresh interpreter each (no Ray
initialised, no RAY_ADDRESS): Ray leaves the head's GCS address in ``ray_current_cluster``,
and a head that was killed leaves the file behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

HINT = "from vllm_dedup.registry.discovery import _ray_cluster_hint; print(_ray_cluster_hint(None))"


def _hint(ray_tmp) -> bool:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VLLM_DEDUP_RAY_NODE_ID")}
    env["RAY_TMPDIR"] = str(ray_tmp)
    out = subprocess.run([sys.executable, "-c", HINT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.fixture
def listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_cluster_counts_only_where_its_address_answers(tmp_path, listening):
    from vllm_dedup.registry.nodes import NODE_ID_ENV

    assert NODE_ID_ENV == "VLLM_DEDUP_RAY_NODE_ID"  # left out of the environment above
    (tmp_path / "ray").mkdir()
    current = tmp_path / "ray" / "ray_current_cluster"
    assert not _hint(tmp_path)  # no file: no cluster
    current.write_text(f"127.0.0.1:{listening}\n")
    assert _hint(tmp_path)  # a head answers there
    with socket.socket() as s:  # a port nothing listens on: the head was killed, its file stayed
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    current.write_text(f"127.0.0.1:{closed}\n")
    assert not _hint(tmp_path)
    current.write_text("garbage")
    assert not _hint(tmp_path)


@pytest.mark.parametrize("family, host, written", [(socket.AF_INET, "127.0.0.1", "{host}:{port}"),
                                                   (socket.AF_INET6, "::1", "[{host}]:{port}")])
def test_a_ray_address_is_probed_as_ray_writes_it_ipv6_in_brackets(family, host, written):
    """Ray writes an IPv6 GCS address as ``[::1]:6379``: the probe connects to the host inside
    the brackets, and says so at once where nothing listens."""
    from vllm_dedup.errors import RegistryUnavailable
    from vllm_dedup.registry.ray_actor import probe_ray_address

    try:
        listener = socket.socket(family)
        listener.bind((host, 0))
    except OSError as e:  # a machine without IPv6 loopback: there is no such cluster to reach
        pytest.skip(f"no {host} here ({e})")
    with listener:
        listener.listen()
        address = written.format(host=host, port=listener.getsockname()[1])
        probe_ray_address(address)
    with pytest.raises(RegistryUnavailable, match="no Ray cluster answers"):
        probe_ray_address(address)  # closed now


def test_a_stale_ray_address_in_the_environment_is_found_out_at_once(monkeypatch):
    """``ray.init("auto")`` goes to ``$RAY_ADDRESS``; where nothing listens there it retried for
    about a minute.  The registry actor's helper probes that address first and says so."""
    from vllm_dedup.errors import RegistryUnavailable
    from vllm_dedup.registry.ray_actor import ensure_actor

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    for address in (None, "auto"):  # the probe's words: ray.init's own failure says "no Ray cluster at auto"
        with pytest.raises(RegistryUnavailable, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
            ensure_actor("vllm-dedup", address=address)
