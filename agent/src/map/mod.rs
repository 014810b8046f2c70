//! The EndpointMap client: watches the operator's cluster-wide map (`IP ->
//! identity, node`) and hands its batches, decoded, to the core, which holds the
//! map and decides what ENDPOINTS gets.
//!
//! - One `Watch` stream at a time, on the operator's channel, bound to this
//!   agent's node and EndpointSync session; it is opened once that session is
//!   connected (the operator knows it then).
//! - Every stream starts with a resync (the full map between `resync_start` and
//!   `resync_end`); batches go to the core in order, and the core treats each
//!   resync as a full replacement.
//! - When the stream fails the client reconnects after a capped, jittered,
//!   exponential backoff; meanwhile the core keeps the map it has (fail-static)
//!   and the agent stays Ready.
//! - An operator that answers UNIMPLEMENTED has no EndpointMap (an older one): the
//!   agent is local-only (said once in the log, and in the status and metrics),
//!   and asks again only every [`MapClient::unsupported_retry`].
//! - An entry that does not decode (an address of neither 4 nor 16 bytes, identity
//!   0 or `host`, node 0) is skipped and counted, never fatal.

use std::{net::IpAddr, num::NonZeroU32, time::Duration};

use census_proto::{
    PROTOCOL_VERSION,
    convert::{services_from_wire, session_to_wire},
    domain::{IdentityId, NodeName, SessionId},
    pb::{self, endpoint_map_client::EndpointMapClient},
    status::code_label,
};
use tokio::sync::{mpsc, watch};
use tonic::Code;

use crate::client::OperatorChannel;
use tracing::{Instrument as _, debug, info, info_span, warn};

use crate::{
    agent_core::{MapBatch, MapEntry, MapEvent, MapLink, MapNode, MapState, StreamError},
    backoff::{Backoff, jittered},
    metrics::Metrics,
    shutdown::stopped,
};

/// Largest batch accepted from the operator (a full map of 550k entries is about
/// 8 MiB in one batch).
const MAX_DECODING: usize = 64 * 1024 * 1024;

/// The client; see the module documentation.
#[derive(Debug)]
pub(crate) struct MapClient {
    pub(crate) channel: OperatorChannel,
    pub(crate) node: NodeName,
    pub(crate) session: SessionId,
    pub(crate) initial_backoff: Duration,
    pub(crate) max_backoff: Duration,
    /// How long an operator without EndpointMap is left alone before it is asked
    /// again (jittered).
    pub(crate) unsupported_retry: Duration,
    pub(crate) metrics: Metrics,
    /// The watch's state, for the core.
    pub(crate) status: watch::Sender<MapLink>,
}

/// How a stream ended.
enum Ended {
    Shutdown,
    /// The operator has no EndpointMap.
    Unsupported,
    Failed(StreamError),
}

impl MapClient {
    /// Runs until `shutdown`. `connected` is true while the EndpointSync stream is
    /// up; `events` go to the core.
    pub(crate) async fn run(
        self,
        events: mpsc::Sender<MapEvent>,
        connected: watch::Receiver<bool>,
        shutdown: watch::Receiver<bool>,
    ) {
        let span = info_span!("map", node = %self.node, session = %self.session);
        self.run_inner(events, connected, shutdown)
            .instrument(span)
            .await;
    }

    async fn run_inner(
        self,
        events: mpsc::Sender<MapEvent>,
        mut connected: watch::Receiver<bool>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut backoff = Backoff::new(self.initial_backoff, self.max_backoff);
        let mut streams = 0u64;
        loop {
            tokio::select! {
                up = connected.wait_for(|up| *up) => if up.is_err() { return },
                () = stopped(&mut shutdown) => return,
            }
            let ended = self
                .stream(&events, &mut shutdown, &mut backoff, &mut streams)
                .await;
            let delay = match ended {
                Ended::Shutdown => return,
                Ended::Unsupported => {
                    let before = self.status.borrow().state;
                    if before != MapState::Unsupported {
                        warn!(
                            "the operator has no EndpointMap (an older operator): this agent is \
                             local-only, other nodes' endpoints count as world; asking again \
                             every {}",
                            humantime::format_duration(self.unsupported_retry)
                        );
                        if events.send(MapEvent::LocalOnly).await.is_err() {
                            return;
                        }
                    }
                    self.status.send_modify(|link| {
                        link.state = MapState::Unsupported;
                        link.last_error = None;
                    });
                    jittered(self.unsupported_retry, 0.2)
                }
                Ended::Failed(error) => {
                    let delay = backoff.next_delay();
                    let before = self.status.borrow().state;
                    if before == MapState::Connected {
                        warn!(%error, retry_in = ?delay, "lost the endpoint map; the remote entries stay in force");
                    } else {
                        debug!(%error, retry_in = ?delay, "cannot watch the endpoint map");
                    }
                    self.status.send_modify(|link| {
                        if link.state != MapState::Unsupported {
                            link.state = MapState::Disconnected;
                        }
                        link.last_error = Some(error);
                    });
                    delay
                }
            };
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = stopped(&mut shutdown) => return,
            }
        }
    }

    /// One stream, from the request to its end.
    async fn stream(
        &self,
        events: &mpsc::Sender<MapEvent>,
        shutdown: &mut watch::Receiver<bool>,
        backoff: &mut Backoff,
        streams: &mut u64,
    ) -> Ended {
        let mut client =
            EndpointMapClient::new(self.channel.clone()).max_decoding_message_size(MAX_DECODING);
        let request = pb::EndpointMapWatchRequest {
            protocol_version: PROTOCOL_VERSION,
            node: self.node.to_string(),
            session: Some(session_to_wire(self.session)),
        };
        let opened = tokio::select! {
            opened = client.watch(request) => opened,
            () = stopped(shutdown) => return Ended::Shutdown,
        };
        let mut inbound = match opened {
            Ok(response) => response.into_inner(),
            Err(status) => return ended_by(&status),
        };
        let before = self.status.borrow().state;
        if before == MapState::Unsupported {
            info!("the operator serves the endpoint map now");
        }
        self.status.send_modify(|link| {
            link.state = MapState::Connected;
            link.last_error = None;
        });
        *streams += 1;
        if *streams > 1 {
            self.metrics.map_reconnects.inc();
        }
        debug!("watching the endpoint map");
        loop {
            let message = tokio::select! {
                message = inbound.message() => message,
                () = stopped(shutdown) => return Ended::Shutdown,
            };
            let batch = match message {
                Ok(Some(batch)) => batch,
                Ok(None) => return Ended::Failed(StreamError::EndedByOperator),
                Err(status) => return ended_by(&status),
            };
            backoff.reset();
            let (batch, malformed) = decode(batch);
            self.metrics.map_batches.inc();
            if batch.resync_start {
                debug!(version = batch.version, "the operator sends the full map");
            }
            if batch.resync_end {
                self.metrics.map_resyncs.inc();
            }
            if malformed > 0 {
                self.metrics.map_malformed.inc_by(malformed as u64);
                warn!(
                    malformed,
                    version = batch.version,
                    "skipped malformed entries of an endpoint map batch"
                );
            }
            if events.send(MapEvent::Batch(batch)).await.is_err() {
                return Ended::Shutdown;
            }
        }
    }
}

fn ended_by(status: &tonic::Status) -> Ended {
    if status.code() == Code::Unimplemented {
        return Ended::Unsupported;
    }
    Ended::Failed(StreamError::Status {
        code: code_label(status.code()),
        message: status.message().to_owned(),
    })
}

/// An address on the wire: 4 or 16 bytes, network order; an IPv4-mapped IPv6
/// address is read as the IPv4 address (the key a local endpoint of it has).
fn ip_from_wire(bytes: &[u8]) -> Option<IpAddr> {
    if let Ok(v4) = <[u8; 4]>::try_from(bytes) {
        return Some(IpAddr::from(v4));
    }
    <[u8; 16]>::try_from(bytes)
        .ok()
        .map(|v6| IpAddr::from(v6).to_canonical())
}

/// `item`, counting it in `malformed` when it is `None`.
fn counted<T>(malformed: &mut usize, item: Option<T>) -> Option<T> {
    if item.is_none() {
        *malformed += 1;
    }
    item
}

/// `batch` in domain terms, and how many of its items were malformed (and left out).
fn decode(batch: pb::EndpointMapBatch) -> (MapBatch, usize) {
    let pb::EndpointMapBatch {
        resync_start,
        resync_end,
        nodes,
        upserts,
        removes,
        removed_nodes,
        built_at_ms,
        version,
        services,
    } = batch;
    let mut malformed = 0;
    // A malformed range is left out (and counted); a set over the limit is left
    // out as a whole, and SERVICES stays as it is.
    let services =
        services.and_then(
            |set| match services_from_wire(&set, "endpoint_map_batch.services") {
                Ok((set, refused)) => {
                    for error in &refused {
                        warn!(%error, "refused a Service range of the operator's");
                    }
                    malformed += refused.len();
                    Some(set)
                }
                Err(error) => {
                    warn!(%error, "refused the operator's Service addresses");
                    malformed += 1;
                    None
                }
            },
        );
    let nodes = nodes
        .into_iter()
        .filter_map(|n| {
            counted(
                &mut malformed,
                NonZeroU32::new(n.index)
                    .zip(NodeName::new(&n.name).ok())
                    .map(|(index, name)| MapNode { index, name }),
            )
        })
        .collect();
    let upserts = upserts
        .into_iter()
        .filter_map(|e| {
            let ip = ip_from_wire(&e.ip);
            // `host` is each node's own word for its own addresses.
            let identity = IdentityId::new(e.identity).filter(|id| *id != IdentityId::HOST);
            let node = NonZeroU32::new(e.node);
            counted(
                &mut malformed,
                match (ip, identity, node) {
                    (Some(ip), Some(identity), Some(node)) => Some(MapEntry { ip, identity, node }),
                    _ => None,
                },
            )
        })
        .collect();
    let removes = removes
        .iter()
        .filter_map(|ip| counted(&mut malformed, ip_from_wire(ip)))
        .collect();
    let removed_nodes = removed_nodes
        .into_iter()
        .filter_map(|index| counted(&mut malformed, NonZeroU32::new(index)))
        .collect();
    let batch = MapBatch {
        resync_start,
        resync_end,
        nodes,
        upserts,
        removes,
        removed_nodes,
        built_at_ms,
        version,
        services,
    };
    (batch, malformed)
}

#[cfg(test)]
mod tests;
