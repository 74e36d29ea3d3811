//! Warm conversations through the `coli` binary: a greedy generation split over two
//! processes by `coli run --kv-file` produces exactly the tokens, text and KV cache of one
//! uninterrupted run, and damaged or foreign KV files (a bad checksum, a truncation, another
//! model, values that are not finite behind a valid checksum) are refused with a clear error.

use std::path::Path;

use colibri::runtime::generate::Conversation;
use colibri::runtime::kv_file;

mod support;
use support::{coli, fixture, reference};

/// Greedy `coli run` on `arch`'s fixture; returns (text without the final newline, stderr).
fn run(arch: &str, prompt: &str, max_tokens: usize, kv: Option<&Path>) -> (String, String) {
    let dir = fixture(arch);
    let max = max_tokens.to_string();
    let mut args = vec![
        "run",
        "--model",
        dir.to_str().unwrap(),
        "-p",
        prompt,
        "--temperature",
        "0",
        "--max-tokens",
        &max,
        "--ignore-eos",
    ];
    if let Some(kv) = kv {
        args.extend(["--kv-file", kv.to_str().unwrap()]);
    }
    let out = coli(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{arch}: coli failed: {stderr}");
    let text = String::from_utf8(out.stdout).expect("utf-8 stdout");
    let text = text
        .strip_suffix('\n')
        .expect("ends with a newline")
        .to_string();
    (text, stderr)
}

fn load(arch: &str, path: &Path) -> Conversation {
    let fp = kv_file::model_fingerprint(&fixture(arch)).unwrap();
    kv_file::load(path, &fp).unwrap()
}

fn bits(c: &Conversation) -> Vec<u32> {
    c.cache
        .layers
        .iter()
        .flat_map(|l| {
            [&l.k, &l.v, &l.aux]
                .into_iter()
                .flat_map(|b| b.to_f32_vec())
                .chain(l.state.iter().copied())
        })
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn a_greedy_run_split_over_two_processes_continues_exactly() {
    // qwen3_moe's fixture generates plain ASCII, so its text must join up exactly too; the
    // others' generations hold bytes that are not whole UTF-8 characters, whose text at a
    // split can legitimately differ, so for them the tokens and caches are compared. The
    // families cover grouped-query attention (k, v) and MLA (latent k, rope v) with and
    // without the DSA indexer's keys (aux), and hybrids whose linear-attention layers keep a
    // recurrent state (qwen3_next, qwen3_5_moe, kimi_linear, glm5_next), and the Inkling
    // family, whose layers keep their short convolutions' last inputs beside the KV rows.
    for (arch, compare_text) in [
        ("qwen3_moe", true),
        ("olmoe", false),
        ("llama", false),
        ("deepseek_v3", false),
        ("glm_moe_dsa", false),
        ("qwen3_next", false),
        ("qwen3_5_moe", false),
        ("kimi_linear", false),
        ("glm5_next", false),
        ("inkling", false),
        ("inkling2", false),
    ] {
        let r = reference(arch);
        let prompt = r["prompt_text"].as_str().unwrap();
        let prompt_len = r["prompt_ids"].as_array().unwrap().len();
        let greedy: Vec<u32> = r["greedy_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let (n, m) = (6, 9);
        let tmp = tempfile::tempdir().unwrap();

        // A: one uninterrupted run, plain and with a (new) KV file to read its tokens from.
        let (text_a, _) = run(arch, prompt, n + m, None);
        let a_kv = tmp.path().join("a.kv");
        let (text_a2, _) = run(arch, prompt, n + m, Some(&a_kv));
        assert_eq!(
            text_a2, text_a,
            "{arch}: --kv-file on a new file changes nothing"
        );
        let a = load(arch, &a_kv);
        assert_eq!(a.tokens.len(), prompt_len + n + m, "{arch}");
        assert_eq!(
            a.tokens[prompt_len..],
            greedy[..n + m],
            "{arch}: the reference greedy tokens"
        );

        // B1: the first N tokens, saved; B2: a new process continues for M more.
        let f = tmp.path().join("conv.kv");
        let (text_b1, err_b1) = run(arch, prompt, n, Some(&f));
        assert!(
            err_b1.contains("does not exist: starting a new conversation"),
            "{arch}: {err_b1}"
        );
        assert!(f.is_file(), "{arch}: the KV file is written");
        let b1 = load(arch, &f);
        assert_eq!(b1.tokens.len(), prompt_len + n, "{arch}");
        assert_eq!(
            b1.cache.len,
            prompt_len + n - 1,
            "{arch}: last token pending"
        );
        let size = std::fs::metadata(&f).unwrap().len();
        let (text_b2, err_b2) = run(arch, "", m, Some(&f));
        assert!(
            err_b2.contains(&format!(
                "restored {} tokens ({} cached, 1 pending)",
                prompt_len + n,
                prompt_len + n - 1
            )) && err_b2.contains(&format!("({})", human_size(size))),
            "{arch}: restore report: {err_b2}"
        );
        assert!(
            err_b2.contains("prompt: 1 tokens"),
            "{arch}: only the pending token is run: {err_b2}"
        );

        let hybrid = [
            "qwen3_next",
            "qwen3_5_moe",
            "kimi_linear",
            "glm5_next",
            "inkling",
            "inkling2",
        ]
        .contains(&arch);
        assert_eq!(
            a.cache.is_recurrent(),
            hybrid,
            "{arch}: the file holds the recurrent states exactly when the model has them"
        );
        if arch == "glm_moe_dsa" {
            assert!(
                a.cache.layers.iter().any(|l| !l.aux.is_empty()),
                "{arch}: the indexer keys are saved"
            );
        }

        let b2 = load(arch, &f);
        assert_eq!(b2.tokens, a.tokens, "{arch}: B1 + B2 tokens == A tokens");
        assert_eq!(b2.cache.len, a.cache.len, "{arch}");
        assert!(bits(&b2) == bits(&a), "{arch}: bit-identical caches");
        if compare_text {
            assert!(!text_b1.is_empty() && !text_b2.is_empty(), "{arch}");
            assert_eq!(
                format!("{text_b1}{text_b2}"),
                text_a,
                "{arch}: B1 + B2 text == A text"
            );
        }
    }
}

#[test]
fn damaged_or_foreign_kv_files_are_refused() {
    let arch = "qwen3_moe";
    let prompt = reference(arch)["prompt_text"].as_str().unwrap().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good.kv");
    run(arch, &prompt, 3, Some(&good));
    let bytes = std::fs::read(&good).unwrap();

    let refused = |name: &str, content: &[u8], model: &str, want: &str| {
        let path = tmp.path().join(name);
        std::fs::write(&path, content).unwrap();
        let dir = fixture(model);
        let out = coli(&[
            "run",
            "--model",
            dir.to_str().unwrap(),
            "-p",
            "",
            "--temperature",
            "0",
            "--max-tokens",
            "2",
            "--kv-file",
            path.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} was accepted: {stderr}");
        assert!(
            stderr.contains(want) && stderr.contains(name) && stderr.contains("delete it"),
            "{name}: {stderr}"
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            content,
            "{name}: a refused file is left as it was"
        );
    };

    let mut corrupt = bytes.clone();
    let mid = corrupt.len() / 2;
    corrupt[mid] ^= 0x01;
    refused("corrupt.kv", &corrupt, arch, "checksum mismatch");
    refused(
        "truncated.kv",
        &bytes[..bytes.len() - 100],
        arch,
        "truncated",
    );
    refused("foreign.kv", &bytes, "olmoe", "different model");
    refused("text.kv", b"hello, world", arch, "not a colibri KV file");

    // A NaN in the cache, saved with a valid checksum (a file damaged before it was summed):
    // before values were checked it was accepted and the answer came back empty.
    let mut conv = load(arch, &good);
    let n = conv.cache.layers[0].k.len();
    conv.cache.layers[0].k.f32_mut()[n / 2] = f32::NAN;
    let fp = kv_file::model_fingerprint(&fixture(arch)).unwrap();
    let source = tmp.path().join("nan-source.kv");
    kv_file::save(&source, &fp, &conv).unwrap();
    let nan = std::fs::read(&source).unwrap();
    refused(
        "nan.kv",
        &nan,
        arch,
        "is NaN, but a KV cache holds finite numbers only",
    );
}

/// A file size as the binary prints it: bytes below 1 KiB, else KiB or MiB with one decimal.
fn human_size(bytes: u64) -> String {
    match bytes {
        0..1024 => format!("{bytes} B"),
        1024..1048576 => format!("{:.1} KiB", bytes as f64 / 1024.0),
        _ => format!("{:.1} MiB", bytes as f64 / 1048576.0),
    }
}
