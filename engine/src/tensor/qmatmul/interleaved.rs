//! Q4_K matrices with their rows interleaved in eights, for the x86 machines' products.
//!
//! The file's layout keeps each row's super-blocks together, so a kernel for one activation
//! row (decode) unpacks every block's 6-bit scales and mins, converts its two f16 scales and
//! runs its float steps once per weight row: measured at about a quarter of Q4_K's decode cost
//! (docs/benchmarks.md §18.1). Here eight rows' super-block `b` are one [`GROUP_BLOCK_BYTES`]
//! record whose fields hold the eight rows side by side (one i32 or f32 lane per row), so one
//! instruction does that work for eight rows, and each activation code, broadcast, feeds eight
//! rows' products:
//!
//! | bytes | field |
//! |---|---|
//! | 0..16 | `d` of rows 0..8 (f16) |
//! | 16..32 | `dmin` of rows 0..8 (f16) |
//! | 32..96 | scale of group `j` of row `r` at `32 + 8j + r` (the 6-bit values, one byte each) |
//! | 96..160 | mins: for `v` in 0..4 and half `h` in 0..2, 8 bytes at `96 + 16v + 8h`: the min lane `v` takes (`Q4K_MIN_LANES[v]`'s) of rows `4h..4h + 4`, then lane `v + 4`'s of the same rows |
//! | 160..1184 | codes: for group `j` in 0..8 and `v` in 0..4, 32 bytes at `160 + 32(4j + v)`: byte `16t + 4s + e` holds, for lane `u = v + 4t`, the code of element `32j + 4u + e` of row `s` (low nibble) and of row `4 + s` (high nibble) |
//!
//! So one 32-byte load and a nibble split give the codes of rows 0..4 and of rows 4..8 for
//! lanes `v` (low 128 bits) and `v + 4` (high), the lanes a 32-byte load of the activation
//! group shuffled with `vpshufd` holds: each activation load serves four `v`, each code load
//! eight rows.
//!
//! The canonical order is untouched: lane `u` of row `r` still takes
//! `Σ_j sc_j · Σ_{e<4} q(32j + 4u + e) · y(32j + 4u + e)` and the min term of its sub-block,
//! the same exact integers, then the same f32 steps `(d·d_x)·sumi − (dmin·d_x)·summ` added
//! super-block after super-block and folded by `fold8`. Only which register lane holds which
//! (row, lane) pair changes: lane `r` of accumulator `u`. So a row's result is bit for bit the
//! scalar reference's on the file's row (tested), and decode equals prefill.
//!
//! The records take 1184 bytes for 8 × 144 of the file (+2.8 %: scales and mins unpacked).
//!
//! Kernels: AVX2 ([`avx2`]), and with AVX-512 VNNI one that takes two lane pairs per 512-bit
//! vector ([`avx512`]). Prefill of many rows on AVX-512 VNNI goes through the tiled kernels,
//! whose tiles of eight rows are filled from a group's records as from the file's rows.

// Row, lane and group indices address several arrays at once here.
#![allow(clippy::needless_range_loop)]

use super::{f16_le, fold8, ActRow, Q4K_MIN_LANES};
use crate::tensor::quant::{get_scale_min_k4, pack_scale_min_k4, QK_K};

/// Rows interleaved together.
pub const GROUP_ROWS: usize = 8;

/// Bytes of one record: eight rows' super-block.
pub const GROUP_BLOCK_BYTES: usize = 1184;

const DMIN_AT: usize = 16;
const SC_AT: usize = 32;
const MIN_AT: usize = 96;
const CODES_AT: usize = 160;
const Q4K_BLOCK: usize = 144;

/// Whether a `rows × cols` Q4_K matrix can be interleaved (whole groups of eight rows).
pub fn fits(rows: usize, cols: usize) -> bool {
    rows.is_multiple_of(GROUP_ROWS) && cols.is_multiple_of(QK_K) && cols > 0
}

/// Bytes of the interleaved layout of a `rows × cols` Q4_K matrix that [`fits`].
pub fn interleaved_bytes(rows: usize, cols: usize) -> usize {
    rows / GROUP_ROWS * (cols / QK_K) * GROUP_BLOCK_BYTES
}

/// The interleaved layout of `rows` Q4_K rows of `cols` values (`bytes`, the file's layout).
///
/// # Panics
/// If the matrix does not [`fit`](fits) or `bytes` is not its size.
pub fn interleave(bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; interleaved_bytes(rows, cols)];
    interleave_into(bytes, rows, cols, &mut out);
    out
}

/// [`interleave`] into `out` ([`interleaved_bytes`] long; every byte is written), groups in
/// parallel on the current thread pool.
///
/// # Panics
/// If the matrix does not [`fit`](fits) or `bytes` or `out` is not its size.
pub fn interleave_into(bytes: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    use rayon::prelude::*;
    assert!(
        fits(rows, cols),
        "a {rows}×{cols} matrix cannot be interleaved in eights"
    );
    let nb = cols / QK_K;
    let row_bytes = nb * Q4K_BLOCK;
    assert_eq!(
        bytes.len(),
        rows * row_bytes,
        "Q4_K bytes do not match the shape"
    );
    assert_eq!(
        out.len(),
        interleaved_bytes(rows, cols),
        "wrong output size"
    );
    out.par_chunks_exact_mut(nb * GROUP_BLOCK_BYTES)
        .enumerate()
        .for_each(|(g, group)| {
            let rows_of = &bytes[g * GROUP_ROWS * row_bytes..(g + 1) * GROUP_ROWS * row_bytes];
            for (b, rec) in group.chunks_exact_mut(GROUP_BLOCK_BYTES).enumerate() {
                let blocks: [&[u8]; GROUP_ROWS] =
                    std::array::from_fn(|r| &rows_of[r * row_bytes + b * Q4K_BLOCK..][..Q4K_BLOCK]);
                fill_record(rec, &blocks);
            }
        });
}

/// One record from the eight rows' super-blocks in the file's layout.
fn fill_record(rec: &mut [u8], blocks: &[&[u8]; GROUP_ROWS]) {
    for (r, wb) in blocks.iter().enumerate() {
        rec[2 * r..2 * r + 2].copy_from_slice(&wb[0..2]);
        rec[DMIN_AT + 2 * r..DMIN_AT + 2 * r + 2].copy_from_slice(&wb[2..4]);
        let scales: &[u8; 12] = wb[4..16].try_into().expect("12 bytes");
        for j in 0..8 {
            rec[SC_AT + 8 * j + r] = get_scale_min_k4(j, scales).0;
        }
        for u in 0..8 {
            rec[min_at(r, u)] = get_scale_min_k4(Q4K_MIN_LANES[u], scales).1;
        }
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        let rec: &mut [u8; GROUP_BLOCK_BYTES] = rec.try_into().expect("one record");
        // SAFETY: AVX2 was just detected.
        unsafe { avx2::record_codes(rec, blocks) };
        return;
    }
    record_codes(rec, blocks);
}

/// A record's codes from the eight rows' super-blocks in the file's layout: the four codes of
/// lane `u` in group `j` of a file row are the low (`j` even) or high nibbles of bytes
/// `16 + 32·(j / 2) + 4u .. +4`; a record cell holds row `s`'s (low nibbles) and row `4 + s`'s
/// (high).
fn record_codes(rec: &mut [u8], blocks: &[&[u8]; GROUP_ROWS]) {
    let four = |wb: &[u8], j: usize, u: usize| {
        let at = 16 + 32 * (j / 2) + 4 * u;
        let x = u32::from_le_bytes(wb[at..at + 4].try_into().expect("4 bytes"));
        (x >> (4 * (j % 2))) & 0x0f0f_0f0f
    };
    for j in 0..8 {
        for u in 0..8 {
            for s in 0..4 {
                let cell = four(blocks[s], j, u) | (four(blocks[4 + s], j, u) << 4);
                let at = code_at(s, 32 * j + 4 * u);
                rec[at..at + 4].copy_from_slice(&cell.to_le_bytes());
            }
        }
    }
}

/// Where in a record the code of element `e` of row `r` is (the low nibble for rows 0..4,
/// the high for 4..8).
fn code_at(r: usize, e: usize) -> usize {
    let (j, u, k) = (e / 32, e % 32 / 4, e % 4);
    let (v, t) = (u % 4, u / 4);
    CODES_AT + 32 * (4 * j + v) + 16 * t + 4 * (r % 4) + k
}

/// Where in a record the min lane `u` of row `r` takes is.
fn min_at(r: usize, u: usize) -> usize {
    MIN_AT + 16 * (u % 4) + 8 * (r / 4) + 4 * (u / 4) + r % 4
}

/// Code of element `e` of row `r` in a record.
fn code(rec: &[u8], r: usize, e: usize) -> u8 {
    let byte = rec[code_at(r, e)];
    if r < 4 {
        byte & 0xf
    } else {
        byte >> 4
    }
}

/// Row `r` of an interleaved matrix (`packed`, rows of `cols` values) in the file's layout:
/// the inverse of [`interleave`].
pub fn row(packed: &[u8], cols: usize, r: usize) -> Vec<u8> {
    let nb = cols / QK_K;
    let group = &packed[r / GROUP_ROWS * nb * GROUP_BLOCK_BYTES..][..nb * GROUP_BLOCK_BYTES];
    let r = r % GROUP_ROWS;
    let mut out = vec![0u8; nb * Q4K_BLOCK];
    for (rec, wb) in group
        .chunks_exact(GROUP_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(Q4K_BLOCK))
    {
        wb[0..2].copy_from_slice(&rec[2 * r..2 * r + 2]);
        wb[2..4].copy_from_slice(&rec[DMIN_AT + 2 * r..DMIN_AT + 2 * r + 2]);
        let mut sc = [0u8; 8];
        let mut mn = [0u8; 8];
        for j in 0..8 {
            sc[j] = rec[SC_AT + 8 * j + r];
            mn[Q4K_MIN_LANES[j]] = rec[min_at(r, j)];
        }
        wb[4..16].copy_from_slice(&pack_scale_min_k4(&sc, &mn));
        for c in 0..4 {
            for l in 0..32 {
                let lo = code(rec, r, 64 * c + l);
                let hi = code(rec, r, 64 * c + 32 + l);
                wb[16 + 32 * c + l] = lo | (hi << 4);
            }
        }
    }
    out
}

/// Row `r`'s `d` and `dmin` in a record.
pub(super) fn record_d_dmin(rec: &[u8], r: usize) -> (f32, f32) {
    (f16_le(rec, 2 * r), f16_le(rec, DMIN_AT + 2 * r))
}

/// Row `r`'s 6-bit scale of group `j` in a record.
pub(super) fn record_scale(rec: &[u8], r: usize, j: usize) -> u8 {
    rec[SC_AT + 8 * j + r]
}

/// The min that lane `u` of row `r` takes (`Q4K_MIN_LANES[u]`'s) in a record.
pub(super) fn record_min(rec: &[u8], r: usize, u: usize) -> u8 {
    rec[min_at(r, u)]
}

/// Where a record's codes start.
pub(super) const RECORD_CODES_AT: usize = CODES_AT;

/// The eight rows of one group (`nb` records) against one activation row, by the canonical
/// definition, read from the records (the scalar path, and the kernels' reference in tests).
pub(super) fn dot_group_ref(group: &[u8], x: ActRow<'_>) -> [f32; GROUP_ROWS] {
    let mut acc = [[0.0f32; 8]; GROUP_ROWS];
    for (b, rec) in group.chunks_exact(GROUP_BLOCK_BYTES).enumerate() {
        let y = &x.qs[b * QK_K..(b + 1) * QK_K];
        for r in 0..GROUP_ROWS {
            let s1 = f16_le(rec, 2 * r) * x.d[b];
            let s2 = f16_le(rec, DMIN_AT + 2 * r) * x.d[b];
            for u in 0..8 {
                let mut sumi = 0i32;
                for j in 0..8 {
                    let s: i32 = (32 * j + 4 * u..32 * j + 4 * u + 4)
                        .map(|e| code(rec, r, e) as i32 * y[e] as i32)
                        .sum();
                    sumi += rec[SC_AT + 8 * j + r] as i32 * s;
                }
                let summ = rec[min_at(r, u)] as i32 * x.pairs[b * 8 + u];
                acc[r][u] += s1 * sumi as f32 - s2 * summ as f32;
            }
        }
    }
    std::array::from_fn(|r| fold8(&acc[r]))
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    //! The AVX2 kernel. Vector `h` (0, 1) of lane pair `v` holds rows `4h..4h + 4` for lane
    //! `v` in its low 128 bits and for lane `v + 4` in its high 128 bits.

    use std::arch::x86_64::*;

    use super::{ActRow, CODES_AT, DMIN_AT, GROUP_BLOCK_BYTES, GROUP_ROWS, MIN_AT, SC_AT};
    use crate::tensor::qmatmul::avx2::prefetch;
    use crate::tensor::quant::QK_K;

    /// Records ahead that each record's step asks the memory for.
    const PREFETCH_RECORDS: usize = 2;

    /// [`record_codes`](super::record_codes) with AVX2: per group, the eight rows' 32 code
    /// bytes (dword `u` = lane `u`'s four codes), row `s` and `4 + s` merged into one byte
    /// each, and a 4 × 4 dword transpose in each 128-bit half gives the record's four
    /// 32-byte cells of lane pairs `v` (dword `4t + s` = lane `v + 4t` of rows `s`, `4 + s`).
    #[target_feature(enable = "avx2")]
    pub(super) fn record_codes(rec: &mut [u8; GROUP_BLOCK_BYTES], blocks: &[&[u8]; GROUP_ROWS]) {
        let m4 = _mm256_set1_epi8(0xf);
        for j in 0..8 {
            let at = 16 + 32 * (j / 2);
            let shift = _mm_cvtsi32_si128(4 * (j % 2) as i32);
            let row = |r: usize| {
                let b: &[u8; 32] = blocks[r][at..at + 32].try_into().expect("32 code bytes");
                // SAFETY: 32 readable bytes (unaligned load).
                let v = unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) };
                // A 16-bit shift by 0 or 4, then the mask: each byte's nibble j % 2.
                _mm256_and_si256(_mm256_srl_epi16(v, shift), m4)
            };
            // Bytes of at most 4 bits: a 16-bit shift by 4 keeps each inside its byte.
            let c: [__m256i; 4] =
                std::array::from_fn(|s| _mm256_or_si256(row(s), _mm256_slli_epi16(row(4 + s), 4)));
            let t0 = _mm256_unpacklo_epi32(c[0], c[1]);
            let t1 = _mm256_unpackhi_epi32(c[0], c[1]);
            let t2 = _mm256_unpacklo_epi32(c[2], c[3]);
            let t3 = _mm256_unpackhi_epi32(c[2], c[3]);
            let cells = [
                _mm256_unpacklo_epi64(t0, t2),
                _mm256_unpackhi_epi64(t0, t2),
                _mm256_unpacklo_epi64(t1, t3),
                _mm256_unpackhi_epi64(t1, t3),
            ];
            for (v, cell) in cells.into_iter().enumerate() {
                let at = CODES_AT + 32 * (4 * j + v);
                let dst: &mut [u8; 32] = (&mut rec[at..at + 32]).try_into().expect("32 bytes");
                // SAFETY: 32 writable bytes (unaligned store).
                unsafe { _mm256_storeu_si256(dst.as_mut_ptr() as *mut __m256i, cell) };
            }
        }
    }

    /// `vpshufb` controls giving i32 lane `l` the i16 pair `(s, s)` of scale byte
    /// `4h + l % 4` from eight scale bytes broadcast to every 64 bits (rows `4h..4h + 4`, the
    /// same in both 128-bit halves).
    const SPREAD: [[i8; 32]; 2] = {
        let mut t = [[-1i8; 32]; 2];
        let mut h = 0;
        while h < 2 {
            let mut l = 0;
            while l < 8 {
                let b = (4 * h + l % 4) as i8;
                t[h][4 * l] = b;
                t[h][4 * l + 2] = b;
                l += 1;
            }
            h += 1;
        }
        t
    };

    /// The group's eight rows against `R` activation rows.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `group` is whole records, and every row of `x`
    /// fits them: codes `b·256..+256`, `pairs[b·8..+8]` and `d[b]` exist for every record `b`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::tensor::qmatmul) unsafe fn dot_group<const R: usize>(
        group: &[u8],
        x: &[ActRow<'_>; R],
    ) -> [[f32; GROUP_ROWS]; R] {
        let mut acc = [[[_mm256_setzero_ps(); 2]; 4]; R];
        let m4 = _mm256_set1_epi8(0xf);
        // SAFETY: two 32-byte tables.
        let spread = unsafe {
            [
                _mm256_loadu_si256(SPREAD[0].as_ptr() as *const __m256i),
                _mm256_loadu_si256(SPREAD[1].as_ptr() as *const __m256i),
            ]
        };
        for (b, rec) in group.chunks_exact(GROUP_BLOCK_BYTES).enumerate() {
            let p = rec.as_ptr();
            // The record two ahead (past the group for its last two: a hint, any address).
            for line in 0..GROUP_BLOCK_BYTES.div_ceil(64) {
                prefetch(p, PREFETCH_RECORDS * GROUP_BLOCK_BYTES + 64 * line);
            }
            // SAFETY: inside the record.
            let (d8, dmin8) = unsafe {
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(DMIN_AT) as *const __m128i)),
                )
            };
            // Rows 0..4 and 4..8 in both halves.
            let d = [
                _mm256_permute2f128_ps(d8, d8, 0x00),
                _mm256_permute2f128_ps(d8, d8, 0x11),
            ];
            let dmin = [
                _mm256_permute2f128_ps(dmin8, dmin8, 0x00),
                _mm256_permute2f128_ps(dmin8, dmin8, 0x11),
            ];
            // Per activation row: (d·d_x, dmin·d_x) of each half, and the 32-code sums of
            // lanes v and v + 4 in the halves of vector v.
            let (scale, pv): ([[__m256; 4]; R], [[__m256i; 4]; R]) = {
                let mut scale = [[_mm256_setzero_ps(); 4]; R];
                let mut pv = [[_mm256_setzero_si256(); 4]; R];
                for r in 0..R {
                    // SAFETY: the row fits: pairs b·8..+8 and d[b] exist.
                    let (pairs, xd) = unsafe {
                        (
                            _mm256_loadu_si256(x[r].pairs.as_ptr().add(b * 8) as *const __m256i),
                            *x[r].d.get_unchecked(b),
                        )
                    };
                    let xv = _mm256_set1_ps(xd);
                    scale[r] = [
                        _mm256_mul_ps(d[0], xv),
                        _mm256_mul_ps(d[1], xv),
                        _mm256_mul_ps(dmin[0], xv),
                        _mm256_mul_ps(dmin[1], xv),
                    ];
                    pv[r] = [
                        _mm256_shuffle_epi32(pairs, 0x00),
                        _mm256_shuffle_epi32(pairs, 0x55),
                        _mm256_shuffle_epi32(pairs, 0xaa),
                        _mm256_shuffle_epi32(pairs, 0xff),
                    ];
                }
                (scale, pv)
            };
            // The float steps of lane pair v, half h, activation row r, from its exact sum.
            let mut finish = |r: usize, v: usize, h: usize, sum: __m256i| {
                // SAFETY: inside the record (MIN_AT + 16·3 + 8 + 8 = 160).
                let mins = unsafe {
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        p.add(MIN_AT + 16 * v + 8 * h) as *const __m128i
                    ))
                };
                // min · pair: i16 × i16 in the low halves (mins < 64, |pair| ≤ 32·128), the
                // high halves 0 × anything: exact.
                let summ = _mm256_madd_epi16(mins, pv[r][v]);
                let t1 = _mm256_mul_ps(scale[r][h], _mm256_cvtepi32_ps(sum));
                let t2 = _mm256_mul_ps(scale[r][2 + h], _mm256_cvtepi32_ps(summ));
                acc[r][v][h] = _mm256_add_ps(acc[r][v][h], _mm256_sub_ps(t1, t2));
            };
            // Group j's scales of rows 0..4 and 4..8 as i16 pairs.
            let scales = |j: usize| {
                // SAFETY: inside the record (SC_AT + 8·7 + 8 = 96).
                let sc = unsafe { (p.add(SC_AT + 8 * j) as *const i64).read_unaligned() };
                let sc = _mm256_set1_epi64x(sc);
                [
                    _mm256_shuffle_epi8(sc, spread[0]),
                    _mm256_shuffle_epi8(sc, spread[1]),
                ]
            };
            // Codes of lane pair v of group j: rows 0..4 and 4..8.
            let codes = |j: usize, v: usize| {
                // SAFETY: inside the record (CODES_AT + 32·31 + 32 = 1184).
                let raw = unsafe {
                    _mm256_loadu_si256(p.add(CODES_AT + 32 * (4 * j + v)) as *const __m256i)
                };
                [
                    _mm256_and_si256(raw, m4),
                    _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
                ]
            };
            // Activation codes of group j of row r.
            let acts = |r: usize, j: usize| {
                // SAFETY: the row fits: codes b·256 + 32j .. + 32 ≤ (b + 1)·256.
                unsafe {
                    _mm256_loadu_si256(x[r].qs.as_ptr().add(b * QK_K + 32 * j) as *const __m256i)
                }
            };
            // y: the activation lanes of this pair broadcast within each half.
            let step = |s: &mut [__m256i; 2], c: &[__m256i; 2], y: __m256i, scv: &[__m256i; 2]| {
                let a = _mm256_madd_epi16(_mm256_maddubs_epi16(c[0], y), scv[0]);
                let e = _mm256_madd_epi16(_mm256_maddubs_epi16(c[1], y), scv[1]);
                s[0] = _mm256_add_epi32(s[0], a);
                s[1] = _mm256_add_epi32(s[1], e);
            };
            macro_rules! pairs_of {
                ($y:expr, $v:literal) => {
                    match $v {
                        0 => _mm256_shuffle_epi32($y, 0x00),
                        1 => _mm256_shuffle_epi32($y, 0x55),
                        2 => _mm256_shuffle_epi32($y, 0xaa),
                        _ => _mm256_shuffle_epi32($y, 0xff),
                    }
                };
            }
            if R == 1 {
                // One activation row: group by group, all four lane pairs' sums in registers
                // (each activation and scale load serves four pairs).
                let mut sums = [[_mm256_setzero_si256(); 2]; 4];
                for j in 0..8 {
                    let scv = scales(j);
                    let y = acts(0, j);
                    step(&mut sums[0], &codes(j, 0), pairs_of!(y, 0), &scv);
                    step(&mut sums[1], &codes(j, 1), pairs_of!(y, 1), &scv);
                    step(&mut sums[2], &codes(j, 2), pairs_of!(y, 2), &scv);
                    step(&mut sums[3], &codes(j, 3), pairs_of!(y, 3), &scv);
                }
                for v in 0..4 {
                    for h in 0..2 {
                        finish(0, v, h, sums[v][h]);
                    }
                }
            } else {
                // Several: lane pair by lane pair, each code load serving every row (the sums
                // of all pairs would not fit in registers).
                // The groups' scales once per record, not once per lane pair.
                let scv_all: [[__m256i; 2]; 8] = std::array::from_fn(scales);
                macro_rules! pair {
                    ($v:literal) => {{
                        let mut sums = [[_mm256_setzero_si256(); 2]; R];
                        for j in 0..8 {
                            let scv = scv_all[j];
                            let c = codes(j, $v);
                            for r in 0..R {
                                step(&mut sums[r], &c, pairs_of!(acts(r, j), $v), &scv);
                            }
                        }
                        for r in 0..R {
                            finish(r, $v, 0, sums[r][0]);
                            finish(r, $v, 1, sums[r][1]);
                        }
                    }};
                }
                pair!(0);
                pair!(1);
                pair!(2);
                pair!(3);
            }
        }
        std::array::from_fn(|r| {
            // lanes[v][h][l]: row 4h + l % 4, lane v + 4·(l / 4).
            let mut lanes = [[[0.0f32; 8]; 2]; 4];
            for v in 0..4 {
                for h in 0..2 {
                    // SAFETY: `lanes[v][h]` is 8 f32.
                    unsafe { _mm256_storeu_ps(lanes[v][h].as_mut_ptr(), acc[r][v][h]) };
                }
            }
            std::array::from_fn(|row| {
                let l: [f32; 8] =
                    std::array::from_fn(|u| lanes[u % 4][row / 4][row % 4 + 4 * (u / 4)]);
                super::fold8(&l)
            })
        })
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    //! The AVX-512 kernel (F, BW, VNNI). A 64-byte code load holds lane pairs `2w` and
    //! `2w + 1` of a group: 128-bit lane `q` of a vector is canonical lane
    //! `u = 2w + q / 2 + 4·(q % 2)`, its i32 lane `s` row `s` (low nibbles) or `4 + s` (high).
    //! The activation group, broadcast to both 256-bit halves and byte-shuffled, gives every
    //! 128-bit lane its lane's four codes; `vpmaddubsw` then `vpdpwssd` with the rows' scales
    //! add each segment's scaled sum to its (row, lane) sum, the same exact integers as the
    //! AVX2 kernel's `vpmaddwd` + add.

    use std::arch::x86_64::*;

    use super::{ActRow, CODES_AT, GROUP_BLOCK_BYTES, GROUP_ROWS, MIN_AT, SC_AT};
    use crate::tensor::qmatmul::avx2::prefetch;
    use crate::tensor::quant::QK_K;

    /// Canonical lane of 128-bit lane `q` in the vectors of lane pairs `2w`, `2w + 1`.
    const fn lane_of(w: usize, q: usize) -> usize {
        2 * w + q / 2 + 4 * (q % 2)
    }

    /// `vpshufb` controls giving i32 lane `s` of every 128-bit lane the i16 pair `(sc, sc)`
    /// of scale byte `4h + s`, from eight scale bytes broadcast to every 64 bits.
    const SPREAD: [[i8; 64]; 2] = {
        let mut t = [[-1i8; 64]; 2];
        let mut h = 0;
        while h < 2 {
            let mut i = 0;
            while i < 16 {
                let b = (4 * h + i % 4) as i8;
                t[h][4 * i] = b;
                t[h][4 * i + 2] = b;
                i += 1;
            }
            h += 1;
        }
        t
    };

    /// `vpshufb` controls giving 128-bit lane `q` the four activation codes of its lane
    /// (`lane_of(w, q)`) in each of its i32 lanes, from the group's 32 codes broadcast to
    /// both 256-bit halves (128-bit lane `q` then holds codes `16·(q % 2)..+16`).
    const ACTS: [[i8; 64]; 2] = {
        let mut t = [[0i8; 64]; 2];
        let mut w = 0;
        while w < 2 {
            let mut byte = 0;
            while byte < 64 {
                let q = byte / 16;
                t[w][byte] = (4 * (2 * w + q / 2) + byte % 4) as i8;
                byte += 1;
            }
            w += 1;
        }
        t
    };

    /// `vpermd` indices giving i32 lane `4q + s` the 32-code sum of lane `lane_of(w, q)`.
    const PAIRS: [[i32; 16]; 2] = {
        let mut t = [[0i32; 16]; 2];
        let mut w = 0;
        while w < 2 {
            let mut l = 0;
            while l < 16 {
                t[w][l] = lane_of(w, l / 4) as i32;
                l += 1;
            }
            w += 1;
        }
        t
    };

    /// `vpermps` indices giving lane `4q + s` the `d` (`dmin` = 0) or `dmin` (`dmin` = 8) of
    /// row `4h + s`, from the record's 16 f16 scales converted in order.
    const fn scale_index(h: usize, dmin: usize) -> [i32; 16] {
        let mut t = [0i32; 16];
        let mut l = 0;
        while l < 16 {
            t[l] = (dmin + 4 * h + l % 4) as i32;
            l += 1;
        }
        t
    }
    /// [`scale_index`] of `d` for rows 0..4, 4..8, then of `dmin`.
    const SCALE_INDEX: [[i32; 16]; 4] = [
        scale_index(0, 0),
        scale_index(1, 0),
        scale_index(0, 8),
        scale_index(1, 8),
    ];

    /// The group's eight rows against `R` activation rows.
    ///
    /// # Safety
    /// AVX2, FMA, F16C and AVX-512 F, BW and VNNI must be available; `group` is whole
    /// records, and every row of `x` fits them: codes `b·256..+256`, `pairs[b·8..+8]` and
    /// `d[b]` exist for every record `b`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    pub(in crate::tensor::qmatmul) unsafe fn dot_group<const R: usize>(
        group: &[u8],
        x: &[ActRow<'_>; R],
    ) -> [[f32; GROUP_ROWS]; R] {
        // acc[r][w][h]: activation row r, lane pairs 2w / 2w + 1, rows 4h..4h + 4.
        let mut acc = [[[_mm512_setzero_ps(); 2]; 2]; R];
        let m4 = _mm512_set1_epi8(0xf);
        let load = |t: &[i8; 64]| {
            // SAFETY: 64 readable bytes.
            unsafe { _mm512_loadu_si512(t.as_ptr() as *const __m512i) }
        };
        let load32 = |t: &[i32; 16]| {
            // SAFETY: 64 readable bytes.
            unsafe { _mm512_loadu_si512(t.as_ptr() as *const __m512i) }
        };
        let spread = [load(&SPREAD[0]), load(&SPREAD[1])];
        let act_ctl = [load(&ACTS[0]), load(&ACTS[1])];
        let pair_idx = [load32(&PAIRS[0]), load32(&PAIRS[1])];
        let scale_idx: [__m512i; 4] = std::array::from_fn(|i| load32(&SCALE_INDEX[i]));
        // This CPU's distance (`prefetch::plan_for`: the record in hand on an Intel Xeon and
        // a Zen 4, eight ahead on a Zen 5); at most MAX_RECORDS_AHEAD records: no overflow.
        let ahead = super::super::prefetch::records_ahead() * GROUP_BLOCK_BYTES;
        for (b, rec) in group.chunks_exact(GROUP_BLOCK_BYTES).enumerate() {
            // Every line of the record `ahead` bytes on asked for before this one's first
            // load, so that they all travel at once instead of as the loads reach them. Past
            // the group's end it is a hint at any address.
            let p = rec.as_ptr();
            for line in 0..GROUP_BLOCK_BYTES.div_ceil(64) {
                prefetch(p, ahead + 64 * line);
            }
            // d of rows 0..8, then dmin of rows 0..8 (bytes 0..32).
            // SAFETY: inside the record.
            let dd = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p as *const __m256i) });
            let wd: [__m512; 4] = std::array::from_fn(|i| _mm512_permutexvar_ps(scale_idx[i], dd));
            // Per activation row: (d·d_x, dmin·d_x) of each half, and the 32-code sums of
            // each vector's lanes.
            let mut scale = [[_mm512_setzero_ps(); 4]; R];
            let mut pv = [[_mm512_setzero_si512(); 2]; R];
            for r in 0..R {
                // SAFETY: the row fits: pairs b·8..+8 and d[b] exist.
                let (pairs, xd) = unsafe {
                    (
                        _mm256_loadu_si256(x[r].pairs.as_ptr().add(b * 8) as *const __m256i),
                        *x[r].d.get_unchecked(b),
                    )
                };
                let xv = _mm512_set1_ps(xd);
                scale[r] = std::array::from_fn(|i| _mm512_mul_ps(wd[i], xv));
                let pairs = _mm512_castsi256_si512(pairs);
                pv[r] = [
                    _mm512_permutexvar_epi32(pair_idx[0], pairs),
                    _mm512_permutexvar_epi32(pair_idx[1], pairs),
                ];
            }
            // The float steps of vector (w, h), activation row r, from its exact sum.
            let mut finish = |r: usize, w: usize, h: usize, sum: __m512i| {
                // Mins of rows 4h..4h + 4: lanes 2w, 2w + 4 then 2w + 1, 2w + 5.
                // SAFETY: inside the record (MIN_AT + 32 + 16 + 8 + 8 = 160).
                let mins = unsafe {
                    _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(
                        _mm_loadl_epi64(p.add(MIN_AT + 32 * w + 8 * h) as *const __m128i),
                        _mm_loadl_epi64(p.add(MIN_AT + 32 * w + 16 + 8 * h) as *const __m128i),
                    ))
                };
                // min · pair: i16 × i16 in the low halves (mins < 64, |pair| ≤ 32·128), the
                // high halves 0 × anything: exact.
                let summ = _mm512_madd_epi16(mins, pv[r][w]);
                let t1 = _mm512_mul_ps(scale[r][h], _mm512_cvtepi32_ps(sum));
                let t2 = _mm512_mul_ps(scale[r][2 + h], _mm512_cvtepi32_ps(summ));
                acc[r][w][h] = _mm512_add_ps(acc[r][w][h], _mm512_sub_ps(t1, t2));
            };
            // Group j's scales of rows 0..4 and 4..8 as i16 pairs.
            let scales = |j: usize| {
                // SAFETY: inside the record (SC_AT + 8·7 + 8 = 96).
                let sc = unsafe { (p.add(SC_AT + 8 * j) as *const i64).read_unaligned() };
                let sc = _mm512_set1_epi64(sc);
                [
                    _mm512_shuffle_epi8(sc, spread[0]),
                    _mm512_shuffle_epi8(sc, spread[1]),
                ]
            };
            // Codes of lane pairs 2w, 2w + 1 of group j: rows 0..4 and 4..8.
            let codes = |j: usize, w: usize| {
                // SAFETY: inside the record (CODES_AT + 32·30 + 64 = 1184).
                let raw = unsafe {
                    _mm512_loadu_si512(p.add(CODES_AT + 32 * (4 * j + 2 * w)) as *const __m512i)
                };
                [
                    _mm512_and_si512(raw, m4),
                    _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4),
                ]
            };
            // Activation codes of group j of row r, in both 256-bit halves.
            let acts = |r: usize, j: usize| {
                // SAFETY: the row fits: codes b·256 + 32j .. + 32 ≤ (b + 1)·256.
                unsafe {
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        x[r].qs.as_ptr().add(b * QK_K + 32 * j) as *const __m256i,
                    ))
                }
            };
            let step = |s: &mut [__m512i; 2], c: &[__m512i; 2], y: __m512i, scv: &[__m512i; 2]| {
                s[0] = _mm512_dpwssd_epi32(s[0], _mm512_maddubs_epi16(c[0], y), scv[0]);
                s[1] = _mm512_dpwssd_epi32(s[1], _mm512_maddubs_epi16(c[1], y), scv[1]);
            };
            if R == 1 {
                // One activation row: group by group, both vectors' sums in registers.
                let mut sums = [[_mm512_setzero_si512(); 2]; 2];
                for j in 0..8 {
                    let scv = scales(j);
                    let y = acts(0, j);
                    for w in 0..2 {
                        step(
                            &mut sums[w],
                            &codes(j, w),
                            _mm512_shuffle_epi8(y, act_ctl[w]),
                            &scv,
                        );
                    }
                }
                for w in 0..2 {
                    for h in 0..2 {
                        finish(0, w, h, sums[w][h]);
                    }
                }
            } else if R <= 4 {
                // Several: group by group, each group's scales spread once and each code
                // load serving every row, each activation group loaded once for both vector
                // pairs; all the sums in registers (4·R of them).
                let mut sums = [[[_mm512_setzero_si512(); 2]; 2]; R];
                for j in 0..8 {
                    let scv = scales(j);
                    let c = [codes(j, 0), codes(j, 1)];
                    for r in 0..R {
                        let a = acts(r, j);
                        for w in 0..2 {
                            let y = _mm512_shuffle_epi8(a, act_ctl[w]);
                            step(&mut sums[r][w], &c[w], y, &scv);
                        }
                    }
                }
                for r in 0..R {
                    for w in 0..2 {
                        finish(r, w, 0, sums[r][w][0]);
                        finish(r, w, 1, sums[r][w][1]);
                    }
                }
            } else {
                // More rows than registers for every sum: vector pair by vector pair.
                for w in 0..2 {
                    let mut sums = [[_mm512_setzero_si512(); 2]; R];
                    for j in 0..8 {
                        let scv = scales(j);
                        let c = codes(j, w);
                        for r in 0..R {
                            let y = _mm512_shuffle_epi8(acts(r, j), act_ctl[w]);
                            step(&mut sums[r], &c, y, &scv);
                        }
                    }
                    for r in 0..R {
                        finish(r, w, 0, sums[r][0]);
                        finish(r, w, 1, sums[r][1]);
                    }
                }
            }
        }
        std::array::from_fn(|r| {
            // lanes[w][h][4q + s]: row 4h + s, lane lane_of(w, q).
            let mut lanes = [[[0.0f32; 16]; 2]; 2];
            for w in 0..2 {
                for h in 0..2 {
                    // SAFETY: `lanes[w][h]` is 16 f32.
                    unsafe { _mm512_storeu_ps(lanes[w][h].as_mut_ptr(), acc[r][w][h]) };
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
            std::array::from_fn(|row| super::fold8(&by_row[row]))
        })
    }
}

/// Bytes of interleaved copies that loads may still make ([`grant`]).
static ALLOWANCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Let the loads that follow make up to `bytes` of interleaved copies in all (a model's load
/// grants what the memory left beside its mapped files allows; nothing is interleaved
/// without a grant). Replaces any earlier grant.
pub fn grant(bytes: u64) {
    ALLOWANCE.store(bytes, std::sync::atomic::Ordering::Relaxed);
}

/// Take `bytes` from the grant, if it has them.
pub(crate) fn take(bytes: u64) -> bool {
    use std::sync::atomic::Ordering::Relaxed;
    let ok = ALLOWANCE
        .fetch_update(Relaxed, Relaxed, |left| left.checked_sub(bytes))
        .is_ok();
    if ok {
        MADE.fetch_add(bytes, Relaxed);
    }
    ok
}

/// When loads interleave Q4_K matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Where it was measured to pay ([`pays`]): the default.
    Auto,
    /// Wherever a matrix fits and the grant has room (tests of the layout on any machine).
    Always,
    /// Never: the file's layout only.
    Never,
}

/// The mode set by [`set_mode`]; 0 = not set (then `COLI_INTERLEAVE`).
static MODE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Set when loads interleave (default: `COLI_INTERLEAVE=auto|always|never`, else auto).
/// Results are the same bits in every mode; this exists so that the layouts can be compared
/// (tests, benchmarks) in one process or between runs of one binary.
pub fn set_mode(mode: Mode) {
    let v = match mode {
        Mode::Auto => 1,
        Mode::Always => 2,
        Mode::Never => 3,
    };
    MODE.store(v, std::sync::atomic::Ordering::Relaxed);
}

/// The mode in force.
pub fn mode() -> Mode {
    match MODE.load(std::sync::atomic::Ordering::Relaxed) {
        1 => Mode::Auto,
        2 => Mode::Always,
        3 => Mode::Never,
        _ => {
            static ENV: std::sync::OnceLock<Mode> = std::sync::OnceLock::new();
            *ENV.get_or_init(|| match std::env::var("COLI_INTERLEAVE").as_deref() {
                Err(_) | Ok("") | Ok("auto") => Mode::Auto,
                Ok("always") => Mode::Always,
                Ok("never") => Mode::Never,
                Ok(other) => {
                    tracing::warn!(
                        "COLI_INTERLEAVE={other:?} is not auto, always or never: taken as auto"
                    );
                    Mode::Auto
                }
            })
        }
    }
}

/// Bytes of interleaved copies made by this process, in all.
static MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Bytes of interleaved copies this process has made (loads, in all).
pub fn made() -> u64 {
    MADE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether loads interleave Q4_K matrices: in [`Mode::Auto`], where the products run faster
/// on interleaved rows: with the AVX2 kernels (measured, docs/benchmarks.md §22) and with
/// AVX-512 VNNI (§23). Machines with AVX-512 BW but not VNNI keep the file's layout, which
/// their 512-bit row kernels take (not measured against the AVX2 record kernel).
pub fn pays() -> bool {
    match mode() {
        Mode::Never => return false,
        Mode::Always => return true,
        Mode::Auto => {}
    }
    #[cfg(target_arch = "x86_64")]
    {
        use crate::tensor::kernels::{avx2_fma_f16c, avx512, Isa};
        Isa::detect() == Isa::Avx2 && avx2_fma_f16c() && (!avx512() || super::vnni())
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 arrangement of a record's codes is the scalar one, byte for byte, on arbitrary
    /// bytes (every code, both nibbles of every byte).
    #[test]
    fn record_codes_by_simd_and_by_scalar_agree() {
        #[cfg(target_arch = "x86_64")]
        {
            if !is_x86_feature_detected!("avx2") {
                eprintln!("no AVX2 here: only the scalar arrangement exists");
                return;
            }
            for seed in 0..20u32 {
                // Arbitrary bytes: mantissa bits of the shared test values.
                let rows: Vec<Vec<u8>> = (0..GROUP_ROWS as u32)
                    .map(|r| {
                        crate::tensor::test_values::xorshift(Q4K_BLOCK, 8 * seed + r + 1)
                            .iter()
                            .map(|v| (v.to_bits() >> 7) as u8)
                            .collect()
                    })
                    .collect();
                let blocks: [&[u8]; GROUP_ROWS] = std::array::from_fn(|r| &rows[r][..]);
                let mut scalar = [0u8; GROUP_BLOCK_BYTES];
                let mut simd = [0xa5u8; GROUP_BLOCK_BYTES];
                record_codes(&mut scalar, &blocks);
                // SAFETY: AVX2 was detected above.
                unsafe { avx2::record_codes(&mut simd, &blocks) };
                assert_eq!(&scalar[CODES_AT..], &simd[CODES_AT..]);
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        eprintln!("not x86: only the scalar arrangement exists");
    }
}
