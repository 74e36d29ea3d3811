//! Anthropic's Messages API: `/v1/messages` and `/v1/messages/count_tokens`. A request is
//! translated into the chat request of `/v1/chat/completions` ([`chat_request`]) and goes
//! through the same rendering, constraints, sampling and scheduler ([`super::chat`]) and the
//! same pump ([`super::pump`]); only the answer is written in Anthropic's shape
//! ([`MessagesFormat`]) and errors in Anthropic's error body (a 503 is a 529
//! `overloaded_error`).
//!
//! The translation: `system` becomes a system message; a user message's text blocks become
//! its text, each `tool_result` block a `tool` message answering its `tool_use_id` (its text
//! prefixed with `Error: ` when `is_error`); an assistant message's text blocks become its
//! content, its `tool_use` blocks its tool calls and its `thinking` blocks its
//! `reasoning_content`; `tools` become functions, `tool_choice` `auto` / `any` / `tool` /
//! `none` become `auto` / `required` / a named function / `none`; `stop_sequences` are stop
//! strings; `thinking` is the template's `enable_thinking`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use colibri::runtime::scheduler::TokenLogprob as EngineLogprob;
use serde_json::{json, Value};

use super::anthropic::*;
use super::chat::{parse_body, random_seed, render_chat, respond, submit_chat};
use super::errors::{ApiError, ErrorShape};
use super::openai::{
    ChatCompletionRequest, ChatMessage, Content, ContentPart, FunctionCall, FunctionDef,
    SamplingFields, Stop, Tool, ToolCall, ToolChoice, Usage,
};
use super::pump::{answer, Delivery, Finish, Format, Part, Timing};
use super::AppState;

// ---------------------------------------------------------------------------------------
// Requests: Anthropic's into the chat request
// ---------------------------------------------------------------------------------------

/// What a message request and a token count share: the model's input.
pub struct Input<'a> {
    pub model: &'a str,
    pub system: Option<&'a SystemPrompt>,
    pub messages: &'a [InputMessage],
    pub tools: Option<&'a [AnthropicTool]>,
    pub tool_choice: Option<&'a AnthropicToolChoice>,
    pub thinking: Option<&'a ThinkingConfig>,
}

impl<'a> Input<'a> {
    fn of_message(req: &'a MessagesRequest) -> Input<'a> {
        Input {
            model: &req.model,
            system: req.system.as_ref(),
            messages: &req.messages,
            tools: req.tools.as_deref(),
            tool_choice: req.tool_choice.as_ref(),
            thinking: req.thinking.as_ref(),
        }
    }

    fn of_count(req: &'a CountTokensRequest) -> Input<'a> {
        Input {
            model: &req.model,
            system: req.system.as_ref(),
            messages: &req.messages,
            tools: req.tools.as_deref(),
            tool_choice: req.tool_choice.as_ref(),
            thinking: req.thinking.as_ref(),
        }
    }
}

/// The chat request of an Anthropic input (no sampling fields): a 400 naming the field
/// that cannot be translated.
pub fn chat_request(input: &Input) -> Result<ChatCompletionRequest, ApiError> {
    let mut messages = Vec::new();
    if let Some(system) = input.system {
        let text = match system {
            SystemPrompt::Text(t) => t.clone(),
            SystemPrompt::Blocks(blocks) => {
                let mut texts = Vec::with_capacity(blocks.len());
                for (i, b) in blocks.iter().enumerate() {
                    texts.push(block_text(&b.kind, &b.text, &format!("system[{i}]"))?);
                }
                texts.join("\n\n")
            }
        };
        messages.push(message("system", Some(Content::Text(text))));
    }
    for (i, m) in input.messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        match m.role.as_str() {
            "user" => user_messages(&m.content, &at, &mut messages)?,
            "assistant" => messages.push(assistant_message(&m.content, &at)?),
            other => {
                return Err(ApiError::invalid(
                    &format!("{at}.role"),
                    format!("unknown role `{other}`; expected user or assistant (the system prompt goes in `system`)"),
                ))
            }
        }
    }
    let tools = match input.tools {
        None => None,
        Some(tools) => Some(
            tools
                .iter()
                .enumerate()
                .map(|(i, t)| function_tool(t, i))
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    let tool_choice = match input.tool_choice {
        None => None,
        Some(c) => Some(match c.kind.as_str() {
            "auto" => ToolChoice::Mode("auto".into()),
            "any" => ToolChoice::Mode("required".into()),
            "none" => ToolChoice::Mode("none".into()),
            "tool" => {
                let name = c.name.as_deref().ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice.name",
                        "a tool_choice of type `tool` names the tool in `name`",
                    )
                })?;
                ToolChoice::Named(json!({"type": "function", "function": {"name": name}}))
            }
            other => {
                return Err(ApiError::invalid(
                    "tool_choice.type",
                    format!("unknown tool_choice type `{other}`; expected auto, any, tool or none"),
                ))
            }
        }),
    };
    let chat_template_kwargs = match input.thinking {
        None => None,
        Some(t) => {
            let on = match t.kind.as_str() {
                "enabled" | "adaptive" => true,
                "disabled" => false,
                other => {
                    return Err(ApiError::invalid(
                        "thinking.type",
                        format!("unknown thinking type `{other}`; expected enabled or disabled"),
                    ))
                }
            };
            Some(json!({ "enable_thinking": on }))
        }
    };
    Ok(ChatCompletionRequest {
        model: Some(input.model.to_string()),
        messages,
        max_tokens: None,
        max_completion_tokens: None,
        sampling: SamplingFields::default(),
        logprobs: None,
        top_logprobs: None,
        tools,
        tool_choice,
        parallel_tool_calls: None,
        response_format: None,
        grammar: None,
        chat_template_kwargs,
        user: None,
    })
}

/// The chat request of a message request, with its sampling and stopping fields.
pub fn chat_request_of_message(
    req: &MessagesRequest,
    max_tokens_cap: usize,
) -> Result<ChatCompletionRequest, ApiError> {
    let mut chat = chat_request(&Input::of_message(req))?;
    // `max_tokens` is required, so clients send large values: the server's cap lowers it
    // rather than refusing it.
    chat.max_tokens = Some(req.max_tokens.min(max_tokens_cap as i64));
    chat.sampling = SamplingFields {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req.stop_sequences.clone().map(Stop::Many),
        stream: req.stream,
        ..SamplingFields::default()
    };
    chat.user = req.metadata.as_ref().and_then(|m| m.user_id.clone());
    Ok(chat)
}

fn message(role: &str, content: Option<Content>) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content,
        name: None,
        tool_calls: None,
        tool_call_id: None,
        reasoning_content: None,
    }
}

fn text_part(text: &str) -> ContentPart {
    ContentPart {
        kind: "text".into(),
        text: Some(text.to_string()),
    }
}

/// The text of a block of type `kind` that must be a text block (`at` names it).
fn block_text(kind: &str, text: &Option<String>, at: &str) -> Result<String, ApiError> {
    match (kind, text) {
        ("text", Some(t)) => Ok(t.clone()),
        ("text", None) => Err(ApiError::invalid(
            &format!("{at}.text"),
            "a block of type `text` needs a `text` field (a string)",
        )),
        (other, _) => Err(ApiError::invalid(
            &format!("{at}.type"),
            format!("blocks of type `{other}` are not supported here (text only)"),
        )),
    }
}

/// A string field a block of its type needs.
fn required<'b>(
    value: &'b Option<String>,
    at: &str,
    field: &str,
    kind: &str,
) -> Result<&'b str, ApiError> {
    value.as_deref().ok_or_else(|| {
        ApiError::invalid(
            &format!("{at}.{field}"),
            format!("a block of type `{kind}` needs a `{field}` field (a string)"),
        )
    })
}

/// A user message: its text, and a `tool` message for each `tool_result` block, in order.
fn user_messages(
    content: &MessageContent,
    at: &str,
    out: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let blocks = match content {
        MessageContent::Text(t) => {
            out.push(message("user", Some(Content::Text(t.clone()))));
            return Ok(());
        }
        MessageContent::Blocks(blocks) => blocks,
    };
    let mut parts: Vec<ContentPart> = Vec::new();
    let flush = |parts: &mut Vec<ContentPart>, out: &mut Vec<ChatMessage>| {
        if !parts.is_empty() {
            out.push(message("user", Some(Content::Parts(std::mem::take(parts)))));
        }
    };
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match b.kind.as_str() {
            "text" => parts.push(text_part(&block_text(&b.kind, &b.text, &at)?)),
            "tool_result" => {
                let id = required(&b.tool_use_id, &at, "tool_use_id", "tool_result")?;
                let mut text = match &b.content {
                    None => String::new(),
                    Some(ToolResultContent::Text(t)) => t.clone(),
                    Some(ToolResultContent::Blocks(inner)) => {
                        let mut texts = Vec::with_capacity(inner.len());
                        for (k, c) in inner.iter().enumerate() {
                            texts.push(block_text(
                                &c.kind,
                                &c.text,
                                &format!("{at}.content[{k}]"),
                            )?);
                        }
                        texts.join("\n\n")
                    }
                };
                if b.is_error == Some(true) {
                    text = format!("Error: {text}");
                }
                flush(&mut parts, out);
                let mut result = message("tool", Some(Content::Text(text)));
                result.tool_call_id = Some(id.to_string());
                out.push(result);
            }
            other => {
                return Err(ApiError::invalid(
                    &format!("{at}.type"),
                    format!(
                        "blocks of type `{other}` are not supported in a user message (text and tool_result only)"
                    ),
                ))
            }
        }
    }
    flush(&mut parts, out);
    Ok(())
}

/// An assistant message: text blocks its content, `tool_use` blocks its calls, `thinking`
/// blocks its reasoning.
fn assistant_message(content: &MessageContent, at: &str) -> Result<ChatMessage, ApiError> {
    let blocks = match content {
        MessageContent::Text(t) => return Ok(message("assistant", Some(Content::Text(t.clone())))),
        MessageContent::Blocks(blocks) => blocks,
    };
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    let mut reasoning: Option<String> = None;
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        match b.kind.as_str() {
            "text" => parts.push(text_part(&block_text(&b.kind, &b.text, &at)?)),
            "tool_use" => {
                let id = required(&b.id, &at, "id", "tool_use")?;
                let name = required(&b.name, &at, "name", "tool_use")?;
                let input = match &b.input {
                    Some(v @ Value::Object(_)) => v,
                    _ => {
                        return Err(ApiError::invalid(
                            &format!("{at}.input"),
                            "a block of type `tool_use` needs an `input` object",
                        ))
                    }
                };
                calls.push(ToolCall {
                    id: id.to_string(),
                    kind: "function".into(),
                    function: FunctionCall {
                        name: name.to_string(),
                        arguments: input.to_string(),
                    },
                });
            }
            "thinking" => {
                let t = required(&b.thinking, &at, "thinking", "thinking")?;
                reasoning.get_or_insert_with(String::new).push_str(t);
            }
            // Encrypted reasoning of another model: nothing this one can read.
            "redacted_thinking" => {}
            other => {
                return Err(ApiError::invalid(
                    &format!("{at}.type"),
                    format!(
                        "blocks of type `{other}` are not supported in an assistant message (text, tool_use and thinking only)"
                    ),
                ))
            }
        }
    }
    let mut m = message("assistant", Some(Content::Parts(parts)));
    m.tool_calls = (!calls.is_empty()).then_some(calls);
    m.reasoning_content = reasoning;
    Ok(m)
}

/// A client tool as a function.
fn function_tool(tool: &AnthropicTool, i: usize) -> Result<Tool, ApiError> {
    if let Some(kind) = tool.kind.as_deref().filter(|k| *k != "custom") {
        return Err(ApiError::invalid(
            &format!("tools[{i}].type"),
            format!("tool type `{kind}` is not supported: this server runs client tools only (`custom`, or no `type`)"),
        ));
    }
    if !tool.input_schema.is_object() {
        return Err(ApiError::invalid(
            &format!("tools[{i}].input_schema"),
            "`input_schema` must be a JSON Schema object",
        ));
    }
    Ok(Tool {
        kind: "function".into(),
        function: FunctionDef {
            name: tool.name.clone(),
            description: tool.description.clone(),
            parameters: Some(tool.input_schema.clone()),
            strict: None,
        },
    })
}

/// The request field an error of the translated request names, as the Anthropic request
/// calls it.
fn anthropic_param(mut e: ApiError) -> ApiError {
    let renamed = match e.param.as_deref() {
        Some("stop") => Some("stop_sequences"),
        Some("chat_template_kwargs") => Some("thinking"),
        _ => None,
    };
    if let Some(p) = renamed {
        e.param = Some(p.to_string());
    }
    e
}

// ---------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------

/// `POST /v1/messages`.
#[utoipa::path(post, path = "/v1/messages", request_body = MessagesRequest,
    responses(
        (status = 200, description = "The message (JSON), or with `stream` an SSE stream of named events (`event: <type>`, `data: <StreamEvent>`): message_start, ping, then per content block content_block_start, content_block_delta…, content_block_stop, then message_delta and message_stop; a failure after the start is an `error` event",
            content((MessagesResponse = "application/json"), (StreamEvent = "text/event-stream"))),
        (status = 400, body = AnthropicErrorBody, description = "A request field is invalid (the message names it), or the prompt exceeds the context"),
        (status = 401, body = AnthropicErrorBody, description = "Missing or invalid API key (`x-api-key` or `Authorization: Bearer`)"),
        (status = 404, body = AnthropicErrorBody, description = "Unknown model"),
        (status = 408, body = AnthropicErrorBody, description = "The body did not arrive within body_timeout_secs"),
        (status = 413, body = AnthropicErrorBody, description = "Body larger than max_body_bytes"),
        (status = 429, body = AnthropicErrorBody, description = "Queue full (see Retry-After)"),
        (status = 500, body = AnthropicErrorBody),
        (status = 529, body = AnthropicErrorBody, description = "Overloaded: loading, draining, timed out waiting for a slot, or the model's files unreadable")
    ),
    security(("api_key" = []))
)]
pub async fn messages(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let trace = super::otlp::parent_context(&headers);
    let result = messages_inner(&state, body, arrived, trace.clone()).await;
    respond(
        &state,
        "/v1/messages",
        arrived,
        trace,
        result.map_err(anthropic_param),
        ErrorShape::Anthropic,
    )
}

async fn messages_inner(
    state: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    arrived: Instant,
    trace: opentelemetry::Context,
) -> Result<Response, ApiError> {
    let req: MessagesRequest = parse_body(body)?;
    if req.max_tokens < 1 {
        return Err(ApiError::invalid(
            "max_tokens",
            format!("`max_tokens` is {}; expected at least 1", req.max_tokens),
        ));
    }
    let chat = chat_request_of_message(&req, state.config.max_tokens_cap)?;
    let rendered = render_chat(state, &chat)?;
    let suffix = format!("{:016x}", random_seed());
    let id = format!("msg_{suffix}");
    let input_tokens = rendered.prompt.len();
    let (events, reading) = submit_chat(state, &chat, rendered, &format!("toolu_{suffix}")).await?;
    let timing = Timing::new(state.clone(), "/v1/messages", id.clone(), arrived, trace);
    let format = MessagesFormat::new(id, &state.model_id, input_tokens);
    let delivery = if req.stream.unwrap_or(false) {
        Delivery::Sse {
            include_usage: false,
        }
    } else {
        Delivery::Json
    };
    answer(events, reading, timing, format, delivery).await
}

/// `POST /v1/messages/count_tokens`.
#[utoipa::path(post, path = "/v1/messages/count_tokens", request_body = CountTokensRequest,
    responses(
        (status = 200, body = CountTokens, description = "The prompt's tokens: `usage.input_tokens` of a message with the same input"),
        (status = 400, body = AnthropicErrorBody, description = "A request field is invalid (the message names it)"),
        (status = 401, body = AnthropicErrorBody, description = "Missing or invalid API key"),
        (status = 404, body = AnthropicErrorBody, description = "Unknown model"),
        (status = 408, body = AnthropicErrorBody),
        (status = 413, body = AnthropicErrorBody, description = "Body larger than max_body_bytes"),
        (status = 529, body = AnthropicErrorBody, description = "Loading or draining")
    ),
    security(("api_key" = []))
)]
pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let trace = super::otlp::parent_context(&headers);
    let result = (|| -> Result<Response, ApiError> {
        let req: CountTokensRequest = parse_body(body)?;
        let chat = chat_request(&Input::of_count(&req))?;
        let rendered = render_chat(&state, &chat)?;
        Ok(Json(CountTokens {
            input_tokens: rendered.prompt.len(),
        })
        .into_response())
    })();
    respond(
        &state,
        "/v1/messages/count_tokens",
        arrived,
        trace,
        result.map_err(anthropic_param),
        ErrorShape::Anthropic,
    )
}

// ---------------------------------------------------------------------------------------
// Answers: the pump's parts as Anthropic's message and events
// ---------------------------------------------------------------------------------------

/// Anthropic's `stop_reason` and `stop_sequence` of a finish.
fn stop_reason(finish: &Finish) -> (&'static str, Option<String>) {
    match (finish.reason, &finish.stop_sequence) {
        ("tool_calls", _) => ("tool_use", None),
        ("length", _) => ("max_tokens", None),
        (_, Some(s)) => ("stop_sequence", Some(s.clone())),
        (_, None) => ("end_turn", None),
    }
}

/// The kind of block a text part goes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TextKind {
    Thinking,
    Text,
}

/// A tool call as a `tool_use` block (its arguments are a compact JSON object).
fn tool_use(call: crate::tool_calls::ToolCall) -> ResponseBlock {
    let input = serde_json::from_str(&call.arguments)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    ResponseBlock::ToolUse {
        id: call.id,
        name: call.name,
        input,
    }
}

/// A message's answer: a [`MessagesResponse`], or its stream of [`StreamEvent`]s. Reasoning
/// and text each go into a block that lasts while parts of its kind follow one another; each
/// tool call is one `tool_use` block.
pub struct MessagesFormat {
    id: String,
    model: String,
    input_tokens: usize,
    /// The index of the next block of a stream.
    next: u32,
    /// The stream's open text or thinking block.
    open: Option<(u32, TextKind)>,
}

impl MessagesFormat {
    /// The format of message `id` (`msg_…`) of `model`, whose prompt is `input_tokens` long.
    pub fn new(id: String, model: &str, input_tokens: usize) -> MessagesFormat {
        MessagesFormat {
            id,
            model: model.to_string(),
            input_tokens,
            next: 0,
            open: None,
        }
    }

    fn message(
        &self,
        content: Vec<ResponseBlock>,
        stop: Option<(&str, Option<String>)>,
        output_tokens: usize,
    ) -> MessagesResponse {
        let (stop_reason, stop_sequence) = match stop {
            Some((r, s)) => (Some(r.to_string()), s),
            None => (None, None),
        };
        MessagesResponse {
            id: self.id.clone(),
            kind: "message".into(),
            role: "assistant".into(),
            model: self.model.clone(),
            content,
            stop_reason,
            stop_sequence,
            usage: AnthropicUsage {
                input_tokens: self.input_tokens,
                output_tokens,
            },
        }
    }

    /// Close the open block, if any.
    fn close(&mut self, out: &mut Vec<StreamEvent>) {
        if let Some((index, _)) = self.open.take() {
            out.push(StreamEvent::ContentBlockStop { index });
        }
    }

    /// Start a block; returns its index.
    fn start(&mut self, block: ResponseBlock, out: &mut Vec<StreamEvent>) -> u32 {
        self.close(out);
        let index = self.next;
        self.next += 1;
        out.push(StreamEvent::ContentBlockStart {
            index,
            content_block: block,
        });
        index
    }

    /// The events of text of `kind`: a delta of the open block, or a new block.
    fn text(&mut self, kind: TextKind, text: String, out: &mut Vec<StreamEvent>) {
        let index = match self.open {
            Some((index, open)) if open == kind => index,
            _ => {
                let empty = match kind {
                    TextKind::Thinking => ResponseBlock::Thinking {
                        thinking: String::new(),
                        signature: String::new(),
                    },
                    TextKind::Text => ResponseBlock::Text {
                        text: String::new(),
                    },
                };
                let index = self.start(empty, out);
                self.open = Some((index, kind));
                index
            }
        };
        let delta = match kind {
            TextKind::Thinking => BlockDelta::ThinkingDelta { thinking: text },
            TextKind::Text => BlockDelta::TextDelta { text },
        };
        out.push(StreamEvent::ContentBlockDelta { index, delta });
    }
}

impl Format for MessagesFormat {
    type Body = MessagesResponse;
    type Chunk = StreamEvent;

    fn opening(&mut self) -> Vec<StreamEvent> {
        vec![
            StreamEvent::MessageStart {
                message: self.message(Vec::new(), None, 0),
            },
            StreamEvent::Ping,
        ]
    }

    fn chunks(&mut self, part: Part, _logprobs: &[EngineLogprob]) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        match part {
            Part::Reasoning(t) => self.text(TextKind::Thinking, t, &mut out),
            Part::Content(t) => self.text(TextKind::Text, t, &mut out),
            Part::ToolCall { call, .. } => {
                let arguments = call.arguments.clone();
                let empty = ResponseBlock::ToolUse {
                    id: call.id,
                    name: call.name,
                    input: json!({}),
                };
                let index = self.start(empty, &mut out);
                out.push(StreamEvent::ContentBlockDelta {
                    index,
                    delta: BlockDelta::InputJsonDelta {
                        partial_json: arguments,
                    },
                });
                out.push(StreamEvent::ContentBlockStop { index });
            }
        }
        out
    }

    fn finish_chunks(&mut self, finish: &Finish, _logprobs: &[EngineLogprob]) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        self.close(&mut out);
        let (reason, sequence) = stop_reason(finish);
        out.push(StreamEvent::MessageDelta {
            delta: MessageDeltaBody {
                stop_reason: Some(reason.to_string()),
                stop_sequence: sequence,
            },
            usage: DeltaUsage {
                output_tokens: finish.usage.completion_tokens,
            },
        });
        out.push(StreamEvent::MessageStop);
        out
    }

    fn usage_chunk(&mut self, _usage: Usage) -> Option<StreamEvent> {
        // The usage rides on `message_delta`.
        None
    }

    fn body(
        self,
        parts: Vec<(Part, Vec<EngineLogprob>)>,
        finish: Finish,
        _logprobs: Vec<EngineLogprob>,
    ) -> MessagesResponse {
        let mut content: Vec<ResponseBlock> = Vec::new();
        for (part, _) in parts {
            match (part, content.last_mut()) {
                (Part::Reasoning(t), Some(ResponseBlock::Thinking { thinking, .. })) => {
                    thinking.push_str(&t)
                }
                (Part::Reasoning(t), _) => content.push(ResponseBlock::Thinking {
                    thinking: t,
                    signature: String::new(),
                }),
                (Part::Content(t), Some(ResponseBlock::Text { text })) => text.push_str(&t),
                (Part::Content(t), _) => content.push(ResponseBlock::Text { text: t }),
                (Part::ToolCall { call, .. }, _) => content.push(tool_use(call)),
            }
        }
        let stop = stop_reason(&finish);
        self.message(content, Some(stop), finish.usage.completion_tokens)
    }

    fn event(chunk: &StreamEvent) -> SseEvent {
        SseEvent::default()
            .event(chunk.name())
            .data(serde_json::to_string(chunk).unwrap_or_default())
    }

    fn error_event(error: &ApiError) -> SseEvent {
        let event = StreamEvent::Error {
            error: error.anthropic_body().error,
        };
        Self::event(&event)
    }

    fn done_event() -> Option<SseEvent> {
        None
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::serve::chat::{template_messages, tool_mode, ToolMode};

    fn parse<T: serde::de::DeserializeOwned>(v: Value) -> T {
        serde_json::from_value(v).expect("a well-formed request")
    }

    fn translate(req: Value) -> Result<ChatCompletionRequest, ApiError> {
        let req: MessagesRequest = parse(req);
        chat_request_of_message(&req, 4096)
    }

    #[test]
    fn a_conversation_becomes_the_chat_messages_templates_read() {
        let chat = translate(json!({
            "model": "m",
            "max_tokens": 100,
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21 C"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": true},
                    {"type": "text", "text": "And "},
                    {"type": "text", "text": "tomorrow?"}
                ]}
            ],
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_k": 7,
            "metadata": {"user_id": "u1"}
        }))
        .expect("translates");
        assert_eq!(chat.max_tokens, Some(100));
        assert_eq!(chat.sampling.temperature, Some(0.5));
        assert_eq!(chat.sampling.top_k, Some(7));
        assert_eq!(
            chat.sampling.stop.clone().map(Stop::into_vec),
            Some(vec!["END".to_string()])
        );
        assert_eq!(chat.user.as_deref(), Some("u1"));
        let messages = template_messages(&chat.messages).expect("valid chat messages");
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "tool", "user"]
        );
        assert_eq!(messages[0]["content"], "Be brief.\n\nBe kind.");
        assert_eq!(messages[1]["content"], "Weather in Paris?");
        let assistant = &messages[2];
        assert_eq!(assistant["content"], "Let me look.");
        assert_eq!(assistant["reasoning_content"], "Use the tool.");
        assert_eq!(assistant["tool_calls"][0]["id"], "toolu_1");
        assert_eq!(
            assistant["tool_calls"][0]["function"]["name"],
            "get_weather"
        );
        assert_eq!(
            assistant["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
        assert_eq!(messages[3]["tool_call_id"], "toolu_1");
        assert_eq!(messages[3]["content"], "21 C");
        assert_eq!(messages[4]["tool_call_id"], "toolu_2");
        assert_eq!(messages[4]["content"], "Error: no such city");
        assert_eq!(messages[5]["content"], "And tomorrow?");
    }

    #[test]
    fn max_tokens_is_lowered_to_the_cap() {
        let req: MessagesRequest = parse(json!({
            "model": "m", "max_tokens": 64000,
            "messages": [{"role": "user", "content": "Hi"}]
        }));
        let chat = chat_request_of_message(&req, 256).expect("translates");
        assert_eq!(chat.max_tokens, Some(256));
    }

    #[test]
    fn tools_and_tool_choice_become_functions_and_modes() {
        let base = json!({
            "model": "m", "max_tokens": 10,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [
                {"name": "a", "description": "A.", "input_schema": {"type": "object"}},
                {"type": "custom", "name": "b", "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}
            ]
        });
        let with_choice = |choice: Option<Value>| {
            let mut req = base.clone();
            if let Some(c) = choice {
                req["tool_choice"] = c;
            }
            let chat = translate(req).expect("translates");
            tool_mode(&chat).expect("a valid tool mode")
        };
        assert_eq!(with_choice(None), ToolMode::Auto);
        assert_eq!(with_choice(Some(json!({"type": "auto"}))), ToolMode::Auto);
        assert_eq!(
            with_choice(Some(json!({"type": "any"}))),
            ToolMode::Required(None)
        );
        assert_eq!(
            with_choice(Some(json!({"type": "tool", "name": "b"}))),
            ToolMode::Required(Some("b".into()))
        );
        assert_eq!(with_choice(Some(json!({"type": "none"}))), ToolMode::Off);
        let chat = translate(base.clone()).expect("translates");
        let tools = chat.tools.expect("tools");
        assert_eq!(tools[0].kind, "function");
        assert_eq!(tools[0].function.name, "a");
        assert_eq!(tools[0].function.description.as_deref(), Some("A."));
        assert_eq!(
            tools[1].function.parameters,
            Some(json!({"type": "object", "properties": {"x": {"type": "integer"}}}))
        );
    }

    #[test]
    fn what_cannot_be_translated_is_a_400_naming_the_field() {
        let cases = [
            (
                json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                None,
                "messages[0].content[0].type",
            ),
            (
                json!([{"role": "system", "content": "Hi"}]),
                None,
                "messages[0].role",
            ),
            (
                json!([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "a", "input": "x"}]}]),
                None,
                "messages[0].content[0].input",
            ),
            (
                json!([{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]),
                None,
                "messages[0].content[0].tool_use_id",
            ),
            (
                json!([{"role": "user", "content": "Hi"}]),
                Some(json!({"type": "tool"})),
                "tool_choice.name",
            ),
            (
                json!([{"role": "user", "content": "Hi"}]),
                Some(json!({"type": "sometimes"})),
                "tool_choice.type",
            ),
        ];
        for (messages, choice, param) in cases {
            let mut req = json!({"model": "m", "max_tokens": 5, "messages": messages,
                "tools": [{"name": "a", "input_schema": {"type": "object"}}]});
            if let Some(c) = choice {
                req["tool_choice"] = c;
            }
            let e = translate(req).expect_err("refused");
            assert_eq!(e.status, 400);
            assert_eq!(e.param.as_deref(), Some(param));
            let body = serde_json::to_value(e.anthropic_body()).expect("serializes");
            assert_eq!(body["type"], "error");
            assert_eq!(body["error"]["type"], "invalid_request_error");
            assert!(
                body["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(param)),
                "{body}"
            );
        }
        let server_tool = json!({"model": "m", "max_tokens": 5,
            "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]});
        let e = translate(server_tool).expect_err("refused");
        assert_eq!(e.param.as_deref(), Some("tools[0].type"));
    }

    #[test]
    fn statuses_take_anthropic_types_and_503_is_overloaded() {
        use axum::http::StatusCode;
        for (status, want_status, kind) in [
            (400, 400, "invalid_request_error"),
            (401, 401, "authentication_error"),
            (404, 404, "not_found_error"),
            (413, 413, "request_too_large"),
            (429, 429, "rate_limit_error"),
            (500, 500, "api_error"),
            (503, 529, "overloaded_error"),
        ] {
            let e = ApiError::new(StatusCode::from_u16(status).expect("a status"), "m");
            let (got, got_kind) = e.anthropic_kind();
            assert_eq!((got.as_u16(), got_kind), (want_status, kind));
        }
    }

    fn finish(reason: &'static str, stop_sequence: Option<&str>) -> Finish {
        Finish {
            reason,
            usage: Usage {
                prompt_tokens: 11,
                completion_tokens: 4,
                total_tokens: 15,
                prompt_tokens_details: crate::serve::openai::PromptTokensDetails {
                    cached_tokens: 3,
                },
            },
            timings: crate::serve::openai::Timings {
                cache_n: 3,
                prompt_n: 8,
                prompt_ms: 40.0,
                prompt_per_second: 200.0,
                predicted_n: 4,
                predicted_ms: 30.0,
                predicted_per_second: 100.0,
            },
            stop_sequence: stop_sequence.map(str::to_string),
        }
    }

    fn call(n: u32, arguments: &str) -> Part {
        Part::ToolCall {
            index: n,
            call: crate::tool_calls::ToolCall {
                id: format!("toolu_x_{n}"),
                name: "get_weather".into(),
                arguments: arguments.into(),
            },
        }
    }

    /// The message a stream's events add up to, checking that blocks open, grow and close in
    /// order, as Anthropic's clients expect.
    fn reassemble(events: &[StreamEvent]) -> MessagesResponse {
        let mut message = match events.first() {
            Some(StreamEvent::MessageStart { message }) => message.clone(),
            other => panic!("a stream starts with message_start, not {other:?}"),
        };
        assert!(matches!(events.last(), Some(StreamEvent::MessageStop)));
        let mut open: Option<u32> = None;
        let mut json = String::new();
        for e in &events[1..events.len() - 1] {
            match e {
                StreamEvent::Ping => {}
                StreamEvent::ContentBlockStart {
                    index,
                    content_block,
                } => {
                    assert_eq!(open, None, "a block starts while another is open");
                    assert_eq!(*index as usize, message.content.len());
                    open = Some(*index);
                    message.content.push(content_block.clone());
                }
                StreamEvent::ContentBlockDelta { index, delta } => {
                    assert_eq!(open, Some(*index));
                    match (message.content.last_mut(), delta) {
                        (Some(ResponseBlock::Text { text }), BlockDelta::TextDelta { text: t }) => {
                            text.push_str(t)
                        }
                        (
                            Some(ResponseBlock::Thinking { thinking, .. }),
                            BlockDelta::ThinkingDelta { thinking: t },
                        ) => thinking.push_str(t),
                        (
                            Some(ResponseBlock::ToolUse { .. }),
                            BlockDelta::InputJsonDelta { partial_json },
                        ) => json.push_str(partial_json),
                        (block, delta) => panic!("{delta:?} in {block:?}"),
                    }
                }
                StreamEvent::ContentBlockStop { index } => {
                    assert_eq!(open.take(), Some(*index));
                    if let Some(ResponseBlock::ToolUse { input, .. }) = message.content.last_mut() {
                        *input = serde_json::from_str(&std::mem::take(&mut json))
                            .expect("the input deltas add up to JSON");
                    }
                }
                StreamEvent::MessageDelta { delta, usage } => {
                    assert_eq!(open, None, "message_delta after every block closed");
                    message.stop_reason = delta.stop_reason.clone();
                    message.stop_sequence = delta.stop_sequence.clone();
                    message.usage.output_tokens = usage.output_tokens;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        message
    }

    fn stream_and_body(parts: Vec<Part>, end: Finish) -> (MessagesResponse, MessagesResponse) {
        let mut format = MessagesFormat::new("msg_x".into(), "m", 11);
        let mut events = format.opening();
        for p in parts.clone() {
            events.extend(format.chunks(p, &[]));
        }
        events.extend(format.finish_chunks(&end, &[]));
        let streamed = reassemble(&events);
        let body = MessagesFormat::new("msg_x".into(), "m", 11).body(
            parts.into_iter().map(|p| (p, Vec::new())).collect(),
            end,
            Vec::new(),
        );
        (streamed, body)
    }

    #[test]
    fn the_body_holds_what_the_stream_delivers() {
        let parts = vec![
            Part::Reasoning("Think".into()),
            Part::Reasoning("ing.".into()),
            Part::Content("Hel".into()),
            Part::Content("lo.".into()),
            call(0, r#"{"city":"Paris"}"#),
            call(1, r#"{"city":"Rome"}"#),
        ];
        let (streamed, body) = stream_and_body(parts, finish("tool_calls", None));
        assert_eq!(
            body.content,
            vec![
                ResponseBlock::Thinking {
                    thinking: "Thinking.".into(),
                    signature: String::new()
                },
                ResponseBlock::Text {
                    text: "Hello.".into()
                },
                ResponseBlock::ToolUse {
                    id: "toolu_x_0".into(),
                    name: "get_weather".into(),
                    input: json!({"city": "Paris"})
                },
                ResponseBlock::ToolUse {
                    id: "toolu_x_1".into(),
                    name: "get_weather".into(),
                    input: json!({"city": "Rome"})
                },
            ]
        );
        assert_eq!(body.stop_reason.as_deref(), Some("tool_use"));
        assert_eq!(
            body.usage,
            AnthropicUsage {
                input_tokens: 11,
                output_tokens: 4
            }
        );
        assert_eq!(streamed.content, body.content);
        assert_eq!(streamed.stop_reason, body.stop_reason);
        assert_eq!(streamed.usage, body.usage);
        assert_eq!(body.id, "msg_x");
        assert_eq!(body.kind, "message");
        assert_eq!(body.role, "assistant");
    }

    #[test]
    fn stop_reasons_follow_how_generation_ended() {
        for (end, reason, sequence) in [
            (finish("stop", None), "end_turn", None),
            (finish("stop", Some("END")), "stop_sequence", Some("END")),
            (finish("length", None), "max_tokens", None),
            (finish("tool_calls", None), "tool_use", None),
        ] {
            let (streamed, body) = stream_and_body(vec![Part::Content("a".into())], end);
            assert_eq!(body.stop_reason.as_deref(), Some(reason));
            assert_eq!(body.stop_sequence.as_deref(), sequence);
            assert_eq!(streamed.stop_reason, body.stop_reason);
            assert_eq!(streamed.stop_sequence, body.stop_sequence);
        }
    }

    #[test]
    fn the_openapi_document_has_the_routes_and_their_schemas() {
        let doc: Value =
            serde_json::from_str(&crate::serve::openapi_json()).expect("the document is JSON");
        for path in [
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/tokenize",
            "/detokenize",
        ] {
            assert!(doc["paths"][path]["post"].is_object(), "{path}");
        }
        let messages = &doc["paths"]["/v1/messages"]["post"]["responses"];
        assert!(messages["529"].is_object(), "{messages}");
        for schema in [
            "MessagesRequest",
            "MessagesResponse",
            "StreamEvent",
            "AnthropicErrorBody",
            "TokenizeResponse",
        ] {
            assert!(doc["components"]["schemas"][schema].is_object(), "{schema}");
        }
    }

    #[test]
    fn text_after_a_call_opens_a_new_block() {
        let parts = vec![
            Part::Content("a".into()),
            call(0, "{}"),
            Part::Content("b".into()),
        ];
        let (streamed, body) = stream_and_body(parts, finish("tool_calls", None));
        assert_eq!(body.content.len(), 3);
        assert_eq!(streamed.content, body.content);
    }
}
