//! Q6_K matrices with their rows interleaved in eights, for products against one activation
//! row (decode).
//!
//! The file's Q6_K row kernel spends most of a decode step's work on what every block repeats
//! per row: spreading its sixteen scales, the activation loads, the offset term and the float
//! steps (docs/benchmarks.md §29). As for Q4_K ([`super`]), eight rows' super-block `b` are one
//! [`RECORD_BYTES`] record whose fields hold the eight rows side by side, so that work is done
//! once for eight rows and each activation code, broadcast, feeds eight rows' products. The
//! record is exactly the eight file blocks' bytes (1680), rearranged:
//!
//! | bytes | field |
//! |---|---|
//! | 0..16 | `d` of rows 0..8 (f16) |
//! | 16..144 | scale of 16-element sub-block `2j + h` of row `r` at `16 + 16j + 8h + r` (i8) |
//! | 144..1168 | the codes' low four bits, as Q4_K's record codes ([`super`]): for group `j` and `v` in 0..4, 32 bytes at `144 + 32(4j + v)`: byte `16t + 4s + e` holds, for lane `u = v + 4t`, element `32j + 4u + e` of row `s` (low nibble) and of row `4 + s` (high nibble) |
//! | 1168..1680 | the codes' top two bits: for group `j` and `w` in 0..2, 32 bytes at `1168 + 32(2j + w)` for the 64 low-bit bytes at `144 + 64(2j + w)`: byte `i` holds, in bits 0-1, 2-3, 4-5 and 6-7, those of the low nibble of byte `i`, the low nibble of byte `32 + i`, the high nibble of byte `i`, the high nibble of byte `32 + i` |
//!
//! The canonical order is untouched: lane `u` of row `r` takes
//! `Σ_j sc_{2j + [u ≥ 4]} · Σ_{e<4} q(32j + 4u + e) · y(32j + 4u + e)` less
//! `32 · (sc_u · bsum_u + sc_{8+u} · bsum_{8+u})`, the same exact integers, then the same f32
//! steps `acc_u += (d·d_x) · sumi_u`, folded by `fold8`: the scalar reference's bits on the
//! file's row (tested).
//!
//! Products of several activation rows (prefill) read the file's rows, which the tiled and row
//! kernels take; only one-row products read these records ([`super::takes`]).

// Row, lane and group indices address several arrays at once here.
#![allow(clippy::needless_range_loop)]

use crate::tensor::qmatmul::{q6k_code, ActRow};
use crate::tensor::quant::{QuantType, QK_K};

/// Rows interleaved together.
pub const GROUP_ROWS: usize = super::GROUP_ROWS;

/// Bytes of one record: eight rows' super-block.
pub const RECORD_BYTES: usize = 8 * Q6K_BLOCK;

const Q6K_BLOCK: usize = 210;
const SC_AT: usize = 16;
const LOW_AT: usize = 144;
const HIGH_AT: usize = 1168;

/// Bytes of the interleaved layout of a `rows × cols` Q6_K matrix that [`super::fits`]: the
/// file's bytes.
pub fn interleaved_bytes(rows: usize, cols: usize) -> usize {
    rows / GROUP_ROWS * (cols / QK_K) * RECORD_BYTES
}

/// The interleaved layout of `rows` Q6_K rows of `cols` values (`bytes`, the file's layout)
/// into `out` ([`interleaved_bytes`] long; every byte is written), groups in parallel on the
/// current thread pool.
///
/// # Panics
/// If the matrix does not [`fit`](super::fits) or `bytes` or `out` is not its size.
pub fn interleave_into(bytes: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    use rayon::prelude::*;
    assert!(
        super::fits(rows, cols),
        "a {rows}×{cols} matrix cannot be interleaved in eights"
    );
    let nb = cols / QK_K;
    let row_bytes = nb * Q6K_BLOCK;
    assert_eq!(
        bytes.len(),
        rows * row_bytes,
        "Q6_K bytes do not match the shape"
    );
    assert_eq!(
        out.len(),
        interleaved_bytes(rows, cols),
        "wrong output size"
    );
    out.par_chunks_exact_mut(nb * RECORD_BYTES)
        .enumerate()
        .for_each(|(g, group)| {
            let rows_of = &bytes[g * GROUP_ROWS * row_bytes..(g + 1) * GROUP_ROWS * row_bytes];
            for (b, rec) in group.chunks_exact_mut(RECORD_BYTES).enumerate() {
                let blocks: [&[u8]; GROUP_ROWS] =
                    std::array::from_fn(|r| &rows_of[r * row_bytes + b * Q6K_BLOCK..][..Q6K_BLOCK]);
                fill_record(rec, &blocks);
            }
        });
}

/// The interleaved layout of `rows` Q6_K rows of `cols` values.
///
/// # Panics
/// As [`interleave_into`].
pub fn interleave(bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; interleaved_bytes(rows, cols)];
    interleave_into(bytes, rows, cols, &mut out);
    out
}

/// Where the low four bits of element `e` of row `r` are in a record (the low nibble for rows
/// 0..4, the high for 4..8).
fn low_at(r: usize, e: usize) -> usize {
    let (j, u, k) = (e / 32, e % 32 / 4, e % 4);
    let (v, t) = (u % 4, u / 4);
    LOW_AT + 32 * (4 * j + v) + 16 * t + 4 * (r % 4) + k
}

/// Where the top two bits of element `e` of row `r` are in a record: the byte and the shift.
fn high_at(r: usize, e: usize) -> (usize, u32) {
    // Offset of the low-bit byte inside its 64-byte vector (group j, pair w = v / 2).
    let o = low_at(r, e) - LOW_AT;
    let (vector, p) = (o / 64, o % 64);
    (
        HIGH_AT + 32 * vector + p % 32,
        (2 * (p / 32) + 4 * (r / 4)) as u32,
    )
}

/// Where the scale of sub-block `sb` (0..16) of row `r` is in a record.
fn scale_at(r: usize, sb: usize) -> usize {
    SC_AT + 16 * (sb / 2) + 8 * (sb % 2) + r
}

/// One record from the eight rows' super-blocks in the file's layout.
fn fill_record(rec: &mut [u8], blocks: &[&[u8]; GROUP_ROWS]) {
    rec.fill(0);
    for (r, wb) in blocks.iter().enumerate() {
        rec[2 * r..2 * r + 2].copy_from_slice(&wb[208..210]);
        for sb in 0..16 {
            rec[scale_at(r, sb)] = wb[192 + sb];
        }
        let shift = 4 * (r / 4) as u32;
        for e in 0..QK_K {
            let q = q6k_code(wb, e) as u8;
            rec[low_at(r, e)] |= (q & 0xf) << shift;
            let (at, s) = high_at(r, e);
            rec[at] |= (q >> 4) << s;
        }
    }
}

/// The 6-bit code of element `e` of row `r` in a record.
fn code(rec: &[u8], r: usize, e: usize) -> u8 {
    let low = (rec[low_at(r, e)] >> (4 * (r / 4))) & 0xf;
    let (at, s) = high_at(r, e);
    low | (((rec[at] >> s) & 3) << 4)
}

/// Row `r` of an interleaved matrix (`packed`, rows of `cols` values) in the file's layout:
/// the inverse of [`interleave`].
pub fn row(packed: &[u8], cols: usize, r: usize) -> Vec<u8> {
    let nb = cols / QK_K;
    let group = &packed[r / GROUP_ROWS * nb * RECORD_BYTES..][..nb * RECORD_BYTES];
    let r = r % GROUP_ROWS;
    let mut out = vec![0u8; nb * Q6K_BLOCK];
    for (rec, wb) in group
        .chunks_exact(RECORD_BYTES)
        .zip(out.chunks_exact_mut(Q6K_BLOCK))
    {
        wb[208..210].copy_from_slice(&rec[2 * r..2 * r + 2]);
        for sb in 0..16 {
            wb[192 + sb] = rec[scale_at(r, sb)];
        }
        // ggml's Q6_K: element e = 128h + 32s + l takes the low (s < 2) or high nibble of
        // ql[64h + l + 32(s & 1)] and bits 2s of qh[32h + l] (`q6k_code`).
        for e in 0..QK_K {
            let q = code(rec, r, e);
            let (h, s, l) = (e / 128, e % 128 / 32, e % 32);
            wb[64 * h + l + 32 * (s & 1)] |= (q & 0xf) << (4 * (s / 2));
            wb[128 + 32 * h + l] |= (q >> 4) << (2 * s);
        }
    }
    out
}

/// The eight rows of one group (`nb` records) against one activation row, by the scalar
/// reference on the rows read back (the path where no kernel for the records runs).
pub(in crate::tensor::qmatmul) fn dot_group_ref(group: &[u8], x: ActRow<'_>) -> [f32; GROUP_ROWS] {
    let cols = group.len() / RECORD_BYTES * QK_K;
    std::array::from_fn(|r| {
        crate::tensor::qmatmul::dot_ref(QuantType::Q6_K, &row(group, cols, r), x)
    })
}

#[cfg(target_arch = "x86_64")]
pub(in crate::tensor::qmatmul) mod avx512 {
    //! The AVX-512 VNNI kernel for one activation row, in the lanes of the Q4_K one
    //! ([`super::super::avx512`]): vector `(w, h)` holds lane pairs `2w`, `2w + 1` of rows
    //! `4h..4h + 4`, i32 lane `4q + s` being row `4h + s`, lane `lane_of(w, q)`.

    use std::arch::x86_64::*;

    use super::super::avx512::{lane_of, ACTS, PAIRS};
    use super::{ActRow, GROUP_ROWS, HIGH_AT, LOW_AT, RECORD_BYTES, SC_AT};
    use crate::tensor::qmatmul::avx2::prefetch;
    use crate::tensor::quant::QK_K;

    /// `vpshufb` controls giving i32 lane `s` of every 128-bit lane the i16 pair `(sc, sc)` of
    /// i16 scale `4h + s` of that 128-bit lane.
    const SPREAD16: [[i8; 64]; 2] = {
        let mut t = [[0i8; 64]; 2];
        let mut h = 0;
        while h < 2 {
            let mut byte = 0;
            while byte < 64 {
                let s = byte % 16 / 4;
                t[h][byte] = (2 * (4 * h + s) + byte % 2) as i8;
                byte += 1;
            }
            h += 1;
        }
        t
    };

    /// `vpermps` indices giving lane `4q + s` the `d` of row `4h + s`.
    const D_INDEX: [[i32; 16]; 2] = {
        let mut t = [[0i32; 16]; 2];
        let mut h = 0;
        while h < 2 {
            let mut l = 0;
            while l < 16 {
                t[h][l] = (4 * h + l % 4) as i32;
                l += 1;
            }
            h += 1;
        }
        t
    };

    /// The group's eight rows against one activation row.
    ///
    /// # Safety
    /// AVX2, FMA, F16C, AVX-512 F, BW and VNNI, and GFNI must be available; `group` is whole records,
    /// and `x` fits them: codes `b·256..+256`, `bsums[b·16..+16]` and `d[b]` exist for every
    /// record `b`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,gfni")]
    pub(in crate::tensor::qmatmul) unsafe fn dot_group(
        group: &[u8],
        x: ActRow<'_>,
    ) -> [f32; GROUP_ROWS] {
        let mut acc = [[_mm512_setzero_ps(); 2]; 2];
        let m4 = _mm512_set1_epi8(0xf);
        // Top-bit fields moved to bits 4-5 of every byte, the other bits cleared, by GF(2)
        // affine maps (output bit i takes the input bits set in byte 7 - i of the 64-bit
        // lane's matrix): of the low nibbles (bits 0-1 in bytes 0..32, 2-3 in 32..64) and of
        // the high nibbles (bits 4-5, 6-7).
        let to_low = _mm512_setr_epi64(
            0x0102_0000,
            0x0102_0000,
            0x0102_0000,
            0x0102_0000,
            0x0408_0000,
            0x0408_0000,
            0x0408_0000,
            0x0408_0000,
        );
        let to_high = _mm512_setr_epi64(
            0x1020_0000,
            0x1020_0000,
            0x1020_0000,
            0x1020_0000,
            0x4080_0000,
            0x4080_0000,
            0x4080_0000,
            0x4080_0000,
        );
        let load = |t: &[i8; 64]| {
            // SAFETY: 64 readable bytes.
            unsafe { _mm512_loadu_si512(t.as_ptr() as *const __m512i) }
        };
        let load32 = |t: &[i32; 16]| {
            // SAFETY: 64 readable bytes.
            unsafe { _mm512_loadu_si512(t.as_ptr() as *const __m512i) }
        };
        let spread = [load(&SPREAD16[0]), load(&SPREAD16[1])];
        let act_ctl = [load(&ACTS[0]), load(&ACTS[1])];
        let pair_idx = [load32(&PAIRS[0]), load32(&PAIRS[1])];
        let d_idx = [load32(&D_INDEX[0]), load32(&D_INDEX[1])];
        // 128-bit lanes 0 of a, 0 of b, 1 of a, 1 of b.
        let take_lanes = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
        for (b, rec) in group.chunks_exact(RECORD_BYTES).enumerate() {
            // Every line of the next record asked for. On a Zen 4, one core streaming a
            // 32000-row matrix: 2.2-2.4 ms, against 4.3 ms asking for this record's lines (the
            // Q4_K records' choice) and 5.5 ms for the record two ahead.
            let p = rec.as_ptr();
            for line in 0..RECORD_BYTES.div_ceil(64) {
                prefetch(p, RECORD_BYTES + 64 * line);
            }
            // SAFETY: the row fits: d[b], bsums b·16..+16 exist.
            let (xd, bs) = unsafe {
                (
                    *x.d.get_unchecked(b),
                    _mm512_loadu_si512(x.bsums.as_ptr().add(b * 16) as *const __m512i),
                )
            };
            // d·d_x of rows 4h..4h + 4 in lanes 4q + s.
            // SAFETY: bytes 0..16 of the record.
            let dd = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) });
            let dd = _mm512_castps256_ps512(dd);
            let xv = _mm512_set1_ps(xd);
            let ds: [__m512; 2] =
                std::array::from_fn(|h| _mm512_mul_ps(_mm512_permutexvar_ps(d_idx[h], dd), xv));
            // Scales of group j as i16: sub-block 2j in 128-bit lanes 0, 2, 2j + 1 in 1, 3;
            // rows 0..8 in each.
            let s16: [__m512i; 8] = std::array::from_fn(|j| {
                // SAFETY: bytes SC_AT + 16j..+16 of the record (j < 8: inside 16..144).
                let v = unsafe { _mm_loadu_si128(p.add(SC_AT + 16 * j) as *const __m128i) };
                _mm512_broadcast_i64x4(_mm256_cvtepi8_epi16(v))
            });
            // The offset term of vector (w, h): sc_u·bsum_u + sc_{8+u}·bsum_{8+u} per lane.
            // bsum pairs (u, u + 8) as i16 in i32 lane u, then spread to the lanes.
            let b16 = _mm512_cvtepi32_epi16(bs);
            let (lo, hi) = (
                _mm256_castsi256_si128(b16),
                _mm256_extracti128_si256(b16, 1),
            );
            let bpairs = _mm512_castsi256_si512(_mm256_set_m128i(
                _mm_unpackhi_epi16(lo, hi),
                _mm_unpacklo_epi16(lo, hi),
            ));
            let mut off = [[_mm512_setzero_si512(); 2]; 2];
            for w in 0..2 {
                let bw = _mm512_permutexvar_epi32(pair_idx[w], bpairs);
                // Lane q of vector w needs sub-blocks u = lane_of(w, q) and u + 8: u of
                // group w (q = 0, 2) or w + 2 (q = 1, 3), halves q / 2.
                let su = _mm512_permutex2var_epi64(s16[w], take_lanes, s16[w + 2]);
                let su8 = _mm512_permutex2var_epi64(s16[w + 4], take_lanes, s16[w + 6]);
                off[w][0] = _mm512_dpwssd_epi32(off[w][0], _mm512_unpacklo_epi16(su, su8), bw);
                off[w][1] = _mm512_dpwssd_epi32(off[w][1], _mm512_unpackhi_epi16(su, su8), bw);
            }
            let mut sums = [[_mm512_setzero_si512(); 2]; 2];
            for j in 0..8 {
                let scv = [
                    _mm512_shuffle_epi8(s16[j], spread[0]),
                    _mm512_shuffle_epi8(s16[j], spread[1]),
                ];
                // SAFETY: the row fits: codes b·256 + 32j .. + 32 ≤ (b + 1)·256.
                let y = _mm512_broadcast_i64x4(unsafe {
                    _mm256_loadu_si256(x.qs.as_ptr().add(b * QK_K + 32 * j) as *const __m256i)
                });
                for w in 0..2 {
                    // SAFETY: inside the record (LOW_AT + 32·30 + 64 = 1168, HIGH_AT +
                    // 32·15 + 32 = 1680).
                    let (raw, top) = unsafe {
                        (
                            _mm512_loadu_si512(
                                p.add(LOW_AT + 32 * (4 * j + 2 * w)) as *const __m512i
                            ),
                            _mm512_broadcast_i64x4(_mm256_loadu_si256(
                                p.add(HIGH_AT + 32 * (2 * j + w)) as *const __m256i,
                            )),
                        )
                    };
                    // (nibble & 0xf) | top bits, in one ternary-logic step each.
                    let t0 = _mm512_gf2p8affine_epi64_epi8::<0>(top, to_low);
                    let t1 = _mm512_gf2p8affine_epi64_epi8::<0>(top, to_high);
                    let c0 = _mm512_ternarylogic_epi32::<0xec>(raw, t0, m4);
                    let c1 = _mm512_ternarylogic_epi32::<0xec>(_mm512_srli_epi16(raw, 4), t1, m4);
                    let yw = _mm512_shuffle_epi8(y, act_ctl[w]);
                    sums[w][0] =
                        _mm512_dpwssd_epi32(sums[w][0], _mm512_maddubs_epi16(c0, yw), scv[0]);
                    sums[w][1] =
                        _mm512_dpwssd_epi32(sums[w][1], _mm512_maddubs_epi16(c1, yw), scv[1]);
                }
            }
            for w in 0..2 {
                for h in 0..2 {
                    // Σ sc·(q − 32)·y = Σ sc·q·y − 32·Σ sc·bsum, exact in i32.
                    let sumi = _mm512_sub_epi32(sums[w][h], _mm512_slli_epi32(off[w][h], 5));
                    let t = _mm512_mul_ps(ds[h], _mm512_cvtepi32_ps(sumi));
                    acc[w][h] = _mm512_add_ps(acc[w][h], t);
                }
            }
        }
        // lanes[w][h][4q + s]: row 4h + s, lane lane_of(w, q).
        let mut lanes = [[[0.0f32; 16]; 2]; 2];
        for w in 0..2 {
            for h in 0..2 {
                // SAFETY: `lanes[w][h]` is 16 f32.
                unsafe { _mm512_storeu_ps(lanes[w][h].as_mut_ptr(), acc[w][h]) };
            }
        }
        let mut by_row = [[0.0f32; 8]; GROUP_ROWS];
        for w in 0..2 {
            for h in 0..2 {
                for q in 0..4 {
                    for s in 0..4 {
                        by_row[4 * h + s][lane_of(w, q)] = lanes[w][h][4 * q + s];
                    }
                }
            }
        }
        std::array::from_fn(|row| crate::tensor::qmatmul::fold8(&by_row[row]))
    }
}
