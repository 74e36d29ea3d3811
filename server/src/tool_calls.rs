//! Reading tool calls and reasoning out of generated text. This module owns the Hermes/Qwen
//! tool-call format (`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, possibly
//! several, possibly after some text), the `<think>...</think>` reasoning split, their
//! streaming forms (which hold back anything that could still turn out to be a tag), and the
//! Lark grammar that forces one well-formed call when a request requires a tool.
//!
//! Content is trimmed: the finished forms return it without leading or trailing whitespace, and
//! the streaming forms emit exactly the same text (whitespace is held until something follows
//! it), so concatenating a stream's events always gives the finished result.

use colibri::runtime::grammar::{strict_json_schema, with_compact_json};
use serde_json::Value;

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

/// One parsed call, OpenAI-shaped pieces.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// `{id_prefix}_{n}`, where n counts the calls of one completion from 0.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// JSON text of the arguments object, compact.
    pub arguments: String,
}

/// Read the inside of a `<tool_call>` block: a JSON object with a non-empty string `name` and
/// an `arguments` object (also accepted: `parameters` for `arguments`, arguments given as a
/// string holding a JSON object, and no arguments at all, read as `{}`). Anything else is not a
/// call.
fn parse_call_body(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(Value::Object(m)) => Value::Object(m.clone()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => Value::Object(m),
            _ => return None,
        },
        Some(_) => return None,
    };
    Some((name.to_string(), args.to_string()))
}

/// Finds the `</tool_call>` that ends a block body: the first one outside a JSON string, so
/// arguments may mention the tag. Keeps its place between calls, for streaming.
#[derive(Debug, Default, Clone, Copy)]
struct BodyScan {
    pos: usize,
    in_str: bool,
    escaped: bool,
}

impl BodyScan {
    /// The byte offset of the closing tag in `body` (the block's text so far, growing between
    /// calls), or `None` when `body` holds none yet.
    fn find_close(&mut self, body: &str) -> Option<usize> {
        let b = body.as_bytes();
        while self.pos < b.len() {
            let c = b[self.pos];
            if self.in_str {
                if self.escaped {
                    self.escaped = false;
                } else if c == b'\\' {
                    self.escaped = true;
                } else if c == b'"' {
                    self.in_str = false;
                }
            } else if c == b'"' {
                self.in_str = true;
            } else if c == b'<' {
                // `<` is ASCII, so `pos` is a char boundary.
                let rest = &body[self.pos..];
                if rest.starts_with(CALL_CLOSE) {
                    return Some(self.pos);
                }
                if CALL_CLOSE.starts_with(rest) {
                    return None; // maybe a tag still arriving: look here again next time
                }
            }
            self.pos += 1;
        }
        None
    }
}

/// Split a finished completion: (content text without the tool-call blocks, trimmed; calls).
/// Invalid JSON inside a block is left as content (not a call), and so is a block with no
/// closing tag; a `</tool_call>` inside a JSON string does not close the block. ids are
/// `id_prefix` + `_` + a counter (e.g. id_prefix="call_abc" -> "call_abc_0", "call_abc_1").
/// The server reads text with [`ToolCallStream`] only; this finished form is what the tests
/// hold the streaming form to.
#[cfg(test)]
pub fn parse_tool_calls(text: &str, id_prefix: &str) -> (String, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(CALL_OPEN) {
        let after_open = &rest[open + CALL_OPEN.len()..];
        let Some(close) = BodyScan::default().find_close(after_open) else {
            break;
        };
        content.push_str(&rest[..open]);
        let body = &after_open[..close];
        match parse_call_body(body) {
            Some((name, arguments)) => calls.push(ToolCall {
                id: format!("{id_prefix}_{}", calls.len()),
                name,
                arguments,
            }),
            None => {
                content.push_str(CALL_OPEN);
                content.push_str(body);
                content.push_str(CALL_CLOSE);
            }
        }
        rest = &after_open[close + CALL_CLOSE.len()..];
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

/// The length of the longest suffix of `text` that is a proper prefix of `tag` (ASCII), i.e.
/// what must be held back because the tag may still be completed by the next piece.
fn partial_tag_len(text: &str, tag: &str) -> usize {
    let max = text.len().min(tag.len() - 1);
    (1..=max)
        .rev()
        .find(|&k| text.ends_with(&tag[..k]))
        .unwrap_or(0)
}

/// Trims a stream of text the way `str::trim` trims the whole: leading whitespace is dropped,
/// and whitespace is held back until something other than whitespace follows it.
#[derive(Debug, Default)]
struct Trimmer {
    started: bool,
    pending: String,
}

impl Trimmer {
    /// The part of `piece` that can be shown now (possibly empty).
    fn push(&mut self, piece: &str) -> String {
        let piece = if self.started {
            piece
        } else {
            piece.trim_start()
        };
        if piece.is_empty() {
            return String::new();
        }
        self.started = true;
        let body = piece.trim_end();
        if body.is_empty() {
            self.pending.push_str(piece);
            return String::new();
        }
        let mut out = std::mem::take(&mut self.pending);
        out.push_str(body);
        self.pending.push_str(&piece[body.len()..]);
        out
    }
}

/// An event of [`ToolCallStream`].
#[derive(Debug, Clone, PartialEq)]
pub enum ToolStreamEvent {
    /// Content text that is safe to show.
    Content(String),
    /// A complete tool call.
    Call(ToolCall),
}

/// Incremental `parse_tool_calls` for streaming: feed text pieces as they are generated; it
/// returns content text that is safe to show (never part of a `<tool_call>` tag: a suffix that
/// could start the tag is held back) and each complete tool call as soon as its closing tag
/// arrives (name and full arguments at once). The concatenated content equals
/// `parse_tool_calls`'s content, and the calls are the same, with the same ids.
#[derive(Debug)]
pub struct ToolCallStream {
    id_prefix: String,
    n_calls: usize,
    /// Text not yet emitted: outside a block, a held-back partial tag; inside, the block body.
    buf: String,
    in_call: bool,
    scan: BodyScan,
    out: Trimmer,
}

impl ToolCallStream {
    /// A stream whose calls get ids `{id_prefix}_0`, `{id_prefix}_1`, ...
    pub fn new(id_prefix: &str) -> Self {
        ToolCallStream {
            id_prefix: id_prefix.to_string(),
            n_calls: 0,
            buf: String::new(),
            in_call: false,
            scan: BodyScan::default(),
            out: Trimmer::default(),
        }
    }

    fn content(&mut self, events: &mut Vec<ToolStreamEvent>, text: &str) {
        let shown = self.out.push(text);
        if shown.is_empty() {
            return;
        }
        if let Some(ToolStreamEvent::Content(last)) = events.last_mut() {
            last.push_str(&shown);
        } else {
            events.push(ToolStreamEvent::Content(shown));
        }
    }

    /// Feed the next piece of generated text.
    pub fn push(&mut self, piece: &str) -> Vec<ToolStreamEvent> {
        let mut events = Vec::new();
        self.buf.push_str(piece);
        loop {
            if self.in_call {
                let Some(close) = self.scan.find_close(&self.buf) else {
                    break;
                };
                let body = self.buf[..close].to_string();
                self.buf.drain(..close + CALL_CLOSE.len());
                self.in_call = false;
                match parse_call_body(&body) {
                    Some((name, arguments)) => {
                        let id = format!("{}_{}", self.id_prefix, self.n_calls);
                        self.n_calls += 1;
                        events.push(ToolStreamEvent::Call(ToolCall {
                            id,
                            name,
                            arguments,
                        }));
                    }
                    None => {
                        let text = format!("{CALL_OPEN}{body}{CALL_CLOSE}");
                        self.content(&mut events, &text);
                    }
                }
            } else if let Some(open) = self.buf.find(CALL_OPEN) {
                let before = self.buf[..open].to_string();
                self.content(&mut events, &before);
                self.buf.drain(..open + CALL_OPEN.len());
                self.in_call = true;
                self.scan = BodyScan::default();
            } else {
                let keep = partial_tag_len(&self.buf, CALL_OPEN);
                let shown = self.buf[..self.buf.len() - keep].to_string();
                self.content(&mut events, &shown);
                self.buf.drain(..self.buf.len() - keep);
                break;
            }
        }
        events
    }

    /// The end of the text: flush what was held back; an unterminated block is content.
    pub fn finish(&mut self) -> Vec<ToolStreamEvent> {
        let mut events = Vec::new();
        let mut rest = std::mem::take(&mut self.buf);
        if self.in_call {
            rest.insert_str(0, CALL_OPEN);
            self.in_call = false;
        }
        self.content(&mut events, &rest);
        events
    }
}

/// Reasoning split for finished text: (reasoning, content), both trimmed; reasoning is `None`
/// when there is none or it is blank. `started_inside` = the prompt already opened `<think>`,
/// so the text is reasoning up to `</think>`; otherwise there is reasoning only when the text
/// starts (after whitespace) with `<think>`. A thought that never closes is all reasoning.
/// The server reads text with [`ReasoningStream`] only; this finished form is what the tests
/// hold the streaming form to.
#[cfg(test)]
pub fn split_reasoning(text: &str, started_inside: bool) -> (Option<String>, String) {
    let inside = if started_inside {
        text
    } else {
        match text.trim_start().strip_prefix(THINK_OPEN) {
            Some(rest) => rest,
            // No thought: the answer is the text exactly as generated.
            None => return (None, text.to_string()),
        }
    };
    let (reasoning, content) = match inside.find(THINK_CLOSE) {
        Some(i) => (&inside[..i], &inside[i + THINK_CLOSE.len()..]),
        None => (inside, ""),
    };
    let reasoning = reasoning.trim();
    (
        (!reasoning.is_empty()).then(|| reasoning.to_string()),
        content.trim().to_string(),
    )
}

/// An event of [`ReasoningStream`].
#[derive(Debug, Clone, PartialEq)]
pub enum ReasoningEvent {
    /// Text of the thought.
    Reasoning(String),
    /// Text of the answer.
    Content(String),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Phase {
    /// Not yet known whether the text opens with `<think>`.
    Undecided,
    /// Inside the thought.
    Thinking,
    /// In the answer.
    Answer,
}

/// Streaming `split_reasoning`, holding back partial tags. The concatenated events of each
/// kind equal the finished split (no reasoning events when it returns `None`).
#[derive(Debug)]
pub struct ReasoningStream {
    phase: Phase,
    buf: String,
    reasoning: Trimmer,
    content: Trimmer,
    /// The text opened without `<think>`: the answer passes through untrimmed.
    raw_content: bool,
}

impl ReasoningStream {
    /// `started_inside` = the prompt already opened `<think>`.
    pub fn new(started_inside: bool) -> Self {
        ReasoningStream {
            phase: if started_inside {
                Phase::Thinking
            } else {
                Phase::Undecided
            },
            buf: String::new(),
            reasoning: Trimmer::default(),
            content: Trimmer::default(),
            raw_content: false,
        }
    }

    fn emit(&mut self, events: &mut Vec<ReasoningEvent>, reasoning: bool, text: &str) {
        let shown = if reasoning {
            self.reasoning.push(text)
        } else if self.raw_content {
            text.to_string()
        } else {
            self.content.push(text)
        };
        if shown.is_empty() {
            return;
        }
        match events.last_mut() {
            Some(ReasoningEvent::Reasoning(last)) if reasoning => last.push_str(&shown),
            Some(ReasoningEvent::Content(last)) if !reasoning => last.push_str(&shown),
            _ if reasoning => events.push(ReasoningEvent::Reasoning(shown)),
            _ => events.push(ReasoningEvent::Content(shown)),
        }
    }

    /// Feed the next piece of generated text.
    pub fn push(&mut self, piece: &str) -> Vec<ReasoningEvent> {
        let mut events = Vec::new();
        self.buf.push_str(piece);
        loop {
            match self.phase {
                Phase::Undecided => {
                    let start = self.buf.trim_start();
                    if let Some(rest) = start.strip_prefix(THINK_OPEN) {
                        self.buf = rest.to_string();
                        self.phase = Phase::Thinking;
                    } else if THINK_OPEN.starts_with(start) {
                        break; // blank, or a prefix of the tag: wait
                    } else {
                        self.phase = Phase::Answer;
                        self.raw_content = true;
                    }
                }
                Phase::Thinking => {
                    if let Some(i) = self.buf.find(THINK_CLOSE) {
                        let thought = self.buf[..i].to_string();
                        self.emit(&mut events, true, &thought);
                        self.buf.drain(..i + THINK_CLOSE.len());
                        self.phase = Phase::Answer;
                    } else {
                        let keep = partial_tag_len(&self.buf, THINK_CLOSE);
                        let thought = self.buf[..self.buf.len() - keep].to_string();
                        self.emit(&mut events, true, &thought);
                        self.buf.drain(..self.buf.len() - keep);
                        break;
                    }
                }
                Phase::Answer => {
                    let text = std::mem::take(&mut self.buf);
                    self.emit(&mut events, false, &text);
                    break;
                }
            }
        }
        events
    }

    /// The end of the text: flush what was held back.
    pub fn finish(&mut self) -> Vec<ReasoningEvent> {
        let mut events = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if self.phase == Phase::Undecided {
            // It never opened `<think>`: all of it is the answer, as generated.
            self.raw_content = true;
        }
        let reasoning = self.phase == Phase::Thinking;
        self.emit(&mut events, reasoning, &rest);
        events
    }
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

/// A llguidance Lark grammar that forces exactly one Hermes-style tool call for the given
/// OpenAI `tools` array (optionally restricted to the function named `only`):
///
/// ```text
/// start: "<tool_call>\n" json_call "\n</tool_call>"
/// json_call: %json {"anyOf": [{"type": "object", "properties": {"name": {"const": NAME},
///     "arguments": PARAMETERS}, "required": ["name", "arguments"],
///     "additionalProperties": false}, ...], "$defs": {...}, "x-guidance": {...}}
/// ```
///
/// The call is compact JSON (no whitespace between tokens: the arguments are re-serialized
/// anyway), and each function's parameters get the engine's strict defaults
/// ([`strict_json_schema`]: objects that list their properties closed, numbers bounded) unless
/// the function says `"strict": false`. A function without `parameters` takes none (`{}`). A
/// parameters schema with local `$ref`s moves under `$defs/fn{i}` with its refs rebased, so
/// pydantic-style `$defs` keep working. Fails when no function is usable or `only` names none
/// of them.
pub fn required_tool_call_grammar(tools: &[Value], only: Option<&str>) -> Result<String, String> {
    let mut options = Vec::new();
    let mut defs = serde_json::Map::new();
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
            None | Some(Value::Null) => {
                serde_json::json!({
                    "type": "object",
                    "properties": {},
                    "additionalProperties": false,
                })
            }
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
        if has_local_ref(&params) {
            let key = format!("fn{i}");
            rebase_refs(&mut params, &format!("#/$defs/{key}"));
            defs.insert(key.clone(), params);
            params = serde_json::json!({ "$ref": format!("#/$defs/{key}") });
        }
        options.push(serde_json::json!({
            "type": "object",
            "properties": { "name": { "const": name }, "arguments": params },
            "required": ["name", "arguments"],
            "additionalProperties": false,
        }));
    }
    if options.is_empty() {
        return Err(match only {
            Some(o) => format!("tool_choice names {o:?}, which is not among the tools {names:?}"),
            None => "no function tools to call".to_string(),
        });
    }
    let mut schema = serde_json::Map::new();
    schema.insert("anyOf".to_string(), Value::Array(options));
    if !defs.is_empty() {
        schema.insert("$defs".to_string(), Value::Object(defs));
    }
    Ok(format!(
        "start: \"<tool_call>\\n\" json_call \"\\n</tool_call>\"\njson_call: %json {}\n",
        with_compact_json(Value::Object(schema))
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: id.to_string(),
            name: name.to_string(),
            arguments: arguments.to_string(),
        }
    }

    /// Every way of cutting `text` into two pieces at char boundaries, plus one char at a
    /// time.
    fn splits(text: &str) -> Vec<Vec<&str>> {
        let mut out: Vec<Vec<&str>> = text
            .char_indices()
            .map(|(i, _)| i)
            .chain([text.len()])
            .map(|i| vec![&text[..i], &text[i..]])
            .collect();
        out.push(
            text.char_indices()
                .map(|(i, c)| &text[i..i + c.len_utf8()])
                .collect(),
        );
        out
    }

    fn stream_tools(pieces: &[&str], prefix: &str) -> (String, Vec<ToolCall>) {
        let mut s = ToolCallStream::new(prefix);
        let mut content = String::new();
        let mut calls = Vec::new();
        let mut events: Vec<ToolStreamEvent> = Vec::new();
        for p in pieces {
            events.extend(s.push(p));
        }
        events.extend(s.finish());
        for e in events {
            match e {
                ToolStreamEvent::Content(t) => {
                    assert!(!t.is_empty(), "empty content event");
                    content.push_str(&t)
                }
                ToolStreamEvent::Call(c) => calls.push(c),
            }
        }
        (content, calls)
    }

    /// The finished parse of `text` is `want`, and so is every streamed split of it.
    fn check_tools(text: &str, want_content: &str, want_calls: &[ToolCall]) {
        let got = parse_tool_calls(text, "call_x");
        assert_eq!(got.0, want_content, "content of {text:?}");
        assert_eq!(got.1, want_calls, "calls of {text:?}");
        for pieces in splits(text) {
            let streamed = stream_tools(&pieces, "call_x");
            assert_eq!(streamed, got, "pieces {pieces:?}");
        }
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
        let mut s = ToolCallStream::new("c");
        assert_eq!(
            s.push("Hello <tool"),
            vec![ToolStreamEvent::Content("Hello".into())]
        );
        assert_eq!(
            s.push("box> and"),
            vec![ToolStreamEvent::Content(" <toolbox> and".into())]
        );
        assert_eq!(s.push(" "), vec![]);
        assert_eq!(s.finish(), vec![]);
        let mut s = ToolCallStream::new("c");
        assert_eq!(s.push("<tool_call>{\"name\": \"f\"}"), vec![]);
        assert_eq!(
            s.push("</tool_call>"),
            vec![ToolStreamEvent::Call(call("c_0", "f", "{}"))]
        );
    }

    #[test]
    fn ids_use_prefix() {
        let (_, calls) = parse_tool_calls(
            "<tool_call>{\"name\":\"a\"}</tool_call><tool_call>{\"name\":\"b\"}</tool_call>",
            "call_abc",
        );
        let ids: Vec<&str> = calls.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["call_abc_0", "call_abc_1"]);
    }

    fn stream_reasoning(pieces: &[&str], started_inside: bool) -> (Option<String>, String) {
        let mut s = ReasoningStream::new(started_inside);
        let mut events = Vec::new();
        for p in pieces {
            events.extend(s.push(p));
        }
        events.extend(s.finish());
        let (mut reasoning, mut content) = (None::<String>, String::new());
        for e in events {
            match e {
                ReasoningEvent::Reasoning(t) => {
                    assert!(!t.is_empty());
                    reasoning.get_or_insert_with(String::new).push_str(&t)
                }
                ReasoningEvent::Content(t) => {
                    assert!(!t.is_empty());
                    content.push_str(&t)
                }
            }
        }
        (reasoning, content)
    }

    fn check_reasoning(text: &str, started_inside: bool, want: (Option<&str>, &str)) {
        let got = split_reasoning(text, started_inside);
        assert_eq!(
            (got.0.as_deref(), got.1.as_str()),
            want,
            "{text:?} started_inside={started_inside}"
        );
        for pieces in splits(text) {
            assert_eq!(
                stream_reasoning(&pieces, started_inside),
                got,
                "pieces {pieces:?}"
            );
        }
    }

    #[test]
    fn think_block_at_start() {
        check_reasoning(
            "<think>\nThe user wants X.\nSo Y.\n</think>\n\nThe answer is Y.",
            false,
            (Some("The user wants X.\nSo Y."), "The answer is Y."),
        );
        check_reasoning("  \n<think>a</think>b", false, (Some("a"), "b"));
    }

    #[test]
    fn no_think_block() {
        check_reasoning("Just an answer.", false, (None, "Just an answer."));
        check_reasoning(
            "  <thinking> is a word",
            false,
            (None, "  <thinking> is a word"),
        );
        // Without a thought the answer is exactly the generated text, whitespace included.
        check_reasoning(" a\n", false, (None, " a\n"));
        check_reasoning("  ", false, (None, "  "));
        check_reasoning("<thi", false, (None, "<thi"));
        check_reasoning(
            "Answer with </think> inside",
            false,
            (None, "Answer with </think> inside"),
        );
        check_reasoning("<thin", false, (None, "<thin"));
        check_reasoning("", false, (None, ""));
    }

    #[test]
    fn empty_think_block() {
        check_reasoning("<think>\n\n</think>\n\nHi!", false, (None, "Hi!"));
    }

    #[test]
    fn started_inside_thought() {
        check_reasoning(
            "Let me think.\n</think>\n\nDone.",
            true,
            (Some("Let me think."), "Done."),
        );
        // The answer may itself mention the tags.
        check_reasoning(
            "x</think>y <think>z</think>",
            true,
            (Some("x"), "y <think>z</think>"),
        );
        // Ran out of tokens while thinking.
        check_reasoning(
            "still thinking </thi",
            true,
            (Some("still thinking </thi"), ""),
        );
    }

    #[test]
    fn unterminated_thought_is_reasoning() {
        check_reasoning("<think>hmm, maybe", false, (Some("hmm, maybe"), ""));
    }

    #[test]
    fn unicode_reasoning() {
        check_reasoning(
            "<think>思考中… 🤔 Zürich</think>答え: 東京 ✓",
            false,
            (Some("思考中… 🤔 Zürich"), "答え: 東京 ✓"),
        );
        check_reasoning("考え </think> 答", true, (Some("考え"), "答"));
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
        let g = required_tool_call_grammar(&weather_tools(), None).unwrap();
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
        let g = required_tool_call_grammar(&weather_tools(), Some("get_time")).unwrap();
        let p = payload(&g);
        let options = p["anyOf"].as_array().unwrap();
        assert_eq!(options.len(), 1);
        assert_eq!(options[0]["properties"]["name"]["const"], "get_time");
        let e = required_tool_call_grammar(&weather_tools(), Some("nope")).unwrap_err();
        assert!(e.contains("nope") && e.contains("get_weather"), "{e}");
    }

    #[test]
    fn tool_grammar_errors() {
        assert!(required_tool_call_grammar(&[], None).is_err());
        let no_name = vec![serde_json::json!({"type": "function", "function": {}})];
        assert!(required_tool_call_grammar(&no_name, None).is_err());
        let bad_params = vec![serde_json::json!(
            {"type": "function", "function": {"name": "f", "parameters": "x"}})];
        assert!(required_tool_call_grammar(&bad_params, None).is_err());
        let other_kind = vec![serde_json::json!({"type": "custom", "custom": {"name": "f"}})];
        assert!(required_tool_call_grammar(&other_kind, None).is_err());
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
            let p = payload(&required_tool_call_grammar(&tool(strict), None).unwrap());
            let args = &p["anyOf"][0]["properties"]["arguments"];
            assert_eq!(args["additionalProperties"], false, "{strict:?}");
            assert_eq!(
                args["properties"]["a"]["maximum"],
                colibri::runtime::grammar::JSON_INTEGER_BOUND
            );
            assert!(args["properties"]["b"]["minimum"].is_number());
        }
        let p = payload(&required_tool_call_grammar(&tool(Some(false)), None).unwrap());
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
        let p = payload(&required_tool_call_grammar(&tools, None).unwrap());
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
