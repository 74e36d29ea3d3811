//! The OpenAI shapes of an answer: how a chat completion (`chat.completion` and
//! `chat.completion.chunk`) and a text completion (`text_completion`) write the pump's parts,
//! finish and usage, as one JSON body or as stream chunks, with the log-probabilities in each
//! endpoint's format. What the pieces are and how a stream ends is the pump's
//! ([`super::pump`]); this module only writes them.

use std::sync::Arc;

use colibri::runtime::scheduler::TokenLogprob as EngineLogprob;
use serde_json::json;

use super::openai::*;
use super::pump::{Finish, Format, Part};
use super::Serving;

/// The text of token ids, for log-probabilities.
pub trait TokenTexts: Send + Sync {
    /// The text and raw bytes of token `id` (special tokens: empty text, as they are not part
    /// of the output).
    fn token_text(&self, id: u32) -> (String, Vec<u8>);
}

impl TokenTexts for Serving {
    fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let text = self
            .loaded
            .tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id], false).ok())
            .unwrap_or_default();
        let bytes = match &self.grammar {
            Some(g) => g.token_bytes(id),
            None => text.as_bytes().to_vec(),
        };
        (text, bytes)
    }
}

/// Identifies the build that produced an answer.
fn fingerprint() -> String {
    format!("colibri-{}", env!("CARGO_PKG_VERSION"))
}

/// What identifies one answer, the same in its body and in every chunk.
pub struct AnswerId {
    /// `chatcmpl-…` or `cmpl-…`.
    pub id: String,
    /// The served model's id.
    pub model: String,
    /// Unix seconds.
    pub created: u64,
}

impl AnswerId {
    /// The answer `id` of `model`, created now.
    pub fn new(id: String, model: &str) -> AnswerId {
        AnswerId {
            id,
            model: model.to_string(),
            created: super::now_secs(),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Chat completions
// ---------------------------------------------------------------------------------------

/// A chat completion's answer: `chat.completion` or `chat.completion.chunk`s.
pub struct ChatFormat {
    pub answer: AnswerId,
    /// The output is constrained to a tool call: the opening chunk has no content.
    pub forced_call: bool,
    /// What the response says besides the answer (`warnings`, on the body or the opening
    /// chunk).
    pub warnings: Vec<String>,
    pub vocab: Arc<dyn TokenTexts>,
}

impl ChatFormat {
    fn logprobs(&self, logprobs: &[EngineLogprob]) -> Option<ChoiceLogprobs> {
        (!logprobs.is_empty()).then(|| ChoiceLogprobs {
            content: logprobs
                .iter()
                .map(|lp| chat_logprob(&*self.vocab, lp))
                .collect(),
        })
    }

    fn chunk_of(
        &self,
        delta: Delta,
        logprobs: &[EngineLogprob],
        finish_reason: Option<String>,
    ) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.answer.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.answer.created,
            model: self.answer.model.clone(),
            system_fingerprint: fingerprint(),
            choices: vec![ChunkChoice {
                index: 0,
                delta,
                logprobs: self.logprobs(logprobs),
                finish_reason,
            }],
            usage: None,
            warnings: None,
            timings: None,
        }
    }

    fn warnings(&self) -> Option<Vec<String>> {
        (!self.warnings.is_empty()).then(|| self.warnings.clone())
    }
}

/// A generated token's log-probability in the chat format.
fn chat_logprob(vocab: &dyn TokenTexts, lp: &EngineLogprob) -> TokenLogprob {
    let (token, bytes) = vocab.token_text(lp.id);
    TokenLogprob {
        token,
        logprob: lp.logprob,
        bytes,
        top_logprobs: lp
            .top
            .iter()
            .map(|&(id, logprob)| {
                let (token, bytes) = vocab.token_text(id);
                TopLogprob {
                    token,
                    logprob,
                    bytes,
                }
            })
            .collect(),
    }
}

impl Format for ChatFormat {
    type Body = ChatCompletion;
    type Chunk = ChatCompletionChunk;

    fn opening(&mut self) -> Vec<ChatCompletionChunk> {
        let delta = Delta {
            role: Some("assistant".into()),
            // A forced tool call has no content (OpenAI sends `null`, not "").
            content: (!self.forced_call).then(String::new),
            ..Delta::default()
        };
        let mut first = self.chunk_of(delta, &[], None);
        first.warnings = self.warnings();
        vec![first]
    }

    fn chunks(&mut self, part: Part, logprobs: &[EngineLogprob]) -> Vec<ChatCompletionChunk> {
        let delta = match part {
            Part::Content(c) => Delta {
                content: Some(c),
                ..Delta::default()
            },
            Part::Reasoning(r) => Delta {
                reasoning_content: Some(r),
                ..Delta::default()
            },
            Part::ToolCall { index, call } => Delta {
                tool_calls: Some(vec![ToolCallDelta {
                    index,
                    id: Some(call.id),
                    kind: Some("function".into()),
                    function: FunctionCallDelta {
                        name: Some(call.name),
                        arguments: Some(call.arguments),
                    },
                }]),
                ..Delta::default()
            },
        };
        vec![self.chunk_of(delta, logprobs, None)]
    }

    fn finish_chunks(
        &mut self,
        finish: &Finish,
        logprobs: &[EngineLogprob],
    ) -> Vec<ChatCompletionChunk> {
        let mut last = self.chunk_of(Delta::default(), logprobs, Some(finish.reason.to_string()));
        last.timings = Some(finish.timings.clone());
        vec![last]
    }

    fn usage_chunk(&mut self, usage: Usage) -> Option<ChatCompletionChunk> {
        let mut last = self.chunk_of(Delta::default(), &[], None);
        last.choices.clear();
        last.usage = Some(usage);
        Some(last)
    }

    fn body(
        self,
        parts: Vec<(Part, Vec<EngineLogprob>)>,
        finish: Finish,
        leftover: Vec<EngineLogprob>,
    ) -> ChatCompletion {
        let mut content = String::new();
        let mut reasoning: Option<String> = None;
        let mut calls = Vec::new();
        let mut logprobs = Vec::new();
        for (part, lps) in parts {
            logprobs.extend(lps);
            match part {
                Part::Content(c) => content.push_str(&c),
                Part::Reasoning(r) => reasoning.get_or_insert_with(String::new).push_str(&r),
                Part::ToolCall { call, .. } => calls.push(ToolCall {
                    id: call.id,
                    kind: "function".into(),
                    function: FunctionCall {
                        name: call.name,
                        arguments: call.arguments,
                    },
                }),
            }
        }
        logprobs.extend(leftover);
        let tool_calls = (!calls.is_empty()).then_some(calls);
        // A message with calls and no other text has `content: null`, as OpenAI sends it.
        let content = (tool_calls.is_none() || !content.is_empty()).then_some(content);
        ChatCompletion {
            id: self.answer.id.clone(),
            object: "chat.completion".into(),
            created: self.answer.created,
            model: self.answer.model.clone(),
            system_fingerprint: fingerprint(),
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: "assistant".into(),
                    content,
                    reasoning_content: reasoning,
                    tool_calls,
                },
                logprobs: self.logprobs(&logprobs),
                finish_reason: finish.reason.to_string(),
            }],
            usage: finish.usage,
            warnings: self.warnings(),
            timings: Some(finish.timings),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Text completions
// ---------------------------------------------------------------------------------------

/// A text completion's answer: a `text_completion` body, or one per chunk.
pub struct CompletionFormat {
    pub answer: AnswerId,
    /// The prompt, when `echo` asks for it in front of the text.
    pub echo: Option<String>,
    pub vocab: Arc<dyn TokenTexts>,
    /// Bytes of text written so far (`text_offset` of the next token).
    offset: usize,
}

impl CompletionFormat {
    /// The format of an answer that starts with `echo`.
    pub fn new(answer: AnswerId, echo: Option<String>, vocab: Arc<dyn TokenTexts>) -> Self {
        CompletionFormat {
            answer,
            echo,
            vocab,
            offset: 0,
        }
    }

    fn completion(
        &self,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish_reason: Option<String>,
    ) -> Completion {
        Completion {
            id: self.answer.id.clone(),
            object: "text_completion".into(),
            created: self.answer.created,
            model: self.answer.model.clone(),
            system_fingerprint: fingerprint(),
            choices: vec![CompletionChoice {
                index: 0,
                text,
                logprobs,
                finish_reason,
            }],
            usage: None,
            timings: None,
        }
    }

    /// Add the legacy-format log-probabilities of tokens whose text starts at `self.offset`.
    fn add_logprobs(&self, logprobs: &[EngineLogprob], into: &mut CompletionLogprobs) {
        for lp in logprobs {
            into.tokens.push(self.vocab.token_text(lp.id).0);
            into.token_logprobs.push(lp.logprob);
            let mut top = serde_json::Map::new();
            for &(id, l) in &lp.top {
                top.insert(self.vocab.token_text(id).0, json!(l));
            }
            into.top_logprobs.push(top);
            into.text_offset.push(self.offset);
        }
    }

    /// The log-probabilities of one chunk.
    fn chunk_logprobs(&self, logprobs: &[EngineLogprob]) -> Option<CompletionLogprobs> {
        (!logprobs.is_empty()).then(|| {
            let mut lps = CompletionLogprobs::default();
            self.add_logprobs(logprobs, &mut lps);
            lps
        })
    }
}

/// The text of a part of a text completion (which is read raw: content only).
fn completion_text(part: Part) -> String {
    match part {
        Part::Content(t) | Part::Reasoning(t) => t,
        Part::ToolCall { .. } => String::new(),
    }
}

impl Format for CompletionFormat {
    type Body = Completion;
    type Chunk = Completion;

    fn opening(&mut self) -> Vec<Completion> {
        match self.echo.take() {
            Some(prompt) => {
                self.offset = prompt.len();
                vec![self.completion(prompt, None, None)]
            }
            None => Vec::new(),
        }
    }

    fn chunks(&mut self, part: Part, logprobs: &[EngineLogprob]) -> Vec<Completion> {
        let text = completion_text(part);
        let lps = self.chunk_logprobs(logprobs);
        self.offset += text.len();
        vec![self.completion(text, lps, None)]
    }

    fn finish_chunks(&mut self, finish: &Finish, logprobs: &[EngineLogprob]) -> Vec<Completion> {
        let lps = self.chunk_logprobs(logprobs);
        let mut last = self.completion(String::new(), lps, Some(finish.reason.to_string()));
        last.timings = Some(finish.timings.clone());
        vec![last]
    }

    fn usage_chunk(&mut self, usage: Usage) -> Option<Completion> {
        let mut last = self.completion(String::new(), None, None);
        last.choices.clear();
        last.usage = Some(usage);
        Some(last)
    }

    fn body(
        mut self,
        parts: Vec<(Part, Vec<EngineLogprob>)>,
        finish: Finish,
        leftover: Vec<EngineLogprob>,
    ) -> Completion {
        let mut text = self.echo.take().unwrap_or_default();
        let mut logprobs: Option<CompletionLogprobs> = None;
        // The log-probabilities no part carried belong after the last part's text.
        let leftover = (Part::Content(String::new()), leftover);
        for (part, lps) in parts.into_iter().chain([leftover]) {
            self.offset = text.len();
            if !lps.is_empty() {
                self.add_logprobs(&lps, logprobs.get_or_insert_with(Default::default));
            }
            text.push_str(&completion_text(part));
        }
        let mut body = self.completion(text, logprobs, Some(finish.reason.to_string()));
        body.usage = Some(finish.usage);
        body.timings = Some(finish.timings);
        body
    }
}
