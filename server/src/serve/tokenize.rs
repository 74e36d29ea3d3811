//! `/tokenize` and `/detokenize`, as vLLM has them: a prompt or a conversation into the
//! model's token ids (a conversation rendered exactly as `/v1/chat/completions` renders it,
//! [`super::chat::render_chat`]), and token ids back into text.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::chat::{check_model, parse_body, render_chat, respond};
use super::errors::{ApiError, ErrorShape};
use super::openai::*;
use super::AppState;

/// `POST /tokenize`.
#[utoipa::path(post, path = "/tokenize", request_body = TokenizeRequest,
    responses(
        (status = 200, body = TokenizeResponse),
        (status = 400, body = ErrorBody, description = "A request field is invalid (`param` names it)"),
        (status = 401, body = ErrorBody, description = "Missing or invalid API key"),
        (status = 404, body = ErrorBody, description = "Unknown model"),
        (status = 413, body = ErrorBody, description = "Body larger than max_body_bytes"),
        (status = 503, body = ErrorBody, description = "Loading or draining")
    ),
    security(("api_key" = []))
)]
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let trace = super::otlp::parent_context(&headers);
    let result = tokenize_inner(&state, body);
    respond(
        &state,
        "/tokenize",
        arrived,
        trace,
        result,
        ErrorShape::OpenAi,
    )
}

fn tokenize_inner(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: TokenizeRequest = parse_body(body)?;
    let tokens = match (&req.prompt, &req.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "give either `prompt` or `messages`, not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "give `prompt` (text) or `messages` (a conversation)",
            ))
        }
        (Some(prompt), None) => {
            check_model(state, &req.model)?;
            let serving = state.serving()?;
            let tok = serving
                .loaded
                .tokenizer
                .as_ref()
                .ok_or_else(|| ApiError::invalid("prompt", "this model has no tokenizer"))?;
            tok.encode(prompt, req.add_special_tokens.unwrap_or(true))
                .map_err(|e| ApiError::invalid("prompt", format!("{e}")))?
        }
        (None, Some(messages)) => {
            let chat = ChatCompletionRequest {
                model: req.model.clone(),
                messages: messages.clone(),
                max_tokens: None,
                max_completion_tokens: None,
                sampling: SamplingFields::default(),
                logprobs: None,
                top_logprobs: None,
                tools: req.tools.clone(),
                tool_choice: None,
                parallel_tool_calls: None,
                response_format: None,
                grammar: None,
                chat_template_kwargs: req.chat_template_kwargs.clone(),
                user: None,
            };
            render_chat(state, &chat)?.prompt
        }
    };
    let max_model_len = state.serving()?.context;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        tokens,
        max_model_len,
    })
    .into_response())
}

/// `POST /detokenize`.
#[utoipa::path(post, path = "/detokenize", request_body = DetokenizeRequest,
    responses(
        (status = 200, body = DetokenizeResponse),
        (status = 400, body = ErrorBody, description = "A token id is not in the vocabulary (`param` names it)"),
        (status = 401, body = ErrorBody, description = "Missing or invalid API key"),
        (status = 404, body = ErrorBody, description = "Unknown model"),
        (status = 413, body = ErrorBody, description = "Body larger than max_body_bytes"),
        (status = 503, body = ErrorBody, description = "Loading or draining")
    ),
    security(("api_key" = []))
)]
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let trace = super::otlp::parent_context(&headers);
    let result = detokenize_inner(&state, body);
    respond(
        &state,
        "/detokenize",
        arrived,
        trace,
        result,
        ErrorShape::OpenAi,
    )
}

fn detokenize_inner(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: DetokenizeRequest = parse_body(body)?;
    check_model(state, &req.model)?;
    let serving = state.serving()?;
    let tok = serving
        .loaded
        .tokenizer
        .as_ref()
        .ok_or_else(|| ApiError::invalid("tokens", "this model has no tokenizer"))?;
    let vocab = serving.loaded.model.info().vocab_size;
    if let Some((i, bad)) = req
        .tokens
        .iter()
        .enumerate()
        .find(|&(_, &t)| t as usize >= vocab)
    {
        return Err(ApiError::invalid(
            &format!("tokens[{i}]"),
            format!("token id {bad} is outside the vocabulary (size {vocab})"),
        ));
    }
    let prompt = tok
        .decode(&req.tokens, false)
        .map_err(|e| ApiError::invalid("tokens", format!("{e}")))?;
    Ok(Json(DetokenizeResponse { prompt }).into_response())
}
