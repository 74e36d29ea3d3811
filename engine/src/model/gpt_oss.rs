//! gpt-oss (`model_type: gpt_oss`; arch doc 2.15): the standard stack with biased q/k/v/o,
//! one learned attention-sink logit per head, sliding-window and full layers as
//! `layer_types` says (even layers sliding by default), half-split RoPE over the whole head
//! with yarn (cos/sin scaled by its attention factor), and a routed MoE on every layer: the
//! router is a biased linear whose top-k logits are softmaxed among themselves; each expert
//! is gpt-oss's clamped GLU, `(clamp(u, ±ℓ) + 1) · g·sigmoid(α·g)` with `g = min(gate, ℓ)`,
//! with biases on its gate, up and down outputs.
//!
//! Experts are stored fused, one tensor per layer: transformers writes
//! `mlp.experts.gate_up_proj [E, D, 2I]` in the `x·W` layout with gate and up columns
//! interleaved and `down_proj [E, I, D]`, the hub ships MXFP4 `…_blocks [E, R, C/32, 16]` +
//! `…_scales [E, R, C/32]` in the row layout (gate and up rows interleaved). Both are split
//! into per-expert matrices when the checkpoint opens ([`crate::format::fused`]); MXFP4 stays
//! MXFP4 (repacked into ggml's blocks exactly, computed by the MXFP4 kernels, never
//! re-quantized). The expert biases (`gate_up_proj_bias [E, 2I]`, interleaved likewise, and
//! `down_proj_bias [E, D]`) stay resident.

use std::sync::Arc;

use super::layers::{ExpertBiases, GluActivation, Linear, MoeBlock, QkNorm, Router};
use super::registry::{boxed_load, Experts, Family};
use super::transformer::{load_standard, Ffn, LayerParts, StandardConfig, Transformer};
use super::LoadOptions;
use crate::format::config::ModelConfig;
use crate::format::fused::{FusedExperts, FusedLayout};
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertStore};
use crate::{Error, Result};

/// Where gpt-oss's routed experts are once split: `mlp.experts.{e}.{gate,up,down}_proj`,
/// counted by `num_local_experts`.
pub const EXPERTS: Experts = Experts {
    count: "num_local_experts",
    block: "mlp",
    matrices: ["gate_proj", "up_proj", "down_proj"],
};

/// gpt-oss's fused expert tensors: transformers' `x·W` float form and the hub's MXFP4 form.
pub const FUSED: &[FusedExperts] = &[
    FusedExperts {
        tensor: "experts.gate_up_proj",
        into: "experts",
        layout: FusedLayout::GateUpInterleavedColumns,
    },
    FusedExperts {
        tensor: "experts.down_proj",
        into: "experts",
        layout: FusedLayout::MatrixColumns("down_proj"),
    },
    FusedExperts {
        tensor: "experts.gate_up_proj_blocks",
        into: "experts",
        layout: FusedLayout::GateUpInterleaved,
    },
    FusedExperts {
        tensor: "experts.down_proj_blocks",
        into: "experts",
        layout: FusedLayout::Matrix("down_proj"),
    },
];

/// gpt-oss in the registry.
pub const FAMILY: Family = Family::new(&["gpt_oss"], boxed_load!(load))
    .with_experts(EXPERTS)
    .with_fused_experts(FUSED);

/// Build a gpt-oss model from its checkpoint.
pub fn load(ckpt: &Checkpoint, cfg: &ModelConfig, opts: &LoadOptions) -> Result<Transformer> {
    let sc = StandardConfig::read(cfg, ckpt, 1e-5, 150_000.0)?;
    let experts = super::expert_count(cfg, ckpt, EXPERTS.count)?;
    let top_k = super::experts_per_token(cfg, experts)?;
    let inter = cfg.dim("intermediate_size")?;
    let (d, layers) = (sc.hidden_size, sc.layers);
    // transformers' default: even layers slide, odd layers see everything.
    let sliding = match cfg.layer_kinds(
        "layer_types",
        layers,
        &["full_attention", "sliding_attention"],
    )? {
        Some(kinds) => kinds.into_iter().map(|k| k == 1).collect(),
        None => (0..layers).map(|l| l % 2 == 0).collect::<Vec<_>>(),
    };
    let window = if sliding.contains(&true) {
        // Tokens a sliding layer sees, bounded like every dimension (2^24).
        Some(cfg.dim("sliding_window")?)
    } else {
        None
    };
    let limit = cfg.f64_or("swiglu_limit", 7.0)? as f32;
    let alpha = cfg.f64_or("swiglu_alpha", 1.702)? as f32;
    for (key, v) in [("swiglu_limit", limit), ("swiglu_alpha", alpha)] {
        if !(v.is_finite() && v > 0.0) {
            return Err(Error::config(
                cfg.path(),
                key,
                format!("is {v}; it must be a positive number"),
            ));
        }
    }
    let all = vec![true; layers];
    let names = EXPERTS.table(ckpt, cfg, "model", &all, experts)?;
    let store: Arc<dyn ExpertStore> = store::open(ckpt, &names, d, inter, 0, &opts.placement)?;
    load_standard(ckpt, cfg, &sc, Some(store.clone()), |l| {
        let p = format!("model.layers.{l}");
        let router = Linear::load(ckpt, &format!("{p}.mlp.router"), experts, d, true)?;
        let moe = MoeBlock {
            activation: GluActivation::ClampedGlu { alpha, limit },
            expert_biases: Some(expert_biases(ckpt, &p, experts, inter, d)?),
            ..MoeBlock::routed(
                l,
                router,
                Router::TopKSoftmax,
                top_k,
                experts,
                inter,
                store.clone(),
            )
        };
        Ok(LayerParts {
            attn: None,
            sinks: Some(ckpt.vector_f32(&format!("{p}.self_attn.sinks"), sc.heads)?),
            qk_norm: QkNorm::None,
            clip_qkv: None,
            window: if sliding[l] { window } else { None },
            ffn: Ffn::Moe(moe),
        })
    })
}

/// Layer `p`'s expert biases: `gate_up_proj_bias [E, 2I]` (gate and up interleaved, as the
/// matrices' columns are) split into gate and up, and `down_proj_bias [E, D]`.
fn expert_biases(
    ckpt: &Checkpoint,
    p: &str,
    experts: usize,
    inter: usize,
    d: usize,
) -> Result<ExpertBiases> {
    let b = format!("{p}.mlp.experts");
    let gate_up = ckpt
        .weight(&format!("{b}.gate_up_proj_bias"), &[experts, 2 * inter])?
        .to_f32_vec()?;
    let down = ckpt
        .weight(&format!("{b}.down_proj_bias"), &[experts, d])?
        .to_f32_vec()?;
    Ok(ExpertBiases {
        gate: gate_up.iter().step_by(2).copied().collect(),
        up: gate_up.iter().skip(1).step_by(2).copied().collect(),
        down,
    })
}
