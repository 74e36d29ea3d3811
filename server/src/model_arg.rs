//! Resolving `--model` (a directory, or `demo`) and loading it with the engine options
//! ([`EngineOptions`], set by [`EngineFlags`]) shared by every command that computes.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use colibri::runtime::loaded::LoadedModel;
use colibri::store::StoreOptions;

use crate::engine_options::{EngineFlags, EngineOptions};

/// Options every computing command takes: the model and the engine options.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model directory (Hugging Face layout), or `demo` for the built-in random-weight model.
    #[arg(long, short = 'm')]
    pub model: String,
    /// The engine options.
    #[command(flatten)]
    pub engine: EngineFlags,
}

impl ModelArgs {
    /// The engine options these flags ask for (the defaults for those not given), validated.
    pub fn options(&self) -> Result<EngineOptions> {
        crate::config::engine_from_flags(&self.engine)
    }

    /// Resolve and load with every weight memory-mapped (nothing is read up front), unless
    /// `--ram` asks for a budget: what `coli info` needs.
    pub fn load_mapped(&self, needs_text: bool) -> Result<LoadedModel> {
        let opts = self.options()?;
        if opts.ram.is_some() {
            return load(&self.model, &opts, needs_text);
        }
        let dir = prepare(&self.model, opts.threads)?;
        // Everything mapped, with the model-shape options (--mla-form, --draft, --kv-dtype).
        let mut load_opts = opts.load_options(&dir, None);
        load_opts.placement.ram_budget = None;
        LoadedModel::open_with(&dir, needs_text, &load_opts)
            .with_context(|| format!("cannot load the model in {}", dir.display()))
    }

    /// Resolve and load, reporting the placement on stderr.
    pub fn load(&self, needs_text: bool) -> Result<LoadedModel> {
        load(&self.model, &self.options()?, needs_text)
    }
}

/// Set up the thread pool and resolve the model directory (synthesizing the demo model on
/// first use).
pub fn prepare(model: &str, threads: usize) -> Result<PathBuf> {
    colibri::tensor::threads::init(threads)?;
    if model == "demo" {
        eprintln!(
            "coli: using the built-in demo model: its weights are RANDOM, so its text is gibberish (its speed is real)"
        );
        return crate::demo::ensure();
    }
    Ok(PathBuf::from(model))
}

/// Resolve `model` (a directory or `demo`) and load it with `opts`, reporting the placement
/// on stderr: what every computing command and `coli serve` do.
pub fn load(model: &str, opts: &EngineOptions, needs_text: bool) -> Result<LoadedModel> {
    let dir = prepare(model, opts.threads)?;
    let default = if model == "demo" {
        crate::demo::demo_budget(&dir)
    } else {
        None
    };
    let load_opts = opts.load_options(Path::new(&dir), default);
    let loaded = LoadedModel::open_with(&dir, needs_text, &load_opts)
        .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    report_placement(&loaded, &load_opts.placement, opts.ram.is_none());
    Ok(loaded)
}

/// One line on stderr saying where the weights live.
pub fn report_placement(loaded: &LoadedModel, opts: &StoreOptions, default_budget: bool) {
    let i = loaded.model.info();
    let size = colibri::store::budget::format_size;
    match (opts.ram_budget, loaded.model.store_stats()) {
        (Some(b), Some(s)) => eprintln!(
            "coli: RAM budget {}{}: {} resident + {} expert cache for {} of routed experts; reader: {}; prefetch {}",
            size(b),
            if default_budget { " (default)" } else { "" },
            size(i.dense_bytes as u64),
            size(s.cache_capacity),
            size(i.routed_expert_bytes as u64),
            s.reader,
            if opts.prefetch { "on" } else { "off" },
        ),
        _ => eprintln!(
            "coli: all {} of weights memory-mapped",
            size((i.dense_bytes + i.routed_expert_bytes) as u64)
        ),
    }
    if let Some(line) = device_line(loaded) {
        eprintln!("coli: {line}");
    }
}

/// Where the device tier stands (`None` on the CPU): the device, its bytes per kind, experts
/// held, uploads.
pub fn device_line(loaded: &LoadedModel) -> Option<String> {
    let s = loaded
        .model
        .store_stats()
        .filter(|s| !s.device.is_empty())?;
    let size = colibri::store::budget::format_size;
    Some(format!(
        "device {}: {} in VRAM ({} dense matrices, {} for {} experts); uploaded at {:.2} GB/s",
        s.device,
        size(s.device_bytes),
        size(s.device_bytes.saturating_sub(s.vram_bytes)),
        size(s.vram_bytes),
        s.vram_experts,
        s.device_upload_bytes as f64 / 1e9 / s.device_upload_seconds.max(1e-9),
    ))
}
