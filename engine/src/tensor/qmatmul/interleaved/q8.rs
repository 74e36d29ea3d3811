//! Q8_0 matrices with their rows interleaved in eights, for products against one activation
//! row (decode).
//!
//! The file's Q8_0 row kernel reduces every 32-code block of every row across its vector
//! lanes and gathers every row's block scales one by one: one core ran it at about 30 GB/s of
//! weights even from cache, no faster than it streams them from memory (docs/benchmarks.md
//! §30). Here eight rows' block `b` are one [`RECORD_BYTES`] record laid out so that the byte
//! products of all eight rows sum down the vector lanes, one row per lane, with no reduction
//! across lanes and the eight scales in one load. The record is the eight file blocks' bytes
//! (272), rearranged:
//!
//! | bytes | field |
//! |---|---|
//! | 0..16 | `d` of rows 0..8 (f16) |
//! | 16..272 | codes, each plus 128 (as `u8`): for `k` in 0..4, 64 bytes at `16 + 64k` whose i32 lane `i` holds codes `4(2k + i / 8)..+4` of row `i % 8` |
//!
//! `vpdpbusd` multiplies the unsigned codes by the activation codes (i32 lanes `i` holding
//! activation codes `4(2k + i / 8)..+4`), so after four of them and the sum of the two 256-bit
//! halves lane `r` holds `Σ (q + 128)·y = Σ q·y + 128·Σ y` of row `r`; less `128·Σ y` (one
//! number per block for all rows, computed once per product: [`activation_offsets`]) that is
//! the block's exact integer sum. Then the scalar reference's f32 steps, `acc_{b mod 8} +=
//! (d·d_x)·sumi`, one row per lane, folded by `fold8` per row: its bits on the file's row
//! (tested).
//!
//! Products of several activation rows (prefill) read the file's rows, which the tiled and row
//! kernels take; only one-row products read these records ([`super::takes`]).

// Row, lane and block indices address several arrays at once here.
#![allow(clippy::needless_range_loop)]

use crate::tensor::qmatmul::{ActRow, QK32};
use crate::tensor::quant::QuantType;

/// Rows interleaved together.
pub const GROUP_ROWS: usize = super::GROUP_ROWS;

/// Bytes of one Q8_0 block in the file.
const Q8_BLOCK: usize = 34;

/// Bytes of one record: eight rows' block.
pub const RECORD_BYTES: usize = 8 * Q8_BLOCK;

/// Where the codes start in a record.
const CODES_AT: usize = 16;

/// Bytes of the interleaved layout of a `rows × cols` Q8_0 matrix that [`super::fits`]: the
/// file's bytes.
pub fn interleaved_bytes(rows: usize, cols: usize) -> usize {
    rows / GROUP_ROWS * (cols / QK32) * RECORD_BYTES
}

/// Where code `e` (0..32) of row `r` is in a record.
fn code_at(r: usize, e: usize) -> usize {
    let dword = e / 4;
    let (k, half) = (dword / 2, dword % 2);
    CODES_AT + 64 * k + 4 * (8 * half + r) + e % 4
}

/// The interleaved layout of `rows` Q8_0 rows of `cols` values (`bytes`, the file's layout)
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
    let nb = cols / QK32;
    let row_bytes = nb * Q8_BLOCK;
    assert_eq!(
        bytes.len(),
        rows * row_bytes,
        "Q8_0 bytes do not match the shape"
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
                for r in 0..GROUP_ROWS {
                    let wb = &rows_of[r * row_bytes + b * Q8_BLOCK..][..Q8_BLOCK];
                    rec[2 * r..2 * r + 2].copy_from_slice(&wb[0..2]);
                    for e in 0..QK32 {
                        rec[code_at(r, e)] = wb[2 + e] ^ 0x80;
                    }
                }
            }
        });
}

/// The interleaved layout of `rows` Q8_0 rows of `cols` values.
///
/// # Panics
/// As [`interleave_into`].
pub fn interleave(bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; interleaved_bytes(rows, cols)];
    interleave_into(bytes, rows, cols, &mut out);
    out
}

/// Row `r` of an interleaved matrix (`packed`, rows of `cols` values) in the file's layout:
/// the inverse of [`interleave`].
pub fn row(packed: &[u8], cols: usize, r: usize) -> Vec<u8> {
    let nb = cols / QK32;
    let group = &packed[r / GROUP_ROWS * nb * RECORD_BYTES..][..nb * RECORD_BYTES];
    let r = r % GROUP_ROWS;
    let mut out = vec![0u8; nb * Q8_BLOCK];
    for (rec, wb) in group
        .chunks_exact(RECORD_BYTES)
        .zip(out.chunks_exact_mut(Q8_BLOCK))
    {
        wb[0..2].copy_from_slice(&rec[2 * r..2 * r + 2]);
        for e in 0..QK32 {
            wb[2 + e] = rec[code_at(r, e)] ^ 0x80;
        }
    }
    out
}

/// `128 · Σ y` of every 32-code block of an activation row: what the records' unsigned codes
/// add to each block's sum (exact: at most 128 · 32 · 128 in magnitude).
pub(in crate::tensor::qmatmul) fn activation_offsets(x: ActRow<'_>) -> Vec<i32> {
    x.qs.chunks_exact(QK32)
        .map(|y| 128 * y.iter().map(|&v| v as i32).sum::<i32>())
        .collect()
}

/// The eight rows of one group (`nb` records) against one activation row, by the scalar
/// reference on the rows read back (the path where no kernel for the records runs).
pub(in crate::tensor::qmatmul) fn dot_group_ref(group: &[u8], x: ActRow<'_>) -> [f32; GROUP_ROWS] {
    let cols = group.len() / RECORD_BYTES * QK32;
    std::array::from_fn(|r| {
        crate::tensor::qmatmul::dot_ref(QuantType::Q8_0, &row(group, cols, r), x)
    })
}

#[cfg(target_arch = "x86_64")]
pub(in crate::tensor::qmatmul) mod avx512 {
    //! The AVX-512 VNNI kernel for one activation row: i32 lane `r` of the 256-bit sums and
    //! f32 lane `r` of the accumulators are row `r`.

    use std::arch::x86_64::*;

    use super::{ActRow, CODES_AT, GROUP_ROWS, QK32, RECORD_BYTES};
    use crate::tensor::qmatmul::avx2::prefetch;

    /// `vpermd` indices giving i32 lanes `0..8` activation dword `2k` and lanes `8..16` dword
    /// `2k + 1` (of the block's 32 codes in the low 256 bits).
    const ACT_INDEX: [[i32; 16]; 4] = {
        let mut t = [[0i32; 16]; 4];
        let mut k = 0;
        while k < 4 {
            let mut i = 0;
            while i < 16 {
                t[k][i] = (2 * k + i / 8) as i32;
                i += 1;
            }
            k += 1;
        }
        t
    };

    /// The group's eight rows against one activation row.
    ///
    /// # Safety
    /// AVX2, FMA, F16C and AVX-512 F, BW and VNNI must be available; `group` is whole records,
    /// and `x` and `offsets` fit them: codes `b·32..+32`, `d[b]` and `offsets[b]` exist for
    /// every record `b`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    pub(in crate::tensor::qmatmul) unsafe fn dot_group(
        group: &[u8],
        x: ActRow<'_>,
        offsets: &[i32],
    ) -> [f32; GROUP_ROWS] {
        let idx: [__m512i; 4] = std::array::from_fn(|k| {
            // SAFETY: 64 readable bytes.
            unsafe { _mm512_loadu_si512(ACT_INDEX[k].as_ptr() as *const __m512i) }
        });
        let mut acc = [_mm256_setzero_ps(); 8];
        // This CPU's distance for streamed rows (`prefetch::plan_for`), whole lines.
        let ahead = crate::tensor::qmatmul::prefetch::row_bytes_ahead();
        let nb = group.len() / RECORD_BYTES;
        // One block's steps: acc[l] += (d·d_x)·sumi, one row per lane.
        let block = |acc: &mut __m256, b: usize, p: *const u8| {
            // SAFETY: record b is whole inside `group` (p points at it) and the row fits:
            // codes b·32..+32, d[b] and offsets[b] exist.
            unsafe {
                let y = _mm512_castsi256_si512(_mm256_loadu_si256(
                    x.qs.as_ptr().add(b * QK32) as *const __m256i
                ));
                let mut s = _mm512_setzero_si512();
                for k in 0..4 {
                    let w = _mm512_loadu_si512(p.add(CODES_AT + 64 * k) as *const __m512i);
                    s = _mm512_dpbusd_epi32(s, w, _mm512_permutexvar_epi32(idx[k], y));
                }
                let s =
                    _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64::<1>(s));
                let sumi = _mm256_sub_epi32(s, _mm256_set1_epi32(*offsets.get_unchecked(b)));
                let dd = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                let scale = _mm256_mul_ps(dd, _mm256_set1_ps(*x.d.get_unchecked(b)));
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(sumi)));
            }
        };
        let full = nb / 8 * 8;
        let mut b0 = 0;
        while b0 < full {
            // SAFETY: b0 < full <= nb: record b0 starts inside `group`.
            let p0 = unsafe { group.as_ptr().add(b0 * RECORD_BYTES) };
            for l in 0..8 {
                // SAFETY: record b0 + l < full is inside `group`.
                let p = unsafe { p0.add(l * RECORD_BYTES) };
                // The record's lines `ahead` bytes on (a hint at any address).
                for line in 0..RECORD_BYTES.div_ceil(64) {
                    prefetch(p, ahead + 64 * line);
                }
                block(&mut acc[l], b0 + l, p);
            }
            b0 += 8;
        }
        for b in full..nb {
            // SAFETY: record b < nb is inside `group`.
            block(&mut acc[b % 8], b, unsafe {
                group.as_ptr().add(b * RECORD_BYTES)
            });
        }
        let mut lanes = [[0.0f32; 8]; 8];
        for l in 0..8 {
            // SAFETY: `lanes[l]` is 8 f32.
            unsafe { _mm256_storeu_ps(lanes[l].as_mut_ptr(), acc[l]) };
        }
        std::array::from_fn(|r| {
            crate::tensor::qmatmul::fold8(&std::array::from_fn(|l| lanes[l][r]))
        })
    }
}
