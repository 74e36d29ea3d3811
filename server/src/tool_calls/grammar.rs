//! The grammar that forces one tool call when a request requires one (`tool_choice:
//! "required"` or a named function): the request's functions are read and checked here, and
//! each format writes the call in its own syntax as a llguidance Lark grammar, the arguments
//! (or, in the XML-style formats, each parameter's value) constrained by the function's JSON
//! schema with the engine's strict defaults ([`strict_json_schema`]: objects that list their
//! properties closed, numbers bounded) unless the function says `"strict": false`.

use colibri::runtime::grammar::{strict_json_schema, with_compact_json};
use serde_json::{json, Value};

use super::{Syntax, ToolCallFormat};

/// One function a forced call may call.
pub(crate) struct Function {
    pub name: String,
    /// Its parameters' JSON schema (strict defaults applied); `{}`-taking functions get a
    /// closed empty object.
    pub params: Value,
}

/// The functions of an OpenAI `tools` array, or only the one named `only`. Fails when a
/// function has no name or a parameters value that is not a schema, or when none is left.
fn functions(tools: &[Value], only: Option<&str>) -> Result<Vec<Function>, String> {
    let mut out = Vec::new();
    let mut names = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        if let Some(kind) = tool.get("type").and_then(Value::as_str) {
            if kind != "function" {
                continue;
            }
        }
        let function = tool
            .get("function")
            .ok_or_else(|| format!("tools[{i}]: no \"function\" object"))?;
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| format!("tools[{i}]: the function has no name"))?;
        names.push(name.to_string());
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let mut params = match function.get("parameters") {
            None | Some(Value::Null) => json!({
                "type": "object",
                "properties": {},
                "additionalProperties": false,
            }),
            Some(p @ (Value::Object(_) | Value::Bool(_))) => p.clone(),
            Some(_) => {
                return Err(format!(
                    "tools[{i}] ({name}): \"parameters\" is not a JSON schema object"
                ))
            }
        };
        if function.get("strict").and_then(Value::as_bool) != Some(false) {
            strict_json_schema(&mut params);
        }
        out.push(Function {
            name: name.to_string(),
            params,
        });
    }
    if out.is_empty() {
        return Err(match only {
            Some(o) => format!("tool_choice names {o:?}, which is not among the tools {names:?}"),
            None => "no function tools to call".to_string(),
        });
    }
    Ok(out)
}

/// A llguidance Lark grammar that forces exactly one call, in `syntax`'s format, to one of
/// the functions of an OpenAI `tools` array (or to the function named `only`). Fails when no
/// function is usable or `only` names none of them.
pub fn required_tool_call_grammar(
    syntax: Syntax,
    tools: &[Value],
    only: Option<&str>,
) -> Result<String, String> {
    let functions = functions(tools, only)?;
    Ok(match syntax.format {
        ToolCallFormat::Auto | ToolCallFormat::Hermes => super::hermes::grammar(&functions),
        ToolCallFormat::Qwen3Coder => super::qwen3_coder::grammar(&functions),
        ToolCallFormat::DeepseekV3 => super::deepseek::grammar_v3(&functions),
        ToolCallFormat::DeepseekV31 => super::deepseek::grammar_v31(&functions),
        ToolCallFormat::DeepseekV32 => {
            super::deepseek::grammar_dsml(&super::deepseek::DSML_V32, &functions)
        }
        ToolCallFormat::DeepseekV4 => {
            super::deepseek::grammar_dsml(&super::deepseek::DSML_V4, &functions)
        }
        ToolCallFormat::KimiK2 => super::kimi::grammar(&functions),
        ToolCallFormat::KimiK3 => super::kimi::grammar_k3(&functions),
        ToolCallFormat::Glm45 => super::glm::grammar(&functions),
        ToolCallFormat::MinimaxM2 => super::minimax::grammar(&functions),
        ToolCallFormat::Harmony => super::harmony::grammar(&functions),
        ToolCallFormat::Inkling => super::inkling::grammar(&functions),
    })
}

/// `s` as a Lark string literal.
pub(crate) fn lit(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// A rule that is the compact JSON of `schema`.
pub(crate) fn json_rule(name: &str, schema: Value) -> String {
    format!("{name}: %json {}\n", with_compact_json(schema))
}

/// `start: PREFIX call SUFFIX` where `call` is one of `one(i, function)` (each a sequence of
/// Lark items, with its own rules appended to `rules`).
pub(crate) fn one_of(
    prefix: &str,
    suffix: &str,
    functions: &[Function],
    mut one: impl FnMut(usize, &Function, &mut String) -> String,
) -> String {
    let mut rules = String::new();
    let alternatives: Vec<String> = functions
        .iter()
        .enumerate()
        .map(|(i, f)| one(i, f, &mut rules))
        .collect();
    let outer = |s: &str| if s.is_empty() { String::new() } else { lit(s) };
    let mut g = format!("start: {} call {}\n", outer(prefix), outer(suffix));
    g.push_str(&format!("call: {}\n", alternatives.join(" | ")));
    g.push_str(&rules);
    g
}

/// `start: PREFIX call SUFFIX` where a call is `head(NAME)` and the function's arguments as
/// JSON, for the formats that write a call's arguments as one JSON object.
pub(crate) fn json_calls(
    prefix: &str,
    suffix: &str,
    functions: &[Function],
    head: impl Fn(&str) -> String,
) -> String {
    one_of(prefix, suffix, functions, |i, f, rules| {
        rules.push_str(&json_rule(&format!("args{i}"), f.params.clone()));
        format!("{} args{i}", lit(&head(&f.name)))
    })
}

/// `start: PREFIX call SUFFIX` where a call is `head(NAME)` and the function's parameters,
/// each `open(key, schema)`, its value and `close` (see [`xml_parameters`]), for the
/// XML-style formats.
pub(crate) fn xml_calls(
    prefix: &str,
    suffix: &str,
    functions: &[Function],
    head: impl Fn(&str) -> String,
    open: impl Fn(&str, &Value) -> String,
    close: &str,
) -> String {
    one_of(prefix, suffix, functions, |i, f, rules| {
        let params = xml_parameters(f, &format!("f{i}"), rules, &open, close);
        format!("{} {params}", lit(&head(&f.name)))
    })
}

/// `s` escaped for a Lark regular expression (`/…/`).
fn regex_escaped(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$'
            | '/' | '-' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// A function's parameters as a sequence of Lark items, required ones in schema order and
/// each optional one, in order, maybe: `open(key, schema)`, the value, then `close`. A
/// string parameter's value is text without `</`, one terminal with the `close` after it (so
/// the lexer never has to guess where the text ends); any other value is JSON of the
/// parameter's schema (with the function's `$defs`). (In a format whose `close` begins `<|`,
/// text may not hold `<|`.) Rules go to `rules`, named after `tag`.
fn xml_parameters(
    function: &Function,
    tag: &str,
    rules: &mut String,
    open: impl Fn(&str, &Value) -> String,
    close: &str,
) -> String {
    let props = function
        .params
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let required: Vec<&str> = function
        .params
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    // The text may not hold `<` followed by what follows `<` in `close` (`</`, `<|`).
    let after = close
        .split_once('<')
        .and_then(|(_, rest)| rest.chars().next())
        .map(|c| regex_escaped(&c.to_string()))
        .unwrap_or_else(|| "\\/".to_string());
    let mut seq = Vec::new();
    for (j, (key, schema)) in props.iter().enumerate() {
        let text = is_text(schema);
        let item = if text {
            let terminal = format!("{}_P{j}", tag.to_uppercase());
            rules.push_str(&format!(
                "{terminal}: /([^<]|<[^{after}])*{}/\n",
                regex_escaped(close)
            ));
            format!("{} {terminal}", lit(&open(key, schema)))
        } else {
            let rule = format!("{tag}_p{j}");
            let mut json_schema = schema.clone();
            for defs in ["$defs", "definitions"] {
                if let (Some(d), Some(obj)) =
                    (function.params.get(defs), json_schema.as_object_mut())
                {
                    obj.insert(defs.to_string(), d.clone());
                }
            }
            rules.push_str(&json_rule(&rule, json_schema));
            format!("{} {rule} {}", lit(&open(key, schema)), lit(close))
        };
        if required.contains(&key.as_str()) {
            seq.push(item);
        } else {
            seq.push(format!("({item})?"));
        }
    }
    seq.join(" ")
}

/// Whether a parameter is written as plain text: its schema allows a string.
pub(crate) fn is_text(schema: &Value) -> bool {
    match schema.get("type") {
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "string"),
        _ => schema
            .get("enum")
            .and_then(Value::as_array)
            .is_some_and(|e| e.iter().all(Value::is_string) && !e.is_empty()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn functions_are_checked() {
        assert!(functions(&[], None).is_err());
        let no_name = vec![json!({"type": "function", "function": {}})];
        assert!(functions(&no_name, None).is_err());
        let bad_params = vec![json!(
            {"type": "function", "function": {"name": "f", "parameters": "x"}})];
        assert!(functions(&bad_params, None).is_err());
        let other_kind = vec![json!({"type": "custom", "custom": {"name": "f"}})];
        assert!(functions(&other_kind, None).is_err());
        let two = vec![
            json!({"type": "function", "function": {"name": "a"}}),
            json!({"type": "function", "function": {"name": "b"}}),
        ];
        let e = functions(&two, Some("nope")).err().unwrap();
        assert!(e.contains("nope") && e.contains("\"a\""), "{e}");
        assert_eq!(functions(&two, Some("b")).unwrap()[0].name, "b");
    }
}
