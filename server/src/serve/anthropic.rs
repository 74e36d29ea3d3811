//! The wire types of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`):
//! requests, responses, stream events and the error body. Beside [`super::openai`], these are
//! the serde types of the HTTP API; `/openapi.json` is generated from both. What they mean is
//! the Anthropic API's; how a request becomes a chat request is [`super::messages`]'s.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// `system`: a string or a list of text blocks.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum SystemPrompt {
    Text(String),
    Blocks(Vec<TextBlockParam>),
}

/// A block of `system` or of a `tool_result`'s `content`: only `text` blocks are accepted.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct TextBlockParam {
    /// `text`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// Message content: a string or a list of content blocks.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Blocks(Vec<InputBlock>),
}

/// A content block of a request. Which fields a block needs depends on its `type`:
/// `text` (`text`), `tool_use` (`id`, `name`, `input`), `tool_result` (`tool_use_id`,
/// `content`, `is_error`), `thinking` (`thinking`, `signature`) and `redacted_thinking`
/// (`data`); other types (images, documents) are refused.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
pub struct InputBlock {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The arguments of a `tool_use` block (an object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub input: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_use_id: Option<String>,
    /// The result of a `tool_result` block: a string or a list of text blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<ToolResultContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_error: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
}

/// The `content` of a `tool_result` block.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ToolResultContent {
    Text(String),
    Blocks(Vec<TextBlockParam>),
}

/// One message of a conversation.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct InputMessage {
    /// `user` or `assistant`.
    pub role: String,
    pub content: MessageContent,
}

/// A tool the model may use: a client tool (`type` absent or `custom`).
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct AnthropicTool {
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the tool's input object.
    #[schema(value_type = Object)]
    pub input_schema: Value,
}

/// `tool_choice`: `{"type": "auto" | "any" | "none"}` or `{"type": "tool", "name": ...}`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct AnthropicToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Accepted; a forced call is always one call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disable_parallel_tool_use: Option<bool>,
}

/// `metadata`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
pub struct Metadata {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
}

/// `thinking`: `{"type": "enabled", "budget_tokens": n}` or `{"type": "disabled"}`; passed to
/// the chat template as `enable_thinking` (the budget is not enforced).
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ThinkingConfig {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_tokens: Option<i64>,
}

/// `POST /v1/messages`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct MessagesRequest {
    pub model: String,
    pub messages: Vec<InputMessage>,
    /// Tokens to generate at most (within the server's `max_tokens_cap`, which it is lowered
    /// to).
    pub max_tokens: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<SystemPrompt>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<AnthropicTool>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<AnthropicToolChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Metadata>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<ThinkingConfig>,
}

/// `POST /v1/messages/count_tokens`: what a message request would send the model.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct CountTokensRequest {
    pub model: String,
    pub messages: Vec<InputMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<SystemPrompt>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<AnthropicTool>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<AnthropicToolChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<ThinkingConfig>,
}

/// The response of `/v1/messages/count_tokens`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct CountTokens {
    /// The prompt's tokens: `usage.input_tokens` of a message request with the same input.
    pub input_tokens: usize,
}

/// A content block of a response.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseBlock {
    /// The model's reasoning (`signature` is empty: there is nothing to verify).
    Thinking {
        thinking: String,
        signature: String,
    },
    Text {
        text: String,
    },
    ToolUse {
        /// `toolu_…`.
        id: String,
        name: String,
        #[schema(value_type = Object)]
        input: Value,
    },
}

/// Token counts of a message.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, ToSchema)]
pub struct AnthropicUsage {
    /// The prompt's tokens (those reused from a slot's cache included).
    pub input_tokens: usize,
    pub output_tokens: usize,
}

/// The response of `/v1/messages` (not streamed), and the `message` of `message_start`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct MessagesResponse {
    /// `msg_…`.
    pub id: String,
    /// `message`.
    #[serde(rename = "type")]
    pub kind: String,
    /// `assistant`.
    pub role: String,
    pub model: String,
    pub content: Vec<ResponseBlock>,
    /// `end_turn`, `max_tokens`, `stop_sequence` or `tool_use` (null in `message_start`).
    pub stop_reason: Option<String>,
    /// The stop sequence that ended the message, when one did.
    pub stop_sequence: Option<String>,
    pub usage: AnthropicUsage,
}

/// What a `content_block_delta` event adds to its block.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    TextDelta {
        text: String,
    },
    ThinkingDelta {
        thinking: String,
    },
    /// JSON text of a `tool_use` block's input (the concatenated deltas parse as the object).
    InputJsonDelta {
        partial_json: String,
    },
}

/// `message_delta.delta`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct MessageDeltaBody {
    pub stop_reason: Option<String>,
    pub stop_sequence: Option<String>,
}

/// `message_delta.usage`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct DeltaUsage {
    pub output_tokens: usize,
}

/// One event of a streamed message; its SSE `event:` name is its `type`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    MessageStart {
        message: MessagesResponse,
    },
    ContentBlockStart {
        index: u32,
        content_block: ResponseBlock,
    },
    Ping,
    ContentBlockDelta {
        index: u32,
        delta: BlockDelta,
    },
    ContentBlockStop {
        index: u32,
    },
    MessageDelta {
        delta: MessageDeltaBody,
        usage: DeltaUsage,
    },
    MessageStop,
    /// A failure after the stream started; nothing follows.
    Error {
        error: AnthropicError,
    },
}

impl StreamEvent {
    /// The SSE `event:` name: the event's `type`.
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::Ping => "ping",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop => "message_stop",
            StreamEvent::Error { .. } => "error",
        }
    }
}

/// The body of every error of the Anthropic routes.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct AnthropicErrorBody {
    /// `error`.
    #[serde(rename = "type")]
    pub kind: String,
    pub error: AnthropicError,
}

/// What went wrong, Anthropic-shaped.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct AnthropicError {
    /// `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `request_too_large`, `rate_limit_error`, `api_error` or `overloaded_error`.
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}
