//! The engine's modules depend only downwards: tensor → format → store → model → runtime, with
//! the converter (`convert`) beside `runtime` at the top (ARCHITECTURE.md, "Layering"). This test reads every source file of each module and fails
//! on a path into a module above it (`crate::model::…`, `use crate::{runtime, …}`,
//! `super::super::…` that climbs out of the module), so a shortcut cannot creep in.

use std::path::{Path, PathBuf};

/// The layers, lowest first.
const LAYERS: &[&str] = &["tensor", "format", "store", "model", "runtime", "convert"];

/// A module's height; `runtime` and `convert` stand side by side on top.
fn rank(module: &str) -> Option<usize> {
    let r = LAYERS.iter().position(|m| *m == module)?;
    Some(r.min(4))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The code of a line, without a `//` comment (string literals are rare enough in paths that
/// a `//` inside one only hides the rest of that line).
fn code_of(line: &str) -> &str {
    match line.find("//") {
        Some(i) => &line[..i],
        None => line,
    }
}

/// The top-level engine modules a piece of code names through `crate::`: `crate::model::x`,
/// and the members of a `use crate::{model::x, runtime}` group.
fn crate_modules(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        // Not `colibri_crate::` or `some_crate::`: `crate` must start a path.
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            // The members at the group's top level: `{format::{a, b}, model}` names both.
            let mut depth = 0;
            let mut start = true;
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && (c.is_alphanumeric() || c == '_') => {
                        found.push(String::new());
                        start = false;
                        found.last_mut().unwrap().push(c);
                    }
                    c if !start
                        && depth == 0
                        && (c.is_alphanumeric() || c == '_')
                        && found.last().is_some_and(|m| !m.contains(':')) =>
                    {
                        found.last_mut().unwrap().push(c)
                    }
                    ':' if depth == 0 && !start => {
                        if let Some(m) = found.last_mut() {
                            m.push(':');
                        }
                    }
                    _ => {}
                }
            }
            for m in found.iter_mut() {
                if let Some(i) = m.find(':') {
                    m.truncate(i);
                }
            }
        } else {
            found.push(
                rest.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect(),
            );
        }
    }
    found
}

/// Every `(file, line, module used)` where a module uses one above it.
fn upward_uses(src: &Path) -> Vec<String> {
    let mut bad = Vec::new();
    for module in LAYERS {
        let mut files = Vec::new();
        let dir = src.join(module);
        if dir.is_dir() {
            rust_files(&dir, &mut files);
        }
        let single = src.join(format!("{module}.rs"));
        if single.is_file() {
            files.push(single);
        }
        let own = rank(module).unwrap();
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            // Climbing out of the module with `super::` from its top file is an upward path too.
            let depth = file
                .strip_prefix(src.join(module))
                .map(|p| p.components().count())
                .unwrap_or(0);
            for (n, line) in text.lines().enumerate() {
                let code = code_of(line);
                let mut used = crate_modules(code);
                // `super::` out of `m/x.rs` climbs two levels, out of `m/mod.rs` one.
                let is_mod = file.file_name().is_some_and(|n| n == "mod.rs");
                let climbs = "super::".repeat(if is_mod { depth } else { depth + 1 });
                if code.contains(&climbs) {
                    if let Some(i) = code.find(&climbs) {
                        used.push(
                            code[i + climbs.len()..]
                                .chars()
                                .take_while(|c| c.is_alphanumeric() || *c == '_')
                                .collect(),
                        );
                    }
                }
                for m in used {
                    if rank(&m).is_some_and(|r| r > own) {
                        bad.push(format!(
                            "{}:{}: `{module}` uses `{m}`, which is above it: {}",
                            file.display(),
                            n + 1,
                            line.trim()
                        ));
                    }
                }
            }
        }
    }
    bad
}

#[test]
fn no_module_imports_one_above_it() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let bad = upward_uses(&src);
    assert!(
        bad.is_empty(),
        "the layering tensor → format → store → model → runtime is broken:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_checker_sees_upward_paths() {
    // The checker itself must be able to fail: each of these forms names `model`.
    for code in [
        "use crate::model::mla::MlaForm;",
        "pub mla_form: crate::model::mla::MlaForm,",
        "use crate::{format, model::cache::KvDType};",
        "use crate::{format::{a, b}, model};",
        "let r = crate::model::layers::Rope::new(&p, 8);",
    ] {
        assert!(
            crate_modules(code).iter().any(|m| m == "model"),
            "missed in {code}"
        );
    }
    assert!(crate_modules("use colibri_crate::model::x;").is_empty());
    // And on a real tree: a store file that reaches into model is reported.
    let dir = std::env::temp_dir().join(format!("coli-layering-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("store")).unwrap();
    std::fs::write(
        dir.join("store/mod.rs"),
        "// crate::model in a comment is fine\nuse crate::tensor::Tensor;\npub struct S { f: crate::model::cache::KvDType }\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.join("format")).unwrap();
    std::fs::write(
        dir.join("format/x.rs"),
        "use super::super::runtime::Thing;\n",
    )
    .unwrap();
    let bad = upward_uses(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(bad.len(), 2, "{bad:#?}");
    assert!(bad[0].contains("`format` uses `runtime`"), "{bad:#?}");
    assert!(bad[1].contains("store/mod.rs:3"), "{bad:#?}");
}
