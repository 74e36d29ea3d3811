//! This machine's bandwidths, measured once and cached in the cache directory: memory read
//! bandwidth (every core summing a large buffer) and disk read bandwidth (O_DIRECT
//! sequential reads of a scratch file, 4 MiB blocks, 4 in flight).

use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::time::Instant;

use anyhow::{Context, Result};
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
}

/// The cached measurement, or a new one (saved atomically).
pub fn bandwidths(remeasure: bool) -> Result<Bandwidths> {
    let path = crate::demo::cache_dir()?.join("machine.json");
    if !remeasure {
        if let Ok(text) = std::fs::read_to_string(&path) {
            if let Ok(b) = serde_json::from_str::<Bandwidths>(&text) {
                return Ok(b);
            }
        }
    }
    eprintln!(
        "coli: measuring this machine's disk and memory bandwidth once (cached in {})",
        path.display()
    );
    let dir = path.parent().unwrap().to_path_buf();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // On a pool of its own with every core: measuring on the global compute pool would create
    // that pool before the command could size it to `--threads`.
    let measure = || (memory_bandwidth(), disk_bandwidth(&dir));
    let (memory, disk) = match rayon::ThreadPoolBuilder::new()
        .num_threads(colibri::tensor::threads::default_threads())
        .build()
    {
        Ok(pool) => pool.install(measure),
        Err(_) => measure(),
    };
    let (disk, source) = disk?;
    let b = Bandwidths {
        disk_gb_per_s: disk,
        memory_gb_per_s: memory,
        disk_source: source,
        measured_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    colibri::format::write::write_atomic(&path, serde_json::to_string_pretty(&b)?.as_bytes())?;
    Ok(b)
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
