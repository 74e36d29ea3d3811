//! Qwen3-Coder's XML calls (vLLM's `qwen3_coder` parser): `<tool_call>\n<function=NAME>\n
//! <parameter=K>\nV\n</parameter>\n…</function>\n</tool_call>`, one block per call. The
//! template writes every value as text (`string` of it), so a value is read back by its
//! parameter's schema type; the newline on each side of a value is the format's, not the
//! value's. A block holding Hermes JSON instead is read as Hermes.

use serde_json::Map;

use super::blocks::BlockFormat;
use super::grammar::{xml_calls, Function};
use super::reasoning::THINK;
use super::values::{strip_newlines, tagged_blocks, typed_value};
use super::{RawCall, Tools};

/// The Qwen3-Coder block.
pub(crate) const FORMAT: BlockFormat = BlockFormat {
    name: "qwen3_coder",
    open: "<tool_call>",
    close: "</tool_call>",
    json_body: false,
    think: THINK,
    drop: &[],
    parse,
};

/// `<function=NAME>` elements with their `<parameter=K>` values.
fn parse(body: &str, tools: &Tools) -> Option<Vec<RawCall>> {
    if body.trim_start().starts_with('{') {
        return super::hermes::json_call(body, &["arguments", "parameters"]).map(|c| vec![c]);
    }
    let functions = tagged_blocks(body, "<function=", "</function>")?;
    let mut calls = Vec::new();
    for (name, inner) in functions {
        let name = name.trim();
        if name.is_empty() {
            return None;
        }
        let mut arguments = Map::new();
        for (key, value) in tagged_blocks(inner, "<parameter=", "</parameter>")? {
            let key = key.trim();
            let value = typed_value(strip_newlines(value), tools.parameter(name, key));
            arguments.insert(key.to_string(), value);
        }
        calls.push(RawCall {
            name: name.to_string(),
            arguments,
        });
    }
    (!calls.is_empty()).then_some(calls)
}

/// One call as Qwen3-Coder's template writes it.
pub(crate) fn grammar(functions: &[Function]) -> String {
    xml_calls(
        "<tool_call>\n<function=",
        "</function>\n</tool_call>",
        functions,
        |name| format!("{name}>\n"),
        |key, _| format!("<parameter={key}>\n"),
        "\n</parameter>\n",
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

    fn coder() -> crate::tool_calls::Syntax {
        syntax(ToolCallFormat::Qwen3Coder)
    }

    #[test]
    fn the_real_template_is_detected_and_lists_the_functions() {
        let prompt = detected_prompt("qwen3-coder", ToolCallFormat::Qwen3Coder);
        assert!(
            prompt.contains("<function>\n<name>get_weather</name>"),
            "{prompt}"
        );
        assert!(
            prompt.contains("<parameter>\n<name>days</name>\n<type>integer</type>"),
            "{prompt}"
        );
        assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt:?}");
    }

    #[test]
    fn text_then_a_call_with_a_multi_line_value() {
        let prompt = weather_prompt(&template("qwen3-coder"));
        let tools = vec![
            weather().0[0].clone(),
            json!({"type": "function", "function": {"name": "write_file", "parameters": {
                "type": "object", "properties": {"path": {"type": "string"},
                "content": {"type": "string"}, "append": {"type": "boolean"}}}}}),
        ];
        let output = "I'll write it.\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=content>\ndef f():\n    return 1 < 2\n</parameter>\n<parameter=append>\nfalse\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        check(
            coder(),
            &prompt,
            Some(&tools),
            output,
            (
                None,
                "I'll write it.",
                &[
                    call(
                        "call_x_0",
                        "write_file",
                        r#"{"path":"/tmp/a.py","content":"def f():\n    return 1 < 2","append":false}"#,
                    ),
                    call("call_x_1", "get_weather", r#"{"city":"Paris","days":3}"#),
                ],
            ),
        );
    }

    #[test]
    fn what_the_template_writes_reads_back() {
        let t = template("qwen3-coder");
        let (tools, mut messages) = weather();
        messages.push(json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_weather",
             "arguments": {"city": "Paris", "days": 3}}}]}));
        let rendered = t.render(&messages, false, Some(&tools), None).unwrap();
        let start =
            rendered.rfind("<|im_start|>assistant").unwrap() + "<|im_start|>assistant".len();
        let turn = rendered[start..].strip_suffix("<|im_end|>\n").unwrap();
        check(
            coder(),
            "",
            Some(&tools),
            turn,
            (
                None,
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
    fn malformed_blocks_are_text() {
        let (tools, _) = weather();
        for output in [
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
            "<tool_call>\nget_weather(Paris)\n</tool_call>",
        ] {
            check(coder(), "", Some(&tools), output, (None, output, &[]));
        }
    }

    #[test]
    fn the_grammar_forces_a_call() {
        let (tools, _) = weather();
        let g = required_tool_call_grammar(coder(), &tools, None).unwrap();
        grammar_accepts(&g, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>");
        grammar_accepts(
            &g,
            "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        );
        grammar_refuses(&g, "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>");
    }
}
