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
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
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
    match (isa, w) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Isa::Avx2 is only chosen when AVX2, FMA and F16C were detected.
        (Isa::Avx2, WeightData::F32(w)) => unsafe { avx2::dot_f32(a, w) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx2, WeightData::BF16(w)) => unsafe { avx2::dot_bf16(a, w) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        (Isa::Avx2, WeightData::F16(w)) => unsafe { avx2::dot_f16(a, w) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: Isa::Neon is only chosen when NEON was detected.
        (Isa::Neon, w) => unsafe { neon::dot(a, w) },
        (_, WeightData::F32(w)) => dot_scalar(a, w),
        (_, WeightData::BF16(w)) => dot_scalar(a, w),
        (_, WeightData::F16(w)) => dot_scalar(a, w),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{fold_lanes, LANES};
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// Load 8 weights as f32 from `p`.
    trait Load8 {
        unsafe fn load8(p: *const Self) -> __m256;
    }
    impl Load8 for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
    }
    impl Load8 for bf16 {
        #[inline(always)]
        unsafe fn load8(p: *const bf16) -> __m256 {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }
    impl Load8 for f16 {
        #[inline(always)]
        unsafe fn load8(p: *const f16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        }
    }

    #[inline(always)]
    unsafe fn chunk<W: Load8>(a: *const f32, w: *const W, acc: &mut [__m256; 4]) {
        for (r, reg) in acc.iter_mut().enumerate() {
            *reg = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(8 * r)), W::load8(w.add(8 * r)), *reg);
        }
    }

    #[inline(always)]
    unsafe fn dot<W: Load8 + Copy + Default>(a: &[f32], w: &[W]) -> f32 {
        assert_eq!(a.len(), w.len());
        let mut acc = [_mm256_setzero_ps(); 4];
        let full = a.len() / LANES * LANES;
        let mut c = 0;
        while c < full {
            chunk(a.as_ptr().add(c), w.as_ptr().add(c), &mut acc);
            c += LANES;
        }
        if full < a.len() {
            let mut ta = [0.0f32; LANES];
            let mut tw = [W::default(); LANES];
            let n = a.len() - full;
            ta[..n].copy_from_slice(&a[full..]);
            tw[..n].copy_from_slice(&w[full..]);
            chunk(ta.as_ptr(), tw.as_ptr(), &mut acc);
        }
        let mut lanes = [0.0f32; LANES];
        for (r, reg) in acc.iter().enumerate() {
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * r), *reg);
        }
        fold_lanes(&mut lanes)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], w: &[f32]) -> f32 {
        dot(a, w)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_bf16(a: &[f32], w: &[bf16]) -> f32 {
        dot(a, w)
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16(a: &[f32], w: &[f16]) -> f32 {
        dot(a, w)
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::{fold_lanes, WeightElem, LANES};
    use crate::tensor::WeightData;
    use std::arch::aarch64::*;

    #[inline(always)]
    unsafe fn chunk<W: WeightElem>(a: &[f32], w: &[W], acc: &mut [float32x4_t; 8]) {
        let mut wf = [0.0f32; LANES];
        for l in 0..LANES {
            wf[l] = w[l].to_f32();
        }
        for (r, reg) in acc.iter_mut().enumerate() {
            *reg = vfmaq_f32(
                *reg,
                vld1q_f32(a.as_ptr().add(4 * r)),
                vld1q_f32(wf.as_ptr().add(4 * r)),
            );
        }
    }

    #[target_feature(enable = "neon")]
    unsafe fn dot_generic<W: WeightElem>(a: &[f32], w: &[W]) -> f32 {
        assert_eq!(a.len(), w.len());
        let mut acc = [vdupq_n_f32(0.0); 8];
        let full = a.len() / LANES * LANES;
        let mut c = 0;
        while c < full {
            chunk(&a[c..c + LANES], &w[c..c + LANES], &mut acc);
            c += LANES;
        }
        if full < a.len() {
            let mut ta = [0.0f32; LANES];
            let mut tw = [W::default(); LANES];
            let n = a.len() - full;
            ta[..n].copy_from_slice(&a[full..]);
            tw[..n].copy_from_slice(&w[full..]);
            chunk(&ta, &tw, &mut acc);
        }
        let mut lanes = [0.0f32; LANES];
        for (r, reg) in acc.iter().enumerate() {
            vst1q_f32(lanes.as_mut_ptr().add(4 * r), *reg);
        }
        fold_lanes(&mut lanes)
    }

    /// # Safety
    /// The CPU must support NEON.
    pub unsafe fn dot(a: &[f32], w: WeightData<'_>) -> f32 {
        match w {
            WeightData::F32(w) => dot_generic(a, w),
            WeightData::BF16(w) => dot_generic(a, w),
            WeightData::F16(w) => dot_generic(a, w),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Naive f64 dot product: an independent reference for the value (not the bits).
    fn dot_f64(a: &[f32], w: &[f32]) -> f64 {
        a.iter().zip(w).map(|(&x, &y)| x as f64 * y as f64).sum()
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
