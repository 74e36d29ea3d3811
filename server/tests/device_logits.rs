//! Placement on a GPU changes speed, never output: `coli logits --device vulkan` on every
//! committed fixture must print exactly what the CPU printed (the hashes recorded in
//! `tests/fixtures/logits.sha256` by `scripts/logits-checksums.sh`), with a VRAM budget that
//! holds nothing, one that holds the dense matrices and some of the experts, and the default
//! that holds everything — memory-mapped and streamed under a RAM budget. Runs on whatever
//! Vulkan device the machine has (Mesa's lavapipe in CI); says "skipped" without one.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every fixture the checksum script covers, with its prompt + greedy tokens.
fn fixtures() -> Vec<(String, String)> {
    let dir = root().join("engine/tests/fixtures");
    // Every family's fixture (a directory with a reference.json), then the variants.
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().join("reference.json").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.len() >= 17, "fixtures missing: {names:?}");
    let mut variants: Vec<String> = std::fs::read_dir(dir.join("variants"))
        .unwrap()
        .map(|e| format!("variants/{}", e.unwrap().file_name().to_string_lossy()))
        .collect();
    variants.sort();
    names.extend(variants);
    names
        .into_iter()
        .map(|f| {
            let r: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(dir.join(&f).join("reference.json")).unwrap(),
            )
            .unwrap();
            let ids: Vec<String> = ["prompt_ids", "greedy_ids"]
                .iter()
                .flat_map(|k| r[k].as_array().unwrap().clone())
                .map(|v| v.to_string())
                .collect();
            (f, ids.join(","))
        })
        .collect()
}

/// The recorded hash of `what` (a line's description in logits.sha256).
fn recorded(what: &str) -> String {
    let text = std::fs::read_to_string(root().join("server/tests/fixtures/logits.sha256")).unwrap();
    text.lines()
        .find_map(|l| l.strip_suffix(what).map(|h| h.trim().to_string()))
        .unwrap_or_else(|| panic!("no recorded hash for `{what}`"))
}

struct Run {
    hash: String,
    log: String,
}

fn sha256(bytes: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("sha256sum runs");
    use std::io::Write;
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

fn logits(fixture: &str, tokens: &str, args: &[&str], state: &Path) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_coli"))
        .current_dir(root().join("engine/tests/fixtures"))
        .args(["logits", "--model", fixture, "--tokens", tokens])
        .args(args)
        .env("COLI_STATE_DIR", state)
        .env("COLI_CACHE_DIR", state)
        .env("COLI_LOG", "info")
        .output()
        .expect("coli runs");
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "coli logits {fixture} {args:?} failed:\n{log}"
    );
    Run {
        hash: sha256(&out.stdout),
        log,
    }
}

/// `(held, total)` from the VRAM tier's log line, if the model has routed experts.
fn experts_in_vram(log: &str) -> Option<(usize, usize)> {
    let line = log.lines().find(|l| l.contains("VRAM tier: "))?;
    let rest = line.split("VRAM tier: ").nth(1)?;
    let mut words = rest.split_whitespace();
    let held = words.next()?.parse().ok()?;
    words.next(); // "of"
    let total = words.next()?.parse().ok()?;
    Some((held, total))
}

fn number_after(log: &str, key: &str) -> u64 {
    let at = log
        .find(key)
        .unwrap_or_else(|| panic!("no `{key}` in the log:\n{log}"));
    log[at + key.len()..]
        .split_whitespace()
        .next()
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no number after `{key}`:\n{log}"))
}

#[test]
fn every_fixture_on_vulkan_prints_the_cpus_logits_whatever_vram_holds() {
    if let Err(e) = colibri::tensor::device::vulkan::VulkanBackend::open(false) {
        eprintln!("skipped: no Vulkan device ({e})");
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let mut some_checked = 0;
    for (f, tokens) in fixtures() {
        let want = recorded(&format!("logits {f}"));
        // Everything that fits (the default budget): dense matrices and every expert.
        let all = logits(&f, &tokens, &["--mmap", "--device", "vulkan"], state.path());
        assert!(
            all.log.contains("device: vulkan"),
            "{f}: the log does not name the Vulkan device:\n{}",
            all.log
        );
        assert_eq!(all.hash, want, "{f} on vulkan (everything in VRAM)");
        let dense = number_after(&all.log, "dense matrices ");
        assert!(dense > 0, "{f}: no dense matrix was placed on the device");
        let (held, total) = experts_in_vram(&all.log).unwrap_or((0, 0));
        assert_eq!(held, total, "{f}: the default budget holds every expert");
        // Nothing in VRAM: every product on the CPU.
        let none = logits(
            &f,
            &tokens,
            &["--mmap", "--device", "vulkan", "--vram", "0"],
            state.path(),
        );
        assert_eq!(number_after(&none.log, "dense matrices "), 0, "{f}");
        assert_eq!(none.hash, want, "{f} on vulkan with nothing in VRAM");
        if total == 0 {
            continue;
        }
        // The dense part and about half of the experts, streamed under a RAM budget.
        let expert_bytes = number_after(&all.log, "experts in VRAM (");
        let half = (dense + expert_bytes / 2).to_string();
        let some = logits(
            &f,
            &tokens,
            &[
                "--ram",
                "64M",
                "--no-learn",
                "--device",
                "vulkan",
                "--vram",
                &half,
            ],
            state.path(),
        );
        let (held, _) = experts_in_vram(&some.log).expect("a VRAM tier line");
        assert!(
            0 < held && held < total,
            "{f}: --vram {half} should hold some of the {total} experts, holds {held}"
        );
        assert_eq!(
            some.hash,
            recorded(&format!("logits --ram 64M {f}")),
            "{f} on vulkan, streamed, {held} of {total} experts in VRAM"
        );
        some_checked += 1;
    }
    assert!(some_checked >= 15, "only {some_checked} MoE fixtures split");
}

#[test]
fn an_explicit_device_that_is_missing_is_a_clear_error_and_auto_falls_back_to_the_cpu() {
    let state = tempfile::tempdir().unwrap();
    let run = |device: &str| {
        Command::new(env!("CARGO_BIN_EXE_coli"))
            .current_dir(root().join("engine/tests/fixtures"))
            .args(["logits", "--model", "olmoe", "--mmap", "--tokens", "1,2,3"])
            .args(["--device", device])
            .env("COLI_STATE_DIR", state.path())
            .env("COLI_CACHE_DIR", state.path())
            .env("COLI_LOG", "info")
            .output()
            .expect("coli runs")
    };
    if colibri::tensor::device::cuda::CudaBackend::open().is_err() {
        let out = run("cuda");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "--device cuda without CUDA must fail"
        );
        assert!(err.contains("no CUDA driver found"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    } else {
        eprintln!("skipped the missing-CUDA case: this machine has CUDA");
    }
    let auto = run("auto");
    assert!(auto.status.success());
    let cpu = run("cpu");
    assert_eq!(
        auto.stdout, cpu.stdout,
        "auto and cpu print the same logits"
    );
    let log = String::from_utf8_lossy(&auto.stderr);
    assert!(
        log.contains("device: "),
        "auto says which device it uses:\n{log}"
    );
}

#[test]
fn gguf_block_formats_on_vulkan_print_the_cpus_logits() {
    // Real models through the integer kernels (Q8_0; Q4_K and Q6_K in q4_k_m's mix): GGUF
    // conversions of the fixtures llama.cpp has a layout for, on the CPU and on Vulkan with
    // everything / part in VRAM. The formats the CPU computes by integer kernels no device
    // has (Q5_0, Q5_1, Q5_K in these mixes) stay on the CPU, with every expert holding one.
    if let Err(e) = colibri::tensor::device::vulkan::VulkanBackend::open(false) {
        eprintln!("skipped: no Vulkan device ({e})");
        return;
    }
    let state = tempfile::tempdir().unwrap();
    let tokens: std::collections::HashMap<String, String> = fixtures().into_iter().collect();
    let mut checked = 0;
    let mut cpu_experts = 0;
    for f in ["llama", "olmoe", "qwen3_moe", "deepseek_v3", "glm4_moe"] {
        for ty in ["q8_0", "q4_k_m", "q5_k_m"] {
            let gguf = state.path().join(format!("{f}-{ty}.gguf"));
            let out = Command::new(env!("CARGO_BIN_EXE_coli"))
                .current_dir(root().join("engine/tests/fixtures"))
                .args(["convert", "--model", f, "--type", ty, "--out"])
                .arg(&gguf)
                .env("COLI_STATE_DIR", state.path())
                .env("COLI_CACHE_DIR", state.path())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "convert {f} {ty}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let model = gguf.to_str().unwrap();
            let t = &tokens[f];
            let cpu = logits(model, t, &["--mmap", "--device", "cpu"], state.path());
            let all = logits(model, t, &["--mmap", "--device", "vulkan"], state.path());
            assert!(number_after(&all.log, "dense matrices ") > 0, "{f} {ty}");
            assert_eq!(all.hash, cpu.hash, "{f} {ty}: everything in VRAM");
            let dense = number_after(&all.log, "dense matrices ");
            let experts = experts_in_vram(&all.log).filter(|&(_, t)| t > 0);
            if let Some((0, _)) = experts {
                // No expert could be placed: each has a matrix that stays on the CPU.
                assert_ne!(ty, "q8_0", "{f}: Q8_0 experts have a device kernel");
                cpu_experts += 1;
            } else if let Some((_, total)) = experts {
                let experts = number_after(&all.log, "experts in VRAM (");
                let half = (dense + experts / 2).to_string();
                let some = logits(
                    model,
                    t,
                    &["--mmap", "--device", "vulkan", "--vram", &half],
                    state.path(),
                );
                let (held, _) = experts_in_vram(&some.log).unwrap();
                assert!(0 < held && held < total, "{f} {ty}: {held} of {total}");
                assert_eq!(
                    some.hash, cpu.hash,
                    "{f} {ty}: {held} of {total} experts in VRAM"
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 15);
    eprintln!("{cpu_experts} of the GGUF MoE runs kept every expert on the CPU");
}
