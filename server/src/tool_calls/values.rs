//! What the XML-style formats (Qwen3-Coder, GLM, MiniMax, DSML) share: a parameter's value is
//! written as text, and read back as the JSON type its schema declares (as vLLM's parsers do:
//! a string stays the text; an integer, number, boolean, null, object or array is parsed, and
//! a value that does not parse as its type stays text); and `<tag name="…">` blocks are
//! found in a call's text.

use serde_json::{Map, Value};

use super::{RawCall, Tools};

/// The JSON types a schema allows (`type` as a string or a list, and those of its `anyOf` /
/// `oneOf` branches; an `enum` or `const` counts as the types of its values).
fn schema_types(schema: &Value) -> Vec<String> {
    let mut types = Vec::new();
    match schema.get("type") {
        Some(Value::String(t)) => types.push(t.clone()),
        Some(Value::Array(ts)) => {
            types.extend(ts.iter().filter_map(|t| t.as_str().map(String::from)))
        }
        _ => {}
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        for branch in schema
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            types.extend(schema_types(branch));
        }
    }
    let values = schema
        .get("enum")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .chain(schema.get("const").cloned());
    for v in values {
        types.push(
            match v {
                Value::String(_) => "string",
                Value::Number(_) => "number",
                Value::Bool(_) => "boolean",
                Value::Null => "null",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            }
            .to_string(),
        );
    }
    types
}

/// The value of a parameter written as `raw`, typed by its `schema` (`None`: the function does
/// not declare it, and it stays text).
pub(crate) fn typed_value(raw: &str, schema: Option<&Value>) -> Value {
    let Some(schema) = schema else {
        return Value::String(raw.to_string());
    };
    let types = schema_types(schema);
    if types.iter().any(|t| t == "string") {
        return Value::String(raw.to_string());
    }
    let text = raw.trim();
    let lowered = text.to_ascii_lowercase();
    let parsed: Option<Value> = match lowered.as_str() {
        // Python's spellings, which models trained on Python tool code also write.
        "true" | "false" => Some(Value::Bool(lowered == "true")),
        "none" | "null" => Some(Value::Null),
        _ => serde_json::from_str(text).ok(),
    };
    let fits = |v: &Value, t: &str| match t {
        "integer" => v.as_i64().is_some() || v.as_u64().is_some(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        _ => false,
    };
    match parsed {
        Some(v) if types.is_empty() || types.iter().any(|t| fits(&v, t)) => v,
        // An integer written as `3.0`.
        Some(Value::Number(n))
            if types.iter().any(|t| t == "integer")
                && n.as_f64()
                    .is_some_and(|f| f.fract() == 0.0 && f.abs() < 9.0e15) =>
        {
            Value::from(n.as_f64().unwrap_or_default() as i64)
        }
        _ => Value::String(raw.to_string()),
    }
}

/// `value` without one newline at each end (the XML formats put parameter values on lines of
/// their own).
pub(crate) fn strip_newlines(value: &str) -> &str {
    let v = value.strip_prefix('\n').unwrap_or(value);
    v.strip_suffix('\n').unwrap_or(v)
}

/// The texts between `begin` and `end` in `text`, in order, where only whitespace may lie
/// outside them; `None` when something else does, or one does not end.
pub(crate) fn delimited<'t>(text: &'t str, begin: &str, end: &str) -> Option<Vec<&'t str>> {
    let mut out = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            return Some(out);
        }
        let item = rest.strip_prefix(begin)?;
        let stop = item.find(end)?;
        out.push(&item[..stop]);
        rest = &item[stop + end.len()..];
    }
}

/// The blocks `<OPEN…>BODY</CLOSE>` of `text`, in order, as (the text between `open` and the
/// next `>`, the body), where `open` is e.g. `<invoke name=` and `close` e.g. `</invoke>`;
/// only whitespace may lie outside them (see [`delimited`]).
pub(crate) fn tagged_blocks<'t>(
    text: &'t str,
    open: &str,
    close: &str,
) -> Option<Vec<(&'t str, &'t str)>> {
    delimited(text, open, close)?
        .into_iter()
        .map(|item| item.split_once('>'))
        .collect()
}

/// The value of attribute `name` in a tag's head (`"get_weather"` in `"get_weather"` or in
/// `name="get_weather" string="true"` with `name` = `name`): quoted or bare.
pub(crate) fn attribute<'t>(head: &'t str, name: &str) -> Option<&'t str> {
    let at = head.find(&format!("{name}="))? + name.len() + 1;
    let v = &head[at..];
    if let Some(quoted) = v.strip_prefix('"') {
        return quoted.find('"').map(|end| &quoted[..end]);
    }
    Some(v.split_whitespace().next().unwrap_or(v))
}

/// The tag names of an `<invoke>`-style format (MiniMax's `<invoke name="…">` and
/// `<parameter name="…">`, DSML's `<｜DSML｜invoke name="…">`).
pub(crate) struct InvokeTags {
    pub invoke: &'static str,
    pub invoke_close: &'static str,
    pub parameter: &'static str,
    pub parameter_close: &'static str,
}

/// The calls of a block of `<invoke name="F"><parameter name="K">V</parameter></invoke>`
/// elements (in `tags`' spelling). A parameter with `string="true"` (DSML) is text, one with
/// `string="false"` JSON; otherwise its value is typed by the function's schema.
pub(crate) fn invoke_calls(body: &str, tags: &InvokeTags, tools: &Tools) -> Option<Vec<RawCall>> {
    let invokes = tagged_blocks(body, tags.invoke, tags.invoke_close)?;
    let mut calls = Vec::with_capacity(invokes.len());
    for (head, inner) in invokes {
        let name = attribute(head, "name").or_else(|| Some(head.trim().trim_matches('"')))?;
        if name.is_empty() {
            return None;
        }
        let mut arguments = Map::new();
        for (phead, value) in tagged_blocks(inner, tags.parameter, tags.parameter_close)? {
            let key = attribute(phead, "name").unwrap_or_else(|| phead.trim().trim_matches('"'));
            let v = match attribute(phead, "string") {
                Some("true") => Value::String(value.to_string()),
                Some("false") => serde_json::from_str(value.trim())
                    .unwrap_or_else(|_| typed_value(value, tools.parameter(name, key))),
                _ => typed_value(value, tools.parameter(name, key)),
            };
            arguments.insert(key.to_string(), v);
        }
        calls.push(RawCall {
            name: name.to_string(),
            arguments,
        });
    }
    Some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_take_their_schema_types() {
        let s = |t: Value| json!({ "type": t });
        assert_eq!(typed_value("42", Some(&s(json!("integer")))), json!(42));
        assert_eq!(typed_value("42", Some(&s(json!("string")))), json!("42"));
        assert_eq!(typed_value(" 2.5 ", Some(&s(json!("number")))), json!(2.5));
        assert_eq!(typed_value("True", Some(&s(json!("boolean")))), json!(true));
        assert_eq!(typed_value("3.0", Some(&s(json!("integer")))), json!(3));
        assert_eq!(
            typed_value("[1, 2]", Some(&s(json!("array")))),
            json!([1, 2])
        );
        assert_eq!(
            typed_value("{\"a\": null}", Some(&s(json!("object")))),
            json!({"a": null})
        );
        assert_eq!(
            typed_value("null", Some(&s(json!(["integer", "null"])))),
            json!(null)
        );
        // A value that is not of its type stays text; so does an undeclared parameter.
        assert_eq!(
            typed_value("many", Some(&s(json!("integer")))),
            json!("many")
        );
        assert_eq!(typed_value("7", None), json!("7"));
        assert_eq!(
            typed_value("b", Some(&json!({"enum": ["a", "b"]}))),
            json!("b")
        );
    }

    #[test]
    fn blocks_and_attributes() {
        let text = " <p name=\"a\">1</p>\n<p name=b string=\"true\">x y</p> ";
        let blocks = tagged_blocks(text, "<p ", "</p>").unwrap();
        assert_eq!(
            blocks,
            [("name=\"a\"", "1"), ("name=b string=\"true\"", "x y")]
        );
        assert_eq!(attribute(blocks[1].0, "string"), Some("true"));
        assert_eq!(attribute(blocks[1].0, "name"), Some("b"));
        assert!(tagged_blocks("junk <p a>1</p>", "<p ", "</p>").is_none());
        assert!(tagged_blocks("<p a>1", "<p ", "</p>").is_none());
    }
}
