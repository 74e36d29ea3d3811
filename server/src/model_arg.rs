//! Resolving `--model` (a directory, or `demo`), the `--threads` setting and the placement
//! options (`--ram`, prefetch, pins) shared by every command that computes.

use std::path::PathBuf;

use anyhow::{Context, Result};
use colibri::model::LoadOptions;
use colibri::runtime::loaded::LoadedModel;
use colibri::store::budget::{default_budget, parse_size};
use colibri::store::StoreOptions;

/// Options every computing command takes.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model directory (Hugging Face layout), or `demo` for the built-in random-weight model.
    #[arg(long, short = 'm')]
    pub model: String,
    /// Compute threads (default: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// RAM budget for resident weights plus the expert cache, e.g. 512M or 6G (default: 80 %
    /// of available memory, or of the container's memory limit when smaller, less 1 GiB). Routed experts beyond it are read from disk on demand.
    #[arg(long)]
    pub ram: Option<String>,
    /// Memory-map every weight instead of reading experts into a budgeted cache.
    #[arg(long, conflicts_with = "ram")]
    pub mmap: bool,
    /// Do not read the next layer's likely experts ahead of time.
    #[arg(long)]
    pub no_prefetch: bool,
    /// I/O threads reading experts.
    #[arg(long, default_value_t = 4)]
    pub io_threads: usize,
    /// Do not record expert usage nor pin the experts it shows to be hot.
    #[arg(long)]
    pub no_learn: bool,
    /// Bytes of the expert cache the learned hot set may pin (default: half of the cache).
    #[arg(long)]
    pub pin_budget: Option<String>,
    /// A byte-identical copy of the checkpoint on another drive (repeatable); reads are
    /// spread over the drives by their weights.
    #[arg(long = "mirror")]
    pub mirrors: Vec<PathBuf>,
    /// Expert cache eviction: lru, or lfru (least frequently, then least recently used).
    #[arg(long, default_value = "lru")]
    pub cache_policy: String,
    /// Read expert files with O_DIRECT (bypassing the page cache), if the filesystem allows.
    #[arg(long)]
    pub direct_io: bool,
    /// How to read experts: auto (io-uring if the kernel allows, else a pread pool), uring or pool.
    #[arg(long, default_value = "auto")]
    pub io: String,
    /// Relative read bandwidth of each --mirror, in order (default 1 each; the model
    /// directory's drive counts 1).
    #[arg(long, value_delimiter = ',')]
    pub mirror_weights: Vec<f64>,
    /// How latent-attention models (DeepSeek, Kimi, GLM-5) compute attention: absorbed (in
    /// the latent space; the default) or expanded (per-head keys and values, as transformers).
    /// An error on a model without latent attention.
    #[arg(long)]
    pub mla_form: Option<String>,
    /// Draft tokens with the checkpoint's multi-token-prediction head (`mtp`; DeepSeek-V3,
    /// GLM-4.5+/5 checkpoints carry one) and verify them in one batched step: the output is
    /// identical, only the speed changes; drafting turns itself off when it does not pay.
    /// `none` (default) does not load the head.
    #[arg(long, default_value = "none")]
    pub draft: String,
    /// Precision of the latent-attention KV cache (DeepSeek, Kimi, GLM-5): f32 (default) or
    /// bf16 (half the bytes per token; values rounded when stored, so outputs may differ
    /// slightly from f32 — an explicit precision choice, never made for you). bf16 is an error
    /// on a model without latent attention.
    #[arg(long)]
    pub kv_dtype: Option<String>,
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

    /// The load options these flags ask for (`default` overrides the default RAM budget).
    pub fn load_options(&self, default: Option<u64>) -> Result<LoadOptions> {
        Ok(LoadOptions {
            placement: self.store_options(default)?,
            mla_form: match &self.mla_form {
                Some(s) => Some(s.parse().map_err(|e| anyhow::anyhow!("--mla-form: {e}"))?),
                None => None,
            },
            kv_dtype: match &self.kv_dtype {
                Some(s) => Some(s.parse().map_err(|e| anyhow::anyhow!("--kv-dtype: {e}"))?),
                None => None,
            },
            draft: self
                .draft
                .parse()
                .map_err(|e| anyhow::anyhow!("--draft: {e}"))?,
        })
    }

    /// The placement options these flags ask for (`default` overrides the default budget).
    pub fn store_options(&self, default: Option<u64>) -> Result<StoreOptions> {
        let ram_budget = if self.mmap {
            None
        } else {
            Some(match &self.ram {
                Some(s) => parse_size(s).context("--ram")?,
                None => default.unwrap_or_else(default_budget),
            })
        };
        if !self.mirror_weights.is_empty() && self.mirror_weights.len() != self.mirrors.len() {
            anyhow::bail!(
                "--mirror-weights has {} values for {} --mirror drives",
                self.mirror_weights.len(),
                self.mirrors.len()
            );
        }
        let weights = if self.mirror_weights.is_empty() && !self.mirrors.is_empty() {
            measured_weights(&self.model, &self.mirrors)
        } else {
            self.mirror_weights.clone()
        };
        let mirrors = self
            .mirrors
            .iter()
            .enumerate()
            .map(|(i, dir)| colibri::store::mirror::Mirror {
                dir: dir.clone(),
                weight: weights.get(i).copied().unwrap_or(1.0),
            })
            .collect();
        Ok(StoreOptions {
            ram_budget,
            io_threads: self.io_threads,
            prefetch: !self.no_prefetch,
            learn: !self.no_learn,
            pin_budget: match &self.pin_budget {
                Some(s) => Some(parse_size(s).context("--pin-budget")?),
                None => None,
            },
            state_dir: None,
            mirrors,
            reader: self.io.parse().map_err(|e| anyhow::anyhow!("--io: {e}"))?,
            direct_io: self.direct_io,
            policy: self
                .cache_policy
                .parse()
                .map_err(|e| anyhow::anyhow!("--cache-policy: {e}"))?,
        })
    }

    /// Resolve and load with every weight memory-mapped (nothing is read up front), unless
    /// `--ram` asks for a budget: what `coli info` needs.
    pub fn load_mapped(&self, needs_text: bool) -> Result<LoadedModel> {
        if self.ram.is_some() {
            return self.load(needs_text);
        }
        let dir = self.prepare()?;
        // Everything mapped, with the model-shape options (--mla-form, --draft, --kv-dtype).
        let mut opts = self.load_options(None)?;
        opts.placement.ram_budget = None;
        LoadedModel::open_with(&dir, needs_text, &opts)
            .with_context(|| format!("cannot load the model in {}", dir.display()))
    }

    /// Resolve and load, reporting the placement on stderr.
    pub fn load(&self, needs_text: bool) -> Result<LoadedModel> {
        let dir = self.prepare()?;
        let default = if self.model == "demo" {
            crate::demo::demo_budget(&dir)
        } else {
            None
        };
        let opts = self.load_options(default)?;
        let loaded = LoadedModel::open_with(&dir, needs_text, &opts)
            .with_context(|| format!("cannot load the model in {}", dir.display()))?;
        report_placement(&loaded, &opts.placement, self.ram.is_none());
        Ok(loaded)
    }
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
}

/// Read weights of the mirror drives relative to the model directory's drive: each drive's
/// measured sequential read bandwidth (256 MiB of its largest safetensors file, O_DIRECT
/// where allowed) divided by the model directory's. Drives that cannot be measured count 1.
fn measured_weights(model: &str, mirrors: &[PathBuf]) -> Vec<f64> {
    let primary = crate::machine::drive_read_bandwidth(std::path::Path::new(model));
    let weights: Vec<f64> = mirrors
        .iter()
        .map(
            |m| match (primary, crate::machine::drive_read_bandwidth(m)) {
                (Some(p), Some(x)) if p > 0.0 => x / p,
                _ => 1.0,
            },
        )
        .collect();
    eprintln!(
        "coli: mirror weights measured (model directory = 1): {}",
        weights
            .iter()
            .map(|w| format!("{w:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    weights
}
