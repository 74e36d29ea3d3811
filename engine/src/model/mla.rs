//! Multi-head latent attention (MLA: DeepSeek-V3, Kimi, GLM-5) and DeepSeek sparse attention
//! (DSA, the lightning indexer of GLM-5 / DeepSeek-V3.2).
//!
//! MLA caches, per token, only the normalised key/value latent `c` (`kv_lora_rank` values)
//! and the rotated rope key `kr` shared by every head (`qk_rope_head_dim` values), instead of
//! `heads · (nope + rope + v)` keys and values. Attention runs in one of two forms, chosen
//! when the model is loaded ([`MlaForm`]), never per step, so a token decoded through the
//! cache gets the bits it gets inside a prefill:
//! * **absorbed** (default): each query head is folded through `W_UK` into the latent space,
//!   scores are `q_abs·c_s + q_rope·kr_s`, the probabilities weight the latents, and `W_UV`
//!   maps the result to the head's values. No per-head key or value is ever materialised.
//! * **expanded** (Hugging Face's form): `kv_b_proj` expands every cached latent into
//!   per-head `k_nope` and `v`, then standard attention. Kept to check the absorbed form.
//!
//! With an indexer (DSA) each query attends only to the `index_topk` cached tokens its
//! indexer scores highest (all of them while it has seen fewer); "shared" indexer layers reuse
//! the selection of the layer before. Attention over a selection uses the same loop as dense
//! attention, keys in ascending order, so selecting every key reproduces dense MLA exactly.
//!
//! DeepSeek-V4's attention ([`CompressedAttention`]) is the successor of both: low-rank
//! queries and one shared key/value head over a sliding window, plus entries compressed from
//! windows of tokens (HCA), or overlapping windows picked by a lightning indexer (CSA), with
//! learned sinks.

use rayon::prelude::*;

use super::cache::LayerKv;
use super::layers::{rows_of, softmax_inplace, Linear, RmsNorm, Rope};
use super::torch_topk::torch_topk_set;
use crate::tensor::attention::softmax;
use crate::tensor::kernels::{dot, Isa};
use crate::tensor::WeightData;

/// How MLA attention is computed (see the module docs). Both give the same model; their
/// results differ only by rounding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum MlaForm {
    /// Attention in the latent space (no per-head keys or values).
    #[default]
    Absorbed,
    /// Per-head keys and values expanded from the cached latents, as transformers does.
    Expanded,
}

/// How queries are projected.
pub enum MlaQuery {
    /// `q_b_proj(RMSNorm(q_a_proj x))` (every large model).
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
    /// `q_proj x` (`q_lora_rank: null`).
    Full(Linear),
}

/// LayerNorm with weight and bias (the indexer's key norm).
pub struct LayerNorm {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub eps: f32,
}

impl LayerNorm {
    /// Normalise every row of `weight.len()` values in place.
    pub fn forward_inplace(&self, x: &mut [f32]) {
        let d = self.weight.len();
        for row in x.chunks_mut(d) {
            let mean = row.iter().sum::<f32>() / d as f32;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
            let r = 1.0 / (var + self.eps).sqrt();
            for ((v, w), b) in row.iter_mut().zip(&self.weight).zip(&self.bias) {
                *v = (*v - mean) * r * w + b;
            }
        }
    }
}

/// The DSA lightning indexer of one "full" layer.
pub struct Indexer {
    /// `[n_heads · head_dim, q_lora_rank]`, applied to the normalised query latent.
    pub wq_b: Linear,
    /// `[head_dim, D]`: one key head.
    pub wk: Linear,
    pub k_norm: LayerNorm,
    /// `[n_heads, D]`: per-head weights of the score sum.
    pub weights_proj: Linear,
    pub heads: usize,
    pub head_dim: usize,
    /// Leading dimensions of each indexer head that rotate (interleaved pairs).
    pub rope_dim: usize,
    /// GLM-5-next's k-pool: keys are scored per pool of tokens, not per token.
    pub kpool: Option<KPool>,
}

/// The k-pool of a GLM-5-next indexer: the tokens are grouped into pools of `size` from the
/// first; a complete pool's key is `Σ_j softmax_j(gate_j + ape_j)[c] · kI_j[c]` over its
/// tokens `j` (per channel `c`, `gate = x · gateᵀ`); a query picks the `top_k / size` best of
/// the complete pools it sees (`Σ_h w_h·relu(qI_h·poolK·dI^-½)`), expanded to their tokens,
/// plus (with `tail`) the visible tokens of the incomplete pool it is in.
pub struct KPool {
    /// Tokens per pool (`index_kpool`).
    pub size: usize,
    /// `[size, head_dim]` (`index_kpool_compress_ape`).
    pub ape: Vec<f32>,
    /// `[head_dim, D]` (`index_kpool_compress_gate`).
    pub gate: Linear,
    /// `index_kpool_always_select_tail`.
    pub tail: bool,
}

/// Which keys each query of a step attends to, in ascending order (one list per query).
pub type Selection = Vec<Vec<u32>>;

impl Indexer {
    /// Values each token keeps in the cache: its key, and with a k-pool its pool gate.
    pub fn key_width(&self) -> usize {
        match self.kpool {
            Some(_) => 2 * self.head_dim,
            None => self.head_dim,
        }
    }
}

/// A lightning-indexer score: `Σ_h (w_h · head_scale) · relu(q_h · k · score_scale)` over the
/// heads of query `q` (`w.len()` heads of `k.len()` values) against one key `k`.
fn relu_score(isa: Isa, q: &[f32], k: &[f32], w: &[f32], head_scale: f32, score_scale: f32) -> f32 {
    let hd = k.len();
    let mut total = 0.0f32;
    for (head, wh) in w.iter().enumerate() {
        let d = dot(isa, &q[head * hd..(head + 1) * hd], WeightData::F32(k));
        total += wh * head_scale * (d * score_scale).max(0.0);
    }
    total
}

/// The k-pool indexer's pick for every query (see [`KPool`]), in ascending order. The pools
/// scored are the complete ones up to the call's last token, as transformers builds them in
/// the same forward call; ties among pool scores are broken as `torch.topk` breaks them over
/// that row, the pools a query cannot see yet masked to `f32::MIN` (`finfo.min`).
#[allow(clippy::too_many_arguments)]
fn select_pooled(
    ix: &Indexer,
    pool: &KPool,
    top_k: usize,
    qi: &[f32],
    rows: &[f32],
    w: &[f32],
    start: usize,
    kv: &mut LayerKv,
) -> Selection {
    let (nh, hd, kp) = (ix.heads, ix.head_dim, pool.size);
    let width = 2 * hd;
    let t_len = rows.len() / width;
    kv.aux.extend(rows);
    let end = start + t_len;
    let cached = kv.aux.f32();
    // The key of every complete pool: per channel, a softmax over the pool's tokens of
    // gate + ape weighting their keys.
    let pools = end / kp;
    let pool_keys: Vec<f32> = (0..pools)
        .into_par_iter()
        .flat_map_iter(|p| {
            let token = move |j: usize| &cached[(p * kp + j) * width..(p * kp + j + 1) * width];
            (0..hd).map(move |c| {
                let mut logits: Vec<f32> = (0..kp)
                    .map(|j| token(j)[hd + c] + pool.ape[j * hd + c])
                    .collect();
                softmax_inplace(&mut logits);
                logits
                    .iter()
                    .enumerate()
                    .fold(0.0f32, |acc, (j, pr)| acc + pr * token(j)[c])
            })
        })
        .collect();
    let select_k = (top_k / kp).min(pools);
    let isa = Isa::detect();
    let head_scale = (nh as f32).powf(-0.5);
    let score_scale = (hd as f32).powf(-0.5);
    (0..t_len)
        .into_par_iter()
        .map(|t| {
            let pos = start + t;
            let visible = (pos + 1) / kp;
            let q = &qi[t * nh * hd..(t + 1) * nh * hd];
            let mut picked: Vec<usize> = if visible <= select_k {
                (0..visible).collect()
            } else {
                let scores: Vec<f32> = (0..pools)
                    .map(|p| {
                        if p >= visible {
                            return f32::MIN;
                        }
                        let k = &pool_keys[p * hd..(p + 1) * hd];
                        let w_t = &w[t * nh..(t + 1) * nh];
                        relu_score(isa, q, k, w_t, head_scale, score_scale)
                    })
                    .collect();
                torch_topk_set(&scores, select_k)
                    .into_iter()
                    .filter(|&p| p < visible)
                    .collect()
            };
            picked.sort_unstable();
            let mut keys: Vec<u32> = picked
                .iter()
                .flat_map(|&p| (p * kp..(p + 1) * kp).map(|s| s as u32))
                .collect();
            if pool.tail {
                keys.extend((visible * kp..=pos).map(|s| s as u32));
            }
            keys
        })
        .collect()
}

/// Sparse attention settings of one layer.
pub enum Sparse {
    /// Dense MLA.
    None,
    /// This layer runs its own indexer and keeps `top_k` keys per query.
    Own { indexer: Box<Indexer>, top_k: usize },
    /// This layer reuses the selection of the layer before it.
    Shared,
}

/// One MLA attention layer.
pub struct Mla {
    pub query: MlaQuery,
    /// `[kv_lora_rank + rope_dim, D]`.
    pub kv_a: Linear,
    /// Norm of the latent (eps 1e-6 in DeepSeek-V3, Kimi and GLM).
    pub kv_norm: RmsNorm,
    /// `[heads · (nope_dim + v_dim), kv_lora_rank]`.
    pub kv_b: Linear,
    /// `[D, heads · v_dim]`.
    pub o: Linear,
    pub heads: usize,
    pub nope_dim: usize,
    pub rope_dim: usize,
    pub v_dim: usize,
    pub kv_lora: usize,
    /// Interleaved-pair RoPE over `rope_dim`.
    pub rope: Rope,
    /// Softmax scale: `(nope + rope)^-½`, times yarn's `mscale²` where it applies.
    pub scale: f32,
    pub form: MlaForm,
    pub sparse: Sparse,
    /// Precision of the cached latents and rope keys.
    pub kv_dtype: super::cache::KvDType,
    /// `W_UK` of every head transposed, `[heads · kv_lora, nope]` (head `h`'s rows
    /// `h·kv_lora..`), so the absorbed query `W_UK_hᵀ · q_nope` is one matmul per head with the
    /// SIMD kernels. Exact copy of `kv_b_proj`'s values (same dtype for f32/bf16/f16, f32 for
    /// other formats).
    pub w_uk_t: crate::tensor::Tensor,
}

/// Build [`Mla::w_uk_t`] from `kv_b_proj` (`[heads · (nope + v), kv_lora]`).
pub fn transpose_w_uk(
    kv_b: &crate::tensor::Tensor,
    heads: usize,
    nope: usize,
    v: usize,
    kv_lora: usize,
) -> crate::Result<crate::tensor::Tensor> {
    use crate::tensor::{DType, Storage, Tensor};
    let view = kv_b.view()?;
    let mut t = vec![0.0f32; heads * kv_lora * nope];
    let mut row = vec![0.0f32; kv_lora];
    for h in 0..heads {
        for i in 0..nope {
            view.row_to_f32(h * (nope + v) + i, &mut row);
            for (j, &x) in row.iter().enumerate() {
                t[(h * kv_lora + j) * nope + i] = x;
            }
        }
    }
    let name = format!("{} (W_UK transposed)", kv_b.name);
    let shape = [heads * kv_lora, nope];
    // Narrowing back to the source's float type is exact: the values came from it.
    let (dtype, bytes): (DType, Vec<u8>) = match kv_b.dtype {
        DType::BF16 => (
            DType::BF16,
            t.iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        ),
        DType::F16 => (
            DType::F16,
            t.iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
        ),
        _ => return Ok(Tensor::from_f32(&name, &shape, &t)),
    };
    Ok(Tensor {
        name,
        shape: shape.to_vec(),
        dtype,
        storage: Storage::owned(&bytes),
        block_scales: None,
        device: None,
        interleaved: None,
    })
}

/// The row-wise projections of a step (all sequences stacked).
pub struct MlaRows {
    /// `[T, heads · (nope + rope)]`.
    pub q: Vec<f32>,
    /// `[T, kv_lora + rope]` before the latent norm.
    pub kv: Vec<f32>,
    /// Indexer queries `[T, nI · dI]`, keys `[T, dI]` (normalised) and head weights `[T, nI]`.
    pub index: Option<(Vec<f32>, Vec<f32>, Vec<f32>)>,
}

impl MlaRows {
    /// Rows `start..start + n` (one sequence's part).
    pub fn segment(&self, start: usize, n: usize, tokens: usize) -> MlaRows {
        let seg = |t: &[f32]| rows_of(t, start, n, tokens);
        MlaRows {
            q: seg(&self.q),
            kv: seg(&self.kv),
            index: self
                .index
                .as_ref()
                .map(|(q, k, w)| (seg(q), seg(k), seg(w))),
        }
    }
}

impl Mla {
    /// Bytes one token takes in the cache: the latent and the rope key (in the cache's
    /// precision) and, with an indexer, its key (f32).
    pub fn cache_bytes_per_token(&self) -> usize {
        let index = match &self.sparse {
            Sparse::Own { indexer, .. } => indexer.key_width(),
            _ => 0,
        };
        let width = match self.kv_dtype {
            super::cache::KvDType::F32 => 4,
            super::cache::KvDType::Bf16 | super::cache::KvDType::F16 => 2,
        };
        (self.kv_lora + self.rope_dim) * width + 4 * index
    }

    /// The projections of rows `x` (`[T, D]`, any number of sequences: row-wise, so a batch
    /// gives each row the bits it gets alone).
    pub fn project(&self, x: &[f32]) -> MlaRows {
        let (q, q_latent) = match &self.query {
            MlaQuery::LowRank { a, norm, b } => {
                let cq = norm.forward(&a.forward(x));
                (b.forward(&cq), Some(cq))
            }
            MlaQuery::Full(l) => (l.forward(x), None),
        };
        let index = match (&self.sparse, q_latent) {
            (Sparse::Own { indexer, .. }, Some(cq)) => {
                let qi = indexer.wq_b.forward(&cq);
                let mut ki = indexer.wk.forward(x);
                indexer.k_norm.forward_inplace(&mut ki);
                if let Some(pool) = &indexer.kpool {
                    // Each token's cached indexer row is its key, then its pool gate.
                    let gate = pool.gate.forward(x);
                    let hd = indexer.head_dim;
                    ki = ki
                        .chunks(hd)
                        .zip(gate.chunks(hd))
                        .flat_map(|(k, g)| k.iter().chain(g).copied())
                        .collect();
                }
                let w = indexer.weights_proj.forward(x);
                Some((qi, ki, w))
            }
            _ => None,
        };
        MlaRows {
            q,
            kv: self.kv_a.forward(x),
            index,
        }
    }

    /// One sequence's attention from its projected rows (tokens at positions `start..`):
    /// the latents and rope keys are appended to `kv`, the indexer (if any) picks the keys
    /// of every query — or the layer reuses `selection`, the previous layer's pick — and
    /// attention runs over the cache. Returns the rows before the output projection
    /// (`[T, heads · v_dim]`); `selection` is left holding this layer's pick.
    pub fn attend_sequence(
        &self,
        rows: MlaRows,
        start: usize,
        kv: &mut LayerKv,
        selection: &mut Option<Selection>,
    ) -> Vec<f32> {
        let (h, nope, rd) = (self.heads, self.nope_dim, self.rope_dim);
        let qk = nope + rd;
        let t_len = rows.q.len() / (h * qk);
        let positions: Vec<usize> = (start..start + t_len).collect();

        // The cache: normalised latents and rotated rope keys.
        let width = self.kv_lora + rd;
        let mut latent = Vec::with_capacity(t_len * self.kv_lora);
        let mut rope_k = Vec::with_capacity(t_len * rd);
        for row in rows.kv.chunks(width) {
            latent.extend_from_slice(&row[..self.kv_lora]);
            rope_k.extend_from_slice(&row[self.kv_lora..]);
        }
        self.kv_norm.forward_inplace(&mut latent);
        self.rope.apply(&mut rope_k, 1, rd, &positions);
        kv.k.extend(&latent);
        kv.v.extend(&rope_k);

        // Queries: the rope part of every head rotates.
        let mut q_nope = Vec::with_capacity(t_len * h * nope);
        let mut q_rope = Vec::with_capacity(t_len * h * rd);
        for head in rows.q.chunks(qk) {
            q_nope.extend_from_slice(&head[..nope]);
            q_rope.extend_from_slice(&head[nope..]);
        }
        self.rope.apply(&mut q_rope, h, rd, &positions);

        match &self.sparse {
            Sparse::None => *selection = None,
            Sparse::Own { indexer, top_k } => {
                let (qi, ki, w) = rows.index.expect("an indexer layer projects indexer rows");
                *selection = Some(match &indexer.kpool {
                    None => self.select(indexer, *top_k, qi, ki, &w, start, kv),
                    Some(pool) => select_pooled(indexer, pool, *top_k, &qi, &ki, &w, start, kv),
                });
            }
            Sparse::Shared => {
                assert!(
                    selection.is_some(),
                    "a shared indexer layer follows an indexer layer (checked at load)"
                );
            }
        }
        let picked = selection.as_ref();
        let keys = |t: usize| -> Vec<u32> {
            match picked {
                Some(s) => s[t].clone(),
                None => (0..=(start + t) as u32).collect(),
            }
        };
        match self.form {
            MlaForm::Absorbed => self.attend_absorbed(&q_nope, &q_rope, kv, t_len, keys),
            MlaForm::Expanded => self.attend_expanded(&q_nope, &q_rope, kv, t_len, keys),
        }
    }

    /// The indexer's pick for every query: keys `0..=pos` scored
    /// `Σ_h w_h · relu(qI_h · kI_s) · dI^-½` (`w = weights_proj(x) · nI^-½`), the best
    /// `top_k` of them (all while fewer), in ascending order. Ties are broken as
    /// transformers' `torch.topk` breaks them over the row it scores in the same forward
    /// call: every key up to the call's last token, the not-yet-causal ones masked
    /// ([`torch_topk_set`](super::torch_topk::torch_topk_set)); scores tie exactly whenever every head's ReLU is 0.
    #[allow(clippy::too_many_arguments)]
    fn select(
        &self,
        ix: &Indexer,
        top_k: usize,
        mut qi: Vec<f32>,
        mut ki: Vec<f32>,
        w: &[f32],
        start: usize,
        kv: &mut LayerKv,
    ) -> Selection {
        let (nh, hd) = (ix.heads, ix.head_dim);
        let t_len = ki.len() / hd;
        let positions: Vec<usize> = (start..start + t_len).collect();
        // The keys transformers scores for every query of this call.
        let end = start + t_len;
        let rope = Rope {
            rotary_dim: ix.rope_dim,
            ..self.rope.clone()
        };
        rope.apply(&mut qi, nh, hd, &positions);
        rope.apply(&mut ki, 1, hd, &positions);
        kv.aux.extend(&ki);
        let isa = Isa::detect();
        let head_scale = (nh as f32).powf(-0.5);
        let score_scale = (hd as f32).powf(-0.5);
        (0..t_len)
            .into_par_iter()
            .map(|t| {
                let pos = start + t;
                if pos < top_k {
                    return (0..=pos as u32).collect();
                }
                let q = &qi[t * nh * hd..(t + 1) * nh * hd];
                let mut scores: Vec<f32> = (0..=pos)
                    .map(|s| {
                        let k = &kv.aux.f32()[s * hd..(s + 1) * hd];
                        let w_t = &w[t * nh..(t + 1) * nh];
                        relu_score(isa, q, k, w_t, head_scale, score_scale)
                    })
                    .collect();
                scores.resize(end, f32::NEG_INFINITY);
                let mut picked: Vec<u32> = torch_topk_set(&scores, top_k)
                    .into_iter()
                    .filter(|&s| s <= pos)
                    .map(|s| s as u32)
                    .collect();
                picked.sort_unstable();
                picked
            })
            .collect()
    }

    /// Absorbed attention over the cache (see the module docs).
    fn attend_absorbed(
        &self,
        q_nope: &[f32],
        q_rope: &[f32],
        kv: &LayerKv,
        t_len: usize,
        keys: impl Fn(usize) -> Vec<u32> + Sync,
    ) -> Vec<f32> {
        let (h, nope, rd, vd, r) = (
            self.heads,
            self.nope_dim,
            self.rope_dim,
            self.v_dim,
            self.kv_lora,
        );
        let kv_b = self.kv_b.weight.view().expect("checked at load");
        let w_uk_t = self.w_uk_t.view().expect("built at load");
        // q_abs[t, h] = W_UK_hᵀ · q_nope[t, h]: one matmul per head over the step's rows.
        let per_head: Vec<Vec<f32>> = (0..h)
            .into_par_iter()
            .map(|head| {
                let qh: Vec<f32> = (0..t_len)
                    .flat_map(|t| q_nope[(t * h + head) * nope..(t * h + head + 1) * nope].to_vec())
                    .collect();
                crate::tensor::matmul::matmul_new(&qh, &w_uk_t.rows_range(head * r, r))
            })
            .collect();
        let mut q_abs = vec![0.0f32; t_len * h * r];
        for (head, acc) in per_head.iter().enumerate() {
            for t in 0..t_len {
                q_abs[(t * h + head) * r..(t * h + head + 1) * r]
                    .copy_from_slice(&acc[t * r..(t + 1) * r]);
            }
        }
        let isa = Isa::detect();
        let mut out = vec![0.0f32; t_len * h * vd];
        out.par_chunks_mut(vd).enumerate().for_each(|(idx, o)| {
            let (t, head) = (idx / h, idx % h);
            let qa = &q_abs[idx * r..(idx + 1) * r];
            let qr = &q_rope[idx * rd..(idx + 1) * rd];
            let ks = keys(t);
            let mut scores: Vec<f32> = ks
                .iter()
                .map(|&s| {
                    let s = s as usize;
                    let c = kv.k.data(s * r..(s + 1) * r);
                    let kr = kv.v.data(s * rd..(s + 1) * rd);
                    (dot(isa, qa, c) + dot(isa, qr, kr)) * self.scale
                })
                .collect();
            softmax(&mut scores, None);
            let mut o_lat = vec![0.0f32; r];
            let mut c = vec![0.0f32; r];
            for (p, &s) in scores.iter().zip(&ks) {
                kv.k.read(s as usize * r..(s as usize + 1) * r, &mut c);
                for (a, cv) in o_lat.iter_mut().zip(&c) {
                    *a += p * cv;
                }
            }
            let w_uv = kv_b.rows_range(head * (nope + vd) + nope, vd);
            crate::tensor::matmul::matmul(&o_lat, &w_uv, o);
        });
        out
    }

    /// Expanded attention (transformers' form): per-head keys and values from the latents.
    fn attend_expanded(
        &self,
        q_nope: &[f32],
        q_rope: &[f32],
        kv: &LayerKv,
        t_len: usize,
        keys: impl Fn(usize) -> Vec<u32> + Sync,
    ) -> Vec<f32> {
        let (h, nope, rd, vd) = (self.heads, self.nope_dim, self.rope_dim, self.v_dim);
        let expanded = self.kv_b.forward(&kv.k.to_f32_vec()); // [len, H · (nope + v)]
        let width = h * (nope + vd);
        let isa = Isa::detect();
        let mut out = vec![0.0f32; t_len * h * vd];
        out.par_chunks_mut(vd).enumerate().for_each(|(idx, o)| {
            let (t, head) = (idx / h, idx % h);
            let qn = &q_nope[idx * nope..(idx + 1) * nope];
            let qr = &q_rope[idx * rd..(idx + 1) * rd];
            let ks = keys(t);
            let at = |s: u32| s as usize * width + head * (nope + vd);
            let mut scores: Vec<f32> = ks
                .iter()
                .map(|&s| {
                    let kn = WeightData::F32(&expanded[at(s)..at(s) + nope]);
                    let kr = kv.v.data(s as usize * rd..(s as usize + 1) * rd);
                    (dot(isa, qn, kn) + dot(isa, qr, kr)) * self.scale
                })
                .collect();
            softmax(&mut scores, None);
            for (p, &s) in scores.iter().zip(&ks) {
                let v = &expanded[at(s) + nope..at(s) + nope + vd];
                for (a, vv) in o.iter_mut().zip(v) {
                    *a += p * vv;
                }
            }
        });
        out
    }
}

// ---------------------------------------------------------------------------------------------
// DeepSeek-V4's compressed attention.

/// A compressor (DeepSeek-V4): the `wkv`/`wgate` rows of every token become one entry per
/// window of `rate` tokens, a per-channel softmax-gated sum normalised and rotated at the
/// window's first position.
pub struct Compressor {
    pub wkv: Linear,
    pub wgate: Linear,
    /// `[rate, width]` per-slot gate bias.
    pub ape: Vec<f32>,
    pub norm: RmsNorm,
    pub rate: usize,
    /// Entry dimension.
    pub dim: usize,
    /// CSA: entries overlap the previous window (rows are `[Ca | Cb]`, `width = 2·dim`).
    pub overlap: bool,
}

impl Compressor {
    /// Load `{p}.{wkv,wgate,ape,norm}` for entries of `dim` over windows of `rate` tokens.
    pub fn load(
        ckpt: &crate::format::safetensors::Checkpoint,
        p: &str,
        d: usize,
        dim: usize,
        rate: usize,
        overlap: bool,
        eps: f64,
    ) -> crate::Result<Self> {
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
    pub fn raw_width(&self) -> usize {
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
        rope.apply_trailing(&mut out, dim, &[w * rate], false);
        out
    }
}

/// The lightning indexer of DeepSeek-V4's CSA layers: its own compressor, queries from the
/// query latent, per-head weights from the layer input.
pub struct CompressedIndexer {
    pub compressor: Compressor,
    pub wq_b: Linear,
    pub weights_proj: Linear,
    pub heads: usize,
    pub dim: usize,
    pub top_k: usize,
}

/// Which entries a DeepSeek-V4 attention layer adds to its sliding window.
#[allow(clippy::large_enum_variant)] // one per layer, never moved in a hot path
pub enum Compression {
    /// The window only.
    Sliding,
    /// Heavily compressed: every complete window of `rate` tokens is one entry, all visible.
    Hca(Compressor),
    /// Compressed sparse: overlapping windows, the indexer picking what each query sees.
    Csa(Compressor, Box<CompressedIndexer>),
}

/// DeepSeek-V4's attention: low-rank queries (`wq_a` → `q_norm` → `wq_b`, then an unweighted
/// RMSNorm per head), one key/value head (`wkv` → `norm`; the same vector is key and value),
/// interleaved RoPE on the trailing dims, a sliding window plus the compressed entries of
/// [`Compression`], learned sinks, the output's rope dims rotated back at the query position,
/// and a grouped low-rank output (`wo_a` per head group, then `wo_b`).
///
/// Cache per layer: `k` the rotated key/value of every token; `v` the compressor's raw
/// `[wkv | wgate]` rows of every token; `aux` per token `[entry | indexer raw rows | indexer
/// entry]`, the entries stored at the row of the token that completes their window (zeros
/// elsewhere). Per-token rows make truncation and KV files work as for every other kind.
pub struct CompressedAttention {
    pub wq_a: Linear,
    pub q_norm: RmsNorm,
    pub wq_b: Linear,
    pub wkv: Linear,
    pub kv_norm: RmsNorm,
    pub wo_a: Linear,
    pub wo_b: Linear,
    pub sinks: Vec<f32>,
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub o_rank: usize,
    pub window: usize,
    /// "main" rope for sliding layers, "compress" for CSA/HCA.
    pub rope: Rope,
    /// The "compress" rope (compressors and indexer).
    pub compress_rope: Rope,
    pub compression: Compression,
    /// Epsilon of the per-head query normalisation.
    pub eps: f32,
}

/// Per-token aux layout of a layer: `[entry | indexer raw rows | indexer entry]`, their
/// widths and the total.
struct AuxLayout {
    entry: usize,
    idx_raw: usize,
    width: usize,
}

/// The row-wise projections of a step for [`CompressedAttention`] (all sequences stacked).
pub struct CompressedRows {
    /// Queries `[T, heads · head_dim]`, normalised per head, not rotated.
    q: Vec<f32>,
    /// Keys/values `[T, head_dim]`, normalised, not rotated.
    k: Vec<f32>,
    /// The compressor's raw rows (compressed layers).
    raw: Option<Vec<f32>>,
    /// The indexer's raw rows, queries `[T, nI · dI]` (not rotated) and head weights `[T, nI]`.
    index: Option<(Vec<f32>, Vec<f32>, Vec<f32>)>,
}

impl CompressedRows {
    /// Rows `start..start + n` (one sequence's part).
    pub fn segment(&self, start: usize, n: usize, tokens: usize) -> CompressedRows {
        let seg = |t: &[f32]| rows_of(t, start, n, tokens);
        CompressedRows {
            q: seg(&self.q),
            k: seg(&self.k),
            raw: self.raw.as_deref().map(seg),
            index: self
                .index
                .as_ref()
                .map(|(r, q, w)| (seg(r), seg(q), seg(w))),
        }
    }
}

impl CompressedAttention {
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

    /// Bytes one token adds to this layer's cache (f32 key/value, raw compressor rows, aux).
    pub fn cache_bytes_per_token(&self) -> usize {
        let raw = match &self.compression {
            Compression::Sliding => 0,
            Compression::Hca(c) | Compression::Csa(c, _) => c.raw_width(),
        };
        4 * (self.head_dim + raw + self.aux_layout().width)
    }

    /// The projections of rows `x` (`[T, D]`, normed; any number of sequences: row-wise, so
    /// a batch gives each row the bits it gets alone).
    pub fn project(&self, x: &[f32]) -> CompressedRows {
        let q_res = self.q_norm.forward(&self.wq_a.forward(x));
        let mut q = self.wq_b.forward(&q_res);
        super::layers::unweighted_rms(&mut q, self.head_dim, self.eps);
        let mut k = self.wkv.forward(x);
        self.kv_norm.forward_inplace(&mut k);
        let (raw, index) = match &self.compression {
            Compression::Sliding => (None, None),
            Compression::Hca(c) => (Some(c.raw(x)), None),
            Compression::Csa(c, ix) => (
                Some(c.raw(x)),
                Some((
                    ix.compressor.raw(x),
                    ix.wq_b.forward(&q_res),
                    ix.weights_proj.forward(x),
                )),
            ),
        };
        CompressedRows { q, k, raw, index }
    }

    /// One sequence's attention from its projected rows (tokens at positions `start..`),
    /// appending to `kv`: the entries these tokens complete, the indexer's picks (CSA), and
    /// attention with sinks over the window and the visible entries. Returns the rows before
    /// the output projection (`[T, heads · head_dim]`, rope dims rotated back).
    pub fn attend_sequence(
        &self,
        rows: CompressedRows,
        start: usize,
        kv: &mut LayerKv,
    ) -> Vec<f32> {
        let (h, hd) = (self.heads, self.head_dim);
        let CompressedRows {
            mut q,
            mut k,
            raw,
            index,
        } = rows;
        let t_len = k.len() / hd;
        let positions: Vec<usize> = (start..start + t_len).collect();
        self.rope.apply_trailing(&mut q, hd, &positions, false);
        self.rope.apply_trailing(&mut k, hd, &positions, false);
        kv.k.extend(&k);

        // Compressed entries completed by these tokens, and (CSA) the indexer's picks.
        let layout = self.aux_layout();
        let mut picks: Option<Vec<Vec<usize>>> = None;
        match &self.compression {
            Compression::Sliding => {}
            Compression::Hca(c) | Compression::Csa(c, _) => {
                kv.v.extend(raw.as_deref().unwrap_or_default());
                let idx_raw = index.as_ref().map(|(r, _, _)| r);
                for (t, &pos) in positions.iter().enumerate() {
                    let mut row = vec![0.0f32; layout.width];
                    if let Some(r) = idx_raw {
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
                if let (Compression::Csa(c, ix), Some((_, iq, iw))) = (&self.compression, index) {
                    picks = Some(self.select(ix, c.rate, iq, &iw, &positions, kv, &layout));
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
            softmax(&mut scores, Some(self.sinks[head]));
            for (&p, kj) in scores.iter().zip(&keys) {
                for (a, v) in o.iter_mut().zip(kj.iter()) {
                    *a += p * v;
                }
            }
        });
        self.rope.apply_trailing(&mut out, hd, &positions, true);
        out
    }

    /// The grouped low-rank output of attention rows `out` (`[T, heads · head_dim]`, any
    /// number of sequences): group `g` of every row through its `wo_a` rows, then `wo_b`.
    pub fn output(&self, out: &[f32]) -> Vec<f32> {
        let (h, hd) = (self.heads, self.head_dim);
        let t_len = out.len() / (h * hd);
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
    /// query may not see yet masked ([`torch_topk_set`]).
    #[allow(clippy::too_many_arguments)]
    fn select(
        &self,
        ix: &CompressedIndexer,
        rate: usize,
        mut q: Vec<f32>,
        w: &[f32],
        positions: &[usize],
        kv: &LayerKv,
        layout: &AuxLayout,
    ) -> Vec<Vec<usize>> {
        let (nh, dim) = (ix.heads, ix.dim);
        self.compress_rope
            .apply_trailing(&mut q, dim, positions, false);
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
