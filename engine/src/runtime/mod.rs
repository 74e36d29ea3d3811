//! The runtime: sampling, the generation loop over a model and its cache, grammar
//! constraints, and the KV-slot scheduler that batches concurrent requests. Later:
//! speculation.

pub mod generate;
pub mod grammar;
pub mod loaded;
pub mod quality;
pub mod sampling;
pub mod scheduler;
