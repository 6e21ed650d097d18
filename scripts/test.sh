#!/usr/bin/env bash
# Set up .venv (idempotent) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
export DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
set +e
# Lint and types first (seconds; mypy ~2 min the first time, cached in .mypy_cache after): ruff over src/, scripts/
# and tests/, mypy over the package (pyproject.toml holds both configurations). A failure fails the run, after the tests.
.venv/bin/ruff check src scripts tests
lint_rc=$?
.venv/bin/mypy
types_rc=$?
# Two pytest workers (pytest-xdist, work stealing): most tests wait on subprocess start-up and
# single-threaded imports, so two at a time use 2 cores better (CI, 2 cores: ~32 instead of ~43 min).
# PYTEST_WORKERS=0 runs them in one process. The slowest tests are listed at the end.
.venv/bin/python -m pytest -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" --dist worksteal --durations=15 "$@"
rc=$?
set -e
echo "scripts/test.sh: setup + lint + tests took $(( $(date +%s) - start )) s (ruff rc $lint_rc, mypy rc $types_rc, pytest rc $rc)"
if [ "$rc" -eq 0 ] && { [ "$lint_rc" -ne 0 ] || [ "$types_rc" -ne 0 ]; }; then
  rc=1
fi
# pytest exits 5 when nothing was collected: that is a failure here, not a pass.
exit $rc
