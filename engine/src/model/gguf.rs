//! A GGUF file seen as a model checkpoint: llama.cpp's architecture names, hyper-parameter
//! keys and tensor names mapped onto the Hugging Face `config.json` fields and tensor names
//! our families load, so one loader per family serves both formats. Which architecture
//! becomes which family, and where each family keeps its experts and routers, come from the
//! [`super::registry`]; the container itself is [`crate::format::gguf`].
//!
//! Routed experts stored fused (`blk.N.ffn_{gate,up,down}_exps.weight`, `[E, rows, cols]`)
//! become one tensor description per expert, each a contiguous slice of the fused tensor, so
//! the tiered store streams single experts from a GGUF file exactly as from safetensors.
//!
//! llama.cpp's converter permutes the Q and K rows of `llama` (and Mixtral, which it writes as
//! `llama`) for its adjacent-pair RoPE; instead of un-permuting quantized rows we keep them
//! and rotate adjacent pairs (`rope_interleaved` in the built configuration).
//!
//! ## DeepSeek-V3 family (`deepseek2`) and GLM-4.5 (`glm4moe`)
//!
//! Both become the Hugging Face families (`deepseek_v3`, `glm4_moe`) and run through their
//! loaders unchanged:
//! * Neither is permuted by llama.cpp's converter: MLA's rope dimensions are interleaved pairs
//!   in the Hugging Face weights already (`rope_interleave: true`, llama.cpp's "normal" RoPE),
//!   and GLM rotates halves (llama.cpp's NeoX RoPE, our default).
//! * MLA's `kv_b_proj` is `attn_kv_b` in older files; current converters split it into
//!   `attn_k_b` (`[H, kv_lora, nope]`: each head's key rows transposed) and `attn_v_b`
//!   (`[H, v, kv_lora]`). The split pair is put back together exactly, in memory
//!   ([`Checkpoint::insert_owned`]): in the files' own type when both are f32, f16 or bf16,
//!   else dequantized to f32 (exact values, four bytes each).
//! * The head sizes come from `attention.key_length_mla` / `value_length_mla` where present
//!   (there `key_length` / `value_length` describe the latent "MQA head"), else from
//!   `key_length` / `value_length`; `qk_rope_head_dim` is `rope.dimension_count`.
//! * Routing: `expert_gating_func` must be sigmoid (2); llama.cpp's default for a `deepseek2`
//!   file without it is DeepSeek-V2's softmax, which is refused by name. Missing
//!   `expert_weights_norm` / `expert_weights_scale` / `expert_group_count` mean what they mean
//!   to llama.cpp: no renormalisation, scale 1, no group limit.
//! * Yarn (`deepseek2`): llama.cpp rotates at magnitude 1 and puts `mscale(mscale_all_dim)²`
//!   on the softmax scale, with `mscale_all_dim = yarn_log_multiplier / 0.1` (its converter
//!   writes `0.1 · mscale_all_dim`); the built `rope_scaling` says exactly that
//!   (`attention_factor: 1`, `mscale_all_dim`).
//! * MTP (`nextn`) layers: `block_count` counts them, `nextn_predict_layers` says how many
//!   there are; they are the last blocks, and their tensors are left out altogether (the
//!   families' forward pass never reads them, llama.cpp skips them too).
//! * KV precision: `glm4moe` runs with llama.cpp's f16 K/V rounding (`kv_f16`) like every
//!   other GGUF file. llama.cpp's MLA keeps its latent cache in f16 as well, but the MLA code
//!   (model/mla.rs) has no f16 path, so a `deepseek2` file runs with f32 latents: bit for bit
//!   what its Hugging Face checkpoint gives, and llama.cpp's f16 rounding of the cached
//!   latents and rope keys is not reproduced.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::registry::{self, Experts, Family};
use crate::format::config::ModelConfig;
use crate::format::gguf::{GgmlType, GgufFile, GgufTensor, MAX_TENSORS};
use crate::format::safetensors::{numbered_parts, Access, Checkpoint, TensorDesc};
use crate::tensor::quant::QuantType;
use crate::tensor::{DType, Storage, Tensor};
use crate::{Error, Result};

/// Open a GGUF model: its metadata as a `config.json`-shaped configuration and its tensors
/// under Hugging Face names.
pub fn open(path: &Path, access: Access) -> Result<(GgufFile, ModelConfig, Checkpoint)> {
    let gguf = GgufFile::open(path)?;
    let config = config_from_gguf(&gguf)?;
    let (tensors, built) = hf_tensors(&gguf, &config)?;
    let mut ckpt = Checkpoint::from_descs(path, &[path.to_path_buf()], tensors, access)?;
    for b in built {
        ckpt.insert_owned(&b.name, b.shape, b.dtype, &b.bytes, path)?;
    }
    Ok((gguf, config, ckpt))
}

/// The `{arch}.*` metadata keys of a GGUF file, read with the file and the key named in errors.
struct ArchKeys<'a> {
    g: &'a GgufFile,
    arch: &'a str,
}

impl ArchKeys<'_> {
    /// The full key of `k` (`qwen3moe.block_count`).
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    /// An integer that must be there.
    fn need(&self, k: &str) -> Result<u64> {
        self.g.get_u64(&self.key(k))?.ok_or_else(|| {
            Error::config(self.g.path(), self.key(k), "missing from the GGUF metadata")
        })
    }

    /// An integer that may be missing.
    fn opt_u(&self, k: &str) -> Result<Option<u64>> {
        self.g.get_u64(&self.key(k))
    }

    /// A float that may be missing.
    fn opt_f(&self, k: &str) -> Result<Option<f64>> {
        self.g.get_f64(&self.key(k))
    }
}

/// Build the `config.json` our loaders read from the GGUF metadata.
pub fn config_from_gguf(g: &GgufFile) -> Result<ModelConfig> {
    let arch = g.architecture()?.to_string();
    let path = g.path().to_path_buf();
    let meta = ArchKeys { g, arch: &arch };
    let embd = g
        .get_tensor("token_embd.weight")
        .ok_or_else(|| Error::tensor(&path, "token_embd.weight", "missing from the GGUF file"))?;
    let vocab = embd.shape[0];
    // Counts are checked against the tensors the file holds before anything is built per
    // block or per expert.
    let experts = meta.opt_u("expert_count")?.unwrap_or(0);
    if experts > 0 {
        let present = experts_in_file(g);
        if experts > present as u64 {
            return Err(Error::config(
                &path,
                meta.key("expert_count"),
                format!("is {experts}, but the file has tensors for only {present} experts"),
            ));
        }
    }
    let used_count = || -> Result<u64> {
        let experts = meta.need("expert_count")?;
        let used = meta.need("expert_used_count")?;
        if used == 0 || used > experts {
            return Err(Error::config(
                &path,
                meta.key("expert_used_count"),
                format!(
                    "is {used}, but each token is routed to at least one and at most all of the \
                     {experts} experts (expert_count)"
                ),
            ));
        }
        Ok(used)
    };
    let model_type = match registry::by_gguf_arch(&arch, experts > 0) {
        Some(family) => family.model_type(),
        None => {
            return Err(Error::config(
                &path,
                "general.architecture",
                format!(
                    "GGUF architecture `{arch}` is not supported by this build (supported: {})",
                    registry::gguf_architectures().join(", ")
                ),
            ))
        }
    };
    let deepseek_family = matches!(arch.as_str(), "deepseek2" | "glm4moe");
    let heads = meta.need("attention.head_count")?;
    let hidden = meta.need("embedding_length")?;
    // MTP ("nextn") blocks are counted in block_count and come last.
    let blocks = meta.need("block_count")?;
    let present = numbered_parts(g.tensors().iter().map(|t| t.name.as_str()), "blk");
    if blocks > present as u64 {
        return Err(Error::config(
            &path,
            meta.key("block_count"),
            format!("is {blocks}, but the file has tensors for only {present} blocks (blk.N)"),
        ));
    }
    let nextn = meta.opt_u("nextn_predict_layers")?.unwrap_or(0);
    if nextn >= blocks {
        return Err(Error::config(
            &path,
            meta.key("nextn_predict_layers"),
            format!("is {nextn}, but block_count is only {blocks}"),
        ));
    }
    let layers = blocks - nextn;
    let mut c = Map::new();
    c.insert("model_type".into(), json!(model_type));
    c.insert("architectures".into(), json!([format!("GGUF {arch}")]));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("num_hidden_layers".into(), json!(layers));
    if nextn > 0 {
        c.insert("num_nextn_predict_layers".into(), json!(nextn));
    }
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert(
        "num_key_value_heads".into(),
        json!(meta.opt_u("attention.head_count_kv")?.unwrap_or(heads)),
    );
    if arch != "deepseek2" {
        // (deepseek2's key_length is the latent "MQA head" or nope + rope, never head_dim.)
        if let Some(hd) = meta.opt_u("attention.key_length")? {
            c.insert("head_dim".into(), json!(hd));
        }
    }
    c.insert(
        "rms_norm_eps".into(),
        json!(meta
            .opt_f("attention.layer_norm_rms_epsilon")?
            .unwrap_or(1e-5)),
    );
    c.insert(
        "rope_theta".into(),
        json!(meta.opt_f("rope.freq_base")?.unwrap_or(10000.0)),
    );
    c.insert(
        "max_position_embeddings".into(),
        json!(meta.opt_u("context_length")?.unwrap_or(4096)),
    );
    c.insert(
        "tie_word_embeddings".into(),
        json!(g.get_tensor("output.weight").is_none()),
    );
    if let Some(ff) = meta.opt_u("feed_forward_length")? {
        c.insert("intermediate_size".into(), json!(ff));
    }
    if let Some(clip) = meta.opt_f("attention.clamp_kqv")? {
        c.insert("clip_qkv".into(), json!(clip));
    }
    // llama.cpp keeps keys and values in f16 by default; run GGUF files the same way. (Not
    // MLA: see the module docs.)
    if arch != "deepseek2" {
        c.insert("kv_f16".into(), json!(true));
    }
    if arch == "qwen2" {
        c.insert("attention_bias".into(), json!(true));
    }
    if arch == "llama" {
        c.insert("rope_interleaved".into(), json!(true));
    }
    if deepseek_family {
        deepseek_family_config(g, &arch, &mut c, layers, vocab, used_count()?)?;
    } else if experts > 0 {
        let used = used_count()?;
        c.insert("num_experts".into(), json!(experts));
        c.insert("num_local_experts".into(), json!(experts));
        c.insert("num_experts_per_tok".into(), json!(used));
        if let Some(ff) = meta.opt_u("expert_feed_forward_length")? {
            c.insert("moe_intermediate_size".into(), json!(ff));
            if model_type != "qwen3_moe" {
                c.insert("intermediate_size".into(), json!(ff));
            }
        }
        // Layers without a router are dense (a Qwen3-MoE `mlp_only_layers` checkpoint).
        let layers = meta.need("block_count")? as usize;
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
    match g.get_str(&meta.key("rope.scaling.type"))? {
        None | Some("none") => {}
        Some("linear") => {
            let factor = meta.opt_f("rope.scaling.factor")?.unwrap_or(1.0);
            c.insert(
                "rope_scaling".into(),
                json!({"rope_type": "linear", "factor": factor}),
            );
        }
        Some("yarn") => {
            let factor = meta.opt_f("rope.scaling.factor")?.unwrap_or(1.0);
            let orig = meta
                .opt_u("rope.scaling.original_context_length")?
                .unwrap_or(4096);
            let mut yarn = json!({"rope_type": "yarn", "factor": factor,
                                  "original_max_position_embeddings": orig});
            for (k, field) in [
                ("rope.scaling.yarn_beta_fast", "beta_fast"),
                ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ] {
                if let Some(b) = meta.opt_f(k)? {
                    yarn[field] = json!(b);
                }
            }
            if arch == "deepseek2" {
                // llama.cpp's deepseek2 graph: rotation magnitude 1 (it cancels yarn's), the
                // softmax scale times mscale(yarn_log_multiplier / 0.1)².
                for k in [
                    "rope.scaling.yarn_attn_factor",
                    "rope.scaling.attn_factor",
                    "rope.scaling.yarn_ext_factor",
                ] {
                    if let Some(v) = meta.opt_f(k)?.filter(|&v| v != 1.0) {
                        return Err(Error::config(
                            &path,
                            meta.key(k),
                            format!("is {v}; this build runs deepseek2 yarn with 1 only"),
                        ));
                    }
                }
                yarn["attention_factor"] = json!(1.0);
                if let Some(m) = meta.opt_f("rope.scaling.yarn_log_multiplier")? {
                    // Undo the converter's 0.1 in f32, as llama.cpp's loader does.
                    yarn["mscale_all_dim"] = json!((m as f32 / 0.1f32) as f64);
                }
            }
            c.insert("rope_scaling".into(), yarn);
        }
        Some(other) => {
            return Err(Error::config(
                &path,
                meta.key("rope.scaling.type"),
                format!("rope scaling `{other}` is not supported (supported: none, linear, yarn)"),
            ))
        }
    }
    if let Some(t) = g.get_tensor("rope_freqs.weight") {
        // Llama 3 style scaling: one divisor per rotated pair, as f32.
        if t.ggml_type != GgmlType::F32 || t.shape.len() != 1 {
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

/// The `deepseek2` / `glm4moe` part of the configuration: DeepSeek's MoE and, for
/// `deepseek2`, MLA's sizes; for `glm4moe`, the partial rotary factor, biases and q/k norms.
fn deepseek_family_config(
    g: &GgufFile,
    arch: &str,
    c: &mut Map<String, Value>,
    layers: u64,
    vocab: usize,
    experts_used: u64,
) -> Result<()> {
    let path = g.path().to_path_buf();
    let meta = ArchKeys { g, arch };

    // Routing. llama_expert_gating_func_type: 1 softmax, 2 sigmoid, 3 softmax over the
    // selected experts. Without the key llama.cpp routes deepseek2 with softmax (DeepSeek-V2
    // / V2.5 files), except GLM-4.7-Flash-sized ones, and glm4moe with sigmoid.
    let gating = meta.opt_u("expert_gating_func")?;
    let sigmoid = match gating {
        Some(2) => true,
        Some(_) => false,
        None => arch == "glm4moe" || ((layers == 47 || layers == 48) && vocab == 154880),
    };
    if !sigmoid {
        let message = match gating {
            Some(v) => format!(
                "is {v} ({}); this build routes {arch} with sigmoid (2) only",
                match v {
                    1 => "softmax",
                    3 => "softmax over the selected experts",
                    _ => "unknown",
                }
            ),
            None => format!(
                "missing: llama.cpp then routes {arch} with softmax (DeepSeek-V2 / V2.5), which \
                 this build does not run (it routes with sigmoid, expert_gating_func = 2)"
            ),
        };
        return Err(Error::config(
            &path,
            meta.key("expert_gating_func"),
            message,
        ));
    }
    let experts = meta.need("expert_count")?;
    c.insert("n_routed_experts".into(), json!(experts));
    c.insert("num_experts_per_tok".into(), json!(experts_used));
    c.insert(
        "moe_intermediate_size".into(),
        json!(meta.need("expert_feed_forward_length")?),
    );
    c.insert(
        "n_shared_experts".into(),
        json!(meta.opt_u("expert_shared_count")?.unwrap_or(0)),
    );
    let dense = meta.opt_u("leading_dense_block_count")?.unwrap_or(0);
    c.insert("first_k_dense_replace".into(), json!(dense));
    if dense > 0 {
        c.insert(
            "intermediate_size".into(),
            json!(meta.need("feed_forward_length")?),
        );
    }
    let groups = meta.opt_u("expert_group_count")?.unwrap_or(0).max(1);
    c.insert("n_group".into(), json!(groups));
    c.insert(
        "topk_group".into(),
        json!(meta
            .opt_u("expert_group_used_count")?
            .filter(|&n| n > 0)
            .unwrap_or(groups)),
    );
    c.insert(
        "norm_topk_prob".into(),
        json!(g
            .get_bool(&meta.key("expert_weights_norm"))?
            .unwrap_or(false)),
    );
    c.insert(
        "routed_scaling_factor".into(),
        json!(meta
            .opt_f("expert_weights_scale")?
            .filter(|&s| s != 0.0)
            .unwrap_or(1.0)),
    );
    c.insert("scoring_func".into(), json!("sigmoid"));

    if arch == "deepseek2" {
        let kv_lora = meta.need("attention.kv_lora_rank")?;
        let rope = meta.need("rope.dimension_count")?;
        let (qk, qk_key) = match meta.opt_u("attention.key_length_mla")? {
            Some(k) => (k, "attention.key_length_mla"),
            None => (meta.need("attention.key_length")?, "attention.key_length"),
        };
        let v = match meta.opt_u("attention.value_length_mla")? {
            Some(v) => v,
            None => meta.need("attention.value_length")?,
        };
        if qk <= rope || rope % 2 != 0 {
            return Err(Error::config(
                &path,
                meta.key(qk_key),
                format!(
                    "is {qk}, which leaves no even split into nope + rope with rope.dimension_count = {rope}"
                ),
            ));
        }
        c.insert("kv_lora_rank".into(), json!(kv_lora));
        c.insert("qk_rope_head_dim".into(), json!(rope));
        c.insert("qk_nope_head_dim".into(), json!(qk - rope));
        c.insert("v_head_dim".into(), json!(v));
        match meta.opt_u("attention.q_lora_rank")?.filter(|&q| q > 0) {
            Some(q) => {
                c.insert("q_lora_rank".into(), json!(q));
            }
            None if g.get_tensor("blk.0.attn_q_a.weight").is_some() => {
                return Err(Error::config(
                    &path,
                    meta.key("attention.q_lora_rank"),
                    "missing from the GGUF metadata, but the file has low-rank queries (blk.0.attn_q_a)",
                ))
            }
            None => {}
        }
        c.insert("rope_interleave".into(), json!(true));
    } else {
        let hidden = c["hidden_size"].as_u64().unwrap_or(0);
        let hd = match c.get("head_dim").and_then(|v| v.as_u64()) {
            Some(hd) => hd,
            None => hidden
                .checked_div(meta.need("attention.head_count")?)
                .ok_or_else(|| Error::config(&path, meta.key("attention.head_count"), "is 0"))?,
        };
        let rot = meta.opt_u("rope.dimension_count")?.unwrap_or(hd);
        let partial = rot as f64 / hd.max(1) as f64;
        if rot > hd || rot % 2 != 0 || (hd as f64 * partial) as u64 != rot {
            return Err(Error::config(
                &path,
                meta.key("rope.dimension_count"),
                format!("is {rot}, which is no even part of the head dimension {hd}"),
            ));
        }
        c.insert("partial_rotary_factor".into(), json!(partial));
        c.insert(
            "attention_bias".into(),
            json!(g.get_tensor("blk.0.attn_q.bias").is_some()),
        );
        c.insert(
            "use_qk_norm".into(),
            json!(g.get_tensor("blk.0.attn_q_norm.weight").is_some()),
        );
    }
    Ok(())
}

/// How many experts the file's tensors hold: the most of a fused `ffn_*_exps` tensor
/// (`[experts, rows, cols]`), or of the numbered per-expert tensors of older Mixtral files
/// (`blk.N.ffn_gate.E.weight`).
fn experts_in_file(g: &GgufFile) -> usize {
    let names = || g.tensors().iter().map(|t| t.name.as_str());
    let fused = g
        .tensors()
        .iter()
        .filter(|t| t.name.ends_with("_exps.weight") && t.shape.len() == 3)
        .map(|t| t.shape[0])
        .max()
        .unwrap_or(0);
    ["ffn_gate", "ffn_up", "ffn_down"]
        .iter()
        .map(|s| numbered_parts(names(), s))
        .fold(fused, usize::max)
}

/// The HF name of a llama.cpp per-layer tensor suffix (`attn_q.weight` → `self_attn.q_proj.weight`),
/// the router under the family's MoE block (`experts`).
fn hf_layer_name(rest: &str, experts: &Experts, glm: bool) -> Option<String> {
    if rest == "exp_probs_b.bias" || rest == "exp_probs_b.weight" {
        return Some("mlp.gate.e_score_correction_bias".into());
    }
    let (base, ext) = rest.rsplit_once('.')?;
    let mapped = match base {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" if glm => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "attn_q_a" => "self_attn.q_a_proj",
        "attn_q_a_norm" => "self_attn.q_a_layernorm",
        "attn_q_b" => "self_attn.q_b_proj",
        "attn_kv_a_mqa" => "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm" => "self_attn.kv_a_layernorm",
        "attn_kv_b" => "self_attn.kv_b_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "ffn_gate_shexp" => "mlp.shared_experts.gate_proj",
        "ffn_up_shexp" => "mlp.shared_experts.up_proj",
        "ffn_down_shexp" => "mlp.shared_experts.down_proj",
        "ffn_gate_inp" => return Some(format!("{}.gate.{ext}", experts.block)),
        _ => return None,
    };
    Some(format!("{mapped}.{ext}"))
}

/// The HF name of expert `e`'s matrix `which` (llama.cpp's `gate`, `up` or `down`) in layer
/// `l`, where the family keeps its experts; another `which` keeps its own name.
fn expert_name(l: usize, e: usize, which: &str, experts: &Experts) -> String {
    let names = experts.names("model", l, e);
    match which {
        "gate" => names.gate,
        "up" => names.up,
        "down" => names.down,
        other => format!("{}.experts.{e}.{other}.weight", experts.block("model", l)),
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

/// A tensor built in memory from others (MLA's `kv_b_proj` from a split file).
struct Built {
    name: String,
    shape: Vec<usize>,
    dtype: DType,
    bytes: Vec<u8>,
}

/// Every tensor of the file under its HF name, and the tensors built from others; fused
/// experts split per expert, MTP (`nextn`) blocks left out.
fn hf_tensors(
    g: &GgufFile,
    cfg: &ModelConfig,
) -> Result<(BTreeMap<String, TensorDesc>, Vec<Built>)> {
    let family: &Family = registry::family_of(cfg)?;
    let model_type = family.model_type();
    // Where the family keeps experts and routers (a dense llama file has neither).
    let experts = family.experts.unwrap_or(Experts::QWEN);
    let glm = model_type == "glm4_moe";
    let layers = cfg.usize("num_hidden_layers")?;
    let mut out = BTreeMap::new();
    let mut put = |name: String, desc: TensorDesc| {
        out.insert(name, desc);
    };
    // MLA's split kv_b per layer: (attn_k_b, attn_v_b).
    type Split<'a> = (Option<&'a GgufTensor>, Option<&'a GgufTensor>);
    let mut split: BTreeMap<usize, Split> = BTreeMap::new();
    let mut split_descs = 0usize;
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
        if l >= layers {
            // An MTP ("nextn") block: not part of the forward pass.
            continue;
        }
        // Fused routed experts: [E, rows, cols], one contiguous slice per expert.
        if let Some(which) = rest
            .strip_suffix("_exps.weight")
            .and_then(|b| b.strip_prefix("ffn_"))
        {
            if t.shape.len() != 3 || t.shape[0] == 0 || t.len % t.shape[0] != 0 || t.len == 0 {
                return Err(Error::tensor(
                    g.path(),
                    &t.name,
                    format!(
                        "fused experts must be [experts, rows, cols] with no empty dimension, got {:?}",
                        t.shape
                    ),
                ));
            }
            let n = t.shape[0];
            let per = t.len / n;
            // One description per expert (two for fused gate/up): bounded like a file's own
            // tensor count, so a few bytes of tiny experts cannot make millions of them.
            split_descs += n * if which == "gate_up" { 2 } else { 1 };
            if split_descs > MAX_TENSORS as usize {
                return Err(Error::tensor(
                    g.path(),
                    &t.name,
                    format!(
                        "the fused experts split into more than {MAX_TENSORS} tensors ({n} experts here)"
                    ),
                ));
            }
            if which == "gate_up" {
                // Gate and up fused along the rows: the first half of each expert's rows is
                // its gate, the second its up (llama.cpp's `ffn_gate_up_exps`).
                if t.shape[1] % 2 != 0 || per % 2 != 0 {
                    return Err(Error::tensor(
                        g.path(),
                        &t.name,
                        format!(
                            "fused gate/up experts need an even row count, got {:?}",
                            t.shape
                        ),
                    ));
                }
                let shape = vec![t.shape[1] / 2, t.shape[2]];
                for e in 0..n {
                    for (half, part) in ["gate", "up"].into_iter().enumerate() {
                        let name = expert_name(l, e, part, &experts);
                        let offset = t.offset + e * per + half * per / 2;
                        put(name.clone(), desc(&name, shape.clone(), offset, per / 2)?);
                    }
                }
                continue;
            }
            for e in 0..n {
                let name = expert_name(l, e, which, &experts);
                put(
                    name.clone(),
                    desc(&name, t.shape[1..].to_vec(), t.offset + e * per, per)?,
                );
            }
            continue;
        }
        match rest {
            "attn_k_b.weight" => {
                split.entry(l).or_default().0 = Some(t);
                continue;
            }
            "attn_v_b.weight" => {
                split.entry(l).or_default().1 = Some(t);
                continue;
            }
            _ => {}
        }
        // Per-expert tensors of older Mixtral files: ffn_gate.E.weight.
        let parts: Vec<&str> = rest.split('.').collect();
        if parts.len() == 3 && parts[2] == "weight" {
            if let (Some(which), Ok(e)) = (parts[0].strip_prefix("ffn_"), parts[1].parse::<usize>())
            {
                let name = expert_name(l, e, which, &super::mixtral::EXPERTS);
                put(name.clone(), desc(&name, t.shape.clone(), t.offset, t.len)?);
                continue;
            }
        }
        match hf_layer_name(rest, &experts, glm) {
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
    let mut built = Vec::new();
    if model_type == "deepseek_v3" {
        for l in 0..layers {
            let name = format!("model.layers.{l}.self_attn.kv_b_proj.weight");
            if out.contains_key(&name) {
                // A file with both forms: the original attn_kv_b is used.
                continue;
            }
            match split.get(&l) {
                Some((Some(k_b), Some(v_b))) => {
                    built.push(kv_b_from_split(g, cfg, k_b, v_b, name)?);
                }
                other => {
                    let missing = match other {
                        Some((Some(_), None)) => format!("blk.{l}.attn_v_b.weight"),
                        Some((None, Some(_))) => format!("blk.{l}.attn_k_b.weight"),
                        _ => format!("blk.{l}.attn_kv_b.weight"),
                    };
                    return Err(Error::tensor(
                        g.path(),
                        missing,
                        format!(
                            "missing from the GGUF file (layer {l} needs attn_kv_b, or attn_k_b with attn_v_b)"
                        ),
                    ));
                }
            }
        }
    }
    Ok((out, built))
}

/// MLA's `kv_b_proj` (`[H·(nope + v), kv_lora]`) rebuilt exactly from llama.cpp's split
/// tensors: `attn_k_b` (`[H, kv_lora, nope]`, each head's key rows transposed) and `attn_v_b`
/// (`[H, v, kv_lora]`). Kept in the files' type when both are f32, f16 or bf16 (elements are
/// only moved); quantized ones are dequantized to f32.
fn kv_b_from_split(
    g: &GgufFile,
    cfg: &ModelConfig,
    k_b: &GgufTensor,
    v_b: &GgufTensor,
    name: String,
) -> Result<Built> {
    let heads = cfg.usize("num_attention_heads")?;
    let r = cfg.usize("kv_lora_rank")?;
    let nope = cfg.usize("qk_nope_head_dim")?;
    let v = cfg.usize("v_head_dim")?;
    for (t, want) in [(k_b, [heads, r, nope]), (v_b, [heads, v, r])] {
        if t.shape != want {
            return Err(Error::tensor(
                g.path(),
                &t.name,
                format!(
                    "has shape {:?}, expected {want:?} (heads, kv_lora_rank, qk_nope_head_dim / v_head_dim) from the GGUF metadata",
                    t.shape
                ),
            ));
        }
    }
    let (kd, vd) = (dtype_of(g, k_b)?, dtype_of(g, v_b)?);
    let (kb, vb) = (g.read_tensor(k_b)?, g.read_tensor(v_b)?);
    let rows = heads * (nope + v);
    if kd == vd && matches!(kd, DType::F32 | DType::F16 | DType::BF16) {
        let es = kd.size();
        let mut bytes = vec![0u8; rows * r * es];
        for h in 0..heads {
            for i in 0..nope {
                for c in 0..r {
                    let dst = ((h * (nope + v) + i) * r + c) * es;
                    let src = ((h * r + c) * nope + i) * es;
                    bytes[dst..dst + es].copy_from_slice(&kb[src..src + es]);
                }
            }
            for j in 0..v {
                let dst = (h * (nope + v) + nope + j) * r * es;
                let src = (h * v + j) * r * es;
                bytes[dst..dst + r * es].copy_from_slice(&vb[src..src + r * es]);
            }
        }
        return Ok(Built {
            name,
            shape: vec![rows, r],
            dtype: kd,
            bytes,
        });
    }
    let dequantize = |t: &GgufTensor, dtype: DType, data: &[u8], rows: usize, cols: usize| {
        let tensor = Tensor {
            name: t.name.clone(),
            shape: vec![rows, cols],
            dtype,
            storage: Storage::owned(data),
            block_scales: None,
            device: None,
            interleaved: None,
        };
        tensor.to_f32_vec()
    };
    let kf = dequantize(k_b, kd, &kb, heads * r, nope)?;
    let vf = dequantize(v_b, vd, &vb, heads * v, r)?;
    let mut values = vec![0.0f32; rows * r];
    for h in 0..heads {
        for i in 0..nope {
            for c in 0..r {
                values[(h * (nope + v) + i) * r + c] = kf[(h * r + c) * nope + i];
            }
        }
        for j in 0..v {
            let dst = (h * (nope + v) + nope + j) * r;
            values[dst..dst + r].copy_from_slice(&vf[(h * v + j) * r..(h * v + j + 1) * r]);
        }
    }
    Ok(Built {
        name,
        shape: vec![rows, r],
        dtype: DType::F32,
        bytes: values.iter().flat_map(|x| x.to_le_bytes()).collect(),
    })
}
