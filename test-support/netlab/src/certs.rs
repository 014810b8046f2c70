//! Certificates for mutual TLS in a lab, made as an installation makes them: by the
//! `census-operator certs` binary under test, into a directory. Its file names
//! (`ca.pem`, `server.pem`, `node-NAME.pem`, `reader-NAME.pem`, each with its
//! `-key.pem`) and the daemons' TLS flags for them. Needs no root.

use std::{
    ffi::OsString,
    net::IpAddr,
    path::{Path, PathBuf},
    process::Command,
};

use crate::{Error, netns::run_command};

/// A directory of certificates written by `census-operator certs`.
#[derive(Debug, Clone)]
pub struct Certs {
    dir: PathBuf,
}

impl Certs {
    /// Runs `operator_bin certs` to write into `dir` a CA, the operator's serving
    /// certificate for `ips`, a client certificate for each of `nodes` and one for
    /// each of `readers`, valid for a day.
    pub fn generate(
        operator_bin: &Path,
        dir: PathBuf,
        ips: &[IpAddr],
        nodes: &[&str],
        readers: &[&str],
    ) -> Result<Self, Error> {
        let mut command = Command::new(operator_bin);
        command.arg("certs").arg("--out-dir").arg(&dir);
        for ip in ips {
            command.args(["--ip", &ip.to_string()]);
        }
        for node in nodes {
            command.args(["--node", node]);
        }
        for reader in readers {
            command.args(["--reader", reader]);
        }
        run_command(command.args(["--days", "1"]))?;
        Ok(Self { dir })
    }

    /// Runs `operator_bin certs` again to rewrite `node`'s client certificate naming
    /// `ips` as the node's own addresses (`--node-ip`): what its Hello may claim.
    pub fn vouch(&self, operator_bin: &Path, node: &str, ips: &[IpAddr]) -> Result<(), Error> {
        let mut command = Command::new(operator_bin);
        command
            .arg("certs")
            .arg("--out-dir")
            .arg(&self.dir)
            .args(["--node", node]);
        for ip in ips {
            command.args(["--node-ip", &ip.to_string()]);
        }
        run_command(command.args(["--days", "1", "--force"])).map(drop)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA that signed every certificate here.
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// `node`'s client certificate and its key.
    pub fn node(&self, node: &str) -> (PathBuf, PathBuf) {
        self.pair(&format!("node-{node}"))
    }

    /// The reader `name`'s client certificate and its key.
    pub fn reader(&self, name: &str) -> (PathBuf, PathBuf) {
        self.pair(&format!("reader-{name}"))
    }

    fn pair(&self, stem: &str) -> (PathBuf, PathBuf) {
        (
            self.dir.join(format!("{stem}.pem")),
            self.dir.join(format!("{stem}-key.pem")),
        )
    }

    /// The operator's flags: its serving certificate, and the CA of its clients.
    pub fn operator_args(&self) -> Vec<OsString> {
        let (cert, key) = self.pair("server");
        vec![
            "--tls-cert".into(),
            cert.into(),
            "--tls-key".into(),
            key.into(),
            "--client-ca".into(),
            self.ca().into(),
        ]
    }

    /// An agent's flags: the operator's CA, and `node`'s certificate.
    pub fn agent_args(&self, node: &str) -> Vec<OsString> {
        let (cert, key) = self.node(node);
        vec![
            "--tls-ca".into(),
            self.ca().into(),
            "--tls-cert".into(),
            cert.into(),
            "--tls-key".into(),
            key.into(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flags_name_the_files_census_operator_certs_writes() {
        let certs = Certs {
            dir: PathBuf::from("/tls"),
        };
        assert_eq!(
            certs.operator_args(),
            [
                "--tls-cert",
                "/tls/server.pem",
                "--tls-key",
                "/tls/server-key.pem",
                "--client-ca",
                "/tls/ca.pem"
            ]
            .map(OsString::from)
        );
        assert_eq!(
            certs.agent_args("a"),
            [
                "--tls-ca",
                "/tls/ca.pem",
                "--tls-cert",
                "/tls/node-a.pem",
                "--tls-key",
                "/tls/node-a-key.pem"
            ]
            .map(OsString::from)
        );
        assert_eq!(
            certs.reader("lab"),
            (
                PathBuf::from("/tls/reader-lab.pem"),
                PathBuf::from("/tls/reader-lab-key.pem")
            )
        );
    }

    #[test]
    fn a_binary_that_fails_is_an_error_naming_the_command() {
        let error = Certs::generate(Path::new("false"), PathBuf::from("/tls"), &[], &["a"], &[])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            error.contains("\"certs\"") && error.contains("failed"),
            "{error}"
        );
    }
}
