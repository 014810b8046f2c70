//! The PEM files the daemons' TLS flags name (certificates, CAs, keys): read at
//! start and checked to hold what the flag needs, so that a wrong file stops the
//! daemon naming the flag and the file rather than failing a handshake later.

use std::{
    fmt, io,
    path::{Path, PathBuf},
};

use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};

/// What a PEM file must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// At least one certificate (a chain, or the CAs to trust).
    Certificate,
    /// A private key (PKCS#8, PKCS#1 or SEC1).
    PrivateKey,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Certificate => "certificate",
            Self::PrivateKey => "private key",
        })
    }
}

/// Why the file of a flag cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PemError {
    #[error("{flag} {}: {source}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{flag} {}: no PEM {what} in it", path.display())]
    NoPem {
        flag: &'static str,
        path: PathBuf,
        what: Kind,
    },
}

/// The bytes of `path`, the file of `flag`, once they are seen to hold a `what`.
pub fn read(flag: &'static str, path: &Path, what: Kind) -> Result<Vec<u8>, PemError> {
    let pem = std::fs::read(path).map_err(|source| PemError::Read {
        flag,
        path: path.to_owned(),
        source,
    })?;
    let found = match what {
        Kind::PrivateKey => PrivateKeyDer::from_pem_slice(&pem).is_ok(),
        Kind::Certificate => CertificateDer::pem_slice_iter(&pem)
            .next()
            .is_some_and(|c| c.is_ok()),
    };
    if !found {
        return Err(PemError::NoPem {
            flag,
            path: path.to_owned(),
            what,
        });
    }
    Ok(pem)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CERT: &str = "-----BEGIN CERTIFICATE-----\nMA==\n-----END CERTIFICATE-----\n";
    const KEY: &str = "-----BEGIN PRIVATE KEY-----\nMA==\n-----END PRIVATE KEY-----\n";

    #[test]
    fn a_file_is_read_when_it_holds_what_its_flag_needs() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert, CERT)?;
        std::fs::write(&key, KEY)?;
        assert_eq!(
            read("--tls-cert", &cert, Kind::Certificate)?,
            CERT.as_bytes()
        );
        assert_eq!(read("--tls-key", &key, Kind::PrivateKey)?, KEY.as_bytes());

        let swapped = read("--tls-key", &cert, Kind::PrivateKey)
            .err()
            .ok_or("a certificate was taken for a key")?;
        assert_eq!(
            swapped.to_string(),
            format!("--tls-key {}: no PEM private key in it", cert.display())
        );
        let swapped = read("--tls-ca", &key, Kind::Certificate)
            .err()
            .ok_or("a key was taken for a certificate")?;
        assert!(matches!(
            swapped,
            PemError::NoPem {
                flag: "--tls-ca",
                what: Kind::Certificate,
                ..
            }
        ));

        let missing = dir.path().join("nope.pem");
        let error = read("--client-ca", &missing, Kind::Certificate)
            .err()
            .ok_or("a missing file was read")?;
        assert!(matches!(
            error,
            PemError::Read {
                flag: "--client-ca",
                ..
            }
        ));
        let text = error.to_string();
        assert!(
            text.starts_with(&format!("--client-ca {}: ", missing.display())),
            "{text}"
        );
        Ok(())
    }
}
