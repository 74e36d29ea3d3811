#!/bin/sh
# Entrypoint of the Vulkan and CUDA images: says on stderr which accelerators the container sees,
# gives `coli serve` the image's default device, then becomes `coli` (exec: coli is PID 1 and gets
# docker stop's SIGTERM itself). Set by the Dockerfile:
#   COLIBRI_IMAGE_VARIANT   vulkan | cuda: which devices to list
#   COLIBRI_DEFAULT_DEVICE  the image's default for coli's `device` key (vulkan: `vulkan`; cuda:
#                           `auto`, i.e. CUDA when a GPU is visible, else the CPU)
#
# The default is exported as COLI_DEVICE only when nothing else chooses the device: not the
# environment (`-e COLI_DEVICE=cpu`), not a profile file (`device = "cpu"` in
# /etc/colibri/colibri.toml or a `--config` file, `[profiles.NAME]` included), not a flag
# (`--device cpu`). An ENV COLI_DEVICE in the image would instead override the profile file's
# `device`, since the environment ranks above the file. coli logs the device it computes on
# (`device: vulkan`, `device: cuda` or `device: cpu`) when it loads the model.
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
    ;;
  cuda)
    # The NVIDIA container runtime mounts nvidia-smi with NVIDIA_DRIVER_CAPABILITIES=utility.
    if command -v nvidia-smi >/dev/null 2>&1 && gpus=$(nvidia-smi -L 2>/dev/null) && [ -n "$gpus" ]; then
      printf '%s\n' "$gpus" | sed 's/^/colibri: nvidia-smi sees: /' >&2
    else
      echo "colibri: no NVIDIA GPU visible (run with --gpus all and the NVIDIA container toolkit); device auto computes on the CPU" >&2
    fi
    ;;
esac

# The image's default device, for `coli serve` and `coli config` (so that `docker run --rm IMAGE
# config --show` shows what `serve` would use), when the configuration leaves `device` at coli's
# built-in default: `coli config --show` with the same flags reads the same files, profile and
# environment as `coli serve` and then prints `device = "auto"  # default`. A binary without the
# `device` key prints no such line and gets no COLI_DEVICE (it would refuse an unknown key); a
# configuration that does not load is left to coli itself to report.
case "${1:-}" in serve | config) sub=$1 ;; *) sub= ;; esac
if [ -n "${COLIBRI_DEFAULT_DEVICE:-}" ] && [ -n "$sub" ]; then
  if [ -n "${COLI_DEVICE+set}" ]; then
    echo "colibri: device $COLI_DEVICE (from COLI_DEVICE; the image's default is $COLIBRI_DEFAULT_DEVICE)" >&2
  else
    # The flags after the command, less a `--show` of `config` (given once below).
    shown=$(
      shift
      for a do
        shift
        [ "$a" = --show ] || set -- "$@" "$a"
      done
      coli config --show "$@" 2>/dev/null
    ) || shown=
    if printf '%s\n' "$shown" | grep -Eq '^(# )?device = .*  # default$'; then
      export COLI_DEVICE="$COLIBRI_DEFAULT_DEVICE"
      echo "colibri: device $COLI_DEVICE (the image's default; -e COLI_DEVICE=..., --device or \`device\` in colibri.toml overrides it)" >&2
    else
      chosen=$(printf '%s\n' "$shown" | sed -n 's/^device = \(.*\)  # \(.*\)$/\1 (from \2)/p')
      [ -z "$chosen" ] || echo "colibri: device $chosen; the image's default is $COLIBRI_DEFAULT_DEVICE" >&2
    fi
  fi
fi

exec coli "$@"
