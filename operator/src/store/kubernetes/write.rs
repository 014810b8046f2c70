//! One store op as API requests. Every write is conditional on the version census
//! last saw (resourceVersion; a delete also the UID); a 409 leads to a re-read, after
//! which the op is retried if the object still says what census wrote, and refused
//! only when a fresh read shows something census did not write: a valid binding of
//! other labels with [`StoreError::IdBound`] (the core takes it), anything else with
//! [`StoreError::Conflict`]. An op makes at most [`ATTEMPTS`] rounds, so conflicts that keep coming fail
//! it with a retryable error and the core's backoff takes over. One deadline (the
//! request timeout, and never past the fence) covers the whole op, its re-reads
//! included.
//!
//! An object being deleted (`deletionTimestamp` set: someone's finalizer holds it) is
//! neither a binding to reuse nor a tombstone to rely on, and nothing can be created
//! under its name until it is gone (the API server answers AlreadyExists). Every op on
//! such an id fails, on a fresh read, with the retryable `Unavailable { cause:
//! "terminating" }`, and the core retries it with backoff until the object is gone.
//! The id is not blocked: blocking would move its users to another id for what is
//! usually a short wait, and while the object exists nothing else can be bound under
//! the id, so the core keeps the id's one label set (it never binds the id to other
//! labels meanwhile: the op stays its to retry), and the API server cannot hold a
//! second one. A DELETE answered 200 with the object and its `deletionTimestamp` is
//! such a wait, not a deleted object.

use std::{
    future::Future,
    time::{SystemTime, UNIX_EPOCH},
};

use census_proto::{domain::IdentityId, labels::LabelSet};
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams, Preconditions};
use tokio::time::Instant;

use super::{
    ConflictOp, Shared,
    error::{Failure, classify},
    index::Source,
    object::{self, Meta, State},
};
use crate::store::{StoreError, StoreOp, Tombstone};

/// Rounds of one op (each 409 costs a re-read and a round).
const ATTEMPTS: usize = 5;

/// What one round decided.
enum Next {
    /// Read the object again, then decide anew.
    Reread,
    /// Decide anew from the index (it was just updated by a write's answer).
    Again,
}

impl Shared {
    pub(super) async fn apply_one(&self, op: StoreOp) -> Result<(), StoreError> {
        // One deadline over the op's requests, re-reads included.
        let until = Instant::now() + self.cfg.request_timeout;
        match op {
            StoreOp::CreateIdentity { id, labels } => self.create(id, &labels, until).await,
            StoreOp::DeleteIdentity {
                id,
                labels,
                tombstone,
            } => self.tombstone(id, &labels, &tombstone, until).await,
            StoreOp::DeleteTombstone { id } => self.forget(id, until).await,
            // The cluster's Node objects are the record of known nodes.
            StoreOp::PutNode { .. } | StoreOp::DeleteNode { .. } => Ok(()),
        }
    }

    /// Runs one write if the fence is open, within the time it and `until` leave.
    pub(super) async fn request<T>(
        &self,
        call: impl Future<Output = Result<T, kube::Error>>,
        until: Instant,
    ) -> Result<T, Failure> {
        let Some(left) = self.fence.remaining() else {
            return Err(Failure::unavailable(
                "not_leader",
                "this replica does not hold the lease",
            ));
        };
        within(
            left.min(until.saturating_duration_since(Instant::now())),
            call,
        )
        .await
    }

    fn known(&self, id: IdentityId) -> Option<(Meta, State)> {
        self.index
            .read()
            .get(id)
            .map(|e| (e.meta.clone(), e.state.clone()))
    }

    /// Records the object a write returned.
    async fn observe(&self, obj: &DynamicObject) {
        if let Ok(p) = object::parse(obj, &self.cfg.limits) {
            let events = self.index.write().apply(p, Source::OwnWrite);
            self.emit(events).await;
        }
    }

    /// Reads the object again into the index (a change found there may be someone
    /// else's, so it is reported like one the watch saw).
    async fn reread(&self, id: IdentityId, until: Instant) -> Result<(), Failure> {
        let name = id.to_string();
        // Reads are not fenced: a follower may read, and this one only informs a write.
        // It is bounded by the op's deadline all the same.
        let left = until.saturating_duration_since(Instant::now());
        let events = match within(left, self.writes.get(&name)).await {
            Ok(obj) => match object::parse(&obj, &self.cfg.limits) {
                Ok(p) => self.index.write().apply(p, Source::Observed),
                Err(_) => Vec::new(),
            },
            Err(Failure::NotFound) => self.index.write().delete(id, None, Source::Observed),
            Err(other) => return Err(other),
        };
        self.emit(events).await;
        Ok(())
    }

    async fn patch_status(
        &self,
        id: IdentityId,
        patch: &serde_json::Value,
        until: Instant,
    ) -> Result<DynamicObject, Failure> {
        let name = id.to_string();
        self.request(
            self.writes
                .patch_status(&name, &PatchParams::default(), &Patch::Merge(patch)),
            until,
        )
        .await
    }

    /// Deletes the object census saw as `meta`. `Ok` only once it is gone: a 200 whose
    /// body is the object with `deletionTimestamp` set means a finalizer holds it
    /// (indexed as being deleted, and a `terminating` failure).
    async fn delete_exact(
        &self,
        id: IdentityId,
        meta: &Meta,
        until: Instant,
    ) -> Result<(), Failure> {
        let name = id.to_string();
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: Some(meta.resource_version.to_string()),
                uid: Some(meta.uid.to_string()),
            }),
            ..DeleteParams::default()
        };
        match self
            .request(self.writes.delete(&name, &params), until)
            .await
        {
            Ok(answer) => match answer.left() {
                Some(obj) if obj.metadata.deletion_timestamp.is_some() => {
                    self.observe(&obj).await;
                    Err(terminating(id))
                }
                // Deleted: the last state of the object, or a Status of Success.
                _ => {
                    let events = self
                        .index
                        .write()
                        .delete(id, Some(&meta.uid), Source::OwnWrite);
                    self.emit(events).await;
                    Ok(())
                }
            },
            Err(Failure::NotFound) => {
                let events = self
                    .index
                    .write()
                    .delete(id, Some(&meta.uid), Source::OwnWrite);
                self.emit(events).await;
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn post(&self, id: IdentityId, labels: &LabelSet, until: Instant) -> Result<(), Failure> {
        let obj = object::binding(&self.resource, id, labels);
        let created = self
            .request(self.writes.create(&PostParams::default(), &obj), until)
            .await?;
        self.observe(&created).await;
        Ok(())
    }

    /// CreateIdentity: bind `id` to `labels`, replacing a tombstone of the id.
    async fn create(
        &self,
        id: IdentityId,
        labels: &LabelSet,
        until: Instant,
    ) -> Result<(), StoreError> {
        let doing = || format!("create identity {id}");
        let mut reread = false;
        for _ in 0..ATTEMPTS {
            let known = self.known(id);
            if let Some((meta, _)) = &known
                && meta.deleting
            {
                if reread {
                    return Err(terminating(id).into_store_error(&doing()));
                }
                self.reread(id, until)
                    .await
                    .map_err(|e| e.into_store_error(&doing()))?;
                reread = true;
                continue;
            }
            self.labels_free(id, labels, known.as_ref())?;
            let next = match known {
                None => match self.post(id, labels, until).await {
                    Ok(()) => return Ok(()),
                    Err(Failure::AlreadyExists) => Next::Reread,
                    Err(e) => return Err(e.into_store_error(&doing())),
                },
                Some((_, State::Binding(bound))) if bound == *labels => return Ok(()),
                Some((
                    meta,
                    State::Tombstone {
                        labels: Some(was), ..
                    },
                )) if was == *labels => {
                    // Bound again to the same labels (within or after its quarantine).
                    let patch = object::revive_patch(&meta.resource_version);
                    match self.patch_status(id, &patch, until).await {
                        Ok(obj) => {
                            self.observe(&obj).await;
                            return Ok(());
                        }
                        Err(Failure::Conflict) => {
                            self.conflicts.met(ConflictOp::Create);
                            Next::Reread
                        }
                        Err(Failure::NotFound) => Next::Reread,
                        Err(e) => return Err(e.into_store_error(&doing())),
                    }
                }
                Some((
                    meta,
                    State::Tombstone {
                        labels_hash,
                        until_ms,
                        ..
                    },
                )) => {
                    if until_ms > now_ms() && labels_hash != labels.stable_hash() {
                        if reread {
                            return Err(conflict(
                                id,
                                labels,
                                format!(
                                    "a tombstone that quarantines it for other labels until {}",
                                    super::crd::time_to_text(until_ms)
                                ),
                            ));
                        }
                        Next::Reread
                    } else {
                        self.clear_tombstone(id, &meta, until, &doing).await?
                    }
                }
                Some((_, state)) => {
                    if reread {
                        return Err(refused(id, labels, state));
                    }
                    Next::Reread
                }
            };
            if let Next::Reread = next {
                self.reread(id, until)
                    .await
                    .map_err(|e| e.into_store_error(&doing()))?;
                reread = true;
            }
        }
        Err(Failure::Conflict.into_store_error(&doing()))
    }

    /// Before writing anything for `id` (free, or a tombstone): labels the store binds
    /// to another id already (an object census did not write) are theirs, and a second
    /// object would be a younger duplicate, invalid for good.
    fn labels_free(
        &self,
        id: IdentityId,
        labels: &LabelSet,
        known: Option<&(Meta, State)>,
    ) -> Result<(), StoreError> {
        let writes = match known {
            None | Some((_, State::Tombstone { .. })) => true,
            Some((_, State::Binding(_) | State::Invalid(_))) => false,
        };
        if writes
            && let Some(bound) = self.index.read().bound_to(labels)
            && bound != id
        {
            return Err(StoreError::LabelsBound {
                id,
                labels: labels.to_string(),
                bound,
            });
        }
        Ok(())
    }

    /// A tombstone census is done with, seen as `meta`, deleted so that CreateIdentity
    /// can replace it.
    async fn clear_tombstone(
        &self,
        id: IdentityId,
        meta: &Meta,
        until: Instant,
        doing: &(dyn Fn() -> String + Sync),
    ) -> Result<Next, StoreError> {
        match self.delete_exact(id, meta, until).await {
            Ok(()) => Ok(Next::Again),
            Err(Failure::Conflict) => {
                self.conflicts.met(ConflictOp::Create);
                Ok(Next::Reread)
            }
            Err(e) => Err(e.into_store_error(&doing())),
        }
    }

    /// DeleteIdentity: turn the binding of `id` to `labels` into a tombstone.
    async fn tombstone(
        &self,
        id: IdentityId,
        labels: &LabelSet,
        tombstone: &Tombstone,
        until: Instant,
    ) -> Result<(), StoreError> {
        let doing = || format!("delete identity {id}");
        let mut reread = false;
        for _ in 0..ATTEMPTS {
            let known = self.known(id);
            if let Some((meta, _)) = &known
                && meta.deleting
            {
                // A tombstone written to it would go with it.
                if reread {
                    return Err(terminating(id).into_store_error(&doing()));
                }
                self.reread(id, until)
                    .await
                    .map_err(|e| e.into_store_error(&doing()))?;
                reread = true;
                continue;
            }
            let next = match known {
                None if !reread => Next::Reread,
                None => {
                    // Gone already (404 counts as success): the quarantine is recorded
                    // all the same, so it survives a restart.
                    match self.post(id, labels, until).await {
                        Ok(()) => Next::Again,
                        Err(Failure::AlreadyExists) => Next::Reread,
                        Err(e) => return Err(e.into_store_error(&doing())),
                    }
                }
                Some((meta, State::Binding(bound))) if bound == *labels => {
                    let patch = object::tombstone_patch(&meta.resource_version, tombstone);
                    match self.patch_status(id, &patch, until).await {
                        Ok(obj) => {
                            self.observe(&obj).await;
                            return Ok(());
                        }
                        // Changed (an annotation added?) or gone: read it and decide again.
                        Err(Failure::Conflict) => {
                            self.conflicts.met(ConflictOp::Tombstone);
                            Next::Reread
                        }
                        Err(Failure::NotFound) => Next::Reread,
                        Err(e) => return Err(e.into_store_error(&doing())),
                    }
                }
                Some((_, State::Tombstone { labels_hash, .. }))
                    if labels_hash == labels.stable_hash() =>
                {
                    return Ok(());
                }
                Some((_, state)) => {
                    if reread {
                        return Err(refused(id, labels, state));
                    }
                    Next::Reread
                }
            };
            if let Next::Reread = next {
                self.reread(id, until)
                    .await
                    .map_err(|e| e.into_store_error(&doing()))?;
                reread = true;
            }
        }
        Err(Failure::Conflict.into_store_error(&doing()))
    }

    /// DeleteTombstone: remove the tombstone of `id`, never a binding.
    async fn forget(&self, id: IdentityId, until: Instant) -> Result<(), StoreError> {
        let doing = || format!("delete the tombstone of {id}");
        let mut reread = false;
        for _ in 0..ATTEMPTS {
            let next = match self.known(id) {
                // Deleted already, but still there: done only once it is gone, so the
                // core never frees the id while the object still names it.
                Some((meta, _)) if meta.deleting => {
                    if reread {
                        return Err(terminating(id).into_store_error(&doing()));
                    }
                    Next::Reread
                }
                Some((meta, State::Tombstone { .. })) => {
                    match self.delete_exact(id, &meta, until).await {
                        Ok(()) => return Ok(()),
                        Err(Failure::Conflict) => {
                            self.conflicts.met(ConflictOp::DeleteTombstone);
                            Next::Reread
                        }
                        Err(e) => return Err(e.into_store_error(&doing())),
                    }
                }
                // Gone, or bound again: nothing of the tombstone is left.
                _ if reread => return Ok(()),
                _ => Next::Reread,
            };
            if let Next::Reread = next {
                self.reread(id, until)
                    .await
                    .map_err(|e| e.into_store_error(&doing()))?;
                reread = true;
            }
        }
        Err(Failure::Conflict.into_store_error(&doing()))
    }
}

/// Runs one request within `limit`.
async fn within<T>(
    limit: std::time::Duration,
    call: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, Failure> {
    if limit.is_zero() {
        return Err(Failure::unavailable(
            "timeout",
            "the op's time ran out before this request",
        ));
    }
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(classify(&e)),
        Err(_) => Err(Failure::unavailable(
            "timeout",
            format!("no answer within {limit:?}"),
        )),
    }
}

/// The object of `id` is being deleted: the op waits (is retried) until it is gone.
fn terminating(id: IdentityId) -> Failure {
    Failure::unavailable(
        "terminating",
        format!(
            "Identity object {id} is being deleted (deletionTimestamp set; a finalizer holds it): \
             nothing can be written under its name until it is gone"
        ),
    )
}

fn conflict(id: IdentityId, labels: &LabelSet, found: String) -> StoreError {
    StoreError::Conflict {
        id,
        expected: labels.to_string(),
        found,
    }
}

/// `id` holds `state` where the op expects `labels`: a valid binding is one census
/// takes ([`StoreError::IdBound`]), anything else a conflict.
fn refused(id: IdentityId, labels: &LabelSet, state: State) -> StoreError {
    match state {
        State::Binding(bound) => StoreError::IdBound {
            id,
            labels: labels.to_string(),
            bound,
        },
        state => conflict(id, labels, describe(&state)),
    }
}

/// What an object holds, for a conflict's `found`.
fn describe(state: &State) -> String {
    match state {
        State::Binding(labels) => format!("an Identity object with the labels {labels}"),
        State::Tombstone { until_ms, .. } => format!(
            "a tombstone of other labels (quarantined until {})",
            super::crd::time_to_text(*until_ms)
        ),
        State::Invalid(why) => format!("an invalid Identity object: {why}"),
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
