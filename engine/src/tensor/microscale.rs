//! OCP microscaling encodings as hub checkpoints ship them, and their exact repacking into
//! ggml's MXFP4 blocks.
//!
//! * **E8M0** (`ue8m0`, safetensors `F8_E8M0` or `U8`): a bare exponent byte, value
//!   `2^(byte − 127)`; `0xFF` is NaN. DeepSeek-V4 stores its FP8 block scales this way (under
//!   `<module>.scale`, `scale_fmt = "ue8m0"`), and every FP4 format below uses it per 32 values.
//! * **E2M1** (FP4): a 4-bit code indexing [`E2M1`] (`±{0, .5, 1, 1.5, 2, 3, 4, 6}`, code 8 is
//!   −0), two codes per byte, the **low nibble first** (element `2t` in the low nibble of byte
//!   `t`, element `2t + 1` in its high nibble).
//! * **Split FP4 matrices**: a matrix `[N, K]` stored as two tensors, the packed codes
//!   (`[N, K/2]` int8/uint8, or `[N, K/32, 16]` uint8) and one E8M0 scale per row per 32 values
//!   (`[N, K/32]`); element `(n, k)` is `E2M1[code] · 2^(scale[n, k/32] − 127)`. This is
//!   DeepSeek-V4's `expert_dtype = "fp4"` (`<module>.weight` + `<module>.scale`) and the
//!   per-expert form of gpt-oss's MXFP4 (`…_blocks` + `…_scales`).
//!
//! A split FP4 matrix is repacked into ggml's MXFP4 blocks ([`QuantType::MXFP4`]: the E8M0
//! byte, then 16 bytes holding element `j` in the low nibble of byte `j` and element `j + 16`
//! in the high nibble) by [`split_fp4_to_mxfp4`]. The repacking only moves nibbles and copies
//! the scale byte, so it is exact, and the size does not change (`K/2 + K/32` bytes per row
//! either way). ggml's MXFP4 value is `kvalues[code] · 2^(e − 127) / 2` with `kvalues` the
//! doubled code book, which equals `E2M1[code] · 2^(e − 127)` exactly in f32 for every code
//! and every `e < 255` (both factors are powers of two times a small integer, the products
//! are representable, including as subnormals for `e < 2`), with one exception: code 8 (−0)
//! dequantizes to +0. A ±0 weight adds a ±0 product to a dot product, which leaves every
//! nonzero sum unchanged and a zero sum at +0 in the f32 kernels, whose accumulators start at
//! +0. A scale byte of `0xFF` (NaN) is rejected: ggml would read it as `2^128`.
//!
//! Results: MXFP4 weights are computed by `tensor::qmatmul` by dequantizing each weight row
//! (the values above) and taking the f32 dot product of `tensor::kernels` in the canonical
//! order, so a split FP4 matrix gives the bits of an f32 matrix holding its dequantized
//! values.

use std::sync::Arc;

use super::quant::{BlockMxfp4, QuantType, QK32};
use super::{DType, Storage, Tensor};

/// The E2M1 code book: value of each 4-bit code (code 8 is −0).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The value of an E2M1 code (the low 4 bits of `code`).
pub fn e2m1_to_f32(code: u8) -> f32 {
    E2M1[(code & 0xf) as usize]
}

/// An E8M0 byte as f32: `2^(e − 127)`, exactly (`2^−127` for `e = 0` is subnormal); NaN for
/// `0xFF`.
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        0xff => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        e => f32::from_bits((e as u32) << 23),
    }
}

/// Repack one 16-byte group of 32 low-nibble-first E2M1 codes into ggml's MXFP4 order
/// (element `j` in the low nibble of byte `j`, element `j + 16` in the high nibble).
#[inline]
fn repack16(src: &[u8], dst: &mut [u8]) {
    const LO: u64 = 0x0f0f_0f0f_0f0f_0f0f;
    // Byte t of `a` holds elements 2t | 2t+1 << 4; byte t of `b` elements 16+2t | 17+2t << 4.
    let a = u64::from_le_bytes(src[..8].try_into().expect("16 bytes"));
    let b = u64::from_le_bytes(src[8..16].try_into().expect("16 bytes"));
    // Byte t: element 2t | element 2t+16 << 4, i.e. output byte 2t.
    let even = (a & LO) | ((b & LO) << 4);
    // Byte t: element 2t+1 | element 2t+17 << 4, i.e. output byte 2t+1.
    let odd = ((a >> 4) & LO) | (b & !LO);
    let (even, odd) = (even.to_le_bytes(), odd.to_le_bytes());
    for t in 0..8 {
        dst[2 * t] = even[t];
        dst[2 * t + 1] = odd[t];
    }
}

/// Repack a split FP4 matrix (`rows × cols`: `codes` holding `cols / 2` bytes per row, low
/// nibble first, and `scales` one E8M0 byte per row per 32 values) into the bytes of `rows`
/// rows of ggml MXFP4 blocks, in an aligned owned buffer. The error says which input is
/// wrong (lengths, or a NaN scale and where).
pub fn split_fp4_to_mxfp4(
    codes: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> std::result::Result<Storage, String> {
    if cols == 0 || !cols.is_multiple_of(QK32) {
        return Err(format!(
            "rows of {cols} FP4 values are not a whole number of 32-value blocks"
        ));
    }
    let blocks = cols / QK32;
    if codes.len() != rows * cols / 2 {
        return Err(format!(
            "codes: {} bytes, but {rows} rows of {cols} FP4 values need {}",
            codes.len(),
            rows * cols / 2
        ));
    }
    if scales.len() != rows * blocks {
        return Err(format!(
            "scales: {} bytes, but {rows} rows of {blocks} blocks need {}",
            scales.len(),
            rows * blocks
        ));
    }
    if let Some(i) = scales.iter().position(|&s| s == 0xff) {
        return Err(format!(
            "scale byte 0xFF (NaN in E8M0) at row {}, block {}",
            i / blocks,
            i % blocks
        ));
    }
    let len = rows * blocks * BlockMxfp4::BYTES;
    let mut words = vec![0u64; len.div_ceil(8)];
    let out = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..len];
    for ((dst, src), &e) in out
        .chunks_exact_mut(BlockMxfp4::BYTES)
        .zip(codes.chunks_exact(QK32 / 2))
        .zip(scales)
    {
        dst[0] = e;
        repack16(src, &mut dst[1..]);
    }
    Ok(Storage::Owned {
        words: Arc::new(words),
        len,
    })
}

/// A split FP4 matrix as an MXFP4 tensor named `name`, shape `[rows, cols]` (see
/// [`split_fp4_to_mxfp4`]).
pub fn split_fp4_tensor(
    name: &str,
    codes: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> std::result::Result<Tensor, String> {
    Ok(Tensor {
        name: name.to_string(),
        shape: vec![rows, cols],
        dtype: DType::Quant(QuantType::MXFP4),
        storage: split_fp4_to_mxfp4(codes, scales, rows, cols)?,
        block_scales: None,
        device: None,
        interleaved: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::quant::dequantize_row;

    /// The straightforward reading of the split format, element by element.
    fn reference(codes: &[u8], scales: &[u8], rows: usize, cols: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            for k in 0..cols {
                let byte = codes[r * cols / 2 + k / 2];
                let code = if k.is_multiple_of(2) {
                    byte & 0xf
                } else {
                    byte >> 4
                };
                out.push(e2m1_to_f32(code) * e8m0_to_f32(scales[r * cols / 32 + k / 32]));
            }
        }
        out
    }

    #[test]
    fn repacking_keeps_every_value() {
        let (rows, cols) = (3, 96);
        let mut s = 0x1234_5678_9abc_def0u64;
        let codes: Vec<u8> = (0..rows * cols / 2)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s as u8
            })
            .collect();
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|i| [0u8, 1, 2, 100, 127, 128, 200, 254, 3][i % 9])
            .collect();
        let want = reference(&codes, &scales, rows, cols);
        let packed = split_fp4_to_mxfp4(&codes, &scales, rows, cols).unwrap();
        let rb = QuantType::MXFP4.row_bytes(cols).unwrap();
        assert_eq!(packed.bytes().len(), rows * rb);
        assert_eq!(rb, cols / 2 + cols / 32, "same size as the split form");
        let mut got = vec![0.0f32; cols];
        for r in 0..rows {
            dequantize_row(
                QuantType::MXFP4,
                &packed.bytes()[r * rb..(r + 1) * rb],
                &mut got,
            )
            .unwrap();
            for (k, (g, w)) in got.iter().zip(&want[r * cols..(r + 1) * cols]).enumerate() {
                // −0 (code 8) becomes +0; every other value keeps its bits.
                assert!(
                    g.to_bits() == w.to_bits() || (*g == 0.0 && *w == 0.0),
                    "row {r} col {k}: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn nan_scales_and_bad_lengths_are_refused() {
        let codes = vec![0u8; 32];
        assert!(split_fp4_to_mxfp4(&codes, &[127, 0xff], 2, 32)
            .err()
            .unwrap()
            .contains("row 1, block 0"));
        assert!(split_fp4_to_mxfp4(&codes, &[127], 2, 32)
            .err()
            .unwrap()
            .contains("scales"));
        assert!(split_fp4_to_mxfp4(&codes[..31], &[127, 127], 2, 32)
            .err()
            .unwrap()
            .contains("codes"));
        assert!(split_fp4_to_mxfp4(&codes, &[127, 127], 1, 48).is_err());
    }
}
