//! Traces and TLS of `coli serve`, end to end against the committed llama fixture: a chat
//! request's span reaches an OTLP collector written here (OTLP/HTTP with protobuf bodies,
//! OTLP/HTTP with JSON bodies over `https://`, and OTLP/gRPC), as a child of the request's W3C
//! `traceparent`; and `tls_cert`/`tls_key` serve HTTPS with a self-signed certificate made
//! here.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use prost::Message;

mod support;

/// The caller's trace: the trace id and span id a `traceparent` carries.
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN_ID: &str = "00f067aa0ba902b7";

/// How long any one step may take before the test fails.
const STEP: Duration = Duration::from_secs(120);

/// One span as the collector saw it.
#[derive(Debug, Clone)]
struct SeenSpan {
    name: String,
    trace_id: String,
    parent_span_id: String,
    content_type: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Spans out of an OTLP/HTTP export body, protobuf or JSON as its content type says.
fn decode(headers: &HeaderMap, body: &[u8]) -> Result<Vec<SeenSpan>, String> {
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut out = Vec::new();
    if content_type == "application/x-protobuf" {
        out = decode_proto(body, &content_type)?;
    } else if content_type == "application/json" {
        let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        for rs in v["resourceSpans"].as_array().into_iter().flatten() {
            for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                for s in ss["spans"].as_array().into_iter().flatten() {
                    let text = |k: &str| s[k].as_str().unwrap_or("").to_string();
                    out.push(SeenSpan {
                        name: text("name"),
                        trace_id: text("traceId").to_lowercase(),
                        parent_span_id: text("parentSpanId").to_lowercase(),
                        content_type: content_type.clone(),
                    });
                }
            }
        }
    } else {
        return Err(format!("unexpected content type `{content_type}`"));
    }
    Ok(out)
}

/// Spans out of the protobuf `ExportTraceServiceRequest` in `body`.
fn decode_proto(body: &[u8], content_type: &str) -> Result<Vec<SeenSpan>, String> {
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    let req = ExportTraceServiceRequest::decode(body).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for rs in req.resource_spans {
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(SeenSpan {
                    name: s.name,
                    trace_id: hex(&s.trace_id),
                    parent_span_id: hex(&s.parent_span_id),
                    content_type: content_type.to_string(),
                });
            }
        }
    }
    Ok(out)
}

/// A gRPC `TraceService/Export` answer: one empty `ExportTraceServiceResponse` message, then
/// the `grpc-status: 0` trailer.
type GrpcBody = http_body_util::StreamBody<
    futures_util::stream::Iter<
        std::vec::IntoIter<Result<hyper::body::Frame<Bytes>, std::convert::Infallible>>,
    >,
>;

fn grpc_ok() -> axum::http::Response<GrpcBody> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().unwrap());
    let frames = vec![
        // Not compressed, length 0: the empty message.
        Ok(hyper::body::Frame::data(Bytes::from_static(&[
            0, 0, 0, 0, 0,
        ]))),
        Ok(hyper::body::Frame::trailers(trailers)),
    ];
    axum::http::Response::builder()
        .header("content-type", "application/grpc")
        .body(http_body_util::StreamBody::new(futures_util::stream::iter(
            frames,
        )))
        .unwrap()
}

/// Which collector to run.
enum Kind<'a> {
    Http,
    Https(&'a Tls),
    /// OTLP/gRPC over plain HTTP/2.
    Grpc,
}

/// A test OTLP collector on 127.0.0.1, every span it decodes sent to the returned channel:
/// OTLP/HTTP (`POST /v1/traces`, over TLS with [`Kind::Https`]) or OTLP/gRPC.
struct Collector {
    url: String,
    spans: mpsc::Receiver<SeenSpan>,
    _runtime: tokio::runtime::Runtime,
}

impl Collector {
    fn start(kind: Kind<'_>) -> Collector {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (tx, spans) = mpsc::channel::<SeenSpan>();
        let grpc_tx = tx.clone();
        let app = Router::new().route(
            "/v1/traces",
            post(move |headers: HeaderMap, body: Bytes| {
                let tx = tx.clone();
                async move {
                    match decode(&headers, &body) {
                        Ok(spans) => {
                            for s in spans {
                                let _ = tx.send(s);
                            }
                            (StatusCode::OK, "")
                        }
                        Err(e) => {
                            eprintln!("collector: bad export: {e}");
                            (StatusCode::BAD_REQUEST, "bad export")
                        }
                    }
                }
            }),
        );
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let url = match kind {
            Kind::Http => {
                runtime.spawn(async move { axum::serve(listener, app).await });
                format!("http://127.0.0.1:{port}")
            }
            Kind::Grpc => {
                runtime.spawn(async move {
                    loop {
                        let Ok((stream, _)) = listener.accept().await else {
                            continue;
                        };
                        let tx = grpc_tx.clone();
                        let service = hyper::service::service_fn(
                            move |req: axum::http::Request<hyper::body::Incoming>| {
                                let tx = tx.clone();
                                async move {
                                    use http_body_util::BodyExt;
                                    assert_eq!(
                                        req.uri().path(),
                                        "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
                                    );
                                    let body = req.into_body().collect().await.unwrap().to_bytes();
                                    // One length-prefixed message: flag, u32 length, bytes.
                                    assert_eq!(body[0], 0, "a compressed message");
                                    let len = u32::from_be_bytes(body[1..5].try_into().unwrap());
                                    let message = &body[5..5 + len as usize];
                                    for s in decode_proto(message, "application/grpc").unwrap() {
                                        let _ = tx.send(s);
                                    }
                                    Ok::<_, std::convert::Infallible>(grpc_ok())
                                }
                            },
                        );
                        tokio::spawn(async move {
                            let _ = hyper::server::conn::http2::Builder::new(
                                hyper_util::rt::TokioExecutor::new(),
                            )
                            .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                            .await;
                        });
                    }
                });
                format!("http://127.0.0.1:{port}")
            }
            Kind::Https(tls) => {
                let acceptor = tls.acceptor();
                runtime.spawn(async move {
                    loop {
                        let Ok((stream, _)) = listener.accept().await else {
                            continue;
                        };
                        let acceptor = acceptor.clone();
                        let service = hyper_util::service::TowerToHyperService::new(app.clone());
                        tokio::spawn(async move {
                            let Ok(stream) = acceptor.accept(stream).await else {
                                return;
                            };
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                                .await;
                        });
                    }
                });
                // The certificate names `localhost`.
                format!("https://localhost:{port}")
            }
        };
        Collector {
            url,
            spans,
            _runtime: runtime,
        }
    }

    /// The first span named `name`; fails after [`STEP`].
    fn span_named(&self, name: &str) -> SeenSpan {
        loop {
            match self.spans.recv_timeout(STEP) {
                Ok(s) if s.name == name => return s,
                Ok(_) => continue,
                Err(e) => panic!("no span `{name}` reached the collector: {e}"),
            }
        }
    }
}

/// A self-signed certificate for `localhost` and 127.0.0.1, written as PEM files.
struct Tls {
    _dir: tempfile::TempDir,
    cert: PathBuf,
    key: PathBuf,
    cert_pem: String,
    key_pem: String,
}

impl Tls {
    fn new() -> Tls {
        let made = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("cert.pem");
        let key = dir.path().join("key.pem");
        let cert_pem = made.cert.pem();
        let key_pem = made.signing_key.serialize_pem();
        std::fs::write(&cert, &cert_pem).unwrap();
        std::fs::write(&key, &key_pem).unwrap();
        Tls {
            _dir: dir,
            cert,
            key,
            cert_pem,
            key_pem,
        }
    }

    fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs = vec![CertificateDer::from_pem_slice(self.cert_pem.as_bytes()).unwrap()];
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    }

    /// A blocking HTTP client that trusts this certificate (and nothing else).
    fn client(&self) -> reqwest::blocking::Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        reqwest::blocking::Client::builder()
            .tls_certs_only([reqwest::Certificate::from_pem(self.cert_pem.as_bytes()).unwrap()])
            .timeout(STEP)
            .build()
            .unwrap()
    }
}

/// A `coli serve` process on the llama fixture and a free port.
struct Serve {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// `http://127.0.0.1:PORT` or `https://…`, from its `listening on` line.
    url: String,
}

impl Serve {
    fn start(args: &[&str], env: &[(&str, &Path)]) -> Serve {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_coli"));
        support::isolated(&mut cmd)
            .args(["serve", "--host", "127.0.0.1", "--port", "0", "--model"])
            .arg(support::fixture("llama"))
            .args(["--slots", "1", "--threads", "1", "--drain-secs", "5"])
            .args(args)
            .env_remove("COLI_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("coli serve starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("serve: {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut s = Serve {
            child,
            lines,
            url: String::new(),
        };
        let listening = s.line_with("coli: listening on ");
        s.url = listening
            .split("coli: listening on ")
            .nth(1)
            .unwrap()
            .trim()
            .to_string();
        s.line_with("coli: ready:");
        s
    }

    /// The next stderr line containing `what`; fails after [`STEP`] or when the server exits.
    fn line_with(&self, what: &str) -> String {
        loop {
            match self.lines.recv_timeout(STEP) {
                Ok(line) if line.contains(what) => return line,
                Ok(_) => continue,
                Err(e) => panic!("coli serve printed no `{what}` line: {e}"),
            }
        }
    }

    /// SIGTERM, then wait for a clean exit (which flushes the queued spans).
    fn stop(mut self) {
        support::sigterm(self.child.id());
        let status = self.child.wait().unwrap();
        assert!(status.success(), "coli serve exited with {status}");
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A non-streamed chat completion carrying the test's `traceparent`.
fn chat(client: &reqwest::blocking::Client, base: &str) {
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .header("traceparent", format!("00-{TRACE_ID}-{PARENT_SPAN_ID}-01"))
        .json(&serde_json::json!({
            "messages": [{"role": "user", "content": "Trace me."}],
            "max_tokens": 3,
            "temperature": 0,
        }))
        .send()
        .expect("the chat request is answered");
    let status = r.status();
    let body = r.text().unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("chat.completion"), "{body}");
}

/// A client of plain-HTTP servers.
fn plain_client() -> reqwest::blocking::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::blocking::Client::builder()
        .timeout(STEP)
        .build()
        .unwrap()
}

/// A [`chat`] through `client` to `serve`, which then stops: the span the collector got for it.
fn chat_span(collector: &Collector, serve: Serve, client: &reqwest::blocking::Client) -> SeenSpan {
    chat(client, &serve.url);
    // Shutdown exports what the batch processor still holds.
    serve.stop();
    collector.span_named("POST /v1/chat/completions")
}

/// The span arrived as `content_type` and is a child of the test's `traceparent`.
fn assert_traced(span: &SeenSpan, content_type: &str) {
    assert_eq!(span.content_type, content_type);
    assert_eq!(span.trace_id, TRACE_ID);
    assert_eq!(span.parent_span_id, PARENT_SPAN_ID);
}

#[test]
fn a_chat_span_reaches_the_collector_as_a_child_of_traceparent() {
    let collector = Collector::start(Kind::Http);
    let serve = Serve::start(&["--otlp-endpoint", &collector.url], &[]);
    let span = chat_span(&collector, serve, &plain_client());
    assert_traced(&span, "application/x-protobuf");
}

#[test]
fn a_grpc_collector_gets_the_span_too() {
    let collector = Collector::start(Kind::Grpc);
    let serve = Serve::start(
        &["--otlp-endpoint", &collector.url, "--otlp-protocol", "grpc"],
        &[],
    );
    let span = chat_span(&collector, serve, &plain_client());
    assert_traced(&span, "application/grpc");
}

#[test]
fn https_serving_and_an_https_json_collector() {
    let tls = Tls::new();
    let collector = Collector::start(Kind::Https(&tls));
    let serve = Serve::start(
        &[
            "--otlp-endpoint",
            &collector.url,
            "--otlp-protocol",
            "http/json",
            "--tls-cert",
            tls.cert.to_str().unwrap(),
            "--tls-key",
            tls.key.to_str().unwrap(),
        ],
        // The exporter trusts the system's roots, which this variable replaces.
        &[("SSL_CERT_FILE", &tls.cert)],
    );
    assert!(serve.url.starts_with("https://127.0.0.1:"), "{}", serve.url);
    let client = tls.client();
    let health = client
        .get(format!("{}/health", serve.url))
        .send()
        .expect("GET /health over TLS");
    assert_eq!(health.status(), 200);
    // Plain HTTP to the TLS port gets no HTTP answer.
    let plain = serve.url.replace("https://", "http://");
    assert!(reqwest::blocking::Client::new()
        .get(format!("{plain}/health"))
        .timeout(Duration::from_secs(10))
        .send()
        .is_err());
    let span = chat_span(&collector, serve, &client);
    assert_traced(&span, "application/json");
}

#[test]
fn a_bad_tls_key_stops_the_server_before_it_listens() {
    let tls = Tls::new();
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "").unwrap();
    let out = support::isolated(Command::new(env!("CARGO_BIN_EXE_coli")).args([
        "serve",
        "--port",
        "0",
        "--tls-cert",
        tls.cert.to_str().unwrap(),
        "--tls-key",
        empty.to_str().unwrap(),
    ]))
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("tls_key") && err.contains("empty.pem"),
        "{err}"
    );
    assert!(!err.contains("listening"), "{err}");
}
