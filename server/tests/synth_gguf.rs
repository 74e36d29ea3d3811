//! `coli synth --format gguf --type T` writes, tensor by tensor, the file that `coli synth`
//! (safetensors) followed by `coli convert --type T` writes: the same bytes, so the same
//! logits and tokens; and it refuses what it cannot do before writing anything.

use std::path::Path;
use std::process::Output;

use colibri::format::gguf::GgufFile;

mod support;
use support::coli;

fn ok_stderr(out: &Output) -> String {
    assert!(
        out.status.success(),
        "coli failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stderr.clone()).expect("utf-8 stderr")
}

fn ok_stdout(out: &Output) -> String {
    ok_stderr(out);
    String::from_utf8(out.stdout.clone()).expect("utf-8 stdout")
}

fn failed_with(out: &Output, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains(what),
        "expected a failure saying `{what}`, got: {stderr}"
    );
}

/// `coli synth ARGS --out OUT EXTRA`.
fn synth(args: &[&str], out: &Path, extra: &[&str]) -> Output {
    let mut a = vec!["synth"];
    a.extend_from_slice(args);
    a.extend(["--out", out.to_str().unwrap()]);
    a.extend_from_slice(extra);
    coli(&a)
}

/// Where two GGUF files first differ: a metadata key (or its order), a tensor's info, or a
/// tensor's bytes; `None` when every key and tensor is the same.
fn first_difference(a: &Path, b: &Path) -> Option<String> {
    let (fa, fb) = (GgufFile::open(a).unwrap(), GgufFile::open(b).unwrap());
    if fa.metadata_keys() != fb.metadata_keys() {
        return Some(format!(
            "metadata keys: {:?} vs {:?}",
            fa.metadata_keys(),
            fb.metadata_keys()
        ));
    }
    for k in fa.metadata_keys() {
        if fa.metadata()[k] != fb.metadata()[k] {
            return Some(format!("metadata `{k}`"));
        }
    }
    let names = |f: &GgufFile| {
        f.tensors()
            .iter()
            .map(|t| t.name.clone())
            .collect::<Vec<_>>()
    };
    if names(&fa) != names(&fb) {
        return Some(format!("tensors: {:?} vs {:?}", names(&fa), names(&fb)));
    }
    for (ta, tb) in fa.tensors().iter().zip(fb.tensors()) {
        if (ta.ggml_type, &ta.dims_ggml) != (tb.ggml_type, &tb.dims_ggml) {
            return Some(format!("tensor `{}`: type or shape", ta.name));
        }
        if fa.read_tensor(ta).unwrap() != fb.read_tensor(tb).unwrap() {
            return Some(format!("tensor `{}`: bytes", ta.name));
        }
    }
    None
}

/// For a standard MoE (olmoe) and a DeepSeek-style one (deepseek-v3: MLA with its split
/// `kv_b_proj`, a dense first layer, shared experts, grouped routing), in a K-quant mix and
/// q8_0: the direct GGUF is byte for byte the two-step one (`general.name` is --out's stem,
/// as convert names a file after its directory), and `coli logits` / `coli run` on both agree.
#[test]
fn synth_gguf_is_synth_then_convert() {
    let tmp = tempfile::tempdir().unwrap();
    let olmoe: &[&str] = &[
        "--arch",
        "olmoe",
        "--layers",
        "3",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--moe-intermediate",
        "256",
        // 4500 × 256 embedding and head values: more than one generated chunk of 2^20.
        "--vocab",
        "4500",
        "--seed",
        "7",
    ];
    let deepseek: &[&str] = &[
        "--arch",
        "deepseek-v3",
        "--layers",
        "3",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--moe-intermediate",
        "256",
        "--intermediate",
        "512",
        "--n-group",
        "4",
        "--topk-group",
        "2",
        "--vocab",
        "512",
        "--seed",
        "7",
    ];
    for (name, args, ty) in [
        ("olmoe", olmoe, "q4_k_m"),
        ("olmoe", olmoe, "q8_0"),
        ("deepseek", deepseek, "q4_k_m"),
        ("deepseek", deepseek, "q8_0"),
    ] {
        let case = tmp.path().join(format!("{name}-{ty}"));
        let (two, one) = (case.join("two"), case.join("one"));
        std::fs::create_dir_all(&one).unwrap();
        let hf = two.join("m");
        ok_stderr(&synth(args, &hf, &[]));
        let converted = two.join("m.gguf");
        ok_stderr(&coli(&[
            "convert",
            "-m",
            hf.to_str().unwrap(),
            "-o",
            converted.to_str().unwrap(),
            "-t",
            ty,
        ]));
        let direct = one.join("m.gguf");
        let stderr = ok_stderr(&synth(args, &direct, &["--format", "gguf", "--type", ty]));
        let size = std::fs::metadata(&direct).unwrap().len();
        assert!(
            stderr.contains(&colibri::store::budget::format_size(size)),
            "{name} {ty}: the size is printed: {stderr}"
        );
        // Only the file is left beside it (no temporary, no text directory).
        let left: Vec<_> = std::fs::read_dir(&one)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["m.gguf"], "{name} {ty}");
        let file = GgufFile::open(&direct).unwrap();
        let types: Vec<_> = file.tensors().iter().map(|t| t.ggml_type.name()).collect();
        assert!(
            types.contains(&if ty == "q8_0" { "Q8_0" } else { "Q4_K" }),
            "{name} {ty}: {types:?}"
        );
        assert_eq!(first_difference(&direct, &converted), None, "{name} {ty}");
        assert!(
            std::fs::read(&direct).unwrap() == std::fs::read(&converted).unwrap(),
            "{name} {ty}: the files differ outside their keys and tensors"
        );
        let logits = |model: &Path| {
            ok_stdout(&coli(&[
                "logits",
                "--model",
                model.to_str().unwrap(),
                "--tokens",
                "1,5,300,42,7",
            ]))
        };
        let (a, b) = (logits(&direct), logits(&converted));
        let v: serde_json::Value = serde_json::from_str(&a).unwrap();
        let rows = v["logits"].as_array().unwrap();
        assert_eq!(rows.len(), 5, "{name} {ty}");
        let vocab = if name == "olmoe" { 4500 } else { 512 };
        assert!(rows.iter().all(|r| r.as_array().unwrap().len() == vocab));
        assert_eq!(a, b, "{name} {ty}: logits");
        let run = |model: &Path| {
            ok_stdout(&coli(&[
                "run",
                "--model",
                model.to_str().unwrap(),
                "--prompt",
                "hello world",
                "--temperature",
                "0",
                "--max-tokens",
                "8",
                "--ignore-eos",
            ]))
        };
        assert_eq!(run(&direct), run(&converted), "{name} {ty}: greedy run");
    }
}

/// What `--format gguf` cannot do is refused before anything is written: an existing --out,
/// an architecture llama.cpp has no layout for, `--type` without it, a bad `--type`, and a
/// file larger than the free space (checked against the planned size up front).
#[test]
fn synth_gguf_refusals_leave_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let existing = d.join("there.gguf");
    std::fs::write(&existing, b"keep").unwrap();
    failed_with(
        &synth(&["--arch", "olmoe", "--format", "gguf"], &existing, &[]),
        "already exists",
    );
    assert_eq!(std::fs::read(&existing).unwrap(), b"keep");
    failed_with(
        &synth(
            &["--arch", "gpt-oss", "--format", "gguf"],
            &d.join("g.gguf"),
            &[],
        ),
        "no GGUF layout for --arch gpt-oss",
    );
    failed_with(
        &synth(&["--arch", "olmoe", "--type", "q8_0"], &d.join("st"), &[]),
        "--type: only with --format gguf",
    );
    failed_with(
        &synth(
            &["--arch", "olmoe", "--format", "gguf", "--type", "q3_k"],
            &d.join("q.gguf"),
            &[],
        ),
        "unknown GGUF type `q3_k`",
    );
    // 200 layers of 256 experts of 16384 × 32768: tens of TiB in q8_0.
    let huge = [
        "--arch",
        "olmoe",
        "--layers",
        "200",
        "--hidden",
        "32768",
        "--experts",
        "256",
        "--moe-intermediate",
        "16384",
        "--vocab",
        "512",
        "--format",
        "gguf",
    ];
    let o = synth(&huge, &d.join("huge.gguf"), &[]);
    failed_with(&o, "the GGUF needs about");
    failed_with(&o, "TiB, but the file system of");
    let left: Vec<_> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["there.gguf"]);
}
