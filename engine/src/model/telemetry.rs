//! Where forward time goes: process-wide counters of time spent in attention, recurrent
//! (linear-attention) layers, expert matmuls, dense MLPs and the LM head, read by
//! `coli bench`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A part of the forward pass.
#[derive(Debug, Clone, Copy)]
pub enum Part {
    /// Softmax attention layers' attention part (projections, attention, output).
    Attention,
    /// Linear-attention layers' attention part (projections, recurrence, output).
    Recurrent,
    Experts,
    DenseMlp,
    LmHead,
}

/// Nanoseconds per [`Part`], in its declaration order.
static NANOS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

/// Add the time since `start` to `part`.
pub fn add(part: Part, start: Instant) {
    NANOS[part as usize].fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

/// Seconds spent so far per part.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Times {
    pub attention: f64,
    pub recurrent: f64,
    pub experts: f64,
    pub dense_mlp: f64,
    pub lm_head: f64,
}

impl Times {
    fn from_array(s: [f64; 5]) -> Times {
        Times {
            attention: s[0],
            recurrent: s[1],
            experts: s[2],
            dense_mlp: s[3],
            lm_head: s[4],
        }
    }

    fn to_array(self) -> [f64; 5] {
        [
            self.attention,
            self.recurrent,
            self.experts,
            self.dense_mlp,
            self.lm_head,
        ]
    }

    /// Now.
    pub fn now() -> Times {
        Times::from_array(std::array::from_fn(|i| {
            NANOS[i].load(Ordering::Relaxed) as f64 / 1e9
        }))
    }

    /// `self − earlier`.
    pub fn since(&self, earlier: &Times) -> Times {
        let (a, b) = (self.to_array(), earlier.to_array());
        Times::from_array(std::array::from_fn(|i| a[i] - b[i]))
    }
}
