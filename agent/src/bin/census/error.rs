//! Every way `census` can fail, each with its exit code and a one-line message that
//! names the problem and what to do. The table of codes is printed by `census --help`
//! ([`EXIT_CODES`]) and documented in docs/cli.md.

use std::{fmt, io, net::IpAddr, path::PathBuf, process::ExitCode};

use census_agent::bpf::InspectError;
use census_proto::{domain::NameError, labels::LabelError};

use super::args::ServerAddr;

/// The exit codes, as `census --help` shows them.
pub(crate) const EXIT_CODES: &str = "\
Exit codes:
   0  success
   1  an unexpected failure (a BPF call, writing the output)
   2  usage: an unknown command or flag, or a flag value of the wrong form
   3  malformed input: labels, a selector, an address, an identity or node name
   4  not found: the identity, label set, node or address is not known
   5  the operator is unreachable (--operator, CENSUS_OPERATOR) or refused the TLS
      handshake (--tls-cert, --tls-key)
   6  the agent is unreachable (--agent, CENSUS_AGENT)
   7  no census maps are pinned at --bpffs (CENSUS_BPFFS)
   8  no permission to read the pinned maps (run as root)
   9  the pinned maps have another layout version
  10  a pinned map has an unexpected type, key size or value size
  11  the operator or agent speaks another protocol version
  12  the operator or agent failed the request or sent an unreadable answer";

/// One exit code per kind of failure; see [`EXIT_CODES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    Failure = 1,
    Usage = 2,
    Malformed = 3,
    NotFound = 4,
    OperatorUnreachable = 5,
    AgentUnreachable = 6,
    NoPins = 7,
    Permission = 8,
    Layout = 9,
    MapShape = 10,
    Incompatible = 11,
    PeerFailed = 12,
}

impl From<Exit> for ExitCode {
    fn from(exit: Exit) -> Self {
        Self::from(exit as u8)
    }
}

/// The program `census` talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer {
    Operator,
    Agent,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Operator => "operator",
            Self::Agent => "agent",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    #[error(
        "malformed labels {input:?}: {source}; write labels as source:key=value, e.g. k8s:app=web"
    )]
    Labels {
        input: String,
        #[source]
        source: LabelError,
    },

    #[error("{input:?} is not an IPv4 or IPv6 address")]
    Address { input: String },

    #[error("{input:?} is not an identity: expected a number from 1 to 4294967295")]
    IdentityArg { input: String },

    #[error("{source}")]
    NodeName {
        #[source]
        source: NameError,
    },

    #[error("the operator at {addr} refused the request: {message}")]
    Refused { addr: ServerAddr, message: String },

    #[error(
        "identity {id} is not known to the operator at {addr}; `census identity list` shows the known ones"
    )]
    UnknownIdentity { id: u32, addr: ServerAddr },

    #[error(
        "no identity has the labels {labels} at the operator at {addr}; `census identity list --labels ...` finds identities by some of their labels"
    )]
    UnknownLabels { labels: String, addr: ServerAddr },

    #[error(
        "node {node} is not known to the operator at {addr}; `census node list` shows the known ones"
    )]
    UnknownNode { node: String, addr: ServerAddr },

    #[error(
        "{ip} is not in the ENDPOINTS map pinned in {dir}; `census bpf endpoints list` shows every entry"
    )]
    UnknownAddress { ip: IpAddr, dir: PathBuf },

    #[error("no endpoint or node claims {ip} in the endpoint map of the operator at {addr}")]
    UnmappedAddress { ip: IpAddr, addr: ServerAddr },

    #[error(
        "cannot reach the operator at {addr}: {reason}; is census-operator running? Point --operator (CENSUS_OPERATOR) at its gRPC address"
    )]
    OperatorUnreachable { addr: ServerAddr, reason: String },

    #[error(
        "the operator at {addr} refused the TLS handshake ({alert}): {}",
        if *presented {
            "it does not accept the client certificate of --tls-cert (CENSUS_TLS_CERT); use one of the CA of its --client-ca, valid now (`census-operator certs --reader NAME` writes one)"
        } else {
            "it requires a client certificate; set --tls-cert and --tls-key (CENSUS_TLS_CERT, CENSUS_TLS_KEY) to a reader's certificate and key (`census-operator certs --reader NAME` writes them)"
        }
    )]
    TlsRefused {
        addr: ServerAddr,
        /// The TLS alert, as rustls names it (`CertificateRequired`).
        alert: String,
        /// Whether a client certificate was presented.
        presented: bool,
    },

    #[error(
        "cannot reach the agent at {addr}: {reason}; is census-agent running on this node? Point --agent (CENSUS_AGENT) at its admin address"
    )]
    AgentUnreachable { addr: ServerAddr, reason: String },

    #[error("{}", pins_message(source))]
    Pins {
        #[source]
        source: InspectError,
    },

    #[error(
        "the {peer} at {addr} speaks another protocol version ({message}); use the census CLI of the {peer}'s release"
    )]
    Incompatible {
        peer: Peer,
        addr: ServerAddr,
        message: String,
    },

    #[error("the operator at {addr} failed the request ({code}): {message}")]
    OperatorFailed {
        addr: ServerAddr,
        code: tonic::Code,
        message: String,
    },

    #[error("the agent at {addr} answered GET {path} with HTTP {status}: {body}")]
    AgentFailed {
        addr: ServerAddr,
        path: &'static str,
        status: u16,
        body: String,
    },

    #[error("the {peer} at {addr} sent an answer census cannot read: {reason}")]
    BadAnswer {
        peer: Peer,
        addr: ServerAddr,
        reason: String,
    },

    #[error("encoding the output as {format} failed: {reason}")]
    Encode {
        format: &'static str,
        reason: String,
    },

    #[error("writing the output failed: {source}")]
    Output {
        #[source]
        source: io::Error,
    },

    #[error("starting census's async runtime failed: {source}")]
    Runtime {
        #[source]
        source: io::Error,
    },
}

impl CliError {
    pub(crate) fn exit(&self) -> Exit {
        match self {
            Self::Labels { .. }
            | Self::Address { .. }
            | Self::IdentityArg { .. }
            | Self::NodeName { .. }
            | Self::Refused { .. } => Exit::Malformed,
            Self::UnknownIdentity { .. }
            | Self::UnknownLabels { .. }
            | Self::UnknownNode { .. }
            | Self::UnknownAddress { .. }
            | Self::UnmappedAddress { .. } => Exit::NotFound,
            Self::OperatorUnreachable { .. } | Self::TlsRefused { .. } => Exit::OperatorUnreachable,
            Self::AgentUnreachable { .. } => Exit::AgentUnreachable,
            Self::Pins { source } => pins_exit(source),
            Self::Incompatible { .. } => Exit::Incompatible,
            Self::OperatorFailed { .. } | Self::AgentFailed { .. } | Self::BadAnswer { .. } => {
                Exit::PeerFailed
            }
            Self::Encode { .. } | Self::Output { .. } | Self::Runtime { .. } => Exit::Failure,
        }
    }

    /// The message on one line: text from peers or the kernel may carry newlines.
    pub(crate) fn one_line(&self) -> String {
        one_line(&self.to_string())
    }
}

impl From<InspectError> for CliError {
    fn from(source: InspectError) -> Self {
        Self::Pins { source }
    }
}

/// `text` with every run of line breaks turned into "; ".
pub(crate) fn one_line(text: &str) -> String {
    text.split(['\n', '\r'])
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

fn pins_exit(error: &InspectError) -> Exit {
    match error {
        InspectError::MissingDir { .. }
        | InspectError::NotADir { .. }
        | InspectError::NotBpffs { .. }
        | InspectError::MissingMap { .. } => Exit::NoPins,
        InspectError::PermissionDenied { .. } => Exit::Permission,
        InspectError::Unversioned { .. } | InspectError::LayoutMismatch { .. } => Exit::Layout,
        InspectError::ShapeMismatch { .. } => Exit::MapShape,
        InspectError::Map { .. } | InspectError::Check { .. } | InspectError::Io { .. } => {
            Exit::Failure
        }
    }
}

const BPFFS_HINT: &str = "point --bpffs (CENSUS_BPFFS) at the agent's pin directory";

fn pins_message(error: &InspectError) -> String {
    match error {
        InspectError::MissingDir { path } => format!(
            "no census maps at {}: the directory does not exist; is census-agent running on \
             this node? If it pins elsewhere, {BPFFS_HINT}",
            path.display()
        ),
        InspectError::NotADir { path } => {
            format!("{} is not a directory; {BPFFS_HINT}", path.display())
        }
        InspectError::NotBpffs { path } => format!(
            "no census maps at {}: it is not on a BPF file system (bpffs); {BPFFS_HINT}",
            path.display()
        ),
        InspectError::MissingMap { map, path } => format!(
            "no census maps at {}: map {map} is not pinned there; is census-agent running on \
             this node (it creates the maps)? If it pins elsewhere, {BPFFS_HINT}",
            path.parent().unwrap_or(path).display()
        ),
        InspectError::PermissionDenied { path, .. } => format!(
            "no permission to read {}: reading BPF maps needs root (or CAP_BPF); run census \
             with sudo",
            path.display()
        ),
        InspectError::Unversioned { pin_dir } => format!(
            "the maps pinned in {} carry no layout version (CENSUS_META is missing): census \
             will not guess their layout; remove them with the agent's uninstall",
            pin_dir.display()
        ),
        InspectError::LayoutMismatch {
            pin_dir, found: 0, ..
        } => format!(
            "the maps pinned in {} have no layout version yet (an agent is creating them); \
             try again in a moment",
            pin_dir.display()
        ),
        InspectError::LayoutMismatch {
            pin_dir,
            found,
            expected,
        } => format!(
            "the maps pinned in {} have layout version {found}, this census reads layout \
             {expected}; use the census CLI of the agent's release",
            pin_dir.display()
        ),
        InspectError::ShapeMismatch {
            path,
            layout,
            expected,
            found,
        } => format!(
            "the map pinned at {} is not what layout {layout} expects (expected {expected}, \
             found {found}); census will not misread it: use the census CLI of the agent's \
             release",
            path.display()
        ),
        InspectError::Map { path, source } => {
            format!(
                "reading the map pinned at {} failed: {source}",
                path.display()
            )
        }
        InspectError::Check { path, source } => {
            format!("checking {} failed: {source}", path.display())
        }
        InspectError::Io {
            operation,
            path,
            source,
        } => format!("{operation} {} failed: {source}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_and_listed() {
        let all = [
            Exit::Failure,
            Exit::Usage,
            Exit::Malformed,
            Exit::NotFound,
            Exit::OperatorUnreachable,
            Exit::AgentUnreachable,
            Exit::NoPins,
            Exit::Permission,
            Exit::Layout,
            Exit::MapShape,
            Exit::Incompatible,
            Exit::PeerFailed,
        ];
        for (i, exit) in all.iter().enumerate() {
            assert_eq!(*exit as usize, i + 1);
            let line = format!("\n{:>4}  ", *exit as u8);
            assert!(EXIT_CODES.contains(&line), "{exit:?} is not in the table");
        }
    }

    #[test]
    fn messages_are_one_line() -> Result<(), Box<dyn std::error::Error>> {
        assert_eq!(one_line("a\nb\r\n\n c "), "a; b; c");
        let error = CliError::OperatorFailed {
            addr: "127.0.0.1:1".parse()?,
            code: tonic::Code::Internal,
            message: "one\ntwo".into(),
        };
        assert_eq!(
            error.one_line(),
            "the operator at http://127.0.0.1:1 failed the request (Internal error): one; two"
        );
        Ok(())
    }
}
