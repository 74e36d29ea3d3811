//! Crash consistency of every kind of file colibri writes, through `kill -9` at random points.
//!
//! The test re-runs its own binary as a child that writes one target over and over through a
//! real writer — `write_atomic` (usage history, configs, tokenizers, saved chats), a streamed
//! `AtomicFile` (GGUF / safetensors output of `coli convert`), `UsageHistory::save` and
//! `kv_file::save` (prefix cache and KV files) — and prints the version it committed after
//! each write. The parent kills it (SIGKILL) a random number of commits in, at a random moment
//! inside the next write, hundreds of times, and checks after each kill:
//!
//! - the target holds one complete version, the last one reported committed or the one being
//!   written (never a torn or mixed file), or is absent only before the first commit;
//! - at most the killed child's own temporary is left, and the next writer's first commit has
//!   removed it (no stale temporaries accumulate);
//! - at the end, after a clean write, no temporary is left at all.
//!
//! Not covered here: profiles from `coli tune` and mirror staging (neither exists yet; both are
//! to use the same writers).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use colibri::format::write::{write_atomic, AtomicFile};
use colibri::model::cache::{KvBuf, KvCache};
use colibri::runtime::generate::Conversation;
use colibri::runtime::kv_file;
use colibri::store::history::UsageHistory;

/// Environment variables that turn the test binary into a writer child.
const CHILD_MODE: &str = "COLI_CRASH_CHILD_MODE";
const CHILD_DIR: &str = "COLI_CRASH_CHILD_DIR";
const FINGERPRINT: &str = "crash-test";
const EXPERTS: [usize; 3] = [64, 0, 32];

/// A deterministic pseudo-random generator (no dependency, reproducible from the seed).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
}

/// Version `k` of a whole-buffer or streamed file: a header naming `k` and the length, then
/// bytes derived from `k`, then a checksum, between 1 KiB and ~3 MiB long so that a kill
/// often lands inside a write.
fn content(k: u64) -> Vec<u8> {
    let len = 1024 + (k.wrapping_mul(2_654_435_761) % (3 << 20)) as usize;
    let mut out = format!("v{k:020} {len:020}\n").into_bytes();
    let mut g = Lcg(k);
    while out.len() < len {
        out.push(g.next() as u8);
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

/// The child: write the target again and again, reporting each committed version.
fn child(mode: &str, dir: &Path) -> ! {
    let out = std::io::stdout();
    let mut history = (mode == "history").then(|| {
        let (h, warning) = UsageHistory::load(dir, FINGERPRINT, &EXPERTS).unwrap();
        assert!(
            warning.is_none(),
            "the history left by a killed writer: {warning:?}"
        );
        h
    });
    for k in 0.. {
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
            }
            "kv" => {
                kv_file::save(&target(dir, mode), FINGERPRINT, &conversation(k)).unwrap();
            }
            other => panic!("unknown mode {other}"),
        }
        let mut o = out.lock();
        writeln!(o, "committed {k}").unwrap();
        o.flush().unwrap();
    }
    unreachable!()
}

/// The version the target holds now (`None` if absent), or why it is torn.
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

/// Names of the temporaries in the target's directory.
fn temporaries(dir: &Path, mode: &str) -> Vec<String> {
    let parent = target(dir, mode).parent().unwrap().to_path_buf();
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    names.sort();
    names
}

/// `kills` rounds of: start a writer, let it commit a random number of versions, kill it at a
/// random moment inside the next write, check the target and the temporaries.
fn kill_writers(mode: &str, kills: usize, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Lcg(seed);
    let mut last_committed: Option<u64> = None;
    let mut left_by_killed: Vec<String> = Vec::new();
    let mut mid_write = 0;
    for round in 0..kills {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &format!("{mode}_writer"), "--nocapture"])
            .env(CHILD_MODE, mode)
            .env(CHILD_DIR, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let commits = 1 + rng.next() % 3;
        let mut seen = 0;
        let mut last_this_child = None;
        while seen < commits {
            let line = match lines.next() {
                Some(Ok(l)) => l,
                other => panic!("{mode} round {round}: the writer stopped early: {other:?}"),
            };
            let Some(k) = line.strip_prefix("committed ") else {
                continue; // the test harness's own output
            };
            let k: u64 = k.parse().unwrap();
            seen += 1;
            last_this_child = Some(k);
            if seen == 1 {
                // The first commit of a new writer has removed what the killed one left.
                let now = temporaries(dir.path(), mode);
                for t in &left_by_killed {
                    assert!(
                        !now.contains(t),
                        "{mode} round {round}: the stale temporary {t} survived a new writer's commit ({now:?})"
                    );
                }
            }
        }
        // A random moment inside the next write (not a synchronisation: any moment must do).
        std::thread::sleep(std::time::Duration::from_micros(rng.next() % 20_000));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // The writer ran ahead of this reader: its last report is still in the pipe.
        for line in lines.map_while(|l| l.ok()) {
            if let Some(k) = line.strip_prefix("committed ") {
                last_this_child = Some(k.parse().unwrap());
            }
        }
        let committed = last_this_child.or(last_committed);
        match check_target(dir.path(), mode) {
            Err(why) => panic!("{mode} round {round}: torn file after kill -9: {why}"),
            Ok(None) => assert!(
                committed.is_none(),
                "{mode} round {round}: the target vanished after version {committed:?} was committed"
            ),
            Ok(Some(v)) => {
                if mode == "history" {
                    // A history that loads without a warning is a complete one; its counts
                    // decay on every save, so no version number is compared.
                    assert!(v > 0, "{mode} round {round}: a saved history with no tokens");
                } else {
                    let c = committed.expect("a file exists only after a commit");
                    assert!(
                        v == c || v == c + 1,
                        "{mode} round {round}: holds version {v}, last committed {c}"
                    );
                }
            }
        }
        let left = temporaries(dir.path(), mode);
        let own = format!(".{pid}.tmp");
        assert!(
            left.iter().all(|t| t.ends_with(&own)),
            "{mode} round {round}: temporaries of other processes left: {left:?}"
        );
        mid_write += usize::from(!left.is_empty());
        left_by_killed = left;
        last_committed = committed;
    }
    eprintln!("{mode}: {kills} kills, {mid_write} inside a write (a temporary left behind)");
    if mode != "history" {
        // The files take milliseconds to write: some kills must have landed inside one, or
        // this test checked nothing.
        assert!(mid_write > 0, "{mode}: no kill landed inside a write");
    }
    // One clean write after the last kill leaves no temporary at all.
    match mode {
        "history" => {
            let (mut h, warning) = UsageHistory::load(dir.path(), FINGERPRINT, &EXPERTS).unwrap();
            assert!(warning.is_none(), "{warning:?}");
            h.save(dir.path()).unwrap();
        }
        "kv" => {
            kv_file::save(&target(dir.path(), mode), FINGERPRINT, &conversation(1)).unwrap();
        }
        _ => write_atomic(&target(dir.path(), mode), &content(1)).unwrap(),
    }
    assert_eq!(
        temporaries(dir.path(), mode),
        Vec::<String>::new(),
        "{mode}: after a clean write"
    );
}

/// Runs as the writer child when the parent asks for it; otherwise does nothing.
fn maybe_child(mode: &str) -> bool {
    if std::env::var(CHILD_MODE).as_deref() == Ok(mode) {
        let dir = PathBuf::from(std::env::var(CHILD_DIR).unwrap());
        child(mode, &dir);
    }
    std::env::var(CHILD_MODE).is_ok()
}

#[test]
fn buffer_writer() {
    if maybe_child("buffer") {
        return;
    }
    kill_writers("buffer", 100, 1);
}

#[test]
fn stream_writer() {
    if maybe_child("stream") {
        return;
    }
    kill_writers("stream", 100, 2);
}

#[test]
fn history_writer() {
    if maybe_child("history") {
        return;
    }
    kill_writers("history", 60, 3);
}

#[test]
fn kv_writer() {
    if maybe_child("kv") {
        return;
    }
    kill_writers("kv", 60, 4);
}

/// The checks can fail: a file cut short is not a version.
#[test]
fn a_torn_file_is_recognised() {
    if std::env::var(CHILD_MODE).is_ok() {
        return;
    }
    let full = content(7);
    assert_eq!(version_of(&full), Ok(7));
    assert!(version_of(&full[..full.len() - 1]).is_err());
    let mut flipped = full.clone();
    flipped[100] ^= 1;
    assert!(version_of(&flipped).is_err());
}
