//! The built-in demo model: an OLMoE-shaped random-weight checkpoint of about 1 GB,
//! synthesized once into the user's cache directory on first use. Also the tokenizer and
//! chat template every synthetic model gets.

use std::path::PathBuf;

use anyhow::{Context, Result};
use colibri::format::tokenizer::{train_byte_level_bpe, Tokenizer};

use crate::synth::{synthesize, SynthArch, SynthArgs, SynthDType};

/// Bumped whenever the demo model's shape changes, so an old cache is not reused.
const DEMO_NAME: &str = "demo-olmoe-1g-v3";

/// ChatML with Hermes/Qwen-style tools (a `# Tools` system block, `<tool_call>` JSON in
/// assistant turns, `<tool_response>` for tool results): the template synthetic models carry.
pub const CHATML_TEMPLATE: &str = r#"{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'assistant' %}<|im_start|>assistant
{{ message['content'] }}{% for tc in message['tool_calls'] or [] %}
<tool_call>
{"name": "{{ tc['function']['name'] }}", "arguments": {{ tc['function']['arguments'] | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

/// Text the synthetic tokenizers are trained on.
const CORPUS: &str = include_str!("demo_corpus.txt");

/// Where colibri caches things: `$COLI_CACHE_DIR`, else `$XDG_CACHE_HOME/colibri`, else
/// `~/.cache/colibri`.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("COLI_CACHE_DIR") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(d).join("colibri"));
    }
    let home = std::env::var_os("HOME")
        .context("cannot find a cache directory: set COLI_CACHE_DIR or HOME")?;
    Ok(PathBuf::from(home).join(".cache").join("colibri"))
}

/// The demo's default budget: the resident set plus a quarter of its expert bytes, so its
/// experts visibly stream.
pub fn demo_budget(dir: &std::path::Path) -> Option<u64> {
    let ckpt = colibri::format::safetensors::Checkpoint::open(dir).ok()?;
    let experts: u64 = ckpt
        .tensors()
        .values()
        .filter(|d| d.name.contains(".experts."))
        .map(|d| d.len as u64)
        .sum();
    Some(ckpt.total_bytes() as u64 - experts + experts / 4)
}

/// The demo model's shape.
pub fn demo_args(out: PathBuf) -> SynthArgs {
    SynthArgs {
        arch: SynthArch::Olmoe,
        layers: 8,
        hidden: 1024,
        heads: Some(16),
        kv_heads: Some(16),
        experts: 32,
        top_k: 4,
        moe_intermediate: 640,
        intermediate: None,
        vocab: 4096,
        dtype: SynthDType::Bf16,
        seed: 0,
        shard_bytes: 4_000_000_000,
        out,
        threads: 0,
        ds: Default::default(),
    }
}

/// The demo model directory, synthesized on first use. Temporaries that killed runs left in
/// the cache directory (a demo model half written, a bandwidth probe) are removed first.
pub fn ensure() -> Result<PathBuf> {
    let cache = cache_dir()?;
    colibri::format::write::remove_stale_temporaries(&cache, |_| true);
    let dir = cache.join(DEMO_NAME);
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let mut args = demo_args(dir.clone());
    // Every id of the demo vocabulary is a real text token, so even random weights print text.
    args.vocab = natural_vocab(&SPECIALS)?;
    eprintln!(
        "coli: writing the demo model (about 1 GB of random weights) to {} — once only",
        dir.display()
    );
    synthesize(&args, true)?;
    Ok(dir)
}

/// Special tokens of synthetic tokenizers.
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

fn corpus_lines() -> Vec<&'static str> {
    CORPUS.lines().filter(|l| !l.trim().is_empty()).collect()
}

/// The vocabulary size the built-in corpus supports without padding.
pub fn natural_vocab(specials: &[&str]) -> Result<usize> {
    Ok(train_byte_level_bpe(&corpus_lines(), 1 << 16, specials)?.vocab_size())
}

/// A byte-level BPE trained on the built-in corpus with exactly `vocab` entries: learned
/// merges up to what the corpus supports, then `<|reserved_N|>` special tokens.
pub fn tokenizer_for(vocab: usize, specials: &[&str]) -> Result<Tokenizer> {
    let tok = train_byte_level_bpe(&corpus_lines(), vocab, specials)?;
    let have = tok.vocab_size();
    if have > vocab {
        anyhow::bail!("tokenizer training produced {have} entries for a vocabulary of {vocab}");
    }
    let mut inner = tok.inner().clone();
    let reserved: Vec<tokenizers::AddedToken> = (0..vocab - have)
        .map(|i| tokenizers::AddedToken::from(format!("<|reserved_{i}|>"), true))
        .collect();
    let _added = inner.add_special_tokens(reserved);
    let tok = Tokenizer::from_inner(inner, "<synthetic tokenizer>");
    if tok.vocab_size() != vocab {
        anyhow::bail!(
            "synthetic tokenizer has {} entries, expected {vocab}",
            tok.vocab_size()
        );
    }
    Ok(tok)
}
