"""The ``vllm-dedup`` command.

    vllm-dedup scan PATH... [--json] [--min-bytes N] [--top N] [--threads N] [--keep-going] [--no-cache]
                           [--plot FILE.png]
    vllm-dedup status [--json | --watch [SECONDS]] [--namespace NS] [--all-nodes [--address ADDR]]

scan exit codes: 0 success; 1 some models could not be read (``--keep-going``: the rest are
still reported); 2 bad usage or, without ``--keep-going``, the first model that could not be
read, or a ``--plot`` file that cannot be written.  status exit codes: 0 success (``--watch``:
stopped with Ctrl-C); 1 no registry runs for the namespace on this node (``--all-nodes``: in
the Ray cluster, or no Ray cluster answers, or some node's registry did not answer); 2 bad
usage (``--address`` without ``--all-nodes``, or ``local``, which would start a new cluster).

``status --all-nodes --json`` prints ``{"namespace": NS, "registries": [...]}``, one item per
node's registry actor, head node first: ``name``, ``node_id``, ``node_ip``, ``head``, ``socket``
and either ``stats`` (the object ``status --json`` prints for one registry) or ``error``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import is_registry_namespace
from .checkpoint.manifest import ManifestCache, default_cache_dir
from .errors import CheckpointError, RegistryUnavailable
from .scan.files import scan_model
from .scan.plot import require_matplotlib, write_plot
from .scan.report import Report
from .status import format_status, watch
from .text import size_text, table


def format_report(report: Report, largest: int = 10) -> str:
    """The human-readable scan report (what ``vllm-dedup scan`` prints without --json)."""
    data = report.to_dict(largest)
    models = data["models"]
    out = [
        table(
            [[f"[{i}] {m['path']}", m["tensors"], size_text(m["bytes"])] for i, m in enumerate(models)],
            ["model", "tensors", "bytes"],
        ),
        "",
    ]
    if len(models) > 1:
        pairs = report.pair_shared_bytes()
        out += [
            "bytes shared by each pair of models (by content):",
            table(
                [[f"[{i}]", *(size_text(b) if i != j else "-" for j, b in enumerate(row))] for i, row in enumerate(pairs)],
                ["", *(f"[{j}]" for j in range(len(models)))],
            ),
            "",
        ]
    out += [
        f"total bytes   {size_text(data['total_bytes']):>10}   (each model loaded alone)",
        f"unique bytes  {size_text(data['unique_bytes']):>10}   (each content stored once)",
        f"saved bytes   {size_text(data['saved_bytes']):>10}   ({100 * data['saved_bytes'] / max(data['total_bytes'], 1):.1f}%)",
    ]
    if data["min_bytes"]:
        out.append(f"(tensors under {data['min_bytes']} bytes ignored)")
    if data["largest_shared"]:
        out += ["", f"largest shared tensors (top {largest}):"]
        out.append(
            table(
                [[size_text(s["bytes"]), s["dtype"], "x".join(map(str, s["shape"])), len(s["places"]), s["places"][0]]
                 for s in data["largest_shared"]],
                ["bytes", "dtype", "shape", "copies", "first place"],
            )
        )
    return "\n".join(out)


def _plot_problem(path: str) -> str | None:
    """Why ``--plot path`` cannot be written, found before the scan: matplotlib is missing, or
    the folder it goes in is not there.  None when nothing is wrong yet."""
    try:
        require_matplotlib()
    except ImportError as e:
        return str(e)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"cannot write the plot to {path}: no such folder {folder}"
    return None


def _cmd_scan(args: argparse.Namespace) -> int:
    if args.plot is not None and (problem := _plot_problem(args.plot)):
        print(f"vllm-dedup scan: error: {problem}", file=sys.stderr)
        return 2
    cache = ManifestCache(None if args.no_cache else default_cache_dir())
    scans, errors = [], []
    for path in args.paths:
        try:
            scans.append(scan_model(path, cache=cache, threads=args.threads, progress=None))
        except CheckpointError as e:
            print(f"vllm-dedup scan: error: {e}", file=sys.stderr)
            if not args.keep_going:
                return 2
            errors.append(e)
    report = Report(scans, args.min_bytes, errors)
    if args.json:
        print(json.dumps(report.to_dict(args.top)))
    else:
        print(format_report(report, args.top))
    if args.plot is not None and not report.models:
        print(f"vllm-dedup scan: no model could be read, so {args.plot} was not drawn", file=sys.stderr)
    elif args.plot is not None:
        sys.stdout.flush()
        try:
            written = write_plot(report, args.plot)
        except OSError as e:
            print(f"vllm-dedup scan: error: cannot write the plot to {args.plot}: {e.strerror or e}", file=sys.stderr)
            return 2
        except Exception as e:  # matplotlib's own (a label it cannot lay out): still one line, exit 2
            print(f"vllm-dedup scan: error: cannot draw the plot {args.plot}: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
        print(f"vllm-dedup scan: heatmap written to {written}", file=sys.stderr)
    return 1 if errors else 0


def _all_nodes_frame(namespace: str) -> tuple[str, list]:
    """The status text of every node's registry in ``namespace`` (through Ray), and the
    registries (`ray_actor.NodeRegistry`)."""
    from .registry.ray_actor import node_registries

    found = node_registries(namespace)
    if not found:
        return f"no registry for namespace {namespace!r} in the Ray cluster", found
    text = format_status([(r.where(), r.stats) for r in found if r.stats is not None])
    errors = [f"registry {r.name} on {r.where()} did not answer: {r.error}" for r in found if r.stats is None]
    return "\n\n".join(part for part in (text, "\n".join(errors)) if part), found


def _cmd_status_all_nodes(args: argparse.Namespace) -> int:
    import logging

    try:
        import ray
    except ImportError as e:
        print(f"vllm-dedup status: --all-nodes reads the registries through Ray, which is not installed ({e})",
              file=sys.stderr)
        return 1
    from .registry.ray_actor import probe_ray_address

    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    if address.strip().lower() == "local":  # ray.init("local") starts a new cluster, which holds no registry
        given = "--address" if args.address else "$RAY_ADDRESS"
        print(f"vllm-dedup status: error: {given} {address!r} would start a new, empty Ray cluster; give the "
              "address of the cluster the engines run in (host:port), or leave it out for this node's", file=sys.stderr)
        return 2

    def connect() -> None:
        probe_ray_address(address)
        ray.init(address=address, namespace=args.namespace, logging_level=logging.WARNING, log_to_driver=False,
                 include_dashboard=False)

    if args.watch is not None:  # a cluster not up yet, or going away, is shown and tried again
        def frame() -> str:
            try:
                if not ray.is_initialized():
                    connect()
                return _all_nodes_frame(args.namespace)[0]
            except Exception as e:
                return f"cannot read the registries through Ray at {address}: {e}; retrying every {args.watch:g}s"

        try:
            return watch(frame, args.watch)
        finally:
            ray.shutdown()
    try:
        connect()
    except (RegistryUnavailable, ConnectionError, RuntimeError, ValueError) as e:
        print(f"vllm-dedup status: no Ray cluster at {address} ({e})", file=sys.stderr)
        return 1
    try:
        text, found = _all_nodes_frame(args.namespace)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps({"namespace": args.namespace, "registries": [r.to_dict() for r in found]}))
    else:
        print(text)
    if not found:
        print(f"vllm-dedup status: no registry for namespace {args.namespace!r} in the Ray cluster at {address}",
              file=sys.stderr)
    return 0 if found and all(r.stats is not None for r in found) else 1


def _cmd_status(args: argparse.Namespace) -> int:
    from .registry.client import registry_stats
    from .registry.nodes import local_socket_path

    if args.all_nodes:
        return _cmd_status_all_nodes(args)
    if args.address is not None:
        print("vllm-dedup status: error: --address needs --all-nodes", file=sys.stderr)
        return 2
    path = local_socket_path(args.namespace)
    if args.watch is not None:
        def frame() -> str:
            try:
                return format_status([(str(path), registry_stats(path))])
            except RegistryUnavailable as e:
                return f"no registry for namespace {args.namespace!r}: {e}; retrying every {args.watch:g}s"

        return watch(frame, args.watch)
    try:
        stats = registry_stats(path)
    except RegistryUnavailable as e:
        print(f"vllm-dedup status: no registry for namespace {args.namespace!r} on this node ({e}); every Ray "
              "node's: vllm-dedup status --all-nodes", file=sys.stderr)
        return 1
    print(json.dumps(stats.to_dict()) if args.json else format_status([(str(path), stats)]))
    return 0


def _nonnegative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = _nonnegative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be >= 1, got 0")
    return value


def _namespace(text: str) -> str:
    if not is_registry_namespace(text):
        raise argparse.ArgumentTypeError(f"{text!r} is no registry namespace: use letters, digits, '-', '_' and '.'")
    return text


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0.1 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 86400 seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-dedup", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    scan = sub.add_parser(
        "scan",
        help="report the bytes several checkpoints share, matched by content",
        description="Report how much memory serving these models side by side would save. "
        "Each PATH is a model: an HF folder (one or sharded safetensors), a Diffusers-style "
        "pipeline folder, a .safetensors, .gguf, .bin or .pt file.",
    )
    scan.add_argument("paths", nargs="+", metavar="PATH")
    scan.add_argument("--json", action="store_true", help="print one JSON object")
    scan.add_argument("--min-bytes", type=_nonnegative, default=0, metavar="N", help="ignore tensors under N bytes")
    scan.add_argument("--keep-going", action="store_true", help="report the readable models when others fail")
    scan.add_argument("--no-cache", action="store_true", help="neither read nor write the manifest cache")
    scan.add_argument("--threads", type=_positive, default=None, metavar="N",
                      help="hashing threads (default: one per core, at most 8)")
    scan.add_argument("--top", type=_nonnegative, default=10, metavar="N", help="largest shared tensors listed")
    scan.add_argument("--plot", metavar="FILE.png", help="also draw a PNG: a heatmap of the bytes each pair of "
                      "models shares, and each model's shared and unique bytes (needs matplotlib)")
    scan.set_defaults(func=_cmd_scan)
    status = sub.add_parser("status", help="what the weight registry on this node holds",
                            description="The registry's engines, segments, and bytes shared and saved, "
                            "per device and share group.")
    status.add_argument("--namespace", default="vllm-dedup", type=_namespace,
                        help="registry namespace (default: vllm-dedup)")
    status.add_argument("--all-nodes", action="store_true",
                        help="every node's registry in the Ray cluster, read through Ray (one per node)")
    status.add_argument("--address", metavar="ADDR", default=None,
                        help="with --all-nodes: the Ray cluster (default: $RAY_ADDRESS, else the local one)")
    shown = status.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print one JSON object")
    shown.add_argument("--watch", type=_positive_seconds, nargs="?", const=2.0, default=None, metavar="SECONDS",
                        help="redraw every SECONDS (default 2) until Ctrl-C; a registry that is not there is "
                        "shown so and tried again")
    status.set_defaults(func=_cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``vllm-dedup`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C during a long scan or a watch: no traceback
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
