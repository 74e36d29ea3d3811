//! Writing files atomically: a temporary file beside the target, synced and renamed into place
//! when complete (and the directory synced, so the rename itself survives a power cut), so a
//! crash never leaves a half-written file under the real name. Every file colibri writes goes
//! through [`AtomicFile`] (streamed writers: KV files, GGUF and safetensors output) or
//! [`write_atomic`] (a whole buffer: usage history, configs, tokenizers, saved chats); a write
//! that fails or is abandoned removes its temporary and leaves the target as it was. Also a
//! streaming safetensors writer (header first, then each tensor's bytes in order) for
//! synthetic models.
//!
//! Every temporary (a file, or a directory for a whole checkpoint) is named after its target
//! and its owner's process id, `NAME.PID.tmp` ([`tmp_path`]), and its owner holds an exclusive
//! advisory lock (`flock`) on it while writing. A process killed while writing leaves its
//! temporary behind, unlocked (the kernel drops the locks of a process that ends);
//! [`remove_stale_temporaries`] removes such leftovers, and every writer removes those of its
//! own target before it starts ([`create_tmp`]). A temporary is stale when nobody holds its
//! lock and its process id is either not running or this process's own (a container restarts
//! its server under the same pid, and this process never leaves one of its live temporaries
//! unlocked). A live writer's temporary is never removed: it is locked, which also protects
//! writers in other pid namespaces sharing the directory; where the file system has no locks,
//! only temporaries of processes that are not running are removed.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::tensor::DType;
use crate::{Error, Result};

/// Held while this process creates and locks a temporary, and while it looks for stale ones,
/// so that it never takes one of its own for stale in the instant between the two.
static TEMPORARIES: Mutex<()> = Mutex::new(());

/// Write `bytes` to `path` atomically (see [`AtomicFile`]). On failure the temporary is
/// removed and `path` is left as it was.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicFile::with_capacity(path, 0)?;
    f.write_all(bytes).map_err(|e| Error::io(f.tmp_path(), e))?;
    f.commit()
}

/// A file being written atomically: bytes go to a locked temporary beside the target (see
/// [`create_tmp`]); [`commit`](AtomicFile::commit) flushes and fsyncs it, renames it to the
/// target and fsyncs the directory. Dropped without a commit (an error on the way, a panic),
/// it removes the temporary, so the target keeps its old contents (or stays absent).
pub struct AtomicFile {
    path: PathBuf,
    tmp: PathBuf,
    /// `None` once committed.
    out: Option<BufWriter<File>>,
}

impl AtomicFile {
    /// Start writing `path`, buffering 64 KiB.
    pub fn create(path: &Path) -> Result<AtomicFile> {
        AtomicFile::with_capacity(path, 64 << 10)
    }

    /// Start writing `path` with a write buffer of `capacity` bytes (0: unbuffered, for
    /// callers that hand over one large buffer).
    pub fn with_capacity(path: &Path, capacity: usize) -> Result<AtomicFile> {
        let (tmp, file) = create_tmp(path)?;
        Ok(AtomicFile {
            path: path.to_path_buf(),
            tmp,
            out: Some(BufWriter::with_capacity(capacity, file)),
        })
    }

    /// Start writing `path` where an interrupted writer left off: a stale temporary of `path`
    /// (left by a process that ended while writing it; see the module documentation) is
    /// taken over — renamed to this process's temporary and locked — and its bytes kept, so
    /// the caller appends after them. Returns the file and the bytes already in it (0 when
    /// there was no temporary to take over: a fresh start). The caller must check the kept
    /// bytes (a checksum of the whole file before [`commit`](AtomicFile::commit)): a process
    /// killed mid-write leaves exactly what it wrote, a power cut may leave less or garbage.
    /// Other stale temporaries of `path` are removed.
    pub fn resume(path: &Path) -> Result<(AtomicFile, u64)> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let tmp = tmp_path(path);
        {
            let _guard = TEMPORARIES.lock().unwrap_or_else(|e| e.into_inner());
            // The largest stale temporary of `path` is the one to continue.
            let mut stale: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)
                .map(|entries| {
                    entries
                        .flatten()
                        .filter_map(|e| {
                            let file_name = e.file_name();
                            let (of, pid) = temporary_owner(file_name.to_str()?)?;
                            let p = e.path();
                            let meta = std::fs::symlink_metadata(&p).ok()?;
                            (of == name && meta.is_file() && is_stale(&p, pid))
                                .then_some((meta.len(), p))
                        })
                        .collect()
                })
                .unwrap_or_default();
            stale.sort();
            if let Some((_, largest)) = stale.pop() {
                if largest != tmp {
                    // Atomic: of two processes taking over the same temporary, one wins and
                    // the other finds it gone and starts afresh.
                    let _ = std::fs::rename(&largest, &tmp);
                }
            }
            for (_, other) in stale {
                let _ = std::fs::remove_file(other);
            }
        }
        let _guard = TEMPORARIES.lock().unwrap_or_else(|e| e.into_inner());
        let file = open_locked(&tmp, path)?;
        let kept = file.metadata().map_err(|e| Error::io(&tmp, e))?.len();
        let mut out = BufWriter::with_capacity(1 << 20, file);
        std::io::Seek::seek(&mut out, std::io::SeekFrom::Start(kept))
            .map_err(|e| Error::io(&tmp, e))?;
        Ok((
            AtomicFile {
                path: path.to_path_buf(),
                tmp,
                out: Some(out),
            },
            kept,
        ))
    }

    /// Flush and fsync what was written so far (the temporary stays a temporary).
    pub fn sync(&mut self) -> Result<()> {
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        out.flush()
            .and_then(|()| out.get_ref().sync_all())
            .map_err(|e| Error::io(&self.tmp, e))
    }

    /// Like [`commit`](AtomicFile::commit), but never replaces an existing `path`: the
    /// temporary is linked under the target's name (which fails if a file has that name), then
    /// unlinked. On an error the temporary is kept (a rerun may verify and publish it again).
    pub fn commit_new(mut self) -> Result<()> {
        self.sync()?;
        if let Some(out) = self.out.take() {
            drop(out);
        }
        match std::fs::hard_link(&self.tmp, &self.path) {
            Ok(()) => std::fs::remove_file(&self.tmp).map_err(|e| Error::io(&self.tmp, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(Error::io(&self.path, e))
            }
            // A file system without hard links: rename, having checked the name is free.
            Err(_) if !self.path.exists() => {
                std::fs::rename(&self.tmp, &self.path).map_err(|e| Error::io(&self.path, e))?
            }
            Err(e) => return Err(Error::io(&self.path, e)),
        }
        sync_parent(&self.path)
    }

    /// Drop what was written so far and start the temporary again from its first byte.
    pub fn restart(&mut self) -> Result<()> {
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        out.flush()
            .and_then(|()| out.get_ref().set_len(0))
            .and_then(|()| std::io::Seek::seek(out, std::io::SeekFrom::Start(0)).map(|_| ()))
            .map_err(|e| Error::io(&self.tmp, e))
    }

    /// The file this becomes on commit.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The temporary being written (what I/O errors name).
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// Flush and fsync the temporary, rename it to the target, fsync the directory. On an
    /// error before the rename the temporary is removed and the target left as it was.
    pub fn commit(mut self) -> Result<()> {
        let Some(out) = self.out.take() else {
            return Ok(());
        };
        let synced = out
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|file| file.sync_all())
            .map_err(|e| Error::io(&self.tmp, e))
            .and_then(|()| {
                std::fs::rename(&self.tmp, &self.path).map_err(|e| Error::io(&self.path, e))
            });
        if let Err(e) = synced {
            let _ = std::fs::remove_file(&self.tmp);
            return Err(e);
        }
        sync_parent(&self.path)
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &mut self.out {
            Some(out) => out.write(buf),
            None => Err(std::io::Error::other("the file is already committed")),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match &mut self.out {
            Some(out) => out.write_all(buf),
            None => Err(std::io::Error::other("the file is already committed")),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.out {
            Some(out) => out.flush(),
            None => Ok(()),
        }
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if let Some(out) = self.out.take() {
            // Not committed: discard the buffer unwritten, close, remove.
            let (file, _unwritten) = out.into_parts();
            drop(file);
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Fsync the directory holding `path`, so that a rename into it is on disk.
pub fn sync_parent(path: &Path) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

/// The temporary name this process uses while writing `path`: `NAME.PID.tmp` beside it.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.tmp", std::process::id()));
    path.with_file_name(name)
}

/// Create the temporary file for writing `path` (see [`tmp_path`]), locked for as long as
/// the returned file is open, after removing the stale temporaries of `path` left by
/// processes that ended. Errors when a live writer holds the same temporary (a process of the
/// same id in another pid namespace, or another writer of `path` in this process).
pub fn create_tmp(path: &Path) -> Result<(PathBuf, File)> {
    remove_stale_temporaries_of(path);
    let tmp = tmp_path(path);
    let _guard = TEMPORARIES.lock().unwrap_or_else(|e| e.into_inner());
    let file = open_locked(&tmp, path)?;
    file.set_len(0).map_err(|e| Error::io(&tmp, e))?;
    Ok((tmp, file))
}

/// Open (creating it, keeping its bytes) and lock `tmp`, the temporary of `path`; errors when
/// a live writer holds its lock. The caller holds `TEMPORARIES`.
fn open_locked(tmp: &Path, path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(tmp)
        .map_err(|e| Error::io(tmp, e))?;
    if try_lock(&file) == Lock::Held {
        return Err(in_use(tmp, path));
    }
    Ok(file)
}

/// Create the temporary directory for writing the directory `path` (see [`tmp_path`]; a
/// leftover of an earlier attempt under the same name is emptied), after removing the stale
/// temporaries of `path`. The returned handle on the directory holds its lock: keep it until
/// the directory is renamed into place.
pub fn create_tmp_dir(path: &Path) -> Result<(PathBuf, File)> {
    remove_stale_temporaries_of(path);
    let tmp = tmp_path(path);
    let _guard = TEMPORARIES.lock().unwrap_or_else(|e| e.into_inner());
    if tmp.exists() {
        let old = File::open(&tmp).map_err(|e| Error::io(&tmp, e))?;
        if try_lock(&old) == Lock::Held {
            return Err(in_use(&tmp, path));
        }
        drop(old);
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let handle = File::open(&tmp).map_err(|e| Error::io(&tmp, e))?;
    try_lock(&handle);
    Ok((tmp, handle))
}

/// The error for a temporary another live process is writing.
fn in_use(tmp: &Path, path: &Path) -> Error {
    Error::Invalid(format!(
        "{}: another process is writing {} (it holds this temporary's lock); try again when it has finished",
        tmp.display(),
        path.display()
    ))
}

/// Remove the stale temporaries (see the module documentation) in `dir` whose target name
/// satisfies `target`: files and directories named `NAME.PID.tmp`. Returns what was
/// removed; each removal is logged, and one that fails is logged and skipped. A directory
/// that cannot be read (or does not exist) has nothing to remove.
pub fn remove_stale_temporaries(dir: &Path, target: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let _guard = TEMPORARIES.lock().unwrap_or_else(|e| e.into_inner());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((of, pid)) = name.to_str().and_then(temporary_owner) else {
            continue;
        };
        let path = entry.path();
        if !target(of) || !is_stale(&path, pid) {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let (bytes, gone) = if meta.is_dir() {
            (dir_bytes(&path), std::fs::remove_dir_all(&path))
        } else {
            (meta.len(), std::fs::remove_file(&path))
        };
        match gone {
            Ok(()) => {
                tracing::info!(
                    "removed {} ({bytes} bytes), left by process {pid}, which ended while writing it",
                    path.display()
                );
                removed.push(path);
            }
            Err(e) => tracing::warn!(
                "cannot remove {}, a temporary left by process {pid}, which ended: {e}",
                path.display()
            ),
        }
    }
    removed
}

/// [`remove_stale_temporaries`] for the temporaries of `path` only.
pub fn remove_stale_temporaries_of(path: &Path) -> Vec<PathBuf> {
    let (Some(name), Some(dir)) = (path.file_name().and_then(|n| n.to_str()), path.parent()) else {
        return Vec::new();
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    remove_stale_temporaries(dir, |of| of == name)
}

/// The target name and owner pid of a temporary's file name `NAME.PID.tmp`.
pub fn temporary_owner(name: &str) -> Option<(&str, u32)> {
    let (target, pid) = name.strip_suffix(".tmp")?.rsplit_once('.')?;
    let digits = !pid.is_empty() && pid.len() <= 10 && pid.bytes().all(|b| b.is_ascii_digit());
    let pid: u32 = pid.parse().ok().filter(|_| digits)?;
    (!target.is_empty() && pid > 0).then_some((target, pid))
}

/// Whether the temporary at `path` owned by process `pid` was left by a process that ended.
fn is_stale(path: &Path, pid: u32) -> bool {
    let me = pid == std::process::id();
    let lock = match File::open(path) {
        Ok(f) => try_lock(&f),
        Err(_) => Lock::Unknown,
    };
    match lock {
        Lock::Held => false,
        // Every live temporary of this process is locked (see `TEMPORARIES`).
        Lock::Free => me || !process_running(pid),
        Lock::Unknown => !me && !process_running(pid),
    }
}

/// What an attempt to lock a temporary found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lock {
    /// It was free, and is now held through the given file until that is closed.
    Free,
    /// Another open file (of this or another process) holds it.
    Held,
    /// The file system does not say (no advisory locks).
    Unknown,
}

/// Take an exclusive advisory lock (`flock`) on `file` without waiting, held until every
/// handle of that open file is closed: `false` when another open file holds it (a file
/// system without advisory locks counts as free). Also works on a directory's handle.
pub fn try_lock_exclusive(file: &File) -> bool {
    try_lock(file) != Lock::Held
}

/// Try to take an exclusive advisory lock on `file`, without waiting.
fn try_lock(file: &File) -> Lock {
    // SAFETY: flock takes a descriptor (valid: `file` is open for the whole call) and flags,
    // no pointers.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Lock::Free;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EWOULDBLOCK) => Lock::Held,
        _ => Lock::Unknown,
    }
}

/// Whether a process with id `pid` is running (or cannot be told apart from one that is).
fn process_running(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 sends nothing; kill only checks that the process exists. `pid` is
    // positive, so it names one process, never a group.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Bytes of the files under `dir` (for the log line of a removed temporary directory).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// One tensor to be written.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// Size in bytes.
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// Streams a safetensors file: the header is written up front from the specs, then the
/// tensors' bytes in the same order. The file appears under its name only on [`finish`].
///
/// [`finish`]: SafetensorsWriter::finish
pub struct SafetensorsWriter {
    path: PathBuf,
    out: AtomicFile,
    specs: Vec<TensorSpec>,
    next: usize,
    written_in_tensor: usize,
}

impl SafetensorsWriter {
    /// Start writing `path` with these tensors, in this order.
    pub fn create(path: &Path, specs: Vec<TensorSpec>) -> Result<SafetensorsWriter> {
        let mut header = serde_json::Map::new();
        let mut meta = serde_json::Map::new();
        meta.insert("format".into(), "pt".into());
        header.insert("__metadata__".into(), meta.into());
        let mut offset = 0usize;
        for s in &specs {
            let n = s.nbytes();
            header.insert(
                s.name.clone(),
                serde_json::json!({
                    "dtype": s.dtype.safetensors_name(),
                    "shape": s.shape,
                    "data_offsets": [offset, offset + n],
                }),
            );
            offset += n;
        }
        let mut json = serde_json::to_vec(&header).expect("header serializes");
        while !(8 + json.len()).is_multiple_of(8) {
            json.push(b' ');
        }
        let mut out = AtomicFile::with_capacity(path, 8 << 20)?;
        out.write_all(&(json.len() as u64).to_le_bytes())
            .and_then(|_| out.write_all(&json))
            .map_err(|e| Error::io(out.tmp_path(), e))?;
        Ok(SafetensorsWriter {
            path: path.to_path_buf(),
            out,
            specs,
            next: 0,
            written_in_tensor: 0,
        })
    }

    /// Append bytes of the current tensor (a tensor may be written in several pieces).
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let spec = self.specs.get(self.next).ok_or_else(|| {
            Error::Invalid(format!(
                "{}: more data than declared tensors",
                self.path.display()
            ))
        })?;
        let remaining = spec.nbytes() - self.written_in_tensor;
        if bytes.len() > remaining {
            return Err(Error::Invalid(format!(
                "{}: tensor `{}` given more bytes than its shape holds",
                self.path.display(),
                spec.name
            )));
        }
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io(self.out.tmp_path(), e))?;
        self.written_in_tensor += bytes.len();
        if self.written_in_tensor == spec.nbytes() {
            self.next += 1;
            self.written_in_tensor = 0;
        }
        Ok(())
    }

    /// Flush, sync and rename into place (dropped unfinished, the temporary is removed).
    pub fn finish(self) -> Result<()> {
        all_written(&self.path, self.next, self.specs.len())?;
        self.out.commit()
    }
}

/// A tensor writer's check before it commits `path`: an error unless all `total` tensors
/// were written (`written` of them were).
pub(crate) fn all_written(path: &Path, written: usize, total: usize) -> Result<()> {
    if written != total {
        return Err(Error::Invalid(format!(
            "{}: only {written} of {total} tensors were written",
            path.display()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process id that is not running: a child that has exited and been reaped.
    fn dead_pid() -> u32 {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(!process_running(pid));
        pid
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn temporary_names_carry_target_and_pid() {
        let path = Path::new("/x/slot-3.kv");
        let tmp = tmp_path(path);
        let name = tmp.file_name().unwrap().to_str().unwrap();
        assert_eq!(name, format!("slot-3.kv.{}.tmp", std::process::id()));
        assert_eq!(tmp.parent(), Some(Path::new("/x")));
        assert_eq!(
            temporary_owner(name),
            Some(("slot-3.kv", std::process::id()))
        );
        assert_eq!(temporary_owner("a.b.17.tmp"), Some(("a.b", 17)));
        for not in [
            "x.tmp",
            ".12.tmp",
            "a.+12.tmp",
            "a.0.tmp",
            "a.12345678901.tmp",
            "a.12.tmpx",
            "a.1x.tmp",
            "a.12",
        ] {
            assert_eq!(temporary_owner(not), None, "{not}");
        }
    }

    #[test]
    fn only_temporaries_of_ended_processes_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let dead = dead_pid();
        let live = std::os::unix::process::parent_id();
        let me = std::process::id();
        // Left by a dead process: a file and a directory (a checkpoint half written).
        std::fs::write(d.join(format!("slot-0.kv.{dead}.tmp")), b"half").unwrap();
        std::fs::create_dir(d.join(format!("model.{dead}.tmp"))).unwrap();
        std::fs::write(d.join(format!("model.{dead}.tmp/a.safetensors")), b"12345").unwrap();
        // A live process's (unlocked: it may be in the instant before it locks).
        std::fs::write(d.join(format!("slot-1.kv.{live}.tmp")), b"live").unwrap();
        // One with this process's id that nobody holds: a container restarted under the same
        // pid left it, as this process locks every temporary it writes.
        std::fs::write(d.join(format!("slot-2.kv.{me}.tmp")), b"old").unwrap();
        // This process writing now (locked).
        let (writing, _held) = create_tmp(&d.join("slot-3.kv")).unwrap();
        // A dead pid, but locked: a live writer in another pid namespace.
        let foreign = d.join(format!("slot-4.kv.{dead}.tmp"));
        std::fs::write(&foreign, b"elsewhere").unwrap();
        let foreign_lock = File::open(&foreign).unwrap();
        assert_eq!(try_lock(&foreign_lock), Lock::Free);
        // Not temporaries, and a temporary of a target the filter excludes.
        std::fs::write(d.join("notes.tmp"), b"").unwrap();
        std::fs::write(d.join("slot-0.kv"), b"kept").unwrap();
        std::fs::write(d.join(format!("other.json.{dead}.tmp")), b"").unwrap();

        let removed = remove_stale_temporaries(d, |t| t != "other.json");
        let mut removed: Vec<String> = removed
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
            .collect();
        removed.sort();
        let mut expected = vec![
            format!("model.{dead}.tmp"),
            format!("slot-0.kv.{dead}.tmp"),
            format!("slot-2.kv.{me}.tmp"),
        ];
        expected.sort();
        assert_eq!(removed, expected);
        let mut kept = vec![
            "notes.tmp".to_string(),
            "slot-0.kv".to_string(),
            format!("other.json.{dead}.tmp"),
            format!("slot-1.kv.{live}.tmp"),
            writing.file_name().unwrap().to_str().unwrap().to_string(),
            format!("slot-4.kv.{dead}.tmp"),
        ];
        kept.sort();
        assert_eq!(names(d), kept);
        // Once the foreign writer is gone, its temporary is stale too.
        drop(foreign_lock);
        assert_eq!(
            remove_stale_temporaries_of(&d.join("slot-4.kv")),
            vec![foreign]
        );
    }

    #[test]
    fn atomic_writes_leave_only_the_target_and_clear_their_leftovers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.json");
        let dead = dead_pid();
        std::fs::write(dir.path().join(format!("h.json.{dead}.tmp")), b"{").unwrap();
        write_atomic(&path, b"{}").unwrap();
        write_atomic(&path, b"{\"a\":1}").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"{\"a\":1}");
        assert_eq!(names(dir.path()), ["h.json"]);
        // A failed write leaves neither a temporary nor a target.
        let missing = dir.path().join("no/such/dir/x.json");
        assert!(write_atomic(&missing, b"{}").is_err());
        assert_eq!(names(dir.path()), ["h.json"]);
    }

    #[test]
    fn a_state_write_that_is_refused_names_the_path_and_keeps_the_old_file() {
        // What usage history (`write_atomic`) and KV files (`AtomicFile`) meet when the state
        // directory is read-only (EACCES).
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir(&state).unwrap();
        let path = state.join("history.json");
        write_atomic(&path, b"old").unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o555)).unwrap();
        // Root (CAP_DAC_OVERRIDE, as in many containers) writes into a 0555 directory anyway:
        // probe, and if so test the same promise with failures root cannot override.
        let probe = state.join("probe");
        let root = std::fs::write(&probe, b"x").is_ok();
        let _ = std::fs::remove_file(&probe);
        if !root {
            let err = write_atomic(&path, b"new").unwrap_err().to_string();
            assert!(err.contains("history.json"), "{err}");
            assert!(err.contains(&state.display().to_string()), "{err}");
            let err = AtomicFile::create(&path).err().unwrap().to_string();
            assert!(err.contains("history.json"), "{err}");
            assert_eq!(std::fs::read(&path).unwrap(), b"old");
            assert_eq!(names(&state), ["history.json"]);
        }
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
        // Failures no capability overrides. (1) The temporary is held by a live writer (a
        // temporary's name taken by a directory would not do: as this process's own unlocked
        // leftover it is cleared and the write succeeds): the error names it, the old file
        // stays.
        let (tmp, held) = create_tmp(&path).unwrap();
        let err = write_atomic(&path, b"new").unwrap_err().to_string();
        assert!(err.contains("history.json"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        drop(held);
        std::fs::remove_file(&tmp).unwrap(); // the other writer's, gone with it
                                             // (2) The state directory's parent is a regular file (ENOTDIR).
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        let under = file.join("history.json");
        let err = write_atomic(&under, b"new").unwrap_err().to_string();
        assert!(
            err.contains("not-a-dir") && err.contains("history.json"),
            "{err}"
        );
        assert_eq!(names(&state), ["history.json"]);
    }

    #[test]
    fn an_atomic_file_appears_only_on_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kv");
        std::fs::write(&path, b"old").unwrap();
        let mut f = AtomicFile::with_capacity(&path, 4).unwrap();
        f.write_all(b"new contents, longer than the buffer")
            .unwrap();
        // Until the commit the target is the old file, and the temporary is beside it.
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(
            names(dir.path()),
            ["kv".to_string(), format!("kv.{}.tmp", std::process::id())]
        );
        f.commit().unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"new contents, longer than the buffer"
        );
        assert_eq!(names(dir.path()), ["kv"]);
    }

    #[test]
    fn an_abandoned_or_failed_atomic_file_leaves_the_target_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.gguf");
        std::fs::write(&path, b"old").unwrap();
        // Dropped without a commit (an error or a panic half-way): the temporary goes.
        let mut f = AtomicFile::create(&path).unwrap();
        f.write_all(&[7u8; 100_000]).unwrap();
        drop(f);
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(names(dir.path()), ["model.gguf"]);

        // A commit that fails (the rename: the target is now a non-empty directory) removes
        // the temporary too.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("inside"), b"x").unwrap();
        let mut f = AtomicFile::create(&blocked).unwrap();
        f.write_all(b"data").unwrap();
        let err = f.commit().unwrap_err().to_string();
        assert!(err.contains("blocked"), "{err}");
        assert_eq!(names(dir.path()), ["blocked", "model.gguf"]);
        assert_eq!(names(&blocked), ["inside"]);
    }

    #[test]
    fn a_temporary_held_by_a_live_writer_is_not_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let (tmp, _held) = create_tmp(&path).unwrap();
        let err = create_tmp(&path).unwrap_err().to_string();
        assert!(
            err.contains("another process is writing") && err.contains("m.gguf"),
            "{err}"
        );
        assert!(tmp.exists());
        let (dtmp, _dheld) = create_tmp_dir(&dir.path().join("ckpt")).unwrap();
        let err = create_tmp_dir(&dir.path().join("ckpt"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("another process is writing"), "{err}");
        assert!(dtmp.is_dir());
    }
}
