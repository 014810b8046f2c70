//! Leader election on a `coordination.k8s.io/v1` Lease, with kube's own API types
//! and resourceVersion optimistic concurrency: the algorithm of client-go's
//! `leaderelection`. Every round reads the Lease; a replica takes it when it is free,
//! expired, or its own, by a `replace` carrying the resourceVersion it read, so of two
//! contenders exactly one wins (the other gets 409).
//!
//! Expiry is judged on the local monotonic clock, from when this replica last saw the
//! Lease record change, never from the `renewTime` another node wrote, so clock skew
//! between nodes does not matter. The leader publishes its gRPC address in the
//! [`ADDRESS_ANNOTATION`] annotation, for followers' answers.

use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
};
use kube::{Api, Client, api::PostParams};
use tokio::time::Instant;

use crate::replica::Leader;

/// The Lease annotation with the leader's gRPC address (`ip:port`).
pub const ADDRESS_ANNOTATION: &str = "census.dev/leader-address";

/// Which Lease, who this replica is, and the timing.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity in `holderIdentity` (its pod's name).
    pub identity: String,
    /// This replica's gRPC address, published while it leads.
    pub address: Option<String>,
    /// How long a Lease is valid after its last renewal.
    pub duration: Duration,
    /// The leader stops writing if it has not renewed for this long.
    pub renew_deadline: Duration,
    /// How often replicas try to acquire, and the leader renews.
    pub retry_period: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    #[error("Lease {namespace}/{name}: {source}")]
    Api {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "lease timing: the retry period ({retry:?}) must be below the renew deadline ({renew:?}), which must be below the lease duration ({duration:?}), itself at least 1s"
    )]
    Timing {
        retry: Duration,
        renew: Duration,
        duration: Duration,
    },
}

impl LeaseConfig {
    pub fn check(&self) -> Result<(), ElectionError> {
        if self.retry_period.is_zero()
            || self.retry_period >= self.renew_deadline
            || self.renew_deadline >= self.duration
            || self.duration < Duration::from_secs(1)
        {
            return Err(ElectionError::Timing {
                retry: self.retry_period,
                renew: self.renew_deadline,
                duration: self.duration,
            });
        }
        Ok(())
    }

    /// `leaseDurationSeconds`: whole seconds, rounded up.
    fn duration_seconds(&self) -> i32 {
        let secs = self.duration.as_millis().div_ceil(1000).max(1);
        i32::try_from(secs).unwrap_or(i32::MAX)
    }
}

/// The result of one round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// This replica holds the Lease; `previous` held it before, if another replica.
    Leading { previous: Option<String> },
    /// Another replica holds a live Lease.
    Following(Option<Leader>),
    /// The Lease changed between this round's read and its write (409): nothing is
    /// known of who holds it now. Like client-go's `tryAcquireOrRenew` returning false
    /// on an update error, the caller reads it again at its next round: a leader keeps
    /// trying until its renew deadline (someone may only have edited an annotation),
    /// and steps down only when a round finds another holder or the deadline passes.
    Conflict,
}

#[derive(Debug, Clone)]
struct Observed {
    resource_version: String,
    at: Instant,
}

#[derive(Debug)]
pub struct Elector {
    api: Api<Lease>,
    cfg: LeaseConfig,
    observed: Option<Observed>,
    /// When another holder's Lease expires, as of the last round.
    expiry: Option<Instant>,
}

impl Elector {
    pub fn new(client: Client, cfg: LeaseConfig) -> Self {
        Self {
            api: Api::namespaced(client, &cfg.namespace),
            cfg,
            observed: None,
            expiry: None,
        }
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.cfg
    }

    /// When the Lease another replica holds expires, as last seen (for a follower to
    /// try right then rather than at its next period).
    pub fn expires_at(&self) -> Option<Instant> {
        self.expiry
    }

    fn error(&self, source: kube::Error) -> ElectionError {
        ElectionError::Api {
            namespace: self.cfg.namespace.clone(),
            name: self.cfg.name.clone(),
            source,
        }
    }

    fn annotations(&self) -> Option<std::collections::BTreeMap<String, String>> {
        self.cfg
            .address
            .as_ref()
            .map(|a| [(ADDRESS_ANNOTATION.to_owned(), a.clone())].into())
    }

    /// One round of acquiring or renewing. `Leading` means the Lease was written with
    /// this replica as holder during this call.
    pub async fn try_acquire_or_renew(&mut self) -> Result<Outcome, ElectionError> {
        let now = Instant::now();
        let stamp = MicroTime(k8s_openapi::jiff::Timestamp::now());
        self.expiry = None;
        let Some(lease) = self
            .api
            .get_opt(&self.cfg.name)
            .await
            .map_err(|e| self.error(e))?
        else {
            return self.create(stamp, now).await;
        };
        let rv = lease.metadata.resource_version.clone().unwrap_or_default();
        let seen_now = Instant::now();
        if self
            .observed
            .as_ref()
            .is_none_or(|o| o.resource_version != rv)
        {
            // Stamped after the read: another holder's lease is never judged to end early.
            self.observed = Some(Observed {
                resource_version: rv,
                at: seen_now,
            });
        }
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let ours = holder.as_deref() == Some(self.cfg.identity.as_str());
        let current = holder.as_ref().map(|name| Leader {
            name: name.clone(),
            address: lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ADDRESS_ANNOTATION))
                .cloned(),
        });
        if !ours && holder.is_some() {
            let record = Duration::from_secs(
                u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
            );
            let valid_for = record.max(self.cfg.duration);
            let seen = self.observed.as_ref().map_or(seen_now, |o| o.at);
            if seen + valid_for > seen_now {
                self.expiry = Some(seen + valid_for);
                return Ok(Outcome::Following(current));
            }
        }
        // Free, expired, or ours: write ourselves in, conditional on what we read.
        self.take_over(lease, spec, holder, stamp, now).await
    }

    /// Creates the Lease with this replica as its holder (none existed).
    async fn create(&mut self, stamp: MicroTime, now: Instant) -> Result<Outcome, ElectionError> {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.cfg.name.clone()),
                namespace: Some(self.cfg.namespace.clone()),
                annotations: self.annotations(),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.cfg.identity.clone()),
                lease_duration_seconds: Some(self.cfg.duration_seconds()),
                acquire_time: Some(stamp.clone()),
                renew_time: Some(stamp),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        match self.api.create(&PostParams::default(), &lease).await {
            Ok(created) => {
                self.observe(&created, now);
                Ok(Outcome::Leading { previous: None })
            }
            // Created by another replica first.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Outcome::Conflict),
            Err(e) => Err(self.error(e)),
        }
    }

    /// Writes this replica into `lease` (free, expired, or its own), conditional on
    /// the version read.
    async fn take_over(
        &mut self,
        lease: Lease,
        spec: LeaseSpec,
        holder: Option<String>,
        stamp: MicroTime,
        now: Instant,
    ) -> Result<Outcome, ElectionError> {
        let ours = holder.as_deref() == Some(self.cfg.identity.as_str());
        let mut next = lease;
        next.metadata.annotations = match self.annotations() {
            Some(mine) => Some(
                next.metadata
                    .annotations
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|(k, _)| k != ADDRESS_ANNOTATION)
                    .chain(mine)
                    .collect(),
            ),
            None => next.metadata.annotations.map(|a| {
                a.into_iter()
                    .filter(|(k, _)| k != ADDRESS_ANNOTATION)
                    .collect()
            }),
        };
        let transitions = spec.lease_transitions.unwrap_or(0);
        next.spec = Some(LeaseSpec {
            holder_identity: Some(self.cfg.identity.clone()),
            lease_duration_seconds: Some(self.cfg.duration_seconds()),
            acquire_time: if ours {
                spec.acquire_time.clone()
            } else {
                Some(stamp.clone())
            },
            renew_time: Some(stamp),
            lease_transitions: Some(if ours {
                transitions
            } else {
                transitions.saturating_add(1)
            }),
            ..spec
        });
        match self
            .api
            .replace(&self.cfg.name, &PostParams::default(), &next)
            .await
        {
            Ok(written) => {
                self.observe(&written, now);
                let previous = holder.filter(|h| *h != self.cfg.identity);
                Ok(Outcome::Leading { previous })
            }
            // What was read is no longer the Lease: who holds it now is unknown.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(Outcome::Conflict),
            Err(e) => Err(self.error(e)),
        }
    }

    fn observe(&mut self, lease: &Lease, at: Instant) {
        self.observed = Some(Observed {
            resource_version: lease.metadata.resource_version.clone().unwrap_or_default(),
            at,
        });
    }

    /// Gives the Lease up (on shutdown), so another replica takes it at its next try
    /// instead of after the lease duration. Does nothing if another replica holds it.
    pub async fn release(&mut self) -> Result<(), ElectionError> {
        let Some(mut lease) = self
            .api
            .get_opt(&self.cfg.name)
            .await
            .map_err(|e| self.error(e))?
        else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(self.cfg.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(k8s_openapi::jiff::Timestamp::now()));
        if let Some(annotations) = lease.metadata.annotations.as_mut() {
            annotations.remove(ADDRESS_ANNOTATION);
        }
        match self
            .api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(self.error(e)),
        }
    }
}
