"""Engines per host: memory and time-to-ready of 1, 2, ..., N ``vllm serve`` engines, plain vs dedup.

    .venv/bin/python benchmarks/engines_per_host.py [--model DIR | --preset {smollm2,llama-1.2b}] [--max-engines N]
                                                    [--budget-gib G] [--scenario {both,same-model,family}]
                                                    [--out DIR] [--json]

Models (``--preset``): ``smollm2`` (the default), the converted SmolLM2-135M-Instruct;
``llama-1.2b``, a random-weight Llama of 1.17B parameters (bfloat16, 2.34 GB in three shards,
`harness.sample_models.llama_1b`), made at the first run.  For the 1B model, as many engines as
fit in 20 GiB: ``--preset llama-1.2b --scenario same-model --max-engines 14 --budget-gib 20``
(measured here: each plain engine adds 4.5 GB, each dedup engine after the first 1.6 GB, so
plain 4 and dedup 11 fit; the run stops adding engines once a phase's total passes the budget).

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
nothing is extrapolated).  A phase stops adding engines once its total passes G GiB (the engine
that passed it is measured: it shows what does not fit), so the two phases may end at different
counts.  Whatever the budget, a phase also stops before an engine the machine has no memory left
for (``MemAvailable`` under the last engine's PSS plus 1 GiB); the JSON says why each stopped.
The JSON (``dedup_warnings``) and the output also give each dedup engine's vllm-dedup warnings
from its log, e.g. why one loaded privately.

Output: the machine's CPU flags and a table on stdout; ``engines_per_host.json`` and
``engines_per_host.png`` (matplotlib; ``engines_per_host-llama-1.2b.*`` for that preset) in
``--out`` (default ``benchmarks/results/``); with ``--json`` the JSON object is also the last
line of stdout.  Exit status 1 when a dedup engine's completion differs from the plain
engine's in the same position, or a process the run started outlived it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.engines import ServeProcess, dedup_warnings  # noqa: E402
from harness.machine import describe, machine  # noqa: E402
from harness.results import write_results  # noqa: E402
from harness.procs import descendants, pss_bytes, tree_pss_parts  # noqa: E402
from harness.variants import cached_variant  # noqa: E402
from vllm_dedup.config import DedupConfig  # noqa: E402
from vllm_dedup.errors import RegistryUnavailable  # noqa: E402
from vllm_dedup.registry.client import registry_stats, shutdown_registry  # noqa: E402
from vllm_dedup.scan.files import scan_model  # noqa: E402
from vllm_dedup.checkpoint.manifest import ManifestCache, default_cache_dir  # noqa: E402
from vllm_dedup.scan.report import Report  # noqa: E402
from vllm_dedup.text import table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _smollm2() -> Path:
    from harness.sample_models import smollm2_hf

    return smollm2_hf()


def _llama_1b() -> Path:
    from harness.sample_models import llama_1b

    return llama_1b()


PRESETS = {"smollm2": _smollm2, "llama-1.2b": _llama_1b}
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

    def __init__(self, models: list[Path], load_format: str, logs: Path, budget_bytes: int | None = None):
        self.models, self.load_format, self.logs, self.budget_bytes = models, load_format, logs, budget_bytes
        self.pids: set[int] = set()
        self.stopped: str | None = None  # why the phase ended before its last engine, if it did

    def measure(self) -> list[dict]:
        servers: list[ServeProcess] = []
        entries = []
        extra = DEDUP_CONFIG if self.load_format == "dedup" else None
        try:
            for i, model in enumerate(self.models):
                if entries and (why := self._no_room(entries)):
                    self.stopped = why
                    print(f"  {self.load_format}: stopped at {len(entries)} engine(s): {why}", file=sys.stderr,
                          flush=True)
                    break
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

    def _no_room(self, entries: list[dict]) -> str | None:
        """Why no further engine is started (None: start it): the total passed the budget, or
        the machine's available memory would not hold one more engine like the last one."""
        total = entries[-1]["pss_bytes"]
        if self.budget_bytes is not None and total > self.budget_bytes:
            return f"{total / MB:.0f} MB is over the budget of {self.budget_bytes / MB:.0f} MB"
        last = total - (entries[-2]["pss_bytes"] if len(entries) > 1 else 0)
        available = _mem_available()
        if available < last + GIB:
            return (f"the machine has {available / MB:.0f} MB available, under one more engine "
                    f"({last / MB:.0f} MB) plus 1 GiB")
        return None

    def _memory(self, servers: list[ServeProcess]) -> dict:
        total = file = 0
        for server in servers:
            self.pids.update(descendants(server.proc.pid))
            parts = tree_pss_parts(server.proc.pid)
            total, file = total + parts["Pss"], file + parts["Pss_File"]
        registry_pss = mapped = 0
        load, warnings = {}, []
        if self.load_format == "dedup":
            warnings = dedup_warnings(servers[-1].log_path)
            for line in warnings:  # said at once: the logs go with the run's folder
                print(f"  dedup engine {len(servers)} warned: {line}", file=sys.stderr, flush=True)
            try:
                stats = registry_stats()
            except RegistryUnavailable as e:  # measured all the same: the row says the registry was gone
                print(f"  dedup engine {len(servers)}: {e}", file=sys.stderr, flush=True)
                warnings.append(f"measuring: {e}")
            else:
                self.pids.add(stats.registry_pid)
                registry_pss = pss_bytes(stats.registry_pid)
                mapped = sum(g.saved_bytes for g in stats.groups)
                newest = set(descendants(servers[-1].proc.pid))  # the engine's pid is its worker's
                load = next((e.load for e in stats.engines if e.pid in newest), {})
        return {"pss_bytes": total + registry_pss, "file_pss_bytes": file, "registry_pss_bytes": registry_pss,
                "mapped_bytes": mapped, "load": {"path": load.get("load_path", "-"), "seconds": load.get("load_seconds")},
                "warnings": warnings}


def _mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def expected_lines(plain: list[dict], dedup: list[dict], shared: list[int]) -> dict:
    """The expected totals at n = 1..N (N: the longer phase) from each phase's measured single
    engine and the checkpoints' shared bytes (see the module docstring)."""
    one_plain, one_dedup = plain[0], dedup[0]
    plain_next = one_plain["pss_bytes"] - one_plain["file_pss_bytes"]
    dedup_next = one_dedup["pss_bytes"] - one_dedup["registry_pss_bytes"] - one_dedup["file_pss_bytes"]
    counts = range(1, max(len(plain), len(dedup)) + 1)
    return {"shared_bytes": shared,
            "pss_plain_bytes": [one_plain["pss_bytes"] + (n - 1) * plain_next for n in counts],
            "pss_dedup_bytes": [one_dedup["pss_bytes"] + sum(dedup_next - shared[i] for i in range(1, n)) for n in counts]}


def engines_within(rows: list[dict], scenario: str, key: str, budget_bytes: int) -> tuple[int, bool]:
    """How many engines fit in ``budget_bytes``: the largest measured n up to which every
    count's ``key`` total is within it, and whether that n is the largest measured (then more
    might fit: the run says "at least")."""
    counts = sorted((r["engines"], r[key]) for r in rows if r["scenario"] == scenario and r[key] is not None)
    fit = 0
    for n, total in counts:
        if total > budget_bytes:
            break
        fit = n
    return fit, bool(counts) and fit == counts[-1][0]


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


def run(model: Path, max_engines: int, scenarios: list[str], logs: Path, budget_bytes: int | None = None) -> dict:
    """Both phases of every scenario; the result object (see `main`).  A phase stops early as
    `Ramp` says (``budget_bytes``, the machine's memory); its missing rows are None."""
    min_bytes = DedupConfig().min_tensor_bytes
    cache = ManifestCache(default_cache_dir())
    base_scan = scan_model(model, cache=cache, progress=False)
    rows, expected, extra, pids = [], {}, {}, set()
    for scenario in scenarios:
        names, models = zip(*scenario_models(model, scenario, max_engines))
        shared = shared_per_engine(list(models), min_bytes)
        print(f"{scenario}: {', '.join(names)}", file=sys.stderr, flush=True)
        phases, stopped = {}, {}
        for fmt, load_format in (("plain", "auto"), ("dedup", "dedup")):
            ramp = Ramp(list(models), load_format, logs, budget_bytes)
            try:
                phases[fmt] = ramp.measure()
            finally:
                pids |= ramp.pids
                stopped[fmt] = ramp.stopped
                if load_format == "dedup":
                    shutdown_registry()  # the next phase starts from an empty registry
        plain, dedup = phases["plain"], phases["dedup"]
        for n in range(1, max(len(plain), len(dedup)) + 1):
            p = plain[n - 1] if n <= len(plain) else None
            d = dedup[n - 1] if n <= len(dedup) else None
            rows.append({"scenario": scenario, "engines": n, "pss_plain_bytes": p and p["pss_bytes"],
                         "pss_dedup_bytes": d and d["pss_bytes"], "ready_plain_s": p and round(p["ready_s"], 2),
                         "ready_dedup_s": d and round(d["ready_s"], 2)})
        expected[scenario] = expected_lines(plain, dedup, shared)
        extra[scenario] = {
            "models": list(names),
            "registry_pss_bytes": [d["registry_pss_bytes"] for d in dedup],
            "file_pss_plain_bytes": [p["file_pss_bytes"] for p in plain],
            "file_pss_dedup_bytes": [d["file_pss_bytes"] for d in dedup],
            "mapped_bytes": [d["mapped_bytes"] for d in dedup],
            "dedup_loads": [d["load"] for d in dedup],
            "dedup_warnings": [d["warnings"] for d in dedup],
            "same_text": [p["text"] == d["text"] for p, d in zip(plain, dedup)],
            "stopped": stopped,
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


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / MB:.0f}"


def _at(values: list, i: int):
    """``values[i]``, or None past its end (a phase that stopped early)."""
    return values[i] if i < len(values) else None


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
        plain, dedup = r["pss_plain_bytes"], r["pss_dedup_bytes"]
        saved = f"{_mb(plain - dedup)} ({100 * (plain - dedup) / plain:.0f}%)" if plain and dedup else "-"
        load, same = _at(more["dedup_loads"], i), _at(more["same_text"], i)
        lines.append([s, r["engines"], more["models"][i], _mb(plain), _mb(exp["pss_plain_bytes"][i]),
                      _mb(dedup), _mb(exp["pss_dedup_bytes"][i]), saved, _mb(_at(more["mapped_bytes"], i)),
                      "-" if r["ready_plain_s"] is None else f"{r['ready_plain_s']:.1f}",
                      "-" if r["ready_dedup_s"] is None else f"{r['ready_dedup_s']:.1f}",
                      "-" if load is None else _load_text(load), "-" if same is None else "yes" if same else "NO"])
    print(table(lines, header, "lrl" + "r" * (len(header) - 3)))
    for s, more in result["scenarios"].items():
        for fmt, why in more.get("stopped", {}).items():
            if why:
                print(f"{s}, {fmt}: stopped early: {why}")
        for i, lines in enumerate(more.get("dedup_warnings", [])):
            for line in lines:
                print(f"{s}, dedup engine {i + 1} warned: {line}")
    if budget := result.get("budget"):
        for f in budget["fit"]:
            counts = {fmt: ("≥ " if f[f"{fmt}_at_least"] else "") + str(f[f"{fmt}_engines"]) for fmt in ("plain", "dedup")}
            print(f"engines within {budget['gib']:g} GiB ({budget['bytes'] / MB:.0f} MB), {f['scenario']}: "
                  f"plain {counts['plain']}, dedup {counts['dedup']} (measured)")


_COLORS = {"plain": "#d1495b", "dedup": "#2a788e"}
_EXPECTED_COLORS = {"plain": "#6e1320", "dedup": "#0d3440"}  # darker: visible where they meet the measured


def _measured(rows: list[dict], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """(engine counts, values) of the rows where ``key`` was measured."""
    kept = [r for r in rows if r[key] is not None]
    return [r["engines"] for r in kept], [r[key] / scale for r in kept]


def _draw_memory(ax, rows: list[dict], exp: dict, budget: dict | None, top_gb: float) -> None:
    n = [r["engines"] for r in rows]
    for fmt in ("plain", "dedup"):
        ax.plot(*_measured(rows, f"pss_{fmt}_bytes", 1e9), "o-", color=_COLORS[fmt], lw=2, label=f"{fmt}, measured")
    shared = ", ".join(_mb(b) for b in exp["shared_bytes"][1:]) or "-"
    labels = {"plain": "plain, expected: n × one engine, code pages once",
              "dedup": f"dedup, expected: engines 2..{n[-1]} map {shared} MB"}
    for fmt in ("plain", "dedup"):
        ax.plot(n, [b / 1e9 for b in exp[f"pss_{fmt}_bytes"]], "--", color=_EXPECTED_COLORS[fmt], lw=1.2, zorder=3,
                label=labels[fmt])
    if budget:
        ax.axhline(budget["bytes"] / 1e9, color="#555555", lw=1, ls=":", label=f"budget {budget['gib']:g} GiB")
    both = [r for r in rows if r["pss_plain_bytes"] is not None and r["pss_dedup_bytes"] is not None]
    if both:
        last = both[-1]
        low, high = last["pss_dedup_bytes"] / 1e9, last["pss_plain_bytes"] / 1e9
        saved = last["pss_plain_bytes"] - last["pss_dedup_bytes"]
        x = last["engines"]
        ax.annotate("", (x, low), (x, high), arrowprops={"arrowstyle": "<->", "lw": 1})
        ax.text(x - 0.06, (low + high) / 2, f"−{saved / MB:.0f} MB\n({100 * saved / last['pss_plain_bytes']:.0f}%)",
                ha="right", va="center", fontsize=9, bbox={"fc": "white", "ec": "none", "alpha": 0.85, "pad": 1})
    ax.set_ylabel("total PSS of all engines (GB)")
    ax.set_ylim(0, top_gb * 1.08)
    ax.set_xticks(n)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def _draw_ready(ax, rows: list[dict], slowest_s: float) -> None:
    for fmt in ("plain", "dedup"):
        ax.plot(*_measured(rows, f"ready_{fmt}_s"), "o-", color=_COLORS[fmt], label=fmt)
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
    top_gb = max(v for r in all_rows for v in (r["pss_plain_bytes"], r["pss_dedup_bytes"]) if v is not None) / 1e9
    slowest_s = max(v for r in all_rows for v in (r["ready_plain_s"], r["ready_dedup_s"]) if v is not None)
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
    parser.add_argument("--model", type=Path, help="HF model folder (default: the preset's)")
    parser.add_argument("--preset", choices=PRESETS, default=None,
                        help="smollm2 (default) or llama-1.2b (random weights, bfloat16, 2.34 GB)")
    parser.add_argument("--max-engines", type=int, default=4, help="engines up at the end of each phase (default 4)")
    parser.add_argument("--budget-gib", type=float, default=None, help="report how many engines fit in this many GiB")
    parser.add_argument("--scenario", choices=("both", *SCENARIOS), default="both",
                        help="run one scenario only (default: both)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and PNG (default benchmarks/results)")
    parser.add_argument("--json", action="store_true", help="print the JSON result as the last line")
    args = parser.parse_args()
    if args.max_engines < 1:
        parser.error("--max-engines must be at least 1")
    if args.model is not None and args.preset is not None:
        parser.error("give --model or --preset, not both")
    name = "engines_per_host" if args.preset in (None, "smollm2") else f"engines_per_host-{args.preset}"
    if args.model is None:
        args.model = PRESETS[args.preset or "smollm2"]()
    scenarios = list(SCENARIOS) if args.scenario == "both" else [args.scenario]
    print(describe(), flush=True)

    with tempfile.TemporaryDirectory(prefix="vllm-dedup-per-host-") as run_dir:
        os.environ["VLLM_DEDUP_RUNTIME_DIR"] = str(Path(run_dir) / "run")  # a private registry
        logs = Path(run_dir) / "logs"
        logs.mkdir()
        try:
            budget = int(args.budget_gib * GIB) if args.budget_gib is not None else None
            result = run(args.model, args.max_engines, scenarios, logs, budget)
            result["machine"] = machine()
        finally:
            shutdown_registry()
    if args.budget_gib is not None:
        result["budget"] = budget_fit(result["rows"], scenarios, args.budget_gib)
    args.out.mkdir(parents=True, exist_ok=True)
    result["plot"] = str(write_plot(result, args.out / f"{name}.png"))
    print_table(result)
    if result["leftover_pids"]:
        print(f"left running: pids {result['leftover_pids']}")
    write_results(args.out / f"{name}.json", result, args.json)
    ok = not result["leftover_pids"] and all(all(m["same_text"]) for m in result["scenarios"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
