//! `coli bench`: prefill and decode speed of a model under a placement, with the expert
//! store's counters (hit rate, GB read per token, I/O wait, prefetch recall), where the
//! forward time went, and the fraction of this machine's disk and memory bandwidth reached.
//! The machine's bandwidths are measured once and cached.

use std::time::Instant;

use anyhow::{Context, Result};
use colibri::model::telemetry::Times;
use colibri::model::Logits;
use colibri::runtime::sampling::{Sampler, SamplingParams};
use colibri::store::budget::format_size;
use colibri::store::StoreSnapshot;
use serde::Serialize;

use crate::model_arg::ModelArgs;

/// Most sequences `coli bench --streams` decodes together (each holds its own KV cache).
const MAX_STREAMS: usize = 256;

/// Arguments of `coli bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens to prefill (synthetic ids).
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens to decode greedily after the prompt.
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// Prefill the prompt in steps of this many tokens, as `coli serve --prefill-chunk` does
    /// (default: the whole prompt in one step).
    #[arg(long, value_name = "TOKENS")]
    pub prefill_chunk: Option<usize>,
    /// Drop the page cache first (needs root), for a cold-start measurement.
    #[arg(long)]
    pub cold: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Re-measure the machine's disk and memory bandwidth instead of using the cached numbers.
    #[arg(long)]
    pub remeasure: bool,
    /// With `--draft ngram|auto`: runs of each draft workload with drafting off and on,
    /// interleaved (medians are reported).
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub draft_reps: usize,
    /// Also decode this many sequences together, one batch per step as `coli serve` runs its
    /// slots (each with its own prompt of `--prompt-tokens`), and report the aggregate decode
    /// rate (as llama.cpp's `llama-batched-bench` does). 0 or 1: off.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub streams: usize,
}

/// What `coli bench` reports.
#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub model: String,
    pub threads: usize,
    pub ram_budget_bytes: Option<u64>,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub cold: bool,
    /// Seconds from the start of the load to a model ready to run (headers, dense weights,
    /// the resident experts).
    pub load_seconds: f64,
    /// Seconds of the prefill and the first sample (the load not included).
    pub ttft_seconds: f64,
    pub prefill_tok_per_s: f64,
    pub decode_tok_per_s: f64,
    pub decode_hit_rate: f64,
    pub decode_byte_hit_rate: f64,
    pub decode_gb_read_per_token: f64,
    pub decode_miss_gb_per_token: f64,
    pub decode_io_wait_seconds_per_token: f64,
    pub prefetch_recall: f64,
    pub prefetch_useful_fraction: f64,
    pub active_gb_per_token: f64,
    pub disk_gb_per_s: f64,
    pub memory_gb_per_s: f64,
    pub disk_bandwidth_fraction: f64,
    /// Disk GB/s ÷ miss GB per token: the decode speed if reading misses were all it did.
    pub disk_roofline_tok_per_s: Option<f64>,
    /// Decode tok/s ÷ the disk roofline.
    pub disk_roofline_fraction: Option<f64>,
    pub memory_bandwidth_fraction: f64,
    pub decode_time: Times,
    /// Seconds of matrix products on the device while decoding (host view) and of its
    /// kernels (device timestamps); 0 on the CPU.
    pub device_product_seconds: f64,
    pub device_kernel_seconds: f64,
    pub prefill_store: Option<StoreSnapshot>,
    pub decode_store: Option<StoreSnapshot>,
    pub loadavg: String,
    /// KV-cache bytes one token adds (f32 values), and what per-head K/V attention of the
    /// same shape would store.
    pub kv_bytes_per_token: usize,
    pub kv_bytes_per_token_full_attention: usize,
    /// Bytes of linear-attention state one sequence keeps, whatever its length.
    pub state_bytes_per_sequence: usize,
    /// With `--draft mtp`: the same decode with drafts from the model's MTP head.
    pub draft: Option<DraftReport>,
    /// With `--draft ngram|auto`: prompt-lookup and grammar drafts through the scheduler, on
    /// workloads whose output copies its context or is forced by a schema.
    pub lookup_drafts: Vec<LookupDraftReport>,
    /// `--streams N`: several sequences decoding in one batch per step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub streams: Option<StreamsReport>,
}

/// Several sequences decoding together (`coli bench --streams N`).
#[derive(Debug, Serialize)]
pub struct StreamsReport {
    /// Sequences in the batch.
    pub streams: usize,
    /// Steps decoded (each gives every sequence one token).
    pub steps: usize,
    /// Seconds prefilling every sequence's prompt (one batch per step).
    pub prefill_seconds: f64,
    /// Tokens of every sequence decoded per second.
    pub aggregate_decode_tok_per_s: f64,
    /// Milliseconds per decode step.
    pub step_ms: f64,
    /// Where the batched decode's forward time went.
    pub decode_time: Times,
    /// The expert store's counters over the batched decode (`None` when fully memory-mapped).
    pub decode_store: Option<StoreSnapshot>,
}

/// One draft workload through the scheduler (one slot, greedy), drafting off and on.
#[derive(Debug, Clone, Serialize)]
pub struct LookupDraftReport {
    /// What the workload is (`code edit`, `json schema`).
    pub workload: String,
    /// `ngram` (draft whenever a source has one) or `auto` (while it pays).
    pub mode: String,
    pub prompt_tokens: usize,
    /// Tokens generated in each run.
    pub gen_tokens: usize,
    pub repetitions: usize,
    /// Median decode speed (tokens after the first, over the time from the first to the last)
    /// without drafts and with them: the net speed, every verification row paid for.
    pub plain_tok_per_s: f64,
    pub draft_tok_per_s: f64,
    /// draft ÷ plain.
    pub speedup: f64,
    /// Per run with drafts: tokens drafted and accepted, by source (`ngram`, `grammar`).
    pub drafted: Vec<(String, u64)>,
    pub accepted: Vec<(String, u64)>,
    /// Accepted ÷ drafted, all sources.
    pub acceptance: f64,
    /// Decode steps of one run without and with drafts.
    pub plain_steps: u64,
    pub draft_steps: u64,
    /// Every run gave the same tokens, drafting off and on (it must).
    pub tokens_identical: bool,
    /// The acceptance at which a drafted row would pay, as the engine measured it at the end
    /// of the last run with drafts (`auto` drafts a source only above it).
    pub break_even: Option<f64>,
    /// /proc/loadavg before and after the runs.
    pub loadavg: String,
}

/// Decode with multi-token-prediction drafts, measured after the plain decode.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DraftReport {
    pub decode_tok_per_s: f64,
    pub acceptance: f64,
    pub drafted: usize,
    pub accepted: usize,
    pub decode_gb_read_per_token: f64,
    pub decode_miss_gb_per_token: f64,
    /// Drafting changed no token (it must not).
    pub tokens_identical: bool,
    /// What `--draft mtp` would keep doing on this machine: drafting pays when it is faster.
    pub pays: bool,
}

/// Run `coli bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    if args.prompt_tokens == 0 {
        anyhow::bail!("--prompt-tokens must be at least 1");
    }
    if args.prefill_chunk == Some(0) {
        anyhow::bail!("--prefill-chunk must be at least 1");
    }
    if args.streams > MAX_STREAMS {
        anyhow::bail!(
            "--streams {} is more sequences than a bench decodes together (at most {MAX_STREAMS}, as many as a server's slots would be)",
            args.streams
        );
    }
    let cold = if args.cold { drop_page_cache() } else { false };
    let machine = crate::machine::bandwidths(args.remeasure)?;
    let load_start = Instant::now();
    let loaded = std::sync::Arc::new(args.model.load(false)?);
    let load_seconds = load_start.elapsed().as_secs_f64();
    let model = loaded.model.as_ref();
    let info = model.info().clone();
    let w = run_workload(
        model,
        &Workload {
            prompt_tokens: args.prompt_tokens,
            gen_tokens: args.gen_tokens,
            prefill_chunk: args.prefill_chunk,
            greedy_tokens: 0,
        },
    )?;
    let (prompt, plain_tokens) = (&w.prompt, &w.tokens);
    let (prefill, ttft, decode) = (w.prefill_seconds, w.ttft_seconds, w.decode_seconds);
    let (s0, s1, s2) = (&w.before, &w.after_prefill, &w.after_decode);
    let decode_time = w.decode_time;
    let draft = match model.drafter() {
        None => None,
        Some(_) => Some(bench_drafts(model, prompt, plain_tokens, args.gen_tokens)?),
    };
    let lookup_drafts = {
        let options = args.model.options()?;
        let config = options.draft_config();
        if config.mode == colibri::runtime::drafts::DraftMode::Off {
            Vec::new()
        } else {
            bench_lookup_drafts(
                &loaded,
                &config,
                crate::engine_options::value_name(&options.draft),
                args.gen_tokens,
                args.draft_reps.max(1),
            )?
        }
    };
    let streams = if args.streams > 1 {
        Some(run_streams(
            model,
            args.streams,
            args.prompt_tokens,
            args.gen_tokens.max(1),
            args.prefill_chunk,
        )?)
    } else {
        None
    };
    model.flush().context("saving the expert usage history")?;

    let n = args.gen_tokens.max(1) as f64;
    let prefill_store = match (s1, s0) {
        (Some(b), Some(a)) => Some(b.since(a)),
        _ => None,
    };
    let decode_store = match (s2, s1) {
        (Some(b), Some(a)) => Some(b.since(a)),
        _ => None,
    };
    let decode_tok_per_s = if args.gen_tokens > 0 {
        args.gen_tokens as f64 / decode
    } else {
        0.0
    };
    let gb_read = decode_store
        .as_ref()
        .map_or(0.0, |s| s.bytes_read as f64 / 1e9 / n);
    let miss_gb = decode_store
        .as_ref()
        .map_or(0.0, |s| s.miss_bytes as f64 / 1e9 / n);
    let roofline = (miss_gb > 0.0).then(|| machine.disk_gb_per_s / miss_gb);
    let active_gb = active_bytes(&info) as f64 / 1e9;
    let report = BenchReport {
        model: loaded.dir.display().to_string(),
        threads: colibri::tensor::threads::current(),
        ram_budget_bytes: args.model.options()?.ram_budget(None),
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        cold,
        load_seconds,
        ttft_seconds: ttft,
        prefill_tok_per_s: args.prompt_tokens as f64 / prefill,
        decode_tok_per_s,
        device_product_seconds: decode_store
            .as_ref()
            .map_or(0.0, |s| s.device_product_seconds),
        device_kernel_seconds: decode_store
            .as_ref()
            .map_or(0.0, |s| s.device_kernel_seconds),
        decode_hit_rate: decode_store.as_ref().map_or(1.0, |s| s.hit_rate()),
        decode_byte_hit_rate: decode_store.as_ref().map_or(1.0, |s| s.byte_hit_rate()),
        decode_gb_read_per_token: gb_read,
        decode_miss_gb_per_token: miss_gb,
        decode_io_wait_seconds_per_token: decode_store
            .as_ref()
            .map_or(0.0, |s| s.io_wait_seconds / n),
        prefetch_recall: decode_store.as_ref().map_or(0.0, |s| s.prefetch_recall()),
        prefetch_useful_fraction: decode_store.as_ref().map_or(0.0, |s| {
            if s.prefetch_bytes == 0 {
                0.0
            } else {
                s.prefetch_useful_bytes as f64 / s.prefetch_bytes as f64
            }
        }),
        active_gb_per_token: active_gb,
        disk_gb_per_s: machine.disk_gb_per_s,
        memory_gb_per_s: machine.memory_gb_per_s,
        disk_bandwidth_fraction: gb_read * decode_tok_per_s / machine.disk_gb_per_s,
        disk_roofline_tok_per_s: roofline,
        disk_roofline_fraction: roofline.map(|r| decode_tok_per_s / r),
        memory_bandwidth_fraction: active_gb * decode_tok_per_s / machine.memory_gb_per_s,
        decode_time,
        prefill_store,
        decode_store,
        loadavg: std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
            .to_string(),
        kv_bytes_per_token: info.kv_bytes_per_token,
        kv_bytes_per_token_full_attention: info.kv_bytes_per_token_full,
        state_bytes_per_sequence: info.state_bytes_per_sequence,
        draft: draft.map(|mut d| {
            d.pays = d.decode_tok_per_s > decode_tok_per_s;
            d
        }),
        lookup_drafts,
        streams,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_text(&report, &machine);
    }
    Ok(())
}

/// What one bench run does: a synthetic prompt prefilled (in chunks, as the server
/// prefills), then tokens decoded one at a time.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Prompt tokens (synthetic ids), at least 1.
    pub prompt_tokens: usize,
    /// Tokens decoded after the prompt (timed), sampled at temperature 1 with a fixed seed.
    pub gen_tokens: usize,
    /// Prompt tokens per prefill step; `None`: the whole prompt in one step.
    pub prefill_chunk: Option<usize>,
    /// Tokens decoded greedily after the timed ones (not timed), for comparing runs.
    pub greedy_tokens: usize,
}

/// What [`run_workload`] measured and produced.
#[derive(Debug, Clone)]
pub struct WorkloadRun {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Seconds of the prefill, and of the prefill plus the first sample.
    pub prefill_seconds: f64,
    pub ttft_seconds: f64,
    /// Seconds of the timed decode.
    pub decode_seconds: f64,
    /// Where the decode's forward time went.
    pub decode_time: Times,
    /// The expert store's counters before the prefill, after it and after the decode.
    pub before: Option<StoreSnapshot>,
    pub after_prefill: Option<StoreSnapshot>,
    pub after_decode: Option<StoreSnapshot>,
    /// The sampled tokens: the first (from the prefill) and one per decode step.
    pub tokens: Vec<u32>,
    /// The greedy tokens decoded after them.
    pub greedy: Vec<u32>,
    /// A hash of the bits of every logits row computed (prefill, decode and greedy steps):
    /// equal only if every row is bit-identical (compared within one process).
    pub logits_hash: u64,
}

/// Run `w` on `model` (a fresh cache), timing the prefill and the decode.
pub fn run_workload(model: &dyn colibri::model::CausalLm, w: &Workload) -> Result<WorkloadRun> {
    use std::hash::{Hash, Hasher};
    let vocab = model.info().vocab_size as u64;
    let prompt: Vec<u32> = (0..w.prompt_tokens as u64)
        .map(|i| ((i * 7919 + 13) % vocab.max(1)) as u32)
        .collect();
    let mut cache = model.new_cache(w.prompt_tokens + w.gen_tokens + w.greedy_tokens + 1);
    let mut digest = std::hash::DefaultHasher::new();
    let mut digest_row = |row: &[f32]| {
        for v in row {
            v.to_bits().hash(&mut digest);
        }
    };

    let before = model.store_stats();
    let t0 = Instant::now();
    let chunk = w.prefill_chunk.unwrap_or(prompt.len()).max(1);
    let mut logits = Vec::new();
    for (i, part) in prompt.chunks(chunk).enumerate() {
        let last = (i + 1) * chunk >= prompt.len();
        let which = if last { Logits::Last } else { Logits::None };
        logits = model.forward(part, &mut cache, which)?;
    }
    let prefill_seconds = t0.elapsed().as_secs_f64();
    let after_prefill = model.store_stats();
    digest_row(&logits);
    // Decode samples (temperature 1, fixed seed) rather than taking the argmax: a random-weight
    // model's greedy text repeats one token, which would make routing (and the cache) look
    // far kinder than real text does. The cost of a step does not depend on the token.
    let mut sampler = Sampler::new(SamplingParams {
        seed: 7,
        ..SamplingParams::default()
    });
    let mut history = prompt.clone();
    let mut next = sampler.sample(&logits, &history);
    let ttft_seconds = t0.elapsed().as_secs_f64();
    let mut tokens = vec![next];

    let times0 = Times::now();
    let t1 = Instant::now();
    for _ in 0..w.gen_tokens {
        history.push(next);
        let l = model.forward(&[next], &mut cache, Logits::Last)?;
        digest_row(&l);
        next = sampler.sample(&l, &history);
        tokens.push(next);
    }
    let decode_seconds = t1.elapsed().as_secs_f64();
    let decode_time = Times::now().since(&times0);
    let after_decode = model.store_stats();

    let mut greedy = Vec::with_capacity(w.greedy_tokens);
    for _ in 0..w.greedy_tokens {
        let l = model.forward(&[next], &mut cache, Logits::Last)?;
        digest_row(&l);
        next = argmax(&l);
        greedy.push(next);
    }
    Ok(WorkloadRun {
        prompt,
        prefill_seconds,
        ttft_seconds,
        decode_seconds,
        decode_time,
        before,
        after_prefill,
        after_decode,
        tokens,
        greedy,
        logits_hash: digest.finish(),
    })
}

/// `streams` sequences, each with its own synthetic prompt of `prompt_tokens`, prefilled
/// together (chunks of `prefill_chunk`) and then decoded `gen_tokens` steps together, every
/// step one batch of one row per sequence: what `coli serve` runs with that many busy slots.
pub fn run_streams(
    model: &dyn colibri::model::CausalLm,
    streams: usize,
    prompt_tokens: usize,
    gen_tokens: usize,
    prefill_chunk: Option<usize>,
) -> Result<StreamsReport> {
    use colibri::model::BatchItem;
    let vocab = model.info().vocab_size.max(1) as u64;
    let prompts: Vec<Vec<u32>> = (0..streams as u64)
        .map(|s| {
            (0..prompt_tokens as u64)
                .map(|i| ((i * 7919 + s * 104_729 + 13) % vocab) as u32)
                .collect()
        })
        .collect();
    let mut caches: Vec<_> = (0..streams)
        .map(|_| model.new_cache(prompt_tokens + gen_tokens + 1))
        .collect();
    let chunk = prefill_chunk.unwrap_or(prompt_tokens).max(1);
    let t0 = Instant::now();
    let mut last = Vec::new();
    for start in (0..prompt_tokens).step_by(chunk) {
        let end = (start + chunk).min(prompt_tokens);
        let which = if end == prompt_tokens {
            Logits::Last
        } else {
            Logits::None
        };
        let mut items: Vec<BatchItem<'_>> = caches
            .iter_mut()
            .zip(&prompts)
            .map(|(cache, p)| BatchItem {
                tokens: &p[start..end],
                cache,
                logits: which,
            })
            .collect();
        last = model.forward_batch(&mut items)?;
    }
    let prefill_seconds = t0.elapsed().as_secs_f64();
    // Each sequence samples with its own seed (temperature 1), as a server's requests do.
    let mut samplers: Vec<Sampler> = (0..streams as u64)
        .map(|s| {
            Sampler::new(SamplingParams {
                seed: 7 + s,
                ..SamplingParams::default()
            })
        })
        .collect();
    let mut histories = prompts;
    let mut next: Vec<u32> = samplers
        .iter_mut()
        .zip(&last)
        .zip(&histories)
        .map(|((s, l), h)| s.sample(l, h))
        .collect();
    let store0 = model.store_stats();
    let times0 = Times::now();
    let t1 = Instant::now();
    for _ in 0..gen_tokens {
        let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut items: Vec<BatchItem<'_>> = caches
            .iter_mut()
            .zip(&tokens)
            .map(|(cache, t)| BatchItem {
                tokens: t,
                cache,
                logits: Logits::Last,
            })
            .collect();
        let logits = model.forward_batch(&mut items)?;
        for (i, l) in logits.iter().enumerate() {
            histories[i].push(next[i]);
            next[i] = samplers[i].sample(l, &histories[i]);
        }
    }
    let decode_seconds = t1.elapsed().as_secs_f64();
    let decode_time = Times::now().since(&times0);
    let decode_store = match (model.store_stats(), store0) {
        (Some(b), Some(a)) => Some(b.since(&a)),
        _ => None,
    };
    Ok(StreamsReport {
        streams,
        steps: gen_tokens,
        prefill_seconds,
        aggregate_decode_tok_per_s: (streams * gen_tokens) as f64 / decode_seconds,
        step_ms: 1e3 * decode_seconds / gen_tokens as f64,
        decode_time,
        decode_store,
    })
}

/// The index of the largest logit (the first of equal ones).
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// A size the report keeps in (decimal) GB, printed like every other size.
fn gb_size(gb: f64) -> String {
    format_size((gb * 1e9).round() as u64)
}

fn print_text(r: &BenchReport, m: &crate::machine::Bandwidths) {
    println!("model:    {}", r.model);
    println!(
        "prefill:  {} tokens in {:.2} s = {:.1} tok/s (TTFT {:.2} s)",
        r.prompt_tokens,
        r.prompt_tokens as f64 / r.prefill_tok_per_s,
        r.prefill_tok_per_s,
        r.ttft_seconds
    );
    println!(
        "decode:   {} tokens, {:.2} tok/s",
        r.gen_tokens, r.decode_tok_per_s
    );
    if let Some(s) = &r.decode_store {
        println!(
            "experts:  hit rate {:.1} % ({:.1} % of bytes), {} missed and {} read per token, {:.1} ms I/O wait per token, prefetch recall {:.0} % (useful {:.0} % of prefetched bytes)",
            100.0 * r.decode_hit_rate,
            100.0 * r.decode_byte_hit_rate,
            gb_size(r.decode_miss_gb_per_token),
            gb_size(r.decode_gb_read_per_token),
            1e3 * r.decode_io_wait_seconds_per_token,
            100.0 * r.prefetch_recall,
            100.0 * r.prefetch_useful_fraction,
        );
        println!(
            "cache:    {} capacity, {} used, {} pinned; reader: {}",
            format_size(s.cache_capacity),
            format_size(s.cache_used),
            format_size(s.pinned_bytes),
            s.reader
        );
        if !s.device.is_empty() {
            println!(
                "device:   {}: {} in VRAM ({} dense, {} experts: {} of them), decode VRAM hits {} of {} experts; decode products {:.2} s ({:.2} s in kernels)",
                s.device,
                format_size(s.device_bytes),
                format_size(s.device_bytes.saturating_sub(s.vram_bytes)),
                format_size(s.vram_bytes),
                s.vram_experts,
                s.vram_hits,
                s.hits + s.misses,
                r.device_product_seconds,
                r.device_kernel_seconds,
            );
        }
        if let Some(drives) = drive_bytes_text(s) {
            println!("drives:   {drives}");
        }
    }
    let t = &r.decode_time;
    println!(
        "time:     attention {:.2} s, recurrent layers {:.2} s, experts {:.2} s, dense MLP {:.2} s, LM head {:.2} s (decode)",
        t.attention, t.recurrent, t.experts, t.dense_mlp, t.lm_head
    );
    println!(
        "machine:  disk {:.2} GB/s ({}), memory {:.1} GB/s: decode reads at {:.0} % of disk bandwidth{} and streams {:.0} % of memory bandwidth ({} active weights per token)",
        m.disk_gb_per_s,
        m.disk_source,
        m.memory_gb_per_s,
        100.0 * r.disk_bandwidth_fraction,
        match (r.disk_roofline_tok_per_s, r.disk_roofline_fraction) {
            (Some(x), Some(f)) => format!(", {:.0} % of the disk roofline ({x:.2} tok/s)", 100.0 * f),
            _ => String::new(),
        },
        100.0 * r.memory_bandwidth_fraction,
        gb_size(r.active_gb_per_token)
    );
    println!(
        "kv cache: {} bytes per token ({} with per-head K/V: {:.1}× smaller){}",
        r.kv_bytes_per_token,
        r.kv_bytes_per_token_full_attention,
        r.kv_bytes_per_token_full_attention as f64 / r.kv_bytes_per_token.max(1) as f64,
        if r.state_bytes_per_sequence > 0 {
            format!(
                "; recurrent state {} bytes per sequence (constant in context)",
                r.state_bytes_per_sequence
            )
        } else {
            String::new()
        }
    );
    if let Some(b) = &r.streams {
        let t = &b.decode_time;
        println!(
            "streams:  {} sequences decoding together: {:.2} tok/s in all, {:.1} ms per step ({} steps; prompts prefilled in {:.2} s); attention {:.2} s, experts {:.2} s, dense MLP {:.2} s, LM head {:.2} s",
            b.streams,
            b.aggregate_decode_tok_per_s,
            b.step_ms,
            b.steps,
            b.prefill_seconds,
            t.attention,
            t.experts,
            t.dense_mlp,
            t.lm_head
        );
    }
    if let Some(d) = &r.draft {
        println!(
            "mtp:      {:.2} tok/s with drafts vs {:.2} without ({} drafted, {:.0} % accepted, {} read per token); tokens identical: {}; drafting {}",
            d.decode_tok_per_s,
            r.decode_tok_per_s,
            d.drafted,
            100.0 * d.acceptance,
            gb_size(d.decode_gb_read_per_token),
            d.tokens_identical,
            if d.pays { "pays here" } else { "does not pay here (--draft mtp turns itself off)" }
        );
    }
    for d in &r.lookup_drafts {
        let by_source: Vec<String> = d
            .drafted
            .iter()
            .zip(&d.accepted)
            .filter(|((_, n), _)| *n > 0)
            .map(|((s, n), (_, a))| format!("{s} {a}/{n}"))
            .collect();
        println!(
            "drafts:   {} ({}, {} prompt + {} generated tokens, median of {}): {:.2} tok/s with drafts vs {:.2} without = {:.2}×; {:.0} % of drafted tokens accepted ({}); {} decode steps instead of {}; a drafted row pays above {} acceptance here; tokens identical: {}",
            d.workload,
            d.mode,
            d.prompt_tokens,
            d.gen_tokens,
            d.repetitions,
            d.draft_tok_per_s,
            d.plain_tok_per_s,
            d.speedup,
            100.0 * d.acceptance,
            if by_source.is_empty() { "nothing drafted".to_string() } else { by_source.join(", ") },
            d.draft_steps,
            d.plain_steps,
            d.break_even
                .map_or("(not measured)".to_string(), |b| format!("{:.0} %", 100.0 * b)),
            d.tokens_identical,
        );
    }
    println!("loadavg:  {}", r.loadavg);
}

/// The bytes each drive served (`/models/m: 1.2 GiB, /mirror/m: 0.9 GiB`), when mirrors
/// spread the reads.
pub fn drive_bytes_text(s: &StoreSnapshot) -> Option<String> {
    let parts: Vec<String> = s
        .drives
        .iter()
        .map(|(d, b)| format!("{d}: {}", format_size(*b)))
        .collect();
    (!parts.is_empty()).then(|| parts.join(", "))
}

/// The code-edit workload: a function the answer copies with one change (a docstring).
const CODE_EDIT_PROMPT: &str = "Add a docstring to this function. Reply with the complete function.

```python
def parse_config(path):
    settings = {}
    with open(path, encoding=\"utf-8\") as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if line.startswith(\"#\"):
                continue
            key, value = line.split(\"=\", 1)
            settings[key.strip()] = value.strip()
    return settings
```";

/// The JSON workload: a schema whose keys the grammar forces.
const JSON_PROMPT: &str = "Describe a fictional city as JSON with its name, country, population, founding year, mayor, twin cities and whether it is a capital.";

fn json_workload_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "properties": {
            "city_name": {"type": "string", "maxLength": 24},
            "country_name": {"type": "string", "maxLength": 24},
            "population_estimate": {"type": "integer"},
            "founding_year": {"type": "integer"},
            "mayor_full_name": {"type": "string", "maxLength": 32},
            "twin_cities": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
            "is_national_capital": {"type": "boolean"}
        },
        "required": ["city_name", "country_name", "population_estimate", "founding_year",
                     "mayor_full_name", "twin_cities", "is_national_capital"],
        "additionalProperties": false
    })
}

/// Prompt-lookup and grammar drafts through the scheduler: each workload greedy on one slot,
/// `reps` times with drafting off and on (alternating which goes first), compared.
fn bench_lookup_drafts(
    loaded: &std::sync::Arc<colibri::runtime::loaded::LoadedModel>,
    config: &colibri::runtime::drafts::DraftConfig,
    mode: String,
    gen_tokens: usize,
    reps: usize,
) -> Result<Vec<LookupDraftReport>> {
    use colibri::runtime::drafts::{DraftConfig, DraftSource};
    use colibri::runtime::grammar::{Grammar, GrammarVocab};
    use colibri::runtime::scheduler::{Event, Request, Scheduler, SchedulerConfig};
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    let Some(tok) = loaded.tokenizer.as_ref() else {
        eprintln!("coli bench: the draft workloads need the model's tokenizer; skipped");
        return Ok(Vec::new());
    };
    let encode = |text: &str| -> Result<Vec<u32>> {
        let text = match &loaded.chat_template {
            Some(t) => t.render(
                &[serde_json::json!({"role": "user", "content": text})],
                true,
                None,
                None,
            )?,
            None => text.to_string(),
        };
        Ok(tok.encode(&text, loaded.chat_template.is_none())?)
    };
    let vocab = GrammarVocab::new(tok.inner(), &loaded.eos_token_ids).ok();
    let workloads: Vec<(&str, Vec<u32>, Option<Grammar>)> = vec![
        ("code edit", encode(CODE_EDIT_PROMPT)?, None),
        (
            "json schema",
            encode(JSON_PROMPT)?,
            Some(Grammar::JsonSchema {
                schema: json_workload_schema(),
                strict: true,
            }),
        ),
    ];
    let mut reports = Vec::new();
    for (name, prompt, grammar) in workloads {
        if grammar.is_some() && vocab.is_none() {
            eprintln!("coli bench: {name}: no grammar vocabulary for this tokenizer; skipped");
            continue;
        }
        let loadavg_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        // One run: tokens, decode tok/s, decode steps, drafted and accepted per source, the
        // measured break-even acceptance.
        type RunResult = (Vec<u32>, f64, u64, [(u64, u64); 2], Option<f64>);
        let run = |drafts: DraftConfig| -> Result<RunResult> {
            let scheduler = Scheduler::start(
                loaded.clone(),
                SchedulerConfig {
                    slots: 1,
                    context: prompt.len() + gen_tokens + 1,
                    prefill_chunk: 256,
                    prefill_budget: None,
                    queue_limit: 1,
                    queue_timeout: Duration::from_secs(600),
                    persist_dir: None,
                    history_save_interval: Duration::from_secs(3600),
                    drafts,
                },
            );
            let constraint = match (&grammar, &vocab) {
                (Some(g), Some(v)) => Some(v.constraint(g).map_err(|e| anyhow::anyhow!("{e}"))?),
                _ => None,
            };
            let (tx, rx) = std::sync::mpsc::channel();
            scheduler
                .submit(Request {
                    prompt: prompt.clone(),
                    max_tokens: gen_tokens,
                    // Generate the full count (or until the schema is complete).
                    eos_token_ids: if constraint.is_some() {
                        loaded.eos_token_ids.clone()
                    } else {
                        vec![]
                    },
                    stop_strings: vec![],
                    sampling: SamplingParams::greedy(),
                    logprobs: None,
                    constraint,
                    sink: Box::new(tx),
                })
                .map_err(|e| anyhow::anyhow!("submitting the draft workload: {e:?}"))?;
            let mut tokens = Vec::new();
            let usage = loop {
                match rx.recv() {
                    Ok(Event::Token { id, .. }) => tokens.push(id),
                    Ok(Event::Done(u)) => break u,
                    Ok(Event::Failed(f)) => anyhow::bail!("{name}: {f}"),
                    Ok(Event::Admitted { .. }) => {}
                    Err(_) => anyhow::bail!("{name}: the scheduler stopped"),
                }
            };
            let stats = scheduler.stats();
            let prefill_steps = prompt.len().div_ceil(256) as u64;
            let steps = stats.steps.load(Ordering::Relaxed) - prefill_steps;
            let per_source = DraftSource::ALL.map(|s| stats.drafts(s));
            let rate = tokens.len().saturating_sub(1) as f64 / usage.decode_seconds.max(1e-9);
            let break_even = *stats
                .draft_break_even
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            Ok((tokens, rate, steps, per_source, break_even))
        };
        let mut plain = Vec::new();
        let mut drafted = Vec::new();
        let mut identical = true;
        let mut reference: Option<Vec<u32>> = None;
        let mut last = (0, 0, [(0, 0); 2], None);
        for rep in 0..reps {
            for on in [rep % 2 == 1, rep % 2 == 0] {
                let (tokens, rate, steps, per_source, break_even) = run(if on {
                    config.clone()
                } else {
                    DraftConfig::off()
                })?;
                match &reference {
                    Some(r) => identical &= *r == tokens,
                    None => reference = Some(tokens),
                }
                if on {
                    drafted.push(rate);
                    last.1 = steps;
                    last.2 = per_source;
                    last.3 = break_even;
                } else {
                    plain.push(rate);
                    last.0 = steps;
                }
            }
        }
        let (plain_steps, draft_steps, per_source, break_even) = last;
        let total_drafted: u64 = per_source.iter().map(|p| p.0).sum();
        let total_accepted: u64 = per_source.iter().map(|p| p.1).sum();
        let plain_rate = median(&mut plain);
        let draft_rate = median(&mut drafted);
        reports.push(LookupDraftReport {
            workload: name.to_string(),
            mode: mode.clone(),
            prompt_tokens: prompt.len(),
            gen_tokens: reference.as_ref().map_or(0, |r| r.len()),
            repetitions: reps,
            plain_tok_per_s: plain_rate,
            draft_tok_per_s: draft_rate,
            speedup: draft_rate / plain_rate.max(1e-9),
            drafted: DraftSource::ALL
                .iter()
                .map(|s| (s.name().to_string(), per_source[*s as usize].0))
                .collect(),
            accepted: DraftSource::ALL
                .iter()
                .map(|s| (s.name().to_string(), per_source[*s as usize].1))
                .collect(),
            acceptance: total_accepted as f64 / total_drafted.max(1) as f64,
            plain_steps,
            draft_steps,
            tokens_identical: identical,
            break_even,
            loadavg: format!(
                "{} → {}",
                loadavg_before.trim(),
                std::fs::read_to_string("/proc/loadavg")
                    .unwrap_or_default()
                    .trim()
            ),
        });
    }
    Ok(reports)
}

/// The median of `v` (0 when empty).
fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Decode the same prompt again, drafting at every step, and compare.
fn bench_drafts(
    model: &dyn colibri::model::CausalLm,
    prompt: &[u32],
    plain_tokens: &[u32],
    gen_tokens: usize,
) -> Result<DraftReport> {
    use colibri::runtime::generate::GenerateParams;
    use colibri::runtime::speculative::{generate_with_drafts, DraftPolicy};
    let params = GenerateParams {
        max_tokens: gen_tokens + 1,
        eos_token_ids: vec![],
        stop_strings: vec![],
        sampling: SamplingParams {
            seed: 7,
            ..SamplingParams::default()
        },
    };
    let s0 = model.store_stats();
    let mut prefill_stats = None;
    let (g, stats) = generate_with_drafts(
        model,
        None,
        prompt,
        &params,
        DraftPolicy::Always,
        |_| {},
        |_| {
            if prefill_stats.is_none() {
                prefill_stats = Some(model.store_stats());
            }
        },
    )?;
    let s1 = model.store_stats();
    let n = gen_tokens.max(1) as f64;
    let store = match (s1, prefill_stats.flatten().or(s0)) {
        (Some(b), Some(a)) => Some(b.since(&a)),
        _ => None,
    };
    Ok(DraftReport {
        decode_tok_per_s: g.decode_tok_per_s(),
        acceptance: stats.acceptance(),
        drafted: stats.drafted,
        accepted: stats.accepted,
        decode_gb_read_per_token: store
            .as_ref()
            .map_or(0.0, |s| s.bytes_read as f64 / 1e9 / n),
        decode_miss_gb_per_token: store
            .as_ref()
            .map_or(0.0, |s| s.miss_bytes as f64 / 1e9 / n),
        tokens_identical: g.tokens == plain_tokens,
        pays: false,
    })
}

/// Weight bytes one decode token touches: the dense weights plus the active experts.
fn active_bytes(i: &colibri::model::ModelInfo) -> u64 {
    let per_expert = i
        .routed_expert_bytes
        .checked_div(i.moe_layers * i.routed_experts)
        .unwrap_or(0);
    (i.dense_bytes + per_expert * i.active_experts * i.moe_layers) as u64
}

fn drop_page_cache() -> bool {
    // Write back dirty pages, then ask the kernel to drop clean caches (root only).
    let _ = std::process::Command::new("sync").status();
    match std::fs::write("/proc/sys/vm/drop_caches", "3") {
        Ok(()) => true,
        Err(e) => {
            eprintln!("coli: --cold: cannot drop the page cache ({e}); measuring warm");
            false
        }
    }
}
