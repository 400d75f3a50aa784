"""A vLLM engine with tensor parallelism on the CPU backend (one worker process per TP rank),
for tests/e2e/test_tp.py.

    python tests/peers/tp_engine.py MODEL LOAD_FORMAT TP_SIZE [EXTRA_CONFIG_JSON]

Prints ``RESULT [token ids]`` (greedy, 8 tokens) once loaded and ``TENSORS [per rank]`` (the
final-tensor oracle's digests, `harness.oracle`), then keeps the engine up until stdin closes.
"""

from __future__ import annotations

import json
import sys

from vllm import LLM, SamplingParams

from harness.oracle import EXTENSION


def main() -> None:
    model, load_format, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    llm = LLM(model, tensor_parallel_size=tp, load_format=load_format, enforce_eager=True,
              kv_cache_memory_bytes=32 << 20, distributed_executor_backend="mp", max_model_len=256,
              worker_extension_cls=EXTENSION, **({"model_loader_extra_config": extra} if extra else {}))
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    print("RESULT " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
    print("TENSORS " + json.dumps(llm.collective_rpc("final_tensor_digests")), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
