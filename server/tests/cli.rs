//! The `coli` binary as users run it, on the committed transformers fixtures: `run`
//! reproduces the reference greedy continuation, `logits` matches the reference logits, the
//! thread count and a seed make runs reproducible, and bad input gets a clear error.

use std::path::Path;
use std::process::{Command, Output};

mod support;
use support::{assert_names_option, coli, fixture, reference};

const FAMILIES: &[&str] = &["llama", "mixtral", "olmoe", "qwen3_moe"];

fn ok_stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "coli failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("utf-8 stdout")
}

/// `coli synth` of a small f32 Qwen3-MoE (2 layers, 4 heads, 2 KV heads, top-2 routing) into
/// `out`; `[hidden, experts, moe_intermediate, vocab]` and `extra` flags as given.
fn synth_qwen3_moe(out: &Path, [hidden, experts, moe, vocab]: [&str; 4], extra: &[&str]) {
    let flags = [
        ("--arch", "qwen3-moe"),
        ("--layers", "2"),
        ("--hidden", hidden),
        ("--heads", "4"),
        ("--kv-heads", "2"),
        ("--experts", experts),
        ("--top-k", "2"),
        ("--moe-intermediate", moe),
        ("--vocab", vocab),
        ("--dtype", "f32"),
    ];
    let mut args = vec!["synth"];
    args.extend(flags.iter().flat_map(|&(flag, value)| [flag, value]));
    args.extend_from_slice(extra);
    args.extend(["--out", out.to_str().unwrap()]);
    ok_stdout(&coli(&args));
}

/// `coli convert` of `model` to the GGUF `gguf` of type `ty`.
fn convert(model: &Path, gguf: &Path, ty: &str) {
    ok_stdout(&coli(&[
        "convert",
        "-m",
        model.to_str().unwrap(),
        "-o",
        gguf.to_str().unwrap(),
        "-t",
        ty,
    ]));
}

#[test]
fn run_reproduces_the_reference_greedy_continuation() {
    for arch in FAMILIES {
        let r = reference(arch);
        let dir = fixture(arch);
        let out = coli(&[
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            r["prompt_text"].as_str().unwrap(),
            "--temperature",
            "0",
            "--max-tokens",
            "16",
            "--ignore-eos",
        ]);
        let text = ok_stdout(&out);
        assert_eq!(
            text.strip_suffix('\n').unwrap(),
            r["greedy_text"].as_str().unwrap(),
            "{arch}"
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!(
                "prompt: {} tokens",
                r["prompt_ids"].as_array().unwrap().len()
            )) && stderr.contains("generated: 16 tokens")
                && stderr.contains("decode"),
            "{arch}: stats line missing: {stderr}"
        );
    }
}

#[test]
fn logits_match_the_reference() {
    for arch in FAMILIES {
        let r = reference(arch);
        let ids: Vec<String> = r["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect();
        let out = coli(&[
            "logits",
            "--model",
            fixture(arch).to_str().unwrap(),
            "--tokens",
            &ids.join(","),
        ]);
        let got: serde_json::Value = serde_json::from_str(&ok_stdout(&out)).unwrap();
        let got = got["logits"].as_array().unwrap();
        let want = r["logits"].as_array().unwrap();
        assert_eq!(got.len(), want.len(), "{arch}: one row per position");
        for (g, w) in got.iter().zip(want) {
            let (g, w) = (g.as_array().unwrap(), w.as_array().unwrap());
            assert_eq!(g.len(), w.len(), "{arch}: full vocabulary");
            for (a, b) in g.iter().zip(w) {
                assert!(
                    (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() <= 1e-4,
                    "{arch}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn one_and_two_threads_give_the_same_tokens() {
    for arch in ["olmoe", "qwen3_moe"] {
        let dir = fixture(arch);
        let run = |threads: &str| {
            ok_stdout(&coli(&[
                "run",
                "--model",
                dir.to_str().unwrap(),
                "--prompt",
                "The old clock",
                "--temperature",
                "0.9",
                "--seed",
                "11",
                "--max-tokens",
                "24",
                "--ignore-eos",
                "--threads",
                threads,
            ]))
        };
        assert_eq!(run("1"), run("2"), "{arch}");
    }
}

#[test]
fn a_seed_reproduces_sampled_text_and_another_seed_changes_it() {
    let dir = fixture("mixtral");
    let run = |seed: &str| {
        ok_stdout(&coli(&[
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "Once upon a time",
            "--temperature",
            "1.0",
            "--top-k",
            "0",
            "--top-p",
            "1",
            "--min-p",
            "0",
            "--seed",
            seed,
            "--max-tokens",
            "24",
            "--ignore-eos",
        ]))
    };
    assert_eq!(run("5"), run("5"));
    assert_ne!(run("5"), run("6"));
}

#[test]
fn chat_wraps_the_prompt_in_the_template() {
    let dir = fixture("olmoe");
    let plain = ok_stdout(&coli(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "Hi",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--ignore-eos",
    ]));
    let chat = ok_stdout(&coli(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        "Hi",
        "--chat",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--ignore-eos",
    ]));
    assert_ne!(plain, chat, "the chat template must change the prompt");
}

#[test]
fn missing_model_directory_is_a_clear_error() {
    let out = coli(&["run", "--model", "/nonexistent/model", "--prompt", "x"]);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("/nonexistent/model") && e.contains("not found"),
        "{e}"
    );
}

#[test]
fn out_of_vocabulary_token_is_rejected() {
    let out = coli(&[
        "logits",
        "--model",
        fixture("llama").to_str().unwrap(),
        "--tokens",
        "1,2,999999",
    ]);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("999999") && e.contains("vocabulary"), "{e}");
    let out = coli(&[
        "logits",
        "--model",
        fixture("llama").to_str().unwrap(),
        "--tokens",
        "1,x",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("`x` is not a token id"));
}

#[test]
fn an_option_the_model_cannot_honour_is_an_error_that_says_why() {
    // (command, model, option, value, what the message must name)
    let cases = [
        ("run", "llama", "--draft", "mtp", "multi-token-prediction"),
        ("run", "olmoe", "--draft", "mtp", "multi-token-prediction"),
        (
            "logits",
            "qwen3_moe",
            "--mla-form",
            "expanded",
            "no multi-head latent attention",
        ),
        (
            "run",
            "mixtral",
            "--mla-form",
            "absorbed",
            "no multi-head latent attention",
        ),
        (
            "run",
            "llama",
            "--kv-dtype",
            "bf16",
            "no latent-attention cache",
        ),
        // The fixture has no MTP head (num_nextn_predict_layers 0).
        ("run", "deepseek_v3", "--draft", "mtp", "MTP head"),
    ];
    for (command, arch, option, value, why) in cases {
        let dir = fixture(arch);
        let mut args = vec![command, "--model", dir.to_str().unwrap(), option, value];
        args.extend(if command == "run" {
            ["--prompt", "hello", "--max-tokens", "2"]
        } else {
            ["--tokens", "1,2", "--threads", "1"]
        });
        let out = coli(&args);
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{command} {option} {value} on {arch} succeeded: {e}"
        );
        assert!(e.contains(why), "{arch} {option} {value}: {e}");
        assert_names_option(&e, option);
    }
    // The same options where they apply still run.
    let dir = fixture("deepseek_v3");
    for (option, value) in [("--mla-form", "expanded"), ("--kv-dtype", "bf16")] {
        let out = coli(&[
            "logits",
            "--model",
            dir.to_str().unwrap(),
            option,
            value,
            "--tokens",
            "1,2",
        ]);
        ok_stdout(&out);
    }
}

/// A process id that is not running: a child that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

#[test]
fn synth_writes_a_runnable_checkpoint_deterministically() {
    let tmp = tempfile::tempdir().unwrap();
    // What a synth killed while writing `a` left: its temporary directory, removed by the
    // next one.
    let stale = tmp.path().join(format!("a.{}.tmp", dead_pid()));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("model.safetensors"), b"half").unwrap();
    let mut outputs = Vec::new();
    for (name, shard) in [("a", "4000000000"), ("b", "100000")] {
        let out = tmp.path().join(name);
        synth_qwen3_moe(
            &out,
            ["64", "4", "32", "400"],
            &["--seed", "3", "--shard-bytes", shard],
        );
        let info = ok_stdout(&coli(&["info", "--model", out.to_str().unwrap()]));
        assert!(
            info.contains("qwen3_moe") && info.contains("4 routed") && info.contains("2 active"),
            "{info}"
        );
        outputs.push(ok_stdout(&coli(&[
            "logits",
            "--model",
            out.to_str().unwrap(),
            "--tokens",
            "1,5,300",
        ])));
    }
    assert!(!stale.exists(), "the killed synth's temporary is removed");
    // The sharded copy (b) holds the same seeded weights as the single file (a).
    assert!(tmp.path().join("b/model.safetensors.index.json").exists());
    assert_eq!(outputs[0], outputs[1]);
    // Writing over an existing directory is refused.
    let o = coli(&[
        "synth",
        "--arch",
        "llama",
        "--out",
        tmp.path().join("a").to_str().unwrap(),
    ]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("already exists"));
}

/// A state directory holding a cached machine measurement, so a bench does not measure this
/// machine's bandwidth.
fn cached_machine() -> tempfile::TempDir {
    let cache = tempfile::tempdir().unwrap();
    std::fs::write(
        cache.path().join("machine.json"),
        r#"{"disk_gb_per_s": 1.0, "memory_gb_per_s": 10.0, "disk_source": "test", "measured_unix": 0}"#,
    )
    .unwrap();
    cache
}

#[test]
fn bench_reports_streaming_under_a_small_budget() {
    let cache = cached_machine();
    let dir = fixture("olmoe");
    let run = |ram: &str| -> serde_json::Value {
        let out = Command::new(env!("CARGO_BIN_EXE_coli"))
            .args([
                "bench",
                "--model",
                dir.to_str().unwrap(),
                "--ram",
                ram,
                "--no-learn",
            ])
            .args(["--prompt-tokens", "8", "--gen-tokens", "8", "--json"])
            .env("COLI_CACHE_DIR", cache.path())
            .env("COLI_STATE_DIR", cache.path().join("state"))
            .output()
            .unwrap();
        serde_json::from_str(&ok_stdout(&out)).unwrap()
    };
    // The fixture holds ~334 kB of resident weights and ~393 kB of experts (16 of ~25 kB).
    let small = run("400K");
    let large = run("10M");
    for r in [&small, &large] {
        assert!(r["decode_tok_per_s"].as_f64().unwrap() > 0.0, "{r}");
        assert_eq!(
            r["disk_gb_per_s"].as_f64().unwrap(),
            1.0,
            "uses the cached measurement"
        );
    }
    let hit = |r: &serde_json::Value| r["decode_hit_rate"].as_f64().unwrap();
    let read = |r: &serde_json::Value| r["decode_gb_read_per_token"].as_f64().unwrap();
    assert!(
        hit(&small) < hit(&large),
        "a smaller cache hits less: {} vs {}",
        hit(&small),
        hit(&large)
    );
    assert!(
        read(&small) > 0.0,
        "a small cache reads during decode: {small}"
    );
}

#[test]
fn bench_streams_decodes_several_sequences_together() {
    let cache = cached_machine();
    let dir = fixture("olmoe");
    let bench = |streams: &str| -> Output {
        Command::new(env!("CARGO_BIN_EXE_coli"))
            .args(["bench", "--model", dir.to_str().unwrap(), "--mmap"])
            .args(["--prompt-tokens", "5", "--gen-tokens", "3", "--json"])
            .args(["--streams", streams])
            .env("COLI_CACHE_DIR", cache.path())
            .env("COLI_STATE_DIR", cache.path().join("state"))
            .output()
            .unwrap()
    };
    let run = |streams: &str| -> serde_json::Value {
        serde_json::from_str(&ok_stdout(&bench(streams))).unwrap()
    };
    // An absurd count is refused before any cache is allocated, naming the flag.
    let absurd = bench("100000000");
    let err = String::from_utf8_lossy(&absurd.stderr);
    assert!(
        !absurd.status.success() && err.contains("--streams 100000000") && err.contains("at most"),
        "{err}"
    );
    let r = run("3");
    let s = &r["streams"];
    assert_eq!(s["streams"].as_u64(), Some(3), "{r}");
    assert_eq!(
        s["steps"].as_u64(),
        Some(3),
        "one step per generated token: {r}"
    );
    let rate = s["aggregate_decode_tok_per_s"].as_f64().unwrap();
    let step_ms = s["step_ms"].as_f64().unwrap();
    // Three tokens per step: the aggregate rate is what the step time says.
    assert!(
        (rate - 3.0 * 1e3 / step_ms).abs() <= 1e-6 * rate,
        "{rate} tok/s vs {step_ms} ms per step"
    );
    assert!(
        s["decode_time"]["experts"].as_f64().unwrap() > 0.0,
        "a MoE decode spends time in its experts: {r}"
    );
    assert!(
        run("1").get("streams").is_none(),
        "one stream is the single-sequence decode"
    );
}

#[test]
fn bench_measures_the_machine_then_runs_on_the_threads_asked_for() {
    // No cached measurement: bench measures memory and disk bandwidth on every core first,
    // which must not leave the compute pool at that size (it once failed with "the global
    // thread pool has already been initialized").
    let cache = tempfile::tempdir().unwrap();
    let dir = fixture("olmoe");
    let out = Command::new(env!("CARGO_BIN_EXE_coli"))
        .args(["bench", "--model", dir.to_str().unwrap(), "--threads", "1"])
        .args([
            "--mmap",
            "--prompt-tokens",
            "4",
            "--gen-tokens",
            "2",
            "--json",
        ])
        .env("COLI_CACHE_DIR", cache.path())
        .env("COLI_STATE_DIR", cache.path().join("state"))
        .output()
        .unwrap();
    let r: serde_json::Value = serde_json::from_str(&ok_stdout(&out)).unwrap();
    assert_eq!(r["threads"].as_u64(), Some(1), "{r}");
    assert!(r["memory_gb_per_s"].as_f64().unwrap() > 0.0, "{r}");
    assert!(cache.path().join("machine.json").exists());
}

#[test]
fn convert_then_kl_measures_the_quantization_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let fx = fixture("qwen3_moe");
    let prompts = tmp.path().join("prompts.txt");
    std::fs::write(
        &prompts,
        "hello world, this is a test\n\nanother line of text\n",
    )
    .unwrap();
    let gguf = tmp.path().join("q8.gguf");
    // What a convert killed while writing left, removed by the next one.
    let stale = tmp.path().join(format!("q8.gguf.{}.tmp", dead_pid()));
    std::fs::write(&stale, b"GGUF").unwrap();
    convert(&fx, &gguf, "q8_0");
    assert!(!stale.exists(), "the killed convert's temporary is removed");
    let kl_run = |model: &std::path::Path| {
        coli(&[
            "kl",
            "-m",
            model.to_str().unwrap(),
            "-r",
            fx.to_str().unwrap(),
            "-p",
            prompts.to_str().unwrap(),
            "--json",
        ])
    };
    let kl = |model: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&ok_stdout(&kl_run(model))).unwrap()
    };
    let same = kl(&fx);
    assert_eq!(same["mean_kl"].as_f64().unwrap(), 0.0, "{same}");
    assert_eq!(same["same_top"].as_f64().unwrap(), 1.0);
    let q8 = kl(&gguf);
    let mean = q8["mean_kl"].as_f64().unwrap();
    assert!(mean > 0.0 && mean < 0.05, "{q8}");
    assert_eq!(q8["positions"], same["positions"]);
    // A prompt file without prompts is a clear error.
    std::fs::write(&prompts, "\n\n").unwrap();
    let out = kl_run(&fx);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no prompts"));
}

/// K-quant GGUFs written by `coli convert` run in llama.cpp with the greedy tokens colibri
/// produces (up to llama.cpp's own near-ties), for a synthetic Qwen3-MoE whose rows are whole
/// 256-element super-blocks. Needs `COLI_LLAMA_CPP_PYTHON` (a Python with llama-cpp-python);
/// skipped with a message otherwise.
#[test]
fn k_quant_gguf_runs_in_llama_cpp_with_our_greedy_tokens() {
    let Some(py) = std::env::var("COLI_LLAMA_CPP_PYTHON").ok() else {
        eprintln!("skipped: set COLI_LLAMA_CPP_PYTHON to a python with llama-cpp-python");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    synth_qwen3_moe(&hf, ["256", "8", "256", "512"], &[]);
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/tests/llamacpp/reference.py");
    let prompt = "5,17,42,99,128,7,300,11";
    for ty in ["q4_k_m", "q6_k", "q8_0"] {
        let gguf = tmp.path().join(format!("{ty}.gguf"));
        convert(&hf, &gguf, ty);
        let json = tmp.path().join(format!("{ty}.json"));
        let st = Command::new(&py)
            .arg(&script)
            .arg(&gguf)
            .arg(&json)
            .args(["--tokens", "16", "--ids", prompt])
            .status()
            .unwrap();
        assert!(st.success(), "{ty}: llama.cpp could not run our GGUF");
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let want: Vec<u64> = r["cases"][0]["greedy_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        let margins: Vec<f64> = r["cases"][0]["margins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        // Ours: teacher-force llama.cpp's continuation and take our argmax at every step.
        let all: Vec<String> = prompt
            .split(',')
            .map(String::from)
            .chain(want.iter().map(|t| t.to_string()))
            .collect();
        let out = coli(&[
            "logits",
            "-m",
            gguf.to_str().unwrap(),
            "--tokens",
            &all.join(","),
        ]);
        let v: serde_json::Value = serde_json::from_str(&ok_stdout(&out)).unwrap();
        let rows = v["logits"].as_array().unwrap();
        let p = prompt.split(',').count();
        let mut exact = 0;
        for (i, &w) in want.iter().enumerate() {
            let row: Vec<f64> = rows[p - 1 + i]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            let ours = (0..row.len()).fold(0, |b, j| if row[j] > row[b] { j } else { b }) as u64;
            assert!(
                ours == w || margins[i] < 0.15,
                "{ty}: step {i}: ours {ours}, llama.cpp {w} (its top-2 margin {})",
                margins[i]
            );
            exact += usize::from(ours == w);
        }
        assert!(
            exact * 4 >= want.len() * 3,
            "{ty}: only {exact} exact steps"
        );
        eprintln!(
            "{ty}: our argmax is llama.cpp's at {exact} of {} steps",
            want.len()
        );
    }
}

#[test]
fn an_io_error_is_printed_with_its_cause_once() {
    // A `config.json` that is a directory: reading it fails with an I/O error, which the
    // message used to repeat ("...: Is a directory (os error 21): Is a directory (os error 21)").
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let config = model.join("config.json");
    std::fs::create_dir_all(&config).unwrap();
    let cause = std::fs::read(&config).unwrap_err().to_string();
    let model = model.to_str().unwrap();
    for args in [
        &["info", "--model", model][..],
        &["logits", "--model", model, "--tokens", "1"],
    ] {
        let command = args[0];
        let out = coli(args);
        assert!(!out.status.success());
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(e.matches(&cause).count(), 1, "{command}: {e}");
        assert!(e.contains(&config.display().to_string()), "{command}: {e}");
    }
}
