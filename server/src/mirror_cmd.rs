//! `coli mirror plan|stage|verify`: fill a second drive with the checkpoint files that serve
//! the most expert reads, so that `--mirror DIR` (`mirrors` in the configuration) spreads
//! those reads over both drives.
//!
//! - `plan` ranks the model's files by their share of the routed-expert reads (the experts
//!   each holds, weighted by the usage history; [`colibri::store::staging::rank_files`]) and
//!   chooses, in that order, those that fit the byte budget and leave the free-space reserve;
//! - `stage` copies the chosen files into the mirror directory (each through a temporary,
//!   SHA-256 verified against the primary, never replacing a file; see
//!   [`colibri::store::staging::stage_file`]), journalling each one done, and publishes the
//!   receipt atomically at the end. Rerun after an interruption, it re-verifies what the journal
//!   or receipt lists instead of copying it again, and continues a file's interrupted copy;
//! - `verify` checks every file the receipt lists (and any other file under a checkpoint
//!   file's name, which a mirror would also serve) against the receipt and the primary.
//!
//! The primary is only read; no mirror file is ever deleted or replaced.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use colibri::store::budget::format_size;
use colibri::store::history::{self, UsageHistory};
use colibri::store::staging::{
    check_copy, rank_files, stage_file, FileUsage, Phase, Receipt, ReceiptEntry, Verdict,
    JOURNAL_FILE, RECEIPT_FILE,
};
use serde::Serialize;

use crate::engine_options::Size;

/// Arguments of `coli mirror`.
#[derive(clap::Args, Debug)]
pub struct MirrorArgs {
    #[command(subcommand)]
    pub command: MirrorCommand,
}

/// The `coli mirror` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum MirrorCommand {
    /// Rank the model's files by the expert reads they serve and choose those to stage.
    Plan(PlanArgs),
    /// Copy the chosen files to the mirror drive (verified, resumable) and write its receipt.
    Stage(PlanArgs),
    /// Check a mirror against its receipt and the primary.
    Verify(VerifyArgs),
}

/// Arguments of `coli mirror plan` and `coli mirror stage`.
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The model directory (or .gguf file): the primary.
    #[arg(long, short = 'm', value_name = "MODEL")]
    pub model: PathBuf,
    /// The mirror directory on the second drive (created by `stage`; optional for `plan`,
    /// which then ignores free space).
    #[arg(long, value_name = "DIR")]
    pub to: Option<PathBuf>,
    /// Bytes of this model's files the mirror may hold in all (those already there count),
    /// e.g. 200G [default: as many as the free space allows].
    #[arg(long, value_name = "SIZE")]
    pub budget: Option<Size>,
    /// Free space to leave on the mirror's drive [default: 2 % of the drive, at least 1G].
    #[arg(long, value_name = "SIZE")]
    pub reserve: Option<Size>,
    /// Print the plan as JSON (`plan` only).
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `coli mirror verify`.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// The model directory (or .gguf file): the primary.
    #[arg(long, short = 'm', value_name = "MODEL")]
    pub model: PathBuf,
    /// The mirror directory to check.
    #[arg(long, value_name = "DIR")]
    pub mirror: PathBuf,
}

/// Run `coli mirror`.
pub fn run(a: MirrorArgs) -> Result<()> {
    match a.command {
        MirrorCommand::Plan(p) => plan_command(p),
        MirrorCommand::Stage(p) => stage_command(p),
        MirrorCommand::Verify(v) => verify_command(v),
    }
}

/// What the mirror directory holds of a file.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "snake_case")]
enum OnMirror {
    /// Nothing (or no mirror directory named).
    Absent,
    /// A file of that name, listed in the receipt or the journal.
    Staged,
    /// A file of that name the receipt does not list.
    Unlisted,
}

/// One file of the plan.
#[derive(Debug, Clone, Serialize)]
struct Planned {
    name: String,
    #[serde(flatten)]
    usage: FileUsage,
    on_mirror: OnMirror,
    chosen: bool,
    /// Why it is or is not chosen.
    why: String,
}

/// The plan: every file, most expert reads first.
#[derive(Debug, Serialize)]
struct Plan {
    model: PathBuf,
    mirror: Option<PathBuf>,
    /// What the ranking is based on.
    history: String,
    budget: Option<u64>,
    reserve: Option<u64>,
    /// Free bytes on the mirror's drive.
    free: Option<u64>,
    files: Vec<Planned>,
    /// Bytes of the chosen files, and of those among them still to copy.
    chosen_bytes: u64,
    to_copy_bytes: u64,
    /// The share of the expert reads the chosen files serve.
    chosen_share: f64,
}

/// The primary's directory (a model directory, or the directory of a GGUF file).
fn primary_dir(model: &Path) -> PathBuf {
    if model.is_file() {
        model
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
    } else {
        model.to_path_buf()
    }
}

/// Free and total bytes of the file system holding `dir`.
fn space(dir: &Path) -> Result<(u64, u64)> {
    let st = rustix::fs::statvfs(dir)
        .with_context(|| format!("checking the free space of {}", dir.display()))?;
    Ok((
        st.f_bavail.saturating_mul(st.f_frsize),
        st.f_blocks.saturating_mul(st.f_frsize),
    ))
}

/// The receipt's and the journal's entries (the journal's win): what a staging verified.
fn staged_entries(mirror: &Path) -> Result<Receipt> {
    let mut done =
        Receipt::read(&mirror.join(RECEIPT_FILE))?.unwrap_or_else(|| Receipt::new(Path::new("")));
    if let Some(journal) = Receipt::read(&mirror.join(JOURNAL_FILE))? {
        for e in journal.shards {
            done.put(e);
        }
    }
    Ok(done)
}

/// Rank the model's files and choose those to stage.
fn make_plan(a: &PlanArgs) -> Result<Plan> {
    let layout = colibri::model::expert_layout(&a.model)
        .with_context(|| format!("reading the layout of {}", a.model.display()))?
        .with_context(|| {
            format!(
                "{} has no routed experts: a mirror only serves routed-expert reads",
                a.model.display()
            )
        })?;
    let (history, described) = load_history(&a.model, &layout.experts_per_layer());
    let ranked = rank_files(&layout, history.as_ref())?;
    let (done, free, reserve) = match &a.to {
        Some(dir) if dir.is_dir() => {
            let (free, total) = space(dir)?;
            let reserve = a
                .reserve
                .as_ref()
                .map_or((total / 50).max(1 << 30), |s| s.bytes);
            (staged_entries(dir)?, Some(free), Some(reserve))
        }
        Some(dir) => {
            // Not created yet: the free space of the nearest existing ancestor.
            let existing = dir
                .ancestors()
                .find(|p| p.is_dir())
                .unwrap_or(Path::new("."));
            let (free, total) = space(existing)?;
            let reserve = a
                .reserve
                .as_ref()
                .map_or((total / 50).max(1 << 30), |s| s.bytes);
            (Receipt::new(Path::new("")), Some(free), Some(reserve))
        }
        None => (
            Receipt::new(Path::new("")),
            None,
            a.reserve.as_ref().map(|s| s.bytes),
        ),
    };
    let budget = a.budget.as_ref().map(|s| s.bytes);
    let mut files = Vec::new();
    let (mut chosen_bytes, mut to_copy, mut share) = (0u64, 0u64, 0.0f64);
    for usage in ranked {
        let name = usage
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let on_mirror = match &a.to {
            Some(dir) if dir.join(&name).exists() => {
                if done.entry(&name).is_some() {
                    OnMirror::Staged
                } else {
                    OnMirror::Unlisted
                }
            }
            _ => OnMirror::Absent,
        };
        let new = on_mirror == OnMirror::Absent;
        let over_budget = budget.is_some_and(|b| chosen_bytes + usage.size > b);
        let no_room = new
            && match (free, reserve) {
                (Some(f), Some(r)) => to_copy + usage.size + r > f,
                _ => false,
            };
        let (chosen, why) = if usage.expert_bytes == 0 {
            (false, "holds no routed experts".to_string())
        } else if over_budget {
            (false, "over the budget".to_string())
        } else if no_room {
            (false, "would cut into the free-space reserve".to_string())
        } else if new {
            (true, "to copy".to_string())
        } else {
            (true, "on the mirror already".to_string())
        };
        if chosen {
            chosen_bytes += usage.size;
            share += usage.share;
            if new {
                to_copy += usage.size;
            }
        }
        files.push(Planned {
            name,
            usage,
            on_mirror,
            chosen,
            why,
        });
    }
    Ok(Plan {
        model: a.model.clone(),
        mirror: a.to.clone(),
        history: described,
        budget,
        reserve,
        free,
        files,
        chosen_bytes,
        to_copy_bytes: to_copy,
        chosen_share: share,
    })
}

/// The model's usage history and a sentence saying what the ranking is based on.
pub(crate) fn load_history(
    model: &Path,
    experts_per_layer: &[usize],
) -> (Option<UsageHistory>, String) {
    let uniform =
        "no usage history: every expert counted alike (serve or bench the model to record one)";
    let Some(state) = history::state_dir() else {
        return (None, uniform.to_string());
    };
    let loaded = history::fingerprint(model)
        .and_then(|fp| UsageHistory::load(&state, &fp, experts_per_layer));
    match loaded {
        Ok((h, None)) if !h.is_empty() => {
            let text = format!(
                "the usage history of {} tokens in {}",
                h.tokens(),
                state.join("usage").display()
            );
            (Some(h), text)
        }
        Ok((_, Some(warning))) => {
            eprintln!("coli: warning: {warning}");
            (None, uniform.to_string())
        }
        Ok(_) => (None, uniform.to_string()),
        Err(e) => {
            eprintln!("coli: warning: cannot read the usage history: {e}");
            (None, uniform.to_string())
        }
    }
}

fn print_plan(p: &Plan) {
    println!("model:   {}", p.model.display());
    println!("ranking: {}", p.history);
    if let Some(m) = &p.mirror {
        println!(
            "mirror:  {} ({} free, {} reserved)",
            m.display(),
            p.free.map_or("-".into(), format_size),
            p.reserve.map_or("-".into(), format_size)
        );
    }
    if let Some(b) = p.budget {
        println!("budget:  {}", format_size(b));
    }
    println!(
        "{:>4}  {:<40} {:>10} {:>8} {:>12} {:>9}  {:<6} why",
        "rank", "file", "size", "experts", "expert bytes", "reads %", "stage"
    );
    for (i, f) in p.files.iter().enumerate() {
        println!(
            "{:>4}  {:<40} {:>10} {:>8} {:>12} {:>8.2}%  {:<6} {}",
            i + 1,
            f.name,
            format_size(f.usage.size),
            f.usage.experts,
            format_size(f.usage.expert_bytes),
            100.0 * f.usage.share,
            if f.chosen { "yes" } else { "no" },
            f.why
        );
    }
    println!(
        "chosen:  {} files, {} ({} to copy), serving {:.1} % of the expert reads",
        p.files.iter().filter(|f| f.chosen).count(),
        format_size(p.chosen_bytes),
        format_size(p.to_copy_bytes),
        100.0 * p.chosen_share
    );
}

fn plan_command(a: PlanArgs) -> Result<()> {
    let plan = make_plan(&a)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
    } else {
        print_plan(&plan);
    }
    Ok(())
}

/// A progress bar on stderr when it is a terminal (hidden otherwise).
fn bar(total: u64, message: String) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new(total);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    b.set_message(message);
    b
}

/// The progress callback of one file: the bar, its message naming the phase.
fn progress(bar: &indicatif::ProgressBar, label: String) -> impl FnMut(Phase, u64, u64) + '_ {
    let mut last = None;
    move |phase, done, total| {
        if last != Some(phase) {
            last = Some(phase);
            let what = match phase {
                Phase::Copy { resumed: 0 } => "copying".to_string(),
                Phase::Copy { resumed } => {
                    format!("copying (continued from {})", format_size(resumed))
                }
                Phase::Verify => "verifying the copy".to_string(),
                Phase::Hash => "hashing".to_string(),
            };
            bar.set_message(format!("{label} {what}"));
            bar.set_length(total);
        }
        bar.set_position(done);
    }
}

fn stage_command(a: PlanArgs) -> Result<()> {
    let Some(to) = a.to.clone() else {
        bail!("coli mirror stage needs --to DIR, the mirror directory on the second drive");
    };
    let primary = primary_dir(&a.model);
    std::fs::create_dir_all(&to).with_context(|| format!("creating {}", to.display()))?;
    let same = |x: &Path, y: &Path| matches!((x.canonicalize(), y.canonicalize()), (Ok(p), Ok(q)) if p == q);
    if same(&to, &primary) {
        bail!(
            "--to {}: is the model's own directory; a mirror must be another directory, on another drive",
            to.display()
        );
    }
    // One staging per mirror directory at a time: held until this process ends.
    let lock = std::fs::File::open(&to).with_context(|| format!("opening {}", to.display()))?;
    if !colibri::format::write::try_lock_exclusive(&lock) {
        bail!(
            "{}: another `coli mirror stage` is writing this directory; wait for it to finish",
            to.display()
        );
    }
    let plan = make_plan(&a)?;
    print_plan(&plan);
    let mut done = staged_entries(&to)?;
    done.primary = std::path::absolute(&primary)
        .unwrap_or_else(|_| primary.clone())
        .display()
        .to_string();
    let chosen: Vec<&Planned> = plan.files.iter().filter(|f| f.chosen).collect();
    let journal = to.join(JOURNAL_FILE);
    let t0 = Instant::now();
    let (mut copied, mut kept) = (0u64, 0u64);
    let mut stopped = None;
    for (i, f) in chosen.iter().enumerate() {
        let label = format!("[{}/{}] {}", i + 1, chosen.len(), f.name);
        let source = &f.usage.path;
        let dest = to.join(&f.name);
        let b = bar(f.usage.size, label.clone());
        let mut report = progress(&b, label.clone());
        let entry = if dest.exists() {
            // A copy killed between publishing and removing its temporary left one behind.
            colibri::format::write::remove_stale_temporaries_of(&dest);
            let claimed = done.entry(&f.name).cloned();
            eprintln!(
                "coli mirror: {label}: on the mirror already; verifying it against {}",
                if claimed.is_some() {
                    "the receipt and the primary"
                } else {
                    "the primary (no receipt lists it)"
                }
            );
            let entry = match claimed {
                Some(e) => e,
                None => {
                    let (sha256, size) =
                        colibri::store::staging::sha256_file(source, false, &mut report)?;
                    ReceiptEntry {
                        shard: f.name.clone(),
                        size,
                        sha256,
                    }
                }
            };
            match check_copy(source, &dest, &entry, &mut report)? {
                Verdict::Identical => {}
                Verdict::CopyDiffers { sha256, .. } => bail!(
                    "{}: differs from the primary {} (SHA-256 {sha256}, expected {}); a mirror file is never deleted or replaced: remove it yourself and rerun",
                    dest.display(),
                    source.display(),
                    entry.sha256
                ),
                Verdict::PrimaryDiffers { sha256, .. } => bail!(
                    "{}: the primary changed since {} was staged (SHA-256 {sha256}, the receipt says {}); remove the mirror copy and rerun",
                    source.display(),
                    dest.display(),
                    entry.sha256
                ),
                Verdict::Missing => bail!("{}: disappeared while being checked", dest.display()),
            }
            kept += entry.size;
            entry
        } else {
            let (free, _) = space(&to)?;
            let reserve = plan.reserve.unwrap_or(0);
            if free < f.usage.size.saturating_add(reserve) {
                stopped = Some(format!(
                    "{}: needs {} but {} has {} free with {} to keep in reserve",
                    f.name,
                    format_size(f.usage.size),
                    to.display(),
                    format_size(free),
                    format_size(reserve)
                ));
                b.finish_and_clear();
                break;
            }
            eprintln!(
                "coli mirror: {label}: copying {} ({:.2} % of the expert reads)",
                format_size(f.usage.size),
                100.0 * f.usage.share
            );
            let staged = stage_file(source, &dest, &mut report)?;
            if staged.resumed > 0 {
                eprintln!(
                    "coli mirror: {label}: continued an interrupted copy at {}{}",
                    format_size(staged.resumed),
                    if staged.restarted {
                        ", which failed its checksum: copied again from the start"
                    } else {
                        ""
                    }
                );
            }
            copied += staged.entry.size;
            staged.entry
        };
        b.finish_and_clear();
        eprintln!(
            "coli mirror: {label}: identical to the primary (SHA-256 {})",
            entry.sha256
        );
        done.put(entry);
        done.write(&journal)
            .with_context(|| format!("writing the journal {}", journal.display()))?;
    }
    // The receipt lists what is verified on the mirror: the files of this staging and those
    // an earlier receipt listed.
    done.shards.sort_by(|x, y| x.shard.cmp(&y.shard));
    let receipt = to.join(RECEIPT_FILE);
    done.write(&receipt)
        .with_context(|| format!("writing the receipt {}", receipt.display()))?;
    let _ = std::fs::remove_file(&journal);
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "staged in {secs:.1} s: {} copied, {} verified in place; receipt {} lists {} files",
        format_size(copied),
        format_size(kept),
        receipt.display(),
        done.shards.len()
    );
    println!(
        "serve with it: coli serve --model {} --mirror {}",
        a.model.display(),
        to.display()
    );
    drop(lock);
    if let Some(why) = stopped {
        bail!("stopped before every chosen file was staged: {why}");
    }
    Ok(())
}

fn verify_command(a: VerifyArgs) -> Result<()> {
    let primary = primary_dir(&a.model);
    let receipt_path = a.mirror.join(RECEIPT_FILE);
    let Some(receipt) = Receipt::read(&receipt_path)? else {
        bail!(
            "{} does not exist: {} has no receipt (stage it with `coli mirror stage --to {}`)",
            receipt_path.display(),
            a.mirror.display(),
            a.mirror.display()
        );
    };
    if a.mirror.join(JOURNAL_FILE).exists() {
        eprintln!(
            "coli mirror: warning: {} holds the journal of an interrupted staging; rerun `coli mirror stage` to finish it",
            a.mirror.display()
        );
    }
    // Files under a checkpoint file's name that the receipt does not list: a mirror serves
    // them too, so they are checked against the primary as well.
    let mut entries: Vec<(ReceiptEntry, bool)> =
        receipt.shards.iter().cloned().map(|e| (e, true)).collect();
    let checkpoint_files: Vec<PathBuf> = match colibri::model::expert_layout(&a.model) {
        Ok(Some(layout)) => layout.files,
        _ => Vec::new(),
    };
    for f in &checkpoint_files {
        let Some(name) = f.file_name().map(|n| n.to_string_lossy().into_owned()) else {
            continue;
        };
        if receipt.entry(&name).is_none() && a.mirror.join(&name).exists() {
            let (sha256, size) = colibri::store::staging::sha256_file(f, false, &mut |_, _, _| {})?;
            entries.push((
                ReceiptEntry {
                    shard: name,
                    size,
                    sha256,
                },
                false,
            ));
        }
    }
    let mut failed = 0usize;
    let mut bytes = 0u64;
    for (i, (entry, listed)) in entries.iter().enumerate() {
        let label = format!("[{}/{}] {}", i + 1, entries.len(), entry.shard);
        let source = primary.join(&entry.shard);
        let copy = a.mirror.join(&entry.shard);
        let unlisted = if *listed { "" } else { " (not in the receipt)" };
        if !source.is_file() {
            failed += 1;
            println!(
                "FAIL  {}{unlisted}: the primary has no such file ({})",
                entry.shard,
                source.display()
            );
            continue;
        }
        let b = bar(entry.size, label.clone());
        let verdict = check_copy(&source, &copy, entry, &mut progress(&b, label.clone()))?;
        b.finish_and_clear();
        let why = match verdict {
            Verdict::Identical => {
                bytes += entry.size;
                println!(
                    "ok    {}{unlisted}: {}, SHA-256 {}, identical to the primary",
                    entry.shard,
                    format_size(entry.size),
                    entry.sha256
                );
                continue;
            }
            Verdict::Missing => "missing from the mirror".to_string(),
            Verdict::CopyDiffers { size, sha256 } => format!(
                "the copy has {size} bytes with SHA-256 {sha256}, the receipt says {} with {}",
                entry.size, entry.sha256
            ),
            Verdict::PrimaryDiffers { size, sha256 } => format!(
                "the primary has {size} bytes with SHA-256 {sha256}, the receipt says {} with {} (the model changed: stage the mirror again)",
                entry.size, entry.sha256
            ),
        };
        failed += 1;
        println!("FAIL  {}{unlisted}: {why}", entry.shard);
    }
    if failed > 0 {
        bail!(
            "{failed} of {} mirror files failed verification; do not serve with --mirror {} until they are fixed (remove them and rerun `coli mirror stage`)",
            entries.len(),
            a.mirror.display()
        );
    }
    println!(
        "verified: {} files, {} on {} identical to the primary {} (receipt {})",
        entries.len(),
        format_size(bytes),
        a.mirror.display(),
        primary.display(),
        receipt_path.display()
    );
    Ok(())
}
