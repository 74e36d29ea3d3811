// y = x·Wᵀ on a CUDA device, in the CPU's canonical order. ../shaders/matmul.comp is the
// specification (engine/src/tensor/kernels.rs and qmatmul.rs define the order); this file repeats
// it operation for operation, one kernel per weight format (DeviceFormat::ALL order):
//   matmul_f32, matmul_bf16, matmul_f16, matmul_mxfp4   f32 activations, 32 lanes by fused
//       multiply-add over chunks of 32 columns, zero-padded tail, fold l+=l+16, +8, +4, +2, +1
//   matmul_q8_0, matmul_q4_0, matmul_q4_1               Q8_0/Q8_1 activation codes, exact integer
//       block sums, (d_w·d_x)·isum into lane b%8, fold8
//   matmul_q4_k, matmul_q6_k                            Q8_K activation codes, per super-block
//       integer sums, 8 lanes over all super-blocks, fold8
//
// Every floating-point operation is an explicit round-to-nearest intrinsic (__fmaf_rn, __fmul_rn,
// __fadd_rn, __fsub_rn, __int2float_rn), which nvcc never contracts or reorders; the file is also
// compiled with -fmad=false, and never with --use_fast_math or -ftz=true (denormals are kept).
//
// Arguments, the same for every kernel (../cuda.rs launches them):
//   w        the weight matrix as its raw bytes (n rows of row_bytes; f32/bf16/f16 rows are k
//            values each), 256-byte aligned as cuMemAlloc returns it
//   xs       the activation words, laid out as vulkan.rs `pack_acts` makes them: f32 rows (m × k)
//            for the float kernels; for the integer kernels the i8 codes (m × k bytes, padded to
//            whole words), then at word offsets d_off the per-block scales (f32), s_off the Q8_1
//            sums (f32), bs_off the Q8_K sums of 16 codes (i32), pr_off the Q8_K sums of 32 codes
//            in Q4K_MIN_LANES order (i32)
//   y        the output, m × n f32
//   m, n, k, row_bytes, d_off, s_off, bs_off, pr_off
// Grid: one block of 32 threads per weight row for the float kernels (grid.x = n), per four
// weight rows for the integer kernels (grid.x = ceil(n / 4)). Weight offsets are computed in
// 64 bits (a matrix may exceed 4 GiB); activation offsets fit 32 bits (cuda.rs chunks the rows).

typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

// f16 bits to f32, exactly (subnormal halves are normal floats; no hardware conversion).
__device__ __forceinline__ float half_bits(u32 h) {
    u32 sign = (h & 0x8000u) << 16;
    u32 e = (h >> 10) & 0x1fu;
    u32 mant = h & 0x3ffu;
    if (e == 0u) {
        if (mant == 0u) return __uint_as_float(sign);
        // Normalise: value = mant · 2^-24.
        int shift = 0;
        while ((mant & 0x400u) == 0u) {
            mant <<= 1;
            shift++;
        }
        mant &= 0x3ffu;
        return __uint_as_float(sign | ((u32)(113 - shift) << 23) | (mant << 13));
    }
    if (e == 31u) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (mant << 13));
}

__device__ __forceinline__ u32 wbyte(const unsigned char* w, u64 i) { return (u32)w[i]; }
__device__ __forceinline__ int wbyte_signed(const unsigned char* w, u64 i) {
    return (int)(signed char)w[i];
}
__device__ __forceinline__ float half_at(const unsigned char* w, u64 i) {
    return half_bits(wbyte(w, i) | (wbyte(w, i + 1u) << 8));
}
__device__ __forceinline__ int xcode(const u32* xs, u32 i) {
    return (int)((const signed char*)xs)[i];
}

// ---------------------------------------------------------------------------------------------
// Float kernels

#define F32 0
#define BF16 1
#define F16 2
#define MXFP4 3

// ggml's kvalues_mxfp4 (doubled e2m1) and GGML_E8M0_TO_FP32_HALF.
__constant__ int KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23));
}

template <int FORMAT>
__device__ __forceinline__ float weight(const unsigned char* w, u32 j, u32 e, u32 k,
                                        u32 row_bytes) {
    if (FORMAT == F32) {
        return ((const float*)w)[(u64)j * k + e];
    } else if (FORMAT == BF16) {
        u32 bits = ((const unsigned short*)w)[(u64)j * k + e];
        return __uint_as_float(bits << 16);
    } else if (FORMAT == F16) {
        return half_bits(((const unsigned short*)w)[(u64)j * k + e]);
    } else {
        u64 base = (u64)j * row_bytes + (u64)(e / 32u) * 17u;
        u32 l = e % 32u;
        u32 q = wbyte(w, base + 1u + (l & 15u));
        u32 code = l < 16u ? (q & 15u) : (q >> 4);
        return __fmul_rn(__int2float_rn(KV_MXFP4[code]), e8m0_half(wbyte(w, base)));
    }
}

// Activation rows computed together against one weight row.
#define ROWS 4

template <int FORMAT>
__device__ __forceinline__ void float_kernel(const unsigned char* w, const u32* xs, float* y,
                                             u32 m, u32 n, u32 k, u32 row_bytes) {
    const float* x = (const float*)xs;
    u32 j = blockIdx.x;
    u32 lane = threadIdx.x;
    if (j >= n) return;  // the whole block: no lane of it takes part in anything
    u32 full = k / 32u * 32u;
    for (u32 i0 = 0u; i0 < m; i0 += ROWS) {
        float acc[ROWS];
#pragma unroll
        for (u32 r = 0u; r < ROWS; r++) acc[r] = 0.0f;
        for (u32 c = 0u; c < full; c += 32u) {
            u32 e = c + lane;
            float wv = weight<FORMAT>(w, j, e, k, row_bytes);
#pragma unroll
            for (u32 r = 0u; r < ROWS; r++) {
                if (i0 + r < m) acc[r] = __fmaf_rn(x[(i0 + r) * k + e], wv, acc[r]);
            }
        }
        if (full < k) {
            u32 e = full + lane;
            bool inside = e < k;
            float wv = inside ? weight<FORMAT>(w, j, e, k, row_bytes) : 0.0f;
#pragma unroll
            for (u32 r = 0u; r < ROWS; r++) {
                if (i0 + r < m) {
                    float xv = inside ? x[(i0 + r) * k + e] : 0.0f;
                    acc[r] = __fmaf_rn(xv, wv, acc[r]);
                }
            }
        }
        // The fold tree: lane l takes l + width for width 16, 8, 4, 2, 1 (lanes at or above
        // width compute values nobody reads, as the shader's idle lanes keep theirs).
#pragma unroll
        for (u32 r = 0u; r < ROWS; r++) {
            float v = acc[r];
            for (u32 width = 16u; width >= 1u; width /= 2u) {
                float other = __shfl_down_sync(FULL_MASK, v, width);
                v = __fadd_rn(v, other);
            }
            if (lane == 0u && i0 + r < m) y[(i0 + r) * n + j] = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Integer block kernels

#define Q8_0 4
#define Q4_0 5
#define Q4_1 6
#define Q4_K 7
#define Q6_K 8

// ggml's get_scale_min_k4 over the 12 packed bytes at `sc`.
__device__ __forceinline__ void scale_min_k4(const unsigned char* w, u32 jj, u64 sc, int* scale,
                                             int* mn) {
    if (jj < 4u) {
        *scale = (int)(wbyte(w, sc + jj) & 63u);
        *mn = (int)(wbyte(w, sc + jj + 4u) & 63u);
    } else {
        *scale = (int)((wbyte(w, sc + jj + 4u) & 0xfu) | ((wbyte(w, sc + jj - 4u) >> 6) << 4));
        *mn = (int)((wbyte(w, sc + jj + 4u) >> 4) | ((wbyte(w, sc + jj) >> 6) << 4));
    }
}
__constant__ u32 Q4K_MIN_LANES[8] = {0u, 1u, 4u, 5u, 2u, 3u, 6u, 7u};

__device__ __forceinline__ int q6k_code(const unsigned char* w, u64 wb, u32 e) {
    u32 h = e / 128u, r = e % 128u;
    u32 s = r / 32u, l = r % 32u;
    u32 ql = wbyte(w, wb + 64u * h + l + 32u * (s & 1u));
    u32 lo = s < 2u ? (ql & 0xfu) : (ql >> 4);
    u32 hi = (wbyte(w, wb + 128u + 32u * h + l) >> (2u * s)) & 3u;
    return (int)(lo | (hi << 4));
}

__device__ __forceinline__ float xword_f32(const u32* xs, u32 i) { return __uint_as_float(xs[i]); }
__device__ __forceinline__ int xword_i32(const u32* xs, u32 i) { return (int)xs[i]; }

// Lane u's share of output (i, j): blocks b ≡ u (mod 8) for the 32-element formats, the
// columns 4u..4u+4 of every 32 in each super-block for the K-quants.
template <int FORMAT>
__device__ __forceinline__ float lane_sum(const unsigned char* w, const u32* xs, u32 j, u32 i,
                                          u32 u, u32 k, u32 row_bytes, u32 d_off, u32 s_off,
                                          u32 bs_off, u32 pr_off) {
    float acc = 0.0f;
    if (FORMAT == Q8_0 || FORMAT == Q4_0 || FORMAT == Q4_1) {
        u32 nb = k / 32u;
        u32 bb = FORMAT == Q8_0 ? 34u : (FORMAT == Q4_0 ? 18u : 20u);
        for (u32 b = u; b < nb; b += 8u) {
            u64 wb = (u64)j * row_bytes + (u64)b * bb;
            u32 xb = i * k + b * 32u;
            int isum = 0;
            if (FORMAT == Q8_0) {
                for (u32 t = 0u; t < 32u; t++)
                    isum += wbyte_signed(w, wb + 2u + t) * xcode(xs, xb + t);
            } else {
                u64 qs = wb + (FORMAT == Q4_0 ? 2u : 4u);
                int off = FORMAT == Q4_0 ? 8 : 0;
                for (u32 t = 0u; t < 16u; t++) {
                    u32 q = wbyte(w, qs + t);
                    isum += ((int)(q & 0xfu) - off) * xcode(xs, xb + t) +
                            ((int)(q >> 4) - off) * xcode(xs, xb + t + 16u);
                }
            }
            float s = __fmul_rn(half_at(w, wb), xword_f32(xs, d_off + i * nb + b));
            float term = __fmul_rn(s, __int2float_rn(isum));
            acc = __fadd_rn(acc, term);
            if (FORMAT == Q4_1) {
                float mterm = __fmul_rn(half_at(w, wb + 2u), xword_f32(xs, s_off + i * nb + b));
                acc = __fadd_rn(acc, mterm);
            }
        }
    } else if (FORMAT == Q4_K) {
        u32 nb = k / 256u;
        for (u32 b = 0u; b < nb; b++) {
            u64 wb = (u64)j * row_bytes + (u64)b * 144u;
            u32 xb = i * k + b * 256u;
            float xd = xword_f32(xs, d_off + i * nb + b);
            float s1 = __fmul_rn(half_at(w, wb), xd);
            float s2 = __fmul_rn(half_at(w, wb + 2u), xd);
            int sumi = 0;
            for (u32 jj = 0u; jj < 8u; jj++) {
                int sc, mn;
                scale_min_k4(w, jj, wb + 4u, &sc, &mn);
                int s = 0;
                for (u32 l = 4u * u; l < 4u * u + 4u; l++) {
                    u32 byte = wbyte(w, wb + 16u + 32u * (jj / 2u) + l);
                    u32 q = (jj % 2u) == 0u ? (byte & 0xfu) : (byte >> 4);
                    s += (int)q * xcode(xs, xb + 32u * jj + l);
                }
                sumi += sc * s;
            }
            int sc_unused, mn;
            scale_min_k4(w, Q4K_MIN_LANES[u], wb + 4u, &sc_unused, &mn);
            int summ = mn * xword_i32(xs, pr_off + (i * nb + b) * 8u + u);
            float t1 = __fmul_rn(s1, __int2float_rn(sumi));
            float t2 = __fmul_rn(s2, __int2float_rn(summ));
            float t = __fsub_rn(t1, t2);
            acc = __fadd_rn(acc, t);
        }
    } else {  // Q6_K
        u32 nb = k / 256u;
        for (u32 b = 0u; b < nb; b++) {
            u64 wb = (u64)j * row_bytes + (u64)b * 210u;
            u32 xb = i * k + b * 256u;
            float s1 = __fmul_rn(half_at(w, wb + 208u), xword_f32(xs, d_off + i * nb + b));
            int sumi = 0;
            for (u32 kk = 0u; kk < 8u; kk++) {
                int s = 0;
                for (u32 e = 32u * kk + 4u * u; e < 32u * kk + 4u * u + 4u; e++) {
                    s += q6k_code(w, wb, e) * xcode(xs, xb + e);
                }
                sumi += wbyte_signed(w, wb + 192u + 2u * kk + (u >= 4u ? 1u : 0u)) * s;
            }
            u32 bs = bs_off + (i * nb + b) * 16u;
            sumi -= 32 * (wbyte_signed(w, wb + 192u + u) * xword_i32(xs, bs + u) +
                          wbyte_signed(w, wb + 192u + 8u + u) * xword_i32(xs, bs + 8u + u));
            float term = __fmul_rn(s1, __int2float_rn(sumi));
            acc = __fadd_rn(acc, term);
        }
    }
    return acc;
}

// Four weight rows per block of 32 threads, eight lanes each.
template <int FORMAT>
__device__ __forceinline__ void int_kernel(const unsigned char* w, const u32* xs, float* y, u32 m,
                                           u32 n, u32 k, u32 row_bytes, u32 d_off, u32 s_off,
                                           u32 bs_off, u32 pr_off) {
    u32 lane = threadIdx.x;
    u32 u = lane % 8u;
    u32 slot = lane / 8u;
    u32 j = blockIdx.x * 4u + slot;
    bool live = j < n;
    for (u32 i = 0u; i < m; i++) {
        float v = live ? lane_sum<FORMAT>(w, xs, j, i, u, k, row_bytes, d_off, s_off, bs_off,
                                          pr_off)
                       : 0.0f;
        float l[8];
#pragma unroll
        for (u32 t = 0u; t < 8u; t++) l[t] = __shfl_sync(FULL_MASK, v, slot * 8u + t);
        if (live && u == 0u) {
            float a = __fadd_rn(__fadd_rn(l[0], l[4]), __fadd_rn(l[2], l[6]));
            float b = __fadd_rn(__fadd_rn(l[1], l[5]), __fadd_rn(l[3], l[7]));
            y[i * n + j] = __fadd_rn(a, b);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points

#define FLOAT_ENTRY(name, format)                                                              \
    extern "C" __global__ void __launch_bounds__(32)                                           \
        name(const unsigned char* __restrict__ w, const u32* __restrict__ xs,                  \
             float* __restrict__ y, u32 m, u32 n, u32 k, u32 row_bytes, u32 d_off, u32 s_off,  \
             u32 bs_off, u32 pr_off) {                                                         \
        float_kernel<format>(w, xs, y, m, n, k, row_bytes);                                    \
    }

#define INT_ENTRY(name, format)                                                                \
    extern "C" __global__ void __launch_bounds__(32)                                           \
        name(const unsigned char* __restrict__ w, const u32* __restrict__ xs,                  \
             float* __restrict__ y, u32 m, u32 n, u32 k, u32 row_bytes, u32 d_off, u32 s_off,  \
             u32 bs_off, u32 pr_off) {                                                         \
        int_kernel<format>(w, xs, y, m, n, k, row_bytes, d_off, s_off, bs_off, pr_off);        \
    }

FLOAT_ENTRY(matmul_f32, F32)
FLOAT_ENTRY(matmul_bf16, BF16)
FLOAT_ENTRY(matmul_f16, F16)
FLOAT_ENTRY(matmul_mxfp4, MXFP4)
INT_ENTRY(matmul_q8_0, Q8_0)
INT_ENTRY(matmul_q4_0, Q4_0)
INT_ENTRY(matmul_q4_1, Q4_1)
INT_ENTRY(matmul_q4_k, Q4_K)
INT_ENTRY(matmul_q6_k, Q6_K)
