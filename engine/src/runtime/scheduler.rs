//! KV-slot scheduling with continuous batching.
//!
//! The scheduler owns `slots` sequence slots, each with its own KV cache, and one engine
//! thread. Requests wait in a bounded queue; a free slot takes the waiting request whose
//! prompt it shares the longest prefix with (so a multi-turn chat reuses its KV and prefills
//! only the new tokens). Every engine step runs all active slots as one batch through
//! [`CausalLm::forward_batch`]: decode rows and prefill chunks together, so an expert routed
//! by several sequences is read and applied once. Long prompts are prefilled in chunks
//! interleaved with the other slots' decode steps.
//!
//! Batching never changes output: every row goes through batch-invariant kernels, and every
//! request samples with its own seeded [`Sampler`], so a request gets exactly the tokens it
//! would get alone.
//!
//! With drafting on ([`SchedulerConfig::drafts`]), a decoding slot's row carries a draft of the
//! next tokens (prompt lookup or the grammar's forced tokens, [`super::drafts`]); the step
//! computes them with everything else, and the request's sampler verifies them in order, so
//! the tokens are the same as without drafts.
//!
//! Results leave through an [`EventSink`] per request; a sink that reports the client gone
//! cancels its sequence at the next step and frees the slot.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::drafts::{DraftConfig, DraftSource, RequestDrafts, StepCost};
use super::generate::{FinishReason, StopText};
use super::grammar::Constraint;
use super::loaded::LoadedModel;
use super::sampling::{Sampler, SamplingParams};
use crate::model::cache::{DraftCheckpoint, KvCache};
use crate::model::{BatchItem, Logits};

/// How the scheduler is sized.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Sequence slots (concurrent requests).
    pub slots: usize,
    /// Tokens each slot's cache holds (prompt plus generated).
    pub context: usize,
    /// Most prompt tokens one slot prefills in one step.
    pub prefill_chunk: usize,
    /// Most prompt tokens all slots together prefill in one step; `None`: as many as keep the
    /// waiting prompts' mean time to first token least by the measured cost of a step and of
    /// a row ([`StepCost::prompt_budget`]), and at least the oldest waiting prompt's chunk.
    /// Waiting prompts are served oldest first.
    pub prefill_budget: Option<usize>,
    /// Most requests waiting for a slot; beyond it [`Scheduler::submit`] refuses.
    pub queue_limit: usize,
    /// Longest a request waits for a slot before it is refused.
    pub queue_timeout: Duration,
    /// Keep the slots' conversations (tokens and KV cache) across restarts: saved as KV files
    /// in this directory when the engine stops, reopened when it starts, so a returning
    /// conversation reuses its prefix after a restart. `None`: slots start empty.
    pub persist_dir: Option<std::path::PathBuf>,
    /// Longest the engine runs without asking the expert store to save what it learned (the
    /// usage history, written in the background: see [`CausalLm::flush_soon`]); it also asks
    /// whenever it goes idle, at the end of each batch of requests. So a process killed while
    /// serving loses at most this much of its history.
    ///
    /// [`CausalLm::flush_soon`]: crate::model::CausalLm::flush_soon
    pub history_save_interval: Duration,
    /// Whether and how decode rows carry drafts (prompt lookup, grammar fast-forward).
    pub drafts: DraftConfig,
}

/// The log-probability of a token, with the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// `(id, logprob)` of the most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What a request hears back, in order: `Admitted`, then `Token`s, then `Done` (or `Failed`).
#[derive(Debug, Clone)]
pub enum Event {
    /// A slot took the request; `cached_tokens` of its prompt were already in the slot's cache.
    Admitted { slot: usize, cached_tokens: usize },
    /// One generated token and the text it completed (possibly empty: text is held back
    /// while it may still become a stop string or an incomplete character).
    Token {
        id: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// Generation ended normally.
    Done(Usage),
    /// Generation could not run; nothing more follows.
    Failed(Failure),
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq)]
pub enum Failure {
    /// It waited longer than the queue timeout for a slot.
    QueueTimeout,
    /// The scheduler is shutting down.
    ShuttingDown,
    /// The request itself is wrong (the message says how).
    Invalid(String),
    /// The model's files could not be read while running it (an I/O error, a short read or a
    /// file cut short, after the store's retry and any mirror): the fault is the storage's,
    /// not the request's, and may pass; the message names the file and offset.
    Storage(String),
    /// The engine failed while running it.
    Engine(String),
}

impl Failure {
    /// The failure of the requests running in a step that returned `e`: a read error of the
    /// model's files is [`Failure::Storage`], anything else [`Failure::Engine`].
    pub fn of_step(e: &crate::Error) -> Failure {
        match e {
            crate::Error::Io { .. } | crate::Error::Corrupt { .. } => {
                Failure::Storage(e.to_string())
            }
            _ => Failure::Engine(e.to_string()),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::QueueTimeout => write!(f, "timed out waiting for a free slot"),
            Failure::ShuttingDown => write!(f, "the server is shutting down"),
            Failure::Invalid(m) => write!(f, "{m}"),
            Failure::Storage(m) => write!(f, "reading the model failed: {m}"),
            Failure::Engine(m) => write!(f, "engine error: {m}"),
        }
    }
}

/// Token counts and timings of a finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Usage {
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused from the slot's previous sequence.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// The stop string the output was cut at, when one ended it.
    pub stop_string: Option<String>,
    /// Time from admission to the first generated token.
    pub prefill_seconds: f64,
    /// Time from the first to the last generated token.
    pub decode_seconds: f64,
}

/// Where a request's events go. `send` returns false once the client is gone; the sequence is
/// then cancelled. `is_closed` lets the scheduler notice a departed client between tokens
/// (e.g. during a long prefill).
pub trait EventSink: Send {
    fn send(&self, event: Event) -> bool;
    fn is_closed(&self) -> bool;
}

impl EventSink for mpsc::Sender<Event> {
    fn send(&self, event: Event) -> bool {
        mpsc::Sender::send(self, event).is_ok()
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// One generation request.
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Ids that end generation (not emitted).
    pub eos_token_ids: Vec<u32>,
    /// Strings that end generation (cut from the text).
    pub stop_strings: Vec<String>,
    pub sampling: SamplingParams,
    /// Report each token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Constrain the output (JSON schema, grammar, a required tool call).
    pub constraint: Option<Constraint>,
    pub sink: Box<dyn EventSink>,
}

/// Why [`Scheduler::submit`] refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// The waiting queue is full.
    QueueFull { limit: usize },
    /// The scheduler no longer admits requests.
    ShuttingDown,
}

/// Live counters, shared with whoever reports them (e.g. `/metrics`).
#[derive(Debug, Default)]
pub struct SchedulerStats {
    /// Requests waiting for a slot.
    pub queued: AtomicUsize,
    /// Slots running a request.
    pub active: AtomicUsize,
    /// Engine steps run.
    pub steps: AtomicU64,
    /// Rows (tokens) run through the model.
    pub rows: AtomicU64,
    /// Prompt tokens reused from slot caches.
    pub cached_prompt_tokens: AtomicU64,
    /// Draft tokens verified, and those accepted, per source ([`DraftSource`] index).
    pub draft_tokens: [AtomicU64; 2],
    pub draft_accepted: [AtomicU64; 2],
    /// Decode steps of a sequence that carried a draft.
    pub draft_steps: AtomicU64,
    /// The measured acceptance at which a drafted row pays for one decoding sequence
    /// ([`StepCost::break_even`]); `None` until measured.
    pub draft_break_even: Mutex<Option<f64>>,
    /// The fitted cost of a step over every step, `(a, b)`: its seconds with no rows and per
    /// row ([`StepCost::fit`]); `None` until measured.
    pub step_cost: Mutex<Option<(f64, f64)>>,
    /// Prompt tokens the last step with prompts waiting could prefill: the configured
    /// [`SchedulerConfig::prefill_budget`] or the measured one ([`StepCost::prompt_budget`]);
    /// `None` before any prompt waited and while no budget applies (not yet measured, or a
    /// row measured free).
    pub prompt_budget: Mutex<Option<usize>>,
}

impl SchedulerStats {
    /// `(drafted, accepted)` tokens of `source` so far.
    pub fn drafts(&self, source: DraftSource) -> (u64, u64) {
        let i = source as usize;
        (
            self.draft_tokens[i].load(Ordering::Relaxed),
            self.draft_accepted[i].load(Ordering::Relaxed),
        )
    }
}

/// A running scheduler: submit requests, read its counters, shut it down.
pub struct Scheduler {
    inbox: Mutex<Option<mpsc::Sender<Message>>>,
    stats: Arc<SchedulerStats>,
    config: SchedulerConfig,
    thread: Mutex<Option<JoinHandle<()>>>,
    accepting: AtomicBool,
}

enum Message {
    Submit(Box<Request>, Instant),
    /// Fail everything queued or running with [`Failure::ShuttingDown`].
    CancelAll,
}

impl Scheduler {
    /// Start the engine thread over `model`.
    pub fn start(model: Arc<LoadedModel>, config: SchedulerConfig) -> Scheduler {
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(SchedulerStats::default());
        let engine = Engine::new(model, config.clone(), stats.clone());
        let thread = std::thread::Builder::new()
            .name("coli-engine".into())
            .spawn(move || engine.run(rx))
            .expect("spawning the engine thread");
        Scheduler {
            inbox: Mutex::new(Some(tx)),
            stats,
            config,
            thread: Mutex::new(Some(thread)),
            accepting: AtomicBool::new(true),
        }
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Live counters.
    pub fn stats(&self) -> &Arc<SchedulerStats> {
        &self.stats
    }

    /// Queue a request. Its events arrive through its sink.
    pub fn submit(&self, request: Request) -> Result<(), SubmitError> {
        if !self.accepting.load(Ordering::SeqCst) {
            return Err(SubmitError::ShuttingDown);
        }
        let limit = self.config.queue_limit;
        // Reserve a queue place; the engine thread releases it on admission.
        let reserved = self
            .stats
            .queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| {
                (q < limit).then_some(q + 1)
            });
        if reserved.is_err() {
            return Err(SubmitError::QueueFull { limit });
        }
        let inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        let sent = inbox.as_ref().map(|tx| {
            tx.send(Message::Submit(Box::new(request), Instant::now()))
                .is_ok()
        });
        if sent != Some(true) {
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            return Err(SubmitError::ShuttingDown);
        }
        Ok(())
    }

    /// Stop admitting new requests (running and queued ones go on).
    pub fn stop_accepting(&self) {
        self.accepting.store(false, Ordering::SeqCst);
    }

    /// Requests queued or running.
    pub fn in_flight(&self) -> usize {
        self.stats.queued.load(Ordering::SeqCst) + self.stats.active.load(Ordering::SeqCst)
    }

    /// Fail every queued and running request with [`Failure::ShuttingDown`].
    pub fn cancel_all(&self) {
        let inbox = self.inbox.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = inbox.as_ref() {
            let _ = tx.send(Message::CancelAll);
        }
    }

    /// Stop the engine thread after it has failed whatever is left, and wait for it.
    pub fn shutdown(&self) {
        self.stop_accepting();
        self.cancel_all();
        self.inbox.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A request in a slot.
struct Running {
    request: Box<Request>,
    sampler: Sampler,
    /// Prompt tokens not yet run.
    pending: usize,
    /// Prompt plus generated tokens (what the penalties look at).
    history: Vec<u32>,
    generated: usize,
    text: StopText,
    /// The token to run next in decode.
    next: Option<u32>,
    cached_tokens: usize,
    admitted: Instant,
    first_token: Option<Instant>,
    /// Its drafting record.
    drafts: RequestDrafts,
}

/// One KV slot: its cache and the tokens the cache holds.
struct Slot {
    cache: KvCache,
    tokens: Vec<u32>,
    running: Option<Running>,
    last_used: u64,
}

/// The engine thread's state.
struct Engine {
    model: Arc<LoadedModel>,
    config: SchedulerConfig,
    stats: Arc<SchedulerStats>,
    slots: Vec<Slot>,
    queue: VecDeque<(Box<Request>, Instant)>,
    clock: u64,
    /// When the expert store was last asked to save what it learned.
    last_save: Instant,
    /// Whether steps ran since then.
    unsaved: bool,
    /// What a decode row costs, measured on the steps run.
    cost: StepCost,
    /// What a step and its rows cost, measured on every step run (prefill chunks too).
    step_time: StepCost,
}

/// A slot's part of a step.
struct Planned {
    slot: usize,
    tokens: Vec<u32>,
    logits: Logits,
    /// A prompt chunk (else a decode row: tokens the cache lacks, then any draft).
    prefill: bool,
    /// The draft at the end of `tokens`: its source, its length, and the cache's checkpoint
    /// for it.
    draft: Option<(DraftSource, usize, DraftCheckpoint)>,
}

impl Engine {
    fn new(model: Arc<LoadedModel>, config: SchedulerConfig, stats: Arc<SchedulerStats>) -> Engine {
        let mut slots: Vec<Slot> = (0..config.slots.max(1))
            .map(|_| Slot {
                cache: model.model.new_cache(config.context),
                tokens: Vec::new(),
                running: None,
                last_used: 0,
            })
            .collect();
        if let Some(dir) = &config.persist_dir {
            restore_slots(&model, dir, config.context, &mut slots);
        }
        Engine {
            model,
            config,
            stats,
            slots,
            queue: VecDeque::new(),
            clock: 0,
            last_save: Instant::now(),
            unsaved: false,
            cost: StepCost::default(),
            step_time: StepCost::default(),
        }
    }

    /// Ask the expert store to save what it learned, in the background (see
    /// [`SchedulerConfig::history_save_interval`]).
    fn save_learning(&mut self) {
        self.model.model.flush_soon();
        self.last_save = Instant::now();
        self.unsaved = false;
    }

    fn run(mut self, rx: mpsc::Receiver<Message>) {
        self.run_loop(rx);
        if let Some(dir) = self.config.persist_dir.clone() {
            save_slots(&self.model, &dir, &self.slots);
        }
    }

    fn run_loop(&mut self, rx: mpsc::Receiver<Message>) {
        loop {
            // Take in messages: block only when there is nothing to do.
            let idle = self.slots.iter().all(|s| s.running.is_none()) && self.queue.is_empty();
            if idle && self.unsaved {
                // The end of a batch of requests.
                self.save_learning();
            }
            let first = if idle {
                match rx.recv() {
                    Ok(m) => Some(m),
                    Err(_) => return,
                }
            } else if self.slots.iter().all(|s| s.running.is_none()) {
                // Only waiting requests: wake up in time to expire the oldest.
                match rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(m) => Some(m),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        self.fail_all(Failure::ShuttingDown);
                        return;
                    }
                }
            } else {
                None
            };
            let mut disconnected = false;
            let mut messages: Vec<Message> = first.into_iter().collect();
            loop {
                match rx.try_recv() {
                    Ok(m) => messages.push(m),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        disconnected = true;
                        break;
                    }
                }
            }
            for m in messages {
                match m {
                    Message::Submit(r, at) => self.queue.push_back((r, at)),
                    Message::CancelAll => self.fail_all(Failure::ShuttingDown),
                }
            }
            if disconnected {
                self.fail_all(Failure::ShuttingDown);
                return;
            }
            self.expire_queue();
            self.admit();
            if self.slots.iter().any(|s| s.running.is_some()) {
                let result = std::panic::catch_unwind(AssertUnwindSafe(|| self.step()));
                let failure = match result {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(Failure::of_step(&e)),
                    Err(panic) => Some(Failure::Engine(panic_message(&panic))),
                };
                if let Some(f) = failure {
                    tracing::error!("engine step failed: {f}");
                    self.fail_running(f);
                }
                self.unsaved = true;
                if self.last_save.elapsed() >= self.config.history_save_interval {
                    self.save_learning();
                }
            }
        }
    }

    /// Refuse queued requests that waited too long or whose client left.
    fn expire_queue(&mut self) {
        let timeout = self.config.queue_timeout;
        let mut kept = VecDeque::with_capacity(self.queue.len());
        while let Some((r, at)) = self.queue.pop_front() {
            if r.sink.is_closed() {
                self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            } else if at.elapsed() > timeout {
                self.stats.queued.fetch_sub(1, Ordering::SeqCst);
                r.sink.send(Event::Failed(Failure::QueueTimeout));
            } else {
                kept.push_back((r, at));
            }
        }
        self.queue = kept;
    }

    /// Put waiting requests into free slots, in arrival order; each takes the free slot whose
    /// cache shares the longest prefix with its prompt (else the least recently used one).
    fn admit(&mut self) {
        while let Some((request, queued_at)) = self.queue.pop_front() {
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            if let Err(why) = self.check(&request) {
                request.sink.send(Event::Failed(Failure::Invalid(why)));
                continue;
            }
            let best = self
                .slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.running.is_none())
                .map(|(i, s)| (i, common_prefix(&s.tokens, &request.prompt), s.last_used))
                .max_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)));
            let Some((slot_index, common, _)) = best else {
                // No free slot: back to the head of the queue, keeping its arrival time (the
                // queue timeout counts from there).
                self.stats.queued.fetch_add(1, Ordering::SeqCst);
                self.queue.push_front((request, queued_at));
                return;
            };
            // Keep at least one prompt token to run, so the prompt's last logits exist.
            let slot = &mut self.slots[slot_index];
            // A recurrent state goes back to its newest checkpoint at or before that.
            let reuse = slot.cache.truncate(common.min(request.prompt.len() - 1));
            slot.tokens.truncate(reuse);
            self.clock += 1;
            slot.last_used = self.clock;
            if !request.sink.send(Event::Admitted {
                slot: slot_index,
                cached_tokens: reuse,
            }) {
                continue;
            }
            self.stats
                .cached_prompt_tokens
                .fetch_add(reuse as u64, Ordering::Relaxed);
            self.stats.active.fetch_add(1, Ordering::SeqCst);
            let sampler = Sampler::new(request.sampling);
            let pending = request.prompt.len() - reuse;
            let history = request.prompt.clone();
            let text = StopText::new(request.stop_strings.clone());
            slot.running = Some(Running {
                request,
                sampler,
                pending,
                history,
                generated: 0,
                text,
                next: None,
                cached_tokens: reuse,
                admitted: Instant::now(),
                first_token: None,
                drafts: RequestDrafts::default(),
            });
        }
    }

    /// Whether a request can run at all.
    fn check(&self, r: &Request) -> Result<(), String> {
        if r.prompt.is_empty() {
            return Err("the prompt is empty: nothing to continue from".into());
        }
        if r.prompt.len() >= self.config.context {
            return Err(format!(
                "the prompt has {} tokens but the context is {} tokens (at least one must be left to generate)",
                r.prompt.len(),
                self.config.context
            ));
        }
        if r.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        r.sampling.validate().map_err(|e| e.to_string())?;
        if !r.stop_strings.is_empty() && self.model.tokenizer.is_none() {
            return Err("stop strings need a tokenizer".into());
        }
        Ok(())
    }

    /// One engine step over every active slot.
    fn step(&mut self) -> crate::Result<()> {
        // Drop sequences whose client left.
        for slot in &mut self.slots {
            if slot
                .running
                .as_ref()
                .is_some_and(|r| r.request.sink.is_closed())
            {
                slot.running = None;
                self.stats.active.fetch_sub(1, Ordering::SeqCst);
            }
        }
        // The whole step counts in what a row costs: drafting, the forward pass, sampling.
        let started = Instant::now();
        let chunk = self.config.prefill_chunk.max(1);
        let context = self.config.context;
        let decoding = self
            .slots
            .iter()
            .filter(|s| s.running.as_ref().is_some_and(|r| r.pending == 0))
            .count();
        let break_even = self.cost.break_even(decoding);
        let prompt_rows = self.prompt_rows(chunk, decoding);
        let drafts = &self.config.drafts;
        // Tokens each active slot runs this step, and which logits it needs.
        let mut plan: Vec<Planned> = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(run) = &mut slot.running else {
                continue;
            };
            if run.pending > 0 {
                let n = prompt_rows[i];
                if n == 0 {
                    // Waits for a later step (the step's prompt budget is spent).
                    continue;
                }
                let start = run.request.prompt.len() - run.pending;
                let tokens = run.request.prompt[start..start + n].to_vec();
                let logits = if n == run.pending {
                    Logits::Last
                } else {
                    Logits::None
                };
                plan.push(Planned {
                    slot: i,
                    tokens,
                    logits,
                    prefill: true,
                    draft: None,
                });
            } else if run.next.is_some() {
                // The tokens the cache lacks: the last one sampled, after those a recurrent
                // state's return to its checkpoint dropped (see below).
                let mut tokens = run.history[slot.cache.len..].to_vec();
                // Room for the draft: every drafted row must fit the cache, and no more tokens
                // than the request may still emit (the row after the draft emits one more).
                let limit = context
                    .saturating_sub(run.history.len() + 1)
                    .min(run.request.max_tokens.saturating_sub(run.generated + 1));
                // A failing constraint must not take the step down: no draft then (sampling
                // reports the constraint's failure).
                let draft = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    run.drafts.propose(
                        drafts,
                        &run.history,
                        run.generated,
                        limit,
                        break_even.unwrap_or(0.0),
                        run.request.constraint.as_mut(),
                    )
                }))
                .unwrap_or(None);
                let (logits, draft) = match draft {
                    Some((source, d)) => {
                        // A recurrent state cannot drop rejected rows: keep a copy to go back to.
                        let mark = slot.cache.begin_draft();
                        tokens.extend_from_slice(&d);
                        (Logits::All, Some((source, d.len(), mark)))
                    }
                    None => (Logits::Last, None),
                };
                plan.push(Planned {
                    slot: i,
                    tokens,
                    logits,
                    prefill: false,
                    draft,
                });
            }
        }
        if plan.is_empty() {
            return Ok(());
        }
        let rows: usize = plan.iter().map(|p| p.tokens.len()).sum();
        let logits = {
            let mut caches: Vec<Option<&mut KvCache>> =
                self.slots.iter_mut().map(|s| Some(&mut s.cache)).collect();
            let mut items: Vec<BatchItem<'_>> = Vec::with_capacity(plan.len());
            for p in &plan {
                let cache = caches[p.slot].take().expect("each slot appears once");
                items.push(BatchItem {
                    tokens: &p.tokens,
                    cache,
                    logits: p.logits,
                });
            }
            self.model.model.forward_batch(&mut items)?
        };
        let decode_only = plan.iter().all(|p| !p.prefill);
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.stats.rows.fetch_add(rows as u64, Ordering::Relaxed);
        for (p, out) in plan.into_iter().zip(logits) {
            let slot = &mut self.slots[p.slot];
            let before = slot.cache.len - p.tokens.len();
            slot.tokens.extend_from_slice(&p.tokens);
            if p.prefill && p.tokens.len() > 1 {
                // The end of a prefill chunk: where a later prompt may branch off.
                slot.cache.checkpoint();
            }
            let run = slot.running.as_mut().expect("planned slots run");
            if run.pending > 0 {
                run.pending -= p.tokens.len();
            }
            if run.pending > 0 {
                continue;
            }
            // The rows to sample from: the last token the cache lacked, then each drafted one.
            let drafted = p.draft.as_ref().map_or(0, |d| d.1);
            let draft = &p.tokens[p.tokens.len() - drafted..];
            let returned = if p.logits == Logits::All {
                p.tokens.len()
            } else {
                1
            };
            let width = out.len() / returned.max(1);
            let first = returned - 1 - drafted;
            // A request's own sampling (its constraint, its text) failing, or panicking, ends
            // that request only: the step's forward pass is done and every cache is whole.
            let model = &self.model;
            let mut accepted = 0;
            let mut outcome = Outcome::Continue;
            for r in 0..=drafted {
                let row = out[(first + r) * width..(first + r + 1) * width].to_vec();
                outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    sample_next(model, context, run, row)
                }))
                .unwrap_or_else(|panic| Outcome::Failed(Failure::Engine(panic_message(&panic))));
                // The next row is worth sampling only while the sampler picked the draft.
                if !matches!(outcome, Outcome::Continue)
                    || r == drafted
                    || run.next != Some(draft[r])
                {
                    break;
                }
                accepted += 1;
            }
            if let Some((source, n, mark)) = p.draft {
                run.drafts.record(
                    drafts.mode,
                    source,
                    n,
                    accepted,
                    run.generated,
                    break_even.unwrap_or(0.0),
                );
                self.stats.draft_tokens[source as usize].fetch_add(n as u64, Ordering::Relaxed);
                self.stats.draft_accepted[source as usize]
                    .fetch_add(accepted as u64, Ordering::Relaxed);
                self.stats.draft_steps.fetch_add(1, Ordering::Relaxed);
                // The rejected drafts' rows leave the cache; a recurrent state goes back to the
                // checkpoint taken before the step, and the next step runs the kept tokens again.
                let keep = before + p.tokens.len() - drafted + accepted;
                if keep < slot.cache.len {
                    let kept = slot.cache.truncate(keep);
                    slot.tokens.truncate(kept);
                }
                slot.cache.end_draft(mark);
            }
            if !matches!(outcome, Outcome::Continue) {
                // The end of a turn: where the next one continues.
                slot.cache.checkpoint();
            }
            match outcome {
                Outcome::Continue => {}
                Outcome::Finished(usage) => {
                    let run = slot.running.take().expect("running");
                    run.request.sink.send(Event::Done(usage));
                    self.stats.active.fetch_sub(1, Ordering::SeqCst);
                }
                Outcome::Failed(why) => {
                    let run = slot.running.take().expect("running");
                    tracing::warn!("request failed in slot {}: {why}", p.slot);
                    run.request.sink.send(Event::Failed(why));
                    self.stats.active.fetch_sub(1, Ordering::SeqCst);
                }
                Outcome::Gone => {
                    slot.running = None;
                    self.stats.active.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        self.step_time.observe(rows, seconds);
        *self
            .stats
            .step_cost
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = self.step_time.fit();
        if decode_only {
            self.cost.observe(rows, seconds);
            *self
                .stats
                .draft_break_even
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = self.cost.break_even(1);
        }
        Ok(())
    }

    /// Prompt tokens each slot prefills this step (0 for slots with none waiting or none
    /// allowed): the waiting prompts oldest first within the step's prompt budget
    /// ([`SchedulerConfig::prefill_budget`], see [`spread_prompts`]).
    fn prompt_rows(&self, chunk: usize, decoding: usize) -> Vec<usize> {
        let mut waiting: Vec<(Instant, usize, usize)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let run = s.running.as_ref()?;
                (run.pending > 0).then_some((run.admitted, i, run.pending))
            })
            .collect();
        waiting.sort_unstable();
        let pending: Vec<usize> = waiting.iter().map(|w| w.2).collect();
        let total: usize = pending.iter().sum();
        let (budget, spread) = match self.config.prefill_budget {
            Some(n) => (Some(n), spread_prompts(&pending, chunk, n, false)),
            None => {
                let budget = self.step_time.prompt_budget(total, decoding);
                let spread = spread_prompts(&pending, chunk, budget.unwrap_or(usize::MAX), true);
                (budget, spread)
            }
        };
        if !pending.is_empty() {
            *self
                .stats
                .prompt_budget
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = budget;
            let taken: usize = spread.iter().sum();
            let unlimited: usize = pending.iter().map(|&p| p.min(chunk)).sum();
            if taken < unlimited {
                tracing::debug!(
                    "prompt budget {budget:?} tokens: prefilling {taken} of {total} waiting \
                     prompt tokens this step beside {decoding} decode rows (step cost fit \
                     {:?})",
                    self.step_time.fit()
                );
            }
        }
        let mut rows = vec![0; self.slots.len()];
        for (w, n) in waiting.iter().zip(spread) {
            rows[w.1] = n;
        }
        rows
    }

    fn fail_running(&mut self, why: Failure) {
        for slot in &mut self.slots {
            if let Some(run) = slot.running.take() {
                run.request.sink.send(Event::Failed(why.clone()));
                self.stats.active.fetch_sub(1, Ordering::SeqCst);
                // The cache may hold a half-written step: forget it.
                slot.cache.clear();
                slot.tokens.clear();
            }
        }
    }

    fn fail_all(&mut self, why: Failure) {
        self.fail_running(why.clone());
        while let Some((r, _)) = self.queue.pop_front() {
            self.stats.queued.fetch_sub(1, Ordering::SeqCst);
            r.sink.send(Event::Failed(why.clone()));
        }
    }
}

/// Prompt tokens each waiting prompt runs in a step, given the tokens each still has to
/// prefill (oldest first): at most `chunk` each, `budget` in all (at least 1), taken in order;
/// with `oldest_whole` the oldest takes its whole chunk whatever the budget.
fn spread_prompts(
    pending: &[usize],
    chunk: usize,
    budget: usize,
    oldest_whole: bool,
) -> Vec<usize> {
    let mut left = budget.max(1);
    pending
        .iter()
        .enumerate()
        .map(|(k, &p)| {
            let want = p.min(chunk);
            let n = if k == 0 && oldest_whole {
                want
            } else {
                want.min(left)
            };
            left = left.saturating_sub(n);
            n
        })
        .collect()
}

/// The file slot `i`'s conversation is kept in.
fn slot_file(dir: &std::path::Path, i: usize) -> std::path::PathBuf {
    dir.join(format!("slot-{i}.kv"))
}

/// Reopen the slots' conversations saved in `dir` (a missing file is an empty slot; a file
/// that cannot be used — another model, corrupt, too long for `context` — is reported and
/// left, and the slot starts empty), after removing the temporaries of slot files that a
/// process killed while saving left there.
fn restore_slots(model: &LoadedModel, dir: &std::path::Path, context: usize, slots: &mut [Slot]) {
    crate::format::write::remove_stale_temporaries(dir, |name| {
        name.strip_prefix("slot-")
            .and_then(|n| n.strip_suffix(".kv"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    let fingerprint = match super::kv_file::model_fingerprint(&model.dir) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("prefix cache: cannot fingerprint the model, slots start empty: {e}");
            return;
        }
    };
    let mut restored = 0;
    for (i, slot) in slots.iter_mut().enumerate() {
        let path = slot_file(dir, i);
        if !path.exists() {
            continue;
        }
        match super::kv_file::restore(&path, &fingerprint, model.model.as_ref()) {
            Ok(conv) if conv.cache.len <= context && conv.cache.len <= conv.tokens.len() => {
                slot.tokens = conv.tokens[..conv.cache.len].to_vec();
                slot.cache = conv.cache;
                slot.cache.max_len = context;
                restored += slot.tokens.len();
            }
            Ok(conv) => tracing::warn!(
                "prefix cache: {} holds {} tokens, more than the context of {context}; slot {i} starts empty",
                path.display(),
                conv.cache.len
            ),
            Err(e) => tracing::warn!("prefix cache: slot {i} starts empty: {e}"),
        }
    }
    if restored > 0 {
        tracing::info!(
            "prefix cache: reopened {restored} cached tokens from {}",
            dir.display()
        );
    }
}

/// Save every slot's conversation into `dir` (atomically, one KV file per slot; an empty
/// slot's file is removed).
fn save_slots(model: &LoadedModel, dir: &std::path::Path, slots: &[Slot]) {
    let fingerprint = match super::kv_file::model_fingerprint(&model.dir) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!("prefix cache: cannot fingerprint the model, not saved: {e}");
            return;
        }
    };
    if let Err(e) = std::fs::create_dir_all(dir) {
        tracing::warn!("prefix cache: cannot create {}: {e}", dir.display());
        return;
    }
    for (i, slot) in slots.iter().enumerate() {
        let path = slot_file(dir, i);
        if slot.tokens.is_empty() || slot.tokens.len() != slot.cache.len {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let conv = super::generate::Conversation {
            tokens: slot.tokens.clone(),
            cache: slot.cache.clone(),
        };
        if let Err(e) = super::kv_file::save(&path, &fingerprint, &conv) {
            tracing::warn!("prefix cache: slot {i} not saved: {e}");
        }
    }
}

/// Sample the next token of `run` from its logits row (`context`: the slot's capacity). What
/// goes wrong here is this request's alone: its constraint refusing to go on is
/// [`Failure::Invalid`] (the request's grammar or schema is at fault), its text failing to
/// decode is [`Failure::Engine`].
fn sample_next(
    model: &LoadedModel,
    context: usize,
    run: &mut Running,
    logits: Vec<f32>,
) -> Outcome {
    match sample_next_inner(model, context, run, logits) {
        Ok(outcome) => outcome,
        Err(failure) => Outcome::Failed(failure),
    }
}

fn sample_next_inner(
    model: &LoadedModel,
    context: usize,
    run: &mut Running,
    mut logits: Vec<f32>,
) -> Result<Outcome, Failure> {
    let constraint_failed = |generated: usize, e: String| {
        Failure::Invalid(format!(
            "the output constraint failed after {generated} generated tokens: {e}"
        ))
    };
    let text_failed = |e: crate::Error| Failure::Engine(format!("decoding the output: {e}"));
    let logprob = run
        .request
        .logprobs
        .map(|top| log_probabilities(&logits, top));
    if let Some(c) = run.request.constraint.as_mut() {
        c.mask_logits(&mut logits)
            .map_err(|e| constraint_failed(run.generated, e))?;
    }
    let id = run.sampler.sample(&logits, &run.history);
    let now = Instant::now();
    let first = *run.first_token.get_or_insert(now);
    let usage = |run: &Running, reason| Usage {
        finish_reason: reason,
        prompt_tokens: run.request.prompt.len(),
        cached_tokens: run.cached_tokens,
        completion_tokens: run.generated,
        stop_string: run.text.stop_string().map(str::to_string),
        prefill_seconds: (first - run.admitted).as_secs_f64(),
        decode_seconds: (now - first).as_secs_f64(),
    };
    let tokenizer = model.tokenizer.as_ref();
    if run.request.eos_token_ids.contains(&id) {
        if let Some(tok) = tokenizer {
            let (piece, _) = run.text.finish(tok).map_err(text_failed)?;
            if !piece.is_empty() {
                run.request.sink.send(Event::Token {
                    id,
                    text: piece,
                    logprob: None,
                });
            }
        }
        return Ok(Outcome::Finished(usage(run, FinishReason::Stop)));
    }
    if let Some(c) = run.request.constraint.as_mut() {
        c.consume(id)
            .map_err(|e| constraint_failed(run.generated, e))?;
    }
    run.generated += 1;
    run.history.push(id);
    let logprob = logprob.map(|(lp, top)| TokenLogprob {
        id,
        logprob: lp[id as usize],
        top,
    });
    let (mut text, mut stopped) = match tokenizer {
        Some(tok) => run.text.push(tok, id).map_err(text_failed)?,
        None => (String::new(), false),
    };
    let grammar_done = run
        .request
        .constraint
        .as_ref()
        .is_some_and(|c| c.is_finished());
    // The next token would not fit in the slot's cache.
    let length = run.generated >= run.request.max_tokens
        || run.request.prompt.len() + run.generated >= context;
    let ends = stopped || grammar_done || length;
    if ends && !stopped {
        if let Some(tok) = tokenizer {
            let (rest, s) = run.text.finish(tok).map_err(text_failed)?;
            text.push_str(&rest);
            stopped = s;
        }
    }
    if !run.request.sink.send(Event::Token { id, text, logprob }) {
        return Ok(Outcome::Gone);
    }
    if stopped || grammar_done {
        return Ok(Outcome::Finished(usage(run, FinishReason::Stop)));
    }
    if length {
        return Ok(Outcome::Finished(usage(run, FinishReason::Length)));
    }
    run.next = Some(id);
    Ok(Outcome::Continue)
}

/// What became of a sequence after a sampled token.
enum Outcome {
    Continue,
    Finished(Usage),
    /// It cannot go on (its constraint or its text failed); only it ends.
    Failed(Failure),
    /// The client left.
    Gone,
}

/// Log-softmax of `logits` and the `top` most likely `(id, logprob)`.
fn log_probabilities(logits: &[f32], top: usize) -> (Vec<f32>, Vec<(u32, f32)>) {
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| ((v - max) as f64).exp())
        .sum();
    let log_sum = max + sum.ln() as f32;
    let lp: Vec<f32> = logits
        .iter()
        .map(|&v| {
            if v.is_nan() {
                f32::NEG_INFINITY
            } else {
                v - log_sum
            }
        })
        .collect();
    let mut order: Vec<u32> = (0..lp.len() as u32).collect();
    let top = top.min(lp.len());
    if top > 0 {
        order.select_nth_unstable_by(top - 1, |&a, &b| {
            lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b))
        });
        order.truncate(top);
        order.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
    } else {
        order.clear();
    }
    let top = order.into_iter().map(|i| (i, lp[i as usize])).collect();
    (lp, top)
}

/// Length of the common prefix of two token sequences.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A caught panic's payload as text: `panic: MESSAGE` (or `panic` when it carries no text).
pub fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        format!("panic: {s}")
    } else if let Some(s) = panic.downcast_ref::<String>() {
        format!("panic: {s}")
    } else {
        "panic".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_probabilities_normalise_and_rank() {
        let (lp, top) = log_probabilities(&[1.0, 3.0, 2.0, f32::NAN], 2);
        let total: f64 = lp.iter().map(|&v| (v as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(lp[3], f32::NEG_INFINITY);
        // log(e^3 / (e^1 + e^3 + e^2))
        let expected = 3.0 - (1f64.exp() + 3f64.exp() + 2f64.exp()).ln();
        assert!((top[0].1 as f64 - expected).abs() < 1e-6);
    }

    #[test]
    fn prompts_are_spread_oldest_first_within_the_budget() {
        // Chunks of 8, a budget of 10: the oldest takes 8, the next the 2 left, the rest wait.
        assert_eq!(spread_prompts(&[20, 5, 3], 8, 10, false), vec![8, 2, 0]);
        // The oldest's whole chunk even beyond the budget; nothing left for the others.
        assert_eq!(spread_prompts(&[20, 5, 3], 8, 4, true), vec![8, 0, 0]);
        assert_eq!(spread_prompts(&[20, 5, 3], 8, 4, false), vec![4, 0, 0]);
        // A budget that covers everyone changes nothing; a budget of 0 still runs a token.
        assert_eq!(
            spread_prompts(&[20, 5, 3], 8, usize::MAX, true),
            vec![8, 5, 3]
        );
        assert_eq!(spread_prompts(&[20, 5, 3], 8, 0, false), vec![1, 0, 0]);
        assert_eq!(spread_prompts(&[2, 5, 3], 8, 9, false), vec![2, 5, 2]);
    }

    #[test]
    fn common_prefix_counts_matching_heads() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[7, 8], &[7, 8]), 2);
    }
}
