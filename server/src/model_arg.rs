//! Resolving `--model` (a directory, or `demo`) and the `--threads` setting shared by every
//! command that computes.

use std::path::PathBuf;

use anyhow::{Context, Result};
use colibri::runtime::loaded::LoadedModel;

/// Options every computing command takes.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model directory (Hugging Face layout), or `demo` for the built-in random-weight model.
    #[arg(long, short = 'm')]
    pub model: String,
    /// Compute threads (default: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// RAM budget for resident weights plus the expert cache (e.g. 512M, 6G). Routed experts
    /// are then read from disk into the cache on demand. Default: every weight memory-mapped.
    #[arg(long)]
    pub ram: Option<String>,
}

impl ModelArgs {
    /// Set up the thread pool and resolve the model directory (synthesizing the demo model
    /// on first use).
    pub fn prepare(&self) -> Result<PathBuf> {
        colibri::tensor::threads::init(self.threads)?;
        if self.model == "demo" {
            eprintln!(
                "coli: using the built-in demo model: its weights are RANDOM, so its text is gibberish (its speed is real)"
            );
            return crate::demo::ensure();
        }
        Ok(PathBuf::from(&self.model))
    }

    /// Resolve and load.
    pub fn load(&self, needs_text: bool) -> Result<LoadedModel> {
        let dir = self.prepare()?;
        let ram_budget = match &self.ram {
            Some(s) => Some(colibri::store::budget::parse_size(s).context("--ram")?),
            None => None,
        };
        let opts = colibri::store::StoreOptions {
            ram_budget,
            io_threads: 0,
        };
        let loaded = LoadedModel::open_with(&dir, needs_text, &opts)
            .with_context(|| format!("cannot load the model in {}", dir.display()))?;
        if let Some(b) = ram_budget {
            let i = loaded.model.info();
            eprintln!(
                "coli: RAM budget {:.2} GB: {:.2} GB resident, {:.2} GB expert cache for {:.2} GB of routed experts (read from disk on demand)",
                b as f64 / 1e9,
                i.dense_bytes as f64 / 1e9,
                b.saturating_sub(i.dense_bytes as u64) as f64 / 1e9,
                i.routed_expert_bytes as f64 / 1e9
            );
        }
        Ok(loaded)
    }
}
