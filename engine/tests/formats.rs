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

/// Qwen3.5/3.6 as the hub ships it: a vision-language config (`qwen3_5_moe`, the text model in
/// `text_config`) and the text model under `model.language_model.`, beside a vision tower and
/// MTP layers. It computes exactly what the text-only form computes, and `coli info`'s facts
/// say what was left out.
#[test]
fn qwen3_5_vision_language_checkpoint_runs_its_text_model() {
    let src = fixture("qwen3_5_moe");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    copy_text_files(&src, dir);
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let hub = serde_json::json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 8},
        "tie_word_embeddings": false,
    });
    std::fs::write(dir.join("config.json"), hub.to_string()).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = all_f32(&src)
        .into_iter()
        .map(|(name, shape, values)| {
            let name = match name.strip_prefix("model.") {
                Some(rest) => format!("model.language_model.{rest}"),
                None => name,
            };
            (name, shape, values)
        })
        .collect();
    tensors.push((
        "model.visual.patch_embed.weight".into(),
        vec![8, 12],
        vec![0.5; 96],
    ));
    tensors.push(("mtp.fc.weight".into(), vec![64, 128], vec![0.25; 64 * 128]));
    write_shards(dir, &tensors, 1, DType::F32);

    let ids = prompt("qwen3_5_moe");
    assert_eq!(bits(&logits(dir, &ids)), bits(&logits(&src, &ids)));
    let m = model::load(dir).unwrap();
    let info = m.info();
    assert_eq!(info.model_type, "qwen3_5_moe");
    assert_eq!(info.unused_bytes, 4 * (96 + 64 * 128));
    let skipped = info.skipped.join("; ");
    assert!(
        skipped.contains("vision tower") && skipped.contains("model.visual."),
        "{skipped}"
    );
    assert!(
        skipped.contains("multi-token-prediction") && skipped.contains("mtp."),
        "{skipped}"
    );
    let text_only = model::load(&src).unwrap();
    assert_eq!(
        info.dense_bytes,
        text_only.info().dense_bytes,
        "what is left out is not resident"
    );
}

/// MiniMax-M2 as released: partial RoPE given by the legacy `rotary_dim` instead of
/// `partial_rotary_factor` computes exactly the same.
#[test]
fn minimax_m2_legacy_rotary_dim_is_the_partial_rotary_factor() {
    let src = fixture("minimax_m2");
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    let path = tmp.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let factor = cfg["rope_parameters"]["partial_rotary_factor"]
        .as_f64()
        .unwrap();
    let head_dim = cfg["head_dim"].as_u64().unwrap();
    cfg["rope_parameters"]
        .as_object_mut()
        .unwrap()
        .remove("partial_rotary_factor");
    cfg["rotary_dim"] = ((factor * head_dim as f64) as u64).into();
    std::fs::write(&path, cfg.to_string()).unwrap();
    let ids = prompt("minimax_m2");
    assert_eq!(bits(&logits(tmp.path(), &ids)), bits(&logits(&src, &ids)));
    // Without either, the whole head would rotate: a different model.
    cfg.as_object_mut().unwrap().remove("rotary_dim");
    std::fs::write(&path, cfg.to_string()).unwrap();
    assert_ne!(bits(&logits(tmp.path(), &ids)), bits(&logits(&src, &ids)));
}
