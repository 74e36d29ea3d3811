//! The Hugging Face Hub's HTTP API as `coli pull` uses it: the repository argument
//! (`ORG/NAME[@REV]`), the revision resolved to its commit
//! (`GET {endpoint}/api/models/{repo}/revision/{rev}`), the commit's files with their sizes and
//! hashes (`GET {endpoint}/api/models/{repo}/tree/{commit}?recursive=true`, followed through
//! its `Link: <…>; rel="next"` pages), and one file's bytes from an offset
//! (`GET {endpoint}/{repo}/resolve/{commit}/{path}` with `Range`, its redirects to a CDN
//! followed here, the token sent to the endpoint's origin only). Every refusal of the Hub
//! becomes one clear message ([`Hub::status_error`]); failures worth retrying are told apart
//! from those that are not ([`Failure`]).

use std::io::Read;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use reqwest::blocking::{Client, Response};
use reqwest::header::{HeaderMap, AUTHORIZATION, LOCATION, RANGE};
use reqwest::{StatusCode, Url};
use serde::Deserialize;

/// The largest JSON answer read from the API (a tree page of a large repository is a few MiB).
const MAX_JSON: u64 = 64 << 20;
/// The most tree pages followed (the Hub sends 1,000 entries a page).
const MAX_TREE_PAGES: usize = 1_000;
/// The most redirects one file request follows (the Hub needs one or two).
const MAX_REDIRECTS: usize = 8;
/// How many times a failed API request is tried again.
const API_RETRIES: u32 = 4;

/// A repository and revision, as `coli pull ORG/NAME[@REV]` names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoSpec {
    /// `ORG/NAME`.
    pub repo: String,
    /// A branch, tag or commit (`main` when not given).
    pub revision: String,
}

impl RepoSpec {
    /// Parse `ORG/NAME` or `ORG/NAME@REV`, checking the names as the Hub allows them.
    pub fn parse(s: &str) -> Result<RepoSpec> {
        let (repo, revision) = match s.split_once('@') {
            Some((repo, rev)) => (repo, rev),
            None => (s, "main"),
        };
        let bad = |why: &str| {
            anyhow!("repository {s:?}: {why}; expected ORG/NAME or ORG/NAME@REVISION, e.g. Qwen/Qwen3-30B-A3B@main")
        };
        let parts: Vec<&str> = repo.split('/').collect();
        if parts.len() != 2 {
            return Err(bad("not of the form ORG/NAME"));
        }
        for part in parts {
            let ok = !part.is_empty()
                && part.len() <= 96
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                && !part.starts_with(['-', '.'])
                && !part.ends_with('.')
                && !part.contains("..")
                && !part.contains("--");
            if !ok {
                return Err(bad(&format!(
                    "{part:?} is not a valid name (letters, digits, '-', '_', '.')"
                )));
            }
        }
        if revision.is_empty()
            || revision.len() > 255
            || revision
                .chars()
                .any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(bad(&format!("{revision:?} is not a revision")));
        }
        Ok(RepoSpec {
            repo: repo.to_string(),
            revision: revision.to_string(),
        })
    }
}

impl std::fmt::Display for RepoSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.repo, self.revision)
    }
}

/// How a file's bytes are checked against the Hub.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    /// An LFS file: the SHA-256 of its bytes (the tree's `lfs.oid`, the resolve answer's
    /// `X-Linked-Etag`).
    Sha256(String),
    /// A file kept in git itself: its git blob id, the SHA-1 of `blob {size}\0` and the bytes
    /// (the tree's `oid`, the resolve answer's `ETag`).
    GitBlob(String),
}

impl Check {
    /// The hex digest: also the name of the file's partial download.
    pub fn hex(&self) -> &str {
        match self {
            Check::Sha256(h) | Check::GitBlob(h) => h,
        }
    }
}

/// A file of the pinned commit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteFile {
    /// Its path in the repository (`/`-separated).
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// What its bytes hash to.
    pub check: Check,
}

/// Why a request failed: worth trying again (a dropped connection, a 5xx, a 429), or not.
#[derive(Debug)]
pub enum Failure {
    /// Try again (after a pause), resuming where the bytes stopped.
    Transient(anyhow::Error),
    /// Give up: the message says why and what to do.
    Fatal(anyhow::Error),
}

impl Failure {
    /// The error, whichever kind.
    pub fn into_error(self) -> anyhow::Error {
        match self {
            Failure::Transient(e) | Failure::Fatal(e) => e,
        }
    }
}

/// What a request was about, for its error message.
#[derive(Clone, Copy, Debug)]
pub enum Subject<'a> {
    /// The repository at a revision (the revision API).
    Revision(&'a str),
    /// The file list of a commit.
    Tree(&'a str),
    /// One file at a commit.
    File(&'a str, &'a str),
}

/// One file's bytes on their way: the final answer (after redirects) and the headers of the
/// Hub's own first answer (`X-Repo-Commit`, `X-Linked-Etag`, `ETag`, `X-Linked-Size`).
pub struct Download {
    /// The answer whose body is the file (200, or 206 for a range).
    pub response: Response,
    /// The headers of the Hub's answer to the resolve URL.
    pub hub_headers: HeaderMap,
}

/// A client of one repository on one Hub endpoint.
pub struct Hub {
    client: Client,
    endpoint: Url,
    token: Option<String>,
    /// `ORG/NAME`.
    pub repo: String,
}

impl Hub {
    /// A client of `repo` on `endpoint` (`https://huggingface.co`, a mirror, or a local test
    /// server), sending `token` as a bearer token to the endpoint's origin only.
    pub fn new(endpoint: &str, repo: &str, token: Option<String>) -> Result<Hub> {
        let mut endpoint = Url::parse(endpoint.trim_end_matches('/'))
            .with_context(|| format!("HF_ENDPOINT / --endpoint {endpoint:?} is not a URL"))?;
        if !matches!(endpoint.scheme(), "http" | "https") || endpoint.host().is_none() {
            bail!("HF_ENDPOINT / --endpoint {endpoint}: expected an http:// or https:// URL");
        }
        if endpoint.query().is_some() || endpoint.fragment().is_some() {
            bail!("HF_ENDPOINT / --endpoint {endpoint}: a base URL takes no query or fragment");
        }
        // A base path (a mirror under /hf) keeps its segments; the API's are appended to them.
        if !endpoint.path().ends_with('/') {
            let path = format!("{}/", endpoint.path());
            endpoint.set_path(&path);
        }
        // reqwest's rustls takes the process's provider: ring (a no-op when one is set).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = Client::builder()
            .user_agent(concat!(
                "colibri/",
                env!("CARGO_PKG_VERSION"),
                " (coli pull)"
            ))
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(30))
            // Per wait: sending a request, and each read of a body (a stalled transfer).
            .timeout(Duration::from_secs(60))
            .build()
            .context("setting up the HTTP client")?;
        Ok(Hub {
            client,
            endpoint,
            token,
            repo: repo.to_string(),
        })
    }

    /// The endpoint, as given (for messages and the receipt).
    pub fn endpoint(&self) -> String {
        self.endpoint.as_str().trim_end_matches('/').to_string()
    }

    /// The endpoint's URL with `segments` appended, each percent-encoded as one segment.
    fn url<'a>(&self, segments: impl IntoIterator<Item = &'a str>) -> Url {
        let mut url = self.endpoint.clone();
        url.path_segments_mut()
            .expect("an http(s) URL has path segments")
            .pop_if_empty()
            .extend(segments);
        url
    }

    fn repo_segments(&self) -> impl Iterator<Item = &str> {
        self.repo.split('/')
    }

    /// The repository's page, where a gated repository's terms are accepted.
    pub fn repo_page(&self) -> Url {
        self.url(self.repo_segments())
    }

    /// `GET url` with the token when `url` is on the endpoint's origin, and `Range: bytes=N-`
    /// when `from` is given; no redirects followed.
    fn get(&self, url: &Url, from: Option<u64>) -> Result<Response, Failure> {
        let mut req = self.client.get(url.clone());
        if let (Some(token), true) = (&self.token, url.origin() == self.endpoint.origin()) {
            req = req.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        if let Some(from) = from {
            req = req.header(RANGE, format!("bytes={from}-"));
        }
        req.send().map_err(|e| {
            Failure::Transient(anyhow::Error::new(e).context(format!("GET {}", redact(url))))
        })
    }

    /// A JSON answer of the API, tried again on transient failures; also its `Link` header's
    /// next page.
    fn get_json<T: for<'de> Deserialize<'de>>(
        &self,
        url: &Url,
        subject: Subject,
    ) -> Result<(T, Option<Url>)> {
        let mut attempt = 0;
        loop {
            match self.get_json_once(url, subject) {
                Ok(v) => return Ok(v),
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Transient(e)) => {
                    attempt += 1;
                    if attempt > API_RETRIES {
                        return Err(e.context(format!("after {attempt} attempts")));
                    }
                    std::thread::sleep(backoff(attempt));
                }
            }
        }
    }

    fn get_json_once<T: for<'de> Deserialize<'de>>(
        &self,
        url: &Url,
        subject: Subject,
    ) -> Result<(T, Option<Url>), Failure> {
        let resp = self.get(url, None)?;
        let status = resp.status();
        if !status.is_success() {
            return Err(self.status_error(status, resp, subject));
        }
        let next = next_link(resp.headers(), url);
        let mut body = Vec::new();
        resp.take(MAX_JSON + 1)
            .read_to_end(&mut body)
            .map_err(|e| {
                Failure::Transient(anyhow!(e).context(format!("reading {}", redact(url))))
            })?;
        if body.len() as u64 > MAX_JSON {
            return Err(Failure::Fatal(anyhow!(
                "{}: the answer is larger than {} MiB",
                redact(url),
                MAX_JSON >> 20
            )));
        }
        let value = serde_json::from_slice(&body).map_err(|e| {
            Failure::Fatal(anyhow!(
                "{}: not the Hub's JSON ({e}); is HF_ENDPOINT a Hugging Face Hub?",
                redact(url)
            ))
        })?;
        Ok((value, next))
    }

    /// The commit `revision` names (`GET /api/models/{repo}/revision/{revision}`'s `sha`).
    pub fn resolve_commit(&self, revision: &str) -> Result<String> {
        #[derive(Deserialize)]
        struct Info {
            sha: Option<String>,
        }
        let url = self.url(
            ["api", "models"]
                .into_iter()
                .chain(self.repo_segments())
                .chain(["revision", revision]),
        );
        let (info, _): (Info, _) = self.get_json(&url, Subject::Revision(revision))?;
        let sha = info
            .sha
            .ok_or_else(|| anyhow!("{}: the answer names no commit (`sha`)", redact(&url)))?;
        if !is_hex(&sha, 40) {
            bail!("{}: {sha:?} is not a commit id", redact(&url));
        }
        Ok(sha.to_ascii_lowercase())
    }

    /// Every file of `commit` with its size and hash
    /// (`GET /api/models/{repo}/tree/{commit}?recursive=true`, all pages).
    pub fn list_files(&self, commit: &str) -> Result<Vec<RemoteFile>> {
        #[derive(Deserialize)]
        struct Lfs {
            oid: String,
            size: u64,
        }
        #[derive(Deserialize)]
        struct Entry {
            #[serde(rename = "type")]
            kind: String,
            path: String,
            #[serde(default)]
            size: u64,
            #[serde(default)]
            oid: Option<String>,
            #[serde(default)]
            lfs: Option<Lfs>,
        }
        let mut url = self.url(
            ["api", "models"]
                .into_iter()
                .chain(self.repo_segments())
                .chain(["tree", commit]),
        );
        url.query_pairs_mut().append_pair("recursive", "true");
        let mut files = Vec::new();
        let mut next = Some(url);
        let mut pages = 0;
        while let Some(url) = next {
            pages += 1;
            if pages > MAX_TREE_PAGES {
                bail!(
                    "{}: more than {MAX_TREE_PAGES} pages of files; name the files with --include",
                    self.repo
                );
            }
            let (entries, link): (Vec<Entry>, _) = self.get_json(&url, Subject::Tree(commit))?;
            for e in entries {
                if e.kind != "file" {
                    continue;
                }
                let (size, check) = match (e.lfs, e.oid) {
                    (Some(lfs), _) => {
                        if !is_hex(&lfs.oid, 64) {
                            bail!(
                                "{}: {}: the LFS oid {:?} is not a SHA-256",
                                redact(&url),
                                e.path,
                                lfs.oid
                            );
                        }
                        (lfs.size, Check::Sha256(lfs.oid.to_ascii_lowercase()))
                    }
                    (None, Some(oid)) => {
                        if !is_hex(&oid, 40) {
                            bail!(
                                "{}: {}: the git oid {oid:?} is not a SHA-1",
                                redact(&url),
                                e.path
                            );
                        }
                        (e.size, Check::GitBlob(oid.to_ascii_lowercase()))
                    }
                    (None, None) => bail!("{}: {}: the file has no oid", redact(&url), e.path),
                };
                files.push(RemoteFile {
                    path: e.path,
                    size,
                    check,
                });
            }
            next = link;
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        files.dedup_by(|a, b| a.path == b.path);
        Ok(files)
    }

    /// Start downloading `path` at `commit` from byte `from` (a `Range` request when `from >
    /// 0`), following the Hub's redirects (to its CDN, or to a renamed repository).
    pub fn open_file(&self, commit: &str, path: &str, from: u64) -> Result<Download, Failure> {
        let mut url = self.url(
            self.repo_segments()
                .chain(["resolve", commit])
                .chain(path.split('/')),
        );
        let range = (from > 0).then_some(from);
        let subject = Subject::File(path, commit);
        let mut hub_headers = None;
        for _ in 0..=MAX_REDIRECTS {
            let resp = self.get(&url, range)?;
            let status = resp.status();
            if hub_headers.is_none() {
                hub_headers = Some(resp.headers().clone());
            }
            if status.is_redirection() {
                let location = resp
                    .headers()
                    .get(LOCATION)
                    .and_then(|l| l.to_str().ok())
                    .ok_or_else(|| {
                        Failure::Fatal(anyhow!(
                            "{}: HTTP {status} without a Location",
                            redact(&url)
                        ))
                    })?;
                url = url.join(location).map_err(|e| {
                    Failure::Fatal(anyhow!("{}: bad redirect {location:?}: {e}", redact(&url)))
                })?;
                if !matches!(url.scheme(), "http" | "https") {
                    return Err(Failure::Fatal(anyhow!(
                        "{path}: redirect to {}",
                        redact(&url)
                    )));
                }
                continue;
            }
            if status.is_success() || status == StatusCode::RANGE_NOT_SATISFIABLE {
                return Ok(Download {
                    response: resp,
                    hub_headers: hub_headers.unwrap_or_default(),
                });
            }
            return Err(self.status_error(status, resp, subject));
        }
        Err(Failure::Fatal(anyhow!(
            "{path}: more than {MAX_REDIRECTS} redirects, the last to {}",
            redact(&url)
        )))
    }

    /// The error an unsuccessful answer means: what went wrong and what to do, transient for
    /// 408, 429 and 5xx.
    pub fn status_error(&self, status: StatusCode, resp: Response, subject: Subject) -> Failure {
        let code = header(resp.headers(), "x-error-code").unwrap_or_default();
        let mut message = header(resp.headers(), "x-error-message").unwrap_or_default();
        let url = redact(resp.url());
        if message.is_empty() {
            // The Hub's JSON `{"error": "..."}`, or the start of whatever else came.
            let mut body = String::new();
            let _ = resp.take(4096).read_to_string(&mut body);
            message = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
                .unwrap_or_else(|| body.chars().take(200).collect());
        }
        let said = if message.trim().is_empty() {
            String::new()
        } else {
            format!(" (the Hub says: {})", message.trim())
        };
        let repo = &self.repo;
        let page = self.repo_page();
        let what = match subject {
            Subject::Revision(rev) => format!("{repo}@{rev}"),
            Subject::Tree(commit) => format!("the files of {repo} at {commit}"),
            Subject::File(path, commit) => format!("{path} of {repo} at {commit}"),
        };
        let gated =
            code == "GatedRepo" || message.contains("gated") || message.contains("restricted");
        let error = match status.as_u16() {
            401 | 403 if gated => anyhow!(
                "{repo} is a gated repository (HTTP {status}){said}: accept its terms at {page} \
                 while logged in, then set HF_TOKEN (or --token-file) to a token of that account"
            ),
            401 if self.token.is_some() => anyhow!(
                "{what}: HTTP 401{said}: the Hub refused the token (HF_TOKEN / --token-file): \
                 check it is valid and can read {repo}"
            ),
            401 => anyhow!(
                "{what}: HTTP 401{said}: {repo} is private, gated or does not exist: check the \
                 name, and set HF_TOKEN (or --token-file) to a token that can read it"
            ),
            403 => anyhow!(
                "{what}: HTTP 403{said}: the token cannot read {repo}: a fine-grained token \
                 needs read access to it; a gated repository's terms must be accepted at {page}"
            ),
            404 => match (code.as_str(), subject) {
                ("RepoNotFound", _) => anyhow!(
                    "repository {repo} not found at {}{said}: check the name (private \
                     repositories need HF_TOKEN)",
                    self.endpoint()
                ),
                (_, Subject::Revision(rev)) => {
                    anyhow!("revision {rev:?} of {repo} not found (HTTP 404){said}: check the branch, tag or commit after '@' (or that {repo} exists)")
                }
                (_, Subject::File(path, commit)) => {
                    anyhow!("{path} not found in {repo} at commit {commit} (HTTP 404){said}")
                }
                (_, Subject::Tree(commit)) => {
                    anyhow!("the file list of {repo} at {commit} was not found (HTTP 404){said}")
                }
            },
            _ => anyhow!("{what}: HTTP {status} from {url}{said}"),
        };
        if matches!(status.as_u16(), 408 | 429) || status.is_server_error() {
            Failure::Transient(error)
        } else {
            Failure::Fatal(error)
        }
    }
}

/// The pause before retry number `attempt` (1, 2, …): 0.25 s doubling, at most 8 s.
pub fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(250u64 << attempt.saturating_sub(1).min(5))
}

/// A header's value as text.
pub fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_string())
}

/// An ETag's value without `W/` and quotes.
pub fn etag_value(raw: &str) -> &str {
    raw.trim().trim_start_matches("W/").trim_matches('"')
}

/// Whether `s` is `len` hex digits.
pub fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The URL of a `Link: <URL>; rel="next"` header, resolved against `base`.
fn next_link(headers: &HeaderMap, base: &Url) -> Option<Url> {
    for value in headers.get_all(reqwest::header::LINK) {
        let Ok(value) = value.to_str() else { continue };
        for link in value.split(',') {
            let mut parts = link.split(';');
            let target = parts.next()?.trim();
            let is_next = parts.any(|p| {
                let p = p.trim();
                p == "rel=\"next\"" || p == "rel=next"
            });
            if is_next {
                let target = target.strip_prefix('<')?.strip_suffix('>')?;
                return base.join(target).ok();
            }
        }
    }
    None
}

/// A URL for messages: without its query (a CDN's signed URL carries credentials there).
pub fn redact(url: &Url) -> String {
    let mut u = url.clone();
    if u.query().is_some() {
        u.set_query(Some("…"));
    }
    let _ = u.set_password(None);
    u.to_string()
}

/// `Content-Range: bytes FIRST-LAST/TOTAL` as (first, last, total).
pub fn content_range(headers: &HeaderMap) -> Option<(u64, u64, Option<u64>)> {
    let value = header(headers, "content-range")?;
    let rest = value.strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let total = if total == "*" {
        None
    } else {
        Some(total.parse().ok()?)
    };
    Some((first.parse().ok()?, last.parse().ok()?, total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_specs() {
        let s = RepoSpec::parse("Qwen/Qwen3-30B-A3B").unwrap();
        assert_eq!(
            (s.repo.as_str(), s.revision.as_str()),
            ("Qwen/Qwen3-30B-A3B", "main")
        );
        let s = RepoSpec::parse("org/m.v1_x@refs/pr/3").unwrap();
        assert_eq!(
            (s.repo.as_str(), s.revision.as_str()),
            ("org/m.v1_x", "refs/pr/3")
        );
        for bad in [
            "qwen", "a/b/c", "a/", "/b", "a/b@", "a/..", "a/b c", "a/b@x y", "-a/b", "a/b.",
        ] {
            assert!(RepoSpec::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn urls_encode_each_segment() {
        let hub = Hub::new("http://127.0.0.1:9/base", "org/name", None).unwrap();
        let u = hub.url(
            ["api", "models"]
                .into_iter()
                .chain(hub.repo_segments())
                .chain(["revision", "refs/pr/1"]),
        );
        assert_eq!(
            u.as_str(),
            "http://127.0.0.1:9/base/api/models/org/name/revision/refs%2Fpr%2F1"
        );
        let u = hub.url(
            hub.repo_segments()
                .chain(["resolve", "abc"])
                .chain("a b/c#d.json".split('/')),
        );
        assert_eq!(
            u.as_str(),
            "http://127.0.0.1:9/base/org/name/resolve/abc/a%20b/c%23d.json"
        );
    }

    #[test]
    fn header_parsing() {
        let mut h = HeaderMap::new();
        h.insert("content-range", "bytes 100-199/200".parse().unwrap());
        h.insert(
            reqwest::header::LINK,
            "<https://hub/api/models/a/b/tree/c?recursive=true&cursor=xyz>; rel=\"next\""
                .parse()
                .unwrap(),
        );
        assert_eq!(content_range(&h), Some((100, 199, Some(200))));
        let base = Url::parse("https://hub/api/models/a/b/tree/c?recursive=true").unwrap();
        assert_eq!(
            next_link(&h, &base).unwrap().as_str(),
            "https://hub/api/models/a/b/tree/c?recursive=true&cursor=xyz"
        );
        assert_eq!(etag_value("W/\"abc\""), "abc");
        assert_eq!(etag_value("\"abc\""), "abc");
        let signed = Url::parse("https://cdn/x?X-Amz-Signature=secret").unwrap();
        assert!(!redact(&signed).contains("secret"));
        assert_eq!(backoff(1), Duration::from_millis(250));
        assert_eq!(backoff(20), Duration::from_secs(8));
    }
}
