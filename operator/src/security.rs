//! How the gRPC server is secured, from the flags: its TLS, who authenticates
//! callers, and the rule that an operator without TLS listens on loopback only
//! (docs/security.md, "Mutual TLS").
//!
//! | flags | callers prove themselves with | listen |
//! |---|---|---|
//! | none | nothing: [`AuthMode::Loopback`], any local process may speak for any node | loopback only |
//! | `--tls-cert --tls-key --client-ca` | a client certificate of the CA ([`AuthMode::MutualTls`]) | anywhere |
//! | `--tls-cert --tls-key`, `--store kubernetes` | a ServiceAccount token ([`AuthMode::BearerToken`]) | anywhere |
//!
//! Everything is read and checked before the operator listens: a bad file or a
//! missing flag stops it at start, naming the flag.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use crate::{
    certs::{NodeCa, NodeCertError},
    config::{StoreKind, TlsArgs},
    grpc::ServerTls,
};

/// The gRPC port when `--grpc-listen` is not given.
pub const DEFAULT_GRPC_PORT: u16 = 9460;

const KEY: &str = "private key";

/// Who authenticates the gRPC server's callers.
#[derive(Debug)]
pub enum AuthMode {
    /// Nobody: no TLS, loopback only; every caller may speak for any node.
    Loopback,
    /// Mutual TLS: the client certificate, of this CA, names the node or a reader.
    MutualTls(NodeCa),
    /// In a cluster: the `authorization: Bearer` ServiceAccount token, checked by a
    /// TokenReview.
    BearerToken,
}

/// The gRPC server's address, TLS and authentication.
#[derive(Debug)]
pub struct Security {
    pub listen: SocketAddr,
    pub mode: AuthMode,
    pub(crate) tls: Option<ServerTls>,
}

/// Why the gRPC server's TLS or authentication cannot be set up. Nothing was started.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error(
        "--grpc-listen {listen} is not a loopback address, and without TLS nothing would authenticate callers: pass --tls-cert, --tls-key and --client-ca (mutual TLS; `census-operator certs` writes them), or listen on 127.0.0.1"
    )]
    NotLoopback { listen: SocketAddr },
    #[error(
        "--tls-cert without --client-ca: with --store redb nothing else authenticates agents; pass --client-ca (the CA of the nodes' certificates)"
    )]
    NoClientCa,
    #[error("--client-ca needs --tls-cert and --tls-key (the operator's serving certificate)")]
    ClientCaWithoutCert,
    #[error("{flag} {}: {source}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{flag} {}: no PEM {what} in it", path.display())]
    NoPem {
        flag: &'static str,
        path: PathBuf,
        what: &'static str,
    },
    #[error(
        "--tls-cert without --client-ca authenticates agents by their ServiceAccount tokens, which needs the Kubernetes API (TokenReview) and it is not set up; pass --client-ca for mutual TLS"
    )]
    NoTokenReview,
    #[error("--client-ca {}: {source}", path.display())]
    BadCa {
        path: PathBuf,
        #[source]
        source: NodeCertError,
    },
}

/// A PEM file's bytes, once it is seen to hold a `what` (a certificate or a key).
fn read(flag: &'static str, path: &Path, what: &'static str) -> Result<Vec<u8>, SecurityError> {
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
    let pem = std::fs::read(path).map_err(|source| SecurityError::Read {
        flag,
        path: path.to_owned(),
        source,
    })?;
    let found = if what == KEY {
        PrivateKeyDer::from_pem_slice(&pem).is_ok()
    } else {
        CertificateDer::pem_slice_iter(&pem)
            .next()
            .is_some_and(|c| c.is_ok())
    };
    if !found {
        return Err(SecurityError::NoPem {
            flag,
            path: path.to_owned(),
            what,
        });
    }
    Ok(pem)
}

/// Reads the TLS files and chooses the authentication; refuses a listen address
/// that is not loopback when no TLS is configured.
pub fn resolve(
    tls: &TlsArgs,
    listen: Option<SocketAddr>,
    store: StoreKind,
    handshake_timeout: Duration,
) -> Result<Security, SecurityError> {
    let TlsArgs {
        tls_cert,
        tls_key,
        client_ca,
    } = tls;
    let (Some(cert), Some(key)) = (tls_cert, tls_key) else {
        if client_ca.is_some() {
            return Err(SecurityError::ClientCaWithoutCert);
        }
        let listen = listen.unwrap_or(SocketAddr::from((Ipv4Addr::LOCALHOST, DEFAULT_GRPC_PORT)));
        if !listen.ip().to_canonical().is_loopback() {
            return Err(SecurityError::NotLoopback { listen });
        }
        return Ok(Security {
            listen,
            mode: AuthMode::Loopback,
            tls: None,
        });
    };
    let mut config = ServerTls {
        cert_pem: read("--tls-cert", cert, "certificate")?,
        key_pem: read("--tls-key", key, KEY)?,
        client_ca_pem: None,
        handshake_timeout,
    };
    let mode = match (client_ca, store) {
        (Some(path), _) => {
            let pem = read("--client-ca", path, "certificate")?;
            let ca = NodeCa::from_pem(&pem).map_err(|source| SecurityError::BadCa {
                path: path.clone(),
                source,
            })?;
            // Required: a connection without a certificate of the CA fails its
            // handshake.
            config.client_ca_pem = Some(pem);
            AuthMode::MutualTls(ca)
        }
        (None, StoreKind::Kubernetes) => AuthMode::BearerToken,
        (None, StoreKind::Redb) => return Err(SecurityError::NoClientCa),
    };
    Ok(Security {
        listen: listen.unwrap_or(SocketAddr::from((Ipv4Addr::UNSPECIFIED, DEFAULT_GRPC_PORT))),
        mode,
        tls: Some(config),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(dir: &Path, ca: bool) -> TlsArgs {
        TlsArgs {
            tls_cert: Some(dir.join("server.pem")),
            tls_key: Some(dir.join("server-key.pem")),
            client_ca: ca.then(|| dir.join("ca.pem")),
        }
    }

    fn certs(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
        crate::certs::run(&crate::certs::CertsArgs {
            out_dir: dir.to_owned(),
            dns: vec!["localhost".to_owned()],
            ips: Vec::new(),
            nodes: Vec::new(),
            readers: Vec::new(),
            days: 1,
            force: false,
        })?;
        Ok(())
    }

    #[test]
    fn without_tls_only_loopback_is_served() -> Result<(), Box<dyn std::error::Error>> {
        let none = TlsArgs::default();
        let t = Duration::from_secs(10);
        let s = resolve(&none, None, StoreKind::Redb, t)?;
        assert_eq!(s.listen, "127.0.0.1:9460".parse()?);
        assert!(matches!(s.mode, AuthMode::Loopback));
        let s = resolve(&none, Some("[::1]:0".parse()?), StoreKind::Kubernetes, t)?;
        assert!(matches!(s.mode, AuthMode::Loopback));
        for addr in ["0.0.0.0:9460", "10.0.0.1:9460", "[::]:9460"] {
            let err = resolve(&none, Some(addr.parse()?), StoreKind::Redb, t)
                .err()
                .ok_or("served without TLS off loopback")?;
            assert!(matches!(err, SecurityError::NotLoopback { .. }), "{err}");
            let text = err.to_string();
            assert!(
                text.contains("--tls-cert") && text.contains("--client-ca"),
                "{text}"
            );
        }
        Ok(())
    }

    #[test]
    fn tls_files_are_read_and_checked_at_start() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        certs(dir.path())?;
        let t = Duration::from_secs(10);
        let s = resolve(&tls(dir.path(), true), None, StoreKind::Redb, t)?;
        assert_eq!(s.listen, "0.0.0.0:9460".parse()?);
        assert!(matches!(s.mode, AuthMode::MutualTls(_)));
        let s = resolve(&tls(dir.path(), false), None, StoreKind::Kubernetes, t)?;
        assert!(matches!(s.mode, AuthMode::BearerToken));
        assert!(matches!(
            resolve(&tls(dir.path(), false), None, StoreKind::Redb, t),
            Err(SecurityError::NoClientCa)
        ));
        let mut missing = tls(dir.path(), true);
        missing.client_ca = Some(dir.path().join("nope.pem"));
        assert!(matches!(
            resolve(&missing, None, StoreKind::Redb, t),
            Err(SecurityError::Read {
                flag: "--client-ca",
                ..
            })
        ));
        let mut not_pem = tls(dir.path(), true);
        std::fs::write(dir.path().join("junk"), "junk")?;
        not_pem.tls_key = Some(dir.path().join("junk"));
        assert!(matches!(
            resolve(&not_pem, None, StoreKind::Redb, t),
            Err(SecurityError::NoPem {
                flag: "--tls-key",
                ..
            })
        ));
        let only_ca = TlsArgs {
            client_ca: Some(dir.path().join("ca.pem")),
            ..TlsArgs::default()
        };
        assert!(matches!(
            resolve(&only_ca, None, StoreKind::Redb, t),
            Err(SecurityError::ClientCaWithoutCert)
        ));
        Ok(())
    }
}
