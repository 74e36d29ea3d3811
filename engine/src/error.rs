//! The engine's error type. Every error names what it is about — the file, the tensor, the
//! config field or the request field — and, where there is one, what was expected, so the
//! binary can print it as one clear line.

use std::path::PathBuf;

/// Errors of the inference engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be opened or read. The I/O error is part of the message and is not
    /// also reported as the [`source`](std::error::Error::source): a chain printer (anyhow's
    /// `{:#}`) would print it twice.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A JSON file does not parse.
    #[error("{path}: invalid JSON: {message}")]
    Json { path: PathBuf, message: String },
    /// A file is truncated or its structure is corrupt.
    #[error("{path}: {message}")]
    Corrupt { path: PathBuf, message: String },
    /// A configuration field is missing or has a value we cannot use.
    #[error("{path}: field `{field}`: {message}")]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },
    /// A tensor is missing, mis-shaped or of a dtype we cannot use.
    #[error("{path}: tensor `{name}`: {message}")]
    Tensor {
        path: PathBuf,
        name: String,
        message: String,
    },
    /// Something this build does not support (a model type, a dtype, a rope type...).
    #[error("{0}")]
    Unsupported(String),
    /// An invalid argument or request (bad token id, empty prompt, context overflow...).
    #[error("{0}")]
    Invalid(String),
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, error: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error,
        }
    }

    /// A corrupt or truncated file.
    pub fn corrupt(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Corrupt {
            path: path.into(),
            message: message.into(),
        }
    }

    /// A bad or missing config field.
    pub fn config(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::Config {
            path: path.into(),
            field: field.into(),
            message: message.into(),
        }
    }

    /// A missing, mis-shaped or unusable tensor.
    pub fn tensor(
        path: impl Into<PathBuf>,
        name: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::Tensor {
            path: path.into(),
            name: name.into(),
            message: message.into(),
        }
    }
}

/// Read a whole file, naming it in the error.
pub fn read_file(path: &std::path::Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

/// Read and parse a JSON file, naming it in the error.
pub fn read_json(path: &std::path::Path) -> Result<serde_json::Value> {
    let bytes = read_file(path)?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every message of an error's chain, joined as anyhow's `{:#}` joins them.
    fn chain(e: &dyn std::error::Error) -> String {
        let mut text = e.to_string();
        let mut cause = e.source();
        while let Some(c) = cause {
            text.push_str(": ");
            text.push_str(&c.to_string());
            cause = c.source();
        }
        text
    }

    #[test]
    fn an_io_error_names_its_cause_once() {
        let e = Error::io(
            "/models/m/config.json",
            std::io::Error::from_raw_os_error(13),
        );
        let text = chain(&e);
        let cause = std::io::Error::from_raw_os_error(13).to_string();
        assert_eq!(text.matches(&cause).count(), 1, "{text}");
        assert!(text.starts_with("/models/m/config.json: "), "{text}");
    }
}
