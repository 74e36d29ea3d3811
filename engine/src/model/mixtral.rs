//! Mixtral (`model_type: mixtral`): Llama attention (with an optional sliding window on every
//! layer) and a routed MoE in every layer: softmax router, top-k, always renormalised;
//! experts stored per expert as `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down).

use std::sync::Arc;

use super::experts_per_token;
use super::layers::{Linear, MoeBlock, QkNorm, Router};
use super::transformer::{load_standard, Ffn, LayerParts, StandardConfig, Transformer};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertNames, ExpertStore};
use crate::Result;

/// Build a Mixtral model from its checkpoint.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let sc = StandardConfig::read(cfg, ckpt, 1e-5, 1e6)?;
    let experts = super::expert_count(cfg, ckpt, "num_local_experts")?;
    let top_k = experts_per_token(cfg, experts)?;
    let inter = cfg.dim("intermediate_size")?;
    let window = cfg.opt_usize("sliding_window")?;
    let d = sc.hidden_size;
    let all = vec![true; sc.layers];
    let names = store::expert_table(ckpt, cfg, "num_local_experts", &all, experts, |l, e| {
        let p = format!("model.layers.{l}.block_sparse_moe.experts.{e}");
        ExpertNames {
            gate: format!("{p}.w1.weight"),
            up: format!("{p}.w3.weight"),
            down: format!("{p}.w2.weight"),
        }
    })?;
    let store: Arc<dyn ExpertStore> = store::open(ckpt, &names, d, inter, 0, &opts.placement)?;
    load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        Ok(LayerParts {
            qk_norm: QkNorm::None,
            clip_qkv: None,
            window,
            ffn: Ffn::Moe(MoeBlock {
                layer: l,
                gate: Linear::load(
                    ckpt,
                    &format!("model.layers.{l}.block_sparse_moe.gate"),
                    experts,
                    d,
                    false,
                )?,
                router: Router::SoftmaxTopK { renormalize: true },
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
