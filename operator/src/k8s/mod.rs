//! The operator in a Kubernetes cluster: clients, the Identity store, the Node watch,
//! leader election and the leader's EndpointSlice, assembled for the daemon.
//!
//! Every replica watches the Identity objects (its read model and, when it leads, the
//! source of `binding_lost`/`binding_invalid`) and the Nodes (Hello admission and
//! `node_gone`), the ServiceCIDRs and the Services' addresses (what agents are sent
//! as Service addresses, kept without the objects), and tries the Lease; the one
//! that holds it runs the core. No replica watches anything else: Leases and the leader EndpointSlice are read one at a time,
//! and no replica writes to any pod.

pub mod endpointslice;
mod leader;
pub mod lease;
pub mod nodes;
pub mod services;
pub mod tokenreview;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use census_daemon::apiserver::Pool;
use census_proto::labels::LabelLimits;
use kube::{
    Api, Client,
    api::{DynamicObject, ListParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use tokio::{sync::watch, task::JoinHandle};
use tracing::{Instrument, info, info_span, warn};

use self::{
    endpointslice::{LeaderSlice, Me, Publisher},
    leader::Leadership,
    lease::{ElectionError, Elector, LeaseConfig},
    nodes::NodeIndex,
    tokenreview::{TokenReviewConfig, TokenReviewer},
};
use crate::{
    admin::Readiness,
    allocator::Config,
    api::Settings,
    config::{KubernetesArgs, ServiceAccountRef},
    metrics::Metrics,
    replica::{Fence, Replica},
    runtime::{Clock, Runtime, feed_store_events},
    services::ServiceAddresses,
    store::{
        Store as _,
        kubernetes::{EventsConfig, KubeStore, KubeStoreConfig},
    },
};

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cannot read the kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("cannot find a cluster configuration (in-cluster or kubeconfig): {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("cannot build a Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error(
        "the Identity CustomResourceDefinition is not installed (identities.census.dev): apply deploy/crds/identity.yaml first"
    )]
    CrdMissing,
    #[error(transparent)]
    Election(#[from] ElectionError),
}

/// What the daemon passes in.
#[derive(Debug)]
pub struct Parts {
    /// The core's parameters (cluster liveness).
    pub cfg: Config,
    pub limits: LabelLimits,
    /// The writers' batch timeout; also bounds one API request.
    pub store_timeout: Duration,
    /// Where this replica serves gRPC (the port is published with the pod IP).
    pub grpc_addr: SocketAddr,
    pub clock: Clock,
    pub settings: Settings,
    pub metrics: Metrics,
    pub readiness: Readiness,
    /// `--service-cidr`: Service ranges besides the ServiceCIDR objects'.
    pub service_cidrs: Vec<ipnet::IpNet>,
}

/// A running replica's cluster side.
#[derive(Debug)]
pub struct Cluster {
    pub runtime: Arc<Runtime>,
    pub store: Arc<KubeStore>,
    pub nodes: Arc<NodeIndex>,
    /// The cluster's Service addresses (`--service-cidr`, ServiceCIDRs, Services).
    pub services: Arc<ServiceAddresses>,
    /// The agents' ServiceAccount (`--agent-service-account`).
    pub agent_service_account: ServiceAccountRef,
    /// Checks agents' bearer tokens (TokenReview), binding them to their nodes.
    pub tokens: TokenReviewer,
    stop: watch::Sender<bool>,
    leadership: JoinHandle<()>,
    tasks: Vec<JoinHandle<()>>,
}

async fn kube_config(args: &KubernetesArgs) -> Result<kube::Config, ClusterError> {
    match &args.kubeconfig {
        Some(path) => {
            let kubeconfig =
                Kubeconfig::read_from(path).map_err(|source| ClusterError::Kubeconfig {
                    path: path.display().to_string(),
                    source,
                })?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|source| ClusterError::Kubeconfig {
                    path: path.display().to_string(),
                    source,
                })
        }
        None => Ok(kube::Config::infer().await?),
    }
}

/// A client of the API server over a connection pool of `max_idle` idle connections,
/// each closed after 10 s unused (census_daemon::apiserver). With `retry`, 429, 503
/// and 504 are retried with kube's backoff; writes and the Lease have their own retry
/// (the core's backoff, the retry period).
fn client(config: kube::Config, retry: bool, max_idle: usize) -> Result<Client, ClusterError> {
    let pool = Pool {
        max_idle,
        ..Pool::default()
    };
    census_daemon::apiserver::client(config, pool, retry).map_err(ClusterError::Client)
}

/// Who this replica is in the cluster and its clients of the API server.
struct Connection {
    namespace: String,
    identity: String,
    lease: LeaseConfig,
    store_config: KubeStoreConfig,
    /// The Identity store's writes.
    writes: Client,
    /// Reads and watches, retried on 429, 503 and 504.
    reads: Client,
    /// The Lease's.
    leases: Client,
    tokens: TokenReviewer,
}

/// Resolves the replica's namespace, identity, Lease and store settings from `args`,
/// and makes its clients of the API server.
async fn connect(
    args: &KubernetesArgs,
    limits: LabelLimits,
    store_timeout: Duration,
    grpc_port: u16,
    metrics: &Metrics,
) -> Result<Connection, ClusterError> {
    let config = kube_config(args).await?;
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let identity = replica_identity(args.pod_name.as_deref());
    let lease = lease_config(args, &namespace, &identity, grpc_port);
    lease.check()?;
    let store_config = store_config(limits, store_timeout, &identity);
    // The writes client keeps as many idle connections as the store writes at once,
    // so a GC pass reuses them; the timeout closes them once the pass is over.
    let writes = client(config.clone(), false, store_config.concurrency)?;
    let reads = client(config.clone(), true, Pool::default().max_idle)?;
    let leases = client(config.clone(), false, 1)?;
    let tokens = token_reviewer(config, args, metrics)?;
    Ok(Connection {
        namespace,
        identity,
        lease,
        store_config,
        writes,
        reads,
        leases,
        tokens,
    })
}

/// Connects to the cluster and starts this replica as a follower.
pub async fn start(args: &KubernetesArgs, parts: Parts) -> Result<Cluster, ClusterError> {
    let KubernetesArgs {
        pod_ip,
        agent_service_account,
        token_audience,
        require_node_address,
        ..
    } = args;
    let Parts {
        cfg,
        limits,
        store_timeout,
        grpc_addr,
        clock,
        settings,
        metrics,
        readiness,
        service_cidrs,
    } = parts;
    let Connection {
        namespace,
        identity,
        lease,
        store_config,
        writes,
        reads,
        leases,
        tokens,
    } = connect(args, limits, store_timeout, grpc_addr.port(), &metrics).await?;
    readiness.set_not_ready(format!("replica {identity}: {}", waiting(&reads).await?));

    let fence = Arc::new(Fence::closed());
    let store = Arc::new(KubeStore::new(
        writes.clone(),
        reads.clone(),
        fence.clone(),
        store_config,
    ));
    let nodes = Arc::new(NodeIndex::binding_peers(*require_node_address));
    let runtime = Runtime::new_replica(
        cfg.clone(),
        clock,
        settings,
        metrics,
        Replica {
            reads: store.read_model(),
            admission: nodes.clone(),
        },
    );
    let services = ServiceAddresses::listing(service_cidrs, runtime.clone());
    let tasks = spawn_tasks(Tasks {
        services: &services,
        nodes: &nodes,
        store: &store,
        reads,
        runtime: &runtime,
        readiness,
        identity: &identity,
        agents: agent_service_account,
    });
    let me = pod_ip.map(|ip| Me {
        pod: identity.clone(),
        ip,
        port: grpc_addr.port(),
    });
    let slice = leader_slice(me, writes, &namespace, &fence);
    let (stop, stop_rx) = watch::channel(false);
    let span = info_span!("leader_election", lease = %lease.name, identity = %identity);
    let leadership = Leadership {
        runtime: runtime.clone(),
        store: store.clone(),
        nodes: nodes.clone(),
        fence,
        elector: Elector::new(leases, lease.clone()),
        slice,
        cfg,
        store_timeout,
        stop: stop_rx,
    };
    let leadership = tokio::spawn(leadership.run().instrument(span));
    info!(
        agent_service_account = %agent_service_account,
        token_audience = %token_audience,
        "agents' tokens bind nodes only for this ServiceAccount and audience"
    );
    info!(%namespace, lease = %lease.name, %identity, "joined the cluster as a follower");
    Ok(Cluster {
        runtime,
        store,
        nodes,
        services,
        agent_service_account: agent_service_account.clone(),
        tokens,
        stop,
        leadership,
        tasks,
    })
}

/// What `/readyz` says while the Identity objects are being listed: why they
/// cannot be yet, if the first try failed (the watch retries).
async fn waiting(reads: &Client) -> Result<String, ClusterError> {
    Ok(match check_crd(reads).await? {
        Some(error) => format!(
            "cannot list Identity objects from the API server yet ({error}); the watch retries"
        ),
        None => "listing the Identity objects".to_owned(),
    })
}

/// The publisher of the leader EndpointSlice, for a replica that knows its pod's
/// address (`--pod-ip`); without it, agents cannot find the leader through that
/// Service, which is said once.
fn leader_slice(
    me: Option<Me>,
    writes: Client,
    namespace: &str,
    fence: &Arc<Fence>,
) -> Option<Publisher> {
    let Some(me) = me else {
        warn!(
            "no --pod-ip: followers cannot tell clients the leader's address, and the \
             leader publishes none in the census-operator-leader EndpointSlice, so agents \
             cannot reach it through that Service"
        );
        return None;
    };
    Some(Publisher::start(LeaderSlice::new(
        writes,
        namespace,
        me,
        fence.clone(),
    )))
}

/// The authenticator of agents' tokens. A caller waits for its review: no kube
/// retries (the review has its own timeout).
fn token_reviewer(
    config: kube::Config,
    args: &KubernetesArgs,
    metrics: &Metrics,
) -> Result<TokenReviewer, ClusterError> {
    Ok(TokenReviewer::counted(
        client(config, false, Pool::default().max_idle)?,
        TokenReviewConfig::new(
            args.token_audience.clone(),
            args.agent_service_account.clone(),
        ),
        tokenreview::Counted {
            reviews: metrics.token_reviews.clone(),
            cached: metrics.token_review_cache_entries.clone(),
        },
    ))
}

/// The Lease this replica takes part in, and the address it publishes there.
fn lease_config(
    args: &KubernetesArgs,
    namespace: &str,
    identity: &str,
    grpc_port: u16,
) -> LeaseConfig {
    LeaseConfig {
        namespace: namespace.to_owned(),
        name: args.lease_name.clone(),
        identity: identity.to_owned(),
        address: args
            .pod_ip
            .map(|ip| SocketAddr::new(ip, grpc_port).to_string()),
        duration: args.lease_duration,
        renew_deadline: args.lease_renew_deadline,
        retry_period: args.lease_retry_period,
    }
}

/// This replica's name in the Lease: the pod's name (`--pod-name`, else the
/// `HOSTNAME` the kubelet sets), or a random one outside a pod.
fn replica_identity(pod_name: Option<&str>) -> String {
    pod_name
        .map(str::to_owned)
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| format!("census-operator-{:08x}", rand::random::<u32>()))
}

/// The Identity store's settings: its label limits, its request timeout, and the
/// Events it records as this replica.
fn store_config(limits: LabelLimits, request_timeout: Duration, identity: &str) -> KubeStoreConfig {
    KubeStoreConfig {
        limits,
        request_timeout,
        events: Some(EventsConfig {
            instance: identity.to_owned(),
        }),
        ..KubeStoreConfig::default()
    }
}

/// What a follower runs besides leader election.
struct Tasks<'a> {
    services: &'a Arc<ServiceAddresses>,
    nodes: &'a Arc<NodeIndex>,
    store: &'a Arc<KubeStore>,
    reads: Client,
    runtime: &'a Arc<Runtime>,
    readiness: Readiness,
    identity: &'a str,
    agents: &'a ServiceAccountRef,
}

/// The watches of ServiceCIDRs, Services and Nodes, the store's events into the
/// core, and the task that says Ready once the Identity objects are listed.
fn spawn_tasks(t: Tasks<'_>) -> Vec<JoinHandle<()>> {
    let mut tasks = vec![
        tokio::spawn(
            services::run_cidrs(t.services.clone(), t.reads.clone())
                .instrument(info_span!("watch", resource = "servicecidrs")),
        ),
        tokio::spawn(
            services::run_services(t.services.clone(), t.reads.clone())
                .instrument(info_span!("watch", resource = "services")),
        ),
        tokio::spawn(
            nodes::run(t.nodes.clone(), t.reads, t.runtime.clone())
                .instrument(info_span!("watch", resource = "nodes")),
        ),
    ];
    if let Some(events) = t.store.events() {
        tasks.push(tokio::spawn(feed_store_events(t.runtime.clone(), events)));
    }
    let (store, nodes, readiness) = (t.store.clone(), t.nodes.clone(), t.readiness);
    let identity = t.identity.to_owned();
    let agents = format!("agents' ServiceAccount {}", t.agents);
    tasks.push(tokio::spawn(async move {
        store.wait_synced().await;
        readiness.set_ready(format!(
            "replica {identity}: listed {} Identity objects; serving reads; {agents}",
            store.cached_objects()
        ));
        info!(nodes = nodes.len(), "listed the Identity objects: ready");
    }));
    tasks
}

/// Fails fast when the CRD is missing; any other failure is left to the watch, which
/// retries (the API server may be down at start), and returned for `/readyz` to say.
async fn check_crd(client: &Client) -> Result<Option<kube::Error>, ClusterError> {
    let api: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &kube::api::ApiResource::erase::<crate::store::kubernetes::crd::Identity>(&()),
    );
    match api.list_metadata(&ListParams::default().limit(1)).await {
        Err(kube::Error::Api(s)) if s.code == 404 => Err(ClusterError::CrdMissing),
        Err(e) => {
            warn!(error = %e, "cannot list Identity objects yet; the watch retries");
            Ok(Some(e))
        }
        Ok(_) => Ok(None),
    }
}

impl Cluster {
    /// Steps down (a leader drains its writes, releases the Lease and takes its
    /// address off the leader EndpointSlice), then stops the watches.
    pub async fn shut_down(self) {
        let _ = self.stop.send(true);
        if tokio::time::timeout(Duration::from_secs(15), self.leadership)
            .await
            .is_err()
        {
            warn!("leadership did not step down in time");
        }
        for task in self.tasks {
            task.abort();
        }
    }

    /// Scrape-time gauges: whether this replica leads, and the Node index's size.
    pub fn collector(&self) -> Box<dyn prometheus_client::collector::Collector> {
        Box::new(ClusterCollector {
            runtime: self.runtime.clone(),
            nodes: self.nodes.clone(),
        })
    }
}

#[derive(Debug)]
struct ClusterCollector {
    runtime: Arc<Runtime>,
    nodes: Arc<NodeIndex>,
}

impl prometheus_client::collector::Collector for ClusterCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::{encoding::EncodeMetric, metrics::gauge::ConstGauge};
        let leader = i64::from(self.runtime.role().is_leader());
        let nodes = i64::try_from(self.nodes.len()).unwrap_or(i64::MAX);
        for (name, help, value) in [
            (
                "census_leader",
                "1 while this replica leads (holds the Lease)",
                leader,
            ),
            (
                "census_kubernetes_cached_nodes",
                "Nodes in the operator's Node index (name and addresses of each)",
                nodes,
            ),
        ] {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}
