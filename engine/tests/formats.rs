//! Loading what people have: sharded safetensors, bf16 and f16 weights, and both forms of
//! RoPE configuration. Each variant is made from a committed fixture and must give exactly
//! the logits its content implies.

mod common;
use common::{bits, copy_text_files, fixture, prompt};

use std::path::Path;

use colibri::format::safetensors::Checkpoint;
use colibri::format::write::{SafetensorsWriter, TensorSpec};
use colibri::model::{self, Logits};
use colibri::tensor::DType;
use half::{bf16, f16};

fn logits(dir: &Path, ids: &[u32]) -> Vec<f32> {
    let m = model::load(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut cache = m.new_cache(ids.len());
    m.forward(ids, &mut cache, Logits::All).unwrap()
}

/// Every tensor of `src` as f32 values, in name order.
fn all_f32(src: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let ck = Checkpoint::open(src).unwrap();
    ck.tensors()
        .keys()
        .map(|name| {
            let t = ck.tensor_any_shape(name).unwrap();
            (name.clone(), t.shape.clone(), t.to_f32_vec().unwrap())
        })
        .collect()
}

/// Write tensors into `files` shards, converting float tensors with `conv`.
fn write_shards(
    dir: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    files: usize,
    dtype: DType,
) {
    let per = tensors.len().div_ceil(files);
    let mut map = serde_json::Map::new();
    for (i, chunk) in tensors.chunks(per).enumerate() {
        let name = if files == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, files)
        };
        let specs = chunk
            .iter()
            .map(|(n, s, _)| TensorSpec {
                name: n.clone(),
                dtype,
                shape: s.clone(),
            })
            .collect();
        let mut w = SafetensorsWriter::create(&dir.join(&name), specs).unwrap();
        for (n, _, vals) in chunk {
            map.insert(n.clone(), name.clone().into());
            let bytes: Vec<u8> = match dtype {
                DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
                DType::BF16 => vals
                    .iter()
                    .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                    .collect(),
                DType::F16 => vals
                    .iter()
                    .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                    .collect(),
                _ => unreachable!(),
            };
            w.write(&bytes).unwrap();
        }
        w.finish().unwrap();
    }
    if files > 1 {
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

#[test]
fn sharded_checkpoint_gives_identical_logits() {
    for arch in ["olmoe", "qwen3_moe"] {
        let tmp = tempfile::tempdir().unwrap();
        copy_text_files(&fixture(arch), tmp.path());
        write_shards(tmp.path(), &all_f32(&fixture(arch)), 3, DType::F32);
        assert!(tmp.path().join("model-00003-of-00003.safetensors").exists());
        let ids = prompt(arch);
        assert_eq!(
            bits(&logits(tmp.path(), &ids)),
            bits(&logits(&fixture(arch), &ids)),
            "{arch}"
        );
    }
}

#[test]
fn half_precision_weights_compute_exactly_their_values() {
    // A bf16 (f16) checkpoint must give the same bits as an f32 checkpoint holding the same
    // rounded values: the kernels widen half floats exactly and sum in the same order.
    for (dtype, round) in [
        (
            DType::BF16,
            (|v: f32| bf16::from_f32(v).to_f32()) as fn(f32) -> f32,
        ),
        (DType::F16, |v: f32| f16::from_f32(v).to_f32()),
    ] {
        let arch = "mixtral";
        let rounded: Vec<_> = all_f32(&fixture(arch))
            .into_iter()
            .map(|(n, s, v)| (n, s, v.into_iter().map(round).collect::<Vec<f32>>()))
            .collect();
        let half_dir = tempfile::tempdir().unwrap();
        let f32_dir = tempfile::tempdir().unwrap();
        for d in [&half_dir, &f32_dir] {
            copy_text_files(&fixture(arch), d.path());
        }
        write_shards(half_dir.path(), &rounded, 1, dtype);
        write_shards(f32_dir.path(), &rounded, 1, DType::F32);
        let ids = prompt(arch);
        let a = logits(half_dir.path(), &ids);
        let b = logits(f32_dir.path(), &ids);
        assert_eq!(bits(&a), bits(&b), "{dtype}");
        // And rounding really changed the weights (the test would be empty otherwise).
        assert_ne!(bits(&a), bits(&logits(&fixture(arch), &ids)), "{dtype}");
    }
}

#[test]
fn old_rope_config_form_is_equivalent() {
    let arch = "llama";
    let tmp = tempfile::tempdir().unwrap();
    copy_text_files(&fixture(arch), tmp.path());
    std::fs::copy(
        fixture(arch).join("model.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    let p = tmp.path().join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let rp = v
        .as_object_mut()
        .unwrap()
        .remove("rope_parameters")
        .expect("v5 config has rope_parameters");
    v["rope_theta"] = rp["rope_theta"].clone();
    let mut scaling = rp.clone();
    scaling.as_object_mut().unwrap().remove("rope_theta");
    if let Some(t) = scaling.as_object_mut().unwrap().remove("rope_type") {
        scaling["type"] = t;
    }
    v["rope_scaling"] = scaling;
    std::fs::write(&p, v.to_string()).unwrap();
    let ids = prompt(arch);
    assert_eq!(
        bits(&logits(tmp.path(), &ids)),
        bits(&logits(&fixture(arch), &ids))
    );
}
