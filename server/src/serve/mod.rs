//! `coli serve`: the OpenAI-compatible HTTP server (with Anthropic's Messages API beside it),
//! running the engine in-process.
//!
//! Start-up binds the listener first (so `/health` answers at once), then loads the model on a
//! background thread; `/ready` turns 200 once it is loaded and warm. Requests go through the
//! API-key check, the body limit, typed parsing and validation, then into the KV-slot
//! [`Scheduler`]; tokens come back through a channel and leave as JSON or SSE. A client has
//! `header_timeout_secs` to send a request's headers and `body_timeout_secs` to send its body.
//! SIGTERM (or Ctrl-C) stops admitting, lets in-flight requests and open connections finish
//! until the drain deadline, then ends the rest (streams with an error event), closes every
//! connection and exits 0. A failed model load — an error or a panic — is reported as failed:
//! the process exits 1, or with `stay_up_on_load_failure` keeps answering 503 with the error.

pub mod anthropic;
pub mod chat;
pub mod errors;
mod formats;
pub mod messages;
pub mod metrics;
pub mod openai;
pub mod otlp;
mod pump;
mod tls;
mod tokenize;

use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::Poll;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use colibri::runtime::grammar::GrammarVocab;
use colibri::runtime::loaded::LoadedModel;
use colibri::runtime::scheduler::{panic_message, Scheduler, SchedulerConfig};
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::Notify;
use tokio::time::Instant;
use utoipa::OpenApi;

use crate::config::{self, ServeConfig, ServeFlags};
use crate::model_arg;
use errors::{ApiError, BodyTimeout, ErrorShape};
use metrics::Metrics;
use openai::*;

/// Arguments of `coli serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub flags: ServeFlags,
}

/// The model being served, once loaded.
pub struct Serving {
    pub loaded: Arc<LoadedModel>,
    pub scheduler: Scheduler,
    /// Grammar constraints over this model's vocabulary (absent without a tokenizer).
    pub grammar: Option<GrammarVocab>,
    /// Tokens per request (prompt plus generated).
    pub context: usize,
    /// How this model writes tool calls and reasoning.
    pub syntax: crate::tool_calls::Syntax,
}

/// What every handler shares.
pub struct AppState {
    pub config: ServeConfig,
    /// The id `/v1/models` reports and requests may name.
    pub model_id: String,
    pub created: u64,
    pub serving: OnceLock<Arc<Serving>>,
    /// Why loading failed, if it did.
    pub load_error: Mutex<Option<String>>,
    /// Notified once loading has failed (`load_error` is set by then).
    pub load_failed: Notify,
    pub draining: AtomicBool,
    pub metrics: Metrics,
    /// The span exporter, when `otlp_endpoint` is configured.
    pub otlp: OnceLock<otlp::Exporter>,
}

impl AppState {
    /// The loaded model, or 503 while loading / after a failed load / while draining.
    pub fn serving(&self) -> Result<Arc<Serving>, ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
            )
            .retry_after(5));
        }
        if let Some(s) = self.serving.get() {
            return Ok(s.clone());
        }
        let why = self
            .load_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Err(match why {
            Some(e) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the model failed to load: {e}"),
            ),
            None => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model is still loading",
            )
            .retry_after(5),
        })
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "colibri",
        description = "OpenAI-compatible API of `coli serve`, with Anthropic's Messages API (`/v1/messages`) and vLLM's `/tokenize` and `/detokenize` beside it. Extensions beyond OpenAI's fields are marked in their descriptions."
    ),
    paths(
        chat::chat_completions,
        chat::completions,
        messages::messages,
        messages::count_tokens,
        tokenize::tokenize,
        tokenize::detokenize,
        list_models,
        health,
        ready,
        metrics_text
    ),
    components(schemas(
        ChatCompletionRequest,
        CompletionRequest,
        ChatCompletion,
        ChatCompletionChunk,
        Completion,
        ModelList,
        ErrorBody,
        Health,
        TokenizeRequest,
        TokenizeResponse,
        DetokenizeRequest,
        DetokenizeResponse,
        anthropic::MessagesRequest,
        anthropic::MessagesResponse,
        anthropic::StreamEvent,
        anthropic::CountTokensRequest,
        anthropic::CountTokens,
        anthropic::AnthropicErrorBody
    )),
    modifiers(&SecurityAddon)
)]
struct ApiDoc;

struct SecurityAddon;

impl utoipa::Modify for SecurityAddon {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The OpenAPI document of the server.
pub fn openapi_json() -> String {
    ApiDoc::openapi()
        .to_pretty_json()
        .expect("the OpenAPI document serializes")
}

/// Run `coli serve`.
pub fn run(args: ServeArgs) -> Result<()> {
    let loaded = config::load(&args.flags)?;
    let cfg = loaded.config;
    init_logging(&cfg);
    let addr: SocketAddr = format!("{}:{}", cfg.host, cfg.port)
        .parse()
        .with_context(|| format!("host `{}` and port {}", cfg.host, cfg.port))?;
    if !addr.ip().is_loopback() && cfg.api_keys.is_empty() {
        tracing::warn!(
            "listening on {} without an API key: anyone who can reach this address can use the model (set api_keys / --api-key / COLI_API_KEYS)",
            addr.ip()
        );
    }
    // Validation made sure both are given or neither.
    let tls = match (&cfg.tls_cert, &cfg.tls_key) {
        (Some(cert), Some(key)) => Some(tls::acceptor(cert, key)?),
        _ => None,
    };
    let model_id = cfg
        .served_model_name
        .clone()
        .unwrap_or_else(|| match cfg.model.as_deref() {
            None | Some("demo") => "demo".to_string(),
            Some(p) => std::path::Path::new(p.trim_end_matches('/'))
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.to_string()),
        });
    let state = Arc::new(AppState {
        metrics: Metrics::new(cfg.slots),
        config: cfg.clone(),
        model_id,
        created: now_secs(),
        serving: OnceLock::new(),
        load_error: Mutex::new(None),
        load_failed: Notify::new(),
        draining: AtomicBool::new(false),
        otlp: OnceLock::new(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("coli-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(serve(state, addr, tls))
}

fn init_logging(cfg: &ServeConfig) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("COLI_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!("{},tower_http=warn,hyper=warn", cfg.log_level))
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = if cfg.log_json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

async fn serve(
    state: Arc<AppState>,
    addr: SocketAddr,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> Result<()> {
    if let Some(endpoint) = &state.config.otlp_endpoint {
        let protocol = &state.config.otlp_protocol;
        // Validation accepted only the names `parse` knows.
        let parsed = otlp::OtlpProtocol::parse(protocol)
            .with_context(|| format!("otlp_protocol `{protocol}`"))?;
        let exporter = otlp::Exporter::start(endpoint, parsed)?;
        let _ = state.otlp.set(exporter);
        eprintln!("coli: exporting a span per request to {endpoint} (OTLP, {protocol})");
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (is another server using the port?)"))?;
    let local = listener.local_addr()?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    eprintln!("coli: listening on {scheme}://{local}");
    // Load the model off the async runtime.
    {
        let state = state.clone();
        std::thread::Builder::new()
            .name("coli-load".into())
            .spawn(move || load_model(&state))
            .context("spawning the loader thread")?;
    }
    let app = router(state.clone());
    let header_timeout = Duration::from_secs(state.config.header_timeout_secs);
    let stop = serve_connections(
        listener,
        app,
        header_timeout,
        tls,
        shutdown_signal(state.clone()),
    )
    .await;
    if let Some(s) = state.serving.get() {
        s.scheduler.shutdown();
        if let Err(e) = s.loaded.model.flush() {
            eprintln!("coli: warning: saving the expert usage history: {e}");
        }
    }
    if state.otlp.get().is_some() {
        // Send the spans still queued; the exporter blocks, so off the async threads.
        let state = state.clone();
        let _ = tokio::task::spawn_blocking(move || {
            if let Some(exporter) = state.otlp.get() {
                exporter.shutdown();
            }
        })
        .await;
    }
    match stop {
        Stop::Signal => {
            eprintln!("coli: stopped");
            Ok(())
        }
        Stop::LoadFailed(e) => Err(anyhow::anyhow!(
            "the model failed to load: {e} (set stay_up_on_load_failure to keep serving 503s with this error instead of exiting)"
        )),
    }
}

/// Load the model the configuration names and start its scheduler; record a failure — an
/// error or a panic anywhere on the way — in `load_error` and notify `load_failed`.
fn load_model(state: &AppState) {
    let cfg = &state.config;
    let result = match std::panic::catch_unwind(AssertUnwindSafe(|| start_serving(cfg))) {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(format!("{e:#}")),
        Err(panic) => Err(format!(
            "the loader stopped on a {} (a bug in colibri: please report it)",
            panic_message(&panic)
        )),
    };
    match result {
        Ok(s) => {
            eprintln!(
                "coli: ready: model `{}`, {} slots × {} tokens",
                state.model_id, cfg.slots, s.context
            );
            let _ = state.serving.set(Arc::new(s));
        }
        Err(e) => {
            if cfg.stay_up_on_load_failure {
                // Otherwise the process exits with this error (printed once, by `main`).
                eprintln!("coli: error: the model failed to load: {e}");
                eprintln!(
                    "coli: staying up (stay_up_on_load_failure): /ready and requests answer 503 with this error"
                );
            }
            *state.load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            state.load_failed.notify_one();
        }
    }
}

/// The variable that makes [`start_serving`] panic, so tests can check that a panic while
/// loading is reported as a failed load. Test-only: nothing sets it in production.
const TEST_LOAD_PANIC_ENV: &str = "COLI_TEST_LOAD_PANIC";

/// Loads the model, warms it up and starts its scheduler.
fn start_serving(cfg: &ServeConfig) -> Result<Serving> {
    if std::env::var_os(TEST_LOAD_PANIC_ENV).is_some() {
        panic!("{TEST_LOAD_PANIC_ENV} is set: a panic forced in the load path");
    }
    // The engine options come from the configuration, as `coli run`'s come from its flags;
    // an option the model cannot honour (`draft = "mtp"` without an MTP head, `mla_form` on a
    // model without latent attention) fails the load with the engine's reason.
    let model = cfg.model.as_deref().unwrap_or("demo");
    let mut loaded = model_arg::load(model, &cfg.engine, true)?;
    let syntax = crate::tool_calls::Syntax::resolve(
        cfg.tool_call_format,
        cfg.reasoning_format,
        loaded.chat_template.as_ref(),
        &loaded.model.info().model_type,
    );
    if let Some(tok) = &loaded.tokenizer {
        // The tags the reader needs must reach the text: decoding drops special tokens.
        if let Some(t) =
            crate::tool_calls::keep_tags_as_text(tok, &syntax.tags(), &loaded.eos_token_ids)?
        {
            loaded.tokenizer = Some(t);
        }
    }
    tracing::info!(
        tool_call_format = ?syntax.format,
        reasoning = syntax.reasoning,
        "tool calls and reasoning are read in the model's format"
    );
    let loaded = Arc::new(loaded);
    let max_ctx = loaded.model.info().max_position_embeddings.max(2);
    let context = if cfg.context == 0 {
        max_ctx
    } else {
        anyhow::ensure!(
            cfg.context <= max_ctx,
            "context: {} tokens is more than the model's {} (max_position_embeddings)",
            cfg.context,
            max_ctx
        );
        cfg.context
    };
    let grammar = match &loaded.tokenizer {
        Some(t) => match GrammarVocab::new(t.inner(), &loaded.eos_token_ids) {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::warn!("grammar-constrained output is off for this model: {e}");
                None
            }
        },
        None => None,
    };
    if cfg.engine.draft == colibri::model::Draft::Mtp {
        tracing::warn!(
            "draft = \"mtp\": the server does not draft with the MTP head yet (coli run and coli bench do); draft = \"ngram\" or \"auto\" drafts here"
        );
    }
    // Warm up: one token through every layer, so the first request does not pay for
    // page faults and thread start-up.
    let mut cache = loaded.model.new_cache(2);
    loaded
        .model
        .forward(&[0], &mut cache, colibri::model::Logits::Last)
        .context("warm-up forward pass")?;
    let scheduler = Scheduler::start(
        loaded.clone(),
        SchedulerConfig {
            slots: cfg.slots,
            context,
            prefill_chunk: cfg.prefill_chunk,
            prefill_budget: (cfg.prefill_budget > 0).then_some(cfg.prefill_budget),
            queue_limit: cfg.queue_limit,
            queue_timeout: Duration::from_secs(cfg.queue_timeout_secs),
            persist_dir: cfg.prefix_cache_dir.clone(),
            history_save_interval: Duration::from_secs(cfg.history_save_secs),
            drafts: cfg.engine.draft_config(),
        },
    );
    Ok(Serving {
        loaded,
        scheduler,
        grammar,
        context,
        syntax,
    })
}

/// The routes, with authentication, body limit and CORS.
pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(chat::completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    let anthropic_api = Router::new()
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key_anthropic,
        ));
    let mut app = Router::new()
        .merge(api)
        .merge(anthropic_api)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), body_deadline))
        .with_state(state.clone());
    if !state.config.cors_origins.is_empty() {
        use tower_http::cors::{AllowOrigin, CorsLayer};
        let origins = &state.config.cors_origins;
        let allow = if origins.iter().any(|o| o == "*") {
            AllowOrigin::any()
        } else {
            AllowOrigin::list(
                origins
                    .iter()
                    .filter_map(|o| HeaderValue::from_str(o).ok())
                    .collect::<Vec<_>>(),
            )
        };
        app = app.layer(
            CorsLayer::new()
                .allow_origin(allow)
                .allow_methods([Method::GET, Method::POST])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    header::HeaderName::from_static("x-api-key"),
                    header::HeaderName::from_static("anthropic-version"),
                    header::HeaderName::from_static("anthropic-beta"),
                ]),
        );
    }
    app
}

/// Gives a request's body `body_timeout_secs`, from the moment its headers are in, to arrive
/// whole: reading it later fails with [`BodyTimeout`], which the handler answers with a 408.
async fn body_deadline(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let limit = Duration::from_secs(state.config.body_timeout_secs);
    next.run(request.map(|body| deadline_body(body, limit)))
        .await
}

/// `body`, failing with [`BodyTimeout`] once `limit` has passed without it having ended. Data
/// that has already arrived is delivered first, so a body that is complete is never refused.
fn deadline_body(body: Body, limit: Duration) -> Body {
    let mut data = body.into_data_stream();
    let mut deadline = Box::pin(tokio::time::sleep(limit));
    let mut ended = false;
    Body::from_stream(futures_util::stream::poll_fn(move |cx| {
        if ended {
            return Poll::Ready(None);
        }
        match data.poll_next_unpin(cx) {
            Poll::Ready(Some(chunk)) => Poll::Ready(Some(chunk.map_err(axum::BoxError::from))),
            Poll::Ready(None) => {
                ended = true;
                Poll::Ready(None)
            }
            Poll::Pending if deadline.as_mut().poll(cx).is_ready() => {
                ended = true;
                Poll::Ready(Some(Err(BodyTimeout(limit).into())))
            }
            Poll::Pending => Poll::Pending,
        }
    }))
}

/// The key a request presents: `Authorization: Bearer KEY` (the scheme in any case, as HTTP
/// auth schemes are case-insensitive) or `x-api-key: KEY`.
fn presented_key(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, key) = v.trim_start().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
        })
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
}

/// `Authorization: Bearer KEY` (or `x-api-key: KEY`) on `/v1/*`, `/tokenize` and
/// `/detokenize` when keys are configured; keys are compared in constant time.
async fn require_api_key(state: State<Arc<AppState>>, request: Request, next: Next) -> Response {
    check_api_key(state, request, next, ErrorShape::OpenAi).await
}

/// [`require_api_key`] on the routes of Anthropic's Messages API, whose 401 is in Anthropic's
/// shape.
async fn require_api_key_anthropic(
    state: State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    check_api_key(state, request, next, ErrorShape::Anthropic).await
}

async fn check_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
    shape: ErrorShape,
) -> Response {
    let keys = &state.config.api_keys;
    if keys.is_empty() {
        return next.run(request).await;
    }
    let given = presented_key(request.headers());
    let ok = given.is_some_and(|g| {
        keys.iter().fold(false, |acc, k| {
            acc | constant_time_eq(k.as_bytes(), g.as_bytes())
        })
    });
    if ok {
        next.run(request).await
    } else {
        let endpoint = request.uri().path().to_string();
        state.metrics.request(&endpoint, 401);
        let response = ApiError::new(
            StatusCode::UNAUTHORIZED,
            if given.is_some() {
                "invalid API key"
            } else {
                "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
            },
        )
        .code("invalid_api_key")
        .into_shaped_response(shape);
        // The request body is never read, so the connection cannot be reused for the next
        // request (hyper closes it after this response): say so, or a keep-alive client sends
        // its next request into a closing connection ("server disconnected", seen in CI).
        let mut response = response;
        response.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        response
    }
}

/// Equality that takes the same time wherever the inputs differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= (x ^ y) as u64;
    }
    diff == 0
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/health", responses((status = 200, body = Health)))]
async fn health(State(state): State<Arc<AppState>>) -> Json<Health> {
    let status = if state.draining.load(Ordering::SeqCst) {
        "draining"
    } else {
        "ok"
    };
    Json(Health {
        status: status.into(),
    })
}

/// Readiness: the model is loaded and warm, and the server is not draining.
#[utoipa::path(get, path = "/ready", responses(
    (status = 200, body = Health),
    (status = 503, body = ErrorBody, description = "loading, failed to load, or draining")
))]
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    match state.serving() {
        Ok(_) => Json(Health {
            status: "ok".into(),
        })
        .into_response(),
        Err(e) => e.into_response(),
    }
}

/// Prometheus metrics in the text exposition format.
#[utoipa::path(get, path = "/metrics", responses((status = 200, content_type = "text/plain", body = String)))]
async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    let serving = state.serving.get();
    let (stats, store, resident) = match serving {
        Some(s) => (
            Some(s.scheduler.stats().clone()),
            s.loaded.model.store_stats(),
            s.loaded.model.info().dense_bytes as u64,
        ),
        None => (None, None, 0),
    };
    let text = state.metrics.render(
        serving.is_some() && !state.draining.load(Ordering::SeqCst),
        stats.as_deref(),
        store,
        resident,
        0,
    );
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response()
}

async fn openapi() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        openapi_json(),
    )
        .into_response()
}

fn model_card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.model_id.clone(),
        object: "model".into(),
        created: state.created,
        owned_by: "colibri".into(),
        max_model_len: state.serving.get().map(|s| s.context).unwrap_or(0),
    }
}

/// The served model.
#[utoipa::path(get, path = "/v1/models", responses(
    (status = 200, body = ModelList),
    (status = 401, body = ErrorBody)
), security(("api_key" = [])))]
async fn list_models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    state.metrics.request("/v1/models", 200);
    Json(ModelList {
        object: "list".into(),
        data: vec![model_card(&state)],
    })
}

async fn get_model(
    State(state): State<Arc<AppState>>,
    id: Result<axum::extract::Path<String>, PathRejection>,
) -> Response {
    match id {
        Ok(axum::extract::Path(id)) if id == state.model_id => {
            Json(model_card(&state)).into_response()
        }
        Ok(axum::extract::Path(id)) => unknown_model(&state, &id).into_response(),
        Err(rejection) => ApiError::from(rejection).param("model").into_response(),
    }
}

/// 404 for a model name this server does not serve.
fn unknown_model(state: &AppState, name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "the model `{name}` does not exist here; this server serves `{}`",
            state.model_id
        ),
    )
    .param("model")
    .code("model_not_found")
}

/// The error shape of a path: Anthropic's under `/v1/messages`, OpenAI's elsewhere.
fn shape_of(path: &str) -> ErrorShape {
    if path == "/v1/messages" || path.starts_with("/v1/messages/") {
        ErrorShape::Anthropic
    } else {
        ErrorShape::OpenAi
    }
}

async fn not_found(request: Request) -> Response {
    let path = request.uri().path();
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route for {} {path}", request.method()),
    )
    .into_shaped_response(shape_of(path))
}

async fn method_not_allowed(request: Request) -> Response {
    let path = request.uri().path();
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {path}", request.method()),
    )
    .into_shaped_response(shape_of(path))
}

/// Why the server stops.
enum Stop {
    /// SIGTERM or Ctrl-C.
    Signal,
    /// The model failed to load (and `stay_up_on_load_failure` is off): why.
    LoadFailed(String),
}

/// What requests ended at the drain deadline, and connections still open then, get to
/// deliver their last bytes.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// `start + d`, or a century after `start` if that is not representable.
fn after(start: Instant, d: Duration) -> Instant {
    start
        .checked_add(d)
        .unwrap_or_else(|| start + Duration::from_secs(100 * 365 * 86_400))
}

/// Serves HTTP/1.1 connections on `listener`, each limited to `header_timeout` for a request's
/// headers, until `stop` resolves with why and the instant every connection must be closed
/// by. Then it stops accepting, lets each connection finish the response it is on, and at that
/// instant drops the ones still open — whatever they are waiting for.
async fn serve_connections(
    mut listener: tokio::net::TcpListener,
    app: Router,
    header_timeout: Duration,
    tls: Option<tokio_rustls::TlsAcceptor>,
    stop: impl Future<Output = (Stop, Instant)>,
) -> Stop {
    let (closing, _) = tokio::sync::watch::channel(false);
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(stop);
    let (why, close_by) = loop {
        tokio::select! {
            s = &mut stop => break s,
            // axum's listener: retries accept errors (e.g. too many open files) after a pause.
            (stream, _) = axum::serve::Listener::accept(&mut listener) => {
                let service = TowerToHyperService::new(app.clone());
                let closing = closing.subscribe();
                let tls = tls.clone();
                connections.spawn(async move {
                    let Some(tls) = tls else {
                        return serve_connection(stream, service, header_timeout, closing).await;
                    };
                    // The handshake counts against the header timeout, as the headers would.
                    match tokio::time::timeout(header_timeout, tls.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            serve_connection(stream, service, header_timeout, closing).await
                        }
                        Ok(Err(e)) => tracing::debug!("TLS handshake failed: {e}"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    };
    drop(listener);
    closing.send_replace(true);
    let drained = tokio::time::timeout_at(close_by, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        eprintln!(
            "coli: closing {} connection(s) still open at the shutdown deadline",
            connections.len()
        );
        connections.shutdown().await;
    }
    why
}

/// Serve HTTP/1.1 on one accepted connection (plain TCP or TLS) until the client closes it, or
/// until `closing` turns true, then let the request in progress finish.
async fn serve_connection<S>(
    stream: S,
    service: TowerToHyperService<Router>,
    header_timeout: Duration,
    mut closing: tokio::sync::watch::Receiver<bool>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let conn = http.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = closing.wait_for(|c| *c) => conn.as_mut().graceful_shutdown(),
    }
    let _ = conn.await;
}

/// Resolves when the server must stop, with why and the instant by which every connection must
/// be closed. After SIGTERM or Ctrl-C: stop admitting (503), give in-flight requests and open
/// connections until the drain deadline, end the requests still running (an error event), and
/// give them [`CLOSE_GRACE`] more. After a failed load (unless `stay_up_on_load_failure`):
/// at once, with [`CLOSE_GRACE`] for the connections.
async fn shutdown_signal(state: Arc<AppState>) -> (Stop, Instant) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    let load_failed = async {
        if state.config.stay_up_on_load_failure {
            std::future::pending::<()>().await;
        }
        state.load_failed.notified().await;
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
        _ = load_failed => {
            let why = state
                .load_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_default();
            return (Stop::LoadFailed(why), after(Instant::now(), CLOSE_GRACE));
        }
    }
    state.draining.store(true, Ordering::SeqCst);
    let drain = Duration::from_secs(state.config.drain_secs);
    let deadline = after(Instant::now(), drain);
    eprintln!(
        "coli: shutting down: new requests get 503; draining in-flight ones and open connections for up to {} s",
        drain.as_secs()
    );
    // Keep listening while draining, so /ready says 503 (a load balancer takes this replica
    // out) and new requests get a 503 instead of a refused connection. Polling the counters
    // here is the drain's own clock, not test synchronisation.
    if let Some(s) = state.serving.get() {
        s.scheduler.stop_accepting();
        while s.scheduler.in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if s.scheduler.in_flight() > 0 {
            eprintln!("coli: drain deadline reached: ending the remaining requests");
            s.scheduler.cancel_all();
            // Let the ended requests' last events reach their clients.
            let grace = after(Instant::now(), CLOSE_GRACE);
            while s.scheduler.in_flight() > 0 && Instant::now() < grace {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    (Stop::Signal, after(deadline, CLOSE_GRACE))
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
