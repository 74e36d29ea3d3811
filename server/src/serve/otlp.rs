//! OpenTelemetry export: one span per request, sent to an OTLP collector through the
//! `opentelemetry` SDK and its OTLP exporter when `otlp_endpoint` is configured.
//!
//! This module owns the span of a request: its parent (the W3C `traceparent`/`tracestate`
//! headers of the incoming request, read with [`TraceContextPropagator`], so a request's span
//! is a child of the caller's trace), its attributes and status, and the exporter: OTLP/HTTP
//! with protobuf (`http/protobuf`, the default) or JSON (`http/json`) bodies to
//! `{otlp_endpoint}/v1/traces`, or OTLP/gRPC (`grpc`) to `otlp_endpoint`; `https://`
//! endpoints use TLS (rustls, the system's trust store). Spans are queued without blocking the
//! request and sent in batches by the SDK's batch processor (every 5 s by default; the SDK's
//! `OTEL_BSP_*` variables tune it) and at shutdown; a collector that is down costs a warning
//! from the SDK, never a request.

use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result};
use axum::http::HeaderMap;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

/// How long one export may take before the SDK gives up on it.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// The OTLP transport, as the `otlp_protocol` key spells it (the values of the OpenTelemetry
/// `OTEL_EXPORTER_OTLP_PROTOCOL` variable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP/HTTP, protobuf bodies, `POST {endpoint}/v1/traces`.
    HttpProtobuf,
    /// OTLP/HTTP, JSON bodies, `POST {endpoint}/v1/traces`.
    HttpJson,
    /// OTLP/gRPC to `{endpoint}` (`TraceService/Export`).
    Grpc,
}

impl OtlpProtocol {
    /// Every accepted spelling, for error messages.
    pub const NAMES: &'static [&'static str] = &["http/protobuf", "http/json", "grpc"];

    /// The protocol `name` spells, if it is one of [`Self::NAMES`].
    pub fn parse(name: &str) -> Option<OtlpProtocol> {
        match name {
            "http/protobuf" => Some(OtlpProtocol::HttpProtobuf),
            "http/json" => Some(OtlpProtocol::HttpJson),
            "grpc" => Some(OtlpProtocol::Grpc),
            _ => None,
        }
    }
}

/// An attribute value.
#[derive(Debug, Clone)]
pub enum Attr {
    Str(String),
    Int(i64),
    Float(f64),
}

/// One finished request, as a span.
#[derive(Debug, Clone)]
pub struct SpanRecord {
    /// e.g. `POST /v1/chat/completions`.
    pub name: String,
    /// The caller's trace context (see [`parent_context`]); the span becomes its child.
    pub parent: Context,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<(&'static str, Attr)>,
    /// The error message of a failed request.
    pub error: Option<String>,
}

/// The trace context of an incoming request: its W3C `traceparent` (and `tracestate`)
/// headers, or an empty context (a new trace) when there are none or they are malformed.
pub fn parent_context(headers: &HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&HeaderExtractor(headers))
}

/// Reads propagation headers out of an [`HeaderMap`].
struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The URL the HTTP exporter posts to: the configured base with `/v1/traces` appended (as the
/// OpenTelemetry specification does for `OTEL_EXPORTER_OTLP_ENDPOINT`).
fn traces_url(endpoint: &str) -> String {
    format!("{}/v1/traces", endpoint.trim_end_matches('/'))
}

/// Sends spans to a collector.
pub struct Exporter {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl Exporter {
    /// Build the exporter and its batch processor. Must run inside the tokio runtime (the gRPC
    /// channel lives on it); the HTTP client runs on a thread of its own.
    pub fn start(endpoint: &str, protocol: OtlpProtocol) -> Result<Exporter> {
        // reqwest's rustls takes the process's provider: ring (a no-op when already set).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let builder = opentelemetry_otlp::SpanExporter::builder();
        let exporter = match protocol {
            OtlpProtocol::HttpProtobuf | OtlpProtocol::HttpJson => {
                // A blocking client, made off the runtime's threads (it owns a runtime of its
                // own, which must not be created or dropped on an async thread), with the TLS
                // roots of the system.
                let client = std::thread::spawn(|| {
                    reqwest::blocking::Client::builder()
                        .timeout(EXPORT_TIMEOUT)
                        .build()
                })
                .join()
                .map_err(|_| anyhow::anyhow!("building the OTLP HTTP client panicked"))?
                .context("building the OTLP HTTP client")?;
                builder
                    .with_http()
                    .with_http_client(client)
                    .with_protocol(if protocol == OtlpProtocol::HttpJson {
                        Protocol::HttpJson
                    } else {
                        Protocol::HttpBinary
                    })
                    .with_endpoint(traces_url(endpoint))
                    .with_timeout(EXPORT_TIMEOUT)
                    .build()
            }
            OtlpProtocol::Grpc => {
                let mut b = builder
                    .with_tonic()
                    .with_protocol(Protocol::Grpc)
                    .with_endpoint(endpoint)
                    .with_timeout(EXPORT_TIMEOUT);
                if endpoint.starts_with("https://") {
                    b = b.with_tls_config(
                        opentelemetry_otlp::tonic_types::transport::ClientTlsConfig::new()
                            .with_native_roots(),
                    );
                }
                b.build()
            }
        }
        .with_context(|| format!("otlp_endpoint `{endpoint}`: setting up the OTLP exporter"))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(
                Resource::builder()
                    .with_service_name("colibri")
                    .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                    .build(),
            )
            .build();
        let tracer = provider.tracer("coli-serve");
        Ok(Exporter { provider, tracer })
    }

    /// Queue a finished request's span (never blocks; a full queue drops it).
    pub fn record(&self, span: SpanRecord) {
        let attributes: Vec<KeyValue> = span
            .attributes
            .into_iter()
            .map(|(k, v)| match v {
                Attr::Str(s) => KeyValue::new(k, s),
                Attr::Int(i) => KeyValue::new(k, i),
                Attr::Float(f) => KeyValue::new(k, f),
            })
            .collect();
        let mut s = self
            .tracer
            .span_builder(span.name)
            .with_kind(SpanKind::Server)
            .with_start_time(span.start)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &span.parent);
        s.set_status(match span.error {
            None => Status::Ok,
            Some(m) => Status::error(m),
        });
        s.end_with_timestamp(span.end);
    }

    /// Export what is queued and stop; blocks until the collector answered or timed out, so
    /// call it off the async threads (e.g. in `spawn_blocking`).
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            eprintln!("coli: warning: flushing the OTLP spans at shutdown: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::TraceContextExt;

    #[test]
    fn protocols_parse_by_their_opentelemetry_names() {
        assert_eq!(
            OtlpProtocol::parse("http/protobuf"),
            Some(OtlpProtocol::HttpProtobuf)
        );
        assert_eq!(
            OtlpProtocol::parse("http/json"),
            Some(OtlpProtocol::HttpJson)
        );
        assert_eq!(OtlpProtocol::parse("grpc"), Some(OtlpProtocol::Grpc));
        assert_eq!(OtlpProtocol::parse("http"), None);
        assert_eq!(OtlpProtocol::parse("GRPC"), None);
    }

    #[test]
    fn the_traces_path_is_appended_to_the_base() {
        assert_eq!(
            traces_url("http://collector:4318"),
            "http://collector:4318/v1/traces"
        );
        assert_eq!(traces_url("https://x/otel/"), "https://x/otel/v1/traces");
    }

    #[test]
    fn the_parent_comes_from_traceparent() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
                .parse()
                .unwrap(),
        );
        let cx = parent_context(&headers);
        let span = cx.span();
        let sc = span.span_context();
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(
            sc.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(sc.span_id().to_string(), "00f067aa0ba902b7");

        // Missing or malformed: a new trace (no valid parent).
        assert!(!parent_context(&HeaderMap::new())
            .span()
            .span_context()
            .is_valid());
        headers.insert("traceparent", "00-zz-00f067aa0ba902b7-01".parse().unwrap());
        assert!(!parent_context(&headers).span().span_context().is_valid());
    }
}
