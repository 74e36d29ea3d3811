//! MiniMax-M2: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="K">V</parameter>\n
//! </invoke>\n</minimax:tool_call>`, several invokes a block, after a `<think>` thought the
//! generation prompt opens (vLLM's `minimax_m2` parser). Values are text for string
//! parameters and JSON otherwise, as the template writes them.

use super::blocks::BlockFormat;
use super::grammar::{xml_calls, Function};
use super::reasoning::THINK;
use super::values::{invoke_calls, InvokeTags};

const TAGS: InvokeTags = InvokeTags {
    invoke: "<invoke ",
    invoke_close: "</invoke>",
    parameter: "<parameter ",
    parameter_close: "</parameter>",
};

/// The MiniMax block.
pub(crate) const FORMAT: BlockFormat = BlockFormat {
    name: "minimax_m2",
    open: "<minimax:tool_call>",
    close: "</minimax:tool_call>",
    json_body: false,
    think: THINK,
    drop: &[],
    parse: |body, tools| invoke_calls(body, &TAGS, tools),
};

/// One call as MiniMax-M2's template writes it.
pub(crate) fn grammar(functions: &[Function]) -> String {
    xml_calls(
        "<minimax:tool_call>\n",
        "</invoke>\n</minimax:tool_call>",
        functions,
        |name| format!("<invoke name=\"{name}\">\n"),
        |key, _| format!("<parameter name=\"{key}\">"),
        "</parameter>\n",
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

    fn minimax() -> crate::tool_calls::Syntax {
        syntax(ToolCallFormat::MinimaxM2)
    }

    #[test]
    fn the_real_template_is_detected_and_opens_a_thought() {
        let prompt = detected_prompt("minimax-m2", ToolCallFormat::MinimaxM2);
        assert!(
            prompt.contains("<tools>\n<tool>{\"name\": \"get_weather\""),
            "{prompt}"
        );
        assert!(prompt.ends_with("]~b]ai\n<think>\n"), "{prompt:?}");
    }

    #[test]
    fn a_thought_then_two_invokes() {
        let prompt = weather_prompt(&template("minimax-m2"));
        let (tools, _) = weather();
        let output = "Paris, 3 days, and the time.\n</think>\n\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n<invoke name=\"get_time\">\n</invoke>\n</minimax:tool_call>";
        check(
            minimax(),
            &prompt,
            Some(&tools),
            output,
            (
                Some("Paris, 3 days, and the time."),
                "",
                &[
                    call("call_x_0", "get_weather", r#"{"city":"Paris","days":3}"#),
                    call("call_x_1", "get_time", "{}"),
                ],
            ),
        );
    }

    #[test]
    fn what_the_template_writes_reads_back() {
        let t = template("minimax-m2");
        let (tools, mut messages) = weather();
        messages.push(
            json!({"role": "assistant", "content": "Looking it up.", "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_weather",
             "arguments": {"city": "Paris", "days": 3}}}]}),
        );
        let rendered = t.render(&messages, false, Some(&tools), None).unwrap();
        let start = rendered.rfind("]~b]ai\n").unwrap() + "]~b]ai\n".len();
        let turn = rendered[start..].strip_suffix("[e~[\n").unwrap();
        check(
            minimax(),
            "",
            Some(&tools),
            turn,
            (
                None,
                "Looking it up.",
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
            "<minimax:tool_call>\n<invoke>\n</invoke>\n</minimax:tool_call>",
            "<minimax:tool_call>\nget_weather(city=Paris)\n</minimax:tool_call>",
            "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris\n</invoke>\n</minimax:tool_call>",
        ] {
            check(minimax(), "", Some(&tools), output, (None, output, &[]));
        }
    }

    #[test]
    fn the_grammar_forces_a_call() {
        let (tools, _) = weather();
        let g = required_tool_call_grammar(minimax(), &tools, None).unwrap();
        grammar_accepts(&g, "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n</minimax:tool_call>");
        grammar_accepts(
            &g,
            "<minimax:tool_call>\n<invoke name=\"get_time\">\n</invoke>\n</minimax:tool_call>",
        );
        grammar_refuses(&g, "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"days\">3</parameter>\n</invoke>\n</minimax:tool_call>");
    }
}
