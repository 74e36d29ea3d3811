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
//! seconds per token = resident bytes read per token / dense compute rate
//!                   + active-expert bytes (hits and misses) / expert compute rate
//!                   + active-expert bytes missed × (from page cache / page-cache rate
//!                                                   + from disk / disk bandwidth)
//! compute rate      = the decode kernel's rate on the model's matrices (dense, or routed
//!                     experts'), at most the memory bandwidth
//! ```
//!
//! with the rates [`crate::machine`] measures (memory, disk and page-cache reads by `coli
//! bench --remeasure`, measured now if none are cached; the decode kernel per matrix format,
//! shape and thread count the first time a plan needs it, [`crate::machine::kernel_rates`]).
//! A compute rate is the kernels' harmonic mean over the model's matrix shapes
//! ([`colibri::model::matrix_shapes`]) weighted by their bytes, each shape timed the way decode
//! runs it (a dense matrix alone, a MoE layer's active experts of one shape in one parallel
//! step): on a machine whose cores cannot keep up with its memory, and with small matrices
//! whose steps cost more than their bytes, decode runs below the memory roofline.
//! The disk bandwidth is multiplied by the drives' relative weights when mirrors are
//! configured. A miss is read from the page cache when the reads are buffered (no
//! `direct_io`) and the file is there: the share assumed so is the memory left beside the
//! plan's RAM total (the machine's available memory, which counts the page cache, less that
//! total) over the routed-expert bytes, at most 1; with `direct_io` every miss is a disk read.
//! Pinned experts always hit; the rest of the cache holds what recent tokens used (LRU), whose
//! hit probabilities follow Che's approximation under each layer's routing distribution from
//! the usage history's counts, or uniform routing without a history (hit fraction = cache
//! bytes / routed-expert bytes). Prefetching hides reads, it does not save them: a prefetched
//! expert is still read, so it counts as a miss here (`coli bench` counts it as a hit). The resident
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
    mirror_weights: Vec<f64>,
    /// The model's weight matrices by format and shape (what the kernels are timed on).
    #[serde(skip)]
    matrices: Vec<colibri::model::MatrixShape>,
    /// Compute threads (0: every core).
    #[serde(skip)]
    threads: usize,
    /// Experts read with O_DIRECT (never from the page cache).
    #[serde(skip)]
    direct_io: bool,
    /// The machine's available memory now (page cache included), if known.
    #[serde(skip)]
    available_memory: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
struct ExpertFacts {
    bytes: u64,
    /// Probability that one of the layer's routed slots picks this expert.
    share: f64,
    place: Place,
    /// Probability that it is in RAM when a token needs it (1 pinned or mapped; the
    /// cache's LRU steady state otherwise, [`lru_hit_probabilities`]).
    hit: f64,
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
    /// The decode kernel's measured rate on each of the model's matrix shapes at the
    /// configured threads.
    pub kernels: Vec<KernelRate>,
    /// The rates dense weights and active experts are computed at (GB/s of weight bytes).
    pub dense_compute_gb_per_s: f64,
    pub expert_compute_gb_per_s: f64,
    /// Expert-sized reads from the page cache through the store's reader (GB/s), and the
    /// share of the misses assumed to be served so (0 with `direct_io`).
    pub page_cache_gb_per_s: f64,
    pub page_cache_miss_fraction: f64,
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

/// The decode kernel's rate on the matrices of one shape of the model.
#[derive(Debug, Clone, Serialize)]
pub struct KernelRate {
    pub format: String,
    pub rows: usize,
    pub cols: usize,
    /// Routed experts' matrices (else dense), and how many one parallel step multiplies.
    pub expert: bool,
    pub group: usize,
    /// Bytes of these matrices in the model.
    pub bytes: u64,
    /// Measured GB/s (`None`: no plain kernel; counted at the memory bandwidth).
    pub gb_per_s: Option<f64>,
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
    let (bw, page_cache, kernels) = kernel_rates(&placement)?;
    let plan = Plan {
        prediction: predict(&placement, &bw, page_cache, &kernels),
        placement,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print_plan(&plan, &bw);
    }
    Ok(())
}

/// The decode kernel's rate on each matrix shape of `p`'s model at its threads (measured
/// now where `machine.json` has none), with the machine's bandwidths.
pub fn kernel_rates(p: &Placement) -> Result<(Bandwidths, f64, Vec<KernelRate>)> {
    let per_layer = (p.routed_experts * p.moe_layers).max(1);
    // Between two uses of a matrix the rest of a token's weights stream through the caches:
    // each shape is timed cycling through as many bytes as all the model's matrices (at most
    // 256 MiB), not only its own.
    let model_bytes: u64 = p.matrices.iter().map(|m| m.bytes).sum();
    let shapes: Vec<crate::machine::KernelShape> = p
        .matrices
        .iter()
        .map(|m| crate::machine::KernelShape {
            dtype: m.dtype,
            rows: m.rows,
            cols: m.cols,
            // A layer's active experts' matrices of this shape go in one step (gate and up
            // together when they have one shape).
            group: if m.expert {
                p.active_experts.max(1)
                    * (m.count as f64 / per_layer as f64).round().max(1.0) as usize
            } else {
                1
            },
            working_set: model_bytes,
        })
        .collect();
    let (bw, page_cache, rates) = crate::machine::kernel_rates(&shapes, p.threads)?;
    let kernels = shapes
        .iter()
        .zip(&p.matrices)
        .zip(rates)
        .map(|((s, m), r)| KernelRate {
            format: m.dtype.to_string(),
            rows: m.rows,
            cols: m.cols,
            expert: m.expert,
            group: s.group,
            bytes: m.bytes,
            gb_per_s: r,
        })
        .collect();
    Ok((bw, page_cache, kernels))
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
    let matrices = colibri::model::matrix_shapes(dir).with_context(|| {
        format!(
            "cannot read the weight matrices of the model in {}",
            dir.display()
        )
    })?;
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
                hit: match p {
                    Place::Pinned | Place::Vram => 1.0,
                    _ if split.is_none() => 1.0,
                    _ => 0.0,
                },
            });
        }
    }
    // The cache's unpinned part holds what recent tokens used (LRU).
    if let Some(s) = split {
        let lru: Vec<usize> = (0..experts.len())
            .filter(|&i| matches!(experts[i].place, Place::Cached | Place::Disk))
            .collect();
        let uses: Vec<(f64, f64)> = lru
            .iter()
            .map(|&i| {
                let x = &experts[i];
                (info.active_experts as f64 * x.share, x.bytes as f64)
            })
            .collect();
        let capacity = s.cache.saturating_sub(ram.pinned_bytes) as f64;
        for (&i, h) in lru.iter().zip(lru_hit_probabilities(&uses, capacity)) {
            experts[i].hit = h;
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
        mirror_weights,
        matrices,
        threads: e.threads,
        direct_io: e.direct_io,
        available_memory: colibri::store::budget::available_memory(),
    })
}

/// Che's approximation of an LRU cache of `capacity` bytes: for items each used `rate` times
/// per token (independently) with `bytes` each, the probability each is in the cache when
/// used, `1 − exp(−rate · T)`, where the characteristic time `T` (tokens) fills the cache:
/// `Σ bytes · (1 − exp(−rate · T)) = capacity`. Everything hits when all that is ever used
/// fits. (For equal rates and sizes this is `capacity / total bytes`, uniform routing's
/// fraction.)
fn lru_hit_probabilities(items: &[(f64, f64)], capacity: f64) -> Vec<f64> {
    let used: f64 = items
        .iter()
        .filter(|&&(rate, _)| rate > 0.0)
        .map(|&(_, b)| b)
        .sum();
    if capacity >= used {
        return items
            .iter()
            .map(|&(rate, _)| if rate > 0.0 { 1.0 } else { 0.0 })
            .collect();
    }
    let filled = |t: f64| -> f64 {
        items
            .iter()
            .map(|&(rate, b)| b * -(-rate * t).exp_m1())
            .sum()
    };
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while filled(hi) < capacity && hi < 1e18 {
        hi *= 2.0;
    }
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if filled(mid) < capacity {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let t = 0.5 * (lo + hi);
    items
        .iter()
        .map(|&(rate, _)| -(-rate * t).exp_m1())
        .collect()
}

/// The decode speed `p` predicts with bandwidths `bw`, the page cache's read rate
/// `page_cache_gb_per_s` and the decode kernel's rates `kernels`
/// ([`kernel_rates`]; see the module comment).
pub fn predict(
    p: &Placement,
    bw: &Bandwidths,
    page_cache_gb_per_s: f64,
    kernels: &[KernelRate],
) -> Prediction {
    let k = p.active_experts as f64;
    // Active-expert bytes per token, and how they split over the tiers.
    let (mut vram_b, mut ram_b, mut miss_b) = (0.0f64, 0.0f64, 0.0f64);
    for x in &p.experts {
        let b = k * x.share * x.bytes as f64;
        match x.place {
            Place::Vram => vram_b += b,
            _ => {
                ram_b += b * x.hit;
                miss_b += b * (1.0 - x.hit);
            }
        }
    }
    let active = vram_b + ram_b + miss_b;
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
    // The kernels' rate over the model's dense or expert matrices: their bytes over the
    // seconds each shape's bytes take (a format without a kernel at the memory bandwidth).
    let compute = |expert: bool| {
        let (bytes, secs) =
            kernels
                .iter()
                .filter(|k| k.expert == expert)
                .fold((0.0f64, 0.0f64), |(b, t), k| {
                    let rate = k.gb_per_s.map_or(memory, |r| (r * 1e9).min(memory));
                    (b + k.bytes as f64, t + k.bytes as f64 / rate)
                });
        if secs > 0.0 {
            (bytes / secs).min(memory)
        } else {
            memory
        }
    };
    let (dense_rate, expert_rate) = (compute(false), compute(true));
    let disk = bw.disk_gb_per_s * 1e9 * (1.0 + p.mirror_weights.iter().sum::<f64>());
    let page_cache = page_cache_gb_per_s * 1e9;
    // Misses served by the page cache: buffered reads, as much of the expert files as the
    // memory beside the plan's own holds.
    let cached_share = match (p.direct_io, p.available_memory) {
        (true, _) | (_, None) => 0.0,
        _ if p.disk.expert_bytes == 0 => 0.0,
        (false, Some(avail)) => {
            (avail.saturating_sub(p.ram.total_bytes) as f64 / p.disk.expert_bytes as f64).min(1.0)
        }
    };
    let seconds = resident / dense_rate
        + (ram_b + miss_b) / expert_rate
        + miss_b * cached_share / page_cache
        + miss_b * (1.0 - cached_share) / disk;
    let frac = |b: f64| if active > 0.0 { b / active } else { 0.0 };
    Prediction {
        memory_gb_per_s: bw.memory_gb_per_s,
        kernels: kernels.to_vec(),
        dense_compute_gb_per_s: dense_rate / 1e9,
        expert_compute_gb_per_s: expert_rate / 1e9,
        page_cache_gb_per_s: page_cache / 1e9,
        page_cache_miss_fraction: cached_share,
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
        "  = 1 / ({} resident / {:.1} GB/s + {} active experts / {:.1} GB/s + reading the {} missed: {:.0} % from the page cache at {:.1} GB/s, the rest from disk at {:.2} GB/s)",
        size(q.resident_bytes_per_token as u64),
        q.dense_compute_gb_per_s,
        size((q.expert_hit_bytes_per_token + q.expert_miss_bytes_per_token) as u64),
        q.expert_compute_gb_per_s,
        size(q.expert_miss_bytes_per_token as u64),
        q.page_cache_miss_fraction * 100.0,
        q.page_cache_gb_per_s,
        q.disk_gb_per_s
    );
    println!(
        "  compute: the decode kernel on each matrix shape (memory {:.1} GB/s at most):",
        q.memory_gb_per_s
    );
    for k in &q.kernels {
        println!(
            "    {:<7} {:>6} x {:<6} {:<6} {:>3} per step  {:>10}  {}",
            k.format,
            k.rows,
            k.cols,
            if k.expert { "expert" } else { "dense" },
            k.group,
            size(k.bytes),
            k.gb_per_s
                .map_or("no kernel: memory rate".to_string(), |r| format!(
                    "{r:.1} GB/s"
                ))
        );
    }
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
