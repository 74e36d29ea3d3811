//! The standard pre-norm decoder stack every family runs: per layer an attention part and a
//! feed-forward part, each reading `Norm(h)` and writing back through the layer's
//! [`Residual`] (`h += f(Norm(h))`, or hyper-connection streams), then a final norm and the LM
//! head. Families differ only in how they fill these parts from their checkpoint (see their
//! files): the attention kind ([`SelfAttention`]), the feed-forward kind ([`Ffn`]), the
//! residual kind and the residual's layout ([`Streams`]), short convolutions on the parts'
//! outputs ([`PostConv`]), and what is done to the embedding and the logits
//! ([`Transformer::embed_norm`], [`LogitForm`]). So batching (one `forward_batch` over every
//! sequence's rows), prefetch and the MTP drafter reach every family.

use std::time::Instant;

use std::borrow::Cow;

use super::cache::KvCache;
use super::inkling::RelAttention;
use super::layers::{
    add_assign, embed, rows_of, unweighted_rms, Attention, HashRoutedMoe, HyperConnection,
    HyperHead, HyperMix, Linear, Mlp, MoeBlock, RmsNorm,
};
use super::linear_attention::{LinearAttention, ShortConv};
use super::mla::{CompressedAttention, Mla, Selection};
use super::telemetry::{self, Part};
use super::{BatchItem, CausalLm, Logits, ModelInfo};
use crate::tensor::Tensor;
use crate::{Error, Result};

/// A decoder layer's feed-forward part.
#[allow(clippy::large_enum_variant)] // one per layer, never moved in a hot path
pub enum Ffn {
    /// A dense (SwiGLU) MLP.
    Dense(Mlp),
    /// A dense MLP whose output is multiplied by a learned scalar (Inkling's
    /// `mlp.global_scale`).
    ScaledDense { mlp: Mlp, scale: f32 },
    /// A routed mixture of experts, the router choosing from the hidden state.
    Moe(MoeBlock),
    /// A mixture of experts whose experts are fixed by the token id (DeepSeek-V4's hash
    /// layers).
    HashMoe(HashRoutedMoe),
}

impl Ffn {
    /// The dense SwiGLU MLP `{p}.mlp` of width `intermediate_size`, as most families' dense
    /// layers are.
    pub fn dense(
        ckpt: &crate::format::safetensors::Checkpoint,
        cfg: &crate::format::config::ModelConfig,
        p: &str,
        d: usize,
    ) -> Result<Ffn> {
        let inter = cfg.dim("intermediate_size")?;
        Ok(Ffn::Dense(Mlp::load(
            ckpt,
            &format!("{p}.mlp"),
            d,
            inter,
            false,
        )?))
    }

    /// The routed-expert block, if the part has one.
    pub fn moe(&self) -> Option<&MoeBlock> {
        match self {
            Ffn::Dense(_) | Ffn::ScaledDense { .. } => None,
            Ffn::Moe(m) => Some(m),
            Ffn::HashMoe(h) => Some(&h.moe),
        }
    }
}

/// A decoder layer's attention part.
#[allow(clippy::large_enum_variant)] // one per layer, never moved in a hot path
pub enum SelfAttention {
    /// Grouped-query attention over per-head keys and values.
    Gqa(Attention),
    /// Multi-head latent attention, optionally sparse (DSA).
    Mla(Mla),
    /// DeepSeek-V4's attention: one key/value head over a sliding window and compressed
    /// entries, with learned sinks.
    Compressed(CompressedAttention),
    /// Linear (recurrent) attention: a fixed-size state per sequence instead of a cache that
    /// grows (Gated DeltaNet, Kimi Delta Attention).
    Linear(LinearAttention),
    /// RoPE-free attention with short convolutions on keys and values and a relative
    /// position bias conditioned on the hidden state (Inkling, Inkling 2).
    Relative(RelAttention),
}

impl SelfAttention {
    /// The output projection of attention rows (any number of sequences, stacked).
    pub fn output(&self, rows: &[f32]) -> Vec<f32> {
        match self {
            SelfAttention::Gqa(a) => a.o.forward(rows),
            SelfAttention::Mla(m) => m.o.forward(rows),
            SelfAttention::Compressed(c) => c.output(rows),
            SelfAttention::Linear(l) => l.out.forward(rows),
            SelfAttention::Relative(r) => r.o.forward(rows),
        }
    }

    /// Bytes one token adds to this layer's cache, and what full (per-head K and V, f32)
    /// attention of the same shape would store.
    pub fn cache_bytes_per_token(&self) -> (usize, usize) {
        match self {
            SelfAttention::Gqa(a) => {
                let n = 2 * a.kv_heads * a.head_dim;
                (a.kv_dtype().bytes() * n, 4 * n)
            }
            SelfAttention::Mla(m) => (
                m.cache_bytes_per_token(),
                4 * m.heads * (m.nope_dim + m.rope_dim + m.v_dim),
            ),
            SelfAttention::Compressed(c) => {
                (c.cache_bytes_per_token(), 4 * 2 * c.heads * c.head_dim)
            }
            SelfAttention::Linear(_) => (0, 0),
            SelfAttention::Relative(r) => {
                let n = 4 * 2 * r.kv_heads * r.head_dim;
                (n, n)
            }
        }
    }

    /// Values of the fixed-size state one sequence keeps in this layer (convolution windows
    /// and linear attention's recurrent matrices; 0 for attention that only caches tokens):
    /// the start of its [`LayerKv::state`](super::cache::LayerKv::state).
    pub fn state_len(&self) -> usize {
        match self {
            SelfAttention::Linear(l) => l.state_len(),
            SelfAttention::Relative(r) => r.state_len(),
            _ => 0,
        }
    }
}

/// How a layer's two parts read the residual and write their output back into it.
#[allow(clippy::large_enum_variant)] // one per layer, never moved in a hot path
pub enum Residual {
    /// One residual row per token: `h += f(Norm(h))`.
    Plain,
    /// Manifold-constrained hyper-connections (DeepSeek-V4): the residual is several streams
    /// per token ([`Streams::Hyper`]); each part reads a weighted sum of them and its output
    /// is mixed back in by the part's own Sinkhorn-normalised weights.
    Hyper {
        attn: HyperConnection,
        ffn: HyperConnection,
    },
    /// Block attention residuals (Inkling 2): the residual is the current partial sum plus
    /// the completed block states ([`Streams::Blocks`]); each part reads a softmax mix of
    /// them ([`BlockResidual`]).
    Blocks(BlockResidual),
}

/// One layer's block attention residuals (Inkling 2, arch doc 2.14). Per token the residual
/// holds the partial sum `h` of the current block and the completed block states
/// `B_0 … B_{n−1}`; a part's input is `softmax(q · Ŝᵀ / √D) · Ŝ` over the stack
/// `S = [B_0 … B_{n−1}, h]`, each entry RMS-normalised without a weight (`Ŝ`, f32), one
/// output per learned query `q`. A layer that opens a block (`boundary`) stores its input as
/// block state `B_n` and restarts the partial sum from its attention output.
pub struct BlockResidual {
    /// The attention part's queries, `[inputs, D]` (one per input the attention reads: 3,
    /// for queries, keys and values, on Inkling 2's full-attention layers); `None` on the
    /// first layer, which reads `h` itself (`inputs` times).
    pub attn_queries: Option<Vec<f32>>,
    /// How many inputs the attention part reads, side by side in one row.
    pub attn_inputs: usize,
    /// The feed-forward part's query `[D]`.
    pub ffn_query: Vec<f32>,
    /// Completed block states before this layer.
    pub blocks: usize,
    /// The layer opens a block.
    pub boundary: bool,
    /// Block states every token's residual has room for ([`Streams::Blocks`]).
    pub slots: usize,
}

impl BlockResidual {
    /// The input of `part` from the residual rows `h`: `[T, attn_inputs · D]` for the
    /// attention part, `[T, D]` for the feed-forward part (whose stack includes the block
    /// state this layer's attention part stored, if it opens a block).
    fn read(&self, part: Sublayer, h: &[f32], d: usize) -> Vec<f32> {
        let width = (1 + self.slots) * d;
        let mut out = Vec::with_capacity(h.len() / (1 + self.slots) * self.attn_inputs);
        for row in h.chunks(width) {
            match (part, &self.attn_queries) {
                (Sublayer::Attention, None) => {
                    for _ in 0..self.attn_inputs {
                        out.extend_from_slice(&row[..d]);
                    }
                }
                (Sublayer::Attention, Some(q)) => attend_blocks(row, self.blocks, q, d, &mut out),
                (Sublayer::Ffn, _) => attend_blocks(
                    row,
                    self.blocks + usize::from(self.boundary),
                    &self.ffn_query,
                    d,
                    &mut out,
                ),
            }
        }
        out
    }

    /// Put `part`'s output `y` (`[T, D]`) back: the partial sum grows by it, or, for the
    /// attention part of a layer that opens a block, the partial sum becomes block state
    /// `blocks` and `y` the new partial sum.
    fn write(&self, part: Sublayer, h: &mut [f32], y: &[f32], d: usize) {
        let width = (1 + self.slots) * d;
        for (row, yt) in h.chunks_mut(width).zip(y.chunks(d)) {
            if matches!(part, Sublayer::Attention) && self.boundary {
                let (partial, states) = row.split_at_mut(d);
                states[self.blocks * d..(self.blocks + 1) * d].copy_from_slice(partial);
                partial.copy_from_slice(yt);
            } else {
                add_assign(&mut row[..d], yt);
            }
        }
    }
}

/// The block attention residual of one token: queries `queries` (`[n, D]`) over the first
/// `blocks` block states of `row` (the `[h | B_0 | …]` layout of [`Streams::Blocks`]) and
/// its partial sum `h`, stacked in the order `B_0 … B_{blocks−1}, h`; `n` outputs of `d`.
fn attend_blocks(row: &[f32], blocks: usize, queries: &[f32], d: usize, out: &mut Vec<f32>) {
    let mut stack: Vec<f32> = Vec::with_capacity((blocks + 1) * d);
    stack.extend_from_slice(&row[d..(blocks + 1) * d]);
    stack.extend_from_slice(&row[..d]);
    unweighted_rms(&mut stack, d, 1e-6);
    let scale = (d as f64).powf(-0.5) as f32;
    let isa = crate::tensor::kernels::Isa::detect();
    for q in queries.chunks(d) {
        let mut p: Vec<f32> = stack
            .chunks(d)
            .map(|s| crate::tensor::kernels::dot(isa, q, crate::tensor::WeightData::F32(s)) * scale)
            .collect();
        // As torch's CPU scaled_dot_product_attention: the values weighted by
        // `exp(logit − max)`, then divided by their sum.
        let max = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for v in p.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        let start = out.len();
        out.resize(start + d, 0.0);
        let o = &mut out[start..];
        for (w, s) in p.iter().zip(stack.chunks(d)) {
            for (oo, ss) in o.iter_mut().zip(s) {
                *oo += w * ss;
            }
        }
        o.iter_mut().for_each(|v| *v /= sum);
    }
}

/// Which of a layer's two parts the residual is serving.
#[derive(Clone, Copy)]
enum Sublayer {
    Attention,
    Ffn,
}

impl Residual {
    /// The input of `part` (before its norm) from the residual rows `h`, and what
    /// [`Residual::write`] needs to put the part's output back.
    fn read<'h>(
        &self,
        part: Sublayer,
        h: &'h [f32],
        d: usize,
    ) -> (Cow<'h, [f32]>, Option<HyperMix>) {
        match self {
            Residual::Plain => (Cow::Borrowed(h), None),
            Residual::Hyper { attn, ffn } => {
                let hc = match part {
                    Sublayer::Attention => attn,
                    Sublayer::Ffn => ffn,
                };
                let (u, mix) = hc.weights(h, d);
                (Cow::Owned(u), Some(mix))
            }
            Residual::Blocks(b) => (Cow::Owned(b.read(part, h, d)), None),
        }
    }

    /// Put `part`'s output `y` (`[T, D]`) back into the residual rows `h`.
    fn write(&self, part: Sublayer, h: &mut [f32], y: &[f32], mix: Option<HyperMix>, d: usize) {
        match (self, mix) {
            (Residual::Hyper { attn, ffn }, Some(mix)) => {
                let hc = match part {
                    Sublayer::Attention => attn,
                    Sublayer::Ffn => ffn,
                };
                hc.mix(h, y, &mix, d);
            }
            (Residual::Blocks(b), _) => b.write(part, h, y, d),
            _ => add_assign(h, y),
        }
    }
}

/// The layout of the residual of every token, from the embedding to the final norm.
#[allow(clippy::large_enum_variant)] // one per model, never moved in a hot path
pub enum Streams {
    /// One row of `hidden_size` values.
    One,
    /// `head.hc` hyper-connection streams, each a copy of the embedding at the start,
    /// collapsed by `head` before the final norm (DeepSeek-V4).
    Hyper(HyperHead),
    /// This many hyper-connection streams, each a copy of the embedding at the start,
    /// collapsed by their plain mean before the final norm (GLM-5-next).
    HyperMean(usize),
    /// Block attention residuals (Inkling 2, [`BlockResidual`]): the partial sum, then room
    /// for `slots` block states (zeros until a layer stores one), collapsed before the final
    /// norm by the block attention residual of `query` (`[D]`) over all of them.
    Blocks { slots: usize, query: Vec<f32> },
}

impl Streams {
    /// Streams per token.
    fn count(&self) -> usize {
        match self {
            Streams::One => 1,
            Streams::Hyper(head) => head.hc,
            Streams::HyperMean(hc) => *hc,
            Streams::Blocks { slots, .. } => 1 + slots,
        }
    }

    /// Residual values per token for rows of `d`.
    pub fn width(&self, d: usize) -> usize {
        self.count() * d
    }

    /// The residual rows of embeddings `e` (`[T, D]`).
    fn spread(&self, e: Vec<f32>, d: usize) -> Vec<f32> {
        if matches!(self, Streams::One) {
            return e;
        }
        let hc = self.count();
        let mut x = Vec::with_capacity(e.len() * hc);
        for row in e.chunks(d) {
            if let Streams::Blocks { slots, .. } = self {
                x.extend_from_slice(row);
                x.resize(x.len() + slots * d, 0.0);
                continue;
            }
            for _ in 0..hc {
                x.extend_from_slice(row);
            }
        }
        x
    }

    /// Residual rows collapsed to one row of `d` per token, for the final norm.
    fn collapse<'x>(&self, x: &'x [f32], d: usize) -> Cow<'x, [f32]> {
        match self {
            Streams::One => Cow::Borrowed(x),
            Streams::Hyper(head) => Cow::Owned(head.collapse(x, d)),
            Streams::HyperMean(hc) => {
                let mut y = Vec::with_capacity(x.len() / hc);
                for xt in x.chunks(hc * d) {
                    let start = y.len();
                    y.extend_from_slice(&xt[..d]);
                    for stream in xt[d..].chunks(d) {
                        add_assign(&mut y[start..], stream);
                    }
                    y[start..].iter_mut().for_each(|v| *v /= *hc as f32);
                }
                Cow::Owned(y)
            }
            Streams::Blocks { slots, query } => {
                let mut y = Vec::with_capacity(x.len() / (1 + slots));
                for row in x.chunks((1 + slots) * d) {
                    attend_blocks(row, *slots, query, d, &mut y);
                }
                Cow::Owned(y)
            }
        }
    }
}

/// One decoder layer.
pub struct Block {
    pub attn_norm: RmsNorm,
    pub attn: SelfAttention,
    pub ffn_norm: RmsNorm,
    pub ffn: Ffn,
    /// How the two parts read and write the residual.
    pub residual: Residual,
    /// Short convolutions over each part's output before it reaches the residual.
    pub post_conv: Option<PostConv>,
}

impl Block {
    /// Values of the fixed-size state one sequence keeps in this layer: the attention
    /// part's ([`SelfAttention::state_len`]), then the [`PostConv`] windows.
    pub fn state_len(&self) -> usize {
        self.attn.state_len() + self.post_conv.as_ref().map_or(0, PostConv::state_len)
    }
}

/// Causal short convolutions with a residual over the output of a layer's attention part
/// and of its feed-forward part (Inkling's `attn_sconv` / `mlp_sconv`):
/// `y ← (y + conv(y)) / divisor` ([`ShortConv::forward_residual`]) per sequence, each
/// sequence's last inputs kept in its cache after the attention part's own state.
pub struct PostConv {
    pub attn: ShortConv,
    pub ffn: ShortConv,
    /// 1 for Inkling, `√(K + 1)` for Inkling 2.
    pub divisor: f32,
}

impl PostConv {
    /// Values of the state it keeps (both windows).
    pub fn state_len(&self) -> usize {
        self.attn.state_len() + self.ffn.state_len()
    }

    /// Convolve `part`'s output rows `y` (`[T, D]`, every sequence of `seqs` in turn), each
    /// sequence's window at `offset` of its layer state.
    fn apply(&self, part: Sublayer, y: &mut [f32], seqs: &mut [SeqPart<'_>], offset: usize) {
        let (conv, at) = match part {
            Sublayer::Attention => (&self.attn, offset),
            Sublayer::Ffn => (&self.ffn, offset + self.attn.state_len()),
        };
        let d = conv.channels;
        let mut row = 0;
        for s in seqs.iter_mut() {
            let state = &mut s.kv.state[at..at + conv.state_len()];
            conv.forward_residual(&mut y[row * d..(row + s.rows) * d], state, self.divisor);
            row += s.rows;
        }
    }
}

/// What is done between the final norm and the logits beyond `lm_head(norm(h))`, as the
/// family's head computes it.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogitForm {
    /// The normed rows are divided by this before the head (Inkling's μP
    /// `logits_mup_width_multiplier`).
    pub divide: Option<f32>,
    /// `c · tanh(logits / c)` (Inkling 2's `final_logit_softcapping`).
    pub softcap: Option<f32>,
    /// Only the first this many logits are tokens (`unpadded_vocab_size`: the head's rows
    /// are padded); rows are cut to it.
    pub vocab: Option<usize>,
}

/// One sequence's share of a block's rows: `rows` rows at positions `start..`, its cache
/// of this layer and its sparse-attention pick.
struct SeqPart<'a> {
    rows: usize,
    start: usize,
    kv: &'a mut super::cache::LayerKv,
    selection: &'a mut Option<Selection>,
}

/// `attend(part)` for every sequence's part of a batch, results in order: in one parallel
/// step when there are several (a batch of decode rows hands the pool one step per layer
/// instead of one per sequence, each sequence's attention splitting further inside it), else
/// on this thread. A sequence's attention is computed the same way either way: the same bits.
fn per_sequence<P: Send, R: Send>(parts: Vec<P>, attend: impl Fn(P) -> R + Sync + Send) -> Vec<R> {
    use rayon::prelude::*;
    if parts.len() > 1 {
        parts.into_par_iter().map(attend).collect()
    } else {
        parts.into_iter().map(attend).collect()
    }
}

/// A pre-norm decoder-only transformer.
pub struct Transformer {
    pub embed: Tensor,
    pub blocks: Vec<Block>,
    pub norm: RmsNorm,
    pub lm_head: Linear,
    pub info: ModelInfo,
    /// The routed-expert store, if the model has one.
    pub store: Option<std::sync::Arc<dyn crate::store::ExpertStore>>,
    /// The multi-token-prediction head, when the checkpoint has one and drafting asked for it.
    pub mtp: Option<MtpHead>,
    /// The residual's layout (one row, or hyper-connection streams, per token).
    pub streams: Streams,
    /// RMSNorm of the embedding rows (Inkling's normed embedding).
    pub embed_norm: Option<RmsNorm>,
    /// What is done to the head's input and output besides the head itself.
    pub logits: LogitForm,
}

/// A DeepSeek-style multi-token-prediction (MTP) head: from the main model's final-normed
/// hidden state at position `i` and the embedding of token `i + 1`, one more decoder layer
/// predicts token `i + 2`:
/// `logits = head(norm(Block(eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]))))`.
/// Checkpoints carry it as layer `num_hidden_layers` (`enorm`, `hnorm`, `eh_proj`,
/// `shared_head.{norm,head}` and a full decoder layer); transformers does not run it, so no
/// oracle checks it. Its drafts are only ever proposals the main model verifies.
///
/// With hyper-connection streams (DeepSeek-V4, `mtp.0.*`) the hidden state is the main model's
/// streams before their final collapse; each stream `i` becomes
/// `e_proj(enorm(embed(t))) + h_proj(hnorm(h_i))`, the block mixes them as the main layers do,
/// and the head's own collapse (`hc_head_*`) precedes its norm.
pub struct MtpHead {
    pub enorm: RmsNorm,
    pub hnorm: RmsNorm,
    /// How the embedding and the hidden state are joined.
    pub input: MtpInput,
    pub block: Block,
    /// The residual's layout in the head (its collapse before `norm`).
    pub streams: Streams,
    pub norm: RmsNorm,
    pub head: Linear,
}

/// How an [`MtpHead`] joins the normed embedding `e` and the normed hidden state `h`.
#[allow(clippy::large_enum_variant)] // one per model, never moved in a hot path
pub enum MtpInput {
    /// `eh_proj([e ; h])`, `eh_proj` `[D, 2D]` (DeepSeek-V3, GLM-5).
    Joined(Linear),
    /// Per stream `e_proj(e) + h_proj(h_i)`, both `[D, D]` (DeepSeek-V4).
    PerStream { e_proj: Linear, h_proj: Linear },
}

impl CausalLm for Transformer {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_cache(&self, max_len: usize) -> KvCache {
        let mut cache = KvCache::new(self.blocks.len(), max_len);
        for (layer, block) in cache.layers.iter_mut().zip(&self.blocks) {
            match &block.attn {
                SelfAttention::Mla(m) => *layer = super::cache::LayerKv::with_dtype(m.kv_dtype),
                SelfAttention::Gqa(a) => *layer = super::cache::LayerKv::with_dtype(a.kv_dtype()),
                _ => {}
            }
            layer.state = vec![0.0; block.state_len()];
        }
        cache
    }

    fn forward(&self, tokens: &[u32], cache: &mut KvCache, logits: Logits) -> Result<Vec<f32>> {
        // Run on a compute-pool thread, so every parallel step inside is shared with the
        // calling worker instead of waking the pool and blocking this thread each time.
        rayon::scope(|_| self.forward_on_pool(tokens, cache, logits))
    }

    fn forward_batch(&self, items: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        rayon::scope(|_| self.forward_batch_on_pool(items))
    }

    fn store_stats(&self) -> Option<crate::store::StoreSnapshot> {
        self.store.as_ref().and_then(|s| s.stats())
    }

    fn drafter(&self) -> Option<&dyn super::Drafter> {
        self.mtp.as_ref().map(|_| self as &dyn super::Drafter)
    }

    fn flush(&self) -> Result<()> {
        match &self.store {
            Some(s) => s.flush(),
            None => Ok(()),
        }
    }

    fn flush_soon(&self) {
        if let Some(s) = &self.store {
            s.flush_soon();
        }
    }
}

impl super::Drafter for Transformer {
    fn new_draft_cache(&self, max_len: usize) -> KvCache {
        let mut cache = KvCache::new(1, max_len);
        if let Some(MtpHead {
            block:
                Block {
                    attn: SelfAttention::Mla(m),
                    ..
                },
            ..
        }) = &self.mtp
        {
            cache.layers[0] = super::cache::LayerKv::with_dtype(m.kv_dtype);
        }
        cache
    }

    fn forward_hidden(&self, tokens: &[u32], cache: &mut KvCache) -> Result<(Vec<f32>, Vec<f32>)> {
        rayon::scope(|_| {
            let mut item = [BatchItem {
                tokens,
                cache,
                logits: Logits::All,
            }];
            let (mut logits, hidden) = self.run_batch(&mut item)?;
            Ok((logits.remove(0), hidden))
        })
    }

    fn draft(&self, hidden: &[f32], next: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let mtp = self
            .mtp
            .as_ref()
            .ok_or_else(|| Error::Invalid("this model has no MTP head loaded".into()))?;
        let d = self.info.hidden_size;
        let width = self.streams.width(d);
        if hidden.len() != next.len() * width || next.is_empty() {
            return Err(Error::Invalid(format!(
                "MTP draft: {} hidden values for {} tokens of width {width}",
                hidden.len(),
                next.len()
            )));
        }
        if cache.len + next.len() > cache.max_len {
            return Err(Error::Invalid("MTP draft: the draft cache is full".into()));
        }
        rayon::scope(|_| {
            let e = mtp.enorm.forward(&embed(&self.embed, next)?);
            let hn = mtp.hnorm.forward(hidden);
            let mut h = match &mtp.input {
                MtpInput::Joined(eh_proj) => {
                    let mut joined = Vec::with_capacity(2 * e.len());
                    for (er, hr) in e.chunks(d).zip(hn.chunks(d)) {
                        joined.extend_from_slice(er);
                        joined.extend_from_slice(hr);
                    }
                    eh_proj.forward(&joined)
                }
                MtpInput::PerStream { e_proj, h_proj } => {
                    let (ep, mut hp) = (e_proj.forward(&e), h_proj.forward(&hn));
                    for (er, hr) in ep.chunks(d).zip(hp.chunks_mut(width)) {
                        for stream in hr.chunks_mut(d) {
                            add_assign(stream, er);
                        }
                    }
                    hp
                }
            };
            let mut selection = None;
            let mut seqs = [SeqPart {
                rows: next.len(),
                start: cache.len,
                kv: &mut cache.layers[0],
                selection: &mut selection,
            }];
            self.block_forward(&mtp.block, &mut h, &mut seqs, next, |_| {})?;
            cache.len += next.len();
            let last = mtp.streams.collapse(&h[(next.len() - 1) * width..], d);
            Ok(mtp.head.forward(&mtp.norm.forward(&last)))
        })
    }
}

impl Transformer {
    /// The forward pass of one sequence (see [`CausalLm::forward`]): a batch of one, so a
    /// sequence alone and inside a batch take the same path.
    fn forward_on_pool(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        let mut item = [BatchItem {
            tokens,
            cache,
            logits,
        }];
        Ok(self.forward_batch_on_pool(&mut item)?.remove(0))
    }

    /// The batched forward pass (see [`CausalLm::forward_batch`]): the rows of every item are
    /// stacked; norms, projections and the MoE block run over the whole stack (so the expert
    /// union of all sequences is acquired once per layer), attention runs per sequence over
    /// its own cache.
    fn forward_batch_on_pool(&self, items: &mut [BatchItem<'_>]) -> Result<Vec<Vec<f32>>> {
        Ok(self.run_batch(items)?.0)
    }

    /// [`Self::forward_batch_on_pool`], also returning the hidden rows the logits were
    /// computed from (the input of a multi-token-prediction head): final-normed, or with
    /// hyper-connection streams the streams before their collapse.
    fn run_batch(&self, items: &mut [BatchItem<'_>]) -> Result<(Vec<Vec<f32>>, Vec<f32>)> {
        for it in items.iter() {
            if it.tokens.is_empty() {
                return Err(Error::Invalid("forward needs at least one token".into()));
            }
            if it.cache.len + it.tokens.len() > it.cache.max_len {
                return Err(Error::Invalid(format!(
                    "context overflow: {} cached + {} new tokens exceed the context of {} tokens",
                    it.cache.len,
                    it.tokens.len(),
                    it.cache.max_len
                )));
            }
        }
        let d = self.info.hidden_size;
        let all: Vec<u32> = items
            .iter()
            .flat_map(|it| it.tokens.iter().copied())
            .collect();
        let width = self.streams.width(d);
        let mut e = embed(&self.embed, &all)?;
        if let Some(norm) = &self.embed_norm {
            norm.forward_inplace(&mut e);
        }
        let mut h = self.streams.spread(e, d);
        // Each sequence's sparse-attention pick, handed from a layer to the next.
        let mut selections: Vec<Option<Selection>> = vec![None; items.len()];
        for (l, block) in self.blocks.iter().enumerate() {
            let mut seqs: Vec<SeqPart<'_>> = items
                .iter_mut()
                .zip(selections.iter_mut())
                .map(|(it, sel)| SeqPart {
                    rows: it.tokens.len(),
                    start: it.cache.len,
                    kv: &mut it.cache.layers[l],
                    selection: sel,
                })
                .collect();
            self.block_forward(block, &mut h, &mut seqs, &all, |h| {
                self.prefetch_next(l, h, &all)
            })?;
        }
        for it in items.iter_mut() {
            it.cache.len += it.tokens.len();
        }
        if let Some(store) = &self.store {
            store.step_done(all.len());
        }
        // One LM-head pass over the rows every item asked for.
        let mut rows = Vec::new();
        let mut counts = Vec::with_capacity(items.len());
        let mut row = 0;
        for it in items.iter() {
            let n = it.tokens.len();
            let (first, count) = match it.logits {
                Logits::All => (row, n),
                Logits::Last => (row + n - 1, 1),
                Logits::None => (row, 0),
            };
            rows.extend_from_slice(&h[first * width..(first + count) * width]);
            counts.push(count);
            row += n;
        }
        if rows.is_empty() {
            return Ok((vec![Vec::new(); items.len()], Vec::new()));
        }
        let t0 = Instant::now();
        let x = self.norm.forward(&self.streams.collapse(&rows, d));
        let out = match self.logits.divide {
            Some(m) => self
                .lm_head
                .forward(&x.iter().map(|v| v / m).collect::<Vec<f32>>()),
            None => self.lm_head.forward(&x),
        };
        telemetry::add(Part::LmHead, t0);
        let hidden = match self.streams {
            Streams::One => x,
            Streams::Hyper(_) | Streams::HyperMean(_) | Streams::Blocks { .. } => rows,
        };
        let padded = out.len() / counts.iter().sum::<usize>();
        let vocab = self.logits.vocab.map_or(padded, |v| v.min(padded));
        let softcap = |row: &[f32]| -> Vec<f32> {
            match self.logits.softcap {
                Some(c) => row.iter().map(|v| (v / c).tanh() * c).collect(),
                None => row.to_vec(),
            }
        };
        let mut result = Vec::with_capacity(items.len());
        let mut at = 0;
        for c in counts {
            let mut logits = Vec::with_capacity(c * vocab);
            for row in out[at * padded..(at + c) * padded].chunks(padded) {
                logits.extend(softcap(&row[..vocab]));
            }
            result.push(logits);
            at += c;
        }
        Ok((result, hidden))
    }

    /// One decoder layer over the stacked residual rows `h` of several sequences (in place;
    /// row `t` holds token `tokens[t]`): norms, projections and the FFN over all rows at
    /// once (each weight read once per step), attention per sequence over its own cache, each
    /// part reading and writing the residual through the block's [`Residual`].
    /// `after_attention` sees the residual between the two parts (the prefetcher's hook).
    fn block_forward(
        &self,
        block: &Block,
        h: &mut [f32],
        seqs: &mut [SeqPart<'_>],
        tokens: &[u32],
        after_attention: impl FnOnce(&[f32]),
    ) -> Result<()> {
        let d = self.info.hidden_size;
        let total: usize = seqs.iter().map(|s| s.rows).sum();
        let t0 = Instant::now();
        let (u, mix) = block.residual.read(Sublayer::Attention, h, d);
        let x = block.attn_norm.forward(&u);
        drop(u);
        let mut heads_out = Vec::new();
        let mut row = 0;
        match &block.attn {
            SelfAttention::Gqa(attn) => {
                let (q, k, v, gate) = attn.project(&x);
                let mut parts = Vec::with_capacity(seqs.len());
                for s in seqs.iter_mut() {
                    let seg = |t: &[f32]| rows_of(t, row, s.rows, total);
                    parts.push((seg(&q), seg(&k), seg(&v), s.start, &mut *s.kv));
                    row += s.rows;
                }
                for out in per_sequence(parts, |(q, k, v, start, kv)| {
                    attn.attend_sequence(q, k, v, start, kv)
                }) {
                    heads_out.extend(out);
                }
                if let Some(gate) = gate {
                    attn.apply_output_gate(&mut heads_out, &gate);
                }
            }
            SelfAttention::Mla(mla) => {
                let rows = mla.project(&x);
                let mut parts = Vec::with_capacity(seqs.len());
                for s in seqs.iter_mut() {
                    let seg = rows.segment(row, s.rows, total);
                    parts.push((seg, s.start, &mut *s.kv, &mut *s.selection));
                    row += s.rows;
                }
                for out in per_sequence(parts, |(seg, start, kv, selection)| {
                    mla.attend_sequence(seg, start, kv, selection)
                }) {
                    heads_out.extend(out);
                }
            }
            SelfAttention::Compressed(c) => {
                let rows = c.project(&x);
                let mut parts = Vec::with_capacity(seqs.len());
                for s in seqs.iter_mut() {
                    parts.push((rows.segment(row, s.rows, total), s.start, &mut *s.kv));
                    row += s.rows;
                }
                for out in per_sequence(parts, |(seg, start, kv)| c.attend_sequence(seg, start, kv))
                {
                    heads_out.extend(out);
                }
            }
            SelfAttention::Linear(la) => {
                let rows = la.project(&x);
                for s in seqs.iter_mut() {
                    heads_out.extend(la.attend_sequence(&rows, (row, s.rows, total), s.kv));
                    row += s.rows;
                }
            }
            SelfAttention::Relative(ra) => {
                let rows = ra.project(&x);
                for s in seqs.iter_mut() {
                    heads_out.extend(ra.attend_sequence(
                        &rows,
                        (row, s.rows, total),
                        s.start,
                        s.kv,
                    ));
                    row += s.rows;
                }
            }
        }
        let mut a = block.attn.output(&heads_out);
        let conv_at = block.attn.state_len();
        if let Some(pc) = &block.post_conv {
            pc.apply(Sublayer::Attention, &mut a, seqs, conv_at);
        }
        block.residual.write(Sublayer::Attention, h, &a, mix, d);
        let part = match block.attn {
            SelfAttention::Linear(_) => Part::Recurrent,
            _ => Part::Attention,
        };
        telemetry::add(part, t0);
        after_attention(h);
        let (u, mix) = block.residual.read(Sublayer::Ffn, h, d);
        let x = block.ffn_norm.forward(&u);
        drop(u);
        let mut f = match &block.ffn {
            Ffn::Dense(mlp) => {
                let t0 = Instant::now();
                let y = mlp.forward(&x);
                telemetry::add(Part::DenseMlp, t0);
                y
            }
            Ffn::ScaledDense { mlp, scale } => {
                let t0 = Instant::now();
                let mut y = mlp.forward(&x);
                y.iter_mut().for_each(|v| *v *= scale);
                telemetry::add(Part::DenseMlp, t0);
                y
            }
            Ffn::Moe(moe) => moe.forward(&x)?,
            Ffn::HashMoe(moe) => moe.forward(&x, tokens)?,
        };
        if let Some(pc) = &block.post_conv {
            pc.apply(Sublayer::Ffn, &mut f, seqs, conv_at);
        }
        block.residual.write(Sublayer::Ffn, h, &f, mix, d);
        Ok(())
    }

    /// One-layer-ahead prefetch: apply layer `l + 1`'s residual read, norm and router to the
    /// residual after layer `l`'s attention (a hash-routed layer's experts follow from the
    /// tokens alone) and hint the store with the experts it would choose. A guess only starts
    /// reads; it never changes a result.
    fn prefetch_next(&self, l: usize, h: &[f32], tokens: &[u32]) {
        let Some(next) = self.blocks.get(l + 1) else {
            return;
        };
        let Some(moe) = next.ffn.moe() else {
            return;
        };
        if !moe.store.wants_hints() {
            return;
        }
        let union = match &next.ffn {
            Ffn::HashMoe(hash) => hash.route_union(tokens),
            _ => {
                let (u, _) = next.residual.read(Sublayer::Ffn, h, self.info.hidden_size);
                moe.route_union(&next.ffn_norm.forward(&u))
            }
        };
        moe.store.hint(l + 1, &union);
    }
}

/// Hyper-parameters every standard decoder has, read from `config.json`.
#[derive(Debug, Clone)]
pub struct StandardConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope: crate::format::config::RopeParams,
    pub attention_bias: bool,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Attention at llama.cpp's f16 KV precision (`kv_f16`, set for GGUF files).
    pub kv_f16: bool,
    /// Prefix of `embed_tokens`, `layers.{L}` and `norm`: `model`, or the hub's
    /// `model.language_model` of a vision-language checkpoint.
    pub prefix: String,
    /// Every RMSNorm is zero-centred, `y · (1 + w)` (Qwen3-Next, Qwen3.5/3.6).
    pub zero_centred_norms: bool,
    /// The query projection carries a per-head output gate ([`Attention::output_gate`]).
    pub output_gate: bool,
}

impl StandardConfig {
    /// Read the common fields (sizes bounded, the layer count checked against `ckpt`);
    /// `default_eps` and `default_theta` are the family's defaults.
    pub fn read(
        cfg: &crate::format::config::ModelConfig,
        ckpt: &crate::format::safetensors::Checkpoint,
        default_eps: f64,
        default_theta: f64,
    ) -> Result<Self> {
        let hidden_size = cfg.dim("hidden_size")?;
        let heads = cfg.dim("num_attention_heads")?;
        let kv_heads = cfg.dim_or("num_key_value_heads", heads)?;
        if heads % kv_heads != 0 {
            return Err(Error::config(
                cfg.path(),
                "num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads = {heads}"),
            ));
        }
        let head_dim = match cfg.opt_dim("head_dim")? {
            Some(hd) => hd,
            None if hidden_size >= heads => hidden_size / heads,
            None => {
                return Err(Error::config(
                    cfg.path(),
                    "num_attention_heads",
                    format!("{heads} heads do not fit hidden_size = {hidden_size}"),
                ))
            }
        };
        Ok(StandardConfig {
            vocab_size: cfg.dim("vocab_size")?,
            hidden_size,
            layers: super::layer_count(cfg, ckpt)?,
            heads,
            kv_heads,
            head_dim,
            rms_norm_eps: cfg.f64_or("rms_norm_eps", default_eps)?,
            rope: cfg.rope(default_theta)?,
            attention_bias: cfg.bool_or("attention_bias", false)?,
            tie_word_embeddings: cfg.bool_or("tie_word_embeddings", false)?,
            max_position_embeddings: cfg.usize_or("max_position_embeddings", 4096)?,
            kv_f16: cfg.bool_or("kv_f16", false)?,
            prefix: "model".to_string(),
            zero_centred_norms: false,
            output_gate: false,
        })
    }

    /// The RMSNorm `name` of `dim` values: plain, or zero-centred (its weight `1 + w`,
    /// computed in f32 as transformers does).
    pub fn norm(
        &self,
        ckpt: &crate::format::safetensors::Checkpoint,
        name: &str,
        dim: usize,
    ) -> Result<RmsNorm> {
        let mut norm = RmsNorm::load(ckpt, name, dim, self.rms_norm_eps)?;
        if self.zero_centred_norms {
            norm.weight.iter_mut().for_each(|w| *w += 1.0);
        }
        Ok(norm)
    }
}

/// What differs per layer between the families that use the standard stack.
pub struct LayerParts {
    pub qk_norm: super::layers::QkNorm,
    pub clip_qkv: Option<f32>,
    pub window: Option<usize>,
    /// One learned attention-sink logit per head ([`Attention::sinks`]; gpt-oss).
    pub sinks: Option<Vec<f32>>,
    pub ffn: Ffn,
    /// The attention part when it is not the grouped-query attention of `self_attn.*`
    /// (a hybrid's linear-attention layers); `qk_norm`, `clip_qkv` and `window` then go
    /// unused.
    pub attn: Option<SelfAttention>,
}

impl LayerParts {
    /// A layer whose attention part the family built itself, and its feed-forward part.
    pub fn own(attn: SelfAttention, ffn: Ffn) -> LayerParts {
        LayerParts {
            attn: Some(attn),
            qk_norm: super::layers::QkNorm::None,
            clip_qkv: None,
            window: None,
            sinks: None,
            ffn,
        }
    }
}

/// Build a standard decoder from HF names (`model.embed_tokens`, `model.layers.{L}.self_attn.*`,
/// `input_layernorm`, `post_attention_layernorm`, `model.norm`, `lm_head`), with the
/// family-specific parts of each layer given by `layer_parts`.
pub fn load_standard(
    ckpt: &crate::format::safetensors::Checkpoint,
    cfg: &crate::format::config::ModelConfig,
    sc: &StandardConfig,
    store: Option<std::sync::Arc<dyn crate::store::ExpertStore>>,
    mut layer_parts: impl FnMut(usize) -> Result<LayerParts>,
) -> Result<Transformer> {
    let d = sc.hidden_size;
    let m = &sc.prefix;
    let embed = ckpt.weight(&format!("{m}.embed_tokens.weight"), &[sc.vocab_size, d])?;
    let lm_head = if sc.tie_word_embeddings && !ckpt.contains("lm_head.weight") {
        Linear::from_tensor(embed.clone())
    } else {
        Linear::load(ckpt, "lm_head", sc.vocab_size, d, false)?
    };
    let mut blocks = Vec::with_capacity(sc.layers);
    for l in 0..sc.layers {
        let p = format!("{m}.layers.{l}");
        let mut parts = layer_parts(l)?;
        let attn = match parts.attn.take() {
            Some(attn) => attn,
            None => SelfAttention::Gqa(standard_attention(
                ckpt,
                sc,
                &p,
                parts.qk_norm,
                parts.clip_qkv,
                parts.window,
                parts.sinks.take(),
            )?),
        };
        blocks.push(Block {
            attn_norm: sc.norm(ckpt, &format!("{p}.input_layernorm.weight"), d)?,
            attn,
            ffn_norm: sc.norm(ckpt, &format!("{p}.post_attention_layernorm.weight"), d)?,
            ffn: parts.ffn,
            residual: Residual::Plain,
            post_conv: None,
        });
    }
    let norm = sc.norm(ckpt, &format!("{m}.norm.weight"), d)?;
    let info = standard_info(ckpt, cfg, sc, &blocks, store.as_deref())?;
    Ok(Transformer {
        embed,
        blocks,
        norm,
        lm_head,
        info,
        store,
        mtp: None,
        streams: Streams::One,
        embed_norm: None,
        logits: LogitForm::default(),
    })
}

/// Layer `p`'s grouped-query attention from `{p}.self_attn.{q,k,v,o}_proj`.
fn standard_attention(
    ckpt: &crate::format::safetensors::Checkpoint,
    sc: &StandardConfig,
    p: &str,
    qk_norm: super::layers::QkNorm,
    clip_qkv: Option<f32>,
    window: Option<usize>,
    sinks: Option<Vec<f32>>,
) -> Result<Attention> {
    use super::layers::Rope;
    let (d, hd) = (sc.hidden_size, sc.head_dim);
    let o_bias = sc.attention_bias && ckpt.contains(&format!("{p}.self_attn.o_proj.bias"));
    let q_width = if sc.output_gate { 2 } else { 1 } * sc.heads * hd;
    Ok(Attention {
        q: Linear::load(
            ckpt,
            &format!("{p}.self_attn.q_proj"),
            q_width,
            d,
            sc.attention_bias,
        )?,
        k: Linear::load(
            ckpt,
            &format!("{p}.self_attn.k_proj"),
            sc.kv_heads * hd,
            d,
            sc.attention_bias,
        )?,
        v: Linear::load(
            ckpt,
            &format!("{p}.self_attn.v_proj"),
            sc.kv_heads * hd,
            d,
            sc.attention_bias,
        )?,
        o: Linear::load(
            ckpt,
            &format!("{p}.self_attn.o_proj"),
            d,
            sc.heads * hd,
            o_bias,
        )?,
        heads: sc.heads,
        kv_heads: sc.kv_heads,
        head_dim: hd,
        qk_norm,
        clip_qkv,
        rope: Rope::new(&sc.rope, hd),
        window,
        scale: (hd as f32).powf(-0.5),
        kv_f16: sc.kv_f16,
        output_gate: sc.output_gate,
        sinks,
    })
}

/// The tensors of a checkpoint a model leaves out on purpose (a vision tower, layers it
/// does not run), so `coli info` can say what and how much.
#[derive(Debug, Default)]
pub struct Unused {
    pub bytes: usize,
    pub params: usize,
    /// One line per part left out.
    pub skipped: Vec<String>,
}

impl Unused {
    /// The tensors whose names start with one of the `(prefix, what it is)` parts.
    pub fn of(ckpt: &crate::format::safetensors::Checkpoint, parts: &[(&str, &str)]) -> Unused {
        let mut unused = Unused::default();
        for (prefix, what) in parts {
            let (mut n, mut bytes) = (0, 0);
            for (name, t) in ckpt.tensors() {
                if name.starts_with(prefix) {
                    n += 1;
                    bytes += t.len;
                    unused.params += t.shape.iter().product::<usize>();
                }
            }
            if n > 0 {
                unused.bytes += bytes;
                unused.skipped.push(format!(
                    "{what} ({n} tensors under `{prefix}`, {bytes} bytes)"
                ));
            }
        }
        unused
    }

    /// Take them out of `info`'s resident bytes and parameter counts, and say them there.
    pub fn apply(self, info: &mut ModelInfo) {
        info.dense_bytes -= self.bytes;
        info.total_params -= self.params;
        info.active_params -= self.params;
        info.unused_bytes += self.bytes;
        info.skipped.extend(self.skipped);
    }
}

/// The distinct dtypes of a checkpoint's tensors, sorted (what `coli info` lists).
pub(crate) fn checkpoint_dtypes(ckpt: &crate::format::safetensors::Checkpoint) -> Vec<String> {
    let mut dtypes: Vec<String> = ckpt
        .tensors()
        .values()
        .map(|t| t.dtype.to_string())
        .collect();
    dtypes.sort();
    dtypes.dedup();
    dtypes
}

pub(crate) fn standard_info(
    ckpt: &crate::format::safetensors::Checkpoint,
    cfg: &crate::format::config::ModelConfig,
    sc: &StandardConfig,
    blocks: &[Block],
    store: Option<&dyn crate::store::ExpertStore>,
) -> Result<ModelInfo> {
    let dtypes = checkpoint_dtypes(ckpt);
    let total_bytes = ckpt.total_bytes();
    let total_params = ckpt.parameter_count();
    let routed_expert_bytes = store.map_or(0, |s| s.total_bytes());
    let mut moe_layers = 0;
    let (mut routed, mut active, mut expert_params) = (0, 0, 0);
    for b in blocks {
        if let Some(m) = b.ffn.moe() {
            moe_layers += 1;
            routed = m.num_experts;
            active = m.top_k;
            let per_expert = 3 * m.gate.weight.shape[1] * expert_intermediate(m);
            expert_params += m.num_experts * per_expert;
        }
    }
    let active_expert_params: usize = blocks
        .iter()
        .filter_map(|b| {
            b.ffn
                .moe()
                .map(|m| m.top_k * 3 * m.gate.weight.shape[1] * expert_intermediate(m))
        })
        .sum();
    Ok(ModelInfo {
        model_type: cfg.model_type()?,
        architecture: cfg
            .json()
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .unwrap_or("")
            .to_string(),
        vocab_size: sc.vocab_size,
        hidden_size: sc.hidden_size,
        layers: sc.layers,
        moe_layers,
        routed_experts: routed,
        shared_experts: blocks
            .iter()
            .find_map(|b| b.ffn.moe().and_then(|m| m.shared.as_ref().map(|_| 1)))
            .unwrap_or(0),
        kv_bytes_per_token: blocks
            .iter()
            .map(|b| b.attn.cache_bytes_per_token().0)
            .sum(),
        kv_bytes_per_token_full: blocks
            .iter()
            .map(|b| b.attn.cache_bytes_per_token().1)
            .sum(),
        state_bytes_per_sequence: blocks.iter().map(|b| 4 * b.state_len()).sum(),
        active_experts: active,
        total_params,
        active_params: total_params.saturating_sub(expert_params) + active_expert_params,
        dense_bytes: total_bytes - routed_expert_bytes,
        routed_expert_bytes,
        dtypes,
        max_position_embeddings: sc.max_position_embeddings,
        unused_bytes: 0,
        skipped: Vec::new(),
    })
}

fn expert_intermediate(m: &MoeBlock) -> usize {
    m.intermediate
}
