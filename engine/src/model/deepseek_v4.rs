//! DeepSeek-V4 (`model_type: deepseek_v4`, V4-Flash) on the standard stack
//! ([`super::transformer`]): its residual is `hc_mult` parallel streams mixed by
//! manifold-constrained hyper-connections ([`Residual::Hyper`], [`Streams::Hyper`]), its
//! attention is [`SelfAttention::Compressed`] (see [`super::mla::CompressedAttention`]) in
//! three kinds of layer, and its MoE is DeepSeek's with a clamped SwiGLU.
//!
//! Every query sees the last `sliding_window` tokens; the compressed layers add entries on
//! the key axis:
//! * **HCA** (heavily compressed): every complete window of `rate` tokens becomes one entry,
//!   a per-channel softmax-gated sum (`wgate` + a per-slot bias `ape`) of `wkv`, normalised
//!   and rotated at the window's first position; a query sees the windows it has completed.
//! * **CSA** (compressed sparse): entries overlap two windows (the previous window's first
//!   half-width slice and this window's second), and a lightning indexer with its own
//!   compressor picks the `index_topk` entries each query attends to.
//! * **sliding**: the window only.
//!
//! The MoE routes by `sqrt(softplus(·))` with a selection bias, or, on `hash_moe` layers, by
//! a fixed token → experts table (`tid2eid`, [`HashRoutedMoe`]); experts and the shared expert
//! use a clamped SwiGLU (`swiglu_limit`).
//!
//! The hub checkpoint's MTP block (`mtp.0.*`: a sliding-attention MoE layer with its own
//! hyper-connections, `e_proj`/`h_proj`, `enorm`/`hnorm`, `norm` and `hc_head_*`) is loaded
//! with `--draft mtp` as the stack's [`MtpHead`]; its experts join the store as layer
//! `num_hidden_layers`.

use std::sync::Arc;

use super::layers::{
    GluActivation, HashRoutedMoe, HyperConnection, HyperHead, Linear, Mlp, MoeBlock, RmsNorm, Rope,
    Router,
};
use super::mla::{CompressedAttention, CompressedIndexer, Compression, Compressor};
use super::transformer::{
    checkpoint_dtypes, Block, Ffn, MtpHead, MtpInput, Residual, SelfAttention, Streams, Transformer,
};
use super::{LoadOptions, ModelInfo};
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertNames, ExpertStore};
use crate::{Error, Result};

/// Where the hub checkpoint keeps the MTP block.
const MTP_PREFIX: &str = "mtp.0";

/// DeepSeek-V4 in the registry: its own stack; llama.cpp has no layout for it. `normalize` is
/// left out because the loader applies [`normalize_config`] itself, once the layer count is
/// checked against the checkpoint (normalizing builds per-layer lists).
pub const FAMILY: super::registry::Family =
    super::registry::Family::new(&["deepseek_v4"], super::registry::boxed_load!(load))
        .with_names(super::registry::StackNames {
            model: "model",
            lm_head: "head",
        })
        .with_experts(super::registry::Experts {
            count: "n_routed_experts",
            block: "ffn",
            matrices: ["w1", "w3", "w2"],
        })
        // Its attention is not MLA; the MTP head (`mtp.0.*`) drafts.
        .with_abilities(super::registry::Abilities {
            latent_attention: false,
            mtp: true,
        });

/// The config in transformers' modern form: hub checkpoints ship the legacy keys
/// (`compress_ratios` per layer, `compress_rate_csa` / `compress_rate_hca`, `num_hash_layers`,
/// `qk_rope_head_dim`, `rope_theta` + `compress_rope_theta` + a flat yarn `rope_scaling`),
/// which transformers folds into `layer_types`, `compress_rates`, `mlp_layer_types`,
/// `partial_rotary_factor` and nested `rope_parameters.{main,compress}`; so do we, with its
/// defaults.
pub fn normalize_config(cfg: &ModelConfig) -> Result<ModelConfig> {
    use serde_json::{json, Value};
    let mut v = cfg.json().clone();
    let n = cfg.usize("num_hidden_layers")?;
    let head_dim = cfg.usize("head_dim")?;
    let get = |k: &str| cfg.get(k).filter(|x| !x.is_null()).cloned();
    // compress_rates: default, then the legacy scalar overrides.
    let mut rates = get("compress_rates").unwrap_or_else(
        || json!({"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}),
    );
    if let Some(r) = get("compress_rate_csa") {
        rates["compressed_sparse_attention"] = r;
    }
    if let Some(r) = get("compress_rate_hca") {
        rates["heavily_compressed_attention"] = r;
    }
    v["compress_rates"] = rates;
    if get("layer_types").is_none() {
        let types: Vec<String> = match get("compress_ratios") {
            Some(Value::Array(list)) => list
                .iter()
                .take(n)
                .map(|r| match r.as_u64() {
                    Some(0) => Ok("sliding_attention".to_string()),
                    Some(4) => Ok("compressed_sparse_attention".to_string()),
                    Some(128) => Ok("heavily_compressed_attention".to_string()),
                    _ => Err(Error::config(
                        cfg.path(),
                        "compress_ratios",
                        format!("entry {r} is not one of 0, 4, 128"),
                    )),
                })
                .collect::<Result<_>>()?,
            Some(other) => {
                return Err(Error::config(
                    cfg.path(),
                    "compress_ratios",
                    format!("expected a list, found {other}"),
                ))
            }
            None => (0..n)
                .map(|i| match i {
                    0 | 1 => "heavily_compressed_attention",
                    _ if (i - 2) % 2 == 1 => "compressed_sparse_attention",
                    _ => "heavily_compressed_attention",
                })
                .map(String::from)
                .collect(),
        };
        v["layer_types"] = json!(types);
    }
    if get("mlp_layer_types").is_none() {
        let hash = match get("num_hash_layers") {
            Some(h) => h
                .as_u64()
                .ok_or_else(|| Error::config(cfg.path(), "num_hash_layers", "expected a number"))?
                as usize,
            None => 3,
        };
        let types: Vec<&str> = (0..n)
            .map(|i| if i < hash { "hash_moe" } else { "moe" })
            .collect();
        v["mlp_layer_types"] = json!(types);
    }
    let partial = match cfg.opt_f64("partial_rotary_factor")? {
        Some(p) => p,
        None => match cfg.opt_usize("qk_rope_head_dim")? {
            Some(r) => r as f64 / head_dim as f64,
            None => 64.0 / 512.0,
        },
    };
    v["partial_rotary_factor"] = json!(partial);
    let rp = get("rope_parameters")
        .or_else(|| get("rope_scaling"))
        .unwrap_or(json!({}));
    let nested = rp.get("main").is_some_and(Value::is_object)
        && rp.get("compress").is_some_and(Value::is_object);
    if !nested {
        let mut yarn = rp.as_object().cloned().unwrap_or_default();
        yarn.remove("main");
        yarn.remove("compress");
        if let Some(t) = yarn.remove("type") {
            yarn.entry("rope_type").or_insert(t);
        }
        let theta = cfg.f64_or("rope_theta", 10000.0)?;
        let compress_theta = cfg.f64_or("compress_rope_theta", 160000.0)?;
        let main = json!({"rope_type": "default", "rope_theta": theta,
            "partial_rotary_factor": partial});
        let mut compress = Value::Object(yarn);
        compress["rope_theta"] = json!(compress_theta);
        compress["partial_rotary_factor"] = json!(partial);
        if compress.get("rope_type").is_none() {
            compress["rope_type"] = json!("default");
        }
        if compress["rope_type"] == "yarn" && compress.get("attention_factor").is_none() {
            // The V4 reference does not scale cos/sin by yarn's mscale.
            compress["attention_factor"] = json!(1.0);
        }
        v["rope_parameters"] = json!({"main": main, "compress": compress});
    }
    Ok(ModelConfig::from_value(cfg.path().to_path_buf(), v))
}

/// RoPE settings of one of V4's rope types (`rope_parameters.{main,compress}`).
fn rope_of(cfg: &ModelConfig, kind: &str, head_dim: usize) -> Result<Rope> {
    let sub = cfg
        .get("rope_parameters")
        .and_then(|p| p.get(kind))
        .cloned()
        .ok_or_else(|| {
            Error::config(
                cfg.path(),
                format!("rope_parameters.{kind}"),
                "missing (DeepSeek-V4 configs give a `main` and a `compress` rope)",
            )
        })?;
    let view = ModelConfig::from_value(
        cfg.path().to_path_buf(),
        serde_json::json!({
            "rope_parameters": sub,
            "max_position_embeddings": cfg.usize_or("max_position_embeddings", 4096)?,
        }),
    );
    // Errors name the field where the file has it: `rope_parameters.{kind}.…`.
    let mut params = view.rope(10000.0).map_err(|e| match e {
        Error::Config {
            path,
            field,
            message,
        } => Error::Config {
            path,
            field: field.replacen("rope_parameters.", &format!("rope_parameters.{kind}."), 1),
            message,
        },
        other => other,
    })?;
    params.interleaved = true;
    Ok(Rope::new(&params, head_dim))
}

/// Build a DeepSeek-V4 model.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    // The layer count first: normalising builds per-layer lists.
    let layers_n = super::layer_count(cfg, ckpt)?;
    let normalized = normalize_config(cfg)?;
    let cfg = &normalized;
    let d = cfg.dim("hidden_size")?;
    let heads = cfg.dim("num_attention_heads")?;
    let hd = cfg.dim("head_dim")?;
    let vocab = cfg.dim("vocab_size")?;
    let q_lora = cfg.dim("q_lora_rank")?;
    let eps = cfg.f64_or("rms_norm_eps", 1e-6)?;
    let hc = cfg.dim_or("hc_mult", 4)?;
    let hc_eps = cfg.f64_or("hc_eps", 1e-6)? as f32;
    let sinkhorn_iters = cfg.usize_in_or(
        "hc_sinkhorn_iters",
        0..=1000,
        "DeepSeek-V4 normalises with 20 iterations",
        20,
    )?;
    let experts = super::expert_count(cfg, ckpt, "n_routed_experts")?;
    let top_k = super::experts_per_token(cfg, experts)?;
    let inter = cfg.dim("moe_intermediate_size")?;
    let limit = cfg.opt_f64("swiglu_limit")?.map(|l| l as f32);
    let scaling = cfg.f64_or("routed_scaling_factor", 1.0)? as f32;
    if let Some(f) = cfg.get("scoring_func").and_then(|v| v.as_str()) {
        if f != "sqrtsoftplus" {
            return Err(Error::config(
                cfg.path(),
                "scoring_func",
                format!("`{f}` is not supported here (expected sqrtsoftplus)"),
            ));
        }
    }
    let list = |key: &str| -> Result<Vec<String>> {
        let v = cfg
            .get(key)
            .and_then(|v| v.as_array())
            .ok_or_else(|| Error::config(cfg.path(), key, "missing (one entry per layer)"))?;
        if v.len() != layers_n {
            return Err(Error::config(
                cfg.path(),
                key,
                format!("has {} entries for {layers_n} layers", v.len()),
            ));
        }
        Ok(v.iter()
            .map(|s| s.as_str().unwrap_or("").to_string())
            .collect())
    };
    let layer_types = list("layer_types")?;
    let mlp_types = list("mlp_layer_types")?;
    let rates = cfg.get("compress_rates").cloned().unwrap_or_default();
    let rate_of = |k: &str| -> Result<usize> {
        rates
            .get(k)
            .and_then(|v| v.as_u64())
            .map(|v| v as usize)
            .ok_or_else(|| Error::config(cfg.path(), format!("compress_rates.{k}"), "missing"))
    };
    let main_rope = rope_of(cfg, "main", hd)?;
    let compress_rope = rope_of(cfg, "compress", hd)?;
    // Hub names have no `model.` prefix, `embed`/`norm`/`hc_head_*`; transformers' save keeps
    // `model.embed_tokens`, `model.norm`, `model.hc_head.hc_*` (arch doc 0.6).
    let (m, embed_name, norm_name, hc_head) = if ckpt.contains("model.embed_tokens.weight") {
        (
            "model.",
            "model.embed_tokens.weight",
            "model.norm.weight",
            "model.hc_head.hc_",
        )
    } else {
        ("", "embed.weight", "norm.weight", "hc_head_")
    };
    // The MTP block, its experts joining the store as layer `layers_n`.
    let mtp_name = format!("{MTP_PREFIX}.e_proj.weight");
    if opts.mtp() && !ckpt.contains(&mtp_name) {
        return Err(Error::config(
            cfg.path(),
            "num_nextn_predict_layers",
            format!(
                "drafting with MTP needs the checkpoint's MTP head, but it has no `{mtp_name}` \
                 (run without --draft mtp)"
            ),
        ));
    }
    let layer_prefix = |l: usize| {
        if l == layers_n {
            MTP_PREFIX.to_string()
        } else {
            format!("{m}layers.{l}")
        }
    };
    let moe_layers = vec![true; layers_n + usize::from(opts.mtp())];
    let names = store::expert_table(
        ckpt,
        cfg,
        "n_routed_experts",
        &moe_layers,
        experts,
        |l, e| {
            let p = format!("{}.ffn.experts.{e}", layer_prefix(l));
            ExpertNames {
                gate: format!("{p}.w1.weight"),
                up: format!("{p}.w3.weight"),
                down: format!("{p}.w2.weight"),
            }
        },
    )?;
    // An MTP block left out is never loaded.
    let mtp_left: Vec<_> = ckpt
        .tensors()
        .iter()
        .filter(|(n, _)| !opts.mtp() && n.starts_with(&format!("{MTP_PREFIX}.")))
        .map(|(_, t)| (t.len, t.shape.iter().product::<usize>()))
        .collect();
    let unused_bytes: usize = mtp_left.iter().map(|t| t.0).sum();
    let unused_params: usize = mtp_left.iter().map(|t| t.1).sum();
    let store: Arc<dyn ExpertStore> =
        store::open(ckpt, &names, d, inter, unused_bytes, &opts.placement)?;
    let embed = ckpt.weight(embed_name, &[vocab, d])?;
    let groups = cfg.dim("o_groups")?;
    let o_rank = cfg.dim("o_lora_rank")?;
    let window = cfg.usize("sliding_window")?;
    // Layer `l`'s block; the MTP block (`l == layers_n`) is a sliding, learned-routed layer.
    let block = |l: usize| -> Result<Block> {
        let p = layer_prefix(l);
        let a = format!("{p}.attn");
        let (layer_type, mlp_type) = if l == layers_n {
            ("sliding_attention", "moe")
        } else {
            (layer_types[l].as_str(), mlp_types[l].as_str())
        };
        let compression = match layer_type {
            "sliding_attention" => Compression::Sliding,
            "heavily_compressed_attention" => Compression::Hca(Compressor::load(
                ckpt,
                &format!("{a}.compressor"),
                d,
                hd,
                rate_of("heavily_compressed_attention")?,
                false,
                eps,
            )?),
            "compressed_sparse_attention" => {
                let rate = rate_of("compressed_sparse_attention")?;
                let (nh, dim) = (cfg.dim("index_n_heads")?, cfg.dim("index_head_dim")?);
                Compression::Csa(
                    Compressor::load(ckpt, &format!("{a}.compressor"), d, hd, rate, true, eps)?,
                    Box::new(CompressedIndexer {
                        compressor: Compressor::load(
                            ckpt,
                            &format!("{a}.indexer.compressor"),
                            d,
                            dim,
                            rate,
                            true,
                            eps,
                        )?,
                        wq_b: Linear::load(
                            ckpt,
                            &format!("{a}.indexer.wq_b"),
                            nh * dim,
                            q_lora,
                            false,
                        )?,
                        weights_proj: Linear::load(
                            ckpt,
                            &format!("{a}.indexer.weights_proj"),
                            nh,
                            d,
                            false,
                        )?,
                        heads: nh,
                        dim,
                        top_k: cfg.usize("index_topk")?,
                    }),
                )
            }
            other => {
                return Err(Error::config(
                    cfg.path(),
                    "layer_types",
                    format!("unknown layer type `{other}`"),
                ))
            }
        };
        let rope = if matches!(compression, Compression::Sliding) {
            main_rope.clone()
        } else {
            compress_rope.clone()
        };
        // Hub checkpoints name the key/value norm `kv_norm`, transformers' save `norm`.
        let kv_norm = if ckpt.contains(&format!("{a}.kv_norm.weight")) {
            format!("{a}.kv_norm.weight")
        } else {
            format!("{a}.norm.weight")
        };
        let attn = CompressedAttention {
            wq_a: Linear::load(ckpt, &format!("{a}.wq_a"), q_lora, d, false)?,
            q_norm: RmsNorm::load(ckpt, &format!("{a}.q_norm.weight"), q_lora, eps)?,
            wq_b: Linear::load(ckpt, &format!("{a}.wq_b"), heads * hd, q_lora, false)?,
            wkv: Linear::load(ckpt, &format!("{a}.wkv"), hd, d, false)?,
            kv_norm: RmsNorm::load(ckpt, &kv_norm, hd, eps)?,
            wo_a: Linear::load(
                ckpt,
                &format!("{a}.wo_a"),
                groups * o_rank,
                heads * hd / groups,
                false,
            )?,
            wo_b: Linear::load(ckpt, &format!("{a}.wo_b"), d, groups * o_rank, false)?,
            sinks: ckpt.vector_f32(&format!("{a}.attn_sink"), heads)?,
            heads,
            head_dim: hd,
            groups,
            o_rank,
            window,
            rope,
            compress_rope: compress_rope.clone(),
            compression,
            eps: eps as f32,
        };
        let hash = match mlp_type {
            "hash_moe" => true,
            "moe" => false,
            other => {
                return Err(Error::config(
                    cfg.path(),
                    "mlp_layer_types",
                    format!("unknown entry `{other}`"),
                ))
            }
        };
        let sp = format!("{p}.ffn.shared_experts");
        let shared = Mlp {
            gate: Linear::load(ckpt, &format!("{sp}.w1"), inter, d, false)?,
            up: Linear::load(ckpt, &format!("{sp}.w3"), inter, d, false)?,
            down: Linear::load(ckpt, &format!("{sp}.w2"), d, inter, false)?,
            limit,
        };
        let moe = MoeBlock {
            layer: l,
            gate: Linear::load(ckpt, &format!("{p}.ffn.gate"), experts, d, false)?,
            router: Router::SqrtSoftplus { scaling },
            top_k,
            num_experts: experts,
            intermediate: inter,
            store: store.clone(),
            correction_bias: if hash {
                None
            } else {
                Some(ckpt.vector_f32(&format!("{p}.ffn.gate.bias"), experts)?)
            },
            shared: Some(shared),
            activation: GluActivation::SwiGlu { limit },
            expert_biases: None,
            shared_gate: None,
        };
        let ffn = if hash {
            let t = ckpt.tensor_any_shape(&format!("{p}.ffn.gate.tid2eid"))?;
            let ids = t.to_i64_vec()?;
            if ids.len() != vocab * top_k || ids.iter().any(|&e| e < 0 || e as usize >= experts) {
                return Err(Error::Invalid(format!(
                    "{p}.ffn.gate.tid2eid: expected {vocab}×{top_k} expert ids below {experts}"
                )));
            }
            Ffn::HashMoe(HashRoutedMoe {
                moe,
                tid2eid: ids.into_iter().map(|e| e as usize).collect(),
            })
        } else {
            Ffn::Moe(moe)
        };
        let hyper = |part: &str| {
            HyperConnection::load(
                ckpt,
                &format!("{p}.hc_{part}"),
                hc,
                d,
                sinkhorn_iters,
                hc_eps,
                eps as f32,
            )
        };
        Ok(Block {
            attn_norm: RmsNorm::load(ckpt, &format!("{p}.attn_norm.weight"), d, eps)?,
            attn: SelfAttention::Compressed(attn),
            ffn_norm: RmsNorm::load(ckpt, &format!("{p}.ffn_norm.weight"), d, eps)?,
            ffn,
            residual: Residual::Hyper {
                attn: hyper("attn")?,
                ffn: hyper("ffn")?,
            },
            post_conv: None,
        })
    };
    let mut blocks = Vec::with_capacity(layers_n);
    for l in 0..layers_n {
        blocks.push(block(l)?);
    }
    let head = Linear::load(ckpt, "head", vocab, d, false)?;
    let mtp = if opts.mtp() {
        let p = MTP_PREFIX;
        Some(MtpHead {
            enorm: RmsNorm::load(ckpt, &format!("{p}.enorm.weight"), d, eps)?,
            hnorm: RmsNorm::load(ckpt, &format!("{p}.hnorm.weight"), d, eps)?,
            input: MtpInput::PerStream {
                e_proj: Linear::load(ckpt, &format!("{p}.e_proj"), d, d, false)?,
                h_proj: Linear::load(ckpt, &format!("{p}.h_proj"), d, d, false)?,
            },
            block: block(layers_n)?,
            streams: Streams::Hyper(HyperHead::load(
                ckpt,
                &format!("{p}.hc_head_"),
                hc,
                d,
                hc_eps,
                eps as f32,
            )?),
            norm: RmsNorm::load(ckpt, &format!("{p}.norm.weight"), d, eps)?,
            head: Linear::from_tensor(head.weight.clone()),
        })
    } else {
        None
    };
    let hc_head = HyperHead::load(ckpt, hc_head, hc, d, hc_eps, eps as f32)?;
    let total_params = ckpt.parameter_count().saturating_sub(unused_params);
    let expert_params = layers_n * experts * 3 * d * inter;
    let mut skipped = Vec::new();
    if !mtp_left.is_empty() {
        skipped.push(format!(
            "the multi-token-prediction head ({MTP_PREFIX}: {} tensors, {unused_bytes} bytes; \
             --draft mtp loads it)",
            mtp_left.len()
        ));
    }
    let info = ModelInfo {
        model_type: cfg.model_type()?,
        architecture: "DeepseekV4ForCausalLM".into(),
        vocab_size: vocab,
        hidden_size: d,
        layers: layers_n,
        moe_layers: layers_n,
        routed_experts: experts,
        shared_experts: 1,
        active_experts: top_k,
        total_params,
        active_params: total_params.saturating_sub(expert_params)
            + layers_n * top_k * 3 * d * inter,
        dense_bytes: ckpt.total_bytes() - store.total_bytes() - unused_bytes,
        routed_expert_bytes: store.total_bytes(),
        dtypes: checkpoint_dtypes(ckpt),
        max_position_embeddings: cfg.usize_or("max_position_embeddings", 4096)?,
        kv_bytes_per_token: blocks
            .iter()
            .map(|b| b.attn.cache_bytes_per_token().0)
            .sum(),
        state_bytes_per_sequence: 0,
        unused_bytes,
        skipped,
        kv_bytes_per_token_full: blocks
            .iter()
            .map(|b| b.attn.cache_bytes_per_token().1)
            .sum(),
    };
    Ok(Transformer {
        embed,
        blocks,
        norm: RmsNorm::load(ckpt, norm_name, d, eps)?,
        lm_head: head,
        info,
        store: Some(store),
        mtp,
        streams: Streams::Hyper(hc_head),
        embed_norm: None,
        logits: Default::default(),
    })
}
