//! Speculative decoding with the model's own multi-token-prediction (MTP) head.
//!
//! After each step the MTP head drafts the token after the one just sampled; the main model
//! then runs both tokens in one forward pass. The first row's logits give the next token
//! exactly as plain decoding would (the kernels are batch-invariant, so a row's bits do not
//! depend on the rows beside it); if that token is the draft, the second row's logits give
//! one more token for free, otherwise the draft's cache entry is dropped. The sampler runs
//! once per emitted token on the main model's logits, in order, so the output — greedy or
//! seeded sampling — is exactly what decoding without drafts produces.
//!
//! Drafting costs the head's layer (with its own routed experts) and a wider verification
//! step (the union of two tokens' experts), which does not pay when reading experts from
//! disk dominates. [`DraftPolicy::Auto`] measures both modes on the run itself and keeps the
//! faster, probing the other again now and then; the tokens are the same either way.

use std::time::Instant;

use super::generate::{FinishReason, GenerateParams, Generation, StopText};
use super::sampling::Sampler;
use crate::format::tokenizer::Tokenizer;
use crate::model::{CausalLm, Drafter};
use crate::{Error, Result};

/// When to draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftPolicy {
    /// Draft at every step.
    Always,
    /// Draft while it is measured to be faster than plain decoding.
    Auto,
}

/// What drafting did during a generation.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct DraftStats {
    /// Drafts the main model verified.
    pub drafted: usize,
    /// Drafts that were the main model's own choice (each one a token without its own step).
    pub accepted: usize,
    /// Decode steps taken with a draft and without one.
    pub draft_steps: usize,
    pub plain_steps: usize,
    /// Measured decode speed of each mode (tokens per second), when it ran.
    pub draft_tok_per_s: Option<f64>,
    pub plain_tok_per_s: Option<f64>,
}

impl DraftStats {
    /// Accepted drafts over verified ones.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// Tokens a mode runs for before its speed counts.
const WINDOW: usize = 16;
/// Tokens between probes of the mode not in use.
const REPROBE: usize = 128;

/// [`DraftPolicy::Auto`]'s bookkeeping: timed windows of each mode.
struct Chooser {
    policy: DraftPolicy,
    drafting: bool,
    window_start: Instant,
    window_tokens: usize,
    since_probe: usize,
    rate: [Option<f64>; 2], // [plain, draft]
}

impl Chooser {
    fn new(policy: DraftPolicy) -> Chooser {
        Chooser {
            policy,
            drafting: true,
            window_start: Instant::now(),
            window_tokens: 0,
            since_probe: 0,
            rate: [None, None],
        }
    }

    /// Count `n` emitted tokens; maybe switch mode.
    fn emitted(&mut self, n: usize) {
        if self.policy == DraftPolicy::Always {
            return;
        }
        self.window_tokens += n;
        self.since_probe += n;
        if self.window_tokens < WINDOW {
            return;
        }
        let rate = self.window_tokens as f64 / self.window_start.elapsed().as_secs_f64().max(1e-9);
        self.rate[self.drafting as usize] = Some(rate);
        let other = self.rate[!self.drafting as usize];
        self.drafting = match other {
            // Measure the other mode once.
            None => !self.drafting,
            Some(o) if self.since_probe >= REPROBE => {
                self.since_probe = 0;
                // Probe the slower mode again (the machine's load may have changed).
                if o < rate {
                    !self.drafting
                } else {
                    self.drafting
                }
            }
            Some(o) => {
                if o > rate {
                    !self.drafting
                } else {
                    self.drafting
                }
            }
        };
        self.window_tokens = 0;
        self.window_start = Instant::now();
    }
}

/// The argmax of a logits row (ties: lower id).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Generate from `prompt` as [`super::generate::generate`] does, drafting with the model's
/// MTP head. The tokens are identical to plain generation's.
pub fn generate_with_drafts(
    model: &dyn CausalLm,
    tokenizer: Option<&Tokenizer>,
    prompt: &[u32],
    params: &GenerateParams,
    policy: DraftPolicy,
    mut on_text: impl FnMut(&str),
    mut on_token: impl FnMut(u32),
) -> Result<(Generation, DraftStats)> {
    let drafter: &dyn Drafter = model.drafter().ok_or_else(|| {
        Error::Invalid("this model was loaded without a multi-token-prediction head".into())
    })?;
    if prompt.is_empty() {
        return Err(Error::Invalid("the prompt is empty".into()));
    }
    params.sampling.validate()?;
    if !params.stop_strings.is_empty() && tokenizer.is_none() {
        return Err(Error::Invalid("stop strings need a tokenizer".into()));
    }
    let info = model.info();
    let vocab = info.vocab_size;
    let ctx = info.max_position_embeddings.max(1);
    if prompt.len() >= ctx {
        return Err(Error::Invalid(format!(
            "the prompt has {} tokens but the model's context is {ctx} tokens",
            prompt.len()
        )));
    }
    // One more position than plain decoding: a draft may sit in the cache past the limit.
    let max_len = (prompt.len() + params.max_tokens + 1).min(ctx);
    let mut cache = model.new_cache(max_len);
    let mut draft_cache = drafter.new_draft_cache(max_len);
    let mut sampler = Sampler::new(params.sampling);
    let mut history: Vec<u32> = prompt.to_vec();
    let mut tokens = Vec::new();
    let mut text = StopText::new(params.stop_strings.clone());
    let mut stats = DraftStats::default();
    let mut finish_reason = FinishReason::Length;

    // Emit one sampled id: false when generation ends with it.
    let mut emit = |id: u32,
                    tokens: &mut Vec<u32>,
                    history: &mut Vec<u32>,
                    finish: &mut FinishReason|
     -> Result<bool> {
        if params.eos_token_ids.contains(&id) {
            *finish = FinishReason::Stop;
            return Ok(false);
        }
        tokens.push(id);
        history.push(id);
        on_token(id);
        if text.deliver(tokenizer, id, &mut on_text)? {
            *finish = FinishReason::Stop;
            return Ok(false);
        }
        Ok(tokens.len() < params.max_tokens)
    };

    let t0 = Instant::now();
    let (logits, hidden) = drafter.forward_hidden(prompt, &mut cache)?;
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let n = prompt.len();
    // Hidden values per position: `hidden_size`, or more where the residual is several
    // streams (DeepSeek-V4's hyper-connections).
    let d = hidden.len() / n;
    let mut last = sampler.sample(&logits[(n - 1) * vocab..], &history);
    let mut going = emit(last, &mut tokens, &mut history, &mut finish_reason)?;
    // The head has not seen these (hidden row, next token) pairs yet.
    let mut unseen_hidden = hidden;
    let mut unseen_next: Vec<u32> = prompt[1..].iter().copied().chain([last]).collect();
    let mut chooser = Chooser::new(policy);
    while going && cache.len + 2 <= max_len {
        if chooser.drafting {
            let draft_logits = drafter.draft(&unseen_hidden, &unseen_next, &mut draft_cache)?;
            let draft = argmax(&draft_logits);
            // A recurrent state cannot drop the draft's position afterwards: keep a copy.
            cache.checkpoint();
            let (logits, hidden) = drafter.forward_hidden(&[last, draft], &mut cache)?;
            stats.drafted += 1;
            stats.draft_steps += 1;
            let x = sampler.sample(&logits[..vocab], &history);
            going = emit(x, &mut tokens, &mut history, &mut finish_reason)?;
            let mut emitted = 1;
            if x == draft && going {
                stats.accepted += 1;
                let y = sampler.sample(&logits[vocab..], &history);
                going = emit(y, &mut tokens, &mut history, &mut finish_reason)?;
                emitted = 2;
                unseen_hidden = hidden;
                unseen_next = vec![x, y];
                last = y;
            } else {
                if x == draft {
                    stats.accepted += 1;
                }
                // The draft's position is not part of the sequence (or generation ended).
                let target = cache.len - 1;
                let kept = cache.truncate(target);
                if kept < target {
                    // A recurrent state went back to its checkpoint: recompute up to the
                    // draft (the cache holds `history[..target]`).
                    drafter.forward_hidden(&history[kept..target], &mut cache)?;
                }
                unseen_hidden = hidden[..d].to_vec();
                unseen_next = vec![x];
                last = x;
            }
            chooser.emitted(emitted);
        } else {
            let (logits, hidden) = drafter.forward_hidden(&[last], &mut cache)?;
            stats.plain_steps += 1;
            let x = sampler.sample(&logits, &history);
            going = emit(x, &mut tokens, &mut history, &mut finish_reason)?;
            // Keep the head's cache complete, so drafting can resume where it left off.
            unseen_hidden.extend_from_slice(&hidden);
            unseen_next.push(x);
            last = x;
            chooser.emitted(1);
        }
    }
    if going && tokens.len() < params.max_tokens {
        // The cache can hold one more token but not a draft beside it.
        let (logits, _) = drafter.forward_hidden(&[last], &mut cache)?;
        let x = sampler.sample(&logits, &history);
        emit(x, &mut tokens, &mut history, &mut finish_reason)?;
    }
    if let Some(tok) = tokenizer {
        let (piece, stopped) = text.finish(tok)?;
        if stopped {
            finish_reason = FinishReason::Stop;
        }
        if !piece.is_empty() {
            on_text(&piece);
        }
    }
    stats.plain_tok_per_s = chooser.rate[0];
    stats.draft_tok_per_s = chooser.rate[1];
    Ok((
        Generation {
            tokens,
            text: text.into_text(),
            finish_reason,
            prompt_tokens: n,
            prefill_seconds,
            decode_seconds: t1.elapsed().as_secs_f64(),
        },
        stats,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::cache::KvCache;
    use crate::model::{Logits, ModelInfo};
    use crate::runtime::generate::generate;
    use crate::runtime::sampling::SamplingParams;

    const V: usize = 8;

    /// The toy model's next token after `t` at position `p` with recurrent state `state`.
    fn next(t: u32, p: usize, state: usize) -> usize {
        (3 * t as usize + p + state) % V
    }

    /// Logits peaked at `next(t, p, state)` (a spread distribution, so sampling has choices).
    fn row(t: u32, p: usize, state: usize) -> Vec<f32> {
        let f = next(t, p, state);
        (0..V).map(|v| -(((v + V - f) % V) as f32) * 0.7).collect()
    }

    /// A toy main model (one cached value per token) with a drafter that is right except
    /// at positions divisible by 3. `recurrent`: its layer also keeps a state that every token
    /// updates and every prediction reads (as linear attention does), so a cache that kept a
    /// rejected draft's update, or lost an accepted one, predicts other tokens; its drafter,
    /// blind to the state, is often wrong.
    struct Toy {
        info: ModelInfo,
        recurrent: bool,
    }

    impl Toy {
        fn new() -> Toy {
            Toy {
                info: ModelInfo {
                    vocab_size: V,
                    hidden_size: 2,
                    max_position_embeddings: 1000,
                    ..ModelInfo::default()
                },
                recurrent: false,
            }
        }

        fn recurrent() -> Toy {
            Toy {
                recurrent: true,
                ..Toy::new()
            }
        }
    }

    impl CausalLm for Toy {
        fn info(&self) -> &ModelInfo {
            &self.info
        }
        fn new_cache(&self, max_len: usize) -> KvCache {
            let mut cache = KvCache::new(1, max_len);
            if self.recurrent {
                cache.layers[0].state = vec![0.0];
            }
            cache
        }
        fn forward(&self, tokens: &[u32], cache: &mut KvCache, logits: Logits) -> Result<Vec<f32>> {
            let (all, _) = self.forward_hidden(tokens, cache)?;
            Ok(match logits {
                Logits::All => all,
                Logits::Last => all[all.len() - V..].to_vec(),
                Logits::None => Vec::new(),
            })
        }
        fn drafter(&self) -> Option<&dyn Drafter> {
            Some(self)
        }
    }

    impl Drafter for Toy {
        fn new_draft_cache(&self, max_len: usize) -> KvCache {
            KvCache::new(1, max_len)
        }
        fn forward_hidden(
            &self,
            tokens: &[u32],
            cache: &mut KvCache,
        ) -> Result<(Vec<f32>, Vec<f32>)> {
            assert!(cache.len + tokens.len() <= cache.max_len, "cache overflow");
            assert_eq!(
                cache.layers[0].k.len(),
                cache.len,
                "truncation kept the cache whole"
            );
            let mut logits = Vec::new();
            let mut hidden = Vec::new();
            for (j, &t) in tokens.iter().enumerate() {
                let p = cache.len + j;
                let state = &mut cache.layers[0].state;
                let s = if let Some(s) = state.first_mut() {
                    *s = ((*s as usize * 5 + t as usize + 1) % 1009) as f32;
                    *s as usize
                } else {
                    0
                };
                logits.extend(row(t, p, s));
                hidden.extend([p as f32, t as f32]);
                cache.layers[0].k.extend(&[t as f32]);
            }
            cache.len += tokens.len();
            Ok((logits, hidden))
        }
        fn draft(&self, hidden: &[f32], next_ids: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
            assert_eq!(hidden.len(), 2 * next_ids.len());
            for (i, pair) in hidden.chunks(2).enumerate() {
                // Pair i is (h_i, t_{i+1}); the head sees every pair once, in order.
                assert_eq!(pair[0] as usize, cache.len + i, "pairs arrive in order");
            }
            cache.len += next_ids.len();
            let last = *next_ids.last().unwrap();
            let pos = cache.len; // position of `last`
            let mut out = vec![0.0; V];
            let guess = if pos.is_multiple_of(3) {
                (next(last, pos, 0) + 1) % V
            } else {
                next(last, pos, 0)
            };
            out[guess] = 1.0;
            Ok(out)
        }
    }

    fn params(sampling: SamplingParams, max_tokens: usize) -> GenerateParams {
        GenerateParams {
            max_tokens,
            eos_token_ids: vec![],
            stop_strings: vec![],
            sampling,
        }
    }

    #[test]
    fn drafts_never_change_the_tokens_greedy_or_sampled() {
        let toy = Toy::new();
        let prompt = [1u32, 5, 2];
        let mut seeded = SamplingParams::greedy();
        seeded.temperature = 1.0;
        seeded.top_k = 0;
        seeded.top_p = 1.0;
        seeded.min_p = 0.0;
        seeded.seed = 7;
        for sampling in [SamplingParams::greedy(), seeded] {
            for max_tokens in [1, 2, 5, 40] {
                let p = params(sampling, max_tokens);
                let plain = generate(&toy, None, &prompt, &p, |_| {}, |_| {}).unwrap();
                for policy in [DraftPolicy::Always, DraftPolicy::Auto] {
                    let (got, stats) =
                        generate_with_drafts(&toy, None, &prompt, &p, policy, |_| {}, |_| {})
                            .unwrap();
                    assert_eq!(got.tokens, plain.tokens, "{policy:?} max {max_tokens}");
                    if policy == DraftPolicy::Always && max_tokens == 40 {
                        assert!(stats.drafted > 10, "{stats:?}");
                        assert!(
                            stats.accepted > 0 && stats.accepted < stats.drafted,
                            "{stats:?}"
                        );
                        // Accepted drafts save steps.
                        assert_eq!(stats.draft_steps + stats.accepted + 1, 40, "{stats:?}");
                    }
                }
            }
        }
    }

    /// A recurrent state cannot drop a rejected draft's position: it goes back to the
    /// checkpoint taken before the verification and the kept token is run again, so drafting
    /// (mostly rejected here) gives exactly the tokens of plain decoding.
    #[test]
    fn rejected_drafts_leave_a_recurrent_state_exact() {
        let toy = Toy::recurrent();
        let prompt = [1u32, 5, 2];
        let p = params(SamplingParams::greedy(), 40);
        let plain = generate(&toy, None, &prompt, &p, |_| {}, |_| {}).unwrap();
        let (got, stats) =
            generate_with_drafts(&toy, None, &prompt, &p, DraftPolicy::Always, |_| {}, |_| {})
                .unwrap();
        assert!(
            stats.drafted > 10 && stats.accepted < stats.drafted,
            "{stats:?}"
        );
        assert_eq!(got.tokens, plain.tokens);
        // The toy really depends on its state: starting from another state changes the tokens.
        let mut other = toy.new_cache(64);
        other.layers[0].state[0] = 3.0;
        let mut from_other = Vec::new();
        let mut logits = toy.forward(&prompt, &mut other, Logits::Last).unwrap();
        for _ in 0..8 {
            let last = super::argmax(&logits);
            from_other.push(last);
            logits = toy.forward(&[last], &mut other, Logits::Last).unwrap();
        }
        assert_ne!(from_other[..], plain.tokens[..8]);
    }
}
