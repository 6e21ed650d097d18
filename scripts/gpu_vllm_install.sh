#!/usr/bin/env bash
# vLLM (and Ray, where carried) on the lent GPU machine, whose image has neither: each travels as a tar of wheels
# split into parts over several device calls (each call carries one `.vchunkN/` or `.rchunkN/` folder; files left on
# the warm machine stay between calls). vLLM: a trimmed set of 117 MiB in three parts (scripts/pack_vllm_for_gpu.sh,
# docs/benchmarks.md "vLLM on the GPU machine"); Ray: 2.60.0 and jsonschema's wheels in two parts
# (scripts/pack_ray_for_gpu.sh; the Ray fleet, `rollout_placement: ray`); SGLang: 0.5.17 and a trimmed sglang-kernel in
# ~41 MiB parts (scripts/pack_sglang_for_gpu.sh; `inference_backend: sglang`). Each call copies its parts to
# /tmp/{v,r,s}chunks; once the parts add up to the tar whose sha256 came with part 0, the wheels are installed into
# /tmp/site (the same place scripts/gpu_check.sh uses; SGLang: /tmp/site_sglang).
# Prints per package "ready", "N part(s) so far" or "not carried" (Ray: nothing when none of it was ever carried).
# Never fails the caller.
set -u
cd "$(dirname "$0")/.."

install_parts() {  # NAME (the module) LETTER (.LETTERchunkN/ folders, /tmp/LETTERchunks) [TARGET, default /tmp/site];
  # status 0 only when it installed now
  local name=$1 store=/tmp/${2}chunks target=${3:-/tmp/site} d
  mkdir -p "$store"
  for d in ."$2"chunk*/; do
    [ -d "$d" ] && cp "$d"* "$store"/ 2>/dev/null
  done
  if python3 -c "import $name" 2>/dev/null || PYTHONPATH=$target:/tmp/site python3 -c "import $name" 2>/dev/null; then
    echo "$name: ready"; return 1
  fi
  if [ ! -f "$store/SHA256" ]; then
    echo "$name: not carried"; return 1
  fi
  cat "$store"/part* > "/tmp/${name}_whl.tar"
  if ! echo "$(cat "$store/SHA256")  /tmp/${name}_whl.tar" | sha256sum -c --quiet - 2>/dev/null; then
    echo "$name: $(ls "$store"/part* | wc -l) part(s) so far"; return 1
  fi
  rm -rf "/tmp/${name}_whl" && mkdir -p "/tmp/${name}_whl" && tar -xf "/tmp/${name}_whl.tar" -C "/tmp/${name}_whl"
  # typing_extensions only where the image's is older than pydantic needs (below)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
    $(ls "/tmp/${name}_whl"/*/*.whl | grep -v typing_extensions) || { echo "$name: install failed"; return 1; }
  return 0
}

if install_parts vllm v; then
  python3 -c "from importlib.metadata import version as v; from packaging.version import Version as V; import sys; sys.exit(V(v('typing_extensions')) < V('4.16'))" \
    || python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site /tmp/vllm_whl/*/typing_extensions-*.whl
  PYTHONPATH=/tmp/site python3 -c "import vllm; print('vllm: ready', vllm.__version__)"
fi
if compgen -G ".rchunk*/" >/dev/null || [ -f /tmp/rchunks/SHA256 ]; then
  install_parts ray r && PYTHONPATH=/tmp/site python3 -c "import ray; print('ray: ready', ray.__version__)"
fi
if compgen -G ".schunk*/" >/dev/null || [ -f /tmp/schunks/SHA256 ]; then  # scripts/pack_sglang_for_gpu.sh
  # a place of its own: its pins differ from vLLM's set (scripts/gpu_check.sh puts it first for SGLang's processes only)
  install_parts sglang s /tmp/site_sglang \
    && PYTHONPATH=/tmp/site_sglang:/tmp/site python3 -c "import sglang; print('sglang: ready', sglang.__version__)"
fi
exit 0
