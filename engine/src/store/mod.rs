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

/// Experts of one layer, ready to compute, held for the duration of a MoE block.
pub struct Lease {
    experts: Vec<(usize, Arc<Expert>)>,
}

impl Lease {
    /// The leased experts with their ids, in the order they became ready.
    pub fn ready(&self) -> impl Iterator<Item = (usize, &Expert)> {
        self.experts.iter().map(|(id, e)| (*id, e.as_ref()))
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
        Ok(Lease { experts })
    }

    fn total_bytes(&self) -> usize {
        self.layers.iter().flatten().map(|e| e.nbytes()).sum()
    }
}
