//! Where weights live, and the expert store MoE blocks acquire routed experts from.
//!
//! The contract (see ARCHITECTURE.md): a MoE block routes its batch, forms the union of the
//! selected experts and calls [`ExpertStore::acquire`] for that layer; the returned [`Lease`]
//! hands out the experts and keeps them from eviction while held. [`ExpertStore::hint`] is an
//! advisory prefetch that can only change what is already in memory, never a result.
//! The model never reads files itself.
//!
//! This first store, [`ResidentStore`], keeps every expert mapped in memory. The tiered store
//! (RAM budget, disk streaming, cache and prefetch) implements the same trait.

pub mod budget;
pub mod fault;
pub mod history;
pub mod mirror;
pub mod reader;
pub mod staging;
pub mod tiered;
pub mod vram;

use std::sync::mpsc::Receiver;
use std::sync::Arc;

use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The three matrices of a SwiGLU expert: `gate` and `up` are `[I, D]`, `down` is `[D, I]`.
#[derive(Debug, Clone)]
pub struct Expert {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

impl Expert {
    /// Bytes of the three matrices.
    pub fn nbytes(&self) -> usize {
        self.gate.nbytes() + self.up.nbytes() + self.down.nbytes()
    }
}

/// The names and shapes of one expert's tensors in a checkpoint.
#[derive(Debug, Clone)]
pub struct ExpertNames {
    pub gate: String,
    pub up: String,
    pub down: String,
}

/// The expert-name table `names[layer][expert]`: `experts` routed experts (the value of the
/// config's `field`, already checked against the experts the checkpoint numbers by
/// `model::expert_count`), named by `name(layer, expert)`, in each layer `moe` marks (the
/// others get an empty list). The whole table is checked against the checkpoint's tensor
/// count before it is built (every expert has three matrices), so no combination of counts
/// builds more names than the checkpoint has tensors.
pub fn expert_table(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    field: &str,
    moe: &[bool],
    experts: usize,
    name: impl Fn(usize, usize) -> ExpertNames,
) -> Result<Vec<Vec<ExpertNames>>> {
    let moe_layers = moe.iter().filter(|&&m| m).count();
    if moe_layers > 0 {
        if experts == 0 {
            return Err(cfg.error(field, "is 0, but MoE layers route to at least one expert"));
        }
        let needed = experts
            .checked_mul(moe_layers)
            .and_then(|n| n.checked_mul(3));
        let have = ckpt.described();
        if needed.is_none_or(|n| n > have) {
            return Err(cfg.error(
                field,
                format!(
                    "{experts} routed experts in each of {moe_layers} MoE layers need {} expert \
                     matrices, but the checkpoint describes only {have} tensors",
                    needed.map_or("more".to_string(), |n| n.to_string())
                ),
            ));
        }
    }
    Ok(moe
        .iter()
        .enumerate()
        .map(|(l, &is_moe)| {
            if is_moe {
                (0..experts).map(|e| name(l, e)).collect()
            } else {
                Vec::new()
            }
        })
        .collect())
}

/// Experts of one layer, handed out as they become ready (cached ones at once, misses as
/// their reads complete), and held while the lease lives.
pub struct Lease {
    ready: std::vec::IntoIter<(usize, Arc<Expert>)>,
    pending: usize,
    arrivals: Option<Receiver<Arrival>>,
    wait_ns: Option<Arc<std::sync::atomic::AtomicU64>>,
}

/// Experts handed out together by [`Lease::next_ready`]: ids and matrices.
pub type ReadyExperts = Vec<(usize, Arc<Expert>)>;

/// An expert delivered to a lease: its id and matrices, or the read error.
pub type Arrival = Result<(usize, Arc<Expert>)>;

impl Lease {
    /// A lease whose experts are all ready now.
    pub fn ready_now(experts: Vec<(usize, Arc<Expert>)>) -> Lease {
        Lease {
            ready: experts.into_iter(),
            pending: 0,
            arrivals: None,
            wait_ns: None,
        }
    }

    /// A lease with some experts ready and `pending` more arriving on `arrivals`; time spent
    /// waiting for them is added to `wait_ns`.
    pub fn with_pending(
        ready: Vec<(usize, Arc<Expert>)>,
        pending: usize,
        arrivals: Receiver<Arrival>,
        wait_ns: Arc<std::sync::atomic::AtomicU64>,
    ) -> Lease {
        Lease {
            ready: ready.into_iter(),
            pending,
            arrivals: Some(arrivals),
            wait_ns: Some(wait_ns),
        }
    }

    /// This lease with `first` handed out before its own experts (the VRAM tier's).
    pub(crate) fn prepend(mut self, first: Vec<(usize, Arc<Expert>)>) -> Lease {
        let mut ready = first;
        ready.extend(self.ready);
        self.ready = ready.into_iter();
        self
    }

    /// Every expert that is ready now (waiting for one if none is), or `None` when all have
    /// been handed out: a caller computes each batch in one step while later reads land.
    pub fn next_ready(&mut self) -> Option<Result<ReadyExperts>> {
        let mut batch: Vec<(usize, Arc<Expert>)> = self.ready.by_ref().collect();
        if batch.is_empty() {
            match self.next_expert()? {
                Ok(e) => batch.push(e),
                Err(e) => return Some(Err(e)),
            }
        }
        while self.pending > 0 {
            let Some(arrivals) = self.arrivals.as_ref() else {
                break;
            };
            match arrivals.try_recv() {
                Ok(Ok(e)) => {
                    self.pending -= 1;
                    batch.push(e);
                }
                Ok(Err(e)) => {
                    self.pending -= 1;
                    return Some(Err(e));
                }
                Err(_) => break,
            }
        }
        Some(Ok(batch))
    }

    /// The next ready expert (blocking until one arrives), or `None` when all were handed out.
    /// A failed read is returned as an error.
    pub fn next_expert(&mut self) -> Option<Result<(usize, Arc<Expert>)>> {
        if let Some(e) = self.ready.next() {
            return Some(Ok(e));
        }
        if self.pending == 0 {
            return None;
        }
        self.pending -= 1;
        let t0 = std::time::Instant::now();
        let got = self.arrivals.as_ref()?.recv();
        if let Some(w) = &self.wait_ns {
            w.fetch_add(
                t0.elapsed().as_nanos() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
        }
        match got {
            Ok(r) => Some(r),
            Err(_) => Some(Err(Error::Invalid(
                "the expert reader stopped before delivering every expert".into(),
            ))),
        }
    }
}

/// A source of routed experts.
pub trait ExpertStore: Send + Sync {
    /// Make the given experts of `layer` available and hold them while the lease lives.
    fn acquire(&self, layer: usize, experts: &[usize]) -> Result<Lease>;
    /// Advisory: these experts of `layer` will probably be wanted soon. Only changes what is
    /// in memory, never a result.
    fn hint(&self, _layer: usize, _experts: &[usize]) {}
    /// Whether [`hint`](Self::hint) does anything (so callers can skip computing guesses).
    fn wants_hints(&self) -> bool {
        false
    }
    /// `tokens` more tokens went through the model (for usage history).
    fn step_done(&self, _tokens: usize) {}
    /// Persist what the store learned (usage history). Called at the end of a run; waits for
    /// a background save in progress (see [`flush_soon`](Self::flush_soon)), then saves.
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    /// Persist what the store learned on a background thread, soon; returns at once (the
    /// engine waits only while the history is copied). Saves land in the order they were
    /// asked for; one that fails is logged. Called by the server while it runs.
    fn flush_soon(&self) {}
    /// Counters so far, if this store keeps any.
    fn stats(&self) -> Option<StoreSnapshot> {
        None
    }
    /// Every expert the usage history has seen, hottest first (empty without one).
    fn hottest(&self) -> Vec<(usize, usize)> {
        Vec::new()
    }
    /// These experts of `layer` were used without being acquired here (a tier above served
    /// them): count them in the usage history.
    fn note_uses(&self, _layer: usize, _experts: &[usize]) {}
    /// Bytes of all routed experts.
    fn total_bytes(&self) -> usize;
}

/// Counters of an expert store at one moment.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StoreSnapshot {
    /// Experts asked for that were in memory, and their bytes.
    pub hits: u64,
    pub hit_bytes: u64,
    /// Experts asked for that had to be read (or were still being read), and their bytes.
    pub misses: u64,
    pub miss_bytes: u64,
    /// Bytes read from disk (misses and prefetches).
    pub bytes_read: u64,
    /// Time the model spent waiting for expert reads.
    pub io_wait_seconds: f64,
    /// Prefetch reads started, their bytes, and the bytes later used.
    pub prefetch_reads: u64,
    pub prefetch_bytes: u64,
    pub prefetch_useful_bytes: u64,
    /// Of the experts a layer used after a hint, how many the hint had guessed.
    pub prefetch_guessed: u64,
    pub prefetch_needed: u64,
    /// Bytes the cache may hold, bytes it holds, bytes pinned.
    pub cache_capacity: u64,
    pub cache_used: u64,
    pub pinned_bytes: u64,
    /// How experts are read (for the start-up report).
    pub reader: String,
    /// Bytes served per drive when mirrors spread the reads (model directory first).
    pub drives: Vec<(String, u64)>,
    /// Experts served from VRAM, and their bytes (also counted in `hits`, `hit_bytes`).
    pub vram_hits: u64,
    pub vram_hit_bytes: u64,
    /// Experts held in VRAM, and their bytes.
    pub vram_experts: u64,
    pub vram_bytes: u64,
    /// The device computing them (empty on the CPU), and the bytes of every matrix on it
    /// (dense and experts).
    pub device: String,
    pub device_bytes: u64,
    /// Bytes uploaded to the device and the seconds it took (dense matrices and experts).
    pub device_upload_bytes: u64,
    pub device_upload_seconds: f64,
    /// Products the device computed, their seconds seen from the host, and the kernels'
    /// own seconds by the device's timestamps.
    pub device_products: u64,
    pub device_product_seconds: f64,
    pub device_kernel_seconds: f64,
}

impl StoreSnapshot {
    /// Hit rate by count.
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }

    /// Hit rate by bytes.
    pub fn byte_hit_rate(&self) -> f64 {
        let n = self.hit_bytes + self.miss_bytes;
        if n == 0 {
            0.0
        } else {
            self.hit_bytes as f64 / n as f64
        }
    }

    /// Prefetch recall: guessed ∩ used over used.
    pub fn prefetch_recall(&self) -> f64 {
        if self.prefetch_needed == 0 {
            0.0
        } else {
            self.prefetch_guessed as f64 / self.prefetch_needed as f64
        }
    }

    /// The difference `self − earlier` of the counters (capacity and usage are `self`'s).
    pub fn since(&self, earlier: &StoreSnapshot) -> StoreSnapshot {
        StoreSnapshot {
            hits: self.hits - earlier.hits,
            hit_bytes: self.hit_bytes - earlier.hit_bytes,
            misses: self.misses - earlier.misses,
            miss_bytes: self.miss_bytes - earlier.miss_bytes,
            bytes_read: self.bytes_read - earlier.bytes_read,
            io_wait_seconds: self.io_wait_seconds - earlier.io_wait_seconds,
            prefetch_reads: self.prefetch_reads - earlier.prefetch_reads,
            prefetch_bytes: self.prefetch_bytes - earlier.prefetch_bytes,
            prefetch_useful_bytes: self.prefetch_useful_bytes - earlier.prefetch_useful_bytes,
            prefetch_guessed: self.prefetch_guessed - earlier.prefetch_guessed,
            prefetch_needed: self.prefetch_needed - earlier.prefetch_needed,
            vram_hits: self.vram_hits - earlier.vram_hits,
            vram_hit_bytes: self.vram_hit_bytes - earlier.vram_hit_bytes,
            device_upload_bytes: self.device_upload_bytes - earlier.device_upload_bytes,
            device_upload_seconds: self.device_upload_seconds - earlier.device_upload_seconds,
            device_products: self.device_products - earlier.device_products,
            device_product_seconds: self.device_product_seconds - earlier.device_product_seconds,
            device_kernel_seconds: self.device_kernel_seconds - earlier.device_kernel_seconds,
            ..self.clone()
        }
    }
}

/// Every expert memory-mapped and resident.
pub struct ResidentStore {
    layers: Vec<Vec<Arc<Expert>>>,
}

impl ResidentStore {
    /// Load the experts named by `names[layer][expert]`, checking shapes `[I, D]` / `[D, I]`.
    /// Layers without routed experts have an empty list. Experts of a layer load in parallel
    /// (mapping is instant; split FP4 experts are repacked into owned MXFP4 buffers), and
    /// their interleaved copies ([`Tensor::interleaved_for_cpu_all`]) share one map.
    pub fn open(
        ckpt: &Checkpoint,
        names: &[Vec<ExpertNames>],
        hidden: usize,
        intermediate: usize,
    ) -> Result<ResidentStore> {
        use rayon::prelude::*;
        let layers = names
            .iter()
            .map(|layer| {
                let weights = layer
                    .par_iter()
                    .map(|n| {
                        Ok([
                            ckpt.weight(&n.gate, &[intermediate, hidden])?,
                            ckpt.weight(&n.up, &[intermediate, hidden])?,
                            ckpt.weight(&n.down, &[hidden, intermediate])?,
                        ])
                    })
                    .collect::<Result<Vec<_>>>()?;
                // Rows interleaved for the CPU's products where that pays and the load's
                // grant has room (the same bits), the layer's copies in one map.
                let mut weights =
                    Tensor::interleaved_for_cpu_all(weights.into_iter().flatten().collect())
                        .into_iter();
                let mut next = || weights.next().expect("three weights per expert");
                Ok((0..layer.len())
                    .map(|_| {
                        Arc::new(Expert {
                            gate: next(),
                            up: next(),
                            down: next(),
                        })
                    })
                    .collect())
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ResidentStore { layers })
    }
}

impl ExpertStore for ResidentStore {
    fn acquire(&self, layer: usize, experts: &[usize]) -> Result<Lease> {
        let table = self
            .layers
            .get(layer)
            .ok_or_else(|| Error::Invalid(format!("no routed experts in layer {layer}")))?;
        let experts = experts
            .iter()
            .map(|&e| {
                table.get(e).map(|x| (e, x.clone())).ok_or_else(|| {
                    Error::Invalid(format!("expert {e} out of range in layer {layer}"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Lease::ready_now(experts))
    }

    fn total_bytes(&self) -> usize {
        self.layers.iter().flatten().map(|e| e.nbytes()).sum()
    }
}

/// How routed experts are placed.
#[derive(Debug, Clone, Default)]
pub struct StoreOptions {
    /// RAM budget in bytes for resident weights plus the expert cache. `None`: everything
    /// resident (memory-mapped).
    pub ram_budget: Option<u64>,
    /// I/O threads reading expert misses (0: a default of 4).
    pub io_threads: usize,
    /// Start reads of the next layer's likely experts early.
    pub prefetch: bool,
    /// Learn which experts are hot (usage history in `state_dir`) and pin the hottest at start.
    pub learn: bool,
    /// Bytes of the cache the learned pins may take (`None`: half of the cache).
    pub pin_budget: Option<u64>,
    /// Where usage history lives (`None`: [`history::state_dir`]).
    pub state_dir: Option<std::path::PathBuf>,
    /// Byte-identical copies of the checkpoint on other drives.
    pub mirrors: Vec<mirror::Mirror>,
    /// How expert misses are read (io-uring or a pread pool; auto picks io-uring if it works).
    pub reader: reader::ReaderKind,
    /// Open the checkpoint files with O_DIRECT (falls back with one warning if refused).
    pub direct_io: bool,
    /// Which expert is evicted when the cache is full.
    pub policy: CachePolicy,
    /// The device whose memory holds the hottest experts above the RAM cache (the VRAM
    /// tier, [`vram`]), with what is left of its budget after the dense matrices.
    pub device: Option<crate::tensor::device::DevicePlacement>,
    /// Wraps each drive's reader (under the retry and length check), for fault injection in
    /// tests ([`fault::WrapReader`]); `None` in normal runs.
    pub wrap_reader: Option<fault::WrapReader>,
    /// Only describe where the routed experts are: [`open`] puts their [`ExpertLayout`] here
    /// and fails, so the load stops before any expert (or anything after them) is read. For
    /// tools that read headers only (`crate::model::expert_layout`); `None` in normal runs.
    pub layout_probe: Option<LayoutProbe>,
}

/// Where each routed expert's bytes are in the checkpoint's files (see
/// [`StoreOptions::layout_probe`]).
#[derive(Debug, Clone, Default)]
pub struct ExpertLayout {
    /// The checkpoint's files, in the order [`ExpertLayout::experts`] numbers them.
    pub files: Vec<std::path::PathBuf>,
    /// `experts[layer][expert]`: (file index, bytes) of each of the expert's matrices' parts
    /// (a fused block's share for an expert sliced out of one); empty lists for layers
    /// without routed experts.
    pub experts: Vec<Vec<Vec<(usize, u64)>>>,
    /// Bytes of every tensor of the checkpoint (what the tiered store's resident set is
    /// taken from, [`tiered::split_budget`]).
    pub checkpoint_bytes: u64,
    /// Bytes of the checkpoint the model never loads (an MTP block left out, a vision tower).
    pub unused_bytes: u64,
}

impl ExpertLayout {
    /// Describe the experts named by `names[layer][expert]` (shapes and dtypes checked as the
    /// tiered store checks them; nothing read).
    pub fn of(
        ckpt: &Checkpoint,
        names: &[Vec<ExpertNames>],
        hidden: usize,
        intermediate: usize,
    ) -> Result<ExpertLayout> {
        let matrix = |name: &str, shape: [usize; 2]| -> Result<Vec<(usize, u64)>> {
            let stored = ckpt.stored_weight(name, &shape)?;
            Ok(match &stored {
                crate::format::safetensors::StoredWeight::Slice(s) => {
                    vec![(s.parts()[0].file, s.bytes() as u64)]
                }
                other => other
                    .parts()
                    .iter()
                    .map(|d| (d.file, d.len as u64))
                    .collect(),
            })
        };
        let experts = names
            .iter()
            .map(|layer| {
                layer
                    .iter()
                    .map(|n| {
                        let mut parts = matrix(&n.gate, [intermediate, hidden])?;
                        parts.extend(matrix(&n.up, [intermediate, hidden])?);
                        parts.extend(matrix(&n.down, [hidden, intermediate])?);
                        Ok(parts)
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ExpertLayout {
            files: (0..ckpt.file_count())
                .map(|i| ckpt.file_path(i).to_path_buf())
                .collect(),
            experts,
            checkpoint_bytes: ckpt.total_bytes() as u64,
            unused_bytes: 0,
        })
    }

    /// Routed experts per layer (what the usage history is shaped by).
    pub fn experts_per_layer(&self) -> Vec<usize> {
        self.experts.iter().map(Vec::len).collect()
    }

    /// Bytes of one expert (0 when out of range): what the tiered store reads and caches
    /// for it.
    pub fn expert_bytes(&self, layer: usize, expert: usize) -> u64 {
        self.experts
            .get(layer)
            .and_then(|l| l.get(expert))
            .map_or(0, |parts| parts.iter().map(|&(_, b)| b).sum())
    }

    /// Bytes of all routed experts.
    pub fn total_bytes(&self) -> u64 {
        self.experts
            .iter()
            .flatten()
            .flatten()
            .map(|&(_, b)| b)
            .sum()
    }
}

/// A store that only describes its experts ([`LayoutProbe::describing`]): the model around
/// it is built (so its [`crate::model::ModelInfo`] is known), but nothing can be computed
/// through it.
struct DescribedStore {
    total_bytes: usize,
}

impl ExpertStore for DescribedStore {
    fn acquire(&self, layer: usize, _experts: &[usize]) -> Result<Lease> {
        Err(Error::Invalid(format!(
            "layer {layer}: this model was loaded to be described only (its experts are not readable)"
        )))
    }

    fn total_bytes(&self) -> usize {
        self.total_bytes
    }
}

/// Where [`open`] leaves the expert layout when asked only for it.
#[derive(Clone, Default)]
pub struct LayoutProbe {
    slot: Arc<std::sync::Mutex<Option<ExpertLayout>>>,
    /// Finish the load with a store that only describes the experts instead of stopping it
    /// ([`LayoutProbe::describing`]).
    describe: bool,
}

impl LayoutProbe {
    /// A probe that lets the load finish around a store that describes the experts and
    /// refuses to hand them out: the model's shape facts are known, no expert is read (and,
    /// with the weights mapped rather than prefaulted, no dense weight either, except the few
    /// a family converts while it builds). What `coli plan` and `coli doctor` load.
    pub fn describing() -> LayoutProbe {
        LayoutProbe {
            describe: true,
            ..LayoutProbe::default()
        }
    }

    /// The layout captured, if the load got as far as the experts.
    pub fn take(&self) -> Option<ExpertLayout> {
        self.slot.lock().ok().and_then(|mut l| l.take())
    }
}

impl std::fmt::Debug for LayoutProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LayoutProbe(..)")
    }
}

/// The message of the error [`open`] stops a load with once it captured the layout.
pub const LAYOUT_CAPTURED: &str = "expert layout captured (a headers-only load stops here)";

/// Expert cache eviction policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum CachePolicy {
    /// Least recently used.
    #[default]
    Lru,
    /// Least frequently used first, then least recently used (frequencies halve
    /// periodically, so the cache follows a changing workload).
    Lfru,
}

/// The expert store for these experts under `opts`: all resident without a budget, tiered
/// (read from disk into a cache of what the budget leaves after the resident set) with one.
/// `unused_bytes` are bytes of the checkpoint the model never loads (an MTP block left out, a
/// vision tower): not counted as resident.
pub fn open(
    ckpt: &Checkpoint,
    names: &[Vec<ExpertNames>],
    hidden: usize,
    intermediate: usize,
    unused_bytes: usize,
    opts: &StoreOptions,
) -> Result<Arc<dyn ExpertStore>> {
    if let Some(probe) = &opts.layout_probe {
        let mut layout = ExpertLayout::of(ckpt, names, hidden, intermediate)?;
        layout.unused_bytes = unused_bytes as u64;
        let total_bytes = layout.total_bytes() as usize;
        if let Ok(mut slot) = probe.slot.lock() {
            slot.get_or_insert(layout);
        }
        if probe.describe {
            return Ok(Arc::new(DescribedStore { total_bytes }));
        }
        return Err(Error::Invalid(LAYOUT_CAPTURED.into()));
    }
    let below: Arc<dyn ExpertStore> = match opts.ram_budget {
        None => Arc::new(ResidentStore::open(ckpt, names, hidden, intermediate)?),
        Some(budget) => Arc::new(tiered::TieredStore::open(
            ckpt,
            names,
            hidden,
            intermediate,
            budget,
            unused_bytes,
            opts,
        )?),
    };
    let Some(placement) = &opts.device else {
        return Ok(below);
    };
    let counts: Vec<usize> = names.iter().map(|l| l.len()).collect();
    let total: usize = counts.iter().sum();
    let tier = Arc::new(vram::VramTier::new(below, placement.clone(), counts));
    // Filled once the whole model has loaded, so dense matrices are placed first.
    let filling = tier.clone();
    placement.after_load(Box::new(move || {
        let n = filling.fill()?;
        let bytes = filling.stats().map_or(0, |s| s.vram_bytes);
        tracing::info!("VRAM tier: {n} of {total} experts in VRAM ({bytes} bytes)");
        Ok(())
    }));
    Ok(tier)
}
