//! The configuration of `coli serve`: the typed, validated [`ServeConfig`], the layers it is
//! read from and where each effective value came from.
//!
//! The engine options (`io`, `cache_policy`, `mla_form`, `ram`, ...) are [`EngineOptions`],
//! the structure every computing command shares; here they are top-level keys like the
//! server's own, held in [`ServeConfig::engine`].
//!
//! Layers, each overriding the one before:
//!
//! 1. built-in defaults ([`ServeConfig::default`]);
//! 2. a profile file in TOML: `--config FILE` (or `COLI_CONFIG`), else `./colibri.toml` when
//!    it exists. Its top-level keys are the base; a table `[profiles.NAME]` holds overrides
//!    applied when `--profile NAME` (or `COLI_PROFILE`) selects it;
//! 3. environment variables `COLI_<KEY>` (e.g. `COLI_PORT=9000`, `COLI_API_KEYS=a,b`);
//! 4. command-line flags ([`ServeFlags`]).
//!
//! The layers are merged with `figment` and the result deserialised strictly into
//! [`ServeConfig`]; every key's [`Source`] is tracked, so an unknown key, a value of the wrong
//! type or one out of range is reported with the file, profile, variable or flag it came from.
//! Secrets (`api_keys`) are never printed: [`Loaded::show`], `Debug` and the error messages
//! mask them.

use std::collections::BTreeMap;
use std::fmt;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider};
use serde::{Deserialize, Serialize};

use crate::engine_options::{EngineFlags, EngineOptions, ENGINE_KEYS};
use crate::tool_calls::{ReasoningFormat, ToolCallFormat};

/// The file read from the working directory when no `--config`/`COLI_CONFIG` names one.
pub const DEFAULT_FILE: &str = "colibri.toml";

/// The log levels `log_level` accepts.
const LOG_LEVELS: &[&str] = &["error", "warn", "info", "debug", "trace"];

/// The longest `header_timeout_secs` / `body_timeout_secs` accepted (a day).
const MAX_TIMEOUT_SECS: u64 = 86_400;

/// Keys whose values are secret: masked wherever the configuration is printed.
const SECRET_KEYS: &[&str] = &["api_keys"];

/// `COLI_*` environment variables that belong to other parts of colibri, not to this
/// configuration; they are skipped, as is every name starting with [`IGNORED_ENV_PREFIXES`].
const IGNORED_ENV: &[&str] = &[
    "COLI_LOG",
    "COLI_ISA",
    "COLI_INTERLEAVE",
    "COLI_CACHE_DIR",
    "COLI_STATE_DIR",
    "COLI_TEST_CACHE",
    "COLI_PROFILE",
    "COLI_CONFIG",
    "COLI_LLAMA_CPP_PYTHON",
];

/// Prefixes of `COLI_*` environment variables that are not configuration (CI and tests).
const IGNORED_ENV_PREFIXES: &[&str] = &["COLI_CI_", "COLI_TEST_"];

/// How an environment variable's text is read for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Taken as it is (strings and paths).
    Text,
    /// An unsigned integer when it reads as one; otherwise left as text, which extraction
    /// then rejects with the expected type.
    Number,
    /// `true`/`false` (also `1`/`0`, `yes`/`no`, `on`/`off`, any case).
    Bool,
    /// Comma-separated items, or a TOML/JSON array literal when it starts with `[`.
    List,
    /// Like [`Shape::List`], each comma-separated item a number when it reads as one.
    NumberList,
}

/// Every key of [`ServeConfig`] but its engine options ([`ENGINE_KEYS`]), in field order, with
/// how the environment spells its value.
const KEYS: &[(&str, Shape)] = &[
    ("model", Shape::Text),
    ("served_model_name", Shape::Text),
    ("slots", Shape::Number),
    ("context", Shape::Number),
    ("prefill_chunk", Shape::Number),
    ("prefill_budget", Shape::Number),
    ("queue_limit", Shape::Number),
    ("queue_timeout_secs", Shape::Number),
    ("max_tokens_cap", Shape::Number),
    ("host", Shape::Text),
    ("port", Shape::Number),
    ("api_keys", Shape::List),
    ("cors_origins", Shape::List),
    ("max_body_bytes", Shape::Number),
    ("header_timeout_secs", Shape::Number),
    ("body_timeout_secs", Shape::Number),
    ("drain_secs", Shape::Number),
    ("stay_up_on_load_failure", Shape::Bool),
    ("log_level", Shape::Text),
    ("log_json", Shape::Bool),
    ("otlp_endpoint", Shape::Text),
    ("otlp_protocol", Shape::Text),
    ("tls_cert", Shape::Text),
    ("tls_key", Shape::Text),
    ("history_save_secs", Shape::Number),
    ("prefix_cache_dir", Shape::Text),
    ("tool_call_format", Shape::Text),
    ("reasoning_format", Shape::Text),
    ("plain_text_messages", Shape::Bool),
];

/// The effective configuration of `coli serve`.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Model directory or `.gguf` path, or `demo`; `None` means the built-in demo model.
    pub model: Option<String>,
    /// The model id `/v1/models` reports; `None` means derived from the model path.
    pub served_model_name: Option<String>,
    /// KV-cache slots, i.e. requests decoded at once (1 to 256).
    pub slots: usize,
    /// Tokens of context per slot; 0 means the model's own context length.
    pub context: usize,
    /// Prompt tokens prefilled per step (at least 1).
    pub prefill_chunk: usize,
    /// Prompt tokens all slots together prefill per step; 0 means measured: as many as keep
    /// the waiting prompts' mean time to first token least, never fewer than the oldest
    /// prompt's chunk.
    pub prefill_budget: usize,
    /// Requests that may wait beyond the active slots (at least 1).
    pub queue_limit: usize,
    /// Seconds a request may wait for a slot before it is refused.
    pub queue_timeout_secs: u64,
    /// The largest `max_tokens` a request may ask for (at least 1).
    pub max_tokens_cap: usize,
    /// The IP address to listen on.
    pub host: String,
    /// The TCP port to listen on; 0 picks any free port.
    pub port: u16,
    /// Accepted bearer tokens; empty means no authentication. Secret.
    pub api_keys: Vec<String>,
    /// Origins allowed by CORS (`*` for any); empty turns CORS off.
    pub cors_origins: Vec<String>,
    /// The largest request body accepted, in bytes (at least 1024).
    pub max_body_bytes: usize,
    /// Seconds a client has to send a request's headers, counted from the connection's start
    /// or the end of its previous response (so also how long an idle keep-alive connection
    /// stays open); then the connection is closed. 1 to 86400.
    pub header_timeout_secs: u64,
    /// Seconds a client has to send a whole request body once its headers are in; then the
    /// request gets a 408. 1 to 86400.
    pub body_timeout_secs: u64,
    /// Seconds in-flight requests and open connections get on shutdown; what is still running
    /// then is ended (streams with an error event), and connections still open 2 s later are
    /// closed.
    pub drain_secs: u64,
    /// After a failed model load, keep serving (`/ready` and requests answer 503 with the
    /// error) instead of exiting with status 1.
    pub stay_up_on_load_failure: bool,
    /// One of `error`, `warn`, `info`, `debug`, `trace`.
    pub log_level: String,
    /// Log as JSON lines instead of text.
    pub log_json: bool,
    /// OpenTelemetry collector (`http://` or `https://`, TLS with the system's trust store);
    /// `None` turns tracing export off. For the HTTP protocols the base URL, to which
    /// `/v1/traces` is appended; for `grpc` the collector's address.
    pub otlp_endpoint: Option<String>,
    /// How spans reach the collector: `http/protobuf` (OTLP/HTTP, protobuf bodies; the
    /// default), `http/json` (OTLP/HTTP, JSON bodies) or `grpc` (OTLP/gRPC).
    pub otlp_protocol: String,
    /// TLS certificate chain (PEM); given together with `tls_key`.
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM); given together with `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// Longest time in seconds between saves of the expert usage history while requests run
    /// (at least 1); it is also saved whenever the server goes idle and at shutdown.
    pub history_save_secs: u64,
    /// Directory keeping the slots' conversations (tokens and KV cache) across restarts;
    /// `None`: slots start empty.
    pub prefix_cache_dir: Option<PathBuf>,
    /// The format tool calls are read (and forced) in: `auto` (the model's own, from how its
    /// chat template writes a call, else its model type), `hermes`, `qwen3_coder`,
    /// `deepseek_v3`, `deepseek_v31`, `deepseek_v32`, `deepseek_v4`, `kimi_k2`, `kimi_k3`, `glm45`,
    /// `minimax_m2`, `harmony` or `inkling`.
    pub tool_call_format: ToolCallFormat,
    /// How reasoning is read: `auto` (the tool-call format's own: `<think>`, harmony's
    /// analysis channel, Inkling's thinking blocks) or `none` (thoughts stay in the content).
    pub reasoning_format: ReasoningFormat,
    /// Encode the text of a chat request (message content of every role, names, tool-call
    /// arguments, tool results, tool definitions) as plain text, so that special-token text
    /// in it (`<|im_end|>`) never becomes a control token; only the chat template's own
    /// markup does. `false` tokenizes the rendered prompt as one string, as before.
    pub plain_text_messages: bool,
    /// The engine options (top-level keys of the file, like the others).
    pub engine: EngineOptions,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            model: None,
            served_model_name: None,
            slots: 4,
            context: 0,
            prefill_chunk: 256,
            prefill_budget: 0,
            queue_limit: 64,
            queue_timeout_secs: 60,
            max_tokens_cap: 4096,
            host: "127.0.0.1".to_string(),
            port: 8080,
            api_keys: Vec::new(),
            cors_origins: Vec::new(),
            max_body_bytes: 4 << 20,
            header_timeout_secs: 75,
            body_timeout_secs: 60,
            drain_secs: 30,
            stay_up_on_load_failure: false,
            log_level: "info".to_string(),
            log_json: false,
            otlp_endpoint: None,
            otlp_protocol: "http/protobuf".to_string(),
            tls_cert: None,
            tls_key: None,
            history_save_secs: 60,
            prefix_cache_dir: None,
            tool_call_format: ToolCallFormat::Auto,
            reasoning_format: ReasoningFormat::Auto,
            plain_text_messages: true,
            engine: EngineOptions::default(),
        }
    }
}

/// Like the derived `Debug`, except that API keys are masked.
impl fmt::Debug for ServeConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServeConfig")
            .field("model", &self.model)
            .field("served_model_name", &self.served_model_name)
            .field("slots", &self.slots)
            .field("context", &self.context)
            .field("prefill_chunk", &self.prefill_chunk)
            .field("prefill_budget", &self.prefill_budget)
            .field("queue_limit", &self.queue_limit)
            .field("queue_timeout_secs", &self.queue_timeout_secs)
            .field("max_tokens_cap", &self.max_tokens_cap)
            .field("host", &self.host)
            .field("port", &self.port)
            .field("api_keys", &vec!["***"; self.api_keys.len()])
            .field("cors_origins", &self.cors_origins)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("header_timeout_secs", &self.header_timeout_secs)
            .field("body_timeout_secs", &self.body_timeout_secs)
            .field("drain_secs", &self.drain_secs)
            .field("stay_up_on_load_failure", &self.stay_up_on_load_failure)
            .field("log_level", &self.log_level)
            .field("log_json", &self.log_json)
            .field("otlp_endpoint", &self.otlp_endpoint)
            .field("otlp_protocol", &self.otlp_protocol)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("history_save_secs", &self.history_save_secs)
            .field("prefix_cache_dir", &self.prefix_cache_dir)
            .field("tool_call_format", &self.tool_call_format)
            .field("reasoning_format", &self.reasoning_format)
            .field("plain_text_messages", &self.plain_text_messages)
            .field("engine", &self.engine)
            .finish()
    }
}

impl ServeConfig {
    /// Checks the ranges and formats types cannot express. On failure returns the offending
    /// key and what is wrong with its value (secrets are not repeated).
    pub fn validate(&self) -> Result<(), (String, String)> {
        let fail = |key: &str, problem: String| Err((key.to_string(), problem));
        let at_least = |key: &str, value: usize, min: usize| {
            if value < min {
                fail(key, format!("expected at least {min}, found {value}"))
            } else {
                Ok(())
            }
        };
        if self.model.as_deref() == Some("") {
            return fail(
                "model",
                "expected a model path or `demo`, found an empty string".into(),
            );
        }
        if self.served_model_name.as_deref() == Some("") {
            return fail("served_model_name", "must not be empty".into());
        }
        self.engine.validate()?;
        if !(1..=256).contains(&self.slots) {
            return fail(
                "slots",
                format!("expected a number from 1 to 256, found {}", self.slots),
            );
        }
        at_least("prefill_chunk", self.prefill_chunk, 1)?;
        at_least("queue_limit", self.queue_limit, 1)?;
        at_least("max_tokens_cap", self.max_tokens_cap, 1)?;
        if self.host.parse::<IpAddr>().is_err() {
            return fail(
                "host",
                format!(
                    "expected an IP address such as 127.0.0.1 or ::, found `{}`",
                    self.host
                ),
            );
        }
        if let Some(i) = self.api_keys.iter().position(|k| k.is_empty()) {
            return fail("api_keys", format!("key number {} is empty", i + 1));
        }
        for origin in &self.cors_origins {
            let ok =
                origin == "*" || origin.starts_with("http://") || origin.starts_with("https://");
            if !ok {
                return fail(
                    "cors_origins",
                    format!(
                        "expected `*` or an origin such as https://example.com, found `{origin}`"
                    ),
                );
            }
        }
        at_least("max_body_bytes", self.max_body_bytes, 1024)?;
        for (key, secs) in [
            ("header_timeout_secs", self.header_timeout_secs),
            ("body_timeout_secs", self.body_timeout_secs),
        ] {
            if !(1..=MAX_TIMEOUT_SECS).contains(&secs) {
                return fail(
                    key,
                    format!(
                        "expected a number of seconds from 1 to {MAX_TIMEOUT_SECS}, found {secs}"
                    ),
                );
            }
        }
        if !LOG_LEVELS.contains(&self.log_level.as_str()) {
            return fail(
                "log_level",
                format!(
                    "expected one of {}, found `{}`",
                    LOG_LEVELS.join(", "),
                    self.log_level
                ),
            );
        }
        if let Some(url) = &self.otlp_endpoint {
            let rest = url
                .strip_prefix("http://")
                .or_else(|| url.strip_prefix("https://"));
            if rest.is_none_or(str::is_empty) {
                return fail(
                    "otlp_endpoint",
                    format!("expected an http:// or https:// URL, found `{url}`"),
                );
            }
        }
        if crate::serve::otlp::OtlpProtocol::parse(&self.otlp_protocol).is_none() {
            return fail(
                "otlp_protocol",
                format!(
                    "expected one of {}, found `{}`",
                    crate::serve::otlp::OtlpProtocol::NAMES.join(", "),
                    self.otlp_protocol
                ),
            );
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => {
                return fail(
                    "tls_cert",
                    "is set but tls_key is not: give both or neither".into(),
                );
            }
            (None, Some(_)) => {
                return fail(
                    "tls_key",
                    "is set but tls_cert is not: give both or neither".into(),
                );
            }
            _ => {}
        }
        if self.history_save_secs == 0 {
            return fail(
                "history_save_secs",
                "expected at least 1 (seconds between saves of the usage history), found 0".into(),
            );
        }
        Ok(())
    }
}

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// The built-in default.
    Default,
    /// A configuration file: its top level (`profile: None`) or a `[profiles.NAME]` table.
    File {
        /// The file, as named (relative names are resolved against the working directory).
        path: PathBuf,
        /// The profile whose table held the value, if any.
        profile: Option<String>,
    },
    /// An environment variable, by name.
    Env(String),
    /// A command-line flag, e.g. `--port`.
    Flag(String),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::File {
                path,
                profile: None,
            } => write!(f, "file {}", path.display()),
            Source::File {
                path,
                profile: Some(p),
            } => write!(f, "file {} [profile {p}]", path.display()),
            Source::Env(var) => write!(f, "env {var}"),
            Source::Flag(flag) => write!(f, "flag {flag}"),
        }
    }
}

impl Source {
    /// The source spelt out for error messages.
    fn describe(&self) -> String {
        match self {
            Source::Default => "the built-in default".to_string(),
            Source::File {
                path,
                profile: None,
            } => format!("file {}", path.display()),
            Source::File {
                path,
                profile: Some(p),
            } => format!("profile `{p}` of file {}", path.display()),
            Source::Env(var) => format!("environment variable {var}"),
            Source::Flag(flag) => format!("flag {flag}"),
        }
    }
}

/// The options of `coli serve` (and `coli config`): each one given overrides the file and the
/// environment; those not given leave them be.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServeFlags {
    /// Configuration file (TOML) [default: ./colibri.toml when it exists; env: COLI_CONFIG].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The `[profiles.NAME]` table of the configuration file to apply [env: COLI_PROFILE].
    #[arg(long, value_name = "NAME")]
    pub profile: Option<String>,
    /// Model directory or .gguf file, or `demo` for the built-in random-weight model.
    #[arg(long, short = 'm', value_name = "MODEL")]
    pub model: Option<String>,
    /// The model id reported by /v1/models [default: derived from the model path].
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// The engine options (as for `coli run`).
    #[command(flatten)]
    pub engine: EngineFlags,
    /// KV-cache slots: requests decoded at once (1-256).
    #[arg(long, value_name = "N")]
    pub slots: Option<usize>,
    /// Tokens of context per slot; 0 = the model's own.
    #[arg(long, value_name = "TOKENS")]
    pub context: Option<usize>,
    /// Prompt tokens prefilled per step.
    #[arg(long, value_name = "TOKENS")]
    pub prefill_chunk: Option<usize>,
    /// Prompt tokens all slots prefill per step; 0 = measured.
    #[arg(long, value_name = "TOKENS")]
    pub prefill_budget: Option<usize>,
    /// Requests that may wait beyond the active slots.
    #[arg(long, value_name = "N")]
    pub queue_limit: Option<usize>,
    /// Seconds a request may wait for a slot.
    #[arg(long, value_name = "SECS")]
    pub queue_timeout_secs: Option<u64>,
    /// The largest max_tokens a request may ask for.
    #[arg(long, value_name = "TOKENS")]
    pub max_tokens_cap: Option<usize>,
    /// IP address to listen on.
    #[arg(long, value_name = "IP")]
    pub host: Option<String>,
    /// TCP port to listen on; 0 = any free port.
    #[arg(long, value_name = "PORT")]
    pub port: Option<u16>,
    /// An accepted bearer token (repeatable).
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_keys: Vec<String>,
    /// An origin allowed by CORS, or `*` (repeatable).
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origins: Vec<String>,
    /// The largest request body accepted, in bytes.
    #[arg(long, value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Seconds a client has to send a request's headers (also the keep-alive idle limit).
    #[arg(long, value_name = "SECS")]
    pub header_timeout_secs: Option<u64>,
    /// Seconds a client has to send a whole request body after its headers (408 beyond).
    #[arg(long, value_name = "SECS")]
    pub body_timeout_secs: Option<u64>,
    /// Seconds in-flight requests and connections get on shutdown.
    #[arg(long, value_name = "SECS")]
    pub drain_secs: Option<u64>,
    /// Keep serving 503s with the error after a failed model load instead of exiting 1.
    #[arg(long)]
    pub stay_up_on_load_failure: bool,
    /// error, warn, info, debug or trace.
    #[arg(long, value_name = "LEVEL")]
    pub log_level: Option<String>,
    /// Log as JSON lines.
    #[arg(long)]
    pub log_json: bool,
    /// OpenTelemetry collector URL (http:// or https://).
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// OTLP transport: http/protobuf (default), http/json or grpc.
    #[arg(long, value_name = "PROTOCOL")]
    pub otlp_protocol: Option<String>,
    /// TLS certificate chain (PEM); needs --tls-key.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM); needs --tls-cert.
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Longest time between saves of the expert usage history while serving (it is also
    /// saved when the server goes idle and at shutdown).
    #[arg(long, value_name = "SECS")]
    pub history_save_secs: Option<u64>,
    /// Keep the slots' conversations (tokens and KV cache) in this directory across restarts.
    #[arg(long, value_name = "DIR")]
    pub prefix_cache_dir: Option<PathBuf>,
    /// The format tool calls are read and forced in [default: auto, the model's own].
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub tool_call_format: Option<ToolCallFormat>,
    /// How reasoning is read: auto (the format's own) or none (left in the content).
    #[arg(long, value_enum, value_name = "FORMAT")]
    pub reasoning_format: Option<ReasoningFormat>,
    /// Encode chat request text as plain text, so special-token text typed in a message never
    /// becomes a control token [default: true].
    #[arg(long, value_name = "BOOL")]
    pub plain_text_messages: Option<bool>,
}

/// The arguments of `coli config`.
#[derive(clap::Args, Debug, Clone)]
pub struct ConfigArgs {
    /// The same options as `coli serve`.
    #[command(flatten)]
    pub flags: ServeFlags,
    /// Print the effective configuration and where each value came from.
    #[arg(long)]
    pub show: bool,
}

/// `coli config [--show]`: loads and validates the configuration as `coli serve` would; with
/// `--show` prints every effective value and its source, otherwise says that it is valid.
pub fn run_config_command(args: ConfigArgs) -> Result<()> {
    let loaded = load(&args.flags)?;
    if args.show {
        print!("{}", loaded.show());
    } else {
        println!("the configuration is valid (print it with --show)");
    }
    Ok(())
}

/// A loaded configuration and the source of each key's effective value.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The merged, validated configuration.
    pub config: ServeConfig,
    /// Key -> where its effective value came from (every key is present).
    pub sources: BTreeMap<String, Source>,
}

impl Loaded {
    /// The effective configuration as TOML lines `key = value  # source`, one per key in
    /// field order. Unset optional keys are printed commented out (`# key = (unset)  # source`)
    /// so the text stays valid TOML; API keys are masked (`["***", "***"]`).
    pub fn show(&self) -> String {
        let mut values = match serde_json::to_value(&self.config) {
            Ok(serde_json::Value::Object(map)) => map,
            Ok(_) => serde_json::Map::new(),
            Err(e) => return format!("# the configuration cannot be shown: {e}\n"),
        };
        // The engine options are top-level keys, as in the file.
        if let Some(serde_json::Value::Object(engine)) = values.remove(ENGINE_TABLE) {
            values.extend(engine);
        }
        let mut out = String::new();
        for (key, _) in keys() {
            let source = self.sources.get(*key).unwrap_or(&Source::Default);
            let value = values.get(*key).unwrap_or(&serde_json::Value::Null);
            let _ = if value.is_null() {
                writeln!(out, "# {key} = (unset)  # {source}")
            } else {
                let shown = if SECRET_KEYS.contains(key) {
                    mask(value)
                } else {
                    toml_text(value)
                };
                writeln!(out, "{key} = {shown}  # {source}")
            };
        }
        out
    }
}

/// A JSON value written as TOML.
fn toml_text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => toml::Value::String(s.clone()).to_string(),
        serde_json::Value::Array(items) => {
            let items: Vec<String> = items.iter().map(toml_text).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

/// A secret value: each list item, or the value itself, as `"***"`.
fn mask(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::Array(items) => format!("[{}]", vec!["\"***\""; items.len()].join(", ")),
        _ => "\"***\"".to_string(),
    }
}

/// Reads every layer from the real process environment and the current directory.
pub fn load(flags: &ServeFlags) -> Result<Loaded> {
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    load_from(flags, &process_env()?, &cwd)
}

/// [`load`] without a profile (`--profile` and `COLI_PROFILE` ignored): the file's top level,
/// the environment and the flags — what `coli tune` starts from.
pub fn load_without_profile(flags: &ServeFlags) -> Result<Loaded> {
    let mut env = process_env()?;
    env.retain(|(name, _)| name != "COLI_PROFILE");
    let flags = ServeFlags {
        profile: None,
        ..flags.clone()
    };
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    load_from(&flags, &env, &cwd)
}

/// The configuration file these flags name (`--config`, else `COLI_CONFIG`), else
/// `./colibri.toml`, whether it exists or not (`coli tune` creates it).
pub fn file_for(flags: &ServeFlags) -> Result<PathBuf> {
    let cwd = std::env::current_dir().context("cannot read the current directory")?;
    let named = flags.config.clone().or_else(|| {
        std::env::var_os("COLI_CONFIG")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    });
    Ok(cwd.join(named.unwrap_or_else(|| PathBuf::from(DEFAULT_FILE))))
}

/// The `COLI_*` variables of this process that configuration reads.
fn process_env() -> Result<Vec<(String, String)>> {
    let mut env = Vec::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("COLI_") || (is_ignored_env(name) && !is_selector_env(name)) {
            continue;
        }
        let value = value
            .into_string()
            .map_err(|_| anyhow!("environment variable {name} is not valid UTF-8"))?;
        env.push((name.to_string(), value));
    }
    Ok(env)
}

/// Whether an environment variable is one this configuration reads to find the file/profile.
fn is_selector_env(name: &str) -> bool {
    name == "COLI_CONFIG" || name == "COLI_PROFILE"
}

/// Whether a `COLI_*` environment variable is not configuration and must be skipped.
fn is_ignored_env(name: &str) -> bool {
    IGNORED_ENV.contains(&name) || IGNORED_ENV_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The field of [`ServeConfig`] holding the engine options; their keys are top-level keys of
/// the file, the environment and the flags, nested under it only for extraction.
const ENGINE_TABLE: &str = "engine";

/// Every key, in the order `coli config --show` prints them: the server's, then the engine's.
fn keys() -> impl Iterator<Item = &'static (&'static str, Shape)> {
    KEYS.iter().chain(ENGINE_KEYS)
}

/// Whether `key` is one of the engine options.
fn is_engine_key(key: &str) -> bool {
    ENGINE_KEYS.iter().any(|(k, _)| *k == key)
}

/// The known keys, for error messages.
fn known_keys() -> String {
    keys().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
}

fn shape_of(key: &str) -> Option<Shape> {
    keys().find(|(k, _)| *k == key).map(|(_, s)| *s)
}

/// The engine options of a computing command (`run`, `bench`, `logits`, `info`): the
/// defaults overridden by the flags given, validated like `coli serve`'s (an error names the
/// flag). The configuration file and the `COLI_*` variables are `coli serve`'s only.
pub fn engine_from_flags(flags: &EngineFlags) -> Result<EngineOptions> {
    let mut layers = Layers::default();
    layers.push(Source::Default, defaults_dict()?);
    for (key, flag, value) in flags.values()? {
        let mut dict = Dict::new();
        dict.insert(key.to_string(), value);
        layers.push(Source::Flag(flag.to_string()), dict);
    }
    Ok(layers.finish()?.config.engine)
}

/// [`load`] with an explicit environment (name, value pairs; only `COLI_*` names matter) and
/// working directory (where `colibri.toml` is looked for and relative `--config` names are
/// resolved).
pub fn load_from(flags: &ServeFlags, env: &[(String, String)], cwd: &Path) -> Result<Loaded> {
    let env_var = |name: &str| {
        env.iter()
            .rev()
            .find(|(n, v)| n == name && !v.is_empty())
            .map(|(_, v)| v.clone())
    };
    let mut layers = Layers::default();
    layers.push(Source::Default, defaults_dict()?);

    // The file and the profile.
    let file = match (&flags.config, env_var("COLI_CONFIG")) {
        (Some(path), _) => Some((cwd.join(path), "flag --config".to_string())),
        (None, Some(path)) => Some((
            cwd.join(path),
            "environment variable COLI_CONFIG".to_string(),
        )),
        (None, None) => None,
    };
    let file = match file {
        Some((path, named_by)) => {
            if !path.exists() {
                bail!(
                    "configuration file {} (named by {named_by}) does not exist",
                    path.display()
                );
            }
            Some(path)
        }
        None => Some(cwd.join(DEFAULT_FILE)).filter(|p| p.is_file()),
    };
    let profile = match (&flags.profile, env_var("COLI_PROFILE")) {
        (Some(name), _) => Some((name.clone(), "flag --profile")),
        (None, Some(name)) => Some((name, "environment variable COLI_PROFILE")),
        (None, None) => None,
    };
    match (&file, &profile) {
        (Some(path), _) => {
            let (base, mut profiles) = read_file(path)?;
            layers.push(
                Source::File {
                    path: path.clone(),
                    profile: None,
                },
                base,
            );
            if let Some((name, selected_by)) = &profile {
                let Some(table) = profiles.remove(name) else {
                    let available: Vec<&str> = profiles.keys().map(String::as_str).collect();
                    let available = if available.is_empty() {
                        "it defines no profiles".to_string()
                    } else {
                        format!("available profiles: {}", available.join(", "))
                    };
                    bail!(
                        "profile `{name}` (selected by {selected_by}) is not in {}; {available}",
                        path.display()
                    );
                };
                layers.push(
                    Source::File {
                        path: path.clone(),
                        profile: Some(name.clone()),
                    },
                    table,
                );
            }
        }
        (None, Some((name, selected_by))) => bail!(
            "profile `{name}` is selected by {selected_by} but there is no configuration file \
             ({} does not exist; name one with --config or COLI_CONFIG)",
            cwd.join(DEFAULT_FILE).display()
        ),
        (None, None) => {}
    }

    // The environment.
    for (name, text) in env {
        if !name.starts_with("COLI_") || is_ignored_env(name) {
            continue;
        }
        let key = name["COLI_".len()..].to_ascii_lowercase();
        let Some(shape) = shape_of(&key) else {
            bail!(
                "unknown configuration key `{key}` from environment variable {name}; known keys: {}",
                known_keys()
            );
        };
        // An empty variable is unset (`COLI_API_KEYS=` from an unset shell variable must not
        // drop the file's keys); `[]` clears a list on purpose.
        if text.trim().is_empty() {
            continue;
        }
        let value = env_value(shape, text).with_context(|| {
            format!("invalid configuration: `{key}` from environment variable {name}")
        })?;
        let mut dict = Dict::new();
        dict.insert(key, value);
        layers.push(Source::Env(name.clone()), dict);
    }

    // The flags.
    for (key, flag, value) in flag_values(flags)? {
        let mut dict = Dict::new();
        dict.insert(key.to_string(), value);
        layers.push(Source::Flag(flag.to_string()), dict);
    }

    layers.finish()
}

/// The defaults as a dictionary of values, the engine options at the top level.
fn defaults_dict() -> Result<Dict> {
    let mut dict = Value::serialize(ServeConfig::default())
        .ok()
        .and_then(Value::into_dict)
        .ok_or_else(|| anyhow!("cannot represent the default configuration"))?;
    if let Some(engine) = dict.remove(ENGINE_TABLE).and_then(Value::into_dict) {
        dict.extend(engine);
    }
    Ok(dict)
}

/// Reads a configuration file: its top-level keys and its `[profiles.NAME]` tables, each
/// checked for unknown keys.
fn read_file(path: &Path) -> Result<(Dict, BTreeMap<String, Dict>)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read configuration file {}", path.display()))?;
    let mut table: toml::Table = toml::from_str(&text)
        .with_context(|| format!("cannot parse configuration file {} as TOML", path.display()))?;
    let mut profiles = BTreeMap::new();
    if let Some(value) = table.remove("profiles") {
        let toml::Value::Table(tables) = value else {
            bail!(
                "`profiles` in {} must be a table of [profiles.NAME] tables",
                path.display()
            );
        };
        for (name, value) in tables {
            let toml::Value::Table(profile) = value else {
                bail!(
                    "`profiles.{name}` in {} must be a table ([profiles.{name}])",
                    path.display()
                );
            };
            let dict = file_dict(profile, path, Some(&name))?;
            profiles.insert(name, dict);
        }
    }
    Ok((file_dict(table, path, None)?, profiles))
}

/// A table of the file as a dictionary, refusing keys the configuration lacks.
fn file_dict(table: toml::Table, path: &Path, profile: Option<&str>) -> Result<Dict> {
    let place = match profile {
        Some(p) => format!("profile `{p}` of {}", path.display()),
        None => path.display().to_string(),
    };
    if let Some(key) = table.keys().find(|k| shape_of(k).is_none()) {
        bail!(
            "unknown configuration key `{key}` in {place}; known keys: {}",
            known_keys()
        );
    }
    Value::serialize(table)
        .ok()
        .and_then(Value::into_dict)
        .ok_or_else(|| anyhow!("cannot read the values of {place}"))
}

/// An environment variable's text as a value of the key's shape.
fn env_value(shape: Shape, text: &str) -> Result<Value> {
    let value = match shape {
        Shape::Text => Value::from(text.to_string()),
        Shape::Number => match text.trim().parse::<u64>() {
            Ok(n) => Value::from(n),
            Err(_) => Value::from(text.to_string()),
        },
        Shape::Bool => match text.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Value::from(true),
            "false" | "0" | "no" | "off" => Value::from(false),
            _ => Value::from(text.to_string()),
        },
        Shape::List | Shape::NumberList if text.trim_start().starts_with('[') => {
            let doc: toml::Table = toml::from_str(&format!("list = {text}"))
                .map_err(|e| anyhow!("`{text}` is not an array literal: {}", e.message()))?;
            Value::serialize(&doc["list"])?
        }
        Shape::List | Shape::NumberList => {
            let items: Vec<Value> = text
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|item| match item.parse::<f64>() {
                    Ok(n) if shape == Shape::NumberList => Value::from(n),
                    _ => Value::from(item.to_string()),
                })
                .collect();
            Value::from(items)
        }
    };
    Ok(value)
}

/// The flags actually given, as (key, flag, value).
fn flag_values(flags: &ServeFlags) -> Result<Vec<(&'static str, &'static str, Value)>> {
    let mut out = Vec::new();
    let mut put = |key: &'static str, flag: &'static str, value: Result<Value, figment::Error>| {
        let value =
            value.map_err(|e| anyhow!("invalid configuration: `{key}` from flag {flag}: {e}"))?;
        out.push((key, flag, value));
        anyhow::Ok(())
    };
    macro_rules! opt {
        ($field:ident, $flag:literal) => {
            if let Some(v) = &flags.$field {
                put(stringify!($field), $flag, Value::serialize(v))?;
            }
        };
    }
    macro_rules! list {
        ($field:ident, $flag:literal) => {
            if !flags.$field.is_empty() {
                put(stringify!($field), $flag, Value::serialize(&flags.$field))?;
            }
        };
    }
    opt!(model, "--model");
    opt!(served_model_name, "--served-model-name");
    opt!(slots, "--slots");
    opt!(context, "--context");
    opt!(prefill_chunk, "--prefill-chunk");
    opt!(prefill_budget, "--prefill-budget");
    opt!(queue_limit, "--queue-limit");
    opt!(queue_timeout_secs, "--queue-timeout-secs");
    opt!(max_tokens_cap, "--max-tokens-cap");
    opt!(host, "--host");
    opt!(port, "--port");
    list!(api_keys, "--api-key");
    list!(cors_origins, "--cors-origin");
    opt!(max_body_bytes, "--max-body-bytes");
    opt!(header_timeout_secs, "--header-timeout-secs");
    opt!(body_timeout_secs, "--body-timeout-secs");
    opt!(drain_secs, "--drain-secs");
    if flags.stay_up_on_load_failure {
        put(
            "stay_up_on_load_failure",
            "--stay-up-on-load-failure",
            Ok(Value::from(true)),
        )?;
    }
    opt!(log_level, "--log-level");
    if flags.log_json {
        put("log_json", "--log-json", Ok(Value::from(true)))?;
    }
    opt!(otlp_endpoint, "--otlp-endpoint");
    opt!(otlp_protocol, "--otlp-protocol");
    opt!(tls_cert, "--tls-cert");
    opt!(tls_key, "--tls-key");
    opt!(history_save_secs, "--history-save-secs");
    opt!(prefix_cache_dir, "--prefix-cache-dir");
    opt!(tool_call_format, "--tool-call-format");
    opt!(reasoning_format, "--reasoning-format");
    opt!(plain_text_messages, "--plain-text-messages");
    out.extend(flags.engine.values()?);
    Ok(out)
}

/// One layer of values, as a figment provider named after its source.
struct Layer {
    name: String,
    dict: Dict,
}

impl Provider for Layer {
    fn metadata(&self) -> Metadata {
        Metadata::named(self.name.clone())
    }

    fn data(&self) -> Result<Map<Profile, Dict>, figment::Error> {
        Ok(Profile::Default.collect(self.dict.clone()))
    }
}

/// The layers in precedence order and the source of each key's latest value.
#[derive(Default)]
struct Layers {
    figment: Figment,
    sources: BTreeMap<String, Source>,
}

impl Layers {
    /// Adds a layer (of top-level keys) that overrides those before it. Its engine options
    /// move into the [`ENGINE_TABLE`] table, where [`ServeConfig`] holds them.
    fn push(&mut self, source: Source, mut dict: Dict) {
        for key in dict.keys() {
            self.sources.insert(key.clone(), source.clone());
        }
        let engine: Dict = dict
            .keys()
            .filter(|k| is_engine_key(k))
            .cloned()
            .collect::<Vec<_>>()
            .into_iter()
            .filter_map(|k| dict.remove(&k).map(|v| (k, v)))
            .collect();
        if !engine.is_empty() {
            dict.insert(ENGINE_TABLE.to_string(), Value::from(engine));
        }
        let layer = Layer {
            name: source.to_string(),
            dict,
        };
        self.figment = std::mem::take(&mut self.figment).merge(layer);
    }

    /// Extracts and validates the merged configuration.
    fn finish(self) -> Result<Loaded> {
        let source_of = |key: &str| {
            self.sources
                .get(key)
                .map_or_else(|| "an unknown source".to_string(), Source::describe)
        };
        let config: ServeConfig = self.figment.extract().map_err(|errors| {
            let error = errors
                .into_iter()
                .next()
                .expect("a figment error holds one error");
            // An engine option's path is `engine.KEY`; the user knows it as `KEY`.
            let key = match error.path.as_slice() {
                [table, key, ..] if table == ENGINE_TABLE => Some(key.clone()),
                [key, ..] => Some(key.clone()),
                [] => None,
            };
            let Some(key) = key else {
                return anyhow!("invalid configuration: {}", error.kind);
            };
            let problem = if SECRET_KEYS.contains(&key.as_str()) {
                secret_problem(&error.kind)
            } else {
                error.kind.to_string()
            };
            anyhow!(
                "invalid configuration: `{key}` from {}: {problem}",
                source_of(&key)
            )
        })?;
        if let Err((key, problem)) = config.validate() {
            bail!(
                "invalid configuration: `{key}` from {}: {problem}",
                source_of(&key)
            );
        }
        Ok(Loaded {
            config,
            sources: self.sources,
        })
    }
}

/// A deserialisation problem with a secret value, without the value.
fn secret_problem(kind: &figment::error::Kind) -> String {
    use figment::error::Kind;
    match kind {
        Kind::InvalidType(_, expected) | Kind::InvalidValue(_, expected) => {
            format!("expected {expected} (value not shown: it is secret)")
        }
        _ => "the value is not valid (not shown: it is secret)".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};
    use std::fs;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn dir_with(file: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(DEFAULT_FILE), file).unwrap();
        dir
    }

    fn file_source(dir: &tempfile::TempDir, profile: Option<&str>) -> Source {
        Source::File {
            path: dir.path().join(DEFAULT_FILE),
            profile: profile.map(str::to_string),
        }
    }

    fn error_of(result: Result<Loaded>) -> String {
        format!("{:#}", result.expect_err("expected an error"))
    }

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        flags: ServeFlags,
    }

    #[test]
    fn keys_match_the_struct_in_field_order() {
        // A config with every optional field set serialises every key, in field order.
        let full = ServeConfig {
            model: Some("m".into()),
            served_model_name: Some("n".into()),
            otlp_endpoint: Some("http://x".into()),
            tls_cert: Some("c".into()),
            tls_key: Some("k".into()),
            prefix_cache_dir: Some("p".into()),
            engine: EngineOptions {
                ram: Some("1G".parse().unwrap()),
                pin_budget: Some("1M".parse().unwrap()),
                mla_form: Some(colibri::model::mla::MlaForm::Expanded),
                kv_dtype: Some(colibri::model::cache::KvDType::Bf16),
                vram: Some("1G".parse().unwrap()),
                ..EngineOptions::default()
            },
            ..ServeConfig::default()
        };
        let text = toml::to_string(&full).unwrap();
        let order: Vec<&str> = text
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('['))
            .filter_map(|l| l.split(" = ").next())
            .collect();
        let keys: Vec<&str> = keys().map(|(k, _)| *k).collect();
        assert_eq!(order, keys);
        assert!(text.contains("\n[engine]\n"), "{text}");
    }

    #[test]
    fn defaults_without_file_env_or_flags() {
        let dir = tempfile::tempdir().unwrap();
        let loaded = load_from(&ServeFlags::default(), &[], dir.path()).unwrap();
        let c = &loaded.config;
        assert_eq!(c, &ServeConfig::default());
        assert_eq!(c.model, None);
        assert_eq!(c.slots, 4);
        assert_eq!(c.prefill_chunk, 256);
        assert_eq!(c.queue_limit, 64);
        assert_eq!(c.queue_timeout_secs, 60);
        assert_eq!(c.max_tokens_cap, 4096);
        assert_eq!(c.host, "127.0.0.1");
        assert_eq!(c.port, 8080);
        assert_eq!(c.max_body_bytes, 4_194_304);
        assert_eq!(c.drain_secs, 30);
        assert_eq!(c.history_save_secs, 60);
        assert_eq!((c.header_timeout_secs, c.body_timeout_secs), (75, 60));
        assert!(!c.stay_up_on_load_failure);
        assert_eq!(c.log_level, "info");
        assert!(!c.log_json);
        assert_eq!(loaded.sources.len(), KEYS.len() + ENGINE_KEYS.len());
        assert!(loaded.sources.values().all(|s| *s == Source::Default));
        assert_eq!(ServeConfig::default().validate(), Ok(()));
    }

    #[test]
    fn file_overrides_defaults_and_profile_overrides_file() {
        let dir = dir_with(
            "slots = 8\nport = 9000\napi_keys = [\"a\"]\n\
             [profiles.prod]\nport = 443\nlog_json = true\n\
             [profiles.dev]\nlog_level = \"debug\"\n",
        );
        let loaded = load_from(&ServeFlags::default(), &[], dir.path()).unwrap();
        assert_eq!(loaded.config.slots, 8);
        assert_eq!(loaded.config.port, 9000);
        assert!(!loaded.config.log_json);
        assert_eq!(loaded.sources["port"], file_source(&dir, None));
        assert_eq!(loaded.sources["threads"], Source::Default);

        let flags = ServeFlags {
            profile: Some("prod".into()),
            ..ServeFlags::default()
        };
        let loaded = load_from(&flags, &[], dir.path()).unwrap();
        assert_eq!(loaded.config.port, 443);
        assert_eq!(loaded.config.slots, 8);
        assert!(loaded.config.log_json);
        assert_eq!(loaded.config.log_level, "info");
        assert_eq!(loaded.sources["port"], file_source(&dir, Some("prod")));
        assert_eq!(loaded.sources["slots"], file_source(&dir, None));

        // The profile may also come from the environment.
        let loaded = load_from(
            &ServeFlags::default(),
            &env(&[("COLI_PROFILE", "dev")]),
            dir.path(),
        )
        .unwrap();
        assert_eq!(loaded.config.log_level, "debug");
        assert_eq!(loaded.config.port, 9000);
        assert_eq!(loaded.sources["log_level"], file_source(&dir, Some("dev")));
    }

    #[test]
    fn env_overrides_file_and_flag_overrides_env() {
        let dir = dir_with("port = 9000\nslots = 8\nhost = \"0.0.0.0\"\n");
        let vars = env(&[("COLI_PORT", "9100"), ("COLI_SLOTS", "16")]);
        let loaded = load_from(&ServeFlags::default(), &vars, dir.path()).unwrap();
        assert_eq!(loaded.config.port, 9100);
        assert_eq!(loaded.config.slots, 16);
        assert_eq!(loaded.config.host, "0.0.0.0");
        assert_eq!(loaded.sources["port"], Source::Env("COLI_PORT".into()));
        assert_eq!(loaded.sources["host"], file_source(&dir, None));

        let flags = ServeFlags {
            port: Some(9200),
            ..ServeFlags::default()
        };
        let loaded = load_from(&flags, &vars, dir.path()).unwrap();
        assert_eq!(loaded.config.port, 9200);
        assert_eq!(loaded.config.slots, 16);
        assert_eq!(loaded.sources["port"], Source::Flag("--port".into()));
        assert_eq!(loaded.sources["slots"], Source::Env("COLI_SLOTS".into()));
        assert_eq!(loaded.sources["drain_secs"], Source::Default);
    }

    #[test]
    fn every_flag_is_applied_with_its_source() {
        let cli = Cli::try_parse_from([
            "coli",
            "-m",
            "demo",
            "--served-model-name",
            "tiny",
            "--mirror",
            "/a",
            "--mirror",
            "/b",
            "--ram",
            "6G",
            "--threads",
            "3",
            "--slots",
            "2",
            "--context",
            "512",
            "--prefill-chunk",
            "64",
            "--prefill-budget",
            "96",
            "--queue-limit",
            "5",
            "--queue-timeout-secs",
            "7",
            "--max-tokens-cap",
            "100",
            "--host",
            "::1",
            "--port",
            "0",
            "--api-key",
            "k1",
            "--api-key",
            "k2",
            "--cors-origin",
            "*",
            "--max-body-bytes",
            "2048",
            "--header-timeout-secs",
            "4",
            "--body-timeout-secs",
            "5",
            "--drain-secs",
            "3",
            "--stay-up-on-load-failure",
            "--log-level",
            "warn",
            "--log-json",
            "--otlp-endpoint",
            "http://otel:4318",
            "--otlp-protocol",
            "grpc",
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
            "--history-save-secs",
            "5",
            "--prefix-cache-dir",
            "/state/prefix",
            "--tool-call-format",
            "qwen3_coder",
            "--reasoning-format",
            "none",
            "--plain-text-messages",
            "false",
        ])
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let loaded = load_from(&cli.flags, &[], dir.path()).unwrap();
        let c = &loaded.config;
        assert_eq!(c.model.as_deref(), Some("demo"));
        assert_eq!(c.served_model_name.as_deref(), Some("tiny"));
        assert_eq!(c.engine.mirrors, [PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(c.engine.ram, Some("6G".parse().unwrap()));
        assert_eq!(
            (
                c.engine.threads,
                c.slots,
                c.context,
                c.prefill_chunk,
                c.prefill_budget
            ),
            (3, 2, 512, 64, 96)
        );
        assert_eq!(
            (c.queue_limit, c.queue_timeout_secs, c.max_tokens_cap),
            (5, 7, 100)
        );
        assert_eq!((c.host.as_str(), c.port), ("::1", 0));
        assert_eq!(c.api_keys, ["k1", "k2"]);
        assert_eq!(c.cors_origins, ["*"]);
        assert_eq!((c.max_body_bytes, c.drain_secs), (2048, 3));
        assert_eq!((c.header_timeout_secs, c.body_timeout_secs), (4, 5));
        assert!(c.stay_up_on_load_failure);
        assert_eq!((c.log_level.as_str(), c.log_json), ("warn", true));
        assert_eq!(c.otlp_endpoint.as_deref(), Some("http://otel:4318"));
        assert_eq!(c.otlp_protocol, "grpc");
        assert_eq!(c.tls_cert, Some(PathBuf::from("c.pem")));
        assert_eq!(c.tls_key, Some(PathBuf::from("k.pem")));
        assert_eq!(c.history_save_secs, 5);
        assert_eq!(c.prefix_cache_dir, Some(PathBuf::from("/state/prefix")));
        assert_eq!(c.tool_call_format, ToolCallFormat::Qwen3Coder);
        assert_eq!(c.reasoning_format, ReasoningFormat::None);
        assert!(!c.plain_text_messages);
        assert_eq!(loaded.sources["mirrors"], Source::Flag("--mirror".into()));
        assert_eq!(loaded.sources["api_keys"], Source::Flag("--api-key".into()));
        assert_eq!(
            loaded.sources["served_model_name"],
            Source::Flag("--served-model-name".into())
        );
        // Every server key, and the engine options given.
        let given = KEYS.iter().map(|(k, _)| *k);
        for key in given.chain(["threads", "ram", "mirrors"]) {
            assert!(
                matches!(loaded.sources[key], Source::Flag(_)),
                "{key}: {:?}",
                loaded.sources[key]
            );
        }
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
        #[derive(Parser)]
        struct ConfigCli {
            #[command(flatten)]
            args: ConfigArgs,
        }
        ConfigCli::command().debug_assert();
        let parsed = ConfigCli::try_parse_from(["coli", "--show", "--port", "1"]).unwrap();
        assert!(parsed.args.show);
        assert_eq!(parsed.args.flags.port, Some(1));
    }

    #[test]
    fn source_display() {
        let file = Source::File {
            path: "/x/colibri.toml".into(),
            profile: None,
        };
        let prod = Source::File {
            path: "/x/colibri.toml".into(),
            profile: Some("prod".into()),
        };
        assert_eq!(Source::Default.to_string(), "default");
        assert_eq!(file.to_string(), "file /x/colibri.toml");
        assert_eq!(prod.to_string(), "file /x/colibri.toml [profile prod]");
        assert_eq!(Source::Env("COLI_PORT".into()).to_string(), "env COLI_PORT");
        assert_eq!(Source::Flag("--port".into()).to_string(), "flag --port");
    }

    #[test]
    fn the_tool_call_format_is_a_typed_key() {
        let dir = dir_with("tool_call_format = \"glm45\"\nreasoning_format = \"none\"\n");
        let loaded = load_from(&ServeFlags::default(), &[], dir.path()).unwrap();
        assert_eq!(loaded.config.tool_call_format, ToolCallFormat::Glm45);
        assert_eq!(loaded.config.reasoning_format, ReasoningFormat::None);
        let loaded = load_from(
            &ServeFlags::default(),
            &env(&[("COLI_TOOL_CALL_FORMAT", "deepseek_v31")]),
            dir.path(),
        )
        .unwrap();
        assert_eq!(loaded.config.tool_call_format, ToolCallFormat::DeepseekV31);
        assert_eq!(
            ServeConfig::default().tool_call_format,
            ToolCallFormat::Auto
        );
        let dir = dir_with("tool_call_format = \"glm\"\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], dir.path()));
        assert!(err.contains("tool_call_format"), "{err}");
        assert!(err.contains("glm45"), "{err}");
    }

    #[test]
    fn unknown_key_in_file_names_key_and_file() {
        let dir = dir_with("slots = 2\nslotz = 3\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], dir.path()));
        assert!(err.contains("unknown configuration key `slotz`"), "{err}");
        assert!(
            err.contains(&dir.path().join(DEFAULT_FILE).display().to_string()),
            "{err}"
        );
        assert!(
            err.contains("known keys: model, served_model_name"),
            "{err}"
        );
    }

    #[test]
    fn unknown_key_in_profile_names_profile() {
        // Checked even when the profile is not selected.
        let dir = dir_with("port = 1\n[profiles.prod]\nprot = 2\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], dir.path()));
        assert!(err.contains("unknown configuration key `prot`"), "{err}");
        assert!(err.contains("profile `prod`"), "{err}");
        assert!(
            err.contains(&dir.path().join(DEFAULT_FILE).display().to_string()),
            "{err}"
        );
    }

    #[test]
    fn unknown_coli_variable_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = error_of(load_from(
            &ServeFlags::default(),
            &env(&[("COLI_SLOTZ", "3")]),
            dir.path(),
        ));
        assert!(
            err.contains("unknown configuration key `slotz` from environment variable COLI_SLOTZ"),
            "{err}"
        );
        assert!(err.contains("known keys: "), "{err}");
    }

    #[test]
    fn other_variables_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let vars = env(&[
            ("COLI_LOG", "debug"),
            ("COLI_ISA", "avx2"),
            ("COLI_CACHE_DIR", "/c"),
            ("COLI_STATE_DIR", "/s"),
            ("COLI_TEST_CACHE", "/t"),
            ("COLI_TEST_ANYTHING", "1"),
            ("COLI_CI_LLAMA_CPP", "/l"),
            ("COLI_LLAMA_CPP_PYTHON", "python3"),
            ("PATH", "/bin"),
            ("COLIBRI_X", "1"),
            ("COLI_LOG_LEVEL", "warn"),
        ]);
        let loaded = load_from(&ServeFlags::default(), &vars, dir.path()).unwrap();
        assert_eq!(loaded.config.log_level, "warn");
        assert_eq!(
            loaded.sources["log_level"],
            Source::Env("COLI_LOG_LEVEL".into())
        );
    }

    #[test]
    fn missing_profile_lists_available_ones() {
        let dir = dir_with("[profiles.prod]\nport = 1\n[profiles.dev]\nport = 2\n");
        let flags = ServeFlags {
            profile: Some("staging".into()),
            ..ServeFlags::default()
        };
        let err = error_of(load_from(&flags, &[], dir.path()));
        assert!(err.contains("profile `staging`"), "{err}");
        assert!(err.contains("flag --profile"), "{err}");
        assert!(err.contains("available profiles: dev, prod"), "{err}");

        let dir = dir_with("port = 1\n");
        let err = error_of(load_from(
            &ServeFlags::default(),
            &env(&[("COLI_PROFILE", "prod")]),
            dir.path(),
        ));
        assert!(err.contains("profile `prod`"), "{err}");
        assert!(err.contains("defines no profiles"), "{err}");

        let empty = tempfile::tempdir().unwrap();
        let err = error_of(load_from(&flags, &[], empty.path()));
        assert!(err.contains("no configuration file"), "{err}");
    }

    #[test]
    fn out_of_range_value_in_file_names_key_and_source() {
        let dir = dir_with("slots = 0\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], dir.path()));
        let file = dir.path().join(DEFAULT_FILE).display().to_string();
        assert!(err.contains("`slots`"), "{err}");
        assert!(err.contains(&format!("file {file}")), "{err}");
        assert!(
            err.contains("expected a number from 1 to 256, found 0"),
            "{err}"
        );

        let dir = dir_with("[profiles.p]\nmax_body_bytes = 10\n");
        let flags = ServeFlags {
            profile: Some("p".into()),
            ..ServeFlags::default()
        };
        let err = error_of(load_from(&flags, &[], dir.path()));
        assert!(
            err.contains("`max_body_bytes` from profile `p` of file"),
            "{err}"
        );
        assert!(err.contains("at least 1024"), "{err}");
    }

    #[test]
    fn wrong_type_names_key_source_and_expectation() {
        let dir = tempfile::tempdir().unwrap();
        let err = error_of(load_from(
            &ServeFlags::default(),
            &env(&[("COLI_PORT", "abc")]),
            dir.path(),
        ));
        assert!(
            err.contains("`port` from environment variable COLI_PORT"),
            "{err}"
        );
        assert!(err.contains("expected u16"), "{err}");

        let err = error_of(load_from(
            &ServeFlags::default(),
            &env(&[("COLI_PORT", "70000")]),
            dir.path(),
        ));
        assert!(
            err.contains("`port` from environment variable COLI_PORT"),
            "{err}"
        );
        assert!(err.contains("70000"), "{err}");

        let file = dir_with("threads = \"four\"\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], file.path()));
        assert!(err.contains("`threads` from file"), "{err}");
        assert!(err.contains("expected usize"), "{err}");

        let file = dir_with("api_keys = \"hunter2\"\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], file.path()));
        assert!(err.contains("`api_keys` from file"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn invalid_flag_value_names_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let flags = ServeFlags {
            host: Some("localhost".into()),
            ..ServeFlags::default()
        };
        let err = error_of(load_from(&flags, &[], dir.path()));
        assert!(err.contains("`host` from flag --host"), "{err}");
        assert!(err.contains("expected an IP address"), "{err}");

        let flags = ServeFlags {
            tls_cert: Some("c.pem".into()),
            ..ServeFlags::default()
        };
        let err = error_of(load_from(&flags, &[], dir.path()));
        assert!(err.contains("`tls_cert` from flag --tls-cert"), "{err}");
        assert!(err.contains("tls_key is not"), "{err}");
    }

    #[test]
    fn validate_checks_each_rule() {
        let bad = |f: fn(&mut ServeConfig)| {
            let mut c = ServeConfig::default();
            f(&mut c);
            c.validate().expect_err("expected invalid").0
        };
        assert_eq!(bad(|c| c.slots = 257), "slots");
        assert_eq!(bad(|c| c.prefill_chunk = 0), "prefill_chunk");
        assert_eq!(bad(|c| c.queue_limit = 0), "queue_limit");
        assert_eq!(bad(|c| c.max_tokens_cap = 0), "max_tokens_cap");
        assert_eq!(bad(|c| c.max_body_bytes = 1023), "max_body_bytes");
        assert_eq!(bad(|c| c.header_timeout_secs = 0), "header_timeout_secs");
        assert_eq!(bad(|c| c.body_timeout_secs = 0), "body_timeout_secs");
        assert_eq!(
            bad(|c| c.body_timeout_secs = MAX_TIMEOUT_SECS + 1),
            "body_timeout_secs"
        );
        assert_eq!(bad(|c| c.log_level = "verbose".into()), "log_level");
        assert_eq!(bad(|c| c.engine.io_threads = 0), "io_threads");
        assert_eq!(
            bad(|c| c.api_keys = vec!["a".into(), String::new()]),
            "api_keys"
        );
        assert_eq!(
            bad(|c| c.otlp_endpoint = Some("otel:4318".into())),
            "otlp_endpoint"
        );
        assert_eq!(bad(|c| c.otlp_protocol = "http".into()), "otlp_protocol");
        assert_eq!(bad(|c| c.otlp_protocol = "gRPC".into()), "otlp_protocol");
        assert_eq!(
            bad(|c| c.cors_origins = vec!["example.com".into()]),
            "cors_origins"
        );
        assert_eq!(bad(|c| c.tls_key = Some("k".into())), "tls_key");
        assert_eq!(bad(|c| c.model = Some(String::new())), "model");
        assert_eq!(bad(|c| c.history_save_secs = 0), "history_save_secs");

        let mut ok = ServeConfig {
            slots: 256,
            max_body_bytes: 1024,
            host: "::".into(),
            port: 0,
            cors_origins: vec!["*".into(), "https://a.example".into()],
            otlp_endpoint: Some("https://otel".into()),
            tls_cert: Some("c".into()),
            tls_key: Some("k".into()),
            header_timeout_secs: 1,
            body_timeout_secs: MAX_TIMEOUT_SECS,
            ..ServeConfig::default()
        };
        for ram in ["6G", "512m", "6GiB", "6gb", "1024", "1.5G", "100B", "2T"] {
            ok.engine.ram = Some(ram.parse().unwrap());
            assert_eq!(ok.validate(), Ok(()), "{ram}");
        }
        for ram in ["", "6 G", "G6", "6GG", "6iB", "1.G", "1..5G", "-1G"] {
            assert!(!crate::engine_options::is_size(ram), "{ram}");
        }
    }

    #[test]
    fn list_variables_split_on_commas_or_read_as_arrays() {
        let dir = tempfile::tempdir().unwrap();
        let vars = env(&[
            ("COLI_API_KEYS", "a, b,c"),
            ("COLI_CORS_ORIGINS", r#"["https://x.example", "*"]"#),
            ("COLI_MIRRORS", "/d1,/d2"),
            ("COLI_LOG_JSON", "true"),
            ("COLI_MAX_BODY_BYTES", "2048"),
            ("COLI_STAY_UP_ON_LOAD_FAILURE", "yes"),
            ("COLI_HEADER_TIMEOUT_SECS", "9"),
        ]);
        let loaded = load_from(&ServeFlags::default(), &vars, dir.path()).unwrap();
        assert_eq!(loaded.config.api_keys, ["a", "b", "c"]);
        assert_eq!(loaded.config.cors_origins, ["https://x.example", "*"]);
        assert_eq!(
            loaded.config.engine.mirrors,
            [PathBuf::from("/d1"), PathBuf::from("/d2")]
        );
        assert!(loaded.config.log_json);
        assert_eq!(loaded.config.max_body_bytes, 2048);
        assert!(loaded.config.stay_up_on_load_failure);
        assert_eq!(loaded.config.header_timeout_secs, 9);
        assert_eq!(
            loaded.sources["api_keys"],
            Source::Env("COLI_API_KEYS".into())
        );

        // An empty variable is unset: the file's keys stay. `[]` clears the list.
        let file = dir_with("api_keys = [\"x\"]\n");
        let loaded = load_from(
            &ServeFlags::default(),
            &env(&[("COLI_API_KEYS", "")]),
            file.path(),
        )
        .unwrap();
        assert_eq!(loaded.config.api_keys, vec!["x".to_string()]);
        let loaded = load_from(
            &ServeFlags::default(),
            &env(&[("COLI_API_KEYS", "[]")]),
            file.path(),
        )
        .unwrap();
        assert!(loaded.config.api_keys.is_empty());

        let err = error_of(load_from(
            &ServeFlags::default(),
            &env(&[("COLI_API_KEYS", "[\"a\", ")]),
            dir.path(),
        ));
        assert!(
            err.contains("`api_keys` from environment variable COLI_API_KEYS"),
            "{err}"
        );
        assert!(err.contains("not an array literal"), "{err}");
    }

    #[test]
    fn show_masks_secrets_and_names_sources() {
        let dir = dir_with("api_keys = [\"s3cret\", \"t0ken\"]\nmodel = \"/m\"\n");
        let flags = ServeFlags {
            port: Some(9000),
            ..ServeFlags::default()
        };
        let loaded = load_from(&flags, &env(&[("COLI_SLOTS", "8")]), dir.path()).unwrap();
        let shown = loaded.show();
        let file = dir.path().join(DEFAULT_FILE).display().to_string();
        assert!(
            !shown.contains("s3cret") && !shown.contains("t0ken"),
            "{shown}"
        );
        assert!(
            shown.contains(&format!("api_keys = [\"***\", \"***\"]  # file {file}\n")),
            "{shown}"
        );
        assert!(
            shown.contains(&format!("model = \"/m\"  # file {file}\n")),
            "{shown}"
        );
        assert!(shown.contains("port = 9000  # flag --port\n"), "{shown}");
        assert!(shown.contains("slots = 8  # env COLI_SLOTS\n"), "{shown}");
        assert!(
            shown.contains("host = \"127.0.0.1\"  # default\n"),
            "{shown}"
        );
        assert!(shown.contains("# ram = (unset)  # default\n"), "{shown}");
        assert_eq!(shown.lines().count(), KEYS.len() + ENGINE_KEYS.len());
        assert!(shown.starts_with("model = "), "{shown}");
        assert!(shown.ends_with("# vram = (unset)  # default\n"), "{shown}");
        // The output is valid TOML.
        toml::from_str::<toml::Table>(&shown).unwrap();
        assert!(!format!("{:?}", loaded.config).contains("s3cret"));
    }

    #[test]
    fn explicit_config_file_must_exist() {
        let dir = tempfile::tempdir().unwrap();
        let flags = ServeFlags {
            config: Some("nope.toml".into()),
            ..ServeFlags::default()
        };
        let err = error_of(load_from(&flags, &[], dir.path()));
        assert!(err.contains("nope.toml"), "{err}");
        assert!(err.contains("does not exist"), "{err}");
        assert!(err.contains("flag --config"), "{err}");

        let err = error_of(load_from(
            &ServeFlags::default(),
            &env(&[("COLI_CONFIG", "/no/such/file.toml")]),
            dir.path(),
        ));
        assert!(err.contains("/no/such/file.toml"), "{err}");
        assert!(err.contains("environment variable COLI_CONFIG"), "{err}");
    }

    #[test]
    fn explicit_config_file_is_read_instead_of_the_default_one() {
        let dir = dir_with("port = 1111\n");
        fs::write(dir.path().join("other.toml"), "port = 2222\n").unwrap();
        let flags = ServeFlags {
            config: Some("other.toml".into()),
            ..ServeFlags::default()
        };
        let loaded = load_from(&flags, &[], dir.path()).unwrap();
        assert_eq!(loaded.config.port, 2222);
        assert_eq!(
            loaded.sources["port"],
            Source::File {
                path: dir.path().join("other.toml"),
                profile: None
            }
        );
        let loaded = load_from(
            &ServeFlags::default(),
            &env(&[("COLI_CONFIG", "other.toml")]),
            dir.path(),
        )
        .unwrap();
        assert_eq!(loaded.config.port, 2222);
    }

    #[test]
    fn malformed_file_is_an_error_naming_it() {
        let dir = dir_with("port = \n");
        let err = error_of(load_from(&ServeFlags::default(), &[], dir.path()));
        assert!(err.contains("cannot parse configuration file"), "{err}");
        assert!(err.contains(DEFAULT_FILE), "{err}");

        let dir = dir_with("profiles = 3\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], dir.path()));
        assert!(err.contains("`profiles`"), "{err}");
    }

    #[test]
    fn engine_options_from_file_env_and_flags_with_their_sources() {
        use colibri::model::cache::KvDType;
        use colibri::model::mla::MlaForm;
        use colibri::model::Draft;
        use colibri::store::reader::ReaderKind;
        use colibri::store::CachePolicy;
        let dir = dir_with(
            "io = \"pool\"\ndirect_io = true\ncache_policy = \"lfru\"\npin_budget = \"512M\"\n\
             [profiles.mla]\nmla_form = \"expanded\"\nkv_dtype = \"bf16\"\n",
        );
        let flags = ServeFlags {
            profile: Some("mla".into()),
            ..ServeFlags::default()
        };
        let vars = env(&[
            ("COLI_IO_THREADS", "2"),
            ("COLI_NO_LEARN", "yes"),
            ("COLI_NO_PREFETCH", "1"),
            ("COLI_MIRRORS", "/d1,/d2"),
            ("COLI_MIRROR_WEIGHTS", "1.5, 2"),
            ("COLI_RAM", "6G"),
        ]);
        let loaded = load_from(&flags, &vars, dir.path()).unwrap();
        let e = &loaded.config.engine;
        assert_eq!(e.io, ReaderKind::Pool);
        assert!(e.direct_io);
        assert_eq!(e.cache_policy, CachePolicy::Lfru);
        assert_eq!(e.pin_budget.as_ref().map(|s| s.bytes), Some(512 << 20));
        assert_eq!(e.mla_form, Some(MlaForm::Expanded));
        assert_eq!(e.kv_dtype, Some(KvDType::Bf16));
        assert_eq!((e.io_threads, e.no_learn, e.no_prefetch), (2, true, true));
        assert_eq!(e.mirror_weights, [1.5, 2.0]);
        assert_eq!(e.ram.as_ref().map(|s| s.bytes), Some(6 << 30));
        assert_eq!(e.draft, Draft::None);
        assert_eq!(loaded.sources["io"], file_source(&dir, None));
        assert_eq!(loaded.sources["mla_form"], file_source(&dir, Some("mla")));
        assert_eq!(
            loaded.sources["io_threads"],
            Source::Env("COLI_IO_THREADS".into())
        );
        assert_eq!(loaded.sources["draft"], Source::Default);
        let shown = loaded.show();
        let file = dir.path().join(DEFAULT_FILE).display().to_string();
        for line in [
            format!("io = \"pool\"  # file {file}\n"),
            format!("direct_io = true  # file {file}\n"),
            format!("cache_policy = \"lfru\"  # file {file}\n"),
            format!("pin_budget = \"512M\"  # file {file}\n"),
            format!("mla_form = \"expanded\"  # file {file} [profile mla]\n"),
            format!("kv_dtype = \"bf16\"  # file {file} [profile mla]\n"),
            "io_threads = 2  # env COLI_IO_THREADS\n".to_string(),
            "mirror_weights = [1.5, 2.0]  # env COLI_MIRROR_WEIGHTS\n".to_string(),
            "ram = \"6G\"  # env COLI_RAM\n".to_string(),
            "draft = \"none\"  # default\n".to_string(),
            "mmap = false  # default\n".to_string(),
        ] {
            assert!(shown.contains(&line), "{line} in:\n{shown}");
        }
        toml::from_str::<toml::Table>(&shown).unwrap();

        // Flags win over both.
        let cli = Cli::try_parse_from([
            "coli",
            "--profile",
            "mla",
            "--io",
            "uring",
            "--cache-policy",
            "LRU",
            "--mla-form",
            "absorbed",
            "--kv-dtype",
            "f32",
            "--draft",
            "mtp",
            "--io-threads",
            "3",
            "--pin-budget",
            "1G",
            "--mmap",
            "--mirror-weights",
            "1,3",
        ])
        .unwrap();
        let vars = env(&[("COLI_MIRRORS", "/d1,/d2")]);
        let loaded = load_from(&cli.flags, &vars, dir.path()).unwrap();
        let e = &loaded.config.engine;
        assert_eq!(e.io, ReaderKind::Uring);
        assert_eq!(e.cache_policy, CachePolicy::Lru);
        assert_eq!(e.mla_form, Some(MlaForm::Absorbed));
        assert_eq!(e.kv_dtype, Some(KvDType::F32));
        assert_eq!((e.draft, e.io_threads, e.mmap), (Draft::Mtp, 3, true));
        assert_eq!(e.mirror_weights, [1.0, 3.0]);
        assert_eq!(loaded.sources["io"], Source::Flag("--io".into()));
        assert_eq!(loaded.sources["mmap"], Source::Flag("--mmap".into()));
        assert!(loaded.show().contains("draft = \"mtp\"  # flag --draft\n"));
    }

    #[test]
    fn a_bad_engine_value_names_the_key_its_source_and_the_valid_values() {
        let dir = tempfile::tempdir().unwrap();
        let err = error_of(load_from(
            &ServeFlags::default(),
            &env(&[("COLI_IO", "fast")]),
            dir.path(),
        ));
        assert!(
            err.contains("`io` from environment variable COLI_IO"),
            "{err}"
        );
        assert!(
            err.contains("auto") && err.contains("uring") && err.contains("pool"),
            "{err}"
        );
        let file = dir_with("kv_dtype = \"f16\"\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], file.path()));
        assert!(err.contains("`kv_dtype` from file"), "{err}");
        assert!(err.contains("f32") && err.contains("bf16"), "{err}");
        let file = dir_with("pin_budget = \"lots\"\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], file.path()));
        assert!(err.contains("`pin_budget` from file"), "{err}");
        assert!(err.contains("expected a size such as 512M"), "{err}");
        let file = dir_with("cache_policy = \"fifo\"\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], file.path()));
        assert!(
            err.contains("`cache_policy`") && err.contains("lfru"),
            "{err}"
        );
        let file = dir_with("draft = \"eagle\"\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], file.path()));
        assert!(err.contains("`draft`") && err.contains("mtp"), "{err}");
        let file = dir_with("mla_form = 3\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], file.path()));
        assert!(err.contains("`mla_form`"), "{err}");
        // Checks beyond the types, with the source.
        let file = dir_with("ram = \"1G\"\nmmap = true\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], file.path()));
        assert!(err.contains("`mmap` from file"), "{err}");
        let err = error_of(load_from(
            &ServeFlags::default(),
            &env(&[("COLI_MIRROR_WEIGHTS", "1,2")]),
            dir.path(),
        ));
        assert!(
            err.contains("`mirror_weights` from environment variable COLI_MIRROR_WEIGHTS"),
            "{err}"
        );
        // A misspelt engine key is an unknown key like any other.
        let file = dir_with("io_thread = 2\n");
        let err = error_of(load_from(&ServeFlags::default(), &[], file.path()));
        assert!(
            err.contains("unknown configuration key `io_thread`"),
            "{err}"
        );
        assert!(err.contains("io_threads"), "{err}");
        // A flag's value set is clap's, from the same enum.
        let err = Cli::try_parse_from(["coli", "--io", "fast"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("possible values: auto, uring, pool"), "{err}");
    }

    #[test]
    fn computing_commands_take_the_engine_options_from_flags() {
        #[derive(Parser)]
        struct Run {
            #[command(flatten)]
            model: crate::model_arg::ModelArgs,
        }
        Run::command().debug_assert();
        let run = Run::try_parse_from([
            "coli",
            "-m",
            "demo",
            "--io",
            "pool",
            "--direct-io",
            "--kv-dtype",
            "bf16",
            "--ram",
            "2G",
        ])
        .unwrap();
        let o = run.model.options().unwrap();
        assert_eq!(o.io, colibri::store::reader::ReaderKind::Pool);
        assert!(o.direct_io);
        assert_eq!(o.kv_dtype, Some(colibri::model::cache::KvDType::Bf16));
        assert_eq!(o.ram_budget(None), Some(2 << 30));
        let defaults = Run::try_parse_from(["coli", "-m", "demo"]).unwrap();
        assert_eq!(defaults.model.options().unwrap(), EngineOptions::default());
        let bad = Run::try_parse_from(["coli", "-m", "demo", "--mirror-weights", "2"]).unwrap();
        let err = format!("{:#}", bad.model.options().unwrap_err());
        assert!(
            err.contains("`mirror_weights` from flag --mirror-weights"),
            "{err}"
        );
        assert!(Run::try_parse_from(["coli", "-m", "x", "--mmap", "--ram", "1G"]).is_err());
    }
}
