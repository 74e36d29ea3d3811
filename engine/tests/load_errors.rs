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
    copy_of("olmoe")
}

/// A copy of `arch`'s fixture to break.
fn copy_of(arch: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(arch)).unwrap() {
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
fn kimi_k3_and_its_blocks_are_refused_naming_them() {
    // The K3 wrapper, its text model a kimi_linear one plus K3's blocks: refused, naming them.
    let tmp = copy_of("kimi_linear");
    edit_config(tmp.path(), |v| {
        let mut text = v.clone();
        text["attn_res_block_size"] = 6.into();
        text["moe_latent_size"] = 3584.into();
        *v = serde_json::json!({"model_type": "kimi_k3", "text_config": text});
    });
    let e = load_err(tmp.path());
    for want in [
        "kimi_k3",
        "AttnRes",
        "attn_res_block_size",
        "LatentMoE",
        "moe_latent_size",
    ] {
        assert!(e.contains(want), "missing {want}: {e}");
    }
    // A kimi_linear config with another activation is refused too, naming it.
    let tmp = copy_of("kimi_linear");
    edit_config(tmp.path(), |v| v["hidden_act"] = "situ_glu".into());
    let e = load_err(tmp.path());
    assert!(e.contains("situ_glu") && e.contains("hidden_act"), "{e}");
    // Without them the same model loads.
    assert!(model::load(&fixture("kimi_linear")).is_ok());
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

#[test]
fn numbered_parts_count_distinct_numbers_after_the_component() {
    use colibri::format::safetensors::numbered_parts;
    let names = [
        "model.layers.0.input_layernorm.weight",
        "model.layers.1.input_layernorm.weight",
        "model.layers.1.mlp.experts.5.up_proj.weight",
        "vision.layers.0.attn.weight",
        "layers.7.attn_norm.weight",
        "model.layers.x.bad",
        "model.mylayers.3.weight",
        "model.layers",
    ];
    assert_eq!(numbered_parts(names, "layers"), 3); // 0, 1 and 7
    assert_eq!(numbered_parts(names, "experts"), 1);
    assert_eq!(numbered_parts(names, "blk"), 0);
}

#[test]
fn config_sizes_and_counts_are_bounded_and_name_the_field() {
    use colibri::format::config::{ModelConfig, MAX_DIM};
    let cfg = ModelConfig::from_value(
        "config.json".into(),
        serde_json::json!({
            "hidden_size": 64, "big": MAX_DIM + 1, "max": MAX_DIM, "zero": 0,
            "num_hidden_layers": 3, "num_local_experts": 9
        }),
    );
    assert_eq!(cfg.dim("hidden_size").unwrap(), 64);
    assert_eq!(cfg.dim("max").unwrap(), MAX_DIM);
    for field in ["big", "zero"] {
        let e = cfg.dim(field).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains(&format!("`{field}`")),
            "{e}"
        );
    }
    assert_eq!(cfg.dim_or("absent", 7).unwrap(), 7);
    // A token id does not fit in u32: refused, not truncated into another id.
    let big_eos = ModelConfig::from_value(
        "config.json".into(),
        serde_json::json!({"eos_token_id": [2, 4294967298u64]}),
    );
    let e = big_eos.eos_token_ids().unwrap_err().to_string();
    assert!(e.contains("`eos_token_id`"), "{e}");
    assert_eq!(cfg.count("num_hidden_layers", 3, "layers").unwrap(), 3);
    let e = cfg
        .count("num_hidden_layers", 2, "layers")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`num_hidden_layers`") && e.contains("is 3") && e.contains("only 2 layers"),
        "{e}"
    );
    // A field read through its alias is named as the file spells it.
    let e = cfg
        .count("num_experts", 8, "routed experts")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`num_local_experts`"), "{e}");
}

/// A checkpoint of empty tensors with these names (what `expert_table` looks at).
fn checkpoint_of_names(
    dir: &Path,
    names: impl Iterator<Item = String>,
) -> colibri::format::safetensors::Checkpoint {
    use colibri::format::safetensors::{Access, Checkpoint, TensorDesc};
    let file = dir.join("empty.bin");
    std::fs::write(&file, b"").unwrap();
    let descs = names
        .map(|name| {
            let d = TensorDesc {
                name: name.clone(),
                shape: vec![0],
                dtype: colibri::tensor::DType::F32,
                file: 0,
                offset: 0,
                len: 0,
            };
            (name, d)
        })
        .collect();
    Checkpoint::from_descs(dir, &[file], descs, Access::Read).unwrap()
}

#[test]
fn an_expert_table_larger_than_the_checkpoint_is_refused_before_it_is_built() {
    use colibri::format::config::ModelConfig;
    use colibri::store::{expert_table, ExpertNames};
    let tmp = tempfile::tempdir().unwrap();
    // Each count alone is within what the names number (1000 layers, 1000 experts), but a
    // table of 1000 × 1000 experts would need 3 million tensors; the file has 2000.
    let ckpt = checkpoint_of_names(
        tmp.path(),
        (0..1000)
            .map(|l| format!("model.layers.{l}.input_layernorm.weight"))
            .chain((0..1000).map(|e| format!("model.layers.0.mlp.experts.{e}.up_proj.weight"))),
    );
    assert_eq!(ckpt.numbered("layers"), 1000);
    assert_eq!(ckpt.numbered("experts"), 1000);
    let cfg = ModelConfig::from_value(tmp.path().join("config.json"), serde_json::json!({}));
    let name = |l: usize, e: usize| ExpertNames {
        gate: format!("{l}.{e}.gate"),
        up: format!("{l}.{e}.up"),
        down: format!("{l}.{e}.down"),
    };
    let e = expert_table(&ckpt, &cfg, "num_experts", &[true; 1000], 1000, name)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json")
            && e.contains("`num_experts`")
            && e.contains("3000000")
            && e.contains("2000 tensors"),
        "{e}"
    );
    // One that fits is built, with empty lists for the dense layers.
    let table = expert_table(&ckpt, &cfg, "num_experts", &[true, false, true], 300, name).unwrap();
    assert_eq!(
        table.iter().map(Vec::len).collect::<Vec<_>>(),
        [300, 0, 300]
    );
    assert_eq!(table[2][299].down, "2.299.down");
}

#[test]
fn a_budget_below_the_resident_weights_prints_sizes_that_show_and_suffice() {
    use colibri::store::budget::parse_size;
    use colibri::store::StoreOptions;
    let tmp = copy_fixture();
    let opts = |budget: u64| StoreOptions {
        ram_budget: Some(budget),
        state_dir: Some(tmp.path().join("state")),
        ..StoreOptions::default()
    };
    let e = match model::load_with(tmp.path(), &colibri::model::LoadOptions::from(opts(1000))) {
        Ok(_) => panic!("1000 bytes cannot hold the resident weights"),
        Err(e) => e.to_string(),
    };
    // The fixture's resident weights are a few hundred KiB: shown in KiB, not "0.00 GB".
    assert!(!e.contains("0.00"), "{e}");
    let at_least = e
        .split("raise --ram to at least ")
        .nth(1)
        .unwrap_or_else(|| panic!("no minimum in: {e}"));
    assert!(at_least.ends_with(" KiB"), "{e}");
    assert!(e.contains("budget of 1000 B"), "{e}");
    // The minimum it names is enough, and is no more than 0.1 KiB above what is needed.
    let min = parse_size(at_least).unwrap();
    assert!(
        model::load_with(tmp.path(), &colibri::model::LoadOptions::from(opts(min))).is_ok(),
        "{e}"
    );
    assert!(
        model::load_with(
            tmp.path(),
            &colibri::model::LoadOptions::from(opts(min - 103))
        )
        .is_err(),
        "{e}"
    );
}

#[test]
fn a_tensor_shape_whose_element_count_overflows_is_refused() {
    // Zero bytes of data, but dimensions whose product (taken before the zero) overflows:
    // anything multiplying the shape out later would panic or wrap.
    let tmp = tempfile::tempdir().unwrap();
    let header = br#"{"w":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    std::fs::write(tmp.path().join("model.safetensors"), bytes).unwrap();
    let e = colibri::format::safetensors::Checkpoint::open(tmp.path())
        .err()
        .expect("must fail")
        .to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("overflows"),
        "{e}"
    );

    use colibri::format::gguf::{GgmlType, GgufFile, GgufTensorSpec, GgufWriter};
    let g = tmp.path().join("zero.gguf");
    let spec = GgufTensorSpec {
        name: "w".into(),
        dims_ggml: vec![0, 1 << 62, 1 << 62],
        ggml_type: GgmlType::F32,
    };
    GgufWriter::create(&g, &[], vec![spec])
        .unwrap()
        .finish()
        .unwrap();
    let e = GgufFile::open(&g).expect_err("must fail").to_string();
    assert!(e.contains("zero.gguf") && e.contains("do not fit"), "{e}");
}

/// The mixtral fixture as an f32 GGUF file, with its tensor `name` replaced by one of ggml
/// dimensions `dims` (zero bytes).
fn gguf_with_tensor(dir: &Path, name: &str, dims: Vec<u64>) -> std::path::PathBuf {
    use colibri::convert::{convert, ConvertType};
    use colibri::format::gguf::{GgufFile, GgufTensorSpec, GgufWriter};
    let good = dir.join("good.gguf");
    if !good.exists() {
        convert(&fixture("mixtral"), &good, ConvertType::F32, |_, _| {}).unwrap();
    }
    let g = GgufFile::open(&good).unwrap();
    let md: Vec<_> = g
        .metadata_keys()
        .iter()
        .map(|k| (k.clone(), g.metadata()[k].clone()))
        .collect();
    let mut parts = Vec::new();
    for t in g.tensors() {
        let (dims, bytes) = if t.name == name {
            let spec = GgufTensorSpec {
                name: t.name.clone(),
                dims_ggml: dims.clone(),
                ggml_type: t.ggml_type,
            };
            let n = spec.nbytes().unwrap();
            (dims.clone(), vec![0u8; n])
        } else {
            (t.dims_ggml.clone(), g.read_tensor(t).unwrap())
        };
        let spec = GgufTensorSpec {
            name: t.name.clone(),
            dims_ggml: dims,
            ggml_type: t.ggml_type,
        };
        parts.push((spec, bytes));
    }
    let out = dir.join("bad.gguf");
    let mut w = GgufWriter::create(&out, &md, parts.iter().map(|p| p.0.clone()).collect()).unwrap();
    for (_, b) in &parts {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
    out
}

#[test]
fn fused_gguf_experts_that_are_empty_or_too_many_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let fused = "blk.0.ffn_up_exps.weight";
    // Empty experts: their count would be bounded by nothing.
    let bad = gguf_with_tensor(tmp.path(), fused, vec![64, 0, 8]);
    let e = load_err(&bad);
    assert!(
        e.contains("bad.gguf") && e.contains(fused) && e.contains("empty"),
        "{e}"
    );
    // 2^21 one-element experts (8 MiB of data) would split into more descriptions than a
    // file may have tensors.
    let bad = gguf_with_tensor(tmp.path(), fused, vec![1, 1, 1 << 21]);
    let e = load_err(&bad);
    assert!(
        e.contains("bad.gguf") && e.contains(fused) && e.contains("more than"),
        "{e}"
    );
}
