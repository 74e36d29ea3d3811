#!/usr/bin/env bash
# Compile the CUDA kernels (engine/src/tensor/device/cuda/matmul.cu) to the committed PTX
# (engine/src/tensor/device/cuda/matmul.ptx), which engine/build.rs uses where it finds no nvcc.
# Its first line records the sha256 of the source it was made from; build.rs refuses to build
# when that is not the sha256 of matmul.cu, so run this script after every change to the .cu.
#
# The compiler is NVRTC 12.1 from PyPI (nvidia-cuda-nvrtc-cu12, installed into target/ptx-venv),
# pinned so the committed file is reproducible: PTX ISA 8.1, which drivers from R530 on load,
# for compute_70 (Volta and every later GPU), with the options engine/build.rs gives nvcc:
# no fused multiply-add contraction, denormals kept, IEEE division and square roots.
# Usage: scripts/build-ptx.sh [OUT.ptx]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
src="$root/engine/src/tensor/device/cuda/matmul.cu"
out="${1:-$root/engine/src/tensor/device/cuda/matmul.ptx}"
venv="$root/target/ptx-venv"
nvrtc_version=12.1.105
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import nvidia.cuda_nvrtc" 2>/dev/null; then
  "$venv/bin/pip" install -q "nvidia-cuda-nvrtc-cu12==$nvrtc_version"
fi
"$venv/bin/python" - "$src" "$out" "$nvrtc_version" <<'EOF'
import ctypes, glob, hashlib, os, sys

src_path, out_path, version = sys.argv[1:4]
import nvidia.cuda_nvrtc as pkg
lib_dir = os.path.join(list(pkg.__path__)[0], "lib")
nvrtc = ctypes.CDLL(glob.glob(os.path.join(lib_dir, "libnvrtc.so*"))[0])
source = open(src_path, "rb").read()
options = [b"--gpu-architecture=compute_70", b"--fmad=false", b"--ftz=false",
           b"--prec-div=true", b"--prec-sqrt=true"]

def check(code, what):
    if code != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"nvrtc: {what}: {nvrtc.nvrtcGetErrorString(code).decode()}")

prog = ctypes.c_void_p()
check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source, b"matmul.cu", 0, None, None),
      "create program")
opts = (ctypes.c_char_p * len(options))(*options)
code = nvrtc.nvrtcCompileProgram(prog, len(options), opts)
size = ctypes.c_size_t()
nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
log = ctypes.create_string_buffer(size.value)
nvrtc.nvrtcGetProgramLog(prog, log)
if log.value.strip():
    sys.stderr.write(log.value.decode())
check(code, "compile")
check(nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
ptx = ctypes.create_string_buffer(size.value)
check(nvrtc.nvrtcGetPTX(prog, ptx), "PTX")
digest = hashlib.sha256(source).hexdigest()
header = (f"// source-sha256: {digest}\n"
          f"// From matmul.cu by scripts/build-ptx.sh: NVRTC {version}, "
          + " ".join(o.decode() for o in options) + "\n")
with open(out_path, "w") as f:
    f.write(header + ptx.value.decode())
print(f"wrote {out_path} (source sha256 {digest})")
EOF
