//! Whether this machine lets a test make file systems of its own in a private user and mount
//! namespace (`unshare -Urm`, no privilege needed). Used by engine/tests/state_write_faults.rs
//! and included by path by server/tests/state.rs: one probe, one "skipped" message.

use std::process::Command;

/// Run `check` (a shell command) in a private user and mount namespace; `true` if it succeeds,
/// otherwise print why the calling test is skipped and return `false`.
pub fn private_mounts_or_skip(check: &str) -> bool {
    let probe = Command::new("unshare")
        .args(["-Urm", "sh", "-c", check])
        .output();
    match probe {
        Ok(out) if out.status.success() => true,
        Ok(out) => {
            eprintln!(
                "skipped: no private user and mount namespace here (unshare -Urm): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            false
        }
        Err(e) => {
            eprintln!("skipped: unshare (util-linux) cannot run: {e}");
            false
        }
    }
}
