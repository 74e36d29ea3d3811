//! `coli pull` as a process against a fake Hub on 127.0.0.1 (pull/tests/support/fake_hub.rs)
//! serving a synthetic model: killed with SIGKILL in the middle of a file and run again (the
//! finished files are not fetched again, the partial one resumes with a Range request), a
//! file the Hub corrupts once detected and fetched again, a gated repository's error, and the
//! pulled directory generating the same tokens as the original.

mod support;

#[path = "../../pull/tests/support/fake_hub.rs"]
mod fake_hub;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use fake_hub::{FakeHub, TOKEN};
use support::{isolated, wait_for};

const REPO: &str = "test-org/tiny-moe";

/// A small f32 Qwen3-MoE in three or more safetensors shards.
fn synth(out: &Path) {
    let o = support::coli(&[
        "synth",
        "--arch",
        "qwen3-moe",
        "--layers",
        "2",
        "--hidden",
        "128",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--experts",
        "8",
        "--moe-intermediate",
        "64",
        "--vocab",
        "512",
        "--dtype",
        "f32",
        "--shard-bytes",
        "1000000",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `coli pull REPO --to dir` against `hub`, with a clean environment (no token, no proxy).
fn pull_cmd(hub: &FakeHub, dir: &Path, home: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_coli"));
    isolated(&mut cmd)
        .args(["pull", REPO, "--to", dir.to_str().unwrap(), "--jobs", "2"])
        .env("HF_ENDPOINT", hub.endpoint())
        .env("HF_HOME", home)
        .env_remove("HF_TOKEN");
    for proxy in [
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
    ] {
        cmd.env_remove(proxy);
    }
    cmd
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `coli run` greedy on `model`: its text.
fn generate(model: &Path) -> String {
    let o = support::coli(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "The quick brown fox",
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        "--ignore-eos",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    String::from_utf8(o.stdout).unwrap()
}

/// The files of the synthetic model, largest first.
fn files_by_size(hub: &FakeHub, dir: &Path) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = FakeHub::files_of(dir)
        .into_iter()
        .map(|f| (f.path.clone(), hub.file(&f.path).bytes.len() as u64))
        .collect();
    v.sort_by_key(|f| std::cmp::Reverse(f.1));
    v
}

#[test]
fn pull_killed_mid_file_resumes_and_the_model_serves_the_same_tokens() {
    let tmp = tempfile::tempdir().unwrap();
    let original = tmp.path().join("original");
    synth(&original);
    let hub = FakeHub::start(REPO, FakeHub::files_of(&original), 100);
    let files = files_by_size(&hub, &original);
    let shards = files
        .iter()
        .filter(|(p, _)| p.ends_with(".safetensors"))
        .count();
    assert!(shards >= 3, "{files:?}");
    let (big, big_size) = files[0].clone();
    let big_file = hub.file(&big);
    let stall_at = big_size / 3;
    hub.faults(|f| f.stall_after = Some((big.clone(), stall_at)));

    let dir = tmp.path().join("pulled");
    let home = tmp.path().join("hf-home");
    let mut child = pull_cmd(&hub, &dir, &home)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let part = dir
        .join(".coli-pull/parts")
        .join(format!("{}.part", big_file.sha256));
    // Every other file in place, the big one's part at the stall point.
    wait_for(120, "the other files and the stalled part", || {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("coli pull exited early: {status}");
        }
        let others = files[1..].iter().all(|(p, _)| dir.join(p).is_file());
        let at = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        (others && at == stall_at).then_some(())
    });
    // The receipt is written after each file: wait until it lists them all but the big one.
    wait_for(60, "the receipt of the finished files", || {
        let r = colibri_pull::read_receipt(&dir).ok()??;
        (r.files.len() == files.len() - 1).then_some(())
    });
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    hub.release();
    assert!(
        !dir.join(&big).exists(),
        "the unfinished file is not under its name"
    );
    let receipt = colibri_pull::read_receipt(&dir).unwrap().unwrap();
    assert!(!receipt.complete);
    assert!(receipt.file(&big).is_none());
    assert_eq!(std::fs::metadata(&part).unwrap().len(), stall_at);

    let mark = hub.log().len();
    let o = pull_cmd(&hub, &dir, &home).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // Finished files were not fetched again; the big one resumed from the part's length.
    for (path, _) in &files[1..] {
        assert!(hub.transfers(path, mark).is_empty(), "{path} fetched again");
    }
    let t = hub.transfers(&big, mark);
    assert_eq!(t.len(), 1, "{t:?}");
    assert_eq!(
        t[0].range.as_deref(),
        Some(format!("bytes={stall_at}-").as_str())
    );
    assert_eq!(t[0].status, 206);
    let err = stderr(&o);
    assert!(
        err.contains("1 resumed") && err.contains("every file verified"),
        "{err}"
    );
    assert!(!part.exists());
    let receipt = colibri_pull::read_receipt(&dir).unwrap().unwrap();
    assert!(receipt.complete && receipt.commit == hub.commit());
    for (path, _) in &files {
        assert_eq!(
            std::fs::read(dir.join(path)).unwrap(),
            std::fs::read(original.join(path)).unwrap(),
            "{path}"
        );
    }

    // The pulled directory is the model: the same tokens as the original.
    let want = generate(&original);
    assert!(!want.is_empty());
    assert_eq!(generate(&dir), want);

    // A third run finds the complete receipt and asks the Hub nothing.
    let mark = hub.log().len();
    let o = pull_cmd(&hub, &dir, &home).output().unwrap();
    assert!(
        o.status.success() && stderr(&o).contains("already complete"),
        "{}",
        stderr(&o)
    );
    assert_eq!(hub.log().len(), mark);
}

#[test]
fn pull_detects_a_corrupted_file_and_fetches_it_again() {
    let tmp = tempfile::tempdir().unwrap();
    let original = tmp.path().join("original");
    synth(&original);
    let hub = FakeHub::start(REPO, FakeHub::files_of(&original), 100);
    let files = files_by_size(&hub, &original);
    let victim = files[1].0.clone();
    hub.faults(|f| f.corrupt_once = vec![victim.clone(), "config.json".into()]);
    let dir = tmp.path().join("pulled");
    let o = pull_cmd(&hub, &dir, &tmp.path().join("hf-home"))
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains(&format!("{victim}: SHA-256 mismatch")),
        "{err}"
    );
    assert!(err.contains("config.json: git blob id mismatch"), "{err}");
    assert!(
        err.contains("2 fetched again after a hash mismatch"),
        "{err}"
    );
    assert_eq!(hub.transfers(&victim, 0).len(), 2);
    for (path, _) in &files {
        assert_eq!(
            std::fs::read(dir.join(path)).unwrap(),
            std::fs::read(original.join(path)).unwrap(),
            "{path}"
        );
    }
}

#[test]
fn pull_of_a_gated_repository_says_to_set_the_token() {
    let tmp = tempfile::tempdir().unwrap();
    let original = tmp.path().join("original");
    std::fs::create_dir_all(&original).unwrap();
    std::fs::write(original.join("config.json"), "{}").unwrap();
    std::fs::write(original.join("model.safetensors"), [0u8; 64]).unwrap();
    let hub = FakeHub::start(REPO, FakeHub::files_of(&original), 100);
    hub.faults(|f| f.gated = true);
    let dir = tmp.path().join("pulled");
    let home = tmp.path().join("hf-home");
    let o = pull_cmd(&hub, &dir, &home).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("gated repository") && err.contains("HF_TOKEN"),
        "{err}"
    );
    // The token from a file, and from HF_TOKEN.
    let token_file = tmp.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let o = pull_cmd(&hub, &dir, &home)
        .args(["--token-file", token_file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let o = pull_cmd(&hub, &tmp.path().join("again"), &home)
        .env("HF_TOKEN", TOKEN)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}
