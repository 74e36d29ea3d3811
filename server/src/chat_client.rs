//! `coli chat`: the terminal client of `coli serve` (or of any OpenAI-compatible server).
//!
//! This file owns the whole client: a minimal blocking HTTP/1.1 client over
//! [`std::net::TcpStream`] (plain `http://` only — https is not supported; put a local proxy
//! in front of a TLS endpoint), the `Transfer-Encoding: chunked` decoder and the incremental
//! server-sent-events parser that print tokens as they stream, the REPL (multi-line input,
//! `/reset`, `/system`, `/save`, `/help`, `/quit`), the SIGINT handling that stops an answer
//! without leaving the REPL, and `--model`, which runs `coli serve` as a child process on a
//! free port for the length of the session.

use std::collections::VecDeque;
use std::io::{self, IsTerminal, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use colibri::format::write::write_atomic;
use serde::Deserialize;
use serde_json::{json, Value};

/// Arguments of `coli chat`.
#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    /// Server URL (default http://127.0.0.1:8080). Plain http:// only; https is not supported.
    #[arg(long)]
    pub url: Option<String>,
    /// API key (default: env OPENAI_API_KEY, or none).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Model name to send (default: the first of the server's /v1/models).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Start a server in-process on this model instead of connecting to --url (path or "demo").
    #[arg(long, conflicts_with = "url")]
    pub model: Option<String>,
    /// System message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    /// Sampling temperature; 0 is greedy (default: the server's).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Most tokens per answer (default: the server's).
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Random seed sent with every request, for reproducible answers.
    #[arg(long)]
    pub seed: Option<u64>,
}

const DEFAULT_URL: &str = "http://127.0.0.1:8080";
/// How long a socket read blocks before the loop looks at the Ctrl-C flag again.
const POLL: Duration = Duration::from_millis(100);
/// A stream that sends nothing at all (not even the server's 5 s keep-alives) for this long
/// is given up.
const STREAM_IDLE: Duration = Duration::from_secs(600);
/// Idle limit of the small GET requests.
const GET_IDLE: Duration = Duration::from_secs(30);
/// How long `--model` waits for the model to load.
const LOAD_DEADLINE: Duration = Duration::from_secs(600);
/// The largest response head or non-streamed body read.
const MAX_HEAD: usize = 64 * 1024;
const MAX_BODY: usize = 16 * 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Ctrl-C

/// Set by the SIGINT handler; cleared by whoever acts on it.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Install the SIGINT handler, without `SA_RESTART` so a blocked read of stdin returns
/// `EINTR` and the prompt can leave at once.
fn install_sigint() -> Result<()> {
    // SAFETY: a zeroed `sigaction` is a valid value; the handler only stores to an atomic,
    // which is async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigint as *const () as libc::sighandler_t;
        sa.sa_flags = 0;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut()) != 0 {
            return Err(io::Error::last_os_error()).context("installing the Ctrl-C handler");
        }
    }
    Ok(())
}

/// Run `f` with SIGINT blocked on this thread, so threads it spawns inherit the mask and the
/// signal always lands on the main thread (where it interrupts the blocked stdin read).
fn with_sigint_blocked<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: plain signal-mask calls on valid, initialised sets.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
        let out = f();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        out
    }
}

/// The error a read returns when Ctrl-C stopped it.
#[derive(Debug)]
struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

fn is_interrupted(e: &anyhow::Error) -> bool {
    e.is::<Interrupted>()
}

// ---------------------------------------------------------------------------------------------
// URLs

/// Where the server is: `http://HOST[:PORT][/PREFIX]`.
#[derive(Debug, Clone, PartialEq)]
struct BaseUrl {
    host: String,
    port: u16,
    /// Path before `/v1/...`, without a trailing slash (usually empty).
    prefix: String,
}

impl BaseUrl {
    /// Parse a server URL. A trailing `/v1` (as in OpenAI clients' `base_url`) is accepted.
    fn parse(url: &str) -> Result<BaseUrl> {
        let url = url.trim();
        if url.starts_with("https://") {
            bail!(
                "{url}: https is not supported by coli chat (it speaks plain HTTP only); use an http:// URL, or a local TLS-terminating proxy"
            );
        }
        let rest = match url.strip_prefix("http://") {
            Some(r) => r,
            None if !url.contains("://") => url,
            None => bail!("{url}: only http:// URLs are supported"),
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.contains('@') {
            bail!("{url}: user:password in the URL is not supported; use --api-key");
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let end = v6
                .find(']')
                .with_context(|| format!("{url}: unclosed `[` in the host"))?;
            let port = match &v6[end + 1..] {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .with_context(|| format!("{url}: junk after the IPv6 address"))?,
                ),
            };
            (v6[..end].to_string(), port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p)),
                None => (authority.to_string(), None),
            }
        };
        if host.is_empty() {
            bail!("{url}: no host");
        }
        let port = match port {
            None => 80,
            Some(p) => p
                .parse::<u16>()
                .with_context(|| format!("{url}: `{p}` is not a port number"))?,
        };
        let mut prefix = path.split(['?', '#']).next().unwrap_or("");
        prefix = prefix.trim_end_matches('/');
        prefix = prefix.strip_suffix("/v1").unwrap_or(prefix);
        Ok(BaseUrl {
            host,
            port,
            prefix: prefix.trim_end_matches('/').to_string(),
        })
    }

    /// The `Host` header value.
    fn host_header(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        if self.port == 80 {
            host
        } else {
            format!("{host}:{}", self.port)
        }
    }

    /// The URL as shown to the user.
    fn display(&self) -> String {
        format!("http://{}{}", self.host_header(), self.prefix)
    }
}

// ---------------------------------------------------------------------------------------------
// Chunked transfer coding

#[derive(Debug)]
enum ChunkState {
    /// Reading the `SIZE[;ext]` line.
    Size(Vec<u8>),
    /// This many data bytes to go.
    Data(u64),
    /// Reading the empty line after a chunk's data.
    DataEnd(Vec<u8>),
    /// After the last (zero) chunk: trailer lines until an empty one.
    Trailer(Vec<u8>),
    Done,
}

/// Incremental decoder of `Transfer-Encoding: chunked`: feed it the bytes as they arrive.
#[derive(Debug)]
struct ChunkedDecoder {
    state: ChunkState,
}

impl ChunkedDecoder {
    fn new() -> ChunkedDecoder {
        ChunkedDecoder {
            state: ChunkState::Size(Vec::new()),
        }
    }

    /// The terminating chunk and its trailers have been read.
    fn is_done(&self) -> bool {
        matches!(self.state, ChunkState::Done)
    }

    /// Decode `input`, appending the data to `out`. Bytes after the end are ignored.
    fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) -> Result<()> {
        const MAX_LINE: usize = 4096;
        while !input.is_empty() {
            match &mut self.state {
                ChunkState::Done => return Ok(()),
                ChunkState::Data(left) => {
                    let n = (*left).min(input.len() as u64) as usize;
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    *left -= n as u64;
                    if *left == 0 {
                        self.state = ChunkState::DataEnd(Vec::new());
                    }
                }
                ChunkState::Size(line) | ChunkState::DataEnd(line) | ChunkState::Trailer(line) => {
                    let Some(nl) = input.iter().position(|&b| b == b'\n') else {
                        line.extend_from_slice(input);
                        if line.len() > MAX_LINE {
                            bail!(
                                "malformed chunked response: a line longer than {MAX_LINE} bytes"
                            );
                        }
                        return Ok(());
                    };
                    line.extend_from_slice(&input[..nl]);
                    input = &input[nl + 1..];
                    if line.last() == Some(&b'\r') {
                        line.pop();
                    }
                    let line = std::mem::take(line);
                    self.state = match &self.state {
                        ChunkState::Size(_) => {
                            let text = String::from_utf8_lossy(&line);
                            let hex = text.split(';').next().unwrap_or("").trim();
                            let size = u64::from_str_radix(hex, 16).map_err(|_| {
                                anyhow!("malformed chunked response: chunk size `{text}`")
                            })?;
                            if size == 0 {
                                ChunkState::Trailer(Vec::new())
                            } else {
                                ChunkState::Data(size)
                            }
                        }
                        ChunkState::DataEnd(_) => {
                            if !line.is_empty() {
                                bail!(
                                    "malformed chunked response: data longer than its chunk size"
                                );
                            }
                            ChunkState::Size(Vec::new())
                        }
                        _ if line.is_empty() => ChunkState::Done,
                        _ => ChunkState::Trailer(Vec::new()),
                    };
                }
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Server-sent events

/// Incremental server-sent-events parser: feed it body bytes, get back the `data` of each
/// complete event. Comment lines (`:` keep-alives) and fields other than `data` are skipped;
/// lines end with `\n` or `\r\n`.
#[derive(Debug, Default)]
struct SseParser {
    line: Vec<u8>,
    data: String,
    has_data: bool,
}

impl SseParser {
    fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut events = Vec::new();
        for &b in bytes {
            if b != b'\n' {
                self.line.push(b);
                continue;
            }
            if self.line.last() == Some(&b'\r') {
                self.line.pop();
            }
            let line = std::mem::take(&mut self.line);
            if line.is_empty() {
                if self.has_data {
                    events.push(std::mem::take(&mut self.data));
                    self.has_data = false;
                }
                continue;
            }
            if line[0] == b':' {
                continue;
            }
            let line = String::from_utf8_lossy(&line);
            let (field, value) = match line.split_once(':') {
                Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
                None => (&*line, ""),
            };
            if field == "data" {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
        }
        events
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP

/// A non-2xx answer, with the server's OpenAI-style error message when it sent one.
#[derive(Debug)]
struct HttpStatusError {
    status: u16,
    reason: String,
    message: String,
    code: Option<String>,
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
struct StreamError(String);

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the server reported an error: {}", self.0)
    }
}

impl std::error::Error for StreamError {}

/// The message of an OpenAI error body (`{"error": {"message": ...}}` or `{"error": "..."}`).
fn error_message(v: &Value) -> Option<(String, Option<String>)> {
    let e = v.get("error")?;
    if let Some(s) = e.as_str() {
        return Some((s.to_string(), None));
    }
    let message = e.get("message")?.as_str()?.to_string();
    let code = e.get("code").and_then(Value::as_str).map(str::to_string);
    Some((message, code))
}

/// How a response body ends.
#[derive(Debug)]
enum Framing {
    Length(u64),
    Chunked(ChunkedDecoder),
    /// Until the server closes the connection.
    Close,
    Done,
}

/// A response whose body is read as it arrives.
struct Response {
    status: u16,
    reason: String,
    stream: TcpStream,
    /// Body bytes read with the head (or since), not yet decoded.
    pending: Vec<u8>,
    framing: Framing,
    idle: Duration,
    interrupt: &'static AtomicBool,
}

/// Read from a socket whose read timeout is [`POLL`], giving up on Ctrl-C or after `idle`
/// without a byte. `Ok(0)` is the end of the stream.
fn read_polling(
    stream: &mut TcpStream,
    buf: &mut [u8],
    idle: Duration,
    interrupt: &AtomicBool,
) -> Result<usize> {
    let since = Instant::now();
    loop {
        if interrupt.load(Ordering::SeqCst) {
            return Err(Interrupted.into());
        }
        match stream.read(buf) {
            Ok(n) => return Ok(n),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                if since.elapsed() > idle {
                    bail!(
                        "the server sent nothing for {} s",
                        since.elapsed().as_secs()
                    );
                }
            }
            Err(e) => return Err(e).context("reading the response"),
        }
    }
}

/// Header names (lower-cased) and values.
type Headers = Vec<(String, String)>;

/// Parse a response head (status line and headers, without the blank line): status, reason
/// phrase, headers.
fn parse_head(head: &[u8]) -> Result<(u16, String, Headers)> {
    let text = String::from_utf8_lossy(head);
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        bail!("not an HTTP/1.x response (it starts with `{status_line}`); is this an HTTP server?");
    }
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .with_context(|| format!("bad status line `{status_line}`"))?;
    let reason = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    for line in lines {
        if line.is_empty() {
            continue;
        }
        let (name, value) = line
            .split_once(':')
            .with_context(|| format!("bad header line `{line}`"))?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    Ok((status, reason, headers))
}

impl Response {
    /// Read the head from `stream`, skipping `1xx` interim responses.
    fn read(
        mut stream: TcpStream,
        head_request: bool,
        idle: Duration,
        interrupt: &'static AtomicBool,
    ) -> Result<Response> {
        let mut buf = Vec::new();
        let mut tmp = [0u8; 8192];
        loop {
            let end = loop {
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i;
                }
                if buf.len() > MAX_HEAD {
                    bail!("the response head is larger than {MAX_HEAD} bytes");
                }
                let n = read_polling(&mut stream, &mut tmp, idle, interrupt)?;
                if n == 0 {
                    bail!("the server closed the connection without answering");
                }
                buf.extend_from_slice(&tmp[..n]);
            };
            let (status, reason, headers) = parse_head(&buf[..end])?;
            buf.drain(..end + 4);
            if (100..200).contains(&status) && status != 101 {
                continue;
            }
            let header = |name: &str| {
                headers
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.as_str())
            };
            let framing = if head_request || status == 204 || status == 304 {
                Framing::Done
            } else if header("transfer-encoding")
                .is_some_and(|v| v.to_ascii_lowercase().contains("chunked"))
            {
                Framing::Chunked(ChunkedDecoder::new())
            } else if let Some(len) = header("content-length") {
                let len: u64 = len
                    .parse()
                    .with_context(|| format!("bad Content-Length `{len}`"))?;
                if len == 0 {
                    Framing::Done
                } else {
                    Framing::Length(len)
                }
            } else {
                Framing::Close
            };
            return Ok(Response {
                status,
                reason,
                stream,
                pending: buf,
                framing,
                idle,
                interrupt,
            });
        }
    }

    /// The next piece of the body as it arrives; `None` at its end.
    fn next_piece(&mut self) -> Result<Option<Vec<u8>>> {
        let mut tmp = [0u8; 16384];
        loop {
            if !self.pending.is_empty() {
                match &mut self.framing {
                    Framing::Done => self.pending.clear(),
                    Framing::Close => return Ok(Some(std::mem::take(&mut self.pending))),
                    Framing::Length(left) => {
                        let n = (*left).min(self.pending.len() as u64) as usize;
                        let piece: Vec<u8> = self.pending.drain(..n).collect();
                        *left -= n as u64;
                        if *left == 0 {
                            self.framing = Framing::Done;
                            self.pending.clear();
                        }
                        return Ok(Some(piece));
                    }
                    Framing::Chunked(dec) => {
                        let mut out = Vec::new();
                        dec.feed(&self.pending, &mut out)?;
                        self.pending.clear();
                        if dec.is_done() {
                            self.framing = Framing::Done;
                        }
                        if !out.is_empty() {
                            return Ok(Some(out));
                        }
                    }
                }
            }
            if matches!(self.framing, Framing::Done) {
                return Ok(None);
            }
            let n = read_polling(&mut self.stream, &mut tmp, self.idle, self.interrupt)?;
            if n == 0 {
                if matches!(self.framing, Framing::Close) {
                    self.framing = Framing::Done;
                    return Ok(None);
                }
                bail!("the server closed the connection in the middle of the response");
            }
            self.pending.extend_from_slice(&tmp[..n]);
        }
    }

    /// The whole body (at most [`MAX_BODY`] bytes).
    fn body(&mut self) -> Result<Vec<u8>> {
        let mut body = Vec::new();
        while let Some(piece) = self.next_piece()? {
            body.extend_from_slice(&piece);
            if body.len() > MAX_BODY {
                bail!("the response body is larger than {MAX_BODY} bytes");
            }
        }
        Ok(body)
    }

    /// Turn a non-2xx response into an [`HttpStatusError`] carrying the server's message.
    fn into_status_error(mut self) -> anyhow::Error {
        let body = self.body().unwrap_or_default();
        let (message, code) = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| error_message(&v))
            .unwrap_or_else(|| {
                let text = String::from_utf8_lossy(&body).trim().to_string();
                (text.chars().take(300).collect(), None)
            });
        HttpStatusError {
            status: self.status,
            reason: self.reason,
            message,
            code,
        }
        .into()
    }
}

/// A blocking HTTP/1.1 client of one server: one connection per request (`Connection: close`).
struct Client {
    base: BaseUrl,
    api_key: Option<String>,
    interrupt: &'static AtomicBool,
}

impl Client {
    fn connect(&self) -> Result<TcpStream> {
        let shown = self.base.display();
        let addrs: Vec<_> = (self.base.host.as_str(), self.base.port)
            .to_socket_addrs()
            .with_context(|| format!("cannot resolve the host of {shown}"))?
            .collect();
        let mut last = None;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(10)) {
                Ok(s) => {
                    s.set_read_timeout(Some(POLL))?;
                    s.set_write_timeout(Some(Duration::from_secs(60)))?;
                    s.set_nodelay(true)?;
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        let e = last.unwrap_or_else(|| io::Error::other("the host has no addresses"));
        Err(anyhow::Error::new(e).context(format!("cannot connect to {shown}")))
    }

    /// Send a request and read the response head.
    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        accept: &str,
        idle: Duration,
    ) -> Result<Response> {
        let mut stream = self.connect()?;
        let mut head = format!(
            "{method} {}{path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: coli-chat/{}\r\nAccept: {accept}\r\nConnection: close\r\n",
            self.base.prefix,
            self.base.host_header(),
            env!("CARGO_PKG_VERSION"),
        );
        if let Some(key) = &self.api_key {
            head.push_str(&format!("Authorization: Bearer {key}\r\n"));
        }
        if let Some(b) = body {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                b.len()
            ));
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(body.unwrap_or_default());
        let written = stream.write_all(&bytes).and_then(|_| stream.flush());
        let response = Response::read(stream, method == "HEAD", idle, self.interrupt);
        match (written, response) {
            (_, Ok(r)) => Ok(r),
            (Err(w), Err(r)) if !is_interrupted(&r) => Err(anyhow::Error::new(w).context(format!(
                "sending {method} {path} to {}",
                self.base.display()
            ))),
            (_, Err(r)) => Err(r),
        }
    }

    /// GET a JSON document; a non-2xx status is an [`HttpStatusError`].
    fn get_json(&self, path: &str) -> Result<Value> {
        let mut r = self.request("GET", path, None, "application/json", GET_IDLE)?;
        if !(200..300).contains(&r.status) {
            return Err(r.into_status_error());
        }
        let body = r.body()?;
        serde_json::from_slice(&body).with_context(|| {
            format!(
                "GET {path}: the answer is not JSON: {}",
                String::from_utf8_lossy(&body)
                    .chars()
                    .take(200)
                    .collect::<String>()
            )
        })
    }

    /// The ids of the served models.
    fn models(&self) -> Result<Vec<String>> {
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

    /// POST a streamed chat completion, handing each piece of text to `sink` as it arrives.
    /// Ctrl-C closes the connection and returns what arrived, marked interrupted.
    fn stream_chat(&self, body: &Value, sink: &mut dyn FnMut(Piece<'_>)) -> Result<Answer> {
        let bytes = serde_json::to_vec(body)?;
        let mut ans = Answer::default();
        let mut response = match self.request(
            "POST",
            "/v1/chat/completions",
            Some(&bytes),
            "text/event-stream",
            STREAM_IDLE,
        ) {
            Ok(r) => r,
            Err(e) if is_interrupted(&e) => {
                ans.interrupted = true;
                return Ok(ans);
            }
            Err(e) => return Err(e),
        };
        if !(200..300).contains(&response.status) {
            return Err(response.into_status_error());
        }
        let mut sse = SseParser::default();
        loop {
            let piece = match response.next_piece() {
                Ok(Some(p)) => p,
                Ok(None) if ans.finish.is_some() => return Ok(ans),
                Ok(None) => bail!("the server ended the stream before the answer was finished"),
                Err(e) if is_interrupted(&e) => {
                    ans.interrupted = true;
                    return Ok(ans);
                }
                Err(e) => return Err(e),
            };
            for data in sse.feed(&piece) {
                if ans.event(&data, sink)? {
                    return Ok(ans);
                }
            }
        }
    }
}

/// A piece of streamed text.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Piece<'a> {
    Reasoning(&'a str),
    Content(&'a str),
}

#[derive(Debug, Default, Deserialize)]
struct WireChunk {
    #[serde(default)]
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
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

#[derive(Debug, Default, Clone, Deserialize)]
struct WireUsage {
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<WireDetails>,
}

#[derive(Debug, Default, Clone, Deserialize)]
struct WireDetails {
    #[serde(default)]
    cached_tokens: u64,
}

/// What one streamed answer produced.
#[derive(Debug, Default)]
struct Answer {
    content: String,
    reasoning: String,
    finish: Option<String>,
    usage: Option<WireUsage>,
    /// Chunks that carried text.
    pieces: u64,
    first: Option<Instant>,
    last: Option<Instant>,
    interrupted: bool,
}

impl Answer {
    /// Take one SSE event; `true` once the stream is over (`[DONE]`).
    fn event(&mut self, data: &str, sink: &mut dyn FnMut(Piece<'_>)) -> Result<bool> {
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
    fn footer(&self) -> String {
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

/// One line explaining a failed request, naming the URL and what to do about it.
fn explain(e: &anyhow::Error, url: &str) -> String {
    if let Some(h) = e.downcast_ref::<HttpStatusError>() {
        let hint = match h.status {
            401 | 403 => {
                " — pass --api-key KEY (or set OPENAI_API_KEY) with a key the server accepts"
            }
            404 if h.code.as_deref() == Some("model_not_found") => {
                " — leave out --model-name to use the served model"
            }
            404 => " — is this a coli serve (OpenAI-compatible) URL?",
            429 => " — the server is busy; try again in a moment",
            503 => " — the server is loading or shutting down; try again shortly",
            400 if h.message.contains("context") => {
                " — the conversation is too long: /save it, then /reset"
            }
            _ => "",
        };
        return format!("{url} answered {h}{hint}");
    }
    if let Some(s) = e.downcast_ref::<StreamError>() {
        return format!("{url}: {s}");
    }
    let refused = e.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::ConnectionRefused)
    });
    if refused {
        return format!(
            "cannot connect to {url}: connection refused — is `coli serve` running there? (or start one with `coli chat --model PATH`)"
        );
    }
    format!("{url}: {e:#}")
}

// ---------------------------------------------------------------------------------------------
// The in-process server (`--model`)

#[derive(Default)]
struct ServerLog {
    /// The last lines of the server's stderr.
    lines: VecDeque<String>,
    /// `http://ADDR` once the server said it listens.
    listening: Option<String>,
    /// Its stderr closed (it exited).
    closed: bool,
    /// The model is loaded: from now on its errors are passed on (before, loading failures
    /// come back through `/ready`).
    ready: bool,
}

/// `coli serve` running as a child process for this session; stopped on drop.
struct LocalServer {
    child: Child,
    log: Arc<(Mutex<ServerLog>, Condvar)>,
}

impl LocalServer {
    /// Start `coli serve --model MODEL` on a free loopback port and wait until it listens.
    fn start(model: &str, api_key: Option<&str>) -> Result<(LocalServer, String)> {
        let exe = std::env::current_exe().context("finding the coli executable")?;
        let mut cmd = Command::new(&exe);
        cmd.args([
            "serve",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
        // The key travels in the environment, not on the command line `ps` shows.
        match api_key {
            Some(k) => cmd.env("COLI_API_KEYS", k),
            None => cmd.env_remove("COLI_API_KEYS"),
        };
        {
            use std::os::unix::process::CommandExt;
            // Its own process group: Ctrl-C in the terminal stops an answer, not the server.
            cmd.process_group(0);
            #[cfg(target_os = "linux")]
            // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    // Stop the server if this process dies without running its destructors.
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting `{} serve`", exe.display()))?;
        let stderr = child.stderr.take().context("the server's stderr")?;
        let log: Arc<(Mutex<ServerLog>, Condvar)> = Arc::default();
        let thread_log = log.clone();
        let spawned = with_sigint_blocked(|| {
            std::thread::Builder::new()
                .name("coli-chat-server-log".into())
                .spawn(move || follow_server_log(stderr, &thread_log))
        });
        let mut server = LocalServer { child, log };
        spawned.context("spawning the server log reader")?;
        let url = server.wait_listening(Duration::from_secs(60))?;
        Ok((server, url))
    }

    fn wait_listening(&mut self, limit: Duration) -> Result<String> {
        let deadline = Instant::now() + limit;
        let (lock, cv) = &*self.log;
        let mut log = lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(url) = &log.listening {
                return Ok(url.clone());
            }
            if log.closed {
                bail!("the server exited while starting:\n{}", tail(&log.lines));
            }
            let now = Instant::now();
            if now >= deadline {
                bail!(
                    "the server did not start listening within {} s:\n{}",
                    limit.as_secs(),
                    tail(&log.lines)
                );
            }
            if INTERRUPTED.swap(false, Ordering::SeqCst) {
                return Err(Interrupted.into());
            }
            log = cv
                .wait_timeout(log, (deadline - now).min(POLL))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Poll `/ready` until the model is loaded, printing progress; bounded by `limit`.
    fn wait_ready(&mut self, client: &Client, model: &str, limit: Duration) -> Result<()> {
        let start = Instant::now();
        let mut said = Duration::ZERO;
        eprintln!("coli chat: loading {model}…");
        loop {
            if let Some(status) = self.child.try_wait()? {
                let log = self.log.0.lock().unwrap_or_else(|p| p.into_inner());
                bail!(
                    "the server exited ({status}) while loading {model}:\n{}",
                    tail(&log.lines)
                );
            }
            match client.get_json("/ready") {
                Ok(_) => {
                    self.log.0.lock().unwrap_or_else(|p| p.into_inner()).ready = true;
                    return Ok(());
                }
                Err(e) if is_interrupted(&e) => return Err(e),
                Err(e) => {
                    if let Some(h) = e.downcast_ref::<HttpStatusError>() {
                        if h.message.contains("failed to load") {
                            bail!("{}", h.message);
                        }
                    }
                }
            }
            let waited = start.elapsed();
            if waited > limit {
                bail!(
                    "{model} did not finish loading within {} min",
                    limit.as_secs() / 60
                );
            }
            if waited >= said + Duration::from_secs(15) {
                said = waited;
                eprintln!("coli chat: still loading… ({} s)", waited.as_secs());
            }
            // Sleep in slices so Ctrl-C answers at once.
            let until = Instant::now() + Duration::from_millis(500);
            while Instant::now() < until {
                if INTERRUPTED.swap(false, Ordering::SeqCst) {
                    return Err(Interrupted.into());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

impl Drop for LocalServer {
    /// SIGTERM (the server drains and saves its expert-usage history), then SIGKILL after 10 s.
    fn drop(&mut self) {
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: signalling our own child, which has not been reaped yet.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match self.child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Read the server's stderr: note where it listens, keep the last lines, and pass its errors
/// and warnings on.
fn follow_server_log(stderr: std::process::ChildStderr, log: &(Mutex<ServerLog>, Condvar)) {
    use std::io::BufRead;
    const KEEP: usize = 40;
    let (lock, cv) = log;
    for line in io::BufReader::new(stderr).lines() {
        let Ok(line) = line else { break };
        let mut l = lock.lock().unwrap_or_else(|p| p.into_inner());
        if l.listening.is_none() {
            if let Some(addr) = line.strip_prefix("coli: listening on ") {
                l.listening = Some(addr.trim().to_string());
                cv.notify_all();
            }
        } else if line.starts_with("coli: warning") || (l.ready && line.starts_with("coli: error"))
        {
            eprintln!("server: {line}");
        }
        if l.lines.len() == KEEP {
            l.lines.pop_front();
        }
        l.lines.push_back(line);
    }
    let mut l = lock.lock().unwrap_or_else(|p| p.into_inner());
    l.closed = true;
    cv.notify_all();
}

fn tail(lines: &VecDeque<String>) -> String {
    if lines.is_empty() {
        return "  (it printed nothing)".into();
    }
    lines
        .iter()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

// ---------------------------------------------------------------------------------------------
// Input

/// A line read from stdin.
#[derive(Debug, PartialEq)]
enum Line {
    Text(String),
    Eof,
    /// Ctrl-C while waiting for input.
    Interrupted,
}

/// Reads lines from stdin itself (std's `read_line` retries on `EINTR`, which would swallow
/// Ctrl-C at the prompt).
struct LineReader<R> {
    inner: R,
    buf: Vec<u8>,
    eof: bool,
}

impl<R: Read> LineReader<R> {
    fn new(inner: R) -> LineReader<R> {
        LineReader {
            inner,
            buf: Vec::new(),
            eof: false,
        }
    }

    fn next_line(&mut self, interrupt: &AtomicBool) -> Result<Line> {
        let mut tmp = [0u8; 4096];
        loop {
            if let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
                let mut line: Vec<u8> = self.buf.drain(..=nl).collect();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(Line::Text(String::from_utf8_lossy(&line).into_owned()));
            }
            if self.eof {
                if self.buf.is_empty() {
                    return Ok(Line::Eof);
                }
                let line = std::mem::take(&mut self.buf);
                return Ok(Line::Text(String::from_utf8_lossy(&line).into_owned()));
            }
            if interrupt.swap(false, Ordering::SeqCst) {
                return Ok(Line::Interrupted);
            }
            match self.inner.read(&mut tmp) {
                Ok(0) => self.eof = true,
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e).context("reading stdin"),
            }
        }
    }
}

/// Joins lines into one input: a line ending with `\` continues on the next, and `"""` at the
/// start of an input opens a block that a line ending with `"""` closes.
#[derive(Debug, Default)]
struct Composer {
    lines: Vec<String>,
    in_block: bool,
}

impl Composer {
    /// Something is pending (the next prompt is a continuation).
    fn pending(&self) -> bool {
        self.in_block || !self.lines.is_empty()
    }

    /// Add a line; the complete input once there is one.
    fn feed(&mut self, line: &str) -> Option<String> {
        if self.in_block {
            if let Some(before) = line.trim_end().strip_suffix("\"\"\"") {
                if !before.is_empty() {
                    self.lines.push(before.to_string());
                }
                self.in_block = false;
                return Some(self.take());
            }
            self.lines.push(line.to_string());
            return None;
        }
        if self.lines.is_empty() {
            if let Some(rest) = line.trim_start().strip_prefix("\"\"\"") {
                if let Some(inner) = rest.trim_end().strip_suffix("\"\"\"") {
                    return Some(inner.to_string());
                }
                self.in_block = true;
                if !rest.trim().is_empty() {
                    self.lines.push(rest.to_string());
                }
                return None;
            }
        }
        if let Some(head) = line.strip_suffix('\\') {
            self.lines.push(head.to_string());
            return None;
        }
        self.lines.push(line.to_string());
        Some(self.take())
    }

    fn take(&mut self) -> String {
        std::mem::take(&mut self.lines).join("\n")
    }
}

/// What an input asks for.
#[derive(Debug, PartialEq)]
enum Input {
    Message(String),
    Reset,
    System(Option<String>),
    Save(String),
    Help,
    Quit,
    Unknown(String),
    Empty,
}

fn parse_input(text: &str) -> Input {
    if text.trim().is_empty() {
        return Input::Empty;
    }
    let trimmed = text.trim();
    if let Some(escaped) = trimmed.strip_prefix("//") {
        return Input::Message(format!("/{escaped}"));
    }
    let Some(command) = trimmed.strip_prefix('/') else {
        return Input::Message(text.to_string());
    };
    let (name, arg) = match command.split_once(char::is_whitespace) {
        Some((n, a)) => (n, a.trim()),
        None => (command, ""),
    };
    match name {
        "reset" | "clear" => Input::Reset,
        "system" => Input::System((!arg.is_empty()).then(|| arg.to_string())),
        "save" if !arg.is_empty() => Input::Save(arg.to_string()),
        "save" => Input::Unknown("/save needs a file name: /save FILE".into()),
        "help" | "?" => Input::Help,
        "quit" | "exit" => Input::Quit,
        _ => Input::Unknown(format!("unknown command /{name}; /help lists the commands")),
    }
}

const HELP: &str = "\
Type a message and press Enter to send it.
  a line ending with \\ continues on the next line; \"\"\" opens and closes a multi-line block
  /reset         clear the conversation (keeps the system message)
  /system TEXT   set the system message and clear the conversation (/system alone removes it)
  /save FILE     write the conversation to FILE as a JSON array of messages
  /help          this text
  /quit, /exit   leave (or Ctrl-D); Ctrl-C stops an answer, and leaves at the prompt
  //TEXT         send a message that starts with /";

// ---------------------------------------------------------------------------------------------
// The conversation

/// One message of the conversation.
#[derive(Debug, Clone, PartialEq)]
struct Message {
    role: &'static str,
    content: String,
    /// An assistant answer cut short by Ctrl-C.
    interrupted: bool,
}

impl Message {
    fn new(role: &'static str, content: impl Into<String>) -> Message {
        Message {
            role,
            content: content.into(),
            interrupted: false,
        }
    }

    /// As sent to the server.
    fn wire(&self) -> Value {
        json!({"role": self.role, "content": self.content})
    }

    /// As saved: the OpenAI message, plus `"interrupted": true` on a cut-short answer.
    fn saved(&self) -> Value {
        let mut v = self.wire();
        if self.interrupted {
            v["interrupted"] = Value::Bool(true);
        }
        v
    }
}

#[derive(Debug, Default)]
struct Conversation {
    system: Option<String>,
    turns: Vec<Message>,
}

impl Conversation {
    fn messages(&self, saved: bool) -> Vec<Value> {
        let system = self
            .system
            .as_ref()
            .map(|s| Message::new("system", s.clone()));
        system
            .iter()
            .chain(&self.turns)
            .map(|m| if saved { m.saved() } else { m.wire() })
            .collect()
    }
}

/// Where the text goes.
struct Ui {
    tty: bool,
    /// The last character written to stdout was a newline (or nothing was written).
    at_line_start: bool,
    in_reasoning: bool,
}

impl Ui {
    fn out(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        let mut o = io::stdout().lock();
        let _ = o.write_all(s.as_bytes()).and_then(|_| o.flush());
        self.at_line_start = s.ends_with('\n');
    }

    fn dim(&self, s: &str) -> String {
        if self.tty {
            format!("\x1b[2m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }

    fn piece(&mut self, p: Piece<'_>) {
        match p {
            Piece::Reasoning(r) => {
                self.in_reasoning = true;
                let r = self.dim(r);
                self.out(&r);
                self.at_line_start = r.ends_with('\n') || r.ends_with("\n\x1b[0m");
            }
            Piece::Content(c) => {
                if self.in_reasoning {
                    self.in_reasoning = false;
                    if !self.at_line_start {
                        self.out("\n");
                    }
                }
                self.out(c);
            }
        }
    }

    fn end_line(&mut self) {
        if !self.at_line_start {
            self.out("\n");
        }
    }
}

/// Run `coli chat`.
pub fn run(args: ChatArgs) -> Result<()> {
    install_sigint()?;
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("OPENAI_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let (mut server, url) = match &args.model {
        Some(m) => {
            let (s, url) = LocalServer::start(m, api_key.as_deref())?;
            (Some(s), url)
        }
        None => (None, args.url.clone().unwrap_or_else(|| DEFAULT_URL.into())),
    };
    let client = Client {
        base: BaseUrl::parse(&url)?,
        api_key,
        interrupt: &INTERRUPTED,
    };
    let shown = client.base.display();
    if let (Some(s), Some(m)) = (server.as_mut(), &args.model) {
        s.wait_ready(&client, m, LOAD_DEADLINE).map_err(|e| {
            if is_interrupted(&e) {
                anyhow!("interrupted while loading {m}")
            } else {
                e
            }
        })?;
    }
    let models = client
        .models()
        .map_err(|e| anyhow!("{}", explain(&e, &shown)))?;
    let model = match &args.model_name {
        Some(m) => m.clone(),
        None => models.first().cloned().with_context(|| {
            format!(
                "{shown} serves no models (GET /v1/models is empty); name one with --model-name"
            )
        })?,
    };
    if !models.is_empty() && !models.contains(&model) {
        eprintln!(
            "coli chat: warning: {shown} lists {}, not `{model}`; sending `{model}` anyway",
            models.join(", ")
        );
    }
    eprintln!("coli chat: {shown}, model `{model}`. /help for commands, Ctrl-D to leave.");
    let mut ui = Ui {
        tty: io::stdout().is_terminal(),
        at_line_start: true,
        in_reasoning: false,
    };
    let mut conv = Conversation {
        system: args.system.clone(),
        turns: Vec::new(),
    };
    let mut reader = LineReader::new(io::stdin());
    let mut composer = Composer::default();
    loop {
        ui.out(if composer.pending() { "… " } else { "> " });
        let line = match reader.next_line(&INTERRUPTED)? {
            Line::Text(l) => l,
            Line::Eof => {
                ui.end_line();
                return Ok(());
            }
            Line::Interrupted => {
                ui.end_line();
                return Ok(());
            }
        };
        let Some(text) = composer.feed(&line) else {
            continue;
        };
        match parse_input(&text) {
            Input::Empty => {}
            Input::Quit => return Ok(()),
            Input::Help => eprintln!("{HELP}"),
            Input::Unknown(why) => eprintln!("coli chat: {why}"),
            Input::Reset => {
                conv.turns.clear();
                eprintln!("coli chat: conversation cleared");
            }
            Input::System(s) => {
                let said = if s.is_some() { "set" } else { "removed" };
                conv.system = s;
                conv.turns.clear();
                eprintln!("coli chat: system message {said}; conversation cleared");
            }
            Input::Save(file) => {
                let messages = conv.messages(true);
                let bytes = serde_json::to_vec_pretty(&messages)?;
                match write_atomic(Path::new(&file), &bytes) {
                    Ok(()) => eprintln!("coli chat: saved {} messages to {file}", messages.len()),
                    Err(e) => eprintln!("coli chat: /save: {e:#}"),
                }
            }
            Input::Message(m) => {
                INTERRUPTED.store(false, Ordering::SeqCst);
                conv.turns.push(Message::new("user", m));
                let mut body = json!({
                    "model": model,
                    "messages": conv.messages(false),
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
                if let Some(t) = args.temperature {
                    body["temperature"] = json!(t);
                }
                if let Some(n) = args.max_tokens {
                    body["max_tokens"] = json!(n);
                }
                if let Some(s) = args.seed {
                    body["seed"] = json!(s);
                }
                ui.in_reasoning = false;
                let result = client.stream_chat(&body, &mut |p| ui.piece(p));
                INTERRUPTED.store(false, Ordering::SeqCst);
                ui.end_line();
                match result {
                    Ok(a) if a.interrupted && a.content.is_empty() => {
                        conv.turns.pop();
                        eprintln!("coli chat: interrupted before the answer began (not kept)");
                    }
                    Ok(a) => {
                        let footer = a.footer();
                        let footer = ui.dim(&footer);
                        ui.out(&format!("{footer}\n"));
                        conv.turns.push(Message {
                            role: "assistant",
                            content: a.content,
                            interrupted: a.interrupted,
                        });
                    }
                    Err(e) => {
                        conv.turns.pop();
                        eprintln!("coli chat: {}", explain(&e, &shown));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn chunked_decoder_whole_and_split_at_every_byte() {
        let wire = b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\nJUNK";
        let mut out = Vec::new();
        let mut d = ChunkedDecoder::new();
        d.feed(wire, &mut out).unwrap();
        assert!(d.is_done());
        assert_eq!(out, b"hello, world");
        for split in 0..wire.len() {
            let mut out = Vec::new();
            let mut d = ChunkedDecoder::new();
            d.feed(&wire[..split], &mut out).unwrap();
            d.feed(&wire[split..], &mut out).unwrap();
            assert!(d.is_done(), "split at {split}");
            assert_eq!(out, b"hello, world", "split at {split}");
        }
        // One byte at a time, with hex sizes above 9 and bare-LF line ends.
        let body: Vec<u8> = (0..26u8).map(|i| b'a' + i).collect();
        let mut wire = b"1a\n".to_vec();
        wire.extend_from_slice(&body);
        wire.extend_from_slice(b"\n0\n\n");
        let mut out = Vec::new();
        let mut d = ChunkedDecoder::new();
        for b in &wire {
            assert!(!d.is_done());
            d.feed(std::slice::from_ref(b), &mut out).unwrap();
        }
        assert!(d.is_done());
        assert_eq!(out, body);
    }

    #[test]
    fn chunked_decoder_rejects_malformed_input() {
        let mut out = Vec::new();
        assert!(ChunkedDecoder::new().feed(b"zz\r\n", &mut out).is_err());
        assert!(ChunkedDecoder::new()
            .feed(b"2\r\nabc\r\n", &mut out)
            .is_err());
        assert!(ChunkedDecoder::new().feed(&[b'1'; 5000], &mut out).is_err());
        // Incomplete is not an error, just not done.
        let mut d = ChunkedDecoder::new();
        d.feed(b"5\r\nhel", &mut out).unwrap();
        assert!(!d.is_done());
    }

    #[test]
    fn sse_parser_events_comments_and_splits() {
        let wire = b": keep-alive\n\ndata: {\"a\":1}\n\nevent: x\r\ndata: line1\r\ndata:line2\r\n\r\n:\n\ndata: [DONE]\n\ndata: unterminated";
        let want = vec!["{\"a\":1}", "line1\nline2", "[DONE]"];
        let mut p = SseParser::default();
        assert_eq!(p.feed(wire), want);
        for split in 0..wire.len() {
            let mut p = SseParser::default();
            let mut got = p.feed(&wire[..split]);
            got.extend(p.feed(&wire[split..]));
            assert_eq!(got, want, "split at {split}");
        }
        let mut p = SseParser::default();
        let got: Vec<String> = wire.iter().flat_map(|b| p.feed(&[*b])).collect();
        assert_eq!(got, want);
        // `data` with no colon is an empty data line.
        assert_eq!(SseParser::default().feed(b"data\n\n"), vec![String::new()]);
    }

    #[test]
    fn urls() {
        let u = BaseUrl::parse("http://127.0.0.1:8080").unwrap();
        assert_eq!(
            u,
            BaseUrl {
                host: "127.0.0.1".into(),
                port: 8080,
                prefix: String::new()
            }
        );
        assert_eq!(u.display(), "http://127.0.0.1:8080");
        let u = BaseUrl::parse("http://example.com/v1/").unwrap();
        assert_eq!((u.port, u.prefix.as_str()), (80, ""));
        assert_eq!(u.host_header(), "example.com");
        let u = BaseUrl::parse("localhost:9000/proxy/v1").unwrap();
        assert_eq!((u.host.as_str(), u.port), ("localhost", 9000));
        assert_eq!(u.prefix, "/proxy");
        let u = BaseUrl::parse("http://[::1]:8080/").unwrap();
        assert_eq!(u.host, "::1");
        assert_eq!(u.host_header(), "[::1]:8080");
        let https = BaseUrl::parse("https://api.example.com").unwrap_err();
        assert!(format!("{https}").contains("https is not supported"));
        assert!(BaseUrl::parse("ftp://x").is_err());
        assert!(BaseUrl::parse("http://host:notaport").is_err());
        assert!(BaseUrl::parse("http://:80").is_err());
    }

    #[test]
    fn response_heads() {
        let (status, reason, headers) = parse_head(
            b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\ncontent-length: 12",
        )
        .unwrap();
        assert_eq!((status, reason.as_str()), (401, "Unauthorized"));
        assert_eq!(headers[1], ("content-length".into(), "12".into()));
        assert!(parse_head(b"SSH-2.0-OpenSSH").is_err());
        assert!(parse_head(b"HTTP/1.1 abc\r\n").is_err());
    }

    #[test]
    fn composer_continuations_and_blocks() {
        let mut c = Composer::default();
        assert_eq!(c.feed("hello"), Some("hello".into()));
        assert_eq!(c.feed("one \\"), None);
        assert!(c.pending());
        assert_eq!(c.feed("two\\"), None);
        assert_eq!(c.feed("three"), Some("one \ntwo\nthree".into()));
        assert!(!c.pending());
        assert_eq!(c.feed("\"\"\""), None);
        assert_eq!(c.feed("a line \\"), None);
        assert_eq!(c.feed(""), None);
        assert_eq!(c.feed("last"), None);
        assert_eq!(c.feed("\"\"\""), Some("a line \\\n\nlast".into()));
        assert_eq!(c.feed("\"\"\"first"), None);
        assert_eq!(c.feed("end\"\"\""), Some("first\nend".into()));
        assert_eq!(c.feed("\"\"\"inline\"\"\""), Some("inline".into()));
        assert!(!c.pending());
    }

    #[test]
    fn inputs() {
        assert_eq!(parse_input("  "), Input::Empty);
        assert_eq!(parse_input("hi /there"), Input::Message("hi /there".into()));
        assert_eq!(
            parse_input("//etc/hosts"),
            Input::Message("/etc/hosts".into())
        );
        assert_eq!(parse_input("/reset"), Input::Reset);
        assert_eq!(
            parse_input("/system  You are terse. "),
            Input::System(Some("You are terse.".into()))
        );
        assert_eq!(parse_input("/system"), Input::System(None));
        assert_eq!(
            parse_input("/save a b.json"),
            Input::Save("a b.json".into())
        );
        assert!(matches!(parse_input("/save"), Input::Unknown(_)));
        assert_eq!(parse_input("/quit"), Input::Quit);
        assert_eq!(parse_input("/exit"), Input::Quit);
        assert_eq!(parse_input("/help"), Input::Help);
        assert!(matches!(parse_input("/frobnicate"), Input::Unknown(_)));
    }

    #[test]
    fn line_reader() {
        let flag = AtomicBool::new(false);
        let mut r = LineReader::new(io::Cursor::new(b"one\r\ntwo\n\nlast".to_vec()));
        let mut lines = Vec::new();
        loop {
            match r.next_line(&flag).unwrap() {
                Line::Text(t) => lines.push(t),
                Line::Eof => break,
                Line::Interrupted => unreachable!(),
            }
        }
        assert_eq!(lines, ["one", "two", "", "last"]);
        flag.store(true, Ordering::SeqCst);
        let mut r = LineReader::new(io::Cursor::new(Vec::new()));
        assert_eq!(r.next_line(&flag).unwrap(), Line::Interrupted);
        assert!(!flag.load(Ordering::SeqCst));
        assert_eq!(r.next_line(&flag).unwrap(), Line::Eof);
    }

    #[test]
    fn footers() {
        let t0 = Instant::now();
        let mut a = Answer {
            usage: Some(WireUsage {
                completion_tokens: 11,
                prompt_tokens_details: Some(WireDetails { cached_tokens: 42 }),
            }),
            finish: Some("stop".into()),
            first: Some(t0),
            last: Some(t0 + Duration::from_secs(2)),
            ..Answer::default()
        };
        assert_eq!(
            a.footer(),
            "[11 tokens, 5.0 tok/s, 42 cached prompt tokens, finish: stop]"
        );
        a.usage = None;
        a.pieces = 3;
        a.interrupted = true;
        assert_eq!(
            a.footer(),
            "[~3 tokens, 1.0 tok/s, ? cached prompt tokens, finish: interrupted]"
        );
        let one = Answer {
            usage: Some(WireUsage {
                completion_tokens: 1,
                prompt_tokens_details: None,
            }),
            finish: Some("length".into()),
            ..Answer::default()
        };
        assert_eq!(
            one.footer(),
            "[1 token, – tok/s, 0 cached prompt tokens, finish: length]"
        );
    }

    #[test]
    fn save_is_atomic_and_openai_shaped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chat.json");
        let conv = Conversation {
            system: Some("be brief".into()),
            turns: vec![
                Message::new("user", "hi"),
                Message {
                    role: "assistant",
                    content: "hel".into(),
                    interrupted: true,
                },
            ],
        };
        std::fs::write(&path, b"old").unwrap();
        write_atomic(&path, &serde_json::to_vec(&conv.messages(true)).unwrap()).unwrap();
        let saved: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(
            saved,
            json!([
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hel", "interrupted": true},
            ])
        );
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["chat.json"]);
        // The wire form never carries the marker.
        assert!(conv
            .messages(false)
            .iter()
            .all(|m| m.get("interrupted").is_none()));
        assert!(write_atomic(&dir.path().join("missing/x.json"), b"{}").is_err());
    }

    /// A one-shot HTTP server on a loopback port: reads one request, then runs `respond`.
    fn fake_server(
        respond: impl FnOnce(TcpStream, String) + Send + 'static,
    ) -> (String, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let handle = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut req = Vec::new();
            let mut tmp = [0u8; 4096];
            // Head, then Content-Length bytes of body.
            let (head_end, len) = loop {
                let n = s.read(&mut tmp).unwrap();
                req.extend_from_slice(&tmp[..n]);
                if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&req[..i]).to_ascii_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse::<usize>().unwrap());
                    break (i + 4, len);
                }
            };
            while req.len() < head_end + len {
                let n = s.read(&mut tmp).unwrap();
                req.extend_from_slice(&tmp[..n]);
            }
            respond(s, String::from_utf8_lossy(&req).into_owned());
        });
        (url, handle)
    }

    fn chunk(s: &mut TcpStream, data: &str) {
        s.write_all(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes())
            .unwrap();
        s.flush().unwrap();
    }

    fn sse_chunk(content: &str) -> String {
        format!(
            "data: {}\n\n",
            json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": null}]})
        )
    }

    #[test]
    fn streams_a_chunked_sse_answer() {
        static FLAG: AtomicBool = AtomicBool::new(false);
        let (url, server) = fake_server(|mut s, req| {
            assert!(
                req.starts_with("POST /v1/chat/completions HTTP/1.1\r\n"),
                "{req}"
            );
            assert!(req.contains("Authorization: Bearer sekrit\r\n"), "{req}");
            let body: Value = serde_json::from_str(req.split("\r\n\r\n").nth(1).unwrap()).unwrap();
            assert_eq!(body["stream_options"]["include_usage"], json!(true));
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                .unwrap();
            chunk(&mut s, &sse_chunk(""));
            chunk(&mut s, ":\n\n");
            // An event split across chunks, and two events in one.
            let hello = sse_chunk("Hel");
            chunk(&mut s, &hello[..10]);
            chunk(&mut s, &hello[10..]);
            chunk(&mut s, &(sse_chunk("lo") + &sse_chunk(" wörld")));
            let fin = json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
            chunk(&mut s, &format!("data: {fin}\n\n"));
            let usage = json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 7}}});
            chunk(&mut s, &format!("data: {usage}\n\ndata: [DONE]\n\n"));
            s.write_all(b"0\r\n\r\n").unwrap();
        });
        let client = Client {
            base: BaseUrl::parse(&url).unwrap(),
            api_key: Some("sekrit".into()),
            interrupt: &FLAG,
        };
        let mut seen = Vec::new();
        let a = client
            .stream_chat(
                &json!({"messages": [], "stream_options": {"include_usage": true}}),
                &mut |p| {
                    if let Piece::Content(c) = p {
                        seen.push(c.to_string())
                    }
                },
            )
            .unwrap();
        server.join().unwrap();
        assert_eq!(seen, ["Hel", "lo", " wörld"]);
        assert_eq!(a.content, "Hello wörld");
        assert_eq!(a.finish.as_deref(), Some("stop"));
        assert!(!a.interrupted);
        assert!(a.footer().starts_with("[3 tokens, "));
        assert!(a
            .footer()
            .ends_with(" tok/s, 7 cached prompt tokens, finish: stop]"));
    }

    #[test]
    fn error_statuses_and_stream_errors_carry_the_servers_message() {
        static FLAG: AtomicBool = AtomicBool::new(false);
        let (url, server) = fake_server(|mut s, _| {
            let body = r#"{"error":{"message":"invalid API key","type":"authentication_error","param":null,"code":"invalid_api_key"}}"#;
            write!(
                s,
                "HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
        });
        let client = Client {
            base: BaseUrl::parse(&url).unwrap(),
            api_key: None,
            interrupt: &FLAG,
        };
        let e = client.stream_chat(&json!({}), &mut |_| {}).unwrap_err();
        server.join().unwrap();
        let line = explain(&e, &url);
        assert!(line.contains("401 Unauthorized: invalid API key"), "{line}");
        assert!(line.contains("--api-key"), "{line}");
        assert!(line.starts_with(&url), "{line}");

        // An error event in a close-delimited stream.
        let (url, server) = fake_server(|mut s, _| {
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
                .unwrap();
            s.write_all(sse_chunk("partial").as_bytes()).unwrap();
            s.write_all(b"data: {\"error\": {\"message\": \"engine error: boom\", \"type\": \"server_error\"}}\n\ndata: [DONE]\n\n")
                .unwrap();
        });
        let client = Client {
            base: BaseUrl::parse(&url).unwrap(),
            ..client
        };
        let e = client.stream_chat(&json!({}), &mut |_| {}).unwrap_err();
        server.join().unwrap();
        assert!(explain(&e, &url).contains("engine error: boom"), "{e:#}");
    }

    #[test]
    fn connection_refused_names_the_url_and_the_fix() {
        static FLAG: AtomicBool = AtomicBool::new(false);
        // Bind then drop a listener: its port is (almost certainly) closed now.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let client = Client {
            base: BaseUrl::parse(&url).unwrap(),
            api_key: None,
            interrupt: &FLAG,
        };
        let e = client.models().unwrap_err();
        let line = explain(&e, &url);
        assert!(
            line.contains(&url) && line.contains("connection refused"),
            "{line}"
        );
        assert!(line.contains("coli serve"), "{line}");
    }

    #[test]
    fn ctrl_c_stops_a_stream_and_keeps_what_arrived() {
        static FLAG: AtomicBool = AtomicBool::new(false);
        let (url, server) = fake_server(|mut s, _| {
            s.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                .unwrap();
            chunk(&mut s, &sse_chunk("one "));
            chunk(&mut s, &sse_chunk("two"));
            // The client presses Ctrl-C once it has printed "two"; wait for it to hang up.
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            // A close with bytes still unread (the chunk's CRLF) is a reset rather than a FIN.
            let mut buf = [0u8; 16];
            match s.read(&mut buf) {
                Ok(0) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
                other => panic!("the client should have hung up: {other:?}"),
            }
        });
        let client = Client {
            base: BaseUrl::parse(&url).unwrap(),
            api_key: None,
            interrupt: &FLAG,
        };
        let a = client
            .stream_chat(&json!({}), &mut |p| {
                if p == Piece::Content("two") {
                    FLAG.store(true, Ordering::SeqCst);
                }
            })
            .unwrap();
        server.join().unwrap();
        assert!(a.interrupted);
        assert_eq!(a.content, "one two");
        assert!(
            a.footer().ends_with("finish: interrupted]"),
            "{}",
            a.footer()
        );
    }
}
