//! `coli synth`: a random-weight checkpoint of any size in the real Hugging Face layout
//! (config.json, safetensors shards with an index when large, tokenizer.json,
//! tokenizer_config.json with a chat template, generation_config.json), deterministic from
//! `--seed`. Written into a temporary directory that is renamed into place when complete.
//!
//! With `--format gguf` it writes the GGUF file `coli convert --type T` makes of that
//! checkpoint instead, without the checkpoint ever existing: the converter asks for one tensor
//! at a time ([`colibri::convert::TensorSource`]) and each is generated when asked, from the
//! same per-tensor, per-chunk seeds the safetensors writer uses, so the two routes give the
//! same bytes and memory stays near one tensor whatever the model's size.
//!
//! The `coli synth` command and the demo model (server/src/demo.rs) use it; [`tokenizer`] is the
//! tokenizer and chat template every synthetic model gets.

pub mod tokenizer;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use colibri::convert::{
    Conversion, ConvertOptions, ConvertProgress, ConvertReport, ConvertType, SourceTensor,
    TensorSource,
};
use colibri::format::write::{create_tmp_dir, write_atomic, SafetensorsWriter, TensorSpec};
use colibri::model::registry::{Experts, Family};
use colibri::model::{
    deepseek_v3, deepseek_v4, glm4_moe, glm_moe_dsa, gpt_oss, kimi_linear, llama, mixtral, olmoe,
    qwen3_moe, qwen3_next,
};
use colibri::tensor::{DType, Storage, Tensor};
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
    /// DeepSeek-V3 (and Kimi's text model): MLA, sigmoid router with expert groups, shared
    /// experts, dense-first layers.
    #[value(name = "deepseek-v3")]
    DeepseekV3,
    /// GLM-4.5/4.6/4.7: GQA with biased q/k/v, partial RoPE, otherwise deepseek-v3's MoE.
    #[value(name = "glm4-moe")]
    Glm4Moe,
    /// GLM-5.x: deepseek-v3's MLA and MoE plus the DSA lightning indexer.
    #[value(name = "glm-moe-dsa")]
    GlmMoeDsa,
    /// DeepSeek-V4: hyper-connection streams, one shared key/value head, HCA / CSA compressed
    /// attention with the lightning indexer, sliding window, sinks, grouped output, hash-routed
    /// first layers, sqrt-softplus routing.
    #[value(name = "deepseek-v4")]
    DeepseekV4,
    /// Qwen3-Next: Gated DeltaNet linear attention (grouped `in_proj_qkvz`/`in_proj_ba`) on
    /// 3 of every 4 layers, gated attention on the others, MoE with a gated shared expert.
    #[value(name = "qwen3-next")]
    Qwen3Next,
    /// Qwen3.5/3.6 MoE (text model): qwen3-next with split DeltaNet projections.
    #[value(name = "qwen3-5-moe")]
    Qwen35Moe,
    /// Kimi Linear: Kimi Delta Attention on 3 of every 4 layers (`--linear-value-heads` heads
    /// of `--linear-head-dim`), NoPE MLA on the others, deepseek-v3's MoE under
    /// `block_sparse_moe` (experts `w1`/`w3`/`w2`).
    #[value(name = "kimi-linear")]
    KimiLinear,
    /// gpt-oss: biased GQA with attention sinks, sliding (`--sliding-window`) and full layers
    /// alternating, yarn RoPE; a biased router and fused biased experts with the clamped GLU,
    /// in transformers' `x·W` layout or (`--mxfp4`) the hub's MXFP4 blocks.
    #[value(name = "gpt-oss")]
    GptOss,
}

impl SynthArch {
    /// deepseek-v3, glm4-moe, glm-moe-dsa and kimi-linear: the architectures `DsArgs` applies
    /// to.
    fn deepseek_style(self) -> bool {
        matches!(
            self,
            SynthArch::DeepseekV3
                | SynthArch::Glm4Moe
                | SynthArch::GlmMoeDsa
                | SynthArch::KimiLinear
        )
    }

    /// Multi-head latent attention (one key/value head per query head).
    fn mla(self) -> bool {
        matches!(
            self,
            SynthArch::DeepseekV3 | SynthArch::GlmMoeDsa | SynthArch::KimiLinear
        )
    }

    /// The family's registry descriptor: the `model_type` written, where experts, routers and
    /// the LM head go.
    pub fn family(self) -> &'static Family {
        match self {
            SynthArch::Olmoe => &olmoe::FAMILY,
            SynthArch::Qwen3Moe => &qwen3_moe::FAMILY,
            SynthArch::Mixtral => &mixtral::FAMILY,
            SynthArch::Llama => &llama::FAMILY,
            SynthArch::DeepseekV3 => &deepseek_v3::FAMILY,
            SynthArch::Glm4Moe => &glm4_moe::FAMILY,
            SynthArch::GlmMoeDsa => &glm_moe_dsa::FAMILY,
            SynthArch::DeepseekV4 => &deepseek_v4::FAMILY,
            SynthArch::Qwen3Next => &qwen3_next::QWEN3_NEXT,
            SynthArch::Qwen35Moe => &qwen3_next::QWEN3_5_MOE,
            SynthArch::KimiLinear => &kimi_linear::FAMILY,
            SynthArch::GptOss => &gpt_oss::FAMILY,
        }
    }

    /// The Gated DeltaNet hybrids (qwen3-next, qwen3-5-moe).
    fn delta_net(self) -> bool {
        matches!(self, SynthArch::Qwen3Next | SynthArch::Qwen35Moe)
    }

    /// Where the family keeps its routed experts (llama: nowhere).
    fn experts(self) -> Option<Experts> {
        self.family().experts
    }

    /// How `--arch` names it.
    fn flag_value(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }

    /// The `model_type` written to config.json.
    fn model_type(self) -> &'static str {
        self.family().model_type()
    }
}

/// What `coli synth` writes.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SynthFormat {
    /// A Hugging Face model directory (config.json, tokenizer, safetensors in --dtype).
    #[default]
    Safetensors,
    /// One GGUF file, as `coli convert --type T` writes that directory (--type; llama.cpp's
    /// architectures only: olmoe, qwen3-moe, mixtral, llama, deepseek-v3, glm4-moe).
    Gguf,
}

/// `--type`: a `coli convert` mix.
fn parse_convert_type(s: &str) -> std::result::Result<ConvertType, String> {
    ConvertType::parse(s).map_err(|e| e.to_string())
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
    /// Key/value heads (default: = heads; MLA architectures always have = heads).
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
    /// Width of dense MLPs (llama, and the dense-first layers of deepseek-v3, glm4-moe and
    /// glm-moe-dsa; default 4 × hidden).
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
    /// Output directory, or with --format gguf the GGUF file (must not exist).
    #[arg(long)]
    pub out: PathBuf,
    /// safetensors: a Hugging Face directory; gguf: the GGUF file `coli convert --type` would
    /// make of it, written tensor by tensor without the directory (memory: about one tensor).
    #[arg(long, value_enum, default_value_t = SynthFormat::Safetensors)]
    pub format: SynthFormat,
    /// --format gguf: the mix, as `coli convert --type` takes it (q8_0, q6_k, q5_k_m, q4_k_m,
    /// bf16, f16 or f32; default q8_0). The values quantized are the --dtype checkpoint's.
    #[arg(short = 't', long = "type", value_parser = parse_convert_type)]
    pub ty: Option<ConvertType>,
    /// Compute threads (default: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Options of the DeepSeek-style architectures.
    #[command(flatten)]
    pub ds: DsArgs,
    /// Options of the linear-attention hybrids.
    #[command(flatten)]
    pub linear: LinearArgs,
    /// gpt-oss: routed experts as the hub ships them, MXFP4 (`…_blocks` + `…_scales`, gate and
    /// up rows interleaved); without it, transformers' fused `x·W` layout in `--dtype` holding
    /// exactly the values the MXFP4 form dequantizes to (so both forms compute the same
    /// tokens). --hidden and --moe-intermediate must be multiples of 32.
    #[arg(long)]
    pub mxfp4: bool,
}

/// Shape options of the linear-attention hybrids (qwen3-next, qwen3-5-moe); the other
/// architectures ignore them.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "qwen3-next / qwen3-5-moe")]
pub struct LinearArgs {
    /// Query/key heads of the linear-attention layers.
    #[arg(long, default_value_t = 16)]
    pub linear_key_heads: usize,
    /// Value heads of the linear-attention layers (a multiple of --linear-key-heads).
    #[arg(long, default_value_t = 32)]
    pub linear_value_heads: usize,
    /// Key and value head dim of the linear-attention layers.
    #[arg(long, default_value_t = 128)]
    pub linear_head_dim: usize,
    /// Taps of the short causal convolution.
    #[arg(long, default_value_t = 4)]
    pub conv_kernel: usize,
    /// Every n-th layer is full (gated softmax) attention, the others linear.
    #[arg(long, default_value_t = 4)]
    pub full_attention_interval: usize,
    /// Width of the shared expert (default: --moe-intermediate).
    #[arg(long)]
    pub shared_intermediate: Option<usize>,
}

impl Default for LinearArgs {
    /// The command-line defaults.
    fn default() -> Self {
        use clap::{Args, FromArgMatches};
        let cmd = Self::augment_args(clap::Command::new("synth"));
        Self::from_arg_matches(&cmd.get_matches_from(["synth"])).expect("defaults parse")
    }
}

/// Kimi Delta Attention's tensors under `s` (`{layer}.self_attn`): q/k/v projections and their
/// short convolutions, the low-rank decay (`f_a`/`f_b`) and output-gate (`g_a`/`g_b`) pairs,
/// per-channel `dt_bias`, per-head `A_log`, `b_proj`, the gated output norm and `o_proj`.
fn kda_attention(pl: &mut Plan, a: &SynthArgs, s: &str) {
    let (d, x) = (a.hidden, &a.linear);
    let (h, dk) = (x.linear_value_heads, x.linear_head_dim);
    let conv_scale = init_scale("conv1d", x.conv_kernel);
    for proj in ["q", "k", "v"] {
        pl.mat(format!("{s}.{proj}_proj.weight"), h * dk, d);
        pl.push(
            format!("{s}.{proj}_conv1d.weight"),
            pl.dtype,
            vec![h * dk, 1, x.conv_kernel],
            Init::Uniform(conv_scale),
        );
    }
    for pair in ["f", "g"] {
        pl.mat(format!("{s}.{pair}_a_proj.weight"), dk, d);
        pl.mat(format!("{s}.{pair}_b_proj.weight"), h * dk, dk);
    }
    pl.bias(format!("{s}.dt_bias"), h * dk);
    pl.push(
        format!("{s}.A_log"),
        pl.dtype,
        vec![1, 1, h, 1],
        Init::Uniform(BIAS_SCALE),
    );
    pl.mat(format!("{s}.b_proj.weight"), h, d);
    pl.norm(format!("{s}.o_norm.weight"), dk);
    pl.mat(format!("{s}.o_proj.weight"), d, h * dk);
}

/// kimi-linear's config keys (transformers' `KimiLinearConfig` as it saves them: Kimi's own
/// key names).
fn kimi_linear_config(a: &SynthArgs, heads: usize) -> serde_json::Value {
    let (x, lin) = (&a.ds, &a.linear);
    let layer_types = hybrid_layer_types(a);
    let mlp_layer_types: Vec<&str> = (0..a.layers)
        .map(|l| if l < x.first_dense { "dense" } else { "sparse" })
        .collect();
    json!({
        "architectures": ["KimiLinearForCausalLM"], "model_type": a.arch.model_type(),
        "intermediate_size": dense_intermediate(a), "moe_intermediate_size": a.moe_intermediate,
        "num_experts": a.experts, "num_experts_per_token": a.top_k,
        "num_shared_experts": x.shared_experts, "num_expert_group": x.n_group,
        "topk_group": x.topk_group, "moe_renormalize": true,
        "routed_scaling_factor": x.routed_scaling, "layer_types": layer_types,
        "mlp_layer_types": mlp_layer_types, "linear_conv_kernel_dim": lin.conv_kernel,
        "linear_head_dim": lin.linear_head_dim, "linear_num_heads": lin.linear_value_heads,
        "q_lora_rank": if x.q_lora_rank > 0 { json!(x.q_lora_rank) } else { json!(null) },
        "kv_lora_rank": x.kv_lora_rank, "qk_nope_head_dim": x.qk_nope_dim,
        "qk_rope_head_dim": x.qk_rope_dim, "qk_head_dim": x.qk_nope_dim + x.qk_rope_dim,
        "v_head_dim": x.v_head_dim, "head_dim": x.qk_rope_dim, "rms_norm_eps": 1e-5,
        "model_max_length": 4096, "pretraining_tp": 1, "output_router_logits": false,
        "pad_token_id": 0, "num_key_value_heads": heads,
    })
}

/// A hybrid's `layer_types`: `linear_attention`, with `full_attention` every
/// `--full-attention-interval`-th layer.
fn hybrid_layer_types(a: &SynthArgs) -> Vec<&'static str> {
    (0..a.layers)
        .map(|l| {
            if linear_layer(a, l) {
                "linear_attention"
            } else {
                "full_attention"
            }
        })
        .collect()
}

/// Whether layer `l` of a hybrid is linear attention.
fn linear_layer(a: &SynthArgs, l: usize) -> bool {
    !(l + 1).is_multiple_of(a.linear.full_attention_interval.max(1))
}

/// Layer `l` of a Gated DeltaNet hybrid (qwen3-next, qwen3-5-moe): linear or gated full
/// attention, then the MoE block with its gated shared expert.
fn delta_net_layer(pl: &mut Plan, a: &SynthArgs, l: usize, heads: usize, kv_heads: usize) {
    let (d, hd, x) = (a.hidden, head_dim(a, heads), &a.linear);
    let p = format!("model.layers.{l}");
    if linear_layer(a, l) {
        let la = format!("{p}.linear_attn");
        let (nk, nv, dh) = (x.linear_key_heads, x.linear_value_heads, x.linear_head_dim);
        let channels = 2 * nk * dh + nv * dh;
        if a.arch == SynthArch::Qwen3Next {
            pl.mat(format!("{la}.in_proj_qkvz.weight"), channels + nv * dh, d);
            pl.mat(format!("{la}.in_proj_ba.weight"), 2 * nv, d);
        } else {
            pl.mat(format!("{la}.in_proj_qkv.weight"), channels, d);
            pl.mat(format!("{la}.in_proj_z.weight"), nv * dh, d);
            pl.mat(format!("{la}.in_proj_b.weight"), nv, d);
            pl.mat(format!("{la}.in_proj_a.weight"), nv, d);
        }
        let conv_scale = init_scale("conv1d", x.conv_kernel);
        pl.push(
            format!("{la}.conv1d.weight"),
            pl.dtype,
            vec![channels, 1, x.conv_kernel],
            Init::Uniform(conv_scale),
        );
        pl.bias(format!("{la}.dt_bias"), nv);
        pl.bias(format!("{la}.A_log"), nv);
        pl.norm(format!("{la}.norm.weight"), dh);
        pl.mat(format!("{la}.out_proj.weight"), d, nv * dh);
    } else {
        pl.mat(format!("{p}.self_attn.q_proj.weight"), 2 * heads * hd, d);
        pl.mat(format!("{p}.self_attn.k_proj.weight"), kv_heads * hd, d);
        pl.mat(format!("{p}.self_attn.v_proj.weight"), kv_heads * hd, d);
        pl.mat(format!("{p}.self_attn.o_proj.weight"), d, heads * hd);
        pl.zero_centred_norm(format!("{p}.self_attn.q_norm.weight"), hd);
        pl.zero_centred_norm(format!("{p}.self_attn.k_norm.weight"), hd);
    }
    pl.zero_centred_norm(format!("{p}.input_layernorm.weight"), d);
    pl.zero_centred_norm(format!("{p}.post_attention_layernorm.weight"), d);
    let layout = a.arch.experts().expect("a MoE family has routed experts");
    pl.router(&layout, l, a.experts, d);
    pl.experts(&layout, l, a.experts, a.moe_intermediate, d);
    let shared = x.shared_intermediate.unwrap_or(a.moe_intermediate);
    let sp = format!("{p}.mlp.shared_expert");
    pl.mat(format!("{sp}.gate_proj.weight"), shared, d);
    pl.mat(format!("{sp}.up_proj.weight"), shared, d);
    pl.mat(format!("{sp}.down_proj.weight"), d, shared);
    pl.mat(format!("{p}.mlp.shared_expert_gate.weight"), 1, d);
}

/// Layer `l` of gpt-oss: biased attention with sinks, the biased router, and the fused
/// experts with their biases, in the MXFP4 form or the `x·W` form of the same values.
fn gpt_oss_layer(pl: &mut Plan, a: &SynthArgs, l: usize, heads: usize, kv_heads: usize) {
    let (d, hd, e, i) = (a.hidden, head_dim(a, heads), a.experts, a.moe_intermediate);
    let p = format!("model.layers.{l}");
    for (proj, rows, cols) in [
        ("q_proj", heads * hd, d),
        ("k_proj", kv_heads * hd, d),
        ("v_proj", kv_heads * hd, d),
        ("o_proj", d, heads * hd),
    ] {
        pl.mat(format!("{p}.self_attn.{proj}.weight"), rows, cols);
        pl.bias(format!("{p}.self_attn.{proj}.bias"), rows);
    }
    pl.push(
        format!("{p}.self_attn.sinks"),
        pl.dtype,
        vec![heads],
        Init::Uniform(1.0),
    );
    pl.norm(format!("{p}.input_layernorm.weight"), d);
    pl.norm(format!("{p}.post_attention_layernorm.weight"), d);
    pl.mat(format!("{p}.mlp.router.weight"), e, d);
    pl.bias(format!("{p}.mlp.router.bias"), e);
    let x = format!("{p}.mlp.experts");
    // (name, rows, cols) of each fused tensor in the row layout, and its scale byte: a power
    // of two near the init scale of its matrices over the E2M1 range (±6).
    for (name, rows, cols, matrix) in [
        ("gate_up_proj", 2 * i, d, "gate_up_proj.weight"),
        ("down_proj", d, i, "down_proj.weight"),
    ] {
        let scale = 127 + (init_scale(matrix, cols) / 6.0).log2().floor() as i32;
        let scale = scale.clamp(1, 254) as u8;
        if a.mxfp4 {
            pl.push(
                format!("{x}.{name}_blocks"),
                DType::U8,
                vec![e, rows, cols / 32, 16],
                Init::Fp4Codes,
            );
            pl.push(
                format!("{x}.{name}_scales"),
                DType::U8,
                vec![e, rows, cols / 32],
                Init::Fp4Scale(scale),
            );
        } else {
            pl.push(
                format!("{x}.{name}"),
                pl.dtype,
                vec![e, cols, rows],
                Init::Fp4Values { rows, cols, scale },
            );
        }
    }
    pl.push(
        format!("{x}.gate_up_proj_bias"),
        pl.dtype,
        vec![e, 2 * i],
        Init::Uniform(BIAS_SCALE),
    );
    pl.push(
        format!("{x}.down_proj_bias"),
        pl.dtype,
        vec![e, d],
        Init::Uniform(BIAS_SCALE),
    );
}

/// gpt-oss's config keys (as transformers writes them; the hub's yarn, window and clamp).
fn gpt_oss_config(a: &SynthArgs, heads: usize) -> serde_json::Value {
    let layer_types: Vec<&str> = (0..a.layers)
        .map(|l| {
            if l % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    let mut v = json!({
        "architectures": ["GptOssForCausalLM"], "model_type": a.arch.model_type(),
        "head_dim": head_dim(a, heads), "intermediate_size": a.moe_intermediate,
        "num_local_experts": a.experts, "num_experts_per_tok": a.top_k,
        "layer_types": layer_types, "sliding_window": a.ds.sliding_window,
        "rms_norm_eps": 1e-5, "attention_bias": true, "swiglu_limit": 7.0, "swiglu_alpha": 1.702,
        "output_router_logits": false, "router_aux_loss_coef": 0.001, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,
            "original_max_position_embeddings": 4096},
    });
    if a.mxfp4 {
        v["quantization_config"] = json!({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]});
    }
    v
}

/// The config keys of a Gated DeltaNet hybrid (as transformers writes them).
fn delta_net_config(a: &SynthArgs, heads: usize) -> serde_json::Value {
    let x = &a.linear;
    let layer_types = hybrid_layer_types(a);
    let mut v = json!({
        "model_type": a.arch.model_type(), "head_dim": head_dim(a, heads), "rms_norm_eps": 1e-6,
        "layer_types": layer_types, "linear_conv_kernel_dim": x.conv_kernel,
        "linear_key_head_dim": x.linear_head_dim, "linear_value_head_dim": x.linear_head_dim,
        "linear_num_key_heads": x.linear_key_heads, "linear_num_value_heads": x.linear_value_heads,
        "moe_intermediate_size": a.moe_intermediate, "num_experts": a.experts,
        "num_experts_per_tok": a.top_k,
        "shared_expert_intermediate_size": x.shared_intermediate.unwrap_or(a.moe_intermediate),
        "output_router_logits": false, "router_aux_loss_coef": 0.001, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25},
    });
    let extra = if a.arch == SynthArch::Qwen3Next {
        json!({
            "architectures": ["Qwen3NextForCausalLM"], "decoder_sparse_step": 1,
            "mlp_only_layers": [], "norm_topk_prob": true,
            "intermediate_size": dense_intermediate(a),
        })
    } else {
        json!({"architectures": ["Qwen3_5MoeForCausalLM"]})
    };
    for (k, val) in extra.as_object().unwrap() {
        v[k] = val.clone();
    }
    v
}

/// Shape options of the DeepSeek-style architectures (deepseek-v3, glm4-moe, glm-moe-dsa);
/// the other architectures ignore them. The defaults suit the default 512-wide model.
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "deepseek-v3 / glm4-moe / glm-moe-dsa")]
pub struct DsArgs {
    /// MLA query latent rank (0: a plain q_proj, deepseek-v3 only).
    #[arg(long, default_value_t = 256)]
    pub q_lora_rank: usize,
    /// MLA key/value latent rank.
    #[arg(long, default_value_t = 128)]
    pub kv_lora_rank: usize,
    /// MLA per-head query/key dims without RoPE.
    #[arg(long, default_value_t = 64)]
    pub qk_nope_dim: usize,
    /// MLA per-head query/key dims with RoPE (even; the rope key is shared by all heads).
    #[arg(long, default_value_t = 32)]
    pub qk_rope_dim: usize,
    /// MLA per-head value dims.
    #[arg(long, default_value_t = 64)]
    pub v_head_dim: usize,
    /// Head dim of the GQA attention of glm4-moe, qwen3-next and qwen3-5-moe (default: hidden /
    /// heads).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// glm4-moe: per-head q/k RMSNorm (use_qk_norm).
    #[arg(long)]
    pub qk_norm: bool,
    /// Shared experts per MoE layer (one MLP of width moe_intermediate × this; 0 for none).
    #[arg(long, default_value_t = 1)]
    pub shared_experts: usize,
    /// Leading layers with a dense MLP instead of MoE (first_k_dense_replace).
    #[arg(long, default_value_t = 1)]
    pub first_dense: usize,
    /// Expert groups of the router (n_group; must divide --experts).
    #[arg(long, default_value_t = 1)]
    pub n_group: usize,
    /// Groups a token may route into (topk_group).
    #[arg(long, default_value_t = 1)]
    pub topk_group: usize,
    /// Multiplier of the routing weights (routed_scaling_factor).
    #[arg(long, default_value_t = 2.5)]
    pub routed_scaling: f64,
    /// glm-moe-dsa: keys each query attends to once the context is longer (index_topk).
    #[arg(long, default_value_t = 2048)]
    pub index_topk: usize,
    /// glm-moe-dsa: indexer heads (index_n_heads).
    #[arg(long, default_value_t = 8)]
    pub index_heads: usize,
    /// glm-moe-dsa: indexer head dim (index_head_dim; at least --qk-rope-dim).
    #[arg(long, default_value_t = 64)]
    pub index_head_dim: usize,
    /// glm-moe-dsa: layers 0, 1, 1 + this, 1 + 2·this, … run their own indexer and the
    /// others reuse the previous layer's top-k (index_topk_freq; 1: every layer has one).
    #[arg(long, default_value_t = 1)]
    pub index_topk_freq: usize,
    /// Also write one DeepSeek-style multi-token-prediction block at layer index = --layers
    /// (num_nextn_predict_layers 1).
    #[arg(long)]
    pub mtp: bool,
    /// deepseek-v4: one letter per layer, H (heavily compressed), C (compressed sparse) or S
    /// (sliding only); default: H H then C H C H …
    #[arg(long)]
    pub v4_layer_types: Option<String>,
    /// deepseek-v4: leading layers routed by the token → experts table (hash_moe).
    #[arg(long, default_value_t = 1)]
    pub hash_layers: usize,
    /// deepseek-v4: hyper-connection streams (hc_mult).
    #[arg(long, default_value_t = 4)]
    pub hc_mult: usize,
    /// deepseek-v4: output projection groups (o_groups; must divide the heads).
    #[arg(long, default_value_t = 2)]
    pub o_groups: usize,
    /// deepseek-v4: rank of each output group (o_lora_rank).
    #[arg(long, default_value_t = 128)]
    pub o_lora_rank: usize,
    /// deepseek-v4: tokens every query sees directly (sliding_window).
    #[arg(long, default_value_t = 128)]
    pub sliding_window: usize,
    /// deepseek-v4: tokens per compressed entry of CSA layers.
    #[arg(long, default_value_t = 4)]
    pub csa_rate: usize,
    /// deepseek-v4: tokens per compressed entry of HCA layers.
    #[arg(long, default_value_t = 128)]
    pub hca_rate: usize,
}

impl Default for DsArgs {
    /// The command-line defaults.
    fn default() -> Self {
        use clap::{Args, FromArgMatches};
        let cmd = Self::augment_args(clap::Command::new("synth"));
        Self::from_arg_matches(&cmd.get_matches_from(["synth"])).expect("defaults parse")
    }
}

/// A deepseek-v4 layer's attention kind: `H`, `C` or `S`.
fn v4_layer_type(a: &SynthArgs, l: usize) -> char {
    match &a.ds.v4_layer_types {
        Some(t) => t.chars().nth(l).unwrap_or('S'),
        None if l < 2 => 'H',
        None if (l - 2).is_multiple_of(2) => 'C',
        None => 'H',
    }
}

/// deepseek-v4's per-head dims: head_dim (default hidden / heads) and its rope part.
fn v4_head_dim(a: &SynthArgs, heads: usize) -> usize {
    a.ds.head_dim.unwrap_or(a.hidden / heads)
}

/// The tensors of a deepseek-v4 checkpoint (the names transformers saves, arch doc 0.6).
fn v4_plan(pl: &mut Plan, a: &SynthArgs, heads: usize) {
    let (d, hd, x) = (a.hidden, v4_head_dim(a, heads), &a.ds);
    let hc = x.hc_mult;
    let n = (2 + hc) * hc;
    let (ql, inter) = (x.q_lora_rank, a.moe_intermediate);
    let small = |pl: &mut Plan, name: String, shape: Vec<usize>| {
        pl.push(name, DType::F32, shape, Init::Uniform(0.5))
    };
    for l in 0..a.layers {
        let p = format!("model.layers.{l}");
        pl.norm(format!("{p}.attn_norm.weight"), d);
        pl.norm(format!("{p}.ffn_norm.weight"), d);
        for sub in ["attn", "ffn"] {
            pl.mat(format!("{p}.hc_{sub}_fn"), n, hc * d);
            small(pl, format!("{p}.hc_{sub}_base"), vec![n]);
            small(pl, format!("{p}.hc_{sub}_scale"), vec![3]);
        }
        let s = format!("{p}.attn");
        pl.mat(format!("{s}.wq_a.weight"), ql, d);
        pl.norm(format!("{s}.q_norm.weight"), ql);
        pl.mat(format!("{s}.wq_b.weight"), heads * hd, ql);
        pl.mat(format!("{s}.wkv.weight"), hd, d);
        pl.norm(format!("{s}.norm.weight"), hd);
        pl.mat(
            format!("{s}.wo_a.weight"),
            x.o_groups * x.o_lora_rank,
            heads * hd / x.o_groups,
        );
        pl.mat(format!("{s}.wo_b.weight"), d, x.o_groups * x.o_lora_rank);
        small(pl, format!("{s}.attn_sink"), vec![heads]);
        let compressor = |pl: &mut Plan, c: String, dim: usize, width: usize, rate: usize| {
            pl.mat(format!("{c}.wkv.weight"), width, d);
            pl.mat(format!("{c}.wgate.weight"), width, d);
            small(pl, format!("{c}.ape"), vec![rate, width]);
            pl.norm(format!("{c}.norm.weight"), dim);
        };
        match v4_layer_type(a, l) {
            'H' => compressor(pl, format!("{s}.compressor"), hd, hd, x.hca_rate),
            'C' => {
                compressor(pl, format!("{s}.compressor"), hd, 2 * hd, x.csa_rate);
                let (ni, ci) = (x.index_heads, x.index_head_dim);
                pl.mat(format!("{s}.indexer.wq_b.weight"), ni * ci, ql);
                pl.mat(format!("{s}.indexer.weights_proj.weight"), ni, d);
                compressor(
                    pl,
                    format!("{s}.indexer.compressor"),
                    ci,
                    2 * ci,
                    x.csa_rate,
                );
            }
            _ => {}
        }
        let f = format!("{p}.ffn");
        let layout = a.arch.experts().expect("deepseek-v4 has routed experts");
        pl.router(&layout, l, a.experts, d);
        if l < x.hash_layers {
            pl.push(
                format!("{f}.gate.tid2eid"),
                DType::I64,
                vec![a.vocab, a.top_k],
                Init::ExpertIds(a.experts),
            );
        } else {
            pl.correction_bias(format!("{f}.gate.bias"), a.experts);
        }
        pl.experts(&layout, l, a.experts, inter, d);
        let q = format!("{f}.shared_experts");
        pl.mat(format!("{q}.w1.weight"), inter, d);
        pl.mat(format!("{q}.w3.weight"), inter, d);
        pl.mat(format!("{q}.w2.weight"), d, inter);
    }
    pl.mat("model.hc_head.hc_fn".into(), hc, hc * d);
    small(pl, "model.hc_head.hc_base".into(), vec![hc]);
    small(pl, "model.hc_head.hc_scale".into(), vec![1]);
}

/// The shape rules of deepseek-v4.
fn check_v4(a: &SynthArgs, heads: usize) -> Result<()> {
    let (hd, x) = (v4_head_dim(a, heads), &a.ds);
    if let Some(t) = &x.v4_layer_types {
        if t.chars().count() != a.layers || t.chars().any(|c| !"HCS".contains(c)) {
            bail!(
                "--v4-layer-types: one of H, C, S per layer ({} layers), got `{t}`",
                a.layers
            );
        }
    }
    if x.q_lora_rank == 0 || x.qk_rope_dim == 0 || x.qk_rope_dim > hd || x.qk_rope_dim % 2 != 0 {
        bail!(
            "deepseek-v4 needs --q-lora-rank > 0 and an even --qk-rope-dim between 2 and the head dim {hd}"
        );
    }
    if x.o_groups == 0 || !heads.is_multiple_of(x.o_groups) {
        bail!("--o-groups {} must divide --heads {heads}", x.o_groups);
    }
    if x.hc_mult == 0 || x.csa_rate == 0 || x.hca_rate == 0 || x.sliding_window == 0 {
        bail!("--hc-mult, --csa-rate, --hca-rate and --sliding-window must be positive");
    }
    if x.index_head_dim < x.qk_rope_dim {
        bail!("--index-head-dim must be at least --qk-rope-dim");
    }
    if x.hash_layers > a.layers {
        bail!(
            "--hash-layers {} is more than --layers {}",
            x.hash_layers,
            a.layers
        );
    }
    Ok(())
}

/// glm_moe_dsa's `index_skip_topk_offset` (the transformers default).
const INDEX_SKIP_OFFSET: usize = 2;

/// Whether glm-moe-dsa layer `i` runs its own indexer ("full") rather than reusing the previous
/// layer's top-k ("shared"): `max(i − offset + 1, 0) % freq == 0`.
fn indexer_full(i: usize, freq: usize) -> bool {
    (i + 1)
        .saturating_sub(INDEX_SKIP_OFFSET)
        .is_multiple_of(freq)
}

/// Run `coli synth`.
pub fn run(args: SynthArgs) -> Result<()> {
    colibri::tensor::threads::init(args.threads)?;
    let t0 = std::time::Instant::now();
    match synthesize(&args, true)? {
        None => eprintln!(
            "coli: wrote {} (random weights, seed {})",
            args.out.display(),
            args.seed
        ),
        Some(report) => {
            for w in &report.warnings {
                eprintln!("coli: warning: {w}");
            }
            let size = std::fs::metadata(&args.out)
                .with_context(|| format!("reading {}", args.out.display()))?
                .len();
            eprintln!(
                "coli: wrote {} ({}; random weights, seed {}; {} tensors: {}; {} from {} of {}) in {:.1} s",
                args.out.display(),
                format_size(size),
                args.seed,
                report.tensors,
                report.types_summary(),
                format_size(report.bytes_out),
                format_size(report.bytes_in),
                match args.dtype {
                    SynthDType::Bf16 => "bf16",
                    SynthDType::F32 => "f32",
                },
                t0.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

/// A size as every size the binary prints (KiB/MiB/GiB).
fn format_size(bytes: u64) -> String {
    colibri::store::budget::format_size(bytes)
}

/// How a tensor is filled.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    /// All ones (norm weights).
    Ones,
    /// All zeros (zero-centred norm weights).
    Zeros,
    /// Uniform in ±scale.
    Uniform(f32),
    /// Uniform in [0, scale) (router correction biases).
    Positive(f32),
    /// Rows of distinct expert ids below the count (deepseek-v4's `tid2eid`, I64).
    ExpertIds(usize),
    /// Packed E2M1 codes (two per byte, low nibble first) of a fused `[E, R, C]` expert
    /// tensor in the row layout: the code of element `i` is [`fp4_code`]`(i)`.
    Fp4Codes,
    /// One E8M0 scale byte per 32 values, all the same.
    Fp4Scale(u8),
    /// The values an [`Init::Fp4Codes`] tensor `[E, R, C]` with scale byte `scale` holds, in
    /// the `x·W` layout `[E, C, R]`.
    Fp4Values { rows: usize, cols: usize, scale: u8 },
}

/// One tensor and how to fill it.
struct Planned {
    spec: TensorSpec,
    init: Init,
}

/// Half-width of the uniform init of biases (attention, indexer LayerNorm).
const BIAS_SCALE: f32 = 0.1;
/// Upper end of the uniform init of router correction biases.
const CORRECTION_BIAS_SCALE: f32 = 0.1;

/// The tensors of a checkpoint being planned: matrices and biases in order, then the norms.
struct Plan {
    dtype: DType,
    mats: Vec<Planned>,
    norms: Vec<Planned>,
}

impl Plan {
    fn push(&mut self, name: String, dtype: DType, shape: Vec<usize>, init: Init) {
        self.mats.push(Planned {
            spec: TensorSpec { name, dtype, shape },
            init,
        });
    }

    /// A `[rows, cols]` matrix with `init_scale`'s init.
    fn mat(&mut self, name: String, rows: usize, cols: usize) {
        let scale = init_scale(&name, cols);
        self.push(name, self.dtype, vec![rows, cols], Init::Uniform(scale));
    }

    /// A bias of the weight dtype, small uniform.
    fn bias(&mut self, name: String, n: usize) {
        self.push(name, self.dtype, vec![n], Init::Uniform(BIAS_SCALE));
    }

    /// A router's selection-only correction bias (f32, one per expert, small positive).
    fn correction_bias(&mut self, name: String, experts: usize) {
        let init = Init::Positive(CORRECTION_BIAS_SCALE);
        self.push(name, DType::F32, vec![experts], init);
    }

    /// A norm weight (all ones).
    fn norm(&mut self, name: String, n: usize) {
        self.norm_of(name, n, Init::Ones);
    }

    /// A zero-centred norm's weight (all zeros: it scales by `1 + w`).
    fn zero_centred_norm(&mut self, name: String, n: usize) {
        self.norm_of(name, n, Init::Zeros);
    }

    fn norm_of(&mut self, name: String, n: usize, init: Init) {
        self.norms.push(Planned {
            spec: TensorSpec {
                name,
                dtype: self.dtype,
                shape: vec![n],
            },
            init,
        });
    }

    /// Layer `l`'s router (`[experts, hidden]`), where the family keeps it.
    fn router(&mut self, layout: &Experts, l: usize, experts: usize, hidden: usize) {
        self.mat(
            format!("{}.weight", layout.router("model", l)),
            experts,
            hidden,
        );
    }

    /// Layer `l`'s routed experts, each a gate and up `[inter, hidden]` and a down
    /// `[hidden, inter]` matrix, named as the family names them.
    fn experts(&mut self, layout: &Experts, l: usize, experts: usize, inter: usize, hidden: usize) {
        for e in 0..experts {
            for (i, (rows, cols)) in [(inter, hidden), (inter, hidden), (hidden, inter)]
                .into_iter()
                .enumerate()
            {
                self.mat(layout.matrix("model", l, e, i), rows, cols);
            }
        }
    }

    fn finish(mut self) -> Vec<Planned> {
        self.mats.append(&mut self.norms);
        self.mats
    }
}

/// Head dim of the non-MLA attention.
fn head_dim(a: &SynthArgs, heads: usize) -> usize {
    match a.arch {
        SynthArch::Glm4Moe | SynthArch::Qwen3Next | SynthArch::Qwen35Moe | SynthArch::GptOss => {
            a.ds.head_dim.unwrap_or(a.hidden / heads)
        }
        _ => a.hidden / heads,
    }
}

/// Width of dense MLPs.
fn dense_intermediate(a: &SynthArgs) -> usize {
    a.intermediate.unwrap_or(4 * a.hidden)
}

fn plan(a: &SynthArgs, heads: usize, kv_heads: usize) -> Vec<Planned> {
    let dtype = match a.dtype {
        SynthDType::Bf16 => DType::BF16,
        SynthDType::F32 => DType::F32,
    };
    let (d, hd) = (a.hidden, head_dim(a, heads));
    let mut pl = Plan {
        dtype,
        mats: Vec::new(),
        norms: Vec::new(),
    };
    pl.mat("model.embed_tokens.weight".into(), a.vocab, d);
    if a.arch == SynthArch::DeepseekV4 {
        v4_plan(&mut pl, a, heads);
        pl.norm("model.norm.weight".into(), d);
        pl.mat(
            format!("{}.weight", a.arch.family().names.lm_head),
            a.vocab,
            d,
        );
        return pl.finish();
    }
    if a.arch == SynthArch::GptOss {
        for l in 0..a.layers {
            gpt_oss_layer(&mut pl, a, l, heads, kv_heads);
        }
        pl.norm("model.norm.weight".into(), d);
        pl.mat("lm_head.weight".into(), a.vocab, d);
        return pl.finish();
    }
    if a.arch.delta_net() {
        for l in 0..a.layers {
            delta_net_layer(&mut pl, a, l, heads, kv_heads);
        }
        pl.zero_centred_norm("model.norm.weight".into(), d);
        pl.mat(
            format!("{}.weight", a.arch.family().names.lm_head),
            a.vocab,
            d,
        );
        return pl.finish();
    }
    if a.arch.deepseek_style() {
        for l in 0..a.layers {
            let dense = l < a.ds.first_dense;
            let indexer = indexer_full(l, a.ds.index_topk_freq);
            ds_layer(&mut pl, a, l, heads, kv_heads, dense, indexer);
        }
        if a.ds.mtp {
            // DeepSeek-style MTP: the embedding and the main model's last hidden state are
            // normed, concatenated and projected, then run through one MoE decoder layer and a
            // head of its own. It runs on its own, so on glm-moe-dsa it has an indexer.
            let p = format!("model.layers.{}", a.layers);
            pl.norm(format!("{p}.enorm.weight"), d);
            pl.norm(format!("{p}.hnorm.weight"), d);
            pl.mat(format!("{p}.eh_proj.weight"), d, 2 * d);
            pl.norm(format!("{p}.shared_head.norm.weight"), d);
            pl.mat(format!("{p}.shared_head.head.weight"), a.vocab, d);
            ds_layer(&mut pl, a, a.layers, heads, kv_heads, false, true);
        }
    }
    let plain_layers = if a.arch.deepseek_style() { 0 } else { a.layers };
    for l in 0..plain_layers {
        let p = format!("model.layers.{l}");
        pl.mat(format!("{p}.self_attn.q_proj.weight"), heads * hd, d);
        pl.mat(format!("{p}.self_attn.k_proj.weight"), kv_heads * hd, d);
        pl.mat(format!("{p}.self_attn.v_proj.weight"), kv_heads * hd, d);
        pl.mat(format!("{p}.self_attn.o_proj.weight"), d, heads * hd);
        pl.norm(format!("{p}.input_layernorm.weight"), d);
        pl.norm(format!("{p}.post_attention_layernorm.weight"), d);
        match a.arch {
            SynthArch::Olmoe => {
                pl.norm(format!("{p}.self_attn.q_norm.weight"), heads * hd);
                pl.norm(format!("{p}.self_attn.k_norm.weight"), kv_heads * hd);
            }
            SynthArch::Qwen3Moe => {
                pl.norm(format!("{p}.self_attn.q_norm.weight"), hd);
                pl.norm(format!("{p}.self_attn.k_norm.weight"), hd);
            }
            _ => {}
        }
        let inter = a.moe_intermediate;
        match a.arch {
            SynthArch::Olmoe | SynthArch::Qwen3Moe | SynthArch::Mixtral => {
                let layout = a.arch.experts().expect("a MoE family has routed experts");
                pl.router(&layout, l, a.experts, d);
                pl.experts(&layout, l, a.experts, inter, d);
            }
            SynthArch::Llama => {
                let i = dense_intermediate(a);
                pl.mat(format!("{p}.mlp.gate_proj.weight"), i, d);
                pl.mat(format!("{p}.mlp.up_proj.weight"), i, d);
                pl.mat(format!("{p}.mlp.down_proj.weight"), d, i);
            }
            SynthArch::DeepseekV3
            | SynthArch::Glm4Moe
            | SynthArch::GlmMoeDsa
            | SynthArch::DeepseekV4
            | SynthArch::Qwen3Next
            | SynthArch::Qwen35Moe
            | SynthArch::KimiLinear
            | SynthArch::GptOss => unreachable!(),
        }
    }
    pl.norm("model.norm.weight".into(), d);
    pl.mat(
        format!("{}.weight", a.arch.family().names.lm_head),
        a.vocab,
        d,
    );
    pl.finish()
}

/// One decoder layer of deepseek-v3 / glm4-moe / glm-moe-dsa under prefix `p` (hub names):
/// MLA or GQA attention, the DSA indexer when `indexer` (glm-moe-dsa only), then a dense MLP
/// or the MoE block (router with its correction bias, routed and shared experts).
fn ds_layer(
    pl: &mut Plan,
    a: &SynthArgs,
    l: usize,
    heads: usize,
    kv_heads: usize,
    dense: bool,
    indexer: bool,
) {
    let (d, x) = (a.hidden, &a.ds);
    let p = format!("model.layers.{l}");
    pl.norm(format!("{p}.input_layernorm.weight"), d);
    pl.norm(format!("{p}.post_attention_layernorm.weight"), d);
    let s = format!("{p}.self_attn");
    if a.arch == SynthArch::KimiLinear && linear_layer(a, l) {
        kda_attention(pl, a, &s);
    } else if a.arch.mla() {
        let qk = x.qk_nope_dim + x.qk_rope_dim;
        if x.q_lora_rank > 0 {
            pl.mat(format!("{s}.q_a_proj.weight"), x.q_lora_rank, d);
            pl.norm(format!("{s}.q_a_layernorm.weight"), x.q_lora_rank);
            pl.mat(format!("{s}.q_b_proj.weight"), heads * qk, x.q_lora_rank);
        } else {
            pl.mat(format!("{s}.q_proj.weight"), heads * qk, d);
        }
        let kv_a = x.kv_lora_rank + x.qk_rope_dim;
        pl.mat(format!("{s}.kv_a_proj_with_mqa.weight"), kv_a, d);
        pl.norm(format!("{s}.kv_a_layernorm.weight"), x.kv_lora_rank);
        let kv_b = heads * (x.qk_nope_dim + x.v_head_dim);
        pl.mat(format!("{s}.kv_b_proj.weight"), kv_b, x.kv_lora_rank);
        pl.mat(format!("{s}.o_proj.weight"), d, heads * x.v_head_dim);
        if indexer && a.arch == SynthArch::GlmMoeDsa {
            let (n, c) = (x.index_heads, x.index_head_dim);
            pl.mat(format!("{s}.indexer.wq_b.weight"), n * c, x.q_lora_rank);
            pl.mat(format!("{s}.indexer.wk.weight"), c, d);
            pl.norm(format!("{s}.indexer.k_norm.weight"), c);
            pl.bias(format!("{s}.indexer.k_norm.bias"), c);
            pl.mat(format!("{s}.indexer.weights_proj.weight"), n, d);
        }
    } else {
        let hd = head_dim(a, heads);
        for (proj, rows) in [
            ("q", heads * hd),
            ("k", kv_heads * hd),
            ("v", kv_heads * hd),
        ] {
            pl.mat(format!("{s}.{proj}_proj.weight"), rows, d);
            pl.bias(format!("{s}.{proj}_proj.bias"), rows);
        }
        pl.mat(format!("{s}.o_proj.weight"), d, heads * hd);
        if x.qk_norm {
            pl.norm(format!("{s}.q_norm.weight"), hd);
            pl.norm(format!("{s}.k_norm.weight"), hd);
        }
    }
    let layout = a
        .arch
        .experts()
        .expect("a DeepSeek-style family has routed experts");
    let m = layout.block("model", l);
    if dense {
        let i = dense_intermediate(a);
        pl.mat(format!("{m}.gate_proj.weight"), i, d);
        pl.mat(format!("{m}.up_proj.weight"), i, d);
        pl.mat(format!("{m}.down_proj.weight"), d, i);
        return;
    }
    let inter = a.moe_intermediate;
    pl.router(&layout, l, a.experts, d);
    pl.correction_bias(format!("{m}.gate.e_score_correction_bias"), a.experts);
    pl.experts(&layout, l, a.experts, inter, d);
    if x.shared_experts > 0 {
        let w = inter * x.shared_experts;
        pl.mat(format!("{m}.shared_experts.gate_proj.weight"), w, d);
        pl.mat(format!("{m}.shared_experts.up_proj.weight"), w, d);
        pl.mat(format!("{m}.shared_experts.down_proj.weight"), d, w);
    }
}

/// Half-width of the uniform init of a matrix. Like a trained model's, the residual stream
/// stays dominated by the token (embeddings of unit scale, residual-branch outputs scaled down),
/// so routing differs from token to token instead of collapsing onto a few experts. Every other
/// matrix keeps the RMS of its (normed) input: the MLA latents and their up-projections, the
/// indexer, routers, the MTP `eh_proj` and heads.
fn init_scale(name: &str, fan_in: usize) -> f32 {
    let unit = (3.0 / fan_in as f32).sqrt();
    if name.ends_with("embed_tokens.weight") {
        3.0f32.sqrt()
    } else if name.ends_with("o_proj.weight")
        || name.ends_with("down_proj.weight")
        || name.ends_with(".w2.weight")
        || name.ends_with("wo_b.weight")
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
    let x = &a.ds;
    // Keys every DeepSeek-style MoE shares (transformers' names, as in its saved configs).
    let ds_moe = json!({
        "intermediate_size": dense_intermediate(a), "moe_intermediate_size": a.moe_intermediate,
        "n_routed_experts": a.experts, "n_shared_experts": x.shared_experts,
        "num_experts_per_tok": a.top_k, "n_group": x.n_group, "topk_group": x.topk_group,
        "norm_topk_prob": true, "routed_scaling_factor": x.routed_scaling,
        "first_k_dense_replace": x.first_dense, "num_nextn_predict_layers": usize::from(x.mtp),
        "output_router_logits": false, "pad_token_id": bos,
    });
    let mla = json!({
        "q_lora_rank": if x.q_lora_rank > 0 { json!(x.q_lora_rank) } else { json!(null) },
        "kv_lora_rank": x.kv_lora_rank, "qk_nope_head_dim": x.qk_nope_dim,
        "qk_rope_head_dim": x.qk_rope_dim, "qk_head_dim": x.qk_nope_dim + x.qk_rope_dim,
        "v_head_dim": x.v_head_dim, "head_dim": x.qk_rope_dim,
    });
    let extra = match a.arch {
        SynthArch::Olmoe => json!({
            "architectures": ["OlmoeForCausalLM"], "model_type": SynthArch::Olmoe.model_type(),
            "intermediate_size": a.moe_intermediate, "num_experts": a.experts,
            "num_experts_per_tok": a.top_k, "norm_topk_prob": false, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "clip_qkv": null,
        }),
        SynthArch::Qwen3Moe => json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": SynthArch::Qwen3Moe.model_type(),
            "intermediate_size": 4 * a.hidden, "moe_intermediate_size": a.moe_intermediate,
            "num_experts": a.experts, "num_experts_per_tok": a.top_k, "norm_topk_prob": true,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "head_dim": a.hidden / heads,
            "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "use_sliding_window": false, "sliding_window": null,
        }),
        SynthArch::Mixtral => json!({
            "architectures": ["MixtralForCausalLM"], "model_type": SynthArch::Mixtral.model_type(),
            "intermediate_size": a.moe_intermediate, "num_local_experts": a.experts,
            "num_experts_per_tok": a.top_k, "rms_norm_eps": 1e-5, "sliding_window": null,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        }),
        SynthArch::Llama => json!({
            "architectures": ["LlamaForCausalLM"], "model_type": SynthArch::Llama.model_type(),
            "intermediate_size": dense_intermediate(a), "rms_norm_eps": 1e-6,
            "mlp_bias": false, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }),
        // The hub's YaRN (factor 40 over 4096 positions, mscale 1), which also scales the
        // softmax by mscale².
        SynthArch::DeepseekV3 => merged(&[
            &ds_moe,
            &mla,
            &json!({
                "architectures": ["DeepseekV3ForCausalLM"], "model_type": SynthArch::DeepseekV3.model_type(),
                "rms_norm_eps": 1e-6, "rope_interleave": true, "pretraining_tp": 1,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                    "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                    "mscale": 1.0, "mscale_all_dim": 1.0},
            }),
        ]),
        SynthArch::Glm4Moe => merged(&[
            &ds_moe,
            &json!({
                "architectures": ["Glm4MoeForCausalLM"], "model_type": SynthArch::Glm4Moe.model_type(),
                "head_dim": head_dim(a, heads), "attention_bias": true, "use_qk_norm": x.qk_norm,
                "rms_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                    "partial_rotary_factor": 0.5},
            }),
        ]),
        SynthArch::DeepseekV4 => v4_config(a, heads),
        SynthArch::Qwen3Next | SynthArch::Qwen35Moe => delta_net_config(a, heads),
        SynthArch::KimiLinear => kimi_linear_config(a, heads),
        SynthArch::GptOss => gpt_oss_config(a, heads),
        SynthArch::GlmMoeDsa => {
            let indexer_types: Vec<&str> = (0..a.layers)
                .map(|l| {
                    if indexer_full(l, x.index_topk_freq) {
                        "full"
                    } else {
                        "shared"
                    }
                })
                .collect();
            let mlp_layer_types: Vec<&str> = (0..a.layers)
                .map(|l| if l < x.first_dense { "dense" } else { "sparse" })
                .collect();
            merged(&[
                &ds_moe,
                &mla,
                &json!({
                    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": SynthArch::GlmMoeDsa.model_type(),
                    "rms_norm_eps": 1e-5, "mlp_bias": false,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                    "index_topk": x.index_topk, "index_n_heads": x.index_heads,
                    "index_head_dim": x.index_head_dim, "index_topk_freq": x.index_topk_freq,
                    "index_skip_topk_offset": INDEX_SKIP_OFFSET, "indexer_types": indexer_types,
                    "layer_types": vec!["indexed_attention"; a.layers],
                    "mlp_layer_types": mlp_layer_types,
                }),
            ])
        }
    };
    for (k, val) in extra.as_object().unwrap() {
        v[k] = val.clone();
    }
    v
}

/// deepseek-v4's config keys (as transformers writes them).
fn v4_config(a: &SynthArgs, heads: usize) -> serde_json::Value {
    let (hd, x) = (v4_head_dim(a, heads), &a.ds);
    let partial = x.qk_rope_dim as f64 / hd as f64;
    let layer_types: Vec<&str> = (0..a.layers)
        .map(|l| match v4_layer_type(a, l) {
            'H' => "heavily_compressed_attention",
            'C' => "compressed_sparse_attention",
            _ => "sliding_attention",
        })
        .collect();
    let mlp_layer_types: Vec<&str> = (0..a.layers)
        .map(|l| if l < x.hash_layers { "hash_moe" } else { "moe" })
        .collect();
    json!({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": SynthArch::DeepseekV4.model_type(),
        "num_key_value_heads": 1, "head_dim": hd, "q_lora_rank": x.q_lora_rank,
        "qk_rope_head_dim": x.qk_rope_dim, "partial_rotary_factor": partial,
        "moe_intermediate_size": a.moe_intermediate, "n_routed_experts": a.experts,
        "n_shared_experts": 1, "num_experts_per_tok": a.top_k, "norm_topk_prob": true,
        "routed_scaling_factor": x.routed_scaling, "scoring_func": "sqrtsoftplus",
        "swiglu_limit": 10.0, "hc_mult": x.hc_mult, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "o_groups": x.o_groups, "o_lora_rank": x.o_lora_rank, "sliding_window": x.sliding_window,
        "index_n_heads": x.index_heads, "index_head_dim": x.index_head_dim,
        "index_topk": x.index_topk, "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
        "compress_rates": {"compressed_sparse_attention": x.csa_rate,
            "heavily_compressed_attention": x.hca_rate},
        "layer_types": layer_types, "mlp_layer_types": mlp_layer_types,
        "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial},
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                "attention_factor": 1.0, "partial_rotary_factor": partial},
        },
        "rms_norm_eps": 1e-6, "mlp_bias": false, "num_nextn_predict_layers": 0,
        "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        "output_router_logits": false, "pad_token_id": 0,
    })
}

/// The union of JSON objects (later ones win).
fn merged(parts: &[&serde_json::Value]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for p in parts {
        for (k, v) in p.as_object().unwrap() {
            out.insert(k.clone(), v.clone());
        }
    }
    serde_json::Value::Object(out)
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
    // The row-layout codes of the fused tensor, whichever form is written.
    let base = p.spec.name.strip_suffix("_blocks").unwrap_or(&p.spec.name);
    match p.init {
        Init::Fp4Codes => {
            return (0..n)
                .map(|i| {
                    let b = (chunk * CHUNK + i) as u64;
                    fp4_code(seed, base, 2 * b) | (fp4_code(seed, base, 2 * b + 1) << 4)
                })
                .collect();
        }
        Init::Fp4Scale(byte) => return vec![byte; n],
        Init::Fp4Values { rows, cols, scale } => {
            let unit = colibri::tensor::microscale::e8m0_to_f32(scale);
            let vals: Vec<f32> = (0..n)
                .map(|i| {
                    // Element (e, c, r) of [E, C, R] is element (e, r, c) of the row layout.
                    let at = chunk * CHUNK + i;
                    let (e, c, r) = (at / (cols * rows), at / rows % cols, at % rows);
                    let idx = ((e * rows + r) * cols + c) as u64;
                    colibri::tensor::microscale::e2m1_to_f32(fp4_code(seed, base, idx)) * unit
                })
                .collect();
            return float_bytes(&vals, p.spec.dtype);
        }
        _ => {}
    }
    if let Init::ExpertIds(experts) = p.init {
        // Row r holds (start_r + j) mod experts for its k slots: distinct while k ≤ experts.
        let k = p.spec.shape[1];
        return (0..n)
            .flat_map(|i| {
                let at = chunk * CHUNK + i;
                let (row, j) = (at / k, at % k);
                let start = chunk_seed(seed, &p.spec.name, row) as usize % experts;
                (((start + j) % experts) as i64).to_le_bytes()
            })
            .collect();
    }
    let mut vals = vec![1.0f32; n];
    let (scale, shift) = match p.init {
        Init::Ones => (0.0, 0.0),
        Init::Zeros => {
            vals.fill(0.0);
            (0.0, 0.0)
        }
        Init::Uniform(s) => (s, 0.0),
        Init::Positive(s) => (s * 0.5, 1.0),
        Init::ExpertIds(_) | Init::Fp4Codes | Init::Fp4Scale(_) | Init::Fp4Values { .. } => {
            unreachable!("filled above")
        }
    };
    if !matches!(p.init, Init::Ones | Init::Zeros) {
        let mut s = chunk_seed(seed, &p.spec.name, chunk);
        for v in &mut vals {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Uniform in [-1, 1), shifted to [0, 2) for Positive.
            *v = ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0 + shift) * scale;
        }
    }
    float_bytes(&vals, p.spec.dtype)
}

/// `vals` as little-endian bf16 or f32 bytes.
fn float_bytes(vals: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::BF16 => vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
        _ => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// The E2M1 code of element `idx` (row layout) of the fused expert tensor `base`.
fn fp4_code(seed: u64, base: &str, idx: u64) -> u8 {
    let mut z = chunk_seed(seed, base, 0) ^ idx.wrapping_mul(0x9E3779B97F4A7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    ((z ^ (z >> 31)) >> 60) as u8
}

/// Write the checkpoint described by `args` to `args.out`: the model directory, or with
/// `--format gguf` the GGUF file (then the conversion's report is returned).
pub fn synthesize(args: &SynthArgs, progress: bool) -> Result<Option<ConvertReport>> {
    if args.out.exists() {
        bail!(
            "--out {}: already exists (choose a new {})",
            args.out.display(),
            match args.format {
                SynthFormat::Safetensors => "directory",
                SynthFormat::Gguf => "file",
            }
        );
    }
    match args.format {
        SynthFormat::Safetensors if args.ty.is_some() => {
            bail!("--type: only with --format gguf (safetensors are written in --dtype)")
        }
        SynthFormat::Gguf if args.arch.family().gguf.is_none() => {
            let supported: Vec<String> = <SynthArch as clap::ValueEnum>::value_variants()
                .iter()
                .filter(|a| a.family().gguf.is_some())
                .map(|a| a.flag_value())
                .collect();
            bail!(
                "--format gguf: llama.cpp has no GGUF layout for --arch {} (GGUF: {})",
                args.arch.flag_value(),
                supported.join(", ")
            )
        }
        _ => {}
    }
    if args.hidden == 0 || args.layers == 0 || args.vocab == 0 {
        bail!("--hidden, --layers and --vocab must be positive");
    }
    let heads = args.heads.unwrap_or((args.hidden / 128).max(1));
    let kv_heads = if args.arch == SynthArch::DeepseekV4 {
        1
    } else if args.arch.mla() {
        if args.kv_heads.is_some_and(|k| k != heads) {
            bail!("--kv-heads: MLA has one key/value head per query head (leave it out)");
        }
        heads
    } else {
        args.kv_heads.unwrap_or(heads)
    };
    // MLA and an explicit --head-dim need no head dim of hidden / heads.
    let free_head_dim = args.arch.mla()
        || ((args.arch.deepseek_style()
            || args.arch == SynthArch::DeepseekV4
            || args.arch == SynthArch::GptOss
            || args.arch.delta_net())
            && args.ds.head_dim.is_some());
    if heads == 0
        || kv_heads == 0
        || (!free_head_dim && !args.hidden.is_multiple_of(heads))
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
    if args.arch.deepseek_style() {
        check_ds(args, heads)?;
    }
    if args.mxfp4
        && (args.arch != SynthArch::GptOss
            || !args.hidden.is_multiple_of(32)
            || !args.moe_intermediate.is_multiple_of(32))
    {
        bail!(
            "--mxfp4: only gpt-oss, with --hidden ({}) and --moe-intermediate ({}) multiples of 32",
            args.hidden,
            args.moe_intermediate
        );
    }
    if args.arch == SynthArch::GptOss && (args.moe_intermediate == 0 || args.ds.sliding_window == 0)
    {
        bail!("--moe-intermediate and --sliding-window must be positive");
    }
    if args.arch == SynthArch::DeepseekV4 {
        check_v4(args, heads)?;
    }
    if args.arch.delta_net() {
        let x = &args.linear;
        if x.linear_key_heads == 0
            || x.linear_head_dim == 0
            || x.conv_kernel == 0
            || x.full_attention_interval == 0
            || !x.linear_value_heads.is_multiple_of(x.linear_key_heads)
            || x.linear_value_heads == 0
        {
            bail!(
                "--linear-value-heads {} must be a positive multiple of --linear-key-heads {}, and --linear-head-dim, --conv-kernel and --full-attention-interval positive",
                x.linear_value_heads,
                x.linear_key_heads
            );
        }
    }
    let parent = args
        .out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    if args.format == SynthFormat::Gguf {
        return write_gguf(args, parent, heads, kv_heads, progress).map(Some);
    }
    // Locked while `_lock` lives; a stale one of a killed run is removed first.
    let (tmp, _lock) = create_tmp_dir(&args.out)?;
    let result = write_all(args, &tmp, heads, kv_heads, progress);
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result?;
    std::fs::rename(&tmp, &args.out)
        .with_context(|| format!("renaming {} to {}", tmp.display(), args.out.display()))?;
    colibri::format::write::sync_parent(&args.out)?;
    Ok(None)
}

/// Room the GGUF header (metadata, vocabulary, merges, tensor infos) and the small text files
/// of the conversion are given beyond the tensor data when free space is checked.
const GGUF_HEADER_ALLOWANCE: u64 = 64 << 20;

/// `--format gguf`: the text files the converter reads its metadata from go to a temporary
/// directory beside `--out` (removed at the end), the tensors are generated one at a time as
/// the converter asks for them, and the file is written to a temporary renamed into place.
fn write_gguf(
    args: &SynthArgs,
    parent: &Path,
    heads: usize,
    kv_heads: usize,
    progress: bool,
) -> Result<ConvertReport> {
    let mix = args.ty.unwrap_or(ConvertType::Q8_0);
    let file = args.out.file_name().unwrap_or_default().to_string_lossy();
    // Named after the output; locked while `_lock` lives, a stale one removed first.
    let (text, _lock) = create_tmp_dir(&args.out.with_file_name(format!("{file}.text")))?;
    let result = (|| {
        write_text(args, &text, heads, kv_heads)?;
        let planned = plan(args, heads, kv_heads);
        let source = Generated::new(&planned, args.seed, &args.out);
        // `coli convert` names a file after its model directory: --out without its extension
        // is that directory's name.
        let name = args.out.file_stem().unwrap_or_default().to_string_lossy();
        let conversion = Conversion::plan(&text, &name, &source, mix, ConvertOptions::default())
            .with_context(|| format!("planning the GGUF {}", args.out.display()))?;
        let need = conversion.tensor_bytes()? + GGUF_HEADER_ALLOWANCE;
        check_free_space(&args.out, parent, need)?;
        let bar = progress_bar(progress, conversion.source_bytes(), "generating");
        let report = conversion
            .write(&args.out, |p: &ConvertProgress| {
                bar.set_position(p.source_done);
                bar.set_message(format!(
                    "{}/{} tensors, {} written",
                    p.tensors_done,
                    p.tensors,
                    format_size(p.written)
                ));
            })
            .with_context(|| format!("writing {}", args.out.display()))?;
        bar.finish_and_clear();
        Ok(report)
    })();
    let _ = std::fs::remove_dir_all(&text);
    result
}

/// Refuse to start writing `out` when the file system holding its directory `dir` has less
/// than `need` bytes free.
fn check_free_space(out: &Path, dir: &Path, need: u64) -> Result<()> {
    let st = rustix::fs::statvfs(dir)
        .with_context(|| format!("checking the free space of {}", dir.display()))?;
    let free = st.f_bavail.saturating_mul(st.f_frsize);
    if free < need {
        bail!(
            "--out {}: the GGUF needs about {}, but the file system of {} has {} free",
            out.display(),
            format_size(need),
            dir.display(),
            format_size(free)
        );
    }
    Ok(())
}

/// The progress bar of a long write (hidden unless `show`): bytes of `total`, rate, eta.
fn progress_bar(show: bool, total: u64, message: &str) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new(total);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
        )
        .unwrap()
        .progress_chars("=> "),
    );
    b.set_message(message.to_string());
    b
}

/// The planned tensors of a synthetic checkpoint as a [`TensorSource`]: each tensor is
/// generated when asked for, chunk by chunk from the seeds the safetensors writer uses
/// ([`fill_chunk`]), so it holds exactly the bytes `--format safetensors` writes.
struct Generated<'a> {
    seed: u64,
    tensors: BTreeMap<&'a str, &'a Planned>,
    /// What errors name.
    out: &'a Path,
}

impl<'a> Generated<'a> {
    fn new(planned: &'a [Planned], seed: u64, out: &'a Path) -> Generated<'a> {
        let tensors = planned.iter().map(|p| (p.spec.name.as_str(), p)).collect();
        Generated { seed, tensors, out }
    }

    fn planned(&self, name: &str) -> colibri::Result<&'a Planned> {
        self.tensors.get(name).copied().ok_or_else(|| {
            colibri::Error::tensor(self.out, name, "is not a tensor of this synthetic model")
        })
    }
}

impl TensorSource for Generated<'_> {
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn describe(&self, name: &str) -> colibri::Result<SourceTensor> {
        let p = self.planned(name)?;
        Ok(SourceTensor {
            shape: p.spec.shape.clone(),
            dtype: p.spec.dtype,
            bytes: p.spec.nbytes(),
        })
    }

    fn tensor(&self, name: &str) -> colibri::Result<Tensor> {
        let p = self.planned(name)?;
        let len = p.spec.nbytes();
        let mut words = vec![0u64; len.div_ceil(8)];
        let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..len];
        // Chunk c holds elements c·CHUNK.., as the safetensors writer generates them.
        let size = p.spec.dtype.size();
        bytes
            .par_chunks_mut(CHUNK * size)
            .enumerate()
            .for_each(|(c, out)| {
                out.copy_from_slice(&fill_chunk(p, self.seed, c, out.len() / size))
            });
        Ok(Tensor {
            name: name.to_string(),
            shape: p.spec.shape.clone(),
            dtype: p.spec.dtype,
            storage: Storage::Owned {
                words: Arc::new(words),
                len,
            },
            block_scales: None,
            device: None,
            interleaved: None,
        })
    }
}

/// The shape rules of the DeepSeek-style architectures.
fn check_ds(args: &SynthArgs, heads: usize) -> Result<()> {
    let x = &args.ds;
    if args.moe_intermediate == 0 || dense_intermediate(args) == 0 {
        bail!("--moe-intermediate and --intermediate must be positive");
    }
    if x.n_group == 0 || !args.experts.is_multiple_of(x.n_group) {
        bail!(
            "--n-group {} must divide --experts {}",
            x.n_group,
            args.experts
        );
    }
    // The router scores a group by its best two experts and keeps --topk-group groups.
    let per_group = args.experts / x.n_group;
    if x.topk_group == 0 || x.topk_group > x.n_group {
        bail!(
            "--topk-group {} must be between 1 and --n-group {}",
            x.topk_group,
            x.n_group
        );
    }
    if x.n_group > 1 && per_group < 2 {
        bail!(
            "--n-group {}: each group needs at least 2 experts",
            x.n_group
        );
    }
    if args.top_k > x.topk_group * per_group {
        bail!(
            "--top-k {} is more than the {} experts in --topk-group {} groups",
            args.top_k,
            x.topk_group * per_group,
            x.topk_group
        );
    }
    if x.first_dense > args.layers {
        bail!(
            "--first-dense {} is more than --layers {}",
            x.first_dense,
            args.layers
        );
    }
    if args.arch.mla() {
        if x.kv_lora_rank == 0 || x.qk_nope_dim == 0 || x.v_head_dim == 0 {
            bail!("--kv-lora-rank, --qk-nope-dim and --v-head-dim must be positive");
        }
        if x.qk_rope_dim == 0 || !x.qk_rope_dim.is_multiple_of(2) {
            bail!("--qk-rope-dim {} must be positive and even", x.qk_rope_dim);
        }
    }
    if args.arch == SynthArch::GlmMoeDsa {
        if x.q_lora_rank == 0 {
            bail!("--q-lora-rank: glm-moe-dsa needs a query latent (its indexer reads it)");
        }
        if x.index_heads == 0 || x.index_topk == 0 || x.index_topk_freq == 0 {
            bail!("--index-heads, --index-topk and --index-topk-freq must be positive");
        }
        if x.index_head_dim < x.qk_rope_dim {
            bail!(
                "--index-head-dim {} must be at least --qk-rope-dim {}",
                x.index_head_dim,
                x.qk_rope_dim
            );
        }
    }
    if args.arch == SynthArch::Glm4Moe {
        // Partial RoPE rotates the first half of each head in pairs.
        let hd = head_dim(args, heads);
        if hd == 0 || !hd.is_multiple_of(4) {
            bail!("head dim {hd} must be a positive multiple of 4 (RoPE on half of it)");
        }
    }
    Ok(())
}

/// The text files of the checkpoint in `dir`: tokenizer.json, tokenizer_config.json (with the
/// chat template), generation_config.json and config.json.
fn write_text(args: &SynthArgs, dir: &Path, heads: usize, kv_heads: usize) -> Result<()> {
    // The tokenizer decides the special token ids.
    let tok = tokenizer::tokenizer_for(args.vocab, &tokenizer::SPECIALS)?;
    tok.save(&dir.join("tokenizer.json"))?;
    let id = |s: &str| tok.token_to_id(s).unwrap_or(0);
    let eos = vec![id("<|endoftext|>"), id("<|im_end|>")];
    let tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "chat_template": tokenizer::CHATML_TEMPLATE,
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
    Ok(())
}

/// The checkpoint in `dir`: text files first, then the weights split into shards.
fn write_all(
    args: &SynthArgs,
    dir: &Path,
    heads: usize,
    kv_heads: usize,
    progress: bool,
) -> Result<()> {
    write_text(args, dir, heads, kv_heads)?;
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
    let bar = progress_bar(progress, total as u64, "writing weights");
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;
    use std::collections::BTreeMap;

    /// Name → (dtype, shape) over every safetensors file in `dir`.
    fn header(dir: &Path) -> BTreeMap<String, (String, Vec<usize>)> {
        let mut out = BTreeMap::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "safetensors") {
                continue;
            }
            let bytes = std::fs::read(&path).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let h: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            for (name, t) in h.as_object().unwrap() {
                if name == "__metadata__" {
                    continue;
                }
                let shape = t["shape"].as_array().unwrap();
                let shape = shape.iter().map(|v| v.as_u64().unwrap() as usize).collect();
                out.insert(
                    name.clone(),
                    (t["dtype"].as_str().unwrap().to_string(), shape),
                );
            }
        }
        out
    }

    /// The f32 values of tensor `name` in `dir/model.safetensors`.
    fn f32_values(dir: &Path, name: &str) -> Vec<f32> {
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let h: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        assert_eq!(h[name]["dtype"], "F32");
        let off = &h[name]["data_offsets"];
        let (a, b) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        bytes[8 + n + a..8 + n + b]
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn config(dir: &Path) -> Value {
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap()
    }

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../engine/tests/fixtures")
            .join(name)
    }

    /// The shape of the engine's transformers fixture of `arch` (3 layers, hidden 64, 4 heads,
    /// MLA q_lora 32 / kv_lora 16 / nope 16 / rope 8 / v 16, 8 experts of 32 with 1 shared,
    /// dense width 96, layer 0 dense, vocab 384), in f32.
    fn tiny(arch: SynthArch, out: PathBuf) -> SynthArgs {
        let ds = DsArgs {
            q_lora_rank: 32,
            kv_lora_rank: 16,
            qk_nope_dim: 16,
            qk_rope_dim: 8,
            v_head_dim: 16,
            first_dense: 1,
            shared_experts: 1,
            ..DsArgs::default()
        };
        SynthArgs {
            arch,
            layers: 3,
            hidden: 64,
            heads: Some(4),
            kv_heads: None,
            experts: 8,
            top_k: 2,
            moe_intermediate: 32,
            intermediate: Some(96),
            vocab: 384,
            dtype: SynthDType::F32,
            seed: 5,
            shard_bytes: 4_000_000_000,
            out,
            threads: 0,
            ds,
            linear: LinearArgs::default(),
            mxfp4: false,
            format: SynthFormat::Safetensors,
            ty: None,
        }
    }

    fn fixture_args(arch: SynthArch, out: PathBuf) -> SynthArgs {
        let mut a = tiny(arch, out);
        match arch {
            SynthArch::DeepseekV3 => {
                a.ds.n_group = 4;
                a.ds.topk_group = 2;
            }
            SynthArch::Glm4Moe => {
                a.kv_heads = Some(2);
                a.ds.head_dim = Some(16);
                a.ds.qk_norm = true;
                a.ds.n_group = 2;
                a.ds.routed_scaling = 1.5;
            }
            SynthArch::GlmMoeDsa => {
                a.ds.index_heads = 8;
                a.ds.index_head_dim = 16;
                a.ds.index_topk = 6;
                a.ds.index_topk_freq = 2;
            }
            SynthArch::KimiLinear => {
                a.layers = 4;
                a.ds.q_lora_rank = 0;
                a.ds.routed_scaling = 2.446;
                a.linear.linear_value_heads = 4;
                a.linear.linear_head_dim = 16;
            }
            SynthArch::Qwen3Next | SynthArch::Qwen35Moe => {
                a.layers = 4;
                a.kv_heads = Some(2);
                a.ds.head_dim = Some(16);
                a.linear = LinearArgs {
                    linear_key_heads: 2,
                    linear_value_heads: 4,
                    linear_head_dim: 16,
                    conv_kernel: 4,
                    full_attention_interval: 4,
                    shared_intermediate: Some(32),
                };
            }
            SynthArch::DeepseekV4 => {
                a.layers = 4;
                a.ds.head_dim = Some(32);
                a.ds.v4_layer_types = Some("HCSC".into());
                a.ds.hash_layers = 2;
                a.ds.hc_mult = 2;
                a.ds.o_groups = 2;
                a.ds.o_lora_rank = 16;
                a.ds.sliding_window = 6;
                a.ds.csa_rate = 4;
                a.ds.hca_rate = 8;
                a.ds.index_heads = 8;
                a.ds.index_head_dim = 16;
                a.ds.index_topk = 2;
                a.ds.routed_scaling = 1.5;
            }
            SynthArch::GptOss => {
                a.layers = 2;
                a.kv_heads = Some(2);
                a.ds.head_dim = Some(16);
                a.ds.sliding_window = 12;
            }
            _ => unreachable!(),
        }
        a
    }

    /// Every tensor of the transformers-written fixture, by name, shape and dtype, and nothing
    /// else; every config key transformers wrote, with the same value for the shape keys.
    #[test]
    fn synth_matches_the_transformers_fixtures() {
        let tmp = tempfile::tempdir().unwrap();
        for (arch, name) in [
            (SynthArch::DeepseekV3, "deepseek_v3"),
            (SynthArch::Glm4Moe, "glm4_moe"),
            (SynthArch::GlmMoeDsa, "glm_moe_dsa"),
            (SynthArch::DeepseekV4, "deepseek_v4"),
            (SynthArch::Qwen3Next, "qwen3_next"),
            (SynthArch::Qwen35Moe, "qwen3_5_moe"),
            (SynthArch::KimiLinear, "kimi_linear"),
            (SynthArch::GptOss, "gpt_oss"),
        ] {
            let out = tmp.path().join(name);
            synthesize(&fixture_args(arch, out.clone()), false).unwrap();
            let want = header(&fixture(name));
            let got = header(&out);
            for (k, v) in &want {
                assert_eq!(got.get(k), Some(v), "{name}: {k}");
            }
            for k in got.keys() {
                assert!(want.contains_key(k), "{name}: unexpected {k}");
            }
            let (want, got) = (config(&fixture(name)), config(&out));
            for (k, v) in want.as_object().unwrap() {
                assert!(
                    got.get(k).is_some() || k == "transformers_version",
                    "{name}: config lacks {k}"
                );
                // Values that differ on purpose: the fixture's dtype/ids/init/rope positions,
                // and its num_nextn_predict_layers default (this checkpoint has no MTP block).
                let free = [
                    "transformers_version",
                    "initializer_range",
                    "max_position_embeddings",
                    "rope_parameters",
                    "eos_token_id",
                    "num_nextn_predict_layers",
                    "hc_sinkhorn_iters",
                    "model_max_length",
                ];
                if !free.contains(&k.as_str()) {
                    assert_eq!(&got[k], v, "{name}: config {k}");
                }
            }
            if !arch.delta_net() && ![SynthArch::KimiLinear, SynthArch::GptOss].contains(&arch) {
                assert_eq!(got["num_nextn_predict_layers"], 0, "{name}");
            }
        }
    }

    /// gpt-oss's two expert forms of one seed — the hub's MXFP4 blocks and transformers'
    /// `x·W` layout holding their values — load to the same model: identical logits, and the
    /// MXFP4 experts take 17 bytes per 32 values.
    #[test]
    fn synth_gpt_oss_mxfp4_and_xw_forms_compute_the_same_logits() {
        let tmp = tempfile::tempdir().unwrap();
        let logits = |mxfp4: bool| {
            let out = tmp.path().join(if mxfp4 { "mxfp4" } else { "xw" });
            let mut a = fixture_args(SynthArch::GptOss, out.clone());
            a.mxfp4 = mxfp4;
            synthesize(&a, false).unwrap();
            let m = colibri::model::load(&out).unwrap();
            let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 384).collect();
            let mut cache = m.new_cache(ids.len());
            let l = m
                .forward(&ids, &mut cache, colibri::model::Logits::All)
                .unwrap();
            (l, m.info().routed_expert_bytes)
        };
        let (xw, xw_bytes) = logits(false);
        let (fp4, fp4_bytes) = logits(true);
        assert!(xw.iter().all(|v| v.is_finite()) && xw.iter().any(|&v| v != 0.0));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&xw) == bits(&fp4), "the two forms differ");
        // 2 layers × 8 experts × 3 matrices of 64×32: f32 against 17/32 bytes per value.
        assert_eq!(xw_bytes, 2 * 8 * 3 * 64 * 32 * 4);
        assert_eq!(fp4_bytes, 2 * 8 * 3 * 64 * 32 / 32 * 17);
    }

    /// The tensors under `model.layers.{l}.` with the prefix stripped.
    fn layer(h: &BTreeMap<String, (String, Vec<usize>)>, l: usize) -> BTreeMap<String, Vec<usize>> {
        let p = format!("model.layers.{l}.");
        h.iter()
            .filter_map(|(k, (_, s))| Some((k.strip_prefix(&p)?.to_string(), s.clone())))
            .collect()
    }

    fn cat<'a>(parts: &[&[(&'a str, Vec<usize>)]]) -> Vec<(&'a str, Vec<usize>)> {
        parts.iter().flat_map(|p| p.iter().cloned()).collect()
    }

    /// Spec shapes (arch doc 2.7 / 2.11, 0.4) of an MoE layer of `tiny` with 2 shared experts.
    fn expected_moe(extra: &[(&str, Vec<usize>)]) -> BTreeMap<String, Vec<usize>> {
        let mut m: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (k, s) in extra {
            m.insert(k.to_string(), s.clone());
        }
        m.insert("input_layernorm.weight".into(), vec![64]);
        m.insert("post_attention_layernorm.weight".into(), vec![64]);
        m.insert("mlp.gate.weight".into(), vec![8, 64]);
        m.insert("mlp.gate.e_score_correction_bias".into(), vec![8]);
        for e in 0..8 {
            m.insert(format!("mlp.experts.{e}.gate_proj.weight"), vec![32, 64]);
            m.insert(format!("mlp.experts.{e}.up_proj.weight"), vec![32, 64]);
            m.insert(format!("mlp.experts.{e}.down_proj.weight"), vec![64, 32]);
        }
        m.insert("mlp.shared_experts.gate_proj.weight".into(), vec![64, 64]);
        m.insert("mlp.shared_experts.up_proj.weight".into(), vec![64, 64]);
        m.insert("mlp.shared_experts.down_proj.weight".into(), vec![64, 64]);
        m
    }

    #[test]
    fn synth_mtp_block_only_with_the_flag() {
        let mtp = [
            ("enorm.weight", vec![64]),
            ("hnorm.weight", vec![64]),
            ("eh_proj.weight", vec![64, 128]),
            ("shared_head.norm.weight", vec![64]),
            ("shared_head.head.weight", vec![384, 64]),
        ];
        let mla = [
            ("self_attn.q_a_proj.weight", vec![32, 64]),
            ("self_attn.q_a_layernorm.weight", vec![32]),
            ("self_attn.q_b_proj.weight", vec![96, 32]),
            ("self_attn.kv_a_proj_with_mqa.weight", vec![24, 64]),
            ("self_attn.kv_a_layernorm.weight", vec![16]),
            ("self_attn.kv_b_proj.weight", vec![128, 16]),
            ("self_attn.o_proj.weight", vec![64, 64]),
        ];
        let indexer = [
            ("self_attn.indexer.wq_b.weight", vec![8 * 16, 32]),
            ("self_attn.indexer.wk.weight", vec![16, 64]),
            ("self_attn.indexer.k_norm.weight", vec![16]),
            ("self_attn.indexer.k_norm.bias", vec![16]),
            ("self_attn.indexer.weights_proj.weight", vec![8, 64]),
        ];
        let gqa = [
            ("self_attn.q_proj.weight", vec![64, 64]),
            ("self_attn.q_proj.bias", vec![64]),
            ("self_attn.k_proj.weight", vec![32, 64]),
            ("self_attn.k_proj.bias", vec![32]),
            ("self_attn.v_proj.weight", vec![32, 64]),
            ("self_attn.v_proj.bias", vec![32]),
            ("self_attn.o_proj.weight", vec![64, 64]),
            ("self_attn.q_norm.weight", vec![16]),
            ("self_attn.k_norm.weight", vec![16]),
        ];
        let tmp = tempfile::tempdir().unwrap();
        for (arch, attn) in [
            (SynthArch::DeepseekV3, cat(&[&mtp, &mla])),
            (SynthArch::Glm4Moe, cat(&[&mtp, &gqa])),
            (SynthArch::GlmMoeDsa, cat(&[&mtp, &mla, &indexer])),
        ] {
            let out = tmp.path().join(format!("{arch:?}"));
            let mut a = fixture_args(arch, out.clone());
            a.ds.shared_experts = 2;
            a.ds.mtp = true;
            synthesize(&a, false).unwrap();
            let h = header(&out);
            assert_eq!(layer(&h, 3), expected_moe(&attn), "{arch:?}");
            assert!(layer(&h, 4).is_empty());
            let c = config(&out);
            assert_eq!(c["num_nextn_predict_layers"], 1);
            assert_eq!(c["num_hidden_layers"], 3);
            assert_eq!(c["n_shared_experts"], 2);
            // The last regular layer is unchanged by the flag (bar the shared width).
            let main = layer(&h, 2);
            assert_eq!(main["mlp.shared_experts.up_proj.weight"], vec![64, 64]);
            assert!(!main.contains_key("enorm.weight"));
        }
    }

    #[test]
    fn synth_indexer_on_full_layers_only() {
        let tmp = tempfile::tempdir().unwrap();
        for (freq, full) in [
            (1, vec!["full", "full", "full", "full", "full"]),
            (2, vec!["full", "full", "shared", "full", "shared"]),
            (3, vec!["full", "full", "shared", "shared", "full"]),
        ] {
            let out = tmp.path().join(format!("f{freq}"));
            let mut a = tiny(SynthArch::GlmMoeDsa, out.clone());
            a.layers = 5;
            a.ds.first_dense = 2;
            a.ds.index_topk_freq = freq;
            synthesize(&a, false).unwrap();
            let h = header(&out);
            let c = config(&out);
            assert_eq!(c["indexer_types"], json!(full));
            assert_eq!(c["index_topk_freq"], freq);
            assert_eq!(c["index_skip_topk_offset"], 2);
            assert_eq!(
                c["mlp_layer_types"],
                json!(["dense", "dense", "sparse", "sparse", "sparse"])
            );
            for (l, kind) in full.iter().enumerate() {
                let t = layer(&h, l);
                let n = t.keys().filter(|k| k.contains(".indexer.")).count();
                assert_eq!(
                    n,
                    if *kind == "full" { 5 } else { 0 },
                    "freq {freq} layer {l}"
                );
                assert_eq!(t.contains_key("mlp.gate_proj.weight"), l < 2);
                assert_eq!(t.contains_key("mlp.gate.weight"), l >= 2);
            }
        }
    }

    #[test]
    fn synth_correction_bias_is_small_positive_f32_and_seeded() {
        let tmp = tempfile::tempdir().unwrap();
        let mut files = Vec::new();
        for (name, seed) in [("a", 1), ("b", 1), ("c", 2)] {
            let out = tmp.path().join(name);
            let mut a = tiny(SynthArch::DeepseekV3, out.clone());
            a.dtype = SynthDType::Bf16;
            a.seed = seed;
            synthesize(&a, false).unwrap();
            let h = header(&out);
            assert_eq!(h["model.layers.1.mlp.gate.weight"].0, "BF16");
            let bias = f32_values(&out, "model.layers.1.mlp.gate.e_score_correction_bias");
            assert_eq!(bias.len(), 8);
            assert!(bias.iter().all(|b| (0.0..0.1).contains(b)), "{bias:?}");
            assert!(bias.iter().any(|b| *b != bias[0]));
            files.push(std::fs::read(out.join("model.safetensors")).unwrap());
        }
        assert_eq!(files[0], files[1]);
        assert_ne!(files[0], files[2]);
    }

    #[test]
    fn synth_cli_takes_the_glm_5_2_layer_shape() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: SynthArgs,
        }
        let cmd = "x --arch glm-moe-dsa --layers 4 --hidden 6144 --heads 64 --experts 32 \
                   --top-k 8 --moe-intermediate 2048 --q-lora-rank 2048 --kv-lora-rank 512 \
                   --qk-nope-dim 192 --qk-rope-dim 64 --v-head-dim 256 --first-dense 1 \
                   --index-topk 2048 --index-heads 32 --index-head-dim 128 --mtp --out /tmp/x";
        let a = <Cli as clap::Parser>::parse_from(cmd.split_whitespace()).a;
        assert_eq!(a.arch, SynthArch::GlmMoeDsa);
        assert!(a.ds.mtp && a.ds.first_dense == 1 && a.ds.index_heads == 32);
        // Plan only (the checkpoint is several GB): GLM-5.2's per-layer shapes (arch doc 2.11).
        let shapes: BTreeMap<String, Vec<usize>> = plan(&a, 64, 64)
            .into_iter()
            .map(|p| (p.spec.name, p.spec.shape))
            .collect();
        for (name, shape) in [
            ("model.layers.1.self_attn.q_a_proj.weight", vec![2048, 6144]),
            (
                "model.layers.1.self_attn.q_b_proj.weight",
                vec![64 * 256, 2048],
            ),
            (
                "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                vec![576, 6144],
            ),
            (
                "model.layers.1.self_attn.kv_b_proj.weight",
                vec![64 * 448, 512],
            ),
            (
                "model.layers.1.self_attn.o_proj.weight",
                vec![6144, 64 * 256],
            ),
            (
                "model.layers.1.self_attn.indexer.wq_b.weight",
                vec![4096, 2048],
            ),
            (
                "model.layers.1.self_attn.indexer.wk.weight",
                vec![128, 6144],
            ),
            (
                "model.layers.1.self_attn.indexer.weights_proj.weight",
                vec![32, 6144],
            ),
            ("model.layers.0.mlp.gate_proj.weight", vec![4 * 6144, 6144]),
            (
                "model.layers.3.mlp.experts.31.down_proj.weight",
                vec![6144, 2048],
            ),
            (
                "model.layers.3.mlp.shared_experts.up_proj.weight",
                vec![2048, 6144],
            ),
            ("model.layers.4.eh_proj.weight", vec![6144, 12288]),
            ("model.layers.4.mlp.gate.weight", vec![32, 6144]),
            (
                "model.layers.4.self_attn.indexer.wk.weight",
                vec![128, 6144],
            ),
        ] {
            assert_eq!(shapes.get(name), Some(&shape), "{name}");
        }
        assert!(!shapes.contains_key("model.layers.5.input_layernorm.weight"));
    }

    #[test]
    fn synth_rejects_bad_ds_shapes() {
        let tmp = tempfile::tempdir().unwrap();
        type Case = (SynthArch, fn(&mut SynthArgs), &'static str);
        let cases: [Case; 5] = [
            (SynthArch::DeepseekV3, |a| a.ds.n_group = 3, "--n-group"),
            (
                SynthArch::DeepseekV3,
                |a| a.kv_heads = Some(2),
                "--kv-heads",
            ),
            (
                SynthArch::DeepseekV3,
                |a| a.ds.first_dense = 4,
                "--first-dense",
            ),
            (
                SynthArch::GlmMoeDsa,
                |a| a.ds.index_head_dim = 4,
                "--index-head-dim",
            ),
            (
                SynthArch::GlmMoeDsa,
                |a| a.ds.q_lora_rank = 0,
                "--q-lora-rank",
            ),
        ];
        for (i, (arch, edit, msg)) in cases.into_iter().enumerate() {
            let out = tmp.path().join(format!("{i}"));
            let mut a = tiny(arch, out.clone());
            edit(&mut a);
            let e = synthesize(&a, false).unwrap_err().to_string();
            assert!(e.contains(msg), "{e}");
            assert!(!out.exists());
        }
    }
}
