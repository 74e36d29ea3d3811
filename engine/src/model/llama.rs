//! Llama (`model_type: llama`): the dense baseline. RMSNorm, half-split RoPE (default,
//! linear, llama3 or yarn scaling), grouped-query attention with optional biases, SwiGLU MLP.

use super::layers::{Mlp, QkNorm};
use super::registry::{boxed_load, Family, Gguf, GgufReads};
use super::transformer::{load_standard, Ffn, LayerParts, StandardConfig, Transformer};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::safetensors::Checkpoint;
use crate::Result;

/// Llama in the registry; GGUF `llama` files without experts (llama.cpp permutes their Q/K),
/// and `qwen2` files (llama with q/k/v biases).
pub const FAMILY: Family = Family::new(&["llama"], boxed_load!(load)).with_gguf(
    Gguf::new("llama")
        .reading(GgufReads::WithoutExperts)
        .also_reading(&["qwen2"])
        .permuted(),
);

/// Build a Llama model from its checkpoint.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, _opts: &LoadOptions) -> Result<Transformer> {
    let sc = StandardConfig::read(cfg, ckpt, 1e-6, 10000.0)?;
    let inter = cfg.dim("intermediate_size")?;
    let mlp_bias = cfg.bool_or("mlp_bias", false)?;
    let d = sc.hidden_size;
    load_standard(ckpt, cfg, &sc, None, |l| {
        Ok(LayerParts {
            attn: None,
            sinks: None,
            qk_norm: QkNorm::None,
            clip_qkv: None,
            window: None,
            ffn: Ffn::Dense(Mlp::load(
                ckpt,
                &format!("model.layers.{l}.mlp"),
                d,
                inter,
                mlp_bias,
            )?),
        })
    })
}
