//! Per-sequence attention state: the key/value cache of every layer.
//!
//! Every buffer holds a fixed number of values per cached token, so a cache can be cut back
//! to a prefix ([`KvCache::truncate`]) and saved byte for byte (`runtime::kv_file`). What the
//! buffers mean depends on the layer's attention kind:
//! * grouped-query attention: `k` and `v` are `[len, kv_heads · head_dim]`;
//! * multi-head latent attention (MLA): `k` is the normalised latent `[len, kv_lora_rank]`,
//!   `v` the rotated shared rope key `[len, qk_rope_head_dim]`, and `aux` the sparse-attention
//!   indexer's keys `[len, index_head_dim]` on layers that have an indexer.

/// The cached state of one attention layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Extra per-token values some attention kinds keep (the DSA indexer's keys).
    pub aux: Vec<f32>,
}

impl LayerKv {
    fn buffers_mut(&mut self) -> [&mut Vec<f32>; 3] {
        [&mut self.k, &mut self.v, &mut self.aux]
    }

    /// Values held, over every buffer.
    pub fn values(&self) -> usize {
        self.k.len() + self.v.len() + self.aux.len()
    }
}

/// The KV cache of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct KvCache {
    pub layers: Vec<LayerKv>,
    /// Tokens already processed (the position of the next token).
    pub len: usize,
    /// Most tokens this cache may hold.
    pub max_len: usize,
}

impl KvCache {
    /// An empty cache for `layers` layers holding up to `max_len` tokens.
    pub fn new(layers: usize, max_len: usize) -> KvCache {
        KvCache {
            layers: vec![LayerKv::default(); layers],
            len: 0,
            max_len,
        }
    }

    /// Forget everything.
    pub fn clear(&mut self) {
        for l in &mut self.layers {
            for b in l.buffers_mut() {
                b.clear();
            }
        }
        self.len = 0;
    }

    /// Keep only the first `len` tokens (a shared prompt prefix), dropping the rest.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        let old = self.len.max(1);
        for l in &mut self.layers {
            for b in l.buffers_mut() {
                let width = b.len() / old;
                b.truncate(len * width);
            }
        }
        self.len = len;
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.layers.iter().map(|l| l.values() * 4).sum()
    }
}
