//! The `kill -9` harness of the crash-consistency tests (engine/tests/crash_consistency.rs, and
//! server/tests/crash_consistency.rs, which includes this file by path): one implementation
//! for every kind of file written through a function called in-process.
//!
//! A test re-runs its own binary as a writer child (the test `{mode}_writer`, told so by
//! [`CHILD_MODE`]) that writes one target again and again through a real writer and prints
//! `committed K` after each version `K` it committed. The parent drains that output as it
//! comes (so the writer never waits on a full pipe and is killed while working, not while
//! blocked on its own reports), lets it commit a random number of versions, waits a random
//! moment, kills it with SIGKILL, and checks:
//!
//! - the target holds one complete version, the last one reported committed or the one being
//!   written (never a torn or mixed file), or is absent only before the first commit;
//! - at most the killed writer's own temporary is left (counted as a kill inside a write), and
//!   the next writer's first commit has removed it (no stale temporaries accumulate);
//! - at the end, after a clean write, no temporary is left at all.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Environment variables that turn a test binary into a writer child.
pub const CHILD_MODE: &str = "COLI_CRASH_CHILD_MODE";
pub const CHILD_DIR: &str = "COLI_CRASH_CHILD_DIR";

/// How long a writer may take to report its next commit before the test gives up on it.
const COMMIT_DEADLINE: Duration = Duration::from_secs(120);

/// A deterministic pseudo-random generator (no dependency, reproducible from the seed).
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    /// A number in [0, 1).
    pub fn unit(&mut self) -> f64 {
        self.next() as f64 / (1u64 << 31) as f64
    }
}

/// In the writer child started for `mode`: the directory it writes in. `None` in the parent
/// and in children of other modes.
pub fn child_dir(mode: &str) -> Option<PathBuf> {
    (std::env::var(CHILD_MODE).as_deref() == Ok(mode))
        .then(|| PathBuf::from(std::env::var(CHILD_DIR).expect("a writer child has a directory")))
}

/// Whether this process is a writer child (of any mode): every other test then does nothing.
pub fn in_child() -> bool {
    std::env::var(CHILD_MODE).is_ok()
}

/// The writer child's loop: `write(k)` for k = 0, 1, ..., each reporting on stdout the version
/// it committed (`k` itself, or a number the file holds, such as a usage history's tokens).
pub fn writer_loop(mut write: impl FnMut(u64) -> u64) -> ! {
    let out = std::io::stdout();
    for k in 0.. {
        let version = write(k);
        let mut o = out.lock();
        writeln!(o, "committed {version}").unwrap();
        o.flush().unwrap();
    }
    unreachable!()
}

/// Names of the temporaries (`NAME.PID.tmp`) in `dir`, sorted.
pub fn temporaries(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    names.sort();
    names
}

/// The process id a temporary `NAME.PID.tmp` is named after.
pub fn temporary_pid(name: &str) -> Option<u32> {
    let stem = name.strip_suffix(".tmp")?;
    stem.rsplit_once('.')?.1.parse().ok()
}

/// Which of a child's outputs [`Drained`] hands over line by line (the other is kept whole).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lines {
    Stdout,
    Stderr,
}

/// A child's output, read by threads as it comes (so that the child never waits on a full
/// pipe): one stream line by line, the other kept whole (to show when the child fails).
pub struct Drained {
    pub lines: mpsc::Receiver<String>,
    by_line: Option<std::thread::JoinHandle<()>>,
    whole: Option<std::thread::JoinHandle<String>>,
}

impl Drained {
    /// Start draining `child`'s piped stdout and stderr, `lines` of them line by line.
    pub fn new(child: &mut Child, lines: Lines) -> Drained {
        let (tx, rx) = mpsc::channel();
        let out: Box<dyn Read + Send> = Box::new(child.stdout.take().expect("stdout is piped"));
        let err: Box<dyn Read + Send> = Box::new(child.stderr.take().expect("stderr is piped"));
        let (by_line, mut whole) = match lines {
            Lines::Stdout => (out, err),
            Lines::Stderr => (err, out),
        };
        let by_line = std::thread::spawn(move || {
            for line in BufReader::new(by_line).lines().map_while(|l| l.ok()) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let whole = std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = whole.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        });
        Drained {
            lines: rx,
            by_line: Some(by_line),
            whole: Some(whole),
        }
    }

    /// The next line, `None` at its end; panics past `deadline`, saying `what` waited.
    pub fn next_line(&mut self, deadline: Duration, what: &str) -> Option<String> {
        match self.lines.recv_timeout(deadline) {
            Ok(l) => Some(l),
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                panic!("{what}: no output for {deadline:?}")
            }
        }
    }

    /// After the child ended: the lines not yet taken, and the whole other stream.
    pub fn finish(mut self) -> (Vec<String>, String) {
        self.by_line.take().unwrap().join().unwrap();
        let rest = self.lines.try_iter().collect();
        let whole = self.whole.take().unwrap().join().unwrap();
        (rest, whole)
    }
}

/// One kind of file under test.
pub struct Target<'a> {
    /// The mode: the writer child is this binary's test `{mode}_writer`.
    pub mode: &'a str,
    /// The directory the child writes in.
    pub dir: &'a Path,
    /// The directory that holds the target and its temporaries.
    pub tmp_dir: PathBuf,
    /// The version the target holds now (`None` if absent), or why it is not a complete one.
    pub check: &'a dyn Fn() -> Result<Option<u64>, String>,
    /// The longest random wait, after the commits waited for, before the kill.
    pub max_pause: Duration,
    /// One clean write after the last kill (must leave no temporary).
    pub clean_write: &'a dyn Fn(),
}

/// What [`kill_writers`] measured.
#[derive(Debug, Clone, Copy)]
pub struct Counts {
    /// Writers killed.
    pub kills: usize,
    /// Kills that left the killed writer's temporary behind: they landed inside a write,
    /// before the rename.
    pub before_rename: usize,
    /// Kills after which the target held a version the writer had not reported: they landed
    /// inside a write too, after the rename (while the directory was synced) — or in the
    /// instant between the write's return and its report.
    pub after_rename: usize,
    /// Wall time of the rounds.
    pub wall: Duration,
}

impl Counts {
    /// Kills that landed inside a write.
    pub fn inside(&self) -> usize {
        self.before_rename + self.after_rename
    }
}

/// `kills` rounds of: start a writer, let it commit 1 to 3 versions, kill it at a random moment
/// within `max_pause` after that, check the target and the temporaries (see the module
/// documentation). Panics on a torn file or a stale temporary. Where fewer than half of the
/// kills landed inside a write (a loaded machine stretches the moments between writes), more
/// rounds follow until more than `kills / 2` did, up to `4 × kills` rounds in all: callers
/// assert that many, so the test still checks what it says and still fails where kills never
/// land inside a write.
pub fn kill_writers(t: &Target, kills: usize, seed: u64) -> Counts {
    let t0 = Instant::now();
    let mode = t.mode;
    let mut rng = Lcg(seed);
    let mut last_committed: Option<u64> = None;
    let mut left_by_killed: Vec<String> = Vec::new();
    let (mut before_rename, mut after_rename) = (0, 0);
    let mut round = 0;
    while round < kills || ((before_rename + after_rename) * 2 <= kills && round < 4 * kills) {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &format!("{mode}_writer"), "--nocapture"])
            .env(CHILD_MODE, mode)
            .env(CHILD_DIR, t.dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut out = Drained::new(&mut child, Lines::Stdout);
        let commits = 1 + rng.next() % 3;
        let mut seen = 0;
        let mut last_this_child = None;
        while seen < commits {
            let Some(line) = out.next_line(COMMIT_DEADLINE, &format!("{mode} round {round}"))
            else {
                let _ = child.wait();
                let (_, err) = out.finish();
                panic!("{mode} round {round}: the writer stopped early:\n{err}");
            };
            let Some(k) = line.strip_prefix("committed ") else {
                continue; // the test harness's own output
            };
            let k: u64 = k.parse().unwrap();
            seen += 1;
            last_this_child = Some(k);
            if seen == 1 {
                // The first commit of a new writer has removed what the killed one left.
                let now = temporaries(&t.tmp_dir);
                for l in &left_by_killed {
                    assert!(
                        !now.contains(l),
                        "{mode} round {round}: the stale temporary {l} survived a new writer's commit ({now:?})"
                    );
                }
            }
        }
        // A random moment of the writing that goes on (not a synchronisation: any moment must
        // do).
        std::thread::sleep(t.max_pause.mul_f64(rng.unit()));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // The writer ran ahead of this reader: its last reports are still in the pipe.
        let (rest, _) = out.finish();
        for line in rest {
            if let Some(k) = line.strip_prefix("committed ") {
                last_this_child = Some(k.parse().unwrap());
            }
        }
        let committed = last_this_child.or(last_committed);
        // Listed before the check: reading some targets removes stale temporaries (a usage
        // history's load does).
        let left = temporaries(&t.tmp_dir);
        match (t.check)() {
            Err(why) => panic!("{mode} round {round}: torn file after kill -9: {why}"),
            Ok(None) => assert!(
                committed.is_none(),
                "{mode} round {round}: the target vanished after version {committed:?} was committed"
            ),
            Ok(Some(v)) => {
                let c = committed.expect("a file exists only after a commit");
                assert!(
                    v == c || v == c + 1,
                    "{mode} round {round}: holds version {v}, last committed {c}"
                );
                after_rename += usize::from(v == c + 1 && left.is_empty());
            }
        }
        let own = format!(".{pid}.tmp");
        assert!(
            left.iter().all(|l| l.ends_with(&own)),
            "{mode} round {round}: temporaries of other processes left: {left:?}"
        );
        before_rename += usize::from(!left.is_empty());
        left_by_killed = left;
        last_committed = committed;
        round += 1;
    }
    (t.clean_write)();
    assert_eq!(
        temporaries(&t.tmp_dir),
        Vec::<String>::new(),
        "{mode}: after a clean write"
    );
    let counts = Counts {
        kills: round,
        before_rename,
        after_rename,
        wall: t0.elapsed(),
    };
    eprintln!(
        "{mode}: {round} kills, {} inside a write ({before_rename} before the rename: the \
         temporary left; {after_rename} after it: a version committed but not reported), \
         0 torn files, 0 stale temporaries, {:.1} s",
        counts.inside(),
        counts.wall.as_secs_f64()
    );
    counts
}
