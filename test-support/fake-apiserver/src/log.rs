//! The request log: every request the server answered, for tests to assert on.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::faults::RequestFilter;

/// The Kubernetes verb of a request (as in audit logs and RBAC).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Verb {
    /// GET of one object.
    Get,
    /// GET of a collection.
    List,
    /// GET of a collection with `watch=true`.
    Watch,
    /// POST.
    Create,
    /// PUT.
    Update,
    /// PATCH (any patch type, including server-side apply).
    Patch,
    /// DELETE of one object.
    Delete,
    /// DELETE of a collection.
    DeleteCollection,
    /// Discovery, version and health endpoints.
    Discovery,
    /// Anything else (answered 404 or 405).
    Other,
}

impl Verb {
    /// The lower-case name (`get`, `list`, `watch`, ..., `deletecollection`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::List => "list",
            Self::Watch => "watch",
            Self::Create => "create",
            Self::Update => "update",
            Self::Patch => "patch",
            Self::Delete => "delete",
            Self::DeleteCollection => "deletecollection",
            Self::Discovery => "discovery",
            Self::Other => "other",
        }
    }

    /// Whether the verb changes state.
    pub fn is_write(self) -> bool {
        matches!(
            self,
            Self::Create | Self::Update | Self::Patch | Self::Delete | Self::DeleteCollection
        )
    }
}

/// Which layer of the API server answered a list, as the real one decides
/// (k8s.io/apiserver `storage/cacher`, `shouldDelegateList`; see the list
/// handler for the rules the fake follows).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ListSource {
    /// The watch cache, in the API server's memory: no etcd read.
    Cache,
    /// Storage (etcd): a range read over every object of the resource.
    Storage,
}

impl ListSource {
    /// `cache` or `storage`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cache => "cache",
            Self::Storage => "storage",
        }
    }
}

/// One answered request.
#[derive(Clone, Debug)]
pub struct RequestRecord {
    /// HTTP method.
    pub method: http::Method,
    /// Request path, without the query.
    pub path: String,
    /// Kubernetes verb.
    pub verb: Verb,
    /// API group (empty for core and for non-resource paths).
    pub group: String,
    /// API version.
    pub version: String,
    /// Plural resource name (empty for non-resource paths).
    pub resource: String,
    /// Subresource, e.g. `status`.
    pub subresource: Option<String>,
    /// Namespace from the path.
    pub namespace: Option<String>,
    /// Object name from the path.
    pub name: Option<String>,
    /// `labelSelector` query parameter.
    pub label_selector: Option<String>,
    /// `fieldSelector` query parameter.
    pub field_selector: Option<String>,
    /// All query parameters, in order.
    pub query: Vec<(String, String)>,
    /// `Content-Type` of a PATCH.
    pub patch_type: Option<String>,
    /// HTTP status code answered (200 for a watch that started).
    pub code: u16,
    /// Whether a fault injected the answer.
    pub injected: bool,
    /// When the request arrived.
    pub at: Instant,
    /// How long the server took to answer (to start a watch stream).
    pub took: Duration,
    /// For a list that was answered 200: which layer served it.
    pub list_source: Option<ListSource>,
}

impl RequestRecord {
    /// A query parameter's value.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A snapshot of the request log.
#[derive(Clone, Debug, Default)]
pub struct Requests {
    records: Vec<RequestRecord>,
}

impl Requests {
    /// All records, oldest first.
    pub fn all(&self) -> &[RequestRecord] {
        &self.records
    }

    /// Iterate over the records, oldest first.
    pub fn iter(&self) -> std::slice::Iter<'_, RequestRecord> {
        self.records.iter()
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether no request was logged.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Records satisfying a predicate (copies, so a temporary snapshot will do).
    pub fn filter(&self, pred: impl Fn(&RequestRecord) -> bool) -> Vec<RequestRecord> {
        self.records.iter().filter(|r| pred(r)).cloned().collect()
    }

    /// Records matching a [`RequestFilter`].
    pub fn matching(&self, filter: &RequestFilter) -> Vec<RequestRecord> {
        self.filter(|r| filter.matches_record(r))
    }

    /// Records of one verb on one (plural) resource.
    pub fn of(&self, verb: Verb, resource: &str) -> Vec<RequestRecord> {
        self.filter(|r| r.verb == verb && r.resource == resource)
    }

    /// Watches of a (plural) resource, e.g. `watches_of("pods")`.
    pub fn watches_of(&self, resource: &str) -> Vec<RequestRecord> {
        self.of(Verb::Watch, resource)
    }

    /// Lists of a (plural) resource.
    pub fn lists_of(&self, resource: &str) -> Vec<RequestRecord> {
        self.of(Verb::List, resource)
    }

    /// Lists of a (plural) resource that storage (etcd) served.
    pub fn storage_lists_of(&self, resource: &str) -> Vec<RequestRecord> {
        self.filter(|r| {
            r.verb == Verb::List
                && r.resource == resource
                && r.list_source == Some(ListSource::Storage)
        })
    }

    /// Writes (create, update, patch, delete, deletecollection) of a resource.
    pub fn writes_of(&self, resource: &str) -> Vec<RequestRecord> {
        self.filter(|r| r.verb.is_write() && r.resource == resource)
    }
}

impl<'a> IntoIterator for &'a Requests {
    type Item = &'a RequestRecord;
    type IntoIter = std::slice::Iter<'a, RequestRecord>;

    fn into_iter(self) -> Self::IntoIter {
        self.records.iter()
    }
}

#[derive(Debug)]
pub(crate) struct RequestLog {
    records: Mutex<Vec<RequestRecord>>,
    appended: watch::Sender<usize>,
}

impl RequestLog {
    pub(crate) fn new() -> Self {
        Self {
            records: Mutex::new(Vec::new()),
            appended: watch::Sender::new(0),
        }
    }

    pub(crate) fn push(&self, record: RequestRecord) {
        tracing::debug!(
            verb = record.verb.as_str(),
            path = %record.path,
            code = record.code,
            "fake apiserver request"
        );
        let len = {
            let mut records = self.records.lock();
            records.push(record);
            records.len()
        };
        self.appended.send_replace(len);
    }

    pub(crate) fn snapshot(&self) -> Requests {
        Requests {
            records: self.records.lock().clone(),
        }
    }

    pub(crate) fn clear(&self) {
        self.records.lock().clear();
    }

    /// Wait until a logged request satisfies `pred` (one already logged
    /// counts), or the timeout passes.
    pub(crate) async fn wait_for(
        &self,
        pred: impl Fn(&RequestRecord) -> bool,
        timeout: Duration,
    ) -> Option<RequestRecord> {
        let mut rx = self.appended.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(found) = self.records.lock().iter().find(|r| pred(r)) {
                return Some(found.clone());
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return None,
            }
        }
    }
}
