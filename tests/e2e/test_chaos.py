"""The chaos soak in CI: three ``vllm serve`` engines of the SmolLM2 family answer a steady stream
of requests while the registry is SIGKILLed (twice) and an engine is SIGKILLed and started again;
nothing answers wrong, nothing fails but what was in flight to the killed engine, nothing leaks,
and the registry agrees with /proc throughout.  `benchmarks/chaos.py` runs it as long as asked."""

from __future__ import annotations

from harness.chaos import Soak


def test_engines_and_the_registry_killed_under_load(smollm2, variants, registry, plain_completions, tmp_path):
    models = {"smollm2": smollm2, "last-layers": variants["last-layers"], "vocab-extended": variants["vocab-extended"]}
    references = {name: plain_completions(path)["texts"] for name, path in models.items()}
    soak = Soak(models, references, tmp_path, registry.socket, interval_s=3.0)
    report = soak.run(cycles=3, victims=["registry", "last-layers", "registry"])
    print(report.to_dict())
    assert (report.cycles, report.registry_kills, report.engine_kills) == (3, 2, 1)
    assert report.sent >= 20 and report.wrong == 0 and report.failed_unexpected == 0, report
    assert report.consistent, report.inconsistencies
    assert report.leaked == {"memfd_holders": 0, "registry_processes": 0, "serve_processes": 0, "socket_files": 0}
    assert report.pss_end_bytes <= 1.15 * report.pss_start_bytes, report
