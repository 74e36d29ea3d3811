//! `coli mirror plan|stage|verify` on a synthetic model split into several files:
//! - `plan` ranks the files by the expert reads the usage history says they serve and
//!   chooses within a byte budget;
//! - `stage` killed (SIGKILL) at random moments and rerun completes; an interrupted copy is
//!   continued and a journalled file re-verified rather than copied again; `verify` passes and
//!   the primary is unchanged (its bytes and modification times before and after);
//! - the staged mirror serves: `coli run --mirror` gives the tokens it gives without, with the
//!   bytes read from each drive shown (also by `coli bench` and `/metrics`);
//! - a damaged or foreign mirror file fails `verify`, and `stage` refuses to replace it.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Instant, SystemTime};

use support::{http, isolated, wait_for, Served};

/// `coli ARGS` with the state directory `state` and a cache directory beside it holding a
/// machine measurement (so that `bench` does not measure this machine's bandwidth).
fn coli(state: &Path) -> Command {
    let cache = state.with_file_name("cache");
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::write(
        cache.join("machine.json"),
        r#"{"disk_gb_per_s": 1.0, "memory_gb_per_s": 10.0, "disk_source": "test", "measured_unix": 0}"#,
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_coli"));
    isolated(&mut cmd)
        .env("COLI_STATE_DIR", state)
        .env("COLI_CACHE_DIR", cache);
    cmd
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("coli runs")
}

fn ok(out: Output, what: &str) -> (String, String) {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{stderr}");
    (stdout, stderr)
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

fn shards(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    v.sort();
    v
}

/// A small deterministic sequence of pseudo-random numbers in [0, 1).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

struct Setup {
    _tmp: tempfile::TempDir,
    model: PathBuf,
    state: PathBuf,
    root: PathBuf,
    ram: String,
}

/// A synthetic OLMoE in several files, and a usage history recorded by `coli run`.
fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let model = root.join("model");
    let state = root.join("state");
    ok(
        run(coli(&state)
            .args([
                "synth", "--arch", "olmoe", "--layers", "4", "--hidden", "256",
            ])
            .args([
                "--experts",
                "16",
                "--top-k",
                "2",
                "--moe-intermediate",
                "256",
            ])
            .args(["--vocab", "512", "--shard-bytes", "3000000", "--out"])
            .arg(&model)),
        "synth",
    );
    assert!(shards(&model).len() >= 4, "{:?}", shards(&model));
    let dense = colibri::model::load(&model).unwrap().info().dense_bytes;
    let ram = dense.to_string();
    ok(
        run(coli(&state)
            .args(["run", "--model"])
            .arg(&model)
            .args([
                "--ram",
                &ram,
                "--threads",
                "1",
                "-p",
                "The hummingbird hovers",
            ])
            .args(["--max-tokens", "16", "--temperature", "1", "--seed", "3"])),
        "coli run (recording a usage history)",
    );
    Setup {
        _tmp: tmp,
        model,
        state,
        root,
        ram,
    }
}

fn plan_json(s: &Setup, extra: &[&str]) -> serde_json::Value {
    let (out, _) = ok(
        run(coli(&s.state)
            .args(["mirror", "plan", "--json", "--model"])
            .arg(&s.model)
            .args(extra)),
        "coli mirror plan",
    );
    serde_json::from_str(&out).unwrap()
}

#[test]
fn plan_ranks_files_by_the_expert_reads_of_the_usage_history() {
    let s = setup();
    let plan = plan_json(&s, &[]);
    assert!(
        plan["history"]
            .as_str()
            .unwrap()
            .contains("usage history of"),
        "{plan}"
    );
    let files = plan["files"].as_array().unwrap();
    assert_eq!(files.len(), shards(&s.model).len());
    let shares: Vec<f64> = files.iter().map(|f| f["share"].as_f64().unwrap()).collect();
    assert!(shares.windows(2).all(|w| w[0] >= w[1]), "{shares:?}");
    assert!(
        (shares.iter().sum::<f64>() - 1.0).abs() < 1e-9,
        "{shares:?}"
    );
    // The history is not uniform: the top file serves more than its share of expert bytes.
    let bytes: Vec<f64> = files
        .iter()
        .map(|f| f["expert_bytes"].as_f64().unwrap())
        .collect();
    let total: f64 = bytes.iter().sum();
    assert!(
        (shares[0] - bytes[0] / total).abs() > 1e-6,
        "the ranking follows the history, not the sizes: {plan}"
    );
    // A budget of two files' bytes chooses the top files that fit, in rank order.
    let sizes: Vec<u64> = files.iter().map(|f| f["size"].as_u64().unwrap()).collect();
    let budget = sizes[0] + sizes[1];
    let plan = plan_json(&s, &["--budget", &budget.to_string()]);
    let chosen: Vec<bool> = plan["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["chosen"].as_bool().unwrap())
        .collect();
    assert!(chosen[0] && chosen[1], "{plan}");
    assert!(plan["chosen_bytes"].as_u64().unwrap() <= budget, "{plan}");
    // The text form says the same.
    let (text, _) = ok(
        run(coli(&s.state)
            .args(["mirror", "plan", "--model"])
            .arg(&s.model)),
        "coli mirror plan",
    );
    assert!(text.contains("rank") && text.contains("reads %"), "{text}");
}

#[test]
fn stage_survives_kills_verify_passes_and_the_mirror_serves() {
    let s = setup();
    let mirror = s.root.join("drive2").join("mirror");
    let primary_before = snapshot(&s.model);
    let stage = |extra: &[&str]| {
        let mut cmd = coli(&s.state);
        cmd.args(["mirror", "stage", "--model"])
            .arg(&s.model)
            .arg("--to")
            .arg(&mirror)
            .args(["--reserve", "0"])
            .args(extra);
        cmd
    };

    // How long an uninterrupted staging takes, on a scratch mirror.
    let scratch = s.root.join("scratch");
    let t0 = Instant::now();
    ok(
        run(coli(&s.state)
            .args(["mirror", "stage", "--reserve", "0", "--model"])
            .arg(&s.model)
            .arg("--to")
            .arg(&scratch)),
        "a whole staging",
    );
    let whole = t0.elapsed();

    // Killed at random moments within that time (each kill lands on a live process). A loaded
    // machine finishes some runs before their moment comes: then more rounds follow, until at
    // least 4 kills landed mid-way, up to 32 rounds.
    let mut rng = Lcg(20260520);
    let mut killed = 0;
    let mut rounds = 0;
    while rounds < 8 || (killed < 4 && rounds < 32) {
        rounds += 1;
        let mut child = stage(&[])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(whole.mul_f64(rng.next()));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap(); // SIGKILL
            killed += 1;
        }
        child.wait().unwrap();
    }
    assert!(
        killed >= 4,
        "only {killed} of {rounds} runs were killed mid-way"
    );

    // The rerun completes, publishes the receipt and removes the journal and temporaries.
    let (out, _) = ok(run(&mut stage(&[])), "the rerun");
    assert!(out.contains("receipt"), "{out}");
    let left: Vec<String> = std::fs::read_dir(&mirror)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".tmp") || n.contains("journal"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    let receipt: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(mirror.join("colibri-mirror.json")).unwrap())
            .unwrap();
    let listed: Vec<&str> = receipt["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["shard"].as_str().unwrap())
        .collect();
    // Every file the plan chose (all that hold experts: no budget, no reserve) is staged and
    // listed, and the mirror holds nothing else of the model.
    let chosen: Vec<String> = plan_json(&s, &[])["files"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["chosen"].as_bool().unwrap())
        .map(|f| f["name"].as_str().unwrap().to_string())
        .collect();
    let mut sorted = chosen.clone();
    sorted.sort();
    assert_eq!(listed, sorted, "{receipt}");
    assert_eq!(shards(&mirror), sorted);
    assert!(listed.len() >= 3, "{receipt}");
    for name in &listed {
        assert_eq!(
            std::fs::read(mirror.join(name)).unwrap(),
            std::fs::read(s.model.join(name)).unwrap(),
            "{name} is byte-identical"
        );
    }

    let verify = || {
        run(coli(&s.state)
            .args(["mirror", "verify", "--model"])
            .arg(&s.model)
            .arg("--mirror")
            .arg(&mirror))
    };
    let (out, _) = ok(verify(), "coli mirror verify");
    assert!(
        out.contains(&format!("verified: {} files", listed.len())),
        "{out}"
    );

    // The primary is unchanged.
    assert!(snapshot(&s.model) == primary_before, "the primary changed");

    // The mirror serves: the same tokens with and without it, bytes read from both drives.
    let generate = |with_mirror: bool| {
        let mut cmd = coli(&s.state);
        cmd.args(["run", "--model"])
            .arg(&s.model)
            .args(["--ram", &s.ram, "--threads", "1", "--no-learn"])
            .args(["-p", "The hummingbird hovers", "--max-tokens", "12"])
            .args(["--temperature", "0", "--ignore-eos"]);
        if with_mirror {
            cmd.arg("--mirror")
                .arg(&mirror)
                .args(["--mirror-weights", "4"]);
        }
        ok(run(&mut cmd), "coli run")
    };
    let (plain, _) = generate(false);
    let (mirrored, log) = generate(true);
    assert_eq!(mirrored, plain, "the same tokens with the mirror");
    let drives = log
        .lines()
        .find(|l| l.starts_with("drives: "))
        .unwrap_or_else(|| panic!("a drives line: {log}"));
    let mirror_bytes = drive_bytes(drives, &mirror.display().to_string());
    let model_bytes = drive_bytes(drives, &s.model.display().to_string());
    assert!(mirror_bytes > 0.0 && model_bytes > 0.0, "{drives}");

    let (bench, _) = ok(
        run(coli(&s.state)
            .args(["bench", "--json", "--model"])
            .arg(&s.model)
            .args(["--ram", &s.ram, "--threads", "1", "--no-learn"])
            .args(["--prompt-tokens", "8", "--gen-tokens", "8"])
            .arg("--mirror")
            .arg(&mirror)
            .args(["--mirror-weights", "4"])),
        "coli bench --mirror",
    );
    let report: serde_json::Value = serde_json::from_str(&bench).unwrap();
    let per_drive = report["decode_store"]["drives"].as_array().unwrap();
    assert_eq!(per_drive.len(), 2, "{report}");
    assert!(
        per_drive
            .iter()
            .any(|d| d[0] == mirror.display().to_string() && d[1].as_u64().unwrap() > 0),
        "{report}"
    );

    let mut server = Served::spawn(
        coli(&s.state)
            .args(["serve", "--model"])
            .arg(&s.model)
            .args(["--host", "127.0.0.1", "--port", "0", "--slots", "1"])
            .args(["--threads", "1", "--no-learn", "--ram", &s.ram])
            .arg("--mirror")
            .arg(&mirror)
            .args(["--mirror-weights", "4"]),
    )
    .wait_ready();
    let body = serde_json::json!({
        "prompt": "The hummingbird hovers", "max_tokens": 12, "temperature": 0, "ignore_eos": true,
    })
    .to_string();
    let (status, reply) = http(server.port, "POST", "/v1/completions", &body).unwrap();
    assert_eq!(status, 200, "{reply}");
    let metrics = wait_for(10, "/metrics", || http(server.port, "GET", "/metrics", "")).1;
    let sample = format!(
        "coli_bytes_read_total{{drive=\"{}\",tier=\"disk\"}} ",
        mirror.display()
    );
    let line = metrics
        .lines()
        .find(|l| l.starts_with(&sample))
        .unwrap_or_else(|| panic!("{sample} in:\n{metrics}"));
    assert!(
        line[sample.len()..].trim().parse::<f64>().unwrap() > 0.0,
        "{line}"
    );
    server.check_running();
    drop(server);

    // A flipped byte in a copy fails verify, and stage refuses to replace the file.
    let damaged = mirror.join(listed[0]);
    let good = std::fs::read(&damaged).unwrap();
    let mut bad = good.clone();
    let at = bad.len() / 2;
    bad[at] ^= 0x10;
    std::fs::write(&damaged, &bad).unwrap();
    let out = verify();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("FAIL  {}", listed[0])), "{text}");
    let out = run(&mut stage(&[]));
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains(listed[0]) && e.contains("never deleted or replaced"),
        "{e}"
    );
    assert_eq!(
        std::fs::read(&damaged).unwrap(),
        bad,
        "the mirror file is left alone"
    );
    assert!(snapshot(&s.model) == primary_before, "the primary changed");
}

/// The bytes a `drives:` line gives `drive` (`drive: 1.2 MB`), in bytes.
fn drive_bytes(line: &str, drive: &str) -> f64 {
    let rest = &line[line
        .find(&format!("{drive}: "))
        .unwrap_or_else(|| panic!("{drive} in {line}"))
        + drive.len()
        + 2..];
    let mut words = rest.split([' ', ',']).filter(|w| !w.is_empty());
    let number: f64 = words.next().unwrap().parse().unwrap();
    let unit = words.next().unwrap();
    let scale = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        u => panic!("unit {u} in {line}"),
    };
    number * scale
}

#[test]
fn an_interrupted_copy_is_continued_and_a_journalled_file_not_copied_again() {
    let s = setup();
    let mirror = s.root.join("mirror");
    std::fs::create_dir_all(&mirror).unwrap();
    let plan = plan_json(&s, &[]);
    let files = plan["files"].as_array().unwrap();
    let first = files[0]["name"].as_str().unwrap().to_string();
    let second = files[1]["name"].as_str().unwrap().to_string();
    // As a killed staging leaves it: the first file copied and journalled, the second half
    // copied into the temporary of a process that ended.
    let bytes = std::fs::read(s.model.join(&first)).unwrap();
    std::fs::write(mirror.join(&first), &bytes).unwrap();
    let entry = serde_json::json!({
        "version": 1, "primary": s.model.display().to_string(), "written": 0,
        "shards": [{"shard": first, "size": bytes.len(), "sha256": sha256_hex(&bytes)}],
    });
    std::fs::write(
        mirror.join("colibri-mirror.journal.json"),
        entry.to_string(),
    )
    .unwrap();
    let second_bytes = std::fs::read(s.model.join(&second)).unwrap();
    let half = second_bytes.len() / 2;
    std::fs::write(
        mirror.join(format!("{second}.4194999.tmp")),
        &second_bytes[..half],
    )
    .unwrap();
    let identity = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(p).unwrap();
        (m.ino(), m.mtime(), m.mtime_nsec())
    };
    let first_identity = identity(&mirror.join(&first));

    let (out, log) = ok(
        run(coli(&s.state)
            .args(["mirror", "stage", "--reserve", "0", "--model"])
            .arg(&s.model)
            .arg("--to")
            .arg(&mirror)),
        "coli mirror stage",
    );
    assert!(
        log.contains(&format!(
            "{first}: on the mirror already; verifying it against the receipt"
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!("{second}: continued an interrupted copy at")),
        "{log}"
    );
    assert!(out.contains("receipt"), "{out}");
    assert_eq!(
        identity(&mirror.join(&first)),
        first_identity,
        "the journalled file was not written again"
    );
    assert_eq!(std::fs::read(mirror.join(&second)).unwrap(), second_bytes);

    // A foreign file under a checkpoint file's name is neither replaced nor trusted.
    let other = s.root.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let foreign = vec![7u8; bytes.len()];
    std::fs::write(other.join(&first), &foreign).unwrap();
    let out = run(coli(&s.state)
        .args(["mirror", "stage", "--reserve", "0", "--model"])
        .arg(&s.model)
        .arg("--to")
        .arg(&other));
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("differs from the primary"), "{e}");
    assert_eq!(std::fs::read(other.join(&first)).unwrap(), foreign);
}

/// SHA-256 of `bytes` in lowercase hex, by the `sha256sum` tool.
fn sha256_hex(bytes: &[u8]) -> String {
    use std::io::Write;
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sha256sum runs");
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout).unwrap()[..64].to_string()
}
