//! Fault injection behind [`RangeReader`], for tests: a [`FaultyReader`] wraps any reader and
//! follows a [`Schedule`] of faults — an I/O error (`EIO`) on the Nth read or on reads
//! touching a given file and offset, a short read (a buffer with fewer bytes than asked for),
//! a slow read (a configurable delay), and a file truncated between reads (the file on disk
//! really is cut, so the reader below sees it).
//!
//! [`StoreOptions::wrap_reader`](super::StoreOptions::wrap_reader) puts one under the
//! expert store's retry and length check (see [`CheckedReader`](super::reader::CheckedReader)),
//! on the primary drive or on any mirror drive, so a whole model can be run against it.
//!
//! What the store does with each fault (tested in `engine/tests/faults.rs`, summed up in
//! `docs/reliability.md`): a fault that happens once is retried once and gives the same
//! tokens; one that persists is a clean error naming the file and byte offset; on a mirror,
//! any failure falls back to the primary and gives the same tokens.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::reader::{ByteRange, RangeReader, ReadDone};
use crate::tensor::Storage;
use crate::{Error, Result};

/// Which reads a fault fires on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trigger {
    /// The read with this number (0-based, counting every request submitted).
    Nth(u64),
    /// Every read with a range of file `file` that contains byte `offset`.
    Touching { file: usize, offset: u64 },
    /// Every read.
    Every,
}

/// What a fault does to the read it fires on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Fail with `EIO`, naming the file and offset as the real readers do.
    Eio,
    /// Read, then hand back the first range with only half of its bytes.
    Short,
    /// Wait this long, then read.
    Delay(Duration),
    /// Cut file `file` to `len` bytes, then read.
    Truncate { file: usize, len: u64 },
}

/// One fault: when, what, and how many times at most.
#[derive(Debug, Clone)]
pub struct Fault {
    pub trigger: Trigger,
    pub action: Action,
    /// Firings left.
    pub times: u64,
}

/// The faults a [`FaultyReader`] injects, shared with the test that made it (which can count
/// the reads and firings afterwards). The first fault whose trigger matches and that has
/// firings left fires; a read fires at most one fault.
#[derive(Debug, Default)]
pub struct Schedule {
    faults: Mutex<Vec<Fault>>,
    reads: AtomicU64,
    fired: AtomicU64,
    seen: Mutex<Vec<ByteRange>>,
}

impl Schedule {
    /// A schedule of `faults`.
    pub fn new(faults: Vec<Fault>) -> Arc<Schedule> {
        Arc::new(Schedule {
            faults: Mutex::new(faults),
            ..Schedule::default()
        })
    }

    /// Requests submitted so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Faults fired so far.
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::Relaxed)
    }

    /// Every range read so far, in submission order.
    pub fn seen(&self) -> Vec<ByteRange> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The action of the fault this read (number `n`, of `ranges`) fires, if any, and the
    /// index of the range it is about (the one touched, else the first).
    fn fire(&self, n: u64, ranges: &[ByteRange]) -> Option<(Action, usize)> {
        let mut faults = self.faults.lock().ok()?;
        let mut at = 0;
        let f = faults.iter_mut().find(|f| {
            f.times > 0
                && match &f.trigger {
                    Trigger::Nth(k) => *k == n,
                    Trigger::Touching { file, offset } => {
                        match ranges.iter().position(|r| {
                            r.file == *file
                                && r.offset <= *offset
                                && *offset < r.offset + r.len as u64
                        }) {
                            Some(i) => {
                                at = i;
                                true
                            }
                            None => false,
                        }
                    }
                    Trigger::Every => true,
                }
        })?;
        f.times -= 1;
        self.fired.fetch_add(1, Ordering::Relaxed);
        Some((f.action.clone(), at))
    }
}

/// A [`RangeReader`] that injects the faults of a [`Schedule`] into the reads of `inner`,
/// whose files are `paths` (what errors name and truncation cuts).
pub struct FaultyReader {
    inner: Arc<dyn RangeReader>,
    paths: Vec<PathBuf>,
    schedule: Arc<Schedule>,
}

impl FaultyReader {
    /// `inner`, reading `paths`, with the faults of `schedule`.
    pub fn new(
        inner: Arc<dyn RangeReader>,
        paths: &[PathBuf],
        schedule: Arc<Schedule>,
    ) -> FaultyReader {
        FaultyReader {
            inner,
            paths: paths.to_vec(),
            schedule,
        }
    }

    fn path(&self, file: usize) -> PathBuf {
        self.paths
            .get(file)
            .cloned()
            .unwrap_or_else(|| PathBuf::from(format!("<file {file}>")))
    }
}

impl RangeReader for FaultyReader {
    fn submit(&self, ranges: Vec<ByteRange>, done: ReadDone) {
        let n = self.schedule.reads.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut seen) = self.schedule.seen.lock() {
            seen.extend(ranges.iter().cloned());
        }
        match self.schedule.fire(n, &ranges) {
            None => self.inner.submit(ranges, done),
            Some((Action::Eio, at)) => {
                let r = ranges.get(at).cloned().unwrap_or(ByteRange {
                    file: 0,
                    offset: 0,
                    len: 0,
                });
                let e = std::io::Error::from_raw_os_error(libc::EIO);
                let err = Error::io(
                    self.path(r.file),
                    std::io::Error::new(
                        e.kind(),
                        format!(
                            "reading {} bytes at offset {}: {e} (injected)",
                            r.len, r.offset
                        ),
                    ),
                );
                done(Err(err))
            }
            Some((Action::Short, _)) => self.inner.submit(
                ranges,
                Box::new(move |result| done(result.map(shorten_first))),
            ),
            Some((Action::Delay(d), _)) => {
                let inner = self.inner.clone();
                let spawned = std::thread::Builder::new()
                    .name("coli-slow-read".into())
                    .spawn(move || {
                        std::thread::sleep(d);
                        inner.submit(ranges, done)
                    });
                if let Err(e) = spawned {
                    tracing::error!("fault injection: cannot start a delay thread: {e}");
                }
            }
            Some((Action::Truncate { file, len }, _)) => {
                let path = self.path(file);
                let cut = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .and_then(|f| f.set_len(len));
                if let Err(e) = cut {
                    tracing::error!("fault injection: cannot truncate {}: {e}", path.display());
                }
                self.inner.submit(ranges, done)
            }
        }
    }

    fn describe(&self) -> String {
        format!("{} with injected faults", self.inner.describe())
    }

    fn drive_bytes(&self) -> Vec<(PathBuf, u64)> {
        self.inner.drive_bytes()
    }
}

/// The first buffer with half of its bytes (a short read the reader did not notice).
fn shorten_first(mut bufs: Vec<Storage>) -> Vec<Storage> {
    if let Some(first) = bufs.first_mut() {
        let half = first.bytes().len() / 2;
        *first = Storage::owned(&first.bytes()[..half]);
    }
    bufs
}

/// How [`StoreOptions::wrap_reader`](super::StoreOptions::wrap_reader) wraps each drive's
/// reader: called with the drive (0 the primary, then the mirrors in order), the files that
/// drive's reader reads, and the reader; returns the reader to use instead.
type WrapFn = dyn Fn(usize, &[PathBuf], Arc<dyn RangeReader>) -> Arc<dyn RangeReader> + Send + Sync;

/// A wrapper for the readers of the expert store (see [`WrapFn`]), for fault injection in
/// tests.
#[derive(Clone)]
pub struct WrapReader(pub Arc<WrapFn>);

impl WrapReader {
    /// Wrap drive `drive`'s reader with a [`FaultyReader`] following `schedule`; the other
    /// drives are left alone.
    pub fn faults_on(drive: usize, schedule: Arc<Schedule>) -> WrapReader {
        WrapReader(Arc::new(move |d, paths, reader| {
            if d == drive {
                Arc::new(FaultyReader::new(reader, paths, schedule.clone()))
            } else {
                reader
            }
        }))
    }

    /// `reader` of drive `drive` reading `paths`, wrapped.
    pub fn wrap(
        &self,
        drive: usize,
        paths: &[PathBuf],
        reader: Arc<dyn RangeReader>,
    ) -> Arc<dyn RangeReader> {
        (self.0)(drive, paths, reader)
    }
}

impl fmt::Debug for WrapReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WrapReader(..)")
    }
}

/// Submit `ranges` to `reader` and wait up to `timeout` (a test helper; a hang is an error).
pub fn read_blocking(
    reader: &dyn RangeReader,
    ranges: Vec<ByteRange>,
    timeout: Duration,
) -> Result<Vec<Storage>> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    reader.submit(
        ranges,
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    rx.recv_timeout(timeout)
        .map_err(|e| Error::Invalid(format!("the read did not finish: {e}")))?
}
