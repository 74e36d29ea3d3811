//! Helpers shared by the `coli` binary's integration tests: the committed engine fixtures and
//! a `coli` command that never touches the user's cache or state directories.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The committed transformers fixture `name` (engine/tests/fixtures).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures")
        .join(name)
}

/// The fixture's `reference.json`.
pub fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

/// Point a command's cache and state directories at test-only places under the temp dir.
pub fn isolated(cmd: &mut Command) -> &mut Command {
    cmd.env(
        "COLI_CACHE_DIR",
        std::env::temp_dir().join("coli-test-cache-unused"),
    )
    .env(
        "COLI_STATE_DIR",
        std::env::temp_dir().join("coli-test-state"),
    )
}

/// `coli ARGS`, run to completion.
pub fn coli(args: &[&str]) -> Output {
    isolated(Command::new(env!("CARGO_BIN_EXE_coli")).args(args))
        .output()
        .expect("coli runs")
}

/// One HTTP/1.1 request to `127.0.0.1:port` on a new connection (JSON body, `Connection:
/// close`, 120 s read timeout): (status, body), or `None` if it could not be sent or read.
pub fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    http_with_head(port, method, path, body).map(|(status, _, body)| (status, body))
}

/// [`http`], also giving the response's status line and headers as they came.
pub fn http_with_head(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
) -> Option<(u16, String, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    Some((status, head.to_string(), body.to_string()))
}

/// Poll `f` until it gives a value; fail after `secs` seconds, saying what was awaited.
pub fn wait_for<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < end,
            "timed out after {secs} s waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Send SIGTERM to process `pid` (asserting `kill` could).
pub fn sigterm(pid: u32) {
    assert!(Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

/// A spawned `coli serve` whose stderr a thread collects; killed when dropped.
pub struct Served {
    /// The process.
    pub child: Child,
    /// The port it listens on (0 until [`Served::wait_ready`] has read it).
    pub port: u16,
    log: Arc<Mutex<String>>,
}

impl Served {
    /// Spawn `cmd` (a `coli serve`), stdin and stdout null, its stderr collected.
    pub fn spawn(cmd: &mut Command) -> Served {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("coli serve starts");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("piped stderr");
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        Served {
            child,
            port: 0,
            log,
        }
    }

    /// Wait for the `listening` line of a server on `127.0.0.1` (its port is read from it),
    /// then until `/ready` answers 200; fails if the server exits first.
    pub fn wait_ready(mut self) -> Served {
        const LISTENING: &str = "coli: listening on http://127.0.0.1:";
        self.port = wait_for(60, "the `listening` line", || {
            self.check_running();
            let log = self.log();
            let rest = &log[log.find(LISTENING)? + LISTENING.len()..];
            rest.split_whitespace().next()?.parse().ok()
        });
        wait_for(120, "/ready", || {
            self.check_running();
            let (status, _) = http(self.port, "GET", "/ready", "")?;
            (status == 200).then_some(())
        });
        self
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Fail, with the log, if the server has exited.
    pub fn check_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("coli serve exited with {status}:\n{}", self.log());
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An error message `e` about a command-line `option` (`--kv-dtype`) names it, as the flag or
/// as its configuration key (`kv_dtype`).
pub fn assert_names_option(e: &str, option: &str) {
    assert!(
        e.contains(option.trim_start_matches("--").replace('-', "_").as_str())
            || e.contains(option),
        "the message names the option: {e}"
    );
}
