//! GLM-5-next (`glm5_next`, its text model `glm5_next_text`; arch doc 2.12, "GLM-5.3-Flash"):
//! a hybrid whose `layer_types` interleave Kimi Delta Attention
//! ([`super::kimi_linear::kda`], with the decay's `linear_lower_bound`) with NoPE MLA behind a
//! k-pool DSA indexer ([`super::mla::KPool`]: tokens grouped into pools of `index_kpool`, each
//! query attends to the tokens of the best `index_topk / index_kpool` complete pools it sees
//! plus the visible tail of the pool it is in; "shared" indexer layers reuse the pick of the
//! indexed layer right before). The residual is `hc_mult` manifold-constrained
//! hyper-connection streams ([`Residual::Hyper`]), collapsed by their plain mean before the
//! final norm ([`Streams::HyperMean`]). Every SwiGLU (dense MLP, shared and routed experts)
//! is clamped at `swiglu_limit`; the router is DeepSeek's sigmoid router with a correction
//! bias. No RoPE anywhere. A hub checkpoint keeps the text model under
//! `model.language_model.` with its config in `text_config`; the vision tower
//! (`model.visual.*`) is not loaded, and `coli info` says so.

use std::sync::Arc;

use serde_json::Value;

use super::deepseek_v3::{DeepseekMoe, MlaShape, EXPERTS};
use super::glm_moe_dsa::indexer_types;
use super::kimi_linear::{first_dense, fold_linear_attn_config, kda, KdaDims};
use super::layers::{HyperConnection, Linear, Rope};
use super::mla::{Indexer, KPool, LayerNorm, Sparse};
use super::qwen3_next::{linear_layers, text_model_config};
use super::registry::{boxed_load, Abilities, Family};
use super::transformer::{
    load_standard, LayerParts, Residual, SelfAttention, StandardConfig, Streams, Transformer,
    Unused,
};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::{Error, Result};

/// GLM-5-next in the registry: the hub's vision-language `model_type` (whose `text_config`
/// holds the text model's) and the text model's own.
pub const FAMILY: Family = Family::new(&["glm5_next", "glm5_next_text"], boxed_load!(load))
    .with_abilities(Abilities {
        latent_attention: true,
        mtp: false,
    })
    .with_normalize(glm5_next_config)
    .with_experts(EXPERTS);

/// The text model's configuration in the form the loader reads, as `Glm5NextTextConfig`
/// reads it: `text_config` (or the flat config), `linear_attn_config` folded into the
/// `linear_*` keys (its `gate_lower_bound`, and `safe_gate` meaning a bound of −5 when none is
/// set), `linear_lower_bound` −5 when absent (an explicit `null` means no bound),
/// `layer_types` explicit (KDA but every 4th layer from layer 3) with "indexed_attention"
/// written as "full_attention", `mlp_layer_types` explicit (the first 3 dense), and
/// `head_dim` dropped (transformers overrides it with the rope dimension, 0).
pub fn glm5_next_config(cfg: &ModelConfig) -> Result<ModelConfig> {
    let text = text_model_config(cfg)?;
    let layers = text.usize("num_hidden_layers")?;
    let mut json = text.json().clone();
    let obj = json
        .as_object_mut()
        .ok_or_else(|| Error::config(text.path(), "text_config", "is not a JSON object"))?;
    obj.remove("head_dim");
    if !obj.contains_key("linear_lower_bound") {
        obj.insert("linear_lower_bound".into(), Value::from(-5.0));
    }
    if let Some(lc) = text.get("linear_attn_config").cloned() {
        fold_linear_attn_config(obj, &lc);
        if let Some(bound) = lc.get("gate_lower_bound") {
            obj.insert("linear_lower_bound".into(), bound.clone());
        }
        let safe = lc.get("safe_gate").and_then(Value::as_bool).unwrap_or(true);
        if safe && obj.get("linear_lower_bound").is_none_or(Value::is_null) {
            obj.insert("linear_lower_bound".into(), Value::from(-5.0));
        }
    }
    let types: Vec<Value> = match obj.get("layer_types").and_then(Value::as_array) {
        Some(list) => list
            .iter()
            .map(|t| match t.as_str() {
                Some("indexed_attention") => Value::from("full_attention"),
                _ => t.clone(),
            })
            .collect(),
        None => super::kimi_linear::layer_types_where(layers, |i| i % 4 == 3),
    };
    obj.insert("layer_types".into(), Value::Array(types));
    if obj.get("mlp_layer_types").is_none_or(Value::is_null) {
        obj.insert("mlp_layer_types".into(), first_dense(layers, 3));
    }
    Ok(ModelConfig::from_value(text.path().to_path_buf(), json))
}

/// Build a GLM-5-next model.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let model_type = cfg.model_type()?;
    let cfg = &glm5_next_config(cfg)?;
    let mut sc = StandardConfig::read(cfg, ckpt, 1e-5, 10000.0)?;
    if ckpt.contains("model.language_model.embed_tokens.weight") {
        sc.prefix = "model.language_model".into();
    }
    let (d, eps) = (sc.hidden_size, sc.rms_norm_eps);
    let linear = linear_layers(cfg, sc.layers)?;
    let full = indexer_types(cfg, sc.layers)?;
    let dims = KdaDims::read(cfg)?;
    let lower_bound = cfg.opt_f64("linear_lower_bound")?.map(|b| b as f32);
    let shape = MlaShape::read(cfg)?;
    if shape.rope_dim != 0 || shape.q_lora.is_none() {
        return Err(Error::config(
            cfg.path(),
            "qk_rope_head_dim",
            "GLM-5-next's attention is NoPE with a query latent: qk_rope_head_dim must be 0 \
             and q_lora_rank set",
        ));
    }
    let scale = (shape.nope as f64).powf(-0.5) as f32;
    let index_heads = cfg.dim("index_n_heads")?;
    let index_dim = cfg.dim("index_head_dim")?;
    let top_k = cfg.usize("index_topk")?;
    let kpool = cfg.dim("index_kpool")?;
    if top_k == 0 || !top_k.is_multiple_of(kpool) {
        return Err(Error::config(
            cfg.path(),
            "index_topk",
            format!("is {top_k}; it must be a positive multiple of index_kpool = {kpool}"),
        ));
    }
    let tail = cfg.bool_or("index_kpool_always_select_tail", true)?;
    let hc = cfg.dim("hc_mult")?;
    let hc_iters = cfg.dim("hc_sinkhorn_iters")?;
    let hc_eps = cfg.f64_or("hc_eps", 1e-6)? as f32;
    let mut moe = DeepseekMoe::read(cfg, ckpt, sc.layers)?;
    moe.swiglu_limit = Some(cfg.f64_or("swiglu_limit", 10.0)? as f32);
    let m = sc.prefix.clone();
    let unused = Unused::of(ckpt, &[("model.visual.", "the vision tower")]);
    let names = EXPERTS.table(ckpt, cfg, &m, &moe.is_moe, moe.experts)?;
    let store: Arc<dyn ExpertStore> = store::open(
        ckpt,
        &names,
        d,
        moe.intermediate,
        unused.bytes,
        &opts.placement,
    )?;
    let q_lora = shape.q_lora.unwrap_or_default();
    let mut model = load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        let p = format!("{m}.layers.{l}");
        let attn = if linear[l] {
            SelfAttention::Linear(kda(ckpt, &p, &dims, d, eps, lower_bound)?)
        } else {
            let sparse = if full[l] {
                let ix = format!("{p}.self_attn.indexer");
                let lin = |name: &str, rows: usize, cols: usize| {
                    Linear::load(ckpt, &format!("{ix}.{name}"), rows, cols, false)
                };
                Sparse::Own {
                    indexer: Box::new(Indexer {
                        wq_b: lin("wq_b", index_heads * index_dim, q_lora)?,
                        wk: lin("wk", index_dim, d)?,
                        k_norm: LayerNorm {
                            weight: ckpt.vector_f32(&format!("{ix}.k_norm.weight"), index_dim)?,
                            bias: ckpt.vector_f32(&format!("{ix}.k_norm.bias"), index_dim)?,
                            eps: 1e-6,
                        },
                        weights_proj: lin("weights_proj", index_heads, d)?,
                        heads: index_heads,
                        head_dim: index_dim,
                        rope_dim: 0,
                        kpool: Some(KPool {
                            size: kpool,
                            ape: ckpt
                                .weight(
                                    &format!("{ix}.index_kpool_compress_ape"),
                                    &[kpool, index_dim],
                                )?
                                .to_f32_vec()?,
                            gate: Linear::from_tensor(ckpt.weight(
                                &format!("{ix}.index_kpool_compress_gate"),
                                &[index_dim, d],
                            )?),
                            tail,
                        }),
                    }),
                    top_k,
                }
            } else if l > 0 && !linear[l - 1] && full[l - 1] {
                Sparse::Shared
            } else {
                return Err(Error::config(
                    cfg.path(),
                    "indexer_types",
                    format!(
                        "layer {l} is \"shared\" but layer {} is not an indexed layer with its \
                         own indexer to share with",
                        l.saturating_sub(1)
                    ),
                ));
            };
            // The latent norms use rms_norm_eps here.
            SelfAttention::Mla(shape.load(ckpt, &p, d, Rope::none(), scale, eps, sparse, opts)?)
        };
        Ok(LayerParts::own(
            attn,
            moe.load_ffn(ckpt, cfg, &p, l, d, &store)?,
        ))
    })?;
    for (l, block) in model.blocks.iter_mut().enumerate() {
        let hyper = |part: &str| {
            let prefix = format!("{m}.layers.{l}.hc_{part}");
            HyperConnection::load(ckpt, &prefix, hc, d, hc_iters, hc_eps, eps as f32)
        };
        block.residual = Residual::Hyper {
            attn: hyper("attn")?,
            ffn: hyper("ffn")?,
        };
    }
    model.streams = Streams::HyperMean(hc);
    unused.apply(&mut model.info);
    model.info.model_type = model_type;
    Ok(model)
}
