//! Output never changes under a refactor: `scripts/logits-checksums.sh` hashes what this `coli`
//! computes on every committed fixture of a supported family (teacher-forced logits, memory-mapped
//! and streamed; the GGUF conversion's bytes and its logits), and the hashes must equal the ones
//! recorded in `tests/fixtures/logits.sha256` with the `coli` of the commit before issue 14's
//! restructure. A single changed bit in any logit, or in a converted file, fails this test.

use std::path::Path;
use std::process::Command;

#[test]
fn every_fixture_computes_what_it_computed_before_the_restructure() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("scripts/logits-checksums.sh"))
        .arg(env!("CARGO_BIN_EXE_coli"))
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "the checksum script failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let now = String::from_utf8(out.stdout).unwrap();
    let recorded =
        std::fs::read_to_string(root.join("server/tests/fixtures/logits.sha256")).unwrap();
    let lines = |s: &str| s.lines().map(str::to_string).collect::<Vec<_>>();
    let (now, recorded) = (lines(&now), lines(&recorded));
    assert!(recorded.len() >= 50, "the recorded list is incomplete");
    let changed: Vec<String> = recorded
        .iter()
        .filter(|l| !now.contains(l))
        .map(|l| format!("recorded: {l}"))
        .chain(
            now.iter()
                .filter(|l| !recorded.contains(l))
                .map(|l| format!("now:      {l}")),
        )
        .collect();
    assert!(
        changed.is_empty(),
        "outputs differ from the recorded ones:\n{}",
        changed.join("\n")
    );
}
