//! The operator's command line. Every flag has a `CENSUS_*` environment variable;
//! related flags are grouped and flattened.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use census_proto::{
    convert::WireLimits,
    domain::IdRange,
    labels::{KeyPattern, LabelFilter, LabelLimits},
};
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::allocator::{self, Liveness};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "census-operator",
    version,
    about = "census's identity allocator"
)]
pub struct Cli {
    #[command(flatten)]
    pub listen: ListenArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub allocator: AllocatorArgs,
    #[command(flatten)]
    pub labels: LabelArgs,
    #[command(flatten)]
    pub limits: LimitArgs,
    #[command(flatten)]
    pub map: MapArgs,
    #[command(flatten)]
    pub services: ServiceArgs,
    #[command(flatten)]
    pub log: census_daemon::LogArgs,
    #[command(flatten)]
    pub profiling: census_daemon::ProfilingArgs,
    #[command(flatten)]
    pub kubernetes: KubernetesArgs,
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// Commands besides running the operator (the default).
#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Write the Identity CustomResourceDefinition (YAML) to a file, or to stdout.
    Crdgen {
        /// The file to write (e.g. deploy/crds/identity.yaml); stdout if not given.
        #[arg(long, short)]
        out: Option<PathBuf>,
    },
    /// Write a CA, the operator's serving certificate and nodes' client
    /// certificates (PEM) for mutual TLS; an existing CA in the directory signs.
    Certs(crate::certs::CertsArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ListenArgs {
    /// Address of the gRPC server (IdentityService, EndpointSync, NodeService, health,
    /// reflection). Without TLS only a loopback address is accepted [default:
    /// 0.0.0.0:9460 with --tls-cert, 127.0.0.1:9460 without].
    #[arg(long, env = "CENSUS_GRPC_LISTEN")]
    pub grpc_listen: Option<SocketAddr>,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Address of the admin HTTP server (/metrics, /healthz, /readyz).
    #[arg(long, env = "CENSUS_ADMIN_LISTEN", default_value = "0.0.0.0:9461")]
    pub admin_listen: SocketAddr,
    /// The admin server's connection cap and timeouts (it is unauthenticated).
    #[command(flatten)]
    pub admin: census_daemon::http::AdminLimits,
    /// How often the gRPC server pings each HTTP/2 connection. A connection whose
    /// peer does not answer within --keepalive-timeout is closed, so a crashed
    /// agent's stream ends and its restarted agent can take over, whatever its clock.
    #[arg(long, env = "CENSUS_KEEPALIVE_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub keepalive_interval: Duration,
    /// How long an HTTP/2 ping may go unanswered before the connection is closed.
    #[arg(long, env = "CENSUS_KEEPALIVE_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    pub keepalive_timeout: Duration,
    /// gRPC connections open at once (one per agent, plus CLIs and tools); one more
    /// is closed as it is accepted, counted and logged.
    #[arg(long, env = "CENSUS_MAX_CONNECTIONS", default_value_t = 8192, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,
    /// Concurrent calls (HTTP/2 streams) on one gRPC connection.
    #[arg(long, env = "CENSUS_MAX_STREAMS_PER_CONNECTION", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams_per_connection: u32,
    /// Bytes of one call's headers (metadata) at most, as HTTP/2 counts them.
    #[arg(long, env = "CENSUS_MAX_HEADER_LIST_BYTES", default_value_t = 16384, value_parser = clap::value_parser!(u32).range(1024..))]
    pub max_header_list_bytes: u32,
    /// How long a new gRPC connection may take to send the HTTP/2 preface (with TLS:
    /// the TLS handshake) before it is closed.
    #[arg(long, env = "CENSUS_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = timeout)]
    pub handshake_timeout: Duration,
    /// How long a gRPC connection may stay without an open call before it is closed
    /// (an agent always holds its stream; a client reconnects when it needs to).
    #[arg(long, env = "CENSUS_IDLE_TIMEOUT", default_value = "5m", value_parser = timeout)]
    pub idle_timeout: Duration,
    /// How long one request message may take to arrive in full, from its first byte
    /// (a unary call's: from the start of the call); a call whose message is late
    /// ends with DEADLINE_EXCEEDED.
    #[arg(long, env = "CENSUS_MESSAGE_TIMEOUT", default_value = "60s", value_parser = timeout)]
    pub message_timeout: Duration,
    /// EndpointSync streams one node may have open at once (its current one, and
    /// ones a restarted agent left behind until keepalive ends them); one more is
    /// refused with RESOURCE_EXHAUSTED.
    #[arg(long, env = "CENSUS_MAX_STREAMS_PER_NODE", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_streams_per_node: u32,
    /// Watches (EndpointMap.Watch, IdentityService.Watch) one caller may have open at
    /// once: a node by its credentials, a reader by its name.
    #[arg(long, env = "CENSUS_MAX_WATCHES_PER_CALLER", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_watches_per_caller: u32,
    /// Watches open at once from every caller together.
    #[arg(long, env = "CENSUS_MAX_WATCHES", default_value_t = 16_384, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_watches: u32,
    /// Bytes of large messages (over the request limit: snapshots) received at once
    /// by all streams together. A message reserves its declared length before it is
    /// buffered and waits for room (within --message-timeout); at least the message
    /// limit (--max-snapshot-endpoints x 4096 bytes).
    #[arg(long, env = "CENSUS_MAX_INFLIGHT_MESSAGE_BYTES", default_value_t = 128 * 1024 * 1024)]
    pub max_inflight_message_bytes: u64,
}

/// A timeout of the gRPC transport: above zero (a zero timeout would close every
/// connection or call at once).
fn timeout(text: &str) -> Result<Duration, String> {
    let timeout = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if timeout.is_zero() {
        return Err("must be above zero".to_owned());
    }
    Ok(timeout)
}

/// TLS of the gRPC server (docs/security.md, "Mutual TLS"). With `--client-ca`,
/// every caller needs a client certificate of that CA (`census-operator certs`),
/// which names its node or makes it a reader.
#[derive(Debug, Clone, Default, Args)]
pub struct TlsArgs {
    /// The serving certificate (PEM, its chain after it), e.g. `server.pem` of
    /// `census-operator certs`.
    #[arg(
        long,
        env = "CENSUS_TLS_CERT",
        value_name = "PEM",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The serving certificate's private key (PEM).
    #[arg(
        long,
        env = "CENSUS_TLS_KEY",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// The CA of clients' certificates (PEM, e.g. `ca.pem`): mutual TLS, the node
    /// taken from the certificate. Needs --tls-cert and --tls-key.
    #[arg(
        long,
        env = "CENSUS_CLIENT_CA",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub client_ca: Option<PathBuf>,
    /// The CA that signed the serving certificate (PEM); followers verify the leader
    /// with it when they forward, by the serving certificate's first DNS name. With
    /// --store kubernetes and bearer tokens (no --client-ca).
    #[arg(long, env = "CENSUS_TLS_CA", value_name = "PEM", requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// An embedded redb file (no cluster needed).
    Redb,
    /// Identity objects in the cluster; replicas elect a leader on a Lease.
    Kubernetes,
}

#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    #[arg(
        long = "store",
        env = "CENSUS_STORE",
        value_enum,
        default_value = "redb"
    )]
    pub kind: StoreKind,
    /// The redb file.
    #[arg(
        long,
        env = "CENSUS_STORE_PATH",
        default_value = "/var/lib/census/census.redb"
    )]
    pub store_path: PathBuf,
    /// Bytes of redb's page cache.
    #[arg(long, env = "CENSUS_STORE_CACHE_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub store_cache_bytes: usize,
    /// How long one batch of store writes may take before it counts as failed.
    #[arg(long, env = "CENSUS_STORE_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub store_timeout: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct AllocatorArgs {
    /// Cluster-local identities, FIRST-LAST (1-255 are reserved).
    #[arg(long, env = "CENSUS_ID_RANGE", default_value = "256-65535")]
    pub id_range: IdRange,
    /// Base interval of agents' snapshots (they jitter it by +-10%).
    #[arg(long, env = "CENSUS_SNAPSHOT_INTERVAL", default_value = "30s", value_parser = humantime::parse_duration)]
    pub snapshot_interval: Duration,
    /// Silence after which a node's view is dropped [default: 3 snapshot intervals].
    #[arg(long, env = "CENSUS_NODE_TTL", value_parser = humantime::parse_duration)]
    pub node_ttl: Option<Duration>,
    /// How long an allocated identity is held for its node before it shows in the node's
    /// view [default: the node TTL; never less].
    #[arg(long, env = "CENSUS_HOLD_TIMEOUT", value_parser = humantime::parse_duration)]
    pub hold_timeout: Option<Duration>,
    /// How long an unreferenced identity is kept before it is deleted.
    #[arg(long, env = "CENSUS_GRACE_PERIOD", default_value = "60s", value_parser = humantime::parse_duration)]
    pub grace_period: Duration,
    /// How long a deleted id is not bound to another label set.
    #[arg(long, env = "CENSUS_QUARANTINE", default_value = "10m", value_parser = humantime::parse_duration)]
    pub quarantine: Duration,
    /// When the store is empty at start, no new id is handed out for this long, so agents
    /// re-report theirs first [default: the node TTL].
    #[arg(long, env = "CENSUS_ADOPTION_WINDOW", value_parser = humantime::parse_duration)]
    pub adoption_window: Option<Duration>,
    /// Identities a node may hold (allocated, not yet in its view) at once.
    #[arg(long, env = "CENSUS_MAX_HOLDS_PER_NODE", default_value_t = 1024)]
    pub max_holds_per_node: usize,
    /// Store deletes per second spent by garbage collection.
    #[arg(long, env = "CENSUS_GC_RATE", default_value_t = 100.0)]
    pub gc_rate: f64,
    /// How often time-driven work runs (holds, liveness, GC).
    #[arg(long, env = "CENSUS_TICK_INTERVAL", default_value = "250ms", value_parser = period)]
    pub tick_interval: Duration,
    /// In a cluster: how long a node may stay stale (silent past the node TTL) before its
    /// view is dropped anyway, a last resort for an agent gone for good. A deleted Node
    /// is dropped at once.
    #[arg(long, env = "CENSUS_STALE_VIEW_LIMIT", default_value = "1h", value_parser = humantime::parse_duration)]
    pub stale_view_limit: Duration,
}

/// `--store kubernetes`: the cluster, leader election and this replica's pod.
#[derive(Debug, Clone, Args)]
pub struct KubernetesArgs {
    /// A kubeconfig file [default: the in-cluster service account, else $KUBECONFIG or
    /// ~/.kube/config].
    #[arg(long, env = "CENSUS_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Namespace of the Lease, of this replica's pod and of its Events [default: the
    /// service account's (in-cluster) or the kubeconfig context's].
    #[arg(long, env = "CENSUS_NAMESPACE")]
    pub namespace: Option<String>,
    /// The Lease replicas elect the leader on.
    #[arg(long, env = "CENSUS_LEASE_NAME", default_value = "census-operator")]
    pub lease_name: String,
    /// How long a Lease stays valid after its last renewal (whole seconds in the Lease).
    #[arg(long, env = "CENSUS_LEASE_DURATION", default_value = "15s", value_parser = humantime::parse_duration)]
    pub lease_duration: Duration,
    /// A leader that has not renewed for this long stops writing (below the duration).
    #[arg(long, env = "CENSUS_LEASE_RENEW_DEADLINE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub lease_renew_deadline: Duration,
    /// How often followers try the Lease and the leader renews it.
    #[arg(long, env = "CENSUS_LEASE_RETRY_PERIOD", default_value = "2s", value_parser = humantime::parse_duration)]
    pub lease_retry_period: Duration,
    /// This replica's pod (downward API `metadata.name`): its identity in the Lease, and
    /// the target of its endpoint in the leader Service's EndpointSlice while it leads
    /// [default: $HOSTNAME].
    #[arg(long, env = "CENSUS_POD_NAME")]
    pub pod_name: Option<String>,
    /// This replica's pod IP (downward API `status.podIP`): the leader publishes
    /// `IP:gRPC port` in the Lease (followers name it when they refuse a write) and in
    /// the EndpointSlice of the `census-operator-leader` Service (agents reach it there).
    #[arg(long, env = "CENSUS_POD_IP")]
    pub pod_ip: Option<IpAddr>,
    /// The agents' ServiceAccount, `NAMESPACE/NAME` (deploy/'s DaemonSet runs as
    /// `census-agent/census-agent`): the only account whose tokens bind agents'
    /// streams to their nodes.
    #[arg(
        long,
        env = "CENSUS_AGENT_SERVICE_ACCOUNT",
        value_name = "NAMESPACE/NAME",
        default_value = "census-agent/census-agent"
    )]
    pub agent_service_account: ServiceAccountRef,
    /// The audience agents' projected ServiceAccount tokens are requested for; a
    /// TokenReview accepts a token only for it.
    #[arg(long, env = "CENSUS_TOKEN_AUDIENCE", default_value = "census", value_parser = audience)]
    pub token_audience: String,
    /// Accept an agent's Hello only from one of its Node's addresses, on top of its
    /// credentials. Off by default: kube-proxy masquerading, IPVS and overlay CNIs
    /// (flannel VXLAN, Calico IPIP/VXLAN, Cilium tunnels) source agents' traffic from
    /// other addresses; the credentials are what bind a stream to its node.
    #[arg(long, env = "CENSUS_REQUIRE_NODE_ADDRESS")]
    pub require_node_address: bool,
}

/// A token audience: not empty, no spaces or control characters (it goes into every
/// TokenReview, and the API server compares it byte for byte).
fn audience(text: &str) -> Result<String, String> {
    if text.is_empty()
        || text.len() > 253
        || text.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err("an audience is 1-253 characters without spaces (e.g. census)".to_owned());
    }
    Ok(text.to_owned())
}

/// A ServiceAccount, `NAMESPACE/NAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAccountRef {
    pub namespace: String,
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ServiceAccountError {
    #[error("{0:?} is not NAMESPACE/NAME (e.g. census-agent/census-agent)")]
    Shape(String),
    #[error(
        "namespace {0:?}: a namespace is a DNS label (at most 63 lowercase letters, digits and '-', starting and ending with a letter or digit)"
    )]
    Namespace(String),
    #[error(
        "ServiceAccount name {0:?}: a ServiceAccount name is a DNS subdomain (at most 253 lowercase letters, digits, '-' and '.', each part starting and ending with a letter or digit)"
    )]
    Name(String),
}

/// An RFC 1123 label: what Kubernetes accepts as a namespace.
fn is_dns_label(s: &str) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// An RFC 1123 subdomain: what Kubernetes accepts as a ServiceAccount name.
fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

impl std::str::FromStr for ServiceAccountRef {
    type Err = ServiceAccountError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let Some((namespace, name)) = s.split_once('/') else {
            return Err(ServiceAccountError::Shape(s.to_owned()));
        };
        if namespace.is_empty() || name.is_empty() || name.contains('/') {
            return Err(ServiceAccountError::Shape(s.to_owned()));
        }
        if !is_dns_label(namespace) {
            return Err(ServiceAccountError::Namespace(namespace.to_owned()));
        }
        if !is_dns_subdomain(name) {
            return Err(ServiceAccountError::Name(name.to_owned()));
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl std::fmt::Display for ServiceAccountRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl ServiceAccountRef {
    /// The user name the API server gives the account's tokens
    /// (`system:serviceaccount:NAMESPACE:NAME`).
    pub fn username(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }
}

#[derive(Debug, Clone, Args)]
pub struct LabelArgs {
    /// Label keys (or `prefix*`) always kept in identities, even if excluded. Repeatable.
    #[arg(
        long = "label-include",
        env = "CENSUS_LABEL_INCLUDE",
        value_delimiter = ','
    )]
    pub include: Vec<KeyPattern>,
    /// Label keys (or `prefix*`) dropped from identities, besides the defaults. Repeatable.
    #[arg(
        long = "label-exclude",
        env = "CENSUS_LABEL_EXCLUDE",
        value_delimiter = ','
    )]
    pub exclude: Vec<KeyPattern>,
    /// Do not drop the default per-pod labels (job-name, controller-uid, pod-template-hash, ...).
    #[arg(long, env = "CENSUS_NO_DEFAULT_LABEL_EXCLUDE")]
    pub no_default_label_exclude: bool,
    /// Labels in one identity, counted after the label filter (a request or an
    /// entry may carry up to 4 times as many before it, all of them checked).
    #[arg(long, env = "CENSUS_MAX_LABELS", default_value_t = 64)]
    pub max_labels: usize,
}

#[derive(Debug, Clone, Args)]
pub struct LimitArgs {
    /// Endpoints in one snapshot.
    #[arg(long, env = "CENSUS_MAX_SNAPSHOT_ENDPOINTS", default_value_t = 10_000)]
    pub max_snapshot_endpoints: usize,
    /// Addresses of one endpoint.
    #[arg(long, env = "CENSUS_MAX_IPS_PER_ENDPOINT", default_value_t = 16)]
    pub max_ips_per_endpoint: usize,
}

/// How often periodic work runs: a duration above zero (a zero period would spin,
/// and a ticker refuses it).
fn period(text: &str) -> Result<Duration, String> {
    let period = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if period.is_zero() {
        return Err("must be above zero: it is how often the work runs".to_owned());
    }
    Ok(period)
}

/// The cluster's Service addresses besides what the API server says.
#[derive(Debug, Clone, Default, Args)]
pub struct ServiceArgs {
    /// A range of ClusterIPs (CIDR, IPv4 or IPv6, host bits clear), sent to agents
    /// as a Service address. Repeatable, or a comma-separated list. For embedded
    /// mode and clusters before Kubernetes 1.33; with --store kubernetes the
    /// ServiceCIDR objects' ranges, LoadBalancer and external IPs are added to it.
    #[arg(
        long = "service-cidr",
        env = "CENSUS_SERVICE_CIDRS",
        value_name = "CIDR",
        value_delimiter = ','
    )]
    pub service_cidrs: Vec<ServiceCidr>,
}

impl ServiceArgs {
    /// The ranges, each once.
    pub fn ranges(&self) -> Vec<ipnet::IpNet> {
        let mut ranges: Vec<ipnet::IpNet> = self.service_cidrs.iter().map(|c| c.0).collect();
        ranges.sort_unstable();
        ranges.dedup();
        ranges
    }
}

/// One `--service-cidr`: a range in CIDR form with its host bits clear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServiceCidr(pub ipnet::IpNet);

impl std::str::FromStr for ServiceCidr {
    type Err = census_proto::domain::CidrError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        census_proto::domain::parse_cidr(text).map(Self)
    }
}

/// How the cluster-wide endpoint map is served (EndpointMap.Watch).
#[derive(Debug, Clone, Args)]
pub struct MapArgs {
    /// How often map changes are sent to watchers, as one batch.
    #[arg(long, env = "CENSUS_MAP_TICK_INTERVAL", default_value = "100ms", value_parser = period)]
    pub map_tick_interval: Duration,
    /// Entries (addresses, nodes) in one map message at most; a full map is sent in
    /// chunks of this size.
    #[arg(long, env = "CENSUS_MAP_BATCH_ENTRIES", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub map_batch_entries: u32,
    /// Batches a watcher may fall behind before it is sent the full map again.
    #[arg(long, env = "CENSUS_MAP_WATCH_BUFFER", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub map_watch_buffer: u32,
    /// Full maps sent at once; other watchers wait for their turn.
    #[arg(long, env = "CENSUS_MAP_MAX_RESYNCS", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub map_max_resyncs: u32,
    /// How long the last full map built is kept for further resyncs after the last
    /// one it served; then it and the batches that followed it are freed.
    #[arg(long, env = "CENSUS_MAP_CACHE_IDLE", default_value = "10s", value_parser = period)]
    pub map_cache_idle: Duration,
}

impl MapArgs {
    pub fn config(&self) -> crate::runtime::MapConfig {
        crate::runtime::MapConfig {
            tick: self.map_tick_interval,
            batch_entries: self.map_batch_entries as usize,
            buffer: self.map_watch_buffer as usize,
            resyncs: self.map_max_resyncs as usize,
            cache_idle: self.map_cache_idle,
        }
    }
}

/// Bytes one endpoint may take in a snapshot at most, generously: key, addresses and
/// a full label set of typical size. The decoding limit of gRPC messages is the
/// endpoint limit times this, so a snapshot at the endpoint limit always fits.
pub const ENDPOINT_WIRE_BYTES: usize = 4096;

impl LimitArgs {
    pub fn wire(&self, labels: &LabelArgs) -> WireLimits {
        WireLimits {
            labels: LabelLimits {
                max_labels: labels.max_labels,
            },
            max_ips_per_endpoint: self.max_ips_per_endpoint,
            max_snapshot_endpoints: self.max_snapshot_endpoints,
        }
    }

    /// The largest gRPC message the operator accepts.
    pub fn max_message_bytes(&self) -> usize {
        self.max_snapshot_endpoints
            .saturating_mul(ENDPOINT_WIRE_BYTES)
            .max(4 * 1024 * 1024)
    }
}

impl LabelArgs {
    pub fn filter(&self) -> LabelFilter {
        LabelFilter::new(
            self.include.clone(),
            self.exclude.clone(),
            !self.no_default_label_exclude,
        )
    }
}

impl AllocatorArgs {
    pub fn config(&self) -> allocator::Config {
        let node_ttl = self.node_ttl.unwrap_or(self.snapshot_interval * 3);
        let hold_timeout = self.hold_timeout.unwrap_or(node_ttl).max(node_ttl);
        allocator::Config {
            range: self.id_range,
            snapshot_interval: self.snapshot_interval,
            node_ttl,
            hold_timeout,
            grace: self.grace_period,
            quarantine: self.quarantine,
            adoption_window: self.adoption_window.unwrap_or(node_ttl),
            liveness: Liveness::Embedded,
            max_holds_per_node: self.max_holds_per_node,
            gc_rate: self.gc_rate,
            gc_burst: self.gc_rate.max(1.0),
            ..allocator::Config::default()
        }
    }

    /// The core's parameters in a cluster: a silent node only goes stale; its view is
    /// dropped when its Node is deleted or after the stale-view limit.
    pub fn cluster_config(&self) -> allocator::Config {
        allocator::Config {
            liveness: Liveness::Cluster {
                stale_view_limit: self.stale_view_limit,
            },
            ..self.config()
        }
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
    fn defaults_follow_the_design() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from(["census-operator"])?;
        let cfg = cli.allocator.config();
        assert_eq!(cfg.node_ttl, Duration::from_secs(90));
        assert_eq!(cfg.hold_timeout, Duration::from_secs(90));
        assert_eq!(cfg.grace, Duration::from_secs(60));
        assert_eq!(cfg.quarantine, Duration::from_secs(600));
        assert_eq!(cli.limits.max_snapshot_endpoints, 10_000);
        assert!(cli.limits.max_message_bytes() >= 10_000 * ENDPOINT_WIRE_BYTES);
        Ok(())
    }

    #[test]
    fn service_cidrs_repeat_or_list_and_refuse_host_bits() -> Result<(), Box<dyn std::error::Error>>
    {
        let cli = Cli::try_parse_from([
            "census-operator",
            "--service-cidr",
            "10.96.0.0/12,fd00:10:96::/108",
            "--service-cidr",
            "10.96.0.0/12",
        ])?;
        let want: Vec<ipnet::IpNet> = vec!["10.96.0.0/12".parse()?, "fd00:10:96::/108".parse()?];
        assert_eq!(cli.services.ranges(), want);
        assert!(
            Cli::try_parse_from(["census-operator"])?
                .services
                .ranges()
                .is_empty()
        );
        let err = Cli::try_parse_from(["census-operator", "--service-cidr", "10.96.1.0/12"])
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("bits set past its prefix length")),
            "{err:?}"
        );
        let err = Cli::try_parse_from(["census-operator", "--service-cidr", "10.96.0.1"])
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains("CIDR form")),
            "{err:?}"
        );
        Ok(())
    }

    #[test]
    fn bad_flags_name_the_problem() {
        let err = Cli::try_parse_from(["census-operator", "--id-range", "10-20"])
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("above the reserved ids")));
        let err = Cli::try_parse_from(["census-operator", "--label-exclude", "a*b"])
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("`*` may only end a pattern")));
        for flag in ["--tick-interval", "--map-tick-interval"] {
            let err = Cli::try_parse_from(["census-operator", flag, "0s"])
                .err()
                .map(|e| e.to_string());
            assert!(
                err.is_some_and(|e| e.contains("must be above zero")),
                "{flag} 0s"
            );
        }
    }

    #[test]
    fn kubernetes_flags_parse() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from([
            "census-operator",
            "--store",
            "kubernetes",
            "--namespace",
            "census",
            "--lease-duration",
            "20s",
            "--pod-ip",
            "10.0.0.7",
            "--stale-view-limit",
            "30m",
        ])?;
        assert_eq!(cli.store.kind, StoreKind::Kubernetes);
        assert_eq!(cli.kubernetes.namespace.as_deref(), Some("census"));
        assert_eq!(cli.kubernetes.lease_duration, Duration::from_secs(20));
        assert_eq!(cli.kubernetes.lease_renew_deadline, Duration::from_secs(10));
        assert_eq!(cli.kubernetes.pod_ip, Some(IpAddr::from([10, 0, 0, 7])));
        assert_eq!(
            cli.allocator.cluster_config().liveness,
            Liveness::Cluster {
                stale_view_limit: Duration::from_secs(1800)
            }
        );
        assert_eq!(cli.allocator.config().liveness, Liveness::Embedded);
        let crdgen = Cli::try_parse_from(["census-operator", "crdgen", "--out", "x.yaml"])?;
        assert!(matches!(
            crdgen.command,
            Some(Command::Crdgen { out: Some(_) })
        ));
        Ok(())
    }

    #[test]
    fn the_agent_service_account_is_namespace_slash_name() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from([
            "census-operator",
            "--agent-service-account",
            "census-agent/census-agent",
        ])?;
        let account = cli.kubernetes.agent_service_account;
        assert_eq!(account.namespace, "census-agent");
        assert_eq!(account.name, "census-agent");
        assert_eq!(account.to_string(), "census-agent/census-agent");
        assert_eq!(
            account.username(),
            "system:serviceaccount:census-agent:census-agent"
        );
        let defaults = Cli::try_parse_from(["census-operator"])?.kubernetes;
        assert_eq!(
            defaults.agent_service_account.to_string(),
            "census-agent/census-agent",
            "deploy/'s DaemonSet's account"
        );
        assert_eq!(defaults.token_audience, "census");
        for bad in ["", "two words", "tab\there"] {
            let err = Cli::try_parse_from(["census-operator", "--token-audience", bad])
                .err()
                .map(|e| e.to_string());
            assert!(
                err.as_ref().is_some_and(
                    |e| e.contains("--token-audience") && e.contains("1-253 characters")
                ),
                "{bad:?}: {err:?}"
            );
        }
        for (bad, needle) in [
            ("census-agent", "is not NAMESPACE/NAME"),
            ("/census-agent", "is not NAMESPACE/NAME"),
            ("census-agent/", "is not NAMESPACE/NAME"),
            ("a/b/c", "is not NAMESPACE/NAME"),
            (
                "Census/agent",
                "namespace \"Census\": a namespace is a DNS label",
            ),
            ("census.agent/agent", "namespace \"census.agent\""),
            ("census/agent_1", "ServiceAccount name \"agent_1\""),
            ("census/-agent", "ServiceAccount name \"-agent\""),
        ] {
            let err = Cli::try_parse_from(["census-operator", "--agent-service-account", bad])
                .err()
                .map(|e| e.to_string());
            assert!(
                err.as_ref()
                    .is_some_and(|e| e.contains(needle) && e.contains("--agent-service-account")),
                "{bad}: {err:?}"
            );
        }
        let long = format!("census/{}", "a".repeat(254));
        assert!(long.parse::<ServiceAccountRef>().is_err());
        let long_ns = format!("{}/agent", "a".repeat(64));
        assert!(long_ns.parse::<ServiceAccountRef>().is_err());
        assert!("census/agent.v2".parse::<ServiceAccountRef>().is_ok());
        Ok(())
    }

    #[test]
    fn hold_timeout_is_never_below_node_ttl() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from([
            "census-operator",
            "--snapshot-interval",
            "10s",
            "--hold-timeout",
            "5s",
        ])?;
        assert_eq!(cli.allocator.config().hold_timeout, Duration::from_secs(30));
        Ok(())
    }
}
