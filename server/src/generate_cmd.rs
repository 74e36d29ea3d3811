//! `coli run`: generate from a prompt, streaming the new text to stdout, then one stats line
//! on stderr. With `--kv-file`, the conversation (tokens and KV cache) is restored from and
//! saved to a file, so that a later process continues it without recomputing it.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use colibri::model::Draft;
use colibri::runtime::generate::{generate_continue, Conversation, GenerateParams};
use colibri::runtime::kv_file;
use colibri::runtime::loaded::LoadedModel;
use colibri::runtime::sampling::SamplingParams;
use colibri::store::budget::format_size;

use crate::engine_options::value_name;
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
    /// Keep the conversation in this file (a warm conversation).
    ///
    /// If PATH does not exist, generation starts from the prompt as usual. If it exists, it
    /// must hold a conversation saved by `coli run --kv-file` with the same model: its tokens
    /// and KV cache are restored and the conversation continues from them. The prompt is then
    /// tokenized without a beginning-of-sequence token, may be empty (`-p ""`), and is
    /// appended to the saved tokens; only tokens not already in the saved cache are run
    /// through the model. With --chat, the template is rendered for the new user turn alone
    /// (after the --system message, if given) with the assistant prompt, a leading
    /// bos_token is dropped, and the result is appended the same way.
    ///
    /// After generation the whole conversation is saved to PATH atomically (a temporary file
    /// renamed into place): the saved and new tokens, the generated ones, and the
    /// end-of-sequence token if one ended the generation. The last token is saved as pending
    /// (not yet run), so a greedy run (--temperature 0) split over several processes
    /// generates exactly the tokens of one uninterrupted run. Sampling restarts its random
    /// generator from --seed in each process, so a sampled continuation is reproducible but
    /// not the one an uninterrupted run would have drawn; stop strings are looked for in the
    /// new text only. The new text is decoded after the saved conversation's last tokens.
    ///
    /// A file saved with another model (different config.json or tensor layout), from
    /// another format version, truncated or failing its checksum is refused with an error;
    /// delete it to start afresh.
    #[arg(long, value_name = "PATH")]
    pub kv_file: Option<PathBuf>,
}

/// Run `coli run`.
pub fn run(args: RunArgs) -> Result<()> {
    let draft = args.model.options()?.draft;
    if matches!(draft, Draft::Ngram | Draft::Auto) {
        eprintln!(
            "coli: --draft {}: prompt-lookup and grammar drafts are the server's (coli serve) and coli bench's; coli run decodes without them",
            value_name(&draft)
        );
    }
    let loaded = args.model.load(true)?;
    let tok = loaded.tokenizer()?;
    let model = loaded.model.as_ref();
    let (fingerprint, restored) = match &args.kv_file {
        Some(path) => {
            // Temporaries of saves of this file that a killed run left.
            colibri::format::write::remove_stale_temporaries_of(path);
            let (fingerprint, conv) = restore(
                path,
                &loaded,
                &args
                    .model
                    .options()?
                    .kv_dtype
                    .map_or_else(|| "f32".to_string(), |k| value_name(&k)),
            )?;
            (Some(fingerprint), conv)
        }
        None => (None, None),
    };
    let mut conv = restored.unwrap_or_else(|| Conversation::new(model));
    let continued = !conv.tokens.is_empty();
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
        let text = match template.bos_token() {
            Some(bos) if continued && !bos.is_empty() => {
                text.strip_prefix(bos).unwrap_or(&text).to_string()
            }
            _ => text,
        };
        tok.encode(&text, false)?
    } else {
        tok.encode(&args.prompt, !continued)?
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
    let mut on_text = |text: &str| {
        if write_error.is_none() {
            if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                write_error = Some(e);
            }
        }
    };
    let mut draft_stats = None;
    let result = if model.drafter().is_some() {
        anyhow::ensure!(
            args.kv_file.is_none(),
            "--draft mtp and --kv-file cannot be combined yet: drop one of them"
        );
        let (g, stats) = colibri::runtime::speculative::generate_with_drafts(
            model,
            Some(tok),
            &prompt_ids,
            &params,
            colibri::runtime::speculative::DraftPolicy::Auto,
            &mut on_text,
            |_| {},
        )?;
        draft_stats = Some(stats);
        g
    } else {
        generate_continue(
            model,
            Some(tok),
            &mut conv,
            &prompt_ids,
            &params,
            &mut on_text,
            |_| {},
        )?
    };
    if let Some(e) = write_error {
        return Err(e).context("writing stdout");
    }
    loaded
        .model
        .flush()
        .context("saving the expert usage history")?;
    writeln!(out)?;
    if let (Some(path), Some(fingerprint)) = (&args.kv_file, &fingerprint) {
        let bytes = kv_file::save(path, fingerprint, &conv).with_context(|| {
            format!(
                "--kv-file: cannot save the conversation to {}",
                path.display()
            )
        })?;
        eprintln!(
            "coli: saved the conversation to {}: {} tokens ({} cached), {}",
            path.display(),
            conv.tokens.len(),
            conv.cache.len,
            format_size(bytes)
        );
    }
    if let Some(d) = &draft_stats {
        eprintln!(
            "mtp drafts: {} verified, {:.0} % accepted; {} steps with drafts, {} without (measured {} vs {} tok/s)",
            d.drafted,
            100.0 * d.acceptance(),
            d.draft_steps,
            d.plain_steps,
            d.draft_tok_per_s.map_or("-".into(), |r| format!("{r:.2}")),
            d.plain_tok_per_s.map_or("-".into(), |r| format!("{r:.2}")),
        );
    }
    if let Some(s) = loaded.model.store_stats() {
        eprintln!(
            "experts: hit rate {:.1} % ({:.1} % of bytes), {} read from disk, {:.2} s waiting for reads, prefetch recall {:.0} %",
            100.0 * s.hit_rate(),
            100.0 * s.byte_hit_rate(),
            format_size(s.bytes_read),
            s.io_wait_seconds,
            100.0 * s.prefetch_recall(),
        );
        if let Some(drives) = crate::bench::drive_bytes_text(&s) {
            eprintln!("drives: {drives}");
        }
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

/// The model's fingerprint and, when `path` exists, the conversation saved in it (checked
/// against the model). Reports on stderr what was restored.
fn restore(
    path: &Path,
    loaded: &LoadedModel,
    kv_dtype: &str,
) -> Result<(String, Option<Conversation>)> {
    let mut fingerprint = kv_file::model_fingerprint(&loaded.dir).with_context(|| {
        format!(
            "--kv-file: cannot fingerprint the model in {}",
            loaded.dir.display()
        )
    })?;
    // A cache kept at another precision is another conversation state.
    if kv_dtype != "f32" {
        fingerprint.push_str(&format!(";kv={kv_dtype}"));
    }
    if !path.exists() {
        eprintln!(
            "coli: {} does not exist: starting a new conversation, saved there at the end",
            path.display()
        );
        return Ok((fingerprint, None));
    }
    let conv = kv_file::restore(path, &fingerprint, loaded.model.as_ref()).with_context(|| {
        format!(
            "--kv-file: cannot continue the conversation in {}",
            path.display()
        )
    })?;
    let bytes = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "coli: restored {} tokens ({} cached, {} pending) from {} ({})",
        conv.tokens.len(),
        conv.cache.len,
        conv.pending().len(),
        path.display(),
        format_size(bytes)
    );
    Ok((fingerprint, Some(conv)))
}

fn random_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (std::process::id() as u64).rotate_left(32)
}
