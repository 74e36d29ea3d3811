//! Warm conversations: a [`Conversation`] (its tokens and KV cache) saved to a file and
//! restored in another process, which then continues exactly where the first left off.
//!
//! The file names the model it belongs to by [`fingerprint`](crate::store::history::fingerprint)
//! (a hash of `config.json` and the safetensors headers, so a changed config or tensor layout
//! is refused) and ends with a checksum of everything before it. It is written atomically
//! (a temporary file renamed into place, see [`crate::format::write`]), so a crash leaves
//! either the old file or the new one. [`load`] checks the file on its own (magic, version,
//! size, checksum, fingerprint, structure: the cache no longer than the conversation nor its
//! capacity, every buffer a whole number of rows, every value a finite number — a checksum
//! only proves the bytes are those that were summed); [`check_model`] checks it against the
//! model (layer count, values per token of every buffer, context, vocabulary); [`restore`]
//! does both.
//! Every problem is an error naming the file and what to do, never a panic.
//!
//! Format (version [`FORMAT_VERSION`]), all integers and floats little-endian:
//!
//! ```text
//! header   magic "COLI_KV\0" (8 bytes) | version u32 | reserved u32 (0) | body_len u64
//! body     fingerprint_len u32 | fingerprint (UTF-8) | layers u32
//!          tokens u64 | cache_len u64 | max_len u64
//!          token ids: tokens × u32
//!          values held: layers × (k u64, v u64, aux u64, state u64)
//!          values: for each layer, its k, then v, then aux, then state values, f32 each
//! trailer  checksum u64: XXH64 (seed 0) of the header and the body
//! ```
//!
//! The token ids are the whole conversation; the cache holds the first `cache_len` of them
//! (the others, normally the last sampled token, are pending: see
//! [`generate_continue`](super::generate::generate_continue)). A k, v or aux buffer's values
//! are `cache_len` rows of a width the model fixes per layer and buffer; a state (linear
//! attention's recurrent state after `cache_len` tokens) has the size the model fixes per
//! layer. Checkpoints of the states are not saved: going back before `cache_len` recomputes
//! from the start. Version 1 files (no state counts) are still read.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::Path;

use super::generate::Conversation;
use crate::format::write::AtomicFile;
use crate::model::cache::{KvBuf, KvCache, KvDType, LayerKv};
use crate::model::{CausalLm, Logits};
use crate::store::history::fingerprint;
use crate::{Error, Result};

/// The first bytes of every KV file.
pub const MAGIC: [u8; 8] = *b"COLI_KV\0";

/// Version of the format [`save`] writes and [`load`] reads.
pub const FORMAT_VERSION: u32 = 2;

/// Bytes before the body: magic, version, reserved, body length.
const HEADER_BYTES: u64 = 24;

/// Bytes after the body: the checksum.
const TRAILER_BYTES: u64 = 8;

/// Names of a layer's buffers, in file order (version 1 files have the first three).
const BUFFERS: [&str; 4] = ["k", "v", "aux", "state"];

/// What every refusal tells the user to do.
const FIX: &str = "delete it (or use another file) to start a new conversation";

/// Values converted per I/O chunk.
const CHUNK_VALUES: usize = 1 << 16;

/// The fingerprint of the model in `model_dir` (a directory or a GGUF file) that KV files
/// of its conversations carry.
pub fn model_fingerprint(model_dir: &Path) -> Result<String> {
    fingerprint(model_dir)
}

/// Save `conv` to `path` atomically for the model with fingerprint `fingerprint`. Returns
/// the file's size in bytes.
pub fn save(path: &Path, fingerprint: &str, conv: &Conversation) -> Result<u64> {
    let cache = &conv.cache;
    if cache.len > conv.tokens.len() {
        return Err(Error::Invalid(format!(
            "{}: cannot save a conversation whose cache holds {} tokens but which has only {}",
            path.display(),
            cache.len,
            conv.tokens.len()
        )));
    }
    let fp = fingerprint.as_bytes();
    let values: u64 = cache
        .layers
        .iter()
        .map(|l| (l.values() + l.state.len()) as u64)
        .sum();
    let body_len = 4
        + fp.len() as u64
        + 4
        + 3 * 8
        + 4 * conv.tokens.len() as u64
        + 4 * 8 * cache.layers.len() as u64
        + 4 * values;

    let mut out = HashingWriter {
        out: AtomicFile::with_capacity(path, 1 << 20)?,
        hash: Xxh64::new(),
    };
    let written = (|| -> std::io::Result<()> {
        out.put(&MAGIC)?;
        out.put(&FORMAT_VERSION.to_le_bytes())?;
        out.put(&0u32.to_le_bytes())?;
        out.put(&body_len.to_le_bytes())?;
        out.put(&(fp.len() as u32).to_le_bytes())?;
        out.put(fp)?;
        out.put(&(cache.layers.len() as u32).to_le_bytes())?;
        out.put(&(conv.tokens.len() as u64).to_le_bytes())?;
        out.put(&(cache.len as u64).to_le_bytes())?;
        out.put(&(cache.max_len as u64).to_le_bytes())?;
        let mut bytes = Vec::with_capacity(4 * CHUNK_VALUES);
        for chunk in conv.tokens.chunks(CHUNK_VALUES) {
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
            out.put(&bytes)?;
        }
        for l in &cache.layers {
            for n in [l.k.len(), l.v.len(), l.aux.len(), l.state.len()] {
                out.put(&(n as u64).to_le_bytes())?;
            }
        }
        for l in &cache.layers {
            for b in [&l.k, &l.v, &l.aux] {
                // bf16 buffers are written widened to f32 (exact); `restore` narrows them back.
                let values = b.to_f32_vec();
                for chunk in values.chunks(CHUNK_VALUES) {
                    bytes.clear();
                    bytes.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
                    out.put(&bytes)?;
                }
            }
            for chunk in l.state.chunks(CHUNK_VALUES) {
                bytes.clear();
                bytes.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
                out.put(&bytes)?;
            }
        }
        let sum = out.hash.digest();
        out.out.write_all(&sum.to_le_bytes())
    })();
    // On an error the dropped file removes its temporary.
    written.map_err(|e| Error::io(out.out.tmp_path(), e))?;
    out.out.commit()?;
    Ok(HEADER_BYTES + body_len + TRAILER_BYTES)
}

/// Read the conversation saved in `path`, checking the file on its own: its magic bytes and
/// version, its size against the length its header announces, its checksum, that it was saved
/// for the model with fingerprint `fingerprint`, its structure (lengths consistent, every
/// buffer a whole number of rows) and that every cached value is finite. See
/// [`check_model`] for the checks against the model itself.
pub fn load(path: &Path, fingerprint: &str) -> Result<Conversation> {
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let size = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut r = BufReader::with_capacity(1 << 20, file);

    // Header.
    let mut header = [0u8; HEADER_BYTES as usize];
    let got = read_up_to(&mut r, &mut header).map_err(|e| Error::io(path, e))?;
    if got < MAGIC.len() || header[..8] != MAGIC {
        return Err(Error::corrupt(
            path,
            format!(
                "not a colibri KV file (it does not start with the bytes \"COLI_KV\\0\"); {FIX}"
            ),
        ));
    }
    if got < header.len() {
        return Err(Error::corrupt(
            path,
            format!("truncated: the file has {size} bytes, too few for a KV file's header; {FIX}"),
        ));
    }
    let version = u32::from_le_bytes(header[8..12].try_into().unwrap());
    if version != FORMAT_VERSION && version != 1 {
        return Err(Error::corrupt(
            path,
            format!(
                "KV file format version {version}, but this build reads version {FORMAT_VERSION}; {FIX}"
            ),
        ));
    }
    let reserved = u32::from_le_bytes(header[12..16].try_into().unwrap());
    let body_len = u64::from_le_bytes(header[16..24].try_into().unwrap());
    let expected = body_len.saturating_add(HEADER_BYTES + TRAILER_BYTES);
    if size < expected {
        return Err(Error::corrupt(
            path,
            format!(
                "truncated: its header announces {expected} bytes but the file has {size} (it was not written or copied completely); {FIX}"
            ),
        ));
    }
    if size > expected {
        return Err(Error::corrupt(
            path,
            format!(
                "{} unexpected bytes after the end its header announces ({expected} bytes); {FIX}",
                size - expected
            ),
        ));
    }

    // Checksum of header and body, before anything in the body is believed.
    let mut hash = Xxh64::new();
    hash.update(&header);
    let mut left = body_len;
    let mut buf = vec![0u8; 1 << 20];
    while left > 0 {
        let n = left.min(buf.len() as u64) as usize;
        r.read_exact(&mut buf[..n])
            .map_err(|e| Error::io(path, e))?;
        hash.update(&buf[..n]);
        left -= n as u64;
    }
    let mut trailer = [0u8; 8];
    r.read_exact(&mut trailer).map_err(|e| Error::io(path, e))?;
    let stored = u64::from_le_bytes(trailer);
    let computed = hash.digest();
    if stored != computed {
        return Err(Error::corrupt(
            path,
            format!(
                "checksum mismatch (stored {stored:016x}, computed {computed:016x}): the file is corrupt; {FIX}"
            ),
        ));
    }
    if reserved != 0 {
        return Err(Error::corrupt(
            path,
            format!("reserved header field is {reserved}, expected 0; {FIX}"),
        ));
    }

    // Body.
    r.seek(SeekFrom::Start(HEADER_BYTES))
        .map_err(|e| Error::io(path, e))?;
    let mut b = Body {
        r,
        left: body_len,
        path,
    };
    let fp_len = b.u32()? as u64;
    let fp = b.bytes(fp_len)?;
    let saved_fp = String::from_utf8(fp)
        .map_err(|_| Error::corrupt(path, format!("the model fingerprint is not UTF-8; {FIX}")))?;
    if saved_fp != fingerprint {
        return Err(Error::Invalid(format!(
            "{}: this KV file was saved with a different model: it belongs to the model with fingerprint {saved_fp}, but the model loaded now has fingerprint {fingerprint} (its config.json or tensor layout differs); use the model it was saved with, or {FIX}",
            path.display()
        )));
    }
    let layers = b.u32()? as usize;
    let n_tokens = b.u64()?;
    let cache_len = b.u64()?;
    let max_len = b.u64()?;
    if cache_len > n_tokens {
        return Err(Error::corrupt(
            path,
            format!("its cache holds {cache_len} tokens but the conversation has only {n_tokens}; {FIX}"),
        ));
    }
    if cache_len > max_len {
        return Err(Error::corrupt(
            path,
            format!("its cache holds {cache_len} tokens but its capacity is {max_len}; {FIX}"),
        ));
    }
    let tokens = b.u32s(n_tokens)?;
    let mut counts = Vec::with_capacity(layers.min(b.left as usize / 32 + 1));
    for _ in 0..layers {
        let (k, v, aux) = (b.u64()?, b.u64()?, b.u64()?);
        let state = if version == 1 { 0 } else { b.u64()? };
        counts.push([k, v, aux, state]);
    }
    let total: u64 = counts
        .iter()
        .flatten()
        .try_fold(0u64, |acc, &c| acc.checked_add(c))
        .and_then(|t| t.checked_mul(4))
        .unwrap_or(u64::MAX);
    if total != b.left {
        return Err(Error::corrupt(
            path,
            format!(
                "its layers announce {total} bytes of values but {} remain; {FIX}",
                b.left
            ),
        ));
    }
    // Every per-token buffer holds `cache_len` rows of one width.
    for (l, c) in counts.iter().enumerate() {
        for (i, &n) in c[..3].iter().enumerate() {
            let whole = if cache_len == 0 {
                n == 0
            } else {
                n % cache_len == 0
            };
            if !whole {
                return Err(Error::corrupt(
                    path,
                    format!(
                        "layer {l}: its `{}` buffer holds {n} values, not a whole number of rows for {cache_len} cached tokens; {FIX}",
                        BUFFERS[i]
                    ),
                ));
            }
        }
    }
    let mut cache = KvCache::new(0, to_usize(max_len, path)?);
    cache.len = to_usize(cache_len, path)?;
    for (l, c) in counts.iter().enumerate() {
        let mut layer = LayerKv::default();
        for (i, &n) in c.iter().enumerate() {
            let values = b.f32s(n)?;
            // A model's keys and values are finite numbers: a NaN or an infinity would turn
            // every attention score that reads it into NaN, so the answer would be garbage.
            if let Some(at) = values.iter().position(|x| !x.is_finite()) {
                return Err(Error::corrupt(
                    path,
                    format!(
                        "layer {l}: value {at} of its `{}` buffer is {}, but a KV cache holds finite numbers only (the file was damaged before its checksum was computed, or was not written by colibri); {FIX}",
                        BUFFERS[i],
                        values[at]
                    ),
                ));
            }
            match i {
                0 => layer.k = KvBuf::F32(values),
                1 => layer.v = KvBuf::F32(values),
                2 => layer.aux = KvBuf::F32(values),
                _ => layer.state = values,
            }
        }
        cache.layers.push(layer);
    }
    Ok(Conversation { tokens, cache })
}

/// Check a conversation restored from `path` against `model`: its tokens must leave room
/// in the model's context and lie in its vocabulary, and its cache must have the model's
/// layer count and, for every layer and buffer, the model's number of values per token
/// (learned by running one token through a fresh cache).
pub fn check_model(path: &Path, conv: &Conversation, model: &dyn CausalLm) -> Result<()> {
    let info = model.info();
    let ctx = info.max_position_embeddings.max(1);
    if conv.tokens.len() >= ctx {
        return Err(Error::Invalid(format!(
            "{}: the saved conversation has {} tokens but the model's context is {ctx} tokens, so there is no room to continue it; {FIX}",
            path.display(),
            conv.tokens.len()
        )));
    }
    if info.vocab_size > 0 {
        if let Some(t) = conv.tokens.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(Error::corrupt(
                path,
                format!(
                    "token id {t} is outside the model's vocabulary of {} tokens; {FIX}",
                    info.vocab_size
                ),
            ));
        }
    }
    let widths = values_per_token(model)?;
    if widths.len() != conv.cache.layers.len() {
        return Err(Error::Invalid(format!(
            "{}: the saved cache has {} layers but the model has {}; {FIX}",
            path.display(),
            conv.cache.layers.len(),
            widths.len()
        )));
    }
    let len = conv.cache.len;
    let fresh = model.new_cache(0);
    for (l, (layer, want)) in conv.cache.layers.iter().zip(&fresh.layers).enumerate() {
        if layer.state.len() != want.state.len() {
            return Err(Error::Invalid(format!(
                "{}: layer {l}: the saved recurrent state holds {} values, but this model's holds {} (was it saved by another version of colibri?); {FIX}",
                path.display(),
                layer.state.len(),
                want.state.len()
            )));
        }
    }
    for (l, (layer, w)) in conv.cache.layers.iter().zip(&widths).enumerate() {
        for (i, held) in [&layer.k, &layer.v, &layer.aux].into_iter().enumerate() {
            if Some(held.len()) != w[i].checked_mul(len) {
                return Err(Error::Invalid(format!(
                    "{}: layer {l}: the saved `{}` buffer holds {} values for {len} cached tokens, but this model keeps {} values per token (was it saved by another version of colibri?); {FIX}",
                    path.display(),
                    BUFFERS[i],
                    held.len(),
                    w[i]
                )));
            }
        }
    }
    Ok(())
}

/// [`load`] then [`check_model`]: the conversation saved in `path`, ready to continue with
/// `model` (whose fingerprint is `fingerprint`).
pub fn restore(path: &Path, fingerprint: &str, model: &dyn CausalLm) -> Result<Conversation> {
    let mut conv = load(path, fingerprint)?;
    check_model(path, &conv, model)?;
    // Buffers the model keeps in bf16 or f16 were written widened to f32: narrow them back
    // (exact for values of that precision; anything else means the file was saved another way).
    let fresh = model.new_cache(0);
    for (l, (layer, want)) in conv.cache.layers.iter_mut().zip(&fresh.layers).enumerate() {
        for (i, (buf, w)) in [&mut layer.k, &mut layer.v, &mut layer.aux]
            .into_iter()
            .zip([&want.k, &want.v, &want.aux])
            .enumerate()
        {
            let dtype = w.dtype();
            if dtype == KvDType::F32 {
                continue;
            }
            let values = buf.to_f32_vec();
            let mut narrow = KvBuf::new(dtype);
            narrow.extend(&values);
            if narrow
                .to_f32_vec()
                .iter()
                .zip(&values)
                .any(|(n, x)| n.to_bits() != x.to_bits())
            {
                let why = match dtype {
                    KvDType::Bf16 => "a bf16 cache, but this model keeps one (--kv-dtype bf16)",
                    _ => "an f16 cache, but this model keeps one (its attention runs at f16 precision, as for GGUF files)",
                };
                return Err(Error::Invalid(format!(
                    "{}: layer {l}: the saved `{}` buffer is not {why}; {FIX}",
                    path.display(),
                    BUFFERS[i]
                )));
            }
            *buf = narrow;
        }
    }
    Ok(conv)
}

/// Values per token of every layer's k, v and aux buffers: one token run through a fresh
/// cache.
pub fn values_per_token(model: &dyn CausalLm) -> Result<Vec<[usize; 3]>> {
    let mut cache = model.new_cache(1);
    model.forward(&[0], &mut cache, Logits::None)?;
    if cache.len != 1 {
        return Err(Error::Invalid(format!(
            "probing the cache layout: one token left {} tokens in the cache",
            cache.len
        )));
    }
    Ok(cache
        .layers
        .iter()
        .map(|l| [l.k.len(), l.v.len(), l.aux.len()])
        .collect())
}

fn to_usize(x: u64, path: &Path) -> Result<usize> {
    usize::try_from(x)
        .map_err(|_| Error::corrupt(path, format!("{x} does not fit this machine; {FIX}")))
}

/// Read as much of `buf` as the file holds; returns the bytes read.
fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// The body of a KV file being parsed: every read is checked against the bytes left, so bad
/// counts give an error, never a panic or a huge allocation.
struct Body<'a> {
    r: BufReader<File>,
    left: u64,
    path: &'a Path,
}

impl Body<'_> {
    fn take(&mut self, n: u64) -> Result<()> {
        if n > self.left {
            return Err(Error::corrupt(
                self.path,
                format!(
                    "its body ends early: {n} more bytes needed, {} left; {FIX}",
                    self.left
                ),
            ));
        }
        self.left -= n;
        Ok(())
    }

    fn bytes(&mut self, n: u64) -> Result<Vec<u8>> {
        self.take(n)?;
        let mut v = vec![0u8; n as usize];
        self.r
            .read_exact(&mut v)
            .map_err(|e| Error::io(self.path, e))?;
        Ok(v)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().unwrap()))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().unwrap()))
    }

    /// `n` 4-byte values, converted by `f`.
    fn words<T>(&mut self, n: u64, f: impl Fn([u8; 4]) -> T) -> Result<Vec<T>> {
        self.take(n.saturating_mul(4))?;
        let n = n as usize;
        let mut out = Vec::with_capacity(n);
        let mut buf = vec![0u8; 4 * CHUNK_VALUES.min(n)];
        while out.len() < n {
            let m = (n - out.len()).min(CHUNK_VALUES);
            self.r
                .read_exact(&mut buf[..4 * m])
                .map_err(|e| Error::io(self.path, e))?;
            out.extend(
                buf[..4 * m]
                    .chunks_exact(4)
                    .map(|c| f(c.try_into().unwrap())),
            );
        }
        Ok(out)
    }

    fn u32s(&mut self, n: u64) -> Result<Vec<u32>> {
        self.words(n, u32::from_le_bytes)
    }

    fn f32s(&mut self, n: u64) -> Result<Vec<f32>> {
        self.words(n, f32::from_le_bytes)
    }
}

/// A writer that hashes what it writes.
struct HashingWriter {
    out: AtomicFile,
    hash: Xxh64,
}

impl HashingWriter {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.hash.update(bytes);
        self.out.write_all(bytes)
    }
}

/// XXH64 (Yann Collet's xxHash, 64-bit, seed 0), streaming: fast (several GB/s, so a large
/// cache costs little to check) and stable across platforms and releases.
#[derive(Debug, Clone)]
pub struct Xxh64 {
    acc: [u64; 4],
    buf: [u8; 32],
    buffered: usize,
    total: u64,
}

impl Default for Xxh64 {
    fn default() -> Self {
        Self::new()
    }
}

impl Xxh64 {
    const P1: u64 = 0x9E37_79B1_85EB_CA87;
    const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
    const P3: u64 = 0x1656_67B1_9E37_79F9;
    const P4: u64 = 0x85EB_CA77_C2B2_AE63;
    const P5: u64 = 0x27D4_EB2F_1656_67C5;

    /// A hasher with seed 0.
    pub fn new() -> Xxh64 {
        Xxh64 {
            acc: [
                Self::P1.wrapping_add(Self::P2),
                Self::P2,
                0,
                0u64.wrapping_sub(Self::P1),
            ],
            buf: [0; 32],
            buffered: 0,
            total: 0,
        }
    }

    fn round(acc: u64, input: u64) -> u64 {
        acc.wrapping_add(input.wrapping_mul(Self::P2))
            .rotate_left(31)
            .wrapping_mul(Self::P1)
    }

    fn merge(h: u64, acc: u64) -> u64 {
        (h ^ Self::round(0, acc))
            .wrapping_mul(Self::P1)
            .wrapping_add(Self::P4)
    }

    fn stripe(acc: &mut [u64; 4], stripe: &[u8]) {
        for (i, a) in acc.iter_mut().enumerate() {
            let w = u64::from_le_bytes(stripe[8 * i..8 * i + 8].try_into().unwrap());
            *a = Self::round(*a, w);
        }
    }

    /// Hash `bytes` after what was hashed so far.
    pub fn update(&mut self, mut bytes: &[u8]) {
        self.total = self.total.wrapping_add(bytes.len() as u64);
        if self.buffered > 0 {
            let n = (32 - self.buffered).min(bytes.len());
            self.buf[self.buffered..self.buffered + n].copy_from_slice(&bytes[..n]);
            self.buffered += n;
            bytes = &bytes[n..];
            if self.buffered < 32 {
                return;
            }
            let buf = self.buf;
            Self::stripe(&mut self.acc, &buf);
            self.buffered = 0;
        }
        let mut stripes = bytes.chunks_exact(32);
        for s in &mut stripes {
            Self::stripe(&mut self.acc, s);
        }
        let rest = stripes.remainder();
        self.buf[..rest.len()].copy_from_slice(rest);
        self.buffered = rest.len();
    }

    /// The hash of everything given to [`update`](Self::update).
    pub fn digest(&self) -> u64 {
        let [a, b, c, d] = self.acc;
        let mut h = if self.total >= 32 {
            let mut h = a
                .rotate_left(1)
                .wrapping_add(b.rotate_left(7))
                .wrapping_add(c.rotate_left(12))
                .wrapping_add(d.rotate_left(18));
            for acc in [a, b, c, d] {
                h = Self::merge(h, acc);
            }
            h
        } else {
            Self::P5
        };
        h = h.wrapping_add(self.total);
        let mut rest = &self.buf[..self.buffered];
        while rest.len() >= 8 {
            let k = Self::round(0, u64::from_le_bytes(rest[..8].try_into().unwrap()));
            h = (h ^ k)
                .rotate_left(27)
                .wrapping_mul(Self::P1)
                .wrapping_add(Self::P4);
            rest = &rest[8..];
        }
        if rest.len() >= 4 {
            let k = u64::from(u32::from_le_bytes(rest[..4].try_into().unwrap()));
            h = (h ^ k.wrapping_mul(Self::P1))
                .rotate_left(23)
                .wrapping_mul(Self::P2)
                .wrapping_add(Self::P3);
            rest = &rest[4..];
        }
        for &byte in rest {
            h = (h ^ u64::from(byte).wrapping_mul(Self::P5))
                .rotate_left(11)
                .wrapping_mul(Self::P1);
        }
        h ^= h >> 33;
        h = h.wrapping_mul(Self::P2);
        h ^= h >> 29;
        h = h.wrapping_mul(Self::P3);
        h ^ (h >> 32)
    }
}

/// XXH64 (seed 0) of `bytes`.
pub fn xxh64(bytes: &[u8]) -> u64 {
    let mut h = Xxh64::new();
    h.update(bytes);
    h.digest()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::generate::{generate, generate_continue, GenerateParams};
    use crate::runtime::sampling::SamplingParams;

    const FP: &str = "0123456789abcdef";

    /// A conversation whose layers have different widths per buffer (an MLA-like layer with
    /// an aux buffer, a plain one without), with awkward float values.
    fn conversation() -> Conversation {
        let len = 5;
        let mut cache = KvCache::new(3, 64);
        cache.len = len;
        let widths = [[4, 4, 0], [3, 2, 5], [1, 7, 0]];
        let specials = [0.0, -0.0, f32::MAX, f32::MIN, f32::MIN_POSITIVE / 8.0];
        let mut x = 0x1234_5678u32;
        for (l, w) in cache.layers.iter_mut().zip(widths) {
            for (i, buf) in [&mut l.k, &mut l.v, &mut l.aux].into_iter().enumerate() {
                *buf = KvBuf::F32(
                    (0..w[i] * len)
                        .map(|j| {
                            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                            if j % 7 == 3 {
                                specials[j % specials.len()]
                            } else {
                                f32::from_bits(x >> 2) // finite, of every magnitude
                            }
                        })
                        .collect(),
                );
            }
        }
        Conversation {
            tokens: vec![7, 0, 383, 12, 99, 5],
            cache,
        }
    }

    fn saved(dir: &Path) -> (std::path::PathBuf, Vec<u8>) {
        let path = dir.join("conv.kv");
        let size = save(&path, FP, &conversation()).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len() as u64, size);
        (path, bytes)
    }

    fn bits(c: &KvCache) -> Vec<Vec<u32>> {
        c.layers
            .iter()
            .flat_map(|l| [&l.k, &l.v, &l.aux])
            .map(|b| b.to_f32_vec().iter().map(|x| x.to_bits()).collect())
            .collect()
    }

    #[test]
    fn xxh64_matches_the_reference_vectors() {
        assert_eq!(xxh64(b""), 0xEF46_DB37_51D8_E999);
        assert_eq!(xxh64(b"abc"), 0x44BC_2CF5_AD77_0999);
        assert_eq!(
            xxh64(b"Nobody inspects the spammish repetition"),
            0xFBCE_A83C_8A37_8BF1
        );
        // Streaming in uneven pieces gives the one-shot hash.
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
        for piece in [1, 3, 31, 32, 33, 100] {
            let mut h = Xxh64::new();
            for c in data.chunks(piece) {
                h.update(c);
            }
            assert_eq!(h.digest(), xxh64(&data), "pieces of {piece}");
        }
    }

    #[test]
    fn kv_file_round_trip_is_bit_identical() {
        let dir = tempfile::tempdir().unwrap();
        let (path, bytes) = saved(dir.path());
        assert_eq!(&bytes[..8], b"COLI_KV\0");
        let back = load(&path, FP).unwrap();
        let orig = conversation();
        assert_eq!(back, orig);
        assert_eq!(back.tokens, orig.tokens);
        assert_eq!(back.cache.len, orig.cache.len);
        assert_eq!(back.cache.max_len, orig.cache.max_len);
        assert_eq!(bits(&back.cache), bits(&orig.cache));
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn kv_file_with_a_corrupt_byte_fails_its_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let (path, bytes) = saved(dir.path());
        let bad = dir.path().join("bad.kv");
        // A value in the middle of the cache, a token id, the fingerprint, the checksum.
        for at in [
            bytes.len() / 2,
            24 + 4 + FP.len() + 4 + 24 + 2,
            24 + 4,
            bytes.len() - 1,
        ] {
            let mut b = bytes.clone();
            b[at] ^= 0x10;
            std::fs::write(&bad, &b).unwrap();
            let err = load(&bad, FP).unwrap_err().to_string();
            assert!(err.contains("checksum mismatch"), "byte {at}: {err}");
            assert!(err.contains("bad.kv"), "names the file: {err}");
        }
        // Every single flipped bit anywhere is refused, never accepted and never a panic.
        for at in 0..bytes.len() {
            for bit in [0x01u8, 0x80] {
                let mut b = bytes.clone();
                b[at] ^= bit;
                std::fs::write(&bad, &b).unwrap();
                assert!(load(&bad, FP).is_err(), "flipped {bit:#x} at byte {at}");
            }
        }
        assert!(load(&path, FP).is_ok());
    }

    #[test]
    fn kv_file_truncated_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (_, bytes) = saved(dir.path());
        let bad = dir.path().join("cut.kv");
        for n in 0..bytes.len() {
            std::fs::write(&bad, &bytes[..n]).unwrap();
            let err = load(&bad, FP).unwrap_err().to_string();
            if n >= 8 {
                assert!(err.contains("truncated"), "{n} bytes: {err}");
            } else {
                assert!(err.contains("not a colibri KV file"), "{n} bytes: {err}");
            }
        }
        let mut long = bytes.clone();
        long.push(0);
        std::fs::write(&bad, &long).unwrap();
        assert!(load(&bad, FP).is_err());
    }

    #[test]
    fn kv_file_of_another_model_or_format_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (path, bytes) = saved(dir.path());
        let err = load(&path, "fedcba9876543210").unwrap_err().to_string();
        assert!(
            err.contains("different model") && err.contains(FP) && err.contains("conv.kv"),
            "{err}"
        );
        let bad = dir.path().join("bad.kv");
        let mut b = bytes.clone();
        b[8] = 3; // version 3
        std::fs::write(&bad, &b).unwrap();
        let err = load(&bad, FP).unwrap_err().to_string();
        assert!(err.contains("version 3"), "{err}");
        let mut b = bytes.clone();
        b[0] = b'X';
        std::fs::write(&bad, &b).unwrap();
        let err = load(&bad, FP).unwrap_err().to_string();
        assert!(err.contains("not a colibri KV file"), "{err}");
        // A well-formed file whose counts lie (checksum recomputed) is refused, not a panic
        // nor a huge allocation.
        let mut b = bytes.clone();
        let tokens_at = 24 + 4 + FP.len() + 4;
        b[tokens_at..tokens_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let n = b.len() - 8;
        let sum = xxh64(&b[..n]);
        b[n..].copy_from_slice(&sum.to_le_bytes());
        std::fs::write(&bad, &b).unwrap();
        let err = load(&bad, FP).unwrap_err().to_string();
        assert!(err.contains("bad.kv"), "{err}");
    }

    /// `bytes` with its checksum recomputed, as a file damaged before it was summed.
    fn resummed(mut bytes: Vec<u8>) -> Vec<u8> {
        let n = bytes.len() - 8;
        let sum = xxh64(&bytes[..n]);
        bytes[n..].copy_from_slice(&sum.to_le_bytes());
        bytes
    }

    #[test]
    fn kv_file_with_a_non_finite_value_and_a_valid_checksum_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nan.kv");
        // Saved through `save`, so the checksum is right: each buffer kind, each non-finite
        // kind, and the last value of the last buffer.
        let cases: [(usize, &str, f32, &str); 4] = [
            (0, "k", f32::NAN, "NaN"),
            (1, "aux", f32::from_bits(0xffa0_0001), "NaN"),
            (1, "v", f32::INFINITY, "inf"),
            (2, "k", f32::NEG_INFINITY, "-inf"),
        ];
        for (layer, buffer, value, shown) in cases {
            let mut c = conversation();
            let l = &mut c.cache.layers[layer];
            let buf = match buffer {
                "k" => &mut l.k,
                "v" => &mut l.v,
                _ => &mut l.aux,
            };
            buf.f32_mut()[1] = value;
            save(&path, FP, &c).unwrap();
            let err = load(&path, FP).unwrap_err().to_string();
            assert!(
                err.contains("nan.kv")
                    && err.contains(&format!(
                        "layer {layer}: value 1 of its `{buffer}` buffer is {shown}"
                    ))
                    && err.contains("finite numbers only")
                    && err.contains("delete it"),
                "{buffer}: {err}"
            );
        }
        let mut c = conversation();
        let v = c.cache.layers[2].v.f32_mut();
        let n = v.len();
        v[n - 1] = f32::NAN;
        save(&path, FP, &c).unwrap();
        let err = load(&path, FP).unwrap_err().to_string();
        assert!(
            err.contains("layer 2: value 34 of its `v` buffer is NaN"),
            "{err}"
        );
    }

    #[test]
    fn kv_file_with_inconsistent_lengths_and_a_valid_checksum_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (path, bytes) = saved(dir.path());
        let bad = dir.path().join("bad.kv");
        let counts_at = 24 + 4 + FP.len() + 4;
        // cache_len (5) above max_len (64 → 4).
        let mut b = bytes.clone();
        b[counts_at + 16..counts_at + 24].copy_from_slice(&4u64.to_le_bytes());
        std::fs::write(&bad, resummed(b)).unwrap();
        let err = load(&bad, FP).unwrap_err().to_string();
        assert!(
            err.contains("bad.kv") && err.contains("holds 5 tokens but its capacity is 4"),
            "{err}"
        );
        // cache_len 5 → 4: layer 0's buffers of 4 values per token still divide (20 values),
        // layer 1's `k` of 3 per token (15 values) does not.
        let mut b = bytes.clone();
        b[counts_at + 8..counts_at + 16].copy_from_slice(&4u64.to_le_bytes());
        std::fs::write(&bad, resummed(b)).unwrap();
        let err = load(&bad, FP).unwrap_err().to_string();
        assert!(
            err.contains("bad.kv")
                && err.contains("layer 1: its `k` buffer holds 15 values, not a whole number of rows for 4 cached tokens"),
            "{err}"
        );
        // An empty cache with values.
        let mut b = bytes.clone();
        b[counts_at + 8..counts_at + 16].copy_from_slice(&0u64.to_le_bytes());
        std::fs::write(&bad, resummed(b)).unwrap();
        let err = load(&bad, FP).unwrap_err().to_string();
        assert!(
            err.contains("layer 0: its `k` buffer holds 20 values, not a whole number of rows for 0 cached tokens"),
            "{err}"
        );
        assert!(load(&path, FP).is_ok());
    }

    fn olmoe() -> (std::path::PathBuf, Box<dyn CausalLm>) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/olmoe");
        let model = crate::model::load(&dir).unwrap();
        (dir, model)
    }

    fn greedy(max_tokens: usize) -> GenerateParams {
        GenerateParams {
            max_tokens,
            eos_token_ids: vec![],
            stop_strings: vec![],
            sampling: SamplingParams::greedy(),
        }
    }

    #[test]
    fn kv_file_continuation_matches_an_uninterrupted_generation() {
        let (dir, model) = olmoe();
        let model = model.as_ref();
        let fp = model_fingerprint(&dir).unwrap();
        let prompt: Vec<u32> = (1..20).map(|i| (i * 37) % 384).collect();
        let (n, m) = (5, 7);

        // Uninterrupted.
        let mut whole = Conversation::new(model);
        let g = generate_continue(
            model,
            None,
            &mut whole,
            &prompt,
            &greedy(n + m),
            |_| {},
            |_| {},
        )
        .unwrap();
        assert_eq!(g.tokens.len(), n + m);
        let plain = generate(model, None, &prompt, &greedy(n + m), |_| {}, |_| {}).unwrap();
        assert_eq!(
            plain.tokens, g.tokens,
            "generate is generate_continue from scratch"
        );
        assert_eq!(whole.tokens.len(), prompt.len() + n + m);
        assert_eq!(
            whole.cache.len,
            whole.tokens.len() - 1,
            "last token pending"
        );

        // N tokens, saved, restored, M more.
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("c.kv");
        let mut first = Conversation::new(model);
        let g1 = generate_continue(model, None, &mut first, &prompt, &greedy(n), |_| {}, |_| {})
            .unwrap();
        save(&path, &fp, &first).unwrap();
        let mut second = restore(&path, &fp, model).unwrap();
        assert_eq!(second, first);
        let g2 =
            generate_continue(model, None, &mut second, &[], &greedy(m), |_| {}, |_| {}).unwrap();
        assert_eq!(g2.prompt_tokens, 1, "only the pending token is run");
        assert_eq!([g1.tokens, g2.tokens].concat(), g.tokens);
        assert_eq!(second.tokens, whole.tokens);
        assert_eq!(second.cache.len, whole.cache.len);
        assert_eq!(bits(&second.cache), bits(&whole.cache));

        // A conversation saved with nothing pending (no tokens generated) continues too.
        let mut none = Conversation::new(model);
        generate_continue(model, None, &mut none, &prompt, &greedy(0), |_| {}, |_| {}).unwrap();
        assert_eq!(none.cache.len, prompt.len());
        save(&path, &fp, &none).unwrap();
        let mut back = restore(&path, &fp, model).unwrap();
        let g3 =
            generate_continue(model, None, &mut back, &[], &greedy(n + m), |_| {}, |_| {}).unwrap();
        assert_eq!(g3.tokens, g.tokens);
    }

    #[test]
    fn kv_file_inconsistent_with_the_model_is_refused() {
        let (dir, model) = olmoe();
        let model = model.as_ref();
        let fp = model_fingerprint(&dir).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("c.kv");
        let mut conv = Conversation::new(model);
        generate_continue(
            model,
            None,
            &mut conv,
            &[1, 2, 3],
            &greedy(2),
            |_| {},
            |_| {},
        )
        .unwrap();
        check_model(&path, &conv, model).unwrap();

        let refused = |c: &Conversation, what: &str| {
            save(&path, &fp, c).unwrap();
            let err = restore(&path, &fp, model).unwrap_err().to_string();
            assert!(err.contains(what) && err.contains("c.kv"), "{what}: {err}");
        };
        let mut c = conv.clone();
        c.cache.layers.pop();
        refused(&c, "layers but the model has");
        let mut c = conv.clone();
        let l = c.cache.layers.len() - 1;
        // One more value per token: whole rows, of the wrong width.
        let one_per_token = vec![0.0; c.cache.len];
        c.cache.layers[l].v.extend(&one_per_token);
        refused(&c, "values per token");
        let mut c = conv.clone();
        c.cache.layers[l].v.extend(&[0.0]);
        refused(&c, "not a whole number of rows");
        let mut c = conv.clone();
        c.cache.layers[0].aux = KvBuf::F32(vec![0.0; c.cache.len]);
        refused(&c, "`aux` buffer");
        let mut c = conv.clone();
        c.tokens[0] = 384;
        refused(&c, "outside the model's vocabulary");
        let ctx = model.info().max_position_embeddings;
        let mut c = conv.clone();
        c.tokens.resize(ctx, 1);
        refused(&c, "no room to continue");
    }
}
