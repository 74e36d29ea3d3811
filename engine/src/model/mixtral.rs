//! Mixtral (`model_type: mixtral`): Llama attention (with an optional sliding window on every
//! layer) and a routed MoE in every layer: softmax router, top-k, always renormalised;
//! experts stored per expert as `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down).

use std::sync::Arc;

use super::experts_per_token;
use super::layers::{Linear, MoeBlock, QkNorm, Router};
use super::registry::{boxed_load, Experts, Family, Gguf, GgufReads};
use super::transformer::{load_standard, Ffn, LayerParts, StandardConfig, Transformer};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::Result;

/// Where Mixtral's experts are: `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2`
/// (down), counted by `num_local_experts`.
pub const EXPERTS: Experts = Experts {
    count: "num_local_experts",
    block: "block_sparse_moe",
    matrices: ["w1", "w3", "w2"],
};

/// Mixtral in the registry; llama.cpp writes it as `llama` (with experts, Q/K permuted).
pub const FAMILY: Family = Family::new(&["mixtral"], boxed_load!(load))
    .with_experts(EXPERTS)
    .with_gguf(
        Gguf::new("llama")
            .reading(GgufReads::WithExperts)
            .permuted(),
    );

/// Build a Mixtral model from its checkpoint.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let sc = StandardConfig::read(cfg, ckpt, 1e-5, 1e6)?;
    let experts = super::expert_count(cfg, ckpt, EXPERTS.count)?;
    let top_k = experts_per_token(cfg, experts)?;
    let inter = cfg.dim("intermediate_size")?;
    let window = cfg.opt_usize("sliding_window")?;
    let d = sc.hidden_size;
    let all = vec![true; sc.layers];
    let names = EXPERTS.table(ckpt, cfg, "model", &all, experts)?;
    let store: Arc<dyn ExpertStore> = store::open(ckpt, &names, d, inter, 0, &opts.placement)?;
    load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        Ok(LayerParts {
            attn: None,
            sinks: None,
            qk_norm: QkNorm::None,
            clip_qkv: None,
            window,
            ffn: Ffn::Moe(MoeBlock::routed(
                l,
                Linear::load(ckpt, &EXPERTS.router("model", l), experts, d, false)?,
                Router::SoftmaxTopK { renormalize: true },
                top_k,
                experts,
                inter,
                store.clone(),
            )),
        })
    })
}
