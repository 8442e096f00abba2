#!/bin/bash
# Builds what a GPU machine without network needs to run tests/perf/gpu/run.sh, into DEST
# (default .gpu/, ignored by git; carry it with the checkout):
#   DEST/bundle_site.tar.xz  vLLM 0.26.0 (CUDA 13 / torch 2.11.0 wheel, kernels trimmed to sm_90)
#                            + the packages the lent H200's image lacks (deps.txt), one site dir
#   DEST/wheels/             the gateway's runtime dependencies for CPython 3.12
# About 3 minutes and 1.5 GB of scratch, on a machine with PyPI. On a CUDA machine with vLLM
# installed (and the gateway's dependencies) none of this is needed.
# usage: bash tests/perf/gpu/build.sh [DEST]
set -euo pipefail
H=$(cd "$(dirname "$0")" && pwd); D=$(mkdir -p "${1:-.gpu}" && realpath "${1:-.gpu}")
T=${TMPDIR:-/tmp}; W=$(mktemp -d "$T/gpu-bundle.XXXX"); trap 'rm -rf "$W"' EXIT
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none"
for n in 17 24 26 27 28 31 34 35; do P="$P --platform manylinux_2_${n}_x86_64"; done
P="$P --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
if [ ! -f "$D/bundle_site.tar.xz" ]; then
  PIP_CONSTRAINT= python3 -m pip download -q $P -d "$W/whl" vllm==0.26.0 -r "$H/recipe/deps.txt"
  PIP_CONSTRAINT= python3 -m pip install -q --target "$W/tools" pyelftools
  mkdir "$W/site" && for w in "$W"/whl/*.whl; do unzip -q -o "$w" -d "$W/site"; done
  cd "$W/site/vllm"
  # FlashAttention, deep_gemm and the sm100 kernels are not used by the tiny model
  # (TRITON_ATTN) and are most of the wheel's size.
  rm -f vllm_flash_attn/_vllm_fa2_C.abi3.so vllm_flash_attn/_vllm_fa3_C.abi3.so vllm-rs \
    third_party/deep_gemm/*.so
  rm -rf third_party/fmha_sm100/cutlass
  for f in _C_stable_libtorch _moe_C_stable_libtorch _flashmla_C _flashmla_extension_C; do
    PYTHONPATH="$W/tools" python3 "$H/recipe/fatbin_strip.py" $f.abi3.so $f.tmp && mv $f.tmp $f.abi3.so
    chmod +x $f.abi3.so
  done
  # Test-only weights (tinyinit.py, inert unless TINY_INIT is set): random but not flat.
  cat >> model_executor/model_loader/dummy_loader.py <<'PY'


# --- test-only hook (inert unless TINY_INIT is set): name-aware random weights ---
import os as _os

if _os.environ.get("TINY_INIT"):
    import tinyinit as _tinyinit

    _orig_dummy_load_weights = DummyModelLoader.load_weights

    def _tiny_load_weights(self, model, model_config):
        _orig_dummy_load_weights(self, model, model_config)
        _tinyinit.init_model(model)

    DummyModelLoader.load_weights = _tiny_load_weights
PY
  cp "$H/recipe/tinyinit.py" "$W/site/"
  cd "$W/site" && tar -cf - . | xz -T0 -9e > "$D/bundle_site.tar.xz"
fi
# The gateway's runtime dependencies that vLLM does not bring (pyproject.toml; vLLM needs
# fastapi, uvicorn, uvloop, aiohttp, httpx, pydantic, pyyaml and prometheus-client too),
# for the GPU image's CPython 3.12.
PIP_CONSTRAINT= python3 -m pip download -q $P -d "$D/wheels" \
  "pydantic-settings>=2.2,<3" python-dotenv "orjson>=3.9,<4" "redis>=5.0.1,<9"
ls -la "$D/bundle_site.tar.xz"; ls "$D/wheels" | wc -l
