//! Dot-product kernels: `Σ a[i]·w[i]` of an f32 activation row against a weight row stored as
//! f32, bf16 or f16.
//!
//! Every path sums in one canonical order so results are bit-identical whichever path runs:
//! 32 lanes, element `i` accumulated into lane `i % 32` with a fused multiply-add, the last
//! partial chunk padded with zeros, then the lanes folded as a fixed tree
//! (`l += l+16`, `l += l+8`, `l += l+4`, `l += l+2`, `l += l+1`). The scalar reference spells
//! the order out; the AVX2+FMA (x86-64) and NEON (aarch64) paths are the same order in
//! registers. The path is chosen once at run time ([`Isa::detect`]).

use half::{bf16, f16};

use super::WeightData;

/// Lanes of the canonical summation order.
pub const LANES: usize = 32;

/// Instruction set used by the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable scalar reference.
    Scalar,
    /// x86-64 AVX2 + FMA (+ F16C for f16 weights).
    Avx2,
    /// aarch64 NEON.
    Neon,
}

impl Isa {
    /// The best instruction set this CPU supports (`COLI_ISA=scalar` forces the reference).
    pub fn detect() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| {
            if std::env::var("COLI_ISA").as_deref() == Ok("scalar") {
                return Isa::Scalar;
            }
            Isa::best_available()
        })
    }

    /// The best instruction set available, ignoring overrides.
    pub fn best_available() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if avx2_fma_f16c() {
                return Isa::Avx2;
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("neon") {
                return Isa::Neon;
            }
        }
        Isa::Scalar
    }
}

/// Whether this CPU has AVX2, FMA and F16C: what the x86-64 kernels need. The dispatchers
/// check it next to each call into them (a cached bit test), so a caller that passes
/// [`Isa::Avx2`] on another CPU gets the scalar reference, never an illegal instruction.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn avx2_fma_f16c() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Whether the 512-bit kernels may run (AVX-512 F and BW detected, `COLI_ISA` not set to
/// `avx2` or `scalar`).
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx512() -> bool {
    static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *YES.get_or_init(|| {
        std::env::var("COLI_ISA").is_err()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
    })
}

/// Element types a weight row can hold, convertible to f32 exactly.
pub trait WeightElem: Copy + Default + Send + Sync {
    fn to_f32(self) -> f32;
}
impl WeightElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}
impl WeightElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
impl WeightElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// Fold the 32 lane sums in the canonical tree order.
#[inline(always)]
fn fold_lanes(acc: &mut [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width >= 1 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// Scalar reference dot product in the canonical order.
pub fn dot_scalar<W: WeightElem>(a: &[f32], w: &[W]) -> f32 {
    assert_eq!(a.len(), w.len());
    let mut acc = [0.0f32; LANES];
    let full = a.len() / LANES * LANES;
    for c in (0..full).step_by(LANES) {
        for l in 0..LANES {
            acc[l] = a[c + l].mul_add(w[c + l].to_f32(), acc[l]);
        }
    }
    if full < a.len() {
        for l in 0..LANES {
            let (x, y) = match a.get(full + l) {
                Some(&x) => (x, w[full + l].to_f32()),
                None => (0.0, 0.0),
            };
            acc[l] = x.mul_add(y, acc[l]);
        }
    }
    fold_lanes(&mut acc)
}

/// Dot product of an activation row with a weight row, on the given instruction set.
#[inline]
pub fn dot(isa: Isa, a: &[f32], w: WeightData<'_>) -> f32 {
    if let WeightData::Quant(..) | WeightData::F8Block { .. } = w {
        return dot_dequantized(isa, a, w);
    }
    match (isa, w) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, w) => dot_block::<1, 1>(isa, [a], [w])[0][0],
        #[cfg(target_arch = "aarch64")]
        // SAFETY: NEON was just detected.
        (Isa::Neon, w) if std::arch::is_aarch64_feature_detected!("neon") => unsafe {
            neon::dot(a, w)
        },
        (_, WeightData::F32(w)) => dot_scalar(a, w),
        (_, WeightData::BF16(w)) => dot_scalar(a, w),
        (_, WeightData::F16(w)) => dot_scalar(a, w),
        (_, WeightData::Quant(..) | WeightData::F8Block { .. }) => unreachable!("handled above"),
    }
}

/// A block-format weight row: dequantize, then the f32 dot (`matmul` routes these to the
/// integer kernels of `qmatmul`; this is the reference for any other caller).
fn dot_dequantized(isa: Isa, a: &[f32], w: WeightData<'_>) -> f32 {
    let view = super::WeightView {
        rows: 1,
        cols: a.len(),
        data: w,
        interleaved: None,
    };
    let mut wf = vec![0.0f32; a.len()];
    view.row_to_f32(0, &mut wf);
    dot(isa, a, WeightData::F32(&wf))
}

/// The dot product of `a` with one MXFP4 row (`a.len() / 32` blocks of ggml's layout: the
/// E8M0 byte, then 16 bytes of codes, element `j` in the low nibble of byte `j`, `j + 16` in
/// the high one), decoding each block's 32 weights in registers as ggml dequantizes them
/// (`kvalues[code] · 2^(e − 128)`): bit for bit the f32 [`dot`] of the dequantized row, whose
/// 32 lanes are exactly one block, without writing the row out first.
pub fn dot_mxfp4(isa: Isa, a: &[f32], w: &[u8]) -> f32 {
    use super::quant::BlockMxfp4;
    assert!(
        a.len().is_multiple_of(LANES) && w.len() == a.len() / LANES * BlockMxfp4::BYTES,
        "dot_mxfp4: {} activations against {} bytes",
        a.len(),
        w.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && avx2_fma_f16c() {
        // SAFETY: AVX2 and FMA were detected just above; the lengths were checked.
        return unsafe { avx2::dot_mxfp4(a, w) };
    }
    let _ = isa;
    dot_mxfp4_scalar(a, w)
}

/// [`dot_mxfp4`]'s scalar reference: each block decoded, then the canonical f32 order.
pub fn dot_mxfp4_scalar(a: &[f32], w: &[u8]) -> f32 {
    use super::quant::BlockMxfp4;
    let mut acc = [0.0f32; LANES];
    let mut y = [0.0f32; LANES];
    for (x, b) in a.chunks_exact(LANES).zip(w.chunks_exact(BlockMxfp4::BYTES)) {
        BlockMxfp4::from_bytes(b).dequantize(&mut y);
        for l in 0..LANES {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    fold_lanes(&mut acc)
}

/// `out[j] = dot(a, m[j·stride ..][.. a.len()])` for every `j < out.len()`: one activation row
/// against rows of a strided f32 matrix (an attention query against one head's cached keys),
/// each in the canonical order — the bits of [`dot`] on each pair, without a call per row.
pub fn dot_strided(isa: Isa, a: &[f32], m: &[f32], stride: usize, out: &mut [f32]) {
    let n = out.len();
    assert!(
        n == 0 || (n - 1) * stride + a.len() <= m.len(),
        "dot_strided: {n} rows of {} at stride {stride} in {} values",
        a.len(),
        m.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && avx2_fma_f16c() {
        // SAFETY: AVX2 and FMA were detected just above; the bounds were checked.
        return unsafe { avx2::dot_strided(a, m, stride, out) };
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot(
            isa,
            a,
            WeightData::F32(&m[j * stride..j * stride + a.len()]),
        );
    }
}

/// `out[e] += p[j] · m[j·stride + e]` for `j = 0, 1, …` in that order and every `e <
/// out.len()`, each product rounded and then added (no fused multiply-add): attention's
/// probability-weighted sum of one head's cached values. The scalar loop is the reference; the
/// SIMD path does the same operations on eight elements at a time.
pub fn add_weighted_rows(isa: Isa, p: &[f32], m: &[f32], stride: usize, out: &mut [f32]) {
    let n = p.len();
    assert!(
        n == 0 || (n - 1) * stride + out.len() <= m.len(),
        "add_weighted_rows: {n} rows of {} at stride {stride} in {} values",
        out.len(),
        m.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && avx2_fma_f16c() {
        // SAFETY: AVX2 was detected just above; the bounds were checked.
        return unsafe { avx2::add_weighted_rows(p, m, stride, out) };
    }
    let _ = isa;
    add_weighted_rows_scalar(p, m, stride, out);
}

/// [`add_weighted_rows`]' scalar reference.
pub fn add_weighted_rows_scalar(p: &[f32], m: &[f32], stride: usize, out: &mut [f32]) {
    let d = out.len();
    for (j, &pj) in p.iter().enumerate() {
        for (o, &v) in out.iter_mut().zip(&m[j * stride..j * stride + d]) {
            *o += pj * v;
        }
    }
}

/// [`dot_strided`] over f16 rows (an f16 key cache), each value widened exactly: the bits of
/// [`dot`] on each pair.
pub fn dot_strided_f16(isa: Isa, a: &[f32], m: &[half::f16], stride: usize, out: &mut [f32]) {
    let n = out.len();
    assert!(
        n == 0 || (n - 1) * stride + a.len() <= m.len(),
        "dot_strided_f16: {n} rows of {} at stride {stride} in {} values",
        a.len(),
        m.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && avx2_fma_f16c() {
        // SAFETY: AVX2, FMA and F16C were detected just above; the bounds were checked.
        return unsafe { avx2::dot_strided(a, m, stride, out) };
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot(
            isa,
            a,
            WeightData::F16(&m[j * stride..j * stride + a.len()]),
        );
    }
}

/// [`add_weighted_rows`] over f16 rows (an f16 value cache), each value widened exactly: the
/// bits of [`add_weighted_rows_scalar`] on the widened rows.
pub fn add_weighted_rows_f16(isa: Isa, p: &[f32], m: &[half::f16], stride: usize, out: &mut [f32]) {
    let n = p.len();
    assert!(
        n == 0 || (n - 1) * stride + out.len() <= m.len(),
        "add_weighted_rows_f16: {n} rows of {} at stride {stride} in {} values",
        out.len(),
        m.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && avx2_fma_f16c() {
        // SAFETY: AVX2 and F16C were detected just above; the bounds were checked.
        return unsafe { avx2::add_weighted_rows(p, m, stride, out) };
    }
    let _ = isa;
    let d = out.len();
    for (j, &pj) in p.iter().enumerate() {
        for (o, v) in out.iter_mut().zip(&m[j * stride..j * stride + d]) {
            *o += pj * v.to_f32();
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register blocks read best as index loops
mod avx2 {
    //! AVX2 blocks: `R` activation rows against `C` weight rows at once (R·C ≤ 3, so the
    //! 4·R·C accumulators stay in registers). Every output keeps the canonical order: its
    //! lanes, its chunk order, its zero-padded tail and its fold are those of `dot_scalar`.
    use super::LANES;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Load 8 weights as f32 from `p`.
    pub trait Load8: Copy + Default {
        /// # Safety
        /// Eight values must be readable at `p` (no alignment needed), and the CPU must have
        /// AVX2 (and F16C for f16).
        unsafe fn load8(p: *const Self) -> __m256;
    }
    impl Load8 for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            // SAFETY: the caller's contract: 8 readable f32, AVX available.
            unsafe { _mm256_loadu_ps(p) }
        }
    }
    impl Load8 for bf16 {
        #[inline(always)]
        unsafe fn load8(p: *const bf16) -> __m256 {
            // SAFETY: the caller's contract: 8 readable bf16 (16 bytes), AVX2 available.
            unsafe {
                let h = _mm_loadu_si128(p as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
            }
        }
    }
    impl Load8 for f16 {
        #[inline(always)]
        unsafe fn load8(p: *const f16) -> __m256 {
            // SAFETY: the caller's contract: 8 readable f16 (16 bytes), F16C available.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
        }
    }

    /// The canonical fold of 32 lanes held in 4 registers (lanes 0-7, 8-15, 16-23, 24-31):
    /// `l += l+16`, `l += l+8`, `l += l+4`, `l += l+2`, `l += l+1`, as vertical adds.
    ///
    /// # Safety
    /// The CPU must have AVX.
    #[inline(always)]
    unsafe fn fold(acc: [__m256; 4]) -> f32 {
        // SAFETY: register-only operations, on the AVX the caller guarantees.
        unsafe {
            let lo = _mm256_add_ps(acc[0], acc[2]); // lanes 0-7 (+16)
            let hi = _mm256_add_ps(acc[1], acc[3]); // lanes 8-15 (+16)
            let v8 = _mm256_add_ps(lo, hi); // l += l+8
            let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps(v8, 1)); // l += l+4
            let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4)); // l += l+2
            let v1 = _mm_add_ss(v2, _mm_shuffle_ps(v2, v2, 0b01)); // l += l+1
            _mm_cvtss_f32(v1)
        }
    }

    /// One 32-element chunk of `R` activation rows against `C` weight rows.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA (and F16C for f16); 32 values must be readable at each
    /// pointer.
    #[inline(always)]
    unsafe fn chunk<W: Load8, const R: usize, const C: usize>(
        a: &[*const f32; R],
        w: &[*const W; C],
        acc: &mut [[[__m256; 4]; C]; R],
    ) {
        // SAFETY: the caller's contract: the features, and elements 8g..8g + 8 (g < 4) of
        // the 32 readable at each pointer.
        unsafe {
            for g in 0..4 {
                let mut wv = [_mm256_setzero_ps(); C];
                for c in 0..C {
                    wv[c] = W::load8(w[c].add(8 * g));
                }
                for r in 0..R {
                    let av = _mm256_loadu_ps(a[r].add(8 * g));
                    for c in 0..C {
                        acc[r][c][g] = _mm256_fmadd_ps(av, wv[c], acc[r][c][g]);
                    }
                }
            }
        }
    }

    /// `out[r][c] = dot(a[r], w[c])` in the canonical order.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA (and F16C for f16); all slices have the same length.
    #[inline(always)]
    pub unsafe fn block<W: Load8, const R: usize, const C: usize>(
        a: [&[f32]; R],
        w: [&[W]; C],
    ) -> [[f32; C]; R] {
        let n = a[0].len();
        // SAFETY: a register-only operation, on the AVX the caller guarantees.
        let mut acc = [[[unsafe { _mm256_setzero_ps() }; 4]; C]; R];
        let full = n / LANES * LANES;
        let mut ap = [std::ptr::null::<f32>(); R];
        let mut wp = [std::ptr::null::<W>(); C];
        let mut c0 = 0;
        while c0 < full {
            for r in 0..R {
                ap[r] = a[r][c0..].as_ptr();
            }
            for c in 0..C {
                wp[c] = w[c][c0..].as_ptr();
            }
            // SAFETY: the caller's features; every slice has n >= c0 + 32 elements (c0 + 32
            // <= full <= n), so 32 are readable at each pointer.
            unsafe { chunk(&ap, &wp, &mut acc) };
            c0 += LANES;
        }
        if full < n {
            let tail = n - full;
            let mut ta = [[0.0f32; LANES]; R];
            let mut tw = [[W::default(); LANES]; C];
            for r in 0..R {
                ta[r][..tail].copy_from_slice(&a[r][full..]);
                ap[r] = ta[r].as_ptr();
            }
            for c in 0..C {
                tw[c][..tail].copy_from_slice(&w[c][full..]);
                wp[c] = tw[c].as_ptr();
            }
            // SAFETY: the caller's features; the pointers are to the 32-element arrays `ta`
            // and `tw`.
            unsafe { chunk(&ap, &wp, &mut acc) };
        }
        let mut out = [[0.0f32; C]; R];
        for r in 0..R {
            for c in 0..C {
                // SAFETY: the caller's contract includes AVX.
                out[r][c] = unsafe { fold(acc[r][c]) };
            }
        }
        out
    }

    /// [`super::dot_mxfp4`] on AVX2: per block, the 16 code bytes split into low and high
    /// nibbles, looked up in the doubled E2M1 table (`pshufb`), widened to f32 and multiplied
    /// by the block's `2^(e − 128)` — the very products ggml's dequantization computes —
    /// then fused into lanes 0-15 (low nibbles) and 16-31 (high nibbles) as `dot` does.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `w` holds `a.len() / 32` blocks of 17 bytes.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_mxfp4(a: &[f32], w: &[u8]) -> f32 {
        use crate::tensor::quant::{e8m0_to_f32_half, KVALUES_MXFP4};
        // SAFETY: register operations and loads within `a` (32 f32 per block) and `w` (17
        // bytes per block), both checked by the caller; AVX2 and FMA by the caller's contract.
        unsafe {
            let table = _mm_loadu_si128(KVALUES_MXFP4.as_ptr() as *const __m128i);
            let mask = _mm_set1_epi8(0x0f);
            let mut acc = [_mm256_setzero_ps(); 4];
            for (b, block) in w.chunks_exact(17).enumerate() {
                let d = _mm256_set1_ps(e8m0_to_f32_half(block[0]));
                let qs = _mm_loadu_si128(block[1..].as_ptr() as *const __m128i);
                let lo = _mm_shuffle_epi8(table, _mm_and_si128(qs, mask));
                let hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(qs, 4), mask));
                let widen = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                let wv = [
                    widen(lo),
                    widen(_mm_srli_si128(lo, 8)),
                    widen(hi),
                    widen(_mm_srli_si128(hi, 8)),
                ];
                let x = a[b * LANES..].as_ptr();
                for g in 0..4 {
                    let wg = _mm256_mul_ps(wv[g], d);
                    acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8 * g)), wg, acc[g]);
                }
            }
            fold(acc)
        }
    }

    /// [`super::dot_strided`] on AVX2: `block` inlined for each row, three rows a pass.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA (and F16C for f16 rows); `(out.len() − 1)·stride +
    /// a.len() ≤ m.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_strided<W: Load8>(a: &[f32], m: &[W], stride: usize, out: &mut [f32]) {
        let k = a.len();
        let row = |j: usize| &m[j * stride..j * stride + k];
        let mut j = 0;
        while j + 3 <= out.len() {
            // SAFETY: the caller's features; every row has k elements, as `a`.
            let d = unsafe { block::<W, 1, 3>([a], [row(j), row(j + 1), row(j + 2)]) };
            out[j..j + 3].copy_from_slice(&d[0]);
            j += 3;
        }
        while j < out.len() {
            // SAFETY: as above.
            out[j] = unsafe { block::<W, 1, 1>([a], [row(j)]) }[0][0];
            j += 1;
        }
    }

    /// [`super::add_weighted_rows`] on AVX2: the output in slices of up to 64 elements held in
    /// registers while every row passes (`acc + p·v`, a rounded product then a rounded sum, as
    /// the reference); a slice's last `len % 8` elements by the scalar loop.
    ///
    /// # Safety
    /// The CPU must have AVX2 (and F16C for f16 rows); `(p.len() − 1)·stride + out.len() ≤
    /// m.len()`.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn add_weighted_rows<W: Load8 + Into<f32>>(
        p: &[f32],
        m: &[W],
        stride: usize,
        out: &mut [f32],
    ) {
        const SLICE: usize = 64;
        let d = out.len();
        let mut e0 = 0;
        while e0 < d {
            let width = SLICE.min(d - e0);
            let vec = width / 8;
            // SAFETY: the caller's features and bound; `e0 + 8·vec ≤ d`.
            unsafe {
                match vec {
                    8 => weighted_slice::<W, 8>(p, m, stride, out, e0),
                    7 => weighted_slice::<W, 7>(p, m, stride, out, e0),
                    6 => weighted_slice::<W, 6>(p, m, stride, out, e0),
                    5 => weighted_slice::<W, 5>(p, m, stride, out, e0),
                    4 => weighted_slice::<W, 4>(p, m, stride, out, e0),
                    3 => weighted_slice::<W, 3>(p, m, stride, out, e0),
                    2 => weighted_slice::<W, 2>(p, m, stride, out, e0),
                    1 => weighted_slice::<W, 1>(p, m, stride, out, e0),
                    _ => {}
                }
            }
            for e in e0 + 8 * vec..e0 + width {
                for (j, &pj) in p.iter().enumerate() {
                    out[e] += pj * m[j * stride + e].into();
                }
            }
            e0 += width;
        }
    }

    /// `out[e0 ..][.. 8V] += p[j] · m[j·stride + e0 ..]` for every row `j` in order, the `V`
    /// vectors of the output held in registers.
    ///
    /// # Safety
    /// The CPU must have AVX; `e0 + 8V ≤ out.len()` and `(p.len() − 1)·stride + out.len() ≤
    /// m.len()`.
    #[inline(always)]
    unsafe fn weighted_slice<W: Load8, const V: usize>(
        p: &[f32],
        m: &[W],
        stride: usize,
        out: &mut [f32],
        e0: usize,
    ) {
        // SAFETY: loads and stores of out[e0 + 8g ..][..8] (g < V, within `out`) and of
        // m[j·stride + e0 + 8g ..][..8] (within row j's first out.len() values, inside `m` by
        // the caller's bound); AVX by the caller's contract.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); V];
            for g in 0..V {
                acc[g] = _mm256_loadu_ps(out.as_ptr().add(e0 + 8 * g));
            }
            for (j, &pj) in p.iter().enumerate() {
                let pv = _mm256_set1_ps(pj);
                let r = m.as_ptr().add(j * stride + e0);
                for g in 0..V {
                    acc[g] = _mm256_add_ps(acc[g], _mm256_mul_ps(pv, W::load8(r.add(8 * g))));
                }
            }
            for g in 0..V {
                _mm256_storeu_ps(out.as_mut_ptr().add(e0 + 8 * g), acc[g]);
            }
        }
    }

    macro_rules! entry {
        ($name:ident, $w:ty, $feat:literal) => {
            /// # Safety
            /// The CPU must support the enabled features; all slices have the same length.
            #[target_feature(enable = $feat)]
            pub unsafe fn $name<const R: usize, const C: usize>(
                a: [&[f32]; R],
                w: [&[$w]; C],
            ) -> [[f32; C]; R] {
                // SAFETY: the caller's contract is `block`'s.
                unsafe { block(a, w) }
            }
        };
    }
    entry!(block_f32, f32, "avx2,fma");
    entry!(block_bf16, bf16, "avx2,fma");
    entry!(block_f16, f16, "avx2,fma,f16c");
}

/// `out[r][c] = dot(a[r], w[c])` for `R` activation rows and `C` weight rows of one dtype,
/// each output in the canonical order (identical bits to [`dot`] on each pair). `R·C ≤ 3`.
#[inline]
pub fn dot_block<const R: usize, const C: usize>(
    isa: Isa,
    a: [&[f32]; R],
    w: [WeightData<'_>; C],
) -> [[f32; C]; R] {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && avx2_fma_f16c() {
        let n = a[0].len();
        macro_rules! go {
            ($variant:ident, $f:ident) => {{
                let mut ws = [&[][..]; C];
                for c in 0..C {
                    match w[c] {
                        WeightData::$variant(x) => ws[c] = x,
                        _ => return dot_block_each(isa, a, w),
                    }
                    assert_eq!(ws[c].len(), n);
                }
                for r in a.iter() {
                    assert_eq!(r.len(), n);
                }
                // SAFETY: AVX2, FMA and F16C were detected just above, and every slice was
                // checked to have length n.
                return unsafe { avx2::$f(a, ws) };
            }};
        }
        match w[0] {
            WeightData::F32(_) => go!(F32, block_f32),
            WeightData::BF16(_) => go!(BF16, block_bf16),
            WeightData::F16(_) => go!(F16, block_f16),
            WeightData::Quant(..) | WeightData::F8Block { .. } => {}
        }
    }
    dot_block_each(isa, a, w)
}

#[allow(clippy::needless_range_loop)]
fn dot_block_each<const R: usize, const C: usize>(
    isa: Isa,
    a: [&[f32]; R],
    w: [WeightData<'_>; C],
) -> [[f32; C]; R] {
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = dot(isa, a[r], w[c]);
        }
    }
    out
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::{fold_lanes, WeightElem, LANES};
    use crate::tensor::WeightData;
    use std::arch::aarch64::*;

    /// # Safety
    /// The CPU must have NEON; `a` and `w` hold at least 32 elements.
    #[inline(always)]
    unsafe fn chunk<W: WeightElem>(a: &[f32], w: &[W], acc: &mut [float32x4_t; 8]) {
        let mut wf = [0.0f32; LANES];
        for l in 0..LANES {
            wf[l] = w[l].to_f32();
        }
        let a = &a[..LANES];
        for (r, reg) in acc.iter_mut().enumerate() {
            // SAFETY: NEON (the caller's contract); elements 4r..4r + 4 (r < 8) of the 32 in
            // `a` and `wf`.
            *reg = unsafe {
                vfmaq_f32(
                    *reg,
                    vld1q_f32(a.as_ptr().add(4 * r)),
                    vld1q_f32(wf.as_ptr().add(4 * r)),
                )
            };
        }
    }

    /// # Safety
    /// The CPU must have NEON.
    #[target_feature(enable = "neon")]
    unsafe fn dot_generic<W: WeightElem>(a: &[f32], w: &[W]) -> f32 {
        assert_eq!(a.len(), w.len());
        let mut acc = [vdupq_n_f32(0.0); 8];
        let full = a.len() / LANES * LANES;
        let mut c = 0;
        while c < full {
            // SAFETY: NEON (the caller's contract); both slices are 32 elements.
            unsafe { chunk(&a[c..c + LANES], &w[c..c + LANES], &mut acc) };
            c += LANES;
        }
        if full < a.len() {
            let mut ta = [0.0f32; LANES];
            let mut tw = [W::default(); LANES];
            let n = a.len() - full;
            ta[..n].copy_from_slice(&a[full..]);
            tw[..n].copy_from_slice(&w[full..]);
            // SAFETY: NEON (the caller's contract); both arrays are 32 elements.
            unsafe { chunk(&ta, &tw, &mut acc) };
        }
        let mut lanes = [0.0f32; LANES];
        for (r, reg) in acc.iter().enumerate() {
            // SAFETY: elements 4r..4r + 4 (r < 8) of the 32 in `lanes`.
            unsafe { vst1q_f32(lanes.as_mut_ptr().add(4 * r), *reg) };
        }
        fold_lanes(&mut lanes)
    }

    /// # Safety
    /// The CPU must support NEON.
    pub unsafe fn dot(a: &[f32], w: WeightData<'_>) -> f32 {
        // SAFETY: the caller's contract (NEON) is `dot_generic`'s.
        unsafe {
            match w {
                WeightData::F32(w) => dot_generic(a, w),
                WeightData::BF16(w) => dot_generic(a, w),
                WeightData::F16(w) => dot_generic(a, w),
                WeightData::Quant(..) | WeightData::F8Block { .. } => {
                    unreachable!("block formats are dispatched before NEON")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::test_values::xorshift as pseudo_random;

    /// Naive f64 dot product: an independent reference for the value (not the bits).
    fn dot_f64(a: &[f32], w: &[f32]) -> f64 {
        a.iter().zip(w).map(|(&x, &y)| x as f64 * y as f64).sum()
    }

    /// An attention query against strided key rows: every score has the bits of [`dot`] on
    /// that pair and is close to the f64 dot, for head widths with and without a partial
    /// 32-lane chunk and row counts around the three-row passes, on every instruction set.
    #[test]
    fn strided_dots_are_the_dot_of_each_row() {
        for isa in [Isa::Scalar, Isa::best_available()] {
            for (hd, stride, rows) in [
                (64, 192, 1),
                (64, 192, 7),
                (80, 160, 9),
                (100, 300, 4),
                (128, 128, 3),
                (256, 512, 5),
            ] {
                let a = pseudo_random(hd, hd as u32);
                let m = pseudo_random((rows - 1) * stride + hd, (rows * stride) as u32);
                let mut out = vec![f32::NAN; rows];
                dot_strided(isa, &a, &m, stride, &mut out);
                for (j, &o) in out.iter().enumerate() {
                    let row = &m[j * stride..j * stride + hd];
                    assert_eq!(
                        o.to_bits(),
                        dot_scalar(&a, row).to_bits(),
                        "{isa:?} hd {hd} row {j}"
                    );
                    assert!(
                        (o as f64 - dot_f64(&a, row)).abs() < 1e-4,
                        "{isa:?} hd {hd} row {j}"
                    );
                }
            }
        }
    }

    /// The probability-weighted sum of value rows: the SIMD path gives the reference's bits
    /// (a rounded product, then a rounded sum, rows in order) for widths that are whole
    /// 64-element slices, partial ones and a scalar tail, added to what `out` held; and the
    /// reference is the f64 sum within rounding.
    #[test]
    fn weighted_rows_match_the_reference_bit_for_bit() {
        for (d, stride, rows) in [
            (64, 192, 1),
            (64, 192, 33),
            (8, 24, 5),
            (72, 144, 10),
            (100, 300, 17),
            (128, 256, 64),
            (7, 7, 3),
        ] {
            let p = pseudo_random(rows, 7 + rows as u32);
            let m = pseudo_random((rows - 1) * stride + d, d as u32);
            let init = pseudo_random(d, 99);
            let mut want = init.clone();
            add_weighted_rows_scalar(&p, &m, stride, &mut want);
            for (e, &w) in want.iter().enumerate() {
                let exact: f64 = init[e] as f64
                    + (0..rows)
                        .map(|j| p[j] as f64 * m[j * stride + e] as f64)
                        .sum::<f64>();
                assert!((w as f64 - exact).abs() < 1e-4, "d {d} element {e}");
            }
            for isa in [Isa::Scalar, Isa::best_available()] {
                let mut got = init.clone();
                add_weighted_rows(isa, &p, &m, stride, &mut got);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{isa:?} d {d} rows {rows}");
            }
        }
    }

    /// MXFP4 rows decoded inside the dot kernel give the bits of the dequantized row's f32
    /// dot, on every instruction set: all 16 codes (8, −0, decodes to +0), scale bytes from
    /// the subnormal 0 and 1 to 254, lengths of 1 to 90 blocks.
    #[test]
    fn mxfp4_dot_equals_the_dequantized_row_dot_bit_for_bit() {
        use crate::tensor::quant::{dequantize_row, QuantType};
        let isa = Isa::best_available();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut byte = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 56) as u8
        };
        for blocks in [1, 2, 3, 8, 90] {
            let n = blocks * 32;
            let a = pseudo_random(n, blocks as u32);
            for scales in [[0u8, 1, 2, 3], [120, 127, 130, 254], [118, 119, 121, 125]] {
                let w: Vec<u8> = (0..blocks)
                    .flat_map(|b| {
                        let codes: Vec<u8> = (0..16).map(|_| byte()).collect();
                        std::iter::once(scales[b % 4]).chain(codes)
                    })
                    .collect();
                let mut wf = vec![0.0f32; n];
                dequantize_row(QuantType::MXFP4, &w, &mut wf).unwrap();
                let want = dot(isa, &a, WeightData::F32(&wf)).to_bits();
                assert_eq!(dot_scalar(&a, &wf).to_bits(), want);
                assert_eq!(dot_mxfp4_scalar(&a, &w).to_bits(), want, "{blocks} blocks");
                assert_eq!(
                    dot_mxfp4(isa, &a, &w).to_bits(),
                    want,
                    "{blocks} blocks, {isa:?}"
                );
            }
        }
    }

    #[test]
    fn scalar_reference_is_accurate() {
        for n in [1, 7, 31, 32, 33, 64, 100, 1000, 4097] {
            let a = pseudo_random(n, 1);
            let w = pseudo_random(n, 2);
            let got = dot_scalar(&a, &w) as f64;
            let want = dot_f64(&a, &w);
            assert!(
                (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                "n={n}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn every_isa_matches_the_scalar_reference_bit_for_bit() {
        let isa = Isa::best_available();
        for n in [1, 5, 31, 32, 33, 63, 64, 65, 200, 1024, 2047, 4099] {
            let a = pseudo_random(n, 3);
            let wf = pseudo_random(n, 4);
            let wb: Vec<bf16> = wf.iter().map(|&x| bf16::from_f32(x)).collect();
            let wh: Vec<f16> = wf.iter().map(|&x| f16::from_f32(x)).collect();
            for (data, reference) in [
                (WeightData::F32(&wf), dot_scalar(&a, &wf)),
                (WeightData::BF16(&wb), dot_scalar(&a, &wb)),
                (WeightData::F16(&wh), dot_scalar(&a, &wh)),
            ] {
                let got = dot(isa, &a, data);
                assert_eq!(
                    got.to_bits(),
                    reference.to_bits(),
                    "{isa:?} n={n}: {got} vs {reference}"
                );
            }
        }
    }

    #[test]
    #[allow(clippy::needless_range_loop)]
    fn blocks_of_rows_give_the_bits_of_single_dots() {
        let isa = Isa::best_available();
        for n in [3, 32, 45, 96, 1000] {
            let a: Vec<Vec<f32>> = (0..3).map(|i| pseudo_random(n, 10 + i)).collect();
            let wf: Vec<Vec<f32>> = (0..2).map(|i| pseudo_random(n, 20 + i)).collect();
            let wb: Vec<Vec<bf16>> = wf
                .iter()
                .map(|w| w.iter().map(|&x| bf16::from_f32(x)).collect())
                .collect();
            let single = |r: usize, w: WeightData<'_>| dot_scalar_data(&a[r], w).to_bits();
            for (w0, w1) in [
                (WeightData::F32(&wf[0]), WeightData::F32(&wf[1])),
                (WeightData::BF16(&wb[0]), WeightData::BF16(&wb[1])),
            ] {
                let b = dot_block::<1, 2>(isa, [&a[0]], [w0, w1]);
                assert_eq!(
                    [b[0][0].to_bits(), b[0][1].to_bits()],
                    [single(0, w0), single(0, w1)],
                    "n={n}"
                );
                let b = dot_block::<3, 1>(isa, [&a[0], &a[1], &a[2]], [w1]);
                for r in 0..3 {
                    assert_eq!(b[r][0].to_bits(), single(r, w1), "n={n} r={r}");
                }
            }
        }
    }

    fn dot_scalar_data(a: &[f32], w: WeightData<'_>) -> f32 {
        match w {
            WeightData::F32(w) => dot_scalar(a, w),
            WeightData::BF16(w) => dot_scalar(a, w),
            WeightData::F16(w) => dot_scalar(a, w),
            WeightData::Quant(..) | WeightData::F8Block { .. } => unreachable!("float rows only"),
        }
    }

    #[test]
    fn half_precision_paths_compute_the_converted_weights() {
        let n = 777;
        let a = pseudo_random(n, 5);
        let wf = pseudo_random(n, 6);
        let wb: Vec<bf16> = wf.iter().map(|&x| bf16::from_f32(x)).collect();
        let wbf: Vec<f32> = wb.iter().map(|x| x.to_f32()).collect();
        let isa = Isa::best_available();
        let got = dot(isa, &a, WeightData::BF16(&wb)) as f64;
        assert!((got - dot_f64(&a, &wbf)).abs() < 1e-4);
        // And bf16 rounding is visible: the f32 weights give a different sum.
        assert_ne!(got, dot_f64(&a, &wf));
    }
}
