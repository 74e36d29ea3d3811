//! Fused expert tensors: every expert of a layer in one tensor `[E, …]`, as transformers v5
//! saves gpt-oss and Inkling (`experts.gate_up_proj`, `experts.down_proj`) and as the hubs
//! ship them (Inkling's interleaved `w13_weight`, gpt-oss's MXFP4 `…_blocks` + `…_scales`).
//!
//! A family declares its fused tensors ([`FusedExperts`]); the checkpoint then describes one
//! matrix per expert, `{parent}.{e}.{gate_proj,up_proj,down_proj}.weight`, each an
//! [`ExpertSlice`]: the expert's block of the fused tensor (one contiguous range, so a streamed
//! expert is one read) and which of its rows or columns make the matrix. Nothing is read when
//! the slices are described. Building a matrix from its block only moves bytes: a block that
//! is the matrix is used as it is (a view of the mapping), rows are gathered, an `x·W` block
//! is transposed, and split FP4 rows are repacked into MXFP4 blocks exactly
//! ([`crate::tensor::microscale`]) — values are never converted, so a fused checkpoint
//! computes the same bits as the same weights stored one matrix per expert.

use std::path::PathBuf;
use std::sync::Arc;

use super::safetensors::TensorDesc;
use crate::tensor::microscale::split_fp4_tensor;
use crate::tensor::{DType, Storage, Tensor};
use crate::{Error, Result};

/// How a fused tensor holds its experts' matrices (`E` experts, each matrix `R × C` as our
/// kernels take it: `R` outputs of `C` inputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedLayout {
    /// `[E, 2I, D]`: each expert's gate rows, then its up rows (transformers' Inkling).
    GateUpHalves,
    /// `[E, 2I, D]`: gate and up rows alternate, `g0, u0, g1, u1, …` (the hubs' `w13`,
    /// gpt-oss's MXFP4 `gate_up_proj_blocks`).
    GateUpInterleaved,
    /// `[E, D, 2I]`, the `x·W` layout: gate and up columns alternate (transformers' gpt-oss).
    GateUpInterleavedColumns,
    /// `[E, R, C]`: one matrix per expert, named by the string (`down_proj`).
    Matrix(&'static str),
    /// `[E, C, R]`, the `x·W` layout: one transposed matrix per expert (gpt-oss `down_proj`).
    MatrixColumns(&'static str),
}

/// A fused expert tensor a family may have: the tensors whose names end in `.{tensor}` hold
/// every expert, and are described as `{prefix}.{into}.{e}.{matrix}.weight`, where `prefix`
/// is what comes before `.{tensor}`. A tensor name ending in `_blocks` with a `_scales`
/// sibling is a split FP4 tensor (`[E, R, C/32, 16]` codes and `[E, R, C/32]` E8M0 scales).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedExperts {
    /// The end of the fused tensor's name (`experts.gate_up_proj`).
    pub tensor: &'static str,
    /// The name component its per-expert matrices go under (`experts`).
    pub into: &'static str,
    pub layout: FusedLayout,
}

impl FusedLayout {
    /// The matrices each expert block yields: (name, pick, rows, cols), from the block's
    /// logical shape `[a, b]` (FP4: `b` counts values, not bytes). `Err`: why the shape does
    /// not fit the layout.
    pub(crate) fn matrices(
        self,
        a: usize,
        b: usize,
    ) -> std::result::Result<Vec<(&'static str, Pick, usize, usize)>, String> {
        let even = |n: usize, what: &str| {
            if n == 0 || !n.is_multiple_of(2) {
                Err(format!(
                    "fused gate/up experts need an even, nonzero {what}, got {n}"
                ))
            } else {
                Ok(n / 2)
            }
        };
        Ok(match self {
            FusedLayout::GateUpHalves => {
                let i = even(a, "row count")?;
                vec![
                    ("gate_proj", Pick::Rows { first: 0, step: 1 }, i, b),
                    ("up_proj", Pick::Rows { first: i, step: 1 }, i, b),
                ]
            }
            FusedLayout::GateUpInterleaved => {
                let i = even(a, "row count")?;
                vec![
                    ("gate_proj", Pick::Rows { first: 0, step: 2 }, i, b),
                    ("up_proj", Pick::Rows { first: 1, step: 2 }, i, b),
                ]
            }
            FusedLayout::GateUpInterleavedColumns => {
                let i = even(b, "column count")?;
                vec![
                    ("gate_proj", Pick::Columns { first: 0, step: 2 }, i, a),
                    ("up_proj", Pick::Columns { first: 1, step: 2 }, i, a),
                ]
            }
            FusedLayout::Matrix(m) => vec![(m, Pick::Rows { first: 0, step: 1 }, a, b)],
            FusedLayout::MatrixColumns(m) => vec![(m, Pick::Columns { first: 0, step: 1 }, b, a)],
        })
    }

    /// Whether the layout is `x·W` (columns are the matrix's rows).
    pub(crate) fn transposed(self) -> bool {
        matches!(
            self,
            FusedLayout::GateUpInterleavedColumns | FusedLayout::MatrixColumns(_)
        )
    }
}

/// Which part of an expert's block a matrix is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// The block is `[·, C]` row-major; the matrix is its rows `first, first + step, …`.
    Rows { first: usize, step: usize },
    /// The block is `[C, ·]` (`x·W`); the matrix's row `r` is the block's column
    /// `first + r · step`.
    Columns { first: usize, step: usize },
}

/// One expert's matrix inside a fused tensor (see the module docs).
#[derive(Debug, Clone)]
pub struct ExpertSlice {
    /// The matrix's name (`….experts.{e}.gate_proj.weight`).
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    /// The expert's block of the fused tensor: one contiguous range (FP4 codes when
    /// `scales` is set), named by the fused tensor.
    pub block: TensorDesc,
    /// The expert's block of the fused tensor's E8M0 scales, for split FP4.
    pub scales: Option<TensorDesc>,
    /// Rows of the block (the block's leading dimension).
    pub block_rows: usize,
    pub pick: Pick,
    /// The file holding the block (for errors).
    pub path: PathBuf,
}

impl ExpertSlice {
    /// The ranges whose bytes make the matrix: the block, then the scales' block.
    pub fn parts(&self) -> Vec<&TensorDesc> {
        std::iter::once(&self.block).chain(&self.scales).collect()
    }

    /// Whether the block is the matrix itself, usable without a copy.
    fn whole(&self) -> bool {
        self.scales.is_none()
            && self.pick == Pick::Rows { first: 0, step: 1 }
            && self.rows == self.block_rows
    }

    /// The matrix's dtype once built.
    pub fn dtype(&self) -> DType {
        if self.scales.is_some() {
            DType::Quant(crate::tensor::quant::QuantType::MXFP4)
        } else {
            self.block.dtype
        }
    }

    /// Bytes of the matrix (its share of the block and scales).
    pub fn bytes(&self) -> usize {
        let share = |d: &TensorDesc| match self.pick {
            Pick::Rows { .. } => d.len / self.block_rows.max(1) * self.rows,
            Pick::Columns { .. } => self.rows * self.cols * d.dtype.size(),
        };
        self.parts().into_iter().map(share).sum()
    }

    /// The matrix from the bytes of its [`parts`](Self::parts).
    pub fn build(&self, block: &Storage, scales: Option<&Storage>) -> Result<Tensor> {
        let err = |why: String| Error::tensor(&self.path, &self.block.name, why);
        if block.bytes().len() != self.block.len {
            return Err(err(format!(
                "expert block of {} bytes, expected {}",
                block.bytes().len(),
                self.block.len
            )));
        }
        if self.whole() {
            return Ok(Tensor {
                name: self.name.clone(),
                shape: vec![self.rows, self.cols],
                dtype: self.block.dtype,
                storage: block.clone(),
                block_scales: None,
                device: None,
                interleaved: None,
            }
            .aligned());
        }
        let gather = |bytes: &[u8]| -> Vec<u8> {
            match self.pick {
                Pick::Rows { first, step } => {
                    let row = bytes.len() / self.block_rows.max(1);
                    let mut out = Vec::with_capacity(row * self.rows);
                    for r in 0..self.rows {
                        let at = (first + r * step) * row;
                        out.extend_from_slice(&bytes[at..at + row]);
                    }
                    out
                }
                Pick::Columns { first, step } => {
                    // The block is [cols, block_cols] elements; element (r, c) of the
                    // matrix is the block's (c, first + r·step).
                    let size = self.block.dtype.size();
                    let block_cols = bytes.len() / size / self.cols.max(1);
                    let mut out = Vec::with_capacity(self.rows * self.cols * size);
                    for r in 0..self.rows {
                        let col = first + r * step;
                        for c in 0..self.cols {
                            let at = (c * block_cols + col) * size;
                            out.extend_from_slice(&bytes[at..at + size]);
                        }
                    }
                    out
                }
            }
        };
        let picked = gather(block.bytes());
        match (&self.scales, scales) {
            (Some(d), Some(s)) => {
                if s.bytes().len() != d.len {
                    return Err(Error::tensor(
                        &self.path,
                        &d.name,
                        format!(
                            "expert scales of {} bytes, expected {}",
                            s.bytes().len(),
                            d.len
                        ),
                    ));
                }
                split_fp4_tensor(
                    &self.name,
                    &picked,
                    &gather(s.bytes()),
                    self.rows,
                    self.cols,
                )
                .map_err(err)
            }
            (Some(d), None) => Err(Error::tensor(
                &self.path,
                &d.name,
                "the expert's FP4 scales were not read",
            )),
            (None, _) => Ok(Tensor {
                name: self.name.clone(),
                shape: vec![self.rows, self.cols],
                dtype: self.block.dtype,
                storage: Storage::owned(&picked),
                block_scales: None,
                device: None,
                interleaved: None,
            }
            .aligned()),
        }
    }
}

/// The slices of one fused tensor `t` (its scales `scales` for split FP4), named under
/// `parent` (`{parent}.{e}.{matrix}.weight`), checked against the layout. `path` names the
/// file in errors.
pub(crate) fn slices_of(
    t: &TensorDesc,
    scales: Option<&TensorDesc>,
    layout: FusedLayout,
    parent: &str,
    path: &std::path::Path,
) -> Result<Vec<Arc<ExpertSlice>>> {
    let err = |why: String| Error::tensor(path, &t.name, why);
    // The logical per-expert shape [a, b].
    let (experts, a, b) = match (scales, t.shape.as_slice()) {
        (None, &[e, a, b]) => {
            if !t.dtype.is_float() && layout.transposed() {
                return Err(err(format!(
                    "is {} in the x·W layout; only f32, bf16 and f16 can be transposed exactly",
                    t.dtype
                )));
            }
            if !(t.dtype.is_float() || matches!(t.dtype, DType::Quant(_))) {
                return Err(err(format!(
                    "has dtype {}, expected f32, bf16, f16 or a ggml block format for fused experts",
                    t.dtype
                )));
            }
            (e, a, b)
        }
        (Some(s), &[e, a, nb, 16]) => {
            if t.dtype != DType::U8 || layout.transposed() {
                return Err(err(format!(
                    "split FP4 experts must be uint8 codes in the row layout, got {} ({layout:?})",
                    t.dtype
                )));
            }
            if s.shape != [e, a, nb] || !matches!(s.dtype, DType::U8 | DType::F8E8M0) {
                return Err(Error::tensor(
                    path,
                    &s.name,
                    format!(
                        "has shape {:?} of {}, but the scales of `{}` must be {:?} of U8 or F8_E8M0",
                        s.shape,
                        s.dtype,
                        t.name,
                        [e, a, nb]
                    ),
                ));
            }
            (e, a, nb * 32)
        }
        _ => {
            return Err(err(format!(
                "has shape {:?}; fused experts are [experts, rows, cols] (split FP4 codes: [experts, rows, blocks, 16])",
                t.shape
            )))
        }
    };
    if experts == 0 || a == 0 || b == 0 {
        return Err(err(format!("has an empty dimension: {:?}", t.shape)));
    }
    let matrices = layout.matrices(a, b).map_err(err)?;
    // Bounded like a GGUF file's tensor count, so a header claiming millions of tiny experts
    // cannot make millions of descriptions.
    let limit = crate::format::gguf::MAX_TENSORS as usize;
    if experts.saturating_mul(matrices.len()) > limit {
        return Err(err(format!(
            "splits into {} expert matrices ({experts} experts); the limit is {limit}",
            experts.saturating_mul(matrices.len())
        )));
    }
    // A block per expert, each at least one byte of the tensor.
    let block_of = |d: &TensorDesc, e: usize| {
        let per = d.len / experts;
        TensorDesc {
            name: d.name.clone(),
            shape: d.shape[1..].to_vec(),
            dtype: d.dtype,
            file: d.file,
            offset: d.offset + e * per,
            len: per,
        }
    };
    if !t.len.is_multiple_of(experts) || scales.is_some_and(|s| !s.len.is_multiple_of(experts)) {
        return Err(err(format!(
            "holds {} bytes, not a whole block for each of its {experts} experts",
            t.len
        )));
    }
    let mut out = Vec::with_capacity(experts * matrices.len());
    for e in 0..experts {
        for &(matrix, pick, rows, cols) in &matrices {
            out.push(Arc::new(ExpertSlice {
                name: format!("{parent}.{e}.{matrix}.weight"),
                rows,
                cols,
                block: block_of(t, e),
                scales: scales.map(|s| block_of(s, e)),
                block_rows: a,
                pick,
                path: path.to_path_buf(),
            }));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(shape: Vec<usize>, dtype: DType) -> TensorDesc {
        let len = shape.iter().product::<usize>() * dtype.size();
        TensorDesc {
            name: "m.layers.0.mlp.experts.gate_up_proj".into(),
            shape,
            dtype,
            file: 0,
            offset: 0,
            len,
        }
    }

    #[test]
    fn absurd_or_misshapen_fused_tensors_are_refused_naming_them() {
        let path = std::path::Path::new("model.safetensors");
        let e = |t: &TensorDesc, layout| {
            slices_of(t, None, layout, "m.layers.0.mlp.experts", path)
                .expect_err("refused")
                .to_string()
        };
        // Two million one-row experts: more descriptions than any checkpoint may have.
        let many = desc(vec![2_000_000, 2, 1], DType::F32);
        let msg = e(&many, FusedLayout::GateUpHalves);
        assert!(
            msg.contains("gate_up_proj") && msg.contains("limit"),
            "{msg}"
        );
        // An odd gate/up width, a 2-D tensor, a float FP4 block, transposed ggml blocks.
        let odd = desc(vec![4, 3, 8], DType::F32);
        assert!(e(&odd, FusedLayout::GateUpInterleaved).contains("even"));
        let flat = desc(vec![4, 8], DType::F32);
        assert!(e(&flat, FusedLayout::Matrix("down_proj")).contains("[experts, rows, cols]"));
        let q = desc(
            vec![4, 8, 34],
            DType::Quant(crate::tensor::quant::QuantType::Q8_0),
        );
        assert!(e(&q, FusedLayout::MatrixColumns("down_proj")).contains("transposed exactly"));
        // A fitting one gives every expert's matrices, named under the parent.
        let ok = desc(vec![3, 4, 8], DType::F32);
        let s = slices_of(&ok, None, FusedLayout::GateUpInterleaved, "p.experts", path).unwrap();
        assert_eq!(s.len(), 6);
        assert_eq!(s[5].name, "p.experts.2.up_proj.weight");
        assert_eq!(
            (s[5].rows, s[5].cols, s[5].block.offset),
            (2, 8, 2 * 4 * 8 * 4)
        );
    }
}
