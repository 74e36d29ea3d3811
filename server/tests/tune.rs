//! `coli tune` on a small synthetic model with a tiny grid: it prints the table it measured,
//! says the output was identical in every setting, writes the fastest setting as a profile into
//! the configuration file (keeping the rest of the file), which `coli config --show --profile
//! tuned` then reports as coming from the profile and `coli serve --profile tuned` starts with;
//! a second run refuses to replace the profile without `--force`.

mod support;

use std::path::Path;
use std::process::{Command, Output};

use support::{http, isolated, Served};

/// `coli ARGS` in `cwd`, with its own state directory.
fn coli_in(cwd: &Path, state: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_coli"));
    isolated(&mut cmd)
        .env("COLI_STATE_DIR", state)
        .env_remove("COLI_PROFILE")
        .env_remove("COLI_CONFIG")
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("coli runs")
}

fn ok(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The operator's configuration file before tuning: comments, a base key, another profile.
const ORIGINAL: &str = "# the operator's settings\nslots = 2 # two at once\n\n\
                        [profiles.debug]\nlog_level = \"debug\"\n";

#[test]
fn tune_writes_the_fastest_setting_as_a_profile_that_serve_uses() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let state = tmp.path().join("state");
    let work = tmp.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let out = coli_in(
        &work,
        &state,
        &[
            "synth",
            "--arch",
            "olmoe",
            "--layers",
            "2",
            "--hidden",
            "256",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--moe-intermediate",
            "128",
            "--vocab",
            "512",
            "--out",
            model.to_str().unwrap(),
        ],
    );
    ok(&out, "synth");
    // The dense weights and no expert: every expert is read from disk, so the I/O settings
    // matter.
    let dense = colibri::model::load(&model).unwrap().info().dense_bytes;
    let ram = dense.to_string();
    let file = work.join("colibri.toml");
    std::fs::write(&file, ORIGINAL).unwrap();

    let args = [
        "tune",
        "--model",
        model.to_str().unwrap(),
        "--ram",
        &ram,
        "--try-threads",
        "1,2",
        "--try-io",
        "pool",
        "--try-direct-io",
        "false",
        "--try-prefetch",
        "true,false",
        "--try-prefill-chunk",
        "8,32",
        "--prompt-tokens",
        "32",
        "--gen-tokens",
        "6",
        "--check-tokens",
        "4",
        "--io",
        "pool",
        "--threads",
        "1",
    ];
    let out = coli_in(&work, &state, &args);
    let table = ok(&out, "coli tune");
    let log = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(log.contains("coli tune: run "), "progress on stderr: {log}");
    assert!(
        table.contains("output identical in every setting"),
        "{table}"
    );

    // The table: a header and one row per setting measured, one of them the fastest.
    let rows: Vec<Vec<&str>> = table
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("threads"))
        .skip(1)
        .take_while(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.parse::<usize>().is_ok())
        })
        .map(|l| l.split_whitespace().collect())
        .collect();
    // Start (1 thread, prefetch on, whole prompt), then 2 threads, prefetch off, two chunks.
    assert!(rows.len() >= 4, "{table}");
    for r in &rows {
        assert!(
            r[8].parse::<f64>().unwrap() > 0.0,
            "seconds measured: {r:?}"
        );
    }
    let fastest: Vec<&Vec<&str>> = rows
        .iter()
        .filter(|r| r.join(" ").contains("fastest"))
        .collect();
    assert_eq!(fastest.len(), 1, "{table}");
    let best = fastest[0];
    // The fastest row's time is the smallest but for ties within 2 %.
    let secs = |r: &Vec<&str>| r[8].parse::<f64>().unwrap();
    let min = rows.iter().map(secs).fold(f64::MAX, f64::min);
    assert!(secs(best) <= min / 0.98 + 1e-9, "{table}");

    // The file: the original text kept as it was, the profile added with the fastest values.
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.starts_with(ORIGINAL), "{text}");
    assert!(text.contains("# Written by `coli tune`"), "{text}");
    let doc: toml::Table = toml::from_str(&text).unwrap();
    let p = &doc["profiles"]["tuned"];
    assert_eq!(p["threads"].as_integer().unwrap().to_string(), best[0]);
    assert_eq!(p["io"].as_str().unwrap(), best[1]);
    assert_eq!(p["direct_io"].as_bool().unwrap().to_string(), best[2]);
    assert_eq!(
        p["no_prefetch"].as_bool().unwrap(),
        best[3] == "off",
        "{text}"
    );
    assert_eq!(
        p["prefill_chunk"].as_integer().unwrap().to_string(),
        best[5]
    );
    assert_eq!(
        p["ram"].as_str(),
        Some(ram.as_str()),
        "flags given are kept: {text}"
    );
    assert_eq!(p["model"].as_str(), model.to_str());
    assert_eq!(doc["slots"].as_integer(), Some(2));
    assert_eq!(
        doc["profiles"]["debug"]["log_level"].as_str(),
        Some("debug")
    );

    // `coli config --show --profile tuned` takes them from the profile.
    let shown = ok(
        &coli_in(&work, &state, &["config", "--show", "--profile", "tuned"]),
        "coli config --show",
    );
    let source = format!("# file {} [profile tuned]", file.display());
    for key in [
        "threads",
        "io",
        "direct_io",
        "no_prefetch",
        "prefill_chunk",
        "ram",
        "model",
    ] {
        let line = shown
            .lines()
            .find(|l| l.starts_with(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("{key} in {shown}"));
        assert!(line.ends_with(&source), "{line}");
    }
    assert!(
        shown.contains(&format!("threads = {}  {source}", best[0])),
        "{shown}"
    );
    assert!(
        shown.contains(&format!("prefill_chunk = {}  {source}", best[5])),
        "{shown}"
    );

    // `coli serve --profile tuned` starts with them and serves.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_coli"));
    isolated(&mut cmd)
        .env("COLI_STATE_DIR", &state)
        .env_remove("COLI_CONFIG")
        .env_remove("COLI_PROFILE")
        .args([
            "serve",
            "--profile",
            "tuned",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ])
        .current_dir(&work);
    let server = Served::spawn(&mut cmd).wait_ready();
    let body = serde_json::json!({
        "prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": true,
    })
    .to_string();
    let (status, reply) =
        http(server.port, "POST", "/v1/completions", &body).expect("the server answers");
    assert_eq!(status, 200, "{reply}");
    let log = server.log();
    assert!(log.contains("reader: pread pool"), "{log}");
    assert!(
        log.contains(if best[3] == "on" {
            "prefetch on"
        } else {
            "prefetch off"
        }),
        "{log}"
    );
    drop(server);

    // Not replaced without --force; replaced with it.
    let before = std::fs::read_to_string(&file).unwrap();
    let out = coli_in(&work, &state, &args);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("already has a profile `tuned`") && e.contains("--force"),
        "{e}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), before);
    let mut forced = args.to_vec();
    forced.extend(["--force", "--try-prefill-chunk", "16"]);
    ok(&coli_in(&work, &state, &forced), "coli tune --force");
    let doc: toml::Table = toml::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert!(doc["profiles"]["tuned"].get("threads").is_some());
    assert!(doc["profiles"].get("debug").is_some());
}
