"""The chaos soak in CI: two ``vllm serve`` engines of the SmolLM2 family (the base and its
last-layers fine-tune) answer a steady, bounded stream of requests while the registry is
SIGKILLed, the fine-tune's engine is SIGKILLed and started again, the base's is hung (SIGSTOP,
SIGCONT 5 s later) and the registry is SIGKILLed again.  Nothing
answers differently from a reference ``vllm serve`` asked one prompt per request; every engine's
final tensors equal its model's reference after every cycle; nothing fails but what was in flight
to the killed engine; nothing leaks; the registry agrees with /proc throughout.
`benchmarks/chaos.py` runs it as long as asked."""

from __future__ import annotations

from harness.chaos import Soak


def test_engines_and_the_registry_killed_and_hung_under_load(smollm2, variants, registry, tmp_path):
    # Two engines (three ran here before; `benchmarks/chaos.py` runs as many as asked): each
    # victim kind still hits an engine that maps from the other.
    models = {"smollm2": smollm2, "last-layers": variants["last-layers"]}
    soak = Soak(models, tmp_path, registry.socket, interval_s=3.0, on_cycle=lambda c: print(c.line(), flush=True))
    report = soak.run(cycles=4, victims=["registry", "kill:last-layers", "hang:smollm2", "registry"])
    print(report.to_dict())
    assert (report.cycles, report.registry_kills, report.engine_kills, report.hangs) == (4, 2, 1, 1)
    assert report.sent >= 20 and report.wrong == 0 and report.failed_unexpected == 0, report
    assert report.tensor_checks == 2 * 5 and report.tensors_differing == 0, report  # 2 engines, start + 4 cycles
    assert report.consistent, report.inconsistencies
    assert report.leaked == {"memfd_holders": 0, "registry_descriptors": 0, "registry_processes": 0,
                             "serve_processes": 0, "socket_files": 0}
    assert report.pss_end_bytes <= 1.15 * report.pss_start_bytes, report
    assert report.ok
