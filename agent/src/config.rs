//! census-agent's command line. Every flag has a `CENSUS_*` environment variable.

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    str::FromStr,
    time::Duration,
};

use census_proto::domain::NodeName;
use clap::{Args, Parser, Subcommand, ValueEnum};

use census_common::{
    ENDPOINTS_MAX_ENTRIES, FLOWS_MAX_ENTRIES, NODES_MAX_ENTRIES, SERVICE_FLOWS_MAX_ENTRIES,
};

use crate::bpf::{AttachModeChoice, DEFAULT_PIN_DIR, DatapathLog, MarkBit};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "census-agent",
    version,
    about = "census's node agent: endpoints -> identities -> pinned BPF maps, and traffic per identity pair",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub agent: AgentArgs,
}

#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Detach census's programs from every interface and remove its pins (maps and
    /// links). Idempotent; says what it removed.
    Uninstall(UninstallArgs),
}

#[derive(Debug, Clone, Args)]
pub struct UninstallArgs {
    /// Where census pinned its maps and links.
    #[arg(long, env = "CENSUS_PIN_DIR", default_value = DEFAULT_PIN_DIR)]
    pub pin_dir: PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct AgentArgs {
    /// This node's name, as the operator knows it [default: the host name].
    #[arg(long, env = "CENSUS_NODE_NAME")]
    pub node_name: Option<NodeName>,
    /// The operator's gRPC address.
    #[arg(long, env = "CENSUS_OPERATOR", default_value = "http://127.0.0.1:9460")]
    pub operator: OperatorAddress,
    #[command(flatten)]
    pub operator_tls: OperatorTlsArgs,
    /// Where the maps and links are pinned (on a BPF file system).
    #[arg(long, env = "CENSUS_PIN_DIR", default_value = DEFAULT_PIN_DIR)]
    pub pin_dir: PathBuf,
    #[command(flatten)]
    pub datapath: DatapathArgs,
    /// Address of the admin HTTP server (/v1/... for the `census` CLI on this node,
    /// /metrics, /healthz, /readyz, /debug/pprof/heap). Unauthenticated, so on
    /// loopback by default.
    #[arg(long, env = "CENSUS_ADMIN_LISTEN", default_value = "127.0.0.1:9462")]
    pub admin_listen: SocketAddr,
    /// Address of a second listener with only /healthz, /readyz and /metrics, for
    /// the kubelet's probes and Prometheus (the DaemonSet: 0.0.0.0:9463) [default:
    /// none].
    #[arg(long, env = "CENSUS_HEALTH_LISTEN")]
    pub health_listen: Option<SocketAddr>,
    /// Each admin listener's connection cap and timeouts (both are unauthenticated).
    #[command(flatten)]
    pub admin_limits: census_daemon::http::AdminLimits,
    #[command(flatten)]
    pub source: SourceArgs,
    /// How often a full pass compares the maps and links with the desired state and
    /// repairs them (the endpoints file is re-read as often, as a safety net).
    #[arg(long, env = "CENSUS_RECONCILE_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub reconcile_interval: Duration,
    /// The longest wait between two attempts to reach the operator (they back off
    /// exponentially, jittered, up to this).
    #[arg(long, env = "CENSUS_RECONNECT_MAX_BACKOFF", default_value = "30s", value_parser = humantime::parse_duration)]
    pub reconnect_max_backoff: Duration,
    /// Do not watch the operator's cluster-wide endpoint map: ENDPOINTS holds this
    /// node's endpoints and addresses only (remote entries a previous run wrote are
    /// removed), so traffic with other nodes' pods counts as `world`.
    #[arg(long, env = "CENSUS_NO_ENDPOINT_MAP")]
    pub no_endpoint_map: bool,
    /// Test only, never for production: do not tell the operator that an endpoint
    /// went away (no Delete delta is sent; the snapshots still say it), so
    /// benchmarks can show the operator's snapshot truth repairing every lost pod
    /// delete (`cargo xtask bench seed-leak`). Hidden from `--help`.
    #[arg(long, env = "CENSUS_TEST_DROP_ENDPOINT_DELETES", hide = true)]
    pub test_drop_endpoint_deletes: bool,
    #[command(flatten)]
    pub log: census_daemon::LogArgs,
    #[command(flatten)]
    pub profiling: census_daemon::ProfilingArgs,
}

/// TLS to the operator (docs/security.md, "Mutual TLS"): with `--tls-ca` the
/// connection is TLS; with `--tls-cert` and `--tls-key` too, mutual TLS as the node
/// the certificate names (`node-NAME.pem` of `census-operator certs`).
#[derive(Debug, Clone, Default, Args)]
pub struct OperatorTlsArgs {
    /// The CA of the operator's serving certificate (PEM): connect over TLS.
    #[arg(long, env = "CENSUS_TLS_CA", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// This node's client certificate (PEM), for mutual TLS.
    #[arg(long, env = "CENSUS_TLS_CERT", value_name = "PEM", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(
        long,
        env = "CENSUS_TLS_KEY",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// A file whose token every call to the operator carries as `authorization:
    /// Bearer TOKEN` (in a cluster: the projected ServiceAccount token, audience
    /// `census`); read again whenever the file changes.
    #[arg(long, env = "CENSUS_TOKEN_FILE", value_name = "PATH")]
    pub token_file: Option<PathBuf>,
}

impl OperatorTlsArgs {
    pub fn files(&self) -> crate::client::TlsFiles {
        crate::client::TlsFiles {
            ca: self.tls_ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
        }
    }

    /// The operator's TLS and token, checked (the files read) now.
    pub fn auth(&self) -> Result<crate::client::OperatorAuth, crate::client::ClientTlsError> {
        crate::client::AccessFiles {
            tls: self.files(),
            token_file: self.token_file.clone(),
        }
        .auth()
    }
}

/// How the datapath is loaded and attached.
#[derive(Debug, Clone, Args)]
pub struct DatapathArgs {
    /// How the classifier attaches to interfaces: `tcx` links (Linux 6.6+), `tc`
    /// filters on a clsact qdisc (any supported kernel), or `auto`: TCX where a
    /// probe finds it, else TC.
    #[arg(long, env = "CENSUS_ATTACH_MODE", value_enum, default_value_t = AttachModeArg::Auto)]
    pub attach_mode: AttachModeArg,
    /// FLOWS' entries (identity pairs) when the map is created; a pinned FLOWS keeps
    /// its size (and its counters) until `census-agent uninstall`.
    #[arg(long, env = "CENSUS_FLOWS_MAX_ENTRIES", default_value_t = FLOWS_MAX_ENTRIES, value_parser = clap::value_parser!(u32).range(1..=16_777_216))]
    pub flows_max_entries: u32,
    /// Entries of each family's Service counters, SERVICE_FLOWS4 and SERVICE_FLOWS6
    /// ((client, Service address, port, protocol, direction), least recently used
    /// evicted first) when the maps are created; pinned maps keep their size (and
    /// their counters).
    #[arg(long, env = "CENSUS_SERVICE_FLOWS_MAX_ENTRIES", default_value_t = SERVICE_FLOWS_MAX_ENTRIES, value_parser = clap::value_parser!(u32).range(1..=16_777_216))]
    pub service_flows_max_entries: u32,
    /// Entries of SERVICE_FLOWS6 alone when it is created, where the IPv6 Service
    /// counters should differ from `--service-flows-max-entries` (an IPv4-only
    /// cluster: 1, where the default's kernel memory is 1.9 MiB on 2 CPUs and 17
    /// MiB on 64, an LRU map being allocated whole); a pinned map keeps its size.
    #[arg(long, env = "CENSUS_SERVICE_FLOWS6_MAX_ENTRIES", value_parser = clap::value_parser!(u32).range(1..=16_777_216))]
    pub service_flows6_max_entries: Option<u32>,
    /// ENDPOINTS' entries (every endpoint of the cluster, local and remote, and
    /// every node address) when the map is created; not preallocated, so an entry
    /// costs kernel memory only once written. A pinned ENDPOINTS keeps its size.
    #[arg(long, env = "CENSUS_ENDPOINTS_MAX_ENTRIES", default_value_t = ENDPOINTS_MAX_ENTRIES, value_parser = clap::value_parser!(u32).range(1..=16_777_216))]
    pub endpoints_max_entries: u32,
    /// NODES' entries (the nodes remote endpoints are on) when the map is created;
    /// not preallocated. A pinned NODES keeps its size.
    #[arg(long, env = "CENSUS_NODES_MAX_ENTRIES", default_value_t = NODES_MAX_ENTRIES, value_parser = clap::value_parser!(u32).range(1..=65_535))]
    pub nodes_max_entries: u32,
    /// Attach the classifier again, first, when another program is found in front
    /// of it (off: it is reported only; two programs that both insist on being
    /// first would take turns).
    #[arg(long, env = "CENSUS_REASSERT_ORDER")]
    pub reassert_order: bool,
    /// The datapath's own log (aya-log), forwarded as `tracing` events of target
    /// `census_datapath`: FLOWS inserts refused (`warn`), frames too short to read
    /// (`info`), LOCAL endpoints counted by address (`debug`). Rate-limited in the
    /// kernel; `off` costs the programs nothing. `--log` must let the level through
    /// (`--log info,census_datapath=debug`).
    #[arg(long, env = "CENSUS_DATAPATH_LOG", value_enum, default_value_t = DatapathLog::Off)]
    pub datapath_log: DatapathLog,
    /// The node's own addresses (repeat the flag, or a comma-separated list; the
    /// DaemonSet passes the downward API's `status.hostIPs`): census never attaches
    /// to a device holding one. A device a default route leaves by is refused
    /// without it.
    #[arg(long = "node-ip", env = "CENSUS_NODE_IPS", value_delimiter = ',')]
    pub node_ips: Vec<IpAddr>,
    /// census's bit of `skb->mark` (one bit, hexadecimal or decimal): set on a packet
    /// an endpoint sends to a Service address, cleared where it is counted,
    /// translated. The default is a bit kube-proxy, Cilium, Calico, Istio and the AWS
    /// VPC CNI leave alone.
    #[arg(long, env = "CENSUS_MARK_BIT", default_value_t = MarkBit::default())]
    pub mark_bit: MarkBit,
    /// The devices Service requests leave the node by, translated, where census
    /// counts those whose backend is on another node (repeat the flag, or a
    /// comma-separated list). Default: every device a default route leaves by and
    /// every VXLAN or Geneve device.
    #[arg(long = "uplink", env = "CENSUS_UPLINKS", value_delimiter = ',')]
    pub uplinks: Vec<String>,
    /// The root of the node's cgroup v2 hierarchy, where census counts what the
    /// node's own sockets send to pods. Default: `/sys/fs/cgroup`, or
    /// `/sys/fs/cgroup/unified` in the hybrid layout. In a pod, the host's,
    /// mounted in (the DaemonSet mounts it at `/run/census/cgroup`).
    #[arg(long, env = "CENSUS_CGROUP_ROOT")]
    pub cgroup_root: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AttachModeArg {
    Auto,
    Tcx,
    Tc,
}

impl From<AttachModeArg> for AttachModeChoice {
    fn from(arg: AttachModeArg) -> Self {
        match arg {
            AttachModeArg::Auto => Self::Auto,
            AttachModeArg::Tcx => Self::Tcx,
            AttachModeArg::Tc => Self::Tc,
        }
    }
}

/// Where endpoints come from.
#[derive(Debug, Clone, Args)]
pub struct SourceArgs {
    /// The endpoint source [default: `file` when --endpoints-file is given, else
    /// `kubernetes`].
    #[arg(long, env = "CENSUS_ENDPOINT_SOURCE", value_enum)]
    pub endpoint_source: Option<SourceKind>,
    /// A JSON (.json) or YAML (.yaml, .yml) list of endpoints, re-read when it changes.
    #[arg(long, env = "CENSUS_ENDPOINTS_FILE")]
    pub endpoints_file: Option<PathBuf>,
    /// The kubeconfig of the Kubernetes pod source [default: the pod's service
    /// account in a cluster, else $KUBECONFIG or ~/.kube/config].
    #[arg(long, env = "CENSUS_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SourceKind {
    /// The pods of this node (`spec.nodeName` = --node-name), from the API server.
    Kubernetes,
    /// The endpoints file (--endpoints-file).
    File,
}

/// The endpoint source the flags name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceChoice {
    File(PathBuf),
    Kubernetes { kubeconfig: Option<PathBuf> },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceArgsError {
    #[error("--endpoint-source file needs --endpoints-file FILE (or CENSUS_ENDPOINTS_FILE)")]
    NoFile,
    #[error("--endpoints-file is for --endpoint-source file, not kubernetes")]
    FileWithKubernetes,
    #[error("--kubeconfig is for --endpoint-source kubernetes, not file")]
    KubeconfigWithFile,
}

impl SourceArgs {
    pub fn choose(&self) -> Result<SourceChoice, SourceArgsError> {
        let Self {
            endpoint_source,
            endpoints_file,
            kubeconfig,
        } = self;
        let kind = endpoint_source.unwrap_or(if endpoints_file.is_some() {
            SourceKind::File
        } else {
            SourceKind::Kubernetes
        });
        match (kind, endpoints_file, kubeconfig) {
            (SourceKind::File, _, Some(_)) => Err(SourceArgsError::KubeconfigWithFile),
            (SourceKind::File, Some(file), None) => Ok(SourceChoice::File(file.clone())),
            (SourceKind::File, None, None) => Err(SourceArgsError::NoFile),
            (SourceKind::Kubernetes, Some(_), _) => Err(SourceArgsError::FileWithKubernetes),
            (SourceKind::Kubernetes, None, kubeconfig) => Ok(SourceChoice::Kubernetes {
                kubeconfig: kubeconfig.clone(),
            }),
        }
    }
}

/// The operator's gRPC URI; `host:port` means `http://host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperatorAddress(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("operator address {address:?}: {reason}")]
pub struct AddressError {
    address: String,
    reason: String,
}

impl OperatorAddress {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for OperatorAddress {
    type Err = AddressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let full = if s.contains("://") {
            s.to_owned()
        } else {
            format!("http://{s}")
        };
        let error = |reason: String| AddressError {
            address: s.to_owned(),
            reason,
        };
        let uri: http::Uri = full
            .parse()
            .map_err(|e: http::uri::InvalidUri| error(e.to_string()))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(error(format!(
                    "scheme {other:?} is not supported (use http://)"
                )));
            }
            None => return Err(error("no scheme".to_owned())),
        }
        if uri.host().is_none_or(str::is_empty) {
            return Err(error("no host".to_owned()));
        }
        Ok(Self(full.trim_end_matches('/').to_owned()))
    }
}

impl fmt::Display for OperatorAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn defaults() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from(["census-agent", "--endpoints-file", "/e.yaml"])?;
        assert!(cli.command.is_none());
        assert_eq!(cli.agent.pin_dir, PathBuf::from("/sys/fs/bpf/census"));
        assert_eq!(
            cli.agent.admin_listen,
            SocketAddr::from(([127, 0, 0, 1], 9462))
        );
        assert_eq!(cli.agent.health_listen, None);
        assert_eq!(cli.agent.operator.as_str(), "http://127.0.0.1:9460");
        assert_eq!(cli.agent.reconcile_interval, Duration::from_secs(10));
        assert_eq!(cli.agent.datapath.attach_mode, AttachModeArg::Auto);
        assert_eq!(cli.agent.datapath.flows_max_entries, 65_536);
        assert_eq!(cli.agent.datapath.endpoints_max_entries, 524_288);
        assert_eq!(cli.agent.datapath.nodes_max_entries, 65_535);
        assert!(!cli.agent.datapath.reassert_order);
        assert!(
            !cli.agent.no_endpoint_map,
            "the endpoint map is watched by default"
        );
        let cli = Cli::try_parse_from(["census-agent", "--no-endpoint-map"])?;
        assert!(cli.agent.no_endpoint_map);
        Ok(())
    }

    #[test]
    fn datapath_flags() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from([
            "census-agent",
            "--attach-mode",
            "tc",
            "--flows-max-entries",
            "1024",
            "--endpoints-max-entries",
            "600000",
            "--nodes-max-entries",
            "5000",
            "--reassert-order",
            "--node-ip",
            "198.19.80.1,2001:db8::1",
            "--node-ip",
            "198.19.80.2",
        ])?;
        let expected: [IpAddr; 3] = [
            [198, 19, 80, 1].into(),
            IpAddr::V6(std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1)),
            [198, 19, 80, 2].into(),
        ];
        assert_eq!(cli.agent.datapath.node_ips, expected);
        assert_eq!(cli.agent.datapath.attach_mode, AttachModeArg::Tc);
        assert_eq!(cli.agent.datapath.flows_max_entries, 1024);
        assert_eq!(cli.agent.datapath.endpoints_max_entries, 600_000);
        assert_eq!(cli.agent.datapath.nodes_max_entries, 5000);
        assert!(cli.agent.datapath.reassert_order);
        for bad in [
            ["--attach-mode", "xdp"],
            ["--flows-max-entries", "0"],
            ["--endpoints-max-entries", "0"],
            ["--nodes-max-entries", "0"],
            ["--nodes-max-entries", "65536"],
            ["--node-ip", "198.19.80"],
        ] {
            assert!(Cli::try_parse_from([&["census-agent"][..], &bad[..]].concat()).is_err());
        }
        Ok(())
    }

    #[test]
    fn the_ipv6_service_counters_take_their_own_size_only_when_asked() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from(["census-agent", "--service-flows-max-entries", "2048"])?;
        assert_eq!(cli.agent.datapath.service_flows_max_entries, 2048);
        assert_eq!(cli.agent.datapath.service_flows6_max_entries, None);
        let cli = Cli::try_parse_from(["census-agent", "--service-flows6-max-entries", "1"])?;
        assert_eq!(cli.agent.datapath.service_flows6_max_entries, Some(1));
        for bad in ["0", "16777217", "many"] {
            let error = Cli::try_parse_from(["census-agent", "--service-flows6-max-entries", bad])
                .err()
                .map(|error| error.to_string())
                .unwrap_or_default();
            assert!(
                error.contains("--service-flows6-max-entries") && error.contains(bad),
                "{bad}: {error}"
            );
        }
        Ok(())
    }

    #[test]
    fn uninstall_is_a_subcommand() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from(["census-agent", "uninstall", "--pin-dir", "/sys/fs/bpf/x"])?;
        let Some(Command::Uninstall(args)) = cli.command else {
            return Err(clap::Error::new(clap::error::ErrorKind::InvalidSubcommand));
        };
        assert_eq!(args.pin_dir, PathBuf::from("/sys/fs/bpf/x"));
        Ok(())
    }

    #[test]
    fn operator_addresses() {
        let parse = |s: &str| {
            s.parse::<OperatorAddress>()
                .map(|a| a.0)
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            parse("10.0.0.1:9460"),
            Ok("http://10.0.0.1:9460".to_owned())
        );
        assert_eq!(
            parse("http://op.census:9460/"),
            Ok("http://op.census:9460".to_owned())
        );
        assert!(parse("https://x:1").is_err_and(|e| e.contains("not supported")));
        assert!(parse("http://").is_err());
    }

    #[test]
    fn the_endpoint_source_follows_the_flags() -> Result<(), clap::Error> {
        let choose = |args: &[&str]| {
            Cli::try_parse_from([&["census-agent"], args].concat())
                .map(|cli| cli.agent.source.choose().map_err(|e| e.to_string()))
        };
        assert_eq!(
            choose(&["--endpoints-file", "/e.yaml"])?,
            Ok(SourceChoice::File("/e.yaml".into()))
        );
        assert_eq!(
            choose(&[])?,
            Ok(SourceChoice::Kubernetes { kubeconfig: None })
        );
        assert_eq!(
            choose(&["--endpoint-source", "kubernetes", "--kubeconfig", "/k"])?,
            Ok(SourceChoice::Kubernetes {
                kubeconfig: Some("/k".into())
            })
        );
        assert!(
            choose(&["--endpoint-source", "file"])?
                .is_err_and(|e| e.contains("needs --endpoints-file"))
        );
        assert!(
            choose(&[
                "--endpoint-source",
                "kubernetes",
                "--endpoints-file",
                "/e.yaml"
            ])?
            .is_err_and(|e| e.contains("not kubernetes"))
        );
        assert!(
            choose(&["--endpoints-file", "/e.yaml", "--kubeconfig", "/k"])?
                .is_err_and(|e| e.contains("not file"))
        );
        Ok(())
    }

    #[test]
    fn bad_node_names_are_refused() {
        let err = Cli::try_parse_from(["census-agent", "--node-name", "Node_1"])
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("is not a DNS subdomain")));
    }
}
