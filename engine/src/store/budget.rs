//! Memory budgets: parsing sizes such as `512M` or `6G`, and the default budget derived from
//! the memory this machine has available.

use crate::{Error, Result};

/// Parse a size: a number with an optional `K`, `M`, `G` or `T` suffix (powers of 1024; a
/// trailing `B` or `iB` is accepted), e.g. `512M`, `6G`, `1.5GiB`, `1048576`.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let body = upper.trim_end_matches("IB").trim_end_matches('B');
    let (num, mult) = match body.chars().last() {
        Some('K') => (&body[..body.len() - 1], 1u64 << 10),
        Some('M') => (&body[..body.len() - 1], 1 << 20),
        Some('G') => (&body[..body.len() - 1], 1 << 30),
        Some('T') => (&body[..body.len() - 1], 1 << 40),
        _ => (body, 1),
    };
    let v: f64 = num.trim().parse().map_err(|_| {
        Error::Invalid(format!(
            "`{s}` is not a size (expected e.g. 512M, 6G or a byte count)"
        ))
    })?;
    if !v.is_finite() || v < 0.0 {
        return Err(Error::Invalid(format!(
            "`{s}` is not a size: it must be non-negative"
        )));
    }
    Ok((v * mult as f64) as u64)
}

/// A byte count for people: bytes below 1 KiB, then KiB and MiB with one decimal, GiB and
/// TiB with two (powers of 1024, the units [`parse_size`] reads), so that small sizes show
/// their number instead of `0.00 GB`. Rounded to nearest; see [`format_size_up`] for a
/// minimum someone is told to give.
pub fn format_size(bytes: u64) -> String {
    format_size_rounded(bytes, f64::round)
}

/// [`format_size`] rounded up at the precision shown, for a size to give at least ("raise
/// --ram to at least …"): [`parse_size`] of it is never below `bytes`.
pub fn format_size_up(bytes: u64) -> String {
    format_size_rounded(bytes, f64::ceil)
}

fn format_size_rounded(bytes: u64, round: fn(f64) -> f64) -> String {
    const UNITS: [(&str, u32, i32); 4] = [
        ("KiB", 10, 1),
        ("MiB", 20, 1),
        ("GiB", 30, 2),
        ("TiB", 40, 2),
    ];
    if bytes < 1 << 10 {
        return format!("{bytes} B");
    }
    // The largest unit the size reaches (TiB beyond).
    let &(name, shift, decimals) = UNITS
        .iter()
        .rev()
        .find(|&&(_, shift, _)| bytes >> shift > 0)
        .unwrap_or(&UNITS[0]);
    let scale = 10f64.powi(decimals);
    let v = round(bytes as f64 / (1u64 << shift) as f64 * scale) / scale;
    format!("{v:.prec$} {name}", prec = decimals as usize)
}

/// Memory available to new allocations (`MemAvailable` of /proc/meminfo), if known.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The memory limit of this process's cgroup (a container's `--memory`, a pod's limit), if one
/// is set: cgroup v2 `memory.max`, else v1 `memory.limit_in_bytes`, as seen from inside the
/// container (its cgroup namespace root).
pub fn cgroup_memory_limit() -> Option<u64> {
    let read = |path: &str| std::fs::read_to_string(path).ok();
    let limit = read("/sys/fs/cgroup/memory.max")
        .or_else(|| read("/sys/fs/cgroup/memory/memory.limit_in_bytes"))?;
    // "max" (v2) or a page-rounded i64::MAX (v1) mean no limit.
    let bytes: u64 = limit.trim().parse().ok()?;
    (bytes < 1 << 60).then_some(bytes)
}

/// The default RAM budget: 80 % of the memory this process may use — available memory, or the
/// cgroup's limit when that is smaller — less 1 GiB of headroom, at least 256 MiB.
pub fn default_budget() -> u64 {
    budget_from(available_memory(), cgroup_memory_limit())
}

/// [`default_budget`] from its two readings (unknown available memory counts as 4 GiB).
pub fn budget_from(available: Option<u64>, cgroup_limit: Option<u64>) -> u64 {
    let usable = available
        .unwrap_or(4 << 30)
        .min(cgroup_limit.unwrap_or(u64::MAX));
    ((usable as f64 * 0.8) as u64)
        .saturating_sub(1 << 30)
        .max(256 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_container_limit_below_available_memory_bounds_the_budget() {
        const G: u64 = 1 << 30;
        // 20 GiB available, no limit: 16 GiB less 1 GiB.
        assert_eq!(budget_from(Some(20 * G), None), 15 * G);
        // The same machine, a 4 GiB container: 3.2 GiB less 1 GiB.
        assert_eq!(budget_from(Some(20 * G), Some(4 * G)), (4 * G) * 8 / 10 - G);
        // A limit above what is available changes nothing; tiny limits keep the floor.
        assert_eq!(
            budget_from(Some(8 * G), Some(64 * G)),
            budget_from(Some(8 * G), None)
        );
        assert_eq!(budget_from(Some(8 * G), Some(G)), 256 << 20);
    }

    #[test]
    fn sizes_print_in_the_unit_that_shows_them() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(1023), "1023 B");
        assert_eq!(format_size(1536), "1.5 KiB");
        assert_eq!(format_size(5 << 20), "5.0 MiB");
        assert_eq!(format_size((3 << 30) + (1 << 29)), "3.50 GiB");
        assert_eq!(format_size(2 << 40), "2.00 TiB");
        // The case of the report: a few MiB is not "0.00 GB".
        assert_eq!(format_size(2_500_000), "2.4 MiB");
        // Nearest for what is, up for what is needed.
        assert_eq!(format_size((1 << 20) + 1), "1.0 MiB");
        assert_eq!(format_size_up((1 << 20) + 1), "1.1 MiB");
        assert_eq!(format_size_up(1 << 20), "1.0 MiB");
        // A minimum printed this way, given back as --ram, is enough.
        let mut b = 1u64;
        while b < 1 << 44 {
            for x in [b, b + 1, b * 3 / 2, b * 2 - 1] {
                let shown = format_size_up(x);
                assert!(parse_size(&shown).unwrap() >= x, "{x} shown as {shown}");
            }
            b *= 2;
        }
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("512M").unwrap(), 512 * 1024 * 1024);
        assert_eq!(parse_size("6G").unwrap(), 6 * 1024 * 1024 * 1024);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 * 512 * 1024 * 1024);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("0").unwrap(), 0);
        assert!(parse_size("lots").unwrap_err().to_string().contains("lots"));
        assert!(parse_size("-1G").is_err());
    }
}
