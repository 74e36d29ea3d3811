//! Qwen3-MoE (`model_type: qwen3_moe`): per-head q/k RMSNorm before RoPE, an optional sliding
//! window on every layer, and a dense/MoE schedule: layer L is MoE iff it is not in
//! `mlp_only_layers` and `(L + 1) % decoder_sparse_step == 0`. Softmax router, top-k,
//! renormalised if `norm_topk_prob`.

use std::sync::Arc;

use super::layers::{Linear, MoeBlock, QkNorm, Router};
use super::registry::{boxed_load, Experts, Family, Gguf};
use super::transformer::{load_standard, Ffn, LayerParts, StandardConfig, Transformer};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::Result;

/// Qwen3-MoE in the registry (GGUF `qwen3moe`).
pub const FAMILY: Family = Family::new(&["qwen3_moe"], boxed_load!(load))
    .with_experts(Experts::QWEN)
    .with_gguf(Gguf::new("qwen3moe"));

/// Build a Qwen3-MoE model from its checkpoint.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let sc = StandardConfig::read(cfg, ckpt, 1e-6, 10000.0)?;
    let experts = cfg.usize_or("num_experts", 0)?;
    let sparse_step = cfg.usize_or("decoder_sparse_step", 1)?.max(1);
    let mlp_only = cfg.usize_list("mlp_only_layers")?;
    let is_moe =
        |l: usize| experts > 0 && !mlp_only.contains(&l) && (l + 1).is_multiple_of(sparse_step);
    let moe: Vec<bool> = (0..sc.layers).map(is_moe).collect();
    // Without MoE layers the expert count and top-k are never used.
    let top_k = if moe.contains(&true) {
        super::expert_count(cfg, ckpt, "num_experts")?;
        super::experts_per_token(cfg, experts)?
    } else {
        cfg.usize("num_experts_per_tok")?
    };
    let moe_inter = cfg.dim("moe_intermediate_size")?;
    let router = Router::SoftmaxTopK {
        renormalize: cfg.bool_or("norm_topk_prob", false)?,
    };
    let window = if cfg.bool_or("use_sliding_window", false)? {
        cfg.opt_usize("sliding_window")?
    } else {
        None
    };
    let (d, hd) = (sc.hidden_size, sc.head_dim);
    let names = Experts::QWEN.table(ckpt, cfg, "model", &moe, experts)?;
    let store: Arc<dyn ExpertStore> = store::open(ckpt, &names, d, moe_inter, 0, &opts.placement)?;
    load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        let p = format!("model.layers.{l}");
        let ffn = if is_moe(l) {
            let gate = Linear::load(ckpt, &format!("{p}.mlp.gate"), experts, d, false)?;
            Ffn::Moe(MoeBlock::routed(
                l,
                gate,
                router,
                top_k,
                experts,
                moe_inter,
                store.clone(),
            ))
        } else {
            Ffn::dense(ckpt, cfg, &p, d)?
        };
        Ok(LayerParts {
            attn: None,
            sinks: None,
            qk_norm: QkNorm::PerHead {
                q: sc.norm(ckpt, &format!("{p}.self_attn.q_norm.weight"), hd)?,
                k: sc.norm(ckpt, &format!("{p}.self_attn.k_norm.weight"), hd)?,
            },
            clip_qkv: None,
            window,
            ffn,
        })
    })
}
