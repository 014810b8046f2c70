//! This node's own addresses, flagged HOST in ENDPOINTS so traffic from and to the
//! node itself counts as the `host` identity.

use std::{collections::BTreeSet, io, net::IpAddr};

use nix::ifaddrs::getifaddrs;

/// Where the node's addresses come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostIps {
    /// Every address of every interface in the agent's network namespace, but
    /// loopback ones (re-read on every full reconcile pass).
    Discover,
    /// These, for tests.
    Fixed(BTreeSet<IpAddr>),
}

impl HostIps {
    pub fn read(&self) -> io::Result<BTreeSet<IpAddr>> {
        match self {
            Self::Fixed(ips) => Ok(ips.clone()),
            Self::Discover => discover(),
        }
    }
}

fn discover() -> io::Result<BTreeSet<IpAddr>> {
    let mut ips = BTreeSet::new();
    for ifaddr in getifaddrs().map_err(io::Error::from)? {
        let Some(address) = ifaddr.address else {
            continue;
        };
        let ip: IpAddr = if let Some(v4) = address.as_sockaddr_in() {
            v4.ip().into()
        } else if let Some(v6) = address.as_sockaddr_in6() {
            v6.ip().into()
        } else {
            continue;
        };
        if !ip.is_loopback() && !ip.is_unspecified() {
            ips.insert(ip);
        }
    }
    Ok(ips)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovers_no_loopback_address() -> io::Result<()> {
        let ips = HostIps::Discover.read()?;
        assert!(ips.iter().all(|ip| !ip.is_loopback()), "{ips:?}");
        Ok(())
    }
}
