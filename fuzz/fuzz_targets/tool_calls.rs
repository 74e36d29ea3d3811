//! The tool-call and reasoning readers (`tool_calls::ChatStream`), every format, with and
//! without tools and reasoning. The first byte picks the format and the mode, the next ones
//! (up to the first NUL) where the text is cut; then comes the prompt, a NUL, and the
//! generated text (or, without a NUL, only the text). Read whole and read in those pieces the
//! text must give the same reasoning, content and calls (the readers promise that cutting
//! never changes a result), no event is empty, and every call's arguments are a JSON object.
#![no_main]

use colibri_server::tool_calls::{Syntax, ToolCallFormat};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Value};

const FORMATS: [ToolCallFormat; 13] = [
    ToolCallFormat::Hermes,
    ToolCallFormat::Qwen3Coder,
    ToolCallFormat::DeepseekV3,
    ToolCallFormat::DeepseekV31,
    ToolCallFormat::DeepseekV32,
    ToolCallFormat::DeepseekV4,
    ToolCallFormat::KimiK2,
    ToolCallFormat::KimiK3,
    ToolCallFormat::Glm45,
    ToolCallFormat::MinimaxM2,
    ToolCallFormat::Harmony,
    ToolCallFormat::Inkling,
    ToolCallFormat::Hermes,
];

/// Two functions whose parameters have the types the XML formats read values by.
fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                           "metric": {"type": "boolean"}, "when": {"type": "array"}},
            "required": ["city"]}}}),
        json!({"type": "function", "function": {"name": "search", "parameters": {
            "type": "object", "properties": {"query": {"type": "string"},
                                             "filters": {"type": "object"}}}}}),
    ]
}

type Read = colibri_server::tool_calls::StreamRead;

fn read(syntax: Syntax, prompt: &str, with_tools: bool, pieces: &[&str]) -> Read {
    let tools = with_tools.then(tools);
    colibri_server::tool_calls::read_stream(syntax, prompt, tools.as_deref(), pieces)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let (cuts, rest) = match rest.iter().position(|&b| b == 0) {
        Some(nul) => (&rest[..nul], &rest[nul + 1..]),
        None => (&[][..], rest),
    };
    let Ok(rest) = std::str::from_utf8(rest) else {
        return;
    };
    let (prompt, text) = rest.split_once('\0').unwrap_or(("", rest));
    let syntax = Syntax {
        format: FORMATS[(mode & 0x0f) as usize % FORMATS.len()],
        reasoning: mode & 0x10 == 0,
    };
    let with_tools = mode & 0x20 == 0;
    let whole = read(syntax, prompt, with_tools, &[text]);
    let pieces = colibri_fuzz::pieces(text, cuts);
    let cut = read(syntax, prompt, with_tools, &pieces);
    assert_eq!(whole, cut, "{syntax:?}: whole vs pieces {pieces:?}");
    for c in &whole.2 {
        let args: Value = serde_json::from_str(&c.arguments)
            .unwrap_or_else(|e| panic!("call {c:?}: arguments are not JSON: {e}"));
        assert!(args.is_object(), "call {c:?}: arguments are not an object");
    }
});
