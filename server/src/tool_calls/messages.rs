//! The one streaming driver of the message formats, where everything the model writes is a
//! sequence of typed messages and the type says what the text is (gpt-oss harmony's
//! `<|channel|>analysis<|message|>…<|end|>`, Inkling's
//! `<|message_model|><|content_thinking|>…<|end_message|>`). A format is a
//! [`MessageFormat`]: the tags that open a message's header, end it and end the body, and how
//! a header reads (reasoning, content or a call). Reasoning and content stream as they come
//! (partial tags held back); a call's body is read once the message ends, and a body that does
//! not read as a call is returned as text, with a warning.

use super::text::{find_first, held_back, Trimmer};
use super::{Ids, Parsed, RawCall, Tools};

/// What a message holds, as its header says.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Kind {
    /// The model's reasoning.
    Reasoning,
    /// Text of the answer.
    Content,
    /// A tool call; the function's name when the header gives it.
    Call(Option<String>),
}

/// How one format writes its messages.
pub(crate) struct MessageFormat {
    /// The format's name in warnings.
    pub name: &'static str,
    /// Tags that open a message's header (they are part of the header text).
    pub starts: &'static [&'static str],
    /// Tags that end a header; the body follows.
    pub header_ends: &'static [&'static str],
    /// Tags that end a body.
    pub ends: &'static [&'static str],
    /// What a message is, from its header text and the tag that ended the header.
    pub kind: fn(&str, &str) -> Kind,
    /// The calls of a call message's body (with the name its header gave), or `None` when the
    /// body does not read as one.
    pub call: fn(Option<&str>, &str, &Tools) -> Option<Vec<RawCall>>,
    /// Prompt endings after which the generated text begins inside a header (the prompt
    /// opened the assistant's message).
    pub header_prompts: &'static [&'static str],
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Between messages.
    Between,
    /// In a header; its text so far.
    Header(String),
    /// In a body of this kind.
    Body(Kind),
}

/// The streaming reader of one message format.
pub(crate) struct MessageStream {
    format: &'static MessageFormat,
    /// With the request's tools and ids, calls are read; without, a call's body is content.
    calls: Option<(std::sync::Arc<Tools>, Ids)>,
    /// Reasoning is split off (otherwise it is content).
    reasoning: bool,
    state: State,
    /// Text not yet handled: a held-back partial tag, or a call's body.
    buf: String,
    thought: Trimmer,
    content: Trimmer,
    /// A message of this kind (content, reasoning) ended: the next text of that kind is set
    /// apart by a blank line.
    separate: [bool; 2],
}

impl MessageStream {
    /// A reader of `format` for text generated after `prompt`.
    pub(crate) fn new(
        format: &'static MessageFormat,
        prompt: &str,
        reasoning: bool,
        calls: Option<(std::sync::Arc<Tools>, Ids)>,
    ) -> Self {
        let state = if format.header_prompts.iter().any(|p| prompt.ends_with(p)) {
            State::Header(String::new())
        } else {
            State::Between
        };
        MessageStream {
            format,
            calls,
            reasoning,
            state,
            buf: String::new(),
            thought: Trimmer::default(),
            content: Trimmer::default(),
            separate: [false; 2],
        }
    }

    /// Text of a reasoning (`thought`) or content message. The first text after a message of
    /// the same kind ended is set apart from it by a blank line (which trimming drops when
    /// nothing follows), the same however the text was cut.
    fn text(&mut self, events: &mut Vec<Parsed>, thought: bool, text: &str) {
        let thought = thought && self.reasoning;
        let trimmer = if thought {
            &mut self.thought
        } else {
            &mut self.content
        };
        let mut shown = String::new();
        if std::mem::take(&mut self.separate[thought as usize]) {
            shown.push_str(&trimmer.push("\n\n"));
        }
        shown.push_str(&trimmer.push(text));
        if thought {
            Parsed::push_reasoning(events, shown);
        } else {
            Parsed::push_content(events, shown);
        }
    }

    /// A call message ended with this body.
    fn call(&mut self, events: &mut Vec<Parsed>, name: Option<String>, body: &str) {
        let parsed = self
            .calls
            .as_ref()
            .map(|(tools, _)| (self.format.call)(name.as_deref(), body, tools));
        match parsed {
            Some(Some(calls)) if !calls.is_empty() => {
                let (_, ids) = self.calls.as_mut().expect("calls are read");
                events.extend(calls.into_iter().map(|c| Parsed::Call(ids.call(c))));
            }
            Some(_) => {
                tracing::warn!(
                    format = self.format.name,
                    body = %body,
                    "a tool call the model wrote does not read as one; it is returned as text"
                );
                self.text(events, false, body);
            }
            None => self.text(events, false, body),
        }
    }

    /// The current body ends (at a tag or at the end of the text).
    fn end_body(&mut self, events: &mut Vec<Parsed>, kind: Kind, rest: &str) {
        match kind {
            Kind::Call(name) => {
                let body = std::mem::take(&mut self.buf) + rest;
                self.call(events, name, &body);
            }
            Kind::Reasoning => {
                self.text(events, true, rest);
                self.separate[self.reasoning as usize] = true;
            }
            Kind::Content => {
                self.text(events, false, rest);
                self.separate[0] = true;
            }
        }
    }

    /// Feed the next piece of generated text.
    pub(crate) fn push(&mut self, piece: &str) -> Vec<Parsed> {
        let mut events = Vec::new();
        self.buf.push_str(piece);
        let f = self.format;
        loop {
            match self.state.clone() {
                State::Between => {
                    let tags: Vec<&str> = f
                        .starts
                        .iter()
                        .chain(f.header_ends)
                        .chain(f.ends)
                        .copied()
                        .collect();
                    match find_first(&self.buf, &tags) {
                        Some((i, tag)) => {
                            let before = self.buf[..i].to_string();
                            self.text(&mut events, false, &before);
                            if f.starts.contains(&tag) {
                                self.state = State::Header(tag.to_string());
                            } else if f.header_ends.contains(&tag) {
                                self.state = State::Body((f.kind)("", tag));
                            } // else an end with no message open: nothing to end
                            self.buf.drain(..i + tag.len());
                        }
                        None => {
                            let keep = held_back(&self.buf, &tags);
                            let shown = self.buf[..self.buf.len() - keep].to_string();
                            self.text(&mut events, false, &shown);
                            self.buf.drain(..self.buf.len() - keep);
                            break;
                        }
                    }
                }
                State::Header(mut header) => {
                    let tags: Vec<&str> = f.header_ends.iter().chain(f.ends).copied().collect();
                    match find_first(&self.buf, &tags) {
                        Some((i, tag)) => {
                            header.push_str(&self.buf[..i]);
                            self.buf.drain(..i + tag.len());
                            if f.ends.contains(&tag) {
                                // A message without a body: its header was text.
                                self.text(&mut events, false, &header);
                                self.state = State::Between;
                            } else {
                                self.state = State::Body((f.kind)(&header, tag));
                            }
                        }
                        None => {
                            // Headers are short: keep the text until the header ends.
                            let keep = held_back(&self.buf, &tags);
                            header.push_str(&self.buf[..self.buf.len() - keep]);
                            self.buf.drain(..self.buf.len() - keep);
                            self.state = State::Header(header);
                            break;
                        }
                    }
                }
                State::Body(kind) => {
                    let tags: Vec<&str> = f.ends.iter().chain(f.starts).copied().collect();
                    let found = find_first(&self.buf, &tags);
                    let is_call = matches!(kind, Kind::Call(_));
                    match found {
                        Some((i, tag)) => {
                            let body = self.buf[..i].to_string();
                            self.buf.drain(..i + tag.len());
                            if is_call {
                                // The call's body is all of `body`; what follows stays.
                                let rest = std::mem::take(&mut self.buf);
                                self.buf = body;
                                self.end_body(&mut events, kind, "");
                                self.buf = rest;
                            } else {
                                self.end_body(&mut events, kind, &body);
                            }
                            self.state = if f.starts.contains(&tag) {
                                State::Header(tag.to_string())
                            } else {
                                State::Between
                            };
                        }
                        None if is_call => break, // the body is read when the message ends
                        None => {
                            let keep = held_back(&self.buf, &tags);
                            let shown = self.buf[..self.buf.len() - keep].to_string();
                            self.text(&mut events, kind == Kind::Reasoning, &shown);
                            self.buf.drain(..self.buf.len() - keep);
                            break;
                        }
                    }
                }
            }
        }
        events
    }

    /// The end of the text (which also ends the last message: gpt-oss ends a call with its
    /// `<|call|>` end-of-sequence token, which never reaches the text).
    pub(crate) fn finish(&mut self) -> Vec<Parsed> {
        let mut events = Vec::new();
        match std::mem::replace(&mut self.state, State::Between) {
            State::Between => {
                let rest = std::mem::take(&mut self.buf);
                self.text(&mut events, false, &rest);
            }
            State::Header(header) => {
                let rest = header + &std::mem::take(&mut self.buf);
                self.text(&mut events, false, &rest);
            }
            State::Body(kind @ Kind::Call(_)) => self.end_body(&mut events, kind, ""),
            State::Body(kind) => {
                let rest = std::mem::take(&mut self.buf);
                self.end_body(&mut events, kind, &rest);
            }
        }
        events
    }
}
