#!/usr/bin/env bash
# SGLang 0.5.17 for the lent GPU machine, whose image has none (megatron.inference_backend: sglang), as a tar of wheels
# split into ~41 MiB parts (PARTS=N: N equal ones): .schunk0/part00 + .schunk0/SHA256, .schunk1/part01, ... unpacked there by
# scripts/gpu_vllm_install.sh (it installs the set once every part arrived) into /tmp/site_sglang, a place of its own:
# its pins (pydantic, xgrammar, transformers) differ from vLLM's carried set, so only SGLang's processes put it first on
# their path (OUMI_SGLANG_SITE, set by scripts/gpu_check.sh). A TEST VEHICLE for that machine only: users install SGLang
# as docs/rollouts.md says.
#
#   bash scripts/pack_sglang_for_gpu.sh [WORK_DIR]   # default /tmp/oumi_sglang_gpu; needs the package index
#
# sglang-kernel 0.4.5 (CUDA 13, the image's) is a 365 MiB wheel; trimmed here to ~14 MiB by dropping what an H100/H200
# run with the triton / flashinfer attention does not load: flash_ops (FlashAttention 3 builds, 326 MiB of the wheel, 1.1
# GB unpacked, imported inside a try: too large for the device calls' 64 MiB), sm100/ (Blackwell), infllm_ops and
# flashmla_ops (MLA). Without flash_ops SGLang's Hopper default (fa3) cannot load, so the backend resolves
# `megatron.sglang_attention_backend: null` to triton there (rollout/sglang_backend.py, said in the log). The other wheels are what importing
# sglang's engine and weight-sync modules loads beyond the image's packages (read off the CPU venv's sys.modules),
# at the lock's versions where the lock has them (openai's too: the first cut's older openai, installed into the same
# /tmp/site, broke vLLM's and TRL's imports on the GPU, 2026-12-06). That run also found IPython missing and the image's
# newer transformers refusing SGLang's config registration: both added below.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/oumi_sglang_gpu}
DL=$WORK/dl
SET=$WORK/sglang_gpu_min
TAR=$WORK/sglang_gpu_min.tar
WHEELS=(
  sglang==0.5.17 sglang-kernel==0.4.5 flashinfer_python==0.6.15.post1 torch_memory_saver==0.0.10
  annotated-types==0.8.0 apache-tvm-ffi==0.1.11 blobfile==3.0.0 compressed-tensors==0.17.0 easydict==1.14
  fastapi==0.136.3 gguf==0.19.0 interegular==0.3.3 llguidance==1.7.6 loguru==0.7.3 msgspec==0.22.0 orjson==3.13.0
  openai==3.57.0 openai-harmony==0.0.8 distro==1.9.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.13.5
  pydantic_core==2.46.5 python-multipart==0.0.22 pyzmq==27.3.0 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0
  typing-inspection==0.4.5 uvicorn==0.35.0 watchfiles==1.1.0 zstandard==0.25.0
  # the GPU lock's xgrammar (SGLang pins 0.2.1, a 45 MB wheel; 0.2.7 is 1.3 MB and what the lock pairs with SGLang)
  xgrammar==0.2.7
  # the lock's transformers: the image's 5.17 already registers the `qwen3_asr` config SGLang 0.5.17 registers on import;
  # and the lock's tokenizers: transformers 5.12.1 refuses the image's 0.23.2 (it needs <= 0.23.0)
  transformers==5.12.1 tokenizers==0.22.2
  # openai 3.57 imports httpx2 (which needs truststore) and jiter: the image has none of them
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
  # sglang/utils.py imports IPython at the top (the engine's import chain reaches it)
  ipython==9.18.1 ipython-pygments-lexers==1.1.1 traitlets==5.16.1 jedi==0.20.1 parso==0.8.7 pexpect==4.9.0
  ptyprocess==0.7.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2
  pure_eval==0.2.4 matplotlib-inline==0.2.2 decorator==5.3.2
)
mkdir -p "$DL"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 -d "$DL" "${WHEELS[@]}" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
rm -rf "$SET" && mkdir -p "$SET"
for whl in "$DL"/*.whl; do
  case $(basename "$whl") in
    sglang_kernel-*) python3 - "$whl" "$SET/$(basename "$whl")" <<'PY'
import sys, zipfile
src, dst = sys.argv[1:3]
drop = {"sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so",
        "sgl_kernel/infllm_ops.cpython-310-x86_64-linux-gnu.so"}
zi = zipfile.ZipFile(src)
assert drop <= set(zi.namelist()), f"not in the wheel (another build?): {sorted(drop - set(zi.namelist()))}"
record = next(n for n in zi.namelist() if n.endswith(".dist-info/RECORD"))
with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
    for info in zi.infolist():  # same order, dates and modes: a reproducible zip; RECORD without the dropped files
        if info.filename in drop:
            continue
        data = zi.read(info.filename)
        if info.filename == record:
            data = "".join(l for l in data.decode().splitlines(True) if l.split(",")[0] not in drop).encode()
        zo.writestr(info, data)
PY
    ;;
    *) cp "$whl" "$SET/" ;;
  esac
done
[ "$(ls "$SET"/*.whl | wc -l)" -eq ${#WHEELS[@]} ] || { echo "expected ${#WHEELS[@]} wheels in $SET"; exit 1; }
source "$REPO/scripts/pack_parts.sh"
pack_parts "$REPO" "$WORK" sglang_gpu_min s
echo "$(ls "$SET"/*.whl | wc -l) wheels, $(du -b "$TAR" | cut -f1) bytes; sha256 $SHA"
echo "carry each .schunkN in its own device call, with .whl where the lease has not carried it yet (scripts/gpu_vllm_install.sh installs SGLang once all arrived)"
