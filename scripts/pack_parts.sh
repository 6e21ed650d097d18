# Sourced by scripts/pack_{vllm,ray,sglang}_for_gpu.sh: one reproducible tar of a wheel folder, split into parts that
# each fit one device call (64 MiB carried: a 41 MiB part beside the ~5 MiB tree and .whl/), placed in .<L>chunkN/
# folders that git ignores (.git/info/exclude), with the tar's sha256 in .<L>chunk0/SHA256. scripts/gpu_vllm_install.sh
# joins and checks them on the GPU machine. PARTS=N splits the tar into N equal parts instead: fewer, larger ones for
# calls that carry no .whl/ (files carried earlier stay on a warm machine, so .whl/ need travel in a lease's first
# call only; 2026-12-06: GGUF, vLLM and SGLang staged in 6 calls instead of 8). A part must fit 64 MiB with the tree.
#
#   pack_parts REPO WORK NAME LETTER    # tars WORK/NAME into WORK/NAME.tar; prints each part; sets SHA

pack_parts() {
  local repo=$1 work=$2 name=$3 letter=$4 exclude part i=0
  chmod 644 "$work/$name"/*.whl
  tar -C "$work" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --mode='u=rwX,go=rX' \
    -cf "$work/$name.tar" "$name"
  SHA=$(sha256sum "$work/$name.tar" | cut -d' ' -f1)
  rm -rf "$work/parts" && mkdir -p "$work/parts"
  if [ -n "${PARTS:-}" ]; then
    split -n "$PARTS" -d -a 2 "$work/$name.tar" "$work/parts/part"
  else
    split -b 41M -d -a 2 "$work/$name.tar" "$work/parts/part"
  fi
  exclude=$(git -C "$repo" rev-parse --git-path info/exclude)
  case $exclude in /*) ;; *) exclude=$repo/$exclude ;; esac
  mkdir -p "$(dirname "$exclude")" && touch "$exclude"
  rm -f "$repo"/."$letter"chunk[0-9]*/part[0-9]* "$repo"/."$letter"chunk[0-9]*/SHA256  # no stale parts of an older tar
  for part in "$work"/parts/part*; do
    mkdir -p "$repo/.${letter}chunk$i" && cp "$part" "$repo/.${letter}chunk$i/"
    grep -qxF "/.${letter}chunk$i/" "$exclude" || echo "/.${letter}chunk$i/" >> "$exclude"
    echo "  .${letter}chunk$i/$(basename "$part")  $(stat -c %s "$part") bytes"
    i=$((i + 1))
  done
  echo "$SHA" > "$repo/.${letter}chunk0/SHA256"
  [ "$(cat "$repo"/."$letter"chunk[0-9]*/part[0-9]* | sha256sum | cut -d' ' -f1)" = "$SHA" ] \
    || { echo "pack_parts: the parts do not add up to the tar" >&2; return 1; }
}
