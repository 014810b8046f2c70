//! The demo's certificates, as an installation makes them: `census-operator certs`
//! writes a CA, the operator's serving certificate (127.0.0.1), a client
//! certificate per node and one for the demo's own reads. The operator then speaks
//! mutual TLS only, and every caller is the node (or the reader) its certificate
//! names.

use std::{
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// The reader certificate the demo reads identities with.
const READER: &str = "demo";

/// A directory of certificates written by `census-operator certs`.
#[derive(Debug, Clone)]
pub(super) struct DemoCerts {
    dir: PathBuf,
}

impl DemoCerts {
    /// Writes the CA, the operator's certificate for 127.0.0.1 and a client
    /// certificate for each of `nodes` (and the demo's reader) into `dir`.
    pub(super) fn generate(
        operator_bin: &Path,
        dir: PathBuf,
        nodes: &[&str],
    ) -> anyhow::Result<Self> {
        let mut command = Command::new(operator_bin);
        command.arg("certs").arg("--out-dir").arg(&dir).args([
            "--ip",
            "127.0.0.1",
            "--reader",
            READER,
            "--days",
            "1",
        ]);
        for node in nodes {
            command.args(["--node", node]);
        }
        let output = command.output().context("running census-operator certs")?;
        if !output.status.success() {
            bail!(
                "census-operator certs: {}",
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(Self { dir })
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The operator's flags: its serving certificate, and the CA of its clients.
    pub(super) fn operator_args(&self) -> Vec<OsString> {
        vec![
            "--tls-cert".into(),
            self.file("server.pem").into(),
            "--tls-key".into(),
            self.file("server-key.pem").into(),
            "--client-ca".into(),
            self.file("ca.pem").into(),
        ]
    }

    /// An agent's flags: the operator's CA, and `node`'s certificate.
    pub(super) fn agent_args(&self, node: &str) -> Vec<OsString> {
        vec![
            "--tls-ca".into(),
            self.file("ca.pem").into(),
            "--tls-cert".into(),
            self.file(&format!("node-{node}.pem")).into(),
            "--tls-key".into(),
            self.file(&format!("node-{node}-key.pem")).into(),
        ]
    }

    /// A channel to the operator at `127.0.0.1:port` as `node`, or as the demo's
    /// reader for `None`.
    pub(super) async fn channel(&self, port: u16, node: Option<&str>) -> anyhow::Result<Channel> {
        let stem = match node {
            Some(node) => format!("node-{node}"),
            None => format!("reader-{READER}"),
        };
        let read = |name: &str| {
            let path = self.file(name);
            fs::read(&path).with_context(|| format!("reading {}", path.display()))
        };
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read("ca.pem")?))
            .identity(Identity::from_pem(
                read(&format!("{stem}.pem"))?,
                read(&format!("{stem}-key.pem"))?,
            ));
        Ok(Channel::from_shared(format!("https://127.0.0.1:{port}"))?
            .tls_config(tls)?
            .connect()
            .await?)
    }
}
