//! `colibri-pull`: `coli pull ORG/NAME[@REV] --to DIR` — a Hugging Face model repository
//! downloaded into a directory `coli serve --model DIR` reads: resumable, parallel, verified.
//!
//! What it does: the revision is resolved to one commit first and every file is fetched from
//! that commit (a branch that moves mid-pull cannot mix two versions); the files are chosen by
//! `--include` globs or by default (configs, tokenizer, chat template, safetensors and index;
//! or the repository's one GGUF file: [`select`]); the free space is checked against what is
//! left to fetch before anything is written; up to `--jobs` files download at once, each into
//! a `.part` file resumed with a `Range` request after an interruption, verified against the
//! Hub's hash (LFS files: SHA-256, the tree API's `lfs.oid` and the `X-Linked-Etag` header;
//! files kept in git: the git blob SHA-1 of the tree's `oid` and the `ETag`), and renamed into
//! place only then ([`fetch`]); a receipt of what landed, with every file's SHA-256, is
//! rewritten atomically after each file and marked complete at the end ([`receipt`]). A
//! complete receipt for the same repository, revision and patterns makes a rerun a no-op that
//! does not touch the network — what the Helm chart's init container relies on at every pod
//! start. Two pulls into one directory take turns (an advisory lock on the directory).
//!
//! Why not the `hf-hub` crate: it downloads into the Hugging Face cache layout (blobs and
//! snapshot symlinks under `~/.cache/huggingface`), not into a plain directory on the model
//! volume; it does not verify the bytes against the Hub's SHA-256; its resumption and
//! parallel downloads are per-chunk of one file, not a bounded number of files; and it brings
//! a second HTTP stack (reqwest 0.12, ureq) beside the workspace's reqwest 0.13. The Hub's
//! API is three GET requests, so this crate speaks it directly with the workspace's reqwest
//! (blocking, rustls with `ring`, whose digests also do the hashing), with
//! [`HF_ENDPOINT`](PullArgs::endpoint) for mirrors and local test servers.

pub mod fetch;
pub mod hub;
pub mod receipt;
pub mod select;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use colibri::store::budget::format_size;

pub use hub::{Check, RemoteFile, RepoSpec};
pub use receipt::{read_receipt, Receipt, ReceiptFile};

/// The receipt's file name in the target directory.
pub const RECEIPT: &str = "coli-pull.json";
/// The folder below the target directory holding partial downloads (removed when complete).
pub const STAGING: &str = ".coli-pull";

/// Arguments of `coli pull`.
#[derive(clap::Args, Debug)]
pub struct PullArgs {
    /// The repository, `ORG/NAME`, optionally at a branch, tag or commit: `ORG/NAME@REV`
    /// (default revision: main).
    #[arg(value_name = "ORG/NAME[@REV]")]
    pub repo: String,
    /// The directory to fill (created if missing); then `coli serve --model DIR`.
    #[arg(long, value_name = "DIR")]
    pub to: PathBuf,
    /// Fetch the files matching this glob (repeatable; `*` also matches `/`, `DIR/` takes a
    /// folder). Default: config, generation config, tokenizer and chat template files, and
    /// the top-level `*.safetensors` with their index; or the repository's only `.gguf` file.
    #[arg(long = "include", value_name = "PATTERN")]
    pub include: Vec<String>,
    /// The Hub (or a mirror of its API).
    #[arg(
        long,
        env = "HF_ENDPOINT",
        default_value = "https://huggingface.co",
        value_name = "URL"
    )]
    pub endpoint: String,
    /// Read the access token from this file (else from HF_TOKEN, else from the token
    /// `hf auth login` saved in $HF_HOME/token, ~/.cache/huggingface/token by default).
    /// Gated and private repositories need one.
    #[arg(long, value_name = "PATH")]
    pub token_file: Option<PathBuf>,
    /// Files downloaded at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    /// Ask the Hub again even when DIR holds a complete pull of the same revision (a branch
    /// may have moved on); files that did not change are not downloaded again.
    #[arg(long)]
    pub refresh: bool,
}

/// Run `coli pull`.
pub fn run(args: PullArgs) -> Result<()> {
    let spec = RepoSpec::parse(&args.repo)?;
    let token = token(args.token_file.as_deref())?;
    let opts = Options {
        spec,
        dir: args.to,
        include: args.include,
        endpoint: args.endpoint,
        token,
        jobs: args.jobs as usize,
        refresh: args.refresh,
    };
    let summary = pull(&opts)?;
    eprintln!("coli: {summary}");
    Ok(())
}

/// The access token: `--token-file`, else `HF_TOKEN`, else the Hugging Face CLI's saved token.
fn token(file: Option<&Path>) -> Result<Option<String>> {
    let read = |path: &Path| -> Result<String> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the token file {}", path.display()))?;
        let token = text.trim().to_string();
        if token.is_empty() || token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            bail!("{}: expected one token on one line", path.display());
        }
        Ok(token)
    };
    if let Some(path) = file {
        return read(path).map(Some);
    }
    if let Ok(t) = std::env::var("HF_TOKEN") {
        if !t.trim().is_empty() {
            return Ok(Some(t.trim().to_string()));
        }
    }
    let saved = match std::env::var_os("HF_HOME") {
        Some(home) => PathBuf::from(home).join("token"),
        None => match std::env::var_os("HOME") {
            Some(home) => PathBuf::from(home).join(".cache/huggingface/token"),
            None => return Ok(None),
        },
    };
    if saved.is_file() {
        return read(&saved).map(Some);
    }
    Ok(None)
}

/// What to pull, where.
#[derive(Clone, Debug)]
pub struct Options {
    /// Repository and revision.
    pub spec: RepoSpec,
    /// The target directory.
    pub dir: PathBuf,
    /// `--include` patterns (empty: the default selection).
    pub include: Vec<String>,
    /// The Hub's base URL.
    pub endpoint: String,
    /// A bearer token for the Hub.
    pub token: Option<String>,
    /// Files at once.
    pub jobs: usize,
    /// Ask the Hub even after a complete pull of the same revision.
    pub refresh: bool,
}

/// What a pull did.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// `ORG/NAME@REV`.
    pub spec: String,
    /// The commit the files are from.
    pub commit: String,
    /// The directory.
    pub dir: PathBuf,
    /// Files the receipt lists.
    pub files: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Files downloaded (in whole or in part) in this run.
    pub downloaded: usize,
    /// Bytes that came over the network.
    pub transferred: u64,
    /// Files whose partial download was resumed.
    pub resumed: usize,
    /// Files downloaded again after a hash mismatch.
    pub refetched: usize,
    /// Files already in place (receipt, or hashed and found right).
    pub present: usize,
    /// True when a complete receipt answered without asking the Hub.
    pub up_to_date: bool,
    /// Seconds it took.
    pub seconds: f64,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let short = &self.commit[..self.commit.len().min(12)];
        if self.up_to_date {
            return write!(
                f,
                "{} (commit {short}) is already complete in {}: {} files, {} (per its {RECEIPT}; \
                 --refresh asks the Hub for a newer commit)",
                self.spec,
                self.dir.display(),
                self.files,
                format_size(self.bytes)
            );
        }
        write!(
            f,
            "pulled {} (commit {short}) into {}: {} files, {}; downloaded {} ({} over the \
             network, {:.1} s, {}/s), {} resumed, {} fetched again after a hash mismatch, {} \
             already in place; every file verified",
            self.spec,
            self.dir.display(),
            self.files,
            format_size(self.bytes),
            self.downloaded,
            format_size(self.transferred),
            self.seconds,
            format_size((self.transferred as f64 / self.seconds.max(1e-3)) as u64),
            self.resumed,
            self.refetched,
            self.present,
        )
    }
}

/// Pull `opts.spec` into `opts.dir` (see the crate's documentation).
pub fn pull(opts: &Options) -> Result<Summary> {
    let t0 = Instant::now();
    let dir = &opts.dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating --to {}", dir.display()))?;
    let _lock = lock_dir(dir)?;
    let mut include = opts.include.clone();
    include.sort();
    include.dedup();

    let previous = read_receipt(dir)?;
    if let Some(r) = &previous {
        if r.repo != opts.spec.repo {
            bail!(
                "{} holds {} (its {RECEIPT}), not {}: choose another --to",
                dir.display(),
                r.repo,
                opts.spec.repo
            );
        }
        if r.complete && r.revision == opts.spec.revision && r.include == include && !opts.refresh {
            let intact = r.files.iter().all(|f| {
                std::fs::metadata(dir.join(&f.path)).is_ok_and(|m| m.is_file() && m.len() == f.size)
            });
            if intact {
                return Ok(Summary {
                    spec: opts.spec.to_string(),
                    commit: r.commit.clone(),
                    dir: dir.clone(),
                    files: r.files.len(),
                    bytes: r.files.iter().map(|f| f.size).sum(),
                    downloaded: 0,
                    transferred: 0,
                    resumed: 0,
                    refetched: 0,
                    present: r.files.len(),
                    up_to_date: true,
                    seconds: t0.elapsed().as_secs_f64(),
                });
            }
        }
    }

    let hub = hub::Hub::new(&opts.endpoint, &opts.spec.repo, opts.token.clone())?;
    let commit = hub
        .resolve_commit(&opts.spec.revision)
        .with_context(|| format!("resolving {} at {}", opts.spec, hub.endpoint()))?;
    let all = hub
        .list_files(&commit)
        .with_context(|| format!("listing the files of {} at {commit}", opts.spec.repo))?;
    let what = format!("{} at {}", opts.spec.repo, &commit[..12]);
    let selected = select::select(&all, &include, &what)?;

    // Files the receipt (of an earlier, perhaps interrupted, pull) lists with the same hash
    // and size are in place and verified; the rest are to land.
    let mut done = Vec::new();
    let mut todo = Vec::new();
    for f in selected {
        let known = previous.as_ref().and_then(|r| r.file(&f.path)).filter(|e| {
            e.size == f.size
                && match &f.check {
                    Check::Sha256(h) => &e.sha256 == h,
                    Check::GitBlob(h) => e.git_oid.as_ref() == Some(h),
                }
        });
        let in_place =
            std::fs::metadata(dir.join(&f.path)).is_ok_and(|m| m.is_file() && m.len() == f.size);
        match known {
            Some(e) if in_place => done.push(e.clone()),
            _ => todo.push(f),
        }
    }
    let staging = dir.join(STAGING);
    let parts = staging.join("parts");
    let part_len = |f: &RemoteFile| {
        std::fs::metadata(parts.join(format!("{}.part", f.check.hex())))
            .map_or(0, |m| m.len().min(f.size))
    };
    let need: u64 = todo.iter().map(|f| f.size - part_len(f)).sum();
    check_free_space(dir, need)?;

    let mut receipt = Receipt {
        format: receipt::FORMAT,
        endpoint: hub.endpoint(),
        repo: opts.spec.repo.clone(),
        revision: opts.spec.revision.clone(),
        commit: commit.clone(),
        include,
        complete: false,
        files: done.clone(),
    };
    receipt.files.sort_by(|a, b| a.path.cmp(&b.path));
    receipt.save(dir)?;

    // Largest first: the long downloads start at once, the small ones fill in around them.
    todo.sort_by(|a, b| b.size.cmp(&a.size).then(a.path.cmp(&b.path)));
    let total: u64 = todo.iter().map(|f| f.size).sum();
    let progress = Progress::new(total, todo.len());
    if !todo.is_empty() {
        progress.line(&format!(
            "pulling {} (commit {}) into {}: {} files, {} to fetch ({} already in place)",
            opts.spec,
            &commit[..12],
            dir.display(),
            todo.len(),
            format_size(need),
            done.len()
        ));
    }
    let cancel = AtomicBool::new(false);
    let job = fetch::Job {
        hub: &hub,
        commit: &commit,
        dir,
        parts: parts.clone(),
        cancel: &cancel,
        progress: &progress,
    };
    let next = AtomicUsize::new(0);
    let shared = Mutex::new((receipt, Vec::<anyhow::Error>::new()));
    let counts = Mutex::new(Counts::default());
    std::thread::scope(|s| {
        for _ in 0..opts.jobs.clamp(1, todo.len().max(1)) {
            s.spawn(|| loop {
                if cancel.load(Ordering::Relaxed) {
                    return;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(file) = todo.get(i) else { return };
                match job.land(file) {
                    Ok(landed) => {
                        counts.lock().unwrap().add(&landed);
                        let mut sh = shared.lock().unwrap();
                        let (receipt, errors) = &mut *sh;
                        receipt.files.retain(|e| e.path != file.path);
                        receipt.files.push(ReceiptFile {
                            path: file.path.clone(),
                            size: file.size,
                            sha256: landed.sha256.clone(),
                            git_oid: match &file.check {
                                Check::GitBlob(h) => Some(h.clone()),
                                Check::Sha256(_) => None,
                            },
                        });
                        receipt.files.sort_by(|a, b| a.path.cmp(&b.path));
                        if let Err(e) = receipt.save(dir) {
                            errors.push(e);
                            cancel.store(true, Ordering::Relaxed);
                        }
                        drop(sh);
                        progress.file_done(file, &landed);
                    }
                    Err(e) => {
                        // Recorded before the others are told to stop, so it comes first.
                        shared.lock().unwrap().1.push(e);
                        cancel.store(true, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    progress.finish();
    let (mut receipt, errors) = shared.into_inner().unwrap();
    if !errors.is_empty() {
        // The first failure caused the others to stop ("stopped (another file failed)").
        let n = errors.len();
        let first = errors.into_iter().next().expect("an error");
        let more = if n > 1 {
            format!(
                " ({} other downloads were stopped; their parts are kept)",
                n - 1
            )
        } else {
            String::new()
        };
        return Err(first.context(format!(
            "pulling {} into {}{more}; rerun to resume",
            opts.spec,
            dir.display()
        )));
    }
    receipt.complete = true;
    receipt.save(dir)?;
    // Parts of other versions of the files, and the staging folder, are no longer needed.
    let _ = std::fs::remove_dir_all(&staging);
    let Counts {
        downloaded,
        transferred,
        resumed,
        refetched,
        adopted,
    } = counts.into_inner().unwrap();
    Ok(Summary {
        spec: opts.spec.to_string(),
        commit,
        dir: dir.clone(),
        files: receipt.files.len(),
        bytes: receipt.files.iter().map(|f| f.size).sum(),
        downloaded,
        transferred,
        resumed,
        refetched,
        present: done.len() + adopted,
        up_to_date: false,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// What the workers did, added up.
#[derive(Default)]
struct Counts {
    downloaded: usize,
    transferred: u64,
    resumed: usize,
    refetched: usize,
    adopted: usize,
}

impl Counts {
    fn add(&mut self, landed: &fetch::Landed) {
        if landed.adopted {
            self.adopted += 1;
        } else {
            self.downloaded += 1;
        }
        self.transferred += landed.transferred;
        self.resumed += usize::from(landed.resumed_from > 0);
        self.refetched += usize::from(landed.refetched);
    }
}

/// Take `dir`'s advisory lock, waiting (with a message) while another pull holds it.
fn lock_dir(dir: &Path) -> Result<std::fs::File> {
    use rustix::fs::{flock, FlockOperation};
    let f = std::fs::File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    if flock(&f, FlockOperation::NonBlockingLockExclusive).is_err() {
        eprintln!(
            "coli: another coli pull is writing {}; waiting for it to finish",
            dir.display()
        );
        flock(&f, FlockOperation::LockExclusive)
            .map_err(|e| anyhow!("locking {}: {e}", dir.display()))?;
    }
    Ok(f)
}

/// Refuse to start when the file system of `dir` has less than `need` bytes free.
fn check_free_space(dir: &Path, need: u64) -> Result<()> {
    let st = rustix::fs::statvfs(dir)
        .with_context(|| format!("checking the free space of {}", dir.display()))?;
    let free = st.f_bavail.saturating_mul(st.f_frsize);
    if free < need {
        bail!(
            "--to {}: the files still to fetch need {}, but its file system has {} free: free \
             space, choose another --to, or fetch fewer files with --include",
            dir.display(),
            format_size(need),
            format_size(free)
        );
    }
    Ok(())
}

/// The progress of a pull on stderr: a bar of bytes on a terminal; otherwise (a container's
/// log) a line per file and a line of totals every 30 s.
pub struct Progress {
    bar: indicatif::ProgressBar,
    done: AtomicU64,
    total: u64,
    files: usize,
    files_done: AtomicUsize,
    last_line: Mutex<Instant>,
    start: Instant,
}

/// How often the log (not a terminal) gets a line of totals.
const LOG_EVERY: Duration = Duration::from_secs(30);

impl Progress {
    fn new(total: u64, files: usize) -> Progress {
        let bar = indicatif::ProgressBar::new(total);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} pulling [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        bar.set_message(format!("0/{files} files"));
        Progress {
            bar,
            done: AtomicU64::new(0),
            total,
            files,
            files_done: AtomicUsize::new(0),
            last_line: Mutex::new(Instant::now()),
            start: Instant::now(),
        }
    }

    /// A line above the bar (or in the log).
    pub fn line(&self, text: &str) {
        if self.bar.is_hidden() {
            eprintln!("coli: {text}");
        } else {
            self.bar.println(format!("coli: {text}"));
        }
    }

    /// A warning line.
    pub fn warn(&self, text: &str) {
        self.line(&format!("warning: {text}"));
    }

    /// `n` more bytes are in place (downloaded, or found in a part or file).
    pub fn add(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        self.bar.set_position(done);
        if self.bar.is_hidden() {
            let mut last = self.last_line.lock().unwrap();
            if last.elapsed() >= LOG_EVERY {
                *last = Instant::now();
                let secs = self.start.elapsed().as_secs_f64();
                eprintln!(
                    "coli: {} of {} ({:.0} %), {} of {} files, {}/s",
                    format_size(done),
                    format_size(self.total),
                    100.0 * done as f64 / self.total.max(1) as f64,
                    self.files_done.load(Ordering::Relaxed),
                    self.files,
                    format_size((done as f64 / secs.max(1e-3)) as u64)
                );
            }
        }
    }

    /// `n` bytes counted before are gone (a part discarded).
    pub fn sub(&self, n: u64) {
        let done = self
            .done
            .fetch_sub(n.min(self.done.load(Ordering::Relaxed)), Ordering::Relaxed)
            .saturating_sub(n);
        self.bar.set_position(done);
    }

    fn file_done(&self, file: &RemoteFile, landed: &fetch::Landed) {
        let n = self.files_done.fetch_add(1, Ordering::Relaxed) + 1;
        self.bar.set_message(format!("{n}/{} files", self.files));
        let how = if landed.adopted {
            "was already in place".to_string()
        } else if landed.resumed_from > 0 {
            format!("resumed from {}", format_size(landed.resumed_from))
        } else {
            "downloaded".to_string()
        };
        let check = match &file.check {
            Check::Sha256(_) => "sha256",
            Check::GitBlob(_) => "git blob sha1",
        };
        self.line(&format!(
            "{} ({}): {how}{}, {check} verified",
            file.path,
            format_size(file.size),
            if landed.refetched {
                " (fetched again after a hash mismatch)"
            } else {
                ""
            },
        ));
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
