//! Builders for tests of the core and of what drives it (the agent's reconcile
//! tests): compiled for this crate's tests and with the `testing` feature.

use std::{
    net::IpAddr,
    num::{NonZeroU16, NonZeroU32},
};

use census_proto::domain::{IdentityId, NodeName};

use crate::{MapBatch, MapEntry, MapEvent, MapNode};

pub fn ip(text: &str) -> IpAddr {
    text.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
}

pub fn id(n: u32) -> IdentityId {
    IdentityId::new(n).unwrap_or(IdentityId::WORLD)
}

pub fn name(n: &str) -> NodeName {
    NodeName::new(n).unwrap_or_else(|e| panic!("{e}"))
}

pub fn index(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

pub fn local(n: u16) -> NonZeroU16 {
    NonZeroU16::new(n).unwrap_or(NonZeroU16::MIN)
}

/// A batch, built up.
#[derive(Debug, Default)]
pub struct B(MapBatch);

impl B {
    /// A whole resync in one batch.
    pub fn resync() -> Self {
        Self(MapBatch {
            resync_start: true,
            resync_end: true,
            ..MapBatch::default()
        })
    }

    pub fn start() -> Self {
        Self(MapBatch {
            resync_start: true,
            ..MapBatch::default()
        })
    }

    pub fn end(mut self) -> Self {
        self.0.resync_end = true;
        self
    }

    pub fn node(mut self, i: u32, n: &str) -> Self {
        self.0.nodes.push(MapNode {
            index: index(i),
            name: name(n),
        });
        self
    }

    pub fn upsert(mut self, address: &str, identity: u32, node: u32) -> Self {
        self.0.upserts.push(MapEntry {
            ip: ip(address),
            identity: id(identity),
            node: index(node),
        });
        self
    }

    pub fn remove(mut self, address: &str) -> Self {
        self.0.removes.push(ip(address));
        self
    }

    pub fn removed_node(mut self, i: u32) -> Self {
        self.0.removed_nodes.push(index(i));
        self
    }

    pub fn event(self) -> MapEvent {
        MapEvent::Batch(self.0)
    }
}
