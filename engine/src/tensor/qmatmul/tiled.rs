//! Prefill products of Q4_K, Q5_K and Q6_K weights with AVX-512 VNNI: tiles of up to eight
//! weight rows, unpacked once, against bands of sixteen activation rows.
//!
//! The row-at-a-time kernels unpack a weight block's nibbles, scales and mins once per four
//! activation rows and finish every (weight row, activation row) pair with its own float steps.
//! Here the weight codes of a tile are unpacked once per task, already multiplied by their
//! scale (Q4_K `sc·q` ≤ 63·15, Q5_K ≤ 63·31, Q6_K ≤ 128·63 in magnitude: i16), and the activation
//! codes of a band are laid out so that one 512-bit register holds the same two elements of
//! sixteen rows: one `vpdpwssd` with a weight pair broadcast then adds `sc·(q₀y₀ + q₁y₁)` to
//! sixteen lane sums at once, and the float steps run on sixteen rows per instruction. Q6_K's
//! `−32·(sc_u·bsum_u + sc_{8+u}·bsum_{8+u})` is one more such step, a pair of the tile's
//! (`−32·sc`) against a pair of the band's 16-code sums.
//!
//! Speed: the scale of every 4-element lane segment (the canonical order) is applied inside a
//! 16-bit multiply-add, 32 products per port-0 µop, as in the row kernels; what the tiles save
//! is the unpacking and float work beside it, 1.0–1.25× from 64 rows (docs/benchmarks.md §19).
//!
//! The bits are the scalar reference's ([`dot_ref`](super::dot_ref)): lane `u`'s integer sum
//! over the super-block is the same exact integer (a sum of the same products, in i32 as the
//! reference's), `(d_w·d_x)·sumi − (dmin_w·d_x)·summ` (Q4_K, Q5_K) or `(d_w·d_x)·sumi` (Q6_K) is
//! formed with the same f32 operations (`summ = m·pairs` is exact as a product of f32: below
//! 2²⁴), the lanes accumulate super-block after super-block and fold as `fold8` does. So a
//! row's result does not depend on whether it went through a band or alone (tested).

// Lane, row and band indices address several arrays at once here.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::{QuantizedActs, Q4K_MIN_LANES};
use crate::tensor::quant::{get_scale_min_k4, QuantType, QK_K};

/// Activation rows per band (one 512-bit register of i32 lanes).
pub(super) const BAND: usize = 16;

/// Weight rows per tile: every activation load feeds this many `vpdpwssd`.
pub(super) const TILE: usize = 8;

// A tile is one interleaved group (`Tile::fill_records`).
const _: () = assert!(TILE == super::interleaved::GROUP_ROWS);

/// Activation rows of a Q8_K product laid out for [`band`]: per band of [`BAND`] rows
/// (the last padded with zero rows), per super-block `b`, lane `u`, group `j` and pair `p`,
/// the codes of elements `256b + 32j + 4u + 2p` and `+1` of the sixteen rows as i16 pairs.
pub(super) struct Bands {
    /// Super-blocks per row.
    nb: usize,
    /// Rows (without the padding).
    pub(super) rows: usize,
    /// `bands × nb × 8 × 16 × BAND` i32 (two i16 codes each).
    codes: Vec<i32>,
    /// `bands × nb × BAND`: the rows' super-block scales.
    d: Vec<f32>,
    /// `bands × nb × 8 × BAND`: lane `u`'s 32-code sum (`QuantizedActs::pairs`) as f32.
    pairs: Vec<f32>,
    /// `bands × nb × 8 × BAND`: the 16-code sums `u` and `8 + u` as an i16 pair (Q6_K).
    bsums: Vec<i32>,
}

impl Bands {
    /// Lay out `acts` (Q8_K) in bands.
    pub(super) fn new(acts: &QuantizedActs) -> Bands {
        assert_eq!(acts.format, super::ActFormat::Q8K, "bands are of Q8_K rows");
        let k = acts.cols;
        let nb = k / QK_K;
        let rows = acts.qs.len() / k;
        let bands = rows.div_ceil(BAND);
        let mut codes = vec![0i32; bands * nb * 128 * BAND];
        let mut d = vec![0f32; bands * nb * BAND];
        let mut pairs = vec![0f32; bands * nb * 8 * BAND];
        let mut bsums = vec![0i32; bands * nb * 8 * BAND];
        for i in 0..rows {
            let (q, r) = (i / BAND, i % BAND);
            let y = &acts.qs[i * k..(i + 1) * k];
            for b in 0..nb {
                let at = (q * nb + b) * 128;
                for u in 0..8 {
                    for jp in 0..16 {
                        let e = 256 * b + 32 * (jp / 2) + 4 * u + 2 * (jp % 2);
                        codes[(at + u * 16 + jp) * BAND + r] = pair(y[e] as i32, y[e + 1] as i32);
                    }
                    let lane = ((q * nb + b) * 8 + u) * BAND + r;
                    pairs[lane] = acts.pairs[(i * nb + b) * 8 + u] as f32;
                    let bs = &acts.bsums[(i * nb + b) * 16..][..16];
                    bsums[lane] = pair(bs[u], bs[8 + u]);
                }
                d[(q * nb + b) * BAND + r] = acts.d[i * nb + b];
            }
        }
        Bands {
            nb,
            rows,
            codes,
            d,
            pairs,
            bsums,
        }
    }

    /// Bands, the last one possibly partial.
    pub(super) fn bands(&self) -> usize {
        self.rows.div_ceil(BAND)
    }
}

/// Two values that fit i16 (codes ≤ 127 in magnitude, 16-code sums ≤ 2032, scaled weight
/// codes ≤ 8064, `32·sc` ≤ 4096) as the i16 pair `(lo, hi)` of one i32 lane.
fn pair(lo: i32, hi: i32) -> i32 {
    debug_assert!(i16::try_from(lo).is_ok() && i16::try_from(hi).is_ok());
    ((lo as i16 as u16 as u32) | ((hi as i16 as u16 as u32) << 16)) as i32
}

/// Up to [`TILE`] Q4_K, Q5_K or Q6_K weight rows unpacked for [`band`] (Q5_K's float steps
/// are Q4_K's: only its codes are unpacked differently).
pub(super) struct Tile {
    ty: QuantType,
    nb: usize,
    /// Rows held.
    pub(super) rows: usize,
    /// `TILE × nb × 8 × 8` u64: for row `w`, super-block `b`, lane `u` and group `j`, the
    /// codes of elements `256b + 32j + 4u .. +4` times their scale, four i16 (the order the
    /// kernel reads them in: lane by lane).
    codes: Vec<u64>,
    /// `TILE × nb`: the super-blocks' `d` and (Q4_K, Q5_K) `dmin`.
    d: Vec<f32>,
    dmin: Vec<f32>,
    /// `TILE × nb × 8`: Q4_K, Q5_K: the min of lane `u` (`Q4K_MIN_LANES[u]`) as f32.
    mins: Vec<f32>,
    /// `TILE × nb × 8`: Q6_K: `(−32·sc_u, −32·sc_{8+u})` as an i16 pair.
    corr: Vec<i32>,
}

impl Tile {
    /// An empty tile for `ty` (Q4_K, Q5_K or Q6_K) rows of `nb` super-blocks.
    pub(super) fn new(ty: QuantType, nb: usize) -> Tile {
        assert!(takes(ty), "no tiled kernel for {ty}");
        Tile {
            ty,
            nb,
            rows: 0,
            codes: vec![0; TILE * nb * 64],
            d: vec![0.0; TILE * nb],
            dmin: vec![0.0; TILE * nb],
            mins: vec![0.0; TILE * nb * 8],
            corr: vec![0; TILE * nb * 8],
        }
    }

    /// Unpack `rows` (at most [`TILE`] rows of the tile's type, `nb` super-blocks each).
    pub(super) fn fill<'w>(&mut self, rows: impl ExactSizeIterator<Item = &'w [u8]>) {
        let bb = self.ty.block_bytes();
        assert!(rows.len() <= TILE, "a tile holds {TILE} rows");
        self.rows = rows.len();
        let nb = self.nb;
        for (w, row) in rows.enumerate() {
            assert_eq!(row.len(), nb * bb, "a {} row of {nb} super-blocks", self.ty);
            for (b, wb) in row.chunks_exact(bb).enumerate() {
                let at = w * nb + b;
                let f16 = |o: usize| half::f16::from_le_bytes([wb[o], wb[o + 1]]).to_f32();
                let mut scaled = [0i16; QK_K];
                let out = &mut scaled;
                if matches!(self.ty, QuantType::Q4_K | QuantType::Q5_K) {
                    let scales: &[u8; 12] = wb[4..16].try_into().unwrap();
                    self.d[at] = f16(0);
                    self.dmin[at] = f16(2);
                    for (u, &p) in Q4K_MIN_LANES.iter().enumerate() {
                        self.mins[at * 8 + u] = get_scale_min_k4(p, scales).1 as f32;
                    }
                    let sc: [i16; 8] =
                        std::array::from_fn(|j| get_scale_min_k4(j, scales).0 as i16);
                    if self.ty == QuantType::Q4_K {
                        let qs: &[u8; 128] = wb[16..144].try_into().unwrap();
                        // SAFETY: tiles are filled only where AVX-512 F and BW were detected
                        // (`super::tiled_kernels`).
                        unsafe { q4k_scaled_codes(qs, &sc, out) };
                    } else {
                        let qh: &[u8; 32] = wb[16..48].try_into().unwrap();
                        let qs: &[u8; 128] = wb[48..176].try_into().unwrap();
                        // SAFETY: as above.
                        unsafe { q5k_scaled_codes(qh, qs, &sc, out) };
                    }
                } else {
                    let sc = |i: usize| wb[192 + i] as i8 as i32;
                    self.d[at] = f16(208);
                    for u in 0..8 {
                        let (lo, hi) = (-32 * sc(u), -32 * sc(8 + u));
                        self.corr[at * 8 + u] = pair(lo, hi);
                    }
                    let scales: [i16; 16] = std::array::from_fn(|i| sc(i) as i16);
                    let qs: &[u8; 192] = wb[..192].try_into().unwrap();
                    // SAFETY: as above.
                    unsafe { q6k_scaled_codes(qs, &scales, out) };
                }
                let chunks: [u64; 64] = bytemuck::cast(scaled);
                let dst = &mut self.codes[at * 64..][..64];
                for u in 0..8 {
                    for j in 0..8 {
                        dst[u * 8 + j] = chunks[j * 8 + u];
                    }
                }
            }
        }
    }
}

impl Tile {
    /// Unpack the eight Q4_K rows of one interleaved group (`nb` records,
    /// [`interleaved`](super::interleaved)): the same tile as [`fill`](Tile::fill) makes from
    /// the rows in the file's layout.
    pub(super) fn fill_records(&mut self, group: &[u8]) {
        use super::interleaved::{record_d_dmin, record_min, GROUP_BLOCK_BYTES, GROUP_ROWS};
        assert_eq!(self.ty, QuantType::Q4_K, "only Q4_K rows are interleaved");
        let nb = self.nb;
        assert_eq!(
            group.len(),
            nb * GROUP_BLOCK_BYTES,
            "a group of {nb} records"
        );
        self.rows = GROUP_ROWS;
        let mut scaled = [[0u64; 64]; GROUP_ROWS];
        for (b, rec) in group.chunks_exact(GROUP_BLOCK_BYTES).enumerate() {
            let rec: &[u8; GROUP_BLOCK_BYTES] = rec.try_into().expect("one record");
            // SAFETY: tiles are filled only where AVX-512 F and BW were detected
            // (`super::tiled_kernels`).
            unsafe { record_scaled_codes(rec, &mut scaled) };
            for (w, row) in scaled.iter().enumerate() {
                let at = w * nb + b;
                (self.d[at], self.dmin[at]) = record_d_dmin(rec, w);
                for u in 0..8 {
                    self.mins[at * 8 + u] = record_min(rec, w, u) as f32;
                }
                self.codes[at * 64..][..64].copy_from_slice(row);
            }
        }
    }
}

/// The eight rows' codes of one interleaved Q4_K record times their group's scale, in a
/// tile's order: `out[w][8u + j]` holds row `w`'s elements `32j + 4u .. +4` as four i16.
///
/// The codes of lane pair `v` (32 bytes per group `j`) are an 8 × 8 matrix of 4-byte cells,
/// group `j` by column `4t + s` (lane `v + 4t`, rows `s` and `4 + s`): transposed, column
/// `4t + s` holds those rows' lane `v + 4t` for the eight groups in order, which is what the
/// tile wants, once the nibbles are split and scaled.
#[target_feature(enable = "avx2,avx512f,avx512bw")]
fn record_scaled_codes(
    rec: &[u8; super::interleaved::GROUP_BLOCK_BYTES],
    out: &mut [[u64; 64]; 8],
) {
    use super::interleaved::{record_scale, GROUP_ROWS, RECORD_CODES_AT};
    let m4 = _mm256_set1_epi8(0xf);
    // Each byte of eight scale bytes (one row's, groups 0..8) four times: i16 `4j + e`
    // takes group j's scale.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7,
        7, 7,
    );
    let scales: [__m512i; GROUP_ROWS] = std::array::from_fn(|w| {
        let sc = u64::from_le_bytes(std::array::from_fn(|j| record_scale(rec, w, j)));
        let bytes = _mm256_shuffle_epi8(_mm256_set1_epi64x(sc as i64), spread);
        _mm512_cvtepu8_epi16(bytes)
    });
    for v in 0..4 {
        let row = |j: usize| {
            let at = RECORD_CODES_AT + 32 * (4 * j + v);
            let cell: &[u8; 32] = rec[at..at + 32].try_into().unwrap();
            // SAFETY: `cell` is 32 readable bytes (unaligned load).
            unsafe { _mm256_loadu_si256(cell.as_ptr() as *const __m256i) }
        };
        let r: [__m256i; 8] = std::array::from_fn(row);
        let t: [__m256i; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_epi32(a, b)
            } else {
                _mm256_unpackhi_epi32(a, b)
            }
        });
        // u[k] (k < 4): column k in the low 128 bits, column k + 4 in the high, of groups
        // 0..4; u[4 + k] the same of groups 4..8.
        let u: [__m256i; 8] = std::array::from_fn(|i| {
            let (q, k) = (i / 4, i % 4);
            let (a, b) = (t[4 * q + k / 2], t[4 * q + 2 + k / 2]);
            if k % 2 == 0 {
                _mm256_unpacklo_epi64(a, b)
            } else {
                _mm256_unpackhi_epi64(a, b)
            }
        });
        for c in 0..8 {
            let (k, hi) = (c % 4, c / 4);
            let col = if hi == 0 {
                _mm256_permute2x128_si256(u[k], u[4 + k], 0x20)
            } else {
                _mm256_permute2x128_si256(u[k], u[4 + k], 0x31)
            };
            // Column c = 4t + s: lane v + 4t of rows s (low nibbles) and 4 + s (high).
            let (t, s) = (c / 4, c % 4);
            let lane = v + 4 * t;
            for (w, codes) in [
                (s, _mm256_and_si256(col, m4)),
                (4 + s, _mm256_and_si256(_mm256_srli_epi16(col, 4), m4)),
            ] {
                let prod = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(codes), scales[w]);
                let dst: &mut [u64; 8] = (&mut out[w][8 * lane..8 * lane + 8]).try_into().unwrap();
                // SAFETY: `dst` is 64 writable bytes (unaligned store).
                unsafe { _mm512_storeu_si512(dst.as_mut_ptr() as *mut __m512i, prod) };
            }
        }
    }
}

/// A Q4_K super-block's codes times their group's scale: element `32j + l` is the low (`j`
/// even) or high nibble of byte `32·(j/2) + l`, times `sc[j]`.
#[target_feature(enable = "avx512f,avx512bw")]
fn q4k_scaled_codes(qs: &[u8; 128], sc: &[i16; 8], out: &mut [i16; QK_K]) {
    let m4 = _mm256_set1_epi8(0xf);
    for c in 0..4 {
        let half: &[u8; 32] = qs[32 * c..32 * c + 32].try_into().unwrap();
        // SAFETY: `half` is 32 readable bytes (unaligned load).
        let q = unsafe { _mm256_loadu_si256(half.as_ptr() as *const __m256i) };
        let lo = _mm256_and_si256(q, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        for (h, v) in [lo, hi].into_iter().enumerate() {
            let j = 2 * c + h;
            let scaled = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(v), _mm512_set1_epi16(sc[j]));
            let dst: &mut [i16; 32] = (&mut out[32 * j..32 * j + 32]).try_into().unwrap();
            // SAFETY: `dst` is 64 writable bytes (unaligned store).
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr() as *mut __m512i, scaled) };
        }
    }
}

/// A Q5_K super-block's codes (`q5k_code`, 0..32) times their group's scale: element
/// `32j + l` is the low (`j` even) or high nibble of `qs[32·(j/2) + l]` with bit `j` of
/// `qh[l]` as bit 4, times `sc[j]`.
#[target_feature(enable = "avx512f,avx512bw")]
fn q5k_scaled_codes(qh: &[u8; 32], qs: &[u8; 128], sc: &[i16; 8], out: &mut [i16; QK_K]) {
    let load = |b: &[u8; 32]| {
        // SAFETY: `b` is 32 readable bytes (unaligned load).
        unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) }
    };
    let (m4, one) = (_mm256_set1_epi8(0xf), _mm256_set1_epi8(1));
    let high = load(qh);
    for c in 0..4 {
        let q = load(qs[32 * c..32 * c + 32].try_into().unwrap());
        let lo = _mm256_and_si256(q, m4);
        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        for (h, v) in [lo, hi].into_iter().enumerate() {
            let j = 2 * c + h;
            // Bit j of each byte as its bit 0 (a 16-bit shift by j < 8 moves the high byte's
            // bit j to its bit 0 too), then to bit 4 (bytes of one bit stay inside their byte).
            let bit = _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(j as i32)), one);
            let code = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
            let scaled = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(code), _mm512_set1_epi16(sc[j]));
            let dst: &mut [i16; 32] = (&mut out[32 * j..32 * j + 32]).try_into().unwrap();
            // SAFETY: `dst` is 64 writable bytes (unaligned store).
            unsafe { _mm512_storeu_si512(dst.as_mut_ptr() as *mut __m512i, scaled) };
        }
    }
}

/// A Q6_K super-block's codes (`q6k_code`, 0..64) times their 16-element scale: group
/// `g = 4h + s` (32 elements) takes nibble `s / 2` of `ql[64h + 32·(s % 2) + l]` and bits
/// `2s, 2s + 1` of `qh[32h + l]` as bits 4 and 5.
#[target_feature(enable = "avx512f,avx512bw")]
fn q6k_scaled_codes(qs: &[u8; 192], sc: &[i16; 16], out: &mut [i16; QK_K]) {
    let load = |off: usize| {
        let b: &[u8; 32] = qs[off..off + 32].try_into().unwrap();
        // SAFETY: `b` is 32 readable bytes (unaligned load).
        unsafe { _mm256_loadu_si256(b.as_ptr() as *const __m256i) }
    };
    let (m4, m2) = (_mm256_set1_epi8(0xf), _mm256_set1_epi8(3));
    for g in 0..8 {
        let (h, s) = (g / 4, g % 4);
        let ql = load(64 * h + 32 * (s % 2));
        let lo = _mm256_and_si256(if s < 2 { ql } else { _mm256_srli_epi16(ql, 4) }, m4);
        let qh = load(128 + 32 * h);
        let hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * s as i32)), m2);
        // Bytes of at most 2 bits: a 16-bit shift by 4 keeps each inside its byte.
        let code = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        let scale = _mm512_inserti64x4(
            _mm512_set1_epi16(sc[2 * g]),
            _mm256_set1_epi16(sc[2 * g + 1]),
            1,
        );
        let scaled = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(code), scale);
        let dst: &mut [i16; 32] = (&mut out[32 * g..32 * g + 32]).try_into().unwrap();
        // SAFETY: `dst` is 64 writable bytes (unaligned store).
        unsafe { _mm512_storeu_si512(dst.as_mut_ptr() as *mut __m512i, scaled) };
    }
}

/// The products of the tile's rows with band `q` of `x`: `out[w][r]` for weight row `w` and
/// activation row `16q + r` (padding rows give zero).
///
/// # Safety
/// AVX-512 F, BW and VNNI must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn band(tile: &Tile, x: &Bands, q: usize, out: &mut [[f32; BAND]; TILE]) {
    let q6 = tile.ty == QuantType::Q6_K;
    match (tile.rows, q6) {
        (TILE, false) => band_rows::<TILE, false>(tile, 0, x, q, out),
        (TILE, true) => band_rows::<TILE, true>(tile, 0, x, q, out),
        (rows, _) => {
            // Fewer rows (a matrix whose height is not a multiple of 8): one at a time.
            let mut one = [[0.0f32; BAND]; TILE];
            for w in 0..rows {
                if q6 {
                    band_rows::<1, true>(tile, w, x, q, &mut one);
                } else {
                    band_rows::<1, false>(tile, w, x, q, &mut one);
                }
                out[w] = one[0];
            }
        }
    }
}

/// Rows `w0 .. w0 + W` of the tile (Q6_K, or Q4_K and Q5_K) against band `q`, into `out[..W]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn band_rows<const W: usize, const Q6: bool>(
    tile: &Tile,
    w0: usize,
    x: &Bands,
    q: usize,
    out: &mut [[f32; BAND]; TILE],
) {
    let nb = tile.nb;
    assert!(
        w0 + W <= tile.rows && x.nb == nb && q < x.bands(),
        "tile and band do not fit"
    );
    // The slices the loops read, checked once: row w0 + w's codes from rows[w].
    let rows: [&[u64]; W] = std::array::from_fn(|w| &tile.codes[(w0 + w) * nb * 64..][..nb * 64]);
    let xc = &x.codes[q * nb * 128 * BAND..(q + 1) * nb * 128 * BAND];
    let xd = &x.d[q * nb * BAND..(q + 1) * nb * BAND];
    let xp = &x.pairs[q * nb * 8 * BAND..(q + 1) * nb * 8 * BAND];
    let xb = &x.bsums[q * nb * 8 * BAND..(q + 1) * nb * 8 * BAND];
    let mut acc = [[_mm512_setzero_ps(); 8]; W];
    for b in 0..nb {
        // SAFETY: b < nb: 16 floats at b·16 of the band's `nb × 16` scales.
        let d_x = unsafe { _mm512_loadu_ps(xd.as_ptr().add(b * BAND)) };
        // `d_w·d_x` and `dmin_w·d_x` of every row pair, once per super-block.
        let s1: [__m512; W] =
            std::array::from_fn(|w| _mm512_mul_ps(_mm512_set1_ps(tile.d[(w0 + w) * nb + b]), d_x));
        let s2: [__m512; W] = std::array::from_fn(|w| {
            _mm512_mul_ps(_mm512_set1_ps(tile.dmin[(w0 + w) * nb + b]), d_x)
        });
        for u in 0..8 {
            let at = (b * 8 + u) * 16;
            let mut isum = [_mm512_setzero_si512(); W];
            for jp in 0..16 {
                // SAFETY: at + jp < nb·128, so 16 i32 from (at + jp)·16 are inside `xc`.
                let xv = unsafe {
                    _mm512_loadu_si512(xc.as_ptr().add((at + jp) * BAND) as *const __m512i)
                };
                for w in 0..W {
                    // SAFETY: at + jp < nb·128: i32 `at + jp` is inside the row's nb·64 u64.
                    let pair = unsafe { (rows[w].as_ptr() as *const i32).add(at + jp).read() };
                    isum[w] = _mm512_dpwssd_epi32(isum[w], xv, _mm512_set1_epi32(pair));
                }
            }
            let lane = (b * 8 + u) * BAND;
            if Q6 {
                // SAFETY: lane + 16 ≤ nb·128 i32 of the band's 16-code sums.
                let bs = unsafe { _mm512_loadu_si512(xb.as_ptr().add(lane) as *const __m512i) };
                for w in 0..W {
                    let corr = tile.corr[((w0 + w) * nb + b) * 8 + u];
                    isum[w] = _mm512_dpwssd_epi32(isum[w], bs, _mm512_set1_epi32(corr));
                }
            }
            // SAFETY: lane + 16 ≤ nb·128 floats of the band's pair sums.
            let pairs = unsafe { _mm512_loadu_ps(xp.as_ptr().add(lane)) };
            for w in 0..W {
                let wi = (w0 + w) * nb + b;
                let t1 = _mm512_mul_ps(s1[w], _mm512_cvtepi32_ps(isum[w]));
                let step = if Q6 {
                    t1
                } else {
                    let summ = _mm512_mul_ps(_mm512_set1_ps(tile.mins[wi * 8 + u]), pairs);
                    _mm512_sub_ps(t1, _mm512_mul_ps(s2[w], summ))
                };
                acc[w][u] = _mm512_add_ps(acc[w][u], step);
            }
        }
    }
    for w in 0..W {
        let a = &acc[w];
        let v = _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
            _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])),
        );
        // SAFETY: 16 writable floats (unaligned store).
        unsafe { _mm512_storeu_ps(out[w].as_mut_ptr(), v) };
    }
}

/// Whether `ty` has a tiled kernel.
pub(super) fn takes(ty: QuantType) -> bool {
    matches!(ty, QuantType::Q4_K | QuantType::Q5_K | QuantType::Q6_K)
}
