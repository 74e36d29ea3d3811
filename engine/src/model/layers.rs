//! Layers shared by the architectures: linear projections, RMSNorm, RoPE, grouped-query
//! attention with a KV cache and optional sliding window, the SwiGLU MLP and the routed
//! mixture-of-experts block. Each is written once here so a fix reaches every family.
//!
//! Activations are `f32`, row-major `[tokens, features]`. Every reduction has a fixed order
//! (see `tensor::kernels`), so batching and threads never change a result.

use std::sync::Arc;

use rayon::prelude::*;

use super::cache::{KvBuf, KvDType, LayerKv};
use crate::format::config::{RopeKind, RopeParams};
use crate::format::safetensors::Checkpoint;
use crate::store::ExpertStore;
use crate::tensor::attention::{
    group_scores, group_weighted_values, round_to_f16, softmax, KvRows,
};
use crate::tensor::device::place_dense;
use crate::tensor::kernels::Isa;
use crate::tensor::matmul::{
    matmul_groups, tensor_matmul, tensor_matmul_many, tensor_matmul_pair, MatmulGroup,
};
use crate::tensor::Tensor;
use crate::Result;

/// `y = x·Wᵀ + b` with `W` stored `[out, in]`.
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// Load `{prefix}.weight` `[out, in]` and, if `bias`, `{prefix}.bias` `[out]`.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear> {
        // On the loading model's device when its budget has room (tensor::device).
        let weight = place_dense(ckpt.weight(&format!("{prefix}.weight"), &[out, inp])?);
        let bias = if bias {
            Some(ckpt.vector_f32(&format!("{prefix}.bias"), out)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// Wrap an existing weight tensor.
    pub fn from_tensor(weight: Tensor) -> Linear {
        Linear {
            weight: place_dense(weight),
            bias: None,
        }
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.weight.shape[0]
    }

    /// Apply to `m` rows.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut y = tensor_matmul(x, &self.weight);
        if let Some(b) = &self.bias {
            add_row_bias(&mut y, b);
        }
        y
    }

    /// Apply several projections to the same `m` rows (an attention's q, k and v, an MLP's
    /// gate and up): the activations are quantized once and all the products share one
    /// parallel step where the weights allow ([`tensor_matmul_many`]), so decode hands work
    /// to the threads once instead of once per projection. Each output is the one
    /// [`Linear::forward`] gives.
    pub fn forward_many<const N: usize>(ls: [&Linear; N], x: &[f32]) -> [Vec<f32>; N] {
        let ys = tensor_matmul_many(x, &ls.map(|l| &l.weight));
        let mut ys = ys.into_iter().zip(ls).map(|(mut y, l)| {
            if let Some(b) = &l.bias {
                add_row_bias(&mut y, b);
            }
            y
        });
        std::array::from_fn(|_| ys.next().expect("one output per projection"))
    }
}

/// Root-mean-square norm (Llama style: normalise in f32, then multiply by the weight).
pub struct RmsNorm {
    pub weight: Vec<f32>,
    pub eps: f32,
}

impl RmsNorm {
    /// Load `{name}` of length `dim`.
    pub fn load(ckpt: &Checkpoint, name: &str, dim: usize, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: ckpt.vector_f32(name, dim)?,
            eps: eps as f32,
        })
    }

    /// Normalise every row of `weight.len()` values in place.
    pub fn forward_inplace(&self, x: &mut [f32]) {
        let d = self.weight.len();
        for row in x.chunks_mut(d) {
            let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let r = 1.0 / (mean_sq + self.eps).sqrt();
            for (v, w) in row.iter_mut().zip(&self.weight) {
                *v = w * (*v * r);
            }
        }
    }

    /// Normalised copy.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut y = x.to_vec();
        self.forward_inplace(&mut y);
        y
    }
}

/// Rotary position embedding tables.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Inverse frequencies, `rotary_dim / 2` of them.
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (yarn's attention factor; 1 otherwise).
    pub scaling: f32,
    /// Leading dimensions of each head that rotate; the rest pass through.
    pub rotary_dim: usize,
    /// Pairs are adjacent elements `(2i, 2i + 1)` rather than halves.
    pub interleaved: bool,
}

impl Rope {
    /// No rotation at all (NoPE attention: Kimi Linear's and GLM-5-next's MLA).
    pub fn none() -> Rope {
        Rope {
            inv_freq: Vec::new(),
            scaling: 1.0,
            rotary_dim: 0,
            interleaved: false,
        }
    }

    /// Frequencies for heads of `head_dim` from the config's RoPE parameters, computed in f32
    /// the way transformers computes them.
    pub fn new(params: &RopeParams, head_dim: usize) -> Rope {
        let d = ((head_dim as f64) * params.partial_rotary_factor) as usize;
        let theta = params.theta as f32;
        let base: Vec<f32> = (0..d / 2)
            .map(|i| theta.powf((2 * i) as f32 / d as f32))
            .collect();
        let mut inv_freq: Vec<f32> = base.iter().map(|b| 1.0 / b).collect();
        let mut scaling = 1.0f32;
        match &params.kind {
            RopeKind::Default => {}
            RopeKind::Linear { factor } => {
                for f in &mut inv_freq {
                    *f /= *factor as f32;
                }
            }
            RopeKind::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: omp,
            } => {
                let (factor, lo, hi, omp) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                    *omp as f32,
                );
                let low_wavelen = omp / lo;
                let high_wavelen = omp / hi;
                for f in &mut inv_freq {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    let scaled = if wavelen > low_wavelen {
                        *f / factor
                    } else {
                        *f
                    };
                    let smooth = (omp / wavelen - lo) / (hi - lo);
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    *f = if medium {
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
            RopeKind::Yarn {
                factor,
                original_max_position_embeddings: omp,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let get_mscale = |s: f64, m: f64| {
                    if s <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * s.ln() + 1.0
                    }
                };
                scaling = match (attention_factor, mscale, mscale_all_dim) {
                    (Some(a), _, _) => *a,
                    (None, Some(m), Some(ma)) if *m != 0.0 && *ma != 0.0 => {
                        get_mscale(*factor, *m) / get_mscale(*factor, *ma)
                    }
                    _ => get_mscale(*factor, 1.0),
                } as f32;
                let dim = d as f64;
                let correction = |rot: f64| {
                    dim * (omp / (rot * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * params.theta.ln())
                };
                let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                low = low.max(0.0);
                high = high.min(dim - 1.0);
                if low == high {
                    high += 0.001;
                }
                for (i, f) in inv_freq.iter_mut().enumerate() {
                    let ramp =
                        ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0 - ramp;
                    let extrap = 1.0 / base[i];
                    let interp = 1.0 / (*factor as f32 * base[i]);
                    *f = interp * (1.0 - extrapolation_factor) + extrap * extrapolation_factor;
                }
            }
        }
        if let Some(f) = &params.freq_factors {
            for (v, f) in inv_freq.iter_mut().zip(f) {
                *v /= *f as f32;
            }
        }
        Rope {
            inv_freq,
            scaling,
            rotary_dim: d,
            interleaved: params.interleaved,
        }
    }

    /// Rotate `x` laid out `[tokens, heads, head_dim]` in place, token `t` at position
    /// `positions[t]`: pair `i` is elements `(i, i + rotary_dim/2)` (half-split, Hugging Face)
    /// or `(2i, 2i + 1)` (interleaved, llama.cpp's permuted Q/K); both rotate by the same angles.
    pub fn apply(&self, x: &mut [f32], heads: usize, head_dim: usize, positions: &[usize]) {
        let half = self.rotary_dim / 2;
        let pair = |i: usize| {
            if self.interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            }
        };
        let mut cos = vec![0.0f32; half];
        let mut sin = vec![0.0f32; half];
        for (t, &pos) in positions.iter().enumerate() {
            for i in 0..half {
                let f = pos as f32 * self.inv_freq[i];
                cos[i] = f.cos() * self.scaling;
                sin[i] = f.sin() * self.scaling;
            }
            for h in 0..heads {
                let base = (t * heads + h) * head_dim;
                let v = &mut x[base..base + head_dim];
                for i in 0..half {
                    let (p, q) = pair(i);
                    let (a, b) = (v[p], v[q]);
                    v[p] = a * cos[i] - b * sin[i];
                    v[q] = b * cos[i] + a * sin[i];
                }
            }
        }
    }

    /// Interleaved rotation of the trailing `rotary_dim` dims of every `width`-wide head of
    /// `x` (`[tokens, heads, width]`), token `t` at `positions[t]`; `inverse` rotates back
    /// (DeepSeek-V4, whose heads keep their rope part last and whose attention output is
    /// rotated back at the query position). The same angles and products as [`Rope::apply`].
    pub fn apply_trailing(&self, x: &mut [f32], width: usize, positions: &[usize], inverse: bool) {
        let rd = self.rotary_dim;
        let heads = x.len() / (positions.len() * width);
        let sign = if inverse { -1.0 } else { 1.0 };
        for (t, &pos) in positions.iter().enumerate() {
            for i in 0..rd / 2 {
                let f = pos as f32 * self.inv_freq[i];
                let (c, s) = (f.cos() * self.scaling, sign * f.sin() * self.scaling);
                for h in 0..heads {
                    let base = (t * heads + h) * width + width - rd;
                    let (a, b) = (x[base + 2 * i], x[base + 2 * i + 1]);
                    x[base + 2 * i] = a * c - b * s;
                    x[base + 2 * i + 1] = b * c + a * s;
                }
            }
        }
    }
}

/// `x · rsqrt(mean(x²) + eps)` over rows of `width` (an RMSNorm without weight).
pub fn unweighted_rms(x: &mut [f32], width: usize, eps: f32) {
    for row in x.chunks_mut(width) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for v in row.iter_mut() {
            *v *= r;
        }
    }
}

/// Normalisation of queries and keys before RoPE.
pub enum QkNorm {
    None,
    /// One RMSNorm over all heads jointly (OLMoE, MiniMax).
    FullWidth {
        q: RmsNorm,
        k: RmsNorm,
    },
    /// RMSNorm over each head separately (Qwen3, GLM).
    PerHead {
        q: RmsNorm,
        k: RmsNorm,
    },
}

/// Grouped-query causal self-attention.
pub struct Attention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub qk_norm: QkNorm,
    /// Clamp q, k and v to `±clip` after the norms (OLMoE's clip_qkv).
    pub clip_qkv: Option<f32>,
    pub rope: Rope,
    /// Each query sees this many most recent keys, itself included.
    pub window: Option<usize>,
    pub scale: f32,
    /// Round queries, keys, values and attention probabilities to f16 precision, as
    /// llama.cpp's default f16 KV cache path does (on for GGUF files, so they run as
    /// llama.cpp runs them).
    pub kv_f16: bool,
    /// The query projection also yields, per head, an output gate (`[q hd | gate hd]`):
    /// attention rows are multiplied by `sigmoid(gate)` before the output projection
    /// (Qwen3-Next's gated attention).
    pub output_gate: bool,
    /// One learned sink logit per head: it joins each softmax's denominator and adds no
    /// value (`p_j = e^{s_j} / (Σ_k e^{s_k} + e^{sink})`; gpt-oss).
    pub sinks: Option<Vec<f32>>,
}

impl Attention {
    /// The precision its cache keeps keys and values in: f16 when they are rounded to f16
    /// before they are cached ([`Attention::kv_f16`]; exact, half the bytes), else f32.
    pub fn kv_dtype(&self) -> KvDType {
        if self.kv_f16 {
            KvDType::F16
        } else {
            KvDType::F32
        }
    }

    /// Attend `x` (`[T, D]`, tokens at positions `start..`) and append its keys and values to
    /// `kv`. Returns `[T, D]`.
    pub fn forward(&self, x: &[f32], start: usize, kv: &mut LayerKv) -> Vec<f32> {
        let (q, k, v, gate) = self.project(x);
        let mut out = self.attend_sequence(q, k, v, start, kv);
        if let Some(gate) = gate {
            self.apply_output_gate(&mut out, &gate);
        }
        self.o.forward(&out)
    }

    /// The q, k and v projections of rows `x` (any number of sequences: row-wise, so a batch
    /// gives each row the bits it gets alone), and the output gate rows if it has one.
    #[allow(clippy::type_complexity)]
    pub fn project(&self, x: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
        let [q, k, v] = Linear::forward_many([&self.q, &self.k, &self.v], x);
        if !self.output_gate {
            return (q, k, v, None);
        }
        let hd = self.head_dim;
        let (mut queries, mut gate) = (Vec::with_capacity(q.len() / 2), Vec::new());
        gate.reserve(q.len() / 2);
        for head in q.chunks(2 * hd) {
            queries.extend_from_slice(&head[..hd]);
            gate.extend_from_slice(&head[hd..]);
        }
        (queries, k, v, Some(gate))
    }

    /// Multiply attention rows by `sigmoid(gate)` (see [`Attention::output_gate`]).
    pub fn apply_output_gate(&self, rows: &mut [f32], gate: &[f32]) {
        for (r, g) in rows.iter_mut().zip(gate) {
            *r *= sigmoid(*g);
        }
    }

    /// One sequence's attention from its projected rows (tokens at positions `start..`):
    /// q/k norms, clipping, RoPE, the keys and values appended to `kv`, attention over the
    /// cache. Returns the rows before the output projection (`[T, heads · head_dim]`).
    pub fn attend_sequence(
        &self,
        mut q: Vec<f32>,
        mut k: Vec<f32>,
        mut v: Vec<f32>,
        start: usize,
        kv: &mut LayerKv,
    ) -> Vec<f32> {
        let (h, kvh, hd) = (self.heads, self.kv_heads, self.head_dim);
        let t_len = q.len() / (h * hd);
        match &self.qk_norm {
            QkNorm::None => {}
            QkNorm::FullWidth { q: qn, k: kn } | QkNorm::PerHead { q: qn, k: kn } => {
                qn.forward_inplace(&mut q);
                kn.forward_inplace(&mut k);
            }
        }
        if let Some(c) = self.clip_qkv {
            for t in [&mut q, &mut k, &mut v] {
                for x in t.iter_mut() {
                    *x = x.clamp(-c, c);
                }
            }
        }
        let positions: Vec<usize> = (start..start + t_len).collect();
        self.rope.apply(&mut q, h, hd, &positions);
        self.rope.apply(&mut k, kvh, hd, &positions);
        if self.kv_f16 {
            for t in [&mut q, &mut k, &mut v] {
                for x in t.iter_mut() {
                    *x = half::f16::from_f32(*x).to_f32();
                }
            }
        }
        kv.k.extend(&k);
        kv.v.extend(&v);
        attend(
            &q,
            kv,
            AttendShape {
                heads: h,
                kv_heads: kvh,
                head_dim: hd,
                window: self.window,
                scale: self.scale,
                sinks: self.sinks.as_deref().map(Sinks::PerHead),
                bias: None,
            },
            start,
            self.kv_f16,
        )
    }
}

/// What [`attend`] needs to know of the attention besides its rows.
#[derive(Debug, Clone, Copy)]
pub struct AttendShape<'a> {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Each query sees this many most recent keys, itself included.
    pub window: Option<usize>,
    pub scale: f32,
    /// Sink logits ([`Attention::sinks`]).
    pub sinks: Option<Sinks<'a>>,
    /// A relative position bias added to every score (Inkling).
    pub bias: Option<RelBias<'a>>,
}

/// Attention-sink logits: each joins its softmax's denominator and adds no value.
#[derive(Debug, Clone, Copy)]
pub enum Sinks<'a> {
    /// One per head, `[H]` (gpt-oss).
    PerHead(&'a [f32]),
    /// One per query token and head, `[T, H]` (Inkling 2's `attn_sink_proj`).
    PerToken(&'a [f32]),
}

/// A relative position bias: the score of key `j` for query token `t` (at position `p`) of
/// head `h` gains `profiles[t, h, p − j]` when `p − j < extent`, nothing farther back.
#[derive(Debug, Clone, Copy)]
pub struct RelBias<'a> {
    /// `[T, H, extent]`.
    pub profiles: &'a [f32],
    pub extent: usize,
}

/// Scaled dot-product attention of queries `q` (`[T, H, hd]`, at positions `start..`) over
/// the cached keys and values, causal, optionally windowed, biased and with sinks (`shape`); with
/// `probs_f16` the attention probabilities are rounded to f16 before weighting the values
/// (llama.cpp's f16 KV path). The query heads that share a key/value head are taken together
/// ([`group_scores`], [`group_weighted_values`]: each cached row read once for all of them), and
/// each head gets, in a fixed order, what it would alone: its scores (each the canonical
/// [`dot`](crate::tensor::kernels::dot) of the query and one key), the softmax over its row,
/// then the probability-weighted value sum in ascending key order — so a token's result never
/// depends on the tokens beside it, the threads, or how a prompt was split into calls.
///
/// How the work is cut into parallel tasks changes no bit: one task per (token, key/value head)
/// when there are enough of them; for decode with few key/value heads, parts of a group's query
/// heads, or — over long caches — [`attend_split_keys`]'s cut of the keys and the value
/// elements, which reads each cached row once whatever the threads.
pub fn attend(
    q: &[f32],
    kv: &LayerKv,
    shape: AttendShape<'_>,
    start: usize,
    probs_f16: bool,
) -> Vec<f32> {
    let (heads, kv_heads, head_dim) = (shape.heads, shape.kv_heads, shape.head_dim);
    let isa = Isa::detect();
    let group = heads / kv_heads;
    let kv_dim = kv_heads * head_dim;
    let (keys, values) = (kv_rows(&kv.k), kv_rows(&kv.v));
    let tokens = q.len() / (heads * head_dim);
    let parallel = q.len() * (start + tokens) >= 1 << 16;
    let threads = rayon::current_num_threads();
    let few_groups = parallel && tokens * kv_heads < 2 * threads;
    let fewest_keys = (start..start + tokens)
        .map(|pos| visible_keys(shape.window, pos).1)
        .min()
        .unwrap_or(0);
    if few_groups && fewest_keys >= SPLIT_KEYS_FROM {
        return attend_split_keys(q, kv, shape, start, probs_f16, threads);
    }
    let mut out = vec![0.0f32; q.len()];
    // A task takes `per_task` query heads of one key/value head's group (a divisor of the
    // group): the whole group, unless there are too few groups to keep every thread busy
    // (decode with few key/value heads), then smaller parts of it. Each head's scores and
    // values are computed alone (the kernels work row by row), so the split changes no bit.
    let per_task = if few_groups {
        let parts = (2 * threads).div_ceil(tokens * kv_heads);
        (1..=group)
            .rev()
            .find(|h| group.is_multiple_of(*h) && group / h >= parts.min(group))
            .unwrap_or(1)
    } else {
        group
    };
    // Task `idx` = (token t, query heads h0 .. h0 + per_task, all of key/value head g), whose
    // outputs are one contiguous run of `out`.
    let work = |(idx, o): (usize, &mut [f32])| {
        let (t, h0) = (
            idx / (heads / per_task),
            idx % (heads / per_task) * per_task,
        );
        let g = h0 / group;
        let (first, n) = visible_keys(shape.window, start + t);
        if n == 0 {
            return; // a window of 0 sees no key: the output stays 0, as in the reference
        }
        let q0 = (t * heads + h0) * head_dim;
        let qg = &q[q0..q0 + per_task * head_dim];
        // This group's keys and values from key `first` on: row j at (j − first) · kv_dim.
        let from = first * kv_dim + g * head_dim;
        let mut scores = vec![0.0f32; per_task * n];
        group_scores(isa, qg, head_dim, keys.from(from), kv_dim, n, &mut scores);
        for (r, row) in scores.chunks_mut(n).enumerate() {
            finish_scores(&shape, start, t, h0 + r, first, probs_f16, row);
        }
        group_weighted_values(isa, &scores, n, values.from(from), kv_dim, head_dim, o);
    };
    let tasks_out = per_task * head_dim;
    if parallel {
        out.par_chunks_mut(tasks_out).enumerate().for_each(work);
    } else {
        out.chunks_mut(tasks_out).enumerate().for_each(work);
    }
    out
}

/// From how many visible keys [`attend`] cuts a decode step's groups by keys and value
/// elements ([`attend_split_keys`]) rather than by query heads.
const SPLIT_KEYS_FROM: usize = 512;

/// The first key a query at position `pos` sees, and how many it sees.
fn visible_keys(window: Option<usize>, pos: usize) -> (usize, usize) {
    let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
    (first, pos + 1 - first)
}

/// Turn the raw scores of query token `t`, head `hh` (`row`: keys `first..=start + t`) into
/// attention probabilities: scaled, biased, the softmax with the head's sink, rounded to f16
/// when `probs_f16`.
fn finish_scores(
    shape: &AttendShape<'_>,
    start: usize,
    t: usize,
    hh: usize,
    first: usize,
    probs_f16: bool,
    row: &mut [f32],
) {
    let pos = start + t;
    let at = t * shape.heads + hh;
    for s in row.iter_mut() {
        *s *= shape.scale;
    }
    if let Some(b) = shape.bias {
        for (s, j) in row.iter_mut().zip(first..) {
            if pos - j < b.extent {
                *s += b.profiles[at * b.extent + pos - j];
            }
        }
    }
    let sink = match shape.sinks {
        Some(Sinks::PerHead(sinks)) => Some(sinks[hh]),
        Some(Sinks::PerToken(sinks)) => Some(sinks[at]),
        None => None,
    };
    softmax(row, sink);
    if probs_f16 {
        // llama.cpp multiplies its f16 values by probabilities converted to f16.
        round_to_f16(row);
    }
}

/// [`attend`] for few (token, key/value head) groups over a long cache (decode), in three
/// parallel steps that keep each group's query heads together, so every cached key and value
/// row is read once, by one thread: (1) the scores of consecutive runs of keys, (2) each
/// head's softmax, (3) the weighted value sums of runs of the head's elements. A score is one
/// [`dot`](crate::tensor::kernels::dot) whatever run its key falls in, and an output element
/// sums over every key in ascending order whatever run of elements holds it, so the bits are
/// [`attend`]'s whatever the cut.
fn attend_split_keys(
    q: &[f32],
    kv: &LayerKv,
    shape: AttendShape<'_>,
    start: usize,
    probs_f16: bool,
    threads: usize,
) -> Vec<f32> {
    let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
    let isa = Isa::detect();
    let group = heads / kv_heads;
    let kv_dim = kv_heads * hd;
    let (keys, values) = (kv_rows(&kv.k), kv_rows(&kv.v));
    let tokens = q.len() / (heads * hd);
    let groups = tokens * kv_heads;
    let parts = (2 * threads).div_ceil(groups).max(1);
    // (1) Scores: task (group gi = t · kv_heads + g, key run c), runs of whole 16-key steps.
    let run_of = |n: usize| n.div_ceil(parts).next_multiple_of(16);
    let runs: Vec<(usize, usize)> = (0..groups)
        .flat_map(|gi| {
            let n = visible_keys(shape.window, start + gi / kv_heads).1;
            let run = run_of(n);
            (0..n.div_ceil(run)).map(move |c| (gi, c))
        })
        .collect();
    let run_scores: Vec<Vec<f32>> = runs
        .par_iter()
        .map(|&(gi, c)| {
            let (t, g) = (gi / kv_heads, gi % kv_heads);
            let (first, n) = visible_keys(shape.window, start + t);
            let run = run_of(n);
            let (j0, len) = (c * run, run.min(n - c * run));
            let q0 = (t * heads + g * group) * hd;
            let from = (first + j0) * kv_dim + g * hd;
            let mut s = vec![0.0f32; group * len];
            group_scores(
                isa,
                &q[q0..q0 + group * hd],
                hd,
                keys.from(from),
                kv_dim,
                len,
                &mut s,
            );
            s
        })
        .collect();
    // Each group's scores as rows of its heads, `[group, n]`.
    let mut scores: Vec<Vec<f32>> = (0..groups)
        .map(|gi| vec![0.0f32; group * visible_keys(shape.window, start + gi / kv_heads).1])
        .collect();
    for (&(gi, c), s) in runs.iter().zip(&run_scores) {
        let n = scores[gi].len() / group;
        let (j0, len) = (c * run_of(n), s.len() / group);
        for r in 0..group {
            scores[gi][r * n + j0..r * n + j0 + len].copy_from_slice(&s[r * len..(r + 1) * len]);
        }
    }
    // (2) Each head's probabilities.
    scores.par_iter_mut().enumerate().for_each(|(gi, s)| {
        let (t, g) = (gi / kv_heads, gi % kv_heads);
        let (first, n) = visible_keys(shape.window, start + t);
        s.par_chunks_mut(n).enumerate().for_each(|(r, row)| {
            finish_scores(&shape, start, t, g * group + r, first, probs_f16, row);
        });
    });
    // (3) Weighted values: task (group gi, elements e0 .. e0 + width of each head), in runs of
    // 32 elements (the AVX-512 kernel's step) where the head dimension allows.
    let unit = if hd.is_multiple_of(32) { 32 } else { hd };
    let width = (hd / unit).div_ceil(parts).max(1) * unit;
    let slices: Vec<(usize, usize)> = (0..groups)
        .flat_map(|gi| (0..hd.div_ceil(width)).map(move |c| (gi, c * width)))
        .collect();
    let sums: Vec<Vec<f32>> = slices
        .par_iter()
        .map(|&(gi, e0)| {
            let (t, g) = (gi / kv_heads, gi % kv_heads);
            let (first, n) = visible_keys(shape.window, start + t);
            let w = width.min(hd - e0);
            let mut o = vec![0.0f32; group * w];
            let from = first * kv_dim + g * hd + e0;
            group_weighted_values(isa, &scores[gi], n, values.from(from), kv_dim, w, &mut o);
            o
        })
        .collect();
    let mut out = vec![0.0f32; q.len()];
    for (&(gi, e0), o) in slices.iter().zip(&sums) {
        let (t, g) = (gi / kv_heads, gi % kv_heads);
        let w = o.len() / group;
        for r in 0..group {
            let at = (t * heads + g * group + r) * hd + e0;
            out[at..at + w].copy_from_slice(&o[r * w..(r + 1) * w]);
        }
    }
    out
}

/// A key or value buffer of grouped-query attention as the attention kernels read it.
fn kv_rows(buf: &KvBuf) -> KvRows<'_> {
    match buf {
        KvBuf::F32(v) => KvRows::F32(v),
        KvBuf::F16(v) => KvRows::F16(v),
        KvBuf::Bf16(_) => panic!("grouped-query attention keeps an f32 or f16 cache"),
    }
}

/// Softmax in place over `x` and one more logit, `sink`, which is left out of the result:
/// `x_j ← e^{x_j − m} / (Σ_k e^{x_k − m} + e^{sink − m})`, `m` the maximum of both
/// (attention sinks, as transformers computes them).
pub fn softmax_with_sink(x: &mut [f32], sink: f32) {
    let max = x.iter().copied().fold(sink, f32::max);
    let mut sum = (sink - max).exp();
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// Numerically stable softmax in place.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// `x · sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `down(silu(gate(x)) · up(x))`, optionally clamped (see [`swiglu`]).
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    /// DeepSeek-V4's `swiglu_limit`.
    pub limit: Option<f32>,
}

impl Mlp {
    /// Load `{prefix}.{gate,up,down}_proj`.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        hidden: usize,
        inter: usize,
        bias: bool,
    ) -> Result<Mlp> {
        Ok(Mlp {
            gate: Linear::load(ckpt, &format!("{prefix}.gate_proj"), inter, hidden, bias)?,
            up: Linear::load(ckpt, &format!("{prefix}.up_proj"), inter, hidden, bias)?,
            down: Linear::load(ckpt, &format!("{prefix}.down_proj"), hidden, inter, bias)?,
            limit: None,
        })
    }

    /// Apply to `[T, D]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let [g, u] = Linear::forward_many([&self.gate, &self.up], x);
        let h: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| swiglu(g, u, self.limit))
            .collect();
        self.down.forward(&h)
    }
}

/// `silu(g) · u`; with a limit ℓ (DeepSeek-V4), `g` is first clamped to `≤ ℓ` and `u` to
/// `[−ℓ, ℓ]`.
#[inline]
pub fn swiglu(g: f32, u: f32, limit: Option<f32>) -> f32 {
    match limit {
        None => silu(g) * u,
        Some(l) => silu(g.min(l)) * u.clamp(-l, l),
    }
}

/// The activation between an expert's gate/up rows and its down projection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GluActivation {
    /// `silu(g) · u`, optionally clamped ([`swiglu`]; DeepSeek-V4's `swiglu_limit`).
    SwiGlu { limit: Option<f32> },
    /// gpt-oss: `g ← min(g, ℓ)`, `u ← clamp(u, −ℓ, ℓ)`, then `(u + 1) · g · sigmoid(α·g)`.
    ClampedGlu { alpha: f32, limit: f32 },
    /// Inkling 2: `gate · tanh(g / gate) · sigmoid(g) · up · tanh(u / up)`, the softcaps
    /// bounding the gate's linear factor and `u` (the sigmoid sees the raw `g`).
    Softcapped { gate: f32, up: f32 },
}

impl GluActivation {
    /// The plain SwiGLU.
    pub const SWIGLU: GluActivation = GluActivation::SwiGlu { limit: None };

    /// The activation of one (gate, up) pair.
    #[inline]
    pub fn apply(self, g: f32, u: f32) -> f32 {
        match self {
            GluActivation::SwiGlu { limit } => swiglu(g, u, limit),
            GluActivation::ClampedGlu { alpha, limit } => {
                let g = g.min(limit);
                let u = u.clamp(-limit, limit);
                (u + 1.0) * (g * sigmoid(g * alpha))
            }
            GluActivation::Softcapped { gate, up } => {
                (g / gate).tanh() * gate * sigmoid(g) * ((u / up).tanh() * up)
            }
        }
    }
}

/// One expert's biases (gpt-oss): added to its gate, up and down outputs.
#[derive(Debug, Clone, Copy)]
pub struct ExpertBias<'a> {
    pub gate: &'a [f32],
    pub up: &'a [f32],
    pub down: &'a [f32],
}

/// Every routed expert's biases of a layer, expert-major (`gate`/`up`: `[E, I]`, `down`:
/// `[E, D]`), kept resident (they are small).
#[derive(Debug, Clone)]
pub struct ExpertBiases {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

impl ExpertBiases {
    /// Expert `e`'s biases (`inter`-wide gate/up, `hidden`-wide down).
    pub fn of(&self, e: usize, inter: usize, hidden: usize) -> ExpertBias<'_> {
        ExpertBias {
            gate: &self.gate[e * inter..(e + 1) * inter],
            up: &self.up[e * inter..(e + 1) * inter],
            down: &self.down[e * hidden..(e + 1) * hidden],
        }
    }
}

/// SwiGLU over an expert's three matrices, `[m, D]` → `[m, D]`.
pub fn expert_swiglu(expert: &crate::store::Expert, x: &[f32]) -> Vec<f32> {
    expert_ffn(expert, x, GluActivation::SWIGLU, None)
}

/// An expert's feed-forward over rows `x` (`[m, D]` → `[m, D]`): gate and up, their
/// biases if any, `act`, down and its bias.
pub fn expert_ffn(
    expert: &crate::store::Expert,
    x: &[f32],
    act: GluActivation,
    bias: Option<ExpertBias<'_>>,
) -> Vec<f32> {
    let (mut g, mut u) = tensor_matmul_pair(x, &expert.gate, &expert.up);
    let h = gated(&mut g, &mut u, bias, act);
    let mut y = tensor_matmul(&h, &expert.down);
    if let Some(b) = bias {
        add_row_bias(&mut y, b.down);
    }
    y
}

/// An expert's hidden rows from its gate and up outputs: their biases if any, then `act`.
fn gated(
    g: &mut [f32],
    u: &mut [f32],
    bias: Option<ExpertBias<'_>>,
    act: GluActivation,
) -> Vec<f32> {
    if let Some(b) = bias {
        add_row_bias(g, b.gate);
        add_row_bias(u, b.up);
    }
    g.iter()
        .zip(u.iter())
        .map(|(&g, &u)| act.apply(g, u))
        .collect()
}

/// One expert's share of a MoE layer for [`experts_ffn`]: its matrices, its input rows
/// (`[m, D]`) and its biases if any.
pub type ExpertWork<'a> = (&'a crate::store::Expert, &'a [f32], Option<ExpertBias<'a>>);

/// The feed-forwards of several CPU experts, each over its own rows: every expert's gate and
/// up in one parallel step, then every down in another (see [`matmul_groups`]), so a layer's
/// experts cost two hand-offs between threads instead of two per expert. Each output is
/// bit for bit the one [`expert_ffn`] gives for that expert alone. Experts held on a device
/// run one by one through [`expert_ffn`].
pub fn experts_ffn(work: &[ExpertWork<'_>], act: GluActivation) -> Vec<Vec<f32>> {
    let on_cpu = |e: &crate::store::Expert| {
        e.gate.device.is_none() && e.up.device.is_none() && e.down.device.is_none()
    };
    if work.len() < 2 || !work.iter().all(|(e, _, _)| on_cpu(e)) {
        return work
            .iter()
            .map(|&(e, x, b)| expert_ffn(e, x, act, b))
            .collect();
    }
    fn view(t: &Tensor) -> crate::tensor::WeightView<'_> {
        t.view().expect("weights were checked at load")
    }
    let views: Vec<_> = work
        .iter()
        .map(|(e, _, _)| (view(&e.gate), view(&e.up), view(&e.down)))
        .collect();
    let rows = |x: &[f32], w: &crate::tensor::WeightView<'_>| x.len() / w.cols * w.rows;
    let mut gs: Vec<Vec<f32>> = work
        .iter()
        .zip(&views)
        .map(|((_, x, _), (g, _, _))| vec![0.0; rows(x, g)])
        .collect();
    let mut us: Vec<Vec<f32>> = work
        .iter()
        .zip(&views)
        .map(|((_, x, _), (_, u, _))| vec![0.0; rows(x, u)])
        .collect();
    {
        let mut groups: Vec<MatmulGroup<'_, '_>> = work
            .iter()
            .zip(&views)
            .zip(gs.iter_mut().zip(us.iter_mut()))
            .map(|(((_, x, _), (g, u, _)), (go, uo))| {
                (*x, vec![(g, go.as_mut_slice()), (u, uo.as_mut_slice())])
            })
            .collect();
        matmul_groups(&mut groups);
    }
    let hs: Vec<Vec<f32>> = work
        .iter()
        .zip(gs.iter_mut().zip(us.iter_mut()))
        .map(|(&(_, _, b), (g, u))| gated(g, u, b, act))
        .collect();
    let mut ys: Vec<Vec<f32>> = hs
        .iter()
        .zip(&views)
        .map(|(h, (_, _, dw))| vec![0.0; rows(h, dw)])
        .collect();
    {
        let mut groups: Vec<MatmulGroup<'_, '_>> = hs
            .iter()
            .zip(&views)
            .zip(ys.iter_mut())
            .map(|((h, (_, _, dw)), y)| (h.as_slice(), vec![(dw, y.as_mut_slice())]))
            .collect();
        matmul_groups(&mut groups);
    }
    for ((_, _, b), y) in work.iter().zip(ys.iter_mut()) {
        if let Some(b) = b {
            add_row_bias(y, b.down);
        }
    }
    ys
}

/// Add `bias` to every row of `rows`.
pub fn add_row_bias(rows: &mut [f32], bias: &[f32]) {
    for row in rows.chunks_mut(bias.len()) {
        add_assign(row, bias);
    }
}

/// How router logits become expert choices and weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Router {
    /// Softmax over all experts in f32, top-k, optionally renormalised over the k
    /// (OLMoE, Qwen3-MoE; Mixtral always renormalises).
    SoftmaxTopK { renormalize: bool },
    /// DeepSeek-V3 style (also Kimi and GLM): `s = sigmoid(logits)`; the selection uses
    /// `s + correction_bias`, restricted to the `topk_group` best of `n_group` equal expert
    /// groups (a group scores the sum of its two best biased scores); the weights are the
    /// unbiased `s` of the chosen experts, renormalised if asked (`Σ + 1e-20`), times
    /// `scaling`.
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        renormalize: bool,
        scaling: f32,
    },
    /// DeepSeek-V4: `s = sqrt(softplus(logits))`; the selection uses `s + correction_bias`;
    /// the weights are the chosen `s`, renormalised (`Σ + 1e-20`), times `scaling`.
    SqrtSoftplus { scaling: f32 },
    /// Inkling: the gate's last `shared` logits score the shared experts. The selection is
    /// the top-k of `sigmoid(logits) + correction_bias` over the routed experts; the weights
    /// are one softmax over the log-sigmoids of the chosen experts' and the shared experts'
    /// logits (so `σ_i / Σ σ`: the shared experts act as a sink), times `route_scale`, times
    /// `global_scale`. The choices are the `k` routed experts, then the shared experts as
    /// experts `E..E + shared` of the block (whose store holds them after the routed ones).
    SharedSink {
        shared: usize,
        route_scale: f32,
        global_scale: f32,
    },
    /// gpt-oss: the top-k of the logits (the gate's bias included), weighted by a softmax
    /// over those k logits alone.
    TopKSoftmax,
}

impl Router {
    /// The `k` (expert, weight) choices of one token, by descending selection score (ties:
    /// lower id). `bias` is the correction bias of the routers that have one.
    pub fn route(&self, logits: &[f32], k: usize, bias: Option<&[f32]>) -> Vec<(usize, f32)> {
        match *self {
            Router::SoftmaxTopK { renormalize } => {
                let mut p = logits.to_vec();
                softmax_inplace(&mut p);
                let mut chosen = top_k(&p, k);
                if renormalize {
                    let sum: f32 = chosen.iter().map(|c| c.1).sum();
                    for c in &mut chosen {
                        c.1 /= sum;
                    }
                }
                chosen
            }
            Router::SigmoidGrouped {
                n_group,
                topk_group,
                renormalize,
                scaling,
            } => {
                let scores: Vec<f32> = logits.iter().map(|&x| sigmoid(x)).collect();
                let mut choice: Vec<f32> = match bias {
                    Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                    None => scores.clone(),
                };
                if n_group > 1 && topk_group < n_group {
                    let per = choice.len() / n_group;
                    let group_scores: Vec<f32> = choice
                        .chunks(per)
                        .map(|g| top_k(g, 2).iter().map(|c| c.1).sum())
                        .collect();
                    let keep = top_k(&group_scores, topk_group);
                    for (g, chunk) in choice.chunks_mut(per).enumerate() {
                        if !keep.iter().any(|c| c.0 == g) {
                            chunk.fill(f32::NEG_INFINITY);
                        }
                    }
                }
                let mut chosen: Vec<(usize, f32)> = top_k(&choice, k)
                    .into_iter()
                    .map(|(e, _)| (e, scores[e]))
                    .collect();
                if renormalize {
                    let sum: f32 = chosen.iter().map(|c| c.1).sum::<f32>() + 1e-20;
                    for c in &mut chosen {
                        c.1 /= sum;
                    }
                }
                for c in &mut chosen {
                    c.1 *= scaling;
                }
                chosen
            }
            Router::SqrtSoftplus { scaling } => {
                let scores: Vec<f32> = logits.iter().map(|&x| sqrt_softplus(x)).collect();
                let choice: Vec<f32> = match bias {
                    Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                    None => scores.clone(),
                };
                let ids: Vec<usize> = top_k(&choice, k).into_iter().map(|c| c.0).collect();
                weights_of(&scores, &ids, scaling)
            }
            Router::SharedSink {
                shared,
                route_scale,
                global_scale,
            } => {
                let routed = logits.len() - shared;
                let mut choice: Vec<f32> = logits[..routed].iter().map(|&x| sigmoid(x)).collect();
                if let Some(b) = bias {
                    choice.iter_mut().zip(b).for_each(|(c, b)| *c += b);
                }
                let ids: Vec<usize> = top_k(&choice, k)
                    .into_iter()
                    .map(|c| c.0)
                    .chain(routed..logits.len())
                    .collect();
                // As transformers: exp(logsigmoid(x) − logsumexp(logsigmoid(chosen ∪ shared))).
                let lp: Vec<f32> = ids
                    .iter()
                    .map(|&e| logits[e].min(0.0) - (-logits[e].abs()).exp().ln_1p())
                    .collect();
                let max = lp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let lse = max + lp.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
                ids.iter()
                    .zip(&lp)
                    .map(|(&e, v)| (e, (v - lse).exp() * route_scale * global_scale))
                    .collect()
            }
            Router::TopKSoftmax => {
                let chosen = top_k(logits, k);
                let mut w: Vec<f32> = chosen.iter().map(|c| c.1).collect();
                softmax_inplace(&mut w);
                chosen.iter().zip(w).map(|(c, w)| (c.0, w)).collect()
            }
        }
    }
}

/// `sqrt(softplus(x))`, softplus as torch computes it (linear above 20).
#[inline]
pub fn sqrt_softplus(x: f32) -> f32 {
    let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
    sp.sqrt()
}

/// The chosen experts with their scores, renormalised (`Σ + 1e-20`) and scaled: how
/// DeepSeek-V4 weights both its learned and its hash-routed choices.
pub fn weights_of(scores: &[f32], ids: &[usize], scaling: f32) -> Vec<(usize, f32)> {
    let sum: f32 = ids.iter().map(|&e| scores[e]).sum::<f32>() + 1e-20;
    ids.iter()
        .map(|&e| (e, scores[e] / sum * scaling))
        .collect()
}

/// The logistic function.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The `k` largest values with their indices, largest first, ties broken by lower index.
pub fn top_k(values: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx.into_iter().map(|i| (i, values[i])).collect()
}

/// The routed mixture-of-experts block: route every row, acquire the union of the chosen
/// experts from the store, run each expert once over all rows routed to it, write each result
/// into its (row, slot) buffer, then sum the slots in slot order.
pub struct MoeBlock {
    pub layer: usize,
    pub gate: Linear,
    pub router: Router,
    pub top_k: usize,
    pub num_experts: usize,
    /// Width of each expert.
    pub intermediate: usize,
    pub store: Arc<dyn ExpertStore>,
    /// Selection-only bias of the routers that have one (`e_score_correction_bias`).
    pub correction_bias: Option<Vec<f32>>,
    /// Always-on experts added to the routed sum (DeepSeek's `shared_experts`).
    pub shared: Option<Mlp>,
    /// The experts' activation (a clamped SwiGLU for DeepSeek-V4, gpt-oss's clamped GLU).
    pub activation: GluActivation,
    /// The routed experts' biases (gpt-oss).
    pub expert_biases: Option<ExpertBiases>,
    /// A `[1, D]` gate on the shared experts' output: `sigmoid(gate · x) · shared(x)`
    /// (Qwen3-Next's `shared_expert_gate`).
    pub shared_gate: Option<Linear>,
}

impl MoeBlock {
    /// Layer `layer`'s block: `router` over `gate`'s logits picks `top_k` of the
    /// `num_experts` experts (width `intermediate`) of `store`; no correction bias, shared
    /// experts or clamp (set those fields on the result where a family has them).
    pub fn routed(
        layer: usize,
        gate: Linear,
        router: Router,
        top_k: usize,
        num_experts: usize,
        intermediate: usize,
        store: Arc<dyn ExpertStore>,
    ) -> MoeBlock {
        MoeBlock {
            layer,
            gate,
            router,
            top_k,
            num_experts,
            intermediate,
            store,
            correction_bias: None,
            shared: None,
            activation: GluActivation::SWIGLU,
            expert_biases: None,
            shared_gate: None,
        }
    }

    /// The `k` (expert, weight) choices of every row of `[T, D]`.
    pub fn route(&self, x: &[f32]) -> Vec<Vec<(usize, f32)>> {
        self.gate
            .forward(x)
            .chunks(self.num_experts)
            .map(|l| {
                self.router
                    .route(l, self.top_k, self.correction_bias.as_deref())
            })
            .collect()
    }

    /// The sorted union of the experts the rows of `x` route to.
    pub fn route_union(&self, x: &[f32]) -> Vec<usize> {
        union_of(&self.route(x))
    }

    /// Apply to `[T, D]`.
    pub fn forward(&self, x: &[f32]) -> Result<Vec<f32>> {
        let routes = self.route(x);
        self.forward_routes(x, &routes)
    }

    /// Apply to `[T, D]` with the (expert, weight) choices of every row given (hash-routed
    /// layers choose from the token ids, not from `x`).
    pub fn forward_routes(&self, x: &[f32], routes: &[Vec<(usize, f32)>]) -> Result<Vec<f32>> {
        let d = self.gate.weight.shape[1];
        let t_len = x.len() / d;
        let union = union_of(routes);
        let mut lease = self.store.acquire(self.layer, &union)?;
        // slots[(t * k + s) * d ..] holds expert (t, s)'s output.
        let k = routes.first().map_or(self.top_k, |r| r.len());
        let mut slots = vec![0.0f32; t_len * k * d];
        let place = |slots: &mut [f32], rows: &[(usize, usize)], ys: &[f32]| {
            for (i, &(t, s)) in rows.iter().enumerate() {
                slots[(t * k + s) * d..(t * k + s + 1) * d]
                    .copy_from_slice(&ys[i * d..(i + 1) * d]);
            }
        };
        // Experts held on a device run there on a helper thread while this one computes the
        // rest on the CPU; each output goes to its own (row, slot), so the sum below is the
        // same whichever finishes first.
        let (to_device, device_work) = std::sync::mpsc::channel::<DeviceExpertWork>();
        let mut device_rx = Some(device_work);
        let mut device_done = Vec::new();
        std::thread::scope(|scope| -> Result<()> {
            let mut device_thread = None;
            // Every expert ready at once runs in one parallel step (all of a resident layer's;
            // a streamed layer's in the batches its reads complete in).
            while let Some(batch) = lease.next_ready() {
                let mut cpu: Vec<DeviceExpertWork> = Vec::new();
                for item in batch? {
                    let (e, expert) = item;
                    let mut rows: Vec<(usize, usize)> = Vec::new();
                    for (t, r) in routes.iter().enumerate() {
                        for (s, &(id, _)) in r.iter().enumerate() {
                            if id == e {
                                rows.push((t, s));
                            }
                        }
                    }
                    let mut xs = Vec::with_capacity(rows.len() * d);
                    for &(t, _) in &rows {
                        xs.extend_from_slice(&x[t * d..(t + 1) * d]);
                    }
                    if expert.gate.device.is_some() {
                        if let Some(rx) = device_rx.take() {
                            let (act, biases, inter) = (
                                self.activation,
                                self.expert_biases.as_ref(),
                                self.intermediate,
                            );
                            device_thread = Some(scope.spawn(move || {
                                rx.iter()
                                    .map(|(e, expert, rows, xs): DeviceExpertWork| {
                                        let bias = biases.map(|b| b.of(e, inter, d));
                                        (rows, expert_ffn(&expert, &xs, act, bias))
                                    })
                                    .collect::<Vec<_>>()
                            }));
                        }
                        // The receiver lives until every expert is sent (the thread ends after).
                        let _ = to_device.send((e, expert, rows, xs));
                        continue;
                    }
                    cpu.push((e, expert, rows, xs));
                }
                if cpu.is_empty() {
                    continue;
                }
                let t0 = std::time::Instant::now();
                let work: Vec<ExpertWork<'_>> = cpu
                    .iter()
                    .map(|(e, expert, _, xs)| {
                        let bias = self
                            .expert_biases
                            .as_ref()
                            .map(|b| b.of(*e, self.intermediate, d));
                        (&**expert, xs.as_slice(), bias)
                    })
                    .collect();
                let outs = experts_ffn(&work, self.activation);
                super::telemetry::add(super::telemetry::Part::Experts, t0);
                for ((_, _, rows, _), ys) in cpu.iter().zip(&outs) {
                    place(&mut slots, rows, ys);
                }
            }
            drop(to_device);
            if let Some(h) = device_thread {
                let t0 = std::time::Instant::now();
                device_done = h.join().map_err(|_| {
                    crate::Error::Invalid("the device expert thread panicked".into())
                })?;
                super::telemetry::add(super::telemetry::Part::Experts, t0);
            }
            Ok(())
        })?;
        for (rows, ys) in &device_done {
            place(&mut slots, rows, ys);
        }
        let mut out = vec![0.0f32; t_len * d];
        for (t, r) in routes.iter().enumerate() {
            let o = &mut out[t * d..(t + 1) * d];
            for (s, &(_, w)) in r.iter().enumerate() {
                let y = &slots[(t * k + s) * d..(t * k + s + 1) * d];
                for (oo, yy) in o.iter_mut().zip(y) {
                    *oo += yy * w;
                }
            }
        }
        if let Some(shared) = &self.shared {
            let t0 = std::time::Instant::now();
            let mut y = shared.forward(x);
            if let Some(gate) = &self.shared_gate {
                for (row, g) in y.chunks_mut(d).zip(gate.forward(x)) {
                    let s = sigmoid(g);
                    row.iter_mut().for_each(|v| *v *= s);
                }
            }
            add_assign(&mut out, &y);
            super::telemetry::add(super::telemetry::Part::DenseMlp, t0);
        }
        Ok(out)
    }
}

/// An expert's work in [`MoeBlock::forward_routes`] (for the device thread or the CPU step):
/// its id, matrices, the (row, slot) pairs it serves and their input rows.
type DeviceExpertWork = (
    usize,
    Arc<crate::store::Expert>,
    Vec<(usize, usize)>,
    Vec<f32>,
);

/// A MoE block routed by token id (DeepSeek-V4's `hash_moe` layers): `tid2eid` fixes the
/// `top_k` experts of every vocabulary entry; the router's `sqrt(softplus(·))` scores of
/// those experts, renormalised and scaled, weight them.
pub struct HashRoutedMoe {
    pub moe: MoeBlock,
    /// `top_k` expert ids per vocabulary entry, row-major.
    pub tid2eid: Vec<usize>,
}

impl HashRoutedMoe {
    /// The `k` (expert, weight) choices of every row of `x`, row `t` holding token `tokens[t]`.
    pub fn route(&self, x: &[f32], tokens: &[u32]) -> Result<Vec<Vec<(usize, f32)>>> {
        let k = self.moe.top_k;
        let scaling = match self.moe.router {
            Router::SqrtSoftplus { scaling } => scaling,
            _ => 1.0,
        };
        self.moe
            .gate
            .forward(x)
            .chunks(self.moe.num_experts)
            .zip(tokens)
            .map(|(lg, &tok)| {
                let scores: Vec<f32> = lg.iter().map(|&v| sqrt_softplus(v)).collect();
                let at = tok as usize * k;
                let ids = self.tid2eid.get(at..at + k).ok_or_else(|| {
                    crate::Error::Invalid(format!(
                        "token id {tok} is outside the hash-routing table of layer {} ({} \
                         entries)",
                        self.moe.layer,
                        self.tid2eid.len() / k.max(1)
                    ))
                })?;
                Ok(weights_of(&scores, ids, scaling))
            })
            .collect()
    }

    /// The sorted union of the experts `tokens` are routed to (what a prefetch hints: exact,
    /// since the table alone decides).
    pub fn route_union(&self, tokens: &[u32]) -> Vec<usize> {
        let k = self.moe.top_k;
        let mut union: Vec<usize> = tokens
            .iter()
            .filter_map(|&t| self.tid2eid.get(t as usize * k..(t as usize + 1) * k))
            .flatten()
            .copied()
            .collect();
        union.sort_unstable();
        union.dedup();
        union
    }

    /// Apply to `[T, D]`, row `t` holding token `tokens[t]`.
    pub fn forward(&self, x: &[f32], tokens: &[u32]) -> Result<Vec<f32>> {
        let routes = self.route(x, tokens)?;
        self.moe.forward_routes(x, &routes)
    }
}

/// Manifold-constrained hyper-connection (mHC) weights of one sub-block (DeepSeek-V4): the
/// residual is `hc` streams per token; the sub-block reads a `pre`-weighted sum of them and
/// its output re-enters as `X'_i = post_i · y + Σ_j comb[j, i] · X_j`, `comb` a
/// Sinkhorn-normalised `hc × hc` matrix. Every weight comes from the token's own streams.
pub struct HyperConnection {
    /// `[(2 + hc)·hc, hc·D]`.
    pub proj: Linear,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
    /// Streams per token.
    pub hc: usize,
    /// Sinkhorn iterations.
    pub iters: usize,
    /// `hc_eps`.
    pub eps: f32,
    /// The streams' RMS normalisation epsilon.
    pub norm_eps: f32,
}

/// What a [`HyperConnection`] computed for a step's rows: their mixing weights.
pub struct HyperMix {
    /// `hc` per row.
    post: Vec<f32>,
    /// `hc × hc` per row, row-major.
    comb: Vec<f32>,
}

impl HyperConnection {
    /// Load `{prefix}_fn`, `{prefix}_base` and `{prefix}_scale` for `hc` streams of width `d`.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        hc: usize,
        d: usize,
        iters: usize,
        eps: f32,
        norm_eps: f32,
    ) -> Result<Self> {
        let n = (2 + hc) * hc;
        Ok(HyperConnection {
            proj: Linear::from_tensor(ckpt.weight(&format!("{prefix}_fn"), &[n, hc * d])?),
            base: ckpt.vector_f32(&format!("{prefix}_base"), n)?,
            scale: ckpt.vector_f32(&format!("{prefix}_scale"), 3)?,
            hc,
            iters,
            eps,
            norm_eps,
        })
    }

    /// For streams `x` (`[T, hc, D]`): the collapsed sub-block input `[T, D]`, and the
    /// weights [`HyperConnection::mix`] needs.
    pub fn weights(&self, x: &[f32], d: usize) -> (Vec<f32>, HyperMix) {
        let hc = self.hc;
        let mut flat = x.to_vec();
        unweighted_rms(&mut flat, hc * d, self.norm_eps);
        let m = self.proj.forward(&flat);
        let n = (2 + hc) * hc;
        let t_len = x.len() / (hc * d);
        let mut collapsed = vec![0.0f32; t_len * d];
        let mut post = vec![0.0f32; t_len * hc];
        let mut comb = vec![0.0f32; t_len * hc * hc];
        for t in 0..t_len {
            let mt = &m[t * n..(t + 1) * n];
            let pre: Vec<f32> = (0..hc)
                .map(|i| sigmoid(mt[i] * self.scale[0] + self.base[i]) + self.eps)
                .collect();
            for i in 0..hc {
                post[t * hc + i] = 2.0 * sigmoid(mt[hc + i] * self.scale[1] + self.base[hc + i]);
            }
            let c = &mut comb[t * hc * hc..(t + 1) * hc * hc];
            for r in 0..hc {
                let row = &mut c[r * hc..(r + 1) * hc];
                for (j, v) in row.iter_mut().enumerate() {
                    let k = 2 * hc + r * hc + j;
                    *v = mt[k] * self.scale[2] + self.base[k];
                }
                softmax_inplace(row);
                for v in row.iter_mut() {
                    *v += self.eps;
                }
            }
            let col_norm = |c: &mut [f32]| {
                for j in 0..hc {
                    let s: f32 = (0..hc).map(|r| c[r * hc + j]).sum::<f32>() + self.eps;
                    for r in 0..hc {
                        c[r * hc + j] /= s;
                    }
                }
            };
            let row_norm = |c: &mut [f32]| {
                for r in 0..hc {
                    let s: f32 = c[r * hc..(r + 1) * hc].iter().sum::<f32>() + self.eps;
                    for v in &mut c[r * hc..(r + 1) * hc] {
                        *v /= s;
                    }
                }
            };
            col_norm(c);
            for _ in 1..self.iters {
                row_norm(c);
                col_norm(c);
            }
            let out = &mut collapsed[t * d..(t + 1) * d];
            for (i, &p) in pre.iter().enumerate() {
                let xi = &x[(t * hc + i) * d..(t * hc + i + 1) * d];
                for (o, v) in out.iter_mut().zip(xi) {
                    *o += p * v;
                }
            }
        }
        (collapsed, HyperMix { post, comb })
    }

    /// `X'_i = post_i · y + Σ_j comb[j, i] · X_j` in place, `y` the sub-block's output `[T, D]`.
    pub fn mix(&self, x: &mut [f32], y: &[f32], w: &HyperMix, d: usize) {
        let hc = self.hc;
        let (post, comb) = (&w.post, &w.comb);
        for (t, yt) in y.chunks(d).enumerate() {
            let old = x[t * hc * d..(t + 1) * hc * d].to_vec();
            for i in 0..hc {
                let out = &mut x[(t * hc + i) * d..(t * hc + i + 1) * d];
                let p = post[t * hc + i];
                for (k, o) in out.iter_mut().enumerate() {
                    let mut acc = p * yt[k];
                    for j in 0..hc {
                        acc += comb[t * hc * hc + j * hc + i] * old[j * d + k];
                    }
                    *o = acc;
                }
            }
        }
    }
}

/// The collapse of hyper-connection streams before the final norm (DeepSeek-V4's
/// `hc_head`): `y = Σ_i (sigmoid(mix_i · scale + base_i) + eps) · X_i`, the mixes a projection
/// of the token's RMS-normalised streams.
pub struct HyperHead {
    /// `[hc, hc·D]`.
    pub proj: Linear,
    pub base: Vec<f32>,
    pub scale: f32,
    pub hc: usize,
    /// `hc_eps`.
    pub eps: f32,
    /// The streams' RMS normalisation epsilon.
    pub norm_eps: f32,
}

impl HyperHead {
    /// Load `{prefix}fn`, `{prefix}base` and `{prefix}scale` for `hc` streams of width `d`.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        hc: usize,
        d: usize,
        eps: f32,
        norm_eps: f32,
    ) -> Result<Self> {
        Ok(HyperHead {
            proj: Linear::from_tensor(ckpt.weight(&format!("{prefix}fn"), &[hc, hc * d])?),
            base: ckpt.vector_f32(&format!("{prefix}base"), hc)?,
            scale: ckpt.vector_f32(&format!("{prefix}scale"), 1)?[0],
            hc,
            eps,
            norm_eps,
        })
    }

    /// Streams `x` (`[T, hc, D]`) collapsed to `[T, D]`, token by token.
    pub fn collapse(&self, x: &[f32], d: usize) -> Vec<f32> {
        let hc = self.hc;
        let mut ys = Vec::with_capacity(x.len() / hc);
        for xt in x.chunks(hc * d) {
            let mut flat = xt.to_vec();
            unweighted_rms(&mut flat, hc * d, self.norm_eps);
            let mixes = self.proj.forward(&flat);
            let mut y = vec![0.0f32; d];
            for i in 0..hc {
                let pre = sigmoid(mixes[i] * self.scale + self.base[i]) + self.eps;
                for (o, v) in y.iter_mut().zip(&xt[i * d..(i + 1) * d]) {
                    *o += pre * v;
                }
            }
            ys.extend(y);
        }
        ys
    }
}

/// The sorted union of the experts in `routes`.
pub fn union_of(routes: &[Vec<(usize, f32)>]) -> Vec<usize> {
    let mut union: Vec<usize> = routes.iter().flatten().map(|r| r.0).collect();
    union.sort_unstable();
    union.dedup();
    union
}

/// Rows `start..start + n` of `t`, a stack of `tokens` rows of one width (one sequence's part
/// of a batch's projections).
pub fn rows_of(t: &[f32], start: usize, n: usize, tokens: usize) -> Vec<f32> {
    let w = t.len() / tokens;
    t[start * w..(start + n) * w].to_vec()
}

/// `a += b` element-wise.
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// Look up embedding rows as f32.
pub fn embed(table: &Tensor, tokens: &[u32]) -> Result<Vec<f32>> {
    let view = table.view()?;
    let mut out = vec![0.0f32; tokens.len() * view.cols];
    for (i, &t) in tokens.iter().enumerate() {
        if t as usize >= view.rows {
            return Err(crate::Error::Invalid(format!(
                "token id {t} is outside the vocabulary (size {})",
                view.rows
            )));
        }
        view.row_to_f32(t as usize, &mut out[i * view.cols..(i + 1) * view.cols]);
    }
    Ok(out)
}

#[cfg(test)]
mod router_tests {
    use super::*;

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn grouped_sigmoid_routing_limits_groups_and_weights_unbiased_scores() {
        // 8 experts in 4 groups of 2; sigmoid scores chosen directly.
        let scores = [0.9, 0.1, 0.5, 0.5, 0.8, 0.7, 0.2, 0.3];
        let logits: Vec<f32> = scores.iter().map(|&p| logit(p)).collect();
        // The bias lifts expert 7 for selection only.
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.55];
        // Group sums of the biased top-2: g0 1.0, g1 1.0, g2 1.5, g3 1.05 → keep g2 and g3.
        let router = Router::SigmoidGrouped {
            n_group: 4,
            topk_group: 2,
            renormalize: true,
            scaling: 2.0,
        };
        let got = router.route(&logits, 2, Some(&bias));
        // Within g2 ∪ g3 the biased scores are 0.8, 0.7, 0.2, 0.85: experts 7 then 4, although
        // expert 0 (0.9, group 0) is the best unbiased score overall.
        let ids: Vec<usize> = got.iter().map(|c| c.0).collect();
        assert_eq!(ids, vec![7, 4]);
        // Weights: the unbiased 0.3 and 0.8, renormalised, times 2.
        let w: Vec<f32> = got.iter().map(|c| c.1).collect();
        assert!((w[0] - 2.0 * 0.3 / 1.1).abs() < 1e-6, "{w:?}");
        assert!((w[1] - 2.0 * 0.8 / 1.1).abs() < 1e-6, "{w:?}");

        // One group (Kimi K2): a plain top-k over the biased scores.
        let flat = Router::SigmoidGrouped {
            n_group: 1,
            topk_group: 1,
            renormalize: false,
            scaling: 1.0,
        };
        let got = flat.route(&logits, 2, Some(&bias));
        let ids: Vec<usize> = got.iter().map(|c| c.0).collect();
        assert_eq!(ids, vec![0, 7]);
        assert!((got[1].1 - 0.3).abs() < 1e-6);
    }

    #[test]
    fn shared_sink_routing_weights_chosen_and_shared_experts_by_one_normalisation() {
        // 4 routed experts, then 2 shared ones; sigmoid scores chosen directly.
        let scores = [0.9, 0.2, 0.6, 0.7, 0.5, 0.25];
        let logits: Vec<f32> = scores.iter().map(|&p| logit(p)).collect();
        // The bias lifts expert 1 above expert 2 (and 3) for selection only.
        let bias = [0.0, 0.6, 0.0, 0.0];
        let router = Router::SharedSink {
            shared: 2,
            route_scale: 8.0,
            global_scale: 0.5,
        };
        let got = router.route(&logits, 2, Some(&bias));
        let ids: Vec<usize> = got.iter().map(|c| c.0).collect();
        assert_eq!(ids, vec![0, 1, 4, 5]);
        // Each weight: its unbiased score over the sum of the chosen and shared ones, × 8 × 0.5.
        let sum = 0.9 + 0.2 + 0.5 + 0.25;
        for (c, p) in got.iter().zip([0.9, 0.2, 0.5, 0.25]) {
            assert!((c.1 - 4.0 * p / sum).abs() < 1e-5, "{got:?}");
        }
    }
}

#[cfg(test)]
mod attend_tests {
    use super::*;
    use crate::model::cache::KvDType;
    use crate::tensor::kernels::dot_scalar;
    use crate::tensor::test_values::xorshift;

    /// Attention one head at a time, spelled out with the scalar kernels: the canonical dot
    /// per key, the shared softmax, `o += p · v` in key order.
    fn reference(q: &[f32], kv: &LayerKv, s: AttendShape<'_>, start: usize) -> Vec<f32> {
        let (keys, values) = (kv.k.f32(), kv.v.f32());
        let (hd, kv_dim, group) = (s.head_dim, s.kv_heads * s.head_dim, s.heads / s.kv_heads);
        let mut out = vec![0.0f32; q.len()];
        for (idx, o) in out.chunks_mut(hd).enumerate() {
            let (t, h) = (idx / s.heads, idx % s.heads);
            let pos = start + t;
            let first = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let at = |j: usize| j * kv_dim + (h / group) * hd;
            let qv = &q[idx * hd..(idx + 1) * hd];
            let mut p: Vec<f32> = (first..=pos)
                .map(|j| {
                    let x = dot_scalar(qv, &keys[at(j)..at(j) + hd]) * s.scale;
                    match s.bias {
                        Some(b) if pos - j < b.extent => x + b.profiles[idx * b.extent + pos - j],
                        _ => x,
                    }
                })
                .collect();
            let sink = match s.sinks {
                Some(Sinks::PerHead(k)) => Some(k[h]),
                Some(Sinks::PerToken(k)) => Some(k[idx]),
                None => None,
            };
            crate::tensor::attention::softmax_reference(&mut p, sink);
            for (pj, j) in p.iter().zip(first..) {
                for (oo, v) in o.iter_mut().zip(&values[at(j)..at(j) + hd]) {
                    *oo += pj * v;
                }
            }
        }
        out
    }

    /// Long contexts and short ones, GQA groups of 1 to 6 heads, with windows, sinks and a
    /// relative bias: every output has the bits of the spelled-out scalar attention, and the
    /// last token of a prompt attended alone equals it attended with the prompt.
    #[test]
    fn attention_gives_the_bits_of_the_scalar_reference() {
        for (heads, kv_heads, hd, keys, window) in [
            (9, 3, 64, 1300, None),
            (8, 2, 64, 1200, Some(700)),
            (16, 2, 128, 1500, None),
            (12, 1, 96, 900, Some(600)),
            (4, 4, 64, 1100, None),
            (6, 1, 72, 1000, None),
            (4, 2, 128, 600, Some(100)),
            (9, 3, 64, 40, None),
            (14, 2, 64, 300, None),
            (10, 2, 32, 90, Some(33)),
            // A window of 0 (a config's `sliding_window: 0`) sees no key: zeros, not a panic.
            (4, 2, 64, 40, Some(0)),
        ] {
            let t_len = 3;
            let start = keys - t_len;
            let kv_dim = kv_heads * hd;
            let mut kv = LayerKv::with_dtype(KvDType::F32);
            kv.k.extend(&xorshift(keys * kv_dim, 1 + keys as u32));
            kv.v.extend(&xorshift(keys * kv_dim, 2 + keys as u32));
            let q = xorshift(t_len * heads * hd, 3 + heads as u32);
            let sinks = xorshift(heads, 4);
            let extent = 5;
            let profiles = xorshift(t_len * heads * extent, 5);
            for variant in 0..3 {
                let shape = AttendShape {
                    heads,
                    kv_heads,
                    head_dim: hd,
                    window,
                    scale: 1.0 / (hd as f32).sqrt(),
                    sinks: (variant == 1).then_some(Sinks::PerHead(&sinks)),
                    bias: (variant == 2).then_some(RelBias {
                        profiles: &profiles,
                        extent,
                    }),
                };
                let want = reference(&q, &kv, shape, start);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let got = attend(&q, &kv, shape, start, false);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{heads}/{kv_heads}×{hd}, {keys} keys, variant {variant}"
                );
                // Other thread counts cut the work otherwise (by query heads, or by keys and
                // value elements for few groups over many keys: the prompt's three tokens too
                // at 8 threads); none changes a bit, in the prompt or its last token alone.
                let row = (t_len - 1) * heads * hd;
                for threads in [1, 3, 8] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let (got, last) = pool.install(|| {
                        (
                            attend(&q, &kv, shape, start, false),
                            attend(&q[row..], &kv, shape, start + t_len - 1, false),
                        )
                    });
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{heads}/{kv_heads}×{hd}, {keys} keys, variant {variant}, {threads} threads"
                    );
                    if variant != 2 {
                        assert_eq!(
                            bits(&last),
                            bits(&want[row..]),
                            "{heads}/{kv_heads}×{hd}, {keys} keys, variant {variant}, \
                             {threads} threads: decode ≠ prefill"
                        );
                    }
                }
                // An f16 cache gives the bits of an f32 cache holding the same (f16) values.
                let mut kv16 = LayerKv::with_dtype(KvDType::F16);
                kv16.k.extend(kv.k.f32());
                kv16.v.extend(kv.v.f32());
                let mut kv32 = LayerKv::with_dtype(KvDType::F32);
                kv32.k.extend(&kv16.k.to_f32_vec());
                kv32.v.extend(&kv16.v.to_f32_vec());
                for probs_f16 in [false, true] {
                    assert_eq!(
                        bits(&attend(&q, &kv16, shape, start, probs_f16)),
                        bits(&attend(&q, &kv32, shape, start, probs_f16)),
                        "{heads}/{kv_heads}×{hd}, {keys} keys, variant {variant}: f16 cache"
                    );
                }
                if variant == 2 {
                    continue; // the bias profiles are laid out per call
                }
                // The last token alone over the same cache.
                let last = attend(&q[row..], &kv, shape, start + t_len - 1, false);
                assert_eq!(
                    bits(&last),
                    bits(&want[row..]),
                    "{heads}/{kv_heads}×{hd}: decode ≠ prefill"
                );
            }
        }
    }
}

#[cfg(test)]
mod linear_tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 1000.0
                    - 0.5
            })
            .collect()
    }

    #[test]
    fn several_projections_at_once_give_each_ones_bits_and_bias() {
        let k = 40;
        let linear = |n: usize, seed: u32, bias: bool| Linear {
            weight: Tensor::from_f32("w", &[n, k], &values(n * k, seed)),
            bias: bias.then(|| values(n, seed + 7)),
        };
        let (q, kk, v) = (linear(12, 1, true), linear(4, 2, false), linear(4, 3, true));
        for m in [1, 5] {
            let x = values(m * k, 11 + m as u32);
            let [a, b, c] = Linear::forward_many([&q, &kk, &v], &x);
            for (got, l) in [(a, &q), (b, &kk), (c, &v)] {
                let want = l.forward(&x);
                assert_eq!(got.len(), m * l.out_features());
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{m} rows");
            }
        }
        // The bias was added: without it the outputs differ.
        let x = values(k, 3);
        let bare = Linear {
            bias: None,
            ..linear(12, 1, false)
        };
        assert_ne!(Linear::forward_many([&q], &x)[0], bare.forward(&x));
    }
}
