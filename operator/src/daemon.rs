//! Assembles the operator: store, core, writers, tick loop, gRPC and admin servers;
//! and takes it down in order on shutdown. With `--store kubernetes` the store, the
//! core and the writers come and go with leadership (see `crate::k8s`).

use std::{net::SocketAddr, sync::Arc, time::Duration};

use prometheus_client::registry::Registry;
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};
use tracing::{info, warn};

use crate::{
    admin::{self, Readiness},
    allocator::Allocator,
    api::{Api, Settings},
    config::{Cli, StoreArgs, StoreKind},
    grpc,
    k8s::{self, Cluster, ClusterError},
    metrics::Metrics,
    runtime::{Clock, CoreCollector, Runtime},
    security::{self, AuthMode, SecurityError},
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

/// Opens the store, loads it, and starts serving.
pub async fn start(cli: Cli) -> Result<Running, StartError> {
    let Cli {
        listen,
        store: store_args,
        allocator,
        labels,
        limits,
        map,
        services: service_args,
        log: _,
        profiling,
        kubernetes,
        command: _,
    } = cli;
    let StoreArgs {
        kind,
        store_path,
        store_cache_bytes,
        store_timeout,
    } = store_args;
    // Checked before anything is opened: a refused start changes nothing.
    if listen.max_inflight_message_bytes < limits.max_message_bytes() as u64 {
        return Err(StartError::MessageBudget {
            budget: listen.max_inflight_message_bytes,
            limit: limits.max_message_bytes(),
        });
    }
    if let Some(warning) = census_daemon::fds::over_limit(
        "--max-connections",
        u64::from(listen.max_connections),
        census_daemon::fds::soft_limit(),
    ) {
        warn!("{warning}");
    }
    let census_daemon::ProfilingArgs { heap_profiling } = profiling;
    if heap_profiling {
        census_daemon::profiling::activate().await?;
        info!("jemalloc heap profiling is on: /debug/pprof/heap on the admin port");
    }
    let security = security::resolve(
        &listen.tls,
        listen.grpc_listen,
        kind,
        listen.handshake_timeout,
    )?;
    let grpc_listen = security.listen;
    // Listen first: a replica in a cluster publishes its gRPC address.
    let grpc_listener =
        TcpListener::bind(grpc_listen)
            .await
            .map_err(|source| StartError::Listen {
                what: "gRPC",
                addr: grpc_listen,
                source,
            })?;
    let admin_listener = TcpListener::bind(listen.admin_listen)
        .await
        .map_err(|source| StartError::Listen {
            what: "admin",
            addr: listen.admin_listen,
            source,
        })?;
    let grpc_addr = grpc_listener
        .local_addr()
        .map_err(|source| StartError::Listen {
            what: "gRPC",
            addr: grpc_listen,
            source,
        })?;
    let admin_addr = admin_listener
        .local_addr()
        .map_err(|source| StartError::Listen {
            what: "admin",
            addr: listen.admin_listen,
            source,
        })?;
    let clock = Clock::new();
    let tick_every = allocator.tick_interval;
    let metrics = Metrics::default();
    let readiness = Readiness::default();
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let admin_metrics = census_daemon::http::AdminMetrics::default();
    admin_metrics.register(registry.sub_registry_with_prefix("census"));
    let admin_limits = listen.admin;
    let settings = |store_kind| Settings {
        filter: labels.filter(),
        wire: limits.wire(&labels),
        snapshot_interval: allocator.snapshot_interval,
        max_message_bytes: limits.max_message_bytes(),
        store_kind,
    };
    let (runtime, writers, cluster) = match kind {
        StoreKind::Redb => {
            let cfg = allocator.config();
            let path = store_path.clone();
            let options = RedbOptions {
                cache_bytes: store_cache_bytes,
                ..RedbOptions::default()
            };
            let redb =
                tokio::task::spawn_blocking(move || RedbStore::open(&path, options)).await??;
            info!(path = %store_path.display(), "opened the redb store");
            let store: Arc<dyn Store> = Arc::new(redb);
            let loaded = store.load().await?;
            info!(
                identities = loaded.identities.len(),
                nodes = loaded.nodes.len(),
                tombstones = loaded.tombstones.len(),
                "loaded the store"
            );
            let alloc = Allocator::new(cfg, loaded, clock.now());
            let (runtime, queues) =
                Runtime::new(alloc, clock, settings(store.kind()), metrics.clone());
            let writers = writer::spawn(queues, store, metrics.clone(), store_timeout);
            ServiceAddresses::new(service_args.ranges(), runtime.clone());
            (runtime, writers, None)
        }
        StoreKind::Kubernetes => {
            let settings = settings("kubernetes");
            let parts = k8s::Parts {
                cfg: allocator.cluster_config(),
                limits: settings.wire.labels,
                store_timeout,
                grpc_addr,
                clock,
                settings,
                metrics: metrics.clone(),
                readiness: readiness.clone(),
                service_cidrs: service_args.ranges(),
            };
            let cluster = k8s::start(&kubernetes, parts).await?;
            registry.register_collector(cluster.store.collector());
            registry.register_collector(cluster.collector());
            (cluster.runtime.clone(), Vec::new(), Some(cluster))
        }
    };
    registry.register_collector(Box::new(CoreCollector::new(runtime.clone())));
    registry.register_collector(Box::new(census_daemon::ProcessCollector::new()));
    let registry = Arc::new(registry);

    let auth = authenticator(
        security.mode,
        grpc_addr,
        cluster.as_ref().map(|c| &c.tokens),
    )?;
    let tls = security.tls;
    let (shutdown, stop) = watch::channel(false);
    let mut servers = Vec::new();
    let map = map.config();
    servers.push(runtime.serve_map(map, Arc::new(grpc::WireMap), stop.clone()));
    {
        let runtime = runtime.clone();
        let mut stop = stop.clone();
        servers.push(tokio::spawn(async move {
            let mut interval = tokio::time::interval(tick_every);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = interval.tick() => runtime.tick(),
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        }));
    }
    {
        let runtime = runtime.clone();
        let mut stop = stop.clone();
        servers.push(tokio::spawn(async move {
            let (counters, nodes) = runtime.read(|a| (a.counters().clone(), a.nodes()));
            let mut summary = Summary::new(&counters, &nodes);
            let mut interval = tokio::time::interval(SUMMARY_EVERY);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval.tick().await;
            loop {
                tokio::select! {
                    _ = interval.tick() => {
                        let (counters, nodes) =
                            runtime.read(|a| (a.counters().clone(), a.nodes()));
                        if let Some(line) = summary.line(&counters, &nodes) {
                            info!("in the last {}: {line}", humantime::format_duration(SUMMARY_EVERY));
                        }
                    }
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        }));
    }
    {
        let operator: Arc<dyn Api> = runtime.clone();
        let metrics = metrics.clone();
        let stop = stop.clone();
        servers.push(tokio::spawn(async move {
            let transport = grpc::Transport {
                keepalive: grpc::Keepalive {
                    interval: listen.keepalive_interval,
                    timeout: listen.keepalive_timeout,
                },
                max_connections: listen.max_connections as usize,
                max_streams_per_connection: listen.max_streams_per_connection,
                max_header_list_bytes: listen.max_header_list_bytes,
                handshake_timeout: listen.handshake_timeout,
                idle_timeout: listen.idle_timeout,
                message_timeout: listen.message_timeout,
                quotas: grpc::QuotaLimits {
                    streams_per_node: listen.max_streams_per_node as usize,
                    watches_per_caller: listen.max_watches_per_caller as usize,
                    watches: listen.max_watches as usize,
                    inflight_message_bytes: usize::try_from(listen.max_inflight_message_bytes)
                        .unwrap_or(usize::MAX),
                },
            };
            let served = grpc::serve(
                grpc_listener,
                operator,
                metrics,
                transport,
                map.batch_entries,
                auth,
                tls,
                stop,
            );
            if let Err(e) = served.await {
                tracing::error!(error = %e, "the gRPC server failed");
            }
        }));
    }
    {
        let router = admin::router(registry, readiness.clone());
        servers.push(tokio::spawn(async move {
            let served = census_daemon::http::serve(
                admin_listener,
                router,
                admin_limits,
                admin_metrics,
                stop,
            );
            if let Err(e) = served.await {
                tracing::error!(error = %e, "the admin server failed");
            }
        }));
    }
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
