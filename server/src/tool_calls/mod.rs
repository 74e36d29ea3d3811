//! Reading tool calls and reasoning out of generated text, in each model family's own format.
//! This module owns
//!
//! - the formats ([`ToolCallFormat`]): Hermes/Qwen (`<tool_call>{json}</tool_call>`),
//!   Qwen3-Coder's XML, DeepSeek-V3/R1 and V3.1 (`<｜tool▁calls▁begin｜>…`), DeepSeek-V3.2/V4
//!   DSML, Kimi K2 (`<|tool_calls_section_begin|>…`) and K3 (`<|open|>call …`), GLM-4.5+ (`<arg_key>`/`<arg_value>`),
//!   MiniMax-M2 (`<minimax:tool_call>`), gpt-oss harmony (channels) and Inkling (typed
//!   content blocks), one file each: its tags, how a call's text reads, the grammar that forces
//!   one call;
//! - which format a model writes ([`Syntax::resolve`]: the configuration, else how the chat
//!   template renders a tool call, else the model type) and which special tokens must reach
//!   the text for it ([`keep_tags_as_text`]);
//! - the two streaming drivers every format runs on (`blocks`: calls as tagged blocks after a
//!   `<think>` thought; `messages`: typed messages, harmony and Inkling), behind one reader
//!   ([`ChatStream`]) that the server feeds generated text to and that gives reasoning,
//!   content and whole calls ([`Parsed`]), holding back anything that could still be a tag;
//! - the Lark grammar that forces one call in the format ([`required_tool_call_grammar`]).
//!
//! Content and reasoning are trimmed: the text a reader gives has no leading or trailing
//! whitespace, whatever pieces it came in, so concatenating a stream's events always gives the
//! same result as reading the whole text at once. A call the model wrote that does not parse
//! is returned as text (with a warning), never an error.

mod blocks;
mod deepseek;
mod glm;
mod grammar;
mod harmony;
mod hermes;
mod inkling;
mod kimi;
mod messages;
mod minimax;
mod qwen3_coder;
mod reasoning;
mod text;
mod values;

#[cfg(test)]
mod testing;

use std::collections::HashMap;
use std::sync::Arc;

use colibri::format::chat_template::ChatTemplate;
use colibri::format::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

pub use grammar::required_tool_call_grammar;
use reasoning::prompt_opens_thought;

use blocks::{BlockFormat, BlockStream};
use messages::{MessageFormat, MessageStream};
use reasoning::{ReasoningEvent, ReasoningStream};

/// One parsed call, OpenAI-shaped pieces.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// `{id_prefix}_{n}`, where n counts the calls of one completion from 0.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// JSON text of the arguments object, compact.
    pub arguments: String,
}

/// A call as its format reads it: the function and its arguments.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RawCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

/// Numbers a completion's calls: `{prefix}_0`, `{prefix}_1`, …
#[derive(Debug, Clone)]
pub(crate) struct Ids {
    prefix: String,
    next: usize,
}

impl Ids {
    fn new(prefix: &str) -> Ids {
        Ids {
            prefix: prefix.to_string(),
            next: 0,
        }
    }

    /// The next call's OpenAI form.
    fn call(&mut self, raw: RawCall) -> ToolCall {
        let id = format!("{}_{}", self.prefix, self.next);
        self.next += 1;
        ToolCall {
            id,
            name: raw.name,
            arguments: Value::Object(raw.arguments).to_string(),
        }
    }
}

/// The parameter schemas of a request's functions, by name: what the XML-style formats type
/// the values they write as text by.
#[derive(Debug, Default)]
pub struct Tools {
    params: HashMap<String, Value>,
}

impl Tools {
    /// The functions of an OpenAI `tools` array (entries that are not functions are skipped).
    pub fn new(tools: &[Value]) -> Tools {
        let params = tools
            .iter()
            .filter_map(|t| t.get("function"))
            .filter_map(|f| {
                let name = f.get("name")?.as_str()?.to_string();
                Some((name, f.get("parameters").cloned().unwrap_or(Value::Null)))
            })
            .collect();
        Tools { params }
    }

    /// The schema of `function`'s parameter `name`, when the function declares it.
    pub(crate) fn parameter(&self, function: &str, name: &str) -> Option<&Value> {
        self.params
            .get(function)?
            .get("properties")?
            .as_object()?
            .get(name)
    }
}

/// The tool-call formats (`tool_call_format`; `auto` picks the model's own, see
/// [`Syntax::resolve`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum ToolCallFormat {
    /// The model's own format, from its chat template or else its model type.
    #[default]
    Auto,
    /// Hermes/Qwen: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
    Hermes,
    /// Qwen3-Coder: `<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`.
    Qwen3Coder,
    /// DeepSeek-V3/R1: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and a ```json block.
    DeepseekV3,
    /// DeepSeek-V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>`.
    DeepseekV31,
    /// DeepSeek-V3.2 DSML: `<｜DSML｜function_calls>` with `<｜DSML｜invoke>` and parameters.
    DeepseekV32,
    /// DeepSeek-V4 DSML: as V3.2, in `<｜DSML｜tool_calls>`.
    DeepseekV4,
    /// Kimi K2: `<|tool_call_begin|>functions.NAME:i<|tool_call_argument_begin|>{json}`.
    KimiK2,
    /// Kimi K3: `<|open|>call tool="NAME"<|sep|><|open|>argument key="K" type="T"<|sep|>V…`.
    KimiK3,
    /// GLM-4.5 and later: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`.
    Glm45,
    /// MiniMax-M2: `<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>`.
    MinimaxM2,
    /// gpt-oss harmony: channels (`analysis`, `commentary to=functions.NAME`, `final`).
    Harmony,
    /// Inkling: typed blocks (`<|content_thinking|>`, `<|content_invoke_tool_json|>`, …).
    Inkling,
}

/// How reasoning is read (`reasoning_format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum ReasoningFormat {
    /// The tool-call format's own: `<think>…</think>`, or harmony's analysis channel and
    /// Inkling's thinking blocks.
    #[default]
    Auto,
    /// Reasoning is not split off: thoughts stay in the content as the model wrote them.
    None,
}

/// The two shapes of formats.
enum Shape {
    Blocks(&'static BlockFormat),
    Messages(&'static MessageFormat),
}

/// How one model writes calls and thoughts: its format (never `auto`) and whether thoughts
/// are split off into `reasoning_content`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Syntax {
    pub format: ToolCallFormat,
    pub reasoning: bool,
}

impl Default for Syntax {
    fn default() -> Syntax {
        Syntax {
            format: ToolCallFormat::Hermes,
            reasoning: true,
        }
    }
}

/// The name of the function the format probe calls (see [`detect_from_template`]).
const PROBE_FN: &str = "probe_function";

impl Syntax {
    /// The syntax to read a model with: `format` unless it is `auto`, else the format the chat
    /// template writes a tool call in ([`detect_from_template`]), else the one of its
    /// `model_type` ([`format_of_model_type`]); reasoning unless `reasoning` is `none`.
    pub fn resolve(
        format: ToolCallFormat,
        reasoning: ReasoningFormat,
        template: Option<&ChatTemplate>,
        model_type: &str,
    ) -> Syntax {
        let format = match format {
            ToolCallFormat::Auto => template
                .and_then(detect_from_template)
                .unwrap_or_else(|| format_of_model_type(model_type)),
            f => f,
        };
        Syntax {
            format,
            reasoning: reasoning != ReasoningFormat::None,
        }
    }

    /// When `prompt` leaves the model inside a thought of this syntax: the text that closes
    /// it (for a constrained answer, which cannot think first: as templates close the thought
    /// when thinking is switched off).
    pub fn thought_closer(&self, prompt: &str) -> Option<String> {
        match self.shape() {
            Shape::Blocks(f) if prompt_opens_thought(prompt, f.think[0]) => {
                Some(format!("{}\n\n", f.think[1]))
            }
            _ => None,
        }
    }

    fn shape(&self) -> Shape {
        match self.format {
            ToolCallFormat::Auto | ToolCallFormat::Hermes => Shape::Blocks(&hermes::FORMAT),
            ToolCallFormat::Qwen3Coder => Shape::Blocks(&qwen3_coder::FORMAT),
            ToolCallFormat::DeepseekV3 | ToolCallFormat::DeepseekV31 => {
                Shape::Blocks(&deepseek::FORMAT)
            }
            ToolCallFormat::DeepseekV32 => Shape::Blocks(&deepseek::DSML_V32.format),
            ToolCallFormat::DeepseekV4 => Shape::Blocks(&deepseek::DSML_V4.format),
            ToolCallFormat::KimiK2 => Shape::Blocks(&kimi::FORMAT),
            ToolCallFormat::KimiK3 => Shape::Blocks(&kimi::K3),
            ToolCallFormat::Glm45 => Shape::Blocks(&glm::FORMAT),
            ToolCallFormat::MinimaxM2 => Shape::Blocks(&minimax::FORMAT),
            ToolCallFormat::Harmony => Shape::Messages(&harmony::FORMAT),
            ToolCallFormat::Inkling => Shape::Messages(&inkling::FORMAT),
        }
    }

    /// Every tag this syntax reads. They must reach the text the server reads as text, so the
    /// ones a tokenizer marks special are turned into plain added tokens at load time
    /// ([`keep_tags_as_text`]).
    pub fn tags(&self) -> Vec<&'static str> {
        match self.shape() {
            Shape::Blocks(f) => {
                let mut tags = vec![f.open, f.close];
                tags.extend(f.drop);
                tags.extend(self.format_tokens());
                if self.reasoning {
                    tags.extend(f.think);
                }
                tags
            }
            Shape::Messages(f) => f
                .starts
                .iter()
                .chain(f.header_ends)
                .chain(f.ends)
                .copied()
                .chain(self.format_tokens())
                .collect(),
        }
    }

    /// Tags inside a format's blocks or headers that are single tokens in its vocabulary.
    fn format_tokens(&self) -> Vec<&'static str> {
        match self.format {
            ToolCallFormat::DeepseekV3 | ToolCallFormat::DeepseekV31 => deepseek::INNER.to_vec(),
            ToolCallFormat::KimiK2 => kimi::INNER.to_vec(),
            ToolCallFormat::KimiK3 => kimi::K3_INNER.to_vec(),
            ToolCallFormat::Glm45 => glm::INNER.to_vec(),
            ToolCallFormat::Harmony => harmony::INNER.to_vec(),
            _ => Vec::new(),
        }
    }
}

/// What the model type says when the template does not: the block formats of the families
/// colibri runs (a block format only acts on its own tags, so a wrong guess changes nothing
/// for plain text); Hermes for the rest. The message formats (harmony, Inkling) read every
/// message's header, so they are chosen only from a template that writes them (or the
/// configuration).
pub fn format_of_model_type(model_type: &str) -> ToolCallFormat {
    match model_type {
        "deepseek_v3" => ToolCallFormat::DeepseekV3,
        "deepseek_v32" => ToolCallFormat::DeepseekV32,
        "deepseek_v4" => ToolCallFormat::DeepseekV4,
        "kimi_k2" | "kimi_k25" | "kimi_linear" => ToolCallFormat::KimiK2,
        "glm4_moe" | "glm_moe_dsa" | "glm5_next" => ToolCallFormat::Glm45,
        "minimax_m2" => ToolCallFormat::MinimaxM2,
        _ => ToolCallFormat::Hermes,
    }
}

/// The format a chat template writes an assistant's tool call in: a probe conversation (a
/// user turn, an assistant turn calling [`PROBE_FN`], its result) is rendered, with the
/// arguments as an object and then as a JSON string (DeepSeek's templates concatenate them),
/// and the rendering is searched for each format's marks (a template that cannot render the
/// probe is known by how it declares the tools, Kimi's `tool_declare`). `None` when the
/// template shows none of them.
pub fn detect_from_template(template: &ChatTemplate) -> Option<ToolCallFormat> {
    let tools = [json!({"type": "function", "function": {"name": PROBE_FN,
        "description": "probe", "parameters": {"type": "object",
        "properties": {"probe_arg": {"type": "string"}}, "required": ["probe_arg"]}}})];
    let rendered = [
        json!({"probe_arg": "probe_value"}),
        json!("{\"probe_arg\": \"probe_value\"}"),
    ]
    .iter()
    .find_map(|arguments| {
        let messages = [
            json!({"role": "user", "content": "probe"}),
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_0",
                    "type": "function", "function": {"name": PROBE_FN, "arguments": arguments}}]}),
            json!({"role": "tool", "tool_call_id": "call_0", "name": PROBE_FN,
                    "content": "ok"}),
            json!({"role": "user", "content": "again"}),
        ];
        template.render(&messages, true, Some(&tools), None).ok()
    })
    .or_else(|| {
        // A template the probe is beyond (Kimi's keeps call ids with `list.append`, which
        // the renderer lacks) still shows its format in how it declares the tools.
        let question = [json!({"role": "user", "content": "probe"})];
        let declared = template.render(&question, true, Some(&tools), None).ok()?;
        declared
            .contains("<|im_system|>tool_declare")
            .then(|| "<|tool_call_begin|>".to_string())
    })?;
    let has = |s: &str| rendered.contains(s);
    let call = |s: &str| rendered.contains(&s.replace("NAME", PROBE_FN));
    Some(if has("<|channel|>") && call("functions.NAME") {
        ToolCallFormat::Harmony
    } else if has("<|content_invoke_tool_json|>") || has("<|message_model|>") {
        ToolCallFormat::Inkling
    } else if has("<｜DSML｜tool_calls>") {
        ToolCallFormat::DeepseekV4
    } else if has("<｜DSML｜function_calls>") {
        ToolCallFormat::DeepseekV32
    } else if call("<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME") {
        ToolCallFormat::DeepseekV3
    } else if call("<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>") {
        ToolCallFormat::DeepseekV31
    } else if call("<|open|>call tool=\"NAME\"") {
        ToolCallFormat::KimiK3
    } else if has("<|tool_call_begin|>") {
        ToolCallFormat::KimiK2
    } else if has("<minimax:tool_call>") {
        ToolCallFormat::MinimaxM2
    } else if has("<arg_key>") {
        ToolCallFormat::Glm45
    } else if call("<function=NAME>") {
        ToolCallFormat::Qwen3Coder
    } else if has("<tool_call>") {
        ToolCallFormat::Hermes
    } else {
        return None;
    })
}

/// `tokenizer` with the added tokens among `tags` that it marks special (and that do not end
/// generation: `eos`) turned into plain added tokens, so that decoding keeps their text, which
/// the readers need (gpt-oss's `<|channel|>`, GLM's `<arg_key>`, Kimi's
/// `<|tool_call_begin|>` are special in their checkpoints). They still encode as one token each.
/// `Ok(None)` when none needed changing.
pub fn keep_tags_as_text(
    tokenizer: &Tokenizer,
    tags: &[&str],
    eos: &[u32],
) -> anyhow::Result<Option<Tokenizer>> {
    use anyhow::Context as _;
    let changed: Vec<u32> = tokenizer
        .inner()
        .get_added_tokens_decoder()
        .iter()
        .filter(|(id, t)| t.special && tags.contains(&t.content.as_str()) && !eos.contains(id))
        .map(|(id, _)| *id)
        .collect();
    if changed.is_empty() {
        return Ok(None);
    }
    let text = tokenizer
        .inner()
        .to_string(false)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("serializing the tokenizer to keep tool-call tags as text")?;
    let mut json: Value =
        serde_json::from_str(&text).context("re-reading the serialized tokenizer")?;
    for t in json["added_tokens"].as_array_mut().into_iter().flatten() {
        if t["id"]
            .as_u64()
            .is_some_and(|id| changed.contains(&(id as u32)))
        {
            t["special"] = Value::Bool(false);
        }
    }
    let inner: tokenizers::Tokenizer = json
        .to_string()
        .parse()
        .map_err(|e| anyhow::anyhow!("{e}"))
        .context("rebuilding the tokenizer with tool-call tags as text")?;
    Ok(Some(tokenizer.variant(inner)))
}

/// What a reader gives: reasoning, content and whole calls, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Parsed {
    /// Text of the model's reasoning.
    Reasoning(String),
    /// Text of the answer.
    Content(String),
    /// A complete call.
    Call(ToolCall),
}

impl Parsed {
    /// Add content to `events`, joined to content just before it; empty text adds nothing.
    fn push_content(events: &mut Vec<Parsed>, text: String) {
        match events.last_mut() {
            _ if text.is_empty() => {}
            Some(Parsed::Content(last)) => last.push_str(&text),
            _ => events.push(Parsed::Content(text)),
        }
    }

    /// Add reasoning to `events`, joined to reasoning just before it.
    fn push_reasoning(events: &mut Vec<Parsed>, text: String) {
        match events.last_mut() {
            _ if text.is_empty() => {}
            Some(Parsed::Reasoning(last)) => last.push_str(&text),
            _ => events.push(Parsed::Reasoning(text)),
        }
    }
}

/// The reader of one chat completion's text: feed it the generated text as it comes; it gives
/// reasoning, content and calls ([`Parsed`]), in the model's [`Syntax`].
pub struct ChatStream {
    inner: Reader,
}

enum Reader {
    Blocks {
        /// The `<think>` split, when reasoning is read.
        reasoning: Option<ReasoningStream>,
        /// The calls, when the request has tools (or the format frames its answer in tags).
        calls: Option<BlockStream>,
    },
    Messages(MessageStream),
}

impl ChatStream {
    /// A reader of text generated after `prompt` (where a thought or a message may already
    /// be open); with `tools`, calls are read, numbered `{id_prefix}_0`, … .
    pub fn new(syntax: Syntax, prompt: &str, tools: Option<(Arc<Tools>, &str)>) -> ChatStream {
        let calls = tools.map(|(t, prefix)| (t, Ids::new(prefix)));
        let inner = match syntax.shape() {
            Shape::Blocks(format) => Reader::Blocks {
                reasoning: syntax.reasoning.then(|| {
                    let inside = prompt_opens_thought(prompt, format.think[0]);
                    ReasoningStream::new(inside, format.think)
                }),
                calls: (calls.is_some() || !format.drop.is_empty())
                    .then(|| BlockStream::new(format, calls)),
            },
            Shape::Messages(format) => {
                Reader::Messages(MessageStream::new(format, prompt, syntax.reasoning, calls))
            }
        };
        ChatStream { inner }
    }

    /// Feed the next piece of generated text.
    pub fn push(&mut self, piece: &str) -> Vec<Parsed> {
        match &mut self.inner {
            Reader::Messages(m) => m.push(piece),
            Reader::Blocks { reasoning, calls } => {
                let split = match reasoning {
                    Some(r) => r.push(piece),
                    None => vec![ReasoningEvent::Content(piece.to_string())],
                };
                Self::blocks(split, calls, false)
            }
        }
    }

    /// The end of the text: what was held back.
    pub fn finish(&mut self) -> Vec<Parsed> {
        match &mut self.inner {
            Reader::Messages(m) => m.finish(),
            Reader::Blocks { reasoning, calls } => {
                let split = reasoning.as_mut().map(|r| r.finish()).unwrap_or_default();
                Self::blocks(split, calls, true)
            }
        }
    }

    /// Reasoning as it is; content through the calls' reader, when there is one.
    fn blocks(
        split: Vec<ReasoningEvent>,
        calls: &mut Option<BlockStream>,
        last: bool,
    ) -> Vec<Parsed> {
        let mut out = Vec::new();
        for e in split {
            match e {
                ReasoningEvent::Reasoning(r) => Parsed::push_reasoning(&mut out, r),
                ReasoningEvent::Content(c) => match calls {
                    Some(calls) => out.extend(calls.push(&c)),
                    None => Parsed::push_content(&mut out, c),
                },
            }
        }
        if last {
            if let Some(calls) = calls {
                out.extend(calls.finish());
            }
        }
        out
    }
}

/// What a whole generation reads as: its reasoning (if any), its content and its calls.
pub type StreamRead = (Option<String>, String, Vec<ToolCall>);

/// Read `pieces`, generated after `prompt`, through a [`ChatStream`] with the request's
/// `tools` (`None`: calls are not read), joining the events; a piece boundary must never
/// change the result (the tests and the fuzz target compare chunkings). Panics on an empty
/// event, which the stream must never emit.
pub fn read_stream(
    syntax: Syntax,
    prompt: &str,
    tools: Option<&[serde_json::Value]>,
    pieces: &[&str],
) -> StreamRead {
    let tools = tools.map(|t| (Arc::new(Tools::new(t)), "call_x"));
    let mut s = ChatStream::new(syntax, prompt, tools);
    let mut events = Vec::new();
    for p in pieces {
        events.extend(s.push(p));
    }
    events.extend(s.finish());
    let (mut reasoning, mut content, mut calls) = (None::<String>, String::new(), Vec::new());
    for e in events {
        match e {
            Parsed::Reasoning(t) => {
                assert!(!t.is_empty(), "an empty reasoning event");
                reasoning.get_or_insert_with(String::new).push_str(&t)
            }
            Parsed::Content(t) => {
                assert!(!t.is_empty(), "an empty content event");
                content.push_str(&t)
            }
            Parsed::Call(c) => calls.push(c),
        }
    }
    (reasoning, content, calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn format_names_are_the_same_in_files_and_flags() {
        for f in ToolCallFormat::value_variants() {
            let serde = serde_json::to_value(f).unwrap();
            let flag = f.to_possible_value().unwrap();
            assert_eq!(serde.as_str(), Some(flag.get_name()), "{f:?}");
        }
        assert_eq!(
            serde_json::to_value(ToolCallFormat::DeepseekV31).unwrap(),
            "deepseek_v31"
        );
        assert_eq!(
            serde_json::to_value(ToolCallFormat::Qwen3Coder).unwrap(),
            "qwen3_coder"
        );
    }

    #[test]
    fn the_configuration_wins_over_the_template_and_the_model_type() {
        let s = Syntax::resolve(
            ToolCallFormat::Glm45,
            ReasoningFormat::None,
            None,
            "deepseek_v3",
        );
        assert_eq!(
            s,
            Syntax {
                format: ToolCallFormat::Glm45,
                reasoning: false
            }
        );
        let s = Syntax::resolve(
            ToolCallFormat::Auto,
            ReasoningFormat::Auto,
            None,
            "glm4_moe",
        );
        assert_eq!(s.format, ToolCallFormat::Glm45);
        // A message format is never guessed from the model type alone.
        let s = Syntax::resolve(ToolCallFormat::Auto, ReasoningFormat::Auto, None, "gpt_oss");
        assert_eq!(s.format, ToolCallFormat::Hermes);
    }

    #[test]
    fn special_tags_are_kept_as_text_and_end_of_sequence_still_ends() {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../engine/tests/fixtures/qwen3_moe/tokenizer.json");
        let mut inner = Tokenizer::from_file(&path).unwrap().inner().clone();
        inner
            .add_special_tokens([
                tokenizers::AddedToken::from("<|channel|>", true),
                tokenizers::AddedToken::from("<|call|>", true),
            ])
            .expect("tokens added");
        let tok = Tokenizer::from_inner(inner, "harmony-like");
        let channel = tok.token_to_id("<|channel|>").unwrap();
        let call = tok.token_to_id("<|call|>").unwrap();
        let ids = tok.encode("<|channel|>analysis<|call|>", false).unwrap();
        assert_eq!(ids.first(), Some(&channel));
        // What the server decodes generated text with (special tokens skipped).
        assert_eq!(tok.decode(&ids, true).unwrap(), "analysis");
        let kept = keep_tags_as_text(&tok, &["<|channel|>", "<|call|>"], &[call])
            .unwrap()
            .expect("a tag was special");
        assert_eq!(kept.decode(&ids, true).unwrap(), "<|channel|>analysis");
        assert_eq!(
            kept.encode("<|channel|>analysis<|call|>", false).unwrap(),
            ids
        );
        assert!(
            keep_tags_as_text(&kept, &["<|channel|>", "<|call|>"], &[call])
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn a_template_that_renders_no_calls_gives_no_format() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
            "plain.jinja",
        )
        .unwrap();
        assert_eq!(detect_from_template(&t), None);
    }
}
