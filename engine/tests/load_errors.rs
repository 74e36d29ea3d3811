//! A model directory that cannot be run gets one clear error naming the file, the tensor or
//! field, and what was expected. One test per case; each starts from a valid fixture copied
//! to a temporary directory and breaks one thing.

mod common;
use common::fixture;

use std::path::Path;

use colibri::format::tokenizer::Tokenizer;
use colibri::model;

/// A copy of the olmoe fixture to break.
fn copy_fixture() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("olmoe")).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    tmp
}

fn load_err(dir: &Path) -> String {
    match model::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
}

/// Rewrite model.safetensors with `f` applied to the parsed header (data unchanged).
fn edit_header(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(&mut header);
    let mut h = serde_json::to_vec(&header).unwrap();
    while h.len() < n {
        h.push(b' ');
    }
    assert_eq!(h.len(), n, "edited header must keep its length");
    let mut out = bytes.clone();
    out[8..8 + n].copy_from_slice(&h);
    std::fs::write(&p, out).unwrap();
}

#[test]
fn the_unbroken_copy_loads() {
    let tmp = copy_fixture();
    assert!(model::load(tmp.path()).is_ok());
}

#[test]
fn unknown_model_type_names_the_field_and_the_supported_types() {
    let tmp = copy_fixture();
    edit_config(tmp.path(), |v| v["model_type"] = "falcon_moe".into());
    let e = load_err(tmp.path());
    assert!(
        e.contains("config.json") && e.contains("model_type") && e.contains("falcon_moe"),
        "{e}"
    );
    assert!(
        e.contains("olmoe") && e.contains("qwen3_moe"),
        "should list supported types: {e}"
    );
}

#[test]
fn missing_config_field_names_it() {
    let tmp = copy_fixture();
    edit_config(tmp.path(), |v| {
        v.as_object_mut().unwrap().remove("num_hidden_layers");
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains("config.json") && e.contains("num_hidden_layers") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn invalid_config_json_names_the_file() {
    let tmp = copy_fixture();
    std::fs::write(
        tmp.path().join("config.json"),
        "{\"model_type\": \"olmoe\",",
    )
    .unwrap();
    let e = load_err(tmp.path());
    assert!(
        e.contains("config.json") && e.contains("invalid JSON"),
        "{e}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let tmp = copy_fixture();
    edit_header(tmp.path(), |h| {
        let v = h.remove("model.layers.1.self_attn.k_norm.weight").unwrap();
        h.insert("model.layers.1.self_attn.k_nrm_.weight".into(), v);
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains("model.layers.1.self_attn.k_norm.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn misshaped_tensor_states_both_shapes() {
    let tmp = copy_fixture();
    // Claim hidden_size 32 while the tensors are 64 wide.
    edit_config(tmp.path(), |v| v["intermediate_size"] = 16.into());
    let e = load_err(tmp.path());
    assert!(
        e.contains("has shape") && e.contains("expected") && e.contains("experts"),
        "{e}"
    );
}

#[test]
fn truncated_safetensors_is_reported_as_truncated() {
    let tmp = copy_fixture();
    let p = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 1000]).unwrap();
    let e = load_err(tmp.path());
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
}

#[test]
fn file_shorter_than_its_header_is_reported() {
    let tmp = copy_fixture();
    let p = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..100]).unwrap();
    let e = load_err(tmp.path());
    assert!(
        e.contains("model.safetensors") && e.contains("header"),
        "{e}"
    );
}

#[test]
fn corrupt_header_json_is_reported() {
    let tmp = copy_fixture();
    let p = tmp.path().join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8] = b'!';
    std::fs::write(&p, bytes).unwrap();
    let e = load_err(tmp.path());
    assert!(
        e.contains("model.safetensors") && e.contains("corrupt"),
        "{e}"
    );
}

#[test]
fn unsupported_dtype_is_named() {
    let tmp = copy_fixture();
    edit_header(tmp.path(), |h| {
        h.get_mut("model.norm.weight").unwrap()["dtype"] = "F64".into();
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains("model.norm.weight") && e.contains("F64") && e.contains("unsupported dtype"),
        "{e}"
    );
}

#[test]
fn integer_tensor_where_weights_are_expected_is_rejected() {
    let tmp = copy_fixture();
    edit_header(tmp.path(), |h| {
        // Same byte size: 64 f32 = 64 i32.
        h.get_mut("model.norm.weight").unwrap()["dtype"] = "I32".into();
    });
    let e = load_err(tmp.path());
    assert!(e.contains("model.norm.weight") && e.contains("i32"), "{e}");
}

#[test]
fn missing_weights_file_names_what_was_expected() {
    let tmp = copy_fixture();
    std::fs::remove_file(tmp.path().join("model.safetensors")).unwrap();
    let e = load_err(tmp.path());
    assert!(
        e.contains("model.safetensors") && e.contains("no weights"),
        "{e}"
    );
}

#[test]
fn missing_config_names_the_file() {
    let tmp = copy_fixture();
    std::fs::remove_file(tmp.path().join("config.json")).unwrap();
    let e = load_err(tmp.path());
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn corrupt_tokenizer_names_the_file() {
    let tmp = copy_fixture();
    std::fs::write(tmp.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let e = Tokenizer::from_file(&tmp.path().join("tokenizer.json"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn a_model_without_tokenizer_still_computes_logits() {
    let tmp = copy_fixture();
    std::fs::remove_file(tmp.path().join("tokenizer.json")).unwrap();
    let loaded = colibri::runtime::loaded::LoadedModel::open(tmp.path(), false).unwrap();
    assert!(loaded.tokenizer.is_none());
    let e = loaded.tokenizer().unwrap_err().to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
    let e = colibri::runtime::loaded::LoadedModel::open(tmp.path(), true)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("tokenizer.json"), "{e}");
}

#[test]
fn a_file_that_is_not_gguf_is_named_as_such() {
    let tmp = tempfile::tempdir().unwrap();
    let f = tmp.path().join("model.bin");
    std::fs::write(&f, b"not a model at all").unwrap();
    let e = colibri::runtime::loaded::LoadedModel::open(&f, false)
        .err()
        .expect("must fail")
        .to_string();
    assert!(
        e.contains("model.bin") && e.contains("GGUF") && e.contains("config.json"),
        "{e}"
    );
    // A GGUF whose header is cut short is a clear error naming the file, not a panic.
    let g = tmp.path().join("cut.gguf");
    std::fs::write(&g, b"GGUF\x03\x00\x00\x00\x01").unwrap();
    let e = colibri::runtime::loaded::LoadedModel::open(&g, false)
        .err()
        .expect("must fail")
        .to_string();
    assert!(e.contains("cut.gguf"), "{e}");
}
