//! Crash consistency of the files `coli`'s own commands write, through `kill -9` at random
//! points (the engine's writers — usage history, KV files, `coli convert` output — are in
//! engine/tests/crash_consistency.rs):
//!
//! - **profiles from `coli tune`**: the test re-runs its own binary as a writer child that
//!   writes a profile into an operator's configuration file again and again through
//!   [`colibri_server::tune::write_profile`] (what `coli tune` writes with), and kills it with
//!   the shared harness (engine/tests/kill9, included by path) hundreds of times. After every
//!   kill the file is the operator's original (only before the first commit) or holds exactly
//!   one complete version, the last reported committed or the one being written — byte for
//!   byte what writing that version produces, the operator's part kept — never a torn one;
//!   at most the killed writer's temporary is left and the next writer removes it.
//! - **mirror staging**: `coli mirror stage` itself is killed (SIGKILL) hundreds of times over
//!   a small synthetic model (5 files of ~400 KB to stage), each run at a random moment during
//!   the copy of one of its files (its first, or a random one) or up to half a file's time
//!   after it, in episodes that each end with a run that completes. Half the episodes start from an empty mirror, half from a mirror
//!   staged earlier with a smaller budget (an old receipt listing fewer files). After every
//!   kill: each model file on the mirror is byte-identical to the primary's (a file is absent
//!   or complete, never torn); the receipt is absent (empty start), the old one byte for byte,
//!   or a complete new one listing every chosen file with the primary's size and SHA-256
//!   (computed by `sha256sum`); a journal, if left, is complete and lists only files that are
//!   on the mirror and identical; every temporary belongs to a process killed in this episode,
//!   holds a prefix of its primary file, and there is at most one per target (they do not
//!   accumulate). After the run that completes: no temporary and no journal are left, the
//!   receipt is the complete new one, `coli mirror verify` passes, and the primary is
//!   unchanged (bytes and modification times).

#[path = "../../engine/tests/kill9/mod.rs"]
mod kill9;
mod support;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use colibri::store::reader::ReaderKind;
use colibri::store::staging::{Receipt, ReceiptEntry, JOURNAL_FILE, RECEIPT_FILE};
use colibri_server::tune::{write_profile, Setting};
use kill9::{kill_writers, temporaries, temporary_pid, Drained, Lcg, Lines, Target};
use support::isolated;

/// Kills per kind and `cargo test` run.
const KILLS: usize = 200;

// ---- profiles from `coli tune` ----

/// The operator's configuration file before any profile is written: comments, a base key,
/// another profile.
const ORIGINAL: &str = "# the operator's settings\nslots = 2 # two at once\n\n\
                        [profiles.debug]\nlog_level = \"debug\"\n";

/// What version `k` of the profile names in its comment.
const VERSION_MARK: &str = "# Written by the crash test: version ";

/// The setting of version `k`: every tuned key varies with `k`.
fn setting(k: u64) -> Setting {
    Setting {
        threads: 1 + (k % 64) as usize,
        io: if k.is_multiple_of(2) {
            ReaderKind::Pool
        } else {
            ReaderKind::Uring
        },
        direct_io: k.is_multiple_of(3),
        prefetch: !k.is_multiple_of(5),
        pin_budget: (!k.is_multiple_of(4)).then(|| format!("{}M", 16 + k % 1000).parse().unwrap()),
        prefill_chunk: 64 << (k % 4),
    }
}

/// The comment above version `k`: like `coli tune`'s (a line per setting measured), naming
/// `k`.
fn comment(k: u64) -> String {
    let mut c =
        format!("\n{VERSION_MARK}{k}.\n# Median prefill tok/s, decode tok/s and ms per setting:\n");
    for i in 0..24 {
        c.push_str(&format!(
            "#   threads={} io=pool direct_io=false prefetch=true pin_budget=half \
             prefill_chunk=256: {:.1}, {:.2}, {:.3}\n",
            1 + i,
            100.0 + (k * 31 + i) as f64 / 7.0,
            10.0 + (k * 17 + i) as f64 / 13.0,
            900.0 + (k * 7 + i) as f64 / 3.0
        ));
    }
    c
}

/// Write version `k` of the profile `tuned` into `file`, as `coli tune --force` does.
fn write_version(file: &Path, k: u64) {
    write_profile(
        file,
        "tuned",
        "demo",
        &setting(k),
        &[("ram".into(), "8G".into())],
        &comment(k),
        true,
    )
    .unwrap();
}

/// The bytes of the configuration file holding version `k`: the operator's file with version
/// `k` written into it.
fn expected_profile(k: u64) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("colibri.toml");
    std::fs::write(&file, ORIGINAL).unwrap();
    write_version(&file, k);
    std::fs::read_to_string(&file).unwrap()
}

/// The version the configuration file `text` holds (`None`: still the operator's original), or
/// why it is not a complete one; `expected` gives (and caches) each version's bytes.
fn profile_version(
    text: &str,
    expected: &mut impl FnMut(u64) -> String,
) -> Result<Option<u64>, String> {
    if text == ORIGINAL {
        return Ok(None);
    }
    let at = text
        .find(VERSION_MARK)
        .ok_or_else(|| format!("neither the original nor a version ({} bytes)", text.len()))?
        + VERSION_MARK.len();
    let digits: String = text[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let k: u64 = digits
        .parse()
        .map_err(|_| format!("no version number after the mark ({} bytes)", text.len()))?;
    let want = expected(k);
    if text != want {
        return Err(format!(
            "holds {} bytes that are not version {k} ({} bytes)",
            text.len(),
            want.len()
        ));
    }
    Ok(Some(k))
}

#[test]
fn tune_profile_writer() {
    if let Some(dir) = kill9::child_dir("tune_profile") {
        let file = dir.join("colibri.toml");
        kill9::writer_loop(|k| {
            write_version(&file, k);
            k
        });
    }
    if kill9::in_child() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("colibri.toml");
    std::fs::write(&file, ORIGINAL).unwrap();
    let cache = RefCell::new(HashMap::new());
    let check = || {
        let text = std::fs::read_to_string(&file)
            .map_err(|e| format!("{} cannot be read: {e}", file.display()))?;
        profile_version(&text, &mut |k| {
            cache
                .borrow_mut()
                .entry(k)
                .or_insert_with(|| expected_profile(k))
                .clone()
        })
    };
    let clean_write = || write_version(&file, 1);
    let counts = kill_writers(
        &Target {
            mode: "tune_profile",
            dir: dir.path(),
            tmp_dir: dir.path().to_path_buf(),
            check: &check,
            max_pause: Duration::from_millis(20),
            clean_write: &clean_write,
        },
        KILLS,
        19,
    );
    assert!(
        counts.inside() * 2 > KILLS,
        "only {} of {} kills landed inside a write (at least {} needed)",
        counts.inside(),
        counts.kills,
        KILLS / 2 + 1
    );
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.starts_with(ORIGINAL),
        "the operator's part is kept: {text}"
    );
}

/// The checks can fail: a version is the same bytes whatever it replaced, and a file cut
/// short, with a changed byte, or of the wrong version is not a version.
#[test]
fn a_torn_profile_is_recognised() {
    if kill9::in_child() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("colibri.toml");
    std::fs::write(&file, ORIGINAL).unwrap();
    write_version(&file, 7);
    write_version(&file, 3);
    let text = std::fs::read_to_string(&file).unwrap();
    assert_eq!(text, expected_profile(3), "a version replaced by another");
    let mut expected = |k| expected_profile(k);
    assert_eq!(profile_version(&text, &mut expected), Ok(Some(3)));
    assert_eq!(profile_version(ORIGINAL, &mut expected), Ok(None));
    for cut in [text.len() - 1, text.len() / 2, ORIGINAL.len() + 60] {
        assert!(
            profile_version(&text[..cut], &mut expected).is_err(),
            "cut at {cut}"
        );
    }
    let changed = text.replace("threads = 4", "threads = 5");
    assert_ne!(changed, text);
    assert!(profile_version(&changed, &mut expected).is_err());
    let other = expected_profile(4).replace("version 4.", "version 3.");
    assert!(profile_version(&other, &mut expected).is_err());
}

// ---- mirror staging ----

/// `coli ARGS` with its own state and cache directories under `root`.
fn coli(root: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_coli"));
    isolated(&mut cmd)
        .env("COLI_STATE_DIR", root.join("state"))
        .env("COLI_CACHE_DIR", root.join("cache"));
    cmd
}

/// Run `cmd` to completion, asserting it succeeded; its stdout.
fn ok(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().expect("coli runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Every file of `dir`: name -> (bytes, modification time).
fn snapshot(dir: &Path) -> BTreeMap<String, (Vec<u8>, SystemTime)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let meta = e.metadata().unwrap();
            (
                e.file_name().into_string().unwrap(),
                (std::fs::read(e.path()).unwrap(), meta.modified().unwrap()),
            )
        })
        .collect()
}

/// SHA-256 of the file `path` in lowercase hex, by the `sha256sum` tool (not colibri's).
fn sha256sum(path: &Path) -> String {
    let out = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum runs");
    assert!(out.status.success(), "sha256sum {}", path.display());
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}

/// The small model, the files a staging chooses and what the mirror must hold of them.
struct Model {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    dir: PathBuf,
    /// The chosen files (all that hold routed experts), most expert reads first.
    chosen: Vec<String>,
    /// Their bytes in the primary.
    bytes: HashMap<String, Vec<u8>>,
    /// The complete receipt's entries, by name.
    entries: Vec<ReceiptEntry>,
}

impl Model {
    /// A synthetic OLMoE split into files of ~400 KB.
    fn new() -> Model {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        let dir = root.join("model");
        ok(
            coli(&root)
                .args([
                    "synth", "--arch", "olmoe", "--layers", "2", "--hidden", "128",
                ])
                .args([
                    "--experts",
                    "8",
                    "--top-k",
                    "2",
                    "--moe-intermediate",
                    "128",
                ])
                .args(["--vocab", "512", "--shard-bytes", "400000", "--out"])
                .arg(&dir),
            "coli synth",
        );
        let plan: serde_json::Value = serde_json::from_str(&ok(
            coli(&root)
                .args(["mirror", "plan", "--json", "--model"])
                .arg(&dir),
            "coli mirror plan",
        ))
        .unwrap();
        let chosen: Vec<String> = plan["files"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["chosen"].as_bool().unwrap())
            .map(|f| f["name"].as_str().unwrap().to_string())
            .collect();
        assert!(chosen.len() >= 4, "{plan}");
        let bytes: HashMap<String, Vec<u8>> = chosen
            .iter()
            .map(|n| (n.clone(), std::fs::read(dir.join(n)).unwrap()))
            .collect();
        let mut entries: Vec<ReceiptEntry> = chosen
            .iter()
            .map(|n| ReceiptEntry {
                shard: n.clone(),
                size: bytes[n].len() as u64,
                sha256: sha256sum(&dir.join(n)),
            })
            .collect();
        entries.sort_by(|a, b| a.shard.cmp(&b.shard));
        Model {
            _tmp: tmp,
            root,
            dir,
            chosen,
            bytes,
            entries,
        }
    }

    /// `coli mirror stage` of the model to `to`, with `extra` arguments.
    fn stage(&self, to: &Path, extra: &[&str]) -> Command {
        let mut cmd = coli(&self.root);
        cmd.args(["mirror", "stage", "--reserve", "0", "--model"])
            .arg(&self.dir)
            .arg("--to")
            .arg(to)
            .args(extra);
        cmd
    }

    /// The expected entry of file `name`.
    fn entry(&self, name: &str) -> &ReceiptEntry {
        self.entries.iter().find(|e| e.shard == name).unwrap()
    }

    /// Whether `r` is the complete receipt of a staging of every chosen file.
    fn complete(&self, r: &Receipt) -> Result<(), String> {
        let primary = std::path::absolute(&self.dir)
            .unwrap()
            .display()
            .to_string();
        if r.primary != primary {
            return Err(format!("names the primary {}, not {primary}", r.primary));
        }
        if r.shards != self.entries {
            return Err(format!("lists {:?}, not {:?}", r.shards, self.entries));
        }
        Ok(())
    }
}

/// How a staging run ended.
enum Ended {
    /// Killed by SIGKILL: its process id.
    Killed(u32),
    /// Completed: its stdout.
    Completed(String),
}

/// The line a staging prints as it starts copying a file (`coli mirror: [2/5] NAME: copying
/// 385.4 KiB ...`).
const COPYING: &str = ": copying ";

/// When to kill a staging: a moment after it starts copying its `nth` file (1-based).
#[derive(Debug, Clone, Copy)]
struct KillAt {
    nth: usize,
    after: Duration,
}

/// Run `cmd` (a staging) and kill it (SIGKILL) at `kill` if it is still running then, or
/// let it run to its end (`None`). Also returns its stderr and the time from its first
/// `copying` line to its end.
fn run_stage(cmd: &mut Command, kill: Option<KillAt>) -> (Ended, String, Duration) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("coli runs");
    let pid = child.id();
    let mut out = Drained::new(&mut child, Lines::Stderr);
    let mut err = String::new();
    let mut started = None;
    let mut copying = 0;
    while let Some(line) = out.next_line(Duration::from_secs(120), "coli mirror stage") {
        err.push_str(&line);
        err.push('\n');
        if !line.contains(COPYING) {
            continue;
        }
        copying += 1;
        started.get_or_insert_with(Instant::now);
        if let Some(k) = kill.filter(|k| k.nth == copying) {
            // A random moment of the copy and what follows it (not a synchronisation: any
            // moment must do).
            std::thread::sleep(k.after);
            child.kill().unwrap(); // SIGKILL, or nothing if it has ended
            break;
        }
    }
    let status = child.wait().unwrap();
    let took = started.map_or(Duration::ZERO, |t| t.elapsed());
    let (rest, stdout) = out.finish();
    for line in rest {
        err.push_str(&line);
        err.push('\n');
    }
    if status.signal() == Some(libc::SIGKILL) {
        return (Ended::Killed(pid), err, took);
    }
    assert!(
        status.success(),
        "the staging failed ({status}):\n{stdout}\n{err}"
    );
    (Ended::Completed(stdout), err, took)
}

/// The chosen files on the mirror `to` that neither its journal nor its receipt lists: files
/// published by a staging killed before it journalled them.
fn unjournalled(m: &Model, to: &Path) -> Vec<String> {
    let listed = |file: &str| {
        Receipt::read(&to.join(file))
            .ok()
            .flatten()
            .map_or(Vec::new(), |r| r.shards)
    };
    let mut known = listed(JOURNAL_FILE);
    known.extend(listed(RECEIPT_FILE));
    m.chosen
        .iter()
        .filter(|n| to.join(n).exists() && !known.iter().any(|e| &e.shard == *n))
        .cloned()
        .collect()
}

/// The checks after a kill (see the module documentation). `old`: the receipt the episode
/// started with. Returns the temporaries left.
fn check_after_kill(
    m: &Model,
    to: &Path,
    old: Option<&[u8]>,
    killed: &[u32],
    what: &str,
) -> Vec<String> {
    let mut temporaries = Vec::new();
    let mut receipt = None;
    for e in std::fs::read_dir(to).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        let path = e.path();
        if let Some(pid) = temporary_pid(&name) {
            assert!(
                killed.contains(&pid),
                "{what}: the temporary {name} is not of a process killed in this episode ({killed:?})"
            );
            let target = name.strip_suffix(&format!(".{pid}.tmp")).unwrap();
            if let Some(primary) = m.bytes.get(target) {
                let bytes = std::fs::read(&path).unwrap();
                assert!(
                    primary.starts_with(&bytes),
                    "{what}: the temporary {name} ({} bytes) is not a prefix of its primary",
                    bytes.len()
                );
            } else {
                assert!(
                    target == RECEIPT_FILE || target == JOURNAL_FILE,
                    "{what}: a temporary of an unexpected file: {name}"
                );
            }
            temporaries.push(name);
        } else if name == RECEIPT_FILE {
            let bytes = std::fs::read(&path).unwrap();
            if old != Some(bytes.as_slice()) {
                let r = Receipt::read(&path)
                    .unwrap_or_else(|e| panic!("{what}: a torn receipt: {e}"))
                    .unwrap();
                m.complete(&r).unwrap_or_else(|why| {
                    panic!("{what}: neither the old receipt nor a complete new one: it {why}")
                });
            }
            receipt = Some(());
        } else if name == JOURNAL_FILE {
            let j = Receipt::read(&path)
                .unwrap_or_else(|e| panic!("{what}: a torn journal: {e}"))
                .unwrap();
            for entry in &j.shards {
                assert_eq!(entry, m.entry(&entry.shard), "{what}: the journal's entry");
                assert!(
                    to.join(&entry.shard).is_file(),
                    "{what}: the journal lists {} but the mirror lacks it",
                    entry.shard
                );
            }
        } else if let Some(primary) = m.bytes.get(&name) {
            let bytes = std::fs::read(&path).unwrap();
            assert!(
                bytes == *primary,
                "{what}: {name} on the mirror ({} bytes) is not the primary's ({} bytes): torn",
                bytes.len(),
                primary.len()
            );
        } else {
            panic!("{what}: an unexpected file on the mirror: {name}");
        }
    }
    if old.is_some() {
        assert!(receipt.is_some(), "{what}: the old receipt vanished");
    }
    let mut targets: Vec<&str> = temporaries
        .iter()
        .map(|n| n.rsplitn(3, '.').nth(2).unwrap())
        .collect();
    targets.sort();
    let before = targets.len();
    targets.dedup();
    assert_eq!(
        before,
        targets.len(),
        "{what}: more than one temporary of a file: {temporaries:?} (they accumulate)"
    );
    temporaries
}

/// The checks after a run that completed.
fn check_completed(m: &Model, to: &Path, stdout: &str, what: &str) {
    assert!(stdout.contains("receipt"), "{what}: {stdout}");
    let left: Vec<String> = temporaries(to)
        .into_iter()
        .chain(
            to.join(JOURNAL_FILE)
                .exists()
                .then(|| JOURNAL_FILE.to_string()),
        )
        .collect();
    assert!(
        left.is_empty(),
        "{what}: left after a completed staging: {left:?}"
    );
    let r = Receipt::read(&to.join(RECEIPT_FILE)).unwrap().unwrap();
    m.complete(&r)
        .unwrap_or_else(|why| panic!("{what}: the receipt {why}"));
    for name in &m.chosen {
        assert!(
            std::fs::read(to.join(name)).unwrap() == m.bytes[name],
            "{what}: {name} differs from the primary"
        );
    }
    let out = ok(
        coli(&m.root)
            .args(["mirror", "verify", "--model"])
            .arg(&m.dir)
            .arg("--mirror")
            .arg(to),
        "coli mirror verify",
    );
    assert!(
        out.contains(&format!("verified: {} files", m.chosen.len())),
        "{what}: {out}"
    );
}

#[test]
fn mirror_stage_survives_kills() {
    if kill9::in_child() {
        return;
    }
    let t0 = Instant::now();
    let m = Model::new();
    let primary_before = snapshot(&m.dir);

    // How long the staging of a file takes (its copy, check, publication and journal entry):
    // an uninterrupted staging's time from its first copy to its end, per file.
    let scratch = m.root.join("scratch");
    let (ended, err, whole) = run_stage(&mut m.stage(&scratch, &[]), None);
    let Ended::Completed(stdout) = ended else {
        panic!("the scratch staging was killed:\n{err}")
    };
    check_completed(&m, &scratch, &stdout, "the scratch staging");
    std::fs::remove_dir_all(&scratch).unwrap();
    let per_file = whole / m.chosen.len() as u32;

    // An old mirror: the two files of most reads, staged with a budget that fits just them.
    let old = m.root.join("old");
    let budget = m.bytes[&m.chosen[0]].len() + m.bytes[&m.chosen[1]].len();
    ok(
        &mut m.stage(&old, &["--budget", &budget.to_string()]),
        "a staging with a budget",
    );
    let old_receipt = std::fs::read(old.join(RECEIPT_FILE)).unwrap();
    assert_eq!(
        Receipt::read(&old.join(RECEIPT_FILE))
            .unwrap()
            .unwrap()
            .shards
            .len(),
        2
    );

    let mut rng = Lcg(20261203);
    let (mut kills, mut episodes, mut continued) = (0, 0, 0);
    // Kills that left the killed run's temporary (inside a copy, or inside the atomic write of
    // the journal or the receipt), and kills after a file was published but before it was
    // journalled (inside the step that stages one file).
    let (mut temporary_left, mut published_unjournalled) = (0, 0);
    while kills < KILLS {
        let to = m.root.join(format!("mirror{episodes}"));
        let from_old = episodes % 2 == 1;
        if from_old {
            std::fs::create_dir(&to).unwrap();
            for e in std::fs::read_dir(&old).unwrap() {
                let e = e.unwrap();
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
        let old = from_old.then_some(old_receipt.as_slice());
        let mut killed = Vec::new();
        loop {
            let what = format!("episode {episodes}, run {}", killed.len() + 1);
            // Killed during the copy of the first file it copies (half the runs: more kills
            // per episode) or of a random one of those still to copy, or up to half a file's
            // time after it; a run with none to copy runs to its end.
            let to_copy = m.chosen.iter().filter(|n| !to.join(n).exists()).count() as u64;
            let kill = (to_copy > 0).then(|| KillAt {
                nth: if rng.next().is_multiple_of(2) {
                    1
                } else {
                    1 + (rng.next() % to_copy) as usize
                },
                after: per_file.mul_f64(1.5 * rng.unit()),
            });
            let before = if to.exists() {
                unjournalled(&m, &to)
            } else {
                Vec::new()
            };
            let (ended, err, _) = run_stage(&mut m.stage(&to, &[]), kill);
            continued += err.matches("continued an interrupted copy").count();
            match ended {
                Ended::Killed(pid) => {
                    kills += 1;
                    killed.push(pid);
                    let left = check_after_kill(&m, &to, old, &killed, &what);
                    let own = format!(".{pid}.tmp");
                    if left.iter().any(|n| n.ends_with(&own)) {
                        temporary_left += 1;
                    } else if unjournalled(&m, &to).iter().any(|n| !before.contains(n)) {
                        published_unjournalled += 1;
                    }
                    assert!(
                        killed.len() < 100,
                        "{what}: the staging makes no progress; the last run's log:\n{err}"
                    );
                }
                Ended::Completed(stdout) => {
                    check_completed(&m, &to, &stdout, &what);
                    break;
                }
            }
        }
        assert!(
            snapshot(&m.dir) == primary_before,
            "episode {episodes}: the primary changed"
        );
        std::fs::remove_dir_all(&to).unwrap();
        episodes += 1;
    }
    let inside = temporary_left + published_unjournalled;
    eprintln!(
        "mirror staging: {kills} kills in {episodes} episodes, {inside} inside a write \
         ({temporary_left} left the killed run's temporary, {published_unjournalled} a file \
         published but not yet journalled), {continued} interrupted copies continued, 0 torn files, \
         0 stale temporaries, the primary unchanged, verify passed after each; {} files of \
         {} bytes; {:.1} s",
        m.chosen.len(),
        m.bytes.values().map(Vec::len).sum::<usize>(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        inside * 2 > kills,
        "only {inside} of {kills} kills landed inside a write"
    );
    assert!(continued > 0, "no interrupted copy was continued");
}
