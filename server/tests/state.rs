//! State on disk through a `kill -9` of `coli serve`. The expert usage history is saved while
//! the server runs (whenever it goes idle, and every `--history-save-secs` during a long
//! request), so a server killed in the middle of a request leaves a valid history holding what
//! it had learned by its last save. The next start removes the temporaries that processes
//! which ended left in the state and prefix-cache directories, but never those of a live
//! process, and refuses a KV file whose checksum is right but whose values are not finite,
//! naming the file.

#[path = "../../engine/tests/namespace/mod.rs"]
mod namespace;
mod support;
use support::{wait_for, Served};

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use colibri::runtime::kv_file;
use colibri::store::history::{self, UsageHistory};

/// The synthesized model: big enough that a long request decodes for seconds, small enough
/// to write in a moment.
const LAYERS: usize = 4;
const EXPERTS: usize = 8;

/// `--history-save-secs` of the servers.
const SAVE_SECS: u64 = 1;

fn coli() -> Command {
    Command::new(env!("CARGO_BIN_EXE_coli"))
}

/// Run `cmd` to completion; it must succeed.
fn run_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The directories a server works with.
struct Dirs {
    _root: tempfile::TempDir,
    model: PathBuf,
    state: PathBuf,
    cache: PathBuf,
    prefix: PathBuf,
    work: PathBuf,
}

impl Dirs {
    fn new() -> Dirs {
        let root = tempfile::tempdir().unwrap();
        let p = root.path();
        let dirs = Dirs {
            model: p.join("model"),
            state: p.join("state"),
            cache: p.join("cache"),
            prefix: p.join("prefix"),
            work: p.join("work"),
            _root: root,
        };
        std::fs::create_dir_all(&dirs.work).unwrap();
        let (layers, experts) = (LAYERS.to_string(), EXPERTS.to_string());
        run_ok(
            coli()
                .args([
                    "synth", "--arch", "olmoe", "--layers", &layers, "--hidden", "512",
                ])
                .args([
                    "--experts",
                    &experts,
                    "--top-k",
                    "2",
                    "--moe-intermediate",
                    "256",
                ])
                .args(["--vocab", "1024", "--out"])
                .arg(&dirs.model)
                .env("COLI_CACHE_DIR", &dirs.cache)
                .env("COLI_STATE_DIR", &dirs.state),
        );
        dirs
    }

    fn fingerprint(&self) -> String {
        history::fingerprint(&self.model).unwrap()
    }

    /// The usage history file.
    fn history(&self) -> PathBuf {
        UsageHistory::path(&self.state, &self.fingerprint()).unwrap()
    }

    /// `tokens` of the history file as it is now (read without side effects), if it parses.
    fn saved_tokens(&self) -> Option<u64> {
        let bytes = std::fs::read(self.history()).ok()?;
        let v: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
        v["tokens"].as_u64()
    }
}

/// A `coli serve` process.
struct Server(Served);

impl std::ops::Deref for Server {
    type Target = Served;
    fn deref(&self) -> &Served {
        &self.0
    }
}

impl std::ops::DerefMut for Server {
    fn deref_mut(&mut self) -> &mut Served {
        &mut self.0
    }
}

impl Server {
    /// Start a server on `dirs` and wait until it is ready.
    fn start(dirs: &Dirs) -> Server {
        Server(Served::spawn(Server::serve(&mut coli(), dirs)).wait_ready())
    }

    /// `cmd` (`coli`, or a wrapper that ends by running it) given `serve` and its arguments
    /// and environment on `dirs`.
    fn serve<'a>(cmd: &'a mut Command, dirs: &Dirs) -> &'a mut Command {
        cmd.args(["serve", "--model"])
            .arg(&dirs.model)
            .args(["--host", "127.0.0.1", "--port", "0", "--slots", "1"])
            .args(["--threads", "1", "--drain-secs", "5"])
            .arg("--history-save-secs")
            .arg(SAVE_SECS.to_string())
            .arg("--prefix-cache-dir")
            .arg(&dirs.prefix)
            .env("COLI_STATE_DIR", &dirs.state)
            .env("COLI_CACHE_DIR", &dirs.cache)
            .current_dir(&dirs.work)
    }

    /// One request on a new connection: (status, body), or `None` if it could not be sent.
    fn try_request(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Option<(u16, String)> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        support::http(self.port, method, path, &body)
    }

    /// A completion; returns its JSON.
    fn complete(&self, prompt: &str, max_tokens: u64) -> serde_json::Value {
        let body = serde_json::json!({
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
        });
        let (status, text) = self
            .try_request("POST", "/v1/completions", Some(&body))
            .expect("the server answers");
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    /// Start a streamed completion; its SSE lines are read from the returned reader.
    fn stream(&self, prompt: &str, max_tokens: u64) -> BufReader<TcpStream> {
        let body = serde_json::json!({
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
            "stream": true,
        })
        .to_string();
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        BufReader::new(s)
    }

    fn kill9(&mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }

    fn terminate(&mut self) -> ExitStatus {
        support::sigterm(self.child.id());
        wait_for(60, "the server to exit after SIGTERM", || {
            self.child.try_wait().unwrap()
        })
    }
}

/// The next SSE `data:` payload of a stream, or `None` at its end.
fn next_event(stream: &mut BufReader<TcpStream>) -> Option<String> {
    let mut line = String::new();
    loop {
        line.clear();
        if stream.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if let Some(data) = line.trim_end().strip_prefix("data: ") {
            return (data != "[DONE]").then(|| data.to_string());
        }
    }
}

/// A process id that is not running: a child that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// A live process (ended when dropped).
struct Live(Child);

impl Drop for Live {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The sorted file names in `dir`.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn a_killed_server_keeps_its_last_saved_history_and_the_next_start_cleans_up() {
    let dirs = Dirs::new();
    let shape = vec![EXPERTS; LAYERS];
    let mut server = Server::start(&dirs);

    // 1. A short request; when it ends the engine goes idle and saves: the history holds
    //    every token it ran (the prompt and all generated tokens but the last).
    let a = server.complete("The history of the engine", 4);
    let ran = a["usage"]["prompt_tokens"].as_u64().unwrap()
        + a["usage"]["completion_tokens"].as_u64().unwrap()
        - 1;
    let first = wait_for(
        60,
        "the history saved at the end of the first request",
        || dirs.saved_tokens().filter(|&t| t >= ran),
    );

    // 2. A long request. While it streams (its batch has not ended), the periodic save
    //    writes what it learned so far, again and again; the server is killed mid-request,
    //    a few events after the second such save (a moment unrelated to the save schedule).
    let mut stream = server.stream("Keep talking about experts", 4000);
    let started = Instant::now();
    let (mut events, mut saves, mut last, mut after) = (0u64, 0, first, 0);
    while saves < 2 || after < 10 {
        if next_event(&mut stream).is_none() {
            panic!(
                "the request ended ({events} events in {:.1} s, {saves} saves seen) before two \
                 periodic saves: the test needs a request longer than 2 × --history-save-secs",
                started.elapsed().as_secs_f64()
            );
        }
        events += 1;
        if saves == 2 {
            after += 1;
        }
        if let Some(t) = dirs.saved_tokens().filter(|&t| t > last) {
            (saves, last) = (saves + 1, t);
        }
    }
    server.kill9();
    let killed = std::time::SystemTime::now();
    let killed_after = started.elapsed().as_secs_f64();
    drop(stream);

    // The history left is a valid one for this model, holding at least the last save seen
    // and at most one save interval old (doubled, and a second more, for a loaded machine).
    let (h, warning) = UsageHistory::load(&dirs.state, &dirs.fingerprint(), &shape).unwrap();
    assert_eq!(warning, None, "the history is valid after kill -9");
    assert!(h.tokens() >= last, "{} < {last}", h.tokens());
    assert!(!h.is_empty());
    let saved_at_kill = h.tokens();
    let modified = std::fs::metadata(dirs.history())
        .unwrap()
        .modified()
        .unwrap();
    let age = killed
        .duration_since(modified)
        .unwrap_or_default()
        .as_secs_f64();
    eprintln!(
        "history after the first request: {first} tokens; killed {killed_after:.2} s into the \
         long request, after {saves} periodic saves; the history left holds {saved_at_kill} \
         tokens, saved {age:.3} s before the kill"
    );
    assert!(
        age <= 2.0 * SAVE_SECS as f64 + 1.0,
        "the history left was saved {age:.2} s before the kill (--history-save-secs {SAVE_SECS})"
    );

    // 3. Leftovers: temporaries of a process that ended and of a live one (a `sleep` sharing
    //    the directories), in the state directory and the prefix cache directory; and a slot
    //    KV file whose checksum is right but which holds a NaN.
    let dead = dead_pid();
    let sharer = Live(Command::new("sleep").arg("600").spawn().unwrap());
    let live = sharer.0.id();
    let usage = dirs.history().parent().unwrap().to_path_buf();
    let fp_json = format!("{}.json", dirs.fingerprint());
    let stale = [
        usage.join(format!("{fp_json}.{dead}.tmp")),
        dirs.prefix.join(format!("slot-0.kv.{dead}.tmp")),
        dirs.prefix.join(format!("slot-3.kv.{dead}.tmp")),
    ];
    let kept = [
        usage.join(format!("{fp_json}.{live}.tmp")),
        dirs.prefix.join(format!("slot-1.kv.{live}.tmp")),
    ];
    std::fs::create_dir_all(&dirs.prefix).unwrap();
    for p in stale.iter().chain(&kept) {
        std::fs::write(p, b"{\"half\":").unwrap();
    }
    let conv_file = dirs.work.join("conv.kv");
    run_ok(
        coli()
            .args(["run", "--model"])
            .arg(&dirs.model)
            .args([
                "-p",
                "Hello",
                "--max-tokens",
                "3",
                "--temperature",
                "0",
                "--kv-file",
            ])
            .arg(&conv_file)
            .env("COLI_CACHE_DIR", &dirs.cache)
            .env("COLI_STATE_DIR", dirs.work.join("other-state")),
    );
    let fp = kv_file::model_fingerprint(&dirs.model).unwrap();
    let mut conv = kv_file::load(&conv_file, &fp).unwrap();
    conv.cache.layers[1].v.f32_mut()[5] = f32::NAN;
    let slot0 = dirs.prefix.join("slot-0.kv");
    kv_file::save(&slot0, &fp, &conv).unwrap();

    // 4. The next start removes the dead process's temporaries only, refuses the NaN file
    //    naming it, reads the history without complaint, and serves.
    let mut server = Server::start(&dirs);
    for p in &stale {
        assert!(
            !p.exists(),
            "{} was not removed:\n{}",
            p.display(),
            server.log()
        );
    }
    for p in &kept {
        assert!(p.exists(), "{} (a live process's) was removed", p.display());
    }
    // The server wrote the refusal before it answered /ready, but the thread collecting its
    // stderr may not have read it yet: wait for the line (a bounded wait, not a sleep).
    let refusal = format!(
        "{}: layer 1: value 5 of its `v` buffer is NaN",
        slot0.display()
    );
    let refused = |log: &str| {
        log.contains(&refusal)
            && log.contains("finite numbers only")
            && log.contains("slot 0 starts empty")
    };
    let log = wait_for(30, "the slot file's refusal in the server's log", || {
        Some(server.log()).filter(|log| refused(log))
    });
    assert!(refused(&log), "{log}");
    assert!(!log.contains("ignoring the expert usage history"), "{log}");
    let b = server.complete("The history of the engine", 4);
    assert_eq!(
        b["choices"][0]["text"], a["choices"][0]["text"],
        "the same greedy text as before the kill"
    );

    // 5. A clean stop saves the history and the slot, and leaves only the live temporaries.
    assert!(server.terminate().success(), "{}", server.log());
    let (h, warning) = UsageHistory::load(&dirs.state, &dirs.fingerprint(), &shape).unwrap();
    assert_eq!(warning, None);
    assert!(h.tokens() > saved_at_kill);
    assert_eq!(
        names(&usage),
        [fp_json.clone(), format!("{fp_json}.{live}.tmp")]
    );
    assert_eq!(
        names(&dirs.prefix),
        ["slot-0.kv".to_string(), format!("slot-1.kv.{live}.tmp")]
    );
    kv_file::load(&slot0, &fp).expect("the slot saved at shutdown is valid");
    drop(sharer);
}

/// A file's bytes, or `None` when it cannot be read.
fn bytes_of(path: &Path) -> Option<Vec<u8>> {
    std::fs::read(path).ok()
}

/// Every file under `dir` (relative path, bytes), sorted: temporaries show as themselves.
fn tree(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().to_path_buf();
                out.push((rel, bytes_of(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// A state directory and prefix-cache directory that refuse every write, for real — full
/// (`ENOSPC`: a tmpfs holding the old state, filled to its last block) or a read-only volume
/// (`EROFS`: a read-only bind mount) — cost warnings naming the file, never a request: the
/// server answers with the tokens a server with writable state gives, `/health` stays 200, the
/// old state stays byte for byte with no temporary beside it, and SIGTERM still ends it
/// cleanly. The mounts are made in a private user and mount namespace (`unshare -Urm`); where
/// that is not allowed the test says "skipped" and why.
#[test]
fn a_state_directory_that_refuses_writes_costs_warnings_not_requests() {
    if !namespace::private_mounts_or_skip("mount -t tmpfs tmpfs /mnt") {
        return;
    }
    let dirs = Dirs::new();
    const PROMPT: &str = "State that cannot be written";

    // The reference, with writable state: its stop leaves a history and a slot file, the
    // old state the refusing servers must keep.
    let mut server = Server::start(&dirs);
    let reference = server.complete(PROMPT, 6);
    assert!(server.terminate().success(), "{}", server.log());
    let old_state = tree(&dirs.state);
    let old_prefix = tree(&dirs.prefix);
    assert!(old_state.iter().any(|(p, _)| dirs.history().ends_with(p)));
    assert!(old_prefix.iter().any(|(p, _)| p.ends_with("slot-0.kv")));

    // Mount over each directory, then exec `coli serve`: `full` copies the old state into a
    // small tmpfs and fills the rest; `ro` bind-mounts it read-only.
    let script = r#"set -e
mode="$1"; shift
for d in "$STATE" "$PREFIX"; do
  if [ "$mode" = full ]; then
    keep="$WORK/kept-$(basename "$d")"
    mkdir "$keep"
    cp -a "$d/." "$keep/"
    mount -t tmpfs -o size=512k tmpfs "$d"
    cp -a "$keep/." "$d/"
    dd if=/dev/zero of="$d/filler" bs=64k 2>/dev/null || true
  else
    mount --bind "$d" "$d"
    mount -o remount,bind,ro "$d"
  fi
done
exec "$@""#;
    for (mode, reason) in [
        ("full", "No space left on device"),
        ("ro", "Read-only file system"),
    ] {
        let mut cmd = Command::new("unshare");
        cmd.args(["-Urm", "sh", "-c", script, "sh", mode])
            .arg(env!("CARGO_BIN_EXE_coli"))
            .env("STATE", &dirs.state)
            .env("PREFIX", &dirs.prefix)
            .env("WORK", &dirs.work);
        Server::serve(&mut cmd, &dirs);
        let mut server = Server(Served::spawn(&mut cmd).wait_ready());
        // The server's own view of its directories (its mount namespace).
        let root = PathBuf::from(format!("/proc/{}/root", server.child.id()));
        let seen = |d: &Path| root.join(d.strip_prefix("/").unwrap());

        for _ in 0..3 {
            let answer = server.complete(PROMPT, 6);
            assert_eq!(
                answer["choices"][0]["text"], reference["choices"][0]["text"],
                "{mode}: the same greedy text as with writable state"
            );
        }
        // Idle after a request, it tries to save the history, and says why it cannot.
        let history = dirs.history();
        let warning = wait_for(60, "the warning of the refused history save", || {
            server.check_running();
            let log = server.log();
            log.lines()
                .find(|l| l.contains("saving the expert usage history"))
                .map(str::to_string)
        });
        assert!(
            warning.contains(&history.file_name().unwrap().to_string_lossy().to_string())
                && warning.contains(reason),
            "{mode}: {warning}"
        );
        let (status, _) = support::http(server.port, "GET", "/health", "").unwrap();
        assert_eq!(status, 200, "{mode}: /health");
        // The old state as it was, and nothing beside it (but the filler of `full`).
        let without_filler = |t: Vec<(PathBuf, Vec<u8>)>| -> Vec<(PathBuf, Vec<u8>)> {
            t.into_iter()
                .filter(|(p, _)| p != Path::new("filler"))
                .collect()
        };
        assert!(
            without_filler(tree(&seen(&dirs.state))) == old_state,
            "{mode}: the state directory changed: {:?}",
            names(&seen(&dirs.state))
        );
        assert!(
            without_filler(tree(&seen(&dirs.prefix))) == old_prefix,
            "{mode}: the prefix-cache directory changed: {:?}",
            names(&seen(&dirs.prefix))
        );

        // A clean stop: the slot cannot be saved either; a warning, exit status 0.
        let status = server.terminate();
        let log = server.log();
        assert!(status.success(), "{mode}: {status}\n{log}");
        assert!(
            log.lines()
                .any(|l| l.contains("slot 0 not saved") && l.contains(reason)),
            "{mode}: the refused slot save is reported:\n{log}"
        );
        assert!(!log.contains("panicked"), "{mode}:\n{log}");
        for line in log.lines().filter(|l| l.contains(reason)) {
            eprintln!("{mode}: {line}");
        }
    }
    // Nothing the refusing servers did reached the real directories.
    assert!(tree(&dirs.state) == old_state && tree(&dirs.prefix) == old_prefix);
}
