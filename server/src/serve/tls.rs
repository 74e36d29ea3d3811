//! HTTPS for `coli serve`: the rustls server configuration built from `tls_cert`/`tls_key`
//! (PEM files), with the `ring` crypto provider. Loaded once at start-up, so a missing file, a
//! file without a certificate or key, or a key that does not match the certificate stops the
//! server before it listens, with the key and the file named.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

/// The TLS acceptor for the certificate chain in `cert` and the private key in `key`.
pub fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .with_context(|| {
            format!(
                "tls_cert `{}`: reading the certificate chain (a PEM file)",
                cert.display()
            )
        })?;
    if certs.is_empty() {
        bail!(
            "tls_cert `{}`: no `BEGIN CERTIFICATE` block in the file (expected the PEM certificate chain, server certificate first)",
            cert.display()
        );
    }
    let key_der = PrivateKeyDer::from_pem_file(key).with_context(|| {
        format!(
            "tls_key `{}`: reading the private key (a PEM file with a PKCS#8, PKCS#1 or SEC1 key)",
            key.display()
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS: the protocol versions of the ring provider")?
        .with_no_client_auth()
        .with_single_cert(certs, key_der)
        .with_context(|| {
            format!(
                "tls_cert `{}` / tls_key `{}`: the key does not fit the certificate",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_files_name_the_key_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a pem file\n").unwrap();
        let e = format!("{:#}", acceptor(&missing, &missing).err().unwrap());
        assert!(e.contains("tls_cert") && e.contains("missing.pem"), "{e}");
        let e = format!("{:#}", acceptor(&empty, &empty).err().unwrap());
        assert!(e.contains("no `BEGIN CERTIFICATE`"), "{e}");

        let a = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let b = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let cert = dir.path().join("cert.pem");
        let key = dir.path().join("key.pem");
        let other_key = dir.path().join("other.pem");
        std::fs::write(&cert, a.cert.pem()).unwrap();
        std::fs::write(&key, a.signing_key.serialize_pem()).unwrap();
        std::fs::write(&other_key, b.signing_key.serialize_pem()).unwrap();
        assert!(acceptor(&cert, &key).is_ok());
        let e = format!("{:#}", acceptor(&cert, &empty).err().unwrap());
        assert!(e.contains("tls_key") && e.contains("empty.pem"), "{e}");
        let e = format!("{:#}", acceptor(&cert, &other_key).err().unwrap());
        assert!(e.contains("does not fit"), "{e}");
    }
}
