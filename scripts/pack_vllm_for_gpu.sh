#!/usr/bin/env bash
# Rebuild, from nothing, the trimmed vLLM 0.26.0 (CUDA) wheel set that travels to the lent GPU machine
# (whose image has no vLLM) in three ~41 MiB parts (PARTS=2: two of ~59 MiB, for calls after the lease's first, which
# carried .whl/): .vchunk0/part00 + .vchunk0/SHA256, .vchunk1/part01, ..., unpacked there by
# scripts/gpu_vllm_install.sh (called by scripts/gpu_check.sh).
# A TEST VEHICLE for that machine only: users install vLLM normally (pip install vllm).
# See docs/benchmarks.md, "vLLM on the GPU machine".
#
#   bash scripts/pack_vllm_for_gpu.sh [WORK_DIR]     # default $OUMI_VLLM_GPU_WORK or /tmp/oumi_vllm_gpu
#
# Needs internet (pip download), python3, pip, tar, split, sha256sum. Idempotent: wheels already in
# WORK_DIR/dl and an already repacked vllm wheel are reused.
set -euo pipefail
START=$SECONDS
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-${OUMI_VLLM_GPU_WORK:-/tmp/oumi_vllm_gpu}}
DL=$WORK/dl                # pip downloads, untouched
SET=$WORK/vllm_gpu_min     # the folder that is tarred (its name is the tar's top folder)
TAR=$WORK/vllm_gpu_min.tar
mkdir -p "$DL" "$WORK/repack"

# Why these 27: what an offline LLM(...), generate and the NCCL weight-transfer API import on top of the
# image (torch 2.11.0+cu130, transformers, triton, numpy), found by removing each wheel and re-importing;
# plus a few declared deps carried for safety. Exact pins: the set was tested as is on the GPU machine.
WHEELS=(
  annotated-types==0.8.0 apache-tvm-ffi==0.1.10 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0
  fastapi==0.136.3 httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 llguidance==1.7.6 msgspec==0.22.0
  openai==3.57.0 openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1
  pydantic==2.14.4 pydantic-core==2.50.5 python-json-logger==4.2.0 pyzmq==27.3.0 setproctitle==1.3.8
  sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5 typing-extensions==4.16.0
  typing-inspection==0.4.5 vllm==0.26.0 xgrammar==0.2.7
)

# 1. Download (no deps: the image already has the rest). Platforms as in the device README's note on
# carrying wheels (Python 3.12, x86-64 manylinux), plus 2_31 which llguidance needs. The order is pip's
# preference where a release has several: 2_17/2014 first picks the same files as the tested set
# (apache-tvm-ffi has both). The local extra indexes' "is ignored" warnings are noise: filtered.
wheel_of() {  # spec -> the downloaded wheel for it, if any (wheel names use normalized names)
  local name=${1%%==*} ver=${1##*==}
  name=$(echo "$name" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g')
  ls "$DL/$name-$ver-"*.whl 2>/dev/null | head -1
}
MISSING=()
for spec in "${WHEELS[@]}"; do [ -n "$(wheel_of "$spec")" ] || MISSING+=("$spec"); done
if [ ${#MISSING[@]} -gt 0 ]; then
  echo "downloading ${#MISSING[@]} wheel(s) into $DL"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 \
    -d "$DL" "${MISSING[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi
for spec in "${WHEELS[@]}"; do [ -n "$(wheel_of "$spec")" ] || { echo "missing after download: $spec"; exit 1; }; done

# 2. Trim the vllm wheel (290 -> 100 MiB) so the set fits three device calls. Removed, and why:
#  - vllm_flash_attn/_vllm_fa2_C: FlashAttention-2, the pre-Hopper fallback (H100/H200 run FA3, kept)
#  - _moe_C_stable_libtorch: MoE kernels (imported under contextlib.suppress; the test models are dense)
#  - vllm-rs: the Rust API-server frontend (offline LLM(...) only)
#  - third_party/fmha_sm100/: Blackwell-only; third_party/deep_gemm/include/ (fp8 JIT headers) and
#    deep_gemm's _C for the other Pythons (cp310/311/313/314; the image runs 3.12)
#  - _flashmla_C, _flashmla_extension_C (MLA), _qutlass_C: optional imports
# The RECORD drops the removed entries so pip installs the wheel; everything else is copied unchanged.
VLLM_SRC=$(wheel_of vllm==0.26.0)
VLLM_OUT=$WORK/repack/$(basename "$VLLM_SRC")
if [ ! -f "$VLLM_OUT" ]; then
  echo "repacking $(basename "$VLLM_SRC") (a minute or two)"
  python3 - "$VLLM_SRC" "$VLLM_OUT.tmp" <<'EOF'
import sys, zipfile
src, dst = sys.argv[1:3]
zi = zipfile.ZipFile(src)
names = zi.namelist()
drop = {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so", "vllm/vllm-rs",
        "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so", "vllm/_qutlass_C.abi3.so"}
drop |= {f"vllm/third_party/deep_gemm/_C.cpython-3{v}-x86_64-linux-gnu.so" for v in (10, 11, 13, 14)}
drop |= {n for n in names if n.startswith(("vllm/third_party/fmha_sm100/", "vllm/third_party/deep_gemm/include/"))}
assert drop <= set(names), f"not in the wheel (another vllm build?): {sorted(drop - set(names))}"
record = next(n for n in names if n.endswith(".dist-info/RECORD"))
with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
    for info in zi.infolist():  # same order, dates and modes as the original: a reproducible zip
        if info.filename in drop:
            continue
        data = zi.read(info.filename)
        if info.filename == record:
            data = "".join(l for l in data.decode().splitlines(True) if l.split(",")[0] not in drop).encode()
        out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
        out.external_attr = info.external_attr
        zo.writestr(out, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
print(f"dropped {len(drop)} files")
EOF
  mv "$VLLM_OUT.tmp" "$VLLM_OUT"
fi

# 3. One reproducible tar of the folder (fixed order, times, owners, modes), split into 41 MiB parts:
# each part plus the ~5 MB tree and .whl/ (~11 MiB) stays under the 64 MiB a device call carries.
rm -rf "$SET" && mkdir -p "$SET"
for spec in "${WHEELS[@]}"; do [ "${spec%%==*}" = vllm ] || cp "$(wheel_of "$spec")" "$SET/"; done
cp "$VLLM_OUT" "$SET/"
# Each part in .vchunkN/ (one folder per device call; git-ignored via .git/info/exclude).
source "$REPO/scripts/pack_parts.sh"
pack_parts "$REPO" "$WORK" vllm_gpu_min v
PART_FILES=("$WORK"/parts/part*)
echo
echo "$(ls "$SET"/*.whl | wc -l) wheels, $(du -b "$TAR" | cut -f1) bytes in $TAR"
echo "sha256 $SHA (in .vchunk0/SHA256)"
echo
# gpu_check.sh puts /tmp/site on PYTHONPATH when .whl/ is there: carried once, it stays on the warm machine.
echo "Device calls, issued back to back (the machine is given back after ~30 s idle; .whl only where not carried yet):"
for i in "${!PART_FILES[@]}"; do
  echo "  run carry=[\".vchunk$i\", \".whl\"]  command: bash scripts/gpu_vllm_install.sh"
done
echo "(the last one installs vLLM into /tmp/site; bash scripts/gpu_check.sh then runs with it; done in $((SECONDS - START)) s)"
