//! Grammar-constrained decoding. This module owns the bridge between the model's tokenizer and
//! llguidance: [`GrammarVocab`] (the token trie and parser factory, built once per model and
//! shared by every request) and [`Constraint`] (one request's parser state, which masks each
//! logits row to the tokens its [`Grammar`] allows and advances by the token the sampler chose).
//!
//! Token bytes come from the tokenizer's own `tokenizer.json` form
//! (`llguidance::token_bytes_from_tokenizer_json`). Special added tokens are stored with
//! toktrie's special-token marker byte (0xFF, never valid UTF-8), so grammar text can never
//! produce them; the EOS ids are marked the same way and are allowed only where the grammar may
//! end. Non-special added tokens (for example Qwen's `<tool_call>`) are ordinary text.
//!
//! A constraint is a request's input, so compiling one must not be able to harm the server:
//! its size and depth are checked first ([`MAX_CONSTRAINT_BYTES`], [`MAX_CONSTRAINT_DEPTH`]),
//! it compiles on a thread of its own with a stack ([`COMPILE_STACK_BYTES`]) many times what
//! the deepest accepted one needs, and its first token mask is computed there too, so one that
//! no output can satisfy (`start: start`, `{"$ref": "#"}`) or that fails llguidance's parser
//! limits from the start is refused with the request instead of failing in the engine.
//!
//! JSON grammars ([`Grammar::JsonObject`], [`Grammar::JsonSchema`]) are compact (no whitespace
//! between tokens) unless the schema brings its own `x-guidance` options, and a strict schema
//! closes its objects and bounds its numbers ([`strict_json_schema`]), so a model cannot run on
//! forever inside a valid output.

mod json_defaults;
mod limits;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use llguidance::api::{StopReason, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

pub use json_defaults::{
    strict_json_schema, with_compact_json, JSON_INTEGER_BOUND, JSON_NUMBER_BOUND,
};
pub use limits::{MAX_CONSTRAINT_BYTES, MAX_CONSTRAINT_DEPTH};

/// The stack of the thread a constraint compiles on. Measured with llguidance 1.9: the
/// deepest constraints the limits accept (a 126-hop `$ref` chain, 40 objects nested through
/// `$ref`, a 128-rule Lark chain; the `deepest_accepted_constraints_compile` test) compile in
/// 512 KiB and overflow 256 KiB, so this is over a hundred times what they need (the shapes of
/// issue 13 that overflowed the HTTP threads' 2 MiB need up to 8 MiB). It is only reserved
/// address space until it is used.
pub const COMPILE_STACK_BYTES: usize = 64 << 20;

/// What a request constrains its output to.
#[derive(Debug, Clone)]
pub enum Grammar {
    /// Any single JSON object (OpenAI response_format json_object).
    JsonObject,
    /// JSON valid against this JSON Schema (OpenAI json_schema). `strict` applies
    /// [`strict_json_schema`] first: objects that list their properties are closed and numbers
    /// bounded where the schema says nothing; `false` reads the schema as JSON Schema does.
    JsonSchema {
        schema: serde_json::Value,
        strict: bool,
    },
    /// A Lark grammar (llguidance's dialect) — the server's `grammar` extension field.
    Lark(String),
    /// A regular expression.
    Regex(String),
}

impl Grammar {
    /// What the grammar is, for messages ("JSON schema", "Lark grammar", ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Grammar::JsonObject => "JSON object constraint",
            Grammar::JsonSchema { .. } => "JSON schema",
            Grammar::Lark(_) => "Lark grammar",
            Grammar::Regex(_) => "regex",
        }
    }
}

/// Why a constraint could not be made. Every case but [`ConstraintError::Thread`] is the
/// request's fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// It is larger than [`MAX_CONSTRAINT_BYTES`].
    #[error("the {kind} is {bytes} bytes; the limit is {limit} bytes (MAX_CONSTRAINT_BYTES): send a smaller one")]
    TooLarge {
        kind: &'static str,
        bytes: usize,
        limit: usize,
    },
    /// It nests deeper than [`MAX_CONSTRAINT_DEPTH`].
    #[error("the {kind} nests more than {limit} levels deep (at {at}); the limit is {limit} levels (MAX_CONSTRAINT_DEPTH), counting nested objects, arrays, brackets, `$ref` hops and rules that use rules: flatten it")]
    TooDeep {
        kind: &'static str,
        at: String,
        limit: usize,
    },
    /// llguidance does not accept it (bad schema or grammar text).
    #[error("invalid {kind}: {message}")]
    Invalid { kind: &'static str, message: String },
    /// It compiles, but cannot start any output: it is unsatisfiable, or too ambiguous for
    /// llguidance's parser limits.
    #[error("the {kind} cannot produce an output: {message}")]
    Unusable { kind: &'static str, message: String },
    /// The compile thread could not be started (the machine's fault, not the request's).
    #[error("starting the grammar compiler thread: {0}")]
    Thread(String),
}

/// The vocabulary side, built once per model from its tokenizer and shared by every request.
pub struct GrammarVocab {
    factory: ParserFactory,
    eos_ids: Arc<[u32]>,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarVocab")
            .field("vocab_size", &self.vocab_size)
            .field("eos_ids", &self.eos_ids)
            .finish_non_exhaustive()
    }
}

impl GrammarVocab {
    /// `tokenizer` is the model's HF tokenizer; `eos_ids` are the ids that end generation (the
    /// first is the one the grammar's "end" maps to; all are allowed, and treated as the end,
    /// where the grammar accepts).
    ///
    /// Fails when the tokenizer is neither byte-level nor byte-fallback (llguidance cannot know
    /// the bytes of its tokens), when `eos_ids` is empty, or when an EOS id lies outside the
    /// vocabulary.
    pub fn new(tokenizer: &tokenizers::Tokenizer, eos_ids: &[u32]) -> Result<GrammarVocab, String> {
        if eos_ids.is_empty() {
            return Err("grammar vocabulary: no EOS token id given".to_string());
        }
        let json_text = tokenizer
            .to_string(false)
            .map_err(|e| format!("grammar vocabulary: serializing the tokenizer: {e}"))?;
        let json: serde_json::Value = serde_json::from_str(&json_text)
            .map_err(|e| format!("grammar vocabulary: re-reading the tokenizer JSON: {e}"))?;
        // llguidance asserts on a few malformed vocabularies instead of returning an error.
        let mut token_bytes = catch_unwind(AssertUnwindSafe(|| {
            llguidance::token_bytes_from_tokenizer_json(&json)
        }))
        .map_err(|_| "grammar vocabulary: llguidance panicked reading the tokenizer".to_string())?
        .map_err(|e| format!("grammar vocabulary: token bytes from the tokenizer: {e}"))?;

        // Ids can have gaps; the trie must still cover every id the tokenizer knows.
        let vocab_size = tokenizer.get_vocab_size(true).max(token_bytes.len());
        if let Some(&bad) = eos_ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(format!(
                "grammar vocabulary: EOS id {bad} is outside the tokenizer's {vocab_size} ids"
            ));
        }
        token_bytes.resize(vocab_size, Vec::new());
        // EOS ends generation: it must never count as grammar text, whatever the tokenizer's
        // `special` flag says.
        for &id in eos_ids {
            let bytes = &mut token_bytes[id as usize];
            if bytes.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                let name = tokenizer
                    .id_to_token(id)
                    .unwrap_or_else(|| format!("<[{id}]>"));
                let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                marked.extend_from_slice(name.as_bytes());
                *bytes = marked;
            }
        }

        let info = TokRxInfo {
            vocab_size: vocab_size as u32,
            tok_eos: eos_ids[0],
            tok_bos: None,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let trie = TokTrie::from(&info, &token_bytes).with_eos_tokens(eos_ids);
        let env: TokEnv = Arc::new(HfTokEnv {
            trie,
            tokenizer: encoder_without_prefix_space(tokenizer),
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| format!("grammar vocabulary: building the parser factory: {e}"))?;
        factory.quiet();
        Ok(GrammarVocab {
            factory,
            eos_ids: eos_ids.into(),
            vocab_size,
        })
    }

    /// The number of token ids the grammar knows; logits beyond it are always masked.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The raw bytes token `id` stands for (a byte-level token may hold part of a UTF-8
    /// character); empty for special tokens and ids outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let trie = self.factory.tok_env().tok_trie();
        if id as usize >= trie.vocab_size() {
            return Vec::new();
        }
        let bytes = trie.token(id);
        if bytes.first() == Some(&0xFF) {
            Vec::new()
        } else {
            bytes.to_vec()
        }
    }

    /// Compile a grammar into a fresh per-request constraint, after checking its size and
    /// depth, on a thread with a [`COMPILE_STACK_BYTES`] stack (the caller blocks until it is
    /// done: call it off an async runtime). The first token mask is computed too, so a
    /// grammar no output can satisfy is an error here rather than in the engine.
    pub fn constraint(&self, grammar: &Grammar) -> Result<Constraint, ConstraintError> {
        std::thread::scope(|scope| {
            let compile = std::thread::Builder::new()
                .name("coli-grammar".to_string())
                .stack_size(COMPILE_STACK_BYTES)
                .spawn_scoped(scope, || self.compile(grammar))
                .map_err(|e| ConstraintError::Thread(e.to_string()))?;
            compile.join().unwrap_or_else(|_| {
                Err(ConstraintError::Invalid {
                    kind: grammar.kind(),
                    message: "llguidance panicked compiling it".to_string(),
                })
            })
        })
    }

    fn compile(&self, grammar: &Grammar) -> Result<Constraint, ConstraintError> {
        let kind = grammar.kind();
        let exceeded = |e: limits::Exceeded| match e {
            limits::Exceeded::Bytes(bytes) => ConstraintError::TooLarge {
                kind,
                bytes,
                limit: MAX_CONSTRAINT_BYTES,
            },
            limits::Exceeded::Depth { at } => ConstraintError::TooDeep {
                kind,
                at,
                limit: MAX_CONSTRAINT_DEPTH,
            },
        };
        let invalid = |message: String| ConstraintError::Invalid { kind, message };
        let top = match grammar {
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(with_compact_json(
                serde_json::json!({"type": "object"}),
            )),
            Grammar::JsonSchema { schema, strict } => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(invalid(format!(
                        "expected an object, got {}",
                        json_kind(schema)
                    )));
                }
                limits::check_schema(schema).map_err(exceeded)?;
                let mut schema = schema.clone();
                if *strict {
                    strict_json_schema(&mut schema);
                }
                TopLevelGrammar::from_json_schema(with_compact_json(schema))
            }
            Grammar::Lark(text) => {
                limits::check_lark(text).map_err(exceeded)?;
                TopLevelGrammar::from_lark(text.clone())
            }
            Grammar::Regex(rx) => {
                limits::check_regex(rx).map_err(exceeded)?;
                TopLevelGrammar::from_regex(rx)
            }
        };
        // A user's grammar must not be able to take the engine down, should it hit a panic.
        let parser = catch_unwind(AssertUnwindSafe(|| self.factory.create_parser(top)))
            .map_err(|_| invalid("llguidance panicked compiling it".to_string()))?
            .map_err(|e| invalid(first_part(&e)))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(first_part(&e)));
        }
        let unusable = |message: String| ConstraintError::Unusable { kind, message };
        let first_mask = if matcher.is_stopped() {
            // Nothing may follow: fine when the empty output is complete.
            if !matcher.is_accepting().unwrap_or(false) {
                return Err(unusable(format!(
                    "it stops before any output ({})",
                    matcher.stop_reason()
                )));
            }
            None
        } else {
            let mask = matcher
                .compute_mask()
                .map_err(|e| unusable(format!("on the first token: {}", first_part(&e))))?;
            if mask.is_zero() {
                return Err(unusable(
                    "no token can start an output it accepts (is it unsatisfiable, e.g. a rule that only refers to itself?)".to_string(),
                ));
            }
            // One step further, on a copy: the first allowed token must lead somewhere. This
            // catches grammars too ambiguous for llguidance's parser limits (which trip on
            // the first token consumed) and those unsatisfiable right after it.
            let first_text =
                (0..mask.len()).find(|&id| mask.get(id) && !self.eos_ids.contains(&(id as u32)));
            if let Some(first) = first_text {
                let mut probe = matcher.clone();
                {
                    probe
                        .consume_token(first as TokenId)
                        .and_then(|()| {
                            if probe.is_stopped() {
                                Ok(())
                            } else {
                                probe.compute_mask().map(|_| ())
                            }
                        })
                        .map_err(|e| {
                            unusable(format!("after its first token: {}", first_part(&e)))
                        })?;
                }
            }
            Some(mask)
        };
        Ok(Constraint {
            matcher,
            first_mask,
            eos_ids: self.eos_ids.clone(),
            vocab_size: self.vocab_size,
            ended: false,
        })
    }
}

/// A per-request constraint: allowed tokens at each step.
pub struct Constraint {
    matcher: Matcher,
    /// The mask for the first token, computed when the constraint was made.
    first_mask: Option<SimpleVob>,
    eos_ids: Arc<[u32]>,
    vocab_size: usize,
    /// An EOS token has been consumed.
    ended: bool,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("vocab_size", &self.vocab_size)
            .field("ended", &self.ended)
            .field("stop_reason", &self.matcher.stop_reason())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Set every disallowed logit to f32::NEG_INFINITY (logits.len() may exceed the tokenizer
    /// vocab: extra ids are disallowed). When the grammar is complete, only EOS ids are allowed.
    ///
    /// Fails when the parser is in an error state or allows no token at all.
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<(), String> {
        if self.is_finished() {
            self.check_stop()?;
            self.mask_all_but_eos(logits);
            return Ok(());
        }
        let mask = match self.first_mask.take() {
            Some(mask) => mask,
            None => self
                .matcher
                .compute_mask()
                .map_err(|e| format!("grammar: computing the token mask: {}", first_part(&e)))?,
        };
        let words = mask.as_slice();
        let mut any = false;
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX && chunk.len() == 32 {
                any = true;
                continue;
            }
            for (b, logit) in chunk.iter_mut().enumerate() {
                if (bits >> b) & 1 == 0 || w * 32 + b >= self.vocab_size {
                    *logit = f32::NEG_INFINITY;
                } else {
                    any = true;
                }
            }
        }
        if !any {
            return Err(format!(
                "grammar: no token of the {} logits is allowed here",
                logits.len()
            ));
        }
        Ok(())
    }

    /// Ok when the parser stopped because the grammar is complete (or EOS came); an error
    /// when it stopped on an error or a resource limit.
    fn check_stop(&self) -> Result<(), String> {
        if let Some(e) = self.matcher.get_error() {
            return Err(format!("grammar: {}", first_part(&e)));
        }
        match self.matcher.stop_reason() {
            StopReason::NotStopped
            | StopReason::NoExtension
            | StopReason::NoExtensionBias
            | StopReason::EndOfSentence => Ok(()),
            reason => Err(format!("grammar: the parser stopped: {reason}")),
        }
    }

    fn mask_all_but_eos(&self, logits: &mut [f32]) {
        for (id, logit) in logits.iter_mut().enumerate() {
            if !self.eos_ids.contains(&(id as u32)) {
                *logit = f32::NEG_INFINITY;
            }
        }
    }

    /// Advance by the chosen token (must have been allowed).
    pub fn consume(&mut self, token: u32) -> Result<(), String> {
        // The first mask is for the state before any token.
        self.first_mask = None;
        let is_eos = self.eos_ids.contains(&token);
        if self.ended || self.matcher.is_stopped() {
            self.check_stop()?;
            if is_eos {
                self.ended = true;
                return Ok(());
            }
            return Err(format!(
                "grammar: token {token} after the grammar was complete (only EOS may follow)"
            ));
        }
        if is_eos
            && !self
                .matcher
                .is_accepting()
                .map_err(|e| format!("grammar: {}", first_part(&e)))?
        {
            return Err(format!(
                "grammar: EOS token {token} before the output is complete"
            ));
        }
        self.matcher
            .consume_token(token as TokenId)
            .map_err(|e| format!("grammar: token {token} rejected: {}", first_part(&e)))?;
        if is_eos {
            self.ended = true;
        }
        Ok(())
    }

    /// The tokens llguidance's fast-forward says the grammar forces next (the canonical
    /// tokenization of the bytes every continuation starts with); empty when nothing is forced,
    /// the grammar is complete or the parser failed. The state does not move: these are a
    /// draft (`runtime::drafts`), consumed only as the sampler picks them.
    pub fn forced_tokens(&mut self) -> Vec<u32> {
        if self.is_finished() || self.matcher.is_error() {
            return Vec::new();
        }
        let vocab = self.vocab_size as u32;
        let mut forced = self.matcher.compute_ff_tokens();
        // Cut at the first id the model cannot produce (the tokenizer may know more ids).
        let valid = forced.iter().take_while(|&&t| t < vocab).count();
        forced.truncate(valid);
        forced
    }

    /// How many of `tokens`, from the first, the grammar would accept in order from here
    /// (without moving the state).
    pub fn valid_prefix(&mut self, tokens: &[u32]) -> usize {
        if tokens.is_empty() || self.is_finished() || self.matcher.is_error() {
            return 0;
        }
        let vocab = self.vocab_size as u32;
        let n = tokens.iter().take_while(|&&t| t < vocab).count();
        self.matcher.validate_tokens(&tokens[..n]).unwrap_or(0)
    }

    /// Whether the output so far is a complete sentence of the grammar.
    pub fn is_accepting(&mut self) -> bool {
        if self.ended {
            return true;
        }
        if self.matcher.is_error() {
            return false;
        }
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether nothing but EOS may follow (generation should end).
    pub fn is_finished(&self) -> bool {
        self.ended || self.matcher.is_stopped()
    }
}

/// llguidance's runtime errors end in a dump of the parser state; keep the message before it.
fn first_part(e: &impl std::fmt::Display) -> String {
    let s = e.to_string();
    match s.find("\n<state>") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// A copy of the tokenizer for tokenizing grammar text in the middle of an output: without
/// the space that `Prepend` normalizers, `Metaspace` pre-tokenizers and `ByteLevel`'s
/// `add_prefix_space` put in front of a whole input.
fn encoder_without_prefix_space(tokenizer: &tokenizers::Tokenizer) -> tokenizers::Tokenizer {
    use tokenizers::normalizers::{NormalizerWrapper, Sequence as NormSeq};
    use tokenizers::pre_tokenizers::metaspace::PrependScheme;
    use tokenizers::pre_tokenizers::sequence::Sequence as PreSeq;
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;

    let mut tok = tokenizer.clone();
    let normalizer = match tok.get_normalizer() {
        Some(NormalizerWrapper::Prepend(_)) => Some(None),
        Some(NormalizerWrapper::Sequence(seq)) => {
            let kept: Vec<NormalizerWrapper> = seq
                .as_ref()
                .iter()
                .filter(|n| !matches!(n, NormalizerWrapper::Prepend(_)))
                .cloned()
                .collect();
            Some(Some(NormalizerWrapper::Sequence(NormSeq::new(kept))))
        }
        _ => None,
    };
    if let Some(normalizer) = normalizer {
        // Only `Into` conversions can fail here, and a wrapper converts into itself.
        let _ = tok.with_normalizer(normalizer);
    }
    let no_prepend = |p: &mut PreTokenizerWrapper| match p {
        PreTokenizerWrapper::Metaspace(m) => m.set_prepend_scheme(PrependScheme::Never),
        PreTokenizerWrapper::ByteLevel(b) => b.add_prefix_space = false,
        _ => {}
    };
    let pre = tok.get_pre_tokenizer().cloned().map(|mut p| {
        if let PreTokenizerWrapper::Sequence(seq) = &mut p {
            let mut parts: Vec<PreTokenizerWrapper> = seq.as_ref().to_vec();
            parts.iter_mut().for_each(no_prepend);
            p = PreTokenizerWrapper::Sequence(PreSeq::new(parts));
        } else {
            no_prepend(&mut p);
        }
        p
    });
    tok.with_pre_tokenizer(pre);
    tok
}

/// llguidance's view of the tokenizer: the trie plus canonical tokenization of forced text.
struct HfTokEnv {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl HfTokEnv {
    /// The tokenizer's ids for `s` when they spell exactly `s` (no special tokens, no added
    /// prefix space); otherwise the trie's greedy tokenization, which always does.
    fn tokenize_str(&self, s: &str) -> Vec<TokenId> {
        if let Ok(enc) = self.tokenizer.encode(s, false) {
            let ids = enc.get_ids();
            let mut spelled = Vec::with_capacity(s.len());
            let mut ok = true;
            for &id in ids {
                if id as usize >= self.trie.vocab_size() {
                    ok = false;
                    break;
                }
                let bytes = self.trie.token(id);
                if bytes.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                    ok = false;
                    break;
                }
                spelled.extend_from_slice(bytes);
            }
            if ok && spelled == s.as_bytes() {
                return ids.to_vec();
            }
        }
        self.trie.greedy_tokenize(s.as_bytes())
    }
}

impl TokenizerEnv for HfTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(s, |s| self.tokenize_str(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::models::TrainerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, Tokenizer};

    const SCHEMA: &str = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":8},"age":{"type":"integer"}},"required":["name","age"],"additionalProperties":false}"#;

    /// A byte-level BPE trained on a little JSON-ish text, with `<|im_end|>` (id 0),
    /// `<|endoftext|>` (id 1) and `<|im_start|>` (id 2) as special tokens.
    fn test_tokenizer() -> Tokenizer {
        let corpus = [
            r#"{"name": "Alice", "age": 30, "city": "Paris"}"#,
            r#"{"name":"Bob","age":41,"tags":["a","b"],"ok":true}"#,
            r#"[1, 2, 3, 4.5, -6, null, false, true, "text"]"#,
            "yes no maybe yes no true false null",
            r#"{"id": 12, "items": [{"k": "v"}, {"k": "w"}], "nested": {"x": 1.25e3}}"#,
            "The quick brown fox jumps over the lazy dog. Hello world!",
            "user@example.com admin@test.com contact@site.com",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "Zürich café naïve 東京 données 123 4567 89",
        ];
        let mut tok = Tokenizer::new(BPE::default());
        tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tok.with_decoder(Some(ByteLevel::default()));
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(600)
            .min_frequency(1)
            .show_progress(false)
            .special_tokens(vec![
                AddedToken::from("<|im_end|>", true),
                AddedToken::from("<|endoftext|>", true),
                AddedToken::from("<|im_start|>", true),
            ])
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        let lines: Vec<String> = (0..20).flat_map(|_| corpus.map(String::from)).collect();
        tok.train(&mut trainer, lines.into_iter())
            .expect("training the test tokenizer");
        tok
    }

    /// A strict JSON schema constraint.
    fn schema(schema: serde_json::Value) -> Grammar {
        Grammar::JsonSchema {
            schema,
            strict: true,
        }
    }

    struct Fixture {
        tok: Tokenizer,
        im_end: u32,
        endoftext: u32,
        im_start: u32,
    }

    fn fixture() -> Fixture {
        let tok = test_tokenizer();
        let id = |s: &str| tok.token_to_id(s).expect("special token in the vocabulary");
        Fixture {
            im_end: id("<|im_end|>"),
            endoftext: id("<|endoftext|>"),
            im_start: id("<|im_start|>"),
            tok,
        }
    }

    /// xorshift64*, seeded; random logits in [-4, 4).
    struct Rng(u64);
    impl Rng {
        fn next_f32(&mut self) -> f32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 8.0 - 4.0
        }
    }

    fn argmax(logits: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        best as u32
    }

    /// Greedy decoding over random logits until an EOS id is chosen; returns the text (EOS
    /// excluded) and the ids, or panics past `max_steps`.
    fn random_decode(
        vocab: &GrammarVocab,
        tok: &Tokenizer,
        grammar: &Grammar,
        eos_ids: &[u32],
        seed: u64,
        n_logits: usize,
        max_steps: usize,
    ) -> (String, Vec<u32>) {
        let mut c = vocab.constraint(grammar).expect("grammar compiles");
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut ids = Vec::new();
        for _ in 0..max_steps {
            let mut logits: Vec<f32> = (0..n_logits).map(|_| rng.next_f32()).collect();
            c.mask_logits(&mut logits).expect("mask");
            let t = argmax(&logits);
            assert!(logits[t as usize].is_finite(), "argmax picked a masked id");
            c.consume(t).expect("consume an allowed token");
            if eos_ids.contains(&t) {
                assert!(c.is_finished());
                let text = tok.decode(&ids, false).expect("decode");
                return (text, ids);
            }
            ids.push(t);
        }
        panic!(
            "no EOS within {max_steps} steps (seed {seed}): {:?}",
            tok.decode(&ids, false)
        );
    }

    #[test]
    fn schema_output_parses_with_required_keys() {
        let f = fixture();
        let eos = [f.im_end, f.endoftext];
        let vocab = GrammarVocab::new(&f.tok, &eos).unwrap();
        let schema: serde_json::Value = serde_json::from_str(SCHEMA).unwrap();
        let grammar = Grammar::JsonSchema {
            schema,
            strict: true,
        };
        let n = f.tok.get_vocab_size(true);
        for seed in 1..=8 {
            let (text, ids) = random_decode(&vocab, &f.tok, &grammar, &eos, seed, n, 300);
            assert!(!ids.contains(&f.im_start), "special token inside: {ids:?}");
            let v: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("seed {seed}: {text:?} is not JSON: {e}"));
            let obj = v.as_object().expect("an object");
            let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
            keys.sort_unstable();
            assert_eq!(keys, ["age", "name"], "seed {seed}: {text:?}");
            let name = obj["name"].as_str().expect("name is a string");
            assert!(name.chars().count() <= 8, "seed {seed}: name too long");
            let age = &obj["age"];
            assert!(
                age.is_i64() || age.is_u64() || integer_literal(&text),
                "seed {seed}: age {age} is not an integer in {text:?}"
            );
        }
    }

    /// Whether the `age` value in `text` is written as an integer literal (serde_json reads
    /// integers past 64 bits as floats).
    fn integer_literal(text: &str) -> bool {
        let after = text.split("\"age\"").nth(1).unwrap_or("");
        let lit: String = after
            .trim_start_matches(|c: char| c == ':' || c.is_whitespace())
            .chars()
            .take_while(|c| !matches!(c, ',' | '}') && !c.is_whitespace())
            .collect();
        let digits = lit.strip_prefix('-').unwrap_or(&lit);
        !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
    }

    #[test]
    fn json_object_output_is_an_object() {
        let f = fixture();
        let eos = [f.im_end];
        let vocab = GrammarVocab::new(&f.tok, &eos).unwrap();
        let n = f.tok.get_vocab_size(true);
        for seed in 1..=8 {
            let (text, ids) =
                random_decode(&vocab, &f.tok, &Grammar::JsonObject, &eos, seed, n, 3000);
            assert!(!ids.contains(&f.im_start) && !ids.contains(&f.endoftext));
            // serde_json refuses numbers like 1e568 that JSON allows, so check the syntax
            // with a strict RFC 8259 reader first, then serde_json where it can.
            assert_eq!(
                json_syntax::top_level_kind(&text),
                Ok('{'),
                "seed {seed}: {text:?}"
            );
            match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(v) => assert!(v.is_object(), "seed {seed}: {text:?}"),
                Err(e) => assert!(
                    e.to_string().starts_with("number out of range"),
                    "seed {seed}: {text:?}: {e}"
                ),
            }
        }
    }

    /// A strict JSON syntax check (RFC 8259) that, unlike serde_json, has no number range.
    mod json_syntax {
        /// The first byte of the single JSON value `text` holds, or where it breaks.
        pub fn top_level_kind(text: &str) -> Result<char, usize> {
            let b = text.as_bytes();
            let mut i = ws(b, 0);
            let first = *b.get(i).ok_or(i)? as char;
            i = value(b, i)?;
            i = ws(b, i);
            if i == b.len() {
                Ok(first)
            } else {
                Err(i)
            }
        }

        fn ws(b: &[u8], mut i: usize) -> usize {
            while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
                i += 1;
            }
            i
        }

        fn lit(b: &[u8], i: usize, word: &[u8]) -> Result<usize, usize> {
            if b[i..].starts_with(word) {
                Ok(i + word.len())
            } else {
                Err(i)
            }
        }

        fn value(b: &[u8], i: usize) -> Result<usize, usize> {
            match b.get(i).ok_or(i)? {
                b'{' => seq(b, i, b'}', true),
                b'[' => seq(b, i, b']', false),
                b'"' => string(b, i),
                b't' => lit(b, i, b"true"),
                b'f' => lit(b, i, b"false"),
                b'n' => lit(b, i, b"null"),
                _ => number(b, i),
            }
        }

        fn seq(b: &[u8], i: usize, close: u8, object: bool) -> Result<usize, usize> {
            let mut i = ws(b, i + 1);
            if b.get(i) == Some(&close) {
                return Ok(i + 1);
            }
            loop {
                if object {
                    if b.get(i) != Some(&b'"') {
                        return Err(i);
                    }
                    i = ws(b, string(b, i)?);
                    if b.get(i) != Some(&b':') {
                        return Err(i);
                    }
                    i = ws(b, i + 1);
                }
                i = ws(b, value(b, i)?);
                match b.get(i) {
                    Some(&c) if c == close => return Ok(i + 1),
                    Some(b',') => i = ws(b, i + 1),
                    _ => return Err(i),
                }
            }
        }

        fn string(b: &[u8], mut i: usize) -> Result<usize, usize> {
            i += 1;
            loop {
                match *b.get(i).ok_or(i)? {
                    b'"' => return Ok(i + 1),
                    b'\\' => match *b.get(i + 1).ok_or(i)? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                        b'u' if b.len() >= i + 6
                            && b[i + 2..i + 6].iter().all(u8::is_ascii_hexdigit) =>
                        {
                            i += 6
                        }
                        _ => return Err(i),
                    },
                    c if c < 0x20 => return Err(i),
                    _ => i += 1,
                }
            }
        }

        fn digits(b: &[u8], mut i: usize) -> Result<usize, usize> {
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            if i == start {
                Err(i)
            } else {
                Ok(i)
            }
        }

        fn number(b: &[u8], mut i: usize) -> Result<usize, usize> {
            if b.get(i) == Some(&b'-') {
                i += 1;
            }
            i = if b.get(i) == Some(&b'0') {
                i + 1
            } else if b.get(i).is_some_and(|c| (b'1'..=b'9').contains(c)) {
                digits(b, i)?
            } else {
                return Err(i);
            };
            if b.get(i) == Some(&b'.') {
                i = digits(b, i + 1)?;
            }
            if matches!(b.get(i), Some(b'e' | b'E')) {
                i += 1;
                if matches!(b.get(i), Some(b'+' | b'-')) {
                    i += 1;
                }
                i = digits(b, i)?;
            }
            Ok(i)
        }

        #[test]
        fn reader_accepts_and_rejects() {
            assert_eq!(
                top_level_kind(r#" {"a": [1, -2.5e+3, "x\u00e9"], "b": {}} "#),
                Ok('{')
            );
            assert_eq!(top_level_kind("[1e999]"), Ok('['));
            assert!(top_level_kind(r#"{"a": 01}"#).is_err());
            assert!(top_level_kind(r#"{"a" 1}"#).is_err());
            assert!(top_level_kind(r#"{"a": 1,}"#).is_err());
            assert!(top_level_kind(r#"{"a": "\n"}"#).is_ok());
            assert!(
                top_level_kind("{\"a\": \"\n\"}").is_err(),
                "a raw line break"
            );
            assert!(top_level_kind("{\"a\": \"\u{1}\"}").is_err());
            assert!(top_level_kind("{} {}").is_err());
        }
    }

    #[test]
    fn lark_yes_or_no() {
        let f = fixture();
        let eos = [f.im_end];
        let vocab = GrammarVocab::new(&f.tok, &eos).unwrap();
        let grammar = Grammar::Lark(r#"start: "yes" | "no""#.to_string());
        let mut seen = std::collections::BTreeSet::new();
        for seed in 1..=12 {
            let (text, _) = random_decode(&vocab, &f.tok, &grammar, &eos, seed, 700, 20);
            assert!(text == "yes" || text == "no", "got {text:?}");
            seen.insert(text);
        }
        assert_eq!(seen.len(), 2, "random logits should reach both answers");
    }

    #[test]
    fn complete_grammar_allows_only_eos() {
        let f = fixture();
        let eos = [f.im_end, f.endoftext];
        let vocab = GrammarVocab::new(&f.tok, &eos).unwrap();
        let mut c = vocab
            .constraint(&Grammar::Lark(r#"start: "yes""#.to_string()))
            .unwrap();
        assert!(!c.is_accepting());
        assert!(
            c.consume(f.im_end).is_err(),
            "EOS before the grammar is done"
        );
        let ids = f.tok.encode("yes", false).unwrap().get_ids().to_vec();
        for &t in &ids {
            c.consume(t).unwrap();
        }
        assert!(c.is_accepting());
        assert!(c.is_finished());
        let mut logits = vec![1.0f32; f.tok.get_vocab_size(true) + 5];
        c.mask_logits(&mut logits).unwrap();
        let allowed: Vec<usize> = (0..logits.len())
            .filter(|&i| logits[i].is_finite())
            .collect();
        let mut want = vec![f.im_end as usize, f.endoftext as usize];
        want.sort_unstable();
        assert_eq!(allowed, want);
        assert!(c.consume(ids[0]).is_err(), "text after the end");
        c.consume(f.endoftext).unwrap();
        assert!(c.is_finished());
    }

    #[test]
    fn every_eos_id_ends_an_accepting_grammar() {
        let f = fixture();
        let eos = [f.endoftext, f.im_end];
        let vocab = GrammarVocab::new(&f.tok, &eos).unwrap();
        let grammar = Grammar::Regex("a*".to_string());
        for &end in &eos {
            let mut c = vocab.constraint(&grammar).unwrap();
            let mut logits = vec![0.0f32; f.tok.get_vocab_size(true)];
            c.mask_logits(&mut logits).unwrap();
            assert!(logits[f.im_end as usize].is_finite());
            assert!(logits[f.endoftext as usize].is_finite());
            assert!(!logits[f.im_start as usize].is_finite());
            assert!(!c.is_finished(), "more `a`s may follow");
            c.consume(end).unwrap();
            assert!(c.is_finished() && c.is_accepting());
            let mut logits = vec![0.0f32; f.tok.get_vocab_size(true)];
            c.mask_logits(&mut logits).unwrap();
            let allowed = logits.iter().filter(|l| l.is_finite()).count();
            assert_eq!(allowed, 2, "only the EOS ids after the end");
        }
    }

    #[test]
    fn regex_constrains_output() {
        let f = fixture();
        let eos = [f.im_end];
        let vocab = GrammarVocab::new(&f.tok, &eos).unwrap();
        let grammar = Grammar::Regex("[a-z]{1,6}@[a-z]{1,6}\\.(com|org)".to_string());
        for seed in 1..=6 {
            let (text, _) = random_decode(&vocab, &f.tok, &grammar, &eos, seed, 700, 60);
            let (user, rest) = text.split_once('@').unwrap_or_else(|| panic!("{text:?}"));
            let (host, tld) = rest.split_once('.').unwrap_or_else(|| panic!("{text:?}"));
            let lower =
                |s: &str| (1..=6).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_lowercase());
            assert!(lower(user) && lower(host), "{text:?}");
            assert!(tld == "com" || tld == "org", "{text:?}");
        }
    }

    #[test]
    fn bad_grammars_are_errors() {
        let f = fixture();
        let vocab = GrammarVocab::new(&f.tok, &[f.im_end]).unwrap();
        let cases = [
            schema(serde_json::json!({"type": "no-such-type"})),
            schema(serde_json::json!(["not", "a", "schema"])),
            schema(serde_json::json!({"$ref": "#/$defs/missing"})),
            Grammar::Lark("start: undefined_rule".to_string()),
            Grammar::Lark("start: \"unterminated".to_string()),
            Grammar::Regex("(unclosed".to_string()),
        ];
        for g in &cases {
            match vocab.constraint(g) {
                Ok(_) => panic!("{g:?} compiled"),
                Err(e) => {
                    let e = e.to_string();
                    assert!(e.len() > 12 && e.starts_with("invalid "), "{g:?}: {e}")
                }
            }
        }
    }

    #[test]
    fn extra_logits_are_masked() {
        let f = fixture();
        let n = f.tok.get_vocab_size(true);
        let vocab = GrammarVocab::new(&f.tok, &[f.im_end]).unwrap();
        assert_eq!(vocab.vocab_size(), n);
        // `.*` allows every text token; EOS is allowed too (the empty string matches).
        let mut c = vocab
            .constraint(&Grammar::Regex("(.|\\n)*".to_string()))
            .unwrap();
        let mut logits = vec![0.5f32; n + 77];
        c.mask_logits(&mut logits).unwrap();
        assert!(logits[n..].iter().all(|l| *l == f32::NEG_INFINITY));
        assert!(
            logits[f.im_end as usize].is_finite(),
            "EOS where the grammar accepts"
        );
        assert!(
            !logits[f.im_start as usize].is_finite(),
            "a special token as text"
        );
        assert!(
            !logits[f.endoftext as usize].is_finite(),
            "a special non-EOS token"
        );
        let byte_a = f.tok.token_to_id("a").unwrap() as usize;
        assert!(logits[byte_a].is_finite());
        // A shorter logits row (a smaller head) is fine too.
        let mut short = vec![0.5f32; 40];
        c.mask_logits(&mut short).unwrap();
    }

    #[test]
    fn disallowed_token_is_rejected() {
        let f = fixture();
        let vocab = GrammarVocab::new(&f.tok, &[f.im_end]).unwrap();
        let mut c = vocab
            .constraint(&Grammar::Lark(r#"start: "yes" | "no""#.to_string()))
            .unwrap();
        let z = f.tok.token_to_id("z").unwrap();
        assert!(c.consume(z).is_err());
    }

    #[test]
    fn lark_embeds_json_schema() {
        // The form of what server/src/tool_calls.rs `required_tool_call_grammar` returns, for
        // the tools `get_weather(city: string)` and `get_time()`.
        let lark = r#"start: "<tool_call>\n" json_call "\n</tool_call>"
json_call: %json {"anyOf":[{"type":"object","properties":{"name":{"const":"get_weather"},"arguments":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"],"additionalProperties":false}},"required":["name","arguments"],"additionalProperties":false},{"type":"object","properties":{"name":{"const":"get_time"},"arguments":{"type":"object","properties":{},"additionalProperties":false}},"required":["name","arguments"],"additionalProperties":false}],"x-guidance":{"whitespace_flexible":false,"coerce_one_of":true}}
"#;
        let f = fixture();
        let vocab = GrammarVocab::new(&f.tok, &[f.im_end]).unwrap();
        let grammar = Grammar::Lark(lark.to_string());
        let feed = |text: &str| -> Result<bool, String> {
            let mut c = vocab.constraint(&grammar).map_err(|e| e.to_string())?;
            for &t in f.tok.encode(text, false).unwrap().get_ids() {
                c.consume(t)?;
            }
            Ok(c.is_accepting())
        };
        let good = [
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>",
            "<tool_call>\n{\"name\":\"get_time\",\"arguments\":{}}\n</tool_call>",
        ];
        for text in good {
            assert_eq!(feed(text), Ok(true), "{text:?}");
        }
        let bad = [
            "<tool_call>\n{\"name\": \"get_time\"",
            "<tool_call>\n{\"name\":\"get_tim\"}",
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\",\"x\"",
            "<tool_call>\n{\"name\":\"get_time\",\"arguments\":{\"city\"",
            "<tool_call>{",
            "Sure: <tool_call>",
        ];
        for text in bad {
            assert!(feed(text).is_err(), "{text:?} was accepted");
        }
        // Random decoding under it ends in a parseable call.
        let mut names = std::collections::BTreeSet::new();
        for seed in 1..=8 {
            let (text, _) = random_decode(&vocab, &f.tok, &grammar, &[f.im_end], seed, 700, 400);
            let inner = text
                .strip_prefix("<tool_call>\n")
                .and_then(|t| t.strip_suffix("\n</tool_call>"))
                .unwrap_or_else(|| panic!("{text:?}"));
            let v: serde_json::Value = serde_json::from_str(inner).unwrap();
            let name = v["name"].as_str().unwrap().to_string();
            match name.as_str() {
                "get_weather" => assert!(v["arguments"]["city"].is_string(), "{text:?}"),
                "get_time" => assert_eq!(v["arguments"], serde_json::json!({}), "{text:?}"),
                other => panic!("unknown function {other}"),
            }
            names.insert(name);
        }
        assert_eq!(names.len(), 2, "both functions are reachable");
    }

    #[test]
    fn json_is_compact_unless_the_schema_says_otherwise() {
        let f = fixture();
        let vocab = GrammarVocab::new(&f.tok, &[f.im_end]).unwrap();
        let blank = f.tok.encode(" ", false).unwrap().get_ids()[0];
        let open = f.tok.encode("{", false).unwrap().get_ids().to_vec();
        let after_open = |g: &Grammar| {
            let mut c = vocab.constraint(g).unwrap();
            for &t in &open {
                c.consume(t).unwrap();
            }
            c
        };
        assert!(after_open(&Grammar::JsonObject).consume(blank).is_err());
        let person = schema(serde_json::from_str(SCHEMA).unwrap());
        assert!(after_open(&person).consume(blank).is_err());
        // The schema's own llguidance options win: flexible whitespace, here.
        let mut loose: serde_json::Value = serde_json::from_str(SCHEMA).unwrap();
        loose["x-guidance"] = serde_json::json!({"whitespace_flexible": true});
        let mut c = after_open(&schema(loose));
        for i in 0..50 {
            c.consume(blank)
                .unwrap_or_else(|e| panic!("blank {i}: {e}"));
        }
    }

    #[test]
    fn bad_vocab_inputs_are_errors() {
        let f = fixture();
        assert!(GrammarVocab::new(&f.tok, &[]).is_err());
        let n = f.tok.get_vocab_size(true) as u32;
        let e = GrammarVocab::new(&f.tok, &[n + 3]).unwrap_err();
        assert!(e.contains("EOS"), "{e}");
    }

    #[test]
    fn shared_types_are_thread_safe() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<GrammarVocab>();
        send::<Constraint>();
    }

    #[test]
    fn oversized_and_deep_constraints_are_refused_naming_the_limit() {
        use super::limits::tests::{lark_chain, nested_objects, ref_chain};
        let f = fixture();
        let vocab = GrammarVocab::new(&f.tok, &[f.im_end]).unwrap();
        // The shapes that overflowed the HTTP thread's stack, and deep brackets.
        let deep = [
            schema(ref_chain(1000)),
            schema(nested_objects(300)),
            Grammar::Lark(lark_chain(750)),
            Grammar::Lark(format!(
                "start: {}\"a\"{}",
                "(".repeat(5000),
                ")".repeat(5000)
            )),
            Grammar::Regex(format!("{}a{}", "(".repeat(5000), ")".repeat(5000))),
            Grammar::Lark(format!(
                "start: x\nx: %json {}",
                serde_json::to_string(&nested_objects(300)).unwrap()
            )),
        ];
        for g in &deep {
            match vocab.constraint(g) {
                Err(e @ ConstraintError::TooDeep { limit, .. }) => {
                    assert_eq!(limit, MAX_CONSTRAINT_DEPTH);
                    let m = e.to_string();
                    assert!(
                        m.contains("MAX_CONSTRAINT_DEPTH") && m.contains("128"),
                        "{m}"
                    );
                }
                other => panic!("{}: {other:?}", g.kind()),
            }
        }
        let big = Grammar::Regex("a".repeat(MAX_CONSTRAINT_BYTES + 1));
        match vocab.constraint(&big) {
            Err(e @ ConstraintError::TooLarge { bytes, .. }) => {
                assert_eq!(bytes, MAX_CONSTRAINT_BYTES + 1);
                assert!(e.to_string().contains("MAX_CONSTRAINT_BYTES"), "{e}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn deepest_accepted_constraints_compile() {
        use super::limits::tests::{lark_chain, nested_objects, ref_chain};
        let f = fixture();
        let vocab = GrammarVocab::new(&f.tok, &[f.im_end]).unwrap();
        let n = MAX_CONSTRAINT_DEPTH;
        let deepest = [
            schema(ref_chain(n - 2)),
            schema(nested_objects(n / 3 - 2)),
            Grammar::Lark(lark_chain(n)),
            // llguidance's Lark parser allows 30 levels of parentheses itself.
            Grammar::Lark(format!("start: {}\"a\"{}", "(".repeat(28), ")".repeat(28))),
            Grammar::Regex(format!("{}a{}", "(".repeat(n), ")".repeat(n))),
        ];
        for g in &deepest {
            let mut c = vocab
                .constraint(g)
                .unwrap_or_else(|e| panic!("{}: {e}", g.kind()));
            let mut logits = vec![0.0f32; f.tok.get_vocab_size(true)];
            c.mask_logits(&mut logits).unwrap();
            assert!(logits.iter().any(|l| l.is_finite()));
        }
    }

    #[test]
    fn constraints_no_output_satisfies_are_refused() {
        let f = fixture();
        let vocab = GrammarVocab::new(&f.tok, &[f.im_end]).unwrap();
        let alternatives: Vec<String> = (0..20_000).map(|i| format!("\"w{i}\"")).collect();
        let cases = [
            Grammar::Lark("start: start".to_string()),
            Grammar::Lark("start: a\na: b\nb: a".to_string()),
            Grammar::Lark("start: \"a\" x\nx: x".to_string()),
            schema(serde_json::json!({"$ref": "#"})),
            schema(serde_json::json!(false)),
            Grammar::Lark(format!("start: {}", alternatives.join(" | "))),
        ];
        for g in &cases {
            match vocab.constraint(g) {
                Err(ConstraintError::Unusable { .. } | ConstraintError::Invalid { .. }) => {}
                other => panic!("{} gave {:?}", g.kind(), other.map(|_| ())),
            }
        }
        // An empty output that is complete is fine.
        let mut c = vocab.constraint(&Grammar::Regex(String::new())).unwrap();
        let mut logits = vec![0.0f32; f.tok.get_vocab_size(true)];
        c.mask_logits(&mut logits).unwrap();
        assert!(logits[f.im_end as usize].is_finite());
    }

    /// Feed `text`'s tokens to a fresh constraint of `g`: Ok(accepting) or the first refusal.
    fn feed(
        vocab: &GrammarVocab,
        tok: &Tokenizer,
        g: &Grammar,
        text: &str,
    ) -> Result<bool, String> {
        let mut c = vocab.constraint(g).map_err(|e| e.to_string())?;
        for &t in tok.encode(text, false).unwrap().get_ids() {
            c.consume(t)?;
        }
        Ok(c.is_accepting())
    }

    #[test]
    fn strict_schemas_bound_integers_and_close_objects() {
        let f = fixture();
        let vocab = GrammarVocab::new(&f.tok, &[f.im_end]).unwrap();
        let open = serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}},
                                      "required": ["n"]});
        let strict = schema(open.clone());
        let loose = Grammar::JsonSchema {
            schema: open,
            strict: false,
        };
        let digits16 = format!("{{\"n\":{}}}", "9".repeat(16));
        let digits17 = format!("{{\"n\":{}", "9".repeat(17));
        assert_eq!(feed(&vocab, &f.tok, &strict, &digits16), Ok(true));
        assert!(feed(&vocab, &f.tok, &strict, &digits17).is_err());
        assert!(feed(&vocab, &f.tok, &loose, &digits17).is_ok());
        assert!(feed(&vocab, &f.tok, &strict, "{\"n\":-9999999999999999}").is_ok());
        let extra = "{\"n\":1,\"m\"";
        assert!(feed(&vocab, &f.tok, &strict, extra).is_err());
        assert!(feed(&vocab, &f.tok, &loose, extra).is_ok());
        // Numbers: 16 digits before the point, no exponent.
        let number = schema(serde_json::json!({"type": "number"}));
        assert_eq!(
            feed(&vocab, &f.tok, &number, "-1234567890123456.25"),
            Ok(true)
        );
        assert!(feed(&vocab, &f.tok, &number, "12345678901234567").is_err());
        assert!(feed(&vocab, &f.tok, &number, "1e5").is_err());
    }

    #[test]
    fn random_output_of_a_strict_unbounded_schema_ends() {
        // Random logits favour nothing, so they find any runaway a grammar allows; under the
        // strict defaults every seed closes the object well inside the budget.
        let f = fixture();
        let eos = [f.im_end];
        let vocab = GrammarVocab::new(&f.tok, &eos).unwrap();
        let g = schema(serde_json::json!({"type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
                           "c": {"type": "boolean"}}, "required": ["a", "b", "c"]}));
        let n = f.tok.get_vocab_size(true);
        for seed in 1..=16 {
            let (text, ids) = random_decode(&vocab, &f.tok, &g, &eos, seed, n, 200);
            let v: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("seed {seed}: {text:?}: {e}"));
            let obj = v.as_object().unwrap();
            assert_eq!(obj.len(), 3, "seed {seed}: {text:?}");
            assert!(obj["a"]
                .as_i64()
                .is_some_and(|a| a.abs() <= JSON_INTEGER_BOUND));
            assert!(obj["b"]
                .as_f64()
                .is_some_and(|b| b.abs() <= JSON_NUMBER_BOUND));
            assert!(ids.len() < 200);
        }
    }

    /// Per-token mask time with a real tokenizer: `COLIBRI_GRAMMAR_TOKENIZER=path/tokenizer.json
    /// cargo test --release -- --ignored --nocapture mask_timing`.
    #[test]
    #[ignore = "timing; needs COLIBRI_GRAMMAR_TOKENIZER"]
    fn mask_timing() {
        let Ok(path) = std::env::var("COLIBRI_GRAMMAR_TOKENIZER") else {
            eprintln!("COLIBRI_GRAMMAR_TOKENIZER not set; skipping");
            return;
        };
        let tok = Tokenizer::from_file(&path).expect("tokenizer");
        let eos = tok
            .token_to_id("<|im_end|>")
            .or_else(|| tok.token_to_id("<|endoftext|>"))
            .expect("an EOS token");
        let n = tok.get_vocab_size(true);
        let t0 = std::time::Instant::now();
        let vocab = GrammarVocab::new(&tok, &[eos]).unwrap();
        eprintln!("vocab {n}: GrammarVocab::new {:?}", t0.elapsed());
        let schema: serde_json::Value = serde_json::from_str(SCHEMA).unwrap();
        let grammars = [
            (
                "schema",
                Grammar::JsonSchema {
                    schema,
                    strict: true,
                },
            ),
            ("json_object", Grammar::JsonObject),
            ("lark", Grammar::Lark(r#"start: "yes" | "no""#.to_string())),
        ];
        for (name, g) in &grammars {
            let mut total = std::time::Duration::ZERO;
            let mut steps = 0usize;
            let mut worst = std::time::Duration::ZERO;
            for seed in 1..=5u64 {
                let t0 = std::time::Instant::now();
                let mut c = vocab.constraint(g).unwrap();
                let compile = t0.elapsed();
                let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
                for _ in 0..400 {
                    let mut logits: Vec<f32> = (0..n).map(|_| rng.next_f32()).collect();
                    let t = std::time::Instant::now();
                    c.mask_logits(&mut logits).unwrap();
                    let dt = t.elapsed();
                    total += dt;
                    worst = worst.max(dt);
                    steps += 1;
                    let id = argmax(&logits);
                    c.consume(id).unwrap();
                    if id == eos {
                        break;
                    }
                }
                if seed == 1 {
                    eprintln!("  {name}: compile {compile:?}");
                }
            }
            eprintln!(
                "  {name}: random logits: {steps} steps, mean mask {:?}, worst {worst:?}",
                total / steps as u32
            );
        }
        // Model-like text: the tokenizer's own tokens of a realistic document, each of which
        // must be allowed where it comes.
        let doc = r#"{"name": "Alice Martin", "age": 34, "email": "alice@example.com", "tags": ["admin", "beta tester"], "address": {"street": "12 rue de la Paix", "city": "Paris", "zip": "75002"}, "active": true, "score": 98.5, "notes": null}"#;
        let ids = tok.encode(doc, false).unwrap().get_ids().to_vec();
        let mut c = vocab.constraint(&Grammar::JsonObject).unwrap();
        let mut total = std::time::Duration::ZERO;
        let mut worst = std::time::Duration::ZERO;
        for (step, &id) in ids.iter().chain([&eos]).enumerate() {
            let mut logits = vec![0.0f32; n];
            let t = std::time::Instant::now();
            c.mask_logits(&mut logits).unwrap();
            let dt = t.elapsed();
            total += dt;
            worst = worst.max(dt);
            assert!(
                logits[id as usize].is_finite(),
                "token {step} ({id}) masked"
            );
            c.consume(id).unwrap();
        }
        assert!(c.is_finished());
        eprintln!(
            "  json_object: document tokens: {} steps, mean mask {:?}, worst {worst:?}",
            ids.len() + 1,
            total / (ids.len() + 1) as u32
        );
    }
}
