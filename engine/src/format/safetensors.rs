//! Safetensors checkpoints: a single `model.safetensors`, or shards listed by
//! `model.safetensors.index.json` (or, failing that, every `*.safetensors` in the directory).
//!
//! Opening a checkpoint reads and validates every header (truncation, overlapping or
//! out-of-range offsets, unknown dtypes, shape/size mismatch) and produces one
//! [`TensorDesc`] per tensor: where its bytes are. With [`Access::Mapped`] tensors are
//! memory-mapped views; with [`Access::Read`] (streaming mode) nothing is mapped and a tensor
//! is read with a positioned read when asked for.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::fused::{slices_of, ExpertSlice, FusedExperts};
use crate::tensor::microscale::{e8m0_to_f32, split_fp4_tensor};
use crate::tensor::{DType, Storage, Tensor};
use crate::{Error, Result};

/// Where one tensor's bytes are.
#[derive(Debug, Clone)]
pub struct TensorDesc {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// How a weight matrix is stored: one tensor, or a split FP4 matrix (two tensors, repacked
/// into MXFP4 blocks when read; see [`crate::tensor::microscale`]).
#[derive(Debug, Clone)]
pub enum StoredWeight {
    /// The tensor itself (f32/bf16/f16, a ggml block format, or FP8 whose block scales are
    /// loaded separately by [`Checkpoint::block_scales`]).
    Tensor(TensorDesc),
    /// Packed E2M1 codes and their E8M0 scales, one per row per 32 values.
    Fp4(Fp4Parts),
    /// One expert's matrix inside a fused tensor of every expert's ([`super::fused`]).
    Slice(Arc<ExpertSlice>),
}

impl StoredWeight {
    /// The tensors whose bytes make the matrix.
    pub fn parts(&self) -> Vec<&TensorDesc> {
        match self {
            StoredWeight::Tensor(d) => vec![d],
            StoredWeight::Fp4(p) => vec![&p.codes, &p.scales],
            StoredWeight::Slice(s) => s.parts(),
        }
    }
}

/// The two tensors of a split FP4 matrix `rows × cols`.
#[derive(Debug, Clone)]
pub struct Fp4Parts {
    /// The matrix's name (the codes tensor).
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols/2]` int8/uint8 (or `[rows, cols/32, 16]` uint8), low nibble first.
    pub codes: TensorDesc,
    /// `[rows, cols/32]` E8M0 (`F8_E8M0` or `U8`).
    pub scales: TensorDesc,
    /// The files holding them (for errors).
    pub codes_path: PathBuf,
    pub scales_path: PathBuf,
}

impl Fp4Parts {
    /// The matrix as MXFP4 blocks from the bytes of [`codes`](Self::codes) and
    /// [`scales`](Self::scales) (exact; see [`crate::tensor::microscale`]). A NaN scale or a
    /// wrong length is an error naming the tensor.
    pub fn repack(&self, codes: &Storage, scales: &Storage) -> Result<Tensor> {
        split_fp4_tensor(
            &self.name,
            codes.bytes(),
            scales.bytes(),
            self.rows,
            self.cols,
        )
        .map_err(|e| {
            if e.starts_with("codes") {
                Error::tensor(&self.codes_path, &self.codes.name, e)
            } else {
                Error::tensor(&self.scales_path, &self.scales.name, e)
            }
        })
    }
}

/// How tensor bytes are reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Memory-map each file; tensors are views of the mapping.
    #[default]
    Mapped,
    /// As [`Access::Mapped`], every page faulted in when the file is opened (`MAP_POPULATE`,
    /// as llama.cpp maps its models): opening reads the whole file (from the page cache when it
    /// is there), and computing never stops on a page fault. For files that fit in memory.
    MappedPrefaulted,
    /// Positioned reads into owned buffers; nothing is mapped (streaming mode).
    Read,
}

enum Backing {
    Mapped(Arc<memmap2::Mmap>),
    Read(File),
    /// Bytes built in memory: one tensor derived from others (see
    /// [`Checkpoint::insert_owned`]).
    Owned(Arc<Vec<u64>>),
}

impl Backing {
    /// `file` (opened read-only from `path`) as `access` reads it: mapped, or read.
    fn of(file: File, path: &Path, access: Access) -> Result<Backing> {
        Ok(match access {
            // SAFETY: the file is opened read-only; we treat the mapping as immutable bytes. A
            // file truncated underneath us by another process would fault; checkpoints are not
            // modified while being served.
            Access::Mapped => Backing::Mapped(Arc::new(
                unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?,
            )),
            // SAFETY: as above; populating only reads the pages in.
            Access::MappedPrefaulted => Backing::Mapped(Arc::new(
                unsafe { memmap2::MmapOptions::new().populate().map(&file) }
                    .map_err(|e| Error::io(path, e))?,
            )),
            Access::Read => Backing::Read(file),
        })
    }
}

struct ShardFile {
    path: PathBuf,
    backing: Backing,
}

/// All tensors of a model directory.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<ShardFile>,
    tensors: BTreeMap<String, TensorDesc>,
    /// Per-expert matrices of fused tensors ([`Checkpoint::split_fused`]), by name; the
    /// fused tensors themselves stay in `tensors`.
    slices: BTreeMap<String, Arc<ExpertSlice>>,
}

impl Checkpoint {
    /// Open the safetensors weights of a model directory, memory-mapped.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        Self::open_with(dir, Access::Mapped)
    }

    /// Open the safetensors weights of a model directory with the given access.
    pub fn open_with(dir: &Path, access: Access) -> Result<Checkpoint> {
        let shards = shard_paths(dir)?;
        let mut files = Vec::new();
        let mut tensors = BTreeMap::new();
        for (index, path) in shards.iter().enumerate() {
            let (backing, descs) = read_shard(path, index, access)?;
            for d in descs {
                if let Some(prev) = tensors.insert(d.name.clone(), d) {
                    return Err(Error::tensor(
                        path,
                        &prev.name,
                        format!(
                            "appears in two shards ({} and {})",
                            files
                                .get(prev.file)
                                .map(|f: &ShardFile| f.path.display().to_string())
                                .unwrap_or_default(),
                            path.display()
                        ),
                    ));
                }
            }
            files.push(ShardFile {
                path: path.clone(),
                backing,
            });
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            tensors,
            slices: BTreeMap::new(),
        })
    }

    /// A checkpoint over already described tensors in `paths` (e.g. a GGUF file whose
    /// tensors were renamed to Hugging Face names); `dir` is what errors and fingerprints
    /// name.
    pub fn from_descs(
        dir: &Path,
        paths: &[PathBuf],
        tensors: BTreeMap<String, TensorDesc>,
        access: Access,
    ) -> Result<Checkpoint> {
        let files = paths
            .iter()
            .map(|path| {
                let file = File::open(path).map_err(|e| Error::io(path, e))?;
                Ok(ShardFile {
                    path: path.clone(),
                    backing: Backing::of(file, path, access)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            files,
            tensors,
            slices: BTreeMap::new(),
        })
    }

    /// Add a tensor whose bytes were built in memory rather than read from a file (a GGUF
    /// file's MLA `kv_b_proj`, rebuilt from its split `attn_k_b` / `attn_v_b`). It becomes a
    /// shard of its own, named by `path` (the file it was derived from) in errors and
    /// listings; it replaces a tensor of the same name.
    pub fn insert_owned(
        &mut self,
        name: &str,
        shape: Vec<usize>,
        dtype: DType,
        bytes: &[u8],
        path: &Path,
    ) -> Result<()> {
        let want = match dtype {
            DType::Quant(q) => {
                let cols = *shape.last().unwrap_or(&1);
                let rows = shape.iter().product::<usize>() / cols.max(1);
                rows * q.row_bytes(cols)?
            }
            other => shape.iter().product::<usize>() * other.size(),
        };
        if bytes.len() != want {
            return Err(Error::tensor(
                path,
                name,
                format!(
                    "built with {} bytes, but shape {shape:?} of {dtype} needs {want}",
                    bytes.len()
                ),
            ));
        }
        let Storage::Owned { words, len } = Storage::owned(bytes) else {
            unreachable!("Storage::owned builds an owned buffer")
        };
        self.files.push(ShardFile {
            path: path.to_path_buf(),
            backing: Backing::Owned(words),
        });
        self.tensors.insert(
            name.to_string(),
            TensorDesc {
                name: name.to_string(),
                shape,
                dtype,
                file: self.files.len() - 1,
                offset: 0,
                len,
            },
        );
        Ok(())
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every tensor description, by name.
    pub fn tensors(&self) -> &BTreeMap<String, TensorDesc> {
        &self.tensors
    }

    /// The path of shard `file`.
    pub fn file_path(&self, file: usize) -> &Path {
        &self.files[file].path
    }

    /// How many distinct numbers follow the name component `segment` in this checkpoint's
    /// tensor names (`numbered("layers")` counts the `N` of `model.layers.{N}.…`): see
    /// [`numbered_parts`].
    pub fn numbered(&self, segment: &str) -> usize {
        numbered_parts(
            self.tensors
                .keys()
                .chain(self.slices.keys())
                .map(String::as_str),
            segment,
        )
    }

    /// How many matrices the checkpoint describes: its tensors and the per-expert matrices of
    /// its fused tensors.
    pub fn described(&self) -> usize {
        self.tensors.len() + self.slices.len()
    }

    /// Whether a tensor (or a fused expert's matrix) exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.slices.contains_key(name)
    }

    /// Describe the per-expert matrices of every fused expert tensor `fused` names
    /// ([`super::fused`]): `{prefix}.{into}.{e}.{matrix}.weight`, read from the fused
    /// tensor's bytes when asked for. Nothing is read here. Returns how many fused tensors
    /// were split; a fused tensor whose shape or dtype does not fit its layout is an error
    /// naming it.
    pub fn split_fused(&mut self, fused: &[FusedExperts]) -> Result<usize> {
        let mut split = 0;
        for f in fused {
            let suffix = format!(".{}", f.tensor);
            let names: Vec<String> = self
                .tensors
                .keys()
                .filter(|n| n.ends_with(&suffix))
                .cloned()
                .collect();
            for name in names {
                let t = &self.tensors[&name];
                let scales = name
                    .strip_suffix("_blocks")
                    .and_then(|base| self.tensors.get(&format!("{base}_scales")));
                let prefix = &name[..name.len() - suffix.len()];
                let parent = format!("{prefix}.{}", f.into);
                let path = self.files[t.file].path.clone();
                for s in slices_of(t, scales, f.layout, &parent, &path)? {
                    if self.contains(&s.name) {
                        return Err(Error::tensor(
                            &path,
                            &name,
                            format!(
                                "is fused experts, but `{}` is in the checkpoint too",
                                s.name
                            ),
                        ));
                    }
                    self.slices.insert(s.name.clone(), s);
                }
                split += 1;
            }
        }
        Ok(split)
    }

    /// The description of a tensor, or an error naming it.
    pub fn desc(&self, name: &str) -> Result<&TensorDesc> {
        self.tensors.get(name).ok_or_else(|| {
            Error::tensor(
                self.weights_path(),
                name,
                "missing from the checkpoint (is the model directory complete and of the model_type config.json names?)",
            )
        })
    }

    fn weights_path(&self) -> PathBuf {
        if self.files.len() == 1 {
            self.files[0].path.clone()
        } else {
            self.dir.clone()
        }
    }

    /// The number of shard files.
    pub fn file_count(&self) -> usize {
        self.files.len()
    }

    /// Check that a tensor exists with this shape and a float dtype, without reading it.
    pub fn check_weight(&self, name: &str, shape: &[usize]) -> Result<&TensorDesc> {
        let d = self.check_shape(name, shape)?;
        if !d.dtype.is_matrix() {
            return Err(Error::tensor(
                &self.files[d.file].path,
                name,
                format!(
                    "has dtype {}, expected f32, bf16, f16, FP8 (F8_E4M3), packed FP4 (int8/uint8 [rows, cols/2]) or a ggml block format",
                    d.dtype
                ),
            ));
        }
        Ok(d)
    }

    /// The description of a tensor that must have `shape`.
    fn check_shape(&self, name: &str, shape: &[usize]) -> Result<&TensorDesc> {
        let d = self.desc(name)?;
        if d.shape != shape {
            return Err(Error::tensor(
                &self.files[d.file].path,
                name,
                format!(
                    "has shape {:?}, expected {:?} from config.json",
                    d.shape, shape
                ),
            ));
        }
        Ok(d)
    }

    /// A tensor, aligned for its dtype, with its shape checked.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        self.check_shape(name, shape)?;
        self.tensor_any_shape(name)
    }

    /// The bytes `d` describes: a view of the mapping, or read (streaming mode).
    fn storage(&self, d: &TensorDesc) -> Result<Storage> {
        let name = &d.name;
        let shard = &self.files[d.file];
        Ok(match &shard.backing {
            Backing::Owned(words) => Storage::Owned {
                words: words.clone(),
                len: d.len,
            },
            Backing::Mapped(map) => Storage::Mapped {
                map: map.clone(),
                start: d.offset,
                len: d.len,
            },
            Backing::Read(file) => {
                use std::os::unix::fs::FileExt;
                let mut words = vec![0u64; d.len.div_ceil(8)];
                let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..d.len];
                file.read_exact_at(buf, d.offset as u64).map_err(|e| {
                    Error::io(
                        &shard.path,
                        std::io::Error::new(
                            e.kind(),
                            format!(
                                "reading tensor `{name}` ({} bytes at offset {}): {e}",
                                d.len, d.offset
                            ),
                        ),
                    )
                })?;
                Storage::Owned {
                    words: Arc::new(words),
                    len: d.len,
                }
            }
        })
    }

    /// A tensor with whatever shape it has.
    pub fn tensor_any_shape(&self, name: &str) -> Result<Tensor> {
        let d = self.desc(name)?;
        let storage = self.storage(d)?;
        let t = Tensor {
            name: name.to_string(),
            shape: d.shape.clone(),
            dtype: d.dtype,
            storage,
            block_scales: None,
            device: None,
            interleaved: None,
        };
        Ok(t.aligned())
    }

    /// A matrix for the kernels (f32/bf16/f16, a ggml block format, FP8 with its block
    /// scales attached, or a split FP4 matrix repacked into MXFP4 blocks), shape checked.
    pub fn weight(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        match self.stored_weight(name, shape)? {
            StoredWeight::Slice(s) => s.build(
                &self.storage(&s.block)?,
                s.scales
                    .as_ref()
                    .map(|d| self.storage(d))
                    .transpose()?
                    .as_ref(),
            ),
            StoredWeight::Fp4(p) => p.repack(
                &self.tensor_any_shape(&p.codes.name)?.storage,
                &self.tensor_any_shape(&p.scales.name)?.storage,
            ),
            StoredWeight::Tensor(_) => {
                let mut t = self.tensor_any_shape(name)?;
                t.block_scales = self.block_scales(name)?;
                Ok(t)
            }
        }
    }

    /// How the matrix `name` of `shape` is stored (shape, dtype and companions checked,
    /// nothing read). A tensor of int8/uint8 packed codes, `[rows, cols/2]` (or
    /// `[rows, cols/32, 16]` uint8), is a split FP4 matrix whose E8M0 scales are
    /// `<module>.scale` for `<module>.weight` (DeepSeek-V4) or `<x>_scales` for `<x>_blocks`
    /// (gpt-oss MXFP4).
    pub fn stored_weight(&self, name: &str, shape: &[usize]) -> Result<StoredWeight> {
        if let Some(s) = self.slices.get(name) {
            if [s.rows, s.cols] != shape {
                return Err(Error::tensor(
                    &s.path,
                    name,
                    format!(
                        "is a {}×{} expert matrix of fused `{}`, expected {shape:?} from config.json",
                        s.rows, s.cols, s.block.name
                    ),
                ));
            }
            return Ok(StoredWeight::Slice(s.clone()));
        }
        let d = self.desc(name)?;
        let (rows, cols) = match shape {
            [rows, cols] => (*rows, *cols),
            _ => (0, 0),
        };
        let packed = matches!(d.dtype, DType::I8 | DType::U8)
            && cols > 0
            && (d.shape == [rows, cols / 2]
                || (d.dtype == DType::U8 && d.shape == [rows, cols / 32, 16]));
        if d.shape == shape || !packed {
            return self
                .check_weight(name, shape)
                .cloned()
                .map(StoredWeight::Tensor);
        }
        let path = &self.files[d.file].path;
        let scale_name = if let Some(base) = name.strip_suffix("_blocks") {
            format!("{base}_scales")
        } else if let Some(module) = name.strip_suffix(".weight") {
            format!("{module}.scale")
        } else {
            return Err(Error::tensor(
                path,
                name,
                format!(
                    "has shape {:?} of {}, like packed FP4 codes for a {rows}×{cols} matrix, but its name ends neither in `.weight` nor `_blocks`, so its scales cannot be found",
                    d.shape, d.dtype
                ),
            ));
        };
        if !cols.is_multiple_of(32) {
            return Err(Error::tensor(
                path,
                name,
                format!(
                    "looks like packed FP4 codes of a {rows}×{cols} matrix, but FP4 rows must be whole 32-value blocks"
                ),
            ));
        }
        let s = self.tensors.get(&scale_name).ok_or_else(|| {
            Error::tensor(
                path,
                name,
                format!(
                    "holds packed FP4 (E2M1, two per byte) for a {rows}×{cols} matrix but `{scale_name}` (its E8M0 scales, one per 32 values) is missing"
                ),
            )
        })?;
        let want = [rows, cols / 32];
        if !matches!(s.dtype, DType::F8E8M0 | DType::U8) || s.shape != want {
            return Err(Error::tensor(
                &self.files[s.file].path,
                &scale_name,
                format!(
                    "has shape {:?} of {}, but the FP4 scales of `{name}` must be {want:?} of F8_E8M0 or U8",
                    s.shape, s.dtype
                ),
            ));
        }
        Ok(StoredWeight::Fp4(Fp4Parts {
            name: name.to_string(),
            rows,
            cols,
            codes: d.clone(),
            scales: s.clone(),
            codes_path: path.clone(),
            scales_path: self.files[s.file].path.clone(),
        }))
    }

    /// The per-block scales of an FP8 weight: `{name}_scale_inv` (DeepSeek-V3 style, one
    /// f32/bf16 per `B×B` block, `B` from `weight_block_size`, 128 by default) or, for
    /// `<module>.weight`, `<module>.scale` (DeepSeek-V4); either may be floats or E8M0 bytes
    /// (`scale_fmt = "ue8m0"`: `F8_E8M0` or `U8`, `2^(byte − 127)`). `None` for other dtypes.
    /// An FP8 weight without scales is an error.
    pub fn block_scales(
        &self,
        name: &str,
    ) -> Result<Option<std::sync::Arc<crate::tensor::BlockScales>>> {
        let d = self.desc(name)?;
        if d.dtype != DType::F8E4M3 {
            return Ok(None);
        }
        let inv_name = format!("{name}_scale_inv");
        let module_scale = name.strip_suffix(".weight").map(|m| format!("{m}.scale"));
        let scale_name = match &module_scale {
            Some(m) if !self.contains(&inv_name) && self.contains(m) => m.clone(),
            _ => inv_name.clone(),
        };
        if !self.contains(&scale_name) {
            let names = match &module_scale {
                Some(m) => format!("`{inv_name}` or `{m}`"),
                None => format!("`{inv_name}`"),
            };
            return Err(Error::tensor(
                &self.files[d.file].path,
                name,
                format!("is FP8 (F8_E4M3) but {names} (its block scales) is missing"),
            ));
        }
        let s = self.tensor_any_shape(&scale_name)?;
        let scale_path = &self.files[self.desc(&scale_name)?.file].path;
        let (rows, cols) = (d.shape[0], *d.shape.last().unwrap_or(&1));
        if s.shape.len() != 2 || s.shape[0] == 0 || s.shape[1] == 0 {
            return Err(Error::tensor(
                scale_path,
                &scale_name,
                format!(
                    "has shape {:?}, expected [row blocks, column blocks]",
                    s.shape
                ),
            ));
        }
        let block_rows = rows.div_ceil(s.shape[0]);
        let block_cols = cols.div_ceil(s.shape[1]);
        // The block size is the one that yields exactly these block counts; a power of two.
        let block = [block_rows, block_cols]
            .into_iter()
            .map(|b| b.next_power_of_two())
            .max()
            .unwrap_or(128);
        if rows.div_ceil(block) != s.shape[0] || cols.div_ceil(block) != s.shape[1] {
            return Err(Error::tensor(
                scale_path,
                &scale_name,
                format!(
                    "has shape {:?}, which is no square block grid over a {rows}×{cols} matrix",
                    s.shape
                ),
            ));
        }
        let values = match s.dtype {
            DType::F8E8M0 | DType::U8 => {
                let bytes = s.storage.bytes();
                if let Some(i) = bytes.iter().position(|&b| b == 0xff) {
                    return Err(Error::tensor(
                        scale_path,
                        &scale_name,
                        format!(
                            "E8M0 scale byte 0xFF (NaN) at block ({}, {})",
                            i / s.shape[1],
                            i % s.shape[1]
                        ),
                    ));
                }
                bytes.iter().map(|&b| e8m0_to_f32(b)).collect()
            }
            DType::F32 | DType::BF16 | DType::F16 => s.to_f32_vec()?,
            other => {
                return Err(Error::tensor(
                    scale_path,
                    &scale_name,
                    format!("has dtype {other}; FP8 block scales must be f32, bf16, f16 or E8M0 (F8_E8M0 or U8)"),
                ))
            }
        };
        Ok(Some(std::sync::Arc::new(crate::tensor::BlockScales {
            values,
            block_rows: block,
            block_cols: block,
            cols: s.shape[1],
        })))
    }

    /// A 1-D vector converted to f32 (norm weights, biases), shape checked.
    pub fn vector_f32(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        self.weight(name, &[len])?.to_f32_vec()
    }

    /// The parameters the tensors hold: their elements, except that packed FP4 codes hold two
    /// values per byte and their E8M0 scales (`<x>_scales` of `<x>_blocks`, `<module>.scale`
    /// of an int8/uint8 `<module>.weight`) are no parameters of their own.
    pub fn parameter_count(&self) -> usize {
        let packed = |name: &str| {
            self.tensors
                .get(name)
                .is_some_and(|d| matches!(d.dtype, DType::I8 | DType::U8))
        };
        let scale_of = |name: &str| -> Option<String> {
            name.strip_suffix("_blocks")
                .map(|b| format!("{b}_scales"))
                .or_else(|| name.strip_suffix(".weight").map(|m| format!("{m}.scale")))
        };
        self.tensors
            .iter()
            .map(|(name, d)| {
                let n = d.shape.iter().product::<usize>();
                let is_scales = name
                    .strip_suffix("_scales")
                    .map(|b| format!("{b}_blocks"))
                    .or_else(|| name.strip_suffix(".scale").map(|m| format!("{m}.weight")))
                    .is_some_and(|codes| packed(&codes))
                    && matches!(d.dtype, DType::U8 | DType::F8E8M0);
                let is_codes =
                    packed(name) && scale_of(name).is_some_and(|s| self.tensors.contains_key(&s));
                if is_scales {
                    0
                } else if is_codes {
                    2 * n
                } else {
                    n
                }
            })
            .sum()
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|d| d.len).sum()
    }
}

/// The safetensors files of a model directory, in order.
fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let json = crate::error::read_json(&index)?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::config(&index, "weight_map", "missing or not an object"))?;
        let mut names: Vec<String> = Vec::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| {
                Error::config(&index, format!("weight_map.{tensor}"), "is not a file name")
            })?;
            if file.contains('/') || file.contains("..") {
                return Err(Error::config(
                    &index,
                    format!("weight_map.{tensor}"),
                    format!("`{file}` is not a plain file name in the model directory"),
                ));
            }
            if !names.iter().any(|n| n == file) {
                names.push(file.to_string());
            }
        }
        names.sort();
        return Ok(names.into_iter().map(|n| dir.join(n)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(Error::io(
            dir.join("model.safetensors"),
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no weights: expected model.safetensors, model.safetensors.index.json or *.safetensors shards",
            ),
        ));
    }
    Ok(found)
}

/// How many distinct numbers `N` follow the dotted component `segment` in `names`
/// (`….{segment}.{N}.…` or `{segment}.{N}.…`). Every numbered part a model has (a layer, an
/// expert) has tensors of its own, so this bounds what a configuration may claim by what the
/// file holds, and it is itself bounded by the number of tensors.
pub fn numbered_parts<'a>(names: impl IntoIterator<Item = &'a str>, segment: &str) -> usize {
    let mut seen = std::collections::HashSet::new();
    for name in names {
        let mut parts = name.split('.').peekable();
        while let Some(p) = parts.next() {
            if p == segment {
                if let Some(n) = parts.peek().and_then(|n| n.parse::<usize>().ok()) {
                    seen.insert(n);
                }
            }
        }
    }
    seen.len()
}

/// The tensors one safetensors file describes, its header validated exactly as a load
/// validates it (every tensor's dtype, shape and byte range inside the file, no overlaps);
/// nothing but the header is read. For tools that check a file on its own (`coli doctor`).
pub fn describe_file(path: &Path) -> Result<Vec<TensorDesc>> {
    read_shard(path, 0, Access::Read).map(|(_, descs)| descs)
}

/// Map one shard and validate its header.
fn read_shard(
    path: &Path,
    file_index: usize,
    access: Access,
) -> Result<(Backing, Vec<TensorDesc>)> {
    use std::os::unix::fs::FileExt;
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let size = file.metadata().map_err(|e| Error::io(path, e))?.len() as usize;
    let read_at = |offset: usize, len: usize| -> Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, offset as u64)
            .map_err(|e| Error::io(path, e))?;
        Ok(buf)
    };
    if size < 8 {
        return Err(Error::corrupt(
            path,
            format!(
                "truncated safetensors file: {size} bytes, the 8-byte header length is missing"
            ),
        ));
    }
    let header_len = u64::from_le_bytes(read_at(0, 8)?.try_into().unwrap()) as usize;
    if header_len > 100 << 20 || 8 + header_len > size {
        return Err(Error::corrupt(
            path,
            format!(
                "corrupt or truncated safetensors header: it claims {header_len} bytes but the file has {size}"
            ),
        ));
    }
    let header: HashMap<String, serde_json::Value> =
        serde_json::from_slice(&read_at(8, header_len)?).map_err(|e| {
            Error::corrupt(
                path,
                format!("corrupt safetensors header (invalid JSON: {e})"),
            )
        })?;
    let data_start = 8 + header_len;
    let data_len = size - data_start;
    let mut descs = Vec::with_capacity(header.len());
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let bad = |message: String| Error::tensor(path, &name, message);
        let dtype_str = info
            .get("dtype")
            .and_then(|v| v.as_str())
            .ok_or_else(|| bad("header entry has no dtype".into()))?;
        let dtype = DType::from_safetensors(dtype_str).ok_or_else(|| {
            bad(format!(
                "unsupported dtype {dtype_str} (supported: F32, BF16, F16, I64, I32, U8, I8, F8_E4M3, F8_E8M0)"
            ))
        })?;
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(|v| v.as_array())
            .ok_or_else(|| bad("header entry has no shape".into()))?
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("shape is not a list of integers".into()))?;
        let offsets: Vec<usize> = info
            .get("data_offsets")
            .and_then(|v| v.as_array())
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().map(|d| d as usize))
                    .collect::<Option<Vec<_>>>()
            })
            .filter(|a| a.len() == 2)
            .ok_or_else(|| bad("data_offsets is not [begin, end]".into()))?;
        let (begin, end) = (offsets[0], offsets[1]);
        if begin > end || end > data_len {
            return Err(Error::corrupt(
                path,
                format!(
                    "tensor `{name}` data [{begin}, {end}) lies outside the {data_len} data bytes: the file is truncated or corrupt"
                ),
            ));
        }
        // Every product of the dimensions fits, whatever order it is taken in (one of 0
        // elements included: [2^62, 2^62, 0] is refused, not multiplied out later).
        let want = shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
            .map(|n| if shape.contains(&0) { 0 } else { n })
            .ok_or_else(|| bad(format!("shape {shape:?} of {dtype} overflows")))?;
        if end - begin != want {
            return Err(bad(format!(
                "has {} bytes but shape {shape:?} of {dtype} needs {want}",
                end - begin
            )));
        }
        descs.push(TensorDesc {
            name,
            shape,
            dtype,
            file: file_index,
            offset: data_start + begin,
            len: end - begin,
        });
    }
    descs.sort_by_key(|d| d.offset);
    for pair in descs.windows(2) {
        if pair[0].offset + pair[0].len > pair[1].offset {
            return Err(Error::corrupt(
                path,
                format!(
                    "tensors `{}` and `{}` overlap: corrupt header",
                    pair[0].name, pair[1].name
                ),
            ));
        }
    }
    Ok((Backing::of(file, path, access)?, descs))
}
