use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use census_proto::{
    convert::filter_to_wire,
    domain::{Endpoint, IdentityId, canonical_ips},
    labels::{LabelFilter, LabelSet},
    pb::{
        endpoint_sync_server::{EndpointSync, EndpointSyncServer},
        identity_service_client::IdentityServiceClient,
    },
};
use census_testkit::{
    Operator, TestResult, fail, identity, lazy_channel, node, node as node_info, until_some,
};
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{
    Request, Response, Status,
    transport::{Channel, Server},
};

use super::*;
use crate::{
    agent_core::{AllocationEvent, AllocationId, Core, EndpointState},
    daemon::new_session,
    source::{HostInterface, SourceEndpoint, SourceEvent},
};

const WAIT: Duration = Duration::from_secs(10);

struct Client {
    reports: mpsc::UnboundedSender<Report>,
    events: mpsc::Receiver<OperatorEvent>,
    ready: watch::Sender<bool>,
    stop: watch::Sender<bool>,
    status: watch::Receiver<OperatorLink>,
    metrics: Metrics,
    session: SessionId,
    task: JoinHandle<()>,
}

fn start(channel: Channel, node: &str) -> Result<Client, Box<dyn std::error::Error + Send + Sync>> {
    start_with(channel, node, false)
}

fn start_with(
    channel: Channel,
    node: &str,
    drop_deletes: bool,
) -> Result<Client, Box<dyn std::error::Error + Send + Sync>> {
    let (reports, reports_rx) = mpsc::unbounded_channel();
    let (events_tx, events) = mpsc::channel(16);
    let (ready, ready_rx) = watch::channel(false);
    let (stop, stop_rx) = watch::channel(false);
    let (status_tx, status) = watch::channel(OperatorLink::default());
    let metrics = Metrics::default();
    let session = new_session();
    let client = SyncClient {
        channel: crate::client::plain(channel),
        node: NodeName::new(node)?,
        session,
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
        metrics: metrics.clone(),
        status: status_tx,
        connected: watch::channel(false).0,
        host_ips: HostIps::Fixed(BTreeSet::new()),
        drop_deletes,
    };
    let task = tokio::spawn(client.run(reports_rx, events_tx, ready_rx, stop_rx));
    Ok(Client {
        reports,
        events,
        ready,
        stop,
        status,
        metrics,
        session,
        task,
    })
}

fn labels(app: &str) -> Result<LabelSet, census_proto::labels::LabelError> {
    LabelSet::for_pod(
        &BTreeMap::from([("app".to_owned(), app.to_owned())]),
        "default",
        "default",
        &LabelFilter::default(),
        &LabelLimits::default(),
    )
}

async fn allocate(
    channel: &Channel,
    node: &str,
    session: SessionId,
    labels: &LabelSet,
) -> Result<IdentityId, Box<dyn std::error::Error + Send + Sync>> {
    let response = IdentityServiceClient::new(channel.clone())
        .allocate(pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: node.to_owned(),
            session: Some(session_to_wire(session)),
            labels: labels.to_strings(),
            allocation: 0,
        })
        .await?
        .into_inner();
    let id = response.identity.map(|i| i.id).unwrap_or_default();
    Ok(IdentityId::new(id).ok_or("no identity")?)
}

fn endpoint(
    name: &str,
    ip: &str,
    id: IdentityId,
    labels: &LabelSet,
) -> Result<Endpoint, Box<dyn std::error::Error + Send + Sync>> {
    Ok(Endpoint {
        key: EndpointKey::new("default", name)?,
        ips: canonical_ips(vec![ip.parse()?]),
        identity: id,
        labels: labels.clone(),
    })
}

async fn refs(channel: &Channel, id: IdentityId) -> u64 {
    identity(channel, id.get())
        .await
        .map_or(0, |i| i.references)
}

/// The test-only switch (`--test-drop-endpoint-deletes`): an endpoint's end is never
/// sent as a delta, so the operator keeps its reference until the next snapshot,
/// which drops it.
#[tokio::test]
async fn dropped_deletes_are_left_to_the_next_snapshot() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    let ch = lazy_channel(op.grpc_addr)?;
    let mut client = start_with(ch.clone(), "n1", true)?;
    let Some(OperatorEvent::Settings(_)) = client.events.recv().await else {
        return Err("HelloReply's settings come first".into());
    };
    let web = labels("web")?;
    let web_id = allocate(&ch, "n1", client.session, &web).await?;
    for (name, ip) in [("web-0", "198.18.1.2"), ("web-1", "198.18.2.2")] {
        client
            .reports
            .send(Report::Upsert(endpoint(name, ip, web_id, &web)?))?;
    }
    client.ready.send(true)?;
    let two = until_some(WAIT, || async {
        (refs(&ch, web_id).await == 2).then_some(())
    })
    .await;
    assert!(two.is_some(), "both endpoints counted");
    let snapshots = node(&ch, "n1").await.ok_or("the node")?.last_snapshot_ms;
    client
        .reports
        .send(Report::Delete(EndpointKey::new("default", "web-0")?))?;
    let dropped = until_some(WAIT, || async {
        (client.metrics.deltas_dropped.get() == 1).then_some(())
    })
    .await;
    assert!(dropped.is_some(), "the delete was not sent");
    let repaired = until_some(WAIT, || async {
        node(&ch, "n1")
            .await
            .filter(|n| n.last_snapshot_ms != snapshots && n.endpoints == 1)
    })
    .await;
    assert!(repaired.is_some(), "a later snapshot dropped web-0");
    assert_eq!(refs(&ch, web_id).await, 1);
    client.stop.send(true)?;
    Ok(())
}

#[tokio::test]
async fn hello_snapshot_deltas_and_rebind() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    let ch = lazy_channel(op.grpc_addr)?;
    let mut client = start(ch.clone(), "n1")?;

    let Some(OperatorEvent::Settings(settings)) = client.events.recv().await else {
        return Err("HelloReply's settings come first".into());
    };
    assert_eq!(settings.filter, LabelFilter::default());

    let web = labels("web")?;
    let web_id = allocate(&ch, "n1", client.session, &web).await?;
    client.reports.send(Report::Upsert(endpoint(
        "web-0",
        "198.18.1.2",
        web_id,
        &web,
    )?))?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = node(&ch, "n1").await.ok_or("the node said Hello")?;
    assert_eq!(
        before.last_snapshot_ms, 0,
        "no snapshot before the source is read"
    );

    client.ready.send(true)?;
    let seen = until_some(WAIT, || async {
        node(&ch, "n1")
            .await
            .filter(|n| n.endpoints == 1 && n.last_snapshot_ms > 0)
    })
    .await;
    assert!(seen.is_some(), "the snapshot reached the operator");
    assert_eq!(refs(&ch, web_id).await, 1);

    // Deltas.
    client.reports.send(Report::Upsert(endpoint(
        "web-1",
        "198.18.2.2",
        web_id,
        &web,
    )?))?;
    let two = until_some(WAIT, || async {
        (refs(&ch, web_id).await == 2).then_some(())
    })
    .await;
    assert!(two.is_some(), "the upsert counted");
    client
        .reports
        .send(Report::Delete(EndpointKey::new("default", "web-0")?))?;
    let one = until_some(WAIT, || async {
        (refs(&ch, web_id).await == 1).then_some(())
    })
    .await;
    assert!(one.is_some(), "the delete counted");

    // An endpoint claiming web's id for other labels is rebound.
    let db = labels("db")?;
    client
        .reports
        .send(Report::Upsert(endpoint("db-0", "198.18.3.2", web_id, &db)?))?;
    let rebind = tokio::time::timeout(WAIT, async {
        loop {
            match client.events.recv().await {
                Some(OperatorEvent::Rebind { key, id }) => return Some((key, id)),
                Some(
                    OperatorEvent::Settings(_)
                    | OperatorEvent::Verdict(_)
                    | OperatorEvent::Services(_),
                ) => {}
                None => return None,
            }
        }
    })
    .await?
    .ok_or("no Rebind")?;
    assert_eq!(rebind.0.as_str(), "default/db-0");
    assert_ne!(rebind.1, web_id);
    assert_eq!(client.metrics.rebinds.get(), 1);

    let status = client.status.borrow().clone();
    assert!(status.connected);
    assert!(status.last_ack_seq >= 3, "{status:?}");
    assert!(client.metrics.deltas_sent.get() >= 3);

    client.stop.send(true)?;
    client.task.await?;
    op.shut_down().await?;
    Ok(())
}

fn pod(name: &str, ip: &str, labels: &[(&str, &str)]) -> TestResult<SourceEndpoint> {
    Ok(SourceEndpoint {
        key: EndpointKey::new("default", name)?,
        ips: canonical_ips(vec![ip.parse()?]),
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        service_account: "default".to_owned(),
        interface: HostInterface::Named(format!("veth{name}")),
    })
}

/// The agent's core wired to the client as the daemon wires them, logging to a
/// file the test reads.
struct Node {
    core: Core,
    logs: tracing::Dispatch,
    log: tempfile::NamedTempFile,
    verdicts: usize,
}

impl Node {
    fn new() -> TestResult<Self> {
        let log = tempfile::NamedTempFile::new()?;
        let logs = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(Arc::new(log.reopen()?))
            .finish();
        Ok(Self {
            core: Core::new(HashMap::new()),
            logs: tracing::Dispatch::new(logs),
            log,
            verdicts: 0,
        })
    }

    /// Runs `event` through the core; its allocations are answered `id`.
    fn source(&mut self, client: &Client, event: SourceEvent, id: u32) -> TestResult {
        self.core.on_source(event);
        let mut fx = self.core.take_effects();
        for request in fx.started() {
            let id = IdentityId::new(id).ok_or("id 0")?;
            self.core.on_allocation(AllocationEvent::Allocated {
                request: request.id,
                labels: request.labels.clone(),
                id,
            });
        }
        let mut reports = std::mem::take(&mut fx.reports);
        reports.extend(self.core.take_effects().reports);
        for report in reports {
            client.reports.send(report)?;
        }
        Ok(())
    }

    /// Feeds the client's events to the core until `done`.
    async fn until(
        &mut self,
        client: &mut Client,
        done: impl Fn(&Self, &Client) -> bool,
    ) -> TestResult {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !done(self, client) {
            let event = tokio::time::timeout_at(deadline, client.events.recv())
                .await
                .map_err(|_| "timed out")?
                .ok_or("the client stopped")?;
            match event {
                OperatorEvent::Verdict(verdict) => {
                    self.verdicts += 1;
                    tracing::dispatcher::with_default(&self.logs, || {
                        self.core.on_operator(OperatorEvent::Verdict(verdict));
                    });
                }
                // Not this core's: its label limit stays the default, above the
                // operator's, as in an agent built with other limits.
                OperatorEvent::Settings(_)
                | OperatorEvent::Rebind { .. }
                | OperatorEvent::Services(_) => {}
            }
        }
        Ok(())
    }

    fn state(&self, name: &str) -> Option<(EndpointState, Option<String>)> {
        let view = self.core.view();
        let status = view.into_iter().find(|e| e.key.name() == name)?;
        Some((status.state, status.problem.map(|p| p.to_string())))
    }

    fn logged(&self, needle: &str) -> TestResult<usize> {
        Ok(std::fs::read_to_string(self.log.path())?
            .lines()
            .filter(|line| line.contains(needle))
            .count())
    }
}

/// Issue 10: an entry the operator rejects costs the agent neither its stream nor
/// its other endpoints; the endpoint is marked, and said once, until it is fixed.
#[tokio::test]
async fn an_endpoint_the_operator_rejects_is_marked_and_logged_once_until_fixed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::start_in(
        dir.path(),
        &["--max-labels", "3", "--snapshot-interval", "1s"],
    )
    .await?;
    let ch = lazy_channel(op.grpc_addr)?;
    let mut client = start(ch.clone(), "n1")?;
    let mut node = Node::new()?;
    // web-0 has four identity labels (app, tier, namespace, service account).
    let web = [("app", "web"), ("tier", "front")];
    let pods = vec![
        pod("web-0", "198.18.1.2", &web)?,
        pod("db-0", "198.18.3.2", &[("app", "db")])?,
    ];
    node.source(&client, SourceEvent::Reset(pods), 300)?;
    client.ready.send(true)?;

    let marked = |node: &Node, _: &Client| {
        node.state("web-0")
            .is_some_and(|(s, _)| s == EndpointState::Error)
    };
    node.until(&mut client, marked).await?;
    let (_, error) = node.state("web-0").ok_or("web-0")?;
    assert_eq!(
        error.as_deref(),
        Some("the operator rejected it: labels: 4 labels exceed the limit of 3")
    );
    assert_eq!(node.state("db-0"), Some((EndpointState::Programmed, None)));
    let seen = until_some(WAIT, || async {
        node_info(&ch, "n1").await.filter(|n| n.endpoints == 1)
    })
    .await;
    assert!(seen.is_some(), "db-0 is counted");

    // The snapshots that follow still carry it: rejected again, said once.
    let first = node.verdicts;
    node.until(&mut client, |node, _| node.verdicts >= first + 2)
        .await?;
    assert!(marked(&node, &client));
    assert_eq!(node.logged("the operator rejected the endpoint")?, 1);
    assert_eq!(node.logged("endpoint=default/web-0")?, 1);
    assert!(client.metrics.rejected_entries.get() >= 3);
    assert_eq!(client.metrics.reconnects.get(), 0, "the stream stayed up");

    // Its labels fixed, the operator takes it and the mark goes.
    let fixed = pod("web-0", "198.18.1.2", &[("app", "web")])?;
    node.source(&client, SourceEvent::Upsert(fixed), 301)?;
    node.until(&mut client, |node, _| {
        node.state("web-0") == Some((EndpointState::Programmed, None))
    })
    .await?;
    assert_eq!(node.logged("the operator accepts the endpoint now")?, 1);
    let seen = until_some(WAIT, || async {
        node_info(&ch, "n1").await.filter(|n| n.endpoints == 2)
    })
    .await;
    assert!(seen.is_some(), "web-0 is counted");

    client.stop.send(true)?;
    client.task.await?;
    op.shut_down().await?;
    Ok(())
}

#[tokio::test]
async fn reconnects_and_sends_a_snapshot_when_the_operator_is_back() -> TestResult {
    let dir = tempfile::tempdir()?;
    let op = Operator::for_agents(dir.path(), 0).await?;
    let addr = op.grpc_addr;
    let ch = lazy_channel(addr)?;
    let mut client = start(ch.clone(), "n1")?;
    client.ready.send(true)?;
    let Some(OperatorEvent::Settings(_)) = client.events.recv().await else {
        return Err("HelloReply's settings come first".into());
    };
    let web = labels("web")?;
    let web_id = allocate(&ch, "n1", client.session, &web).await?;
    client.reports.send(Report::Upsert(endpoint(
        "web-0",
        "198.18.1.2",
        web_id,
        &web,
    )?))?;
    let seen = until_some(WAIT, || async {
        (refs(&ch, web_id).await == 1).then_some(())
    })
    .await;
    assert!(seen.is_some());

    op.shut_down().await?;
    let down = until_some(WAIT, || async {
        (!client.status.borrow().connected).then_some(())
    })
    .await;
    assert!(down.is_some(), "the client noticed");
    assert!(client.status.borrow().last_error.is_some());
    // A change while the operator is away.
    client.reports.send(Report::Upsert(endpoint(
        "web-1",
        "198.18.2.2",
        web_id,
        &web,
    )?))?;

    let op = Operator::for_agents(dir.path(), addr.port()).await?;
    let back = until_some(WAIT, || async {
        node(&ch, "n1")
            .await
            .filter(|n| n.connected && n.endpoints == 2)
    })
    .await;
    assert!(
        back.is_some(),
        "the snapshot after reconnecting holds both endpoints"
    );
    assert_eq!(refs(&ch, web_id).await, 2);
    assert!(client.metrics.reconnects.get() >= 1);
    assert!(client.status.borrow().connected);

    client.stop.send(true)?;
    client.task.await?;
    op.shut_down().await?;
    Ok(())
}

#[tokio::test]
async fn hello_carries_the_nodes_first_16_addresses_but_link_local_ones() -> TestResult {
    let mut ips: BTreeSet<IpAddr> = (1..=20u8).map(|i| IpAddr::from([198, 18, 0, i])).collect();
    // What the operator would refuse a Hello for is left out.
    for unusable in [
        "169.254.1.1",
        "fe80::1",
        "0.1.2.3",
        "127.0.0.1",
        "224.0.0.1",
    ] {
        ips.insert(unusable.parse()?);
    }
    ips.insert("2001:db8::1".parse()?);
    let client = SyncClient {
        channel: crate::client::plain(lazy_channel("127.0.0.1:1".parse()?)?),
        node: NodeName::new("n1")?,
        session: new_session(),
        initial_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
        metrics: Metrics::default(),
        status: watch::channel(OperatorLink::default()).0,
        connected: watch::channel(false).0,
        host_ips: HostIps::Fixed(ips),
        drop_deletes: false,
    };
    let sent = client.hello_addresses();
    let want: Vec<String> = (1..=16).map(|i| format!("198.18.0.{i}")).collect();
    assert_eq!(sent, want);
    Ok(())
}

type Outbound = mpsc::Sender<Result<pb::OperatorMessage, Status>>;

/// An EndpointSync service that answers every Hello (snapshots only when asked)
/// and hands the test each stream: the agent's messages, and the sending side of
/// the operator's, which ends the stream when dropped.
struct Scripted {
    streams: mpsc::UnboundedSender<(mpsc::UnboundedReceiver<pb::AgentMessage>, Outbound)>,
}

#[tonic::async_trait]
impl EndpointSync for Scripted {
    type SyncStream = ReceiverStream<Result<pb::OperatorMessage, Status>>;

    async fn sync(
        &self,
        request: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let mut inbound = request.into_inner();
        let (operator, outbound) = mpsc::channel(16);
        let reply = pb::HelloReply {
            protocol_version: PROTOCOL_VERSION,
            filter: Some(filter_to_wire(&LabelFilter::default())),
            // An hour: within a test, only the snapshots asked for.
            snapshot_interval_ms: 3_600_000,
            ..pb::HelloReply::default()
        };
        let _ = operator
            .send(Ok(pb::OperatorMessage {
                body: Some(operator_message::Body::HelloReply(reply)),
            }))
            .await;
        let (agent, messages) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(message)) = inbound.message().await {
                if agent.send(message).is_err() {
                    return;
                }
            }
        });
        let _ = self.streams.send((messages, operator));
        Ok(Response::new(ReceiverStream::new(outbound)))
    }
}

async fn next<T>(rx: &mut mpsc::UnboundedReceiver<T>) -> TestResult<T> {
    match tokio::time::timeout(WAIT, rx.recv()).await {
        Ok(Some(item)) => Ok(item),
        _ => fail("nothing came"),
    }
}

/// The next message's body, which must be a Snapshot.
async fn next_snapshot(
    messages: &mut mpsc::UnboundedReceiver<pb::AgentMessage>,
) -> TestResult<pb::Snapshot> {
    match next(messages).await?.body {
        Some(Body::Snapshot(snapshot)) => Ok(snapshot),
        other => fail(format!("not a snapshot: {other:?}")),
    }
}

/// A new stream's first messages: its Hello, then its snapshot.
async fn hello_then_snapshot(
    messages: &mut mpsc::UnboundedReceiver<pb::AgentMessage>,
) -> TestResult<pb::Snapshot> {
    match next(messages).await?.body {
        Some(Body::Hello(_)) => next_snapshot(messages).await,
        other => fail(format!("not a Hello: {other:?}")),
    }
}

/// The operator ends the holds of the allocations a Snapshot says are settled: the
/// number travels in every Snapshot, never as a message of its own, and a new
/// stream of the same session still carries it.
#[tokio::test]
async fn the_settled_allocations_go_in_every_snapshot_and_never_as_a_delta() -> TestResult {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (streams_tx, mut streams) = mpsc::unbounded_channel();
    let (stop_server, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .add_service(EndpointSyncServer::new(Scripted {
                streams: streams_tx,
            }))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            }),
    );
    let client = start(lazy_channel(addr)?, "n1")?;
    client.ready.send(true)?;
    let (mut messages, operator) = next(&mut streams).await?;
    let first = hello_then_snapshot(&mut messages).await?;
    assert_eq!(first.allocations_settled, 0, "nothing settled yet");

    let web = labels("web")?;
    let web_id = IdentityId::new(300).ok_or("300")?;
    client.reports.send(Report::Upsert(endpoint(
        "web-0",
        "198.18.1.2",
        web_id,
        &web,
    )?))?;
    client.reports.send(Report::Settled(AllocationId::new(3)))?;
    client.reports.send(Report::Upsert(endpoint(
        "web-1",
        "198.18.2.2",
        web_id,
        &web,
    )?))?;
    for name in ["web-0", "web-1"] {
        match next(&mut messages).await?.body {
            Some(Body::Upsert(upsert)) => {
                assert_eq!(upsert.endpoint.map(|e| e.name).as_deref(), Some(name));
            }
            other => return fail(format!("not {name}'s upsert: {other:?}")),
        }
    }
    assert_eq!(client.metrics.deltas_sent.get(), 2);
    assert_eq!(client.metrics.deltas_dropped.get(), 0);

    operator
        .send(Ok(pb::OperatorMessage {
            body: Some(operator_message::Body::SnapshotRequest(
                pb::SnapshotRequest {},
            )),
        }))
        .await?;
    let asked = next_snapshot(&mut messages).await?;
    assert_eq!(asked.allocations_settled, 3);
    assert_eq!(asked.endpoints.len(), 2);

    // The operator ends the stream; the agent's next one is the same session.
    drop((operator, messages));
    let (mut messages, _operator) = next(&mut streams).await?;
    let again = hello_then_snapshot(&mut messages).await?;
    assert_eq!(again.allocations_settled, 3, "kept across streams");
    assert_eq!(again.endpoints.len(), 2);

    client.stop.send(true)?;
    client.task.await?;
    let _ = stop_server.send(());
    server.await??;
    Ok(())
}
