//! Choosing the next token from logits: sampling parameters and their validation, the
//! penalties (repetition, presence, frequency), temperature, top-k / top-p / min-p
//! truncation, and a small seeded RNG (xoshiro256** seeded by splitmix64) so that a request
//! with a seed is reproducible.

use std::collections::HashMap;

use crate::error::{Error, Result};

/// How to pick tokens. The defaults sample from the model's unmodified distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy decoding.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` turns it off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`;
    /// `1` turns it off. Must lie in (0, 1].
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; `0` turns it off.
    pub min_p: f32,
    /// HF repetition penalty on every token seen before; `1` turns it off.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty, subtracted once from every token seen before.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty, subtracted once per earlier occurrence of a token.
    pub frequency_penalty: f32,
    /// Seed of the sampler's random number generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0), everything else off.
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
    }

    /// Check every field, naming the first bad one in an [`Error::Invalid`]: temperature and
    /// min-p must be finite and non-negative (min-p at most 1), top-p in (0, 1], the
    /// repetition penalty finite and positive, presence and frequency penalties in [-2, 2]
    /// (the OpenAI range; negative values encourage repetition).
    pub fn validate(&self) -> Result<()> {
        let invalid = |field: &str, value: f32, expected: &str| {
            Err(Error::Invalid(format!(
                "sampling parameter `{field}` is {value}; expected {expected}"
            )))
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return invalid("temperature", self.temperature, "a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return invalid("top_p", self.top_p, "a number in (0, 1]");
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return invalid("min_p", self.min_p, "a number in [0, 1]");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return invalid(
                "repetition_penalty",
                self.repetition_penalty,
                "a finite number > 0",
            );
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return invalid(
                "presence_penalty",
                self.presence_penalty,
                "a number in [-2, 2]",
            );
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return invalid(
                "frequency_penalty",
                self.frequency_penalty,
                "a number in [-2, 2]",
            );
        }
        Ok(())
    }

    fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

/// xoshiro256** (Blackman & Vigna), seeded through splitmix64.
#[derive(Debug, Clone)]
struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    fn seeded(seed: u64) -> Xoshiro256 {
        let mut x = seed;
        let mut splitmix64 = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Xoshiro256 {
            s: [splitmix64(), splitmix64(), splitmix64(), splitmix64()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1), 53 bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// The size of the first top-k tried when top-p needs the candidates in order: usually
/// enough to reach `top_p`, and much cheaper than sorting the whole vocabulary.
const TOP_P_FIRST_TRY: usize = 512;

/// Picks tokens from logits according to [`SamplingParams`], with its own seeded RNG.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256,
    /// Scratch: (token, logit) candidates, reused between calls.
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for `params` (which should have passed [`SamplingParams::validate`]),
    /// its RNG seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler {
            params,
            rng: Xoshiro256::seeded(params.seed),
            candidates: Vec::new(),
        }
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Pick the next token from `logits` (one per vocabulary entry), given the tokens
    /// `previous_tokens` that the penalties look at.
    ///
    /// Penalties apply first (also when greedy, as in HF and vLLM): the repetition penalty
    /// divides positive and multiplies negative logits of every distinct earlier token; the
    /// presence and frequency penalties subtract `presence + frequency × count`. Temperature
    /// 0 then takes the argmax (lowest index on ties). Otherwise the logits are divided by
    /// the temperature, truncated by top-k, top-p and min-p in that order, and a token is
    /// drawn from the renormalised distribution. NaN logits count as `-inf`; ids in
    /// `previous_tokens` beyond the vocabulary are ignored; empty logits give token 0.
    pub fn sample(&mut self, logits: &[f32], previous_tokens: &[u32]) -> u32 {
        let p = self.params;
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.clear();
        candidates.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, if l.is_nan() { f32::NEG_INFINITY } else { l })),
        );
        if p.has_penalties() {
            apply_penalties(&mut candidates, previous_tokens, &p);
        }
        let token = if p.temperature == 0.0 {
            argmax(&candidates)
        } else {
            self.draw(&mut candidates)
        };
        self.candidates = candidates;
        token
    }

    /// Temperature, truncation and the random draw over `candidates` (all tokens, in order).
    fn draw(&mut self, candidates: &mut Vec<(u32, f32)>) -> u32 {
        let p = self.params;
        let fallback = argmax(candidates);
        candidates.retain(|&(_, l)| l > f32::NEG_INFINITY);
        if candidates.is_empty() {
            return fallback;
        }
        let inv_t = 1.0 / p.temperature;
        if !inv_t.is_finite() {
            // A temperature this close to 0 is greedy decoding.
            return fallback;
        }
        for c in candidates.iter_mut() {
            c.1 *= inv_t;
        }
        // After a top-k cut the candidates are sorted, most likely first.
        let mut sorted = false;
        if p.top_k > 0 && p.top_k < candidates.len() {
            candidates.select_nth_unstable_by(p.top_k - 1, by_rank);
            candidates.truncate(p.top_k);
            candidates.sort_unstable_by(by_rank);
            sorted = true;
        }
        if p.top_p < 1.0 {
            cut_top_p(candidates, sorted, p.top_p);
        }
        if p.min_p > 0.0 {
            let max = max_logit(candidates);
            // prob < min_p × max prob  ⇔  logit < max logit + ln(min_p)
            let threshold = max + p.min_p.ln();
            candidates.retain(|&(_, l)| l >= threshold || l == max);
        }

        let max = max_logit(candidates);
        let total: f64 = candidates
            .iter()
            .map(|&(_, l)| ((l - max) as f64).exp())
            .sum();
        let target = self.rng.next_f64() * total;
        let mut acc = 0.0;
        for &(id, l) in candidates.iter() {
            acc += ((l - max) as f64).exp();
            if acc > target {
                return id;
            }
        }
        // Rounding left `target` beyond the sum: take the last candidate.
        candidates.last().map(|c| c.0).unwrap_or(fallback)
    }
}

/// Repetition penalty (HF), then presence and frequency penalties (OpenAI).
fn apply_penalties(candidates: &mut [(u32, f32)], previous: &[u32], p: &SamplingParams) {
    let mut counts: HashMap<u32, u32> = HashMap::new();
    for &t in previous {
        if (t as usize) < candidates.len() {
            *counts.entry(t).or_insert(0) += 1;
        }
    }
    for (&t, &n) in &counts {
        let l = &mut candidates[t as usize].1;
        if p.repetition_penalty != 1.0 {
            *l = if *l > 0.0 {
                *l / p.repetition_penalty
            } else {
                *l * p.repetition_penalty
            };
        }
        *l -= p.presence_penalty + p.frequency_penalty * n as f32;
    }
}

/// The id with the largest logit, the lowest id among equals; 0 when there is none.
fn argmax(candidates: &[(u32, f32)]) -> u32 {
    let mut best: Option<(u32, f32)> = None;
    for &(id, l) in candidates {
        match best {
            Some((_, b)) if l <= b => {}
            _ => best = Some((id, l)),
        }
    }
    best.map(|b| b.0).unwrap_or(0)
}

fn max_logit(candidates: &[(u32, f32)]) -> f32 {
    candidates
        .iter()
        .map(|c| c.1)
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Most likely first; among equal logits the lower id first (a total order, so the first k
/// of it are well defined).
fn by_rank(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Truncate `candidates` to the smallest set of most likely tokens whose probability
/// (normalised over `candidates`) reaches `top_p`, leaving them sorted; always keeps one.
/// When not yet `sorted`, only the first [`TOP_P_FIRST_TRY`] are ordered at first and the
/// rest only if the nucleus reaches beyond them.
fn cut_top_p(candidates: &mut Vec<(u32, f32)>, sorted: bool, top_p: f32) {
    let len = candidates.len();
    let max = max_logit(candidates);
    let weight = |l: f32| ((l - max) as f64).exp();
    let total: f64 = candidates.iter().map(|c| weight(c.1)).sum();
    let goal = top_p as f64 * total;
    let mut sorted_upto = len;
    if !sorted {
        sorted_upto = TOP_P_FIRST_TRY.min(len);
        if sorted_upto < len {
            candidates.select_nth_unstable_by(sorted_upto - 1, by_rank);
        }
        candidates[..sorted_upto].sort_unstable_by(by_rank);
    }
    let mut acc = 0.0;
    for i in 0..len {
        if i == sorted_upto {
            // Everything from here on ranks below the sorted head.
            candidates[i..].sort_unstable_by(by_rank);
            sorted_upto = len;
        }
        acc += weight(candidates[i].1);
        if acc >= goal {
            candidates.truncate(i + 1);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    fn draws(p: SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = Sampler::new(p);
        (0..n).map(|_| s.sample(logits, &[])).collect()
    }

    const LOGITS: [f32; 8] = [0.5, 2.0, -1.0, 1.9, 0.0, 1.0, -3.0, 0.7];

    #[test]
    fn greedy_takes_argmax_lowest_index_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&LOGITS, &[]), 1);
        assert_eq!(s.sample(&[0.0, 3.0, -1.0, 3.0], &[]), 1);
        assert_eq!(s.sample(&[f32::NAN, -5.0, f32::NEG_INFINITY], &[]), 1);
    }

    #[test]
    fn same_seed_same_sequence_other_seed_differs() {
        let flat = [0.0f32; 16];
        let a = draws(params(|p| p.seed = 42), &flat, 50);
        let b = draws(params(|p| p.seed = 42), &flat, 50);
        let c = draws(params(|p| p.seed = 43), &flat, 50);
        assert_eq!(a, b);
        assert_ne!(a, c);
        // Not stuck on one token.
        assert!(a.iter().any(|&t| t != a[0]));
    }

    #[test]
    fn xoshiro_matches_reference_output() {
        // Published vectors: xoshiro256** from state [1, 2, 3, 4] yields 11520, 0,
        // 1509978240, 1215971899390074240 (reference C implementation, as in rand_xoshiro's
        // tests); splitmix64 from seed 0 yields 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4.
        let mut r = Xoshiro256 { s: [1, 2, 3, 4] };
        let out: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
        assert_eq!(out, vec![11520, 0, 1509978240, 1215971899390074240]);
        let seeded = Xoshiro256::seeded(0);
        assert_eq!(seeded.s[..2], [0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4]);
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let sampled = draws(
            params(|p| {
                p.top_k = 1;
                p.seed = 7
            }),
            &LOGITS,
            200,
        );
        assert!(sampled.iter().all(|&t| t == 1), "{sampled:?}");
    }

    #[test]
    fn top_k_restricts_to_k_best() {
        let sampled = draws(params(|p| p.top_k = 3), &LOGITS, 2000);
        assert!(sampled.iter().all(|t| [1, 3, 5].contains(t)), "{sampled:?}");
        for t in [1, 3, 5] {
            assert!(sampled.contains(&t), "token {t} never drawn");
        }
    }

    #[test]
    fn small_top_p_only_draws_top_token() {
        // Token 1 alone has probability ≈ 0.31 here, which already covers top_p = 0.2.
        let sampled = draws(params(|p| p.top_p = 0.2), &LOGITS, 2000);
        assert!(sampled.iter().all(|&t| t == 1), "{sampled:?}");
    }

    #[test]
    fn top_p_keeps_smallest_covering_set() {
        // Probabilities 0.5, 0.25, 0.125, 0.125 (logits ln of them).
        let logits = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.125f32.ln()];
        let sampled = draws(params(|p| p.top_p = 0.7), &logits, 4000);
        assert!(sampled.iter().all(|&t| t == 0 || t == 1), "{sampled:?}");
        let ones = sampled.iter().filter(|&&t| t == 1).count() as f64 / 4000.0;
        // Renormalised over {0, 1}: token 1 has 1/3.
        assert!((ones - 1.0 / 3.0).abs() < 0.03, "{ones}");
    }

    #[test]
    fn top_p_over_a_large_vocabulary() {
        // 5000 equally likely tokens: top_p = 0.5 needs 2500 of them, beyond the first
        // top-k try, and must keep exactly the lowest 2500 ids (ties break by id).
        let logits = vec![0.0f32; 5000];
        let sampled = draws(params(|p| p.top_p = 0.5), &logits, 3000);
        assert!(sampled.iter().all(|&t| t < 2500), "drew beyond the nucleus");
        assert!(sampled.iter().any(|&t| t >= TOP_P_FIRST_TRY as u32));
    }

    #[test]
    fn min_p_filters_unlikely_tokens() {
        // Probabilities ∝ 1, 0.5, 0.2, 0.05: min_p 0.3 keeps tokens 0 and 1 only.
        let logits = [0.0f32, 0.5f32.ln(), 0.2f32.ln(), 0.05f32.ln()];
        let sampled = draws(params(|p| p.min_p = 0.3), &logits, 3000);
        assert!(sampled.iter().all(|&t| t == 0 || t == 1), "{sampled:?}");
        assert!(sampled.contains(&1));
        // Without min_p, token 2 shows up.
        assert!(draws(SamplingParams::default(), &logits, 3000).contains(&2));
    }

    #[test]
    fn repetition_penalty_changes_argmax() {
        let logits = [1.0f32, 3.0, 2.0, -0.5];
        let mut plain = Sampler::new(SamplingParams::greedy());
        assert_eq!(plain.sample(&logits, &[1, 3]), 1);
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy()
        });
        // Token 1: 3.0 / 2 = 1.5 < 2.0, so token 2 wins; token 3 goes to -1.0.
        assert_eq!(s.sample(&logits, &[1, 3, 1]), 2);
        // A negative logit is multiplied: token 0 at -1.0 becomes -2.0 and loses to -1.5.
        assert_eq!(s.sample(&[-1.0, -1.5], &[0]), 1);
    }

    #[test]
    fn presence_and_frequency_penalties() {
        let logits = [2.0f32, 1.0, 0.0];
        let mut presence = Sampler::new(SamplingParams {
            presence_penalty: 1.5,
            ..SamplingParams::greedy()
        });
        // Token 0 drops to 0.5 < 1.0.
        assert_eq!(presence.sample(&logits, &[0, 0, 0]), 1);
        let mut frequency = Sampler::new(SamplingParams {
            frequency_penalty: 0.4,
            ..SamplingParams::greedy()
        });
        // Two occurrences: 2.0 - 0.8 = 1.2 still wins; three: 0.8 loses.
        assert_eq!(frequency.sample(&logits, &[0, 0]), 0);
        assert_eq!(frequency.sample(&logits, &[0, 0, 0]), 1);
    }

    #[test]
    fn frequencies_match_softmax() {
        let logits = [1.0f32, 0.2, -0.5, 0.6];
        let t = 0.8f64;
        let weights: Vec<f64> = logits.iter().map(|&l| (l as f64 / t).exp()).collect();
        let z: f64 = weights.iter().sum();
        let n = 20000;
        let sampled = draws(
            params(|p| {
                p.temperature = t as f32;
                p.seed = 1234
            }),
            &logits,
            n,
        );
        for (tok, w) in weights.iter().enumerate() {
            let freq = sampled.iter().filter(|&&s| s as usize == tok).count() as f64 / n as f64;
            let expected = w / z;
            assert!(
                (freq - expected).abs() < 0.02,
                "token {tok}: frequency {freq}, softmax {expected}"
            );
        }
    }

    #[test]
    fn default_params_validate_and_bad_ones_name_the_field() {
        SamplingParams::default().validate().unwrap();
        SamplingParams::greedy().validate().unwrap();
        let cases: Vec<(&str, SamplingParams)> = vec![
            ("temperature", params(|p| p.temperature = -0.1)),
            ("temperature", params(|p| p.temperature = f32::NAN)),
            ("top_p", params(|p| p.top_p = 0.0)),
            ("top_p", params(|p| p.top_p = 1.5)),
            ("top_p", params(|p| p.top_p = f32::NAN)),
            ("min_p", params(|p| p.min_p = -0.5)),
            ("min_p", params(|p| p.min_p = f32::NAN)),
            ("repetition_penalty", params(|p| p.repetition_penalty = 0.0)),
            (
                "repetition_penalty",
                params(|p| p.repetition_penalty = -1.0),
            ),
            (
                "presence_penalty",
                params(|p| p.presence_penalty = f32::NAN),
            ),
            ("presence_penalty", params(|p| p.presence_penalty = 3.0)),
            ("frequency_penalty", params(|p| p.frequency_penalty = -2.5)),
        ];
        for (field, p) in cases {
            match p.validate() {
                Err(Error::Invalid(msg)) => assert!(msg.contains(field), "{msg}"),
                other => panic!("{field}: expected Invalid, got {other:?}"),
            }
        }
    }
}
