//! Crash consistency of every kind of file the engine writes, through `kill -9` at random
//! points, by the shared harness in `kill9/` (one implementation, also included by
//! server/tests/crash_consistency.rs, which covers `coli tune` profiles and mirror staging).
//!
//! The test re-runs its own binary as a child that writes one target over and over through a
//! real writer — `write_atomic` (usage history, configs, tokenizers, saved chats), a streamed
//! `AtomicFile` (GGUF / safetensors output of `coli convert`), `UsageHistory::save` and
//! `kv_file::save` (prefix cache and KV files) — and prints the version it committed after
//! each write. The parent drains those reports as they come, kills the child (SIGKILL) a
//! random number of commits in, at a random moment of the writing that goes on, 200 times per
//! kind, and checks after each kill:
//!
//! - the target holds one complete version, the last one reported committed or the one being
//!   written (never a torn or mixed file), or is absent only before the first commit;
//! - at most the killed child's own temporary is left, and the next writer's first commit has
//!   removed it (no stale temporaries accumulate);
//! - at the end, after a clean write, no temporary is left at all.
//!
//! More than half the kills of each kind must land inside a write (the killed writer's
//! temporary left, or a version renamed into place but not yet reported), or the test fails:
//! the files are a few MiB at most and the writer spends most of its time writing and syncing.

mod kill9;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use colibri::format::write::{write_atomic, AtomicFile};
use colibri::model::cache::{KvBuf, KvCache};
use colibri::runtime::generate::Conversation;
use colibri::runtime::kv_file;
use colibri::store::history::UsageHistory;
use kill9::{kill_writers, Lcg, Target};

const FINGERPRINT: &str = "crash-test";
const EXPERTS: [usize; 3] = [64, 0, 32];

/// A fixed pseudo-random pattern (1 MiB) the versions are cut from, made once: copying it is
/// cheap, so the writer spends its time writing, where the kills are to land.
fn pattern() -> &'static [u8] {
    static PATTERN: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    PATTERN.get_or_init(|| {
        let mut g = Lcg(0x5eed);
        (0..1 << 20).map(|_| g.next() as u8).collect()
    })
}

/// Version `k` of a whole-buffer or streamed file: a header naming `k` and the length, then
/// the pattern rotated by an offset that depends on `k`, then a checksum; between 1 KiB and
/// ~3 MiB long so that a kill often lands inside a write.
fn content(k: u64) -> Vec<u8> {
    let len = 1024 + (k.wrapping_mul(2_654_435_761) % (3 << 20)) as usize;
    let mut out = Vec::with_capacity(len + 8);
    out.extend_from_slice(format!("v{k:020} {len:020}\n").as_bytes());
    let p = pattern();
    let mut at = (k.wrapping_mul(7919) % p.len() as u64) as usize;
    while out.len() < len {
        let n = (len - out.len()).min(p.len() - at);
        out.extend_from_slice(&p[at..at + n]);
        at = 0;
    }
    let sum: u64 = out.iter().map(|&b| b as u64).sum();
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// The version a file written by [`content`] holds, or why it is not a complete one.
fn version_of(bytes: &[u8]) -> Result<u64, String> {
    let header = bytes.get(..42).ok_or("shorter than the header")?;
    let text = std::str::from_utf8(header).map_err(|_| "header is not text")?;
    let k: u64 = text[1..21].parse().map_err(|_| "bad version")?;
    if bytes != content(k).as_slice() {
        return Err(format!(
            "holds {} bytes that are not version {k} ({} bytes)",
            bytes.len(),
            content(k).len()
        ));
    }
    Ok(k)
}

/// Conversation `k` for a KV file: `k` in its first token, a length that varies with `k`.
fn conversation(k: u64) -> Conversation {
    let len = 1 + (k as usize * 37) % 900;
    let mut cache = KvCache::new(2, 1024);
    cache.len = len;
    let mut g = Lcg(k);
    for l in cache.layers.iter_mut() {
        l.k = KvBuf::F32((0..64 * len).map(|_| g.next() as f32).collect());
        l.v = KvBuf::F32((0..64 * len).map(|_| g.next() as f32).collect());
    }
    let mut tokens = vec![k as u32];
    tokens.extend((0..len as u32).map(|i| i % 500));
    Conversation { tokens, cache }
}

fn target(dir: &Path, mode: &str) -> PathBuf {
    match mode {
        "history" => UsageHistory::path(dir, FINGERPRINT).unwrap(),
        "kv" => dir.join("conversation.kv"),
        _ => dir.join("target.bin"),
    }
}

/// The writer child: write the target again and again, reporting each committed version.
fn child(mode: &str, dir: &Path) -> ! {
    let mut history = (mode == "history").then(|| {
        let (h, warning) = UsageHistory::load(dir, FINGERPRINT, &EXPERTS).unwrap();
        assert!(
            warning.is_none(),
            "the history left by a killed writer: {warning:?}"
        );
        h
    });
    kill9::writer_loop(|k| {
        match mode {
            "buffer" => write_atomic(&target(dir, mode), &content(k)).unwrap(),
            "stream" => {
                let mut f = AtomicFile::create(&target(dir, mode)).unwrap();
                for chunk in content(k).chunks(4096) {
                    f.write_all(chunk).unwrap();
                }
                f.commit().unwrap();
            }
            "history" => {
                let h = history.as_mut().unwrap();
                h.record(0, &[(k % 64) as usize, ((k / 64) % 64) as usize]);
                h.record(2, &[(k % 32) as usize]);
                h.end_step();
                h.save(dir).unwrap();
                // Its version: the tokens (steps) it holds, one more on every save.
                return h.tokens();
            }
            "kv" => {
                kv_file::save(&target(dir, mode), FINGERPRINT, &conversation(k)).unwrap();
            }
            other => panic!("unknown mode {other}"),
        }
        k
    })
}

/// The version the target holds now (`None` if absent), or why it is torn. A usage history
/// that loads without a warning is a complete one; its version is its token count.
fn check_target(dir: &Path, mode: &str) -> Result<Option<u64>, String> {
    let path = target(dir, mode);
    match mode {
        "history" => {
            if !path.exists() {
                return Ok(None);
            }
            let (h, warning) = UsageHistory::load(dir, FINGERPRINT, &EXPERTS).unwrap();
            match warning {
                Some(w) => Err(w),
                None => Ok(Some(h.tokens())),
            }
        }
        "kv" => match std::fs::metadata(&path) {
            Err(_) => Ok(None),
            Ok(_) => kv_file::load(&path, FINGERPRINT)
                .map(|c| Some(c.tokens[0] as u64))
                .map_err(|e| e.to_string()),
        },
        _ => match std::fs::read(&path) {
            Err(_) => Ok(None),
            Ok(bytes) => version_of(&bytes).map(Some),
        },
    }
}

/// [`KILLS`] kills of the writer of `mode` (see [`kill9::kill_writers`]); most must land
/// inside a write, or this test checks little.
fn kill(mode: &str, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let check = || check_target(d, mode);
    let clean_write = || match mode {
        "history" => {
            let (mut h, warning) = UsageHistory::load(d, FINGERPRINT, &EXPERTS).unwrap();
            assert!(warning.is_none(), "{warning:?}");
            h.save(d).unwrap();
        }
        "kv" => {
            kv_file::save(&target(d, mode), FINGERPRINT, &conversation(1)).unwrap();
        }
        _ => write_atomic(&target(d, mode), &content(1)).unwrap(),
    };
    let counts = kill_writers(
        &Target {
            mode,
            dir: d,
            tmp_dir: target(d, mode).parent().unwrap().to_path_buf(),
            check: &check,
            max_pause: Duration::from_millis(20),
            clean_write: &clean_write,
        },
        KILLS,
        seed,
    );
    assert!(
        counts.inside() * 2 > KILLS,
        "{mode}: only {} of {} kills landed inside a write (at least {} needed)",
        counts.inside(),
        counts.kills,
        KILLS / 2 + 1
    );
}

/// Kills per kind and `cargo test` run.
const KILLS: usize = 200;

#[test]
fn buffer_writer() {
    if let Some(dir) = kill9::child_dir("buffer") {
        child("buffer", &dir);
    }
    if kill9::in_child() {
        return;
    }
    kill("buffer", 1);
}

#[test]
fn stream_writer() {
    if let Some(dir) = kill9::child_dir("stream") {
        child("stream", &dir);
    }
    if kill9::in_child() {
        return;
    }
    kill("stream", 2);
}

#[test]
fn history_writer() {
    if let Some(dir) = kill9::child_dir("history") {
        child("history", &dir);
    }
    if kill9::in_child() {
        return;
    }
    kill("history", 3);
}

#[test]
fn kv_writer() {
    if let Some(dir) = kill9::child_dir("kv") {
        child("kv", &dir);
    }
    if kill9::in_child() {
        return;
    }
    kill("kv", 4);
}

/// The checks can fail: a file cut short is not a version.
#[test]
fn a_torn_file_is_recognised() {
    if kill9::in_child() {
        return;
    }
    let full = content(7);
    assert_eq!(version_of(&full), Ok(7));
    assert!(version_of(&full[..full.len() - 1]).is_err());
    let mut flipped = full.clone();
    flipped[100] ^= 1;
    assert!(version_of(&flipped).is_err());
}
