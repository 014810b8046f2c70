//! Assembles the agent: the endpoint source, the [core](crate::core) and the shells
//! around it — the allocate client, the EndpointSync client, the EndpointMap
//! client, reconcile against the datapath and the admin server — and stops it. The shells know the core, never
//! each other: this module carries events to the core and its effects to them.
//!
//! Stopping never touches the datapath: maps, links and counters stay as they are
//! for the next agent to adopt (fail-static across restarts). `census-agent
//! uninstall` is the only way they go.

use std::{
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use census_proto::{
    domain::{NodeName, SessionId},
    labels::LabelFilter,
};
use prometheus_client::registry::Registry;
use tokio::{
    net::TcpListener,
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tracing::{Instrument as _, debug, error, info, info_span, warn};

use crate::{
    admin::{self, AdminState, Query},
    agent_core::{
        AllocationEvent, Core, Effects, MapEvent, MapLink, MapState, OperatorEvent, OperatorLink,
        Status,
    },
    allocate::AllocateClient,
    bpf::{self, Inspector},
    client::OperatorChannel,
    host::HostIps,
    links::{Changes, LinkEvents, watch_links},
    map::MapClient,
    metrics::{AgentCollector, KindLabels, Metrics},
    reconcile::{self, DatapathPort, Reconciler},
    shutdown::stopped,
    source::{EndpointSource, SourceEvent},
    sync::SyncClient,
};

/// How the agent runs (the command line, resolved).
#[derive(Debug, Clone)]
pub struct Options {
    pub node: NodeName,
    /// The operator's gRPC URI (`http://host:port`).
    pub operator: String,
    /// TLS to the operator, and the bearer token every call carries.
    pub operator_auth: crate::client::OperatorAuth,
    pub admin_listen: SocketAddr,
    /// A listener for probes and Prometheus only (admin::health_router).
    pub health_listen: Option<SocketAddr>,
    /// Each admin listener's connection cap and timeouts.
    pub admin_limits: census_daemon::http::AdminLimits,
    pub reconcile_interval: Duration,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    pub session: SessionId,
    pub host_ips: HostIps,
    /// Attach census first again when another program is found in front of it.
    pub reassert_order: bool,
    /// Watch the operator's cluster-wide endpoint map (off: local-only).
    pub endpoint_map: bool,
    /// Test only (`--test-drop-endpoint-deletes`): send the operator no Delete
    /// delta, leaving every endpoint's end to the next snapshot.
    pub drop_endpoint_deletes: bool,
    /// Where the node's own hooks (uplinks, sockets) go, attached at start and
    /// put back by every full pass; `None`: this agent attaches none.
    pub node_hooks: Option<NodeHooks>,
}

pub use crate::reconcile::NodeHooks;

/// How long an operator without EndpointMap is left alone before it is asked again.
const UNSUPPORTED_RETRY: Duration = Duration::from_secs(600);

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    OperatorTls(crate::client::ClientTlsError),
    #[error("cannot listen on {addr} (admin): {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("reading ENDPOINTS at start failed: {0}")]
    ReadMaps(#[source] bpf::Error),
}

/// A new session: this process's start time in ns and a random nonce.
pub fn new_session() -> SessionId {
    let start_time_ns = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    SessionId {
        start_time_ns,
        nonce: rand::random(),
    }
}

/// A running agent.
#[derive(Debug)]
pub struct Running {
    pub admin_addr: SocketAddr,
    pub health_addr: Option<SocketAddr>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Stops every task; the datapath stays as it is.
    pub async fn shut_down(self) {
        let _ = self.shutdown.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        info!("stopped; the datapath stays in place");
    }
}

/// Starts the agent on `maps` (the loaded [`bpf::Datapath`] in production; the
/// crate's tests pass an in-memory one), with `pinned` for reading FLOWS at scrape
/// time, and endpoints from `source`.
#[expect(
    private_bounds,
    reason = "the datapath port is the crate's own: outside it, only bpf::Datapath has it"
)]
pub async fn start<M>(
    options: Options,
    mut maps: M,
    pinned: Option<Inspector>,
    source: Box<dyn EndpointSource>,
) -> Result<Running, StartError>
where
    M: DatapathPort + Send + 'static,
{
    let Options {
        node,
        operator,
        operator_auth,
        admin_listen,
        health_listen,
        admin_limits,
        reconcile_interval,
        initial_backoff,
        max_backoff,
        session,
        host_ips,
        reassert_order,
        endpoint_map,
        drop_endpoint_deletes,
        node_hooks,
    } = options;
    let metrics = Metrics::default();
    let clients = Clients {
        channel: operator_channel(&operator, &operator_auth)?,
        node: node.clone(),
        session,
        initial_backoff,
        max_backoff,
        metrics: metrics.clone(),
    };
    let (mut core, entries) = adopt(&maps, &node)?;
    info!(%node, %session, operator, entries, "starting");

    let (status_tx, status_rx) = watch::channel(Status::default());
    let pinned = pinned.map(Arc::new);
    let (registry, admin_metrics) = registry(&metrics, &status_rx, &pinned);
    let servers =
        AdminServers::bind(admin_listen, health_listen, admin_limits, admin_metrics).await?;
    let admin_addr = servers.admin_addr;

    let (shutdown, stop) = watch::channel(false);
    let mut tasks = Vec::new();
    let (links, routes) = watch_link_events(&mut tasks);
    let source = spawn_source(source, routes, &stop, &mut tasks);
    let sync = clients.spawn_sync(host_ips.clone(), drop_endpoint_deletes, &stop, &mut tasks);
    let map = clients.spawn_map(endpoint_map, &mut core, &sync.connected, &stop, &mut tasks);
    let (allocate, allocations) = clients.allocate(sync.connected);

    let reconciler = reconciler(&metrics, reassert_order, node_hooks, &mut maps);
    let (query_tx, query_rx) = mpsc::channel(16);
    let wiring = Wiring {
        core,
        reconciler,
        maps,
        allocate,
        reports: sync.reports,
        source_filter: source.filter,
        ready: sync.ready,
        metrics,
        status: status_tx,
        host_ips,
        reconcile_interval,
    };
    let inputs = Inputs {
        links,
        source: source.events,
        allocations,
        operator: sync.operator,
        link: sync.link,
        map: map.events,
        map_link: map.link,
        queries: query_rx,
        stop: stop.clone(),
    };
    let span = info_span!("core", %node, %session);
    tasks.push(tokio::spawn(wiring.run(inputs).instrument(span)));

    let admin_state = AdminState {
        registry: Arc::new(registry),
        node: node.to_string(),
        operator_address: operator,
        session: session.to_string(),
        source: source.description,
        status: status_rx,
        queries: query_tx,
        maps: pinned,
    };
    let health_addr = servers.spawn(admin_state, &stop, &mut tasks);
    Ok(Running {
        admin_addr,
        health_addr,
        shutdown,
        tasks,
    })
}

/// The core, given what a previous run left in the datapath: ENDPOINTS' entries to
/// adopt, the interfaces the classifier is attached to, the nodes and services
/// pinned; and how many ENDPOINTS entries were found.
fn adopt<M: DatapathPort>(maps: &M, node: &NodeName) -> Result<(Core, usize), StartError> {
    let found = maps.read_endpoints().map_err(StartError::ReadMaps)?;
    let attached = reconcile::attached_at_start(maps);
    let pinned_nodes = reconcile::pinned_nodes(maps);
    let pinned_services = reconcile::pinned_services(maps);
    let core = Core::new(reconcile::adoptable(&found))
        .with_attached(attached)
        .with_node(node.clone(), pinned_nodes)
        .with_services(pinned_services);
    Ok((core, found.len()))
}

/// The core's ends of the endpoint source.
struct SourceEnds {
    /// What the source reads, for the admin API.
    description: String,
    /// Its copy of the operator's label filter, if it filters labels itself.
    filter: Option<watch::Sender<LabelFilter>>,
    events: mpsc::Receiver<SourceEvent>,
}

/// The endpoint source, told of the node's link and route changes, as a task of
/// `tasks` until `stop`.
fn spawn_source(
    mut source: Box<dyn EndpointSource>,
    routes: watch::Receiver<u64>,
    stop: &watch::Receiver<bool>,
    tasks: &mut Vec<JoinHandle<()>>,
) -> SourceEnds {
    source.watch_routes(routes);
    let description = source.describe();
    let filter = source.label_filter();
    let (events_tx, events) = mpsc::channel(64);
    tasks.push(tokio::spawn(source.run(events_tx, stop.clone())));
    SourceEnds {
        description,
        filter,
        events,
    }
}

/// What every client of the operator is built from.
struct Clients {
    channel: OperatorChannel,
    node: NodeName,
    session: SessionId,
    initial_backoff: Duration,
    max_backoff: Duration,
    metrics: Metrics,
}

/// The core's ends of the EndpointSync client.
struct SyncEnds {
    reports: mpsc::UnboundedSender<crate::agent_core::Report>,
    operator: mpsc::Receiver<OperatorEvent>,
    link: watch::Receiver<OperatorLink>,
    ready: watch::Sender<bool>,
    /// True while the stream is up: Allocate and EndpointMap wait for it.
    connected: watch::Receiver<bool>,
}

/// The core's ends of the EndpointMap client; closed when there is none.
struct MapEnds {
    events: mpsc::Receiver<MapEvent>,
    link: watch::Receiver<MapLink>,
}

impl Clients {
    /// The EndpointSync client, reporting this node's endpoints to the operator, as
    /// a task of `tasks` until `stop`.
    fn spawn_sync(
        &self,
        host_ips: HostIps,
        drop_deletes: bool,
        stop: &watch::Receiver<bool>,
        tasks: &mut Vec<JoinHandle<()>>,
    ) -> SyncEnds {
        let (reports_tx, reports_rx) = mpsc::unbounded_channel();
        let (operator_tx, operator_rx) = mpsc::channel(1024);
        let (link_tx, link_rx) = watch::channel(OperatorLink::default());
        let (ready_tx, ready_rx) = watch::channel(false);
        let (connected_tx, connected_rx) = watch::channel(false);
        let sync = SyncClient {
            channel: self.channel.clone(),
            node: self.node.clone(),
            session: self.session,
            initial_backoff: self.initial_backoff,
            max_backoff: self.max_backoff,
            metrics: self.metrics.clone(),
            status: link_tx,
            connected: connected_tx,
            host_ips,
            drop_deletes,
        };
        tasks.push(tokio::spawn(sync.run(
            reports_rx,
            operator_tx,
            ready_rx,
            stop.clone(),
        )));
        SyncEnds {
            reports: reports_tx,
            operator: operator_rx,
            link: link_rx,
            ready: ready_tx,
            connected: connected_rx,
        }
    }

    /// The operator's cluster-wide endpoint map, watched into the core as a task of
    /// `tasks` until `stop`; without it (`--no-endpoint-map`), the core is told it
    /// is local-only.
    fn spawn_map(
        &self,
        enabled: bool,
        core: &mut Core,
        connected: &watch::Receiver<bool>,
        stop: &watch::Receiver<bool>,
        tasks: &mut Vec<JoinHandle<()>>,
    ) -> MapEnds {
        let (map_tx, map_rx) = mpsc::channel(16);
        let (map_link_tx, map_link_rx) = watch::channel(MapLink::default());
        if enabled {
            let map = MapClient {
                channel: self.channel.clone(),
                node: self.node.clone(),
                session: self.session,
                initial_backoff: self.initial_backoff,
                max_backoff: self.max_backoff,
                unsupported_retry: UNSUPPORTED_RETRY,
                metrics: self.metrics.clone(),
                status: map_link_tx,
            };
            tasks.push(tokio::spawn(map.run(
                map_tx,
                connected.clone(),
                stop.clone(),
            )));
        } else {
            info!("the endpoint map watch is off (--no-endpoint-map): this agent is local-only");
            core.on_map(MapEvent::LocalOnly);
            core.set_map_link(MapLink {
                state: MapState::Disabled,
                last_error: None,
            });
        }
        MapEnds {
            events: map_rx,
            link: map_link_rx,
        }
    }

    /// The Allocate client, and where its answers arrive.
    fn allocate(
        self,
        connected: watch::Receiver<bool>,
    ) -> (AllocateClient, mpsc::Receiver<AllocationEvent>) {
        let (alloc_tx, alloc_rx) = mpsc::channel(1024);
        let client = AllocateClient::new(
            self.channel,
            self.node,
            self.session,
            alloc_tx,
            connected,
            self.max_backoff,
            self.metrics,
        );
        (client, alloc_rx)
    }
}

/// The reconciler, with the node's own hooks attached at once, not at the first
/// full pass: what is missing is logged now, and reported by every full pass until
/// it is attached.
fn reconciler<M: DatapathPort>(
    metrics: &Metrics,
    reassert_order: bool,
    node_hooks: Option<NodeHooks>,
    maps: &mut M,
) -> Reconciler {
    let mut reconciler = Reconciler::new(metrics.clone())
        .reassert_order(reassert_order)
        .node_hooks(node_hooks);
    reconciler.repair_node_hooks(maps);
    reconciler
}

/// Link changes, so that interfaces re-created under the agent get the classifier
/// back at once; link and route changes, so that a pod whose device was not found
/// yet is looked up again. Without them (the socket cannot be opened), the full
/// pass and the source's periodic lookup do.
fn watch_link_events(
    tasks: &mut Vec<JoinHandle<()>>,
) -> (watch::Receiver<u64>, watch::Receiver<u64>) {
    let (links_tx, links_rx) = watch::channel(0);
    let (routes_tx, routes_rx) = watch::channel(0);
    let changes = Changes {
        links: links_tx,
        routes: routes_tx,
    };
    match LinkEvents::open() {
        Ok(events) => tasks.push(tokio::spawn(watch_links(events, changes))),
        Err(error) => warn!(
            %error,
            "cannot watch link changes; a re-created interface waits for the full pass"
        ),
    }
    (links_rx, routes_rx)
}

/// The agent's metrics registry: its own metrics, the admin servers' (returned),
/// its collector of the core's status and pinned maps, the process's.
fn registry(
    metrics: &Metrics,
    status: &watch::Receiver<Status>,
    pinned: &Option<Arc<Inspector>>,
) -> (Registry, census_daemon::http::AdminMetrics) {
    let mut registry = Registry::default();
    metrics.register(&mut registry);
    let admin_metrics = census_daemon::http::AdminMetrics::default();
    admin_metrics.register(registry.sub_registry_with_prefix("census_agent"));
    registry.register_collector(Box::new(AgentCollector::new(
        status.clone(),
        pinned.clone(),
    )));
    registry.register_collector(Box::new(census_daemon::ProcessCollector::new()));
    (registry, admin_metrics)
}

/// The admin server, and the health and metrics server if one is asked for.
struct AdminServers {
    admin: TcpListener,
    admin_addr: SocketAddr,
    health: Option<(TcpListener, SocketAddr)>,
    limits: census_daemon::http::AdminLimits,
    metrics: census_daemon::http::AdminMetrics,
}

impl AdminServers {
    /// Listens on `admin` (and on `health`, if given).
    async fn bind(
        admin: SocketAddr,
        health: Option<SocketAddr>,
        limits: census_daemon::http::AdminLimits,
        metrics: census_daemon::http::AdminMetrics,
    ) -> Result<Self, StartError> {
        let listen = |addr| async move {
            admin::bind(addr)
                .await
                .map_err(|source| StartError::Listen { addr, source })
        };
        let (admin, admin_addr) = listen(admin).await?;
        let health = match health {
            Some(addr) => Some(listen(addr).await?),
            None => None,
        };
        Ok(Self {
            admin,
            admin_addr,
            health,
            limits,
            metrics,
        })
    }

    /// Serves `state` until `stop`, each server a task of `tasks`; the health
    /// server's address.
    fn spawn(
        self,
        state: AdminState,
        stop: &watch::Receiver<bool>,
        tasks: &mut Vec<JoinHandle<()>>,
    ) -> Option<SocketAddr> {
        let Self {
            admin,
            admin_addr,
            health,
            limits,
            metrics,
        } = self;
        let router = admin::router(state.clone());
        let mut health_addr = None;
        if let Some((health, addr)) = health {
            let router = admin::health_router(state);
            let (stop, metrics) = (stop.clone(), metrics.clone());
            tasks.push(tokio::spawn(async move {
                let served = census_daemon::http::serve(health, router, limits, metrics, stop);
                if let Err(e) = served.await {
                    error!(error = %e, "the health and metrics server failed");
                }
            }));
            info!(%addr, "health and metrics server listening");
            health_addr = Some(addr);
        }
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let served = census_daemon::http::serve(admin, router, limits, metrics, stop);
            if let Err(e) = served.await {
                error!(error = %e, "the admin server failed");
            }
        }));
        info!(%admin_addr, "admin server listening");
        health_addr
    }
}

/// A lazily connected channel to the operator: calls fail fast while it is away,
/// and it reconnects by itself.
fn operator_channel(
    address: &str,
    auth: &crate::client::OperatorAuth,
) -> Result<OperatorChannel, StartError> {
    let endpoint =
        crate::client::endpoint(address, auth.tls.as_ref()).map_err(StartError::OperatorTls)?;
    let channel = endpoint
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
        .connect_lazy();
    Ok(crate::client::with_token(channel, auth.token_file.clone()))
}

/// Seconds from `ms` since the Unix epoch (another host's clock) to now; 0 for a
/// time ahead of this host's clock.
fn since_ms(ms: u64) -> f64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Duration::from_millis(now.saturating_sub(ms)).as_secs_f64()
}

/// What woke the core.
enum Step {
    Source(Option<SourceEvent>),
    Allocation(AllocationEvent),
    Operator(OperatorEvent),
    Link,
    Map(MapEvent),
    MapLink,
    /// A link of the node was added, changed or removed.
    Links,
    Query(Query),
    Tick,
}

/// What the core's task listens to.
struct Inputs {
    source: mpsc::Receiver<SourceEvent>,
    allocations: mpsc::Receiver<AllocationEvent>,
    operator: mpsc::Receiver<OperatorEvent>,
    link: watch::Receiver<OperatorLink>,
    map: mpsc::Receiver<MapEvent>,
    map_link: watch::Receiver<MapLink>,
    /// Bumped at every link change of the node.
    links: watch::Receiver<u64>,
    queries: mpsc::Receiver<Query>,
    stop: watch::Receiver<bool>,
}

/// The core and the shells its effects go to, on the core's task.
struct Wiring<M> {
    core: Core,
    reconciler: Reconciler,
    maps: M,
    allocate: AllocateClient,
    reports: mpsc::UnboundedSender<crate::agent_core::Report>,
    /// The source's copy of the operator's label filter, if it filters labels itself.
    source_filter: Option<watch::Sender<LabelFilter>>,
    ready: watch::Sender<bool>,
    metrics: Metrics,
    /// The core's status, for the admin API and the metrics.
    status: watch::Sender<Status>,
    host_ips: HostIps,
    reconcile_interval: Duration,
}

impl<M: DatapathPort> Wiring<M> {
    async fn run(mut self, inputs: Inputs) {
        let Inputs {
            mut source,
            mut allocations,
            mut operator,
            mut link,
            mut map,
            mut map_link,
            mut links,
            mut queries,
            mut stop,
        } = inputs;
        let mut tick = tokio::time::interval(self.reconcile_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let was_synced = self.core.synced();
            let was_complete = self.core.map_complete();
            let step = tokio::select! {
                event = source.recv() => Step::Source(event),
                Some(event) = allocations.recv() => Step::Allocation(event),
                Some(event) = operator.recv() => Step::Operator(event),
                Ok(()) = link.changed() => Step::Link,
                Some(event) = map.recv() => Step::Map(event),
                Ok(()) = map_link.changed() => Step::MapLink,
                Ok(()) = links.changed() => Step::Links,
                Some(query) = queries.recv() => Step::Query(query),
                _ = tick.tick() => Step::Tick,
                () = stopped(&mut stop) => return,
            };
            let mut full_pass = false;
            // When the operator built the batch whose entries this step writes.
            let mut built_at_ms = None;
            match step {
                Step::Source(Some(event)) => {
                    if let SourceEvent::Failed(failure) = &event {
                        self.metrics
                            .source_errors
                            .get_or_create(&KindLabels { kind: failure.kind })
                            .inc();
                    }
                    self.core.on_source(event);
                }
                Step::Source(None) => {
                    warn!("the endpoint source stopped; the last set stays in force");
                    stopped(&mut stop).await;
                    return;
                }
                Step::Allocation(event) => {
                    self.allocate.answered(&event);
                    self.core.on_allocation(event);
                }
                Step::Operator(event) => {
                    let settings = matches!(event, OperatorEvent::Settings(_));
                    self.core.on_operator(event);
                    if settings {
                        self.share_filter();
                    }
                }
                Step::Link => {
                    let link = link.borrow_and_update().clone();
                    self.core.set_operator_link(link);
                }
                Step::Map(event) => built_at_ms = self.on_map(event),
                Step::MapLink => {
                    let link = map_link.borrow_and_update().clone();
                    self.core.set_map_link(link);
                }
                Step::Links => {
                    links.borrow_and_update();
                    self.link_pass();
                }
                Step::Query(Query::Endpoints(reply)) => {
                    let _ = reply.send(self.core.view());
                }
                Step::Tick => {
                    match self.host_ips.read() {
                        Ok(ips) => self.core.set_host_ips(ips),
                        Err(error) => warn!(%error, "cannot read the node's addresses"),
                    }
                    full_pass = true;
                }
            }
            self.after_step(built_at_ms, was_synced, was_complete, full_pass);
        }
    }

    /// A batch of the endpoint map into the core; when the operator built it, if it
    /// changed anything.
    fn on_map(&mut self, event: MapEvent) -> Option<u64> {
        let built = match &event {
            MapEvent::Batch(batch) => batch.built_at_ms,
            MapEvent::LocalOnly => 0,
        };
        let applied = self.core.on_map(event);
        if applied.skipped > 0 {
            self.metrics.map_malformed.inc_by(applied.skipped as u64);
            warn!(
                skipped = applied.skipped,
                "skipped endpoint map entries naming a node the operator never announced"
            );
        }
        (applied.changed > 0 && built > 0).then_some(built)
    }

    /// What every step ends with: the core's effects applied, a full pass when one
    /// is due (asked for, the first full set of endpoints, the first whole map), the
    /// status published.
    fn after_step(
        &mut self,
        built_at_ms: Option<u64>,
        was_synced: bool,
        was_complete: bool,
        mut full_pass: bool,
    ) {
        self.apply_all();
        if let Some(built) = built_at_ms {
            self.metrics.map_propagation.observe(since_ms(built));
        }
        if !was_synced && self.core.synced() {
            // The first full set: what it does not list can go now.
            full_pass = true;
            let _ = self.ready.send(true);
            info!(
                endpoints = self.core.len(),
                "the first full set of endpoints is in place"
            );
        }
        if !was_complete && self.core.map_complete() {
            // The first whole map: what a previous run pinned and it lacks goes now.
            full_pass = true;
            info!(
                nodes = self.core.status().map.nodes,
                "the first full endpoint map is in place"
            );
        }
        if full_pass {
            self.full_pass();
            self.apply_all();
        }
        self.status.send_replace(self.core.status());
    }

    /// Hands the operator's label filter to a source that filters labels itself.
    fn share_filter(&self) {
        let Some(filter) = &self.source_filter else {
            return;
        };
        let wanted = self.core.label_filter();
        filter.send_if_modified(|f| {
            let changed = f != wanted;
            if changed {
                f.clone_from(wanted);
            }
            changed
        });
    }

    /// Carries the core's effects to the shells until there are none: what
    /// reconcile did can change the desired entries (an address becomes LOCAL
    /// once its interface is attached, and stops being LOCAL when that fails).
    fn apply_all(&mut self) {
        // Each round settles the interfaces it attached; a few rounds at most.
        for _ in 0..4 {
            let fx = self.core.take_effects();
            if fx.is_empty() {
                return;
            }
            self.apply(fx);
        }
    }

    /// Carries the core's effects to the shells, and what reconcile did back.
    fn apply(&mut self, fx: Effects) {
        if fx.is_empty() {
            return;
        }
        let reconciled = self.reconciler.apply(&mut self.maps, &fx);
        let Effects {
            allocations,
            reports,
            ..
        } = fx;
        for allocation in allocations {
            self.allocate.apply(allocation);
        }
        for report in reports {
            // The sync task lives as long as this one.
            let _ = self.reports.send(report);
        }
        self.core.on_reconciled(reconciled);
    }

    /// The links part of the full pass, after a link change: cheap (the node's
    /// interfaces), so it runs at once.
    fn link_pass(&mut self) {
        let desired = self.core.desired_interfaces();
        let prune = self.core.synced();
        let reconciled = self.reconciler.link_pass(&mut self.maps, &desired, prune);
        self.core.on_reconciled(reconciled);
    }

    fn full_pass(&mut self) {
        let started = Instant::now();
        let desired = self.core.desired();
        let prune = self.core.synced();
        let report = self.reconciler.full_pass(&mut self.maps, &desired, prune);
        let took = started.elapsed();
        self.metrics.full_pass_duration.observe(took.as_secs_f64());
        if report.repaired + report.removed + report.pruned > 0 {
            info!(
                repaired = report.repaired,
                removed = report.removed,
                pruned_links = report.pruned,
                "full pass repaired the datapath"
            );
        }
        debug!(
            ?took,
            entries = desired.entries.len(),
            written = report.written,
            "full pass"
        );
        let reconciled = self.reconciler.pass_outcome(&desired, report);
        self.core.on_reconciled(reconciled);
        // A full pass re-reads the endpoints file too (the source's own timer).
    }
}

#[cfg(test)]
mod tests;
