//! The flags every command takes, and the arguments `census` checks itself (labels,
//! addresses, identities) so that malformed input gets its own exit code before
//! anything is read or asked.

use std::{fmt, net::IpAddr, path::PathBuf, str::FromStr, time::Duration};

use census_agent::bpf::DEFAULT_PIN_DIR;
use census_proto::{
    domain::NodeName,
    labels::{Label, LabelLimits, LabelSet},
};
use clap::Args;

use super::{error::CliError, output::Format};

/// Flags every command takes (before or after the command).
#[derive(Debug, Clone, Args)]
pub(crate) struct Global {
    /// Output format: aligned columns for people, JSON or YAML for scripts.
    #[arg(short, long, value_enum, default_value_t = Format::Table, global = true)]
    pub(crate) output: Format,
    /// Show identities as numbers only: tables skip looking their labels up at the operator.
    #[arg(short = 'n', long, global = true)]
    pub(crate) numeric: bool,
    /// Leave out the header line of tables.
    #[arg(long, global = true)]
    pub(crate) no_headers: bool,
    /// The operator's gRPC address.
    #[arg(
        long,
        env = "CENSUS_OPERATOR",
        default_value = "http://127.0.0.1:9460",
        global = true
    )]
    pub(crate) operator: ServerAddr,
    /// The CA of the operator's serving certificate (PEM): reach the operator over
    /// TLS (docs/security.md, "Mutual TLS").
    #[arg(long, env = "CENSUS_TLS_CA", value_name = "PEM", global = true)]
    pub(crate) tls_ca: Option<PathBuf>,
    /// A client certificate for the operator (PEM): a reader's (`census-operator
    /// certs --reader NAME`), for an operator that requires mutual TLS.
    #[arg(long, env = "CENSUS_TLS_CERT", value_name = "PEM", global = true)]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, env = "CENSUS_TLS_KEY", value_name = "PEM", global = true)]
    pub(crate) tls_key: Option<PathBuf>,
    /// A file whose token every call to the operator carries as `authorization:
    /// Bearer TOKEN` (a ServiceAccount token the operator accepts for reading).
    #[arg(long, env = "CENSUS_TOKEN_FILE", value_name = "PATH", global = true)]
    pub(crate) token_file: Option<PathBuf>,
    /// The local agent's admin address.
    #[arg(
        long,
        env = "CENSUS_AGENT",
        default_value = "http://127.0.0.1:9462",
        global = true
    )]
    pub(crate) agent: ServerAddr,
    /// The directory the agent pins its maps in.
    #[arg(long, env = "CENSUS_BPFFS", default_value = DEFAULT_PIN_DIR, global = true)]
    pub(crate) bpffs: PathBuf,
    /// How long to wait for the operator or the agent to connect and answer.
    #[arg(
        long,
        env = "CENSUS_TIMEOUT",
        default_value = "5s",
        value_parser = humantime::parse_duration,
        global = true
    )]
    pub(crate) timeout: Duration,
}

/// The address of the operator or the agent: `http://host:port`, or `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerAddr {
    /// `host:port`.
    authority: String,
}

impl ServerAddr {
    /// `host:port`, for a TCP connection and the `Host` header.
    pub(crate) fn authority(&self) -> &str {
        &self.authority
    }
}

impl fmt::Display for ServerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum AddrError {
    #[error("{0:?} is not an address: expected http://HOST:PORT or HOST:PORT")]
    Syntax(String),
    #[error("{0:?}: only http:// is supported")]
    Scheme(String),
}

impl FromStr for ServerAddr {
    type Err = AddrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let with_scheme = if s.contains("://") {
            s.to_owned()
        } else {
            format!("http://{s}")
        };
        let uri: http::Uri = with_scheme
            .parse()
            .map_err(|_| AddrError::Syntax(s.to_owned()))?;
        if uri.scheme_str() != Some("http") {
            return Err(AddrError::Scheme(s.to_owned()));
        }
        let path_is_empty = matches!(uri.path(), "" | "/") && uri.query().is_none();
        let authority = uri
            .authority()
            .filter(|a| !a.host().is_empty() && path_is_empty)
            .ok_or_else(|| AddrError::Syntax(s.to_owned()))?;
        let port = authority.port_u16().unwrap_or(80);
        let host = authority.host();
        Ok(Self {
            authority: format!("{host}:{port}"),
        })
    }
}

/// An identity given on the command line: a number, not 0.
pub(crate) fn parse_identity(input: &str) -> Result<u32, CliError> {
    input
        .trim()
        .parse::<u32>()
        .ok()
        .filter(|&id| id != 0)
        .ok_or_else(|| CliError::IdentityArg {
            input: input.to_owned(),
        })
}

pub(crate) fn parse_ip(input: &str) -> Result<IpAddr, CliError> {
    input.trim().parse().map_err(|_| CliError::Address {
        input: input.to_owned(),
    })
}

pub(crate) fn parse_node(input: &str) -> Result<NodeName, CliError> {
    NodeName::new(input).map_err(|source| CliError::NodeName { source })
}

/// Generous: the operator applies its own limit.
const MAX_LABELS: LabelLimits = LabelLimits { max_labels: 4096 };

/// Labels given as arguments, each argument one label or several separated by commas
/// (a label never contains a comma): validated, sorted, deduplicated.
pub(crate) fn parse_labels(inputs: &[String]) -> Result<Vec<String>, CliError> {
    let labels = split_labels(inputs);
    let set = LabelSet::parse(&labels, &MAX_LABELS).map_err(|source| CliError::Labels {
        input: inputs.join(","),
        source,
    })?;
    Ok(set.to_strings())
}

/// A selector (`k8s:app=web,k8s:tier=db`): each label validated on its own.
pub(crate) fn parse_selector(inputs: &[String]) -> Result<Vec<String>, CliError> {
    let labels = split_labels(inputs);
    for label in &labels {
        Label::parse(label).map_err(|source| CliError::Labels {
            input: inputs.join(","),
            source,
        })?;
    }
    Ok(labels)
}

fn split_labels(inputs: &[String]) -> Vec<String> {
    inputs
        .iter()
        .flat_map(|input| input.split(','))
        .map(str::trim)
        .filter(|label| !label.is_empty())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_take_a_scheme_or_not() -> Result<(), AddrError> {
        for (input, want) in [
            ("http://127.0.0.1:9460", "http://127.0.0.1:9460"),
            ("http://127.0.0.1:9460/", "http://127.0.0.1:9460"),
            ("127.0.0.1:9462", "http://127.0.0.1:9462"),
            ("operator.census:80", "http://operator.census:80"),
            ("localhost", "http://localhost:80"),
            ("[::1]:9460", "http://[::1]:9460"),
        ] {
            assert_eq!(input.parse::<ServerAddr>()?.to_string(), want, "{input}");
        }
        assert_eq!(
            "https://x:1".parse::<ServerAddr>(),
            Err(AddrError::Scheme("https://x:1".into()))
        );
        for bad in ["", "http://", "http://x:1/path", "a b"] {
            assert!(bad.parse::<ServerAddr>().is_err(), "{bad:?}");
        }
        Ok(())
    }

    #[test]
    fn identities_are_positive_numbers() {
        assert_eq!(parse_identity("4711").ok(), Some(4711));
        for bad in ["0", "-1", "x", "4294967296", ""] {
            assert!(
                matches!(parse_identity(bad), Err(CliError::IdentityArg { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn labels_are_split_validated_and_sorted() -> Result<(), CliError> {
        let labels = parse_labels(&["k8s:b=2,k8s:a=1".into(), "k8s:a=1".into()])?;
        assert_eq!(labels, ["k8s:a=1", "k8s:b=2"]);
        for bad in ["k8s:-x=y", "app=web", "k8s:a=1,k8s:a=2", ","] {
            assert!(
                matches!(parse_labels(&[bad.into()]), Err(CliError::Labels { .. })),
                "{bad:?}"
            );
        }
        assert!(parse_selector(&["k8s:app=web".into()]).is_ok());
        assert!(matches!(
            parse_selector(&["k8s:app".into()]),
            Err(CliError::Labels { .. })
        ));
        Ok(())
    }
}
