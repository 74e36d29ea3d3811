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

/// A raw output pointer shared by tasks that write disjoint elements (`matmul` here and
/// `qmatmul`'s kernels).
#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: tasks write disjoint index sets (distinct weight rows j), see `matmul` and
// `qmatmul::qmatmul`.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub(super) fn get(self) -> *mut f32 {
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
            let (bytes, interleaved) = match w.interleaved {
                Some(p) => (p, true),
                None => (bytes, false),
            };
            let mat = super::qmatmul::QMat {
                ty,
                bytes,
                n,
                out,
                interleaved,
            };
            return super::qmatmul::qmatmul_multi(x, k_dim, &mut [mat]);
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
    let (mut ya, mut yb) = (
        vec![0.0; x.len() / a.cols * a.rows],
        vec![0.0; x.len() / b.cols * b.rows],
    );
    matmul_groups(&mut [(x, vec![(a, ya.as_mut_slice()), (b, yb.as_mut_slice())])]);
    (ya, yb)
}

/// One set of activation rows and the weights applied to it, each with its output, for
/// [`matmul_groups`].
pub type MatmulGroup<'a, 'w> = (&'a [f32], Vec<(&'a WeightView<'w>, &'a mut [f32])>);

/// Products of several activation sets, each with its own weights (every expert of a MoE
/// layer): where all the weights are block-quantized with one activation format and one row
/// length they run in one parallel step (see [`qmatmul_groups`](super::qmatmul::qmatmul_groups));
/// otherwise product by product. Every result is the one [`matmul`] gives.
pub fn matmul_groups(groups: &mut [MatmulGroup<'_, '_>]) {
    let cols = groups
        .iter()
        .flat_map(|g| g.1.iter())
        .map(|(w, _)| w.cols)
        .next();
    let quantized = groups
        .iter()
        .flat_map(|g| g.1.iter())
        .all(|(w, _)| matches!(w.data, WeightData::Quant(..)) && Some(w.cols) == cols);
    match cols {
        Some(k_dim) if quantized => {
            let xs: Vec<&[f32]> = groups.iter().map(|g| g.0).collect();
            let mut mats: Vec<Vec<super::qmatmul::QMat<'_>>> = groups
                .iter_mut()
                .map(|(_, ws)| {
                    ws.iter_mut()
                        .map(|(w, out)| {
                            let WeightData::Quant(ty, bytes) = w.data else {
                                unreachable!("checked above")
                            };
                            let (bytes, interleaved) = match w.interleaved {
                                Some(p) => (p, true),
                                None => (bytes, false),
                            };
                            super::qmatmul::QMat {
                                ty,
                                bytes,
                                n: w.rows,
                                out,
                                interleaved,
                            }
                        })
                        .collect()
                })
                .collect();
            let mut qgroups: Vec<super::qmatmul::QGroup<'_, '_, '_>> = xs
                .into_iter()
                .zip(mats.iter_mut())
                .map(|(x, mats)| super::qmatmul::QGroup { x, mats })
                .collect();
            super::qmatmul::qmatmul_groups(k_dim, &mut qgroups);
        }
        _ => {
            for (x, ws) in groups.iter_mut() {
                for (w, out) in ws.iter_mut() {
                    matmul(x, w, out);
                }
            }
        }
    }
}

/// [`matmul`] into a new vector.
pub fn matmul_new(x: &[f32], w: &WeightView<'_>) -> Vec<f32> {
    let m = x.len() / w.cols;
    let mut out = vec![0.0; m * w.rows];
    matmul(x, w, &mut out);
    out
}

/// `x·Wᵀ` for a weight tensor: on its device copy when it has one (the same bits), else
/// [`matmul`] on the CPU. A device that fails mid-run is a fault the request cannot recover
/// from: it panics with the device's error (the server answers that request with a 500).
pub fn tensor_matmul(x: &[f32], w: &super::Tensor) -> Vec<f32> {
    let rows = w.shape.first().copied().unwrap_or(0);
    let cols = w.shape.last().copied().unwrap_or(1).max(1);
    match &w.device {
        Some(d) => {
            let mut out = vec![0.0; x.len() / cols * rows];
            if let Err(e) = d.matmul(x, &mut out) {
                panic!("{} failed computing `{}`: {e}", d.backend().name(), w.name);
            }
            out
        }
        None => matmul_new(x, &w.view().expect("weights were checked at load")),
    }
}

/// [`matmul_pair`] for weight tensors (an expert's gate and up): on their device when both
/// are there (the activations quantized once), else on the CPU.
pub fn tensor_matmul_pair(x: &[f32], a: &super::Tensor, b: &super::Tensor) -> (Vec<f32>, Vec<f32>) {
    let mut ys = tensor_matmul_many(x, &[a, b]).into_iter();
    let (ya, yb) = (ys.next(), ys.next());
    (
        ya.expect("one output per weight"),
        yb.expect("one output per weight"),
    )
}

/// Products of the same activations with several weight tensors (an attention's q, k and v; an
/// MLP's gate and up), one output per weight: on their device when all are there in one format
/// (the activations quantized once), on the CPU when none is (block-quantized weights of one
/// activation format share its quantization and one parallel step, see [`matmul_groups`]),
/// else one by one. Every result is the one [`tensor_matmul`] gives.
pub fn tensor_matmul_many(x: &[f32], ws: &[&super::Tensor]) -> Vec<Vec<f32>> {
    let devices: Vec<_> = ws.iter().map(|w| w.device.as_ref()).collect();
    if let Some(Some(first)) = devices.first() {
        let same = devices
            .iter()
            .all(|d| d.is_some_and(|d| d.format == first.format && d.cols == first.cols));
        if same {
            let acts = first.activations(x);
            let m = x.len() / first.cols;
            return ws
                .iter()
                .zip(&devices)
                .map(|(t, d)| {
                    let d = d.expect("checked above");
                    let mut y = vec![0.0; m * d.rows];
                    if let Err(e) = d.matmul_prepared(x, acts.as_ref(), &mut y) {
                        panic!("{} failed computing `{}`: {e}", d.backend().name(), t.name);
                    }
                    y
                })
                .collect();
        }
    }
    if devices.iter().all(|d| d.is_none()) {
        let views: Vec<WeightView<'_>> = ws
            .iter()
            .map(|w| w.view().expect("weights were checked at load"))
            .collect();
        let mut ys: Vec<Vec<f32>> = views
            .iter()
            .map(|v| vec![0.0; x.len() / v.cols.max(1) * v.rows])
            .collect();
        matmul_groups(&mut [(
            x,
            views
                .iter()
                .zip(ys.iter_mut())
                .map(|(v, y)| (v, y.as_mut_slice()))
                .collect(),
        )]);
        return ys;
    }
    ws.iter().map(|w| tensor_matmul(x, w)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::tensor::quant::QuantType;
    use crate::tensor::test_values::{lcg, LCG_INC, LCG_MUL};

    /// `n` values in `[-0.5, 0.5)` drawn from `seed`.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        lcg(n, seed.wrapping_mul(LCG_MUL).wrapping_add(LCG_INC))
    }

    /// Activations `m × k` and weights `n × k` drawn from `seed` and `seed + 1`.
    fn inputs(m: usize, n: usize, k: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
        (values(m * k, seed), values(n * k, seed + 1))
    }

    /// `w` as `n` f32 rows of `k`.
    fn f32_view(w: &[f32], n: usize, k: usize) -> WeightView<'_> {
        WeightView {
            rows: n,
            cols: k,
            data: WeightData::F32(w),
            interleaved: None,
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    #[test]
    fn matches_naive_product() {
        let (m, n, k) = (5, 37, 70);
        let (x, w) = inputs(m, n, k, 1);
        let out = matmul_new(&x, &f32_view(&w, n, k));
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
        let (x, w) = inputs(m, n, k, 3);
        let batch = matmul_new(&x, &f32_view(&w, n, k));
        for i in [0, 17, 63] {
            let alone = matmul_new(&x[i * k..(i + 1) * k], &f32_view(&w, n, k));
            assert_eq!(bits(&alone), bits(&batch[i * n..(i + 1) * n]));
        }
    }

    /// `n × k` weights from `seed` as a tensor of `ty` (`None`: f32).
    fn weight(ty: Option<QuantType>, n: usize, k: usize, seed: u64) -> crate::tensor::Tensor {
        let w = values(n * k, seed);
        let Some(ty) = ty else {
            return crate::tensor::Tensor::from_f32("w", &[n, k], &w);
        };
        let mut bytes = Vec::new();
        for row in w.chunks_exact(k) {
            crate::tensor::quant::quantize_row(ty, row, &mut bytes).unwrap();
        }
        crate::tensor::Tensor {
            name: format!("w.{ty}"),
            shape: vec![n, k],
            dtype: crate::tensor::DType::Quant(ty),
            storage: crate::tensor::Storage::owned(&bytes),
            block_scales: None,
            device: None,
            interleaved: None,
        }
    }

    /// A tensor with interleaved Q4_K rows gives the file's rows' bits through `matmul`,
    /// `matmul_groups` and `tensor_matmul_many`; a view of whole groups of eight keeps the
    /// interleaved copy and one of other rows drops it, with the same bits either way.
    #[test]
    fn interleaved_tensors_give_the_files_bits() {
        let (n, k) = (40, 512);
        let plain = weight(Some(QuantType::Q4_K), n, k, 9);
        let packed = super::super::qmatmul::interleaved::interleave(plain.storage.bytes(), n, k);
        let inter = crate::tensor::Tensor {
            interleaved: Some(crate::tensor::Storage::owned(&packed)),
            ..plain.clone()
        };
        for m in [1, 2, 5] {
            let x = values(m * k, 10 + m as u64);
            let want = matmul_new(&x, &plain.view().unwrap());
            let view = inter.view().unwrap();
            assert!(view.interleaved.is_some());
            assert_eq!(bits(&matmul_new(&x, &view)), bits(&want), "{m} rows");
            let many = tensor_matmul_many(&x, &[&inter, &plain, &inter]);
            for y in &many {
                assert_eq!(bits(y), bits(&want), "{m} rows, grouped");
            }
            for (start, rows, kept) in [(8, 16, true), (0, 40, true), (3, 5, false), (8, 4, false)]
            {
                let part = view.rows_range(start, rows);
                assert_eq!(part.interleaved.is_some(), kept, "rows {start}+{rows}");
                let got = matmul_new(&x, &part);
                for i in 0..m {
                    let w = &want[i * n + start..i * n + start + rows];
                    assert_eq!(
                        bits(&got[i * rows..(i + 1) * rows]),
                        bits(w),
                        "rows {start}+{rows}"
                    );
                }
            }
        }
    }

    /// Copies made for several tensors at once share one huge-page map (over 2 MiB in all
    /// here): each chosen Q4_K matrix gets its own rows' records, in order, the others none,
    /// and products give the file's bits.
    #[test]
    fn copies_of_several_tensors_go_to_their_own_tensors() {
        let (k, x) = (2048, values(2 * 2048, 3));
        let tensors = vec![
            weight(Some(QuantType::Q4_K), 1024, k, 1),
            weight(None, 16, k, 2),
            weight(Some(QuantType::Q4_K), 8, k, 3),
            weight(Some(QuantType::Q4_K), 512, k, 4),
            weight(Some(QuantType::Q4_K), 1024, k, 5),
            weight(Some(QuantType::Q4_K), 12, k, 6),
        ];
        let chosen = [true, true, true, false, true, true];
        let wanted = [true, false, true, false, true, false];
        let made = crate::tensor::Tensor::with_interleaved_copies(tensors.clone(), &chosen);
        assert!(matches!(
            made[0].interleaved,
            Some(crate::tensor::Storage::Mapped { .. })
        ));
        for (i, (t, plain)) in made.iter().zip(&tensors).enumerate() {
            assert_eq!(t.interleaved.is_some(), wanted[i], "tensor {i}");
            if let Some(copy) = &t.interleaved {
                let n = t.shape[0];
                let want =
                    super::super::qmatmul::interleaved::interleave(plain.storage.bytes(), n, k);
                assert!(copy.bytes() == &want[..], "tensor {i}'s copy");
            }
            let (got, want) = (
                matmul_new(&x, &t.view().unwrap()),
                matmul_new(&x, &plain.view().unwrap()),
            );
            assert_eq!(bits(&got), bits(&want), "tensor {i}");
        }
    }

    #[test]
    fn many_products_give_each_single_products_bits() {
        use QuantType::*;
        let k = 512;
        // One activation format (Q4_K and Q6_K share Q8_K: grouped), two (Q8_0 beside them:
        // one by one), f32 beside quantized, and several quantized matrices of unequal heights.
        let sets: [&[(Option<QuantType>, usize)]; 4] = [
            &[(Some(Q4_K), 96), (Some(Q6_K), 32), (Some(Q4_K), 32)],
            &[(Some(Q4_K), 48), (Some(Q8_0), 40), (Some(Q6_K), 16)],
            &[(None, 24), (Some(Q4_K), 64)],
            &[(Some(Q8_0), 200), (Some(Q8_0), 8)],
        ];
        for (si, set) in sets.iter().enumerate() {
            let ws: Vec<_> = set
                .iter()
                .enumerate()
                .map(|(i, &(ty, n))| weight(ty, n, k, 100 + 10 * si as u64 + i as u64))
                .collect();
            let refs: Vec<&crate::tensor::Tensor> = ws.iter().collect();
            for m in [1, 3, 70] {
                let x = values(m * k, 7 + m as u64);
                for threads in [1, 3] {
                    let (many, single) = pool(threads).install(|| {
                        let many = tensor_matmul_many(&x, &refs);
                        let single: Vec<Vec<f32>> =
                            ws.iter().map(|w| tensor_matmul(&x, w)).collect();
                        (many, single)
                    });
                    assert_eq!(many.len(), ws.len());
                    for (i, (a, b)) in many.iter().zip(&single).enumerate() {
                        assert_eq!(a.len(), m * set[i].1, "set {si}, matrix {i}: length");
                        assert_eq!(
                            bits(a),
                            bits(b),
                            "set {si}, matrix {i}, {m} rows, {threads} threads"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn thread_count_does_not_change_bits() {
        let (m, n, k) = (8, 1000, 333);
        let (x, w) = inputs(m, n, k, 5);
        let a = pool(1).install(|| matmul_new(&x, &f32_view(&w, n, k)));
        let b = pool(3).install(|| matmul_new(&x, &f32_view(&w, n, k)));
        assert_eq!(bits(&a), bits(&b));
    }
}
