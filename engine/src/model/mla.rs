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

use rayon::prelude::*;

use super::cache::LayerKv;
use super::layers::{softmax_inplace, Linear, RmsNorm, Rope};
use super::torch_topk::torch_topk_set;
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
}

/// Which keys each query of a step attends to, in ascending order (one list per query).
pub type Selection = Vec<Vec<u32>>;

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
        let seg = |t: &[f32]| {
            let w = t.len() / tokens;
            t[start * w..(start + n) * w].to_vec()
        };
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
            Sparse::Own { indexer, .. } => indexer.head_dim,
            _ => 0,
        };
        let width = match self.kv_dtype {
            super::cache::KvDType::F32 => 4,
            super::cache::KvDType::Bf16 => 2,
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
                *selection = Some(self.select(indexer, *top_k, qi, ki, &w, start, kv));
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
                        let mut total = 0.0f32;
                        for head in 0..nh {
                            let d = dot(isa, &q[head * hd..(head + 1) * hd], WeightData::F32(k));
                            let weight = w[t * nh + head] * head_scale;
                            total += weight * (d * score_scale).max(0.0);
                        }
                        total
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
            softmax_inplace(&mut scores);
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
            softmax_inplace(&mut scores);
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
