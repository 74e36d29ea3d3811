#!/usr/bin/env python3
"""Regenerate the quantization test vectors checked by `engine/src/tensor/quant.rs`.

Not run by CI (CI has no Python). Run by hand when the vectors need to change:

    pip install gguf==0.19.0 numpy
    python engine/tests/quant_vectors/generate.py

It uses gguf-py's numpy reference implementations (`gguf.quants.quantize` /
`gguf.quants.dequantize`), which are written to match ggml bit for bit. Output, all
little-endian, in this directory:

* `input.f32`          1024 f32: the fixed pseudo-random input row (4 super-blocks).
* `<type>.q`           the quantized bytes gguf-py produces from `input.f32`, for the types
                       gguf-py can quantize; for the others (K-quants, IQ4_*), pseudo-random
                       block bytes with sane f16 scale fields.
* `<type>.deq.f32`     gguf-py's dequantization of `<type>.q`.
* `manifest.json`      for each type: ggml name, whether `.q` came from gguf-py's quantizer.

Not produced by this script: `kquant_ref/<type>.q` (Q2_K..Q6_K) are the bytes ggml's K-quant
reference quantizers (`quantize_row_q{2..6}_K_ref`, ggml-quants.c, built with gcc -O2
-ffp-contract=off) produce from `input.f32`; gguf-py has no K-quant quantizer. Regenerate
them with a build of ggml if `input.f32` changes. (A build with FP contraction, e.g.
-march=native with FMA, gives different bytes for Q2_K, Q4_K, Q5_K and Q6_K.)
"""

import json
import os

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf import quants

HERE = os.path.dirname(os.path.abspath(__file__))
N = 1024

rng = np.random.RandomState(20240611)

# Four super-blocks of different character: plain normal data, a wide-range block with an
# outlier, a small-magnitude block, and a block that is mostly positive with a zero
# 32-element sub-block (exercises the d == 0 / min paths).
x = rng.standard_normal(N).astype(np.float32)
x[256:512] *= np.float32(3.0)
x[300] = np.float32(25.0)
x[512:768] *= np.float32(1e-3)
x[768:1024] = np.abs(x[768:1024]) + np.float32(0.5)
x[800:832] = np.float32(0.0)
x = x.astype(np.float32)
x.tofile(os.path.join(HERE, "input.f32"))

# Types gguf-py can quantize (bit-exact with ggml's reference quantizers).
quantizable = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4]
# Types gguf-py can only dequantize: random blocks. Offsets of f16 scale fields to sanitize.
f16_fields = {
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
}

manifest = {}
for t in quantizable:
    q = quants.quantize(x.reshape(1, N), t)
    qb = np.ascontiguousarray(q).view(np.uint8).reshape(-1)
    d = quants.dequantize(qb.reshape(1, -1), t).astype(np.float32).reshape(-1)
    assert d.size == N
    qb.tofile(os.path.join(HERE, f"{t.name.lower()}.q"))
    d.tofile(os.path.join(HERE, f"{t.name.lower()}.deq.f32"))
    manifest[t.name.lower()] = {"id": int(t), "quantized_by_gguf_py": True}

for t, fields in f16_fields.items():
    block_size, type_size = GGML_QUANT_SIZES[t]
    nb = N // block_size
    raw = rng.randint(0, 256, size=(nb, type_size)).astype(np.uint8)
    for b in range(nb):
        for off in fields:
            v = np.float16(rng.uniform(-0.1, 0.1) if off == fields[0] else rng.uniform(0, 0.05))
            raw[b, off:off + 2] = np.frombuffer(v.tobytes(), dtype=np.uint8)
    qb = raw.reshape(-1)
    d = quants.dequantize(qb.reshape(1, -1), t).astype(np.float32).reshape(-1)
    assert d.size == N
    qb.tofile(os.path.join(HERE, f"{t.name.lower()}.q"))
    d.tofile(os.path.join(HERE, f"{t.name.lower()}.deq.f32"))
    manifest[t.name.lower()] = {"id": int(t), "quantized_by_gguf_py": False}

with open(os.path.join(HERE, "manifest.json"), "w") as f:
    json.dump({"n": N, "gguf_py": "0.19.0", "types": manifest}, f, indent=1, sort_keys=True)
    f.write("\n")
