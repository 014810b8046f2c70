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
//!   and the real per-resource field selectors (others are 400);
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
//! - fault injection ([`Faults`]), a request log ([`Requests`]) and direct
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
//! Not modelled (tests that need these belong on a real cluster, `#[ignore]`d):
//! admission, defaulting and schema validation beyond names; strategic merge
//! list semantics (merge keys, `$patch`) and server-side apply field
//! ownership (no managedFields, no apply conflicts, omitted fields are not
//! removed); immutable fields (e.g. a pod's `spec.nodeName`); graceful
//! deletion (pods go at once, no kubelet); `propagationPolicy`, owner
//! references and the garbage collector; `dryRun` (refused with 400);
//! authentication and RBAC; Table and protobuf encodings; CRD version
//! conversion (each served version is its own store); core and
//! `events.k8s.io` Events are separate stores.

#![forbid(unsafe_code)]

mod error;
mod faults;
mod http;
mod log;
mod object;
mod patch;
mod resource;
mod rng;
mod route;
mod selector;
mod server;
mod store;
mod watch;

pub use error::{ApiError, ConflictCause, Error, Invalidity};
pub use faults::{DownMode, Failure, FaultId, Faults, RequestFilter, TOUCH_ANNOTATION};
pub use log::{RequestRecord, Requests, Verb};
pub use patch::PatchError;
pub use resource::{GroupResource, Gvr, ResourceSpec};
pub use selector::SelectorError;
pub use server::{FakeApiServer, ServerConfig};
