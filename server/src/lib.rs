//! The library behind `coli` (`src/main.rs` is only its argument parser): the HTTP server
//! (`serve`), the operator commands, the tool-call and reasoning readers (`tool_calls`) and
//! the chat client. It is a library so that the fuzz targets (`fuzz/`) and tests can reach the
//! request types and parsers; nothing outside this workspace is meant to depend on it.

pub mod bench;
pub mod chat_client;
pub mod config;
pub mod convert;
pub mod demo;
pub mod doctor;
pub mod engine_options;
pub mod generate_cmd;
pub mod info;
pub mod kl;
pub mod logits;
pub mod machine;
pub mod mirror_cmd;
pub mod model_arg;
pub mod plan;
pub mod serve;
pub mod tool_calls;
pub mod tune;
