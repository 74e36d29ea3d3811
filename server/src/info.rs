//! `coli info`: what a model is and what it weighs.

use anyhow::Result;

use crate::model_arg::ModelArgs;

/// Arguments of `coli info`.
#[derive(clap::Args, Debug)]
pub struct InfoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

fn bytes(n: usize) -> String {
    colibri::store::budget::format_size(n as u64)
}

fn count(n: usize) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2} B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.1} M", n / 1e6)
    } else {
        format!("{:.1} k", n / 1e3)
    }
}

/// Run `coli info`.
pub fn run(args: InfoArgs) -> Result<()> {
    let loaded = args.model.load_mapped(false)?;
    let i = loaded.model.info();
    if args.json {
        println!("{}", serde_json::to_string_pretty(i)?);
        return Ok(());
    }
    println!("model:        {}", loaded.dir.display());
    println!("architecture: {} ({})", i.architecture, i.model_type);
    println!(
        "layers:       {} ({} MoE), hidden {}, vocab {}, context {}",
        i.layers, i.moe_layers, i.hidden_size, i.vocab_size, i.max_position_embeddings
    );
    if i.moe_layers > 0 {
        println!(
            "experts:      {} routed, {} shared, {} active per token",
            i.routed_experts, i.shared_experts, i.active_experts
        );
    } else {
        println!("experts:      none (dense)");
    }
    println!(
        "parameters:   {} total, {} active per token",
        count(i.total_params),
        count(i.active_params)
    );
    println!(
        "weights:      {} dense (resident), {} routed experts; dtypes: {}",
        bytes(i.dense_bytes),
        bytes(i.routed_expert_bytes),
        i.dtypes.join(", ")
    );
    if i.kv_bytes_per_token == i.kv_bytes_per_token_full {
        println!("kv cache:     {} per token", bytes(i.kv_bytes_per_token));
    } else {
        println!(
            "kv cache:     {} per token; per-head K/V attention (f32) would take {} ({:.1}× more)",
            bytes(i.kv_bytes_per_token),
            bytes(i.kv_bytes_per_token_full),
            i.kv_bytes_per_token_full as f64 / i.kv_bytes_per_token.max(1) as f64
        );
    }
    if i.state_bytes_per_sequence > 0 {
        println!(
            "state:        {} per sequence (linear-attention and convolution windows; constant in context)",
            bytes(i.state_bytes_per_sequence)
        );
    }
    println!(
        "tokenizer:    {}",
        match &loaded.tokenizer {
            Some(t) => t.origin().display().to_string(),
            None => "none".into(),
        }
    );
    println!(
        "chat template: {}",
        loaded
            .chat_template
            .as_ref()
            .map(|t| t.source().display().to_string())
            .unwrap_or_else(|| "none".into())
    );
    if let Some(line) = crate::model_arg::device_line(&loaded) {
        println!("{line}");
    }
    for what in &i.skipped {
        println!("not loaded:   {what}");
    }
    Ok(())
}
