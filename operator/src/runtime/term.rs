//! Role and term: a replica leads with a core built from the store, or follows with
//! an empty one. Every change of role starts a new term.

use std::sync::Arc;

use tokio::sync::watch;

use super::{Inner, Runtime};
use crate::{
    allocator::{AllocError, Allocator},
    api::{StreamEnd, Term, ToAgent},
    replica::{Leader, NotLeader, Role},
    store::Loaded,
    writer::WriterQueues,
};

impl Runtime {
    /// This replica leads from now on with `alloc` (built from the store): a new term.
    /// Returns the writer queues for the term's writers.
    pub fn lead(self: &Arc<Self>, alloc: Allocator) -> WriterQueues {
        let mut inner = self.inner.lock();
        inner.alloc = alloc;
        inner.role = Role::Leader;
        inner.term += 1;
        self.terms.send_replace(inner.term);
        let queues = self.writer_queues(&mut inner);
        let now = self.clock.now();
        self.dispatch(&mut inner, now);
        queues
    }

    /// This replica stops leading: a new term. Agent streams are ended (they reconnect
    /// to the leader), Allocate calls waiting for the store are answered, the writer
    /// queues close and the core is dropped. The caller stops the old term's writers
    /// first; whatever they still answer belongs to the old term and is dropped.
    pub fn follow(&self, leader: Option<Leader>) {
        let mut inner = self.inner.lock();
        let refusal = NotLeader {
            leader: leader.clone(),
        };
        for (_, tx) in inner.streams.drain() {
            let _ = tx.try_send(ToAgent::End(StreamEnd::NotLeader(Box::new(
                refusal.clone(),
            ))));
        }
        for (_, tx) in inner.replies.drain() {
            let _ = tx.send(Err(AllocError::StoreUnavailable {
                cause: "not_leader",
            }));
        }
        inner.writers = None;
        let cfg = inner.alloc.config().clone();
        inner.alloc = Allocator::new(cfg, Loaded::default(), self.clock.now());
        if inner.role.is_leader() {
            inner.term += 1;
            self.terms.send_replace(inner.term);
        }
        inner.role = Role::Follower { leader };
    }

    /// A follower learnt who leads now.
    pub fn set_leader(&self, leader: Option<Leader>) {
        let mut inner = self.inner.lock();
        if let Role::Follower { leader: known } = &mut inner.role {
            *known = leader;
        }
    }

    pub fn role(&self) -> Role {
        self.inner.lock().role.clone()
    }

    /// Changes of term, for streams that must start over when the role changes.
    pub fn terms(&self) -> watch::Receiver<Term> {
        self.terms.subscribe()
    }
}

/// A follower's refusal, if this replica does not lead.
pub(super) fn refusal(inner: &Inner) -> Option<NotLeader> {
    match &inner.role {
        Role::Leader => None,
        Role::Follower { leader } => Some(NotLeader {
            leader: leader.clone(),
        }),
    }
}

/// Whether `term` is the current term and this replica leads in it; if not, the
/// refusal for a stream or writer of an older term.
pub(super) fn current(inner: &Inner, term: Term) -> Result<(), NotLeader> {
    if inner.term != term || !inner.role.is_leader() {
        return Err(refusal(inner).unwrap_or(NotLeader { leader: None }));
    }
    Ok(())
}
