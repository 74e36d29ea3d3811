//! One file's download: into `.coli-pull/parts/{hash}.part` below the target directory
//! (named by the hash the bytes must have, so a partial download is only ever resumed for the
//! same bytes), resumed with a `Range` request from the part's length after an interruption or
//! a dropped connection, hashed while it streams (the part's earlier bytes are hashed first),
//! verified against the Hub's hash, fsynced and renamed into place — so a file under its real
//! name is always complete and verified. A hash mismatch deletes the part and downloads the
//! file once more from the start; a second mismatch is an error naming the file.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{anyhow, bail, Context, Result};
use reqwest::StatusCode;
use ring::digest::{Context as Digest, SHA1_FOR_LEGACY_USE_ONLY, SHA256};

use crate::hub::{
    backoff, content_range, etag_value, header, is_hex, Check, Failure, Hub, RemoteFile,
};
use crate::Progress;

/// Consecutive failed attempts (without a byte of progress between them) before giving up.
const MAX_FAILURES: u32 = 6;
/// Bytes read from the network (or an existing part) at a time.
const CHUNK: usize = 1 << 20;

/// What the download of one file shares with the others.
pub struct Job<'a> {
    /// The repository's client.
    pub hub: &'a Hub,
    /// The pinned commit.
    pub commit: &'a str,
    /// The target directory.
    pub dir: &'a Path,
    /// Where partial downloads live.
    pub parts: PathBuf,
    /// Set when another file failed: stop at the next chunk, keeping the part.
    pub cancel: &'a AtomicBool,
    /// Bytes and messages.
    pub progress: &'a Progress,
}

/// A file in place and verified.
#[derive(Debug)]
pub struct Landed {
    /// The SHA-256 of its bytes.
    pub sha256: String,
    /// Bytes that came over the network for it in this run.
    pub transferred: u64,
    /// The length of the partial download this run resumed from (0: none).
    pub resumed_from: u64,
    /// Whether it was downloaded a second time after a hash mismatch.
    pub refetched: bool,
    /// Whether it was already in place (not in the receipt) and only hashed.
    pub adopted: bool,
}

/// The running hashes of one file's bytes.
struct Hashes {
    sha256: Digest,
    /// The git blob hash, for files kept in git.
    git: Option<Digest>,
}

impl Hashes {
    fn new(file: &RemoteFile) -> Hashes {
        let git = matches!(file.check, Check::GitBlob(_)).then(|| {
            let mut d = Digest::new(&SHA1_FOR_LEGACY_USE_ONLY);
            d.update(format!("blob {}\0", file.size).as_bytes());
            d
        });
        Hashes {
            sha256: Digest::new(&SHA256),
            git,
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        self.sha256.update(bytes);
        if let Some(g) = &mut self.git {
            g.update(bytes);
        }
    }

    /// (SHA-256, git blob id) in lower-case hex.
    fn finish(self) -> (String, Option<String>) {
        (
            hex(self.sha256.finish().as_ref()),
            self.git.map(|g| hex(g.finish().as_ref())),
        )
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The hashes of a whole file on disk, with its bytes counted into `progress`.
fn hash_file(
    path: &Path,
    file: &RemoteFile,
    progress: &Progress,
) -> Result<(String, Option<String>)> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hashes = Hashes::new(file);
    let mut buf = vec![0u8; CHUNK];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hashes.update(&buf[..n]);
        progress.add(n as u64);
    }
    Ok(hashes.finish())
}

/// Whether the hashes are what the Hub says: `Err` says what came instead.
fn verify(file: &RemoteFile, sha256: &str, git: Option<&str>) -> Result<(), String> {
    match &file.check {
        Check::Sha256(want) if want != sha256 => Err(format!(
            "SHA-256 mismatch: the Hub says {want}, the bytes hash to {sha256}"
        )),
        Check::GitBlob(want) if Some(want.as_str()) != git => Err(format!(
            "git blob id mismatch: the Hub says {want}, the bytes hash to {}",
            git.unwrap_or("?")
        )),
        _ => Ok(()),
    }
}

impl Job<'_> {
    /// The target path of `file`.
    pub fn target(&self, file: &RemoteFile) -> PathBuf {
        self.dir.join(&file.path)
    }

    /// The partial download of `file`.
    pub fn part(&self, file: &RemoteFile) -> PathBuf {
        debug_assert!(is_hex(file.check.hex(), file.check.hex().len()));
        self.parts.join(format!("{}.part", file.check.hex()))
    }

    /// Put `file` in place, verified: adopt a file already at its path whose bytes hash right,
    /// else download it (resuming a part), verify it, and rename it into place.
    pub fn land(&self, file: &RemoteFile) -> Result<Landed> {
        let target = self.target(file);
        if let Ok(meta) = std::fs::metadata(&target) {
            if meta.is_dir() {
                bail!(
                    "{} is a directory, where the file {} goes",
                    target.display(),
                    file.path
                );
            }
            if meta.len() == file.size {
                let (sha256, git) = hash_file(&target, file, self.progress)?;
                if verify(file, &sha256, git.as_deref()).is_ok() {
                    return Ok(Landed {
                        sha256,
                        transferred: 0,
                        resumed_from: 0,
                        refetched: false,
                        adopted: true,
                    });
                }
                self.progress.warn(&format!(
                    "{}: the file in place is not the Hub's (its hash differs): downloading it",
                    file.path
                ));
            }
            // Counted in the total as a download: take back what hashing it added.
            self.progress.sub(if meta.len() == file.size {
                meta.len()
            } else {
                0
            });
        }
        let part = self.part(file);
        let mut refetched = false;
        let mut transferred = 0;
        let mut resumed_from = None;
        loop {
            let got = self.download(file, &part)?;
            transferred += got.transferred;
            resumed_from.get_or_insert(got.resumed_from);
            match verify(file, &got.sha256, got.git.as_deref()) {
                Ok(()) => {
                    if let Some(parent) = target.parent() {
                        std::fs::create_dir_all(parent)
                            .with_context(|| format!("creating {}", parent.display()))?;
                    }
                    std::fs::rename(&part, &target).with_context(|| {
                        format!("renaming {} to {}", part.display(), target.display())
                    })?;
                    colibri::format::write::sync_parent(&target)?;
                    return Ok(Landed {
                        sha256: got.sha256,
                        transferred,
                        resumed_from: resumed_from.unwrap_or(0),
                        refetched,
                        adopted: false,
                    });
                }
                Err(why) => {
                    let _ = std::fs::remove_file(&part);
                    self.progress.sub(file.size);
                    if refetched {
                        bail!(
                            "{}: {why}, again after downloading it a second time; the file was \
                             deleted. The Hub's copy, a proxy or the network corrupts it: try \
                             again later or from another HF_ENDPOINT",
                            file.path
                        );
                    }
                    self.progress.warn(&format!(
                        "{}: {why}; the part was deleted, downloading it again",
                        file.path
                    ));
                    refetched = true;
                }
            }
        }
    }

    /// Bring `part` to `file.size` bytes: resume it, and retry dropped transfers.
    fn download(&self, file: &RemoteFile, part: &Path) -> Result<Downloaded> {
        std::fs::create_dir_all(&self.parts)
            .with_context(|| format!("creating {}", self.parts.display()))?;
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(part)
            .with_context(|| format!("opening {}", part.display()))?;
        let mut len = f
            .metadata()
            .with_context(|| format!("reading {}", part.display()))?
            .len();
        if len > file.size {
            f.set_len(0)
                .with_context(|| format!("truncating {}", part.display()))?;
            len = 0;
        }
        // The bytes already there are hashed first; the download continues after them.
        let mut hashes = Hashes::new(file);
        let mut buf = vec![0u8; CHUNK];
        let mut read = 0;
        while read < len {
            let want = ((len - read) as usize).min(CHUNK);
            f.read_exact(&mut buf[..want])
                .with_context(|| format!("reading {}", part.display()))?;
            hashes.update(&buf[..want]);
            read += want as u64;
        }
        self.progress.add(len);
        let resumed_from = len;
        let mut transferred = 0;
        let mut failures = 0;
        while len < file.size {
            if self.cancel.load(Ordering::Relaxed) {
                bail!(
                    "{}: stopped (another file failed); the part is kept",
                    file.path
                );
            }
            let before = len;
            let outcome = self.transfer(file, &mut f, &mut hashes, &mut len, &mut buf);
            transferred += len - before;
            if len > before {
                failures = 0;
            }
            match outcome {
                Ok(()) => {}
                Err(Step::Fatal(e)) => return Err(e),
                Err(Step::Restart(why)) if len == 0 => {
                    bail!("{}: {why}", file.path);
                }
                Err(Step::Restart(why)) => {
                    self.progress
                        .warn(&format!("{}: {why}; starting it over", file.path));
                    f.set_len(0)
                        .with_context(|| format!("truncating {}", part.display()))?;
                    self.progress.sub(len);
                    len = 0;
                    hashes = Hashes::new(file);
                    failures += 1;
                }
                Err(Step::Again(e)) => {
                    failures += 1;
                    if failures >= MAX_FAILURES {
                        return Err(e.context(format!(
                            "{}: giving up after {failures} attempts in a row without progress \
                             ({len} of {} bytes are kept in {}; rerun to resume)",
                            file.path,
                            file.size,
                            part.display()
                        )));
                    }
                    self.progress
                        .warn(&format!("{}: {e:#}; retrying from byte {len}", file.path));
                    std::thread::sleep(backoff(failures));
                }
            }
        }
        f.sync_all()
            .with_context(|| format!("syncing {}", part.display()))?;
        let (sha256, git) = hashes.finish();
        Ok(Downloaded {
            sha256,
            git,
            transferred,
            resumed_from,
        })
    }

    /// One request for the bytes from `len` on, appended to `f` until the answer ends.
    fn transfer(
        &self,
        file: &RemoteFile,
        f: &mut File,
        hashes: &mut Hashes,
        len: &mut u64,
        buf: &mut [u8],
    ) -> Result<(), Step> {
        let download = self
            .hub
            .open_file(self.commit, &file.path, *len)
            .map_err(|e| match e {
                Failure::Transient(e) => Step::Again(e),
                Failure::Fatal(e) => Step::Fatal(e),
            })?;
        self.check_hub_headers(file, &download.hub_headers)
            .map_err(Step::Fatal)?;
        let mut resp = download.response;
        let status = resp.status();
        if status == StatusCode::RANGE_NOT_SATISFIABLE {
            return Err(Step::Restart(format!(
                "the server refused the range from byte {len}"
            )));
        }
        if status == StatusCode::PARTIAL_CONTENT {
            match content_range(resp.headers()) {
                Some((first, _, total))
                    if first == *len && total.is_none_or(|t| t == file.size) => {}
                got => {
                    return Err(Step::Restart(format!(
                        "the server sent the range {got:?}, not bytes {len}- of {}",
                        file.size
                    )))
                }
            }
        } else if *len > 0 {
            return Err(Step::Restart(format!(
                "the server ignored the range request (HTTP {status})"
            )));
        }
        if let Some(n) = resp.content_length() {
            if n != file.size - *len {
                return Err(Step::Fatal(anyhow!(
                    "{}: the server sends {n} bytes from byte {len}, but the file has {} bytes \
                     at commit {}",
                    file.path,
                    file.size,
                    self.commit
                )));
            }
        }
        f.seek(SeekFrom::Start(*len))
            .map_err(|e| Step::Fatal(anyhow!(e).context("seeking the part")))?;
        loop {
            if self.cancel.load(Ordering::Relaxed) {
                return Err(Step::Fatal(anyhow!(
                    "{}: stopped (another file failed); the part is kept",
                    file.path
                )));
            }
            let n = match resp.read(buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(Step::Again(
                        anyhow!(e).context(format!("the transfer broke at byte {len}")),
                    ))
                }
            };
            if *len + n as u64 > file.size {
                return Err(Step::Fatal(anyhow!(
                    "{}: the server sends more than the file's {} bytes",
                    file.path,
                    file.size
                )));
            }
            f.write_all(&buf[..n]).map_err(|e| {
                let full = e.kind() == ErrorKind::StorageFull
                    || e.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error());
                Step::Fatal(if full {
                    anyhow!(
                        "{}: the disk is full after {len} of {} bytes: free space and rerun \
                         coli pull (it resumes from here)",
                        self.parts.display(),
                        file.size
                    )
                } else {
                    anyhow!(e).context(format!("writing the part of {}", file.path))
                })
            })?;
            hashes.update(&buf[..n]);
            *len += n as u64;
            self.progress.add(n as u64);
        }
        if *len < file.size {
            return Err(Step::Again(anyhow!(
                "the connection closed after {len} of {} bytes",
                file.size
            )));
        }
        Ok(())
    }

    /// The Hub's headers for the file must agree with the pinned commit and the tree's hash.
    fn check_hub_headers(
        &self,
        file: &RemoteFile,
        headers: &reqwest::header::HeaderMap,
    ) -> Result<()> {
        if let Some(commit) = header(headers, "x-repo-commit") {
            if !commit.eq_ignore_ascii_case(self.commit) {
                bail!(
                    "{}: the Hub answered from commit {commit}, not the pinned {}",
                    file.path,
                    self.commit
                );
            }
        }
        let linked = header(headers, "x-linked-etag");
        match (&file.check, linked) {
            (Check::Sha256(want), Some(etag))
                if is_hex(etag_value(&etag), 64)
                    && !etag_value(&etag).eq_ignore_ascii_case(want) =>
            {
                bail!(
                    "{}: the Hub's X-Linked-Etag {etag} is not the tree's SHA-256 {want}",
                    file.path
                )
            }
            (Check::GitBlob(want), None) => {
                if let Some(etag) = header(headers, "etag") {
                    let v = etag_value(&etag);
                    if is_hex(v, 40) && !v.eq_ignore_ascii_case(want) {
                        bail!(
                            "{}: the Hub's ETag {etag} is not the tree's git oid {want}",
                            file.path
                        );
                    }
                }
            }
            _ => {}
        }
        if let Some(size) = header(headers, "x-linked-size") {
            if size.parse::<u64>().ok() != Some(file.size) {
                bail!(
                    "{}: the Hub's X-Linked-Size {size} is not the tree's size {}",
                    file.path,
                    file.size
                );
            }
        }
        Ok(())
    }
}

/// A part brought to its full size.
struct Downloaded {
    sha256: String,
    git: Option<String>,
    transferred: u64,
    resumed_from: u64,
}

/// How one transfer ended, when not with the whole file.
enum Step {
    /// Retry from where the bytes stopped.
    Again(anyhow::Error),
    /// Discard the part and start from byte 0.
    Restart(String),
    /// Give up on the file.
    Fatal(anyhow::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn git_blob_ids_are_gits() {
        // `printf 'hello\n' | git hash-object --stdin`
        let file = RemoteFile {
            path: "x".into(),
            size: 6,
            check: Check::GitBlob("ce013625030ba8dba906f756967f9e9ca394464a".into()),
        };
        let mut h = Hashes::new(&file);
        h.update(b"hello\n");
        let (sha256, git) = h.finish();
        assert_eq!(
            git.as_deref(),
            Some("ce013625030ba8dba906f756967f9e9ca394464a")
        );
        // `printf 'hello\n' | sha256sum`
        assert_eq!(
            sha256,
            "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
        );
        assert!(verify(&file, &sha256, git.as_deref()).is_ok());
        let lfs = RemoteFile {
            check: Check::Sha256("0".repeat(64)),
            ..file
        };
        assert!(verify(&lfs, &sha256, None)
            .unwrap_err()
            .contains("SHA-256 mismatch"));
    }
}
