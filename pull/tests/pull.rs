//! `colibri_pull::pull` against a fake Hub on 127.0.0.1 (tests/support/fake_hub.rs): what
//! lands, the receipt, resumption from a part, hash mismatches, broken and stalled transfers,
//! and the errors a user meets (gated, missing revision, no space, unsafe paths).

#[path = "support/fake_hub.rs"]
mod fake_hub;

use std::path::Path;

use colibri_pull::{pull, read_receipt, Options, RepoSpec, Summary, RECEIPT, STAGING};
use fake_hub::{sha256, FakeHub, HubFile, TOKEN};

const REPO: &str = "test-org/tiny-model";

/// `n` deterministic pseudo-random bytes.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A repository in the Hugging Face layout, with files the default selection leaves out.
fn repo_files() -> Vec<HubFile> {
    vec![
        HubFile::new(
            ".gitattributes",
            b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n".to_vec(),
        ),
        HubFile::new("README.md", b"# tiny\n".to_vec()),
        HubFile::new("config.json", br#"{"model_type": "llama"}"#.to_vec()),
        HubFile::new(
            "generation_config.json",
            br#"{"do_sample": false}"#.to_vec(),
        ),
        HubFile::new("model-00001-of-00002.safetensors", bytes(3 << 20, 1)),
        HubFile::new(
            "model-00002-of-00002.safetensors",
            bytes((2 << 20) + 12345, 2),
        ),
        HubFile::new(
            "model.safetensors.index.json",
            br#"{"weight_map": {}}"#.to_vec(),
        ),
        HubFile::new("sub/extra.safetensors", bytes(1000, 3)),
        HubFile::new("tokenizer.json", bytes(70_000, 4)),
        HubFile::new(
            "tokenizer_config.json",
            br#"{"chat_template": "x"}"#.to_vec(),
        ),
    ]
}

const DEFAULT: &[&str] = &[
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
];
const BIG: &str = "model-00001-of-00002.safetensors";

fn options(hub: &FakeHub, spec: &str, dir: &Path) -> Options {
    Options {
        spec: RepoSpec::parse(spec).unwrap(),
        dir: dir.to_path_buf(),
        include: vec![],
        endpoint: hub.endpoint(),
        token: None,
        jobs: 3,
        refresh: false,
    }
}

/// Every default file is in `dir` with the Hub's bytes, the receipt is complete and lists
/// their SHA-256, and nothing else is there.
fn assert_landed(hub: &FakeHub, dir: &Path) {
    for path in DEFAULT {
        let got = std::fs::read(dir.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(got == *hub.file(path).bytes, "{path}: bytes differ");
    }
    let receipt = read_receipt(dir).unwrap().expect("a receipt");
    assert!(receipt.complete);
    assert_eq!(receipt.commit, hub.commit());
    let listed: Vec<&str> = receipt.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(listed, DEFAULT);
    for f in &receipt.files {
        assert_eq!(f.sha256, sha256(&hub.file(&f.path).bytes), "{}", f.path);
        assert_eq!(f.size, hub.file(&f.path).bytes.len() as u64);
        assert_eq!(
            f.git_oid.is_some(),
            !f.path.ends_with(".safetensors"),
            "{}",
            f.path
        );
    }
    let mut entries: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    entries.sort();
    let mut expected: Vec<String> = DEFAULT.iter().map(|s| s.to_string()).collect();
    expected.push(RECEIPT.to_string());
    expected.sort();
    assert_eq!(
        entries, expected,
        "the staging folder and parts are gone, nothing else written"
    );
}

#[test]
fn pulls_the_default_files_verified_with_a_receipt_then_is_a_no_op() {
    let hub = FakeHub::start(REPO, repo_files(), 3);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let s = pull(&options(&hub, REPO, &dir)).unwrap();
    assert_landed(&hub, &dir);
    assert_eq!(
        (s.files, s.downloaded, s.resumed, s.refetched, s.present),
        (7, 7, 0, 0, 0)
    );
    let log = hub.log();
    // The tree came in pages (3 entries a page) through the Link header.
    let pages = log.iter().filter(|l| l.path.contains("/tree/")).count();
    assert!(pages >= 4, "{pages} tree pages");
    // Every LFS file came from the CDN, without the token (none here) and after a redirect.
    assert_eq!(hub.transfers(BIG, 0).len(), 1);
    assert!(log.iter().any(|l| l.server == "hub" && l.status == 302));
    // Files outside the default selection were not fetched.
    assert!(!log
        .iter()
        .any(|l| l.path.ends_with("README.md") || l.path.contains("extra")));

    // Again: the complete receipt answers, the Hub is not asked.
    let before = hub.log().len();
    let again = pull(&options(&hub, REPO, &dir)).unwrap();
    assert!(again.up_to_date, "{again}");
    assert_eq!(hub.log().len(), before);
    // --refresh asks the Hub, finds the same commit and hashes, downloads nothing.
    let refreshed = pull(&Options {
        refresh: true,
        ..options(&hub, REPO, &dir)
    })
    .unwrap();
    assert_eq!(
        (
            refreshed.downloaded,
            refreshed.present,
            refreshed.transferred
        ),
        (0, 7, 0)
    );
    assert!(hub.transfers(BIG, before).is_empty());
}

#[test]
fn a_part_is_resumed_with_a_range_request() {
    let hub = FakeHub::start(REPO, repo_files(), 100);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let big = hub.file(BIG);
    let parts = dir.join(STAGING).join("parts");
    std::fs::create_dir_all(&parts).unwrap();
    let have = 1_234_567;
    std::fs::write(
        parts.join(format!("{}.part", big.sha256)),
        &big.bytes[..have],
    )
    .unwrap();
    let s = pull(&options(&hub, REPO, &dir)).unwrap();
    assert_landed(&hub, &dir);
    assert_eq!(s.resumed, 1);
    let t = hub.transfers(BIG, 0);
    assert_eq!(t.len(), 1);
    assert_eq!(
        t[0].range.as_deref(),
        Some(format!("bytes={have}-").as_str())
    );
    assert_eq!(t[0].status, 206);
    let total: u64 = DEFAULT.iter().map(|p| hub.file(p).bytes.len() as u64).sum();
    assert_eq!(
        s.transferred,
        total - have as u64,
        "only the missing bytes came over the network"
    );
}

#[test]
fn a_corrupted_file_is_fetched_again_once() {
    let hub = FakeHub::start(REPO, repo_files(), 100);
    hub.faults(|f| f.corrupt_once = vec![BIG.into(), "tokenizer.json".into()]);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let s = pull(&options(&hub, REPO, &dir)).unwrap();
    assert_landed(&hub, &dir);
    assert_eq!(s.refetched, 2);
    // Two whole transfers of each (the second from byte 0, not resumed).
    for path in [BIG, "tokenizer.json"] {
        let t = hub.transfers(path, 0);
        assert_eq!(t.len(), 2, "{path}: {t:?}");
        assert!(t.iter().all(|l| l.range.is_none()), "{path}: {t:?}");
    }
}

#[test]
fn a_file_corrupted_every_time_is_an_error_naming_it() {
    let hub = FakeHub::start(REPO, repo_files(), 100);
    hub.faults(|f| f.corrupt_always = vec![BIG.into()]);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let e = format!("{:#}", pull(&options(&hub, REPO, &dir)).unwrap_err());
    assert!(
        e.contains(BIG) && e.contains("SHA-256 mismatch") && e.contains("second time"),
        "{e}"
    );
    assert!(
        !dir.join(BIG).exists(),
        "an unverified file was put in place"
    );
    assert_eq!(hub.transfers(BIG, 0).len(), 2);
    let receipt = read_receipt(&dir).unwrap().unwrap();
    assert!(!receipt.complete);
    assert!(receipt.file(BIG).is_none());
    // The rerun, once the Hub serves the right bytes, fetches only what is missing.
    hub.faults(|f| f.corrupt_always.clear());
    let before = hub.log().len();
    let s = pull(&options(&hub, REPO, &dir)).unwrap();
    assert_landed(&hub, &dir);
    for path in DEFAULT {
        let n = hub.transfers(path, before).len();
        assert_eq!(n, usize::from(receipt.file(path).is_none()), "{path}");
    }
    assert_eq!(s.present, receipt.files.len());
}

#[test]
fn a_broken_transfer_resumes_where_it_stopped() {
    let hub = FakeHub::start(REPO, repo_files(), 100);
    hub.faults(|f| f.cut_after = Some((BIG.into(), 1_000_000)));
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    pull(&options(&hub, REPO, &dir)).unwrap();
    assert_landed(&hub, &dir);
    let t = hub.transfers(BIG, 0);
    assert_eq!(t.len(), 2, "{t:?}");
    assert_eq!(t[0].range, None);
    assert_eq!(t[1].range.as_deref(), Some("bytes=1000000-"));
}

#[test]
fn a_server_ignoring_ranges_gets_the_file_from_the_start() {
    let hub = FakeHub::start(REPO, repo_files(), 100);
    hub.faults(|f| f.ignore_range = true);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let big = hub.file(BIG);
    let parts = dir.join(STAGING).join("parts");
    std::fs::create_dir_all(&parts).unwrap();
    std::fs::write(
        parts.join(format!("{}.part", big.sha256)),
        &big.bytes[..1000],
    )
    .unwrap();
    pull(&options(&hub, REPO, &dir)).unwrap();
    assert_landed(&hub, &dir);
    let t = hub.transfers(BIG, 0);
    assert_eq!(t.len(), 2, "{t:?}");
    assert_eq!((t[0].status, t[1].range.as_deref()), (200, None));
}

#[test]
fn a_file_already_in_place_is_hashed_not_downloaded() {
    let hub = FakeHub::start(REPO, repo_files(), 100);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(BIG), &*hub.file(BIG).bytes).unwrap();
    // Same size, other bytes: replaced.
    let mut wrong = hub.file("tokenizer.json").bytes.to_vec();
    wrong[5] ^= 1;
    std::fs::write(dir.join("tokenizer.json"), &wrong).unwrap();
    let s = pull(&options(&hub, REPO, &dir)).unwrap();
    assert_landed(&hub, &dir);
    assert!(hub.transfers(BIG, 0).is_empty());
    assert_eq!(hub.transfers("tokenizer.json", 0).len(), 1);
    assert_eq!((s.present, s.downloaded), (1, 6));
}

#[test]
fn gated_repositories_need_the_token() {
    let hub = FakeHub::start(REPO, repo_files(), 100);
    hub.faults(|f| f.gated = true);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let e = format!("{:#}", pull(&options(&hub, REPO, &dir)).unwrap_err());
    assert!(
        e.contains("gated") && e.contains("HF_TOKEN") && e.contains("401"),
        "{e}"
    );
    let wrong = Options {
        token: Some("hf_wrong".into()),
        ..options(&hub, REPO, &dir)
    };
    let e = format!("{:#}", pull(&wrong).unwrap_err());
    assert!(e.contains("gated") && e.contains("403"), "{e}");
    let right = Options {
        token: Some(TOKEN.into()),
        ..options(&hub, REPO, &dir)
    };
    pull(&right).unwrap();
    assert_landed(&hub, &dir);
    // The token went to the Hub, never to the CDN (which refuses requests that carry one).
    let log = hub.log();
    assert!(log
        .iter()
        .filter(|l| l.server == "cdn")
        .all(|l| l.authorization.is_none()));
    assert!(log
        .iter()
        .filter(|l| l.server == "hub" && l.status < 400)
        .all(|l| l.authorization.as_deref() == Some(&format!("Bearer {TOKEN}"))));
}

#[test]
fn missing_revisions_repositories_and_patterns_are_named() {
    let hub = FakeHub::start(REPO, repo_files(), 100);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let e = format!(
        "{:#}",
        pull(&options(&hub, &format!("{REPO}@v9"), &dir)).unwrap_err()
    );
    assert!(
        e.contains("revision \"v9\"") && e.contains("not found"),
        "{e}"
    );
    let e = format!(
        "{:#}",
        pull(&options(&hub, "test-org/other", &dir)).unwrap_err()
    );
    assert!(
        e.contains("test-org/other") && e.contains("not found"),
        "{e}"
    );
    let o = Options {
        include: vec!["*.json".into(), "*.gguf".into()],
        ..options(&hub, REPO, &dir)
    };
    let e = format!("{:#}", pull(&o).unwrap_err());
    assert!(
        e.contains("\"*.gguf\" matches no file") && e.contains("config.json"),
        "{e}"
    );
    // By commit, with patterns: only those files.
    let o = Options {
        include: vec!["*.json".into()],
        ..options(&hub, &format!("{REPO}@{}", hub.commit()), &dir)
    };
    let s: Summary = pull(&o).unwrap();
    assert_eq!(s.files, 5); // config, generation_config, index, tokenizer, tokenizer_config
    assert!(!dir.join(BIG).exists());
    assert!(dir.join("model.safetensors.index.json").exists());
}

#[test]
fn too_little_space_is_refused_before_writing() {
    let hub = FakeHub::start(REPO, repo_files(), 100);
    hub.faults(|f| {
        f.tree_size.insert(BIG.into(), 1 << 60);
    });
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let e = format!("{:#}", pull(&options(&hub, REPO, &dir)).unwrap_err());
    assert!(
        e.contains("need") && e.contains("free") && e.contains("--include"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "nothing written"
    );
    assert!(hub
        .log()
        .iter()
        .all(|l| !l.path.contains("/resolve/") && l.server == "hub"));
}

#[test]
fn unsafe_paths_and_other_repositories_are_refused() {
    let hub = FakeHub::start(REPO, repo_files(), 100);
    hub.faults(|f| {
        f.extra_tree
            .push(("../escape.json".into(), 2, "1".repeat(40)))
    });
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    let o = Options {
        include: vec!["*.json".into()],
        ..options(&hub, REPO, &dir)
    };
    let e = format!("{:#}", pull(&o).unwrap_err());
    assert!(
        e.contains("../escape.json") && e.contains("not a safe relative path"),
        "{e}"
    );
    assert!(!tmp.path().join("escape.json").exists());

    let other = tmp.path().join("other");
    let hub2 = FakeHub::start("test-org/second", repo_files(), 100);
    pull(&options(&hub2, "test-org/second", &other)).unwrap();
    let e = format!("{:#}", pull(&options(&hub, REPO, &other)).unwrap_err());
    assert!(
        e.contains("holds test-org/second") && e.contains("another --to"),
        "{e}"
    );
}
