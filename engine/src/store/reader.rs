//! Positioned reads of checkpoint byte ranges into owned buffers, off the compute threads.
//! Errors name the file, the byte offset and the length.
//!
//! Two readers implement [`RangeReader`]:
//!
//! - [`UringReader`]: one submission thread owns an io-uring; every range of every request is
//!   its own read, so all the misses of a layer are in flight at once (up to the queue depth).
//! - [`PreadPool`]: a bounded pool of threads doing `pread`s, one request at a time per thread.
//!   It works everywhere, including where the kernel or a seccomp filter refuses io-uring.
//!
//! Both can read with `O_DIRECT` (bypassing the page cache, so streamed experts do not push
//! the rest of the machine out of memory): each range is widened to [`DIRECT_ALIGN`]-aligned
//! offsets and lengths, read into an aligned buffer and moved to the front of it, so the
//! returned [`Storage`] holds exactly the requested bytes either way. Where `O_DIRECT` is
//! refused (tmpfs, some overlay file systems) the files are read through the page cache and
//! [`open_reader`] says so in one warning.
//!
//! [`open_reader`] picks the reader from [`ReaderOptions`]: io-uring when a ring can be
//! created and works, the pool otherwise.
//!
//! **Retry and length check.** The expert store reads through a [`CheckedReader`] on top of
//! everything else (the mirror set included): it is the one place a read is retried. A request
//! that fails (an `EIO`, a file cut short, a mirror and then the primary failing) or that
//! comes back with a buffer of the wrong length is re-issued once ([`READ_RETRIES`]); if that
//! fails too, the error is returned as is, naming the file and byte offset, and the store
//! hands it to the model (a clean `Error`, never a panic or wrong bytes). A transient fault
//! therefore costs one extra read and changes no result; a persistent one costs one extra
//! read before the error.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};

use io_uring::{opcode, types, IoUring};

use crate::tensor::Storage;
use crate::{Error, Result};

/// One byte range of one checkpoint file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ByteRange {
    /// Index of the file in the list the reader was opened with.
    pub file: usize,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read.
    pub len: usize,
}

type Job = Box<dyn FnOnce() + Send>;

/// What a finished read hands back: the buffers of the ranges, in order, or the first error.
pub type ReadDone = Box<dyn FnOnce(Result<Vec<Storage>>) + Send>;

/// Something that reads byte ranges of the checkpoint files asynchronously: a pool of `pread`
/// threads, io-uring, or a set of mirror drives in front of them.
pub trait RangeReader: Send + Sync {
    /// Read every range of `ranges`; `done` is called once, on any thread, with the buffers in
    /// order or the first error (which names the file and offset).
    fn submit(&self, ranges: Vec<ByteRange>, done: ReadDone);
    /// How it reads, for the start-up report (e.g. "pread pool, 4 threads, buffered").
    fn describe(&self) -> String;
    /// Bytes served per drive (directory), where the reader spreads reads over several.
    fn drive_bytes(&self) -> Vec<(std::path::PathBuf, u64)> {
        Vec::new()
    }
}

/// How many times [`CheckedReader`] re-issues a failed request.
pub const READ_RETRIES: u32 = 1;

/// A [`RangeReader`] over `inner` (whose files are `paths`) that checks every buffer has the
/// length of its range and re-issues a failed or short request up to [`READ_RETRIES`] times
/// (see the module comment). Errors name the file and byte offset.
pub struct CheckedReader {
    inner: Arc<dyn RangeReader>,
    paths: Arc<Vec<PathBuf>>,
}

impl CheckedReader {
    /// Check and retry the reads of `inner`, which reads `paths`.
    pub fn new(inner: Arc<dyn RangeReader>, paths: &[PathBuf]) -> CheckedReader {
        CheckedReader {
            inner,
            paths: Arc::new(paths.to_vec()),
        }
    }
}

/// Submit `ranges` to `inner`, check the buffers, and re-issue on failure while `retries` last.
fn submit_checked(
    inner: Arc<dyn RangeReader>,
    paths: Arc<Vec<PathBuf>>,
    ranges: Vec<ByteRange>,
    retries: u32,
    done: ReadDone,
) {
    let again = (retries > 0).then(|| (inner.clone(), ranges.clone()));
    let checked_paths = paths.clone();
    let expected: Vec<ByteRange> = ranges.clone();
    inner.submit(
        ranges,
        Box::new(move |result| {
            let result = result.and_then(|bufs| check_buffers(&checked_paths, &expected, bufs));
            match (result, again) {
                (Err(e), Some((inner, ranges))) => {
                    tracing::warn!("{e}; reading it again");
                    submit_checked(inner, paths, ranges, retries - 1, done)
                }
                (result, _) => done(result),
            }
        }),
    );
}

/// `bufs` if there is one per range, each of its range's length; else an error naming the
/// file and offset of the first range that does not match.
fn check_buffers(
    paths: &[PathBuf],
    ranges: &[ByteRange],
    bufs: Vec<Storage>,
) -> Result<Vec<Storage>> {
    let name = |file: usize| {
        paths
            .get(file)
            .cloned()
            .unwrap_or_else(|| PathBuf::from(format!("<checkpoint file {file}>")))
    };
    if bufs.len() != ranges.len() {
        let first = ranges.first().map_or(0, |r| r.file);
        return Err(Error::io(
            name(first),
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the reader returned {} buffers for {} ranges (first at offset {})",
                    bufs.len(),
                    ranges.len(),
                    ranges.first().map_or(0, |r| r.offset)
                ),
            ),
        ));
    }
    if let Some((r, b)) = ranges
        .iter()
        .zip(&bufs)
        .find(|(r, b)| b.bytes().len() != r.len)
    {
        return Err(Error::io(
            name(r.file),
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "reading {} bytes at offset {}: a short read of {} bytes",
                    r.len,
                    r.offset,
                    b.bytes().len()
                ),
            ),
        ));
    }
    Ok(bufs)
}

impl RangeReader for CheckedReader {
    fn submit(&self, ranges: Vec<ByteRange>, done: ReadDone) {
        submit_checked(
            self.inner.clone(),
            self.paths.clone(),
            ranges,
            READ_RETRIES,
            done,
        )
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn drive_bytes(&self) -> Vec<(PathBuf, u64)> {
        self.inner.drive_bytes()
    }
}

/// Alignment of `O_DIRECT` reads: file offsets, lengths and buffer addresses are multiples of
/// it. 4096 covers the logical block size of the drives and file systems in use.
pub const DIRECT_ALIGN: usize = 4096;

/// Queue depth of the io-uring reader [`open_reader`] builds: reads in flight at once.
pub const QUEUE_DEPTH: usize = 64;

/// Largest single read submitted (a multiple of [`DIRECT_ALIGN`]); longer ranges are read in
/// pieces, like the kernel's own per-call limit of just under 2 GiB.
const MAX_CHUNK: usize = 1 << 30;

/// Which reader [`open_reader`] builds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum ReaderKind {
    /// io-uring where a ring can be created and works, the pread pool otherwise.
    #[default]
    Auto,
    /// io-uring, or an error saying why it cannot be used.
    #[serde(alias = "io-uring", alias = "io_uring")]
    #[cfg_attr(feature = "clap", value(alias = "io-uring", alias = "io_uring"))]
    Uring,
    /// The pread pool.
    #[serde(alias = "pread")]
    #[cfg_attr(feature = "clap", value(alias = "pread"))]
    Pool,
}

/// How checkpoint ranges are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReaderOptions {
    /// io-uring, the pread pool, or whichever works.
    pub kind: ReaderKind,
    /// Threads of the pread pool (0: a default of 4). The io-uring reader uses one thread.
    pub threads: usize,
    /// Read with `O_DIRECT`, bypassing the page cache (falls back to buffered reads, with a
    /// warning, where the file system refuses it).
    pub direct_io: bool,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            kind: ReaderKind::Auto,
            threads: 4,
            direct_io: false,
        }
    }
}

/// Open `paths` and build the reader `opts` asks for. Returns the reader and human-readable
/// warnings for the start-up report: `O_DIRECT` refused (the files are then read through the
/// page cache), or io-uring unavailable under [`ReaderKind::Auto`] (the pread pool is used).
/// The reader's [`RangeReader::describe`] says which one it is and how it reads.
pub fn open_reader(
    paths: &[PathBuf],
    opts: &ReaderOptions,
) -> Result<(Arc<dyn RangeReader>, Vec<String>)> {
    open_reader_at_depth(paths, opts, QUEUE_DEPTH)
}

/// [`open_reader`] with an io-uring of `depth` reads in flight.
fn open_reader_at_depth(
    paths: &[PathBuf],
    opts: &ReaderOptions,
    depth: usize,
) -> Result<(Arc<dyn RangeReader>, Vec<String>)> {
    let files = Arc::new(OpenFiles::open(paths, opts.direct_io)?);
    let mut warnings: Vec<String> = files.warning().map(str::to_string).into_iter().collect();
    let threads = if opts.threads == 0 { 4 } else { opts.threads };
    let reader: Arc<dyn RangeReader> = match opts.kind {
        ReaderKind::Pool => Arc::new(PreadPool::with_files(files, threads)?),
        ReaderKind::Uring => Arc::new(UringReader::with_files(files, depth)?),
        ReaderKind::Auto => match UringReader::with_files(files.clone(), depth) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                warnings.push(format!(
                    "io-uring is not available ({e}); reading with a pool of {threads} pread threads"
                ));
                Arc::new(PreadPool::with_files(files, threads)?)
            }
        },
    };
    Ok((reader, warnings))
}

/// One checkpoint file, opened for buffered reads and, where allowed, for `O_DIRECT` reads.
struct Source {
    path: PathBuf,
    file: File,
    direct: Option<File>,
}

impl Source {
    /// The error for `range` failing with `e`: the path, the offset and the length, and for a
    /// range past the end of the file, where the file ends.
    fn range_error(&self, range: &ByteRange, e: io::Error) -> Error {
        let reason = match (e.kind(), self.file.metadata()) {
            (io::ErrorKind::UnexpectedEof, Ok(m)) => format!("the file ends at byte {}", m.len()),
            _ => e.to_string(),
        };
        Error::io(
            &self.path,
            io::Error::new(
                e.kind(),
                format!(
                    "reading {} bytes at offset {}: {reason}",
                    range.len, range.offset
                ),
            ),
        )
    }

    /// The descriptor a read planned as `direct` or buffered goes to.
    fn fd_for(&self, direct: bool) -> &File {
        match (&self.direct, direct) {
            (Some(f), true) => f,
            _ => &self.file,
        }
    }
}

/// The checkpoint files a reader reads, opened once and shared by reader threads.
pub struct OpenFiles {
    sources: Vec<Source>,
    direct: AtomicBool,
    warning: Option<String>,
}

impl OpenFiles {
    /// Open `paths` for reading. With `direct_io`, each file is also opened with `O_DIRECT` and
    /// probed with one aligned read; if any file refuses, all are read buffered and
    /// [`OpenFiles::warning`] says why.
    pub fn open(paths: &[PathBuf], direct_io: bool) -> Result<OpenFiles> {
        let mut sources = paths
            .iter()
            .map(|p| {
                Ok(Source {
                    path: p.clone(),
                    file: File::open(p).map_err(|e| Error::io(p, e))?,
                    direct: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut warning = None;
        if direct_io {
            let mut refused = None;
            for s in &mut sources {
                match open_direct(&s.path) {
                    Ok(f) => s.direct = Some(f),
                    Err(reason) => {
                        refused = Some(reason);
                        break;
                    }
                }
            }
            if let Some(reason) = refused {
                for s in &mut sources {
                    s.direct = None;
                }
                warning = Some(format!(
                    "direct I/O (O_DIRECT) is not available: {reason}; reading through the page cache"
                ));
            }
        }
        let direct = direct_io && warning.is_none();
        Ok(OpenFiles {
            sources,
            direct: AtomicBool::new(direct),
            warning,
        })
    }

    /// Whether reads bypass the page cache (`O_DIRECT`).
    pub fn direct(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    /// Why `O_DIRECT` was asked for but is not used, if it was refused when opening.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }

    /// Number of files.
    pub fn len(&self) -> usize {
        self.sources.len()
    }

    /// Whether there are no files.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// The file `range` names, or an error if there is no such file.
    fn source(&self, range: &ByteRange) -> Result<&Source> {
        self.sources.get(range.file).ok_or_else(|| {
            Error::Invalid(format!(
                "a read names checkpoint file {}, but only {} are open",
                range.file,
                self.sources.len()
            ))
        })
    }

    /// A plan for reading `range` of `src`, direct where it can be.
    fn plan(&self, src: &Source, range: &ByteRange) -> Result<Plan> {
        let direct = self.direct() && src.direct.is_some();
        Plan::new(range, direct).map_err(|e| src.range_error(range, e))
    }

    /// An `O_DIRECT` read failed with `e` although the probe passed: read buffered from now on.
    fn disable_direct(&self, src: &Source, e: &io::Error) {
        if self.direct.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                "{}: O_DIRECT read failed ({e}); reading through the page cache from now on",
                src.path.display()
            );
        }
    }
}

/// Open `path` with `O_DIRECT` and check that an aligned read works, or say why not.
fn open_direct(path: &Path) -> std::result::Result<File, String> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| format!("{}: cannot open with O_DIRECT: {e}", path.display()))?;
    let probe = ByteRange {
        file: 0,
        offset: 0,
        len: DIRECT_ALIGN,
    };
    let mut plan = Plan::new(&probe, true).map_err(|e| e.to_string())?;
    loop {
        let (offset, buf) = plan.next_chunk();
        match file.read_at(buf, offset) {
            // A file shorter than one block (or empty) still proves the read is accepted.
            Ok(_) => return Ok(file),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("{}: O_DIRECT read failed: {e}", path.display())),
        }
    }
}

/// One range's read in progress: where it reads from, the buffer it lands in, how far it got.
///
/// A buffered read lands at the start of the buffer. A direct read starts at the range's
/// offset rounded down to [`DIRECT_ALIGN`], asks for whole aligned blocks, and lands at the
/// first aligned address inside the buffer (which has [`DIRECT_ALIGN`] bytes of slack for
/// that); [`Plan::finish`] moves the requested bytes to the front.
struct Plan {
    direct: bool,
    /// File offset of the first byte read.
    start: u64,
    /// Bytes to ask for in all (whole blocks when direct).
    target: usize,
    /// Byte index in `words` where the read lands.
    dest: usize,
    /// Bytes between `start` and the range's offset.
    head: usize,
    /// Bytes of the range.
    len: usize,
    /// Bytes read so far.
    got: usize,
    words: Vec<u64>,
}

impl Plan {
    fn new(range: &ByteRange, direct: bool) -> io::Result<Plan> {
        let end = range
            .offset
            .checked_add(range.len as u64)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "the range ends past 2^63")
            })?;
        if !direct {
            return Ok(Plan {
                direct,
                start: range.offset,
                target: range.len,
                dest: 0,
                head: 0,
                len: range.len,
                got: 0,
                words: vec![0u64; range.len.div_ceil(8)],
            });
        }
        let align = DIRECT_ALIGN as u64;
        let start = range.offset / align * align;
        let aligned_end = end.div_ceil(align) * align;
        let target = usize::try_from(aligned_end - start)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "the range is too long"))?;
        let words = vec![0u64; (target + DIRECT_ALIGN).div_ceil(8)];
        let addr = words.as_ptr() as usize;
        let dest = (DIRECT_ALIGN - addr % DIRECT_ALIGN) % DIRECT_ALIGN;
        Ok(Plan {
            direct,
            start,
            target,
            dest,
            head: (range.offset - start) as usize,
            len: range.len,
            got: 0,
            words,
        })
    }

    /// Whether every byte of the range has been read.
    fn complete(&self) -> bool {
        self.got >= self.head + self.len
    }

    /// The next read: its file offset and the buffer it fills (aligned when direct).
    fn next_chunk(&mut self) -> (u64, &mut [u8]) {
        let n = (self.target - self.got).min(MAX_CHUNK);
        let at = self.dest + self.got;
        let bytes = bytemuck::cast_slice_mut::<u64, u8>(&mut self.words);
        (self.start + self.got as u64, &mut bytes[at..at + n])
    }

    /// Account for `n` more bytes read. A read of nothing, or a short direct read (which can
    /// only end at the end of the file), before the range is complete means the file ends
    /// inside the range.
    fn advance(&mut self, n: usize) -> io::Result<()> {
        self.got += n;
        let ended = n == 0 || (self.direct && !self.got.is_multiple_of(DIRECT_ALIGN));
        if !self.complete() && ended {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "unexpected end of file",
            ));
        }
        Ok(())
    }

    /// The range's bytes, moved to the front of the buffer.
    fn finish(self) -> Storage {
        let Plan {
            dest,
            head,
            len,
            mut words,
            ..
        } = self;
        let from = dest + head;
        if from > 0 {
            bytemuck::cast_slice_mut::<u64, u8>(&mut words).copy_within(from..from + len, 0);
        }
        words.truncate(len.div_ceil(8));
        if words.capacity() > 2 * words.len() + 64 {
            // Small direct reads carry blocks of slack; give it back.
            words.shrink_to_fit();
        }
        Storage::Owned {
            words: Arc::new(words),
            len,
        }
    }
}

/// An empty buffer, for ranges of no bytes.
fn empty_storage() -> Storage {
    Storage::Owned {
        words: Arc::new(Vec::new()),
        len: 0,
    }
}

/// Read `plan` to completion with `pread`s on `file`.
fn read_plan(file: &File, plan: &mut Plan) -> io::Result<()> {
    while !plan.complete() {
        let (offset, buf) = plan.next_chunk();
        match file.read_at(buf, offset) {
            Ok(n) => plan.advance(n)?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Read one range synchronously; a direct read refused with `EINVAL` is retried buffered.
fn read_range(files: &OpenFiles, range: &ByteRange) -> Result<Storage> {
    let src = files.source(range)?;
    if range.len == 0 {
        return Ok(empty_storage());
    }
    let mut plan = files.plan(src, range)?;
    match read_plan(src.fd_for(plan.direct), &mut plan) {
        Ok(()) => Ok(plan.finish()),
        Err(e) if plan.direct && e.raw_os_error() == Some(libc::EINVAL) => {
            files.disable_direct(src, &e);
            let mut plan = files.plan(src, range)?;
            read_plan(src.fd_for(plan.direct), &mut plan).map_err(|e| src.range_error(range, e))?;
            Ok(plan.finish())
        }
        Err(e) => Err(src.range_error(range, e)),
    }
}

/// Read every range synchronously, stopping at the first error.
fn read_ranges(files: &OpenFiles, ranges: &[ByteRange]) -> Result<Vec<Storage>> {
    ranges.iter().map(|r| read_range(files, r)).collect()
}

/// Call `done` with `result`, keeping a panic in it from taking down a reader thread.
fn deliver(done: ReadDone, result: Result<Vec<Storage>>) {
    if catch_unwind(AssertUnwindSafe(move || done(result))).is_err() {
        tracing::error!("a read completion handler panicked");
    }
}

/// "O_DIRECT" or "buffered", for `describe`.
fn mode(files: &OpenFiles) -> &'static str {
    if files.direct() {
        "O_DIRECT"
    } else {
        "buffered"
    }
}

/// A bounded pool of threads doing `pread`s.
pub struct PreadPool {
    files: Arc<OpenFiles>,
    jobs: Mutex<Sender<Job>>,
    threads: usize,
}

impl PreadPool {
    /// Open `paths` for buffered reading and start `threads` I/O threads.
    pub fn new(paths: &[PathBuf], threads: usize) -> Result<PreadPool> {
        PreadPool::with_files(Arc::new(OpenFiles::open(paths, false)?), threads)
    }

    /// Start `threads` I/O threads (at least one) reading `files`.
    pub fn with_files(files: Arc<OpenFiles>, threads: usize) -> Result<PreadPool> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = threads.max(1);
        for i in 0..threads {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("coli-io-{i}"))
                .spawn(move || loop {
                    let job = match rx.lock() {
                        Ok(guard) => guard.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })
                .map_err(|e| Error::Invalid(format!("cannot start I/O thread: {e}")))?;
        }
        Ok(PreadPool {
            files,
            jobs: Mutex::new(tx),
            threads,
        })
    }

    /// I/O threads.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl RangeReader for PreadPool {
    fn submit(&self, ranges: Vec<ByteRange>, done: ReadDone) {
        let files = self.files.clone();
        let job: Job = Box::new(move || deliver(done, read_ranges(&files, &ranges)));
        let sent = self.jobs.lock().map(|tx| tx.send(job));
        if let Ok(Err(failed)) = sent {
            // The pool is gone (only at shutdown): run the read here.
            (failed.0)();
        }
    }

    fn describe(&self) -> String {
        format!(
            "pread pool, {} threads, {}",
            self.threads,
            mode(&self.files)
        )
    }
}

/// A request handed to the io-uring thread.
struct Request {
    ranges: Vec<ByteRange>,
    done: ReadDone,
}

/// Reads ranges with io-uring: one thread owns the ring and submits every range of every
/// request as its own read, up to the queue depth in flight at once; short reads are
/// resubmitted for the rest.
pub struct UringReader {
    files: Arc<OpenFiles>,
    /// `None` only while dropping.
    requests: Option<Sender<Request>>,
    /// Written after each request so the ring thread, waiting on the ring, wakes to take it.
    wake: Arc<OwnedFd>,
    depth: usize,
}

impl UringReader {
    /// Create a ring of `depth` reads in flight (at least 1) over `files`, check that it works
    /// (the kernel or a seccomp filter may refuse io-uring, and the kernel refuses rings of
    /// more than 32768 entries) and start its thread.
    pub fn with_files(files: Arc<OpenFiles>, depth: usize) -> Result<UringReader> {
        let depth = depth.clamp(1, 1 << 20);
        let unavailable = |what: &str, e: io::Error| Error::Unsupported(format!("{what}: {e}"));
        // Room for every read in flight plus the wake-up poll.
        let entries = (depth as u32 + 1).next_power_of_two();
        let mut ring = IoUring::new(entries).map_err(|e| unavailable("cannot create a ring", e))?;
        let mut probe = io_uring::Probe::new();
        ring.submitter()
            .register_probe(&mut probe)
            .map_err(|e| unavailable("cannot probe the ring's operations", e))?;
        for (code, name) in [
            (opcode::Read::CODE, "read"),
            (opcode::PollAdd::CODE, "poll"),
        ] {
            if !probe.is_supported(code) {
                return Err(Error::Unsupported(format!(
                    "the kernel's io-uring lacks the {name} operation"
                )));
            }
        }
        // One round trip, in case submitting is refused although creating the ring was not.
        let nop = opcode::Nop::new().build().user_data(0);
        // SAFETY: a NOP references no memory.
        unsafe { ring.submission().push(&nop) }.map_err(|_| {
            Error::Unsupported("the ring's submission queue is full when new".into())
        })?;
        ring.submit_and_wait(1)
            .map_err(|e| unavailable("cannot submit to the ring", e))?;
        let nop_result = ring.completion().next().map(|c| c.result());
        if nop_result != Some(0) {
            return Err(Error::Unsupported(format!(
                "the ring answered a no-op with {nop_result:?}"
            )));
        }

        // SAFETY: eventfd takes no pointers; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(unavailable(
                "cannot create an eventfd",
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: `fd` is a freshly created descriptor that nothing else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let (tx, rx) = channel();
        let thread = RingThread {
            ring,
            files: files.clone(),
            wake: wake.clone(),
            depth,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            queue: VecDeque::new(),
            pending: HashMap::new(),
            next_id: 0,
            wake_armed: false,
        };
        std::thread::Builder::new()
            .name("coli-uring".into())
            .spawn(move || thread.run(rx))
            .map_err(|e| Error::Invalid(format!("cannot start the io-uring thread: {e}")))?;
        Ok(UringReader {
            files,
            requests: Some(tx),
            wake,
            depth,
        })
    }

    /// Reads in flight at most.
    pub fn depth(&self) -> usize {
        self.depth
    }
}

/// Add one to the eventfd `fd`, waking the ring thread's poll.
fn signal(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live local to a descriptor we hold open. A failure can
    // only be a saturated counter, which wakes the poll just the same.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

impl RangeReader for UringReader {
    fn submit(&self, ranges: Vec<ByteRange>, done: ReadDone) {
        let request = Request { ranges, done };
        let request = match &self.requests {
            Some(tx) => match tx.send(request) {
                Ok(()) => return signal(&self.wake),
                Err(failed) => failed.0,
            },
            None => request,
        };
        // The ring thread is gone: read here.
        deliver(request.done, read_ranges(&self.files, &request.ranges));
    }

    fn describe(&self) -> String {
        format!(
            "io-uring, queue depth {}, {}",
            self.depth,
            mode(&self.files)
        )
    }
}

impl Drop for UringReader {
    fn drop(&mut self) {
        // The thread finishes what is queued and in flight, then exits.
        drop(self.requests.take());
        signal(&self.wake);
    }
}

/// `user_data` of the wake-up poll's completion; reads use their slot index.
const WAKE: u64 = u64::MAX;

/// A range's read, queued or in flight.
struct Op {
    request: u64,
    index: usize,
    range: ByteRange,
    /// Built when first submitted, so queued reads hold no buffer yet.
    plan: Option<Plan>,
}

/// A request whose reads are not all done.
struct Pending {
    results: Vec<Option<Storage>>,
    left: usize,
    done: ReadDone,
}

/// The state of the io-uring thread.
///
/// Invariant: a buffer the kernel may be writing to belongs to an [`Op`] in `slots` until that
/// slot's completion has been reaped.
struct RingThread {
    ring: IoUring,
    files: Arc<OpenFiles>,
    wake: Arc<OwnedFd>,
    depth: usize,
    /// Reads in flight, by slot (the completion's `user_data`).
    slots: Vec<Option<Op>>,
    free: Vec<usize>,
    /// Reads waiting for a slot, in order.
    queue: VecDeque<Op>,
    pending: HashMap<u64, Pending>,
    next_id: u64,
    wake_armed: bool,
}

impl RingThread {
    fn run(mut self, rx: Receiver<Request>) {
        let mut closed = false;
        loop {
            loop {
                match rx.try_recv() {
                    Ok(r) => self.accept(r),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        closed = true;
                        break;
                    }
                }
            }
            self.fill();
            if !closed && !self.wake_armed {
                let poll =
                    opcode::PollAdd::new(types::Fd(self.wake.as_raw_fd()), libc::POLLIN as u32)
                        .build()
                        .user_data(WAKE);
                // SAFETY: a poll references no memory; the eventfd stays open as long as the
                // ring (this thread holds both).
                if unsafe { self.ring.submission().push(&poll) }.is_ok() {
                    self.wake_armed = true;
                }
            }
            let in_flight = self.depth - self.free.len();
            if closed && in_flight == 0 && self.queue.is_empty() {
                return;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                    ) => {}
                Err(e) => return self.fail_ring(e, rx),
            }
            let done: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (user_data, result) in done {
                self.complete(user_data, result);
            }
        }
    }

    /// Take a new request: fail it at once if a range is invalid, else queue its reads.
    fn accept(&mut self, request: Request) {
        let Request { ranges, done } = request;
        let mut results = Vec::with_capacity(ranges.len());
        for r in &ranges {
            let checked = self.files.source(r).and_then(|src| {
                r.offset
                    .checked_add(r.len as u64)
                    .filter(|&e| e <= i64::MAX as u64)
                    .map(|_| ())
                    .ok_or_else(|| {
                        src.range_error(
                            r,
                            io::Error::new(io::ErrorKind::InvalidInput, "the range ends past 2^63"),
                        )
                    })
            });
            if let Err(e) = checked {
                return deliver(done, Err(e));
            }
            results.push((r.len == 0).then(empty_storage));
        }
        let left = results.iter().filter(|r| r.is_none()).count();
        if left == 0 {
            let results = results.into_iter().flatten().collect();
            return deliver(done, Ok(results));
        }
        let id = self.next_id;
        self.next_id += 1;
        for (index, range) in ranges.into_iter().enumerate() {
            if range.len > 0 {
                self.queue.push_back(Op {
                    request: id,
                    index,
                    range,
                    plan: None,
                });
            }
        }
        self.pending.insert(
            id,
            Pending {
                results,
                left,
                done,
            },
        );
    }

    /// Move queued reads into free slots and onto the submission queue.
    fn fill(&mut self) {
        while let Some(&slot) = self.free.last() {
            let Some(mut op) = self.queue.pop_front() else {
                return;
            };
            if !self.pending.contains_key(&op.request) {
                continue; // its request already failed
            }
            let files = self.files.clone();
            let src = match files.source(&op.range) {
                Ok(src) => src,
                Err(e) => {
                    self.fail(op.request, e);
                    continue;
                }
            };
            let mut plan = match op.plan.take() {
                Some(p) => p,
                None => match files.plan(src, &op.range) {
                    Ok(p) => p,
                    Err(e) => {
                        self.fail(op.request, e);
                        continue;
                    }
                },
            };
            let fd = src.fd_for(plan.direct).as_raw_fd();
            let (offset, buf) = plan.next_chunk();
            // MAX_CHUNK keeps the length within u32.
            let read = opcode::Read::new(types::Fd(fd), buf.as_mut_ptr(), buf.len() as u32)
                .offset(offset)
                .build()
                .user_data(slot as u64);
            // SAFETY: the read writes into `plan.words`, a heap buffer that moves into
            // `self.slots[slot]` below and stays there, untouched and unfreed, until this
            // slot's completion is reaped in `complete` (or is leaked in `Drop`). The file
            // descriptor belongs to `self.files`, which this thread holds for its lifetime.
            let pushed = unsafe { self.ring.submission().push(&read) };
            op.plan = Some(plan);
            if pushed.is_err() {
                // Submission queue full: retry after the next submit.
                self.queue.push_front(op);
                return;
            }
            self.free.pop();
            self.slots[slot] = Some(op);
        }
    }

    /// Handle one completion.
    fn complete(&mut self, user_data: u64, result: i32) {
        if user_data == WAKE {
            self.wake_armed = false;
            let mut count = 0u64;
            // SAFETY: reads 8 bytes into a live local from the non-blocking eventfd we hold;
            // resetting the counter before the channel is drained loses no wake-up.
            unsafe { libc::read(self.wake.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
            return;
        }
        let slot = user_data as usize;
        let Some(mut op) = self.slots.get_mut(slot).and_then(Option::take) else {
            return;
        };
        // The kernel is done with this slot's buffer: it is ours again.
        self.free.push(slot);
        if !self.pending.contains_key(&op.request) {
            return; // the request failed earlier; the buffer can go now
        }
        let Some(mut plan) = op.plan.take() else {
            return;
        };
        let Ok(src) = self.files.source(&op.range) else {
            return;
        };
        if result < 0 {
            let e = io::Error::from_raw_os_error(-result);
            match -result {
                libc::EINTR | libc::EAGAIN => op.plan = Some(plan),
                libc::EINVAL if plan.direct => {
                    self.files.disable_direct(src, &e);
                    op.plan = None; // re-planned buffered when resubmitted
                }
                _ => {
                    let err = src.range_error(&op.range, e);
                    return self.fail(op.request, err);
                }
            }
            self.queue.push_front(op);
            return;
        }
        if let Err(e) = plan.advance(result as usize) {
            let err = src.range_error(&op.range, e);
            return self.fail(op.request, err);
        }
        if !plan.complete() {
            op.plan = Some(plan);
            self.queue.push_front(op); // a short read: the rest goes next
            return;
        }
        let Some(p) = self.pending.get_mut(&op.request) else {
            return;
        };
        p.results[op.index] = Some(plan.finish());
        p.left -= 1;
        if p.left == 0 {
            if let Some(p) = self.pending.remove(&op.request) {
                let results = p.results.into_iter().flatten().collect();
                deliver(p.done, Ok(results));
            }
        }
    }

    /// Fail `request` with `e`; its reads still in flight are dropped as they complete.
    fn fail(&mut self, request: u64, e: Error) {
        if let Some(p) = self.pending.remove(&request) {
            deliver(p.done, Err(e));
        }
    }

    /// The ring itself failed: fail what is pending, leave the buffers in flight to the kernel
    /// (leaked, in `Drop`), and serve later requests with synchronous reads.
    fn fail_ring(mut self, e: io::Error, rx: Receiver<Request>) {
        tracing::error!("io-uring failed ({e}); reading with pread from now on");
        let ids: Vec<u64> = self.pending.keys().copied().collect();
        for id in ids {
            self.fail(
                id,
                Error::Invalid(format!("the io-uring reader failed: {e}")),
            );
        }
        self.queue.clear();
        let files = self.files.clone();
        drop(self);
        while let Ok(r) = rx.recv() {
            deliver(r.done, read_ranges(&files, &r.ranges));
        }
    }
}

impl Drop for RingThread {
    fn drop(&mut self) {
        // Reads still in flight (only after the ring failed) may yet be written by the kernel:
        // leak their buffers rather than free memory it could write to.
        for op in self.slots.iter_mut().filter_map(Option::take) {
            std::mem::forget(op);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::mpsc::sync_channel;
    use std::time::Duration;

    /// Deterministic pseudo-random bytes.
    fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    struct Fixture {
        _dir: tempfile::TempDir,
        paths: Vec<PathBuf>,
        data: Vec<Vec<u8>>,
    }

    /// Two files on disk (not tmpfs where avoidable): one of an unaligned size, one a whole
    /// number of blocks.
    fn fixture() -> Fixture {
        let dir = tempfile::Builder::new()
            .prefix("colibri-reader-")
            .tempdir_in(std::env::temp_dir())
            .unwrap();
        let sizes = [1_000_003usize, 64 * DIRECT_ALIGN];
        let mut paths = Vec::new();
        let mut data = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let bytes = pseudo_random(n, 0x9e37_79b9_7f4a_7c15 + i as u64);
            let path = dir.path().join(format!("shard-{i}.safetensors"));
            let mut f = File::create(&path).unwrap();
            f.write_all(&bytes).unwrap();
            f.sync_all().unwrap();
            paths.push(path);
            data.push(bytes);
        }
        Fixture {
            _dir: dir,
            paths,
            data,
        }
    }

    /// Whether this machine lets us use io-uring.
    fn uring_works(f: &Fixture) -> bool {
        let files = Arc::new(OpenFiles::open(&f.paths, false).unwrap());
        match UringReader::with_files(files, 8) {
            Ok(_) => true,
            Err(e) => {
                eprintln!("io-uring unavailable here: {e}");
                false
            }
        }
    }

    fn kinds(f: &Fixture) -> Vec<ReaderKind> {
        let mut k = vec![ReaderKind::Pool, ReaderKind::Auto];
        if uring_works(f) {
            k.push(ReaderKind::Uring);
        }
        k
    }

    fn open(f: &Fixture, kind: ReaderKind, direct_io: bool) -> Arc<dyn RangeReader> {
        let opts = ReaderOptions {
            kind,
            threads: 3,
            direct_io,
        };
        let (reader, warnings) = open_reader(&f.paths, &opts).unwrap();
        let desc = reader.describe();
        if direct_io {
            let fell_back = warnings.iter().any(|w| w.contains("O_DIRECT"));
            assert!(
                desc.contains("O_DIRECT") || fell_back,
                "{desc} / {warnings:?}"
            );
            assert!(
                warnings.iter().filter(|w| w.contains("O_DIRECT")).count() <= 1,
                "{warnings:?}"
            );
        } else {
            assert!(desc.contains("buffered"), "{desc}");
        }
        eprintln!("{kind:?} direct={direct_io}: {desc} {warnings:?}");
        reader
    }

    /// Submit and wait for one request.
    fn read(reader: &dyn RangeReader, ranges: Vec<ByteRange>) -> Result<Vec<Storage>> {
        let (tx, rx) = sync_channel(1);
        reader.submit(
            ranges,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv_timeout(Duration::from_secs(60)).unwrap()
    }

    fn expect<'a>(f: &'a Fixture, r: &ByteRange) -> &'a [u8] {
        &f.data[r.file][r.offset as usize..r.offset as usize + r.len]
    }

    /// Ranges of every awkward kind: unaligned, aligned, tiny, long, ending exactly at the end
    /// of each file, empty.
    fn ranges(f: &Fixture, count: usize, seed: u64) -> Vec<ByteRange> {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut out = Vec::new();
        for (file, d) in f.data.iter().enumerate() {
            let size = d.len();
            out.push(ByteRange {
                file,
                offset: (size - 1) as u64,
                len: 1,
            });
            out.push(ByteRange {
                file,
                offset: (size - 200_000) as u64,
                len: 200_000,
            });
            out.push(ByteRange {
                file,
                offset: 0,
                len: size,
            });
            out.push(ByteRange {
                file,
                offset: DIRECT_ALIGN as u64,
                len: 2 * DIRECT_ALIGN,
            });
            out.push(ByteRange {
                file,
                offset: 17,
                len: 0,
            });
        }
        while out.len() < count {
            let file = (next() % f.data.len() as u64) as usize;
            let size = f.data[file].len();
            let len = 1 + (next() % 200_000) as usize;
            let len = len.min(size);
            let offset = next() % (size - len + 1) as u64;
            out.push(ByteRange { file, offset, len });
        }
        out
    }

    #[test]
    fn every_reader_returns_exactly_the_requested_bytes() {
        let f = fixture();
        for kind in kinds(&f) {
            for direct in [false, true] {
                let reader = open(&f, kind, direct);
                // One request with many ranges (more than the queue depth).
                let all = ranges(&f, 150, 7);
                let got = read(reader.as_ref(), all.clone()).unwrap();
                assert_eq!(got.len(), all.len());
                for (r, s) in all.iter().zip(&got) {
                    assert_eq!(s.bytes().len(), r.len, "{kind:?} {direct} {r:?}");
                    assert!(s.bytes() == expect(&f, r), "{kind:?} {direct} {r:?}");
                }
                // 100 requests in flight at once.
                let (tx, rx) = channel();
                let requests: Vec<Vec<ByteRange>> = (0..100u64)
                    .map(|i| {
                        // ranges() starts with 10 fixed ones; keep 1 to 5 random ones.
                        let mut rs = ranges(&f, 11 + (i % 5) as usize, 1000 + i);
                        rs.drain(..10);
                        rs
                    })
                    .collect();
                for (i, rs) in requests.iter().enumerate() {
                    let tx = tx.clone();
                    reader.submit(
                        rs.clone(),
                        Box::new(move |r| {
                            let _ = tx.send((i, r));
                        }),
                    );
                }
                for _ in 0..requests.len() {
                    let (i, r) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
                    let got = r.unwrap();
                    assert_eq!(got.len(), requests[i].len());
                    for (r, s) in requests[i].iter().zip(&got) {
                        assert!(s.bytes() == expect(&f, r), "{kind:?} {direct} {r:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn reads_past_the_end_name_the_file_and_offset() {
        let f = fixture();
        for kind in kinds(&f) {
            for direct in [false, true] {
                let reader = open(&f, kind, direct);
                for (file, d) in f.data.iter().enumerate() {
                    let size = d.len() as u64;
                    for (offset, len) in [(size - 10, 100), (size + 5000, 10), (size, 1)] {
                        let bad = ByteRange { file, offset, len };
                        let good = ByteRange {
                            file,
                            offset: 3,
                            len: 5000,
                        };
                        let msg = read(reader.as_ref(), vec![good, bad])
                            .err()
                            .unwrap_or_else(|| panic!("{kind:?} {direct} read past the end"))
                            .to_string();
                        let name = f.paths[file].file_name().unwrap().to_str().unwrap();
                        assert!(msg.contains(name), "{msg}");
                        assert!(msg.contains(&format!("offset {offset}")), "{msg}");
                        assert!(msg.contains(&format!("ends at byte {size}")), "{msg}");
                    }
                }
                // An unknown file is an error too, and the reader still works afterwards.
                let none = ByteRange {
                    file: 9,
                    offset: 0,
                    len: 1,
                };
                assert!(read(reader.as_ref(), vec![none]).is_err());
                let ok = ByteRange {
                    file: 0,
                    offset: 12345,
                    len: 777,
                };
                let got = read(reader.as_ref(), vec![ok.clone()]).unwrap();
                assert!(got[0].bytes() == expect(&f, &ok));
            }
        }
    }

    #[test]
    fn auto_picks_a_reader_and_says_which() {
        let f = fixture();
        let (reader, warnings) = open_reader(&f.paths, &ReaderOptions::default()).unwrap();
        let desc = reader.describe();
        if uring_works(&f) {
            assert!(desc.starts_with("io-uring, queue depth 64"), "{desc}");
            assert!(warnings.is_empty(), "{warnings:?}");
        } else {
            assert!(desc.starts_with("pread pool, 4 threads"), "{desc}");
            assert!(
                warnings.iter().any(|w| w.contains("io-uring")),
                "{warnings:?}"
            );
        }
        assert!(desc.ends_with("buffered"), "{desc}");
        let pool = ReaderOptions {
            kind: ReaderKind::Pool,
            threads: 0,
            direct_io: false,
        };
        let (reader, _) = open_reader(&f.paths, &pool).unwrap();
        assert_eq!(reader.describe(), "pread pool, 4 threads, buffered");
        // The names configuration files use (serde), aliases included.
        let kind = |s: &str| serde_json::from_value::<ReaderKind>(serde_json::json!(s));
        assert_eq!(kind("io-uring").unwrap(), ReaderKind::Uring);
        assert!(kind("mmap").is_err());
    }

    #[test]
    fn refused_direct_io_falls_back_with_one_warning() {
        // procfs refuses O_DIRECT (EINVAL); the checkpoint file next to it is read buffered.
        let f = fixture();
        let proc_file = PathBuf::from("/proc/version");
        let paths = vec![f.paths[0].clone(), proc_file];
        for kind in kinds(&f) {
            let opts = ReaderOptions {
                kind,
                threads: 2,
                direct_io: true,
            };
            let (reader, warnings) = open_reader(&paths, &opts).unwrap();
            let desc = reader.describe();
            eprintln!("{kind:?} with /proc/version: {desc} {warnings:?}");
            let direct_warnings: Vec<_> =
                warnings.iter().filter(|w| w.contains("O_DIRECT")).collect();
            if desc.contains("O_DIRECT") {
                assert!(direct_warnings.is_empty(), "{warnings:?}");
            } else {
                assert_eq!(direct_warnings.len(), 1, "{warnings:?}");
                assert!(direct_warnings[0].contains("/proc/version"), "{warnings:?}");
                assert!(desc.ends_with("buffered"), "{desc}");
            }
            let r = ByteRange {
                file: 0,
                offset: 4095,
                len: 70_001,
            };
            let got = read(reader.as_ref(), vec![r.clone()]).unwrap();
            assert!(got[0].bytes() == expect(&f, &r));
        }
    }

    #[test]
    fn auto_falls_back_to_the_pool_when_no_ring_can_be_made() {
        // The kernel refuses rings this deep, as it would refuse io-uring under seccomp.
        let f = fixture();
        let (reader, warnings) =
            open_reader_at_depth(&f.paths, &ReaderOptions::default(), 1 << 20).unwrap();
        assert_eq!(reader.describe(), "pread pool, 4 threads, buffered");
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with("io-uring is not available"),
            "{warnings:?}"
        );
        let opts = ReaderOptions {
            kind: ReaderKind::Uring,
            ..ReaderOptions::default()
        };
        let err = open_reader_at_depth(&f.paths, &opts, 1 << 20)
            .err()
            .unwrap();
        assert!(err.to_string().contains("ring"), "{err}");
        let r = ByteRange {
            file: 1,
            offset: 1,
            len: 9999,
        };
        let got = read(reader.as_ref(), vec![r.clone()]).unwrap();
        assert!(got[0].bytes() == expect(&f, &r));
    }

    #[test]
    fn dropping_a_reader_finishes_what_was_submitted() {
        let f = fixture();
        for kind in kinds(&f) {
            let reader = open(&f, kind, false);
            let (tx, rx) = channel();
            let rs = ranges(&f, 40, 99);
            for i in 0..20 {
                let tx = tx.clone();
                reader.submit(
                    rs.clone(),
                    Box::new(move |r| {
                        let _ = tx.send((i, r.map(|b| b.len())));
                    }),
                );
            }
            drop(reader);
            for _ in 0..20 {
                let (_, n) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
                assert_eq!(n.unwrap(), rs.len());
            }
        }
    }

    #[test]
    fn a_panicking_handler_does_not_stop_the_reader() {
        let f = fixture();
        for kind in kinds(&f) {
            let reader = open(&f, kind, false);
            let r = ByteRange {
                file: 1,
                offset: 100,
                len: 100,
            };
            reader.submit(
                vec![r.clone()],
                Box::new(|_| panic!("a deliberate panic in a test handler")),
            );
            let got = read(reader.as_ref(), vec![r.clone()]).unwrap();
            assert!(got[0].bytes() == expect(&f, &r));
        }
    }
}
