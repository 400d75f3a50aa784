"""The main job: several ``vllm serve`` engines on one machine, with and without dedup.

    python examples/demo.py [--engines 3] [--json]

Engines: SmolLM2-135M-Instruct, its last-layers variant and its vocab-extended variant (see
`harness.variants`), each a real ``vllm serve`` on 127.0.0.1 (CPU backend).  The run:

1. expected sharing, from the checkpoints' content keys (`vllm_dedup.scan`): for each engine,
   the bytes of its tensors (>= ``min_tensor_bytes``) already held by the engines before it;
2. plain: all engines up with ``--load-format auto`` (started together: they share nothing);
   one OpenAI-API completion each; PSS;
3. dedup: the same with ``--load-format dedup``, one engine after another (a later one maps what
   the earlier ones published); PSS; what the registry says each engine mapped;
4. a table, then everything is shut down and checked: no engine process, registry, memfd
   segment or temporary file is left.

PSS is summed over each server's processes (API server, engine core, worker); the dedup total
also counts the registry daemon's (one per machine, no engine's descendant).  The plain
engines' PSS differs from the dedup ones' by more than the shared bytes: on the CPU backend a
plain engine repacks linear weights into oneDNN memory, and the dedup loader returns freed heap
memory to the system; `benchmarks/memory.py` separates these effects.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.engines import ServeProcess, dedup_warnings  # noqa: E402
from harness.procs import mark_session, memfd_holders, processes_matching, pss_bytes  # noqa: E402
from harness.variants import smollm2_family  # noqa: E402
from vllm_dedup.config import DedupConfig  # noqa: E402
from vllm_dedup.registry.client import registry_stats, shutdown_registry  # noqa: E402
from vllm_dedup.scan.files import scan_model  # noqa: E402
from vllm_dedup.checkpoint.manifest import ManifestCache, default_cache_dir  # noqa: E402
from vllm_dedup.scan.report import Report  # noqa: E402
from vllm_dedup.segments.host import RECIPE_MEMFD_NAME  # noqa: E402

PROMPT = "The capital of France is"
MB = 1e6


def expected_shared(models: list[Path], min_bytes: int) -> list[int]:
    """Per engine: bytes of its checkpoint tensors whose content an earlier engine holds."""
    cache = ManifestCache(default_cache_dir())
    return Report([scan_model(m, cache=cache, progress=False) for m in models], min_bytes).shared_with_earlier_bytes()


def registry_view():
    """The registry's stats and its daemon's PSS in bytes, with the dedup engines up."""
    stats = registry_stats()
    return stats, pss_bytes(stats.registry_pid)


def run_phase(models: list[Path], load_format: str, logs: Path, while_up=lambda: None):
    """Start every engine, query each, measure PSS with all of them up, call ``while_up()``,
    stop them.  Dedup engines start one after another (a later one maps what earlier ones
    published); plain ones all at once, since they share nothing: a ``vllm serve`` start is
    mostly three interpreters importing vLLM one after another, one core's work, so two plain
    engines were ready in 24.6 s together where one took 24.5 s alone (2-core machine).

    Returns:
        (PSS per engine in bytes, completion text per engine, what ``while_up`` returned).
    """
    servers = []
    try:
        together = load_format != "dedup"
        for i, m in enumerate(models):
            print(f"  starting vllm serve --load-format {load_format} {m.name} ...", file=sys.stderr, flush=True)
            servers.append(ServeProcess(m, load_format, logs / f"{load_format}-{i}.log",
                                        core=i % (os.cpu_count() or 1)))
            if not together:
                servers[-1].wait_ready()
        for s in servers:
            s.wait_ready()
        texts = [s.complete([PROMPT])[0] for s in servers]
        time.sleep(1)
        return [s.pss() for s in servers], texts, while_up()
    finally:
        for s in servers:
            s.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, choices=(2, 3), default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    args = parser.parse_args()

    mark_session("demo")  # the leftover checks count only the demo's own processes
    models = list(smollm2_family(args.engines).values())
    min_bytes = DedupConfig().min_tensor_bytes
    expected = expected_shared(models, min_bytes)
    run_dir = Path(tempfile.mkdtemp(prefix="vllm-dedup-demo-"))
    os.environ["VLLM_DEDUP_RUNTIME_DIR"] = str(run_dir / "run")  # a private registry for the demo
    logs = run_dir / "logs"
    logs.mkdir()
    try:
        print("plain engines (--load-format auto):", file=sys.stderr)
        plain_pss, plain_texts, _ = run_phase(models, "auto", logs)
        print("dedup engines (--load-format dedup):", file=sys.stderr)
        dedup_pss, dedup_texts, (stats, registry_pss) = run_phase(models, "dedup", logs, while_up=registry_view)
        # The registry records each engine's model path and what it mapped from the others.
        by_model = {e.model: e.load for e in stats.engines}
        # A failure inside vllm-dedup never stops an engine: it loads privately, and the demo says so.
        private = {m.name: dedup_warnings(logs / f"dedup-{i}.log") for i, m in enumerate(models)
                   if str(m) not in by_model}  # with why, before the logs go with the run's folder
        shared = [by_model.get(str(m), {}).get("shared_bytes", 0) for m in models]
        packed = sum(by_model.get(str(m), {}).get("packed_tensors", 0) for m in models)  # oneDNN's, published or mapped

        rows = []
        for i, m in enumerate(models):
            rows.append({
                "engine": i, "model": m.name, "pss_plain_bytes": plain_pss[i], "pss_dedup_bytes": dedup_pss[i],
                "shared_bytes": shared[i], "expected_shared_bytes": expected[i],
                "outputs_match": plain_texts[i] == dedup_texts[i], "text": dedup_texts[i],
            })
        result = {
            "engines": rows,
            # the registry daemon serves the dedup engines only: their total counts it
            "pss_plain_bytes": sum(plain_pss), "pss_dedup_bytes": sum(dedup_pss) + registry_pss,
            "pss_registry_bytes": registry_pss, "saved_bytes": sum(plain_pss) - sum(dedup_pss) - registry_pss,
            "shared_bytes": sum(shared), "expected_shared_bytes": sum(expected), "packed_tensors": packed,
        }
    except BaseException:  # what the failure left behind is said too
        left = cleanup(run_dir)
        print("left behind: " + (", ".join(left) if left else "nothing (no process, segment or temp file)"),
              file=sys.stderr)
        raise
    result["leftovers"] = leftovers = cleanup(run_dir)

    w = max(len(r["model"]) for r in rows) + 4
    print(f"{'engine':<{w}} {'PSS plain':>10} {'PSS dedup':>10} {'mapped':>9} {'expected':>9}  same text")
    for r in rows:
        print(f"{'[%d] %s' % (r['engine'], r['model']):<{w}} {r['pss_plain_bytes'] / MB:>8.0f}MB "
              f"{r['pss_dedup_bytes'] / MB:>8.0f}MB {r['shared_bytes'] / MB:>7.0f}MB "
              f"{r['expected_shared_bytes'] / MB:>7.0f}MB  {r['outputs_match']}")
    print(f"{'registry daemon':<{w}} {'':>10} {registry_pss / MB:>8.0f}MB")
    print(f"{'total':<{w}} {result['pss_plain_bytes'] / MB:>8.0f}MB {result['pss_dedup_bytes'] / MB:>8.0f}MB "
          f"{result['shared_bytes'] / MB:>7.0f}MB {result['expected_shared_bytes'] / MB:>7.0f}MB")
    # Where vLLM packs weights for oneDNN (bf16 on AVX-512, float32 everywhere) the engines also
    # share the packed copies, which the checkpoints do not show; on AVX2 a bf16 model has none.
    also = (f"; {result['packed_tensors']} of the tensors the engines published or mapped are oneDNN packed "
            "copies, which the checkpoints do not show" if result["packed_tensors"] else "")
    print(f"saved: {result['saved_bytes'] / MB:.0f} MB of PSS with dedup; {result['shared_bytes'] / MB:.0f} MB "
          f"of weights mapped from segments (expected from the checkpoints' keys: "
          f"{result['expected_shared_bytes'] / MB:.0f} MB{also})")
    print("left behind: " + (", ".join(leftovers) if leftovers else "nothing (no process, segment or temp file)"))
    if args.json:
        print(json.dumps(result))
    for name, why in private.items():
        print(f"the dedup engine of {name} is not in the registry: it loaded privately; its log said:")
        for line in why or ["(no vllm-dedup warning)"]:
            print(f"  {line}")
    return 0 if not leftovers and not private and all(r["outputs_match"] for r in rows) else 1


def cleanup(run_dir: Path) -> list[str]:
    """Stop the demo's registry, remove its directory; list whatever is left behind."""
    shutdown_registry()
    left = []
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = _leftovers(run_dir)
        if not left:
            break
        time.sleep(0.2)
    shutil.rmtree(run_dir, ignore_errors=True)
    return left


def _leftovers(run_dir: Path) -> list[str]:
    pids = set(processes_matching(str(run_dir).encode())) | set(processes_matching(b"vllm", b"serve", b"127.0.0.1"))
    left = [f"process {pid}" for pid in sorted(pids)]
    left += [f"segment memfd in process {pid}" for pid in memfd_holders()]
    left += [f"recipe memfd in process {pid}" for pid in memfd_holders(RECIPE_MEMFD_NAME)]
    run = run_dir / "run"
    if run.exists() and any(run.iterdir()):
        left += [f"file {p}" for p in run.iterdir()]
    return left


if __name__ == "__main__":
    sys.exit(main())
