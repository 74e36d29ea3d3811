//! Inkling 2 (`inkling2_text`, "Inkling-2-Small"; arch doc 2.14): the Inkling family's
//! successor, on Inkling's attention ([`super::inkling::RelAttention`]) with:
//! * block attention residuals ([`BlockResidual`], [`Streams::Blocks`]): every
//!   `n_layers_per_attn_res_block` layers the residual becomes a block state, and each part
//!   reads a learned-query softmax mix of the block states and the current partial sum; a
//!   full-attention layer reads three (its queries', keys' and values' inputs, each with its
//!   own input norm);
//! * on sliding-window layers short convolutions on keys and values scaled by `1/√(K+1)`, on
//!   full layers dynamic convolutions whose taps are projected from the token
//!   ([`DynamicConv`]); both parts' outputs through `(y + conv(y))/√(K+1)` ([`PostConv`]);
//! * L2 clips of queries (learned scale), keys and relative states, values RMS-normalised
//!   without a weight, scale `hd^−½`, per-token attention sinks (`attn_sink_proj`), the heads'
//!   output gated by `sigmoid(gate_attn x)`, and on full layers the log scaling of queries and
//!   relative states by `τ`;
//! * sigmoid top-k routing with a selection-only bias, renormalised and scaled by
//!   `route_scale` (`Router::SigmoidGrouped` with one group), over softcapped-SwiGLU experts
//!   (`GluActivation::Softcapped`), no shared experts and no dense layers;
//! * logits softcapped by `final_logit_softcapping` and cut to `unpadded_vocab_size`.
//!
//! The checkpoint keeps Thinking Machines' names (`model.llm.*`, `attn.wq_du`, experts fused
//! in `w13_weight` with gate and up rows interleaved, split per expert on load), which is
//! also what transformers saves.

use std::sync::Arc;

use super::inkling::{
    fold_aliases, Geometry, HeadNorm, KvConv, LogScaling, RelAttention, TML_ATTN,
};
use super::layers::{GluActivation, Linear, MoeBlock, RmsNorm, Router};
use super::linear_attention::{DynamicConv, ShortConv};
use super::registry::{boxed_load, Experts, Family};
use super::transformer::{
    standard_info, Block, BlockResidual, Ffn, LogitForm, PostConv, Residual, SelfAttention,
    StandardConfig, Streams, Transformer,
};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::fused::FusedExperts;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::Result;

/// The stack's prefix.
const MODEL: &str = "model.llm";

/// Where Inkling 2's routed experts are once split: `model.llm.layers.{L}.mlp.experts.{e}.…`.
pub const EXPERTS: Experts = super::inkling::EXPERTS;

/// Inkling 2's fused experts: `w13_weight` (gate and up rows interleaved) and `w2_weight`.
const FUSED: &[FusedExperts] = &[super::inkling::HUB_W13, super::inkling::HUB_W2];

/// Inkling 2 in the registry.
pub const FAMILY: Family = Family::new(&["inkling2_text"], boxed_load!(load))
    .with_normalize(inkling2_config)
    .with_names(super::registry::StackNames {
        model: MODEL,
        lm_head: "model.llm.unembed",
    })
    .with_experts(EXPERTS)
    .with_fused_experts(FUSED);

/// transformers' `attribute_map` names of Inkling 2's own fields (the other name first),
/// beside the family's ([`super::inkling::FAMILY_ALIASES`]).
const KEY_ALIASES: &[(&str, &str)] = &[
    ("intermediate_size", "moe_intermediate_size"),
    ("routed_scaling_factor", "route_scale"),
];

/// An Inkling 2 config in the form the loader reads, as `Inkling2TextConfig` reads it: the
/// `attribute_map` names under transformers' names and explicit `layer_types` (every 6th
/// layer full attention).
pub fn inkling2_config(cfg: &ModelConfig) -> Result<ModelConfig> {
    let mut json = fold_aliases(cfg, KEY_ALIASES)?;
    let layers = super::inkling::schedule_len(cfg)?;
    let obj = json.as_object_mut().expect("checked by fold_aliases");
    if obj
        .get("layer_types")
        .is_none_or(serde_json::Value::is_null)
    {
        let types = (0..layers)
            .map(|i| {
                serde_json::Value::from(if (i + 1) % 6 == 0 {
                    "hybrid"
                } else {
                    "hybrid_sliding"
                })
            })
            .collect();
        obj.insert("layer_types".into(), serde_json::Value::Array(types));
    }
    Ok(ModelConfig::from_value(cfg.path().to_path_buf(), json))
}

/// Build an Inkling 2 model.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let cfg = &inkling2_config(cfg)?;
    let mut sc = StandardConfig::read(cfg, ckpt, 1e-6, 10000.0)?;
    sc.prefix = MODEL.into();
    let (d, eps) = (sc.hidden_size, sc.rms_norm_eps);
    let geo = Geometry::read(cfg, &sc)?;
    let per_block = cfg.usize_in_or(
        "n_layers_per_attn_res_block",
        1..=sc.layers.max(1),
        "a block of at least one and at most num_hidden_layers layers",
        6,
    )?;
    let scoring = cfg
        .get("scoring_func")
        .and_then(|v| v.as_str())
        .unwrap_or("sigmoid");
    if scoring != "sigmoid" {
        return Err(cfg.error(
            "scoring_func",
            format!("is `{scoring}`; Inkling 2 routes with `sigmoid`"),
        ));
    }
    let qk_clip = cfg.f64_or("qk_l2_clip_threshold", 22.627416997969522)? as f32;
    let rel_clip = cfg.f64_or("rel_l2_clip_threshold", 8.0)? as f32;
    let activation = GluActivation::Softcapped {
        gate: cfg.f64_or("mlp_gate_softcap", 4.0)? as f32,
        up: cfg.f64_or("mlp_up_softcap", 25.0)? as f32,
    };
    let n_floor = cfg.usize_in_or(
        "log_scaling_n_floor",
        1..=usize::MAX,
        "full-attention positions are divided by it",
        128000,
    )?;
    let experts = super::expert_count(cfg, ckpt, EXPERTS.count)?;
    let top_k = super::experts_per_token(cfg, experts)?;
    let moe_inter = cfg.dim("moe_intermediate_size")?;
    let route_scale = cfg.f64_or("route_scale", 8.0)? as f32;
    let moe = vec![true; sc.layers];
    let names = EXPERTS.table(ckpt, cfg, MODEL, &moe, experts)?;
    let unused = super::transformer::Unused::of(ckpt, &[("model.visual.", "the vision tower")]);
    let store: Arc<dyn ExpertStore> =
        store::open(ckpt, &names, d, moe_inter, unused.bytes, &opts.placement)?;
    let kernel = geo.kernel;
    let divisor = ((kernel + 1) as f64).sqrt() as f32;
    let slots = sc.layers.div_ceil(per_block);
    let vector = |name: &str, n: usize| ckpt.vector_f32(&format!("{MODEL}.{name}"), n);
    let mut blocks = Vec::with_capacity(sc.layers);
    for l in 0..sc.layers {
        let p = format!("{MODEL}.layers.{l}");
        let sliding = geo.sliding_layers[l];
        let (h, kvh, hd) = if sliding { geo.sliding } else { geo.full };
        let kv_width = kvh * hd;
        let convs = if sliding {
            let conv = |which: &str| -> Result<KvConv> {
                Ok(KvConv::Short {
                    conv: ShortConv::load(
                        ckpt,
                        &[(&format!("{p}.attn.{which}_sconv.weight"), kv_width)],
                        kernel,
                    )?,
                    divisor,
                })
            };
            [conv("k")?, conv("v")?]
        } else {
            let conv = |which: &str| -> Result<KvConv> {
                Ok(KvConv::Dynamic(DynamicConv::load(
                    ckpt,
                    &format!("{p}.attn.{which}_sconv"),
                    kv_width,
                    kvh,
                    kernel,
                    d,
                )?))
            };
            [conv("k")?, conv("v")?]
        };
        let mut attn = RelAttention::load(ckpt, &p, &TML_ATTN, &geo, sliding, d, convs)?;
        let lin =
            |name: &str, out: usize| Linear::load(ckpt, &format!("{p}.attn.{name}"), out, d, false);
        attn.gate = Some(lin("gate_attn", h * hd)?);
        attn.sinks = Some(lin("attn_sink_proj", h)?);
        attn.scale = (hd as f64).powf(-0.5) as f32;
        let clip_scale = |name: &str, width: usize| {
            ckpt.weight(&format!("{p}.attn.{name}.scale"), &[h, width])?
                .to_f32_vec()
        };
        attn.q_norm = HeadNorm::Clip {
            scale: Some(clip_scale("q_l2_clip", hd)?),
            threshold: qk_clip,
        };
        attn.k_norm = HeadNorm::Clip {
            scale: None,
            threshold: qk_clip,
        };
        attn.v_norm = HeadNorm::Unit { eps: eps as f32 };
        attn.r_norm = HeadNorm::Clip {
            scale: Some(clip_scale("rel_l2_clip", geo.d_rel)?),
            threshold: rel_clip,
        };
        let norm = |name: &str| RmsNorm::load(ckpt, &format!("{p}.{name}.weight"), d, eps);
        let (attn_norm, inputs) = if sliding {
            (norm("attn_norm")?, 1)
        } else {
            attn.log_scaling = Some(LogScaling {
                alpha: geo.alpha as f32,
                n_floor: n_floor as f32,
                on_states: true,
            });
            attn.input_norms = Some([
                norm("q_input_norm")?.weight,
                norm("k_input_norm")?.weight,
                norm("v_input_norm")?.weight,
            ]);
            // Each of the three inputs is normalised by the block's norm, its own weight
            // applied inside the attention.
            let unit = RmsNorm {
                weight: vec![1.0; d],
                eps: eps as f32,
            };
            (unit, 3)
        };
        let gate = Linear::load(ckpt, &EXPERTS.router(MODEL, l), experts, d, false)?;
        let router = Router::SigmoidGrouped {
            n_group: 1,
            topk_group: 1,
            renormalize: true,
            scaling: route_scale,
        };
        let ffn = Ffn::Moe(MoeBlock {
            correction_bias: Some(ckpt.vector_f32(&format!("{p}.mlp.gate.bias"), experts)?),
            activation,
            ..MoeBlock::routed(l, gate, router, top_k, experts, moe_inter, store.clone())
        });
        // Layer L's queries are `attn_queries.{L − 1}`: `[D]`, or `[3, D]` on full layers.
        let attn_queries = (l > 0)
            .then(|| {
                let name = format!("{MODEL}.attn_res.attn_queries.{}", l - 1);
                match inputs {
                    1 => ckpt.vector_f32(&name, d),
                    n => ckpt.weight(&name, &[n, d])?.to_f32_vec(),
                }
            })
            .transpose()?;
        let conv =
            |name: &str| ShortConv::load(ckpt, &[(&format!("{p}.{name}.weight"), d)], kernel);
        blocks.push(Block {
            attn_norm,
            attn: SelfAttention::Relative(attn),
            ffn_norm: norm("mlp_norm")?,
            ffn,
            residual: Residual::Blocks(BlockResidual {
                attn_queries,
                attn_inputs: inputs,
                ffn_query: vector(&format!("attn_res.mlp_queries.{l}"), d)?,
                blocks: l.div_ceil(per_block),
                boundary: l % per_block == 0,
                slots,
            }),
            post_conv: Some(PostConv {
                attn: conv("attn_sconv")?,
                ffn: conv("mlp_sconv")?,
                divisor,
            }),
        });
    }
    let embed = ckpt.weight(&format!("{MODEL}.embed.weight"), &[sc.vocab_size, d])?;
    let lm_head = Linear::load(ckpt, FAMILY.names.lm_head, sc.vocab_size, d, false)?;
    let mut info = standard_info(ckpt, cfg, &sc, &blocks, Some(store.as_ref()))?;
    let unpadded = cfg.dim_or("unpadded_vocab_size", 200058)?;
    info.vocab_size = info.vocab_size.min(unpadded);
    unused.apply(&mut info);
    Ok(Transformer {
        embed,
        blocks,
        norm: RmsNorm::load(ckpt, &format!("{MODEL}.norm.weight"), d, eps)?,
        lm_head,
        info,
        store: Some(store),
        mtp: None,
        streams: Streams::Blocks {
            slots,
            query: vector("attn_res.output_query", d)?,
        },
        embed_norm: Some(RmsNorm::load(
            ckpt,
            &format!("{MODEL}.embed_norm.weight"),
            d,
            eps,
        )?),
        logits: LogitForm {
            divide: None,
            softcap: Some(cfg.f64_or("final_logit_softcapping", 30.0)? as f32),
            vocab: Some(unpadded),
        },
    })
}
