#!/usr/bin/env bash
# The main job, on a fresh machine: set up .venv/, prepare the real sample checkpoints
# (SmolLM2-135M-Instruct converted from its GGUF, and two variants of it), then start three
# `vllm serve` engines on 127.0.0.1 without and with --load-format dedup, query each through
# the OpenAI API, print their memory (PSS) side by side with the bytes shared, and shut
# everything down.  Extra arguments go to examples/demo.py (e.g. --engines 2, --json).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure-venv.sh"
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
exec "$root/.venv/bin/python" "$root/examples/demo.py" "$@"
