//! `coli plan` on a small synthetic MoE with known bandwidths (a `machine.json` in the cache
//! directory): the text names every tier, `--json` parses and holds the resident set and cache
//! a real load reports, the uniform-routing hit fraction and the predicted tok/s by the
//! documented formula; a too-small `--ram` is refused with the numbers; a usage history
//! recorded by `coli run` is used for the pins and hit rates.

mod support;

use std::path::Path;
use std::process::{Command, Output};

use support::isolated;

/// `coli ARGS` with its own cache (holding `machine.json`) and state directories.
fn coli_with(cache: &Path, state: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_coli"));
    isolated(&mut cmd)
        .env("COLI_CACHE_DIR", cache)
        .env("COLI_STATE_DIR", state)
        .env_remove("COLI_PROFILE")
        .env_remove("COLI_CONFIG")
        .current_dir(cache)
        .args(args)
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

const MEMORY_GB_S: f64 = 10.0;
const DISK_GB_S: f64 = 0.5;

struct Setup {
    _tmp: tempfile::TempDir,
    model: std::path::PathBuf,
    cache: std::path::PathBuf,
    state: std::path::PathBuf,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let cache = tmp.path().join("cache");
    let state = tmp.path().join("state");
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::write(
        cache.join("machine.json"),
        serde_json::json!({
            "disk_gb_per_s": DISK_GB_S,
            "memory_gb_per_s": MEMORY_GB_S,
            "disk_source": "test",
            "measured_unix": 0,
        })
        .to_string(),
    )
    .unwrap();
    let out = coli_with(
        &cache,
        &state,
        &[
            "synth",
            "--arch",
            "olmoe",
            "--layers",
            "2",
            "--hidden",
            "128",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--moe-intermediate",
            "64",
            "--vocab",
            "512",
            "--dtype",
            "f32",
            "--out",
            model.to_str().unwrap(),
        ],
    );
    ok(&out, "synth");
    Setup {
        _tmp: tmp,
        model,
        cache,
        state,
    }
}

#[test]
fn plan_prints_every_tier_predicts_by_the_formula_and_refuses_a_small_budget() {
    let s = setup();
    let info = colibri::model::load(&s.model).unwrap().info().clone();
    let dense = info.dense_bytes as u64;
    let routed = info.routed_expert_bytes as u64;
    // A budget holding the resident set and a quarter of the experts.
    let cache = routed / 4;
    let ram = (dense + cache).to_string();
    let m = s.model.to_str().unwrap();

    let text = ok(
        &coli_with(&s.cache, &s.state, &["plan", "-m", m, "--ram", &ram]),
        "plan",
    );
    for tier in ["VRAM", "RAM", "disk"] {
        assert!(
            text.lines().any(|l| l.starts_with(tier)),
            "no {tier} row:\n{text}"
        );
    }
    assert!(text.contains("predicted decode"), "{text}");

    let json = ok(
        &coli_with(
            &s.cache,
            &s.state,
            &[
                "plan",
                "-m",
                m,
                "--ram",
                &ram,
                "--json",
                "--slots",
                "3",
                "--context",
                "100",
            ],
        ),
        "plan --json",
    );
    let p: serde_json::Value = serde_json::from_str(&json).expect("plan --json parses");
    assert_eq!(p["mode"], "tiered");
    assert_eq!(p["ram"]["dense_bytes"].as_u64(), Some(dense), "{p:#}");
    assert_eq!(p["ram"]["cache_bytes"].as_u64(), Some(cache), "{p:#}");
    assert_eq!(p["routed_expert_bytes"].as_u64(), Some(routed));
    assert_eq!(p["disk"]["expert_bytes"].as_u64(), Some(routed));
    assert_eq!(p["ram"]["slots"].as_u64(), Some(3));
    assert_eq!(p["ram"]["context"].as_u64(), Some(100));
    assert_eq!(
        p["ram"]["kv_bytes_per_slot"].as_u64(),
        Some((info.kv_bytes_per_token * 100 + info.state_bytes_per_sequence) as u64)
    );
    assert!(p["vram"].is_object());
    // No usage history: uniform routing, hit fraction = cache / routed bytes.
    let q = &p["prediction"];
    let hit = q["ram_hit_fraction"].as_f64().unwrap();
    assert!((hit - cache as f64 / routed as f64).abs() < 1e-9, "{q:#}");
    // Every expert has the same size: a token's active bytes are top-k of them per layer.
    let active = 2.0 * info.moe_layers as f64 * routed as f64 / (8.0 * info.moe_layers as f64);
    let hit_b = q["expert_hit_bytes_per_token"].as_f64().unwrap();
    let miss_b = q["expert_miss_bytes_per_token"].as_f64().unwrap();
    assert!((hit_b + miss_b - active).abs() < 1.0, "{q:#}");
    let resident = q["resident_bytes_per_token"].as_f64().unwrap();
    assert!(resident > 0.0 && resident <= dense as f64, "{q:#}");
    let seconds =
        resident / (MEMORY_GB_S * 1e9) + hit_b / (MEMORY_GB_S * 1e9) + miss_b / (DISK_GB_S * 1e9);
    let tok_s = q["decode_tok_per_s"].as_f64().unwrap();
    assert!((tok_s - 1.0 / seconds).abs() / tok_s < 1e-9, "{q:#}");

    // A budget below the resident set: refused, with the numbers and the fix.
    let small = (dense / 2).to_string();
    let out = coli_with(&s.cache, &s.state, &["plan", "-m", m, "--ram", &small]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("do not fit the RAM budget") && err.contains("raise --ram to at least"),
        "{err}"
    );
    let shown = colibri::store::budget::format_size_up(dense);
    assert!(
        err.contains(&shown),
        "names the resident size {shown}: {err}"
    );

    // Memory-mapped: every expert in RAM, nothing read from disk.
    let json = ok(
        &coli_with(&s.cache, &s.state, &["plan", "-m", m, "--mmap", "--json"]),
        "plan --mmap",
    );
    let p: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(p["mode"], "mapped");
    assert_eq!(p["prediction"]["miss_fraction"].as_f64(), Some(0.0));
}

#[test]
fn plan_uses_the_usage_history_for_pins_and_hits() {
    let s = setup();
    let info = colibri::model::load(&s.model).unwrap().info().clone();
    let dense = info.dense_bytes as u64;
    let routed = info.routed_expert_bytes as u64;
    let ram = (dense + routed / 2).to_string();
    let m = s.model.to_str().unwrap();
    // Record a usage history.
    ok(
        &coli_with(
            &s.cache,
            &s.state,
            &[
                "run",
                "-m",
                m,
                "--ram",
                &ram,
                "-p",
                "hello there",
                "--max-tokens",
                "8",
            ],
        ),
        "run",
    );
    let json = ok(
        &coli_with(
            &s.cache,
            &s.state,
            &["plan", "-m", m, "--ram", &ram, "--json"],
        ),
        "plan --json",
    );
    let p: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(
        p["history"].as_str().unwrap().contains("usage history"),
        "{p:#}"
    );
    // Pins fit half of the cache (the default pin budget), and some are pinned.
    let pinned = p["ram"]["pinned_bytes"].as_u64().unwrap();
    assert!(pinned > 0 && pinned <= routed / 4, "{p:#}");
    let q = &p["prediction"];
    let sum = q["ram_hit_fraction"].as_f64().unwrap() + q["miss_fraction"].as_f64().unwrap();
    assert!((sum - 1.0).abs() < 1e-9, "{q:#}");
}
