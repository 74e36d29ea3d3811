//! `coli doctor` on a small synthetic sharded model: it passes the intact directory (exit 0),
//! and flags each broken copy — a missing or truncated shard, a missing tokenizer or
//! config.json, a bad config key, an unsupported dtype, an index naming a tensor its shard does
//! not hold, an unwritable state directory, an absurd configuration value, a corrupt GGUF
//! header, a mirror copy of the wrong size, an LFS pointer instead of weights — with exit 2
//! and an `error:` line naming the file or key. `--deep` finds a NaN written into a tensor
//! (which the header checks cannot see), a file that no longer matches `coli pull`'s
//! receipt, and one flipped bit in a shard's tensor data under a receipt of its true hash.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use support::isolated;

/// `coli ARGS` in `cwd` with `state` as its state directory and no configuration from the
/// environment.
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

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A small f32 Qwen3-MoE in several shards with an index.
fn synth(out: &Path) {
    let o = coli_in(
        Path::new("."),
        &std::env::temp_dir(),
        &[
            "synth",
            "--arch",
            "qwen3-moe",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--moe-intermediate",
            "32",
            "--vocab",
            "512",
            "--dtype",
            "f32",
            "--shard-bytes",
            "60000",
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "synth: {}", text(&o));
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// The model's shards, sorted.
fn shards(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

/// The safetensors header of `file`: (data start, JSON).
fn header(file: &Path) -> (usize, serde_json::Value) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (8 + n, serde_json::from_slice(&bytes[8..8 + n]).unwrap())
}

/// Exit status 2 and an `error:` line that names `subject` and says `what`.
fn assert_error(out: &Output, subject: &str, what: &str) {
    let t = text(out);
    assert_eq!(out.status.code(), Some(2), "expected a failure:\n{t}");
    assert!(
        t.lines().any(|l| l.starts_with("error: ")
            && l.contains(subject)
            && l.contains(what)
            && l.contains(" — ")),
        "no `error:` line naming {subject:?} with {what:?}:\n{t}"
    );
}

struct Case {
    tmp: tempfile::TempDir,
    model: PathBuf,
    state: PathBuf,
}

impl Case {
    /// A fresh copy of the base model and a state directory.
    fn new(base: &Path) -> Case {
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("model");
        copy_dir(base, &model);
        let state = tmp.path().join("state");
        std::fs::create_dir_all(&state).unwrap();
        Case { tmp, model, state }
    }

    fn doctor(&self, extra: &[&str]) -> Output {
        let mut args = vec!["doctor", "--model", self.model.to_str().unwrap()];
        args.extend_from_slice(extra);
        coli_in(self.tmp.path(), &self.state, &args)
    }
}

#[test]
fn doctor_passes_a_good_model_and_names_each_broken_file_or_key() {
    let base_tmp = tempfile::tempdir().unwrap();
    let base = base_tmp.path().join("base");
    synth(&base);
    assert!(base.join("model.safetensors.index.json").is_file());
    let all = shards(&base);
    assert!(all.len() >= 2, "the base model is sharded: {all:?}");
    let shard_name = |i: usize| all[i].file_name().unwrap().to_str().unwrap().to_string();

    // The intact model passes, and so does --deep.
    let good = Case::new(&base);
    let out = good.doctor(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("every check passed"));
    let out = good.doctor(&["--deep"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // Read-only: the state directory is left as it was.
    assert_eq!(std::fs::read_dir(&good.state).unwrap().count(), 0);

    // 1. A shard the index names is missing.
    let c = Case::new(&base);
    std::fs::remove_file(c.model.join(shard_name(1))).unwrap();
    assert_error(&c.doctor(&[]), &shard_name(1), "missing");

    // 2. A shard cut short.
    let c = Case::new(&base);
    let f = c.model.join(shard_name(0));
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    assert_error(&c.doctor(&[]), &shard_name(0), "truncated");

    // 3. No tokenizer.
    let c = Case::new(&base);
    std::fs::remove_file(c.model.join("tokenizer.json")).unwrap();
    assert_error(&c.doctor(&[]), "tokenizer.json", "missing");

    // 4. A config key the family refuses.
    let c = Case::new(&base);
    let cfg_path = c.model.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["num_experts_per_tok"] = serde_json::json!(0);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    assert_error(&c.doctor(&[]), "config.json", "num_experts_per_tok");

    // 5. No config.json.
    let c = Case::new(&base);
    std::fs::remove_file(c.model.join("config.json")).unwrap();
    assert_error(&c.doctor(&[]), "config.json", "missing");

    // 6. A dtype colibri does not read (F32 → F64 in a header, same length).
    let c = Case::new(&base);
    let f = c.model.join(shard_name(0));
    let mut bytes = std::fs::read(&f).unwrap();
    let (start, _) = header(&f);
    let at = bytes[..start]
        .windows(5)
        .position(|w| w == b"\"F32\"")
        .expect("an F32 tensor");
    bytes[at + 2] = b'6';
    bytes[at + 3] = b'4';
    std::fs::write(&f, bytes).unwrap();
    assert_error(&c.doctor(&[]), &shard_name(0), "unsupported dtype F64");

    // 7. The index names a tensor its shard does not hold.
    let c = Case::new(&base);
    let index = c.model.join("model.safetensors.index.json");
    let mut idx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    idx["weight_map"]["model.layers.0.mlp.not_there.weight"] = serde_json::json!(shard_name(0));
    std::fs::write(&index, idx.to_string()).unwrap();
    assert_error(
        &c.doctor(&[]),
        "model.safetensors.index.json",
        "model.layers.0.mlp.not_there.weight",
    );

    // 8. A state directory that cannot be written (a file where the directory should be).
    let c = Case::new(&base);
    let blocked = c.tmp.path().join("blocked");
    std::fs::write(&blocked, b"a file").unwrap();
    let out = coli_in(
        c.tmp.path(),
        &blocked.join("state"),
        &["doctor", "--model", c.model.to_str().unwrap()],
    );
    assert_error(&out, "blocked", "not a directory");

    // 9. An absurd configuration value in ./colibri.toml.
    let c = Case::new(&base);
    std::fs::write(c.tmp.path().join("colibri.toml"), "slots = 100000\n").unwrap();
    assert_error(&c.doctor(&[]), "configuration", "slots");

    // 10. A corrupt GGUF header.
    let c = Case::new(&base);
    let gguf = c.tmp.path().join("model.gguf");
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&3u32.to_le_bytes());
    bytes.extend_from_slice(&u64::MAX.to_le_bytes());
    bytes.extend_from_slice(&[0xAB; 64]);
    std::fs::write(&gguf, bytes).unwrap();
    let out = coli_in(
        c.tmp.path(),
        &c.state,
        &["doctor", "--model", gguf.to_str().unwrap()],
    );
    assert_error(&out, "model.gguf", "");

    // 11. A mirror whose copy of a shard differs in size from the primary.
    let c = Case::new(&base);
    let mirror = c.tmp.path().join("mirror");
    std::fs::create_dir_all(&mirror).unwrap();
    std::fs::write(mirror.join(shard_name(0)), b"short").unwrap();
    assert_error(
        &c.doctor(&["--mirror", mirror.to_str().unwrap()]),
        &shard_name(0),
        "the primary has",
    );

    // 12. A Git LFS pointer in place of a shard.
    let c = Case::new(&base);
    std::fs::write(
        c.model.join(shard_name(1)),
        "version https://git-lfs.github.com/spec/v1\noid sha256:\
         0000000000000000000000000000000000000000000000000000000000000000\nsize 123\n",
    )
    .unwrap();
    assert_error(&c.doctor(&[]), &shard_name(1), "LFS pointer");

    // 13. A model directory that does not exist.
    let c = Case::new(&base);
    let out = coli_in(
        c.tmp.path(),
        &c.state,
        &[
            "doctor",
            "--model",
            c.tmp.path().join("nowhere").to_str().unwrap(),
        ],
    );
    assert_error(&out, "nowhere", "does not exist");
}

/// The name of the first f32 tensor of the safetensors file `f`, and where its data begins
/// and ends in the file.
fn first_f32_tensor(f: &Path) -> (String, usize, usize) {
    let (start, h) = header(f);
    let (name, info) = h
        .as_object()
        .unwrap()
        .iter()
        .find(|(k, v)| *k != "__metadata__" && v["dtype"] == "F32")
        .expect("an f32 tensor");
    let [begin, end] = [0, 1].map(|i| info["data_offsets"][i].as_u64().unwrap() as usize);
    (name.clone(), start + begin, start + end)
}

/// A `coli pull` receipt in `model` saying `shard` has `size` bytes and SHA-256 `sha256`.
fn write_receipt(model: &Path, shard: &str, size: u64, sha256: &str) {
    let receipt = serde_json::json!({
        "format": 1,
        "endpoint": "https://huggingface.co",
        "repo": "test/model",
        "revision": "main",
        "commit": "0123456789abcdef0123456789abcdef01234567",
        "include": [],
        "complete": true,
        "files": [{"path": shard, "size": size, "sha256": sha256}],
    });
    std::fs::write(model.join("coli-pull.json"), receipt.to_string()).unwrap();
}

#[test]
fn deep_finds_a_nan_a_receipt_mismatch_and_a_flipped_bit() {
    let base_tmp = tempfile::tempdir().unwrap();
    let base = base_tmp.path().join("base");
    synth(&base);
    let all = shards(&base);

    // A NaN written over the first value of an f32 tensor: the headers are intact.
    let c = Case::new(&base);
    let f = c.model.join(all[0].file_name().unwrap());
    let (name, begin, _) = first_f32_tensor(&f);
    let name = name.as_str();
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[begin..begin + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&f, &bytes).unwrap();
    let out = c.doctor(&[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "headers alone pass:\n{}",
        text(&out)
    );
    assert_error(&c.doctor(&["--deep"]), name, "NaN");

    // A file that no longer matches coli pull's receipt.
    let c = Case::new(&base);
    let shard = all[1].file_name().unwrap().to_str().unwrap();
    let size = std::fs::metadata(c.model.join(shard)).unwrap().len();
    write_receipt(&c.model, shard, size, &"00".repeat(32));
    let out = c.doctor(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_error(&c.doctor(&["--deep"]), shard, "coli-pull.json says");

    // One flipped bit in the middle of a shard's tensor data, under a receipt that held the
    // shard's true SHA-256: the value stays finite (the low bit of a mantissa byte), the
    // headers stay intact, and only --deep's hash sees it.
    let c = Case::new(&base);
    let path = c.model.join(shard);
    let (sha256, size) =
        colibri::store::staging::sha256_file(&path, false, &mut |_, _, _| {}).unwrap();
    write_receipt(&c.model, shard, size, &sha256);
    let out = c.doctor(&["--deep"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "the true hash passes:\n{}",
        text(&out)
    );
    let (_, begin, end) = first_f32_tensor(&path);
    // The lowest byte of an f32 in the middle of the tensor: its last mantissa bits.
    let at = begin + ((end - begin) / 8) * 4;
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let out = c.doctor(&[]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "headers alone pass:\n{}",
        text(&out)
    );
    assert_error(&c.doctor(&["--deep"]), shard, "coli-pull.json says");
}
