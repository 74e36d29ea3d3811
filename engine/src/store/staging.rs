//! Staging mirror drives (`coli mirror plan|stage|verify`): which checkpoint files are worth
//! copying to a second drive, copying them there safely, and proving the copies identical.
//!
//! This module owns:
//! - **ranking** ([`rank_files`]): each file's share of the routed-expert reads, from the
//!   experts it holds ([`super::ExpertLayout`]) weighted by how often the usage history
//!   ([`super::history`]) saw them chosen (every expert alike without a history);
//! - **copying** ([`stage_file`]): a file is copied through a temporary beside its target
//!   (`NAME.PID.tmp`, see [`crate::format::write`]) while the primary is hashed, the copy is
//!   read back from the mirror drive and its SHA-256 compared with the primary's, and only then
//!   published under the primary's name — never replacing a file of that name. A temporary
//!   left by an interrupted copy is taken over and continued ([`AtomicFile::resume`]); if the
//!   whole file then fails its checksum, the copy restarts from the first byte once;
//! - **receipts** ([`Receipt`]): the JSON list (file, size, SHA-256) of what a mirror holds,
//!   [`RECEIPT_FILE`] in the mirror directory, written atomically; while staging, a journal of
//!   the files done so far ([`JOURNAL_FILE`]) lets a rerun skip them once re-verified;
//! - **checking** ([`check_copy`]): a mirror file against its receipt entry and the primary.
//!
//! The primary is only ever opened read-only; nothing here deletes a mirror file.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::history::UsageHistory;
use super::ExpertLayout;
use crate::format::write::{write_atomic, AtomicFile};
use crate::{Error, Result};

/// The receipt of a staged mirror, in the mirror directory.
pub const RECEIPT_FILE: &str = "colibri-mirror.json";

/// The journal of a staging in progress (the files done so far), in the mirror directory;
/// removed when the receipt is published.
pub const JOURNAL_FILE: &str = "colibri-mirror.journal.json";

/// The format version [`Receipt`]s are written in.
pub const RECEIPT_VERSION: u32 = 1;

/// The largest receipt or journal read (a receipt lists files: a few hundred bytes each).
const MAX_RECEIPT_BYTES: u64 = 16 << 20;

/// Bytes read and written per step while copying and hashing.
const CHUNK: usize = 8 << 20;

/// One staged file: its name (in both the primary and the mirror directory), size and
/// SHA-256 (lowercase hex).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiptEntry {
    pub shard: String,
    pub size: u64,
    pub sha256: String,
}

/// What a mirror directory holds: the files staged into it, each verified byte-identical to
/// the primary's when it was staged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    pub version: u32,
    /// The primary model directory (or GGUF file) the files were copied from.
    pub primary: String,
    /// Unix time in seconds it was written.
    pub written: u64,
    pub shards: Vec<ReceiptEntry>,
}

impl Receipt {
    /// An empty receipt for copies of `primary`.
    pub fn new(primary: &Path) -> Receipt {
        Receipt {
            version: RECEIPT_VERSION,
            primary: primary.display().to_string(),
            written: 0,
            shards: Vec::new(),
        }
    }

    /// Read a receipt or journal; `None` when `path` does not exist. Refuses (naming the
    /// file) one that is too large, not JSON of this shape, of another version, or whose
    /// entries name anything but a plain file name, repeat a name or hold a malformed SHA-256.
    pub fn read(path: &Path) -> Result<Option<Receipt>> {
        let file = match File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(path, e)),
        };
        let mut bytes = Vec::new();
        file.take(MAX_RECEIPT_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::io(path, e))?;
        if bytes.len() as u64 > MAX_RECEIPT_BYTES {
            return Err(Error::corrupt(
                path,
                format!("is larger than {MAX_RECEIPT_BYTES} bytes: not a mirror receipt"),
            ));
        }
        let receipt: Receipt = serde_json::from_slice(&bytes).map_err(|e| Error::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        if receipt.version != RECEIPT_VERSION {
            return Err(Error::corrupt(
                path,
                format!(
                    "has format version {} (this build reads {RECEIPT_VERSION})",
                    receipt.version
                ),
            ));
        }
        let mut names = std::collections::HashSet::new();
        for e in &receipt.shards {
            if !is_plain_name(&e.shard) {
                return Err(Error::corrupt(
                    path,
                    format!("names `{}`, which is not a plain file name", e.shard),
                ));
            }
            if !names.insert(e.shard.as_str()) {
                return Err(Error::corrupt(path, format!("lists `{}` twice", e.shard)));
            }
            if e.sha256.len() != 64 || !e.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(Error::corrupt(
                    path,
                    format!("holds a malformed SHA-256 for `{}`", e.shard),
                ));
            }
        }
        Ok(Some(receipt))
    }

    /// Write it to `path` atomically, stamped with the time.
    pub fn write(&mut self, path: &Path) -> Result<()> {
        self.written = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let text = serde_json::to_string_pretty(self).map_err(|e| Error::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        write_atomic(path, text.as_bytes())
    }

    /// The entry for file `name`.
    pub fn entry(&self, name: &str) -> Option<&ReceiptEntry> {
        self.shards.iter().find(|e| e.shard == name)
    }

    /// Add or replace the entry for `entry.shard`.
    pub fn put(&mut self, entry: ReceiptEntry) {
        match self.shards.iter_mut().find(|e| e.shard == entry.shard) {
            Some(e) => *e = entry,
            None => self.shards.push(entry),
        }
    }
}

/// Whether `name` is one path component (no separator, not `.` or `..`, not empty).
fn is_plain_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\0'])
}

/// What a long file operation reports as it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Reading the primary (hashing it), writing the copy from `resumed` bytes on.
    Copy { resumed: u64 },
    /// Reading the copy back from the mirror drive to hash it.
    Verify,
    /// Hashing a file (verification of an existing copy or of the primary).
    Hash,
}

/// Progress of one file: the phase, bytes done and bytes in all.
pub type Progress<'a> = &'a mut dyn FnMut(Phase, u64, u64);

/// The SHA-256 (lowercase hex) and length of the file at `path`. With `uncached`, its clean
/// pages are first dropped from the page cache (best effort), so the bytes hashed are the
/// drive's, not a cached copy of what was written.
pub fn sha256_file(path: &Path, uncached: bool, progress: Progress) -> Result<(String, u64)> {
    let phase = if uncached { Phase::Verify } else { Phase::Hash };
    read_hashing(path, uncached, phase, progress, |_, _| Ok(()))
}

/// Read `path` from its first byte, hashing it and handing each chunk with its offset to
/// `each`, reporting `phase` progress; see [`sha256_file`] for `uncached`. Returns the
/// SHA-256 and the bytes read.
fn read_hashing(
    path: &Path,
    uncached: bool,
    phase: Phase,
    progress: Progress,
    mut each: impl FnMut(u64, &[u8]) -> Result<()>,
) -> Result<(String, u64)> {
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    if uncached {
        drop_cached_pages(&file);
    }
    let total = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut done = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        each(done, &buf[..n])?;
        done += n as u64;
        progress(phase, done, total);
    }
    Ok((hex(&hasher.finalize()), done))
}

/// Ask the kernel to drop `file`'s clean cached pages (ignored where it cannot).
fn drop_cached_pages(file: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: posix_fadvise takes a descriptor (open for the whole call) and plain integers;
    // it only advises the page cache and touches no memory of ours.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// Lowercase hex of `bytes`.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What [`stage_file`] did.
#[derive(Debug, Clone)]
pub struct Staged {
    /// The receipt entry of the published copy.
    pub entry: ReceiptEntry,
    /// Bytes of an interrupted copy taken over (0: copied from the start).
    pub resumed: u64,
    /// Whether the taken-over bytes failed the checksum and the copy was restarted.
    pub restarted: bool,
}

/// Copy the primary file `primary` to `dest` (which must not exist) through a temporary
/// beside `dest`, continuing an interrupted copy's temporary if one is left: the primary is
/// read once, hashed, and the bytes beyond the kept ones written; the temporary is synced,
/// read back from the drive and hashed; the copy is published under `dest` only if both
/// SHA-256s agree (a mismatch after a resumed start restarts the copy once from the first
/// byte; otherwise it is an error and the temporary is discarded). The primary is opened
/// read-only. An existing `dest` is an error, never replaced.
pub fn stage_file(primary: &Path, dest: &Path, progress: Progress) -> Result<Staged> {
    if dest.exists() {
        return Err(Error::Invalid(format!(
            "{}: already exists; a mirror file is never replaced (check it with `coli mirror verify`)",
            dest.display()
        )));
    }
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (mut out, mut kept) = AtomicFile::resume(dest)?;
    let resumed = kept;
    let mut restarted = false;
    loop {
        let (primary_sha, size) = copy_from(primary, &mut out, kept, progress)?;
        out.sync()?;
        let (copy_sha, copy_len) = sha256_file(out.tmp_path(), true, progress)?;
        if copy_sha == primary_sha && copy_len == size {
            out.commit_new()?;
            return Ok(Staged {
                entry: ReceiptEntry {
                    shard: name,
                    size,
                    sha256: primary_sha,
                },
                resumed,
                restarted,
            });
        }
        if kept > 0 && !restarted {
            // What an interrupted copy left is not what the primary holds (a power cut can
            // leave garbage): start again from the first byte.
            tracing::warn!(
                "{}: the copy continued from {kept} bytes does not match the primary; copying it again from the start",
                dest.display()
            );
            out.restart()?;
            kept = 0;
            restarted = true;
            continue;
        }
        return Err(Error::corrupt(
            out.tmp_path(),
            format!(
                "the copy of {} reads back with SHA-256 {copy_sha} ({copy_len} bytes), the primary has {primary_sha} ({size} bytes): the mirror drive does not keep what was written",
                primary.display()
            ),
        ));
    }
}

/// Read `primary` from its first byte, hashing it, and write to `out` what lies beyond its
/// first `kept` bytes. Returns the primary's SHA-256 and length.
fn copy_from(
    primary: &Path,
    out: &mut AtomicFile,
    kept: u64,
    progress: Progress,
) -> Result<(String, u64)> {
    let total = std::fs::metadata(primary)
        .map_err(|e| Error::io(primary, e))?
        .len();
    let (sha, read) = read_hashing(
        primary,
        false,
        Phase::Copy { resumed: kept },
        progress,
        |at, chunk| {
            let end = at + chunk.len() as u64;
            if end > kept {
                let skip = kept.saturating_sub(at) as usize;
                out.write_all(&chunk[skip..])
                    .map_err(|e| Error::io(out.tmp_path(), e))?;
            }
            Ok(())
        },
    )?;
    if read != total {
        return Err(Error::corrupt(
            primary,
            format!("changed size while being copied ({total} bytes, then {read})"),
        ));
    }
    Ok((sha, read))
}

/// What [`check_copy`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The copy has the receipt's size and SHA-256, and so has the primary.
    Identical,
    /// The mirror lacks the file.
    Missing,
    /// The copy's size or SHA-256 differs from the receipt's.
    CopyDiffers { size: u64, sha256: String },
    /// The primary's size or SHA-256 differs from the receipt's (the primary changed since).
    PrimaryDiffers { size: u64, sha256: String },
}

/// Check the mirror file `copy` against its receipt `entry` and the primary file `primary`:
/// both are hashed (the copy uncached, from its drive).
pub fn check_copy(
    primary: &Path,
    copy: &Path,
    entry: &ReceiptEntry,
    progress: Progress,
) -> Result<Verdict> {
    if !copy.exists() {
        return Ok(Verdict::Missing);
    }
    let (sha256, size) = sha256_file(copy, true, progress)?;
    if size != entry.size || sha256 != entry.sha256 {
        return Ok(Verdict::CopyDiffers { size, sha256 });
    }
    let (sha256, size) = sha256_file(primary, false, progress)?;
    if size != entry.size || sha256 != entry.sha256 {
        return Ok(Verdict::PrimaryDiffers { size, sha256 });
    }
    Ok(Verdict::Identical)
}

/// One checkpoint file's part of the routed-expert reads.
#[derive(Debug, Clone, Serialize)]
pub struct FileUsage {
    /// The file (in the primary directory).
    pub path: PathBuf,
    /// Its size in bytes.
    pub size: u64,
    /// Routed experts with bytes in it.
    pub experts: usize,
    /// Bytes of routed experts in it.
    pub expert_bytes: u64,
    /// Its share (0 to 1) of the expert bytes the model reads: each expert's bytes in the
    /// file weighted by the usage history's count of it (every expert alike without one).
    pub share: f64,
}

/// The checkpoint's files, most expert reads first (ties: more expert bytes, then name):
/// each file's share of the bytes routed experts are read for, by the usage `history`
/// (`None` or an empty history: every expert counts alike). Sizes are read from the files.
pub fn rank_files(layout: &ExpertLayout, history: Option<&UsageHistory>) -> Result<Vec<FileUsage>> {
    let uniform = history.is_none_or(|h| h.is_empty());
    let mut files: Vec<FileUsage> = layout
        .files
        .iter()
        .map(|p| {
            let size = std::fs::metadata(p).map_err(|e| Error::io(p, e))?.len();
            Ok(FileUsage {
                path: p.clone(),
                size,
                experts: 0,
                expert_bytes: 0,
                share: 0.0,
            })
        })
        .collect::<Result<_>>()?;
    let mut weights = vec![0.0f64; files.len()];
    for (l, layer) in layout.experts.iter().enumerate() {
        for (e, parts) in layer.iter().enumerate() {
            let count = match history {
                Some(h) if !uniform => h.count(l, e),
                _ => 1.0,
            };
            let mut seen = Vec::new();
            for &(f, bytes) in parts {
                let Some(file) = files.get_mut(f) else {
                    continue;
                };
                file.expert_bytes += bytes;
                if !seen.contains(&f) {
                    seen.push(f);
                    file.experts += 1;
                }
                weights[f] += count * bytes as f64;
            }
        }
    }
    let total: f64 = weights.iter().sum();
    for (f, w) in files.iter_mut().zip(&weights) {
        f.share = if total > 0.0 { w / total } else { 0.0 };
    }
    files.sort_by(|a, b| {
        b.share
            .total_cmp(&a.share)
            .then(b.expert_bytes.cmp(&a.expert_bytes))
            .then(a.path.cmp(&b.path))
    });
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quiet() -> impl FnMut(Phase, u64, u64) {
        |_, _, _| {}
    }

    fn sha(bytes: &[u8]) -> String {
        hex(&Sha256::digest(bytes))
    }

    #[test]
    fn sha256_of_a_known_text() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abc");
        std::fs::write(&p, b"abc").unwrap();
        let (h, n) = sha256_file(&p, false, &mut quiet()).unwrap();
        // FIPS 180-2's example.
        assert_eq!(
            h,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(n, 3);
    }

    #[test]
    fn a_copy_is_published_identical_and_never_replaces_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let primary = dir.path().join("p.bin");
        let data: Vec<u8> = (0..(CHUNK * 2 + 12345))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        std::fs::write(&primary, &data).unwrap();
        let mirror = dir.path().join("m");
        std::fs::create_dir(&mirror).unwrap();
        let dest = mirror.join("p.bin");
        let staged = stage_file(&primary, &dest, &mut quiet()).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), data);
        assert_eq!(staged.entry.sha256, sha(&data));
        assert_eq!((staged.entry.size, staged.resumed), (data.len() as u64, 0));
        let err = stage_file(&primary, &dest, &mut quiet())
            .unwrap_err()
            .to_string();
        assert!(err.contains("never replaced"), "{err}");
        // Only the copy is in the mirror directory: no temporary left.
        assert_eq!(std::fs::read_dir(&mirror).unwrap().count(), 1);
    }

    /// A temporary left by a process that ended (a pid above Linux's largest, 2^22).
    fn stale_tmp(dest: &Path) -> PathBuf {
        let mut name = dest.file_name().unwrap().to_os_string();
        name.push(".4194999.tmp");
        dest.with_file_name(name)
    }

    #[test]
    fn an_interrupted_copy_is_continued_and_a_bad_one_restarted() {
        let dir = tempfile::tempdir().unwrap();
        let primary = dir.path().join("p.bin");
        let data: Vec<u8> = (0..(CHUNK + 777)).map(|i| (i * 13 % 241) as u8).collect();
        std::fs::write(&primary, &data).unwrap();
        let mirror = dir.path().join("m");
        std::fs::create_dir(&mirror).unwrap();

        // A clean prefix is kept.
        let dest = mirror.join("p.bin");
        std::fs::write(stale_tmp(&dest), &data[..CHUNK / 2 + 3]).unwrap();
        let staged = stage_file(&primary, &dest, &mut quiet()).unwrap();
        assert_eq!(staged.resumed, (CHUNK / 2 + 3) as u64);
        assert!(!staged.restarted);
        assert_eq!(std::fs::read(&dest).unwrap(), data);

        // A prefix with a wrong byte is detected and the copy restarted.
        let dest = mirror.join("q.bin");
        let mut bad = data[..1000].to_vec();
        bad[10] ^= 1;
        std::fs::write(stale_tmp(&dest), &bad).unwrap();
        let primary_q = dir.path().join("q.bin");
        std::fs::write(&primary_q, &data).unwrap();
        let staged = stage_file(&primary_q, &dest, &mut quiet()).unwrap();
        assert!(staged.restarted);
        assert_eq!(std::fs::read(&dest).unwrap(), data);

        // A temporary longer than the primary is restarted too.
        let dest = mirror.join("r.bin");
        let primary_r = dir.path().join("r.bin");
        std::fs::write(&primary_r, &data[..100]).unwrap();
        std::fs::write(stale_tmp(&dest), &data[..200]).unwrap();
        stage_file(&primary_r, &dest, &mut quiet()).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), &data[..100]);
        let left: Vec<_> = std::fs::read_dir(&mirror)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn receipts_round_trip_and_bad_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(RECEIPT_FILE);
        assert_eq!(Receipt::read(&path).unwrap(), None);
        let mut r = Receipt::new(Path::new("/models/m"));
        r.put(ReceiptEntry {
            shard: "a.safetensors".into(),
            size: 3,
            sha256: sha(b"abc"),
        });
        r.write(&path).unwrap();
        let back = Receipt::read(&path).unwrap().unwrap();
        assert_eq!(back, r);
        assert!(back.entry("a.safetensors").is_some());
        for (bad, why) in [
            (
                r#"{"version":1,"primary":"p","written":0,"shards":[{"shard":"../x","size":1,"sha256":"00"}]}"#,
                "plain file name",
            ),
            (
                r#"{"version":9,"primary":"p","written":0,"shards":[]}"#,
                "format version 9",
            ),
            (
                r#"{"version":1,"primary":"p","written":0,"shards":[{"shard":"x","size":1,"sha256":"zz"}]}"#,
                "malformed SHA-256",
            ),
            (
                r#"{"version":1,"primary":"p","written":0,"shards":[],"extra":1}"#,
                "unknown field",
            ),
            ("[", "invalid JSON"),
        ] {
            std::fs::write(&path, bad).unwrap();
            let e = Receipt::read(&path).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(RECEIPT_FILE), "{bad}: {e}");
        }
    }

    #[test]
    fn check_copy_tells_each_case_apart() {
        let dir = tempfile::tempdir().unwrap();
        let primary = dir.path().join("p");
        let copy = dir.path().join("c");
        std::fs::write(&primary, b"abc").unwrap();
        let entry = ReceiptEntry {
            shard: "p".into(),
            size: 3,
            sha256: sha(b"abc"),
        };
        assert_eq!(
            check_copy(&primary, &copy, &entry, &mut quiet()).unwrap(),
            Verdict::Missing
        );
        std::fs::write(&copy, b"abc").unwrap();
        assert_eq!(
            check_copy(&primary, &copy, &entry, &mut quiet()).unwrap(),
            Verdict::Identical
        );
        std::fs::write(&copy, b"abd").unwrap();
        assert!(matches!(
            check_copy(&primary, &copy, &entry, &mut quiet()).unwrap(),
            Verdict::CopyDiffers { size: 3, .. }
        ));
        std::fs::write(&copy, b"abc").unwrap();
        std::fs::write(&primary, b"abcd").unwrap();
        assert!(matches!(
            check_copy(&primary, &copy, &entry, &mut quiet()).unwrap(),
            Verdict::PrimaryDiffers { size: 4, .. }
        ));
    }

    #[test]
    fn files_rank_by_the_history_of_the_experts_they_hold() {
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("f{i}"))).collect();
        for (i, f) in files.iter().enumerate() {
            std::fs::write(f, vec![0u8; 100 + i]).unwrap();
        }
        // Layer 0: expert 0 in f0, expert 1 in f1; f2 holds no expert.
        let layout = ExpertLayout {
            files: files.clone(),
            experts: vec![vec![vec![(0, 10), (0, 10)], vec![(1, 30)]]],
            ..ExpertLayout::default()
        };
        let uniform = rank_files(&layout, None).unwrap();
        assert_eq!(uniform[0].path, files[1]);
        assert!((uniform[0].share - 0.6).abs() < 1e-12);
        assert_eq!((uniform[1].experts, uniform[1].expert_bytes), (1, 20));
        assert_eq!(
            (uniform[2].path.clone(), uniform[2].share),
            (files[2].clone(), 0.0)
        );
        let mut h = UsageHistory::new("f", &[2]);
        for _ in 0..4 {
            h.record(0, &[0]);
        }
        h.record(0, &[1]);
        let ranked = rank_files(&layout, Some(&h)).unwrap();
        // Expert 0: 4 uses × 20 bytes = 80; expert 1: 1 × 30 = 30.
        assert_eq!(ranked[0].path, files[0]);
        assert!((ranked[0].share - 80.0 / 110.0).abs() < 1e-12);
        assert_eq!(ranked[0].size, 100);
    }
}
