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
//!
//! DeepSeek-V3 / R1 and the Kimi K2.5 text model become `deepseek2`, GLM-4.5 `glm4moe`, with
//! the keys and tensor names llama.cpp's converter writes (`attn_q_a`, `attn_kv_a_mqa`,
//! `attn_k_b` / `attn_v_b` or, with [`ConvertOptions::legacy_kv_b`], `attn_kv_b`;
//! `exp_probs_b.bias`, `ffn_*_shexp`, `post_attention_norm` for GLM; `expert_group_count`,
//! `expert_gating_func`, `leading_dense_block_count`, `rope.scaling.yarn_log_multiplier`, ...).
//! Neither is permuted. GLM's MTP layers follow the main ones (`nextn_predict_layers`);
//! DeepSeek's are dropped, as llama.cpp drops them. FP8 checkpoints (DeepSeek-V3's own) are
//! dequantized with their block scales.
//!
//! The tensors come from a [`TensorSource`]: a safetensors [`Checkpoint`] ([`convert`]), or
//! anything else that can hand over one named tensor at a time ([`Conversion::plan`];
//! `coli synth --format gguf` generates each from its seed when asked).

use std::path::Path;

use rayon::prelude::*;
use serde_json::Value;

use crate::format::config::ModelConfig;
use crate::format::gguf::{
    GgmlType, GgufArray, GgufTensorSpec, GgufValue, GgufWriter, GGUF_DEFAULT_ALIGNMENT,
};
use crate::format::safetensors::Checkpoint;
use crate::model::registry::{self, Family, Gguf, FAMILIES};
use crate::tensor::quant::{quantize_row, QuantType};
use crate::tensor::{DType, Tensor};
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

impl ConvertReport {
    /// Tensors per type as the commands print them: `25 q4_K, 5 q6_K, 21 f32`.
    pub fn types_summary(&self) -> String {
        let types: Vec<String> = self.types.iter().map(|(t, n)| format!("{n} {t}")).collect();
        types.join(", ")
    }
}

/// One tensor to write: its GGUF name, row-major shape, type and where its rows come from.
struct Plan {
    name: String,
    shape: Vec<usize>,
    ty: QuantType,
    /// HF tensors whose rows are concatenated (one for plain tensors, one per expert for
    /// fused experts).
    sources: Vec<String>,
    /// How rows come from each source.
    rows: Rows,
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

/// The registry's family of `cfg`, if llama.cpp has a layout for it (its descriptor's `gguf`).
fn gguf_family(cfg: &ModelConfig) -> Result<(&'static Family, Gguf)> {
    let convertible = || {
        FAMILIES
            .iter()
            .filter(|f| f.gguf.is_some())
            .flat_map(|f| f.model_types.iter().copied())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mt = cfg.model_type()?;
    match registry::by_model_type(&mt) {
        Some(family @ Family { gguf: Some(g), .. }) => Ok((family, *g)),
        _ => Err(Error::config(
            cfg.path(),
            "model_type",
            format!(
                "converting `{mt}` to GGUF is not supported (supported: {})",
                convertible()
            ),
        )),
    }
}

/// The `general.*` keys every file gets: architecture `arch`, the model's `name`, the mix's
/// `file_type` and the quantization version.
fn general_metadata(name: &str, arch: &str, mix: ConvertType) -> Vec<(String, GgufValue)> {
    vec![
        (
            "general.architecture".into(),
            GgufValue::String(arch.into()),
        ),
        ("general.name".into(), GgufValue::String(name.into())),
        ("general.file_type".into(), GgufValue::U32(mix.file_type())),
        ("general.quantization_version".into(), GgufValue::U32(2)),
    ]
}

/// Options of [`convert_with`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConvertOptions {
    /// MLA models: write `kv_b_proj` as one `attn_kv_b` tensor with the per-head key and value
    /// lengths (llama.cpp's layout before its latent KV cache; llama.cpp still loads it, then
    /// without that cache) instead of the split `attn_k_b` / `attn_v_b` and the `*_mla` keys
    /// its converter writes now.
    pub legacy_kv_b: bool,
}

/// Convert the Hugging Face model in `dir` to a GGUF file at `out`. `progress(done, total)`
/// is called with source bytes after each source tensor.
pub fn convert(
    dir: &Path,
    out: &Path,
    mix: ConvertType,
    progress: impl FnMut(u64, u64),
) -> Result<ConvertReport> {
    convert_with(dir, out, mix, ConvertOptions::default(), progress)
}

/// [`convert`] with options: the safetensors checkpoint in `dir` through [`Conversion`],
/// named after the directory.
pub fn convert_with(
    dir: &Path,
    out: &Path,
    mix: ConvertType,
    opts: ConvertOptions,
    mut progress: impl FnMut(u64, u64),
) -> Result<ConvertReport> {
    let ckpt = Checkpoint::open(dir)?;
    let conversion = Conversion::plan(dir, &model_name(dir), &ckpt, mix, opts)?;
    conversion.write(out, |p| progress(p.source_done, p.source_total))
}

/// A GGUF file's `general.name` for the model in `dir`: the directory's name.
fn model_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

/// A tensor as a [`TensorSource`] describes it, without its values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceTensor {
    /// Row-major shape (the last dimension is the row length).
    pub shape: Vec<usize>,
    /// How its values are stored.
    pub dtype: DType,
    /// Its stored size in bytes (what progress counts).
    pub bytes: usize,
}

/// What a conversion reads from a checkpoint: which tensors it has, their shapes and dtypes,
/// and one tensor's values at a time. A [`Checkpoint`] reads them from its safetensors files;
/// `coli synth --format gguf` generates each one when it is asked for, so a model need never
/// exist whole in memory or on disk before its GGUF does.
pub trait TensorSource {
    /// Whether the checkpoint has a tensor of this name.
    fn contains(&self, name: &str) -> bool;
    /// A tensor's shape, dtype and size, or an error naming it.
    fn describe(&self, name: &str) -> Result<SourceTensor>;
    /// A tensor's values, aligned for its dtype (an FP8 tensor with its block scales
    /// attached), or an error naming it.
    fn tensor(&self, name: &str) -> Result<Tensor>;
}

impl TensorSource for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        Checkpoint::contains(self, name)
    }

    fn describe(&self, name: &str) -> Result<SourceTensor> {
        let d = self.desc(name)?;
        Ok(SourceTensor {
            shape: d.shape.clone(),
            dtype: d.dtype,
            bytes: d.len,
        })
    }

    fn tensor(&self, name: &str) -> Result<Tensor> {
        let mut t = self.tensor_any_shape(name)?;
        // FP8 checkpoints (DeepSeek-V3's own) carry per-block scales.
        t.block_scales = self.block_scales(name)?;
        Ok(t)
    }
}

/// Where a conversion is, for progress displays ([`Conversion::write`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvertProgress {
    /// GGUF tensors written so far, of `tensors`.
    pub tensors_done: usize,
    /// GGUF tensors in the file.
    pub tensors: usize,
    /// Source bytes converted so far, of `source_total`.
    pub source_done: u64,
    /// Source bytes the conversion reads.
    pub source_total: u64,
    /// Tensor bytes written so far.
    pub written: u64,
}

/// A conversion planned: the GGUF file's metadata and tensors (names, shapes, types and
/// where their rows come from), nothing read yet. [`Conversion::write`] then reads one
/// source tensor at a time, quantizes its rows in parallel and streams them to the file.
pub struct Conversion<'a> {
    source: &'a dyn TensorSource,
    metadata: Vec<(String, GgufValue)>,
    plans: Vec<Plan>,
    warnings: Vec<String>,
}

impl<'a> Conversion<'a> {
    /// Plan the GGUF file of the model whose `config.json`, `tokenizer.json` and
    /// `tokenizer_config.json` are in `dir` and whose tensors `source` gives, with
    /// `general.name` = `name`.
    pub fn plan(
        dir: &Path,
        name: &str,
        source: &'a dyn TensorSource,
        mix: ConvertType,
        opts: ConvertOptions,
    ) -> Result<Conversion<'a>> {
        let cfg = ModelConfig::from_model_dir(dir)?;
        let (family, gguf) = gguf_family(&cfg)?;
        if matches!(gguf.arch, "deepseek2" | "glm4moe") {
            plan_deepseek_family(dir, name, source, mix, opts, family, &cfg)
        } else {
            plan_standard(dir, name, source, mix, family, gguf, &cfg)
        }
    }

    /// Bytes of tensor data the file will hold (each tensor padded to the alignment); the
    /// file is this plus its header (metadata, vocabulary and tensor infos).
    pub fn tensor_bytes(&self) -> Result<u64> {
        let mut total = 0u64;
        for p in &self.plans {
            let spec = GgufTensorSpec::from_shape(p.name.clone(), &p.shape, ggml(p.ty));
            let n = spec
                .nbytes()
                .map_err(|m| Error::Invalid(format!("tensor `{}`: {m}", p.name)))?;
            // The metadata sets no `general.alignment`: GGUF's default.
            total += (n as u64).next_multiple_of(GGUF_DEFAULT_ALIGNMENT);
        }
        Ok(total)
    }

    /// Source bytes the conversion reads.
    pub fn source_bytes(&self) -> u64 {
        self.plans
            .iter()
            .flat_map(|p| p.sources.iter())
            .map(|s| self.source.describe(s).map(|d| d.bytes as u64).unwrap_or(0))
            .sum()
    }

    /// Tensors the file will hold.
    pub fn tensors(&self) -> usize {
        self.plans.len()
    }

    /// What planning found that llama.cpp or colibri will treat differently.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Write the file at `out` (a temporary beside it, renamed into place when complete),
    /// one source tensor at a time; `progress` is called after each.
    pub fn write(
        self,
        out: &Path,
        mut progress: impl FnMut(&ConvertProgress),
    ) -> Result<ConvertReport> {
        let source = self.source;
        let specs: Vec<GgufTensorSpec> = self
            .plans
            .iter()
            .map(|p| GgufTensorSpec::from_shape(p.name.clone(), &p.shape, ggml(p.ty)))
            .collect();
        let mut state = ConvertProgress {
            tensors_done: 0,
            tensors: self.plans.len(),
            source_done: 0,
            source_total: self.source_bytes(),
            written: 0,
        };
        let mut writer = GgufWriter::create(out, &self.metadata, specs)?;
        let mut types: Vec<(String, usize)> = Vec::new();
        for p in &self.plans {
            if let Some(bytes) = &p.computed {
                state.written += bytes.len() as u64;
                writer.write(bytes)?;
            }
            for src in &p.sources {
                let t = source.tensor(src)?;
                let bytes = convert_tensor(&t, p.ty, p.rows)?;
                state.written += bytes.len() as u64;
                writer.write(&bytes)?;
                state.source_done += t.nbytes() as u64;
                drop(t);
                progress(&state);
            }
            match types.iter_mut().find(|(n, _)| n == p.ty.name()) {
                Some((_, c)) => *c += 1,
                None => types.push((p.ty.name().to_string(), 1)),
            }
            state.tensors_done += 1;
            progress(&state);
        }
        writer.finish()?;
        Ok(ConvertReport {
            tensors: self.plans.len(),
            bytes_in: state.source_total,
            bytes_out: state.written,
            types,
            warnings: self.warnings,
        })
    }
}

/// The plan of every family but the DeepSeek-style ones: llama.cpp's `llama`, `olmoe`,
/// `qwen3moe` layouts (Q/K permuted where the family's descriptor says so).
fn plan_standard<'a>(
    dir: &Path,
    name: &str,
    ckpt: &'a dyn TensorSource,
    mix: ConvertType,
    family: &Family,
    gguf: Gguf,
    cfg: &ModelConfig,
) -> Result<Conversion<'a>> {
    // Where the experts are, and how many (a dense family has none).
    let moe = match family.experts {
        Some(experts) => Some((experts, cfg.usize(experts.count)?)),
        None => None,
    };
    let experts = moe.map_or(0, |(_, n)| n);
    let mut warnings = Vec::new();
    let layers = cfg.usize("num_hidden_layers")?;
    let hidden = cfg.usize("hidden_size")?;
    let heads = cfg.usize("num_attention_heads")?;
    let kv_heads = cfg.usize_or("num_key_value_heads", heads)?;
    let head_dim = cfg.usize_or("head_dim", hidden / heads)?;
    let rope = cfg.rope(10000.0)?;
    if let Some(w) = cfg.get("sliding_window").and_then(|v| v.as_u64()) {
        if gguf.arch == "llama" {
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
    let a = gguf.arch;
    let u32v = |v: usize| GgufValue::U32(v as u32);
    let mut md = general_metadata(name, a, mix);
    md.extend([
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
    ]);
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
    let inter_key = if experts > 0 && cfg.get("moe_intermediate_size").is_some() {
        "moe_intermediate_size"
    } else {
        "intermediate_size"
    };
    let expert_inter = cfg.usize(inter_key)?;
    if experts > 0 {
        md.push((format!("{a}.expert_count"), u32v(experts)));
        md.push((
            format!("{a}.expert_used_count"),
            u32v(cfg.usize("num_experts_per_tok")?),
        ));
        md.push((
            format!("{a}.expert_feed_forward_length"),
            u32v(expert_inter),
        ));
        let norm = cfg.bool_or("norm_topk_prob", gguf.arch == "llama")?;
        let llama_norm = gguf.arch != "olmoe";
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
    tokenizer_metadata(dir, cfg, &mut md, &mut warnings)?;

    // Tensors, in llama.cpp's order: embeddings, layers, final norm, output.
    let vocab = cfg.usize("vocab_size")?;
    let mut plans = Vec::new();
    let plan_one = |name: String, src: String, permute: Option<usize>, layer: Option<usize>| {
        let rows = permute.map_or(Rows::Plain, Rows::Permute);
        plan_tensor(ckpt, mix, layers, name, src, rows, layer)
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
            rows: Rows::Plain,
            computed: Some(factors.iter().flat_map(|f| f.to_le_bytes()).collect()),
        });
    }
    plan!(
        "token_embd.weight".into(),
        "model.embed_tokens.weight".into(),
        None,
        None
    );
    let qk = |n: usize| if gguf.permute_qk { Some(n) } else { None };
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
        let router = moe.map(|(x, _)| format!("{}.weight", x.router("model", l)));
        let routed = router.as_ref().filter(|r| ckpt.contains(r));
        if experts > 0 && routed.is_none() && gguf.arch != "llama" {
            warnings.push(format!(
                "layer {l} is dense (no router): colibri runs this file, but llama.cpp's `{a}` expects every layer to be MoE and will refuse it"
            ));
        }
        if let (Some((layout, _)), Some(router), true) = (moe, routed, experts > 0) {
            plan!(
                format!("{b}.ffn_gate_inp.weight"),
                router.clone(),
                None,
                Some(l)
            );
            for (i, which) in ["gate", "up", "down"].iter().enumerate() {
                let name = format!("{b}.ffn_{which}_exps.weight");
                let sources: Vec<String> = (0..experts)
                    .map(|e| layout.matrix("model", l, e, i))
                    .collect();
                plans.push(plan_fused_experts(
                    ckpt, dir, mix, layers, name, sources, l,
                )?);
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

    Ok(Conversion {
        source: ckpt,
        metadata: md,
        plans,
        warnings,
    })
}

/// Source tensor `src` written as `name` with its rows as `rows` says: vectors (norms, biases)
/// and routers in f32, the rest in the type the mix gives `name` in `layer` of `blocks`.
fn plan_tensor(
    ckpt: &dyn TensorSource,
    mix: ConvertType,
    blocks: usize,
    name: String,
    src: String,
    rows: Rows,
    layer: Option<usize>,
) -> Result<Plan> {
    let shape = ckpt.describe(&src)?.shape;
    let ty = match shape.last() {
        Some(&cols) if shape.len() > 1 && !name.contains("ffn_gate_inp") => {
            choose_type(mix, &name, cols, layer, blocks)
        }
        _ => QuantType::F32,
    };
    Ok(Plan {
        name,
        shape,
        ty,
        sources: vec![src],
        rows,
        computed: None,
    })
}

/// Layer `layer`'s routed experts fused into one tensor `name` (`[experts, rows, cols]`, as
/// llama.cpp's `ffn_{gate,up,down}_exps`), one source per expert, all of one shape.
fn plan_fused_experts(
    ckpt: &dyn TensorSource,
    dir: &Path,
    mix: ConvertType,
    blocks: usize,
    name: String,
    sources: Vec<String>,
    layer: usize,
) -> Result<Plan> {
    let Some(first) = sources.first() else {
        return Err(Error::tensor(
            dir,
            name,
            "a MoE layer needs at least one routed expert",
        ));
    };
    let first = ckpt.describe(first)?.shape;
    for src in &sources {
        if ckpt.describe(src)?.shape != first {
            return Err(Error::tensor(
                dir,
                src,
                "experts of a layer differ in shape",
            ));
        }
    }
    let Some(&cols) = first.last() else {
        return Err(Error::tensor(
            dir,
            &sources[0],
            "an expert matrix has no dimensions",
        ));
    };
    let mut shape = vec![sources.len()];
    shape.extend(&first);
    Ok(Plan {
        ty: choose_type(mix, &name, cols, Some(layer), blocks),
        name,
        shape,
        sources,
        rows: Rows::Plain,
        computed: None,
    })
}

/// DeepSeek-V3 / R1 and the Kimi K2.5 text model → `deepseek2`, GLM-4.5 → `glm4moe`, as
/// llama.cpp's converter writes them: MLA tensors unpermuted (the RoPE dimensions are already
/// interleaved pairs), `kv_b_proj` split into `attn_k_b` (transposed per head) and `attn_v_b`
/// unless `opts.legacy_kv_b`; GLM's Q/K unpermuted too (llama.cpp rotates halves there); the
/// router's correction bias as `exp_probs_b.bias`; GLM's MTP layers appended as
/// `blk.{num_hidden_layers + i}` with their `nextn.*` tensors (DeepSeek's are skipped, as
/// llama.cpp's converter skips them).
fn plan_deepseek_family<'a>(
    dir: &Path,
    name: &str,
    ckpt: &'a dyn TensorSource,
    mix: ConvertType,
    opts: ConvertOptions,
    family: &Family,
    top: &ModelConfig,
) -> Result<Conversion<'a>> {
    use crate::format::config::RopeKind;
    let mt = top.model_type()?;
    // The text model's config as the loader reads it (Kimi K2.5's `text_config`), and where
    // its tensors are.
    let cfg = family.config(top)?;
    let (m, lm_head) = (family.names.model, family.names.lm_head);
    let mla = mt != "glm4_moe";
    let a = if mla { "deepseek2" } else { "glm4moe" };
    let mut warnings = Vec::new();
    let layers = cfg.usize("num_hidden_layers")?;
    let hidden = cfg.usize("hidden_size")?;
    let heads = cfg.usize("num_attention_heads")?;
    let vocab = cfg.usize("vocab_size")?;
    let eps = cfg.f64_or("rms_norm_eps", if mla { 1e-6 } else { 1e-5 })?;
    let rope = cfg.rope(10000.0)?;

    // The MoE, as the loaders read it (model/deepseek_v3.rs `DeepseekMoe`).
    let experts = cfg.usize("n_routed_experts")?;
    let top_k = cfg.usize("num_experts_per_tok")?;
    let n_group = cfg.usize_or("n_group", 1)?.max(1);
    let topk_group = cfg.usize_or("topk_group", n_group)?;
    let shared = cfg.usize_or("n_shared_experts", 0)?;
    let moe_inter = cfg.usize("moe_intermediate_size")?;
    let dense_lead = cfg.usize_or("first_k_dense_replace", 0)?;
    crate::model::deepseek_v3::check_sigmoid_scoring(&cfg)?;
    if let Some(list) = cfg.get("mlp_layer_types").and_then(|v| v.as_array()) {
        let leading = list
            .iter()
            .enumerate()
            .all(|(l, t)| t.as_str() == Some(if l < dense_lead { "dense" } else { "sparse" }));
        if !leading || list.len() != layers {
            return Err(Error::config(
                cfg.path(),
                "mlp_layer_types",
                "GGUF can only say how many leading layers are dense (leading_dense_block_count); this layout is not that",
            ));
        }
    }

    let u32v = |v: usize| GgufValue::U32(v as u32);
    let f32v = |v: f64| GgufValue::F32(v as f32);
    let key = |k: &str| format!("{a}.{k}");
    let mut md = general_metadata(name, a, mix);
    md.extend([
        (
            key("context_length"),
            u32v(cfg.usize_or("max_position_embeddings", 4096)?),
        ),
        (key("embedding_length"), u32v(hidden)),
        (key("attention.head_count"), u32v(heads)),
        (key("attention.layer_norm_rms_epsilon"), f32v(eps)),
        (key("rope.freq_base"), f32v(rope.theta)),
        (key("vocab_size"), u32v(vocab)),
        (key("expert_count"), u32v(experts)),
        (key("expert_used_count"), u32v(top_k)),
        (key("expert_shared_count"), u32v(shared)),
        (key("expert_group_count"), u32v(n_group)),
        (key("expert_group_used_count"), u32v(topk_group)),
        // llama_expert_gating_func_type: 2 = sigmoid.
        (key("expert_gating_func"), GgufValue::U32(2)),
        (key("leading_dense_block_count"), u32v(dense_lead)),
        (key("expert_feed_forward_length"), u32v(moe_inter)),
        (
            key("expert_weights_norm"),
            GgufValue::Bool(cfg.bool_or("norm_topk_prob", true)?),
        ),
    ]);
    if let Some(s) = cfg.opt_f64("routed_scaling_factor")? {
        md.push((key("expert_weights_scale"), f32v(s)));
    }
    if let Some(ff) = cfg.opt_usize("intermediate_size")? {
        md.push((key("feed_forward_length"), u32v(ff)));
    }

    // Attention.
    let q_lora = cfg.opt_usize("q_lora_rank")?;
    let (kv_lora, nope, v_dim) = if mla {
        (
            cfg.usize("kv_lora_rank")?,
            cfg.usize("qk_nope_head_dim")?,
            cfg.usize("v_head_dim")?,
        )
    } else {
        (0, 0, 0)
    };
    let head_dim = cfg.usize_or("head_dim", hidden / heads.max(1))?;
    if mla {
        let rope_dim = cfg.usize("qk_rope_head_dim")?;
        if !cfg.bool_or("rope_interleave", true)? {
            return Err(Error::Unsupported(
                "GGUF export of an MLA model with rope_interleave = false (llama.cpp's deepseek2 rotates adjacent pairs of the unpermuted weights)".into(),
            ));
        }
        if let Some(q) = q_lora {
            md.push((key("attention.q_lora_rank"), u32v(q)));
        }
        md.push((key("attention.kv_lora_rank"), u32v(kv_lora)));
        if opts.legacy_kv_b {
            md.push((key("attention.head_count_kv"), u32v(heads)));
            md.push((key("attention.key_length"), u32v(nope + rope_dim)));
            md.push((key("attention.value_length"), u32v(v_dim)));
        } else {
            // MLA as MQA over the latent: one "head" of kv_lora + rope keys, kv_lora values.
            md.push((key("attention.head_count_kv"), u32v(1)));
            md.push((key("attention.key_length"), u32v(kv_lora + rope_dim)));
            md.push((key("attention.value_length"), u32v(kv_lora)));
            md.push((key("attention.key_length_mla"), u32v(nope + rope_dim)));
            md.push((key("attention.value_length_mla"), u32v(v_dim)));
        }
        md.push((key("rope.dimension_count"), u32v(rope_dim)));
        if eps != 1e-6 {
            warnings.push(format!(
                "llama.cpp normalises the MLA latents with rms_norm_eps = {eps}, transformers (and colibri) with 1e-6: llama.cpp's results on this file differ slightly"
            ));
        }
        match rope.kind {
            RopeKind::Default => {}
            RopeKind::Yarn {
                factor,
                original_max_position_embeddings: omp,
                beta_fast,
                beta_slow,
                mscale_all_dim,
                truncate,
                ..
            } => {
                // llama.cpp's deepseek2 cancels yarn's magnitude on the rotation and puts
                // mscale(mscale_all_dim)² on the softmax scale: only configurations whose
                // rotation magnitude is 1 (mscale = mscale_all_dim) survive the trip.
                let mut rp = rope.clone();
                rp.interleaved = true;
                rp.partial_rotary_factor = 1.0;
                let magnitude = crate::model::layers::Rope::new(&rp, rope_dim).scaling;
                if (magnitude - 1.0).abs() > 1e-6 || !truncate {
                    return Err(Error::Unsupported(format!(
                        "GGUF export of this yarn configuration: llama.cpp's deepseek2 rotates at magnitude 1 with truncated correction dims, this config.json gives magnitude {magnitude} (mscale ≠ mscale_all_dim, or attention_factor) or truncate = {truncate}"
                    )));
                }
                md.push((key("rope.scaling.type"), GgufValue::String("yarn".into())));
                md.push((key("rope.scaling.factor"), f32v(factor)));
                md.push((
                    key("rope.scaling.original_context_length"),
                    u32v(omp as usize),
                ));
                md.push((key("rope.scaling.yarn_beta_fast"), f32v(beta_fast)));
                md.push((key("rope.scaling.yarn_beta_slow"), f32v(beta_slow)));
                if let Some(m) = mscale_all_dim {
                    // llama.cpp's converter writes 0.1 · mscale_all_dim (and its loader
                    // divides by 0.1 again).
                    md.push((key("rope.scaling.yarn_log_multiplier"), f32v(0.1 * m)));
                }
            }
            ref other => {
                return Err(Error::Unsupported(format!(
                    "GGUF export of RoPE scaling {other:?} for {mt}"
                )))
            }
        }
    } else {
        // GLM's partial rotary factor defaults to 0.5 (model/glm4_moe.rs).
        let given = cfg.get("partial_rotary_factor").is_some()
            || cfg
                .get("rope_parameters")
                .and_then(|p| p.get("partial_rotary_factor"))
                .is_some();
        let partial = if given {
            rope.partial_rotary_factor
        } else {
            0.5
        };
        let rot = (head_dim as f64 * partial) as usize;
        if rope.kind != RopeKind::Default {
            return Err(Error::Unsupported(format!(
                "GGUF export of RoPE scaling {:?} for glm4_moe",
                rope.kind
            )));
        }
        md.push((
            key("attention.head_count_kv"),
            u32v(cfg.usize_or("num_key_value_heads", heads)?),
        ));
        md.push((key("attention.key_length"), u32v(head_dim)));
        md.push((key("attention.value_length"), u32v(head_dim)));
        md.push((key("rope.dimension_count"), u32v(rot)));
    }

    // MTP layers: GLM's are written after the main layers (llama.cpp loads and skips them);
    // DeepSeek's are dropped, as llama.cpp's converter drops them.
    let nextn_cfg = cfg.usize_or("num_nextn_predict_layers", 0)?;
    let has_mtp = |i: usize| ckpt.contains(&format!("{m}.layers.{}.eh_proj.weight", layers + i));
    let nextn = if mla {
        0
    } else {
        (0..nextn_cfg).take_while(|&i| has_mtp(i)).count()
    };
    if !mla && nextn < nextn_cfg {
        warnings.push(format!(
            "config.json has num_nextn_predict_layers = {nextn_cfg} but the checkpoint holds {nextn} MTP layers: written with {nextn}"
        ));
    }
    if !mla {
        md.push((key("nextn_predict_layers"), u32v(nextn)));
    }
    md.push((key("block_count"), u32v(layers + nextn)));
    tokenizer_metadata(dir, &cfg, &mut md, &mut warnings)?;

    // Tensors.
    let blocks = layers + nextn;
    let plan = |name: String, src: String, layer: Option<usize>| {
        plan_tensor(ckpt, mix, blocks, name, src, Rows::Plain, layer)
    };
    let mut plans = vec![plan(
        "token_embd.weight".into(),
        format!("{m}.embed_tokens.weight"),
        None,
    )?];
    if plans[0].shape.first() != Some(&vocab) {
        return Err(Error::tensor(
            dir,
            format!("{m}.embed_tokens.weight"),
            "rows differ from vocab_size",
        ));
    }
    for l in 0..blocks {
        let p = format!("{m}.layers.{l}");
        let b = format!("blk.{l}");
        let s = Some(l);
        let mut pairs: Vec<(&str, &str)> = vec![("attn_norm.weight", "input_layernorm.weight")];
        if mla {
            if q_lora.is_some() {
                pairs.extend([
                    ("attn_q_a.weight", "self_attn.q_a_proj.weight"),
                    ("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
                    ("attn_q_b.weight", "self_attn.q_b_proj.weight"),
                ]);
            } else {
                pairs.push(("attn_q.weight", "self_attn.q_proj.weight"));
            }
            pairs.extend([
                (
                    "attn_kv_a_mqa.weight",
                    "self_attn.kv_a_proj_with_mqa.weight",
                ),
                ("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
            ]);
            if opts.legacy_kv_b {
                pairs.push(("attn_kv_b.weight", "self_attn.kv_b_proj.weight"));
            }
            pairs.extend([
                ("attn_output.weight", "self_attn.o_proj.weight"),
                ("ffn_norm.weight", "post_attention_layernorm.weight"),
            ]);
        } else {
            pairs.extend([
                ("attn_q.weight", "self_attn.q_proj.weight"),
                ("attn_k.weight", "self_attn.k_proj.weight"),
                ("attn_v.weight", "self_attn.v_proj.weight"),
                ("attn_output.weight", "self_attn.o_proj.weight"),
                (
                    "post_attention_norm.weight",
                    "post_attention_layernorm.weight",
                ),
            ]);
            for (g, h) in [
                ("attn_q.bias", "self_attn.q_proj.bias"),
                ("attn_k.bias", "self_attn.k_proj.bias"),
                ("attn_v.bias", "self_attn.v_proj.bias"),
                ("attn_q_norm.weight", "self_attn.q_norm.weight"),
                ("attn_k_norm.weight", "self_attn.k_norm.weight"),
            ] {
                if ckpt.contains(&format!("{p}.{h}")) {
                    pairs.push((g, h));
                }
            }
        }
        for (g, h) in pairs {
            plans.push(plan(format!("{b}.{g}"), format!("{p}.{h}"), s)?);
        }
        if mla && !opts.legacy_kv_b {
            let src = format!("{p}.self_attn.kv_b_proj.weight");
            let d = ckpt.describe(&src)?;
            if d.shape != [heads * (nope + v_dim), kv_lora] {
                return Err(Error::tensor(
                    dir,
                    &src,
                    format!(
                        "has shape {:?}, expected [{}, {kv_lora}] from config.json",
                        d.shape,
                        heads * (nope + v_dim)
                    ),
                ));
            }
            for (name, shape, cols, rows) in [
                (
                    format!("{b}.attn_k_b.weight"),
                    vec![heads, kv_lora, nope],
                    nope,
                    Rows::KvbKeys {
                        heads,
                        nope,
                        v: v_dim,
                    },
                ),
                (
                    format!("{b}.attn_v_b.weight"),
                    vec![heads, v_dim, kv_lora],
                    kv_lora,
                    Rows::KvbValues {
                        heads,
                        nope,
                        v: v_dim,
                    },
                ),
            ] {
                let ty = choose_type(mix, &name, cols, s, blocks);
                plans.push(Plan {
                    name,
                    shape,
                    ty,
                    sources: vec![src.clone()],
                    rows,
                    computed: None,
                });
            }
        }
        if l >= dense_lead {
            plans.push(plan(
                format!("{b}.ffn_gate_inp.weight"),
                format!("{p}.mlp.gate.weight"),
                s,
            )?);
            let bias = format!("{p}.mlp.gate.e_score_correction_bias");
            if ckpt.contains(&bias) {
                plans.push(plan(format!("{b}.exp_probs_b.bias"), bias, s)?);
            }
            for which in ["gate", "up", "down"] {
                let name = format!("{b}.ffn_{which}_exps.weight");
                let sources: Vec<String> = (0..experts)
                    .map(|e| format!("{p}.mlp.experts.{e}.{which}_proj.weight"))
                    .collect();
                plans.push(plan_fused_experts(
                    ckpt, dir, mix, blocks, name, sources, l,
                )?);
            }
            if shared > 0 {
                for which in ["gate", "up", "down"] {
                    plans.push(plan(
                        format!("{b}.ffn_{which}_shexp.weight"),
                        format!("{p}.mlp.shared_experts.{which}_proj.weight"),
                        s,
                    )?);
                }
            }
        } else {
            for which in ["gate", "up", "down"] {
                plans.push(plan(
                    format!("{b}.ffn_{which}.weight"),
                    format!("{p}.mlp.{which}_proj.weight"),
                    s,
                )?);
            }
        }
        if l >= layers {
            for (g, h, required) in [
                ("nextn.eh_proj.weight", "eh_proj.weight", true),
                ("nextn.enorm.weight", "enorm.weight", true),
                ("nextn.hnorm.weight", "hnorm.weight", true),
                (
                    "nextn.shared_head_norm.weight",
                    "shared_head.norm.weight",
                    true,
                ),
                (
                    "nextn.shared_head_head.weight",
                    "shared_head.head.weight",
                    false,
                ),
                ("nextn.embed_tokens.weight", "embed_tokens.weight", false),
            ] {
                let src = format!("{p}.{h}");
                if required || ckpt.contains(&src) {
                    plans.push(plan(format!("{b}.{g}"), src, s)?);
                }
            }
        }
    }
    plans.push(plan(
        "output_norm.weight".into(),
        format!("{m}.norm.weight"),
        None,
    )?);
    let head = format!("{lm_head}.weight");
    let tied = cfg.bool_or("tie_word_embeddings", false)? && !ckpt.contains(&head);
    if !tied {
        plans.push(plan("output.weight".into(), head, None)?);
    }
    Ok(Conversion {
        source: ckpt,
        metadata: md,
        plans,
        warnings,
    })
}

/// How a plan's rows come from its source tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    /// As stored.
    Plain,
    /// Permuted per head (this many heads) for llama.cpp's RoPE (Q/K of llama and mixtral).
    Permute(usize),
    /// MLA's `kv_b_proj` (`[H·(nope + v), r]`) as llama.cpp's `attn_k_b` (`[H, r, nope]`):
    /// each head's key rows, transposed.
    KvbKeys { heads: usize, nope: usize, v: usize },
    /// MLA's `kv_b_proj` as llama.cpp's `attn_v_b` (`[H, v, r]`): each head's value rows.
    KvbValues { heads: usize, nope: usize, v: usize },
}

/// Rows of `t` (rearranged as `rows` says) quantized to `ty`, in parallel chunks.
fn convert_tensor(t: &Tensor, ty: QuantType, rows: Rows) -> Result<Vec<u8>> {
    let view = t.view()?;
    let (n, cols) = (view.rows, view.cols);
    if let Rows::KvbKeys { heads, nope, v } | Rows::KvbValues { heads, nope, v } = rows {
        if n != heads * (nope + v) {
            return Err(Error::Invalid(format!(
                "tensor `{}` has {n} rows, expected heads · (qk_nope_head_dim + v_head_dim) = {}",
                t.name,
                heads * (nope + v)
            )));
        }
    }
    if let Rows::KvbKeys { heads, nope, v } = rows {
        // Head h's block is `cols` (= kv_lora_rank) rows of `nope` values: column c of the
        // head's key rows.
        let row_bytes = ty.row_bytes(nope)?;
        let blocks: Vec<Result<Vec<u8>>> = (0..heads)
            .into_par_iter()
            .map(|h| {
                let mut keys = vec![0.0f32; nope * cols];
                for i in 0..nope {
                    view.row_to_f32(h * (nope + v) + i, &mut keys[i * cols..(i + 1) * cols]);
                }
                let mut out = Vec::with_capacity(cols * row_bytes);
                let mut row = vec![0.0f32; nope];
                for c in 0..cols {
                    for (i, x) in row.iter_mut().enumerate() {
                        *x = keys[i * cols + c];
                    }
                    quantize_row(ty, &row, &mut out)?;
                }
                Ok(out)
            })
            .collect();
        let mut out = Vec::with_capacity(heads * cols * row_bytes);
        for b in blocks {
            out.extend(b?);
        }
        return Ok(out);
    }
    let out_rows = match rows {
        Rows::KvbValues { heads, v, .. } => heads * v,
        _ => n,
    };
    let source_row = |r: usize| -> usize {
        match rows {
            Rows::Permute(h) if n.is_multiple_of(h) => {
                let hd = n / h;
                let (head, i) = (r / hd, r % hd);
                // llama.cpp's permute: new row 2i ← old row i, new row 2i+1 ← old row i + hd/2.
                head * hd + if i % 2 == 0 { i / 2 } else { i / 2 + hd / 2 }
            }
            Rows::KvbValues { nope, v, .. } => (r / v) * (nope + v) + nope + r % v,
            _ => r,
        }
    };
    let row_bytes = ty.row_bytes(cols)?;
    const CHUNK: usize = 64;
    let chunks: Vec<Result<Vec<u8>>> = (0..out_rows.div_ceil(CHUNK))
        .into_par_iter()
        .map(|c| {
            let mut out = Vec::with_capacity(CHUNK * row_bytes);
            let mut row = vec![0.0f32; cols];
            for r in c * CHUNK..((c + 1) * CHUNK).min(out_rows) {
                view.row_to_f32(source_row(r), &mut row);
                quantize_row(ty, &row, &mut out)?;
            }
            Ok(out)
        })
        .collect();
    let mut out = Vec::with_capacity(out_rows * row_bytes);
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
