//! Errors: [`ApiError`] is what the HTTP API answers (as a `Status` object),
//! [`Error`] is what the library's own methods return.

use std::{io, net::SocketAddr, path::PathBuf};

use serde_json::{Value, json};

use crate::{
    faults::Failure,
    patch::PatchError,
    resource::{GroupResource, Gvr},
    selector::SelectorError,
};

/// A failure the API answers with a `Status` object, worded like the real API
/// server's so that `kube::Error::Api` carries the same code and reason.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// 404 for a missing object.
    #[error("{resource} \"{name}\" not found")]
    NotFound {
        /// The resource the object was looked up in.
        resource: GroupResource,
        /// The object's name.
        name: String,
    },
    /// 404 for a URL that names no served resource.
    #[error("the server could not find the requested resource")]
    NoSuchResource,
    /// 409 on create of an existing name.
    #[error("{resource} \"{name}\" already exists")]
    AlreadyExists {
        /// The resource written to.
        resource: GroupResource,
        /// The object's name.
        name: String,
    },
    /// 409 on a failed optimistic-concurrency check or delete precondition.
    #[error("Operation cannot be fulfilled on {resource} \"{name}\": {cause}")]
    Conflict {
        /// The resource written to.
        resource: GroupResource,
        /// The object's name.
        name: String,
        /// Which check failed.
        cause: Box<ConflictCause>,
    },
    /// 400 for a label or field selector that does not parse.
    #[error("{source}")]
    BadSelector {
        /// The parse failure.
        #[from]
        source: SelectorError,
    },
    /// 400 for a field selector on a field the resource does not index.
    #[error("field label not supported: {field}")]
    UnsupportedField {
        /// The field label.
        field: String,
    },
    /// 400 when the body names another object than the URL.
    #[error("the name of the object ({body}) does not match the name on the URL ({url})")]
    NameMismatch {
        /// Name in the body.
        body: String,
        /// Name in the URL.
        url: String,
    },
    /// 400 when the body's namespace differs from the URL's.
    #[error(
        "the namespace of the provided object does not match the namespace sent on the request"
    )]
    NamespaceMismatch,
    /// 400 for a body that is not JSON.
    #[error("the body of the request could not be decoded: {source}")]
    InvalidJson {
        /// The decoding failure.
        source: serde_json::Error,
    },
    /// 400 for a body that is JSON but not an object with metadata.
    #[error("the body of the request is not a Kubernetes object")]
    NotAnObject,
    /// 400 for a query parameter that does not parse.
    #[error("invalid value {value:?} for query parameter {name}")]
    InvalidParam {
        /// The parameter.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// 400 for a `continue` token the server did not issue.
    #[error("continue key is not valid: {token}")]
    InvalidContinue {
        /// The token.
        token: String,
    },
    /// 400 for `continue` together with a (non-zero) `resourceVersion`.
    #[error("specifying resource version is not allowed when using continue")]
    VersionWithContinue,
    /// 400: the fake does not implement dry runs and will not pretend to.
    #[error("dryRun is not supported by the fake API server")]
    DryRunUnsupported,
    /// 422 for an object or request options that fail validation.
    #[error("{kind} \"{name}\" is invalid: {cause}")]
    Invalid {
        /// Kind of the invalid thing (an object kind or an options kind).
        kind: String,
        /// Its name.
        name: String,
        /// What is wrong.
        cause: Invalidity,
    },
    /// 422 for an object that fails its CRD's schema or validation rules:
    /// one cause per field error, as `details.causes`.
    #[error(
        "{kind}.{group} \"{name}\" is invalid: {}",
        crate::validation::causes_text(causes)
    )]
    FieldsInvalid {
        /// The object's kind.
        kind: String,
        /// Its API group.
        group: String,
        /// Its name.
        name: String,
        /// The field errors.
        causes: Vec<crate::validation::FieldCause>,
    },
    /// 403 from admission (a ValidatingAdmissionPolicy that denies).
    #[error("{resource} \"{name}\" is forbidden: {message}")]
    Forbidden {
        /// The resource written to.
        resource: GroupResource,
        /// The object's name.
        name: String,
        /// Why, as the admission plugin words it.
        message: String,
    },
    /// 403 from RBAC (only TokenReviews are authorized; `tokenreview`).
    #[error("{resource} is forbidden: User \"{user}\" cannot {verb} resource \"{}\" in API group \"{}\" at the cluster scope", resource.resource, resource.group)]
    AccessDenied {
        /// The resource asked for.
        resource: GroupResource,
        /// Who asked.
        user: String,
        /// The verb refused.
        verb: &'static str,
    },
    /// 400 for a TokenReview without `spec.token`.
    #[error("token is required for TokenReview in authentication")]
    TokenRequired,
    /// 400 for a token requested for a pod that runs as another ServiceAccount.
    #[error(
        "cannot bind token for serviceaccount \"{service_account}\" to pod running with different serviceaccount name."
    )]
    TokenForOtherServiceAccount {
        /// The ServiceAccount the token was asked for.
        service_account: String,
    },
    /// 401 for a bearer token the server did not issue.
    #[error("Unauthorized")]
    Unauthorized,
    /// 422 for a patch that cannot be applied.
    #[error("the patch could not be applied: {source}")]
    PatchFailed {
        /// Why.
        #[from]
        source: PatchError,
    },
    /// 415 for a patch type the resource does not support.
    #[error(
        "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {content_type:?})"
    )]
    UnsupportedPatch {
        /// The request's content type.
        content_type: String,
    },
    /// 405 for a method the path does not support.
    #[error("the server does not allow this method on the requested resource")]
    MethodNotAllowed,
    /// 410 for a resume or exact read below the compacted revision.
    #[error("too old resource version: {requested} ({oldest})")]
    TooOldResourceVersion {
        /// The requested resourceVersion.
        requested: u64,
        /// The oldest one still available.
        oldest: u64,
    },
    /// 410 for a `continue` token whose snapshot was compacted.
    #[error(
        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter."
    )]
    ContinueExpired,
    /// 504 for a read at a resourceVersion the server has not reached.
    #[error("Too large resource version: {requested}, current resource version: {current}")]
    TooLargeResourceVersion {
        /// The requested resourceVersion.
        requested: u64,
        /// The server's.
        current: u64,
    },
    /// 500: the real server rejects a create that carries a resourceVersion.
    #[error("resourceVersion should not be set on objects to be created")]
    ResourceVersionOnCreate,
    /// An error injected by [`crate::Faults`].
    #[error("{}", failure.message())]
    Injected {
        /// What was injected.
        failure: Failure,
    },
}

/// Why a write conflicted.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConflictCause {
    /// The object's resourceVersion moved on.
    Modified,
    /// A delete precondition on the UID failed.
    UidPrecondition {
        /// The UID in the precondition.
        expected: String,
        /// The object's UID.
        actual: String,
    },
    /// A delete precondition on the resourceVersion failed.
    ResourceVersionPrecondition {
        /// The resourceVersion in the precondition.
        expected: String,
        /// The object's resourceVersion.
        actual: String,
    },
}

impl std::fmt::Display for ConflictCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Modified => f.write_str(
                "the object has been modified; please apply your changes to the latest version and try again",
            ),
            Self::UidPrecondition { expected, actual } => write!(
                f,
                "Precondition failed: UID in precondition: {expected}, UID in object meta: {actual}"
            ),
            Self::ResourceVersionPrecondition { expected, actual } => write!(
                f,
                "Precondition failed: ResourceVersion in precondition: {expected}, ResourceVersion in object meta: {actual}"
            ),
        }
    }
}

/// A validation failure, worded as `field: reason`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Invalidity {
    /// Neither `metadata.name` nor `metadata.generateName`.
    #[error("metadata.name: Required value: name or generateName is required")]
    NameRequired,
    /// A name that is not a DNS-1123 subdomain.
    #[error(
        "metadata.name: Invalid value: {0:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
    )]
    BadName(String),
    /// A `generateName` that is not a name prefix (it must end in an alphanumeric or
    /// `-`).
    #[error(
        "metadata.generateName: Invalid value: {0:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
    )]
    BadGenerateName(String),
    /// A label value the API server refuses (found against a real API server: the
    /// fake used to keep any string).
    #[error(
        "metadata.labels: Invalid value: {value:?}: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (label {key})"
    )]
    BadLabelValue { key: String, value: String },
    /// Adding a finalizer to an object that is being deleted.
    #[error(
        "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted"
    )]
    FinalizerWhileDeleting,
    /// An Event about an object without a namespace (cluster-scoped) outside the
    /// namespaces the API server allows for it, or about a namespaced object outside its
    /// namespace (see `events.rs`).
    #[error(
        "involvedObject.namespace: Invalid value: {involved:?}: does not match event.namespace"
    )]
    EventNamespace {
        /// The namespace of the Event's `regarding`/`involvedObject`.
        involved: String,
    },
    /// An `events.k8s.io/v1` Event without `eventTime`.
    #[error("eventTime: Required value")]
    EventTimeRequired,
    /// Server-side apply without a field manager.
    #[error("fieldManager: Required value: is required for apply patch")]
    FieldManagerRequired,
    /// `sendInitialEvents` without `allowWatchBookmarks`.
    #[error(
        "allowWatchBookmarks: Required value: sendInitialEvents requires setting allowWatchBookmarks=true"
    )]
    InitialEventsNeedBookmarks,
    /// `sendInitialEvents` with another `resourceVersionMatch` than NotOlderThan.
    #[error(
        "resourceVersionMatch: Unsupported value: sendInitialEvents requires setting resourceVersionMatch=NotOlderThan"
    )]
    InitialEventsNeedNotOlderThan,
    /// `resourceVersionMatch` on a watch without `sendInitialEvents`.
    #[error(
        "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided"
    )]
    MatchOnPlainWatch,
    /// `resourceVersionMatch` without `resourceVersion`.
    #[error(
        "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden unless resourceVersion is provided"
    )]
    MatchWithoutVersion,
    /// `resourceVersionMatch=Exact` with `resourceVersion=0`.
    #[error(
        "resourceVersionMatch: Forbidden: resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\""
    )]
    ExactWithZero,
    /// An unknown `resourceVersionMatch` value.
    #[error("resourceVersionMatch: Unsupported value: {0:?}")]
    UnknownMatch(String),
}

impl ApiError {
    /// The HTTP status code.
    pub fn code(&self) -> u16 {
        match self {
            Self::NotFound { .. } | Self::NoSuchResource => 404,
            Self::AlreadyExists { .. } | Self::Conflict { .. } => 409,
            Self::BadSelector { .. }
            | Self::UnsupportedField { .. }
            | Self::NameMismatch { .. }
            | Self::NamespaceMismatch
            | Self::InvalidJson { .. }
            | Self::NotAnObject
            | Self::InvalidParam { .. }
            | Self::InvalidContinue { .. }
            | Self::VersionWithContinue
            | Self::DryRunUnsupported
            | Self::TokenRequired
            | Self::TokenForOtherServiceAccount { .. } => 400,
            Self::Invalid { .. } | Self::FieldsInvalid { .. } | Self::PatchFailed { .. } => 422,
            Self::Forbidden { .. } | Self::AccessDenied { .. } => 403,
            Self::Unauthorized => 401,
            Self::UnsupportedPatch { .. } => 415,
            Self::MethodNotAllowed => 405,
            Self::TooOldResourceVersion { .. } | Self::ContinueExpired => 410,
            Self::TooLargeResourceVersion { .. } => 504,
            Self::ResourceVersionOnCreate => 500,
            Self::Injected { failure } => failure.code(),
        }
    }

    /// The `reason` of the Status (`NotFound`, `Conflict`, `Expired`, ...).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotFound { .. } | Self::NoSuchResource => "NotFound",
            Self::AlreadyExists { .. } => "AlreadyExists",
            Self::Conflict { .. } => "Conflict",
            Self::BadSelector { .. }
            | Self::UnsupportedField { .. }
            | Self::NameMismatch { .. }
            | Self::NamespaceMismatch
            | Self::InvalidJson { .. }
            | Self::NotAnObject
            | Self::InvalidParam { .. }
            | Self::InvalidContinue { .. }
            | Self::VersionWithContinue
            | Self::DryRunUnsupported
            | Self::TokenRequired
            | Self::TokenForOtherServiceAccount { .. } => "BadRequest",
            Self::Invalid { .. } | Self::FieldsInvalid { .. } | Self::PatchFailed { .. } => {
                "Invalid"
            }
            Self::Forbidden { .. } | Self::AccessDenied { .. } => "Forbidden",
            Self::Unauthorized => "Unauthorized",
            Self::UnsupportedPatch { .. } => "UnsupportedMediaType",
            Self::MethodNotAllowed => "MethodNotAllowed",
            Self::TooOldResourceVersion { .. } | Self::ContinueExpired => "Expired",
            Self::TooLargeResourceVersion { .. } => "Timeout",
            Self::ResourceVersionOnCreate => "InternalError",
            Self::Injected { failure } => failure.reason(),
        }
    }

    fn details(&self) -> Option<Value> {
        let for_object = |resource: &GroupResource, name: &str| json!({"name": name, "group": resource.group, "kind": resource.resource});
        match self {
            Self::NotFound { resource, name }
            | Self::AlreadyExists { resource, name }
            | Self::Conflict { resource, name, .. }
            | Self::Forbidden { resource, name, .. } => Some(for_object(resource, name)),
            Self::FieldsInvalid {
                kind,
                group,
                name,
                causes,
            } => Some(json!({
                "name": name, "group": group, "kind": kind,
                "causes": causes.iter().map(|c| json!({
                    "reason": c.reason, "message": c.message, "field": c.field,
                })).collect::<Vec<_>>(),
            })),
            Self::Invalid { kind, name, .. } => Some(json!({"name": name, "kind": kind})),
            Self::AccessDenied { resource, .. } => {
                Some(json!({"group": resource.group, "kind": resource.resource}))
            }
            Self::TooLargeResourceVersion { .. } => Some(json!({
                "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                "retryAfterSeconds": 1,
            })),
            Self::Injected { failure } => failure
                .retry_after()
                .map(|s| json!({"retryAfterSeconds": s})),
            _ => None,
        }
    }

    /// The `Status` object the API answers with.
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.to_string(),
            "reason": self.reason(),
            "code": self.code(),
        });
        if let Some(details) = self.details() {
            status["details"] = details;
        }
        status
    }
}

/// What the library's own methods (start, seeding, kubeconfig) fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The listener could not be bound.
    #[error("binding the fake API server on {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// The kubeconfig could not be written.
    #[error("writing the kubeconfig {}", path.display())]
    WriteKubeconfig {
        /// Where.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The server URL did not parse (it always should).
    #[error("the server URL {url} is invalid")]
    Url {
        /// The URL.
        url: String,
        /// Why.
        source: http::uri::InvalidUri,
    },
    /// kube could not build a client.
    #[error("building a kube client for the fake API server")]
    Client {
        /// Why.
        source: Box<kube::Error>,
    },
    /// An object could not be converted to or from JSON.
    #[error("converting an object to or from JSON")]
    Json {
        /// Why.
        #[from]
        source: serde_json::Error,
    },
    /// An inserted object has no `apiVersion` or `kind`.
    #[error("the object has no apiVersion and kind")]
    MissingTypeMeta,
    /// No registered resource serves this apiVersion and kind.
    #[error("no resource is registered for {api_version} {kind}")]
    UnknownKind {
        /// The object's apiVersion.
        api_version: String,
        /// The object's kind.
        kind: String,
    },
    /// No registered resource has this group/version/resource.
    #[error("no resource {gvr} is registered")]
    UnknownResource {
        /// The GVR asked for.
        gvr: Gvr,
    },
    /// The operation was refused as the API would refuse it.
    #[error(transparent)]
    Api(#[from] ApiError),
}
