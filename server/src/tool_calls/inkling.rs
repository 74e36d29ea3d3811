//! Inkling (Thinking Machines), as vLLM's `inkling` parser reads it: the model writes typed
//! blocks, `<|message_model|>[NAME]<|content_KIND|>…<|end_message|>`, where KIND is
//! `thinking` (reasoning), `text` (the answer), `invoke_tool_json` (a call:
//! `{"name": …, "args": {…}}`) or `invoke_tool_text` / `tool_error` (shown as text); a block
//! may also end with `<|content_model_end_sampling|>`, and the generation prompt opens the
//! first `<|message_model|>`. No Inkling chat template is published in a form this project
//! could find (see `server/tests/fixtures/chat_templates/README.md`), so this format is chosen
//! by configuration (or a template that writes these tags), and its tests use outputs written
//! from vLLM's parser documentation and tests.

use super::grammar::Function;
use super::messages::{Kind, MessageFormat};
use super::{RawCall, Tools};

const INVOKE_JSON: &str = "<|content_invoke_tool_json|>";

/// Inkling's blocks.
pub(crate) const FORMAT: MessageFormat = MessageFormat {
    name: "inkling",
    starts: &["<|message_model|>"],
    header_ends: &[
        "<|content_text|>",
        "<|content_thinking|>",
        INVOKE_JSON,
        "<|content_invoke_tool_text|>",
        "<|content_tool_error|>",
    ],
    ends: &["<|end_message|>", "<|content_model_end_sampling|>"],
    kind,
    call,
    header_prompts: &["<|message_model|>"],
};

/// A block's kind is its content tag; a call's header may name the function.
fn kind(header: &str, end: &str) -> Kind {
    let name = header.trim_start_matches("<|message_model|>").trim();
    match end {
        "<|content_thinking|>" => Kind::Reasoning,
        INVOKE_JSON => Kind::Call((!name.is_empty()).then(|| name.to_string())),
        _ => Kind::Content,
    }
}

/// A call's text: `{"name": NAME, "args": {…}}`.
fn call(_name: Option<&str>, body: &str, _tools: &Tools) -> Option<Vec<RawCall>> {
    super::hermes::json_call(body, &["args", "arguments"]).map(|c| vec![c])
}

/// One call block after the generation prompt's `<|message_model|>`.
pub(crate) fn grammar(functions: &[Function]) -> String {
    format!(
        "start: {} call {}\ncall: %json {}\n",
        super::grammar::lit(INVOKE_JSON),
        super::grammar::lit("<|end_message|>"),
        super::hermes::any_call(functions, "args")
    )
}

#[cfg(test)]
mod tests {
    use crate::tool_calls::testing::{
        call as tool_call, check, grammar_accepts, grammar_refuses, syntax, weather,
    };
    use crate::tool_calls::{required_tool_call_grammar, ToolCallFormat};

    fn inkling() -> crate::tool_calls::Syntax {
        syntax(ToolCallFormat::Inkling)
    }

    #[test]
    fn a_thought_then_a_named_call() {
        let (tools, _) = weather();
        // The block sequence of vLLM's Inkling parser tests, with this test's tools.
        let output = "<|content_thinking|>need weather<|end_message|><|message_model|>get_weather<|content_invoke_tool_json|>{\"name\":\"get_weather\",\"args\":{\"city\":\"Seoul\"}}<|end_message|><|content_model_end_sampling|>";
        check(
            inkling(),
            "<|message_model|>",
            Some(&tools),
            output,
            (
                Some("need weather"),
                "",
                &[tool_call("call_x_0", "get_weather", r#"{"city":"Seoul"}"#)],
            ),
        );
    }

    #[test]
    fn text_blocks_are_the_answer() {
        let output = "<|content_thinking|>Simple.<|end_message|><|message_model|><|content_text|>Hello!<|end_message|><|message_model|><|content_text|>Bye.<|end_message|>";
        check(
            inkling(),
            "<|message_model|>",
            None,
            output,
            (Some("Simple."), "Hello!\n\nBye.", &[]),
        );
    }

    #[test]
    fn a_malformed_call_is_text() {
        let (tools, _) = weather();
        let output = "<|content_invoke_tool_json|>{\"args\":{}}<|end_message|>";
        check(
            inkling(),
            "<|message_model|>",
            Some(&tools),
            output,
            (None, "{\"args\":{}}", &[]),
        );
    }

    #[test]
    fn the_grammar_forces_a_call() {
        let (tools, _) = weather();
        let g = required_tool_call_grammar(inkling(), &tools, None).unwrap();
        grammar_accepts(&g, "<|content_invoke_tool_json|>{\"name\":\"get_weather\",\"args\":{\"city\":\"Seoul\"}}<|end_message|>");
        grammar_refuses(
            &g,
            "<|content_invoke_tool_json|>{\"name\":\"get_weather\",\"args\":{}}<|end_message|>",
        );
    }
}
