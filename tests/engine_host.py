"""One real vLLM engine in its own process, driven over stdin/stdout (used by the tests and the
memory benchmark).

    python tests/engine_host.py MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON]

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set here) the engine core and worker run in this
process, so this process's PSS is the engine's memory.  After loading it prints
``READY {"pid": ...}``; then each stdin line is a JSON request ``{"prompts": [...],
"max_tokens": N}`` answered by ``RESULT {"ids": [[token ids], ...], "texts": [...]}``, or ``{"rpc": "method"}``
answered by ``RPC ok`` / ``RPC error <message>``.  EOF or ``exit`` ends it.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from vllm import LLM, SamplingParams

    model, fmt = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    llm = LLM(model, load_format=fmt, dtype="bfloat16", max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=32 << 20, seed=0, **({"model_loader_extra_config": extra} if extra else {}))
    print("READY " + json.dumps({"pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line or line == "exit":
            break
        req = json.loads(line)
        if "rpc" in req:
            try:
                llm.collective_rpc(req["rpc"])
                print("RPC ok", flush=True)
            except Exception as e:
                print("RPC error " + str(e).replace("\n", " "), flush=True)
            continue
        outs = llm.generate(req["prompts"], SamplingParams(temperature=0, max_tokens=req.get("max_tokens", 16)))
        print("RESULT " + json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs],
                                      "texts": [o.outputs[0].text for o in outs]}), flush=True)


if __name__ == "__main__":
    main()
