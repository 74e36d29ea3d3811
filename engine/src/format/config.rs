//! `config.json`: the model's hyper-parameters, read through typed getters that name the
//! field and the file when a value is missing or of the wrong type.
//!
//! Both RoPE forms are understood: transformers v5's `rope_parameters` and the older
//! top-level `rope_theta` / `rope_scaling` / `partial_rotary_factor`.

use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::{Error, Result};

/// The largest dimension [`ModelConfig::dim`] accepts: 2^24 (16,777,216), far above any real
/// width, head count, rank or vocabulary, and small enough that a product of three fits in
/// 64 bits.
pub const MAX_DIM: usize = 1 << 24;

const DIM_BOUND: &str = "a dimension must be positive and at most 2^24";

/// Config fields that transformers' `attribute_map`s make synonyms.
const ALIASES: &[(&str, &str)] = &[("num_experts", "num_local_experts")];

/// The other name of a field that has one.
fn alias_of(field: &str) -> Option<&'static str> {
    ALIASES.iter().find_map(|&(a, b)| match field {
        f if f == a => Some(b),
        f if f == b => Some(a),
        _ => None,
    })
}

/// A parsed `config.json`.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    path: PathBuf,
    json: Value,
}

impl ModelConfig {
    /// Read `config.json` of a model directory.
    pub fn from_model_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let json = crate::error::read_json(&path)?;
        if !json.is_object() {
            return Err(Error::Json {
                path,
                message: "expected a JSON object at the top level".into(),
            });
        }
        Ok(ModelConfig { path, json })
    }

    /// Wrap a JSON value (tests, nested text configs).
    pub fn from_value(path: PathBuf, json: Value) -> ModelConfig {
        ModelConfig { path, json }
    }

    /// The file this config came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The raw JSON.
    pub fn json(&self) -> &Value {
        &self.json
    }

    /// `model_type`.
    pub fn model_type(&self) -> Result<String> {
        self.str("model_type")
    }

    /// An error about `field`, named as the file spells it (a field read through its
    /// `attribute_map` alias is named by the key the file has).
    pub fn error(&self, field: &str, message: impl Into<String>) -> Error {
        let named = match self.json.get(field).filter(|v| !v.is_null()) {
            Some(_) => field,
            None => alias_of(field)
                .filter(|alias| self.json.get(*alias).is_some_and(|v| !v.is_null()))
                .unwrap_or(field),
        };
        Error::config(&self.path, named, message)
    }

    /// A field's raw value, treating JSON null as absent. Fields that transformers maps to
    /// each other (`attribute_map`, e.g. `num_experts` / `num_local_experts`) are found under
    /// either name.
    pub fn get(&self, field: &str) -> Option<&Value> {
        let direct = self.json.get(field).filter(|v| !v.is_null());
        direct.or_else(|| {
            alias_of(field).and_then(|alias| self.json.get(alias).filter(|v| !v.is_null()))
        })
    }

    /// A required string field.
    pub fn str(&self, field: &str) -> Result<String> {
        match self.get(field) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(self.error(field, format!("expected a string, found {other}"))),
            None => Err(self.error(field, "missing")),
        }
    }

    /// A required non-negative integer.
    pub fn usize(&self, field: &str) -> Result<usize> {
        self.opt_usize(field)?
            .ok_or_else(|| self.error(field, "missing (expected a non-negative integer)"))
    }

    /// An optional non-negative integer.
    pub fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                self.error(field, format!("expected a non-negative integer, found {v}"))
            }),
        }
    }

    /// A non-negative integer with a default.
    pub fn usize_or(&self, field: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(field)?.unwrap_or(default))
    }

    /// A required integer in `range`; `bound` says in words what the range is (for the
    /// message when the value is outside it).
    pub fn usize_in(
        &self,
        field: &str,
        range: RangeInclusive<usize>,
        bound: &str,
    ) -> Result<usize> {
        let v = self.usize(field)?;
        self.check_in(field, v, range, bound)
    }

    /// A per-layer list of kinds (`layer_types`): for each of the `layers` entries, its index
    /// in `kinds`. `None` when the field is absent or null; an error naming the field (and
    /// the entry) when it is not a list of `layers` of the `kinds`.
    pub fn layer_kinds(
        &self,
        key: &str,
        layers: usize,
        kinds: &[&str],
    ) -> Result<Option<Vec<usize>>> {
        let Some(v) = self.get(key).filter(|v| !v.is_null()) else {
            return Ok(None);
        };
        let list = v.as_array().filter(|t| t.len() == layers).ok_or_else(|| {
            Error::config(
                &self.path,
                key,
                format!("must be a list of {layers} entries (num_hidden_layers)"),
            )
        })?;
        let expected = kinds
            .iter()
            .map(|k| format!("\"{k}\""))
            .collect::<Vec<_>>()
            .join(" or ");
        list.iter()
            .enumerate()
            .map(|(l, t)| {
                t.as_str()
                    .and_then(|t| kinds.iter().position(|k| *k == t))
                    .ok_or_else(|| {
                        Error::config(
                            &self.path,
                            format!("{key}[{l}]"),
                            format!("is {t}, expected {expected}"),
                        )
                    })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    /// [`Self::usize_in`] with a default for a missing field (the default is not checked).
    pub fn usize_in_or(
        &self,
        field: &str,
        range: RangeInclusive<usize>,
        bound: &str,
        default: usize,
    ) -> Result<usize> {
        match self.opt_usize(field)? {
            None => Ok(default),
            Some(v) => self.check_in(field, v, range, bound),
        }
    }

    fn check_in(
        &self,
        field: &str,
        v: usize,
        range: RangeInclusive<usize>,
        bound: &str,
    ) -> Result<usize> {
        if range.contains(&v) {
            return Ok(v);
        }
        Err(self.error(
            field,
            format!(
                "is {v}, outside {}..={} ({bound})",
                range.start(),
                range.end()
            ),
        ))
    }

    /// A required dimension (a width, a head count, a rank, the vocabulary size): a positive
    /// integer of at most [`MAX_DIM`], so that products of a few of them neither overflow
    /// nor ask for absurd allocations before the tensors are checked against them.
    pub fn dim(&self, field: &str) -> Result<usize> {
        self.usize_in(field, 1..=MAX_DIM, DIM_BOUND)
    }

    /// An optional dimension (see [`Self::dim`]).
    pub fn opt_dim(&self, field: &str) -> Result<Option<usize>> {
        match self.opt_usize(field)? {
            None => Ok(None),
            Some(v) => self.check_in(field, v, 1..=MAX_DIM, DIM_BOUND).map(Some),
        }
    }

    /// A dimension with a default (see [`Self::dim`]).
    pub fn dim_or(&self, field: &str, default: usize) -> Result<usize> {
        Ok(self.opt_dim(field)?.unwrap_or(default))
    }

    /// A required count of numbered parts that each have their own tensors in the checkpoint
    /// (`num_hidden_layers`: `…layers.{L}.…`): at most `present`, how many such parts the
    /// checkpoint's tensor names number ([`crate::format::safetensors::numbered_parts`]).
    /// Checked before anything is allocated or looped over per part, so a config claiming
    /// 2^62 layers is refused at once.
    pub fn count(&self, field: &str, present: usize, parts: &str) -> Result<usize> {
        let v = self.usize(field)?;
        if v > present {
            return Err(self.error(
                field,
                format!("is {v}, but the checkpoint has tensors for only {present} {parts}"),
            ));
        }
        Ok(v)
    }

    /// An optional number.
    pub fn opt_f64(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(field, format!("expected a number, found {v}"))),
        }
    }

    /// A number with a default.
    pub fn f64_or(&self, field: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(field)?.unwrap_or(default))
    }

    /// A boolean with a default.
    pub fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.error(field, format!("expected true or false, found {v}"))),
        }
    }

    /// An optional list of non-negative integers.
    pub fn usize_list(&self, field: &str) -> Result<Vec<usize>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().map(|n| n as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| self.error(field, "expected a list of non-negative integers")),
            Some(v) => Err(self.error(field, format!("expected a list, found {v}"))),
        }
    }

    /// Token ids that end generation: `eos_token_id` as an integer or a list.
    pub fn eos_token_ids(&self) -> Result<Vec<u32>> {
        // Token ids are u32: a larger number is refused, not truncated into another id.
        let id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        match self.get("eos_token_id") {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => {
                a.iter().map(id).collect::<Option<Vec<_>>>().ok_or_else(|| {
                    self.error("eos_token_id", "expected token ids (integers below 2^32)")
                })
            }
            Some(v) => id(v).map(|n| vec![n]).ok_or_else(|| {
                self.error(
                    "eos_token_id",
                    format!("expected a token id (an integer below 2^32), found {v}"),
                )
            }),
        }
    }

    /// The RoPE settings in either config form. `default_theta` is the architecture's default
    /// when no theta is given.
    pub fn rope(&self, default_theta: f64) -> Result<RopeParams> {
        let params = self
            .get("rope_parameters")
            .or_else(|| self.get("rope_scaling"));
        let field = if self.get("rope_parameters").is_some() {
            "rope_parameters"
        } else {
            "rope_scaling"
        };
        let num = |obj: Option<&Value>, key: &str| -> Result<Option<f64>> {
            match obj.and_then(|o| o.get(key)).filter(|v| !v.is_null()) {
                None => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                    self.error(
                        &format!("{field}.{key}"),
                        format!("expected a number, found {v}"),
                    )
                }),
            }
        };
        if let Some(p) = params {
            if !p.is_object() {
                return Err(self.error(field, format!("expected an object, found {p}")));
            }
        }
        let theta = num(params, "rope_theta")?
            .or(self.opt_f64("rope_theta")?)
            .unwrap_or(default_theta);
        let nested_partial = num(params, "partial_rotary_factor")?;
        let partial = nested_partial
            .or(self.opt_f64("partial_rotary_factor")?)
            .unwrap_or(1.0);
        if !(0.0..=1.0).contains(&partial) {
            // The rotated width is head_dim × partial: more than the head is no rotation
            // anyone defines, and a huge factor would size the frequency table by it.
            let name = match nested_partial {
                Some(_) => format!("{field}.partial_rotary_factor"),
                None => "partial_rotary_factor".to_string(),
            };
            return Err(self.error(
                &name,
                format!("is {partial}, expected a fraction of the head between 0 and 1"),
            ));
        }
        let kind_name = params
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(|v| v.as_str())
            .unwrap_or("default")
            .to_string();
        let need = |key: &str| -> Result<f64> {
            num(params, key)?.ok_or_else(|| {
                self.error(
                    &format!("{field}.{key}"),
                    format!("missing (required by rope_type `{kind_name}`)"),
                )
            })
        };
        let omp = || -> Result<f64> {
            Ok(match num(params, "original_max_position_embeddings")? {
                Some(v) => v,
                None => self.opt_f64("max_position_embeddings")?.ok_or_else(|| {
                    self.error(
                        &format!("{field}.original_max_position_embeddings"),
                        "missing",
                    )
                })?,
            })
        };
        let kind = match kind_name.as_str() {
            "default" => RopeKind::Default,
            "linear" => RopeKind::Linear { factor: need("factor")? },
            "llama3" => RopeKind::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: omp()?,
            },
            "yarn" => RopeKind::Yarn {
                factor: need("factor")?,
                original_max_position_embeddings: omp()?,
                beta_fast: num(params, "beta_fast")?.unwrap_or(32.0),
                beta_slow: num(params, "beta_slow")?.unwrap_or(1.0),
                mscale: num(params, "mscale")?,
                mscale_all_dim: num(params, "mscale_all_dim")?,
                attention_factor: num(params, "attention_factor")?,
                truncate: params
                    .and_then(|p| p.get("truncate"))
                    .and_then(|v| v.as_bool())
                    .unwrap_or(true),
            },
            other => {
                return Err(self.error(
                    &format!("{field}.rope_type"),
                    format!("rope type `{other}` is not supported (supported: default, linear, llama3, yarn)"),
                ))
            }
        };
        Ok(RopeParams {
            theta,
            partial_rotary_factor: partial,
            kind,
            interleaved: self.bool_or("rope_interleaved", false)?,
            freq_factors: match self.get("rope_freq_factors") {
                None => None,
                Some(Value::Array(a)) => Some(
                    a.iter()
                        .map(|v| v.as_f64())
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| {
                            self.error("rope_freq_factors", "expected a list of numbers")
                        })?,
                ),
                Some(v) => {
                    return Err(
                        self.error("rope_freq_factors", format!("expected a list, found {v}"))
                    )
                }
            },
        })
    }
}

/// RoPE settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeParams {
    pub theta: f64,
    pub partial_rotary_factor: f64,
    pub kind: RopeKind,
    /// Rotate adjacent pairs `(2i, 2i + 1)` instead of halves `(i, i + d/2)`. Set in the
    /// configuration built from a GGUF file whose Q/K rows llama.cpp's converter permuted for
    /// its "normal" RoPE (llama, mixtral); never in a Hugging Face config.json.
    pub interleaved: bool,
    /// Per-frequency divisors (GGUF's `rope_freqs` tensor, how llama.cpp stores llama 3
    /// scaling); set only in configurations built from GGUF files.
    pub freq_factors: Option<Vec<f64>>,
}

/// RoPE frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeKind {
    Default,
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
        truncate: bool,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(v: Value) -> ModelConfig {
        ModelConfig::from_value("config.json".into(), v)
    }

    #[test]
    fn both_rope_forms_agree() {
        let v5 = cfg(
            json!({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}}),
        );
        let old = cfg(
            json!({"rope_theta": 500000.0, "rope_scaling": {"type": "llama3",
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}}),
        );
        assert_eq!(v5.rope(10000.0).unwrap(), old.rope(10000.0).unwrap());
        assert_eq!(v5.rope(10000.0).unwrap().theta, 500000.0);
    }

    #[test]
    fn rope_defaults_to_the_architecture_theta() {
        let r = cfg(json!({})).rope(1e6).unwrap();
        assert_eq!(r.theta, 1e6);
        assert_eq!(r.kind, RopeKind::Default);
    }

    #[test]
    fn unknown_rope_type_names_the_field() {
        let e = cfg(json!({"rope_parameters": {"rope_type": "wavy"}}))
            .rope(1e4)
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("rope_parameters.rope_type") && msg.contains("wavy"),
            "{msg}"
        );
    }

    #[test]
    fn wrong_type_names_the_field() {
        let e = cfg(json!({"hidden_size": "big"}))
            .usize("hidden_size")
            .unwrap_err();
        assert!(e.to_string().contains("`hidden_size`"), "{e}");
        let e = cfg(json!({})).usize("num_hidden_layers").unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
    }
}
