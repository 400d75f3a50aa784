#!/usr/bin/env bash
# Run the test suite: sets up .venv/ first if needed (see scripts/ensure-venv.sh), lints every
# Python file with ruff (pyproject.toml: pyflakes rules and syntax errors), then runs pytest.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -k scan -x`.
#
# `bash tests/run.sh --fast`: the fast suite (about 2 minutes on 2 cores): every test that is
# neither `slow` nor `heavy` (pyproject.toml's markers), plus one real engine
# (tests/e2e/test_smoke.py).  CI (.ci/run) runs everything.
#
# Tests run in two pytest-xdist workers (`VLLM_DEDUP_TEST_WORKERS`, 0 for one process): most of
# an engine's start-up is single-threaded Python, so one worker leaves a 2-core machine half idle.
# Three are slower there: the tests took 31:40 against two workers' 29:02, back to back on one
# 2-core VM (engines' OpenMP threads and imports contend), and two workers' shares of the work
# came out even (1729 and 1720 s of tests each), so the order of the tests is not the cost.
# Each worker is a test session of its own (tests/conftest.py): its own Ray cluster, registry
# daemons and leak checks; a test that reads machine-wide state (the page cache) uses files of
# its own.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
select=(-n "${VLLM_DEDUP_TEST_WORKERS:-2}" --dist worksteal)
if [[ "${1:-}" == "--fast" ]]; then
  shift
  select+=(-m "(not slow and not heavy) or smoke")
fi
bash "$root/scripts/ensure-venv.sh"
cd "$root"
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
"$root/.venv/bin/ruff" check "$root"
exec "$root/.venv/bin/python" -m pytest -ra --durations=25 ${select[@]+"${select[@]}"} "$@"
