//! OLMoE (`model_type: olmoe`): Llama-style attention with q/k RMSNorm over the whole
//! projected width (all heads jointly) and optional `clip_qkv`; a routed MoE in every layer
//! (softmax router, top-k, renormalised only if `norm_topk_prob`), no shared expert.

use std::sync::Arc;

use super::layers::{Linear, MoeBlock, QkNorm, RmsNorm, Router};
use super::transformer::{load_standard, Ffn, LayerParts, StandardConfig, Transformer};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertNames, ExpertStore};
use crate::Result;

/// Per-expert tensor names of the qwen2_moe layout,
/// `{prefix}.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj`, for the layers whose `moe` entry
/// is set (`prefix` is `model`, or `language_model.model` for Kimi's text model); `experts`
/// is the value of the config's `field`, checked by [`store::expert_table`].
pub fn qwen_style_expert_names(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    field: &str,
    prefix: &str,
    moe: &[bool],
    experts: usize,
) -> Result<Vec<Vec<ExpertNames>>> {
    store::expert_table(ckpt, cfg, field, moe, experts, |l, e| {
        let p = format!("{prefix}.layers.{l}.mlp.experts.{e}");
        ExpertNames {
            gate: format!("{p}.gate_proj.weight"),
            up: format!("{p}.up_proj.weight"),
            down: format!("{p}.down_proj.weight"),
        }
    })
}

/// Build an OLMoE model from its checkpoint.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let sc = StandardConfig::read(cfg, ckpt, 1e-5, 10000.0)?;
    let experts = super::expert_count(cfg, ckpt, "num_experts")?;
    let top_k = super::experts_per_token(cfg, experts)?;
    let inter = cfg.dim("intermediate_size")?;
    let renormalize = cfg.bool_or("norm_topk_prob", false)?;
    let clip_qkv = cfg.opt_f64("clip_qkv")?.map(|c| c as f32);
    let (d, hd) = (sc.hidden_size, sc.head_dim);
    let all = vec![true; sc.layers];
    let names = qwen_style_expert_names(ckpt, cfg, "num_experts", "model", &all, experts)?;
    let store: Arc<dyn ExpertStore> = store::open(ckpt, &names, d, inter, 0, &opts.placement)?;
    load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        let p = format!("model.layers.{l}");
        Ok(LayerParts {
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
            ffn: Ffn::Moe(MoeBlock {
                layer: l,
                gate: Linear::load(ckpt, &format!("{p}.mlp.gate"), experts, d, false)?,
                router: Router::SoftmaxTopK { renormalize },
                top_k,
                num_experts: experts,
                intermediate: inter,
                store: store.clone(),
                correction_bias: None,
                shared: None,
                swiglu_limit: None,
            }),
        })
    })
}
