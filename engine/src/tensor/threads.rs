//! The compute thread pool. Kernels split work by output rows, never by the reduction
//! dimension, so the number of threads changes who computes a value, not how.

use crate::{Error, Result};

/// Configure the global compute pool with `threads` threads (0 = all cores).
/// Can be called once per process; later calls with the same count are no-ops.
pub fn init(threads: usize) -> Result<usize> {
    let n = if threads == 0 {
        default_threads()
    } else {
        threads
    };
    match rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("coli-compute-{i}"))
        .build_global()
    {
        Ok(()) => Ok(n),
        Err(_) if rayon::current_num_threads() == n => Ok(n),
        Err(e) => Err(Error::Invalid(format!(
            "cannot set up {n} compute threads: {e} (pool already has {})",
            rayon::current_num_threads()
        ))),
    }
}

/// All available cores.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Threads in the compute pool.
pub fn current() -> usize {
    rayon::current_num_threads()
}
