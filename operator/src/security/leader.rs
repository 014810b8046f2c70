//! How a follower verifies the leader when it forwards NodeService calls to it
//! (`--tls-ca`): every replica serves the one certificate, and the leader is reached
//! by its pod IP, so the leader's certificate is checked against the CA that signed
//! it and by the serving certificate's first DNS name. Both files are read and the
//! CA is seen to sign this replica's own serving certificate at start.

use std::path::Path;

use census_daemon::pem::{self, Kind};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime, pem::PemObject as _};

use super::SecurityError;
use crate::grpc::LeaderTls;

/// Reads `--tls-ca` and checks it verifies this replica's serving certificate
/// (`cert_pem`, of `--tls-cert cert`) for server authentication and its first DNS
/// name.
pub(super) fn read(ca: &Path, cert: &Path, cert_pem: &[u8]) -> Result<LeaderTls, SecurityError> {
    let ca_pem = pem::read("--tls-ca", ca, Kind::Certificate)?;
    let bad_ca = |reason: String| SecurityError::BadTlsCa {
        path: ca.to_owned(),
        reason,
    };
    let anchors = CertificateDer::pem_slice_iter(&ca_pem)
        .map(|der| {
            let der = der.map_err(|e| bad_ca(e.to_string()))?;
            webpki::anchor_from_trusted_cert(&der)
                .map(|a| a.to_owned())
                .map_err(|e| bad_ca(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut chain = CertificateDer::pem_slice_iter(cert_pem);
    let not_served = || SecurityError::NoServerName {
        path: cert.to_owned(),
    };
    let leaf = chain.next().and_then(Result::ok).ok_or_else(not_served)?;
    let intermediates = chain.filter_map(Result::ok).collect::<Vec<_>>();
    let (_, parsed) = x509_parser::parse_x509_certificate(&leaf).map_err(|_| not_served())?;
    let server_name = parsed
        .subject_alternative_name()
        .ok()
        .flatten()
        .into_iter()
        .flat_map(|ext| ext.value.general_names.iter())
        .find_map(|name| match name {
            x509_parser::extensions::GeneralName::DNSName(dns) => Some((*dns).to_owned()),
            _ => None,
        })
        .ok_or_else(not_served)?;
    let unverified = |reason: webpki::Error| SecurityError::TlsCaUnverified {
        ca: ca.to_owned(),
        cert: cert.to_owned(),
        name: server_name.clone(),
        reason: format!("{reason:?}"),
    };
    let end_entity = webpki::EndEntityCert::try_from(&leaf).map_err(unverified)?;
    end_entity
        .verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &intermediates,
            UnixTime::now(),
            webpki::KeyUsage::server_auth(),
            None,
            None,
        )
        .map_err(unverified)?;
    let name = ServerName::try_from(server_name.as_str()).map_err(|_| not_served())?;
    end_entity
        .verify_is_valid_for_subject_name(&name)
        .map_err(unverified)?;
    Ok(LeaderTls {
        ca_pem,
        server_name,
    })
}
