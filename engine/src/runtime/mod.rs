//! The runtime: sampling, the generation loop over a model and its cache, grammar
//! constraints, the KV-slot scheduler that batches concurrent requests, and KV files that
//! save a conversation for another process to continue; drafts verified in one batched step
//! (`speculative`: the model's MTP head; `drafts`: prompt lookup and grammar fast-forward).

pub mod drafts;
pub mod generate;
pub mod grammar;
pub mod kv_file;
pub mod loaded;
pub mod quality;
pub mod sampling;
pub mod scheduler;
pub mod speculative;
