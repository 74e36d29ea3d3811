//! Positioned reads of checkpoint byte ranges into owned buffers, on a bounded pool of I/O
//! threads (so disk waits never block compute threads). Errors name the file and offset.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};

use crate::tensor::Storage;
use crate::{Error, Result};

/// One byte range of one checkpoint file.
#[derive(Debug, Clone)]
pub struct ByteRange {
    pub file: usize,
    pub offset: u64,
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
    /// How it reads, for the start-up report (e.g. "pread pool, 4 threads").
    fn describe(&self) -> String;
}

/// A bounded pool of threads doing `pread`s.
pub struct PreadPool {
    files: Arc<Vec<(PathBuf, File)>>,
    jobs: Mutex<Sender<Job>>,
    threads: usize,
}

impl PreadPool {
    /// Open `paths` for reading and start `threads` I/O threads.
    pub fn new(paths: &[PathBuf], threads: usize) -> Result<PreadPool> {
        let files = paths
            .iter()
            .map(|p| {
                File::open(p)
                    .map(|f| (p.clone(), f))
                    .map_err(|e| Error::io(p, e))
            })
            .collect::<Result<Vec<_>>>()?;
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
            files: Arc::new(files),
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
        let job: Job = Box::new(move || done(read_ranges(&files, &ranges)));
        let sent = self.jobs.lock().map(|tx| tx.send(job));
        if let Ok(Err(failed)) = sent {
            // The pool is gone (only at shutdown): run the read here.
            (failed.0)();
        }
    }

    fn describe(&self) -> String {
        format!("pread pool, {} threads", self.threads)
    }
}

fn read_ranges(files: &[(PathBuf, File)], ranges: &[ByteRange]) -> Result<Vec<Storage>> {
    ranges
        .iter()
        .map(|r| {
            let (path, file) = &files[r.file];
            let mut words = vec![0u64; r.len.div_ceil(8)];
            let buf = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..r.len];
            file.read_exact_at(buf, r.offset).map_err(|e| {
                Error::io(
                    path,
                    std::io::Error::new(
                        e.kind(),
                        format!("reading {} bytes at offset {}: {e}", r.len, r.offset),
                    ),
                )
            })?;
            Ok(Storage::Owned {
                words: Arc::new(words),
                len: r.len,
            })
        })
        .collect()
}
