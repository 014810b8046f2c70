//! Routing the core's effects, under the lock and without waiting: store writes to
//! the writer queues, Allocate answers to their callers, messages to agents' streams,
//! changes to Watch subscribers.

use tokio::sync::mpsc;

use super::{Inner, Runtime};
use crate::{
    allocator::{AgentMsg, ConnId, Effect, Priority, Timestamp},
    api::{Allocated, StreamEnd, ToAgent},
    store::StoreError,
};

impl Runtime {
    pub(super) fn dispatch(&self, inner: &mut Inner, now: Timestamp) {
        loop {
            let effects = inner.alloc.drain_effects();
            if effects.is_empty() {
                return;
            }
            for effect in effects {
                match effect {
                    Effect::Store { op, priority } => {
                        let queue = inner.writers.as_ref().map(|w| match priority {
                            Priority::Allocation => &w.allocation,
                            Priority::Gc => &w.gc,
                        });
                        let sent = match queue {
                            Some(q) => q.try_send(op).map_err(|e| match e {
                                mpsc::error::TrySendError::Full(op) => (op, "queue_full"),
                                mpsc::error::TrySendError::Closed(op) => (op, "shutdown"),
                            }),
                            None => Err((op, "shutdown")),
                        };
                        if let Err((op, cause)) = sent {
                            // The core retries with backoff, like any failed write.
                            let err = StoreError::Unavailable {
                                cause,
                                detail: "the writer queue refused the op".into(),
                            };
                            inner.alloc.store_result(op, Err(err), now);
                        }
                    }
                    Effect::Reply { req, result } => {
                        if let Some(tx) = inner.replies.remove(&req) {
                            let answer = result.map(|id| Allocated {
                                id,
                                info: inner.alloc.identity(id),
                            });
                            let _ = tx.send(answer);
                        }
                    }
                    Effect::Agent { conn, msg, .. } => self.to_agent(inner, conn, msg),
                    Effect::Watch(change) => {
                        let _ = self.watch.send(change);
                    }
                }
            }
        }
    }

    fn to_agent(&self, inner: &mut Inner, conn: ConnId, msg: AgentMsg) {
        let Some(tx) = inner.streams.get(&conn) else {
            return;
        };
        let msg = match msg {
            AgentMsg::Rebind { key, identity } => {
                self.metrics.rebinds_sent.inc();
                ToAgent::Rebind { key, identity }
            }
            AgentMsg::SnapshotNow => ToAgent::SnapshotNow,
            AgentMsg::Close(reason) => {
                let _ = tx.try_send(ToAgent::End(StreamEnd::Closed(reason)));
                inner.streams.remove(&conn);
                return;
            }
        };
        if tx.try_send(msg).is_err() {
            // The agent is not reading. Rebinds are sent again after its next snapshot.
            self.metrics.agent_messages_dropped.inc();
        }
    }
}
