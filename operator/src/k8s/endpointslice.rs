//! The leader's address in the one EndpointSlice of the selector-less
//! [`LEADER_SERVICE`] Service, so agents reach the leader through the Service while
//! the operator has no write access to pods: it may write this one object only.
//!
//! The slice carries the labels that make kube-proxy (and every other consumer of
//! EndpointSlices) use it for the Service, and that keep the EndpointSlice
//! controller's hands off it (`endpointslice.kubernetes.io/managed-by` other than
//! its own; the Service has no selector, so the controller would not write one
//! anyway). The leader publishes its pod IP and gRPC port as the only endpoint; a
//! new leader overwrites whatever a crashed predecessor left; a replica that steps
//! down (or starts, after a crash of its own) removes its address if the slice still
//! holds it, so agents never reach a follower for longer than a step-down takes.
//!
//! Every write is conditional on the resourceVersion just read (a 409 is re-read),
//! so a replica that steps down never erases the address its successor wrote. A
//! leader's writes go through the store's [`Fence`]: none completes after its renew
//! deadline, when another replica may already lead.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::Duration};

use k8s_openapi::{
    api::{
        core::v1::ObjectReference,
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{Api, Client, api::PostParams};
use tokio::{sync::watch, task::JoinHandle};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::replica::Fence;

/// The Service agents use to reach the leader, and the name of its EndpointSlice.
pub const LEADER_SERVICE: &str = "census-operator-leader";
/// The label that ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The label naming who manages an EndpointSlice.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// census's value of [`MANAGED_BY_LABEL`]: not the EndpointSlice controller's
/// (`endpointslice-controller.k8s.io`), so it never touches the slice; a label
/// value, so no `/` (the API server refuses one).
pub const MANAGED_BY: &str = "census-operator.census.dev";
/// The Service's port name: an EndpointSlice port serves the Service port of the
/// same name.
pub const PORT_NAME: &str = "grpc";

/// How often a leader reads its slice back and repairs it (someone deleted or
/// edited it).
const RECHECK: Duration = Duration::from_secs(30);
/// The longest one request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Conflicts in a row before a sync counts as failed (and is retried with backoff).
const ROUNDS: usize = 5;
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    #[error("EndpointSlice {namespace}/{LEADER_SERVICE}: {source}")]
    Api {
        namespace: String,
        #[source]
        source: kube::Error,
    },
    #[error("EndpointSlice {namespace}/{LEADER_SERVICE}: the request timed out")]
    Timeout { namespace: String },
    #[error(
        "EndpointSlice {namespace}/{LEADER_SERVICE}: still conflicting after {ROUNDS} re-reads"
    )]
    Conflicts { namespace: String },
    #[error(
        "EndpointSlice {namespace}/{LEADER_SERVICE} has addressType {found}, this replica's pod IP needs {wanted} (the field is immutable: delete the slice, the leader creates it again)"
    )]
    AddressType {
        namespace: String,
        found: String,
        wanted: &'static str,
    },
}

/// What one sync did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synced {
    /// The slice already said what it should.
    Unchanged,
    /// The slice was created or rewritten.
    Written,
    /// A leader's write was not sent: its fence is closed (it is stepping down).
    Fenced,
}

/// This replica as an endpoint of the leader Service.
#[derive(Debug, Clone)]
pub struct Me {
    pub pod: String,
    pub ip: IpAddr,
    pub port: u16,
}

impl Me {
    fn address_type(&self) -> &'static str {
        if self.ip.is_ipv4() { "IPv4" } else { "IPv6" }
    }

    fn address(&self) -> String {
        self.ip.to_string()
    }

    fn endpoint(&self, namespace: &str) -> Endpoint {
        Endpoint {
            addresses: vec![self.address()],
            conditions: Some(EndpointConditions {
                ready: Some(true),
                serving: Some(true),
                terminating: Some(false),
            }),
            target_ref: Some(ObjectReference {
                kind: Some("Pod".to_owned()),
                namespace: Some(namespace.to_owned()),
                name: Some(self.pod.clone()),
                ..ObjectReference::default()
            }),
            ..Endpoint::default()
        }
    }

    fn port(&self) -> EndpointPort {
        EndpointPort {
            name: Some(PORT_NAME.to_owned()),
            port: Some(i32::from(self.port)),
            protocol: Some("TCP".to_owned()),
            ..EndpointPort::default()
        }
    }
}

/// Reads and writes the leader slice.
#[derive(Clone)]
pub struct LeaderSlice {
    api: Api<EndpointSlice>,
    namespace: String,
    me: Me,
    fence: Arc<Fence>,
}

impl std::fmt::Debug for LeaderSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderSlice")
            .field("namespace", &self.namespace)
            .field("me", &self.me)
            .finish_non_exhaustive()
    }
}

fn labels() -> BTreeMap<String, String> {
    [
        (SERVICE_NAME_LABEL.to_owned(), LEADER_SERVICE.to_owned()),
        (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
    ]
    .into()
}

impl LeaderSlice {
    pub fn new(client: Client, namespace: &str, me: Me, fence: Arc<Fence>) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            me,
            fence,
        }
    }

    fn api_error(&self, source: kube::Error) -> SliceError {
        SliceError::Api {
            namespace: self.namespace.clone(),
            source,
        }
    }

    /// Whether `slice` lists this replica: its address, for its pod.
    fn lists_me(&self, slice: &EndpointSlice) -> bool {
        let mine = self.me.address();
        slice.endpoints.iter().any(|e| {
            e.addresses.contains(&mine)
                && e.target_ref
                    .as_ref()
                    .is_none_or(|r| r.name.as_deref() == Some(self.me.pod.as_str()))
        })
    }

    /// Whether `slice` says exactly that this replica leads.
    fn says_i_lead(&self, slice: &EndpointSlice) -> bool {
        let endpoints = slice.endpoints.as_slice();
        let ports = slice.ports.as_deref().unwrap_or_default();
        let have = slice.metadata.labels.clone().unwrap_or_default();
        endpoints == [self.me.endpoint(&self.namespace)]
            && ports == [self.me.port()]
            && labels().iter().all(|(k, v)| have.get(k) == Some(v))
    }

    /// The slice saying that this replica leads, from what was read (`None`: absent).
    fn leading(&self, read: Option<EndpointSlice>) -> EndpointSlice {
        let mut slice = read.unwrap_or_else(|| EndpointSlice {
            metadata: ObjectMeta {
                name: Some(LEADER_SERVICE.to_owned()),
                namespace: Some(self.namespace.clone()),
                ..ObjectMeta::default()
            },
            address_type: self.me.address_type().to_owned(),
            endpoints: Vec::new(),
            ports: None,
        });
        let mut have = slice.metadata.labels.take().unwrap_or_default();
        have.extend(labels());
        slice.metadata.labels = Some(have);
        slice.endpoints = vec![self.me.endpoint(&self.namespace)];
        slice.ports = Some(vec![self.me.port()]);
        slice
    }

    async fn request<T>(
        &self,
        timeout: Duration,
        call: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<Result<T, kube::Error>, SliceError> {
        tokio::time::timeout(timeout.min(REQUEST_TIMEOUT), call)
            .await
            .map_err(|_| SliceError::Timeout {
                namespace: self.namespace.clone(),
            })
    }

    /// Makes the slice name this replica as the leader (`leading`), or removes this
    /// replica's address from it. A leader writes only while its fence is open.
    pub async fn sync(&self, leading: bool) -> Result<Synced, SliceError> {
        for _ in 0..ROUNDS {
            let read = self
                .request(REQUEST_TIMEOUT, self.api.get_opt(LEADER_SERVICE))
                .await?
                .map_err(|e| self.api_error(e))?;
            let write = match (&read, leading) {
                (None, false) => return Ok(Synced::Unchanged),
                (Some(slice), false) if !self.lists_me(slice) => return Ok(Synced::Unchanged),
                (Some(slice), true) if self.says_i_lead(slice) => return Ok(Synced::Unchanged),
                (Some(slice), true) if slice.address_type != self.me.address_type() => {
                    return Err(SliceError::AddressType {
                        namespace: self.namespace.clone(),
                        found: slice.address_type.clone(),
                        wanted: self.me.address_type(),
                    });
                }
                (Some(slice), false) => {
                    let mut slice = slice.clone();
                    // No endpoint: kube-proxy rejects connections at once, and agents
                    // retry until the next leader publishes itself.
                    slice.endpoints = Vec::new();
                    slice
                }
                (_, true) => self.leading(read.clone()),
            };
            let timeout = if leading {
                match self.fence.remaining() {
                    Some(left) => left,
                    None => return Ok(Synced::Fenced),
                }
            } else {
                REQUEST_TIMEOUT
            };
            let pp = PostParams::default();
            // The slice read carries its resourceVersion: the write is conditional.
            let answer = match read {
                None => self.request(timeout, self.api.create(&pp, &write)).await?,
                Some(_) => {
                    self.request(timeout, self.api.replace(LEADER_SERVICE, &pp, &write))
                        .await?
                }
            };
            match answer {
                Ok(_) => return Ok(Synced::Written),
                // Written by someone else since the read (409 Conflict), or created
                // (409 AlreadyExists): read again.
                Err(kube::Error::Api(s)) if s.code == 409 => {
                    debug!(reason = %s.reason, "the leader EndpointSlice changed under us; re-reading");
                }
                Err(e) => return Err(self.api_error(e)),
            }
        }
        Err(SliceError::Conflicts {
            namespace: self.namespace.clone(),
        })
    }
}

/// Keeps the slice as this replica's role wants it, retrying with backoff.
#[derive(Debug)]
pub struct Publisher {
    desired: watch::Sender<bool>,
    task: JoinHandle<()>,
    slice: LeaderSlice,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Publisher {
    /// Starts as a follower: a replica restarted in the same pod removes the address
    /// it published before it crashed.
    pub fn start(slice: LeaderSlice) -> Self {
        let (desired, rx) = watch::channel(false);
        let task = tokio::spawn(
            keep(slice.clone(), rx)
                .instrument(info_span!("leader_slice", pod = %slice.me.pod, ip = %slice.me.ip)),
        );
        Self {
            desired,
            task,
            slice,
        }
    }

    /// Publishes this replica (`true`) or takes its address off (`false`).
    pub fn set(&self, leading: bool) {
        self.desired.send_replace(leading);
    }

    /// Takes this replica's address off now (at shutdown), within `timeout`.
    pub async fn clear(self, timeout: Duration) {
        self.task.abort();
        match tokio::time::timeout(timeout, self.slice.sync(false)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                warn!(error = %e, "could not remove this replica from the leader EndpointSlice");
            }
            Err(_) => warn!("removing this replica from the leader EndpointSlice timed out"),
        }
    }
}

async fn keep(slice: LeaderSlice, mut desired: watch::Receiver<bool>) {
    'wanted: loop {
        let leading = *desired.borrow_and_update();
        let mut wait = RETRY_MIN;
        loop {
            match slice.sync(leading).await {
                Ok(synced) => {
                    match (synced, leading) {
                        (Synced::Written, true) => {
                            info!("published this replica in the leader EndpointSlice");
                        }
                        (Synced::Written, false) => {
                            info!("removed this replica from the leader EndpointSlice");
                        }
                        (Synced::Unchanged | Synced::Fenced, _) => {}
                    }
                    break;
                }
                Err(e) => {
                    warn!(error = %e, leading, "could not update the leader EndpointSlice; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        changed = desired.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            continue 'wanted;
                        }
                    }
                    wait = (wait * 2).min(RETRY_MAX);
                }
            }
        }
        // A leader reads its slice back now and then, and repairs it.
        let recheck = async {
            if leading {
                tokio::time::sleep(RECHECK).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            () = recheck => {}
            changed = desired.changed() => {
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}
