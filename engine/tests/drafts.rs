//! Prompt-lookup and grammar fast-forward drafts through the scheduler change speed, never
//! tokens: on every committed fixture, a code-edit prompt whose text repeats gives the same
//! tokens, text, log-probabilities and finish reasons with drafting off, `ngram` (every step)
//! and `auto` — greedy, and seeded sampling with penalties; a JSON schema whose keys the grammar
//! forces gives the same output with its forced tokens drafted; requests batched with drafts
//! get the tokens each gets alone without them; stop strings, the context's end and max_tokens
//! end a drafted sequence exactly where they end a plain one.
//!
//! The fixtures' random weights do not copy text as a trained model does, but several fall
//! into loops when decoding greedily, which prompt lookup then drafts; the tests check that
//! drafts were really accepted (and rejected) there, so both paths of the verification run.
//! Acceptance on a trained model (SmolLM2) is measured by the API suite and `coli bench`.

mod common;
use common::fixture;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use colibri::runtime::drafts::{DraftConfig, DraftMode, DraftSource};
use colibri::runtime::generate::FinishReason;
use colibri::runtime::grammar::{Grammar, GrammarVocab};
use colibri::runtime::loaded::LoadedModel;
use colibri::runtime::sampling::SamplingParams;
use colibri::runtime::scheduler::{Event, Request, Scheduler, SchedulerConfig};

/// Every committed fixture that `LoadedModel::open` serves.
const FIXTURES: [&str; 17] = [
    "llama",
    "mixtral",
    "olmoe",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
    "glm_moe_dsa",
    "deepseek_v4",
    "minimax_m2",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5_moe",
    "kimi_linear",
    "kimi_k25",
    "glm5_next",
    "inkling",
    "inkling2",
];

/// A code edit: the answer is the function again with one change.
const CODE_EDIT: &str = "Rewrite this function with one change: return the total.\n\
def count_words(lines):\n    total = 0\n    for line in lines:\n        total = total + len(line.split())\n    print(total)\n\
Answer:\ndef count_words(lines):\n    total = 0\n    for line in lines:\n";

fn config(slots: usize, context: usize, drafts: DraftConfig) -> SchedulerConfig {
    SchedulerConfig {
        slots,
        context,
        prefill_chunk: 16,
        prefill_budget: None,
        queue_limit: 64,
        queue_timeout: Duration::from_secs(120),
        persist_dir: None,
        history_save_interval: Duration::from_secs(60),
        drafts,
    }
}

fn mode(mode: DraftMode) -> DraftConfig {
    DraftConfig {
        mode,
        max_tokens: 6,
        ngram_min: 1,
        ngram_max: 3,
    }
}

fn seeded(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.7,
        top_k: 40,
        top_p: 0.95,
        repetition_penalty: 1.05,
        frequency_penalty: 0.1,
        seed,
        ..SamplingParams::default()
    }
}

/// Everything a request heard: tokens, text, log-probability bits (and alternatives), the end.
#[derive(Debug, Clone, PartialEq)]
struct Output {
    tokens: Vec<u32>,
    text: String,
    logprobs: Vec<(u32, Vec<(u32, u32)>)>,
    finish: Result<FinishReason, String>,
}

struct Job {
    prompt: Vec<u32>,
    sampling: SamplingParams,
    max_tokens: usize,
    stop: Vec<String>,
    eos: Vec<u32>,
    constraint: Option<Grammar>,
}

impl Job {
    fn new(prompt: Vec<u32>, sampling: SamplingParams, max_tokens: usize) -> Job {
        Job {
            prompt,
            sampling,
            max_tokens,
            stop: vec![],
            eos: vec![],
            constraint: None,
        }
    }
}

fn submit(scheduler: &Scheduler, loaded: &LoadedModel, job: &Job) -> mpsc::Receiver<Event> {
    let constraint = job.constraint.as_ref().map(|g| {
        let tok = loaded.tokenizer.as_ref().expect("a tokenizer");
        GrammarVocab::new(tok.inner(), &loaded.eos_token_ids)
            .unwrap()
            .constraint(g)
            .unwrap()
    });
    let (tx, rx) = mpsc::channel();
    scheduler
        .submit(Request {
            prompt: job.prompt.clone(),
            max_tokens: job.max_tokens,
            eos_token_ids: job.eos.clone(),
            stop_strings: job.stop.clone(),
            sampling: job.sampling,
            logprobs: Some(2),
            constraint,
            sink: Box::new(tx),
        })
        .unwrap();
    rx
}

fn collect(rx: mpsc::Receiver<Event>) -> Output {
    let mut out = Output {
        tokens: vec![],
        text: String::new(),
        logprobs: vec![],
        finish: Err("no end".into()),
    };
    loop {
        match rx.recv_timeout(Duration::from_secs(300)).expect("an event") {
            Event::Admitted { .. } => {}
            Event::Token { id, text, logprob } => {
                out.tokens.push(id);
                out.text.push_str(&text);
                if let Some(l) = logprob {
                    out.logprobs.push((
                        l.logprob.to_bits(),
                        l.top.iter().map(|(i, p)| (*i, p.to_bits())).collect(),
                    ));
                }
            }
            Event::Done(u) => {
                out.finish = Ok(u.finish_reason);
                return out;
            }
            Event::Failed(f) => {
                out.finish = Err(f.to_string());
                return out;
            }
        }
    }
}

/// Run `jobs` at once on a fresh scheduler; their outputs and the (drafted, accepted) tokens of
/// each source.
fn run(
    loaded: &Arc<LoadedModel>,
    cfg: SchedulerConfig,
    jobs: &[Job],
) -> (Vec<Output>, [(u64, u64); 2]) {
    let scheduler = Scheduler::start(loaded.clone(), cfg);
    let receivers: Vec<_> = jobs.iter().map(|j| submit(&scheduler, loaded, j)).collect();
    let outputs = receivers.into_iter().map(collect).collect();
    let stats = DraftSource::ALL.map(|s| scheduler.stats().drafts(s));
    (outputs, stats)
}

fn open(arch: &str) -> Arc<LoadedModel> {
    Arc::new(LoadedModel::open(&fixture(arch), true).unwrap())
}

fn encode(loaded: &LoadedModel, text: &str) -> Vec<u32> {
    loaded
        .tokenizer
        .as_ref()
        .unwrap()
        .encode(text, false)
        .unwrap()
}

#[test]
fn prompt_lookup_drafts_never_change_the_output_on_any_fixture() {
    let mut accepted_somewhere = 0;
    let mut rejected_somewhere = 0;
    let mut recurrent_accepted = 0;
    for arch in FIXTURES {
        let loaded = open(arch);
        let prompt = encode(&loaded, CODE_EDIT);
        for (what, sampling) in [("greedy", SamplingParams::greedy()), ("seeded", seeded(11))] {
            let job = Job::new(prompt.clone(), sampling, 40);
            let context = prompt.len() + 64;
            let (plain, none) = run(&loaded, config(1, context, DraftConfig::off()), &[job]);
            assert_eq!(none, [(0, 0); 2], "{arch}: drafting off drafts nothing");
            assert_eq!(plain[0].finish, Ok(FinishReason::Length), "{arch} {what}");
            assert_eq!(plain[0].tokens.len(), 40);
            for m in [DraftMode::Always, DraftMode::Auto] {
                let job = Job::new(prompt.clone(), sampling, 40);
                let (drafted, stats) = run(&loaded, config(1, context, mode(m)), &[job]);
                assert_eq!(drafted[0], plain[0], "{arch} {what} {m:?}");
                let (n, a) = stats[DraftSource::Ngram as usize];
                eprintln!("{arch} {what} {m:?}: {a} of {n} drafted tokens accepted");
                assert!(
                    n > 0,
                    "{arch} {what} {m:?}: the repeated text was never drafted"
                );
                if m == DraftMode::Always {
                    accepted_somewhere += a;
                    rejected_somewhere += n - a;
                    if loaded.model.new_cache(1).is_recurrent() {
                        recurrent_accepted += a;
                    }
                }
            }
        }
    }
    // Both sides of the verification ran: tokens kept from drafts, and drafts cut back.
    assert!(accepted_somewhere > 50, "{accepted_somewhere} accepted");
    assert!(rejected_somewhere > 50, "{rejected_somewhere} rejected");
    eprintln!("recurrent fixtures: {recurrent_accepted} accepted");
}

#[test]
fn grammar_fast_forward_drafts_keep_a_schemas_output() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "station_name": {"type": "string", "maxLength": 12},
            "clock_hours": {"type": "integer", "minimum": 0, "maximum": 23},
            "trains_running": {"type": "boolean"},
            "platform_numbers": {
                "type": "array",
                "items": {"type": "integer", "minimum": 1, "maximum": 99},
                "maxItems": 3
            }
        },
        "required": ["station_name", "clock_hours", "trains_running", "platform_numbers"],
        "additionalProperties": false
    });
    let mut grammar_accepted = 0;
    for arch in ["llama", "olmoe", "qwen3_next", "gpt_oss"] {
        let loaded = open(arch);
        let prompt = encode(&loaded, "Describe the station as JSON: ");
        for (what, sampling) in [("greedy", SamplingParams::greedy()), ("seeded", seeded(5))] {
            let job = || Job {
                eos: loaded.eos_token_ids.clone(),
                constraint: Some(Grammar::JsonSchema {
                    schema: schema.clone(),
                    strict: true,
                }),
                ..Job::new(prompt.clone(), sampling, 120)
            };
            let context = prompt.len() + 160;
            let (plain, _) = run(&loaded, config(1, context, DraftConfig::off()), &[job()]);
            let value: serde_json::Value = serde_json::from_str(&plain[0].text)
                .unwrap_or_else(|e| panic!("{arch} {what}: {e}: {}", plain[0].text));
            assert!(value["platform_numbers"].is_array(), "{arch}: {value}");
            for m in [DraftMode::Always, DraftMode::Auto] {
                let (drafted, stats) = run(&loaded, config(1, context, mode(m)), &[job()]);
                assert_eq!(drafted[0], plain[0], "{arch} {what} {m:?}");
                let (n, a) = stats[DraftSource::Grammar as usize];
                eprintln!(
                    "{arch} {what} {m:?}: grammar {a}/{n}, ngram {}/{} accepted",
                    stats[0].1, stats[0].0
                );
                assert!(n > 0, "{arch} {what} {m:?}: no forced token was drafted");
                grammar_accepted += a;
            }
        }
    }
    assert!(
        grammar_accepted > 20,
        "{grammar_accepted} forced tokens accepted"
    );
}

#[test]
fn batched_requests_with_drafts_get_the_tokens_each_gets_alone_without() {
    for arch in ["mixtral", "qwen3_next"] {
        let loaded = open(arch);
        let base = encode(&loaded, CODE_EDIT);
        let vocab = loaded.model.info().vocab_size as u32;
        // Six requests: different prompts (some repeat themselves), greedy and seeded.
        let jobs: Vec<Job> = (0..6u32)
            .map(|i| {
                let mut p: Vec<u32> = base[(i as usize * 3)..].to_vec();
                if i % 2 == 1 {
                    p = p.iter().map(|&t| (t + i * 7) % vocab).collect();
                }
                let sampling = if i % 3 == 0 {
                    SamplingParams::greedy()
                } else {
                    seeded(100 + i as u64)
                };
                Job::new(p, sampling, 24)
            })
            .collect();
        let context = base.len() + 32;
        let alone: Vec<Output> = jobs
            .iter()
            .map(|j| {
                let job = Job::new(j.prompt.clone(), j.sampling, j.max_tokens);
                run(&loaded, config(1, context, DraftConfig::off()), &[job]).0[0].clone()
            })
            .collect();
        let (together, stats) = run(&loaded, config(4, context, mode(DraftMode::Always)), &jobs);
        assert!(stats[0].0 > 0, "{arch}: nothing drafted");
        for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(t, a, "{arch}: request {i}");
        }
    }
}

#[test]
fn a_drafted_sequence_ends_where_a_plain_one_ends() {
    // mixtral's greedy output loops, so drafts run up to each end.
    let loaded = open("mixtral");
    let prompt = encode(&loaded, CODE_EDIT);
    let greedy = SamplingParams::greedy();
    let plain = |job: Job, context: usize| {
        run(&loaded, config(1, context, DraftConfig::off()), &[job]).0[0].clone()
    };
    let long = plain(Job::new(prompt.clone(), greedy, 40), prompt.len() + 64);
    assert!(long.text.len() > 12, "{:?}", long.text);
    // A stop string in the middle of the text: it ends inside a verified draft.
    let chars: Vec<char> = long.text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cases: Vec<(Job, usize, &str)> = vec![
        (
            Job {
                stop: vec![stop.clone()],
                ..Job::new(prompt.clone(), greedy, 40)
            },
            prompt.len() + 64,
            "stop string",
        ),
        // The context ends before max_tokens.
        (
            Job::new(prompt.clone(), greedy, 40),
            prompt.len() + 13,
            "context",
        ),
        // max_tokens ends it, at every length up to a draft's.
        (
            Job::new(prompt.clone(), greedy, 1),
            prompt.len() + 64,
            "1 token",
        ),
        (
            Job::new(prompt.clone(), greedy, 2),
            prompt.len() + 64,
            "2 tokens",
        ),
        (
            Job::new(prompt.clone(), greedy, 7),
            prompt.len() + 64,
            "7 tokens",
        ),
        // An end-of-sequence id the output reaches.
        (
            Job {
                eos: vec![long.tokens[20]],
                ..Job::new(prompt.clone(), greedy, 40)
            },
            prompt.len() + 64,
            "eos",
        ),
    ];
    for (job, context, what) in cases {
        let expected = plain(
            Job {
                stop: job.stop.clone(),
                eos: job.eos.clone(),
                ..Job::new(job.prompt.clone(), job.sampling, job.max_tokens)
            },
            context,
        );
        let (got, stats) = run(&loaded, config(1, context, mode(DraftMode::Always)), &[job]);
        eprintln!(
            "{what}: {} tokens, drafts {:?}",
            expected.tokens.len(),
            stats[0]
        );
        assert_eq!(got[0], expected, "{what}");
    }
}
