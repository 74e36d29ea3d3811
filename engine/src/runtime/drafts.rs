//! Draft tokens for the scheduler: prompt lookup (n-gram) and grammar fast-forward, and the
//! policy that keeps a draft source only while it pays.
//!
//! A draft is a guess of the next few tokens of a sequence. The scheduler appends it to the
//! sequence's decode row, so the main model computes the row and every drafted position in
//! one batched step; then the request's own sampler runs once per emitted token on the main
//! model's logits, in order, exactly as [`super::speculative`] verifies MTP drafts: a drafted
//! token is kept only while it is the token the sampler picked, and the first mismatch ends the
//! step with the sampler's token. Each row's logits are the bits plain decoding computes
//! (batch-invariant kernels), the sampler sees the same logits, history and constraint state,
//! and its random generator is drawn once per emitted token as without drafts — so greedy and
//! seeded outputs are identical with drafting on or off. Rejected drafts' cache rows are cut
//! back ([`crate::model::cache::KvCache::truncate`]; a recurrent state goes back to the
//! checkpoint taken before the step and the kept tokens are run again).
//!
//! Two sources:
//! * **Prompt lookup** ([`ngram_lookup`]): the longest suffix of the sequence (`ngram_max`
//!   down to `ngram_min` tokens) that occurred before; the draft is what followed its latest
//!   occurrence. It pays on text that copies its context (code edits, quoting, extraction,
//!   repetitive output). Its length adapts per request: one more than the last draft kept,
//!   doubled after a draft kept whole (up to `max_tokens`), so a copy in progress drafts long
//!   and a guess that keeps missing costs one row.
//! * **Grammar fast-forward**: when the request's constraint forces the next bytes (a JSON
//!   schema's keys and punctuation), llguidance's forced tokens are the draft. A forced byte
//!   string is not always a forced token sequence — the mask may admit another tokenization of
//!   the same bytes — so these drafts are verified like the others (a token that is the only
//!   one the mask allows is accepted whatever the logits); that keeps the sampler's choices,
//!   and so the output, exactly those of decoding without drafts.
//!
//! [`DraftMode::Auto`]'s policy, per request and per source: drafting costs every drafted row
//! its compute (and, for MoE models, the experts it routes to), and gains a decode step per
//! accepted token. The engine measures what a row costs ([`StepCost`]: a least-squares fit of
//! step time against rows over recent decode steps), so a drafted row pays when its acceptance
//! exceeds the cost of a row relative to the decode step it may save (the break-even
//! acceptance, at least [`MIN_ACCEPTANCE`]). Each source starts on; after [`EVIDENCE`] drafted
//! tokens whose recent acceptance is below break-even it is switched off for [`REPROBE_AFTER`]
//! generated tokens, then probed again.

use super::grammar::Constraint;

/// When the scheduler drafts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftMode {
    /// Never.
    #[default]
    Off,
    /// Whenever a source has a draft.
    Always,
    /// Each source while it is measured to pay (see the module comment).
    Auto,
}

/// How the scheduler drafts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftConfig {
    pub mode: DraftMode,
    /// Most tokens one draft may have.
    pub max_tokens: usize,
    /// Shortest suffix prompt lookup matches.
    pub ngram_min: usize,
    /// Longest suffix prompt lookup matches (it tries the longest first).
    pub ngram_max: usize,
}

impl Default for DraftConfig {
    fn default() -> Self {
        DraftConfig {
            mode: DraftMode::Off,
            max_tokens: 8,
            ngram_min: 2,
            ngram_max: 4,
        }
    }
}

impl DraftConfig {
    /// Drafting off.
    pub fn off() -> DraftConfig {
        DraftConfig::default()
    }

    /// Check the sizes: `Err((field, problem))`.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.max_tokens == 0 || self.max_tokens > MAX_DRAFT_TOKENS {
            return Err((
                "draft_tokens",
                format!(
                    "expected 1 to {MAX_DRAFT_TOKENS}, found {}",
                    self.max_tokens
                ),
            ));
        }
        if self.ngram_min == 0 || self.ngram_min > MAX_NGRAM {
            return Err((
                "draft_ngram_min",
                format!("expected 1 to {MAX_NGRAM}, found {}", self.ngram_min),
            ));
        }
        if self.ngram_max < self.ngram_min || self.ngram_max > MAX_NGRAM {
            return Err((
                "draft_ngram_max",
                format!(
                    "expected {} (draft_ngram_min) to {MAX_NGRAM}, found {}",
                    self.ngram_min, self.ngram_max
                ),
            ));
        }
        Ok(())
    }
}

/// The most tokens a draft may have (each is one more row of a verification step).
pub const MAX_DRAFT_TOKENS: usize = 64;
/// The longest suffix prompt lookup may match.
pub const MAX_NGRAM: usize = 16;
/// The least acceptance a source keeps drafting at, whatever a row is measured to cost.
pub const MIN_ACCEPTANCE: f64 = 0.1;
/// Drafted tokens (recent, decayed) a source's acceptance is judged on.
pub const EVIDENCE: f64 = 8.0;
/// Generated tokens a source stays off for before it is probed again.
pub const REPROBE_AFTER: usize = 64;
/// Weight each earlier draft keeps in a source's recent acceptance, per new draft.
const DECAY: f64 = 0.8;

/// Where a draft came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftSource {
    /// Prompt lookup.
    Ngram = 0,
    /// The constraint's forced tokens.
    Grammar = 1,
}

impl DraftSource {
    /// Every source, in index order.
    pub const ALL: [DraftSource; 2] = [DraftSource::Ngram, DraftSource::Grammar];

    /// Its name in metrics and reports.
    pub fn name(self) -> &'static str {
        match self {
            DraftSource::Ngram => "ngram",
            DraftSource::Grammar => "grammar",
        }
    }
}

/// The draft prompt lookup makes from `history` (the prompt and the tokens generated so far):
/// for `n` from `max` down to `min`, the latest earlier occurrence of the last `n` tokens, and
/// up to `limit` tokens that followed it. The continuation is read from the history extended
/// by the draft itself, so a repeating period continues past the end of the history. Empty
/// when no suffix of those lengths occurred before.
pub fn ngram_lookup(history: &[u32], min: usize, max: usize, limit: usize) -> Vec<u32> {
    let len = history.len();
    if limit == 0 || min == 0 {
        return Vec::new();
    }
    for n in (min..=max.min(len.saturating_sub(1))).rev() {
        let suffix = &history[len - n..];
        // Latest start i < len - n with history[i..i + n] == suffix.
        let Some(start) = (0..len - n).rev().find(|&i| history[i..i + n] == *suffix) else {
            continue;
        };
        let mut draft: Vec<u32> = Vec::with_capacity(limit);
        for j in 0..limit {
            let at = start + n + j;
            let t = if at < len {
                history[at]
            } else {
                draft[at - len]
            };
            draft.push(t);
        }
        return draft;
    }
    Vec::new()
}

/// A source's recent record within one request.
#[derive(Debug, Clone, Default)]
struct SourceRecord {
    /// Drafted and accepted tokens, each earlier draft's weight decayed by [`DECAY`].
    recent_drafted: f64,
    recent_accepted: f64,
    /// Off until this many tokens have been generated.
    off_until: usize,
    /// The most tokens its next prompt-lookup draft may have (0: the configured most): one
    /// more than the last draft kept, doubled after a draft kept whole — a copy in progress
    /// drafts long, a guess that keeps missing costs one row.
    length: usize,
}

impl SourceRecord {
    /// Whether enough recent drafts were judged and too few of their tokens accepted.
    fn below(&self, break_even: f64) -> bool {
        self.recent_drafted >= EVIDENCE
            && self.recent_accepted < break_even.max(MIN_ACCEPTANCE) * self.recent_drafted
    }
}

/// A request's drafting state: per source, its totals and its recent acceptance.
#[derive(Debug, Clone, Default)]
pub struct RequestDrafts {
    records: [SourceRecord; 2],
    /// Tokens drafted and accepted in this request, per source ([`DraftSource`] index).
    pub drafted: [u64; 2],
    pub accepted: [u64; 2],
}

impl RequestDrafts {
    /// The draft for the sequence's next step (`history`: prompt and generated tokens;
    /// `generated`: how many; `limit`: the most tokens it may have; `break_even`: the
    /// acceptance a drafted row must reach to pay, for [`DraftMode::Auto`]). The constraint's
    /// forced tokens first, else prompt lookup (cut where the constraint would refuse it).
    pub fn propose(
        &mut self,
        config: &DraftConfig,
        history: &[u32],
        generated: usize,
        limit: usize,
        break_even: f64,
        mut constraint: Option<&mut Constraint>,
    ) -> Option<(DraftSource, Vec<u32>)> {
        let limit = limit.min(config.max_tokens);
        if config.mode == DraftMode::Off || limit == 0 {
            return None;
        }
        let on = |r: &SourceRecord| match config.mode {
            DraftMode::Off => false,
            DraftMode::Always => true,
            DraftMode::Auto => generated >= r.off_until && !r.below(break_even),
        };
        if let Some(c) = constraint.as_deref_mut() {
            if on(&self.records[DraftSource::Grammar as usize]) {
                let mut forced = c.forced_tokens();
                forced.truncate(limit);
                if !forced.is_empty() {
                    return Some((DraftSource::Grammar, forced));
                }
            }
        }
        let record = &self.records[DraftSource::Ngram as usize];
        if !on(record) {
            return None;
        }
        let length = match record.length {
            0 => limit,
            n => n.min(limit),
        };
        let mut draft = ngram_lookup(history, config.ngram_min, config.ngram_max, length);
        if let Some(c) = constraint {
            let valid = c.valid_prefix(&draft);
            draft.truncate(valid);
        }
        (!draft.is_empty()).then_some((DraftSource::Ngram, draft))
    }

    /// Record a verified draft: `drafted` tokens from `source`, `accepted` of them kept, after
    /// `generated` tokens. In [`DraftMode::Auto`] a source whose recent acceptance is below
    /// `break_even` (and [`MIN_ACCEPTANCE`]) goes off for [`REPROBE_AFTER`] tokens.
    pub fn record(
        &mut self,
        mode: DraftMode,
        source: DraftSource,
        drafted: usize,
        accepted: usize,
        generated: usize,
        break_even: f64,
    ) {
        let i = source as usize;
        self.drafted[i] += drafted as u64;
        self.accepted[i] += accepted as u64;
        let r = &mut self.records[i];
        r.recent_drafted = r.recent_drafted * DECAY + drafted as f64;
        r.recent_accepted = r.recent_accepted * DECAY + accepted as f64;
        r.length = if accepted >= drafted {
            (2 * drafted).min(MAX_DRAFT_TOKENS)
        } else {
            accepted + 1
        };
        if mode == DraftMode::Auto && r.below(break_even) {
            // Off for a while; judged afresh when probed again.
            *r = SourceRecord {
                off_until: generated + REPROBE_AFTER,
                length: 1,
                ..SourceRecord::default()
            };
        }
    }

    /// Whether `source` is currently switched off (by [`DraftMode::Auto`]).
    pub fn is_off(&self, source: DraftSource, generated: usize) -> bool {
        generated < self.records[source as usize].off_until
    }
}

/// What a step and each of its rows cost, measured: step seconds fitted as `a + b · rows` by
/// exponentially weighted least squares over the recent steps it is shown. The scheduler keeps
/// two: one over decode steps alone (what a drafted row costs; prefill chunks' rows cost
/// differently) and one over every step (how to spread waiting prompts over steps,
/// [`StepCost::prompt_budget`]).
#[derive(Debug, Clone, Default)]
pub struct StepCost {
    w: f64,
    sr: f64,
    st: f64,
    srr: f64,
    srt: f64,
    steps: u64,
}

/// Weight a step keeps per later step in [`StepCost`]'s fit.
const COST_DECAY: f64 = 0.98;
/// Decode steps observed before [`StepCost`] gives an estimate.
const COST_MIN_STEPS: u64 = 8;

impl StepCost {
    /// Add one decode step of `rows` rows that took `seconds`.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        let r = rows as f64;
        self.w = self.w * COST_DECAY + 1.0;
        self.sr = self.sr * COST_DECAY + r;
        self.st = self.st * COST_DECAY + seconds;
        self.srr = self.srr * COST_DECAY + r * r;
        self.srt = self.srt * COST_DECAY + r * seconds;
        self.steps += 1;
    }

    /// `(a, b)`: the fitted seconds of a step with no rows and of each row; `None` until
    /// enough steps of different sizes were seen.
    pub fn fit(&self) -> Option<(f64, f64)> {
        if self.steps < COST_MIN_STEPS || self.w <= 0.0 {
            return None;
        }
        let mr = self.sr / self.w;
        let mt = self.st / self.w;
        let var = self.srr / self.w - mr * mr;
        if var < 1e-3 {
            return None;
        }
        let b = ((self.srt / self.w - mr * mt) / var).max(0.0);
        let a = (mt - b * mr).max(0.0);
        Some((a, b))
    }

    /// Prompt tokens to prefill in the next step when `waiting` prompt tokens wait and
    /// `decode_rows` decode rows run in every step: `sqrt(waiting · (a / b + decode_rows))`,
    /// at least 1; `None` until measured or when a row is free (then all of them).
    ///
    /// Why: `k` waiting prompts of `p` tokens prefilled `m` at a time finish after `k / m`
    /// steps of `a' + m·p·b` each (`a'` the step's cost without them: its fixed cost and its
    /// decode rows); their mean time to first token, `(k/m + 1)(a' + m·p·b) / 2`, is least at
    /// `m·p = sqrt(k·p · a'/b)`. All at once is best only where a step's fixed cost dwarfs
    /// their rows; one at a time where rows cost everything.
    pub fn prompt_budget(&self, waiting: usize, decode_rows: usize) -> Option<usize> {
        let (a, b) = self.fit()?;
        if b <= 0.0 {
            return None;
        }
        let budget = (waiting as f64 * (a / b + decode_rows as f64))
            .sqrt()
            .ceil();
        Some((budget as usize).max(1))
    }

    /// The acceptance at which a drafted row pays in a step of `sequences` decode rows: the
    /// cost of one more row over the cost per token of a step without drafts,
    /// `b / ((a + b·s) / s)`; `None` until measured.
    pub fn break_even(&self, sequences: usize) -> Option<f64> {
        let (a, b) = self.fit()?;
        let s = sequences.max(1) as f64;
        let per_token = (a + b * s) / s;
        (per_token > 0.0).then(|| (b / per_token).min(1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_takes_the_longest_latest_match_and_continues_a_period() {
        // "1 2 3 4 9 | 1 2 3 4 5 6 | 1 2 3": the 3-gram [1 2 3] last occurred before 4 5 6.
        let h = [1, 2, 3, 4, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3];
        assert_eq!(ngram_lookup(&h, 1, 3, 3), vec![4, 5, 6]);
        // The 4-gram [6 1 2 3] never occurred before; with min 4 there is no draft.
        assert!(ngram_lookup(&h, 4, 4, 3).is_empty());
        // A period of 2 continues past the end of the history.
        assert_eq!(ngram_lookup(&[7, 8, 7, 8], 2, 2, 5), vec![7, 8, 7, 8, 7]);
        // Nothing to match in a history with no repeat.
        assert!(ngram_lookup(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(ngram_lookup(&[], 1, 3, 4).is_empty());
        assert!(ngram_lookup(&[5], 1, 3, 4).is_empty());
        // The longest match wins over a later shorter one: [2 3] last occurred before 9,
        // [1 2 3] before 4.
        let h = [1, 2, 3, 4, 0, 2, 3, 9, 1, 2, 3];
        assert_eq!(ngram_lookup(&h, 2, 3, 1), vec![4]);
        assert_eq!(ngram_lookup(&h, 2, 2, 1), vec![9]);
    }

    #[test]
    fn auto_turns_a_source_off_below_break_even_and_probes_it_again() {
        let config = DraftConfig {
            mode: DraftMode::Auto,
            ..DraftConfig::default()
        };
        let history = [1, 2, 3, 1, 2, 3, 1, 2];
        let mut d = RequestDrafts::default();
        let mut generated = 0;
        // Rejected drafts: off after enough evidence.
        let mut drafts = 0;
        while d
            .propose(&config, &history, generated, 8, 0.3, None)
            .is_some()
        {
            d.record(DraftMode::Auto, DraftSource::Ngram, 4, 0, generated, 0.3);
            generated += 1;
            drafts += 1;
            assert!(drafts < 10, "never turned off");
        }
        assert!(d.is_off(DraftSource::Ngram, generated));
        assert_eq!(d.drafted[0], 4 * drafts as u64);
        // Back on after REPROBE_AFTER tokens.
        assert!(d
            .propose(&config, &history, generated + REPROBE_AFTER, 8, 0.3, None)
            .is_some());
        // A source accepted above break-even stays on; `Always` never turns off.
        let mut good = RequestDrafts::default();
        let mut always = RequestDrafts::default();
        for g in 0..100 {
            good.record(DraftMode::Auto, DraftSource::Ngram, 4, 2, g, 0.3);
            always.record(DraftMode::Always, DraftSource::Ngram, 4, 0, g, 0.3);
        }
        assert!(!good.is_off(DraftSource::Ngram, 100));
        assert!(!always.is_off(DraftSource::Ngram, 100));
        // Off proposes nothing.
        let off = DraftConfig::default();
        assert!(RequestDrafts::default()
            .propose(&off, &history, 0, 8, 0.0, None)
            .is_none());
    }

    #[test]
    fn prompt_lookup_drafts_grow_while_kept_and_shrink_after_a_miss() {
        let config = DraftConfig {
            mode: DraftMode::Always,
            max_tokens: 8,
            ..DraftConfig::default()
        };
        let history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2];
        let len = |d: &mut RequestDrafts| {
            d.propose(&config, &history, 0, 16, 0.0, None)
                .map(|(s, t)| (s, t.len()))
        };
        let mut d = RequestDrafts::default();
        assert_eq!(len(&mut d), Some((DraftSource::Ngram, 8)));
        d.record(DraftMode::Always, DraftSource::Ngram, 8, 2, 0, 0.0);
        assert_eq!(len(&mut d), Some((DraftSource::Ngram, 3)));
        d.record(DraftMode::Always, DraftSource::Ngram, 3, 0, 0, 0.0);
        assert_eq!(len(&mut d), Some((DraftSource::Ngram, 1)));
        d.record(DraftMode::Always, DraftSource::Ngram, 1, 1, 0, 0.0);
        assert_eq!(len(&mut d), Some((DraftSource::Ngram, 2)));
        d.record(DraftMode::Always, DraftSource::Ngram, 2, 2, 0, 0.0);
        assert_eq!(len(&mut d), Some((DraftSource::Ngram, 4)));
        d.record(DraftMode::Always, DraftSource::Ngram, 4, 4, 0, 0.0);
        d.record(DraftMode::Always, DraftSource::Ngram, 8, 8, 0, 0.0);
        // Never past the configured most, nor the room left.
        assert_eq!(len(&mut d), Some((DraftSource::Ngram, 8)));
        assert_eq!(
            d.propose(&config, &history, 0, 5, 0.0, None)
                .map(|(_, t)| t.len()),
            Some(5)
        );
    }

    #[test]
    fn step_cost_fits_rows_and_gives_the_break_even() {
        let mut c = StepCost::default();
        assert_eq!(c.break_even(1), None);
        // 10 ms a step plus 2 ms a row.
        for i in 0..40 {
            let rows = 1 + (i % 5);
            c.observe(rows, 0.010 + 0.002 * rows as f64);
        }
        let (a, b) = c.fit().unwrap();
        assert!(
            (a - 0.010).abs() < 1e-9 && (b - 0.002).abs() < 1e-9,
            "{a} {b}"
        );
        // One sequence: a row costs 2 of a 12 ms token.
        assert!((c.break_even(1).unwrap() - 2.0 / 12.0).abs() < 1e-9);
        // Four sequences share the fixed cost: a row is dearer relative to a token.
        assert!((c.break_even(4).unwrap() - 0.002 / (0.018 / 4.0)).abs() < 1e-9);
        // Prompt budget: 10 ms a step is 5 rows' worth; 80 waiting tokens, 3 decode rows:
        // sqrt(80 * (5 + 3)) = 25.3, rounded up.
        assert_eq!(c.prompt_budget(80, 3), Some(26));
        // Nothing waiting still allows a row; rows that cost nothing allow everything.
        assert_eq!(c.prompt_budget(0, 0), Some(1));
        let mut free = StepCost::default();
        for i in 0..40 {
            free.observe(1 + i % 5, 0.010);
        }
        assert_eq!(free.prompt_budget(80, 3), None);
        // Steps all of one size say nothing about a row's cost.
        let mut flat = StepCost::default();
        for _ in 0..40 {
            flat.observe(1, 0.01);
        }
        assert_eq!(flat.break_even(1), None);
    }

    #[test]
    fn sizes_are_checked() {
        assert!(DraftConfig::default().validate().is_ok());
        let bad = |f: fn(&mut DraftConfig)| {
            let mut c = DraftConfig::default();
            f(&mut c);
            c.validate().unwrap_err().0
        };
        assert_eq!(bad(|c| c.max_tokens = 0), "draft_tokens");
        assert_eq!(bad(|c| c.max_tokens = 65), "draft_tokens");
        assert_eq!(bad(|c| c.ngram_min = 0), "draft_ngram_min");
        assert_eq!(bad(|c| c.ngram_max = 1), "draft_ngram_max");
        assert_eq!(bad(|c| c.ngram_max = 17), "draft_ngram_max");
    }
}
