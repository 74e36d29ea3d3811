//! The tokenizer and chat template every synthetic model gets: a byte-level BPE trained on a
//! built-in corpus, padded with reserved special tokens to exactly the vocabulary asked for,
//! and ChatML with Hermes-style tools.

use anyhow::Result;
use colibri::format::tokenizer::{train_byte_level_bpe, Tokenizer};

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
