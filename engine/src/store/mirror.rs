//! Mirror drives: byte-identical copies of the checkpoint on other drives (`--mirror DIR`,
//! repeatable), read alongside the primary so that their bandwidth adds up.
//!
//! This module owns three things:
//! - **validation** ([`MirrorSet::validate`]): every mirror file must have the primary file's
//!   name, size and safetensors header bytes; a mirror may lack some files (it is then partial
//!   and those files are always read from drives that have them), but not all of them. Mirrors
//!   are only ever read, never written.
//! - **routing** ([`MirrorSet::route`]): each request (one expert's ranges) goes to exactly one
//!   drive, chosen by weighted rendezvous hashing of (file, first offset). The same expert is
//!   therefore always read from the same drive (the page cache never holds it twice) and the
//!   load splits in proportion to the drives' weights.
//! - **fallback and counters** ([`MirroredReader`]): a failed mirror read is re-issued on the
//!   primary (logged once per mirror, counted every time) so the run goes on; a failed primary
//!   read is returned as is. Bytes, requests and fallbacks are counted per drive.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use super::reader::{ByteRange, RangeReader, ReadDone};
use crate::tensor::Storage;
use crate::{Error, Result};

/// The largest safetensors header compared byte for byte (the format's own sanity bound).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// One mirror drive as configured: a directory holding copies of (some of) the primary's
/// checkpoint files under the same names, and its share of the load relative to the others.
#[derive(Debug, Clone)]
pub struct Mirror {
    /// The directory holding the copies.
    pub dir: PathBuf,
    /// Relative share of the requests (the primary's weight defaults to 1.0); must be > 0.
    pub weight: f64,
}

/// One drive of a [`MirrorSet`]: the primary (index 0) or a mirror.
#[derive(Debug, Clone)]
pub struct Drive {
    /// The drive's model directory.
    pub dir: PathBuf,
    /// Its routing weight.
    pub weight: f64,
    /// For each primary file index, the index of that file in this drive's own file list (the
    /// list its reader was opened on), or `None` when the drive lacks the file.
    local: Vec<Option<usize>>,
}

impl Drive {
    /// Whether this drive holds primary file `file`.
    pub fn has(&self, file: usize) -> bool {
        self.local.get(file).is_some_and(|l| l.is_some())
    }

    /// How many of the primary's files this drive holds.
    pub fn files_held(&self) -> usize {
        self.local.iter().filter(|l| l.is_some()).count()
    }
}

/// The validated drives (primary first, then the mirrors in the order given) and the rule
/// that routes each request to one of them.
#[derive(Debug, Clone)]
pub struct MirrorSet {
    drives: Vec<Drive>,
}

impl MirrorSet {
    /// Check every mirror against the primary files `primary_paths` (in `primary_dir`): for
    /// each file name, a mirror either lacks it (partial mirror, reported in the returned
    /// warnings) or holds a copy of the same size whose safetensors header (the first 8 + N
    /// bytes) is identical. A size or header difference, a mirror holding none of the files, a
    /// mirror that is the primary directory or a repeated mirror, and a weight that is not a
    /// positive number are errors naming the file or directory.
    pub fn validate(
        primary_dir: &Path,
        primary_paths: &[PathBuf],
        primary_weight: f64,
        mirrors: &[Mirror],
    ) -> Result<(MirrorSet, Vec<String>)> {
        check_weight(primary_dir, primary_weight)?;
        let primary_canon = canonical_dir(primary_dir)?;
        let mut seen = vec![primary_canon];
        let mut drives = vec![Drive {
            dir: primary_dir.to_path_buf(),
            weight: primary_weight,
            local: (0..primary_paths.len()).map(Some).collect(),
        }];
        let mut warnings = Vec::new();
        for m in mirrors {
            check_weight(&m.dir, m.weight)?;
            let canon = canonical_dir(&m.dir)?;
            if seen.contains(&canon) {
                return Err(Error::Invalid(format!(
                    "mirror {}: is the model directory itself or another mirror given twice",
                    m.dir.display()
                )));
            }
            seen.push(canon);
            let mut local = Vec::with_capacity(primary_paths.len());
            let mut missing = Vec::new();
            let mut held = 0usize;
            for primary in primary_paths {
                let name = primary.file_name().ok_or_else(|| {
                    Error::Invalid(format!(
                        "checkpoint file {} has no file name",
                        primary.display()
                    ))
                })?;
                let copy = m.dir.join(name);
                if check_copy(primary, &copy)? {
                    local.push(Some(held));
                    held += 1;
                } else {
                    local.push(None);
                    missing.push(name.to_string_lossy().into_owned());
                }
            }
            if held == 0 {
                return Err(Error::Invalid(format!(
                    "mirror {}: holds none of the checkpoint's files ({}); expected byte-identical copies under the same names",
                    m.dir.display(),
                    list_names(primary_paths)
                )));
            }
            if !missing.is_empty() {
                warnings.push(format!(
                    "mirror {} is partial: it holds {held} of {} files; {} {} read from the other drives",
                    m.dir.display(),
                    primary_paths.len(),
                    missing.join(", "),
                    if missing.len() == 1 { "is" } else { "are" }
                ));
            }
            drives.push(Drive {
                dir: m.dir.clone(),
                weight: m.weight,
                local,
            });
        }
        Ok((MirrorSet { drives }, warnings))
    }

    /// The drives: the primary at index 0, then the mirrors.
    pub fn drives(&self) -> &[Drive] {
        &self.drives
    }

    /// The drive (index into [`MirrorSet::drives`]) that serves a request: among the drives
    /// holding the first range's file, the one with the highest weighted rendezvous score
    /// `w / -ln(u)` where `u` in (0, 1] is a hash of (file, first offset, drive). If that drive
    /// lacks a file of a later range, or the request is empty, the primary serves it.
    pub fn route(&self, ranges: &[ByteRange]) -> usize {
        let Some(first) = ranges.first() else {
            return 0;
        };
        let key = mix(mix(first.file as u64) ^ first.offset);
        let mut best = 0usize;
        let mut best_score = f64::NEG_INFINITY;
        for (i, d) in self.drives.iter().enumerate() {
            if !d.has(first.file) {
                continue;
            }
            let h = mix(key ^ mix(0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1)));
            // u in (0, 1]: 53 random bits, shifted off zero.
            let u = ((h >> 11) + 1) as f64 / (1u64 << 53) as f64;
            // w / -ln(u); u == 1 (ln = +0.0, whose negation would give -inf) wins outright.
            let e = -u.ln();
            let score = if e > 0.0 { d.weight / e } else { f64::INFINITY };
            if score > best_score {
                best_score = score;
                best = i;
            }
        }
        if ranges.iter().all(|r| self.drives[best].has(r.file)) {
            best
        } else {
            0
        }
    }

    /// The files drive `drive` holds, in its own index order (what its reader is opened on).
    fn drive_paths(&self, drive: usize, primary_paths: &[PathBuf]) -> Vec<PathBuf> {
        let d = &self.drives[drive];
        primary_paths
            .iter()
            .zip(&d.local)
            .filter(|(_, l)| l.is_some())
            .map(|(p, _)| match p.file_name() {
                Some(name) if drive > 0 => d.dir.join(name),
                _ => p.clone(),
            })
            .collect()
    }
}

/// Per-drive counters.
#[derive(Default)]
struct Counters {
    bytes: AtomicU64,
    requests: AtomicU64,
    fallbacks: AtomicU64,
    warned: AtomicBool,
}

/// What the completion callbacks share: the primary reader (for fallbacks) and the counters.
struct Shared {
    primary: Arc<dyn RangeReader>,
    dirs: Vec<PathBuf>,
    counters: Vec<Counters>,
}

impl Shared {
    fn served(&self, drive: usize, bytes: u64) {
        let c = &self.counters[drive];
        c.bytes.fetch_add(bytes, Ordering::Relaxed);
        c.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Read `ranges` (primary file indices) on the primary, counting what it serves.
    fn read_primary(self: &Arc<Self>, ranges: Vec<ByteRange>, done: ReadDone) {
        let bytes = ranges.iter().map(|r| r.len as u64).sum();
        let shared = self.clone();
        self.primary.submit(
            ranges,
            Box::new(move |result| {
                if result.is_ok() {
                    shared.served(0, bytes);
                }
                done(result)
            }),
        );
    }

    /// Count a failed read on mirror `drive`, warning the first time.
    fn fell_back(&self, drive: usize, error: &Error) {
        let c = &self.counters[drive];
        c.fallbacks.fetch_add(1, Ordering::Relaxed);
        if !c.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "mirror {}: read failed ({error}); reading from the primary instead. Further failures on this mirror are counted, not logged",
                self.dirs[drive].display()
            );
        }
    }
}

/// A [`RangeReader`] over the primary and its mirrors: routes each request to one drive (see
/// [`MirrorSet::route`]), re-issues a failed mirror read on the primary, and counts per drive.
///
/// A mirror that failed keeps receiving its share (a bad sector fails only its ranges); every
/// failure costs one extra read on the primary and is counted in [`MirroredReader::stats`].
pub struct MirroredReader {
    set: MirrorSet,
    /// One reader per drive, index 0 the primary; mirrors read their own file lists.
    readers: Vec<Arc<dyn RangeReader>>,
    shared: Arc<Shared>,
}

impl MirroredReader {
    /// Validate `mirrors` against the primary checkpoint files `primary_paths` in
    /// `primary_dir` (see [`MirrorSet::validate`]; the primary's weight is 1.0) and open a
    /// reader for each mirror with `make_reader`, called with the files that mirror holds (in
    /// primary order). `primary_reader` reads `primary_paths`. Returns the reader and the
    /// warnings for the start-up report (partial mirrors).
    pub fn open(
        primary_dir: &Path,
        primary_paths: &[PathBuf],
        primary_reader: Arc<dyn RangeReader>,
        mirrors: Vec<Mirror>,
        make_reader: impl Fn(&[PathBuf]) -> Result<Arc<dyn RangeReader>>,
    ) -> Result<(MirroredReader, Vec<String>)> {
        Self::open_weighted(
            primary_dir,
            primary_paths,
            primary_reader,
            1.0,
            mirrors,
            make_reader,
        )
    }

    /// [`MirroredReader::open`] with the primary's routing weight given.
    pub fn open_weighted(
        primary_dir: &Path,
        primary_paths: &[PathBuf],
        primary_reader: Arc<dyn RangeReader>,
        primary_weight: f64,
        mirrors: Vec<Mirror>,
        make_reader: impl Fn(&[PathBuf]) -> Result<Arc<dyn RangeReader>>,
    ) -> Result<(MirroredReader, Vec<String>)> {
        let (set, warnings) =
            MirrorSet::validate(primary_dir, primary_paths, primary_weight, &mirrors)?;
        let mut readers = vec![primary_reader.clone()];
        for drive in 1..set.drives.len() {
            readers.push(make_reader(&set.drive_paths(drive, primary_paths))?);
        }
        let shared = Arc::new(Shared {
            primary: primary_reader,
            dirs: set.drives.iter().map(|d| d.dir.clone()).collect(),
            counters: set.drives.iter().map(|_| Counters::default()).collect(),
        });
        Ok((
            MirroredReader {
                set,
                readers,
                shared,
            },
            warnings,
        ))
    }

    /// The drives and the routing rule.
    pub fn set(&self) -> &MirrorSet {
        &self.set
    }

    /// Per drive (primary first): its directory, the bytes and requests it served, and the
    /// requests that failed on it and were re-read from the primary (always 0 for the
    /// primary). A fallback's bytes count as served by the primary.
    pub fn stats(&self) -> Vec<(PathBuf, u64, u64, u64)> {
        self.shared
            .dirs
            .iter()
            .zip(&self.shared.counters)
            .map(|(dir, c)| {
                (
                    dir.clone(),
                    c.bytes.load(Ordering::Relaxed),
                    c.requests.load(Ordering::Relaxed),
                    c.fallbacks.load(Ordering::Relaxed),
                )
            })
            .collect()
    }
}

impl RangeReader for MirroredReader {
    fn submit(&self, ranges: Vec<ByteRange>, done: ReadDone) {
        let drive = self.set.route(&ranges);
        if drive == 0 {
            return self.shared.read_primary(ranges, done);
        }
        let local_of = &self.set.drives[drive].local;
        let local: Vec<ByteRange> = ranges
            .iter()
            .map(|r| ByteRange {
                // `route` only picks a mirror holding every file of the request.
                file: local_of[r.file].unwrap_or(0),
                offset: r.offset,
                len: r.len,
            })
            .collect();
        let shared = self.shared.clone();
        self.readers[drive].submit(
            local,
            Box::new(move |result| {
                match result.and_then(|bufs| check_lengths(&shared.dirs[drive], &ranges, bufs)) {
                    Ok(bufs) => {
                        shared.served(drive, ranges.iter().map(|r| r.len as u64).sum());
                        done(Ok(bufs))
                    }
                    Err(e) => {
                        shared.fell_back(drive, &e);
                        shared.read_primary(ranges, done)
                    }
                }
            }),
        );
    }

    fn drive_bytes(&self) -> Vec<(PathBuf, u64)> {
        self.stats()
            .into_iter()
            .map(|(d, b, _, _)| (d, b))
            .collect()
    }

    fn describe(&self) -> String {
        let total = self.set.drives.first().map_or(0, |d| d.local.len());
        let drives: Vec<String> = self
            .set
            .drives
            .iter()
            .zip(&self.readers)
            .enumerate()
            .map(|(i, (d, r))| {
                let role = if i == 0 {
                    "primary".to_string()
                } else {
                    format!("mirror, {}/{total} files", d.files_held())
                };
                format!(
                    "{} ({role}, weight {}, {})",
                    d.dir.display(),
                    d.weight,
                    r.describe()
                )
            })
            .collect();
        format!(
            "{} drives, requests split by weight: {}",
            drives.len(),
            drives.join("; ")
        )
    }
}

/// A mirror's buffers must match the requested ranges; anything else is treated as a failed
/// read (and re-read from the primary).
fn check_lengths(dir: &Path, ranges: &[ByteRange], bufs: Vec<Storage>) -> Result<Vec<Storage>> {
    let ok = bufs.len() == ranges.len()
        && bufs
            .iter()
            .zip(ranges)
            .all(|(b, r)| b.bytes().len() == r.len);
    if ok {
        Ok(bufs)
    } else {
        Err(Error::Invalid(format!(
            "mirror {}: the reader returned buffers that do not match the {} requested ranges",
            dir.display(),
            ranges.len()
        )))
    }
}

fn check_weight(dir: &Path, weight: f64) -> Result<()> {
    if weight.is_finite() && weight > 0.0 {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "drive {}: weight {weight} is not a positive number",
            dir.display()
        )))
    }
}

fn canonical_dir(dir: &Path) -> Result<PathBuf> {
    let canon = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    if !canon.is_dir() {
        return Err(Error::io(
            dir,
            std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
        ));
    }
    Ok(canon)
}

fn list_names(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.file_name().unwrap_or_default().to_string_lossy())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether `copy` is present and a valid copy of `primary` (same size, same header bytes):
/// `Ok(false)` when absent, an error naming `copy` when it differs.
fn check_copy(primary: &Path, copy: &Path) -> Result<bool> {
    let meta = match std::fs::metadata(copy) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Error::io(copy, e)),
    };
    let differs = |what: String| {
        Error::corrupt(
            copy,
            format!(
                "is not a byte-identical copy of {}: {what}",
                primary.display()
            ),
        )
    };
    if !meta.is_file() {
        return Err(differs("it is not a regular file".into()));
    }
    let size = std::fs::metadata(primary)
        .map_err(|e| Error::io(primary, e))?
        .len();
    if meta.len() != size {
        return Err(differs(format!(
            "it has {} bytes, the primary {size} (an incomplete copy?)",
            meta.len()
        )));
    }
    let pf = File::open(primary).map_err(|e| Error::io(primary, e))?;
    let cf = File::open(copy).map_err(|e| Error::io(copy, e))?;
    // The header length prefix (or the whole file when shorter), then the header.
    let n = size.min(8) as usize;
    let p_len = read_at(&pf, primary, 0, n)?;
    let c_len = read_at(&cf, copy, 0, n)?;
    if p_len != c_len {
        return Err(differs(format!(
            "its safetensors header length differs ({} bytes, the primary {})",
            header_len(&c_len),
            header_len(&p_len)
        )));
    }
    let hlen = header_len(&p_len)
        .min(MAX_HEADER_BYTES)
        .min(size - n as u64) as usize;
    let p_head = read_at(&pf, primary, n as u64, hlen)?;
    let c_head = read_at(&cf, copy, n as u64, hlen)?;
    if let Some(at) = p_head.iter().zip(&c_head).position(|(a, b)| a != b) {
        return Err(differs(format!(
            "its safetensors header differs at byte {} (of {hlen} header bytes)",
            n + at
        )));
    }
    Ok(true)
}

/// The little-endian header length in the first 8 bytes (0 when the file is shorter).
fn header_len(prefix: &[u8]) -> u64 {
    prefix.try_into().map(u64::from_le_bytes).unwrap_or(0)
}

fn read_at(file: &File, path: &Path, offset: u64, len: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, offset)
        .map_err(|e| Error::io(path, e))?;
    Ok(buf)
}

/// SplitMix64 finalizer: a fast, well-mixed 64-bit hash.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::reader::PreadPool;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc::channel;

    const PAYLOAD: usize = 64 * 1024;

    /// A small safetensors-like file: 8-byte LE header length, JSON header, payload.
    fn fake_file(path: &Path, seed: u8, header_extra: &str) {
        let header = format!(
            r#"{{"w":{{"dtype":"U8","shape":[{PAYLOAD}],"data_offsets":[0,{PAYLOAD}]}}{header_extra}}}"#
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend((0..PAYLOAD).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)));
        std::fs::write(path, bytes).unwrap();
    }

    const NAMES: [&str; 2] = ["a.safetensors", "b.safetensors"];

    /// A primary dir with two files and its paths.
    fn primary() -> (tempfile::TempDir, Vec<PathBuf>) {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> = NAMES.iter().map(|n| dir.path().join(n)).collect();
        for (i, p) in paths.iter().enumerate() {
            fake_file(p, i as u8 * 7 + 1, "");
        }
        (dir, paths)
    }

    /// A mirror dir holding copies of the given primary files.
    fn mirror_of(paths: &[PathBuf], which: &[usize]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for &i in which {
            std::fs::copy(&paths[i], dir.path().join(NAMES[i])).unwrap();
        }
        dir
    }

    fn pool(paths: &[PathBuf]) -> Result<Arc<dyn RangeReader>> {
        Ok(Arc::new(PreadPool::new(paths, 2)?))
    }

    fn read(r: &dyn RangeReader, ranges: Vec<ByteRange>) -> Result<Vec<Vec<u8>>> {
        let (tx, rx) = channel();
        r.submit(
            ranges,
            Box::new(move |res| {
                tx.send(res.map(|b| b.iter().map(|s| s.bytes().to_vec()).collect()))
                    .unwrap()
            }),
        );
        rx.recv().unwrap()
    }

    /// Expert-like requests: three ranges in one file starting at `offset`.
    fn request(file: usize, offset: u64) -> Vec<ByteRange> {
        (0..3)
            .map(|k| ByteRange {
                file,
                offset: offset + k * 100,
                len: 50 + k as usize,
            })
            .collect()
    }

    fn offsets(n: u64) -> impl Iterator<Item = u64> {
        // Distinct offsets inside the payload (which starts after a ~60-byte header).
        (0..n).map(|i| 100 + (i * 29) % (PAYLOAD as u64 - 400))
    }

    /// A reader that fails every request after the first `ok` ones.
    struct FailAfter {
        label: &'static str,
        inner: Arc<dyn RangeReader>,
        ok: usize,
        seen: AtomicUsize,
    }

    impl RangeReader for FailAfter {
        fn submit(&self, ranges: Vec<ByteRange>, done: ReadDone) {
            if self.seen.fetch_add(1, Ordering::SeqCst) < self.ok {
                self.inner.submit(ranges, done)
            } else {
                let r = &ranges[0];
                done(Err(Error::io(
                    format!("{}-file-{}", self.label, r.file),
                    std::io::Error::other(format!("injected failure at offset {}", r.offset)),
                )))
            }
        }
        fn describe(&self) -> String {
            "failing".into()
        }
    }

    fn fail_after(
        label: &'static str,
        paths: &[PathBuf],
        ok: usize,
    ) -> Result<Arc<dyn RangeReader>> {
        Ok(Arc::new(FailAfter {
            label,
            inner: pool(paths)?,
            ok,
            seen: AtomicUsize::new(0),
        }))
    }

    #[test]
    fn same_bytes_as_the_primary() {
        let (dir, paths) = primary();
        let m1 = mirror_of(&paths, &[0, 1]);
        let m2 = mirror_of(&paths, &[0, 1]);
        let plain = pool(&paths).unwrap();
        let mirrors = vec![
            Mirror {
                dir: m1.path().into(),
                weight: 1.0,
            },
            Mirror {
                dir: m2.path().into(),
                weight: 2.0,
            },
        ];
        let (r, warnings) =
            MirroredReader::open(dir.path(), &paths, pool(&paths).unwrap(), mirrors, pool).unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        let mut n = 0;
        for file in 0..2 {
            for off in offsets(300) {
                let want = read(plain.as_ref(), request(file, off)).unwrap();
                assert_eq!(read(&r, request(file, off)).unwrap(), want);
                n += 1;
            }
        }
        let stats = r.stats();
        assert_eq!(stats.len(), 3);
        assert_eq!(stats.iter().map(|s| s.2).sum::<u64>(), n);
        assert!(stats.iter().all(|s| s.2 > 0 && s.3 == 0), "{stats:?}");
        assert_eq!(stats.iter().map(|s| s.1).sum::<u64>(), n * (50 + 51 + 52));
        let d = r.describe();
        assert!(d.contains("3 drives") && d.contains("weight 2"), "{d}");
    }

    #[test]
    fn routing_is_deterministic_and_weighted() {
        let (dir, paths) = primary();
        let m = mirror_of(&paths, &[0, 1]);
        let mirrors = [Mirror {
            dir: m.path().into(),
            weight: 3.0,
        }];
        let (set, _) = MirrorSet::validate(dir.path(), &paths, 1.0, &mirrors).unwrap();
        let (again, _) = MirrorSet::validate(dir.path(), &paths, 1.0, &mirrors).unwrap();
        let mut to_mirror = 0;
        for off in 0..2000u64 {
            let req = request((off % 2) as usize, off * 4096);
            let d = set.route(&req);
            assert_eq!(d, set.route(&req));
            assert_eq!(d, again.route(&req));
            to_mirror += (d == 1) as usize;
        }
        let share = to_mirror as f64 / 2000.0;
        assert!((0.65..0.85).contains(&share), "mirror share {share}");
        // Equal weights split about evenly.
        let (even, _) = MirrorSet::validate(
            dir.path(),
            &paths,
            3.0,
            &[Mirror {
                dir: m.path().into(),
                weight: 3.0,
            }],
        )
        .unwrap();
        let share = (0..2000u64)
            .filter(|&o| even.route(&request(0, o * 4096)) == 1)
            .count() as f64
            / 2000.0;
        assert!((0.4..0.6).contains(&share), "even share {share}");
    }

    #[test]
    fn partial_mirror_serves_only_the_file_it_has() {
        let (dir, paths) = primary();
        let m = mirror_of(&paths, &[1]);
        let plain = pool(&paths).unwrap();
        let mirrors = vec![Mirror {
            dir: m.path().into(),
            weight: 100.0,
        }];
        let (r, warnings) =
            MirroredReader::open(dir.path(), &paths, pool(&paths).unwrap(), mirrors, pool).unwrap();
        assert_eq!(warnings.len(), 1);
        assert!(
            warnings[0].contains("a.safetensors") && warnings[0].contains("1 of 2"),
            "{warnings:?}"
        );
        assert!(!r.set().drives()[1].has(0) && r.set().drives()[1].has(1));
        for off in offsets(200) {
            assert_eq!(r.set().route(&request(0, off)), 0);
            assert_eq!(
                read(&r, request(0, off)).unwrap(),
                read(plain.as_ref(), request(0, off)).unwrap()
            );
        }
        let stats = r.stats();
        assert_eq!((stats[0].2, stats[1].2), (200, 0));
        // File 1 (local index 0 on the mirror) is served mostly by the mirror, correctly.
        for off in offsets(200) {
            assert_eq!(
                read(&r, request(1, off)).unwrap(),
                read(plain.as_ref(), request(1, off)).unwrap()
            );
        }
        let stats = r.stats();
        assert!(stats[1].2 > 150, "{stats:?}");
        // A request spanning both files goes to the primary when the mirror would win.
        let mut mixed = request(1, 500);
        mixed.extend(request(0, 500));
        assert_eq!(r.set().route(&mixed), 0);
        assert_eq!(
            read(&r, mixed.clone()).unwrap(),
            read(plain.as_ref(), mixed).unwrap()
        );
    }

    #[test]
    fn mismatched_mirrors_are_errors_naming_them() {
        let (dir, paths) = primary();
        let check = |m: &tempfile::TempDir, want: &str| {
            let mirrors = [Mirror {
                dir: m.path().into(),
                weight: 1.0,
            }];
            let err = MirrorSet::validate(dir.path(), &paths, 1.0, &mirrors)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&m.path().display().to_string()) && err.contains(want),
                "{err}"
            );
        };
        // Different size.
        let m = mirror_of(&paths, &[0, 1]);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(m.path().join(NAMES[1]))
            .unwrap();
        f.set_len(PAYLOAD as u64).unwrap();
        check(&m, "bytes");
        // Same size, different header byte.
        let m = mirror_of(&paths, &[0, 1]);
        let mut bytes = std::fs::read(&paths[0]).unwrap();
        bytes[12] ^= 1;
        std::fs::write(m.path().join(NAMES[0]), &bytes).unwrap();
        check(&m, "header differs at byte 12");
        // Different header length, same total size.
        let m = mirror_of(&paths, &[0]);
        let p = m.path().join(NAMES[1]);
        fake_file(
            &p,
            8,
            r#","x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}"#,
        );
        let mut bytes = std::fs::read(&p).unwrap();
        bytes.truncate(std::fs::metadata(&paths[1]).unwrap().len() as usize);
        std::fs::write(&p, &bytes).unwrap();
        check(&m, "header length differs");
        // Holding none of the files.
        let m = tempfile::tempdir().unwrap();
        check(&m, "holds none");
        // The primary itself, and a bad weight.
        let err = MirrorSet::validate(
            dir.path(),
            &paths,
            1.0,
            &[Mirror {
                dir: dir.path().into(),
                weight: 1.0,
            }],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("model directory itself"), "{err}");
        let m = mirror_of(&paths, &[0]);
        let err = MirrorSet::validate(
            dir.path(),
            &paths,
            1.0,
            &[Mirror {
                dir: m.path().into(),
                weight: 0.0,
            }],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("positive"), "{err}");
    }

    #[test]
    fn failing_mirror_falls_back_to_the_primary() {
        let (dir, paths) = primary();
        let m = mirror_of(&paths, &[0, 1]);
        let plain = pool(&paths).unwrap();
        let mirrors = vec![Mirror {
            dir: m.path().into(),
            weight: 3.0,
        }];
        let (r, _) = MirroredReader::open(
            dir.path(),
            &paths,
            pool(&paths).unwrap(),
            mirrors,
            |p: &[PathBuf]| fail_after("mirror", p, 10),
        )
        .unwrap();
        let mut to_mirror = 0u64;
        for file in 0..2 {
            for off in offsets(100) {
                to_mirror += (r.set().route(&request(file, off)) == 1) as u64;
                assert_eq!(
                    read(&r, request(file, off)).unwrap(),
                    read(plain.as_ref(), request(file, off)).unwrap()
                );
            }
        }
        let stats = r.stats();
        assert_eq!(stats[1].2, 10, "{stats:?}");
        assert_eq!(stats[1].3, to_mirror - 10, "{stats:?}");
        assert_eq!(stats[0].2, 200 - 10);
        assert_eq!(stats[0].3, 0);
    }

    #[test]
    fn truncated_mirror_falls_back_to_the_primary() {
        let (dir, paths) = primary();
        let m = mirror_of(&paths, &[0, 1]);
        let plain = pool(&paths).unwrap();
        let mirrors = vec![Mirror {
            dir: m.path().into(),
            weight: 5.0,
        }];
        let (r, _) =
            MirroredReader::open(dir.path(), &paths, pool(&paths).unwrap(), mirrors, pool).unwrap();
        // Cut the mirror's copy of file 0 to its header after validation.
        std::fs::OpenOptions::new()
            .write(true)
            .open(m.path().join(NAMES[0]))
            .unwrap()
            .set_len(90)
            .unwrap();
        for off in offsets(200) {
            assert_eq!(
                read(&r, request(0, off)).unwrap(),
                read(plain.as_ref(), request(0, off)).unwrap()
            );
        }
        let stats = r.stats();
        assert!(stats[1].3 > 100, "{stats:?}");
        assert_eq!(stats[1].2, 0, "{stats:?}");
        assert_eq!(stats[0].2, 200);
    }

    #[test]
    fn primary_errors_surface() {
        let (dir, paths) = primary();
        let m = mirror_of(&paths, &[0, 1]);
        let mirrors = vec![Mirror {
            dir: m.path().into(),
            weight: 1.0,
        }];
        // The primary fails everything; the mirror fails everything too, so requests routed
        // there fall back to the primary and fail with the primary's error.
        let (r, _) = MirroredReader::open(
            dir.path(),
            &paths,
            fail_after("primary", &paths, 0).unwrap(),
            mirrors,
            |p: &[PathBuf]| fail_after("mirror", p, 0),
        )
        .unwrap();
        let mut via_mirror = 0;
        for off in offsets(50) {
            via_mirror += (r.set().route(&request(1, off)) == 1) as usize;
            let err = read(&r, request(1, off)).unwrap_err().to_string();
            assert!(
                err.contains("primary-file-1") && err.contains(&format!("offset {off}")),
                "{err}"
            );
        }
        assert!(via_mirror > 0);
        let stats = r.stats();
        assert_eq!(stats[1].3 as usize, via_mirror);
        assert_eq!(stats[0].2 + stats[1].2, 0);
        // An out-of-file read on a real primary names the file and the offset.
        let (r, _) =
            MirroredReader::open(dir.path(), &paths, pool(&paths).unwrap(), vec![], pool).unwrap();
        let err = read(&r, request(0, 1 << 30)).unwrap_err().to_string();
        assert!(
            err.contains("a.safetensors") && err.contains(&format!("offset {}", 1u64 << 30)),
            "{err}"
        );
    }
}
