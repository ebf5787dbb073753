#!/usr/bin/env bash
# TransformerEngine 2.20.2 for the device (no network there, 64 MiB per carry): fills .wte1-.wte5
# (git-ignored) for `gpu_run.sh te1` .. `te5`, after setup1-3.
#
# - transformer_engine_cu13 (TE's common library + Python package, a 276 MB wheel) is split into
#   60 MiB parts, one per carry; te5 joins them.
# - transformer_engine_torch (TE's PyTorch extension) ships as an sdist of 33 C++ files (no CUDA
#   kernels: a torch CppExtension that needs CUDA headers only). It is compiled HERE against the
#   venv's torch, the same 2.11.0+cu130 build as the device's, with the CUDA 13 headers of the
#   nvidia-* wheels (nvidia-cuda-crt and -cccl add the two the torch wheel leaves out): ~11 min on
#   2 idle cores here instead of device minutes. The device then only installs wheels.
# - transformer_engine (the meta package: TE's import checks that its metadata is installed) and
#   einops (imported by TE's attention package).
#
#   bash scripts/device/packers/prepare_te_parts.sh      # TE_CACHE=/tmp/te keeps downloads and the build
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
CACHE=${TE_CACHE:-/tmp/te}
TE_VERSION=2.20.2
PY=$(PYENV_VERSION=3.12.1 pyenv which python3.12)
VENV_PY="$ROOT/.venv/bin/python"
UV="$ROOT/.tools/bin/uv"
mkdir -p "$CACHE"
"$PY" -m pip download -q --no-deps -d "$CACHE" "transformer_engine==$TE_VERSION" \
  "transformer_engine_cu13==$TE_VERSION" "transformer_engine_torch==$TE_VERSION" einops
torch_wheel=$(ls "$CACHE"/dist/transformer_engine_torch-"$TE_VERSION"-*.whl 2>/dev/null || true)
if [ -z "$torch_wheel" ]; then
  torch_version=$("$VENV_PY" -c "import torch; print(torch.__version__)")
  [ "$torch_version" = "2.11.0+cu130" ] || { echo "venv torch $torch_version: the device runs 2.11.0+cu130" >&2; exit 2; }
  "$UV" pip install -q --python "$VENV_PY" --target "$CACHE/build-site" setuptools wheel packaging
  # not on PYTHONPATH: a second `nvidia` package dir there would hide the venv's CUDA headers
  "$UV" pip install -q --python "$VENV_PY" --target "$CACHE/cuda-headers" \
    "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*"
  rm -rf "$CACHE/src" && mkdir -p "$CACHE/src"
  tar xzf "$CACHE/transformer_engine_torch-$TE_VERSION.tar.gz" -C "$CACHE/src"
  (cd "$CACHE/src/transformer_engine_torch-$TE_VERSION" \
    && CPLUS_INCLUDE_PATH="$CACHE/cuda-headers/nvidia/cu13/include" PYTHONPATH="$CACHE/build-site" \
       NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="$(nproc)" \
       "$VENV_PY" setup.py -q bdist_wheel -d "$CACHE/dist")
  torch_wheel=$(ls "$CACHE"/dist/transformer_engine_torch-"$TE_VERSION"-*.whl)
fi
for i in 1 2 3 4 5; do rm -rf "$ROOT/.wte$i" && mkdir -p "$ROOT/.wte$i"; done
(cd "$CACHE" && rm -f te.part* && split -b 60M -a 2 "transformer_engine_cu13-$TE_VERSION-py3-none-manylinux_2_28_x86_64.whl" te.part)
parts=("$CACHE"/te.part*)
[ "${#parts[@]}" -le 5 ] || { echo "${#parts[@]} parts: more than the five te stages" >&2; exit 2; }
for i in "${!parts[@]}"; do mv "${parts[$i]}" "$ROOT/.wte$((i + 1))/"; done
cp "$torch_wheel" "$CACHE"/einops-*.whl "$CACHE/transformer_engine-$TE_VERSION-py3-none-any.whl" \
  "$ROOT/.wte5/"
sha256sum "$CACHE/transformer_engine_cu13-$TE_VERSION-py3-none-manylinux_2_28_x86_64.whl" \
  | cut -d' ' -f1 > "$ROOT/.wte5/te.sha256"
du -sb "$ROOT"/.wte?
