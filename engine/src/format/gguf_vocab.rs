//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, built the way
//! llama.cpp builds it, as a [`Tokenizer`] (a `tokenizers::Tokenizer` underneath).
//!
//! This module owns the translation from llama.cpp's vocabulary description to the
//! `tokenizers` crate's pipeline:
//!
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE. The vocabulary is
//!   `tokenizer.ggml.tokens`, the merges `tokenizer.ggml.merges` (`"left right"`, rank = index).
//!   The pre-tokenizer is llama.cpp's list of regexes for `tokenizer.ggml.pre`, applied one
//!   after another, each splitting every piece into matches and the text between them (a
//!   sequence of isolating splits), then the GPT-2 byte-to-unicode mapping.
//!   A few pre types (`gemma4`, `sarvam-moe`, ...) are "SentencePiece-style BPE" instead: spaces
//!   become `▁`, text is split only at newlines, and unknown bytes fall back to `<0xXX>`.
//! - `tokenizer.ggml.model = "gemma4"`: that SentencePiece-style BPE.
//! - `tokenizer.ggml.model = "llama"`: SentencePiece BPE by scores (`tokenizer.ggml.scores`).
//!   llama.cpp repeatedly merges the adjacent pair whose concatenation is a token with the
//!   highest score; we express that as BPE merges ranked by the merged token's score (as
//!   Hugging Face's SentencePiece converter does), with byte fallback to `<0xXX>`, spaces
//!   replaced by `▁` and a `▁` prepended when `tokenizer.ggml.add_space_prefix` (default true).
//!
//! Token types (`tokenizer.ggml.token_type`): control and unknown tokens become special added
//! tokens, user-defined tokens non-special added tokens; all are matched in the raw text
//! before normalization, like llama.cpp's special-token partition. Encoding with
//! `add_special_tokens` adds BOS / EOS as [`special_tokens`] says.
//!
//! Other tokenizer models (`bert`, `t5`, `rwkv`, ...) and pre types whose llama.cpp splitting
//! is hand-written code rather than a regex (`kimi-k2`, `afmoe`, `superbpe`) are
//! [`Error::Unsupported`], naming the model or pre type and the file.

use std::collections::HashMap;
use std::path::Path;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, NormalizerWrapper, SplitDelimiterBehavior};

use crate::error::{Error, Result};
use crate::format::gguf::{GgufArray, GgufFile};
use crate::format::tokenizer::Tokenizer;

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
const KEY_GENERAL_NAME: &str = "general.name";

/// The SentencePiece whitespace marker.
const SPM_SPACE: &str = "\u{2581}";

/// Special-token facts from a GGUF file's metadata, with llama.cpp's defaults per tokenizer
/// model where the metadata is silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgufSpecialTokens {
    /// Beginning-of-sequence token.
    pub bos: Option<u32>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// End-of-turn token: `tokenizer.ggml.eot_token_id`, else found by its text
    /// (`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`, ... — the first of llama.cpp's list present).
    pub eot: Option<u32>,
    /// Whether encoding with special tokens prepends BOS.
    pub add_bos: bool,
    /// Whether encoding with special tokens appends EOS.
    pub add_eos: bool,
}

/// The tokenizer models we know of, as `tokenizer.ggml.model` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum VocabModel {
    /// `llama`: SentencePiece BPE by scores.
    Spm,
    /// `gpt2`: BPE with merges (byte-level, or SentencePiece-style for some pre types).
    Bpe,
    /// `gemma4`: SentencePiece-style BPE with merges.
    Gemma4,
    /// `bert`: WordPiece.
    Wpm,
    /// `t5`: Unigram.
    Ugm,
    /// `rwkv`: greedy trie.
    Rwkv,
    /// `no_vocab` / `none`: no tokenizer.
    None,
}

impl VocabModel {
    fn from_name(name: &str) -> Option<VocabModel> {
        Some(match name {
            "llama" => VocabModel::Spm,
            "gpt2" => VocabModel::Bpe,
            "gemma4" => VocabModel::Gemma4,
            "bert" => VocabModel::Wpm,
            "t5" => VocabModel::Ugm,
            "rwkv" => VocabModel::Rwkv,
            "no_vocab" | "none" => VocabModel::None,
            _ => return None,
        })
    }
}

/// How a BPE pre type splits text, and the defaults that come with it in llama.cpp.
struct PreType {
    /// The `tokenizer.ggml.pre` values that select it.
    names: &'static [&'static str],
    /// Regexes applied in order; each splits every piece into matches and gaps.
    regexes: &'static [&'static str],
    /// A whole pre-token that is itself a vocabulary token is taken as is, without merging.
    ignore_merges: bool,
    /// Default for `add_bos_token`.
    add_bos: bool,
    /// The pre type has no BOS token by default.
    no_bos: bool,
    /// `false`: SentencePiece-style BPE (spaces as `▁`, raw UTF-8, `<0xXX>` byte fallback)
    /// instead of GPT-2 byte-level BPE.
    byte_level: bool,
}

const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_DEEPSEEK3: &str = r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_BLOOM: &str = r" ?[^(\s|.,!?\u{2026}\u{3002}\u{FF0C}\u{3001}\u{964}\u{6D4}\u{60C})]+";
const RE_NEWLINES: &str = r"[^\n]+|[\n]+";
const RE_GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const fn bpe(names: &'static [&'static str], regexes: &'static [&'static str]) -> PreType {
    PreType {
        names,
        regexes,
        ignore_merges: false,
        add_bos: false,
        no_bos: false,
        byte_level: true,
    }
}

const fn ignore_merges(mut p: PreType) -> PreType {
    p.ignore_merges = true;
    p
}

const fn add_bos(mut p: PreType) -> PreType {
    p.add_bos = true;
    p
}

const fn no_bos(mut p: PreType) -> PreType {
    p.no_bos = true;
    p
}

const fn spm_style(mut p: PreType) -> PreType {
    p.byte_level = false;
    p
}

/// llama.cpp's pre types (`llm_tokenizer_bpe` in `llama-vocab.cpp`) that are plain regex lists.
const PRE_TYPES: &[PreType] = &[
    bpe(
        &["default"],
        &[
            r"[\p{P}\$\+<=>\^~\|]+",
            RE_GPT2,
            r"\p{N}+",
            r"[0-9][0-9][0-9]",
        ],
    ),
    add_bos(ignore_merges(bpe(
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ],
        &[RE_LLAMA3],
    ))),
    bpe(&["dbrx", "smaug-bpe"], &[RE_LLAMA3]),
    bpe(
        &["jais-2"],
        &[
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
        ],
    ),
    bpe(
        &["deepseek-llm"],
        &[
            r"[\r\n]",
            r"\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+",
            r"\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+",
            r"\s+$",
            r"[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+",
            r"\p{N}+",
        ],
    ),
    bpe(
        &["deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"],
        &[
            r"\p{N}{1,3}",
            r"[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
            RE_DEEPSEEK3,
        ],
    ),
    bpe(
        &["spark2_5"],
        &[
            r"\p{N}{1,3}",
            r"[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
            r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
            r"\p{N}",
        ],
    ),
    ignore_merges(bpe(
        &["youtu"],
        &[
            r"[\u{AC00}-\u{D7A3}\u{3131}-\u{318E}]+|[\u{FF01}\u{2026}\u{201C}\u{201D}\u{2018}\u{2019}\u{2014}\u{FF1A}\u{FF1B}\u{FF0C}\u{3001}-\u{303F}\u{FE30}-\u{FE4F}]+|[\u{3105}-\u{312F}]+|[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
    )),
    bpe(
        &["deepseek-coder"],
        &[
            r"[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            r"[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+",
            r"\p{N}",
        ],
    ),
    bpe(
        &["falcon"],
        &[r"[\p{P}\$\+<=>\^~\|`]+", RE_GPT2, r"[0-9][0-9][0-9]"],
    ),
    bpe(
        &[
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        &[r"\p{N}", RE_GPT2],
    ),
    bpe(
        &[
            "gpt-2",
            "gpt2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "exaone4",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
        ],
        &[RE_GPT2],
    ),
    bpe(
        &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ],
        &[RE_QWEN2],
    ),
    bpe(
        &["qwen35"],
        &[
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
    ),
    bpe(&["poro-chat", "bloom", "gpt3-finnish"], &[RE_BLOOM]),
    no_bos(bpe(&["chatglm-bpe"], &[RE_LLAMA3])),
    no_bos(ignore_merges(bpe(&["glm4", "glm5"], &[RE_LLAMA3]))),
    bpe(&["viking"], &[RE_BLOOM, r"\p{N}"]),
    add_bos(ignore_merges(bpe(
        &["tekken"],
        &[
            r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
    ))),
    add_bos(bpe(
        &["chameleon"],
        &[
            r"<sentinel:[0-9]+>",
            r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            RE_GPT2,
        ],
    )),
    bpe(
        &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        &[RE_GPT4O],
    ),
    ignore_merges(bpe(
        &["granite-embed-multi-97m"],
        &[
            r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
    )),
    bpe(
        &["tiny_aya", "cohere2moe"],
        &[
            r"\d{1,3}(?=(?:\d{3})*\b)",
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
    ),
    bpe(
        &["bailingmoe", "bailingmoe2", "llada-moe"],
        &[
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        ],
    ),
    bpe(
        &["seed-coder"],
        &[
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
    ),
    bpe(
        &["ufakzeka"],
        &[r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    ),
    bpe(&["laguna"], &[RE_NEWLINES, RE_QWEN2]),
    bpe(
        &["exaone-moe"],
        &[
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
        ],
    ),
    ignore_merges(bpe(
        &["minicpm5"],
        &[
            r"\p{N}{1,3}",
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ],
    )),
    add_bos(spm_style(bpe(
        &["gemma4", "granite-embed-multi-311m"],
        &[RE_NEWLINES],
    ))),
    spm_style(bpe(&["sarvam-moe"], &[RE_NEWLINES])),
];

/// Pre types whose llama.cpp splitting is hand-written code, not a regex list.
const UNSUPPORTED_PRE_TYPES: &[&str] = &["kimi-k2", "afmoe", "superbpe", "whitespace"];

fn find_pre_type(name: &str) -> Option<&'static PreType> {
    PRE_TYPES.iter().find(|p| p.names.contains(&name))
}

/// Every `tokenizer.ggml.pre` value this module builds a tokenizer for.
pub fn supported_pre_types() -> Vec<&'static str> {
    PRE_TYPES
        .iter()
        .flat_map(|p| p.names.iter().copied())
        .collect()
}

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_id(id: i64) -> TokenType {
        match id {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            // 1 is normal; 0 (undefined) and anything else behave as normal text.
            _ => TokenType::Normal,
        }
    }
}

/// Token texts llama.cpp treats as control tokens whatever their type says (end of turn /
/// generation and fill-in-the-middle markers), in its order of preference for end of turn.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

const OTHER_CONTROL_TEXTS: &[&str] = &[
    "<|eom_id|>",
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "[PAD]",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "</s>",
    "[EOS]",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "[e~[",
];

/// Token texts llama.cpp always renders (gpt-oss), made user-defined.
const FORCED_USER_DEFINED_TEXTS: &[&str] =
    &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// The vocabulary part of the metadata, read and checked.
struct GgufVocab<'a> {
    gguf: &'a GgufFile,
    model: VocabModel,
    model_name: String,
    /// Token texts by id (an empty token becomes `[EMPTY_<id>]`, as in llama.cpp).
    tokens: Vec<String>,
    /// Token text → id; a repeated text maps to its last id.
    ids: HashMap<String, u32>,
    types: Vec<TokenType>,
}

impl<'a> GgufVocab<'a> {
    fn path(&self) -> &'a Path {
        self.gguf.path()
    }

    fn read(gguf: &'a GgufFile) -> Result<GgufVocab<'a>> {
        let path = gguf.path();
        let model_name = gguf
            .get_str(KEY_MODEL)?
            .ok_or_else(|| Error::config(path, KEY_MODEL, "missing from the GGUF metadata"))?
            .to_string();
        let model = VocabModel::from_name(&model_name).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: `{KEY_MODEL}` is {model_name:?}, a tokenizer model llama.cpp does not know \
                 of (known: llama, gpt2, gemma4, bert, t5, rwkv, none)",
                path.display()
            ))
        })?;
        let mut tokens = match gguf.get_array(KEY_TOKENS)? {
            None => {
                return Err(Error::config(
                    path,
                    KEY_TOKENS,
                    "missing from the GGUF metadata (the vocabulary)",
                ))
            }
            Some(a) => a
                .as_strings()
                .ok_or_else(|| {
                    Error::config(
                        path,
                        KEY_TOKENS,
                        format!(
                            "is an array of {}, expected strings",
                            a.element_type().name()
                        ),
                    )
                })?
                .to_vec(),
        };
        if u32::try_from(tokens.len()).is_err() {
            return Err(Error::config(
                path,
                KEY_TOKENS,
                format!(
                    "has {} tokens, more than token ids can number",
                    tokens.len()
                ),
            ));
        }
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                *t = format!("[EMPTY_{i}]");
            }
        }
        let n = tokens.len();
        let mut types = vec![TokenType::Normal; n];
        if let Some(a) = gguf.get_array(KEY_TOKEN_TYPE)? {
            let raw = per_token(path, KEY_TOKEN_TYPE, a, integers(a), "integers", n)?;
            for (t, &r) in types.iter_mut().zip(&raw) {
                *t = TokenType::from_id(r);
            }
        }
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut vocab = GgufVocab {
            gguf,
            model,
            model_name,
            tokens,
            ids,
            types,
        };
        vocab.fix_types_by_text();
        Ok(vocab)
    }

    /// llama.cpp's corrections of token types by token text.
    fn fix_types_by_text(&mut self) {
        for text in EOT_TEXTS.iter().chain(OTHER_CONTROL_TEXTS) {
            if let Some(&id) = self.ids.get(*text) {
                self.types[id as usize] = TokenType::Control;
            }
        }
        for text in FORCED_USER_DEFINED_TEXTS {
            if let Some(&id) = self.ids.get(*text) {
                self.types[id as usize] = TokenType::UserDefined;
            }
        }
        // o200k_harmony / solar-open: `<|end|>` is not the end of generation there.
        let has = |t: &str| self.ids.contains_key(t);
        if (has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>")) {
            if let Some(&id) = self.ids.get("<|end|>") {
                self.types[id as usize] = TokenType::UserDefined;
            }
        }
        // gemma4 / plamo: `</s>` is a normal token.
        if has("<|tool_response>") || has("<|plamo:eos|>") {
            if let Some(&id) = self.ids.get("</s>") {
                self.types[id as usize] = TokenType::Normal;
            }
        }
    }

    /// A token id from the metadata, or `default`; an id out of range falls back to the
    /// default (and a default out of range is none), as in llama.cpp.
    fn token_id(&self, key: &str, default: Option<u32>) -> Result<Option<u32>> {
        let n = self.tokens.len() as u64;
        let default = default.filter(|&d| u64::from(d) < n);
        Ok(match self.gguf.get_u64(key)? {
            Some(id) if id < n => Some(id as u32),
            _ => default,
        })
    }

    fn pre_name(&self) -> Result<Option<&'a str>> {
        self.gguf.get_str(KEY_PRE)
    }

    /// The pre type of a BPE vocabulary.
    fn pre_type(&self) -> Result<&'static PreType> {
        if self.model == VocabModel::Gemma4 {
            return Ok(find_pre_type("gemma4").expect("gemma4 is in PRE_TYPES"));
        }
        let name = self.pre_name()?.unwrap_or("default");
        find_pre_type(name).ok_or_else(|| {
            let why = if UNSUPPORTED_PRE_TYPES.contains(&name) {
                "its llama.cpp splitting is hand-written code, not a regex list"
            } else {
                "unknown pre-tokenizer type"
            };
            Error::Unsupported(format!(
                "{}: `{KEY_PRE}` = {name:?}: {why}; supported: {}",
                self.path().display(),
                supported_pre_types().join(", ")
            ))
        })
    }

    fn unsupported_model(&self) -> Error {
        Error::Unsupported(format!(
            "{}: tokenizer model {:?} (`{KEY_MODEL}`) is not supported; supported: llama \
             (SentencePiece BPE), gpt2 (BPE), gemma4",
            self.path().display(),
            self.model_name
        ))
    }
}

/// The elements of an integer array as `i64`.
/// The per-token array `a` under `key`, read as `values` (`None`: its elements are not
/// `expected`); an error unless it has an entry for each of the `n` tokens.
fn per_token<T>(
    path: &Path,
    key: &str,
    a: &GgufArray,
    values: Option<Vec<T>>,
    expected: &str,
    n: usize,
) -> Result<Vec<T>> {
    let v = values.ok_or_else(|| {
        Error::config(
            path,
            key,
            format!(
                "is an array of {}, expected {expected}",
                a.element_type().name()
            ),
        )
    })?;
    if v.len() < n {
        return Err(Error::config(
            path,
            key,
            format!("has {} entries for {n} tokens", v.len()),
        ));
    }
    Ok(v)
}

fn integers(a: &GgufArray) -> Option<Vec<i64>> {
    match a {
        GgufArray::I8(v) => Some(v.iter().map(|&x| x.into()).collect()),
        GgufArray::I16(v) => Some(v.iter().map(|&x| x.into()).collect()),
        GgufArray::I32(v) => Some(v.iter().map(|&x| x.into()).collect()),
        GgufArray::I64(v) => Some(v.clone()),
        _ => a
            .to_u64s()
            .map(|v| v.into_iter().map(|x| x as i64).collect()),
    }
}

/// Read the special-token facts of a GGUF file: BOS / EOS / EOT ids and whether encoding adds
/// BOS / EOS, with llama.cpp's defaults for the tokenizer model (and BPE pre type) where the
/// metadata does not say. Errors name the file and key; an unknown tokenizer model is
/// [`Error::Unsupported`].
pub fn special_tokens(gguf: &GgufFile) -> Result<GgufSpecialTokens> {
    let vocab = GgufVocab::read(gguf)?;
    special_tokens_of(&vocab)
}

fn special_tokens_of(vocab: &GgufVocab<'_>) -> Result<GgufSpecialTokens> {
    // (bos, eos, add_bos, add_eos) defaults per model, from llama_vocab::impl::load.
    let (mut bos, eos, mut add_bos, add_eos) = match vocab.model {
        VocabModel::Spm => (Some(1), Some(2), true, false),
        VocabModel::Bpe => (Some(11), Some(11), false, false),
        VocabModel::Gemma4 => (None, None, true, false),
        VocabModel::Wpm => (Some(101), None, true, false),
        VocabModel::Ugm => (None, Some(1), false, true),
        VocabModel::Rwkv | VocabModel::None => (None, None, false, false),
    };
    if matches!(vocab.model, VocabModel::Bpe | VocabModel::Gemma4) {
        // An unknown pre type has no special defaults; the tokenizer itself reports it.
        if let Ok(pre) = vocab.pre_type() {
            add_bos |= pre.add_bos;
            if pre.no_bos {
                bos = None;
            }
        }
    }
    let bos = vocab.token_id(KEY_BOS, bos)?;
    let eos = vocab.token_id(KEY_EOS, eos)?;
    let mut eot = vocab.token_id(KEY_EOT, None)?;
    if eot.is_none() {
        eot = EOT_TEXTS.iter().find_map(|t| vocab.ids.get(*t).copied());
    }
    let gguf = vocab.gguf;
    let mut add_bos = gguf.get_bool(KEY_ADD_BOS)?.unwrap_or(add_bos);
    let add_eos = gguf.get_bool(KEY_ADD_EOS)?.unwrap_or(add_eos);
    if vocab.model == VocabModel::Gemma4 {
        // llama.cpp forces BOS for Gemma 4 whatever the metadata says.
        add_bos = true;
    }
    Ok(GgufSpecialTokens {
        bos,
        eos,
        eot,
        add_bos,
        add_eos,
    })
}

/// Build the tokenizer a GGUF file describes (`tokenizer.ggml.*` metadata), tokenizing as
/// llama.cpp does. Missing or malformed metadata is an error naming the file and key; a
/// tokenizer model or pre type we cannot express is [`Error::Unsupported`].
pub fn tokenizer_from_gguf(gguf: &GgufFile) -> Result<Tokenizer> {
    let vocab = GgufVocab::read(gguf)?;
    let path = gguf.path();
    let specials = special_tokens_of(&vocab)?;
    let mut inner = match vocab.model {
        VocabModel::Spm => spm_tokenizer(&vocab)?,
        VocabModel::Bpe | VocabModel::Gemma4 => bpe_tokenizer(&vocab)?,
        _ => return Err(vocab.unsupported_model()),
    };
    add_special_tokens(&vocab, &mut inner)?;
    if let Some(pp) = post_processor(&vocab, &specials)? {
        inner.with_post_processor(Some(pp));
    }
    Ok(Tokenizer::from_inner(inner, path))
}

fn lib_error(vocab: &GgufVocab<'_>, what: &str, e: impl std::fmt::Display) -> Error {
    Error::corrupt(
        vocab.path(),
        format!("cannot build the tokenizer's {what}: {e}"),
    )
}

/// The token-text → id map the `tokenizers` BPE model takes.
fn bpe_vocab(vocab: &GgufVocab<'_>) -> Vocab {
    vocab.ids.iter().map(|(t, &i)| (t.clone(), i)).collect()
}

/// Byte-level (or SentencePiece-style) BPE with the GGUF merges.
fn bpe_tokenizer(vocab: &GgufVocab<'_>) -> Result<tokenizers::Tokenizer> {
    let path = vocab.path();
    let pre = vocab.pre_type()?;
    let merges_array = vocab
        .gguf
        .get_array(KEY_MERGES)?
        .ok_or_else(|| Error::config(path, KEY_MERGES, "missing from the GGUF metadata"))?;
    let merge_strings = merges_array.as_strings().ok_or_else(|| {
        Error::config(
            path,
            KEY_MERGES,
            format!(
                "is an array of {}, expected strings",
                merges_array.element_type().name()
            ),
        )
    })?;
    let mut merges = Vec::with_capacity(merge_strings.len());
    for (i, m) in merge_strings.iter().enumerate() {
        // llama.cpp splits at the first space after the first byte.
        let space = m
            .as_bytes()
            .iter()
            .skip(1)
            .position(|&b| b == b' ')
            .map(|p| p + 1)
            .ok_or_else(|| {
                Error::config(
                    path,
                    KEY_MERGES,
                    format!("entry {i} ({m:?}) is not two tokens separated by a space"),
                )
            })?;
        let (left, right) = (&m[..space], &m[space + 1..]);
        // A merge that cannot produce a vocabulary token never yields a token in llama.cpp
        // either (its pieces end up as bytes); the `tokenizers` BPE model refuses such merges.
        if vocab.ids.contains_key(left)
            && vocab.ids.contains_key(right)
            && vocab.ids.contains_key(&format!("{left}{right}"))
        {
            merges.push((left.to_string(), right.to_string()));
        }
    }
    let mut builder = BPE::builder()
        .vocab_and_merges(bpe_vocab(vocab), merges)
        .ignore_merges(pre.ignore_merges);
    if !pre.byte_level {
        builder = builder.byte_fallback(true);
    }
    let model = builder
        .build()
        .map_err(|e| lib_error(vocab, "BPE model", e))?;
    let mut tok = tokenizers::Tokenizer::new(model);

    let mut pre_tokenizers = Vec::with_capacity(pre.regexes.len() + 1);
    for re in pre.regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| lib_error(vocab, &format!("pre-tokenizer regex {re:?}"), e))?;
        pre_tokenizers.push(PreTokenizerWrapper::Split(split));
    }
    if pre.byte_level {
        pre_tokenizers.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, true, false,
        )));
        tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(
            false, true, false,
        ))));
    } else {
        let escape = Replace::new(" ", SPM_SPACE).map_err(|e| lib_error(vocab, "normalizer", e))?;
        tok.with_normalizer(Some(NormalizerWrapper::Replace(escape)))
            .map_err(|e| lib_error(vocab, "normalizer", e))?;
        tok.with_decoder(Some(spm_decoder(vocab, false)?));
    }
    tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(
        PreTokenizerSequence::new(pre_tokenizers),
    )));
    Ok(tok)
}

/// Decoder for `▁`-spaced vocabularies with `<0xXX>` byte tokens.
fn spm_decoder(vocab: &GgufVocab<'_>, strip_prefix: bool) -> Result<DecoderWrapper> {
    let unescape = Replace::new(SPM_SPACE, " ").map_err(|e| lib_error(vocab, "decoder", e))?;
    let mut steps = vec![
        DecoderWrapper::Replace(unescape),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if strip_prefix {
        steps.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    Ok(DecoderWrapper::Sequence(DecoderSequence::new(steps)))
}

/// SentencePiece BPE by scores, as BPE merges ranked by the merged token's score.
fn spm_tokenizer(vocab: &GgufVocab<'_>) -> Result<tokenizers::Tokenizer> {
    let path = vocab.path();
    let n = vocab.tokens.len();
    let scores = match vocab.gguf.get_array(KEY_SCORES)? {
        None => vec![0.0; n],
        Some(a) => {
            let s = per_token(path, KEY_SCORES, a, a.to_f64s(), "numbers", n)?;
            // llama.cpp keeps scores as f32.
            s.into_iter().map(|x| x as f32).collect()
        }
    };
    let add_space_prefix = vocab.gguf.get_bool(KEY_ADD_SPACE_PREFIX)?.unwrap_or(true);

    // Every way to write a token as two tokens is a merge; llama.cpp merges the pair whose
    // concatenation has the highest score first (ties: leftmost), so rank by score.
    let mut merges: Vec<(u32, u32, f32)> = Vec::new();
    for (id, piece) in vocab.tokens.iter().enumerate() {
        if vocab.ids.get(piece) != Some(&(id as u32)) {
            continue; // a repeated text: only its last id is reachable
        }
        let start = merges.len();
        for (split, _) in piece.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (
                vocab.ids.get(&piece[..split]),
                vocab.ids.get(&piece[split..]),
            ) {
                merges.push((l, r, scores[id]));
            }
        }
        merges[start..].sort_by_key(|&(l, r, _)| (l, r));
    }
    merges.sort_by(|a, b| b.2.total_cmp(&a.2));
    let merges = merges
        .into_iter()
        .map(|(l, r, _)| {
            (
                vocab.tokens[l as usize].clone(),
                vocab.tokens[r as usize].clone(),
            )
        })
        .collect();

    let mut builder = BPE::builder()
        .vocab_and_merges(bpe_vocab(vocab), merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = vocab.token_id(KEY_UNK, Some(0))? {
        builder = builder.unk_token(vocab.tokens[unk as usize].clone());
    }
    let model = builder
        .build()
        .map_err(|e| lib_error(vocab, "BPE model", e))?;
    let mut tok = tokenizers::Tokenizer::new(model);

    let escape = Replace::new(" ", SPM_SPACE).map_err(|e| lib_error(vocab, "normalizer", e))?;
    let normalizer = if add_space_prefix {
        NormalizerWrapper::Sequence(NormalizerSequence::new(vec![
            NormalizerWrapper::Prepend(Prepend::new(SPM_SPACE.to_string())),
            NormalizerWrapper::Replace(escape),
        ]))
    } else {
        NormalizerWrapper::Replace(escape)
    };
    tok.with_normalizer(Some(normalizer))
        .map_err(|e| lib_error(vocab, "normalizer", e))?;
    tok.with_decoder(Some(spm_decoder(vocab, add_space_prefix)?));
    Ok(tok)
}

/// Control and unknown tokens become special added tokens, user-defined tokens plain added
/// tokens, all matched against the raw text (llama.cpp's special-token partition).
fn add_special_tokens(vocab: &GgufVocab<'_>, tok: &mut tokenizers::Tokenizer) -> Result<()> {
    let general_name = vocab
        .gguf
        .get_str(KEY_GENERAL_NAME)
        .ok()
        .flatten()
        .unwrap_or("")
        .to_lowercase();
    let pre_name = vocab.pre_name().ok().flatten().unwrap_or("");
    // llama.cpp's per-model token attributes.
    let phi3 = general_name.contains("phi-3") || general_name.contains("phi3");
    let jina_mask = ["jina-v2-de", "jina-v2-es", "jina-v2-code"]
        .iter()
        .any(|p| pre_name.contains(p));

    let mut special = Vec::new();
    let mut plain = Vec::new();
    for (id, (text, &ty)) in vocab.tokens.iter().zip(&vocab.types).enumerate() {
        let is_special = match ty {
            TokenType::Control | TokenType::Unknown => true,
            TokenType::UserDefined => false,
            _ => continue,
        };
        if vocab.ids.get(text) != Some(&(id as u32)) {
            continue;
        }
        let mut rstrip = false;
        if phi3 {
            rstrip = !matches!(text.as_str(), "<unk>" | "<s>" | "<|endoftext|>");
        }
        let lstrip = jina_mask && text == "<mask>";
        let token = AddedToken::from(text.clone(), is_special)
            .normalized(false)
            .rstrip(rstrip)
            .lstrip(lstrip);
        if is_special {
            special.push(token);
        } else {
            plain.push(token);
        }
    }
    tok.add_special_tokens(special)
        .map_err(|e| lib_error(vocab, "special tokens", e))?;
    tok.add_tokens(plain)
        .map_err(|e| lib_error(vocab, "user-defined tokens", e))?;
    Ok(())
}

/// A template adding BOS / EOS around each sequence, if the vocabulary adds either.
fn post_processor(
    vocab: &GgufVocab<'_>,
    specials: &GgufSpecialTokens,
) -> Result<Option<PostProcessorWrapper>> {
    if !specials.add_bos && !specials.add_eos {
        return Ok(None);
    }
    let path = vocab.path();
    let require = |wanted: bool, id: Option<u32>, flag: &str, key: &str| -> Result<Option<u32>> {
        match (wanted, id) {
            (false, _) => Ok(None),
            (true, Some(id)) => Ok(Some(id)),
            (true, None) => Err(Error::config(
                path,
                key,
                format!("`{flag}` is true but the vocabulary has no such token"),
            )),
        }
    };
    let bos = require(specials.add_bos, specials.bos, KEY_ADD_BOS, KEY_BOS)?;
    let eos = require(specials.add_eos, specials.eos, KEY_ADD_EOS, KEY_EOS)?;
    let piece = |id: u32| serde_json::json!({"SpecialToken": {"id": vocab.tokens[id as usize], "type_id": 0}});
    let template = |seq: &str, type_id: u32| {
        let mut t = Vec::new();
        t.extend(bos.map(piece));
        t.push(serde_json::json!({"Sequence": {"id": seq, "type_id": type_id}}));
        t.extend(eos.map(piece));
        t
    };
    let mut single = template("A", 0);
    let mut pair = single.clone();
    pair.extend(template("B", 1));
    let mut special_tokens = serde_json::Map::new();
    for id in bos.into_iter().chain(eos) {
        let text = &vocab.tokens[id as usize];
        special_tokens.insert(
            text.clone(),
            serde_json::json!({"id": text, "ids": [id], "tokens": [text]}),
        );
    }
    let json = serde_json::json!({
        "type": "TemplateProcessing",
        "single": std::mem::take(&mut single),
        "pair": pair,
        "special_tokens": special_tokens,
    });
    serde_json::from_value(json)
        .map(Some)
        .map_err(|e| lib_error(vocab, "post-processor", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::gguf::{GgufValue, GgufWriter};

    fn strings(v: &[&str]) -> GgufValue {
        GgufValue::Array(GgufArray::String(v.iter().map(|s| s.to_string()).collect()))
    }

    /// A tiny byte-level BPE vocabulary: the bytes "a", "b", "Ġ" and the merge "a b".
    fn gpt2_metadata() -> Vec<(String, GgufValue)> {
        vec![
            (
                "general.architecture".into(),
                GgufValue::String("gpt2".into()),
            ),
            (KEY_MODEL.into(), GgufValue::String("gpt2".into())),
            (KEY_PRE.into(), GgufValue::String("gpt-2".into())),
            (
                KEY_TOKENS.into(),
                strings(&["a", "b", "ab", "Ġ", "<|endoftext|>"]),
            ),
            (
                KEY_TOKEN_TYPE.into(),
                GgufValue::Array(GgufArray::I32(vec![1, 1, 1, 1, 3])),
            ),
            (KEY_MERGES.into(), strings(&["a b"])),
            (KEY_BOS.into(), GgufValue::U32(4)),
            (KEY_EOS.into(), GgufValue::U32(4)),
        ]
    }

    fn with(
        mut meta: Vec<(String, GgufValue)>,
        key: &str,
        value: Option<GgufValue>,
    ) -> Vec<(String, GgufValue)> {
        meta.retain(|(k, _)| k != key);
        if let Some(v) = value {
            meta.push((key.to_string(), v));
        }
        meta
    }

    /// The GPT-2 metadata with the string `value` under `key`.
    fn gpt2_with_string(key: &str, value: &str) -> Vec<(String, GgufValue)> {
        with(gpt2_metadata(), key, Some(GgufValue::String(value.into())))
    }

    fn open(dir: &tempfile::TempDir, meta: &[(String, GgufValue)]) -> GgufFile {
        let path = dir.path().join("vocab.gguf");
        GgufWriter::create(&path, meta, vec![])
            .unwrap()
            .finish()
            .unwrap();
        GgufFile::open(&path).unwrap()
    }

    fn build_err(meta: &[(String, GgufValue)]) -> String {
        let dir = tempfile::tempdir().unwrap();
        let gguf = open(&dir, meta);
        let err = tokenizer_from_gguf(&gguf).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("vocab.gguf"), "no file in {msg:?}");
        msg
    }

    #[test]
    fn tiny_gpt2_vocab_encodes_and_decodes() {
        let dir = tempfile::tempdir().unwrap();
        let gguf = open(&dir, &gpt2_metadata());
        let tok = tokenizer_from_gguf(&gguf).unwrap();
        assert_eq!(tok.encode("ab a", false).unwrap(), vec![2, 3, 0]);
        assert_eq!(tok.decode(&[2, 3, 0], false).unwrap(), "ab a");
        let sp = special_tokens(&gguf).unwrap();
        assert_eq!(
            sp,
            GgufSpecialTokens {
                bos: Some(4),
                eos: Some(4),
                eot: Some(4),
                add_bos: false,
                add_eos: false
            }
        );
        // Metadata turns BOS on; encoding with special tokens adds it.
        let meta = with(gpt2_metadata(), KEY_ADD_BOS, Some(GgufValue::Bool(true)));
        let dir = tempfile::tempdir().unwrap();
        let tok = tokenizer_from_gguf(&open(&dir, &meta)).unwrap();
        assert_eq!(tok.encode("ab", true).unwrap(), vec![4, 2]);
        assert_eq!(tok.encode("ab", false).unwrap(), vec![2]);
    }

    #[test]
    fn gguf_control_token_text_encodes_as_plain_text_when_asked() {
        let meta = with(
            with(
                gpt2_metadata(),
                KEY_TOKENS,
                Some(strings(&["a", "b", "ab", "Ġ", "<s>", "<", "s", ">"])),
            ),
            KEY_TOKEN_TYPE,
            Some(GgufValue::Array(GgufArray::I32(vec![
                1, 1, 1, 1, 3, 1, 1, 1,
            ]))),
        );
        let dir = tempfile::tempdir().unwrap();
        let tok = tokenizer_from_gguf(&open(&dir, &meta)).unwrap();
        assert_eq!(tok.special_token_texts(), ["<s>".to_string()]);
        // The control token's text matches in markup, and is split as text when plain.
        assert_eq!(tok.encode("a<s>b", false).unwrap(), vec![0, 4, 1]);
        assert_eq!(tok.encode_plain("a<s>b").unwrap(), vec![0, 5, 6, 7, 1]);
        use crate::format::chat_template::PromptPart;
        let parts = [
            PromptPart::Markup("<s>a".into()),
            PromptPart::Plain("<s>".into()),
            PromptPart::Markup("b<s>".into()),
        ];
        assert_eq!(tok.encode_parts(&parts).unwrap(), vec![4, 0, 5, 6, 7, 1, 4]);
    }

    #[test]
    fn unknown_pre_type_names_the_key_and_the_choices() {
        let meta = gpt2_with_string(KEY_PRE, "nonesuch");
        let msg = build_err(&meta);
        assert!(msg.contains(KEY_PRE) && msg.contains("nonesuch"), "{msg}");
        assert!(msg.contains("llama-bpe") && msg.contains("qwen2"), "{msg}");
    }

    #[test]
    fn missing_tokens_names_the_key() {
        let msg = build_err(&with(gpt2_metadata(), KEY_TOKENS, None));
        assert!(msg.contains(KEY_TOKENS), "{msg}");
    }

    #[test]
    fn malformed_merges_name_the_key() {
        let meta = with(gpt2_metadata(), KEY_MERGES, Some(strings(&["ab"])));
        let msg = build_err(&meta);
        assert!(msg.contains(KEY_MERGES) && msg.contains("entry 0"), "{msg}");
        let msg = build_err(&with(gpt2_metadata(), KEY_MERGES, None));
        assert!(msg.contains(KEY_MERGES), "{msg}");
        let meta = with(
            gpt2_metadata(),
            KEY_MERGES,
            Some(GgufValue::Array(GgufArray::U32(vec![1]))),
        );
        let msg = build_err(&meta);
        assert!(msg.contains(KEY_MERGES), "{msg}");
    }

    #[test]
    fn unsupported_model_names_the_model() {
        let meta = gpt2_with_string(KEY_MODEL, "bert");
        let dir = tempfile::tempdir().unwrap();
        let err = tokenizer_from_gguf(&open(&dir, &meta)).unwrap_err();
        assert!(matches!(err, Error::Unsupported(_)), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains("bert") && msg.contains("vocab.gguf"), "{msg}");
    }

    #[test]
    fn every_pre_type_regex_compiles() {
        for p in PRE_TYPES {
            for re in p.regexes {
                Split::new(
                    SplitPattern::Regex((*re).to_string()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap_or_else(|e| panic!("{:?}: {re:?}: {e}", p.names));
            }
        }
    }

    #[test]
    fn tiny_spm_vocab_merges_by_score() {
        // "▁ab" can be "▁a" + "b" (score of ▁ab) — the highest-scoring merge wins first.
        let tokens = [
            "<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab", "<0x21>",
        ];
        let types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 6];
        let scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -5.0, -4.0, -6.0, 0.0];
        let meta = vec![
            (
                "general.architecture".into(),
                GgufValue::String("llama".into()),
            ),
            (KEY_MODEL.into(), GgufValue::String("llama".into())),
            (KEY_TOKENS.into(), strings(&tokens)),
            (
                KEY_TOKEN_TYPE.into(),
                GgufValue::Array(GgufArray::I32(types.to_vec())),
            ),
            (
                KEY_SCORES.into(),
                GgufValue::Array(GgufArray::F32(scores.to_vec())),
            ),
        ];
        let dir = tempfile::tempdir().unwrap();
        let gguf = open(&dir, &meta);
        let tok = tokenizer_from_gguf(&gguf).unwrap();
        // "ab" (-4) merges before "▁a" (-5): ▁ + ab, then ▁ab.
        assert_eq!(tok.encode("ab!", false).unwrap(), vec![8, 9]);
        assert_eq!(tok.encode("ab", true).unwrap(), vec![1, 8]);
        assert_eq!(tok.decode(&[8, 9], false).unwrap(), "ab!");
        let sp = special_tokens(&gguf).unwrap();
        assert_eq!(
            (sp.bos, sp.eos, sp.add_bos, sp.add_eos),
            (Some(1), Some(2), true, false)
        );
    }
}
