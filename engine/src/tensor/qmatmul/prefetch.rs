//! How far ahead of the weight bytes in hand the product kernels ask the memory for more.
//!
//! A software prefetch is only a hint: it changes when bytes arrive, never which bytes are
//! read or how they are summed, so every distance gives the same bits (tested). The distance
//! that streams one core's products fastest is a property of the core's memory pipeline, and
//! the best one differs between processor generations in opposite directions (§29.3, §30 of
//! docs/benchmarks.md), so it is chosen once per process from the CPUID vendor and family
//! ([`plan_for`]), each entry measured on that processor with `examples/qmatmul_speed.rs`
//! (`QMATMUL_AHEAD`, `QMATMUL_ROWS_AHEAD`: distances alternating product by product). The
//! setters exist for that measuring and for the tests.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// The prefetch distances of the kernels on one processor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Records past the one in hand whose lines the 512-bit interleaved Q4_K kernel asks for
    /// (`interleaved::avx512`; a record is `interleaved::GROUP_BLOCK_BYTES`).
    pub records_ahead: usize,
    /// Bytes past the weight bytes in hand from which the row kernels (AVX2, VNNI and 512-bit,
    /// one weight row at a time in the file's layout) ask for the bytes they step.
    pub row_bytes_ahead: usize,
}

/// The distances where no processor-specific entry applies. The row kernels' 3 KiB, measured
/// streaming one activation row through matrices much larger than the caches (§25, §26): on a
/// Zen 3 (AVX2 kernels) 1.2-1.3× (Q8_0) and 1.2-1.4× (Q6_K) faster than the half KiB or less
/// it replaced; on a Zen 4 (VNNI and 512-bit kernels) Q8_0, Q6_K and Q5_K 1.07-1.10× faster
/// than sixteen or two blocks, 1 KiB no better, 2-4 KiB all close; the hardware prefetchers
/// alone do not keep one core's loads fed. The records' "the one in hand": on a Zen 4 (§29.3)
/// 2.76 ms for a 75 MB matrix against 3.1-3.5 ms for 1-4 records ahead; on an Intel Xeon
/// (§23) 55-57 ms for 604 MB against 59-61 ms with no software prefetch and 66-71 ms two
/// records ahead.
pub const DEFAULT_PLAN: Plan = Plan {
    records_ahead: 0,
    row_bytes_ahead: 3072,
};

/// The plan measured best on a processor, by CPUID vendor string and family:
/// - AMD family 1Ah (Zen 5, §30): the records 8 ahead (9.3 KiB): one row through a 75 MB
///   matrix in 1.75-2.29 ms against 2.41-3.26 ms for the record in hand; 12-16 records 0-9 %
///   faster than 8 there but no faster in the whole model, whose matrices are ~1 MiB (the
///   prefetches past each matrix's end are wasted). The row kernels 6 KiB ahead: Q8_0 (68 MB)
///   2.56-2.98 ms against 2.97-3.18 ms at 3 KiB, Q6_K (51 MB) 1.78-1.90 against 2.00-2.11.
/// - Every other processor: [`DEFAULT_PLAN`] (measured on Zen 3, Zen 4 and an Intel Xeon).
pub fn plan_for(vendor: &[u8; 12], family: u32) -> Plan {
    match (vendor, family) {
        (b"AuthenticAMD", 0x1A) => Plan {
            records_ahead: 8,
            row_bytes_ahead: 6144,
        },
        _ => DEFAULT_PLAN,
    }
}

/// The most records ahead [`set_records_ahead`] takes (75 KiB: far past any useful distance).
pub const MAX_RECORDS_AHEAD: usize = 64;

/// The most bytes ahead [`set_row_bytes_ahead`] takes.
pub const MAX_ROW_BYTES_AHEAD: usize = 1 << 20;

/// Not set: this CPU's plan applies.
const UNSET: usize = usize::MAX;

static RECORDS_AHEAD: AtomicUsize = AtomicUsize::new(UNSET);
static ROW_BYTES_AHEAD: AtomicUsize = AtomicUsize::new(UNSET);

/// This processor's plan ([`plan_for`] its CPUID), read once.
pub fn cpu_plan() -> Plan {
    static PLAN: std::sync::OnceLock<Plan> = std::sync::OnceLock::new();
    *PLAN.get_or_init(|| {
        let (vendor, family) = cpu_vendor_family();
        plan_for(&vendor, family)
    })
}

/// Records ahead for the interleaved Q4_K kernel: as [`set_records_ahead`] set it, else this
/// CPU's plan.
#[inline]
pub fn records_ahead() -> usize {
    distance(&RECORDS_AHEAD, || cpu_plan().records_ahead)
}

/// Bytes ahead for the row kernels: as [`set_row_bytes_ahead`] set it, else this CPU's plan.
/// (The kernels read it once per block: one relaxed load once the plan is cached.)
#[inline]
pub fn row_bytes_ahead() -> usize {
    distance(&ROW_BYTES_AHEAD, || cpu_plan().row_bytes_ahead)
}

/// Set the interleaved kernel's distance in records (at most [`MAX_RECORDS_AHEAD`]), or
/// `None` for this CPU's plan. The same bits at every distance.
pub fn set_records_ahead(records: Option<usize>) {
    set_distance(&RECORDS_AHEAD, records, MAX_RECORDS_AHEAD);
}

/// Set the row kernels' distance in bytes (at most [`MAX_ROW_BYTES_AHEAD`]), or `None` for
/// this CPU's plan. The same bits at every distance.
pub fn set_row_bytes_ahead(bytes: Option<usize>) {
    set_distance(&ROW_BYTES_AHEAD, bytes, MAX_ROW_BYTES_AHEAD);
}

/// The distance in `cell`; where none is set, `plan()`'s, stored in `cell` for the next reads
/// (unless a distance was set meanwhile).
#[inline]
fn distance(cell: &AtomicUsize, plan: impl FnOnce() -> usize) -> usize {
    match cell.load(Relaxed) {
        UNSET => {
            let v = plan();
            let _ = cell.compare_exchange(UNSET, v, Relaxed, Relaxed);
            v
        }
        n => n,
    }
}

/// Put `v` (at most `max`) in `cell`, or `None`: the plan's again at the next read.
fn set_distance(cell: &AtomicUsize, v: Option<usize>, max: usize) {
    cell.store(v.map_or(UNSET, |v| v.min(max)), Relaxed);
}

/// This CPU's CPUID vendor string and family (the base family, plus the extended family
/// where the base is 0xF); zeros off x86_64.
pub fn cpu_vendor_family() -> ([u8; 12], u32) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // Leaves 0 and 1 exist on every x86_64 processor.
        let (leaf0, leaf1) = (__cpuid(0), __cpuid(1));
        let mut vendor = [0u8; 12];
        vendor[0..4].copy_from_slice(&leaf0.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&leaf0.edx.to_le_bytes());
        vendor[8..12].copy_from_slice(&leaf0.ecx.to_le_bytes());
        let base = (leaf1.eax >> 8) & 0xF;
        let family = if base == 0xF {
            base + ((leaf1.eax >> 20) & 0xFF)
        } else {
            base
        };
        (vendor, family)
    }
    #[cfg(not(target_arch = "x86_64"))]
    ([0; 12], 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vendor and family read by CPUID are those the kernel reports in /proc/cpuinfo
    /// (where there is one), so the plan is chosen for the processor it runs on.
    #[test]
    fn cpu_vendor_and_family_are_the_kernels() {
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            eprintln!("no /proc/cpuinfo here: nothing to compare CPUID with");
            return;
        };
        if !cfg!(target_arch = "x86_64") {
            eprintln!("not x86_64: CPUID is not read here");
            return;
        }
        let field = |name: &str| {
            info.lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    (k.trim() == name).then(|| v.trim().to_string())
                })
                .expect("a field of /proc/cpuinfo")
        };
        let (vendor, family) = cpu_vendor_family();
        assert_eq!(std::str::from_utf8(&vendor).unwrap(), field("vendor_id"));
        assert_eq!(family.to_string(), field("cpu family"));
    }

    /// Set distances are clamped to their limits, `None` gives the plan back, and a read with
    /// none set caches the plan (on a cell of the test's own: the process's cells are shared
    /// with tests that set distances concurrently).
    #[test]
    fn set_distances_are_bounded_and_reset() {
        let cell = AtomicUsize::new(UNSET);
        let plans = std::cell::Cell::new(0);
        let plan = || {
            plans.set(plans.get() + 1);
            7
        };
        assert_eq!(distance(&cell, plan), 7);
        assert_eq!(distance(&cell, plan), 7);
        assert_eq!(plans.get(), 1, "the plan is read once, then cached");
        set_distance(&cell, Some(usize::MAX - 1), 64);
        assert_eq!(distance(&cell, plan), 64);
        set_distance(&cell, Some(3), 64);
        assert_eq!(distance(&cell, plan), 3);
        set_distance(&cell, None, 64);
        assert_eq!(distance(&cell, plan), 7);
        assert_eq!(plans.get(), 2);
        assert!(records_ahead() <= MAX_RECORDS_AHEAD);
        assert!(row_bytes_ahead() <= MAX_ROW_BYTES_AHEAD);
    }
}
