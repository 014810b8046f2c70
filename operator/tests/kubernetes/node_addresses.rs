//! The cluster's Node objects feed the endpoint map: each Node's InternalIP and
//! ExternalIP addresses are `remote-node` entries of that node while the Node exists,
//! on whichever replica leads.

use std::net::IpAddr;

use census_fake_apiserver::Gvr;
use census_operator::allocator::ClaimSource;
use census_proto::domain::IdentityId;
use census_testkit::Operator;
use serde_json::json;

use crate::{
    common::{TestResult, WAIT, eventually, fake},
    operator::{seed_cluster, start_replica, until_leader},
};

/// The node and identity of `ip`'s winning claim, if it is a node address.
fn node_address(op: &Operator, ip: &str) -> TestResult<Option<(String, IdentityId)>> {
    let ip: IpAddr = ip.parse()?;
    let found = op.running().runtime.read(|a| a.map_lookup(ip));
    Ok(found.and_then(|l| {
        l.claims
            .into_iter()
            .find(|c| c.winner && c.source == ClaimSource::NodeAddress)
            .map(|c| (c.node.to_string(), c.identity))
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_addresses_follow_the_node_objects() -> TestResult {
    let server = fake().await?;
    seed_cluster(&server, &["op-a"])?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig(&kubeconfig)?;
    let op = start_replica(&kubeconfig, "op-a").await?;
    until_leader(&op).await?;
    let want = Some(("node-2".to_owned(), IdentityId::REMOTE_NODE));

    // Listed before the core was built: fed when it is.
    eventually("node-2's address is in the map", WAIT, || async {
        Ok((node_address(&op, "10.9.9.9")? == want).then_some(()))
    })
    .await?;
    // A Node's addresses change: the map follows.
    let nodes = Gvr::new("", "v1", "nodes");
    server.modify(&nodes, None, "node-2", |o| {
        o["status"]["addresses"] = json!([
            {"type": "InternalIP", "address": "10.9.9.10"},
            {"type": "ExternalIP", "address": "fd00::9"},
            {"type": "Hostname", "address": "node-2"},
        ]);
    })?;
    eventually("node-2's new addresses are in the map", WAIT, || async {
        let both = node_address(&op, "10.9.9.10")? == want && node_address(&op, "fd00::9")? == want;
        Ok((both && node_address(&op, "10.9.9.9")?.is_none()).then_some(()))
    })
    .await?;
    // The Node is deleted: its addresses leave the map.
    server.delete(&nodes, None, "node-2");
    eventually("node-2's addresses leave the map", WAIT, || async {
        let gone =
            node_address(&op, "10.9.9.10")?.is_none() && node_address(&op, "fd00::9")?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    op.shut_down().await
}
