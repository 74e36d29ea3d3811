//! `y = x·Wᵀ` for a batch of activation rows against a weight matrix.
//!
//! Work is split across threads by blocks of weight rows (output features). Every output
//! element is one [`dot`] in the canonical order, so the result does not depend on the
//! number of threads, on the block size, or on how many rows the batch has: a row computed
//! alone and the same row inside a batch of 64 give identical bits.

use rayon::prelude::*;

use super::kernels::{dot, dot_block, Isa};
use super::{WeightData, WeightView};

/// Weight rows per parallel task.
const ROWS_PER_TASK: usize = 16;

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint index sets (distinct weight rows j), see `matmul`.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out[i·n + j] = Σ_k x[i·k_dim + k] · w[j, k]` for `m = x.len() / w.cols` rows.
pub fn matmul(x: &[f32], w: &WeightView<'_>, out: &mut [f32]) {
    let k_dim = w.cols;
    let n = w.rows;
    assert!(
        k_dim > 0 && x.len().is_multiple_of(k_dim),
        "matmul: x is not a whole number of rows"
    );
    let m = x.len() / k_dim;
    assert_eq!(out.len(), m * n, "matmul: output has the wrong size");
    match w.data {
        WeightData::Quant(ty, bytes) => {
            return super::qmatmul::qmatmul(x, ty, bytes, n, k_dim, out)
        }
        WeightData::F8Block { .. } => return super::qmatmul::dequantized_matmul(x, w, out),
        _ => {}
    }
    let isa = Isa::detect();
    let ptr = OutPtr(out.as_mut_ptr());
    let tasks = n.div_ceil(ROWS_PER_TASK);
    let run = |t: usize| {
        let j0 = t * ROWS_PER_TASK;
        let j1 = (j0 + ROWS_PER_TASK).min(n);
        let x_row = |i: usize| &x[i * k_dim..(i + 1) * k_dim];
        let w_row = |j: usize| w.rows_range(j, 1).data;
        // SAFETY: every index i*n + j written below has i < m and j0 <= j < j1 <= n, so it is
        // inside `out`, and each (i, j) is written by exactly one task (the one owning row j).
        let put = |i: usize, j: usize, v: f32| unsafe { *ptr.get().add(i * n + j) = v };
        if m == 1 {
            // Decode: two weight rows per step, two independent streams in flight.
            let mut j = j0;
            while j + 2 <= j1 {
                let r = dot_block::<1, 2>(isa, [x_row(0)], [w_row(j), w_row(j + 1)]);
                put(0, j, r[0][0]);
                put(0, j + 1, r[0][1]);
                j += 2;
            }
            if j < j1 {
                put(0, j, dot(isa, x_row(0), w_row(j)));
            }
            return;
        }
        // Prefill: each weight chunk is loaded once for three activation rows.
        for j in j0..j1 {
            let wr = w_row(j);
            let mut i = 0;
            while i + 3 <= m {
                let r = dot_block::<3, 1>(isa, [x_row(i), x_row(i + 1), x_row(i + 2)], [wr]);
                for (d, v) in r.iter().enumerate() {
                    put(i + d, j, v[0]);
                }
                i += 3;
            }
            if i + 2 <= m {
                let r = dot_block::<2, 1>(isa, [x_row(i), x_row(i + 1)], [wr]);
                put(i, j, r[0][0]);
                put(i + 1, j, r[1][0]);
                i += 2;
            }
            if i < m {
                put(i, j, dot(isa, x_row(i), wr));
            }
        }
    };
    if m * n * k_dim < 32 * 1024 || rayon::current_num_threads() == 1 {
        (0..tasks).for_each(run);
    } else {
        (0..tasks).into_par_iter().for_each(run);
    }
}

/// Two products of the same activations (an expert's gate and up). Quantized matrices of one
/// activation format share the activation quantization and one parallel step; every result is
/// the one [`matmul`] gives.
pub fn matmul_pair(x: &[f32], a: &WeightView<'_>, b: &WeightView<'_>) -> (Vec<f32>, Vec<f32>) {
    if let (WeightData::Quant(ta, ba), WeightData::Quant(tb, bb)) = (a.data, b.data) {
        if a.cols == b.cols {
            let m = x.len() / a.cols;
            let (mut ya, mut yb) = (vec![0.0; m * a.rows], vec![0.0; m * b.rows]);
            super::qmatmul::qmatmul_multi(
                x,
                a.cols,
                &mut [
                    super::qmatmul::QMat {
                        ty: ta,
                        bytes: ba,
                        n: a.rows,
                        out: &mut ya,
                    },
                    super::qmatmul::QMat {
                        ty: tb,
                        bytes: bb,
                        n: b.rows,
                        out: &mut yb,
                    },
                ],
            );
            return (ya, yb);
        }
    }
    (matmul_new(x, a), matmul_new(x, b))
}

/// [`matmul`] into a new vector.
pub fn matmul_new(x: &[f32], w: &WeightView<'_>) -> Vec<f32> {
    let m = x.len() / w.cols;
    let mut out = vec![0.0; m * w.rows];
    matmul(x, w, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn matches_naive_product() {
        let (m, n, k) = (5, 37, 70);
        let x = values(m * k, 1);
        let w = values(n * k, 2);
        let view = WeightView {
            rows: n,
            cols: k,
            data: WeightData::F32(&w),
        };
        let out = matmul_new(&x, &view);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum();
                assert!((out[i * n + j] as f64 - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn a_row_alone_and_inside_a_batch_give_identical_bits() {
        let (m, n, k) = (64, 300, 515);
        let x = values(m * k, 3);
        let w = values(n * k, 4);
        let view = WeightView {
            rows: n,
            cols: k,
            data: WeightData::F32(&w),
        };
        let batch = matmul_new(&x, &view);
        for i in [0, 17, 63] {
            let alone = matmul_new(&x[i * k..(i + 1) * k], &view);
            assert_eq!(
                alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                batch[i * n..(i + 1) * n]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn thread_count_does_not_change_bits() {
        let (m, n, k) = (8, 1000, 333);
        let x = values(m * k, 5);
        let w = values(n * k, 6);
        let view = WeightView {
            rows: n,
            cols: k,
            data: WeightData::F32(&w),
        };
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let a = one.install(|| matmul_new(&x, &view));
        let b = three.install(|| matmul_new(&x, &view));
        assert_eq!(
            a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            b.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }
}
