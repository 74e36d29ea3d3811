//! GLM-4.5 / 4.6 / 4.7 (`model_type: glm4_moe`): grouped-query attention with q/k/v biases,
//! optional per-head q/k RMSNorm (`use_qk_norm`) and half-split RoPE on the first
//! `partial_rotary_factor` (default 0.5) of each head; DeepSeek's MoE (sigmoid router with a
//! correction bias, groups, scaling, shared experts) after `first_k_dense_replace` dense
//! layers. The MTP block (layer `num_hidden_layers`) is not loaded.

use std::sync::Arc;

use super::deepseek_v3::{DeepseekMoe, EXPERTS};
use super::layers::{QkNorm, RmsNorm};
use super::registry::{boxed_load, Family, Gguf};
use super::transformer::{load_standard, LayerParts, StandardConfig, Transformer};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::Result;

/// GLM-4.5 / 4.6 / 4.7 in the registry (GGUF `glm4moe`).
pub const FAMILY: Family = Family::new(&["glm4_moe"], boxed_load!(load))
    .with_experts(EXPERTS)
    .with_gguf(Gguf::new("glm4moe"));

/// Build a GLM-4 MoE model.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let mut sc = StandardConfig::read(cfg, ckpt, 1e-5, 10000.0)?;
    let given = cfg.get("partial_rotary_factor").is_some()
        || cfg
            .get("rope_parameters")
            .and_then(|p| p.get("partial_rotary_factor"))
            .is_some();
    if !given {
        sc.rope.partial_rotary_factor = 0.5;
    }
    let moe = DeepseekMoe::read(cfg, ckpt, sc.layers)?;
    let names = EXPERTS.table(ckpt, cfg, "model", &moe.is_moe, moe.experts)?;
    let store: Arc<dyn ExpertStore> = store::open(
        ckpt,
        &names,
        sc.hidden_size,
        moe.intermediate,
        0,
        &opts.placement,
    )?;
    let qk_norm = cfg.bool_or("use_qk_norm", false)?;
    let (d, hd) = (sc.hidden_size, sc.head_dim);
    load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        let p = format!("model.layers.{l}");
        let norm = |w: &str| {
            RmsNorm::load(
                ckpt,
                &format!("{p}.self_attn.{w}.weight"),
                hd,
                sc.rms_norm_eps,
            )
        };
        Ok(LayerParts {
            attn: None,
            sinks: None,
            qk_norm: if qk_norm {
                QkNorm::PerHead {
                    q: norm("q_norm")?,
                    k: norm("k_norm")?,
                }
            } else {
                QkNorm::None
            },
            clip_qkv: None,
            window: None,
            ffn: moe.load_ffn(ckpt, cfg, &p, l, d, &store)?,
        })
    })
}
