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
    let cold = if args.cold { drop_page_cache() } else { false };
    let machine = crate::machine::bandwidths(args.remeasure)?;
    let load_start = Instant::now();
    let loaded = args.model.load(false)?;
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
