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

/// Where the scenario's Node objects live: the fake, or a real control plane.
enum Objects<'a> {
    Fake(&'a census_fake_apiserver::FakeApiServer),
    Real(&'a census_testkit::cluster::ControlPlane),
}

impl Objects<'_> {
    fn create_node(&self, name: &str, ip: &str) -> TestResult {
        match self {
            Self::Fake(server) => {
                server.insert(crate::common::node(name, ip))?;
            }
            Self::Real(plane) => {
                // Not kwok's (no annotation), and tainted: nothing is scheduled there.
                plane.apply(&json!({
                    "apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name},
                    "spec": {"taints": [{"key": "census.dev/test", "effect": "NoSchedule"}]},
                }))?;
                self.set_addresses(name, &[("InternalIP", ip), ("Hostname", name)])?;
            }
        }
        Ok(())
    }

    fn set_addresses(&self, name: &str, addresses: &[(&str, &str)]) -> TestResult {
        let addresses: Vec<_> = addresses
            .iter()
            .map(|(kind, address)| json!({"type": kind, "address": address}))
            .collect();
        match self {
            Self::Fake(server) => {
                server.modify(&Gvr::new("", "v1", "nodes"), None, name, |o| {
                    o["status"]["addresses"] = json!(addresses);
                })?;
            }
            Self::Real(plane) => {
                let patch = json!({"status": {"addresses": addresses}}).to_string();
                plane.kubectl_ok(&[
                    "patch",
                    "node",
                    name,
                    "--subresource=status",
                    "--type=merge",
                    "-p",
                    &patch,
                ])?;
            }
        }
        Ok(())
    }

    fn delete_node(&self, name: &str) -> TestResult {
        match self {
            Self::Fake(server) => {
                server.delete(&Gvr::new("", "v1", "nodes"), None, name);
            }
            Self::Real(plane) => {
                plane.kubectl_ok(&["delete", "node", name])?;
            }
        }
        Ok(())
    }
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
    scenario(&op, &Objects::Fake(&server), "node-2", false).await?;
    op.shut_down().await
}

/// The same on a real control plane (a private one: its operator leads and would
/// collect the other tests' Identity objects).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_addresses_follow_the_node_objects_on_the_real_control_plane() -> TestResult {
    let private = census_testkit::cluster::Private::start("node-addresses")?;
    let plane = &private.0;
    census_testkit::cluster::apply_crd(plane)?;
    let args = crate::operator::replica_args(
        &plane.kubeconfig(),
        "op-a",
        &[("--namespace", "default"), ("--pod-ip", "198.18.255.3")],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let op = Operator::start(&args).await?;
    until_leader(&op).await?;
    let objects = Objects::Real(plane);
    objects.create_node("census-test-node", "198.19.200.9")?;
    scenario(&op, &objects, "census-test-node", true).await?;
    op.shut_down().await
}

/// `node` exists with the address 198.19.200.9 (the fake's node-2: 10.9.9.9).
async fn scenario(op: &Operator, objects: &Objects<'_>, node: &str, real: bool) -> TestResult {
    let (first, second, v6) = if real {
        ("198.19.200.9", "198.19.200.10", "fd00::9")
    } else {
        ("10.9.9.9", "10.9.9.10", "fd00::9")
    };
    let want = Some((node.to_owned(), IdentityId::REMOTE_NODE));

    // Listed before the core was built: fed when it is.
    eventually("the node's address is in the map", WAIT, || async {
        Ok((node_address(op, first)? == want).then_some(()))
    })
    .await?;
    // A Node's addresses change: the map follows.
    objects.set_addresses(
        node,
        &[
            ("InternalIP", second),
            ("ExternalIP", v6),
            ("Hostname", node),
        ],
    )?;
    eventually("the node's new addresses are in the map", WAIT, || async {
        let both = node_address(op, second)? == want && node_address(op, v6)? == want;
        Ok((both && node_address(op, first)?.is_none()).then_some(()))
    })
    .await?;
    // The Node is deleted: its addresses leave the map.
    objects.delete_node(node)?;
    eventually("the node's addresses leave the map", WAIT, || async {
        let gone = node_address(op, second)?.is_none() && node_address(op, v6)?.is_none();
        Ok(gone.then_some(()))
    })
    .await?;
    Ok(())
}
