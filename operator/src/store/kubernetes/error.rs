//! What a failed API request means for a store op: a few outcomes the op logic acts
//! on (not found, already exists, conflict), and everything else as a retryable
//! failure with a bounded cause label.

use crate::store::StoreError;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Failure {
    #[error("not found")]
    NotFound,
    #[error("already exists")]
    AlreadyExists,
    /// A resourceVersion or UID precondition failed.
    #[error("conflict")]
    Conflict,
    /// 410: a list's continue token or a watch's resourceVersion was compacted.
    #[error("expired")]
    Expired,
    /// The request may succeed later (`cause` is a bounded metric label).
    #[error("{detail}")]
    Unavailable { cause: &'static str, detail: String },
}

impl Failure {
    pub(crate) fn unavailable(cause: &'static str, detail: impl Into<String>) -> Self {
        Self::Unavailable {
            cause,
            detail: detail.into(),
        }
    }

    /// A bounded label for logs and metrics.
    pub(crate) fn cause(&self) -> &'static str {
        match self {
            Self::NotFound => "not_found",
            Self::AlreadyExists => "already_exists",
            Self::Conflict => "conflict",
            Self::Expired => "expired",
            Self::Unavailable { cause, .. } => cause,
        }
    }

    /// For an op that cannot act on this outcome: retried later like any failure.
    pub(crate) fn into_store_error(self, doing: &str) -> StoreError {
        let (cause, detail) = match self {
            Self::NotFound => ("not_found", format!("{doing}: not found")),
            Self::AlreadyExists => ("already_exists", format!("{doing}: already exists")),
            Self::Conflict => (
                "conflict_retries",
                format!("{doing}: conflicts kept coming"),
            ),
            Self::Expired => ("expired", format!("{doing}: expired (410)")),
            Self::Unavailable { cause, detail } => (cause, format!("{doing}: {detail}")),
        };
        StoreError::Unavailable { cause, detail }
    }
}

/// Classifies a kube client error.
pub(crate) fn classify(e: &kube::Error) -> Failure {
    match e {
        kube::Error::Api(status) => match status.code {
            404 => Failure::NotFound,
            409 if status.reason == "AlreadyExists" => Failure::AlreadyExists,
            409 => Failure::Conflict,
            410 => Failure::Expired,
            code => {
                Failure::unavailable(status_cause(code), format!("{} {}", code, status.message))
            }
        },
        kube::Error::SerdeError(e) => Failure::unavailable("bad_response", e.to_string()),
        kube::Error::HyperError(e) => Failure::unavailable("transport", e.to_string()),
        kube::Error::Service(e) => Failure::unavailable("transport", e.to_string()),
        other => Failure::unavailable("client", other.to_string()),
    }
}

fn status_cause(code: u16) -> &'static str {
    match code {
        401 | 403 => "forbidden",
        400 | 422 => "rejected",
        429 => "throttled",
        503 => "unavailable",
        504 => "server_timeout",
        500..=599 => "server_error",
        _ => "unexpected_status",
    }
}

#[cfg(test)]
mod tests {
    use kube::core::Status;

    use super::*;

    fn api(code: u16, reason: &str) -> kube::Error {
        let mut status = Status::failure("injected", reason);
        status.code = code;
        kube::Error::Api(Box::new(status))
    }

    #[test]
    fn errors_map_to_outcomes_and_bounded_causes() {
        assert_eq!(classify(&api(404, "NotFound")), Failure::NotFound);
        assert_eq!(classify(&api(409, "AlreadyExists")), Failure::AlreadyExists);
        assert_eq!(classify(&api(409, "Conflict")), Failure::Conflict);
        for (code, cause) in [
            (429, "throttled"),
            (500, "server_error"),
            (503, "unavailable"),
            (403, "forbidden"),
        ] {
            match classify(&api(code, "X")) {
                Failure::Unavailable { cause: c, .. } => assert_eq!(c, cause),
                other => panic!("{code}: {other:?}"),
            }
        }
        assert_eq!(
            Failure::Conflict.into_store_error("tombstone 300").cause(),
            "conflict_retries"
        );
    }
}
