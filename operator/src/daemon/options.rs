//! The operator's command line resolved into what the daemon is wired from, before
//! anything is opened or bound: a refused start changes nothing.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use tracing::warn;

use super::StartError;
use crate::{
    api::Settings,
    config::{AllocatorArgs, Cli, KubernetesArgs, StoreArgs, StoreKind},
    grpc,
    runtime::MapConfig,
    security::{self, Security},
};

/// What the daemon is wired from.
#[derive(Debug)]
pub(crate) struct Options {
    /// Who may call, the gRPC address (which the TLS mode decides) and its TLS.
    pub(crate) security: Security,
    pub(crate) admin_listen: SocketAddr,
    pub(crate) admin_limits: census_daemon::http::AdminLimits,
    /// What the gRPC server's connections and callers are held to.
    pub(crate) transport: grpc::Transport,
    pub(crate) heap_profiling: bool,
    pub(crate) store: StoreOptions,
    pub(crate) allocator: AllocatorArgs,
    /// What the operator tells agents and checks requests by; `store_kind` is
    /// filled in once the store is open.
    pub(crate) settings: Settings,
    pub(crate) map: MapConfig,
    pub(crate) service_cidrs: Vec<ipnet::IpNet>,
    pub(crate) kubernetes: KubernetesArgs,
}

/// Where identities are kept.
#[derive(Debug)]
pub(crate) struct StoreOptions {
    pub(crate) kind: StoreKind,
    pub(crate) path: PathBuf,
    pub(crate) cache_bytes: usize,
    /// How long a store write may take before it is retried.
    pub(crate) timeout: Duration,
}

impl Options {
    /// Checks and resolves `cli` (the TLS files are read here).
    pub(crate) fn resolve(cli: Cli) -> Result<Self, StartError> {
        let Cli {
            listen,
            store,
            allocator,
            labels,
            limits,
            map,
            services,
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
        } = store;
        let max_message_bytes = limits.max_message_bytes();
        if listen.max_inflight_message_bytes < max_message_bytes as u64 {
            return Err(StartError::MessageBudget {
                budget: listen.max_inflight_message_bytes,
                limit: max_message_bytes,
            });
        }
        if let Some(warning) = census_daemon::fds::over_limit(
            "--max-connections",
            u64::from(listen.max_connections),
            census_daemon::fds::soft_limit(),
        ) {
            warn!("{warning}");
        }
        let security = security::resolve(
            &listen.tls,
            listen.grpc_listen,
            kind,
            listen.handshake_timeout,
        )?;
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
        let settings = Settings {
            filter: labels.filter(),
            wire: limits.wire(&labels),
            snapshot_interval: allocator.snapshot_interval,
            max_message_bytes,
            store_kind: "",
        };
        Ok(Self {
            security,
            admin_listen: listen.admin_listen,
            admin_limits: listen.admin,
            transport,
            heap_profiling: profiling.heap_profiling,
            store: StoreOptions {
                kind,
                path: store_path,
                cache_bytes: store_cache_bytes,
                timeout: store_timeout,
            },
            allocator,
            settings,
            map: map.config(),
            service_cidrs: services.ranges(),
            kubernetes,
        })
    }
}
