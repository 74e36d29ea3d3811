//! The text side of a checkpoint: loading `tokenizer.json` through the `tokenizers` crate,
//! encoding and decoding, incremental detokenization for streamed output ([`TextStream`]),
//! and training a small byte-level BPE so that synthetic random-weight models get a working
//! tokenizer ([`train_byte_level_bpe`]).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

use crate::error::{Error, Result};
use crate::format::chat_template::PromptPart;

/// The replacement character a byte-level decoder emits for an incomplete UTF-8 sequence.
const REPLACEMENT: char = '\u{FFFD}';

/// The most tokens [`TextStream`] holds back waiting for a UTF-8 sequence to complete.
const MAX_HELD_TOKENS: usize = 4;

/// A loaded tokenizer (`tokenizer.json`), remembering where it came from for error messages.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    origin: PathBuf,
    /// A copy of `inner` that encodes special-token text as ordinary text, made on first use.
    plain: Arc<OnceLock<tokenizers::Tokenizer>>,
    /// The special-token texts [`Tokenizer::special_token_texts`] reports, found on first use.
    specials: Arc<OnceLock<Vec<String>>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

/// Why the decoder `d` (or a decoder of its `Sequence`) cannot be used, if it cannot: a
/// `Strip` decoder with `stop` > 0 makes the tokenizers crate index before the start of a
/// token shorter than `stop` characters (an empty one, say) and panic while decoding, which
/// no load-time check of the crate catches (found by the `tokenizer` fuzz target).
fn unsafe_decoder(d: &serde_json::Value) -> Option<String> {
    match d.get("type").and_then(|t| t.as_str()) {
        Some("Sequence") => d
            .get("decoders")
            .and_then(|v| v.as_array())
            .and_then(|all| all.iter().find_map(unsafe_decoder)),
        Some("Strip") => match d.get("stop").and_then(|v| v.as_u64()) {
            Some(stop) if stop > 0 => Some(format!(
                "decoder: a Strip decoder with \"stop\": {stop} is not supported (the tokenizers \
                 crate panics decoding a token shorter than {stop} characters); tokenizers of \
                 released models strip at the start only (\"stop\": 0)"
            )),
            _ => None,
        },
        _ => None,
    }
}

impl Tokenizer {
    /// Load a `tokenizer.json`. A missing or unreadable file is [`Error::Io`]; a file that is
    /// not JSON (a syntax error, nesting deeper than serde_json's 128 levels) is
    /// [`Error::Json`]; one that does not describe a tokenizer is [`Error::Corrupt`]; all
    /// name the path.
    ///
    /// The `tokenizers` crate panics on some such files (its decoder and normalizer
    /// deserializers `expect` success), so the JSON is parsed here first, and what the crate
    /// builds from it is built under `catch_unwind`: a panic in there becomes an error too.
    pub fn from_file(path: &Path) -> Result<Tokenizer> {
        let json = crate::error::read_json(path)?;
        let built = std::panic::catch_unwind(move || {
            <tokenizers::Tokenizer as serde::Deserialize>::deserialize(json)
        });
        let inner = match built {
            Ok(Ok(inner)) => inner,
            Ok(Err(e)) => {
                return Err(Error::corrupt(
                    path,
                    format!("not a usable tokenizer.json: {e}"),
                ))
            }
            Err(panic) => {
                let why = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("no message");
                return Err(Error::corrupt(
                    path,
                    format!(
                        "not a usable tokenizer.json: the tokenizers crate failed on it ({why})"
                    ),
                ));
            }
        };
        // What the crate built, not what the file says, is checked: the crate matches a
        // decoder by its fields as well as its "type" (a "Striz" with Strip's fields builds a
        // Strip), so the decoder is read back from the built tokenizer.
        let built_decoder = inner
            .get_decoder()
            .and_then(|d| serde_json::to_value(d).ok());
        if let Some(why) = built_decoder.as_ref().and_then(unsafe_decoder) {
            return Err(Error::corrupt(path, why));
        }
        Ok(Tokenizer::from_inner(inner, path))
    }

    /// Wrap an already built `tokenizers` tokenizer; `origin` is what error messages name.
    pub fn from_inner(inner: tokenizers::Tokenizer, origin: impl Into<PathBuf>) -> Tokenizer {
        Tokenizer {
            inner,
            origin: origin.into(),
            plain: Arc::default(),
            specials: Arc::default(),
        }
    }

    /// A tokenizer around `inner` (a variant of this one, e.g. with some special tokens made
    /// non-special so that decoding keeps them) that still treats this tokenizer's special
    /// tokens as special-token text: [`Tokenizer::encode_plain`] and
    /// [`Tokenizer::special_token_texts`] are this tokenizer's.
    pub fn variant(&self, inner: tokenizers::Tokenizer) -> Tokenizer {
        self.plain_inner();
        self.special_token_texts();
        Tokenizer {
            inner,
            origin: self.origin.clone(),
            plain: self.plain.clone(),
            specials: self.specials.clone(),
        }
    }

    fn plain_inner(&self) -> &tokenizers::Tokenizer {
        self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        })
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The file this tokenizer was loaded from (or the label it was given).
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Encode `text` to token ids; `add_special_tokens` applies the tokenizer's
    /// post-processor (e.g. a leading BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self.inner.encode(text, add_special_tokens).map_err(|e| {
            Error::Invalid(format!(
                "{}: cannot encode text: {e}",
                self.origin.display()
            ))
        })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Encode `text` as ordinary text: special-token text in it is split like any other text
    /// instead of becoming the special token (`tokenizers`' `encode_special_tokens`).
    /// Non-special added tokens still match, as in [`Tokenizer::encode`].
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.plain_inner().encode(text, false).map_err(|e| {
            Error::Invalid(format!(
                "{}: cannot encode text: {e}",
                self.origin.display()
            ))
        })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Encode a rendered prompt: markup with [`Tokenizer::encode`] (special tokens match),
    /// request text with [`Tokenizer::encode_plain`], concatenated. No special tokens are
    /// added around the whole.
    pub fn encode_parts(&self, parts: &[PromptPart]) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        for part in parts {
            match part {
                PromptPart::Markup(s) => ids.extend(self.encode(s, false)?),
                PromptPart::Plain(s) => ids.extend(self.encode_plain(s)?),
            }
        }
        Ok(ids)
    }

    /// The texts of the special added tokens (control tokens such as `<|im_end|>`): what
    /// [`ChatTemplate::render_parts`](crate::format::chat_template::ChatTemplate::render_parts)
    /// keeps from becoming tokens when it appears in request text.
    pub fn special_token_texts(&self) -> &[String] {
        self.specials.get_or_init(|| {
            let mut texts: Vec<String> = self
                .inner
                .get_added_tokens_decoder()
                .into_values()
                .filter(|t| t.special && !t.content.is_empty())
                .map(|t| t.content)
                .collect();
            texts.sort();
            texts.dedup();
            texts
        })
    }

    /// Decode token ids to text, dropping special tokens when `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| {
            Error::Invalid(format!(
                "{}: cannot decode token ids: {e}",
                self.origin.display()
            ))
        })
    }

    /// The vocabulary size, added (special) tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string (model vocabulary or added token), if any.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id, if the id is in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Write this tokenizer as a `tokenizer.json` at `path` (atomically).
    pub fn save(&self, path: &Path) -> Result<()> {
        let json = self.inner.to_string(true).map_err(|e| {
            Error::Invalid(format!(
                "{}: cannot serialise tokenizer: {e}",
                path.display()
            ))
        })?;
        crate::format::write::write_atomic(path, json.as_bytes())
    }
}

/// Train a byte-level BPE tokenizer on `corpus`, in memory and deterministically.
///
/// GPT-2 style: a `ByteLevel` pre-tokenizer (no prefix space) and decoder, an initial alphabet
/// of all 256 byte-level characters so any text encodes, and merges learned by a
/// `BpeTrainer` until the vocabulary reaches `vocab_size` (special tokens and the alphabet
/// included; fewer if the corpus runs out of pairs). `special_tokens` get the first ids, in
/// order. Fails with [`Error::Invalid`] when `vocab_size` cannot hold the alphabet and the
/// special tokens.
pub fn train_byte_level_bpe(
    corpus: &[&str],
    vocab_size: usize,
    special_tokens: &[&str],
) -> Result<Tokenizer> {
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let minimum = alphabet.len() + special_tokens.len();
    if vocab_size < minimum {
        return Err(Error::Invalid(format!(
            "byte-level BPE: vocab_size {vocab_size} is below {minimum} \
             ({} byte symbols + {} special tokens)",
            alphabet.len(),
            special_tokens.len()
        )));
    }
    let mut seen = HashSet::new();
    for token in special_tokens {
        if token.is_empty() || !seen.insert(*token) {
            return Err(Error::Invalid(format!(
                "byte-level BPE: special token {token:?} is empty or repeated"
            )));
        }
    }

    let mut inner = tokenizers::Tokenizer::new(BPE::default());
    inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    inner.with_decoder(Some(ByteLevel::new(false, true, true)));

    let trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(0)
        .initial_alphabet(alphabet)
        .special_tokens(
            special_tokens
                .iter()
                .map(|t| AddedToken::from(t.to_string(), true))
                .collect(),
        )
        .build();
    let mut trainer = TrainerWrapper::from(trainer);
    inner
        .train(&mut trainer, corpus.iter())
        .map_err(|e| Error::Invalid(format!("byte-level BPE training failed: {e}")))?;
    Ok(Tokenizer::from_inner(inner, "<trained byte-level BPE>"))
}

/// Incremental detokenizer for streamed output.
///
/// Feed it generated ids one at a time; each [`push`](Self::push) returns the text those ids
/// completed. Text is decoded with special tokens skipped. While the decoded text ends in
/// U+FFFD (a UTF-8 character split across byte-level tokens) output is held back, at most
/// for 4 tokens (then it is emitted anyway), so a multi-byte character comes out whole. For a
/// well-formed generation the concatenation of all pushes and [`finish`](Self::finish)
/// equals decoding all ids at once.
///
/// Rather than re-decoding the whole sequence at every step, it decodes a window starting at
/// the tokens of the last emitted piece (the same text as decoding everything when the
/// decoder is context-free across that boundary, which holds for byte-level BPE and for
/// SentencePiece-style decoders, whose leading-space rules the window's prefix absorbs).
#[derive(Debug, Default, Clone)]
pub struct TextStream {
    /// Ids from the start of the decode window on.
    ids: Vec<u32>,
    /// Number of ids in `ids` that were already emitted (the window's context prefix).
    read: usize,
    /// Decoded text of `ids[..read]`.
    prefix: String,
}

impl TextStream {
    /// A stream with nothing pushed yet.
    pub fn new() -> TextStream {
        TextStream::default()
    }

    /// A stream whose first pushed id follows `context` (ids already shown elsewhere, e.g. the
    /// end of an earlier generation of the same conversation): what it returns is the text
    /// that the pushed ids add after `context`, decoded in its context.
    pub fn with_context(tok: &Tokenizer, context: &[u32]) -> Result<TextStream> {
        Ok(TextStream {
            ids: context.to_vec(),
            read: context.len(),
            prefix: tok.decode(context, true)?,
        })
    }

    /// Add one generated id; returns the newly completed text (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tok.decode(&self.ids, true)?;
        let held = self.ids.len() - self.read;
        if text.ends_with(REPLACEMENT) && held <= MAX_HELD_TOKENS {
            return Ok(String::new());
        }
        self.emit(tok, &text)
    }

    /// Flush whatever is still held back (an incomplete character comes out as U+FFFD).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        if self.ids.len() == self.read {
            return Ok(String::new());
        }
        let text = tok.decode(&self.ids, true)?;
        self.emit(tok, &text)
    }

    /// Return `text` (the decoding of the whole window) beyond the prefix, then slide the
    /// window so that the ids just emitted become the new prefix.
    fn emit(&mut self, tok: &Tokenizer, text: &str) -> Result<String> {
        let new = match text.strip_prefix(self.prefix.as_str()) {
            Some(rest) => rest.to_string(),
            None => {
                // The prefix decodes differently in context; this only happens after a
                // forced emission of an incomplete character. Skip what was already
                // emitted by length.
                let mut start = self.prefix.len().min(text.len());
                while !text.is_char_boundary(start) {
                    start += 1;
                }
                text[start..].to_string()
            }
        };
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        // Decode the new prefix on its own: the next window starts with exactly these ids,
        // so decoder rules that depend on position (leading spaces) apply to it the same way.
        self.prefix = tok.decode(&self.ids, true)?;
        Ok(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CORPUS: &[&str] = &[
        "the quick brown fox jumps over the lazy dog",
        "hello world, hello there, hello again",
        "the rain in spain stays mainly in the plain",
        "colibri is a small bird that hovers while it feeds",
        "tokens are pieces of text; pieces of text are tokens",
    ];

    fn trained() -> Tokenizer {
        train_byte_level_bpe(CORPUS, 300, &["<|endoftext|>", "<|im_start|>"]).unwrap()
    }

    #[test]
    fn train_save_reload_round_trip() {
        let tok = trained();
        let vocab = tok.vocab_size();
        assert!(vocab <= 300, "vocab {vocab} over the requested 300");
        assert!(vocab >= 256 + 2, "vocab {vocab} misses bytes or specials");
        assert_eq!(tok.token_to_id("<|endoftext|>"), Some(0));
        assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
        assert_eq!(tok.id_to_token(1).as_deref(), Some("<|im_start|>"));

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        tok.save(&path).unwrap();
        let back = Tokenizer::from_file(&path).unwrap();
        assert_eq!(back.vocab_size(), vocab);

        for text in [
            "hello world",
            "héllo wörld ✓",
            "the  lazy\tdog\n",
            "日本語 🐦",
        ] {
            let ids = back.encode(text, false).unwrap();
            assert_eq!(ids, tok.encode(text, false).unwrap());
            assert_eq!(back.decode(&ids, false).unwrap(), text);
        }
        // Merges were learned: a frequent corpus word takes fewer tokens than bytes.
        let hello = back.encode("hello", false).unwrap();
        assert!(hello.len() < "hello".len(), "no merges learned: {hello:?}");
        // Special tokens are recognised in text and skipped on request.
        let ids = back.encode("<|im_start|>hi", false).unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(back.decode(&ids, true).unwrap(), "hi");
    }

    #[test]
    fn shareable_between_threads() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
        check::<TextStream>();
    }

    #[test]
    fn training_is_deterministic() {
        let a = trained().inner().to_string(false).unwrap();
        let b = trained().inner().to_string(false).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn vocab_too_small_is_rejected() {
        let err = train_byte_level_bpe(CORPUS, 257, &["<a>", "<b>"]).unwrap_err();
        assert!(matches!(err, Error::Invalid(_)), "{err}");
    }

    #[test]
    fn missing_file_is_io_error_naming_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope").join("tokenizer.json");
        let err = Tokenizer::from_file(&path).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        assert!(err.to_string().contains(&path.display().to_string()));
    }

    #[test]
    fn garbage_file_is_corrupt_naming_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, br#"{"model": {"type": "nonsense"}}"#).unwrap();
        let err = Tokenizer::from_file(&path).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains(&path.display().to_string()));
    }

    #[test]
    fn a_strip_decoder_that_panics_when_decoding_is_refused_at_load() {
        // Found by the `tokenizer` fuzz target: Strip with stop > 0 panics in the crate's
        // decode on a token shorter than `stop` (here, inside a Sequence).
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&trained().inner().to_string(false).unwrap()).unwrap();
        let strip = |stop: u64| serde_json::json!({"type": "Strip", "content": " ", "start": 1, "stop": stop});
        json["decoder"] =
            serde_json::json!({"type": "Sequence", "decoders": [{"type": "Fuse"}, strip(5)]});
        std::fs::write(&path, json.to_string()).unwrap();
        let err = Tokenizer::from_file(&path).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string())
                && msg.contains("Strip")
                && msg.contains("\"stop\": 5"),
            "{msg}"
        );
        // Stripping at the start only (Llama's and Mistral's decoders) loads and decodes.
        json["decoder"] =
            serde_json::json!({"type": "Sequence", "decoders": [{"type": "Fuse"}, strip(0)]});
        std::fs::write(&path, json.to_string()).unwrap();
        let tok = Tokenizer::from_file(&path).unwrap();
        let ids = tok.encode("hello world", false).unwrap();
        assert!(!ids.is_empty());
        tok.decode(&ids, false).unwrap();
        // Found by the long fuzz campaign: the crate builds a Strip from any decoder with
        // Strip's fields, whatever its "type" says ("Striz" here); that is refused too.
        json["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Fuse"},
            {"type": "Striz", "content": " ", "start": 1, "stop": 5},
        ]});
        std::fs::write(&path, json.to_string()).unwrap();
        let msg = Tokenizer::from_file(&path).unwrap_err().to_string();
        assert!(
            msg.contains("Strip") && msg.contains("\"stop\": 5"),
            "{msg}"
        );
    }

    #[test]
    fn a_file_the_tokenizers_crate_panics_on_is_an_error() {
        // Well-formed JSON that the crate's normalizer deserializer `expect`s to be a
        // charsmap: it panics inside the crate, and the load returns an error instead.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let mut json: serde_json::Value =
            serde_json::from_str(&trained().inner().to_string(false).unwrap()).unwrap();
        json["normalizer"] = serde_json::json!({"type": "Precompiled", "precompiled_charsmap": 5});
        std::fs::write(&path, json.to_string()).unwrap();
        let err = Tokenizer::from_file(&path).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains("Precompiled"),
            "{msg}"
        );
        // Nesting beyond serde_json's limit is a JSON error naming the file and the place.
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        std::fs::write(&path, deep).unwrap();
        let err = Tokenizer::from_file(&path).unwrap_err();
        assert!(matches!(err, Error::Json { .. }), "{err}");
        assert!(err.to_string().contains("recursion limit"), "{err}");
    }

    #[test]
    fn text_stream_emits_multibyte_characters_whole() {
        let tok = trained();
        let text = "hi ✓ wörld 🐦!";
        let ids = tok.encode(text, false).unwrap();
        // The precondition: the check mark really is split over several byte tokens.
        let check = tok.encode("✓", false).unwrap();
        assert!(check.len() >= 2, "✓ is a single token: {check:?}");

        let mut stream = TextStream::new();
        let mut pieces = Vec::new();
        for &id in &ids {
            pieces.push(stream.push(&tok, id).unwrap());
        }
        pieces.push(stream.finish(&tok).unwrap());
        for piece in &pieces {
            assert!(
                !piece.contains(REPLACEMENT),
                "partial character: {pieces:?}"
            );
        }
        assert!(pieces.iter().any(|p| p.contains('✓')));
        assert!(pieces.iter().any(|p| p.contains('🐦')));
        // Some pushes had to wait for the rest of a character.
        assert!(pieces[..ids.len()].iter().any(|p| p.is_empty()));
        assert_eq!(pieces.concat(), tok.decode(&ids, true).unwrap());
        assert_eq!(pieces.concat(), text);
    }

    #[test]
    fn text_stream_skips_special_tokens_and_flushes_held_bytes() {
        let tok = trained();
        let mut ids = vec![1];
        ids.extend(tok.encode("ok ✓", false).unwrap());
        // Cut the check mark short: its last byte never arrives.
        ids.pop();
        let mut stream = TextStream::new();
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&stream.push(&tok, id).unwrap());
        }
        assert_eq!(out, "ok ");
        out.push_str(&stream.finish(&tok).unwrap());
        assert_eq!(out, tok.decode(&ids, true).unwrap());
        assert!(out.ends_with(REPLACEMENT));
        assert_eq!(stream.finish(&tok).unwrap(), "");
    }

    #[test]
    fn text_stream_with_context_continues_the_text() {
        // A SentencePiece-style decoder drops the leading space of the first token it
        // decodes: text continued after earlier ids must keep it.
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"post_processor":null,
            "pre_tokenizer":{"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true},
            "decoder":{"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true},
            "model":{"type":"WordLevel","vocab":{"▁hello":0,"▁world":1,"▁again":2,"<unk>":3},"unk_token":"<unk>"}}"#;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json).unwrap();
        let tok = Tokenizer::from_file(&path).unwrap();
        let ids = [0, 1, 2, 1];
        let whole = tok.decode(&ids, true).unwrap();
        assert_eq!(whole, "hello world again world");
        for k in 1..ids.len() {
            let mut stream = TextStream::with_context(&tok, &ids[..k]).unwrap();
            let mut text = tok.decode(&ids[..k], true).unwrap();
            for &id in &ids[k..] {
                text.push_str(&stream.push(&tok, id).unwrap());
            }
            text.push_str(&stream.finish(&tok).unwrap());
            assert_eq!(text, whole, "split after {k} ids");
        }
        // Without the context the space is lost.
        assert_eq!(TextStream::new().push(&tok, 1).unwrap(), "world");
    }

    #[test]
    fn text_stream_holdback_is_bounded() {
        let tok = trained();
        // A run of lone continuation bytes never completes a character; after more than
        // MAX_HELD_TOKENS held tokens the stream must emit anyway.
        let cont = tok.encode("✓", false).unwrap();
        let last = *cont.last().unwrap();
        let mut stream = TextStream::new();
        let mut emitted_at = None;
        for step in 0..10 {
            if !stream.push(&tok, last).unwrap().is_empty() {
                emitted_at = Some(step);
                break;
            }
        }
        assert_eq!(emitted_at, Some(MAX_HELD_TOKENS));
    }
}
