#!/usr/bin/env bash
# Run the test suite: sets up .venv/ first if needed (see scripts/ensure-venv.sh), lints every
# Python file with ruff (pyproject.toml: pyflakes rules and syntax errors), then runs pytest.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -k scan -x`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/ensure-venv.sh"
cd "$root"
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
"$root/.venv/bin/ruff" check "$root"
exec "$root/.venv/bin/python" -m pytest -ra --durations=25 "$@"
