//! The engine options through `coli serve` and `coli config --show`: the I/O mode, direct I/O,
//! cache policy, MLA form and KV dtype set by flags, by `COLI_*` variables and by the profile
//! file reach the engine (a latent-attention fixture serves with them), show up with their
//! sources, and an option the model cannot honour stops the server with the engine's reason.

mod support;

use std::path::Path;
use std::process::{Child, Command, ExitStatus};

use support::{assert_names_option, coli, fixture, http, isolated, wait_for, Served};

/// `coli serve ARGS` in `cwd`, with `env` added, its stderr collected.
fn spawn_serve(args: &[&str], env: &[(&str, &str)], cwd: &Path) -> Served {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_coli"));
    isolated(&mut cmd)
        .arg("serve")
        .args(["--host", "127.0.0.1", "--port", "0", "--slots", "1"])
        .args(args)
        .envs(env.iter().copied())
        .current_dir(cwd);
    Served::spawn(&mut cmd)
}

/// Start a server and wait until `/ready` answers 200.
fn start_server(args: &[&str], env: &[(&str, &str)], cwd: &Path) -> Served {
    spawn_serve(args, env, cwd).wait_ready()
}

/// `coli serve` as [`spawn_serve`] starts it, expected to exit with an error: its exit status
/// and its whole stderr.
fn refused(args: &[&str], env: &[(&str, &str)], cwd: &Path) -> (ExitStatus, String) {
    let mut serve = spawn_serve(args, env, cwd);
    let status = wait_exit(&mut serve.child);
    // The reader thread has the whole stderr once the pipe closes.
    let log = wait_for(10, "the whole log", || {
        let l = serve.log();
        l.contains("coli: error:").then_some(l)
    });
    (status, log)
}

/// A greedy completion of a few tokens from `server`; returns its text.
fn complete(server: &Served) -> String {
    let body = serde_json::json!({
        "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": true,
    })
    .to_string();
    let (status, text) =
        http(server.port, "POST", "/v1/completions", &body).expect("the server answers");
    assert_eq!(status, 200, "{text}\n{}", server.log());
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// The MLA options the tests set, as flags.
const MLA_FLAGS: &[&str] = &[
    "--io",
    "pool",
    "--io-threads",
    "2",
    "--direct-io",
    "--cache-policy",
    "lfru",
    "--mla-form",
    "expanded",
    "--kv-dtype",
    "bf16",
];

/// What a `coli run` of the same settings generates (the reference the server must match).
fn run_text(model: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "hello",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
        "--ignore-eos",
        "--threads",
        "1",
    ];
    args.extend_from_slice(extra);
    let out = coli(&args);
    assert!(
        out.status.success(),
        "coli run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // `run` ends its text with a newline.
    let text = String::from_utf8(out.stdout).unwrap();
    text.strip_suffix('\n').unwrap_or(&text).to_string()
}

#[test]
fn serve_takes_the_engine_options_from_flags_on_a_latent_attention_model() {
    let model = fixture("deepseek_v3");
    let work = tempfile::tempdir().unwrap();
    let mut args = vec!["--model", model.to_str().unwrap(), "--threads", "1"];
    args.extend_from_slice(MLA_FLAGS);
    let server = start_server(&args, &[], work.path());
    let text = complete(&server);
    let log = server.log();
    assert!(log.contains("reader: pread pool, 2 threads"), "{log}");
    // The same tokens as `coli run` with the same options.
    assert_eq!(text, run_text(&model, MLA_FLAGS));
}

#[test]
fn serve_takes_the_engine_options_from_the_file_and_the_environment() {
    let model = fixture("glm_moe_dsa");
    let work = tempfile::tempdir().unwrap();
    std::fs::write(
        work.path().join("colibri.toml"),
        format!(
            "model = {:?}\nthreads = 1\ncache_policy = \"lfru\"\ndirect_io = true\n\
             [profiles.mla]\nmla_form = \"expanded\"\nkv_dtype = \"bf16\"\n",
            model.to_str().unwrap()
        ),
    )
    .unwrap();
    let env = [
        ("COLI_PROFILE", "mla"),
        ("COLI_IO", "pool"),
        ("COLI_IO_THREADS", "2"),
    ];
    let server = start_server(&[], &env, work.path());
    let text = complete(&server);
    let log = server.log();
    assert!(log.contains("reader: pread pool, 2 threads"), "{log}");
    assert_eq!(text, run_text(&model, MLA_FLAGS));
}

/// `coli config --show ARGS` in `cwd` with `env`: (success, stdout, stderr).
fn config_show(args: &[&str], env: &[(&str, &str)], cwd: &Path) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_coli"));
    let out = isolated(&mut cmd)
        .args(["config", "--show"])
        .args(args)
        .envs(env.iter().copied())
        .current_dir(cwd)
        .output()
        .expect("coli config runs");
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn config_show_names_each_engine_options_source() {
    let work = tempfile::tempdir().unwrap();
    // From the environment.
    let env = [
        ("COLI_IO", "pool"),
        ("COLI_DIRECT_IO", "true"),
        ("COLI_CACHE_POLICY", "lfru"),
        ("COLI_MLA_FORM", "expanded"),
        ("COLI_KV_DTYPE", "bf16"),
    ];
    let (ok, shown, e) = config_show(&[], &env, work.path());
    assert!(ok, "{e}");
    for line in [
        "io = \"pool\"  # env COLI_IO\n",
        "direct_io = true  # env COLI_DIRECT_IO\n",
        "cache_policy = \"lfru\"  # env COLI_CACHE_POLICY\n",
        "mla_form = \"expanded\"  # env COLI_MLA_FORM\n",
        "kv_dtype = \"bf16\"  # env COLI_KV_DTYPE\n",
        "draft = \"none\"  # default\n",
        "io_threads = 4  # default\n",
        "# pin_budget = (unset)  # default\n",
    ] {
        assert!(shown.contains(line), "{line} in:\n{shown}");
    }

    // From the profile file, a profile of it, and a flag over both.
    let file = work.path().join("colibri.toml");
    std::fs::write(
        &file,
        "io = \"pool\"\ndirect_io = true\ncache_policy = \"lfru\"\npin_budget = \"256M\"\n\
         [profiles.mla]\nmla_form = \"expanded\"\nkv_dtype = \"bf16\"\n",
    )
    .unwrap();
    let (ok, shown, e) = config_show(&["--profile", "mla", "--draft", "mtp"], &[], work.path());
    assert!(ok, "{e}");
    let f = file.display();
    for line in [
        format!("io = \"pool\"  # file {f}\n"),
        format!("direct_io = true  # file {f}\n"),
        format!("cache_policy = \"lfru\"  # file {f}\n"),
        format!("pin_budget = \"256M\"  # file {f}\n"),
        format!("mla_form = \"expanded\"  # file {f} [profile mla]\n"),
        format!("kv_dtype = \"bf16\"  # file {f} [profile mla]\n"),
        "draft = \"mtp\"  # flag --draft\n".to_string(),
    ] {
        assert!(shown.contains(&line), "{line} in:\n{shown}");
    }

    // A bad value names the key, its source and the valid values.
    let (ok, _, e) = config_show(&[], &[("COLI_KV_DTYPE", "f16")], work.path());
    assert!(!ok);
    assert!(
        e.contains("`kv_dtype` from environment variable COLI_KV_DTYPE"),
        "{e}"
    );
    assert!(e.contains("f32") && e.contains("bf16"), "{e}");
    let (ok, _, e) = config_show(&["--cache-policy", "fifo"], &[], work.path());
    assert!(!ok);
    assert!(e.contains("--cache-policy") && e.contains("lfru"), "{e}");
}

/// Wait (bounded) for a process to exit.
fn wait_exit(child: &mut Child) -> ExitStatus {
    wait_for(120, "coli serve to exit", || child.try_wait().unwrap())
}

#[test]
fn serve_stops_with_the_reason_when_the_model_cannot_honour_an_option() {
    // (model, option, value, what the message must name), as the `run` test of cli.rs.
    let cases = [
        ("llama", "--draft", "mtp", "multi-token-prediction"),
        (
            "qwen3_moe",
            "--mla-form",
            "expanded",
            "no multi-head latent attention",
        ),
        ("llama", "--kv-dtype", "bf16", "no latent-attention cache"),
    ];
    let work = tempfile::tempdir().unwrap();
    for (arch, option, value, why) in cases {
        let model = fixture(arch);
        let (status, e) = refused(
            &["--model", model.to_str().unwrap(), option, value],
            &[],
            work.path(),
        );
        assert!(!status.success(), "{arch} {option} {value} served: {e}");
        assert!(e.contains(why), "{arch} {option} {value}: {e}");
        assert_names_option(&e, option);
    }
    // The same from the environment.
    let model = fixture("mixtral");
    let (status, e) = refused(
        &["--model", model.to_str().unwrap()],
        &[("COLI_MLA_FORM", "absorbed")],
        work.path(),
    );
    assert!(!status.success(), "{e}");
    assert!(e.contains("no multi-head latent attention"), "{e}");
}
