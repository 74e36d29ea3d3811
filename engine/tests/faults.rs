//! Fault injection in the expert store: for a streamed model (a RAM budget that caches no
//! expert, so every step reads) and a mirrored one, every read fault gives either the clean
//! run's greedy tokens (a retry, or the mirror falling back to the primary) or a clean error
//! naming the file and byte offset: never other tokens, a panic or a hang. Each run is on its
//! own thread and waited for with a timeout, so a hang fails the test and a panic is reported.

mod common;
use common::{fixture, prompt};

use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use colibri::model::{self, LoadOptions};
use colibri::runtime::generate::{generate, GenerateParams};
use colibri::runtime::sampling::SamplingParams;
use colibri::store::fault::{Action, Fault, Schedule, Trigger, WrapReader};
use colibri::store::mirror::Mirror;
use colibri::store::StoreOptions;

const ARCH: &str = "olmoe";
const FILE: &str = "model.safetensors";
/// Far more than any run here takes (slow reads included); reaching it means a hang.
const TIMEOUT: Duration = Duration::from_secs(120);
/// The slow reads' delay: within the 100 ms–1 s of a struggling drive, short for the tests.
const SLOW: Duration = Duration::from_millis(100);

/// A copy of the fixture in `dir` (so truncating it harms nothing).
fn copy_model(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for entry in std::fs::read_dir(fixture(ARCH)).unwrap() {
        let p = entry.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
        }
    }
    dir.to_path_buf()
}

/// Streamed placement (no expert fits the cache), two I/O threads, the mirror if any.
fn streamed(dir: &Path, mirror: Option<&Path>, wrap: Option<WrapReader>) -> StoreOptions {
    let dense = model::load(dir).unwrap().info().dense_bytes as u64;
    StoreOptions {
        ram_budget: Some(dense),
        io_threads: 2,
        mirrors: mirror
            .map(|m| {
                vec![Mirror {
                    dir: m.to_path_buf(),
                    weight: 1.0,
                }]
            })
            .unwrap_or_default(),
        wrap_reader: wrap,
        ..StoreOptions::default()
    }
}

/// Eight greedy tokens of the fixture's prompt with `dir` loaded under `opts`, or the error's
/// message. Panics if the run hangs or panics.
fn run(dir: &Path, opts: StoreOptions) -> Result<Vec<u32>, String> {
    let (tx, rx) = channel();
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        let ids = prompt(ARCH);
        let params = GenerateParams {
            max_tokens: 8,
            eos_token_ids: vec![],
            stop_strings: vec![],
            sampling: SamplingParams::greedy(),
        };
        let result = model::load_with(&dir, &LoadOptions::from(opts))
            .and_then(|m| generate(m.as_ref(), None, &ids, &params, |_| {}, |_| {}))
            .map(|g| g.tokens)
            .map_err(|e| e.to_string());
        let _ = tx.send(result);
    });
    match rx.recv_timeout(TIMEOUT) {
        Ok(r) => r,
        Err(RecvTimeoutError::Timeout) => panic!("the run hung for {TIMEOUT:?}"),
        Err(RecvTimeoutError::Disconnected) => panic!("the run panicked"),
    }
}

fn fault(trigger: Trigger, action: Action, times: u64) -> Fault {
    Fault {
        trigger,
        action,
        times,
    }
}

/// Run with `faults` on drive `drive`; the schedule comes back to count firings.
fn run_faulty(
    dir: &Path,
    mirror: Option<&Path>,
    drive: usize,
    faults: Vec<Fault>,
) -> (Result<Vec<u32>, String>, Arc<Schedule>) {
    let schedule = Schedule::new(faults);
    let wrap = WrapReader::faults_on(drive, schedule.clone());
    let r = run(dir, streamed(dir, mirror, Some(wrap)));
    (r, schedule)
}

/// A clean error: names the checkpoint file and the byte offset.
fn assert_clean_error(r: &Result<Vec<u32>, String>, offset: Option<u64>, what: &str) {
    let e = match r {
        Ok(t) => panic!("{what}: expected an error, got tokens {t:?}"),
        Err(e) => e,
    };
    assert!(e.contains(FILE), "{what}: the error names the file: {e}");
    match offset {
        Some(o) => assert!(
            e.contains(&format!("offset {o}")),
            "{what}: the error names offset {o}: {e}"
        ),
        None => assert!(
            e.contains("offset"),
            "{what}: the error names an offset: {e}"
        ),
    }
}

#[test]
fn streamed_store_read_faults_are_retried_or_clean_errors() {
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = copy_model(&tmp.path().join("model"));
    let reference = run(&fixture(ARCH), StoreOptions::default()).unwrap();

    // The clean reader, wrapped but injecting nothing: the resident tokens.
    let (clean, log) = run_faulty(&dir, None, 0, vec![]);
    assert_eq!(clean.unwrap(), reference, "streamed = resident");
    let seen = log.seen();
    assert!(log.reads() > 8, "every step reads ({} reads)", log.reads());
    // An expert range in the middle of the run, for the faults that touch one offset.
    let victim = seen[seen.len() / 2].clone();

    // EIO once, on the 4th read: retried, same tokens.
    let (r, s) = run_faulty(&dir, None, 0, vec![fault(Trigger::Nth(3), Action::Eio, 1)]);
    assert_eq!(s.fired(), 1);
    assert_eq!(r.unwrap(), reference, "a transient EIO is retried");

    // EIO every time a read touches one offset: a clean error naming file and offset.
    let touching = Trigger::Touching {
        file: victim.file,
        offset: victim.offset + victim.len as u64 / 2,
    };
    let (r, s) = run_faulty(&dir, None, 0, vec![fault(touching, Action::Eio, u64::MAX)]);
    assert_eq!(s.fired(), 2, "the read and its one retry");
    assert_clean_error(&r, Some(victim.offset), "persistent EIO");

    // A short read once: detected, retried, same tokens.
    let (r, s) = run_faulty(
        &dir,
        None,
        0,
        vec![fault(Trigger::Nth(2), Action::Short, 1)],
    );
    assert_eq!(s.fired(), 1);
    assert_eq!(r.unwrap(), reference, "a transient short read is retried");

    // Short reads every time: a clean error, never a tensor with missing bytes.
    let (r, _) = run_faulty(
        &dir,
        None,
        0,
        vec![fault(Trigger::Every, Action::Short, u64::MAX)],
    );
    assert_clean_error(&r, None, "persistent short reads");

    // Slow reads: same tokens, no timeout.
    let (r, s) = run_faulty(
        &dir,
        None,
        0,
        vec![fault(Trigger::Every, Action::Delay(SLOW), 5)],
    );
    assert_eq!(s.fired(), 5);
    assert_eq!(r.unwrap(), reference, "slow reads change nothing");

    // The file is cut to its first 64 bytes mid-run: a clean error naming file and offset.
    let cut = fault(Trigger::Nth(4), Action::Truncate { file: 0, len: 64 }, 1);
    let (r, s) = run_faulty(&dir, None, 0, vec![cut]);
    assert_eq!(s.fired(), 1);
    assert_eq!(std::fs::metadata(dir.join(FILE)).unwrap().len(), 64);
    assert_clean_error(&r, None, "truncated mid-run");
    let e = r.unwrap_err();
    assert!(e.contains("ends at byte 64"), "{e}");
}

#[test]
fn mirrored_store_read_faults_fall_back_or_are_retried() {
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let dir = copy_model(&tmp.path().join("primary"));
    let reference = run(&fixture(ARCH), StoreOptions::default()).unwrap();
    let fresh_mirror = |name: &str| {
        let m = tmp.path().join(name);
        std::fs::create_dir_all(&m).unwrap();
        std::fs::copy(dir.join(FILE), m.join(FILE)).unwrap();
        m
    };

    let mirror = fresh_mirror("mirror");
    let (clean, log) = run_faulty(&dir, Some(&mirror), 1, vec![]);
    assert_eq!(clean.unwrap(), reference, "mirrored = resident");
    assert!(log.reads() > 0, "the mirror serves some reads");

    // Every mirror read fails (EIO), or comes back short, or is slow: the primary serves them.
    for (what, action) in [
        ("EIO", Action::Eio),
        ("short", Action::Short),
        ("slow", Action::Delay(SLOW)),
    ] {
        let times = if what == "slow" { 5 } else { u64::MAX };
        let (r, s) = run_faulty(
            &dir,
            Some(&mirror),
            1,
            vec![fault(Trigger::Every, action, times)],
        );
        assert!(s.fired() > 0, "{what}: the fault fired");
        assert_eq!(r.unwrap(), reference, "{what} on the mirror: same tokens");
    }

    // The mirror's copy is cut mid-run: its reads fail and fall back to the primary.
    let cut_mirror = fresh_mirror("mirror-cut");
    let cut = fault(Trigger::Nth(1), Action::Truncate { file: 0, len: 64 }, 1);
    let (r, s) = run_faulty(&dir, Some(&cut_mirror), 1, vec![cut]);
    assert_eq!(s.fired(), 1);
    assert_eq!(
        std::fs::metadata(cut_mirror.join(FILE)).unwrap().len(),
        64,
        "the mirror's copy was really cut"
    );
    assert_eq!(r.unwrap(), reference, "a truncated mirror: same tokens");

    // A transient EIO on the primary (its first read) is retried: same tokens.
    let (r, s) = run_faulty(
        &dir,
        Some(&mirror),
        0,
        vec![fault(Trigger::Every, Action::Eio, 1)],
    );
    assert_eq!(s.fired(), 1, "the primary serves some reads");
    assert_eq!(r.unwrap(), reference, "a transient EIO on the primary");

    // A persistent EIO on the primary for one range is a clean error (the mirror is only
    // ever a source the primary covers for, not the other way round).
    let (_, log) = run_faulty(&dir, Some(&mirror), 0, vec![]);
    let seen = log.seen();
    let victim = seen[seen.len() / 2].clone();
    let touching = Trigger::Touching {
        file: victim.file,
        offset: victim.offset,
    };
    let (r, _) = run_faulty(
        &dir,
        Some(&mirror),
        0,
        vec![fault(touching, Action::Eio, u64::MAX)],
    );
    assert_clean_error(&r, Some(victim.offset), "persistent EIO on the primary");
}
