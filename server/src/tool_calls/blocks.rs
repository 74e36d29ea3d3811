//! The one streaming driver of the block formats: calls written as blocks in the text, each
//! between an opening and a closing tag (Hermes' `<tool_call>`, DeepSeek's
//! `<｜tool▁calls▁begin｜>`, Kimi's `<|tool_calls_section_begin|>`, GLM's `<tool_call>`,
//! MiniMax's `<minimax:tool_call>`, DSML's `<｜DSML｜tool_calls>`). A format is a
//! [`BlockFormat`]: its two tags and how the text between them reads as calls. The driver
//! holds back anything that could still turn out to be an opening tag, gives a block's calls
//! when its closing tag arrives, and returns a block that does not read as calls (or never
//! closes) as text, with a warning. Content is trimmed as `str::trim` trims the whole.

use super::text::{find_first, held_back, partial_tag_len, Trimmer};
use super::{Ids, Parsed, RawCall, Tools};

/// How one format writes its blocks of calls.
pub(crate) struct BlockFormat {
    /// The format's name in warnings.
    pub name: &'static str,
    /// The tag that opens a block.
    pub open: &'static str,
    /// The tag that closes it.
    pub close: &'static str,
    /// The body is JSON: a closing tag inside a JSON string does not close the block.
    pub json_body: bool,
    /// The tags that open and close a thought at the start of the text.
    pub think: [&'static str; 2],
    /// Tags that frame the answer and are not part of it (Kimi K3's `<|open|>response<|sep|>`):
    /// dropped from the content wherever they appear outside a block.
    pub drop: &'static [&'static str],
    /// The calls a block's body (the text between the tags) holds, or `None` when it does not
    /// read as calls (it is then returned as text).
    pub parse: fn(&str, &Tools) -> Option<Vec<RawCall>>,
}

/// Finds the closing tag that ends a block body; in a JSON body, the first one outside a
/// JSON string, so arguments may mention the tag. Keeps its place between calls, for
/// streaming.
#[derive(Debug, Default, Clone, Copy)]
struct BodyScan {
    pos: usize,
    in_str: bool,
    escaped: bool,
}

impl BodyScan {
    /// The byte offset of `close` in `body` (the block's text so far, growing between calls),
    /// or `None` when `body` holds none yet.
    fn find_close(&mut self, body: &str, close: &str, json: bool) -> Option<usize> {
        if !json {
            // Look again from where a partial tag may have started.
            let found = body[self.pos..].find(close).map(|i| self.pos + i);
            if found.is_none() {
                self.pos = body.len() - partial_tag_len(body, close);
            }
            return found;
        }
        let b = body.as_bytes();
        let first = close.as_bytes()[0];
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
            } else if c == first {
                // The tags open with an ASCII byte, so `pos` is a char boundary.
                let rest = &body[self.pos..];
                if rest.starts_with(close) {
                    return Some(self.pos);
                }
                if close.starts_with(rest) {
                    return None; // maybe a tag still arriving: look here again next time
                }
            }
            self.pos += 1;
        }
        None
    }
}

/// The streaming reader of one block format: feed it text pieces as they are generated; it
/// gives content that is safe to show and each block's calls once the block closes.
pub(crate) struct BlockStream {
    format: &'static BlockFormat,
    /// With the request's tools and ids, blocks are read as calls; without, only the format's
    /// [`BlockFormat::drop`] tags are taken out of the content.
    calls: Option<(std::sync::Arc<Tools>, Ids)>,
    /// Text not yet emitted: outside a block, a held-back partial tag; inside, the body.
    buf: String,
    in_block: bool,
    scan: BodyScan,
    out: Trimmer,
}

impl BlockStream {
    /// A reader of `format`'s blocks, typing values by the tools, numbering calls with the ids.
    pub(crate) fn new(
        format: &'static BlockFormat,
        calls: Option<(std::sync::Arc<Tools>, Ids)>,
    ) -> Self {
        BlockStream {
            format,
            calls,
            buf: String::new(),
            in_block: false,
            scan: BodyScan::default(),
            out: Trimmer::default(),
        }
    }

    fn content(&mut self, events: &mut Vec<Parsed>, text: &str) {
        let shown = self.out.push(text);
        Parsed::push_content(events, shown);
    }

    /// A closed block: its calls, or its text when it does not read as calls.
    fn block(&mut self, events: &mut Vec<Parsed>, body: &str) {
        let parsed = match self.calls.as_mut() {
            Some((tools, ids)) => (self.format.parse)(body, tools).map(|calls| {
                calls
                    .into_iter()
                    .map(|c| Parsed::Call(ids.call(c)))
                    .collect::<Vec<_>>()
            }),
            None => None, // not reached: without calls no block opens
        };
        match parsed {
            Some(calls) if !calls.is_empty() => events.extend(calls),
            _ => {
                tracing::warn!(
                    format = self.format.name,
                    block = %body,
                    "a tool-call block the model wrote does not read as calls; it is returned as text"
                );
                let f = self.format;
                let text = format!("{}{body}{}", f.open, f.close);
                self.content(events, &text);
            }
        }
    }

    /// Feed the next piece of generated text.
    pub(crate) fn push(&mut self, piece: &str) -> Vec<Parsed> {
        let mut events = Vec::new();
        self.buf.push_str(piece);
        let f = self.format;
        loop {
            if self.in_block {
                let Some(close) = self.scan.find_close(&self.buf, f.close, f.json_body) else {
                    break;
                };
                let body = self.buf[..close].to_string();
                self.buf.drain(..close + f.close.len());
                self.in_block = false;
                self.block(&mut events, &body);
                continue;
            }
            let mut tags = f.drop.to_vec();
            if self.calls.is_some() {
                tags.push(f.open);
            }
            if let Some((at, tag)) = find_first(&self.buf, &tags) {
                let before = self.buf[..at].to_string();
                self.content(&mut events, &before);
                self.buf.drain(..at + tag.len());
                if tag == f.open {
                    self.in_block = true;
                    self.scan = BodyScan::default();
                }
            } else {
                let keep = held_back(&self.buf, &tags);
                let shown = self.buf[..self.buf.len() - keep].to_string();
                self.content(&mut events, &shown);
                self.buf.drain(..self.buf.len() - keep);
                break;
            }
        }
        events
    }

    /// The end of the text: flush what was held back; an unterminated block is content.
    pub(crate) fn finish(&mut self) -> Vec<Parsed> {
        let mut events = Vec::new();
        let mut rest = std::mem::take(&mut self.buf);
        if self.in_block {
            tracing::warn!(
                format = self.format.name,
                "the text ended inside a tool-call block; it is returned as text"
            );
            rest.insert_str(0, self.format.open);
            self.in_block = false;
        }
        self.content(&mut events, &rest);
        events
    }
}
