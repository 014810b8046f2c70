//! What the generated runs do: the world each run is set in, and the actions.

use std::time::Duration;

use proptest::prelude::*;

use super::super::{IdRange, Liveness, ms, small_config};
use super::{AGENTS, PODS};

/// The world a run is set in: the core's configuration, and how an operator restart
/// goes (its clock may have stepped back; with an empty store, new ids wait for an
/// adoption window).
#[derive(Debug, Clone)]
pub(super) struct Setup {
    /// A range of 12 ids (so runs exhaust it), or the usual 768.
    pub(super) small_range: bool,
    /// A hold quota of 3 (so runs reach it), or 64.
    pub(super) small_quota: bool,
    /// In a cluster (nodes go stale and are dropped after the stale-view limit or
    /// when their Node goes), or embedded (silence drops a node's view).
    pub(super) cluster: bool,
    /// The adoption window after a restart on an empty store.
    pub(super) window: Duration,
}

/// The stale-view limit of a run in a cluster.
pub(super) const STALE_VIEW_LIMIT: Duration = Duration::from_millis(6_000);

impl Setup {
    pub(super) fn config(&self) -> super::super::Config {
        let mut cfg = small_config();
        if self.small_range {
            cfg.range = IdRange::new(256, 267).unwrap_or_default();
        }
        if self.small_quota {
            cfg.max_holds_per_node = 3;
        }
        if self.cluster {
            cfg.liveness = Liveness::Cluster {
                stale_view_limit: STALE_VIEW_LIMIT,
            };
        }
        cfg.adoption_window = self.window;
        cfg
    }
}

pub(super) fn arb_setup() -> impl Strategy<Value = Setup> {
    (
        proptest::bool::weighted(0.25),
        proptest::bool::weighted(0.25),
        proptest::bool::weighted(0.4),
        prop_oneof![Just(0u64), Just(2_000)],
    )
        .prop_map(|(small_range, small_quota, cluster, window)| Setup {
            small_range,
            small_quota,
            cluster,
            window: ms(window),
        })
}

/// What happens to a message an agent sends.
#[derive(Debug, Clone)]
pub(super) enum Fate {
    Deliver,
    Drop,
    Duplicate,
    /// Deliver the one behind it first.
    Swap,
    /// Let this many messages behind it overtake it.
    Delay(usize),
}

/// How the store answers a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Answer {
    Ok,
    /// Not written: unavailable.
    Fail,
    /// Written, but the answer is an error (a timeout after the commit).
    CommitThenFail,
    /// Answered with an error now, written later (`Action::LateCommit`).
    Late,
}

/// How a Rebind the core sends reaches its agent.
#[derive(Debug, Clone, Copy)]
pub(super) enum RebindFate {
    Deliver,
    Drop,
    /// Behind every message queued after it.
    Delay,
}

#[derive(Debug, Clone)]
pub(super) enum Action {
    /// The pod runs with this label set (0..4 shared, 4.. unique per run).
    Want {
        agent: usize,
        pod: u8,
        labels: u8,
    },
    Unwant {
        agent: usize,
        pod: u8,
    },
    /// The pod comes back with the labels it last had, and its agent allocates (a
    /// rollout, or a Job re-run): races GC deleting the identity it left behind.
    Rewant {
        agent: usize,
        pod: u8,
    },
    Allocate {
        agent: usize,
        pod: u8,
    },
    /// Many Job pods start at once, their identities are allocated and reported, and
    /// then they finish: maps grow, and must give the memory back at rest. `early`:
    /// they finish before their Allocates are answered, and the agent's next
    /// snapshot says it gave the allocations up.
    Burst {
        agent: usize,
        pods: u8,
        early: bool,
    },
    Send {
        agent: usize,
        fate: Fate,
    },
    /// The next Rebind queued for the agent.
    Rebind {
        agent: usize,
        fate: RebindFate,
    },
    /// A snapshot; `duplicate` repeats its last entry (the wire layer refuses such
    /// a snapshot; the core defines it: the first entry counts).
    Snapshot {
        agent: usize,
        duplicate: bool,
    },
    Reconnect {
        agent: usize,
    },
    /// A new agent process: a new session, whose clock may have stepped back (an
    /// older session); the old process's stream closed, or is left half-open.
    /// `down`: no agent ran for longer than the core keeps a silent node's view (its
    /// identities collected meanwhile). `relabel` (pick, labels): the labels of one
    /// of its pods (the pick-th it holds) changed while no agent ran.
    RestartAgent {
        agent: usize,
        step_back: bool,
        half_open: bool,
        down: bool,
        relabel: Option<(u8, u8)>,
    },
    /// The transport's keepalive closes a half-open stream.
    KeepaliveTimeout {
        agent: usize,
    },
    RestartOperator {
        commit_mask: u8,
        wipe_store: bool,
        /// The new process's clock is behind the old one's by this much.
        step_back_ms: u16,
    },
    /// Something rewrote the agent's map entry behind its back (`id` 0: to an id the
    /// store quarantines, if any).
    Corrupt {
        agent: usize,
        pod: u8,
        id: u32,
    },
    /// The allocation writer (or the GC writer) answers its next ops.
    Store {
        ops: u8,
        answer: Answer,
        gc: bool,
    },
    /// The oldest write answered with an error lands in the store now.
    LateCommit,
    /// The store's watch reports its next changes to the core.
    StoreWatch {
        events: u8,
    },
    /// Someone deletes an identity object (`kubectl delete identity`).
    DeleteObject {
        pick: u8,
    },
    /// Someone edits an identity object's labels: invalid for its id.
    EditObject {
        pick: u8,
    },
    /// A binding census did not write appears (a backup restored, a GitOps re-sync).
    ForeignBinding {
        offset: u16,
        labels: u8,
    },
    /// The agent's Node object is deleted (in a cluster).
    NodeGone {
        agent: usize,
    },
    Tick {
        ms: u16,
    },
    /// Someone deletes every tombstone in the store (`kubectl delete identities
    /// --all`); the store's watch reports each to the core.
    LoseTombstones,
}

pub(super) fn arb_action() -> impl Strategy<Value = Action> {
    let agent = 0..AGENTS;
    prop_oneof![
        8 => (agent.clone(), 0..PODS, 0u8..8).prop_map(|(agent, pod, labels)| Action::Want { agent, pod, labels }),
        6 => (agent.clone(), 0..PODS).prop_map(|(agent, pod)| Action::Unwant { agent, pod }),
        6 => (agent.clone(), 0..PODS).prop_map(|(agent, pod)| Action::Rewant { agent, pod }),
        8 => (agent.clone(), 0..PODS).prop_map(|(agent, pod)| Action::Allocate { agent, pod }),
        1 => (agent.clone(), 4u8..40, any::<bool>()).prop_map(|(agent, pods, early)| Action::Burst { agent, pods, early }),
        12 => (agent.clone(), prop_oneof![
            8 => Just(Fate::Deliver),
            4 => Just(Fate::Drop),
            2 => Just(Fate::Duplicate),
            2 => Just(Fate::Swap),
            2 => (2usize..6).prop_map(Fate::Delay),
        ]).prop_map(|(agent, fate)| Action::Send { agent, fate }),
        12 => (agent.clone(), prop_oneof![
            2 => Just(RebindFate::Deliver), 1 => Just(RebindFate::Drop), 1 => Just(RebindFate::Delay)
        ]).prop_map(|(agent, fate)| Action::Rebind { agent, fate }),
        10 => (agent.clone(), proptest::bool::weighted(0.2))
            .prop_map(|(agent, duplicate)| Action::Snapshot { agent, duplicate }),
        2 => agent.clone().prop_map(|agent| Action::Reconnect { agent }),
        2 => (agent.clone(), proptest::bool::weighted(0.3), any::<bool>(), proptest::bool::weighted(0.3), proptest::option::weighted(0.4, (any::<u8>(), 0u8..8)))
            .prop_map(|(agent, step_back, half_open, down, relabel)| Action::RestartAgent { agent, step_back, half_open, down, relabel }),
        1 => agent.clone().prop_map(|agent| Action::KeepaliveTimeout { agent }),
        2 => (any::<u8>(), proptest::bool::weighted(0.5), prop_oneof![Just(0u16), Just(0), Just(700), Just(5_000)])
            .prop_map(|(commit_mask, wipe_store, step_back_ms)| Action::RestartOperator { commit_mask, wipe_store, step_back_ms }),
        5 => (agent.clone(), 0..PODS, prop_oneof![256u32..280, 1020u32..1030, 1u32..4, 5000u32..5001, Just(0u32), Just(0u32)])
            .prop_map(|(agent, pod, id)| Action::Corrupt { agent, pod, id }),
        8 => (1u8..6, prop_oneof![
            10 => Just(Answer::Ok), 2 => Just(Answer::Fail), 1 => Just(Answer::CommitThenFail), 1 => Just(Answer::Late)
        ], any::<bool>())
            .prop_map(|(ops, answer, gc)| Action::Store { ops, answer, gc }),
        1 => Just(Action::LateCommit),
        4 => (1u8..4).prop_map(|events| Action::StoreWatch { events }),
        1 => any::<u8>().prop_map(|pick| Action::DeleteObject { pick }),
        1 => any::<u8>().prop_map(|pick| Action::EditObject { pick }),
        1 => (any::<u16>(), 0u8..8).prop_map(|(offset, labels)| Action::ForeignBinding { offset, labels }),
        1 => agent.prop_map(|agent| Action::NodeGone { agent }),
        8 => (1u16..3000).prop_map(|ms| Action::Tick { ms }),
        2 => Just(Action::LoseTombstones),
    ]
}
