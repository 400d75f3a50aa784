"""A vLLM engine with tensor parallelism on the CPU backend (one worker process per TP rank),
for tests/test_tp.py.

    python tests/tp_engine.py MODEL LOAD_FORMAT TP_SIZE

Prints ``RESULT [token ids]`` (greedy, 8 tokens) once loaded, then keeps the engine up until
stdin closes.
"""

from __future__ import annotations

import json
import sys

from vllm import LLM, SamplingParams


def main() -> None:
    model, load_format, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model, tensor_parallel_size=tp, load_format=load_format, enforce_eager=True,
              kv_cache_memory_bytes=32 << 20, distributed_executor_backend="mp", max_model_len=256)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    print("RESULT " + json.dumps(list(out[0].outputs[0].token_ids)), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
