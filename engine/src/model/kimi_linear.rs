//! Kimi Linear (`kimi_linear`, Kimi-Linear-48B-A3B): a hybrid whose `layer_types` interleave
//! Kimi Delta Attention ([`super::linear_attention`], arch doc 1.8: per-channel decay, its
//! l2norm, a sigmoid-gated output norm) with NoPE multi-head latent attention (the rope part
//! of the MLA key is kept and shared, but nothing rotates). The feed-forward part is the
//! DeepSeek MoE (sigmoid router with a selection-only correction bias, group-limited top-k,
//! `routed_scaling_factor`, ungated shared experts), the first `first_k_dense_replace` layers
//! dense. Its `config.json` uses Kimi's key names (`num_experts_per_token`,
//! `moe_renormalize`, `num_expert_group`, `num_shared_experts`, `model_max_length`,
//! `linear_attn_config`); [`kimi_linear_config`] folds them into the names the shared loaders
//! read, with transformers' defaults. Its tensors keep the hub's names: `block_sparse_moe`,
//! experts `w1`/`w3`/`w2`, separate `q`/`k`/`v` short convolutions.
//!
//! [`kda`] and [`KdaDims`] are shared with GLM-5-next, whose linear layers are the same KDA.

use std::sync::Arc;

use serde_json::Value;

use super::deepseek_v3::{DeepseekMoe, MlaShape};
use super::layers::{Linear, Rope};
use super::linear_attention::{Decay, GateAct, L2Norm, LinearAttention, Projection, ShortConv};
use super::mla::Sparse;
use super::qwen3_next::linear_layers;
use super::registry::{boxed_load, Abilities, Experts, Family};
use super::transformer::{load_standard, LayerParts, SelfAttention, StandardConfig, Transformer};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::{Error, Result};

/// Where Kimi Linear's routed experts are: `block_sparse_moe.experts.{e}.{w1,w3,w2}`
/// (gate, up, down), counted by `num_experts`.
pub const EXPERTS: Experts = Experts {
    count: "num_experts",
    ..super::mixtral::EXPERTS
};

/// Kimi Linear in the registry.
pub const FAMILY: Family = Family::new(&["kimi_linear"], boxed_load!(load))
    .with_abilities(Abilities {
        latent_attention: true,
        mtp: false,
    })
    .with_normalize(kimi_linear_config)
    .with_experts(EXPERTS);

/// Kimi's names of transformers' `attribute_map` (the Kimi name first).
const KIMI_KEYS: &[(&str, &str)] = &[
    ("num_experts_per_token", "num_experts_per_tok"),
    ("moe_renormalize", "norm_topk_prob"),
    ("num_expert_group", "n_group"),
    ("num_shared_experts", "n_shared_experts"),
    ("model_max_length", "max_position_embeddings"),
];

/// `layer_types` of `layers` layers: `full_attention` where `full(i)`, else `linear_attention`
/// (the defaults transformers derives for the KDA hybrids).
pub fn layer_types_where(layers: usize, full: impl Fn(usize) -> bool) -> Vec<Value> {
    (0..layers)
        .map(|i| {
            Value::from(if full(i) {
                "full_attention"
            } else {
                "linear_attention"
            })
        })
        .collect()
}

/// A Kimi Linear config in the form the loaders read, as `KimiLinearConfig` reads it: Kimi's
/// key names under their transformers names, the geometry of `linear_attn_config` (which
/// takes precedence), explicit `layer_types` (from `linear_attn_config`'s 1-based
/// `full_attn_layers`/`kda_layers`, else MLA every 4th layer from layer 4) and
/// `mlp_layer_types` (the first `first_k_dense_replace`, default 1, dense), and transformers'
/// defaults for the MoE keys.
pub fn kimi_linear_config(cfg: &ModelConfig) -> Result<ModelConfig> {
    let mut json = cfg.json().clone();
    let obj = json
        .as_object_mut()
        .ok_or_else(|| Error::config(cfg.path(), "config", "is not a JSON object"))?;
    for (kimi, name) in KIMI_KEYS {
        if obj.get(*name).is_none_or(Value::is_null) {
            if let Some(v) = obj.get(*kimi).filter(|v| !v.is_null()).cloned() {
                obj.insert(name.to_string(), v);
            }
        }
    }
    for (key, default) in [
        ("n_shared_experts", Value::from(1)),
        ("n_group", Value::from(1)),
        ("topk_group", Value::from(1)),
        ("norm_topk_prob", Value::from(true)),
        ("routed_scaling_factor", Value::from(2.446)),
        ("num_experts_per_tok", Value::from(8)),
        ("rms_norm_eps", Value::from(1e-5)),
        ("linear_head_dim", Value::from(128)),
        ("linear_num_heads", Value::from(32)),
        ("linear_conv_kernel_dim", Value::from(4)),
    ] {
        if obj.get(key).is_none_or(Value::is_null) {
            obj.insert(key.to_string(), default);
        }
    }
    let layers = cfg.usize("num_hidden_layers")?;
    let linear_cfg = cfg.get("linear_attn_config").cloned();
    if let Some(lc) = &linear_cfg {
        fold_linear_attn_config(obj, lc);
    }
    if obj.get("layer_types").is_none_or(Value::is_null) {
        let listed = |key: &str| linear_cfg.as_ref().and_then(|lc| lc.get(key)?.as_array());
        let types: Vec<Value> = match (listed("full_attn_layers"), listed("kda_layers")) {
            (Some(full), Some(kda)) => {
                let mut types = vec![Value::Null; layers];
                for (list, kind) in [(full, "full_attention"), (kda, "linear_attention")] {
                    for v in list {
                        let l = v.as_u64().filter(|&l| l >= 1 && l as usize <= layers);
                        let l = l.ok_or_else(|| {
                            Error::config(
                                cfg.path(),
                                "linear_attn_config",
                                format!("layer {v} is not one of layers 1..={layers} (1-based)"),
                            )
                        })?;
                        types[l as usize - 1] = Value::from(kind);
                    }
                }
                if let Some(l) = types.iter().position(Value::is_null) {
                    return Err(Error::config(
                        cfg.path(),
                        "linear_attn_config",
                        format!(
                            "layer {} is in neither full_attn_layers nor kda_layers",
                            l + 1
                        ),
                    ));
                }
                types
            }
            _ => layer_types_where(layers, |i| i > 0 && i % 4 == 0),
        };
        obj.insert("layer_types".into(), Value::Array(types));
    }
    if obj.get("mlp_layer_types").is_none_or(Value::is_null) {
        let dense = cfg.usize_or("first_k_dense_replace", 1)?;
        obj.insert("mlp_layer_types".into(), first_dense(layers, dense));
    }
    Ok(ModelConfig::from_value(cfg.path().to_path_buf(), json))
}

/// `mlp_layer_types` of `layers` layers whose first `dense` are dense, the rest sparse.
pub fn first_dense(layers: usize, dense: usize) -> Value {
    (0..layers)
        .map(|i| Value::from(if i < dense { "dense" } else { "sparse" }))
        .collect()
}

/// The KDA geometry of a checkpoint's `linear_attn_config` dict (`head_dim`, `num_heads`,
/// `short_conv_kernel_size`) over the `linear_*` keys of config `obj`: the dict takes
/// precedence, as in transformers.
pub fn fold_linear_attn_config(obj: &mut serde_json::Map<String, Value>, lc: &Value) {
    for (from, to) in [
        ("head_dim", "linear_head_dim"),
        ("num_heads", "linear_num_heads"),
        ("short_conv_kernel_size", "linear_conv_kernel_dim"),
    ] {
        if let Some(v) = lc.get(from).filter(|v| !v.is_null()) {
            obj.insert(to.to_string(), v.clone());
        }
    }
}

/// The Kimi Delta Attention geometry of a config (`linear_*` keys): `heads` heads of
/// `head_dim` for queries, keys and values alike, and the short convolutions' kernel.
#[derive(Debug, Clone, Copy)]
pub struct KdaDims {
    /// `linear_num_heads`.
    pub heads: usize,
    /// `linear_head_dim` (queries, keys and values alike).
    pub head_dim: usize,
    /// `linear_conv_kernel_dim`.
    pub kernel: usize,
}

impl KdaDims {
    /// Read `linear_num_heads`, `linear_head_dim` and `linear_conv_kernel_dim`.
    pub fn read(cfg: &ModelConfig) -> Result<KdaDims> {
        Ok(KdaDims {
            heads: cfg.dim("linear_num_heads")?,
            head_dim: cfg.dim("linear_head_dim")?,
            kernel: cfg.usize_in(
                "linear_conv_kernel_dim",
                1..=64,
                "a short convolution of 1 to 64 taps",
            )?,
        })
    }
}

/// Layer `p`'s Kimi Delta Attention (`{p}.self_attn.*`) over hidden rows of `d`: the output
/// norm's eps `eps`, and the decay's lower bound (GLM-5-next's `linear_lower_bound`; `None`:
/// `−exp(A_log)·softplus`).
pub fn kda(
    ckpt: &Checkpoint,
    p: &str,
    dims: &KdaDims,
    d: usize,
    eps: f64,
    lower_bound: Option<f32>,
) -> Result<LinearAttention> {
    let a = format!("{p}.self_attn");
    let (h, dk) = (dims.heads, dims.head_dim);
    let w = h * dk;
    let lin = |name: &str, rows: usize, cols: usize| {
        Linear::load(ckpt, &format!("{a}.{name}"), rows, cols, false)
    };
    let projection = Projection::Kimi {
        q: lin("q_proj", w, d)?,
        k: lin("k_proj", w, d)?,
        v: lin("v_proj", w, d)?,
        f_a: lin("f_a_proj", dk, d)?,
        f_b: lin("f_b_proj", w, dk)?,
        b: lin("b_proj", h, d)?,
        g_a: lin("g_a_proj", dk, d)?,
        g_b: lin("g_b_proj", w, dk)?,
    };
    let convs: Vec<String> = ["q", "k", "v"]
        .iter()
        .map(|x| format!("{a}.{x}_conv1d.weight"))
        .collect();
    let conv = ShortConv::load(
        ckpt,
        &[(&convs[0], w), (&convs[1], w), (&convs[2], w)],
        dims.kernel,
    )?;
    // `A_log` is `[1, 1, H, 1]` in Kimi Linear, `[H]` in GLM-5-next.
    let a_log_name = format!("{a}.A_log");
    let a_log_shape = match ckpt.tensors().get(&a_log_name) {
        Some(t) if t.shape.len() == 4 => vec![1, 1, h, 1],
        _ => vec![h],
    };
    let a_log = ckpt.weight(&a_log_name, &a_log_shape)?.to_f32_vec()?;
    Ok(LinearAttention {
        projection,
        conv,
        decay: Decay::PerChannel {
            exp_a: a_log.iter().map(|x| x.exp()).collect(),
            dt_bias: ckpt.vector_f32(&format!("{a}.dt_bias"), w)?,
            lower_bound,
        },
        l2: L2Norm::Div,
        k_heads: h,
        heads: h,
        dk,
        dv: dk,
        norm_weight: ckpt.vector_f32(&format!("{a}.o_norm.weight"), dk)?,
        norm_eps: eps as f32,
        gate_act: GateAct::Sigmoid,
        out: lin("o_proj", d, w)?,
    })
}

/// Blocks Kimi K3 adds to `kimi_linear` that transformers 5.23.0 does not have, by the config
/// keys that announce them (matched as substrings, case-insensitive).
const K3_BLOCKS: &[(&str, &str)] = &[
    ("attn_res", "block attention residuals (AttnRes)"),
    ("attention_residual", "block attention residuals (AttnRes)"),
    ("latent", "latent-space experts (LatentMoE)"),
];

/// Why a Kimi K3 config (or a `kimi_linear` one carrying K3's blocks) is refused: the blocks
/// its keys announce that transformers' `kimi_linear` does not have, and an activation other
/// than SiLU. colibri implements them only once they can be checked against an independent
/// reference; until then they are refused, never guessed. `None`: nothing of the kind.
pub fn missing_blocks(cfg: &ModelConfig) -> Option<String> {
    let text = cfg.get("text_config").unwrap_or(cfg.json());
    let keys: Vec<&String> = text
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    let mut found: Vec<String> = Vec::new();
    for (pattern, block) in K3_BLOCKS {
        let hits: Vec<&str> = keys
            .iter()
            .filter(|k| k.to_ascii_lowercase().contains(pattern))
            .map(|k| k.as_str())
            .collect();
        if !hits.is_empty() && !found.iter().any(|f| f.starts_with(block)) {
            found.push(format!("{block} (`{}`)", hits.join("`, `")));
        }
    }
    match text.get("hidden_act").and_then(|v| v.as_str()) {
        Some(act) if act != "silu" => found.push(format!("the activation `{act}` (hidden_act)")),
        _ => {}
    }
    (!found.is_empty()).then(|| found.join(", "))
}

/// The error for a `kimi_k3` config: K3's text model is `kimi_linear` plus blocks colibri does
/// not implement yet.
pub fn refuse_kimi_k3(cfg: &ModelConfig) -> Error {
    let blocks = missing_blocks(cfg).unwrap_or_else(|| {
        "block attention residuals (AttnRes), latent-space experts (LatentMoE) and its SiTU-GLU \
         activation, as its model card describes them"
            .into()
    });
    Error::config(
        cfg.path(),
        "model_type",
        format!(
            "`kimi_k3` (Kimi K3) is not supported by this build: its text model is `kimi_linear` \
             plus {blocks}, which transformers 5.23.0's `kimi_linear` does not have and colibri \
             does not implement (they cannot be checked against a reference here); \
             `kimi_linear` checkpoints without them run"
        ),
    )
}

/// Build a Kimi Linear model.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    if let Some(blocks) = missing_blocks(cfg) {
        return Err(Error::config(
            cfg.path(),
            "model_type",
            format!(
                "this `kimi_linear` config carries {blocks}, which transformers 5.23.0's \
                 `kimi_linear` does not have and colibri does not implement (Kimi K3's blocks); \
                 refusing rather than running a different model"
            ),
        ));
    }
    let cfg = &kimi_linear_config(cfg)?;
    let sc = StandardConfig::read(cfg, ckpt, 1e-5, 10000.0)?;
    let d = sc.hidden_size;
    let linear = linear_layers(cfg, sc.layers)?;
    let dims = KdaDims::read(cfg)?;
    let shape = MlaShape::read(cfg)?;
    // NoPE: the rope part of the key is kept (and shared by the heads), but never rotated;
    // the softmax scale counts it.
    let scale = ((shape.nope + shape.rope_dim) as f64).powf(-0.5) as f32;
    let moe = DeepseekMoe::read_named(cfg, ckpt, sc.layers, EXPERTS)?;
    let names = EXPERTS.table(ckpt, cfg, &sc.prefix, &moe.is_moe, moe.experts)?;
    let store: Arc<dyn ExpertStore> =
        store::open(ckpt, &names, d, moe.intermediate, 0, &opts.placement)?;
    let m = sc.prefix.clone();
    let mut model = load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        let p = format!("{m}.layers.{l}");
        let attn = if linear[l] {
            SelfAttention::Linear(kda(ckpt, &p, &dims, d, sc.rms_norm_eps, None)?)
        } else {
            // The latent norms use eps 1e-6 whatever rms_norm_eps says.
            let mla = shape.load(ckpt, &p, d, Rope::none(), scale, 1e-6, Sparse::None, opts)?;
            SelfAttention::Mla(mla)
        };
        Ok(LayerParts::own(
            attn,
            moe.load_ffn(ckpt, cfg, &p, l, d, &store)?,
        ))
    })?;
    model.info.model_type = cfg.model_type()?;
    Ok(model)
}
