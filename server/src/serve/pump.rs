//! The event pump: the one place where a request's scheduler events become its answer, for
//! every endpoint that generates. This module owns
//!
//! - the request's event channel ([`Events`], fed by the scheduler through an
//!   [`EventSink`]) and the wait for admission before a stream starts;
//! - how events become [`Piece`]s: the generated text read as it is ([`Reading::Raw`]) or
//!   with reasoning split off and tool calls parsed out, in the model's format
//!   ([`Reading::Chat`], a [`ChatStream`]), each
//!   piece carrying the log-probabilities of the tokens that led to it, then a [`Finish`]
//!   (reason, usage, the stop string that ended it), or an error;
//! - the request's latency metrics and its "request finished" record ([`Timing`]);
//! - the two sinks pieces go to: one JSON body ([`answer_json`]) or an SSE stream
//!   ([`answer_sse`]), written in the endpoint's [`Format`] (OpenAI's in [`super::formats`],
//!   Anthropic's in [`super::messages`]); handlers call [`answer`], which picks the sink the
//!   request's [`Delivery`] asks for;
//! - how every stream ends (docs/api.md, "How a stream ends"): after a success, the format's
//!   finishing chunks (OpenAI's: the chunk with `finish_reason`), the usage chunk when
//!   `stream_options.include_usage` asks for it, then the format's last event (OpenAI's
//!   `data: [DONE]`); after a failure, the format's error event, then that last event.
//!   A client that leaves stops the pump, which drops the events' receiver, which cancels the
//!   sequence in the scheduler.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use colibri::runtime::generate::FinishReason;
use colibri::runtime::scheduler::{
    Event, EventSink, Failure, TokenLogprob as EngineLogprob, Usage as EngineUsage,
};
use serde::Serialize;
use tokio::sync::mpsc;

use super::errors::ApiError;
use super::openai::{PromptTokensDetails, SamplingFields, Timings, Usage};
use super::AppState;
use crate::tool_calls::{ChatStream, Parsed, ToolCall};

/// How long a stream may stay silent before a keep-alive comment is sent (e.g. a long prefill).
const KEEP_ALIVE: Duration = Duration::from_secs(5);

/// How many SSE events may wait for a slow client before the pump waits for it.
const SSE_BUFFER: usize = 64;

// ---------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------

/// Sends scheduler events into a tokio channel; a dropped receiver is a departed client.
struct ChannelSink(mpsc::UnboundedSender<Event>);

impl EventSink for ChannelSink {
    fn send(&self, event: Event) -> bool {
        self.0.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// One request's scheduler events, in the order they were sent. Dropping it tells the
/// scheduler that the client is gone.
pub struct Events {
    rx: mpsc::UnboundedReceiver<Event>,
    /// An event read ahead (by [`Events::admitted`]) and not yet handed out.
    held: Option<Event>,
}

impl Events {
    /// A new channel: the sink the scheduler sends into, and the events it delivers.
    pub fn channel() -> (Box<dyn EventSink>, Events) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Box::new(ChannelSink(tx)), Events { rx, held: None })
    }

    async fn next(&mut self) -> Option<Event> {
        match self.held.take() {
            Some(e) => Some(e),
            None => self.rx.recv().await,
        }
    }

    /// Wait until a slot takes the request, so a stream whose request is never admitted
    /// (queue timeout, shutdown, invalid) gets a real HTTP status rather than a 200 with an
    /// error event. Once admitted, the prefill runs with the stream open (keep-alive comments).
    async fn admitted(&mut self, timing: &mut Timing) -> Result<(), ApiError> {
        match self.next().await {
            Some(Event::Admitted { slot, .. }) => {
                timing.slot = Some(slot);
                Ok(())
            }
            Some(Event::Failed(f)) => Err(failure_error(f)),
            Some(other) => {
                // Not expected before admission: keep it for the pump.
                self.held = Some(other);
                Ok(())
            }
            None => Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine stopped before admitting the request",
            )),
        }
    }
}

/// The API error of a request the scheduler failed.
pub fn failure_error(f: Failure) -> ApiError {
    match f {
        Failure::QueueTimeout => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "timed out waiting for a free slot; retry later",
        )
        .retry_after(1),
        Failure::ShuttingDown => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        ),
        Failure::Invalid(m) => ApiError::new(StatusCode::BAD_REQUEST, m),
        // The storage failed, not the request or the engine: another try (here once the
        // drive recovers, or on another replica) may succeed.
        Failure::Storage(m) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("reading the model's files failed: {m}; retry later"),
        )
        .retry_after(5),
        Failure::Engine(m) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("engine error: {m}"),
        ),
    }
}

/// The error of an event channel that closed without the request having finished or failed.
fn engine_stopped() -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the engine stopped before finishing the request",
    )
}

// ---------------------------------------------------------------------------------------
// Timing
// ---------------------------------------------------------------------------------------

/// Timing of one request's tokens, for the latency metrics, the log and the OTLP span.
pub struct Timing {
    pub state: Arc<AppState>,
    /// `/v1/chat/completions` or `/v1/completions`.
    pub endpoint: &'static str,
    /// The response id (`chatcmpl-…`, `cmpl-…`).
    pub id: String,
    pub arrived: Instant,
    /// The caller's trace context, the parent of the request's span.
    pub trace: opentelemetry::Context,
    /// When the previous token arrived.
    pub last: Option<Instant>,
    /// The slot that took the request.
    pub slot: Option<usize>,
}

impl Timing {
    /// The timing of a request that arrived at `arrived`, in the caller's trace `trace`.
    pub fn new(
        state: Arc<AppState>,
        endpoint: &'static str,
        id: String,
        arrived: Instant,
        trace: opentelemetry::Context,
    ) -> Timing {
        Timing {
            state,
            endpoint,
            id,
            arrived,
            trace,
            last: None,
            slot: None,
        }
    }

    fn token(&mut self) {
        let now = Instant::now();
        let metrics = &self.state.metrics;
        match self.last {
            None => metrics.ttft.observe((now - self.arrived).as_secs_f64()),
            Some(t) => metrics.inter_token.observe((now - t).as_secs_f64()),
        }
        self.last = Some(now);
    }

    fn done(&self, usage: &EngineUsage) {
        let state = &self.state;
        state
            .metrics
            .e2e
            .observe(self.arrived.elapsed().as_secs_f64());
        state
            .metrics
            .prompt_tokens
            .inc_by(usage.prompt_tokens as u64);
        state
            .metrics
            .generated_tokens
            .inc_by(usage.completion_tokens as u64);
        state
            .metrics
            .cached_tokens
            .inc_by(usage.cached_tokens as u64);
        tracing::info!(
            id = %self.id,
            slot = self.slot,
            prompt_tokens = usage.prompt_tokens,
            cached_tokens = usage.cached_tokens,
            generated_tokens = usage.completion_tokens,
            prefill_s = usage.prefill_seconds,
            decode_s = usage.decode_seconds,
            total_s = self.arrived.elapsed().as_secs_f64(),
            "request finished"
        );
        if let Some(exporter) = state.otlp.get() {
            use super::otlp::{Attr, SpanRecord};
            let end = std::time::SystemTime::now();
            let mut attributes = vec![
                ("coli.request_id", Attr::Str(self.id.clone())),
                ("gen_ai.request.model", Attr::Str(state.model_id.clone())),
                ("coli.prompt_tokens", Attr::Int(usage.prompt_tokens as i64)),
                ("coli.cached_tokens", Attr::Int(usage.cached_tokens as i64)),
                (
                    "coli.generated_tokens",
                    Attr::Int(usage.completion_tokens as i64),
                ),
                ("coli.prefill_seconds", Attr::Float(usage.prefill_seconds)),
                ("coli.decode_seconds", Attr::Float(usage.decode_seconds)),
                (
                    "coli.finish_reason",
                    Attr::Str(finish_reason(usage.finish_reason).into()),
                ),
            ];
            if let Some(slot) = self.slot {
                attributes.push(("coli.slot", Attr::Int(slot as i64)));
            }
            exporter.record(SpanRecord {
                name: format!("POST {}", self.endpoint),
                parent: self.trace.clone(),
                start: end - self.arrived.elapsed(),
                end,
                attributes,
                error: None,
            });
        }
    }
}

/// OpenAI's `finish_reason` for the engine's.
fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// The OpenAI usage object of the engine's counts.
pub fn usage(u: &EngineUsage) -> Usage {
    Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        total_tokens: u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details: PromptTokensDetails {
            cached_tokens: u.cached_tokens,
        },
    }
}

/// Where a finished request's time went, as llama.cpp's server reports it.
pub fn timings(u: &EngineUsage) -> Timings {
    let prompt_n = u.prompt_tokens.saturating_sub(u.cached_tokens);
    let per_second = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    Timings {
        cache_n: u.cached_tokens,
        prompt_n,
        prompt_ms: 1e3 * u.prefill_seconds,
        prompt_per_second: per_second(prompt_n, u.prefill_seconds),
        predicted_n: u.completion_tokens,
        predicted_ms: 1e3 * u.decode_seconds,
        predicted_per_second: per_second(u.completion_tokens.saturating_sub(1), u.decode_seconds),
    }
}

// ---------------------------------------------------------------------------------------
// Pieces
// ---------------------------------------------------------------------------------------

/// A part of an answer, as the reading of the text yields it.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// Text of the answer.
    Content(String),
    /// Text of the model's reasoning (chat only).
    Reasoning(String),
    /// The `index`-th tool call of the answer, whole (chat with tools only).
    ToolCall { index: u32, call: ToolCall },
}

/// How generation ended, as every format writes it.
#[derive(Debug, Clone)]
pub struct Finish {
    /// OpenAI's `finish_reason`: `stop`, `length` or `tool_calls`.
    pub reason: &'static str,
    pub usage: Usage,
    /// Where the request's time went.
    pub timings: Timings,
    /// The stop string the output was cut at, when one ended it (reason `stop`).
    pub stop_sequence: Option<String>,
}

/// What the pump hands a sink: parts, then exactly one [`Piece::Finish`] or [`Piece::Error`].
#[derive(Debug)]
pub enum Piece {
    /// A part of the answer, with the log-probabilities of the tokens generated since the
    /// previous piece.
    Part {
        part: Part,
        logprobs: Vec<EngineLogprob>,
    },
    /// Generation ended: how, and the log-probabilities of the tokens no part carried.
    Finish {
        finish: Finish,
        logprobs: Vec<EngineLogprob>,
    },
    /// The request failed; nothing follows.
    Error(ApiError),
}

/// How the generated text is read into parts.
pub enum Reading {
    /// As generated: every token that brings text or a log-probability is one content part
    /// (text completions).
    Raw,
    /// Chat: reasoning split off and, when the request has tools, tool calls parsed out of the
    /// content, in the model's format, by this reader.
    Chat(Box<ChatStream>),
}

/// The state of a [`Reading`] while the text arrives.
enum Reader {
    Raw,
    Chat(Box<ChatReader>),
}

/// The state of [`Reading::Chat`].
struct ChatReader {
    stream: Box<ChatStream>,
    /// Tool calls parsed so far.
    calls: u32,
    /// Log-probabilities of the tokens since the last part.
    pending: Vec<EngineLogprob>,
}

impl Reader {
    fn new(reading: Reading) -> Reader {
        match reading {
            Reading::Raw => Reader::Raw,
            Reading::Chat(stream) => Reader::Chat(Box::new(ChatReader {
                stream,
                calls: 0,
                pending: Vec::new(),
            })),
        }
    }

    /// The parts one generated token completes.
    fn token(&mut self, text: String, logprob: Option<EngineLogprob>) -> Vec<Piece> {
        match self {
            Reader::Raw if text.is_empty() && logprob.is_none() => Vec::new(),
            Reader::Raw => vec![Piece::Part {
                part: Part::Content(text),
                logprobs: logprob.into_iter().collect(),
            }],
            Reader::Chat(chat) => {
                chat.pending.extend(logprob);
                let events = chat.stream.push(&text);
                chat.pieces(events)
            }
        }
    }

    /// The parts held back until the end of the text, then the finish.
    fn finish(&mut self, done: &EngineUsage) -> Vec<Piece> {
        let (mut pieces, calls, leftover) = match self {
            Reader::Raw => (Vec::new(), 0, Vec::new()),
            Reader::Chat(chat) => {
                let events = chat.stream.finish();
                let pieces = chat.pieces(events);
                (pieces, chat.calls, std::mem::take(&mut chat.pending))
            }
        };
        pieces.push(Piece::Finish {
            finish: Finish {
                reason: if calls > 0 {
                    "tool_calls"
                } else {
                    finish_reason(done.finish_reason)
                },
                usage: usage(done),
                timings: timings(done),
                stop_sequence: done.stop_string.clone(),
            },
            logprobs: leftover,
        });
        pieces
    }
}

impl ChatReader {
    /// The pieces of the reader's events, numbering the calls.
    fn pieces(&mut self, events: Vec<Parsed>) -> Vec<Piece> {
        let parts = events
            .into_iter()
            .map(|e| match e {
                Parsed::Reasoning(r) => Part::Reasoning(r),
                Parsed::Content(c) => Part::Content(c),
                Parsed::Call(call) => {
                    self.calls += 1;
                    Part::ToolCall {
                        index: self.calls - 1,
                        call,
                    }
                }
            })
            .collect();
        self.with_logprobs(parts)
    }

    /// Pieces of `parts`, empty text left out; the pending log-probabilities ride on the
    /// first.
    fn with_logprobs(&mut self, parts: Vec<Part>) -> Vec<Piece> {
        parts
            .into_iter()
            .filter(|part| !matches!(part, Part::Content(t) | Part::Reasoning(t) if t.is_empty()))
            .map(|part| Piece::Part {
                part,
                logprobs: std::mem::take(&mut self.pending),
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------
// The pump and its sinks
// ---------------------------------------------------------------------------------------

/// The client is gone: nothing more can be delivered.
#[derive(Debug)]
pub struct ClientGone;

/// Where the pump delivers pieces.
trait Sink {
    /// Deliver one piece.
    async fn put(&mut self, piece: Piece) -> Result<(), ClientGone>;
    /// Resolves once the client is gone (never, for a sink that cannot tell).
    async fn gone(&self);
}

/// Turn `events` into pieces read as `reading`, and deliver them to `sink` until the request
/// finishes or fails (the last piece is a [`Piece::Finish`] or a [`Piece::Error`]), or the
/// sink's client is gone. An event channel that closes without either is an error.
async fn pump(mut events: Events, reading: Reading, mut timing: Timing, sink: &mut impl Sink) {
    let mut reader = Reader::new(reading);
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            _ = sink.gone() => return,
        };
        let (pieces, last) = match event {
            Some(Event::Admitted { slot, .. }) => {
                timing.slot = Some(slot);
                continue;
            }
            Some(Event::Token { text, logprob, .. }) => {
                timing.token();
                (reader.token(text, logprob), false)
            }
            Some(Event::Done(done)) => {
                timing.done(&done);
                (reader.finish(&done), true)
            }
            Some(Event::Failed(f)) => (vec![Piece::Error(failure_error(f))], true),
            None => (vec![Piece::Error(engine_stopped())], true),
        };
        for piece in pieces {
            if sink.put(piece).await.is_err() {
                return;
            }
        }
        if last {
            return;
        }
    }
}

/// How an endpoint writes an answer: as one JSON body, and as the chunks of a stream. The
/// defaults of the SSE methods are OpenAI's (`data:` events only, errors as OpenAI error
/// bodies, `data: [DONE]` last); Anthropic's Messages API names its events instead.
pub trait Format: Send + Sync + 'static {
    /// The whole answer.
    type Body: Serialize;
    /// One SSE event of a streamed answer.
    type Chunk: Serialize + Send + Sync;
    /// The chunks a stream opens with, before any part.
    fn opening(&mut self) -> Vec<Self::Chunk>;
    /// The chunks of one part.
    fn chunks(&mut self, part: Part, logprobs: &[EngineLogprob]) -> Vec<Self::Chunk>;
    /// The chunks that end the answer as `finish` says.
    fn finish_chunks(&mut self, finish: &Finish, logprobs: &[EngineLogprob]) -> Vec<Self::Chunk>;
    /// The chunk that carries the usage (`stream_options.include_usage`), where the format
    /// has one.
    fn usage_chunk(&mut self, usage: Usage) -> Option<Self::Chunk>;
    /// The whole answer from its parts (each with its log-probabilities), how it finished and
    /// the log-probabilities no part carried.
    fn body(
        self,
        parts: Vec<(Part, Vec<EngineLogprob>)>,
        finish: Finish,
        logprobs: Vec<EngineLogprob>,
    ) -> Self::Body;
    /// The SSE event of one chunk.
    fn event(chunk: &Self::Chunk) -> SseEvent {
        sse_json(chunk)
    }
    /// The SSE event of an error that ends a stream.
    fn error_event(error: &ApiError) -> SseEvent {
        sse_json(&error.body())
    }
    /// The event every stream ends with, if the format has one.
    fn done_event() -> Option<SseEvent> {
        Some(SseEvent::default().data("[DONE]"))
    }
}

/// Collects the pieces of a non-streamed answer.
struct JsonSink {
    parts: Vec<(Part, Vec<EngineLogprob>)>,
    end: Option<Piece>,
}

impl Sink for JsonSink {
    async fn put(&mut self, piece: Piece) -> Result<(), ClientGone> {
        match piece {
            Piece::Part { part, logprobs } => self.parts.push((part, logprobs)),
            end => self.end = Some(end),
        }
        Ok(())
    }

    async fn gone(&self) {
        // A client that leaves drops the handler's future, and the pump with it.
        std::future::pending::<()>().await
    }
}

/// The answer to `events` as one JSON body in `format`, or the request's error (its status
/// and OpenAI error body).
async fn answer_json<F: Format>(
    events: Events,
    reading: Reading,
    timing: Timing,
    format: F,
) -> Result<Response, ApiError> {
    let mut sink = JsonSink {
        parts: Vec::new(),
        end: None,
    };
    pump(events, reading, timing, &mut sink).await;
    match sink.end {
        Some(Piece::Finish { finish, logprobs }) => {
            Ok(Json(format.body(sink.parts, finish, logprobs)).into_response())
        }
        Some(Piece::Error(e)) => Err(e),
        Some(Piece::Part { .. }) | None => Err(engine_stopped()),
    }
}

/// Writes the pieces of a streamed answer as SSE events.
struct SseSink<F> {
    format: F,
    out: mpsc::Sender<SseEvent>,
    include_usage: bool,
}

impl<F: Format> SseSink<F> {
    async fn send(&self, event: SseEvent) -> Result<(), ClientGone> {
        self.out.send(event).await.map_err(|_| ClientGone)
    }

    /// Send `chunks`, in order.
    async fn send_all(&self, chunks: Vec<F::Chunk>) -> Result<(), ClientGone> {
        for chunk in &chunks {
            self.send(F::event(chunk)).await?;
        }
        Ok(())
    }

    /// The last event of every stream, where the format has one.
    async fn done(&self) -> Result<(), ClientGone> {
        match F::done_event() {
            Some(event) => self.send(event).await,
            None => Ok(()),
        }
    }
}

impl<F: Format> Sink for SseSink<F> {
    async fn put(&mut self, piece: Piece) -> Result<(), ClientGone> {
        match piece {
            Piece::Part { part, logprobs } => {
                let chunks = self.format.chunks(part, &logprobs);
                self.send_all(chunks).await
            }
            Piece::Finish { finish, logprobs } => {
                let last = self.format.finish_chunks(&finish, &logprobs);
                self.send_all(last).await?;
                if self.include_usage {
                    if let Some(usage) = self.format.usage_chunk(finish.usage) {
                        self.send(F::event(&usage)).await?;
                    }
                }
                self.done().await
            }
            Piece::Error(e) => {
                self.send(F::error_event(&e)).await?;
                self.done().await
            }
        }
    }

    async fn gone(&self) {
        self.out.closed().await
    }
}

/// The answer to `events` as an SSE stream of `format`'s chunks (admission already awaited,
/// see [`Events::admitted`]), pumped on a task of its own; `include_usage` adds the usage
/// chunk at the end.
fn answer_sse<F: Format>(
    events: Events,
    reading: Reading,
    timing: Timing,
    mut format: F,
    include_usage: bool,
) -> Response {
    let (out, rx) = mpsc::channel::<SseEvent>(SSE_BUFFER);
    tokio::spawn(async move {
        let opening: Vec<SseEvent> = format.opening().iter().map(F::event).collect();
        let mut sink = SseSink {
            format,
            out,
            include_usage,
        };
        for event in opening {
            if sink.send(event).await.is_err() {
                return;
            }
        }
        pump(events, reading, timing, &mut sink).await;
    });
    let stream =
        tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), |e| {
            Ok::<_, std::convert::Infallible>(e)
        });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response()
}

/// How the client asked for its answer.
pub enum Delivery {
    /// One JSON body.
    Json,
    /// An SSE stream; `include_usage`: with the usage chunk before `[DONE]`.
    Sse { include_usage: bool },
}

impl Delivery {
    /// What a request's `stream` and `stream_options` ask for.
    pub fn of(fields: &SamplingFields) -> Delivery {
        if fields.stream.unwrap_or(false) {
            Delivery::Sse {
                include_usage: fields
                    .stream_options
                    .as_ref()
                    .is_some_and(|o| o.include_usage),
            }
        } else {
            Delivery::Json
        }
    }
}

/// The answer to a submitted request's `events`, read as `reading` and written in `format`,
/// delivered as the client asked. A stream starts only once a slot has taken the request; a
/// request failed before that, or a non-streamed one that fails, is answered with its error's
/// status.
pub async fn answer<F: Format>(
    mut events: Events,
    reading: Reading,
    mut timing: Timing,
    format: F,
    delivery: Delivery,
) -> Result<Response, ApiError> {
    match delivery {
        Delivery::Json => answer_json(events, reading, timing, format).await,
        Delivery::Sse { include_usage } => {
            events.admitted(&mut timing).await?;
            Ok(answer_sse(events, reading, timing, format, include_usage))
        }
    }
}

fn sse_json<T: Serialize>(value: &T) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(value).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    //! The pump with a fake event source: events are queued into the channel the scheduler
    //! would send into, and the answer is read back as a client reads it.

    use std::sync::atomic::AtomicBool;
    use std::sync::{Mutex, OnceLock};

    use serde_json::Value;

    use super::*;
    use crate::config::ServeConfig;
    use crate::serve::formats::{AnswerId, ChatFormat, CompletionFormat, TokenTexts};
    use crate::serve::metrics::Metrics;

    /// Token `id`'s text is `<id>`.
    struct Numbered;

    impl TokenTexts for Numbered {
        fn token_text(&self, id: u32) -> (String, Vec<u8>) {
            let text = format!("<{id}>");
            let bytes = text.clone().into_bytes();
            (text, bytes)
        }
    }

    fn state() -> Arc<AppState> {
        Arc::new(AppState {
            config: ServeConfig::default(),
            model_id: "test-model".into(),
            created: 0,
            serving: OnceLock::new(),
            load_error: Mutex::new(None),
            load_failed: tokio::sync::Notify::new(),
            draining: AtomicBool::new(false),
            metrics: Metrics::new(1),
            otlp: OnceLock::new(),
        })
    }

    fn timing(endpoint: &'static str) -> Timing {
        Timing::new(
            state(),
            endpoint,
            "test-id".into(),
            Instant::now(),
            opentelemetry::Context::new(),
        )
    }

    fn answer_id(id: &str) -> AnswerId {
        AnswerId::new(id.into(), "test-model")
    }

    fn chat_format() -> ChatFormat {
        ChatFormat {
            answer: answer_id("chatcmpl-test"),
            forced_call: false,
            warnings: Vec::new(),
            vocab: Arc::new(Numbered),
        }
    }

    fn completion_format(echo: Option<&str>) -> CompletionFormat {
        CompletionFormat::new(
            answer_id("cmpl-test"),
            echo.map(str::to_string),
            Arc::new(Numbered),
        )
    }

    fn chat_reading(tools: bool) -> Reading {
        let tools = tools.then(|| (Arc::new(crate::tool_calls::Tools::default()), "call_test"));
        Reading::Chat(Box::new(ChatStream::new(
            crate::tool_calls::Syntax::default(),
            "",
            tools,
        )))
    }

    fn token(text: &str) -> Event {
        Event::Token {
            id: 0,
            text: text.into(),
            logprob: None,
        }
    }

    fn token_with_logprob(id: u32, text: &str) -> Event {
        Event::Token {
            id,
            text: text.into(),
            logprob: Some(EngineLogprob {
                id,
                logprob: -(id as f32),
                top: vec![(id, -(id as f32))],
            }),
        }
    }

    fn done(finish_reason: FinishReason) -> Event {
        Event::Done(EngineUsage {
            finish_reason,
            prompt_tokens: 5,
            cached_tokens: 1,
            completion_tokens: 2,
            stop_string: None,
            prefill_seconds: 0.25,
            decode_seconds: 0.5,
        })
    }

    /// The events of a request that a slot took, followed by `then`; the channel then closes
    /// (the scheduler has dropped its sink).
    fn events(then: Vec<Event>) -> Events {
        let (sink, events) = Events::channel();
        assert!(sink.send(Event::Admitted {
            slot: 0,
            cached_tokens: 0
        }));
        for e in then {
            assert!(sink.send(e));
        }
        events
    }

    /// The `data:` payloads of a whole SSE response, in order.
    async fn sse_data(response: Response) -> Vec<String> {
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("the stream's body");
        let text = String::from_utf8(body.to_vec()).expect("the stream is UTF-8");
        text.lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.trim().to_string())
            .collect()
    }

    /// The answer to a chat request (tool calls parsed when `tools`) with these events.
    async fn chat_answer(
        events: Events,
        tools: bool,
        delivery: Delivery,
    ) -> Result<Response, ApiError> {
        let timing = timing("/v1/chat/completions");
        answer(events, chat_reading(tools), timing, chat_format(), delivery).await
    }

    /// The answer to a text completion (`echo`: the prompt it echoes) with these events.
    async fn completion_answer(
        events: Events,
        echo: Option<&str>,
        delivery: Delivery,
    ) -> Result<Response, ApiError> {
        let format = completion_format(echo);
        answer(
            events,
            Reading::Raw,
            timing("/v1/completions"),
            format,
            delivery,
        )
        .await
    }

    fn sse(include_usage: bool) -> Delivery {
        Delivery::Sse { include_usage }
    }

    async fn json_body(response: Response) -> Value {
        let body = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("the body");
        serde_json::from_slice(&body).expect("a JSON body")
    }

    async fn chat_stream(then: Vec<Event>, tools: bool, include_usage: bool) -> Vec<String> {
        let response = chat_answer(events(then), tools, sse(include_usage)).await;
        sse_data(response.expect("an admitted stream starts")).await
    }

    async fn completion_stream(then: Vec<Event>, include_usage: bool) -> Vec<String> {
        let response = completion_answer(events(then), None, sse(include_usage)).await;
        sse_data(response.expect("an admitted stream starts")).await
    }

    /// The JSON events before `[DONE]`, checking that `[DONE]` is the last event and the only
    /// one.
    fn before_done(data: &[String]) -> Vec<Value> {
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:#?}");
        assert_eq!(
            data.iter().filter(|d| *d == "[DONE]").count(),
            1,
            "{data:#?}"
        );
        data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).expect("each event before [DONE] is JSON"))
            .collect()
    }

    /// The error of a stream's last event before `[DONE]`, checking that no event before it
    /// finished the choice.
    fn stream_error(data: &[String]) -> Value {
        let events = before_done(data);
        let (last, rest) = events.split_last().expect("an error event");
        assert!(
            rest.iter()
                .all(|e| e.get("error").is_none() && finish(e).is_none()),
            "{events:#?}"
        );
        last.get("error")
            .cloned()
            .expect("the last event is an error")
    }

    fn finish(event: &Value) -> Option<&str> {
        event["choices"][0]["finish_reason"].as_str()
    }

    fn chat_text(events: &[Value], field: &str) -> String {
        events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"][field].as_str())
            .collect()
    }

    fn completion_text(events: &[Value]) -> String {
        events
            .iter()
            .filter_map(|e| e["choices"][0]["text"].as_str())
            .collect()
    }

    fn engine_failure() -> Event {
        Event::Failed(Failure::Engine("a failure made by the test".into()))
    }

    #[tokio::test]
    async fn a_chat_stream_that_fails_ends_with_an_error_then_done() {
        let data = chat_stream(
            vec![token("Hel"), token("lo"), engine_failure()],
            false,
            true,
        )
        .await;
        let error = stream_error(&data);
        assert!(
            error["message"]
                .as_str()
                .is_some_and(|m| m.contains("a failure made by the test")),
            "{error}"
        );
        assert_eq!(error["type"], "server_error");
        // What was generated before the failure was delivered.
        assert_eq!(chat_text(&before_done(&data), "content"), "Hello");
    }

    #[tokio::test]
    async fn a_chat_stream_whose_engine_stops_ends_with_an_error_then_done() {
        let data = chat_stream(vec![token("Hel")], false, false).await;
        let error = stream_error(&data);
        assert_eq!(error["type"], "server_error");
    }

    #[tokio::test]
    async fn a_completion_stream_that_fails_ends_with_an_error_then_done() {
        let failed = Event::Failed(Failure::Invalid("the constraint gave up".into()));
        let data = completion_stream(vec![token("Hel"), token("lo"), failed], true).await;
        let error = stream_error(&data);
        assert_eq!(error["message"], "the constraint gave up");
        assert_eq!(error["type"], "invalid_request_error");
        assert_eq!(completion_text(&before_done(&data)), "Hello");
    }

    #[tokio::test]
    async fn a_completion_stream_whose_engine_stops_ends_with_an_error_then_done() {
        let data = completion_stream(vec![token("Hel")], false).await;
        let error = stream_error(&data);
        assert_eq!(error["type"], "server_error");
    }

    #[tokio::test]
    async fn a_chat_stream_ends_with_its_finish_then_usage_then_done() {
        for include_usage in [false, true] {
            let then = vec![token("Hel"), token("lo"), done(FinishReason::Length)];
            let data = chat_stream(then, false, include_usage).await;
            let events = before_done(&data);
            let mut finished: Vec<&Value> = events.iter().filter(|e| finish(e).is_some()).collect();
            assert_eq!(finished.len(), 1, "{events:#?}");
            assert_eq!(finish(finished.remove(0)), Some("length"));
            let last = events.last().expect("events");
            if include_usage {
                assert_eq!(last["choices"], serde_json::json!([]));
                assert_eq!(last["usage"]["prompt_tokens"], 5);
                assert_eq!(last["usage"]["completion_tokens"], 2);
                assert_eq!(last["usage"]["total_tokens"], 7);
                assert_eq!(last["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
                assert_eq!(finish(&events[events.len() - 2]), Some("length"));
            } else {
                assert_eq!(finish(last), Some("length"));
                assert!(events.iter().all(|e| e.get("usage").is_none()));
            }
            // The opening chunk names the role; the text follows.
            assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
            assert_eq!(chat_text(&events, "content"), "Hello");
            // The finish chunk, and only it, says where the time went (llama.cpp's names): 4
            // of the 5 prompt tokens computed in 0.25 s, 2 tokens generated 0.5 s apart.
            let timed: Vec<&Value> = events
                .iter()
                .filter(|e| e.get("timings").is_some())
                .collect();
            assert_eq!(timed.len(), 1, "{events:#?}");
            assert_eq!(finish(timed[0]), Some("length"));
            let t = &timed[0]["timings"];
            assert_eq!(
                (&t["cache_n"], &t["prompt_n"], &t["predicted_n"]),
                (
                    &serde_json::json!(1),
                    &serde_json::json!(4),
                    &serde_json::json!(2)
                )
            );
            for (key, want) in [
                ("prompt_ms", 250.0),
                ("prompt_per_second", 16.0),
                ("predicted_ms", 500.0),
                ("predicted_per_second", 2.0),
            ] {
                let got = t[key].as_f64().expect("a number");
                assert!((got - want).abs() < 1e-9, "{key}: {got} vs {want}");
            }
            assert!(events
                .iter()
                .all(|e| e["object"] == "chat.completion.chunk"));
        }
    }

    #[tokio::test]
    async fn a_completion_stream_ends_with_its_finish_then_usage_then_done() {
        for include_usage in [false, true] {
            let then = vec![
                token("Hel"),
                token(""),
                token("lo"),
                done(FinishReason::Stop),
            ];
            let data = completion_stream(then, include_usage).await;
            let events = before_done(&data);
            let finished: Vec<&Value> = events.iter().filter(|e| finish(e).is_some()).collect();
            assert_eq!(finished.len(), 1, "{events:#?}");
            assert_eq!(finish(finished[0]), Some("stop"));
            let last = events.last().expect("events");
            if include_usage {
                assert_eq!(last["choices"], serde_json::json!([]));
                assert_eq!(last["usage"]["total_tokens"], 7);
            } else {
                assert_eq!(finish(last), Some("stop"));
            }
            assert_eq!(completion_text(&events), "Hello");
            // A token without text (held back) and without a log-probability sends no chunk.
            let texts: Vec<&str> = events
                .iter()
                .filter(|e| finish(e).is_none())
                .filter_map(|e| e["choices"][0]["text"].as_str())
                .collect();
            assert_eq!(texts, ["Hel", "lo"]);
        }
    }

    /// The message a chat stream's events add up to: (reasoning, content, calls, finish).
    fn reassembled(events: &[Value]) -> (Option<String>, String, Vec<Value>, String) {
        let reasoning = chat_text(events, "reasoning_content");
        let calls = events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"]["tool_calls"].as_array())
            .flatten()
            .cloned()
            .collect();
        let finish = events.iter().find_map(finish).unwrap_or_default();
        (
            (!reasoning.is_empty()).then_some(reasoning),
            chat_text(events, "content"),
            calls,
            finish.to_string(),
        )
    }

    #[tokio::test]
    async fn the_json_body_holds_what_the_stream_delivers() {
        let call = r#"<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>"#;
        let (first, second) = call.split_at(20);
        let cases: Vec<Vec<&str>> = vec![
            vec!["Hel", "lo"],
            vec!["<think>hm", "m</think>", " The answer."],
            vec!["Calling. ", first, second],
        ];
        for tokens in cases {
            let then = || {
                let mut then: Vec<Event> = tokens.iter().map(|t| token(t)).collect();
                then.push(done(FinishReason::Stop));
                then
            };
            let streamed = before_done(&chat_stream(then(), true, false).await);
            let (reasoning, content, calls, finish) = reassembled(&streamed);
            let response = chat_answer(events(then()), true, Delivery::Json).await;
            let body = json_body(response.expect("a finished request answers 200")).await;
            let message = &body["choices"][0]["message"];
            assert_eq!(message["reasoning_content"].as_str(), reasoning.as_deref());
            let want_content = (calls.is_empty() || !content.is_empty()).then_some(content);
            assert_eq!(
                message["content"].as_str(),
                want_content.as_deref(),
                "{tokens:?}"
            );
            let body_calls = message["tool_calls"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            assert_eq!(body_calls.len(), calls.len(), "{tokens:?}");
            for (b, s) in body_calls.iter().zip(&calls) {
                assert_eq!(b["id"], s["id"]);
                assert_eq!(b["function"], s["function"]);
            }
            assert_eq!(body["choices"][0]["finish_reason"], finish.as_str());
            assert_eq!(body["usage"]["total_tokens"], 7);
        }
    }

    #[tokio::test]
    async fn a_tool_call_finishes_with_tool_calls() {
        let call = r#"<tool_call>{"name": "f", "arguments": {}}</tool_call>"#;
        let events = before_done(
            &chat_stream(vec![token(call), done(FinishReason::Stop)], true, false).await,
        );
        let (_, content, calls, finish) = reassembled(&events);
        assert_eq!(finish, "tool_calls");
        assert_eq!(content, "");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "f");
        assert_eq!(calls[0]["id"], "call_test_0");
        assert_eq!(calls[0]["index"], 0);
    }

    #[tokio::test]
    async fn a_request_that_fails_without_a_stream_answers_its_error() {
        let failed = Event::Failed(Failure::Invalid("the constraint gave up".into()));
        for (then, status) in [
            (vec![token("Hel"), failed], StatusCode::BAD_REQUEST),
            (vec![token("Hel")], StatusCode::INTERNAL_SERVER_ERROR),
        ] {
            let error = completion_answer(events(then), None, Delivery::Json)
                .await
                .expect_err("a failed request is an error response");
            assert_eq!(error.status, status);
        }
    }

    #[tokio::test]
    async fn a_stream_refused_before_admission_gets_its_status() {
        let (sink, events) = Events::channel();
        assert!(sink.send(Event::Failed(Failure::QueueTimeout)));
        let error = completion_answer(events, None, sse(false))
            .await
            .expect_err("a request never admitted is not a 200");
        assert_eq!(error.status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test]
    async fn chat_logprobs_ride_on_the_next_piece_and_none_are_lost() {
        // Token 1 writes nothing visible yet (a tag that may open), token 2 completes it.
        let then = vec![
            token_with_logprob(1, "<"),
            token_with_logprob(2, "a"),
            token_with_logprob(3, ""),
            done(FinishReason::Stop),
        ];
        let events = before_done(&chat_stream(then, true, false).await);
        let ids: Vec<String> = events
            .iter()
            .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array())
            .flatten()
            .map(|lp| lp["token"].as_str().unwrap_or_default().to_string())
            .collect();
        assert_eq!(ids, ["<1>", "<2>", "<3>"]);
        assert_eq!(chat_text(&events, "content"), "<a");
    }

    #[tokio::test]
    async fn completion_logprobs_give_each_token_its_text_offset() {
        let then = || {
            vec![
                token_with_logprob(1, "ab"),
                token_with_logprob(2, ""),
                token_with_logprob(3, "c"),
                done(FinishReason::Stop),
            ]
        };
        // After an echoed prompt of 4 bytes: "ab" at 4, "" at 6, "c" at 6.
        let want = [4, 6, 6];
        let response = completion_answer(events(then()), Some("Say:"), sse(false)).await;
        let streamed = before_done(&sse_data(response.expect("a stream")).await);
        assert_eq!(completion_text(&streamed), "Say:abc");
        let offsets: Vec<u64> = streamed
            .iter()
            .filter_map(|e| e["choices"][0]["logprobs"]["text_offset"].as_array())
            .flatten()
            .filter_map(Value::as_u64)
            .collect();
        assert_eq!(offsets, want);
        let response = completion_answer(events(then()), Some("Say:"), Delivery::Json).await;
        let body = json_body(response.expect("a body")).await;
        assert_eq!(body["choices"][0]["text"], "Say:abc");
        assert_eq!(
            body["choices"][0]["logprobs"]["text_offset"],
            serde_json::json!(want)
        );
        assert_eq!(
            body["choices"][0]["logprobs"]["tokens"],
            serde_json::json!(["<1>", "<2>", "<3>"])
        );
    }

    #[tokio::test]
    async fn a_client_that_leaves_cancels_its_request_while_nothing_is_generated() {
        // The request is admitted and in its prefill: no token comes.
        let (tx, rx) = mpsc::unbounded_channel();
        tx.send(Event::Admitted {
            slot: 0,
            cached_tokens: 0,
        })
        .expect("the channel is open");
        let events = Events { rx, held: None };
        let response = chat_answer(events, false, sse(false)).await;
        drop(response.expect("a stream"));
        // The scheduler sees the client gone (its sink's `is_closed`) without sending again.
        tokio::time::timeout(Duration::from_secs(30), tx.closed())
            .await
            .expect("the pump dropped the events once the client left");
    }
}
