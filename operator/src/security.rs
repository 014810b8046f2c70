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
//! missing flag stops it at start, naming the flag. With bearer tokens, `--tls-ca`
//! is what a follower verifies the leader with when it forwards (`leader`).

mod leader;

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use census_daemon::pem::{self, Kind, PemError};

use crate::{
    certs::{NodeCa, NodeCertError},
    config::{StoreKind, TlsArgs},
    grpc::ServerTls,
};

/// The gRPC port when `--grpc-listen` is not given.
pub const DEFAULT_GRPC_PORT: u16 = 9460;

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
    #[error("--tls-ca needs --tls-cert and --tls-key (the serving certificate it signed)")]
    TlsCaWithoutCert,
    #[error(
        "--tls-ca is what followers verify the leader with when they forward callers' tokens: it needs --store kubernetes and no --client-ca (a client certificate cannot be forwarded)"
    )]
    TlsCaUnused,
    #[error("--tls-ca {}: {reason}", path.display())]
    BadTlsCa { path: PathBuf, reason: String },
    #[error(
        "--tls-cert {}: no DNS name (subject alternative name) in its first certificate, and followers verify the leader by it",
        path.display()
    )]
    NoServerName { path: PathBuf },
    #[error(
        "--tls-ca {} does not verify --tls-cert {} as a serving certificate for {name}: {reason}",
        ca.display(),
        cert.display()
    )]
    TlsCaUnverified {
        ca: PathBuf,
        cert: PathBuf,
        name: String,
        reason: String,
    },
    #[error(transparent)]
    Pem(#[from] PemError),
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
        tls_ca,
    } = tls;
    let (Some(cert), Some(key)) = (tls_cert, tls_key) else {
        if client_ca.is_some() {
            return Err(SecurityError::ClientCaWithoutCert);
        }
        if tls_ca.is_some() {
            return Err(SecurityError::TlsCaWithoutCert);
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
        cert_pem: pem::read("--tls-cert", cert, Kind::Certificate)?,
        key_pem: pem::read("--tls-key", key, Kind::PrivateKey)?,
        client_ca_pem: None,
        leader: None,
        handshake_timeout,
    };
    let mode = match (client_ca, store) {
        (Some(path), _) => {
            let pem = pem::read("--client-ca", path, Kind::Certificate)?;
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
    if let Some(ca) = tls_ca {
        if !matches!(mode, AuthMode::BearerToken) {
            return Err(SecurityError::TlsCaUnused);
        }
        config.leader = Some(leader::read(ca, cert, &config.cert_pem)?);
    }
    Ok(Security {
        listen: listen.unwrap_or(SocketAddr::from((Ipv4Addr::UNSPECIFIED, DEFAULT_GRPC_PORT))),
        mode,
        tls: Some(config),
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn tls(dir: &Path, ca: bool) -> TlsArgs {
        TlsArgs {
            tls_cert: Some(dir.join("server.pem")),
            tls_key: Some(dir.join("server-key.pem")),
            client_ca: ca.then(|| dir.join("ca.pem")),
            tls_ca: None,
        }
    }

    fn certs(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
        serving(dir, &["localhost"])
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
            Err(SecurityError::Pem(PemError::Read {
                flag: "--client-ca",
                ..
            }))
        ));
        let mut not_pem = tls(dir.path(), true);
        std::fs::write(dir.path().join("junk"), "junk")?;
        not_pem.tls_key = Some(dir.path().join("junk"));
        assert!(matches!(
            resolve(&not_pem, None, StoreKind::Redb, t),
            Err(SecurityError::Pem(PemError::NoPem {
                flag: "--tls-key",
                ..
            }))
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

    /// A CA and a serving certificate for `dns` and 127.0.0.1 in `dir`.
    fn serving(dir: &Path, dns: &[&str]) -> Result<(), Box<dyn std::error::Error>> {
        crate::certs::run(&crate::certs::CertsArgs {
            out_dir: dir.to_owned(),
            dns: dns.iter().map(|d| (*d).to_owned()).collect(),
            ips: vec!["127.0.0.1".parse()?],
            nodes: Vec::new(),
            readers: Vec::new(),
            node_ips: Vec::new(),
            days: 1,
            force: false,
        })?;
        Ok(())
    }

    #[test]
    fn the_leader_is_verified_with_tls_ca_by_the_first_dns_name()
    -> Result<(), Box<dyn std::error::Error>> {
        let t = Duration::from_secs(10);
        let dir = tempfile::tempdir()?;
        serving(
            dir.path(),
            &["census-operator-leader.census-system.svc", "localhost"],
        )?;
        let mut args = tls(dir.path(), false);
        args.tls_ca = Some(dir.path().join("ca.pem"));
        let s = resolve(&args, None, StoreKind::Kubernetes, t)?;
        let leader = s
            .tls
            .and_then(|tls| tls.leader)
            .ok_or("--tls-ca was not kept")?;
        assert_eq!(
            leader.server_name,
            "census-operator-leader.census-system.svc"
        );
        assert_eq!(leader.ca_pem, std::fs::read(dir.path().join("ca.pem"))?);
        // Without it a follower has nothing to verify the leader with.
        let s = resolve(&tls(dir.path(), false), None, StoreKind::Kubernetes, t)?;
        assert!(s.tls.is_some_and(|tls| tls.leader.is_none()));

        // Only bearer tokens are forwarded.
        let mut mutual = args.clone();
        mutual.client_ca = Some(dir.path().join("ca.pem"));
        for store in [StoreKind::Kubernetes, StoreKind::Redb] {
            assert!(matches!(
                resolve(&mutual, None, store, t),
                Err(SecurityError::TlsCaUnused)
            ));
        }
        let only_ca = TlsArgs {
            tls_ca: Some(dir.path().join("ca.pem")),
            ..TlsArgs::default()
        };
        assert!(matches!(
            resolve(
                &only_ca,
                Some("127.0.0.1:0".parse()?),
                StoreKind::Kubernetes,
                t
            ),
            Err(SecurityError::TlsCaWithoutCert)
        ));

        // Another CA, a key, a missing file: refused at start, naming --tls-ca.
        let other = tempfile::tempdir()?;
        serving(other.path(), &["localhost"])?;
        let mut wrong = args.clone();
        wrong.tls_ca = Some(other.path().join("ca.pem"));
        let err = resolve(&wrong, None, StoreKind::Kubernetes, t)
            .err()
            .ok_or("another CA was taken")?;
        assert!(
            matches!(err, SecurityError::TlsCaUnverified { .. }),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.starts_with("--tls-ca ")
                && text.contains("--tls-cert")
                && text.contains("census-operator-leader.census-system.svc"),
            "{text}"
        );
        for file in ["server-key.pem", "nope.pem"] {
            let mut bad = args.clone();
            bad.tls_ca = Some(dir.path().join(file));
            let err = resolve(&bad, None, StoreKind::Kubernetes, t)
                .err()
                .ok_or("a bad --tls-ca was taken")?;
            assert!(err.to_string().starts_with("--tls-ca "), "{err}");
        }

        // A serving certificate with no DNS name gives followers nothing to check.
        let ip_only = tempfile::tempdir()?;
        serving(ip_only.path(), &[])?;
        let mut no_name = tls(ip_only.path(), false);
        no_name.tls_ca = Some(ip_only.path().join("ca.pem"));
        let err = resolve(&no_name, None, StoreKind::Kubernetes, t)
            .err()
            .ok_or("a certificate without a DNS name was taken")?;
        assert!(matches!(err, SecurityError::NoServerName { .. }), "{err}");
        assert!(err.to_string().starts_with("--tls-cert "), "{err}");
        Ok(())
    }
}
