//! The runtime: sampling and the generation loop over a model and its cache. Later: KV slots,
//! scheduling, grammar and speculation.

pub mod generate;
pub mod loaded;
pub mod quality;
pub mod sampling;
