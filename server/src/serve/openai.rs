//! The OpenAI-compatible wire types: requests, responses and stream chunks of
//! `/v1/chat/completions`, `/v1/completions` and `/v1/models`, vLLM's `/tokenize` and
//! `/detokenize`, and the error body. With Anthropic's ([`super::anthropic`]) these are the
//! only serde types of the HTTP API; `/openapi.json` is generated from them.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
pub struct StreamOptions {
    /// Send a last chunk with the request's `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// A part of a multi-part message content (only text parts are accepted).
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ContentPart {
    /// `text`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// Message content: a string or a list of text parts.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// The function of a tool call.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// A tool call made by the assistant.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ToolCall {
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

/// One message of a conversation.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Calls the assistant made (assistant messages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// The call this message answers (tool messages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The assistant's reasoning (passed back to templates that render it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

/// A function the model may call.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct FunctionDef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the arguments object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A tool: `{"type": "function", "function": {...}}`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct Tool {
    /// `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type":"function","function":{"name":...}}`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    #[schema(value_type = Object)]
    Named(Value),
}

/// `response_format.json_schema`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct JsonSchemaFormat {
    #[serde(default)]
    pub name: Option<String>,
    #[schema(value_type = Object)]
    pub schema: Value,
    #[serde(default)]
    pub strict: Option<bool>,
}

/// `response_format`: `{"type":"text"}`, `{"type":"json_object"}` or
/// `{"type":"json_schema","json_schema":{...}}`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub json_schema: Option<JsonSchemaFormat>,
}

/// The sampling and stopping fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
pub struct SamplingFields {
    /// 0 is greedy. Default: the model's generation_config.json, else 1.
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Extension: keep the k most likely tokens (0 = off).
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Extension: drop tokens below this fraction of the top token's probability.
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Extension: HF repetition penalty (1 = off).
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    /// The same seed and settings give the same tokens, alone or batched with others.
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Only 1 is supported.
    #[serde(default)]
    pub n: Option<u32>,
    /// Extension: keep generating past end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ChatCompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    /// Deprecated alias of `max_completion_tokens`.
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Return each generated token's log-probability.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many alternatives per token (0–20).
    #[serde(default)]
    pub top_logprobs: Option<i64>,
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    #[serde(default)]
    pub tool_choice: Option<ToolChoice>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    /// Extension: a grammar the output must match, in llguidance's Lark dialect.
    #[serde(default)]
    pub grammar: Option<String>,
    /// Extension: extra chat template arguments (e.g. `{"enable_thinking": false}`).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<Value>,
    #[serde(default)]
    pub user: Option<String>,
}

/// `prompt` of `/v1/completions`: a string, a list with one string, or token ids.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Prompt,
    /// Default 16, as in OpenAI's API.
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Return this many alternatives per token (0–20) with each token's log-probability.
    #[serde(default)]
    pub logprobs: Option<i64>,
    /// Prepend the prompt to the returned text.
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    /// Extension: a grammar the output must match, in llguidance's Lark dialect.
    #[serde(default)]
    pub grammar: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV was reused from an earlier request in the same slot.
    pub cached_tokens: usize,
}

/// Token counts of a request.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// Extension, as llama.cpp's server names it: where a request's time went, on the last chunk
/// of a stream (the one with `finish_reason`) and in a whole answer. Time from the request's
/// admission to a slot to its first generated token is the prompt's; from the first to the
/// last generated token, the generation's.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Timings {
    /// Prompt tokens whose KV was reused from the slot's previous sequence.
    pub cache_n: usize,
    /// Prompt tokens computed.
    pub prompt_n: usize,
    /// Milliseconds from admission to the first generated token.
    pub prompt_ms: f64,
    /// Prompt tokens computed per second of `prompt_ms`.
    pub prompt_per_second: f64,
    /// Tokens generated.
    pub predicted_n: usize,
    /// Milliseconds from the first to the last generated token.
    pub predicted_ms: f64,
    /// Tokens after the first per second of `predicted_ms` (0 with one token).
    pub predicted_per_second: f64,
}

/// One alternative of a token's log-probability.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// A generated token's log-probability (chat format).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// `choices[].logprobs` of a chat completion.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChoiceLogprobs {
    pub content: Vec<TokenLogprob>,
}

/// The assistant's answer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: String,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChoiceLogprobs>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: String,
}

/// The response of `/v1/chat/completions` (not streamed).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// Extension: what the server could not do as asked (for example a chat template that
    /// does not render `tools`); absent when there is nothing to say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warnings: Option<Vec<String>>,
    /// Extension: where the request's time went.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// A tool call piece in a stream chunk.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCallDelta,
}

/// The function piece of a streamed tool call.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// What a stream chunk adds to the message.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// One choice of a stream chunk.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: Option<String>,
}

/// A `chat.completion.chunk` (one SSE event of a streamed chat completion).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Extension: the response's warnings (see [`ChatCompletion::warnings`]), on the first
    /// chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warnings: Option<Vec<String>>,
    /// Extension: where the request's time went, on the chunk with `finish_reason`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// `choices[].logprobs` of a text completion (the legacy format).
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    #[schema(value_type = Vec<Object>)]
    pub top_logprobs: Vec<serde_json::Map<String, Value>>,
    pub text_offset: Vec<usize>,
}

/// One choice of a text completion (or of its stream chunk).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
}

/// The response of `/v1/completions`, and each SSE event when streamed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Completion {
    pub id: String,
    /// `text_completion`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Extension: where the request's time went, in a whole answer and on the chunk with
    /// `finish_reason`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<Timings>,
}

/// A model the server serves.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    /// `model`.
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// Extension: tokens per request (prompt plus generated).
    pub max_model_len: usize,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ModelList {
    /// `list`.
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// The body of every error response.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong, OpenAI-shaped.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error`, `server_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The offending request field, when there is one.
    pub param: Option<String>,
    pub code: Option<String>,
}

/// `POST /tokenize` (an extension, as vLLM has it): a prompt, or a conversation rendered as
/// `/v1/chat/completions` renders it.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// Text to tokenize (give this or `messages`).
    #[serde(default)]
    pub prompt: Option<String>,
    /// A conversation: the prompt a chat completion request with these messages (and `tools`,
    /// `chat_template_kwargs`) would send the model.
    #[serde(default)]
    pub messages: Option<Vec<ChatMessage>>,
    /// With `prompt`: add the tokenizer's special tokens (default true). A conversation's
    /// tokens are always those of the chat prompt.
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub tools: Option<Vec<Tool>>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<Value>,
}

/// The response of `/tokenize`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct TokenizeResponse {
    pub tokens: Vec<u32>,
    pub count: usize,
    /// Tokens per request (prompt plus generated).
    pub max_model_len: usize,
}

/// `POST /detokenize` (an extension, as vLLM has it).
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// Token ids of the model's vocabulary.
    pub tokens: Vec<u32>,
}

/// The response of `/detokenize`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    /// The text of the tokens (special tokens included).
    pub prompt: String,
}

/// `GET /health` and `GET /ready`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// `ok`, `loading` or `draining`.
    pub status: String,
}
