//! The family registry: what every part of colibri needs to know about an architecture, in one
//! [`Family`] descriptor defined next to the family's code (`model/<family>.rs`, `FAMILY`), and
//! [`FAMILIES`], the one list of them.
//!
//! The loader ([`super::load_with`]: `SUPPORTED` model types, which loader, which options a
//! family can honour), the GGUF reader ([`super::gguf`]: llama.cpp's architecture names, expert
//! and router tensor names), the converter (`crate::convert`: the architecture a family is
//! written as, whether Q/K are permuted, where its experts are, its config normalization) and
//! `colibri-synth` (model types, expert and head names) read these descriptors; none keeps a
//! table of its own. A new family is one file with its `FAMILY` plus one entry in [`FAMILIES`].

use std::borrow::Cow;

use super::{CausalLm, LoadOptions};
use crate::format::config::ModelConfig;
use crate::format::fused::FusedExperts;
use crate::format::safetensors::Checkpoint;
use crate::store::{self, ExpertNames};
use crate::{Error, Result};

/// Every family this build runs, in the order messages list them.
pub const FAMILIES: &[&Family] = &[
    &super::llama::FAMILY,
    &super::mixtral::FAMILY,
    &super::olmoe::FAMILY,
    &super::qwen3_moe::FAMILY,
    &super::deepseek_v3::FAMILY,
    &super::deepseek_v3::KIMI_K25,
    &super::glm4_moe::FAMILY,
    &super::glm_moe_dsa::FAMILY,
    &super::deepseek_v4::FAMILY,
    &super::minimax_m2::FAMILY,
    &super::gpt_oss::FAMILY,
    &super::qwen3_next::QWEN3_NEXT,
    &super::qwen3_next::QWEN3_5_MOE,
    &super::kimi_linear::FAMILY,
    &super::glm5_next::FAMILY,
    &super::inkling::FAMILY,
    &super::inkling2::FAMILY,
];

/// A [`LoadFn`] from a family's `load` that returns its own model type.
macro_rules! boxed_load {
    ($load:path) => {
        |ckpt, cfg, opts| Ok(Box::new($load(ckpt, cfg, opts)?))
    };
}
pub(crate) use boxed_load;

/// Build a family's model from an opened checkpoint and its `config.json`.
pub type LoadFn = fn(&Checkpoint, &ModelConfig, &LoadOptions) -> Result<Box<dyn CausalLm>>;

/// One architecture: how it is recognised, loaded, named on the Hub and in GGUF.
pub struct Family {
    /// The `config.json` `model_type`s it runs; the first is the one it writes.
    pub model_types: &'static [&'static str],
    /// Build the model.
    pub load: LoadFn,
    /// What it can do beyond the plain forward pass.
    pub abilities: Abilities,
    /// The configuration in the form its loader (and the converter) reads, when that is not
    /// `config.json` as it is: Kimi K2.5's `text_config` unwrapped, DeepSeek-V4's legacy keys
    /// folded into transformers' modern ones.
    pub normalize: Option<fn(&ModelConfig) -> Result<ModelConfig>>,
    /// Where the decoder stack's tensors are.
    pub names: StackNames,
    /// Where its routed experts are; `None`: a dense family.
    pub experts: Option<Experts>,
    /// Expert tensors it may store fused, every expert in one tensor: split into per-expert
    /// matrices before it loads ([`Checkpoint::split_fused`]).
    pub fused_experts: &'static [FusedExperts],
    /// How llama.cpp calls it; `None`: GGUF has no layout for it.
    pub gguf: Option<Gguf>,
}

/// What a family can do beyond the plain forward pass, so an option it cannot honour is
/// refused before any weight is read.
#[derive(Debug, Clone, Copy, Default)]
pub struct Abilities {
    /// Multi-head latent attention (`mla_form` and `kv_dtype` apply).
    pub latent_attention: bool,
    /// A multi-token-prediction drafter, when the checkpoint carries the head.
    pub mtp: bool,
}

impl Abilities {
    /// The plain forward pass only.
    pub const NONE: Abilities = Abilities {
        latent_attention: false,
        mtp: false,
    };
    /// Latent attention and an MTP drafter: the DeepSeek-V3 stack ([`super::deepseek_v3`]).
    pub const LATENT_ATTENTION_AND_MTP: Abilities = Abilities {
        latent_attention: true,
        mtp: true,
    };
}

/// Where a family keeps the tensors of its decoder stack (Hugging Face names).
#[derive(Debug, Clone, Copy)]
pub struct StackNames {
    /// Prefix of `embed_tokens`, `layers.{L}` and `norm` (`model`, or Kimi's
    /// `language_model.model`).
    pub model: &'static str,
    /// Name of the LM head without `.weight`.
    pub lm_head: &'static str,
}

impl StackNames {
    /// `model.*` and `lm_head`, as most families save them.
    pub const STANDARD: StackNames = StackNames {
        model: "model",
        lm_head: "lm_head",
    };
}

impl Default for StackNames {
    fn default() -> StackNames {
        StackNames::STANDARD
    }
}

/// Where a family's routed experts and routers are (Hugging Face names): layer `L`'s MoE block
/// is `{model}.layers.{L}.{block}`, its router `{block}.gate`, expert `e`'s matrices
/// `{block}.experts.{e}.{gate,up,down}.weight`.
#[derive(Debug, Clone, Copy)]
pub struct Experts {
    /// The `config.json` field with the routed-expert count.
    pub count: &'static str,
    /// The MoE block under `{model}.layers.{L}`: `mlp`, `block_sparse_moe`, `ffn`.
    pub block: &'static str,
    /// An expert's gate, up and down matrices.
    pub matrices: [&'static str; 3],
}

impl Experts {
    /// The qwen2_moe layout: `mlp.experts.{e}.{gate,up,down}_proj`, counted by `num_experts`.
    pub const QWEN: Experts = Experts {
        count: "num_experts",
        block: "mlp",
        matrices: ["gate_proj", "up_proj", "down_proj"],
    };

    /// The MoE block of layer `l` under stack prefix `model`.
    pub fn block(&self, model: &str, l: usize) -> String {
        format!("{model}.layers.{l}.{}", self.block)
    }

    /// The router of layer `l`, without `.weight`.
    pub fn router(&self, model: &str, l: usize) -> String {
        format!("{}.gate", self.block(model, l))
    }

    /// The name of matrix `i` (0 gate, 1 up, 2 down) of expert `e` of layer `l`.
    pub fn matrix(&self, model: &str, l: usize, e: usize, i: usize) -> String {
        format!(
            "{}.experts.{e}.{}.weight",
            self.block(model, l),
            self.matrices[i]
        )
    }

    /// The tensor names of expert `e` of layer `l`.
    pub fn names(&self, model: &str, l: usize, e: usize) -> ExpertNames {
        ExpertNames {
            gate: self.matrix(model, l, e, 0),
            up: self.matrix(model, l, e, 1),
            down: self.matrix(model, l, e, 2),
        }
    }

    /// Every expert's names for the layers whose `moe` entry is set, `experts` being the value
    /// of the config's [`Experts::count`] field, checked by [`store::expert_table`].
    pub fn table(
        &self,
        ckpt: &Checkpoint,
        cfg: &ModelConfig,
        model: &str,
        moe: &[bool],
        experts: usize,
    ) -> Result<Vec<Vec<ExpertNames>>> {
        store::expert_table(ckpt, cfg, self.count, moe, experts, |l, e| {
            self.names(model, l, e)
        })
    }
}

/// Which files of a GGUF architecture become a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufReads {
    /// Every file of the architecture.
    All,
    /// Files with routed experts (llama.cpp writes Mixtral as `llama`).
    WithExperts,
    /// Files without routed experts.
    WithoutExperts,
    /// None: the family is written as this architecture, and read back as another family
    /// (Kimi K2.5's text model is a `deepseek2` file, read as DeepSeek-V3).
    Never,
}

/// How llama.cpp calls a family.
#[derive(Debug, Clone, Copy)]
pub struct Gguf {
    /// `general.architecture` it is written as (and read from, as [`Gguf::reads`] says).
    pub arch: &'static str,
    /// Which files of `arch` become this family.
    pub reads: GgufReads,
    /// Other architectures read as this family, every file of them (`qwen2`: llama with q/k/v
    /// biases).
    pub also_reads: &'static [&'static str],
    /// llama.cpp's converter permutes Q and K rows for its adjacent-pair RoPE.
    pub permute_qk: bool,
}

impl Gguf {
    /// Architecture `arch`, every file of it read as the family, Q/K as stored.
    pub const fn new(arch: &'static str) -> Gguf {
        Gguf {
            arch,
            reads: GgufReads::All,
            also_reads: &[],
            permute_qk: false,
        }
    }

    /// Only these files of the architecture are the family.
    pub const fn reading(self, reads: GgufReads) -> Gguf {
        Gguf { reads, ..self }
    }

    /// Also every file of these architectures.
    pub const fn also_reading(self, also_reads: &'static [&'static str]) -> Gguf {
        Gguf { also_reads, ..self }
    }

    /// Q and K rows permuted for llama.cpp's adjacent-pair RoPE.
    pub const fn permuted(self) -> Gguf {
        Gguf {
            permute_qk: true,
            ..self
        }
    }
}

impl Family {
    /// A dense family on the standard stack names (`model.*`, `lm_head`) with no abilities,
    /// normalization or GGUF layout; the `with_*` methods add what it has.
    pub const fn new(model_types: &'static [&'static str], load: LoadFn) -> Family {
        Family {
            model_types,
            load,
            abilities: Abilities::NONE,
            normalize: None,
            names: StackNames::STANDARD,
            experts: None,
            fused_experts: &[],
            gguf: None,
        }
    }

    /// With these fused expert tensors split into per-expert matrices before loading.
    pub const fn with_fused_experts(self, fused_experts: &'static [FusedExperts]) -> Family {
        Family {
            fused_experts,
            ..self
        }
    }

    /// With these abilities.
    pub const fn with_abilities(self, abilities: Abilities) -> Family {
        Family { abilities, ..self }
    }

    /// With its config normalized by `normalize` before loading or converting.
    pub const fn with_normalize(
        self,
        normalize: fn(&ModelConfig) -> Result<ModelConfig>,
    ) -> Family {
        Family {
            normalize: Some(normalize),
            ..self
        }
    }

    /// With its stack under these names.
    pub const fn with_names(self, names: StackNames) -> Family {
        Family { names, ..self }
    }

    /// With routed experts laid out so.
    pub const fn with_experts(self, experts: Experts) -> Family {
        Family {
            experts: Some(experts),
            ..self
        }
    }

    /// With this GGUF layout.
    pub const fn with_gguf(self, gguf: Gguf) -> Family {
        Family {
            gguf: Some(gguf),
            ..self
        }
    }

    /// The `model_type` it writes.
    pub fn model_type(&self) -> &'static str {
        self.model_types[0]
    }

    /// `cfg` in the form the loader reads ([`Family::normalize`]).
    pub fn config<'a>(&self, cfg: &'a ModelConfig) -> Result<Cow<'a, ModelConfig>> {
        match self.normalize {
            Some(normalize) => Ok(Cow::Owned(normalize(cfg)?)),
            None => Ok(Cow::Borrowed(cfg)),
        }
    }

    /// Whether a GGUF file of `arch` (with routed experts or not) becomes this family.
    pub fn reads_gguf(&self, arch: &str, has_experts: bool) -> bool {
        let Some(g) = &self.gguf else { return false };
        if g.also_reads.contains(&arch) {
            return true;
        }
        g.arch == arch
            && match g.reads {
                GgufReads::All => true,
                GgufReads::WithExperts => has_experts,
                GgufReads::WithoutExperts => !has_experts,
                GgufReads::Never => false,
            }
    }
}

/// The family that runs `model_type`.
pub fn by_model_type(model_type: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.model_types.contains(&model_type))
}

/// The family of `cfg`'s `model_type`, or an error naming the field and what is supported.
pub fn family_of(cfg: &ModelConfig) -> Result<&'static Family> {
    let model_type = cfg.model_type()?;
    if model_type == "kimi_k3" {
        return Err(super::kimi_linear::refuse_kimi_k3(cfg));
    }
    by_model_type(&model_type).ok_or_else(|| {
        Error::config(
            cfg.path(),
            "model_type",
            format!(
                "`{model_type}` is not supported by this build (supported: {})",
                supported().join(", ")
            ),
        )
    })
}

/// The family a GGUF file of `arch` becomes.
pub fn by_gguf_arch(arch: &str, has_experts: bool) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.reads_gguf(arch, has_experts))
}

/// The `model_type`s this build runs.
pub fn supported() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.model_types.iter().copied())
        .collect()
}

/// The GGUF architectures this build reads.
pub fn gguf_architectures() -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for g in FAMILIES.iter().filter_map(|f| f.gguf.as_ref()) {
        let read = (g.reads != GgufReads::Never).then_some(g.arch);
        for a in read.into_iter().chain(g.also_reads.iter().copied()) {
            if !out.contains(&a) {
                out.push(a);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_types_and_gguf_architectures_are_unambiguous() {
        let all = supported();
        for (i, t) in all.iter().enumerate() {
            assert!(!all[..i].contains(t), "`{t}` is claimed by two families");
        }
        for arch in gguf_architectures() {
            for experts in [false, true] {
                let n = FAMILIES
                    .iter()
                    .filter(|f| f.reads_gguf(arch, experts))
                    .count();
                assert!(
                    n <= 1,
                    "GGUF `{arch}` (experts: {experts}) is read by {n} families"
                );
            }
        }
        assert_eq!(
            gguf_architectures(),
            [
                "llama",
                "qwen2",
                "olmoe",
                "qwen3moe",
                "deepseek2",
                "glm4moe"
            ]
        );
    }
}
