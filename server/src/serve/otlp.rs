//! OpenTelemetry export: one span per request, sent to an OTLP/HTTP collector as JSON
//! (`POST {endpoint}/v1/traces`, the OTLP JSON encoding of `ExportTraceServiceRequest`) when
//! `otlp_endpoint` is configured. Spans are queued without blocking the request and sent in
//! batches by a task of their own; a collector that is down costs a warning, never a request.
//! Plain `http://` only (run the collector, or a sidecar, next to the server).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

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
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<(&'static str, Attr)>,
    /// The error message of a failed request.
    pub error: Option<String>,
}

/// Sends spans to a collector.
#[derive(Clone)]
pub struct Exporter {
    tx: mpsc::UnboundedSender<SpanRecord>,
}

/// Where to send: host, port and path of `{endpoint}/v1/traces`.
#[derive(Debug, Clone, PartialEq)]
struct Target {
    host: String,
    port: u16,
    path: String,
}

fn parse_endpoint(endpoint: &str) -> Result<Target> {
    let Some(rest) = endpoint.strip_prefix("http://") else {
        bail!(
            "otlp_endpoint `{endpoint}`: only http:// collectors are supported (run the collector or a sidecar next to the server)"
        );
    };
    let (authority, base) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (
            h.to_string(),
            p.parse()
                .with_context(|| format!("otlp_endpoint `{endpoint}`: bad port `{p}`"))?,
        ),
        None => (authority.to_string(), 4318),
    };
    if host.is_empty() {
        bail!("otlp_endpoint `{endpoint}`: no host");
    }
    Ok(Target {
        host,
        port,
        path: format!("{base}/v1/traces"),
    })
}

impl Exporter {
    /// Start the sending task on the current tokio runtime.
    pub fn start(endpoint: &str) -> Result<Exporter> {
        let target = parse_endpoint(endpoint)?;
        let (tx, mut rx) = mpsc::unbounded_channel::<SpanRecord>();
        tokio::spawn(async move {
            let mut warned = false;
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                while batch.len() < 256 {
                    match rx.try_recv() {
                        Ok(s) => batch.push(s),
                        Err(_) => break,
                    }
                }
                let body = encode(&batch).to_string();
                match post(&target, &body).await {
                    Ok(()) => warned = false,
                    Err(e) if !warned => {
                        tracing::warn!(
                            "OTLP export to {}:{}{} failed: {e:#} (further failures are not logged until one succeeds)",
                            target.host,
                            target.port,
                            target.path
                        );
                        warned = true;
                    }
                    Err(_) => {}
                }
            }
        });
        Ok(Exporter { tx })
    }

    /// Queue a span (never blocks).
    pub fn record(&self, span: SpanRecord) {
        let _ = self.tx.send(span);
    }
}

fn nanos(t: SystemTime) -> String {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos()
        .to_string()
}

/// Random hex id of `bytes` bytes.
fn random_hex(bytes: usize) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut out = String::new();
    while out.len() < bytes * 2 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out.truncate(bytes * 2);
    out
}

/// The OTLP JSON body for `spans`.
fn encode(spans: &[SpanRecord]) -> Value {
    let spans: Vec<Value> = spans
        .iter()
        .map(|s| {
            let attributes: Vec<Value> = s
                .attributes
                .iter()
                .map(|(k, v)| {
                    let value = match v {
                        Attr::Str(x) => json!({ "stringValue": x }),
                        Attr::Int(x) => json!({ "intValue": x.to_string() }),
                        Attr::Float(x) => json!({ "doubleValue": x }),
                    };
                    json!({ "key": k, "value": value })
                })
                .collect();
            let status = match &s.error {
                None => json!({ "code": 1 }),
                Some(m) => json!({ "code": 2, "message": m }),
            };
            json!({
                "traceId": random_hex(16),
                "spanId": random_hex(8),
                "name": s.name,
                "kind": 2,
                "startTimeUnixNano": nanos(s.start),
                "endTimeUnixNano": nanos(s.end),
                "attributes": attributes,
                "status": status,
            })
        })
        .collect();
    json!({
        "resourceSpans": [{
            "resource": { "attributes": [
                { "key": "service.name", "value": { "stringValue": "colibri" } },
                { "key": "service.version", "value": { "stringValue": env!("CARGO_PKG_VERSION") } }
            ]},
            "scopeSpans": [{
                "scope": { "name": "coli-serve" },
                "spans": spans
            }]
        }]
    })
}

async fn post(target: &Target, body: &str) -> Result<()> {
    let connect = tokio::net::TcpStream::connect((target.host.as_str(), target.port));
    let mut stream = tokio::time::timeout(Duration::from_secs(5), connect)
        .await
        .context("connecting timed out")?
        .context("connecting")?;
    let request = format!(
        "POST {} HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        target.path,
        target.host,
        target.port,
        body.len(),
        body
    );
    stream.write_all(request.as_bytes()).await?;
    let mut head = vec![0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut head))
        .await
        .context("waiting for the collector's answer timed out")??;
    let line = String::from_utf8_lossy(&head[..n]);
    let status = line.split_whitespace().nth(1).unwrap_or("");
    if !status.starts_with('2') {
        bail!(
            "the collector answered `{}`",
            line.lines().next().unwrap_or("")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_with_default_port_and_base_path() {
        assert_eq!(
            parse_endpoint("http://collector:4318").unwrap(),
            Target {
                host: "collector".into(),
                port: 4318,
                path: "/v1/traces".into()
            }
        );
        assert_eq!(
            parse_endpoint("http://127.0.0.1/otel/").unwrap(),
            Target {
                host: "127.0.0.1".into(),
                port: 4318,
                path: "/otel/v1/traces".into()
            }
        );
        let e = parse_endpoint("https://x:4318").unwrap_err().to_string();
        assert!(e.contains("only http://"), "{e}");
        assert!(parse_endpoint("http://x:notaport").is_err());
    }

    #[test]
    fn spans_encode_as_otlp_json() {
        let start = UNIX_EPOCH + Duration::from_secs(10);
        let body = encode(&[SpanRecord {
            name: "POST /v1/completions".into(),
            start,
            end: start + Duration::from_millis(1500),
            attributes: vec![
                ("coli.slot", Attr::Int(3)),
                ("coli.id", Attr::Str("cmpl-1".into())),
            ],
            error: None,
        }]);
        let span = &body["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(span["name"], "POST /v1/completions");
        assert_eq!(span["startTimeUnixNano"], "10000000000");
        assert_eq!(span["endTimeUnixNano"], "11500000000");
        assert_eq!(span["traceId"].as_str().unwrap().len(), 32);
        assert_eq!(span["spanId"].as_str().unwrap().len(), 16);
        assert_eq!(span["attributes"][0]["key"], "coli.slot");
        assert_eq!(span["attributes"][0]["value"]["intValue"], "3");
        assert_eq!(span["attributes"][1]["value"]["stringValue"], "cmpl-1");
        assert_eq!(span["status"]["code"], 1);
    }
}
