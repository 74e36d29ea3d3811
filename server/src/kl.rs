//! `coli kl`: how far a (quantized) model is from its reference on a prompt set — mean KL
//! divergence of the next-token distributions and how often both pick the same top token.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use colibri::model::Logits;
use colibri::runtime::loaded::LoadedModel;
use colibri::runtime::quality::Divergence;

/// Arguments of `coli kl`.
#[derive(clap::Args, Debug)]
pub struct KlArgs {
    /// The model to judge (directory or GGUF file).
    #[arg(short, long)]
    pub model: PathBuf,
    /// The reference model with the same vocabulary (directory or GGUF file).
    #[arg(short, long)]
    pub reference: PathBuf,
    /// Text file of prompts, one per line (blank lines skipped), tokenized by the reference.
    #[arg(short, long)]
    pub prompts: PathBuf,
    /// Tokens of each prompt compared at most.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Compute threads (default: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Run `coli kl`.
pub fn run(a: KlArgs) -> Result<()> {
    colibri::tensor::threads::init(a.threads)?;
    let text = std::fs::read_to_string(&a.prompts)
        .with_context(|| format!("reading prompts from {}", a.prompts.display()))?;
    let prompts: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if prompts.is_empty() {
        bail!("{}: no prompts (one per line)", a.prompts.display());
    }
    let reference = LoadedModel::open(&a.reference, true)
        .with_context(|| format!("loading the reference {}", a.reference.display()))?;
    let model = LoadedModel::open(&a.model, false)
        .with_context(|| format!("loading {}", a.model.display()))?;
    let vocab = reference.model.info().vocab_size;
    if model.model.info().vocab_size != vocab {
        bail!(
            "vocabularies differ: {} has {}, the reference {} has {vocab}",
            a.model.display(),
            model.model.info().vocab_size,
            a.reference.display()
        );
    }
    let tok = reference.tokenizer()?;
    let mut d = Divergence::default();
    for p in &prompts {
        let mut ids = tok.encode(p, true)?;
        ids.truncate(a.max_tokens);
        if ids.is_empty() {
            continue;
        }
        let run = |m: &LoadedModel| -> Result<Vec<f32>> {
            let mut cache = m.model.new_cache(ids.len());
            Ok(m.model.forward(&ids, &mut cache, Logits::All)?)
        };
        d.add(&run(&reference)?, &run(&model)?, vocab);
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": a.model, "reference": a.reference, "prompts": prompts.len(),
                "positions": d.positions, "mean_kl": d.mean_kl(), "max_kl": d.kl_max,
                "same_top": d.same_top_fraction(),
            })
        );
    } else {
        println!("model:      {}", a.model.display());
        println!("reference:  {}", a.reference.display());
        println!("positions:  {} over {} prompts", d.positions, prompts.len());
        println!("mean KL:    {:.6} nats (max {:.4})", d.mean_kl(), d.kl_max);
        println!("same top:   {:.2} %", 100.0 * d.same_top_fraction());
    }
    Ok(())
}
