//! Expert usage history, the memory behind "learned pins".
//!
//! This module owns three things:
//! - [`fingerprint`]: a stable identity for a checkpoint, computed from `config.json` and the
//!   safetensors headers without reading any weights, so the same model copied elsewhere keeps
//!   its history and any change to its config or tensor layout starts a fresh one;
//! - [`state_dir`]: where colibri keeps state that outlives a run (never the model directory);
//! - [`UsageHistory`]: per model, a decayed count of how often each routed expert was chosen,
//!   saved as `<state dir>/usage/<fingerprint>.json`. At start the engine loads it and pins the
//!   [`hottest`](UsageHistory::hottest) experts that fit a pin budget; while running it
//!   [`record`](UsageHistory::record)s each token's routing and
//!   [`save`](UsageHistory::save)s it — the server periodically and whenever it goes idle
//!   (see `runtime::scheduler`), every command at its end —, which fades old history with a
//!   half-life of [`HALF_LIFE_TOKENS`] tokens. A save is atomic, so a process killed at any
//!   moment leaves the last complete save, and the temporaries of saves it was killed in
//!   are removed by the next [`load`](UsageHistory::load).
//!
//! A history is never a reason to stop a run: a missing file gives an empty history, and an
//! unreadable, corrupt or mis-shaped one gives an empty history plus a warning for the caller
//! to report. The type is not synchronised; callers sharing one wrap it in a `Mutex`, and take
//! a [`snapshot`](UsageHistory::snapshot) under it to write after releasing it.
//!
//! File format (version [`FORMAT_VERSION`]):
//! `{"version":1,"fingerprint":"…","tokens":123,"since_save":0,"updated":1700000000,
//! "layers":[[counts…],…]}` with one list of counts per layer (empty for layers without routed
//! experts), `tokens` the total tokens ever recorded, `since_save` the tokens recorded since the
//! counts were last decayed and `updated` the Unix time of the last save in seconds.

use std::ffi::OsString;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::error::read_file;
use crate::format::write::{remove_stale_temporaries, write_atomic};
use crate::{Error, Result};

/// Version of the usage file format written by [`UsageHistory::save`].
pub const FORMAT_VERSION: u32 = 1;

/// Tokens after which a recorded choice counts half as much.
pub const HALF_LIFE_TOKENS: f64 = 100_000.0;

/// Largest safetensors header [`fingerprint`] accepts (the safetensors format's own limit).
const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// FNV-1a, 64 bits: small, dependency-free and stable across platforms and releases (unlike
/// `std`'s `DefaultHasher`, whose output may change between Rust versions).
struct Fnv64(u64);

impl Fnv64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    fn new() -> Fnv64 {
        Fnv64(Self::OFFSET)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }

    /// A field preceded by its length, so that field boundaries cannot be shifted to produce
    /// the same byte stream from different inputs.
    fn field(&mut self, bytes: &[u8]) {
        self.bytes(&(bytes.len() as u64).to_le_bytes());
        self.bytes(bytes);
    }
}

/// A stable hex fingerprint (16 hex digits) of the checkpoint in `model_dir`.
///
/// Hashes `config.json`'s bytes and, for every regular `*.safetensors` file in the directory
/// (symbolic links followed, sorted by name), its name, its size and its header (the 8-byte
/// length and the JSON header it announces). Tensor data is never read, so this is cheap even
/// for a large model. The same checkpoint copied to another directory has the same
/// fingerprint; any change to the config or to a file's tensor layout changes it.
///
/// Errors when `config.json` or the directory cannot be read, or a safetensors file is too
/// short for the header it announces.
pub fn fingerprint(model_dir: &Path) -> Result<String> {
    let mut h = Fnv64::new();
    h.field(b"colibri-checkpoint-fingerprint-v1");
    if model_dir.is_file() {
        // A single-file checkpoint (GGUF): its size and the head of the file, which holds the
        // metadata and every tensor's description.
        let path = model_dir;
        let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
        let size = f.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut head = vec![0u8; size.min(8 << 20) as usize];
        f.read_exact(&mut head).map_err(|e| Error::io(path, e))?;
        h.field(&size.to_le_bytes());
        h.field(&head);
        return Ok(format!("{:016x}", h.0));
    }
    h.field(&read_file(&model_dir.join("config.json"))?);

    let entries = std::fs::read_dir(model_dir).map_err(|e| Error::io(model_dir, e))?;
    let mut files: Vec<(OsString, PathBuf)> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(model_dir, e))?;
        let path = entry.path();
        let is_safetensors = path.extension().is_some_and(|x| x == "safetensors");
        if is_safetensors && path.is_file() {
            files.push((entry.file_name(), path));
        }
    }
    files.sort();

    for (name, path) in &files {
        let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
        let size = f.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut len = [0u8; 8];
        f.read_exact(&mut len).map_err(|e| Error::io(path, e))?;
        let n = u64::from_le_bytes(len);
        if n > MAX_HEADER_BYTES || n > size - 8 {
            return Err(Error::corrupt(
                path,
                format!("safetensors header of {n} bytes does not fit a {size}-byte file"),
            ));
        }
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header).map_err(|e| Error::io(path, e))?;
        h.field(name.to_string_lossy().as_bytes());
        h.field(&size.to_le_bytes());
        h.field(&len);
        h.field(&header);
    }
    Ok(format!("{:016x}", h.0))
}

/// Where colibri keeps state between runs: `$COLI_STATE_DIR`, else `$XDG_STATE_HOME/colibri`,
/// else `$HOME/.local/state/colibri`; `None` when none of these is set. Empty variables count
/// as unset, and a relative `$XDG_STATE_HOME` is ignored, as the XDG specification asks.
pub fn state_dir() -> Option<PathBuf> {
    state_dir_from(|name| std::env::var_os(name))
}

/// [`state_dir`] with the environment given by `var`.
fn state_dir_from(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set("COLI_STATE_DIR") {
        return Some(dir);
    }
    if let Some(xdg) = set("XDG_STATE_HOME").filter(|p| p.is_absolute()) {
        return Some(xdg.join("colibri"));
    }
    set("HOME").map(|home| home.join(".local").join("state").join("colibri"))
}

/// The on-disk form of a [`UsageHistory`].
#[derive(Serialize, Deserialize)]
struct UsageFile {
    version: u32,
    fingerprint: String,
    tokens: u64,
    since_save: u64,
    #[serde(default)]
    updated: u64,
    layers: Vec<Vec<f64>>,
}

/// How often each routed expert of one model was chosen, with old choices fading.
///
/// Counts are kept per layer and expert as `f64`: [`record`](Self::record) adds 1 per choice,
/// and [`save`](Self::save) multiplies every count by `0.5^(tokens since last save /
/// HALF_LIFE_TOKENS)`, so a choice made `HALF_LIFE_TOKENS` tokens ago weighs half as much as
/// one made now.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageHistory {
    fingerprint: String,
    /// `counts[layer][expert]`; a layer without routed experts has an empty list.
    counts: Vec<Vec<f64>>,
    /// Tokens ever recorded for this model.
    tokens: u64,
    /// Tokens recorded since the counts were last decayed by [`save`](Self::save).
    since_save: u64,
    /// Unix time in seconds of the last save (0: never saved).
    updated: u64,
}

impl UsageHistory {
    /// An empty history for the model with fingerprint `fingerprint`, whose layer `l` has
    /// `experts_per_layer[l]` routed experts (0 for dense layers). The number of layers is
    /// `experts_per_layer.len()`.
    pub fn new(fingerprint: impl Into<String>, experts_per_layer: &[usize]) -> UsageHistory {
        UsageHistory {
            fingerprint: fingerprint.into(),
            counts: experts_per_layer.iter().map(|&n| vec![0.0; n]).collect(),
            tokens: 0,
            since_save: 0,
            updated: 0,
        }
    }

    /// The file holding the history of model `fingerprint` under state directory `dir`:
    /// `<dir>/usage/<fingerprint>.json`. Errors when the fingerprint is not a plain name
    /// (ASCII letters, digits, `-` and `_`), so it can never point outside `<dir>/usage`.
    pub fn path(dir: &Path, fingerprint: &str) -> Result<PathBuf> {
        let plain = !fingerprint.is_empty()
            && fingerprint
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !plain {
            return Err(Error::Invalid(format!(
                "usage history: fingerprint {fingerprint:?} is not a plain file name"
            )));
        }
        Ok(dir.join("usage").join(format!("{fingerprint}.json")))
    }

    /// Load the history of model `fingerprint` (shaped as in [`new`](Self::new)) from state
    /// directory `dir`, after removing the temporaries that processes killed while saving left
    /// in `<dir>/usage` (see [`remove_stale_temporaries`]).
    ///
    /// A missing file gives an empty history and no warning. A file that cannot be read, is
    /// not valid JSON, has another format version, names another fingerprint, holds negative
    /// or non-finite counts, or whose layers and expert counts differ from
    /// `experts_per_layer` gives an empty history and a warning saying why, for the caller to
    /// report. The only error is a fingerprint that is not a plain file name (see
    /// [`path`](Self::path)).
    pub fn load(
        dir: &Path,
        fingerprint: &str,
        experts_per_layer: &[usize],
    ) -> Result<(UsageHistory, Option<String>)> {
        let path = Self::path(dir, fingerprint)?;
        remove_stale_temporaries(&dir.join("usage"), |_| true);
        let empty = || UsageHistory::new(fingerprint, experts_per_layer);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((empty(), None)),
            Err(e) => return Ok((empty(), Some(ignored(&path, &e.to_string())))),
        };
        match Self::parse(&bytes, fingerprint, experts_per_layer) {
            Ok(h) => Ok((h, None)),
            Err(why) => Ok((empty(), Some(ignored(&path, &why)))),
        }
    }

    /// Parse and check a usage file's bytes; the error says why the file cannot be used.
    fn parse(
        bytes: &[u8],
        fingerprint: &str,
        experts_per_layer: &[usize],
    ) -> std::result::Result<UsageHistory, String> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("invalid JSON: {e}"))?;
        let version = value.get("version").and_then(|v| v.as_u64());
        if version != Some(u64::from(FORMAT_VERSION)) {
            return Err(format!(
                "format version {} (expected {FORMAT_VERSION})",
                value.get("version").unwrap_or(&serde_json::Value::Null)
            ));
        }
        let file: UsageFile =
            serde_json::from_value(value).map_err(|e| format!("unexpected structure: {e}"))?;
        if file.fingerprint != fingerprint {
            return Err(format!(
                "it is for model {:?}, not {fingerprint:?}",
                file.fingerprint
            ));
        }
        let shape: Vec<usize> = file.layers.iter().map(Vec::len).collect();
        if shape != experts_per_layer {
            return Err(format!(
                "it has {} layers with {shape:?} experts, the model has {} layers with \
                 {experts_per_layer:?} experts",
                shape.len(),
                experts_per_layer.len()
            ));
        }
        if let Some(c) = file
            .layers
            .iter()
            .flatten()
            .find(|c| !(c.is_finite() && **c >= 0.0))
        {
            return Err(format!(
                "it holds the count {c}, counts must be finite and >= 0"
            ));
        }
        Ok(UsageHistory {
            fingerprint: file.fingerprint,
            counts: file.layers,
            tokens: file.tokens,
            since_save: file.since_save,
            updated: file.updated,
        })
    }

    /// Count one choice of each of `experts` in `layer`; called per token per MoE layer with
    /// the experts the router selected. A layer or expert out of range is a caller bug: it
    /// panics in debug builds and is ignored in release builds.
    pub fn record(&mut self, layer: usize, experts: &[usize]) {
        let Some(row) = self.counts.get_mut(layer) else {
            debug_assert!(false, "usage history: layer {layer} out of range");
            return;
        };
        for &e in experts {
            match row.get_mut(e) {
                Some(c) => *c += 1.0,
                None => debug_assert!(false, "usage history: expert {e} of layer {layer}"),
            }
        }
    }

    /// Count one token; called once per token after its layers were recorded.
    pub fn end_step(&mut self) {
        self.tokens += 1;
        self.since_save += 1;
    }

    /// Multiply every count by `factor`, which is clamped into `[0, 1]` (NaN: no change).
    pub fn decay(&mut self, factor: f64) {
        let factor = if factor.is_nan() {
            1.0
        } else {
            factor.clamp(0.0, 1.0)
        };
        for c in self.counts.iter_mut().flatten() {
            *c *= factor;
        }
    }

    /// The decay [`save`](Self::save) applies after `tokens` tokens:
    /// `0.5^(tokens / HALF_LIFE_TOKENS)`.
    pub fn decay_factor(tokens: u64) -> f64 {
        0.5f64.powf(tokens as f64 / HALF_LIFE_TOKENS)
    }

    /// Decay the counts for the tokens seen since the last save (see
    /// [`decay_factor`](Self::decay_factor)) and write the history atomically (a temporary
    /// file renamed into place) to `<dir>/usage/<fingerprint>.json`, creating the directories:
    /// [`snapshot`](Self::snapshot) then [`PendingSave::write`].
    ///
    /// `dir` is the state directory (see [`state_dir`]); a directory holding a `config.json`
    /// looks like a model directory and is refused, as history is never written beside the
    /// weights. If writing fails, what was learned stays in memory (decayed for the tokens
    /// seen, as time passed either way) and the next save writes it.
    pub fn save(&mut self, dir: &Path) -> Result<()> {
        self.snapshot(dir)?.write()
    }

    /// The first, quick half of [`save`](Self::save), for a caller that holds the history
    /// under a lock the engine also takes: decay the counts for the tokens seen since the last
    /// save and copy the history out, to be written by [`PendingSave::write`] after the lock
    /// is released. Errors only when the fingerprint is not a plain name (see
    /// [`path`](Self::path)).
    pub fn snapshot(&mut self, dir: &Path) -> Result<PendingSave> {
        let path = Self::path(dir, &self.fingerprint)?;
        let factor = Self::decay_factor(self.since_save);
        for c in self.counts.iter_mut().flatten() {
            *c *= factor;
        }
        self.since_save = 0;
        self.updated = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Ok(PendingSave {
            dir: dir.to_path_buf(),
            path,
            file: UsageFile {
                version: FORMAT_VERSION,
                fingerprint: self.fingerprint.clone(),
                tokens: self.tokens,
                since_save: 0,
                updated: self.updated,
                layers: self.counts.clone(),
            },
        })
    }

    /// The experts to pin: all experts with a count above zero, hottest first (ties: lower
    /// layer, then lower expert id), each taken if its `expert_bytes(layer, expert)` still fits
    /// in what is left of `budget` and skipped otherwise (a smaller, colder expert may still
    /// fit after it). Returns `(layer, expert)` pairs in that order.
    pub fn hottest(
        &self,
        expert_bytes: impl Fn(usize, usize) -> u64,
        budget: u64,
    ) -> Vec<(usize, usize)> {
        let mut ranked: Vec<(f64, usize, usize)> = self
            .counts
            .iter()
            .enumerate()
            .flat_map(|(l, row)| row.iter().enumerate().map(move |(e, &c)| (c, l, e)))
            .filter(|&(c, _, _)| c > 0.0)
            .collect();
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut left = budget;
        let mut chosen = Vec::new();
        for (_, l, e) in ranked {
            let bytes = expert_bytes(l, e);
            if bytes <= left {
                left -= bytes;
                chosen.push((l, e));
            }
        }
        chosen
    }

    /// The model fingerprint this history belongs to.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Routed experts per layer, as given to [`new`](Self::new).
    pub fn experts_per_layer(&self) -> Vec<usize> {
        self.counts.iter().map(Vec::len).collect()
    }

    /// The decayed count of `expert` in `layer` (0 when out of range).
    pub fn count(&self, layer: usize, expert: usize) -> f64 {
        self.counts
            .get(layer)
            .and_then(|row| row.get(expert))
            .copied()
            .unwrap_or(0.0)
    }

    /// Tokens ever recorded for this model.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Tokens recorded since the last save.
    pub fn since_save(&self) -> u64 {
        self.since_save
    }

    /// Unix time in seconds of the last save (0: never saved).
    pub fn updated(&self) -> u64 {
        self.updated
    }

    /// Whether nothing was ever recorded (every count is zero).
    pub fn is_empty(&self) -> bool {
        self.counts.iter().flatten().all(|&c| c == 0.0)
    }
}

/// A history copied out by [`UsageHistory::snapshot`], not yet written.
pub struct PendingSave {
    /// The state directory.
    dir: PathBuf,
    /// `<dir>/usage/<fingerprint>.json`.
    path: PathBuf,
    file: UsageFile,
}

impl PendingSave {
    /// The file it will be written to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Write it atomically, creating the directories; refuses a state directory that looks
    /// like a model directory (see [`UsageHistory::save`]). Saves of one history must be
    /// written in the order they were taken, so that an older one never replaces a newer one.
    pub fn write(self) -> Result<()> {
        let dir = &self.dir;
        if dir.join("config.json").exists() {
            return Err(Error::Invalid(format!(
                "{}: refusing to write usage history into what looks like a model directory \
                 (it holds a config.json); use a state directory such as $COLI_STATE_DIR",
                dir.display()
            )));
        }
        let bytes = serde_json::to_vec(&self.file)
            .map_err(|e| Error::Invalid(format!("usage history: cannot serialise: {e}")))?;
        let parent = self.path.parent().unwrap_or(dir);
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        write_atomic(&self.path, &bytes)
    }
}

/// The warning for a usage file that is ignored.
fn ignored(path: &Path, why: &str) -> String {
    format!(
        "{}: ignoring the expert usage history ({why}); starting a new one",
        path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny safetensors file whose header is `header` followed by `data` bytes.
    fn write_safetensors(path: &Path, header: &str, data: usize) {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend(std::iter::repeat_n(7u8, data));
        std::fs::write(path, bytes).unwrap();
    }

    const HEADER_A: &str = r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
    const HEADER_B: &str = r#"{"v":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;

    fn fake_model(dir: &Path) {
        std::fs::write(dir.join("config.json"), br#"{"model_type":"x"}"#).unwrap();
        write_safetensors(&dir.join("model-00001-of-00002.safetensors"), HEADER_A, 16);
        write_safetensors(&dir.join("model-00002-of-00002.safetensors"), HEADER_B, 16);
        std::fs::write(dir.join("README.md"), b"not hashed").unwrap();
    }

    #[test]
    fn fnv_matches_reference_vectors() {
        let mut h = Fnv64::new();
        h.bytes(b"");
        assert_eq!(h.0, 0xcbf2_9ce4_8422_2325);
        let mut h = Fnv64::new();
        h.bytes(b"a");
        assert_eq!(h.0, 0xaf63_dc4c_8601_ec8c);
        let mut h = Fnv64::new();
        h.bytes(b"foobar");
        assert_eq!(h.0, 0x8594_4171_f739_67e8);
    }

    #[test]
    fn fingerprint_is_stable_across_copies_and_ignores_weights_and_other_files() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        fake_model(a.path());
        fake_model(b.path());
        let fa = fingerprint(a.path()).unwrap();
        assert_eq!(fa.len(), 16);
        assert!(fa.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(fa, fingerprint(b.path()).unwrap());
        assert_eq!(fa, fingerprint(a.path()).unwrap());
        // Other files and weight bytes (same size) are not part of the identity.
        std::fs::write(b.path().join("README.md"), b"changed").unwrap();
        let shard = b.path().join("model-00002-of-00002.safetensors");
        let mut bytes = std::fs::read(&shard).unwrap();
        let n = bytes.len();
        bytes[n - 16..].fill(9);
        std::fs::write(&shard, bytes).unwrap();
        assert_eq!(fa, fingerprint(b.path()).unwrap());
    }

    #[test]
    fn fingerprint_changes_with_config_header_size_or_name() {
        let dir = tempfile::tempdir().unwrap();
        fake_model(dir.path());
        let base = fingerprint(dir.path()).unwrap();

        std::fs::write(dir.path().join("config.json"), br#"{"model_type":"y"}"#).unwrap();
        assert_ne!(base, fingerprint(dir.path()).unwrap());
        fake_model(dir.path());
        assert_eq!(base, fingerprint(dir.path()).unwrap());

        // Same header length, one byte of the shape changed.
        let changed = HEADER_A.replace("[2,2]", "[1,4]");
        assert_eq!(changed.len(), HEADER_A.len());
        write_safetensors(
            &dir.path().join("model-00001-of-00002.safetensors"),
            &changed,
            16,
        );
        assert_ne!(base, fingerprint(dir.path()).unwrap());
        fake_model(dir.path());

        write_safetensors(
            &dir.path().join("model-00001-of-00002.safetensors"),
            HEADER_A,
            32,
        );
        assert_ne!(base, fingerprint(dir.path()).unwrap());
        fake_model(dir.path());

        std::fs::rename(
            dir.path().join("model-00002-of-00002.safetensors"),
            dir.path().join("other.safetensors"),
        )
        .unwrap();
        assert_ne!(base, fingerprint(dir.path()).unwrap());
    }

    #[test]
    fn fingerprint_errors_on_missing_config_or_bad_header() {
        let dir = tempfile::tempdir().unwrap();
        assert!(fingerprint(dir.path()).is_err());
        fake_model(dir.path());
        let mut bytes = 1000u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        std::fs::write(dir.path().join("bad.safetensors"), bytes).unwrap();
        let err = fingerprint(dir.path()).unwrap_err().to_string();
        assert!(err.contains("bad.safetensors"), "{err}");
        std::fs::write(dir.path().join("bad.safetensors"), b"abc").unwrap();
        assert!(fingerprint(dir.path()).is_err());
    }

    #[test]
    fn state_dir_precedence() {
        fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
            move |name| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            }
        }
        let all = [
            ("COLI_STATE_DIR", "/s"),
            ("XDG_STATE_HOME", "/x"),
            ("HOME", "/h"),
        ];
        assert_eq!(state_dir_from(env(&all)), Some(PathBuf::from("/s")));
        assert_eq!(
            state_dir_from(env(&[("COLI_STATE_DIR", ""), ("XDG_STATE_HOME", "/x")])),
            Some(PathBuf::from("/x/colibri"))
        );
        assert_eq!(
            state_dir_from(env(&[("XDG_STATE_HOME", "rel"), ("HOME", "/h")])),
            Some(PathBuf::from("/h/.local/state/colibri"))
        );
        assert_eq!(state_dir_from(env(&[("HOME", "")])), None);
    }

    fn history() -> UsageHistory {
        let mut h = UsageHistory::new("abc123", &[0, 4, 3]);
        h.record(1, &[0, 2]);
        h.end_step();
        h.record(1, &[2, 3]);
        h.record(2, &[1]);
        h.end_step();
        h
    }

    #[test]
    fn record_counts_choices_and_tokens() {
        let h = history();
        assert_eq!(h.tokens(), 2);
        assert_eq!(h.since_save(), 2);
        assert_eq!(h.count(1, 0), 1.0);
        assert_eq!(h.count(1, 1), 0.0);
        assert_eq!(h.count(1, 2), 2.0);
        assert_eq!(h.count(1, 3), 1.0);
        assert_eq!(h.count(2, 1), 1.0);
        assert_eq!(h.count(0, 0), 0.0);
        assert!(!h.is_empty());
        assert_eq!(h.experts_per_layer(), vec![0, 4, 3]);
    }

    #[test]
    fn decay_multiplies_and_clamps() {
        let mut h = history();
        h.decay(0.25);
        assert_eq!(h.count(1, 2), 0.5);
        h.decay(f64::NAN);
        assert_eq!(h.count(1, 2), 0.5);
        h.decay(3.0);
        assert_eq!(h.count(1, 2), 0.5);
        h.decay(-1.0);
        assert!(h.is_empty());
    }

    #[test]
    fn save_load_round_trip_with_half_life_decay() {
        let state = tempfile::tempdir().unwrap();
        let mut h = UsageHistory::new("abc123", &[0, 4, 3]);
        h.record(1, &[2]);
        h.record(1, &[2]);
        h.record(2, &[0]);
        // Exactly one half-life of tokens, then half of another.
        for _ in 0..100_000 {
            h.end_step();
        }
        h.save(state.path()).unwrap();
        assert_eq!(h.count(1, 2), 1.0); // 2 * 0.5
        assert_eq!(h.count(2, 0), 0.5);
        assert_eq!(h.since_save(), 0);
        assert!(h.updated() > 0);

        let (loaded, warning) = UsageHistory::load(state.path(), "abc123", &[0, 4, 3]).unwrap();
        assert_eq!(warning, None);
        assert_eq!(loaded, h);
        assert_eq!(loaded.tokens(), 100_000);

        let mut h = loaded;
        for _ in 0..50_000 {
            h.end_step();
        }
        h.save(state.path()).unwrap();
        // 1.0 * 0.5^(50000/100000) = 1/sqrt(2).
        let expected = std::f64::consts::FRAC_1_SQRT_2;
        assert!(
            (h.count(1, 2) - expected).abs() < 1e-12,
            "{}",
            h.count(1, 2)
        );
        let (loaded, _) = UsageHistory::load(state.path(), "abc123", &[0, 4, 3]).unwrap();
        // serde_json parses floats to within one ulp, not always exactly.
        assert!((loaded.count(1, 2) - expected).abs() < 1e-12);
        assert!((loaded.count(2, 0) - 0.5 * expected).abs() < 1e-12);
        assert_eq!(loaded.tokens(), 150_000);

        // Saving with no tokens since the last save does not decay.
        let before = h.count(1, 2);
        h.save(state.path()).unwrap();
        assert_eq!(h.count(1, 2), before);
    }

    #[test]
    fn saved_file_has_the_documented_format() {
        let state = tempfile::tempdir().unwrap();
        let mut h = history();
        h.save(state.path()).unwrap();
        let path = state.path().join("usage").join("abc123.json");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        assert_eq!(v["version"], 1);
        assert_eq!(v["fingerprint"], "abc123");
        assert_eq!(v["tokens"], 2);
        assert_eq!(v["since_save"], 0);
        assert!(v["updated"].as_u64().unwrap() > 0);
        let layers = v["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 3);
        assert_eq!(layers[0].as_array().unwrap().len(), 0);
        assert_eq!(layers[1].as_array().unwrap().len(), 4);
        assert!(layers[1][2].is_number());
    }

    #[test]
    fn missing_file_is_empty_without_warning() {
        let state = tempfile::tempdir().unwrap();
        let (h, warning) = UsageHistory::load(state.path(), "abc123", &[2, 2]).unwrap();
        assert_eq!(warning, None);
        assert_eq!(h, UsageHistory::new("abc123", &[2, 2]));
    }

    #[test]
    fn shape_mismatch_gives_empty_history_and_warning() {
        let state = tempfile::tempdir().unwrap();
        history().save(state.path()).unwrap();
        for shape in [&[0, 4, 4][..], &[0, 4], &[0, 4, 3, 0]] {
            let (h, warning) = UsageHistory::load(state.path(), "abc123", shape).unwrap();
            assert!(h.is_empty());
            assert_eq!(h.experts_per_layer(), shape);
            let warning = warning.expect("a warning");
            assert!(warning.contains("abc123.json"), "{warning}");
            assert!(warning.contains("layers"), "{warning}");
        }
    }

    #[test]
    fn corrupt_or_foreign_files_give_empty_history_and_warning() {
        let state = tempfile::tempdir().unwrap();
        let path = UsageHistory::path(state.path(), "abc123").unwrap();
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let cases: [(&str, &str); 6] = [
            ("{\"version\":1,\"fingerprint\":", "invalid JSON"),
            ("", "invalid JSON"),
            (
                r#"{"version":2,"fingerprint":"abc123","tokens":0,"since_save":0,"layers":[[0,0]]}"#,
                "version",
            ),
            (
                r#"{"version":1,"fingerprint":"other","tokens":0,"since_save":0,"layers":[[0,0]]}"#,
                "other",
            ),
            (
                r#"{"version":1,"fingerprint":"abc123","tokens":0,"since_save":0,"layers":[[1,-2]]}"#,
                "-2",
            ),
            (
                r#"{"version":1,"fingerprint":"abc123","tokens":"x","since_save":0,"layers":[[0,0]]}"#,
                "structure",
            ),
        ];
        for (text, expect) in cases {
            std::fs::write(&path, text).unwrap();
            let (h, warning) = UsageHistory::load(state.path(), "abc123", &[2]).unwrap();
            assert!(h.is_empty(), "{text}");
            let warning = warning.unwrap_or_else(|| panic!("no warning for {text}"));
            assert!(warning.contains(expect), "{warning}");
        }
        // Integer counts and a missing `updated` are accepted.
        std::fs::write(
            &path,
            r#"{"version":1,"fingerprint":"abc123","tokens":5,"since_save":5,"layers":[[3,0]]}"#,
        )
        .unwrap();
        let (h, warning) = UsageHistory::load(state.path(), "abc123", &[2]).unwrap();
        assert_eq!(warning, None);
        assert_eq!(h.count(0, 0), 3.0);
        assert_eq!(h.since_save(), 5);
        assert_eq!(h.updated(), 0);
    }

    #[test]
    fn bad_fingerprints_are_refused() {
        let state = tempfile::tempdir().unwrap();
        for fp in ["", "../x", "a/b", "a.b"] {
            assert!(UsageHistory::load(state.path(), fp, &[1]).is_err(), "{fp}");
            assert!(
                UsageHistory::new(fp, &[1]).save(state.path()).is_err(),
                "{fp}"
            );
        }
        assert!(!state.path().join("x.json").exists());
    }

    #[test]
    fn hottest_orders_by_count_then_layer_then_expert_and_skips_zeros() {
        let mut h = UsageHistory::new("m", &[3, 3]);
        h.record(1, &[2, 2, 2]);
        h.record(0, &[1, 1]);
        h.record(1, &[0, 0]);
        h.record(0, &[2]);
        // Counts: (1,2)=3, (0,1)=2, (1,0)=2, (0,2)=1; zeros: (0,0), (1,1).
        let all = h.hottest(|_, _| 10, u64::MAX);
        assert_eq!(all, vec![(1, 2), (0, 1), (1, 0), (0, 2)]);
        assert_eq!(h.hottest(|_, _| 10, 29), vec![(1, 2), (0, 1)]);
        assert_eq!(h.hottest(|_, _| 10, 30), vec![(1, 2), (0, 1), (1, 0)]);
        assert_eq!(h.hottest(|_, _| 10, 9), vec![]);
        assert_eq!(h.hottest(|_, _| 0, 0), all);
        // A too-large expert is skipped and colder ones that fit are still taken.
        let sized = |l: usize, e: usize| if (l, e) == (0, 1) { 100 } else { 10 };
        assert_eq!(h.hottest(sized, 35), vec![(1, 2), (1, 0), (0, 2)]);
        assert_eq!(UsageHistory::new("m", &[3]).hottest(|_, _| 1, 100), vec![]);
    }

    #[test]
    fn refuses_to_save_into_a_model_directory() {
        let model = tempfile::tempdir().unwrap();
        fake_model(model.path());
        let err = history().save(model.path()).unwrap_err().to_string();
        assert!(err.contains("model directory"), "{err}");
        assert!(!model.path().join("usage").exists());
    }

    #[test]
    fn save_creates_directories_and_leaves_no_temporary_file() {
        let state = tempfile::tempdir().unwrap();
        let dir = state.path().join("deep").join("state");
        let mut h = history();
        h.save(&dir).unwrap();
        h.record(1, &[1]);
        h.end_step();
        h.save(&dir).unwrap();
        let names: Vec<String> = std::fs::read_dir(dir.join("usage"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["abc123.json".to_string()]);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn failed_save_keeps_what_was_learned_for_the_next_save() {
        let state = tempfile::tempdir().unwrap();
        // `usage` is a file, so the directory cannot be created.
        std::fs::write(state.path().join("usage"), b"").unwrap();
        let mut h = history();
        for _ in 0..1000 {
            h.end_step();
        }
        let mut twin = h.clone();
        assert!(h.save(state.path()).is_err());
        // Decayed for the 1002 tokens seen, as a successful save would have.
        let factor = 0.5f64.powf(1002.0 / 100_000.0);
        assert_eq!(h.count(1, 2), 2.0 * factor);
        assert_eq!(h.since_save(), 0);
        // Once the directory can be written, the next save writes what the failed one
        // would have, and nothing is decayed twice.
        std::fs::remove_file(state.path().join("usage")).unwrap();
        h.save(state.path()).unwrap();
        let other = tempfile::tempdir().unwrap();
        twin.save(other.path()).unwrap();
        assert_eq!(h.count(1, 2), twin.count(1, 2));
        let (loaded, warning) = UsageHistory::load(state.path(), "abc123", &[0, 4, 3]).unwrap();
        assert_eq!(warning, None);
        // serde_json parses floats to within one ulp, not always exactly.
        assert!((loaded.count(1, 2) - 2.0 * factor).abs() < 1e-12);
        assert_eq!(loaded.tokens(), 1002);
    }

    #[test]
    fn snapshot_decays_at_once_and_writes_later() {
        let state = tempfile::tempdir().unwrap();
        let mut h = history();
        let pending = h.snapshot(state.path()).unwrap();
        assert_eq!(
            pending.path(),
            state.path().join("usage").join("abc123.json")
        );
        assert!(
            !pending.path().exists(),
            "nothing is written by the snapshot"
        );
        // What is recorded after the snapshot is not in it, and is not decayed by it.
        h.record(2, &[2]);
        h.end_step();
        pending.write().unwrap();
        let (loaded, _) = UsageHistory::load(state.path(), "abc123", &[0, 4, 3]).unwrap();
        assert_eq!(loaded.tokens(), 2);
        assert_eq!(loaded.count(2, 2), 0.0);
        assert_eq!(h.count(2, 2), 1.0);
        assert_eq!(h.since_save(), 1);
    }

    #[test]
    fn load_removes_temporaries_of_dead_processes_only() {
        let state = tempfile::tempdir().unwrap();
        let mut h = history();
        h.save(state.path()).unwrap();
        let usage = state.path().join("usage");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = usage.join(format!("abc123.json.{dead}.tmp"));
        std::fs::write(&stale, b"{\"version\":1,").unwrap();
        // This process is alive, and its temporary is locked as it writes: it stays.
        let (live, _lock) = crate::format::write::create_tmp(&usage.join("other.json")).unwrap();
        let (_, warning) = UsageHistory::load(state.path(), "abc123", &[0, 4, 3]).unwrap();
        assert_eq!(warning, None);
        assert!(!stale.exists(), "the dead process's temporary is removed");
        assert!(live.exists(), "a live writer's temporary is kept");
    }
}
