//! `coli convert`: write a Hugging Face checkpoint as a GGUF file llama.cpp runs.

use std::path::PathBuf;

use anyhow::{Context, Result};
use colibri::convert::{convert_with, ConvertOptions, ConvertType};

/// Arguments of `coli convert`.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// Hugging Face model directory (config.json, safetensors, tokenizer.json).
    #[arg(short, long)]
    pub model: PathBuf,
    /// The GGUF file to write (written to a temporary name, renamed at the end).
    #[arg(short, long)]
    pub out: PathBuf,
    /// q8_0, q6_k, q5_k_m, q4_k_m, bf16, f16 or f32.
    #[arg(short = 't', long = "type", default_value = "q8_0")]
    pub ty: String,
    /// MLA models (DeepSeek-V3, Kimi): write `kv_b_proj` as one `attn_kv_b` tensor, llama.cpp's
    /// layout before its latent KV cache, instead of the split `attn_k_b` / `attn_v_b` its
    /// converter writes now.
    #[arg(long)]
    pub legacy_kv_b: bool,
    /// Compute threads for quantization (default: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// Run `coli convert`.
pub fn run(a: ConvertArgs) -> Result<()> {
    let mix = ConvertType::parse(&a.ty)?;
    if a.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(a.threads)
            .build_global()
            .context("setting up the thread pool")?;
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} converting [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let t0 = std::time::Instant::now();
    let opts = ConvertOptions {
        legacy_kv_b: a.legacy_kv_b,
    };
    let report = convert_with(&a.model, &a.out, mix, opts, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("converting {} to {}", a.model.display(), a.out.display()))?;
    bar.finish_and_clear();
    for w in &report.warnings {
        eprintln!("coli: warning: {w}");
    }
    eprintln!(
        "coli: wrote {} ({} tensors: {}; {} from {}) in {:.1} s",
        a.out.display(),
        report.tensors,
        report.types_summary(),
        colibri::store::budget::format_size(report.bytes_out as u64),
        colibri::store::budget::format_size(report.bytes_in as u64),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
