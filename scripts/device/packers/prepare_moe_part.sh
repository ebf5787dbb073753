#!/usr/bin/env bash
# The MoE kernels vLLM needs for Qwen3-MoE (`_moe_C_stable_libtorch.abi3.so`, ~45 MB), left out of the
# repacked wheel by ../shared/device/prepare_parts.sh: extract it into .w5 (git-ignored) to carry with
# `gpu_run.sh setup_moe` after setup2. Needs the original wheel in $WORK/orig (prepare_parts.sh).
set -euo pipefail
WORK=${WORK:-/tmp/devpack}
ROOT=$(git rev-parse --show-toplevel)
WHEEL=$(ls "$WORK"/orig/vllm-0.26.0-*.whl)
rm -rf "$ROOT/.w5" && mkdir -p "$ROOT/.w5"
unzip -q -j "$WHEEL" 'vllm/_moe_C_stable_libtorch.abi3.so' -d "$ROOT/.w5"
xz -T0 -6 "$ROOT/.w5/_moe_C_stable_libtorch.abi3.so"
du -sb "$ROOT/.w5"
