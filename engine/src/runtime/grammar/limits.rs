//! The size and depth a constraint may have before llguidance compiles it.
//!
//! llguidance compiles schemas and grammars by recursion: a `$ref` chain, a chain of Lark rules
//! each naming the next, or brackets nested in brackets each take stack frames, and a deep
//! enough one overflows any thread's stack, which aborts the whole process. So every constraint
//! is measured here first, without recursion deeper than the limit itself, and one that is too
//! large or too deep is refused before it is compiled; what passes is compiled on a thread whose
//! stack holds many times what the deepest accepted constraint needs
//! (`COMPILE_STACK_BYTES` in the parent module).
//!
//! Depth counts what llguidance recurses on:
//!
//! * a JSON Schema: each object or array of the schema document is one level, and a local
//!   `$ref` (`#`, `#/json/pointer`) is followed as one more level into its target (a `$ref` back
//!   into the chain it came from is not followed again, as llguidance does not); regexes given
//!   as `pattern` or `patternProperties` keys count their brackets;
//! * a Lark grammar: each rule or terminal is one level, plus the brackets around each name it
//!   uses, following names from rule to rule (again not around a cycle); the schema of every
//!   `%json` in it is measured as above;
//! * a regex: its brackets.

use std::collections::{HashMap, HashSet};

use serde_json::Value;

/// The most bytes a constraint may have: a Lark grammar or regex as text, a JSON Schema as
/// compact JSON. Large tool lists and generated schemas fit; llguidance's own grammar limits
/// start around a few megabytes.
pub const MAX_CONSTRAINT_BYTES: usize = 512 * 1024;

/// The deepest a constraint may nest (see the module documentation for what a level is). Real
/// schemas and grammars stay far below it: 64 nested objects, or a Lark expression grammar
/// with dozens of precedence levels.
pub const MAX_CONSTRAINT_DEPTH: usize = 128;

/// How a constraint exceeds a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Exceeded {
    /// It has this many bytes, more than [`MAX_CONSTRAINT_BYTES`].
    Bytes(usize),
    /// It nests deeper than [`MAX_CONSTRAINT_DEPTH`]; `at` says where the limit was crossed.
    Depth { at: String },
}

fn check_bytes(n: usize) -> Result<(), Exceeded> {
    if n > MAX_CONSTRAINT_BYTES {
        Err(Exceeded::Bytes(n))
    } else {
        Ok(())
    }
}

/// Counts the bytes of a serialization without keeping them.
struct ByteCount(usize);

impl std::io::Write for ByteCount {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Check a JSON Schema's size (as compact JSON) and depth.
pub(super) fn check_schema(schema: &Value) -> Result<(), Exceeded> {
    let mut count = ByteCount(0);
    // Writing into a counter cannot fail.
    let _ = serde_json::to_writer(&mut count, schema);
    check_bytes(count.0)?;
    SchemaDepth::new(schema).height(schema, "#".to_string(), 0)?;
    Ok(())
}

/// Check a regex's size and bracket depth.
pub(super) fn check_regex(rx: &str) -> Result<(), Exceeded> {
    check_bytes(rx.len())?;
    if regex_depth(rx) > MAX_CONSTRAINT_DEPTH {
        return Err(Exceeded::Depth {
            at: "the regex's brackets".to_string(),
        });
    }
    Ok(())
}

/// The deepest bracket nesting of a regex (`(` and `[`; escaped characters do not count).
fn regex_depth(rx: &str) -> usize {
    let b = rx.as_bytes();
    let (mut i, mut depth, mut max) = (0, 0usize, 0);
    while i < b.len() {
        match b[i] {
            b'\\' => i += 1,
            b'(' | b'[' => {
                depth += 1;
                max = max.max(depth);
            }
            b')' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    max
}

/// Heights of schema nodes, following local `$ref`s.
struct SchemaDepth<'a> {
    root: &'a Value,
    /// Height of each node measured so far, by address.
    memo: HashMap<*const Value, usize>,
    /// Nodes on the current chain (a `$ref` to one of them is a cycle, not followed).
    on_path: HashSet<*const Value>,
}

impl<'a> SchemaDepth<'a> {
    fn new(root: &'a Value) -> Self {
        SchemaDepth {
            root,
            memo: HashMap::new(),
            on_path: HashSet::new(),
        }
    }

    /// The target of a local `$ref`, when it is one this document holds.
    fn resolve(&self, reference: &str) -> Option<&'a Value> {
        let fragment = reference.strip_prefix('#')?;
        if fragment.is_empty() {
            return Some(self.root);
        }
        if !fragment.starts_with('/') {
            return None; // an anchor name: llguidance reports what it makes of it
        }
        self.root.pointer(&percent_decode(fragment))
    }

    /// The height of `v` (a scalar 0, a container 1 more than its highest child, a `$ref` 1
    /// more than its target) where `level` levels lie above it; an error once `level` plus the
    /// height passes the limit. Recursion never goes deeper than the limit.
    fn height(&mut self, v: &'a Value, at: String, level: usize) -> Result<usize, Exceeded> {
        let key = v as *const Value;
        if let Some(&h) = self.memo.get(&key) {
            if level + h > MAX_CONSTRAINT_DEPTH {
                return Err(Exceeded::Depth { at });
            }
            return Ok(h);
        }
        let children: Vec<(&'a Value, String)> = match v {
            Value::Array(items) => items
                .iter()
                .enumerate()
                .map(|(i, x)| (x, format!("{at}/{i}")))
                .collect(),
            Value::Object(map) => map
                .iter()
                .map(|(k, x)| (x, format!("{at}/{}", escape_pointer(k))))
                .collect(),
            _ => return Ok(0),
        };
        if level + 1 > MAX_CONSTRAINT_DEPTH {
            return Err(Exceeded::Depth { at });
        }
        self.on_path.insert(key);
        let mut h = 1;
        for (child, child_at) in children {
            h = h.max(1 + self.height(child, child_at, level + 1)?);
        }
        if let Value::Object(map) = v {
            if let Some(Value::String(pattern)) = map.get("pattern") {
                h = h.max(regex_depth(pattern));
            }
            if let Some(Value::Object(patterns)) = map.get("patternProperties") {
                for p in patterns.keys() {
                    h = h.max(1 + regex_depth(p));
                }
            }
            if let Some(target) = map
                .get("$ref")
                .and_then(Value::as_str)
                .and_then(|r| self.resolve(r))
            {
                if !self.on_path.contains(&(target as *const Value)) {
                    let target_at = map["$ref"].as_str().unwrap_or("#").to_string();
                    h = h.max(1 + self.height(target, target_at, level + 1)?);
                }
            }
        }
        self.on_path.remove(&key);
        if level + h > MAX_CONSTRAINT_DEPTH {
            return Err(Exceeded::Depth { at });
        }
        self.memo.insert(key, h);
        Ok(h)
    }
}

/// `%XX` escapes of a URI fragment decoded (a malformed one is left as it is).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_string())
}

/// A key as a JSON pointer segment.
fn escape_pointer(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// One rule or terminal of a Lark grammar, as far as depth goes.
struct LarkDef<'a> {
    name: &'a str,
    /// The names its body uses, each with the bracket depth it stands at.
    uses: Vec<(&'a str, usize)>,
    /// The deepest bracket nesting of its body.
    brackets: usize,
}

/// Check a Lark grammar's size and depth (and the schema of every `%json` in it).
pub(super) fn check_lark(text: &str) -> Result<(), Exceeded> {
    check_bytes(text.len())?;
    let defs = scan_lark(text)?;
    let mut by_name: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, d) in defs.iter().enumerate() {
        by_name.entry(d.name).or_default().push(i);
    }
    let mut walk = LarkDepth {
        defs: &defs,
        by_name: &by_name,
        memo: vec![None; defs.len()],
        on_path: vec![false; defs.len()],
    };
    for i in 0..defs.len() {
        walk.height(i, 0)?;
    }
    Ok(())
}

struct LarkDepth<'d, 'a> {
    defs: &'d [LarkDef<'a>],
    by_name: &'d HashMap<&'a str, Vec<usize>>,
    memo: Vec<Option<usize>>,
    on_path: Vec<bool>,
}

impl LarkDepth<'_, '_> {
    /// The height of definition `i` (1, plus the deepest of its brackets and of the names it
    /// uses, each with the brackets around it) where `level` levels lie above it.
    fn height(&mut self, i: usize, level: usize) -> Result<usize, Exceeded> {
        let too_deep = |name: &str| Exceeded::Depth {
            at: format!("rule `{name}`"),
        };
        let def = &self.defs[i];
        if let Some(h) = self.memo[i] {
            if level + h > MAX_CONSTRAINT_DEPTH {
                return Err(too_deep(def.name));
            }
            return Ok(h);
        }
        if level + 1 + def.brackets > MAX_CONSTRAINT_DEPTH {
            return Err(too_deep(def.name));
        }
        self.on_path[i] = true;
        let mut h = 1 + def.brackets;
        for &(name, brackets) in &def.uses {
            let Some(targets) = self.by_name.get(name) else {
                continue; // imported or undefined: llguidance says which
            };
            for &t in targets {
                if self.on_path[t] {
                    continue;
                }
                h = h.max(1 + brackets + self.height(t, level + 1 + brackets)?);
            }
        }
        self.on_path[i] = false;
        if level + h > MAX_CONSTRAINT_DEPTH {
            return Err(too_deep(def.name));
        }
        self.memo[i] = Some(h);
        Ok(h)
    }
}

fn is_name_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || c == b'_'
}

fn is_name_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'-'
}

/// The definitions of a Lark grammar (llguidance's dialect) with the names each uses, read
/// without parsing it: comments, strings, regexes, special tokens and the JSON of `%json`,
/// `%regex` and `%llguidance` are skipped; a definition is `name:` (optionally `?name`,
/// `!name`, `name.PRIORITY`, `name[ATTRIBUTES]`) at the start of a line outside brackets. A
/// malformed grammar is measured as far as it goes; llguidance reports what is wrong with it.
fn scan_lark(text: &str) -> Result<Vec<LarkDef<'_>>, Exceeded> {
    let b = text.as_bytes();
    let mut defs: Vec<LarkDef<'_>> = Vec::new();
    let mut current: Option<usize> = None;
    let mut depth = 0usize;
    let mut line_start = true;
    let mut i = 0;
    let skip_string = |mut i: usize| -> usize {
        // `i` is at the opening quote.
        i += 1;
        while i < b.len() && b[i] != b'"' {
            if b[i] == b'\\' {
                i += 1;
            }
            i += 1;
        }
        i + 1
    };
    while i < b.len() {
        let c = b[i];
        match c {
            b'\n' => {
                line_start = true;
                i += 1;
                continue;
            }
            b' ' | b'\t' | b'\r' => {
                i += 1;
                continue;
            }
            b'#' => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'"' => i = skip_string(i),
            b'/' => {
                // A regex: its brackets nest inside the ones around it.
                let start = i + 1;
                i += 1;
                while i < b.len() && b[i] != b'/' && b[i] != b'\n' {
                    if b[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
                let inner = regex_depth(&text[start..i.min(b.len())]);
                if let Some(d) = current {
                    defs[d].brackets = defs[d].brackets.max(depth + inner);
                }
                i += 1;
            }
            b'<' => {
                // A special token `<...>`.
                let mut j = i + 1;
                while j < b.len() && !matches!(b[j], b'<' | b'>' | b' ' | b'\t' | b'\n' | b'\r') {
                    j += 1;
                }
                i = if b.get(j) == Some(&b'>') {
                    j + 1
                } else {
                    i + 1
                };
            }
            b'%' => {
                let start = i + 1;
                i += 1;
                while i < b.len() && b[i].is_ascii_alphabetic() {
                    i += 1;
                }
                let word = &text[start..i];
                if matches!(word, "json" | "regex" | "llguidance") {
                    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\r' | b'\n') {
                        i += 1;
                    }
                    let mut values = serde_json::Deserializer::from_str(&text[i..]).into_iter();
                    match values.next() {
                        Some(Ok(value)) => {
                            if word == "json" {
                                check_schema(&value)?;
                            }
                            i += values.byte_offset();
                        }
                        // Not JSON: llguidance reports it.
                        _ => return Ok(defs),
                    }
                } else if line_start && depth == 0 {
                    current = None; // a statement such as %ignore or %import
                }
            }
            b'@' => {
                i += 1;
                while i < b.len() && is_name_byte(b[i]) {
                    i += 1;
                }
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                if let Some(d) = current {
                    defs[d].brackets = defs[d].brackets.max(depth);
                }
                i += 1;
            }
            b')' | b']' | b'}' => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            b'?' | b'!' if line_start => {
                i += 1;
                continue; // a rule's modifier: still at the start of its line
            }
            c if is_name_start(c) => {
                let start = i;
                while i < b.len() && is_name_byte(b[i]) {
                    i += 1;
                }
                let name = &text[start..i];
                let definition = line_start && depth == 0 && {
                    // name.PRIORITY, name[ATTRIBUTES], then `:` (not `::`).
                    let mut j = i;
                    if b.get(j) == Some(&b'.') {
                        j += 1;
                        while j < b.len() && (b[j].is_ascii_digit() || b[j] == b'-') {
                            j += 1;
                        }
                    }
                    if b.get(j) == Some(&b'[') {
                        let mut d = 0usize;
                        while j < b.len() {
                            match b[j] {
                                b'"' => {
                                    j = skip_string(j);
                                    continue;
                                }
                                b'[' => d += 1,
                                b']' => {
                                    d -= 1;
                                    if d == 0 {
                                        j += 1;
                                        break;
                                    }
                                }
                                _ => {}
                            }
                            j += 1;
                        }
                    }
                    while j < b.len() && matches!(b[j], b' ' | b'\t') {
                        j += 1;
                    }
                    let is_def = b.get(j) == Some(&b':') && b.get(j + 1) != Some(&b':');
                    if is_def {
                        i = j + 1;
                    }
                    is_def
                };
                if definition {
                    defs.push(LarkDef {
                        name,
                        uses: Vec::new(),
                        brackets: 0,
                    });
                    current = Some(defs.len() - 1);
                } else if let Some(d) = current {
                    defs[d].uses.push((name, depth));
                }
            }
            _ => i += 1,
        }
        line_start = false;
    }
    Ok(defs)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use serde_json::json;

    /// A `$ref` chain `#/$defs/a0 → a1 → … → a{n-1}` ending in an integer.
    pub(in crate::runtime::grammar) fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            let body = if i + 1 < n {
                json!({"$ref": format!("#/$defs/a{}", i + 1)})
            } else {
                json!({"type": "integer"})
            };
            defs.insert(format!("a{i}"), body);
        }
        json!({"$defs": defs, "$ref": "#/$defs/a0"})
    }

    /// Objects nested `n` deep through `$ref`: `{"c": {"c": … {"c": 1}}}`.
    pub(in crate::runtime::grammar) fn nested_objects(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            let child = if i + 1 < n {
                json!({"$ref": format!("#/$defs/n{}", i + 1)})
            } else {
                json!({"type": "integer"})
            };
            defs.insert(
                format!("n{i}"),
                json!({"type": "object", "properties": {"c": child}, "required": ["c"]}),
            );
        }
        json!({"$defs": defs, "$ref": "#/$defs/n0"})
    }

    /// A Lark rule chain `start: r1`, `r1: r2`, …, `r{n-1}: "x"` (`n` rules).
    pub(in crate::runtime::grammar) fn lark_chain(n: usize) -> String {
        let mut g = String::from(if n > 1 {
            "start: r1\n"
        } else {
            "start: \"x\"\n"
        });
        for i in 1..n {
            if i + 1 < n {
                g.push_str(&format!("r{i}: r{}\n", i + 1));
            } else {
                g.push_str(&format!("r{i}: \"x\"\n"));
            }
        }
        g
    }

    fn depth_error(r: Result<(), Exceeded>) -> String {
        match r {
            Err(Exceeded::Depth { at }) => at,
            other => panic!("expected a depth error, got {other:?}"),
        }
    }

    #[test]
    fn schema_depth_follows_refs_and_counts_containers() {
        // {"$defs": {a0: {$ref}}, "$ref"}: the root, its `$ref` hop into a0 (one object) and so
        // on: n hops of one level each, plus the root and the last def.
        assert!(check_schema(&ref_chain(MAX_CONSTRAINT_DEPTH - 2)).is_ok());
        let at = depth_error(check_schema(&ref_chain(MAX_CONSTRAINT_DEPTH)));
        assert!(at.starts_with("#/$defs/a"), "{at}");
        assert!(depth_error(check_schema(&ref_chain(1000))).starts_with("#/$defs/a"));
        // Each nested object: itself, `properties`, the property's schema, the hop.
        assert!(check_schema(&nested_objects(MAX_CONSTRAINT_DEPTH / 3 - 2)).is_ok());
        assert!(check_schema(&nested_objects(MAX_CONSTRAINT_DEPTH / 3 + 1)).is_err());
        assert!(check_schema(&nested_objects(300)).is_err());
    }

    #[test]
    fn schema_cycles_are_not_followed_around() {
        // A recursive tree and a self reference are shallow.
        let tree = json!({"$defs": {"node": {"type": "object", "properties": {
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"});
        assert!(check_schema(&tree).is_ok());
        assert!(check_schema(&json!({"$ref": "#"})).is_ok());
        // A ring of 500 refs entered once is 500 deep.
        let mut defs = serde_json::Map::new();
        for i in 0..500 {
            defs.insert(
                format!("r{i}"),
                json!({"$ref": format!("#/$defs/r{}", (i + 1) % 500)}),
            );
        }
        assert!(check_schema(&json!({"$defs": defs, "$ref": "#/$defs/r0"})).is_err());
    }

    #[test]
    fn schema_size_and_pattern_brackets() {
        let big = json!({"enum": vec!["x".repeat(1000); MAX_CONSTRAINT_BYTES / 1000 + 1]});
        assert!(matches!(check_schema(&big), Err(Exceeded::Bytes(n)) if n > MAX_CONSTRAINT_BYTES));
        let deep_pattern = format!(
            "{}a{}",
            "(".repeat(MAX_CONSTRAINT_DEPTH + 1),
            ")".repeat(MAX_CONSTRAINT_DEPTH + 1)
        );
        assert!(check_schema(&json!({"type": "string", "pattern": deep_pattern})).is_err());
        assert!(check_schema(&json!({"type": "string", "pattern": "(a|b)+[c-d]"})).is_ok());
    }

    #[test]
    fn pointers_are_unescaped() {
        let s = json!({"$defs": {"a/b": {"$defs": {"c%d": {"type": "integer"}}}},
                       "$ref": "#/$defs/a~1b/$defs/c%25d"});
        let d = SchemaDepth::new(&s);
        assert_eq!(
            d.resolve("#/$defs/a~1b/$defs/c%25d"),
            Some(&json!({"type": "integer"}))
        );
        assert_eq!(d.resolve("#"), Some(&s));
        assert_eq!(d.resolve("#anchor"), None);
        assert_eq!(d.resolve("other.json#/x"), None);
    }

    #[test]
    fn lark_depth_follows_rule_chains() {
        assert!(check_lark(&lark_chain(MAX_CONSTRAINT_DEPTH)).is_ok());
        let at = depth_error(check_lark(&lark_chain(MAX_CONSTRAINT_DEPTH + 1)));
        assert!(at.starts_with("rule `"), "{at}");
        assert!(check_lark(&lark_chain(750)).is_err());
        // Recursion is a cycle, not depth.
        assert!(check_lark("start: x\nx: \"(\" x \")\" | \"a\"\n").is_ok());
        // Brackets count, in rules and in regexes.
        let parens = format!(
            "start: {}\"a\"{}\n",
            "(".repeat(MAX_CONSTRAINT_DEPTH + 1),
            ")".repeat(MAX_CONSTRAINT_DEPTH + 1)
        );
        assert!(check_lark(&parens).is_err());
        let rx = format!(
            "start: /{}a{}/\n",
            "(".repeat(MAX_CONSTRAINT_DEPTH + 1),
            ")".repeat(MAX_CONSTRAINT_DEPTH + 1)
        );
        assert!(check_lark(&rx).is_err());
    }

    #[test]
    fn lark_scanner_reads_definitions() {
        let g = r#"
// a comment with start: and (((((
?start: item+ | "str: ( [" WORD   # another comment
!item.2: "a" | /([a-z]("x"))/ | <|im_end|> | @other
lazy[stop=":"]: WORD
WORD: /[a-z]+/
%ignore WORD
json_call: %json {"type": "object", "properties": {"a": {"type": "string"}}}
tail: item
    | lazy
"#;
        let defs = scan_lark(g).unwrap();
        let names: Vec<&str> = defs.iter().map(|d| d.name).collect();
        assert_eq!(
            names,
            ["start", "item", "lazy", "WORD", "json_call", "tail"]
        );
        let uses = |n: &str| -> Vec<&str> {
            defs.iter()
                .find(|d| d.name == n)
                .unwrap()
                .uses
                .iter()
                .map(|u| u.0)
                .collect()
        };
        assert_eq!(uses("start"), ["item", "WORD"]);
        assert!(uses("item").is_empty());
        assert_eq!(uses("lazy"), ["WORD"]);
        assert!(uses("json_call").is_empty());
        assert_eq!(uses("tail"), ["item", "lazy"]);
        assert_eq!(defs[1].brackets, 2, "the regex's groups");
        // The schema inside %json is measured too.
        let deep = format!(
            "start: x\nx: %json {}\n",
            serde_json::to_string(&ref_chain(1000)).unwrap()
        );
        assert!(check_lark(&deep).is_err());
    }

    #[test]
    fn regex_depth_counts_unescaped_brackets() {
        assert_eq!(regex_depth(r"a(b[c])\(\[d"), 2);
        assert_eq!(regex_depth(""), 0);
        assert!(check_regex(&"(".repeat(MAX_CONSTRAINT_DEPTH + 1)).is_err());
        assert!(check_regex(&"a".repeat(MAX_CONSTRAINT_BYTES + 1)).is_err());
    }
}
