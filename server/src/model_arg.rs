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
        LoadedModel::open(&dir, needs_text)
            .with_context(|| format!("cannot load the model in {}", dir.display()))
    }
}
