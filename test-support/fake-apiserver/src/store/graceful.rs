//! Graceful deletion of pods, as the pod registry does it
//! (`pkg/registry/core/pod/strategy.go` `CheckGracefulDelete`,
//! `k8s.io/apiserver/pkg/registry/rest/delete.go` `BeforeDelete`).
//!
//! A DELETE of a scheduled, unfinished pod does not remove it: it sets
//! `deletionTimestamp` (now + the grace period) and
//! `deletionGracePeriodSeconds`, bumps `generation`, and the pod stays, with its
//! IP and phase, until the kubelet has stopped its containers and confirms with a
//! DELETE of grace period 0 ([`Store::confirm_pod_deletion`] stands in for it).
//! The grace period is the request's `gracePeriodSeconds`, else the pod's
//! `spec.terminationGracePeriodSeconds`, else 30 (the API's default for the
//! field). A pod that is not scheduled (`spec.nodeName` unset) or has Succeeded
//! or Failed goes at once, as does a DELETE with period 0. Deleting a pod that is
//! already terminating can only shorten its period; anything else changes nothing.

use serde_json::{Value, json};

use super::*;

/// `spec.terminationGracePeriodSeconds` when the pod does not set it.
const DEFAULT_GRACE_SECONDS: i64 = 30;

/// What a graceful DELETE did.
pub(crate) enum GracefulOutcome {
    /// Not graceful (grace 0, unscheduled or finished pod): the normal delete path.
    Immediate,
    /// The pod is terminating (newly or still): its current state.
    Terminating(Obj),
}

fn grace_of(obj: &Value) -> Option<i64> {
    object::meta(obj)?
        .get("deletionGracePeriodSeconds")?
        .as_i64()
}

fn timestamp_after(seconds: i64) -> String {
    let now = k8s_openapi::jiff::Timestamp::now();
    now.checked_add(k8s_openapi::jiff::SignedDuration::from_secs(seconds))
        .unwrap_or(now)
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

impl Store {
    /// Whether `res` is the core pods resource, whose deletes are graceful.
    pub(crate) fn is_pods(&self, res: usize) -> bool {
        let spec = self.spec(res);
        spec.group.is_empty() && spec.plural == "pods"
    }

    /// A DELETE of a pod with `requested` as `gracePeriodSeconds` (None when the
    /// request names none). Preconditions are checked by the caller first.
    pub(crate) fn delete_pod_gracefully(
        &mut self,
        res: usize,
        key: &ObjKey,
        requested: Option<i64>,
    ) -> Result<GracefulOutcome, ApiError> {
        let old = self.get(res, key)?;
        if meta_str(&old, "deletionTimestamp").is_some() {
            let Some(current) = grace_of(&old) else {
                return Ok(GracefulOutcome::Immediate);
            };
            // Only a shorter period may be set (`BeforeDelete`).
            return match requested {
                Some(0) => Ok(GracefulOutcome::Immediate),
                Some(shorter) if shorter > 0 && shorter < current => {
                    let mut next = (*old).clone();
                    set_meta(
                        &mut next,
                        "deletionTimestamp",
                        json!(timestamp_after(shorter)),
                    );
                    set_meta(&mut next, "deletionGracePeriodSeconds", json!(shorter));
                    let obj = self.commit_put(res, key.clone(), next, Some(old));
                    Ok(GracefulOutcome::Terminating(obj))
                }
                _ => Ok(GracefulOutcome::Terminating(old)),
            };
        }
        let mut period = requested
            .or_else(|| old["spec"]["terminationGracePeriodSeconds"].as_i64())
            .unwrap_or(DEFAULT_GRACE_SECONDS);
        let scheduled = old["spec"]["nodeName"]
            .as_str()
            .is_some_and(|n| !n.is_empty());
        let finished = matches!(
            old["status"]["phase"].as_str(),
            Some("Succeeded" | "Failed")
        );
        if !scheduled || finished {
            period = 0;
        }
        if period < 0 {
            period = 1;
        }
        if period == 0 {
            return Ok(GracefulOutcome::Immediate);
        }
        let mut next = (*old).clone();
        set_meta(
            &mut next,
            "deletionTimestamp",
            json!(timestamp_after(period)),
        );
        set_meta(&mut next, "deletionGracePeriodSeconds", json!(period));
        set_meta(&mut next, "generation", json!(object::generation(&old) + 1));
        let obj = self.commit_put(res, key.clone(), next, Some(old));
        Ok(GracefulOutcome::Terminating(obj))
    }

    /// What the kubelet does once a terminating pod's containers are stopped: a
    /// DELETE with grace period 0 and the pod's UID as precondition. The pod goes,
    /// or, with finalizers, waits for them with `deletionGracePeriodSeconds: 0`.
    /// `uid` (when given) must still be the pod's: a pod re-created under the same
    /// name is left alone. Returns the pod's last state, or None if nothing was
    /// terminating there.
    pub(crate) fn confirm_pod_deletion(
        &mut self,
        res: usize,
        key: &ObjKey,
        uid: Option<&str>,
    ) -> Option<Obj> {
        let old = self.resources[res].objects.get(key).cloned()?;
        if meta_str(&old, "deletionTimestamp").is_none()
            || uid.is_some_and(|uid| meta_str(&old, "uid") != Some(uid))
        {
            return None;
        }
        if object::finalizers(&old).is_empty() {
            return Some(self.commit_delete(res, key, (*old).clone()));
        }
        let mut next = (*old).clone();
        set_meta(&mut next, "deletionGracePeriodSeconds", json!(0));
        Some(self.commit_put(res, key.clone(), next, Some(old)))
    }
}
