//! Helpers shared by the engine's integration tests: the committed fixtures and their
//! reference prompts, and bit views of logits.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};

/// The committed transformers fixture of `arch`.
pub fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(arch)
}

/// The fixture's `reference.json`.
pub fn reference_json(arch: &str) -> serde_json::Value {
    let text =
        std::fs::read_to_string(fixture(arch).join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("reference.json parses")
}

/// The fixture's reference prompt ids.
pub fn prompt(arch: &str) -> Vec<u32> {
    ids(&reference_json(arch), "prompt_ids")
}

/// A list of token ids under `key`.
pub fn ids(v: &serde_json::Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The bit patterns of `v`, for exact comparisons.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Cut every safetensors file in `dir` to 64 bytes, so later reads of their data fail.
pub fn truncate_safetensors(dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&p)
                .unwrap()
                .set_len(64)
                .unwrap();
        }
    }
}
