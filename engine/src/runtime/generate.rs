//! The generation loop: prefill the prompt as one batch, then decode one token at a time,
//! sampling each from the last logits row, until an end-of-sequence id, a stop string or the
//! token limit. Text is streamed through a callback as it becomes complete. A
//! [`Conversation`] carries the tokens and cache from one generation to the next
//! ([`generate_continue`]).

use std::time::Instant;

use super::sampling::{Sampler, SamplingParams};
use crate::format::tokenizer::{TextStream, Tokenizer};
use crate::model::cache::KvCache;
use crate::model::{CausalLm, Logits};
use crate::{Error, Result};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Token ids that end generation (not emitted).
    pub eos_token_ids: Vec<u32>,
    /// Strings that end generation (not emitted).
    pub stop_strings: Vec<String>,
    pub sampling: SamplingParams,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// The token limit.
    Length,
}

/// The outcome of a generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated token ids (without the end-of-sequence id).
    pub tokens: Vec<u32>,
    /// Generated text (empty without a tokenizer), cut before a stop string.
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

impl Generation {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tok_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_seconds.max(1e-9)
    }

    /// Generated tokens per second after the first (the first comes from the prefill logits).
    pub fn decode_tok_per_s(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1);
        if steps == 0 {
            0.0
        } else {
            steps as f64 / self.decode_seconds.max(1e-9)
        }
    }
}

/// A conversation that can be continued: every token so far, and the cache of the ones the
/// model has already run. The cache covers a prefix of the tokens (`cache.len <=
/// tokens.len()`); the rest — after a generation, the last sampled token, which has not been
/// run yet — are pending and run first by the next [`generate_continue`]. This is what
/// `runtime::kv_file` saves and restores.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    pub tokens: Vec<u32>,
    pub cache: KvCache,
}

impl Conversation {
    /// An empty conversation for `model`.
    pub fn new(model: &dyn CausalLm) -> Conversation {
        Conversation {
            tokens: Vec::new(),
            cache: model.new_cache(0),
        }
    }

    /// The tokens the cache does not hold yet.
    pub fn pending(&self) -> &[u32] {
        &self.tokens[self.cache.len.min(self.tokens.len())..]
    }
}

/// Generate from `prompt`. `on_text` receives each newly completed piece of text (only when a
/// tokenizer is given); `on_token` each generated id.
pub fn generate(
    model: &dyn CausalLm,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    params: &GenerateParams,
    on_text: impl FnMut(&str),
    on_token: impl FnMut(u32),
) -> Result<Generation> {
    let mut conv = Conversation::new(model);
    generate_continue(
        model, tokenizer, &mut conv, prompt, params, on_text, on_token,
    )
}

/// Continue `conv`: append `prompt` (which may be empty) to its tokens, run every token its
/// cache does not hold yet as one prefill, then generate as [`generate`] does. The
/// repetition penalties see the whole conversation.
///
/// On success `conv` holds every token, the generated ones included, plus the
/// end-of-sequence id that ended the generation, if one did; the last token is left pending
/// (not run), so that a later continuation runs it exactly as an uninterrupted generation
/// would have: splitting a greedy generation into several calls gives the same tokens and a
/// bit-identical cache. A continued conversation (one that had tokens before this call)
/// decodes its new text in the context of the tokens before it, so the pieces join up as one
/// text. On error `conv` is left part-way and should be dropped.
pub fn generate_continue(
    model: &dyn CausalLm,
    tokenizer: Option<&Tokenizer>,
    conv: &mut Conversation,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str),
    mut on_token: impl FnMut(u32),
) -> Result<Generation> {
    if prompt.is_empty() && conv.tokens.is_empty() {
        return Err(Error::Invalid(
            "the prompt is empty: nothing to continue from".into(),
        ));
    }
    params.sampling.validate()?;
    if !params.stop_strings.is_empty() && tokenizer.is_none() {
        return Err(Error::Invalid("stop strings need a tokenizer".into()));
    }
    if conv.cache.len > conv.tokens.len() {
        return Err(Error::Invalid(format!(
            "the conversation's cache holds {} tokens but the conversation has only {}",
            conv.cache.len,
            conv.tokens.len()
        )));
    }
    let continued = !conv.tokens.is_empty();
    let ctx = model.info().max_position_embeddings.max(1);
    let total = conv.tokens.len() + prompt.len();
    if total >= ctx {
        return Err(Error::Invalid(if continued {
            format!(
                "the conversation has {} tokens ({} restored + {} new) but the model's context is {ctx} tokens",
                total,
                conv.tokens.len(),
                prompt.len()
            )
        } else {
            format!(
                "the prompt has {} tokens but the model's context is {ctx} tokens",
                prompt.len()
            )
        }));
    }
    conv.tokens.extend_from_slice(prompt);
    if conv.cache.len == conv.tokens.len() {
        // Everything was run already (a conversation saved after a prefill without
        // generation): run the last token again for its logits (from a recurrent state's
        // checkpoint, the cache may go back further; everything from there runs again).
        conv.cache.truncate(conv.tokens.len() - 1);
    }
    let run = conv.tokens[conv.cache.len..].to_vec();
    let max_len = (conv.tokens.len() + params.max_tokens).min(ctx);
    conv.cache.max_len = max_len;
    let mut sampler = Sampler::new(params.sampling);
    let mut tokens = Vec::new();
    let mut text = StopText::new(params.stop_strings.clone());
    if let (true, Some(tok)) = (continued, tokenizer) {
        // The new text continues the conversation's: decode it after the last few tokens.
        let context = &conv.tokens[conv.tokens.len().saturating_sub(CONTEXT_TOKENS)..];
        text.stream = TextStream::with_context(tok, context)?;
    }

    let t0 = Instant::now();
    let mut logits = model.forward(&run, &mut conv.cache, Logits::Last)?;
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut finish_reason = FinishReason::Length;
    while tokens.len() < params.max_tokens {
        let id = sampler.sample(&logits, &conv.tokens);
        if params.eos_token_ids.contains(&id) {
            conv.tokens.push(id);
            finish_reason = FinishReason::Stop;
            break;
        }
        tokens.push(id);
        conv.tokens.push(id);
        on_token(id);
        if text.deliver(tokenizer, id, &mut on_text)? {
            finish_reason = FinishReason::Stop;
            break;
        }
        if tokens.len() >= params.max_tokens || conv.cache.len >= max_len {
            break;
        }
        logits = model.forward(&[id], &mut conv.cache, Logits::Last)?;
    }
    if let Some(tok) = tokenizer {
        let (piece, stopped) = text.finish(tok)?;
        if stopped {
            finish_reason = FinishReason::Stop;
        }
        if !piece.is_empty() {
            on_text(&piece);
        }
    }
    Ok(Generation {
        tokens,
        text: text.into_text(),
        finish_reason,
        prompt_tokens: run.len(),
        prefill_seconds,
        decode_seconds: t1.elapsed().as_secs_f64(),
    })
}

/// Tokens of a continued conversation its new text is decoded after (enough for decoders
/// whose output depends on what precedes a token: leading spaces, split characters).
const CONTEXT_TOKENS: usize = 4;

/// Generated text as it grows, cut at the first stop string. Text that could be the start of
/// a stop string is held back until the next token shows it is not.
#[derive(Debug, Clone, Default)]
pub struct StopText {
    stream: TextStream,
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    stops: Vec<String>,
    stopped: bool,
    /// The stop string the text was cut at, once one appeared.
    matched: Option<String>,
}

impl StopText {
    /// Track text ending at any of `stops`.
    pub fn new(stops: Vec<String>) -> StopText {
        StopText {
            stops,
            ..StopText::default()
        }
    }

    /// Add a generated id: returns the newly safe text and whether a stop string appeared
    /// (the text is then cut before it, and nothing more should be pushed).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<(String, bool)> {
        let piece = self.stream.push(tok, id)?;
        self.text.push_str(&piece);
        Ok(self.advance(false))
    }

    /// Push `id` when there is a tokenizer, handing the newly safe text (if any) to `on_text`;
    /// true when a stop string appeared. The one step every generation loop takes per token.
    pub fn deliver(
        &mut self,
        tokenizer: Option<&Tokenizer>,
        id: u32,
        on_text: &mut impl FnMut(&str),
    ) -> Result<bool> {
        let Some(tok) = tokenizer else {
            return Ok(false);
        };
        let (piece, stopped) = self.push(tok, id)?;
        if !piece.is_empty() {
            on_text(&piece);
        }
        Ok(stopped)
    }

    /// The end of generation: flush what was held back (an incomplete character comes out as
    /// U+FFFD). Returns the remaining text and whether a stop string appeared in it.
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<(String, bool)> {
        if !self.stopped {
            let piece = self.stream.finish(tok)?;
            self.text.push_str(&piece);
        }
        Ok(self.advance(true))
    }

    /// Everything generated so far (cut before a stop string).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The final text.
    pub fn into_text(self) -> String {
        self.text
    }

    /// The stop string the text was cut at, once one has appeared (the earliest in the text;
    /// of several starting there, the first given).
    pub fn stop_string(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    fn advance(&mut self, last: bool) -> (String, bool) {
        if !self.stopped {
            if let Some((cut, which)) = find_stop(&self.text, &self.stops) {
                self.text.truncate(cut);
                self.stopped = true;
                self.matched = Some(self.stops[which].clone());
            }
        }
        let safe = if self.stopped || last {
            self.text.len()
        } else {
            self.text.len() - held_back(&self.text, &self.stops)
        };
        let piece = if safe > self.emitted {
            self.text[self.emitted..safe].to_string()
        } else {
            String::new()
        };
        self.emitted = self.emitted.max(safe);
        (piece, self.stopped)
    }
}

/// Byte offset of the first stop string in `text`, and which of `stops` it is (of several
/// starting there, the first given).
fn find_stop(text: &str, stops: &[String]) -> Option<(usize, usize)> {
    stops
        .iter()
        .enumerate()
        .filter(|(_, s)| !s.is_empty())
        .filter_map(|(i, s)| text.find(s.as_str()).map(|at| (at, i)))
        .min()
}

/// Bytes at the end of `text` that could be the start of a stop string and so must not be
/// emitted yet.
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for s in stops {
        for n in (1..s.len()).rev() {
            if n <= text.len()
                && text.is_char_boundary(text.len() - n)
                && s.is_char_boundary(n)
                && text.ends_with(&s[..n])
            {
                hold = hold.max(n);
                break;
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_prefixes_are_held_back() {
        let stops = vec!["</end>".to_string()];
        assert_eq!(held_back("hello </e", &stops), 3);
        assert_eq!(held_back("hello", &stops), 0);
        assert_eq!(find_stop("ab</end>cd", &stops), Some((2, 0)));
    }

    #[test]
    fn the_earliest_stop_string_is_the_one_reported() {
        let stops = vec!["cd".to_string(), "b".to_string(), "bc".to_string()];
        assert_eq!(find_stop("abcd", &stops), Some((1, 1)));
        assert_eq!(find_stop("xcd", &stops), Some((1, 0)));
        assert_eq!(find_stop("xyz", &stops), None);
    }
}
