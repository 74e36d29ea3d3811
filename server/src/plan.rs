//! `coli plan`: where a model's bytes would live with a configuration — VRAM, RAM, disk — and
//! the decode speed that placement predicts, without reading any weight.
//!
//! The placement is the engine's own: the model is described by [`colibri::model::describe`]
//! (the family's loader builds it around a store that only describes the experts), the RAM
//! budget is split by [`colibri::store::tiered::split_budget`] (the resident set, the expert
//! cache, the pin budget, and the refusal of a budget the resident set does not fit), the
//! pinned experts are `UsageHistory::hottest` within the pin budget, and the VRAM tier is
//! filled in [`colibri::store::vram::fill_order`]. The configuration is `coli serve`'s
//! (defaults < profile file < `COLI_*` < flags).
//!
//! The prediction, for one sequence decoding:
//!
//! ```text
//! seconds per token = resident bytes read per token / memory bandwidth
//!                   + active-expert bytes hit in RAM / memory bandwidth
//!                   + active-expert bytes missed     / disk bandwidth
//! ```
//!
//! with the bandwidths `coli bench --remeasure` measures ([`crate::machine`]; measured now if
//! none are cached), the disk's multiplied by the drives' relative weights when mirrors are
//! configured, and the hit fractions from the usage history's counts (each layer's routing
//! distribution; the RAM cache assumed to hold the hottest experts that fit it) or, without a
//! history, uniform routing (hit fraction = cache bytes / routed-expert bytes). The resident
//! bytes read per token are the resident set less the input embedding table (a token reads
//! one row of it), that table estimated at the checkpoint's mean bytes per parameter. Bytes
//! in VRAM are computed on the device, whose bandwidth is not measured: they are left out of
//! the time, so with a VRAM tier the figure is an upper bound.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use colibri::model::{Described, LoadOptions};
use colibri::store::budget::format_size;
use colibri::store::tiered::{split_budget, BudgetSplit};
use colibri::tensor::device::DeviceChoice;
use serde::Serialize;

use crate::config::{ServeConfig, ServeFlags};
use crate::machine::Bandwidths;

/// Arguments of `coli plan`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The configuration `coli serve` would run with: a file, a profile, `COLI_*` variables
    /// and these flags (`--model`, `--ram`, `--vram`, `--mirror`, `--slots`, `--context`, ...).
    #[command(flatten)]
    pub flags: ServeFlags,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Where the weights and caches live with one configuration (no prediction).
#[derive(Debug, Clone, Serialize)]
pub struct Placement {
    /// The model directory or file.
    pub model: PathBuf,
    pub model_type: String,
    /// `tiered` (a RAM budget, experts read from disk into a cache) or `mapped` (`mmap`:
    /// every weight memory-mapped).
    pub mode: String,
    /// The RAM budget and where it comes from (`None` when mapped).
    pub ram_budget: Option<u64>,
    pub ram_budget_source: String,
    /// Bytes of the dense (resident) weights: everything but the routed experts and what the
    /// model never loads.
    pub dense_bytes: u64,
    /// Bytes of all routed experts, their count, and how many a token uses per MoE layer.
    pub routed_expert_bytes: u64,
    pub routed_experts: usize,
    pub moe_layers: usize,
    pub active_experts: usize,
    /// The budget's split (tiered mode).
    pub split: Option<BudgetSplit>,
    pub vram: VramTier,
    pub ram: RamTier,
    pub disk: DiskTier,
    /// What the expert ranking (pins, VRAM order, hit fractions) is based on.
    pub history: String,
    /// Per routed expert in the plan: (layer, expert, bytes, share of its layer's routing).
    #[serde(skip)]
    experts: Vec<ExpertFacts>,
    /// Checkpoint bytes over parameters (the embedding table's estimate).
    #[serde(skip)]
    bytes_per_param: f64,
    #[serde(skip)]
    embedding_params: u64,
    #[serde(skip)]
    hidden_size: usize,
    #[serde(skip)]
    tied_embeddings: bool,
    #[serde(skip)]
    uniform: bool,
    #[serde(skip)]
    mirror_weights: Vec<f64>,
}

#[derive(Debug, Clone, Copy)]
struct ExpertFacts {
    bytes: u64,
    /// Probability that one of the layer's routed slots picks this expert.
    share: f64,
    place: Place,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Vram,
    Pinned,
    Cached,
    Disk,
}

/// The VRAM tier (empty without a device budget).
#[derive(Debug, Clone, Serialize, Default)]
pub struct VramTier {
    /// The device budget (`vram`), when a device is configured and the budget given.
    pub budget: Option<u64>,
    /// Dense matrices placed on the device (estimated: the resident set less the embedding
    /// table, up to the budget).
    pub dense_bytes: u64,
    /// Experts placed (usage history's hottest first, then layer by layer) and their bytes.
    pub experts: usize,
    pub expert_bytes: u64,
    /// Why there is no VRAM tier, or what the figures assume.
    pub note: String,
}

/// The RAM tier.
#[derive(Debug, Clone, Serialize, Default)]
pub struct RamTier {
    /// Dense (resident) weights.
    pub dense_bytes: u64,
    /// Experts pinned from the usage history at start, and their bytes.
    pub pinned_experts: usize,
    pub pinned_bytes: u64,
    /// Bytes of the expert cache (pins included); all routed experts when mapped.
    pub cache_bytes: u64,
    /// KV cache and fixed-size state one slot takes at the configured context.
    pub kv_bytes_per_slot: u64,
    pub slots: usize,
    pub context: usize,
    /// Dense weights + expert cache + every slot's KV.
    pub total_bytes: u64,
}

/// The disk tier.
#[derive(Debug, Clone, Serialize, Default)]
pub struct DiskTier {
    /// Routed-expert bytes read from disk on demand (all of them; the cache holds copies).
    pub expert_bytes: u64,
    /// Drives the reads are spread over (the model directory and each mirror).
    pub drives: usize,
}

/// The predicted decode speed of one sequence.
#[derive(Debug, Clone, Serialize)]
pub struct Prediction {
    pub memory_gb_per_s: f64,
    /// Disk bandwidth of all drives together (the measured one times the drives' weights).
    pub disk_gb_per_s: f64,
    pub disk_source: String,
    /// Bytes read per token from RAM for the resident set, from RAM for expert hits, from
    /// disk for expert misses; bytes computed in VRAM (not timed).
    pub resident_bytes_per_token: f64,
    pub expert_hit_bytes_per_token: f64,
    pub expert_miss_bytes_per_token: f64,
    pub vram_bytes_per_token: f64,
    /// Of the active-expert bytes: the fractions served by VRAM, RAM and disk.
    pub vram_fraction: f64,
    pub ram_hit_fraction: f64,
    pub miss_fraction: f64,
    pub seconds_per_token: f64,
    pub decode_tok_per_s: f64,
}

/// The plan: the placement and its prediction.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    #[serde(flatten)]
    pub placement: Placement,
    pub prediction: Prediction,
}

/// Run `coli plan`.
pub fn run(args: PlanArgs) -> Result<()> {
    let loaded = crate::config::load(&args.flags)?;
    let placement = placement(&loaded.config)?;
    let bw = crate::machine::bandwidths(false)?;
    let plan = Plan {
        prediction: predict(&placement, &bw),
        placement,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print_plan(&plan, &bw);
    }
    Ok(())
}

/// The model directory `config` names (the demo model, synthesized on first use, when none),
/// and the default RAM budget it gets (the demo's own; `None`: the machine's default).
pub fn resolve_model(config: &ServeConfig) -> Result<(PathBuf, Option<u64>)> {
    let model = config.model.as_deref().unwrap_or("demo");
    let dir = if model == "demo" {
        crate::demo::ensure()?
    } else {
        PathBuf::from(model)
    };
    let default = if model == "demo" {
        crate::demo::demo_budget(&dir)
    } else {
        None
    };
    Ok((dir, default))
}

/// Describe the model `config` names as `coli serve` would load it (headers only).
pub fn describe(config: &ServeConfig, dir: &Path) -> Result<Described> {
    let e = &config.engine;
    let opts = LoadOptions {
        mla_form: e.mla_form,
        kv_dtype: e.kv_dtype,
        draft: e.draft,
        ..LoadOptions::default()
    };
    colibri::model::describe(dir, &opts)
        .with_context(|| format!("cannot describe the model in {}", dir.display()))
}

/// Where the model's bytes would live with `config` (headers only; the usage history read
/// when learning is on). Errors as `coli serve` would when the resident set does not fit the
/// RAM budget.
pub fn placement(config: &ServeConfig) -> Result<Placement> {
    let (dir, default) = resolve_model(config)?;
    let described = describe(config, &dir)?;
    placement_of(config, &dir, default, &described)
}

/// [`placement`] of a model already described.
pub fn placement_of(
    config: &ServeConfig,
    dir: &Path,
    default_budget: Option<u64>,
    described: &Described,
) -> Result<Placement> {
    let e = &config.engine;
    let info = &described.info;
    let layout = described.layout.as_ref();
    let budget = e.ram_budget(default_budget);
    let ram_budget_source = match (&e.ram, e.mmap, default_budget) {
        (_, true, _) => "mmap: no budget".to_string(),
        (Some(s), _, _) => format!("ram = {s}"),
        (None, _, Some(_)) => "the demo model's default".to_string(),
        (None, _, None) => {
            "default: 80 % of available memory (or of the cgroup's limit), less 1 GiB".to_string()
        }
    };
    let routed_expert_bytes = layout.map_or(0, |l| l.total_bytes());
    let experts_per_layer = layout.map_or_else(Vec::new, |l| l.experts_per_layer());
    // The budget's split, as the tiered store makes it (a model without routed experts has
    // only its resident set to fit).
    let split = match budget {
        None => None,
        Some(b) => Some(match layout {
            Some(l) => split_budget(
                l.checkpoint_bytes,
                l.total_bytes(),
                l.unused_bytes,
                b,
                e.pin_budget.as_ref().map(|s| s.bytes),
            )?,
            None => split_budget(info.dense_bytes as u64, 0, 0, b, Some(0))?,
        }),
    };
    let dense_bytes = split.map_or(info.dense_bytes as u64, |s| s.resident);
    let (history, history_text) = match (layout, e.no_learn) {
        (None, _) => (None, "no routed experts".to_string()),
        (Some(_), true) => (
            None,
            "no_learn: no usage history; uniform routing assumed".to_string(),
        ),
        (Some(_), false) => crate::mirror_cmd::load_history(dir, &experts_per_layer),
    };
    let uniform = history.is_none();
    let bytes_of = |l: usize, x: usize| layout.map_or(0, |lay| lay.expert_bytes(l, x));
    let mut place: Vec<Vec<Place>> = experts_per_layer
        .iter()
        .map(|&n| vec![Place::Disk; n])
        .collect();

    // Embedding table estimate (one row of it is read per token unless the LM head is it).
    let total_params = info.total_params.max(1) as f64;
    let checkpoint_bytes = layout.map_or((info.dense_bytes + info.unused_bytes) as u64, |l| {
        l.checkpoint_bytes
    });
    let bytes_per_param = checkpoint_bytes as f64 / total_params;
    let embedding_params = (info.vocab_size * info.hidden_size) as u64;
    let tied_embeddings = colibri::format::config::ModelConfig::from_model_dir(dir)
        .ok()
        .and_then(|c| c.bool_or("tie_word_embeddings", false).ok())
        .unwrap_or(false);
    let embedding_bytes = if tied_embeddings {
        0
    } else {
        ((embedding_params as f64 * bytes_per_param) as u64).min(dense_bytes)
    };

    // The VRAM tier, when a device is configured with a budget.
    let mut vram = VramTier::default();
    if e.device == DeviceChoice::Cpu {
        vram.note = "device = cpu: no VRAM tier".into();
    } else if let Some(v) = &e.vram {
        let budget = v.bytes;
        vram.budget = Some(budget);
        vram.dense_bytes = dense_bytes.saturating_sub(embedding_bytes).min(budget);
        let mut left = budget - vram.dense_bytes;
        let hottest = history
            .as_ref()
            .map_or_else(Vec::new, |h| h.hottest(|_, _| 0, 0));
        for (l, x) in colibri::store::vram::fill_order(hottest, &experts_per_layer) {
            if left == 0 {
                break;
            }
            let b = bytes_of(l, x);
            if b <= left {
                left -= b;
                place[l][x] = Place::Vram;
                vram.experts += 1;
                vram.expert_bytes += b;
            }
        }
        vram.note = format!(
            "if a {} device opens: dense matrices first (estimated), then experts at their \
             stored size (formats the device computes dequantized take more)",
            crate::engine_options::value_name(&e.device)
        );
    } else {
        vram.note = format!(
            "device = {}: give --vram SIZE to plan a VRAM tier (plan does not open the device)",
            crate::engine_options::value_name(&e.device)
        );
    }

    // The RAM tier: pins, then the cache's steady state (the hottest that fit).
    let mut ram = RamTier {
        dense_bytes,
        slots: config.slots,
        context: if config.context == 0 {
            info.max_position_embeddings
        } else {
            config.context
        },
        ..RamTier::default()
    };
    match split {
        None => {
            ram.cache_bytes = routed_expert_bytes;
            for row in place.iter_mut() {
                for p in row.iter_mut().filter(|p| **p == Place::Disk) {
                    *p = Place::Cached;
                }
            }
        }
        Some(s) => {
            ram.cache_bytes = s.cache;
            if let Some(h) = &history {
                for (l, x) in h.hottest(bytes_of, s.pin_budget) {
                    ram.pinned_experts += 1;
                    ram.pinned_bytes += bytes_of(l, x);
                    if place[l][x] == Place::Disk {
                        place[l][x] = Place::Pinned;
                    }
                }
                let mut left = s.cache.saturating_sub(ram.pinned_bytes);
                for (l, x) in h.hottest(|_, _| 0, 0) {
                    let b = bytes_of(l, x);
                    if place[l][x] == Place::Disk && b <= left {
                        left -= b;
                        place[l][x] = Place::Cached;
                    }
                }
            }
        }
    }
    ram.kv_bytes_per_slot =
        (info.kv_bytes_per_token * ram.context + info.state_bytes_per_sequence) as u64;
    ram.total_bytes = dense_bytes + ram.cache_bytes + ram.kv_bytes_per_slot * ram.slots as u64;

    // Each expert's share of its layer's routing.
    let mut experts = Vec::new();
    for (l, row) in place.iter().enumerate() {
        let n = row.len();
        let total: f64 = history
            .as_ref()
            .map_or(0.0, |h| (0..n).map(|x| h.count(l, x)).sum());
        for (x, &p) in row.iter().enumerate() {
            let share = match &history {
                Some(h) if total > 0.0 => h.count(l, x) / total,
                _ => 1.0 / n as f64,
            };
            experts.push(ExpertFacts {
                bytes: bytes_of(l, x),
                share,
                place: p,
            });
        }
    }
    let mirror_weights = if e.mirror_weights.is_empty() {
        vec![1.0; e.mirrors.len()]
    } else {
        e.mirror_weights.clone()
    };
    Ok(Placement {
        model: dir.to_path_buf(),
        model_type: info.model_type.clone(),
        mode: if split.is_some() { "tiered" } else { "mapped" }.into(),
        ram_budget: budget,
        ram_budget_source,
        dense_bytes,
        routed_expert_bytes,
        routed_experts: info.routed_experts,
        moe_layers: info.moe_layers,
        active_experts: info.active_experts,
        split,
        vram,
        ram,
        disk: DiskTier {
            expert_bytes: if split.is_some() {
                routed_expert_bytes
            } else {
                0
            },
            drives: 1 + e.mirrors.len(),
        },
        history: history_text,
        experts,
        bytes_per_param,
        embedding_params,
        hidden_size: info.hidden_size,
        tied_embeddings,
        uniform,
        mirror_weights,
    })
}

/// The decode speed `p` predicts with bandwidths `bw` (see the module comment).
pub fn predict(p: &Placement, bw: &Bandwidths) -> Prediction {
    let k = p.active_experts as f64;
    // Active-expert bytes per token, and how they split over the tiers.
    let (mut vram_b, mut ram_b, mut miss_b) = (0.0f64, 0.0f64, 0.0f64);
    for x in &p.experts {
        let b = k * x.share * x.bytes as f64;
        match x.place {
            Place::Vram => vram_b += b,
            Place::Pinned | Place::Cached => ram_b += b,
            Place::Disk => miss_b += b,
        }
    }
    let active = vram_b + ram_b + miss_b;
    if p.uniform && p.mode == "tiered" && active > 0.0 {
        // Uniform routing: hit fraction = cache bytes / routed-expert bytes outside VRAM.
        let outside = (p.routed_expert_bytes - p.vram.expert_bytes) as f64;
        let f = if outside > 0.0 {
            (p.ram.cache_bytes as f64 / outside).min(1.0)
        } else {
            1.0
        };
        let rest = ram_b + miss_b;
        ram_b = rest * f;
        miss_b = rest - ram_b;
    }
    let embedding = if p.tied_embeddings {
        0.0
    } else {
        (p.embedding_params as f64 * p.bytes_per_param).min(p.dense_bytes as f64)
    };
    // The one row of the table a token reads.
    let row = if p.tied_embeddings {
        0.0
    } else {
        p.hidden_size as f64 * p.bytes_per_param
    };
    let resident = (p.dense_bytes as f64 - embedding + row - p.vram.dense_bytes as f64).max(0.0);
    let memory = bw.memory_gb_per_s * 1e9;
    let disk = bw.disk_gb_per_s * 1e9 * (1.0 + p.mirror_weights.iter().sum::<f64>());
    let seconds = resident / memory + ram_b / memory + miss_b / disk;
    let frac = |b: f64| if active > 0.0 { b / active } else { 0.0 };
    Prediction {
        memory_gb_per_s: bw.memory_gb_per_s,
        disk_gb_per_s: disk / 1e9,
        disk_source: bw.disk_source.clone(),
        resident_bytes_per_token: resident,
        expert_hit_bytes_per_token: ram_b,
        expert_miss_bytes_per_token: miss_b,
        vram_bytes_per_token: vram_b + p.vram.dense_bytes as f64,
        vram_fraction: frac(vram_b),
        ram_hit_fraction: frac(ram_b),
        miss_fraction: frac(miss_b),
        seconds_per_token: seconds,
        decode_tok_per_s: if seconds > 0.0 { 1.0 / seconds } else { 0.0 },
    }
}

fn print_plan(plan: &Plan, bw: &Bandwidths) {
    let p = &plan.placement;
    let q = &plan.prediction;
    let size = format_size;
    println!("model:   {} ({})", p.model.display(), p.model_type);
    if p.moe_layers > 0 {
        println!(
            "experts: {} routed in each of {} MoE layers, {} per token; {} in all",
            p.routed_experts,
            p.moe_layers,
            p.active_experts,
            size(p.routed_expert_bytes)
        );
    }
    match (p.mode.as_str(), p.ram_budget) {
        ("tiered", Some(b)) => println!(
            "mode:    tiered: RAM budget {} ({}); experts read from disk into the cache",
            size(b),
            p.ram_budget_source
        ),
        _ => println!("mode:    memory-mapped (mmap): every weight mapped, no budget"),
    }
    println!("ranking: {}", p.history);
    println!();
    let row = |tier: &str, dense: String, experts: String, kv: String| {
        println!("{tier:<6} {dense:>12}   {experts:<44} {kv}");
    };
    row("tier", "dense".into(), "experts".into(), "KV/state".into());
    match p.vram.budget {
        Some(b) => row(
            "VRAM",
            size(p.vram.dense_bytes),
            format!(
                "{} in VRAM ({} experts), budget {}",
                size(p.vram.expert_bytes),
                p.vram.experts,
                size(b)
            ),
            "-".into(),
        ),
        None => row("VRAM", "-".into(), "-".into(), "-".into()),
    }
    row(
        "RAM",
        size(p.ram.dense_bytes),
        if p.mode == "tiered" {
            format!(
                "{} cache, {} pinned ({} experts)",
                size(p.ram.cache_bytes),
                size(p.ram.pinned_bytes),
                p.ram.pinned_experts
            )
        } else {
            format!("{} mapped", size(p.ram.cache_bytes))
        },
        format!(
            "{} per slot × {} slots",
            size(p.ram.kv_bytes_per_slot),
            p.ram.slots
        ),
    );
    row(
        "disk",
        "-".into(),
        if p.disk.expert_bytes > 0 {
            format!("{}, read on demand", size(p.disk.expert_bytes))
        } else {
            "-".into()
        },
        "-".into(),
    );
    if p.vram.budget.is_none() || !p.vram.note.is_empty() {
        println!("VRAM:    {}", p.vram.note);
    }
    println!(
        "RAM:     {} in all (dense + cache + KV at a context of {} tokens per slot)",
        size(p.ram.total_bytes),
        p.ram.context
    );
    if p.disk.drives > 1 {
        println!("disk:    reads spread over {} drives", p.disk.drives);
    }
    println!();
    println!(
        "predicted decode: {:.2} tok/s for one sequence ({:.2} ms per token)",
        q.decode_tok_per_s,
        q.seconds_per_token * 1e3
    );
    println!(
        "  = 1 / ({} resident / {:.1} GB/s + {} expert hits / {:.1} GB/s + {} expert misses / {:.2} GB/s)",
        size(q.resident_bytes_per_token as u64),
        q.memory_gb_per_s,
        size(q.expert_hit_bytes_per_token as u64),
        q.memory_gb_per_s,
        size(q.expert_miss_bytes_per_token as u64),
        q.disk_gb_per_s
    );
    println!(
        "  active-expert bytes: {:.1} % in VRAM (not timed), {:.1} % RAM hits, {:.1} % disk misses",
        q.vram_fraction * 100.0,
        q.ram_hit_fraction * 100.0,
        q.miss_fraction * 100.0
    );
    println!(
        "  bandwidths: memory {:.1} GB/s, disk {:.2} GB/s ({}; `coli bench --remeasure` to measure again)",
        bw.memory_gb_per_s, bw.disk_gb_per_s, bw.disk_source
    );
}
