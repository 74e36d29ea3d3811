//! Kimi K2 (and K2.5, K2-Thinking): `<|tool_calls_section_begin|><|tool_call_begin|>
//! functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>…
//! <|tool_calls_section_end|>`, after a `<think>` thought when the model thinks (vLLM's
//! `kimi_k2` parser). The function's name is read from the call id `functions.NAME:IDX`.

use serde_json::Value;

use super::blocks::BlockFormat;
use super::grammar::{json_calls, Function};
use super::values::delimited;
use super::{RawCall, Tools};

const CALL_BEGIN: &str = "<|tool_call_begin|>";
const ARGS_BEGIN: &str = "<|tool_call_argument_begin|>";
const CALL_END: &str = "<|tool_call_end|>";

/// The Kimi section.
pub(crate) const FORMAT: BlockFormat = BlockFormat {
    name: "kimi_k2",
    open: "<|tool_calls_section_begin|>",
    close: "<|tool_calls_section_end|>",
    json_body: false,
    parse,
};

/// The tags inside a section (special tokens of Kimi's vocabulary).
pub(crate) const INNER: [&str; 3] = [CALL_BEGIN, ARGS_BEGIN, CALL_END];

/// The calls of a section, whitespace between them.
fn parse(body: &str, _tools: &Tools) -> Option<Vec<RawCall>> {
    delimited(body, CALL_BEGIN, CALL_END)?
        .into_iter()
        .map(|item| {
            let (id, args) = item.split_once(ARGS_BEGIN)?;
            let id = id.trim();
            let name = id.strip_prefix("functions.").unwrap_or(id);
            let name = match name.rsplit_once(':') {
                Some((n, i)) if i.chars().all(|c| c.is_ascii_digit()) => n,
                _ => name,
            };
            if name.is_empty() {
                return None;
            }
            let Value::Object(arguments) = serde_json::from_str(args.trim()).ok()? else {
                return None;
            };
            Some(RawCall {
                name: name.to_string(),
                arguments,
            })
        })
        .collect()
}

/// One call, as Kimi writes it, with the id `functions.NAME:0`.
pub(crate) fn grammar(functions: &[Function]) -> String {
    let prefix = format!("{}{CALL_BEGIN}functions.", FORMAT.open);
    let suffix = format!("{CALL_END}{}", FORMAT.close);
    json_calls(&prefix, &suffix, functions, |name| {
        format!("{name}:0{ARGS_BEGIN}")
    })
}

#[cfg(test)]
mod tests {
    use crate::tool_calls::testing::{
        call, check, grammar_accepts, grammar_refuses, syntax, template, weather, weather_prompt,
    };
    use crate::tool_calls::{detect_from_template, required_tool_call_grammar, ToolCallFormat};
    use serde_json::json;

    fn kimi() -> crate::tool_calls::Syntax {
        syntax(ToolCallFormat::KimiK2)
    }

    #[test]
    fn the_real_template_is_detected_and_declares_the_tools() {
        let t = template("kimi-k2-thinking");
        assert_eq!(detect_from_template(&t), Some(ToolCallFormat::KimiK2));
        let prompt = weather_prompt(&t);
        assert!(
            prompt.starts_with("<|im_system|>tool_declare<|im_middle|>[{"),
            "{prompt}"
        );
        assert!(prompt.contains("\"get_weather\""), "{prompt}");
        assert!(
            prompt.ends_with("<|im_assistant|>assistant<|im_middle|>"),
            "{prompt:?}"
        );
    }

    #[test]
    fn k2_thinking_thinks_then_calls_twice() {
        let t = template("kimi-k2-thinking");
        let prompt = weather_prompt(&t);
        let (tools, _) = weather();
        let output = "<think>Paris, three days. Also the time.</think>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\", \"days\": 3}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
        check(
            kimi(),
            &prompt,
            Some(&tools),
            output,
            (
                Some("Paris, three days. Also the time."),
                "Let me check.",
                &[
                    call("call_x_0", "get_weather", r#"{"city":"Paris","days":3}"#),
                    call("call_x_1", "get_time", "{}"),
                ],
            ),
        );
    }

    #[test]
    fn a_tool_call_in_the_history_is_beyond_the_renderer() {
        // The template keeps its call ids with `list.append`, which minijinja (colibri's
        // renderer) does not have: a conversation with an earlier call does not render, and
        // the format is known from the tool declaration instead (see `detect_from_template`).
        let t = template("kimi-k2-thinking");
        let (tools, mut messages) = weather();
        messages.push(json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]}));
        let e = t.render(&messages, false, Some(&tools), None).unwrap_err();
        assert!(e.to_string().contains("append"), "{e}");
    }

    #[test]
    fn malformed_calls_are_text() {
        let (tools, _) = weather();
        for output in [
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>[1]<|tool_call_end|><|tool_calls_section_end|>",
        ] {
            check(kimi(), "", Some(&tools), output, (None, output, &[]));
        }
    }

    #[test]
    fn the_grammar_forces_a_call() {
        let (tools, _) = weather();
        let g = required_tool_call_grammar(kimi(), &tools, None).unwrap();
        grammar_accepts(&g, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\":\"Paris\"}<|tool_call_end|><|tool_calls_section_end|>");
        grammar_refuses(&g, "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>");
    }
}
