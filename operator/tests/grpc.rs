//! The operator over real loopback gRPC: a real server started by
//! `census_operator::daemon::start`, real tonic clients (the generated ones, and for
//! reflection a generic client driven by descriptors fetched from the server).
//!
//! Every test starts its own operator on its own tempdir store. Time-driven behaviour
//! (holds, GC, quarantine) runs on short timers and is waited for with deadlines.

use std::{
    collections::BTreeSet,
    str::FromStr,
    time::{Duration, Instant},
};

use census_proto::{
    PROTOCOL_VERSION,
    pb::{self, agent_message::Body, watch_event::Kind},
};
use census_testkit::{
    Agent, Operator, TestResult, endpoint, eventually, expect_status, fail, hello, open_stream,
    open_stream_and_close, session, strings,
};
use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, ReflectMessage, Value};
use tonic::{
    Code, Status,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
};

const SHOP: &[&str] = &["k8s:app=shop", "k8s:io.kubernetes.pod.namespace=shop"];
const DB: &[&str] = &["k8s:app=db", "k8s:io.kubernetes.pod.namespace=shop"];

fn live() -> i32 {
    pb::IdentityState::Live.into()
}

fn protected() -> i32 {
    pb::IdentityState::Protected.into()
}

// ---------------------------------------------------------------------------
// The happy path
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hello_reply_carries_the_filter_the_interval_and_the_limits() -> TestResult {
    let op = Operator::start(&[
        "--snapshot-interval",
        "7s",
        "--label-exclude",
        "tenant-id",
        "--max-labels",
        "20",
        "--max-snapshot-endpoints",
        "500",
        "--max-ips-per-endpoint",
        "4",
    ])
    .await?;
    let (_agent, reply) = Agent::connect(&op, "node-a", session(100)).await?;

    assert_eq!(reply.protocol_version, PROTOCOL_VERSION);
    assert!(!reply.operator_version.is_empty());
    let filter = reply.filter.ok_or("HelloReply without a filter")?;
    for key in [
        "job-name",
        "pod-template-hash",
        "controller-uid",
        "kubernetes.io/*",
        "tenant-id",
    ] {
        assert!(
            filter.exclude.iter().any(|p| p == key),
            "{key} missing from {:?}",
            filter.exclude
        );
    }
    assert!(
        !filter
            .exclude
            .iter()
            .any(|p| p.starts_with("app.kubernetes.io")),
        "app.kubernetes.io/* is kept: users select on it"
    );
    assert_eq!(reply.snapshot_interval_ms, 7000);
    let limits = reply.limits.ok_or("HelloReply without limits")?;
    assert_eq!(limits.max_snapshot_endpoints, 500);
    assert_eq!(limits.max_labels, 20);
    assert_eq!(limits.max_ips_per_endpoint, 4);
    assert!(limits.max_message_bytes >= 4 * 1024 * 1024);
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_canonicalizes_filters_persists_and_answers_get_and_lookup() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (_agent, _) = Agent::connect(&op, "node-a", s).await?;

    let first = op
        .allocate_ok(
            "node-a",
            s,
            &[
                "k8s:tier=web",
                "k8s:job-name=nightly-28312",
                "k8s:app=shop",
                "k8s:pod-template-hash=5d8f7c9b4",
            ],
        )
        .await?;
    assert!(first.id >= 256, "{first:?} is not in the allocation range");
    assert_eq!(first.state, live(), "answered only once persisted");
    assert_eq!(first.labels, ["k8s:app=shop", "k8s:tier=web"]);
    assert_eq!(first.holds, 1);
    assert_eq!(first.references, 0);

    // The same labels in another order, duplicated, with other per-run labels.
    let again = op
        .allocate_ok(
            "node-a",
            s,
            &[
                "k8s:tier=web",
                "k8s:app=shop",
                "k8s:app=shop",
                "k8s:job-name=nightly-28313",
            ],
        )
        .await?;
    assert_eq!(again.id, first.id);
    let other = op
        .allocate_ok("node-a", s, &["k8s:app=shop", "k8s:tier=db"])
        .await?;
    assert_ne!(other.id, first.id);

    let got = op.get(first.id).await??;
    assert_eq!(got.labels, first.labels);
    assert_eq!(got.state, live());
    assert_eq!((got.references, got.holds), (0, 1));

    let mut identities = op.identities().await?;
    let found = identities
        .lookup(pb::LookupRequest {
            protocol_version: PROTOCOL_VERSION,
            labels: strings(&["k8s:job-name=x", "k8s:tier=web", "k8s:app=shop"]),
        })
        .await?
        .into_inner();
    assert_eq!(found, got);
    let unknown = identities
        .lookup(pb::LookupRequest {
            protocol_version: PROTOCOL_VERSION,
            labels: strings(&["k8s:app=nobody"]),
        })
        .await;
    expect_status(unknown, Code::NotFound, &["k8s:app=nobody"])?;

    // Persisted: a restarted operator loads the binding from the store.
    let op = op.restart(&[]).await?;
    let loaded = op.get(first.id).await??;
    assert_eq!(loaded.labels, first.labels);
    // Nothing references or holds it yet: the restart fence keeps it.
    assert_eq!(loaded.state, protected());
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_deltas_are_acked_and_node_service_shows_the_view() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let shop = op.allocate_ok("node-a", s, SHOP).await?.id;
    let ep = |name: &str, id: u32| endpoint("shop", name, &["198.18.0.2"], id, SHOP);

    let answer = agent.snapshot(vec![ep("web-0", shop)]).await?;
    assert_eq!(
        answer.ack,
        pb::Ack {
            seq: 1,
            ignored: false,
            corrections: 0,
            rejected: vec![],
            pending: vec![],
        }
    );
    assert!(answer.rebinds.is_empty());
    let node = op.get_node_ok("node-a").await?;
    assert_eq!(node.session, Some(s));
    assert!(node.connected);
    assert!(!node.stale);
    assert_eq!(node.last_seq, 1);
    assert_eq!(node.endpoints, 1);
    assert_eq!(node.adoptions, 1, "the session's first snapshot adopts");
    assert_eq!(node.corrections, 0);
    assert_eq!(node.holds, 0, "seen in the view: the hold ended");
    assert!(node.last_heard_ms > 0 && node.last_snapshot_ms > 0);

    let answer = agent.upsert(ep("web-1", shop)).await?;
    assert_eq!(answer.ack.seq, 2);
    assert!(!answer.ack.ignored);

    // web-2 never came as a delta (a lost event), web-3 claims an id that is not
    // its labels': one correction each, and a Rebind for web-3.
    let answer = agent
        .snapshot(vec![
            ep("web-0", shop),
            ep("web-1", shop),
            ep("web-2", shop),
            ep("web-3", 999),
        ])
        .await?;
    assert_eq!(answer.ack.seq, 3);
    assert_eq!(answer.ack.corrections, 2);
    assert_eq!(
        answer.rebinds,
        [pb::Rebind {
            namespace: "shop".into(),
            name: "web-3".into(),
            identity: shop
        }]
    );

    let node = op.get_node_ok("node-a").await?;
    assert_eq!(node.endpoints, 4);
    assert_eq!(node.last_seq, 3);
    assert_eq!((node.adoptions, node.corrections, node.rebinds), (1, 2, 1));
    let identity = op.get(shop).await??;
    assert_eq!(identity.references, 4);
    assert_eq!(identity.holds, 0);

    let mut nodes = op.nodes().await?;
    let listed = nodes
        .list_nodes(pb::ListNodesRequest {
            protocol_version: PROTOCOL_VERSION,
        })
        .await?
        .into_inner()
        .nodes;
    assert_eq!(listed, [node]);
    op.shut_down().await
}

/// Pods gone before their identities were answered: the agent's next snapshot says
/// their allocations have settled, and the holds end there, not at the hold
/// timeout; a later allocation still in flight keeps its hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_ends_the_holds_of_the_allocations_it_says_have_settled() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let allocated = |answer: Result<pb::Identity, Status>| {
        answer
            .map(|identity| identity.id)
            .map_err(|e| e.to_string())
    };
    let shop = allocated(op.allocate_numbered("node-a", s, 1, SHOP).await?)?;
    let db = allocated(op.allocate_numbered("node-a", s, 2, DB).await?)?;
    assert_eq!(op.get_node_ok("node-a").await?.holds, 2);

    // An agent that settles nothing yet ends nothing.
    agent.snapshot_settled(vec![], 0).await?;
    assert_eq!(op.get_node_ok("node-a").await?.holds, 2);

    agent.snapshot_settled(vec![], 1).await?;
    assert_eq!(op.get_node_ok("node-a").await?.holds, 1);
    assert_eq!(op.get(shop).await??.holds, 0);
    assert_eq!(op.get(db).await??.holds, 1);
    let (_, _, metrics) = op.admin_get("/metrics").await?;
    assert_eq!(sample(&metrics, "census_holds_settled_total"), Some(1.0));
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_paginates_filters_by_selector_and_refuses_bad_tokens() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (_agent, _) = Agent::connect(&op, "node-a", s).await?;
    let mut want = Vec::new();
    let mut db = Vec::new();
    for (i, app) in ["a", "b", "c", "d", "e"].into_iter().enumerate() {
        let tier = if i % 2 == 0 { "db" } else { "web" };
        let app = format!("k8s:app={app}");
        let tier_label = format!("k8s:tier={tier}");
        let id = op.allocate_ok("node-a", s, &[&app, &tier_label]).await?.id;
        want.push(id);
        if tier == "db" {
            db.push(id);
        }
    }
    want.sort_unstable();

    let mut client = op.identities().await?;
    let request = |page_token: String, selector: &[&str]| pb::ListRequest {
        protocol_version: PROTOCOL_VERSION,
        page_size: 2,
        page_token,
        selector: strings(selector),
        include_quarantined: false,
    };
    let mut pages = Vec::new();
    let mut token = String::new();
    loop {
        let page = client.list(request(token, &[])).await?.into_inner();
        pages.push(page.identities.iter().map(|i| i.id).collect::<Vec<_>>());
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
        if pages.len() > 5 {
            return fail("List does not end");
        }
    }
    assert_eq!(pages.iter().map(Vec::len).collect::<Vec<_>>(), [2, 2, 1]);
    assert_eq!(pages.concat(), want);

    let page = client
        .list(pb::ListRequest {
            page_size: 0,
            ..request(String::new(), &["k8s:tier=db"])
        })
        .await?
        .into_inner();
    let mut got: Vec<u32> = page.identities.iter().map(|i| i.id).collect();
    got.sort_unstable();
    db.sort_unstable();
    assert_eq!(got, db);
    assert!(page.next_page_token.is_empty());
    assert!(
        page.identities
            .iter()
            .all(|i| i.labels.iter().any(|l| l == "k8s:tier=db"))
    );

    let before = op.observe().await?;
    let bad = client.list(request("not-a-token".into(), &[])).await;
    expect_status(bad, Code::InvalidArgument, &["page_token"])?;
    let bad = client.list(request(String::new(), &["k8s:tier"])).await;
    expect_status(bad, Code::InvalidArgument, &["selector[0]", "k8s:tier"])?;
    assert_eq!(op.observe().await?, before);
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_sends_the_full_list_then_upserts_and_removals() -> TestResult {
    // The node goes silent after Hello: its view and holds are dropped after the
    // node TTL, and GC deletes the identities after the grace period.
    let op = Operator::start(&[
        "--snapshot-interval",
        "1s",
        "--node-ttl",
        "1s",
        "--hold-timeout",
        "1s",
        "--grace-period",
        "200ms",
        "--quarantine",
        "30s",
    ])
    .await?;
    let s = session(100);
    let (_agent, _) = Agent::connect(&op, "node-a", s).await?;
    let shop = op.allocate_ok("node-a", s, SHOP).await?;
    let db = op.allocate_ok("node-a", s, DB).await?;

    let mut watch = op.watch().await?;
    let mut next = async || watch.next().await;
    let kind = |e: &pb::WatchEvent| Kind::try_from(e.kind).unwrap_or(Kind::Unspecified);

    assert_eq!(kind(&next().await?), Kind::ResyncStart);
    let mut listed = BTreeSet::new();
    for _ in 0..2 {
        let event = next().await?;
        assert_eq!(kind(&event), Kind::Upsert);
        let identity = event.identity.ok_or("UPSERT without an identity")?;
        listed.insert((identity.id, identity.labels));
    }
    assert_eq!(
        listed,
        BTreeSet::from([(shop.id, shop.labels), (db.id, db.labels)])
    );
    assert_eq!(kind(&next().await?), Kind::ResyncEnd);

    let web = op
        .allocate_ok("node-a", s, &["k8s:app=web", "k8s:tier=front"])
        .await?;
    // Changes of shop and db (their holds end) may come first.
    let event = loop {
        let event = next().await?;
        if event.identity.as_ref().is_some_and(|i| i.id == web.id) {
            break event;
        }
    };
    assert_eq!(kind(&event), Kind::Upsert);
    let identity = event.identity.ok_or("UPSERT without an identity")?;
    assert_eq!((identity.id, &identity.labels), (web.id, &web.labels));

    let mut removed = BTreeSet::new();
    while !removed.contains(&web.id) {
        let event = next().await?;
        if kind(&event) == Kind::Upsert {
            // A state change on the way (released, deleting).
            continue;
        }
        assert_eq!(kind(&event), Kind::Removed, "{event:?}");
        let identity = event.identity.ok_or("REMOVED without an identity")?;
        assert!(!identity.labels.is_empty(), "REMOVED names the labels");
        removed.insert(identity.id);
    }
    let gone = op.get(web.id).await??;
    assert_eq!(gone.state, i32::from(pb::IdentityState::Quarantined));
    assert!(gone.labels.is_empty());
    op.shut_down().await
}

/// What a Watch event says of one identity: kind, state, references, holds.
fn life_step(event: &pb::WatchEvent) -> (Kind, i32, u64, u32) {
    let kind = Kind::try_from(event.kind).unwrap_or(Kind::Unspecified);
    let identity = event.identity.clone().unwrap_or_default();
    (kind, identity.state, identity.references, identity.holds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_follows_one_identity_from_allocation_to_removal() -> TestResult {
    // What nothing uses is released at once (after the start's fence of one node
    // TTL) and deleted 200 ms later.
    let op = Operator::start(&[
        "--snapshot-interval",
        "1s",
        "--node-ttl",
        "2s",
        "--grace-period",
        "200ms",
        "--quarantine",
        "30s",
    ])
    .await?;
    let mut watch = op.watch().await?;
    let mut next = async || watch.next().await;
    assert_eq!(life_step(&next().await?).0, Kind::ResyncStart);
    assert_eq!(life_step(&next().await?).0, Kind::ResyncEnd);

    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let shop = op.allocate_ok("node-a", s, SHOP).await?;
    let created = next().await?;
    let identity = created.identity.clone().unwrap_or_default();
    assert_eq!((identity.id, &identity.labels), (shop.id, &shop.labels));
    assert_eq!(
        life_step(&created),
        (Kind::Upsert, live(), 0, 1),
        "{created:?}"
    );

    // Two endpoints and the end of the hold: one event.
    agent
        .snapshot(vec![
            endpoint("shop", "web-0", &[], shop.id, SHOP),
            endpoint("shop", "web-1", &[], shop.id, SHOP),
        ])
        .await?;
    let referenced = next().await?;
    assert_eq!(
        life_step(&referenced),
        (Kind::Upsert, live(), 2, 0),
        "{referenced:?}"
    );

    agent.snapshot(vec![]).await?;
    let unused = next().await?;
    let (kind, state, references, holds) = life_step(&unused);
    // Still inside the start's fence (PROTECTED), or just past it (LIVE until the
    // next tick releases it).
    assert!(
        kind == Kind::Upsert && (state == protected() || state == live()),
        "{unused:?}"
    );
    assert_eq!((references, holds), (0, 0), "{unused:?}");
    let released = next().await?;
    assert_eq!(
        life_step(&released),
        (Kind::Upsert, i32::from(pb::IdentityState::Released), 0, 0),
        "{released:?}"
    );
    assert_ne!(released.identity.map_or(0, |i| i.released_at_ms), 0);
    let deleting = next().await?;
    assert_eq!(
        life_step(&deleting),
        (Kind::Upsert, i32::from(pb::IdentityState::Deleting), 0, 0),
        "{deleting:?}"
    );
    let removed = next().await?;
    assert_eq!(life_step(&removed).0, Kind::Removed, "{removed:?}");
    assert_eq!(
        removed.identity,
        Some(pb::Identity {
            id: shop.id,
            labels: shop.labels,
            ..pb::Identity::default()
        }),
        "REMOVED carries only the id and the labels"
    );
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_unused_identities_are_shown_protected_until_the_fence_ends() -> TestResult
{
    let args = [
        "--snapshot-interval",
        "1s",
        "--node-ttl",
        "3s",
        "--grace-period",
        "30s",
    ];
    let op = Operator::start(&args).await?;
    let s = session(100);
    let (_agent, _) = Agent::connect(&op, "node-a", s).await?;
    let shop = op.allocate_ok("node-a", s, SHOP).await?;
    let op = op.restart(&args).await?;

    // Loaded, with no reference nor hold: kept by the fence, and shown so.
    let got = op.get(shop.id).await??;
    assert_eq!(
        (got.state, got.references, got.holds),
        (protected(), 0, 0),
        "{got:?}"
    );
    assert_ne!(got.protected_until_ms, 0, "{got:?}");
    assert_eq!(op.list_all().await?, vec![got.clone()]);
    let (_, _, metrics) = op.admin_get("/metrics").await?;
    for line in [
        "census_identities{state=\"protected\"} 1",
        "census_identities{state=\"live\"} 0",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "no line {line:?} in\n{metrics}"
        );
    }
    let mut watch = op.watch().await?;
    let mut next = async || watch.next().await;
    assert_eq!(life_step(&next().await?).0, Kind::ResyncStart);
    let listed = next().await?;
    assert_eq!(listed.identity.as_ref(), Some(&got));
    assert_eq!(life_step(&next().await?).0, Kind::ResyncEnd);

    // The fence ends a node TTL after the start: released, and told so.
    let released = next().await?;
    assert_eq!(
        life_step(&released),
        (Kind::Upsert, i32::from(pb::IdentityState::Released), 0, 0),
        "{released:?}"
    );
    op.shut_down().await
}

// ---------------------------------------------------------------------------
// Bad input: a precise status, and state untouched
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_labels_are_invalid_argument_naming_label_and_field() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (_agent, _) = Agent::connect(&op, "node-a", s).await?;
    op.allocate_ok("node-a", s, SHOP).await?;
    let before = op.observe().await?;

    let cases: &[(&[&str], &[&str])] = &[
        (
            &["k8s:tier=db", "k8s:app"],
            &["labels[1]", "\"k8s:app\"", "no `=`"],
        ),
        (
            &["k8s:tier=db", "k8s:-x=y"],
            &["labels[1]", "\"k8s:-x=y\"", "key's name"],
        ),
        (
            &["k8s:tier=db", ":app=web"],
            &["labels[1]", "\":app=web\"", "source is empty"],
        ),
        (
            &["app=web"],
            &["labels[0]", "\"app=web\"", "source:key=value"],
        ),
        (
            &["reserved:host="],
            &["labels[0]", "\"reserved:host=\"", "reserved"],
        ),
        (
            &["k8s:app=a", "k8s:app=b"],
            &["labels", "k8s:app=a", "k8s:app=b"],
        ),
        (&[], &["labels", "at least one label"]),
        (
            &["k8s:job-name=x"],
            &["labels", "after the label filter", "at least one label"],
        ),
    ];
    let mut client = op.identities().await?;
    for (labels, needles) in cases {
        let answer = op.allocate("node-a", s, labels).await?;
        expect_status(answer, Code::InvalidArgument, needles)?;
        let answer = client
            .lookup(pb::LookupRequest {
                protocol_version: PROTOCOL_VERSION,
                labels: strings(labels),
            })
            .await;
        expect_status(answer, Code::InvalidArgument, needles)?;
    }
    assert_eq!(op.observe().await?, before);
    op.shut_down().await
}

/// `labels_from_wire` names the first label that *starts with* the bad one, so a bad
/// `k8s:app` after a good `k8s:app=web` is reported as `labels[0]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_label_index_is_exact_when_a_good_label_shares_its_prefix() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (_agent, _) = Agent::connect(&op, "node-a", s).await?;
    let answer = op
        .allocate("node-a", s, &["k8s:app=web", "k8s:app"])
        .await?;
    expect_status(answer, Code::InvalidArgument, &["labels[1]", "\"k8s:app\""])?;
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_set_over_the_size_limit_is_refused_by_allocate_and_rejected_in_a_snapshot()
-> TestResult {
    let op = Operator::start(&["--max-labels", "4"]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let four = ["k8s:a=1", "k8s:b=2", "k8s:c=3", "k8s:d=4"];
    let id = op.allocate_ok("node-a", s, &four).await?.id;
    agent
        .snapshot(vec![endpoint("shop", "web-0", &[], id, &four)])
        .await?;
    let before = op.observe().await?;

    let five = ["k8s:a=1", "k8s:b=2", "k8s:c=3", "k8s:d=4", "k8s:e=5"];
    let answer = op.allocate("node-a", s, &five).await?;
    expect_status(
        answer,
        Code::InvalidArgument,
        &["labels", "5 labels", "limit of 4"],
    )?;
    assert_eq!(op.observe().await?, before);
    // In a snapshot, the entry is rejected alone: left out of the view.
    let answer = agent
        .snapshot(vec![endpoint("shop", "web-0", &[], id, &five)])
        .await?;
    let rejected = rejected(&answer.ack);
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(rejected[0].0, "shop/web-0");
    assert_eq!(rejected[0].1, "labels: 5 labels exceed the limit of 4");
    assert_eq!(op.get_node_ok("node-a").await?.endpoints, 0);
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_over_the_endpoint_limit_ends_the_stream_and_keeps_the_view() -> TestResult {
    let op = Operator::start(&["--max-snapshot-endpoints", "3"]).await?;
    let s = session(100);
    let (mut agent, reply) = Agent::connect(&op, "node-a", s).await?;
    assert_eq!(
        reply.limits.map(|l| l.max_snapshot_endpoints),
        Some(3),
        "the agent is told the limit"
    );
    let id = op.allocate_ok("node-a", s, SHOP).await?.id;
    let ep = |name: &str| endpoint("shop", name, &["198.18.0.2"], id, SHOP);
    agent.snapshot(vec![ep("web-0"), ep("web-1")]).await?;
    let before = op.observe().await?;

    let seq = agent.next_seq();
    agent
        .send(
            seq,
            Body::Snapshot(pb::Snapshot {
                endpoints: vec![ep("web-0"), ep("web-1"), ep("web-2"), ep("web-3")],
                allocations_settled: 0,
            }),
        )
        .await?;
    agent
        .expect_end(
            Code::InvalidArgument,
            &["snapshot.endpoints", "4 entries", "limit of 3"],
        )
        .await?;

    let after = op.observe().await?;
    assert_eq!(after, before);
    let node = after.node("node-a").ok_or("node-a is gone")?;
    assert_eq!((node.endpoints, node.last_seq), (2, 1));
    assert_eq!(after.identity(id).map(|i| i.references), Some(2));
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_entries_are_rejected_alone_naming_the_entry_and_the_field() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let id = op.allocate_ok("node-a", s, SHOP).await?.id;
    let ep = |name: &str, ips: &[&str], id: u32| endpoint("shop", name, ips, id, SHOP);

    // (the snapshot, the entry it rejects, what its reason says); web-0 is always
    // good and taken.
    let cases: Vec<(Vec<pb::Endpoint>, &str, &[&str])> = vec![
        (
            vec![ep("web-0", &[], id), ep("web-1", &["198.18.0.300"], id)],
            "shop/web-1",
            &["ips[0]", "198.18.0.300", "not an IPv4 or IPv6"],
        ),
        (
            vec![
                ep("web-0", &[], id),
                ep("web-1", &["198.18.0.2", "2001:db8::zz"], id),
            ],
            "shop/web-1",
            &["ips[1]", "2001:db8::zz"],
        ),
        (
            vec![ep("web-0", &[], id), ep("web-1", &[], 0)],
            "shop/web-1",
            &["identity", "must not be 0"],
        ),
        (
            vec![
                ep("web-0", &[], id),
                endpoint("Shop", "web-1", &[], id, SHOP),
            ],
            "Shop/web-1",
            &["namespace", "\"Shop\""],
        ),
        (
            vec![ep("web-0", &[], id), endpoint("shop", "", &[], id, SHOP)],
            "shop/",
            &["name", "is required"],
        ),
        (
            vec![
                ep("web-0", &[], id),
                endpoint("shop", "web-1", &[], id, &["k8s:tier=db", "k8s:app"]),
            ],
            "shop/web-1",
            &["labels[1]", "\"k8s:app\""],
        ),
    ];
    for (endpoints, key, needles) in cases {
        let answer = agent.snapshot(endpoints).await?;
        let rejected = rejected(&answer.ack);
        let [(named, reason)] = rejected.as_slice() else {
            return fail(format!("one rejection for {key} expected: {rejected:?}"));
        };
        assert_eq!(named, key);
        for needle in needles {
            assert!(reason.contains(needle), "{reason:?} should name {needle:?}");
        }
        assert_eq!(
            op.get_node_ok("node-a").await?.endpoints,
            1,
            "{key}: web-0 is taken"
        );
    }

    // Of two entries with one key, the first is taken.
    let answer = agent
        .snapshot(vec![
            ep("web-0", &["198.18.0.2"], id),
            ep("web-0", &[], 999),
        ])
        .await?;
    assert_eq!(
        rejected(&answer.ack),
        [(
            "shop/web-0".to_owned(),
            "duplicate endpoint key, first entry kept".to_owned()
        )]
    );
    assert!(
        answer.rebinds.is_empty(),
        "the second one's id is never looked at"
    );
    let before = op.observe().await?;

    // A bad upsert and a bad delete are rejected the same way, and change nothing.
    let answer = agent.upsert(ep("web-1", &["x"], id)).await?;
    assert_eq!(
        rejected(&answer.ack),
        [(
            "shop/web-1".to_owned(),
            "ips[0]: \"x\" is not an IPv4 or IPv6 address".to_owned()
        )]
    );
    let seq = agent.next_seq();
    let answer = agent
        .exchange(
            seq,
            Body::Delete(pb::EndpointDelete {
                namespace: "shop".into(),
                name: String::new(),
            }),
        )
        .await?;
    assert_eq!(
        rejected(&answer.ack),
        [("shop/".to_owned(), "name: is required".to_owned())]
    );
    assert_eq!(op.observe().await?, before);

    // And the stream still works for good input.
    let answer = agent
        .snapshot(vec![ep("web-0", &["198.18.0.2"], id), ep("web-1", &[], id)])
        .await?;
    assert!(!answer.ack.ignored);
    assert!(answer.ack.rejected.is_empty());
    assert_eq!(op.get_node_ok("node-a").await?.endpoints, 2);
    op.shut_down().await
}

/// An address no endpoint can have (unspecified, broadcast, loopback, multicast,
/// link-local, in either family, and IPv4-mapped) rejects its entry alone, naming
/// the address and what it is; the benchmarking and documentation ranges the tests
/// use stay allowed. A Hello naming such an address as the node's is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_no_endpoint_can_have_are_rejected_naming_what_they_are() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let id = op.allocate_ok("node-a", s, SHOP).await?.id;
    let cases = [
        ("0.0.0.0", "the unspecified address"),
        ("0.1.2.3", "0.0.0.0/8"),
        ("::", "the unspecified address"),
        ("255.255.255.255", "the broadcast address"),
        ("127.0.0.1", "a loopback address"),
        ("127.9.9.9", "a loopback address"),
        ("::1", "a loopback address"),
        ("::ffff:127.0.0.1", "a loopback address"),
        ("224.0.0.1", "a multicast address"),
        ("239.1.2.3", "a multicast address"),
        ("ff02::1", "a multicast address"),
        ("169.254.1.1", "a link-local address"),
        ("fe80::1", "a link-local address"),
    ];
    let mut endpoints = vec![endpoint(
        "shop",
        "good",
        &[
            "198.18.0.2",
            "198.19.255.1",
            "10.1.2.3",
            "2001:db8::2",
            "fd00::2",
        ],
        id,
        SHOP,
    )];
    for (i, (ip, _)) in cases.iter().enumerate() {
        endpoints.push(endpoint(
            "shop",
            &format!("bad-{i}"),
            &["198.18.0.9", ip],
            id,
            SHOP,
        ));
    }
    let answer = agent.snapshot(endpoints).await?;
    let refused = rejected(&answer.ack);
    assert_eq!(refused.len(), cases.len(), "{refused:?}");
    for (i, (ip, what)) in cases.iter().enumerate() {
        let (key, reason) = &refused[i];
        assert_eq!(key, &format!("shop/bad-{i}"));
        assert!(
            reason.starts_with("ips[1]: ") && reason.contains(what),
            "{ip}: {reason:?} should name ips[1] and {what:?}"
        );
    }
    assert_eq!(
        op.get_node_ok("node-a").await?.endpoints,
        1,
        "good is taken"
    );
    // An upsert likewise.
    let answer = agent
        .upsert(endpoint("shop", "late", &["127.0.0.1"], id, SHOP))
        .await?;
    assert_eq!(
        rejected(&answer.ack),
        [(
            "shop/late".to_owned(),
            "ips[0]: 127.0.0.1 is a loopback address: no endpoint has it".to_owned()
        )]
    );
    // A Hello naming a loopback address as the node's own is refused.
    let mut hello = hello("node-b", session(200));
    if let Some(Body::Hello(hello)) = &mut hello.body {
        hello.addresses = vec!["198.18.5.5".into(), "127.0.0.1".into()];
    }
    let refused = open_stream(&op, vec![hello]).await?;
    expect_status(
        refused.map(|_| ()),
        Code::InvalidArgument,
        &["hello.addresses[1]", "127.0.0.1 is a loopback address"],
    )?;
    op.shut_down().await
}

/// --max-labels counts the labels the label filter keeps: 70 labels of which 6 are
/// filtered out are 64, allowed by Allocate and in a snapshot; 65 kept are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_labels_counts_the_labels_the_filter_keeps() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let filtered = [
        "k8s:controller-uid=1",
        "k8s:job-name=j",
        "k8s:pod-template-hash=abc",
        "k8s:controller-revision-hash=r",
        "k8s:pod-template-generation=1",
        "k8s:statefulset.kubernetes.io/pod-name=p",
    ];
    let labels = |kept: usize| -> Vec<String> {
        (0..kept)
            .map(|i| format!("k8s:l{i}=v"))
            .chain(filtered.iter().map(|l| (*l).to_owned()))
            .collect()
    };
    let seventy = labels(64);
    let seventy: Vec<&str> = seventy.iter().map(String::as_str).collect();
    assert_eq!(seventy.len(), 70);
    let identity = op.allocate_ok("node-a", s, &seventy).await?;
    assert_eq!(identity.labels.len(), 64, "the filtered labels are dropped");
    let answer = agent
        .snapshot(vec![endpoint(
            "shop",
            "web-0",
            &["198.18.0.2"],
            identity.id,
            &seventy,
        )])
        .await?;
    assert!(answer.ack.rejected.is_empty(), "{:?}", answer.ack);
    let over = labels(65);
    let over: Vec<&str> = over.iter().map(String::as_str).collect();
    expect_status(
        op.allocate("node-a", s, &over).await?,
        Code::InvalidArgument,
        &["labels", "65 labels", "limit of 64"],
    )?;
    op.shut_down().await
}

/// The entries an Ack rejects: (namespace/name, reason).
fn rejected(ack: &pb::Ack) -> Vec<(String, String)> {
    ack.rejected
        .iter()
        .map(|r| (format!("{}/{}", r.namespace, r.name), r.reason.clone()))
        .collect()
}

/// The value of the sample `series` in an OpenMetrics text, if it is there.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| {
        let value = line.strip_prefix(series)?.strip_prefix(' ')?;
        value.parse().ok()
    })
}

/// Issue 10: one bad entry costs neither the node its stream nor the other entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_snapshot_entry_is_rejected_alone_and_the_stream_stays_open() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let id = op.allocate_ok("node-a", s, SHOP).await?.id;
    let good = |name: &str, ip: &str| endpoint("shop", name, &[ip], id, SHOP);
    let bad = endpoint(
        "shop",
        "bad-0",
        &["198.18.0.9"],
        id,
        &["k8s:-x=y", "k8s:io.kubernetes.pod.namespace=shop"],
    );
    let snapshot = vec![
        good("web-0", "198.18.0.2"),
        bad.clone(),
        good("web-1", "198.18.0.3"),
        good("web-2", "198.18.0.4"),
    ];

    let answer = agent.snapshot(snapshot.clone()).await?;
    assert!(!answer.ack.ignored);
    let first = rejected(&answer.ack);
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(first[0].0, "shop/bad-0");
    assert!(
        first[0].1.starts_with("labels[0]: label \"k8s:-x=y\""),
        "the reason names the field and the label: {first:?}"
    );
    let node = op.get_node_ok("node-a").await?;
    assert_eq!(node.endpoints, 3, "the three good entries are applied");
    assert_eq!(op.get(id).await??.references, 3);

    // The agent resends it: rejected again, the same way, and the stream goes on.
    let answer = agent.snapshot(snapshot).await?;
    assert_eq!(rejected(&answer.ack), first);
    assert_eq!(op.get_node_ok("node-a").await?.endpoints, 3);
    let (_, _, metrics) = op.admin_get("/metrics").await?;
    assert_eq!(
        sample(&metrics, "census_rejected_entries_total{reason=\"labels\"}"),
        Some(2.0),
        "counted in every message that carries it"
    );

    // Its labels fixed, the entry is taken.
    let answer = agent
        .snapshot(vec![
            good("web-0", "198.18.0.2"),
            good("bad-0", "198.18.0.9"),
            good("web-1", "198.18.0.3"),
            good("web-2", "198.18.0.4"),
        ])
        .await?;
    assert!(answer.ack.rejected.is_empty(), "{:?}", answer.ack);
    assert_eq!(op.get_node_ok("node-a").await?.endpoints, 4);

    // A bad upsert is acked with its rejection and changes nothing.
    let before = op.observe().await?;
    let answer = agent.upsert(good("web-3", "198.18.0.300")).await?;
    let upserted = rejected(&answer.ack);
    assert_eq!(upserted.len(), 1, "{upserted:?}");
    assert_eq!(upserted[0].0, "shop/web-3");
    assert!(
        upserted[0].1.starts_with("ips[0]: \"198.18.0.300\""),
        "{upserted:?}"
    );
    assert_eq!(op.observe().await?, before);

    // A message malformed as a whole still ends the stream, naming the field.
    let seq = agent.next_seq();
    agent
        .send(seq, Body::Upsert(pb::EndpointUpsert { endpoint: None }))
        .await?;
    agent
        .expect_end(Code::InvalidArgument, &["upsert.endpoint", "is required"])
        .await?;
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_before_hello_is_failed_precondition() -> TestResult {
    let op = Operator::start(&[]).await?;
    let before = op.observe().await?;
    let upsert = pb::AgentMessage {
        seq: 1,
        body: Some(Body::Upsert(pb::EndpointUpsert {
            endpoint: Some(endpoint("shop", "web-0", &[], 300, SHOP)),
        })),
    };
    let answer = open_stream(&op, vec![upsert, hello("node-a", session(100))]).await?;
    expect_status(
        answer,
        Code::FailedPrecondition,
        &["first message", "Hello"],
    )?;
    let answer = open_stream_and_close(&op, vec![]).await?;
    expect_status(answer, Code::FailedPrecondition, &["before Hello"])?;
    assert_eq!(op.observe().await?, before);
    assert!(before.nodes.is_empty());
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_with_bad_addresses_is_invalid_argument_naming_the_address() -> TestResult {
    let op = Operator::start(&[]).await?;
    let before = op.observe().await?;
    let with = |addresses: Vec<String>| {
        let mut h = hello("node-a", session(100));
        if let Some(Body::Hello(h)) = &mut h.body {
            h.addresses = addresses;
        }
        h
    };
    let answer = open_stream(&op, vec![with(vec!["10.0.0.1".into(), "node-a".into()])]).await?;
    expect_status(
        answer,
        Code::InvalidArgument,
        &[
            "hello.addresses[1]",
            "\"node-a\"",
            "not an IPv4 or IPv6 address",
        ],
    )?;
    let many = (0..17).map(|i| format!("10.0.0.{i}")).collect();
    let answer = open_stream(&op, vec![with(many)]).await?;
    expect_status(
        answer,
        Code::InvalidArgument,
        &["hello.addresses", "17", "16"],
    )?;
    assert_eq!(
        op.observe().await?,
        before,
        "a refused Hello changes nothing"
    );
    assert!(before.nodes.is_empty());
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_hello_on_a_stream_is_failed_precondition() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    for seq in [0, 5] {
        let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
        let before = op.observe().await?;
        let second = hello("node-a", session(200));
        let body = second.body.ok_or("hello has a body")?;
        agent.send(seq, body).await?;
        agent
            .expect_end(Code::FailedPrecondition, &["Hello", "first message"])
            .await?;
        assert_eq!(op.observe().await?, before, "second Hello with seq {seq}");
        assert_eq!(
            op.get_node_ok("node-a").await?.session,
            Some(s),
            "the second Hello changed nothing"
        );
    }
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_session_replaces_the_stream_and_an_older_one_is_refused() -> TestResult {
    let op = Operator::start(&[]).await?;
    let (s1, s2) = (session(100), session(200));
    let (mut a, _) = Agent::connect(&op, "node-a", s1).await?;
    let id = op.allocate_ok("node-a", s1, SHOP).await?.id;
    a.snapshot(vec![endpoint("shop", "web-0", &[], id, SHOP)])
        .await?;

    let (_b, _) = Agent::connect(&op, "node-a", s2).await?;
    a.expect_end(
        Code::FailedPrecondition,
        &["node-a", "replaced", "200-0000000000000007"],
    )
    .await?;
    let node = op.get_node_ok("node-a").await?;
    assert_eq!(node.session, Some(s2));
    assert!(node.connected, "stream B is the node's stream");
    assert_eq!(node.last_seq, 0, "a new session starts its seq again");
    assert_eq!(
        node.endpoints, 1,
        "the view stays until the new session's snapshot"
    );

    let before = op.observe().await?;
    let answer = open_stream(&op, vec![hello("node-a", s1)]).await?;
    expect_status(
        answer,
        Code::FailedPrecondition,
        &[
            "node-a",
            "100-0000000000000007",
            "200-0000000000000007",
            "older",
        ],
    )?;
    let answer = op.allocate("node-a", s1, DB).await?;
    expect_status(
        answer,
        Code::FailedPrecondition,
        &["100-0000000000000007", "200-0000000000000007"],
    )?;
    assert_eq!(op.observe().await?, before);
    assert!(op.get_node_ok("node-a").await?.connected);
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_seq_is_acked_as_ignored_and_counted() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let id = op.allocate_ok("node-a", s, SHOP).await?.id;
    let ep = |name: &str| endpoint("shop", name, &[], id, SHOP);
    agent.snapshot(vec![ep("web-0")]).await?;
    agent.upsert(ep("web-1")).await?;
    let before = op.observe().await?;

    let answer = agent
        .exchange(
            1,
            Body::Snapshot(pb::Snapshot {
                endpoints: vec![],
                allocations_settled: 0,
            }),
        )
        .await?;
    assert_eq!(
        answer.ack,
        pb::Ack {
            seq: 1,
            ignored: true,
            corrections: 0,
            rejected: vec![],
            pending: vec![],
        }
    );
    let answer = agent
        .exchange(
            2,
            Body::Delete(pb::EndpointDelete {
                namespace: "shop".into(),
                name: "web-0".into(),
            }),
        )
        .await?;
    assert!(answer.ack.ignored);

    let mut after = op.observe().await?;
    let node = after.nodes.first_mut().ok_or("no node")?;
    assert_eq!(node.old_seq_ignored, 2);
    assert_eq!((node.last_seq, node.endpoints), (2, 2));
    node.old_seq_ignored = 0;
    assert_eq!(after, before, "ignored messages change nothing else");

    // seq 0 is Hello's alone.
    agent
        .send(
            0,
            Body::Upsert(pb::EndpointUpsert {
                endpoint: Some(ep("web-2")),
            }),
        )
        .await?;
    agent
        .expect_end(Code::InvalidArgument, &["seq", "above 0"])
        .await?;
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_version_mismatch_is_failed_precondition_naming_both() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (_agent, _) = Agent::connect(&op, "node-a", s).await?;
    let id = op.allocate_ok("node-a", s, SHOP).await?.id;
    let before = op.observe().await?;
    let both: &[&str] = &["version mismatch", "version 2", "version 1"];

    let mut identities = op.identities().await?;
    let answer = identities
        .allocate(pb::AllocateRequest {
            protocol_version: 2,
            node: "node-a".into(),
            session: Some(s),
            labels: strings(DB),
            allocation: 0,
        })
        .await;
    expect_status(answer, Code::FailedPrecondition, both)?;
    let answer = identities
        .get(pb::GetRequest {
            protocol_version: 2,
            id,
        })
        .await;
    expect_status(answer, Code::FailedPrecondition, both)?;
    let answer = identities
        .lookup(pb::LookupRequest {
            protocol_version: 2,
            labels: strings(SHOP),
        })
        .await;
    expect_status(answer, Code::FailedPrecondition, both)?;
    let answer = identities
        .list(pb::ListRequest {
            protocol_version: 2,
            ..pb::ListRequest::default()
        })
        .await;
    expect_status(answer, Code::FailedPrecondition, both)?;
    let answer = identities.list(pb::ListRequest::default()).await;
    expect_status(
        answer,
        Code::FailedPrecondition,
        &["version 0", "version 1", "unset"],
    )?;
    let answer = identities
        .watch(pb::WatchRequest {
            protocol_version: 2,
        })
        .await;
    expect_status(answer, Code::FailedPrecondition, both)?;
    let mut nodes = op.nodes().await?;
    let answer = nodes
        .get_node(pb::GetNodeRequest {
            protocol_version: 2,
            name: "node-a".into(),
        })
        .await;
    expect_status(answer, Code::FailedPrecondition, both)?;
    let answer = nodes
        .list_nodes(pb::ListNodesRequest {
            protocol_version: 2,
        })
        .await;
    expect_status(answer, Code::FailedPrecondition, both)?;
    let answer = nodes
        .get_version(pb::GetVersionRequest {
            protocol_version: 2,
        })
        .await;
    expect_status(answer, Code::FailedPrecondition, both)?;

    let mut bad_hello = hello("node-a", session(200));
    if let Some(Body::Hello(h)) = &mut bad_hello.body {
        h.protocol_version = 2;
    }
    let answer = open_stream(&op, vec![bad_hello]).await?;
    expect_status(answer, Code::FailedPrecondition, both)?;
    assert_eq!(op.observe().await?, before);
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_needs_the_nodes_current_session() -> TestResult {
    let op = Operator::start(&[]).await?;
    let before = op.observe().await?;
    let answer = op.allocate("node-x", session(100), SHOP).await?;
    expect_status(
        answer,
        Code::FailedPrecondition,
        &["node-x", "no session", "Hello"],
    )?;
    assert_eq!(op.observe().await?, before);

    let current = session(200);
    let (_agent, _) = Agent::connect(&op, "node-a", current).await?;
    let before = op.observe().await?;
    let answer = op.allocate("node-a", session(100), SHOP).await?;
    expect_status(
        answer,
        Code::FailedPrecondition,
        &[
            "node-a",
            "100-0000000000000007",
            "older",
            "200-0000000000000007",
        ],
    )?;
    let answer = op.allocate("node-a", session(300), SHOP).await?;
    expect_status(
        answer,
        Code::FailedPrecondition,
        &["node-a", "300-0000000000000007", "not the current session"],
    )?;

    let mut identities = op.identities().await?;
    let answer = identities
        .allocate(pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: "node-a".into(),
            session: None,
            labels: strings(SHOP),
            allocation: 0,
        })
        .await;
    expect_status(answer, Code::InvalidArgument, &["session", "is required"])?;
    let answer = op.allocate("Node_A", current, SHOP).await?;
    expect_status(answer, Code::InvalidArgument, &["node", "\"Node_A\""])?;
    assert_eq!(op.observe().await?, before);

    assert!(op.allocate("node-a", current, SHOP).await?.is_ok());
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_id_range_is_resource_exhausted_until_ids_are_freed() -> TestResult {
    let op = Operator::start(&[
        "--id-range",
        "256-258",
        "--snapshot-interval",
        "1s",
        "--node-ttl",
        "1s",
        "--hold-timeout",
        "1s",
        "--grace-period",
        "1s",
        "--quarantine",
        "2s",
    ])
    .await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let mut ids = BTreeSet::new();
    for app in ["a", "b", "c"] {
        let label = format!("k8s:app={app}");
        ids.insert(op.allocate_ok("node-a", s, &[&label]).await?.id);
    }
    assert_eq!(ids, BTreeSet::from([256, 257, 258]));

    let before = op.observe().await?;
    let answer = op.allocate("node-a", s, &["k8s:app=d"]).await?;
    expect_status(
        answer,
        Code::ResourceExhausted,
        &["identity range 256-258", "exhausted"],
    )?;
    assert_eq!(op.observe().await?, before);

    // The node stays alive with snapshots that reference none of the three: their
    // holds expire, GC deletes them, and their quarantine ends.
    let deadline = Instant::now() + Duration::from_secs(20);
    let fresh = loop {
        agent.snapshot(vec![]).await?;
        match op.allocate("node-a", s, &["k8s:app=d"]).await? {
            Ok(identity) => break identity,
            Err(status) if status.code() == Code::ResourceExhausted => {}
            Err(status) => return fail(format!("Allocate failed otherwise: {status:?}")),
        }
        if Instant::now() > deadline {
            return fail("no id was freed within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(ids.contains(&fresh.id), "{fresh:?} is from the range");
    assert_eq!(fresh.labels, ["k8s:app=d"]);
    let node = op.get_node_ok("node-a").await?;
    assert!(node.connected, "the node was kept alive");
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hold_quota_is_resource_exhausted() -> TestResult {
    let op = Operator::start(&["--max-holds-per-node", "2"]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let a = op.allocate_ok("node-a", s, &["k8s:app=a"]).await?.id;
    op.allocate_ok("node-a", s, &["k8s:app=b"]).await?;

    let before = op.observe().await?;
    let answer = op.allocate("node-a", s, &["k8s:app=c"]).await?;
    expect_status(
        answer,
        Code::ResourceExhausted,
        &["node-a", "holds 2", "limit"],
    )?;
    assert_eq!(op.observe().await?, before);
    // A label set the node already holds is still answered.
    assert_eq!(op.allocate_ok("node-a", s, &["k8s:app=a"]).await?.id, a);

    // Seen in the node's view, `a` is no longer held: room for one more.
    agent
        .snapshot(vec![endpoint("shop", "web-0", &[], a, &["k8s:app=a"])])
        .await?;
    assert_eq!(op.get_node_ok("node-a").await?.holds, 1);
    op.allocate_ok("node-a", s, &["k8s:app=c"]).await?;
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_and_get_node_refuse_unknown_and_bad_input() -> TestResult {
    let op = Operator::start(&[]).await?;
    let (_agent, _) = Agent::connect(&op, "node-a", session(100)).await?;
    let before = op.observe().await?;

    expect_status(op.get(4000).await?, Code::NotFound, &["identity 4000"])?;
    expect_status(op.get(0).await?, Code::InvalidArgument, &["id", "0"])?;
    let host = op.get(1).await??;
    assert_eq!(host.labels, ["reserved:host="]);
    assert_eq!(host.state, i32::from(pb::IdentityState::Reserved));
    let world = op.get(2).await??;
    assert_eq!(world.labels, ["reserved:world="]);

    expect_status(op.get_node("node-zz").await?, Code::NotFound, &["node-zz"])?;
    expect_status(
        op.get_node("Node_A").await?,
        Code::InvalidArgument,
        &["name", "\"Node_A\""],
    )?;
    expect_status(
        op.get_node("").await?,
        Code::InvalidArgument,
        &["name", "is required"],
    )?;
    assert_eq!(op.observe().await?, before);
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_store_hands_out_no_new_id_in_the_adoption_window_but_serves_adopted() -> TestResult
{
    // The default adoption window: one node TTL (90 s).
    let op = Operator::start_without(&["--adoption-window"], &[]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let before = op.observe().await?;
    let answer = op.allocate("node-a", s, DB).await?;
    expect_status(
        answer,
        Code::Unavailable,
        &["store was empty", "re-reported"],
    )?;
    assert_eq!(op.observe().await?, before);

    // An agent that still holds 4242 for SHOP reports it: adopted, no rebind.
    let answer = agent
        .snapshot(vec![endpoint("shop", "web-0", &[], 4242, SHOP)])
        .await?;
    assert!(answer.rebinds.is_empty());
    let adopted = eventually("4242 persisted", Duration::from_secs(10), || async {
        let identity = op.get(4242).await??;
        Ok((identity.state == live()).then_some(identity))
    })
    .await?;
    assert_eq!(adopted.labels, SHOP);
    assert_eq!(adopted.references, 1);
    assert_eq!(op.allocate_ok("node-a", s, SHOP).await?.id, 4242);
    assert_eq!(op.get_node_ok("node-a").await?.adoptions, 1);

    let answer = op.allocate("node-a", s, DB).await?;
    expect_status(answer, Code::Unavailable, &["store was empty"])?;
    op.shut_down().await
}

// ---------------------------------------------------------------------------
// Generic tooling: reflection, health, the admin port
// ---------------------------------------------------------------------------

/// Encodes `DynamicMessage`s and decodes answers of one message type: what a generic
/// client such as grpcurl does with descriptors it fetched by reflection.
#[derive(Debug, Clone)]
struct DynamicCodec {
    output: MessageDescriptor,
}

#[derive(Debug)]
struct DynamicEncoder;

#[derive(Debug)]
struct DynamicDecoder(MessageDescriptor);

impl Codec for DynamicCodec {
    type Encode = DynamicMessage;
    type Decode = DynamicMessage;
    type Encoder = DynamicEncoder;
    type Decoder = DynamicDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        DynamicEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        DynamicDecoder(self.output.clone())
    }
}

impl Encoder for DynamicEncoder {
    type Item = DynamicMessage;
    type Error = Status;

    fn encode(&mut self, item: DynamicMessage, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(format!("encoding: {e}")))
    }
}

impl Decoder for DynamicDecoder {
    type Item = DynamicMessage;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<DynamicMessage>, Status> {
        DynamicMessage::decode(self.0.clone(), src)
            .map(Some)
            .map_err(|e| Status::internal(format!("decoding: {e}")))
    }
}

/// A `FileDescriptorSet` of the encoded `FileDescriptorProto`s reflection returned.
fn descriptor_set(files: &[Vec<u8>]) -> Vec<u8> {
    let mut set = Vec::new();
    for file in files {
        prost::encoding::bytes::encode(1, file, &mut set);
    }
    set
}

const SERVICES: &[&str] = &[
    "census.v1.IdentityService",
    "census.v1.EndpointSync",
    "census.v1.NodeService",
    "grpc.health.v1.Health",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_v1_lets_a_generic_client_discover_and_call_get() -> TestResult {
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };

    let op = Operator::start(&[]).await?;
    let channel = op.channel().await?;
    let mut reflection = ServerReflectionClient::new(channel.clone());
    let requests = [
        MessageRequest::ListServices(String::new()),
        MessageRequest::FileContainingSymbol("census.v1.IdentityService".into()),
    ]
    .map(|r| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(r),
    });
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter(requests))
        .await?
        .into_inner();

    let listed = match answers.message().await?.and_then(|a| a.message_response) {
        Some(MessageResponse::ListServicesResponse(list)) => list.service,
        other => return fail(format!("expected the list of services, got {other:?}")),
    };
    let names: BTreeSet<&str> = listed.iter().map(|s| s.name.as_str()).collect();
    for service in SERVICES {
        assert!(names.contains(service), "{service} missing from {names:?}");
    }
    let files = match answers.message().await?.and_then(|a| a.message_response) {
        Some(MessageResponse::FileDescriptorResponse(files)) => files.file_descriptor_proto,
        other => return fail(format!("expected file descriptors, got {other:?}")),
    };

    // Everything from here on knows only what reflection returned.
    let pool = DescriptorPool::decode(descriptor_set(&files).as_slice())?;
    let service = pool
        .get_service_by_name("census.v1.IdentityService")
        .ok_or("reflection did not describe census.v1.IdentityService")?;
    let get = service
        .methods()
        .find(|m| m.name() == "Get")
        .ok_or("IdentityService has no Get")?;
    assert_eq!(get.input().full_name(), "census.v1.GetRequest");
    let mut request = DynamicMessage::new(get.input());
    request.try_set_field_by_name("protocol_version", Value::U32(PROTOCOL_VERSION))?;
    request.try_set_field_by_name("id", Value::U32(1))?;

    let path = format!("/{}/{}", service.full_name(), get.name());
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await?;
    let answer = grpc
        .unary(
            tonic::Request::new(request),
            http::uri::PathAndQuery::from_str(&path)?,
            DynamicCodec {
                output: get.output(),
            },
        )
        .await?
        .into_inner();

    assert_eq!(answer.descriptor().full_name(), "census.v1.Identity");
    let id = answer
        .get_field_by_name("id")
        .and_then(|v| v.as_u32())
        .ok_or("no id in the answer")?;
    assert_eq!(id, 1);
    let state = answer
        .get_field_by_name("state")
        .and_then(|v| v.as_enum_number())
        .ok_or("no state in the answer")?;
    let state_name = get
        .output()
        .get_field_by_name("state")
        .and_then(|f| f.kind().as_enum().cloned())
        .and_then(|e| e.get_value(state))
        .map(|v| v.name().to_owned());
    assert_eq!(state_name.as_deref(), Some("IDENTITY_STATE_RESERVED"));
    let labels = answer
        .get_field_by_name("labels")
        .and_then(|v| {
            v.as_list().map(|l| {
                l.iter()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect::<Vec<_>>()
            })
        })
        .ok_or("no labels in the answer")?;
    assert_eq!(labels, ["reserved:host="]);
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_v1alpha_lists_the_services_and_describes_them() -> TestResult {
    use tonic_reflection::pb::v1alpha::{
        ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
        server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
    };

    let op = Operator::start(&[]).await?;
    let mut reflection = ServerReflectionClient::new(op.channel().await?);
    let requests = [
        MessageRequest::ListServices(String::new()),
        MessageRequest::FileContainingSymbol("census.v1.NodeService".into()),
    ]
    .map(|r| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(r),
    });
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter(requests))
        .await?
        .into_inner();
    let listed = match answers.message().await?.and_then(|a| a.message_response) {
        Some(MessageResponse::ListServicesResponse(list)) => list.service,
        other => return fail(format!("expected the list of services, got {other:?}")),
    };
    let names: BTreeSet<&str> = listed.iter().map(|s| s.name.as_str()).collect();
    for service in SERVICES {
        assert!(names.contains(service), "{service} missing from {names:?}");
    }
    let files = match answers.message().await?.and_then(|a| a.message_response) {
        Some(MessageResponse::FileDescriptorResponse(files)) => files.file_descriptor_proto,
        other => return fail(format!("expected file descriptors, got {other:?}")),
    };
    let pool = DescriptorPool::decode(descriptor_set(&files).as_slice())?;
    // Reflection describes the services as this build compiled them.
    let compiled = DescriptorPool::decode(pb::FILE_DESCRIPTOR_SET)?;
    let methods = |pool: &DescriptorPool| -> TestResult<BTreeSet<String>> {
        let service = pool
            .get_service_by_name("census.v1.NodeService")
            .ok_or("no census.v1.NodeService")?;
        Ok(service.methods().map(|m| m.name().to_owned()).collect())
    };
    let reflected = methods(&pool)?;
    assert!(reflected.contains("GetNode") && reflected.contains("ListNodes"));
    assert_eq!(reflected, methods(&compiled)?);
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_reports_the_services_serving() -> TestResult {
    use tonic_health::pb::{
        HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
    };

    let op = Operator::start(&[]).await?;
    let mut health = HealthClient::new(op.channel().await?);
    for service in [
        "census.v1.IdentityService",
        "census.v1.EndpointSync",
        "census.v1.NodeService",
    ] {
        let answer = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await?
            .into_inner();
        assert_eq!(
            answer.status,
            i32::from(ServingStatus::Serving),
            "{service}"
        );
    }
    let unknown = health
        .check(HealthCheckRequest {
            service: "census.v1.Nope".into(),
        })
        .await;
    expect_status(unknown, Code::NotFound, &[])?;
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_port_serves_health_readiness_and_openmetrics() -> TestResult {
    let op = Operator::start(&[]).await?;
    let (status, _, body) = op.admin_get("/healthz").await?;
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let (status, _, body) = op.admin_get("/readyz").await?;
    assert_eq!(status, 200);
    assert!(
        body.starts_with("ready: ") && body.contains("redb") && body.contains("gRPC on"),
        "{body:?}"
    );

    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let id = op.allocate_ok("node-a", s, SHOP).await?.id;
    agent
        .snapshot(vec![endpoint("shop", "web-0", &[], id, SHOP)])
        .await?;
    expect_status(
        op.allocate("node-x", s, SHOP).await?,
        Code::FailedPrecondition,
        &[],
    )?;

    let (status, head, body) = op.admin_get("/metrics").await?;
    assert_eq!(status, 200);
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    for line in [
        "census_identities{state=\"live\"} 1",
        "census_grpc_requests_total{method=\"IdentityService/Allocate\",code=\"OK\"} 1",
        "census_grpc_requests_total{method=\"IdentityService/Allocate\",code=\"FailedPrecondition\"} 1",
        "census_snapshots_total 1",
        "census_nodes 1",
        "census_connected_nodes 1",
        "census_endpoints 1",
        "census_store_repairs_total{kind=\"tombstone_recreated\"} 0",
    ] {
        assert!(
            body.lines().any(|l| l == line),
            "no line {line:?} in\n{body}"
        );
    }
    for name in [
        "census_id_range_usage_ratio ",
        "census_allocate_duration_seconds_bucket{",
        "census_allocate_duration_seconds_count{kind=\"new\"} 1",
    ] {
        assert!(body.contains(name), "no {name:?} in\n{body}");
    }
    assert!(body.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");

    let (status, _, _) = op.admin_get("/nope").await?;
    assert_eq!(status, 404);
    op.shut_down().await
}

// ---------------------------------------------------------------------------
// Limits and shutdown
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_at_the_endpoint_limit_fits_the_message_limit() -> TestResult {
    const ENDPOINTS: usize = 10_000;
    const APPS: usize = 100;
    let op = Operator::start(&["--max-snapshot-endpoints", "10000"]).await?;
    let s = session(100);
    let (mut agent, reply) = Agent::connect(&op, "node-a", s).await?;
    let max_bytes = reply.limits.map_or(0, |l| l.max_message_bytes);

    // 100 deployments of 100 pods, with the labels they typically carry.
    let label_sets: Vec<Vec<String>> = (0..APPS)
        .map(|app| {
            let namespace = format!("team-{:02}-payments-production", app % 10);
            vec![
                format!("k8s:app.kubernetes.io/name=checkout-payments-service-{app:03}"),
                format!("k8s:app.kubernetes.io/instance=checkout-payments-service-{app:03}-primary"),
                "k8s:app.kubernetes.io/part-of=online-boutique-storefront-platform".to_owned(),
                format!("k8s:io.kubernetes.pod.namespace={namespace}"),
                format!("k8s:io.kubernetes.pod.serviceaccount=checkout-payments-service-{app:03}-runtime"),
            ]
        })
        .collect();
    let endpoints: Vec<pb::Endpoint> = (0..ENDPOINTS)
        .map(|i| {
            let app = i % APPS;
            pb::Endpoint {
                namespace: format!("team-{:02}-payments-production", app % 10),
                name: format!("checkout-payments-service-{app:03}-7f9c8d6b5d-{i:05}"),
                ips: vec![
                    format!("198.18.{}.{}", i / 250, i % 250 + 1),
                    format!("2001:db8:1234:5678::{i:x}"),
                ],
                identity: 1000 + app as u32,
                labels: label_sets[app].clone(),
            }
        })
        .collect();
    let snapshot = pb::Snapshot {
        endpoints,
        allocations_settled: 0,
    };
    let size = snapshot.encoded_len();
    assert!(
        size > 4 * 1024 * 1024,
        "the snapshot ({size} bytes) must exceed tonic's 4 MiB default to prove anything"
    );
    assert!(size as u64 <= max_bytes, "{size} > {max_bytes}");

    let seq = agent.next_seq();
    let answer = agent.exchange(seq, Body::Snapshot(snapshot)).await?;
    assert!(!answer.ack.ignored);
    assert!(answer.rebinds.is_empty(), "every claimed id is adopted");
    let node = op.get_node_ok("node-a").await?;
    assert_eq!(node.endpoints, ENDPOINTS as u64);
    assert_eq!(node.adoptions, ENDPOINTS as u64);
    op.shut_down().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shut_down_ends_agent_streams_and_watches_with_unavailable() -> TestResult {
    let op = Operator::start(&[]).await?;
    let s = session(100);
    let (mut agent, _) = Agent::connect(&op, "node-a", s).await?;
    let id = op.allocate_ok("node-a", s, SHOP).await?.id;
    agent
        .snapshot(vec![endpoint("shop", "web-0", &[], id, SHOP)])
        .await?;
    let (mut other, _) = Agent::connect(&op, "node-b", session(100)).await?;
    let mut watch = op
        .identities()
        .await?
        .watch(pb::WatchRequest {
            protocol_version: PROTOCOL_VERSION,
        })
        .await?
        .into_inner();
    // The full list has been sent: the watch is in its change loop.
    loop {
        let event = watch.message().await?.ok_or("the watch ended")?;
        if event.kind == i32::from(Kind::ResyncEnd) {
            break;
        }
    }

    op.shut_down().await?;
    agent
        .expect_end(Code::Unavailable, &["shutting down"])
        .await?;
    other
        .expect_end(Code::Unavailable, &["shutting down"])
        .await?;
    let end = tokio::time::timeout(Duration::from_secs(10), watch.message())
        .await
        .map_err(|_| "the watch did not end")?;
    expect_status(end, Code::Unavailable, &["shutting down"])?;
    Ok(())
}

/// DESIGN.md, "Sessions and ordering": an older session is refused only while the
/// current session's stream is open. An agent that crashed leaves a half-open stream
/// (its host went silent); the server's keepalive closes it, and the restarted agent,
/// whose clock stepped back, gets in.
#[tokio::test]
async fn a_restarted_agent_with_an_older_clock_gets_in_after_the_keepalive_timeout() -> TestResult {
    let op = Operator::start(&[
        "--keepalive-interval",
        "200ms",
        "--keepalive-timeout",
        "500ms",
    ])
    .await?;
    let proxy = census_testkit::proxy::SilentProxy::start(op.grpc_addr).await?;
    let (_crashed, _) = Agent::connect(&proxy.addr, "node-1", session(2_000)).await?;
    // While the first stream answers, an older session is a zombie: refused.
    let zombie = open_stream(&op, vec![hello("node-1", session(1_000))]).await?;
    expect_status(zombie.map(|_| ()), Code::FailedPrecondition, &["node-1"])?;
    // The agent's host goes silent: no answer to pings, no FIN.
    proxy.go_silent();
    let started = Instant::now();
    let back = eventually(
        "the restarted agent's Hello",
        Duration::from_secs(10),
        || async { Ok(Agent::connect(&op, "node-1", session(1_000)).await.ok()) },
    )
    .await?;
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(5),
        "within keepalive interval + timeout (and retries): {waited:?}"
    );
    let (mut agent, _) = back;
    let answer = agent
        .snapshot(vec![endpoint(
            "shop",
            "web-0",
            &["198.18.0.2"],
            300,
            &["k8s:app=web"],
        )])
        .await?;
    assert_eq!(answer.ack.seq, 1, "its own seq, from 1");
    let node = op.get_node_ok("node-1").await?;
    assert_eq!(node.session.map(|s| s.start_time_ns), Some(1_000));
    Ok(())
}
