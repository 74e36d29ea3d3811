//! `coli plan` on a small synthetic MoE with known bandwidths and kernel rate (a
//! `machine.json` in the cache directory): the text names every tier, `--json` parses and
//! holds the resident set and cache a real load reports, the uniform-routing hit fraction and
//! the predicted tok/s by the documented formula, with buffered and O_DIRECT reads; a kernel
//! rate not cached is measured and kept; a too-small `--ram` is refused with the numbers; a usage history
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
const PAGE_CACHE_GB_S: f64 = 2.0;

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
            "page_cache_gb_per_s": PAGE_CACHE_GB_S,
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
        &coli_with(
            &s.cache,
            &s.state,
            &["plan", "-m", m, "--ram", &ram, "--threads", "1"],
        ),
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
                "--threads",
                "1",
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
    // The decode kernel was timed on every matrix shape of the model: q, k, v, o (one
    // shape), the router, the LM head (dense); gate and up (one shape, both of a layer's two
    // active experts in one step) and down (experts).
    let kernels = q["kernels"].as_array().unwrap();
    let find = |rows: u64, cols: u64, expert: bool| {
        kernels
            .iter()
            .find(|k| {
                k["rows"].as_u64() == Some(rows)
                    && k["cols"].as_u64() == Some(cols)
                    && k["expert"].as_bool() == Some(expert)
            })
            .unwrap_or_else(|| panic!("no {rows}x{cols} kernel: {q:#}"))
    };
    assert_eq!(find(128, 128, false)["group"].as_u64(), Some(1), "{q:#}");
    assert_eq!(find(512, 128, false)["format"], "f32", "{q:#}");
    assert_eq!(find(64, 128, true)["group"].as_u64(), Some(4), "{q:#}");
    assert_eq!(find(128, 64, true)["group"].as_u64(), Some(2), "{q:#}");
    let expert_bytes: u64 = kernels
        .iter()
        .filter(|k| k["expert"] == true)
        .map(|k| k["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(expert_bytes, routed, "{q:#}");
    // Each rate is measured, and the compute rates are their byte-weighted harmonic means
    // capped at the memory bandwidth.
    let rate_of = |expert: bool| {
        let (b, t) =
            kernels
                .iter()
                .filter(|k| k["expert"] == expert)
                .fold((0.0, 0.0), |(b, t), k| {
                    let r = k["gb_per_s"].as_f64().unwrap();
                    assert!(r > 0.0 && r.is_finite(), "{q:#}");
                    let n = k["bytes"].as_f64().unwrap();
                    (b + n, t + n / r.min(MEMORY_GB_S))
                });
        (b / t).min(MEMORY_GB_S)
    };
    let (dense_rate, expert_rate) = (rate_of(false), rate_of(true));
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.max(1.0);
    assert!(
        close(q["dense_compute_gb_per_s"].as_f64().unwrap(), dense_rate),
        "{q:#}"
    );
    assert!(
        close(q["expert_compute_gb_per_s"].as_f64().unwrap(), expert_rate),
        "{q:#}"
    );
    // Resident weights at the dense rate, every active expert at the expert rate, and reading
    // the misses: from the page cache (buffered reads) for the share the free memory holds,
    // the rest from disk.
    let share = q["page_cache_miss_fraction"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&share), "{q:#}");
    let seconds = resident / (dense_rate * 1e9)
        + (hit_b + miss_b) / (expert_rate * 1e9)
        + miss_b * share / (PAGE_CACHE_GB_S * 1e9)
        + miss_b * (1.0 - share) / (DISK_GB_S * 1e9);
    let tok_s = q["decode_tok_per_s"].as_f64().unwrap();
    assert!((tok_s - 1.0 / seconds).abs() / tok_s < 1e-9, "{q:#}");

    // With O_DIRECT reads no miss comes from the page cache.
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
                "--threads",
                "1",
                "--direct-io",
            ],
        ),
        "plan --direct-io --json",
    );
    let q: serde_json::Value =
        serde_json::from_str::<serde_json::Value>(&json).unwrap()["prediction"].clone();
    assert_eq!(q["page_cache_miss_fraction"].as_f64(), Some(0.0), "{q:#}");
    let miss_b = q["expert_miss_bytes_per_token"].as_f64().unwrap();
    let seconds = resident / (dense_rate * 1e9)
        + (hit_b + miss_b) / (expert_rate * 1e9)
        + miss_b / (DISK_GB_S * 1e9);
    let tok_s = q["decode_tok_per_s"].as_f64().unwrap();
    assert!((tok_s - 1.0 / seconds).abs() / tok_s < 1e-9, "{q:#}");

    // A budget below the resident set: refused, with the numbers and the fix.
    let small = (dense / 2).to_string();
    let out = coli_with(
        &s.cache,
        &s.state,
        &["plan", "-m", m, "--ram", &small, "--threads", "1"],
    );
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
        &coli_with(
            &s.cache,
            &s.state,
            &["plan", "-m", m, "--mmap", "--json", "--threads", "1"],
        ),
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
    // The kernel rates measured are kept in machine.json beside the bandwidths given,
    // keyed by format, shape, step, working set (the model's matrices together) and threads.
    let model_bytes: u64 = q["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["bytes"].as_u64().unwrap())
        .sum();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let machine: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(s.cache.join("machine.json")).unwrap())
            .unwrap();
    assert_eq!(machine["memory_gb_per_s"].as_f64(), Some(MEMORY_GB_S));
    let kept = machine["kernel_gb_per_s"].as_object().unwrap();
    for k in q["kernels"].as_array().unwrap() {
        let key = format!(
            "{} {}x{} x{} {}@{cores}",
            k["format"].as_str().unwrap(),
            k["rows"],
            k["cols"],
            k["group"],
            model_bytes
        );
        assert_eq!(
            kept.get(&key).and_then(|v| v.as_f64()),
            k["gb_per_s"].as_f64(),
            "{key}: {machine:#}"
        );
    }
}
