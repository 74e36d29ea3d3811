//! `coli logits`: teacher-forced logits of a token sequence, one JSON object on stdout:
//! `{"logits": [[...vocab...], ...]}` with one row per input position, as f32.

use std::io::Write;

use anyhow::{bail, Context, Result};
use colibri::model::Logits;

use crate::model_arg::ModelArgs;

/// Arguments of `coli logits`.
#[derive(clap::Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated token ids, e.g. `3,17,42`.
    #[arg(long)]
    pub tokens: String,
}

/// Run `coli logits`.
pub fn run(args: LogitsArgs) -> Result<()> {
    let ids = parse_ids(&args.tokens)?;
    let loaded = args.model.load(false)?;
    let model = loaded.model.as_ref();
    let vocab = model.info().vocab_size;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("--tokens: id {bad} is outside the vocabulary (size {vocab})");
    }
    let mut cache = model.new_cache(ids.len());
    let logits = model.forward(&ids, &mut cache, Logits::All)?;
    let rows: Vec<&[f32]> = logits.chunks(vocab).collect();
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    serde_json::to_writer(&mut out, &serde_json::json!({ "logits": rows }))?;
    writeln!(out)?;
    out.flush().context("writing stdout")?;
    Ok(())
}

/// Parse `3,17,42`.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids: Vec<u32> = s
        .split(',')
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .with_context(|| format!("--tokens: `{t}` is not a token id"))
        })
        .collect::<Result<_>>()?;
    if ids.is_empty() {
        bail!("--tokens: no token ids given (expected e.g. --tokens 3,17,42)");
    }
    Ok(ids)
}
