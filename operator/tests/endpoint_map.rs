//! EndpointMap over real loopback gRPC: a real operator (`daemon::start`), real agents'
//! EndpointSync streams feeding it, and watchers that apply what they are sent the way
//! an agent does (forget everything at `resync_start`, then apply each batch) and
//! check that no version is skipped after a full map.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
};

use census_proto::{PROTOCOL_VERSION, pb};
use census_testkit::{
    ANSWER_TIMEOUT, Agent, Operator, TestResult, endpoint, expect_status, fail, session,
};
use prost::Message as _;
use tonic::{Code, Status, Streaming, transport::Channel};

const SHOP: &[&str] = &["k8s:app=shop", "k8s:io.kubernetes.pod.namespace=shop"];
const DB: &[&str] = &["k8s:app=db", "k8s:io.kubernetes.pod.namespace=shop"];

/// What a watcher holds: address -> (identity, node name).
type Map = BTreeMap<IpAddr, (u32, String)>;

fn ip(text: &str) -> TestResult<IpAddr> {
    Ok(text.parse()?)
}

fn map_of(entries: &[(&str, u32, &str)]) -> TestResult<Map> {
    entries
        .iter()
        .map(|(a, id, node)| Ok((ip(a)?, (*id, (*node).to_owned()))))
        .collect()
}

fn wire_ip(bytes: &[u8]) -> TestResult<IpAddr> {
    Ok(match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes)?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes)?),
        n => return fail(format!("an address of {n} bytes")),
    })
}

/// One watcher, applying batches as an agent does.
struct Watcher {
    stream: Streaming<pb::EndpointMapBatch>,
    map: Map,
    nodes: HashMap<u32, String>,
    /// Filled between `resync_start` and `resync_end`.
    pending: Option<(Map, HashMap<u32, String>)>,
    /// The version the map is current to, once a full map has ended.
    version: Option<u64>,
    /// Full maps received (their `resync_start`).
    resyncs: u32,
    /// Versions of the batches of changes applied, and their encoded size.
    batches: Vec<(u64, usize)>,
    /// Bytes received, and at the last `resync_start`.
    bytes: usize,
    bytes_before_last_resync: usize,
}

async fn map_channel(op: &Operator, window: Option<u32>) -> TestResult<Channel> {
    let endpoint = Channel::from_shared(op.url())?
        .connect_timeout(ANSWER_TIMEOUT)
        .initial_stream_window_size(window)
        .initial_connection_window_size(window);
    Ok(endpoint.connect().await?)
}

fn watch_request(node: &str, session: pb::Session) -> pb::EndpointMapWatchRequest {
    pb::EndpointMapWatchRequest {
        protocol_version: PROTOCOL_VERSION,
        node: node.into(),
        session: Some(session),
    }
}

async fn watch(
    channel: Channel,
    request: pb::EndpointMapWatchRequest,
) -> TestResult<Result<Streaming<pb::EndpointMapBatch>, Status>> {
    let mut client = pb::endpoint_map_client::EndpointMapClient::new(channel);
    let answer = tokio::time::timeout(ANSWER_TIMEOUT, client.watch(request))
        .await
        .map_err(|_| "EndpointMap.Watch did not answer")?;
    Ok(answer.map(tonic::Response::into_inner))
}

impl Watcher {
    async fn open(op: &Operator, node: &str, session: pb::Session) -> TestResult<Self> {
        Self::open_on(map_channel(op, None).await?, node, session).await
    }

    async fn open_on(channel: Channel, node: &str, session: pb::Session) -> TestResult<Self> {
        let stream = match watch(channel, watch_request(node, session)).await? {
            Ok(stream) => stream,
            Err(status) => return fail(format!("Watch of {node} refused: {status:?}")),
        };
        Ok(Self {
            stream,
            map: Map::new(),
            nodes: HashMap::new(),
            pending: None,
            version: None,
            resyncs: 0,
            batches: Vec::new(),
            bytes: 0,
            bytes_before_last_resync: 0,
        })
    }

    /// Reads and applies one batch.
    async fn step(&mut self) -> TestResult<pb::EndpointMapBatch> {
        let batch = match tokio::time::timeout(ANSWER_TIMEOUT, self.stream.message()).await {
            Err(_) => return fail(format!("no map batch within {ANSWER_TIMEOUT:?}")),
            Ok(Err(status)) => return fail(format!("the watch ended: {status:?}")),
            Ok(Ok(None)) => return fail("the watch ended cleanly"),
            Ok(Ok(Some(batch))) => batch,
        };
        // As framed on the wire: the operator counts the 5-byte gRPC prefix too.
        let size = batch.encoded_len() + 5;
        if batch.resync_start {
            self.resyncs += 1;
            self.bytes_before_last_resync = self.bytes;
            self.pending = Some((Map::new(), HashMap::new()));
        }
        self.bytes += size;
        let in_resync = self.pending.is_some();
        if !in_resync {
            let Some(version) = self.version else {
                return fail("a batch of changes before any full map");
            };
            if batch.version != version + 1 {
                return fail(format!(
                    "version {} after {version}: a batch was skipped",
                    batch.version
                ));
            }
            self.batches.push((batch.version, size));
        }
        let (map, nodes) = match &mut self.pending {
            Some((map, nodes)) => (map, nodes),
            None => (&mut self.map, &mut self.nodes),
        };
        for node in &batch.nodes {
            if node.index == 0 {
                return fail("node index 0");
            }
            nodes.insert(node.index, node.name.clone());
        }
        for entry in &batch.upserts {
            let Some(name) = nodes.get(&entry.node) else {
                return fail(format!(
                    "entry names node {} before it was sent",
                    entry.node
                ));
            };
            map.insert(wire_ip(&entry.ip)?, (entry.identity, name.clone()));
        }
        for removed in &batch.removes {
            map.remove(&wire_ip(removed)?);
        }
        for index in &batch.removed_nodes {
            nodes.remove(index);
        }
        if batch.resync_end {
            let Some((map, nodes)) = self.pending.take() else {
                return fail("resync_end without resync_start");
            };
            self.map = map;
            self.nodes = nodes;
        }
        if !in_resync || batch.resync_end {
            self.version = Some(batch.version);
        }
        Ok(batch)
    }

    /// Reads until the map (outside a resync) is `expected`.
    async fn until(&mut self, expected: &Map) -> TestResult {
        loop {
            if self.pending.is_none() && self.version.is_some() && self.map == *expected {
                return Ok(());
            }
            if let Err(e) = self.step().await {
                return fail(format!(
                    "{e}; map so far {:?}, expected {expected:?}",
                    self.map
                ));
            }
        }
    }
}

/// One sample of the operator's /metrics: the value of `name` with `labels` (e.g.
/// `kind="batch"`), 0 when absent.
async fn metric(op: &Operator, name: &str, labels: &str) -> TestResult<f64> {
    let (status, _, body) = op.admin_get("/metrics").await?;
    if status != 200 {
        return fail(format!("/metrics answered {status}"));
    }
    let wanted = if labels.is_empty() {
        name.to_owned()
    } else {
        format!("{name}{{{labels}}}")
    };
    for line in body.lines() {
        if let Some(value) = line.strip_prefix(&wanted).and_then(|r| r.strip_prefix(' ')) {
            return Ok(value.trim().parse()?);
        }
    }
    Ok(0.0)
}

/// Three nodes, each with an agent and a watcher of the map.
struct Cluster {
    op: Operator,
    agents: Vec<Agent>,
    sessions: Vec<pb::Session>,
    shop: u32,
    db: u32,
}

const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

impl Cluster {
    async fn start(args: &[&str]) -> TestResult<Self> {
        let op = Operator::start(args).await?;
        let mut agents = Vec::new();
        let mut sessions = Vec::new();
        for (i, node) in NODES.iter().enumerate() {
            let s = session(100 * (i as u64 + 1));
            agents.push(Agent::connect(&op, node, s).await?.0);
            sessions.push(s);
        }
        let shop = op.allocate_ok("node-a", sessions[0], SHOP).await?.id;
        let db = op.allocate_ok("node-b", sessions[1], DB).await?.id;
        Ok(Self {
            op,
            agents,
            sessions,
            shop,
            db,
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_get_the_full_map_then_every_change_encoded_once() -> TestResult {
    let mut c = Cluster::start(&["--map-tick-interval", "20ms"]).await?;
    let (shop, db) = (c.shop, c.db);
    c.agents[0]
        .snapshot(vec![
            endpoint("shop", "web-0", &["198.18.0.2"], shop, SHOP),
            endpoint("shop", "web-1", &["198.18.0.3", "2001:db8::3"], shop, SHOP),
        ])
        .await?;
    c.agents[1]
        .snapshot(vec![endpoint("shop", "db-0", &["198.18.1.2"], db, DB)])
        .await?;
    let mut expected = map_of(&[
        ("198.18.0.2", shop, "node-a"),
        ("198.18.0.3", shop, "node-a"),
        ("2001:db8::3", shop, "node-a"),
        ("198.18.1.2", db, "node-b"),
    ])?;
    let mut watchers = Vec::new();
    for (node, s) in NODES.iter().zip(&c.sessions) {
        let mut w = Watcher::open(&c.op, node, *s).await?;
        w.until(&expected).await?;
        assert_eq!(w.resyncs, 1, "{node}: one full map");
        watchers.push(w);
    }
    let encoded_before = metric(&c.op, "census_map_encoded_bytes_total", "kind=\"batch\"").await?;
    let sent_before = metric(&c.op, "census_map_messages_sent_total", "kind=\"batch\"").await?;

    // Changes on two nodes: an upsert, a delete by snapshot, a moved address.
    c.agents[0]
        .upsert(endpoint("shop", "web-2", &["198.18.0.4"], shop, SHOP))
        .await?;
    c.agents[1]
        .snapshot(vec![endpoint("shop", "db-1", &["198.18.1.3"], db, DB)])
        .await?;
    expected.insert(ip("198.18.0.4")?, (shop, "node-a".into()));
    expected.remove(&ip("198.18.1.2")?);
    expected.insert(ip("198.18.1.3")?, (db, "node-b".into()));
    for w in &mut watchers {
        w.until(&expected).await?;
    }
    let encoded =
        metric(&c.op, "census_map_encoded_bytes_total", "kind=\"batch\"").await? - encoded_before;
    let sent =
        metric(&c.op, "census_map_messages_sent_total", "kind=\"batch\"").await? - sent_before;

    let versions: Vec<Vec<u64>> = watchers
        .iter()
        .map(|w| w.batches.iter().map(|(v, _)| *v).collect())
        .collect();
    assert!(!versions[0].is_empty(), "the changes came as batches");
    assert!(
        versions.iter().all(|v| *v == versions[0]),
        "every watcher got the same batches: {versions:?}"
    );
    for w in &watchers {
        assert_eq!(w.resyncs, 1, "changes never cost a full map");
    }
    // Each batch was encoded once: the bytes encoded are one watcher's worth, and
    // the messages sent are every watcher's.
    let one_watcher: usize = watchers[0].batches.iter().map(|(_, n)| n).sum();
    assert_eq!(encoded as usize, one_watcher);
    assert_eq!(sent as usize, 3 * versions[0].len());
    assert_eq!(
        metric(&c.op, "census_map_batches_built_total", "").await? as u64,
        watchers[0].version.unwrap_or_default(),
        "one build per version"
    );
    assert_eq!(metric(&c.op, "census_map_watchers", "").await?, 3.0);
    assert_eq!(
        metric(&c.op, "census_map_resyncs_total", "reason=\"new_watcher\"").await?,
        3.0
    );
    assert_eq!(
        metric(&c.op, "census_map_entries", "kind=\"endpoint\"").await?,
        expected.len() as f64
    );
    drop(watchers);
    c.op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_does_not_read_is_sent_the_full_map_again_not_a_queue() -> TestResult {
    const BUFFER: usize = 4;
    const ROUNDS: usize = 30;
    const PODS: usize = 1500;
    let buffer = BUFFER.to_string();
    let mut c =
        Cluster::start(&["--map-tick-interval", "20ms", "--map-watch-buffer", &buffer]).await?;
    let shop = c.shop;
    // Every round moves every pod to addresses of its own: a batch of 2 x PODS
    // changes, and a state no other round has.
    let round = |r: usize| -> (Vec<pb::Endpoint>, Vec<(String, u32, &'static str)>) {
        let mut endpoints = Vec::new();
        let mut entries = Vec::new();
        for i in 0..PODS {
            let addr = format!("198.18.{}.{}", r * 6 + i / 250, i % 250 + 1);
            endpoints.push(endpoint("shop", &format!("web-{i}"), &[&addr], shop, SHOP));
            entries.push((addr, shop, "node-a"));
        }
        (endpoints, entries)
    };
    let expect = |entries: &[(String, u32, &str)]| -> TestResult<Map> {
        map_of(
            &entries
                .iter()
                .map(|(a, id, n)| (a.as_str(), *id, *n))
                .collect::<Vec<_>>(),
        )
    };
    let (endpoints, entries) = round(0);
    c.agents[0].snapshot(endpoints).await?;
    let mut fast = Watcher::open(&c.op, "node-b", c.sessions[1]).await?;
    fast.until(&expect(&entries)?).await?;
    // The slow watcher has its own connection with a 64 KiB window; after its first
    // full map it reads nothing until the end.
    const WINDOW: u32 = 65_535;
    let channel = map_channel(&c.op, Some(WINDOW)).await?;
    let mut slow = Watcher::open_on(channel, "node-c", c.sessions[2]).await?;
    slow.until(&expect(&entries)?).await?;
    let first_full = slow.bytes;

    let mut truth = Map::new();
    for r in 1..=ROUNDS {
        let (endpoints, entries) = round(r);
        c.agents[0].snapshot(endpoints).await?;
        truth = expect(&entries)?;
        // Paced by a watcher that reads: every round is at least one batch.
        fast.until(&truth).await?;
    }
    let batches = fast.batches.len();
    let largest = fast.batches.iter().map(|(_, n)| *n).max().unwrap_or(0);
    assert!(batches >= ROUNDS, "{batches} batches for {ROUNDS} rounds");
    assert!(
        metric(&c.op, "census_map_watcher_lag_batches_count", "").await? > 0.0,
        "lag is measured"
    );

    // Now it reads: what the transport held, then a full map, and the truth.
    slow.until(&truth).await?;
    assert_eq!(
        slow.resyncs, 2,
        "the first full map, and one after it fell behind"
    );
    assert!(
        metric(&c.op, "census_map_resyncs_total", "reason=\"lagged\"").await? >= 1.0,
        "counted as lagged"
    );
    // What the operator kept for it is bounded by the buffer and the transport's
    // window, not by how many batches it missed.
    let bound = first_full + WINDOW as usize + (BUFFER + 2) * largest + (64 << 10);
    let all: usize = fast.batches.iter().map(|(_, n)| n).sum();
    assert!(
        slow.bytes_before_last_resync < bound,
        "{} bytes before the resync, bound {bound} (every batch: {all})",
        slow.bytes_before_last_resync
    );
    assert!(bound < all, "the test makes more changes than the bound");
    c.op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_reconnects_gets_the_full_map_again() -> TestResult {
    let mut c = Cluster::start(&["--map-tick-interval", "20ms"]).await?;
    let shop = c.shop;
    c.agents[0]
        .snapshot(vec![endpoint("shop", "web-0", &["198.18.0.2"], shop, SHOP)])
        .await?;
    let mut expected = map_of(&[("198.18.0.2", shop, "node-a")])?;
    let mut w = Watcher::open(&c.op, "node-b", c.sessions[1]).await?;
    w.until(&expected).await?;
    drop(w);

    // Changed while it was away: the new watch starts from a full map with it.
    c.agents[0]
        .snapshot(vec![endpoint("shop", "web-1", &["198.18.0.3"], shop, SHOP)])
        .await?;
    expected = map_of(&[("198.18.0.3", shop, "node-a")])?;
    let mut w = Watcher::open(&c.op, "node-b", c.sessions[1]).await?;
    let first = w.step().await?;
    assert!(
        first.resync_start,
        "a new watch starts with a full map: {first:?}"
    );
    w.until(&expected).await?;
    assert_eq!(w.resyncs, 1);
    assert!(w.batches.is_empty() || w.batches[0].0 > first.version);
    assert_eq!(
        metric(&c.op, "census_map_resyncs_total", "reason=\"new_watcher\"").await?,
        2.0
    );
    c.op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_is_bound_to_the_nodes_current_session() -> TestResult {
    let c = Cluster::start(&[]).await?;
    let channel = map_channel(&c.op, None).await?;
    let refused = watch(channel.clone(), watch_request("node-z", session(1))).await?;
    expect_status(refused, Code::FailedPrecondition, &["node-z", "no session"])?;
    let refused = watch(channel.clone(), watch_request("node-a", session(99))).await?;
    expect_status(refused, Code::FailedPrecondition, &["node-a", "older"])?;
    let refused = watch(channel.clone(), watch_request("node-a", session(101))).await?;
    expect_status(
        refused,
        Code::FailedPrecondition,
        &["node-a", "not the current"],
    )?;
    let refused = watch(channel.clone(), watch_request("Not A Node", session(100))).await?;
    expect_status(refused, Code::InvalidArgument, &["node"])?;
    let mut old = watch_request("node-a", session(100));
    old.protocol_version = PROTOCOL_VERSION + 1;
    expect_status(
        watch(channel.clone(), old).await?,
        Code::FailedPrecondition,
        &["version"],
    )?;
    let mut none = watch_request("node-a", session(100));
    none.session = None;
    expect_status(
        watch(channel, none).await?,
        Code::InvalidArgument,
        &["session"],
    )?;
    assert_eq!(metric(&c.op, "census_map_watchers", "").await?, 0.0);
    c.op.shut_down().await
}

async fn lookup(
    op: &Operator,
    ip: &str,
) -> TestResult<Result<pb::EndpointMapLookupResponse, Status>> {
    let mut client = pb::endpoint_map_client::EndpointMapClient::new(map_channel(op, None).await?);
    Ok(client
        .lookup(pb::EndpointMapLookupRequest {
            protocol_version: PROTOCOL_VERSION,
            ip: ip.into(),
        })
        .await
        .map(tonic::Response::into_inner))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_shows_the_claims_of_an_address_and_its_conflicts() -> TestResult {
    let mut c = Cluster::start(&[]).await?;
    let (shop, db) = (c.shop, c.db);
    c.agents[0]
        .snapshot(vec![endpoint("shop", "web-0", &["198.18.0.2"], shop, SHOP)])
        .await?;
    let found = lookup(&c.op, "198.18.0.2").await??;
    assert_eq!(found.ip, "198.18.0.2");
    assert_eq!(found.claims.len(), 1, "{found:?}");
    let claim = &found.claims[0];
    assert_eq!(
        (
            claim.node.as_str(),
            claim.namespace.as_str(),
            claim.name.as_str()
        ),
        ("node-a", "shop", "web-0")
    );
    assert_eq!(claim.identity, shop);
    assert!(claim.winner && claim.claimed_at_ms > 0);
    assert_eq!(found.conflicts, 0);

    // The address reused on another node (its delete on node-a lost): the newer
    // claim wins, the conflict is counted and kept. (node-b has reported before: a
    // session's first snapshot claims as the oldest.)
    c.agents[1].snapshot(Vec::new()).await?;
    c.agents[1]
        .snapshot(vec![endpoint("shop", "db-0", &["198.18.0.2"], db, DB)])
        .await?;
    let found = lookup(&c.op, "198.18.0.2").await??;
    assert_eq!(found.claims.len(), 2, "{found:?}");
    assert_eq!(
        (
            found.claims[0].node.as_str(),
            found.claims[0].winner,
            found.claims[0].identity
        ),
        ("node-b", true, db)
    );
    assert_eq!(
        (found.claims[1].node.as_str(), found.claims[1].winner),
        ("node-a", false)
    );
    assert_eq!(found.conflicts, 1);
    let conflict = found.history.first().ok_or("no conflict in the history")?;
    assert_eq!(
        conflict.won.as_ref().map(|w| w.node.as_str()),
        Some("node-b")
    );
    assert_eq!(
        conflict.displaced.as_ref().map(|d| d.node.as_str()),
        Some("node-a")
    );
    assert!(metric(&c.op, "census_map_conflicts_total", "").await? >= 1.0);

    // An IPv6 address in any text form; nothing claims it.
    expect_status(
        lookup(&c.op, "2001:DB8:0::9").await?,
        Code::NotFound,
        &["2001:db8::9"],
    )?;
    for bad in ["", "198.18.0", "web-0", "198.18.0.2/32"] {
        expect_status(lookup(&c.op, bad).await?, Code::InvalidArgument, &["ip"])?;
    }
    c.op.shut_down().await
}

/// An IPv4-mapped IPv6 address is its IPv4 address: a claim of
/// `::ffff:198.18.0.7` and one of `198.18.0.7` are claims of one address, with one
/// winner and the conflict counted, and Lookup (which reads either form as IPv4)
/// sees both; an entry listing both forms claims the address once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv4_mapped_address_is_one_address_with_its_ipv4_form() -> TestResult {
    let mut c = Cluster::start(&[]).await?;
    let (shop, db) = (c.shop, c.db);
    let answer = c.agents[0]
        .snapshot(vec![endpoint(
            "shop",
            "web-0",
            &["::ffff:198.18.0.7"],
            shop,
            SHOP,
        )])
        .await?;
    assert!(answer.ack.rejected.is_empty(), "{:?}", answer.ack);
    let found = lookup(&c.op, "198.18.0.7").await??;
    assert_eq!(found.claims.len(), 1, "{found:?}");
    c.agents[1].snapshot(Vec::new()).await?;
    c.agents[1]
        .snapshot(vec![endpoint("shop", "db-0", &["198.18.0.7"], db, DB)])
        .await?;
    let found = lookup(&c.op, "::ffff:198.18.0.7").await??;
    assert_eq!(found.ip, "198.18.0.7");
    assert_eq!(
        found
            .claims
            .iter()
            .map(|c| (c.node.as_str(), c.winner))
            .collect::<Vec<_>>(),
        [("node-b", true), ("node-a", false)],
        "{found:?}"
    );
    assert_eq!(found.conflicts, 1);
    c.agents[2]
        .snapshot(vec![endpoint(
            "shop",
            "both",
            &["::ffff:198.18.0.8", "198.18.0.8"],
            shop,
            SHOP,
        )])
        .await?;
    let found = lookup(&c.op, "198.18.0.8").await??;
    assert_eq!(found.claims.len(), 1, "{found:?}");
    assert_eq!(found.conflicts, 0);
    c.op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_hello_addresses_are_remote_node_entries_of_the_map() -> TestResult {
    /// The reserved `remote-node` identity.
    const REMOTE_NODE: u32 = 6;
    let op = Operator::start(&["--map-tick-interval", "20ms"]).await?;
    let (a, b) = (session(100), session(200));
    let (_agent_a, _) =
        Agent::connect_with_addresses(&op, "node-a", a, &["198.19.0.1", "2001:db8:ff::1"]).await?;
    let (_agent_b, _) = Agent::connect(&op, "node-b", b).await?;
    let mut w = Watcher::open(&op, "node-b", b).await?;
    w.until(&map_of(&[
        ("198.19.0.1", REMOTE_NODE, "node-a"),
        ("2001:db8:ff::1", REMOTE_NODE, "node-a"),
    ])?)
    .await?;

    // A new session's Hello says the node's addresses again: what it no longer
    // lists leaves the map, what it adds comes in.
    let (_agent_a, _) =
        Agent::connect_with_addresses(&op, "node-a", session(101), &["198.19.0.9"]).await?;
    w.until(&map_of(&[("198.19.0.9", REMOTE_NODE, "node-a")])?)
        .await?;
    assert_eq!(
        metric(&op, "census_map_entries", "kind=\"node_address\"").await?,
        1.0
    );
    drop(w);
    op.shut_down().await
}
