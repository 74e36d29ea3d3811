//! DeepSeek-V3 / R1 (`model_type: deepseek_v3`) and the Kimi K2 / K2.5 text model
//! (`kimi_k25`, whose `text_config` is a DeepSeek-V3 config): multi-head latent attention
//! ([`super::mla`]) with interleaved RoPE and yarn's `mscale²` on the softmax scale; the first
//! `first_k_dense_replace` layers dense, the rest a DeepSeek MoE (sigmoid router with a
//! selection-only correction bias, group-limited top-k, `routed_scaling_factor`, plus ungated
//! shared experts). The MTP block that checkpoints carry at layer `num_hidden_layers` is not
//! part of the forward pass and is not loaded.
//!
//! [`load_mla_stack`] builds any of these MLA models (GLM-5's `glm_moe_dsa` adds its indexer
//! through it).

use std::sync::Arc;

use super::layers::{GluActivation, Linear, Mlp, MoeBlock, RmsNorm, Rope, Router};
use super::mla::{transpose_w_uk, Mla, MlaQuery, Sparse};
pub use super::registry::StackNames;
use super::registry::{boxed_load, Abilities, Experts, Family, Gguf, GgufReads};
use super::transformer::{
    standard_info, Block, Ffn, MtpHead, MtpInput, Residual, SelfAttention, StandardConfig, Streams,
    Transformer,
};
use super::LoadOptions;
use crate::format::config::{ModelConfig, RopeKind, MAX_DIM};
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::{Error, Result};

/// Where DeepSeek-style MoE experts are: the qwen2_moe layout, counted by `n_routed_experts`
/// (DeepSeek-V3, Kimi, GLM-4.5 and GLM-5).
pub const EXPERTS: Experts = Experts {
    count: "n_routed_experts",
    ..Experts::QWEN
};

/// DeepSeek-V3 / R1 and Kimi K2 (whose own `model_type` transformers remaps to deepseek_v3) in
/// the registry; GGUF `deepseek2`.
pub const FAMILY: Family = Family::new(&["deepseek_v3", "kimi_k2"], boxed_load!(load))
    .with_abilities(Abilities::LATENT_ATTENTION_AND_MTP)
    .with_experts(EXPERTS)
    .with_gguf(Gguf::new("deepseek2"));

/// Kimi K2.5's text model in the registry: a DeepSeek-V3 config in `text_config`, tensors
/// under `language_model.*`; written to GGUF as `deepseek2` (read back as DeepSeek-V3).
pub const KIMI_K25: Family = Family::new(&["kimi_k25"], boxed_load!(load_kimi_k25))
    .with_abilities(Abilities::LATENT_ATTENTION_AND_MTP)
    .with_normalize(kimi_k25_text_config)
    .with_names(StackNames {
        model: "language_model.model",
        lm_head: "language_model.lm_head",
    })
    .with_experts(EXPERTS)
    .with_gguf(Gguf::new("deepseek2").reading(GgufReads::Never));

/// Build a DeepSeek-V3 model.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let interleave = cfg.bool_or("rope_interleave", true)?;
    load_mla_stack(ckpt, cfg, opts, &StackNames::default(), interleave, |_| {
        Ok(Sparse::None)
    })
}

/// Build the text model of a Kimi K2.5 checkpoint (`language_model.*`; vision tower ignored).
pub fn load_kimi_k25(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    opts: &LoadOptions,
) -> Result<Transformer> {
    let text_cfg = kimi_k25_text_config(cfg)?;
    let interleave = text_cfg.bool_or("rope_interleave", true)?;
    let mut model = load_mla_stack(ckpt, &text_cfg, opts, &KIMI_K25.names, interleave, |_| {
        Ok(Sparse::None)
    })?;
    model.info.model_type = cfg.model_type()?;
    Ok(model)
}

/// The DeepSeek-V3 configuration of a Kimi K2.5 checkpoint: its `text_config`, with what
/// lives at the top level of a Kimi config: `tie_word_embeddings` (default true there) and the
/// `eos_token_id` / `bos_token_id` the text config leaves out. The loader and the GGUF
/// converter read this (through [`KIMI_K25`]'s `normalize`).
pub fn kimi_k25_text_config(cfg: &ModelConfig) -> Result<ModelConfig> {
    super::unwrap_text_config(cfg, true, "its DeepSeek-V3 text model")
}

/// Refuse a `scoring_func` other than `sigmoid`, the only one the DeepSeek MoE routes with.
pub fn check_sigmoid_scoring(cfg: &ModelConfig) -> Result<()> {
    match cfg.get("scoring_func").and_then(|v| v.as_str()) {
        Some(f) if f != "sigmoid" => Err(Error::config(
            cfg.path(),
            "scoring_func",
            format!("`{f}` is not supported (this family routes with `sigmoid`)"),
        )),
        _ => Ok(()),
    }
}

/// The DeepSeek MoE settings of a config (shared by deepseek_v3, kimi, glm4_moe and
/// glm_moe_dsa).
pub struct DeepseekMoe {
    pub experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    pub shared: usize,
    pub router: Router,
    /// Which layers are MoE (the rest are dense).
    pub is_moe: Vec<bool>,
    /// Where the MoE block, its experts and (on dense layers) the MLP are.
    pub names: Experts,
    /// The clamp of every SwiGLU (dense MLP, shared and routed experts), if any.
    pub swiglu_limit: Option<f32>,
}

impl DeepseekMoe {
    /// Read the MoE keys: `mlp_layer_types` ("dense"/"sparse") if present, else the first
    /// `first_k_dense_replace` layers dense.
    pub fn read(cfg: &ModelConfig, ckpt: &Checkpoint, layers: usize) -> Result<DeepseekMoe> {
        DeepseekMoe::read_named(cfg, ckpt, layers, EXPERTS)
    }

    /// [`DeepseekMoe::read`] for a family whose experts are named and counted as `names`
    /// says (Kimi Linear's `block_sparse_moe`).
    pub fn read_named(
        cfg: &ModelConfig,
        ckpt: &Checkpoint,
        layers: usize,
        names: Experts,
    ) -> Result<DeepseekMoe> {
        let experts = super::expert_count(cfg, ckpt, names.count)?;
        let n_group = cfg.usize_or("n_group", 1)?.max(1);
        let topk_group = cfg.usize_or("topk_group", n_group)?;
        if experts % n_group != 0 || experts / n_group < 2 || topk_group > n_group {
            return Err(Error::config(
                cfg.path(),
                "n_group",
                format!(
                    "n_group = {n_group} and topk_group = {topk_group} do not fit \
                     {experts} routed experts (groups must divide them, two experts at least each)"
                ),
            ));
        }
        check_sigmoid_scoring(cfg)?;
        let is_moe = match cfg.get("mlp_layer_types").and_then(|v| v.as_array()) {
            Some(list) => {
                if list.len() != layers {
                    return Err(Error::config(
                        cfg.path(),
                        "mlp_layer_types",
                        format!("has {} entries for {layers} layers", list.len()),
                    ));
                }
                list.iter()
                    .map(|v| match v.as_str() {
                        Some("sparse") => Ok(true),
                        Some("dense") => Ok(false),
                        _ => Err(Error::config(
                            cfg.path(),
                            "mlp_layer_types",
                            format!("unknown entry {v} (expected \"dense\" or \"sparse\")"),
                        )),
                    })
                    .collect::<Result<Vec<bool>>>()?
            }
            None => {
                let dense = cfg.usize_or("first_k_dense_replace", 0)?;
                (0..layers).map(|l| l >= dense).collect()
            }
        };
        Ok(DeepseekMoe {
            experts,
            top_k: super::experts_per_token(cfg, experts)?,
            intermediate: cfg.dim("moe_intermediate_size")?,
            shared: cfg.usize_in_or(
                "n_shared_experts",
                0..=MAX_DIM,
                "shared experts are at most 2^24",
                0,
            )?,
            router: Router::SigmoidGrouped {
                n_group,
                topk_group,
                renormalize: cfg.bool_or("norm_topk_prob", true)?,
                scaling: cfg.f64_or("routed_scaling_factor", 1.0)? as f32,
            },
            is_moe,
            names,
            swiglu_limit: None,
        })
    }

    /// Layer `l`'s feed-forward part under `{p}.{block}` (`block` from [`DeepseekMoe::names`],
    /// `mlp` for most): a dense MLP (`*_proj`, `intermediate_size`) or the MoE block (`gate`,
    /// its correction bias and the shared experts).
    pub fn load_ffn(
        &self,
        ckpt: &Checkpoint,
        cfg: &ModelConfig,
        p: &str,
        l: usize,
        d: usize,
        store: &Arc<dyn ExpertStore>,
    ) -> Result<Ffn> {
        let block = format!("{p}.{}", self.names.block);
        let mlp = |name: &str, inter: usize| -> Result<Mlp> {
            let mut mlp = Mlp::load(ckpt, name, d, inter, false)?;
            mlp.limit = self.swiglu_limit;
            Ok(mlp)
        };
        if !self.is_moe[l] {
            // A dense layer's MLP may be saved as `{p}.mlp` whatever the MoE block is called.
            let dense = match ckpt.contains(&format!("{block}.gate_proj.weight")) {
                true => block,
                false => format!("{p}.mlp"),
            };
            return Ok(Ffn::Dense(mlp(&dense, cfg.dim("intermediate_size")?)?));
        }
        let bias_name = format!("{block}.gate.e_score_correction_bias");
        let correction_bias = if ckpt.contains(&bias_name) {
            Some(ckpt.vector_f32(&bias_name, self.experts)?)
        } else {
            None
        };
        let shared = if self.shared > 0 {
            Some(mlp(
                &format!("{block}.shared_experts"),
                self.intermediate * self.shared,
            )?)
        } else {
            None
        };
        Ok(Ffn::Moe(MoeBlock {
            layer: l,
            gate: Linear::load(ckpt, &format!("{block}.gate"), self.experts, d, false)?,
            router: self.router,
            top_k: self.top_k,
            num_experts: self.experts,
            intermediate: self.intermediate,
            store: store.clone(),
            correction_bias,
            shared,
            activation: GluActivation::SwiGlu {
                limit: self.swiglu_limit,
            },
            expert_biases: None,
            shared_gate: None,
        }))
    }
}

/// The multi-head latent attention geometry of a config.
#[derive(Debug, Clone, Copy)]
pub struct MlaShape {
    /// `num_attention_heads`.
    pub heads: usize,
    /// `q_lora_rank`; `None`: a full-rank `q_proj`.
    pub q_lora: Option<usize>,
    /// `kv_lora_rank`.
    pub kv_lora: usize,
    /// `qk_nope_head_dim`.
    pub nope: usize,
    /// `qk_rope_head_dim` (0 for NoPE models without the rope part).
    pub rope_dim: usize,
    /// `v_head_dim`.
    pub v_dim: usize,
}

impl MlaShape {
    /// Read `num_attention_heads`, `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
    /// `qk_rope_head_dim` (even: rope rotates pairs) and `v_head_dim`.
    pub fn read(cfg: &ModelConfig) -> Result<MlaShape> {
        let rope_dim = cfg.usize_in("qk_rope_head_dim", 0..=MAX_DIM, "at most 2^24")?;
        if rope_dim % 2 != 0 {
            return Err(Error::config(
                cfg.path(),
                "qk_rope_head_dim",
                format!("is {rope_dim}; MLA rotates pairs, so it must be even"),
            ));
        }
        Ok(MlaShape {
            heads: cfg.dim("num_attention_heads")?,
            q_lora: cfg.opt_dim("q_lora_rank")?,
            kv_lora: cfg.dim("kv_lora_rank")?,
            nope: cfg.dim("qk_nope_head_dim")?,
            rope_dim,
            v_dim: cfg.dim("v_head_dim")?,
        })
    }

    /// Layer `p`'s attention (`{p}.self_attn.*`: `q_a_proj`/`q_a_layernorm`/`q_b_proj` or
    /// `q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`) over hidden
    /// rows of `d`, with rope `rope` on the rope part (a no-op rope for NoPE), softmax scale
    /// `scale`, latent norms of eps `latent_eps` and the sparse part `sparse`.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        &self,
        ckpt: &Checkpoint,
        p: &str,
        d: usize,
        rope: Rope,
        scale: f32,
        latent_eps: f64,
        sparse: Sparse,
        opts: &LoadOptions,
    ) -> Result<Mla> {
        let MlaShape {
            heads,
            q_lora,
            kv_lora,
            nope,
            rope_dim,
            v_dim,
        } = *self;
        let a = format!("{p}.self_attn");
        let query = match q_lora {
            Some(r) => MlaQuery::LowRank {
                a: Linear::load(ckpt, &format!("{a}.q_a_proj"), r, d, false)?,
                norm: RmsNorm::load(ckpt, &format!("{a}.q_a_layernorm.weight"), r, latent_eps)?,
                b: Linear::load(
                    ckpt,
                    &format!("{a}.q_b_proj"),
                    heads * (nope + rope_dim),
                    r,
                    false,
                )?,
            },
            None => MlaQuery::Full(Linear::load(
                ckpt,
                &format!("{a}.q_proj"),
                heads * (nope + rope_dim),
                d,
                false,
            )?),
        };
        if !matches!(sparse, Sparse::None) && q_lora.is_none() {
            return Err(Error::Invalid(format!(
                "{a}: sparse attention's indexer reads the query latent, so q_lora_rank must be set"
            )));
        }
        let kv_b = Linear::load(
            ckpt,
            &format!("{a}.kv_b_proj"),
            heads * (nope + v_dim),
            kv_lora,
            false,
        )?;
        let w_uk_t = transpose_w_uk(&kv_b.weight, heads, nope, v_dim, kv_lora)?;
        Ok(Mla {
            query,
            kv_a: Linear::load(
                ckpt,
                &format!("{a}.kv_a_proj_with_mqa"),
                kv_lora + rope_dim,
                d,
                false,
            )?,
            kv_norm: RmsNorm::load(
                ckpt,
                &format!("{a}.kv_a_layernorm.weight"),
                kv_lora,
                latent_eps,
            )?,
            kv_b,
            o: Linear::load(ckpt, &format!("{a}.o_proj"), d, heads * v_dim, false)?,
            heads,
            nope_dim: nope,
            rope_dim,
            v_dim,
            kv_lora,
            rope,
            scale,
            form: opts.mla_form(),
            sparse,
            kv_dtype: opts.kv_dtype(),
            w_uk_t,
        })
    }
}

/// Build an MLA decoder: embeddings, `num_hidden_layers` blocks of MLA attention (with the
/// sparse part `sparse(l)` gives) and DeepSeek FFNs, final norm, LM head.
pub fn load_mla_stack(
    ckpt: &Checkpoint,
    cfg: &ModelConfig,
    opts: &LoadOptions,
    names: &StackNames,
    interleave: bool,
    mut sparse: impl FnMut(usize) -> Result<Sparse>,
) -> Result<Transformer> {
    let d = cfg.dim("hidden_size")?;
    let layers = super::layer_count(cfg, ckpt)?;
    let vocab = cfg.dim("vocab_size")?;
    let shape = MlaShape::read(cfg)?;
    let (nope, rope_dim) = (shape.nope, shape.rope_dim);
    if rope_dim == 0 {
        // Only the NoPE families (Kimi Linear, GLM-5-next) have no rotated part.
        return Err(Error::config(
            cfg.path(),
            "qk_rope_head_dim",
            "is 0, but this family rotates a rope part of every query and key head (at least 2)",
        ));
    }
    let eps = cfg.f64_or("rms_norm_eps", 1e-6)?;
    let mut rope_params = cfg.rope(10000.0)?;
    rope_params.interleaved = interleave;
    rope_params.partial_rotary_factor = 1.0;
    // yarn: the softmax scale also takes mscale(factor, mscale_all_dim)².
    let mut scale = ((nope + rope_dim) as f64).powf(-0.5);
    if let RopeKind::Yarn {
        factor,
        mscale_all_dim: Some(m),
        ..
    } = rope_params.kind
    {
        if m != 0.0 && factor > 1.0 {
            let ms = 0.1 * m * factor.ln() + 1.0;
            scale *= ms * ms;
        }
    }
    let mut moe = DeepseekMoe::read(cfg, ckpt, layers)?;
    let m = names.model;
    let mtp_name = format!("{m}.layers.{layers}.eh_proj.weight");
    if opts.mtp() {
        if !ckpt.contains(&mtp_name) {
            return Err(Error::config(
                cfg.path(),
                "num_nextn_predict_layers",
                format!(
                    "drafting with MTP needs the checkpoint's MTP head, but it has no `{mtp_name}` \
                     (run without --draft mtp)"
                ),
            ));
        }
        // The MTP block is a MoE layer; its experts join the store as layer `layers`.
        moe.is_moe.push(true);
    }
    let expert_names = EXPERTS.table(ckpt, cfg, m, &moe.is_moe, moe.experts)?;
    // What is never loaded: tensors outside the text model (Kimi's vision tower) and an MTP
    // block left out.
    let mtp_prefix = format!("{m}.layers.{layers}.");
    let (mut unused_bytes, mut unused_params) = (0, 0);
    // (tensors, bytes) left out: outside the text model, and of the MTP block.
    let (mut outside_text, mut mtp_left) = ((0, 0), (0, 0));
    for (name, t) in ckpt.tensors() {
        let outside = !name.starts_with(&format!("{m}.")) && !name.starts_with(names.lm_head);
        let mtp_block = !opts.mtp() && name.starts_with(&mtp_prefix);
        if outside || mtp_block {
            unused_bytes += t.len;
            unused_params += t.shape.iter().product::<usize>();
            let count = if outside {
                &mut outside_text
            } else {
                &mut mtp_left
            };
            *count = (count.0 + 1, count.1 + t.len);
        }
    }
    let mut skipped = Vec::new();
    if outside_text.0 > 0 {
        skipped.push(format!(
            "{} tensors outside the text model (a vision tower; {} bytes)",
            outside_text.0, outside_text.1
        ));
    }
    if mtp_left.0 > 0 {
        skipped.push(format!(
            "the multi-token-prediction head (layer {layers}: {} tensors, {} bytes; --draft mtp loads it)",
            mtp_left.0, mtp_left.1
        ));
    }
    let store: Arc<dyn ExpertStore> = store::open(
        ckpt,
        &expert_names,
        d,
        moe.intermediate,
        unused_bytes,
        &opts.placement,
    )?;
    let tie = cfg.bool_or("tie_word_embeddings", false)?;
    let embed = ckpt.weight(&format!("{m}.embed_tokens.weight"), &[vocab, d])?;
    let head_name = format!("{}.weight", names.lm_head);
    let lm_head = if tie && !ckpt.contains(&head_name) {
        Linear::from_tensor(embed.clone())
    } else {
        Linear::load(ckpt, names.lm_head, vocab, d, false)?
    };
    let mut block = |l: usize| -> Result<Block> {
        let p = format!("{m}.layers.{l}");
        let rope = Rope::new(&rope_params, rope_dim);
        // The latent norms use eps 1e-6 whatever rms_norm_eps says.
        let attn = shape.load(ckpt, &p, d, rope, scale as f32, 1e-6, sparse(l)?, opts)?;
        Ok(Block {
            attn_norm: RmsNorm::load(ckpt, &format!("{p}.input_layernorm.weight"), d, eps)?,
            attn: SelfAttention::Mla(attn),
            ffn_norm: RmsNorm::load(
                ckpt,
                &format!("{p}.post_attention_layernorm.weight"),
                d,
                eps,
            )?,
            ffn: moe.load_ffn(ckpt, cfg, &p, l, d, &store)?,
            residual: Residual::Plain,
            post_conv: None,
        })
    };
    let mut blocks = Vec::with_capacity(layers);
    for l in 0..layers {
        blocks.push(block(l)?);
    }
    let mtp = if opts.mtp() {
        let p = format!("{m}.layers.{layers}");
        let head_name = format!("{p}.shared_head.head");
        Some(MtpHead {
            enorm: RmsNorm::load(ckpt, &format!("{p}.enorm.weight"), d, eps)?,
            hnorm: RmsNorm::load(ckpt, &format!("{p}.hnorm.weight"), d, eps)?,
            input: MtpInput::Joined(Linear::load(
                ckpt,
                &format!("{p}.eh_proj"),
                d,
                2 * d,
                false,
            )?),
            block: block(layers)?,
            streams: Streams::One,
            norm: RmsNorm::load(ckpt, &format!("{p}.shared_head.norm.weight"), d, eps)?,
            head: if ckpt.contains(&format!("{head_name}.weight")) {
                Linear::load(ckpt, &head_name, vocab, d, false)?
            } else {
                Linear::from_tensor(lm_head.weight.clone())
            },
        })
    } else {
        None
    };
    let norm = RmsNorm::load(ckpt, &format!("{m}.norm.weight"), d, eps)?;
    let sc = StandardConfig {
        vocab_size: vocab,
        hidden_size: d,
        layers,
        heads: shape.heads,
        kv_heads: shape.heads,
        head_dim: nope + rope_dim,
        rms_norm_eps: eps,
        rope: rope_params,
        attention_bias: false,
        tie_word_embeddings: tie,
        max_position_embeddings: cfg.usize_or("max_position_embeddings", 4096)?,
        kv_f16: false,
        prefix: m.to_string(),
        zero_centred_norms: false,
        output_gate: false,
    };
    let mut info = standard_info(ckpt, cfg, &sc, &blocks, Some(store.as_ref()))?;
    // What is never loaded is neither resident nor part of the model that runs.
    info.dense_bytes -= unused_bytes;
    info.total_params -= unused_params;
    info.active_params -= unused_params;
    info.unused_bytes = unused_bytes;
    info.skipped = skipped;
    Ok(Transformer {
        embed,
        blocks,
        norm,
        lm_head,
        info,
        store: Some(store),
        mtp,
        streams: Streams::One,
        embed_norm: None,
        logits: Default::default(),
    })
}
