//! `coli tune`: measure this machine's fastest engine settings for a model and keep them as a
//! named profile of the configuration file, which `coli serve --profile NAME` (or
//! `COLI_PROFILE=NAME`) then applies.
//!
//! The settings tried are the ones that change speed and never tokens: compute threads, the
//! expert reader (io-uring or the pread pool), direct I/O, prefetch, the pin budget and the
//! prefill chunk. Starting from the configuration `coli serve` would use (the file's top level,
//! the `COLI_*` variables and the flags given), one setting at a time is varied over a small
//! grid and the best value kept before the next (coordinate descent: about a dozen runs,
//! not the hundreds of the full product). Each run loads the model afresh with the setting
//! and runs `coli bench`'s workload in-process ([`crate::bench::run_workload`]): a prompt
//! prefilled in chunks, tokens decoded, then a few greedy tokens. Every run starts from the
//! same usage history (a copy, so runs neither learn from each other nor touch the real one),
//! after one warm-up run that is not counted.
//!
//! Output is identical whatever the setting — by design; it is checked here: every run's
//! sampled and greedy tokens and the bits of every logits row must equal the warm-up's, and a
//! difference is an error (a bug), reported instead of writing anything.
//!
//! The profile is written into the file atomically, keeping the rest of it (comments and
//! formatting included); an existing profile of that name is only replaced with `--force`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use colibri::runtime::loaded::LoadedModel;
use colibri::store::budget::format_size;
use colibri::store::reader::ReaderKind;

use crate::bench::{run_workload, Workload};
use crate::config::ServeFlags;
use crate::engine_options::{value_name, EngineFlags, EngineOptions, Size};

/// Arguments of `coli tune`.
#[derive(clap::Args, Debug)]
pub struct TuneArgs {
    /// Model directory or .gguf file, or `demo` [default: the configuration's `model`].
    #[arg(long, short = 'm', value_name = "MODEL")]
    pub model: Option<String>,
    /// The configuration file read for the starting point and written with the profile
    /// (created if missing) [default: ./colibri.toml; env: COLI_CONFIG].
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Name of the profile to write (`[profiles.NAME]`).
    #[arg(long, value_name = "NAME", default_value = "tuned")]
    pub profile: String,
    /// Replace an existing profile of that name.
    #[arg(long)]
    pub force: bool,
    /// Measure and print the table, but write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Seconds to spend measuring at most: no run starts that would likely end past it; the
    /// best setting measured so far is kept.
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub time_budget_secs: u64,
    /// Runs of each setting (interleaved); the medians are compared.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub repeats: usize,
    /// Prompt tokens of each run.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Tokens decoded (timed) in each run.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub gen_tokens: usize,
    /// Greedy tokens decoded after them (not timed), compared across settings.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub check_tokens: usize,
    /// Compute threads to try, comma-separated [default: half, three quarters and all
    /// cores].
    #[arg(long, value_delimiter = ',', value_name = "N,...")]
    pub try_threads: Vec<usize>,
    /// Expert readers to try [default: uring,pool].
    #[arg(long, value_enum, value_delimiter = ',', value_name = "READER,...")]
    pub try_io: Vec<ReaderKind>,
    /// Direct I/O settings to try [default: false,true].
    #[arg(long, value_delimiter = ',', value_name = "BOOL,...")]
    pub try_direct_io: Vec<bool>,
    /// Prefetch settings to try [default: true,false].
    #[arg(long, value_delimiter = ',', value_name = "BOOL,...")]
    pub try_prefetch: Vec<bool>,
    /// Pin budgets to try [default: 0, a quarter, half and three quarters of the cache,
    /// when a usage history pins anything].
    #[arg(long, value_delimiter = ',', value_name = "SIZE,...")]
    pub try_pin_budget: Vec<Size>,
    /// Prefill chunks to try [default: 64,128,256,512 up to --prompt-tokens].
    #[arg(long, value_delimiter = ',', value_name = "TOKENS,...")]
    pub try_prefill_chunk: Vec<usize>,
    /// The starting engine options (as for `coli serve`; they override the file and the
    /// environment, and the options not tuned are kept as they are).
    #[command(flatten)]
    pub engine: EngineFlags,
}

/// A candidate improves on the best so far only when it is at least this much faster, so
/// that noise does not move the configuration away from what was set.
const MIN_GAIN: f64 = 0.02;

/// One point of the grid: the values of the tuned keys (public for [`write_profile`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    pub threads: usize,
    pub io: ReaderKind,
    pub direct_io: bool,
    pub prefetch: bool,
    /// `None`: the default (half of the cache).
    pub pin_budget: Option<Size>,
    pub prefill_chunk: usize,
}

impl Setting {
    /// The engine options of `base` with this setting's values.
    fn apply(&self, base: &EngineOptions) -> EngineOptions {
        EngineOptions {
            threads: self.threads,
            io: self.io,
            direct_io: self.direct_io,
            no_prefetch: !self.prefetch,
            pin_budget: self.pin_budget.clone(),
            ..base.clone()
        }
    }

    fn pin_text(&self) -> String {
        self.pin_budget
            .as_ref()
            .map_or_else(|| "half".to_string(), |s| s.to_string())
    }
}

/// The tuned keys, in the order they are tuned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Axis {
    Threads,
    Io,
    DirectIo,
    Prefetch,
    PinBudget,
    PrefillChunk,
}

impl Axis {
    const ALL: [Axis; 6] = [
        Axis::Threads,
        Axis::Io,
        Axis::DirectIo,
        Axis::Prefetch,
        Axis::PinBudget,
        Axis::PrefillChunk,
    ];

    /// The configuration key.
    fn key(self) -> &'static str {
        match self {
            Axis::Threads => "threads",
            Axis::Io => "io",
            Axis::DirectIo => "direct_io",
            Axis::Prefetch => "no_prefetch",
            Axis::PinBudget => "pin_budget",
            Axis::PrefillChunk => "prefill_chunk",
        }
    }
}

/// One timed run.
#[derive(Debug, Clone)]
struct Sample {
    prefill_tok_per_s: f64,
    decode_tok_per_s: f64,
    /// Prefill plus decode seconds: what is compared.
    seconds: f64,
    /// Seconds of the whole run, the load included (for the time budget).
    wall: f64,
    tokens: Vec<u32>,
    greedy: Vec<u32>,
    logits_hash: u64,
    reader: String,
    cache_capacity: u64,
    pinned_bytes: u64,
}

/// A setting and its runs.
#[derive(Debug, Clone)]
struct Row {
    setting: Setting,
    samples: Vec<Sample>,
    error: Option<String>,
}

impl Row {
    fn median(&self, f: impl Fn(&Sample) -> f64) -> Option<f64> {
        let mut v: Vec<f64> = self.samples.iter().map(f).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(if v.len() % 2 == 1 {
            v[v.len() / 2]
        } else {
            (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
        })
    }

    fn seconds(&self) -> Option<f64> {
        self.median(|s| s.seconds)
    }
}

/// What every run shares.
struct Bench<'a> {
    dir: PathBuf,
    base: EngineOptions,
    default_budget: Option<u64>,
    state: &'a StateCopy,
    workload: Workload,
    started: Instant,
    budget_secs: f64,
    /// Every run's (tokens, greedy tokens, logits hash) must equal this (the warm-up's).
    reference: Option<(Vec<u32>, Vec<u32>, u64)>,
    mismatches: Vec<String>,
    runs: usize,
}

impl Bench<'_> {
    /// Load the model with `s` and run the workload on `s.threads` threads.
    fn measure(&mut self, s: &Setting) -> Result<Sample> {
        let opts = s.apply(&self.base);
        let mut load = opts.load_options(&self.dir, self.default_budget);
        load.placement.state_dir = self.state.dir.clone();
        let workload = Workload {
            prefill_chunk: Some(s.prefill_chunk),
            ..self.workload.clone()
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(s.threads)
            .thread_name(|i| format!("coli-tune-{i}"))
            .build()
            .context("starting the compute threads")?;
        let dir = self.dir.clone();
        let t0 = Instant::now();
        let sample = pool.install(move || -> Result<Sample> {
            let loaded = LoadedModel::open_with(&dir, false, &load)
                .with_context(|| format!("cannot load the model in {}", dir.display()))?;
            let model = loaded.model.as_ref();
            let run = run_workload(model, &workload)?;
            let stats = model.store_stats();
            Ok(Sample {
                prefill_tok_per_s: workload.prompt_tokens as f64 / run.prefill_seconds,
                decode_tok_per_s: workload.gen_tokens as f64 / run.decode_seconds.max(1e-9),
                seconds: run.prefill_seconds + run.decode_seconds,
                wall: 0.0,
                tokens: run.tokens,
                greedy: run.greedy,
                logits_hash: run.logits_hash,
                reader: stats
                    .as_ref()
                    .map_or_else(String::new, |s| s.reader.clone()),
                cache_capacity: stats.as_ref().map_or(0, |s| s.cache_capacity),
                pinned_bytes: stats.as_ref().map_or(0, |s| s.pinned_bytes),
            })
        });
        let mut sample = sample?;
        sample.wall = t0.elapsed().as_secs_f64();
        self.runs += 1;
        let got = (
            sample.tokens.clone(),
            sample.greedy.clone(),
            sample.logits_hash,
        );
        match &self.reference {
            None => self.reference = Some(got),
            Some(r) if *r == got => {}
            Some(r) => self.mismatches.push(if r.0 != got.0 || r.1 != got.1 {
                format!(
                    "{}: tokens {:?} then greedy {:?}, expected {:?} then {:?}",
                    describe(s),
                    got.0,
                    got.1,
                    r.0,
                    r.1
                )
            } else {
                format!(
                    "{}: the same tokens, but logits whose bits differ",
                    describe(s)
                )
            }),
        }
        Ok(sample)
    }

    /// Seconds left of the time budget.
    fn left(&self) -> f64 {
        self.budget_secs - self.started.elapsed().as_secs_f64()
    }
}

/// A setting in one line (`threads=2 io=pool ...`).
fn describe(s: &Setting) -> String {
    format!(
        "threads={} io={} direct_io={} prefetch={} pin_budget={} prefill_chunk={}",
        s.threads,
        value_name(&s.io),
        s.direct_io,
        if s.prefetch { "on" } else { "off" },
        s.pin_text(),
        s.prefill_chunk
    )
}

/// The copy of the model's usage history every run starts from, in a private state directory
/// (removed when dropped); `dir` is `None` when runs do not learn.
struct StateCopy {
    dir: Option<PathBuf>,
}

impl StateCopy {
    /// Copy the usage history of the model in `model_dir` (if any) into a new private state
    /// directory.
    fn new(model_dir: &Path, learn: bool) -> Result<StateCopy> {
        if !learn {
            return Ok(StateCopy { dir: None });
        }
        let dir = std::env::temp_dir().join(format!("coli-tune-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("usage"))
            .with_context(|| format!("creating {}", dir.display()))?;
        let copy = StateCopy {
            dir: Some(dir.clone()),
        };
        if let Some(state) = colibri::store::history::state_dir() {
            let fp = colibri::store::history::fingerprint(model_dir)
                .with_context(|| format!("fingerprinting {}", model_dir.display()))?;
            let from = colibri::store::history::UsageHistory::path(&state, &fp)?;
            if from.is_file() {
                let to = colibri::store::history::UsageHistory::path(&dir, &fp)?;
                std::fs::copy(&from, &to)
                    .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
            }
        }
        Ok(copy)
    }
}

impl Drop for StateCopy {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The values of `axis` to try from `best` (the best setting so far, tried already).
fn candidates(axis: Axis, best: &Setting, a: &TuneArgs, ctx: &GridContext) -> Vec<Setting> {
    let with = |f: &dyn Fn(&mut Setting)| {
        let mut s = best.clone();
        f(&mut s);
        s
    };
    let mut out: Vec<Setting> = match axis {
        Axis::Threads => {
            let n = colibri::tensor::threads::default_threads();
            let values = if a.try_threads.is_empty() {
                vec![n.div_ceil(2), (3 * n).div_ceil(4), n]
            } else {
                a.try_threads.clone()
            };
            values
                .into_iter()
                .filter(|&t| t >= 1)
                .map(|t| with(&|s| s.threads = t))
                .collect()
        }
        Axis::Io if ctx.streaming => {
            let values = if a.try_io.is_empty() {
                vec![ReaderKind::Uring, ReaderKind::Pool]
            } else {
                a.try_io.clone()
            };
            values
                .into_iter()
                // `auto` measured as what it chose is not measured again.
                .filter(|k| !(best.io == ReaderKind::Auto && ctx.auto_is == Some(*k)))
                .map(|k| with(&|s| s.io = k))
                .collect()
        }
        Axis::DirectIo if ctx.streaming => {
            let values = if a.try_direct_io.is_empty() {
                vec![false, true]
            } else {
                a.try_direct_io.clone()
            };
            values
                .into_iter()
                .map(|d| with(&|s| s.direct_io = d))
                .collect()
        }
        Axis::Prefetch if ctx.streaming => {
            let values = if a.try_prefetch.is_empty() {
                vec![true, false]
            } else {
                a.try_prefetch.clone()
            };
            values
                .into_iter()
                .map(|p| with(&|s| s.prefetch = p))
                .collect()
        }
        Axis::PinBudget if ctx.streaming && ctx.pins => {
            let values: Vec<Option<Size>> = if a.try_pin_budget.is_empty() {
                // Half of the cache is the default (`None`), not tried again as a size.
                let cap = ctx.cache_capacity;
                let half = best.pin_budget.is_some().then_some(cap / 2);
                [Some(0), Some(cap / 4), half, Some(cap / 4 * 3)]
                    .into_iter()
                    .flatten()
                    .filter_map(|b| size_of(b).ok())
                    .map(Some)
                    .collect()
            } else {
                a.try_pin_budget.iter().cloned().map(Some).collect()
            };
            values
                .into_iter()
                .map(|p| with(&|s| s.pin_budget = p.clone()))
                .collect()
        }
        Axis::PrefillChunk => {
            let values = if a.try_prefill_chunk.is_empty() {
                [64, 128, 256, 512]
                    .into_iter()
                    .filter(|&c| c <= a.prompt_tokens)
                    .collect()
            } else {
                a.try_prefill_chunk.clone()
            };
            values
                .into_iter()
                .filter(|&c| c >= 1)
                .map(|c| with(&|s| s.prefill_chunk = c))
                .collect()
        }
        _ => Vec::new(),
    };
    let mut seen = vec![best.clone()];
    out.retain(|s| {
        let new = !seen.contains(s);
        if new {
            seen.push(s.clone());
        }
        new
    });
    out
}

/// A size of about `bytes`, rounded down to MiB (from 1 MiB) or KiB (from 1 KiB).
fn size_of(bytes: u64) -> Result<Size, String> {
    if bytes >= 1 << 20 {
        format!("{}M", bytes >> 20).parse()
    } else if bytes >= 1 << 10 {
        format!("{}K", bytes >> 10).parse()
    } else {
        bytes.to_string().parse()
    }
}

/// What the warm-up found out about the model under the base setting.
struct GridContext {
    /// Experts are read from disk into a cache (not memory-mapped): the I/O keys matter.
    streaming: bool,
    /// What `io = "auto"` chose.
    auto_is: Option<ReaderKind>,
    /// The cache's bytes (for the pin budgets tried).
    cache_capacity: u64,
    /// The usage history pinned experts (else pin budgets change nothing).
    pins: bool,
}

/// Run `coli tune`.
pub fn run(a: TuneArgs) -> Result<()> {
    if a.prompt_tokens == 0 || a.repeats == 0 {
        bail!("--prompt-tokens and --repeats must be at least 1");
    }
    if a.profile.is_empty()
        || !a
            .profile
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        bail!(
            "--profile `{}`: expected a name of letters, digits, `-` and `_`",
            a.profile
        );
    }
    let flags = ServeFlags {
        config: a.config.clone(),
        model: a.model.clone(),
        engine: a.engine.clone(),
        ..ServeFlags::default()
    };
    let file = crate::config::file_for(&flags)?;
    if !a.force && !a.dry_run && profile_exists(&file, &a.profile)? {
        bail!(
            "{} already has a profile `{}`; pass --force to replace it, or --profile to name another",
            file.display(),
            a.profile
        );
    }
    let loaded = crate::config::load_without_profile(&flags)?;
    let given = given_engine_keys(&loaded)?;
    let config = loaded.config;
    let Some(model) = config.model.clone() else {
        bail!(
            "no model to tune: give --model, or set `model` in {}",
            file.display()
        );
    };
    let dir = crate::model_arg::prepare(&model, 0)?;
    let default_budget = if model == "demo" {
        crate::demo::demo_budget(&dir)
    } else {
        None
    };
    let mut base = config.engine.clone();
    if !base.mirrors.is_empty() && base.mirror_weights.is_empty() {
        // Measured once, not at every load.
        base.mirror_weights = base
            .store_options(&dir, default_budget)
            .mirrors
            .iter()
            .map(|m| m.weight)
            .collect();
    }
    let state = StateCopy::new(&dir, !base.no_learn)?;
    let start = Setting {
        threads: if base.threads == 0 {
            colibri::tensor::threads::default_threads()
        } else {
            base.threads
        },
        io: base.io,
        direct_io: base.direct_io,
        prefetch: !base.no_prefetch,
        pin_budget: base.pin_budget.clone(),
        prefill_chunk: config.prefill_chunk,
    };
    let mut bench = Bench {
        dir: dir.clone(),
        base: base.clone(),
        default_budget,
        state: &state,
        workload: Workload {
            prompt_tokens: a.prompt_tokens,
            gen_tokens: a.gen_tokens,
            prefill_chunk: None,
            greedy_tokens: a.check_tokens,
        },
        started: Instant::now(),
        budget_secs: a.time_budget_secs as f64,
        reference: None,
        mismatches: Vec::new(),
        runs: 0,
    };

    eprintln!(
        "coli tune: {} from {}; each run: {} prompt tokens, {} decoded, {} greedy (checked); time budget {} s",
        model,
        describe(&start),
        a.prompt_tokens,
        a.gen_tokens,
        a.check_tokens,
        a.time_budget_secs
    );
    eprintln!("coli tune: warm-up run (not counted)");
    let warm = bench
        .measure(&start)
        .context("the warm-up run with the starting setting failed")?;
    let streaming = base.ram_budget(default_budget).is_some();
    let ctx = GridContext {
        streaming,
        auto_is: if warm.reader.starts_with("io-uring") {
            Some(ReaderKind::Uring)
        } else if warm.reader.starts_with("pread") {
            Some(ReaderKind::Pool)
        } else {
            None
        },
        cache_capacity: warm.cache_capacity,
        pins: warm.pinned_bytes > 0 || !a.try_pin_budget.is_empty(),
    };
    let mut notes = Vec::new();
    if !streaming {
        notes.push(
            "every weight is memory-mapped (mmap = true): io, direct_io, prefetch and pin_budget do not apply and were not tried".to_string(),
        );
    } else if !ctx.pins {
        notes.push(
            "no usage history pinned any expert, so pin budgets would change nothing: pin_budget was not tried (serve or bench the model first)".to_string(),
        );
    }

    let mut rows: Vec<Row> = Vec::new();
    let mut out_of_time = false;
    let mut best = start.clone();
    // The starting setting, measured like the others.
    measure_rows(
        &mut bench,
        &mut rows,
        std::slice::from_ref(&start),
        a.repeats,
        &mut out_of_time,
        Some(warm.wall),
    );
    if rows[0].error.is_some() || rows[0].samples.is_empty() {
        bail!(
            "the starting setting could not be measured: {}",
            rows[0]
                .error
                .clone()
                .unwrap_or_else(|| "no time left".into())
        );
    }
    for axis in Axis::ALL {
        if out_of_time {
            break;
        }
        let tries = candidates(axis, &best, &a, &ctx);
        if tries.is_empty() {
            continue;
        }
        eprintln!(
            "coli tune: {}: trying {}",
            axis.key(),
            tries
                .iter()
                .map(|s| value_of(axis, s))
                .collect::<Vec<_>>()
                .join(", ")
        );
        // The best so far runs again beside its challengers, so that each comparison is
        // between runs made close together (its medians take every run it had).
        let mut batch = vec![best.clone()];
        batch.extend(tries.iter().cloned());
        measure_rows(
            &mut bench,
            &mut rows,
            &batch,
            a.repeats,
            &mut out_of_time,
            None,
        );
        let best_secs = row_of(&rows, &best)
            .and_then(Row::seconds)
            .unwrap_or(f64::MAX);
        let winner = tries
            .iter()
            .filter_map(|s| row_of(&rows, s).and_then(|r| r.seconds().map(|t| (s, t))))
            .min_by(|x, y| x.1.total_cmp(&y.1));
        if let Some((s, t)) = winner {
            if t < best_secs * (1.0 - MIN_GAIN) {
                best = s.clone();
            }
        }
    }
    // Medians move as the best so far is re-run: in the end, any setting measured clearly
    // faster than the descent's choice replaces it.
    let best_secs = row_of(&rows, &best)
        .and_then(Row::seconds)
        .unwrap_or(f64::MAX);
    if let Some((s, t)) = rows
        .iter()
        .filter_map(|r| r.seconds().map(|t| (&r.setting, t)))
        .min_by(|x, y| x.1.total_cmp(&y.1))
    {
        if t < best_secs * (1.0 - MIN_GAIN) {
            best = s.clone();
        }
    }
    if out_of_time {
        notes.push(format!(
            "the time budget ({} s) ran out: the best of the {} settings measured is kept",
            a.time_budget_secs,
            rows.len()
        ));
    }

    print_table(&rows, &best, &start);
    for n in &notes {
        println!("note: {n}");
    }
    if !bench.mismatches.is_empty() {
        bail!(
            "output differed between settings, which must never happen (a bug; please report it):\n  {}",
            bench.mismatches.join("\n  ")
        );
    }
    println!(
        "output identical in every setting: {} runs (and the warm-up) gave the same {} sampled and {} greedy tokens, and bit-identical logits at every step",
        bench.runs - 1,
        a.gen_tokens + 1,
        a.check_tokens
    );
    let best_row = row_of(&rows, &best).expect("the best setting was measured");
    let start_row = &rows[0];
    let speedup = start_row.seconds().unwrap_or(0.0) / best_row.seconds().unwrap_or(f64::MAX);
    println!(
        "fastest: {} ({:.2}× the starting setting)",
        describe(&best),
        speedup
    );
    if a.dry_run {
        println!("--dry-run: nothing written");
        return Ok(());
    }
    // The model as an absolute path, so the profile works from any directory.
    let model = if model == "demo" {
        model
    } else {
        std::path::absolute(&model).map_or(model, |p| p.display().to_string())
    };
    let comment = profile_comment(&model, &rows, &best, bench.runs - 1);
    write_profile(&file, &a.profile, &model, &best, &given, &comment, a.force)?;
    println!(
        "wrote profile `{}` to {}: serve with it by `coli serve --profile {}` (or COLI_PROFILE={})",
        a.profile,
        file.display(),
        a.profile,
        a.profile
    );
    Ok(())
}

/// The value `axis` has in `s`, as the table shows it.
fn value_of(axis: Axis, s: &Setting) -> String {
    match axis {
        Axis::Threads => s.threads.to_string(),
        Axis::Io => value_name(&s.io),
        Axis::DirectIo => s.direct_io.to_string(),
        Axis::Prefetch => (if s.prefetch { "on" } else { "off" }).to_string(),
        Axis::PinBudget => s.pin_text(),
        Axis::PrefillChunk => s.prefill_chunk.to_string(),
    }
}

fn row_of<'r>(rows: &'r [Row], s: &Setting) -> Option<&'r Row> {
    rows.iter().find(|r| r.setting == *s)
}

/// Measure each of `settings` `repeats` times, interleaved, into `rows`; a run that fails
/// marks its row failed (and its setting is not run again). Stops when the next run would
/// likely end past the time budget. `first_wall` estimates a run before any was timed.
fn measure_rows(
    bench: &mut Bench,
    rows: &mut Vec<Row>,
    settings: &[Setting],
    repeats: usize,
    out_of_time: &mut bool,
    first_wall: Option<f64>,
) {
    for s in settings {
        if row_of(rows, s).is_none() {
            rows.push(Row {
                setting: s.clone(),
                samples: Vec::new(),
                error: None,
            });
        }
    }
    for _ in 0..repeats {
        for s in settings {
            // The slowest run so far estimates the next.
            let estimate = rows
                .iter()
                .flat_map(|r| r.samples.iter().map(|x| x.wall))
                .chain(first_wall)
                .fold(0.0f64, f64::max);
            if estimate > bench.left() {
                *out_of_time = true;
                return;
            }
            let i = rows
                .iter()
                .position(|r| r.setting == *s)
                .expect("added above");
            if rows[i].error.is_some() {
                continue;
            }
            eprint!("coli tune: run {}: {} ... ", bench.runs, describe(s));
            match bench.measure(s) {
                Ok(x) => {
                    eprintln!(
                        "prefill {:.1} tok/s, decode {:.2} tok/s ({:.0} s of {:.0} s used)",
                        x.prefill_tok_per_s,
                        x.decode_tok_per_s,
                        bench.started.elapsed().as_secs_f64(),
                        bench.budget_secs
                    );
                    rows[i].samples.push(x);
                }
                Err(e) => {
                    eprintln!("failed: {e:#}");
                    rows[i].error = Some(format!("{e:#}"));
                }
            }
        }
    }
}

/// The table of every setting measured, on stdout.
fn print_table(rows: &[Row], best: &Setting, start: &Setting) {
    println!(
        "{:>7} {:>6} {:>9} {:>8} {:>10} {:>7} {:>13} {:>12} {:>9} {:>4}  note",
        "threads",
        "io",
        "direct_io",
        "prefetch",
        "pin_budget",
        "chunk",
        "prefill tok/s",
        "decode tok/s",
        "ms",
        "runs"
    );
    for r in rows {
        let s = &r.setting;
        let mut note = Vec::new();
        if s == start {
            note.push("start".to_string());
        }
        if s == best {
            note.push("fastest".to_string());
        }
        if let Some(e) = &r.error {
            note.push(format!("failed: {e}"));
        }
        let num = |v: Option<f64>, digits: usize| {
            v.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
        };
        println!(
            "{:>7} {:>6} {:>9} {:>8} {:>10} {:>7} {:>13} {:>12} {:>9} {:>4}  {}",
            s.threads,
            value_name(&s.io),
            s.direct_io,
            if s.prefetch { "on" } else { "off" },
            s.pin_text(),
            s.prefill_chunk,
            num(r.median(|x| x.prefill_tok_per_s), 1),
            num(r.median(|x| x.decode_tok_per_s), 2),
            num(r.seconds().map(|t| t * 1e3), 3),
            r.samples.len(),
            note.join(", ")
        );
    }
}

/// The comment written above the profile: when, for which model, and what was measured.
fn profile_comment(model: &str, rows: &[Row], best: &Setting, runs: usize) -> String {
    let when = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut c = format!(
        "\n# Written by `coli tune` (unix time {when}) for {model} on this machine: {runs} runs, \
         output identical in each.\n# Median prefill tok/s, decode tok/s and ms per setting:\n"
    );
    for r in rows {
        let mark = if r.setting == *best {
            "  <- fastest"
        } else {
            ""
        };
        match (&r.error, r.seconds()) {
            (Some(e), _) => c.push_str(&format!(
                "#   {}: failed: {}\n",
                describe(&r.setting),
                first_line(e)
            )),
            (None, Some(t)) => c.push_str(&format!(
                "#   {}: {:.1}, {:.2}, {:.3}{mark}\n",
                describe(&r.setting),
                r.median(|x| x.prefill_tok_per_s).unwrap_or(0.0),
                r.median(|x| x.decode_tok_per_s).unwrap_or(0.0),
                t * 1e3
            )),
            (None, None) => {}
        }
    }
    c
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

/// Whether the configuration file `file` (which may not exist) has `[profiles.NAME]`.
fn profile_exists(file: &Path, name: &str) -> Result<bool> {
    if !file.exists() {
        return Ok(false);
    }
    let doc = read_document(file)?;
    Ok(doc
        .get("profiles")
        .and_then(|p| p.as_table_like())
        .is_some_and(|p| p.contains_key(name)))
}

fn read_document(file: &Path) -> Result<toml_edit::DocumentMut> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("cannot read configuration file {}", file.display()))?;
    text.parse::<toml_edit::DocumentMut>()
        .with_context(|| format!("cannot parse configuration file {} as TOML", file.display()))
}

/// The engine options given as flags that `coli tune` does not tune (`--ram 8G`): part of
/// the setting measured, so written into the profile with it. As (key, value) in key order.
fn given_engine_keys(loaded: &crate::config::Loaded) -> Result<Vec<(String, toml_edit::Value)>> {
    let tuned: Vec<&str> = Axis::ALL.iter().map(|a| a.key()).collect();
    let values = serde_json::to_value(&loaded.config.engine)?;
    let mut out = Vec::new();
    for (key, _) in crate::engine_options::ENGINE_KEYS {
        let from_flag = matches!(
            loaded.sources.get(*key),
            Some(crate::config::Source::Flag(_))
        );
        if !from_flag || tuned.contains(key) {
            continue;
        }
        if let Some(v) = values.get(*key).and_then(toml_value) {
            out.push((key.to_string(), v));
        }
    }
    Ok(out)
}

/// A JSON value as a TOML value (`None` for null, which TOML cannot hold).
fn toml_value(v: &serde_json::Value) -> Option<toml_edit::Value> {
    use serde_json::Value as J;
    Some(match v {
        J::Null => return None,
        J::Bool(b) => (*b).into(),
        J::Number(n) => match n.as_i64() {
            Some(i) => i.into(),
            None => n.as_f64()?.into(),
        },
        J::String(s) => s.as_str().into(),
        J::Array(items) => {
            let mut a = toml_edit::Array::new();
            for item in items {
                a.push(toml_value(item)?);
            }
            a.into()
        }
        J::Object(_) => return None,
    })
}

/// Write `[profiles.NAME]` with the setting `s`, the model and the `given` options into
/// `file`, atomically ([`colibri::format::write::write_atomic`]), keeping everything else in
/// it, with `comment` above the table; refuses to replace an existing profile unless `force`.
/// What `coli tune` writes with (public for the crash-consistency test,
/// server/tests/crash_consistency.rs).
pub fn write_profile(
    file: &Path,
    name: &str,
    model: &str,
    s: &Setting,
    given: &[(String, toml_edit::Value)],
    comment: &str,
    force: bool,
) -> Result<()> {
    use toml_edit::{value, Item, Table};
    let mut doc = if file.exists() {
        read_document(file)?
    } else {
        toml_edit::DocumentMut::new()
    };
    let profiles = doc
        .entry("profiles")
        .or_insert_with(|| {
            let mut t = Table::new();
            t.set_implicit(true);
            Item::Table(t)
        })
        .as_table_mut()
        .with_context(|| {
            format!(
                "`profiles` in {} is not a table of [profiles.NAME] tables",
                file.display()
            )
        })?;
    if profiles.contains_key(name) && !force {
        bail!(
            "{} already has a profile `{name}`; pass --force to replace it",
            file.display()
        );
    }
    let mut t = Table::new();
    t.insert("model", value(model));
    t.insert("threads", value(s.threads as i64));
    t.insert("io", value(value_name(&s.io)));
    t.insert("direct_io", value(s.direct_io));
    t.insert("no_prefetch", value(!s.prefetch));
    if let Some(p) = &s.pin_budget {
        t.insert("pin_budget", value(p.to_string()));
    }
    t.insert("prefill_chunk", value(s.prefill_chunk as i64));
    for (key, v) in given {
        t.insert(key, toml_edit::Item::Value(v.clone()));
    }
    t.decor_mut().set_prefix(comment);
    profiles.insert(name, Item::Table(t));
    colibri::format::write::write_atomic(file, doc.to_string().as_bytes())
        .with_context(|| format!("writing {}", file.display()))?;
    eprintln!(
        "coli tune: {} ({}) written",
        file.display(),
        format_size(std::fs::metadata(file).map(|m| m.len()).unwrap_or(0))
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting() -> Setting {
        Setting {
            threads: 2,
            io: ReaderKind::Pool,
            direct_io: false,
            prefetch: true,
            pin_budget: None,
            prefill_chunk: 256,
        }
    }

    #[test]
    fn a_profile_is_added_keeping_the_file_and_replaced_only_with_force() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("colibri.toml");
        let original =
            "# my server\nport = 9000 # the port\n\n[profiles.dev]\nlog_level = \"debug\"\n";
        std::fs::write(&file, original).unwrap();
        let s = setting();
        write_profile(&file, "tuned", "/m", &s, &[], "\n# measured\n", false).unwrap();
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.starts_with(original), "{text}");
        assert!(text.contains("# measured\n[profiles.tuned]\n"), "{text}");
        assert!(profile_exists(&file, "tuned").unwrap());
        assert!(profile_exists(&file, "dev").unwrap());
        assert!(!profile_exists(&file, "other").unwrap());
        let e = write_profile(&file, "tuned", "/m", &s, &[], "", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("already has a profile `tuned`") && e.contains("--force"),
            "{e}"
        );
        let faster = Setting {
            threads: 1,
            pin_budget: Some("64M".parse().unwrap()),
            ..s
        };
        write_profile(&file, "tuned", "/m", &faster, &[], "", true).unwrap();
        let table: toml::Table = toml::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        let t = &table["profiles"]["tuned"];
        assert_eq!(t["threads"].as_integer(), Some(1));
        assert_eq!(t["pin_budget"].as_str(), Some("64M"));
        assert_eq!(t["io"].as_str(), Some("pool"));
        assert_eq!(t["no_prefetch"].as_bool(), Some(false));
        assert_eq!(table["port"].as_integer(), Some(9000));
    }

    #[test]
    fn a_new_file_gets_just_the_profile() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("new.toml");
        write_profile(
            &file,
            "fast",
            "demo",
            &setting(),
            &[("ram".into(), "1G".into())],
            "",
            false,
        )
        .unwrap();
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.starts_with("[profiles.fast]\n"), "{text}");
    }

    #[test]
    fn candidates_skip_the_best_so_far_and_what_does_not_apply() {
        let args =
            <TuneArgs as clap::FromArgMatches>::from_arg_matches(
                &<TuneArgs as clap::Args>::augment_args(clap::Command::new("t"))
                    .get_matches_from(["t", "--try-threads", "1,2,2", "--prompt-tokens", "100"]),
            )
            .unwrap();
        let ctx = GridContext {
            streaming: true,
            auto_is: Some(ReaderKind::Pool),
            cache_capacity: 64 << 20,
            pins: false,
        };
        let best = setting();
        let threads: Vec<usize> = candidates(Axis::Threads, &best, &args, &ctx)
            .iter()
            .map(|s| s.threads)
            .collect();
        assert_eq!(threads, [1]);
        assert!(candidates(Axis::PinBudget, &best, &args, &ctx).is_empty());
        let chunks: Vec<usize> = candidates(Axis::PrefillChunk, &best, &args, &ctx)
            .iter()
            .map(|s| s.prefill_chunk)
            .collect();
        assert_eq!(chunks, [64]);
        let auto = Setting {
            io: ReaderKind::Auto,
            ..setting()
        };
        let io: Vec<ReaderKind> = candidates(Axis::Io, &auto, &args, &ctx)
            .iter()
            .map(|s| s.io)
            .collect();
        assert_eq!(io, [ReaderKind::Uring]);
        let pins = GridContext { pins: true, ..ctx };
        let budgets: Vec<String> = candidates(Axis::PinBudget, &best, &args, &pins)
            .iter()
            .map(Setting::pin_text)
            .collect();
        assert_eq!(budgets, ["0", "16M", "48M"]);
        assert_eq!(size_of(1148544).unwrap().to_string(), "1M");
        assert_eq!(size_of(382848).unwrap().to_string(), "373K");
        assert_eq!(size_of(1000).unwrap().to_string(), "1000");
        let mapped = GridContext {
            streaming: false,
            ..pins
        };
        assert!(candidates(Axis::Io, &best, &args, &mapped).is_empty());
        assert!(candidates(Axis::DirectIo, &best, &args, &mapped).is_empty());
    }
}
