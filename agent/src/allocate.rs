//! The allocate client: runs the core's allocation requests against the operator's
//! IdentityService.
//!
//! Each request is a task that retries with capped, jittered backoff while the
//! operator is away or refuses, reporting every answer and failed attempt to the
//! core as an [`AllocationEvent`], until it has an identity or the core cancels it
//! (no endpoint needs the label set any more). Allocate waits for the EndpointSync
//! stream: the operator must know the session.

use std::{collections::HashMap, sync::Arc, time::Duration};

use census_proto::{
    PROTOCOL_VERSION,
    convert::session_to_wire,
    domain::{IdentityId, NodeName, SessionId},
    labels::LabelSet,
    pb::{self, identity_service_client::IdentityServiceClient},
    status::code_label,
};
use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tonic::Code;

use crate::client::OperatorChannel;
use tracing::{Instrument as _, debug, info_span, warn};

use crate::{
    agent_core::{AllocateFailure, Allocation, AllocationEvent, AllocationId, AllocationRequest},
    backoff::Backoff,
    metrics::Metrics,
};

/// At most this many Allocate calls at once.
const CONCURRENCY: usize = 32;
/// One Allocate call may take this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(15);

/// Starts and cancels the core's allocations.
#[derive(Debug)]
pub(crate) struct AllocateClient {
    caller: Caller,
    /// The requests in flight; dropping one's sender cancels its task.
    inflight: HashMap<AllocationId, oneshot::Sender<()>>,
}

/// What every request's task shares.
#[derive(Debug, Clone)]
struct Caller {
    client: IdentityServiceClient<OperatorChannel>,
    node: NodeName,
    session: SessionId,
    events: mpsc::Sender<AllocationEvent>,
    limit: Arc<Semaphore>,
    /// Allocate needs the operator to know this session: calls wait for a stream.
    connected: watch::Receiver<bool>,
    initial_backoff: Duration,
    max_backoff: Duration,
    metrics: Metrics,
}

impl AllocateClient {
    pub(crate) fn new(
        channel: OperatorChannel,
        node: NodeName,
        session: SessionId,
        events: mpsc::Sender<AllocationEvent>,
        connected: watch::Receiver<bool>,
        max_backoff: Duration,
        metrics: Metrics,
    ) -> Self {
        Self {
            caller: Caller {
                client: IdentityServiceClient::new(channel),
                node,
                session,
                events,
                limit: Arc::new(Semaphore::new(CONCURRENCY)),
                connected,
                initial_backoff: Duration::from_millis(200),
                max_backoff,
                metrics,
            },
            inflight: HashMap::new(),
        }
    }

    /// Carries out one of the core's allocation effects.
    pub(crate) fn apply(&mut self, allocation: Allocation) {
        match allocation {
            Allocation::Start(request) => self.start(request),
            Allocation::Cancel(id) => {
                if self.inflight.remove(&id).is_some() {
                    debug!(?id, "no endpoint needs the label set any more");
                }
            }
        }
    }

    /// `event` reached the core: a request that has its answer is done.
    pub(crate) fn answered(&mut self, event: &AllocationEvent) {
        if let AllocationEvent::Allocated { request, .. } = event {
            self.inflight.remove(request);
        }
    }

    fn start(&mut self, request: AllocationRequest) {
        let (cancel, cancelled) = oneshot::channel();
        self.inflight.insert(request.id, cancel);
        let span = info_span!("allocate", labels = %request.labels);
        tokio::spawn(self.caller.clone().run(request, cancelled).instrument(span));
    }
}

impl Caller {
    async fn run(self, request: AllocationRequest, mut cancelled: oneshot::Receiver<()>) {
        let AllocationRequest {
            id: request,
            labels,
        } = request;
        let mut backoff = Backoff::new(self.initial_backoff, self.max_backoff);
        let mut connected = self.connected.clone();
        loop {
            let attempt = async {
                // Ended (false) only when the agent stops; then the call fails and ends.
                let _ = connected.wait_for(|up| *up).await.map(|_| ());
                let _permit = self.limit.acquire().await;
                self.attempt(&labels).await
            };
            let result = tokio::select! {
                result = attempt => result,
                _ = &mut cancelled => return,
            };
            let event = match result {
                Ok(id) => {
                    self.metrics.allocation("ok");
                    AllocationEvent::Allocated {
                        request,
                        labels: labels.clone(),
                        id,
                    }
                }
                Err(failure) => {
                    self.metrics.allocation(failure.metric_label());
                    warn!(error = %failure, "Allocate failed; retrying");
                    AllocationEvent::Failed {
                        request,
                        labels: labels.clone(),
                        failure,
                    }
                }
            };
            let done = matches!(event, AllocationEvent::Allocated { .. });
            if self.events.send(event).await.is_err() || done {
                return;
            }
            let delay = backoff.next_delay();
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = &mut cancelled => return,
            }
        }
    }

    /// One Allocate call.
    async fn attempt(&self, labels: &LabelSet) -> Result<IdentityId, AllocateFailure> {
        let request = pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: self.node.to_string(),
            session: Some(session_to_wire(self.session)),
            labels: labels.to_strings(),
            allocation: 0,
        };
        let mut client = self.client.clone();
        let call = tokio::time::timeout(CALL_TIMEOUT, client.allocate(request));
        match call.await {
            Err(_) => Err(AllocateFailure::Timeout),
            Ok(Err(status)) => Err(failure(&status)),
            Ok(Ok(response)) => response
                .into_inner()
                .identity
                .and_then(|identity| IdentityId::new(identity.id))
                .ok_or(AllocateFailure::NoIdentity),
        }
    }
}

/// The failure a gRPC status means.
fn failure(status: &tonic::Status) -> AllocateFailure {
    let message = status.message().to_owned();
    match status.code() {
        Code::InvalidArgument => AllocateFailure::Refused { message },
        code => AllocateFailure::Rejected {
            code: code_label(code),
            message,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invalid_argument_is_a_refusal_and_other_codes_are_not() {
        let refused = failure(&tonic::Status::invalid_argument("labels[0]: bad"));
        assert!(refused.is_refusal());
        assert_eq!(refused.metric_label(), "InvalidArgument");
        assert_eq!(
            refused.to_string(),
            "operator: InvalidArgument: labels[0]: bad"
        );
        let away = failure(&tonic::Status::unavailable("not the leader"));
        assert!(!away.is_refusal());
        assert_eq!(away.metric_label(), "Unavailable");
        assert_eq!(away.to_string(), "operator: Unavailable: not the leader");
    }
}
