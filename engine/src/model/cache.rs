//! Per-sequence attention state: the key/value cache of every layer.

/// Keys and values of one attention layer, `[len, kv_heads · head_dim]` each.
#[derive(Debug, Clone, Default)]
pub struct LayerKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// The KV cache of one sequence.
#[derive(Debug, Clone)]
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
            l.k.clear();
            l.v.clear();
        }
        self.len = 0;
    }

    /// Keep only the first `len` tokens (a shared prompt prefix), dropping the rest.
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        for l in &mut self.layers {
            let k_width = l.k.len() / self.len.max(1);
            let v_width = l.v.len() / self.len.max(1);
            l.k.truncate(len * k_width);
            l.v.truncate(len * v_width);
        }
        self.len = len;
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| (l.k.len() + l.v.len()) * 4)
            .sum()
    }
}
