//! Where forward time goes: process-wide counters of time spent in attention, expert matmuls,
//! dense MLPs and the LM head, read by `coli bench`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

static ATTENTION_NS: AtomicU64 = AtomicU64::new(0);
static EXPERTS_NS: AtomicU64 = AtomicU64::new(0);
static DENSE_MLP_NS: AtomicU64 = AtomicU64::new(0);
static LM_HEAD_NS: AtomicU64 = AtomicU64::new(0);

/// A part of the forward pass.
#[derive(Debug, Clone, Copy)]
pub enum Part {
    Attention,
    Experts,
    DenseMlp,
    LmHead,
}

fn counter(p: Part) -> &'static AtomicU64 {
    match p {
        Part::Attention => &ATTENTION_NS,
        Part::Experts => &EXPERTS_NS,
        Part::DenseMlp => &DENSE_MLP_NS,
        Part::LmHead => &LM_HEAD_NS,
    }
}

/// Add the time since `start` to `part`.
pub fn add(part: Part, start: Instant) {
    counter(part).fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// Seconds spent so far per part.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Times {
    pub attention: f64,
    pub experts: f64,
    pub dense_mlp: f64,
    pub lm_head: f64,
}

impl Times {
    /// Now.
    pub fn now() -> Times {
        let s = |p| counter(p).load(Ordering::Relaxed) as f64 / 1e9;
        Times {
            attention: s(Part::Attention),
            experts: s(Part::Experts),
            dense_mlp: s(Part::DenseMlp),
            lm_head: s(Part::LmHead),
        }
    }

    /// `self − earlier`.
    pub fn since(&self, e: &Times) -> Times {
        Times {
            attention: self.attention - e.attention,
            experts: self.experts - e.experts,
            dense_mlp: self.dense_mlp - e.dense_mlp,
            lm_head: self.lm_head - e.lm_head,
        }
    }
}
