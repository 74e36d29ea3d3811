//! DeepSeek-V4-Flash's native quantized checkpoints: routed experts in FP4 (`expert_dtype =
//! "fp4"`: `<module>.weight` int8 `[N, K/2]`, two E2M1 codes per byte, low nibble first, and
//! `<module>.scale` with one E8M0 byte per row per 32 values) and dense projections in FP8
//! E4M3 with E8M0 block scales under `<module>.scale` (`scale_fmt = "ue8m0"`). The loader
//! repacks FP4 matrices into ggml MXFP4 blocks (exactly) and decodes E8M0 scales exactly, so a
//! checkpoint in these formats gives bit for bit the logits of one holding its dequantized
//! values in f32, fully resident and streamed through the expert cache alike. Also the
//! per-expert gpt-oss MXFP4 form (`…_blocks` + `…_scales`) and the errors for missing or
//! corrupt scales.

mod common;
use common::{encode_e4m3, fixture, write_tensors};

use std::path::Path;

use colibri::format::safetensors::Checkpoint;
use colibri::model::{self, Logits};
use colibri::store::StoreOptions;
use colibri::tensor::microscale::{e2m1_to_f32, e8m0_to_f32};
use colibri::tensor::{f8e4m3_to_f32, DType};

/// The E2M1 code book, written out by hand from the format (code 8 is −0).
const E2M1_BY_HAND: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

#[test]
fn e2m1_codes_and_e8m0_scales_decode_exactly() {
    for (code, want) in E2M1_BY_HAND.iter().enumerate() {
        assert_eq!(
            e2m1_to_f32(code as u8).to_bits(),
            want.to_bits(),
            "E2M1 code {code}"
        );
    }
    assert!(e2m1_to_f32(8).is_sign_negative(), "code 8 is −0");
    // 2^(e − 127), by hand.
    for (e, want) in [
        (127u8, 1.0f32),
        (128, 2.0),
        (126, 0.5),
        (130, 8.0),
        (117, 0.000_976_562_5), // 2^-10
        (150, 8_388_608.0),     // 2^23
        (1, 1.175_494_4e-38),   // 2^-126, the smallest normal
        (254, 1.701_411_8e38),  // 2^127
    ] {
        assert_eq!(e8m0_to_f32(e).to_bits(), want.to_bits(), "E8M0 byte {e}");
    }
    assert_eq!(e8m0_to_f32(0).to_bits(), 0x0040_0000, "2^-127 is subnormal");
    assert!(e8m0_to_f32(255).is_nan(), "0xFF is NaN");
}

/// A 2×32 split FP4 matrix decodes element by element to the hand-computed values, through
/// both naming schemes (V4's `.weight` + `.scale`, gpt-oss's `_blocks` + `_scales`): the low
/// nibble is the first element.
#[test]
fn split_fp4_matrices_decode_low_nibble_first() {
    // Row 0: element k has code k % 16, scale byte 128 (×2). Row 1: code 15 − k % 16, scale
    // byte 125 (×1/4).
    let code = |r: usize, k: usize| if r == 0 { k % 16 } else { 15 - k % 16 } as u8;
    let packed: Vec<u8> = (0..2)
        .flat_map(|r| (0..16).map(move |t| code(r, 2 * t) | (code(r, 2 * t + 1) << 4)))
        .collect();
    let scales = vec![128u8, 125];
    #[rustfmt::skip]
    let row0 = [
        0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, -0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0,
    ];
    #[rustfmt::skip]
    let row1 = [
        -1.5, -1.0, -0.75, -0.5, -0.375, -0.25, -0.125, -0.0,
        1.5, 1.0, 0.75, 0.5, 0.375, 0.25, 0.125, 0.0,
    ];
    let want: Vec<f32> = row0
        .iter()
        .chain(&row0)
        .chain(&row1)
        .chain(&row1)
        .copied()
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    write_tensors(
        tmp.path(),
        vec![
            ("a.weight".into(), DType::I8, vec![2, 16], packed.clone()),
            ("a.scale".into(), DType::F8E8M0, vec![2, 1], scales.clone()),
            ("b_blocks".into(), DType::U8, vec![2, 1, 16], packed.clone()),
            ("b_scales".into(), DType::U8, vec![2, 1], scales.clone()),
        ],
    );
    for access in [
        colibri::format::safetensors::Access::Mapped,
        colibri::format::safetensors::Access::Read,
    ] {
        let ckpt = Checkpoint::open_with(tmp.path(), access).unwrap();
        for name in ["a.weight", "b_blocks"] {
            let t = ckpt.weight(name, &[2, 32]).unwrap();
            assert_eq!(t.shape, vec![2, 32]);
            assert_eq!(t.nbytes(), packed.len() + scales.len(), "no size change");
            let got = t.to_f32_vec().unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // Equal as numbers; −0 may come back as +0 (ggml's MXFP4 table has no −0).
                assert!(
                    g == w && (g.to_bits() == w.to_bits() || *w == 0.0),
                    "{name} element {i}: {g} vs {w}"
                );
            }
        }
    }
}

/// Nearest E2M1 code to `v` (ties to the smaller magnitude), by search.
fn encode_e2m1(v: f32) -> u8 {
    let mut best = 0u8;
    for c in 1u8..8 {
        if (E2M1_BY_HAND[c as usize] - v.abs()).abs()
            < (E2M1_BY_HAND[best as usize] - v.abs()).abs()
        {
            best = c;
        }
    }
    if v.is_sign_negative() {
        best | 8
    } else {
        best
    }
}

/// The smallest E8M0 byte `e` with `top · 2^(e−127) ≥ amax` (127 for an all-zero block).
fn scale_byte(amax: f32, top: f32) -> u8 {
    if amax == 0.0 {
        return 127;
    }
    let mut e = 0u8;
    while top * 2f32.powi(e as i32 - 127) < amax {
        e += 1;
    }
    e
}

fn is_dense_projection(name: &str) -> bool {
    [
        ".attn.wq_a.weight",
        ".attn.wq_b.weight",
        ".attn.wkv.weight",
        ".attn.wo_a.weight",
        ".attn.wo_b.weight",
    ]
    .iter()
    .any(|p| name.ends_with(p))
        || name.contains(".ffn.shared_experts.")
}

type Tensors = Vec<(String, DType, Vec<usize>, Vec<u8>)>;

/// An f32 tensor both forms hold unchanged.
fn keep_f32(quant: &mut Tensors, deq: &mut Tensors, name: &str, shape: &[usize], values: &[f32]) {
    let bytes = bytemuck::cast_slice::<f32, u8>(values).to_vec();
    quant.push((name.to_string(), DType::F32, shape.to_vec(), bytes.clone()));
    deq.push((name.to_string(), DType::F32, shape.to_vec(), bytes));
}

/// Row-major values (rows a whole number of 32-value blocks) as split FP4: the packed codes
/// (low nibble first), one E8M0 scale byte per 32 values (the largest magnitude at most
/// 6·scale), and the values they dequantize to.
fn fp4_rows(values: &[f32]) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    let mut codes = vec![0u8; values.len()];
    let mut scales = vec![0u8; values.len() / 32];
    let mut dq = vec![0.0f32; values.len()];
    for (b, s) in scales.iter_mut().enumerate() {
        let block = &values[b * 32..(b + 1) * 32];
        *s = scale_byte(block.iter().fold(0.0f32, |m, v| m.max(v.abs())), 6.0);
        let scale = 2f32.powi(*s as i32 - 127);
        for k in 0..32 {
            let c = encode_e2m1(block[k] / scale);
            codes[b * 32 + k] = c;
            dq[b * 32 + k] = E2M1_BY_HAND[c as usize] * scale;
        }
    }
    let packed = codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
    (packed, scales, dq)
}

/// `[rows, cols]` row-major → `[cols, rows]`.
fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| v[r * cols + c]))
        .collect()
}

/// The gpt_oss fixture (transformers' fused `x·W` experts: `gate_up_proj [E, D, 2I]` with
/// gate/up columns interleaved, `down_proj [E, I, D]`) as the hub ships it — MXFP4
/// `…_blocks [E, R, C/32, 16]` + `…_scales [E, R, C/32]` in the row layout, gate and up rows
/// interleaved — and in transformers' layout holding exactly the values that dequantizes to.
fn gpt_oss_tensors() -> (Tensors, Tensors) {
    let ckpt = Checkpoint::open(&fixture("gpt_oss")).unwrap();
    let (mut quant, mut deq) = (vec![], vec![]);
    let f32_bytes = |v: &[f32]| bytemuck::cast_slice::<f32, u8>(v).to_vec();
    for (name, d) in ckpt.tensors() {
        let values = ckpt.tensor_any_shape(name).unwrap().to_f32_vec().unwrap();
        let fused =
            name.ends_with(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj");
        if !fused {
            keep_f32(&mut quant, &mut deq, name, &d.shape, &values);
            continue;
        }
        // [E, C, R] in x·W: each expert's matrix is the transpose, [R, C].
        let (e, c, r) = (d.shape[0], d.shape[1], d.shape[2]);
        let (mut blocks, mut scales, mut dq_xw) = (vec![], vec![], vec![]);
        for x in values.chunks(c * r) {
            let (p, s, dq) = fp4_rows(&transpose(x, c, r));
            blocks.extend(p);
            scales.extend(s);
            dq_xw.extend(transpose(&dq, r, c));
        }
        quant.push((
            format!("{name}_blocks"),
            DType::U8,
            vec![e, r, c / 32, 16],
            blocks,
        ));
        quant.push((
            format!("{name}_scales"),
            DType::U8,
            vec![e, r, c / 32],
            scales,
        ));
        deq.push((name.clone(), DType::F32, d.shape.clone(), f32_bytes(&dq_xw)));
    }
    (quant, deq)
}

fn gpt_oss_logits(
    dir: &Path,
    opts: &StoreOptions,
) -> (Vec<u32>, Option<colibri::store::StoreSnapshot>) {
    let ids = common::prompt("gpt_oss");
    let m = model::load_with(dir, &colibri::model::LoadOptions::from(opts.clone()))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut cache = m.new_cache(ids.len());
    let out = m.forward(&ids, &mut cache, Logits::All).unwrap();
    (common::bits(&out), m.store_stats())
}

/// gpt-oss's hub MXFP4 experts (fused, rows interleaved) give bit for bit the logits of
/// transformers' fused `x·W` layout holding their dequantized values — resident, and
/// streamed with each expert's gate/up block read once; the expert bytes are the MXFP4
/// bytes (17 per 32 values).
#[test]
fn gpt_oss_mxfp4_experts_equal_their_dequantization_resident_and_streamed() {
    let tmp = tempfile::tempdir().unwrap();
    let (quant_dir, deq_dir) = (tmp.path().join("mxfp4"), tmp.path().join("deq"));
    let (quant, deq) = gpt_oss_tensors();
    for (dir, tensors) in [(&quant_dir, quant), (&deq_dir, deq)] {
        write_tensors(dir, tensors);
        common::copy_text_files(&fixture("gpt_oss"), dir);
    }
    let want = gpt_oss_logits(&deq_dir, &StoreOptions::default()).0;
    let resident = gpt_oss_logits(&quant_dir, &StoreOptions::default()).0;
    assert!(
        resident == want,
        "MXFP4 experts differ from their dequantization"
    );
    let original = gpt_oss_logits(&fixture("gpt_oss"), &StoreOptions::default()).0;
    assert!(original != want, "quantization changed nothing?");

    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(quant_dir.join("config.json")).unwrap())
            .unwrap();
    let n = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let per_expert = 3 * n("hidden_size") * n("intermediate_size") / 32 * 17;
    let info = model::load(&quant_dir).unwrap().info().clone();
    assert_eq!(
        info.routed_expert_bytes,
        n("num_hidden_layers") * n("num_local_experts") * per_expert
    );
    // Packed codes hold two parameters a byte, their scales none: both forms hold as many.
    let deq_info = model::load(&deq_dir).unwrap().info().clone();
    assert_eq!(info.total_params, deq_info.total_params);
    assert_eq!(info.active_params, deq_info.active_params);
    assert!(info.active_params < info.total_params);
    assert_eq!(
        info.dense_bytes,
        Checkpoint::open(&quant_dir).unwrap().total_bytes() - info.routed_expert_bytes
    );
    for (threads, prefetch) in [(0, false), (2, true)] {
        let opts = StoreOptions {
            ram_budget: Some(info.dense_bytes as u64 + 4 * per_expert as u64),
            io_threads: threads,
            prefetch,
            learn: false,
            ..StoreOptions::default()
        };
        let (bits, stats) = gpt_oss_logits(&quant_dir, &opts);
        let stats = stats.expect("a streaming store");
        assert!(
            bits == want,
            "streamed MXFP4 experts changed the logits (threads {threads}, prefetch {prefetch})"
        );
        assert!(stats.bytes_read > 0, "nothing was streamed");
        // Each read expert costs its own bytes: gate and up share one block, read once.
        assert_eq!(stats.bytes_read as usize % per_expert, 0, "{stats:?}");
        assert!(
            stats.bytes_read as usize
                <= (stats.misses as usize + stats.prefetch_reads as usize) * per_expert,
            "{stats:?}"
        );
    }
}

/// The deepseek_v4 fixture as V4-Flash ships it (routed experts FP4, attention and shared
/// experts FP8 with E8M0 block scales; every scale naming and encoding variant appears) and
/// as the exact f32 dequantization of that.
fn v4_tensors() -> (Tensors, Tensors) {
    let ckpt = Checkpoint::open(&fixture("deepseek_v4")).unwrap();
    let (mut quant, mut deq) = (vec![], vec![]);
    let f32_bytes = |v: &[f32]| bytemuck::cast_slice::<f32, u8>(v).to_vec();
    for (i, (name, d)) in ckpt.tensors().iter().enumerate() {
        let t = ckpt.tensor_any_shape(name).unwrap();
        if d.dtype != DType::F32 {
            let bytes = t.storage.bytes().to_vec();
            quant.push((name.clone(), d.dtype, d.shape.clone(), bytes.clone()));
            deq.push((name.clone(), d.dtype, d.shape.clone(), bytes));
            continue;
        }
        let values = t.to_f32_vec().unwrap();
        let module = name.strip_suffix(".weight").unwrap_or(name);
        if name.contains(".ffn.experts.") {
            let (rows, cols) = (d.shape[0], d.shape[1]);
            let (packed, scales, dq) = fp4_rows(&values);
            // V4 stores int8; uint8 (as gpt-oss) is the same bytes.
            let dtype = if i.is_multiple_of(2) {
                DType::I8
            } else {
                DType::U8
            };
            quant.push((name.clone(), dtype, vec![rows, cols / 2], packed));
            quant.push((
                format!("{module}.scale"),
                DType::F8E8M0,
                vec![rows, cols / 32],
                scales,
            ));
            deq.push((name.clone(), DType::F32, d.shape.clone(), f32_bytes(&dq)));
        } else if is_dense_projection(name) {
            // FP8 E4M3 with power-of-two block scales (128×128 blocks).
            let (rows, cols) = (d.shape[0], d.shape[1]);
            let (br, bc) = (rows.div_ceil(128), cols.div_ceil(128));
            let mut amax = vec![0.0f32; br * bc];
            for r in 0..rows {
                for c in 0..cols {
                    let a = &mut amax[(r / 128) * bc + c / 128];
                    *a = a.max(values[r * cols + c].abs());
                }
            }
            let scales: Vec<u8> = amax.iter().map(|&a| scale_byte(a, 448.0)).collect();
            let mut codes = vec![0u8; rows * cols];
            let mut dq = vec![0.0f32; rows * cols];
            for r in 0..rows {
                for c in 0..cols {
                    let s = 2f32.powi(scales[(r / 128) * bc + c / 128] as i32 - 127);
                    let code = encode_e4m3(values[r * cols + c] / s);
                    codes[r * cols + c] = code;
                    dq[r * cols + c] = f8e4m3_to_f32(code) * s;
                }
            }
            quant.push((name.clone(), DType::F8E4M3, d.shape.clone(), codes));
            // V4's form (`.scale`, F8_E8M0) and the other namings and encodings.
            let (scale_name, dtype, bytes) = match i % 4 {
                0 => (format!("{module}.scale"), DType::F8E8M0, scales),
                1 => (format!("{module}.scale"), DType::U8, scales),
                2 => (format!("{name}_scale_inv"), DType::F8E8M0, scales),
                _ => {
                    let f: Vec<f32> = scales.iter().map(|&e| 2f32.powi(e as i32 - 127)).collect();
                    (format!("{module}.scale"), DType::F32, f32_bytes(&f))
                }
            };
            quant.push((scale_name, dtype, vec![br, bc], bytes));
            deq.push((name.clone(), DType::F32, d.shape.clone(), f32_bytes(&dq)));
        } else {
            keep_f32(&mut quant, &mut deq, name, &d.shape, &values);
        }
    }
    (quant, deq)
}

/// Write `tensors` as a model directory with the fixture's config (plus V4's quantization
/// fields when `quantized`).
fn write_model(dir: &Path, tensors: Tensors, quantized: bool) {
    let src = fixture("deepseek_v4");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    if quantized {
        cfg["expert_dtype"] = "fp4".into();
        cfg["quantization_config"] = serde_json::json!({
            "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic", "weight_block_size": [128, 128]
        });
    }
    write_tensors(dir, tensors);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
}

fn logits(dir: &Path, opts: &StoreOptions) -> (Vec<u32>, Option<u64>) {
    let ids = common::prompt("deepseek_v4");
    let m = model::load_with(dir, &colibri::model::LoadOptions::from(opts.clone()))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut cache = m.new_cache(ids.len());
    let out = m.forward(&ids, &mut cache, Logits::All).unwrap();
    (common::bits(&out), m.store_stats().map(|s| s.bytes_read))
}

#[test]
fn v4_fp4_and_fp8_checkpoint_equals_its_dequantization_resident_and_streamed() {
    let tmp = tempfile::tempdir().unwrap();
    let (quant_dir, deq_dir) = (tmp.path().join("v4"), tmp.path().join("deq"));
    let (quant, deq) = v4_tensors();
    assert!(quant.iter().any(|t| t.1 == DType::I8) && quant.iter().any(|t| t.1 == DType::U8));
    // Code 8 (−0), which MXFP4 blocks read as +0, occurs.
    assert!(quant
        .iter()
        .filter(|t| t.0.contains(".ffn.experts.") && t.0.ends_with(".weight"))
        .any(|t| t.3.iter().any(|&b| b & 0xf == 8 || b >> 4 == 8)));
    write_model(&quant_dir, quant, true);
    write_model(&deq_dir, deq, false);

    let resident = logits(&quant_dir, &StoreOptions::default());
    let want = logits(&deq_dir, &StoreOptions::default());
    assert!(
        resident.0 == want.0,
        "FP4/FP8 checkpoint differs from its dequantization"
    );
    let original = logits(&fixture("deepseek_v4"), &StoreOptions::default());
    assert!(original.0 != resident.0, "quantization changed nothing?");

    // Expert bytes are the codes and their scales: 17 bytes per 32 values, in both stores.
    let cfg = |k: &str| {
        let c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(quant_dir.join("config.json")).unwrap())
                .unwrap();
        c[k].as_u64().unwrap() as usize
    };
    let expert_values = cfg("num_hidden_layers")
        * cfg("n_routed_experts")
        * 3
        * cfg("hidden_size")
        * cfg("moe_intermediate_size");
    let info = model::load(&quant_dir).unwrap().info().clone();
    assert_eq!(info.routed_expert_bytes, expert_values / 32 * 17);
    let total = Checkpoint::open(&quant_dir).unwrap().total_bytes();
    assert_eq!(info.dense_bytes, total - info.routed_expert_bytes);

    for (threads, prefetch) in [(0, false), (2, true)] {
        let opts = StoreOptions {
            ram_budget: Some(info.dense_bytes as u64),
            io_threads: threads,
            prefetch,
            learn: false,
            ..StoreOptions::default()
        };
        let m =
            model::load_with(&quant_dir, &colibri::model::LoadOptions::from(opts.clone())).unwrap();
        assert_eq!(m.info().routed_expert_bytes, info.routed_expert_bytes);
        assert_eq!(m.info().dense_bytes, info.dense_bytes);
        drop(m);
        let streamed = logits(&quant_dir, &opts);
        assert!(streamed.1.unwrap_or(0) > 0, "nothing was streamed");
        assert!(
            streamed.0 == want.0,
            "streamed FP4 experts changed the logits (threads {threads}, prefetch {prefetch})"
        );
    }
}

/// The V4 checkpoint with `edit` applied to each tensor (`None` drops it).
fn edited_v4(
    dir: &Path,
    edit: impl Fn(&str, DType, &[usize], &[u8]) -> Option<(DType, Vec<usize>, Vec<u8>)>,
) {
    let (quant, _) = v4_tensors();
    let tensors = quant
        .into_iter()
        .filter_map(|(name, dtype, shape, bytes)| {
            edit(&name, dtype, &shape, &bytes).map(|(d, s, b)| (name, d, s, b))
        })
        .collect();
    write_model(dir, tensors, true);
}

fn keep(_: &str, d: DType, s: &[usize], b: &[u8]) -> Option<(DType, Vec<usize>, Vec<u8>)> {
    Some((d, s.to_vec(), b.to_vec()))
}

fn load_error(dir: &Path, opts: &StoreOptions) -> String {
    model::load_with(dir, &colibri::model::LoadOptions::from(opts.clone()))
        .err()
        .expect("loading must fail")
        .to_string()
}

fn streaming() -> StoreOptions {
    StoreOptions {
        ram_budget: Some(1 << 30),
        learn: false,
        ..StoreOptions::default()
    }
}

#[test]
fn missing_or_corrupt_scales_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let expert = "model.layers.2.ffn.experts.5.w2";

    // A routed expert's FP4 scales missing: named at load, resident or streamed.
    let dir = tmp.path().join("no_fp4_scale");
    let drop_scale = format!("{expert}.scale");
    edited_v4(&dir, |n, d, s, b| {
        (n != drop_scale).then(|| keep(n, d, s, b)).flatten()
    });
    for opts in [StoreOptions::default(), streaming()] {
        let e = load_error(&dir, &opts);
        assert!(
            e.contains(&format!("{expert}.weight"))
                && e.contains(&drop_scale)
                && e.contains("missing"),
            "{e}"
        );
    }

    // FP4 scales of the wrong shape, or not bytes.
    for (dtype, shape) in [(DType::U8, vec![64, 2]), (DType::F32, vec![64, 1])] {
        let dir = tmp.path().join(format!("bad_fp4_scale_{dtype}"));
        let target = drop_scale.clone();
        let (dt, sh) = (dtype, shape.clone());
        edited_v4(&dir, move |n, d, s, b| {
            if n == target {
                let len = sh.iter().product::<usize>() * dt.size();
                Some((dt, sh.clone(), vec![127; len]))
            } else {
                keep(n, d, s, b)
            }
        });
        for opts in [StoreOptions::default(), streaming()] {
            let e = load_error(&dir, &opts);
            assert!(
                e.contains(&drop_scale) && e.contains("[64, 1]") && e.contains("F8_E8M0"),
                "{e}"
            );
        }
    }

    // A NaN scale byte (0xFF) in every layer-2 expert's gate: named when it is read (at load
    // when resident, when the expert is first streamed otherwise).
    let dir = tmp.path().join("nan_fp4_scale");
    edited_v4(&dir, |n, d, s, b| {
        let mut b = b.to_vec();
        if n.starts_with("model.layers.2.ffn.experts.") && n.ends_with(".w1.scale") {
            b[3] = 0xff;
        }
        Some((d, s.to_vec(), b))
    });
    let e = load_error(&dir, &StoreOptions::default());
    assert!(
        e.contains("model.layers.2.ffn.experts.") && e.contains(".w1.scale") && e.contains("0xFF"),
        "{e}"
    );
    let m = model::load_with(&dir, &colibri::model::LoadOptions::from(streaming())).unwrap();
    let ids = common::prompt("deepseek_v4");
    let mut cache = m.new_cache(ids.len());
    let e = m
        .forward(&ids, &mut cache, Logits::All)
        .expect_err("the corrupt expert must not compute")
        .to_string();
    assert!(
        e.contains("model.layers.2.ffn.experts.") && e.contains(".w1.scale") && e.contains("0xFF"),
        "{e}"
    );

    // FP8 dense weights: scales missing, NaN.
    let wq = "model.layers.1.attn.wq_a";
    let dir = tmp.path().join("no_fp8_scale");
    edited_v4(&dir, |n, d, s, b| {
        (!n.starts_with(&format!("{wq}.weight_")) && n != format!("{wq}.scale"))
            .then(|| keep(n, d, s, b))
            .flatten()
    });
    let e = load_error(&dir, &StoreOptions::default());
    assert!(
        e.contains(&format!("{wq}.weight"))
            && e.contains(&format!("{wq}.scale"))
            && e.contains("missing"),
        "{e}"
    );
    let dir = tmp.path().join("nan_fp8_scale");
    edited_v4(&dir, |n, d, s, b| {
        if n.starts_with(wq) && d != DType::F8E4M3 {
            Some((DType::U8, s.to_vec(), vec![0xff; s.iter().product()]))
        } else {
            keep(n, d, s, b)
        }
    });
    let e = load_error(&dir, &StoreOptions::default());
    assert!(e.contains(wq) && e.contains("0xFF"), "{e}");
}
