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
