//! What a JSON constraint allows where its schema leaves it open, so that a model cannot run on
//! inside a valid output until `max_tokens` cuts it:
//!
//! * compact output: no whitespace between JSON tokens, `,` and `:` as separators
//!   ([`with_compact_json`]; a schema's own `x-guidance` options take precedence);
//! * strict schemas ([`strict_json_schema`], unless the request says `strict: false`): an
//!   object schema that lists `properties` and says nothing about other keys gets
//!   `additionalProperties: false` (OpenAI's strict mode, llama.cpp's default), and a number
//!   without bounds gets them: integers of at most 16 digits (llama.cpp's
//!   `[1-9][0-9]{0,15}`), numbers with at most 16 digits before the point (and so no
//!   exponent).

use serde_json::{json, Map, Value};

/// The largest magnitude a strict schema's integer may have where the schema sets no bound:
/// 16 digits.
pub const JSON_INTEGER_BOUND: i64 = 9_999_999_999_999_999;

/// The bound of a strict schema's number where the schema sets none: at most 16 digits
/// before the point.
pub const JSON_NUMBER_BOUND: f64 = 1e16;

/// llguidance's JSON compile options for compact output (no whitespace between tokens, its
/// default `,` and `:` separators), with `oneOf` read as `anyOf` (pydantic and OpenAI clients
/// write `oneOf` for unions).
fn compact_options() -> Map<String, Value> {
    let v = json!({"whitespace_flexible": false, "coerce_one_of": true});
    match v {
        Value::Object(m) => m,
        _ => unreachable!("a JSON object literal"),
    }
}

/// `schema` with llguidance's compile options (`x-guidance`) for compact output; options the
/// schema brings itself override these, key by key (for example
/// `{"x-guidance": {"whitespace_flexible": true}}` lets the model indent). A boolean schema is
/// returned as it is.
pub fn with_compact_json(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        let mut options = compact_options();
        if let Some(Value::Object(own)) = obj.get("x-guidance") {
            for (k, v) in own {
                options.insert(k.clone(), v.clone());
            }
        }
        obj.insert("x-guidance".to_string(), Value::Object(options));
    }
    schema
}

/// Apply the strict defaults to every subschema of `schema` (see the module documentation).
/// Objects under `allOf` (and objects with an `allOf`) are left open: closing each part of an
/// intersection would forbid the keys of the other parts.
pub fn strict_json_schema(schema: &mut Value) {
    strict_node(schema, false);
}

fn strict_node(node: &mut Value, in_all_of: bool) {
    let Value::Object(map) = node else { return };
    for (k, v) in map.iter_mut() {
        match k.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Value::Object(m) = v {
                    m.values_mut().for_each(|s| strict_node(s, false));
                }
            }
            "items" | "prefixItems" => match v {
                Value::Array(a) => a.iter_mut().for_each(|s| strict_node(s, false)),
                s => strict_node(s, false),
            },
            "anyOf" | "oneOf" => {
                if let Value::Array(a) = v {
                    a.iter_mut().for_each(|s| strict_node(s, false));
                }
            }
            "allOf" => {
                if let Value::Array(a) = v {
                    a.iter_mut().for_each(|s| strict_node(s, true));
                }
            }
            "additionalProperties"
            | "additionalItems"
            | "contains"
            | "propertyNames"
            | "not"
            | "if"
            | "then"
            | "else"
            | "unevaluatedItems"
            | "unevaluatedProperties" => strict_node(v, false),
            _ => {}
        }
    }
    let has_type = |t: &str| match map.get("type") {
        Some(Value::String(s)) => s == t,
        Some(Value::Array(a)) => a.iter().any(|x| x.as_str() == Some(t)),
        _ => false,
    };
    let (number, integer) = (has_type("number"), has_type("integer"));
    let closable = map.contains_key("properties")
        && !in_all_of
        && !map.contains_key("allOf")
        && !map.contains_key("additionalProperties")
        && !map.contains_key("unevaluatedProperties");
    if closable {
        map.insert("additionalProperties".to_string(), Value::Bool(false));
    }
    let (low, high) = if number {
        (json!(-JSON_NUMBER_BOUND), json!(JSON_NUMBER_BOUND))
    } else if integer {
        (json!(-JSON_INTEGER_BOUND), json!(JSON_INTEGER_BOUND))
    } else {
        return;
    };
    let bound = |key: &str, exclusive: &str| -> Option<f64> {
        map.get(key)
            .and_then(Value::as_f64)
            .or_else(|| map.get(exclusive).and_then(Value::as_f64))
    };
    let (min, max) = (
        bound("minimum", "exclusiveMinimum"),
        bound("maximum", "exclusiveMaximum"),
    );
    let (low_f, high_f) = (low.as_f64().unwrap_or(0.0), high.as_f64().unwrap_or(0.0));
    // A bound of the schema's own beyond ours: leave the other side as it is rather than
    // make the range empty.
    if min.is_none() && max.is_none_or(|m| m >= low_f) {
        map.insert("minimum".to_string(), low);
    }
    if max.is_none() && min.is_none_or(|m| m <= high_f) {
        map.insert("maximum".to_string(), high);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_with_properties_are_closed() {
        let mut s = json!({"type": "object", "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "free": {"type": "object"},
            "open": {"type": "object", "properties": {}, "additionalProperties": true},
            "list": {"type": "array", "items": {"properties": {"c": {}}}},
            "either": {"anyOf": [{"properties": {"d": {}}}, {"type": "null"}]},
            "both": {"allOf": [{"properties": {"e": {}}}, {"properties": {"f": {}}}]}
        }, "$defs": {"X": {"properties": {"g": {}}}}});
        strict_json_schema(&mut s);
        let p = &s["properties"];
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(p["a"]["additionalProperties"], false);
        assert_eq!(
            p["free"].get("additionalProperties"),
            None,
            "a free-form object"
        );
        assert_eq!(
            p["open"]["additionalProperties"], true,
            "the schema's own word"
        );
        assert_eq!(p["list"]["items"]["additionalProperties"], false);
        assert_eq!(p["either"]["anyOf"][0]["additionalProperties"], false);
        assert_eq!(p["both"]["allOf"][0].get("additionalProperties"), None);
        assert_eq!(s["$defs"]["X"]["additionalProperties"], false);
        // Values are not schemas: `const`, `enum`, `default` stay as they are.
        let mut s = json!({"const": {"properties": {"x": 1}}, "default": {"properties": {}}});
        let before = s.clone();
        strict_json_schema(&mut s);
        assert_eq!(s, before);
    }

    #[test]
    fn numbers_get_bounds_they_lack() {
        let mut s = json!({"type": "object", "properties": {
            "i": {"type": "integer"},
            "n": {"type": ["number", "null"]},
            "low": {"type": "integer", "minimum": 0},
            "high": {"type": "integer", "exclusiveMaximum": 10},
            "huge": {"type": "integer", "minimum": 1e20},
            "s": {"type": "string"}
        }});
        strict_json_schema(&mut s);
        let p = &s["properties"];
        assert_eq!(p["i"]["minimum"], -JSON_INTEGER_BOUND);
        assert_eq!(p["i"]["maximum"], JSON_INTEGER_BOUND);
        assert_eq!(p["n"]["minimum"], -JSON_NUMBER_BOUND);
        assert_eq!(p["n"]["maximum"], JSON_NUMBER_BOUND);
        assert_eq!(p["low"]["minimum"], 0);
        assert_eq!(p["low"]["maximum"], JSON_INTEGER_BOUND);
        assert_eq!(p["high"]["minimum"], -JSON_INTEGER_BOUND);
        assert_eq!(p["high"].get("maximum"), None);
        assert_eq!(p["huge"].get("maximum"), None, "no empty range");
        assert_eq!(p["s"], json!({"type": "string"}));
        assert_eq!(JSON_INTEGER_BOUND.to_string().len(), 16);
    }

    #[test]
    fn compact_options_merge_under_the_schemas_own() {
        let s = with_compact_json(json!({"type": "object"}));
        assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
        assert_eq!(s["x-guidance"]["coerce_one_of"], true);
        let s = with_compact_json(json!({"x-guidance": {"whitespace_flexible": true}}));
        assert_eq!(s["x-guidance"]["whitespace_flexible"], true);
        assert_eq!(s["x-guidance"]["coerce_one_of"], true);
        assert_eq!(with_compact_json(json!(true)), json!(true));
    }
}
