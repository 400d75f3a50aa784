"""Engines per host: memory and time-to-ready of 1, 2, ..., N ``vllm serve`` engines, plain vs dedup.

    .venv/bin/python benchmarks/engines_per_host.py [--model DIR] [--max-engines N] [--budget-gib G]
                                                    [--scenario {both,same-model,family}] [--out DIR] [--json]

Scenarios (real ``vllm serve`` engines on 127.0.0.1, CPU backend, `harness.engines.ServeProcess`):

- ``same-model``: every engine serves DIR;
- ``family``: the engines cycle through DIR, its ``last-layers`` variant and its
  ``vocab-extended`` variant (`harness.variants`): base, last-layers, vocab-extended, base, ...

For each scenario, plain (``--load-format auto``) and then dedup (``--load-format dedup``, a
private standalone registry), engines are started one at a time: engine n starts once engine
n-1 answers ``/health`` and has served one completion.  With n engines up, the row records the
total PSS of every server's process tree (API server, engine core, worker; for dedup plus the
registry daemon, which is no engine's descendant) and the seconds the n-th engine took from
``vllm serve`` to ``/health``.  Every engine is stopped, and the registry shut down, before
the next phase.

Expected lines (the plot's dashed lines, the table's ``exp.`` columns), anchored on the
measured single engine of each phase: each further engine adds what the first one holds on its
own, less what it finds already resident.  Already resident, plain or dedup, are the
file-backed pages the first engine maps (``Pss_File``: libraries and Python modules, which the
page cache holds once however many processes map them, about 145 MB per engine here, so a
plain n x plain(1) would overstate every further engine by that much); for dedup also the
registry (one per host) and ``shared_i``, the bytes of engine i's checkpoint tensors (at least
``min_tensor_bytes``) whose content engines 1..i-1 hold, from the checkpoints' content keys
(`vllm_dedup.scan`).  So plain(n) = plain(1) + (n-1) x (plain(1) - file(1)) and dedup(n) =
dedup(1) + sum over i = 2..n of (dedup(1) - registry - file(1) - shared_i).  ``mapped`` is
what the registry says the engines mapped from others' segments.

``--budget-gib G``: per scenario, how many engines fit in G GiB, plain vs dedup: the largest
measured n whose total PSS is at most G GiB ("≥ n" when the largest n measured still fits:
nothing is extrapolated).

Output: a table on stdout; ``engines_per_host.json`` and ``engines_per_host.png`` (matplotlib)
in ``--out`` (default ``benchmarks/results/``); with ``--json`` the JSON object is also the last
line of stdout.  Exit status 1 when a dedup engine's completion differs from the plain
engine's in the same position, or a process the run started outlived it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.engines import ServeProcess  # noqa: E402
from harness.procs import descendants, pss_bytes, tree_pss_parts  # noqa: E402
from harness.variants import cached_variant  # noqa: E402
from vllm_dedup.config import DedupConfig  # noqa: E402
from vllm_dedup.registry.client import registry_stats, shutdown_registry  # noqa: E402
from vllm_dedup.scan.files import scan_model  # noqa: E402
from vllm_dedup.checkpoint.manifest import ManifestCache, default_cache_dir  # noqa: E402
from vllm_dedup.scan.report import Report  # noqa: E402
from vllm_dedup.text import table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SCENARIOS = ("same-model", "family")
FAMILY = (None, "last-layers", "vocab-extended")  # None: the base model itself
PROMPT = "The capital of France is"
MB, GIB = 1e6, 1 << 30
# The dedup engines use the standalone daemon even when another user's Ray cluster runs on the
# machine: the registry measured is always the same kind of process.
DEDUP_CONFIG = {"registry_address": "local"}


def scenario_models(model: Path, scenario: str, n: int) -> list[tuple[str, Path]]:
    """Engines 1..n of ``scenario``: (``base`` or the variant kind, checkpoint folder); the
    family's variants are built once and cached."""
    kinds = [None] * n if scenario == "same-model" else [FAMILY[i % len(FAMILY)] for i in range(n)]
    return [(k, cached_variant(model, k)) if k else ("base", model) for k in kinds]


def shared_per_engine(models: list[Path], min_bytes: int) -> list[int]:
    """Per engine, in start order: bytes of its checkpoint tensors (>= ``min_bytes``) whose
    content an earlier engine holds, from the checkpoints' content keys (manifest-cached)."""
    cache = ManifestCache(default_cache_dir())
    return Report([scan_model(m, cache=cache, progress=False) for m in models], min_bytes).shared_with_earlier_bytes()


class Ramp:
    """One phase: engines of one load format started one at a time, measured at each count.

    `measure` returns one entry per engine count: ``pss_bytes`` (all servers' trees, plus the
    registry), ``file_pss_bytes`` (the servers' file-backed part), ``registry_pss_bytes``,
    ``ready_s`` (the newest engine's start to ``/health``), ``mapped_bytes`` (registry),
    ``load`` (dedup: the newest engine's load path and seconds, as it reported them) and
    ``text`` (the newest engine's completion).  Every pid seen
    is kept in ``pids`` so that the caller can check none outlives the run.
    """

    def __init__(self, models: list[Path], load_format: str, logs: Path):
        self.models, self.load_format, self.logs = models, load_format, logs
        self.pids: set[int] = set()

    def measure(self) -> list[dict]:
        servers: list[ServeProcess] = []
        entries = []
        extra = DEDUP_CONFIG if self.load_format == "dedup" else None
        try:
            for i, model in enumerate(self.models):
                print(f"  {self.load_format}: engine {i + 1} of {len(self.models)} ({model.name}) ...",
                      file=sys.stderr, flush=True)
                begin = time.monotonic()
                server = ServeProcess(model, self.load_format, self.logs / f"{self.load_format}-{i}.log",
                                      extra_config=extra, core=i % (os.cpu_count() or 1))
                servers.append(server)
                server.wait_ready(600)
                ready_s = time.monotonic() - begin
                # One request before measuring: a server's first request allocates what serving
                # needs, and shows that the engine works.
                text = server.complete([PROMPT], max_tokens=8)[0]
                time.sleep(1)
                entries.append({"ready_s": ready_s, "text": text, **self._memory(servers)})
            return entries
        finally:
            for server in servers:
                server.stop()

    def _memory(self, servers: list[ServeProcess]) -> dict:
        total = file = 0
        for server in servers:
            self.pids.update(descendants(server.proc.pid))
            parts = tree_pss_parts(server.proc.pid)
            total, file = total + parts["Pss"], file + parts["Pss_File"]
        registry_pss = mapped = 0
        load = {}
        if self.load_format == "dedup":
            stats = registry_stats()
            self.pids.add(stats.registry_pid)
            registry_pss = pss_bytes(stats.registry_pid)
            mapped = sum(g.saved_bytes for g in stats.groups)
            newest = set(descendants(servers[-1].proc.pid))  # the engine's pid is its worker's
            load = next((e.load for e in stats.engines if e.pid in newest), {})
        return {"pss_bytes": total + registry_pss, "file_pss_bytes": file, "registry_pss_bytes": registry_pss,
                "mapped_bytes": mapped, "load": {"path": load.get("path", "-"), "seconds": load.get("load_seconds")}}


def expected_lines(plain: list[dict], dedup: list[dict], shared: list[int]) -> dict:
    """The expected totals at n = 1..N from each phase's measured single engine and the
    checkpoints' shared bytes (see the module docstring)."""
    one_plain, one_dedup = plain[0], dedup[0]
    plain_next = one_plain["pss_bytes"] - one_plain["file_pss_bytes"]
    dedup_next = one_dedup["pss_bytes"] - one_dedup["registry_pss_bytes"] - one_dedup["file_pss_bytes"]
    counts = range(1, len(plain) + 1)
    return {"shared_bytes": shared,
            "pss_plain_bytes": [one_plain["pss_bytes"] + (n - 1) * plain_next for n in counts],
            "pss_dedup_bytes": [one_dedup["pss_bytes"] + sum(dedup_next - shared[i] for i in range(1, n)) for n in counts]}


def engines_within(rows: list[dict], scenario: str, key: str, budget_bytes: int) -> tuple[int, bool]:
    """How many engines fit in ``budget_bytes``: the largest measured n up to which every
    count's ``key`` total is within it, and whether that n is the largest measured (then more
    might fit: the run says "at least")."""
    counts = sorted((r["engines"], r[key]) for r in rows if r["scenario"] == scenario)
    fit = 0
    for n, total in counts:
        if total > budget_bytes:
            break
        fit = n
    return fit, fit == counts[-1][0]


def budget_fit(rows: list[dict], scenarios: list[str], budget_gib: float) -> dict:
    """The ``budget`` part of the result: per scenario, the engines that fit, plain and dedup."""
    budget_bytes = int(budget_gib * GIB)
    fit = []
    for scenario in scenarios:
        entry = {"scenario": scenario}
        for fmt in ("plain", "dedup"):
            n, at_least = engines_within(rows, scenario, f"pss_{fmt}_bytes", budget_bytes)
            entry |= {f"{fmt}_engines": n, f"{fmt}_at_least": at_least}
        fit.append(entry)
    return {"gib": budget_gib, "bytes": budget_bytes, "fit": fit}


def run(model: Path, max_engines: int, scenarios: list[str], logs: Path) -> dict:
    """Both phases of every scenario; the result object (see `main`)."""
    min_bytes = DedupConfig().min_tensor_bytes
    cache = ManifestCache(default_cache_dir())
    base_scan = scan_model(model, cache=cache, progress=False)
    rows, expected, extra, pids = [], {}, {}, set()
    for scenario in scenarios:
        names, models = zip(*scenario_models(model, scenario, max_engines))
        shared = shared_per_engine(list(models), min_bytes)
        print(f"{scenario}: {', '.join(names)}", file=sys.stderr, flush=True)
        phases = {}
        for fmt, load_format in (("plain", "auto"), ("dedup", "dedup")):
            ramp = Ramp(list(models), load_format, logs)
            try:
                phases[fmt] = ramp.measure()
            finally:
                pids |= ramp.pids
                if load_format == "dedup":
                    shutdown_registry()  # the next phase starts from an empty registry
        plain, dedup = phases["plain"], phases["dedup"]
        for n in range(1, max_engines + 1):
            p, d = plain[n - 1], dedup[n - 1]
            rows.append({"scenario": scenario, "engines": n, "pss_plain_bytes": p["pss_bytes"],
                         "pss_dedup_bytes": d["pss_bytes"], "ready_plain_s": round(p["ready_s"], 2),
                         "ready_dedup_s": round(d["ready_s"], 2)})
        expected[scenario] = expected_lines(plain, dedup, shared)
        extra[scenario] = {
            "models": list(names),
            "registry_pss_bytes": [d["registry_pss_bytes"] for d in dedup],
            "file_pss_plain_bytes": [p["file_pss_bytes"] for p in plain],
            "file_pss_dedup_bytes": [d["file_pss_bytes"] for d in dedup],
            "mapped_bytes": [d["mapped_bytes"] for d in dedup],
            "dedup_loads": [d["load"] for d in dedup],
            "same_text": [p["text"] == d["text"] for p, d in zip(plain, dedup)],
        }
    return {"model": str(model), "model_weight_bytes": Report([base_scan]).model_bytes(base_scan),
            "min_tensor_bytes": min_bytes, "max_engines": max_engines, "rows": rows, "expected": expected,
            "scenarios": extra, "leftover_pids": _wait_gone(pids)}


def _wait_gone(pids: set[int], timeout_s: float = 30) -> list[int]:
    """The pids (servers' processes, registry daemon) still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = sorted(p for p in pids if Path(f"/proc/{p}").exists())
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _mb(n: float) -> str:
    return f"{n / MB:.0f}"


def _load_text(load: dict) -> str:
    return load["path"] + (f" {load['seconds']:.2f} s" if load["seconds"] is not None else "")


def print_table(result: dict) -> None:
    """The result as a plain-text table, then the budget lines."""
    print(f"model {result['model']} ({result['model_weight_bytes'] / MB:.1f} MB of weights); total PSS of "
          f"all engines in MB (dedup: with the registry daemon), expected from 1 engine and the checkpoints")
    header = ["scenario", "n", "n-th engine", "plain", "exp.", "dedup", "exp.", "saved", "mapped",
              "ready plain s", "ready dedup s", "dedup load", "same text"]
    lines = []
    for r in result["rows"]:
        s, i = r["scenario"], r["engines"] - 1
        exp, more = result["expected"][s], result["scenarios"][s]
        saved = r["pss_plain_bytes"] - r["pss_dedup_bytes"]
        lines.append([s, r["engines"], more["models"][i], _mb(r["pss_plain_bytes"]), _mb(exp["pss_plain_bytes"][i]),
                      _mb(r["pss_dedup_bytes"]), _mb(exp["pss_dedup_bytes"][i]),
                      f"{_mb(saved)} ({100 * saved / r['pss_plain_bytes']:.0f}%)", _mb(more["mapped_bytes"][i]),
                      f"{r['ready_plain_s']:.1f}", f"{r['ready_dedup_s']:.1f}", _load_text(more["dedup_loads"][i]),
                      "yes" if more["same_text"][i] else "NO"])
    print(table(lines, header, "lrl" + "r" * (len(header) - 3)))
    if budget := result.get("budget"):
        for f in budget["fit"]:
            counts = {fmt: ("≥ " if f[f"{fmt}_at_least"] else "") + str(f[f"{fmt}_engines"]) for fmt in ("plain", "dedup")}
            print(f"engines within {budget['gib']:g} GiB ({budget['bytes'] / MB:.0f} MB), {f['scenario']}: "
                  f"plain {counts['plain']}, dedup {counts['dedup']} (measured)")


_COLORS = {"plain": "#d1495b", "dedup": "#2a788e"}
_EXPECTED_COLORS = {"plain": "#6e1320", "dedup": "#0d3440"}  # darker: visible where they meet the measured


def _draw_memory(ax, rows: list[dict], exp: dict, budget: dict | None, top_gb: float) -> None:
    n = [r["engines"] for r in rows]
    for fmt in ("plain", "dedup"):
        ax.plot(n, [r[f"pss_{fmt}_bytes"] / 1e9 for r in rows], "o-", color=_COLORS[fmt], lw=2, label=f"{fmt}, measured")
    shared = ", ".join(_mb(b) for b in exp["shared_bytes"][1:]) or "-"
    labels = {"plain": "plain, expected: n × one engine, code pages once",
              "dedup": f"dedup, expected: engines 2..{n[-1]} map {shared} MB"}
    for fmt in ("plain", "dedup"):
        ax.plot(n, [b / 1e9 for b in exp[f"pss_{fmt}_bytes"]], "--", color=_EXPECTED_COLORS[fmt], lw=1.2, zorder=3,
                label=labels[fmt])
    if budget:
        ax.axhline(budget["bytes"] / 1e9, color="#555555", lw=1, ls=":", label=f"budget {budget['gib']:g} GiB")
    last = rows[-1]
    low, high = last["pss_dedup_bytes"] / 1e9, last["pss_plain_bytes"] / 1e9
    saved = last["pss_plain_bytes"] - last["pss_dedup_bytes"]
    ax.annotate("", (n[-1], low), (n[-1], high), arrowprops={"arrowstyle": "<->", "lw": 1})
    ax.text(n[-1] - 0.06, (low + high) / 2, f"−{saved / MB:.0f} MB\n({100 * saved / last['pss_plain_bytes']:.0f}%)",
            ha="right", va="center", fontsize=9, bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 1})
    ax.set_ylabel("total PSS of all engines (GB)")
    ax.set_ylim(0, top_gb * 1.08)
    ax.set_xticks(n)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def _draw_ready(ax, rows: list[dict], slowest_s: float) -> None:
    n = [r["engines"] for r in rows]
    for fmt in ("plain", "dedup"):
        ax.plot(n, [r[f"ready_{fmt}_s"] for r in rows], "o-", color=_COLORS[fmt], label=fmt)
    ax.set_xlabel("engines up (vllm serve, started one at a time)")
    ax.set_ylabel("n-th engine\nready (s)")
    ax.set_ylim(0, slowest_s * 1.25)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right", ncols=2)


def write_plot(result: dict, path: Path) -> Path:
    """Draw total PSS against engine count, plain vs dedup, measured (solid) and expected
    (dashed), one column per scenario, with the time-to-ready of the n-th engine under each;
    write it to ``path`` as PNG.  Returns ``path``."""
    from vllm_dedup.scan.plot import require_matplotlib

    Figure, FigureCanvasAgg = require_matplotlib()
    scenarios = list(result["expected"])
    fig = Figure(figsize=(5.6 * len(scenarios) + 0.6, 7.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, len(scenarios), height_ratios=[3, 1.2])
    all_rows = result["rows"]
    top_gb = max(max(r["pss_plain_bytes"], r["pss_dedup_bytes"]) for r in all_rows) / 1e9
    slowest_s = max(max(r["ready_plain_s"], r["ready_dedup_s"]) for r in all_rows)
    for col, scenario in enumerate(scenarios):
        rows = [r for r in all_rows if r["scenario"] == scenario]
        mem = fig.add_subplot(grid[0, col])
        _draw_memory(mem, rows, result["expected"][scenario], result.get("budget"), top_gb)
        mem.set_title(f"{scenario}: " + ", ".join(result["scenarios"][scenario]["models"]), fontsize=10)
        _draw_ready(fig.add_subplot(grid[1, col], sharex=mem), rows, slowest_s)
    fig.suptitle(f"vllm serve engines per host: {Path(result['model']).name} "
                 f"({result['model_weight_bytes'] / MB:.0f} MB of weights), plain vs dedup", fontsize=12)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="HF model folder (default: the converted SmolLM2)")
    parser.add_argument("--max-engines", type=int, default=4, help="engines up at the end of each phase (default 4)")
    parser.add_argument("--budget-gib", type=float, default=None, help="report how many engines fit in this many GiB")
    parser.add_argument("--scenario", choices=("both", *SCENARIOS), default="both",
                        help="run one scenario only (default: both)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG (default benchmarks/results)")
    parser.add_argument("--json", action="store_true", help="print the JSON result as the last line")
    args = parser.parse_args()
    if args.max_engines < 1:
        parser.error("--max-engines must be at least 1")
    if args.model is None:
        from harness.sample_models import smollm2_hf

        args.model = smollm2_hf()
    scenarios = list(SCENARIOS) if args.scenario == "both" else [args.scenario]

    with tempfile.TemporaryDirectory(prefix="vllm-dedup-per-host-") as run_dir:
        os.environ["VLLM_DEDUP_RUNTIME_DIR"] = str(Path(run_dir) / "run")  # a private registry
        logs = Path(run_dir) / "logs"
        logs.mkdir()
        try:
            result = run(args.model, args.max_engines, scenarios, logs)
        finally:
            shutdown_registry()
    if args.budget_gib is not None:
        result["budget"] = budget_fit(result["rows"], scenarios, args.budget_gib)
    args.out.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(write_plot(result, args.out / "engines_per_host.png"))
    print_table(result)
    if result["leftover_pids"]:
        print(f"left running: pids {result['leftover_pids']}")
    (args.out / "engines_per_host.json").write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    ok = not result["leftover_pids"] and all(all(m["same_text"]) for m in result["scenarios"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
