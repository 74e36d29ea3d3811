//! Hugging Face checkpoint → GGUF, the way llama.cpp's converter and quantizer name, order
//! and quantize things, so llama.cpp loads and runs the file.
//!
//! One tensor is held at a time (rows are converted in parallel chunks and streamed to a
//! temporary file that is renamed into place at the end). Q and K rows of `llama`/`mixtral`
//! are permuted for llama.cpp's adjacent-pair RoPE; routed experts are fused into
//! `ffn_{gate,up,down}_exps` tensors, expert by expert. Quantization uses the deterministic
//! reference quantizers (what llama.cpp does without an importance matrix).
//!
//! Mixes: `q8_0`, `q6_k`, `bf16` are uniform; `q4_k_m` and `q5_k_m` follow llama.cpp's
//! rules for those names: `output.weight` Q6_K, `attn_v` and `ffn_down` (also for experts) Q6_K
//! in the layers llama.cpp gives more bits (the first and last eighth and every third in
//! between), the rest Q4_K / Q5_K. Rows whose length is not a multiple of 256 fall back as
//! llama.cpp does (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0). Norms, biases and routers stay f32.

use std::path::Path;

use rayon::prelude::*;
use serde_json::Value;

use super::config::ModelConfig;
use super::gguf::{GgmlType, GgufArray, GgufTensorSpec, GgufValue, GgufWriter};
use super::safetensors::Checkpoint;
use crate::tensor::quant::{quantize_row, QuantType};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// The target mixes of `coli convert --type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvertType {
    Q8_0,
    Q6K,
    Q5KM,
    Q4KM,
    BF16,
    F16,
    /// Lossless (tests and references).
    F32,
}

impl ConvertType {
    /// Parse `q8_0`, `q6_k`, `q5_k_m`, `q4_k_m`, `bf16`, `f16` or `f32`.
    pub fn parse(s: &str) -> Result<ConvertType> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "q8_0" => ConvertType::Q8_0,
            "q6_k" => ConvertType::Q6K,
            "q5_k_m" => ConvertType::Q5KM,
            "q4_k_m" => ConvertType::Q4KM,
            "bf16" => ConvertType::BF16,
            "f16" => ConvertType::F16,
            "f32" => ConvertType::F32,
            other => {
                return Err(Error::Invalid(format!(
                "unknown GGUF type `{other}` (choose q8_0, q6_k, q5_k_m, q4_k_m, bf16, f16 or f32)"
            )))
            }
        })
    }

    /// llama.cpp's `general.file_type` (`enum llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            ConvertType::F32 => 0,
            ConvertType::F16 => 1,
            ConvertType::Q8_0 => 7,
            ConvertType::Q4KM => 15,
            ConvertType::Q5KM => 17,
            ConvertType::Q6K => 18,
            ConvertType::BF16 => 32,
        }
    }
}

/// What a conversion wrote.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub tensors: usize,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Tensors per ggml type written.
    pub types: Vec<(String, usize)>,
    pub warnings: Vec<String>,
}

/// One tensor to write: its GGUF name, row-major shape, type and where its rows come from.
struct Plan {
    name: String,
    shape: Vec<usize>,
    ty: QuantType,
    /// HF tensors whose rows are concatenated (one for plain tensors, one per expert for
    /// fused experts).
    sources: Vec<String>,
    /// Heads whose rows are permuted for llama.cpp's RoPE (Q/K of llama and mixtral).
    permute_heads: Option<usize>,
    /// Bytes computed here rather than read (`rope_freqs.weight`).
    computed: Option<Vec<u8>>,
}

/// llama.cpp's `use_more_bits`: the layers its `_M` mixes give more bits.
fn use_more_bits(layer: usize, layers: usize) -> bool {
    layer < layers / 8
        || layer >= 7 * layers / 8
        || (layer as isize - (layers / 8) as isize) % 3 == 2
}

fn choose_type(
    mix: ConvertType,
    gguf_name: &str,
    cols: usize,
    layer: Option<usize>,
    layers: usize,
) -> QuantType {
    let base = match mix {
        ConvertType::Q8_0 => QuantType::Q8_0,
        ConvertType::Q6K => QuantType::Q6_K,
        ConvertType::Q5KM => QuantType::Q5_K,
        ConvertType::Q4KM => QuantType::Q4_K,
        ConvertType::BF16 => return QuantType::BF16,
        ConvertType::F16 => return QuantType::F16,
        ConvertType::F32 => return QuantType::F32,
    };
    let more = layer.is_some_and(|l| use_more_bits(l, layers));
    let ty = match mix {
        ConvertType::Q5KM | ConvertType::Q4KM => {
            if gguf_name == "output.weight"
                || ((gguf_name.contains("attn_v.") || gguf_name.contains("ffn_down")) && more)
            {
                QuantType::Q6_K
            } else {
                base
            }
        }
        _ => base,
    };
    if cols.is_multiple_of(ty.block_size()) {
        return ty;
    }
    let fallback = match ty {
        QuantType::Q4_K => QuantType::Q5_0,
        QuantType::Q5_K => QuantType::Q5_1,
        _ => QuantType::Q8_0,
    };
    if cols.is_multiple_of(fallback.block_size()) {
        fallback
    } else {
        QuantType::F16
    }
}

fn ggml(q: QuantType) -> GgmlType {
    GgmlType::from_id(q.ggml_id()).expect("every QuantType is a ggml type")
}

/// The llama.cpp architecture name and per-family facts.
struct Family {
    arch: &'static str,
    permute_qk: bool,
    experts: usize,
    expert_prefix: fn(usize, usize) -> String,
    expert_names: [&'static str; 3],
    router: fn(usize) -> String,
}

fn family(cfg: &ModelConfig) -> Result<Family> {
    let mt = cfg.model_type()?;
    let qwen_prefix = |l: usize, e: usize| format!("model.layers.{l}.mlp.experts.{e}");
    let qwen_router = |l: usize| format!("model.layers.{l}.mlp.gate.weight");
    Ok(match mt.as_str() {
        "llama" => Family {
            arch: "llama",
            permute_qk: true,
            experts: 0,
            expert_prefix: qwen_prefix,
            expert_names: ["gate_proj", "up_proj", "down_proj"],
            router: qwen_router,
        },
        "mixtral" => Family {
            arch: "llama",
            permute_qk: true,
            experts: cfg.usize("num_local_experts")?,
            expert_prefix: |l, e| format!("model.layers.{l}.block_sparse_moe.experts.{e}"),
            expert_names: ["w1", "w3", "w2"],
            router: |l| format!("model.layers.{l}.block_sparse_moe.gate.weight"),
        },
        "olmoe" => Family {
            arch: "olmoe",
            permute_qk: false,
            experts: cfg.usize("num_experts")?,
            expert_prefix: qwen_prefix,
            expert_names: ["gate_proj", "up_proj", "down_proj"],
            router: qwen_router,
        },
        "qwen3_moe" => Family {
            arch: "qwen3moe",
            permute_qk: false,
            experts: cfg.usize("num_experts")?,
            expert_prefix: qwen_prefix,
            expert_names: ["gate_proj", "up_proj", "down_proj"],
            router: qwen_router,
        },
        other => {
            return Err(Error::config(
                cfg.path(),
                "model_type",
                format!("converting `{other}` to GGUF is not supported (supported: llama, mixtral, olmoe, qwen3_moe)"),
            ))
        }
    })
}

/// Convert the Hugging Face model in `dir` to a GGUF file at `out`. `progress(done, total)`
/// is called with source bytes after each tensor.
pub fn convert(
    dir: &Path,
    out: &Path,
    mix: ConvertType,
    mut progress: impl FnMut(u64, u64),
) -> Result<ConvertReport> {
    let cfg = ModelConfig::from_model_dir(dir)?;
    let fam = family(&cfg)?;
    let ckpt = Checkpoint::open(dir)?;
    let mut warnings = Vec::new();
    let layers = cfg.usize("num_hidden_layers")?;
    let hidden = cfg.usize("hidden_size")?;
    let heads = cfg.usize("num_attention_heads")?;
    let kv_heads = cfg.usize_or("num_key_value_heads", heads)?;
    let head_dim = cfg.usize_or("head_dim", hidden / heads)?;
    let rope = cfg.rope(10000.0)?;
    if let Some(w) = cfg.get("sliding_window").and_then(|v| v.as_u64()) {
        if fam.arch == "llama" {
            warnings.push(format!(
                "config.json has sliding_window = {w}; GGUF's llama architecture has none, so llama.cpp (and colibri on this file) attend to the whole context"
            ));
        }
    }
    if rope.partial_rotary_factor != 1.0 {
        return Err(Error::Unsupported(
            "partial rotary embeddings in GGUF export".into(),
        ));
    }

    // Metadata.
    let a = fam.arch;
    let u32v = |v: usize| GgufValue::U32(v as u32);
    let mut md: Vec<(String, GgufValue)> = vec![
        ("general.architecture".into(), GgufValue::String(a.into())),
        (
            "general.name".into(),
            GgufValue::String(
                dir.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "model".into()),
            ),
        ),
        ("general.file_type".into(), GgufValue::U32(mix.file_type())),
        ("general.quantization_version".into(), GgufValue::U32(2)),
        (format!("{a}.block_count"), u32v(layers)),
        (
            format!("{a}.context_length"),
            u32v(cfg.usize_or("max_position_embeddings", 4096)?),
        ),
        (format!("{a}.embedding_length"), u32v(hidden)),
        (format!("{a}.attention.head_count"), u32v(heads)),
        (format!("{a}.attention.head_count_kv"), u32v(kv_heads)),
        (format!("{a}.attention.key_length"), u32v(head_dim)),
        (format!("{a}.attention.value_length"), u32v(head_dim)),
        (format!("{a}.rope.dimension_count"), u32v(head_dim)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            GgufValue::F32(cfg.f64_or("rms_norm_eps", 1e-6)? as f32),
        ),
        (
            format!("{a}.rope.freq_base"),
            GgufValue::F32(rope.theta as f32),
        ),
        (format!("{a}.vocab_size"), u32v(cfg.usize("vocab_size")?)),
    ];
    if let Some(c) = cfg.get("clip_qkv").and_then(|v| v.as_f64()) {
        md.push((format!("{a}.attention.clamp_kqv"), GgufValue::F32(c as f32)));
    }
    match &rope.kind {
        crate::format::config::RopeKind::Default => {}
        crate::format::config::RopeKind::Linear { factor } => {
            md.push((
                format!("{a}.rope.scaling.type"),
                GgufValue::String("linear".into()),
            ));
            md.push((
                format!("{a}.rope.scaling.factor"),
                GgufValue::F32(*factor as f32),
            ));
        }
        crate::format::config::RopeKind::Llama3 { .. } => {}
        other => {
            return Err(Error::Unsupported(format!(
                "GGUF export of RoPE scaling {other:?}"
            )))
        }
    }
    let inter_key = if fam.experts > 0 && cfg.get("moe_intermediate_size").is_some() {
        "moe_intermediate_size"
    } else {
        "intermediate_size"
    };
    let expert_inter = cfg.usize(inter_key)?;
    if fam.experts > 0 {
        md.push((format!("{a}.expert_count"), u32v(fam.experts)));
        md.push((
            format!("{a}.expert_used_count"),
            u32v(cfg.usize("num_experts_per_tok")?),
        ));
        md.push((
            format!("{a}.expert_feed_forward_length"),
            u32v(expert_inter),
        ));
        let norm = cfg.bool_or("norm_topk_prob", fam.arch == "llama")?;
        let llama_norm = fam.arch != "olmoe";
        if norm != llama_norm {
            warnings.push(format!(
                "config.json has norm_topk_prob = {norm}, but llama.cpp's `{a}` always uses {llama_norm}: llama.cpp will route differently from colibri on this file"
            ));
        }
    }
    if cfg.get("intermediate_size").is_some() {
        md.push((
            format!("{a}.feed_forward_length"),
            u32v(cfg.usize("intermediate_size")?),
        ));
    } else {
        md.push((format!("{a}.feed_forward_length"), u32v(expert_inter)));
    }
    tokenizer_metadata(dir, &cfg, &mut md, &mut warnings)?;

    // Tensors, in llama.cpp's order: embeddings, layers, final norm, output.
    let vocab = cfg.usize("vocab_size")?;
    let mut plans = Vec::new();
    let plan_one =
        |name: String, src: String, permute: Option<usize>, layer: Option<usize>| -> Result<Plan> {
            let d = ckpt.desc(&src)?;
            let shape = d.shape.clone();
            let ty = if shape.len() == 1 || name.contains("ffn_gate_inp") {
                QuantType::F32
            } else {
                choose_type(mix, &name, *shape.last().unwrap(), layer, layers)
            };
            Ok(Plan {
                name,
                shape,
                ty,
                sources: vec![src],
                permute_heads: permute,
                computed: None,
            })
        };
    macro_rules! plan {
        ($($a:expr),*) => { plans.push(plan_one($($a),*)?) };
    }
    if let crate::format::config::RopeKind::Llama3 {
        factor,
        low_freq_factor: lo,
        high_freq_factor: hi,
        original_max_position_embeddings: omp,
    } = rope.kind
    {
        // llama.cpp stores llama 3 scaling as one divisor per rotated pair.
        let theta = rope.theta as f32;
        let factors: Vec<f32> = (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf((2 * i) as f32 / head_dim as f32);
                let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
                if wavelen < omp / hi {
                    1.0
                } else if wavelen > omp / lo {
                    factor as f32
                } else {
                    let smooth = (omp / wavelen - lo) / (hi - lo);
                    (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
                }
            })
            .collect();
        plans.push(Plan {
            name: "rope_freqs.weight".into(),
            shape: vec![head_dim / 2],
            ty: QuantType::F32,
            sources: vec![],
            permute_heads: None,
            computed: Some(factors.iter().flat_map(|f| f.to_le_bytes()).collect()),
        });
    }
    plan!(
        "token_embd.weight".into(),
        "model.embed_tokens.weight".into(),
        None,
        None
    );
    let qk = |n: usize| if fam.permute_qk { Some(n) } else { None };
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        let b = format!("blk.{l}");
        let mut pairs: Vec<(String, String, Option<usize>)> = vec![
            (
                format!("{b}.attn_norm.weight"),
                format!("{p}.input_layernorm.weight"),
                None,
            ),
            (
                format!("{b}.attn_q.weight"),
                format!("{p}.self_attn.q_proj.weight"),
                qk(heads),
            ),
            (
                format!("{b}.attn_k.weight"),
                format!("{p}.self_attn.k_proj.weight"),
                qk(kv_heads),
            ),
            (
                format!("{b}.attn_v.weight"),
                format!("{p}.self_attn.v_proj.weight"),
                None,
            ),
            (
                format!("{b}.attn_output.weight"),
                format!("{p}.self_attn.o_proj.weight"),
                None,
            ),
        ];
        for (g, h, perm) in [
            ("attn_q.bias", "self_attn.q_proj.bias", qk(heads)),
            ("attn_k.bias", "self_attn.k_proj.bias", qk(kv_heads)),
            ("attn_v.bias", "self_attn.v_proj.bias", None),
            ("attn_q_norm.weight", "self_attn.q_norm.weight", None),
            ("attn_k_norm.weight", "self_attn.k_norm.weight", None),
        ] {
            if ckpt.contains(&format!("{p}.{h}")) {
                pairs.push((format!("{b}.{g}"), format!("{p}.{h}"), perm));
            }
        }
        pairs.push((
            format!("{b}.ffn_norm.weight"),
            format!("{p}.post_attention_layernorm.weight"),
            None,
        ));
        for (g, s, perm) in pairs {
            plan!(g, s, perm, Some(l));
        }
        let router = (fam.router)(l);
        if fam.experts > 0 && !ckpt.contains(&router) && fam.arch != "llama" {
            warnings.push(format!(
                "layer {l} is dense (no router): colibri runs this file, but llama.cpp's `{a}` expects every layer to be MoE and will refuse it"
            ));
        }
        if fam.experts > 0 && ckpt.contains(&router) {
            plan!(format!("{b}.ffn_gate_inp.weight"), router, None, Some(l));
            for (which, hf) in ["gate", "up", "down"].iter().zip(fam.expert_names) {
                let name = format!("{b}.ffn_{which}_exps.weight");
                let sources: Vec<String> = (0..fam.experts)
                    .map(|e| format!("{}.{hf}.weight", (fam.expert_prefix)(l, e)))
                    .collect();
                let first = ckpt.desc(&sources[0])?.shape.clone();
                for s in &sources {
                    if ckpt.desc(s)?.shape != first {
                        return Err(Error::tensor(dir, s, "experts of a layer differ in shape"));
                    }
                }
                let mut shape = vec![fam.experts];
                shape.extend(&first);
                let ty = choose_type(mix, &name, first[1], Some(l), layers);
                plans.push(Plan {
                    name,
                    shape,
                    ty,
                    sources,
                    permute_heads: None,
                    computed: None,
                });
            }
        } else {
            for (g, h) in [
                ("ffn_gate", "gate_proj"),
                ("ffn_up", "up_proj"),
                ("ffn_down", "down_proj"),
            ] {
                plan!(
                    format!("{b}.{g}.weight"),
                    format!("{p}.mlp.{h}.weight"),
                    None,
                    Some(l)
                );
            }
        }
    }
    plan!(
        "output_norm.weight".into(),
        "model.norm.weight".into(),
        None,
        None
    );
    let tied = cfg.bool_or("tie_word_embeddings", false)? && !ckpt.contains("lm_head.weight");
    if !tied {
        plan!("output.weight".into(), "lm_head.weight".into(), None, None);
    }
    let embd = plans.iter().find(|p| p.name == "token_embd.weight");
    if embd.is_some_and(|p| p.shape[0] != vocab) {
        return Err(Error::tensor(
            dir,
            "model.embed_tokens.weight",
            "rows differ from vocab_size",
        ));
    }

    // Write.
    let specs: Vec<GgufTensorSpec> = plans
        .iter()
        .map(|p| GgufTensorSpec::from_shape(p.name.clone(), &p.shape, ggml(p.ty)))
        .collect();
    let bytes_in: u64 = plans
        .iter()
        .flat_map(|p| p.sources.iter())
        .map(|s| ckpt.desc(s).map(|d| d.len as u64).unwrap_or(0))
        .sum();
    let mut writer = GgufWriter::create(out, &md, specs)?;
    let (mut done, mut bytes_out) = (0u64, 0u64);
    let mut types: Vec<(String, usize)> = Vec::new();
    for p in &plans {
        if let Some(bytes) = &p.computed {
            bytes_out += bytes.len() as u64;
            writer.write(bytes)?;
        }
        for src in &p.sources {
            let t = ckpt.tensor_any_shape(src)?;
            let bytes = convert_tensor(&t, p.ty, p.permute_heads)?;
            bytes_out += bytes.len() as u64;
            writer.write(&bytes)?;
            done += t.nbytes() as u64;
        }
        match types.iter_mut().find(|(n, _)| n == p.ty.name()) {
            Some((_, c)) => *c += 1,
            None => types.push((p.ty.name().to_string(), 1)),
        }
        progress(done, bytes_in);
    }
    writer.finish()?;
    Ok(ConvertReport {
        tensors: plans.len(),
        bytes_in,
        bytes_out,
        types,
        warnings,
    })
}

/// Rows of `t` (permuted per head if asked) quantized to `ty`, in parallel chunks.
fn convert_tensor(t: &Tensor, ty: QuantType, permute_heads: Option<usize>) -> Result<Vec<u8>> {
    let view = t.view()?;
    let (rows, cols) = (view.rows, view.cols);
    let source_row = |r: usize| -> usize {
        match permute_heads {
            Some(h) if rows.is_multiple_of(h) => {
                let hd = rows / h;
                let (head, i) = (r / hd, r % hd);
                // llama.cpp's permute: new row 2i ← old row i, new row 2i+1 ← old row i + hd/2.
                head * hd + if i % 2 == 0 { i / 2 } else { i / 2 + hd / 2 }
            }
            _ => r,
        }
    };
    let row_bytes = ty.row_bytes(cols)?;
    const CHUNK: usize = 64;
    let chunks: Vec<Result<Vec<u8>>> = (0..rows.div_ceil(CHUNK))
        .into_par_iter()
        .map(|c| {
            let mut out = Vec::with_capacity(CHUNK * row_bytes);
            let mut row = vec![0.0f32; cols];
            for r in c * CHUNK..((c + 1) * CHUNK).min(rows) {
                view.row_to_f32(source_row(r), &mut row);
                quantize_row(ty, &row, &mut out)?;
            }
            Ok(out)
        })
        .collect();
    let mut out = Vec::with_capacity(rows * row_bytes);
    for c in chunks {
        out.extend(c?);
    }
    Ok(out)
}

/// llama.cpp's `tokenizer.ggml.*` keys from `tokenizer.json` (byte-level BPE only), plus the
/// chat template from `tokenizer_config.json`.
fn tokenizer_metadata(
    dir: &Path,
    cfg: &ModelConfig,
    md: &mut Vec<(String, GgufValue)>,
    warnings: &mut Vec<String>,
) -> Result<()> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        warnings.push(
            "no tokenizer.json: the GGUF has no vocabulary (llama.cpp needs one to run text)"
                .into(),
        );
        return Ok(());
    }
    let json = crate::error::read_json(&path)?;
    let model = &json["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(Error::Unsupported(format!(
            "{}: only byte-level BPE tokenizers can be written to GGUF so far (this one is {})",
            path.display(),
            model["type"]
        )));
    }
    let vocab_size = cfg.usize("vocab_size")?;
    let mut tokens = vec![String::new(); vocab_size];
    let mut types = vec![1i32; vocab_size];
    let mut filled = vec![false; vocab_size];
    if let Some(v) = model["vocab"].as_object() {
        for (tok, id) in v {
            if let Some(id) = id.as_u64().map(|i| i as usize).filter(|&i| i < vocab_size) {
                tokens[id] = tok.clone();
                filled[id] = true;
            }
        }
    }
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        if let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) {
            let id = id as usize;
            if id < vocab_size {
                tokens[id] = content.to_string();
                filled[id] = true;
                types[id] = if added["special"].as_bool() == Some(true) {
                    3
                } else {
                    4
                };
            }
        }
    }
    for (i, f) in filled.iter().enumerate() {
        if !f {
            tokens[i] = format!("[PAD{i}]");
            types[i] = 5;
        }
    }
    let merges: Vec<String> = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| match m {
            Value::String(s) => Some(s.clone()),
            Value::Array(p) => Some(format!("{} {}", p.first()?.as_str()?, p.get(1)?.as_str()?)),
            _ => None,
        })
        .collect();
    let pre = match json["pre_tokenizer"]["type"].as_str() {
        Some("ByteLevel") => "gpt-2",
        _ => {
            let text = json["pre_tokenizer"].to_string();
            if text.contains("\\\\p{N}{1,3}") {
                "llama-bpe"
            } else if text.contains("\\\\p{N}") && text.contains("?i:") {
                "qwen2"
            } else {
                warnings.push("unrecognised pre-tokenizer: written as `default` (GPT-2)".into());
                "default"
            }
        }
    };
    md.push((
        "tokenizer.ggml.model".into(),
        GgufValue::String("gpt2".into()),
    ));
    md.push(("tokenizer.ggml.pre".into(), GgufValue::String(pre.into())));
    md.push((
        "tokenizer.ggml.tokens".into(),
        GgufValue::Array(GgufArray::String(tokens)),
    ));
    md.push((
        "tokenizer.ggml.token_type".into(),
        GgufValue::Array(GgufArray::I32(types)),
    ));
    md.push((
        "tokenizer.ggml.merges".into(),
        GgufValue::Array(GgufArray::String(merges)),
    ));
    let eos = cfg.eos_token_ids()?;
    if let Some(&e) = eos.first() {
        md.push(("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(e)));
    }
    if let Some(b) = cfg.get("bos_token_id").and_then(|v| v.as_u64()) {
        md.push((
            "tokenizer.ggml.bos_token_id".into(),
            GgufValue::U32(b as u32),
        ));
    }
    md.push((
        "tokenizer.ggml.add_bos_token".into(),
        GgufValue::Bool(false),
    ));
    let tc = dir.join("tokenizer_config.json");
    if tc.is_file() {
        if let Some(t) = crate::error::read_json(&tc)?["chat_template"].as_str() {
            md.push((
                "tokenizer.chat_template".into(),
                GgufValue::String(t.into()),
            ));
        }
    }
    Ok(())
}
