//! `coli chat`: the terminal client of `coli serve` (or of any OpenAI-compatible server).
//!
//! This file owns the command around the HTTP client (the `colibri-client` crate, which speaks
//! to the server and parses the streamed answers): the REPL (multi-line input, `/reset`,
//! `/system`, `/save`, `/help`, `/quit`) that prints tokens as they stream, the SIGINT handling
//! that stops an answer without leaving the REPL, the one-line explanations of failures, and
//! `--model`, which runs `coli serve` as a child process on a free port for the length of the
//! session.

use std::collections::VecDeque;
use std::io::{self, IsTerminal, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use colibri::format::write::write_atomic;
use colibri_client::{
    is_connection_refused, is_interrupted, Client, HttpStatusError, Interrupted, Options, Piece,
    StreamError,
};
use serde_json::{json, Value};

/// Arguments of `coli chat`.
#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    /// Server URL (default http://127.0.0.1:8080); http:// or https:// (the system's trust
    /// store; `SSL_CERT_FILE` names another).
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
/// How often waits look at the Ctrl-C flag.
const POLL: Duration = colibri_client::POLL;
/// How long `--model` waits for the model to load.
const LOAD_DEADLINE: Duration = Duration::from_secs(600);

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

/// Block SIGINT on the calling thread (the HTTP client's threads), so that it lands on the
/// main thread, where it interrupts the blocked stdin read.
fn block_sigint_here() {
    // SAFETY: plain signal-mask calls on a valid, initialised set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
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
    if is_connection_refused(e) {
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

/// The terminal's `NOFLSH` mode while `coli chat` runs. Without it, typing Ctrl-C makes the
/// terminal discard output already written but not yet shown, so the screen would lack text
/// the interrupted answer keeps. The previous mode is restored on drop.
struct KeepOutputOnInterrupt {
    saved: Option<libc::termios>,
}

impl KeepOutputOnInterrupt {
    fn new() -> KeepOutputOnInterrupt {
        // SAFETY: a zeroed `termios` is a valid value for `tcgetattr` to fill; both calls only
        // read or write that struct, and fail (changing nothing) when stdin is not a terminal.
        unsafe {
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(libc::STDIN_FILENO, &mut t) != 0 {
                return KeepOutputOnInterrupt { saved: None };
            }
            let saved = t;
            t.c_lflag |= libc::NOFLSH;
            if libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &t) != 0 {
                return KeepOutputOnInterrupt { saved: None };
            }
            KeepOutputOnInterrupt { saved: Some(saved) }
        }
    }
}

impl Drop for KeepOutputOnInterrupt {
    fn drop(&mut self) {
        if let Some(t) = &self.saved {
            // SAFETY: `t` is the mode `tcgetattr` returned for this terminal.
            unsafe {
                libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, t);
            }
        }
    }
}

/// Run `coli chat`.
pub fn run(args: ChatArgs) -> Result<()> {
    install_sigint()?;
    let _terminal = KeepOutputOnInterrupt::new();
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
    let client = Client::new(
        &url,
        Options {
            api_key,
            interrupt: &INTERRUPTED,
            on_thread_start: Some(block_sigint_here),
        },
    )?;
    let shown = client.display();
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

    #[test]
    fn explanations_name_the_url_and_the_fix() {
        let url = "http://127.0.0.1:9";
        let e: anyhow::Error = HttpStatusError {
            status: 401,
            reason: "Unauthorized".into(),
            message: "invalid API key".into(),
            code: Some("invalid_api_key".into()),
        }
        .into();
        let line = explain(&e, url);
        assert!(line.starts_with(url), "{line}");
        assert!(line.contains("401 Unauthorized: invalid API key"), "{line}");
        assert!(line.contains("--api-key"), "{line}");
        let e: anyhow::Error = StreamError("engine error: boom".into()).into();
        assert!(explain(&e, url).contains("engine error: boom"));

        // A real refused connection: bind then drop a listener, so its port is closed.
        static FLAG: AtomicBool = AtomicBool::new(false);
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("http://127.0.0.1:{port}");
        let client = Client::new(
            &url,
            Options {
                api_key: None,
                interrupt: &FLAG,
                on_thread_start: None,
            },
        )
        .unwrap();
        let line = explain(&client.models().unwrap_err(), &url);
        assert!(
            line.contains(&url) && line.contains("connection refused"),
            "{line}"
        );
        assert!(line.contains("coli serve"), "{line}");
    }
}
