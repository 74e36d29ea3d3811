//! Tensors as the kernels see them: dtypes, weight storage (memory-mapped or owned), typed
//! views, the CPU kernels and the thread pool they run on.
//!
//! A [`Tensor`] is a shape, a dtype and bytes. The bytes may be a window of a memory-mapped
//! checkpoint file or an owned, aligned buffer; kernels never know which. Kernels take typed
//! views ([`WeightView`]) and never know about files.

pub mod attention;
pub mod device;
pub mod kernels;
pub mod matmul;
pub mod microscale;
pub mod qmatmul;
pub mod quant;
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod test_values;
pub mod threads;

use std::sync::Arc;

use half::{bf16, f16};

use crate::{Error, Result};

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    I64,
    I32,
    U8,
    I8,
    /// OCP FP8 E4M3 (`torch.float8_e4m3fn`), used with per-block scales.
    F8E4M3,
    /// OCP E8M0 (`torch.float8_e8m0fnu`): a bare exponent, `2^(byte − 127)`; block scales
    /// ([`microscale::e8m0_to_f32`]).
    F8E8M0,
    /// A ggml block format (GGUF files): rows are sequences of blocks.
    Quant(quant::QuantType),
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E8M0 => 1,
            // Blocks are parsed from bytes; no alignment is needed.
            DType::Quant(_) => 1,
        }
    }

    /// Parse a safetensors dtype string ("F32", "BF16", ...).
    pub fn from_safetensors(s: &str) -> Option<DType> {
        Some(match s {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "I64" => DType::I64,
            "I32" => DType::I32,
            "U8" => DType::U8,
            "I8" => DType::I8,
            "F8_E4M3" => DType::F8E4M3,
            "F8_E8M0" => DType::F8E8M0,
            _ => return None,
        })
    }

    /// The safetensors name of this dtype.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::F8E4M3 => "F8_E4M3",
            DType::F8E8M0 => "F8_E8M0",
            DType::Quant(q) => q.name(),
        }
    }

    /// Whether matrix kernels accept this dtype as weights.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Whether matrix kernels accept this dtype as weights (floats and ggml block formats).
    pub fn is_matrix(self) -> bool {
        self.is_float() || matches!(self, DType::Quant(_) | DType::F8E4M3)
    }

    /// The dtype of a ggml type: the float types map to ours, the rest are block formats.
    pub fn from_quant(q: quant::QuantType) -> DType {
        match q {
            quant::QuantType::F32 => DType::F32,
            quant::QuantType::F16 => DType::F16,
            quant::QuantType::BF16 => DType::BF16,
            q => DType::Quant(q),
        }
    }

    /// Bytes of a row of `n` elements.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        match self {
            DType::Quant(q) => q.row_bytes(n),
            d => Ok(n * d.size()),
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::F8E4M3 => "f8_e4m3",
            DType::F8E8M0 => "f8_e8m0",
            DType::Quant(q) => q.name(),
        })
    }
}

/// Where a tensor's bytes live.
#[derive(Clone)]
pub enum Storage {
    /// A window of a memory map: of a file, or anonymous ([`Storage::huge_pages`]).
    Mapped {
        map: Arc<memmap2::Mmap>,
        start: usize,
        len: usize,
    },
    /// An owned buffer, 8-byte aligned.
    Owned { words: Arc<Vec<u64>>, len: usize },
}

impl Storage {
    /// Copy `bytes` into an owned, aligned buffer.
    pub fn owned(bytes: &[u8]) -> Storage {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        Storage::Owned {
            words: Arc::new(words),
            len: bytes.len(),
        }
    }

    /// Buffers of `lens` bytes, each written by `fill(i, buffer)` (in parallel), side by side
    /// in one anonymous map the kernel is asked to back with transparent huge pages
    /// (`MADV_HUGEPAGE`, from a 2 MiB boundary): where the system allows them, a matrix
    /// streamed by one core misses the TLB once per 2 MiB instead of per 4 KiB (measured
    /// faster, docs/benchmarks.md §23), and matrices smaller than a huge page (a layer's
    /// experts) share them. Where the map cannot be made, or it all is smaller than a huge
    /// page, owned buffers (the advice is only advice: ignored where refused).
    pub fn huge_pages(lens: &[usize], fill: impl Fn(usize, &mut [u8]) + Sync) -> Vec<Storage> {
        use rayon::prelude::*;
        const HUGE: usize = 2 << 20;
        let total = lens.iter().try_fold(0usize, |a, &l| a.checked_add(l));
        if let Some(total) = total.filter(|&t| t >= HUGE) {
            if let Ok(mut map) = memmap2::MmapMut::map_anon(total + HUGE) {
                let base = map.as_ptr() as usize;
                let start = base.next_multiple_of(HUGE) - base;
                let _ = map.advise_range(memmap2::Advice::HugePage, start, total);
                let mut windows = Vec::with_capacity(lens.len());
                let mut rest = &mut map[start..start + total];
                for &len in lens {
                    let (window, tail) = rest.split_at_mut(len);
                    windows.push(window);
                    rest = tail;
                }
                windows
                    .into_par_iter()
                    .enumerate()
                    .for_each(|(i, w)| fill(i, w));
                if let Ok(map) = map.make_read_only() {
                    let map = Arc::new(map);
                    let mut at = start;
                    return lens
                        .iter()
                        .map(|&len| {
                            at += len;
                            Storage::Mapped {
                                map: map.clone(),
                                start: at - len,
                                len,
                            }
                        })
                        .collect();
                }
            }
        }
        lens.par_iter()
            .enumerate()
            .map(|(i, &len)| {
                let mut words = vec![0u64; len.div_ceil(8)];
                fill(
                    i,
                    &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..len],
                );
                Storage::Owned {
                    words: Arc::new(words),
                    len,
                }
            })
            .collect()
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped { map, start, len } => &map[*start..*start + *len],
            Storage::Owned { words, len } => &bytemuck::cast_slice::<u64, u8>(words)[..*len],
        }
    }
}

/// A stored tensor: name, shape, dtype and bytes.
#[derive(Clone)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub storage: Storage,
    /// Per-block dequantization scales (FP8 checkpoints' `weight_scale_inv` or `scale`).
    pub block_scales: Option<Arc<BlockScales>>,
    /// A copy on a compute device (GPU), when the placement put it there: products with this
    /// tensor then run on that device, with the bits the CPU gives ([`device`]).
    pub device: Option<Arc<device::DeviceMatrix>>,
    /// A Q4_K matrix's rows interleaved in eights ([`qmatmul::interleaved`]), made at load
    /// where the CPU's products run faster on them ([`Tensor::interleaved_for_cpu`]): products
    /// then read these, with the same bits; `storage` stays the tensor's bytes for the rest.
    pub interleaved: Option<Storage>,
}

/// Scales of a block-quantized matrix: element `(i, j)` is multiplied by
/// `values[(i / block_rows) * cols + j / block_cols]`.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockScales {
    pub values: Vec<f32>,
    pub block_rows: usize,
    pub block_cols: usize,
    /// Scale columns (`ceil(matrix cols / block_cols)`).
    pub cols: usize,
}

/// OCP FP8 E4M3 (no infinities; `S.1111.111` is NaN) to f32, exactly.
pub fn f8e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0xf) as i32;
    let man = (b & 7) as f32;
    if exp == 0xf && b & 7 == 7 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} {:?} {})", self.name, self.shape, self.dtype)
    }
}

impl Tensor {
    /// Build an owned f32 tensor (tests, synthetic weights).
    pub fn from_f32(name: &str, shape: &[usize], values: &[f32]) -> Tensor {
        assert_eq!(shape.iter().product::<usize>(), values.len());
        Tensor {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype: DType::F32,
            storage: Storage::owned(bytemuck::cast_slice(values)),
            block_scales: None,
            device: None,
            interleaved: None,
        }
    }

    /// This tensor with an interleaved copy of its rows for the CPU's products, where that
    /// pays ([`qmatmul::interleaved::pays`]: a Q4_K matrix of whole groups of eight rows, on a
    /// machine whose kernels were measured faster on it) and the load's grant has room for
    /// the copy ([`qmatmul::interleaved::grant`]); else unchanged. The results of every
    /// product are the same bits either way.
    pub fn interleaved_for_cpu(self) -> Tensor {
        Tensor::interleaved_for_cpu_all(vec![self])
            .pop()
            .expect("one tensor in, one out")
    }

    /// [`Tensor::interleaved_for_cpu`] of several tensors (a layer's experts), their copies
    /// side by side in one [`Storage::huge_pages`] map, in order.
    pub fn interleaved_for_cpu_all(tensors: Vec<Tensor>) -> Vec<Tensor> {
        let pays = qmatmul::interleaved::pays();
        let chosen: Vec<bool> = tensors
            .iter()
            .map(|t| {
                pays && t.interleavable().is_some_and(|(rows, cols)| {
                    let copy = qmatmul::interleaved::interleaved_bytes(rows, cols);
                    qmatmul::interleaved::take(copy as u64)
                })
            })
            .collect();
        Tensor::with_interleaved_copies(tensors, &chosen)
    }

    /// `tensors` with an interleaved copy made for each one `chosen` that can have one
    /// ([`Tensor::interleavable`]), the copies side by side in one [`Storage::huge_pages`]
    /// map; the others unchanged.
    pub(crate) fn with_interleaved_copies(tensors: Vec<Tensor>, chosen: &[bool]) -> Vec<Tensor> {
        assert_eq!(tensors.len(), chosen.len(), "one choice per tensor");
        let mut which = Vec::new();
        let mut lens = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            if let (true, Some((rows, cols))) = (chosen[i], t.interleavable()) {
                which.push((i, rows, cols));
                lens.push(qmatmul::interleaved::interleaved_bytes(rows, cols));
            }
        }
        if lens.is_empty() {
            return tensors;
        }
        let copies = Storage::huge_pages(&lens, |w, out| {
            let (i, rows, cols) = which[w];
            qmatmul::interleaved::interleave_into(tensors[i].storage.bytes(), rows, cols, out)
        });
        let mut copies = which.into_iter().zip(copies).peekable();
        tensors
            .into_iter()
            .enumerate()
            .map(|(i, t)| match copies.next_if(|((w, _, _), _)| *w == i) {
                Some((_, copy)) => Tensor {
                    interleaved: Some(copy),
                    ..t
                },
                None => t,
            })
            .collect()
    }

    /// `(rows, cols)` if this tensor can have an interleaved copy: a Q4_K matrix of whole
    /// groups of eight rows, its bytes its size, on the CPU, not already interleaved.
    fn interleavable(&self) -> Option<(usize, usize)> {
        let (rows, cols) = (*self.shape.first()?, *self.shape.last()?);
        let q4k = self.dtype == DType::Quant(quant::QuantType::Q4_K) && self.shape.len() == 2;
        let ok = q4k
            && self.device.is_none()
            && self.interleaved.is_none()
            && qmatmul::interleaved::fits(rows, cols)
            && quant::QuantType::Q4_K
                .row_bytes(cols)
                .ok()
                .and_then(|rb| rb.checked_mul(rows))
                == Some(self.nbytes());
        ok.then_some((rows, cols))
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.storage.bytes().len()
    }

    /// Make sure the bytes are aligned for the dtype; copies into an owned buffer if not.
    pub fn aligned(self) -> Tensor {
        let ptr = self.storage.bytes().as_ptr() as usize;
        if ptr.is_multiple_of(self.dtype.size().max(1)) {
            self
        } else {
            let storage = Storage::owned(self.storage.bytes());
            Tensor { storage, ..self }
        }
    }

    /// A typed view for the matrix kernels. The last dimension is the row length.
    pub fn view(&self) -> Result<WeightView<'_>> {
        let bytes = self.storage.bytes();
        let cols = *self.shape.last().unwrap_or(&1);
        let rows = self.numel().checked_div(cols).unwrap_or(0);
        let data = match self.dtype {
            DType::F32 => WeightData::F32(cast(bytes, &self.name)?),
            DType::BF16 => WeightData::BF16(cast(bytes, &self.name)?),
            DType::F16 => WeightData::F16(cast(bytes, &self.name)?),
            DType::Quant(q) => {
                let want = rows * q.row_bytes(cols)?;
                if bytes.len() != want {
                    return Err(Error::Invalid(format!(
                        "tensor `{}`: {} bytes, but {rows} rows of {cols} {q} values need {want}",
                        self.name,
                        bytes.len()
                    )));
                }
                WeightData::Quant(q, bytes)
            }
            DType::F8E4M3 => {
                let scales = self.block_scales.as_deref().ok_or_else(|| {
                    Error::Invalid(format!(
                        "tensor `{}` is FP8 but has no block scales (`weight_scale_inv` or `scale`)",
                        self.name
                    ))
                })?;
                let want_rows = rows.div_ceil(scales.block_rows);
                if scales.cols != cols.div_ceil(scales.block_cols)
                    || scales.values.len() != want_rows * scales.cols
                {
                    return Err(Error::Invalid(format!(
                        "tensor `{}`: {} block scales of {}×{} do not cover a {rows}×{cols} matrix",
                        self.name,
                        scales.values.len(),
                        scales.block_rows,
                        scales.block_cols
                    )));
                }
                WeightData::F8Block {
                    codes: bytes,
                    scales,
                    row0: 0,
                }
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "tensor `{}` has dtype {other}; matrix weights must be f32, bf16 or f16",
                    self.name
                )))
            }
        };
        let interleaved = self.interleaved.as_ref().map(|s| s.bytes());
        Ok(WeightView {
            rows,
            cols,
            data,
            interleaved,
        })
    }

    /// The values converted to f32 (norm weights, biases, embeddings rows are read through views).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let view = self.view()?;
        let mut out = vec![0.0f32; view.rows * view.cols];
        for r in 0..view.rows {
            view.row_to_f32(r, &mut out[r * view.cols..(r + 1) * view.cols]);
        }
        Ok(out)
    }

    /// Integer values (index tables).
    pub fn to_i64_vec(&self) -> Result<Vec<i64>> {
        let bytes = self.storage.bytes();
        Ok(match self.dtype {
            DType::I64 => bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            DType::I32 => bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64)
                .collect(),
            other => {
                return Err(Error::Unsupported(format!(
                    "tensor `{}` has dtype {other}; expected an integer table",
                    self.name
                )))
            }
        })
    }
}

fn cast<'a, T: bytemuck::Pod>(bytes: &'a [u8], name: &str) -> Result<&'a [T]> {
    bytemuck::try_cast_slice(bytes).map_err(|e| {
        Error::Invalid(format!(
            "tensor `{name}`: bytes cannot be viewed as {}: {e}",
            std::any::type_name::<T>()
        ))
    })
}

/// The element data of a weight matrix.
#[derive(Clone, Copy)]
pub enum WeightData<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
    F16(&'a [f16]),
    /// Rows of ggml blocks.
    Quant(quant::QuantType, &'a [u8]),
    /// FP8 E4M3 codes with per-block scales; `row0` is the first row's index in the matrix
    /// the scales describe.
    F8Block {
        codes: &'a [u8],
        scales: &'a BlockScales,
        row0: usize,
    },
}

/// A row-major matrix of weights, `rows × cols`, as the kernels take it.
#[derive(Clone, Copy)]
pub struct WeightView<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData<'a>,
    /// The same Q4_K rows interleaved in eights, where the tensor has them
    /// ([`Tensor::interleaved`]): the products read these.
    pub interleaved: Option<&'a [u8]>,
}

impl<'a> WeightView<'a> {
    /// Rows `[start, start + n)` as a new view.
    pub fn rows_range(&self, start: usize, n: usize) -> WeightView<'a> {
        let (a, b) = (start * self.cols, (start + n) * self.cols);
        let data = match self.data {
            WeightData::F32(d) => WeightData::F32(&d[a..b]),
            WeightData::BF16(d) => WeightData::BF16(&d[a..b]),
            WeightData::F16(d) => WeightData::F16(&d[a..b]),
            WeightData::Quant(q, d) => {
                let rb = q.row_bytes(self.cols).expect("checked by view()");
                WeightData::Quant(q, &d[start * rb..(start + n) * rb])
            }
            WeightData::F8Block {
                codes,
                scales,
                row0,
            } => WeightData::F8Block {
                codes: &codes[a..b],
                scales,
                row0: row0 + start,
            },
        };
        // Whole groups of eight keep their interleaved copy; other ranges use the file's rows.
        let g = qmatmul::interleaved::GROUP_ROWS;
        let interleaved = self
            .interleaved
            .filter(|_| start.is_multiple_of(g) && n.is_multiple_of(g) && self.rows >= g)
            .map(|p| {
                let group = p.len() / (self.rows / g);
                &p[start / g * group..(start + n) / g * group]
            });
        WeightView {
            rows: n,
            cols: self.cols,
            data,
            interleaved,
        }
    }

    /// Convert row `r` to f32 into `out`.
    pub fn row_to_f32(&self, r: usize, out: &mut [f32]) {
        let (a, b) = (r * self.cols, (r + 1) * self.cols);
        match self.data {
            WeightData::F32(d) => out.copy_from_slice(&d[a..b]),
            WeightData::BF16(d) => {
                for (o, v) in out.iter_mut().zip(&d[a..b]) {
                    *o = v.to_f32();
                }
            }
            WeightData::F16(d) => {
                for (o, v) in out.iter_mut().zip(&d[a..b]) {
                    *o = v.to_f32();
                }
            }
            WeightData::Quant(q, d) => {
                let rb = q.row_bytes(self.cols).expect("checked by view()");
                quant::dequantize_row(q, &d[r * rb..(r + 1) * rb], out)
                    .expect("row length checked by view()");
            }
            WeightData::F8Block {
                codes,
                scales,
                row0,
            } => {
                let srow = &scales.values[(row0 + r) / scales.block_rows * scales.cols..];
                for (k, (o, &c)) in out.iter_mut().zip(&codes[a..b]).enumerate() {
                    *o = f8e4m3_to_f32(c) * srow[k / scales.block_cols];
                }
            }
        }
    }

    /// The dtype of the elements.
    pub fn dtype(&self) -> DType {
        match self.data {
            WeightData::F32(_) => DType::F32,
            WeightData::BF16(_) => DType::BF16,
            WeightData::F16(_) => DType::F16,
            WeightData::Quant(q, _) => DType::Quant(q),
            WeightData::F8Block { .. } => DType::F8E4M3,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Storage;

    /// Buffers side by side in one map (over 2 MiB in all) or owned (under it) each hold what
    /// their own `fill` wrote.
    #[test]
    fn huge_page_buffers_hold_their_own_bytes() {
        let pattern = |i: usize, at: usize| (i * 131 + at * 7 + at / 4096) as u8;
        for (lens, mapped) in [
            (vec![3 << 20 | 5, 17, 1 << 20 | 3, 0, 9], true),
            (vec![10, 20], false),
        ] {
            let made = Storage::huge_pages(&lens, |i, out| {
                for (at, b) in out.iter_mut().enumerate() {
                    *b = pattern(i, at);
                }
            });
            assert_eq!(made.len(), lens.len());
            for (i, (s, &len)) in made.iter().zip(&lens).enumerate() {
                assert_eq!(matches!(s, Storage::Mapped { .. }), mapped, "buffer {i}");
                let want: Vec<u8> = (0..len).map(|at| pattern(i, at)).collect();
                assert!(s.bytes() == &want[..], "buffer {i} of {lens:?}");
            }
        }
    }
}
