//! DeepSeek-V4 (`model_type: deepseek_v4`, V4-Flash): a decoder whose residual is `hc_mult`
//! parallel streams mixed by manifold-constrained hyper-connections (mHC), with three kinds
//! of attention layer and DeepSeek MoE.
//!
//! Attention (every kind): low-rank queries (`wq_a` → `q_norm` → `wq_b`, then an unweighted
//! RMSNorm per head), a single key/value head (`wkv` → `norm`; the same vector is key and
//! value), interleaved RoPE on the trailing `head_dim · partial_rotary_factor` dims, learned
//! sinks, the output's rope dims rotated back at the query position, and a grouped low-rank
//! output (`wo_a` per head group, then `wo_b`). Every query sees the last `sliding_window`
//! tokens; the compressed layers add entries on the key axis:
//! * **HCA** (heavily compressed): every complete window of `rate` tokens becomes one entry,
//!   a per-channel softmax-gated sum (`wgate` + a per-slot bias `ape`) of `wkv`, normalised
//!   and rotated at the window's first position; a query sees the windows it has completed.
//! * **CSA** (compressed sparse): entries overlap two windows (the previous window's first
//!   half-width slice and this window's second), and a lightning indexer with its own
//!   compressor picks the `index_topk` entries each query attends to.
//! * **sliding**: the window only.
//!
//! The MoE routes by `sqrt(softplus(·))` with a selection bias, or, on `hash_moe` layers, by
//! a fixed token → experts table (`tid2eid`); experts and the shared expert use a clamped
//! SwiGLU (`swiglu_limit`).
//!
//! Cache per layer (see `model::cache`): `k` the rotated key/value of every token; `v` the
//! compressor's raw `[wkv | wgate]` rows of every token; `aux` per token `[entry | indexer
//! raw rows | indexer entry]`, the entries stored at the row of the token that completes
//! their window (zeros elsewhere). Keeping per-token rows makes truncation and KV files work
//! as for every other model; a later cache can keep only the live window.

use std::sync::Arc;

use rayon::prelude::*;

use super::cache::{KvCache, LayerKv};
use super::layers::{
    embed, softmax_inplace, weights_of, Linear, Mlp, MoeBlock, RmsNorm, Rope, Router,
};
use super::torch_topk::torch_topk_set;
use super::LoadOptions;
use super::{CausalLm, Logits, ModelInfo};
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertNames, ExpertStore};
use crate::tensor::kernels::{dot, Isa};
use crate::tensor::{Tensor, WeightData};
use crate::{Error, Result};

/// `x · rsqrt(mean(x²) + eps)` over rows of `width`.
fn unweighted_rms(x: &mut [f32], width: usize, eps: f32) {
    for row in x.chunks_mut(width) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for v in row.iter_mut() {
            *v *= r;
        }
    }
}

/// Interleaved RoPE on the trailing `rope.rotary_dim` dims of every `width`-wide head of
/// `x` (`[tokens, heads, width]`), token `t` at `positions[t]`; `inverse` rotates back.
fn rope_trailing(rope: &Rope, x: &mut [f32], width: usize, positions: &[usize], inverse: bool) {
    let rd = rope.rotary_dim;
    let heads = x.len() / (positions.len() * width);
    let sign = if inverse { -1.0 } else { 1.0 };
    for (t, &pos) in positions.iter().enumerate() {
        for i in 0..rd / 2 {
            let f = pos as f32 * rope.inv_freq[i];
            let (c, s) = (f.cos() * rope.scaling, sign * f.sin() * rope.scaling);
            for h in 0..heads {
                let base = (t * heads + h) * width + width - rd;
                let (a, b) = (x[base + 2 * i], x[base + 2 * i + 1]);
                x[base + 2 * i] = a * c - b * s;
                x[base + 2 * i + 1] = b * c + a * s;
            }
        }
    }
}

/// Manifold-constrained hyper-connection weights of one sub-block.
struct HyperConnection {
    /// `[(2 + hc)·hc, hc·D]`.
    proj: Linear,
    base: Vec<f32>,
    scale: Vec<f32>,
    hc: usize,
    iters: usize,
    eps: f32,
    norm_eps: f32,
}

impl HyperConnection {
    fn load(ckpt: &Checkpoint, prefix: &str, hc: usize, d: usize, c: &V4Config) -> Result<Self> {
        let n = (2 + hc) * hc;
        Ok(HyperConnection {
            proj: Linear::from_tensor(ckpt.weight(&format!("{prefix}_fn"), &[n, hc * d])?),
            base: ckpt.vector_f32(&format!("{prefix}_base"), n)?,
            scale: ckpt.vector_f32(&format!("{prefix}_scale"), 3)?,
            hc,
            iters: c.sinkhorn_iters,
            eps: c.hc_eps,
            norm_eps: c.eps as f32,
        })
    }

    /// For streams `x` (`[T, hc, D]`): the collapsed block input `[T, D]`, and per token
    /// `post` (`hc`) and `comb` (`hc × hc`, row-major).
    fn weights(&self, x: &[f32], d: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
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
                .map(|i| super::layers::sigmoid(mt[i] * self.scale[0] + self.base[i]) + self.eps)
                .collect();
            for i in 0..hc {
                post[t * hc + i] =
                    2.0 * super::layers::sigmoid(mt[hc + i] * self.scale[1] + self.base[hc + i]);
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
        (collapsed, post, comb)
    }

    /// `X'_i = post_i · y + Σ_j comb[j, i] · X_j` in place.
    fn mix(&self, x: &mut [f32], y: &[f32], post: &[f32], comb: &[f32], d: usize) {
        let hc = self.hc;
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

/// A compressor: `wkv`/`wgate` rows of every token become one entry per window.
struct Compressor {
    wkv: Linear,
    wgate: Linear,
    /// `[rate, width]` per-slot gate bias.
    ape: Vec<f32>,
    norm: RmsNorm,
    rate: usize,
    /// Entry dimension.
    dim: usize,
    /// CSA: entries overlap the previous window (rows are `[Ca | Cb]`, `width = 2·dim`).
    overlap: bool,
}

impl Compressor {
    fn load(
        ckpt: &Checkpoint,
        p: &str,
        d: usize,
        dim: usize,
        rate: usize,
        overlap: bool,
        eps: f64,
    ) -> Result<Self> {
        let width = if overlap { 2 * dim } else { dim };
        Ok(Compressor {
            wkv: Linear::load(ckpt, &format!("{p}.wkv"), width, d, false)?,
            wgate: Linear::load(ckpt, &format!("{p}.wgate"), width, d, false)?,
            ape: ckpt
                .weight(&format!("{p}.ape"), &[rate, width])?
                .to_f32_vec()?,
            norm: RmsNorm::load(ckpt, &format!("{p}.norm.weight"), dim, eps)?,
            rate,
            dim,
            overlap,
        })
    }

    /// Raw values one token keeps: `[wkv | wgate]`.
    fn raw_width(&self) -> usize {
        2 * if self.overlap { 2 * self.dim } else { self.dim }
    }

    /// Raw rows of `x` (`[T, D]`).
    fn raw(&self, x: &[f32]) -> Vec<f32> {
        let (c, z) = (self.wkv.forward(x), self.wgate.forward(x));
        let w = self.raw_width() / 2;
        let mut out = Vec::with_capacity(c.len() * 2);
        for (cr, zr) in c.chunks(w).zip(z.chunks(w)) {
            out.extend_from_slice(cr);
            out.extend_from_slice(zr);
        }
        out
    }

    /// Entry `w` from the raw rows of every token (`raw`, `[len, raw_width]`), normalised
    /// and rotated at position `w · rate`.
    fn entry(&self, raw: &[f32], w: usize, rope: &Rope) -> Vec<f32> {
        let (rate, dim) = (self.rate, self.dim);
        let rw = self.raw_width();
        let half = rw / 2;
        // Slots: (kv, gate) per channel.
        let mut slots: Vec<(Vec<f32>, Vec<f32>)> = Vec::with_capacity(2 * rate);
        let slot = |tok: usize, j: usize, off: usize| -> (Vec<f32>, Vec<f32>) {
            let row = &raw[tok * rw..(tok + 1) * rw];
            let kv = row[off..off + dim].to_vec();
            let gate: Vec<f32> = (0..dim)
                .map(|c| row[half + off + c] + self.ape[j * half + off + c])
                .collect();
            (kv, gate)
        };
        if self.overlap {
            for j in 0..rate {
                if w == 0 {
                    slots.push((vec![0.0; dim], vec![f32::NEG_INFINITY; dim]));
                } else {
                    slots.push(slot((w - 1) * rate + j, j, 0));
                }
            }
            for j in 0..rate {
                slots.push(slot(w * rate + j, j, dim));
            }
        } else {
            for j in 0..rate {
                slots.push(slot(w * rate + j, j, 0));
            }
        }
        let mut out = vec![0.0f32; dim];
        let mut g = vec![0.0f32; slots.len()];
        for (c, o) in out.iter_mut().enumerate() {
            for (k, s) in slots.iter().enumerate() {
                g[k] = s.1[c];
            }
            softmax_inplace(&mut g);
            for (k, s) in slots.iter().enumerate() {
                *o += s.0[c] * g[k];
            }
        }
        self.norm.forward_inplace(&mut out);
        rope_trailing(rope, &mut out, dim, &[w * rate], false);
        out
    }
}

/// The CSA layers' lightning indexer.
struct V4Indexer {
    compressor: Compressor,
    wq_b: Linear,
    weights_proj: Linear,
    heads: usize,
    dim: usize,
    top_k: usize,
}

enum Compression {
    Sliding,
    Hca(Compressor),
    Csa(Compressor, Box<V4Indexer>),
}

struct V4Attention {
    wq_a: Linear,
    q_norm: RmsNorm,
    wq_b: Linear,
    wkv: Linear,
    kv_norm: RmsNorm,
    wo_a: Linear,
    wo_b: Linear,
    sinks: Vec<f32>,
    heads: usize,
    head_dim: usize,
    groups: usize,
    o_rank: usize,
    window: usize,
    /// "main" rope for sliding layers, "compress" for CSA/HCA.
    rope: Rope,
    /// The "compress" rope (compressors and indexer).
    compress_rope: Rope,
    compression: Compression,
    eps: f32,
}

/// Per-token aux layout of a layer: `[entry | indexer raw rows | indexer entry]`, their
/// widths and the total.
struct AuxLayout {
    entry: usize,
    idx_raw: usize,
    width: usize,
}

impl V4Attention {
    fn aux_layout(&self) -> AuxLayout {
        match &self.compression {
            Compression::Sliding => AuxLayout {
                entry: 0,
                idx_raw: 0,
                width: 0,
            },
            Compression::Hca(c) => AuxLayout {
                entry: c.dim,
                idx_raw: 0,
                width: c.dim,
            },
            Compression::Csa(c, ix) => {
                let r = ix.compressor.raw_width();
                AuxLayout {
                    entry: c.dim,
                    idx_raw: r,
                    width: c.dim + r + ix.dim,
                }
            }
        }
    }

    /// Attention of one sequence's rows `x` (`[T, D]`, normed) at positions `start..`,
    /// appending to `kv`. Returns `[T, D]`.
    fn forward(&self, x: &[f32], start: usize, kv: &mut LayerKv) -> Vec<f32> {
        let (h, hd) = (self.heads, self.head_dim);
        let t_len = x.len() / self.wkv.weight.shape[1];
        let positions: Vec<usize> = (start..start + t_len).collect();
        let q_res = self.q_norm.forward(&self.wq_a.forward(x));
        let mut q = self.wq_b.forward(&q_res);
        unweighted_rms(&mut q, hd, self.eps);
        rope_trailing(&self.rope, &mut q, hd, &positions, false);
        let mut k = self.wkv.forward(x);
        self.kv_norm.forward_inplace(&mut k);
        rope_trailing(&self.rope, &mut k, hd, &positions, false);
        kv.k.extend(&k);

        // Compressed entries completed by these tokens, and (CSA) the indexer's picks.
        let layout = self.aux_layout();
        let mut picks: Option<Vec<Vec<usize>>> = None;
        match &self.compression {
            Compression::Sliding => {}
            Compression::Hca(c) | Compression::Csa(c, _) => {
                kv.v.extend(&c.raw(x));
                let idx_raw = match &self.compression {
                    Compression::Csa(_, ix) => Some(ix.compressor.raw(x)),
                    _ => None,
                };
                for (t, &pos) in positions.iter().enumerate() {
                    let mut row = vec![0.0f32; layout.width];
                    if let Some(r) = &idx_raw {
                        let w = layout.idx_raw;
                        row[layout.entry..layout.entry + w].copy_from_slice(&r[t * w..(t + 1) * w]);
                    }
                    kv.aux.extend(&row);
                    if (pos + 1) % c.rate == 0 {
                        let w = pos / c.rate;
                        let e = c.entry(kv.v.f32(), w, &self.compress_rope);
                        let at = pos * layout.width;
                        kv.aux.f32_mut()[at..at + c.dim].copy_from_slice(&e);
                        if let Compression::Csa(_, ix) = &self.compression {
                            let raws: Vec<f32> = kv
                                .aux
                                .f32()
                                .chunks(layout.width)
                                .flat_map(|r| {
                                    r[layout.entry..layout.entry + layout.idx_raw].to_vec()
                                })
                                .collect();
                            let ie = ix.compressor.entry(&raws, w, &self.compress_rope);
                            let off = at + layout.entry + layout.idx_raw;
                            kv.aux.f32_mut()[off..off + ix.dim].copy_from_slice(&ie);
                        }
                    }
                }
                if let Compression::Csa(c, ix) = &self.compression {
                    picks = Some(self.select(ix, c.rate, x, &q_res, &positions, kv, &layout));
                }
            }
        }

        // Attention with sinks over the window and the visible entries.
        let isa = Isa::detect();
        let scale = (hd as f32).powf(-0.5);
        let rate = match &self.compression {
            Compression::Hca(c) | Compression::Csa(c, _) => c.rate,
            Compression::Sliding => 0,
        };
        let mut out = vec![0.0f32; t_len * h * hd];
        out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
            let (t, head) = (idx / h, idx % h);
            let pos = start + t;
            let qv = &q[idx * hd..(idx + 1) * hd];
            let first = (pos + 1).saturating_sub(self.window);
            let mut keys: Vec<&[f32]> = (first..=pos)
                .map(|j| &kv.k.f32()[j * hd..(j + 1) * hd])
                .collect();
            if let Some(visible) = (pos + 1).checked_div(rate) {
                let entries: Vec<usize> = match &picks {
                    Some(p) => p[t].clone(),
                    None => (0..visible).collect(),
                };
                for w in entries {
                    let at = ((w + 1) * rate - 1) * layout.width;
                    keys.push(&kv.aux.f32()[at..at + hd]);
                }
            }
            let mut scores: Vec<f32> = keys
                .iter()
                .map(|kj| dot(isa, qv, WeightData::F32(kj)) * scale)
                .collect();
            let sink = self.sinks[head];
            let max = scores.iter().copied().fold(sink, f32::max);
            let mut sum = (sink - max).exp();
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            for (s, kj) in scores.iter().zip(&keys) {
                let p = s / sum;
                for (a, v) in o.iter_mut().zip(kj.iter()) {
                    *a += p * v;
                }
            }
        });
        rope_trailing(&self.rope, &mut out, hd, &positions, true);

        // Grouped low-rank output.
        let g = self.groups;
        let gw = h * hd / g;
        let wo_a = self.wo_a.weight.view().expect("checked at load");
        let mut mid = vec![0.0f32; t_len * g * self.o_rank];
        for gi in 0..g {
            let xs: Vec<f32> = (0..t_len)
                .flat_map(|t| out[t * h * hd + gi * gw..t * h * hd + (gi + 1) * gw].to_vec())
                .collect();
            let part = crate::tensor::matmul::matmul_new(
                &xs,
                &wo_a.rows_range(gi * self.o_rank, self.o_rank),
            );
            for t in 0..t_len {
                mid[(t * g + gi) * self.o_rank..(t * g + gi + 1) * self.o_rank]
                    .copy_from_slice(&part[t * self.o_rank..(t + 1) * self.o_rank]);
            }
        }
        self.wo_b.forward(&mid)
    }

    /// The indexer's picks: for each query, the best `top_k` entries it may see, ascending.
    /// Ties are broken as transformers' `torch.topk` breaks them over the row it scores in
    /// the same forward call: every entry complete by the call's last token, the ones the
    /// query may not see yet masked ([`torch_topk_set`](super::torch_topk::torch_topk_set)).
    #[allow(clippy::too_many_arguments)]
    fn select(
        &self,
        ix: &V4Indexer,
        rate: usize,
        x: &[f32],
        q_res: &[f32],
        positions: &[usize],
        kv: &LayerKv,
        layout: &AuxLayout,
    ) -> Vec<Vec<usize>> {
        let (nh, dim) = (ix.heads, ix.dim);
        let mut q = ix.wq_b.forward(q_res);
        rope_trailing(&self.compress_rope, &mut q, dim, positions, false);
        let w = ix.weights_proj.forward(x);
        let isa = Isa::detect();
        let (score_scale, head_scale) = ((dim as f32).powf(-0.5), (nh as f32).powf(-0.5));
        // The entries transformers scores for every query of this call.
        let entries = positions.last().map_or(0, |&p| (p + 1) / rate);
        positions
            .par_iter()
            .enumerate()
            .map(|(t, &pos)| {
                let visible = (pos + 1) / rate;
                if visible <= ix.top_k {
                    return (0..visible).collect();
                }
                let mut scores: Vec<f32> = (0..visible)
                    .map(|e| {
                        let at =
                            ((e + 1) * rate - 1) * layout.width + layout.entry + layout.idx_raw;
                        let key = &kv.aux.f32()[at..at + dim];
                        let mut total = 0.0f32;
                        for hh in 0..nh {
                            let d = dot(
                                isa,
                                &q[(t * nh + hh) * dim..(t * nh + hh + 1) * dim],
                                WeightData::F32(key),
                            );
                            total += d.max(0.0) * score_scale * (w[t * nh + hh] * head_scale);
                        }
                        total
                    })
                    .collect();
                scores.resize(entries, f32::NEG_INFINITY);
                let mut p: Vec<usize> = torch_topk_set(&scores, ix.top_k)
                    .into_iter()
                    .filter(|&e| e < visible)
                    .collect();
                p.sort_unstable();
                p
            })
            .collect()
    }
}

struct V4Layer {
    attn_norm: RmsNorm,
    attn: V4Attention,
    ffn_norm: RmsNorm,
    moe: MoeBlock,
    /// Hash-routed layers: `top_k` expert ids per vocabulary entry.
    tid2eid: Option<Vec<usize>>,
    hc_attn: HyperConnection,
    hc_ffn: HyperConnection,
}

/// Settings shared by the layers.
struct V4Config {
    eps: f64,
    hc_eps: f32,
    sinkhorn_iters: usize,
}

/// A DeepSeek-V4 model.
pub struct DeepseekV4 {
    embed: Tensor,
    layers: Vec<V4Layer>,
    hc_head: (Linear, Vec<f32>, f32),
    norm: RmsNorm,
    head: Linear,
    hc: usize,
    hc_eps: f32,
    eps: f32,
    info: ModelInfo,
    store: Arc<dyn ExpertStore>,
}

/// DeepSeek-V4 in the registry: its own stack; llama.cpp has no layout for it. `normalize` is
/// left out because the loader applies [`normalize_config`] itself, once the layer count is
/// checked against the checkpoint (normalizing builds per-layer lists).
pub const FAMILY: super::registry::Family =
    super::registry::Family::new(&["deepseek_v4"], super::registry::boxed_load!(load))
        .with_names(super::registry::StackNames {
            model: "model",
            lm_head: "head",
        })
        .with_experts(super::registry::Experts {
            count: "n_routed_experts",
            block: "ffn",
            matrices: ["w1", "w3", "w2"],
        });

/// The config in transformers' modern form: hub checkpoints ship the legacy keys
/// (`compress_ratios` per layer, `compress_rate_csa` / `compress_rate_hca`, `num_hash_layers`,
/// `qk_rope_head_dim`, `rope_theta` + `compress_rope_theta` + a flat yarn `rope_scaling`),
/// which transformers folds into `layer_types`, `compress_rates`, `mlp_layer_types`,
/// `partial_rotary_factor` and nested `rope_parameters.{main,compress}`; so do we, with its
/// defaults.
pub fn normalize_config(cfg: &ModelConfig) -> Result<ModelConfig> {
    use serde_json::{json, Value};
    let mut v = cfg.json().clone();
    let n = cfg.usize("num_hidden_layers")?;
    let head_dim = cfg.usize("head_dim")?;
    let get = |k: &str| cfg.get(k).filter(|x| !x.is_null()).cloned();
    // compress_rates: default, then the legacy scalar overrides.
    let mut rates = get("compress_rates").unwrap_or_else(
        || json!({"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}),
    );
    if let Some(r) = get("compress_rate_csa") {
        rates["compressed_sparse_attention"] = r;
    }
    if let Some(r) = get("compress_rate_hca") {
        rates["heavily_compressed_attention"] = r;
    }
    v["compress_rates"] = rates;
    if get("layer_types").is_none() {
        let types: Vec<String> = match get("compress_ratios") {
            Some(Value::Array(list)) => list
                .iter()
                .take(n)
                .map(|r| match r.as_u64() {
                    Some(0) => Ok("sliding_attention".to_string()),
                    Some(4) => Ok("compressed_sparse_attention".to_string()),
                    Some(128) => Ok("heavily_compressed_attention".to_string()),
                    _ => Err(Error::config(
                        cfg.path(),
                        "compress_ratios",
                        format!("entry {r} is not one of 0, 4, 128"),
                    )),
                })
                .collect::<Result<_>>()?,
            Some(other) => {
                return Err(Error::config(
                    cfg.path(),
                    "compress_ratios",
                    format!("expected a list, found {other}"),
                ))
            }
            None => (0..n)
                .map(|i| match i {
                    0 | 1 => "heavily_compressed_attention",
                    _ if (i - 2) % 2 == 1 => "compressed_sparse_attention",
                    _ => "heavily_compressed_attention",
                })
                .map(String::from)
                .collect(),
        };
        v["layer_types"] = json!(types);
    }
    if get("mlp_layer_types").is_none() {
        let hash = match get("num_hash_layers") {
            Some(h) => h
                .as_u64()
                .ok_or_else(|| Error::config(cfg.path(), "num_hash_layers", "expected a number"))?
                as usize,
            None => 3,
        };
        let types: Vec<&str> = (0..n)
            .map(|i| if i < hash { "hash_moe" } else { "moe" })
            .collect();
        v["mlp_layer_types"] = json!(types);
    }
    let partial = match cfg.opt_f64("partial_rotary_factor")? {
        Some(p) => p,
        None => match cfg.opt_usize("qk_rope_head_dim")? {
            Some(r) => r as f64 / head_dim as f64,
            None => 64.0 / 512.0,
        },
    };
    v["partial_rotary_factor"] = json!(partial);
    let rp = get("rope_parameters")
        .or_else(|| get("rope_scaling"))
        .unwrap_or(json!({}));
    let nested = rp.get("main").is_some_and(Value::is_object)
        && rp.get("compress").is_some_and(Value::is_object);
    if !nested {
        let mut yarn = rp.as_object().cloned().unwrap_or_default();
        yarn.remove("main");
        yarn.remove("compress");
        if let Some(t) = yarn.remove("type") {
            yarn.entry("rope_type").or_insert(t);
        }
        let theta = cfg.f64_or("rope_theta", 10000.0)?;
        let compress_theta = cfg.f64_or("compress_rope_theta", 160000.0)?;
        let main = json!({"rope_type": "default", "rope_theta": theta,
            "partial_rotary_factor": partial});
        let mut compress = Value::Object(yarn);
        compress["rope_theta"] = json!(compress_theta);
        compress["partial_rotary_factor"] = json!(partial);
        if compress.get("rope_type").is_none() {
            compress["rope_type"] = json!("default");
        }
        if compress["rope_type"] == "yarn" && compress.get("attention_factor").is_none() {
            // The V4 reference does not scale cos/sin by yarn's mscale.
            compress["attention_factor"] = json!(1.0);
        }
        v["rope_parameters"] = json!({"main": main, "compress": compress});
    }
    Ok(ModelConfig::from_value(cfg.path().to_path_buf(), v))
}

/// RoPE settings of one of V4's rope types (`rope_parameters.{main,compress}`).
fn rope_of(cfg: &ModelConfig, kind: &str, head_dim: usize) -> Result<Rope> {
    let sub = cfg
        .get("rope_parameters")
        .and_then(|p| p.get(kind))
        .cloned()
        .ok_or_else(|| {
            Error::config(
                cfg.path(),
                format!("rope_parameters.{kind}"),
                "missing (DeepSeek-V4 configs give a `main` and a `compress` rope)",
            )
        })?;
    let view = ModelConfig::from_value(
        cfg.path().to_path_buf(),
        serde_json::json!({
            "rope_parameters": sub,
            "max_position_embeddings": cfg.usize_or("max_position_embeddings", 4096)?,
        }),
    );
    // Errors name the field where the file has it: `rope_parameters.{kind}.…`.
    let mut params = view.rope(10000.0).map_err(|e| match e {
        Error::Config {
            path,
            field,
            message,
        } => Error::Config {
            path,
            field: field.replacen("rope_parameters.", &format!("rope_parameters.{kind}."), 1),
            message,
        },
        other => other,
    })?;
    params.interleaved = true;
    Ok(Rope::new(&params, head_dim))
}

/// Build a DeepSeek-V4 model.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<DeepseekV4> {
    // The layer count first: normalising builds per-layer lists.
    let layers_n = super::layer_count(cfg, ckpt)?;
    let normalized = normalize_config(cfg)?;
    let cfg = &normalized;
    let d = cfg.dim("hidden_size")?;
    let heads = cfg.dim("num_attention_heads")?;
    let hd = cfg.dim("head_dim")?;
    let vocab = cfg.dim("vocab_size")?;
    let q_lora = cfg.dim("q_lora_rank")?;
    let eps = cfg.f64_or("rms_norm_eps", 1e-6)?;
    let hc = cfg.dim_or("hc_mult", 4)?;
    let c = V4Config {
        eps,
        hc_eps: cfg.f64_or("hc_eps", 1e-6)? as f32,
        sinkhorn_iters: cfg.usize_in_or(
            "hc_sinkhorn_iters",
            0..=1000,
            "DeepSeek-V4 normalises with 20 iterations",
            20,
        )?,
    };
    let experts = super::expert_count(cfg, ckpt, "n_routed_experts")?;
    let top_k = super::experts_per_token(cfg, experts)?;
    let inter = cfg.dim("moe_intermediate_size")?;
    let limit = cfg.opt_f64("swiglu_limit")?.map(|l| l as f32);
    let scaling = cfg.f64_or("routed_scaling_factor", 1.0)? as f32;
    if let Some(f) = cfg.get("scoring_func").and_then(|v| v.as_str()) {
        if f != "sqrtsoftplus" {
            return Err(Error::config(
                cfg.path(),
                "scoring_func",
                format!("`{f}` is not supported here (expected sqrtsoftplus)"),
            ));
        }
    }
    let list = |key: &str| -> Result<Vec<String>> {
        let v = cfg
            .get(key)
            .and_then(|v| v.as_array())
            .ok_or_else(|| Error::config(cfg.path(), key, "missing (one entry per layer)"))?;
        if v.len() != layers_n {
            return Err(Error::config(
                cfg.path(),
                key,
                format!("has {} entries for {layers_n} layers", v.len()),
            ));
        }
        Ok(v.iter()
            .map(|s| s.as_str().unwrap_or("").to_string())
            .collect())
    };
    let layer_types = list("layer_types")?;
    let mlp_types = list("mlp_layer_types")?;
    let rates = cfg.get("compress_rates").cloned().unwrap_or_default();
    let rate_of = |k: &str| -> Result<usize> {
        rates
            .get(k)
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .ok_or_else(|| Error::config(cfg.path(), format!("compress_rates.{k}"), "missing"))
    };
    let main_rope = rope_of(cfg, "main", hd)?;
    let compress_rope = rope_of(cfg, "compress", hd)?;
    // Hub names have no `model.` prefix, `embed`/`norm`/`hc_head_*`; transformers' save keeps
    // `model.embed_tokens`, `model.norm`, `model.hc_head.hc_*` (arch doc 0.6).
    let (m, embed_name, norm_name, hc_head) = if ckpt.contains("model.embed_tokens.weight") {
        (
            "model.",
            "model.embed_tokens.weight",
            "model.norm.weight",
            "model.hc_head.hc_",
        )
    } else {
        ("", "embed.weight", "norm.weight", "hc_head_")
    };
    let all = vec![true; layers_n];
    let names = store::expert_table(ckpt, cfg, "n_routed_experts", &all, experts, |l, e| {
        let p = format!("{m}layers.{l}.ffn.experts.{e}");
        ExpertNames {
            gate: format!("{p}.w1.weight"),
            up: format!("{p}.w3.weight"),
            down: format!("{p}.w2.weight"),
        }
    })?;
    let store: Arc<dyn ExpertStore> = store::open(ckpt, &names, d, inter, 0, &opts.placement)?;
    let embed = ckpt.weight(embed_name, &[vocab, d])?;
    let mut layers = Vec::with_capacity(layers_n);
    for l in 0..layers_n {
        let p = format!("{m}layers.{l}");
        let a = format!("{p}.attn");
        let groups = cfg.dim("o_groups")?;
        let o_rank = cfg.dim("o_lora_rank")?;
        let compression = match layer_types[l].as_str() {
            "sliding_attention" => Compression::Sliding,
            "heavily_compressed_attention" => Compression::Hca(Compressor::load(
                ckpt,
                &format!("{a}.compressor"),
                d,
                hd,
                rate_of("heavily_compressed_attention")?,
                false,
                eps,
            )?),
            "compressed_sparse_attention" => {
                let rate = rate_of("compressed_sparse_attention")?;
                let (nh, dim) = (cfg.dim("index_n_heads")?, cfg.dim("index_head_dim")?);
                Compression::Csa(
                    Compressor::load(ckpt, &format!("{a}.compressor"), d, hd, rate, true, eps)?,
                    Box::new(V4Indexer {
                        compressor: Compressor::load(
                            ckpt,
                            &format!("{a}.indexer.compressor"),
                            d,
                            dim,
                            rate,
                            true,
                            eps,
                        )?,
                        wq_b: Linear::load(
                            ckpt,
                            &format!("{a}.indexer.wq_b"),
                            nh * dim,
                            q_lora,
                            false,
                        )?,
                        weights_proj: Linear::load(
                            ckpt,
                            &format!("{a}.indexer.weights_proj"),
                            nh,
                            d,
                            false,
                        )?,
                        heads: nh,
                        dim,
                        top_k: cfg.usize("index_topk")?,
                    }),
                )
            }
            other => {
                return Err(Error::config(
                    cfg.path(),
                    "layer_types",
                    format!("unknown layer type `{other}`"),
                ))
            }
        };
        let rope = if matches!(compression, Compression::Sliding) {
            main_rope.clone()
        } else {
            compress_rope.clone()
        };
        let attn = V4Attention {
            wq_a: Linear::load(ckpt, &format!("{a}.wq_a"), q_lora, d, false)?,
            q_norm: RmsNorm::load(ckpt, &format!("{a}.q_norm.weight"), q_lora, eps)?,
            wq_b: Linear::load(ckpt, &format!("{a}.wq_b"), heads * hd, q_lora, false)?,
            wkv: Linear::load(ckpt, &format!("{a}.wkv"), hd, d, false)?,
            kv_norm: RmsNorm::load(ckpt, &format!("{a}.norm.weight"), hd, eps)?,
            wo_a: Linear::load(
                ckpt,
                &format!("{a}.wo_a"),
                groups * o_rank,
                heads * hd / groups,
                false,
            )?,
            wo_b: Linear::load(ckpt, &format!("{a}.wo_b"), d, groups * o_rank, false)?,
            sinks: ckpt.vector_f32(&format!("{a}.attn_sink"), heads)?,
            heads,
            head_dim: hd,
            groups,
            o_rank,
            window: cfg.usize("sliding_window")?,
            rope,
            compress_rope: compress_rope.clone(),
            compression,
            eps: eps as f32,
        };
        let hash = match mlp_types[l].as_str() {
            "hash_moe" => true,
            "moe" => false,
            other => {
                return Err(Error::config(
                    cfg.path(),
                    "mlp_layer_types",
                    format!("unknown entry `{other}`"),
                ))
            }
        };
        let tid2eid = if hash {
            let t = ckpt.tensor_any_shape(&format!("{p}.ffn.gate.tid2eid"))?;
            let ids = t.to_i64_vec()?;
            if ids.len() != vocab * top_k || ids.iter().any(|&e| e < 0 || e as usize >= experts) {
                return Err(Error::Invalid(format!(
                    "{p}.ffn.gate.tid2eid: expected {vocab}×{top_k} expert ids below {experts}"
                )));
            }
            Some(ids.into_iter().map(|e| e as usize).collect())
        } else {
            None
        };
        let sp = format!("{p}.ffn.shared_experts");
        let shared = Mlp {
            gate: Linear::load(ckpt, &format!("{sp}.w1"), inter, d, false)?,
            up: Linear::load(ckpt, &format!("{sp}.w3"), inter, d, false)?,
            down: Linear::load(ckpt, &format!("{sp}.w2"), d, inter, false)?,
            limit,
        };
        let moe = MoeBlock {
            layer: l,
            gate: Linear::load(ckpt, &format!("{p}.ffn.gate"), experts, d, false)?,
            router: Router::SqrtSoftplus { scaling },
            top_k,
            num_experts: experts,
            intermediate: inter,
            store: store.clone(),
            correction_bias: if hash {
                None
            } else {
                Some(ckpt.vector_f32(&format!("{p}.ffn.gate.bias"), experts)?)
            },
            shared: Some(shared),
            swiglu_limit: limit,
        };
        layers.push(V4Layer {
            attn_norm: RmsNorm::load(ckpt, &format!("{p}.attn_norm.weight"), d, eps)?,
            attn,
            ffn_norm: RmsNorm::load(ckpt, &format!("{p}.ffn_norm.weight"), d, eps)?,
            moe,
            tid2eid,
            hc_attn: HyperConnection::load(ckpt, &format!("{p}.hc_attn"), hc, d, &c)?,
            hc_ffn: HyperConnection::load(ckpt, &format!("{p}.hc_ffn"), hc, d, &c)?,
        });
    }
    let head = Linear::load(ckpt, "head", vocab, d, false)?;
    let hc_head = (
        Linear::from_tensor(ckpt.weight(&format!("{hc_head}fn"), &[hc, hc * d])?),
        ckpt.vector_f32(&format!("{hc_head}base"), hc)?,
        ckpt.vector_f32(&format!("{hc_head}scale"), 1)?[0],
    );
    let total_params: usize = ckpt
        .tensors()
        .values()
        .map(|t| t.shape.iter().product::<usize>())
        .sum();
    let expert_params = layers_n * experts * 3 * d * inter;
    let kv_per_token: usize = layers
        .iter()
        .map(|l| {
            let raw = match &l.attn.compression {
                Compression::Sliding => 0,
                Compression::Hca(c) | Compression::Csa(c, _) => c.raw_width(),
            };
            4 * (hd + raw + l.attn.aux_layout().width)
        })
        .sum();
    let dtypes = super::transformer::checkpoint_dtypes(ckpt);
    let info = ModelInfo {
        model_type: cfg.model_type()?,
        architecture: "DeepseekV4ForCausalLM".into(),
        vocab_size: vocab,
        hidden_size: d,
        layers: layers_n,
        moe_layers: layers_n,
        routed_experts: experts,
        shared_experts: 1,
        active_experts: top_k,
        total_params,
        active_params: total_params - expert_params + layers_n * top_k * 3 * d * inter,
        dense_bytes: ckpt.total_bytes() - store.total_bytes(),
        routed_expert_bytes: store.total_bytes(),
        dtypes,
        max_position_embeddings: cfg.usize_or("max_position_embeddings", 4096)?,
        kv_bytes_per_token: kv_per_token,
        unused_bytes: 0,
        skipped: Vec::new(),
        kv_bytes_per_token_full: layers_n * 2 * heads * hd * 4,
    };
    Ok(DeepseekV4 {
        embed,
        layers,
        hc_head,
        norm: RmsNorm::load(ckpt, norm_name, d, eps)?,
        head,
        hc,
        hc_eps: c.hc_eps,
        eps: eps as f32,
        info,
        store,
    })
}

impl CausalLm for DeepseekV4 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_cache(&self, max_len: usize) -> KvCache {
        KvCache::new(self.layers.len(), max_len)
    }

    fn forward(&self, tokens: &[u32], cache: &mut KvCache, logits: Logits) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::Invalid("forward needs at least one token".into()));
        }
        if cache.len + tokens.len() > cache.max_len {
            return Err(Error::Invalid(format!(
                "context overflow: {} cached + {} new tokens exceed the context of {} tokens",
                cache.len,
                tokens.len(),
                cache.max_len
            )));
        }
        rayon::scope(|_| self.forward_on_pool(tokens, cache, logits))
    }

    fn store_stats(&self) -> Option<crate::store::StoreSnapshot> {
        self.store.stats()
    }

    fn flush(&self) -> Result<()> {
        self.store.flush()
    }

    fn flush_soon(&self) {
        self.store.flush_soon();
    }
}

impl DeepseekV4 {
    fn forward_on_pool(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let (d, hc) = (self.info.hidden_size, self.hc);
        let start = cache.len;
        let e = embed(&self.embed, tokens)?;
        let t_len = tokens.len();
        let mut x = Vec::with_capacity(t_len * hc * d);
        for row in e.chunks(d) {
            for _ in 0..hc {
                x.extend_from_slice(row);
            }
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let t0 = std::time::Instant::now();
            let (u, post, comb) = layer.hc_attn.weights(&x, d);
            let a = layer
                .attn
                .forward(&layer.attn_norm.forward(&u), start, &mut cache.layers[l]);
            layer.hc_attn.mix(&mut x, &a, &post, &comb, d);
            super::telemetry::add(super::telemetry::Part::Attention, t0);
            let (u, post, comb) = layer.hc_ffn.weights(&x, d);
            let f_in = layer.ffn_norm.forward(&u);
            let routes: Vec<Vec<(usize, f32)>> = match &layer.tid2eid {
                None => layer.moe.route(&f_in),
                Some(table) => {
                    let k = layer.moe.top_k;
                    layer
                        .moe
                        .gate
                        .forward(&f_in)
                        .chunks(layer.moe.num_experts)
                        .zip(tokens)
                        .map(|(lg, &tok)| {
                            let scores: Vec<f32> = lg
                                .iter()
                                .map(|&v| super::layers::sqrt_softplus(v))
                                .collect();
                            let ids = &table[tok as usize * k..(tok as usize + 1) * k];
                            let scaling = match layer.moe.router {
                                Router::SqrtSoftplus { scaling } => scaling,
                                _ => 1.0,
                            };
                            weights_of(&scores, ids, scaling)
                        })
                        .collect()
                }
            };
            let f = layer.moe.forward_routes(&f_in, &routes)?;
            layer.hc_ffn.mix(&mut x, &f, &post, &comb, d);
        }
        cache.len += t_len;
        self.store.step_done(t_len);
        let rows: Vec<usize> = match logits {
            Logits::All => (0..t_len).collect(),
            Logits::Last => vec![t_len - 1],
            Logits::None => return Ok(Vec::new()),
        };
        // Final collapse of the streams, norm, head.
        let (proj, base, scale) = &self.hc_head;
        let mut ys = Vec::with_capacity(rows.len() * d);
        for &t in &rows {
            let xt = &x[t * hc * d..(t + 1) * hc * d];
            let mut flat = xt.to_vec();
            unweighted_rms(&mut flat, hc * d, self.eps);
            let mixes = proj.forward(&flat);
            let mut y = vec![0.0f32; d];
            for i in 0..hc {
                let pre = super::layers::sigmoid(mixes[i] * scale + base[i]) + self.hc_eps;
                for (o, v) in y.iter_mut().zip(&xt[i * d..(i + 1) * d]) {
                    *o += pre * v;
                }
            }
            ys.extend(y);
        }
        Ok(self.head.forward(&self.norm.forward(&ys)))
    }
}
