//! Assembles the operator: store, core, writers, tick loop, gRPC and admin servers;
//! and takes it down in order on shutdown.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use prometheus_client::registry::Registry;
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};
use tracing::{info, warn};

use crate::{
    admin::{self, Readiness},
    allocator::Allocator,
    config::{Cli, StoreArgs, StoreKind},
    grpc,
    metrics::{CoreCollector, Metrics},
    runtime::{Clock, Runtime, Settings},
    store::{
        Store, StoreError,
        redb::{RedbOptions, RedbStore},
    },
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
}

/// How long shutdown waits for writes in flight to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// A running operator.
#[derive(Debug)]
pub struct Running {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub runtime: Arc<Runtime>,
    pub readiness: Readiness,
    shutdown: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    writers: Vec<JoinHandle<()>>,
}

/// Opens the store, loads it, and starts serving.
pub async fn start(cli: Cli) -> Result<Running, StartError> {
    let Cli {
        listen,
        store: store_args,
        allocator,
        labels,
        limits,
        log: _,
        profiling,
    } = cli;
    let StoreArgs {
        kind,
        store_path,
        store_cache_bytes,
        store_timeout,
    } = store_args;
    let census_daemon::ProfilingArgs { heap_profiling } = profiling;
    if heap_profiling {
        census_daemon::profiling::activate().await?;
        info!("jemalloc heap profiling is on: /debug/pprof/heap on the admin port");
    }
    let cfg = allocator.config();
    let store: Arc<dyn Store> = match kind {
        StoreKind::Redb => {
            let path = store_path.clone();
            let options = RedbOptions {
                cache_bytes: store_cache_bytes,
                ..RedbOptions::default()
            };
            let redb =
                tokio::task::spawn_blocking(move || RedbStore::open(&path, options)).await??;
            info!(path = %store_path.display(), "opened the redb store");
            Arc::new(redb)
        }
    };
    let loaded = store.load().await?;
    info!(
        identities = loaded.identities.len(),
        nodes = loaded.nodes.len(),
        tombstones = loaded.tombstones.len(),
        "loaded the store"
    );
    let clock = Clock::new();
    let settings = Settings {
        filter: labels.filter(),
        wire: limits.wire(&labels),
        snapshot_interval: cfg.snapshot_interval,
        max_message_bytes: limits.max_message_bytes(),
        store_kind: store.kind(),
    };
    let tick_every = allocator.tick_interval;
    let alloc = Allocator::new(cfg, loaded, clock.now());
    let metrics = Metrics::default();
    let (runtime, queues) = Runtime::new(alloc, clock, settings, metrics.clone());
    let writers = writer::spawn(queues, store.clone(), runtime.clone(), store_timeout);

    let mut registry = Registry::default();
    metrics.register(&mut registry);
    registry.register_collector(Box::new(CoreCollector::new(runtime.clone())));
    registry.register_collector(Box::new(census_daemon::ProcessCollector::new()));
    let registry = Arc::new(registry);

    let grpc_listener = TcpListener::bind(listen.grpc_listen)
        .await
        .map_err(|source| StartError::Listen {
            what: "gRPC",
            addr: listen.grpc_listen,
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
            addr: listen.grpc_listen,
            source,
        })?;
    let admin_addr = admin_listener
        .local_addr()
        .map_err(|source| StartError::Listen {
            what: "admin",
            addr: listen.admin_listen,
            source,
        })?;

    let (shutdown, stop) = watch::channel(false);
    let readiness = Readiness::default();
    let mut servers = Vec::new();
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
        let stop = stop.clone();
        servers.push(tokio::spawn(async move {
            if let Err(e) = grpc::serve(grpc_listener, runtime, stop).await {
                tracing::error!(error = %e, "the gRPC server failed");
            }
        }));
    }
    {
        let router = admin::router(registry, readiness.clone());
        servers.push(tokio::spawn(async move {
            if let Err(e) = admin::serve(admin_listener, router, stop).await {
                tracing::error!(error = %e, "the admin server failed");
            }
        }));
    }
    readiness.set_ready(format!(
        "store {} loaded, gRPC on {grpc_addr}",
        store.kind()
    ));
    info!(%grpc_addr, %admin_addr, "serving");
    Ok(Running {
        grpc_addr,
        admin_addr,
        runtime,
        readiness,
        shutdown,
        servers,
        writers,
    })
}

impl Running {
    /// Stops serving: agent streams are told to reconnect, writes in flight finish
    /// (up to a timeout), then everything ends.
    pub async fn shut_down(self) {
        self.readiness.set_not_ready("shutting down");
        let _ = self.shutdown.send(true);
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
