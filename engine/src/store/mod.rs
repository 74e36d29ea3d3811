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
pub mod reader;
pub mod tiered;

use std::sync::mpsc::Receiver;
use std::sync::Arc;

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

/// Experts of one layer, handed out as they become ready (cached ones at once, misses as
/// their reads complete), and held while the lease lives.
pub struct Lease {
    ready: std::vec::IntoIter<(usize, Arc<Expert>)>,
    pending: usize,
    arrivals: Option<Receiver<Arrival>>,
}

/// An expert delivered to a lease: its id and matrices, or the read error.
pub type Arrival = Result<(usize, Arc<Expert>)>;

impl Lease {
    /// A lease whose experts are all ready now.
    pub fn ready_now(experts: Vec<(usize, Arc<Expert>)>) -> Lease {
        Lease {
            ready: experts.into_iter(),
            pending: 0,
            arrivals: None,
        }
    }

    /// A lease with some experts ready and `pending` more arriving on `arrivals`.
    pub fn with_pending(
        ready: Vec<(usize, Arc<Expert>)>,
        pending: usize,
        arrivals: Receiver<Arrival>,
    ) -> Lease {
        Lease {
            ready: ready.into_iter(),
            pending,
            arrivals: Some(arrivals),
        }
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
        match self.arrivals.as_ref()?.recv() {
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
    /// Advisory: these experts of `layer` will probably be wanted soon.
    fn hint(&self, _layer: usize, _experts: &[usize]) {}
    /// Bytes of all routed experts.
    fn total_bytes(&self) -> usize;
}

/// Every expert memory-mapped and resident.
pub struct ResidentStore {
    layers: Vec<Vec<Arc<Expert>>>,
}

impl ResidentStore {
    /// Load the experts named by `names[layer][expert]`, checking shapes `[I, D]` / `[D, I]`.
    /// Layers without routed experts have an empty list.
    pub fn open(
        ckpt: &Checkpoint,
        names: &[Vec<ExpertNames>],
        hidden: usize,
        intermediate: usize,
    ) -> Result<ResidentStore> {
        let layers = names
            .iter()
            .map(|layer| {
                layer
                    .iter()
                    .map(|n| {
                        Ok(Arc::new(Expert {
                            gate: ckpt.weight(&n.gate, &[intermediate, hidden])?,
                            up: ckpt.weight(&n.up, &[intermediate, hidden])?,
                            down: ckpt.weight(&n.down, &[hidden, intermediate])?,
                        }))
                    })
                    .collect::<Result<Vec<_>>>()
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
}

/// The expert store for these experts under `opts`: all resident without a budget, tiered
/// (read from disk into a cache of what the budget leaves after the resident set) with one.
pub fn open(
    ckpt: &Checkpoint,
    names: &[Vec<ExpertNames>],
    hidden: usize,
    intermediate: usize,
    opts: &StoreOptions,
) -> Result<Arc<dyn ExpertStore>> {
    match opts.ram_budget {
        None => Ok(Arc::new(ResidentStore::open(
            ckpt,
            names,
            hidden,
            intermediate,
        )?)),
        Some(budget) => Ok(Arc::new(tiered::TieredStore::open(
            ckpt,
            names,
            hidden,
            intermediate,
            budget,
            if opts.io_threads == 0 {
                4
            } else {
                opts.io_threads
            },
        )?)),
    }
}
