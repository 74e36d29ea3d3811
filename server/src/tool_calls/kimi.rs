//! Kimi's formats.
//!
//! - K2 (and K2.5, K2-Thinking): `<|tool_calls_section_begin|><|tool_call_begin|>
//!   functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>…
//!   <|tool_calls_section_end|>`, after a `<think>` thought when the model thinks (vLLM's
//!   `kimi_k2` parser). The function's name is read from the call id `functions.NAME:IDX`.
//! - K3 writes everything as `<|open|>TAG attr="…"<|sep|>…<|close|>TAG<|sep|>` elements, as its
//!   template does: a `think` element (the generation prompt opens it), the answer in a
//!   `response` element (whose tags are not part of it), then a `tools` element of
//!   `<|open|>call tool="NAME" index="1"<|sep|>` elements, each argument
//!   `<|open|>argument key="K" type="T"<|sep|>V<|close|>argument<|sep|>` (text when `T` is
//!   `string`, JSON otherwise) or the arguments as one `json` element.

use serde_json::Value;

use super::blocks::BlockFormat;
use super::grammar::{is_text, json_calls, xml_calls, Function};
use super::reasoning::THINK;
use super::values::{attribute, delimited, typed_value};
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
    think: THINK,
    drop: &[],
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

const K3_SEP: &str = "<|sep|>";

/// Kimi K3's `tools` element, after a `think` element.
pub(crate) const K3: BlockFormat = BlockFormat {
    name: "kimi_k3",
    open: "<|open|>tools<|sep|>",
    close: "<|close|>tools<|sep|>",
    json_body: false,
    think: ["<|open|>think<|sep|>", "<|close|>think<|sep|>"],
    drop: &[
        "<|open|>response<|sep|>",
        "<|close|>response<|sep|>",
        "<|close|>message<|sep|>",
        "<|end_of_msg|>",
    ],
    parse: parse_k3,
};

/// The tokens K3's elements are made of (special in its vocabulary).
pub(crate) const K3_INNER: [&str; 4] = ["<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"];

/// An attribute value as K3's template escapes it.
fn unescaped(value: &str) -> String {
    value.replace("&quot;", "\"").replace("&amp;", "&")
}

/// The `call` elements of a `tools` element.
fn parse_k3(body: &str, tools: &Tools) -> Option<Vec<RawCall>> {
    delimited(body, "<|open|>call ", "<|close|>call<|sep|>")?
        .into_iter()
        .map(|call| {
            let (head, inner) = call.split_once(K3_SEP)?;
            let name = unescaped(attribute(head, "tool")?);
            if name.is_empty() {
                return None;
            }
            if inner.trim_start().starts_with("<|open|>json") {
                let (_, json) = delimited(inner, "<|open|>json", "<|close|>json<|sep|>")?
                    .first()?
                    .split_once(K3_SEP)?;
                let Value::Object(arguments) = serde_json::from_str(json.trim()).ok()? else {
                    return None;
                };
                return Some(RawCall { name, arguments });
            }
            let mut arguments = serde_json::Map::new();
            for arg in delimited(inner, "<|open|>argument ", "<|close|>argument<|sep|>")? {
                let (head, value) = arg.split_once(K3_SEP)?;
                let key = unescaped(attribute(head, "key")?);
                let v = match attribute(head, "type") {
                    Some("string") => Value::String(value.to_string()),
                    _ => serde_json::from_str(value.trim())
                        .unwrap_or_else(|_| typed_value(value, tools.parameter(&name, &key))),
                };
                arguments.insert(key, v);
            }
            Some(RawCall { name, arguments })
        })
        .collect()
}

/// The `type` K3 writes for a value of this schema.
fn k3_type(schema: &Value) -> &'static str {
    if is_text(schema) {
        return "string";
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("integer" | "number") => "number",
        Some("boolean") => "boolean",
        Some("array") => "array",
        Some("null") => "null",
        _ => "object",
    }
}

/// One call as Kimi K3's template writes it.
pub(crate) fn grammar_k3(functions: &[Function]) -> String {
    xml_calls(
        K3.open,
        &format!("<|close|>call{K3_SEP}{}", K3.close),
        functions,
        |name| format!("<|open|>call tool=\"{name}\" index=\"1\"{K3_SEP}"),
        |key, schema| {
            format!(
                "<|open|>argument key=\"{key}\" type=\"{}\"{K3_SEP}",
                k3_type(schema)
            )
        },
        &format!("<|close|>argument{K3_SEP}"),
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

    fn kimi() -> crate::tool_calls::Syntax {
        syntax(ToolCallFormat::KimiK2)
    }

    #[test]
    fn the_real_template_is_detected_and_declares_the_tools() {
        let prompt = detected_prompt("kimi-k2-thinking", ToolCallFormat::KimiK2);
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

    fn k3() -> crate::tool_calls::Syntax {
        syntax(ToolCallFormat::KimiK3)
    }

    #[test]
    fn the_k3_template_is_detected_and_opens_a_thought() {
        let prompt = detected_prompt("kimi-k3", ToolCallFormat::KimiK3);
        assert!(
            prompt
                .starts_with("<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools"),
            "{prompt}"
        );
        assert!(prompt.contains("\"name\":\"get_weather\""), "{prompt}");
        assert!(
            prompt.ends_with("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"),
            "{prompt:?}"
        );
    }

    #[test]
    fn k3_thinks_answers_and_calls() {
        let prompt = weather_prompt(&template("kimi-k3"));
        let (tools, _) = weather();
        let output = "Paris for three days.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool=\"get_time\" index=\"2\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";
        check(
            k3(),
            &prompt,
            Some(&tools),
            output,
            (
                Some("Paris for three days."),
                "Checking.",
                &[
                    call("call_x_0", "get_weather", r#"{"city":"Paris","days":3}"#),
                    call("call_x_1", "get_time", "{}"),
                ],
            ),
        );
        // Without tools the answer's frame is still taken out.
        let output = "Easy.<|close|>think<|sep|><|open|>response<|sep|>Hi!<|close|>response<|sep|><|close|>message<|sep|>";
        check(k3(), &prompt, None, output, (Some("Easy."), "Hi!", &[]));
    }

    #[test]
    fn what_the_k3_template_writes_reads_back() {
        let t = template("kimi-k3");
        let (tools, mut messages) = weather();
        messages.push(
            json!({"role": "assistant", "content": "On it.", "reasoning_content": "Use the tool.",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_weather",
             "arguments": {"city": "Paris \"15e\"", "days": 3}}}]}),
        );
        let rendered = t.render(&messages, false, Some(&tools), None).unwrap();
        let open = "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>";
        let turn = &rendered[rendered.rfind(open).unwrap() + open.len()..];
        let turn = turn.strip_suffix("<|end_of_msg|>").unwrap();
        check(
            k3(),
            open,
            Some(&tools),
            turn,
            (
                Some("Use the tool."),
                "On it.",
                &[call(
                    "call_x_0",
                    "get_weather",
                    r#"{"city":"Paris \"15e\"","days":3}"#,
                )],
            ),
        );
    }

    #[test]
    fn the_k3_grammar_forces_a_call() {
        let (tools, _) = weather();
        let g = required_tool_call_grammar(k3(), &tools, None).unwrap();
        grammar_accepts(&g, "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>");
        grammar_refuses(&g, "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>");
    }
}
