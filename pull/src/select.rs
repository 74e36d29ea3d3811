//! Which files of a commit `coli pull` fetches: those matching `--include` patterns (globs as
//! `hf download --include` reads them: `*` also matches `/`, a pattern ending in `/` takes the
//! whole folder), or by default what `coli serve` reads from a Hugging Face directory — the
//! configs, the tokenizer and chat template files and the safetensors weights with their index,
//! top-level only — or the one GGUF file of a repository that has no safetensors. Also the
//! check that every path the Hub names stays inside the target directory.

use anyhow::{anyhow, bail, Result};
use globset::{GlobBuilder, GlobSetBuilder};

use crate::hub::RemoteFile;
use crate::{RECEIPT, STAGING};

/// Top-level files fetched by default besides the weights: what the model loader, tokenizer and
/// chat template read.
pub const DEFAULT_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];

/// The files of `files` to fetch: `include` matched, or the default selection.
pub fn select(files: &[RemoteFile], include: &[String], what: &str) -> Result<Vec<RemoteFile>> {
    let chosen = if include.is_empty() {
        default_selection(files, what)?
    } else {
        let mut set = GlobSetBuilder::new();
        for pattern in include {
            // `hf download`'s rule: a folder pattern takes what is inside.
            let pattern = if pattern.ends_with('/') {
                format!("{pattern}*")
            } else {
                pattern.clone()
            };
            let glob = GlobBuilder::new(&pattern)
                .literal_separator(false)
                .build()
                .map_err(|e| anyhow!("--include {pattern:?}: {e}"))?;
            set.add(glob);
        }
        let set = set.build()?;
        let mut hit = vec![false; include.len()];
        let mut chosen = Vec::new();
        for f in files {
            let matches = set.matches(&f.path);
            for &i in &matches {
                hit[i] = true;
            }
            if !matches.is_empty() {
                chosen.push(f.clone());
            }
        }
        if let Some(i) = hit.iter().position(|h| !h) {
            bail!(
                "--include {:?} matches no file of {what}; its files: {}",
                include[i],
                listing(files.iter().map(|f| f.path.as_str()))
            );
        }
        chosen
    };
    for f in &chosen {
        check_path(&f.path)?;
    }
    Ok(chosen)
}

/// What `coli serve` needs from a Hugging Face directory, or the repository's only GGUF file.
fn default_selection(files: &[RemoteFile], what: &str) -> Result<Vec<RemoteFile>> {
    let top: Vec<&RemoteFile> = files.iter().filter(|f| !f.path.contains('/')).collect();
    let has_index = top
        .iter()
        .any(|f| f.path.ends_with(".safetensors.index.json"));
    let weights = |f: &&RemoteFile| {
        f.path.ends_with(".safetensors")
            // Mistral's repositories carry the same weights twice: the Hugging Face shards an
            // index names, and `consolidated.safetensors` for mistral-inference.
            && !(has_index && f.path.starts_with("consolidated"))
    };
    if top.iter().any(weights) {
        return Ok(top
            .into_iter()
            .filter(|f| {
                weights(f)
                    || f.path.ends_with(".safetensors.index.json")
                    || DEFAULT_FILES.contains(&f.path.as_str())
            })
            .cloned()
            .collect());
    }
    let ggufs: Vec<&RemoteFile> = files.iter().filter(|f| f.path.ends_with(".gguf")).collect();
    match ggufs.as_slice() {
        [one] => Ok(vec![(*one).clone()]),
        [] => bail!(
            "{what} has no safetensors weights at its top level and no GGUF file; name the files \
             to fetch with --include; its files: {}",
            listing(files.iter().map(|f| f.path.as_str()))
        ),
        many => bail!(
            "{what} has no safetensors weights but {} GGUF files: name the one to fetch with \
             --include, e.g. --include '{}'; they are: {}",
            many.len(),
            many[0].path,
            listing(many.iter().map(|f| f.path.as_str()))
        ),
    }
}

/// At most 30 names, comma-separated.
fn listing<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.collect();
    let mut s = names
        .iter()
        .take(30)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > 30 {
        s.push_str(&format!(", … ({} in all)", names.len()));
    }
    if s.is_empty() {
        s.push_str("(none)");
    }
    s
}

/// A path from the Hub must name a file inside the target directory: relative, no `.`, `..` or
/// empty components, no backslashes or control characters, and not the pull's own receipt or
/// staging folder.
pub fn check_path(path: &str) -> Result<()> {
    let bad = path.is_empty()
        || path.len() > 4096
        || path.starts_with('/')
        || path.contains('\\')
        || path.chars().any(char::is_control)
        || path
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
        || path == RECEIPT
        || path.split('/').next() == Some(STAGING);
    if bad {
        bail!("the Hub names a file {path:?}, which is not a safe relative path: refusing to write it");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::Check;

    fn files(paths: &[&str]) -> Vec<RemoteFile> {
        paths
            .iter()
            .map(|p| RemoteFile {
                path: p.to_string(),
                size: 1,
                check: Check::GitBlob("0".repeat(40)),
            })
            .collect()
    }

    fn paths(v: Vec<RemoteFile>) -> Vec<String> {
        v.into_iter().map(|f| f.path).collect()
    }

    #[test]
    fn default_is_what_serve_reads() {
        let repo = files(&[
            ".gitattributes",
            "README.md",
            "config.json",
            "consolidated.safetensors",
            "generation_config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
            "original/model.safetensors",
            "params.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]);
        assert_eq!(
            paths(select(&repo, &[], "r").unwrap()),
            [
                "config.json",
                "generation_config.json",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "model.safetensors.index.json",
                "tokenizer.json",
                "tokenizer_config.json"
            ]
        );
    }

    #[test]
    fn gguf_repositories() {
        let one = files(&["README.md", "m-Q4_K_M.gguf"]);
        assert_eq!(paths(select(&one, &[], "r").unwrap()), ["m-Q4_K_M.gguf"]);
        let many = files(&["m-Q4_K_M.gguf", "m-Q8_0.gguf"]);
        let e = select(&many, &[], "r").unwrap_err().to_string();
        assert!(e.contains("--include") && e.contains("m-Q8_0.gguf"), "{e}");
        let picked = select(&many, &["*Q8_0.gguf".into()], "r").unwrap();
        assert_eq!(paths(picked), ["m-Q8_0.gguf"]);
        assert!(select(&files(&["README.md"]), &[], "r").is_err());
    }

    #[test]
    fn include_patterns() {
        let repo = files(&["a.json", "sub/b.json", "sub/c.bin", "d.bin"]);
        assert_eq!(
            paths(select(&repo, &["*.json".into()], "r").unwrap()),
            ["a.json", "sub/b.json"]
        );
        assert_eq!(
            paths(select(&repo, &["sub/".into()], "r").unwrap()),
            ["sub/b.json", "sub/c.bin"]
        );
        let e = select(&repo, &["*.json".into(), "*.gguf".into()], "r")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"*.gguf\" matches no file"), "{e}");
        assert!(select(&repo, &["[".into()], "r").is_err());
    }

    #[test]
    fn unsafe_paths_are_refused() {
        for p in [
            "../x",
            "a/../../x",
            "/etc/passwd",
            "a//b",
            "./a",
            "a\\b",
            RECEIPT,
            ".coli-pull/x",
            "",
        ] {
            assert!(check_path(p).is_err(), "{p:?} accepted");
        }
        check_path("sub/dir/model.safetensors").unwrap();
    }
}
