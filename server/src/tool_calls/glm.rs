//! GLM-4.5 and later (GLM-4.6, 4.7, 5): `<tool_call>NAME\n<arg_key>K</arg_key>\n
//! <arg_value>V</arg_value>\n…</tool_call>`, one block per call, after a `<think>` thought
//! (vLLM's `glm45` / `glm47` parsers; GLM-4.7 leaves out the newlines). A value is text for
//! a string parameter and JSON otherwise, as the template writes it (`tojson` unless a
//! string), read back by the parameter's schema type.

use serde_json::Map;

use super::blocks::BlockFormat;
use super::grammar::{xml_calls, Function};
use super::reasoning::THINK;
use super::values::typed_value;
use super::{RawCall, Tools};

/// The GLM block.
pub(crate) const FORMAT: BlockFormat = BlockFormat {
    name: "glm45",
    open: "<tool_call>",
    close: "</tool_call>",
    json_body: false,
    think: THINK,
    drop: &[],
    parse,
};

/// The tags inside a block (special tokens in GLM's vocabulary).
pub(crate) const INNER: [&str; 4] = ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"];

/// `NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs, whitespace between.
fn parse(body: &str, tools: &Tools) -> Option<Vec<RawCall>> {
    let (name, mut rest) = match body.find(INNER[0]) {
        Some(i) => (body[..i].trim(), &body[i..]),
        None => (body.trim(), ""),
    };
    if name.is_empty() || name.contains(['<', '>', '\n']) {
        return None;
    }
    let mut arguments = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after_key = rest.strip_prefix(INNER[0])?;
        let key_end = after_key.find(INNER[1])?;
        let key = after_key[..key_end].trim();
        let after = after_key[key_end + INNER[1].len()..].trim_start();
        let after_value = after.strip_prefix(INNER[2])?;
        let value_end = after_value.find(INNER[3])?;
        let value = &after_value[..value_end];
        arguments.insert(
            key.to_string(),
            typed_value(value, tools.parameter(name, key)),
        );
        rest = &after_value[value_end + INNER[3].len()..];
    }
    Some(vec![RawCall {
        name: name.to_string(),
        arguments,
    }])
}

/// One call as GLM-4.5's template writes it:
/// `<tool_call>NAME\n(<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n)*</tool_call>`.
pub(crate) fn grammar(functions: &[Function]) -> String {
    xml_calls(
        "<tool_call>",
        "</tool_call>",
        functions,
        |name| format!("{name}\n"),
        |key, _| format!("<arg_key>{key}</arg_key>\n<arg_value>"),
        "</arg_value>\n",
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

    fn glm() -> crate::tool_calls::Syntax {
        syntax(ToolCallFormat::Glm45)
    }

    #[test]
    fn the_real_template_is_detected_and_prompts_with_the_tools() {
        let prompt = detected_prompt("glm-4.6", ToolCallFormat::Glm45);
        assert!(
            prompt.starts_with("[gMASK]<sop><|system|>\n# Tools"),
            "{prompt}"
        );
        assert!(prompt.contains("\"name\": \"get_weather\""), "{prompt}");
        assert!(
            prompt.contains("<arg_key>{arg-key-1}</arg_key>"),
            "{prompt}"
        );
        assert!(
            prompt.ends_with("<|user|>\nWhat is the weather in Paris for 3 days?<|assistant|>"),
            "{prompt:?}"
        );
    }

    #[test]
    fn a_call_after_a_thought() {
        let t = template("glm-4.6");
        let prompt = weather_prompt(&t);
        let (tools, _) = weather();
        // As GLM-4.5 answers after `<|assistant|>`: a thought, then the call.
        let output = "\n<think>The user wants Paris for 3 days: get_weather takes a city and days.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>";
        check(
            glm(),
            &prompt,
            Some(&tools),
            output,
            (
                Some("The user wants Paris for 3 days: get_weather takes a city and days."),
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
    fn with_reasoning_off_the_thought_stays_in_the_content() {
        let (tools, _) = weather();
        let off = crate::tool_calls::Syntax {
            format: ToolCallFormat::Glm45,
            reasoning: false,
        };
        let output = "<think>Hm.</think>\n<tool_call>get_time\n</tool_call>";
        check(
            off,
            "",
            Some(&tools),
            output,
            (
                None,
                "<think>Hm.</think>",
                &[call("call_x_0", "get_time", "{}")],
            ),
        );
    }

    #[test]
    fn glm47_without_newlines_text_before_and_two_calls() {
        let (tools, _) = weather();
        let output = "<think></think>Checking both.<tool_call>get_weather<arg_key>city</arg_key><arg_value>San Francisco, CA</arg_value></tool_call><tool_call>get_time</tool_call>";
        check(
            glm(),
            "",
            Some(&tools),
            output,
            (
                None,
                "Checking both.",
                &[
                    call("call_x_0", "get_weather", r#"{"city":"San Francisco, CA"}"#),
                    call("call_x_1", "get_time", "{}"),
                ],
            ),
        );
    }

    #[test]
    fn a_string_parameter_stays_text_and_others_are_json() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "number"},
            "o": {"type": "object"}, "b": {"type": "boolean"}}}}}),
        ];
        let output = "<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>007</arg_value>\n<arg_key>n</arg_key>\n<arg_value>1.5</arg_value>\n<arg_key>o</arg_key>\n<arg_value>{\"k\": [1, \"x\"]}</arg_value>\n<arg_key>b</arg_key>\n<arg_value>false</arg_value>\n</tool_call>";
        check(
            glm(),
            "",
            Some(&tools),
            output,
            (
                None,
                "",
                &[call(
                    "call_x_0",
                    "f",
                    r#"{"s":"007","n":1.5,"o":{"k":[1,"x"]},"b":false}"#,
                )],
            ),
        );
    }

    #[test]
    fn a_malformed_call_is_text() {
        let (tools, _) = weather();
        for output in [
            "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>",
            "<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        ] {
            check(glm(), "", Some(&tools), output, (None, output, &[]));
        }
        // Not closed: the text is the answer.
        let output = "Sure <tool_call>get_weather\n<arg_key>city</arg_key>";
        check(glm(), "", Some(&tools), output, (None, output, &[]));
    }

    #[test]
    fn what_the_template_writes_reads_back() {
        let t = template("glm-4.6");
        let (tools, mut messages) = weather();
        messages.push(json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_weather",
             "arguments": {"city": "Paris", "days": 3}}}]}));
        let rendered = t.render(&messages, false, Some(&tools), None).unwrap();
        let turn = &rendered[rendered.rfind("<|assistant|>").unwrap() + "<|assistant|>".len()..];
        check(
            glm(),
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
    fn the_grammar_forces_a_call_in_the_template_s_form() {
        let (tools, _) = weather();
        let g = required_tool_call_grammar(glm(), &tools, None).unwrap();
        grammar_accepts(
            &g,
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        );
        grammar_accepts(&g, "<tool_call>get_time\n</tool_call>");
        // `days` is an integer; `city` is required.
        grammar_refuses(
            &g,
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>three</arg_value>\n</tool_call>",
        );
        grammar_refuses(&g, "<tool_call>get_weather\n</tool_call>");
        let only = required_tool_call_grammar(glm(), &tools, Some("get_time")).unwrap();
        grammar_refuses(
            &only,
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        );
    }
}
