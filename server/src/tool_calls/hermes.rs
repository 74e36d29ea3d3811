//! Hermes/Qwen tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
//! possibly several, possibly after some text (Qwen2.5/Qwen3's templates; vLLM's `hermes`
//! parser), and the grammar that forces one.

use colibri::runtime::grammar::with_compact_json;
use serde_json::{Map, Value};

use super::blocks::BlockFormat;
use super::grammar::Function;
use super::reasoning::THINK;
use super::{RawCall, Tools};

/// The Hermes block: a JSON object between `<tool_call>` and `</tool_call>`.
pub(crate) const FORMAT: BlockFormat = BlockFormat {
    name: "hermes",
    open: "<tool_call>",
    close: "</tool_call>",
    json_body: true,
    think: THINK,
    drop: &[],
    parse,
};

/// Read the inside of a `<tool_call>` block: a JSON object with a non-empty string `name` and
/// an `arguments` object (also accepted: `parameters` for `arguments`, arguments given as a
/// string holding a JSON object, and no arguments at all, read as `{}`). Anything else is not a
/// call.
fn parse(body: &str, _tools: &Tools) -> Option<Vec<RawCall>> {
    json_call(body, &["arguments", "parameters"]).map(|c| vec![c])
}

/// A call written as one JSON object `{"name": NAME, KEY: {...}}`, the arguments under the
/// first of `keys` present (an object, a string holding one, or absent: `{}`).
pub(crate) fn json_call(body: &str, keys: &[&str]) -> Option<RawCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let arguments = match keys.iter().find_map(|k| obj.get(*k)) {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => m,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(RawCall {
        name: name.to_string(),
        arguments,
    })
}

/// Rewrite every local `$ref` ("#...") in `schema` to point below `base` ("#/$defs/fn0"), for a
/// schema that moves from a document's root to `base`.
fn rebase_refs(schema: &mut Value, base: &str) {
    match schema {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                match v {
                    Value::String(r) if key == "$ref" && r.starts_with('#') => {
                        *r = format!("{base}{}", &r[1..]);
                    }
                    _ => rebase_refs(v, base),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rebase_refs(v, base)),
        _ => {}
    }
}

fn has_local_ref(schema: &Value) -> bool {
    match schema {
        Value::Object(map) => map.iter().any(|(k, v)| {
            (k == "$ref" && v.as_str().is_some_and(|r| r.starts_with('#'))) || has_local_ref(v)
        }),
        Value::Array(items) => items.iter().any(has_local_ref),
        _ => false,
    }
}

/// A grammar that forces exactly one Hermes call:
///
/// ```text
/// start: "<tool_call>\n" json_call "\n</tool_call>"
/// json_call: %json {"anyOf": [{"type": "object", "properties": {"name": {"const": NAME},
///     "arguments": PARAMETERS}, "required": ["name", "arguments"],
///     "additionalProperties": false}, ...], "$defs": {...}, "x-guidance": {...}}
/// ```
///
/// The call is compact JSON (no whitespace between tokens: the arguments are re-serialized
/// anyway). A parameters schema with local `$ref`s moves under `$defs/fn{i}` with its refs
/// rebased, so pydantic-style `$defs` keep working.
pub(crate) fn grammar(functions: &[Function]) -> String {
    format!(
        "start: \"<tool_call>\\n\" json_call \"\\n</tool_call>\"\njson_call: %json {}\n",
        any_call(functions, "arguments")
    )
}

/// The compact JSON schema of a call `{"name": NAME, ARGS: PARAMETERS}` to any of the
/// functions: one `anyOf` option each, parameters with `$ref`s moved under `$defs`.
pub(crate) fn any_call(functions: &[Function], args: &str) -> Value {
    let mut defs = Map::new();
    let options = functions
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let mut params = f.params.clone();
            if has_local_ref(&params) {
                let key = format!("fn{i}");
                rebase_refs(&mut params, &format!("#/$defs/{key}"));
                defs.insert(key.clone(), params);
                params = serde_json::json!({ "$ref": format!("#/$defs/{key}") });
            }
            serde_json::json!({
                "type": "object",
                "properties": { "name": { "const": f.name }, args: params },
                "required": ["name", args],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut schema = Map::new();
    schema.insert("anyOf".to_string(), Value::Array(options));
    if !defs.is_empty() {
        schema.insert("$defs".to_string(), Value::Object(defs));
    }
    with_compact_json(Value::Object(schema))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_calls::testing::{
        call, check, grammar_accepts, grammar_refuses, read, syntax, weather,
    };
    use crate::tool_calls::{required_tool_call_grammar, ChatStream, Parsed, ToolCallFormat};
    use std::sync::Arc;

    fn check_tools(text: &str, want_content: &str, want_calls: &[crate::tool_calls::ToolCall]) {
        let tools = weather().0;
        check(
            syntax(ToolCallFormat::Hermes),
            "",
            Some(&tools),
            text,
            (None, want_content, want_calls),
        );
    }

    fn required_tool_call_grammar_h(tools: &[Value], only: Option<&str>) -> Result<String, String> {
        required_tool_call_grammar(syntax(ToolCallFormat::Hermes), tools, only)
    }

    #[test]
    fn single_call() {
        check_tools(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "",
            &[call("call_x_0", "get_weather", r#"{"city":"Paris"}"#)],
        );
    }

    #[test]
    fn text_then_two_calls() {
        let text = "Let me look both up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n";
        check_tools(
            text,
            "Let me look both up.",
            &[
                call(
                    "call_x_0",
                    "get_weather",
                    r#"{"city":"Paris","days":[1,2]}"#,
                ),
                call("call_x_1", "get_time", "{}"),
            ],
        );
    }

    #[test]
    fn text_between_and_after_calls() {
        let text = "A <tool_call>{\"name\":\"f\",\"arguments\":{\"x\":1}}</tool_call> B\n\n<tool_call>{\"name\":\"g\",\"arguments\":{}}</tool_call>  C ";
        check_tools(
            text,
            "A  B\n\n  C",
            &[
                call("call_x_0", "f", r#"{"x":1}"#),
                call("call_x_1", "g", "{}"),
            ],
        );
    }

    #[test]
    fn malformed_json_stays_content() {
        let text = "Try: <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": }\n</tool_call> then <tool_call>{\"name\": \"g\", \"arguments\": {\"y\": \"z\"}}</tool_call>";
        check_tools(
            text,
            "Try: <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": }\n</tool_call> then",
            &[call("call_x_0", "g", r#"{"y":"z"}"#)],
        );
        // Valid JSON but not a call: no name, a numeric name, arguments that are no object.
        for body in [
            r#"{"arguments": {}}"#,
            r#"{"name": 3, "arguments": {}}"#,
            r#"{"name": "f", "arguments": [1]}"#,
            r#"["f", {}]"#,
        ] {
            let text = format!("<tool_call>{body}</tool_call>");
            check_tools(&text, &text, &[]);
        }
    }

    #[test]
    fn closing_tag_inside_a_string() {
        let text = "<tool_call>{\"name\": \"write\", \"arguments\": {\"text\": \"end with </tool_call> and \\\"</tool_call>\\\"\"}}</tool_call> ok";
        check_tools(
            text,
            "ok",
            &[call(
                "call_x_0",
                "write",
                r#"{"text":"end with </tool_call> and \"</tool_call>\""}"#,
            )],
        );
        // Outside a string the first closing tag ends the block (and here spoils it).
        let text = "<tool_call>{\"name\": \"f\", </tool_call>\"a\"}</tool_call>";
        check_tools(
            text,
            "<tool_call>{\"name\": \"f\", </tool_call>\"a\"}</tool_call>",
            &[],
        );
    }

    #[test]
    fn argument_variants() {
        check_tools(
            r#"<tool_call>{"name": "f", "arguments": "{\"a\": 1}"}</tool_call>"#,
            "",
            &[call("call_x_0", "f", r#"{"a":1}"#)],
        );
        check_tools(
            r#"<tool_call>{"name": "f"}</tool_call>"#,
            "",
            &[call("call_x_0", "f", "{}")],
        );
        check_tools(
            r#"<tool_call>{"name": "f", "parameters": {"b": true}}</tool_call>"#,
            "",
            &[call("call_x_0", "f", r#"{"b":true}"#)],
        );
    }

    #[test]
    fn unterminated_block_is_content() {
        let text = "Sure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {";
        check_tools(text, text.trim(), &[]);
        // A complete call, then an unterminated one.
        let text = "<tool_call>{\"name\":\"f\"}</tool_call>\n<tool_call>{\"name\":";
        check_tools(
            text,
            "<tool_call>{\"name\":",
            &[call("call_x_0", "f", "{}")],
        );
    }

    #[test]
    fn tag_lookalikes_are_content() {
        check_tools("a <tool b <tool_cal c", "a <tool b <tool_cal c", &[]);
        check_tools("ends with <tool_ca", "ends with <tool_ca", &[]);
        check_tools("x </tool_call> y", "x </tool_call> y", &[]);
        check_tools(
            "<<tool_call>{\"name\":\"f\"}</tool_call>",
            "<",
            &[call("call_x_0", "f", "{}")],
        );
    }

    #[test]
    fn unicode_content_and_arguments() {
        let text = "Météo à 東京 🌧️ :\n<tool_call>\n{\"name\": \"météo\", \"arguments\": {\"ville\": \"Zürich 東京 🌧️\"}}\n</tool_call>\nvoilà ✓";
        check_tools(
            text,
            "Météo à 東京 🌧️ :\n\nvoilà ✓",
            &[call("call_x_0", "météo", r#"{"ville":"Zürich 東京 🌧️"}"#)],
        );
    }

    #[test]
    fn held_back_text_is_released() {
        let tools = Some((Arc::new(Tools::new(&weather().0)), "c"));
        let mut s = ChatStream::new(syntax(ToolCallFormat::Hermes), "", tools.clone());
        assert_eq!(s.push("Hello <tool"), vec![Parsed::Content("Hello".into())]);
        assert_eq!(
            s.push("box> and"),
            vec![Parsed::Content(" <toolbox> and".into())]
        );
        assert_eq!(s.push(" "), vec![]);
        assert_eq!(s.finish(), vec![]);
        let mut s = ChatStream::new(syntax(ToolCallFormat::Hermes), "", tools);
        assert_eq!(s.push("<tool_call>{\"name\": \"f\"}"), vec![]);
        assert_eq!(
            s.push("</tool_call>"),
            vec![Parsed::Call(call("c_0", "f", "{}"))]
        );
    }

    #[test]
    fn the_grammar_forces_a_call() {
        let tools = weather().0;
        let g = required_tool_call_grammar_h(&tools, None).unwrap();
        grammar_accepts(&g, "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\",\"days\":3}}\n</tool_call>");
        grammar_refuses(
            &g,
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"days\":3}}\n</tool_call>",
        );
    }

    #[test]
    fn ids_count_the_calls() {
        let (_, _, calls) = read(
            syntax(ToolCallFormat::Hermes),
            "",
            Some(&[]),
            &["<tool_call>{\"name\":\"a\"}</tool_call><tool_call>{\"name\":\"b\"}</tool_call>"],
        );
        let ids: Vec<&str> = calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["call_x_0", "call_x_1"]);
    }

    fn weather_tools() -> Vec<Value> {
        serde_json::from_str(
            r#"[
              {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": false}}},
              {"type": "function", "function": {"name": "get_time"}}
            ]"#,
        )
        .unwrap()
    }

    /// The `%json` payload of a grammar from [`required_tool_call_grammar`].
    fn payload(grammar: &str) -> Value {
        let mut lines = grammar.lines();
        assert_eq!(
            lines.next(),
            Some(r#"start: "<tool_call>\n" json_call "\n</tool_call>""#)
        );
        let json = lines
            .next()
            .and_then(|l| l.strip_prefix("json_call: %json "))
            .expect("json_call rule");
        serde_json::from_str(json).expect("payload is JSON")
    }

    #[test]
    fn tool_grammar_lists_every_function() {
        let g = required_tool_call_grammar_h(&weather_tools(), None).unwrap();
        let p = payload(&g);
        let options = p["anyOf"].as_array().unwrap();
        assert_eq!(options.len(), 2);
        assert_eq!(options[0]["properties"]["name"]["const"], "get_weather");
        assert_eq!(
            options[0]["properties"]["arguments"]["required"],
            serde_json::json!(["city"])
        );
        assert_eq!(options[1]["properties"]["name"]["const"], "get_time");
        assert_eq!(
            options[1]["properties"]["arguments"]["additionalProperties"],
            false
        );
        for o in options {
            assert_eq!(o["required"], serde_json::json!(["name", "arguments"]));
            assert_eq!(o["additionalProperties"], false);
        }
        assert_eq!(p["x-guidance"]["whitespace_flexible"], false);
    }

    #[test]
    fn tool_grammar_only_one() {
        let g = required_tool_call_grammar_h(&weather_tools(), Some("get_time")).unwrap();
        let p = payload(&g);
        let options = p["anyOf"].as_array().unwrap();
        assert_eq!(options.len(), 1);
        assert_eq!(options[0]["properties"]["name"]["const"], "get_time");
        let e = required_tool_call_grammar_h(&weather_tools(), Some("nope")).unwrap_err();
        assert!(e.contains("nope") && e.contains("get_weather"), "{e}");
    }

    #[test]
    fn tool_grammar_is_strict_unless_the_function_says_not() {
        let tool = |strict: Option<bool>| {
            let mut f = serde_json::json!({"name": "add", "parameters": {"type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}}});
            if let Some(s) = strict {
                f["strict"] = Value::Bool(s);
            }
            vec![serde_json::json!({"type": "function", "function": f})]
        };
        for strict in [None, Some(true)] {
            let p = payload(&required_tool_call_grammar_h(&tool(strict), None).unwrap());
            let args = &p["anyOf"][0]["properties"]["arguments"];
            assert_eq!(args["additionalProperties"], false, "{strict:?}");
            assert_eq!(
                args["properties"]["a"]["maximum"],
                colibri::runtime::grammar::JSON_INTEGER_BOUND
            );
            assert!(args["properties"]["b"]["minimum"].is_number());
        }
        let p = payload(&required_tool_call_grammar_h(&tool(Some(false)), None).unwrap());
        let args = &p["anyOf"][0]["properties"]["arguments"];
        assert_eq!(args.get("additionalProperties"), None);
        assert_eq!(
            args["properties"]["a"],
            serde_json::json!({"type": "integer"})
        );
    }

    #[test]
    fn tool_grammar_rebases_refs() {
        let tools = vec![serde_json::json!({"type": "function", "function": {
        "name": "add_pet",
        "parameters": {
            "type": "object",
            "properties": {"pet": {"$ref": "#/$defs/Pet"}},
            "required": ["pet"],
            "$defs": {"Pet": {"type": "object", "properties": {
                "name": {"type": "string"},
                "friends": {"type": "array", "items": {"$ref": "#/$defs/Pet"}}}}}
        }}})];
        let p = payload(&required_tool_call_grammar_h(&tools, None).unwrap());
        let args = &p["anyOf"][0]["properties"]["arguments"];
        assert_eq!(args["$ref"], "#/$defs/fn0");
        let moved = &p["$defs"]["fn0"];
        assert_eq!(moved["properties"]["pet"]["$ref"], "#/$defs/fn0/$defs/Pet");
        assert_eq!(
            moved["$defs"]["Pet"]["properties"]["friends"]["items"]["$ref"],
            "#/$defs/fn0/$defs/Pet"
        );
    }
}
