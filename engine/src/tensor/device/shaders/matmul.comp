// y = x·Wᵀ on a Vulkan device, in the CPU's canonical order (engine/src/tensor/kernels.rs and
// qmatmul.rs define it; this file repeats it operation for operation). One source, compiled once
// per weight format with -DFORMAT=n (see ../vulkan.rs and scripts/build-shaders.sh):
//   0 F32, 1 BF16, 2 F16, 3 MXFP4      f32 activations, 32 lanes by fma, zero-padded tail,
//                                      fold l+=l+16, +8, +4, +2, +1
//   4 Q8_0, 5 Q4_0, 6 Q4_1             Q8_0/Q8_1 activation codes, exact integer block sums,
//                                      (d_w·d_x)·isum into lane b%8, fold8
//   7 Q4_K, 8 Q6_K                     Q8_K activation codes, per super-block integer sums,
//                                      8 lanes over all super-blocks, fold8
// Every floating-point result is `precise`: no contraction into fma, no reassociation.
// With -DFMA_EMULATED the float kernels compute each fused multiply-add exactly in f64 (for
// drivers whose `fma` is not fused, such as lavapipe's): the product is exact in f64, the sum's
// rounding error comes from TwoSum, and rounding the f64 sum to odd before rounding to f32
// gives the correctly rounded fused result.
#version 450

#define F32 0
#define BF16 1
#define F16 2
#define MXFP4 3
#define Q8_0 4
#define Q4_0 5
#define Q4_1 6
#define Q4_K 7
#define Q6_K 8

#if FORMAT <= MXFP4
#define FLOAT_KERNEL 1
// One weight row per workgroup, its 32 lanes are the canonical order's 32 lanes.
layout(local_size_x = 32, local_size_y = 1, local_size_z = 1) in;
#define ROWS 4
shared float fold_buf[ROWS][32];
#else
// Four weight rows per workgroup, eight lanes each.
layout(local_size_x = 32, local_size_y = 1, local_size_z = 1) in;
shared float fold_buf[32];
#endif

layout(std430, binding = 0) readonly buffer Weights { uint w[]; };
layout(std430, binding = 1) readonly buffer Acts { uint xs[]; };
layout(std430, binding = 2) writeonly buffer Out { float y[]; };

layout(push_constant) uniform Params {
    uint m;          // activation rows
    uint n;          // weight rows
    uint k;          // columns
    uint row_bytes;  // bytes of one weight row
    uint d_off;      // words: per-block activation scales (f32)
    uint s_off;      // words: Q8_1 sums (f32)
    uint bs_off;     // words: Q8_K sums of 16 codes (i32)
    uint pr_off;     // words: Q8_K sums of 32 codes in Q4K_MIN_LANES order (i32)
    uint groups_x;   // workgroups along x (rows beyond 65535 groups continue in z)
} p;

uint wbyte(uint i) { return (w[i >> 2] >> ((i & 3u) * 8u)) & 0xffu; }
int wbyte_signed(uint i) { return bitfieldExtract(int(w[i >> 2]), int((i & 3u) * 8u), 8); }
int xcode(uint i) { return bitfieldExtract(int(xs[i >> 2]), int((i & 3u) * 8u), 8); }

// f16 bits to f32, exactly (subnormal halves are normal floats; no hardware conversion).
float half_bits(uint h) {
    uint sign = (h & 0x8000u) << 16;
    uint e = (h >> 10) & 0x1fu;
    uint mant = h & 0x3ffu;
    if (e == 0u) {
        if (mant == 0u) return uintBitsToFloat(sign);
        // Normalise: value = mant · 2^-24.
        int shift = 0;
        while ((mant & 0x400u) == 0u) { mant <<= 1; shift++; }
        mant &= 0x3ffu;
        return uintBitsToFloat(sign | (uint(113 - shift) << 23) | (mant << 13));
    }
    if (e == 31u) return uintBitsToFloat(sign | 0x7f800000u | (mant << 13));
    return uintBitsToFloat(sign | ((e + 112u) << 23) | (mant << 13));
}
float half_at(uint i) { return half_bits(wbyte(i) | (wbyte(i + 1u) << 8)); }

uint group_index() { return gl_WorkGroupID.x + gl_WorkGroupID.z * p.groups_x; }

#ifdef FLOAT_KERNEL
#ifdef FMA_EMULATED
float fma_exact(float a, float b, float c) {
    precise double p = double(a) * double(b);
    precise double dc = double(c);
    precise double s = p + dc;
    precise double bb = s - p;
    precise double e = (p - (s - bb)) + (dc - bb);
    uvec2 bits = unpackDouble2x32(s);
    if (e != 0.0 && !isnan(e) && !isinf(s) && (bits.x & 1u) == 0u) {
        // Round to odd: the neighbour of s toward the exact sum (one of the two is odd).
        if ((s > 0.0) == (e > 0.0)) {
            bits.x += 1u;
        } else if (bits.x == 0u) {
            bits.x = 0xffffffffu;
            bits.y -= 1u;
        } else {
            bits.x -= 1u;
        }
        s = packDouble2x32(bits);
    }
    return float(s);
}
#define FMA fma_exact
#else
#define FMA fma
#endif

// ggml's kvalues_mxfp4 (doubled e2m1) and GGML_E8M0_TO_FP32_HALF.
const int KV_MXFP4[16] = int[16](0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
float e8m0_half(uint e) {
    return uintBitsToFloat(e < 2u ? (0x00200000u << e) : ((e - 1u) << 23));
}

float weight(uint j, uint e) {
#if FORMAT == F32
    return uintBitsToFloat(w[j * p.k + e]);
#elif FORMAT == BF16
    uint i = j * p.k + e;
    return uintBitsToFloat(((w[i >> 1] >> ((i & 1u) * 16u)) & 0xffffu) << 16);
#elif FORMAT == F16
    uint i = j * p.k + e;
    return half_bits((w[i >> 1] >> ((i & 1u) * 16u)) & 0xffffu);
#else
    uint base = j * p.row_bytes + (e / 32u) * 17u;
    uint l = e % 32u;
    uint q = wbyte(base + 1u + (l & 15u));
    uint code = l < 16u ? (q & 15u) : (q >> 4);
    precise float v = float(KV_MXFP4[code]) * e8m0_half(wbyte(base));
    return v;
#endif
}

void main() {
    uint j = group_index();
    uint lane = gl_LocalInvocationID.x;
    bool live = j < p.n;
    uint full = p.k / 32u * 32u;
    for (uint i0 = 0u; i0 < p.m; i0 += ROWS) {
        precise float acc[ROWS];
        for (uint r = 0u; r < ROWS; r++) acc[r] = 0.0;
        if (live) {
            for (uint c = 0u; c < full; c += 32u) {
                uint e = c + lane;
                float wv = weight(j, e);
                for (uint r = 0u; r < ROWS && i0 + r < p.m; r++) {
                    acc[r] = FMA(uintBitsToFloat(xs[(i0 + r) * p.k + e]), wv, acc[r]);
                }
            }
            if (full < p.k) {
                uint e = full + lane;
                bool inside = e < p.k;
                float wv = inside ? weight(j, e) : 0.0;
                for (uint r = 0u; r < ROWS && i0 + r < p.m; r++) {
                    float xv = inside ? uintBitsToFloat(xs[(i0 + r) * p.k + e]) : 0.0;
                    acc[r] = FMA(xv, wv, acc[r]);
                }
            }
        }
        for (uint r = 0u; r < ROWS; r++) fold_buf[r][lane] = acc[r];
        barrier();
        for (uint width = 16u; width >= 1u; width /= 2u) {
            if (lane < width) {
                for (uint r = 0u; r < ROWS; r++) {
                    precise float s = fold_buf[r][lane] + fold_buf[r][lane + width];
                    fold_buf[r][lane] = s;
                }
            }
            barrier();
        }
        if (live && lane == 0u) {
            for (uint r = 0u; r < ROWS && i0 + r < p.m; r++) y[(i0 + r) * p.n + j] = fold_buf[r][0];
        }
        barrier();
    }
}

#else // integer block kernels

#if FORMAT == Q4_K
// ggml's get_scale_min_k4 over the 12 packed bytes at `sc`.
void scale_min_k4(uint jj, uint sc, out int scale, out int mn) {
    if (jj < 4u) {
        scale = int(wbyte(sc + jj) & 63u);
        mn = int(wbyte(sc + jj + 4u) & 63u);
    } else {
        scale = int((wbyte(sc + jj + 4u) & 0xfu) | ((wbyte(sc + jj - 4u) >> 6) << 4));
        mn = int((wbyte(sc + jj + 4u) >> 4) | ((wbyte(sc + jj) >> 6) << 4));
    }
}
const uint Q4K_MIN_LANES[8] = uint[8](0u, 1u, 4u, 5u, 2u, 3u, 6u, 7u);
#endif

#if FORMAT == Q6_K
int q6k_code(uint wb, uint e) {
    uint h = e / 128u, r = e % 128u;
    uint s = r / 32u, l = r % 32u;
    uint ql = wbyte(wb + 64u * h + l + 32u * (s & 1u));
    uint lo = s < 2u ? (ql & 0xfu) : (ql >> 4);
    uint hi = (wbyte(wb + 128u + 32u * h + l) >> (2u * s)) & 3u;
    return int(lo | (hi << 4));
}
#endif

float lane_sum(uint j, uint i, uint u) {
    precise float acc = 0.0;
#if FORMAT == Q8_0 || FORMAT == Q4_0 || FORMAT == Q4_1
    uint nb = p.k / 32u;
    uint bb = FORMAT == Q8_0 ? 34u : (FORMAT == Q4_0 ? 18u : 20u);
    for (uint b = u; b < nb; b += 8u) {
        uint wb = j * p.row_bytes + b * bb;
        uint xb = i * p.k + b * 32u;
        int isum = 0;
#if FORMAT == Q8_0
        for (uint t = 0u; t < 32u; t++) isum += wbyte_signed(wb + 2u + t) * xcode(xb + t);
#else
        uint qs = wb + (FORMAT == Q4_0 ? 2u : 4u);
        int off = FORMAT == Q4_0 ? 8 : 0;
        for (uint t = 0u; t < 16u; t++) {
            uint q = wbyte(qs + t);
            isum += (int(q & 0xfu) - off) * xcode(xb + t) + (int(q >> 4) - off) * xcode(xb + t + 16u);
        }
#endif
        precise float s = half_at(wb) * uintBitsToFloat(xs[p.d_off + i * nb + b]);
        precise float term = s * float(isum);
        acc = acc + term;
#if FORMAT == Q4_1
        precise float mterm = half_at(wb + 2u) * uintBitsToFloat(xs[p.s_off + i * nb + b]);
        acc = acc + mterm;
#endif
    }
#elif FORMAT == Q4_K
    uint nb = p.k / 256u;
    for (uint b = 0u; b < nb; b++) {
        uint wb = j * p.row_bytes + b * 144u;
        uint xb = i * p.k + b * 256u;
        float xd = uintBitsToFloat(xs[p.d_off + i * nb + b]);
        precise float s1 = half_at(wb) * xd;
        precise float s2 = half_at(wb + 2u) * xd;
        int sumi = 0;
        for (uint jj = 0u; jj < 8u; jj++) {
            int sc, mn;
            scale_min_k4(jj, wb + 4u, sc, mn);
            int s = 0;
            for (uint l = 4u * u; l < 4u * u + 4u; l++) {
                uint byte = wbyte(wb + 16u + 32u * (jj / 2u) + l);
                uint q = (jj % 2u) == 0u ? (byte & 0xfu) : (byte >> 4);
                s += int(q) * xcode(xb + 32u * jj + l);
            }
            sumi += sc * s;
        }
        int sc_unused, mn;
        scale_min_k4(Q4K_MIN_LANES[u], wb + 4u, sc_unused, mn);
        int summ = mn * int(xs[p.pr_off + (i * nb + b) * 8u + u]);
        precise float t1 = s1 * float(sumi);
        precise float t2 = s2 * float(summ);
        precise float t = t1 - t2;
        acc = acc + t;
    }
#else // Q6_K
    uint nb = p.k / 256u;
    for (uint b = 0u; b < nb; b++) {
        uint wb = j * p.row_bytes + b * 210u;
        uint xb = i * p.k + b * 256u;
        precise float s1 = half_at(wb + 208u) * uintBitsToFloat(xs[p.d_off + i * nb + b]);
        int sumi = 0;
        for (uint kk = 0u; kk < 8u; kk++) {
            int s = 0;
            for (uint e = 32u * kk + 4u * u; e < 32u * kk + 4u * u + 4u; e++) {
                s += q6k_code(wb, e) * xcode(xb + e);
            }
            sumi += wbyte_signed(wb + 192u + 2u * kk + (u >= 4u ? 1u : 0u)) * s;
        }
        uint bs = p.bs_off + (i * nb + b) * 16u;
        sumi -= 32 * (wbyte_signed(wb + 192u + u) * int(xs[bs + u])
                      + wbyte_signed(wb + 192u + 8u + u) * int(xs[bs + 8u + u]));
        precise float term = s1 * float(sumi);
        acc = acc + term;
    }
#endif
    return acc;
}

void main() {
    uint lane = gl_LocalInvocationID.x;
    uint u = lane % 8u;
    uint slot = lane / 8u;
    uint j = group_index() * 4u + slot;
    bool live = j < p.n;
    for (uint i = 0u; i < p.m; i++) {
        fold_buf[lane] = live ? lane_sum(j, i, u) : 0.0;
        barrier();
        if (live && u == 0u) {
            uint o = slot * 8u;
            precise float a = (fold_buf[o] + fold_buf[o + 4u]) + (fold_buf[o + 2u] + fold_buf[o + 6u]);
            precise float b = (fold_buf[o + 1u] + fold_buf[o + 5u]) + (fold_buf[o + 3u] + fold_buf[o + 7u]);
            precise float v = a + b;
            y[i * p.n + j] = v;
        }
        barrier();
    }
}
#endif
