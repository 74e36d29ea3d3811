//! The tiered expert store: dense weights stay resident; routed experts live on disk and are
//! read with positioned reads into an LRU cache sized by what the RAM budget leaves after the
//! resident set. All misses of a layer are issued at once; cached experts are handed out
//! immediately so they compute while the misses load; an expert already being read (by a
//! prefetch hint or another request) is waited for, never read twice. Pinned experts are never
//! evicted. Placement changes speed, never results: an expert read from disk is byte-for-byte
//! the expert a memory map would show, or, for split FP4 matrices (packed E2M1 codes plus
//! their E8M0 scales, read together as two ranges), the MXFP4 blocks the resident load
//! repacks them into, built by the same function on a small pool of repack threads (so the
//! reader threads keep reading).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

use std::path::PathBuf;

use super::history::{self, UsageHistory};
use super::mirror::MirroredReader;
use super::reader::{open_reader, ByteRange, CheckedReader, RangeReader, ReaderOptions};
use super::{
    Arrival, CachePolicy, Expert, ExpertNames, ExpertStore, Lease, StoreOptions, StoreSnapshot,
};
use crate::format::fused::ExpertSlice;
use crate::format::safetensors::{Checkpoint, Fp4Parts, StoredWeight};
use crate::tensor::quant::QuantType;
use crate::tensor::{DType, Storage, Tensor};
use crate::{Error, Result};

type Key = (usize, usize);

/// Where one expert matrix is on disk.
#[derive(Debug, Clone)]
struct MatrixLocation {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    /// The tensor's bytes, or a split FP4 matrix's codes then scales.
    ranges: Vec<ByteRange>,
    /// FP8 block scales (small; kept resident).
    scales: Option<Arc<crate::tensor::BlockScales>>,
    /// A split FP4 matrix, repacked into MXFP4 blocks when its ranges arrive.
    fp4: Option<Arc<Fp4Parts>>,
    /// One expert's matrix of a fused tensor, built from its block when the block arrives
    /// (the gate and up matrices of an expert share one block, read once).
    slice: Option<Arc<ExpertSlice>>,
}

impl MatrixLocation {
    /// Bytes of this matrix (a fused block's share, for a slice of one).
    fn bytes(&self) -> usize {
        match &self.slice {
            Some(s) => s.bytes(),
            None => self.ranges.iter().map(|r| r.len).sum(),
        }
    }

    /// The matrix from its buffers, taken from `bufs` in range order.
    fn assemble(&self, bufs: &mut impl Iterator<Item = Storage>) -> Result<Tensor> {
        let mut next = || {
            bufs.next().ok_or_else(|| {
                Error::Invalid(format!(
                    "the expert reader returned too few buffers for `{}`",
                    self.name
                ))
            })
        };
        if let Some(s) = &self.slice {
            let block = next()?;
            let scales = match s.scales {
                Some(_) => Some(next()?),
                None => None,
            };
            return s.build(&block, scales.as_ref());
        }
        match &self.fp4 {
            Some(p) => {
                let (codes, scales) = (next()?, next()?);
                p.repack(&codes, &scales)
            }
            None => Ok(Tensor {
                name: self.name.clone(),
                shape: self.shape.clone(),
                dtype: self.dtype,
                storage: next()?,
                block_scales: self.scales.clone(),
                device: None,
                interleaved: None,
            }),
        }
    }
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    hit_bytes: AtomicU64,
    misses: AtomicU64,
    miss_bytes: AtomicU64,
    bytes_read: AtomicU64,
    io_wait_ns: Arc<AtomicU64>,
    prefetch_reads: AtomicU64,
    prefetch_bytes: AtomicU64,
    prefetch_useful_bytes: AtomicU64,
    prefetch_guessed: AtomicU64,
    prefetch_needed: AtomicU64,
}

struct Entry {
    expert: Arc<Expert>,
    tick: u64,
    /// Uses, halved every time the cache has seen as many inserts as it holds entries (LFRU).
    uses: u32,
    pinned: bool,
    /// Brought in by a prefetch hint and not used yet.
    prefetched: bool,
}

#[derive(Default)]
struct Cache {
    entries: HashMap<Key, Entry>,
    used: u64,
    pinned: u64,
    tick: u64,
    /// Reads in progress, with whoever waits for them.
    inflight: HashMap<Key, (Vec<Sender<Arrival>>, bool)>,
    /// The last hint per layer, to measure prefetch recall.
    last_hint: HashMap<usize, HashSet<usize>>,
    /// Inserts since the LFRU use counts were last halved.
    inserts_since_aging: usize,
}

struct Inner {
    cache: Mutex<Cache>,
    capacity: u64,
    counters: Counters,
    policy: CachePolicy,
}

/// Routed experts read from disk into a bounded cache.
pub struct TieredStore {
    locations: Vec<Vec<[MatrixLocation; 3]>>,
    expert_bytes: Vec<Vec<u64>>,
    reader: Arc<dyn RangeReader>,
    /// Threads that repack split FP4 experts as they arrive (only when there are any).
    repack: Option<Arc<rayon::ThreadPool>>,
    inner: Arc<Inner>,
    total_bytes: usize,
    prefetch: bool,
    learning: Option<Learning>,
    warnings: Vec<String>,
}

/// The reader for the primary files, behind the mirror drives if any, under the one retry
/// and length check ([`CheckedReader`]). Each drive's reader is wrapped by
/// [`StoreOptions::wrap_reader`] when set (fault injection in tests).
fn make_reader(
    dir: &std::path::Path,
    paths: &[PathBuf],
    threads: usize,
    opts: &StoreOptions,
) -> Result<(Arc<dyn RangeReader>, Vec<String>)> {
    let ropts = ReaderOptions {
        kind: opts.reader,
        threads,
        direct_io: opts.direct_io,
    };
    let wrap = |drive: usize, files: &[PathBuf], r: Arc<dyn RangeReader>| match &opts.wrap_reader {
        Some(w) => w.wrap(drive, files, r),
        None => r,
    };
    let (primary, mut warnings) = open_reader(paths, &ropts)?;
    let primary = wrap(0, paths, primary);
    if opts.mirrors.is_empty() {
        return Ok((Arc::new(CheckedReader::new(primary, paths)), warnings));
    }
    let drive = std::sync::atomic::AtomicUsize::new(1);
    let (mirrored, more) = MirroredReader::open(
        dir,
        paths,
        primary,
        opts.mirrors.clone(),
        |files: &[PathBuf]| -> Result<Arc<dyn RangeReader>> {
            let (r, w) = open_reader(files, &ropts)?;
            for w in w {
                tracing::warn!("{w}");
            }
            Ok(wrap(drive.fetch_add(1, Ordering::Relaxed), files, r))
        },
    )?;
    warnings.extend(more);
    Ok((
        Arc::new(CheckedReader::new(Arc::new(mirrored), paths)),
        warnings,
    ))
}

/// The usage history being recorded, where it is saved, and the thread that saves it in the
/// background.
struct Learning {
    shared: Arc<Saving>,
    /// Wakes the saver thread (started on the first [`ExpertStore::flush_soon`]).
    saver: Mutex<Option<Sender<()>>>,
    warning: Option<String>,
}

/// What the engine and the saver thread share.
struct Saving {
    history: Mutex<UsageHistory>,
    dir: PathBuf,
    /// Held from a snapshot to the end of its write, so saves land in the order they were
    /// taken and never two at once.
    order: Mutex<()>,
    /// The last background save's error, so a failure repeating is logged once.
    last_error: Mutex<Option<String>>,
}

impl Saving {
    /// Save the history: decay and copy it under its lock (the engine waits only for that),
    /// then write it.
    fn save(&self) -> Result<()> {
        let _order = self.order.lock().unwrap_or_else(|e| e.into_inner());
        let pending = self
            .history
            .lock()
            .map_err(|_| Error::Invalid("usage history poisoned".into()))?
            .snapshot(&self.dir)?;
        pending.write()
    }

    /// The saver thread: one save per wake-up (wake-ups that came during a save are merged),
    /// skipped when nothing was recorded since the last one. Ends when the store is dropped.
    fn run(&self, wake: Receiver<()>) {
        while wake.recv().is_ok() {
            while wake.try_recv().is_ok() {}
            let dirty = self.history.lock().is_ok_and(|h| h.since_save() > 0);
            if !dirty {
                continue;
            }
            let t0 = std::time::Instant::now();
            let result = self.save();
            let mut last = self.last_error.lock().unwrap_or_else(|e| e.into_inner());
            match result {
                Ok(()) => {
                    tracing::debug!(
                        "usage history saved in {:.1} ms",
                        t0.elapsed().as_secs_f64() * 1e3
                    );
                    *last = None;
                }
                Err(e) => {
                    let e = e.to_string();
                    if last.as_deref() != Some(e.as_str()) {
                        tracing::warn!("saving the expert usage history: {e}");
                    }
                    *last = Some(e);
                }
            }
        }
    }
}

/// How a RAM budget is split by [`TieredStore::open`] (and predicted by `coli plan`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BudgetSplit {
    /// The resident set: every tensor of the checkpoint but the routed experts and the
    /// bytes the model never loads (embeddings, attention, norms, routers, dense layers).
    pub resident: u64,
    /// Bytes the expert cache may hold: the budget less the resident set.
    pub cache: u64,
    /// Bytes of the cache the usage history's hottest experts may pin: the pin budget asked
    /// for, or half of the cache, never more than the cache.
    pub pin_budget: u64,
}

/// Split `budget` as the tiered store does for a checkpoint of `checkpoint_bytes` whose
/// routed experts take `expert_bytes` and of which `unused_bytes` are never loaded: the
/// resident set first, the rest for the expert cache, of which `pin_budget` (default: half)
/// may be pinned. Refuses, with the numbers and the fix, a budget the resident set does not
/// fit.
pub fn split_budget(
    checkpoint_bytes: u64,
    expert_bytes: u64,
    unused_bytes: u64,
    budget: u64,
    pin_budget: Option<u64>,
) -> Result<BudgetSplit> {
    let resident = checkpoint_bytes.saturating_sub(expert_bytes + unused_bytes);
    if resident > budget {
        return Err(Error::Invalid(format!(
            "the resident weights alone ({}: embeddings, attention, norms, routers, dense layers) do not fit the RAM budget of {}; raise --ram to at least {}",
            super::budget::format_size(resident),
            super::budget::format_size(budget),
            super::budget::format_size_up(resident)
        )));
    }
    let cache = budget - resident;
    Ok(BudgetSplit {
        resident,
        cache,
        pin_budget: pin_budget.unwrap_or(cache / 2).min(cache),
    })
}

impl TieredStore {
    /// Describe the experts named by `names[layer][expert]` (shapes checked, nothing read)
    /// and size the cache as `budget` less the checkpoint's resident (non-expert) bytes;
    /// `unused_bytes` of the checkpoint are never loaded, so not resident either.
    pub fn open(
        ckpt: &Checkpoint,
        names: &[Vec<ExpertNames>],
        hidden: usize,
        intermediate: usize,
        budget: u64,
        unused_bytes: usize,
        opts: &StoreOptions,
    ) -> Result<TieredStore> {
        let locate = |name: &str, shape: [usize; 2]| -> Result<MatrixLocation> {
            // Existence, shape, dtype and companions; nothing read.
            let stored = ckpt.stored_weight(name, &shape)?;
            let ranges = stored
                .parts()
                .iter()
                .map(|d| ByteRange {
                    file: d.file,
                    offset: d.offset as u64,
                    len: d.len,
                })
                .collect();
            Ok(match stored {
                StoredWeight::Tensor(d) => MatrixLocation {
                    name: name.to_string(),
                    shape: d.shape.clone(),
                    dtype: d.dtype,
                    ranges,
                    scales: ckpt.block_scales(name)?,
                    fp4: None,
                    slice: None,
                },
                StoredWeight::Fp4(p) => MatrixLocation {
                    name: name.to_string(),
                    shape: shape.to_vec(),
                    dtype: DType::Quant(QuantType::MXFP4),
                    ranges,
                    scales: None,
                    fp4: Some(Arc::new(p)),
                    slice: None,
                },
                StoredWeight::Slice(s) => MatrixLocation {
                    name: name.to_string(),
                    shape: shape.to_vec(),
                    dtype: s.dtype(),
                    ranges,
                    scales: None,
                    fp4: None,
                    slice: Some(s),
                },
            })
        };
        let mut total_bytes = 0usize;
        let locations = names
            .iter()
            .map(|layer| {
                layer
                    .iter()
                    .map(|n| {
                        let m = [
                            locate(&n.gate, [intermediate, hidden])?,
                            locate(&n.up, [intermediate, hidden])?,
                            locate(&n.down, [hidden, intermediate])?,
                        ];
                        total_bytes += m.iter().map(|x| x.bytes()).sum::<usize>();
                        Ok(m)
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let split = split_budget(
            ckpt.total_bytes() as u64,
            total_bytes as u64,
            unused_bytes as u64,
            budget,
            opts.pin_budget,
        )?;
        let expert_bytes = locations
            .iter()
            .map(|l| {
                l.iter()
                    .map(|m| m.iter().map(|x| x.bytes() as u64).sum())
                    .collect()
            })
            .collect();
        let paths: Vec<_> = (0..ckpt.file_count())
            .map(|i| ckpt.file_path(i).to_path_buf())
            .collect();
        let threads = if opts.io_threads == 0 {
            4
        } else {
            opts.io_threads
        };
        let (reader, warnings) = make_reader(ckpt.dir(), &paths, threads, opts)?;
        let repack = if locations
            .iter()
            .flatten()
            .flatten()
            .any(|m| m.fp4.is_some() || m.slice.is_some())
        {
            Some(Arc::new(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("coli-repack-{i}"))
                    .build()
                    .map_err(|e| {
                        Error::Invalid(format!("cannot start the expert repack threads: {e}"))
                    })?,
            ))
        } else {
            None
        };
        for w in &warnings {
            tracing::warn!("{w}");
        }
        let experts_per_layer: Vec<usize> = names.iter().map(|l| l.len()).collect();
        let learning = match (
            opts.learn,
            opts.state_dir.clone().or_else(history::state_dir),
        ) {
            (true, Some(dir)) => {
                let fp = history::fingerprint(ckpt.dir())?;
                let (h, warning) = UsageHistory::load(&dir, &fp, &experts_per_layer)?;
                if let Some(w) = &warning {
                    tracing::warn!("{w}");
                }
                Some(Learning {
                    shared: Arc::new(Saving {
                        history: Mutex::new(h),
                        dir,
                        order: Mutex::new(()),
                        last_error: Mutex::new(None),
                    }),
                    saver: Mutex::new(None),
                    warning,
                })
            }
            _ => None,
        };
        let store = TieredStore {
            locations,
            expert_bytes,
            reader,
            repack,
            inner: Arc::new(Inner {
                cache: Mutex::new(Cache::default()),
                capacity: split.cache,
                counters: Counters::default(),
                policy: opts.policy,
            }),
            total_bytes,
            prefetch: opts.prefetch,
            learning,
            warnings,
        };
        if let Some(l) = &store.learning {
            let pin_budget = split.pin_budget;
            let hot = l
                .shared
                .history
                .lock()
                .map_err(|_| Error::Invalid("usage history poisoned".into()))?
                .hottest(|layer, e| store.expert_bytes[layer][e], pin_budget);
            if !hot.is_empty() {
                store.pin(&hot)?;
            }
        }
        Ok(store)
    }

    /// Warnings from start-up (usage history, direct I/O, mirrors).
    pub fn warnings(&self) -> Vec<String> {
        let mut w = self.warnings.clone();
        w.extend(self.learning.as_ref().and_then(|l| l.warning.clone()));
        w
    }

    /// Bytes the expert cache may hold.
    pub fn capacity(&self) -> u64 {
        self.inner.capacity
    }

    /// Bytes of one expert.
    pub fn expert_bytes(&self, layer: usize, expert: usize) -> u64 {
        self.expert_bytes[layer][expert]
    }

    /// Read these experts now and keep them for good (never evicted), as far as they fit the
    /// cache. Returns the bytes pinned.
    pub fn pin(&self, experts: &[Key]) -> Result<u64> {
        let mut leases = Vec::new();
        for &(layer, e) in experts {
            leases.push(self.acquire(layer, &[e])?);
        }
        for mut lease in leases {
            while let Some(item) = lease.next_expert() {
                item?;
            }
        }
        let mut c = self.lock()?;
        let mut pinned = 0;
        for key in experts {
            if let Some(entry) = c.entries.get_mut(key) {
                if !entry.pinned {
                    entry.pinned = true;
                    pinned += entry.expert.nbytes() as u64;
                }
            }
        }
        c.pinned += pinned;
        Ok(pinned)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Cache>> {
        self.inner
            .cache
            .lock()
            .map_err(|_| Error::Invalid("expert cache poisoned by an earlier panic".into()))
    }

    /// Register interest in `key`: join its read if one is in flight, else record a new read
    /// and return true — the caller then calls [`submit_read`](Self::submit_read) once the
    /// cache lock is released (a reader may deliver inline, and delivery takes the lock).
    fn register_read(
        &self,
        c: &mut Cache,
        key: Key,
        waiter: Option<Sender<Arrival>>,
        prefetch: bool,
    ) -> bool {
        if let Some((waiters, _)) = c.inflight.get_mut(&key) {
            waiters.extend(waiter);
            return false;
        }
        c.inflight
            .insert(key, (waiter.into_iter().collect(), prefetch));
        true
    }

    /// Issue the read registered for `key`. Must be called without the cache lock held.
    fn submit_read(&self, key: Key) {
        let loc = self.locations[key.0][key.1].clone();
        let inner = self.inner.clone();
        // A range two matrices share (a fused expert's gate/up block) is read once.
        let mut ranges: Vec<ByteRange> = Vec::new();
        let mut order = Vec::new();
        for r in loc.iter().flat_map(|m| m.ranges.iter()) {
            let at = ranges.iter().position(|x| x == r).unwrap_or_else(|| {
                ranges.push(r.clone());
                ranges.len() - 1
            });
            order.push(at);
        }
        // Repacking FP4 and gathering fused rows are CPU work: they run on the repack
        // threads, not the reader's.
        let repack = self
            .repack
            .clone()
            .filter(|_| loc.iter().any(|m| m.fp4.is_some() || m.slice.is_some()));
        self.reader.submit(
            ranges,
            Box::new(move |bufs| {
                let finish = move || {
                    let result = bufs.and_then(|b| {
                        let mut b = order.iter().map(|&i| b[i].clone());
                        let gate = loc[0].assemble(&mut b)?;
                        let up = loc[1].assemble(&mut b)?;
                        let down = loc[2].assemble(&mut b)?;
                        Ok(Arc::new(Expert { gate, up, down }))
                    });
                    inner.complete(key, result);
                };
                match repack {
                    Some(pool) => pool.spawn(finish),
                    None => finish(),
                }
            }),
        );
    }
}

impl Inner {
    /// A read finished: keep the expert (if it fits), wake whoever waits.
    fn complete(&self, key: Key, result: Result<Arc<Expert>>) {
        let Ok(mut c) = self.cache.lock() else { return };
        let (waiters, prefetch) = c.inflight.remove(&key).unwrap_or_default();
        match result {
            Ok(expert) => {
                self.counters
                    .bytes_read
                    .fetch_add(expert.nbytes() as u64, Ordering::Relaxed);
                let kept = self.insert(&mut c, key, &expert, prefetch && waiters.is_empty());
                if !kept && waiters.is_empty() {
                    tracing::debug!("prefetched expert {key:?} did not fit the cache");
                }
                drop(c);
                for w in waiters {
                    let _ = w.send(Ok((key.1, expert.clone())));
                }
            }
            Err(e) => {
                drop(c);
                let message = e.to_string();
                let mut first = Some(e);
                for w in waiters {
                    let err = first
                        .take()
                        .unwrap_or_else(|| Error::Invalid(message.clone()));
                    let _ = w.send(Err(err));
                }
            }
        }
    }

    /// Keep `expert`, evicting least recently used unpinned entries to make room. An expert
    /// that cannot fit is not kept.
    fn insert(&self, c: &mut Cache, key: Key, expert: &Arc<Expert>, prefetched: bool) -> bool {
        let size = expert.nbytes() as u64;
        if c.entries.contains_key(&key) {
            return true;
        }
        if size > self.capacity.saturating_sub(c.pinned) {
            return false;
        }
        while c.used + size > self.capacity {
            let policy = self.policy;
            let victim = c
                .entries
                .iter()
                .filter(|(_, e)| !e.pinned)
                .min_by_key(|(_, e)| match policy {
                    CachePolicy::Lru => (0, e.tick),
                    CachePolicy::Lfru => (e.uses, e.tick),
                })
                .map(|(k, _)| *k);
            let Some(victim) = victim else { return false };
            if let Some(e) = c.entries.remove(&victim) {
                c.used -= e.expert.nbytes() as u64;
            }
        }
        c.tick += 1;
        let tick = c.tick;
        c.used += size;
        c.inserts_since_aging += 1;
        if c.inserts_since_aging > c.entries.len().max(16) {
            c.inserts_since_aging = 0;
            for e in c.entries.values_mut() {
                e.uses /= 2;
            }
        }
        c.entries.insert(
            key,
            Entry {
                expert: expert.clone(),
                tick,
                uses: 1,
                pinned: false,
                prefetched,
            },
        );
        true
    }
}

impl ExpertStore for TieredStore {
    fn hottest(&self) -> Vec<(usize, usize)> {
        match &self.learning {
            Some(l) => l
                .shared
                .history
                .lock()
                .map(|h| h.hottest(|_, _| 0, 0))
                .unwrap_or_default(),
            None => Vec::new(),
        }
    }

    fn note_uses(&self, layer: usize, experts: &[usize]) {
        if let Some(l) = &self.learning {
            if let Ok(mut h) = l.shared.history.lock() {
                h.record(layer, experts);
            }
        }
    }

    fn acquire(&self, layer: usize, experts: &[usize]) -> Result<Lease> {
        let table = self
            .locations
            .get(layer)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| Error::Invalid(format!("no routed experts in layer {layer}")))?;
        if let Some(&e) = experts.iter().find(|&&e| e >= table.len()) {
            return Err(Error::Invalid(format!(
                "expert {e} out of range in layer {layer}"
            )));
        }
        if let Some(l) = &self.learning {
            if let Ok(mut h) = l.shared.history.lock() {
                h.record(layer, experts);
            }
        }
        let counters = &self.inner.counters;
        let (tx, rx) = channel();
        let mut ready = Vec::new();
        let mut pending = 0;
        let mut to_submit = Vec::new();
        let mut c = self.lock()?;
        if let Some(guess) = c.last_hint.remove(&layer) {
            let guessed = experts.iter().filter(|e| guess.contains(e)).count();
            counters
                .prefetch_guessed
                .fetch_add(guessed as u64, Ordering::Relaxed);
            counters
                .prefetch_needed
                .fetch_add(experts.len() as u64, Ordering::Relaxed);
        }
        for &e in experts {
            let bytes = self.expert_bytes[layer][e];
            c.tick += 1;
            let tick = c.tick;
            match c.entries.get_mut(&(layer, e)) {
                Some(entry) => {
                    entry.tick = tick;
                    entry.uses = entry.uses.saturating_add(1);
                    if std::mem::take(&mut entry.prefetched) {
                        counters
                            .prefetch_useful_bytes
                            .fetch_add(bytes, Ordering::Relaxed);
                    }
                    counters.hits.fetch_add(1, Ordering::Relaxed);
                    counters.hit_bytes.fetch_add(bytes, Ordering::Relaxed);
                    ready.push((e, entry.expert.clone()));
                }
                None => {
                    if let Some((_, true)) = c.inflight.get(&(layer, e)) {
                        counters
                            .prefetch_useful_bytes
                            .fetch_add(bytes, Ordering::Relaxed);
                    }
                    counters.misses.fetch_add(1, Ordering::Relaxed);
                    counters.miss_bytes.fetch_add(bytes, Ordering::Relaxed);
                    if self.register_read(&mut c, (layer, e), Some(tx.clone()), false) {
                        to_submit.push((layer, e));
                    }
                    pending += 1;
                }
            }
        }
        drop(c);
        for key in to_submit {
            self.submit_read(key);
        }
        Ok(Lease::with_pending(
            ready,
            pending,
            rx,
            counters.io_wait_ns.clone(),
        ))
    }

    fn hint(&self, layer: usize, experts: &[usize]) {
        if !self.prefetch {
            return;
        }
        let Some(table) = self.locations.get(layer).filter(|t| !t.is_empty()) else {
            return;
        };
        let Ok(mut c) = self.lock() else { return };
        c.last_hint.insert(layer, experts.iter().copied().collect());
        let mut to_submit = Vec::new();
        for &e in experts.iter().filter(|&&e| e < table.len()) {
            let key = (layer, e);
            if c.entries.contains_key(&key) || c.inflight.contains_key(&key) {
                continue;
            }
            let counters = &self.inner.counters;
            counters.prefetch_reads.fetch_add(1, Ordering::Relaxed);
            counters
                .prefetch_bytes
                .fetch_add(self.expert_bytes[layer][e], Ordering::Relaxed);
            if self.register_read(&mut c, key, None, true) {
                to_submit.push(key);
            }
        }
        drop(c);
        for key in to_submit {
            self.submit_read(key);
        }
    }

    fn wants_hints(&self) -> bool {
        self.prefetch
    }

    fn step_done(&self, tokens: usize) {
        if let Some(l) = &self.learning {
            if let Ok(mut h) = l.shared.history.lock() {
                for _ in 0..tokens {
                    h.end_step();
                }
            }
        }
    }

    fn flush(&self) -> Result<()> {
        match &self.learning {
            Some(l) => l.shared.save(),
            None => Ok(()),
        }
    }

    fn flush_soon(&self) {
        let Some(l) = &self.learning else { return };
        let mut saver = l.saver.lock().unwrap_or_else(|e| e.into_inner());
        if saver.is_none() {
            let (tx, rx) = channel();
            let shared = l.shared.clone();
            match std::thread::Builder::new()
                .name("coli-history".into())
                .spawn(move || shared.run(rx))
            {
                Ok(_) => *saver = Some(tx),
                Err(e) => {
                    tracing::warn!("cannot start the usage history saver thread: {e}");
                    return;
                }
            }
        }
        if let Some(tx) = saver.as_ref() {
            let _ = tx.send(());
        }
    }

    fn stats(&self) -> Option<StoreSnapshot> {
        let k = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (used, pinned) = self.lock().map(|c| (c.used, c.pinned)).unwrap_or((0, 0));
        Some(StoreSnapshot {
            hits: get(&k.hits),
            hit_bytes: get(&k.hit_bytes),
            misses: get(&k.misses),
            miss_bytes: get(&k.miss_bytes),
            bytes_read: get(&k.bytes_read),
            io_wait_seconds: get(&k.io_wait_ns) as f64 / 1e9,
            prefetch_reads: get(&k.prefetch_reads),
            prefetch_bytes: get(&k.prefetch_bytes),
            prefetch_useful_bytes: get(&k.prefetch_useful_bytes),
            prefetch_guessed: get(&k.prefetch_guessed),
            prefetch_needed: get(&k.prefetch_needed),
            cache_capacity: self.inner.capacity,
            cache_used: used,
            pinned_bytes: pinned,
            reader: self.reader.describe(),
            drives: self
                .reader
                .drive_bytes()
                .into_iter()
                .map(|(d, b)| (d.display().to_string(), b))
                .collect(),
            ..StoreSnapshot::default()
        })
    }

    fn total_bytes(&self) -> usize {
        self.total_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::safetensors::Access;

    #[test]
    fn a_budget_splits_into_resident_set_cache_and_pins() {
        // 100 bytes of checkpoint: 60 of experts, 10 never loaded, so 30 resident.
        let s = split_budget(100, 60, 10, 50, None).unwrap();
        assert_eq!((s.resident, s.cache, s.pin_budget), (30, 20, 10));
        assert_eq!(
            split_budget(100, 60, 10, 50, Some(15)).unwrap().pin_budget,
            15
        );
        assert_eq!(
            split_budget(100, 60, 10, 50, Some(99)).unwrap().pin_budget,
            20
        );
        assert_eq!(split_budget(100, 60, 10, 30, None).unwrap().cache, 0);
        let e = split_budget(100, 60, 10, 29, None).unwrap_err().to_string();
        assert!(
            e.contains("30 B") && e.contains("29 B") && e.contains("raise --ram"),
            "{e}"
        );
    }
    use crate::tensor::Storage;
    use std::fs::File;
    use std::os::unix::fs::FileExt;

    /// A reader that delivers on the caller's thread, inside `submit`.
    struct InlineReader {
        files: Vec<File>,
    }

    impl RangeReader for InlineReader {
        fn submit(&self, ranges: Vec<ByteRange>, done: super::super::reader::ReadDone) {
            let bufs = ranges
                .iter()
                .map(|r| {
                    let mut words = vec![0u64; r.len.div_ceil(8)];
                    let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..r.len];
                    self.files[r.file]
                        .read_exact_at(buf, r.offset)
                        .map_err(|e| Error::io("inline", e))?;
                    Ok(Storage::Owned {
                        words: Arc::new(words),
                        len: r.len,
                    })
                })
                .collect();
            done(bufs);
        }

        fn describe(&self) -> String {
            "inline".into()
        }
    }

    #[test]
    fn a_reader_that_delivers_inline_does_not_deadlock() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/olmoe");
        let ckpt = Checkpoint::open_with(&dir, Access::Read).unwrap();
        let names: Vec<Vec<ExpertNames>> = (0..2)
            .map(|l| {
                (0..8)
                    .map(|e| {
                        let p = format!("model.layers.{l}.mlp.experts.{e}");
                        ExpertNames {
                            gate: format!("{p}.gate_proj.weight"),
                            up: format!("{p}.up_proj.weight"),
                            down: format!("{p}.down_proj.weight"),
                        }
                    })
                    .collect()
            })
            .collect();
        let opts = StoreOptions {
            prefetch: true,
            ..StoreOptions::default()
        };
        let mut store = TieredStore::open(&ckpt, &names, 64, 32, u64::MAX / 4, 0, &opts).unwrap();
        store.reader = Arc::new(InlineReader {
            files: vec![File::open(ckpt.file_path(0)).unwrap()],
        });
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            store.hint(1, &[2, 3]);
            let mut lease = store.acquire(0, &[0, 1, 5]).unwrap();
            let mut got = Vec::new();
            while let Some(e) = lease.next_expert() {
                got.push(e.unwrap().0);
            }
            let mut lease = store.acquire(1, &[2, 3]).unwrap();
            while let Some(e) = lease.next_expert() {
                got.push(e.unwrap().0);
            }
            tx.send(got).unwrap();
        });
        let mut got = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("acquire and hint finish with an inline reader (no deadlock)");
        got.sort();
        assert_eq!(got, vec![0, 1, 2, 3, 5]);
    }
}
