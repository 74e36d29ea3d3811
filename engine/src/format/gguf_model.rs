//! A GGUF file seen as a model checkpoint: llama.cpp's architecture names, hyper-parameter
//! keys and tensor names mapped onto the Hugging Face `config.json` fields and tensor names
//! our families load, so one loader per family serves both formats.
//!
//! Routed experts stored fused (`blk.N.ffn_{gate,up,down}_exps.weight`, `[E, rows, cols]`)
//! become one tensor description per expert, each a contiguous slice of the fused tensor, so
//! the tiered store streams single experts from a GGUF file exactly as from safetensors.
//!
//! llama.cpp's converter permutes the Q and K rows of `llama` (and Mixtral, which it writes as
//! `llama`) for its adjacent-pair RoPE; instead of un-permuting quantized rows we keep them
//! and rotate adjacent pairs (`rope_interleaved` in the built configuration).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::config::ModelConfig;
use super::gguf::{GgufFile, GgufTensor};
use super::safetensors::{Access, Checkpoint, TensorDesc};
use crate::tensor::quant::QuantType;
use crate::tensor::DType;
use crate::{Error, Result};

/// The GGUF architectures this build maps, with the family each becomes.
pub const SUPPORTED_ARCHITECTURES: &[(&str, &str)] = &[
    ("llama", "llama (mixtral when it has experts)"),
    ("qwen2", "llama with q/k/v biases"),
    ("olmoe", "olmoe"),
    ("qwen3moe", "qwen3_moe"),
];

/// Whether `path` is a GGUF file (by its magic), not a directory.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    if !path.is_file() {
        return false;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// Open a GGUF model: its metadata as a `config.json`-shaped configuration and its tensors
/// under Hugging Face names.
pub fn open(path: &Path, access: Access) -> Result<(GgufFile, ModelConfig, Checkpoint)> {
    let gguf = GgufFile::open(path)?;
    let config = config_from_gguf(&gguf)?;
    let model_type = config.model_type()?;
    let tensors = hf_tensors(&gguf, &model_type)?;
    let ckpt = Checkpoint::from_descs(path, &[path.to_path_buf()], tensors, access)?;
    Ok((gguf, config, ckpt))
}

/// Build the `config.json` our loaders read from the GGUF metadata.
pub fn config_from_gguf(g: &GgufFile) -> Result<ModelConfig> {
    let arch = g.architecture()?.to_string();
    let path = g.path().to_path_buf();
    let key = |k: &str| format!("{arch}.{k}");
    let need = |k: &str| -> Result<u64> {
        g.get_u64(&key(k))?
            .ok_or_else(|| Error::config(&path, key(k), "missing from the GGUF metadata"))
    };
    let opt_u = |k: &str| g.get_u64(&key(k));
    let opt_f = |k: &str| g.get_f64(&key(k));
    let embd = g
        .get_tensor("token_embd.weight")
        .ok_or_else(|| Error::tensor(&path, "token_embd.weight", "missing from the GGUF file"))?;
    let vocab = embd.shape[0];
    let experts = opt_u("expert_count")?.unwrap_or(0);
    let model_type = match (arch.as_str(), experts) {
        ("llama", 0) | ("qwen2", _) => "llama",
        ("llama", _) => "mixtral",
        ("olmoe", _) => "olmoe",
        ("qwen3moe", _) => "qwen3_moe",
        (other, _) => {
            return Err(Error::config(
                &path,
                "general.architecture",
                format!(
                    "GGUF architecture `{other}` is not supported by this build (supported: {})",
                    SUPPORTED_ARCHITECTURES
                        .iter()
                        .map(|(a, _)| *a)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ))
        }
    };
    let heads = need("attention.head_count")?;
    let hidden = need("embedding_length")?;
    let mut c = Map::new();
    c.insert("model_type".into(), json!(model_type));
    c.insert("architectures".into(), json!([format!("GGUF {arch}")]));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("num_hidden_layers".into(), json!(need("block_count")?));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert(
        "num_key_value_heads".into(),
        json!(opt_u("attention.head_count_kv")?.unwrap_or(heads)),
    );
    if let Some(hd) = opt_u("attention.key_length")? {
        c.insert("head_dim".into(), json!(hd));
    }
    c.insert(
        "rms_norm_eps".into(),
        json!(opt_f("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5)),
    );
    c.insert(
        "rope_theta".into(),
        json!(opt_f("rope.freq_base")?.unwrap_or(10000.0)),
    );
    c.insert(
        "max_position_embeddings".into(),
        json!(opt_u("context_length")?.unwrap_or(4096)),
    );
    c.insert(
        "tie_word_embeddings".into(),
        json!(g.get_tensor("output.weight").is_none()),
    );
    if let Some(ff) = opt_u("feed_forward_length")? {
        c.insert("intermediate_size".into(), json!(ff));
    }
    if let Some(clip) = opt_f("attention.clamp_kqv")? {
        c.insert("clip_qkv".into(), json!(clip));
    }
    // llama.cpp keeps keys and values in f16 by default; run GGUF files the same way.
    c.insert("kv_f16".into(), json!(true));
    if arch == "qwen2" {
        c.insert("attention_bias".into(), json!(true));
    }
    if arch == "llama" {
        c.insert("rope_interleaved".into(), json!(true));
    }
    if experts > 0 {
        let used = need("expert_used_count")?;
        c.insert("num_experts".into(), json!(experts));
        c.insert("num_local_experts".into(), json!(experts));
        c.insert("num_experts_per_tok".into(), json!(used));
        if let Some(ff) = opt_u("expert_feed_forward_length")? {
            c.insert("moe_intermediate_size".into(), json!(ff));
            if model_type != "qwen3_moe" {
                c.insert("intermediate_size".into(), json!(ff));
            }
        }
        // Layers without a router are dense (a Qwen3-MoE `mlp_only_layers` checkpoint).
        let layers = need("block_count")? as usize;
        let dense: Vec<usize> = (0..layers)
            .filter(|l| {
                g.get_tensor(&format!("blk.{l}.ffn_gate_inp.weight"))
                    .is_none()
            })
            .collect();
        if !dense.is_empty() {
            c.insert("mlp_only_layers".into(), json!(dense));
        }
        // llama.cpp renormalises the top-k weights for qwen3moe (and mixtral), not olmoe.
        c.insert("norm_topk_prob".into(), json!(model_type != "olmoe"));
    }
    match g.get_str(&key("rope.scaling.type"))? {
        None | Some("none") => {}
        Some("linear") => {
            let factor = opt_f("rope.scaling.factor")?.unwrap_or(1.0);
            c.insert(
                "rope_scaling".into(),
                json!({"rope_type": "linear", "factor": factor}),
            );
        }
        Some("yarn") => {
            let factor = opt_f("rope.scaling.factor")?.unwrap_or(1.0);
            let orig = opt_u("rope.scaling.original_context_length")?.unwrap_or(4096);
            c.insert(
                "rope_scaling".into(),
                json!({"rope_type": "yarn", "factor": factor,
                       "original_max_position_embeddings": orig}),
            );
        }
        Some(other) => {
            return Err(Error::config(
                &path,
                key("rope.scaling.type"),
                format!("rope scaling `{other}` is not supported (supported: none, linear, yarn)"),
            ))
        }
    }
    if let Some(t) = g.get_tensor("rope_freqs.weight") {
        // Llama 3 style scaling: one divisor per rotated pair, as f32.
        if t.ggml_type != super::gguf::GgmlType::F32 || t.shape.len() != 1 {
            return Err(Error::tensor(
                &path,
                "rope_freqs.weight",
                format!(
                    "expected a 1-D f32 tensor, got {} {:?}",
                    t.ggml_type, t.shape
                ),
            ));
        }
        let bytes = g.read_tensor(t)?;
        let factors: Vec<f64> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
            .collect();
        c.insert("rope_freq_factors".into(), json!(factors));
    }
    if let Some(id) = g.get_u64("tokenizer.ggml.eos_token_id")? {
        c.insert("eos_token_id".into(), json!(id));
    }
    if let Some(id) = g.get_u64("tokenizer.ggml.bos_token_id")? {
        c.insert("bos_token_id".into(), json!(id));
    }
    Ok(ModelConfig::from_value(path, Value::Object(c)))
}

/// The HF name of a llama.cpp per-layer tensor suffix (`attn_q.weight` → `self_attn.q_proj.weight`).
fn hf_layer_name(rest: &str, mixtral: bool) -> Option<String> {
    let (base, ext) = rest.rsplit_once('.')?;
    let mapped = match base {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "ffn_gate_inp" if mixtral => "block_sparse_moe.gate",
        "ffn_gate_inp" => "mlp.gate",
        _ => return None,
    };
    Some(format!("{mapped}.{ext}"))
}

/// The HF name of expert `e`'s matrix (`gate`, `up` or `down`) in layer `l`.
fn expert_name(l: usize, e: usize, which: &str, mixtral: bool) -> String {
    if mixtral {
        let w = match which {
            "gate" => "w1",
            "down" => "w2",
            _ => "w3",
        };
        format!("model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight")
    } else {
        format!("model.layers.{l}.mlp.experts.{e}.{which}_proj.weight")
    }
}

fn dtype_of(g: &GgufFile, t: &GgufTensor) -> Result<DType> {
    QuantType::from_ggml_id(t.ggml_type.id())
        .map(DType::from_quant)
        .ok_or_else(|| {
            Error::tensor(
                g.path(),
                &t.name,
                format!(
                    "has ggml type {}, which this build cannot compute (supported: {})",
                    t.ggml_type,
                    QuantType::ALL.map(|q| q.name()).join(", ")
                ),
            )
        })
}

/// Every tensor of the file under its HF name; fused experts split per expert.
fn hf_tensors(g: &GgufFile, model_type: &str) -> Result<BTreeMap<String, TensorDesc>> {
    let mixtral = model_type == "mixtral";
    let mut out = BTreeMap::new();
    let mut put = |name: String, desc: TensorDesc| {
        out.insert(name, desc);
    };
    for t in g.tensors() {
        let desc =
            |name: &str, shape: Vec<usize>, offset: usize, len: usize| -> Result<TensorDesc> {
                Ok(TensorDesc {
                    name: name.to_string(),
                    shape,
                    dtype: dtype_of(g, t)?,
                    file: 0,
                    offset,
                    len,
                })
            };
        let top = match t.name.as_str() {
            "token_embd.weight" => Some("model.embed_tokens.weight"),
            "output_norm.weight" => Some("model.norm.weight"),
            "output.weight" => Some("lm_head.weight"),
            _ => None,
        };
        if let Some(hf) = top {
            put(hf.into(), desc(hf, t.shape.clone(), t.offset, t.len)?);
            continue;
        }
        let Some(rest) = t.name.strip_prefix("blk.") else {
            put(
                t.name.clone(),
                desc(&t.name, t.shape.clone(), t.offset, t.len)?,
            );
            continue;
        };
        let Some((layer, rest)) = rest.split_once('.') else {
            continue;
        };
        let Ok(l) = layer.parse::<usize>() else {
            continue;
        };
        // Fused routed experts: [E, rows, cols], one contiguous slice per expert.
        if let Some(which) = rest
            .strip_suffix("_exps.weight")
            .and_then(|b| b.strip_prefix("ffn_"))
        {
            if t.shape.len() != 3 || t.shape[0] == 0 || t.len % t.shape[0] != 0 {
                return Err(Error::tensor(
                    g.path(),
                    &t.name,
                    format!(
                        "fused experts must be [experts, rows, cols], got {:?}",
                        t.shape
                    ),
                ));
            }
            let n = t.shape[0];
            let per = t.len / n;
            for e in 0..n {
                let name = expert_name(l, e, which, mixtral);
                put(
                    name.clone(),
                    desc(&name, t.shape[1..].to_vec(), t.offset + e * per, per)?,
                );
            }
            continue;
        }
        // Per-expert tensors of older Mixtral files: ffn_gate.E.weight.
        let parts: Vec<&str> = rest.split('.').collect();
        if parts.len() == 3 && parts[2] == "weight" {
            if let (Some(which), Ok(e)) = (parts[0].strip_prefix("ffn_"), parts[1].parse::<usize>())
            {
                let name = expert_name(l, e, which, true);
                put(name.clone(), desc(&name, t.shape.clone(), t.offset, t.len)?);
                continue;
            }
        }
        match hf_layer_name(rest, mixtral) {
            Some(suffix) => {
                let name = format!("model.layers.{l}.{suffix}");
                put(name.clone(), desc(&name, t.shape.clone(), t.offset, t.len)?);
            }
            None => put(
                t.name.clone(),
                desc(&t.name, t.shape.clone(), t.offset, t.len)?,
            ),
        }
    }
    Ok(out)
}
