#!/bin/sh
# Entrypoint of the Vulkan and CUDA images: says on stderr which accelerator the container sees and
# that this build of coli computes on the CPU, then becomes `coli` (exec: coli is PID 1 and gets
# docker stop's SIGTERM itself). COLIBRI_IMAGE_VARIANT (vulkan|cuda) is set by the Dockerfile.
set -eu

case "${COLIBRI_IMAGE_VARIANT:-}" in
  vulkan)
    if command -v vulkaninfo >/dev/null 2>&1; then
      # One line per device of `vulkaninfo --summary` (lavapipe, "llvmpipe", is Mesa's CPU device).
      devices=$(vulkaninfo --summary 2>/dev/null | awk '
        /^GPU[0-9]+:/ { gpu = $1 }
        $1 == "deviceType" { type = $3 }
        $1 == "deviceName" { sub(/^[^=]*= /, ""); name = $0 }
        $1 == "driverInfo" { sub(/^[^=]*= /, ""); printf "%s %s (%s, %s)\n", gpu, name, type, $0 }
      ') || devices=
      if [ -n "$devices" ]; then
        printf '%s\n' "$devices" | sed 's/^/colibri: vulkaninfo --summary sees: /' >&2
      else
        echo "colibri: vulkaninfo --summary sees no Vulkan device" >&2
      fi
    else
      echo "colibri: vulkaninfo is not installed; cannot list Vulkan devices" >&2
    fi
    echo "colibri: Vulkan backend not built; running on CPU" >&2
    ;;
  cuda)
    # The NVIDIA container runtime mounts nvidia-smi with NVIDIA_DRIVER_CAPABILITIES=utility.
    if command -v nvidia-smi >/dev/null 2>&1 && gpus=$(nvidia-smi -L 2>/dev/null) && [ -n "$gpus" ]; then
      printf '%s\n' "$gpus" | sed 's/^/colibri: nvidia-smi sees: /' >&2
    else
      echo "colibri: no NVIDIA GPU visible (run with --gpus all and the NVIDIA container toolkit)" >&2
    fi
    echo "colibri: CUDA backend not built; running on CPU" >&2
    ;;
esac

exec coli "$@"
