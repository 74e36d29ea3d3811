//! GGUF files (the llama.cpp / ggml checkpoint format), versions 2 and 3, little-endian.
//!
//! A GGUF file is a header (magic `GGUF`, version, tensor count, metadata count), a list of
//! typed metadata key/value pairs, a list of tensor infos (name, dimensions in ggml order,
//! ggml type id, offset relative to the data section), padding to `general.alignment`
//! (default 32), and the data section holding every tensor's bytes at aligned offsets.
//!
//! [`GgufFile::open`] reads and validates everything up to the data section with positioned
//! reads — nothing is mapped — and describes each tensor ([`GgufTensor`]): its ggml type,
//! its dimensions, and where its bytes are in the file. Corrupt files are errors naming the
//! file and what was wrong (what was being read and at which byte for a truncated file),
//! never panics or huge allocations. [`GgufWriter`] streams a version-3 file atomically.
//!
//! Dimensions: ggml lists a tensor's dimensions fastest-varying first (`ne[0]` is the row
//! length); [`GgufTensor::shape`] is the same reversed, i.e. row-major like safetensors.
//! A `[rows, cols]` matrix is `dims_ggml = [cols, rows]`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::format::write::AtomicFile;
use crate::{Error, Result};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// The version [`GgufWriter`] writes.
pub const GGUF_VERSION: u32 = 3;
/// Alignment of the data section and of tensor offsets when `general.alignment` is absent.
pub const GGUF_DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that sets the alignment (a `u32`, a power of two).
pub const KEY_ALIGNMENT: &str = "general.alignment";
/// The metadata key naming the model architecture.
pub const KEY_ARCHITECTURE: &str = "general.architecture";
/// ggml's limit on the number of dimensions of a tensor.
pub const MAX_DIMS: usize = 4;
/// ggml's limit on tensor name length (including the terminating NUL in C), enforced by
/// the writer only.
pub const MAX_NAME_LEN: usize = 64;

/// Longest string (key, value or tensor name) the reader accepts.
const MAX_STRING_LEN: u64 = 1 << 20;
/// Most elements in one metadata array.
const MAX_ARRAY_LEN: u64 = 64 << 20;
/// Most tensors in one file (and most tensor descriptions a GGUF checkpoint's fused experts
/// are split into).
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata pairs in one file.
const MAX_KV: u64 = 1 << 20;
/// Deepest nesting of arrays in metadata.
const MAX_ARRAY_DEPTH: usize = 8;
/// Bytes fetched per positioned read while parsing the header.
const READ_CHUNK: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// ggml types
// ---------------------------------------------------------------------------------------------

/// A ggml tensor type: plain numbers or a block quantization. The discriminant is the id
/// stored in GGUF tensor infos (ids 4, 5, 31–33, 36–38 are retired or unused in ggml).
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
}

impl GgmlType {
    /// Every type this module knows, in id order.
    pub const ALL: [GgmlType; 32] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
    ];

    /// The type with this GGUF id, if known.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// The id stored in GGUF tensor infos.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The name ggml and gguf-py use (`"Q4_K"`, `"BF16"`...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
        }
    }

    /// `(elements per block, bytes per block)`; plain types are blocks of one element.
    /// The values are ggml's (`GGML_QUANT_SIZES` in gguf-py).
    pub fn block_geometry(self) -> (usize, usize) {
        use GgmlType::*;
        const QK_K: usize = 256;
        match self {
            F32 => (1, 4),
            F16 => (1, 2),
            Q4_0 => (32, 2 + 16),
            Q4_1 => (32, 2 + 2 + 16),
            Q5_0 => (32, 2 + 4 + 16),
            Q5_1 => (32, 2 + 2 + 4 + 16),
            Q8_0 => (32, 2 + 32),
            Q8_1 => (32, 4 + 4 + 32),
            Q2_K => (QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            Q3_K => (QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            Q4_K => (QK_K, 2 + 2 + QK_K / 2 + 12),
            Q5_K => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
            Q6_K => (QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
            Q8_K => (QK_K, 4 + QK_K + QK_K / 8),
            IQ2_XXS => (QK_K, 2 + QK_K / 4),
            IQ2_XS => (QK_K, 2 + QK_K / 4 + QK_K / 32),
            IQ3_XXS => (QK_K, 2 + QK_K / 4 + QK_K / 8),
            IQ1_S => (QK_K, 2 + QK_K / 8 + QK_K / 16),
            IQ4_NL => (32, 2 + 16),
            IQ3_S => (QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            IQ2_S => (QK_K, 2 + QK_K / 4 + QK_K / 16),
            IQ4_XS => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            I8 => (1, 1),
            I16 => (1, 2),
            I32 => (1, 4),
            I64 => (1, 8),
            F64 => (1, 8),
            IQ1_M => (QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            BF16 => (1, 2),
            TQ1_0 => (QK_K, 2 + 4 * 13),
            TQ2_0 => (QK_K, 2 + 64),
            MXFP4 => (32, 1 + 16),
        }
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        self.block_geometry().0
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.block_geometry().1
    }

    /// Whether this is a block quantization (more than one element per block).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Whether the engine is meant to compute with this type (dequantize or multiply);
    /// other types can be described and copied but not used.
    pub fn is_computable(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16
                | BF16
                | Q8_0
                | Q4_0
                | Q4_1
                | Q5_0
                | Q5_1
                | Q2_K
                | Q3_K
                | Q4_K
                | Q5_K
                | Q6_K
                | IQ4_NL
                | IQ4_XS
                | MXFP4
        )
    }

    /// Bytes of one row of `ne0` elements, or an error message if `ne0` is not a whole
    /// number of blocks or the size overflows.
    pub fn row_bytes(self, ne0: u64) -> std::result::Result<usize, String> {
        let (bs, bb) = self.block_geometry();
        if !ne0.is_multiple_of(bs as u64) {
            return Err(format!(
                "row length {ne0} (ne[0]) is not a multiple of the {} block size {bs}",
                self.name()
            ));
        }
        (ne0 / bs as u64)
            .checked_mul(bb as u64)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| format!("row of {ne0} {} elements overflows", self.name()))
    }

    /// Bytes of a tensor with these ggml dimensions (`ne[0]` first): rows × row bytes.
    /// No dimensions means one element.
    pub fn nbytes(self, dims_ggml: &[u64]) -> std::result::Result<usize, String> {
        let ne0 = dims_ggml.first().copied().unwrap_or(1);
        let row = self.row_bytes(ne0)?;
        let mut total = row;
        for &d in dims_ggml.iter().skip(1) {
            total = usize::try_from(d)
                .ok()
                .and_then(|d| total.checked_mul(d))
                .ok_or_else(|| format!("size of dimensions {dims_ggml:?} overflows"))?;
        }
        Ok(total)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

// ---------------------------------------------------------------------------------------------
// Metadata values
// ---------------------------------------------------------------------------------------------

/// The type ids of GGUF metadata values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgufValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl GgufValueType {
    /// The type with this id, if any.
    pub fn from_id(id: u32) -> Option<GgufValueType> {
        use GgufValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The id stored in the file.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// A lower-case name for messages (`"u32"`, `"string"`...).
    pub fn name(self) -> &'static str {
        use GgufValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// The fewest bytes one value of this type takes in a file.
    fn min_size(self) -> u64 {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A typed metadata array. Arrays of arrays hold inner arrays of any (each its own) type.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

impl GgufValue {
    /// The value's type.
    pub fn value_type(&self) -> GgufValueType {
        match self {
            GgufValue::U8(_) => GgufValueType::U8,
            GgufValue::I8(_) => GgufValueType::I8,
            GgufValue::U16(_) => GgufValueType::U16,
            GgufValue::I16(_) => GgufValueType::I16,
            GgufValue::U32(_) => GgufValueType::U32,
            GgufValue::I32(_) => GgufValueType::I32,
            GgufValue::F32(_) => GgufValueType::F32,
            GgufValue::Bool(_) => GgufValueType::Bool,
            GgufValue::String(_) => GgufValueType::String,
            GgufValue::Array(_) => GgufValueType::Array,
            GgufValue::U64(_) => GgufValueType::U64,
            GgufValue::I64(_) => GgufValueType::I64,
            GgufValue::F64(_) => GgufValueType::F64,
        }
    }

    /// A description of the type for messages (`"u32"`, `"array of string"`).
    pub fn type_description(&self) -> String {
        match self {
            GgufValue::Array(a) => format!("array of {}", a.element_type().name()),
            v => v.value_type().name().to_string(),
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer (of any type).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            GgufValue::U64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a bool, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array, if it is one.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl GgufArray {
    /// The element type.
    pub fn element_type(&self) -> GgufValueType {
        match self {
            GgufArray::U8(_) => GgufValueType::U8,
            GgufArray::I8(_) => GgufValueType::I8,
            GgufArray::U16(_) => GgufValueType::U16,
            GgufArray::I16(_) => GgufValueType::I16,
            GgufArray::U32(_) => GgufValueType::U32,
            GgufArray::I32(_) => GgufValueType::I32,
            GgufArray::F32(_) => GgufValueType::F32,
            GgufArray::Bool(_) => GgufValueType::Bool,
            GgufArray::String(_) => GgufValueType::String,
            GgufArray::Array(_) => GgufValueType::Array,
            GgufArray::U64(_) => GgufValueType::U64,
            GgufArray::I64(_) => GgufValueType::I64,
            GgufArray::F64(_) => GgufValueType::F64,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            GgufArray::U8(v) => v.len(),
            GgufArray::I8(v) => v.len(),
            GgufArray::U16(v) => v.len(),
            GgufArray::I16(v) => v.len(),
            GgufArray::U32(v) => v.len(),
            GgufArray::I32(v) => v.len(),
            GgufArray::F32(v) => v.len(),
            GgufArray::Bool(v) => v.len(),
            GgufArray::String(v) => v.len(),
            GgufArray::Array(v) => v.len(),
            GgufArray::U64(v) => v.len(),
            GgufArray::I64(v) => v.len(),
            GgufArray::F64(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The strings, if this is an array of strings.
    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            GgufArray::String(v) => Some(v),
            _ => None,
        }
    }

    /// The elements as unsigned integers, if this is an integer array with no negative
    /// element.
    pub fn to_u64s(&self) -> Option<Vec<u64>> {
        fn conv<T: Copy + TryInto<u64>>(v: &[T]) -> Option<Vec<u64>> {
            v.iter().map(|&x| x.try_into().ok()).collect()
        }
        match self {
            GgufArray::U8(v) => conv(v),
            GgufArray::I8(v) => conv(v),
            GgufArray::U16(v) => conv(v),
            GgufArray::I16(v) => conv(v),
            GgufArray::U32(v) => conv(v),
            GgufArray::I32(v) => conv(v),
            GgufArray::U64(v) => Some(v.clone()),
            GgufArray::I64(v) => conv(v),
            _ => None,
        }
    }

    /// The elements as floats, if this is a float or integer array.
    pub fn to_f64s(&self) -> Option<Vec<f64>> {
        match self {
            GgufArray::F32(v) => Some(v.iter().map(|&x| x.into()).collect()),
            GgufArray::F64(v) => Some(v.clone()),
            GgufArray::I8(v) => Some(v.iter().map(|&x| x.into()).collect()),
            GgufArray::I16(v) => Some(v.iter().map(|&x| x.into()).collect()),
            GgufArray::I32(v) => Some(v.iter().map(|&x| x.into()).collect()),
            GgufArray::I64(v) => Some(v.iter().map(|&x| x as f64).collect()),
            _ => self
                .to_u64s()
                .map(|v| v.into_iter().map(|x| x as f64).collect()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------

/// Where one tensor's bytes are in a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensor {
    /// The tensor's name.
    pub name: String,
    /// Dimensions in ggml order: `dims_ggml[0]` (`ne[0]`) is the fastest-varying (the row
    /// length).
    pub dims_ggml: Vec<u64>,
    /// Dimensions row-major (slowest first): `dims_ggml` reversed.
    pub shape: Vec<usize>,
    /// The element / block type.
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Length of the data in bytes.
    pub len: usize,
}

impl GgufTensor {
    /// The number of elements.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An open, validated GGUF file: its metadata and tensor descriptions. The file stays open
/// for [`GgufFile::read_tensor`].
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    file: File,
    file_len: u64,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: BTreeMap<String, GgufValue>,
    key_order: Vec<String>,
    tensors: Vec<GgufTensor>,
    by_name: HashMap<String, usize>,
}

/// Positioned reads of the header, in chunks, with truncation errors that say what was being
/// read and where.
struct Cursor<'a> {
    file: &'a File,
    path: &'a Path,
    len: u64,
    pos: u64,
    buf: Vec<u8>,
    buf_start: u64,
}

impl<'a> Cursor<'a> {
    fn new(file: &'a File, path: &'a Path, len: u64) -> Self {
        Cursor {
            file,
            path,
            len,
            pos: 0,
            buf: Vec::new(),
            buf_start: 0,
        }
    }

    fn corrupt(&self, message: impl Into<String>) -> Error {
        Error::corrupt(self.path, message)
    }

    /// Bytes left after the current position.
    fn remaining(&self) -> u64 {
        self.len - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn fmt::Display) -> Result<&[u8]> {
        let end = match self.pos.checked_add(n as u64) {
            Some(end) if end <= self.len => end,
            _ => {
                return Err(self.corrupt(format!(
                    "truncated: reading {what} at byte {} needs {n} bytes, but the file ends at byte {}",
                    self.pos, self.len
                )))
            }
        };
        let buf_end = self.buf_start + self.buf.len() as u64;
        if self.pos < self.buf_start || end > buf_end {
            let want = (n.max(READ_CHUNK) as u64).min(self.len - self.pos) as usize;
            self.buf.resize(want, 0);
            self.file
                .read_exact_at(&mut self.buf, self.pos)
                .map_err(|e| Error::io(self.path, e))?;
            self.buf_start = self.pos;
        }
        let start = (self.pos - self.buf_start) as usize;
        self.pos = end;
        Ok(&self.buf[start..start + n])
    }

    fn array<const N: usize>(&mut self, what: &dyn fmt::Display) -> Result<[u8; N]> {
        let b = self.take(N, what)?;
        Ok(b.try_into().expect("take returns N bytes"))
    }

    fn u32(&mut self, what: &dyn fmt::Display) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn fmt::Display) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A length-prefixed UTF-8 string.
    fn string(&mut self, what: &dyn fmt::Display) -> Result<String> {
        let at = self.pos;
        let n = self.u64(&format_args!("the length of {what}"))?;
        if n > MAX_STRING_LEN {
            return Err(self.corrupt(format!(
                "{what} at byte {at} claims a length of {n} bytes (more than the {MAX_STRING_LEN} allowed)"
            )));
        }
        let bytes = self.take(n as usize, what)?.to_vec();
        String::from_utf8(bytes)
            .map_err(|_| self.corrupt(format!("{what} at byte {at} is not valid UTF-8")))
    }

    fn value_type(&mut self, what: &dyn fmt::Display) -> Result<GgufValueType> {
        let at = self.pos;
        let id = self.u32(what)?;
        GgufValueType::from_id(id).ok_or_else(|| {
            self.corrupt(format!(
                "{what} at byte {at} is {id}, not a known metadata value type (0..=12)"
            ))
        })
    }

    fn value(&mut self, ty: GgufValueType, what: &dyn fmt::Display) -> Result<GgufValue> {
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(self.array::<1>(what)?[0]),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(what)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(what)?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            GgufValueType::Bool => GgufValue::Bool(self.bool(what)?),
            GgufValueType::String => GgufValue::String(self.string(what)?),
            GgufValueType::Array => GgufValue::Array(self.array_value(what, 0)?),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(what)?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
        })
    }

    fn bool(&mut self, what: &dyn fmt::Display) -> Result<bool> {
        let at = self.pos;
        match self.array::<1>(what)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.corrupt(format!(
                "{what} at byte {at} is a bool of value {b}, not 0 or 1"
            ))),
        }
    }

    /// Fixed-size elements, converted a chunk at a time.
    fn numbers<T, const N: usize>(
        &mut self,
        n: usize,
        what: &dyn fmt::Display,
        conv: fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        let mut out = Vec::with_capacity(n);
        let per_chunk = (READ_CHUNK / N).max(1);
        while out.len() < n {
            let k = per_chunk.min(n - out.len());
            let bytes = self.take(k * N, what)?;
            out.extend(
                bytes
                    .chunks_exact(N)
                    .map(|c| conv(c.try_into().expect("chunk of N"))),
            );
        }
        Ok(out)
    }

    /// An array's element type, length and elements.
    fn array_value(&mut self, what: &dyn fmt::Display, depth: usize) -> Result<GgufArray> {
        let at = self.pos;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.corrupt(format!(
                "{what} at byte {at} nests arrays more than {MAX_ARRAY_DEPTH} deep"
            )));
        }
        let ty = self.value_type(&format_args!("the element type of {what}"))?;
        let n = self.u64(&format_args!("the length of {what}"))?;
        if n > MAX_ARRAY_LEN {
            return Err(self.corrupt(format!(
                "{what} at byte {at} claims {n} elements (more than the {MAX_ARRAY_LEN} allowed)"
            )));
        }
        // Each element takes at least `min_size` bytes: refuse before allocating for them.
        if n * ty.min_size() > self.remaining() {
            return Err(self.corrupt(format!(
                "truncated: {what} at byte {at} claims {n} elements of type {}, at least {} bytes, but the file ends at byte {}",
                ty.name(),
                n * ty.min_size(),
                self.len
            )));
        }
        let n = n as usize;
        let elems = format_args!("an element of {what}");
        Ok(match ty {
            GgufValueType::U8 => GgufArray::U8(self.numbers(n, &elems, |b: [u8; 1]| b[0])?),
            GgufValueType::I8 => GgufArray::I8(self.numbers(n, &elems, i8::from_le_bytes)?),
            GgufValueType::U16 => GgufArray::U16(self.numbers(n, &elems, u16::from_le_bytes)?),
            GgufValueType::I16 => GgufArray::I16(self.numbers(n, &elems, i16::from_le_bytes)?),
            GgufValueType::U32 => GgufArray::U32(self.numbers(n, &elems, u32::from_le_bytes)?),
            GgufValueType::I32 => GgufArray::I32(self.numbers(n, &elems, i32::from_le_bytes)?),
            GgufValueType::F32 => GgufArray::F32(self.numbers(n, &elems, f32::from_le_bytes)?),
            GgufValueType::U64 => GgufArray::U64(self.numbers(n, &elems, u64::from_le_bytes)?),
            GgufValueType::I64 => GgufArray::I64(self.numbers(n, &elems, i64::from_le_bytes)?),
            GgufValueType::F64 => GgufArray::F64(self.numbers(n, &elems, f64::from_le_bytes)?),
            GgufValueType::Bool => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.bool(&elems)?);
                }
                GgufArray::Bool(v)
            }
            GgufValueType::String => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string(&elems)?);
                }
                GgufArray::String(v)
            }
            GgufValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(&elems, depth + 1)?);
                }
                GgufArray::Array(v)
            }
        })
    }
}

fn align_up(x: u64, alignment: u64) -> Option<u64> {
    x.checked_next_multiple_of(alignment)
}

impl GgufFile {
    /// Open and validate a GGUF file (versions 2 and 3, little-endian): header, metadata,
    /// tensor infos, and that every tensor's data lies aligned, inside the file and apart
    /// from the others. Tensor data is not read.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut c = Cursor::new(&file, path, file_len);

        // Header.
        let magic: [u8; 4] = c.array(&"the magic")?;
        if magic != GGUF_MAGIC {
            return Err(c.corrupt(format!(
                "not a GGUF file: starts with {magic:02x?}, expected \"GGUF\""
            )));
        }
        let version = c.u32(&"the version")?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(Error::Unsupported(format!(
                    "{}: GGUF version 1 is not supported (only 2 and 3); re-convert the model",
                    path.display()
                )))
            }
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(Error::Unsupported(format!(
                    "{}: big-endian GGUF (version {}) is not supported",
                    path.display(),
                    v.swap_bytes()
                )))
            }
            v => {
                return Err(Error::Unsupported(format!(
                    "{}: GGUF version {v} is not supported (only 2 and 3)",
                    path.display()
                )))
            }
        }
        let tensor_count = c.u64(&"the tensor count")?;
        let kv_count = c.u64(&"the metadata count")?;
        // Caps only: a truncated file is reported where the reading stops.
        if tensor_count > MAX_TENSORS {
            return Err(c.corrupt(format!(
                "implausible tensor count {tensor_count} (the limit is {MAX_TENSORS})"
            )));
        }
        if kv_count > MAX_KV {
            return Err(c.corrupt(format!(
                "implausible metadata count {kv_count} (the limit is {MAX_KV})"
            )));
        }

        // Metadata.
        let mut metadata = BTreeMap::new();
        let mut key_order = Vec::with_capacity(kv_count.min(1024) as usize);
        for i in 0..kv_count {
            let at = c.pos;
            let key = c.string(&format_args!("the key of metadata pair #{i}"))?;
            let ty = c.value_type(&format_args!("the value type of `{key}`"))?;
            let value = c.value(ty, &format_args!("the value of `{key}`"))?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(c.corrupt(format!(
                    "metadata key `{key}` appears twice (again at byte {at})"
                )));
            }
            key_order.push(key);
        }
        let alignment = match metadata.get(KEY_ALIGNMENT) {
            None => GGUF_DEFAULT_ALIGNMENT,
            Some(GgufValue::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(v) => {
                return Err(Error::config(
                    path,
                    KEY_ALIGNMENT,
                    format!("is {v:?}, expected a u32 power of two"),
                ))
            }
        };

        // Tensor infos.
        let mut infos = Vec::with_capacity(tensor_count.min(1024) as usize);
        let mut by_name = HashMap::with_capacity(tensor_count.min(1024) as usize);
        for i in 0..tensor_count {
            let name = c.string(&format_args!("the name of tensor #{i}"))?;
            let at = c.pos;
            let n_dims = c.u32(&format_args!("the dimension count of tensor `{name}`"))?;
            if n_dims as usize > MAX_DIMS {
                return Err(Error::tensor(
                    path,
                    &name,
                    format!(
                        "has {n_dims} dimensions (at byte {at}); ggml allows at most {MAX_DIMS}"
                    ),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                dims.push(c.u64(&format_args!("dimension {d} of tensor `{name}`"))?);
            }
            let at = c.pos;
            let type_id = c.u32(&format_args!("the type of tensor `{name}`"))?;
            let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| {
                Error::tensor(
                    path,
                    &name,
                    format!("has unknown ggml type id {type_id} (at byte {at})"),
                )
            })?;
            let rel = c.u64(&format_args!("the data offset of tensor `{name}`"))?;
            if by_name.insert(name.clone(), infos.len()).is_some() {
                return Err(Error::tensor(
                    path,
                    &name,
                    "appears twice in the tensor infos",
                ));
            }
            infos.push((name, dims, ggml_type, rel));
        }
        let data_offset = align_up(c.pos, alignment)
            .ok_or_else(|| c.corrupt("the data section offset overflows"))?;

        // Tensor placement.
        let mut tensors = Vec::with_capacity(infos.len());
        for (name, dims, ggml_type, rel) in infos {
            let bad = |message: String| Error::tensor(path, &name, message);
            let len = ggml_type
                .nbytes(&dims)
                .map_err(|m| bad(format!("{m} (dimensions {dims:?}, type {ggml_type})")))?;
            if !rel.is_multiple_of(alignment) {
                return Err(bad(format!(
                    "data offset {rel} is not a multiple of the alignment {alignment}"
                )));
            }
            let start = data_offset.checked_add(rel);
            let end = start.and_then(|s| s.checked_add(len as u64));
            let start = match (start, end) {
                (Some(s), Some(e)) if e <= file_len => s,
                _ => {
                    return Err(bad(format!(
                        "data (offset {rel} in the data section at byte {data_offset}, {len} bytes) extends beyond the end of the file ({file_len} bytes); is the file truncated?"
                    )))
                }
            };
            // The element count fits too, even where a zero dimension makes the size 0.
            let fits = dims
                .iter()
                .filter(|&&d| d != 0)
                .try_fold(1usize, |n, &d| usize::try_from(d).ok()?.checked_mul(n));
            let shape = dims
                .iter()
                .rev()
                .map(|&d| usize::try_from(d))
                .collect::<std::result::Result<Vec<_>, _>>()
                .ok()
                .filter(|_| fits.is_some())
                .ok_or_else(|| bad(format!("dimensions {dims:?} do not fit in memory")))?;
            tensors.push(GgufTensor {
                name,
                dims_ggml: dims,
                shape,
                ggml_type,
                offset: start as usize,
                len,
            });
        }
        // Tensors with data are disjoint. Empty ones (a zero dimension) hold no bytes and may
        // sit anywhere; they are left out of the order altogether, so that one between two
        // tensors never hides their overlap.
        let mut order: Vec<usize> = (0..tensors.len()).filter(|&i| tensors[i].len > 0).collect();
        order.sort_by_key(|&i| (tensors[i].offset, tensors[i].len));
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            if a.offset + a.len > b.offset {
                return Err(Error::tensor(
                    path,
                    &b.name,
                    format!(
                        "data (bytes {}..{}) overlaps tensor `{}` (bytes {}..{})",
                        b.offset,
                        b.offset + b.len,
                        a.name,
                        a.offset,
                        a.offset + a.len
                    ),
                ));
            }
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            file,
            file_len,
            version,
            alignment,
            data_offset,
            metadata,
            key_order,
            tensors,
            by_name,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of the data section and tensor offsets.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The absolute byte offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The file's length in bytes.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Every metadata pair, by key.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    /// The metadata keys in file order.
    pub fn metadata_keys(&self) -> &[String] {
        &self.key_order
    }

    /// Every tensor, in file (tensor info) order.
    pub fn tensors(&self) -> &[GgufTensor] {
        &self.tensors
    }

    /// A tensor by name, if present.
    pub fn get_tensor(&self, name: &str) -> Option<&GgufTensor> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor by name, or an error naming the file and tensor.
    pub fn tensor(&self, name: &str) -> Result<&GgufTensor> {
        self.get_tensor(name)
            .ok_or_else(|| Error::tensor(&self.path, name, "missing from the GGUF file"))
    }

    /// Read a tensor's bytes with a positioned read.
    pub fn read_tensor(&self, tensor: &GgufTensor) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; tensor.len];
        self.file
            .read_exact_at(&mut buf, tensor.offset as u64)
            .map_err(|e| {
                Error::io(
                    &self.path,
                    std::io::Error::new(e.kind(), format!("reading tensor `{}`: {e}", tensor.name)),
                )
            })?;
        Ok(buf)
    }

    /// A metadata value, or an error naming the key if it is missing.
    pub fn require(&self, key: &str) -> Result<&GgufValue> {
        self.metadata
            .get(key)
            .ok_or_else(|| Error::config(&self.path, key, "missing from the GGUF metadata"))
    }

    fn typed<'s, T>(
        &'s self,
        key: &str,
        expected: &str,
        get: impl FnOnce(&'s GgufValue) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => get(v).map(Some).ok_or_else(|| {
                Error::config(
                    &self.path,
                    key,
                    format!("is {} {v:?}, expected {expected}", v.type_description()),
                )
            }),
        }
    }

    /// A string value: `None` if absent, an error if of another type.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", GgufValue::as_str)
    }

    /// A non-negative integer value of any integer type: `None` if absent, an error if of
    /// another type or negative.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a non-negative integer", GgufValue::as_u64)
    }

    /// A float (or integer) value: `None` if absent, an error if of another type.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", GgufValue::as_f64)
    }

    /// A bool value: `None` if absent, an error if of another type.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", GgufValue::as_bool)
    }

    /// An array value: `None` if absent, an error if of another type.
    pub fn get_array(&self, key: &str) -> Result<Option<&GgufArray>> {
        self.typed(key, "an array", GgufValue::as_array)
    }

    /// `general.architecture`, which every GGUF model must have.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str(KEY_ARCHITECTURE)?.ok_or_else(|| {
            Error::config(
                &self.path,
                KEY_ARCHITECTURE,
                "missing from the GGUF metadata",
            )
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------

/// One tensor to be written to a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorSpec {
    /// The tensor's name (under [`MAX_NAME_LEN`] bytes).
    pub name: String,
    /// Dimensions in ggml order (`ne[0]`, the row length, first).
    pub dims_ggml: Vec<u64>,
    /// The element / block type.
    pub ggml_type: GgmlType,
}

impl GgufTensorSpec {
    /// A spec from a row-major shape (slowest dimension first).
    pub fn from_shape(name: impl Into<String>, shape: &[usize], ggml_type: GgmlType) -> Self {
        GgufTensorSpec {
            name: name.into(),
            dims_ggml: shape.iter().rev().map(|&d| d as u64).collect(),
            ggml_type,
        }
    }

    /// Size in bytes, or an error message.
    pub fn nbytes(&self) -> std::result::Result<usize, String> {
        self.ggml_type.nbytes(&self.dims_ggml)
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_array(out: &mut Vec<u8>, a: &GgufArray) {
    out.extend_from_slice(&a.element_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! nums {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        GgufArray::U8(v) => out.extend_from_slice(v),
        GgufArray::I8(v) => nums!(v),
        GgufArray::U16(v) => nums!(v),
        GgufArray::I16(v) => nums!(v),
        GgufArray::U32(v) => nums!(v),
        GgufArray::I32(v) => nums!(v),
        GgufArray::F32(v) => nums!(v),
        GgufArray::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        GgufArray::String(v) => v.iter().for_each(|s| put_string(out, s)),
        GgufArray::Array(v) => v.iter().for_each(|a| put_array(out, a)),
        GgufArray::U64(v) => nums!(v),
        GgufArray::I64(v) => nums!(v),
        GgufArray::F64(v) => nums!(v),
    }
}

/// The payload of a value (without its type id).
fn put_value(out: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::U8(x) => out.push(*x),
        GgufValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Bool(x) => out.push(u8::from(*x)),
        GgufValue::String(s) => put_string(out, s),
        GgufValue::Array(a) => put_array(out, a),
        GgufValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        GgufValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Streams a version-3 GGUF file: the header, metadata and tensor infos are written up front
/// from the specs, then each tensor's bytes in the same order (a tensor may come in several
/// pieces), each padded to the alignment. The file appears under its name only on
/// [`finish`](GgufWriter::finish).
pub struct GgufWriter {
    path: PathBuf,
    /// Removes its temporary if the writer is dropped unfinished.
    out: AtomicFile,
    alignment: usize,
    specs: Vec<GgufTensorSpec>,
    sizes: Vec<usize>,
    next: usize,
    written_in_tensor: usize,
}

impl GgufWriter {
    /// Start writing `path` with this metadata (in this order) and these tensors (in this
    /// order). `general.alignment`, if given, must be a `u32` power of two; otherwise 32.
    pub fn create(
        path: &Path,
        metadata: &[(String, GgufValue)],
        tensors: Vec<GgufTensorSpec>,
    ) -> Result<GgufWriter> {
        let invalid = |m: String| Error::Invalid(format!("{}: {m}", path.display()));
        let mut alignment = GGUF_DEFAULT_ALIGNMENT as usize;
        let mut keys = std::collections::HashSet::new();
        for (k, v) in metadata {
            if !keys.insert(k.as_str()) {
                return Err(invalid(format!("metadata key `{k}` given twice")));
            }
            if k == KEY_ALIGNMENT {
                match v {
                    GgufValue::U32(a) if a.is_power_of_two() => alignment = *a as usize,
                    _ => {
                        return Err(invalid(format!(
                            "`{KEY_ALIGNMENT}` must be a u32 power of two, not {v:?}"
                        )))
                    }
                }
            }
        }
        let mut names = std::collections::HashSet::new();
        let mut sizes = Vec::with_capacity(tensors.len());
        for s in &tensors {
            if !names.insert(s.name.as_str()) {
                return Err(invalid(format!("tensor `{}` given twice", s.name)));
            }
            if s.name.len() >= MAX_NAME_LEN {
                return Err(invalid(format!(
                    "tensor name `{}` is {} bytes; ggml allows at most {}",
                    s.name,
                    s.name.len(),
                    MAX_NAME_LEN - 1
                )));
            }
            if s.dims_ggml.len() > MAX_DIMS {
                return Err(invalid(format!(
                    "tensor `{}` has {} dimensions; ggml allows at most {MAX_DIMS}",
                    s.name,
                    s.dims_ggml.len()
                )));
            }
            sizes.push(
                s.nbytes()
                    .map_err(|m| invalid(format!("tensor `{}`: {m}", s.name)))?,
            );
        }

        let mut head = Vec::new();
        head.extend_from_slice(&GGUF_MAGIC);
        head.extend_from_slice(&GGUF_VERSION.to_le_bytes());
        head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_string(&mut head, k);
            head.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut head, v);
        }
        let mut offset = 0usize;
        for (s, &n) in tensors.iter().zip(&sizes) {
            put_string(&mut head, &s.name);
            head.extend_from_slice(&(s.dims_ggml.len() as u32).to_le_bytes());
            for d in &s.dims_ggml {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&s.ggml_type.id().to_le_bytes());
            head.extend_from_slice(&(offset as u64).to_le_bytes());
            offset += n.next_multiple_of(alignment);
        }
        head.resize(head.len().next_multiple_of(alignment), 0);

        let mut out = AtomicFile::with_capacity(path, 8 << 20)?;
        out.write_all(&head)
            .map_err(|e| Error::io(out.tmp_path(), e))?;
        let mut w = GgufWriter {
            path: path.to_path_buf(),
            out,
            alignment,
            specs: tensors,
            sizes,
            next: 0,
            written_in_tensor: 0,
        };
        w.advance()?;
        Ok(w)
    }

    /// Pad and move past every tensor that is complete.
    fn advance(&mut self) -> Result<()> {
        while self.next < self.specs.len() && self.written_in_tensor == self.sizes[self.next] {
            let n = self.sizes[self.next];
            let pad = n.next_multiple_of(self.alignment) - n;
            self.out
                .write_all(&vec![0u8; pad])
                .map_err(|e| Error::io(self.out.tmp_path(), e))?;
            self.next += 1;
            self.written_in_tensor = 0;
        }
        Ok(())
    }

    /// Append bytes of the current tensor.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let spec = self.specs.get(self.next).ok_or_else(|| {
            Error::Invalid(format!(
                "{}: more data than declared tensors",
                self.path.display()
            ))
        })?;
        let remaining = self.sizes[self.next] - self.written_in_tensor;
        if bytes.len() > remaining {
            return Err(Error::Invalid(format!(
                "{}: tensor `{}` given more bytes than its {} {:?} holds",
                self.path.display(),
                spec.name,
                spec.ggml_type,
                spec.dims_ggml
            )));
        }
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io(self.out.tmp_path(), e))?;
        self.written_in_tensor += bytes.len();
        self.advance()
    }

    /// Flush, sync and rename into place; an error if some tensor is incomplete.
    pub fn finish(self) -> Result<()> {
        crate::format::write::all_written(&self.path, self.next, self.specs.len())?;
        self.out.commit()
    }
}

/// Whether `path` is a GGUF file (by its magic), not a directory.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}
