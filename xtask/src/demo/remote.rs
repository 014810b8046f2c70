//! The demo's second node, over gRPC: what another node's agent tells the operator
//! (EndpointSync Hello with the node's address, Allocate, a Snapshot of one pod), so
//! that the demo's agent learns that pod from the cluster-wide endpoint map and
//! counts traffic to it by its identity, not as `world`.
//!
//! Its stream stays open (on a thread inside the demo's node namespace, where the
//! operator listens) until the value is dropped, so the operator keeps the node
//! connected and its pod in the map.

use std::{
    fs::File,
    net::Ipv4Addr,
    thread::{self, JoinHandle},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, agent_message, endpoint_sync_client::EndpointSyncClient,
        identity_service_client::IdentityServiceClient, operator_message,
    },
};
use nix::sched::{CloneFlags, setns};
use tokio::sync::{mpsc, oneshot};

/// The second node's name, address and pod.
pub(super) const NODE: &str = "demo-node-b";
pub(super) const NODE_ADDRESS: Ipv4Addr = Ipv4Addr::new(198, 19, 255, 2);
pub(super) const POD: &str = "api-0";
pub(super) const POD_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 10);
pub(super) const POD_LABELS: [&str; 3] = [
    "k8s:app=api",
    "k8s:io.kubernetes.pod.namespace=default",
    "k8s:io.kubernetes.pod.serviceaccount=default",
];

/// The second node while its stream is open.
#[derive(Debug)]
pub(super) struct RemoteNode {
    /// The identity the operator gave the pod.
    pub(super) identity: u32,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
}

impl RemoteNode {
    /// Connects to the operator at `127.0.0.1:port` from inside the network
    /// namespace at `netns` (mutual TLS, with the node's own certificate) and
    /// reports the node's pod; returns once the snapshot is acked.
    pub(super) fn start(
        netns: &std::path::Path,
        port: u16,
        certs: super::tls::DemoCerts,
    ) -> anyhow::Result<Self> {
        let file = File::open(netns).with_context(|| format!("opening {}", netns.display()))?;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel();
        let thread = thread::Builder::new().name("demo-node-b".into()).spawn(
            move || -> anyhow::Result<()> {
                setns(&file, CloneFlags::CLONE_NEWNET).context("entering the node namespace")?;
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async move {
                    match connect(port, &certs).await {
                        Ok((identity, stream)) => {
                            let _ = ready_tx.send(Ok(identity));
                            // Held open until the demo is done with the node.
                            let _ = stop_rx.await;
                            drop(stream);
                        }
                        Err(error) => {
                            let _ = ready_tx.send(Err(error));
                        }
                    }
                    Ok(())
                })
            },
        )?;
        let identity = ready_rx
            .recv_timeout(Duration::from_secs(20))
            .context("the second node's stream did not come up in 20 s")??;
        Ok(Self {
            identity,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }
}

impl Drop for RemoteNode {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What keeps the node's EndpointSync stream open.
type Stream = (
    mpsc::Sender<pb::AgentMessage>,
    tonic::Streaming<pb::OperatorMessage>,
);

async fn connect(port: u16, certs: &super::tls::DemoCerts) -> anyhow::Result<(u32, Stream)> {
    // Its own node certificate: only it may speak for this node.
    let channel = certs.channel(port, Some(NODE)).await?;
    let session = pb::Session {
        start_time_ns: u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos())?,
        nonce: rand::random(),
    };
    let (tx, rx) = mpsc::channel(8);
    tx.send(pb::AgentMessage {
        seq: 0,
        body: Some(agent_message::Body::Hello(pb::Hello {
            protocol_version: PROTOCOL_VERSION,
            node: NODE.to_owned(),
            session: Some(session),
            agent_version: "demo".to_owned(),
            addresses: vec![NODE_ADDRESS.to_string()],
        })),
    })
    .await?;
    let mut inbound = EndpointSyncClient::new(channel.clone())
        .sync(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let Some(operator_message::Body::HelloReply(_)) = inbound.message().await?.and_then(|m| m.body)
    else {
        bail!("the operator did not answer the second node's Hello");
    };
    let labels: Vec<String> = POD_LABELS.iter().map(|l| (*l).to_owned()).collect();
    let identity = IdentityServiceClient::new(channel)
        .allocate(pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: NODE.to_owned(),
            session: Some(session),
            labels: labels.clone(),
            allocation: 0,
        })
        .await?
        .into_inner()
        .identity
        .context("Allocate answered no identity")?
        .id;
    tx.send(pb::AgentMessage {
        seq: 1,
        body: Some(agent_message::Body::Snapshot(pb::Snapshot {
            endpoints: vec![pb::Endpoint {
                namespace: "default".to_owned(),
                name: POD.to_owned(),
                ips: vec![POD_IP.to_string()],
                identity,
                labels,
            }],
            allocations_settled: 0,
        })),
    })
    .await?;
    match inbound.message().await?.and_then(|m| m.body) {
        Some(operator_message::Body::Ack(ack)) if ack.rejected.is_empty() => {}
        other => bail!("the operator did not accept the second node's snapshot: {other:?}"),
    }
    Ok((identity, (tx, inbound)))
}
