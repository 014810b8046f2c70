//! What reconcile knows it has written to ENDPOINTS, kept compact: with the
//! cluster-wide map ENDPOINTS holds an entry for every endpoint of the cluster.
//!
//! - Entries of this node (LOCAL, unattached, host): one table per address family
//!   (an IPv4 entry costs 12 bytes, not the 28 of an `IpAddr` key and its padding).
//! - REMOTE entries: nothing per entry. The core holds every remote claim (and
//!   sends a change only when a claim's value changes), and every change is
//!   written before the next full pass, so a REMOTE entry the core wants is
//!   written unless its write failed: only those failures are kept. (At 550k IPv6
//!   entries a set of the written addresses would cost about 32 bytes per entry,
//!   a third of the agent's memory for the map.)

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use crate::bpf;

#[derive(Debug, Default)]
pub(super) struct Written {
    v4: HashMap<Ipv4Addr, bpf::Endpoint>,
    v6: HashMap<Ipv6Addr, bpf::Endpoint>,
    /// REMOTE entries whose last write failed: not in ENDPOINTS as far as this
    /// agent knows.
    unwritten: HashSet<IpAddr>,
}

impl Written {
    /// The entry of this node written for `ip`, if any.
    pub(super) fn local(&self, ip: IpAddr) -> Option<bpf::Endpoint> {
        match ip {
            IpAddr::V4(v4) => self.v4.get(&v4).copied(),
            IpAddr::V6(v6) => self.v6.get(&v6).copied(),
        }
    }

    /// Whether `ip` is known to hold `want` already: an entry of this node only (a
    /// REMOTE entry's value is not kept, and "no entry" is known only by reading
    /// ENDPOINTS).
    pub(super) fn holds(&self, ip: IpAddr, want: Option<bpf::Endpoint>) -> bool {
        match want {
            Some(want) if want.remote_node().is_none() => self.local(ip) == Some(want),
            _ => false,
        }
    }

    /// Whether this agent wrote `want` for `ip` (a REMOTE entry: whether its last
    /// write succeeded).
    pub(super) fn wrote(&self, ip: IpAddr, want: bpf::Endpoint) -> bool {
        if want.remote_node().is_some() {
            !self.unwritten.contains(&ip)
        } else {
            self.local(ip) == Some(want)
        }
    }

    /// `endpoint` was written for `ip`.
    pub(super) fn insert(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) {
        self.unwritten.remove(&ip);
        let local = endpoint.remote_node().is_none();
        match ip {
            IpAddr::V4(v4) if local => {
                self.v4.insert(v4, endpoint);
            }
            IpAddr::V6(v6) if local => {
                self.v6.insert(v6, endpoint);
            }
            IpAddr::V4(v4) => {
                self.v4.remove(&v4);
            }
            IpAddr::V6(v6) => {
                self.v6.remove(&v6);
            }
        }
    }

    /// Writing `want` for `ip` failed: what was there is unknown.
    pub(super) fn failed(&mut self, ip: IpAddr, want: bpf::Endpoint) {
        if want.remote_node().is_some() {
            self.unwritten.insert(ip);
        } else {
            self.unwritten.remove(&ip);
        }
    }

    /// `ip` has no entry.
    pub(super) fn remove(&mut self, ip: IpAddr) {
        self.unwritten.remove(&ip);
        match ip {
            IpAddr::V4(v4) => {
                self.v4.remove(&v4);
            }
            IpAddr::V6(v6) => {
                self.v6.remove(&v6);
            }
        }
    }

    /// Entries of this node written.
    pub(super) fn local_len(&self) -> usize {
        self.v4.len() + self.v6.len()
    }

    /// REMOTE entries the core wants that are not written.
    pub(super) fn unwritten_len(&self) -> usize {
        self.unwritten.len()
    }

    /// Keeps the entries of the addresses `keep` keeps.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(IpAddr) -> bool) {
        self.v4.retain(|ip, _| keep(IpAddr::V4(*ip)));
        self.v6.retain(|ip, _| keep(IpAddr::V6(*ip)));
        self.unwritten.retain(|ip| keep(*ip));
    }
}
