//! The EndpointMap client against a real gRPC server over loopback (a small
//! EndpointMap service whose streams each test feeds), with the core and
//! reconcile on the fake datapath behind it, as the daemon wires them.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use census_proto::pb::endpoint_map_server::{EndpointMap, EndpointMapServer};
use census_testkit::{TestResult, fail, lazy_channel};
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, service::Routes, transport::Server};

use super::*;
use crate::{
    agent_core::Core,
    bpf,
    daemon::new_session,
    reconcile::{MapKey, Reconciler, fake::FakeMaps},
};

const WAIT: Duration = Duration::from_secs(10);
const OWN: &str = "n1";

type Batches = mpsc::Sender<Result<pb::EndpointMapBatch, Status>>;

/// An EndpointMap service whose streams the test feeds: every Watch hands the
/// test its request and the sending side of its stream.
struct Scripted {
    streams: mpsc::UnboundedSender<(pb::EndpointMapWatchRequest, Batches)>,
    /// Answer every Watch UNIMPLEMENTED (still handing the test its request).
    refuse: bool,
}

#[tonic::async_trait]
impl EndpointMap for Scripted {
    type WatchStream = ReceiverStream<Result<pb::EndpointMapBatch, Status>>;

    async fn watch(
        &self,
        request: Request<pb::EndpointMapWatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let (tx, rx) = mpsc::channel(16);
        let _ = self.streams.send((request.into_inner(), tx));
        if self.refuse {
            return Err(Status::unimplemented("census.v1.EndpointMap"));
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn lookup(
        &self,
        _: Request<pb::EndpointMapLookupRequest>,
    ) -> Result<Response<pb::EndpointMapLookupResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

/// A server on `listener` until `stop`: the scripted service, or (`None`) a
/// server without EndpointMap, which answers every call UNIMPLEMENTED as an
/// older operator's tonic server does (tonic's `Routes` fallback).
fn serve(
    listener: TcpListener,
    scripted: Option<Scripted>,
) -> (oneshot::Sender<()>, JoinHandle<()>) {
    let (stop, stopped) = oneshot::channel::<()>();
    let routes = match scripted {
        Some(service) => Routes::new(EndpointMapServer::new(service)),
        None => Routes::default(),
    };
    let task = tokio::spawn(async move {
        let _ = Server::builder()
            .add_routes(routes)
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            })
            .await;
    });
    (stop, task)
}

/// The client under test, and the core and reconcile it feeds.
struct Agent {
    core: Core,
    reconciler: Reconciler,
    maps: FakeMaps,
    events: mpsc::Receiver<MapEvent>,
    link: watch::Receiver<MapLink>,
    metrics: Metrics,
    session: SessionId,
    _stop: watch::Sender<bool>,
    _connected: watch::Sender<bool>,
}

fn agent(addr: SocketAddr) -> TestResult<Agent> {
    let (events_tx, events) = mpsc::channel(16);
    let (link_tx, link) = watch::channel(MapLink::default());
    let (stop, stop_rx) = watch::channel(false);
    let (connected, connected_rx) = watch::channel(true);
    let metrics = Metrics::default();
    let session = new_session();
    let client = MapClient {
        channel: crate::client::plain(lazy_channel(addr)?),
        node: NodeName::new(OWN)?,
        session,
        initial_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(100),
        unsupported_retry: Duration::from_millis(50),
        metrics: metrics.clone(),
        status: link_tx,
    };
    tokio::spawn(client.run(events_tx, connected_rx, stop_rx));
    Ok(Agent {
        core: Core::new(Default::default()).with_node(NodeName::new(OWN)?, []),
        reconciler: Reconciler::default(),
        maps: FakeMaps::default(),
        events,
        link,
        metrics,
        session,
        _stop: stop,
        _connected: connected,
    })
}

impl Agent {
    /// The client's next event, carried through the core to the datapath.
    async fn next(&mut self) -> TestResult<()> {
        let Ok(Some(event)) = tokio::time::timeout(WAIT, self.events.recv()).await else {
            return fail("no event from the map client");
        };
        self.core.on_map(event);
        let fx = self.core.take_effects();
        let done = self.reconciler.apply(&mut self.maps, &fx);
        self.core.on_reconciled(done);
        Ok(())
    }

    /// The REMOTE entries: address -> (identity, the name NODES gives its node).
    fn remote(&self) -> BTreeMap<String, (u32, String)> {
        self.maps
            .entries
            .iter()
            .filter_map(|(key, e)| {
                let node = e.remote_node()?;
                let name = self
                    .maps
                    .nodes
                    .get(&node.get())
                    .map_or_else(|| format!("no NODES {node}"), |n| n.name.clone());
                Some((key.ip()?.to_string(), (e.identity, name)))
            })
            .collect()
    }

    async fn state(&mut self, want: MapState) -> TestResult<()> {
        let reached = tokio::time::timeout(WAIT, self.link.wait_for(|l| l.state == want))
            .await
            .is_ok_and(|r| r.is_ok());
        if reached {
            return Ok(());
        }
        fail(format!(
            "the map link is not {want:?}: {:?}",
            *self.link.borrow()
        ))
    }
}

async fn next_stream(
    streams: &mut mpsc::UnboundedReceiver<(pb::EndpointMapWatchRequest, Batches)>,
) -> TestResult<(pb::EndpointMapWatchRequest, Batches)> {
    match tokio::time::timeout(WAIT, streams.recv()).await {
        Ok(Some(stream)) => Ok(stream),
        _ => fail("the client opened no Watch"),
    }
}

fn v4(address: &str) -> Vec<u8> {
    match address.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.octets().to_vec(),
        Ok(IpAddr::V6(v6)) => v6.octets().to_vec(),
        Err(_) => Vec::new(),
    }
}

fn node(index: u32, name: &str) -> pb::MapNode {
    pb::MapNode {
        index,
        name: name.to_owned(),
    }
}

fn entry(address: &str, identity: u32, node: u32) -> pb::MapEntry {
    pb::MapEntry {
        ip: v4(address),
        identity,
        node,
    }
}

fn row(identity: u32, node: &str) -> (u32, String) {
    (identity, node.to_owned())
}

async fn listener() -> TestResult<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    Ok((listener, addr))
}

#[tokio::test]
async fn the_full_map_then_changes_then_a_resync_that_sweeps() -> TestResult {
    let (listener, addr) = listener().await?;
    let (streams_tx, mut streams) = mpsc::unbounded_channel();
    let _server = serve(
        listener,
        Some(Scripted {
            streams: streams_tx,
            refuse: false,
        }),
    );
    let mut agent = agent(addr)?;

    let (request, batches) = next_stream(&mut streams).await?;
    assert_eq!(request.node, OWN);
    assert_eq!(request.protocol_version, PROTOCOL_VERSION);
    assert_eq!(request.session, Some(session_to_wire(agent.session)));
    agent.state(MapState::Connected).await?;

    // The full map in two batches, this node's entries among them, and a
    // malformed entry (5 bytes of address).
    batches
        .send(Ok(pb::EndpointMapBatch {
            resync_start: true,
            nodes: vec![node(1, OWN), node(2, "n2"), node(3, "n3")],
            upserts: vec![
                entry("198.18.1.2", 300, 1),
                entry("198.18.2.2", 301, 2),
                entry("198.18.2.1", 6, 2),
                pb::MapEntry {
                    ip: vec![198, 18, 2, 9, 9],
                    identity: 302,
                    node: 2,
                },
            ],
            built_at_ms: 1,
            version: 7,
            ..Default::default()
        }))
        .await?;
    batches
        .send(Ok(pb::EndpointMapBatch {
            resync_end: true,
            upserts: vec![entry("198.18.3.2", 303, 3)],
            version: 7,
            ..Default::default()
        }))
        .await?;
    agent.next().await?;
    agent.next().await?;
    assert_eq!(
        agent.remote(),
        BTreeMap::from([
            ("198.18.2.1".to_owned(), row(6, "n2")),
            ("198.18.2.2".to_owned(), row(301, "n2")),
            ("198.18.3.2".to_owned(), row(303, "n3")),
        ])
    );
    assert_eq!(agent.metrics.map_malformed.get(), 1);
    assert_eq!(agent.metrics.map_resyncs.get(), 1);

    // Changes.
    batches
        .send(Ok(pb::EndpointMapBatch {
            upserts: vec![entry("198.18.2.3", 304, 2)],
            removes: vec![v4("198.18.3.2")],
            removed_nodes: vec![3],
            version: 8,
            ..Default::default()
        }))
        .await?;
    agent.next().await?;
    assert_eq!(
        agent.remote().keys().cloned().collect::<Vec<_>>(),
        ["198.18.2.1", "198.18.2.2", "198.18.2.3"]
    );
    assert_eq!(
        agent.maps.nodes.keys().copied().collect::<Vec<_>>(),
        [2],
        "n3 is gone with its last entry"
    );

    // A resync (a watcher that fell behind) that no longer lists 198.18.2.2.
    batches
        .send(Ok(pb::EndpointMapBatch {
            resync_start: true,
            resync_end: true,
            nodes: vec![node(2, "n2")],
            upserts: vec![entry("198.18.2.1", 6, 2), entry("198.18.2.3", 304, 2)],
            version: 9,
            ..Default::default()
        }))
        .await?;
    agent.next().await?;
    assert_eq!(
        agent.remote().keys().cloned().collect::<Vec<_>>(),
        ["198.18.2.1", "198.18.2.3"]
    );
    assert_eq!(agent.metrics.map_batches.get(), 4);
    assert_eq!(agent.core.status().map.version, 9);
    Ok(())
}

#[tokio::test]
async fn an_operator_without_endpoint_map_leaves_the_agent_local_only() -> TestResult {
    let (listener, addr) = listener().await?;
    let _server = serve(listener, None);
    let mut agent = agent(addr)?;
    // What a previous operator's map left.
    agent.maps.entries.insert(
        MapKey::from("198.18.2.2".parse::<IpAddr>()?),
        bpf::Endpoint::remote(300, std::num::NonZeroU16::MIN),
    );

    agent.next().await?;
    agent.state(MapState::Unsupported).await?;
    assert!(
        agent.core.status().map.complete,
        "local-only is a whole (empty) map"
    );
    let desired = agent.core.desired();
    let report = agent.reconciler.full_pass(&mut agent.maps, &desired, true);
    assert_eq!(report.removed, 1);
    assert!(agent.remote().is_empty());
    assert_eq!(agent.metrics.map_batches.get(), 0);
    Ok(())
}

/// Checked: failing when the client tells the core at every refusal.
#[tokio::test]
async fn an_operator_without_endpoint_map_is_asked_again_and_told_to_the_core_once() -> TestResult {
    let (listener, addr) = listener().await?;
    let (streams_tx, mut streams) = mpsc::unbounded_channel();
    let _server = serve(
        listener,
        Some(Scripted {
            streams: streams_tx,
            refuse: true,
        }),
    );
    let mut agent = agent(addr)?;
    // The third Watch is asked once the second refusal has been dealt with.
    for _ in 0..3 {
        next_stream(&mut streams).await?;
    }
    assert_eq!(agent.events.recv().await, Some(MapEvent::LocalOnly));
    assert!(agent.events.try_recv().is_err(), "LocalOnly is said once");
    assert_eq!(agent.link.borrow().state, MapState::Unsupported);
    Ok(())
}

#[tokio::test]
async fn a_restarted_operator_is_watched_again_and_the_map_stays_meanwhile() -> TestResult {
    let (listener, addr) = listener().await?;
    let (streams_tx, mut streams) = mpsc::unbounded_channel();
    let (stop, server) = serve(
        listener,
        Some(Scripted {
            streams: streams_tx,
            refuse: false,
        }),
    );
    let mut agent = agent(addr)?;
    let (_, batches) = next_stream(&mut streams).await?;
    batches
        .send(Ok(pb::EndpointMapBatch {
            resync_start: true,
            resync_end: true,
            nodes: vec![node(2, "n2")],
            upserts: vec![entry("198.18.2.2", 301, 2), entry("198.18.2.3", 302, 2)],
            ..Default::default()
        }))
        .await?;
    agent.next().await?;
    agent.state(MapState::Connected).await?;

    // The operator goes away.
    batches.send(Err(Status::unavailable("restarting"))).await?;
    drop(batches);
    let _ = stop.send(());
    let _ = server.await;
    agent.state(MapState::Disconnected).await?;
    assert_eq!(agent.remote().len(), 2, "fail-static");

    // It comes back on the same address, with other indexes and a changed map.
    let listener = TcpListener::bind(addr).await?;
    let (streams_tx, mut streams) = mpsc::unbounded_channel();
    let _server = serve(
        listener,
        Some(Scripted {
            streams: streams_tx,
            refuse: false,
        }),
    );
    let (_, batches) = next_stream(&mut streams).await?;
    batches
        .send(Ok(pb::EndpointMapBatch {
            resync_start: true,
            resync_end: true,
            nodes: vec![node(9, "n2")],
            upserts: vec![entry("198.18.2.2", 301, 9), entry("198.18.2.4", 303, 9)],
            ..Default::default()
        }))
        .await?;
    agent.next().await?;
    agent.state(MapState::Connected).await?;
    assert_eq!(
        agent.remote(),
        BTreeMap::from([
            ("198.18.2.2".to_owned(), row(301, "n2")),
            ("198.18.2.4".to_owned(), row(303, "n2")),
        ])
    );
    assert_eq!(agent.metrics.map_reconnects.get(), 1);
    Ok(())
}

/// An address the operator sends as IPv4-mapped IPv6 (16 bytes) is the IPv4
/// address: the ENDPOINTS key a local endpoint of that address has.
#[test]
fn an_ipv4_mapped_address_is_decoded_as_ipv4() {
    let mapped = entry("::ffff:198.18.3.2", 300, 3);
    assert_eq!(mapped.ip.len(), 16);
    let (batch, malformed) = decode(pb::EndpointMapBatch {
        nodes: vec![node(3, "n3")],
        upserts: vec![mapped],
        removes: vec![v4("::ffff:198.18.3.9")],
        ..Default::default()
    });
    assert_eq!(malformed, 0);
    assert_eq!(
        batch
            .upserts
            .iter()
            .map(|e| e.ip.to_string())
            .collect::<Vec<_>>(),
        ["198.18.3.2"]
    );
    assert_eq!(
        batch
            .removes
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["198.18.3.9"]
    );
}

#[test]
fn malformed_items_are_skipped_and_counted() {
    let (batch, malformed) = decode(pb::EndpointMapBatch {
        nodes: vec![node(0, "n0"), node(2, "Not_A_Name"), node(3, "n3")],
        upserts: vec![
            entry("198.18.3.2", 300, 3),
            entry("2001:db8::2", 300, 3),
            pb::MapEntry {
                ip: vec![1, 2, 3],
                identity: 300,
                node: 3,
            },
            entry("198.18.3.3", 0, 3),
            entry("198.18.3.4", 1, 3),
            entry("198.18.3.5", 300, 0),
        ],
        removes: vec![v4("198.18.3.9"), vec![]],
        removed_nodes: vec![0, 4],
        ..Default::default()
    });
    assert_eq!(malformed, 8);
    assert_eq!(batch.nodes.len(), 1);
    assert_eq!(
        batch
            .upserts
            .iter()
            .map(|e| e.ip.to_string())
            .collect::<Vec<_>>(),
        ["198.18.3.2", "2001:db8::2"]
    );
    assert_eq!(batch.removes.len(), 1);
    assert_eq!(batch.removed_nodes.len(), 1);
}

#[test]
fn a_batchs_service_addresses_are_decoded_without_their_malformed_ranges() {
    let range = |address: Vec<u8>, prefix_len: u32, kind: pb::ServiceKind| pb::ServiceRange {
        address,
        prefix_len,
        kind: kind as i32,
    };
    let (batch, malformed) = decode(pb::EndpointMapBatch {
        services: Some(pb::ServiceSet {
            cluster_ips: Vec::new(),
            ranges: vec![
                range(v4("10.96.0.0"), 12, pb::ServiceKind::ClusterIpRange),
                range(v4("10.96.0.1"), 12, pb::ServiceKind::ClusterIpRange),
                range(vec![10, 96], 16, pb::ServiceKind::ClusterIpRange),
                range(v4("203.0.113.7"), 32, pb::ServiceKind::Unspecified),
            ],
        }),
        ..Default::default()
    });
    assert_eq!(malformed, 3);
    let ranges: Vec<String> = batch
        .services
        .iter()
        .flat_map(|s| s.iter())
        .map(|(r, k)| format!("{r} {k}"))
        .collect();
    assert_eq!(ranges, ["10.96.0.0/12 cluster-ip-range"]);
    // Unset: no set, not an empty one.
    let (batch, malformed) = decode(pb::EndpointMapBatch::default());
    assert_eq!((batch.services, malformed), (None, 0));
    // An empty set is a set: SERVICES is to be empty.
    let (batch, _) = decode(pb::EndpointMapBatch {
        services: Some(pb::ServiceSet::default()),
        ..Default::default()
    });
    assert_eq!(batch.services.map(|s| s.len()), Some(0));
}
