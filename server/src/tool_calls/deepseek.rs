//! DeepSeek's tool calls, after a `<think>` thought:
//!
//! - V3 and R1 (vLLM's `deepseek_v3`): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
//!   <｜tool▁sep｜>NAME\n```json\n{…}\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`;
//! - V3.1 (`deepseek_v31`): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>` in
//!   the same section (the reader takes either form, whichever the template);
//! - V3.2 and V4 (`deepseek_v32`, `deepseek_v4`), DSML: `<｜DSML｜function_calls>` (V3.2) or
//!   `<｜DSML｜tool_calls>` (V4) around `<｜DSML｜invoke name="NAME">` elements whose
//!   `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>` are text
//!   (`string="true"`) or JSON. V3.2 and V4 ship no Jinja chat template (their checkpoints
//!   encode conversations in Python), so DSML is chosen by model type or configuration.

use serde_json::Value;

use super::blocks::BlockFormat;
use super::grammar::{is_text, json_calls, xml_calls, Function};
use super::reasoning::THINK;
use super::values::{delimited, invoke_calls, InvokeTags};
use super::{RawCall, Tools};

const CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const CALLS_END: &str = "<｜tool▁calls▁end｜>";
const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const CALL_END: &str = "<｜tool▁call▁end｜>";
const SEP: &str = "<｜tool▁sep｜>";

/// The V3/V3.1 section.
pub(crate) const FORMAT: BlockFormat = BlockFormat {
    name: "deepseek_v3",
    open: CALLS_BEGIN,
    close: CALLS_END,
    json_body: false,
    think: THINK,
    drop: &[],
    parse,
};

/// The tags inside a V3/V3.1 section (special tokens of DeepSeek's vocabulary).
pub(crate) const INNER: [&str; 3] = [CALL_BEGIN, CALL_END, SEP];

/// The calls of a section: `<｜tool▁call▁begin｜>…<｜tool▁call▁end｜>` items, whitespace between.
fn parse(body: &str, _tools: &Tools) -> Option<Vec<RawCall>> {
    delimited(body, CALL_BEGIN, CALL_END)?
        .into_iter()
        .map(call)
        .collect()
}

/// One call: `function<｜tool▁sep｜>NAME\n```json\nARGS\n```` (V3) or `NAME<｜tool▁sep｜>ARGS`
/// (V3.1).
fn call(item: &str) -> Option<RawCall> {
    let (left, right) = item.split_once(SEP)?;
    let (name, args) = match right.split_once("```json") {
        Some((name, fenced)) if left.trim() == "function" => {
            (name.trim(), fenced.trim_end().strip_suffix("```")?.trim())
        }
        _ => (left.trim(), right.trim()),
    };
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    match serde_json::from_str(args).ok()? {
        Value::Object(arguments) => Some(RawCall {
            name: name.to_string(),
            arguments,
        }),
        _ => None,
    }
}

/// One call as the V3/R1 template writes it.
pub(crate) fn grammar_v3(functions: &[Function]) -> String {
    let prefix = format!("{CALLS_BEGIN}{CALL_BEGIN}function{SEP}");
    let suffix = format!("\n```{CALL_END}{CALLS_END}");
    json_calls(&prefix, &suffix, functions, |name| {
        format!("{name}\n```json\n")
    })
}

/// One call as the V3.1 template writes it.
pub(crate) fn grammar_v31(functions: &[Function]) -> String {
    let prefix = format!("{CALLS_BEGIN}{CALL_BEGIN}");
    let suffix = format!("{CALL_END}{CALLS_END}");
    json_calls(&prefix, &suffix, functions, |name| format!("{name}{SEP}"))
}

/// A DSML block and its element names.
pub(crate) struct Dsml {
    pub format: BlockFormat,
    pub tags: InvokeTags,
}

const DSML_TAGS: InvokeTags = InvokeTags {
    invoke: "<｜DSML｜invoke ",
    invoke_close: "</｜DSML｜invoke>",
    parameter: "<｜DSML｜parameter ",
    parameter_close: "</｜DSML｜parameter>",
};

/// DeepSeek-V3.2's DSML.
pub(crate) const DSML_V32: Dsml = Dsml {
    format: BlockFormat {
        name: "deepseek_v32",
        open: "<｜DSML｜function_calls>",
        close: "</｜DSML｜function_calls>",
        json_body: false,
        think: THINK,
        drop: &[],
        parse: |body, tools| invoke_calls(body, &DSML_TAGS, tools),
    },
    tags: DSML_TAGS,
};

/// DeepSeek-V4's DSML.
pub(crate) const DSML_V4: Dsml = Dsml {
    format: BlockFormat {
        name: "deepseek_v4",
        open: "<｜DSML｜tool_calls>",
        close: "</｜DSML｜tool_calls>",
        json_body: false,
        think: THINK,
        drop: &[],
        parse: |body, tools| invoke_calls(body, &DSML_TAGS, tools),
    },
    tags: DSML_TAGS,
};

/// One call in DSML, as vLLM's DSML parsers document it (one element a line).
pub(crate) fn grammar_dsml(dsml: &Dsml, functions: &[Function]) -> String {
    let (f, t) = (&dsml.format, &dsml.tags);
    xml_calls(
        &format!("{}\n", f.open),
        &format!("{}\n{}", t.invoke_close, f.close),
        functions,
        |name| format!("{}name=\"{name}\">\n", t.invoke),
        |key, schema| {
            format!(
                "{}name=\"{key}\" string=\"{}\">",
                t.parameter,
                is_text(schema)
            )
        },
        &format!("{}\n", t.parameter_close),
    )
}

#[cfg(test)]
mod tests {
    use crate::tool_calls::testing::{
        call, check, grammar_accepts, grammar_refuses, syntax, template, weather, weather_prompt,
    };
    use crate::tool_calls::{detect_from_template, required_tool_call_grammar, ToolCallFormat};
    use serde_json::json;

    #[test]
    fn the_real_templates_are_detected() {
        let r1 = template("deepseek-r1");
        assert_eq!(detect_from_template(&r1), Some(ToolCallFormat::DeepseekV3));
        let v31 = template("deepseek-v3.1");
        assert_eq!(
            detect_from_template(&v31),
            Some(ToolCallFormat::DeepseekV31)
        );
    }

    #[test]
    fn r1_thinks_then_calls() {
        let t = template("deepseek-r1");
        let prompt = weather_prompt(&t);
        // DeepSeek's templates do not write the tools (the caller describes them); the turn
        // is opened with a thought.
        assert!(
            prompt.ends_with(
                "<｜User｜>What is the weather in Paris for 3 days?<｜Assistant｜><think>\n"
            ),
            "{prompt:?}"
        );
        let (tools, _) = weather();
        let output = "The user asks about Paris for 3 days; get_weather fits.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\", \"days\": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        check(
            syntax(ToolCallFormat::DeepseekV3),
            &prompt,
            Some(&tools),
            output,
            (
                Some("The user asks about Paris for 3 days; get_weather fits."),
                "",
                &[
                    call("call_x_0", "get_weather", r#"{"city":"Paris","days":3}"#),
                    call("call_x_1", "get_time", "{}"),
                ],
            ),
        );
    }

    #[test]
    fn v31_calls_without_thinking() {
        let t = template("deepseek-v3.1");
        let prompt = weather_prompt(&t);
        assert!(prompt.ends_with("<｜Assistant｜></think>"), "{prompt:?}");
        let (tools, _) = weather();
        let output = "I'll check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\", \"days\": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        check(
            syntax(ToolCallFormat::DeepseekV31),
            &prompt,
            Some(&tools),
            output,
            (
                None,
                "I'll check.",
                &[call(
                    "call_x_0",
                    "get_weather",
                    r#"{"city":"Paris","days":3}"#,
                )],
            ),
        );
    }

    #[test]
    fn what_the_v31_template_writes_reads_back() {
        let t = template("deepseek-v3.1");
        let (tools, mut messages) = weather();
        // DeepSeek's templates concatenate the arguments: they take the JSON text.
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "get_weather",
             "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "c1", "type": "function", "function": {"name": "get_time",
             "arguments": "{}"}}]}));
        let rendered = t.render(&messages, false, Some(&tools), None).unwrap();
        let turn = &rendered
            [rendered.find("<｜Assistant｜></think>").unwrap() + "<｜Assistant｜></think>".len()..];
        let turn = turn.strip_suffix("<｜end▁of▁sentence｜>").unwrap();
        check(
            syntax(ToolCallFormat::DeepseekV31),
            "",
            Some(&tools),
            turn,
            (
                None,
                "",
                &[
                    call("call_x_0", "get_weather", r#"{"city":"Paris"}"#),
                    call("call_x_1", "get_time", "{}"),
                ],
            ),
        );
    }

    #[test]
    fn malformed_sections_are_text() {
        let (tools, _) = weather();
        for output in [
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": <｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "<｜tool▁calls▁begin｜>get_weather<｜tool▁sep｜>{}<｜tool▁calls▁end｜>",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}",
        ] {
            check(
                syntax(ToolCallFormat::DeepseekV31),
                "",
                Some(&tools),
                output,
                (None, output, &[]),
            );
        }
    }

    #[test]
    fn dsml_v4_and_v32() {
        let (tools, _) = weather();
        // The example of vLLM's DeepSeek-V4 parser documentation, with this test's tools.
        let v4 = "<think>\nNeed the weather.\n</think>\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">杭州</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">5</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_time\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
        let want = [
            call("call_x_0", "get_weather", r#"{"city":"杭州","days":5}"#),
            call("call_x_1", "get_time", "{}"),
        ];
        check(
            syntax(ToolCallFormat::DeepseekV4),
            "",
            Some(&tools),
            v4,
            (Some("Need the weather."), "", &want),
        );
        let v32 = v4
            .replace("<｜DSML｜tool_calls>", "<｜DSML｜function_calls>")
            .replace("</｜DSML｜tool_calls>", "</｜DSML｜function_calls>");
        check(
            syntax(ToolCallFormat::DeepseekV32),
            "",
            Some(&tools),
            &v32,
            (Some("Need the weather."), "", &want),
        );
        // `string="true"` keeps a number-looking value as text.
        let text = "<｜DSML｜tool_calls><｜DSML｜invoke name=\"get_weather\"><｜DSML｜parameter name=\"city\" string=\"true\">1984</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>";
        check(
            syntax(ToolCallFormat::DeepseekV4),
            "",
            Some(&tools),
            text,
            (
                None,
                "",
                &[call("call_x_0", "get_weather", r#"{"city":"1984"}"#)],
            ),
        );
    }

    #[test]
    fn the_grammars_force_each_form() {
        let (tools, _) = weather();
        let g =
            required_tool_call_grammar(syntax(ToolCallFormat::DeepseekV3), &tools, None).unwrap();
        grammar_accepts(&g, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\":\"Paris\",\"days\":3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
        grammar_refuses(&g, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"days\":3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
        let g = required_tool_call_grammar(
            syntax(ToolCallFormat::DeepseekV31),
            &tools,
            Some("get_time"),
        )
        .unwrap();
        grammar_accepts(&g, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>");
        let g =
            required_tool_call_grammar(syntax(ToolCallFormat::DeepseekV4), &tools, None).unwrap();
        grammar_accepts(&g, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
        grammar_refuses(&g, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"false\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
    }
}
