//! This machine's bandwidths, measured once and cached in the cache directory: memory read
//! bandwidth (every core summing a large buffer), disk read bandwidth (O_DIRECT sequential
//! reads of a scratch file, 4 MiB blocks, 4 in flight), and, measured the first time a plan
//! needs them, the rate of expert-sized reads from the page cache and the rates of the decode
//! kernel per weight format, matrix shape and thread count ([`kernel_rates`]).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::time::Instant;

use anyhow::{Context, Result};
use colibri::tensor::DType;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Measured bandwidths.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Bandwidths {
    pub disk_gb_per_s: f64,
    pub memory_gb_per_s: f64,
    /// How the disk number was obtained.
    pub disk_source: String,
    pub measured_unix: u64,
    /// GB/s of expert-sized reads through the store's reader from a file held in the page
    /// cache ([`page_cache_bandwidth`]): what a miss costs when the expert's file is there.
    /// `None` until a plan needs it ([`kernel_rates`] measures it then).
    #[serde(default)]
    pub page_cache_gb_per_s: Option<f64>,
    /// GB/s of weight bytes the decode kernel gets through, by `"FORMAT ROWSxCOLS xGROUP
    /// BYTES@THREADS"` (see [`kernel_rates`]); filled in as plans need them.
    #[serde(default)]
    pub kernel_gb_per_s: BTreeMap<String, f64>,
}

/// The cached measurement, or a new one (saved atomically).
pub fn bandwidths(remeasure: bool) -> Result<Bandwidths> {
    let path = crate::demo::cache_dir()?.join("machine.json");
    if !remeasure {
        if let Some(b) = cached(&path) {
            return Ok(b);
        }
    }
    eprintln!(
        "coli: measuring this machine's disk and memory bandwidth once (cached in {})",
        path.display()
    );
    let dir = path.parent().unwrap().to_path_buf();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (memory, disk) = on_all_cores(|| (memory_bandwidth(), disk_bandwidth(&dir)));
    let (disk, source) = disk?;
    let b = Bandwidths {
        disk_gb_per_s: disk,
        memory_gb_per_s: memory,
        disk_source: source,
        measured_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        page_cache_gb_per_s: None,
        kernel_gb_per_s: BTreeMap::new(),
    };
    save(&path, &b)?;
    Ok(b)
}

/// The measurement cached at `path`, if it reads.
fn cached(path: &std::path::Path) -> Option<Bandwidths> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str::<Bandwidths>(&text).ok()
}

/// Write `b` to `path` atomically.
fn save(path: &std::path::Path, b: &Bandwidths) -> Result<()> {
    colibri::format::write::write_atomic(path, serde_json::to_string_pretty(b)?.as_bytes())
        .with_context(|| format!("saving {}", path.display()))
}

/// Run `f` on a pool of `threads` threads of its own (0: every core): measuring on the global
/// compute pool would create that pool before the command could size it to `--threads`.
fn on_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    let n = if threads == 0 {
        colibri::tensor::threads::default_threads()
    } else {
        threads
    };
    match rayon::ThreadPoolBuilder::new().num_threads(n).build() {
        Ok(pool) => pool.install(f),
        Err(_) => f(),
    }
}

/// [`on_threads`] with every core.
fn on_all_cores<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    on_threads(0, f)
}

/// Matrices of one shape that decode multiplies in one parallel step: a dense matrix alone
/// (`group` 1), or the matrices of that shape of a MoE layer's active experts together (as
/// [`colibri::tensor::matmul::matmul_groups`] runs them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelShape {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub group: usize,
    /// Bytes the measurement cycles through when fewer than 256 MiB: a model's matrices
    /// together (a small model's weights stay in the caches, as they do when it decodes).
    pub working_set: u64,
}

impl KernelShape {
    /// Its key in `machine.json` on `threads` threads.
    fn key(&self, threads: usize) -> String {
        format!(
            "{} {}x{} x{} {}@{threads}",
            self.dtype,
            self.rows,
            self.cols,
            self.group,
            self.working_set()
        )
    }

    /// Bytes the measurement cycles through.
    fn working_set(&self) -> usize {
        (self.working_set as usize).clamp(1, 256 << 20)
    }
}

/// The bandwidths ([`bandwidths`], with the page cache's read rate,
/// [`page_cache_bandwidth`]), and the decode kernel's rate for each of `shapes` on `threads`
/// threads (0: every core), in GB/s of weight bytes: cached in `machine.json`, measured (a
/// second or so each) and saved for those not there yet. `None` for a format without a plain matrix kernel (FP8
/// blocks, integers): a plan counts its bytes at the memory bandwidth.
///
/// Each measurement multiplies one activation row by 256 MiB of weight matrices of the shape
/// (rows cut so that one matrix is at most 64 MiB; or as many bytes as the model's matrices
/// have together, when fewer): larger together than any cache, as a large model's weights are, in steps of `group` matrices through
/// [`colibri::tensor::matmul::matmul_groups`] as decode does, and keeps the median of five
/// passes or more (what decode sustains on a shared machine, not its best moment). So the rate includes what a step costs beside its bytes (the hand-off between
/// threads, quantizing the activations) and is the lower of what the memory delivers and
/// what the kernel's arithmetic keeps up with.
pub fn kernel_rates(
    shapes: &[KernelShape],
    threads: usize,
) -> Result<(Bandwidths, f64, Vec<Option<f64>>)> {
    let path = crate::demo::cache_dir()?.join("machine.json");
    let mut b = bandwidths(false)?;
    let mut changed = false;
    let n = if threads == 0 {
        colibri::tensor::threads::default_threads()
    } else {
        threads
    };
    let page_cache = match b.page_cache_gb_per_s {
        Some(r) => r,
        None => {
            let dir = path.parent().unwrap();
            let r = on_all_cores(|| page_cache_bandwidth(dir))?;
            eprintln!("coli: measured expert reads from the page cache: {r:.1} GB/s");
            b.page_cache_gb_per_s = Some(r);
            changed = true;
            r
        }
    };
    for s in shapes {
        if b.kernel_gb_per_s.contains_key(&s.key(n)) {
            continue;
        }
        if let Some(rate) = on_threads(n, || kernel_rate(s)) {
            eprintln!(
                "coli: measured the decode kernel on {n} threads for {}: {rate:.1} GB/s",
                s.key(n)
            );
            b.kernel_gb_per_s.insert(s.key(n), rate);
            changed = true;
        }
    }
    if changed {
        save(&path, &b)?;
    }
    let rates = shapes
        .iter()
        .map(|s| b.kernel_gb_per_s.get(&s.key(n)).copied())
        .collect();
    Ok((b, page_cache, rates))
}

/// GB/s of weight bytes through `matmul_groups` for matrices of `shape` with one activation
/// row (see [`kernel_rates`]); `None` for a format without a plain matrix kernel.
fn kernel_rate(shape: &KernelShape) -> Option<f64> {
    use colibri::tensor::matmul::{matmul_groups, MatmulGroup};
    use colibri::tensor::quant::QuantType;
    let total = shape.working_set();
    const LARGEST: usize = 64 << 20;
    let cols = shape.cols;
    let f = match shape.dtype {
        DType::Quant(QuantType::F32) => DType::F32,
        DType::Quant(QuantType::F16) => DType::F16,
        DType::Quant(QuantType::BF16) => DType::BF16,
        f => f,
    };
    let row_bytes = match f {
        DType::F32 => cols * 4,
        DType::F16 | DType::BF16 => cols * 2,
        DType::Quant(q) => q.row_bytes(cols).ok()?,
        _ => return None,
    };
    // A row larger than the largest matrix timed (an absurd shape from a hostile file) is
    // not timed: its bytes count at the memory bandwidth, and nothing huge is allocated.
    if cols == 0 || shape.rows == 0 || row_bytes == 0 || row_bytes > LARGEST {
        return None;
    }
    let group = shape.group.max(1);
    let rows = shape.rows.min((LARGEST / row_bytes).max(1));
    let count = total.div_ceil(rows * row_bytes).div_ceil(group) * group;
    let x = probe_activations(cols);
    let weights = ProbeWeights::new(f, count * rows, cols)?;
    let matrices = weights.matrices(rows);
    let mut outs = vec![vec![0f32; rows]; group];
    let bytes = (count * rows * row_bytes) as f64;
    let mut rates = Vec::new();
    // Five timed passes at least, and a fifth of a second at least (a small working set).
    let started = Instant::now();
    let mut pass = 0;
    while pass < 6 || (started.elapsed().as_secs_f64() < 0.2 && pass < 10_000) {
        pass += 1;
        let t = Instant::now();
        for step in matrices.chunks(group) {
            let mut groups: Vec<MatmulGroup<'_, '_>> = vec![(
                x.as_slice(),
                step.iter()
                    .zip(outs.iter_mut())
                    .map(|(w, o)| (w, o.as_mut_slice()))
                    .collect(),
            )];
            matmul_groups(&mut groups);
        }
        std::hint::black_box(&outs);
        // The first pass warms the pool and the pages up.
        if pass > 1 {
            rates.push(bytes / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    Some(median(&mut rates))
}

/// The activation row the compute probes multiply by: small, varied, finite values.
fn probe_activations(cols: usize) -> Vec<f32> {
    (0..cols).map(|i| (i % 17) as f32 / 17.0 - 0.5).collect()
}

/// Weight rows of one format for the compute probes ([`kernel_rate`], the page-cache probe's
/// compute), every byte 0x3C: normal, finite values in every format (f32 0x3C3C3C3C ≈ 0.0115,
/// f16/bf16 0x3C3C, the blocks' scales alike), so no pass runs on NaNs or subnormals.
enum ProbeWeights {
    F32(Vec<f32>, usize),
    F16(Vec<half::f16>, usize),
    BF16(Vec<half::bf16>, usize),
    /// The format, the bytes, the columns and the bytes of a row.
    Quant(colibri::tensor::quant::QuantType, Vec<u8>, usize, usize),
}

impl ProbeWeights {
    /// `rows × cols` in format `f`; `None` for a format without a plain matrix kernel.
    fn new(f: DType, rows: usize, cols: usize) -> Option<ProbeWeights> {
        Some(match f {
            DType::F32 => ProbeWeights::F32(vec![f32::from_bits(0x3C3C_3C3C); rows * cols], cols),
            DType::F16 => ProbeWeights::F16(vec![half::f16::from_bits(0x3C3C); rows * cols], cols),
            DType::BF16 => {
                ProbeWeights::BF16(vec![half::bf16::from_bits(0x3C3C); rows * cols], cols)
            }
            DType::Quant(q) => {
                let row_bytes = q.row_bytes(cols).ok()?;
                ProbeWeights::Quant(q, vec![0x3Cu8; rows * row_bytes], cols, row_bytes)
            }
            _ => return None,
        })
    }

    /// The rows cut into matrices of `rows` rows each.
    fn matrices(&self, rows: usize) -> Vec<colibri::tensor::WeightView<'_>> {
        use colibri::tensor::{WeightData, WeightView};
        let view = |cols, data| WeightView {
            rows,
            cols,
            data,
            interleaved: None,
        };
        match self {
            ProbeWeights::F32(w, cols) => w
                .chunks(rows * cols)
                .map(|d| view(*cols, WeightData::F32(d)))
                .collect(),
            ProbeWeights::F16(w, cols) => w
                .chunks(rows * cols)
                .map(|d| view(*cols, WeightData::F16(d)))
                .collect(),
            ProbeWeights::BF16(w, cols) => w
                .chunks(rows * cols)
                .map(|d| view(*cols, WeightData::BF16(d)))
                .collect(),
            ProbeWeights::Quant(q, w, cols, row_bytes) => w
                .chunks(rows * row_bytes)
                .map(|d| view(*cols, WeightData::Quant(*q, d)))
                .collect(),
        }
    }
}

/// GB/s summing a 1 GiB buffer on every thread of the current pool (best of 3 passes).
fn memory_bandwidth() -> f64 {
    let n = (1usize << 30) / 8;
    let buf: Vec<u64> = (0..n as u64)
        .into_par_iter()
        .map(|i| i.wrapping_mul(0x9E37))
        .collect();
    let mut best = 0.0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
        best = best.max((n * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

/// GB/s of O_DIRECT reads of a 1 GiB scratch file (4 MiB blocks, 4 readers).
fn disk_bandwidth(dir: &std::path::Path) -> Result<(f64, String)> {
    // A temporary of the atomic writer (`bandwidth-probe.PID.tmp`, locked while `probe` is
    // open), so a run killed while measuring leaves a file the next write removes.
    let (path, probe) = colibri::format::write::create_tmp(&dir.join("bandwidth-probe"))?;
    let measured = measure_disk(&path, probe);
    let _ = std::fs::remove_file(&path);
    measured
}

/// GB/s of expert-sized reads from the page cache while decode computes: a thread reads a
/// 256 MiB scratch file (held in the page cache: just written) through the store's own reader
/// (io-uring where it works, buffered) in batches of 24 ranges of 1 MiB, as a MoE layer's
/// missed experts are read, while the decode kernel cycles through 64 MiB of bf16 matrices on
/// the current compute pool for about half a second; the bytes read over that time. The
/// median of 3 runs. Reads from the page cache cost CPU time and memory bandwidth (copies,
/// buffers, the reader's hand-offs) that compute competes for, so this, not the rate of reads
/// on an idle machine, is the rate misses are read at while a model decodes.
fn page_cache_bandwidth(dir: &std::path::Path) -> Result<f64> {
    let (path, probe) = colibri::format::write::create_tmp(&dir.join("page-cache-probe"))?;
    let measured = time_reads_during_compute(&path, probe);
    let _ = std::fs::remove_file(&path);
    measured
}

/// Write 256 MiB to `path` through `probe`, then measure reading them back during
/// compute (see [`page_cache_bandwidth`]), in GB/s.
fn time_reads_during_compute(path: &std::path::Path, mut probe: std::fs::File) -> Result<f64> {
    use colibri::store::reader::{open_reader, ByteRange, ReaderOptions};
    use colibri::tensor::matmul::matmul;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    const RANGE: usize = 1 << 20;
    const RANGES: usize = 256;
    const BATCH: usize = 24;
    let data: Vec<u8> = (0..RANGE).map(|i| (i * 31 % 251) as u8).collect();
    for _ in 0..RANGES {
        probe
            .write_all(&data)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let (reader, _) = open_reader(&[path.to_path_buf()], &ReaderOptions::default())
        .with_context(|| format!("opening {}", path.display()))?;
    let read_batch = |first: usize| -> Result<u64> {
        let ranges = (first..first + BATCH)
            .map(|r| ByteRange {
                file: 0,
                offset: ((r % RANGES) * RANGE) as u64,
                len: RANGE,
            })
            .collect();
        let (tx, rx) = std::sync::mpsc::channel();
        reader.submit(
            ranges,
            Box::new(move |r| {
                let _ = tx.send(r.map(|bufs| bufs.len()));
            }),
        );
        rx.recv()
            .context("the reader stopped")?
            .with_context(|| format!("reading {}", path.display()))?;
        Ok((BATCH * RANGE) as u64)
    };

    // The compute: one activation row through 64 MiB of bf16 matrices, `passes` times.
    let (rows, cols, count) = (4096, 1024, 8);
    let weights =
        ProbeWeights::new(DType::BF16, count * rows, cols).context("bf16 probe matrices")?;
    let matrices = weights.matrices(rows);
    let x = probe_activations(cols);
    let mut out = vec![0f32; rows];
    let mut compute = |passes: usize| {
        let t = Instant::now();
        for _ in 0..passes {
            for w in &matrices {
                matmul(&x, w, &mut out);
            }
        }
        std::hint::black_box(&out);
        t.elapsed().as_secs_f64()
    };
    compute(1);
    read_batch(0)?;
    let passes = (0.5 / compute(1).max(1e-6)).ceil().clamp(2.0, 10_000.0) as usize;

    let mut rates = Vec::new();
    for _ in 0..3 {
        let stop = AtomicBool::new(false);
        let bytes = AtomicU64::new(0);
        let (with_reads, reading) = std::thread::scope(|s| {
            let reading = s.spawn(|| -> Result<()> {
                let mut next = 0;
                while !stop.load(Ordering::Relaxed) {
                    bytes.fetch_add(read_batch(next)?, Ordering::Relaxed);
                    next += BATCH;
                }
                Ok(())
            });
            let secs = compute(passes);
            let read = bytes.load(Ordering::Relaxed);
            stop.store(true, Ordering::Relaxed);
            ((secs, read), reading.join())
        });
        reading.map_err(|_| anyhow::anyhow!("the page-cache probe's reader panicked"))??;
        let (secs, read) = with_reads;
        rates.push(read as f64 / secs / 1e9);
    }
    Ok(median(&mut rates))
}

/// The median of `values` (not empty).
fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Write the probe file `path` through `probe` (its open, locked handle), then time reading it.
fn measure_disk(path: &std::path::Path, mut probe: std::fs::File) -> Result<(f64, String)> {
    const BLOCK: usize = 4 << 20;
    const BLOCKS: usize = 256;
    let block: Vec<u8> = (0..BLOCK).map(|i| (i * 31 % 251) as u8).collect();
    for _ in 0..BLOCKS {
        probe
            .write_all(&block)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    probe
        .sync_all()
        .with_context(|| format!("writing {}", path.display()))?;
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    let (file, source) = match direct {
        Ok(f) => (f, "O_DIRECT reads, 4 MiB blocks, 4 in flight".to_string()),
        Err(_) => (
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?,
            "buffered reads (O_DIRECT refused here), may include page cache".to_string(),
        ),
    };
    let t = Instant::now();
    let result: std::io::Result<()> = (0..4usize).into_par_iter().try_for_each(|r| {
        // A 4096-aligned buffer inside an over-allocated vector.
        let mut raw = vec![0u8; BLOCK + 4096];
        let off = raw.as_ptr().align_offset(4096);
        let buf = &mut raw[off..off + BLOCK];
        let mut b = r;
        while b < BLOCKS {
            file.read_exact_at(buf, (b * BLOCK) as u64)?;
            b += 4;
        }
        Ok(())
    });
    let secs = t.elapsed().as_secs_f64();
    result.context("reading the bandwidth probe file")?;
    Ok(((BLOCK * BLOCKS) as f64 / secs / 1e9, source))
}

/// GB/s reading up to 256 MiB of the largest `*.safetensors` file in `dir` (O_DIRECT where the
/// filesystem allows, else buffered), or `None` if there is none or it cannot be read.
pub fn drive_read_bandwidth(dir: &std::path::Path) -> Option<f64> {
    const BLOCK: usize = 4 << 20;
    let largest = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .max_by_key(|p| p.metadata().map(|m| m.len()).unwrap_or(0))?;
    let len = largest.metadata().ok()?.len() as usize;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&largest)
        .or_else(|_| std::fs::File::open(&largest))
        .ok()?;
    let blocks = (len / BLOCK).clamp(1, 64);
    let mut raw = vec![0u8; BLOCK + 4096];
    let off = raw.as_ptr().align_offset(4096);
    let buf = &mut raw[off..off + BLOCK];
    let t = Instant::now();
    let mut read = 0usize;
    for b in 0..blocks {
        let n = file.read_at(buf, (b * BLOCK) as u64).ok()?;
        read += n;
        if n < BLOCK {
            break;
        }
    }
    (read > 0).then(|| read as f64 / t.elapsed().as_secs_f64() / 1e9)
}
