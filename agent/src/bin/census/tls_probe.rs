//! Why a TLS connection to the operator failed, when the call only says "operation
//! was canceled" or "connection closed". In TLS 1.3 the server judges the client's
//! certificate after the client has finished its half of the handshake: an operator
//! that refuses it (none presented, another CA's, an expired one) sends a TLS alert
//! and closes the connection under the first call, and the call's error no longer
//! carries the alert. A second handshake with the same files, made here, reads it.

use std::{io, path::Path, sync::Arc, time::Duration};

use census_agent::client::TlsFiles;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject as _};
use tokio::{io::AsyncReadExt as _, net::TcpStream};
use tokio_rustls::{
    TlsConnector,
    rustls::{self, ClientConfig, RootCertStore},
};

/// The alert the operator at `authority` (`host:port`) answers a handshake made
/// with `files` with, as rustls names it (`CertificateRequired`, `UnknownCA`, ...);
/// `None` when the handshake holds, or fails for another reason (the files, the
/// network), which the caller's own error already says.
pub(crate) async fn refusal(authority: &str, files: &TlsFiles, within: Duration) -> Option<String> {
    let config = client_config(files)?;
    let authority: http::uri::Authority = authority.parse().ok()?;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let name = ServerName::try_from(host.to_owned()).ok()?;
    let port = authority.port_u16()?;
    let probe = async {
        let tcp = TcpStream::connect((host, port)).await.ok()?;
        let mut tls = match TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
        {
            Ok(tls) => tls,
            Err(error) => return alert(&error),
        };
        // TLS 1.3: the verdict on the client's certificate comes after the
        // handshake, as the first thing the server sends.
        let mut byte = [0u8; 1];
        match tls.read(&mut byte).await {
            Err(error) => alert(&error),
            Ok(_) => None,
        }
    };
    tokio::time::timeout(within, probe).await.ok().flatten()
}

/// The TLS alert an IO error of rustls carries, if it is one.
fn alert(error: &io::Error) -> Option<String> {
    match error.get_ref()?.downcast_ref::<rustls::Error>()? {
        rustls::Error::AlertReceived(description) => Some(format!("{description:?}")),
        _ => None,
    }
}

fn client_config(files: &TlsFiles) -> Option<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(files.ca.as_deref()?).ok()? {
        roots.add(cert.ok()?).ok()?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(roots);
    let mut config = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(chain(cert)?, PrivateKeyDer::from_pem_file(key).ok()?)
            .ok()?,
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Some(config)
}

fn chain(path: &Path) -> Option<Vec<CertificateDer<'static>>> {
    CertificateDer::pem_file_iter(path)
        .ok()?
        .collect::<Result<Vec<_>, _>>()
        .ok()
}
