//! Qwen3-Next (`qwen3_next`) and Qwen3.5/3.6 MoE (`qwen3_5_moe`, its text model
//! `qwen3_5_moe_text`; arch doc 2.5, 2.6): hybrids whose `layer_types` interleave Gated
//! DeltaNet linear attention ([`super::linear_attention`]) with gated softmax attention (a
//! per-head sigmoid gate on the output, per-head q/k norms, partial RoPE over the first
//! `partial_rotary_factor` of each head). Every RMSNorm but the DeltaNet's gated one is
//! zero-centred (`1 + w`). Every sparse layer is a softmax top-k MoE plus a shared expert
//! scaled by `sigmoid(shared_expert_gate · x)`.
//!
//! The two differ in the DeltaNet's projections: Qwen3-Next groups `in_proj_qkvz`/`in_proj_ba`
//! per key head, Qwen3.5 splits them into `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
//! `in_proj_a`; Qwen3.5 always renormalises its top-k and has no dense layers. Qwen3.5's
//! multimodal RoPE reduces to partial RoPE for text. A hub (vision-language) checkpoint keeps
//! the text model under `model.language_model.` with its config in `text_config`; the vision
//! tower (`model.visual.*`) and the multi-token-prediction layers (`mtp.*`) are not loaded,
//! and `coli info` says so.

use std::sync::Arc;

use super::layers::{Linear, Mlp, MoeBlock, QkNorm, Router};
use super::linear_attention::{Decay, GateAct, L2Norm, LinearAttention, Projection, ShortConv};
use super::registry::{boxed_load, Experts, Family};
use super::transformer::{
    load_standard, Ffn, LayerParts, SelfAttention, StandardConfig, Transformer, Unused,
};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::{Error, Result};

/// Qwen3-Next in the registry.
pub const QWEN3_NEXT: Family =
    Family::new(&["qwen3_next"], boxed_load!(load)).with_experts(Experts::QWEN);

/// Qwen3.5/3.6 MoE in the registry: the text model's `model_type` and the hub's
/// vision-language one (whose `text_config` holds the text model's).
pub const QWEN3_5_MOE: Family =
    Family::new(&["qwen3_5_moe_text", "qwen3_5_moe"], boxed_load!(load))
        .with_experts(Experts::QWEN)
        .with_normalize(text_model_config);

/// The text model's configuration: `text_config` of a vision-language config, else the
/// config itself.
pub fn text_model_config(cfg: &ModelConfig) -> Result<ModelConfig> {
    if cfg.get("text_config").is_some() {
        super::unwrap_text_config(cfg, false, "the text model")
    } else {
        Ok(cfg.clone())
    }
}

/// The linear-attention geometry of a config (`linear_*` keys).
struct DeltaNetDims {
    kernel: usize,
    k_heads: usize,
    v_heads: usize,
    dk: usize,
    dv: usize,
}

impl DeltaNetDims {
    fn read(cfg: &ModelConfig) -> Result<DeltaNetDims> {
        let dims = DeltaNetDims {
            kernel: cfg.usize_in_or(
                "linear_conv_kernel_dim",
                1..=64,
                "a short convolution of 1 to 64 taps",
                4,
            )?,
            k_heads: cfg.dim("linear_num_key_heads")?,
            v_heads: cfg.dim("linear_num_value_heads")?,
            dk: cfg.dim("linear_key_head_dim")?,
            dv: cfg.dim("linear_value_head_dim")?,
        };
        if !dims.v_heads.is_multiple_of(dims.k_heads) {
            return Err(Error::config(
                cfg.path(),
                "linear_num_value_heads",
                format!(
                    "{} is not a multiple of linear_num_key_heads = {} (each key head serves a whole number of value heads)",
                    dims.v_heads, dims.k_heads
                ),
            ));
        }
        Ok(dims)
    }
}

/// Which layers are linear attention: `layer_types`, else every layer but each
/// `full_attention_interval`-th.
pub fn linear_layers(cfg: &ModelConfig, layers: usize) -> Result<Vec<bool>> {
    if let Some(kinds) = cfg.layer_kinds(
        "layer_types",
        layers,
        &["full_attention", "linear_attention"],
    )? {
        return Ok(kinds.into_iter().map(|k| k == 1).collect());
    }
    let interval = cfg.usize_in_or(
        "full_attention_interval",
        1..=layers.max(1),
        "every n-th layer is full attention",
        4,
    )?;
    Ok((0..layers)
        .map(|l| !(l + 1).is_multiple_of(interval))
        .collect())
}

/// Build a Qwen3-Next or Qwen3.5/3.6 MoE model.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let model_type = cfg.model_type()?;
    let cfg = &text_model_config(cfg)?;
    let split = model_type.starts_with("qwen3_5");
    let mut sc = StandardConfig::read(cfg, ckpt, 1e-6, 10000.0)?;
    if ckpt.contains("model.language_model.embed_tokens.weight") {
        sc.prefix = "model.language_model".into();
    }
    sc.zero_centred_norms = true;
    sc.output_gate = true;
    let (d, hd) = (sc.hidden_size, sc.head_dim);
    let linear = linear_layers(cfg, sc.layers)?;
    let dims = DeltaNetDims::read(cfg)?;

    let experts = super::expert_count(cfg, ckpt, "num_experts")?;
    let top_k = super::experts_per_token(cfg, experts)?;
    let moe_inter = cfg.dim("moe_intermediate_size")?;
    let shared_inter = cfg.usize_or("shared_expert_intermediate_size", 0)?;
    let (renormalize, moe) = if split {
        (true, vec![true; sc.layers])
    } else {
        let sparse_step = cfg.usize_or("decoder_sparse_step", 1)?.max(1);
        let mlp_only = cfg.usize_list("mlp_only_layers")?;
        let moe = (0..sc.layers)
            .map(|l| !mlp_only.contains(&l) && (l + 1).is_multiple_of(sparse_step))
            .collect();
        (cfg.bool_or("norm_topk_prob", true)?, moe)
    };
    let router = Router::SoftmaxTopK { renormalize };
    let m = sc.prefix.clone();
    let unused = Unused::of(
        ckpt,
        &[
            ("model.visual.", "the vision tower"),
            ("mtp.", "the multi-token-prediction layers (not run: --draft mtp needs a DeepSeek-style head)"),
        ],
    );
    let names = Experts::QWEN.table(ckpt, cfg, &m, &moe, experts)?;
    let store: Arc<dyn ExpertStore> =
        store::open(ckpt, &names, d, moe_inter, unused.bytes, &opts.placement)?;
    let mut model = load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        let p = format!("{m}.layers.{l}");
        let ffn = if moe[l] {
            let shared = (shared_inter > 0)
                .then(|| {
                    Mlp::load(
                        ckpt,
                        &format!("{p}.mlp.shared_expert"),
                        d,
                        shared_inter,
                        false,
                    )
                })
                .transpose()?;
            let shared_gate = shared
                .is_some()
                .then(|| Linear::load(ckpt, &format!("{p}.mlp.shared_expert_gate"), 1, d, false))
                .transpose()?;
            let gate = Linear::load(ckpt, &Experts::QWEN.router(&m, l), experts, d, false)?;
            Ffn::Moe(MoeBlock {
                shared,
                shared_gate,
                ..MoeBlock::routed(l, gate, router, top_k, experts, moe_inter, store.clone())
            })
        } else {
            Ffn::dense(ckpt, cfg, &p, d)?
        };
        let (attn, qk_norm) = if linear[l] {
            let la = delta_net(ckpt, &p, &dims, split, d, sc.rms_norm_eps)?;
            (Some(SelfAttention::Linear(la)), QkNorm::None)
        } else {
            let norm = |n: &str| sc.norm(ckpt, &format!("{p}.self_attn.{n}.weight"), hd);
            let qk_norm = QkNorm::PerHead {
                q: norm("q_norm")?,
                k: norm("k_norm")?,
            };
            (None, qk_norm)
        };
        Ok(LayerParts {
            attn,
            qk_norm,
            clip_qkv: None,
            window: None,
            sinks: None,
            ffn,
        })
    })?;
    unused.apply(&mut model.info);
    model.info.model_type = model_type;
    Ok(model)
}

/// Layer `p`'s Gated DeltaNet (`{p}.linear_attn.*`).
fn delta_net(
    ckpt: &Checkpoint,
    p: &str,
    dims: &DeltaNetDims,
    split: bool,
    d: usize,
    eps: f64,
) -> Result<LinearAttention> {
    let la = format!("{p}.linear_attn");
    let (nk, nv, dk, dv) = (dims.k_heads, dims.v_heads, dims.dk, dims.dv);
    let channels = 2 * nk * dk + nv * dv;
    let lin = |name: &str, rows: usize| Linear::load(ckpt, &format!("{la}.{name}"), rows, d, false);
    let projection = if split {
        Projection::Split {
            qkv: lin("in_proj_qkv", channels)?,
            z: lin("in_proj_z", nv * dv)?,
            b: lin("in_proj_b", nv)?,
            a: lin("in_proj_a", nv)?,
        }
    } else {
        Projection::Grouped {
            qkvz: lin("in_proj_qkvz", channels + nv * dv)?,
            ba: lin("in_proj_ba", 2 * nv)?,
        }
    };
    let a_log = ckpt.vector_f32(&format!("{la}.A_log"), nv)?;
    Ok(LinearAttention {
        projection,
        conv: ShortConv::load(
            ckpt,
            &[(&format!("{la}.conv1d.weight"), channels)],
            dims.kernel,
        )?,
        decay: Decay::PerHead {
            neg_a: a_log.iter().map(|a| -a.exp()).collect(),
            dt_bias: ckpt.vector_f32(&format!("{la}.dt_bias"), nv)?,
        },
        l2: L2Norm::Rsqrt,
        k_heads: nk,
        heads: nv,
        dk,
        dv,
        norm_weight: ckpt.vector_f32(&format!("{la}.norm.weight"), dv)?,
        norm_eps: eps as f32,
        gate_act: GateAct::Silu,
        out: Linear::load(ckpt, &format!("{la}.out_proj"), d, nv * dv, false)?,
    })
}
