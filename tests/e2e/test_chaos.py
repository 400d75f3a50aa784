"""The chaos soak in CI: three ``vllm serve`` engines of the SmolLM2 family answer a steady,
bounded stream of requests while the registry is SIGKILLed, an engine is SIGKILLed and started
again, another is hung (SIGSTOP, SIGCONT 5 s later) and the registry is SIGKILLed again.  Nothing
answers differently from a reference ``vllm serve`` asked one prompt per request; every engine's
final tensors equal its model's reference after every cycle; nothing fails but what was in flight
to the killed engine; nothing leaks; the registry agrees with /proc throughout.
`benchmarks/chaos.py` runs it as long as asked."""

from __future__ import annotations

from harness.chaos import Soak


def test_engines_and_the_registry_killed_and_hung_under_load(smollm2, variants, registry, tmp_path):
    models = {"smollm2": smollm2, "last-layers": variants["last-layers"], "vocab-extended": variants["vocab-extended"]}
    soak = Soak(models, tmp_path, registry.socket, interval_s=3.0, on_cycle=lambda c: print(c.line(), flush=True))
    report = soak.run(cycles=4, victims=["registry", "kill:last-layers", "hang:vocab-extended", "registry"])
    print(report.to_dict())
    assert (report.cycles, report.registry_kills, report.engine_kills, report.hangs) == (4, 2, 1, 1)
    assert report.sent >= 30 and report.wrong == 0 and report.failed_unexpected == 0, report
    assert report.tensor_checks == 3 * 5 and report.tensors_differing == 0, report  # 3 engines, start + 4 cycles
    assert report.consistent, report.inconsistencies
    assert report.leaked == {"memfd_holders": 0, "registry_descriptors": 0, "registry_processes": 0,
                             "serve_processes": 0, "socket_files": 0}
    assert report.pss_end_bytes <= 1.15 * report.pss_start_bytes, report
    assert report.ok
