//! Quotas per authenticated caller and caps on the whole server: what one node's
//! credentials, or everyone together, may hold open at once (DESIGN.md,
//! "Authentication and node binding").
//!
//! - **EndpointSync streams per node.** The session rule keeps one current stream per
//!   node; this bounds the ones before their Hello and the ones a reconnecting agent
//!   leaves behind until keepalive ends them.
//! - **Watches per caller and in all.** A watch holds a subscription and, while it
//!   resyncs, a position in a full map or list; EndpointMap.Watch and
//!   IdentityService.Watch count together.
//! - **Bytes of large messages in flight**: the transport's budget
//!   (`census_transport::budget`), sized by `--max-inflight-message-bytes` here.
//!
//! Holds have their quota in the allocator (`--max-holds-per-node`), by the node an
//! Allocate speaks for, which authentication binds to the caller's credentials.
//!
//! Every refusal is RESOURCE_EXHAUSTED naming the quota, its flag and its value, and
//! is counted (`census_quota_refusals_total`). A refused call changes no state.

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use census_proto::domain::NodeName;
use parking_lot::Mutex;
use prometheus_client::metrics::{counter::Counter, family::Family};
use tonic::Status;

use super::auth::Principal;
use crate::metrics::ReasonLabels;

/// The quotas and caps, as configured.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QuotaLimits {
    /// EndpointSync streams one node may have open (`--max-streams-per-node`).
    pub(crate) streams_per_node: usize,
    /// Watches one caller may have open (`--max-watches-per-caller`).
    pub(crate) watches_per_caller: usize,
    /// Watches open in all (`--max-watches`).
    pub(crate) watches: usize,
    /// Bytes of messages above the request limit being received at once
    /// (`--max-inflight-message-bytes`); at least the message limit.
    pub(crate) inflight_message_bytes: usize,
}

/// What a quota counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Stream,
    Watch,
}

/// Whose quota a call counts against.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Owner {
    Node(NodeName),
    Reader(String),
}

/// The open calls of every caller, against [`QuotaLimits`].
#[derive(Debug)]
pub(crate) struct Quotas {
    limits: QuotaLimits,
    held: Mutex<HashMap<(Kind, Owner), usize>>,
    watches: AtomicUsize,
    refusals: Family<ReasonLabels, Counter>,
}

/// One open call counted against its caller's quota (and the watch cap) until dropped.
#[derive(Debug)]
pub(crate) struct Held {
    quotas: Arc<Quotas>,
    key: Option<(Kind, Owner)>,
    watch: bool,
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut held = self.quotas.held.lock();
            if let Some(n) = held.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    held.remove(&key);
                }
            }
        }
        if self.watch {
            self.quotas.watches.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Quotas {
    pub(crate) fn new(limits: QuotaLimits, refusals: Family<ReasonLabels, Counter>) -> Arc<Self> {
        Arc::new(Self {
            limits,
            held: Mutex::default(),
            watches: AtomicUsize::new(0),
            refusals,
        })
    }

    /// An EndpointSync stream of `node` (the node its Hello names, which
    /// authentication bound to the caller).
    pub(crate) fn stream(self: &Arc<Self>, node: &NodeName) -> Result<Held, Status> {
        let key = (Kind::Stream, Owner::Node(node.clone()));
        let max = self.limits.streams_per_node;
        if !self.take(&key, max) {
            return Err(self.refused("streams_per_node", format!(
                "node {node} has {max} EndpointSync streams open, the per-node quota (--max-streams-per-node); a stream ends when its agent closes it or keepalive finds it dead"
            )));
        }
        Ok(Held {
            quotas: Arc::clone(self),
            key: Some(key),
            watch: false,
        })
    }

    /// A watch by `principal` (EndpointMap.Watch or IdentityService.Watch); `node` is
    /// the node the watch speaks for, if it does (a loopback caller's quota is its
    /// node's: on loopback every simulated node is its own caller).
    pub(crate) fn watch(
        self: &Arc<Self>,
        principal: &Principal,
        node: Option<&NodeName>,
    ) -> Result<Held, Status> {
        let cap = self.limits.watches;
        let open = self.watches.fetch_add(1, Ordering::AcqRel);
        // Taken first, so a watch refused by its caller's quota is given back by the
        // guard like any other.
        let mut held = Held {
            quotas: Arc::clone(self),
            key: None,
            watch: true,
        };
        if open >= cap {
            return Err(self.refused(
                "watches",
                format!("{cap} watches are open, the server's cap (--max-watches); retry later"),
            ));
        }
        let owner = match (principal, node) {
            (Principal::Node { node, .. }, _) => Owner::Node(node.clone()),
            (Principal::Reader { name, .. }, _) => Owner::Reader(name.clone()),
            (Principal::Loopback, Some(node)) => Owner::Node(node.clone()),
            // A loopback reader: only the server's cap.
            (Principal::Loopback, None) => return Ok(held),
        };
        let max = self.limits.watches_per_caller;
        let key = (Kind::Watch, owner);
        let who = match &key.1 {
            Owner::Node(node) => format!("node {node}"),
            Owner::Reader(name) => format!("reader {}", super::auth::bounded(name)),
        };
        if !self.take(&key, max) {
            return Err(self.refused(
                "watches_per_caller",
                format!(
                    "{who} has {max} watches open, the per-caller quota (--max-watches-per-caller)"
                ),
            ));
        }
        held.key = Some(key);
        Ok(held)
    }

    /// Counts one more call against `key` unless it has `max` open.
    fn take(&self, key: &(Kind, Owner), max: usize) -> bool {
        let mut held = self.held.lock();
        match held.get_mut(key) {
            Some(n) if *n >= max => false,
            Some(n) => {
                *n += 1;
                true
            }
            None if max == 0 => false,
            None => {
                held.insert(key.clone(), 1);
                true
            }
        }
    }

    fn refused(&self, quota: &'static str, message: String) -> Status {
        self.refusals
            .get_or_create(&ReasonLabels { reason: quota })
            .inc();
        Status::resource_exhausted(message)
    }

    /// Open watches in all.
    #[cfg(test)]
    fn watches_open(&self) -> usize {
        self.watches.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn limits() -> QuotaLimits {
        QuotaLimits {
            streams_per_node: 2,
            watches_per_caller: 2,
            watches: 3,
            inflight_message_bytes: 100,
        }
    }

    fn node(name: &str) -> Result<NodeName, Box<dyn std::error::Error>> {
        Ok(NodeName::new(name)?)
    }

    fn of(name: &str) -> Result<Principal, Box<dyn std::error::Error>> {
        Ok(Principal::Node {
            node: node(name)?,
            expires: None,
            addresses: crate::grpc::auth::Vouched::Any,
        })
    }

    fn reader(name: &str) -> Principal {
        Principal::Reader {
            name: name.to_owned(),
            expires: Some(SystemTime::now()),
        }
    }

    fn refused<T: std::fmt::Debug>(answer: Result<T, Status>) -> Result<Status, String> {
        match answer {
            Ok(held) => Err(format!("not refused: {held:?}")),
            Err(status) => Ok(status),
        }
    }

    #[test]
    fn a_node_opens_streams_up_to_its_quota_and_again_once_one_ends() -> TestResult {
        let refusals = Family::default();
        let quotas = Quotas::new(limits(), refusals.clone());
        let first = quotas.stream(&node("node-a")?)?;
        let _second = quotas.stream(&node("node-a")?)?;
        let status = refused(quotas.stream(&node("node-a")?))?;
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(
            status.message().contains("node node-a")
                && status.message().contains("--max-streams-per-node"),
            "{}",
            status.message()
        );
        let _other = quotas.stream(&node("node-b")?)?;
        drop(first);
        let _again = quotas.stream(&node("node-a")?)?;
        let counted = refusals
            .get_or_create(&ReasonLabels {
                reason: "streams_per_node",
            })
            .get();
        assert_eq!(counted, 1);
        Ok(())
    }

    #[test]
    fn watches_count_per_caller_and_against_the_cap_and_come_back() -> TestResult {
        let quotas = Quotas::new(limits(), Family::default());
        let a1 = quotas.watch(&of("node-a")?, None)?;
        let _a2 = quotas.watch(&of("node-a")?, None)?;
        let status = refused(quotas.watch(&of("node-a")?, None))?;
        assert!(
            status.message().contains("--max-watches-per-caller"),
            "{}",
            status.message()
        );
        assert_eq!(quotas.watches_open(), 2, "a refused watch holds nothing");
        let _r = quotas.watch(&reader("cli"), None)?;
        let capped = refused(quotas.watch(&reader("other"), None))?;
        assert_eq!(capped.code(), tonic::Code::ResourceExhausted);
        assert!(
            capped.message().contains("--max-watches)"),
            "{}",
            capped.message()
        );
        drop(a1);
        assert_eq!(quotas.watches_open(), 2);
        let _other = quotas.watch(&reader("other"), None)?;
        assert_eq!(quotas.held.lock().len(), 3, "node-a, cli and other");
        Ok(())
    }

    #[test]
    fn loopback_watches_count_per_node_named_and_readers_only_against_the_cap() -> TestResult {
        let quotas = Quotas::new(limits(), Family::default());
        let a = node("a")?;
        let _a1 = quotas.watch(&Principal::Loopback, Some(&a))?;
        let _a2 = quotas.watch(&Principal::Loopback, Some(&a))?;
        refused(quotas.watch(&Principal::Loopback, Some(&a)))?;
        let _c = quotas.watch(&Principal::Loopback, None)?;
        refused(quotas.watch(&Principal::Loopback, None))?;
        Ok(())
    }

    #[test]
    fn the_quota_map_forgets_callers_with_nothing_open() -> TestResult {
        let quotas = Quotas::new(limits(), Family::default());
        for i in 0..100 {
            let held = quotas.stream(&node(&format!("node-{i}"))?)?;
            drop(held);
        }
        assert!(quotas.held.lock().is_empty());
        Ok(())
    }
}
