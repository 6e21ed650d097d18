#!/usr/bin/env bash
# GPU tests and benchmarks in one call, on the lent GPU machine (torch 2.11 preinstalled there).
#   bash scripts/gpu_check.sh                        # from the repo root; wheels carried in .whl/ (docs/benchmarks.md)
#   GPU_CHECK_BENCH=laws bash scripts/gpu_check.sh   # benchmark modes by name; arguments go to scripts/gpu_check.py
# This file only prepares the machine: it installs what the image lacks (megatron-core, megatron-bridge, omegaconf, ...)
# from .whl/ and vLLM from its carried parts (scripts/gpu_vllm_install.sh), then hands over to scripts/gpu_check.py,
# which runs the GPU tests (GPU_CHECK_TESTS), the real-model run (GPU_CHECK_REAL_MODEL), the benchmark modes
# (GPU_CHECK_BENCH; `python3 scripts/gpu_check.py --list` names them), the jobs (GPU_CHECK_JOBS) and prints the
# tables last; results land in $OUT (default ./gpu_results) for docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.oumi_megatron_whl ]; then
  # once per machine: a later vLLM install may upgrade pydantic
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  touch /tmp/site/.oumi_megatron_whl
fi
if [ -f /tmp/site/.oumi_megatron_whl ]; then  # installed by this call or an earlier one of the same lease
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
else
  export PYTHONPATH=$PWD/src:$PWD/tests
fi
# vLLM, when its parts were carried (scripts/gpu_vllm_install.sh); its tests skip, visibly, otherwise.
# The trimmed wheel set has no flashinfer: vLLM's sampler must not ask for it.
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1
bash scripts/gpu_vllm_install.sh
# SGLang's set has a place of its own (its pins differ from vLLM's): SGLang's processes put it first on their path
[ -d /tmp/site_sglang/sglang ] && export OUMI_SGLANG_SITE=/tmp/site_sglang
# The image's python has no venv: make `python`, `torchrun` and the CLIs resolve for the tests.
mkdir -p /tmp/bin && ln -sf "$(command -v python3)" /tmp/bin/python
printf '#!/usr/bin/env bash\nexec python3 -m oumi_megatron "$@"\n' > /tmp/bin/oumi-megatron && chmod +x /tmp/bin/oumi-megatron
export PATH=/tmp/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
exec python3 scripts/gpu_check.py "$@"
