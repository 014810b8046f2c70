//! A fake Kubernetes API server for census's tests.
//!
//! No real API server runs on the machines census is built on, so its
//! Kubernetes code (the Identity CRD store, GC with preconditions, leader
//! election on a Lease, the Node watch, the agent's `spec.nodeName` pod watch)
//! is tested against this server. It speaks the real HTTP/JSON API over
//! loopback closely enough for a real `kube::Client` and
//! `kube::runtime::watcher` (kube 5, k8s-openapi 0.29):
//!
//! - one store for any group/version/resource, namespaced or cluster-scoped;
//!   core resources are pre-registered, creating a CustomResourceDefinition
//!   registers its resource (and marks it Established), and
//!   [`FakeApiServer::register_resource`] adds one directly;
//! - one global resourceVersion (like etcd's revision); `uid`,
//!   `creationTimestamp`, `generation` (spec changes only) as the real server;
//! - list with `limit`/`continue` (pages read one snapshot; a compacted one is
//!   410 Expired), `resourceVersion`/`resourceVersionMatch`, label selectors
//!   and the real per-resource field selectors (others are 400); which layer
//!   would serve each list (the watch cache or etcd, as `shouldDelegateList`
//!   decides; `resourceVersion=0` ignores `limit`) is in the request log
//!   ([`ListSource`]);
//! - watch with history replay from a resourceVersion, synthetic ADDED for
//!   `resourceVersion` unset or `0`, selector transitions (an object that stops
//!   matching is DELETED, one that starts is ADDED), periodic BOOKMARKs,
//!   streaming lists (`sendInitialEvents` with the `k8s.io/initial-events-end`
//!   bookmark), `timeoutSeconds`, and the in-stream ERROR with a 410 Status
//!   for a resume below the retained history;
//! - create/update/patch/delete with the real `Status` errors: 409
//!   AlreadyExists, 409 Conflict on a stale resourceVersion and on delete
//!   preconditions, 404, 422; finalizers and `deletionTimestamp`; `/status`;
//!   merge, JSON, strategic (as merge, built-in kinds only) and apply (as
//!   merge, creating when missing) patches; `generateName`;
//! - Event validation on create, as `ValidateEventCreate`: an Event about an
//!   object without a namespace (cluster-scoped) only in `default` or
//!   `kube-system` (422 Invalid elsewhere), `eventTime` required by
//!   `events.k8s.io/v1`;
//! - graceful deletion of pods: `deletionTimestamp` and
//!   `deletionGracePeriodSeconds` from `gracePeriodSeconds` or
//!   `spec.terminationGracePeriodSeconds` (30 by default), the pod kept (with its
//!   IP) until a stand-in kubelet confirms at the end of the period or a test
//!   does ([`FakeApiServer::confirm_pod_deletion`]); grace 0, unscheduled and
//!   finished pods go at once; [`FakeApiServer::end_pod`] moves a pod to
//!   Succeeded or Failed;
//! - fault injection ([`Faults`], including a request-rate limit answered as
//!   the priority and fairness filter does: 429, `Retry-After`, plain text),
//!   a request log ([`Requests`]) and direct
//!   seeding ([`FakeApiServer::insert_many`] and friends).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use census_fake_apiserver::{FakeApiServer, Gvr, RequestFilter, ResourceSpec, Verb};
//! use k8s_openapi::api::{coordination::v1::Lease, core::v1::Pod};
//!
//! let server = FakeApiServer::start().await?;
//! let client = server.client()?; // or server.write_kubeconfig(path) for a process
//! server.register_resource(
//!     ResourceSpec::cluster("census.dev", "v1", "Identity", "identities").with_status(),
//! );
//! server.insert(serde_json::json!({
//!     "apiVersion": "census.dev/v1", "kind": "Identity",
//!     "metadata": {"name": "4711"}, "spec": {"labels": {"app": "web"}},
//! }))?;
//! // The next delete of identity 4711 gets 409, as if someone wrote first.
//! let id = Gvr::new("census.dev", "v1", "identities");
//! server.faults().conflict_next(RequestFilter::object(&id, None, "4711").verb(Verb::Delete), 1);
//! server.faults().drop_watches();
//! let leases: kube::Api<Lease> = kube::Api::namespaced(client, "kube-system");
//! # let _ = leases;
//! let watches = server.requests().watches_of("pods");
//! assert!(watches.iter().all(|w| w.field_selector.as_deref() == Some("spec.nodeName=n1")));
//! # let _ = Gvr::of::<Pod>();
//! # Ok(()) }
//! ```
//!
//! `TokenReview` answers for bound ServiceAccount tokens issued with
//! [`FakeApiServer::issue_token`], as the real authenticator does (audiences,
//! expiry, the bound pod still existing, the node in the user's `extra` from
//! v1.30), authorized by the RBAC objects in the store (`tokenreview`).
//!
//! Custom resources are validated against their CRD's schema and CEL rules
//! (`validation`), ValidatingAdmissionPolicies are enforced for the user a
//! bearer token or impersonation names (`admission`), and `/openapi/v3` has
//! what kubectl needs (`openapi`).
//!
//! Not modelled (tests that need these belong on a real cluster, `#[ignore]`d):
//! mutating admission, defaulting, pruning, built-in kinds' schema validation
//! beyond names, the CEL cost budget; strategic merge
//! list semantics (merge keys, `$patch`) and server-side apply field
//! ownership (no managedFields, no apply conflicts, omitted fields are not
//! removed); immutable fields (e.g. a pod's `spec.nodeName`); a real kubelet
//! (phases, IPs and the end of a graceful deletion are set by tests or by the
//! stand-in timer; a pod whose node is gone is not collected); priority and
//! fairness beyond a plain rate limit (no flow schemas, no queueing, no
//! `X-Kubernetes-PF-*` headers); consistent lists from the watch cache
//! (`ConsistentListFromCache`: the fake answers as a v1.30 server does, a list
//! without resourceVersion is an etcd read); `propagationPolicy`, owner
//! references and the garbage collector; `dryRun` (refused with 400);
//! RBAC beyond TokenReviews (who may impersonate, anything else); Table and protobuf encodings; CRD version
//! conversion (each served version is its own store); core and
//! `events.k8s.io` Events are separate stores.

#![forbid(unsafe_code)]

mod admission;
mod error;
mod events;
mod faults;
mod http;
mod kubelet;
mod log;
mod object;
mod openapi;
mod patch;
mod pods;
mod ratelimit;
mod resource;
mod rng;
mod route;
mod selector;
mod server;
mod store;
mod tokenreview;
mod validation;
mod watch;

pub use error::{ApiError, ConflictCause, Error, Invalidity};
pub use faults::{DownMode, Failure, FaultId, Faults, RequestFilter, TOUCH_ANNOTATION};
pub use log::{ListSource, RequestRecord, Requests, Verb};
pub use patch::PatchError;
pub use pods::PodEnd;
pub use ratelimit::RateLimit;
pub use resource::{GroupResource, Gvr, ResourceSpec};
pub use selector::SelectorError;
pub use server::{FakeApiServer, ServerConfig};
pub use tokenreview::{API_AUDIENCE, TokenRequest};
pub use validation::FieldCause;
