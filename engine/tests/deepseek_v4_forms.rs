//! DeepSeek-V4 checkpoints as the hub ships them: the legacy config keys transformers folds
//! into its modern form (`compress_ratios`, `compress_rate_*`, `num_hash_layers`,
//! `qk_rope_head_dim`, `rope_theta` + `compress_rope_theta` + a flat yarn `rope_scaling`), and
//! the hub's tensor names (no `model.` prefix, `embed`, `norm`, `hc_head_*`). Both load to
//! exactly the logits of the transformers-saved fixture.

mod common;
use common::{bits, fixture, prompt};

use std::path::Path;

use colibri::format::safetensors::Checkpoint;
use colibri::format::write::{SafetensorsWriter, TensorSpec};
use colibri::model::{self, Logits};

fn logits(dir: &Path) -> Vec<f32> {
    let m = model::load(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let ids = prompt("deepseek_v4");
    let mut cache = m.new_cache(ids.len());
    m.forward(&ids, &mut cache, Logits::All).unwrap()
}

/// A copy of the fixture with `config.json` replaced and every tensor renamed by `rename`.
fn copy(to: &Path, config: &serde_json::Value, rename: impl Fn(&str) -> String) {
    let src = fixture("deepseek_v4");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), to.join(f)).unwrap();
    }
    std::fs::write(to.join("config.json"), config.to_string()).unwrap();
    let ck = Checkpoint::open(&src).unwrap();
    let names: Vec<String> = ck.tensors().keys().cloned().collect();
    let specs = names
        .iter()
        .map(|n| {
            let d = ck.desc(n).unwrap();
            TensorSpec {
                name: rename(n),
                dtype: d.dtype,
                shape: d.shape.clone(),
            }
        })
        .collect();
    let mut w = SafetensorsWriter::create(&to.join("model.safetensors"), specs).unwrap();
    for n in &names {
        w.write(ck.tensor_any_shape(n).unwrap().storage.bytes())
            .unwrap();
    }
    w.finish().unwrap();
}

fn fixture_config() -> serde_json::Value {
    serde_json::from_str(
        &std::fs::read_to_string(fixture("deepseek_v4").join("config.json")).unwrap(),
    )
    .unwrap()
}

#[test]
fn legacy_config_keys_load_as_the_modern_form() {
    let want = logits(&fixture("deepseek_v4"));
    let mut c = fixture_config();
    let o = c.as_object_mut().unwrap();
    for k in [
        "layer_types",
        "mlp_layer_types",
        "compress_rates",
        "rope_parameters",
        "partial_rotary_factor",
    ] {
        o.remove(k);
    }
    // The fixture is HCA, CSA, sliding, CSA with HCA windows of 8 tokens, 2 hash layers,
    // 8 rope dims of 32, compress yarn factor 4 over 64 positions.
    o.insert("compress_ratios".into(), serde_json::json!([128, 4, 0, 4]));
    o.insert("compress_rate_hca".into(), 8.into());
    o.insert("num_hash_layers".into(), 2.into());
    o.insert("qk_rope_head_dim".into(), 8.into());
    o.insert("rope_theta".into(), 10000.0.into());
    o.insert("compress_rope_theta".into(), 160000.0.into());
    o.insert(
        "rope_scaling".into(),
        serde_json::json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32.0, "beta_slow": 1.0}),
    );
    let dir = tempfile::tempdir().unwrap();
    copy(dir.path(), &c, |n| n.to_string());
    assert_eq!(bits(&logits(dir.path())), bits(&want));

    // A wrong ratio is named.
    c["compress_ratios"] = serde_json::json!([128, 4, 0, 5]);
    std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
    let err = model::load(dir.path()).err().expect("refused").to_string();
    assert!(err.contains("compress_ratios"), "{err}");
}

#[test]
fn hub_tensor_names_load_like_the_transformers_save() {
    let want = logits(&fixture("deepseek_v4"));
    let dir = tempfile::tempdir().unwrap();
    copy(dir.path(), &fixture_config(), |n| match n {
        "model.embed_tokens.weight" => "embed.weight".into(),
        "model.norm.weight" => "norm.weight".into(),
        _ => n
            .replace("model.hc_head.hc_", "hc_head_")
            .trim_start_matches("model.")
            .to_string(),
    });
    let names = Checkpoint::open(dir.path()).unwrap();
    assert!(names.contains("layers.0.attn.wq_a.weight") && names.contains("hc_head_fn"));
    assert_eq!(bits(&logits(dir.path())), bits(&want));
}
