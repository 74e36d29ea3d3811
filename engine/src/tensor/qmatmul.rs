//! Matrix products against quantized weights (ggml block formats), computed as llama.cpp
//! does: the activation rows are quantized to 8-bit blocks once per product, and each output
//! is a sum of exact integer block dot products scaled by the two block scales.
//!
//! Activation formats (chosen by the weight type, as llama.cpp's `vec_dot` pairs them):
//! * `Q8_0` (for Q8_0, Q4_0, Q5_0 and IQ4_NL weights): 32 values, `d = f16(max|x| / 127)`,
//!   `q = round_ties_even(x · 127 / max|x|)`.
//! * `Q8_1` (for Q4_1 and Q5_1): as `Q8_0` plus `s = f16(d · Σq)` with the unrounded `d`.
//! * `Q8_K` (for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS): 256 values, `d = 1 / iscale` in
//!   f32 with `iscale = −127 / x_max` (`x_max` the value of largest magnitude),
//!   `q = nearest(iscale·x)`, and the sums of each 16 codes.
//!
//! Weight codes, as ggml defines the values: Q8_0 `q`; Q4_0 `q − 8`; Q5_0 `q − 16` (the fifth
//! bit from `qh`); Q4_1 / Q5_1 `q` with the block min `m` added as `m · s`; IQ4_NL / IQ4_XS
//! `kvalues_iq4nl[q]`; Q4_K / Q5_K `sc·q` less `m` against the 32-sums of the activation
//! codes; Q6_K `sc·(q − 32)`; Q3_K `sc·(q − 4)` (`q` with bit 2 from `hmask`, and
//! `sc − 32` from the 6-bit scales); Q2_K `sc·q` less `m` against the 16-sums. Integer
//! sums are exact, so only where they are cut into lanes and the float steps after them
//! define the bits.
//!
//! Canonical order (what makes the scalar reference and the SIMD kernels bit-identical, and a
//! row's result independent of batch size and threads):
//! * 32-element formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL): block `b`'s exact integer sum
//!   `isum_b` is scaled, `p_b = (d_w · d_x) · isum_b`, and added into lane `b % 8` of eight
//!   f32 accumulators (Q4_1 and Q5_1 then add `m_w · s_x` to the same lane); the lanes fold
//!   as `((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))`.
//! * K-quants and IQ4_XS: eight f32 lanes, one per i32 lane of AVX2's `madd` over a
//!   32-element group. Per super-block, lane `u` takes the exact integer sum over the eight
//!   groups `j` of the group's scale (of its 16-element half for Q2_K, Q3_K, Q6_K: the first
//!   half for `u < 4`) times `Σ code·y` over elements `32j + 4u .. 32j + 4u + 4`; then, still
//!   in i32, the per-format term of that lane: Q4_K / Q5_K `summ_u = m_p · (32-sum p)` with
//!   `p = [0, 1, 4, 5, 2, 3, 6, 7][u]`; Q2_K `summ_u = m_u · bsum_u + m_{8+u} · bsum_{8+u}`;
//!   Q6_K / Q3_K subtract `32` / `4` times `sc_u · bsum_u + sc_{8+u} · bsum_{8+u}` (the
//!   codes are taken unsigned, `q + 32` / `q + 4`). The lane then adds
//!   `(d_w·d_x) · sumi_u − (dmin_w·d_x) · summ_u` (Q4_K, Q5_K, Q2_K) or `(d_w·d_x) · sumi_u`
//!   (Q6_K, Q3_K, IQ4_XS), super-block after super-block; the lanes fold as above.
//!
//! Kernels: the scalar reference (`dot_ref`, which defines the results) and AVX2 for every
//! type; with AVX-512 VNNI the 32-element formats' byte products, and with AVX-512 BW 512-bit
//! integer steps for Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (IQ4_XS's AVX2 kernel runs there); with
//! AVX-512 VNNI, Q4_K, Q5_K and Q6_K products of [`TILED_MIN_ROWS`] or more activation rows
//! (prefill) go through [`tiled`]: eight weight rows unpacked once against sixteen activation
//! rows per register, the same lanes and float steps, so the same bits. There are no NEON
//! kernels for the block formats: aarch64 computes them by the scalar reference (this
//! workspace is built and tested on x86-64 only and cannot compile aarch64).
//!
//! Every other ggml type (MXFP4) is computed by dequantizing the weight row (bit-identical to
//! ggml's dequantization) and taking the f32 dot product of `tensor::kernels`: exact to the
//! format, deterministic, but slower. MXFP4 against a few activation rows (decode) skips the
//! row buffer: `kernels::dot_mxfp4` decodes each block in registers and fuses it into the
//! same 32 lanes, giving the same bits.

use half::f16;
use rayon::prelude::*;

use super::kernels::{dot, dot_mxfp4, Isa};
use super::matmul::OutPtr;
use super::quant::{
    dequantize_row, get_scale_min_k4, q3k_scales, unpack_q5, BlockIq4Xs, QuantType, KVALUES_IQ4NL,
    QK32, QK_K,
};
use super::WeightData;

/// Weight rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// Below this many activation rows an MXFP4 weight row is decoded inside the dot kernel for
/// each of them; from it on, once into a buffer shared by all (both give the same bits).
const MXFP4_DECODE_ROWS: usize = 4;

/// Activation rows handled together against one weight row (prefill).
const ROW_GROUP: usize = 4;

/// Activation rows an interleaved Q4_K group takes at once (prefill). On a Zen 1 (§22) two
/// measured fastest (1, 3 and 4: 0.96–1.04× of it); on a Zen 3 four, with each group's scales
/// spread once per record, ran 1.03–1.10× that two-row pass at 64 rows and 1.34–1.37× at 512
/// (docs/benchmarks.md §25).
const GROUP_ACT_ROWS: usize = 4;

/// Bytes of quantized activation rows a task keeps hot while its weight rows pass over them.
const X_CHUNK_BYTES: usize = 24 * 1024;

/// From this many activation rows on, Q4_K, Q5_K and Q6_K products go through the tiled kernels
/// where they run (AVX-512 VNNI). Unpacking a tile costs about as much as the row kernels
/// spend on a few dozen rows: below this the row kernels are as fast or faster (measured with
/// `QMATMUL_AB=1 qmatmul_speed`, docs/benchmarks.md §19).
const TILED_MIN_ROWS: usize = 64;

pub mod interleaved;
pub mod prefetch;
#[cfg(target_arch = "x86_64")]
mod tiled;

/// How activations are quantized for a weight type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActFormat {
    Q8_0,
    Q8_1,
    Q8K,
}

/// The activation format the integer kernels use for `ty`, or `None` when `ty` is computed by
/// dequantizing.
pub fn act_format(ty: QuantType) -> Option<ActFormat> {
    match ty {
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 | QuantType::IQ4_NL => {
            Some(ActFormat::Q8_0)
        }
        QuantType::Q4_1 | QuantType::Q5_1 => Some(ActFormat::Q8_1),
        QuantType::Q2_K
        | QuantType::Q3_K
        | QuantType::Q4_K
        | QuantType::Q5_K
        | QuantType::Q6_K
        | QuantType::IQ4_XS => Some(ActFormat::Q8K),
        _ => None,
    }
}

/// Quantized activation rows.
pub struct QuantizedActs {
    pub format: ActFormat,
    pub cols: usize,
    /// Codes, `rows × cols`.
    pub qs: Vec<i8>,
    /// One scale per block.
    pub d: Vec<f32>,
    /// Q8_1: `f16(d · Σq)` per block. Q8_K: the sum of each 16 codes.
    pub sums: Vec<f32>,
    pub bsums: Vec<i32>,
    /// Q8_K: per super-block, the sums of each 32 codes in [`Q4K_MIN_LANES`] order.
    pub pairs: Vec<i32>,
}

impl QuantizedActs {
    /// Quantize `x` (`rows × cols`) to `format`.
    pub fn quantize(format: ActFormat, x: &[f32], cols: usize) -> QuantizedActs {
        let bs = match format {
            ActFormat::Q8_0 | ActFormat::Q8_1 => QK32,
            ActFormat::Q8K => QK_K,
        };
        assert!(
            cols.is_multiple_of(bs),
            "activation row not a whole number of blocks"
        );
        let blocks = x.len() / bs;
        let mut qs = vec![0i8; x.len()];
        let mut d = Vec::with_capacity(blocks);
        let mut sums = Vec::with_capacity(if format == ActFormat::Q8_1 { blocks } else { 0 });
        let k_blocks = if format == ActFormat::Q8K { blocks } else { 0 };
        let mut bsums: Vec<i32> = Vec::with_capacity(k_blocks * (QK_K / 16));
        let mut pairs = Vec::with_capacity(k_blocks * 8);
        for (xb, qb) in x.chunks_exact(bs).zip(qs.chunks_exact_mut(bs)) {
            match format {
                ActFormat::Q8_0 | ActFormat::Q8_1 => {
                    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let dd = amax / 127.0;
                    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                    let mut sum = 0i32;
                    for (q, &v) in qb.iter_mut().zip(xb) {
                        // Ties to even, as `_mm256_round_ps(_MM_ROUND_NEAREST)` (|v·id| ≤ 127).
                        *q = nearest_int(v * id) as i8;
                        sum += *q as i32;
                    }
                    d.push(f16::from_f32(dd).to_f32());
                    if format == ActFormat::Q8_1 {
                        sums.push(f16::from_f32(dd * sum as f32).to_f32());
                    }
                }
                ActFormat::Q8K => {
                    // The value of largest magnitude, the first one where several tie (NaN
                    // never counts): the greatest magnitude first (a maximum, in any order, so
                    // vectorized), then where it first occurs.
                    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let max = xb.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0);
                    if amax == 0.0 {
                        d.push(0.0);
                        bsums.extend([0i32; QK_K / 16]);
                        pairs.extend([0i32; 8]);
                        continue;
                    }
                    let iscale = -127.0 / max;
                    for (q, &v) in qb.iter_mut().zip(xb) {
                        *q = nearest_int(iscale * v).min(127) as i8;
                    }
                    for g in qb.chunks_exact(16) {
                        bsums.push(g.iter().map(|&q| q as i32).sum());
                    }
                    let bs = &bsums[bsums.len() - 16..];
                    for p in Q4K_MIN_LANES {
                        pairs.push(bs[2 * p] + bs[2 * p + 1]);
                    }
                    d.push(1.0 / iscale);
                }
            }
        }
        QuantizedActs {
            format,
            cols,
            qs,
            d,
            sums,
            bsums,
            pairs,
        }
    }

    /// Row `i` as the kernels take it.
    fn row(&self, i: usize) -> ActRow<'_> {
        let bs = match self.format {
            ActFormat::Q8_0 | ActFormat::Q8_1 => QK32,
            ActFormat::Q8K => QK_K,
        };
        let nb = self.cols / bs;
        ActRow {
            qs: &self.qs[i * self.cols..(i + 1) * self.cols],
            d: &self.d[i * nb..(i + 1) * nb],
            sums: if self.sums.is_empty() {
                &[]
            } else {
                &self.sums[i * nb..(i + 1) * nb]
            },
            bsums: if self.bsums.is_empty() {
                &[]
            } else {
                &self.bsums[i * nb * 16..(i + 1) * nb * 16]
            },
            pairs: if self.pairs.is_empty() {
                &[]
            } else {
                &self.pairs[i * nb * 8..(i + 1) * nb * 8]
            },
        }
    }
}

/// ggml's `nearest_int` (round half to even via the 1.5·2²³ trick).
#[inline]
fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Q4_K's min term in lane `u` uses sub-block `Q4K_MIN_LANES[u]` (the pairing of AVX2's
/// `hadd` over the 16 sums, kept for all paths).
const Q4K_MIN_LANES: [usize; 8] = [0, 1, 4, 5, 2, 3, 6, 7];

/// One quantized activation row.
#[derive(Clone, Copy)]
struct ActRow<'a> {
    qs: &'a [i8],
    d: &'a [f32],
    sums: &'a [f32],
    bsums: &'a [i32],
    pairs: &'a [i32],
}

#[inline]
fn f16_le(b: &[u8], off: usize) -> f32 {
    f16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

/// The fixed fold of the eight lanes.
#[inline]
fn fold8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

// ------------------------------------------------------------------------------------------
// Scalar reference (defines the results).

/// Exact integer sum of one 32-element weight block against 32 activation codes.
fn isum32(ty: QuantType, w: &[u8], x: &[i8]) -> i32 {
    match ty {
        QuantType::Q8_0 => w[2..34]
            .iter()
            .zip(x)
            .map(|(&q, &v)| q as i8 as i32 * v as i32)
            .sum(),
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let qs = if ty == QuantType::Q4_0 {
                &w[2..18]
            } else {
                &w[4..20]
            };
            let off = if ty == QuantType::Q4_0 { 8 } else { 0 };
            (0..16)
                .map(|j| {
                    ((qs[j] & 0xf) as i32 - off) * x[j] as i32
                        + ((qs[j] >> 4) as i32 - off) * x[j + 16] as i32
                })
                .sum()
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let (qh_at, off) = if ty == QuantType::Q5_0 {
                (2, 16)
            } else {
                (4, 0)
            };
            let qh = u32::from_le_bytes(w[qh_at..qh_at + 4].try_into().unwrap());
            let codes = unpack_q5(w[qh_at + 4..qh_at + 20].try_into().unwrap(), qh);
            codes
                .iter()
                .zip(x)
                .map(|(&q, &v)| (q as i32 - off) * v as i32)
                .sum()
        }
        QuantType::IQ4_NL => {
            let qs = &w[2..18];
            let kv = |q: u8| KVALUES_IQ4NL[q as usize] as i32;
            (0..16)
                .map(|j| kv(qs[j] & 0xf) * x[j] as i32 + kv(qs[j] >> 4) * x[j + 16] as i32)
                .sum()
        }
        _ => unreachable!("not a 32-element integer format"),
    }
}

/// A K-quant super-block's eight lane sums: lane `u` holds, for each 32-element group `j`,
/// the group's scale `sc(j, u)` times the exact sum of `code(e) · y[e]` over its elements
/// `e = 32j + 4u .. 32j + 4u + 4` (the i32 lanes of AVX2's `madd` over a group).
fn k_lanes(y: &[i8], code: impl Fn(usize) -> i32, sc: impl Fn(usize, usize) -> i32) -> [i32; 8] {
    std::array::from_fn(|u| {
        (0..8)
            .map(|j| {
                let s: i32 = (32 * j + 4 * u..32 * j + 4 * u + 4)
                    .map(|e| code(e) * y[e] as i32)
                    .sum();
                sc(j, u) * s
            })
            .sum()
    })
}

/// The 16-element sub-block of lane `u`'s elements in 32-element group `j` (lanes 0..4 hold
/// the group's first 16 elements).
#[inline]
fn sub16(j: usize, u: usize) -> usize {
    2 * j + usize::from(u >= 4)
}

/// Scalar reference dot of a quantized weight row against a quantized activation row.
#[allow(clippy::needless_range_loop)] // element indices are the point of the reference
fn dot_ref(ty: QuantType, w: &[u8], x: ActRow<'_>) -> f32 {
    match ty {
        QuantType::Q8_0
        | QuantType::Q4_0
        | QuantType::Q4_1
        | QuantType::Q5_0
        | QuantType::Q5_1
        | QuantType::IQ4_NL => {
            let bb = ty.block_bytes();
            let mut acc = [0.0f32; 8];
            for (b, wb) in w.chunks_exact(bb).enumerate() {
                let isum = isum32(ty, wb, &x.qs[b * QK32..(b + 1) * QK32]);
                let s = f16_le(wb, 0) * x.d[b];
                let l = b % 8;
                acc[l] += s * isum as f32;
                if matches!(ty, QuantType::Q4_1 | QuantType::Q5_1) {
                    acc[l] += f16_le(wb, 2) * x.sums[b];
                }
            }
            fold8(&acc)
        }
        QuantType::Q4_K => {
            let mut acc = [0.0f32; 8];
            for (b, wb) in w.chunks_exact(ty.block_bytes()).enumerate() {
                let scales: &[u8; 12] = wb[4..16].try_into().unwrap();
                let qs = &wb[16..144];
                let y = &x.qs[b * QK_K..(b + 1) * QK_K];
                let s1 = f16_le(wb, 0) * x.d[b];
                let s2 = f16_le(wb, 2) * x.d[b];
                for u in 0..8 {
                    let mut sumi = 0i32;
                    for j in 0..8 {
                        let (sc, _) = get_scale_min_k4(j, scales);
                        let mut s = 0i32;
                        for l in 4 * u..4 * u + 4 {
                            let byte = qs[32 * (j / 2) + l];
                            let q = if j % 2 == 0 { byte & 0xf } else { byte >> 4 };
                            s += q as i32 * y[32 * j + l] as i32;
                        }
                        sumi += sc as i32 * s;
                    }
                    let (_, m) = get_scale_min_k4(Q4K_MIN_LANES[u], scales);
                    let summ = m as i32 * x.pairs[b * 8 + u];
                    acc[u] += s1 * sumi as f32 - s2 * summ as f32;
                }
            }
            fold8(&acc)
        }
        QuantType::Q6_K => {
            let mut acc = [0.0f32; 8];
            for (b, wb) in w.chunks_exact(ty.block_bytes()).enumerate() {
                let y = &x.qs[b * QK_K..(b + 1) * QK_K];
                let bs = &x.bsums[b * 16..(b + 1) * 16];
                let sc = |g: usize| wb[192 + g] as i8 as i32;
                let s1 = f16_le(wb, 208) * x.d[b];
                for u in 0..8 {
                    let mut sumi = 0i32;
                    for k in 0..8 {
                        let mut s = 0i32;
                        for e in 32 * k + 4 * u..32 * k + 4 * u + 4 {
                            s += q6k_code(wb, e) * y[e] as i32;
                        }
                        sumi += sc(2 * k + usize::from(u >= 4)) * s;
                    }
                    sumi -= 32 * (sc(u) * bs[u] + sc(8 + u) * bs[8 + u]);
                    acc[u] += s1 * sumi as f32;
                }
            }
            fold8(&acc)
        }
        QuantType::Q5_K => {
            let mut acc = [0.0f32; 8];
            for (b, wb) in w.chunks_exact(ty.block_bytes()).enumerate() {
                let scales: &[u8; 12] = wb[4..16].try_into().unwrap();
                let y = &x.qs[b * QK_K..(b + 1) * QK_K];
                let s1 = f16_le(wb, 0) * x.d[b];
                let s2 = f16_le(wb, 2) * x.d[b];
                let sumi = k_lanes(
                    y,
                    |e| q5k_code(wb, e),
                    |j, _| get_scale_min_k4(j, scales).0 as i32,
                );
                for u in 0..8 {
                    let (_, m) = get_scale_min_k4(Q4K_MIN_LANES[u], scales);
                    let summ = m as i32 * x.pairs[b * 8 + u];
                    acc[u] += s1 * sumi[u] as f32 - s2 * summ as f32;
                }
            }
            fold8(&acc)
        }
        QuantType::IQ4_XS => {
            let mut acc = [0.0f32; 8];
            for (b, wb) in w.chunks_exact(ty.block_bytes()).enumerate() {
                let blk = BlockIq4Xs::from_bytes(wb);
                let y = &x.qs[b * QK_K..(b + 1) * QK_K];
                let s1 = blk.d.to_f32() * x.d[b];
                let code = |e: usize| {
                    let q = blk.qs[16 * (e / 32) + e % 16] >> (4 * ((e % 32) / 16));
                    KVALUES_IQ4NL[(q & 0xf) as usize] as i32
                };
                let sumi = k_lanes(y, code, |j, _| blk.scale(j));
                for u in 0..8 {
                    acc[u] += s1 * sumi[u] as f32;
                }
            }
            fold8(&acc)
        }
        QuantType::Q3_K => {
            let mut acc = [0.0f32; 8];
            for (b, wb) in w.chunks_exact(ty.block_bytes()).enumerate() {
                let sc = q3k_scales(wb[96..108].try_into().unwrap());
                let sc = |i: usize| sc[i] as i32;
                let y = &x.qs[b * QK_K..(b + 1) * QK_K];
                let bs = &x.bsums[b * 16..(b + 1) * 16];
                let s1 = f16_le(wb, 108) * x.d[b];
                // Codes 0..8 (`q + 4`); Σ sc·(c − 4)·y = Σ sc·c·y − 4·Σ sc·bsum.
                let sumi = k_lanes(y, |e| q3k_code(wb, e), |j, u| sc(sub16(j, u)));
                for u in 0..8 {
                    let v = sumi[u] - 4 * (sc(u) * bs[u] + sc(8 + u) * bs[8 + u]);
                    acc[u] += s1 * v as f32;
                }
            }
            fold8(&acc)
        }
        QuantType::Q2_K => {
            let mut acc = [0.0f32; 8];
            for (b, wb) in w.chunks_exact(ty.block_bytes()).enumerate() {
                let y = &x.qs[b * QK_K..(b + 1) * QK_K];
                let bs = &x.bsums[b * 16..(b + 1) * 16];
                let s1 = f16_le(wb, 80) * x.d[b];
                let s2 = f16_le(wb, 82) * x.d[b];
                let sumi = k_lanes(
                    y,
                    |e| q2k_code(wb, e),
                    |j, u| (wb[sub16(j, u)] & 0xf) as i32,
                );
                let m = |i: usize| (wb[i] >> 4) as i32;
                for u in 0..8 {
                    let summ = m(u) * bs[u] + m(8 + u) * bs[8 + u];
                    acc[u] += s1 * sumi[u] as f32 - s2 * summ as f32;
                }
            }
            fold8(&acc)
        }
        _ => unreachable!("no integer kernel for {ty}"),
    }
}

/// The SIMD kernels' contract between weight row `w` of `ty` and activation row `x`: `w` is a
/// whole number `nb` of blocks, and `x` has `nb` blocks of codes, one scale per block, and the
/// sums its format has (Q8_1: one per block; Q8_K: 16 and 8 per super-block). The kernels
/// read exactly these ranges.
#[inline]
fn row_fits(ty: QuantType, w: &[u8], x: &ActRow<'_>) -> bool {
    let (bb, bs) = (ty.block_bytes(), ty.block_size());
    // One scale per block: `nb` without a division (this runs for every row product).
    let nb = x.d.len();
    let sums = match ty {
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 | QuantType::IQ4_NL => true,
        QuantType::Q4_1 | QuantType::Q5_1 => x.sums.len() == nb,
        QuantType::IQ4_XS => true,
        QuantType::Q4_K | QuantType::Q5_K => x.pairs.len() == 8 * nb,
        QuantType::Q6_K | QuantType::Q3_K | QuantType::Q2_K => x.bsums.len() == 16 * nb,
        _ => false,
    };
    sums && w.len() == nb * bb && x.qs.len() == nb * bs
}

/// The unsigned 6-bit code (0..64) of element `e` of a Q6_K block.
#[inline]
fn q6k_code(wb: &[u8], e: usize) -> i32 {
    let (h, r) = (e / 128, e % 128);
    let (s, l) = (r / 32, r % 32);
    let ql = wb[64 * h + l + 32 * (s & 1)];
    let lo = if s < 2 { ql & 0xf } else { ql >> 4 };
    let hi = (wb[128 + 32 * h + l] >> (2 * s)) & 3;
    (lo | (hi << 4)) as i32
}

/// The 5-bit code (0..32) of element `e` of a Q5_K block (d, dmin 0..4, scales 4..16, qh
/// 16..48, qs 48..176): group `j = e / 32` takes the low (even `j`) or high nibble of
/// `qs[32·(j / 2) + l]` and bit `j` of `qh[l]`, `l = e % 32` (as `dequantize_row_q5_K`).
#[inline]
fn q5k_code(wb: &[u8], e: usize) -> i32 {
    let (j, l) = (e / 32, e % 32);
    let byte = wb[48 + 32 * (j / 2) + l];
    let lo = if j % 2 == 0 { byte & 0xf } else { byte >> 4 };
    let hi = (wb[16 + l] >> j) & 1;
    (lo | (hi << 4)) as i32
}

/// The 3-bit code plus 4 (0..8) of element `e` of a Q3_K block (hmask 0..32, qs 32..96):
/// group `g = e / 32` takes bits `2·(g % 4)` of `qs[32·(g / 4) + i]` and, as bit 2, bit `g`
/// of `hmask[i]` (set: no −4), `i = e % 32` (as `dequantize_row_q3_K`).
#[inline]
fn q3k_code(wb: &[u8], e: usize) -> i32 {
    let (g, i) = (e / 32, e % 32);
    let lo = (wb[32 + 32 * (g / 4) + i] >> (2 * (g % 4))) & 3;
    let hi = (wb[i] >> g) & 1;
    (lo | (hi << 2)) as i32
}

/// The 2-bit code (0..4) of element `e` of a Q2_K block (qs 16..80, laid out as Q3_K's).
#[inline]
fn q2k_code(wb: &[u8], e: usize) -> i32 {
    let (g, i) = (e / 32, e % 32);
    ((wb[16 + 32 * (g / 4) + i] >> (2 * (g % 4))) & 3) as i32
}

// ------------------------------------------------------------------------------------------
// Dispatch.

/// Dot products of one weight row against `R` activation rows (the tests' entry; products
/// check the rows once per task and call [`dot_fitted_rows`]).
#[cfg(test)]
fn dot_rows<const R: usize>(isa: Isa, ty: QuantType, w: &[u8], x: &[ActRow<'_>; R]) -> [f32; R] {
    assert!(
        x.iter().all(|x| row_fits(ty, w, x)),
        "qmatmul: activation rows do not fit the {ty} weight row"
    );
    // SAFETY: every row fits `w` (asserted above).
    unsafe { dot_fitted_rows(isa, ty, w, x) }
}

/// [`dot_rows`] for rows the caller has checked.
///
/// # Safety
/// Every row of `x` must fit `w` ([`row_fits`]): all the SIMD kernels read.
#[inline]
unsafe fn dot_fitted_rows<const R: usize>(
    isa: Isa,
    ty: QuantType,
    w: &[u8],
    x: &[ActRow<'_>; R],
) -> [f32; R] {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && super::kernels::avx2_fma_f16c() {
        // SAFETY: AVX2, FMA and F16C were just detected, and every row fits `w` (the
        // caller's contract).
        return unsafe { avx2::dot_rows::<R>(ty, w, x) };
    }
    let _ = isa;
    std::array::from_fn(|r| dot_ref(ty, w, x[r]))
}

/// `out[j] = dot(row j of rows, x)` for every weight row of `rows` (`row_bytes` each) against
/// one activation row: [`dot_fitted_rows`] for each row, with the kernel chosen once for the
/// run rather than per row (decode of one sequence, where a row of a narrow matrix costs
/// little more than the dispatch). The same bits.
///
/// # Safety
/// `x` must fit every row ([`row_fits`]); `rows` is `out.len()` rows of `row_bytes`.
unsafe fn dot_fitted_row_run(
    isa: Isa,
    ty: QuantType,
    rows: &[u8],
    row_bytes: usize,
    x: &[ActRow<'_>; 1],
    out: &mut [f32],
) {
    debug_assert_eq!(rows.len(), out.len() * row_bytes);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && super::kernels::avx2_fma_f16c() {
        // SAFETY: AVX2, FMA and F16C were just detected; the rows fit (the caller's contract).
        return unsafe { avx2::dot_row_run(ty, rows, row_bytes, x, out) };
    }
    for (w, o) in rows.chunks_exact(row_bytes).zip(out) {
        // SAFETY: the caller's contract.
        *o = unsafe { dot_fitted_rows::<1>(isa, ty, w, x) }[0];
    }
}

/// The eight rows of an interleaved Q4_K group ([`interleaved`]) against `R` activation rows.
///
/// # Safety
/// `group` is whole records and every row of `x` fits them (codes, `d` and `pairs` of every
/// super-block).
#[inline]
unsafe fn dot_group<const R: usize>(
    isa: Isa,
    group: &[u8],
    x: &[ActRow<'_>; R],
) -> [[f32; interleaved::GROUP_ROWS]; R] {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && super::kernels::avx2_fma_f16c() {
        if vnni() {
            // SAFETY: AVX2, FMA, F16C and AVX-512 F, BW, VNNI were detected; the rows fit
            // (the caller's contract).
            return unsafe { interleaved::avx512::dot_group::<R>(group, x) };
        }
        // SAFETY: AVX2, FMA and F16C were just detected; the rows fit (the caller's contract).
        return unsafe { interleaved::avx2::dot_group::<R>(group, x) };
    }
    let _ = isa;
    std::array::from_fn(|r| interleaved::dot_group_ref(group, x[r]))
}

#[cfg(target_arch = "x86_64")]
use super::kernels::avx512;

/// Whether the VNNI byte-product kernels may run (AVX-512 VNNI and VL detected, and the
/// 512-bit kernels allowed).
#[cfg(target_arch = "x86_64")]
fn vnni() -> bool {
    static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *YES.get_or_init(|| {
        avx512() && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl")
    })
}

/// Whether Q4_K, Q5_K and Q6_K products of many rows go through [`tiled`] (AVX-512 F, BW and VNNI
/// detected, and the 512-bit kernels allowed).
#[cfg(target_arch = "x86_64")]
fn tiled_kernels() -> bool {
    vnni() && TILED_ON.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether the tiled kernels may run where they can ([`set_tiled_kernels`]).
static TILED_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Allow or forbid the tiled prefill kernels (default: allowed). Results are bit-identical
/// either way; this exists so that kernel work can compare the two paths in one process
/// (`examples/qmatmul_speed.rs`), alternating, on a machine whose speed drifts.
pub fn set_tiled_kernels(on: bool) {
    TILED_ON.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// `out[i·n + j] = Σ_k x[i, k] · W[j, k]` for a quantized `W` (`n × k_dim`, `bytes` holding
/// `n` rows of `ty`).
pub fn qmatmul(x: &[f32], ty: QuantType, bytes: &[u8], n: usize, k_dim: usize, out: &mut [f32]) {
    qmatmul_multi(
        x,
        k_dim,
        &mut [QMat {
            ty,
            bytes,
            n,
            out,
            interleaved: false,
        }],
    );
}

/// One quantized matrix and its output for [`qmatmul_multi`].
pub struct QMat<'a> {
    pub ty: QuantType,
    /// The rows: in the file's layout, or (Q4_K with `interleaved`) in eights, as
    /// [`interleaved::interleave`] lays them out.
    pub bytes: &'a [u8],
    /// Whether `bytes` is the interleaved layout.
    pub interleaved: bool,
    /// Rows of the matrix.
    pub n: usize,
    /// `m × n` results.
    pub out: &'a mut [f32],
}

/// Several products of the same activations (an expert's gate and up): the activations are
/// quantized once and every matrix's rows are shared out in one parallel step. Each output
/// element is computed exactly as [`qmatmul`] computes it.
pub fn qmatmul_multi(x: &[f32], k_dim: usize, mats: &mut [QMat<'_>]) {
    qmatmul_groups(k_dim, &mut [QGroup { x, mats }]);
}

/// Activation rows and the quantized matrices that multiply them, for [`qmatmul_groups`].
pub struct QGroup<'x, 'm, 'q> {
    /// `m × k_dim` activations.
    pub x: &'x [f32],
    /// The matrices applied to `x`, each with its `m × n` output.
    pub mats: &'m mut [QMat<'q>],
}

/// Products of several activation sets, each with its own matrices (the gate and up of every
/// expert of a MoE layer): each set is quantized once and all the matrices' rows are shared
/// out in one parallel step, so a layer's experts cost one hand-off between threads instead of
/// one per expert. Each output element is computed exactly as [`qmatmul`] computes it (the
/// same activation rows grouped the same way against the same weight row), so grouping never
/// changes a bit. Matrices whose activation formats differ run one by one.
pub fn qmatmul_groups(k_dim: usize, groups: &mut [QGroup<'_, '_, '_>]) {
    assert!(k_dim > 0, "qmatmul: zero-length rows");
    for g in groups.iter() {
        assert!(
            g.x.len().is_multiple_of(k_dim),
            "qmatmul: x is not a whole number of rows"
        );
    }
    let mut formats = groups
        .iter()
        .flat_map(|g| g.mats.iter())
        .map(|q| act_format(q.ty));
    let format = formats.next().flatten();
    if !formats.all(|f| f == format) {
        for g in groups.iter_mut() {
            for q in g.mats.iter_mut() {
                qmatmul_groups(
                    k_dim,
                    &mut [QGroup {
                        x: g.x,
                        mats: std::slice::from_mut(q),
                    }],
                );
            }
        }
        return;
    }
    struct Job<'b> {
        ty: QuantType,
        bytes: &'b [u8],
        interleaved: bool,
        n: usize,
        row_bytes: usize,
        out: OutPtr,
        first_task: usize,
        group: usize,
    }
    let mut jobs = Vec::new();
    let mut tasks = 0;
    let mut work = 0;
    for (gi, g) in groups.iter_mut().enumerate() {
        let m = g.x.len() / k_dim;
        for q in g.mats.iter_mut() {
            assert_eq!(q.out.len(), m * q.n, "qmatmul: output has the wrong size");
            let row_bytes = q.ty.row_bytes(k_dim).expect("row length checked at load");
            let want = if q.interleaved {
                assert!(
                    q.ty == QuantType::Q4_K && interleaved::fits(q.n, k_dim),
                    "qmatmul: only Q4_K matrices of whole groups of eight rows are interleaved"
                );
                q.n / interleaved::GROUP_ROWS * (k_dim / QK_K) * interleaved::GROUP_BLOCK_BYTES
            } else {
                q.n * row_bytes
            };
            assert_eq!(
                q.bytes.len(),
                want,
                "qmatmul: weight bytes do not match the shape"
            );
            jobs.push(Job {
                ty: q.ty,
                bytes: q.bytes,
                interleaved: q.interleaved,
                n: q.n,
                row_bytes,
                out: OutPtr(q.out.as_mut_ptr()),
                first_task: tasks,
                group: gi,
            });
            tasks += q.n.div_ceil(ROWS_PER_TASK);
            work += m * q.n * k_dim;
        }
    }
    if jobs.is_empty() {
        return;
    }
    let xs: Vec<&[f32]> = groups.iter().map(|g| g.x).collect();
    let isa = Isa::detect();
    let job_of = |t: usize| {
        // Jobs are in task order: the last one starting at or before `t` owns it.
        let at = jobs.partition_point(|j| j.first_task <= t) - 1;
        (&jobs[at], t - jobs[at].first_task)
    };
    match format {
        Some(format) => {
            // Groups the tiled kernels take get their rows laid out in bands as well.
            #[cfg(target_arch = "x86_64")]
            let banded: Vec<bool> = groups
                .iter()
                .map(|g| {
                    tiled_kernels()
                        && g.x.len() / k_dim >= TILED_MIN_ROWS
                        && g.mats.iter().any(|q| tiled::takes(q.ty))
                })
                .collect();
            #[cfg(not(target_arch = "x86_64"))]
            let banded = vec![false; groups.len()];
            // Each set is quantized on its own (the same bits on any thread): in parallel when
            // there are several with many rows in all (a MoE layer's prefill), so its experts
            // are not prepared one by one; decode's few rows are not worth a hand-off.
            let prepare = |(x, banded): (&&[f32], &bool)| {
                let acts = QuantizedActs::quantize(format, x, k_dim);
                #[cfg(target_arch = "x86_64")]
                let bands = banded.then(|| tiled::Bands::new(&acts));
                #[cfg(not(target_arch = "x86_64"))]
                let bands: Option<()> = banded.then_some(());
                (acts, bands)
            };
            let rows: usize = xs.iter().map(|x| x.len() / k_dim).sum();
            let parallel =
                xs.len() > 1 && rows >= TILED_MIN_ROWS && rayon::current_num_threads() > 1;
            let prepared: Vec<_> = if parallel {
                xs.par_iter().zip(&banded).map(prepare).collect()
            } else {
                xs.iter().zip(&banded).map(prepare).collect()
            };
            let (acts, bands): (Vec<QuantizedActs>, Vec<_>) = prepared.into_iter().unzip();
            #[cfg(not(target_arch = "x86_64"))]
            let _ = bands;
            let act_rows: Vec<Vec<ActRow<'_>>> = xs
                .iter()
                .zip(&acts)
                .map(|(x, a)| (0..x.len() / k_dim).map(|i| a.row(i)).collect())
                .collect();
            // Activation rows are taken in chunks that stay in L1 while every weight row of
            // the task passes over them (otherwise each weight row re-streams all of them).
            let chunk = (X_CHUNK_BYTES / k_dim).max(1).div_ceil(ROW_GROUP) * ROW_GROUP;
            let run = |t: usize| {
                let (job, t) = job_of(t);
                let (ty, n) = (job.ty, job.n);
                let act_rows = &act_rows[job.group];
                let m = act_rows.len();
                let w_row = |j: usize| &job.bytes[j * job.row_bytes..(j + 1) * job.row_bytes];
                // SAFETY: every index i*n + j written has i < m and j < n, so it is inside the
                // job's output (asserted `m × n` above), and each (i, j) is written by exactly
                // one task (the one owning row j of this job).
                let put = |i: usize, j: usize, v: f32| unsafe { *job.out.get().add(i * n + j) = v };
                let (j0, j1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(n));
                #[cfg(target_arch = "x86_64")]
                if let (true, Some(bands)) = (tiled::takes(ty), &bands[job.group]) {
                    let mut tile = tiled::Tile::new(ty, k_dim / QK_K);
                    let mut lanes = [[0.0f32; tiled::BAND]; tiled::TILE];
                    for t0 in (j0..j1).step_by(tiled::TILE) {
                        let t1 = (t0 + tiled::TILE).min(j1);
                        if job.interleaved {
                            // t0 is a whole group (ROWS_PER_TASK and n are, checked above).
                            let gb = k_dim / QK_K * interleaved::GROUP_BLOCK_BYTES;
                            let g = t0 / interleaved::GROUP_ROWS;
                            tile.fill_records(&job.bytes[g * gb..(g + 1) * gb]);
                        } else {
                            tile.fill((t0..t1).map(w_row));
                        }
                        for q in 0..bands.bands() {
                            // SAFETY: `bands` exists only where `tiled_kernels` detected
                            // AVX-512 F, BW and VNNI.
                            unsafe { tiled::band(&tile, bands, q, &mut lanes) };
                            for (w, lane) in lanes[..t1 - t0].iter().enumerate() {
                                let i1 = (q * tiled::BAND + tiled::BAND).min(m);
                                for i in q * tiled::BAND..i1 {
                                    put(i, t0 + w, lane[i - q * tiled::BAND]);
                                }
                            }
                        }
                    }
                    return;
                }
                if job.interleaved {
                    // ROWS_PER_TASK and n are whole groups (checked above), so j0 and j1 are.
                    let group_bytes = k_dim / QK_K * interleaved::GROUP_BLOCK_BYTES;
                    assert!(
                        act_rows.iter().all(|x| x.qs.len() == k_dim
                            && x.d.len() * QK_K == k_dim
                            && x.pairs.len() * QK_K == 8 * k_dim),
                        "qmatmul: activation rows do not fit the Q4_K weight rows"
                    );
                    for g in j0 / interleaved::GROUP_ROWS..j1 / interleaved::GROUP_ROWS {
                        let group = &job.bytes[g * group_bytes..(g + 1) * group_bytes];
                        let j = g * interleaved::GROUP_ROWS;
                        let mut i = 0;
                        while i < m {
                            // GROUP_ACT_ROWS at a time, then two, then one.
                            macro_rules! rows_at_once {
                                ($r:expr) => {{
                                    let rows: &[ActRow<'_>; $r] =
                                        act_rows[i..i + $r].try_into().unwrap();
                                    // SAFETY: every activation row fits the group (asserted
                                    // above).
                                    let v = unsafe { dot_group::<{ $r }>(isa, group, rows) };
                                    for (r, v) in v.iter().enumerate() {
                                        for (w, &v) in v.iter().enumerate() {
                                            put(i + r, j + w, v);
                                        }
                                    }
                                    i += $r;
                                }};
                            }
                            match m - i {
                                GROUP_ACT_ROWS.. => rows_at_once!(GROUP_ACT_ROWS),
                                3 => rows_at_once!(3),
                                2 => rows_at_once!(2),
                                _ => rows_at_once!(1),
                            }
                        }
                    }
                    return;
                }
                // Every weight row of the job has the same length: the rows are checked once
                // here, not at every product.
                assert!(
                    act_rows.iter().all(|x| row_fits(ty, w_row(j0), x)),
                    "qmatmul: activation rows do not fit the {ty} weight row"
                );
                if m == 1 {
                    // SAFETY: row 0's outputs j0..j1 (j1 <= n) are this task's alone, inside
                    // the job's `1 × n` output.
                    let out =
                        unsafe { std::slice::from_raw_parts_mut(job.out.get().add(j0), j1 - j0) };
                    let rows = &job.bytes[j0 * job.row_bytes..j1 * job.row_bytes];
                    let one: &[ActRow<'_>; 1] = act_rows[..1].try_into().unwrap();
                    // SAFETY: the activation row fits every row of this job (asserted above).
                    unsafe { dot_fitted_row_run(isa, ty, rows, job.row_bytes, one, out) };
                    return;
                }
                let mut i0 = 0;
                while i0 < m {
                    let i1 = (i0 + chunk).min(m);
                    for j in j0..j1 {
                        let w = w_row(j);
                        let mut i = i0;
                        while i + ROW_GROUP <= i1 {
                            // Borrowed, not copied: an `ActRow` is five slices.
                            let rows = act_rows[i..i + ROW_GROUP].try_into().unwrap();
                            // SAFETY: every activation row fits a row of this job (asserted
                            // above).
                            let v = unsafe { dot_fitted_rows::<ROW_GROUP>(isa, ty, w, rows) };
                            for (r, v) in v.into_iter().enumerate() {
                                put(i + r, j, v);
                            }
                            i += ROW_GROUP;
                        }
                        // The last one to three rows together: a batch of sequences'
                        // decode routes a few rows to each expert, and three rows alone cost
                        // more than four together (the same bits either way).
                        macro_rules! rest {
                            ($r:expr) => {{
                                let rows = act_rows[i..i + $r].try_into().unwrap();
                                // SAFETY: as above.
                                let v = unsafe { dot_fitted_rows::<{ $r }>(isa, ty, w, rows) };
                                for (r, v) in v.into_iter().enumerate() {
                                    put(i + r, j, v);
                                }
                            }};
                        }
                        match i1 - i {
                            0 => {}
                            1 => rest!(1),
                            2 => rest!(2),
                            _ => rest!(3),
                        }
                    }
                    i0 = i1;
                }
            };
            par_tasks(tasks, work, run);
        }
        None => {
            let run = |t: usize| {
                let (job, t) = job_of(t);
                let (ty, n) = (job.ty, job.n);
                let x = xs[job.group];
                let m = x.len() / k_dim;
                // SAFETY: as above.
                let put = |i: usize, j: usize, v: f32| unsafe { *job.out.get().add(i * n + j) = v };
                let (j0, j1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(n));
                let mut wf = vec![0.0f32; k_dim];
                for j in j0..j1 {
                    let w = &job.bytes[j * job.row_bytes..(j + 1) * job.row_bytes];
                    if ty == QuantType::MXFP4 && m < MXFP4_DECODE_ROWS {
                        // Few rows: decode each block in registers (same bits, no row buffer).
                        for i in 0..m {
                            put(i, j, dot_mxfp4(isa, &x[i * k_dim..(i + 1) * k_dim], w));
                        }
                        continue;
                    }
                    dequantize_row(ty, w, &mut wf).expect("row length checked at load");
                    for i in 0..m {
                        put(
                            i,
                            j,
                            dot(isa, &x[i * k_dim..(i + 1) * k_dim], WeightData::F32(&wf)),
                        );
                    }
                }
            };
            par_tasks(tasks, work, run);
        }
    }
}

/// `out = x·Wᵀ` for any weight the view can turn into f32 rows (FP8 with block scales): each
/// weight row is dequantized once per task and dotted with every activation row by the f32
/// kernel, so results keep the canonical f32 order (identical to a checkpoint holding the
/// dequantized values).
pub fn dequantized_matmul(x: &[f32], w: &super::WeightView<'_>, out: &mut [f32]) {
    let (n, k_dim) = (w.rows, w.cols);
    let m = x.len() / k_dim;
    assert_eq!(out.len(), m * n, "matmul: output has the wrong size");
    let isa = Isa::detect();
    let ptr = OutPtr(out.as_mut_ptr());
    // SAFETY: as in `qmatmul`: disjoint (i, j) per task, all inside `out`.
    let put = |i: usize, j: usize, v: f32| unsafe { *ptr.get().add(i * n + j) = v };
    let run = |t: usize| {
        let (j0, j1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(n));
        let mut wf = vec![0.0f32; k_dim];
        for j in j0..j1 {
            w.row_to_f32(j, &mut wf);
            for i in 0..m {
                put(
                    i,
                    j,
                    dot(isa, &x[i * k_dim..(i + 1) * k_dim], WeightData::F32(&wf)),
                );
            }
        }
    };
    par_tasks(n.div_ceil(ROWS_PER_TASK), m * n * k_dim, run);
}

fn par_tasks(tasks: usize, work: usize, run: impl Fn(usize) + Sync + Send) {
    if work < 32 * 1024 || rayon::current_num_threads() == 1 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod avx2 {
    //! AVX2 integer parts of the kernels. Integer sums are exact, so only the float steps
    //! need to follow the scalar reference, and they do so lane for lane.
    //!
    //! Memory safety: the kernels read weight row `w` and activation rows `x` only within the
    //! ranges [`row_fits`](super::row_fits) describes, which their callers guarantee (the
    //! dispatch asserts it). The register-only helpers are safe `#[target_feature]` functions,
    //! so the compiler checks that only code with those features calls them.

    use std::arch::x86_64::*;

    use super::{f16_le, fold8, ActRow, BlockIq4Xs, QuantType, KVALUES_IQ4NL, QK32, QK_K};

    /// The address `off` bytes past `p`, for a prefetch hint. The kernels prefetch a few
    /// blocks ahead, which near the end of a row lies past the row, and for the last row of a
    /// matrix past the end of its allocation: the address is formed with `wrapping_add`,
    /// which is defined for any offset (`add` there is undefined behaviour even though the
    /// address is never read).
    #[inline(always)]
    pub(super) const fn prefetch_addr(p: *const u8, off: usize) -> *const i8 {
        p.wrapping_add(off).cast()
    }

    // Checked by the compiler: constant evaluation rejects pointer arithmetic out of bounds of
    // an allocation ("in-bounds pointer arithmetic failed") as the undefined behaviour it is,
    // so this fails to build if `prefetch_addr` ever uses `ptr::add` again. The offsets are
    // of the sizes the kernels use (two Q4_K blocks ahead, as the AVX2 interleaved records
    // ask, sixteen Q8_0 blocks, and the row kernels' farthest lines), from the last block of an
    // exactly-sized row, and one that wraps the address space.
    const _: () = {
        let row = [0u8; 144];
        let _ = prefetch_addr(row.as_ptr(), 2 * 144 + 128);
        let q8 = [0u8; 8 * 34];
        let _ = prefetch_addr(q8.as_ptr(), 16 * 34 + 256);
        let _ = prefetch_addr(q8.as_ptr(), super::prefetch::MAX_ROW_BYTES_AHEAD + 64 * 4);
        let _ = prefetch_addr(row.as_ptr(), usize::MAX);
    };

    /// Hint that the cache line `off` bytes past `p` will be read soon (any address).
    #[inline(always)]
    pub(super) fn prefetch(p: *const u8, off: usize) {
        // SAFETY: a prefetch is only a hint: it reads nothing the program can observe and
        // never faults, whatever the address (and SSE, which has it, is baseline on x86_64).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(prefetch_addr(p, off)) }
    }

    /// Prefetch the cache lines of the `bytes` that start this CPU's row distance
    /// ([`prefetch::row_bytes_ahead`](super::prefetch::row_bytes_ahead)) past `p` (a kernel
    /// calls it once per `bytes` it steps, so the prefetched span is contiguous).
    #[inline(always)]
    pub(super) fn prefetch_ahead(p: *const u8, bytes: usize) {
        let ahead = super::prefetch::row_bytes_ahead();
        for line in 0..bytes.div_ceil(64) {
            prefetch(p, ahead + 64 * line);
        }
    }

    /// Sum of i8·i8 products of 32 bytes as 8 i32 lanes, with `|w|` already computed.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn mul_i8_abs(aw: __m256i, w: __m256i, x: __m256i) -> __m256i {
        let sy = _mm256_sign_epi8(x, w);
        _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sy), _mm256_set1_epi16(1))
    }

    /// Sum of u8·i8 products of 32 bytes, as 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn mul_u8(w: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
    }

    /// Lane `b` = the sum of the eight lanes of `v[b]`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn transpose_sum(v: &[__m256i; 8]) -> __m256i {
        let t0 = _mm256_hadd_epi32(v[0], v[1]);
        let t1 = _mm256_hadd_epi32(v[2], v[3]);
        let t2 = _mm256_hadd_epi32(v[4], v[5]);
        let t3 = _mm256_hadd_epi32(v[6], v[7]);
        let u0 = _mm256_hadd_epi32(t0, t1);
        let u1 = _mm256_hadd_epi32(t2, t3);
        let lo = _mm256_permute2x128_si256(u0, u1, 0x20);
        let hi = _mm256_permute2x128_si256(u0, u1, 0x31);
        _mm256_add_epi32(lo, hi)
    }

    /// The 32 weight codes of a 32-element block as bytes (signed for Q8_0/Q4_0/Q5_0/IQ4_NL,
    /// unsigned for Q4_1/Q5_1).
    ///
    /// # Safety
    /// `wb` must point to a whole block of `ty` (`ty.block_bytes()` readable bytes).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn codes32(ty: QuantType, wb: *const u8) -> __m256i {
        if ty == QuantType::Q8_0 {
            // SAFETY: bytes 2..34 of a 34-byte Q8_0 block.
            return unsafe { _mm256_loadu_si256(wb.add(2) as *const __m256i) };
        }
        // Where the 16 bytes of nibbles start.
        let off = match ty {
            QuantType::Q4_0 | QuantType::IQ4_NL => 2,
            QuantType::Q4_1 => 4,
            QuantType::Q5_0 => 6,
            _ => 8,
        };
        // SAFETY: bytes 2..18 of an 18-byte Q4_0 or IQ4_NL block, 4..20 of a 20-byte Q4_1
        // block, 6..22 of a 22-byte Q5_0 block or 8..24 of a 24-byte Q5_1 block.
        let packed = unsafe { _mm_loadu_si128(wb.add(off) as *const __m128i) };
        let m = _mm_set1_epi8(0xf);
        let lo = _mm_and_si128(packed, m);
        let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), m);
        let v = _mm256_set_m128i(hi, lo);
        match ty {
            QuantType::Q4_0 => _mm256_sub_epi8(v, _mm256_set1_epi8(8)),
            QuantType::Q4_1 => v,
            QuantType::IQ4_NL => {
                // SAFETY: the 16 bytes of the 16-entry i8 table.
                let kv = unsafe { _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i) };
                _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(kv), v)
            }
            _ => {
                // SAFETY: the four bytes of `qh` just before the nibbles (2..6 of a Q5_0
                // block, 4..8 of a Q5_1 block), no alignment needed.
                let qh = unsafe { (wb.add(off - 4) as *const u32).read_unaligned() };
                let v = _mm256_or_si256(v, _mm256_and_si256(bits32(qh), _mm256_set1_epi8(0x10)));
                if ty == QuantType::Q5_0 {
                    _mm256_sub_epi8(v, _mm256_set1_epi8(16))
                } else {
                    v
                }
            }
        }
    }

    /// Byte `i` of the result is 0xff where bit `i` of `bits` is set, else 0.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn bits32(bits: u32) -> __m256i {
        // Byte i gets byte i / 8 of `bits`, all its bits but bit i % 8 then set.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            ),
        );
        let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
        _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1))
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available; every activation row must fit `w`
    /// ([`row_fits`](super::row_fits)).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows<const R: usize>(
        ty: QuantType,
        w: &[u8],
        x: &[ActRow<'_>; R],
    ) -> [f32; R] {
        let wide = super::avx512();
        // SAFETY: the caller's contract; `wide` only where `avx512` detected AVX-512 F and BW.
        unsafe { dot_rows_with::<R>(ty, w, x, wide) }
    }

    /// [`dot_rows`], with the 512-bit kernels only if `wide`.
    ///
    /// # Safety
    /// As [`dot_rows`]; with `wide`, AVX-512 F and BW must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_rows_with<const R: usize>(
        ty: QuantType,
        w: &[u8],
        x: &[ActRow<'_>; R],
        wide: bool,
    ) -> [f32; R] {
        match ty {
            QuantType::Q8_0
            | QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::IQ4_NL => {
                let vnni = wide && super::vnni();
                // SAFETY: the caller's contract is the kernel's; VNNI only where `vnni`
                // detected AVX-512 F, BW, VL and VNNI.
                unsafe { dot32::<R>(ty, w, x, vnni) }
            }
            // SAFETY: the caller's contract (AVX-512 F and BW with `wide`) is the kernel's.
            QuantType::Q4_K if wide => unsafe { dot_q45k_512::<R, false>(w, x) },
            // SAFETY: the caller's contract is the kernel's.
            QuantType::Q4_K => unsafe { dot_q4k::<R>(w, x) },
            // SAFETY: the caller's contract (AVX-512 F and BW with `wide`) is the kernel's.
            QuantType::Q6_K if wide => unsafe { dot_k16_512::<R, K16_Q6K>(w, x) },
            // SAFETY: the caller's contract is the kernel's.
            QuantType::Q6_K => unsafe { dot_q6k::<R>(w, x) },
            // SAFETY: the caller's contract (AVX-512 F and BW with `wide`) is the kernel's.
            QuantType::Q5_K if wide => unsafe { dot_q45k_512::<R, true>(w, x) },
            // SAFETY: the caller's contract is each kernel's.
            QuantType::Q5_K => unsafe { dot_k::<R, 0>(w, x) },
            // SAFETY: as above.
            QuantType::IQ4_XS => unsafe { dot_k::<R, 1>(w, x) },
            // SAFETY: the caller's contract (AVX-512 F and BW with `wide`) is the kernel's.
            QuantType::Q3_K if wide => unsafe { dot_k16_512::<R, K16_Q3K>(w, x) },
            // SAFETY: as above.
            QuantType::Q3_K => unsafe { dot_k::<R, 2>(w, x) },
            // SAFETY: the caller's contract (AVX-512 F and BW with `wide`) is the kernel's.
            QuantType::Q2_K if wide => unsafe { dot_k16_512::<R, K16_Q2K>(w, x) },
            // SAFETY: as above.
            QuantType::Q2_K => unsafe { dot_k::<R, 3>(w, x) },
            _ => unreachable!("no integer kernel for {ty}"),
        }
    }

    /// [`dot_fitted_row_run`](super::dot_fitted_row_run) on AVX2: the kernel is chosen once,
    /// and the loop over the rows runs inside a function with the kernel's own features, so
    /// the kernel can be inlined into it.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `x` fits every row of `rows` (`row_bytes` each,
    /// `out.len()` of them).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_row_run(
        ty: QuantType,
        rows: &[u8],
        row_bytes: usize,
        x: &[ActRow<'_>; 1],
        out: &mut [f32],
    ) {
        let wide = super::avx512();
        let vnni = wide && super::vnni();
        use QuantType::*;
        // SAFETY: the caller's contract is each kernel's; the VNNI loops run only where `vnni`
        // detected AVX-512 F, BW, VL and VNNI, and `dot_rows_with` takes its 512-bit kernels
        // only where `wide` detected AVX-512 F and BW. (The K-quants keep `dot_rows_with` per
        // row: a loop calling their 512-bit kernels through a pointer streamed Q4_K rows from
        // memory 8-10 % slower in `qmatmul_speed`.)
        unsafe {
            match (ty, vnni) {
                (Q8_0, true) => run32_vnni::<0>(rows, row_bytes, x, out),
                (Q4_0, true) => run32_vnni::<1>(rows, row_bytes, x, out),
                (Q4_1, true) => run32_vnni::<2>(rows, row_bytes, x, out),
                (Q5_0, true) => run32_vnni::<3>(rows, row_bytes, x, out),
                (Q5_1, true) => run32_vnni::<4>(rows, row_bytes, x, out),
                (IQ4_NL, true) => run32_vnni::<5>(rows, row_bytes, x, out),
                (Q8_0, false) => run32::<0>(rows, row_bytes, x, out),
                (Q4_0, false) => run32::<1>(rows, row_bytes, x, out),
                (Q4_1, false) => run32::<2>(rows, row_bytes, x, out),
                (Q5_0, false) => run32::<3>(rows, row_bytes, x, out),
                (Q5_1, false) => run32::<4>(rows, row_bytes, x, out),
                (IQ4_NL, false) => run32::<5>(rows, row_bytes, x, out),
                _ => {
                    for (w, o) in rows.chunks_exact(row_bytes).zip(out) {
                        *o = dot_rows_with::<1>(ty, w, x, wide)[0];
                    }
                }
            }
        }
    }

    /// Defines a loop over every row against `x` by one 32-element kernel of format `T`,
    /// compiled with that kernel's features so it can be inlined.
    ///
    /// Safety of the generated functions: as [`dot_row_run`], with the features they enable.
    macro_rules! row_run {
        ($(#[$attr:meta])* $name:ident, $kernel:ident) => {
            $(#[$attr])*
            unsafe fn $name<const T: u8>(
                rows: &[u8],
                row_bytes: usize,
                x: &[ActRow<'_>; 1],
                out: &mut [f32],
            ) {
                for (w, o) in rows.chunks_exact(row_bytes).zip(out) {
                    // SAFETY: the caller's contract.
                    *o = unsafe { $kernel::<1, T>(w, x) }[0];
                }
            }
        };
    }

    row_run!(
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
        run32_vnni,
        dot32_t_vnni
    );

    row_run!(
        #[target_feature(enable = "avx2,fma,f16c")]
        run32,
        dot32_t
    );

    /// # Safety
    /// As [`dot_rows`]; with `vnni`, AVX-512 F, VL and VNNI must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot32<const R: usize>(
        ty: QuantType,
        w: &[u8],
        x: &[ActRow<'_>; R],
        vnni: bool,
    ) -> [f32; R] {
        // SAFETY: the caller's contract (features, rows fitting `w`, VNNI where `vnni`) is
        // each kernel's.
        unsafe {
            match (ty, vnni) {
                (QuantType::Q8_0, false) => dot32_t::<R, 0>(w, x),
                (QuantType::Q4_0, false) => dot32_t::<R, 1>(w, x),
                (QuantType::Q4_1, false) => dot32_t::<R, 2>(w, x),
                (QuantType::Q5_0, false) => dot32_t::<R, 3>(w, x),
                (QuantType::Q5_1, false) => dot32_t::<R, 4>(w, x),
                (_, false) => dot32_t::<R, 5>(w, x),
                (QuantType::Q8_0, true) => dot32_t_vnni::<R, 0>(w, x),
                (QuantType::Q4_0, true) => dot32_t_vnni::<R, 1>(w, x),
                (QuantType::Q4_1, true) => dot32_t_vnni::<R, 2>(w, x),
                (QuantType::Q5_0, true) => dot32_t_vnni::<R, 3>(w, x),
                (QuantType::Q5_1, true) => dot32_t_vnni::<R, 4>(w, x),
                (_, true) => dot32_t_vnni::<R, 5>(w, x),
            }
        }
    }

    /// Eight f16 values at `p`, `p + stride`, ... as f32.
    ///
    /// # Safety
    /// The two bytes at `p + k·stride` must be readable for each `k < 8`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn f16x8(p: *const u8, stride: usize) -> __m256 {
        // SAFETY: readable by the caller's contract (`read_unaligned`: no alignment needed).
        let h = |k: usize| unsafe { (p.add(k * stride) as *const u16).read_unaligned() } as i16;
        _mm256_cvtph_ps(_mm_setr_epi16(
            h(0),
            h(1),
            h(2),
            h(3),
            h(4),
            h(5),
            h(6),
            h(7),
        ))
    }

    /// Defines a 32-element kernel for one format (`T` = 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q5_0,
    /// 4 Q5_1, 5 IQ4_NL) with the
    /// given byte-product steps; the integer sums, and so the results, are the same for all.
    ///
    /// Safety of the generated functions: as [`dot_rows`], with the features they enable.
    /// With `nb` blocks in `w`, every block index `b0 + k` read below is `< nb`, so weight
    /// bytes `(b0 + k)·bb..(b0 + k + 1)·bb`, activation codes `(b0 + k)·32..+32` and scales
    /// (and Q4_1/Q5_1 sums) `b0..b0 + 8` or `b0 + k` are inside `w` and the row fitting it.
    macro_rules! dot32_kernel {
        ($(#[$attr:meta])* $name:ident, $mul_abs:ident, $mul_u8:ident $(,)?) => {
            $(#[$attr])*
            unsafe fn $name<const R: usize, const T: u8>(w: &[u8], x: &[ActRow<'_>; R]) -> [f32; R] {
            let ty = match T {
                0 => QuantType::Q8_0,
                1 => QuantType::Q4_0,
                2 => QuantType::Q4_1,
                3 => QuantType::Q5_0,
                4 => QuantType::Q5_1,
                _ => QuantType::IQ4_NL,
            };
            // Q4_1 and Q5_1 have unsigned codes and a min.
            let signed = T != 2 && T != 4;
            let bb = ty.block_bytes();
            let nb = w.len() / bb;
            let full = nb / 8 * 8;
            let mut acc = [_mm256_setzero_ps(); R];
            let mut b0 = 0;
            while b0 < full {
                // SAFETY: b0 < full <= nb, so the offset is inside `w`.
                let wp = unsafe { w.as_ptr().add(b0 * bb) };
                // The row distance ahead (`prefetch::row_bytes_ahead`): past the row's end for its last groups.
                prefetch_ahead(wp, 8 * bb);
                let mut codes = [_mm256_setzero_si256(); 8];
                let mut abs = [_mm256_setzero_si256(); 8];
                for k in 0..8 {
                    // SAFETY: block b0 + k < full <= nb is whole inside `w`.
                    codes[k] = unsafe { codes32(ty, wp.add(k * bb)) };
                    if signed {
                        abs[k] = _mm256_sign_epi8(codes[k], codes[k]);
                    }
                }
                // SAFETY: the f16 scale (bytes 0..2) of blocks b0..b0 + 8, all inside `w`.
                let dw = unsafe { f16x8(wp, bb) };
                let mw = if signed {
                    _mm256_setzero_ps()
                } else {
                    // SAFETY: the Q4_1/Q5_1 f16 min (bytes 2..4) of blocks b0..b0 + 8, inside `w`.
                    unsafe { f16x8(wp.add(2), bb) }
                };
                for r in 0..R {
                    let xr = x[r];
                    // SAFETY: the row fits `w`: codes (b0 + k)·32..+32 for k < 8 and scales
                    // (and Q4_1/Q5_1 sums) b0..b0 + 8 lie inside it, as b0 + 8 <= full <= nb.
                    unsafe {
                        let xq = xr.qs.as_ptr().add(b0 * QK32);
                        let mut prods = [_mm256_setzero_si256(); 8];
                        for k in 0..8 {
                            let xv = _mm256_loadu_si256(xq.add(k * QK32) as *const __m256i);
                            prods[k] = if signed {
                                $mul_abs(abs[k], codes[k], xv)
                            } else {
                                $mul_u8(codes[k], xv)
                            };
                        }
                        let isums = _mm256_cvtepi32_ps(transpose_sum(&prods));
                        let s = _mm256_mul_ps(dw, _mm256_loadu_ps(xr.d.as_ptr().add(b0)));
                        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s, isums));
                        if !signed {
                            let m = _mm256_mul_ps(mw, _mm256_loadu_ps(xr.sums.as_ptr().add(b0)));
                            acc[r] = _mm256_add_ps(acc[r], m);
                        }
                    }
                }
                b0 += 8;
            }
            if b0 < nb {
                // Tail of fewer than 8 blocks: the missing blocks' lanes get exact zeros
                // (`0 · 0`, as in the reference), and the activation scales and sums of the
                // blocks that are there come in through a masked load (the lanes past the
                // row's last block are neither read nor faulted on).
                let nblk = nb - b0;
                let mut codes = [_mm256_setzero_si256(); 8];
                let mut dw = [0.0f32; 8];
                let mut mw = [0.0f32; 8];
                for k in 0..nblk {
                    let blk = &w[(b0 + k) * bb..(b0 + k + 1) * bb];
                    // SAFETY: `blk` is one whole block.
                    codes[k] = unsafe { codes32(ty, blk.as_ptr()) };
                    dw[k] = f16_le(blk, 0);
                    if !signed {
                        mw[k] = f16_le(blk, 2);
                    }
                }
                let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let present = _mm256_cmpgt_epi32(_mm256_set1_epi32(nblk as i32), lane);
                // SAFETY: `dw` and `mw` are arrays of 8 f32.
                let (dw, mw) = unsafe { (_mm256_loadu_ps(dw.as_ptr()), _mm256_loadu_ps(mw.as_ptr())) };
                for r in 0..R {
                    let xr = x[r];
                    let mut prods = [_mm256_setzero_si256(); 8];
                    for k in 0..nblk {
                        // SAFETY: the row fits `w`, so codes (b0 + k)·32..+32 of block
                        // b0 + k < nb are inside it.
                        let xv = unsafe {
                            _mm256_loadu_si256(xr.qs.as_ptr().add((b0 + k) * QK32) as *const __m256i)
                        };
                        prods[k] = if signed {
                            $mul_abs(_mm256_sign_epi8(codes[k], codes[k]), codes[k], xv)
                        } else {
                            $mul_u8(codes[k], xv)
                        };
                    }
                    let isums = _mm256_cvtepi32_ps(transpose_sum(&prods));
                    // SAFETY: the row fits `w`, so its scales (and sums) b0..nb exist and
                    // b0 < nb: the pointer is inside the slice, and the mask reads only lanes
                    // k < nblk, i.e. b0 + k < nb.
                    let xd = unsafe { _mm256_maskload_ps(xr.d.as_ptr().add(b0), present) };
                    let p = _mm256_mul_ps(_mm256_mul_ps(dw, xd), isums);
                    acc[r] = _mm256_add_ps(acc[r], p);
                    if !signed {
                        // SAFETY: as for `xd`.
                        let xs = unsafe { _mm256_maskload_ps(xr.sums.as_ptr().add(b0), present) };
                        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(mw, xs));
                    }
                }
            }
            fold_rows(acc)
        }
        };
    }

    dot32_kernel!(
        #[target_feature(enable = "avx2,fma,f16c")]
        dot32_t,
        mul_i8_abs,
        mul_u8,
    );

    dot32_kernel!(
        /// With AVX-512 VNNI: `vpdpbusd` does the byte products and their sums in one step.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
        dot32_t_vnni,
        mul_i8_abs_vnni,
        mul_u8_vnni,
    );

    /// [`mul_i8_abs`] with VNNI.
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    fn mul_i8_abs_vnni(aw: __m256i, w: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, _mm256_sign_epi8(x, w))
    }

    /// [`mul_u8`] with VNNI.
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    fn mul_u8_vnni(w: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
    }

    /// A Q4_K super-block's eight 6-bit scales (bytes 0..8) and mins (8..16), unpacked with word
    /// operations (the layout of `get_scale_min_k4`), and the mins as i32 lanes in the order
    /// `hadd` pairs the 16 sums: [0+1, 2+3, 8+9, 10+11, 4+5, 6+7, 12+13, 14+15].
    #[inline]
    #[target_feature(enable = "avx2")]
    fn q4k_scales_mins(wb: &[u8]) -> ([u8; 16], __m256i) {
        // The 12 scale bytes 4..16, as three little-endian words (as `read_unaligned` of
        // u32 on x86_64).
        let word = |i: usize| u32::from_le_bytes(wb[4 + 4 * i..8 + 4 * i].try_into().unwrap());
        let (q0, q1, q2) = (word(0), word(1), word(2));
        const K1: u32 = 0x3f3f_3f3f;
        const K2: u32 = 0x0f0f_0f0f;
        const K3: u32 = 0x0303_0303;
        let u: [u32; 4] = [
            q0 & K1,
            (q2 & K2) | (((q0 >> 6) & K3) << 4),
            q1 & K1,
            ((q2 >> 4) & K2) | (((q1 >> 6) & K3) << 4),
        ];
        let ub: [u8; 16] = bytemuck::cast(u);
        // SAFETY: bytes 8..16 of the 16-byte array `ub`.
        let mins8 = unsafe { _mm_loadl_epi64(ub.as_ptr().add(8) as *const __m128i) };
        let mins = _mm256_cvtepu8_epi32(mins8);
        let mv = _mm256_permutevar8x32_epi32(mins, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
        (ub, mv)
    }

    /// Each i32 lane `v` (a value that fits i16) as the i16 pair `(v, v)`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn i16_pairs(v: __m256i) -> __m256i {
        _mm256_or_si256(
            _mm256_and_si256(v, _mm256_set1_epi32(0xffff)),
            _mm256_slli_epi32(v, 16),
        )
    }

    /// Vector `j`: every i16 lane holds lane `j` of `v` (eight i32 lanes that fit i16), the
    /// scale vectors `madd` takes for a 32-element group with one scale.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn broadcast_i16_pairs(v: __m256i) -> [__m256i; 8] {
        let p = i16_pairs(v);
        std::array::from_fn(|j| _mm256_permutevar8x32_epi32(p, _mm256_set1_epi32(j as i32)))
    }

    /// Vector `k`: i16 lanes of the low 128 bits hold lane `2k` of `v`, of the high 128 bits
    /// lane `2k + 1` (eight i32 lanes that fit i16): the scale vectors `madd` takes for a
    /// 32-element group with one scale per 16 elements.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn quarter_pairs(v: __m256i) -> [__m256i; 4] {
        let p = i16_pairs(v);
        std::array::from_fn(|k| {
            let (a, c) = (2 * k as i32, 2 * k as i32 + 1);
            _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(a, a, a, a, c, c, c, c))
        })
    }

    /// # Safety
    /// As [`dot_rows`]. `w` is `nb` whole blocks (`chunks_exact`), and the row fits
    /// `w`: codes `b·256..+256`, `pairs[b·8..+8]` and `d[b]` exist for every block `b < nb`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q4k<const R: usize>(w: &[u8], x: &[ActRow<'_>; R]) -> [f32; R] {
        let bb = QuantType::Q4_K.block_bytes();
        let mut acc = [_mm256_setzero_ps(); R];
        let m4 = _mm256_set1_epi8(0xf);
        for (b, wb) in w.chunks_exact(bb).enumerate() {
            // The row distance ahead (`prefetch::row_bytes_ahead`): past the row's end for its last blocks.
            prefetch_ahead(wb.as_ptr(), bb);
            let (ub, mv) = q4k_scales_mins(wb);
            // SAFETY: bytes 0..8 of the 16-byte array `ub` (the scales).
            let sc8 = unsafe { _mm_loadl_epi64(ub.as_ptr() as *const __m128i) };
            let scv = broadcast_i16_pairs(_mm256_cvtepu8_epi32(sc8));
            let mut nib = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                // SAFETY: bytes 16 + 32c..48 + 32c (at most 144) of the 144-byte block.
                let q =
                    unsafe { _mm256_loadu_si256(wb.as_ptr().add(16 + 32 * c) as *const __m256i) };
                nib[2 * c] = _mm256_and_si256(q, m4);
                nib[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            }
            // SAFETY: bytes 0..4 of the block (d and dmin), no alignment needed.
            let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe {
                (wb.as_ptr() as *const i32).read_unaligned()
            }));
            let (d, dmin) = (_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 1)));
            for r in 0..R {
                let xr = x[r];
                // SAFETY: the row fits `w` and b < nb: codes b·256..+256, pairs b·8..+8 and
                // d[b] are inside it.
                let (sum, pairs, xd) = unsafe {
                    let y = xr.qs.as_ptr().add(b * QK_K);
                    let mut sum = _mm256_setzero_si256();
                    for j in 0..8 {
                        let yv = _mm256_loadu_si256(y.add(32 * j) as *const __m256i);
                        let p16 = _mm256_maddubs_epi16(nib[j], yv);
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, scv[j]));
                    }
                    let pairs = _mm256_loadu_si256(xr.pairs.as_ptr().add(b * 8) as *const __m256i);
                    (sum, pairs, *xr.d.get_unchecked(b))
                };
                let summ = _mm256_mullo_epi32(pairs, mv);
                let t1 = _mm256_mul_ps(_mm256_set1_ps(d * xd), _mm256_cvtepi32_ps(sum));
                let t2 = _mm256_mul_ps(_mm256_set1_ps(dmin * xd), _mm256_cvtepi32_ps(summ));
                acc[r] = _mm256_add_ps(acc[r], _mm256_sub_ps(t1, t2));
            }
        }
        fold_rows(acc)
    }

    /// Byte-shuffle controls (`vpshufb`, within each 128-bit lane) that spread a block's i16
    /// scales over the 512-bit scale registers of the kernels: in vector `k`, i16 lane `l`
    /// takes scale `s = (32 / span)·k + l / span`, each scale covering `span` i16 lanes
    /// (`2·span` bytes of codes), from a register holding scales `8·(s / 8)..+8` in every
    /// 128-bit lane. An in-lane shuffle of a broadcast, not a cross-lane `vpermw`: the same
    /// vectors for fewer micro-operations.
    const fn scale_spread(span: usize) -> [[u8; 64]; 4] {
        let mut t = [[0u8; 64]; 4];
        let mut k = 0;
        while k < 4 {
            let mut byte = 0;
            while byte < 64 {
                let s = 32 / span * k + byte / 2 / span;
                t[k][byte] = (2 * (s % 8) + byte % 2) as u8;
                byte += 1;
            }
            k += 1;
        }
        t
    }

    /// For [`dot_q45k_512`]'s `scv[k]`: groups `2k` and `2k + 1`, one scale per 32 codes.
    const Q4K_HALVES: [[u8; 64]; 4] = scale_spread(16);

    /// For [`k16_block_512`]'s `zs[k]`: quarters `4k..4k + 4`, one scale per 16 codes (scales
    /// 0..8 for `k < 2`, 8..16 for `k ≥ 2`).
    const Q6K_QUARTERS: [[u8; 64]; 4] = scale_spread(8);

    /// [`dot_q4k`] with 512-bit integer steps (two 32-element groups per instruction); the
    /// eight-lane integer sums, and so the results, are identical. With `Q5`, the same for
    /// Q5_K (its float steps are Q4_K's): bit `j` of `qh[l]` (bytes 16..48) is added to code
    /// `32j + l` as 16 before the products, whose pairs (`2·31·127`) still fit i16.
    ///
    /// # Safety
    /// As [`dot_q4k`] (`w` whole Q5_K blocks with `Q5`), and AVX-512 F and BW must be
    /// available.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
    unsafe fn dot_q45k_512<const R: usize, const Q5: bool>(
        w: &[u8],
        x: &[ActRow<'_>; R],
    ) -> [f32; R] {
        let ty = if Q5 { QuantType::Q5_K } else { QuantType::Q4_K };
        let bb = ty.block_bytes();
        // Where the 128 bytes of nibbles start.
        let qs_at = if Q5 { 48 } else { 16 };
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, wb) in w.chunks_exact(bb).enumerate() {
            // The row distance ahead (`prefetch::row_bytes_ahead`): past the row's end for its last blocks.
            prefetch_ahead(wb.as_ptr(), bb);
            let (ub, mv) = q4k_scales_mins(wb);
            // SAFETY: bytes 0..8 of the 16-byte array `ub` (the scales).
            let sc8 = unsafe { _mm_loadl_epi64(ub.as_ptr() as *const __m128i) };
            let sc16 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sc8));
            let mut scv = [_mm512_setzero_si512(); 4];
            for k in 0..4 {
                // SAFETY: the 64 bytes of one row of the table.
                let ctl = unsafe { _mm512_loadu_si512(Q4K_HALVES[k].as_ptr() as *const __m512i) };
                scv[k] = _mm512_shuffle_epi8(sc16, ctl);
            }
            // Groups (2k, 2k + 1) side by side: the low nibbles of chunk k, then its high ones.
            let m4z = _mm512_set1_epi8(0xf);
            let mut nib = [_mm512_setzero_si512(); 4];
            for h in 0..2 {
                // SAFETY: bytes qs_at + 64h..+64 (at most 144 of Q4_K's 144-byte block, 176 of
                // Q5_K's 176).
                let q = unsafe {
                    _mm512_loadu_si512(wb.as_ptr().add(qs_at + 64 * h) as *const __m512i)
                };
                let lo = _mm512_and_si512(q, m4z);
                let hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4z);
                nib[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);
                nib[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);
            }
            if Q5 {
                // SAFETY: bytes 16..48 of the 176-byte block (qh).
                let qh = unsafe { _mm256_loadu_si256(wb.as_ptr().add(16) as *const __m256i) };
                nib = add_group_bits(nib, _mm512_broadcast_i64x4(qh), 16);
            }
            // SAFETY: bytes 0..4 of the block (d and dmin), no alignment needed.
            let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(unsafe {
                (wb.as_ptr() as *const i32).read_unaligned()
            }));
            let (d, dmin) = (_mm_cvtss_f32(dd), _mm_cvtss_f32(_mm_shuffle_ps(dd, dd, 1)));
            for r in 0..R {
                let xr = x[r];
                // SAFETY: the row fits `w` and b < nb: codes b·256..+256, pairs b·8..+8 and
                // d[b] are inside it.
                let (sum5, pairs, xd) = unsafe {
                    let y = xr.qs.as_ptr().add(b * QK_K);
                    let mut sum5 = _mm512_setzero_si512();
                    for k in 0..4 {
                        let yv = _mm512_loadu_si512(y.add(64 * k) as *const __m512i);
                        let p16 = _mm512_maddubs_epi16(nib[k], yv);
                        sum5 = _mm512_add_epi32(sum5, _mm512_madd_epi16(p16, scv[k]));
                    }
                    let pairs = _mm256_loadu_si256(xr.pairs.as_ptr().add(b * 8) as *const __m256i);
                    (sum5, pairs, *xr.d.get_unchecked(b))
                };
                let sum = _mm256_add_epi32(
                    _mm512_castsi512_si256(sum5),
                    _mm512_extracti64x4_epi64(sum5, 1),
                );
                let summ = _mm256_mullo_epi32(pairs, mv);
                let t1 = _mm256_mul_ps(_mm256_set1_ps(d * xd), _mm256_cvtepi32_ps(sum));
                let t2 = _mm256_mul_ps(_mm256_set1_ps(dmin * xd), _mm256_cvtepi32_ps(summ));
                acc[r] = _mm256_add_ps(acc[r], _mm256_sub_ps(t1, t2));
            }
        }
        fold_rows(acc)
    }

    /// One super-block of Q5_K, IQ4_XS, Q3_K or Q2_K unpacked for [`dot_k`].
    struct KBlock {
        /// The codes of the 8 groups of 32 elements (element `32j + l`): unsigned (Q5_K
        /// 0..32, Q3_K 0..8 = `q + 4`, Q2_K 0..4) or signed (IQ4_XS, the code book's values).
        codes: [__m256i; 8],
        /// Group `j`'s scales as i16 for `madd`: its first 16 elements' in the low half, its
        /// last 16's in the high half (the same for a 32-element scale).
        scv: [__m256i; 8],
        /// Q5_K: the mins in [`Q4K_MIN_LANES`](super::Q4K_MIN_LANES) order. Q3_K: scales
        /// 0..8; Q2_K: mins 0..8 (as i32).
        aux_lo: __m256i,
        /// Q3_K: scales 8..16; Q2_K: mins 8..16.
        aux_hi: __m256i,
        d: f32,
        dmin: f32,
    }

    /// `T` of [`dot_k`]: 0 Q5_K, 1 IQ4_XS, 2 Q3_K, 3 Q2_K.
    const fn k_type(t: u8) -> QuantType {
        match t {
            0 => QuantType::Q5_K,
            1 => QuantType::IQ4_XS,
            2 => QuantType::Q3_K,
            _ => QuantType::Q2_K,
        }
    }

    /// The 32 bytes of `wb` from `off` (`off + 32 ≤ N`).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn load32<const N: usize>(wb: &[u8; N], off: usize) -> __m256i {
        let b: &[u8; 32] = wb[off..off + 32].try_into().expect("32 bytes");
        // SAFETY: `b` is 32 readable bytes (unaligned load).
        unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) }
    }

    /// The 16 bytes of `wb` from `off` as the 32 nibbles of a group: low nibbles (elements
    /// 0..16) in the low half, high ones (16..32) in the high half.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn nibbles16<const N: usize>(wb: &[u8; N], off: usize) -> __m256i {
        let b: &[u8; 16] = wb[off..off + 16].try_into().expect("16 bytes");
        // SAFETY: `b` is 16 readable bytes (unaligned load).
        let packed = unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) };
        let m = _mm_set1_epi8(0xf);
        _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16(packed, 4), m),
            _mm_and_si128(packed, m),
        )
    }

    /// [`k_block`] as a function call.
    #[inline(never)]
    #[target_feature(enable = "avx2,f16c")]
    fn k_block_call<const T: u8>(wb: &[u8]) -> KBlock {
        // SAFETY: AVX2 and F16C are enabled here.
        unsafe { k_block::<T>(wb) }
    }

    /// Unpack one super-block of `k_type(T)`.
    ///
    /// Not a `target_feature` function, so that it can be always inlined into [`dot_k`]: as a
    /// call it returned the unpacked block through memory, a third of the kernel's time.
    ///
    /// # Safety
    /// AVX2 and F16C must be available.
    #[inline(always)]
    unsafe fn k_block<const T: u8>(wb: &[u8]) -> KBlock {
        // SAFETY: AVX2 and F16C are available (the caller's contract), which is all the
        // vector operations below need.
        unsafe {
            let one = _mm256_set1_epi8(1);
            let three = _mm256_set1_epi8(3);
            let m4 = _mm256_set1_epi8(0xf);
            let mut codes = [_mm256_setzero_si256(); 8];
            let scv;
            let (mut aux_lo, mut aux_hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            let (d, dmin);
            // The 2-bit fields of Q3_K / Q2_K: group g = 4n + s is bits 2s of the 32 bytes n.
            let low2 = |q: [__m256i; 2], g: usize| {
                let v = q[g / 4];
                let v = match g % 4 {
                    0 => v,
                    1 => _mm256_srli_epi16(v, 2),
                    2 => _mm256_srli_epi16(v, 4),
                    _ => _mm256_srli_epi16(v, 6),
                };
                _mm256_and_si256(v, three)
            };
            // Bit g of each byte of `h`, moved to bit `to`.
            let bit = |h: __m256i, g: usize, to: i32| {
                let v = match g {
                    0 => h,
                    1 => _mm256_srli_epi16(h, 1),
                    2 => _mm256_srli_epi16(h, 2),
                    3 => _mm256_srli_epi16(h, 3),
                    4 => _mm256_srli_epi16(h, 4),
                    5 => _mm256_srli_epi16(h, 5),
                    6 => _mm256_srli_epi16(h, 6),
                    _ => _mm256_srli_epi16(h, 7),
                };
                let v = _mm256_and_si256(v, one);
                if to == 4 {
                    _mm256_slli_epi16(v, 4)
                } else {
                    _mm256_slli_epi16(v, 2)
                }
            };
            match T {
                0 => {
                    let wb: &[u8; 176] = wb.try_into().expect("a Q5_K block is 176 bytes");
                    let (ub, mv) = q4k_scales_mins(wb);
                    let qh = load32(wb, 16);
                    for c in 0..4 {
                        let q = load32(wb, 48 + 32 * c);
                        let lo = _mm256_and_si256(q, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                        codes[2 * c] = _mm256_or_si256(lo, bit(qh, 2 * c, 4));
                        codes[2 * c + 1] = _mm256_or_si256(hi, bit(qh, 2 * c + 1, 4));
                    }
                    // In bounds: bytes 0..8 of the 16-byte array `ub` (the scales).
                    let sc8 = _mm_loadl_epi64(ub.as_ptr() as *const __m128i);
                    scv = broadcast_i16_pairs(_mm256_cvtepu8_epi32(sc8));
                    aux_lo = mv;
                    d = f16_le(wb, 0);
                    dmin = f16_le(wb, 2);
                }
                1 => {
                    let wb: &[u8; 136] = wb.try_into().expect("an IQ4_XS block is 136 bytes");
                    let blk = BlockIq4Xs::from_bytes(wb);
                    // In bounds: the 16 bytes of the 16-entry i8 table.
                    let kv = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
                    let kv = _mm256_broadcastsi128_si256(kv);
                    let mut sc = [0i32; 8];
                    for j in 0..8 {
                        codes[j] = _mm256_shuffle_epi8(kv, nibbles16(wb, 8 + 16 * j));
                        sc[j] = blk.scale(j);
                    }
                    // In bounds: the 32 bytes of the array `sc`.
                    scv = broadcast_i16_pairs(_mm256_loadu_si256(sc.as_ptr() as *const __m256i));
                    d = blk.d.to_f32();
                    dmin = 0.0;
                }
                2 => {
                    let wb: &[u8; 110] = wb.try_into().expect("a Q3_K block is 110 bytes");
                    let hm = load32(wb, 0);
                    let q = [load32(wb, 32), load32(wb, 64)];
                    for g in 0..8 {
                        codes[g] = _mm256_or_si256(low2(q, g), bit(hm, g, 2));
                    }
                    let sc = q3k_scales_simd(wb[96..108].try_into().expect("12 bytes"));
                    aux_lo = _mm256_cvtepi8_epi32(sc);
                    aux_hi = _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8));
                    // Group g's halves take scales 2g and 2g + 1.
                    let (l, h) = (quarter_pairs(aux_lo), quarter_pairs(aux_hi));
                    scv = [l[0], l[1], l[2], l[3], h[0], h[1], h[2], h[3]];
                    d = f16_le(wb, 108);
                    dmin = 0.0;
                }
                _ => {
                    let wb: &[u8; 84] = wb.try_into().expect("a Q2_K block is 84 bytes");
                    let q = [load32(wb, 16), load32(wb, 48)];
                    let mut sc = [0u8; 16];
                    let mut mins = [0u8; 16];
                    for i in 0..16 {
                        sc[i] = wb[i] & 0xf;
                        mins[i] = wb[i] >> 4;
                    }
                    for g in 0..8 {
                        codes[g] = low2(q, g);
                    }
                    // In bounds: bytes 0..8 and 8..16 of the 16-byte arrays `sc` and `mins`.
                    let (sc_lo, sc_hi, lo, hi) = {
                        (
                            _mm_loadl_epi64(sc.as_ptr() as *const __m128i),
                            _mm_loadl_epi64(sc.as_ptr().add(8) as *const __m128i),
                            _mm_loadl_epi64(mins.as_ptr() as *const __m128i),
                            _mm_loadl_epi64(mins.as_ptr().add(8) as *const __m128i),
                        )
                    };
                    // Group g's halves take scales 2g and 2g + 1.
                    let l = quarter_pairs(_mm256_cvtepu8_epi32(sc_lo));
                    let h = quarter_pairs(_mm256_cvtepu8_epi32(sc_hi));
                    scv = [l[0], l[1], l[2], l[3], h[0], h[1], h[2], h[3]];
                    aux_lo = _mm256_cvtepu8_epi32(lo);
                    aux_hi = _mm256_cvtepu8_epi32(hi);
                    d = f16_le(wb, 80);
                    dmin = f16_le(wb, 82);
                }
            }
            KBlock {
                codes,
                scv,
                aux_lo,
                aux_hi,
                d,
                dmin,
            }
        }
    }

    /// Q5_K (`T` = 0), IQ4_XS (1), Q3_K (2), Q2_K (3): the eight-lane integer sums of
    /// [`k_lanes`](super::k_lanes) by `maddubs`/`madd` per 32-element group, then the
    /// per-format min or offset and the float steps of `dot_ref`, lane for lane.
    ///
    /// # Safety
    /// As [`dot_rows`]. `w` is `nb` whole blocks (`chunks_exact`), and the row fits `w`:
    /// codes `b·256..+256` and `d[b]` exist for every block `b < nb`, and `pairs[b·8..+8]`
    /// (Q5_K) or `bsums[b·16..+16]` (Q3_K, Q2_K).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_k<const R: usize, const T: u8>(w: &[u8], x: &[ActRow<'_>; R]) -> [f32; R] {
        let bb = k_type(T).block_bytes();
        let signed = T == 1;
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, wb) in w.chunks_exact(bb).enumerate() {
            // The row distance ahead (`prefetch::row_bytes_ahead`): past the row's end for its last blocks.
            prefetch_ahead(wb.as_ptr(), bb);
            // One row: the block unpacked in registers; several: by a call (inlined, their
            // loop spills more than it saves).
            let k = if R == 1 {
                // SAFETY: this kernel runs with AVX2 and F16C.
                unsafe { k_block::<T>(wb) }
            } else {
                k_block_call::<T>(wb)
            };
            let mut abs = [_mm256_setzero_si256(); 8];
            if signed {
                for j in 0..8 {
                    abs[j] = _mm256_sign_epi8(k.codes[j], k.codes[j]);
                }
            }
            for r in 0..R {
                let xr = x[r];
                // SAFETY: the row fits `w` and b < nb: codes b·256..+256 and d[b] are inside
                // it, and pairs b·8..+8 (T = 0) or bsums b·16..+16 (T = 2, 3).
                let (sum, aux_lo, aux_hi, xd) = unsafe {
                    let y = xr.qs.as_ptr().add(b * QK_K);
                    let mut sum = _mm256_setzero_si256();
                    for j in 0..8 {
                        let yv = _mm256_loadu_si256(y.add(32 * j) as *const __m256i);
                        let p16 = if signed {
                            _mm256_maddubs_epi16(abs[j], _mm256_sign_epi8(yv, k.codes[j]))
                        } else {
                            _mm256_maddubs_epi16(k.codes[j], yv)
                        };
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, k.scv[j]));
                    }
                    let (lo, hi) = match T {
                        0 => (
                            _mm256_loadu_si256(xr.pairs.as_ptr().add(b * 8) as *const __m256i),
                            _mm256_setzero_si256(),
                        ),
                        1 => (_mm256_setzero_si256(), _mm256_setzero_si256()),
                        _ => {
                            let bs = xr.bsums.as_ptr().add(b * 16);
                            (
                                _mm256_loadu_si256(bs as *const __m256i),
                                _mm256_loadu_si256(bs.add(8) as *const __m256i),
                            )
                        }
                    };
                    (sum, lo, hi, *xr.d.get_unchecked(b))
                };
                let s1 = _mm256_set1_ps(k.d * xd);
                let t = match T {
                    0 | 3 => {
                        let summ = if T == 0 {
                            _mm256_mullo_epi32(aux_lo, k.aux_lo)
                        } else {
                            _mm256_add_epi32(
                                _mm256_mullo_epi32(aux_lo, k.aux_lo),
                                _mm256_mullo_epi32(aux_hi, k.aux_hi),
                            )
                        };
                        let t1 = _mm256_mul_ps(s1, _mm256_cvtepi32_ps(sum));
                        let t2 =
                            _mm256_mul_ps(_mm256_set1_ps(k.dmin * xd), _mm256_cvtepi32_ps(summ));
                        _mm256_sub_ps(t1, t2)
                    }
                    1 => _mm256_mul_ps(s1, _mm256_cvtepi32_ps(sum)),
                    _ => {
                        let off = _mm256_add_epi32(
                            _mm256_mullo_epi32(aux_lo, k.aux_lo),
                            _mm256_mullo_epi32(aux_hi, k.aux_hi),
                        );
                        // Σ sc·(c − 4)·y = Σ sc·c·y − 4·Σ sc·bsum, exact in i32.
                        let sumi = _mm256_sub_epi32(sum, _mm256_slli_epi32(off, 2));
                        _mm256_mul_ps(s1, _mm256_cvtepi32_ps(sumi))
                    }
                };
                acc[r] = _mm256_add_ps(acc[r], t);
            }
        }
        fold_rows(acc)
    }

    /// Fold each row's eight lanes in the canonical order.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn fold_rows<const R: usize>(acc: [__m256; R]) -> [f32; R] {
        let mut out = [0.0f32; R];
        for r in 0..R {
            let mut lanes = [0.0f32; 8];
            // SAFETY: `lanes` is an array of 8 f32.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]) };
            out[r] = fold8(&lanes);
        }
        out
    }

    /// One Q6_K super-block unpacked for the integer steps.
    struct Q6kBlock {
        /// Codes of the 8 groups of 32 elements (element `32g + l`), 0..64.
        codes: [__m256i; 8],
        /// Scales of groups `2k` (low half) and `2k + 1` (high half) as i16 vectors.
        scv: [__m256i; 8],
        /// The 16 scales as i32, in two halves.
        sc_lo: __m256i,
        sc_hi: __m256i,
        d: f32,
    }

    /// Unpack the 210-byte Q6_K block `wb` (ql 0..128, qh 128..192, scales 192..208, d
    /// 208..210).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn q6k_block(wb: &[u8]) -> Q6kBlock {
        let wb: &[u8; 210] = wb.try_into().expect("a Q6_K block is 210 bytes");
        let m4 = _mm256_set1_epi8(0xf);
        let m2 = _mm256_set1_epi8(3);
        let mut codes = [_mm256_setzero_si256(); 8];
        for h in 0..2 {
            // SAFETY: bytes 64h..64h + 64 (ql) and 128 + 32h..160 + 32h (qh), h < 2, of the
            // 210-byte block.
            let (ql0, ql1, qh) = unsafe {
                (
                    _mm256_loadu_si256(wb.as_ptr().add(64 * h) as *const __m256i),
                    _mm256_loadu_si256(wb.as_ptr().add(64 * h + 32) as *const __m256i),
                    _mm256_loadu_si256(wb.as_ptr().add(128 + 32 * h) as *const __m256i),
                )
            };
            let lows = [
                _mm256_and_si256(ql0, m4),
                _mm256_and_si256(ql1, m4),
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
            ];
            let highs = [
                _mm256_and_si256(qh, m2),
                _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                _mm256_and_si256(_mm256_srli_epi16(qh, 4), m2),
                _mm256_and_si256(_mm256_srli_epi16(qh, 6), m2),
            ];
            for s in 0..4 {
                codes[4 * h + s] = _mm256_or_si256(lows[s], _mm256_slli_epi16(highs[s], 4));
            }
        }
        let sc = &wb[192..208];
        // SAFETY: bytes 0..8 and 8..16 of the 16 scale bytes.
        let (sc_lo, sc_hi) = unsafe {
            (
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(sc.as_ptr() as *const __m128i)),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(sc.as_ptr().add(8) as *const __m128i)),
            )
        };
        // Group k's two 16-element halves take scales 2k and 2k + 1.
        let (lo, hi) = (quarter_pairs(sc_lo), quarter_pairs(sc_hi));
        let scv = [lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]];
        Q6kBlock {
            codes,
            scv,
            sc_lo,
            sc_hi,
            d: _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                u16::from_le_bytes([wb[208], wb[209]]) as i32,
            ))),
        }
    }

    /// # Safety
    /// As [`dot_rows`]. `w` is `nb` whole blocks (`chunks_exact`), and the row fits
    /// `w`: codes `b·256..+256`, `bsums[b·16..+16]` and `d[b]` exist for every block `b < nb`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q6k<const R: usize>(w: &[u8], x: &[ActRow<'_>; R]) -> [f32; R] {
        let bb = QuantType::Q6_K.block_bytes();
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, wb) in w.chunks_exact(bb).enumerate() {
            // The row distance ahead (`prefetch::row_bytes_ahead`): past the row's end for its last blocks.
            prefetch_ahead(wb.as_ptr(), bb);
            let Q6kBlock {
                codes,
                scv,
                sc_lo,
                sc_hi,
                d,
            } = q6k_block(wb);
            for r in 0..R {
                let xr = x[r];
                // SAFETY: the row fits `w` and b < nb: codes b·256..+256, bsums b·16..+16 and
                // d[b] are inside it.
                let (sum, bs_lo, bs_hi, xd) = unsafe {
                    let y = xr.qs.as_ptr().add(b * QK_K);
                    let mut sum = _mm256_setzero_si256();
                    for k in 0..8 {
                        let yv = _mm256_loadu_si256(y.add(32 * k) as *const __m256i);
                        let p16 = _mm256_maddubs_epi16(codes[k], yv);
                        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, scv[k]));
                    }
                    let bs = xr.bsums.as_ptr().add(b * 16);
                    (
                        sum,
                        _mm256_loadu_si256(bs as *const __m256i),
                        _mm256_loadu_si256(bs.add(8) as *const __m256i),
                        *xr.d.get_unchecked(b),
                    )
                };
                let off = _mm256_add_epi32(
                    _mm256_mullo_epi32(bs_lo, sc_lo),
                    _mm256_mullo_epi32(bs_hi, sc_hi),
                );
                // Σ sc·(q − 32)·y = Σ sc·q·y − 32·Σ sc·bsum, exact in i32.
                let sumi = _mm256_sub_epi32(sum, _mm256_slli_epi32(off, 5));
                let t = _mm256_mul_ps(_mm256_set1_ps(d * xd), _mm256_cvtepi32_ps(sumi));
                acc[r] = _mm256_add_ps(acc[r], t);
            }
        }
        fold_rows(acc)
    }

    /// One Q6_K, Q3_K or Q2_K super-block unpacked for [`dot_k16_512`]: [`Q6kBlock`]'s codes
    /// and scales (Q3_K: codes `q + 4`, 0..8, and its sixteen 6-bit scales less 32; Q2_K: codes
    /// 0..4, its 4-bit scales, and its 4-bit mins as `sc_lo` / `sc_hi`), two 32-element groups
    /// per register.
    struct Q6kBlock512 {
        /// Groups `2k` (low half) and `2k + 1` (high half) of the codes, 0..64 (Q3_K 0..8).
        z: [__m512i; 4],
        /// The scales of those groups' four 16-element quarters as i16 for `madd`.
        zs: [__m512i; 4],
        sc_lo: __m256i,
        sc_hi: __m256i,
        d: f32,
        /// Q2_K's `dmin` (0 for the others).
        dmin: f32,
    }

    /// [`q6k_block`] in 512-bit steps: the same codes and scales, unpacked with a quarter of
    /// the instructions (a decode reads each block once, so the unpacking is most of its work).
    #[inline]
    #[target_feature(enable = "avx2,f16c,avx512f,avx512bw")]
    fn q6k_block_512(wb: &[u8]) -> Q6kBlock512 {
        let wb: &[u8; 210] = wb.try_into().expect("a Q6_K block is 210 bytes");
        let m4 = _mm512_set1_epi8(0xf);
        let m30 = _mm512_set1_epi8(0x30);
        let mut z = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            // SAFETY: bytes 64h..64h + 64 (ql) and 128 + 32h..160 + 32h (qh), h < 2, of the
            // 210-byte block.
            let (ql, qh) = unsafe {
                (
                    _mm512_loadu_si512(wb.as_ptr().add(64 * h) as *const __m512i),
                    _mm256_loadu_si256(wb.as_ptr().add(128 + 32 * h) as *const __m256i),
                )
            };
            // The 32 qh bytes in both halves; their 2-bit fields moved to bits 4..6: fields
            // 0 | 1 for groups 4h, 4h + 1, fields 2 | 3 for groups 4h + 2, 4h + 3 (shifts of
            // 64-bit lanes: the bits a shift carries across bytes are masked off).
            let q = _mm512_broadcast_i64x4(qh);
            let hi01 = _mm512_and_si512(
                _mm512_sllv_epi64(q, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2)),
                m30,
            );
            let hi23 = _mm512_and_si512(
                _mm512_srlv_epi64(q, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)),
                m30,
            );
            z[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), hi01);
            z[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), hi23);
        }
        // SAFETY: bytes 192..208 of the block (the 16 scales).
        let sc = unsafe { _mm_loadu_si128(wb.as_ptr().add(192) as *const __m128i) };
        k16_block_512(z, sc, u16::from_le_bytes([wb[208], wb[209]]))
    }

    /// [`Q6kBlock512`] from a block's codes `z`, its sixteen i8 scales `sc` (one per 16
    /// elements) and its f16 `d`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,avx512f,avx512bw")]
    fn k16_block_512(z: [__m512i; 4], sc: __m128i, d: u16) -> Q6kBlock512 {
        // Scales 0..8 and 8..16 as i16, each in every 128-bit lane.
        let s16 = [
            _mm512_broadcast_i32x4(_mm_cvtepi8_epi16(sc)),
            _mm512_broadcast_i32x4(_mm_cvtepi8_epi16(_mm_srli_si128(sc, 8))),
        ];
        let mut zs = [_mm512_setzero_si512(); 4];
        for (k, zs) in zs.iter_mut().enumerate() {
            // i16 lane l takes scale 4k + l / 8 (eight lanes = 16 bytes = a quarter).
            // SAFETY: the 64 bytes of one row of the table.
            let ctl = unsafe { _mm512_loadu_si512(Q6K_QUARTERS[k].as_ptr() as *const __m512i) };
            *zs = _mm512_shuffle_epi8(s16[k / 2], ctl);
        }
        Q6kBlock512 {
            z,
            zs,
            sc_lo: _mm256_cvtepi8_epi32(sc),
            sc_hi: _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)),
            d: _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(d as i32))),
            dmin: 0.0,
        }
    }

    /// A Q2_K super-block (scales and mins 0..16, qs 16..80, d 80..82, dmin 82..84) for
    /// [`dot_k16_512`]: group `g` takes bits `2·(g % 4)` of `qs[32·(g / 4) + i]`
    /// (`q2k_code`); byte `j` holds scale `j` (low nibble) and min `j` (high nibble).
    #[inline]
    #[target_feature(enable = "avx2,f16c,avx512f,avx512bw")]
    fn q2k_block_512(wb: &[u8]) -> Q6kBlock512 {
        let wb: &[u8; 84] = wb.try_into().expect("a Q2_K block is 84 bytes");
        let z = low2_groups_512(wb[16..80].try_into().unwrap());
        // SAFETY: bytes 0..16 of the block (scales and mins).
        let v = unsafe { _mm_loadu_si128(wb.as_ptr() as *const __m128i) };
        let m4 = _mm_set1_epi8(0xf);
        let mins = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
        let f16 = |o: usize| u16::from_le_bytes([wb[o], wb[o + 1]]);
        let mut block = k16_block_512(z, _mm_and_si128(v, m4), f16(80));
        block.sc_lo = _mm256_cvtepu8_epi32(mins);
        block.sc_hi = _mm256_cvtepu8_epi32(_mm_srli_si128(mins, 8));
        block.dmin = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(f16(82) as i32)));
        block
    }

    /// Q5_K's and Q3_K's high code bit: `codes[k]` holds groups `2k` (low half) and `2k + 1`
    /// (high half) of 32 elements; where bit `j` of byte `l` of `high` (32 bytes, in both
    /// halves) is set, `add` is added to element `l` of group `j`.
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw")]
    fn add_group_bits(codes: [__m512i; 4], high: __m512i, add: i8) -> [__m512i; 4] {
        let add = _mm512_set1_epi8(add);
        std::array::from_fn(|k| {
            let bit = _mm512_inserti64x4(
                _mm512_set1_epi8((1u8 << (2 * k)) as i8),
                _mm256_set1_epi8((1u8 << (2 * k + 1)) as i8),
                1,
            );
            _mm512_mask_add_epi8(codes[k], _mm512_test_epi8_mask(high, bit), codes[k], add)
        })
    }

    /// The 2-bit fields of Q3_K's and Q2_K's 64 code bytes as four registers of two groups
    /// each: group `g` is bits `2·(g % 4)` of bytes `32·(g / 4)..+32`; register `k` holds
    /// groups `2k` (low half) and `2k + 1` (high half).
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw")]
    fn low2_groups_512(qs: &[u8; 64]) -> [__m512i; 4] {
        let m3 = _mm512_set1_epi8(3);
        std::array::from_fn(|k| {
            let b: &[u8; 32] = qs[32 * (k / 2)..32 * (k / 2) + 32].try_into().unwrap();
            // SAFETY: `b` is 32 readable bytes (unaligned load).
            let q =
                _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) });
            // Shifts of 64-bit lanes: the bits carried across bytes are masked off.
            let (a, c) = (2 * (2 * k % 4) as i64, 2 * ((2 * k + 1) % 4) as i64);
            _mm512_and_si512(
                _mm512_srlv_epi64(q, _mm512_setr_epi64(a, a, a, a, c, c, c, c)),
                m3,
            )
        })
    }

    /// A Q3_K block's sixteen scales (`q3k_scales`) in one register: scale `j`'s low nibble
    /// is nibble `j / 8` of byte `j % 8`, its top two bits bits `2·(j / 4)` of byte `8 + j % 4`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn q3k_scales_simd(s: &[u8; 12]) -> __m128i {
        let m4 = _mm_set1_epi8(0xf);
        let low8 = _mm_cvtsi64_si128(i64::from_le_bytes(s[..8].try_into().unwrap()));
        // Low nibbles of bytes 0..8 (scales 0..8), then their high nibbles (scales 8..16).
        let low = _mm_unpacklo_epi64(
            _mm_and_si128(low8, m4),
            _mm_and_si128(_mm_srli_epi16(low8, 4), m4),
        );
        // Bytes 8..12 in each 32-bit lane j / 4, shifted right by 2·(j / 4); bits a shift
        // carries across bytes are masked off.
        let top = _mm_set1_epi32(i32::from_le_bytes(s[8..12].try_into().unwrap()));
        let high = _mm_and_si128(
            _mm_srlv_epi32(top, _mm_setr_epi32(0, 2, 4, 6)),
            _mm_set1_epi8(3),
        );
        // Bytes of at most 2 bits: a 16-bit shift by 4 keeps each inside its byte.
        _mm_sub_epi8(
            _mm_or_si128(low, _mm_slli_epi16(high, 4)),
            _mm_set1_epi8(32),
        )
    }

    /// A Q3_K super-block (hmask 0..32, qs 32..96, scales 96..108, d 108..110) for
    /// [`dot_k16_512`]: group `g` takes bits `2·(g % 4)` of `qs[32·(g / 4) + i]` and, as bit 2,
    /// bit `g` of `hmask[i]` (`q3k_code`).
    #[inline]
    #[target_feature(enable = "avx2,f16c,avx512f,avx512bw")]
    fn q3k_block_512(wb: &[u8]) -> Q6kBlock512 {
        let wb: &[u8; 110] = wb.try_into().expect("a Q3_K block is 110 bytes");
        // SAFETY: bytes 0..32 of the block (hmask).
        let hm =
            _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(wb.as_ptr() as *const __m256i) });
        let z = add_group_bits(low2_groups_512(wb[32..96].try_into().unwrap()), hm, 4);
        let sc = q3k_scales_simd(wb[96..108].try_into().unwrap());
        k16_block_512(z, sc, u16::from_le_bytes([wb[108], wb[109]]))
    }

    /// `KIND` of [`dot_k16_512`].
    const K16_Q6K: u8 = 0;
    const K16_Q3K: u8 = 1;
    const K16_Q2K: u8 = 2;

    /// [`dot_q6k`] with 512-bit integer steps; identical integer lanes and results. Q3_K and
    /// Q2_K (`KIND`) have the same integer lanes (a scale per 16 codes): Q3_K's codes carry an
    /// offset taken back through the 16-code sums as Q6_K's (4 instead of 32) and its float
    /// step is Q6_K's; Q2_K's 16-code sums weighted by its mins make the `dmin` term, with
    /// Q4_K's float step. `dot_ref` gives all three.
    ///
    /// # Safety
    /// As [`dot_q6k`] (`w` whole blocks of the `KIND`'s type), and AVX-512 F and BW must be
    /// available.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
    unsafe fn dot_k16_512<const R: usize, const KIND: u8>(
        w: &[u8],
        x: &[ActRow<'_>; R],
    ) -> [f32; R] {
        let ty = match KIND {
            K16_Q6K => QuantType::Q6_K,
            K16_Q3K => QuantType::Q3_K,
            _ => QuantType::Q2_K,
        };
        let bb = ty.block_bytes();
        // The codes' offset, as a shift: 32 (Q6_K) or 4 (Q3_K).
        let offset_shift = if KIND == K16_Q3K { 2 } else { 5 };
        let mut acc = [_mm256_setzero_ps(); R];
        for (b, wb) in w.chunks_exact(bb).enumerate() {
            // The row distance ahead (`prefetch::row_bytes_ahead`): past the row's end for its last blocks.
            prefetch_ahead(wb.as_ptr(), bb);
            let Q6kBlock512 {
                z,
                zs,
                sc_lo,
                sc_hi,
                d,
                dmin,
            } = match KIND {
                K16_Q6K => q6k_block_512(wb),
                K16_Q3K => q3k_block_512(wb),
                _ => q2k_block_512(wb),
            };
            for r in 0..R {
                let xr = x[r];
                // SAFETY: the row fits `w` and b < nb: codes b·256..+256, bsums b·16..+16 and
                // d[b] are inside it.
                let (sum5, bs_lo, bs_hi, xd) = unsafe {
                    let y = xr.qs.as_ptr().add(b * QK_K);
                    let mut sum5 = _mm512_setzero_si512();
                    for k in 0..4 {
                        let yv = _mm512_loadu_si512(y.add(64 * k) as *const __m512i);
                        let p16 = _mm512_maddubs_epi16(z[k], yv);
                        sum5 = _mm512_add_epi32(sum5, _mm512_madd_epi16(p16, zs[k]));
                    }
                    let bs = xr.bsums.as_ptr().add(b * 16);
                    (
                        sum5,
                        _mm256_loadu_si256(bs as *const __m256i),
                        _mm256_loadu_si256(bs.add(8) as *const __m256i),
                        *xr.d.get_unchecked(b),
                    )
                };
                let sum = _mm256_add_epi32(
                    _mm512_castsi512_si256(sum5),
                    _mm512_extracti64x4_epi64(sum5, 1),
                );
                let off = _mm256_add_epi32(
                    _mm256_mullo_epi32(bs_lo, sc_lo),
                    _mm256_mullo_epi32(bs_hi, sc_hi),
                );
                let s1 = _mm256_set1_ps(d * xd);
                let t = if KIND == K16_Q2K {
                    // `off` is Σ m·bsum: (d·d_x)·sumi − (dmin·d_x)·summ.
                    let t1 = _mm256_mul_ps(s1, _mm256_cvtepi32_ps(sum));
                    let t2 = _mm256_mul_ps(_mm256_set1_ps(dmin * xd), _mm256_cvtepi32_ps(off));
                    _mm256_sub_ps(t1, t2)
                } else {
                    // Σ sc·(q − 32)·y = Σ sc·q·y − 32·Σ sc·bsum (Q3_K: 4), exact in i32.
                    let sumi = _mm256_sub_epi32(
                        sum,
                        _mm256_sll_epi32(off, _mm_cvtsi32_si128(offset_shift)),
                    );
                    _mm256_mul_ps(s1, _mm256_cvtepi32_ps(sumi))
                };
                acc[r] = _mm256_add_ps(acc[r], t);
            }
        }
        fold_rows(acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::quant::quantize_row;

    use crate::tensor::test_values::{lcg, LCG_MUL};

    /// `n` values in `[-1, 1)` drawn from `seed`.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut v = lcg(n, seed.wrapping_mul(LCG_MUL).wrapping_add(1));
        v.iter_mut().for_each(|x| *x *= 2.0);
        v
    }

    /// Every type with an integer kernel.
    const TYPES: [QuantType; 12] = [
        QuantType::Q8_0,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::IQ4_NL,
        QuantType::Q2_K,
        QuantType::Q3_K,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
        QuantType::IQ4_XS,
    ];

    /// `w` (rows of `k`) as `ty`: quantized where colibri has a quantizer, else random
    /// blocks ([`blocks`]) seeded from the values.
    fn quantized(ty: QuantType, w: &[f32], k: usize) -> Vec<u8> {
        if !ty.can_quantize() {
            let nb = w.len() / ty.block_size();
            return blocks(ty, nb, w[0].to_bits() as u64, Fill::Random, 0.01);
        }
        let mut bytes = Vec::new();
        for row in w.chunks_exact(k) {
            quantize_row(ty, row, &mut bytes).unwrap();
        }
        bytes
    }

    /// Byte offsets of a block's f16 scale fields (d, and dmin or m).
    fn f16_fields(ty: QuantType) -> &'static [usize] {
        match ty {
            QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
            QuantType::Q3_K => &[108],
            QuantType::Q2_K => &[80, 82],
            QuantType::Q6_K => &[208],
            _ => &[0],
        }
    }

    /// How [`blocks`] fills the code and sub-scale bytes.
    #[derive(Clone, Copy, Debug)]
    enum Fill {
        Random,
        /// Every byte 0: the smallest codes (IQ4's −127, Q5_0's −16, Q3_K's −4 everywhere).
        Zero,
        /// Every byte 0xff: the largest codes and sub-scales.
        Max,
    }

    /// `nb` blocks of `ty` whose bytes are `fill`, with every f16 scale field set to `scale`.
    fn blocks(ty: QuantType, nb: usize, seed: u64, fill: Fill, scale: f32) -> Vec<u8> {
        let bb = ty.block_bytes();
        let mut b: Vec<u8> = match fill {
            Fill::Random => values(nb * bb, seed)
                .iter()
                .map(|v| (v.to_bits() >> 9) as u8)
                .collect(),
            Fill::Zero => vec![0; nb * bb],
            Fill::Max => vec![0xff; nb * bb],
        };
        for blk in b.chunks_exact_mut(bb) {
            for &o in f16_fields(ty) {
                blk[o..o + 2].copy_from_slice(&f16::from_f32(scale).to_le_bytes());
            }
        }
        b
    }

    /// Every path the dispatch can take for these rows — the scalar reference, the AVX2
    /// kernels and, where detected, the AVX-512 ones, one row at a time and four at once —
    /// gives the reference's bits.
    #[allow(clippy::needless_range_loop)] // a row index for the rows and the wanted bits
    fn all_paths_agree(ty: QuantType, w: &[u8], acts: &QuantizedActs, what: &str) {
        let m = acts.qs.len() / acts.cols;
        let want: Vec<u32> = (0..m)
            .map(|i| dot_ref(ty, w, acts.row(i)).to_bits())
            .collect();
        for isa in [Isa::Scalar, Isa::best_available()] {
            for i in 0..m {
                let got = dot_rows::<1>(isa, ty, w, &[acts.row(i)])[0];
                assert_eq!(got.to_bits(), want[i], "{ty} {isa:?} {what} row {i}");
            }
            for i0 in (0..m.saturating_sub(3)).step_by(4) {
                let four: [ActRow; 4] = std::array::from_fn(|r| acts.row(i0 + r));
                for (r, v) in dot_rows::<4>(isa, ty, w, &four).into_iter().enumerate() {
                    assert_eq!(v.to_bits(), want[i0 + r], "{ty} {isa:?} {what} x4 row {r}");
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if Isa::best_available() == Isa::Avx2 {
            for wide in [false, avx512()] {
                for i in 0..m {
                    assert!(row_fits(ty, w, &acts.row(i)));
                    // SAFETY: AVX2, FMA and F16C were detected (`best_available`), the row
                    // fits (asserted), and `wide` only where `avx512` detected F and BW.
                    let got = unsafe { avx2::dot_rows_with::<1>(ty, w, &[acts.row(i)], wide) };
                    assert_eq!(got[0].to_bits(), want[i], "{ty} wide={wide} {what} row {i}");
                }
            }
        }
    }

    /// Activation rows for the edge tests: random, all zero, every code ±127, a zero block
    /// among random ones, and tiny values.
    fn edge_activations(k: usize, seed: u64) -> Vec<f32> {
        let mut x = values(k, seed);
        x.extend(std::iter::repeat_n(0.0, k));
        x.extend((0..k).map(|i| if i % 3 == 0 { -3.0 } else { 3.0 }));
        let mut holed = values(k, seed + 1);
        holed[..QK32].fill(0.0);
        x.extend(holed);
        x.extend(values(k, seed + 2).iter().map(|v| v * 1e-20));
        x
    }

    /// Random, all-zero, smallest-code and largest-code blocks with zero, subnormal, unit and
    /// largest f16 scales, against random, zero and saturated activations, for several block
    /// counts: every kernel gives the scalar reference's bits.
    #[test]
    fn kernels_match_the_reference_on_edge_blocks() {
        for ty in TYPES {
            let ks: &[usize] = if ty.block_size() == QK_K {
                &[256, 512, 768, 1280]
            } else {
                &[32, 96, 256, 288, 544]
            };
            for &k in ks {
                let acts =
                    QuantizedActs::quantize(act_format(ty).unwrap(), &edge_activations(k, 5), k);
                let nb = k / ty.block_size();
                for fill in [Fill::Random, Fill::Zero, Fill::Max] {
                    for scale in [0.0f32, 6e-8, 1.0, 65504.0] {
                        let w = blocks(ty, nb, 3 + k as u64, fill, scale);
                        all_paths_agree(ty, &w, &acts, &format!("k={k} {fill:?} {scale:e}"));
                    }
                }
                // Blocks of mixed kinds in one row.
                let mut w = Vec::new();
                for b in 0..nb {
                    let fill = [Fill::Random, Fill::Max, Fill::Zero][b % 3];
                    w.extend(blocks(ty, 1, b as u64, fill, [0.5, 2.0, 0.0][b % 3]));
                }
                all_paths_agree(ty, &w, &acts, &format!("k={k} mixed"));
            }
        }
    }

    /// The scalar reference is the dot product of the dequantized weights
    /// (`dequantize_row`, ggml's values) and the dequantized activation codes (`q · d`, and
    /// for Q8_1 the block sums as given), computed independently in f64: the integer
    /// formulas are right, up to the f32 rounding of the scaled sums.
    #[test]
    fn reference_is_the_dot_of_the_dequantized_rows() {
        for ty in TYPES {
            for k in [256usize, 768, 2304] {
                let bs = ty.block_size();
                let nb = k / bs;
                let mut rows = vec![quantized(ty, &values(k, 70 + k as u64), k)];
                rows.push(blocks(ty, nb, 71, Fill::Random, 0.03));
                rows.push(blocks(ty, nb, 72, Fill::Max, 0.5));
                let x = edge_activations(k, 73);
                let format = act_format(ty).unwrap();
                let acts = QuantizedActs::quantize(format, &x, k);
                let abs = match format {
                    ActFormat::Q8K => QK_K,
                    _ => QK32,
                };
                let mut wf = vec![0.0f32; k];
                for (r, w) in rows.iter().enumerate() {
                    dequantize_row(ty, w, &mut wf).unwrap();
                    for i in 0..x.len() / k {
                        let a = acts.row(i);
                        let xf = |t: usize| a.qs[t] as f64 * a.d[t / abs] as f64;
                        let mut want: f64 = (0..k).map(|t| wf[t] as f64 * xf(t)).sum();
                        let mut mag: f64 = (0..k).map(|t| (wf[t] as f64 * xf(t)).abs()).sum();
                        if format == ActFormat::Q8_1 {
                            // The min's term uses the block sum `s` (f16 of the unrounded
                            // scale times Σq) where the dequantized activations give d·Σq.
                            for b in 0..nb {
                                let m = f16::from_le_bytes([
                                    w[b * ty.block_bytes() + 2],
                                    w[b * ty.block_bytes() + 3],
                                ])
                                .to_f32() as f64;
                                let dsum: f64 = (32 * b..32 * b + 32).map(xf).sum();
                                want += m * (a.sums[b] as f64 - dsum);
                                mag += (m * a.sums[b] as f64).abs();
                            }
                        }
                        let got = dot_ref(ty, w, a) as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * mag + 1e-30,
                            "{ty} k={k} weights {r} row {i}: {got} vs {want} (scale {mag})"
                        );
                    }
                }
            }
        }
    }

    /// The SIMD kernels give exactly the scalar reference, for 1 and 4 rows at once and for
    /// block counts that are not a multiple of 8.
    #[test]
    #[allow(clippy::needless_range_loop)] // rows are indexed in two arrays
    fn simd_matches_the_scalar_reference_bit_for_bit() {
        let isa = Isa::best_available();
        for ty in TYPES {
            for k in [256usize, 768, 2304] {
                let w = values(3 * k, 7 + k as u64);
                let x = values(5 * k, 9 + k as u64);
                let bytes = quantized(ty, &w, k);
                let acts = QuantizedActs::quantize(act_format(ty).unwrap(), &x, k);
                let rb = ty.row_bytes(k).unwrap();
                for j in 0..3 {
                    let wr = &bytes[j * rb..(j + 1) * rb];
                    let four: [ActRow; 4] = std::array::from_fn(|i| acts.row(i));
                    let got4 = dot_rows::<4>(isa, ty, wr, &four);
                    #[cfg(target_arch = "x86_64")]
                    if isa == Isa::Avx2 {
                        // The AVX2-only kernels too, where dispatch picks the 512-bit ones.
                        for i in 0..5 {
                            let want = dot_ref(ty, wr, acts.row(i));
                            // SAFETY: AVX2 was detected; `wide` is off.
                            let narrow =
                                unsafe { avx2::dot_rows_with::<1>(ty, wr, &[acts.row(i)], false) };
                            assert_eq!(
                                narrow[0].to_bits(),
                                want.to_bits(),
                                "{ty} avx2 k={k} row {i}"
                            );
                        }
                    }
                    for i in 0..5 {
                        let want = dot_ref(ty, wr, acts.row(i));
                        let one = dot_rows::<1>(isa, ty, wr, &[acts.row(i)])[0];
                        assert_eq!(one.to_bits(), want.to_bits(), "{ty} k={k} row {i}");
                        if i < 4 {
                            assert_eq!(got4[i].to_bits(), want.to_bits(), "{ty} k={k} x4 row {i}");
                        }
                    }
                }
            }
        }
    }

    /// Rows that are their whole allocation (so the kernels' prefetches run past its end), for
    /// every block count from one up, including 32-element rows whose count is not a multiple
    /// of the kernels' 8-block groups: the SIMD kernels still give the scalar reference, at
    /// the prefetch distances of the processors measured and the farthest taken.
    #[test]
    fn kernels_on_exactly_allocated_rows_of_any_block_count() {
        let isa = Isa::best_available();
        for ahead in [Some(0), Some(3072), Some(6144), Some(usize::MAX), None] {
            prefetch::set_row_bytes_ahead(ahead);
            kernels_on_exactly_allocated_rows(isa);
        }
    }

    fn kernels_on_exactly_allocated_rows(isa: Isa) {
        for ty in TYPES {
            let ks: &[usize] = match act_format(ty) {
                Some(ActFormat::Q8K) => &[256, 512, 768],
                _ => &[32, 64, 96, 256 + 32, 416, 544],
            };
            for &k in ks {
                let bytes = quantized(ty, &values(k, 51 + k as u64), k);
                let x = values(4 * k, 52 + k as u64);
                let acts = QuantizedActs::quantize(act_format(ty).unwrap(), &x, k);
                // One row, in a boxed slice of exactly its size.
                let row: Box<[u8]> = bytes.clone().into_boxed_slice();
                let four: [ActRow; 4] = std::array::from_fn(|i| acts.row(i));
                let got4 = dot_rows::<4>(isa, ty, &row, &four);
                for (i, got) in got4.into_iter().enumerate() {
                    let want = dot_ref(ty, &row, acts.row(i));
                    let one = dot_rows::<1>(isa, ty, &row, &[acts.row(i)])[0];
                    assert_eq!(one.to_bits(), want.to_bits(), "{ty} k={k} row {i}");
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty} k={k} x4 row {i}");
                    #[cfg(target_arch = "x86_64")]
                    if isa == Isa::Avx2 {
                        // The AVX2-only kernels too, where dispatch picks the 512-bit ones.
                        assert!(row_fits(ty, &row, &acts.row(i)));
                        // SAFETY: AVX2, FMA and F16C were detected (`best_available`), the row
                        // fits (asserted), and `wide` is off.
                        let narrow =
                            unsafe { avx2::dot_rows_with::<1>(ty, &row, &[acts.row(i)], false) };
                        assert_eq!(
                            narrow[0].to_bits(),
                            want.to_bits(),
                            "{ty} avx2 k={k} row {i}"
                        );
                    }
                }
                let mut out = vec![0.0f32; 4];
                qmatmul(&x, ty, &row, 1, k, &mut out);
                for (i, got) in out.into_iter().enumerate() {
                    let want = dot_ref(ty, &row, acts.row(i));
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty} k={k} qmatmul row {i}");
                }
            }
        }
    }

    /// Prefetch addresses are formed with wrapping arithmetic: any offset past the end of the
    /// row's allocation, even one that wraps the address space, is the plain address (with
    /// `ptr::add` it would be undefined behaviour, which the compile-time check next to
    /// `prefetch_addr` catches; at run time only Miri would), and prefetching it is harmless.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn prefetch_addresses_past_the_allocation_are_well_defined() {
        let row: Box<[u8]> = vec![7u8; QuantType::Q4_K.block_bytes()].into_boxed_slice();
        let p = row.as_ptr();
        let len = row.len();
        for off in [
            0,
            len - 1,
            len,
            2 * len + 128,
            16 * len + 256,
            1 << 40,
            usize::MAX,
        ] {
            let a = avx2::prefetch_addr(p, off);
            assert_eq!(a as usize, (p as usize).wrapping_add(off), "offset {off}");
            avx2::prefetch(p, off);
        }
        assert!(row.iter().all(|&b| b == 7));
    }

    /// Activation rows that do not fit the weight row are refused before any kernel reads
    /// them (the SIMD kernels would read past their ends).
    #[test]
    fn rows_that_do_not_fit_the_weight_row_are_refused() {
        let k = 64;
        let w = quantized(QuantType::Q4_1, &values(k, 61), k);
        let no_sums = QuantizedActs::quantize(ActFormat::Q8_0, &values(k, 62), k);
        let short = QuantizedActs::quantize(ActFormat::Q8_1, &values(k / 2, 63), k / 2);
        assert!(row_fits(
            QuantType::Q4_1,
            &w,
            &QuantizedActs::quantize(ActFormat::Q8_1, &values(k, 64), k).row(0)
        ));
        for x in [no_sums.row(0), short.row(0)] {
            assert!(!row_fits(QuantType::Q4_1, &w, &x));
            let run = std::panic::AssertUnwindSafe(|| {
                dot_rows::<1>(Isa::best_available(), QuantType::Q4_1, &w, &[x])
            });
            assert!(std::panic::catch_unwind(run).is_err());
        }
    }

    /// The integer path agrees with dequantize-then-f32 up to the activation quantization
    /// error (8-bit codes: relative error well under 1 %).
    #[test]
    fn integer_dot_is_close_to_dequantized_f32() {
        for ty in TYPES {
            let k = 1024;
            let w = values(16 * k, 21);
            let x = values(3 * k, 22);
            let bytes = quantized(ty, &w, k);
            let mut got = vec![0.0f32; 3 * 16];
            qmatmul(&x, ty, &bytes, 16, k, &mut got);
            let mut wf = vec![0.0f32; k];
            let rb = ty.row_bytes(k).unwrap();
            let mut err = 0.0f64;
            let mut norm = 0.0f64;
            for j in 0..16 {
                dequantize_row(ty, &bytes[j * rb..(j + 1) * rb], &mut wf).unwrap();
                for i in 0..3 {
                    let want: f64 = (0..k).map(|t| x[i * k + t] as f64 * wf[t] as f64).sum();
                    err += (got[i * 16 + j] as f64 - want).powi(2);
                    norm += want * want;
                }
            }
            let rel = (err / norm).sqrt();
            assert!(rel < 0.01, "{ty}: relative error {rel}");
            assert!(rel > 0.0, "{ty}: activations were not quantized at all?");
        }
    }

    /// Q4_K rows of every kind for the interleaving tests: quantized values, random bytes,
    /// and the edge blocks (largest codes, sub-scales and mins; zero; mixed) with several
    /// f16 scales, row after row.
    fn q4k_rows(n: usize, k: usize, seed: u64) -> Vec<u8> {
        let nb = k / QK_K;
        let mut w = Vec::new();
        for r in 0..n {
            let row = match r % 5 {
                0 => quantized(QuantType::Q4_K, &values(k, seed + r as u64), k),
                1 => blocks(QuantType::Q4_K, nb, seed + r as u64, Fill::Random, 0.02),
                2 => blocks(QuantType::Q4_K, nb, 0, Fill::Max, 65504.0),
                3 => blocks(QuantType::Q4_K, nb, 0, Fill::Zero, 1.0),
                _ => (0..nb)
                    .flat_map(|b| {
                        let fill = [Fill::Max, Fill::Random, Fill::Zero][b % 3];
                        blocks(
                            QuantType::Q4_K,
                            1,
                            seed + b as u64,
                            fill,
                            [6e-8, 0.5, 2.0][b % 3],
                        )
                    })
                    .collect(),
            };
            w.extend(row);
        }
        w
    }

    /// Interleaving keeps every byte: each row read back from the interleaved records is the
    /// file's row.
    #[test]
    fn interleaved_rows_read_back_as_the_files_rows() {
        for (n, k) in [(8, 256), (16, 768), (24, 2048)] {
            let w = q4k_rows(n, k, 11 + k as u64);
            let packed = interleaved::interleave(&w, n, k);
            assert_eq!(
                packed.len(),
                n / 8 * k / QK_K * interleaved::GROUP_BLOCK_BYTES
            );
            let rb = QuantType::Q4_K.row_bytes(k).unwrap();
            for r in 0..n {
                assert_eq!(
                    interleaved::row(&packed, k, r),
                    &w[r * rb..(r + 1) * rb],
                    "{n}x{k} row {r}"
                );
            }
        }
    }

    /// Products on interleaved rows give, for every (activation row, weight row), the scalar
    /// reference's bits on the file's row: the scalar group reference, the kernel for one and
    /// for four activation rows, and whole products of 1 to 9 rows at 1 and 3 threads, beside
    /// the same products on the file's layout.
    #[test]
    #[allow(clippy::needless_range_loop)] // a row index for the results and the wanted bits
    fn interleaved_products_give_the_reference_bits() {
        for (n, k) in [(8, 256), (24, 768), (40, 1280)] {
            let w = q4k_rows(n, k, 20 + n as u64);
            let packed = interleaved::interleave(&w, n, k);
            let rb = QuantType::Q4_K.row_bytes(k).unwrap();
            let gb = k / QK_K * interleaved::GROUP_BLOCK_BYTES;
            let mut x = edge_activations(k, 31);
            x.extend(values(4 * k, 32));
            let acts = QuantizedActs::quantize(ActFormat::Q8K, &x, k);
            let m = x.len() / k;
            let want = |i: usize, j: usize| {
                dot_ref(QuantType::Q4_K, &w[j * rb..(j + 1) * rb], acts.row(i)).to_bits()
            };
            for g in 0..n / 8 {
                let group = &packed[g * gb..(g + 1) * gb];
                for i in 0..m {
                    let got = interleaved::dot_group_ref(group, acts.row(i));
                    for r in 0..8 {
                        assert_eq!(
                            got[r].to_bits(),
                            want(i, 8 * g + r),
                            "ref {n}x{k} {i},{g}.{r}"
                        );
                    }
                    for (kernel, got) in group_kernels::<1>(group, &[acts.row(i)]) {
                        for r in 0..8 {
                            assert_eq!(got[0][r].to_bits(), want(i, 8 * g + r), "{kernel} {i}");
                        }
                    }
                }
                /// Every group kernel this machine runs on `rows` (scalar, AVX2, AVX-512).
                fn group_kernels<const R: usize>(
                    group: &[u8],
                    rows: &[ActRow<'_>; R],
                ) -> Vec<(&'static str, [[f32; 8]; R])> {
                    // SAFETY: the rows were quantized for this width: they fit the group.
                    let mut all = vec![("scalar", unsafe {
                        dot_group::<R>(Isa::Scalar, group, rows)
                    })];
                    #[cfg(target_arch = "x86_64")]
                    if crate::tensor::kernels::avx2_fma_f16c() {
                        // SAFETY: AVX2, FMA and F16C detected; the rows fit.
                        all.push(("avx2", unsafe {
                            interleaved::avx2::dot_group::<R>(group, rows)
                        }));
                        if vnni() {
                            // At the prefetch distances of the CPUs measured and the most
                            // taken (hints past the group's end: the same bits).
                            for (name, ahead) in [
                                ("avx512 prefetching the record in hand", 0),
                                ("avx512 prefetching 8 ahead", 8),
                                ("avx512 prefetching the most ahead", usize::MAX),
                            ] {
                                prefetch::set_records_ahead(Some(ahead));
                                // SAFETY: and AVX-512 F, BW, VNNI.
                                all.push((name, unsafe {
                                    interleaved::avx512::dot_group::<R>(group, rows)
                                }));
                            }
                            prefetch::set_records_ahead(None);
                        } else {
                            eprintln!("no AVX-512 VNNI here: its interleaved kernel is not tested");
                        }
                    }
                    all
                }
                fn several<const R: usize>(
                    group: &[u8],
                    acts: &QuantizedActs,
                    want: &dyn Fn(usize, usize) -> u32,
                    g: usize,
                ) {
                    let m = acts.qs.len() / acts.cols;
                    for i0 in 0..=m - R {
                        let rows: [ActRow; R] = std::array::from_fn(|d| acts.row(i0 + d));
                        for (kernel, got) in group_kernels::<R>(group, &rows) {
                            for (d, row) in got.iter().enumerate() {
                                for r in 0..8 {
                                    let at = (i0 + d, 8 * g + r);
                                    let w = want(at.0, at.1);
                                    assert_eq!(row[r].to_bits(), w, "{kernel} x{R} {at:?}");
                                }
                            }
                        }
                    }
                }
                several::<2>(group, &acts, &want, g);
                several::<3>(group, &acts, &want, g);
                several::<4>(group, &acts, &want, g);
            }
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                for rows in [1usize, 2, 3, 4, 5, 7, 9] {
                    let xs = &x[..rows * k];
                    let mut got = vec![0.0f32; rows * n];
                    let mut plain = vec![0.0f32; rows * n];
                    pool.install(|| {
                        let mut mats = [QMat {
                            ty: QuantType::Q4_K,
                            bytes: &packed,
                            n,
                            out: &mut got,
                            interleaved: true,
                        }];
                        qmatmul_multi(xs, k, &mut mats);
                        qmatmul(xs, QuantType::Q4_K, &w, n, k, &mut plain);
                    });
                    for i in 0..rows {
                        for j in 0..n {
                            let at = i * n + j;
                            assert_eq!(got[at].to_bits(), want(i, j), "{threads}t {rows} rows");
                            assert_eq!(plain[at].to_bits(), got[at].to_bits());
                        }
                    }
                }
            }
        }
    }

    /// Prefill of many rows on interleaved matrices (tiles filled from the records where the
    /// tiled kernels run, the group kernels elsewhere) gives the scalar reference's bits on the
    /// file's rows, as the same product on the file's layout does.
    #[test]
    fn interleaved_prefill_gives_the_reference_bits() {
        let (n, k) = (24, 512);
        let w = q4k_rows(n, k, 77);
        let packed = interleaved::interleave(&w, n, k);
        let rb = QuantType::Q4_K.row_bytes(k).unwrap();
        for m in [TILED_MIN_ROWS, TILED_MIN_ROWS + 7] {
            let mut x = edge_activations(k, 5);
            x.extend(values((m - x.len() / k) * k, 6));
            let acts = QuantizedActs::quantize(ActFormat::Q8K, &x, k);
            let mut got = vec![0.0f32; m * n];
            let mut plain = vec![0.0f32; m * n];
            let mut mats = [QMat {
                ty: QuantType::Q4_K,
                bytes: &packed,
                n,
                out: &mut got,
                interleaved: true,
            }];
            qmatmul_multi(&x, k, &mut mats);
            qmatmul(&x, QuantType::Q4_K, &w, n, k, &mut plain);
            for i in 0..m {
                for j in 0..n {
                    let want = dot_ref(QuantType::Q4_K, &w[j * rb..(j + 1) * rb], acts.row(i));
                    let at = i * n + j;
                    assert_eq!(got[at].to_bits(), want.to_bits(), "{m} rows: {i},{j}");
                    assert_eq!(plain[at].to_bits(), want.to_bits(), "file's rows {i},{j}");
                }
            }
        }
    }

    /// Batch size and thread count never change a result.
    #[test]
    fn batch_and_threads_do_not_change_bits() {
        for ty in TYPES.into_iter().chain([QuantType::MXFP4]) {
            let (n, k, m) = (70, 512, 9);
            let w = values(n * k, 31);
            let x = values(m * k, 32);
            let bytes = quantized(ty, &w, k);
            let pool = |t| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(t)
                    .build()
                    .unwrap()
            };
            let mut batch = vec![0.0f32; m * n];
            pool(1).install(|| qmatmul(&x, ty, &bytes, n, k, &mut batch));
            let mut threaded = vec![0.0f32; m * n];
            pool(3).install(|| qmatmul(&x, ty, &bytes, n, k, &mut threaded));
            assert_eq!(
                batch.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                threaded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{ty}: threads"
            );
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for i in 0..m {
                let mut alone = vec![0.0f32; n];
                qmatmul(&x[i * k..(i + 1) * k], ty, &bytes, n, k, &mut alone);
                // One activation row (decode) runs every weight row of a task through one
                // kernel choice: each result is the scalar reference's.
                if let Some(format) = act_format(ty) {
                    let acts = QuantizedActs::quantize(format, &x[i * k..(i + 1) * k], k);
                    let rb = ty.row_bytes(k).unwrap();
                    for (j, got) in alone.iter().enumerate() {
                        let want = dot_ref(ty, &bytes[j * rb..(j + 1) * rb], acts.row(0));
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{ty}: row {i} alone, weight row {j}"
                        );
                    }
                }
                assert_eq!(
                    bits(&alone),
                    bits(&batch[i * n..(i + 1) * n]),
                    "{ty}: row {i} alone vs in a batch of {m}"
                );
                // Among every smaller batch that holds it (1..9 rows: groups of four and the
                // single-row tail in every mix).
                for rows in i + 1..m {
                    let mut some = vec![0.0f32; rows * n];
                    qmatmul(&x[..rows * k], ty, &bytes, n, k, &mut some);
                    assert_eq!(
                        bits(&alone),
                        bits(&some[i * n..(i + 1) * n]),
                        "{ty}: row {i} alone vs in a batch of {rows}"
                    );
                }
            }
        }
    }

    /// Q4_K, Q5_K and Q6_K products of many rows (the tiled kernels, where AVX-512 VNNI runs) give
    /// every element the scalar reference's bits, so a row's result is the same alone or in a
    /// batch: full and partial bands (64, 65, 80, 97 rows), tiles of 8 and single weight rows
    /// (heights 8, 12, 13, 29), one to eight super-blocks, random and extreme blocks (largest
    /// codes and scales, zero, subnormal scales) against random, zero, saturated and tiny
    /// activations, through `qmatmul` and through a grouped step beside a small group and the
    /// other format.
    #[test]
    fn many_row_k_quant_products_give_the_reference_bits() {
        #[cfg(target_arch = "x86_64")]
        if !tiled_kernels() {
            eprintln!(
                "note: no AVX-512 VNNI here: the tiled Q4_K/Q5_K/Q6_K kernels are not exercised"
            );
        }
        let check = |ty: QuantType, w: &[u8], n: usize, x: &[f32], out: &[f32], what: &str| {
            let k = x.len() / (out.len() / n);
            let m = x.len() / k;
            let acts = QuantizedActs::quantize(ActFormat::Q8K, x, k);
            let rb = w.len() / n;
            for i in 0..m {
                for j in 0..n {
                    let want = dot_ref(ty, &w[j * rb..(j + 1) * rb], acts.row(i));
                    assert_eq!(
                        out[i * n + j].to_bits(),
                        want.to_bits(),
                        "{ty} {what}: row {i} of {m}, weight row {j} of {n}, k {k}"
                    );
                }
            }
        };
        let shapes = [(29, 512, 64), (12, 256, 80), (13, 2048, 65), (8, 768, 97)];
        for (ty, other) in [
            (QuantType::Q4_K, QuantType::Q6_K),
            (QuantType::Q6_K, QuantType::Q4_K),
            (QuantType::Q5_K, QuantType::Q6_K),
        ] {
            for (s, &(n, k, m)) in shapes.iter().enumerate() {
                let seed = 300 + 10 * s as u64;
                let mut x = edge_activations(k, seed);
                while x.len() < m * k {
                    x.extend(values(k, seed + x.len() as u64));
                }
                x.truncate(m * k);
                let nb = n * k / QK_K;
                let weights = [
                    quantized(ty, &values(n * k, seed + 1), k),
                    blocks(ty, nb, seed + 2, Fill::Random, 0.01),
                    blocks(ty, nb, seed + 3, Fill::Max, 65504.0),
                    blocks(ty, nb, seed + 4, Fill::Zero, 1.0),
                    blocks(ty, nb, seed + 5, Fill::Random, 6e-8),
                ];
                for (c, w) in weights.iter().enumerate() {
                    // Both paths (other tests running meanwhile get the same bits either way).
                    for tiled in [true, false] {
                        set_tiled_kernels(tiled);
                        let mut out = vec![0.0f32; m * n];
                        qmatmul(&x, ty, w, n, k, &mut out);
                        set_tiled_kernels(true);
                        check(
                            ty,
                            w,
                            n,
                            &x,
                            &out,
                            &format!("qmatmul, weights {c}, {tiled}"),
                        );
                    }
                }
                // A grouped step: this group with a matrix of the other format, beside a small
                // group.
                let small = values(3 * k, seed + 6);
                let w2 = quantized(other, &values(n * k, seed + 7), k);
                let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
                let mut c = vec![0.0; 3 * n];
                let mat = |ty, bytes, out| QMat {
                    ty,
                    bytes,
                    n,
                    out,
                    interleaved: false,
                };
                let mut big = vec![mat(ty, &weights[0], &mut a), mat(other, &w2, &mut b)];
                let mut little = vec![mat(ty, &weights[1], &mut c)];
                qmatmul_groups(
                    k,
                    &mut [
                        QGroup {
                            x: &x,
                            mats: &mut big,
                        },
                        QGroup {
                            x: &small,
                            mats: &mut little,
                        },
                    ],
                );
                check(ty, &weights[0], n, &x, &a, "grouped");
                check(other, &w2, n, &x, &b, "grouped, other format");
                check(ty, &weights[1], n, &small, &c, "grouped, small group");
            }
        }
    }

    /// Shared activations and one parallel step change no bit of either product, including when
    /// the formats differ (then the products run apart).
    #[test]
    fn multi_equals_separate_products() {
        let (k, m) = (512, 5);
        let x = values(m * k, 41);
        for (ta, tb) in [
            (QuantType::Q4_K, QuantType::Q4_K),
            (QuantType::Q4_K, QuantType::Q6_K),
            (QuantType::Q8_0, QuantType::Q4_K),
            (QuantType::Q5_K, QuantType::Q5_K),
        ] {
            let (na, nb) = (33, 70);
            let wa = quantized(ta, &values(na * k, 42), k);
            let wb = quantized(tb, &values(nb * k, 43), k);
            let (mut sa, mut sb) = (vec![0.0f32; m * na], vec![0.0f32; m * nb]);
            qmatmul(&x, ta, &wa, na, k, &mut sa);
            qmatmul(&x, tb, &wb, nb, k, &mut sb);
            let (mut ya, mut yb) = (vec![0.0f32; m * na], vec![0.0f32; m * nb]);
            qmatmul_multi(
                &x,
                k,
                &mut [
                    QMat {
                        ty: ta,
                        bytes: &wa,
                        n: na,
                        out: &mut ya,
                        interleaved: false,
                    },
                    QMat {
                        ty: tb,
                        bytes: &wb,
                        n: nb,
                        out: &mut yb,
                        interleaved: false,
                    },
                ],
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ya), bits(&sa), "{ta}/{tb}: first");
            assert_eq!(bits(&yb), bits(&sb), "{ta}/{tb}: second");
        }
    }

    /// One parallel step over several activation sets (a MoE layer's experts, each with its own
    /// rows: 1, 3, 4, 9 and 17 of them, so every row-group tail is hit) changes no bit of any
    /// product, for every block format (integer and dequantized paths), with mixed formats,
    /// and on 1 or 3 threads.
    #[test]
    fn groups_equal_separate_products() {
        let k = 256;
        let ms = [1usize, 3, 4, 9, 17];
        let n = 37;
        let mut cases: Vec<Vec<QuantType>> = QuantType::ALL
            .into_iter()
            .filter(|t| t.row_bytes(k).is_ok())
            .map(|t| vec![t; ms.len()])
            .collect();
        cases.push(vec![
            QuantType::Q4_K,
            QuantType::Q8_0,
            QuantType::Q4_K,
            QuantType::MXFP4,
            QuantType::Q6_K,
        ]);
        for tys in cases {
            let xs: Vec<Vec<f32>> = ms
                .iter()
                .enumerate()
                .map(|(g, &m)| values(m * k, 100 + g as u64))
                .collect();
            // Two matrices per group (gate and up), of the group's type.
            let ws: Vec<[Vec<u8>; 2]> = tys
                .iter()
                .enumerate()
                .map(|(g, &ty)| {
                    [0u64, 1].map(|h| quantized(ty, &values(n * k, 200 + 2 * g as u64 + h), k))
                })
                .collect();
            let mut alone = Vec::new();
            for (g, &ty) in tys.iter().enumerate() {
                for w in &ws[g] {
                    let mut out = vec![0.0f32; ms[g] * n];
                    qmatmul(&xs[g], ty, w, n, k, &mut out);
                    alone.push(out);
                }
            }
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut outs: Vec<Vec<f32>> =
                    alone.iter().map(|o| vec![f32::NAN; o.len()]).collect();
                pool.install(|| {
                    let mut mats: Vec<Vec<QMat<'_>>> = Vec::new();
                    let mut rest = outs.as_mut_slice();
                    for (g, &ty) in tys.iter().enumerate() {
                        let (two, tail) = rest.split_at_mut(2);
                        rest = tail;
                        let [a, b] = two else { unreachable!() };
                        mats.push(vec![
                            QMat {
                                ty,
                                bytes: &ws[g][0],
                                n,
                                out: a,
                                interleaved: false,
                            },
                            QMat {
                                ty,
                                bytes: &ws[g][1],
                                n,
                                out: b,
                                interleaved: false,
                            },
                        ]);
                    }
                    let mut groups: Vec<QGroup<'_, '_, '_>> = xs
                        .iter()
                        .zip(mats.iter_mut())
                        .map(|(x, mats)| QGroup { x, mats })
                        .collect();
                    qmatmul_groups(k, &mut groups);
                });
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for (i, (got, want)) in outs.iter().zip(&alone).enumerate() {
                    assert_eq!(
                        bits(got),
                        bits(want),
                        "{tys:?}, {threads} threads: product {i}"
                    );
                }
            }
        }
    }

    /// Q8_0 activation quantization: scale is max|x|/127 rounded to f16, codes round to
    /// nearest even, the largest value maps to ±127.
    #[test]
    fn activation_quantization_follows_ggml() {
        let mut x = vec![0.0f32; 32];
        x[..5].copy_from_slice(&[127.0, -63.5, 0.5, 1.5, 2.5]); // 127 / max|x| = 1 exactly
        let a = QuantizedActs::quantize(ActFormat::Q8_0, &x, 32);
        assert_eq!(&a.qs[..5], &[127, -64, 0, 2, 2]);
        assert_eq!(a.d[0], 1.0);
        let k = QuantizedActs::quantize(ActFormat::Q8K, &values(256, 3), 256);
        let total: i32 = k.qs.iter().map(|&q| q as i32).sum();
        assert_eq!(k.bsums.iter().sum::<i32>(), total);
        assert!(k.qs.iter().any(|&q| q == 127 || q == -127));
        // Q8_K scales by the value of largest magnitude, the first where two tie: here −2
        // (before +2), so iscale = −127 / −2 = 63.5 and −2 → −127, +2 → 127 (clamped at 127).
        let mut x = vec![0.0f32; 256];
        x[..4].copy_from_slice(&[0.5, -2.0, 1.0, 2.0]);
        let k = QuantizedActs::quantize(ActFormat::Q8K, &x, 256);
        assert_eq!(&k.qs[..4], &[32, -127, 64, 127]);
        assert_eq!(k.d[0], 1.0 / 63.5f32);
        // A NaN is never that value: the scale comes from the largest number (here +1).
        x[..4].copy_from_slice(&[f32::NAN, 1.0, -0.5, 0.25]);
        let k = QuantizedActs::quantize(ActFormat::Q8K, &x, 256);
        assert_eq!(k.d[0], 1.0 / -127.0f32);
        assert_eq!(&k.qs[1..4], &[-127, 64, -32]);
    }
}
