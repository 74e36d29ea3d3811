//! What the fuzz targets share: a scratch directory for the readers that take a path, the
//! repository's fixtures (checkpoints, tokenizers, chat templates), cutting a text into
//! pieces where the input says, and the panic hook for targets whose code under test catches
//! panics on purpose.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The repository's root (the fuzz crate sits in `fuzz/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("fuzz/ has a parent")
        .to_path_buf()
}

/// The engine's oracle fixtures: one small Hugging Face directory per family.
pub fn fixtures() -> PathBuf {
    repo_root().join("engine/tests/fixtures")
}

/// The real chat templates committed as test data, sorted by name.
pub fn chat_templates() -> &'static [(String, String)] {
    static TEMPLATES: OnceLock<Vec<(String, String)>> = OnceLock::new();
    TEMPLATES.get_or_init(|| {
        let dir = repo_root().join("server/tests/fixtures/chat_templates");
        let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
            .expect("server/tests/fixtures/chat_templates")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
            .map(|p| {
                let source = std::fs::read_to_string(&p).expect("a chat template");
                (p.display().to_string(), source)
            })
            .collect();
        out.sort();
        out
    })
}

/// An empty directory of this process's own under `$TMPDIR` (`fuzz/run.sh` points `TMPDIR`
/// at a directory it removes afterwards), emptied on every call.
pub fn scratch(name: &str) -> PathBuf {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    let root = ROOT.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("colibri-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&root).expect("the scratch directory");
        root
    });
    let dir = root.join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// Cut `text` into pieces at char boundaries chosen by `cuts`: each byte is the length (in
/// chars, 1-8) of the next piece, cycling; no cuts means one char at a time.
pub fn pieces<'a>(text: &'a str, cuts: &[u8]) -> Vec<&'a str> {
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .collect();
    let mut out = Vec::new();
    let (mut at, mut k) = (0, 0);
    while at + 1 < bounds.len() {
        let step = cuts
            .get(k % cuts.len().max(1))
            .map_or(1, |c| 1 + (*c as usize % 8));
        let next = (at + step).min(bounds.len() - 1);
        out.push(&text[bounds[at]..bounds[next]]);
        at = next;
        k += 1;
    }
    out
}

/// Put back the standard panic hook in place of libFuzzer's, which aborts on every panic,
/// even one the code under test catches on purpose (the tokenizers crate's panics, which
/// `Tokenizer::from_file` turns into errors; llguidance's, on its compile thread). A panic
/// nobody catches still aborts: libfuzzer-sys runs each input under `catch_unwind` and aborts
/// when it unwinds out.
pub fn catching_panics() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let _ = std::panic::take_hook();
        std::panic::set_hook(Box::new(|info| eprintln!("caught panic: {info}")));
    });
}
