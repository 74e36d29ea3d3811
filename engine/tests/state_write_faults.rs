//! State writes refused by the file system, for real: a full file system (`ENOSPC`: a small
//! tmpfs filled to the last block), a read-only one (`EROFS`: a read-only bind mount, what a
//! read-only volume gives) and a forbidden directory (`EACCES`: mode 0555 with the capability
//! that lets root write anyway dropped, so the test means the same as root or not). Every
//! writer of state — `write_atomic` (configs, tokenizers, machine files), a streamed
//! `AtomicFile` (convert's output), `UsageHistory::save` and `kv_file::save` (prefix cache, KV
//! files) — must give an error naming the file and the system's reason, leave the old file
//! byte for byte as it was and leave no temporary behind; once space is freed, the same write
//! succeeds.
//!
//! The file systems are made in a private user and mount namespace (`unshare -Urm`), so the
//! test needs no privilege and changes nothing outside itself: the test re-runs its own binary
//! there (told so by [`CHILD_DIR`]). Where user namespaces are not allowed, it says "skipped"
//! and why.

mod namespace;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use colibri::format::write::{write_atomic, AtomicFile};
use colibri::model::cache::{KvBuf, KvCache};
use colibri::runtime::generate::Conversation;
use colibri::runtime::kv_file;
use colibri::store::history::UsageHistory;

/// Set in the child: the directory holding `full/`, `ro/` and `locked/`.
const CHILD_DIR: &str = "COLI_STATE_FAULT_CHILD_DIR";
const FINGERPRINT: &str = "state-fault-test";
const EXPERTS: [usize; 2] = [16, 8];
/// The tmpfs that is filled: small, so filling it is quick.
const TMPFS_SIZE: &str = "1m";

/// One writer of state, writing version `k` of its file in `dir`.
#[derive(Clone, Copy, Debug)]
enum Writer {
    Buffer,
    Stream,
    History,
    Kv,
}

const WRITERS: [Writer; 4] = [Writer::Buffer, Writer::Stream, Writer::History, Writer::Kv];

/// Version `k` of a plain file: a few KiB naming `k`.
fn content(k: u64) -> Vec<u8> {
    let mut v = format!("version {k}\n").into_bytes();
    v.extend((0..4096u32).map(|i| (i as u64 * 31 + k) as u8));
    v
}

/// Conversation `k`: `k` in its first token, a cache of a few KiB.
fn conversation(k: u64) -> Conversation {
    let len = 16;
    let mut cache = KvCache::new(2, 64);
    cache.len = len;
    for l in cache.layers.iter_mut() {
        l.k = KvBuf::F32((0..64 * len).map(|i| (i as u64 + k) as f32).collect());
        l.v = KvBuf::F32((0..64 * len).map(|i| (i as u64 * 3 + k) as f32).collect());
    }
    let mut tokens = vec![k as u32];
    tokens.extend(0..len as u32 - 1);
    Conversation { tokens, cache }
}

/// A usage history that has seen `k` steps.
fn history(k: u64) -> UsageHistory {
    let mut h = UsageHistory::new(FINGERPRINT, &EXPERTS);
    for step in 0..k {
        h.record(0, &[(step % 16) as usize]);
        h.record(1, &[(step % 8) as usize]);
        h.end_step();
    }
    h
}

impl Writer {
    fn path(self, dir: &Path) -> PathBuf {
        match self {
            Writer::Buffer => dir.join("machine.json"),
            Writer::Stream => dir.join("model.gguf"),
            Writer::History => UsageHistory::path(dir, FINGERPRINT).unwrap(),
            Writer::Kv => dir.join("slot-0.kv"),
        }
    }

    fn write(self, dir: &Path, k: u64) -> colibri::Result<()> {
        match self {
            Writer::Buffer => write_atomic(&self.path(dir), &content(k)),
            Writer::Stream => {
                let path = self.path(dir);
                let mut f = AtomicFile::create(&path)?;
                for chunk in content(k).chunks(1000) {
                    f.write_all(chunk)
                        .map_err(|e| colibri::Error::io(&path, e))?;
                }
                f.commit()
            }
            Writer::History => history(k).save(dir),
            Writer::Kv => kv_file::save(&self.path(dir), FINGERPRINT, &conversation(k)).map(|_| ()),
        }
    }

    /// The version the file holds, or why it is not one.
    fn version(self, dir: &Path) -> Result<u64, String> {
        let path = self.path(dir);
        match self {
            Writer::Buffer | Writer::Stream => {
                let bytes = std::fs::read(&path).map_err(|e| e.to_string())?;
                (0..4)
                    .find(|&k| bytes == content(k))
                    .ok_or_else(|| format!("{} holds no version", path.display()))
            }
            Writer::History => {
                let (h, warning) = UsageHistory::load(dir, FINGERPRINT, &EXPERTS).unwrap();
                match warning {
                    Some(w) => Err(w),
                    None => Ok(h.tokens()),
                }
            }
            Writer::Kv => kv_file::load(&path, FINGERPRINT)
                .map(|c| c.tokens[0] as u64)
                .map_err(|e| e.to_string()),
        }
    }
}

/// The sorted paths of the files under `dir`, relative to it (the usage history lives in a
/// subdirectory): a temporary left anywhere shows.
fn names(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    out.sort();
    out
}

/// Every writer's version 1, in `dir`.
fn write_old_versions(dir: &Path) {
    for w in WRITERS {
        w.write(dir, 1).unwrap();
        assert_eq!(w.version(dir), Ok(1), "{w:?}");
    }
}

/// Version 2 of every writer is refused in `dir` with `reason` (the system's words); the
/// error names the file, version 1 stays, and no temporary is left.
fn assert_refused(dir: &Path, reason: &str) {
    let before = names(dir);
    for w in WRITERS {
        let err = w
            .write(dir, 2)
            .expect_err(&format!("{w:?} in {}", dir.display()))
            .to_string();
        let file = w
            .path(dir)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        assert!(err.contains(&file), "{w:?}: the error names {file}: {err}");
        assert!(
            err.contains(reason),
            "{w:?}: the error says {reason:?}: {err}"
        );
        assert_eq!(w.version(dir), Ok(1), "{w:?}: the old file is kept");
        assert_eq!(names(dir), before, "{w:?}: no temporary is left");
        println!("refused: {w:?}: {err}");
    }
}

/// In the namespace: `full/` is a tmpfs, `ro/` a read-only bind mount holding version 1 of
/// every file (written by the parent), `locked/` a 0555 directory holding the same, and this
/// process cannot override file permissions.
fn child(base: &Path) {
    // ENOSPC: version 1 written, then the rest of the file system filled.
    let full = base.join("full");
    write_old_versions(&full);
    let mut filler = std::fs::File::create(full.join("filler")).unwrap();
    let block = vec![0xa5u8; 64 << 10];
    let filled = loop {
        match filler.write(&block) {
            Ok(0) => panic!("a write of nothing"),
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert_eq!(filled.raw_os_error(), Some(libc::ENOSPC), "{filled}");
    drop(filler);
    assert_refused(&full, "No space left on device");
    // Space freed: the same writes succeed, without a restart.
    std::fs::remove_file(full.join("filler")).unwrap();
    for w in WRITERS {
        w.write(&full, 2).unwrap();
        assert_eq!(w.version(&full), Ok(2), "{w:?}");
    }

    // EROFS: a read-only volume.
    assert_refused(&base.join("ro"), "Read-only file system");

    // EACCES: a directory the process may not write.
    assert_refused(&base.join("locked"), "Permission denied");
}

/// The command that runs this test's binary as the child, in its namespace, with the file
/// systems in place.
fn child_command(base: &Path) -> Command {
    let script = r#"set -e
base="$1"; shift
mount -t tmpfs -o size="$SIZE" tmpfs "$base/full"
mount --bind "$base/ro" "$base/ro"
mount -o remount,bind,ro "$base/ro"
exec setpriv --bounding-set=-dac_override,-dac_read_search "$@""#;
    let mut cmd = Command::new("unshare");
    cmd.args(["-Urm", "sh", "-c", script, "sh"])
        .arg(base)
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "state_writes_refused_by_the_file_system_keep_the_old_file",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SIZE", TMPFS_SIZE)
        .env(CHILD_DIR, base);
    cmd
}

#[test]
fn state_writes_refused_by_the_file_system_keep_the_old_file() {
    if let Ok(base) = std::env::var(CHILD_DIR) {
        child(Path::new(&base));
        return;
    }
    if !namespace::private_mounts_or_skip(
        "mount -t tmpfs tmpfs /mnt && setpriv --bounding-set=-dac_override true",
    ) {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    for sub in ["full", "ro", "locked"] {
        std::fs::create_dir(base.join(sub)).unwrap();
    }
    write_old_versions(&base.join("ro"));
    write_old_versions(&base.join("locked"));
    // Every directory of it (the usage history's subdirectory too).
    let locked = [base.join("locked/usage"), base.join("locked")];
    for d in &locked {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o555)).unwrap();
    }
    let out = child_command(base).output().unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    for d in locked.iter().rev() {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    assert!(out.status.success(), "the child failed:\n{log}");
    for line in log.lines().filter(|l| l.starts_with("refused: ")) {
        eprintln!("{line}");
    }
    // The child really ran the checks (a filter that matched nothing would pass too).
    assert!(log.contains("1 passed"), "{log}");
    // Nothing it did reached this side: the tmpfs was the child's own.
    assert_eq!(names(&base.join("full")), Vec::<String>::new());
}
