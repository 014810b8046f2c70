//! The demo's certificates, as an installation makes them: `census-operator certs`
//! writes a CA, the operator's serving certificate (127.0.0.1), a client
//! certificate per node and one for the demo's own reads. The operator then speaks
//! mutual TLS only, and every caller is the node (or the reader) its certificate
//! names.

use std::{
    ffi::OsString,
    fs,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use census_netlab::certs::Certs;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// The reader certificate the demo reads identities with.
const READER: &str = "demo";

/// A directory of certificates written by `census-operator certs`.
#[derive(Debug, Clone)]
pub(super) struct DemoCerts(Certs);

impl DemoCerts {
    /// Writes the CA, the operator's certificate for 127.0.0.1 and a client
    /// certificate for each of `nodes` (and the demo's reader) into `dir`.
    pub(super) fn generate(
        operator_bin: &Path,
        dir: PathBuf,
        nodes: &[&str],
    ) -> anyhow::Result<Self> {
        let loopback = IpAddr::from(Ipv4Addr::LOCALHOST);
        Certs::generate(operator_bin, dir, &[loopback], nodes, &[READER])
            .map(Self)
            .context("census-operator certs")
    }

    /// Rewrites `node`'s certificate naming `ips` as the node's own addresses (what
    /// its Hello may claim).
    pub(super) fn vouch(
        &self,
        operator_bin: &Path,
        node: &str,
        ips: &[IpAddr],
    ) -> anyhow::Result<()> {
        self.0
            .vouch(operator_bin, node, ips)
            .with_context(|| format!("census-operator certs --node {node} --node-ip"))
    }

    /// The operator's flags: its serving certificate, and the CA of its clients.
    pub(super) fn operator_args(&self) -> Vec<OsString> {
        self.0.operator_args()
    }

    /// An agent's flags: the operator's CA, and `node`'s certificate.
    pub(super) fn agent_args(&self, node: &str) -> Vec<OsString> {
        self.0.agent_args(node)
    }

    /// A channel to the operator at `127.0.0.1:port` as `node`, or as the demo's
    /// reader for `None`.
    pub(super) async fn channel(&self, port: u16, node: Option<&str>) -> anyhow::Result<Channel> {
        let (cert, key) = match node {
            Some(node) => self.0.node(node),
            None => self.0.reader(READER),
        };
        let read =
            |path: PathBuf| fs::read(&path).with_context(|| format!("reading {}", path.display()));
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(self.0.ca())?))
            .identity(Identity::from_pem(read(cert)?, read(key)?));
        Ok(Channel::from_shared(format!("https://127.0.0.1:{port}"))?
            .tls_config(tls)?
            .connect()
            .await?)
    }
}
