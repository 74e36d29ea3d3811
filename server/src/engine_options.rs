//! The engine options: one typed structure, [`EngineOptions`], shared by every command that
//! loads a model (`run`, `bench`, `logits`, `info`, `serve`, and `config --show`), and the
//! flags that set them, [`EngineFlags`].
//!
//! Each option is a typed value: the value sets are the engine's own enums
//! ([`ReaderKind`], [`CachePolicy`], [`MlaForm`], [`KvDType`], [`Draft`]), which derive serde
//! (for the configuration file and the environment) and `clap::ValueEnum` (for flags) from the
//! same definition, and sizes are [`Size`]s. The computing commands take them as flags over
//! the defaults; `coli serve` reads them like its other keys — defaults < profile file <
//! `COLI_*` variables < flags — as top-level keys of `colibri.toml` (see `crate::config`).
//! [`EngineOptions::load_options`] builds the engine's [`LoadOptions`] from them.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::Result;
use colibri::model::cache::KvDType;
use colibri::model::mla::MlaForm;
use colibri::model::{Draft, LoadOptions};
use colibri::runtime::drafts::{DraftConfig, DraftMode};
use colibri::store::budget::{default_budget, parse_size};
use colibri::store::reader::ReaderKind;
use colibri::store::{CachePolicy, StoreOptions};
use colibri::tensor::device::DeviceChoice;
use figment::value::Value;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::config::Shape;

/// Every key of [`EngineOptions`], in field order, with how the environment spells its value.
pub(crate) const ENGINE_KEYS: &[(&str, Shape)] = &[
    ("threads", Shape::Number),
    ("ram", Shape::Text),
    ("mmap", Shape::Bool),
    ("mirrors", Shape::List),
    ("mirror_weights", Shape::NumberList),
    ("io", Shape::Text),
    ("io_threads", Shape::Number),
    ("direct_io", Shape::Bool),
    ("cache_policy", Shape::Text),
    ("pin_budget", Shape::Text),
    ("no_learn", Shape::Bool),
    ("no_prefetch", Shape::Bool),
    ("mla_form", Shape::Text),
    ("kv_dtype", Shape::Text),
    ("draft", Shape::Text),
    ("draft_tokens", Shape::Number),
    ("draft_ngram_min", Shape::Number),
    ("draft_ngram_max", Shape::Number),
    ("device", Shape::Text),
    ("vram", Shape::Text),
];

/// A byte size as written (`512M`, `6G`, `6GiB`, `1.5G`, or a plain byte count; powers of
/// 1024, any case) and the bytes it means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Size {
    /// The bytes.
    pub bytes: u64,
    /// The text it was given as (shown back by `coli config --show`).
    text: String,
}

impl FromStr for Size {
    type Err = String;

    fn from_str(s: &str) -> Result<Size, String> {
        let fail = || format!("expected a size such as 512M, 6G or 6GiB, found `{s}`");
        if !is_size(s) {
            return Err(fail());
        }
        let bytes = parse_size(s).map_err(|_| fail())?;
        Ok(Size {
            bytes,
            text: s.trim().to_string(),
        })
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Serialize for Size {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Size {
    /// A size string, or a non-negative integer (bytes).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Size;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as 512M, 6G or 6GiB, or a byte count")
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Size, E> {
                s.parse().map_err(E::custom)
            }

            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Size, E> {
                Ok(Size {
                    bytes: n,
                    text: n.to_string(),
                })
            }

            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Size, E> {
                u64::try_from(n)
                    .map_err(|_| E::custom(format!("expected a size, found {n}")))
                    .and_then(|n| self.visit_u64(n))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// Whether `s` is a size the engine's budget parser reads: a number (digits, optionally with a
/// decimal fraction) followed by an optional unit K, M, G or T, itself optionally followed by
/// `B` or `iB`; or a plain byte count with an optional `B`. Case-insensitive.
pub(crate) fn is_size(s: &str) -> bool {
    let t = s.trim().to_ascii_uppercase();
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(end);
    let mut parts = number.split('.');
    let whole = parts.next().unwrap_or("");
    let fraction = parts.next();
    let number_ok =
        !whole.is_empty() && parts.next().is_none() && fraction.is_none_or(|f| !f.is_empty());
    let unit_ok = match unit.chars().next() {
        None => true,
        Some('K' | 'M' | 'G' | 'T') => matches!(&unit[1..], "" | "B" | "IB"),
        Some('B') => unit.len() == 1,
        Some(_) => false,
    };
    number_ok && unit_ok
}

/// The engine options of every command that loads a model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineOptions {
    /// Compute threads; 0 means all cores.
    pub threads: usize,
    /// RAM budget for resident weights plus the expert cache; `None` means the default
    /// budget (80 % of available memory, or of the container's limit when smaller, less 1 GiB).
    pub ram: Option<Size>,
    /// Memory-map every weight instead of reading experts into a budgeted cache (no `ram`).
    pub mmap: bool,
    /// Byte-identical copies of the checkpoint on other drives; reads are spread over them.
    pub mirrors: Vec<PathBuf>,
    /// Relative read bandwidth of each mirror, in order (empty: measured at start).
    pub mirror_weights: Vec<f64>,
    /// How experts are read: io-uring, a pread pool, or whichever works.
    pub io: ReaderKind,
    /// I/O threads reading experts (at least 1).
    pub io_threads: usize,
    /// Read expert files with O_DIRECT (bypassing the page cache), if the filesystem allows.
    pub direct_io: bool,
    /// Which expert the cache evicts when full.
    pub cache_policy: CachePolicy,
    /// Bytes of the expert cache the learned hot set may pin; `None`: half of the cache.
    pub pin_budget: Option<Size>,
    /// Do not record expert usage nor pin the experts it shows to be hot.
    pub no_learn: bool,
    /// Do not read the next layer's likely experts ahead of time.
    pub no_prefetch: bool,
    /// How latent attention is computed; `None`: the family's default (absorbed). An error on
    /// a model without latent attention.
    pub mla_form: Option<MlaForm>,
    /// Precision of the latent-attention KV cache; `None`: f32. bf16 is an error on a model
    /// without latent attention.
    pub kv_dtype: Option<KvDType>,
    /// Speculative decoding's drafts: none; the checkpoint's MTP head (an error on a
    /// checkpoint without one; `run` and `bench`); prompt lookup and grammar fast-forward at
    /// every step (`ngram`) or while they pay (`auto`) (`serve` and `bench`).
    pub draft: Draft,
    /// Most tokens one prompt-lookup or grammar draft may have.
    pub draft_tokens: usize,
    /// Shortest suffix (tokens) prompt lookup matches.
    pub draft_ngram_min: usize,
    /// Longest suffix (tokens) prompt lookup matches; it tries the longest first.
    pub draft_ngram_max: usize,
    /// The device that computes with the matrices placed on it: `auto` (a CUDA GPU, else a
    /// Vulkan GPU, else the CPU), `cuda`, `vulkan` or `cpu`. Tokens are the same on each.
    pub device: DeviceChoice,
    /// Device memory to fill (dense matrices first, then the hottest experts); `None`: the
    /// device's free memory less a tenth (at least 512 MiB).
    pub vram: Option<Size>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: 0,
            ram: None,
            mmap: false,
            mirrors: Vec::new(),
            mirror_weights: Vec::new(),
            io: ReaderKind::default(),
            io_threads: 4,
            direct_io: false,
            cache_policy: CachePolicy::default(),
            pin_budget: None,
            no_learn: false,
            no_prefetch: false,
            mla_form: None,
            kv_dtype: None,
            draft: Draft::default(),
            draft_tokens: DraftConfig::default().max_tokens,
            draft_ngram_min: DraftConfig::default().ngram_min,
            draft_ngram_max: DraftConfig::default().ngram_max,
            device: DeviceChoice::Auto,
            vram: None,
        }
    }
}

impl EngineOptions {
    /// Checks what types cannot express. On failure returns the offending key and what is
    /// wrong with its value.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let fail = |key: &str, problem: String| Err((key.to_string(), problem));
        if self.mmap && self.ram.is_some() {
            return fail(
                "mmap",
                "is set together with ram: memory-mapping uses no RAM budget; unset one of them"
                    .into(),
            );
        }
        if self.mirrors.iter().any(|m| m.as_os_str().is_empty()) {
            return fail("mirrors", "must not contain an empty path".into());
        }
        if !self.mirror_weights.is_empty() && self.mirror_weights.len() != self.mirrors.len() {
            return fail(
                "mirror_weights",
                format!(
                    "has {} values for {} mirrors: give one per mirror, or none to measure them",
                    self.mirror_weights.len(),
                    self.mirrors.len()
                ),
            );
        }
        if let Some(w) = self
            .mirror_weights
            .iter()
            .find(|w| !(w.is_finite() && **w > 0.0))
        {
            return fail(
                "mirror_weights",
                format!("expected positive numbers, found {w}"),
            );
        }
        if self.io_threads == 0 {
            return fail("io_threads", "expected at least 1, found 0".into());
        }
        if let Err((key, problem)) = self.draft_config().validate() {
            return fail(key, problem);
        }
        Ok(())
    }

    /// How the scheduler drafts (`coli serve`, `coli bench`): prompt lookup and grammar
    /// fast-forward with `draft = "ngram"` (always) or `"auto"` (while they pay); off
    /// otherwise (`mtp` drafts with the model's head in `coli run` and `coli bench`).
    pub fn draft_config(&self) -> DraftConfig {
        DraftConfig {
            mode: match self.draft {
                Draft::None | Draft::Mtp => DraftMode::Off,
                Draft::Ngram => DraftMode::Always,
                Draft::Auto => DraftMode::Auto,
            },
            max_tokens: self.draft_tokens,
            ngram_min: self.draft_ngram_min,
            ngram_max: self.draft_ngram_max,
        }
    }

    /// The engine's load options (`model` is the model directory, for measuring mirror
    /// drives; `default` overrides the default RAM budget).
    pub fn load_options(&self, model: &Path, default: Option<u64>) -> LoadOptions {
        LoadOptions {
            placement: self.store_options(model, default),
            mla_form: self.mla_form,
            kv_dtype: self.kv_dtype,
            draft: self.draft,
            device: self.device,
            vram: self.vram.as_ref().map(|s| s.bytes),
        }
    }

    /// The RAM budget: `None` with `mmap`, else `ram`, else `default`, else the machine's
    /// default budget.
    pub fn ram_budget(&self, default: Option<u64>) -> Option<u64> {
        if self.mmap {
            return None;
        }
        Some(match &self.ram {
            Some(s) => s.bytes,
            None => default.unwrap_or_else(default_budget),
        })
    }

    /// The expert store's placement options (see [`EngineOptions::load_options`]).
    pub fn store_options(&self, model: &Path, default: Option<u64>) -> StoreOptions {
        let ram_budget = self.ram_budget(default);
        let weights = if self.mirror_weights.is_empty() && !self.mirrors.is_empty() {
            measured_weights(model, &self.mirrors)
        } else {
            self.mirror_weights.clone()
        };
        let mirrors = self
            .mirrors
            .iter()
            .enumerate()
            .map(|(i, dir)| colibri::store::mirror::Mirror {
                dir: dir.clone(),
                weight: weights.get(i).copied().unwrap_or(1.0),
            })
            .collect();
        StoreOptions {
            ram_budget,
            io_threads: self.io_threads,
            prefetch: !self.no_prefetch,
            learn: !self.no_learn,
            pin_budget: self.pin_budget.as_ref().map(|s| s.bytes),
            state_dir: None,
            mirrors,
            reader: self.io,
            direct_io: self.direct_io,
            policy: self.cache_policy,
            device: None,
            wrap_reader: None,
            layout_probe: None,
        }
    }
}

/// The name a value of an option enum has in flags, files and variables (`bf16`, `lfru`).
pub fn value_name<T: clap::ValueEnum>(value: &T) -> String {
    value
        .to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

/// The engine options as flags: each one given overrides the defaults (and, for `coli serve`,
/// the configuration file and the environment); those not given leave them be.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EngineFlags {
    /// Compute threads; 0 = all cores [default: 0].
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// RAM budget for resident weights plus the expert cache, e.g. 512M or 6G (default: 80 %
    /// of available memory, or of the container's memory limit when smaller, less 1 GiB).
    /// Routed experts beyond it are read from disk on demand.
    #[arg(long, value_name = "SIZE")]
    pub ram: Option<Size>,
    /// Memory-map every weight instead of reading experts into a budgeted cache.
    #[arg(long, conflicts_with = "ram")]
    pub mmap: bool,
    /// A byte-identical copy of the checkpoint on another drive (repeatable); reads are
    /// spread over the drives by their weights.
    #[arg(long = "mirror", value_name = "PATH")]
    pub mirrors: Vec<PathBuf>,
    /// Relative read bandwidth of each --mirror, in order, comma-separated (default: measured;
    /// the model directory's drive counts 1).
    #[arg(long, value_delimiter = ',', value_name = "W")]
    pub mirror_weights: Vec<f64>,
    /// How to read experts [default: auto].
    #[arg(long, value_enum, ignore_case = true, value_name = "READER")]
    pub io: Option<ReaderKind>,
    /// I/O threads reading experts [default: 4].
    #[arg(long, value_name = "N")]
    pub io_threads: Option<usize>,
    /// Read expert files with O_DIRECT (bypassing the page cache), if the filesystem allows.
    #[arg(long)]
    pub direct_io: bool,
    /// Expert cache eviction [default: lru].
    #[arg(long, value_enum, ignore_case = true, value_name = "POLICY")]
    pub cache_policy: Option<CachePolicy>,
    /// Bytes of the expert cache the learned hot set may pin (default: half of the cache).
    #[arg(long, value_name = "SIZE")]
    pub pin_budget: Option<Size>,
    /// Do not record expert usage nor pin the experts it shows to be hot.
    #[arg(long)]
    pub no_learn: bool,
    /// Do not read the next layer's likely experts ahead of time.
    #[arg(long)]
    pub no_prefetch: bool,
    /// How latent-attention models (DeepSeek, Kimi, GLM-5) compute attention (default:
    /// absorbed). An error on a model without latent attention.
    #[arg(long, value_enum, ignore_case = true, value_name = "FORM")]
    pub mla_form: Option<MlaForm>,
    /// Precision of the latent-attention KV cache (DeepSeek, Kimi, GLM-5) (default: f32).
    /// bf16 halves the bytes per token; values are rounded when stored, so outputs may differ
    /// slightly from f32 — an explicit choice, never made for you. bf16 is an error on a model
    /// without latent attention.
    #[arg(long, value_enum, ignore_case = true, value_name = "DTYPE")]
    pub kv_dtype: Option<KvDType>,
    /// Draft tokens and verify them in one batched step: the output is identical, only the
    /// speed changes. `mtp`: the checkpoint's multi-token-prediction head (DeepSeek-V3,
    /// GLM-4.5+/5 carry one; an error without it), in `run` and `bench`, turning itself off
    /// when it does not pay. `ngram`: prompt lookup (text the output copies from its context)
    /// and grammar fast-forward (tokens a JSON schema or grammar forces) at every step, in
    /// `serve` and `bench`; `auto`: the same, each source kept only while its measured
    /// acceptance pays for the rows it adds [default: none].
    #[arg(long, value_enum, ignore_case = true, value_name = "DRAFTER")]
    pub draft: Option<Draft>,
    /// Most tokens one prompt-lookup or grammar draft may have [default: 8].
    #[arg(long, value_name = "N")]
    pub draft_tokens: Option<usize>,
    /// Shortest suffix, in tokens, prompt lookup matches [default: 2].
    #[arg(long, value_name = "N")]
    pub draft_ngram_min: Option<usize>,
    /// Longest suffix, in tokens, prompt lookup matches (the longest is tried first)
    /// [default: 4].
    #[arg(long, value_name = "N")]
    pub draft_ngram_max: Option<usize>,
    /// The device computing with the matrices placed on it: auto (a CUDA GPU, else a Vulkan
    /// GPU, else the CPU), cuda, vulkan (also Mesa's lavapipe) or cpu. Products on a device
    /// give the CPU's bits: tokens are the same on each [default: auto].
    #[arg(long, value_enum, ignore_case = true, value_name = "DEVICE")]
    pub device: Option<DeviceChoice>,
    /// Device memory to fill, e.g. 8G: dense matrices first, then the hottest experts; the
    /// rest is computed on the CPU (default: the device's free memory less a tenth).
    #[arg(long, value_name = "SIZE")]
    pub vram: Option<Size>,
}

impl EngineFlags {
    /// The flags actually given, as (key, flag, value).
    pub(crate) fn values(&self) -> Result<Vec<(&'static str, &'static str, Value)>> {
        let mut out = Vec::new();
        let mut put =
            |key: &'static str, flag: &'static str, value: Result<Value, figment::Error>| {
                let value = value.map_err(|e| {
                    anyhow::anyhow!("invalid configuration: `{key}` from flag {flag}: {e}")
                })?;
                out.push((key, flag, value));
                anyhow::Ok(())
            };
        macro_rules! opt {
            ($field:ident, $flag:literal) => {
                if let Some(v) = &self.$field {
                    put(stringify!($field), $flag, Value::serialize(v))?;
                }
            };
        }
        macro_rules! list {
            ($field:ident, $flag:literal) => {
                if !self.$field.is_empty() {
                    put(stringify!($field), $flag, Value::serialize(&self.$field))?;
                }
            };
        }
        macro_rules! switch {
            ($field:ident, $flag:literal) => {
                if self.$field {
                    put(stringify!($field), $flag, Ok(Value::from(true)))?;
                }
            };
        }
        opt!(threads, "--threads");
        opt!(ram, "--ram");
        switch!(mmap, "--mmap");
        list!(mirrors, "--mirror");
        list!(mirror_weights, "--mirror-weights");
        opt!(io, "--io");
        opt!(io_threads, "--io-threads");
        switch!(direct_io, "--direct-io");
        opt!(cache_policy, "--cache-policy");
        opt!(pin_budget, "--pin-budget");
        switch!(no_learn, "--no-learn");
        switch!(no_prefetch, "--no-prefetch");
        opt!(mla_form, "--mla-form");
        opt!(kv_dtype, "--kv-dtype");
        opt!(draft, "--draft");
        opt!(draft_tokens, "--draft-tokens");
        opt!(draft_ngram_min, "--draft-ngram-min");
        opt!(draft_ngram_max, "--draft-ngram-max");
        opt!(device, "--device");
        opt!(vram, "--vram");
        Ok(out)
    }
}

/// Read weights of the mirror drives relative to the model directory's drive: each drive's
/// measured sequential read bandwidth (256 MiB of its largest safetensors file, O_DIRECT
/// where allowed) divided by the model directory's. Drives that cannot be measured count 1.
fn measured_weights(model: &Path, mirrors: &[PathBuf]) -> Vec<f64> {
    let primary = crate::machine::drive_read_bandwidth(model);
    let weights: Vec<f64> = mirrors
        .iter()
        .map(
            |m| match (primary, crate::machine::drive_read_bandwidth(m)) {
                (Some(p), Some(x)) if p > 0.0 => x / p,
                _ => 1.0,
            },
        )
        .collect();
    eprintln!(
        "coli: mirror weights measured (model directory = 1): {}",
        weights
            .iter()
            .map(|w| format!("{w:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    weights
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_show_as_written() {
        let s: Size = "512M".parse().unwrap();
        assert_eq!((s.bytes, s.to_string()), (512 << 20, "512M".to_string()));
        for ok in ["6G", "512m", "6GiB", "6gb", "1024", "1.5G", "100B", "2T"] {
            assert!(ok.parse::<Size>().is_ok(), "{ok}");
        }
        for bad in ["", "6 G", "G6", "6GG", "6iB", "1.G", "1..5G", "-1G", "6Q"] {
            let e = bad.parse::<Size>().unwrap_err();
            assert!(e.contains("expected a size such as 512M"), "{bad}: {e}");
        }
    }

    #[test]
    fn value_names_are_the_serde_names() {
        assert_eq!(value_name(&KvDType::Bf16), "bf16");
        assert_eq!(value_name(&ReaderKind::Uring), "uring");
        assert_eq!(
            serde_json::to_value(KvDType::Bf16).unwrap(),
            serde_json::json!("bf16")
        );
        assert_eq!(
            serde_json::from_value::<ReaderKind>(serde_json::json!("io-uring")).unwrap(),
            ReaderKind::Uring
        );
    }

    #[test]
    fn validate_checks_each_rule() {
        let bad = |f: fn(&mut EngineOptions)| {
            let mut o = EngineOptions::default();
            f(&mut o);
            o.validate().expect_err("expected invalid").0
        };
        assert_eq!(
            bad(|o| {
                o.mmap = true;
                o.ram = Some("1G".parse().unwrap());
            }),
            "mmap"
        );
        assert_eq!(bad(|o| o.mirrors = vec![PathBuf::new()]), "mirrors");
        assert_eq!(bad(|o| o.mirror_weights = vec![1.0]), "mirror_weights");
        assert_eq!(
            bad(|o| {
                o.mirrors = vec!["/a".into()];
                o.mirror_weights = vec![0.0];
            }),
            "mirror_weights"
        );
        assert_eq!(bad(|o| o.io_threads = 0), "io_threads");
        assert_eq!(bad(|o| o.draft_tokens = 0), "draft_tokens");
        assert_eq!(bad(|o| o.draft_ngram_min = 0), "draft_ngram_min");
        assert_eq!(
            bad(|o| {
                o.draft_ngram_min = 5;
                o.draft_ngram_max = 3;
            }),
            "draft_ngram_max"
        );
        assert_eq!(EngineOptions::default().validate(), Ok(()));
    }

    #[test]
    fn options_reach_the_load_options() {
        let o = EngineOptions {
            ram: Some("1G".parse().unwrap()),
            io: ReaderKind::Pool,
            io_threads: 2,
            direct_io: true,
            cache_policy: CachePolicy::Lfru,
            pin_budget: Some("512M".parse().unwrap()),
            no_learn: true,
            no_prefetch: true,
            mirrors: vec!["/m".into()],
            mirror_weights: vec![2.0],
            mla_form: Some(MlaForm::Expanded),
            kv_dtype: Some(KvDType::Bf16),
            draft: Draft::Mtp,
            ..EngineOptions::default()
        };
        let l = o.load_options(Path::new("/model"), None);
        let p = &l.placement;
        assert_eq!(p.ram_budget, Some(1 << 30));
        assert_eq!(
            (p.reader, p.io_threads, p.direct_io),
            (ReaderKind::Pool, 2, true)
        );
        assert_eq!(p.policy, CachePolicy::Lfru);
        assert_eq!(p.pin_budget, Some(512 << 20));
        assert!(!p.learn && !p.prefetch);
        assert_eq!(p.mirrors.len(), 1);
        assert_eq!(p.mirrors[0].weight, 2.0);
        assert_eq!(l.mla_form, Some(MlaForm::Expanded));
        assert_eq!(l.kv_dtype, Some(KvDType::Bf16));
        assert_eq!(l.draft, Draft::Mtp);
        let mapped = EngineOptions {
            mmap: true,
            ..EngineOptions::default()
        };
        assert_eq!(
            mapped.store_options(Path::new("/m"), Some(5)).ram_budget,
            None
        );
        assert_eq!(
            EngineOptions::default()
                .store_options(Path::new("/m"), Some(5))
                .ram_budget,
            Some(5)
        );
    }
}
