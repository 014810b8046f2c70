//! Assembles the operator from its resolved [`Options`] (`options`: the command
//! line checked before anything is opened): store, core, writers, tick loop, gRPC
//! and admin servers; and takes it down in order on shutdown. With `--store kubernetes` the store, the
//! core and the writers come and go with leadership (see `crate::k8s`).

use std::{net::SocketAddr, sync::Arc, time::Duration};

use prometheus_client::registry::Registry;
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};
use tracing::{info, warn};

mod options;

use self::options::{Options, StoreOptions};
use crate::{
    admin::{self, Readiness},
    allocator::Allocator,
    api::{Api, Settings},
    config::{Cli, StoreKind},
    grpc,
    k8s::{self, Cluster, ClusterError},
    metrics::Metrics,
    runtime::{Clock, CoreCollector, Runtime},
    security::{AuthMode, Security, SecurityError},
    services::ServiceAddresses,
    store::{
        Store, StoreError,
        redb::{RedbOptions, RedbStore},
    },
    summary::Summary,
    writer,
};

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot listen on {addr} ({what}): {source}")]
    Listen {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("the store task failed: {0}")]
    Join(#[from] tokio::task::JoinError),
    #[error(transparent)]
    Profiling(#[from] census_daemon::ProfilingError),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    #[error(transparent)]
    Security(#[from] SecurityError),
    #[error(
        "--max-inflight-message-bytes {budget} is below the message limit of {limit} bytes (--max-snapshot-endpoints x 4096): a snapshot at the limit could never be received"
    )]
    MessageBudget { budget: u64, limit: usize },
}

/// How long shutdown waits for writes in flight to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A running operator.
#[derive(Debug)]
pub struct Running {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub runtime: Arc<Runtime>,
    readiness: Readiness,
    shutdown: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    writers: Vec<JoinHandle<()>>,
    /// `--store kubernetes`: the cluster side (its writers come and go with leadership).
    pub cluster: Option<Cluster>,
}

/// Who authenticates the gRPC server's callers, for `mode`.
fn authenticator(
    mode: AuthMode,
    grpc_addr: SocketAddr,
    tokens: Option<&k8s::tokenreview::TokenReviewer>,
) -> Result<Arc<dyn grpc::auth::Authenticate>, StartError> {
    Ok(match mode {
        AuthMode::Loopback => {
            warn!(
                %grpc_addr,
                "the gRPC server runs unauthenticated on loopback (no --tls-cert): every local process may speak for any node"
            );
            Arc::new(grpc::auth::LoopbackOnly)
        }
        AuthMode::MutualTls(ca) => {
            info!(%grpc_addr, "the gRPC server requires mutual TLS: callers are named by their client certificates");
            Arc::new(grpc::auth::MutualTls::new(ca))
        }
        // The cluster's TokenReview authenticator (`crate::k8s::tokenreview`), built by
        // `k8s::start` from its client and the Kubernetes flags.
        AuthMode::BearerToken => match tokens {
            Some(tokens) => {
                info!(%grpc_addr, "the gRPC server requires agents' ServiceAccount tokens (TokenReview)");
                Arc::new(tokens.clone())
            }
            None => return Err(SecurityError::NoTokenReview.into()),
        },
    })
}

/// How often the operator logs what its core did (nothing for a quiet interval).
const SUMMARY_EVERY: Duration = Duration::from_secs(60);

/// Resolves `cli`, opens the store, loads it, and starts serving.
pub async fn start(cli: Cli) -> Result<Running, StartError> {
    run(Options::resolve(cli)?).await
}

/// The core with its store: the runtime, the store's writers (embedded) or the
/// cluster side (whose writers come and go with leadership).
struct Core {
    runtime: Arc<Runtime>,
    writers: Vec<JoinHandle<()>>,
    cluster: Option<Cluster>,
}

/// Starts the operator `options` describe.
async fn run(options: Options) -> Result<Running, StartError> {
    if options.heap_profiling {
        census_daemon::profiling::activate().await?;
        info!("jemalloc heap profiling is on: /debug/pprof/heap on the admin port");
    }
    // Listen first: a replica in a cluster publishes its gRPC address.
    let (grpc_listener, grpc_addr) = listen("gRPC", options.security.listen).await?;
    let (admin_listener, admin_addr) = listen("admin", options.admin_listen).await?;
    let metrics = Metrics::default();
    let readiness = Readiness::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let admin_metrics = census_daemon::http::AdminMetrics::default();
    admin_metrics.register(registry.sub_registry_with_prefix("census"));
    let core = match options.store.kind {
        StoreKind::Redb => open_redb(&options, &metrics).await?,
        StoreKind::Kubernetes => {
            let core = open_cluster(&options, grpc_addr, &metrics, &readiness).await?;
            if let Some(cluster) = &core.cluster {
                registry.register_collector(cluster.store.collector());
                registry.register_collector(cluster.collector());
            }
            core
        }
    };
    let Core {
        runtime,
        writers,
        cluster,
    } = core;
    registry.register_collector(Box::new(CoreCollector::new(runtime.clone())));
    registry.register_collector(Box::new(census_daemon::ProcessCollector::new()));

    let Security { mode, tls, .. } = options.security;
    let auth = authenticator(mode, grpc_addr, cluster.as_ref().map(|c| &c.tokens))?;
    let (shutdown, stop) = watch::channel(false);
    let grpc = GrpcServer {
        listener: grpc_listener,
        operator: runtime.clone(),
        metrics,
        transport: options.transport,
        map_batch_entries: options.map.batch_entries,
        auth,
        tls,
    };
    let admin = admin::router(Arc::new(registry), readiness.clone());
    let servers = vec![
        runtime.serve_map(options.map, Arc::new(grpc::WireMap), stop.clone()),
        spawn_ticks(&runtime, options.allocator.tick_interval, stop.clone()),
        spawn_summary(&runtime, stop.clone()),
        grpc.spawn(stop.clone()),
        tokio::spawn(async move {
            let served = census_daemon::http::serve(
                admin_listener,
                admin,
                options.admin_limits,
                admin_metrics,
                stop,
            );
            if let Err(e) = served.await {
                tracing::error!(error = %e, "the admin server failed");
            }
        }),
    ];
    if cluster.is_none() {
        readiness.set_ready(format!("store redb loaded, gRPC on {grpc_addr}"));
    }
    info!(%grpc_addr, %admin_addr, "serving");
    Ok(Running {
        grpc_addr,
        admin_addr,
        runtime,
        readiness,
        shutdown,
        servers,
        writers,
        cluster,
    })
}

/// A listener on `addr`, and the address it got (the port, for `:0`).
async fn listen(
    what: &'static str,
    addr: SocketAddr,
) -> Result<(TcpListener, SocketAddr), StartError> {
    let error = |source| StartError::Listen { what, addr, source };
    let listener = TcpListener::bind(addr).await.map_err(error)?;
    let local = listener.local_addr().map_err(error)?;
    Ok((listener, local))
}

/// The embedded store (redb), loaded into a new core, and its writers.
async fn open_redb(options: &Options, metrics: &Metrics) -> Result<Core, StartError> {
    let StoreOptions {
        path,
        cache_bytes,
        timeout,
        ..
    } = &options.store;
    let redb_options = RedbOptions {
        cache_bytes: *cache_bytes,
        ..RedbOptions::default()
    };
    let at = path.clone();
    let redb = tokio::task::spawn_blocking(move || RedbStore::open(&at, redb_options)).await??;
    info!(path = %path.display(), "opened the redb store");
    let store: Arc<dyn Store> = Arc::new(redb);
    let loaded = store.load().await?;
    info!(
        identities = loaded.identities.len(),
        nodes = loaded.nodes.len(),
        tombstones = loaded.tombstones.len(),
        "loaded the store"
    );
    let clock = Clock::new();
    let alloc = Allocator::new(options.allocator.config(), loaded, clock.now());
    let settings = Settings {
        store_kind: store.kind(),
        ..options.settings.clone()
    };
    let (runtime, queues) = Runtime::new(alloc, clock, settings, metrics.clone());
    let writers = writer::spawn(queues, store, metrics.clone(), *timeout);
    ServiceAddresses::new(options.service_cidrs.clone(), runtime.clone());
    Ok(Core {
        runtime,
        writers,
        cluster: None,
    })
}

/// The cluster side (`--store kubernetes`): leadership, the Identity store, and the
/// core of whichever replica leads.
async fn open_cluster(
    options: &Options,
    grpc_addr: SocketAddr,
    metrics: &Metrics,
    readiness: &Readiness,
) -> Result<Core, StartError> {
    let settings = Settings {
        store_kind: "kubernetes",
        ..options.settings.clone()
    };
    let parts = k8s::Parts {
        cfg: options.allocator.cluster_config(),
        limits: settings.wire.labels,
        store_timeout: options.store.timeout,
        grpc_addr,
        clock: Clock::new(),
        settings,
        metrics: metrics.clone(),
        readiness: readiness.clone(),
        service_cidrs: options.service_cidrs.clone(),
    };
    let cluster = k8s::start(&options.kubernetes, parts).await?;
    Ok(Core {
        runtime: cluster.runtime.clone(),
        writers: Vec::new(),
        cluster: Some(cluster),
    })
}

/// Ticks the core every `every` until `stop`.
fn spawn_ticks(
    runtime: &Arc<Runtime>,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let runtime = runtime.clone();
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(every);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = interval.tick() => runtime.tick(),
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    })
}

/// Logs what the core did every [`SUMMARY_EVERY`] until `stop`.
fn spawn_summary(runtime: &Arc<Runtime>, mut stop: watch::Receiver<bool>) -> JoinHandle<()> {
    let runtime = runtime.clone();
    tokio::spawn(async move {
        let (counters, nodes) = runtime.read(|a| (a.counters().clone(), a.nodes()));
        let mut summary = Summary::new(&counters, &nodes);
        let mut interval = tokio::time::interval(SUMMARY_EVERY);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        interval.tick().await;
        loop {
            tokio::select! {
                _ = interval.tick() => {
                    let (counters, nodes) = runtime.read(|a| (a.counters().clone(), a.nodes()));
                    if let Some(line) = summary.line(&counters, &nodes) {
                        info!("in the last {}: {line}", humantime::format_duration(SUMMARY_EVERY));
                    }
                }
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    })
}

/// The gRPC server, ready to serve.
struct GrpcServer {
    listener: TcpListener,
    operator: Arc<Runtime>,
    metrics: Metrics,
    transport: grpc::Transport,
    map_batch_entries: usize,
    auth: Arc<dyn grpc::auth::Authenticate>,
    tls: Option<grpc::ServerTls>,
}

impl GrpcServer {
    /// Serves until `stop`; a failure is logged.
    fn spawn(self, stop: watch::Receiver<bool>) -> JoinHandle<()> {
        tokio::spawn(async move {
            let operator: Arc<dyn Api> = self.operator;
            let served = grpc::serve(
                self.listener,
                operator,
                self.metrics,
                self.transport,
                self.map_batch_entries,
                self.auth,
                self.tls,
                stop,
            );
            if let Err(e) = served.await {
                tracing::error!(error = %e, "the gRPC server failed");
            }
        })
    }
}

impl Running {
    /// Stops serving: agent streams are told to reconnect, writes in flight finish
    /// (up to a timeout), then everything ends.
    pub async fn shut_down(self) {
        self.readiness.set_not_ready("shutting down");
        let _ = self.shutdown.send(true);
        if let Some(cluster) = self.cluster {
            cluster.shut_down().await;
        }
        self.runtime.shut_down();
        for server in self.servers {
            let _ = server.await;
        }
        let drain = async {
            for w in self.writers {
                let _ = w.await;
            }
        };
        if tokio::time::timeout(DRAIN_TIMEOUT, drain).await.is_err() {
            warn!(timeout = ?DRAIN_TIMEOUT, "store writes still in flight at shutdown");
        }
        info!("stopped");
    }
}
