//! How the agent and the `census` CLI reach the operator: plain HTTP/2 (an
//! operator without TLS listens on loopback only), or TLS that trusts the CA of the
//! operator's serving certificate and, for mutual TLS, presents a client
//! certificate from `census-operator certs` (a node's for the agent, a reader's for
//! the CLI). docs/security.md, "Mutual TLS".

use std::{os::unix::fs::MetadataExt as _, path::PathBuf, sync::Arc, time::SystemTime};

use census_daemon::pem::{self, Kind, PemError};
use tonic::{
    metadata::AsciiMetadataValue,
    service::{Interceptor, interceptor::InterceptedService},
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity},
};

/// How the agent reaches the operator: TLS (none: plain HTTP/2), and the file of the
/// bearer token every call carries (none: no token).
#[derive(Debug, Clone, Default)]
pub struct OperatorAuth {
    pub tls: Option<ClientTlsConfig>,
    pub token_file: Option<PathBuf>,
}

/// The files of `--tls-ca`, `--tls-cert`, `--tls-key` and `--token-file`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessFiles {
    pub tls: TlsFiles,
    pub token_file: Option<PathBuf>,
}

impl AccessFiles {
    /// The operator's TLS (its files read now) and token file.
    pub fn auth(&self) -> Result<OperatorAuth, ClientTlsError> {
        Ok(OperatorAuth {
            tls: self.tls.config()?,
            token_file: self.token_file.clone(),
        })
    }
}

/// A channel to the operator whose every call carries the bearer token, if any.
pub type OperatorChannel = InterceptedService<Channel, Bearer>;

/// `channel` with no token: for an operator that authenticates by certificate, or
/// not at all (loopback).
pub fn plain(channel: Channel) -> OperatorChannel {
    InterceptedService::new(channel, Bearer::default())
}

/// `channel` sending the token of `token_file`, when one is given.
pub fn with_token(channel: Channel, token_file: Option<PathBuf>) -> OperatorChannel {
    InterceptedService::new(
        channel,
        Bearer(token_file.map(|p| Arc::new(TokenFile::new(p)))),
    )
}

/// Adds `authorization: Bearer TOKEN` to every call, the token read from its file.
#[derive(Debug, Clone, Default)]
pub struct Bearer(Option<Arc<TokenFile>>);

impl Interceptor for Bearer {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(file) = &self.0 {
            let value = file.header().map_err(|e| {
                tonic::Status::unauthenticated(format!("--token-file {}: {e}", file.path.display()))
            })?;
            request.metadata_mut().insert("authorization", value);
        }
        Ok(request)
    }
}

/// A token file (a projected ServiceAccount token: the kubelet replaces it before it
/// expires, by renaming a new one into place). Read again whenever its modification
/// time, size or inode changes, so every call carries the current token.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    cached: parking_lot::Mutex<Option<(Stamp, AsciiMetadataValue)>>,
}

/// What tells a file changed without reading it.
type Stamp = (Option<SystemTime>, u64, u64);

/// Why a token cannot be sent.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{0}")]
    Read(#[from] std::io::Error),
    #[error("the file is empty")]
    Empty,
    #[error("the token is not printable ASCII")]
    NotAscii,
}

impl TokenFile {
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            cached: parking_lot::Mutex::new(None),
        }
    }

    /// `Bearer TOKEN`, from the file as it is now.
    pub fn header(&self) -> Result<AsciiMetadataValue, TokenError> {
        // Follows symlinks: the kubelet swaps a `..data` link to a new directory.
        let meta = std::fs::metadata(&self.path)?;
        let stamp = (meta.modified().ok(), meta.len(), meta.ino());
        let mut cached = self.cached.lock();
        if let Some((seen, value)) = cached.as_ref()
            && *seen == stamp
        {
            return Ok(value.clone());
        }
        let text = std::fs::read_to_string(&self.path)?;
        let token = text.trim();
        if token.is_empty() {
            return Err(TokenError::Empty);
        }
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::NotAscii);
        }
        let value = AsciiMetadataValue::try_from(format!("Bearer {token}"))
            .map_err(|_| TokenError::NotAscii)?;
        *cached = Some((stamp, value.clone()));
        Ok(value)
    }
}

/// The PEM files of `--tls-ca`, `--tls-cert` and `--tls-key`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// The CA of the operator's serving certificate: TLS is on when it is given.
    pub ca: Option<PathBuf>,
    /// This client's certificate, for mutual TLS (with `key`).
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// Why the operator's TLS cannot be set up.
#[derive(Debug, thiserror::Error)]
pub enum ClientTlsError {
    #[error(transparent)]
    Pem(#[from] PemError),
    #[error("--tls-cert and --tls-key go together: pass both, or neither")]
    HalfPair,
    #[error(
        "--tls-cert without --tls-ca: pass the CA of the operator's serving certificate (ca.pem of `census-operator certs`)"
    )]
    NoCa,
    #[error("operator address {address:?}: {reason}")]
    Address { address: String, reason: String },
}

impl TlsFiles {
    /// The TLS configuration these files make; `None` for plain HTTP/2.
    /// The flags are checked before any file is read.
    pub fn config(&self) -> Result<Option<ClientTlsConfig>, ClientTlsError> {
        let Self { ca, cert, key } = self;
        let pair = match (cert, key) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => return Err(ClientTlsError::HalfPair),
        };
        let Some(ca) = ca else {
            return match pair {
                Some(_) => Err(ClientTlsError::NoCa),
                None => Ok(None),
            };
        };
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem::read(
            "--tls-ca",
            ca,
            Kind::Certificate,
        )?));
        if let Some((cert, key)) = pair {
            tls = tls.identity(Identity::from_pem(
                pem::read("--tls-cert", cert, Kind::Certificate)?,
                pem::read("--tls-key", key, Kind::PrivateKey)?,
            ));
        }
        Ok(Some(tls))
    }
}

/// The operator at `address` (`http://host:port`), over TLS when `tls` is given (then
/// `https://host:port`: the serving certificate must name `host`).
pub fn endpoint(address: &str, tls: Option<&ClientTlsConfig>) -> Result<Endpoint, ClientTlsError> {
    let bad = |reason: String| ClientTlsError::Address {
        address: address.to_owned(),
        reason,
    };
    let Some(tls) = tls else {
        return Endpoint::from_shared(address.to_owned()).map_err(|e| bad(e.to_string()));
    };
    let rest = address
        .strip_prefix("http://")
        .or_else(|| address.strip_prefix("https://"))
        .unwrap_or(address);
    Endpoint::from_shared(format!("https://{rest}"))
        .map_err(|e| bad(e.to_string()))?
        .tls_config(tls.clone())
        .map_err(|e| bad(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_call_carries_the_token_the_file_holds_now() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("token");
        std::fs::write(&path, "first.token\n")?;
        let mut bearer = Bearer(Some(Arc::new(TokenFile::new(path.clone()))));
        let sent = |bearer: &mut Bearer| -> Result<String, Box<dyn std::error::Error>> {
            let request = bearer.call(tonic::Request::new(()))?;
            let value = request
                .metadata()
                .get("authorization")
                .ok_or("no authorization")?;
            Ok(value.to_str()?.to_owned())
        };
        assert_eq!(sent(&mut bearer)?, "Bearer first.token");
        // Rotated as the kubelet does: a new file renamed into place.
        let next = dir.path().join("token.new");
        std::fs::write(&next, "second.token")?;
        std::fs::rename(&next, &path)?;
        assert_eq!(sent(&mut bearer)?, "Bearer second.token");
        std::fs::write(&path, "")?;
        let refused = bearer.call(tonic::Request::new(())).err();
        assert_eq!(
            refused.map(|s| s.code()),
            Some(tonic::Code::Unauthenticated)
        );
        std::fs::remove_file(&path)?;
        assert!(bearer.call(tonic::Request::new(())).is_err());
        // No token file: nothing is added.
        let request = Bearer::default().call(tonic::Request::new(()))?;
        assert!(request.metadata().get("authorization").is_none());
        Ok(())
    }

    #[test]
    fn tls_is_on_with_a_ca_and_mutual_with_a_certificate() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let pem = "-----BEGIN CERTIFICATE-----\nMA==\n-----END CERTIFICATE-----\n";
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, pem)?;
        assert!(TlsFiles::default().config()?.is_none());
        let files = TlsFiles {
            ca: Some(ca.clone()),
            ..TlsFiles::default()
        };
        assert!(files.config()?.is_some());
        let half = TlsFiles {
            ca: Some(ca.clone()),
            cert: Some(ca.clone()),
            key: None,
        };
        assert!(matches!(half.config(), Err(ClientTlsError::HalfPair)));
        let no_ca = TlsFiles {
            ca: None,
            cert: Some(ca.clone()),
            key: Some(ca),
        };
        assert!(matches!(no_ca.config(), Err(ClientTlsError::NoCa)));
        let missing = TlsFiles {
            ca: Some(dir.path().join("nope.pem")),
            ..TlsFiles::default()
        };
        assert!(matches!(
            missing.config(),
            Err(ClientTlsError::Pem(PemError::Read {
                flag: "--tls-ca",
                ..
            }))
        ));
        // A certificate where the key belongs: refused at start, naming the flag.
        let swapped = TlsFiles {
            ca: files.ca.clone(),
            cert: files.ca.clone(),
            key: files.ca.clone(),
        };
        let refused = swapped
            .config()
            .err()
            .ok_or("a certificate taken for a key")?;
        assert!(
            matches!(
                refused,
                ClientTlsError::Pem(PemError::NoPem {
                    flag: "--tls-key",
                    what: Kind::PrivateKey,
                    ..
                })
            ),
            "{refused}"
        );
        assert!(refused.to_string().starts_with("--tls-key "), "{refused}");
        let tls = files.config()?;
        let endpoint = endpoint("http://operator.census:9460", tls.as_ref())?;
        assert_eq!(endpoint.uri().scheme_str(), Some("https"));
        assert_eq!(
            super::endpoint("http://127.0.0.1:9460", None)?
                .uri()
                .scheme_str(),
            Some("http")
        );
        Ok(())
    }
}
