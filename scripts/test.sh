#!/usr/bin/env bash
# Set up .venv (idempotent) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
export DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
set +e
.venv/bin/python -m pytest -p no:cacheprovider "$@"
rc=$?
set -e
echo "scripts/test.sh: setup + tests took $(( $(date +%s) - start )) s"
# pytest exits 5 when nothing was collected: that is a failure here, not a pass.
exit $rc
