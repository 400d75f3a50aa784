"""Three fine-tunes of SmolLM2 as Ray Serve deployments that share their common weights.

    python examples/serve_finetunes.py                 # deploy with dedup and serve until Ctrl-C
    python examples/serve_finetunes.py --smoke --json  # plain vs dedup, measured, torn down
    python examples/serve_finetunes.py --models 2      # the base model and one fine-tune only

The application is Ray Serve LLM's OpenAI-compatible app (``ray.serve.llm.build_openai_app``):
one ``LLMServer`` deployment per model, each a vLLM engine (CPU backend here) loading with
``load_format="dedup"``, behind one ``/v1`` route that picks the deployment from the request's
``model`` field.  `vllm_dedup.serve.build_dedup_app` builds it and creates the registry actor in
the same Ray cluster first.  Models: SmolLM2-135M-Instruct and two variants of it
(`harness.variants.smollm2_family`).

``--smoke`` runs the same application twice in one Ray cluster, plain (vLLM's default loader)
then dedup: deploy, query every model once (greedy), measure PSS, delete.  PSS is summed over
the processes of the ``LLMServer`` replicas (replica actor, vLLM engine core, worker) and, for
dedup, the registry actor's process; the proxy, controller and ingress are the same in both
runs and left out.  The last line printed is one JSON object.

Ray: with ``--address`` (or ``RAY_ADDRESS``) the script joins that cluster, otherwise it starts a
single-node cluster on 127.0.0.1 for its own use.  In its own cluster the application answers at
``/v1``; in a joined one, whose ``/`` may belong to another application, at ``/<app>/v1``
(``--route-prefix`` chooses).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/: the repository's test and demo scaffolding (not shipped)

from harness.engines import openai_complete  # noqa: E402
from harness.procs import free_port, serve_replica_pids, tree_pss_bytes, tree_pss_parts  # noqa: E402
from harness.variants import smollm2_family  # noqa: E402
from vllm_dedup.registry.client import registry_stats, shutdown_registry  # noqa: E402

PROMPT = "The capital of France is"
MB = 1e6
ENGINE_KWARGS = {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "seed": 0,
                 "kv_cache_memory_bytes": 32 << 20}  # the CPU backend wants the KV cache size given


def route_prefix(chosen: str | None, app_name: str, joined: bool) -> str:
    """Where the application answers: ``chosen``; else ``/`` in the script's own cluster, and
    ``/<app_name>`` in a joined one (Serve refuses a second application at a prefix taken)."""
    if chosen is not None:
        return "/" + chosen.strip("/")
    return f"/{app_name}" if joined else "/"


def deploy(models: dict, dedup: bool, app_name: str, port: int, prefix: str = "/") -> int:
    """Run the application ``app_name`` at ``prefix``; returns the HTTP port Serve answers on:
    ``port``, or the one of a Serve already running in a joined cluster, which keeps its own
    options (and only logs that it ignored ours)."""
    from ray import serve
    from ray.serve.context import _get_global_client  # Ray has no public call for Serve's port

    from vllm_dedup.serve import build_dedup_app

    app = build_dedup_app(models, dedup=dedup, engine_kwargs=ENGINE_KWARGS,
                          deployment_config={"num_replicas": 1})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(app, name=app_name, route_prefix=prefix, blocking=False)
    return _get_global_client().http_config.port


def run_phase(models: dict, dedup: bool, port: int, prefix: str | None = None, joined: bool = False) -> dict:
    """Deploy, query each model, measure PSS with all replicas up, delete the application."""
    from ray import serve

    from vllm_dedup.serve import ensure_registry

    app_name = "dedup" if dedup else "plain"
    print(f"deploying {app_name} ({len(models)} models) ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    route = route_prefix(prefix, app_name, joined)
    port = deploy(models, dedup, app_name, port, route)
    deploy_s = time.monotonic() - start
    try:
        answers = {}
        for model in models:
            reply = openai_complete(port, model, PROMPT, logprobs=1, route=route.rstrip("/"))
            choice = reply["choices"][0]
            # The logprob tells the models apart where the greedy text does not.
            answers[model] = {"answered_by": reply["model"], "text": choice["text"],
                              "logprob": choice["logprobs"]["token_logprobs"][0]}
        time.sleep(1)
        # Each model's replicas' process trees, read once.  The file-backed part (torch's
        # libraries), whose PSS moves with every other process on the machine that maps them,
        # is reported beside the total, so that a busy machine's comparison can leave it out.
        parts = {model: [tree_pss_parts(p) for p in serve_replica_pids(app_name, f"LLMServer:{model}")]
                 for model in models}
        pss = {model: sum(one["Pss"] for one in trees) for model, trees in parts.items()}
        file_pss = {model: sum(one["Pss_File"] for one in trees) for model, trees in parts.items()}
        stats = registry_stats(ensure_registry()) if dedup else None  # this node's registry
        registry_pss = tree_pss_bytes(stats.registry_pid) if dedup else 0
    finally:
        serve.delete(app_name)
    return {"deploy_s": deploy_s, "answers": answers, "pss": pss, "file_pss": file_pss, "registry_pss": registry_pss,
            "stats": stats}


def smoke(models: dict, port: int, prefix: str | None = None, joined: bool = False) -> dict:
    plain = run_phase(models, dedup=False, port=port, prefix=prefix, joined=joined)
    dedup = run_phase(models, dedup=True, port=port, prefix=prefix, joined=joined)
    by_model = {e.model: e.load for e in dedup["stats"].engines}
    rows = []
    for model, path in models.items():
        load = by_model.get(str(path), {})
        rows.append({
            "model": model,
            "answered_by": dedup["answers"][model]["answered_by"],
            "pss_plain_bytes": plain["pss"][model], "pss_dedup_bytes": dedup["pss"][model],
            "file_pss_plain_bytes": plain["file_pss"][model], "file_pss_dedup_bytes": dedup["file_pss"][model],
            "mapped_from_others_bytes": load.get("shared_bytes", 0),
            "same_text": plain["answers"][model]["text"] == dedup["answers"][model]["text"],
            "text": dedup["answers"][model]["text"],
            "first_token_logprob": dedup["answers"][model]["logprob"],
        })
    pss_plain = sum(plain["pss"].values())
    pss_dedup = sum(dedup["pss"].values()) + dedup["registry_pss"]
    return {
        "models": rows,
        "models_answered": sum(r["answered_by"] == r["model"] for r in rows),
        "pss_plain_bytes": pss_plain,
        "pss_dedup_bytes": pss_dedup,
        "registry_pss_bytes": dedup["registry_pss"],
        "saved_bytes": pss_plain - pss_dedup,
        "mapped_from_others_bytes": sum(r["mapped_from_others_bytes"] for r in rows),
        "same_text": all(r["same_text"] for r in rows),
        "deploy_s": {"plain": plain["deploy_s"], "dedup": dedup["deploy_s"]},
    }


def print_table(result: dict) -> None:
    w = max(len(r["model"]) for r in result["models"]) + 2
    print(f"{'model':<{w}} {'PSS plain':>10} {'PSS dedup':>10} {'mapped':>9}  same text  answered by")
    for r in result["models"]:
        print(f"{r['model']:<{w}} {r['pss_plain_bytes'] / MB:>8.0f}MB {r['pss_dedup_bytes'] / MB:>8.0f}MB "
              f"{r['mapped_from_others_bytes'] / MB:>7.0f}MB  {str(r['same_text']):<9}  {r['answered_by']}")
    print(f"{'registry actor':<{w}} {'':>10} {result['registry_pss_bytes'] / MB:>8.0f}MB")
    print(f"{'total':<{w}} {result['pss_plain_bytes'] / MB:>8.0f}MB {result['pss_dedup_bytes'] / MB:>8.0f}MB "
          f"{result['mapped_from_others_bytes'] / MB:>7.0f}MB")
    print(f"saved with dedup: {result['saved_bytes'] / MB:.0f} MB of PSS; models answered: "
          f"{result['models_answered']}/{len(result['models'])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="plain vs dedup: deploy, query, measure, tear down")
    parser.add_argument("--json", action="store_true", help="with --smoke: print the result as JSON on the last line")
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"), help="Ray cluster to join")
    parser.add_argument("--port", type=int, default=None, help="HTTP port of the OpenAI route (default: a free one)")
    parser.add_argument("--route-prefix", default=None,
                        help="where the application answers (default: / in the script's own cluster, /<app> in a "
                             "joined one)")
    parser.add_argument("--models", type=int, choices=(2, 3), default=3,
                        help="how many of the family: SmolLM2, its last-layers fine-tune, its vocab-extended variant")
    args = parser.parse_args()

    import ray
    from ray import serve

    models = {name: str(path) for name, path in smollm2_family(args.models).items()}
    port = args.port or free_port()
    # --smoke: the replicas' logs stay in Ray's log files, so that stdout ends with the result.
    quiet = {"logging_level": "WARNING", "log_to_driver": not args.smoke}
    if args.address:
        ray.init(address=args.address, **quiet)
    else:
        # A private single-node cluster on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps
        # Ray on 127.0.0.1 instead of the machine's interface address).  Serve kills an HTTP
        # proxy that is not up within 5 s, and `serve.start` then fails: on a small machine
        # busy loading engines, starting its worker process can take longer.
        for key, value in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}.items():
            os.environ.setdefault(key, value)
        # address="local": a new cluster even where one runs on this machine (`ray start`).
        ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False,
                 _node_ip_address="127.0.0.1", **quiet)
    try:
        if not args.smoke:
            route = route_prefix(args.route_prefix, "finetunes", joined=bool(args.address))
            port = deploy(models, dedup=True, app_name="finetunes", port=port, prefix=route)
            print(f"serving {', '.join(models)} at http://127.0.0.1:{port}{route.rstrip('/')}/v1 (Ctrl-C stops)",
                  flush=True)
            while True:
                time.sleep(3600)
        result = smoke(models, port, args.route_prefix, joined=bool(args.address))
    except KeyboardInterrupt:
        return 0
    finally:
        if args.address:  # a joined cluster keeps its other applications and its registry
            running = serve.status().applications
            for name in ("finetunes", "plain", "dedup"):
                if name in running:
                    serve.delete(name)
        else:
            serve.shutdown()
            shutdown_registry()  # our own cluster's
        ray.shutdown()
    # Printed after the teardown, so that nothing Ray says comes after the JSON line.
    print_table(result)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0 if result["models_answered"] == len(models) and result["same_text"] else 1

if __name__ == "__main__":
    sys.exit(main())
