//! A checkpoint's `generation_config.json`: the model author's default sampling settings and
//! the end-of-sequence ids generation stops on. The file is optional; every field is too.

use std::path::Path;

use serde_json::Value;

use crate::error::{read_json, Error, Result};

/// The file name inside a model directory.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// Generation defaults from `generation_config.json`. Absent (or `null`) fields are `None`
/// (or empty for `eos_token_ids`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// Token ids that end generation (`eos_token_id`, an int or a list of ints).
    pub eos_token_ids: Vec<u32>,
    /// The beginning-of-sequence id (`bos_token_id`).
    pub bos_token_id: Option<u32>,
    /// Default sampling temperature.
    pub temperature: Option<f32>,
    /// Default nucleus (top-p) threshold.
    pub top_p: Option<f32>,
    /// Default top-k cut-off.
    pub top_k: Option<u32>,
    /// Default min-p threshold.
    pub min_p: Option<f32>,
    /// Default repetition penalty (HF semantics).
    pub repetition_penalty: Option<f32>,
    /// Whether the author intends sampling (`true`) or greedy decoding (`false`).
    pub do_sample: Option<bool>,
    /// Default cap on generated tokens.
    pub max_new_tokens: Option<usize>,
}

impl GenerationConfig {
    /// Read `generation_config.json` from a model directory. A missing file gives the
    /// default (everything unset); invalid JSON is [`Error::Json`]; a field of the wrong type
    /// or out of range is [`Error::Config`] naming it.
    pub fn from_model_dir(dir: &Path) -> Result<GenerationConfig> {
        let path = dir.join(GENERATION_CONFIG_FILE);
        if !path.exists() {
            return Ok(GenerationConfig::default());
        }
        let json = read_json(&path)?;
        Self::from_json(&json, &path)
    }

    /// Parse an already read `generation_config.json`; `path` is what errors name.
    pub fn from_json(json: &Value, path: &Path) -> Result<GenerationConfig> {
        let obj = json
            .as_object()
            .ok_or_else(|| Error::corrupt(path, "expected a JSON object at the top level"))?;
        let field = |name: &str| obj.get(name).filter(|v| !v.is_null());
        let bad = |name: &str, expected: &str, got: &Value| {
            Error::config(path, name, format!("expected {expected}, got {got}"))
        };

        let token_id = |name: &str, v: &Value| -> Result<u32> {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| bad(name, "a non-negative token id", v))
        };
        let float = |name: &str| -> Result<Option<f32>> {
            match field(name) {
                None => Ok(None),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() => Ok(Some(x as f32)),
                    _ => Err(bad(name, "a number", v)),
                },
            }
        };
        let count = |name: &str| -> Result<Option<u64>> {
            match field(name) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(Some)
                    .ok_or_else(|| bad(name, "a non-negative integer", v)),
            }
        };

        let eos_token_ids = match field("eos_token_id") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| token_id("eos_token_id", v))
                .collect::<Result<_>>()?,
            Some(v) => vec![token_id("eos_token_id", v)?],
        };
        let bos_token_id = field("bos_token_id")
            .map(|v| token_id("bos_token_id", v))
            .transpose()?;
        let top_k = count("top_k")?
            .map(|k| u32::try_from(k).map_err(|_| bad("top_k", "a 32-bit integer", &k.into())))
            .transpose()?;
        let max_new_tokens = count("max_new_tokens")?
            .map(|n| {
                usize::try_from(n)
                    .map_err(|_| bad("max_new_tokens", "a smaller integer", &n.into()))
            })
            .transpose()?;
        let do_sample = match field("do_sample") {
            None => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(v) => return Err(bad("do_sample", "a boolean", v)),
        };

        Ok(GenerationConfig {
            eos_token_ids,
            bos_token_id,
            temperature: float("temperature")?,
            top_p: float("top_p")?,
            top_k,
            min_p: float("min_p")?,
            repetition_penalty: float("repetition_penalty")?,
            do_sample,
            max_new_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(contents: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(GENERATION_CONFIG_FILE), contents).unwrap();
        dir
    }

    #[test]
    fn missing_file_gives_default() {
        let dir = tempfile::tempdir().unwrap();
        let gc = GenerationConfig::from_model_dir(dir.path()).unwrap();
        assert_eq!(gc, GenerationConfig::default());
        assert!(gc.eos_token_ids.is_empty());
        assert_eq!(gc.temperature, None);
    }

    #[test]
    fn full_file_with_eos_list() {
        let dir = dir_with(
            r#"{
              "bos_token_id": 151643,
              "do_sample": true,
              "eos_token_id": [151645, 151643],
              "pad_token_id": 151643,
              "repetition_penalty": 1.05,
              "temperature": 0.7,
              "top_k": 20,
              "top_p": 0.8,
              "min_p": 0,
              "max_new_tokens": 2048,
              "transformers_version": "4.51.0"
            }"#,
        );
        let gc = GenerationConfig::from_model_dir(dir.path()).unwrap();
        assert_eq!(
            gc,
            GenerationConfig {
                eos_token_ids: vec![151645, 151643],
                bos_token_id: Some(151643),
                temperature: Some(0.7),
                top_p: Some(0.8),
                top_k: Some(20),
                min_p: Some(0.0),
                repetition_penalty: Some(1.05),
                do_sample: Some(true),
                max_new_tokens: Some(2048),
            }
        );
    }

    #[test]
    fn eos_as_single_int_and_nulls() {
        let dir = dir_with(r#"{"eos_token_id": 2, "bos_token_id": null, "temperature": 1}"#);
        let gc = GenerationConfig::from_model_dir(dir.path()).unwrap();
        assert_eq!(gc.eos_token_ids, vec![2]);
        assert_eq!(gc.bos_token_id, None);
        assert_eq!(gc.temperature, Some(1.0));
        assert_eq!(gc.top_k, None);
        assert_eq!(gc.do_sample, None);
    }

    #[test]
    fn invalid_json_is_json_error() {
        let dir = dir_with(r#"{"eos_token_id": 2,"#);
        let err = GenerationConfig::from_model_dir(dir.path()).unwrap_err();
        assert!(matches!(err, Error::Json { .. }), "{err}");
        assert!(err.to_string().contains(GENERATION_CONFIG_FILE));
    }

    fn config_error_field(contents: &str) -> String {
        let dir = dir_with(contents);
        match GenerationConfig::from_model_dir(dir.path()).unwrap_err() {
            Error::Config { field, path, .. } => {
                assert!(path.ends_with(GENERATION_CONFIG_FILE));
                field
            }
            other => panic!("expected a config error, got {other}"),
        }
    }

    #[test]
    fn wrong_types_name_the_field() {
        assert_eq!(
            config_error_field(r#"{"eos_token_id": "2"}"#),
            "eos_token_id"
        );
        assert_eq!(
            config_error_field(r#"{"eos_token_id": [1, -2]}"#),
            "eos_token_id"
        );
        assert_eq!(
            config_error_field(r#"{"bos_token_id": 1.5}"#),
            "bos_token_id"
        );
        assert_eq!(
            config_error_field(r#"{"temperature": "hot"}"#),
            "temperature"
        );
        assert_eq!(config_error_field(r#"{"top_p": [0.9]}"#), "top_p");
        assert_eq!(config_error_field(r#"{"top_k": -1}"#), "top_k");
        assert_eq!(config_error_field(r#"{"min_p": true}"#), "min_p");
        assert_eq!(
            config_error_field(r#"{"repetition_penalty": {}}"#),
            "repetition_penalty"
        );
        assert_eq!(config_error_field(r#"{"do_sample": "yes"}"#), "do_sample");
        assert_eq!(
            config_error_field(r#"{"max_new_tokens": 1.5}"#),
            "max_new_tokens"
        );
    }

    #[test]
    fn non_object_is_corrupt() {
        let dir = dir_with("[1, 2]");
        let err = GenerationConfig::from_model_dir(dir.path()).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
    }
}
