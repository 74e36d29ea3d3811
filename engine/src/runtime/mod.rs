//! The runtime: sampling, the generation loop over a model and its cache, grammar
//! constraints, the KV-slot scheduler that batches concurrent requests, and KV files that
//! save a conversation for another process to continue. Later: speculation.

pub mod generate;
pub mod grammar;
pub mod kv_file;
pub mod loaded;
pub mod quality;
pub mod sampling;
pub mod scheduler;
pub mod speculative;
