use std::{
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
    time::Duration,
};

use census_proto::{
    convert::WireLimits,
    domain::{EndpointKey, IdRange, IdentityId, NodeName, SessionId},
    labels::{LabelFilter, LabelSet},
};
use tokio::sync::{broadcast, mpsc};

use super::*;
use crate::{
    allocator::{IdentityInfo, IdentityState},
    api::{Allocation, Api, Caller, Refused},
    replica::{Admission, AdmissionError, Leader, NotLeader, ReadModel},
    store::StoreError,
};

/// A read model with one binding, and an admission that lets everyone in.
#[derive(Debug)]
struct Fixed(IdentityId, LabelSet, broadcast::Sender<WatchChange>);

impl ReadModel for Fixed {
    fn identity(&self, id: IdentityId) -> Option<IdentityInfo> {
        (id == self.0).then(|| IdentityInfo {
            id,
            labels: Some(self.1.clone()),
            state: IdentityState::Live,
            refs: 0,
            holds: 0,
        })
    }
    fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo> {
        (*labels == self.1).then(|| self.identity(self.0)).flatten()
    }
    fn list(
        &self,
        _: Option<IdentityId>,
        _: usize,
        _: Option<&LabelSet>,
        _: bool,
    ) -> (Vec<IdentityInfo>, bool) {
        (self.identity(self.0).into_iter().collect(), false)
    }
    fn bindings(&self) -> Vec<IdentityInfo> {
        self.identity(self.0).into_iter().collect()
    }
    fn subscribe(&self) -> broadcast::Receiver<WatchChange> {
        self.2.subscribe()
    }
}

#[derive(Debug)]
struct Anyone;

impl Admission for Anyone {
    fn admit(&self, _: &NodeName, _: Option<IpAddr>) -> Result<(), AdmissionError> {
        Ok(())
    }
}

fn settings() -> Settings {
    Settings {
        filter: LabelFilter::default(),
        wire: WireLimits::default(),
        snapshot_interval: Duration::from_secs(30),
        max_message_bytes: 4 << 20,
        store_kind: "test",
    }
}

fn cfg() -> Result<Config, Box<dyn std::error::Error>> {
    Ok(Config {
        range: IdRange::new(256, 300)?,
        adoption_window: Duration::ZERO,
        ..Config::default()
    })
}

const SESSION: SessionId = SessionId {
    start_time_ns: 1,
    nonce: 1,
};

fn caller() -> Result<Caller, Box<dyn std::error::Error>> {
    Ok(Caller {
        node: NodeName::new("n1")?,
        peer: Some(IpAddr::from(Ipv4Addr::LOCALHOST)),
    })
}

#[tokio::test]
async fn roles_change_in_terms_and_followers_refuse_writes()
-> Result<(), Box<dyn std::error::Error>> {
    let web: LabelSet = "k8s:app=web".parse()?;
    let stored = IdentityId::new(4000).ok_or("id")?;
    let replica = Replica {
        reads: Arc::new(Fixed(stored, web.clone(), broadcast::channel(4).0)),
        admission: Arc::new(Anyone),
    };
    let runtime = Runtime::new_replica(
        cfg()?,
        Clock::new(),
        settings(),
        Metrics::default(),
        replica,
    );
    let caller = caller()?;

    // A follower: reads from the read model, writes refused naming the leader.
    assert_eq!(runtime.lookup(&web).map(|i| i.id), Some(stored));
    assert_eq!(runtime.identity_feed().full.len(), 1);
    let leader = Leader {
        name: "op-b".into(),
        address: Some("10.0.0.2:9460".into()),
    };
    runtime.set_leader(Some(leader.clone()));
    let (tx, _rx) = mpsc::channel(8);
    match runtime.hello(&caller, SESSION, tx) {
        Err(Refused::NotLeader(NotLeader { leader: Some(l) })) => assert_eq!(l, leader),
        other => return Err(format!("expected NotLeader, got {other:?}").into()),
    }
    assert!(matches!(
        runtime.allocate(&caller, SESSION, web.clone()),
        Err(Refused::NotLeader(_))
    ));

    // Leading: the core answers; its bindings, not the read model's.
    let mut terms = runtime.terms();
    let _queues = runtime.lead(Allocator::new(cfg()?, Loaded::default(), runtime.now()));
    assert!(terms.has_changed()?);
    let _ = terms.borrow_and_update();
    let (tx, mut rx) = mpsc::channel(8);
    let stream = runtime.hello(&caller, SESSION, tx)?;
    assert!(runtime.lookup(&web).is_none());
    assert!(runtime.identity_feed().full.is_empty());
    assert!(runtime.node(&caller.node).is_some());

    // Stepping down: the stream is ended naming the leader, the old term is over,
    // and late store answers are dropped.
    runtime.follow(Some(leader.clone()));
    assert!(terms.has_changed()?);
    assert_eq!(
        rx.recv().await,
        Some(ToAgent::End(StreamEnd::NotLeader(NotLeader {
            leader: Some(leader)
        })))
    );
    let key = EndpointKey::new("default", "web-1")?;
    assert!(matches!(
        runtime.delete(&stream, 1, &key),
        Err(Refused::NotLeader(_))
    ));
    runtime.disconnect(&stream);
    runtime.store_results(
        stream.term,
        [(
            StoreOp::DeleteTombstone { id: stored },
            Err(StoreError::Unavailable {
                cause: "late",
                detail: String::new(),
            }),
        )],
    );
    assert_eq!(runtime.read(|a| a.counters().store_failures.len()), 0);
    assert_eq!(runtime.lookup(&web).map(|i| i.id), Some(stored));
    Ok(())
}

#[tokio::test]
async fn a_new_term_never_hears_of_an_old_terms_writes() -> Result<(), Box<dyn std::error::Error>> {
    let replica = Replica {
        reads: Arc::new(Fixed(
            IdentityId::new(4000).ok_or("id")?,
            "k8s:app=web".parse()?,
            broadcast::channel(4).0,
        )),
        admission: Arc::new(Anyone),
    };
    let runtime = Runtime::new_replica(
        cfg()?,
        Clock::new(),
        settings(),
        Metrics::default(),
        replica,
    );
    let _first = runtime.lead(Allocator::new(cfg()?, Loaded::default(), runtime.now()));
    let old = *runtime.terms().borrow();
    runtime.follow(None);
    let _second = runtime.lead(Allocator::new(cfg()?, Loaded::default(), runtime.now()));
    let failed = || {
        [(
            StoreOp::DeleteTombstone {
                id: IdentityId::new(260).unwrap_or(IdentityId::WORLD),
            },
            Err(StoreError::Unavailable {
                cause: "late",
                detail: String::new(),
            }),
        )]
    };
    runtime.store_results(old, failed());
    assert_eq!(runtime.read(|a| a.counters().store_failures.len()), 0);
    runtime.store_results(*runtime.terms().borrow(), failed());
    assert_eq!(runtime.read(|a| a.counters().store_failures.len()), 1);
    Ok(())
}

#[tokio::test]
async fn a_known_label_set_is_answered_at_once_with_its_identity()
-> Result<(), Box<dyn std::error::Error>> {
    let web: LabelSet = "k8s:app=web".parse()?;
    let (runtime, _queues) = Runtime::new(
        Allocator::new(cfg()?, Loaded::default(), Clock::new().now()),
        Clock::new(),
        settings(),
        Metrics::default(),
    );
    let caller = caller()?;
    let (tx, _rx) = mpsc::channel(8);
    runtime.hello(&caller, SESSION, tx)?;
    let Allocation::New(pending) = runtime.allocate(&caller, SESSION, web.clone())? else {
        return Err("a new label set is persisted first".into());
    };
    // The writer's answer, as it would come back from the store.
    let op = StoreOp::CreateIdentity {
        id: IdentityId::new(256).ok_or("id")?,
        labels: web.clone(),
    };
    runtime.store_results(0, [(op, Ok(()))]);
    let new = pending.await??;
    assert_eq!(new.info.as_ref().map(|i| i.id), Some(new.id));
    match runtime.allocate(&caller, SESSION, web)? {
        Allocation::Known(known) => {
            assert_eq!(known.id, new.id);
            assert_eq!(known.info.map(|i| i.holds), Some(1));
        }
        Allocation::New(_) => return Err("a known label set is answered at once".into()),
    }
    Ok(())
}
