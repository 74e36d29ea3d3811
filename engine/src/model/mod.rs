//! Models: shared layers ([`layers`]), the standard decoder stack ([`transformer`]) and one
//! file per architecture that maps its `config.json` and tensor names onto them.
//!
//! [`load`] reads a model directory (or a GGUF file, [`gguf`]) and picks the family by
//! `model_type` from the [`registry`].

pub mod cache;
pub mod deepseek_v3;
pub mod deepseek_v4;
pub mod gguf;
pub mod glm4_moe;
pub mod glm5_next;
pub mod glm_moe_dsa;
pub mod gpt_oss;
pub mod inkling;
pub mod inkling2;
pub mod kimi_linear;
pub mod layers;
pub mod linear_attention;
pub mod llama;
pub mod minimax_m2;
pub mod mixtral;
pub mod mla;
pub mod olmoe;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod registry;
pub mod telemetry;
pub mod torch_topk;
pub mod transformer;

use std::path::Path;

use crate::format::config::ModelConfig;
use crate::format::safetensors::{Access, Checkpoint};
use crate::store::StoreOptions;
use crate::tensor::device::{DeviceChoice, DevicePlacement};
use crate::{Error, Result};
use cache::{KvCache, KvDType};
use mla::MlaForm;
pub use registry::supported;
use registry::Abilities;

/// How to load a model: where its weights live (the store's placement) and the choices about
/// the model itself that are made at load time. A choice the family cannot honour is an error
/// from [`load_with`], never ignored.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Where routed experts live: RAM budget, I/O, cache, pins, mirrors.
    pub placement: StoreOptions,
    /// How multi-head latent attention is computed; `None`: the family's default (absorbed).
    /// Set on a model without latent attention, it is an error.
    pub mla_form: Option<MlaForm>,
    /// Precision of the latent-attention cache; `None`: f32. bf16 on a model without latent
    /// attention is an error.
    pub kv_dtype: Option<KvDType>,
    /// The drafter to load for speculative decoding.
    pub draft: Draft,
    /// The device that computes with the matrices placed on it (dense first, then the
    /// hottest experts); the CPU computes the rest, with the same bits.
    pub device: DeviceChoice,
    /// Bytes of device memory to fill; `None`: most of what is free
    /// ([`crate::tensor::device::default_vram_budget`]).
    pub vram: Option<u64>,
}

impl LoadOptions {
    /// The latent-attention form asked for, or the default.
    pub fn mla_form(&self) -> MlaForm {
        self.mla_form.unwrap_or_default()
    }

    /// The latent-attention cache precision asked for, or the default.
    pub fn kv_dtype(&self) -> KvDType {
        self.kv_dtype.unwrap_or_default()
    }

    /// Whether the checkpoint's multi-token-prediction head is to be loaded.
    pub fn mtp(&self) -> bool {
        self.draft == Draft::Mtp
    }
}

impl From<StoreOptions> for LoadOptions {
    /// Load with this placement and every model choice at its default.
    fn from(placement: StoreOptions) -> LoadOptions {
        LoadOptions {
            placement,
            ..LoadOptions::default()
        }
    }
}

/// Which drafter speculative decoding uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Draft {
    /// No drafting.
    #[default]
    None,
    /// The checkpoint's own multi-token-prediction head (DeepSeek-V3, GLM-5 checkpoints).
    Mtp,
    /// Prompt lookup (n-gram) and grammar fast-forward drafts at every step where they have
    /// one (the scheduler's: `runtime::drafts`).
    Ngram,
    /// Prompt lookup and grammar fast-forward, each kept only while measured to pay.
    Auto,
}

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// One row per input token.
    All,
    /// Only the last token's row.
    Last,
    /// No rows (a prefill chunk that is not the prompt's last).
    None,
}

/// One sequence's part of a batched forward pass.
pub struct BatchItem<'a> {
    /// Tokens to run (a prefill chunk, or one decode token).
    pub tokens: &'a [u32],
    /// The sequence's cache; the tokens are appended to it.
    pub cache: &'a mut KvCache,
    /// Which logits rows to return for this sequence.
    pub logits: Logits,
}

/// What `coli info` shows about a model.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ModelInfo {
    pub model_type: String,
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub layers: usize,
    pub moe_layers: usize,
    pub routed_experts: usize,
    pub shared_experts: usize,
    pub active_experts: usize,
    pub total_params: usize,
    pub active_params: usize,
    pub dense_bytes: usize,
    pub routed_expert_bytes: usize,
    pub dtypes: Vec<String>,
    pub max_position_embeddings: usize,
    /// Bytes one token adds to the KV cache (f32 values, every layer).
    pub kv_bytes_per_token: usize,
    /// What per-head K/V attention of the same shape would store per token (equals
    /// `kv_bytes_per_token` except for latent attention).
    pub kv_bytes_per_token_full: usize,
    /// Bytes of the fixed-size state one sequence keeps in linear-attention layers
    /// (convolution windows and recurrent matrices; constant in the context length).
    pub state_bytes_per_sequence: usize,
    /// Bytes of the checkpoint this model never loads (see `skipped`).
    pub unused_bytes: usize,
    /// What of the checkpoint was left out on purpose, e.g. "MTP head (layer 3)" or "vision
    /// tower": said by `coli info`.
    pub skipped: Vec<String>,
}

/// A causal language model: tokens in, next-token logits out.
pub trait CausalLm: Send + Sync {
    /// Shape and size facts.
    fn info(&self) -> &ModelInfo;
    /// An empty per-sequence cache holding up to `max_len` tokens.
    fn new_cache(&self, max_len: usize) -> KvCache;
    /// Run `tokens` (a prefill chunk or one decode token) at the cache's next positions,
    /// appending them to the cache, and return logits rows (`vocab_size` each).
    fn forward(&self, tokens: &[u32], cache: &mut KvCache, logits: Logits) -> Result<Vec<f32>>;
    /// Run several sequences as one batch: each item's tokens continue its own cache, and
    /// item `i`'s logits rows come back at index `i`. Every row is computed by the same
    /// batch-invariant kernels as alone, so each result is bit-identical to a separate
    /// [`CausalLm::forward`]; batching only shares the work (an expert routed by several
    /// sequences is read and applied once). The default runs the items one by one.
    fn forward_batch(&self, items: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        items
            .iter_mut()
            .map(|it| self.forward(it.tokens, it.cache, it.logits))
            .collect()
    }
    /// The model's multi-token-prediction drafter, when its checkpoint has one and loading
    /// asked for it ([`LoadOptions::draft`]).
    fn drafter(&self) -> Option<&dyn Drafter> {
        None
    }
    /// Counters of the expert store, if it keeps any.
    fn store_stats(&self) -> Option<crate::store::StoreSnapshot> {
        None
    }
    /// Persist what the expert store learned (usage history).
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    /// Persist what the expert store learned in the background (see
    /// [`crate::store::ExpertStore::flush_soon`]); returns at once.
    fn flush_soon(&self) {}
}

/// Draft tokens from a model's own multi-token-prediction head (speculative decoding; see
/// `runtime::speculative`). Drafts are proposals: the main model verifies every one.
pub trait Drafter: Send + Sync {
    /// An empty cache for the draft head's own attention layer.
    fn new_draft_cache(&self, max_len: usize) -> KvCache;
    /// The main forward pass with every logits row, plus the final-normed hidden rows.
    fn forward_hidden(&self, tokens: &[u32], cache: &mut KvCache) -> Result<(Vec<f32>, Vec<f32>)>;
    /// Run the head over (hidden row `i`, token `next[i]`) pairs — the main model's state
    /// at a position and the token that followed it — appending them to `cache`; returns the
    /// logits of the token after the last pair's.
    fn draft(&self, hidden: &[f32], next: &[u32], cache: &mut KvCache) -> Result<Vec<f32>>;
}

/// Load the model in `dir` with every weight resident.
pub fn load(dir: &Path) -> Result<Box<dyn CausalLm>> {
    load_with(dir, &LoadOptions::default())
}

/// Where the routed experts of the model in `dir` are in its files, read from the headers
/// (the load stops once the experts are described: nothing is read beyond what a load
/// maps; see [`crate::store::StoreOptions::layout_probe`]). `None` for a model without
/// routed experts.
pub fn expert_layout(dir: &Path) -> Result<Option<crate::store::ExpertLayout>> {
    let probe = crate::store::LayoutProbe::default();
    let opts = LoadOptions {
        placement: StoreOptions {
            layout_probe: Some(probe.clone()),
            ..StoreOptions::default()
        },
        device: DeviceChoice::Cpu,
        ..LoadOptions::default()
    };
    let loaded = load_on_cpu(dir, &opts);
    match (probe.take(), loaded) {
        (Some(layout), _) => Ok(Some(layout)),
        (None, Ok(_)) => Ok(None),
        (None, Err(e)) => Err(e),
    }
}

/// A model described without being made runnable ([`describe`]).
pub struct Described {
    /// Its shape and size facts, as a load with the same options reports them.
    pub info: ModelInfo,
    /// Where its routed experts are (`None` for a model without routed experts).
    pub layout: Option<crate::store::ExpertLayout>,
}

/// Describe the model in `dir` as [`load_with`] would build it with `opts` (its family, every
/// tensor's name, shape and dtype checked by the family's loader, the model choices of
/// `opts` applied), on the CPU, with the weights mapped and never prefaulted and the routed
/// experts only described (see [`crate::store::LayoutProbe::describing`]): headers are read,
/// no expert is, and no dense weight but the few a family converts while it builds. What
/// `coli plan` and `coli doctor` load.
pub fn describe(dir: &Path, opts: &LoadOptions) -> Result<Described> {
    let probe = crate::store::LayoutProbe::describing();
    let opts = LoadOptions {
        placement: StoreOptions {
            layout_probe: Some(probe.clone()),
            ram_budget: None,
            device: None,
            ..StoreOptions::default()
        },
        device: DeviceChoice::Cpu,
        ..opts.clone()
    };
    let model = load_on_cpu(dir, &opts)?;
    Ok(Described {
        info: model.info().clone(),
        layout: probe.take(),
    })
}

/// The weight matrices of one shape and format in a model: routed experts' (a tensor named
/// `….experts.…`, or a three-dimensional stack of them) or dense ones.
#[derive(Debug, Clone, PartialEq)]
pub struct MatrixShape {
    pub dtype: crate::tensor::DType,
    pub rows: usize,
    pub cols: usize,
    /// Routed experts' matrices.
    pub expert: bool,
    /// How many matrices of this shape, and their bytes together.
    pub count: usize,
    pub bytes: u64,
}

/// The weight matrices of the model in `dir` (a directory or a GGUF file) grouped by format,
/// shape and kind (dense or routed expert), from the headers alone: what a token's forward
/// pass multiplies, for `coli plan` to time with the decode kernel's rate on each. The input
/// embedding table (`*embed_tokens.weight`) is left out when the checkpoint has a separate
/// `lm_head.weight` (a token reads one row of it), and so are tensors of more than three
/// dimensions (split FP4 blocks, counted by the caller at the memory bandwidth).
pub fn matrix_shapes(dir: &Path) -> Result<Vec<MatrixShape>> {
    let ckpt = if crate::format::gguf::is_gguf(dir) {
        gguf::open(dir, Access::Mapped)?.2
    } else {
        Checkpoint::open_with(dir, Access::Mapped)?
    };
    let tensors = ckpt.tensors();
    let untied = tensors.keys().any(|n| n.ends_with("lm_head.weight"));
    let mut shapes: Vec<MatrixShape> = Vec::new();
    for (name, t) in tensors {
        if untied && name.ends_with("embed_tokens.weight") {
            continue;
        }
        let (count, rows, cols, expert) = match t.shape[..] {
            [rows, cols] => (1, rows, cols, name.contains(".experts.")),
            [n, rows, cols] => (n, rows, cols, true),
            _ => continue,
        };
        let same = |m: &&mut MatrixShape| {
            (m.dtype, m.rows, m.cols, m.expert) == (t.dtype, rows, cols, expert)
        };
        match shapes.iter_mut().find(|m| same(m)) {
            Some(m) => {
                m.count += count;
                m.bytes += t.len as u64;
            }
            None => shapes.push(MatrixShape {
                dtype: t.dtype,
                rows,
                cols,
                expert,
                count,
                bytes: t.len as u64,
            }),
        }
    }
    Ok(shapes)
}

/// Load the model in `dir`, placing routed experts as `opts` says.
pub fn load_with(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn CausalLm>> {
    let Some(backend) = crate::tensor::device::open(opts.device)? else {
        tracing::info!("device: cpu");
        return load_on_cpu(dir, opts);
    };
    let budget = opts
        .vram
        .unwrap_or_else(|| crate::tensor::device::default_vram_budget(&*backend));
    let placement = DevicePlacement::new(backend.clone(), budget);
    let mut on_device = opts.clone();
    on_device.placement.device = Some(placement.clone());
    let model = crate::tensor::device::loading_with(Some(placement.clone()), || {
        load_on_cpu(dir, &on_device)
    })?;
    let dense = budget - placement.left();
    tracing::info!(
        "device: {} `{}`: VRAM budget {budget} bytes, dense matrices {dense} bytes",
        backend.api(),
        backend.name(),
    );
    placement.finish_load()?;
    Ok(model)
}

/// [`load_with`] once the device placement (if any) is set up.
fn load_on_cpu(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn CausalLm>> {
    // Streaming mode never maps the files: dense weights are read once, experts on demand.
    // Mapped, they are faulted in at open when they fit in the memory available, so no step
    // stops on a page fault (a larger mapping is left to fault in as it is read).
    let free = crate::store::budget::available_memory();
    let access = if opts.placement.layout_probe.is_some() {
        // Headers only: nothing is faulted in.
        Access::Mapped
    } else if opts.placement.ram_budget.is_some() {
        Access::Read
    } else if free.is_some_and(|free| weight_file_bytes(dir) <= free) {
        Access::MappedPrefaulted
    } else {
        Access::Mapped
    };
    // Mapped files that fit leave room for interleaved copies of Q4_K matrices (faster CPU
    // products, the same bits): up to half of the memory left beside them. Streaming and
    // larger-than-memory loads keep the file's layout only.
    let grant = match (access, free) {
        (Access::MappedPrefaulted, Some(free)) => free.saturating_sub(weight_file_bytes(dir)) / 2,
        _ => 0,
    };
    // (Loads on other threads share the grant and the count: both only ever cost speed.)
    let made = crate::tensor::qmatmul::interleaved::made();
    crate::tensor::qmatmul::interleaved::grant(grant);
    let model = load_on_cpu_with(dir, access, opts);
    crate::tensor::qmatmul::interleaved::grant(0);
    let used = crate::tensor::qmatmul::interleaved::made().saturating_sub(made);
    if used > 0 {
        tracing::info!(
            "Q4_K matrices interleaved in eights for the CPU kernels: {} beside the mapped files \
             (their kernel prefetching {} records ahead on this CPU)",
            crate::store::budget::format_size(used),
            crate::tensor::qmatmul::prefetch::records_ahead()
        );
    }
    model
}

/// [`load_on_cpu`] with the files' access chosen.
fn load_on_cpu_with(dir: &Path, access: Access, opts: &LoadOptions) -> Result<Box<dyn CausalLm>> {
    if crate::format::gguf::is_gguf(dir) {
        let (_, cfg, ckpt) = gguf::open(dir, access)?;
        return load_family(&ckpt, &cfg, opts);
    }
    let cfg = ModelConfig::from_model_dir(dir)?;
    // Check the family before touching the weights, so the error is about the real problem.
    let family = registry::family_of(&cfg)?;
    let mut ckpt = Checkpoint::open_with(dir, access)?;
    ckpt.split_fused(family.fused_experts)?;
    load_family(&ckpt, &cfg, opts)
}

/// Bytes of the weight files of a model directory (its `.safetensors` and `.gguf` files) or of a
/// GGUF file.
fn weight_file_bytes(dir: &Path) -> u64 {
    if dir.is_file() {
        return std::fs::metadata(dir).map_or(u64::MAX, |m| m.len());
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return u64::MAX;
    };
    entries
        .flatten()
        .filter(|e| {
            e.path()
                .extension()
                .is_some_and(|x| x == "safetensors" || x == "gguf")
        })
        .map(|e| e.metadata().map_or(0, |m| m.len()))
        .sum()
}

/// The text model's configuration of a multimodal config: its `text_config`, with what lives
/// at the top level there: `tie_word_embeddings` (default `tie_default`) and the
/// `eos_token_id` / `bos_token_id` / `architectures` the text config leaves out. `what` names the text model in
/// the error when `text_config` is missing.
pub fn unwrap_text_config(cfg: &ModelConfig, tie_default: bool, what: &str) -> Result<ModelConfig> {
    let model_type = cfg.model_type()?;
    let why = format!("a {model_type} config holds {what} there");
    let mut text = cfg
        .get("text_config")
        .cloned()
        .ok_or_else(|| Error::config(cfg.path(), "text_config", format!("missing ({why})")))?;
    if !text.is_object() {
        return Err(Error::config(
            cfg.path(),
            "text_config",
            format!("is not an object ({why})"),
        ));
    }
    text["tie_word_embeddings"] =
        serde_json::Value::Bool(cfg.bool_or("tie_word_embeddings", tie_default)?);
    for key in ["eos_token_id", "bos_token_id", "architectures"] {
        if text.get(key).is_none_or(|v| v.is_null()) {
            if let Some(v) = cfg.get(key) {
                text[key] = v.clone();
            }
        }
    }
    Ok(ModelConfig::from_value(cfg.path().to_path_buf(), text))
}

/// `num_hidden_layers`, checked against the layers the checkpoint has tensors for
/// ([`ModelConfig::count`]) before any family builds anything per layer.
pub fn layer_count(cfg: &ModelConfig, ckpt: &Checkpoint) -> Result<usize> {
    cfg.count("num_hidden_layers", ckpt.numbered("layers"), "layers")
}

/// The routed-expert count in `field`, checked against the experts the checkpoint has
/// tensors for (`…experts.{E}.…`, [`ModelConfig::count`]) before anything is built per
/// expert.
pub fn expert_count(cfg: &ModelConfig, ckpt: &Checkpoint, field: &str) -> Result<usize> {
    cfg.count(field, ckpt.numbered("experts"), "routed experts")
}

/// `num_experts_per_tok`: how many of the `experts` routed experts each token uses, at
/// least one and at most all of them.
pub fn experts_per_token(cfg: &ModelConfig, experts: usize) -> Result<usize> {
    cfg.usize_in(
        "num_experts_per_tok",
        1..=experts.max(1),
        &format!("each token is routed to at least one of the {experts} routed experts"),
    )
}

/// Refuse the options `model_type` cannot honour, saying why.
fn check_options(model_type: &str, can: Abilities, opts: &LoadOptions) -> Result<()> {
    if let (Some(form), false) = (opts.mla_form, can.latent_attention) {
        return Err(Error::Invalid(format!(
            "mla_form `{}` (--mla-form) cannot apply: `{model_type}` has no multi-head latent \
             attention (only DeepSeek-V3/R1, Kimi K2/K2.5 and GLM-5 do); leave it unset",
            format!("{form:?}").to_lowercase()
        )));
    }
    if let (Some(KvDType::Bf16), false) = (opts.kv_dtype, can.latent_attention) {
        return Err(Error::Invalid(format!(
            "kv_dtype `bf16` (--kv-dtype) cannot apply: `{model_type}` has no latent-attention \
             cache (its KV cache is f32); leave it unset"
        )));
    }
    if opts.mtp() && !can.mtp {
        return Err(Error::Invalid(format!(
            "draft `mtp` (--draft mtp) cannot apply: colibri has no multi-token-prediction \
             drafter for `{model_type}`; run without --draft mtp"
        )));
    }
    Ok(())
}

/// Build the family `cfg` names from an opened checkpoint.
fn load_family(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    opts: &LoadOptions,
) -> Result<Box<dyn CausalLm>> {
    let family = registry::family_of(cfg)?;
    let model_type = cfg.model_type()?;
    check_options(&model_type, family.abilities, opts)?;
    let model = (family.load)(ckpt, cfg, opts)?;
    if opts.mtp() && model.drafter().is_none() {
        return Err(Error::Invalid(format!(
            "draft `mtp` (--draft mtp): this `{model_type}` model loaded no \
             multi-token-prediction drafter; run without --draft mtp"
        )));
    }
    Ok(model)
}
