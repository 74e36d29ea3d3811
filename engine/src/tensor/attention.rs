//! Attention's kernels over one head group: the query heads that share a key/value head
//! (grouped-query attention) are scored and weighted together, so each cached key and value
//! row is read from memory once for all of them, whether the cache holds f32 or f16 values.
//!
//! The arithmetic is that of one head at a time: every score is the canonical [`dot`] of its
//! query and key (32 lanes, fused multiply-adds, the fixed fold), and every output element sums
//! `p_j · v_j` (a rounded product, then a rounded sum) in ascending key order, as
//! [`add_weighted_rows_scalar`] spells out. So a group gives each head the bits it gets alone,
//! and the scalar loops here are the reference the SIMD paths are tested against bit for bit.
//!
//! Paths: AVX-512 (F, with F16C for f16 rows) for head dimensions that are a multiple of 32
//! — scores of sixteen keys at a time, their 32-lane sums folded together in the canonical
//! tree (the same additions, done across keys) —, otherwise the AVX2 kernels of
//! [`kernels`](super::kernels) one head at a time (f32 or f16 rows, F16C widening), or the
//! scalar reference. The softmax has AVX-512 and AVX2 paths with the reference's bits.

use half::f16;

use super::kernels::{
    add_weighted_rows, add_weighted_rows_f16, add_weighted_rows_scalar, dot, dot_strided,
    dot_strided_f16, Isa,
};
use super::WeightData;

/// One head group's cached key or value rows: row `j` of the group's head starts at
/// `j · stride` (the rows of the other key/value heads lie in between).
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl<'a> KvRows<'a> {
    /// The rows from value `at` on.
    pub fn from(self, at: usize) -> KvRows<'a> {
        match self {
            KvRows::F32(v) => KvRows::F32(&v[at..]),
            KvRows::F16(v) => KvRows::F16(&v[at..]),
        }
    }

    fn len(&self) -> usize {
        match self {
            KvRows::F32(v) => v.len(),
            KvRows::F16(v) => v.len(),
        }
    }

    /// Row `j`'s first `width` values, as a kernel operand.
    fn row(&self, j: usize, stride: usize, width: usize) -> WeightData<'_> {
        let at = j * stride;
        match self {
            KvRows::F32(v) => WeightData::F32(&v[at..at + width]),
            KvRows::F16(v) => WeightData::F16(&v[at..at + width]),
        }
    }
}

/// `out[r·n + j] = dot(q_r, key_j)` for every query `q_r` (the rows of `q`, `hd` values each)
/// and key `j < n`: each score the canonical [`dot`].
pub fn group_scores(
    isa: Isa,
    q: &[f32],
    hd: usize,
    keys: KvRows<'_>,
    stride: usize,
    n: usize,
    out: &mut [f32],
) {
    let rows = q.len() / hd;
    assert!(
        hd > 0 && q.len() == rows * hd,
        "group_scores: q is not whole rows of {hd}"
    );
    assert_eq!(out.len(), rows * n, "group_scores: out is not {rows} × {n}");
    assert!(
        n == 0 || (n - 1) * stride + hd <= keys.len(),
        "group_scores: {n} keys of {hd} at stride {stride} in {} values",
        keys.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && hd.is_multiple_of(32) && avx512::usable(keys) {
        // SAFETY: AVX-512 F (and F16C, AVX2 and FMA) were detected by `usable`; the bounds
        // were checked above and `hd` is a multiple of 32.
        unsafe { avx512::group_scores(q, hd, keys, stride, n, out) };
        return;
    }
    // Every query head over a run of keys before the next run, so the group's other heads
    // read the run from cache; each score is still its own dot.
    for j0 in (0..n).step_by(KEY_RUN) {
        let len = KEY_RUN.min(n - j0);
        let run = keys.from(j0 * stride);
        for r in 0..rows {
            let qr = &q[r * hd..(r + 1) * hd];
            let o = &mut out[r * n + j0..r * n + j0 + len];
            match run {
                KvRows::F32(k) => dot_strided(isa, qr, k, stride, o),
                KvRows::F16(k) => dot_strided_f16(isa, qr, k, stride, o),
            }
        }
    }
}

/// How many keys (or values) the one-head-at-a-time paths of [`group_scores`] and
/// [`group_weighted_values`] take for every head of the group before the next ones: 16-32 KiB
/// of f32 rows, which stay in L1 for the group's other heads.
const KEY_RUN: usize = 64;

/// `out_r[e] += p[r·n + j] · value_j[e]` for `j = 0, 1, …, n − 1` in that order, for every
/// output row `out_r` (`hd` values each) and element `e`: each product rounded, then added.
pub fn group_weighted_values(
    isa: Isa,
    p: &[f32],
    n: usize,
    values: KvRows<'_>,
    stride: usize,
    hd: usize,
    out: &mut [f32],
) {
    let rows = out.len() / hd;
    assert!(
        hd > 0 && out.len() == rows * hd,
        "group_weighted_values: out is not rows of {hd}"
    );
    assert_eq!(
        p.len(),
        rows * n,
        "group_weighted_values: p is not {rows} × {n}"
    );
    assert!(
        n == 0 || (n - 1) * stride + hd <= values.len(),
        "group_weighted_values: {n} rows of {hd} at stride {stride} in {} values",
        values.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && hd.is_multiple_of(32) && avx512::usable(values) {
        // SAFETY: as in `group_scores`.
        unsafe { avx512::group_weighted_values(p, n, values, stride, hd, out) };
        return;
    }
    // Every head over a run of values before the next run (as in `group_scores`); an output
    // element still adds its products in ascending key order, run after run.
    for j0 in (0..n).step_by(KEY_RUN) {
        let len = KEY_RUN.min(n - j0);
        let run = values.from(j0 * stride);
        for (r, o) in out.chunks_mut(hd).enumerate() {
            let pr = &p[r * n + j0..r * n + j0 + len];
            match run {
                KvRows::F32(v) => add_weighted_rows(isa, pr, v, stride, o),
                KvRows::F16(v) => add_weighted_rows_f16(isa, pr, v, stride, o),
            }
        }
    }
}

/// [`add_weighted_rows_scalar`] over f16 rows (each value widened exactly).
fn weighted_rows_scalar_f16(p: &[f32], m: &[f16], stride: usize, out: &mut [f32]) {
    let d = out.len();
    for (j, &pj) in p.iter().enumerate() {
        for (o, v) in out.iter_mut().zip(&m[j * stride..j * stride + d]) {
            *o += pj * v.to_f32();
        }
    }
}

/// Round every value to the nearest f16 (ties to even) and back, in place.
pub fn round_to_f16(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::kernels::avx2_fma_f16c() {
        // SAFETY: F16C and AVX were just detected.
        unsafe { avx2_round_to_f16(x) };
        return;
    }
    for v in x.iter_mut() {
        *v = f16::from_f32(*v).to_f32();
    }
}

/// [`round_to_f16`] eight values at a time (`vcvtps2ph` rounds to nearest even, as
/// `f16::from_f32` does).
///
/// # Safety
/// The CPU must have AVX and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn avx2_round_to_f16(x: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` is 8 f32, loaded and stored unaligned; AVX and F16C by the contract.
        unsafe {
            let v = _mm256_loadu_ps(c.as_ptr());
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm256_storeu_ps(c.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
    for v in chunks.into_remainder() {
        *v = f16::from_f32(*v).to_f32();
    }
}

/// Lanes of the softmax's sum.
const SOFTMAX_LANES: usize = 16;

/// `e^x` as attention's softmax computes it (the scalar reference; the SIMD paths give the
/// same bits): `x` is split as `n·ln 2 + r` with `n = round(x·log₂e)` (ties to even) and `r`
/// by two fused multiply-adds (Cody–Waite, Cephes' `ln 2` split), `e^r` by Cephes' degree-7
/// polynomial in Horner form with fused multiply-adds, then scaled by `2^n` in one rounded
/// product. Within 2 ulp of `e^x` (tested); `x < −87` gives 0 (below `1.7·10⁻³⁸`, nothing a
/// probability can hold beside the row's maximum, which is 1), and `x` is taken at most 88.
#[inline]
pub fn exp_canonical(x: f32) -> f32 {
    if x < EXP_MIN {
        return 0.0;
    }
    // Not `min`, which would turn a NaN into 88: a NaN stays a NaN.
    let x = if x > EXP_MAX { EXP_MAX } else { x };
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut y = EXP_P[0];
    for c in &EXP_P[1..] {
        y = y.mul_add(r, *c);
    }
    let y = y.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

const EXP_MIN: f32 = -87.0;
const EXP_MAX: f32 = 88.0;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes' `expf` coefficients: `e^r ≈ 1 + r + r²·P(r)`.
const EXP_P: [f32; 6] = [
    1.987_569_2e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5, // Cephes: 5.0000001201e-1, which is 0.5 in f32
];

/// Attention's softmax in place, with an optional sink logit that joins the denominator and
/// is left out of the result (`p_j = e^{x_j − m} / (Σ_k e^{x_k − m} + e^{sink − m})`, `m` the
/// maximum of all): every exponential by [`exp_canonical`], the sum in 16 lanes (element `j`
/// into lane `j % 16`, in order, then the lanes folded `l += l+8`, `+4`, `+2`, `+1`) plus the
/// sink's term, each probability one division. The scalar loop is the reference; the SIMD
/// path gives its bits.
pub fn softmax(x: &mut [f32], sink: Option<f32>) {
    if x.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::kernels::avx512() && super::kernels::avx2_fma_f16c() {
        // SAFETY: AVX-512 F (and AVX2, FMA) were just detected.
        unsafe { avx512::softmax(x, sink) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::kernels::avx2_fma_f16c() {
        // SAFETY: AVX2 and FMA were just detected.
        unsafe { avx2::softmax(x, sink) };
        return;
    }
    softmax_reference(x, sink);
}

/// [`softmax`]'s scalar reference.
pub fn softmax_reference(x: &mut [f32], sink: Option<f32>) {
    let m = x
        .iter()
        .fold(sink.unwrap_or(f32::NEG_INFINITY), |m, &v| m.max(v));
    let mut lanes = [0.0f32; SOFTMAX_LANES];
    for (j, v) in x.iter_mut().enumerate() {
        *v = exp_canonical(*v - m);
        lanes[j % SOFTMAX_LANES] += *v;
    }
    let mut width = SOFTMAX_LANES / 2;
    while width >= 1 {
        for l in 0..width {
            lanes[l] += lanes[l + width];
        }
        width /= 2;
    }
    let sum = match sink {
        Some(s) => lanes[0] + exp_canonical(s - m),
        None => lanes[0],
    };
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// The scalar reference of [`group_scores`] (tests).
pub fn group_scores_reference(
    q: &[f32],
    hd: usize,
    keys: KvRows<'_>,
    stride: usize,
    n: usize,
) -> Vec<f32> {
    let rows = q.len() / hd;
    let mut out = vec![0.0; rows * n];
    for r in 0..rows {
        for j in 0..n {
            out[r * n + j] = dot(
                Isa::Scalar,
                &q[r * hd..(r + 1) * hd],
                keys.row(j, stride, hd),
            );
        }
    }
    out
}

/// The scalar reference of [`group_weighted_values`] (tests).
pub fn group_weighted_values_reference(
    p: &[f32],
    n: usize,
    values: KvRows<'_>,
    stride: usize,
    out: &mut [f32],
    hd: usize,
) {
    for (r, o) in out.chunks_mut(hd).enumerate() {
        let pr = &p[r * n..(r + 1) * n];
        match values {
            KvRows::F32(v) => add_weighted_rows_scalar(pr, v, stride, o),
            KvRows::F16(v) => weighted_rows_scalar_f16(pr, v, stride, o),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! 256-bit softmax for machines without AVX-512: the reference's sixteen sum lanes are two
    //! registers (lanes 0-7 and 8-15), every exponential the reference's operations on eight
    //! lanes, the last `n mod 16` elements by the scalar reference into the same lanes.

    use std::arch::x86_64::*;

    use super::SOFTMAX_LANES;

    /// [`super::exp_canonical`] on eight lanes: the same operations in the same order.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        use super::{EXP_MAX, EXP_MIN, EXP_P, LN2_HI, LN2_LO};
        // SAFETY: register-only operations on the caller's AVX2 and FMA.
        unsafe {
            let flush = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN));
            // `min_ps(a, b)` is `b` when either is a NaN: a NaN stays a NaN, as in the reference.
            let x = _mm256_min_ps(_mm256_set1_ps(EXP_MAX), x);
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
            let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
            let mut y = _mm256_set1_ps(EXP_P[0]);
            for c in &EXP_P[1..] {
                y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
            }
            let y = _mm256_add_ps(
                _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r),
                _mm256_set1_ps(1.0),
            );
            let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            ));
            let v = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
            _mm256_blendv_ps(v, _mm256_setzero_ps(), flush)
        }
    }

    /// [`super::softmax`] on eight lanes.
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn softmax(x: &mut [f32], sink: Option<f32>) {
        // The maximum as the reference folds it (cheap beside the exponentials, and the same
        // value whatever the NaNs and signed zeros).
        let m = x
            .iter()
            .fold(sink.unwrap_or(f32::NEG_INFINITY), |m, &v| m.max(v));
        let n = x.len();
        let full = n / SOFTMAX_LANES * SOFTMAX_LANES;
        let p = x.as_mut_ptr();
        let mut lanes = [0.0f32; SOFTMAX_LANES];
        // SAFETY: loads and stores of x[j..j + 16] for j + 16 <= full <= n; register
        // operations on the caller's features; `lanes` holds sixteen values.
        unsafe {
            let mm = _mm256_set1_ps(m);
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut j = 0;
            while j < full {
                let a = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(j)), mm));
                let b = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(j + 8)), mm));
                _mm256_storeu_ps(p.add(j), a);
                _mm256_storeu_ps(p.add(j + 8), b);
                lo = _mm256_add_ps(lo, a);
                hi = _mm256_add_ps(hi, b);
                j += SOFTMAX_LANES;
            }
            _mm256_storeu_ps(lanes.as_mut_ptr(), lo);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi);
        }
        // The tail after every whole block of sixteen: each lane's additions stay in order.
        for (j, v) in x.iter_mut().enumerate().skip(full) {
            *v = super::exp_canonical(*v - m);
            lanes[j % SOFTMAX_LANES] += *v;
        }
        let mut width = SOFTMAX_LANES / 2;
        while width >= 1 {
            for l in 0..width {
                lanes[l] += lanes[l + width];
            }
            width /= 2;
        }
        let total = match sink {
            Some(s) => lanes[0] + super::exp_canonical(s - m),
            None => lanes[0],
        };
        let tv = _mm256_set1_ps(total);
        let full8 = n / 8 * 8;
        // SAFETY: loads and stores of x[j..j + 8] for j + 8 <= full8 <= n.
        unsafe {
            let mut j = 0;
            while j < full8 {
                _mm256_storeu_ps(p.add(j), _mm256_div_ps(_mm256_loadu_ps(p.add(j)), tv));
                j += 8;
            }
        }
        for v in &mut x[full8..] {
            *v /= total;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register blocks read best as index loops
mod avx512 {
    //! 512-bit paths. Scores: for a block of sixteen keys, each (query, key) pair's 32 lanes
    //! are summed over the head dimension in two registers (lanes 0-15 and 16-31, fused
    //! multiply-adds from zero, chunk after chunk), then `l += l+16` makes one register per
    //! key, and the remaining steps of the canonical fold (`l += l+8`, `+4`, `+2`, `+1`) are
    //! done for the sixteen keys together by shuffles that pair exactly the lanes the fold
    //! pairs. Weighted values: up to four output rows × 64 elements held in registers while
    //! every value row passes, `acc + p·v` as two rounded operations.

    use std::arch::x86_64::*;

    use super::KvRows;

    /// Query rows handled together (each key row loaded once for all of them).
    const ROWS: usize = 4;
    /// Keys scored, then folded, together.
    const KEYS: usize = 16;

    /// Whether the 512-bit kernels may run on `rows`: AVX-512 F (the 512-bit steps), and AVX2,
    /// FMA and F16C (the kernels' other instructions and f16 widening), not overridden by
    /// `COLI_ISA`.
    pub fn usable(_rows: KvRows<'_>) -> bool {
        super::super::kernels::avx512() && super::super::kernels::avx2_fma_f16c()
    }

    /// Sixteen consecutive values of a row, as f32.
    ///
    /// # Safety
    /// Sixteen values must be readable at `p + at`; AVX-512 F and F16C.
    #[inline(always)]
    unsafe fn load16(rows: KvRows<'_>, at: usize) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            match rows {
                KvRows::F32(v) => _mm512_loadu_ps(v.as_ptr().add(at)),
                KvRows::F16(v) => {
                    _mm512_cvtph_ps(_mm256_loadu_si256(v.as_ptr().add(at) as *const __m256i))
                }
            }
        }
    }

    /// # Safety
    /// AVX-512 F, AVX2, FMA and F16C; `hd % 32 == 0`; `q` is whole rows of `hd`, `out` is
    /// `rows × n`, and `(n − 1)·stride + hd ≤ keys.len()`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn group_scores(
        q: &[f32],
        hd: usize,
        keys: KvRows<'_>,
        stride: usize,
        n: usize,
        out: &mut [f32],
    ) {
        let rows = q.len() / hd;
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + ROWS).min(rows);
            // SAFETY: the caller's contract, for rows r0..r1.
            unsafe {
                match r1 - r0 {
                    4 => scores_rows::<4>(q, r0, hd, keys, stride, n, out),
                    3 => scores_rows::<3>(q, r0, hd, keys, stride, n, out),
                    2 => scores_rows::<2>(q, r0, hd, keys, stride, n, out),
                    _ => scores_rows::<1>(q, r0, hd, keys, stride, n, out),
                }
            }
            r0 = r1;
        }
    }

    /// Scores of query rows `r0..r0 + R` against every key.
    ///
    /// # Safety
    /// As [`group_scores`], and `r0 + R ≤ rows`.
    #[inline(always)]
    unsafe fn scores_rows<const R: usize>(
        q: &[f32],
        r0: usize,
        hd: usize,
        keys: KvRows<'_>,
        stride: usize,
        n: usize,
        out: &mut [f32],
    ) {
        let qp: [*const f32; R] = std::array::from_fn(|r| q[(r0 + r) * hd..].as_ptr());
        let mut j0 = 0;
        while j0 < n {
            let kn = KEYS.min(n - j0);
            // SAFETY: register-only.
            let mut sums = [[unsafe { _mm512_setzero_ps() }; KEYS]; R];
            for kk in 0..kn {
                let at = (j0 + kk) * stride;
                // SAFETY: key j0 + kk < n: its hd values at `at` are inside `keys`; query row
                // r0 + r < rows has hd values at qp[r]; hd is a multiple of 32.
                unsafe {
                    let mut lo = [_mm512_setzero_ps(); R];
                    let mut hi = [_mm512_setzero_ps(); R];
                    let mut c = 0;
                    while c < hd {
                        let kl = load16(keys, at + c);
                        let kh = load16(keys, at + c + 16);
                        for r in 0..R {
                            lo[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qp[r].add(c)), kl, lo[r]);
                            hi[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qp[r].add(c + 16)), kh, hi[r]);
                        }
                        c += 32;
                    }
                    for r in 0..R {
                        // l += l+16
                        sums[r][kk] = _mm512_add_ps(lo[r], hi[r]);
                    }
                }
            }
            for r in 0..R {
                // SAFETY: register-only (the features are the caller's contract).
                let folded = unsafe { fold16(&sums[r]) };
                let row = &mut out[(r0 + r) * n + j0..(r0 + r) * n + j0 + kn];
                row.copy_from_slice(&folded[..kn]);
            }
            j0 += kn;
        }
    }

    /// The canonical fold's last four steps (`l += l+8`, `+4`, `+2`, `+1`) of sixteen
    /// 16-lane sums at once: entry `k` of the result is sum `k` folded.
    ///
    /// # Safety
    /// AVX-512 F.
    #[inline(always)]
    unsafe fn fold16(s: &[__m512; KEYS]) -> [f32; KEYS] {
        // SAFETY: register-only operations on the caller's AVX-512 F; the final store is to a
        // 16-f32 array.
        unsafe {
            // l += l+8: quarters (0, 1) + (2, 3) of keys 2i and 2i+1, side by side.
            let mut u = [_mm512_setzero_ps(); 8];
            for i in 0..8 {
                let (a, b) = (s[2 * i], s[2 * i + 1]);
                let x = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
                let y = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
                u[i] = _mm512_add_ps(x, y); // [k2i (8) | k2i+1 (8)]
            }
            // l += l+4: quarter 0 + 1 and 2 + 3 of u[2i], u[2i+1].
            let mut v = [_mm512_setzero_ps(); 4];
            for i in 0..4 {
                let (a, b) = (u[2 * i], u[2 * i + 1]);
                let x = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
                let y = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
                v[i] = _mm512_add_ps(x, y); // [k4i | k4i+1 | k4i+2 | k4i+3] (4 each)
            }
            // l += l+2, within each 128-bit quarter.
            let mut w = [_mm512_setzero_ps(); 2];
            for i in 0..2 {
                let (a, b) = (v[2 * i], v[2 * i + 1]);
                let x = _mm512_shuffle_ps::<0b01_00_01_00>(a, b);
                let y = _mm512_shuffle_ps::<0b11_10_11_10>(a, b);
                // quarter L: [k8i+L (2) | k8i+4+L (2)]
                w[i] = _mm512_add_ps(x, y);
            }
            // l += l+1: quarter L holds keys L, L+4, L+8, L+12.
            let x = _mm512_shuffle_ps::<0b10_00_10_00>(w[0], w[1]);
            let y = _mm512_shuffle_ps::<0b11_01_11_01>(w[0], w[1]);
            let z = _mm512_add_ps(x, y);
            // Key k sits at 4·(k % 4) + k / 4.
            let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
            let mut out = [0.0f32; KEYS];
            _mm512_storeu_ps(out.as_mut_ptr(), _mm512_permutexvar_ps(order, z));
            out
        }
    }

    /// [`super::exp_canonical`] on sixteen lanes: the same operations in the same order.
    ///
    /// # Safety
    /// AVX-512 F.
    #[inline(always)]
    unsafe fn exp16(x: __m512) -> __m512 {
        use super::{EXP_MAX, EXP_MIN, EXP_P, LN2_HI, LN2_LO};
        // SAFETY: register-only operations on the caller's AVX-512 F.
        unsafe {
            let flush = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_MIN));
            // `min_ps(a, b)` is `b` when either is a NaN: a NaN stays a NaN, as in the reference.
            let x = _mm512_min_ps(_mm512_set1_ps(EXP_MAX), x);
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
            );
            let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
            let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
            let mut y = _mm512_set1_ps(EXP_P[0]);
            for c in &EXP_P[1..] {
                y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
            }
            let y = _mm512_add_ps(
                _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r),
                _mm512_set1_ps(1.0),
            );
            let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(n),
                _mm512_set1_epi32(127),
            ));
            let v = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
            _mm512_mask_mov_ps(v, flush, _mm512_setzero_ps())
        }
    }

    /// [`super::softmax`] on sixteen lanes.
    ///
    /// # Safety
    /// AVX-512 F, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn softmax(x: &mut [f32], sink: Option<f32>) {
        let n = x.len();
        let full = n / 16 * 16;
        let tail: __mmask16 = ((1u32 << (n - full)) - 1) as __mmask16;
        let p = x.as_mut_ptr();
        // SAFETY: loads and stores of x[j..j + 16] for j + 16 <= full <= n, and masked ones of
        // the tail's n − full elements; register operations on the caller's features.
        unsafe {
            let mut mv = _mm512_set1_ps(sink.unwrap_or(f32::NEG_INFINITY));
            let mut j = 0;
            while j < full {
                mv = _mm512_max_ps(mv, _mm512_loadu_ps(p.add(j)));
                j += 16;
            }
            if full < n {
                let t = _mm512_maskz_loadu_ps(tail, p.add(full));
                mv = _mm512_mask_max_ps(mv, tail, mv, t);
            }
            let m = _mm512_reduce_max_ps(mv);
            let mm = _mm512_set1_ps(m);
            let mut sum = _mm512_setzero_ps();
            let mut j = 0;
            while j < full {
                let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(j)), mm));
                _mm512_storeu_ps(p.add(j), e);
                sum = _mm512_add_ps(sum, e);
                j += 16;
            }
            if full < n {
                let t = _mm512_maskz_loadu_ps(tail, p.add(full));
                let e = exp16(_mm512_sub_ps(t, mm));
                _mm512_mask_storeu_ps(p.add(full), tail, e);
                sum = _mm512_mask_add_ps(sum, tail, sum, e);
            }
            // l += l+8, +4, +2, +1, as the reference folds.
            let mut lanes = [0.0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), sum);
            let mut width = 8;
            while width >= 1 {
                for l in 0..width {
                    lanes[l] += lanes[l + width];
                }
                width /= 2;
            }
            let total = match sink {
                Some(s) => lanes[0] + super::exp_canonical(s - m),
                None => lanes[0],
            };
            let tv = _mm512_set1_ps(total);
            let mut j = 0;
            while j < full {
                _mm512_storeu_ps(p.add(j), _mm512_div_ps(_mm512_loadu_ps(p.add(j)), tv));
                j += 16;
            }
            if full < n {
                let t = _mm512_maskz_loadu_ps(tail, p.add(full));
                _mm512_mask_storeu_ps(p.add(full), tail, _mm512_div_ps(t, tv));
            }
        }
    }

    /// # Safety
    /// AVX-512 F, AVX2, FMA and F16C; `hd % 32 == 0`; `out` is whole rows of `hd`, `p` is
    /// `rows × n`, and `(n − 1)·stride + hd ≤ values.len()`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn group_weighted_values(
        p: &[f32],
        n: usize,
        values: KvRows<'_>,
        stride: usize,
        hd: usize,
        out: &mut [f32],
    ) {
        let rows = out.len() / hd;
        let mut r0 = 0;
        while r0 < rows {
            let r1 = (r0 + ROWS).min(rows);
            let mut e0 = 0;
            while e0 < hd {
                // 64 elements at a time, or the last 32.
                let wide = hd - e0 >= 64;
                // SAFETY: the caller's contract, for rows r0..r1 and elements e0..e0 + 32·V
                // (within hd, which is a multiple of 32).
                unsafe {
                    match (r1 - r0, wide) {
                        (4, true) => weighted::<4, 4>(p, n, values, stride, hd, out, r0, e0),
                        (3, true) => weighted::<3, 4>(p, n, values, stride, hd, out, r0, e0),
                        (2, true) => weighted::<2, 4>(p, n, values, stride, hd, out, r0, e0),
                        (_, true) => weighted::<1, 4>(p, n, values, stride, hd, out, r0, e0),
                        (4, false) => weighted::<4, 2>(p, n, values, stride, hd, out, r0, e0),
                        (3, false) => weighted::<3, 2>(p, n, values, stride, hd, out, r0, e0),
                        (2, false) => weighted::<2, 2>(p, n, values, stride, hd, out, r0, e0),
                        (_, false) => weighted::<1, 2>(p, n, values, stride, hd, out, r0, e0),
                    }
                }
                e0 += if wide { 64 } else { 32 };
            }
            r0 = r1;
        }
    }

    /// Output rows `r0..r0 + R`, elements `e0..e0 + 16·V`, over every value row in order.
    ///
    /// # Safety
    /// As [`group_weighted_values`], and `r0 + R ≤ rows`, `e0 + 16·V ≤ hd`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn weighted<const R: usize, const V: usize>(
        p: &[f32],
        n: usize,
        values: KvRows<'_>,
        stride: usize,
        hd: usize,
        out: &mut [f32],
        r0: usize,
        e0: usize,
    ) {
        // SAFETY: out rows r0 + r < rows hold hd values, elements e0 + 16g + 16 ≤ hd; value
        // row j < n holds hd values at j·stride, inside `values`; p row r0 + r holds n values.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); V]; R];
            for r in 0..R {
                for g in 0..V {
                    acc[r][g] = _mm512_loadu_ps(out.as_ptr().add((r0 + r) * hd + e0 + 16 * g));
                }
            }
            let pp: [*const f32; R] = std::array::from_fn(|r| p.as_ptr().add((r0 + r) * n));
            for j in 0..n {
                let at = j * stride + e0;
                let mut v = [_mm512_setzero_ps(); V];
                for g in 0..V {
                    v[g] = load16(values, at + 16 * g);
                }
                for r in 0..R {
                    let pj = _mm512_set1_ps(*pp[r].add(j));
                    for g in 0..V {
                        acc[r][g] = _mm512_add_ps(acc[r][g], _mm512_mul_ps(pj, v[g]));
                    }
                }
            }
            for r in 0..R {
                for g in 0..V {
                    _mm512_storeu_ps(out.as_mut_ptr().add((r0 + r) * hd + e0 + 16 * g), acc[r][g]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::test_values::xorshift;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Every path against the scalar reference, for f32 and f16 rows, group sizes 1-9, head
    /// dims with and without a 32-multiple, key counts around the 16-key blocks, strided rows
    /// (the group's head is the middle one of three), and with negative zeros in the keys.
    #[test]
    fn group_kernels_give_the_scalar_reference_bits() {
        for &hd in &[8usize, 32, 40, 64, 96, 128] {
            for &rows in &[1usize, 2, 3, 4, 5, 8, 9] {
                for &n in &[0usize, 1, 15, 16, 17, 33, 70] {
                    let stride = 3 * hd;
                    let seed = (hd * 131 + rows * 17 + n) as u32;
                    let q = xorshift(rows * hd, seed);
                    let mut k32 = xorshift(n.max(1) * stride, seed + 1);
                    for x in k32.iter_mut().step_by(7) {
                        *x = -0.0;
                    }
                    let k16: Vec<f16> = k32.iter().map(|&x| f16::from_f32(x)).collect();
                    let p = xorshift(rows * n, seed + 2);
                    let init = xorshift(rows * hd, seed + 3);
                    for rows_kind in [KvRows::F32(&k32[hd..]), KvRows::F16(&k16[hd..])] {
                        let want = group_scores_reference(&q, hd, rows_kind, stride, n);
                        let mut want_v = init.clone();
                        group_weighted_values_reference(&p, n, rows_kind, stride, &mut want_v, hd);
                        for isa in [Isa::Scalar, Isa::best_available()] {
                            let what = format!("hd {hd} rows {rows} n {n} {rows_kind:?} {isa:?}");
                            let mut got = vec![f32::NAN; rows * n];
                            group_scores(isa, &q, hd, rows_kind, stride, n, &mut got);
                            assert_eq!(bits(&got), bits(&want), "scores, {what}");
                            let mut got_v = init.clone();
                            group_weighted_values(isa, &p, n, rows_kind, stride, hd, &mut got_v);
                            assert_eq!(bits(&got_v), bits(&want_v), "values, {what}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn canonical_exp_is_within_two_ulp_and_flushes_below_minus_87() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let got = exp_canonical(x);
            let want = (x as f64).exp() as f32;
            worst = worst.max(got.to_bits().abs_diff(want.to_bits()));
            x += 0.000_37;
        }
        for x in [-1e-7f32, -0.0, 0.0, 1.0, 10.0, 88.0] {
            let (got, want) = (exp_canonical(x), (x as f64).exp() as f32);
            worst = worst.max(got.to_bits().abs_diff(want.to_bits()));
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(exp_canonical(-87.01), 0.0);
        assert_eq!(exp_canonical(f32::NEG_INFINITY), 0.0);
        assert!(exp_canonical(f32::NAN).is_nan());
        let mut row = vec![0.5f32, f32::NAN, -1.0];
        softmax(&mut row, None);
        assert!(row[1].is_nan(), "a NaN score is not hidden: {row:?}");
    }

    /// The SIMD softmax against the reference: lengths around the 16 lanes, with and without a
    /// sink (also one that is the maximum), wide and narrow score ranges.
    #[test]
    fn softmax_gives_the_reference_bits() {
        for n in (0..70).chain([255, 256, 257, 4096]) {
            for (spread, sink) in [
                (1.0, None),
                (40.0, None),
                (3.0, Some(0.5)),
                (3.0, Some(9.0)),
            ] {
                let x: Vec<f32> = xorshift(n, n as u32 + 11)
                    .iter()
                    .map(|v| v * spread)
                    .collect();
                let mut want = x.clone();
                softmax_reference(&mut want, sink);
                let mut got = x.clone();
                softmax(&mut got, sink);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "n {n} spread {spread} sink {sink:?}"
                );
                // The 256-bit path too, which machines with AVX-512 do not take.
                #[cfg(target_arch = "x86_64")]
                if super::super::kernels::avx2_fma_f16c() {
                    let mut got = x.clone();
                    // SAFETY: AVX2 and FMA were just detected.
                    unsafe { super::avx2::softmax(&mut got, sink) };
                    assert_eq!(bits(&got), bits(&want), "avx2: n {n} spread {spread}");
                }
                if n > 0 {
                    let total: f64 = want.iter().map(|&p| p as f64).sum();
                    let sink_p = sink.map_or(0.0, |s| {
                        let m = x.iter().fold(s, |m, &v| m.max(v)) as f64;
                        let z: f64 = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>()
                            + (s as f64 - m).exp();
                        (s as f64 - m).exp() / z
                    });
                    assert!((total + sink_p - 1.0).abs() < 1e-5, "n {n}: Σp = {total}");
                }
            }
        }
    }

    #[test]
    fn rounding_to_f16_is_ties_to_even_as_half_does() {
        let mut x = xorshift(1000, 3);
        x.extend([
            65520.0,
            -65519.0,
            1e-8,
            -6.1e-5,
            0.0,
            -0.0,
            f32::INFINITY,
            2.0f32.powi(-24) * 1.5,
            1.0 + 2.0f32.powi(-11),
        ]);
        let want: Vec<u32> = x
            .iter()
            .map(|&v| f16::from_f32(v).to_f32().to_bits())
            .collect();
        round_to_f16(&mut x);
        assert_eq!(bits(&x), want);
    }
}
