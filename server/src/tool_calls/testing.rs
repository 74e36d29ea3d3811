//! What the formats' tests share: every way of cutting a text into pieces, a reader run over
//! them, the real chat templates committed under `server/tests/fixtures/chat_templates/`, and
//! a grammar driven token by token over a fixture tokenizer.

use std::path::PathBuf;

use colibri::format::chat_template::ChatTemplate;
use colibri::format::tokenizer::Tokenizer;
use colibri::runtime::grammar::{Grammar, GrammarVocab};
use serde_json::Value;

use super::{Syntax, ToolCall, ToolCallFormat};

/// Every way of cutting `text` into two pieces at char boundaries, plus one char at a time.
pub(crate) fn splits(text: &str) -> Vec<Vec<&str>> {
    let mut out: Vec<Vec<&str>> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .map(|i| vec![&text[..i], &text[i..]])
        .collect();
    out.push(
        text.char_indices()
            .map(|(i, c)| &text[i..i + c.len_utf8()])
            .collect(),
    );
    out
}

/// What a reader made of a text: (reasoning, content, calls).
pub(crate) type Read = super::StreamRead;

/// The syntax of `format` with reasoning read.
pub(crate) fn syntax(format: ToolCallFormat) -> Syntax {
    Syntax {
        format,
        reasoning: true,
    }
}

/// Read `pieces`, generated after `prompt`, with the request's `tools` (`None`: calls are not
/// read). No event is empty.
pub(crate) fn read(syntax: Syntax, prompt: &str, tools: Option<&[Value]>, pieces: &[&str]) -> Read {
    super::read_stream(syntax, prompt, tools, pieces)
}

/// A call with this id, name and arguments (JSON text, compared as written).
pub(crate) fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: id.to_string(),
        name: name.to_string(),
        arguments: arguments.to_string(),
    }
}

/// `text` (generated after `prompt`) reads as `want`, whole and cut anywhere.
pub(crate) fn check(
    syntax: Syntax,
    prompt: &str,
    tools: Option<&[Value]>,
    text: &str,
    want: (Option<&str>, &str, &[ToolCall]),
) {
    let want: Read = (
        want.0.map(String::from),
        want.1.to_string(),
        want.2.to_vec(),
    );
    assert_eq!(read(syntax, prompt, tools, &[text]), want, "whole {text:?}");
    for pieces in splits(text) {
        assert_eq!(
            read(syntax, prompt, tools, &pieces),
            want,
            "pieces {pieces:?}"
        );
    }
}

/// The committed real chat template `name` (`server/tests/fixtures/chat_templates/NAME.jinja`).
pub(crate) fn template(name: &str) -> ChatTemplate {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat_templates")
        .join(format!("{name}.jinja"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    ChatTemplate::new(text, &path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A weather conversation: the tools (get_weather(city: string, days: integer) and
/// get_time()), and the user's question.
pub(crate) fn weather() -> (Vec<Value>, Vec<Value>) {
    let tools = serde_json::json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "The city"},
                "days": {"type": "integer", "description": "How many days"}},
            "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "description": "The time now",
            "parameters": {"type": "object", "properties": {}}}}
    ]);
    let messages = serde_json::json!([
        {"role": "user", "content": "What is the weather in Paris for 3 days?"}
    ]);
    (
        tools.as_array().unwrap().clone(),
        messages.as_array().unwrap().clone(),
    )
}

/// The prompt `template` renders for the weather question with its tools; it must show the
/// model the tools (a function name and a parameter name) and the question.
pub(crate) fn weather_prompt(template: &ChatTemplate) -> String {
    let (tools, messages) = weather();
    let prompt = template
        .render(&messages, true, Some(&tools), None)
        .expect("the template renders the weather question");
    assert!(
        prompt.contains("What is the weather in Paris for 3 days?"),
        "{prompt}"
    );
    prompt
}

/// The weather prompt of the committed real template `name` (see [`weather_prompt`]), after
/// checking that the server would read that template's model in `format`.
pub(crate) fn detected_prompt(name: &str, format: ToolCallFormat) -> String {
    let t = template(name);
    assert_eq!(super::detect_from_template(&t), Some(format), "{name}");
    weather_prompt(&t)
}

/// The fixture tokenizer (byte-level BPE of 384 tokens; `<|im_end|>` is its EOS).
fn fixture_tokenizer() -> (Tokenizer, u32) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures/qwen3_moe/tokenizer.json");
    let tok = Tokenizer::from_file(&path).expect("the fixture tokenizer");
    let eos = tok.token_to_id("<|im_end|>").expect("<|im_end|>");
    (tok, eos)
}

/// The grammar compiles, allows every token of `text` in turn and is complete after it.
pub(crate) fn grammar_accepts(grammar: &str, text: &str) {
    let (tok, eos) = fixture_tokenizer();
    let vocab = GrammarVocab::new(tok.inner(), &[eos]).expect("a grammar vocabulary");
    let mut c = vocab
        .constraint(&Grammar::Lark(grammar.to_string()))
        .unwrap_or_else(|e| panic!("the grammar compiles: {e}\n{grammar}"));
    let ids = tok.encode(text, false).expect("encode");
    let mut done = String::new();
    for id in ids {
        let mut logits = vec![0.0f32; vocab.vocab_size()];
        c.mask_logits(&mut logits)
            .unwrap_or_else(|e| panic!("mask after {done:?}: {e}"));
        let piece = tok.decode(&[id], false).unwrap_or_default();
        assert!(
            logits[id as usize].is_finite(),
            "the grammar refuses {piece:?} after {done:?}\n{grammar}"
        );
        c.consume(id).expect("consume an allowed token");
        done.push_str(&piece);
    }
    assert!(
        c.is_accepting(),
        "the grammar is not complete after {text:?}\n{grammar}"
    );
}

/// The grammar does not allow `text` (some token of it is refused, or it is incomplete).
pub(crate) fn grammar_refuses(grammar: &str, text: &str) {
    let (tok, eos) = fixture_tokenizer();
    let vocab = GrammarVocab::new(tok.inner(), &[eos]).expect("a grammar vocabulary");
    let mut c = vocab
        .constraint(&Grammar::Lark(grammar.to_string()))
        .expect("the grammar compiles");
    for id in tok.encode(text, false).expect("encode") {
        let mut logits = vec![0.0f32; vocab.vocab_size()];
        if c.mask_logits(&mut logits).is_err() || !logits[id as usize].is_finite() {
            return;
        }
        c.consume(id).expect("consume an allowed token");
    }
    assert!(!c.is_accepting(), "the grammar allows {text:?}\n{grammar}");
}
