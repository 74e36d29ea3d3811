//! The tiered expert store: dense weights stay resident; routed experts live on disk and are
//! read with positioned reads into an LRU cache sized by what the RAM budget leaves after the
//! resident set. All misses of a layer are issued at once; cached experts are handed out
//! immediately so they compute while the misses load. Placement changes speed, never results:
//! an expert read from disk is byte-for-byte the expert a memory map would show.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};

use super::reader::{ByteRange, PreadPool, RangeReader};
use super::{Expert, ExpertNames, ExpertStore, Lease};
use crate::format::safetensors::Checkpoint;
use crate::tensor::{DType, Tensor};
use crate::{Error, Result};

/// Where one expert matrix is on disk.
#[derive(Debug, Clone)]
struct MatrixLocation {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    range: ByteRange,
}

/// Counters of a tiered store.
#[derive(Debug, Default)]
pub struct StoreStats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub bytes_read: AtomicU64,
}

struct Cache {
    entries: HashMap<(usize, usize), (Arc<Expert>, u64)>,
    used: u64,
    tick: u64,
}

struct Inner {
    cache: Mutex<Cache>,
    capacity: u64,
    stats: StoreStats,
}

/// Routed experts read from disk into a bounded LRU cache.
pub struct TieredStore {
    locations: Vec<Vec<[MatrixLocation; 3]>>,
    reader: Arc<dyn RangeReader>,
    inner: Arc<Inner>,
    total_bytes: usize,
}

impl TieredStore {
    /// Describe the experts named by `names[layer][expert]` (shapes checked) and size the cache
    /// as `budget` less the checkpoint's resident (non-expert) bytes.
    pub fn open(
        ckpt: &Checkpoint,
        names: &[Vec<ExpertNames>],
        hidden: usize,
        intermediate: usize,
        budget: u64,
        io_threads: usize,
    ) -> Result<TieredStore> {
        let locate = |name: &str, shape: [usize; 2]| -> Result<MatrixLocation> {
            let t = ckpt.weight(name, &shape)?; // checks existence, shape and dtype
            let d = ckpt.desc(name)?;
            Ok(MatrixLocation {
                name: name.to_string(),
                shape: t.shape.clone(),
                dtype: t.dtype,
                range: ByteRange {
                    file: d.file,
                    offset: d.offset as u64,
                    len: d.len,
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
                        total_bytes += m.iter().map(|x| x.range.len).sum::<usize>();
                        Ok(m)
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let resident = (ckpt.total_bytes() - total_bytes) as u64;
        if resident > budget {
            return Err(Error::Invalid(format!(
                "the resident weights alone ({:.2} GB: embeddings, attention, norms, routers, dense layers) do not fit the RAM budget of {:.2} GB; raise --ram to at least {:.2} GB",
                resident as f64 / 1e9,
                budget as f64 / 1e9,
                resident as f64 / 1e9
            )));
        }
        let paths: Vec<_> = (0..ckpt_file_count(ckpt))
            .map(|i| ckpt.file_path(i).to_path_buf())
            .collect();
        Ok(TieredStore {
            locations,
            reader: Arc::new(PreadPool::new(&paths, io_threads)?),
            inner: Arc::new(Inner {
                cache: Mutex::new(Cache {
                    entries: HashMap::new(),
                    used: 0,
                    tick: 0,
                }),
                capacity: budget - resident,
                stats: StoreStats::default(),
            }),
            total_bytes,
        })
    }

    /// Bytes the expert cache may hold.
    pub fn capacity(&self) -> u64 {
        self.inner.capacity
    }

    /// Hit, miss and read counters.
    pub fn stats(&self) -> &StoreStats {
        &self.inner.stats
    }
}

fn ckpt_file_count(ckpt: &Checkpoint) -> usize {
    ckpt.tensors()
        .values()
        .map(|d| d.file + 1)
        .max()
        .unwrap_or(0)
}

impl Inner {
    /// Keep `expert` in the cache, evicting least recently used entries to make room. An
    /// expert larger than the whole cache is not kept.
    fn insert(&self, key: (usize, usize), expert: &Arc<Expert>) {
        let size = expert.nbytes() as u64;
        if size > self.capacity {
            return;
        }
        let Ok(mut c) = self.cache.lock() else { return };
        if c.entries.contains_key(&key) {
            return;
        }
        while c.used + size > self.capacity {
            let Some((&victim, _)) = c.entries.iter().min_by_key(|(_, (_, t))| *t) else {
                break;
            };
            if let Some((e, _)) = c.entries.remove(&victim) {
                c.used -= e.nbytes() as u64;
            }
        }
        c.tick += 1;
        let tick = c.tick;
        c.used += size;
        c.entries.insert(key, (expert.clone(), tick));
    }
}

impl ExpertStore for TieredStore {
    fn acquire(&self, layer: usize, experts: &[usize]) -> Result<Lease> {
        let table = self
            .locations
            .get(layer)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| Error::Invalid(format!("no routed experts in layer {layer}")))?;
        let mut ready = Vec::new();
        let mut misses = Vec::new();
        {
            let mut c = self
                .inner
                .cache
                .lock()
                .map_err(|_| Error::Invalid("expert cache poisoned".into()))?;
            for &e in experts {
                if e >= table.len() {
                    return Err(Error::Invalid(format!(
                        "expert {e} out of range in layer {layer}"
                    )));
                }
                c.tick += 1;
                let tick = c.tick;
                match c.entries.get_mut(&(layer, e)) {
                    Some((x, t)) => {
                        *t = tick;
                        ready.push((e, x.clone()));
                    }
                    None => misses.push(e),
                }
            }
        }
        let stats = &self.inner.stats;
        stats.hits.fetch_add(ready.len() as u64, Ordering::Relaxed);
        stats
            .misses
            .fetch_add(misses.len() as u64, Ordering::Relaxed);
        let (tx, rx) = channel();
        for &e in &misses {
            let loc = table[e].clone();
            let tx = tx.clone();
            let inner = self.inner.clone();
            let ranges = loc.iter().map(|m| m.range.clone()).collect();
            self.reader.submit(
                ranges,
                Box::new(move |bufs| {
                    let result = bufs.map(|mut b| {
                        let make = |m: &MatrixLocation, storage| Tensor {
                            name: m.name.clone(),
                            shape: m.shape.clone(),
                            dtype: m.dtype,
                            storage,
                        };
                        let down = make(&loc[2], b.pop().unwrap());
                        let up = make(&loc[1], b.pop().unwrap());
                        let gate = make(&loc[0], b.pop().unwrap());
                        let expert = Arc::new(Expert { gate, up, down });
                        inner
                            .stats
                            .bytes_read
                            .fetch_add(expert.nbytes() as u64, Ordering::Relaxed);
                        inner.insert((layer, e), &expert);
                        (e, expert)
                    });
                    let _ = tx.send(result);
                }),
            );
        }
        Ok(Lease::with_pending(ready, misses.len(), rx))
    }

    fn total_bytes(&self) -> usize {
        self.total_bytes
    }
}
