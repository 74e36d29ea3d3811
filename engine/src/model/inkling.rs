//! Inkling (`inkling_text`, Thinking Machines' Inkling; arch doc 2.13) and the attention it
//! shares with Inkling 2 ([`super::inkling2`]).
//!
//! Attention has no RoPE: keys and values pass through short causal convolutions with a
//! residual ([`KvConv`]), queries and keys are RMS-normalised per head and scaled by `1/hd`,
//! and a relative position bias conditioned on the hidden state is added to every score
//! ([`RelAttention`]: `bias(i, j) = (r_i · proj)[i − j]` for `0 ≤ i − j < extent`). Layers
//! interleave sliding-window (`hybrid_sliding`, their own head counts, the bias over the
//! window) and full attention (`hybrid`; with `log_scaling_n_floor` the queries and the bias
//! grow with the position by `τ = 1 + α·ln(max((pos + 1)/n_floor, 1))`). Both parts' outputs
//! pass through a short convolution with a residual before they reach the residual stream
//! ([`PostConv`]). All those convolutions keep their last inputs per sequence in its cache,
//! like the hybrids' recurrent states (prefix reuse goes through checkpoints).
//!
//! The embedding is RMS-normalised; the final normed rows are divided by
//! `logits_mup_width_multiplier` before the head, and the logits cut to
//! `unpadded_vocab_size`. Sparse layers route with Inkling's router (`Router::SharedSink`:
//! a sigmoid top-k with a selection-only bias, then one softmax over the log-sigmoids of the
//! chosen experts' and the shared experts' logits), the shared experts running as experts of
//! the store that every token uses; dense layers (`mlp_layer_types`) scale their SwiGLU by
//! `mlp.global_scale`. Experts are stored fused (`experts.gate_up_proj [E, 2I, D]`,
//! `shared_experts.{gate,up,down}_proj [S, ·, ·]`, or the hub's interleaved `w13_weight`) and
//! split per expert on load.

use std::sync::Arc;

use serde_json::Value;

use super::layers::{
    attend, rows_of, sigmoid, unweighted_rms, AttendShape, Linear, Mlp, MoeBlock, RelBias, RmsNorm,
    Router, Sinks,
};
use super::linear_attention::{DynamicConv, ShortConv};
use super::registry::{boxed_load, Experts, Family};
use super::transformer::{
    load_standard, Ffn, LayerParts, LogitForm, PostConv, SelfAttention, StandardConfig, Transformer,
};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::fused::{FusedExperts, FusedLayout};
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertNames, ExpertStore};
use crate::{Error, Result};

/// Where Inkling's routed experts are once split: `mlp.experts.{e}.{gate,up,down}_proj`,
/// counted by `n_routed_experts`.
pub const EXPERTS: Experts = Experts {
    count: "n_routed_experts",
    ..Experts::QWEN
};

/// The hubs' fused routed experts (Inkling's and Inkling 2's): `experts.w13_weight`
/// `[E, 2I, D]`, gate and up rows interleaved…
pub(crate) const HUB_W13: FusedExperts = FusedExperts {
    tensor: "experts.w13_weight",
    into: "experts",
    layout: FusedLayout::GateUpInterleaved,
};

/// …and `experts.w2_weight` `[E, D, I]`.
pub(crate) const HUB_W2: FusedExperts = FusedExperts {
    tensor: "experts.w2_weight",
    into: "experts",
    layout: FusedLayout::Matrix("down_proj"),
};

/// Inkling's fused expert tensors: transformers' `gate_up_proj` (gate rows, then up rows) and
/// `down_proj`, the shared experts' `[S, ·, ·]` matrices, and the hub's `w13_weight` /
/// `shared_w13_weight` (gate and up rows interleaved) and `w2_weight` / `shared_w2_weight`.
const FUSED: &[FusedExperts] = &[
    FusedExperts {
        tensor: "experts.gate_up_proj",
        into: "experts",
        layout: FusedLayout::GateUpHalves,
    },
    FusedExperts {
        tensor: "experts.down_proj",
        into: "experts",
        layout: FusedLayout::Matrix("down_proj"),
    },
    HUB_W13,
    HUB_W2,
    FusedExperts {
        tensor: "shared_w13_weight",
        into: "shared_experts",
        layout: FusedLayout::GateUpInterleaved,
    },
    FusedExperts {
        tensor: "shared_w2_weight",
        into: "shared_experts",
        layout: FusedLayout::Matrix("down_proj"),
    },
    FusedExperts {
        tensor: "shared_experts.gate_proj",
        into: "shared_experts",
        layout: FusedLayout::Matrix("gate_proj"),
    },
    FusedExperts {
        tensor: "shared_experts.up_proj",
        into: "shared_experts",
        layout: FusedLayout::Matrix("up_proj"),
    },
    FusedExperts {
        tensor: "shared_experts.down_proj",
        into: "shared_experts",
        layout: FusedLayout::Matrix("down_proj"),
    },
];

/// Inkling in the registry.
pub const FAMILY: Family = Family::new(&["inkling_text"], boxed_load!(load))
    .with_normalize(inkling_config)
    .with_experts(EXPERTS)
    .with_fused_experts(FUSED);

/// transformers' `attribute_map` names the Inkling family's configs share (the other name
/// first; checkpoints spell the kernel `sconv_kernel_size`, the context `model_max_length`).
pub(crate) const FAMILY_ALIASES: &[(&str, &str)] = &[
    ("sconv_kernel_size", "conv_kernel_size"),
    ("sliding_window", "sliding_window_size"),
    ("num_local_experts", "n_routed_experts"),
    ("model_max_length", "max_position_embeddings"),
];

/// `cfg`'s JSON with each field of the [`FAMILY_ALIASES`] and of `own` (`(other name,
/// name)`) under its name when only the other name is set.
pub(crate) fn fold_aliases(cfg: &ModelConfig, own: &[(&str, &str)]) -> Result<Value> {
    let mut json = cfg.json().clone();
    let obj = json
        .as_object_mut()
        .ok_or_else(|| Error::config(cfg.path(), "config", "is not a JSON object"))?;
    for (other, name) in FAMILY_ALIASES.iter().chain(own) {
        if obj.get(*name).is_none_or(Value::is_null) {
            if let Some(v) = obj.get(*other).filter(|v| !v.is_null()).cloned() {
                obj.insert(name.to_string(), v);
            }
        }
    }
    Ok(json)
}

/// An Inkling config in the form the loader reads, as `InklingTextConfig` reads it: the
/// `attribute_map` names under transformers' names, explicit `layer_types` (from
/// `local_layer_ids`, else every layer but each 6th sliding), explicit `mlp_layer_types`
/// (the first `dense_mlp_idx`, default 0, dense), and checkpoints' `dense_intermediate_size`
/// folded in (`intermediate_size` is then the experts' width).
pub fn inkling_config(cfg: &ModelConfig) -> Result<ModelConfig> {
    let mut json = fold_aliases(
        cfg,
        &[("embedding_multiplier", "logits_mup_width_multiplier")],
    )?;
    let layers = schedule_len(cfg)?;
    let obj = json.as_object_mut().expect("checked by fold_aliases");
    if obj.get("layer_types").is_none_or(Value::is_null) {
        let local = cfg
            .get("local_layer_ids")
            .map(|_| cfg.usize_list("local_layer_ids"));
        let local = local.transpose()?;
        let types = (0..layers)
            .map(|i| {
                let sliding = match &local {
                    Some(ids) => ids.contains(&i),
                    None => (i + 1) % 6 != 0,
                };
                Value::from(if sliding { "hybrid_sliding" } else { "hybrid" })
            })
            .collect();
        obj.insert("layer_types".into(), Value::Array(types));
    }
    if obj.get("mlp_layer_types").is_none_or(Value::is_null) {
        let dense = cfg.usize_or("dense_mlp_idx", 0)?;
        let types = (0..layers)
            .map(|i| Value::from(if i < dense { "dense" } else { "sparse" }))
            .collect();
        obj.insert("mlp_layer_types".into(), Value::Array(types));
    }
    if let Some(dense) = cfg.get("dense_intermediate_size").cloned() {
        if let Some(experts) = obj.get("intermediate_size").cloned() {
            obj.insert("moe_intermediate_size".into(), experts);
        }
        obj.insert("intermediate_size".into(), dense);
    }
    Ok(ModelConfig::from_value(cfg.path().to_path_buf(), json))
}

/// How many layers a derived per-layer schedule lists: `num_hidden_layers`, or none when it
/// is beyond any model (the loader then refuses it against the checkpoint's layers, naming
/// the field, before reading a schedule).
pub(crate) fn schedule_len(cfg: &ModelConfig) -> Result<usize> {
    let layers = cfg.usize("num_hidden_layers")?;
    Ok(if layers <= 1 << 16 { layers } else { 0 })
}

/// Each entry of the string list `field` (`num_hidden_layers` long) as one of `kinds`
/// (`(name, value)`), or an error naming the entry.
pub(crate) fn layer_kinds<T: Copy>(
    cfg: &ModelConfig,
    field: &str,
    layers: usize,
    kinds: &[(&str, T)],
) -> Result<Vec<T>> {
    let list = cfg
        .get(field)
        .and_then(Value::as_array)
        .filter(|a| a.len() == layers)
        .ok_or_else(|| {
            cfg.error(
                field,
                format!("must be a list of {layers} layer types (num_hidden_layers)"),
            )
        })?;
    list.iter()
        .enumerate()
        .map(|(l, v)| {
            kinds
                .iter()
                .find(|(name, _)| v.as_str() == Some(*name))
                .map(|&(_, k)| k)
                .ok_or_else(|| {
                    let names: Vec<String> =
                        kinds.iter().map(|(n, _)| format!("\"{n}\"")).collect();
                    Error::config(
                        cfg.path(),
                        format!("{field}[{l}]"),
                        format!("is {v}, expected {}", names.join(" or ")),
                    )
                })
        })
        .collect()
}

/// The attention geometry of an Inkling-family config.
#[derive(Debug, Clone)]
pub(crate) struct Geometry {
    /// `(heads, kv heads, head_dim)` of full-attention layers.
    pub full: (usize, usize, usize),
    /// The same for sliding-window layers (`swa_*`).
    pub sliding: (usize, usize, usize),
    /// `sliding_window_size`: the window, and the bias extent, of sliding layers.
    pub window: usize,
    /// `rel_extent`: the bias extent of full layers.
    pub rel_extent: usize,
    pub d_rel: usize,
    /// `conv_kernel_size`.
    pub kernel: usize,
    /// `log_scaling_n_floor` and `log_scaling_alpha`.
    pub n_floor: Option<usize>,
    pub alpha: f64,
    /// Per layer: sliding-window attention (`hybrid_sliding`) or full (`hybrid`).
    pub sliding_layers: Vec<bool>,
}

impl Geometry {
    /// Read from `cfg` (normalised), for `sc.layers` layers; the full-attention head counts are
    /// `sc`'s.
    pub fn read(cfg: &ModelConfig, sc: &StandardConfig) -> Result<Geometry> {
        let heads = |h: &str, kv: &str, hd: &str, default: (usize, usize, usize)| -> Result<_> {
            let geo = (
                cfg.dim_or(h, default.0)?,
                cfg.dim_or(kv, default.1)?,
                cfg.dim_or(hd, default.2)?,
            );
            if geo.0 % geo.1 != 0 {
                return Err(cfg.error(kv, format!("{} does not divide {h} = {}", geo.1, geo.0)));
            }
            Ok(geo)
        };
        let full = (sc.heads, sc.kv_heads, sc.head_dim);
        let sliding = heads(
            "swa_num_attention_heads",
            "swa_num_key_value_heads",
            "swa_head_dim",
            full,
        )?;
        let n_floor = cfg.opt_usize("log_scaling_n_floor")?;
        if n_floor == Some(0) {
            return Err(cfg.error("log_scaling_n_floor", "is 0; positions are divided by it"));
        }
        Ok(Geometry {
            full,
            sliding,
            window: cfg.dim("sliding_window_size")?,
            rel_extent: cfg.dim("rel_extent")?,
            d_rel: cfg.dim("d_rel")?,
            kernel: cfg.usize_in_or(
                "conv_kernel_size",
                1..=64,
                "a short convolution of 1 to 64 taps",
                4,
            )?,
            n_floor,
            alpha: cfg.f64_or("log_scaling_alpha", 0.1)?,
            sliding_layers: layer_kinds(
                cfg,
                "layer_types",
                sc.layers,
                &[("hybrid_sliding", true), ("hybrid", false)],
            )?,
        })
    }
}

/// A per-head normalisation of queries, keys, values or relative states (in place, rows of
/// `heads · width`).
pub enum HeadNorm {
    None,
    /// RMSNorm with a weight of `width` (Inkling's q/k norms).
    Rms(RmsNorm),
    /// RMSNorm without a weight (Inkling 2's values).
    Unit {
        eps: f32,
    },
    /// `x ← x · s`, then scaled down to an L2 norm of at most `threshold`:
    /// `x · min(1, threshold / (‖x‖ + 1e-6))`, in f32 (Inkling 2's q/k/relative clips; `s`,
    /// `[heads, width]`, is learned for queries and relative states, absent for keys).
    Clip {
        scale: Option<Vec<f32>>,
        threshold: f32,
    },
}

impl HeadNorm {
    fn apply(&self, x: &mut [f32], width: usize) {
        match self {
            HeadNorm::None => {}
            HeadNorm::Rms(n) => n.forward_inplace(x),
            HeadNorm::Unit { eps } => unweighted_rms(x, width, *eps),
            HeadNorm::Clip { scale, threshold } => {
                let per_row = scale.as_ref().map_or(width, Vec::len);
                for row in x.chunks_mut(per_row) {
                    if let Some(s) = scale {
                        row.iter_mut().zip(s).for_each(|(v, s)| *v *= s);
                    }
                    for head in row.chunks_mut(width) {
                        let norm = head.iter().map(|v| v * v).sum::<f32>().sqrt();
                        let f = (threshold / (norm + 1e-6)).min(1.0);
                        head.iter_mut().for_each(|v| *v *= f);
                    }
                }
            }
        }
    }
}

/// The convolution of a key or value projection.
pub enum KvConv {
    /// `(y + conv(y)) / divisor` with fixed taps ([`ShortConv::forward_residual`]).
    Short { conv: ShortConv, divisor: f32 },
    /// Taps that depend on the token (Inkling 2's full-attention layers).
    Dynamic(DynamicConv),
}

impl KvConv {
    fn state_len(&self) -> usize {
        match self {
            KvConv::Short { conv, .. } => conv.state_len(),
            KvConv::Dynamic(c) => c.state_len(),
        }
    }

    /// The taps of rows whose convolution input is `x` (dynamic convolutions only).
    fn taps(&self, x: &[f32]) -> Option<Vec<f32>> {
        match self {
            KvConv::Short { .. } => None,
            KvConv::Dynamic(c) => Some(c.taps.forward(x)),
        }
    }

    fn forward(&self, y: &mut [f32], taps: Option<&[f32]>, state: &mut [f32]) {
        match (self, taps) {
            (KvConv::Short { conv, divisor }, _) => conv.forward_residual(y, state, *divisor),
            (KvConv::Dynamic(c), Some(taps)) => c.forward(y, taps, state),
            (KvConv::Dynamic(_), None) => unreachable!("projected with the rows"),
        }
    }
}

/// `τ = 1 + α · ln(max((pos + 1) / n_floor, 1))`, in f32, multiplying the queries and the
/// relative position bias of full-attention layers.
#[derive(Debug, Clone, Copy)]
pub struct LogScaling {
    pub alpha: f32,
    pub n_floor: f32,
    /// Scale the relative states before the bias is formed (Inkling 2) rather than the bias
    /// (Inkling): the same up to rounding, as each model computes it.
    pub on_states: bool,
}

impl LogScaling {
    fn tau(&self, pos: usize) -> f32 {
        1.0 + self.alpha * ((pos + 1) as f32 / self.n_floor).max(1.0).ln()
    }
}

/// Attention with short convolutions on keys and values and a relative position bias
/// conditioned on the hidden state, no RoPE (Inkling, Inkling 2; see the module docs). Per
/// token: `q = qnorm(q_proj x)`, `k = knorm(conv(k_proj x))`, `v = vnorm(conv(v_proj x))`,
/// `R = rnorm(r_proj x)` (`[heads, d_rel]`); with log scaling `q` and the bias (or `R`) are
/// multiplied by `τ`; scores `q·k · scale + (R·proj)[i − j]` (0 beyond the extent), a sliding
/// window if set, optionally a per-token sink logit per head; the heads' output optionally
/// gated by `sigmoid(gate_proj x)`.
pub struct RelAttention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub r: Linear,
    pub o: Linear,
    /// Inkling 2's output gate, `[heads · head_dim, D]`.
    pub gate: Option<Linear>,
    /// Inkling 2's per-token sink logits, `[heads, D]`.
    pub sinks: Option<Linear>,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub d_rel: usize,
    /// `rel_logits_proj.proj`, `[d_rel, extent]`.
    pub rel_proj: Vec<f32>,
    pub extent: usize,
    /// Each query sees this many most recent keys, itself included.
    pub window: Option<usize>,
    pub scale: f32,
    pub q_norm: HeadNorm,
    pub k_norm: HeadNorm,
    pub v_norm: HeadNorm,
    pub r_norm: HeadNorm,
    pub log_scaling: Option<LogScaling>,
    pub k_conv: KvConv,
    pub v_conv: KvConv,
    /// Queries, keys and values read separate inputs (Inkling 2's full-attention layers):
    /// the block's rows are the three side by side, each RMS-normalised with a unit weight,
    /// and these are their norms' weights (`q_input_norm`, `k_input_norm`, `v_input_norm`).
    pub input_norms: Option<[Vec<f32>; 3]>,
}

/// [`RelAttention::project`]'s rows of one or several sequences.
pub struct RelRows {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    r: Vec<f32>,
    gate: Option<Vec<f32>>,
    sinks: Option<Vec<f32>>,
    k_taps: Option<Vec<f32>>,
    v_taps: Option<Vec<f32>>,
}

/// The tensor names of a [`RelAttention`] under a layer (without `.weight`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttnNames {
    pub q: &'static str,
    pub k: &'static str,
    pub v: &'static str,
    pub r: &'static str,
    pub o: &'static str,
    /// The bias profiles (`….rel_logits_proj.proj`).
    pub rel: &'static str,
}

/// transformers' names (`self_attn.*`).
pub(crate) const HF_ATTN: AttnNames = AttnNames {
    q: "self_attn.q_proj",
    k: "self_attn.k_proj",
    v: "self_attn.v_proj",
    r: "self_attn.r_proj",
    o: "self_attn.o_proj",
    rel: "self_attn.rel_logits_proj.proj",
};

/// Thinking Machines' names (`attn.*`, the hub's and Inkling 2's).
pub(crate) const TML_ATTN: AttnNames = AttnNames {
    q: "attn.wq_du",
    k: "attn.wk_dv",
    v: "attn.wv_dv",
    r: "attn.wr_du",
    o: "attn.wo_ud",
    rel: "attn.rel_logits_proj.proj",
};

impl RelAttention {
    /// Layer `p`'s projections and bias profiles (`names`), on a sliding-window layer or
    /// not, with these key/value convolutions; the norms, scale (`1/hd`) and the rest as
    /// Inkling has them (no log scaling): the caller sets what differs.
    pub(crate) fn load(
        ckpt: &Checkpoint,
        p: &str,
        names: &AttnNames,
        geo: &Geometry,
        sliding: bool,
        d: usize,
        convs: [KvConv; 2],
    ) -> Result<RelAttention> {
        let (h, kvh, hd) = if sliding { geo.sliding } else { geo.full };
        let extent = if sliding { geo.window } else { geo.rel_extent };
        let lin = |name: &str, out: usize, inp: usize| {
            Linear::load(ckpt, &format!("{p}.{name}"), out, inp, false)
        };
        let [k_conv, v_conv] = convs;
        Ok(RelAttention {
            q: lin(names.q, h * hd, d)?,
            k: lin(names.k, kvh * hd, d)?,
            v: lin(names.v, kvh * hd, d)?,
            r: lin(names.r, h * geo.d_rel, d)?,
            o: lin(names.o, d, h * hd)?,
            gate: None,
            sinks: None,
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
            d_rel: geo.d_rel,
            rel_proj: ckpt
                .weight(&format!("{p}.{}", names.rel), &[geo.d_rel, extent])?
                .to_f32_vec()?,
            extent,
            window: sliding.then_some(geo.window),
            scale: 1.0 / hd as f32,
            q_norm: HeadNorm::None,
            k_norm: HeadNorm::None,
            v_norm: HeadNorm::None,
            r_norm: HeadNorm::None,
            log_scaling: None,
            k_conv,
            v_conv,
            input_norms: None,
        })
    }

    /// Values of the state a sequence keeps: the key convolution's window, then the value
    /// convolution's.
    pub fn state_len(&self) -> usize {
        self.k_conv.state_len() + self.v_conv.state_len()
    }

    /// The projections of rows `x` (any number of sequences: row-wise).
    pub fn project(&self, x: &[f32]) -> RelRows {
        let split;
        let (xq, xk, xv) = match &self.input_norms {
            None => (x, x, x),
            Some(weights) => {
                let d = self.q.weight.shape[1];
                let mut parts = [Vec::new(), Vec::new(), Vec::new()];
                for row in x.chunks(3 * d) {
                    for ((part, input), w) in parts.iter_mut().zip(row.chunks(d)).zip(weights) {
                        part.extend(input.iter().zip(w).map(|(v, w)| w * v));
                    }
                }
                split = parts;
                (&split[0][..], &split[1][..], &split[2][..])
            }
        };
        RelRows {
            q: self.q.forward(xq),
            k: self.k.forward(xk),
            v: self.v.forward(xv),
            r: self.r.forward(xq),
            gate: self.gate.as_ref().map(|g| g.forward(xq)),
            sinks: self.sinks.as_ref().map(|s| s.forward(xq)),
            k_taps: self.k_conv.taps(xk),
            v_taps: self.v_conv.taps(xv),
        }
    }

    /// One sequence's attention from its rows `start..start + n` of the projected stack of
    /// `tokens` rows, its tokens at positions `pos..`: the convolutions continue from the
    /// windows in `kv.state` (updated), keys and values are appended to `kv`. Returns the
    /// rows before the output projection (`[n, heads · head_dim]`).
    pub fn attend_sequence(
        &self,
        rows: &RelRows,
        (start, n, tokens): (usize, usize, usize),
        pos: usize,
        kv: &mut super::cache::LayerKv,
    ) -> Vec<f32> {
        let (h, kvh, hd, dr, ext) = (
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.d_rel,
            self.extent,
        );
        let seg = |v: &[f32]| rows_of(v, start, n, tokens);
        let (mut q, mut k, mut v, mut r) = (seg(&rows.q), seg(&rows.k), seg(&rows.v), seg(&rows.r));
        let (k_state, rest) = kv.state.split_at_mut(self.k_conv.state_len());
        let v_state = &mut rest[..self.v_conv.state_len()];
        self.k_conv
            .forward(&mut k, rows.k_taps.as_deref().map(seg).as_deref(), k_state);
        self.v_conv
            .forward(&mut v, rows.v_taps.as_deref().map(seg).as_deref(), v_state);
        self.q_norm.apply(&mut q, hd);
        self.k_norm.apply(&mut k, hd);
        self.v_norm.apply(&mut v, hd);
        self.r_norm.apply(&mut r, dr);
        let tau: Option<Vec<f32>> = self
            .log_scaling
            .map(|ls| (0..n).map(|t| ls.tau(pos + t)).collect());
        if let Some(tau) = &tau {
            for (t, &tt) in tau.iter().enumerate() {
                q[t * h * hd..(t + 1) * h * hd]
                    .iter_mut()
                    .for_each(|x| *x *= tt);
            }
        }
        let states_scaled = self.log_scaling.is_some_and(|ls| ls.on_states);
        if let (Some(tau), true) = (&tau, states_scaled) {
            for (t, &tt) in tau.iter().enumerate() {
                r[t * h * dr..(t + 1) * h * dr]
                    .iter_mut()
                    .for_each(|x| *x *= tt);
            }
        }
        // The bias profile of every (token, head): `R · proj`, `[n, heads, extent]`.
        let mut rel = vec![0.0f32; n * h * ext];
        for (i, (out, rs)) in rel.chunks_mut(ext).zip(r.chunks(dr)).enumerate() {
            for (e, o) in out.iter_mut().enumerate() {
                let mut acc = 0.0f32;
                for (dd, rv) in rs.iter().enumerate() {
                    acc += rv * self.rel_proj[dd * ext + e];
                }
                *o = match (&tau, states_scaled) {
                    (Some(tau), false) => acc * tau[i / h],
                    _ => acc,
                };
            }
        }
        kv.k.extend(&k);
        kv.v.extend(&v);
        let sinks = rows.sinks.as_deref().map(seg);
        let mut out = attend(
            &q,
            kv,
            AttendShape {
                heads: h,
                kv_heads: kvh,
                head_dim: hd,
                window: self.window,
                scale: self.scale,
                sinks: sinks.as_deref().map(Sinks::PerToken),
                bias: Some(RelBias {
                    profiles: &rel,
                    extent: ext,
                }),
            },
            pos,
            false,
        );
        if let Some(gate) = rows.gate.as_deref().map(seg) {
            for (o, g) in out.iter_mut().zip(&gate) {
                *o *= sigmoid(*g);
            }
        }
        out
    }
}

/// Build an Inkling model.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let cfg = &inkling_config(cfg)?;
    let sc = StandardConfig::read(cfg, ckpt, 1e-6, 10000.0)?;
    let d = sc.hidden_size;
    let geo = Geometry::read(cfg, &sc)?;
    let eps = sc.rms_norm_eps;
    let dense = layer_kinds(
        cfg,
        "mlp_layer_types",
        sc.layers,
        &[("dense", true), ("sparse", false)],
    )?;
    let moe: Vec<bool> = dense.iter().map(|d| !d).collect();
    let experts = super::expert_count(cfg, ckpt, EXPERTS.count)?;
    let top_k = super::experts_per_token(cfg, experts)?;
    let moe_inter = cfg.dim("moe_intermediate_size")?;
    let shared = if moe.contains(&true) {
        cfg.usize_in_or(
            "n_shared_experts",
            1..=ckpt.numbered("shared_experts").max(1),
            "transformers' router takes the shared experts' logits off the end of the gate's, so \
             at least one, and at most the shared experts the checkpoint has",
            2,
        )?
    } else {
        0
    };
    let route_scale = cfg.f64_or("route_scale", 8.0)? as f32;
    let m = &sc.prefix;
    // Every sparse layer's store holds its routed experts, then its shared experts.
    let names = store::expert_table(ckpt, cfg, EXPERTS.count, &moe, experts + shared, |l, e| {
        if e < experts {
            EXPERTS.names(m, l, e)
        } else {
            let s = format!("{}.shared_experts.{}", EXPERTS.block(m, l), e - experts);
            ExpertNames {
                gate: format!("{s}.gate_proj.weight"),
                up: format!("{s}.up_proj.weight"),
                down: format!("{s}.down_proj.weight"),
            }
        }
    })?;
    let store: Arc<dyn ExpertStore> = store::open(ckpt, &names, d, moe_inter, 0, &opts.placement)?;
    let kernel = geo.kernel;
    let mut model = load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        let p = format!("{m}.layers.{l}");
        let sliding = geo.sliding_layers[l];
        let kv_width = if sliding {
            geo.sliding.1 * geo.sliding.2
        } else {
            geo.full.1 * geo.full.2
        };
        let conv = |which: &str| -> Result<KvConv> {
            Ok(KvConv::Short {
                conv: ShortConv::load(
                    ckpt,
                    &[(
                        &format!("{p}.self_attn.{which}_sconv.conv1d.weight"),
                        kv_width,
                    )],
                    kernel,
                )?,
                divisor: 1.0,
            })
        };
        let mut attn = RelAttention::load(
            ckpt,
            &p,
            &HF_ATTN,
            &geo,
            sliding,
            d,
            [conv("k")?, conv("v")?],
        )?;
        let hd = attn.head_dim;
        let norm = |n: &str| RmsNorm::load(ckpt, &format!("{p}.self_attn.{n}.weight"), hd, eps);
        attn.q_norm = HeadNorm::Rms(norm("q_norm")?);
        attn.k_norm = HeadNorm::Rms(norm("k_norm")?);
        attn.log_scaling = match (sliding, geo.n_floor) {
            (false, Some(n_floor)) => Some(LogScaling {
                alpha: geo.alpha as f32,
                n_floor: n_floor as f32,
                on_states: false,
            }),
            _ => None,
        };
        let ffn = if dense[l] {
            let mlp = Mlp::load(
                ckpt,
                &format!("{p}.mlp"),
                d,
                cfg.dim("intermediate_size")?,
                false,
            )?;
            let scale = ckpt.vector_f32(&format!("{p}.mlp.global_scale"), 1)?[0];
            Ffn::ScaledDense { mlp, scale }
        } else {
            let router = EXPERTS.router(m, l);
            let gate = Linear::load(ckpt, &router, experts + shared, d, false)?;
            let global_scale = ckpt.vector_f32(&format!("{router}.global_scale"), 1)?[0];
            let bias = ckpt.vector_f32(&format!("{router}.e_score_correction_bias"), experts)?;
            let router = Router::SharedSink {
                shared,
                route_scale,
                global_scale,
            };
            Ffn::Moe(MoeBlock {
                correction_bias: Some(bias),
                ..MoeBlock::routed(
                    l,
                    gate,
                    router,
                    top_k,
                    experts + shared,
                    moe_inter,
                    store.clone(),
                )
            })
        };
        Ok(LayerParts::own(SelfAttention::Relative(attn), ffn))
    })?;
    for (l, block) in model.blocks.iter_mut().enumerate() {
        let p = format!("{m}.layers.{l}");
        let conv = |name: &str| {
            ShortConv::load(ckpt, &[(&format!("{p}.{name}.conv1d.weight"), d)], kernel)
        };
        block.post_conv = Some(PostConv {
            attn: conv("attn_sconv")?,
            ffn: conv("mlp_sconv")?,
            divisor: 1.0,
        });
    }
    model.embed_norm = Some(RmsNorm::load(
        ckpt,
        &format!("{m}.embed_tokens.embed_norm.weight"),
        d,
        eps,
    )?);
    let unpadded = cfg.opt_dim("unpadded_vocab_size")?;
    model.logits = LogitForm {
        divide: Some(cfg.f64_or("logits_mup_width_multiplier", 24.0)? as f32),
        softcap: None,
        vocab: unpadded,
    };
    finish_info(&mut model, unpadded, experts, shared);
    Ok(model)
}

/// Correct what [`load_standard`]'s info says of an Inkling-family model: the state of its
/// convolutions, the vocabulary its logits cover, and (with `shared` experts run from the
/// store) the routed and shared expert counts and the parameters every token uses.
pub(crate) fn finish_info(
    model: &mut Transformer,
    unpadded: Option<usize>,
    experts: usize,
    shared: usize,
) {
    let info = &mut model.info;
    info.state_bytes_per_sequence = model.blocks.iter().map(|b| 4 * b.state_len()).sum();
    if let Some(v) = unpadded {
        info.vocab_size = info.vocab_size.min(v);
    }
    if shared > 0 {
        info.routed_experts = experts;
        info.shared_experts = shared;
        for b in &model.blocks {
            if let Some(moe) = b.ffn.moe() {
                info.active_params += shared * 3 * moe.gate.weight.shape[1] * moe.intermediate;
            }
        }
    }
}
