//! A read error of the model's files while `coli serve` runs: the request that needed the
//! bytes gets a 503 naming the file (with `Retry-After`), the server keeps serving, and once
//! the file is whole again the same request gives the same tokens as before the fault.
//!
//! The model is streamed: the RAM budget holds the dense weights and no expert, so every step
//! reads its experts from `model.safetensors`. The fault is real: the file is cut short in
//! place (the server's open descriptor sees it), then its bytes are written back in place.

mod support;
use support::{http, http_with_head, wait_for, Served};

use std::path::Path;
use std::process::Command;

fn coli() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_coli"));
    support::isolated(&mut cmd);
    cmd
}

/// A greedy completion request: (status, body, the `Retry-After` header if any).
fn complete(port: u16, prompt: &str) -> (u16, serde_json::Value, Option<String>) {
    let body = serde_json::json!({
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
    })
    .to_string();
    let (status, head, body) =
        http_with_head(port, "POST", "/v1/completions", &body).expect("the server answers");
    let retry_after = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("retry-after")
            .then(|| v.trim().to_string())
    });
    let json = serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body));
    (status, json, retry_after)
}

fn text_of(v: &serde_json::Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .expect("a completion")
        .into()
}

/// Overwrite `path`'s bytes in place (same inode, as the server's descriptor sees it).
fn write_in_place(path: &Path, bytes: &[u8]) {
    use std::io::{Seek, Write};
    let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.rewind().unwrap();
    f.write_all(bytes).unwrap();
    f.set_len(bytes.len() as u64).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn a_read_error_is_a_503_naming_the_file_and_the_server_keeps_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    let out = coli()
        .args([
            "synth", "--arch", "olmoe", "--layers", "2", "--hidden", "256",
        ])
        .args([
            "--experts",
            "8",
            "--top-k",
            "2",
            "--moe-intermediate",
            "128",
        ])
        .args(["--vocab", "512", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dense = colibri::model::load(&model).unwrap().info().dense_bytes;
    let weights = model.join("model.safetensors");
    let original = std::fs::read(&weights).unwrap();

    let mut server = Served::spawn(
        coli()
            .args(["serve", "--model"])
            .arg(&model)
            .args(["--host", "127.0.0.1", "--port", "0", "--slots", "1"])
            .args(["--threads", "1", "--ram", &dense.to_string()])
            .env("COLI_STATE_DIR", tmp.path().join("state")),
    )
    .wait_ready();
    let port = server.port;
    let prompt = "The hummingbird hovers";
    let (status, before, _) = complete(port, prompt);
    assert_eq!(status, 200, "{before}");

    // The file cut to its first 64 bytes: the experts the next step needs are past its end.
    write_in_place(&weights, &original[..64]);
    let (status, error, retry_after) = complete(port, prompt);
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert_eq!(status, 503, "{error}");
    assert!(
        message.contains("model.safetensors") && message.contains("offset"),
        "the error names the file and the offset: {message}"
    );
    assert!(
        retry_after.is_some(),
        "a 503 for a read error says when to retry"
    );
    server.check_running();
    let (status, _) = http(port, "GET", "/health", "").expect("the server answers");
    assert_eq!(status, 200);

    // Whole again: the same request gives the same tokens.
    write_in_place(&weights, &original);
    let (status, after, _) = complete(port, prompt);
    assert_eq!(status, 200, "{after}");
    assert_eq!(
        text_of(&after),
        text_of(&before),
        "the same tokens after the fault"
    );
    let metrics = wait_for(10, "the metrics", || http(port, "GET", "/metrics", ""));
    assert!(
        metrics
            .1
            .lines()
            .any(|l| l.starts_with("coli_requests_total") && l.contains("status=\"503\"")),
        "the 503 is counted"
    );
    server.check_running();
}
