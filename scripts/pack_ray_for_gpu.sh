#!/usr/bin/env bash
# Ray 2.60.0 for the lent GPU machine, whose image has none (the Ray fleet: megatron.rollout_placement: ray), in two
# ~41 MiB parts: .rchunk0/part00 + .rchunk0/SHA256, .rchunk1/part01, unpacked there by scripts/gpu_vllm_install.sh.
# The image already has Ray's other dependencies (click, filelock, msgpack, protobuf, pyyaml, requests, ...) but
# jsonschema's four wheels, carried too. Versions are the lock's. A TEST VEHICLE for that machine only.
#
#   bash scripts/pack_ray_for_gpu.sh [WORK_DIR]     # default /tmp/oumi_ray_gpu; needs the package index (pip download)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-/tmp/oumi_ray_gpu}
SET=$WORK/ray_gpu_min
TAR=$WORK/ray_gpu_min.tar
WHEELS=(ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1)
rm -rf "$SET" && mkdir -p "$SET"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$SET" "${WHEELS[@]}" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
[ "$(ls "$SET"/*.whl | wc -l)" -eq ${#WHEELS[@]} ] || { echo "expected ${#WHEELS[@]} wheels in $SET"; exit 1; }
source "$REPO/scripts/pack_parts.sh"
pack_parts "$REPO" "$WORK" ray_gpu_min r
echo "sha256 $SHA; carry each .rchunkN in its own device call (scripts/gpu_vllm_install.sh installs Ray once all arrived)"
