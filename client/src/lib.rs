//! `colibri-client`: a small blocking client of OpenAI-compatible chat servers (`coli serve`,
//! or any other), the HTTP side of `coli chat`.
//!
//! This crate owns the wire protocol of a chat session: the server URL (`http://` or
//! `https://`, TLS through rustls with the `ring` provider and the system's trust store), the
//! requests (`GET /v1/models`, `GET /ready`, a streamed `POST /v1/chat/completions`), the
//! server-sent events of a streamed answer (parsed by `eventsource-stream`) and what they add up
//! to ([`Answer`]), and the errors a server can answer with ([`HttpStatusError`],
//! [`StreamError`]). HTTP itself is `reqwest`'s, run on a small tokio runtime of the client's
//! own, so callers stay blocking. A caller-owned flag ([`Options::interrupt`], set by a Ctrl-C
//! handler) stops a request or a stream within [`POLL`]; a stream stopped that way returns what
//! arrived, marked interrupted.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use eventsource_stream::{EventStreamError, Eventsource};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::Value;

/// How often a waiting request looks at the interrupt flag.
pub const POLL: Duration = Duration::from_millis(100);
/// A stream that sends nothing at all (not even the server's 5 s keep-alives) for this long
/// is given up.
pub const STREAM_IDLE: Duration = Duration::from_secs(600);
/// Time limit of the small GET requests.
pub const GET_TIMEOUT: Duration = Duration::from_secs(30);
/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest non-streamed body read.
const MAX_BODY: usize = 16 * 1024 * 1024;

/// Install `ring` as the process's rustls provider, which `reqwest` uses (a no-op when a
/// provider is installed already).
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

// ---------------------------------------------------------------------------------------------
// Errors

/// The error a request returns when the interrupt flag stopped it.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// Whether `e` is (or wraps) [`Interrupted`].
pub fn is_interrupted(e: &anyhow::Error) -> bool {
    e.is::<Interrupted>()
}

/// A non-2xx answer, with the server's OpenAI-style error message when it sent one.
#[derive(Debug)]
pub struct HttpStatusError {
    pub status: u16,
    /// The status's reason phrase (`Unauthorized`).
    pub reason: String,
    /// The server's message, or the start of its body.
    pub message: String,
    /// The OpenAI error `code`, when the server sent one (`model_not_found`).
    pub code: Option<String>,
}

impl std::fmt::Display for HttpStatusError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.reason)?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for HttpStatusError {}

/// An error the server sent inside a stream (`data: {"error": {...}}`).
#[derive(Debug)]
pub struct StreamError(pub String);

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the server reported an error: {}", self.0)
    }
}

impl std::error::Error for StreamError {}

/// The message (and code) of an OpenAI error body: `{"error": {"message": ...}}` or
/// `{"error": "..."}`.
pub fn error_message(v: &Value) -> Option<(String, Option<String>)> {
    let e = v.get("error")?;
    if let Some(s) = e.as_str() {
        return Some((s.to_string(), None));
    }
    let message = e.get("message")?.as_str()?.to_string();
    let code = e.get("code").and_then(Value::as_str).map(str::to_string);
    Some((message, code))
}

/// Whether `e` says that nothing listens at the server's address.
pub fn is_connection_refused(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

// ---------------------------------------------------------------------------------------------
// URLs

/// The server's base URL, from what a user types: `http(s)://HOST[:PORT][/PREFIX]`, a bare
/// `HOST:PORT` (taken as `http://`), with or without the `/v1` OpenAI clients put in their
/// base URL. The result has no trailing slash and no `/v1`.
pub fn base_url(url: &str) -> Result<reqwest::Url> {
    let text = url.trim();
    let with_scheme = if text.contains("://") {
        text.to_string()
    } else {
        format!("http://{text}")
    };
    let mut u = reqwest::Url::parse(&with_scheme)
        .with_context(|| format!("{text}: not a URL (expected http://HOST:PORT)"))?;
    if !matches!(u.scheme(), "http" | "https") {
        bail!("{text}: only http:// and https:// URLs are supported");
    }
    if u.host_str().is_none_or(str::is_empty) {
        bail!("{text}: no host");
    }
    if !u.username().is_empty() || u.password().is_some() {
        bail!("{text}: user:password in the URL is not supported; use --api-key");
    }
    let path = u.path().trim_end_matches('/');
    let path = path.strip_suffix("/v1").unwrap_or(path);
    let path = path.trim_end_matches('/').to_string();
    u.set_path(&path);
    u.set_query(None);
    u.set_fragment(None);
    Ok(u)
}

/// `base` as shown to the user: no trailing slash.
fn shown(base: &reqwest::Url) -> String {
    base.as_str().trim_end_matches('/').to_string()
}

// ---------------------------------------------------------------------------------------------
// The client

/// How a [`Client`] is set up.
pub struct Options {
    /// Sent as `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// Set (by a Ctrl-C handler) to stop the request in progress; the client never clears it.
    pub interrupt: &'static AtomicBool,
    /// Run on every thread the client starts (e.g. to block signals there, so that they land
    /// on the caller's thread).
    pub on_thread_start: Option<fn()>,
}

/// A blocking client of one server.
pub struct Client {
    base: reqwest::Url,
    http: reqwest::Client,
    api_key: Option<String>,
    interrupt: &'static AtomicBool,
    runtime: tokio::runtime::Runtime,
}

impl Client {
    /// A client of the server at `url` (see [`base_url`]).
    pub fn new(url: &str, options: Options) -> Result<Client> {
        install_crypto_provider();
        let base = base_url(url)?;
        let mut rt = tokio::runtime::Builder::new_current_thread();
        rt.enable_all();
        if let Some(f) = options.on_thread_start {
            rt.on_thread_start(f);
        }
        let runtime = rt.build().context("starting the HTTP client's runtime")?;
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .user_agent(concat!("coli-chat/", env!("CARGO_PKG_VERSION")))
            .build()
            .context("setting up the HTTP client")?;
        Ok(Client {
            base,
            http,
            api_key: options.api_key,
            interrupt: options.interrupt,
            runtime,
        })
    }

    /// The server's URL as shown to the user.
    pub fn display(&self) -> String {
        shown(&self.base)
    }

    /// The URL of `path` (`/v1/models`) on this server.
    fn url(&self, path: &str) -> String {
        format!("{}{path}", shown(&self.base))
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, self.url(path));
        match &self.api_key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    /// Run `fut` to completion, or fail with [`Interrupted`] once the interrupt flag is set.
    fn run<T>(&self, fut: impl std::future::Future<Output = Result<T>>) -> Result<T> {
        let interrupt = self.interrupt;
        self.runtime.block_on(async move {
            tokio::select! {
                r = fut => r,
                () = interrupted(interrupt) => Err(Interrupted.into()),
            }
        })
    }

    /// GET a JSON document; a non-2xx status is an [`HttpStatusError`].
    pub fn get_json(&self, path: &str) -> Result<Value> {
        let req = self
            .request(reqwest::Method::GET, path)
            .header("accept", "application/json")
            .timeout(GET_TIMEOUT);
        let what = format!("GET {}", self.url(path));
        self.run(async move {
            let r = req.send().await.with_context(|| what.clone())?;
            if !r.status().is_success() {
                return Err(status_error(r).await);
            }
            let body = read_limited(r).await.with_context(|| what.clone())?;
            serde_json::from_slice(&body).with_context(|| {
                format!(
                    "{what}: the answer is not JSON: {}",
                    String::from_utf8_lossy(&body)
                        .chars()
                        .take(200)
                        .collect::<String>()
                )
            })
        })
    }

    /// The ids of the served models.
    pub fn models(&self) -> Result<Vec<String>> {
        let v = self.get_json("/v1/models")?;
        let data = v
            .get("data")
            .and_then(Value::as_array)
            .context("GET /v1/models: no `data` list in the answer")?;
        Ok(data
            .iter()
            .filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_string))
            .collect())
    }

    /// POST a streamed chat completion (`body` is the request, with `"stream": true`), handing
    /// each piece of text to `sink` as it arrives. The interrupt flag closes the connection
    /// and returns what arrived, marked interrupted.
    pub fn stream_chat(&self, body: &Value, sink: &mut dyn FnMut(Piece<'_>)) -> Result<Answer> {
        let mut ans = Answer::default();
        let req = self
            .request(reqwest::Method::POST, "/v1/chat/completions")
            .header("accept", "text/event-stream")
            .json(body);
        let what = format!("POST {}", self.url("/v1/chat/completions"));
        let interrupt = self.interrupt;
        let outcome: Result<()> = self.runtime.block_on(async {
            let send = async {
                let r = req.send().await.with_context(|| what.clone())?;
                if !r.status().is_success() {
                    return Err(status_error(r).await);
                }
                Ok(r)
            };
            let response = tokio::select! {
                r = send => r?,
                () = interrupted(interrupt) => return Err(Interrupted.into()),
            };
            let mut events = response.bytes_stream().eventsource();
            loop {
                let next = tokio::select! {
                    n = tokio::time::timeout(STREAM_IDLE, events.next()) => n,
                    () = interrupted(interrupt) => return Err(Interrupted.into()),
                };
                let event = match next {
                    Err(_) => bail!(
                        "{what}: nothing arrived for {} s; giving up on the stream",
                        STREAM_IDLE.as_secs()
                    ),
                    Ok(None) if ans.finish.is_some() => return Ok(()),
                    Ok(None) => {
                        bail!("the server ended the stream before the answer was finished")
                    }
                    Ok(Some(Err(EventStreamError::Transport(e)))) => {
                        return Err(
                            anyhow::Error::new(e).context(format!("{what}: reading the stream"))
                        )
                    }
                    Ok(Some(Err(e))) => bail!("{what}: the event stream is malformed: {e}"),
                    Ok(Some(Ok(event))) => event,
                };
                if ans.event(&event.data, sink)? {
                    return Ok(());
                }
            }
        });
        match outcome {
            Ok(()) => Ok(ans),
            Err(e) if is_interrupted(&e) => {
                ans.interrupted = true;
                Ok(ans)
            }
            Err(e) => Err(e),
        }
    }
}

/// Resolves once `flag` is set (looked at every [`POLL`]).
async fn interrupted(flag: &AtomicBool) {
    let mut tick = tokio::time::interval(POLL);
    loop {
        tick.tick().await;
        if flag.load(Ordering::SeqCst) {
            return;
        }
    }
}

/// A body of at most [`MAX_BODY`] bytes.
async fn read_limited(mut r: reqwest::Response) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    while let Some(chunk) = r.chunk().await? {
        if body.len() + chunk.len() > MAX_BODY {
            bail!("the answer is larger than {} MiB", MAX_BODY >> 20);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// A non-2xx response as an [`HttpStatusError`] carrying the server's message.
async fn status_error(r: reqwest::Response) -> anyhow::Error {
    let status = r.status();
    let body = read_limited(r).await.unwrap_or_default();
    let (message, code) = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| error_message(&v))
        .unwrap_or_else(|| {
            let text = String::from_utf8_lossy(&body).trim().to_string();
            (text.chars().take(300).collect(), None)
        });
    HttpStatusError {
        status: status.as_u16(),
        reason: status.canonical_reason().unwrap_or("").to_string(),
        message,
        code,
    }
    .into()
}

// ---------------------------------------------------------------------------------------------
// Streamed answers

/// A piece of streamed text.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Piece<'a> {
    /// `delta.reasoning_content`.
    Reasoning(&'a str),
    /// `delta.content`.
    Content(&'a str),
}

#[derive(Debug, Default, Deserialize)]
struct WireChunk {
    #[serde(default)]
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Debug, Default, Deserialize)]
struct WireChoice {
    #[serde(default)]
    delta: WireDelta,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct WireDelta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
}

/// The usage a stream ends with (`stream_options.include_usage`).
#[derive(Debug, Default, Clone, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub completion_tokens: u64,
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Default, Clone, Deserialize)]
pub struct PromptDetails {
    #[serde(default)]
    pub cached_tokens: u64,
}

/// What one streamed answer produced.
#[derive(Debug, Default)]
pub struct Answer {
    pub content: String,
    pub reasoning: String,
    /// The `finish_reason` of the last choice that had one.
    pub finish: Option<String>,
    pub usage: Option<Usage>,
    /// Chunks that carried text.
    pub pieces: u64,
    /// When the first and the last piece of text arrived.
    pub first: Option<Instant>,
    pub last: Option<Instant>,
    /// Stopped by the interrupt flag.
    pub interrupted: bool,
}

impl Answer {
    /// Take one event's data; `true` once the stream is over (`[DONE]`).
    pub fn event(&mut self, data: &str, sink: &mut dyn FnMut(Piece<'_>)) -> Result<bool> {
        if data.trim() == "[DONE]" {
            return Ok(true);
        }
        let v: Value = serde_json::from_str(data).with_context(|| {
            format!(
                "the server sent an event that is not JSON: {}",
                data.chars().take(200).collect::<String>()
            )
        })?;
        if let Some((message, _)) = error_message(&v) {
            return Err(StreamError(message).into());
        }
        let chunk: WireChunk = serde_json::from_value(v).context("reading a stream chunk")?;
        for c in chunk.choices {
            let mut text = |piece: Piece<'_>, s: &str| {
                if !s.is_empty() {
                    let now = Instant::now();
                    self.first.get_or_insert(now);
                    self.last = Some(now);
                    self.pieces += 1;
                    sink(piece);
                }
            };
            if let Some(r) = &c.delta.reasoning_content {
                text(Piece::Reasoning(r), r);
                self.reasoning.push_str(r);
            }
            if let Some(t) = &c.delta.content {
                text(Piece::Content(t), t);
                self.content.push_str(t);
            }
            if let Some(f) = c.finish_reason {
                self.finish = Some(f);
            }
        }
        if let Some(u) = chunk.usage {
            self.usage = Some(u);
        }
        Ok(false)
    }

    /// `[N tokens, X.X tok/s, C cached prompt tokens, finish: R]`. Without the server's usage
    /// (an interrupted answer) the count is of text chunks, marked `~`. The rate is decode
    /// speed: N tokens span N−1 intervals between the first and the last.
    pub fn footer(&self) -> String {
        let (tokens, approx) = match &self.usage {
            Some(u) => (u.completion_tokens, ""),
            None => (self.pieces, "~"),
        };
        let unit = if tokens == 1 { "token" } else { "tokens" };
        let rate = match (self.first, self.last) {
            (Some(a), Some(b)) if tokens >= 2 && b > a => {
                format!("{:.1}", (tokens - 1) as f64 / (b - a).as_secs_f64())
            }
            _ => "–".to_string(),
        };
        let cached = match &self.usage {
            Some(u) => u
                .prompt_tokens_details
                .as_ref()
                .map_or(0, |d| d.cached_tokens)
                .to_string(),
            None => "?".to_string(),
        };
        let finish = if self.interrupted {
            "interrupted"
        } else {
            self.finish.as_deref().unwrap_or("?")
        };
        format!("[{approx}{tokens} {unit}, {rate} tok/s, {cached} cached prompt tokens, finish: {finish}]")
    }
}

#[cfg(test)]
mod tests;
