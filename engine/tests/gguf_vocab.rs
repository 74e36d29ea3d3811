//! Tokenizers built from GGUF metadata against llama.cpp's own test vectors: the
//! `models/ggml-vocab-*.gguf` files with their `.inp` / `.out` cases from the llama-cpp-python
//! 0.3.36 source distribution (vendored llama.cpp). The `.out` ids were made with
//! `common_tokenize(ctx, text, add_special = false, parse_special = false)`: no BOS, and
//! special-token text in the input is plain text.
//!
//! The files are looked for in `$COLI_TEST_CACHE` (else `$HOME/.cache/colibri-tests`) under
//! `llama-cpp-python-0.3.36/models/`; if absent they are fetched once from PyPI and
//! only the vocab files extracted. Offline, the test says "skipped" and passes.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use colibri::format::gguf::GgufFile;
use colibri::format::gguf_vocab::tokenizer_from_gguf;
use colibri::Error;

const SDIST: &str = "llama-cpp-python==0.3.36";
const CACHE_SUBDIR: &str = "llama-cpp-python-0.3.36";
const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

/// The vocabularies that must pass every case; a change here is a regression (or progress).
const EXPECTED_PASSING: &[&str] = &[
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
];

fn cache_root() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("COLI_TEST_CACHE") {
        return Some(PathBuf::from(dir));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("colibri-tests"))
}

fn has_vocabs(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten().any(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.starts_with("ggml-vocab-") && name.ends_with(".gguf")
            })
        })
        .unwrap_or(false)
}

/// Download the sdist and extract only the vocab files into `models` (atomically: a temp dir
/// next to it, renamed into place).
fn fetch(root: &Path, models: &Path) -> Result<(), String> {
    std::fs::create_dir_all(root).map_err(|e| format!("{}: {e}", root.display()))?;
    let work =
        tempfile::tempdir_in(root).map_err(|e| format!("temp dir in {}: {e}", root.display()))?;
    let dl = work.path().join("dl");
    // The sdist straight from PyPI's simple index (`pip download` of an sdist would first
    // install its build system to read its metadata, which takes minutes), checked against
    // the sha256 the index gives.
    let script = "import hashlib, os, re, sys, urllib.request\n\
        html = urllib.request.urlopen('https://pypi.org/simple/llama-cpp-python/', timeout=60).read().decode()\n\
        url, sha = re.search(r'href=\"([^\"]*llama_cpp_python-0\\.3\\.36\\.tar\\.gz)#sha256=([0-9a-f]+)', html).groups()\n\
        data = urllib.request.urlopen(url, timeout=600).read()\n\
        assert hashlib.sha256(data).hexdigest() == sha, 'sha256 mismatch'\n\
        os.makedirs(sys.argv[1], exist_ok=True)\n\
        open(os.path.join(sys.argv[1], 'sdist.tar.gz'), 'wb').write(data)\n";
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(&dl)
        .status()
        .map_err(|e| format!("cannot run python3: {e}"))?;
    if !status.success() {
        return Err(format!(
            "downloading {SDIST} from PyPI failed ({status}); offline?"
        ));
    }
    let archive = std::fs::read_dir(&dl)
        .map_err(|e| format!("{}: {e}", dl.display()))?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".tar.gz"))
        .ok_or_else(|| format!("no .tar.gz in {}", dl.display()))?;
    let out = work.path().join("x");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let status = Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(&out)
        .args(["--wildcards", "*/vendor/llama.cpp/models/ggml-vocab-*"])
        .status()
        .map_err(|e| format!("cannot run tar: {e}"))?;
    if !status.success() {
        return Err(format!("tar failed on {} ({status})", archive.display()));
    }
    let top = std::fs::read_dir(&out)
        .map_err(|e| format!("{}: {e}", out.display()))?
        .flatten()
        .next()
        .ok_or("the archive held no vocab files")?
        .path();
    let extracted = top.join("vendor/llama.cpp/models");
    if !has_vocabs(&extracted) {
        return Err(format!(
            "no ggml-vocab-*.gguf under {}",
            extracted.display()
        ));
    }
    let parent = models.parent().expect("models has a parent");
    std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    if let Err(e) = std::fs::rename(&extracted, models) {
        // Another run may have put it in place meanwhile.
        if !has_vocabs(models) {
            return Err(format!("rename into {}: {e}", models.display()));
        }
    }
    Ok(())
}

fn vocab_dir() -> Result<PathBuf, String> {
    let root = cache_root().ok_or("neither COLI_TEST_CACHE nor HOME is set")?;
    let models = root.join(CACHE_SUBDIR).join("models");
    if has_vocabs(&models) {
        return Ok(models);
    }
    eprintln!(
        "fetching llama.cpp vocab test files ({SDIST}) into {}",
        models.display()
    );
    fetch(&root, &models)?;
    Ok(models)
}

/// The cases of one vocab, parsed as llama.cpp's `test-tokenizer-0.cpp` does.
fn read_cases(gguf: &Path) -> Result<Vec<(String, Vec<u32>)>, String> {
    let inp_path = PathBuf::from(format!("{}.inp", gguf.display()));
    let out_path = PathBuf::from(format!("{}.out", gguf.display()));
    let inp =
        std::fs::read_to_string(&inp_path).map_err(|e| format!("{}: {e}", inp_path.display()))?;
    let out =
        std::fs::read_to_string(&out_path).map_err(|e| format!("{}: {e}", out_path.display()))?;
    let mut texts = Vec::new();
    let mut rest = inp.as_str();
    while !rest.is_empty() {
        match rest.find(SEPARATOR) {
            Some(i) => {
                texts.push(rest[..i].to_string());
                rest = &rest[i + SEPARATOR.len()..];
            }
            None => {
                texts.push(rest.to_string());
                break;
            }
        }
    }
    let ids: Vec<Vec<u32>> = out
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|t| {
                    t.parse::<u32>()
                        .map_err(|e| format!("{}: {t:?}: {e}", out_path.display()))
                })
                .collect::<Result<Vec<u32>, String>>()
        })
        .collect::<Result<_, _>>()?;
    if texts.len() != ids.len() {
        return Err(format!(
            "{} has {} cases but {} has {} lines",
            inp_path.display(),
            texts.len(),
            out_path.display(),
            ids.len()
        ));
    }
    Ok(texts.into_iter().zip(ids).collect())
}

enum Outcome {
    Passed {
        model: String,
        pre: String,
        cases: usize,
    },
    Failed {
        model: String,
        pre: String,
        passed: usize,
        cases: usize,
        report: String,
    },
    Skipped {
        model: String,
        pre: String,
        reason: String,
    },
}

/// A vocabulary that failed before any case ran.
fn failed_early(model: &str, pre: &str, report: String) -> Outcome {
    Outcome::Failed {
        model: model.into(),
        pre: pre.into(),
        passed: 0,
        cases: 0,
        report,
    }
}

fn run_vocab(path: &Path) -> Outcome {
    let gguf = match GgufFile::open(path) {
        Ok(g) => g,
        Err(e) => return failed_early("?", "?", format!("cannot open: {e}")),
    };
    let meta = |k: &str| gguf.get_str(k).ok().flatten().unwrap_or("-").to_string();
    let (model, pre) = (meta("tokenizer.ggml.model"), meta("tokenizer.ggml.pre"));
    let tok = match tokenizer_from_gguf(&gguf) {
        Ok(t) => t,
        Err(Error::Unsupported(m)) => {
            return Outcome::Skipped {
                model,
                pre,
                reason: m,
            }
        }
        Err(e) => return failed_early(&model, &pre, format!("cannot build the tokenizer: {e}")),
    };
    let cases = match read_cases(path) {
        Ok(c) => c,
        Err(e) => return failed_early(&model, &pre, e),
    };
    // parse_special = false: special-token text is plain text.
    let mut inner = tok.inner().clone();
    inner.set_encode_special_tokens(true);
    let mut report = String::new();
    let mut passed = 0;
    for (text, expected) in &cases {
        let got = match inner.encode(text.as_str(), false) {
            Ok(enc) => enc.get_ids().to_vec(),
            Err(e) => {
                let _ = writeln!(report, "  case {text:?}: encode error: {e}");
                continue;
            }
        };
        if &got != expected {
            let _ = writeln!(
                report,
                "  case {text:?}\n    expected {expected:?}\n    got      {got:?}"
            );
            continue;
        }
        match tok.decode(&got, false) {
            Ok(back) if &back == text => passed += 1,
            Ok(back) => {
                let _ = writeln!(
                    report,
                    "  case {text:?}: ids match but decode gives {back:?}"
                );
            }
            Err(e) => {
                let _ = writeln!(report, "  case {text:?}: decode error: {e}");
            }
        }
    }
    if passed == cases.len() {
        Outcome::Passed {
            model,
            pre,
            cases: cases.len(),
        }
    } else {
        Outcome::Failed {
            model,
            pre,
            passed,
            cases: cases.len(),
            report,
        }
    }
}

#[test]
fn llama_cpp_vocab_vectors() {
    let dir = match vocab_dir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: llama.cpp vocab test files unavailable: {e}");
            return;
        }
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("ggml-vocab-")
                && name.ends_with(".gguf")
                && PathBuf::from(format!("{}.inp", p.display())).exists()
                && PathBuf::from(format!("{}.out", p.display())).exists()
        })
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "no vocab files with cases in {}",
        dir.display()
    );

    let mut table = String::new();
    let mut failures = String::new();
    let mut passing = Vec::new();
    for path in &files {
        let file = path.file_name().unwrap().to_string_lossy();
        let name = file
            .trim_start_matches("ggml-vocab-")
            .trim_end_matches(".gguf")
            .to_string();
        match run_vocab(path) {
            Outcome::Passed { model, pre, cases } => {
                let _ = writeln!(table, "{name:<16} {model:<8} {pre:<16} {cases}/{cases}");
                passing.push(name);
            }
            Outcome::Failed {
                model,
                pre,
                passed,
                cases,
                report,
            } => {
                let _ = writeln!(
                    table,
                    "{name:<16} {model:<8} {pre:<16} {passed}/{cases} FAILED"
                );
                let _ = writeln!(failures, "{name} ({model}, {pre}):\n{report}");
            }
            Outcome::Skipped { model, pre, reason } => {
                let _ = writeln!(table, "{name:<16} {model:<8} {pre:<16} skipped: {reason}");
            }
        }
    }
    eprintln!("vocab            model    pre              cases\n{table}");
    assert!(
        failures.is_empty(),
        "supported vocabularies mismatch llama.cpp:\n{failures}"
    );
    assert_eq!(
        passing, EXPECTED_PASSING,
        "the vocabularies passing every case changed"
    );
}
