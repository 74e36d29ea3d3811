//! `coli serve`: the OpenAI-compatible HTTP server, running the engine in-process.
//!
//! Start-up binds the listener first (so `/health` answers at once), then loads the model on a
//! background thread; `/ready` turns 200 once it is loaded and warm. Requests go through the
//! API-key check, the body limit, typed parsing and validation, then into the KV-slot
//! [`Scheduler`]; tokens come back through a channel and leave as JSON or SSE. SIGTERM (or
//! Ctrl-C) stops admitting, lets in-flight requests finish until the drain deadline, then ends
//! the rest with an error event and exits 0.

mod chat;
mod errors;
pub mod metrics;
pub mod openai;
pub mod otlp;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use colibri::runtime::grammar::GrammarVocab;
use colibri::runtime::loaded::LoadedModel;
use colibri::runtime::scheduler::{Scheduler, SchedulerConfig};
use utoipa::OpenApi;

use crate::config::{self, ServeConfig, ServeFlags};
use crate::model_arg::ModelArgs;
use errors::ApiError;
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
        description = "OpenAI-compatible API of `coli serve`. Extensions beyond OpenAI's fields are marked in their descriptions."
    ),
    paths(
        chat::chat_completions,
        chat::completions,
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
        Health
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
        eprintln!(
            "coli: warning: listening on {} without an API key; set --api-key",
            addr.ip()
        );
    }
    if cfg.tls_cert.is_some() {
        anyhow::bail!(
            "tls_cert/tls_key: TLS termination is not built into this version of coli serve; terminate TLS in front of it (an ingress or a reverse proxy) and unset tls_cert/tls_key"
        );
    }
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
        draining: AtomicBool::new(false),
        otlp: OnceLock::new(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("coli-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(serve(state, addr))
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

async fn serve(state: Arc<AppState>, addr: SocketAddr) -> Result<()> {
    if let Some(endpoint) = &state.config.otlp_endpoint {
        let exporter = otlp::Exporter::start(endpoint)?;
        let _ = state.otlp.set(exporter);
        eprintln!("coli: exporting a span per request to {endpoint} (OTLP/HTTP JSON)");
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} (is another server using the port?)"))?;
    let local = listener.local_addr()?;
    eprintln!("coli: listening on http://{local}");
    // Load the model off the async runtime.
    {
        let state = state.clone();
        std::thread::Builder::new()
            .name("coli-load".into())
            .spawn(move || load_model(&state))
            .context("spawning the loader thread")?;
    }
    let app = router(state.clone());
    let shutdown = shutdown_signal(state.clone());
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving HTTP")?;
    if let Some(s) = state.serving.get() {
        s.scheduler.shutdown();
        if let Err(e) = s.loaded.model.flush() {
            eprintln!("coli: warning: saving the expert usage history: {e}");
        }
    }
    eprintln!("coli: stopped");
    Ok(())
}

/// Load the model the configuration names and start its scheduler.
fn load_model(state: &AppState) {
    let cfg = &state.config;
    let result = (|| -> Result<Serving> {
        let args = ModelArgs {
            model: cfg.model.clone().unwrap_or_else(|| "demo".into()),
            threads: cfg.threads,
            ram: cfg.ram.clone(),
            mmap: false,
            no_prefetch: false,
            io_threads: 4,
            no_learn: false,
            pin_budget: None,
            mirrors: cfg.mirrors.clone(),
            cache_policy: "lru".into(),
            direct_io: false,
            io: "auto".into(),
            mirror_weights: Vec::new(),
            mla_form: "absorbed".into(),
            draft: "none".into(),
            kv_dtype: "f32".into(),
        };
        let loaded = Arc::new(args.load(true)?);
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
                queue_limit: cfg.queue_limit,
                queue_timeout: Duration::from_secs(cfg.queue_timeout_secs),
                persist_dir: cfg.prefix_cache_dir.clone(),
                history_save_interval: Duration::from_secs(cfg.history_save_secs),
            },
        );
        Ok(Serving {
            loaded,
            scheduler,
            grammar,
            context,
        })
    })();
    match result {
        Ok(s) => {
            eprintln!(
                "coli: ready: model `{}`, {} slots × {} tokens",
                state.model_id, cfg.slots, s.context
            );
            let _ = state.serving.set(Arc::new(s));
        }
        Err(e) => {
            eprintln!("coli: error: {e:#}");
            *state.load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!("{e:#}"));
        }
    }
}

/// The routes, with authentication, body limit and CORS.
pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(chat::completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    let mut app = Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
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
                .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE]),
        );
    }
    app
}

/// `Authorization: Bearer KEY` (or `x-api-key: KEY`) on `/v1/*` when keys are configured;
/// keys are compared in constant time.
async fn require_api_key(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: Next,
) -> Response {
    let keys = &state.config.api_keys;
    if keys.is_empty() {
        return next.run(request).await;
    }
    let headers = request.headers();
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").map(str::trim))
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
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
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            if given.is_some() {
                "invalid API key"
            } else {
                "missing API key: send `Authorization: Bearer <key>`"
            },
        )
        .code("invalid_api_key")
        .into_response()
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
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    if id == state.model_id {
        Json(model_card(&state)).into_response()
    } else {
        unknown_model(&state, &id).into_response()
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

async fn not_found(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route for {} {}", request.method(), request.uri().path()),
    )
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} is not allowed on {}",
            request.method(),
            request.uri().path()
        ),
    )
}

/// Resolves after SIGTERM or Ctrl-C and the drain: stop admitting (503), give in-flight
/// requests until the drain deadline, end the rest with an error event.
async fn shutdown_signal(state: Arc<AppState>) {
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
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    state.draining.store(true, Ordering::SeqCst);
    let deadline = Duration::from_secs(state.config.drain_secs);
    eprintln!(
        "coli: shutting down: new requests get 503; draining in-flight ones for up to {} s",
        deadline.as_secs()
    );
    // Keep listening while draining, so /ready says 503 (a load balancer takes this replica
    // out) and new requests get a 503 instead of a refused connection. Polling the counters
    // here is the drain's own clock, not test synchronisation.
    if let Some(s) = state.serving.get() {
        s.scheduler.stop_accepting();
        let start = tokio::time::Instant::now();
        while s.scheduler.in_flight() > 0 && start.elapsed() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if s.scheduler.in_flight() > 0 {
            eprintln!("coli: drain deadline reached: ending the remaining requests");
            s.scheduler.cancel_all();
            // Let the ended requests' last events reach their clients.
            let grace = tokio::time::Instant::now();
            while s.scheduler.in_flight() > 0 && grace.elapsed() < Duration::from_secs(2) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    // Returning stops the listener; axum then waits for open responses to finish.
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
