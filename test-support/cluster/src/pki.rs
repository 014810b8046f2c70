//! The control plane's certificates and keys: a CA, the API server's serving
//! certificate, the service-account signing key, and client certificates for the
//! components and an administrator, each with the kubeconfig that presents it.

use std::{net::IpAddr, path::Path};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use crate::{Error, go::write};

/// A client of the API server, by the user and groups its certificate names.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClientCert {
    pub(crate) file: &'static str,
    pub(crate) user: &'static str,
    pub(crate) group: Option<&'static str>,
}

/// Who gets a client certificate (and a kubeconfig of the same name).
pub(crate) const CLIENTS: [ClientCert; 4] = [
    ClientCert {
        file: "admin",
        user: "census-admin",
        group: Some("system:masters"),
    },
    ClientCert {
        file: "controller-manager",
        user: "system:kube-controller-manager",
        group: None,
    },
    ClientCert {
        file: "scheduler",
        user: "system:kube-scheduler",
        group: None,
    },
    // kwok plays every node's kubelet with one client; the Node authorizer would
    // confine a `system:node:<name>` certificate to one node.
    ClientCert {
        file: "kwok",
        user: "kwok",
        group: Some("system:masters"),
    },
];

fn pki(e: rcgen::Error) -> Error {
    Error::Pki(e)
}

/// Writes everything under `dir`: `ca.pem`, `apiserver.pem`/`-key.pem`, `sa-key.pem`,
/// `sa.pem`, and `<client>.pem`/`-key.pem` for each of [`CLIENTS`].
pub(crate) fn write_all(dir: &Path, service_ip: IpAddr) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        what: "create",
        path: dir.to_owned(),
        source,
    })?;
    let ca_key = KeyPair::generate().map_err(pki)?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name = name("census test control plane CA", None);
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key).map_err(pki)?;
    write(&dir.join("ca.pem"), &ca_cert.pem())?;
    let issuer = Issuer::new(ca, ca_key);

    let mut serving = CertificateParams::new(vec![
        "localhost".to_owned(),
        "kubernetes".to_owned(),
        "kubernetes.default".to_owned(),
        "kubernetes.default.svc".to_owned(),
        "kubernetes.default.svc.cluster.local".to_owned(),
    ])
    .map_err(pki)?;
    serving.subject_alt_names.extend([
        SanType::IpAddress(IpAddr::from([127, 0, 0, 1])),
        SanType::IpAddress(service_ip),
    ]);
    serving.distinguished_name = name("kube-apiserver", None);
    serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf(dir, "apiserver", serving, &issuer)?;

    for client in CLIENTS {
        let mut params = CertificateParams::default();
        params.distinguished_name = name(client.user, client.group);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        leaf(dir, client.file, params, &issuer)?;
    }

    // The service-account signing key, and its public half for verifying.
    let sa = KeyPair::generate().map_err(pki)?;
    write(&dir.join("sa.pem"), &sa.public_key_pem())?;
    write(&dir.join("sa-key.pem"), &sa.serialize_pem())
}

fn name(common: &str, organization: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common);
    if let Some(o) = organization {
        dn.push(DnType::OrganizationName, o);
    }
    dn
}

fn leaf(
    dir: &Path,
    file: &str,
    mut params: CertificateParams,
    issuer: &Issuer<'_, KeyPair>,
) -> Result<(), Error> {
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    let key = KeyPair::generate().map_err(pki)?;
    let cert = params.signed_by(&key, issuer).map_err(pki)?;
    write(&dir.join(format!("{file}.pem")), &cert.pem())?;
    write(&dir.join(format!("{file}-key.pem")), &key.serialize_pem())
}

/// A kubeconfig for `server` that presents the client certificate `file`.
pub(crate) fn cert_kubeconfig(pki: &Path, server: &str, file: &str) -> String {
    kubeconfig(
        pki,
        server,
        &format!(
            "    client-certificate: {}\n    client-key: {}\n",
            pki.join(format!("{file}.pem")).display(),
            pki.join(format!("{file}-key.pem")).display()
        ),
    )
}

/// A kubeconfig for `server` that sends a bearer token.
pub fn token_kubeconfig(pki: &Path, server: &str, token: &str) -> String {
    kubeconfig(pki, server, &format!("    token: {token}\n"))
}

fn kubeconfig(pki: &Path, server: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: census-test\n  cluster:\n    \
         server: {server}\n    certificate-authority: {}\nusers:\n- name: user\n  user:\n{user}\
         contexts:\n- name: census-test\n  context:\n    cluster: census-test\n    user: user\n\
         current-context: census-test\n",
        pki.join("ca.pem").display()
    )
}
