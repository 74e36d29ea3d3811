//! MiniMax-M2 (`model_type: minimax_m2`; arch doc 2.16): the standard stack with q/k RMSNorm
//! over the whole projected width (all heads jointly, as OLMoE), partial half-split RoPE over
//! the first `partial_rotary_factor` of each head (the hub's legacy `rotary_dim` says the
//! same), and a routed MoE on every layer: `s = sigmoid(logits)`, the top-k of
//! `s + e_score_correction_bias` (the bias lives on the MoE block), the chosen `s`
//! renormalised; no shared expert, no scaling.

use std::sync::Arc;

use super::layers::{Linear, MoeBlock, QkNorm, Router};
use super::registry::{boxed_load, Experts, Family};
use super::transformer::{load_standard, Ffn, LayerParts, StandardConfig, Transformer};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::{Error, Result};

/// Where MiniMax-M2's routed experts are: Mixtral's layout (`block_sparse_moe.experts.{e}`,
/// `w1`/`w3`/`w2`, counted by `num_local_experts`).
pub const EXPERTS: Experts = super::mixtral::EXPERTS;

/// MiniMax-M2 in the registry.
pub const FAMILY: Family = Family::new(&["minimax_m2"], boxed_load!(load))
    .with_normalize(config)
    .with_experts(EXPERTS);

/// The config as transformers reads it: a legacy `rotary_dim` (the released checkpoints')
/// becomes `partial_rotary_factor = rotary_dim / head_dim` when no factor is given.
pub fn config(cfg: &ModelConfig) -> Result<ModelConfig> {
    let mut json = cfg.json().clone();
    let has_factor = ["rope_parameters", "rope_scaling"].iter().any(|k| {
        cfg.get(k)
            .and_then(|r| r.get("partial_rotary_factor"))
            .is_some()
    }) || cfg.get("partial_rotary_factor").is_some();
    if let (Some(rotary_dim), false) = (cfg.opt_usize("rotary_dim")?, has_factor) {
        let head_dim = cfg.dim("head_dim")?;
        if rotary_dim > head_dim {
            return Err(Error::config(
                cfg.path(),
                "rotary_dim",
                format!("is {rotary_dim}, more than head_dim = {head_dim}"),
            ));
        }
        json["partial_rotary_factor"] = (rotary_dim as f64 / head_dim as f64).into();
    }
    Ok(ModelConfig::from_value(cfg.path().to_path_buf(), json))
}

/// Build a MiniMax-M2 model from its checkpoint.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let cfg = &config(cfg)?;
    let sc = StandardConfig::read(cfg, ckpt, 1e-6, 5_000_000.0)?;
    let experts = super::expert_count(cfg, ckpt, EXPERTS.count)?;
    let top_k = super::experts_per_token(cfg, experts)?;
    let inter = cfg.dim("intermediate_size")?;
    let (d, hd) = (sc.hidden_size, sc.head_dim);
    let all = vec![true; sc.layers];
    let names = EXPERTS.table(ckpt, cfg, "model", &all, experts)?;
    let store: Arc<dyn ExpertStore> = store::open(ckpt, &names, d, inter, 0, &opts.placement)?;
    // R4 is the grouped sigmoid router with one group and no scaling (its `Σ + 1e-20` is Σ in
    // f32 for any sum of sigmoids above 1e-12).
    let router = Router::SigmoidGrouped {
        n_group: 1,
        topk_group: 1,
        renormalize: true,
        scaling: 1.0,
    };
    load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        let p = format!("model.layers.{l}");
        let gate = Linear::load(ckpt, &EXPERTS.router("model", l), experts, d, false)?;
        let bias = format!("{}.e_score_correction_bias", EXPERTS.block("model", l));
        let moe = MoeBlock {
            correction_bias: Some(ckpt.vector_f32(&bias, experts)?),
            ..MoeBlock::routed(l, gate, router, top_k, experts, inter, store.clone())
        };
        let norm =
            |n: &str, width: usize| sc.norm(ckpt, &format!("{p}.self_attn.{n}.weight"), width);
        Ok(LayerParts {
            attn: None,
            sinks: None,
            qk_norm: QkNorm::FullWidth {
                q: norm("q_norm", sc.heads * hd)?,
                k: norm("k_norm", sc.kv_heads * hd)?,
            },
            clip_qkv: None,
            window: None,
            ffn: Ffn::Moe(moe),
        })
    })
}
