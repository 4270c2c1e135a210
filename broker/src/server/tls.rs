//! The TLS (amqps) side of the listener: building a rustls `ServerConfig` from PEM files with
//! the *ring* provider, reloading it when the files change (certificates are rotated without
//! a restart; connections already open keep the session they have), and reading the subject
//! common name of a verified client certificate for SASL EXTERNAL.

use crate::config::Config;
use parking_lot::{Mutex, RwLock};
use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use thiserror::Error;

/// Why a TLS configuration could not be built; each says which file to fix.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A file could not be read or holds no usable PEM item.
    #[error("cannot load {what} from {path}: {reason}")]
    File {
        /// Which file: certificate chain, private key or CA bundle.
        what: &'static str,
        /// The path as configured.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// rustls refused the combination (key does not match the certificate, bad CA, ...).
    #[error("invalid TLS configuration: {0}")]
    Rustls(String),
    /// `amqps_listen` is set without `tls_cert_file` or `tls_key_file`.
    #[error("amqps_listen needs tls_cert_file and tls_key_file (--tls-cert, --tls-key)")]
    MissingFiles,
}

/// The files a TLS configuration is built from, and the client-certificate policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
    /// PEM CA bundle for client certificates, if clients are asked for one.
    pub ca: Option<PathBuf>,
    /// Ask clients for a certificate and verify it (needs `ca`).
    pub verify_peer: bool,
    /// Refuse the handshake when the client presents no certificate.
    pub fail_if_no_peer_cert: bool,
}

impl TlsFiles {
    /// The TLS part of the broker configuration, or None when no TLS listener is configured.
    pub fn from_config(c: &Config) -> Result<Option<Self>, TlsError> {
        if c.amqps_listen.is_none() {
            return Ok(None);
        }
        let (Some(cert), Some(key)) = (&c.tls_cert_file, &c.tls_key_file) else {
            return Err(TlsError::MissingFiles);
        };
        Ok(Some(Self {
            cert: cert.clone(),
            key: key.clone(),
            ca: c.tls_ca_file.clone(),
            verify_peer: c.tls_verify_peer,
            fail_if_no_peer_cert: c.tls_fail_if_no_peer_cert,
        }))
    }

    /// Whether clients are asked for a certificate (and so may use SASL EXTERNAL).
    pub fn asks_for_client_cert(&self) -> bool {
        self.ca.is_some() && self.verify_peer
    }

    /// Reads the files and builds a server configuration with the ring provider.
    pub fn load(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let file_err = |what: &'static str, path: &Path, reason: String| TlsError::File {
            what,
            path: path.to_owned(),
            reason,
        };
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.cert)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|e| file_err("certificate chain", &self.cert, e.to_string()))?;
        if chain.is_empty() {
            return Err(file_err(
                "certificate chain",
                &self.cert,
                "no CERTIFICATE block".into(),
            ));
        }
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|e| file_err("private key", &self.key, e.to_string()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Rustls(e.to_string()))?;
        let builder = match (&self.ca, self.verify_peer) {
            (Some(ca), true) => {
                let mut roots = rustls::RootCertStore::empty();
                let cas = CertificateDer::pem_file_iter(ca)
                    .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| file_err("CA bundle", ca, e.to_string()))?;
                let (added, _) = roots.add_parsable_certificates(cas);
                if added == 0 {
                    return Err(file_err("CA bundle", ca, "no usable CA certificate".into()));
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
                let verifier = if self.fail_if_no_peer_cert {
                    verifier
                } else {
                    verifier.allow_unauthenticated()
                };
                let verifier = verifier
                    .build()
                    .map_err(|e| TlsError::Rustls(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let config = builder
            .with_single_cert(chain, key)
            .map_err(|e| TlsError::Rustls(e.to_string()))?;
        Ok(Arc::new(config))
    }

    /// Modification time and length of each file: what "the files changed" means.
    fn stamps(&self) -> Vec<Option<(SystemTime, u64)>> {
        let stamp = |p: &Path| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        };
        let mut v = vec![stamp(&self.cert), stamp(&self.key)];
        if let Some(ca) = &self.ca {
            v.push(stamp(ca));
        }
        v
    }
}

/// The TLS configuration in force, swapped when the files change. Each accepted connection
/// takes the current `Arc` once, so a reload never disturbs a handshake in progress.
#[derive(Debug)]
pub struct TlsState {
    files: TlsFiles,
    current: RwLock<Arc<ServerConfig>>,
    loaded_stamps: Mutex<Vec<Option<(SystemTime, u64)>>>,
}

impl TlsState {
    /// Loads the files once; a broker with a broken TLS configuration does not start.
    pub fn new(files: TlsFiles) -> Result<Self, TlsError> {
        let stamps = files.stamps();
        let config = files.load()?;
        Ok(Self {
            files,
            current: RwLock::new(config),
            loaded_stamps: Mutex::new(stamps),
        })
    }

    /// The configuration new connections use.
    pub fn current(&self) -> Arc<ServerConfig> {
        self.current.read().clone()
    }

    /// The files and policy this state was built from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Reloads when a file changed since the last successful load. A failed load (for
    /// example the certificate was rewritten but the key not yet) keeps the old
    /// configuration and is retried on the next call. Returns whether a new one is in force.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let stamps = self.files.stamps();
        if *self.loaded_stamps.lock() == stamps {
            return Ok(false);
        }
        let config = self.files.load()?;
        *self.current.write() = config;
        *self.loaded_stamps.lock() = stamps;
        Ok(true)
    }
}

/// Checks the certificate files every `interval` and swaps in a new configuration when
/// they changed. Runs for the life of the broker.
pub async fn reload_loop(state: Arc<TlsState>, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_error = String::new();
    loop {
        tick.tick().await;
        match state.reload_if_changed() {
            Ok(true) => {
                last_error.clear();
                tracing::info!(cert = %state.files.cert.display(), "TLS certificate reloaded");
            }
            Ok(false) => {}
            Err(e) => {
                // Say it once per distinct error, not every interval.
                let text = e.to_string();
                if text != last_error {
                    tracing::warn!(error = %text, "TLS files changed but cannot be loaded; keeping the previous certificate");
                    last_error = text;
                }
            }
        }
    }
}

/// The subject common name (OID 2.5.4.3) of a DER certificate, as SASL EXTERNAL takes the
/// user name from it (RabbitMQ's `ssl_cert_login_from = common_name`). The certificate was
/// verified by rustls before this reads it; every length is still checked.
pub fn subject_common_name(cert_der: &[u8]) -> Option<String> {
    const SEQUENCE: u8 = 0x30;
    const SET: u8 = 0x31;
    const OID: u8 = 0x06;
    const CN_OID: &[u8] = &[0x55, 0x04, 0x03];
    let (tag, cert, _) = der_tlv(cert_der)?;
    if tag != SEQUENCE {
        return None;
    }
    let (tag, mut tbs, _) = der_tlv(cert)?;
    if tag != SEQUENCE {
        return None;
    }
    // tbsCertificate: [0] version (optional), serial, signature, issuer, validity, subject.
    let (tag, _, rest) = der_tlv(tbs)?;
    if tag == 0xA0 {
        tbs = rest;
    }
    for _ in 0..4 {
        tbs = der_tlv(tbs)?.2;
    }
    let (tag, mut subject, _) = der_tlv(tbs)?;
    if tag != SEQUENCE {
        return None;
    }
    while !subject.is_empty() {
        let (tag, mut rdn, rest) = der_tlv(subject)?;
        subject = rest;
        if tag != SET {
            return None;
        }
        while !rdn.is_empty() {
            let (_, atv, rest) = der_tlv(rdn)?;
            rdn = rest;
            let (tag, oid, value) = der_tlv(atv)?;
            if tag == OID && oid == CN_OID {
                let (tag, text, _) = der_tlv(value)?;
                // UTF8String, PrintableString, T61String, IA5String.
                if matches!(tag, 0x0C | 0x13 | 0x14 | 0x16) {
                    return String::from_utf8(text.to_vec()).ok();
                }
                return None;
            }
        }
    }
    None
}

/// One DER tag-length-value: (tag, value, what follows). Definite lengths up to 4 bytes.
fn der_tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, mut rest) = rest.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7F);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        rest = &rest[n..];
        len
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert_with_cn(cn: &str) -> (String, String) {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "ringmq tests");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn the_common_name_is_read_from_the_subject() {
        let (pem, _) = cert_with_cn("app-user");
        let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        assert_eq!(subject_common_name(&der).as_deref(), Some("app-user"));
    }

    #[test]
    fn truncated_or_garbage_der_gives_no_name() {
        let (pem, _) = cert_with_cn("app-user");
        let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        for cut in [0, 1, 5, 40, der.len() / 2] {
            assert_eq!(subject_common_name(&der[..cut]), None, "cut at {cut}");
        }
        assert_eq!(
            subject_common_name(&[0x30, 0x84, 0xFF, 0xFF, 0xFF, 0xFF]),
            None
        );
    }

    #[test]
    fn a_changed_file_is_reloaded_and_a_broken_one_keeps_the_old_config() {
        let dir = std::env::temp_dir().join(format!("ringmq-tls-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = cert_with_cn("one");
        let files = TlsFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
            ca: None,
            verify_peer: true,
            fail_if_no_peer_cert: false,
        };
        std::fs::write(&files.cert, cert).unwrap();
        std::fs::write(&files.key, key).unwrap();
        let state = TlsState::new(files.clone()).unwrap();
        assert!(!state.reload_if_changed().unwrap());
        let before = state.current();
        std::fs::write(&files.key, "not a key").unwrap();
        assert!(state.reload_if_changed().is_err());
        assert!(Arc::ptr_eq(&before, &state.current()));
        let (cert, key) = cert_with_cn("two");
        std::fs::write(&files.cert, cert).unwrap();
        std::fs::write(&files.key, key).unwrap();
        assert!(state.reload_if_changed().unwrap());
        assert!(!Arc::ptr_eq(&before, &state.current()));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
