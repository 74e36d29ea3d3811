//! FP8 (E4M3) checkpoints with 128×128 block scales (`weight_scale_inv`), as DeepSeek-V3 and
//! its descendants ship them: the llama fixture's projections quantized to FP8 load and run,
//! give bit for bit the logits of a checkpoint holding the dequantized values (`f8 · scale`
//! in f32, the way transformers dequantizes), and stay close to transformers' f32 logits.

mod common;
use common::{encode_e4m3, fixture, mean_abs_diff, reference_json, write_specs};

use std::path::{Path, PathBuf};

use colibri::format::safetensors::Checkpoint;
use colibri::format::write::TensorSpec;
use colibri::model::{self, Logits};
use colibri::tensor::{f8e4m3_to_f32, DType};

const BLOCK: usize = 128;

fn is_projection(name: &str) -> bool {
    [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    .iter()
    .any(|p| name.ends_with(&format!("{p}.weight")))
}

/// The fixture `arch` written as FP8 and as its exact dequantization in f32 into a temporary
/// directory: the directory (removed when dropped) and the two checkpoints.
fn fp8_and_dequantized(arch: &str) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (fp8, deq) = (tmp.path().join("fp8"), tmp.path().join("deq"));
    write_fp8_and_dequantized(&fixture(arch), &fp8, &deq);
    (tmp, fp8, deq)
}

/// Write the fixture as FP8 (`fp8`) and as its exact dequantization in f32 (`deq`).
fn write_fp8_and_dequantized(src: &Path, fp8: &Path, deq: &Path) {
    let ckpt = Checkpoint::open(src).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    std::fs::create_dir_all(fp8).unwrap();
    std::fs::create_dir_all(deq).unwrap();
    std::fs::write(deq.join("config.json"), cfg.to_string()).unwrap();
    cfg["quantization_config"] = serde_json::json!({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK]
    });
    std::fs::write(fp8.join("config.json"), cfg.to_string()).unwrap();
    let (mut fp8_specs, mut fp8_data, mut deq_specs, mut deq_data) =
        (vec![], vec![], vec![], vec![]);
    for (name, d) in ckpt.tensors() {
        let t = ckpt.tensor_any_shape(name).unwrap();
        let values = t.to_f32_vec().unwrap();
        if !is_projection(name) {
            for (specs, data) in [
                (&mut fp8_specs, &mut fp8_data),
                (&mut deq_specs, &mut deq_data),
            ] {
                specs.push(TensorSpec {
                    name: name.clone(),
                    dtype: DType::F32,
                    shape: d.shape.clone(),
                });
                data.push(bytemuck::cast_slice::<f32, u8>(&values).to_vec());
            }
            continue;
        }
        let (rows, cols) = (d.shape[0], d.shape[1]);
        let (br, bc) = (rows.div_ceil(BLOCK), cols.div_ceil(BLOCK));
        let mut scales = vec![0.0f32; br * bc];
        for i in 0..rows {
            for j in 0..cols {
                let s = &mut scales[(i / BLOCK) * bc + j / BLOCK];
                *s = s.max(values[i * cols + j].abs() / 448.0);
            }
        }
        for s in &mut scales {
            if *s == 0.0 {
                *s = 1.0;
            }
        }
        let mut codes = vec![0u8; rows * cols];
        let mut dq = vec![0.0f32; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                let s = scales[(i / BLOCK) * bc + j / BLOCK];
                codes[i * cols + j] = encode_e4m3(values[i * cols + j] / s);
                dq[i * cols + j] = f8e4m3_to_f32(codes[i * cols + j]) * s;
            }
        }
        fp8_specs.push(TensorSpec {
            name: name.clone(),
            dtype: DType::F8E4M3,
            shape: vec![rows, cols],
        });
        fp8_data.push(codes);
        fp8_specs.push(TensorSpec {
            name: format!("{name}_scale_inv"),
            dtype: DType::F32,
            shape: vec![br, bc],
        });
        fp8_data.push(bytemuck::cast_slice::<f32, u8>(&scales).to_vec());
        deq_specs.push(TensorSpec {
            name: name.clone(),
            dtype: DType::F32,
            shape: vec![rows, cols],
        });
        deq_data.push(bytemuck::cast_slice::<f32, u8>(&dq).to_vec());
    }
    write_specs(fp8, fp8_specs, fp8_data);
    write_specs(deq, deq_specs, deq_data);
}

#[test]
fn e4m3_decoding_follows_the_ocp_format() {
    assert_eq!(f8e4m3_to_f32(0x00), 0.0);
    assert_eq!(f8e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
    assert_eq!(f8e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
    assert_eq!(f8e4m3_to_f32(0x38), 1.0);
    assert_eq!(f8e4m3_to_f32(0x3c), 1.5);
    assert_eq!(f8e4m3_to_f32(0x7e), 448.0); // largest finite
    assert_eq!(f8e4m3_to_f32(0xfe), -448.0);
    assert!(f8e4m3_to_f32(0x7f).is_nan() && f8e4m3_to_f32(0xff).is_nan());
    // Monotone over the positive codes, so the nearest-code search above is meaningful.
    for c in 1u8..=0x7e {
        assert!(f8e4m3_to_f32(c) > f8e4m3_to_f32(c - 1), "code {c:#x}");
    }
}

#[test]
fn fp8_checkpoint_equals_its_dequantization_and_stays_near_transformers() {
    let (_tmp, fp8, deq) = fp8_and_dequantized("llama");
    let r = reference_json("llama");
    let ids = common::ids(&r, "prompt_ids");
    let want = common::reference_logits("llama");
    let run = |dir: &Path| {
        let m = model::load(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let mut cache = m.new_cache(ids.len());
        m.forward(&ids, &mut cache, Logits::All).unwrap()
    };
    let got = run(&fp8);
    assert_eq!(
        common::bits(&got),
        common::bits(&run(&deq)),
        "FP8 path differs from its dequantization"
    );
    let mean = mean_abs_diff(&got, &want);
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    assert!(mean > 0.0, "FP8 changed nothing?");
    assert!(
        mean < 0.05 * scale,
        "mean |Δlogit| {mean} against transformers (scale {scale})"
    );
}

#[test]
fn fp8_weight_without_scales_is_a_clear_error() {
    let (_tmp, fp8, _) = fp8_and_dequantized("llama");
    // Rewrite the FP8 checkpoint without one scale tensor.
    let ckpt = Checkpoint::open(&fp8).unwrap();
    let drop = "model.layers.0.self_attn.q_proj.weight_scale_inv";
    let mut specs = vec![];
    let mut data = vec![];
    for (name, d) in ckpt.tensors() {
        if name == drop {
            continue;
        }
        specs.push(TensorSpec {
            name: name.clone(),
            dtype: d.dtype,
            shape: d.shape.clone(),
        });
        data.push(
            ckpt.tensor_any_shape(name)
                .unwrap()
                .storage
                .bytes()
                .to_vec(),
        );
    }
    write_specs(&fp8, specs, data);
    let e = model::load(&fp8).err().expect("must fail").to_string();
    assert!(
        e.contains("q_proj.weight") && e.contains("scale_inv"),
        "{e}"
    );
}

/// FP8 routed experts stream through the tiered store (their scales stay resident) with the
/// bits of the fully resident model.
#[test]
fn fp8_experts_stream_with_identical_bits() {
    use colibri::store::StoreOptions;
    let (_tmp, fp8, _) = fp8_and_dequantized("mixtral");
    let ids = common::prompt("mixtral");
    let run = |opts: &StoreOptions| {
        let m = model::load_with(&fp8, &colibri::model::LoadOptions::from(opts.clone())).unwrap();
        let mut cache = m.new_cache(ids.len());
        let logits = m.forward(&ids, &mut cache, Logits::All).unwrap();
        (common::bits(&logits), m.store_stats().map(|s| s.bytes_read))
    };
    let resident = run(&StoreOptions::default());
    let info = model::load(&fp8).unwrap().info().clone();
    let streamed = run(&StoreOptions {
        ram_budget: Some(info.dense_bytes as u64),
        learn: false,
        ..StoreOptions::default()
    });
    assert!(streamed.1.unwrap_or(0) > 0, "nothing was streamed");
    assert!(
        resident.0 == streamed.0,
        "streamed FP8 experts changed the logits"
    );
}
