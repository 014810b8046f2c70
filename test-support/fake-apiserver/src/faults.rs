//! Fault injection: conflicts, errors, latency, edits behind the client's
//! back, dropped watches, compaction and outages, on demand while the server
//! runs. Probabilistic faults draw from a seedable RNG, so a failing run
//! replays with the same seed and request order.

use std::{sync::Arc, time::Duration};

use parking_lot::Mutex;

use crate::{
    error::{ApiError, ConflictCause},
    log::{RequestRecord, Verb},
    ratelimit::{Bucket, RateLimit},
    resource::{GroupResource, Gvr},
    rng::SplitMix64,
    server::{Availability, Shared},
};

/// Which requests a fault (or a log query) applies to. Unset fields match
/// anything; an empty verb set matches every verb.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestFilter {
    verbs: Vec<Verb>,
    group: Option<String>,
    resource: Option<String>,
    subresource: Option<String>,
    namespace: Option<String>,
    name: Option<String>,
}

impl RequestFilter {
    /// Every request.
    pub fn any() -> Self {
        Self::default()
    }

    /// Requests on a (plural) resource, e.g. `RequestFilter::resource("leases")`.
    pub fn resource(plural: &str) -> Self {
        Self {
            resource: Some(plural.to_owned()),
            ..Self::default()
        }
    }

    /// Requests on one kube-rs typed resource, e.g. `RequestFilter::of::<Lease>()`.
    pub fn of<K: kube::Resource<DynamicType = ()>>() -> Self {
        Self::resource(&K::plural(&())).group(&K::group(&()))
    }

    /// Requests on one object.
    pub fn object(gvr: &Gvr, namespace: Option<&str>, name: &str) -> Self {
        let filter = Self::resource(&gvr.resource).group(&gvr.group).name(name);
        match namespace {
            Some(ns) => filter.namespace(ns),
            None => filter,
        }
    }

    /// Also match this verb (the first call restricts to it).
    #[must_use]
    pub fn verb(mut self, verb: Verb) -> Self {
        self.verbs.push(verb);
        self
    }

    /// Also match these verbs.
    #[must_use]
    pub fn verbs(mut self, verbs: impl IntoIterator<Item = Verb>) -> Self {
        self.verbs.extend(verbs);
        self
    }

    /// Only writes: create, update, patch, delete, deletecollection.
    #[must_use]
    pub fn writes(self) -> Self {
        self.verbs([
            Verb::Create,
            Verb::Update,
            Verb::Patch,
            Verb::Delete,
            Verb::DeleteCollection,
        ])
    }

    /// Only this API group (empty for core).
    #[must_use]
    pub fn group(mut self, group: &str) -> Self {
        self.group = Some(group.to_owned());
        self
    }

    /// Only this namespace.
    #[must_use]
    pub fn namespace(mut self, namespace: &str) -> Self {
        self.namespace = Some(namespace.to_owned());
        self
    }

    /// Only this object name.
    #[must_use]
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// Only this subresource (e.g. `status`).
    #[must_use]
    pub fn subresource(mut self, subresource: &str) -> Self {
        self.subresource = Some(subresource.to_owned());
        self
    }

    /// Whether a logged request matches.
    pub fn matches_record(&self, r: &RequestRecord) -> bool {
        let eq = |want: &Option<String>, have: Option<&str>| {
            want.as_deref().is_none_or(|w| Some(w) == have)
        };
        (self.verbs.is_empty() || self.verbs.contains(&r.verb))
            && eq(&self.group, Some(&r.group))
            && eq(&self.resource, Some(&r.resource))
            && eq(&self.subresource, r.subresource.as_deref())
            && eq(&self.namespace, r.namespace.as_deref())
            && eq(&self.name, r.name.as_deref())
    }
}

/// An error answer to inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Failure {
    /// 500 InternalError.
    InternalError,
    /// 429 TooManyRequests with a `Retry-After` header (seconds). kube 5
    /// clients retry 429/503/504 by themselves (up to 15 times by default).
    TooManyRequests {
        /// The `Retry-After` value.
        retry_after_secs: u32,
    },
    /// 503 ServiceUnavailable.
    ServiceUnavailable,
}

impl Failure {
    pub(crate) fn code(self) -> u16 {
        match self {
            Self::InternalError => 500,
            Self::TooManyRequests { .. } => 429,
            Self::ServiceUnavailable => 503,
        }
    }

    pub(crate) fn reason(self) -> &'static str {
        match self {
            Self::InternalError => "InternalError",
            Self::TooManyRequests { .. } => "TooManyRequests",
            Self::ServiceUnavailable => "ServiceUnavailable",
        }
    }

    pub(crate) fn message(self) -> &'static str {
        match self {
            Self::InternalError => {
                "an error on the server (injected) has prevented the request from succeeding"
            }
            Self::TooManyRequests { .. } => {
                "the server has received too many requests and has asked us to try again later"
            }
            Self::ServiceUnavailable => "the server is currently unable to handle the request",
        }
    }

    pub(crate) fn retry_after(self) -> Option<u32> {
        match self {
            Self::TooManyRequests { retry_after_secs } => Some(retry_after_secs),
            _ => None,
        }
    }
}

/// How the server is down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownMode {
    /// Close every connection and refuse new ones (the listener is closed).
    Refuse,
    /// Accept connections but answer nothing; open watches go silent.
    Hang,
}

/// Identifies an injected fault, to remove it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FaultId(u64);

#[derive(Debug)]
enum Action {
    Conflict,
    Fail(Failure),
    Latency(Duration),
    Annotate { key: String, value: Option<String> },
    RateLimit(Bucket),
}

#[derive(Debug)]
struct Rule {
    id: FaultId,
    filter: RequestFilter,
    action: Action,
    remaining: Option<u32>,
    probability: f64,
}

#[derive(Debug)]
struct Rules {
    rules: Vec<Rule>,
    rng: SplitMix64,
    next_id: u64,
    touches: u64,
}

/// The rule set, shared by the handler and the [`Faults`] handle.
#[derive(Debug)]
pub(crate) struct FaultState {
    inner: Mutex<Rules>,
}

/// What the faults decided for one request.
#[derive(Debug, Default)]
pub(crate) struct Decision {
    pub(crate) latency: Duration,
    pub(crate) error: Option<ApiError>,
    pub(crate) annotations: Vec<(String, String)>,
    /// Over a rate limit: answer 429 with this `Retry-After`.
    pub(crate) throttled: Option<u32>,
}

impl FaultState {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            inner: Mutex::new(Rules {
                rules: Vec::new(),
                rng: SplitMix64::new(seed),
                next_id: 0,
                touches: 0,
            }),
        }
    }

    fn add(
        &self,
        filter: RequestFilter,
        action: Action,
        remaining: Option<u32>,
        probability: f64,
    ) -> FaultId {
        let mut inner = self.inner.lock();
        inner.next_id += 1;
        let id = FaultId(inner.next_id);
        inner.rules.push(Rule {
            id,
            filter,
            action,
            remaining,
            probability,
        });
        id
    }

    pub(crate) fn decide(
        &self,
        record: &RequestRecord,
        resource: Option<&GroupResource>,
    ) -> Decision {
        let mut decision = Decision::default();
        let mut inner = self.inner.lock();
        let Rules {
            rules,
            rng,
            touches,
            ..
        } = &mut *inner;
        for rule in rules.iter_mut() {
            if rule.remaining == Some(0) || !rule.filter.matches_record(record) {
                continue;
            }
            let targets_object = record.verb.is_write() && record.name.is_some();
            let applies = match &rule.action {
                Action::Latency(_) => true,
                Action::Annotate { .. } | Action::Conflict => {
                    targets_object && decision.error.is_none()
                }
                Action::Fail(_) => decision.error.is_none(),
                Action::RateLimit(_) => decision.throttled.is_none(),
            };
            if !applies || (rule.probability < 1.0 && rng.next_f64() >= rule.probability) {
                continue;
            }
            match &mut rule.action {
                Action::Latency(d) => decision.latency += *d,
                Action::Annotate { key, value } => {
                    *touches += 1;
                    let value = value.clone().unwrap_or_else(|| touches.to_string());
                    decision.annotations.push((key.clone(), value));
                }
                Action::Conflict => {
                    decision.error = Some(ApiError::Conflict {
                        resource: resource.cloned().unwrap_or_else(|| GroupResource {
                            group: record.group.clone(),
                            resource: record.resource.clone(),
                        }),
                        name: record.name.clone().unwrap_or_default(),
                        cause: Box::new(ConflictCause::Modified),
                    });
                }
                Action::Fail(failure) => {
                    decision.error = Some(ApiError::Injected { failure: *failure });
                }
                Action::RateLimit(bucket) => decision.throttled = bucket.take(),
            }
            if let Some(n) = &mut rule.remaining {
                *n -= 1;
            }
        }
        rules.retain(|r| r.remaining != Some(0));
        decision
    }
}

/// The annotation [`Faults::touch_before_write`] sets.
pub const TOUCH_ANNOTATION: &str = "fake-apiserver.census.dev/touched";

/// A handle to inject faults into a running server; cheap to clone.
#[derive(Clone)]
pub struct Faults {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults").finish_non_exhaustive()
    }
}

impl Faults {
    fn state(&self) -> &FaultState {
        &self.shared.faults
    }

    /// Answer the next `times` matching writes with 409 Conflict
    /// ("the object has been modified"), without changing anything.
    pub fn conflict_next(&self, filter: RequestFilter, times: u32) -> FaultId {
        self.state().add(filter, Action::Conflict, Some(times), 1.0)
    }

    /// Right before each of the next `times` matching writes, set the
    /// [`TOUCH_ANNOTATION`] annotation on the target object (a new
    /// resourceVersion and a MODIFIED event), so that the write's
    /// resourceVersion or precondition really is stale.
    pub fn touch_before_write(&self, filter: RequestFilter, times: u32) -> FaultId {
        let action = Action::Annotate {
            key: TOUCH_ANNOTATION.to_owned(),
            value: None,
        };
        self.state().add(filter, action, Some(times), 1.0)
    }

    /// Like [`Faults::touch_before_write`] with a chosen annotation.
    pub fn annotate_before_write(
        &self,
        filter: RequestFilter,
        key: &str,
        value: &str,
        times: u32,
    ) -> FaultId {
        let action = Action::Annotate {
            key: key.to_owned(),
            value: Some(value.to_owned()),
        };
        self.state().add(filter, action, Some(times), 1.0)
    }

    /// Fail the next `times` matching requests.
    pub fn fail_next(&self, filter: RequestFilter, times: u32, failure: Failure) -> FaultId {
        self.state()
            .add(filter, Action::Fail(failure), Some(times), 1.0)
    }

    /// Fail a fraction (0..=1) of matching requests, drawn from the seeded RNG.
    pub fn fail_fraction(&self, filter: RequestFilter, fraction: f64, failure: Failure) -> FaultId {
        self.state().add(
            filter,
            Action::Fail(failure),
            None,
            fraction.clamp(0.0, 1.0),
        )
    }

    /// Limit the rate of matching requests, as the API server's priority and
    /// fairness filter does: over the limit, 429 with `Retry-After` and the
    /// filter's plain-text body, before anything else (see [`RateLimit`]).
    pub fn limit_rate(&self, filter: RequestFilter, limit: RateLimit) -> FaultId {
        self.state()
            .add(filter, Action::RateLimit(Bucket::new(limit)), None, 1.0)
    }

    /// Delay matching requests (for a watch: its start).
    pub fn delay(&self, filter: RequestFilter, latency: Duration) -> FaultId {
        self.state()
            .add(filter, Action::Latency(latency), None, 1.0)
    }

    /// Remove one fault.
    pub fn remove(&self, id: FaultId) {
        self.state().inner.lock().rules.retain(|r| r.id != id);
    }

    /// Remove every fault (outages and dropped watches are not undone).
    pub fn clear(&self) {
        self.state().inner.lock().rules.clear();
    }

    /// Restart the fault RNG from a seed.
    pub fn reseed(&self, seed: u64) {
        self.state().inner.lock().rng = SplitMix64::new(seed);
    }

    /// Take the server down until [`Faults::come_up`].
    pub fn go_down(&self, mode: DownMode) {
        tracing::info!(?mode, "fake apiserver going down");
        let availability = match mode {
            DownMode::Refuse => Availability::Refusing,
            DownMode::Hang => Availability::Hanging,
        };
        self.shared.availability.send_replace(availability);
        if mode == DownMode::Refuse {
            self.shared.conn_epoch.send_modify(|e| *e += 1);
        }
    }

    /// Serve again, on the same address.
    pub fn come_up(&self) {
        tracing::info!("fake apiserver coming up");
        self.shared.availability.send_replace(Availability::Up);
    }

    /// Abort every open watch mid-stream (the connection closes, as when an
    /// API server restarts); clients must resume or re-list.
    pub fn drop_watches(&self) {
        self.shared.watch_epoch.send_modify(|e| *e += 1);
    }

    /// Forget all history: watch resumes and `continue` tokens from before
    /// now get 410 Gone; open watches go on.
    pub fn compact(&self) {
        self.shared.store.lock().compact();
    }
}
