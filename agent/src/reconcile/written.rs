//! What reconcile has written to ENDPOINTS, kept compact: with the cluster-wide map
//! it holds an entry for every endpoint of the cluster. One table per address
//! family (an IPv4 entry costs 12 bytes, not the 28 of an `IpAddr` key and its
//! padding), and for a REMOTE entry only its address: the core holds its value
//! (and sends a change only when the value changes), so it is not kept twice.

use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use crate::bpf;

#[derive(Debug, Default)]
pub(super) struct Written {
    v4: HashMap<Ipv4Addr, bpf::Endpoint>,
    v6: HashMap<Ipv6Addr, bpf::Endpoint>,
    remote_v4: HashSet<Ipv4Addr>,
    remote_v6: HashSet<Ipv6Addr>,
}

impl Written {
    fn local(&self, ip: IpAddr) -> Option<bpf::Endpoint> {
        match ip {
            IpAddr::V4(v4) => self.v4.get(&v4).copied(),
            IpAddr::V6(v6) => self.v6.get(&v6).copied(),
        }
    }

    /// Whether the entry written for `ip` is a REMOTE one.
    pub(super) fn is_remote(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(v4) => self.remote_v4.contains(&v4),
            IpAddr::V6(v6) => self.remote_v6.contains(&v6),
        }
    }

    /// Whether `ip` is known to be as `want` says: no entry written, or this very
    /// entry. A REMOTE entry's value is not kept, so it is never known to be.
    pub(super) fn holds(&self, ip: IpAddr, want: Option<bpf::Endpoint>) -> bool {
        match want {
            None => self.local(ip).is_none() && !self.is_remote(ip),
            Some(want) if want.remote_node().is_some() => false,
            Some(want) => self.local(ip) == Some(want),
        }
    }

    /// Whether this agent wrote `want` for `ip` (a REMOTE entry: a REMOTE one).
    pub(super) fn wrote(&self, ip: IpAddr, want: bpf::Endpoint) -> bool {
        if want.remote_node().is_some() {
            self.is_remote(ip)
        } else {
            self.local(ip) == Some(want)
        }
    }

    pub(super) fn insert(&mut self, ip: IpAddr, endpoint: bpf::Endpoint) {
        let remote = endpoint.remote_node().is_some();
        match ip {
            IpAddr::V4(v4) if remote => {
                self.v4.remove(&v4);
                self.remote_v4.insert(v4);
            }
            IpAddr::V6(v6) if remote => {
                self.v6.remove(&v6);
                self.remote_v6.insert(v6);
            }
            IpAddr::V4(v4) => {
                self.remote_v4.remove(&v4);
                self.v4.insert(v4, endpoint);
            }
            IpAddr::V6(v6) => {
                self.remote_v6.remove(&v6);
                self.v6.insert(v6, endpoint);
            }
        }
    }

    pub(super) fn remove(&mut self, ip: IpAddr) {
        match ip {
            IpAddr::V4(v4) => {
                self.v4.remove(&v4);
                self.remote_v4.remove(&v4);
            }
            IpAddr::V6(v6) => {
                self.v6.remove(&v6);
                self.remote_v6.remove(&v6);
            }
        }
    }

    pub(super) fn len(&self) -> usize {
        self.v4.len() + self.v6.len() + self.remote_v4.len() + self.remote_v6.len()
    }

    /// Keeps the entries of the addresses `keep` keeps.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(IpAddr) -> bool) {
        self.v4.retain(|ip, _| keep(IpAddr::V4(*ip)));
        self.v6.retain(|ip, _| keep(IpAddr::V6(*ip)));
        self.remote_v4.retain(|ip| keep(IpAddr::V4(*ip)));
        self.remote_v6.retain(|ip| keep(IpAddr::V6(*ip)));
    }
}
