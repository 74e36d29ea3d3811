//! Scalar reference of llama.cpp's (ggml's) block quantization formats.
//!
//! A quantized row is a sequence of fixed-size blocks; each block holds `block_size` elements
//! in `block_bytes` bytes (a few f16 scales plus packed integer codes). This module knows the
//! byte layout of every format we read from GGUF files, turns blocks back into f32
//! ([`dequantize_row`]) and, for the formats we write, produces them from f32
//! ([`quantize_row`]).
//!
//! Everything here is the *reference*: plain scalar code, no `unsafe`, blocks parsed from
//! little-endian bytes (`&[u8]`, no alignment needed). It follows ggml's `ggml-quants.c` step
//! by step, including the order and association of every f32 operation (no fused
//! multiply-adds), so that
//!
//! * dequantization is bit-identical to ggml's `dequantize_row_*` and to gguf-py's numpy
//!   reference (checked against committed vectors in `engine/tests/quant_vectors/`);
//! * quantization is bit-identical to ggml's `quantize_row_*_ref` (the deterministic
//!   reference quantizers llama.cpp uses without an importance matrix) for Q4_0, Q4_1, Q5_0,
//!   Q5_1, Q8_0, MXFP4 (checked against gguf-py's vectors) and is a line-by-line port for the
//!   K-quants Q2_K..Q6_K (`make_qkx2_quants`, `make_qx_quants`, `make_q3_quants`), which
//!   gguf-py cannot produce; those are checked against committed bytes from a build of
//!   ggml's reference quantizers without FP contraction (a build that fuses multiply-adds,
//!   e.g. `-march=native` with FMA, rounds differently and produces different K-quant
//!   bytes; ggml itself is not deterministic across such builds).
//!
//! Element order inside blocks (ggml's, reproduced by the block types' `dequantize`):
//! 32-element formats store element `j` in the low nibble of byte `j` and element `j + 16` in
//! its high nibble; the K-quants interleave 32- or 64-element groups as documented on each
//! block type. Fast kernels elsewhere may compute dot products directly on blocks; they must
//! produce the values this module defines.

use half::{bf16, f16};

use crate::{Error, Result};

/// Elements per K-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// Elements per block of the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL,
/// MXFP4).
pub const QK32: usize = 32;

/// IQ4_NL / IQ4_XS non-linear code book (ggml's `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// MXFP4 (OCP microscaling e2m1) code book, *doubled* so it fits in integers (ggml's
/// `kvalues_mxfp4`); the block scale is halved to compensate
/// ([`e8m0_to_f32_half`]). Codes 8..16 are the negatives (code 8 is -0).
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// A ggml tensor type this module can read (and for some, write).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    MXFP4,
}

impl QuantType {
    /// Every supported type.
    pub const ALL: [QuantType; 16] = [
        QuantType::F32,
        QuantType::F16,
        QuantType::BF16,
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q2_K,
        QuantType::Q3_K,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
        QuantType::IQ4_NL,
        QuantType::IQ4_XS,
        QuantType::MXFP4,
    ];

    /// The type with ggml's numeric id (`enum ggml_type`, as stored in GGUF tensor infos);
    /// `None` for ids this module does not support.
    pub fn from_ggml_id(id: u32) -> Option<QuantType> {
        QuantType::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// ggml's numeric id of this type.
    pub fn ggml_id(self) -> u32 {
        match self {
            QuantType::F32 => 0,
            QuantType::F16 => 1,
            QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 3,
            QuantType::Q5_0 => 6,
            QuantType::Q5_1 => 7,
            QuantType::Q8_0 => 8,
            QuantType::Q2_K => 10,
            QuantType::Q3_K => 11,
            QuantType::Q4_K => 12,
            QuantType::Q5_K => 13,
            QuantType::Q6_K => 14,
            QuantType::IQ4_NL => 20,
            QuantType::IQ4_XS => 23,
            QuantType::BF16 => 30,
            QuantType::MXFP4 => 39,
        }
    }

    /// ggml's name of this type (`ggml_type_name`: "f32", "q4_0", "q4_K", "iq4_nl", ...).
    pub fn name(self) -> &'static str {
        match self {
            QuantType::F32 => "f32",
            QuantType::F16 => "f16",
            QuantType::BF16 => "bf16",
            QuantType::Q4_0 => "q4_0",
            QuantType::Q4_1 => "q4_1",
            QuantType::Q5_0 => "q5_0",
            QuantType::Q5_1 => "q5_1",
            QuantType::Q8_0 => "q8_0",
            QuantType::Q2_K => "q2_K",
            QuantType::Q3_K => "q3_K",
            QuantType::Q4_K => "q4_K",
            QuantType::Q5_K => "q5_K",
            QuantType::Q6_K => "q6_K",
            QuantType::IQ4_NL => "iq4_nl",
            QuantType::IQ4_XS => "iq4_xs",
            QuantType::MXFP4 => "mxfp4",
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_size(self) -> usize {
        match self {
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => 1,
            QuantType::Q4_0
            | QuantType::Q4_1
            | QuantType::Q5_0
            | QuantType::Q5_1
            | QuantType::Q8_0
            | QuantType::IQ4_NL
            | QuantType::MXFP4 => QK32,
            QuantType::Q2_K
            | QuantType::Q3_K
            | QuantType::Q4_K
            | QuantType::Q5_K
            | QuantType::Q6_K
            | QuantType::IQ4_XS => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::F32 => 4,
            QuantType::F16 | QuantType::BF16 => 2,
            QuantType::Q4_0 => BlockQ4_0::BYTES,
            QuantType::Q4_1 => BlockQ4_1::BYTES,
            QuantType::Q5_0 => BlockQ5_0::BYTES,
            QuantType::Q5_1 => BlockQ5_1::BYTES,
            QuantType::Q8_0 => BlockQ8_0::BYTES,
            QuantType::Q2_K => BlockQ2K::BYTES,
            QuantType::Q3_K => BlockQ3K::BYTES,
            QuantType::Q4_K => BlockQ4K::BYTES,
            QuantType::Q5_K => BlockQ5K::BYTES,
            QuantType::Q6_K => BlockQ6K::BYTES,
            QuantType::IQ4_NL => BlockIq4Nl::BYTES,
            QuantType::IQ4_XS => BlockIq4Xs::BYTES,
            QuantType::MXFP4 => BlockMxfp4::BYTES,
        }
    }

    /// Bytes of a row of `n` elements; an error if `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return Err(Error::Invalid(format!(
                "{}: row of {n} elements is not a multiple of the block size {}",
                self.name(),
                self.block_size()
            )));
        }
        Ok(n / self.block_size() * self.block_bytes())
    }

    /// Whether [`quantize_row`] can produce this type.
    pub fn can_quantize(self) -> bool {
        !matches!(self, QuantType::IQ4_NL | QuantType::IQ4_XS)
    }
}

impl std::fmt::Display for QuantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

// ------------------------------------------------------------------------------------------
// Helpers shared by the formats.

/// Read the little-endian f16 at `b[off..off + 2]`.
#[inline]
fn f16_at(b: &[u8], off: usize) -> f16 {
    f16::from_le_bytes([b[off], b[off + 1]])
}

/// Copy `N` bytes starting at `off`.
#[inline]
fn arr<const N: usize>(b: &[u8], off: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[off..off + N]);
    a
}

/// Check that a block parser got exactly its block.
#[inline]
fn check_len(b: &[u8], bytes: usize, what: &str) {
    assert_eq!(b.len(), bytes, "{what} block must be {bytes} bytes");
}

/// ggml's `nearest_int`: round to nearest, ties to even, via the 1.5·2²³ trick (valid for
/// |x| ≤ 2²² − 1, which every caller guarantees for finite input).
#[inline]
fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// ggml's `GGML_E8M0_TO_FP32_HALF`: an e8m0 exponent byte as the f32 `2^(e-127) / 2`
/// (subnormal for `e < 2`).
#[inline]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// Q4_K / Q5_K: the 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes
/// (ggml's `get_scale_min_k4`). Bytes 0..4 hold scales 0..4 in their low 6 bits, bytes 4..8
/// mins 0..4; bytes 8..12 hold the low nibbles of scales (low half) and mins (high half)
/// 4..8, whose top 2 bits sit in the top bits of bytes 0..4 (scales) and 4..8 (mins).
#[inline]
pub fn get_scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Pack eight 6-bit scales and mins the way [`get_scale_min_k4`] reads them.
pub(crate) fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        let (l, m) = (ls[j], lm[j]);
        if j < 4 {
            s[j] = l;
            s[j + 4] = m;
        } else {
            s[j + 4] = (l & 0xf) | ((m & 0xf) << 4);
            s[j - 4] |= (l >> 4) << 6;
            s[j] |= (m >> 4) << 6;
        }
    }
    s
}

/// Q3_K: the 16 signed 6-bit sub-block scales (already minus 32) from the 12 packed bytes.
/// Scale `j` has its low nibble in byte `j` (j < 8, low half) or `j − 8` (high half) and its
/// top 2 bits in byte `8 + j % 4` at bit `2·(j / 4)`.
#[inline]
pub fn q3k_scales(s: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0xf } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

// ------------------------------------------------------------------------------------------
// 32-element formats.

/// Q8_0: `d: f16`, 32 × `i8`; value = `q · d`. 34 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; 32],
}

impl BlockQ8_0 {
    pub const BYTES: usize = 34;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "q8_0");
        let mut qs = [0i8; 32];
        for (q, &v) in qs.iter_mut().zip(&b[2..]) {
            *q = v as i8;
        }
        BlockQ8_0 {
            d: f16_at(b, 0),
            qs,
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend(self.qs.iter().map(|&q| q as u8));
    }

    /// Dequantize into 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = self.d.to_f32();
        for (y, &q) in y[..32].iter_mut().zip(&self.qs) {
            *y = q as f32 * d;
        }
    }

    /// ggml's `quantize_row_q8_0_ref` for one block.
    pub fn quantize(x: &[f32]) -> Self {
        let mut amax = 0.0f32;
        for &v in &x[..32] {
            amax = if amax > v.abs() { amax } else { v.abs() };
        }
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; 32];
        for (q, &v) in qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
        BlockQ8_0 {
            d: f16::from_f32(d),
            qs,
        }
    }
}

/// Index of the element with the largest magnitude (first on ties) and that element.
#[inline]
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Minimum and maximum of a block (ggml's loop starting from ±FLT_MAX).
#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// Q4_0: `d: f16`, 16 bytes of nibbles; element `j` is the low nibble of byte `j`, element
/// `j + 16` the high nibble; value = `(q − 8) · d`. 18 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; 16],
}

impl BlockQ4_0 {
    pub const BYTES: usize = 18;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "q4_0");
        BlockQ4_0 {
            d: f16_at(b, 0),
            qs: arr(b, 2),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.qs);
    }

    /// Dequantize into 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = self.d.to_f32();
        for (j, &q) in self.qs.iter().enumerate() {
            y[j] = ((q & 0xf) as i32 - 8) as f32 * d;
            y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }

    /// ggml's `quantize_row_q4_0_ref` for one block.
    pub fn quantize(x: &[f32]) -> Self {
        let max = signed_absmax(&x[..32]);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            let x0 = x[j] * id;
            let x1 = x[16 + j] * id;
            let q0 = ((x0 + 8.5) as i8).min(15) as u8;
            let q1 = ((x1 + 8.5) as i8).min(15) as u8;
            *q = q0 | (q1 << 4);
        }
        BlockQ4_0 {
            d: f16::from_f32(d),
            qs,
        }
    }
}

/// Q4_1: `d: f16`, `m: f16`, 16 bytes of nibbles (as Q4_0); value = `q · d + m`. 20 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; 16],
}

impl BlockQ4_1 {
    pub const BYTES: usize = 20;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "q4_1");
        BlockQ4_1 {
            d: f16_at(b, 0),
            m: f16_at(b, 2),
            qs: arr(b, 4),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.m.to_le_bytes());
        out.extend_from_slice(&self.qs);
    }

    /// Dequantize into 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for (j, &q) in self.qs.iter().enumerate() {
            y[j] = (q & 0xf) as f32 * d + m;
            y[j + 16] = (q >> 4) as f32 * d + m;
        }
    }

    /// ggml's `quantize_row_q4_1_ref` for one block.
    pub fn quantize(x: &[f32]) -> Self {
        let (min, max) = min_max(&x[..32]);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            let x0 = (x[j] - min) * id;
            let x1 = (x[16 + j] - min) * id;
            let q0 = ((x0 + 0.5) as i8).min(15) as u8;
            let q1 = ((x1 + 0.5) as i8).min(15) as u8;
            *q = q0 | (q1 << 4);
        }
        BlockQ4_1 {
            d: f16::from_f32(d),
            m: f16::from_f32(min),
            qs,
        }
    }
}

/// Q5_0: `d: f16`, `qh: u32` (bit `j` = 5th bit of element `j`), 16 bytes of low nibbles
/// (as Q4_0); value = `(q − 16) · d`. 22 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: u32,
    pub qs: [u8; 16],
}

/// Split 32 five-bit codes into Q5 low nibbles and high-bit word.
fn pack_q5(l: &[u8; 32]) -> ([u8; 16], u32) {
    let mut qs = [0u8; 16];
    let mut qh = 0u32;
    for j in 0..16 {
        let (x0, x1) = (l[j], l[j + 16]);
        qs[j] = (x0 & 0x0f) | ((x1 & 0x0f) << 4);
        qh |= (((x0 & 0x10) >> 4) as u32) << j;
        qh |= (((x1 & 0x10) >> 4) as u32) << (j + 16);
    }
    (qs, qh)
}

/// The 32 five-bit codes (0..32) of a Q5_0 / Q5_1 block from its low nibbles and high-bit
/// word (element `j < 16` in the low nibble of `qs[j]`, `j ≥ 16` in the high nibble of
/// `qs[j − 16]`; the fifth bit of element `j` is bit `j` of `qh`).
#[inline]
pub fn unpack_q5(qs: &[u8; 16], qh: u32) -> [u8; 32] {
    let mut l = [0u8; 32];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        l[j] = (qs[j] & 0x0f) | xh0;
        l[j + 16] = (qs[j] >> 4) | xh1;
    }
    l
}

impl BlockQ5_0 {
    pub const BYTES: usize = 22;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "q5_0");
        BlockQ5_0 {
            d: f16_at(b, 0),
            qh: u32::from_le_bytes(arr(b, 2)),
            qs: arr(b, 6),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.qh.to_le_bytes());
        out.extend_from_slice(&self.qs);
    }

    /// Dequantize into 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = self.d.to_f32();
        for (y, &q) in y[..32].iter_mut().zip(&unpack_q5(&self.qs, self.qh)) {
            *y = (q as i32 - 16) as f32 * d;
        }
    }

    /// ggml's `quantize_row_q5_0_ref` for one block.
    pub fn quantize(x: &[f32]) -> Self {
        let max = signed_absmax(&x[..32]);
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut l = [0u8; 32];
        for (l, &v) in l.iter_mut().zip(x) {
            *l = ((v * id + 16.5) as i8).min(31) as u8;
        }
        let (qs, qh) = pack_q5(&l);
        BlockQ5_0 {
            d: f16::from_f32(d),
            qh,
            qs,
        }
    }
}

/// Q5_1: `d: f16`, `m: f16`, `qh: u32`, 16 bytes of low nibbles (as Q5_0);
/// value = `q · d + m`. 24 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: u32,
    pub qs: [u8; 16],
}

impl BlockQ5_1 {
    pub const BYTES: usize = 24;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "q5_1");
        BlockQ5_1 {
            d: f16_at(b, 0),
            m: f16_at(b, 2),
            qh: u32::from_le_bytes(arr(b, 4)),
            qs: arr(b, 8),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.m.to_le_bytes());
        out.extend_from_slice(&self.qh.to_le_bytes());
        out.extend_from_slice(&self.qs);
    }

    /// Dequantize into 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for (y, &q) in y[..32].iter_mut().zip(&unpack_q5(&self.qs, self.qh)) {
            *y = q as f32 * d + m;
        }
    }

    /// ggml's `quantize_row_q5_1_ref` for one block.
    pub fn quantize(x: &[f32]) -> Self {
        let (min, max) = min_max(&x[..32]);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut l = [0u8; 32];
        for (l, &v) in l.iter_mut().zip(x) {
            *l = ((v - min) * id + 0.5) as u8;
        }
        let (qs, qh) = pack_q5(&l);
        BlockQ5_1 {
            d: f16::from_f32(d),
            m: f16::from_f32(min),
            qh,
            qs,
        }
    }
}

/// IQ4_NL: `d: f16`, 16 bytes of nibbles (as Q4_0) indexing [`KVALUES_IQ4NL`];
/// value = `d · kvalues[q]`. 18 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockIq4Nl {
    pub d: f16,
    pub qs: [u8; 16],
}

impl BlockIq4Nl {
    pub const BYTES: usize = 18;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "iq4_nl");
        BlockIq4Nl {
            d: f16_at(b, 0),
            qs: arr(b, 2),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.qs);
    }

    /// Dequantize into 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = self.d.to_f32();
        for (j, &q) in self.qs.iter().enumerate() {
            y[j] = d * KVALUES_IQ4NL[(q & 0xf) as usize] as f32;
            y[j + 16] = d * KVALUES_IQ4NL[(q >> 4) as usize] as f32;
        }
    }
}

/// MXFP4: `e: u8` (e8m0 shared exponent), 16 bytes of e2m1 nibbles (as Q4_0) indexing
/// [`KVALUES_MXFP4`]; value = `kvalues[q] · 2^(e−127) / 2`. 17 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockMxfp4 {
    pub e: u8,
    pub qs: [u8; 16],
}

impl BlockMxfp4 {
    pub const BYTES: usize = 17;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "mxfp4");
        BlockMxfp4 {
            e: b[0],
            qs: arr(b, 1),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.push(self.e);
        out.extend_from_slice(&self.qs);
    }

    /// Dequantize into 32 values.
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = e8m0_to_f32_half(self.e);
        for (j, &q) in self.qs.iter().enumerate() {
            y[j] = KVALUES_MXFP4[(q & 0xf) as usize] as f32 * d;
            y[j + 16] = KVALUES_MXFP4[(q >> 4) as usize] as f32 * d;
        }
    }

    /// ggml's `quantize_row_mxfp4_ref` for one block.
    pub fn quantize(x: &[f32]) -> Self {
        let mut amax = 0.0f32;
        for &v in &x[..32] {
            if amax < v.abs() {
                amax = v.abs();
            }
        }
        let e = if amax > 0.0 {
            (amax.log2().floor() - 2.0 + 127.0) as u8
        } else {
            0
        };
        let d = e8m0_to_f32_half(e);
        let best = |v: f32| -> u8 {
            let mut best_index = 0;
            let mut best_err = (KVALUES_MXFP4[0] as f32 * d - v).abs();
            for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
                let err = (k as f32 * d - v).abs();
                if err < best_err {
                    best_index = i;
                    best_err = err;
                }
            }
            best_index as u8
        };
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = best(x[j]) | (best(x[16 + j]) << 4);
        }
        BlockMxfp4 { e, qs }
    }
}

// ------------------------------------------------------------------------------------------
// K-quants (256-element super-blocks).

/// Pack 256 two-bit codes: byte `32·h + l` (h = 0, 1) holds elements `128h + l + 32s` at
/// bits `2s` (s = 0..4).
fn pack_2bit(l: &[u8; QK_K]) -> [u8; 64] {
    let mut qs = [0u8; 64];
    for j in (0..QK_K).step_by(128) {
        for i in 0..32 {
            qs[j / 4 + i] =
                l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6);
        }
    }
    qs
}

/// Q2_K: `scales: [u8; 16]` (low nibble: scale, high nibble: min of each 16-element
/// sub-block), `qs: [u8; 64]` (2-bit codes, see `pack_2bit`), `d: f16`, `dmin: f16`;
/// value = `d·sc·q − dmin·m`. 84 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ2K {
    pub scales: [u8; 16],
    pub qs: [u8; 64],
    pub d: f16,
    pub dmin: f16,
}

impl BlockQ2K {
    pub const BYTES: usize = 84;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "q2_K");
        BlockQ2K {
            scales: arr(b, 0),
            qs: arr(b, 16),
            d: f16_at(b, 80),
            dmin: f16_at(b, 82),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.scales);
        out.extend_from_slice(&self.qs);
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.dmin.to_le_bytes());
    }

    /// Dequantize into 256 values (ggml's `dequantize_row_q2_K`).
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = self.d.to_f32();
        let min = self.dmin.to_f32();
        let mut k = 0;
        let mut is = 0;
        for n in 0..2 {
            let q = &self.qs[32 * n..32 * n + 32];
            for shift in [0, 2, 4, 6] {
                for half in 0..2 {
                    let sc = self.scales[is];
                    is += 1;
                    let dl = d * (sc & 0xf) as f32;
                    let ml = min * (sc >> 4) as f32;
                    for &qb in &q[16 * half..16 * half + 16] {
                        y[k] = dl * ((qb >> shift) & 3) as f32 - ml;
                        k += 1;
                    }
                }
            }
        }
    }

    /// ggml's `quantize_row_q2_K_ref` for one super-block.
    pub fn quantize(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let mut l = [0u8; QK_K];
        let mut laux = [0u8; 16];
        let mut weights = [0f32; 16];
        let mut mins = [0f32; 16];
        let mut scales = [0f32; 16];
        let q4scale = 15.0f32;

        let mut max_scale = 0.0f32;
        let mut max_min = 0.0f32;
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            for (w, &v) in weights.iter_mut().zip(xs) {
                *w = v.abs();
            }
            let (scale, the_min) = make_qkx2_quants(
                3,
                xs,
                &weights,
                &mut l[16 * j..16 * j + 16],
                &mut laux,
                KParams {
                    rmin: -0.5,
                    rdelta: 0.1,
                    nstep: 15,
                    use_mad: true,
                },
            );
            scales[j] = scale;
            mins[j] = the_min;
            if scale > max_scale {
                max_scale = scale;
            }
            if the_min > max_min {
                max_min = the_min;
            }
        }

        let mut b = BlockQ2K {
            scales: [0; 16],
            qs: [0; 64],
            d: f16::ZERO,
            dmin: f16::ZERO,
        };
        if max_scale > 0.0 {
            let iscale = q4scale / max_scale;
            for (s, &v) in b.scales.iter_mut().zip(&scales) {
                *s = nearest_int(iscale * v) as u8;
            }
            b.d = f16::from_f32(max_scale / q4scale);
        }
        if max_min > 0.0 {
            let iscale = q4scale / max_min;
            for (s, &v) in b.scales.iter_mut().zip(&mins) {
                *s |= (nearest_int(iscale * v) as u8) << 4;
            }
            b.dmin = f16::from_f32(max_min / q4scale);
        }
        for j in 0..16 {
            let d = b.d.to_f32() * (b.scales[j] & 0xf) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = b.dmin.to_f32() * (b.scales[j] >> 4) as f32;
            for ii in 0..16 {
                let q = nearest_int((x[16 * j + ii] + dm) / d);
                l[16 * j + ii] = q.clamp(0, 3) as u8;
            }
        }
        b.qs = pack_2bit(&l);
        b
    }
}

/// Q3_K: `hmask: [u8; 32]` (high bit of element `e` at byte `e % 32`, bit `e / 32`; a *clear*
/// bit subtracts 4), `qs: [u8; 64]` (low 2 bits, see `pack_2bit`), `scales: [u8; 12]` (16
/// six-bit scales, see [`q3k_scales`]), `d: f16`; value = `d·(sc − 32)·q`. 110 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ3K {
    pub hmask: [u8; 32],
    pub qs: [u8; 64],
    pub scales: [u8; 12],
    pub d: f16,
}

impl BlockQ3K {
    pub const BYTES: usize = 110;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "q3_K");
        BlockQ3K {
            hmask: arr(b, 0),
            qs: arr(b, 32),
            scales: arr(b, 96),
            d: f16_at(b, 108),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.hmask);
        out.extend_from_slice(&self.qs);
        out.extend_from_slice(&self.scales);
        out.extend_from_slice(&self.d.to_le_bytes());
    }

    /// Dequantize into 256 values (ggml's `dequantize_row_q3_K`).
    pub fn dequantize(&self, y: &mut [f32]) {
        let d_all = self.d.to_f32();
        let scales = q3k_scales(&self.scales);
        let mut m = 1u8;
        let mut k = 0;
        let mut is = 0;
        for n in 0..2 {
            let q = &self.qs[32 * n..32 * n + 32];
            for shift in [0, 2, 4, 6] {
                for half in 0..2 {
                    let dl = d_all * scales[is] as f32;
                    is += 1;
                    let range = 16 * half..16 * half + 16;
                    for (&qb, &hb) in q[range.clone()].iter().zip(&self.hmask[range]) {
                        let low = ((qb >> shift) & 3) as i32;
                        let sub = if hb & m != 0 { 0 } else { 4 };
                        y[k] = dl * (low - sub) as f32;
                        k += 1;
                    }
                }
                m <<= 1;
            }
        }
    }

    /// ggml's `quantize_row_q3_K_ref` for one super-block.
    pub fn quantize(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let mut max_scale = 0.0f32;
        let mut amax = 0.0f32;
        for j in 0..16 {
            scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
            let scale = scales[j].abs();
            if scale > amax {
                amax = scale;
                max_scale = scales[j];
            }
        }
        let mut b = BlockQ3K {
            hmask: [0; 32],
            qs: [0; 64],
            scales: [0; 12],
            d: f16::ZERO,
        };
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, &s) in scales.iter().enumerate() {
                let lq = (nearest_int(iscale * s) as i8).clamp(-32, 31) + 32;
                if j < 8 {
                    b.scales[j] = (lq & 0xf) as u8;
                } else {
                    b.scales[j - 8] |= ((lq & 0xf) << 4) as u8;
                }
                let hi = (lq >> 4) as u8;
                b.scales[j % 4 + 8] |= hi << (2 * (j / 4));
            }
            b.d = f16::from_f32(1.0 / iscale);
        }
        let sc = q3k_scales(&b.scales);
        for j in 0..16 {
            let d = b.d.to_f32() * sc[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(x[16 * j + ii] / d);
                l[16 * j + ii] = (q.clamp(-4, 3) + 4) as i8;
            }
        }
        let mut lu = [0u8; QK_K];
        let mut m = 0;
        let mut hm = 1u8;
        for j in 0..QK_K {
            let mut v = l[j] as u8;
            if v > 3 {
                b.hmask[m] |= hm;
                v -= 4;
            }
            lu[j] = v;
            m += 1;
            if m == QK_K / 8 {
                m = 0;
                hm <<= 1;
            }
        }
        b.qs = pack_2bit(&lu);
        b
    }
}

/// Q4_K: `d: f16`, `dmin: f16`, `scales: [u8; 12]` (eight 6-bit scales and mins, see
/// [`get_scale_min_k4`]), `qs: [u8; 128]`: 64-element chunk `c` uses bytes `32c..32c + 32`,
/// its first 32 elements in the low nibbles (sub-block `2c`), the next 32 in the high nibbles
/// (sub-block `2c + 1`); value = `d·sc·q − dmin·m`. 144 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}

impl BlockQ4K {
    pub const BYTES: usize = 144;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "q4_K");
        BlockQ4K {
            d: f16_at(b, 0),
            dmin: f16_at(b, 2),
            scales: arr(b, 4),
            qs: arr(b, 16),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.dmin.to_le_bytes());
        out.extend_from_slice(&self.scales);
        out.extend_from_slice(&self.qs);
    }

    /// Dequantize into 256 values (ggml's `dequantize_row_q4_K`).
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = self.d.to_f32();
        let min = self.dmin.to_f32();
        for c in 0..4 {
            let q = &self.qs[32 * c..32 * c + 32];
            let (sc1, m1) = get_scale_min_k4(2 * c, &self.scales);
            let (sc2, m2) = get_scale_min_k4(2 * c + 1, &self.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let y = &mut y[64 * c..64 * c + 64];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0xf) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }

    /// ggml's `quantize_row_q4_K_ref` for one super-block.
    pub fn quantize(x: &[f32]) -> Self {
        let (d, dmin, scales, l) = quantize_k_scale_min(x, 15, -1.0, 0.1, 20);
        let mut qs = [0u8; 128];
        for c in 0..4 {
            for i in 0..32 {
                qs[32 * c + i] = l[64 * c + i] | (l[64 * c + i + 32] << 4);
            }
        }
        BlockQ4K {
            d,
            dmin,
            scales,
            qs,
        }
    }
}

/// The shared part of `quantize_row_q4_K_ref` / `quantize_row_q5_K_ref`: per 32-element
/// sub-block scale and min by `make_qkx2_quants`, 6-bit packing of both relative to the
/// super-block maxima, then requantization of every element against the packed values.
/// Returns `(d, dmin, packed scales, codes 0..=nmax)`.
fn quantize_k_scale_min(
    x: &[f32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f16, f16, [u8; 12], [u8; QK_K]) {
    let x = &x[..QK_K];
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let mut mins = [0f32; 8];
    let mut scales = [0f32; 8];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (scale, the_min) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            &mut laux,
            KParams {
                rmin,
                rdelta,
                nstep,
                use_mad: false,
            },
        );
        scales[j] = scale;
        mins[j] = the_min;
        if scale > max_scale {
            max_scale = scale;
        }
        if the_min > max_min {
            max_min = the_min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    let packed = pack_scale_min_k4(&ls, &lm);
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    for j in 0..8 {
        let (sc, m) = get_scale_min_k4(j, &packed);
        let dd = d.to_f32() * sc as f32;
        if dd == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for ii in 0..32 {
            let q = nearest_int((x[32 * j + ii] + dm) / dd);
            l[32 * j + ii] = q.clamp(0, nmax) as u8;
        }
    }
    (d, dmin, packed, l)
}

/// Q5_K: `d: f16`, `dmin: f16`, `scales: [u8; 12]` (as Q4_K), `qh: [u8; 32]`, `qs: [u8; 128]`
/// (low nibbles as Q4_K); the 5th bit of element `64c + i` (i < 32) is bit `2c` of `qh[i]`,
/// of element `64c + 32 + i` bit `2c + 1`; value = `d·sc·q − dmin·m`. 176 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}

impl BlockQ5K {
    pub const BYTES: usize = 176;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "q5_K");
        BlockQ5K {
            d: f16_at(b, 0),
            dmin: f16_at(b, 2),
            scales: arr(b, 4),
            qh: arr(b, 16),
            qs: arr(b, 48),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.dmin.to_le_bytes());
        out.extend_from_slice(&self.scales);
        out.extend_from_slice(&self.qh);
        out.extend_from_slice(&self.qs);
    }

    /// Dequantize into 256 values (ggml's `dequantize_row_q5_K`).
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = self.d.to_f32();
        let min = self.dmin.to_f32();
        let (mut u1, mut u2) = (1u8, 2u8);
        for c in 0..4 {
            let ql = &self.qs[32 * c..32 * c + 32];
            let (sc1, m1) = get_scale_min_k4(2 * c, &self.scales);
            let (sc2, m2) = get_scale_min_k4(2 * c + 1, &self.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let y = &mut y[64 * c..64 * c + 64];
            for l in 0..32 {
                let h1 = if self.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if self.qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((ql[l] & 0xf) + h1) as f32 - m1;
                y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
            u1 <<= 2;
            u2 <<= 2;
        }
    }

    /// ggml's `quantize_row_q5_K_ref` for one super-block.
    pub fn quantize(x: &[f32]) -> Self {
        let (d, dmin, scales, l) = quantize_k_scale_min(x, 31, -0.5, 0.1, 15);
        let mut qs = [0u8; 128];
        let mut qh = [0u8; 32];
        let (mut m1, mut m2) = (1u8, 2u8);
        for c in 0..4 {
            for j in 0..32 {
                let mut l1 = l[64 * c + j];
                if l1 > 15 {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                let mut l2 = l[64 * c + j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                qs[32 * c + j] = l1 | (l2 << 4);
            }
            m1 <<= 2;
            m2 <<= 2;
        }
        BlockQ5K {
            d,
            dmin,
            scales,
            qh,
            qs,
        }
    }
}

/// Q6_K: `ql: [u8; 128]` (low nibbles), `qh: [u8; 64]` (high 2 bits), `scales: [i8; 16]`
/// (one per 16 elements), `d: f16`. In each 128-element half `h`, element `128h + 32s + l`
/// (s = 0..4, l < 32) has its low nibble in `ql[64h + l + 32·(s & 1)]` (low half for s < 2,
/// high half otherwise) and its high bits at bit `2s` of `qh[32h + l]`;
/// value = `d·sc·(q − 32)`. 210 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ6K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    pub scales: [i8; 16],
    pub d: f16,
}

impl BlockQ6K {
    pub const BYTES: usize = 210;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "q6_K");
        let mut scales = [0i8; 16];
        for (s, &v) in scales.iter_mut().zip(&b[192..208]) {
            *s = v as i8;
        }
        BlockQ6K {
            ql: arr(b, 0),
            qh: arr(b, 128),
            scales,
            d: f16_at(b, 208),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.ql);
        out.extend_from_slice(&self.qh);
        out.extend(self.scales.iter().map(|&s| s as u8));
        out.extend_from_slice(&self.d.to_le_bytes());
    }

    /// Dequantize into 256 values (ggml's `dequantize_row_q6_K`).
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = self.d.to_f32();
        for h in 0..2 {
            let ql = &self.ql[64 * h..64 * h + 64];
            let qh = &self.qh[32 * h..32 * h + 32];
            let sc = &self.scales[8 * h..8 * h + 8];
            let y = &mut y[128 * h..128 * h + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * sc[is] as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }

    /// ggml's `quantize_row_q6_K_ref` for one super-block.
    pub fn quantize(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let mut max_scale = 0.0f32;
        let mut max_abs_scale = 0.0f32;
        for ib in 0..16 {
            let scale =
                make_qx_quants(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
            scales[ib] = scale;
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = scale;
            }
        }
        let mut b = BlockQ6K {
            ql: [0; 128],
            qh: [0; 64],
            scales: [0; 16],
            d: f16::ZERO,
        };
        if max_abs_scale < GROUP_MAX_EPS {
            return b;
        }
        let iscale = -128.0 / max_scale;
        b.d = f16::from_f32(1.0 / iscale);
        for (s, &v) in b.scales.iter_mut().zip(&scales) {
            *s = nearest_int(iscale * v).min(127) as i8;
        }
        for j in 0..16 {
            let d = b.d.to_f32() * b.scales[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(x[16 * j + ii] / d);
                l[16 * j + ii] = (q.clamp(-32, 31) + 32) as i8;
            }
        }
        for h in 0..2 {
            let j = 128 * h;
            for i in 0..32 {
                let q = |s: usize| l[j + i + 32 * s] as u8;
                b.ql[64 * h + i] = (q(0) & 0xf) | ((q(2) & 0xf) << 4);
                b.ql[64 * h + i + 32] = (q(1) & 0xf) | ((q(3) & 0xf) << 4);
                b.qh[32 * h + i] =
                    (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
            }
        }
        b
    }
}

/// IQ4_XS: `d: f16`, `scales_h: u16` (top 2 bits of the 6-bit scale of sub-block `ib` at bit
/// `2·ib`), `scales_l: [u8; 4]` (low nibbles: sub-block `ib` in byte `ib / 2`, low half for
/// even `ib`), `qs: [u8; 128]` (16 bytes per 32-element sub-block, nibbles as Q4_0) indexing
/// [`KVALUES_IQ4NL`]; value = `d·(sc − 32)·kvalues[q]`. 136 bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockIq4Xs {
    pub d: f16,
    pub scales_h: u16,
    pub scales_l: [u8; 4],
    pub qs: [u8; 128],
}

impl BlockIq4Xs {
    pub const BYTES: usize = 136;

    /// Parse a block from exactly [`Self::BYTES`] bytes (panics on any other length).
    pub fn from_bytes(b: &[u8]) -> Self {
        check_len(b, Self::BYTES, "iq4_xs");
        BlockIq4Xs {
            d: f16_at(b, 0),
            scales_h: u16::from_le_bytes([b[2], b[3]]),
            scales_l: arr(b, 4),
            qs: arr(b, 8),
        }
    }

    /// Append the block's bytes.
    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.scales_h.to_le_bytes());
        out.extend_from_slice(&self.scales_l);
        out.extend_from_slice(&self.qs);
    }

    /// The signed scale (`−32..32`) of 32-element sub-block `ib` (0..8).
    #[inline]
    pub fn scale(&self, ib: usize) -> i32 {
        let low = (self.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf;
        let high = ((self.scales_h >> (2 * ib)) & 3) as u8;
        (low | (high << 4)) as i32 - 32
    }

    /// Dequantize into 256 values (ggml's `dequantize_row_iq4_xs`).
    pub fn dequantize(&self, y: &mut [f32]) {
        let d = self.d.to_f32();
        for ib in 0..8 {
            let dl = d * self.scale(ib) as f32;
            let qs = &self.qs[16 * ib..16 * ib + 16];
            let y = &mut y[32 * ib..32 * ib + 32];
            for j in 0..16 {
                y[j] = dl * KVALUES_IQ4NL[(qs[j] & 0xf) as usize] as f32;
                y[j + 16] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// ggml's scale searches.

/// ggml's `GROUP_MAX_EPS`: groups whose largest magnitude is below this quantize to zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// Search parameters of [`make_qkx2_quants`].
#[derive(Clone, Copy)]
struct KParams {
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
}

/// ggml's `make_qkx2_quants`: codes `L[i] ∈ 0..=nmax` with `x ≈ scale·L − the_min`, fitting
/// scale and min by weighted least squares over `nstep + 1` candidate inverse scales and
/// keeping the candidate of least weighted error (squared, or absolute with `use_mad`).
/// Returns `(scale, the_min)` with `the_min ≥ 0`.
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    laux: &mut [u8],
    p: KParams,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if p.use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if p.nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=p.nstep {
        iscale = (p.rmin + p.rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let w = weights[i];
            let lf = q as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with `rmse_type = 1` and no importance weights (weights `x²`), as
/// `quantize_row_q6_K_ref` calls it: symmetric codes `L[i] ∈ 0..2·nmax` (stored `+ nmax`),
/// choosing among 19 candidate scales the one of best weighted fit. Returns the scale
/// (negative when the largest-magnitude element is positive, as in ggml).
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let n = x.len();
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        l[..n].fill(0);
        return 0.0;
    }
    let mut iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = (q + nmax) as i8;
        let w = x[i] * x[i];
        let lf = q as f32;
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &xi in x {
            let lf = nearest_int(iscale * xi).clamp(-nmax, nmax - 1) as f32;
            let w = xi * xi;
            sumlx += w * xi * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
                l[i] = (q + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_q3_quants` with `do_rmse = true`, as `quantize_row_q3_K_ref` calls it:
/// symmetric codes refined by coordinate descent on the `x²`-weighted fit; codes are
/// returned `+ nmax` (0..2·nmax).
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let n = x.len();
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        l[..n].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = q as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let w = x[i] * x[i];
            let li = l[i] as f32;
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] as i32 {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for v in l[..n].iter_mut() {
        *v += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

// ------------------------------------------------------------------------------------------
// Rows.

/// Dequantize one row of `out.len()` elements stored as `ty` in `bytes`.
///
/// `out.len()` must be a multiple of the type's block size and `bytes` exactly
/// [`QuantType::row_bytes`] long. Results are bit-identical to ggml's `dequantize_row_*`.
pub fn dequantize_row(ty: QuantType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let expected = ty.row_bytes(out.len())?;
    if bytes.len() != expected {
        return Err(Error::Invalid(format!(
            "{ty}: row of {} elements needs {expected} bytes, got {}",
            out.len(),
            bytes.len()
        )));
    }
    let bs = ty.block_size();
    let bb = ty.block_bytes();
    macro_rules! blocks {
        ($block:ty) => {
            for (b, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bs)) {
                <$block>::from_bytes(b).dequantize(y);
            }
        };
    }
    match ty {
        QuantType::F32 => {
            for (b, y) in bytes.chunks_exact(4).zip(out.iter_mut()) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        QuantType::F16 => {
            for (b, y) in bytes.chunks_exact(2).zip(out.iter_mut()) {
                *y = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        QuantType::BF16 => {
            for (b, y) in bytes.chunks_exact(2).zip(out.iter_mut()) {
                *y = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        QuantType::Q4_0 => blocks!(BlockQ4_0),
        QuantType::Q4_1 => blocks!(BlockQ4_1),
        QuantType::Q5_0 => blocks!(BlockQ5_0),
        QuantType::Q5_1 => blocks!(BlockQ5_1),
        QuantType::Q8_0 => blocks!(BlockQ8_0),
        QuantType::Q2_K => blocks!(BlockQ2K),
        QuantType::Q3_K => blocks!(BlockQ3K),
        QuantType::Q4_K => blocks!(BlockQ4K),
        QuantType::Q5_K => blocks!(BlockQ5K),
        QuantType::Q6_K => blocks!(BlockQ6K),
        QuantType::IQ4_NL => blocks!(BlockIq4Nl),
        QuantType::IQ4_XS => blocks!(BlockIq4Xs),
        QuantType::MXFP4 => blocks!(BlockMxfp4),
    }
    Ok(())
}

/// Quantize one row `src` to `ty`, appending [`QuantType::row_bytes`] bytes to `out`.
///
/// Uses ggml's deterministic reference quantizers (`quantize_row_*_ref`, i.e. what
/// llama.cpp produces without an importance matrix): F16 and BF16 round to nearest even,
/// Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/MXFP4 and the K-quants Q2_K..Q6_K follow ggml step by step.
/// `src.len()` must be a multiple of the block size; IQ4_NL and IQ4_XS are not supported
/// (see [`QuantType::can_quantize`]).
pub fn quantize_row(ty: QuantType, src: &[f32], out: &mut Vec<u8>) -> Result<()> {
    let n_bytes = ty.row_bytes(src.len())?;
    if !ty.can_quantize() {
        return Err(Error::Unsupported(format!("quantizing to {ty}")));
    }
    out.reserve(n_bytes);
    let bs = ty.block_size();
    macro_rules! blocks {
        ($block:ty) => {
            for x in src.chunks_exact(bs) {
                <$block>::quantize(x).write(out);
            }
        };
    }
    match ty {
        QuantType::F32 => out.extend(src.iter().flat_map(|v| v.to_le_bytes())),
        QuantType::F16 => out.extend(src.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes())),
        QuantType::BF16 => out.extend(src.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes())),
        QuantType::Q4_0 => blocks!(BlockQ4_0),
        QuantType::Q4_1 => blocks!(BlockQ4_1),
        QuantType::Q5_0 => blocks!(BlockQ5_0),
        QuantType::Q5_1 => blocks!(BlockQ5_1),
        QuantType::Q8_0 => blocks!(BlockQ8_0),
        QuantType::Q2_K => blocks!(BlockQ2K),
        QuantType::Q3_K => blocks!(BlockQ3K),
        QuantType::Q4_K => blocks!(BlockQ4K),
        QuantType::Q5_K => blocks!(BlockQ5K),
        QuantType::Q6_K => blocks!(BlockQ6K),
        QuantType::MXFP4 => blocks!(BlockMxfp4),
        QuantType::IQ4_NL | QuantType::IQ4_XS => unreachable!("checked by can_quantize"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::test_values::xorshift as pseudo_random;

    fn deq(ty: QuantType, bytes: &[u8]) -> Vec<f32> {
        let n = bytes.len() / ty.block_bytes() * ty.block_size();
        let mut out = vec![0.0; n];
        dequantize_row(ty, bytes, &mut out).unwrap();
        out
    }

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn type_table_matches_ggml() {
        // (id, block size, block bytes) from ggml's type traits.
        let table = [
            (QuantType::F32, 0, 1, 4),
            (QuantType::F16, 1, 1, 2),
            (QuantType::Q4_0, 2, 32, 18),
            (QuantType::Q4_1, 3, 32, 20),
            (QuantType::Q5_0, 6, 32, 22),
            (QuantType::Q5_1, 7, 32, 24),
            (QuantType::Q8_0, 8, 32, 34),
            (QuantType::Q2_K, 10, 256, 84),
            (QuantType::Q3_K, 11, 256, 110),
            (QuantType::Q4_K, 12, 256, 144),
            (QuantType::Q5_K, 13, 256, 176),
            (QuantType::Q6_K, 14, 256, 210),
            (QuantType::IQ4_NL, 20, 32, 18),
            (QuantType::IQ4_XS, 23, 256, 136),
            (QuantType::BF16, 30, 1, 2),
            (QuantType::MXFP4, 39, 32, 17),
        ];
        for (ty, id, bs, bb) in table {
            assert_eq!(QuantType::from_ggml_id(id), Some(ty));
            assert_eq!(
                (ty.ggml_id(), ty.block_size(), ty.block_bytes()),
                (id, bs, bb)
            );
        }
        for id in [4, 5, 9, 15, 16, 24, 40, 1000] {
            assert_eq!(QuantType::from_ggml_id(id), None);
        }
        assert_eq!(QuantType::Q4_K.row_bytes(512).unwrap(), 288);
        assert!(QuantType::Q4_K.row_bytes(100).is_err());
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut out = vec![0.0; 32];
        assert!(dequantize_row(QuantType::Q8_0, &[0; 33], &mut out).is_err());
        let mut out = vec![0.0; 31];
        assert!(dequantize_row(QuantType::Q8_0, &[0; 34], &mut out).is_err());
        assert!(quantize_row(QuantType::Q4_K, &[0.0; 32], &mut Vec::new()).is_err());
        assert!(quantize_row(QuantType::IQ4_NL, &[0.0; 32], &mut Vec::new()).is_err());
    }

    // ---- (a) hand-built blocks, expectations from the format definitions.

    #[test]
    fn hand_built_q8_0() {
        let mut b = h(1.5).to_vec();
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let y = deq(QuantType::Q8_0, &b);
        for (j, &v) in y.iter().enumerate() {
            assert_eq!(v, (j as f32 - 16.0) * 1.5);
        }
    }

    #[test]
    fn hand_built_q4_0_q4_1_iq4_nl() {
        // Byte j = j | (15 − j) << 4: element j has code j, element j + 16 code 15 − j.
        let qs: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
        let code = |e: usize| if e < 16 { e } else { 15 - (e - 16) };

        let b = [&h(0.5)[..], &qs].concat();
        for (e, &v) in deq(QuantType::Q4_0, &b).iter().enumerate() {
            assert_eq!(v, (code(e) as f32 - 8.0) * 0.5);
        }
        let b = [&h(0.25)[..], &h(-1.0), &qs].concat();
        for (e, &v) in deq(QuantType::Q4_1, &b).iter().enumerate() {
            assert_eq!(v, code(e) as f32 * 0.25 - 1.0);
        }
        let lut = [
            -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
        ];
        let b = [&h(2.0)[..], &qs].concat();
        for (e, &v) in deq(QuantType::IQ4_NL, &b).iter().enumerate() {
            assert_eq!(v, lut[code(e)] as f32 * 2.0);
        }
    }

    #[test]
    fn hand_built_q5_0_q5_1() {
        // Codes 0..32 in element order: element e has code (7·e + 3) % 32.
        let code = |e: usize| (7 * e + 3) % 32;
        let mut qs = [0u8; 16];
        let mut qh = 0u32;
        for e in 0..32 {
            let c = code(e) as u8;
            if e < 16 {
                qs[e] |= c & 15;
            } else {
                qs[e - 16] |= (c & 15) << 4;
            }
            qh |= ((c >> 4) as u32) << e;
        }
        let b = [&h(0.5)[..], &qh.to_le_bytes(), &qs].concat();
        for (e, &v) in deq(QuantType::Q5_0, &b).iter().enumerate() {
            assert_eq!(v, (code(e) as f32 - 16.0) * 0.5);
        }
        let b = [&h(0.125)[..], &h(3.0), &qh.to_le_bytes(), &qs].concat();
        for (e, &v) in deq(QuantType::Q5_1, &b).iter().enumerate() {
            assert_eq!(v, code(e) as f32 * 0.125 + 3.0);
        }
    }

    #[test]
    fn hand_built_mxfp4() {
        // e = 128: scale 2^1, halved: 1.0, so values are the doubled e2m1 code book.
        let e2m1 = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        let qs: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
        for (e, scale) in [(128u8, 2.0f32), (127, 1.0), (120, 1.0 / 128.0)] {
            let b = [&[e][..], &qs].concat();
            for (i, &v) in deq(QuantType::MXFP4, &b).iter().enumerate() {
                let c = if i < 16 { i } else { 15 - (i - 16) };
                assert_eq!(v, e2m1[c] * scale, "e={e} i={i}");
            }
        }
        // Subnormal scales: e = 0 is 2^-127 / 2 = 2^-128.
        let b = [&[0u8][..], &[0x77u8; 16]].concat();
        assert_eq!(deq(QuantType::MXFP4, &b)[0], 12.0 * 2f32.powi(-128));
    }

    #[test]
    fn hand_built_q2_k() {
        // Element e: sub-block e / 16, 2-bit code at byte 32·(e/128) + e%32, bit 2·((e%128)/32).
        let code = |e: usize| ((e * 5 + e / 7) % 4) as u8;
        let sc = |s: usize| ((s * 3) % 16) as u8;
        let mn = |s: usize| ((s * 7 + 1) % 16) as u8;
        let mut b = vec![0u8; 84];
        for (s, v) in b[..16].iter_mut().enumerate() {
            *v = sc(s) | (mn(s) << 4);
        }
        for e in 0..256 {
            b[16 + 32 * (e / 128) + e % 32] |= code(e) << (2 * ((e % 128) / 32));
        }
        b[80..82].copy_from_slice(&h(0.5));
        b[82..84].copy_from_slice(&h(0.25));
        for (e, &v) in deq(QuantType::Q2_K, &b).iter().enumerate() {
            let s = e / 16;
            let want = 0.5 * sc(s) as f32 * code(e) as f32 - 0.25 * mn(s) as f32;
            assert_eq!(v, want, "e={e}");
        }
    }

    #[test]
    fn hand_built_q3_k() {
        // 3-bit code c ∈ 0..8 means c − 4; its high bit is stored in hmask at byte e%32,
        // bit e/32; the 6-bit scale of sub-block s is stored as described in ggml-common.h.
        let code = |e: usize| ((e * 3 + e / 5) % 8) as u8;
        let sc6 = |s: usize| ((s * 11 + 5) % 64) as u8;
        let mut b = vec![0u8; 110];
        for e in 0..256 {
            let c = code(e);
            b[32 + 32 * (e / 128) + e % 32] |= (c & 3) << (2 * ((e % 128) / 32));
            if c & 4 != 0 {
                b[e % 32] |= 1 << (e / 32);
            }
        }
        for s in 0..16 {
            let v = sc6(s);
            if s < 8 {
                b[96 + s] |= v & 15;
            } else {
                b[96 + s - 8] |= (v & 15) << 4;
            }
            b[96 + 8 + s % 4] |= (v >> 4) << (2 * (s / 4));
        }
        b[108..110].copy_from_slice(&h(0.5));
        for (e, &v) in deq(QuantType::Q3_K, &b).iter().enumerate() {
            let want = 0.5 * (sc6(e / 16) as f32 - 32.0) * (code(e) as f32 - 4.0);
            assert_eq!(v, want, "e={e}");
        }
    }

    /// Pack eight 6-bit scales and mins following the layout diagram in gguf-py
    /// (bytes 0..4: EEAAAAAA scales, 4..8: eeaaaaaa mins, 8..12: eeeeEEEE low nibbles).
    fn k4_scales(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
        let mut s = [0u8; 12];
        for i in 0..4 {
            s[i] = (sc[i] & 63) | ((sc[i + 4] >> 4) << 6);
            s[i + 4] = (mn[i] & 63) | ((mn[i + 4] >> 4) << 6);
            s[i + 8] = (sc[i + 4] & 15) | ((mn[i + 4] & 15) << 4);
        }
        s
    }

    #[test]
    fn hand_built_q4_k_q5_k() {
        let sc = [1u8, 17, 63, 40, 5, 33, 62, 16];
        let mn = [0u8, 9, 63, 21, 48, 31, 2, 60];
        let scales = k4_scales(&sc, &mn);
        for s in 0..8 {
            assert_eq!(get_scale_min_k4(s, &scales), (sc[s], mn[s]));
        }
        let code4 = |e: usize| ((e * 7 + e / 9) % 16) as u8;
        let code5 = |e: usize| ((e * 13 + e / 3) % 32) as u8;

        // Q4_K: element e in chunk e/64, byte 32·(e/64) + e%32, high nibble if (e%64) ≥ 32.
        let mut b = vec![0u8; 144];
        b[0..2].copy_from_slice(&h(0.5));
        b[2..4].copy_from_slice(&h(0.125));
        b[4..16].copy_from_slice(&scales);
        for e in 0..256 {
            b[16 + 32 * (e / 64) + e % 32] |= code4(e) << (4 * ((e % 64) / 32));
        }
        for (e, &v) in deq(QuantType::Q4_K, &b).iter().enumerate() {
            let s = e / 32;
            let want = 0.5 * sc[s] as f32 * code4(e) as f32 - 0.125 * mn[s] as f32;
            assert_eq!(v, want, "q4_K e={e}");
        }

        // Q5_K: as Q4_K plus the 5th bit at qh[e%32], bit e/32.
        let mut b = vec![0u8; 176];
        b[0..2].copy_from_slice(&h(0.5));
        b[2..4].copy_from_slice(&h(0.125));
        b[4..16].copy_from_slice(&scales);
        for e in 0..256 {
            let c = code5(e);
            b[48 + 32 * (e / 64) + e % 32] |= (c & 15) << (4 * ((e % 64) / 32));
            b[16 + e % 32] |= (c >> 4) << (e / 32);
        }
        for (e, &v) in deq(QuantType::Q5_K, &b).iter().enumerate() {
            let s = e / 32;
            let want = 0.5 * sc[s] as f32 * code5(e) as f32 - 0.125 * mn[s] as f32;
            assert_eq!(v, want, "q5_K e={e}");
        }
    }

    #[test]
    fn hand_built_q6_k() {
        // Element e = 128·h + 32·s + l: low nibble in ql[64h + l + 32·(s%2)] (high nibble if
        // s ≥ 2), high 2 bits in qh[32h + l] at bit 2s; scale (i8) per 16 elements.
        let code = |e: usize| ((e * 29 + e / 11) % 64) as u8;
        let scale = |i: usize| (i as i32 * 17 - 120) as i8;
        let mut b = vec![0u8; 210];
        for e in 0..256 {
            let (hh, s, l) = (e / 128, (e % 128) / 32, e % 32);
            let c = code(e);
            b[64 * hh + l + 32 * (s % 2)] |= (c & 15) << (4 * (s / 2));
            b[128 + 32 * hh + l] |= (c >> 4) << (2 * s);
        }
        for i in 0..16 {
            b[192 + i] = scale(i) as u8;
        }
        b[208..210].copy_from_slice(&h(0.25));
        for (e, &v) in deq(QuantType::Q6_K, &b).iter().enumerate() {
            let want = 0.25 * scale(e / 16) as f32 * (code(e) as f32 - 32.0);
            assert_eq!(v, want, "e={e}");
        }
    }

    #[test]
    fn hand_built_iq4_xs() {
        let lut = [
            -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
        ];
        let sc6 = |s: usize| ((s * 19 + 3) % 64) as u16;
        let code = |e: usize| (e * 5 + e / 16) % 16;
        let mut b = vec![0u8; 136];
        b[0..2].copy_from_slice(&h(0.5));
        let mut scales_h = 0u16;
        for s in 0..8 {
            scales_h |= (sc6(s) >> 4) << (2 * s);
            b[4 + s / 2] |= ((sc6(s) & 15) as u8) << (4 * (s % 2));
        }
        b[2..4].copy_from_slice(&scales_h.to_le_bytes());
        // Sub-block s: 16 bytes at 8 + 16s; element j in the low nibble, j + 16 high.
        for e in 0..256 {
            let (s, j) = (e / 32, e % 32);
            b[8 + 16 * s + j % 16] |= (code(e) as u8) << (4 * (j / 16));
        }
        for (e, &v) in deq(QuantType::IQ4_XS, &b).iter().enumerate() {
            let want = 0.5 * (sc6(e / 32) as f32 - 32.0) * lut[code(e)] as f32;
            assert_eq!(v, want, "e={e}");
        }
    }

    #[test]
    fn float_types_pass_through() {
        let x = pseudo_random(64, 9);
        for ty in [QuantType::F32, QuantType::F16, QuantType::BF16] {
            let mut q = Vec::new();
            quantize_row(ty, &x, &mut q).unwrap();
            let y = deq(ty, &q);
            for (&a, &b) in x.iter().zip(&y) {
                let want = match ty {
                    QuantType::F32 => a,
                    QuantType::F16 => f16::from_f32(a).to_f32(),
                    _ => bf16::from_f32(a).to_f32(),
                };
                assert_eq!(b.to_bits(), want.to_bits());
            }
        }
    }

    // ---- (b) round trips.

    /// Input with a different magnitude per 256-element group, plus an all-zero block.
    fn test_row(n: usize, seed: u32) -> Vec<f32> {
        let mut x = pseudo_random(n, seed);
        for (i, v) in x.iter_mut().enumerate() {
            let group = i / 256;
            *v *= [1.0, 30.0, 1e-3, 4.0][group % 4];
        }
        for v in &mut x[64..96] {
            *v = 0.0;
        }
        x
    }

    fn round_trip(ty: QuantType, x: &[f32]) -> Vec<f32> {
        let mut q = Vec::new();
        quantize_row(ty, x, &mut q).unwrap();
        assert_eq!(q.len(), ty.row_bytes(x.len()).unwrap());
        let y = deq(ty, &q);
        assert!(y.iter().all(|v| v.is_finite()), "{ty}");
        y
    }

    #[test]
    fn q8_0_and_q4_0_round_trip_within_half_a_step() {
        let x = test_row(2048, 3);
        for (ty, levels) in [(QuantType::Q8_0, 127.0f32), (QuantType::Q4_0, 8.0)] {
            let y = round_trip(ty, &x);
            for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / levels;
                // Half a step, plus the f16 rounding of d times the largest code.
                let d16 = f16::from_f32(d).to_f32();
                let mut bound = 0.5 * d + levels * (d16 - d).abs() + 1e-30;
                if ty == QuantType::Q4_0 {
                    // The element opposite in sign to the absmax element, at full magnitude,
                    // would need code 16 and clamps to 15: a full step.
                    bound += 0.5 * d;
                }
                for (&a, &b) in xb.iter().zip(yb) {
                    assert!((a - b).abs() <= bound, "{ty}: {a} vs {b}, bound {bound}");
                }
            }
        }
    }

    /// RMS error relative to the RMS of the data, per 256-element group.
    fn rel_rmse(x: &[f32], y: &[f32]) -> f64 {
        let mut worst = 0.0f64;
        for (xb, yb) in x.chunks(256).zip(y.chunks(256)) {
            let e: f64 = xb
                .iter()
                .zip(yb)
                .map(|(&a, &b)| ((a - b) as f64).powi(2))
                .sum();
            let s: f64 = xb.iter().map(|&a| (a as f64).powi(2)).sum();
            if s > 0.0 {
                worst = worst.max((e / s).sqrt());
            }
        }
        worst
    }

    #[test]
    fn round_trip_relative_rmse_bounds() {
        // Uniform data in [-a, a]: a b-bit uniform quantizer over the block range has RMS
        // error ≈ step/√12 = 2a/(2^b − 1)/√12 against a data RMS of a/√3, i.e.
        // ≈ 1/(2^b − 1). The bounds below are that estimate with head room for scale
        // quantization (f16 / 6-bit sub-block scales) and clamping; measured values are
        // printed with `--nocapture`. Q6_K's bound is looser: in the 1e-3 group its
        // super-block scale d ≈ 2e-7 is an f16 subnormal, so the 8-bit sub-block scales
        // saturate and the largest elements clip (0.027 there, 0.013 in the other groups;
        // ggml's reference quantizer gives the same bytes).
        let x = test_row(4096, 11);
        let bounds = [
            (QuantType::Q8_0, 0.006),
            (QuantType::Q4_0, 0.09),
            (QuantType::Q4_1, 0.08),
            (QuantType::Q5_0, 0.045),
            (QuantType::Q5_1, 0.04),
            (QuantType::MXFP4, 0.20),
            (QuantType::Q2_K, 0.40),
            (QuantType::Q3_K, 0.20),
            (QuantType::Q4_K, 0.09),
            (QuantType::Q5_K, 0.045),
            (QuantType::Q6_K, 0.035),
        ];
        for (ty, bound) in bounds {
            let e = rel_rmse(&x, &round_trip(ty, &x));
            println!("{ty}: relative RMSE {e:.5} (bound {bound})");
            assert!(e < bound, "{ty}: relative RMSE {e} ≥ {bound}");
        }
    }

    #[test]
    fn zeros_quantize_to_zeros() {
        let x = vec![0.0f32; 512];
        for ty in QuantType::ALL.into_iter().filter(|t| t.can_quantize()) {
            assert!(round_trip(ty, &x).iter().all(|&v| v == 0.0), "{ty}");
        }
    }

    #[test]
    fn nearest_int_rounds_half_to_even() {
        for (x, want) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (3.49, 3),
        ] {
            assert_eq!(nearest_int(x), want, "{x}");
        }
    }

    // ---- (c) committed vectors from gguf-py (engine/tests/quant_vectors/generate.py).

    fn vector_file(name: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/quant_vectors")
            .join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn f32s(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    #[test]
    fn k_quants_match_ggml_reference_bytes() {
        let input = f32s(&vector_file("input.f32"));
        for ty in [
            QuantType::Q2_K,
            QuantType::Q3_K,
            QuantType::Q4_K,
            QuantType::Q5_K,
            QuantType::Q6_K,
        ] {
            let name = ty.name().to_lowercase();
            let want = vector_file(&format!("kquant_ref/{name}.q"));
            let mut ours = Vec::new();
            quantize_row(ty, &input, &mut ours).unwrap();
            assert_eq!(ours.len(), want.len(), "{name}");
            for (i, (a, b)) in ours.iter().zip(&want).enumerate() {
                assert_eq!(a, b, "{name} quantize byte {i}");
            }
        }
    }

    #[test]
    fn matches_gguf_py_vectors() {
        let manifest: serde_json::Value =
            serde_json::from_slice(&vector_file("manifest.json")).unwrap();
        let input = f32s(&vector_file("input.f32"));
        let types = manifest["types"].as_object().unwrap();
        assert_eq!(types.len(), 15);
        for (name, info) in types {
            let ty = QuantType::from_ggml_id(info["id"].as_u64().unwrap() as u32).unwrap();
            assert_eq!(ty.name().to_lowercase(), *name);
            let q = vector_file(&format!("{name}.q"));
            let want = f32s(&vector_file(&format!("{name}.deq.f32")));
            let got = deq(ty, &q);
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{name} dequantize element {i}: {g} vs {w}"
                );
            }
            if info["quantized_by_gguf_py"].as_bool().unwrap() {
                let mut ours = Vec::new();
                quantize_row(ty, &input, &mut ours).unwrap();
                assert_eq!(ours.len(), q.len(), "{name}");
                for (i, (a, b)) in ours.iter().zip(&q).enumerate() {
                    assert_eq!(a, b, "{name} quantize byte {i}");
                }
            }
        }
    }
}
