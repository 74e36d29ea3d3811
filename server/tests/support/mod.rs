//! Helpers shared by the `coli` binary's integration tests: the committed engine fixtures and
//! a `coli` command that never touches the user's cache or state directories.
#![allow(dead_code)] // each test binary uses a different subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The committed transformers fixture `name` (engine/tests/fixtures).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../engine/tests/fixtures")
        .join(name)
}

/// The fixture's `reference.json`.
pub fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

/// Point a command's cache and state directories at test-only places under the temp dir.
pub fn isolated(cmd: &mut Command) -> &mut Command {
    cmd.env(
        "COLI_CACHE_DIR",
        std::env::temp_dir().join("coli-test-cache-unused"),
    )
    .env(
        "COLI_STATE_DIR",
        std::env::temp_dir().join("coli-test-state"),
    )
}

/// `coli ARGS`, run to completion.
pub fn coli(args: &[&str]) -> Output {
    isolated(Command::new(env!("CARGO_BIN_EXE_coli")).args(args))
        .output()
        .expect("coli runs")
}
