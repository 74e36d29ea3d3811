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

/// The default RAM budget: 80 % of available memory less 1 GiB of headroom, at least 256 MiB.
pub fn default_budget() -> u64 {
    let avail = available_memory().unwrap_or(4 << 30);
    ((avail as f64 * 0.8) as u64)
        .saturating_sub(1 << 30)
        .max(256 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

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
