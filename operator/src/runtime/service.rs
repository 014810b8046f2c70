//! The calls of the gRPC layer ([`Api`]): reads, Allocate, and the messages of an
//! EndpointSync stream, each under one lock, refused by a follower naming the leader.

use std::{net::IpAddr, time::Instant};

use census_proto::{
    domain::{AllocationId, Endpoint, EndpointKey, IdRange, IdentityId, NodeName, SessionId},
    labels::LabelSet,
};
use tokio::sync::oneshot;

use super::{Runtime, term};
use crate::{
    allocator::{Allocator, Applied, IdentityInfo, NodeInfo, SyncError, Timestamp, WatchChange},
    api::{
        AgentTx, Allocated, Allocation, Api, Caller, Connected, Feed, MapLookup, MapResync,
        MapWatch, Refused, Settings, Term,
    },
    replica::Role,
};

impl Runtime {
    /// Runs `f` on the core for a message of `stream`, if the stream's term is still
    /// the current one.
    fn on_stream<R>(
        &self,
        stream: &Connected,
        f: impl FnOnce(&mut Allocator, Timestamp) -> Result<R, SyncError>,
    ) -> Result<R, Refused> {
        let mut inner = self.inner.lock();
        term::current(&inner, stream.term)?;
        let now = self.clock.now();
        let r = f(&mut inner.alloc, now);
        self.dispatch(&mut inner, now);
        Ok(r?)
    }
}

impl Api for Runtime {
    fn settings(&self) -> &Settings {
        &self.settings
    }

    fn role(&self) -> Role {
        Runtime::role(self)
    }

    fn services(&self) -> Option<std::sync::Arc<census_proto::domain::ServiceSet>> {
        Runtime::services(self)
    }

    fn id_range(&self) -> IdRange {
        self.read(Allocator::range)
    }

    fn identity(&self, id: IdentityId) -> Option<IdentityInfo> {
        self.reads().identity(id)
    }

    fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo> {
        self.reads().lookup(labels)
    }

    fn list(
        &self,
        after: Option<IdentityId>,
        limit: usize,
        selector: Option<&LabelSet>,
        include_quarantined: bool,
    ) -> (Vec<IdentityInfo>, bool) {
        self.reads()
            .list(after, limit, selector, include_quarantined)
    }

    fn identity_feed(&self) -> Feed<WatchChange, IdentityInfo> {
        Runtime::identity_feed(self)
    }

    fn nodes(&self) -> Vec<NodeInfo> {
        self.read(Allocator::nodes)
    }

    fn node(&self, name: &NodeName) -> Option<NodeInfo> {
        self.read(|a| a.node(name))
    }

    fn allocate(
        &self,
        caller: &Caller,
        session: SessionId,
        allocation: AllocationId,
        labels: LabelSet,
    ) -> Result<Allocation, Refused> {
        let mut inner = self.inner.lock();
        if let Some(refusal) = term::refusal(&inner) {
            return Err(refusal.into());
        }
        let now = self.clock.now();
        let req = inner.next_req;
        inner.next_req += 1;
        let answer = match inner
            .alloc
            .allocate(req, &caller.node, session, allocation, labels, now)
        {
            Ok(Some(id)) => Ok(Ok(id)),
            Ok(None) => {
                let (tx, rx) = oneshot::channel();
                inner.replies.insert(req, tx);
                Ok(Err(rx))
            }
            Err(e) => Err(e),
        };
        self.dispatch(&mut inner, now);
        Ok(match answer? {
            Ok(id) => Allocation::Known(Allocated {
                id,
                info: inner.alloc.identity(id),
            }),
            Err(pending) => Allocation::New(pending),
        })
    }

    fn hello(
        &self,
        caller: &Caller,
        session: SessionId,
        addresses: Vec<IpAddr>,
        tx: AgentTx,
    ) -> Result<Connected, Refused> {
        if let Some(replica) = &self.replica {
            replica.admission.admit(&caller.node, caller.peer)?;
        }
        let mut inner = self.inner.lock();
        if let Some(refusal) = term::refusal(&inner) {
            return Err(refusal.into());
        }
        let now = self.clock.now();
        let accepted = inner.alloc.hello(&caller.node, session, now);
        if let Ok(acc) = &accepted {
            inner.streams.insert(acc.conn, tx);
            inner
                .alloc
                .hello_addresses(&caller.node, acc.conn, addresses, now);
        }
        self.dispatch(&mut inner, now);
        Ok(Connected {
            node: caller.node.clone(),
            session,
            conn: accepted?.conn,
            term: inner.term,
        })
    }

    fn upsert(&self, stream: &Connected, seq: u64, endpoint: Endpoint) -> Result<Applied, Refused> {
        self.on_stream(stream, |a, now| {
            a.upsert(&stream.node, stream.conn, seq, endpoint, now)
        })
    }

    fn delete(&self, stream: &Connected, seq: u64, key: &EndpointKey) -> Result<Applied, Refused> {
        self.on_stream(stream, |a, now| {
            a.delete(&stream.node, stream.conn, seq, key, now)
        })
    }

    fn snapshot(
        &self,
        stream: &Connected,
        seq: u64,
        endpoints: Vec<Endpoint>,
        settled: AllocationId,
    ) -> Result<Applied, Refused> {
        self.on_stream(stream, |a, now| {
            let started = Instant::now();
            let applied = a.snapshot(&stream.node, stream.conn, seq, endpoints, settled, now);
            self.metrics
                .snapshot_apply
                .observe(started.elapsed().as_secs_f64());
            applied
        })
    }

    fn disconnect(&self, stream: &Connected) {
        let mut inner = self.inner.lock();
        if inner.term != stream.term {
            return;
        }
        inner.streams.remove(&stream.conn);
        inner.alloc.disconnect(&stream.node, stream.conn);
        let now = self.clock.now();
        self.dispatch(&mut inner, now);
    }

    fn map_watch(&self, caller: &Caller, session: SessionId) -> Result<MapWatch, Refused> {
        Runtime::map_watch(self, caller, session)
    }

    fn map_resync(&self, term: Term) -> Result<MapResync, Refused> {
        Runtime::map_resync(self, term)
    }

    fn map_lookup(&self, ip: IpAddr) -> Result<Option<MapLookup>, Refused> {
        Runtime::map_lookup(self, ip)
    }
}
