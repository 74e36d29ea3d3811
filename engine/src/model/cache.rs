//! Per-sequence state of every layer: the key/value cache of attention layers and the
//! recurrent state of linear-attention layers.
//!
//! Every key/value buffer holds a fixed number of values per cached token, so it can be cut
//! back to a prefix ([`KvCache::truncate`]) and saved byte for byte (`runtime::kv_file`). What
//! the buffers mean depends on the layer's attention kind:
//! * grouped-query attention: `k` and `v` are `[len, kv_heads · head_dim]`;
//! * multi-head latent attention (MLA): `k` is the normalised latent `[len, kv_lora_rank]`,
//!   `v` the rotated shared rope key `[len, qk_rope_head_dim]`, and `aux` the sparse-attention
//!   indexer's keys `[len, index_head_dim]` on layers that have an indexer;
//! * linear (recurrent) attention: no per-token buffers; `state` holds the short
//!   convolutions' last inputs and the recurrent matrices, a fixed size whatever the length.
//!
//! A recurrent state cannot be cut back, so a cache with one keeps [`Checkpoint`]s (copies of
//! every state at some length, taken by [`KvCache::checkpoint`]); [`KvCache::truncate`] then
//! returns to the nearest checkpoint at or before the asked length, and the caller recomputes
//! the tokens between (which gives the same bits: prefill and decode share one order).

use half::{bf16, f16};

/// Precision of a cache buffer (`--kv-dtype`; latent attention's cache may be kept in bf16).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum KvDType {
    /// 32-bit floats.
    #[default]
    F32,
    /// bfloat16: half the bytes, values rounded when stored.
    Bf16,
    /// IEEE half precision: not an option, but how grouped-query attention keeps its keys and
    /// values when it runs at llama.cpp's f16 precision (GGUF files): the values are rounded
    /// to f16 before they are cached, so storing them as f16 is exact and halves the bytes
    /// attention reads.
    #[serde(skip)]
    #[cfg_attr(feature = "clap", value(skip))]
    F16,
}

impl KvDType {
    /// Bytes of one value.
    pub fn bytes(self) -> usize {
        match self {
            KvDType::F32 => 4,
            KvDType::Bf16 | KvDType::F16 => 2,
        }
    }
}

/// A cache buffer: f32 values, or bf16 or f16 values (rounded to nearest even when stored;
/// every reader sees the stored values, so prefill and decode agree bit for bit).
#[derive(Debug, Clone, PartialEq)]
pub enum KvBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl Default for KvBuf {
    fn default() -> KvBuf {
        KvBuf::F32(Vec::new())
    }
}

impl KvBuf {
    /// An empty buffer of `dtype`.
    pub fn new(dtype: KvDType) -> KvBuf {
        match dtype {
            KvDType::F32 => KvBuf::F32(Vec::new()),
            KvDType::Bf16 => KvBuf::Bf16(Vec::new()),
            KvDType::F16 => KvBuf::F16(Vec::new()),
        }
    }

    /// Its precision.
    pub fn dtype(&self) -> KvDType {
        match self {
            KvBuf::F32(_) => KvDType::F32,
            KvBuf::Bf16(_) => KvDType::Bf16,
            KvBuf::F16(_) => KvDType::F16,
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            KvBuf::F32(v) => v.len(),
            KvBuf::Bf16(v) => v.len(),
            KvBuf::F16(v) => v.len(),
        }
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        match self {
            KvBuf::F32(v) => 4 * v.len(),
            KvBuf::Bf16(v) => 2 * v.len(),
            KvBuf::F16(v) => 2 * v.len(),
        }
    }

    /// Append `x`, rounded to the buffer's precision.
    pub fn extend(&mut self, x: &[f32]) {
        match self {
            KvBuf::F32(v) => v.extend_from_slice(x),
            KvBuf::Bf16(v) => v.extend(x.iter().map(|&f| bf16::from_f32(f))),
            KvBuf::F16(v) => v.extend(x.iter().map(|&f| f16::from_f32(f))),
        }
    }

    /// Keep the first `n` values.
    pub fn truncate(&mut self, n: usize) {
        match self {
            KvBuf::F32(v) => v.truncate(n),
            KvBuf::Bf16(v) => v.truncate(n),
            KvBuf::F16(v) => v.truncate(n),
        }
    }

    /// Drop every value.
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Values `range` as a kernel operand.
    pub fn data(&self, range: std::ops::Range<usize>) -> crate::tensor::WeightData<'_> {
        match self {
            KvBuf::F32(v) => crate::tensor::WeightData::F32(&v[range]),
            KvBuf::Bf16(v) => crate::tensor::WeightData::BF16(&v[range]),
            KvBuf::F16(v) => crate::tensor::WeightData::F16(&v[range]),
        }
    }

    /// Values `range` as f32 into `out`.
    pub fn read(&self, range: std::ops::Range<usize>, out: &mut [f32]) {
        match self {
            KvBuf::F32(v) => out.copy_from_slice(&v[range]),
            KvBuf::Bf16(v) => {
                for (o, x) in out.iter_mut().zip(&v[range]) {
                    *o = x.to_f32();
                }
            }
            KvBuf::F16(v) => {
                for (o, x) in out.iter_mut().zip(&v[range]) {
                    *o = x.to_f32();
                }
            }
        }
    }

    /// Every value as f32 (exact for every precision).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            KvBuf::F32(v) => v.clone(),
            KvBuf::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            KvBuf::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// The f32 values of a buffer that attention kinds without a precision option keep.
    /// Their caches are made f32 by `new_cache` and KV files are checked against it, so
    /// another precision here is a broken invariant.
    pub fn f32(&self) -> &Vec<f32> {
        match self {
            KvBuf::F32(v) => v,
            KvBuf::Bf16(_) | KvBuf::F16(_) => panic!("this attention kind keeps an f32 cache"),
        }
    }

    /// Mutable [`KvBuf::f32`].
    pub fn f32_mut(&mut self) -> &mut Vec<f32> {
        match self {
            KvBuf::F32(v) => v,
            KvBuf::Bf16(_) | KvBuf::F16(_) => panic!("this attention kind keeps an f32 cache"),
        }
    }
}

impl From<Vec<f32>> for KvBuf {
    fn from(v: Vec<f32>) -> KvBuf {
        KvBuf::F32(v)
    }
}

/// The cached state of one layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerKv {
    pub k: KvBuf,
    pub v: KvBuf,
    /// Extra per-token values some attention kinds keep (the DSA indexer's keys).
    pub aux: KvBuf,
    /// A linear-attention layer's recurrent state (its size fixed by the layer, zeros at the
    /// start); empty for attention layers.
    pub state: Vec<f32>,
}

impl LayerKv {
    /// An empty layer cache whose `k` and `v` hold `dtype` values (`aux` stays f32).
    pub fn with_dtype(dtype: KvDType) -> LayerKv {
        LayerKv {
            k: KvBuf::new(dtype),
            v: KvBuf::new(dtype),
            aux: KvBuf::default(),
            state: Vec::new(),
        }
    }

    /// The cache of a linear-attention layer: a zero state of `values` values.
    pub fn recurrent(values: usize) -> LayerKv {
        LayerKv {
            state: vec![0.0; values],
            ..LayerKv::default()
        }
    }

    fn buffers_mut(&mut self) -> [&mut KvBuf; 3] {
        [&mut self.k, &mut self.v, &mut self.aux]
    }

    /// Values held, over every per-token buffer.
    pub fn values(&self) -> usize {
        self.k.len() + self.v.len() + self.aux.len()
    }

    /// Bytes held, over every buffer and the recurrent state.
    pub fn nbytes(&self) -> usize {
        self.k.nbytes() + self.v.nbytes() + self.aux.nbytes() + 4 * self.state.len()
    }
}

/// Every layer's recurrent state at one length of the sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// Tokens processed when it was taken.
    pub len: usize,
    /// Per layer, its `state` then (empty for attention layers).
    pub states: Vec<Vec<f32>>,
}

/// What [`KvCache::begin_draft`] changed, for [`KvCache::end_draft`] to undo.
#[derive(Debug)]
#[must_use = "hand it to KvCache::end_draft"]
pub struct DraftCheckpoint {
    /// The length of the checkpoint it added.
    added: Option<usize>,
    /// The oldest checkpoint, taken out to make room.
    evicted: Option<Checkpoint>,
}

/// How many checkpoints a cache keeps (the most recent ones): enough for the end of the last
/// turns and the last prefill chunks, bounded because a big model's state is tens of MB.
pub const MAX_CHECKPOINTS: usize = 4;

/// The KV cache of one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct KvCache {
    pub layers: Vec<LayerKv>,
    /// Tokens already processed (the position of the next token).
    pub len: usize,
    /// Most tokens this cache may hold.
    pub max_len: usize,
    /// Saved recurrent states, oldest first (see [`KvCache::truncate`]); always empty for a
    /// model without linear-attention layers.
    pub checkpoints: Vec<Checkpoint>,
}

impl KvCache {
    /// An empty cache for `layers` layers holding up to `max_len` tokens.
    pub fn new(layers: usize, max_len: usize) -> KvCache {
        KvCache {
            layers: vec![LayerKv::default(); layers],
            len: 0,
            max_len,
            checkpoints: Vec::new(),
        }
    }

    /// Whether a layer keeps a recurrent state (so truncation needs a checkpoint).
    pub fn is_recurrent(&self) -> bool {
        self.layers.iter().any(|l| !l.state.is_empty())
    }

    /// Forget everything: no tokens, zero recurrent states, no checkpoints.
    pub fn clear(&mut self) {
        for l in &mut self.layers {
            for b in l.buffers_mut() {
                b.clear();
            }
            l.state.fill(0.0);
        }
        self.checkpoints.clear();
        self.len = 0;
    }

    /// Save every recurrent state at the current length (a no-op without recurrent layers, or
    /// when the newest checkpoint is already at this length), keeping the newest
    /// [`MAX_CHECKPOINTS`].
    pub fn checkpoint(&mut self) {
        if !self.is_recurrent() || self.checkpoints.last().is_some_and(|c| c.len == self.len) {
            return;
        }
        if self.checkpoints.len() == MAX_CHECKPOINTS {
            self.checkpoints.remove(0);
        }
        self.checkpoints.push(Checkpoint {
            len: self.len,
            states: self.layers.iter().map(|l| l.state.clone()).collect(),
        });
    }

    /// Before rows that may be cut back again (a draft being verified): save the recurrent
    /// states at the current length as [`KvCache::checkpoint`] does, but keep what that would
    /// evict, so [`KvCache::end_draft`] can put the checkpoints back as they were — drafting
    /// must not cost a later prompt the checkpoint it would branch off from. A no-op without
    /// recurrent layers.
    pub fn begin_draft(&mut self) -> DraftCheckpoint {
        if !self.is_recurrent() || self.checkpoints.last().is_some_and(|c| c.len == self.len) {
            return DraftCheckpoint {
                added: None,
                evicted: None,
            };
        }
        let evicted =
            (self.checkpoints.len() == MAX_CHECKPOINTS).then(|| self.checkpoints.remove(0));
        self.checkpoint();
        DraftCheckpoint {
            added: Some(self.len),
            evicted,
        }
    }

    /// After the draft's rows were kept or cut back ([`KvCache::truncate`]): drop the checkpoint
    /// [`KvCache::begin_draft`] added and restore the one it displaced.
    pub fn end_draft(&mut self, mark: DraftCheckpoint) {
        if let Some(len) = mark.added {
            self.checkpoints.retain(|c| c.len != len);
        }
        if let Some(c) = mark.evicted {
            if c.len <= self.len && self.checkpoints.len() < MAX_CHECKPOINTS {
                self.checkpoints.insert(0, c);
            }
        }
    }

    /// Go back to at most the first `len` tokens (a shared prompt prefix, a rejected draft),
    /// dropping the rest, and return the length kept. Without recurrent layers that is `len`.
    /// With them it is the length of the newest checkpoint at or before `len` (0, the zero
    /// state, if there is none): the caller recomputes the tokens from there to `len`.
    pub fn truncate(&mut self, len: usize) -> usize {
        if len >= self.len {
            return self.len;
        }
        let keep = if self.is_recurrent() {
            self.checkpoints.retain(|c| c.len <= len);
            match self.checkpoints.last() {
                Some(c) => {
                    for (l, s) in self.layers.iter_mut().zip(&c.states) {
                        l.state.copy_from_slice(s);
                    }
                    c.len
                }
                None => {
                    for l in &mut self.layers {
                        l.state.fill(0.0);
                    }
                    0
                }
            }
        } else {
            len
        };
        let old = self.len.max(1);
        for l in &mut self.layers {
            for b in l.buffers_mut() {
                let width = b.len() / old;
                b.truncate(keep * width);
            }
        }
        self.len = keep;
        keep
    }

    /// Bytes held: the per-token buffers, the recurrent states and their checkpoints.
    pub fn nbytes(&self) -> usize {
        let checkpoints: usize = self
            .checkpoints
            .iter()
            .flat_map(|c| &c.states)
            .map(|s| 4 * s.len())
            .sum();
        self.layers.iter().map(|l| l.nbytes()).sum::<usize>() + checkpoints
    }

    /// Bytes of the recurrent states alone (constant in the length).
    pub fn state_bytes(&self) -> usize {
        self.layers.iter().map(|l| 4 * l.state.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache of one attention layer (2 values per token) and one recurrent layer, at
    /// `len` tokens whose state is `len` in every value.
    fn grown(len: usize, cache: &mut KvCache) {
        while cache.len < len {
            cache.layers[0].k.extend(&[cache.len as f32, 0.5]);
            cache.len += 1;
            cache.layers[1].state.fill(cache.len as f32);
        }
    }

    #[test]
    fn truncation_returns_to_the_newest_checkpoint_at_or_before() {
        let mut cache = KvCache::new(2, 64);
        cache.layers[1] = LayerKv::recurrent(3);
        assert!(cache.is_recurrent());
        grown(4, &mut cache);
        cache.checkpoint();
        grown(9, &mut cache);
        cache.checkpoint();
        grown(12, &mut cache);
        // Between the checkpoints: back to 4, the state as it was at 4, 4 rows kept.
        assert_eq!(cache.truncate(7), 4);
        assert_eq!(cache.len, 4);
        assert_eq!(cache.layers[1].state, vec![4.0; 3]);
        assert_eq!(cache.layers[0].k.len(), 8);
        assert_eq!(cache.checkpoints.len(), 1);
        // Regrowing from there equals never having cut.
        grown(12, &mut cache);
        let mut fresh = KvCache::new(2, 64);
        fresh.layers[1] = LayerKv::recurrent(3);
        grown(12, &mut fresh);
        assert_eq!(cache.layers, fresh.layers);
        // Before every checkpoint: back to the zero state.
        assert_eq!(cache.truncate(3), 0);
        assert_eq!(cache.layers[1].state, vec![0.0; 3]);
        assert!(cache.layers[0].k.is_empty());
    }

    #[test]
    fn attention_caches_truncate_exactly_and_take_no_checkpoints() {
        let mut cache = KvCache::new(1, 64);
        cache.layers[0].k.extend(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        cache.len = 3;
        cache.checkpoint();
        assert!(cache.checkpoints.is_empty());
        assert_eq!(cache.truncate(2), 2);
        assert_eq!(cache.layers[0].k.to_f32_vec(), vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(cache.truncate(5), 2);
    }

    #[test]
    fn only_the_newest_checkpoints_are_kept() {
        let mut cache = KvCache::new(1, 64);
        cache.layers[0] = LayerKv::recurrent(1);
        for n in 1..=MAX_CHECKPOINTS + 2 {
            cache.len = n;
            cache.checkpoint();
            cache.checkpoint();
        }
        let lens: Vec<usize> = cache.checkpoints.iter().map(|c| c.len).collect();
        assert_eq!(lens, (3..=MAX_CHECKPOINTS + 2).collect::<Vec<_>>());
    }

    #[test]
    fn a_draft_checkpoint_leaves_the_kept_ones_as_they_were() {
        let mut cache = KvCache::new(1, 64);
        cache.layers[0] = LayerKv::recurrent(1);
        for n in 1..=MAX_CHECKPOINTS {
            cache.len = n;
            cache.layers[0].state[0] = n as f32;
            cache.checkpoint();
        }
        let kept = cache.checkpoints.clone();
        // A draft after a full set: rejected (back to its checkpoint), then accepted.
        cache.len = 10;
        cache.layers[0].state[0] = 10.0;
        let mark = cache.begin_draft();
        assert_eq!(cache.checkpoints.last().unwrap().len, 10);
        cache.len = 13;
        cache.layers[0].state[0] = 13.0;
        assert_eq!(cache.truncate(11), 10);
        assert_eq!(cache.layers[0].state, vec![10.0]);
        cache.end_draft(mark);
        assert_eq!(cache.checkpoints, kept);
        let mark = cache.begin_draft();
        cache.len = 14;
        cache.end_draft(mark);
        assert_eq!(cache.checkpoints, kept);
        // At a length that already has a checkpoint nothing is added or removed.
        cache.len = MAX_CHECKPOINTS;
        let mark = cache.begin_draft();
        cache.end_draft(mark);
        assert_eq!(cache.checkpoints, kept);
        // Attention caches take none.
        let mut plain = KvCache::new(1, 64);
        let mark = plain.begin_draft();
        assert!(plain.checkpoints.is_empty());
        plain.end_draft(mark);
    }
}
