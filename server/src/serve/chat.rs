//! `/v1/chat/completions` and `/v1/completions`: parse and validate the request, render the
//! conversation through the model's chat template (with tools), build the sampling
//! parameters and the output constraint, and submit to the scheduler; the answer is the
//! pump's ([`super::pump`]), written in the endpoint's format ([`super::formats`]).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use colibri::runtime::grammar::{Constraint, ConstraintError, Grammar};
use colibri::runtime::sampling::SamplingParams;
use colibri::runtime::scheduler::{Request as EngineRequest, SubmitError};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use super::errors::{ApiError, ErrorShape};
use super::formats::{AnswerId, ChatFormat, CompletionFormat};
use super::openai::*;
use super::pump::{answer, Delivery, Events, Reading, Timing};
use super::{AppState, Serving};
use crate::tool_calls::{required_tool_call_grammar, ChatStream, Tools};

/// The prefix of chat completion ids (`chatcmpl-…`); tool call ids are `call_…` with the same
/// suffix.
const CHAT_ID_PREFIX: &str = "chatcmpl";

/// Parse a JSON body, naming the field that is wrong.
pub(super) fn parse_body<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body.map_err(ApiError::from)?;
    parse_json(&body)
}

/// Parse a request body's bytes into a typed request (`T` is [`ChatCompletionRequest`] or
/// [`CompletionRequest`]): a 400 naming the field that is wrong, or saying what follows the
/// JSON value.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let parsed = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let mut path = e.path().to_string();
        let mut inner = e.into_inner().to_string();
        if path == "." || path.is_empty() {
            // serde loses the path inside `#[serde(flatten)]` (the shared sampling fields):
            // find the culprit by reading them on their own.
            if let Ok(v) = serde_json::from_slice::<Value>(body) {
                if let Err(e) = serde_path_to_error::deserialize::<_, SamplingFields>(v) {
                    path = e.path().to_string();
                    inner = e.into_inner().to_string();
                }
            }
        }
        let param = (path != "." && !path.is_empty()).then_some(path);
        let mut err = ApiError::new(
            StatusCode::BAD_REQUEST,
            match &param {
                Some(p) => format!("invalid request body at `{p}`: {inner}"),
                None => format!("invalid request body: {inner}"),
            },
        );
        err.param = param;
        err
    })?;
    // Only whitespace may follow the JSON value.
    de.end().map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("invalid request body: {e}: only whitespace may follow the JSON value"),
        )
    })?;
    Ok(parsed)
}

/// Everything a request asks the engine for.
struct Job {
    prompt: Vec<u32>,
    max_tokens: usize,
    stop: Vec<String>,
    sampling: SamplingParams,
    ignore_eos: bool,
    logprobs: Option<usize>,
    grammar: Option<Grammar>,
    /// The request field the grammar came from (named in errors).
    grammar_param: String,
}

/// Sampling parameters from the request, the model's generation defaults, then OpenAI's.
fn sampling_params(f: &SamplingFields, serving: &Serving) -> Result<SamplingParams, ApiError> {
    let g = &serving.loaded.generation;
    let sampled_by_default = g.do_sample != Some(false);
    let temperature = f
        .temperature
        .or(if sampled_by_default {
            g.temperature
        } else {
            Some(0.0)
        })
        .unwrap_or(1.0);
    let check = |name: &str, v: f32, ok: bool, expected: &str| {
        if ok {
            Ok(())
        } else {
            Err(ApiError::invalid(
                name,
                format!("`{name}` is {v}; expected {expected}"),
            ))
        }
    };
    check(
        "temperature",
        temperature,
        temperature.is_finite() && (0.0..=2.0).contains(&temperature),
        "a number in [0, 2]",
    )?;
    let top_p = f.top_p.or(g.top_p).unwrap_or(1.0);
    check(
        "top_p",
        top_p,
        top_p > 0.0 && top_p <= 1.0,
        "a number in (0, 1]",
    )?;
    let min_p = f.min_p.or(g.min_p).unwrap_or(0.0);
    check(
        "min_p",
        min_p,
        (0.0..=1.0).contains(&min_p),
        "a number in [0, 1]",
    )?;
    let presence = f.presence_penalty.unwrap_or(0.0);
    check(
        "presence_penalty",
        presence,
        (-2.0..=2.0).contains(&presence),
        "a number in [-2, 2]",
    )?;
    let frequency = f.frequency_penalty.unwrap_or(0.0);
    check(
        "frequency_penalty",
        frequency,
        (-2.0..=2.0).contains(&frequency),
        "a number in [-2, 2]",
    )?;
    let repetition = f.repetition_penalty.or(g.repetition_penalty).unwrap_or(1.0);
    check(
        "repetition_penalty",
        repetition,
        repetition.is_finite() && repetition > 0.0 && repetition <= 10.0,
        "a number in (0, 10]",
    )?;
    let top_k = match f.top_k {
        Some(k) if k < -1 => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` is {k}; expected 0 or -1 (off) or a positive number"),
            ))
        }
        Some(k) if k <= 0 => 0,
        Some(k) => k as usize,
        None => g.top_k.map(|k| k as usize).unwrap_or(0),
    };
    if let Some(n) = f.n {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("`n` is {n}; this server generates one choice per request (n = 1)"),
            ));
        }
    }
    Ok(SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty: repetition,
        presence_penalty: presence,
        frequency_penalty: frequency,
        seed: match f.seed {
            Some(s) => s as u64,
            None => random_seed(),
        },
    })
}

pub(super) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// `max_tokens` resolved against the server's cap and the slot's room.
fn max_tokens(
    requested: Option<i64>,
    param: &str,
    prompt_len: usize,
    serving: &Serving,
    cap: usize,
) -> Result<usize, ApiError> {
    let context = serving.context;
    if prompt_len >= context {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "the prompt is {prompt_len} tokens but this server's context is {context} tokens per request (prompt plus output, at least one output token); shorten the prompt{}",
                if context < serving.loaded.model.info().max_position_embeddings {
                    format!(
                        " or start the server with a larger --context (the model allows {})",
                        serving.loaded.model.info().max_position_embeddings
                    )
                } else {
                    String::new()
                }
            ),
        )
        .code("context_length_exceeded"));
    }
    let room = context - prompt_len;
    match requested {
        None => Ok(cap.min(room)),
        Some(n) if n < 1 => Err(ApiError::invalid(
            param,
            format!("`{param}` is {n}; expected at least 1"),
        )),
        Some(n) if n as u64 > cap as u64 => Err(ApiError::invalid(
            param,
            format!("`{param}` is {n}; this server allows at most {cap} tokens per request (max_tokens_cap)"),
        )),
        Some(n) => Ok((n as usize).min(room)),
    }
}

fn stop_strings(stop: &Option<Stop>) -> Result<Vec<String>, ApiError> {
    let stops = stop.clone().map(Stop::into_vec).unwrap_or_default();
    if stops.len() > 16 {
        return Err(ApiError::invalid("stop", "at most 16 stop strings"));
    }
    if stops.iter().any(|s| s.is_empty()) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    Ok(stops)
}

fn response_grammar(
    format: &Option<ResponseFormat>,
    grammar: &Option<String>,
) -> Result<Option<Grammar>, ApiError> {
    let from_format = match format {
        None => None,
        Some(f) => match f.kind.as_str() {
            "text" => None,
            "json_object" => Some(Grammar::JsonObject),
            "json_schema" => match &f.json_schema {
                Some(s) => Some(Grammar::JsonSchema {
                    schema: s.schema.clone(),
                    // Strict unless the request says otherwise: closed objects, bounded numbers.
                    strict: s.strict != Some(false),
                }),
                None => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema",
                        "`response_format` of type json_schema needs a `json_schema` object with a `schema`",
                    ))
                }
            },
            other => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    format!("unknown response_format type `{other}`; expected text, json_object or json_schema"),
                ))
            }
        },
    };
    match (from_format, grammar) {
        (Some(_), Some(_)) => Err(ApiError::invalid(
            "grammar",
            "give either `response_format` or `grammar`, not both",
        )),
        (Some(g), None) => Ok(Some(g)),
        (None, Some(l)) => Ok(Some(Grammar::Lark(l.clone()))),
        (None, None) => Ok(None),
    }
}

/// Compile a request's output constraint, off the async runtime (the engine compiles it on a
/// thread of its own, after checking its size and depth). Every refusal is a 400 naming the
/// field the constraint came from, except a compiler thread that cannot start (500).
async fn compile_constraint(
    serving: &Arc<Serving>,
    grammar: &Grammar,
    param: &str,
) -> Result<Constraint, ApiError> {
    if serving.grammar.is_none() {
        return Err(ApiError::invalid(
            param,
            "constrained output is not available for this model (its vocabulary could not be read for the grammar engine)",
        ));
    }
    let compile = {
        let serving = serving.clone();
        let grammar = grammar.clone();
        tokio::task::spawn_blocking(move || match &serving.grammar {
            Some(vocab) => vocab.constraint(&grammar),
            None => unreachable!("checked above"),
        })
    };
    match compile.await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e @ ConstraintError::Thread(_))) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot compile the output constraint: {e}"),
        )),
        Ok(Err(e)) => Err(ApiError::invalid(
            param,
            format!("cannot use the output constraint: {e}"),
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("compiling the output constraint failed: {e}"),
        )),
    }
}

/// The request field a constraint from [`response_grammar`] came from.
fn grammar_param(grammar: &Option<String>) -> &'static str {
    if grammar.is_some() {
        "grammar"
    } else {
        "response_format"
    }
}

/// Submit a job; returns its events.
async fn submit(serving: &Arc<Serving>, job: Job) -> Result<Events, ApiError> {
    let constraint = match &job.grammar {
        None => None,
        Some(g) => Some(compile_constraint(serving, g, &job.grammar_param).await?),
    };
    let (sink, events) = Events::channel();
    let request = EngineRequest {
        prompt: job.prompt,
        max_tokens: job.max_tokens,
        eos_token_ids: if job.ignore_eos && job.grammar.is_none() {
            Vec::new()
        } else {
            serving.loaded.eos_token_ids.clone()
        },
        stop_strings: job.stop,
        sampling: job.sampling,
        logprobs: job.logprobs,
        constraint,
        sink,
    };
    serving.scheduler.submit(request).map_err(|e| match e {
        SubmitError::QueueFull { limit } => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "the server is busy: {limit} requests are already waiting for a slot; retry later"
            ),
        )
        .code("queue_full")
        .retry_after(1),
        SubmitError::ShuttingDown => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        )
        .retry_after(5),
    })?;
    Ok(events)
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", random_seed())
}

// ---------------------------------------------------------------------------------------
// Chat completions
// ---------------------------------------------------------------------------------------

/// How tools take part in a chat request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolMode {
    /// No tools rendered, no parsing.
    Off,
    /// Tools rendered; calls parsed from the output if the model makes them.
    Auto,
    /// Tools rendered; the output is constrained to one call (of any tool, or the named one).
    Required(Option<String>),
}

/// The conversation as the chat template reads it, checking roles and content: a 400 naming
/// the message (and part) that is wrong.
pub fn template_messages(messages: &[ChatMessage]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` is empty"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "developer" => "system",
            r @ ("system" | "user" | "assistant" | "tool") => r,
            other => {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!(
                    "unknown role `{other}`; expected system, developer, user, assistant or tool"
                ),
                ))
            }
        };
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => text.push_str(t),
                        ("text", None) => {
                            return Err(ApiError::invalid(
                                &format!("messages[{i}].content[{j}].text"),
                                "a content part of type `text` needs a `text` field (a string)",
                            ))
                        }
                        _ => {
                            return Err(ApiError::invalid(
                                &format!("messages[{i}].content[{j}]"),
                                format!(
                                    "content parts of type `{}` are not supported (text only)",
                                    p.kind
                                ),
                            ))
                        }
                    }
                }
                text
            }
        };
        let mut msg = json!({"role": role, "content": content});
        if let Some(calls) = &m.tool_calls {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    // Templates expect the arguments as an object.
                    let args: Value = serde_json::from_str(&c.function.arguments)
                        .unwrap_or_else(|_| Value::String(c.function.arguments.clone()));
                    json!({"id": c.id, "type": "function",
                           "function": {"name": c.function.name, "arguments": args}})
                })
                .collect();
            msg["tool_calls"] = Value::Array(calls);
        }
        if let Some(id) = &m.tool_call_id {
            msg["tool_call_id"] = Value::String(id.clone());
        }
        if let Some(n) = &m.name {
            msg["name"] = Value::String(n.clone());
        }
        if let Some(r) = &m.reasoning_content {
            msg["reasoning_content"] = Value::String(r.clone());
        }
        out.push(msg);
    }
    Ok(out)
}

/// How the request's tools take part ([`ToolMode`]), checking `tools` and `tool_choice`: a 400
/// naming the field that is wrong.
pub fn tool_mode(req: &ChatCompletionRequest) -> Result<ToolMode, ApiError> {
    let tools = req.tools.as_deref().unwrap_or(&[]);
    for (i, t) in tools.iter().enumerate() {
        if t.kind != "function" {
            return Err(ApiError::invalid(
                &format!("tools[{i}].type"),
                format!("tool type `{}` is not supported; expected function", t.kind),
            ));
        }
    }
    let mode = match &req.tool_choice {
        None => {
            if tools.is_empty() {
                ToolMode::Off
            } else {
                ToolMode::Auto
            }
        }
        Some(ToolChoice::Mode(m)) => match m.as_str() {
            "none" => ToolMode::Off,
            "auto" => ToolMode::Auto,
            "required" => ToolMode::Required(None),
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                    "unknown tool_choice `{other}`; expected none, auto, required or a function"
                ),
                ))
            }
        },
        Some(ToolChoice::Named(v)) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !tools.iter().any(|t| t.function.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("tool_choice names `{name}`, which is not among `tools`"),
                ));
            }
            ToolMode::Required(Some(name.to_string()))
        }
    };
    if !matches!(mode, ToolMode::Off) && tools.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice needs `tools`",
        ));
    }
    Ok(mode)
}

/// `POST /v1/chat/completions`.
#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion (JSON), or with `stream` an SSE stream of `data: <ChatCompletionChunk>` events ending with `data: [DONE]`",
            content((ChatCompletion = "application/json"), (ChatCompletionChunk = "text/event-stream"))),
        (status = 400, body = ErrorBody, description = "A request field is invalid (`param` names it), or the prompt exceeds the context"),
        (status = 401, body = ErrorBody, description = "Missing or invalid API key"),
        (status = 404, body = ErrorBody, description = "Unknown model"),
        (status = 413, body = ErrorBody, description = "Body larger than max_body_bytes"),
        (status = 429, body = ErrorBody, description = "Queue full (see Retry-After)"),
        (status = 500, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "Loading, draining, or timed out waiting for a slot")
    ),
    security(("api_key" = []))
)]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let trace = super::otlp::parent_context(&headers);
    let result = chat_inner(&state, body, arrived, trace.clone()).await;
    respond(
        &state,
        "/v1/chat/completions",
        arrived,
        trace,
        result,
        ErrorShape::OpenAi,
    )
}

/// A handler's result as its response, counted in the request metrics; an error is also
/// recorded as a span (with OTLP on) and answered in `shape`.
pub(super) fn respond(
    state: &AppState,
    endpoint: &str,
    arrived: Instant,
    trace: opentelemetry::Context,
    result: Result<Response, ApiError>,
    shape: ErrorShape,
) -> Response {
    match result {
        Ok(r) => {
            state.metrics.request(endpoint, r.status().as_u16());
            r
        }
        Err(e) => {
            state.metrics.request(endpoint, e.status.as_u16());
            if let Some(exporter) = state.otlp.get() {
                use super::otlp::{Attr, SpanRecord};
                let end = std::time::SystemTime::now();
                exporter.record(SpanRecord {
                    name: format!("POST {endpoint}"),
                    parent: trace,
                    start: end - arrived.elapsed(),
                    end,
                    attributes: vec![(
                        "http.response.status_code",
                        Attr::Int(e.status.as_u16() as i64),
                    )],
                    error: Some(e.message.clone()),
                });
            }
            e.into_shaped_response(shape)
        }
    }
}

pub(super) fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if !m.is_empty() && *m != state.model_id => Err(super::unknown_model(state, m)),
        _ => Ok(()),
    }
}

async fn chat_inner(
    state: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    arrived: Instant,
    trace: opentelemetry::Context,
) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    let rendered = render_chat(state, &req)?;
    let answer_id = AnswerId::new(new_id(CHAT_ID_PREFIX), &state.model_id);
    let call_ids = format!("call_{}", &answer_id.id[CHAT_ID_PREFIX.len() + 1..]);
    let forced_call = matches!(rendered.mode, ToolMode::Required(_));
    let warnings = rendered.warnings.clone();
    let serving = rendered.serving.clone();
    let (events, reading) = submit_chat(state, &req, rendered, &call_ids).await?;
    let timing = Timing::new(
        state.clone(),
        "/v1/chat/completions",
        answer_id.id.clone(),
        arrived,
        trace,
    );
    let format = ChatFormat {
        answer: answer_id,
        forced_call,
        warnings,
        vocab: serving,
    };
    answer(events, reading, timing, format, Delivery::of(&req.sampling)).await
}

/// A chat request rendered through the model's chat template into its prompt: what both chat
/// endpoints (OpenAI's `/v1/chat/completions` and Anthropic's `/v1/messages`, whose requests
/// are translated into a [`ChatCompletionRequest`] first) count and submit.
pub struct RenderedChat {
    pub serving: Arc<Serving>,
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// The prompt's text (the reader of the output looks at how it ends).
    pub text: String,
    pub mode: ToolMode,
    /// The request's tools as the template reads them (absent with [`ToolMode::Off`]).
    pub tools_json: Option<Vec<Value>>,
    /// What the response says besides the answer.
    pub warnings: Vec<String>,
    /// The output constraint: `response_format`, `grammar` or a required tool call.
    pub grammar: Option<Grammar>,
    /// The request field the constraint came from.
    pub grammar_param: &'static str,
}

/// Check a chat request's model, messages, tools and constraint, and render it into its
/// prompt: a 400 naming the field that is wrong, 404 for another model, 503 while the model
/// is not being served.
pub fn render_chat(
    state: &AppState,
    req: &ChatCompletionRequest,
) -> Result<RenderedChat, ApiError> {
    check_model(state, &req.model)?;
    let serving = state.serving()?;
    let tokenizer = serving.loaded.tokenizer.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "this model has no tokenizer, so it cannot chat",
        )
    })?;
    let template = serving.loaded.chat_template.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "this model has no chat template; use /v1/completions with a raw prompt",
        )
    })?;
    let messages = template_messages(&req.messages)?;
    let mode = tool_mode(req)?;
    let tools_json: Option<Vec<Value>> = match (&mode, &req.tools) {
        (ToolMode::Off, _) | (_, None) => None,
        (_, Some(tools)) => Some(
            tools
                .iter()
                .map(|t| serde_json::to_value(t).unwrap_or(Value::Null))
                .collect(),
        ),
    };
    let kwargs = req.chat_template_kwargs.clone();
    if kwargs
        .as_ref()
        .is_some_and(|k| !k.is_object() && !k.is_null())
    {
        return Err(ApiError::invalid(
            "chat_template_kwargs",
            "`chat_template_kwargs` must be an object",
        ));
    }
    // Special-token text inside the request stays text (`plain_text_messages`).
    let specials: &[String] = if state.config.plain_text_messages {
        tokenizer.special_token_texts()
    } else {
        &[]
    };
    let mut rendered = template
        .render_parts(
            &messages,
            true,
            tools_json.as_deref(),
            kwargs.as_ref(),
            specials,
        )
        .map_err(|e| ApiError::invalid("messages", format!("{e}")))?;
    let text = rendered.text();
    let mut warnings = Vec::new();
    if let Some(tools) = &tools_json {
        // A template that ignores `tools` renders the same prompt without them (one that
        // cannot render without them certainly does not ignore them).
        let without = template.render(&messages, true, None, kwargs.as_ref()).ok();
        if without.as_ref() == Some(&text) {
            let warning = format!(
                "this model's chat template does not render `tools`, so the model was not shown the {} tool(s) of the request{}",
                tools.len(),
                if matches!(mode, ToolMode::Required(_)) {
                    "; the output is still constrained to a call"
                } else {
                    "; calls it makes are still parsed"
                }
            );
            tracing::warn!("{warning}");
            warnings.push(warning);
        }
    }
    let mut grammar = response_grammar(&req.response_format, &req.grammar)?;
    let mut grammar_param = grammar_param(&req.grammar);
    if let ToolMode::Required(only) = &mode {
        if grammar.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "a required tool call cannot be combined with response_format or grammar",
            ));
        }
        let tools: Vec<Value> = tools_json.clone().unwrap_or_default();
        let lark = required_tool_call_grammar(serving.syntax, &tools, only.as_deref())
            .map_err(|e| ApiError::invalid("tools", e))?;
        grammar = Some(Grammar::Lark(lark));
        grammar_param = "tools";
    }
    // A constrained answer cannot think first: when the template opened a thought, close it
    // (as templates do when thinking is switched off), so the constraint applies to the answer.
    let mut text = text;
    if let Some(closer) = grammar.as_ref().and(serving.syntax.thought_closer(&text)) {
        text.push_str(&closer);
        rendered.push_markup(&closer);
    }
    let prompt = tokenizer
        .encode_parts(&rendered.parts)
        .map_err(|e| ApiError::invalid("messages", format!("{e}")))?;
    Ok(RenderedChat {
        serving,
        prompt,
        text,
        mode,
        tools_json,
        warnings,
        grammar,
        grammar_param,
    })
}

/// Submit a rendered chat request with its sampling, stopping and log-probability fields;
/// returns its events and the reader of its output (reasoning split off; tool calls, named
/// `{call_ids}_{n}`, parsed out when the request has tools).
pub(super) async fn submit_chat(
    state: &AppState,
    req: &ChatCompletionRequest,
    rendered: RenderedChat,
    call_ids: &str,
) -> Result<(Events, Reading), ApiError> {
    let serving = rendered.serving;
    let requested = req.max_completion_tokens.or(req.max_tokens);
    let param = if req.max_completion_tokens.is_some() {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max = max_tokens(
        requested,
        param,
        rendered.prompt.len(),
        &serving,
        state.config.max_tokens_cap,
    )?;
    let sampling = sampling_params(&req.sampling, &serving)?;
    let stop = stop_strings(&req.sampling.stop)?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (_, Some(n)) if !(0..=20).contains(&n) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` is {n}; expected 0 to 20"),
            ))
        }
        (false, Some(n)) if n > 0 => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            ))
        }
        (true, n) => Some(n.unwrap_or(0) as usize),
        (false, _) => None,
    };
    let job = Job {
        prompt: rendered.prompt,
        max_tokens: max,
        stop,
        sampling,
        ignore_eos: req.sampling.ignore_eos.unwrap_or(false),
        logprobs,
        grammar: rendered.grammar,
        grammar_param: rendered.grammar_param.to_string(),
    };
    let events = submit(&serving, job).await?;
    let tools = (!matches!(rendered.mode, ToolMode::Off)).then(|| {
        let tools = Tools::new(rendered.tools_json.as_deref().unwrap_or_default());
        (Arc::new(tools), call_ids)
    });
    let reading = Reading::Chat(Box::new(ChatStream::new(
        serving.syntax,
        &rendered.text,
        tools,
    )));
    Ok((events, reading))
}

// ---------------------------------------------------------------------------------------
// Text completions
// ---------------------------------------------------------------------------------------

/// `POST /v1/completions`.
#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion (JSON), or with `stream` an SSE stream of `data: <Completion>` events ending with `data: [DONE]`",
            content((Completion = "application/json"), (Completion = "text/event-stream"))),
        (status = 400, body = ErrorBody, description = "A request field is invalid (`param` names it), or the prompt exceeds the context"),
        (status = 401, body = ErrorBody, description = "Missing or invalid API key"),
        (status = 404, body = ErrorBody, description = "Unknown model"),
        (status = 413, body = ErrorBody, description = "Body larger than max_body_bytes"),
        (status = 429, body = ErrorBody, description = "Queue full (see Retry-After)"),
        (status = 500, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "Loading, draining, or timed out waiting for a slot")
    ),
    security(("api_key" = []))
)]
pub async fn completions(
    State(state): State<Arc<AppState>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrived = Instant::now();
    let trace = super::otlp::parent_context(&headers);
    let result = completions_inner(&state, body, arrived, trace.clone()).await;
    respond(
        &state,
        "/v1/completions",
        arrived,
        trace,
        result,
        ErrorShape::OpenAi,
    )
}

async fn completions_inner(
    state: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    arrived: Instant,
    trace: opentelemetry::Context,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    check_model(state, &req.model)?;
    let serving = state.serving()?;
    let (prompt, prompt_text) = match &req.prompt {
        Prompt::Text(t) => (encode(&serving, t)?, Some(t.clone())),
        Prompt::Texts(v) if v.len() == 1 => (encode(&serving, &v[0])?, Some(v[0].clone())),
        Prompt::Texts(v) => {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "`prompt` has {} strings; this server takes one prompt per request",
                    v.len()
                ),
            ))
        }
        Prompt::Tokens(ids) => {
            let vocab = serving.loaded.model.info().vocab_size;
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary (size {vocab})"),
                ));
            }
            (ids.clone(), None)
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    let max = max_tokens(
        // OpenAI's default of 16, within this server's cap.
        Some(
            req.max_tokens
                .unwrap_or(16.min(state.config.max_tokens_cap as i64)),
        ),
        "max_tokens",
        prompt.len(),
        &serving,
        state.config.max_tokens_cap,
    )
    .map_err(|mut e| {
        if e.param.as_deref() == Some("messages") {
            e.param = Some("prompt".into());
        }
        e
    })?;
    let sampling = sampling_params(&req.sampling, &serving)?;
    let stop = stop_strings(&req.sampling.stop)?;
    let logprobs = match req.logprobs {
        Some(n) if !(0..=20).contains(&n) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` is {n}; expected 0 to 20"),
            ))
        }
        Some(n) => Some(n as usize),
        None => None,
    };
    let grammar = response_grammar(&req.response_format, &req.grammar)?;
    let echo = if req.echo.unwrap_or(false) {
        Some(match prompt_text {
            Some(t) => t,
            None => serving
                .loaded
                .tokenizer
                .as_ref()
                .and_then(|t| t.decode(&prompt, false).ok())
                .unwrap_or_default(),
        })
    } else {
        None
    };
    let job = Job {
        prompt,
        max_tokens: max,
        stop,
        sampling,
        ignore_eos: req.sampling.ignore_eos.unwrap_or(false),
        logprobs,
        grammar,
        grammar_param: grammar_param(&req.grammar).to_string(),
    };
    let events = submit(&serving, job).await?;
    let answer_id = AnswerId::new(new_id("cmpl"), &state.model_id);
    let timing = Timing::new(
        state.clone(),
        "/v1/completions",
        answer_id.id.clone(),
        arrived,
        trace,
    );
    let format = CompletionFormat::new(answer_id, echo, serving);
    answer(
        events,
        Reading::Raw,
        timing,
        format,
        Delivery::of(&req.sampling),
    )
    .await
}

pub(super) fn encode(serving: &Serving, text: &str) -> Result<Vec<u32>, ApiError> {
    let tok = serving.loaded.tokenizer.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "prompt",
            "this model has no tokenizer: send the prompt as token ids",
        )
    })?;
    tok.encode(text, true)
        .map_err(|e| ApiError::invalid("prompt", format!("{e}")))
}
