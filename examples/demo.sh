#!/usr/bin/env bash
# The main job, on a fresh machine: set up .venv/, prepare the real sample checkpoints
# (SmolLM2-135M-Instruct converted from its GGUF, four variants of it, the GGUF itself and
# all-MiniLM-L6-v2), then report with `vllm-dedup scan` how much memory serving them side by
# side would save.  Extra arguments go to `vllm-dedup scan` (e.g. --json).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure-venv.sh"
export PATH="$root/.venv/bin:$PATH"
mapfile -t models < <(python "$root/examples/prepare_models.py" 2> >(grep -v -i "triton\|it/s\]" >&2))
echo "vllm-dedup scan ${models[*]}" >&2
vllm-dedup scan "$@" "${models[@]}"
