//! Per-sequence attention state: the key/value cache of every layer.
//!
//! Every buffer holds a fixed number of values per cached token, so a cache can be cut back
//! to a prefix ([`KvCache::truncate`]) and saved byte for byte (`runtime::kv_file`). What the
//! buffers mean depends on the layer's attention kind:
//! * grouped-query attention: `k` and `v` are `[len, kv_heads · head_dim]`;
//! * multi-head latent attention (MLA): `k` is the normalised latent `[len, kv_lora_rank]`,
//!   `v` the rotated shared rope key `[len, qk_rope_head_dim]`, and `aux` the sparse-attention
//!   indexer's keys `[len, index_head_dim]` on layers that have an indexer.

use half::bf16;

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
}

/// A cache buffer: f32 values, or bf16 values (rounded to nearest even when stored; every
/// reader sees the stored values, so prefill and decode agree bit for bit).
#[derive(Debug, Clone, PartialEq)]
pub enum KvBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
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
        }
    }

    /// Its precision.
    pub fn dtype(&self) -> KvDType {
        match self {
            KvBuf::F32(_) => KvDType::F32,
            KvBuf::Bf16(_) => KvDType::Bf16,
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            KvBuf::F32(v) => v.len(),
            KvBuf::Bf16(v) => v.len(),
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
        }
    }

    /// Append `x`, rounded to the buffer's precision.
    pub fn extend(&mut self, x: &[f32]) {
        match self {
            KvBuf::F32(v) => v.extend_from_slice(x),
            KvBuf::Bf16(v) => v.extend(x.iter().map(|&f| bf16::from_f32(f))),
        }
    }

    /// Keep the first `n` values.
    pub fn truncate(&mut self, n: usize) {
        match self {
            KvBuf::F32(v) => v.truncate(n),
            KvBuf::Bf16(v) => v.truncate(n),
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
        }
    }

    /// Every value as f32 (exact for both precisions).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self {
            KvBuf::F32(v) => v.clone(),
            KvBuf::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }

    /// The f32 values of a buffer that attention kinds without a precision option keep.
    /// Their caches are made f32 by `new_cache` and KV files are checked against it, so
    /// another precision here is a broken invariant.
    pub fn f32(&self) -> &Vec<f32> {
        match self {
            KvBuf::F32(v) => v,
            KvBuf::Bf16(_) => panic!("this attention kind keeps an f32 cache"),
        }
    }

    /// Mutable [`KvBuf::f32`].
    pub fn f32_mut(&mut self) -> &mut Vec<f32> {
        match self {
            KvBuf::F32(v) => v,
            KvBuf::Bf16(_) => panic!("this attention kind keeps an f32 cache"),
        }
    }
}

impl From<Vec<f32>> for KvBuf {
    fn from(v: Vec<f32>) -> KvBuf {
        KvBuf::F32(v)
    }
}

/// The cached state of one attention layer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerKv {
    pub k: KvBuf,
    pub v: KvBuf,
    /// Extra per-token values some attention kinds keep (the DSA indexer's keys).
    pub aux: KvBuf,
}

impl LayerKv {
    /// An empty layer cache whose `k` and `v` hold `dtype` values (`aux` stays f32).
    pub fn with_dtype(dtype: KvDType) -> LayerKv {
        LayerKv {
            k: KvBuf::new(dtype),
            v: KvBuf::new(dtype),
            aux: KvBuf::default(),
        }
    }

    fn buffers_mut(&mut self) -> [&mut KvBuf; 3] {
        [&mut self.k, &mut self.v, &mut self.aux]
    }

    /// Values held, over every buffer.
    pub fn values(&self) -> usize {
        self.k.len() + self.v.len() + self.aux.len()
    }

    /// Bytes held, over every buffer.
    pub fn nbytes(&self) -> usize {
        self.k.nbytes() + self.v.nbytes() + self.aux.nbytes()
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
        self.layers.iter().map(|l| l.nbytes()).sum()
    }
}
