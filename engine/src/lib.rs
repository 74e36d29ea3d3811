//! colibri's inference engine.
//!
//! Modules in dependency order, each using only those above it:
//! - [`tensor`]: dtypes, weight storage, CPU kernels and the thread pool.
//! - [`format`]: checkpoint readers (safetensors, config.json, tokenizer, chat template).
//! - [`store`]: where weights live; the expert store the MoE blocks acquire experts from.
//! - [`model`]: shared layers and one file per architecture.
//! - [`runtime`]: sequences, sampling and the generation loop.
//! - [`convert`]: Hugging Face → GGUF (it quantizes, and uses the model's own RoPE, so it sits
//!   above `model`; `format` only describes).

pub mod convert;
pub mod error;
pub mod format;
pub mod model;
pub mod runtime;
pub mod store;
pub mod tensor;

pub use error::{Error, Result};
