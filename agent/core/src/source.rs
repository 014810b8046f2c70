//! What a source tells the agent about the endpoints of its node: the events the
//! core takes in (the sources themselves, which do the I/O, are the agent's).

use std::{collections::BTreeMap, error::Error, fmt, net::IpAddr, sync::Arc};

use census_proto::domain::EndpointKey;

/// One endpoint as a source describes it: pod labels, before the agent applies the
/// label filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceEndpoint {
    pub key: EndpointKey,
    /// Sorted, without duplicates.
    pub ips: Box<[IpAddr]>,
    /// The pod's labels (`key -> value`): all of them, or, from a source that takes
    /// the operator's filter (the agent's `EndpointSource::label_filter`), those it keeps.
    pub labels: BTreeMap<String, String>,
    pub service_account: String,
    pub interface: HostInterface,
}

/// The host side of an endpoint's interface, where the classifier goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostInterface {
    /// Its name, in the agent's network namespace.
    Named(String),
    /// The source could not find it, and says why. The endpoint still gets its
    /// identity and ENDPOINTS entries (its traffic with other endpoints is counted
    /// at theirs), but no classifier of its own, and it is shown in error.
    Unknown(NoInterface),
}

/// Why a source found no host-side interface for an endpoint: the source's own
/// error (a route lookup's, say), kept whole with its chain. Two are equal when
/// they say the same.
#[derive(Clone)]
pub struct NoInterface(Arc<dyn Error + Send + Sync>);

impl NoInterface {
    pub fn new(error: impl Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(error))
    }

    /// An endpoint without any address to look a route up for.
    pub fn no_address() -> Self {
        Self::from("the pod has no address")
    }
}

impl From<&str> for NoInterface {
    fn from(why: &str) -> Self {
        Self::new(Said(why.to_owned()))
    }
}

/// A reason given as text.
#[derive(Debug)]
struct Said(String);

impl fmt::Display for Said {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for Said {}

impl fmt::Display for NoInterface {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Debug for NoInterface {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Error for NoInterface {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for NoInterface {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

impl Eq for NoInterface {}

impl PartialEq<str> for NoInterface {
    fn eq(&self, other: &str) -> bool {
        let said = self.to_string();
        said == other
    }
}

impl HostInterface {
    pub fn name(&self) -> Option<&str> {
        match self {
            Self::Named(name) => Some(name),
            Self::Unknown(_) => None,
        }
    }
}

/// What a source tells the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceEvent {
    /// The full desired set: replaces everything the source said before.
    Reset(Vec<SourceEndpoint>),
    /// One endpoint appeared or changed.
    Upsert(SourceEndpoint),
    /// One endpoint is gone.
    Delete(EndpointKey),
    /// The source could not read its input; what it said before stays in force.
    Failed(SourceFailure),
}

/// Why a source could not deliver, for logs, `/readyz` and the endpoints API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFailure {
    /// A bounded metric label (`read`, `parse`, `invalid`, ...).
    pub kind: &'static str,
    /// The whole message, naming the input and the problem.
    pub detail: String,
}

impl fmt::Display for SourceFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}
