#!/usr/bin/env bash
# Compile the Vulkan kernels (engine/src/tensor/device/shaders/matmul.comp) to the committed
# SPIR-V, one module per weight format, and for the float formats a second one that computes
# fused multiply-adds exactly in f64 (`*_fma64.spv`, for drivers whose fma is not fused).
# Needs glslangValidator (Debian: glslang-tools). engine/tests/device.rs checks that the
# committed files are what this script produces.
set -euo pipefail
dir="$(cd "$(dirname "$0")/.." && pwd)/engine/src/tensor/device/shaders"
out="${1:-$dir}"
names=(f32 bf16 f16 mxfp4 q8_0 q4_0 q4_1 q4_k q6_k)
for i in "${!names[@]}"; do
  glslangValidator -V --quiet --target-env vulkan1.0 -DFORMAT="$i" \
    "$dir/matmul.comp" -o "$out/matmul_${names[$i]}.spv" >/dev/null
  if [ "$i" -le 3 ]; then
    glslangValidator -V --quiet --target-env vulkan1.0 -DFORMAT="$i" -DFMA_EMULATED \
      "$dir/matmul.comp" -o "$out/matmul_${names[$i]}_fma64.spv" >/dev/null
  fi
done
