//! GLM-5 (`model_type: glm_moe_dsa`, GLM-5.2): DeepSeek-V3's MLA and MoE ([`super::deepseek_v3`])
//! plus DeepSeek sparse attention. Each layer is a "full" indexer layer (its lightning
//! indexer picks the `index_topk` keys every query attends to) or a "shared" one (it reuses
//! the pick of the layer before). `indexer_types` comes from the config, else from
//! `index_topk_pattern` ("F"/"S" per layer), else from `index_topk_freq` and
//! `index_skip_topk_offset` (layer `i` is full iff `max(i − offset + 1, 0) % freq == 0`).
//! The RoPE of the attention and the indexer is interleaved; the MTP block (layer
//! `num_hidden_layers`) is not loaded.

use super::deepseek_v3::{load_mla_stack, EXPERTS};
use super::layers::Linear;
use super::mla::{Indexer, LayerNorm, Sparse};
use super::registry::{boxed_load, Abilities, Family, StackNames};
use super::transformer::Transformer;
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::{Error, Result};

/// GLM-5 in the registry; llama.cpp has no layout for it.
pub const FAMILY: Family = Family::new(&["glm_moe_dsa"], boxed_load!(load))
    .with_abilities(Abilities::LATENT_ATTENTION_AND_MTP)
    .with_experts(EXPERTS);

/// Whether each layer runs its own indexer (`true`) or shares the previous pick.
pub fn indexer_types(cfg: &ModelConfig, layers: usize) -> Result<Vec<bool>> {
    let parse = |v: &str| match v {
        "full" | "F" => Ok(true),
        "shared" | "S" => Ok(false),
        other => Err(Error::config(
            cfg.path(),
            "indexer_types",
            format!("unknown entry `{other}` (expected \"full\" or \"shared\")"),
        )),
    };
    let types: Vec<bool> = if let Some(list) = cfg.get("indexer_types").and_then(|v| v.as_array()) {
        list.iter()
            .map(|v| parse(v.as_str().unwrap_or("?")))
            .collect::<Result<_>>()?
    } else if let Some(p) = cfg.get("index_topk_pattern").and_then(|v| v.as_str()) {
        p.chars()
            .map(|c| parse(&c.to_string()))
            .collect::<Result<_>>()?
    } else {
        let freq = cfg.usize_or("index_topk_freq", 1)?.max(1);
        let offset = cfg.usize_or("index_skip_topk_offset", 2)?;
        (0..layers)
            .map(|i| (i + 1).saturating_sub(offset).is_multiple_of(freq))
            .collect()
    };
    if types.len() != layers {
        return Err(Error::config(
            cfg.path(),
            "indexer_types",
            format!("has {} entries for {layers} layers", types.len()),
        ));
    }
    if types.first() == Some(&false) {
        return Err(Error::config(
            cfg.path(),
            "indexer_types",
            "layer 0 is \"shared\" but there is no earlier indexer layer to share with",
        ));
    }
    Ok(types)
}

/// Build a GLM-5 model.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let layers = super::layer_count(cfg, ckpt)?;
    let full = indexer_types(cfg, layers)?;
    let d = cfg.dim("hidden_size")?;
    let q_lora = cfg.dim("q_lora_rank")?;
    let heads = cfg.dim("index_n_heads")?;
    let head_dim = cfg.dim("index_head_dim")?;
    let rope_dim = cfg.dim("qk_rope_head_dim")?;
    let top_k = cfg.usize("index_topk")?;
    if rope_dim > head_dim || top_k == 0 {
        return Err(Error::config(
            cfg.path(),
            "index_head_dim",
            format!(
                "the indexer needs index_head_dim ({head_dim}) ≥ qk_rope_head_dim ({rope_dim}) \
                 and index_topk ≥ 1"
            ),
        ));
    }
    load_mla_stack(ckpt, cfg, opts, &StackNames::default(), true, |l| {
        let p = format!("model.layers.{l}.self_attn.indexer");
        if l >= layers {
            // The MTP block: its own indexer if the checkpoint has one, else dense.
            if !ckpt.contains(&format!("{p}.wq_b.weight")) {
                return Ok(Sparse::None);
            }
        } else if !full[l] {
            return Ok(Sparse::Shared);
        }
        Ok(Sparse::Own {
            indexer: Box::new(Indexer {
                wq_b: Linear::load(ckpt, &format!("{p}.wq_b"), heads * head_dim, q_lora, false)?,
                wk: Linear::load(ckpt, &format!("{p}.wk"), head_dim, d, false)?,
                k_norm: LayerNorm {
                    weight: ckpt.vector_f32(&format!("{p}.k_norm.weight"), head_dim)?,
                    bias: ckpt.vector_f32(&format!("{p}.k_norm.bias"), head_dim)?,
                    eps: 1e-6,
                },
                weights_proj: Linear::load(ckpt, &format!("{p}.weights_proj"), heads, d, false)?,
                heads,
                head_dim,
                rope_dim,
                kpool: None,
            }),
            top_k,
        })
    })
}
