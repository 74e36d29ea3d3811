//! A fake Hugging Face Hub on 127.0.0.1 for `coli pull`'s tests (no network): the Hub's API
//! and file layout for one repository at one commit, plus a second listener standing in for
//! the CDN that LFS files redirect to. Every request is logged (server, path, `Range`,
//! `Authorization`, status), and faults can be set while it runs: bytes corrupted once or
//! always, a transfer stalled or cut after N bytes, `Range` ignored, a gated repository, a
//! size the tree misstates, extra tree entries.
//!
//! Routes, as the Hub answers them:
//! - `GET /api/models/{org}/{name}/revision/{rev}`: `{"id", "sha", "siblings": [{"rfilename"}]}`
//!   for `main` or the commit, else 404 `X-Error-Code: RevisionNotFound`;
//! - `GET /api/models/{org}/{name}/tree/{rev}?recursive=true[&cursor=N]`: `[{"type": "file",
//!   "path", "size", "oid", "lfs": {"oid", "size", "pointerSize"}}]`, `page_size` entries a
//!   page, the next page in `Link: <…>; rel="next"`;
//! - `GET /{org}/{name}/resolve/{rev}/{path}`: small files answered directly (`ETag` = git
//!   blob id), LFS files (`*.safetensors`, `*.gguf`, `*.bin`) with 302 to the CDN (`X-Linked-Etag`
//!   = SHA-256, `X-Linked-Size`); both with `X-Repo-Commit`;
//! - CDN `GET /cdn/{sha256}?sig=…`: the bytes, `Range` honoured; a request that carries an
//!   `Authorization` header is refused with 400, as a presigned-URL store does.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use ring::digest::{digest, SHA1_FOR_LEGACY_USE_ONLY, SHA256};

/// The token a gated fake repository accepts.
pub const TOKEN: &str = "hf_test_token";

/// One file of the fake repository.
#[derive(Clone, Debug)]
pub struct HubFile {
    pub path: String,
    pub bytes: Arc<Vec<u8>>,
    pub sha256: String,
    pub git_oid: String,
    pub lfs: bool,
}

impl HubFile {
    pub fn new(path: &str, bytes: Vec<u8>) -> HubFile {
        let lfs = [".safetensors", ".gguf", ".bin"]
            .iter()
            .any(|ext| path.ends_with(ext));
        let mut blob = format!("blob {}\0", bytes.len()).into_bytes();
        blob.extend_from_slice(&bytes);
        HubFile {
            path: path.to_string(),
            sha256: hex(digest(&SHA256, &bytes).as_ref()),
            git_oid: hex(digest(&SHA1_FOR_LEGACY_USE_ONLY, &blob).as_ref()),
            bytes: Arc::new(bytes),
            lfs,
        }
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of `bytes`, in hex.
pub fn sha256(bytes: &[u8]) -> String {
    hex(digest(&SHA256, bytes).as_ref())
}

/// A logged request.
#[derive(Clone, Debug)]
pub struct Logged {
    /// `hub` or `cdn`.
    pub server: &'static str,
    /// The path (percent-decoded) without the query.
    pub path: String,
    /// The `Range` header.
    pub range: Option<String>,
    /// The `Authorization` header.
    pub authorization: Option<String>,
    /// The status answered.
    pub status: u16,
}

/// Faults, settable while the hub runs.
#[derive(Default, Debug)]
pub struct Faults {
    /// Paths whose bytes are served with one byte flipped, the next time only.
    pub corrupt_once: Vec<String>,
    /// Paths whose bytes are always served with one byte flipped.
    pub corrupt_always: Vec<String>,
    /// (path, n): the next transfer of path sends n bytes, then waits until released.
    pub stall_after: Option<(String, u64)>,
    /// (path, n): the next transfer of path sends n bytes, then closes the connection.
    pub cut_after: Option<(String, u64)>,
    /// Answer range requests with the whole file (200).
    pub ignore_range: bool,
    /// Require [`TOKEN`]: 401 (GatedRepo) without a token, 403 with another.
    pub gated: bool,
    /// Sizes the tree states instead of the real ones.
    pub tree_size: HashMap<String, u64>,
    /// More entries for the tree: (path, size, git oid).
    pub extra_tree: Vec<(String, u64, String)>,
}

struct State {
    repo: String,
    commit: String,
    files: Vec<HubFile>,
    page_size: usize,
    cdn_port: u16,
    log: Mutex<Vec<Logged>>,
    faults: Mutex<Faults>,
    /// Stalled transfers wait on this until `released` (or shutdown).
    released: Mutex<bool>,
    wake: Condvar,
    shutdown: AtomicBool,
}

/// A running fake Hub.
pub struct FakeHub {
    pub port: u16,
    pub cdn_port: u16,
    state: Arc<State>,
}

impl FakeHub {
    /// Serve `files` as repository `repo` (`ORG/NAME`) at one commit, `page_size` tree entries
    /// a page.
    pub fn start(repo: &str, files: Vec<HubFile>, page_size: usize) -> FakeHub {
        let hub = TcpListener::bind("127.0.0.1:0").unwrap();
        let cdn = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = hub.local_addr().unwrap().port();
        let cdn_port = cdn.local_addr().unwrap().port();
        let commit = hex(digest(&SHA1_FOR_LEGACY_USE_ONLY, repo.as_bytes()).as_ref());
        let state = Arc::new(State {
            repo: repo.to_string(),
            commit,
            files,
            page_size: page_size.max(1),
            cdn_port,
            log: Mutex::new(Vec::new()),
            faults: Mutex::new(Faults::default()),
            released: Mutex::new(false),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        for (listener, server) in [(hub, "hub"), (cdn, "cdn")] {
            let state = state.clone();
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if state.shutdown.load(Ordering::Relaxed) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    let state = state.clone();
                    std::thread::spawn(move || {
                        let _ = serve(&state, server, conn);
                    });
                }
            });
        }
        FakeHub {
            port,
            cdn_port,
            state,
        }
    }

    /// Every file below `dir`, as a repository.
    pub fn files_of(dir: &Path) -> Vec<HubFile> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    let rel = p
                        .strip_prefix(dir)
                        .unwrap()
                        .to_str()
                        .unwrap()
                        .replace('\\', "/");
                    out.push(HubFile::new(&rel, std::fs::read(&p).unwrap()));
                }
            }
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        out
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The commit `main` names.
    pub fn commit(&self) -> String {
        self.state.commit.clone()
    }

    /// The file at `path`.
    pub fn file(&self, path: &str) -> HubFile {
        self.state
            .files
            .iter()
            .find(|f| f.path == path)
            .unwrap()
            .clone()
    }

    /// Change the faults.
    pub fn faults(&self, f: impl FnOnce(&mut Faults)) {
        f(&mut self.state.faults.lock().unwrap());
    }

    /// The requests so far.
    pub fn log(&self) -> Vec<Logged> {
        self.state.log.lock().unwrap().clone()
    }

    /// The requests for `path`'s bytes (its resolve URL, or its CDN URL) since request `from`.
    pub fn transfers(&self, path: &str, from: usize) -> Vec<Logged> {
        let f = self.file(path);
        let resolve = format!("/{}/resolve/", self.state.repo);
        self.log()[from..]
            .iter()
            .filter(|l| {
                if f.lfs {
                    l.server == "cdn" && l.path == format!("/cdn/{}", f.sha256)
                } else {
                    l.server == "hub"
                        && l.path.starts_with(&resolve)
                        && l.path.ends_with(&format!("/{}", f.path))
                }
            })
            .cloned()
            .collect()
    }

    /// Let stalled transfers go on (they then close their connections).
    pub fn release(&self) {
        *self.state.released.lock().unwrap() = true;
        self.state.wake.notify_all();
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.state.shutdown.store(true, Ordering::Relaxed);
        self.release();
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        let _ = TcpStream::connect(("127.0.0.1", self.cdn_port));
    }
}

struct Request {
    path: String,
    query: String,
    headers: HashMap<String, String>,
}

fn read_request(conn: &TcpStream) -> Option<Request> {
    let mut reader = BufReader::new(conn.try_clone().ok()?);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let _method = parts.next()?;
    let target = parts.next()?.to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        reader.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p.to_string(), q.to_string()),
        None => (target, String::new()),
    };
    Some(Request {
        path: percent_decode(&path),
        query,
        headers,
    })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let digits = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
            if let Ok(v) = u8::from_str_radix(digits, 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn respond(
    conn: &mut TcpStream,
    status: u16,
    headers: &[(String, String)],
    body: &[u8],
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        _ => "Status",
    };
    let mut head = format!(
        "HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes())?;
    conn.write_all(body)?;
    conn.flush()
}

fn error(conn: &mut TcpStream, status: u16, code: &str, message: &str) -> std::io::Result<()> {
    let body = serde_json::json!({ "error": message }).to_string();
    respond(
        conn,
        status,
        &[
            ("X-Error-Code".into(), code.into()),
            ("X-Error-Message".into(), message.into()),
            ("Content-Type".into(), "application/json".into()),
        ],
        body.as_bytes(),
    )
}

fn serve(state: &State, server: &'static str, mut conn: TcpStream) -> std::io::Result<()> {
    let Some(req) = read_request(&conn) else {
        return Ok(());
    };
    if state.shutdown.load(Ordering::Relaxed) {
        return Ok(());
    }
    let log = |status: u16| {
        state.log.lock().unwrap().push(Logged {
            server,
            path: req.path.clone(),
            range: req.headers.get("range").cloned(),
            authorization: req.headers.get("authorization").cloned(),
            status,
        });
    };
    if server == "cdn" {
        if req.headers.contains_key("authorization") {
            log(400);
            return error(&mut conn, 400, "", "Only one auth mechanism allowed");
        }
        let sha = req.path.strip_prefix("/cdn/").unwrap_or_default();
        let Some(f) = state.files.iter().find(|f| f.sha256 == sha && f.lfs) else {
            log(404);
            return error(&mut conn, 404, "", "no such object");
        };
        return send_bytes(state, &mut conn, f, &req, &[], log);
    }

    // The Hub.
    let gated = state.faults.lock().unwrap().gated;
    if gated {
        match req.headers.get("authorization").map(String::as_str) {
            None => {
                log(401);
                return error(&mut conn, 401, "GatedRepo", &format!("Access to model {} is restricted. You must have access to it and be authenticated to access it. Please log in.", state.repo));
            }
            Some(a) if a != format!("Bearer {TOKEN}") => {
                log(403);
                return error(
                    &mut conn,
                    403,
                    "GatedRepo",
                    &format!(
                        "Access to model {} is restricted and you are not in the authorized list.",
                        state.repo
                    ),
                );
            }
            Some(_) => {}
        }
    }
    let api = format!("/api/models/{}/", state.repo);
    if let Some(rest) = req.path.strip_prefix(&api) {
        if let Some(rev) = rest.strip_prefix("revision/") {
            if rev != "main" && rev != state.commit {
                log(404);
                return error(
                    &mut conn,
                    404,
                    "RevisionNotFound",
                    &format!("Invalid rev id: {rev}"),
                );
            }
            log(200);
            let body = serde_json::json!({
                "_id": "0",
                "id": state.repo,
                "sha": state.commit,
                "private": false,
                "gated": if gated { serde_json::json!("manual") } else { serde_json::json!(false) },
                "siblings": state.files.iter().map(|f| serde_json::json!({"rfilename": f.path})).collect::<Vec<_>>(),
            });
            return respond(
                &mut conn,
                200,
                &[("Content-Type".into(), "application/json".into())],
                body.to_string().as_bytes(),
            );
        }
        if let Some(rev) = rest.strip_prefix("tree/") {
            if rev != "main" && rev != state.commit {
                log(404);
                return error(
                    &mut conn,
                    404,
                    "RevisionNotFound",
                    &format!("Invalid rev id: {rev}"),
                );
            }
            let faults = state.faults.lock().unwrap();
            let mut entries: Vec<serde_json::Value> = Vec::new();
            let mut dirs: Vec<String> = Vec::new();
            for f in &state.files {
                let size = faults
                    .tree_size
                    .get(&f.path)
                    .copied()
                    .unwrap_or(f.bytes.len() as u64);
                let mut e = serde_json::json!({"type": "file", "oid": f.git_oid, "size": size, "path": f.path});
                if f.lfs {
                    e["oid"] = serde_json::json!(hex(digest(
                        &SHA1_FOR_LEGACY_USE_ONLY,
                        f.sha256.as_bytes()
                    )
                    .as_ref()));
                    e["lfs"] =
                        serde_json::json!({"oid": f.sha256, "size": size, "pointerSize": 134});
                }
                if let Some((d, _)) = f.path.rsplit_once('/') {
                    if !dirs.contains(&d.to_string()) {
                        dirs.push(d.to_string());
                        entries.push(serde_json::json!({"type": "directory", "oid": "0".repeat(40), "size": 0, "path": d}));
                    }
                }
                entries.push(e);
            }
            for (path, size, oid) in &faults.extra_tree {
                entries.push(
                    serde_json::json!({"type": "file", "oid": oid, "size": size, "path": path}),
                );
            }
            drop(faults);
            let cursor: usize = req
                .query
                .split('&')
                .find_map(|kv| kv.strip_prefix("cursor="))
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            let page: Vec<_> = entries
                .iter()
                .skip(cursor)
                .take(state.page_size)
                .cloned()
                .collect();
            let mut headers = vec![("Content-Type".to_string(), "application/json".to_string())];
            if cursor + state.page_size < entries.len() {
                headers.push((
                    "Link".into(),
                    format!(
                        "<http://127.0.0.1:{}/api/models/{}/tree/{rev}?recursive=true&cursor={}>; rel=\"next\"",
                        conn.local_addr()?.port(),
                        state.repo,
                        cursor + state.page_size
                    ),
                ));
            }
            log(200);
            return respond(
                &mut conn,
                200,
                &headers,
                serde_json::Value::Array(page).to_string().as_bytes(),
            );
        }
        log(404);
        return error(&mut conn, 404, "", "not an API route of this fake hub");
    }
    let resolve = format!("/{}/resolve/", state.repo);
    let Some(rest) = req.path.strip_prefix(&resolve) else {
        log(404);
        return error(&mut conn, 404, "RepoNotFound", "Repository not found");
    };
    let (rev, path) = rest.split_once('/').unwrap_or((rest, ""));
    if rev != "main" && rev != state.commit {
        log(404);
        return error(
            &mut conn,
            404,
            "RevisionNotFound",
            &format!("Invalid rev id: {rev}"),
        );
    }
    let Some(f) = state.files.iter().find(|f| f.path == path) else {
        log(404);
        return error(
            &mut conn,
            404,
            "EntryNotFound",
            &format!("{path} does not exist on \"{rev}\""),
        );
    };
    let common = vec![("X-Repo-Commit".to_string(), state.commit.clone())];
    if f.lfs {
        log(302);
        let mut headers = common;
        headers.push(("X-Linked-Etag".into(), format!("\"{}\"", f.sha256)));
        headers.push(("X-Linked-Size".into(), f.bytes.len().to_string()));
        headers.push(("ETag".into(), format!("\"{}\"", f.sha256)));
        headers.push((
            "Location".into(),
            format!(
                "http://127.0.0.1:{}/cdn/{}?sig=presigned-secret",
                state.cdn_port, f.sha256
            ),
        ));
        return respond(&mut conn, 302, &headers, b"");
    }
    let mut headers = common;
    headers.push(("ETag".into(), format!("\"{}\"", f.git_oid)));
    send_bytes(state, &mut conn, f, &req, &headers, log)
}

/// A file's bytes (or the range asked for), with the faults applied.
fn send_bytes(
    state: &State,
    conn: &mut TcpStream,
    f: &HubFile,
    req: &Request,
    extra: &[(String, String)],
    log: impl Fn(u16),
) -> std::io::Result<()> {
    let len = f.bytes.len() as u64;
    let mut faults = state.faults.lock().unwrap();
    let start = match req.headers.get("range") {
        Some(r) if !faults.ignore_range => {
            let from = r
                .strip_prefix("bytes=")
                .and_then(|r| r.split('-').next())
                .and_then(|n| n.parse::<u64>().ok());
            match from {
                Some(n) if n < len => Some(n),
                _ => {
                    drop(faults);
                    log(416);
                    return respond(
                        conn,
                        416,
                        &[("Content-Range".into(), format!("bytes */{len}"))],
                        b"",
                    );
                }
            }
        }
        _ => None,
    };
    let mut body = f.bytes[start.unwrap_or(0) as usize..].to_vec();
    let once = faults.corrupt_once.iter().position(|p| *p == f.path);
    if let Some(i) = once {
        faults.corrupt_once.remove(i);
    }
    if (once.is_some() || faults.corrupt_always.contains(&f.path)) && !body.is_empty() {
        let mid = body.len() / 2;
        body[mid] ^= 0x5a;
    }
    let stall = match &faults.stall_after {
        Some((p, n)) if *p == f.path => Some(*n),
        _ => None,
    };
    if stall.is_some() {
        faults.stall_after = None;
    }
    let cut = match &faults.cut_after {
        Some((p, n)) if *p == f.path => Some(*n),
        _ => None,
    };
    if cut.is_some() {
        faults.cut_after = None;
    }
    drop(faults);
    let status = if start.is_some() { 206 } else { 200 };
    log(status);
    let mut head = format!(
        "HTTP/1.1 {status} {}\r\nConnection: close\r\nContent-Length: {}\r\nContent-Type: application/octet-stream\r\n",
        if status == 206 { "Partial Content" } else { "OK" },
        body.len()
    );
    if let Some(s) = start {
        head.push_str(&format!("Content-Range: bytes {s}-{}/{len}\r\n", len - 1));
    }
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes())?;
    if let Some(n) = stall.or(cut) {
        let n = (n as usize).min(body.len());
        conn.write_all(&body[..n])?;
        conn.flush()?;
        if stall.is_some() {
            let mut released = state.released.lock().unwrap();
            while !*released && !state.shutdown.load(Ordering::Relaxed) {
                released = state.wake.wait(released).unwrap();
            }
        }
        // Closing short of Content-Length: the client sees the transfer break.
        return conn.shutdown(std::net::Shutdown::Both);
    }
    // In pieces, so a slow reader sees the bytes arrive as a stream.
    for chunk in body.chunks(256 << 10) {
        conn.write_all(chunk)?;
    }
    conn.flush()
}
