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
                self.attempt(request, &labels).await
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

    /// One Allocate call of `allocation`: every attempt carries its number, under
    /// which the operator records the hold its answer adds.
    async fn attempt(
        &self,
        allocation: AllocationId,
        labels: &LabelSet,
    ) -> Result<IdentityId, AllocateFailure> {
        let request = pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: self.node.to_string(),
            session: Some(session_to_wire(self.session)),
            labels: labels.to_strings(),
            allocation: allocation.get(),
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
    use std::sync::atomic::{AtomicUsize, Ordering};

    use census_proto::pb::identity_service_server::{IdentityService, IdentityServiceServer};
    use census_testkit::{TestResult, fail, lazy_channel};
    use tokio::net::TcpListener;
    use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
    use tonic::{Request, Response, Status, transport::Server};

    use super::*;
    use crate::daemon::new_session;

    const WAIT: Duration = Duration::from_secs(10);

    /// An IdentityService that answers UNAVAILABLE to its first Allocate and
    /// identity 300 to the others, handing the test every request.
    struct Recording {
        requests: mpsc::UnboundedSender<pb::AllocateRequest>,
        calls: AtomicUsize,
    }

    #[tonic::async_trait]
    impl IdentityService for Recording {
        type WatchStream = ReceiverStream<Result<pb::WatchEvent, Status>>;

        async fn allocate(
            &self,
            request: Request<pb::AllocateRequest>,
        ) -> Result<Response<pb::AllocateResponse>, Status> {
            let _ = self.requests.send(request.into_inner());
            if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(Status::unavailable("not yet"));
            }
            Ok(Response::new(pb::AllocateResponse {
                identity: Some(pb::Identity {
                    id: 300,
                    ..pb::Identity::default()
                }),
            }))
        }

        async fn get(&self, _: Request<pb::GetRequest>) -> Result<Response<pb::Identity>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn lookup(
            &self,
            _: Request<pb::LookupRequest>,
        ) -> Result<Response<pb::Identity>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn list(
            &self,
            _: Request<pb::ListRequest>,
        ) -> Result<Response<pb::ListResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn watch(
            &self,
            _: Request<pb::WatchRequest>,
        ) -> Result<Response<Self::WatchStream>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    async fn next<T>(rx: &mut mpsc::UnboundedReceiver<T>) -> TestResult<T> {
        match tokio::time::timeout(WAIT, rx.recv()).await {
            Ok(Some(item)) => Ok(item),
            _ => fail("nothing came"),
        }
    }

    /// The operator records the hold of an answer under the request's number, and
    /// a retry is the same allocation.
    #[tokio::test]
    async fn every_attempt_of_a_request_carries_its_number() -> TestResult {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (requests_tx, mut requests) = mpsc::unbounded_channel();
        let service = Recording {
            requests: requests_tx,
            calls: AtomicUsize::new(0),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(
            Server::builder()
                .add_service(IdentityServiceServer::new(service))
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                    let _ = stopped.await;
                }),
        );
        let (events_tx, mut events) = mpsc::channel(16);
        let (_connected, connected) = watch::channel(true);
        let mut client = AllocateClient::new(
            crate::client::plain(lazy_channel(addr)?),
            NodeName::new("n1")?,
            new_session(),
            events_tx,
            connected,
            Duration::from_millis(50),
            Metrics::default(),
        );
        client.caller.initial_backoff = Duration::from_millis(10);
        let labels: LabelSet = "k8s:app=web".parse()?;
        client.apply(Allocation::Start(AllocationRequest {
            id: AllocationId::new(7),
            labels: labels.clone(),
        }));

        let event = tokio::time::timeout(WAIT, events.recv()).await?;
        assert!(
            matches!(&event, Some(AllocationEvent::Failed { request, .. }) if *request == AllocationId::new(7)),
            "{event:?}"
        );
        let event = tokio::time::timeout(WAIT, events.recv()).await?;
        assert_eq!(
            event,
            Some(AllocationEvent::Allocated {
                request: AllocationId::new(7),
                labels,
                id: IdentityId::new(300).ok_or("300")?,
            })
        );
        let numbers = [
            next(&mut requests).await?.allocation,
            next(&mut requests).await?.allocation,
        ];
        assert_eq!(numbers, [7, 7], "the attempt and its retry");

        let _ = stop.send(());
        server.await??;
        Ok(())
    }

    #[test]
    fn an_invalid_argument_is_a_refusal_and_other_codes_are_not() {
        let refused = failure(&Status::invalid_argument("labels[0]: bad"));
        assert!(refused.is_refusal());
        assert_eq!(refused.metric_label(), "InvalidArgument");
        assert_eq!(
            refused.to_string(),
            "operator: InvalidArgument: labels[0]: bad"
        );
        let away = failure(&Status::unavailable("not the leader"));
        assert!(!away.is_refusal());
        assert_eq!(away.metric_label(), "Unavailable");
        assert_eq!(away.to_string(), "operator: Unavailable: not the leader");
    }
}
