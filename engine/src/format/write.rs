//! Writing files atomically: a temporary file beside the target, renamed into place when
//! complete, so a crash never leaves a half-written file under the real name. Also a streaming
//! safetensors writer (header first, then each tensor's bytes in order) for synthetic models.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::tensor::DType;
use crate::{Error, Result};

/// Write `bytes` to `path` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_path(path);
    let mut f = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| Error::io(&tmp, e))?;
    f.sync_all().map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

/// The temporary name used while writing `path`.
pub fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.tmp", std::process::id()));
    path.with_file_name(name)
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
    tmp: PathBuf,
    out: BufWriter<File>,
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
        let tmp = tmp_path(path);
        let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        out.write_all(&(json.len() as u64).to_le_bytes())
            .and_then(|_| out.write_all(&json))
            .map_err(|e| Error::io(&tmp, e))?;
        Ok(SafetensorsWriter {
            path: path.to_path_buf(),
            tmp,
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
            .map_err(|e| Error::io(&self.tmp, e))?;
        self.written_in_tensor += bytes.len();
        if self.written_in_tensor == spec.nbytes() {
            self.next += 1;
            self.written_in_tensor = 0;
        }
        Ok(())
    }

    /// Flush, sync and rename into place.
    pub fn finish(self) -> Result<()> {
        if self.next != self.specs.len() {
            return Err(Error::Invalid(format!(
                "{}: only {} of {} tensors were written",
                self.path.display(),
                self.next,
                self.specs.len()
            )));
        }
        commit(self.out, &self.tmp, &self.path)
    }
}

/// Flush and sync a buffered temporary file, then rename it to `path`: the last step of every
/// atomic write.
pub fn commit(out: BufWriter<File>, tmp: &Path, path: &Path) -> Result<()> {
    let mut out = out;
    out.flush().map_err(|e| Error::io(tmp, e))?;
    let file = out
        .into_inner()
        .map_err(|e| Error::io(tmp, e.into_error()))?;
    file.sync_all().map_err(|e| Error::io(tmp, e))?;
    std::fs::rename(tmp, path).map_err(|e| Error::io(path, e))
}
