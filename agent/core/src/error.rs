//! What can go wrong for an endpoint, typed: the core keeps these and the admin API
//! renders them (`Display`); metric labels come from `match`es, never from the text.

use std::{error::Error as StdError, fmt, net::IpAddr, sync::Arc};

use census_proto::{convert::FieldError, domain::EndpointKey, labels::LabelError};

/// Why an endpoint has no identity labels.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LabelsError {
    #[error("{count} addresses, over the operator's limit of {limit}")]
    TooManyAddresses { count: usize, limit: usize },
    #[error(transparent)]
    Labels(#[from] LabelError),
}

/// Why one Allocate call gave no identity; the allocation is retried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateFailure {
    #[error("the operator did not answer Allocate in time")]
    Timeout,
    /// The operator refused the label set (`InvalidArgument`): retrying will not
    /// help until the labels change.
    #[error("operator: InvalidArgument: {message}")]
    Refused { message: String },
    /// Any other gRPC status; `code` is the code's name as the gRPC specification
    /// spells it (`Unavailable`, ...), a bounded label.
    #[error("operator: {code}: {message}")]
    Rejected { code: &'static str, message: String },
    #[error("the operator answered without an identity")]
    NoIdentity,
}

impl AllocateFailure {
    /// The `outcome` label of `census_agent_allocations_total`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Refused { .. } => "InvalidArgument",
            Self::Rejected { code, .. } => code,
            Self::NoIdentity => "invalid",
        }
    }

    /// Whether the operator refused the labels themselves, not merely failed to answer.
    pub fn is_refusal(&self) -> bool {
        matches!(self, Self::Refused { .. })
    }
}

/// A failed datapath operation (a map write, an attachment), as the reconcile shell
/// reported it: the error itself, shared, so the core can keep it and show it.
#[derive(Debug, Clone)]
pub struct DatapathError(Arc<dyn StdError + Send + Sync>);

impl DatapathError {
    pub fn new(error: impl StdError + Send + Sync + 'static) -> Self {
        Self(Arc::new(error))
    }
}

impl fmt::Display for DatapathError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl StdError for DatapathError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.0.source()
    }
}

/// Why the EndpointSync stream ended or could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    #[error("cannot queue Hello")]
    QueueHello,
    #[error("the operator did not answer Hello in time")]
    HelloTimeout,
    /// A gRPC status; `code` as the gRPC specification spells it.
    #[error("{code}: {message}")]
    Status { code: &'static str, message: String },
    #[error("the operator's first message is not HelloReply: {got}")]
    NotHelloReply { got: &'static str },
    #[error("the operator speaks protocol version {operator}, this agent {agent}")]
    ProtocolVersion { operator: u32, agent: u32 },
    #[error(transparent)]
    Settings(#[from] FieldError),
    #[error("the agent is stopping")]
    Stopping,
    #[error("the operator ended the stream")]
    EndedByOperator,
    #[error("the stream closed")]
    Closed,
}

/// What is wrong with an endpoint (state `error`), or why it still waits for its
/// identity (state `waiting_for_identity`).
#[derive(Debug, Clone, thiserror::Error)]
pub enum Problem {
    #[error("no identity labels: {0}")]
    NoLabels(LabelsError),
    #[error("the operator refused the labels: {0}")]
    Refused(AllocateFailure),
    /// The operator's Ack rejected the endpoint, with its reason.
    #[error("the operator rejected it: {0}")]
    Rejected(String),
    #[error("address {ip} is also endpoint {owner}'s")]
    AddressTaken { ip: IpAddr, owner: EndpointKey },
    #[error("writing ENDPOINTS[{ip}]: {error}")]
    MapWrite { ip: IpAddr, error: DatapathError },
    /// Attaching the classifier or writing its INTERFACES entry failed.
    #[error("{0}")]
    Interface(DatapathError),
    /// The source found no host-side interface, and says why.
    #[error("no host-side interface: {0}")]
    NoInterface(crate::source::NoInterface),
    /// Waiting: the last allocation attempt failed, and is retried.
    #[error("{0}")]
    Allocating(AllocateFailure),
    /// Waiting: the operator accepted the endpoint but decides its identity later.
    #[error("the operator decides its identity after its adoption window")]
    Pending,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_failures_keep_their_words_and_bounded_labels() {
        let cases = [
            (
                AllocateFailure::Timeout,
                "timeout",
                "the operator did not answer Allocate in time",
            ),
            (
                AllocateFailure::Refused {
                    message: "labels[0]: bad".into(),
                },
                "InvalidArgument",
                "operator: InvalidArgument: labels[0]: bad",
            ),
            (
                AllocateFailure::Rejected {
                    code: "Unavailable",
                    message: "not the leader".into(),
                },
                "Unavailable",
                "operator: Unavailable: not the leader",
            ),
            (
                AllocateFailure::NoIdentity,
                "invalid",
                "the operator answered without an identity",
            ),
        ];
        for (failure, label, text) in cases {
            assert_eq!(failure.metric_label(), label);
            assert_eq!(failure.to_string(), text);
            assert_eq!(
                failure.is_refusal(),
                matches!(failure, AllocateFailure::Refused { .. })
            );
        }
    }
}
