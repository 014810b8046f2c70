//! `census-operator certs`: a CA, the operator's serving certificate and one
//! client certificate per node, as PEM files, for mutual TLS between agents and
//! the operator; and [`NodeCa`], which reads the node name back from a client
//! certificate the CA signed.
//!
//! Files in `--out-dir` (keys are written 0600, certificates 0644; each file is
//! written to a temporary name and renamed, so a reader never sees half a file):
//!
//! | file | what |
//! |---|---|
//! | `ca.pem`, `ca-key.pem` | the CA (ECDSA P-256, `CA:true, pathlen:0`, keyCertSign) |
//! | `server.pem`, `server-key.pem` | the operator's serving certificate: the `--dns` and `--ip` SANs, EKU serverAuth only |
//! | `node-NAME.pem`, `node-NAME-key.pem` | node NAME's client certificate: the URI SAN `census://node/NAME`, EKU clientAuth only |
//! | `reader-NAME.pem`, `reader-NAME-key.pem` | a reader's client certificate (the CLI, a tool: reads only): the URI SAN `census://reader/NAME`, EKU clientAuth only |
//!
//! **The node is the URI SAN** `census://node/NAME` (NAME a Kubernetes node name,
//! a DNS subdomain): one such SAN, nothing else is read. Not a DNS SAN: a client
//! certificate's DNS names mean "this host" to other tools, and `node:NAME` is
//! not a valid DNS name. The common name is set to NAME for people reading the
//! certificate and never trusted. The serving certificate has no clientAuth EKU
//! and node certificates have no serverAuth EKU, so neither can stand in for the
//! other.
//!
//! An existing CA in the directory is used to sign (so nodes are added by running
//! the command again with new `--node`s); it is never replaced, even with
//! `--force`, which only overwrites serving and node certificates. Everything is
//! checked before anything is written: a refusal changes no file.

use std::{
    fs,
    io::Write,
    net::IpAddr,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use census_proto::domain::NodeName;
use clap::Args;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls_pki_types::{CertificateDer, UnixTime, pem::PemObject};

/// The scheme and authority of a node's URI SAN: `census://node/NAME`.
pub const NODE_URI_PREFIX: &str = "census://node/";

/// The scheme and authority of a reader's URI SAN: `census://reader/NAME`.
pub const READER_URI_PREFIX: &str = "census://reader/";

/// The clientAuth extended key usage (1.3.6.1.5.5.7.3.2), DER-encoded OID value.
const EKU_CLIENT_AUTH: &[u8] = &[0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x03, 0x02];

/// `census-operator certs` flags.
#[derive(Debug, Clone, Args)]
pub struct CertsArgs {
    /// The directory to write the PEM files to (created if missing).
    #[arg(long, short = 'o', value_name = "DIR")]
    pub out_dir: PathBuf,
    /// A DNS name of the operator's serving certificate, e.g.
    /// census-operator-leader.census-system.svc (repeat for more).
    #[arg(long = "dns", value_name = "NAME")]
    pub dns: Vec<String>,
    /// An IP address of the operator's serving certificate (repeat for more).
    #[arg(long = "ip", value_name = "ADDRESS")]
    pub ips: Vec<IpAddr>,
    /// A node to write a client certificate for (repeat for more).
    #[arg(long = "node", value_name = "NODE")]
    pub nodes: Vec<NodeName>,
    /// A reader to write a client certificate for: it may read (the CLI, a tool),
    /// never speak for a node. NAME is a DNS subdomain, e.g. `cli` (repeat for more).
    #[arg(long = "reader", value_name = "NAME")]
    pub readers: Vec<NodeName>,
    /// An address of the node named by `--node` (repeat for more): written as an
    /// IP SAN of its client certificate, it is what the node's Hello may claim as
    /// its own in the endpoint map (`remote-node`). Needs exactly one `--node`.
    #[arg(long = "node-ip", value_name = "ADDRESS")]
    pub node_ips: Vec<IpAddr>,
    /// How long the new certificates are valid, in days.
    #[arg(long, default_value_t = 365)]
    pub days: u32,
    /// Overwrite existing serving and node certificates (never the CA).
    #[arg(long)]
    pub force: bool,
}

/// Why `certs` wrote nothing, or a certificate was refused.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    #[error("{} exists; pass --force to overwrite it", path.display())]
    Exists { path: PathBuf },
    #[error(
        "{} exists but {} does not: restore the missing half of the CA, or remove both to make a new CA",
        present.display(),
        missing.display()
    )]
    HalfCa { present: PathBuf, missing: PathBuf },
    #[error("reading {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a usable CA: {source}", path.display())]
    BadCa {
        path: PathBuf,
        #[source]
        source: rcgen::Error,
    },
    #[error("{} does not belong to the certificate in {}", key.display(), cert.display())]
    CaKeyMismatch { cert: PathBuf, key: PathBuf },
    #[error(
        "nothing to write: the CA in {} exists; name --dns or --ip for a serving certificate, --node for client certificates",
        dir.display()
    )]
    NothingToWrite { dir: PathBuf },
    #[error(
        "--dns {name:?} is not a DNS name (letters, digits, `-` and `.`, a leading `*.` at most)"
    )]
    BadDnsName { name: String },
    #[error("--node {node} is named twice")]
    DuplicateNode { node: NodeName },
    #[error("--reader {reader} is named twice")]
    DuplicateReader { reader: NodeName },
    #[error("--days must be at least 1")]
    NoDays,
    #[error(
        "--node-ip gives the addresses of one node, and {nodes} --node are named: write one node's certificate per command when naming its addresses"
    )]
    NodeIpsOfOneNode { nodes: usize },
    #[error("--node-ip {ip} is {reason}: no node is reached at it")]
    BadNodeIp {
        ip: IpAddr,
        reason: census_proto::domain::UnusableIp,
    },
    #[error("making the {what}: {source}")]
    Generate {
        what: String,
        #[source]
        source: rcgen::Error,
    },
    #[error("writing {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// One file to write.
#[derive(Debug)]
struct Output {
    path: PathBuf,
    contents: String,
    secret: bool,
}

/// Paths of the files of a node's client certificate: (certificate, key).
pub fn node_files(dir: &Path, node: &NodeName) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("node-{node}.pem")),
        dir.join(format!("node-{node}-key.pem")),
    )
}

/// Paths of the files of a reader's client certificate: (certificate, key).
pub fn reader_files(dir: &Path, reader: &NodeName) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("reader-{reader}.pem")),
        dir.join(format!("reader-{reader}-key.pem")),
    )
}

fn valid_dns_name(name: &str) -> bool {
    let name = name.strip_prefix("*.").unwrap_or(name);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

fn read(path: &Path) -> Result<String, CertsError> {
    fs::read_to_string(path).map_err(|source| CertsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn params(days: u32, common_name: &str) -> CertificateParams {
    let now = SystemTime::now();
    let mut params = CertificateParams::default();
    // A minute back, for clocks slightly behind the one that signed.
    params.not_before = (now - Duration::from_secs(60)).into();
    params.not_after = (now + Duration::from_secs(u64::from(days) * 86_400)).into();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "census");
    dn.push(DnType::CommonName, common_name);
    params.distinguished_name = dn;
    params.use_authority_key_identifier_extension = true;
    params
}

fn generate(what: &str) -> impl Fn(rcgen::Error) -> CertsError + '_ {
    move |source| CertsError::Generate {
        what: what.to_owned(),
        source,
    }
}

/// The CA in `dir`, or a new one (and its files to write).
fn load_or_make_ca(
    dir: &Path,
    days: u32,
    out: &mut Vec<Output>,
) -> Result<(Issuer<'static, KeyPair>, bool), CertsError> {
    let cert_path = dir.join("ca.pem");
    let key_path = dir.join("ca-key.pem");
    match (cert_path.exists(), key_path.exists()) {
        (true, true) => {
            let cert_pem = read(&cert_path)?;
            let key = KeyPair::from_pem(&read(&key_path)?).map_err(|source| CertsError::BadCa {
                path: key_path.clone(),
                source,
            })?;
            let der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|_| {
                CertsError::BadCa {
                    path: cert_path.clone(),
                    source: rcgen::Error::CouldNotParseCertificate,
                }
            })?;
            let (_, parsed) =
                x509_parser::parse_x509_certificate(&der).map_err(|_| CertsError::BadCa {
                    path: cert_path.clone(),
                    source: rcgen::Error::CouldNotParseCertificate,
                })?;
            if parsed
                .tbs_certificate
                .subject_pki
                .subject_public_key
                .data
                .as_ref()
                != key.public_key_raw()
            {
                return Err(CertsError::CaKeyMismatch {
                    cert: cert_path,
                    key: key_path,
                });
            }
            let issuer =
                Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|source| CertsError::BadCa {
                    path: cert_path,
                    source,
                })?;
            Ok((issuer, true))
        }
        (true, false) => Err(CertsError::HalfCa {
            present: cert_path,
            missing: key_path,
        }),
        (false, true) => Err(CertsError::HalfCa {
            present: key_path,
            missing: cert_path,
        }),
        (false, false) => {
            let key = KeyPair::generate().map_err(generate("CA key"))?;
            let mut p = params(days.max(3650), "census CA");
            p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
            p.key_usages = vec![
                KeyUsagePurpose::KeyCertSign,
                KeyUsagePurpose::CrlSign,
                KeyUsagePurpose::DigitalSignature,
            ];
            let cert = p.self_signed(&key).map_err(generate("CA certificate"))?;
            out.push(Output {
                path: cert_path,
                contents: cert.pem(),
                secret: false,
            });
            out.push(Output {
                path: key_path,
                contents: key.serialize_pem(),
                secret: true,
            });
            Ok((Issuer::new(p, key), false))
        }
    }
}

fn leaf(
    what: &str,
    mut p: CertificateParams,
    issuer: &Issuer<'_, KeyPair>,
    cert_path: PathBuf,
    key_path: PathBuf,
    out: &mut Vec<Output>,
) -> Result<(), CertsError> {
    let key = KeyPair::generate().map_err(generate(what))?;
    p.is_ca = IsCa::ExplicitNoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let cert = p.signed_by(&key, issuer).map_err(generate(what))?;
    out.push(Output {
        path: cert_path,
        contents: cert.pem(),
        secret: false,
    });
    out.push(Output {
        path: key_path,
        contents: key.serialize_pem(),
        secret: true,
    });
    Ok(())
}

fn ia5(value: &str, what: &str) -> Result<rcgen::string::Ia5String, CertsError> {
    rcgen::string::Ia5String::try_from(value).map_err(generate(what))
}

/// Refuses what `args` cannot mean, before anything is read or written.
fn check(args: &CertsArgs) -> Result<(), CertsError> {
    let CertsArgs {
        dns,
        nodes,
        readers,
        node_ips,
        days,
        ..
    } = args;
    if *days == 0 {
        return Err(CertsError::NoDays);
    }
    if !node_ips.is_empty() && nodes.len() != 1 {
        return Err(CertsError::NodeIpsOfOneNode { nodes: nodes.len() });
    }
    for ip in node_ips {
        census_proto::domain::check_usable_ip(*ip)
            .map_err(|reason| CertsError::BadNodeIp { ip: *ip, reason })?;
    }
    if let Some(name) = dns.iter().find(|n| !valid_dns_name(n)) {
        return Err(CertsError::BadDnsName { name: name.clone() });
    }
    for (i, node) in nodes.iter().enumerate() {
        if nodes[..i].contains(node) {
            return Err(CertsError::DuplicateNode { node: node.clone() });
        }
    }
    for (i, reader) in readers.iter().enumerate() {
        if readers[..i].contains(reader) {
            return Err(CertsError::DuplicateReader {
                reader: reader.clone(),
            });
        }
    }
    Ok(())
}

/// Write what `args` asks for; returns the files written, in order.
pub fn run(args: &CertsArgs) -> Result<Vec<PathBuf>, CertsError> {
    check(args)?;
    let CertsArgs {
        out_dir,
        dns,
        ips,
        nodes,
        readers,
        node_ips,
        days,
        force,
    } = args;
    let serving = !dns.is_empty() || !ips.is_empty();
    let mut leaves = Vec::new();
    if serving {
        leaves.push((out_dir.join("server.pem"), out_dir.join("server-key.pem")));
    }
    leaves.extend(nodes.iter().map(|n| node_files(out_dir, n)));
    leaves.extend(readers.iter().map(|r| reader_files(out_dir, r)));
    if !force {
        for path in leaves.iter().flat_map(|(c, k)| [c, k]) {
            if path.exists() {
                return Err(CertsError::Exists { path: path.clone() });
            }
        }
    }

    let mut out = Vec::new();
    let (issuer, existing) = load_or_make_ca(out_dir, *days, &mut out)?;
    if existing && leaves.is_empty() {
        return Err(CertsError::NothingToWrite {
            dir: out_dir.clone(),
        });
    }
    let mut leaves = leaves.into_iter();
    if serving && let Some((cert, key)) = leaves.next() {
        let mut p = params(*days, dns.first().map_or("census-operator", String::as_str));
        for name in dns {
            p.subject_alt_names
                .push(SanType::DnsName(ia5(name, "serving certificate")?));
        }
        p.subject_alt_names
            .extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        leaf("serving certificate", p, &issuer, cert, key, &mut out)?;
    }
    let clients = nodes
        .iter()
        .map(|n| {
            (
                format!("client certificate of node {n}"),
                NODE_URI_PREFIX,
                n,
            )
        })
        .chain(readers.iter().map(|r| {
            (
                format!("client certificate of reader {r}"),
                READER_URI_PREFIX,
                r,
            )
        }));
    for ((what, prefix, name), (cert, key)) in clients.zip(leaves) {
        let mut p = params(*days, name.as_str());
        p.subject_alt_names
            .push(SanType::URI(ia5(&format!("{prefix}{name}"), &what)?));
        if prefix == NODE_URI_PREFIX {
            p.subject_alt_names.extend(
                node_ips
                    .iter()
                    .map(|ip| SanType::IpAddress(ip.to_canonical())),
            );
        }
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        leaf(&what, p, &issuer, cert, key, &mut out)?;
    }

    fs::create_dir_all(out_dir).map_err(|source| CertsError::Write {
        path: out_dir.clone(),
        source,
    })?;
    out.iter()
        .map(|o| write_file(o).map(|()| o.path.clone()))
        .collect()
}

fn write_file(output: &Output) -> Result<(), CertsError> {
    let Output {
        path,
        contents,
        secret,
    } = output;
    let err = |source| CertsError::Write {
        path: path.clone(),
        source,
    };
    let mut tmp = path.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let _ = fs::remove_file(&tmp);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if *secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(err)?;
    file.write_all(contents.as_bytes()).map_err(err)?;
    file.sync_all().map_err(err)?;
    fs::rename(&tmp, path).map_err(err)
}

/// Why a client certificate names no node.
#[derive(Debug, thiserror::Error)]
pub enum NodeCertError {
    #[error("the CA certificate cannot be read: {0}")]
    Ca(String),
    #[error("no client certificate was presented")]
    NoCertificate,
    #[error("the client certificate is not valid for this CA: {0}")]
    Untrusted(#[source] webpki::Error),
    #[error(
        "the client certificate is not signed by the CA itself but through {intermediates} intermediate certificate(s): the CA is pathlen:0, and a client presents a certificate of census-operator certs"
    )]
    Chain { intermediates: usize },
    #[error("the client certificate cannot be parsed")]
    Malformed,
    #[error("the client certificate has no {NODE_URI_PREFIX}NAME URI SAN")]
    NoNode,
    #[error(
        "the client certificate has more than one {NODE_URI_PREFIX}NAME or {READER_URI_PREFIX}NAME URI SAN"
    )]
    ManyNodes,
    #[error("the client certificate is a reader's ({READER_URI_PREFIX}{0}), not a node's")]
    Reader(String),
    #[error("the client certificate's node: {0}")]
    BadName(#[from] census_proto::domain::NameError),
}

/// The CA that signs nodes' client certificates, for reading a node name from
/// a certificate chain a client presented.
#[derive(Debug)]
pub struct NodeCa {
    anchors: Vec<rustls_pki_types::TrustAnchor<'static>>,
}

impl NodeCa {
    /// From the CA's PEM (every certificate in it is trusted).
    pub fn from_pem(pem: &[u8]) -> Result<Self, NodeCertError> {
        let anchors = CertificateDer::pem_slice_iter(pem)
            .map(|der| {
                let der = der.map_err(|e| NodeCertError::Ca(e.to_string()))?;
                webpki::anchor_from_trusted_cert(&der)
                    .map(|a| a.to_owned())
                    .map_err(|e| NodeCertError::Ca(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if anchors.is_empty() {
            return Err(NodeCertError::Ca("no certificate in it".to_owned()));
        }
        Ok(Self { anchors })
    }

    /// The node a client certificate chain (leaf first) proves to be, checked
    /// now: signed by this CA, in its validity period, for client
    /// authentication, with one `census://node/NAME` URI SAN.
    pub fn node_of(&self, chain: &[CertificateDer<'_>]) -> Result<NodeName, NodeCertError> {
        self.node_at(chain, UnixTime::now())
    }

    /// [`Self::node_at`].
    pub fn node_at(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<NodeName, NodeCertError> {
        match self.subject_at(chain, now)? {
            CertSubject::Node(node) => Ok(node),
            CertSubject::Reader(name) => Err(NodeCertError::Reader(name)),
        }
    }

    /// Who a client certificate chain (leaf first) names, checked now: a node
    /// (`census://node/NAME`) or a reader (`census://reader/NAME`), exactly one.
    pub fn subject_of(&self, chain: &[CertificateDer<'_>]) -> Result<CertSubject, NodeCertError> {
        self.subject_at(chain, UnixTime::now())
    }

    /// [`Self::subject_of`] at a given time.
    pub fn subject_at(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<CertSubject, NodeCertError> {
        self.verify_at(chain, now).map(|verified| verified.subject)
    }

    /// Who a client certificate chain names and until when it proves it, checked
    /// now (see [`Self::subject_of`]).
    ///
    /// The leaf must be signed by the CA itself: the CA is written `pathlen:0`, and
    /// webpki does not read a trust anchor's constraints, so the chain is verified
    /// with no intermediates at all. Certificates the client sends after its leaf
    /// (the CA's own, say) are not used; a leaf that verifies only through them is
    /// [`NodeCertError::Chain`].
    pub fn verify(&self, chain: &[CertificateDer<'_>]) -> Result<Verified, NodeCertError> {
        self.verify_at(chain, UnixTime::now())
    }

    /// [`Self::verify`] at a given time.
    pub fn verify_at(
        &self,
        chain: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<Verified, NodeCertError> {
        let (leaf, intermediates) = chain.split_first().ok_or(NodeCertError::NoCertificate)?;
        let cert = webpki::EndEntityCert::try_from(leaf).map_err(NodeCertError::Untrusted)?;
        let verify = |intermediates: &[CertificateDer<'_>]| {
            cert.verify_for_usage(
                webpki::ALL_VERIFICATION_ALGS,
                &self.anchors,
                intermediates,
                now,
                webpki::KeyUsage::required(EKU_CLIENT_AUTH),
                None,
                None,
            )
            .map(|_| ())
        };
        if let Err(error) = verify(&[]) {
            // Named for what it is when the chain holds only through what the
            // client sent after its leaf.
            if !intermediates.is_empty() && verify(intermediates).is_ok() {
                return Err(NodeCertError::Chain {
                    intermediates: intermediates.len(),
                });
            }
            return Err(NodeCertError::Untrusted(error));
        }
        let (_, parsed) =
            x509_parser::parse_x509_certificate(leaf).map_err(|_| NodeCertError::Malformed)?;
        let san = parsed
            .subject_alternative_name()
            .map_err(|_| NodeCertError::Malformed)?;
        let general_names = || san.iter().flat_map(|ext| ext.value.general_names.iter());
        let addresses = general_names()
            .filter_map(|name| match name {
                x509_parser::extensions::GeneralName::IPAddress(bytes) => ip_san(bytes),
                _ => None,
            })
            .collect();
        let mut names = general_names().filter_map(|name| match name {
            x509_parser::extensions::GeneralName::URI(uri) => uri
                .strip_prefix(NODE_URI_PREFIX)
                .map(|node| (node, true))
                .or_else(|| uri.strip_prefix(READER_URI_PREFIX).map(|r| (r, false))),
            _ => None,
        });
        let (name, node) = names.next().ok_or(NodeCertError::NoNode)?;
        if names.next().is_some() {
            return Err(NodeCertError::ManyNodes);
        }
        let name = NodeName::new(name)?;
        let subject = if node {
            CertSubject::Node(name)
        } else {
            CertSubject::Reader(name.as_str().to_owned())
        };
        // The leaf proves nothing once it has expired; the CA itself is a trust
        // anchor, judged by its own validity at the handshake.
        Ok(Verified {
            subject,
            not_after: not_after(&parsed),
            addresses,
        })
    }
}

/// An IP SAN's address (4 or 16 bytes; a name constraint's 8 or 32 are not one).
fn ip_san(bytes: &[u8]) -> Option<IpAddr> {
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some(ip.to_canonical())
}

fn not_after(cert: &x509_parser::certificate::X509Certificate<'_>) -> SystemTime {
    let seconds = cert.validity().not_after.timestamp();
    SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(seconds).unwrap_or(0))
}

/// A verified client certificate chain: who it names, until when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub subject: CertSubject,
    /// The end of the leaf's validity (`notAfter`; the leaf is signed by the CA
    /// itself): a stream it authenticated ends then.
    pub not_after: SystemTime,
    /// The leaf's IP SANs (IPv4-mapped ones as IPv4): for a node, the addresses
    /// the certificate vouches are its own.
    pub addresses: Vec<IpAddr>,
}

/// Who a client certificate of the CA names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertSubject {
    /// An agent's: it speaks for this node.
    Node(NodeName),
    /// A reader's: it may read, never speak for a node.
    Reader(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn args(dir: &Path) -> Result<CertsArgs, Box<dyn std::error::Error>> {
        Ok(CertsArgs {
            out_dir: dir.to_owned(),
            dns: vec!["census-operator-leader.census-system.svc".to_owned()],
            ips: vec!["127.0.0.1".parse()?],
            nodes: vec![NodeName::new("node-a")?, NodeName::new("node-b.example")?],
            readers: vec![NodeName::new("cli")?],
            node_ips: Vec::new(),
            days: 30,
            force: false,
        })
    }

    fn der(path: &Path) -> Result<CertificateDer<'static>, Box<dyn std::error::Error>> {
        Ok(CertificateDer::from_pem_file(path)?)
    }

    #[test]
    fn node_names_are_read_back_from_certificates_of_this_ca_only() -> TestResult {
        let dir = tempfile::tempdir()?;
        run(&args(dir.path())?)?;
        let ca = NodeCa::from_pem(&fs::read(dir.path().join("ca.pem"))?)?;
        let (a, _) = node_files(dir.path(), &NodeName::new("node-a")?);
        assert_eq!(ca.node_of(&[der(&a)?])?.as_str(), "node-a");
        let (b, _) = node_files(dir.path(), &NodeName::new("node-b.example")?);
        assert_eq!(ca.node_of(&[der(&b)?])?.as_str(), "node-b.example");

        // The serving certificate is not a client certificate.
        let server = der(&dir.path().join("server.pem"))?;
        assert!(matches!(
            ca.node_of(&[server]),
            Err(NodeCertError::Untrusted(_))
        ));
        // Another CA's node certificate is refused, whatever it says.
        let other = tempfile::tempdir()?;
        run(&args(other.path())?)?;
        let (foreign, _) = node_files(other.path(), &NodeName::new("node-a")?);
        assert!(matches!(
            ca.node_of(&[der(&foreign)?]),
            Err(NodeCertError::Untrusted(_))
        ));
        // Past its validity, a certificate of this CA is refused too.
        let later = UnixTime::since_unix_epoch(
            SystemTime::now().duration_since(SystemTime::UNIX_EPOCH)?
                + Duration::from_secs(31 * 86_400),
        );
        assert!(matches!(
            ca.node_at(&[der(&a)?], later),
            Err(NodeCertError::Untrusted(_))
        ));
        assert!(matches!(ca.node_of(&[]), Err(NodeCertError::NoCertificate)));
        Ok(())
    }

    #[test]
    fn a_verified_chain_proves_its_subject_until_its_certificate_expires() -> TestResult {
        let dir = tempfile::tempdir()?;
        run(&args(dir.path())?)?;
        let ca = NodeCa::from_pem(&fs::read(dir.path().join("ca.pem"))?)?;
        let (a, _) = node_files(dir.path(), &NodeName::new("node-a")?);
        let verified = ca.verify(&[der(&a)?])?;
        assert_eq!(
            verified.subject,
            CertSubject::Node(NodeName::new("node-a")?)
        );
        // Issued for 30 days (within the minute the test takes).
        let left = verified.not_after.duration_since(SystemTime::now())?;
        let thirty = Duration::from_secs(30 * 86_400);
        assert!(
            left <= thirty && left > thirty - Duration::from_secs(300),
            "{left:?}"
        );
        Ok(())
    }

    #[test]
    fn a_certificate_of_this_ca_without_a_node_uri_names_no_node() -> TestResult {
        let dir = tempfile::tempdir()?;
        run(&args(dir.path())?)?;
        let issuer = Issuer::from_ca_cert_pem(
            &read(&dir.path().join("ca.pem"))?,
            KeyPair::from_pem(&read(&dir.path().join("ca-key.pem"))?)?,
        )?;
        let ca = NodeCa::from_pem(&fs::read(dir.path().join("ca.pem"))?)?;
        let client = |sans: Vec<SanType>| -> Result<CertificateDer<'static>, rcgen::Error> {
            let mut p = params(1, "x");
            p.subject_alt_names = sans;
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            Ok(p.signed_by(&KeyPair::generate()?, &issuer)?.der().clone())
        };
        let dns = client(vec![SanType::DnsName("node-a".try_into()?)])?;
        assert!(matches!(ca.node_of(&[dns]), Err(NodeCertError::NoNode)));
        let two = client(vec![
            SanType::URI("census://node/a".try_into()?),
            SanType::URI("census://node/b".try_into()?),
        ])?;
        assert!(matches!(ca.node_of(&[two]), Err(NodeCertError::ManyNodes)));
        let bad = client(vec![SanType::URI("census://node/Not_A_Node".try_into()?)])?;
        assert!(matches!(ca.node_of(&[bad]), Err(NodeCertError::BadName(_))));
        Ok(())
    }

    #[test]
    fn a_reader_certificate_names_a_reader_and_no_node() -> TestResult {
        let dir = tempfile::tempdir()?;
        run(&args(dir.path())?)?;
        let ca = NodeCa::from_pem(&fs::read(dir.path().join("ca.pem"))?)?;
        let (cert, key) = reader_files(dir.path(), &NodeName::new("cli")?);
        assert!(key.exists());
        let chain = [der(&cert)?];
        assert_eq!(
            ca.subject_of(&chain)?,
            CertSubject::Reader("cli".to_owned())
        );
        assert!(matches!(ca.node_of(&chain), Err(NodeCertError::Reader(_))));
        let (node, _) = node_files(dir.path(), &NodeName::new("node-a")?);
        assert_eq!(
            ca.subject_of(&[der(&node)?])?,
            CertSubject::Node(NodeName::new("node-a")?)
        );
        let mut twice = args(dir.path())?;
        twice.readers.push(NodeName::new("cli")?);
        twice.force = true;
        assert!(matches!(
            run(&twice),
            Err(CertsError::DuplicateReader { .. })
        ));
        Ok(())
    }

    #[test]
    fn node_ips_are_the_ip_sans_of_one_nodes_certificate() -> TestResult {
        let dir = tempfile::tempdir()?;
        run(&args(dir.path())?)?;
        let ca = NodeCa::from_pem(&fs::read(dir.path().join("ca.pem"))?)?;
        let (a, _) = node_files(dir.path(), &NodeName::new("node-a")?);
        assert_eq!(ca.verify(&[der(&a)?])?.addresses, Vec::<IpAddr>::new());

        let one = |ips: &[&str]| -> Result<CertsArgs, Box<dyn std::error::Error>> {
            Ok(CertsArgs {
                out_dir: dir.path().to_owned(),
                dns: Vec::new(),
                ips: Vec::new(),
                nodes: vec![NodeName::new("node-a")?],
                readers: Vec::new(),
                node_ips: ips.iter().map(|ip| ip.parse()).collect::<Result<_, _>>()?,
                days: 30,
                force: true,
            })
        };
        run(&one(&["10.1.0.1", "fd00::1", "::ffff:10.1.0.2"])?)?;
        let verified = ca.verify(&[der(&a)?])?;
        assert_eq!(
            verified.subject,
            CertSubject::Node(NodeName::new("node-a")?)
        );
        let want: Vec<IpAddr> = ["10.1.0.1", "fd00::1", "10.1.0.2"]
            .iter()
            .map(|ip| ip.parse())
            .collect::<Result<_, _>>()?;
        assert_eq!(verified.addresses, want);

        // Refused before anything is written: addresses of two nodes at once, an
        // address no node has.
        let before = fs::read(&a)?;
        let mut two = one(&["10.1.0.9"])?;
        two.nodes.push(NodeName::new("node-b")?);
        let refused = run(&two).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            refused.contains("one node") && refused.contains("2 --node"),
            "{refused}"
        );
        let refused = run(&one(&["10.1.0.9", "127.0.0.1"])?)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert_eq!(
            refused,
            "--node-ip 127.0.0.1 is a loopback address: no node is reached at it"
        );
        let mut without_node = one(&["10.1.0.9"])?;
        without_node.nodes.clear();
        assert!(matches!(
            run(&without_node),
            Err(CertsError::NodeIpsOfOneNode { nodes: 0 })
        ));
        assert_eq!(fs::read(&a)?, before, "a refusal wrote the certificate");
        Ok(())
    }

    /// The CA is written `pathlen:0`, and webpki does not read a trust anchor's
    /// constraints: a chain through an intermediate CA (signed by the CA's key, with
    /// clientAuth) verifies up to the anchor, and must still name nobody.
    #[test]
    fn a_chain_through_an_intermediate_ca_names_nobody() -> TestResult {
        let dir = tempfile::tempdir()?;
        run(&args(dir.path())?)?;
        let issuer = Issuer::from_ca_cert_pem(
            &read(&dir.path().join("ca.pem"))?,
            KeyPair::from_pem(&read(&dir.path().join("ca-key.pem"))?)?,
        )?;
        let ca = NodeCa::from_pem(&fs::read(dir.path().join("ca.pem"))?)?;
        let mut p = params(1, "intermediate");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let intermediate_key = KeyPair::generate()?;
        let intermediate = p.signed_by(&intermediate_key, &issuer)?;
        let intermediate_issuer = Issuer::new(p, intermediate_key);
        let mut leaf = params(1, "node-a");
        leaf.is_ca = IsCa::ExplicitNoCa;
        leaf.subject_alt_names = vec![SanType::URI("census://node/node-a".try_into()?)];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let leaf = leaf.signed_by(&KeyPair::generate()?, &intermediate_issuer)?;
        let chain = [leaf.der().clone(), intermediate.der().clone()];
        let refused = ca.node_of(&chain);
        assert!(
            matches!(refused, Err(NodeCertError::Chain { intermediates: 1 })),
            "{refused:?}"
        );
        assert!(
            refused.is_err_and(|e| e.to_string().contains("signed by the CA itself")),
            "the refusal says why"
        );
        // The leaf alone does not chain to the CA.
        assert!(matches!(
            ca.node_of(&chain[..1]),
            Err(NodeCertError::Untrusted(_))
        ));
        // A leaf of the CA itself proves its node whatever else the client sends
        // after it (the CA's own certificate, an unrelated one): they are not used.
        let (a, _) = node_files(dir.path(), &NodeName::new("node-a")?);
        let ca_cert = der(&dir.path().join("ca.pem"))?;
        for extra in [ca_cert, intermediate.der().clone()] {
            assert_eq!(ca.node_of(&[der(&a)?, extra])?.as_str(), "node-a");
        }
        Ok(())
    }

    #[test]
    fn dns_names_are_checked() {
        assert!(valid_dns_name("census-operator-leader.census-system.svc"));
        assert!(valid_dns_name("*.census-system.svc"));
        for bad in ["", "a..b", "-a", "a b", "node:a", "a.*.b"] {
            assert!(!valid_dns_name(bad), "{bad}");
        }
    }
}
