//! Multi-token-prediction drafts on a real MLA model: the deepseek_v3 fixture with an MTP block
//! added at layer `num_hidden_layers` (its decoder layer copied from layer 2, fresh `eh_proj`),
//! and on DeepSeek-V4: its fixture with the hub's `mtp.0.*` block (layer 2, a sliding-window
//! learned-routed layer, copied with its hyper-connections; fresh `e_proj`, `h_proj` and
//! `hc_head_*`). Drafting never changes a token — greedy or seeded sampling, resident or
//! streamed. A random
//! head's drafts are all rejected, so an "oracle" drafter that knows the answer except at every
//! third position also runs the real model through accepted drafts (two-row verification steps
//! whose second row is used) and rejected ones (the draft's cache row dropped).

mod common;
use common::{copy_text_files, fixture, load_error, prompt, write_tensors};

use std::path::Path;

use colibri::format::safetensors::Checkpoint;
use colibri::model::cache::KvCache;
use colibri::model::{self, CausalLm, Drafter, Logits, ModelInfo};
use colibri::model::{Draft, LoadOptions};
use colibri::runtime::generate::{generate, GenerateParams};
use colibri::runtime::sampling::SamplingParams;
use colibri::runtime::speculative::{generate_with_drafts, DraftPolicy};
use colibri::store::StoreOptions;
use colibri::tensor::DType;

/// A checkpoint's tensors `(name, dtype, shape, bytes)`.
type Tensors = Vec<(String, DType, Vec<usize>, Vec<u8>)>;

/// The fixture `arch`'s text files copied into `to`, its tensors, and each tensor of
/// `model.layers.2.` again under `prefix` (the MTP block's decoder layer); with the checkpoint.
fn fixture_with_layer_2_as(arch: &str, to: &Path, prefix: &str) -> (Checkpoint, Tensors) {
    let src = fixture(arch);
    copy_text_files(&src, to);
    let ck = Checkpoint::open(&src).unwrap();
    let mut tensors: Tensors = Vec::new();
    for n in ck.tensors().keys() {
        let t = ck.tensor_any_shape(n).unwrap();
        let bytes = t.storage.bytes().to_vec();
        tensors.push((n.clone(), t.dtype, t.shape.clone(), bytes.clone()));
        if let Some(rest) = n.strip_prefix("model.layers.2.") {
            tensors.push((format!("{prefix}{rest}"), t.dtype, t.shape.clone(), bytes));
        }
    }
    (ck, tensors)
}

/// Little-endian f32 bytes.
fn f32s(v: Vec<f32>) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A 32-bit xorshift stream of weights in `[-scale/2, scale/2)`.
struct Weights(u32);

impl Weights {
    /// The next `n` weights.
    fn take(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let x = &mut self.0;
                *x ^= *x << 13;
                *x ^= *x >> 17;
                *x ^= *x << 5;
                (*x as f32 / u32::MAX as f32 - 0.5) * scale
            })
            .collect()
    }
}

/// The fixture plus an MTP block at layer 3.
fn with_mtp(to: &Path) {
    let prefix = "model.layers.3.";
    let (ck, mut tensors) = fixture_with_layer_2_as("deepseek_v3", to, prefix);
    let d = 64;
    let ones = f32s(vec![1.0; d]);
    let eh = Weights(0x2545_f491).take(d * 2 * d, 0.3);
    let head = ck.tensor_any_shape("lm_head.weight").unwrap();
    for (name, shape, bytes) in [
        ("enorm.weight", vec![d], ones.clone()),
        ("hnorm.weight", vec![d], ones.clone()),
        ("eh_proj.weight", vec![d, 2 * d], f32s(eh)),
        ("shared_head.norm.weight", vec![d], ones),
        (
            "shared_head.head.weight",
            head.shape.clone(),
            head.storage.bytes().to_vec(),
        ),
    ] {
        tensors.push((format!("{prefix}{name}"), DType::F32, shape, bytes));
    }
    write_tensors(to, tensors);
}

/// The DeepSeek-V4 fixture plus the hub's MTP block (`mtp.0.*`).
fn with_v4_mtp(to: &Path) {
    let (_, mut tensors) = fixture_with_layer_2_as("deepseek_v4", to, "mtp.0.");
    let (d, hc) = (64, 2);
    let mut random = Weights(0x9e37_79b9);
    let e_proj = random.take(d * d, 0.3);
    let h_proj = random.take(d * d, 0.3);
    let hc_fn = random.take(hc * hc * d, 0.1);
    for (name, shape, bytes) in [
        ("enorm.weight", vec![d], f32s(vec![1.0; d])),
        ("hnorm.weight", vec![d], f32s(vec![1.0; d])),
        ("norm.weight", vec![d], f32s(vec![1.0; d])),
        ("e_proj.weight", vec![d, d], f32s(e_proj)),
        ("h_proj.weight", vec![d, d], f32s(h_proj)),
        ("hc_head_fn", vec![hc, hc * d], f32s(hc_fn)),
        ("hc_head_base", vec![hc], f32s(vec![0.0; hc])),
        ("hc_head_scale", vec![1], f32s(vec![1.0])),
    ] {
        tensors.push((format!("mtp.0.{name}"), DType::F32, shape, bytes));
    }
    write_tensors(to, tensors);
}

/// The fixture `arch` with an MTP block, written into `to`.
fn with_head(arch: &str, to: &Path) {
    match arch {
        "deepseek_v3" => with_mtp(to),
        "deepseek_v4" => with_v4_mtp(to),
        other => panic!("no MTP fixture for {other}"),
    }
}

fn params(sampling: SamplingParams, n: usize) -> GenerateParams {
    GenerateParams {
        max_tokens: n,
        eos_token_ids: vec![],
        stop_strings: vec![],
        sampling,
    }
}

fn seeded() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 11,
        ..SamplingParams::greedy()
    }
}

/// Run `test` on each fixture with an MTP block: its architecture, the checkpoint's directory
/// and the fixture's prompt.
fn for_each_mtp_fixture(test: impl Fn(&str, &Path, &[u32])) {
    for arch in ["deepseek_v3", "deepseek_v4"] {
        let dir = tempfile::tempdir().unwrap();
        with_head(arch, dir.path());
        test(arch, dir.path(), &prompt(arch));
    }
}

#[test]
fn mtp_drafts_never_change_the_tokens() {
    for_each_mtp_fixture(drafts_never_change_the_tokens);
}

fn drafts_never_change_the_tokens(arch: &str, dir: &Path, ids: &[u32]) {
    let plain_model = model::load(dir).unwrap();
    assert!(
        plain_model.drafter().is_none(),
        "the head loads only on request"
    );
    let resident = LoadOptions {
        draft: Draft::Mtp,
        ..LoadOptions::default()
    };
    let info = model::load_with(dir, &resident).unwrap().info().clone();
    // Streamed: the MTP layer's experts go through the store like the others.
    let streamed = LoadOptions {
        placement: StoreOptions {
            ram_budget: Some(info.dense_bytes as u64 + 4096),
            io_threads: 2,
            ..StoreOptions::default()
        },
        ..resident.clone()
    };
    for opts in [resident, streamed] {
        let m = model::load_with(dir, &opts).unwrap();
        for sampling in [SamplingParams::greedy(), seeded()] {
            let p = params(sampling, 24);
            let want = generate(plain_model.as_ref(), None, ids, &p, |_| {}, |_| {}).unwrap();
            for policy in [DraftPolicy::Always, DraftPolicy::Auto] {
                let (got, stats) =
                    generate_with_drafts(m.as_ref(), None, ids, &p, policy, |_| {}, |_| {})
                        .unwrap();
                eprintln!("{arch}: {policy:?}: {} tokens, {stats:?}", got.tokens.len());
                assert_eq!(got.tokens, want.tokens, "{arch}: {policy:?}");
                assert!(stats.drafted > 0, "{arch}: {stats:?}");
            }
        }
    }
}

/// The real model, with drafts from the known answer except at every third position.
struct Oracle {
    inner: Box<dyn CausalLm>,
    answer: Vec<u32>,
    prompt_len: usize,
}

impl CausalLm for Oracle {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }
    fn new_cache(&self, max_len: usize) -> KvCache {
        self.inner.new_cache(max_len)
    }
    fn forward(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: Logits,
    ) -> colibri::Result<Vec<f32>> {
        self.inner.forward(tokens, cache, logits)
    }
    fn drafter(&self) -> Option<&dyn Drafter> {
        Some(self)
    }
}

impl Drafter for Oracle {
    fn new_draft_cache(&self, max_len: usize) -> KvCache {
        KvCache::new(1, max_len)
    }
    fn forward_hidden(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> colibri::Result<(Vec<f32>, Vec<f32>)> {
        let (logits, hidden) = self
            .inner
            .drafter()
            .unwrap()
            .forward_hidden(tokens, cache)?;
        Ok((logits, hidden))
    }
    fn draft(
        &self,
        _hidden: &[f32],
        next: &[u32],
        cache: &mut KvCache,
    ) -> colibri::Result<Vec<f32>> {
        cache.len += next.len();
        let pos = cache.len; // position of next.last()
        let i = pos + 1 - self.prompt_len; // index in the answer of the token to draft
        let v = self.info().vocab_size;
        let mut row = vec![0.0f32; v];
        let mut guess = self.answer.get(i).copied().unwrap_or(0) as usize;
        if pos.is_multiple_of(3) {
            guess = (guess + 1) % v;
        }
        row[guess] = 1.0;
        Ok(row)
    }
}

#[test]
fn accepted_and_rejected_drafts_keep_the_greedy_tokens() {
    for_each_mtp_fixture(oracle_drafts_keep_the_greedy_tokens);
}

fn oracle_drafts_keep_the_greedy_tokens(arch: &str, dir: &Path, ids: &[u32]) {
    let opts = LoadOptions {
        draft: Draft::Mtp,
        ..LoadOptions::default()
    };
    let p = params(SamplingParams::greedy(), 30);
    let plain = model::load(dir).unwrap();
    let want = generate(plain.as_ref(), None, ids, &p, |_| {}, |_| {}).unwrap();
    let oracle = Oracle {
        inner: model::load_with(dir, &opts).unwrap(),
        answer: want.tokens.clone(),
        prompt_len: ids.len(),
    };
    let (got, stats) =
        generate_with_drafts(&oracle, None, ids, &p, DraftPolicy::Always, |_| {}, |_| {}).unwrap();
    assert_eq!(got.tokens, want.tokens, "{arch}");
    assert!(
        stats.accepted >= 5 && stats.accepted < stats.drafted,
        "{arch}: {stats:?}"
    );
}

#[test]
fn deepseek_v4_without_its_mtp_block_refuses_draft_mtp_naming_it() {
    let opts = LoadOptions {
        draft: Draft::Mtp,
        ..LoadOptions::default()
    };
    let err = load_error(&fixture("deepseek_v4"), &opts);
    assert!(
        err.contains("mtp.0.e_proj.weight") && err.contains("--draft mtp"),
        "{err}"
    );
}
