//! Layers shared by the architectures: linear projections, RMSNorm, RoPE, grouped-query
//! attention with a KV cache and optional sliding window, the SwiGLU MLP and the routed
//! mixture-of-experts block. Each is written once here so a fix reaches every family.
//!
//! Activations are `f32`, row-major `[tokens, features]`. Every reduction has a fixed order
//! (see `tensor::kernels`), so batching and threads never change a result.

use std::sync::Arc;

use rayon::prelude::*;

use super::cache::LayerKv;
use crate::format::config::{RopeKind, RopeParams};
use crate::format::safetensors::Checkpoint;
use crate::store::ExpertStore;
use crate::tensor::kernels::{dot, Isa};
use crate::tensor::matmul::{matmul, matmul_new};
use crate::tensor::{Tensor, WeightData};
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
        let weight = ckpt.weight(&format!("{prefix}.weight"), &[out, inp])?;
        let bias = if bias {
            Some(ckpt.vector_f32(&format!("{prefix}.bias"), out)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    /// Wrap an existing weight tensor.
    pub fn from_tensor(weight: Tensor) -> Linear {
        Linear { weight, bias: None }
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.weight.shape[0]
    }

    /// Apply to `m` rows.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let view = self.weight.view().expect("weights were checked at load");
        let mut y = matmul_new(x, &view);
        if let Some(b) = &self.bias {
            for row in y.chunks_mut(b.len()) {
                for (v, bb) in row.iter_mut().zip(b) {
                    *v += bb;
                }
            }
        }
        y
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
}

impl Attention {
    /// Attend `x` (`[T, D]`, tokens at positions `start..`) and append its keys and values to
    /// `kv`. Returns `[T, D]`.
    pub fn forward(&self, x: &[f32], start: usize, kv: &mut LayerKv) -> Vec<f32> {
        let (q, k, v) = self.project(x);
        let out = self.attend_sequence(q, k, v, start, kv);
        self.o.forward(&out)
    }

    /// The q, k and v projections of rows `x` (any number of sequences: row-wise, so a batch
    /// gives each row the bits it gets alone).
    pub fn project(&self, x: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        (self.q.forward(x), self.k.forward(x), self.v.forward(x))
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
            h,
            kvh,
            hd,
            start,
            self.window,
            self.scale,
            self.kv_f16,
        )
    }
}

/// Scaled dot-product attention of queries `q` (`[T, H, hd]`, at positions `start..`) over
/// the cached keys and values, causal, optionally windowed; with `probs_f16` the attention
/// probabilities are rounded to f16 before weighting the values (llama.cpp's f16 KV path). Each (token, head) is computed
/// by one task in a fixed order.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    kv: &LayerKv,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    start: usize,
    window: Option<usize>,
    scale: f32,
    probs_f16: bool,
) -> Vec<f32> {
    let isa = Isa::detect();
    let (keys, values) = (kv.k.f32(), kv.v.f32());
    let group = heads / kv_heads;
    let kv_dim = kv_heads * head_dim;
    let mut out = vec![0.0f32; q.len()];
    let work = |(idx, o): (usize, &mut [f32])| {
        let (t, hh) = (idx / heads, idx % heads);
        let pos = start + t;
        let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let qv = &q[idx * head_dim..(idx + 1) * head_dim];
        let kvh = hh / group;
        let mut scores: Vec<f32> = (first..=pos)
            .map(|j| {
                let kj = &keys[j * kv_dim + kvh * head_dim..j * kv_dim + (kvh + 1) * head_dim];
                dot(isa, qv, WeightData::F32(kj)) * scale
            })
            .collect();
        softmax_inplace(&mut scores);
        if probs_f16 {
            // llama.cpp multiplies its f16 values by probabilities converted to f16.
            for p in scores.iter_mut() {
                *p = half::f16::from_f32(*p).to_f32();
            }
        }
        for (p, j) in scores.iter().zip(first..=pos) {
            let vj = &values[j * kv_dim + kvh * head_dim..j * kv_dim + (kvh + 1) * head_dim];
            for (oo, vv) in o.iter_mut().zip(vj) {
                *oo += p * vv;
            }
        }
    };
    if q.len() * (start + q.len() / (heads * head_dim)) < 1 << 16 {
        out.chunks_mut(head_dim).enumerate().for_each(work);
    } else {
        out.par_chunks_mut(head_dim).enumerate().for_each(work);
    }
    out
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
        let g = self.gate.forward(x);
        let u = self.up.forward(x);
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

/// SwiGLU over an expert's three matrices, `[m, D]` → `[m, D]`.
pub fn expert_swiglu(expert: &crate::store::Expert, x: &[f32]) -> Vec<f32> {
    expert_swiglu_limited(expert, x, None)
}

/// [`expert_swiglu`] with an optional clamp (see [`swiglu`]).
pub fn expert_swiglu_limited(
    expert: &crate::store::Expert,
    x: &[f32],
    limit: Option<f32>,
) -> Vec<f32> {
    let (g, u) = crate::tensor::matmul::matmul_pair(
        x,
        &expert.gate.view().expect("checked at load"),
        &expert.up.view().expect("checked at load"),
    );
    let h: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| swiglu(g, u, limit))
        .collect();
    let down = expert.down.view().expect("checked at load");
    let mut y = vec![0.0; (h.len() / down.cols) * down.rows];
    matmul(&h, &down, &mut y);
    y
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
    /// Clamp of the experts' SwiGLU (DeepSeek-V4's `swiglu_limit`).
    pub swiglu_limit: Option<f32>,
}

impl MoeBlock {
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
        while let Some(item) = lease.next_expert() {
            let (e, expert) = item?;
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
            let t0 = std::time::Instant::now();
            let ys = expert_swiglu_limited(&expert, &xs, self.swiglu_limit);
            super::telemetry::add(super::telemetry::Part::Experts, t0);
            for (i, &(t, s)) in rows.iter().enumerate() {
                slots[(t * k + s) * d..(t * k + s + 1) * d]
                    .copy_from_slice(&ys[i * d..(i + 1) * d]);
            }
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
            add_assign(&mut out, &shared.forward(x));
            super::telemetry::add(super::telemetry::Part::DenseMlp, t0);
        }
        Ok(out)
    }
}

fn union_of(routes: &[Vec<(usize, f32)>]) -> Vec<usize> {
    let mut union: Vec<usize> = routes.iter().flatten().map(|r| r.0).collect();
    union.sort_unstable();
    union.dedup();
    union
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
}
