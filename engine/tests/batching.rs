//! Batching changes speed, never results: a sequence run inside a batch of other sequences
//! (prefill chunks and decode rows mixed, each continuing its own cache) gives the same logits
//! bits as run alone; the scheduler's concurrent requests get exactly the tokens each gets
//! alone with the same seed; a prompt that extends a slot's previous sequence reuses its KV and
//! still gives the same tokens; a request whose constraint fails in the middle of a batch ends
//! alone, and the request batched with it gets its tokens all the same.

mod common;
use common::{bits, fixture, prompt, MOE_FIXTURES};

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use colibri::model::{self, BatchItem, Logits};
use colibri::runtime::generate::{generate, FinishReason, GenerateParams};
use colibri::runtime::grammar::{Grammar, GrammarVocab};
use colibri::runtime::loaded::LoadedModel;
use colibri::runtime::sampling::SamplingParams;
use colibri::runtime::scheduler::{
    Event, Failure, Request, Scheduler, SchedulerConfig, SubmitError, Usage,
};

#[test]
fn a_sequence_inside_a_batch_gives_the_bits_it_gives_alone() {
    for arch in MOE_FIXTURES.into_iter().chain(["llama"]) {
        let m = model::load(&fixture(arch)).unwrap();
        let ids = prompt(arch);
        let vocab = m.info().vocab_size as u32;
        let a: Vec<u32> = ids.clone();
        let b: Vec<u32> = ids.iter().rev().map(|&t| (t * 7 + 3) % vocab).collect();
        let c: Vec<u32> = ids[..3].to_vec();

        // Alone: a prefix of each, then one more step of each.
        let alone = |seq: &[u32], split: usize| {
            let mut cache = m.new_cache(64);
            let first = m.forward(&seq[..split], &mut cache, Logits::All).unwrap();
            let second = m.forward(&seq[split..], &mut cache, Logits::All).unwrap();
            (first, second)
        };
        let (a1, a2) = alone(&a, a.len() - 1);
        let (b1, _) = alone(&b, 4);
        let (c1, c2) = alone(&c, 2);

        // Together: the same two steps, the three sequences batched each time.
        let mut ca = m.new_cache(64);
        let mut cb = m.new_cache(64);
        let mut cc = m.new_cache(64);
        let step1 = m
            .forward_batch(&mut [
                BatchItem {
                    tokens: &a[..a.len() - 1],
                    cache: &mut ca,
                    logits: Logits::All,
                },
                BatchItem {
                    tokens: &b[..4],
                    cache: &mut cb,
                    logits: Logits::All,
                },
                BatchItem {
                    tokens: &c[..2],
                    cache: &mut cc,
                    logits: Logits::All,
                },
            ])
            .unwrap();
        let step2 = m
            .forward_batch(&mut [
                BatchItem {
                    tokens: &c[2..],
                    cache: &mut cc,
                    logits: Logits::All,
                },
                BatchItem {
                    tokens: &a[a.len() - 1..],
                    cache: &mut ca,
                    logits: Logits::Last,
                },
                BatchItem {
                    tokens: &b[4..],
                    cache: &mut cb,
                    logits: Logits::None,
                },
            ])
            .unwrap();
        assert_eq!(bits(&step1[0]), bits(&a1), "{arch}: a, step 1");
        assert_eq!(bits(&step1[1]), bits(&b1), "{arch}: b, step 1");
        assert_eq!(bits(&step1[2]), bits(&c1), "{arch}: c, step 1");
        assert_eq!(bits(&step2[0]), bits(&c2), "{arch}: c, step 2");
        assert_eq!(bits(&step2[1]), bits(&a2), "{arch}: a, step 2");
        assert!(step2[2].is_empty(), "{arch}: Logits::None returns no rows");
        assert_eq!(cb.len, b.len(), "{arch}: b's cache advanced all the same");
    }
}

/// Misses of a store that holds no expert: every expert of every acquire is read, so the
/// count is the sum of the acquired unions' sizes.
fn streamed(arch: &str) -> Box<dyn model::CausalLm> {
    let dir = fixture(arch);
    let resident = model::load(&dir).unwrap().info().dense_bytes as u64;
    let opts = colibri::store::StoreOptions {
        ram_budget: Some(resident),
        io_threads: 2,
        prefetch: false,
        learn: false,
        ..Default::default()
    };
    model::load_with(&dir, &model::LoadOptions::from(opts)).unwrap()
}

#[test]
fn a_batch_acquires_each_layers_expert_union_once() {
    for arch in ["deepseek_v3", "deepseek_v4"] {
        let ids = prompt(arch);
        // Apart: each sequence its own forward pass on its own fresh store.
        let apart = streamed(arch);
        let vocab = apart.info().vocab_size as u32;
        let a: Vec<u32> = ids.clone();
        let b: Vec<u32> = ids.iter().map(|&t| (t * 5 + 1) % vocab).collect();
        let mut ca = apart.new_cache(64);
        let mut cb = apart.new_cache(64);
        let la = apart.forward(&a, &mut ca, Logits::All).unwrap();
        let lb = apart.forward(&b, &mut cb, Logits::All).unwrap();
        let apart_misses = apart.store_stats().unwrap().misses;
        // Together: one batch.
        let together = streamed(arch);
        let mut ca = together.new_cache(64);
        let mut cb = together.new_cache(64);
        let both = together
            .forward_batch(&mut [
                BatchItem {
                    tokens: &a,
                    cache: &mut ca,
                    logits: Logits::All,
                },
                BatchItem {
                    tokens: &b,
                    cache: &mut cb,
                    logits: Logits::All,
                },
            ])
            .unwrap();
        let together_misses = together.store_stats().unwrap().misses;
        eprintln!("{arch}: {together_misses} experts read batched, {apart_misses} apart");
        assert_eq!(bits(&both[0]), bits(&la), "{arch}: a");
        assert_eq!(bits(&both[1]), bits(&lb), "{arch}: b");
        // An expert both sequences route to in a layer is read once, not twice.
        assert!(
            together_misses < apart_misses,
            "{arch}: {together_misses} experts read batched, {apart_misses} apart"
        );
    }
}

#[test]
fn deepseek_v4_requests_batch_in_fewer_steps_with_the_tokens_each_gets_alone() {
    let dir = fixture("deepseek_v4");
    let loaded = Arc::new(LoadedModel::open(&dir, false).unwrap());
    let vocab = loaded.model.info().vocab_size as u32;
    let base = prompt("deepseek_v4");
    // Four prompts of different lengths (windows, compressed entries and indexer picks
    // differ per sequence), four seeds.
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| {
            (0..(5 + i as usize * 4))
                .map(|j| (base[j % base.len()] + i * 17 + j as u32) % vocab)
                .collect()
        })
        .collect();
    let config = |slots: usize| SchedulerConfig {
        slots,
        context: 64,
        prefill_chunk: 4,
        prefill_budget: None,
        queue_limit: 16,
        queue_timeout: Duration::from_secs(120),
        persist_dir: None,
        history_save_interval: Duration::from_secs(60),
        drafts: Default::default(),
    };
    let steps = |s: &Scheduler| s.stats().steps.load(std::sync::atomic::Ordering::Relaxed);
    // Alone: each request on a scheduler of its own.
    let mut alone = Vec::new();
    let mut steps_alone = 0;
    for (i, p) in prompts.iter().enumerate() {
        let scheduler = Scheduler::start(loaded.clone(), config(1));
        let (r, rx) = request(p.clone(), 40 + i as u64, 10);
        scheduler.submit(r).unwrap();
        let (tokens, end) = collect(rx);
        assert_eq!(end.unwrap().completion_tokens, 10);
        alone.push(tokens);
        steps_alone += steps(&scheduler);
    }
    // Together: four slots, everything submitted at once.
    let scheduler = Scheduler::start(loaded.clone(), config(4));
    let receivers: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (r, rx) = request(p.clone(), 40 + i as u64, 10);
            scheduler.submit(r).unwrap();
            rx
        })
        .collect();
    for (i, rx) in receivers.into_iter().enumerate() {
        let (tokens, end) = collect(rx);
        assert_eq!(end.unwrap().completion_tokens, 10);
        assert_eq!(tokens, alone[i], "request {i}");
    }
    let together = steps(&scheduler);
    eprintln!("deepseek_v4: {together} steps batched, {steps_alone} one at a time");
    assert!(
        together < steps_alone,
        "{together} steps batched, {steps_alone} one at a time"
    );
}

/// Collect a request's events: its tokens and how it ended.
fn collect(rx: mpsc::Receiver<Event>) -> (Vec<u32>, Result<Usage, Failure>) {
    let mut tokens = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("an event") {
            Event::Admitted { .. } => {}
            Event::Token { id, .. } => tokens.push(id),
            Event::Done(u) => return (tokens, Ok(u)),
            Event::Failed(f) => return (tokens, Err(f)),
        }
    }
}

fn request(prompt: Vec<u32>, seed: u64, max_tokens: usize) -> (Request, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel();
    let r = Request {
        prompt,
        max_tokens,
        eos_token_ids: vec![],
        stop_strings: vec![],
        sampling: SamplingParams {
            temperature: 0.9,
            seed,
            ..SamplingParams::default()
        },
        logprobs: None,
        constraint: None,
        sink: Box::new(tx),
    };
    (r, rx)
}

#[test]
fn concurrent_requests_get_exactly_the_tokens_each_gets_alone() {
    // The prompts spread over steps by the measured budget, by a budget that cuts chunks (3
    // tokens a step over all slots) and by one token a step; on the hybrids (recurrent state
    // and convolution windows continued across cut chunks) by a cutting budget.
    for (arch, budgets) in [
        ("olmoe", vec![None, Some(3), Some(1)]),
        ("qwen3_5_moe", vec![Some(3)]),
        ("kimi_linear", vec![Some(5)]),
        ("inkling", vec![Some(3)]),
    ] {
        concurrent_requests_match_alone(arch, &budgets);
    }
}

fn concurrent_requests_match_alone(arch: &str, budgets: &[Option<usize>]) {
    let dir = fixture(arch);
    let loaded = Arc::new(LoadedModel::open(&dir, false).unwrap());
    let vocab = loaded.model.info().vocab_size as u32;
    let base = prompt(arch);
    // Eight prompts of different lengths, eight seeds.
    let prompts: Vec<Vec<u32>> = (0..8u32)
        .map(|i| {
            (0..(3 + i as usize * 2))
                .map(|j| (base[j % base.len()] + i * 31 + j as u32) % vocab)
                .collect()
        })
        .collect();
    // Alone: the plain generation loop, no scheduler.
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = GenerateParams {
                max_tokens: 12,
                eos_token_ids: vec![],
                stop_strings: vec![],
                sampling: SamplingParams {
                    temperature: 0.9,
                    seed: 100 + i as u64,
                    ..SamplingParams::default()
                },
            };
            generate(loaded.model.as_ref(), None, p, &params, |_| {}, |_| {})
                .unwrap()
                .tokens
        })
        .collect();
    // Together: 4 slots, small prefill chunks, everything submitted at once.
    for &budget in budgets {
        let scheduler = Scheduler::start(
            loaded.clone(),
            SchedulerConfig {
                slots: 4,
                context: 64,
                prefill_chunk: 4,
                prefill_budget: budget,
                queue_limit: 16,
                queue_timeout: Duration::from_secs(120),
                persist_dir: None,
                history_save_interval: Duration::from_secs(60),
                drafts: Default::default(),
            },
        );
        let receivers: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (r, rx) = request(p.clone(), 100 + i as u64, 12);
                scheduler.submit(r).unwrap();
                rx
            })
            .collect();
        for (i, rx) in receivers.into_iter().enumerate() {
            let (tokens, end) = collect(rx);
            let usage = end.unwrap();
            assert_eq!(usage.finish_reason, FinishReason::Length);
            assert_eq!(usage.completion_tokens, 12);
            assert_eq!(tokens, alone[i], "{arch}: request {i}, budget {budget:?}");
        }
        let stats = scheduler.stats();
        let steps = stats.steps.load(std::sync::atomic::Ordering::Relaxed);
        let prompt_tokens: u64 = prompts.iter().map(|p| p.len() as u64).sum();
        assert!(
            steps < 8 * 12 + prompt_tokens,
            "{arch}: requests were batched"
        );
        // A configured budget is the one every step with prompts waiting reports; the step
        // cost is fitted from steps of different sizes.
        if let Some(n) = budget {
            assert_eq!(*stats.prompt_budget.lock().unwrap(), Some(n), "{arch}");
        }
        assert!(
            stats.step_cost.lock().unwrap().is_some(),
            "{arch}: {steps} steps of several sizes gave no step cost"
        );
        if budget == Some(1) {
            // One prompt token a step: at least as many steps as prompt tokens.
            assert!(
                steps >= prompt_tokens,
                "{steps} steps, {prompt_tokens} prompt tokens"
            );
        }
    }
}

#[test]
fn a_constraint_failing_in_a_batch_ends_only_its_own_request() {
    let dir = fixture("olmoe");
    let loaded = Arc::new(LoadedModel::open(&dir, false).unwrap());
    let tokenizer = loaded
        .tokenizer
        .as_ref()
        .expect("the fixture has a tokenizer");
    let vocab = GrammarVocab::new(tokenizer.inner(), &loaded.eos_token_ids).unwrap();
    // Accepted (its first two tokens lead somewhere), unsatisfiable once "ab" is written: the
    // mask after it fails in the engine.
    let grammar = Grammar::Lark("start: \"a\" \"b\" x\nx: x".to_string());
    let base = prompt("olmoe");
    let alone = generate(
        loaded.model.as_ref(),
        None,
        &base,
        &GenerateParams {
            max_tokens: 24,
            eos_token_ids: vec![],
            stop_strings: vec![],
            sampling: SamplingParams {
                temperature: 0.9,
                seed: 5,
                ..SamplingParams::default()
            },
        },
        |_| {},
        |_| {},
    )
    .unwrap()
    .tokens;
    let scheduler = Scheduler::start(
        loaded.clone(),
        SchedulerConfig {
            slots: 2,
            context: 128,
            prefill_chunk: 64,
            prefill_budget: None,
            queue_limit: 4,
            queue_timeout: Duration::from_secs(120),
            persist_dir: None,
            history_save_interval: Duration::from_secs(60),
            drafts: Default::default(),
        },
    );
    let (a, a_rx) = request(base.clone(), 5, 24);
    let (mut b, b_rx) = request(base[..10].to_vec(), 6, 24);
    b.constraint = Some(
        vocab
            .constraint(&grammar)
            .expect("the constraint is accepted"),
    );
    scheduler.submit(a).unwrap();
    scheduler.submit(b).unwrap();
    let (b_tokens, b_end) = collect(b_rx);
    match b_end {
        Err(Failure::Invalid(m)) => assert!(m.contains("output constraint failed"), "{m}"),
        other => panic!("expected the constraint's failure, got {other:?}"),
    }
    assert!(
        (1..=2).contains(&b_tokens.len()),
        "\"ab\" in one or two tokens before the constraint failed: {b_tokens:?}"
    );
    let (a_tokens, a_end) = collect(a_rx);
    let usage = a_end.expect("the other request completes");
    assert_eq!(usage.finish_reason, FinishReason::Length);
    assert_eq!(a_tokens, alone);
    // Alone, A takes 24 steps (a prefill and 23 decodes) and B one more than its tokens:
    // fewer in all means B ran inside A's steps.
    let steps = scheduler
        .stats()
        .steps
        .load(std::sync::atomic::Ordering::Relaxed);
    let apart = 24 + b_tokens.len() as u64 + 1;
    assert!(
        steps < apart,
        "{steps} steps, {apart} apart: the requests did not share a batch"
    );
}

#[test]
fn a_prompt_extending_a_slots_sequence_reuses_its_kv_and_gets_the_same_tokens() {
    // The hybrids' recurrent state (and the Inkling family's convolution windows) goes back
    // to a checkpoint (end of a turn, end of a prefill chunk: chunks of 8 here) instead of
    // being cut; attention caches are cut exactly.
    for (arch, chunk) in [
        ("qwen3_moe", 256),
        ("qwen3_5_moe", 8),
        ("kimi_linear", 8),
        ("inkling", 8),
        ("inkling2", 8),
    ] {
        let loaded = Arc::new(LoadedModel::open(&fixture(arch), false).unwrap());
        let config = |slots| SchedulerConfig {
            slots,
            context: 64,
            prefill_chunk: chunk,
            prefill_budget: None,
            queue_limit: 4,
            queue_timeout: Duration::from_secs(120),
            persist_dir: None,
            history_save_interval: Duration::from_secs(60),
            drafts: Default::default(),
        };
        let base = prompt(arch);
        let scheduler = Scheduler::start(loaded.clone(), config(2));
        let fresh = Scheduler::start(loaded, config(1));
        let run = |s: &Scheduler, tokens: &[u32], seed| {
            let (r, rx) = request(tokens.to_vec(), seed, 6);
            s.submit(r).unwrap();
            let (out, end) = collect(rx);
            (out, end.unwrap().cached_tokens)
        };
        let (first, cached) = run(&scheduler, &base, 7);
        assert_eq!(cached, 0, "{arch}");
        // The next turn: the previous prompt, its answer, and two new tokens.
        let mut turn2 = base.clone();
        turn2.extend_from_slice(&first);
        turn2.extend_from_slice(&[5, 9]);
        let (second, cached) = run(&scheduler, &turn2, 8);
        // Every token whose KV the slot holds is reused: the prompt and all generated tokens
        // but the last (which was sampled, never run).
        let turn1_end = base.len() + first.len() - 1;
        assert_eq!(cached, turn1_end, "{arch}");
        // Without reuse: the same request on a fresh scheduler.
        let (again, cached) = run(&fresh, &turn2, 8);
        assert_eq!(cached, 0, "{arch}");
        assert_eq!(second, again, "{arch}");
        // A prompt that leaves the slot's sequence one token before turn 2's end: attention
        // keeps everything before it, a recurrent state its newest checkpoint before it.
        let mut branch = turn2[..turn2.len() - 1].to_vec();
        branch.push(3);
        let (out, cached) = run(&scheduler, &branch, 9);
        if arch == "qwen3_moe" {
            assert_eq!(cached, turn2.len() - 1, "{arch}");
        } else {
            assert!(
                (turn1_end..turn2.len() - 1).contains(&cached),
                "{arch}: {cached}"
            );
        }
        assert_eq!(out, run(&fresh, &branch, 9).0, "{arch}");
    }
}

#[test]
fn a_full_queue_refuses_and_an_oversized_prompt_fails_with_the_numbers() {
    let dir = fixture("olmoe");
    let loaded = Arc::new(LoadedModel::open(&dir, false).unwrap());
    let scheduler = Scheduler::start(
        loaded,
        SchedulerConfig {
            slots: 1,
            context: 64,
            prefill_chunk: 8,
            prefill_budget: None,
            queue_limit: 1,
            queue_timeout: Duration::from_secs(120),
            persist_dir: None,
            history_save_interval: Duration::from_secs(60),
            drafts: Default::default(),
        },
    );
    let (r, rx) = request(vec![1; 70], 1, 4);
    scheduler.submit(r).unwrap();
    match collect(rx).1 {
        Err(Failure::Invalid(m)) => assert!(m.contains("70 tokens") && m.contains("64"), "{m}"),
        other => panic!("expected an invalid-request failure, got {other:?}"),
    }
    // A long request takes the one slot (its first token proves it is running)...
    let (r, long) = request(vec![1, 2], 1, 62);
    scheduler.submit(r).unwrap();
    loop {
        if let Event::Token { .. } = long.recv_timeout(Duration::from_secs(60)).unwrap() {
            break;
        }
    }
    // ...the next waits in the one queue place, and the one after is refused.
    let (r, waiting) = request(vec![3, 4], 2, 2);
    scheduler.submit(r).unwrap();
    let (r, _refused) = request(vec![5, 6], 3, 2);
    assert_eq!(
        scheduler.submit(r).unwrap_err(),
        SubmitError::QueueFull { limit: 1 }
    );
    // Both accepted requests still finish.
    assert_eq!(collect(long).1.unwrap().completion_tokens, 62);
    assert_eq!(collect(waiting).1.unwrap().completion_tokens, 2);
    scheduler.stop_accepting();
    let (r, _rx) = request(vec![1, 2], 1, 4);
    assert_eq!(scheduler.submit(r).unwrap_err(), SubmitError::ShuttingDown);
}

#[test]
fn slot_conversations_survive_a_restart_through_the_prefix_cache_dir() {
    let dir = fixture("deepseek_v3");
    let loaded = Arc::new(LoadedModel::open(&dir, false).unwrap());
    let base = prompt("deepseek_v3");
    let state = tempfile::tempdir().unwrap();
    let config = |persist: bool| SchedulerConfig {
        slots: 2,
        context: 64,
        prefill_chunk: 256,
        prefill_budget: None,
        queue_limit: 4,
        queue_timeout: Duration::from_secs(120),
        persist_dir: persist.then(|| state.path().to_path_buf()),
        history_save_interval: Duration::from_secs(60),
        drafts: Default::default(),
    };
    let first_run = Scheduler::start(loaded.clone(), config(true));
    let (r, rx) = request(base.clone(), 7, 6);
    first_run.submit(r).unwrap();
    let (first, end) = collect(rx);
    assert_eq!(end.unwrap().cached_tokens, 0);
    first_run.shutdown();
    drop(first_run);
    let saved: Vec<_> = std::fs::read_dir(state.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(saved.len(), 1, "one slot held a conversation: {saved:?}");

    // A restart reopens it: the next turn reuses every token the slot had run.
    let mut turn2 = base.clone();
    turn2.extend_from_slice(&first);
    turn2.extend_from_slice(&[5, 9]);
    let restarted = Scheduler::start(loaded.clone(), config(true));
    let (r, rx) = request(turn2.clone(), 8, 6);
    restarted.submit(r).unwrap();
    let (second, end) = collect(rx);
    assert_eq!(end.unwrap().cached_tokens, base.len() + first.len() - 1);
    drop(restarted);

    // The same tokens as a scheduler that never saw the conversation.
    let fresh = Scheduler::start(loaded.clone(), config(false));
    let (r, rx) = request(turn2.clone(), 8, 6);
    fresh.submit(r).unwrap();
    let (again, end) = collect(rx);
    assert_eq!(end.unwrap().cached_tokens, 0);
    assert_eq!(second, again);
    drop(fresh);

    // A corrupt file is reported and ignored: the slot starts empty and requests are served.
    for name in std::fs::read_dir(state.path()).unwrap() {
        let path = name.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
    }
    let after_damage = Scheduler::start(loaded, config(true));
    let (r, rx) = request(turn2, 8, 6);
    after_damage.submit(r).unwrap();
    let (third, end) = collect(rx);
    assert_eq!(end.unwrap().cached_tokens, 0);
    assert_eq!(third, again);
}

/// An [`EventSink`] that runs `on_token(n)` on the engine thread at the `n`-th generated token
/// (1-based) before passing every event on.
struct Watching {
    tx: mpsc::Sender<Event>,
    tokens: std::sync::atomic::AtomicUsize,
    on_token: Box<dyn Fn(usize) + Send>,
}

impl colibri::runtime::scheduler::EventSink for Watching {
    fn send(&self, event: Event) -> bool {
        if let Event::Token { .. } = event {
            let n = self
                .tokens
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                + 1;
            (self.on_token)(n);
        }
        self.tx.send(event).is_ok()
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// `tokens` of the usage history file in `state`, if it exists and parses (read without
/// touching anything else in the directory).
fn saved_tokens(state: &std::path::Path) -> Option<u64> {
    let usage = state.join("usage");
    let file = std::fs::read_dir(&usage)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "json"))?;
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(file).ok()?).ok()?;
    v["tokens"].as_u64()
}

/// Poll `f` until it returns true; false after `secs` seconds.
fn within(secs: u64, f: impl Fn() -> bool) -> bool {
    let end = std::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        if std::time::Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// A request for `prompt` whose events go through a [`Watching`] sink.
fn watched_request(
    prompt: Vec<u32>,
    max_tokens: usize,
    on_token: impl Fn(usize) + Send + 'static,
) -> (Request, mpsc::Receiver<Event>) {
    let (r, _) = request(prompt, 3, max_tokens);
    let (tx, rx) = mpsc::channel();
    let sink = Watching {
        tx,
        tokens: Default::default(),
        on_token: Box::new(on_token),
    };
    (
        Request {
            sink: Box::new(sink),
            ..r
        },
        rx,
    )
}

#[test]
fn the_usage_history_is_saved_while_a_request_runs_and_when_the_engine_goes_idle() {
    let dir = fixture("olmoe");
    let learning = |state: &std::path::Path| colibri::store::StoreOptions {
        ram_budget: Some(1 << 30),
        learn: true,
        state_dir: Some(state.to_path_buf()),
        ..Default::default()
    };
    let config = |interval: Duration| SchedulerConfig {
        slots: 1,
        context: 64,
        prefill_chunk: 256,
        prefill_budget: None,
        queue_limit: 4,
        queue_timeout: Duration::from_secs(120),
        persist_dir: None,
        history_save_interval: interval,
        drafts: Default::default(),
    };
    let base = prompt("olmoe");
    let p = base.len() as u64;

    // A save due after every step. The engine thread is held inside the third token's event,
    // so the request is certainly still running: meanwhile the background saver writes the
    // steps before it (the prompt's rows and the first decode row).
    let state = tempfile::tempdir().unwrap();
    let loaded = Arc::new(
        LoadedModel::open_with(
            &dir,
            false,
            &colibri::model::LoadOptions::from(learning(state.path())),
        )
        .unwrap(),
    );
    let scheduler = Scheduler::start(loaded.clone(), config(Duration::ZERO));
    let seen = Arc::new(std::sync::Mutex::new(None));
    let (during, watched) = (seen.clone(), state.path().to_path_buf());
    let (r, rx) = watched_request(base.clone(), 8, move |n| {
        if n == 3 {
            within(60, || saved_tokens(&watched).is_some_and(|t| t > p));
            *during.lock().unwrap() = saved_tokens(&watched);
        }
    });
    scheduler.submit(r).unwrap();
    assert_eq!(collect(rx).1.unwrap().completion_tokens, 8);
    let during = seen.lock().unwrap().expect("a save while the request ran");
    assert!(
        during > p,
        "{during} tokens saved, the prompt alone has {p}"
    );
    drop(scheduler);

    // Saves due only every minute: none while the request runs, one when the engine goes
    // idle, holding every row the engine ran.
    let state = tempfile::tempdir().unwrap();
    let loaded = Arc::new(
        LoadedModel::open_with(
            &dir,
            false,
            &colibri::model::LoadOptions::from(learning(state.path())),
        )
        .unwrap(),
    );
    let scheduler = Scheduler::start(loaded.clone(), config(Duration::from_secs(60)));
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (during, watched) = (seen.clone(), state.path().to_path_buf());
    let (r, rx) = watched_request(base.clone(), 8, move |_| {
        during.lock().unwrap().push(saved_tokens(&watched));
    });
    scheduler.submit(r).unwrap();
    assert_eq!(collect(rx).1.unwrap().completion_tokens, 8);
    let rows = scheduler
        .stats()
        .rows
        .load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        rows,
        p + 7,
        "the prompt, then every generated token but the last"
    );
    assert!(
        within(60, || saved_tokens(state.path()) == Some(rows)),
        "the history saved when the engine went idle holds all {rows} rows: {:?}",
        saved_tokens(state.path())
    );
    assert_eq!(
        *seen.lock().unwrap(),
        vec![None; 8],
        "no save during the request"
    );
    drop(scheduler);
    // What was saved is a valid history of this model.
    let fp = colibri::store::history::fingerprint(&dir).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let n = |k: &str| config[k].as_u64().unwrap() as usize;
    let shape = vec![n("num_experts"); n("num_hidden_layers")];
    let (h, warning) =
        colibri::store::history::UsageHistory::load(state.path(), &fp, &shape).unwrap();
    assert_eq!(warning, None);
    assert_eq!(h.tokens(), rows);
    assert!(!h.is_empty());
}
