//! Certificates from `census-operator certs` in a temporary directory, the
//! operator's TLS flags for them, and clients that present them.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use census_operator::certs::{self, CertsArgs};
use census_proto::domain::NodeName;
use tempfile::TempDir;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::{ANSWER_TIMEOUT, TestResult, agent::Target};

/// A CA, a serving certificate for `localhost` and 127.0.0.1, and client
/// certificates, as `census-operator certs` writes them.
#[derive(Debug)]
pub struct Certs {
    dir: TempDir,
}

/// Who a client certificate names.
#[derive(Debug, Clone, Copy)]
pub enum Client<'a> {
    Node(&'a str),
    Reader(&'a str),
}

impl Certs {
    /// Writes a CA, the serving certificate and a client certificate for each of
    /// `nodes` and `readers`.
    pub fn generate(nodes: &[&str], readers: &[&str]) -> TestResult<Self> {
        let dir = tempfile::tempdir()?;
        let names = |list: &[&str]| -> TestResult<Vec<NodeName>> {
            list.iter()
                .map(|n| NodeName::new(n).map_err(Into::into))
                .collect()
        };
        certs::run(&CertsArgs {
            out_dir: dir.path().to_owned(),
            dns: vec!["localhost".to_owned()],
            ips: vec!["127.0.0.1".parse()?, "::1".parse()?],
            nodes: names(nodes)?,
            readers: names(readers)?,
            node_ips: Vec::new(),
            days: 1,
            force: false,
        })?;
        Ok(Self { dir })
    }

    /// Writes (over an existing one) `node`'s client certificate naming `ips` as
    /// the node's own addresses (`census-operator certs --node NODE --node-ip IP`).
    pub fn node_with_addresses(&self, node: &str, ips: &[&str]) -> TestResult {
        certs::run(&CertsArgs {
            out_dir: self.dir().to_owned(),
            dns: Vec::new(),
            ips: Vec::new(),
            nodes: vec![NodeName::new(node)?],
            readers: Vec::new(),
            node_ips: ips.iter().map(|ip| ip.parse()).collect::<Result<_, _>>()?,
            days: 1,
            force: true,
        })?;
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn path(&self, file: &str) -> TestResult<String> {
        Ok(self
            .dir
            .path()
            .join(file)
            .to_str()
            .ok_or("the certificates' directory is not UTF-8")?
            .to_owned())
    }

    /// The operator's flags for mutual TLS with these certificates.
    pub fn operator_flags(&self) -> TestResult<Vec<String>> {
        Ok(vec![
            "--tls-cert".into(),
            self.path("server.pem")?,
            "--tls-key".into(),
            self.path("server-key.pem")?,
            "--client-ca".into(),
            self.path("ca.pem")?,
        ])
    }

    /// The files of `client`'s certificate: (certificate, key).
    pub fn client_files(&self, client: Client<'_>) -> TestResult<(PathBuf, PathBuf)> {
        Ok(match client {
            Client::Node(node) => certs::node_files(self.dir(), &NodeName::new(node)?),
            Client::Reader(name) => certs::reader_files(self.dir(), &NodeName::new(name)?),
        })
    }

    /// TLS that trusts this CA and presents `client`'s certificate (none for `None`).
    pub fn client(&self, client: Option<Client<'_>>) -> TestResult<ClientTlsConfig> {
        let ca = std::fs::read(self.dir().join("ca.pem"))?;
        let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        Ok(match client {
            None => tls,
            Some(client) => {
                let (cert, key) = self.client_files(client)?;
                tls.identity(Identity::from_pem(
                    std::fs::read(cert)?,
                    std::fs::read(key)?,
                ))
            }
        })
    }

    /// `addr` reached over TLS as `client`.
    pub fn target(&self, addr: SocketAddr, client: Option<Client<'_>>) -> TestResult<Secured> {
        Ok(Secured {
            addr,
            tls: self.client(client)?,
        })
    }
}

/// An operator's address and the TLS to reach it with: a [`Target`] for
/// [`crate::Agent`] and [`crate::open_stream`].
#[derive(Debug, Clone)]
pub struct Secured {
    pub addr: SocketAddr,
    pub tls: ClientTlsConfig,
}

impl Secured {
    /// A channel over TLS, connected (the handshake done).
    pub async fn channel(&self) -> TestResult<Channel> {
        Ok(Channel::from_shared(format!("https://{}", self.addr))?
            .tls_config(self.tls.clone())?
            .connect_timeout(ANSWER_TIMEOUT)
            .connect()
            .await?)
    }
}

impl Target for Secured {
    fn grpc_addr(&self) -> SocketAddr {
        self.addr
    }

    fn tls(&self) -> Option<&ClientTlsConfig> {
        Some(&self.tls)
    }
}
