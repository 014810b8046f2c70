//! IdentityService: Allocate, Get, Lookup, List, Watch.

use std::{sync::Arc, time::Instant};

use census_proto::{
    convert::{
        check_version, filtered_labels_from_wire, labels_from_wire, node_from_wire,
        session_from_wire,
    },
    domain::{AllocationId, IdentityId},
    labels::{LabelLimits, LabelSet},
    pb::{self, identity_service_server::IdentityService, watch_event::Kind},
};
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::debug;

use super::{
    Operator, auth,
    convert::identity_to_wire,
    quota::Quotas,
    status::{alloc, field, refused, version},
};
use crate::{
    api::{Allocated, Allocation, Caller, Feed, WatchChange},
    metrics::{KindLabels, Metrics},
};

const DEFAULT_PAGE: usize = 500;
const MAX_PAGE: usize = 5000;
const WATCH_QUEUE: usize = 256;

#[derive(Debug, Clone)]
pub(crate) struct Identities {
    operator: Operator,
    metrics: Metrics,
    shutdown: watch::Receiver<bool>,
    quotas: Arc<Quotas>,
}

impl Identities {
    pub(crate) fn new(
        operator: Operator,
        metrics: Metrics,
        shutdown: watch::Receiver<bool>,
        quotas: Arc<Quotas>,
    ) -> Self {
        Self {
            operator,
            metrics,
            shutdown,
            quotas,
        }
    }

    /// Labels from a request, validated and passed through the operator's filter;
    /// the limit counts the labels the filter keeps.
    fn labels(&self, labels: &[String], field_name: &str) -> Result<LabelSet, Status> {
        let settings = self.operator.settings();
        filtered_labels_from_wire(labels, &settings.filter, &settings.wire.labels, field_name)
            .map_err(field)
    }
}

#[tonic::async_trait]
impl IdentityService for Identities {
    async fn allocate(
        &self,
        request: Request<pb::AllocateRequest>,
    ) -> Result<Response<pb::AllocateResponse>, Status> {
        let started = Instant::now();
        let principal = auth::caller(&request)?;
        let peer = request.remote_addr().map(|p| p.ip().to_canonical());
        let req = request.into_inner();
        check_version(req.protocol_version).map_err(version)?;
        let node = node_from_wire(&req.node, "node").map_err(field)?;
        auth::speaks_for(&principal, &node)?;
        let session = session_from_wire(req.session.as_ref(), "session").map_err(field)?;
        let labels = self.labels(&req.labels, "labels")?;
        let caller = Caller { node, peer };
        let (Allocated { id, info }, kind) = match self
            .operator
            .allocate(&caller, session, AllocationId::new(req.allocation), labels)
            .map_err(refused)?
        {
            Allocation::Known(allocated) => (allocated, "known"),
            Allocation::New(pending) => {
                let answer = pending
                    .await
                    .map_err(|_| Status::unavailable("the operator is shutting down"))?;
                (answer.map_err(alloc)?, "new")
            }
        };
        self.metrics
            .allocate_latency
            .get_or_create(&KindLabels { kind })
            .observe(started.elapsed().as_secs_f64());
        let identity = info.as_ref().map_or_else(
            || pb::Identity {
                id: id.get(),
                ..pb::Identity::default()
            },
            identity_to_wire,
        );
        Ok(Response::new(pb::AllocateResponse {
            identity: Some(identity),
        }))
    }

    async fn get(
        &self,
        request: Request<pb::GetRequest>,
    ) -> Result<Response<pb::Identity>, Status> {
        auth::caller(&request)?;
        let req = request.into_inner();
        check_version(req.protocol_version).map_err(version)?;
        let id =
            IdentityId::new(req.id).ok_or_else(|| Status::invalid_argument("id: must not be 0"))?;
        if let Some(name) = id.reserved_name() {
            return Ok(Response::new(pb::Identity {
                id: id.get(),
                labels: vec![format!("reserved:{name}=")],
                state: pb::IdentityState::Reserved.into(),
                ..pb::Identity::default()
            }));
        }
        match self.operator.identity(id) {
            Some(info) => Ok(Response::new(identity_to_wire(&info))),
            None => Err(Status::not_found(format!("identity {id} is not known"))),
        }
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::Identity>, Status> {
        auth::caller(&request)?;
        let req = request.into_inner();
        check_version(req.protocol_version).map_err(version)?;
        let labels = self.labels(&req.labels, "labels")?;
        match self.operator.lookup(&labels) {
            Some(info) => Ok(Response::new(identity_to_wire(&info))),
            None => Err(Status::not_found(format!(
                "no identity has the labels {labels}"
            ))),
        }
    }

    async fn list(
        &self,
        request: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        auth::caller(&request)?;
        let req = request.into_inner();
        check_version(req.protocol_version).map_err(version)?;
        let limit = match req.page_size {
            0 => DEFAULT_PAGE,
            n => (n as usize).min(MAX_PAGE),
        };
        let after = if req.page_token.is_empty() {
            None
        } else {
            let id = req
                .page_token
                .parse::<u32>()
                .ok()
                .and_then(IdentityId::new)
                .ok_or_else(|| {
                    Status::invalid_argument("page_token: not a token from a previous ListResponse")
                })?;
            Some(id)
        };
        let selector = if req.selector.is_empty() {
            None
        } else {
            // Selectors match stored labels as they are: no filter.
            let limits = LabelLimits {
                max_labels: self.operator.settings().wire.labels.max_labels,
            };
            Some(labels_from_wire(&req.selector, &limits, "selector").map_err(field)?)
        };
        let (page, more) =
            self.operator
                .list(after, limit, selector.as_ref(), req.include_quarantined);
        let next_page_token = match (more, page.last()) {
            (true, Some(last)) => last.id.to_string(),
            _ => String::new(),
        };
        Ok(Response::new(pb::ListResponse {
            identities: page.iter().map(identity_to_wire).collect(),
            next_page_token,
        }))
    }

    type WatchStream = auth::Expiring<pb::WatchEvent>;

    async fn watch(
        &self,
        request: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let principal = auth::caller(&request)?;
        let req = request.into_inner();
        check_version(req.protocol_version).map_err(version)?;
        let quota = self.quotas.watch(&principal, None)?;
        let (tx, rx) = mpsc::channel(WATCH_QUEUE);
        let operator = self.operator.clone();
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            run_watch(operator, tx, shutdown).await;
            drop(quota);
        });
        Ok(Response::new(auth::until_expired(
            ReceiverStream::new(rx),
            principal.expires(),
        )))
    }
}

fn event(kind: Kind, identity: Option<pb::Identity>) -> Result<pb::WatchEvent, Status> {
    Ok(pb::WatchEvent {
        kind: kind.into(),
        identity,
    })
}

/// A REMOVED event's identity: the id and its labels, nothing else.
fn removed(id: IdentityId, labels: &LabelSet) -> pb::Identity {
    pb::Identity {
        id: id.get(),
        labels: labels.to_strings(),
        ..pb::Identity::default()
    }
}

type WatchTx = mpsc::Sender<Result<pb::WatchEvent, Status>>;

/// Sends the full list, then changes; starts over with the full list when the
/// subscriber falls behind or the replica's role changes. Ends when the client goes
/// away or the operator stops.
async fn run_watch(operator: Operator, tx: WatchTx, mut shutdown: watch::Receiver<bool>) {
    loop {
        let Feed {
            mut terms,
            mut changes,
            full: all,
        } = operator.identity_feed();
        // Encoded one at a time as the queue takes them: a watcher holds one copy of
        // the list, not two.
        let full = std::iter::once(event(Kind::ResyncStart, None))
            .chain(
                all.iter()
                    .map(|info| event(Kind::Upsert, Some(identity_to_wire(info)))),
            )
            .chain(std::iter::once(event(Kind::ResyncEnd, None)));
        for item in full {
            if tx.send(item).await.is_err() {
                return;
            }
        }
        drop(all);
        loop {
            let change = tokio::select! {
                change = changes.recv() => change,
                () = tx.closed() => return,
                _ = terms.changed() => {
                    debug!("the replica's role changed: sending the full list again");
                    break;
                }
                _ = shutdown.changed() => {
                    let _ = tx.send(Err(Status::unavailable("the operator is shutting down"))).await;
                    return;
                }
            };
            let item = match change {
                Ok(WatchChange::Upsert(info)) => event(Kind::Upsert, Some(identity_to_wire(&info))),
                Ok(WatchChange::Removed { id, labels }) => {
                    event(Kind::Removed, Some(removed(id, &labels)))
                }
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    debug!(
                        missed,
                        "watch subscriber fell behind: sending the full list again"
                    );
                    break;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            };
            if tx.send(item).await.is_err() {
                return;
            }
        }
    }
}
