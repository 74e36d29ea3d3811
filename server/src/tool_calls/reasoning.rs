//! The `<think>…</think>` reasoning split every block format shares (Qwen, DeepSeek, Kimi,
//! GLM, MiniMax): a thought only at the start of the text (or from the start, when the prompt
//! already opened `<think>`), whole and streamed; the streaming form holds back partial tags.

use super::text::{partial_tag_len, Trimmer};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

/// The tags of a thought: `<think>` and `</think>`, which every block format but Kimi K3 uses.
pub(crate) const THINK: [&str; 2] = [THINK_OPEN, THINK_CLOSE];

/// Whether a rendered prompt leaves the model inside a thought (it ends with `open`).
pub(crate) fn prompt_opens_thought(prompt: &str, open: &str) -> bool {
    prompt.trim_end().ends_with(open)
}

/// Reasoning split for finished text: (reasoning, content), both trimmed; reasoning is `None`
/// when there is none or it is blank. `started_inside` = the prompt already opened `<think>`,
/// so the text is reasoning up to `</think>`; otherwise there is reasoning only when the text
/// starts (after whitespace) with `<think>`. A thought that never closes is all reasoning.
/// The server reads text with [`ReasoningStream`] only; this finished form is what the tests
/// hold the streaming form to.
#[cfg(test)]
pub(crate) fn split_reasoning(text: &str, started_inside: bool) -> (Option<String>, String) {
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
pub(crate) enum ReasoningEvent {
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
pub(crate) struct ReasoningStream {
    phase: Phase,
    buf: String,
    reasoning: Trimmer,
    content: Trimmer,
    /// The text opened without `<think>`: the answer passes through untrimmed.
    raw_content: bool,
    /// The opening and closing tags.
    tags: [&'static str; 2],
}

impl ReasoningStream {
    /// `started_inside` = the prompt already opened `<think>`.
    pub(crate) fn new(started_inside: bool, tags: [&'static str; 2]) -> Self {
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
            tags,
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
    pub(crate) fn push(&mut self, piece: &str) -> Vec<ReasoningEvent> {
        let mut events = Vec::new();
        self.buf.push_str(piece);
        loop {
            match self.phase {
                Phase::Undecided => {
                    let start = self.buf.trim_start();
                    if let Some(rest) = start.strip_prefix(self.tags[0]) {
                        self.buf = rest.to_string();
                        self.phase = Phase::Thinking;
                    } else if self.tags[0].starts_with(start) {
                        break; // blank, or a prefix of the tag: wait
                    } else {
                        self.phase = Phase::Answer;
                        self.raw_content = true;
                    }
                }
                Phase::Thinking => {
                    if let Some(i) = self.buf.find(self.tags[1]) {
                        let thought = self.buf[..i].to_string();
                        self.emit(&mut events, true, &thought);
                        self.buf.drain(..i + self.tags[1].len());
                        self.phase = Phase::Answer;
                    } else {
                        let keep = partial_tag_len(&self.buf, self.tags[1]);
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
    pub(crate) fn finish(&mut self) -> Vec<ReasoningEvent> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tool_calls::testing::splits;

    fn stream_reasoning(pieces: &[&str], started_inside: bool) -> (Option<String>, String) {
        let mut s = ReasoningStream::new(started_inside, THINK);
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
}
