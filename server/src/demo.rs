//! The built-in demo model: an OLMoE-shaped random-weight checkpoint of about 1 GB,
//! synthesized once (by `colibri_synth`) into the user's cache directory on first use.

use std::path::PathBuf;

use anyhow::{Context, Result};
use colibri_synth::tokenizer::{natural_vocab, SPECIALS};
use colibri_synth::{synthesize, SynthArch, SynthArgs, SynthDType};

/// Bumped whenever the demo model's shape changes, so an old cache is not reused.
const DEMO_NAME: &str = "demo-olmoe-1g-v3";

/// Where colibri caches things: `$COLI_CACHE_DIR`, else `$XDG_CACHE_HOME/colibri`, else
/// `~/.cache/colibri`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("COLI_CACHE_DIR") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(d).join("colibri"));
    }
    let home = std::env::var_os("HOME")
        .context("cannot find a cache directory: set COLI_CACHE_DIR or HOME")?;
    Ok(PathBuf::from(home).join(".cache").join("colibri"))
}

/// The demo's default budget: the resident set plus a quarter of its expert bytes, so its
/// experts visibly stream.
pub fn demo_budget(dir: &std::path::Path) -> Option<u64> {
    let ckpt = colibri::format::safetensors::Checkpoint::open(dir).ok()?;
    let experts: u64 = ckpt
        .tensors()
        .values()
        .filter(|d| d.name.contains(".experts."))
        .map(|d| d.len as u64)
        .sum();
    Some(ckpt.total_bytes() as u64 - experts + experts / 4)
}

/// The demo model's shape.
pub fn demo_args(out: PathBuf) -> SynthArgs {
    SynthArgs {
        arch: SynthArch::Olmoe,
        layers: 8,
        hidden: 1024,
        heads: Some(16),
        kv_heads: Some(16),
        experts: 32,
        top_k: 4,
        moe_intermediate: 640,
        intermediate: None,
        vocab: 4096,
        dtype: SynthDType::Bf16,
        seed: 0,
        shard_bytes: 4_000_000_000,
        out,
        threads: 0,
        ds: Default::default(),
        linear: Default::default(),
        mxfp4: false,
        format: Default::default(),
        ty: None,
    }
}

/// The demo model directory, synthesized on first use. Temporaries that killed runs left in
/// the cache directory (a demo model half written, a bandwidth probe) are removed first.
pub fn ensure() -> Result<PathBuf> {
    let cache = cache_dir()?;
    colibri::format::write::remove_stale_temporaries(&cache, |_| true);
    let dir = cache.join(DEMO_NAME);
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let mut args = demo_args(dir.clone());
    // Every id of the demo vocabulary is a real text token, so even random weights print text.
    args.vocab = natural_vocab(&SPECIALS)?;
    eprintln!(
        "coli: writing the demo model (about 1 GB of random weights) to {} — once only",
        dir.display()
    );
    synthesize(&args, true)?;
    Ok(dir)
}
