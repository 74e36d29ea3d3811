//! `coli synth`: a random-weight checkpoint of any size in the real Hugging Face layout
//! (config.json, safetensors shards with an index when large, tokenizer.json,
//! tokenizer_config.json with a chat template, generation_config.json), deterministic from
//! `--seed`. Written into a temporary directory that is renamed into place when complete.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use colibri::format::write::{tmp_path, write_atomic, SafetensorsWriter, TensorSpec};
use colibri::tensor::DType;
use half::bf16;
use rayon::prelude::*;
use serde_json::json;

/// Architectures `coli synth` can write.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthArch {
    Olmoe,
    Qwen3Moe,
    Mixtral,
    Llama,
}

/// Weight dtype of a synthetic checkpoint.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthDType {
    Bf16,
    F32,
}

/// Arguments of `coli synth`.
#[derive(clap::Args, Debug, Clone)]
pub struct SynthArgs {
    /// Architecture to write.
    #[arg(long, value_enum)]
    pub arch: SynthArch,
    /// Decoder layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 512)]
    pub hidden: usize,
    /// Attention heads (default: hidden / 128, at least 1).
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key/value heads (default: = heads).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Routed experts per MoE layer (ignored for llama).
    #[arg(long, default_value_t = 8)]
    pub experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 2)]
    pub top_k: usize,
    /// Width of each expert.
    #[arg(long, default_value_t = 256)]
    pub moe_intermediate: usize,
    /// Width of dense MLPs (llama; default 4 × hidden).
    #[arg(long)]
    pub intermediate: Option<usize>,
    /// Vocabulary size (the tokenizer is trained and padded to exactly this).
    #[arg(long, default_value_t = 4096)]
    pub vocab: usize,
    /// Weight dtype.
    #[arg(long, value_enum, default_value_t = SynthDType::Bf16)]
    pub dtype: SynthDType,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Largest shard in bytes before splitting into model-0000i-of-0000n.safetensors.
    #[arg(long, default_value_t = 4_000_000_000)]
    pub shard_bytes: usize,
    /// Output directory (must not exist).
    #[arg(long)]
    pub out: PathBuf,
    /// Compute threads (default: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// Run `coli synth`.
pub fn run(args: SynthArgs) -> Result<()> {
    colibri::tensor::threads::init(args.threads)?;
    synthesize(&args, true)?;
    eprintln!(
        "coli: wrote {} (random weights, seed {})",
        args.out.display(),
        args.seed
    );
    Ok(())
}

/// One tensor and how to fill it.
struct Planned {
    spec: TensorSpec,
    /// Uniform in ±scale, or all ones when `None`.
    scale: Option<f32>,
}

fn plan(a: &SynthArgs, heads: usize, kv_heads: usize) -> Vec<Planned> {
    let dtype = match a.dtype {
        SynthDType::Bf16 => DType::BF16,
        SynthDType::F32 => DType::F32,
    };
    let (d, hd) = (a.hidden, a.hidden / heads);
    let mut out = Vec::new();
    let mut mat = |name: String, rows: usize, cols: usize| {
        out.push(Planned {
            scale: Some(init_scale(&name, cols)),
            spec: TensorSpec {
                name,
                dtype,
                shape: vec![rows, cols],
            },
        })
    };
    mat("model.embed_tokens.weight".into(), a.vocab, d);
    let mut norms: Vec<(String, usize)> = Vec::new();
    for l in 0..a.layers {
        let p = format!("model.layers.{l}");
        mat(format!("{p}.self_attn.q_proj.weight"), heads * hd, d);
        mat(format!("{p}.self_attn.k_proj.weight"), kv_heads * hd, d);
        mat(format!("{p}.self_attn.v_proj.weight"), kv_heads * hd, d);
        mat(format!("{p}.self_attn.o_proj.weight"), d, heads * hd);
        norms.push((format!("{p}.input_layernorm.weight"), d));
        norms.push((format!("{p}.post_attention_layernorm.weight"), d));
        match a.arch {
            SynthArch::Olmoe => {
                norms.push((format!("{p}.self_attn.q_norm.weight"), heads * hd));
                norms.push((format!("{p}.self_attn.k_norm.weight"), kv_heads * hd));
            }
            SynthArch::Qwen3Moe => {
                norms.push((format!("{p}.self_attn.q_norm.weight"), hd));
                norms.push((format!("{p}.self_attn.k_norm.weight"), hd));
            }
            _ => {}
        }
        let inter = a.moe_intermediate;
        match a.arch {
            SynthArch::Olmoe | SynthArch::Qwen3Moe => {
                mat(format!("{p}.mlp.gate.weight"), a.experts, d);
                for e in 0..a.experts {
                    let q = format!("{p}.mlp.experts.{e}");
                    mat(format!("{q}.gate_proj.weight"), inter, d);
                    mat(format!("{q}.up_proj.weight"), inter, d);
                    mat(format!("{q}.down_proj.weight"), d, inter);
                }
            }
            SynthArch::Mixtral => {
                mat(format!("{p}.block_sparse_moe.gate.weight"), a.experts, d);
                for e in 0..a.experts {
                    let q = format!("{p}.block_sparse_moe.experts.{e}");
                    mat(format!("{q}.w1.weight"), inter, d);
                    mat(format!("{q}.w3.weight"), inter, d);
                    mat(format!("{q}.w2.weight"), d, inter);
                }
            }
            SynthArch::Llama => {
                let i = a.intermediate.unwrap_or(4 * d);
                mat(format!("{p}.mlp.gate_proj.weight"), i, d);
                mat(format!("{p}.mlp.up_proj.weight"), i, d);
                mat(format!("{p}.mlp.down_proj.weight"), d, i);
            }
        }
    }
    norms.push(("model.norm.weight".into(), d));
    mat("lm_head.weight".into(), a.vocab, d);
    for (name, n) in norms {
        out.push(Planned {
            spec: TensorSpec {
                name,
                dtype,
                shape: vec![n],
            },
            scale: None,
        });
    }
    out
}

/// Half-width of the uniform init of a matrix. Like a trained model's, the residual stream
/// stays dominated by the token (embeddings of unit scale, residual-branch outputs scaled down),
/// so routing differs from token to token instead of collapsing onto a few experts.
fn init_scale(name: &str, fan_in: usize) -> f32 {
    let unit = (3.0 / fan_in as f32).sqrt();
    if name.ends_with("embed_tokens.weight") {
        3.0f32.sqrt()
    } else if name.ends_with("o_proj.weight")
        || name.ends_with("down_proj.weight")
        || name.ends_with(".w2.weight")
    {
        unit * 0.1
    } else {
        unit
    }
}

fn config_json(
    a: &SynthArgs,
    heads: usize,
    kv_heads: usize,
    eos: &[u32],
    bos: u32,
) -> serde_json::Value {
    let common = json!({
        "vocab_size": a.vocab,
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": false,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": match a.dtype { SynthDType::Bf16 => "bfloat16", SynthDType::F32 => "float32" },
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_cache": true,
        "colibri_synthetic": {"seed": a.seed, "note": "random weights written by coli synth"},
    });
    let mut v = common;
    let extra = match a.arch {
        SynthArch::Olmoe => json!({
            "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
            "intermediate_size": a.moe_intermediate, "num_experts": a.experts,
            "num_experts_per_tok": a.top_k, "norm_topk_prob": false, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "clip_qkv": null,
        }),
        SynthArch::Qwen3Moe => json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "intermediate_size": 4 * a.hidden, "moe_intermediate_size": a.moe_intermediate,
            "num_experts": a.experts, "num_experts_per_tok": a.top_k, "norm_topk_prob": true,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": a.hidden / heads,
            "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": false, "sliding_window": null,
        }),
        SynthArch::Mixtral => json!({
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": a.moe_intermediate, "num_local_experts": a.experts,
            "num_experts_per_tok": a.top_k, "rms_norm_eps": 1e-5, "sliding_window": null,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        }),
        SynthArch::Llama => json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "intermediate_size": a.intermediate.unwrap_or(4 * a.hidden), "rms_norm_eps": 1e-6,
            "mlp_bias": false, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }),
    };
    for (k, val) in extra.as_object().unwrap() {
        v[k] = val.clone();
    }
    v
}

/// Seeded xorshift stream for one chunk of one tensor.
fn chunk_seed(seed: u64, name: &str, chunk: usize) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325 ^ seed.wrapping_mul(0x9E3779B97F4A7C15);
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    let mut z = h ^ (chunk as u64).wrapping_mul(0xD1B54A32D192ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    (z ^ (z >> 31)) | 1
}

const CHUNK: usize = 1 << 20;

fn fill_chunk(p: &Planned, seed: u64, chunk: usize, n: usize) -> Vec<u8> {
    let mut vals = vec![1.0f32; n];
    if let Some(scale) = p.scale {
        let mut s = chunk_seed(seed, &p.spec.name, chunk);
        for v in &mut vals {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *v = ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale;
        }
    }
    match p.spec.dtype {
        DType::BF16 => vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Write the checkpoint described by `args` to `args.out`.
pub fn synthesize(args: &SynthArgs, progress: bool) -> Result<()> {
    if args.out.exists() {
        bail!(
            "--out {}: already exists (choose a new directory)",
            args.out.display()
        );
    }
    if args.hidden == 0 || args.layers == 0 || args.vocab == 0 {
        bail!("--hidden, --layers and --vocab must be positive");
    }
    let heads = args.heads.unwrap_or((args.hidden / 128).max(1));
    let kv_heads = args.kv_heads.unwrap_or(heads);
    if heads == 0
        || kv_heads == 0
        || !args.hidden.is_multiple_of(heads)
        || !heads.is_multiple_of(kv_heads)
    {
        bail!(
            "--heads {heads} must divide --hidden {} and be a multiple of --kv-heads {kv_heads}",
            args.hidden
        );
    }
    if args.arch != SynthArch::Llama
        && (args.experts == 0 || args.top_k == 0 || args.top_k > args.experts)
    {
        bail!(
            "--top-k {} must be between 1 and --experts {}",
            args.top_k,
            args.experts
        );
    }
    let parent = args
        .out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let tmp = tmp_path(&args.out);
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let result = write_all(args, &tmp, heads, kv_heads, progress);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result?;
    std::fs::rename(&tmp, &args.out)
        .with_context(|| format!("renaming {} to {}", tmp.display(), args.out.display()))?;
    Ok(())
}

fn write_all(
    args: &SynthArgs,
    dir: &Path,
    heads: usize,
    kv_heads: usize,
    progress: bool,
) -> Result<()> {
    // Text side first: the tokenizer decides the special token ids.
    let tok = crate::demo::tokenizer_for(args.vocab, &crate::demo::SPECIALS)?;
    tok.save(&dir.join("tokenizer.json"))?;
    let id = |s: &str| tok.token_to_id(s).unwrap_or(0);
    let eos = vec![id("<|endoftext|>"), id("<|im_end|>")];
    let tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": crate::demo::CHATML_TEMPLATE,
    });
    write_atomic(
        &dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tokenizer_config)?.as_bytes(),
    )?;
    let generation = json!({"bos_token_id": id("<|endoftext|>"), "eos_token_id": eos, "do_sample": true, "temperature": 0.8, "top_p": 0.95});
    write_atomic(
        &dir.join("generation_config.json"),
        serde_json::to_string_pretty(&generation)?.as_bytes(),
    )?;
    let config = config_json(args, heads, kv_heads, &eos, id("<|endoftext|>"));
    write_atomic(
        &dir.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;

    // Weights, split into shards.
    let planned = plan(args, heads, kv_heads);
    let total: usize = planned.iter().map(|p| p.spec.nbytes()).sum();
    let mut shards: Vec<Vec<&Planned>> = vec![Vec::new()];
    let mut size = 0;
    for p in &planned {
        if size > 0 && size + p.spec.nbytes() > args.shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += p.spec.nbytes();
        shards.last_mut().unwrap().push(p);
    }
    let bar = if progress {
        let b = indicatif::ProgressBar::new(total as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
            )
            .unwrap()
            .progress_chars("=> "),
        );
        b.set_message("writing weights");
        b
    } else {
        indicatif::ProgressBar::hidden()
    };
    let n = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        };
        let mut w = SafetensorsWriter::create(
            &dir.join(&file),
            shard.iter().map(|p| p.spec.clone()).collect(),
        )?;
        for p in shard {
            weight_map.insert(p.spec.name.clone(), json!(file));
            let elems: usize = p.spec.shape.iter().product();
            let chunks = elems.div_ceil(CHUNK);
            // Generate a batch of chunks in parallel, write them in order.
            let batch = 16;
            for c0 in (0..chunks).step_by(batch) {
                let bufs: Vec<Vec<u8>> = (c0..(c0 + batch).min(chunks))
                    .into_par_iter()
                    .map(|c| fill_chunk(p, args.seed, c, CHUNK.min(elems - c * CHUNK)))
                    .collect();
                for b in bufs {
                    w.write(&b)?;
                    bar.inc(b.len() as u64);
                }
            }
        }
        w.finish()?;
    }
    if n > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        write_atomic(
            &dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?.as_bytes(),
        )?;
    }
    bar.finish_and_clear();
    Ok(())
}
