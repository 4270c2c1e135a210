//! TLS helpers for the tests: a throw-away certificate authority (rcgen, ring provider) that
//! issues server and client certificates into a directory, and a rustls client (ring
//! provider, no aws-lc) to connect to the broker's amqps listener.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A certificate authority whose files live in `dir`: `ca.pem`, and the server's
/// `server.pem` / `server.key` once [`Pki::write_server`] ran.
pub struct Pki {
    /// Directory holding the PEM files.
    pub dir: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its private key, PEM encoded.
pub struct Issued {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key (PKCS#8).
    pub key_pem: String,
}

impl Pki {
    /// A new CA named `name`, its certificate written to `dir/ca.pem`.
    pub fn new(dir: &Path, name: &str) -> Self {
        std::fs::create_dir_all(dir).expect("certificate dir is writable");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("valid params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().expect("key generation");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("self-signed CA");
        std::fs::write(dir.join("ca.pem"), issuer.pem()).expect("writable");
        Self {
            dir: dir.to_owned(),
            issuer,
        }
    }

    /// Path of the CA certificate.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// Path of the server certificate chain.
    pub fn server_cert_file(&self) -> PathBuf {
        self.dir.join("server.pem")
    }

    /// Path of the server key.
    pub fn server_key_file(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    /// The CA certificate in DER, for a client's root store.
    pub fn ca_der(&self) -> CertificateDer<'static> {
        self.issuer.der().clone()
    }

    /// A certificate for `localhost` / 127.0.0.1 with subject CN `cn`.
    pub fn server(&self, cn: &str) -> Issued {
        self.issue(
            cn,
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        )
    }

    /// A client certificate with subject CN `cn` (the user SASL EXTERNAL logs in as).
    pub fn client(&self, cn: &str) -> Issued {
        self.issue(cn, Vec::new(), ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// Issues a server certificate with CN `cn` and writes `server.pem` and `server.key`
    /// (each replaced with a rename, as certificate tooling does).
    pub fn write_server(&self, cn: &str) -> Issued {
        let issued = self.server(cn);
        replace_file(&self.server_key_file(), &issued.key_pem);
        replace_file(&self.server_cert_file(), &issued.cert_pem);
        issued
    }

    /// YAML lines enabling the amqps listener on an OS-assigned port with these files.
    pub fn broker_yaml(&self, with_ca: bool) -> String {
        let mut y = format!(
            "amqps_listen: 127.0.0.1:0\ntls_cert_file: {}\ntls_key_file: {}\ntls_reload_interval_s: 1\n",
            self.server_cert_file().display(),
            self.server_key_file().display()
        );
        if with_ca {
            y.push_str(&format!("tls_ca_file: {}\n", self.ca_file().display()));
        }
        y
    }

    fn issue(&self, cn: &str, sans: Vec<String>, usage: ExtendedKeyUsagePurpose) -> Issued {
        let mut params = CertificateParams::new(sans).expect("valid SANs");
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().expect("key generation");
        let cert = params.signed_by(&key, &self.issuer).expect("signing");
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

fn replace_file(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("writable");
    std::fs::rename(&tmp, path).expect("rename in the same dir");
}

/// A rustls client configuration (ring provider) trusting `ca`, presenting `client` if given.
pub fn client_config(
    ca: CertificateDer<'static>,
    client: Option<&Issued>,
) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).expect("a valid CA certificate");
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring supports the default versions")
    .with_root_certificates(roots);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some(c) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(c.cert_pem.as_bytes()).expect("PEM")],
                PrivateKeyDer::from_pem_slice(c.key_pem.as_bytes()).expect("PEM"),
            )
            .expect("a matching key"),
    };
    Arc::new(config)
}

/// Connects to `addr` and runs the TLS handshake for server name `localhost`.
pub async fn connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let name = ServerName::try_from("localhost").expect("a valid DNS name");
    tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
}

/// The subject CN of the certificate the server presented on `stream`, read by the broker's
/// own parser (the tests check rotation with it).
pub fn server_cert_cn(stream: &TlsStream<TcpStream>) -> Option<String> {
    let (_, session) = stream.get_ref();
    let leaf = session.peer_certificates()?.first()?;
    ringmq::server::tls::subject_common_name(leaf)
}
