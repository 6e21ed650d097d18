#!/usr/bin/env bash
# vLLM on the lent GPU machine, whose image has none: a trimmed wheel set (117 MiB, see
# docs/benchmarks.md "vLLM on the GPU machine") travels as a tar split into parts over several device
# calls (each carries one `.vchunkN/` folder; files left on the warm machine stay between calls).
# Each call copies its part to /tmp/vchunks; once the parts add up to the tar whose sha256 came with
# part 0, the wheels are installed into /tmp/site (the same place scripts/gpu_check.sh uses).
# Prints "vllm: ready", "vllm: N part(s) so far" or "vllm: not carried". Never fails the caller.
set -u
cd "$(dirname "$0")/.."
mkdir -p /tmp/vchunks
for d in .vchunk*/; do
  [ -d "$d" ] && cp "$d"* /tmp/vchunks/ 2>/dev/null
done
if python3 -c "import vllm" 2>/dev/null || PYTHONPATH=/tmp/site python3 -c "import vllm" 2>/dev/null; then
  echo "vllm: ready"; exit 0
fi
if [ ! -f /tmp/vchunks/SHA256 ]; then
  echo "vllm: not carried"; exit 0
fi
cat /tmp/vchunks/part* > /tmp/vllm_whl.tar
if ! echo "$(cat /tmp/vchunks/SHA256)  /tmp/vllm_whl.tar" | sha256sum -c --quiet - 2>/dev/null; then
  echo "vllm: $(ls /tmp/vchunks/part* | wc -l) part(s) so far"; exit 0
fi
rm -rf /tmp/vwhl && mkdir -p /tmp/vwhl && tar -xf /tmp/vllm_whl.tar -C /tmp/vwhl
# typing_extensions only where the image's is older than pydantic needs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls /tmp/vwhl/*/*.whl | grep -v typing_extensions) || { echo "vllm: install failed"; exit 0; }
python3 -c "from importlib.metadata import version as v; from packaging.version import Version as V; import sys; sys.exit(V(v('typing_extensions')) < V('4.16'))" \
  || python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site /tmp/vwhl/*/typing_extensions-*.whl
PYTHONPATH=/tmp/site python3 -c "import vllm; print('vllm: ready', vllm.__version__)"
