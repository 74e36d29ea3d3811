//! Checkpoint formats: reading what people have into tensor descriptions and typed configs.
//! Readers describe; they never compute.

pub mod chat_template;
pub mod config;
pub mod fused;
pub mod generation_config;
pub mod gguf;
pub mod gguf_vocab;
pub mod safetensors;
pub mod tokenizer;
pub mod write;
