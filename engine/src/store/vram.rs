//! The VRAM tier: routed experts held on a compute device, above the RAM cache and the disk.
//!
//! [`VramTier`] wraps the store below it (resident or tiered). When the model has loaded (its
//! dense matrices placed first), [`VramTier::fill`] takes the device budget that is left and
//! uploads experts into it: the learned hottest first (the usage history's ranking), then the
//! rest a layer at a time in expert order, while they fit. A lease hands those out at once,
//! marked by their device copies, so the MoE block computes them on the device; every other
//! expert comes from the store below as before and is computed on the CPU. The device gives
//! the CPU's bits (`tensor::device`), so which experts sit in VRAM changes time, never tokens.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use super::{Expert, ExpertStore, Lease, StoreSnapshot};
use crate::tensor::device::DevicePlacement;
use crate::{Error, Result};

/// The order [`VramTier::fill`] offers experts to the device (and `coli plan` predicts it
/// in): `hottest` (the usage history's ranking) first, then every other expert of
/// `experts[layer]` routed experts per layer, expert 0 of every layer, then expert 1, and so
/// on; pairs out of range are left out.
pub fn fill_order(hottest: Vec<(usize, usize)>, experts: &[usize]) -> Vec<(usize, usize)> {
    let in_range = |&(layer, e): &(usize, usize)| experts.get(layer).is_some_and(|&n| e < n);
    let mut order: Vec<(usize, usize)> = hottest.into_iter().filter(in_range).collect();
    let mut seen: std::collections::HashSet<(usize, usize)> = order.iter().copied().collect();
    for e in 0..experts.iter().copied().max().unwrap_or(0) {
        for (layer, &n) in experts.iter().enumerate() {
            if e < n && seen.insert((layer, e)) {
                order.push((layer, e));
            }
        }
    }
    order
}

/// Routed experts on a device over the store below.
pub struct VramTier {
    below: Arc<dyn ExpertStore>,
    placement: DevicePlacement,
    /// `slots[layer][expert]`: the device-resident copy, if the expert is in VRAM.
    slots: RwLock<Vec<Vec<Option<Arc<Expert>>>>>,
    /// Experts per layer (0 for dense layers).
    experts: Vec<usize>,
    hits: AtomicU64,
    hit_bytes: AtomicU64,
    held_bytes: AtomicU64,
    /// Experts asked for, in every tier.
    asked: AtomicU64,
}

impl VramTier {
    /// The tier over `below`, empty until [`VramTier::fill`]; `experts[layer]` is the layer's
    /// routed expert count.
    pub fn new(
        below: Arc<dyn ExpertStore>,
        placement: DevicePlacement,
        experts: Vec<usize>,
    ) -> Self {
        let slots = experts.iter().map(|&n| vec![None; n]).collect();
        VramTier {
            below,
            placement,
            slots: RwLock::new(slots),
            experts,
            hits: AtomicU64::new(0),
            hit_bytes: AtomicU64::new(0),
            held_bytes: AtomicU64::new(0),
            asked: AtomicU64::new(0),
        }
    }

    /// Upload experts while the placement's budget lasts: learned hottest first, then layer
    /// by layer. Returns how many went up.
    pub fn fill(&self) -> Result<usize> {
        let mut placed = 0;
        for (layer, e) in fill_order(self.below.hottest(), &self.experts) {
            if self.placement.left() == 0 {
                break;
            }
            let mut lease = self.below.acquire(layer, &[e])?;
            let Some(got) = lease.next_expert() else {
                continue;
            };
            let (_, expert) = got?;
            let Some(on_device) = self.upload(&expert) else {
                continue;
            };
            let bytes = on_device.device_bytes();
            self.held_bytes.fetch_add(bytes, Ordering::Relaxed);
            self.slots
                .write()
                .map_err(|_| Error::Invalid("VRAM tier poisoned".into()))?[layer][e] =
                Some(Arc::new(on_device));
            placed += 1;
        }
        Ok(placed)
    }

    /// The expert with all three matrices on the device (host bytes dropped), or `None`
    /// if they do not all fit or one of them must stay on the CPU (checked first, so no
    /// budget is taken for an expert that cannot be placed whole).
    fn upload(&self, x: &Expert) -> Option<Expert> {
        if ![&x.gate, &x.up, &x.down]
            .iter()
            .all(|t| self.placement.can_place(t))
        {
            return None;
        }
        let gate = self.placement.place(&x.gate, false)?;
        let up = self.placement.place(&x.up, false)?;
        let down = self.placement.place(&x.down, false)?;
        Some(Expert { gate, up, down })
    }

    /// Experts in VRAM now.
    pub fn held(&self) -> usize {
        self.slots
            .read()
            .map(|s| s.iter().flatten().filter(|x| x.is_some()).count())
            .unwrap_or(0)
    }
}

impl Expert {
    /// Bytes of the three matrices' device copies.
    pub fn device_bytes(&self) -> u64 {
        [&self.gate, &self.up, &self.down]
            .iter()
            .filter_map(|t| t.device.as_ref())
            .map(|d| d.bytes)
            .sum()
    }
}

impl ExpertStore for VramTier {
    fn acquire(&self, layer: usize, experts: &[usize]) -> Result<Lease> {
        self.asked
            .fetch_add(experts.len() as u64, Ordering::Relaxed);
        let mut on_device = Vec::new();
        let mut rest = Vec::new();
        {
            let slots = self
                .slots
                .read()
                .map_err(|_| Error::Invalid("VRAM tier poisoned".into()))?;
            for &e in experts {
                match slots
                    .get(layer)
                    .and_then(|l| l.get(e))
                    .and_then(|x| x.clone())
                {
                    Some(x) => {
                        self.hit_bytes
                            .fetch_add(x.device_bytes(), Ordering::Relaxed);
                        on_device.push((e, x));
                    }
                    None => rest.push(e),
                }
            }
        }
        self.hits
            .fetch_add(on_device.len() as u64, Ordering::Relaxed);
        if !on_device.is_empty() {
            let ids: Vec<usize> = on_device.iter().map(|(e, _)| *e).collect();
            self.below.note_uses(layer, &ids);
        }
        if rest.is_empty() {
            return Ok(Lease::ready_now(on_device));
        }
        let below = self.below.acquire(layer, &rest)?;
        Ok(below.prepend(on_device))
    }

    fn hint(&self, layer: usize, experts: &[usize]) {
        let rest: Vec<usize> = match self.slots.read() {
            Ok(s) => experts
                .iter()
                .copied()
                .filter(|&e| {
                    s.get(layer)
                        .and_then(|l| l.get(e))
                        .is_none_or(|x| x.is_none())
                })
                .collect(),
            Err(_) => return,
        };
        self.below.hint(layer, &rest);
    }

    fn wants_hints(&self) -> bool {
        self.below.wants_hints()
    }

    fn step_done(&self, tokens: usize) {
        self.below.step_done(tokens);
    }

    fn flush(&self) -> Result<()> {
        self.below.flush()
    }

    fn flush_soon(&self) {
        self.below.flush_soon();
    }

    fn stats(&self) -> Option<StoreSnapshot> {
        let below = self.below.stats();
        let counted = below.is_some();
        let mut s = below.unwrap_or_default();
        s.vram_hits = self.hits.load(Ordering::Relaxed);
        if !counted {
            // The store below keeps no counters: it holds every expert in memory (mapped), so
            // whatever VRAM did not serve, it served from RAM.
            s.hits = self.asked.load(Ordering::Relaxed) - s.vram_hits;
        }
        s.vram_hit_bytes = self.hit_bytes.load(Ordering::Relaxed);
        // A VRAM hit is a hit: the counts and rates cover every tier.
        s.hits += s.vram_hits;
        s.hit_bytes += s.vram_hit_bytes;
        s.vram_bytes = self.held_bytes.load(Ordering::Relaxed);
        s.vram_experts = self.held() as u64;
        s.device = format!(
            "{} `{}`",
            self.placement.backend().api(),
            self.placement.backend().name()
        );
        let d = self.placement.backend().stats();
        s.device_bytes = d.resident_bytes;
        s.device_upload_bytes = d.upload_bytes;
        s.device_upload_seconds = d.upload_seconds;
        s.device_products = d.products;
        s.device_product_seconds = d.product_seconds;
        s.device_kernel_seconds = d.kernel_seconds;
        Some(s)
    }

    fn hottest(&self) -> Vec<(usize, usize)> {
        self.below.hottest()
    }

    fn note_uses(&self, layer: usize, experts: &[usize]) {
        self.below.note_uses(layer, experts);
    }

    fn total_bytes(&self) -> usize {
        self.below.total_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::fill_order;

    #[test]
    fn the_fill_order_is_the_hottest_then_layer_by_layer() {
        // Layer 1 is dense; (2, 5) is out of range and left out; (0, 1) is not repeated.
        let order = fill_order(vec![(2, 1), (0, 1), (2, 5)], &[2, 0, 3]);
        assert_eq!(order, vec![(2, 1), (0, 1), (0, 0), (2, 0), (2, 2)]);
        assert!(fill_order(Vec::new(), &[]).is_empty());
    }
}
