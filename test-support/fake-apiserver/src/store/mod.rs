//! The object store: every object of every resource, one global
//! resourceVersion counter (like etcd's revision), a bounded history of
//! changes for watch resumption, and the write semantics of the real API
//! server (optimistic concurrency, preconditions, finalizers, status).
//!
//! `write` holds the API's write rules, `read` lists and watch starts,
//! `direct` the test-facing seeding and edits.

mod admit;
mod direct;
mod graceful;
mod read;
mod write;

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    ops::Bound,
    sync::Arc,
};

use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::{
    error::{ApiError, ConflictCause, Error, Invalidity},
    object::{self, meta_str, remove_meta, set_meta},
    patch::{self, PatchKind},
    resource::{self, CRD_GROUP, CRD_PLURAL, Gvr, INITIAL_NAMESPACES, ResourceSpec},
    rng::SplitMix64,
    selector::{FieldSelector, LabelSelector},
};

pub(crate) type Obj = Arc<Value>;

/// Objects sort as etcd keys do: by namespace, then name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct ObjKey {
    pub(crate) namespace: String,
    pub(crate) name: String,
}

impl ObjKey {
    pub(crate) fn new(namespace: &str, name: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ChangeKind {
    Added,
    Modified,
    Deleted,
}

/// One committed write. For deletions `object` is the last state with the
/// deletion's resourceVersion, as the real watch sends it.
#[derive(Debug)]
pub(crate) struct Change {
    pub(crate) rv: u64,
    pub(crate) res: usize,
    pub(crate) key: ObjKey,
    pub(crate) kind: ChangeKind,
    pub(crate) object: Obj,
    pub(crate) prev: Option<Obj>,
}

#[derive(Debug)]
struct Resource {
    spec: ResourceSpec,
    builtin: bool,
    active: bool,
    objects: BTreeMap<ObjKey, Obj>,
}

#[derive(Debug)]
struct WatchSlot {
    res: usize,
    tx: mpsc::Sender<Arc<Change>>,
}

/// Which subresource a write addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sub {
    Main,
    Status,
}

/// Delete preconditions from `DeleteOptions.preconditions`, and its grace period.
#[derive(Clone, Debug, Default)]
pub(crate) struct Preconditions {
    pub(crate) uid: Option<String>,
    pub(crate) resource_version: Option<String>,
    /// `gracePeriodSeconds` of the DELETE (query or body), for pods.
    pub(crate) grace_period_seconds: Option<i64>,
}

pub(crate) enum DeleteOutcome {
    /// The object is gone; this is its last state.
    Gone(Obj),
    /// Finalizers hold it; this is the object with `deletionTimestamp` set.
    Pending(Obj),
}

/// Which state a list reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadVersion {
    Latest,
    NotOlderThan(u64),
    Exact(u64),
}

pub(crate) struct ListQuery<'a> {
    pub(crate) label: &'a LabelSelector,
    pub(crate) field: &'a FieldSelector,
    pub(crate) limit: Option<usize>,
    pub(crate) continue_token: Option<&'a str>,
    pub(crate) version: ReadVersion,
}

pub(crate) struct ListPage {
    pub(crate) items: Vec<Obj>,
    pub(crate) rv: u64,
    pub(crate) continue_token: Option<String>,
    pub(crate) remaining: Option<u64>,
}

/// Where a watch starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WatchFrom {
    /// `resourceVersion` unset or `0`: synthetic ADDED events for the current
    /// state, then changes.
    Current,
    /// Changes after this resourceVersion.
    After(u64),
}

pub(crate) struct WatchOpen {
    pub(crate) initial: Vec<Obj>,
    pub(crate) replay: Vec<Arc<Change>>,
    pub(crate) rx: mpsc::Receiver<Arc<Change>>,
    pub(crate) rv: u64,
}

#[derive(Debug)]
pub(crate) struct Store {
    rv: u64,
    compacted: u64,
    history: VecDeque<Arc<Change>>,
    history_limit: usize,
    watch_buffer: usize,
    resources: Vec<Resource>,
    index: HashMap<Gvr, usize>,
    watchers: Vec<WatchSlot>,
    rng: SplitMix64,
    pub(crate) admission: admit::AdmissionState,
}

fn matches(spec: &ResourceSpec, label: &LabelSelector, field: &FieldSelector, obj: &Value) -> bool {
    label.matches(object::labels(obj)) && field.matches(spec, obj)
}

impl Store {
    pub(crate) fn new(history_limit: usize, watch_buffer: usize, seed: u64) -> Self {
        let mut store = Self {
            rv: 0,
            compacted: 0,
            history: VecDeque::new(),
            history_limit: history_limit.max(1),
            watch_buffer: watch_buffer.max(1),
            resources: Vec::new(),
            index: HashMap::new(),
            watchers: Vec::new(),
            rng: SplitMix64::new(seed ^ 0x6B75_6265),
            admission: admit::AdmissionState::default(),
        };
        for spec in resource::builtins() {
            let res = store.register(spec);
            store.resources[res].builtin = true;
        }
        for ns in INITIAL_NAMESPACES {
            let body = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
            // Seeding a fresh store cannot conflict.
            let _ = store.seed(body);
        }
        store
    }

    pub(crate) fn rv(&self) -> u64 {
        self.rv
    }

    /// Serve a resource (again); returns its index.
    pub(crate) fn register(&mut self, spec: ResourceSpec) -> usize {
        let gvr = spec.gvr();
        if let Some(&res) = self.index.get(&gvr) {
            let r = &mut self.resources[res];
            r.active = true;
            r.spec = spec;
            return res;
        }
        self.resources.push(Resource {
            spec,
            builtin: false,
            active: true,
            objects: BTreeMap::new(),
        });
        let res = self.resources.len() - 1;
        self.index.insert(gvr, res);
        res
    }

    pub(crate) fn resolve(&self, gvr: &Gvr) -> Option<usize> {
        self.index
            .get(gvr)
            .copied()
            .filter(|&r| self.resources[r].active)
    }

    fn resolve_kind(&self, api_version: &str, kind: &str) -> Option<usize> {
        let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
        self.resources.iter().position(|r| {
            r.active && r.spec.group == group && r.spec.version == version && r.spec.kind == kind
        })
    }

    pub(crate) fn spec(&self, res: usize) -> &ResourceSpec {
        &self.resources[res].spec
    }

    pub(crate) fn active_specs(&self) -> Vec<&ResourceSpec> {
        self.resources
            .iter()
            .filter(|r| r.active)
            .map(|r| &r.spec)
            .collect()
    }

    fn not_found(&self, res: usize, name: &str) -> ApiError {
        ApiError::NotFound {
            resource: self.spec(res).group_resource(),
            name: name.to_owned(),
        }
    }

    fn conflict(&self, res: usize, name: &str, cause: ConflictCause) -> ApiError {
        ApiError::Conflict {
            resource: self.spec(res).group_resource(),
            name: name.to_owned(),
            cause: Box::new(cause),
        }
    }

    fn invalid(&self, res: usize, name: &str, cause: Invalidity) -> ApiError {
        ApiError::Invalid {
            kind: self.spec(res).kind.clone(),
            name: name.to_owned(),
            cause,
        }
    }

    pub(crate) fn get(&self, res: usize, key: &ObjKey) -> Result<Obj, ApiError> {
        self.resources[res]
            .objects
            .get(key)
            .cloned()
            .ok_or_else(|| self.not_found(res, &key.name))
    }

    pub(crate) fn count(&self, res: usize) -> usize {
        self.resources[res].objects.len()
    }

    pub(crate) fn all(&self, res: usize) -> Vec<Obj> {
        self.resources[res].objects.values().cloned().collect()
    }

    // ---- committing ----------------------------------------------------

    fn record(&mut self, change: Change) {
        let change = Arc::new(change);
        self.watchers.retain(|w| {
            // A watcher too slow to drain its buffer is closed, as the real
            // watch cache does; the client resumes from its last version.
            w.res != change.res || w.tx.try_send(Arc::clone(&change)).is_ok()
        });
        self.history.push_back(change);
        while self.history.len() > self.history_limit {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
    }

    fn commit_put(&mut self, res: usize, key: ObjKey, mut obj: Value, prev: Option<Obj>) -> Obj {
        self.rv += 1;
        set_meta(
            &mut obj,
            "resourceVersion",
            Value::String(self.rv.to_string()),
        );
        let obj = Arc::new(obj);
        self.resources[res]
            .objects
            .insert(key.clone(), Arc::clone(&obj));
        let kind = if prev.is_some() {
            ChangeKind::Modified
        } else {
            ChangeKind::Added
        };
        self.record(Change {
            rv: self.rv,
            res,
            key,
            kind,
            object: Arc::clone(&obj),
            prev,
        });
        obj
    }

    fn commit_delete(&mut self, res: usize, key: &ObjKey, mut last: Value) -> Obj {
        self.rv += 1;
        set_meta(
            &mut last,
            "resourceVersion",
            Value::String(self.rv.to_string()),
        );
        let last = Arc::new(last);
        let prev = self.resources[res].objects.remove(key);
        self.record(Change {
            rv: self.rv,
            res,
            key: key.clone(),
            kind: ChangeKind::Deleted,
            object: Arc::clone(&last),
            prev,
        });
        self.after_delete(res, key);
        last
    }

    /// Cascades the real server performs (through controllers) when a
    /// namespace or a CRD goes away: their objects go too.
    fn after_delete(&mut self, res: usize, key: &ObjKey) {
        let spec = self.spec(res).clone();
        let doomed: Vec<(usize, ObjKey)> = if spec.group.is_empty() && spec.plural == "namespaces" {
            self.resources
                .iter()
                .enumerate()
                .filter(|(_, r)| r.spec.namespaced)
                .flat_map(|(i, r)| {
                    r.objects
                        .keys()
                        .filter(|k| k.namespace == key.name)
                        .map(move |k| (i, k.clone()))
                })
                .collect()
        } else if spec.group == CRD_GROUP && spec.plural == CRD_PLURAL {
            let Some((plural, group)) = key.name.split_once('.') else {
                return;
            };
            let served: Vec<usize> = self
                .resources
                .iter()
                .enumerate()
                .filter(|(_, r)| !r.builtin && r.spec.group == group && r.spec.plural == plural)
                .map(|(i, _)| i)
                .collect();
            let doomed = served
                .iter()
                .flat_map(|&i| {
                    self.resources[i]
                        .objects
                        .keys()
                        .map(move |k| (i, k.clone()))
                })
                .collect();
            for i in served {
                self.resources[i].active = false;
            }
            doomed
        } else {
            return;
        };
        for (r, k) in doomed {
            if let Some(obj) = self.resources[r].objects.get(&k) {
                let last = (**obj).clone();
                self.commit_delete(r, &k, last);
            }
        }
    }

    fn after_put(&mut self, res: usize, obj: &Value) {
        let spec = self.spec(res);
        if spec.group == CRD_GROUP && spec.plural == CRD_PLURAL {
            for s in resource::specs_from_crd(obj) {
                self.register(s);
            }
        }
    }

    /// Drop all history: resumes from before now get 410 Gone.
    pub(crate) fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }
}

#[cfg(test)]
mod tests {
    use super::{
        read::{continue_decode, continue_encode},
        *,
    };

    fn cm(name: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "default"}})
    }

    #[test]
    fn continue_token_round_trips() {
        let key = ObjKey::new("ns", "a");
        assert_eq!(continue_decode(&continue_encode(7, &key)), Some((7, key)));
        assert_eq!(continue_decode("zz"), None);
    }

    #[test]
    fn paged_list_is_a_consistent_snapshot() -> Result<(), Box<dyn std::error::Error>> {
        let mut store = Store::new(100, 10, 0);
        let res = store
            .resolve(&Gvr::new("", "v1", "configmaps"))
            .ok_or("no configmaps")?;
        for i in 0..5 {
            store.seed(cm(&format!("cm-{i}")))?;
        }
        let (label, field) = (LabelSelector::default(), FieldSelector::default());
        let q = |token| ListQuery {
            label: &label,
            field: &field,
            limit: Some(2),
            continue_token: token,
            version: ReadVersion::Latest,
        };
        let first = store.list(res, Some("default"), &q(None))?;
        assert_eq!(first.items.len(), 2);
        assert_eq!(first.remaining, Some(3));
        // Changes after the first page do not show in later pages.
        store
            .remove(res, &ObjKey::new("default", "cm-3"))
            .ok_or("cm-3 missing")?;
        store.seed(cm("cm-9"))?;
        let token = first.continue_token.ok_or("no continue")?;
        let second = store.list(res, Some("default"), &q(Some(&token)))?;
        let names: Vec<_> = second
            .items
            .iter()
            .filter_map(|o| meta_str(o, "name"))
            .collect();
        assert_eq!(names, ["cm-2", "cm-3"]);
        assert_eq!(second.rv, first.rv);
        store.compact();
        let token = second.continue_token.ok_or("no continue")?;
        assert!(matches!(
            store.list(res, Some("default"), &q(Some(&token))),
            Err(ApiError::ContinueExpired)
        ));
        Ok(())
    }

    #[test]
    fn bounded_history_compacts_the_oldest_changes() -> Result<(), Box<dyn std::error::Error>> {
        let mut store = Store::new(3, 10, 0);
        let res = store
            .resolve(&Gvr::new("", "v1", "configmaps"))
            .ok_or("no configmaps")?;
        let start = store.rv();
        for i in 0..5 {
            store.seed(cm(&format!("cm-{i}")))?;
        }
        let (label, field) = (LabelSelector::default(), FieldSelector::default());
        let too_old = store.watch_open(res, None, WatchFrom::After(start), false, &label, &field);
        assert!(matches!(
            too_old,
            Err(ApiError::TooOldResourceVersion { .. })
        ));
        let recent = store.watch_open(
            res,
            None,
            WatchFrom::After(store.rv() - 2),
            false,
            &label,
            &field,
        )?;
        assert_eq!(recent.replay.len(), 2);
        Ok(())
    }
}
