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
chmod 644 "$SET"/*.whl
tar -C "$WORK" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --mode='u=rwX,go=rX' -cf "$TAR" ray_gpu_min
SHA=$(sha256sum "$TAR" | cut -d' ' -f1)
rm -rf "$WORK/parts" && mkdir -p "$WORK/parts"
split -b 41M -d -a 2 "$TAR" "$WORK/parts/part"
EXCLUDE=$(git -C "$REPO" rev-parse --git-path info/exclude)
case $EXCLUDE in /*) ;; *) EXCLUDE=$REPO/$EXCLUDE ;; esac
mkdir -p "$(dirname "$EXCLUDE")" && touch "$EXCLUDE"
rm -f "$REPO"/.rchunk[0-9]*/part[0-9]* "$REPO"/.rchunk[0-9]*/SHA256
i=0
for part in "$WORK"/parts/part*; do
  mkdir -p "$REPO/.rchunk$i" && cp "$part" "$REPO/.rchunk$i/"
  grep -qxF "/.rchunk$i/" "$EXCLUDE" || echo "/.rchunk$i/" >> "$EXCLUDE"
  echo "  .rchunk$i/$(basename "$part")  $(stat -c %s "$part") bytes"
  i=$((i + 1))
done
echo "$SHA" > "$REPO/.rchunk0/SHA256"
echo "sha256 $SHA; carry each .rchunkN in its own device call (scripts/gpu_vllm_install.sh installs Ray once all arrived)"
