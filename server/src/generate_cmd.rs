//! `coli run`: generate from a prompt, streaming the new text to stdout, then one stats line
//! on stderr.

use std::io::Write;

use anyhow::{Context, Result};
use colibri::runtime::generate::{generate, GenerateParams};
use colibri::runtime::sampling::SamplingParams;

use crate::model_arg::ModelArgs;

/// Arguments of `coli run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// A system message (with --chat).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy (default: generation_config.json's, else 0.8).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Keep the k most likely tokens; 0 = off (default: generation_config.json's, else 40).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling threshold (default: generation_config.json's, else 0.95).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens below this fraction of the top token's probability (default 0.05).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Penalty for tokens already present (1 = off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Random seed; the same seed and settings reproduce the same text (default: random).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text is generated (may be repeated).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
}

/// Run `coli run`.
pub fn run(args: RunArgs) -> Result<()> {
    let loaded = args.model.load(true)?;
    let tok = loaded.tokenizer()?;
    let prompt_ids = if args.chat {
        let template = loaded.chat_template.as_ref().with_context(|| {
            format!(
                "--chat: {} has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja)",
                loaded.dir.display()
            )
        })?;
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(serde_json::json!({"role": "system", "content": s}));
        }
        messages.push(serde_json::json!({"role": "user", "content": args.prompt}));
        let text = template.render(&messages, true, None, None)?;
        tok.encode(&text, false)?
    } else {
        tok.encode(&args.prompt, true)?
    };
    let g = &loaded.generation;
    let sampling = SamplingParams {
        temperature: args.temperature.or(g.temperature).unwrap_or(0.8),
        top_k: args.top_k.or(g.top_k.map(|k| k as usize)).unwrap_or(40),
        top_p: args.top_p.or(g.top_p).unwrap_or(0.95),
        min_p: args.min_p.or(g.min_p).unwrap_or(0.05),
        repetition_penalty: args
            .repetition_penalty
            .or(g.repetition_penalty)
            .unwrap_or(1.0),
        seed: args.seed.unwrap_or_else(random_seed),
        ..SamplingParams::default()
    };
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        eos_token_ids: if args.ignore_eos {
            vec![]
        } else {
            loaded.eos_token_ids.clone()
        },
        stop_strings: args.stop.clone(),
        sampling,
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut write_error = None;
    let result = generate(
        loaded.model.as_ref(),
        Some(tok),
        &prompt_ids,
        &params,
        |text| {
            if write_error.is_none() {
                if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                    write_error = Some(e);
                }
            }
        },
        |_| {},
    )?;
    if let Some(e) = write_error {
        return Err(e).context("writing stdout");
    }
    loaded
        .model
        .flush()
        .context("saving the expert usage history")?;
    writeln!(out)?;
    if let Some(s) = loaded.model.store_stats() {
        eprintln!(
            "experts: hit rate {:.1} % ({:.1} % of bytes), {:.2} GB read from disk, {:.2} s waiting for reads, prefetch recall {:.0} %",
            100.0 * s.hit_rate(),
            100.0 * s.byte_hit_rate(),
            s.bytes_read as f64 / 1e9,
            s.io_wait_seconds,
            100.0 * s.prefetch_recall(),
        );
    }
    eprintln!(
        "prompt: {} tokens, prefill {:.1} tok/s | generated: {} tokens, decode {:.1} tok/s | finish: {:?} | threads: {}",
        result.prompt_tokens,
        result.prefill_tok_per_s(),
        result.tokens.len(),
        result.decode_tok_per_s(),
        result.finish_reason,
        colibri::tensor::threads::current(),
    );
    Ok(())
}

fn random_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (std::process::id() as u64).rotate_left(32)
}
