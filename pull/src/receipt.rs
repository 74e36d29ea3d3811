//! The receipt `coli pull` keeps in the target directory (`coli-pull.json`): which repository,
//! revision and commit the files came from, and each file's size and SHA-256. It is rewritten
//! atomically after every file that lands, with `complete: false`, so an interrupted pull knows
//! on its next run which files are already verified; the last write says `complete: true`. A
//! complete receipt for the same repository, revision and patterns makes a rerun (the Helm
//! chart's init container at every pod start) return at once without asking the Hub.
//! `coli doctor --deep` can check the directory's bytes against it.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// The receipt's format version.
pub const FORMAT: u32 = 1;

/// What a pull fetched into a directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    /// [`FORMAT`].
    pub format: u32,
    /// The Hub endpoint the files came from.
    pub endpoint: String,
    /// `ORG/NAME`.
    pub repo: String,
    /// The revision asked for (`main`, a tag, a commit).
    pub revision: String,
    /// The commit it named when the pull started; every file is from it.
    pub commit: String,
    /// The `--include` patterns (empty: the default selection).
    pub include: Vec<String>,
    /// Whether every selected file is in place and verified.
    pub complete: bool,
    /// The files in place, by path.
    pub files: Vec<ReceiptFile>,
}

/// One file of a [`Receipt`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiptFile {
    /// Its path below the directory (`/`-separated).
    pub path: String,
    /// Its size in bytes.
    pub size: u64,
    /// The SHA-256 of its bytes. For an LFS file this is the Hub's own hash, which the bytes
    /// were verified against; for a small file kept in git it was computed here.
    pub sha256: String,
    /// For a file kept in git (not LFS): its git blob id, which the bytes were verified
    /// against. `None` for LFS files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git_oid: Option<String>,
}

impl Receipt {
    /// The entry of `path`, if any.
    pub fn file(&self, path: &str) -> Option<&ReceiptFile> {
        self.files.iter().find(|f| f.path == path)
    }

    /// Write it to `dir`'s receipt atomically.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let path = dir.join(crate::RECEIPT);
        let mut text = serde_json::to_string_pretty(self).expect("a receipt serializes");
        text.push('\n');
        colibri::format::write::write_atomic(&path, text.as_bytes())
            .with_context(|| format!("writing the receipt {}", path.display()))
    }
}

/// The receipt in `dir`, if there is one; an error names the file when it cannot be read.
pub fn read_receipt(dir: &Path) -> Result<Option<Receipt>> {
    let path = dir.join(crate::RECEIPT);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    if text.len() > 64 << 20 {
        bail!(
            "{}: larger than 64 MiB; not a receipt of coli pull",
            path.display()
        );
    }
    let receipt: Receipt = serde_json::from_slice(&text).with_context(|| {
        format!(
            "{} is not a receipt of coli pull: remove it (the next pull re-checks every file)",
            path.display()
        )
    })?;
    if receipt.format != FORMAT {
        bail!(
            "{}: receipt format {} (this coli reads {FORMAT}); remove it to pull again",
            path.display(),
            receipt.format
        );
    }
    Ok(Some(receipt))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_receipt(dir.path()).unwrap(), None);
        let r = Receipt {
            format: FORMAT,
            endpoint: "http://127.0.0.1:1".into(),
            repo: "a/b".into(),
            revision: "main".into(),
            commit: "c".repeat(40),
            include: vec![],
            complete: true,
            files: vec![ReceiptFile {
                path: "config.json".into(),
                size: 2,
                sha256: "4".repeat(64),
                git_oid: Some("5".repeat(40)),
            }],
        };
        r.save(dir.path()).unwrap();
        assert_eq!(read_receipt(dir.path()).unwrap(), Some(r));
        std::fs::write(dir.path().join(crate::RECEIPT), "{\"format\": 1}").unwrap();
        let e = format!("{:#}", read_receipt(dir.path()).unwrap_err());
        assert!(
            e.contains("coli-pull.json") && e.contains("remove it"),
            "{e}"
        );
    }
}
