//! OLMoE (`model_type: olmoe`): Llama-style attention with q/k RMSNorm over the whole
//! projected width (all heads jointly) and optional `clip_qkv`; a routed MoE in every layer
//! (softmax router, top-k, renormalised only if `norm_topk_prob`), no shared expert.

use std::sync::Arc;

use super::layers::{Linear, MoeBlock, QkNorm, RmsNorm, Router};
use super::registry::{boxed_load, Experts, Family, Gguf};
use super::transformer::{load_standard, Ffn, LayerParts, StandardConfig, Transformer};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::Result;

/// OLMoE in the registry (GGUF `olmoe`).
pub const FAMILY: Family = Family::new(&["olmoe"], boxed_load!(load))
    .with_experts(Experts::QWEN)
    .with_gguf(Gguf::new("olmoe"));

/// Build an OLMoE model from its checkpoint.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let sc = StandardConfig::read(cfg, ckpt, 1e-5, 10000.0)?;
    let experts = super::expert_count(cfg, ckpt, Experts::QWEN.count)?;
    let top_k = super::experts_per_token(cfg, experts)?;
    let inter = cfg.dim("intermediate_size")?;
    let renormalize = cfg.bool_or("norm_topk_prob", false)?;
    let clip_qkv = cfg.opt_f64("clip_qkv")?.map(|c| c as f32);
    let (d, hd) = (sc.hidden_size, sc.head_dim);
    let all = vec![true; sc.layers];
    let names = Experts::QWEN.table(ckpt, cfg, "model", &all, experts)?;
    let store: Arc<dyn ExpertStore> = store::open(ckpt, &names, d, inter, 0, &opts.placement)?;
    load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        let p = format!("model.layers.{l}");
        Ok(LayerParts {
            attn: None,
            sinks: None,
            qk_norm: QkNorm::FullWidth {
                q: RmsNorm::load(
                    ckpt,
                    &format!("{p}.self_attn.q_norm.weight"),
                    sc.heads * hd,
                    sc.rms_norm_eps,
                )?,
                k: RmsNorm::load(
                    ckpt,
                    &format!("{p}.self_attn.k_norm.weight"),
                    sc.kv_heads * hd,
                    sc.rms_norm_eps,
                )?,
            },
            clip_qkv,
            window: None,
            ffn: Ffn::Moe(MoeBlock::routed(
                l,
                Linear::load(ckpt, &Experts::QWEN.router("model", l), experts, d, false)?,
                Router::SoftmaxTopK { renormalize },
                top_k,
                experts,
                inter,
                store.clone(),
            )),
        })
    })
}
