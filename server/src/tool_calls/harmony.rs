//! gpt-oss's harmony format (vLLM's `openai` tool parser and harmony reasoning): every
//! message is `<|start|>ROLE<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>
//! TEXT<|end|>`, the generation prompt opening the assistant's first one with
//! `<|start|>assistant`. The `analysis` channel is reasoning, `final` the answer, `commentary`
//! a preamble shown as content, or, addressed `to=functions.NAME` (before or after the
//! channel), a call whose text is the JSON arguments; a call ends with `<|call|>`, an
//! end-of-sequence token that never reaches the text, so the end of the text ends it too.

use serde_json::Value;

use super::grammar::{json_calls, Function};
use super::messages::{Kind, MessageFormat};
use super::{RawCall, Tools};

/// Harmony's messages.
pub(crate) const FORMAT: MessageFormat = MessageFormat {
    name: "harmony",
    starts: &["<|start|>", "<|channel|>"],
    header_ends: &["<|message|>"],
    ends: &["<|end|>", "<|call|>", "<|return|>"],
    kind,
    call,
    header_prompts: &["<|start|>assistant"],
};

/// Tags inside a header (special tokens of gpt-oss's vocabulary).
pub(crate) const INNER: [&str; 1] = ["<|constrain|>"];

/// The word after `key` in a header (up to whitespace or a tag).
fn word<'h>(header: &'h str, key: &str) -> Option<&'h str> {
    let at = header.find(key)? + key.len();
    let rest = &header[at..];
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '<')
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

/// A header's meaning: a call when addressed to a function, else by its channel.
fn kind(header: &str, _end: &str) -> Kind {
    if let Some(name) = word(header, "to=").and_then(|r| r.strip_prefix("functions.")) {
        return Kind::Call(Some(name.to_string()));
    }
    match word(header, "<|channel|>") {
        Some("analysis") => Kind::Reasoning,
        _ => Kind::Content,
    }
}

/// A call's text is its JSON arguments object.
fn call(name: Option<&str>, body: &str, _tools: &Tools) -> Option<Vec<RawCall>> {
    let name = name.filter(|n| !n.is_empty())?;
    match serde_json::from_str(body.trim()).ok()? {
        Value::Object(arguments) => Some(vec![RawCall {
            name: name.to_string(),
            arguments,
        }]),
        _ => None,
    }
}

/// One call after the generation prompt's `<|start|>assistant`, as gpt-oss writes it:
/// `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{json}` (then its
/// `<|call|>` ends the generation).
pub(crate) fn grammar(functions: &[Function]) -> String {
    json_calls(
        "<|channel|>commentary to=functions.",
        "",
        functions,
        |name| format!("{name} <|constrain|>json<|message|>"),
    )
}

#[cfg(test)]
mod tests {
    use crate::tool_calls::testing::{
        call, check, detected_prompt, grammar_accepts, grammar_refuses, syntax, template, weather,
        weather_prompt,
    };
    use crate::tool_calls::{required_tool_call_grammar, ToolCallFormat};
    use serde_json::json;

    fn harmony() -> crate::tool_calls::Syntax {
        syntax(ToolCallFormat::Harmony)
    }

    #[test]
    fn the_real_template_is_detected_and_lists_the_functions() {
        let prompt = detected_prompt("gpt-oss-120b", ToolCallFormat::Harmony);
        assert!(
            prompt.starts_with("<|start|>system<|message|>You are ChatGPT"),
            "{prompt}"
        );
        assert!(prompt.contains("namespace functions {"), "{prompt}");
        assert!(prompt.contains("type get_weather = (_: {"), "{prompt}");
        assert!(prompt.ends_with("<|start|>user<|message|>What is the weather in Paris for 3 days?<|end|><|start|>assistant"), "{prompt:?}");
    }

    #[test]
    fn analysis_then_a_call() {
        let prompt = weather_prompt(&template("gpt-oss-120b"));
        let (tools, _) = weather();
        let output = "<|channel|>analysis<|message|>User wants Paris weather for 3 days. Call get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\",\"days\":3}";
        check(
            harmony(),
            &prompt,
            Some(&tools),
            output,
            (
                Some("User wants Paris weather for 3 days. Call get_weather."),
                "",
                &[call(
                    "call_x_0",
                    "get_weather",
                    r#"{"city":"Paris","days":3}"#,
                )],
            ),
        );
    }

    #[test]
    fn analysis_then_the_final_answer_with_or_without_tools() {
        let prompt = weather_prompt(&template("gpt-oss-120b"));
        let (tools, _) = weather();
        let output = "<|channel|>analysis<|message|>No tool needed.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny in Paris.";
        let want = (Some("No tool needed."), "It is sunny in Paris.", &[][..]);
        check(harmony(), &prompt, Some(&tools), output, want);
        check(harmony(), &prompt, None, output, want);
        // Two analysis messages are one thought, a blank line apart.
        let output = "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|><|start|>assistant<|channel|>final<|message|>Done.";
        check(
            harmony(),
            &prompt,
            None,
            output,
            (Some("One.\n\nTwo."), "Done.", &[]),
        );
    }

    #[test]
    fn with_reasoning_off_the_analysis_is_content() {
        let off = crate::tool_calls::Syntax {
            format: ToolCallFormat::Harmony,
            reasoning: false,
        };
        let output = "<|channel|>analysis<|message|>Thinking.<|end|><|start|>assistant<|channel|>final<|message|>Answer.";
        check(
            off,
            "<|start|>assistant",
            None,
            output,
            (None, "Thinking.\n\nAnswer.", &[]),
        );
    }

    #[test]
    fn a_preamble_then_a_call_addressed_before_the_channel() {
        let prompt = weather_prompt(&template("gpt-oss-120b"));
        let (tools, _) = weather();
        let output = "<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>";
        check(
            harmony(),
            &prompt,
            Some(&tools),
            output,
            (
                None,
                "Checking the weather.",
                &[call("call_x_0", "get_weather", r#"{"city":"Paris"}"#)],
            ),
        );
    }

    #[test]
    fn what_the_template_writes_reads_back() {
        let t = template("gpt-oss-120b");
        let (tools, mut messages) = weather();
        let prompt = t.render(&messages, true, Some(&tools), None).unwrap();
        messages.push(
            json!({"role": "assistant", "thinking": "Use the tool.", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_weather",
             "arguments": {"city": "Paris", "days": 3}}}]}),
        );
        let rendered = t.render(&messages, false, Some(&tools), None).unwrap();
        let turn = rendered
            .strip_prefix(prompt.as_str())
            .expect("the turn follows the prompt");
        check(
            harmony(),
            &prompt,
            Some(&tools),
            turn,
            (
                Some("Use the tool."),
                "",
                &[call(
                    "call_x_0",
                    "get_weather",
                    r#"{"city":"Paris","days":3}"#,
                )],
            ),
        );
    }

    #[test]
    fn a_malformed_call_is_text() {
        let prompt = "<|start|>assistant";
        let (tools, _) = weather();
        let output = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": ";
        check(
            harmony(),
            prompt,
            Some(&tools),
            output,
            (None, "{\"city\":", &[]),
        );
    }

    #[test]
    fn the_grammar_forces_a_call() {
        let (tools, _) = weather();
        let g = required_tool_call_grammar(harmony(), &tools, None).unwrap();
        grammar_accepts(&g, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\",\"days\":3}");
        grammar_refuses(&g, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"days\":3}");
        grammar_refuses(&g, "<|channel|>final<|message|>Hi");
    }
}
