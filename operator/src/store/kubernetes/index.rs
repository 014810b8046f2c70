//! The store's minimal view of its own objects: per id, the object's uid and
//! resourceVersion (for write preconditions) and what it says (a binding's labels, a
//! tombstone, or why it is invalid). Never the objects themselves.
//!
//! It is fed by the watch of the Identity objects and by the answers to census's own
//! writes. On the leader it supplies preconditions (a hint: every write is
//! conditional, so a stale entry costs a 409 and a re-read, never a wrong write); on a
//! follower it is the read model IdentityService answers from. Changes census did not
//! make become [`StoreEvent`]s for the core.
//!
//! An object being deleted (`deletionTimestamp` set, held by someone's finalizer) is
//! kept with its uid and version, but counts as neither a binding nor a tombstone: its
//! labels are free in the index, readers do not see it, and a binding that starts
//! being deleted is lost ([`StoreEvent::BindingLost`]) like a deleted one.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use census_proto::{domain::IdentityId, labels::LabelSet};
use tokio::sync::broadcast;

use super::object::{Meta, Parsed, State};
use crate::{
    allocator::{IdentityInfo, IdentityState, Timestamp, WatchChange},
    store::StoreEvent,
};

/// Watch changes buffered per read-model subscriber.
const CHANGES_BUFFER: usize = 4096;

/// Where a change to an object was learnt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// The watch, or a re-read: the change may be someone else's.
    Observed,
    /// The answer to census's own write: a binding it ended is not "lost".
    OwnWrite,
}

#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) meta: Meta,
    pub(crate) state: State,
}

impl Entry {
    /// The labels this object binds, if it is a binding not being deleted.
    fn bound(&self) -> Option<&LabelSet> {
        match &self.state {
            State::Binding(labels) if !self.meta.deleting => Some(labels),
            _ => None,
        }
    }

    /// Whether readers see it (an object being deleted is as good as gone).
    fn visible(&self) -> bool {
        !self.meta.deleting
    }
}

#[derive(Debug)]
pub(crate) struct Index {
    entries: BTreeMap<IdentityId, Entry>,
    /// Label set -> id, for bindings only.
    by_labels: HashMap<LabelSet, IdentityId>,
    /// Objects whose name is not an id (they cannot be keyed or blocked, only reported).
    bad_names: BTreeSet<Box<str>>,
    changes: broadcast::Sender<WatchChange>,
    /// The first full list is in: bindings that appear from now on are news to a core
    /// built from that list ([`StoreEvent::BindingFound`]).
    listed: bool,
}

impl Default for Index {
    fn default() -> Self {
        Self {
            entries: BTreeMap::new(),
            by_labels: HashMap::new(),
            bad_names: BTreeSet::new(),
            changes: broadcast::channel(CHANGES_BUFFER).0,
            listed: false,
        }
    }
}

/// Whether resourceVersion `new` is newer than `old`. resourceVersions are opaque; the
/// numeric comparison (etcd revisions) only keeps a late watch event from overwriting
/// a newer write answer, which would cost an extra 409, never a wrong write.
fn newer(new: &str, old: &str) -> bool {
    match (new.parse::<u64>(), old.parse::<u64>()) {
        (Ok(n), Ok(o)) => n > o,
        _ => new != old,
    }
}

impl Index {
    pub(crate) fn get(&self, id: IdentityId) -> Option<&Entry> {
        self.entries.get(&id)
    }

    /// Every object, by id.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (IdentityId, &Entry)> {
        self.entries.iter().map(|(&id, e)| (id, e))
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Objects census cannot use: invalid ones and those whose name is not an id.
    pub(crate) fn invalid_count(&self) -> usize {
        self.entries
            .values()
            .filter(|e| matches!(e.state, State::Invalid(_)))
            .count()
            + self.bad_names.len()
    }

    /// Every invalid object, by id, with what is wrong with it.
    pub(crate) fn invalid(&self) -> Vec<(IdentityId, String)> {
        self.entries
            .iter()
            .filter_map(|(id, e)| match &e.state {
                State::Invalid(why) => Some((*id, why.to_string())),
                _ => None,
            })
            .collect()
    }

    /// A new or changed object.
    pub(crate) fn apply(&mut self, p: Parsed, source: Source) -> Vec<StoreEvent> {
        let mut out = Vec::new();
        let Parsed {
            id,
            meta,
            mut state,
        } = p;
        if let Some(old) = self.entries.get(&id) {
            if old.meta.uid == meta.uid {
                if !newer(&meta.resource_version, &old.meta.resource_version) {
                    return out;
                }
                match (&old.state, &state) {
                    // Once invalid, an object stays so: census has blocked its id.
                    (State::Invalid(why), _) => state = State::Invalid(why.clone()),
                    (State::Binding(was), State::Binding(now)) if was != now => {
                        state = State::Invalid(
                            format!("its labels were edited from {was} to {now}").into(),
                        );
                    }
                    _ => {}
                }
            } else {
                // Another object under the same name: the old one is gone.
                self.remove(id, source, &mut out);
            }
        }
        if let State::Binding(labels) = &state
            && !meta.deleting
            && let Some(&other) = self.by_labels.get(labels)
            && other != id
            && let Some(entry) = self.entries.get(&other)
        {
            // Two objects claim one label set: the older one keeps it.
            let mine = (meta.created_ms, id);
            let theirs = (entry.meta.created_ms, other);
            if mine < theirs {
                let why = format!("its labels {labels} are also bound to the older identity {id}");
                let other_meta = entry.meta.clone();
                self.set(
                    other,
                    other_meta,
                    State::Invalid(why.into()),
                    source,
                    &mut out,
                );
            } else {
                state = State::Invalid(
                    format!("its labels {labels} are bound to identity {other} already").into(),
                );
            }
        }
        self.set(id, meta, state, source, &mut out);
        out
    }

    /// An object is gone. `uid` guards against a late event of an older object.
    pub(crate) fn delete(
        &mut self,
        id: IdentityId,
        uid: Option<&str>,
        source: Source,
    ) -> Vec<StoreEvent> {
        let mut out = Vec::new();
        if self
            .entries
            .get(&id)
            .is_some_and(|e| uid.is_none_or(|u| *e.meta.uid == *u))
        {
            self.remove(id, source, &mut out);
        }
        out
    }

    /// An object whose name is not an id appeared (`true`) or went away (`false`).
    /// Returns true if this is news.
    pub(crate) fn bad_name(&mut self, name: &str, present: bool) -> bool {
        if present {
            self.bad_names.insert(name.into())
        } else {
            self.bad_names.remove(name)
        }
    }

    /// The watch listed everything again: what is not listed is gone.
    pub(crate) fn reset(&mut self, listed: Vec<Parsed>, bad_names: Vec<String>) -> Vec<StoreEvent> {
        let mut out = Vec::new();
        let present: BTreeSet<IdentityId> = listed.iter().map(|p| p.id).collect();
        let gone: Vec<IdentityId> = self
            .entries
            .keys()
            .filter(|id| !present.contains(id))
            .copied()
            .collect();
        for id in gone {
            self.remove(id, Source::Observed, &mut out);
        }
        for p in listed {
            out.extend(self.apply(p, Source::Observed));
        }
        self.bad_names = bad_names.into_iter().map(Into::into).collect();
        self.listed = true;
        out
    }

    fn remove(&mut self, id: IdentityId, source: Source, out: &mut Vec<StoreEvent>) {
        let Some(old) = self.entries.remove(&id) else {
            return;
        };
        if let Some(labels) = old.bound().cloned() {
            self.unlink(id, &labels);
            let _ = self.changes.send(WatchChange::Removed {
                id,
                labels: labels.clone(),
            });
            if source == Source::Observed {
                out.push(StoreEvent::BindingLost { id, labels });
            }
        } else if let State::Tombstone {
            labels,
            labels_hash,
            until_ms,
        } = old.state
            && source == Source::Observed
        {
            // Deleted by someone else (`kubectl delete identities --all`): the core
            // writes it again while the id is still in quarantine.
            out.push(StoreEvent::TombstoneLost {
                tombstone: crate::store::Tombstone {
                    id,
                    labels_hash,
                    until_ms,
                },
                labels,
            });
        }
    }

    fn set(
        &mut self,
        id: IdentityId,
        meta: Meta,
        state: State,
        source: Source,
        out: &mut Vec<StoreEvent>,
    ) {
        let new = Entry {
            meta,
            state: state.clone(),
        };
        let now_bound = new.bound().cloned();
        let old = self.entries.insert(id, new);
        let was_bound = old.as_ref().and_then(Entry::bound).cloned();
        let old_state = old.map(|e| e.state);
        if let Some(was) = &was_bound
            && now_bound.as_ref() != Some(was)
        {
            self.unlink(id, was);
            let _ = self.changes.send(WatchChange::Removed {
                id,
                labels: was.clone(),
            });
            if source == Source::Observed && !matches!(state, State::Invalid(_)) {
                out.push(StoreEvent::BindingLost {
                    id,
                    labels: was.clone(),
                });
            }
        }
        match state {
            State::Binding(labels) if now_bound.is_some() => {
                if was_bound.as_ref() != Some(&labels) {
                    self.by_labels.insert(labels.clone(), id);
                    if source == Source::Observed && self.listed {
                        out.push(StoreEvent::BindingFound { id, labels });
                    }
                    if let Some(info) = self.identity(id) {
                        let _ = self.changes.send(WatchChange::Upsert(info));
                    }
                }
            }
            State::Invalid(why) => {
                if !matches!(old_state, Some(State::Invalid(_))) {
                    out.push(StoreEvent::BindingInvalid {
                        id,
                        found: why.to_string(),
                    });
                }
            }
            State::Binding(_) | State::Tombstone { .. } => {}
        }
    }

    /// The identity the index binds `labels` to.
    pub(crate) fn bound_to(&self, labels: &LabelSet) -> Option<IdentityId> {
        self.by_labels.get(labels).copied()
    }

    fn unlink(&mut self, id: IdentityId, labels: &LabelSet) {
        if self.by_labels.get(labels) == Some(&id) {
            self.by_labels.remove(labels);
        }
    }

    fn info(id: IdentityId, entry: &Entry) -> IdentityInfo {
        let (labels, state) = match &entry.state {
            State::Binding(labels) => (Some(labels.clone()), IdentityState::Live),
            State::Tombstone { until_ms, .. } => (
                None,
                IdentityState::Quarantined {
                    until: Timestamp::from_millis(*until_ms),
                },
            ),
            State::Invalid(_) => (None, IdentityState::Blocked),
        };
        IdentityInfo {
            id,
            labels,
            state,
            refs: 0,
            holds: 0,
        }
    }

    pub(crate) fn identity(&self, id: IdentityId) -> Option<IdentityInfo> {
        self.entries
            .get(&id)
            .filter(|e| e.visible())
            .map(|e| Self::info(id, e))
    }

    pub(crate) fn lookup(&self, labels: &LabelSet) -> Option<IdentityInfo> {
        self.by_labels.get(labels).and_then(|&id| self.identity(id))
    }

    pub(crate) fn list(
        &self,
        after: Option<IdentityId>,
        limit: usize,
        selector: Option<&LabelSet>,
        include_quarantined: bool,
    ) -> (Vec<IdentityInfo>, bool) {
        let start = after.map_or(1, |id| id.get().saturating_add(1)).max(1);
        let Some(start) = IdentityId::new(start) else {
            return (Vec::new(), false);
        };
        let mut page: Vec<IdentityInfo> = self
            .entries
            .range(start..)
            .filter(|(_, e)| e.visible())
            .filter(|(_, e)| match &e.state {
                State::Binding(labels) => selector.is_none_or(|s| labels.contains_all(s)),
                _ => include_quarantined && selector.is_none(),
            })
            .take(limit.saturating_add(1))
            .map(|(&id, e)| Self::info(id, e))
            .collect();
        let more = page.len() > limit;
        page.truncate(limit);
        (page, more)
    }

    pub(crate) fn bindings(&self) -> Vec<IdentityInfo> {
        self.entries
            .iter()
            .filter(|(_, e)| e.bound().is_some())
            .map(|(&id, e)| Self::info(id, e))
            .collect()
    }

    pub(crate) fn subscribe(&self) -> broadcast::Receiver<WatchChange> {
        self.changes.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u32) -> IdentityId {
        match IdentityId::new(n) {
            Some(id) => id,
            None => panic!("id 0"),
        }
    }

    fn labels(text: &str) -> LabelSet {
        match text.parse() {
            Ok(set) => set,
            Err(e) => panic!("test labels {text:?}: {e}"),
        }
    }

    fn parsed(n: u32, uid: &str, rv: u64, created: i64, state: State) -> Parsed {
        Parsed {
            id: id(n),
            meta: Meta {
                uid: uid.into(),
                resource_version: rv.to_string().into(),
                created_ms: created,
                deleting: false,
            },
            state,
        }
    }

    fn deleting(mut p: Parsed) -> Parsed {
        p.meta.deleting = true;
        p
    }

    #[test]
    fn an_object_being_deleted_is_neither_a_binding_nor_a_tombstone() {
        let web = labels("k8s:app=web");
        let mut index = Index::default();
        index.reset(
            vec![parsed(300, "a", 1, 0, State::Binding(web.clone()))],
            Vec::new(),
        );
        let mut changes = index.subscribe();
        // Someone deletes it while their finalizer holds it: lost, its labels free.
        let events = index.apply(
            deleting(parsed(300, "a", 2, 0, State::Binding(web.clone()))),
            Source::Observed,
        );
        assert_eq!(
            events,
            [StoreEvent::BindingLost {
                id: id(300),
                labels: web.clone()
            }]
        );
        assert!(matches!(
            changes.try_recv(),
            Ok(WatchChange::Removed { .. })
        ));
        assert!(index.lookup(&web).is_none());
        assert!(index.identity(id(300)).is_none());
        assert!(index.bindings().is_empty());
        assert!(index.get(id(300)).is_some_and(|e| e.meta.deleting));
        // Another object taking the labels meanwhile is not a duplicate of it.
        assert!(
            index
                .apply(
                    parsed(301, "b", 3, 5, State::Binding(web.clone())),
                    Source::Observed
                )
                .iter()
                .all(|e| !matches!(e, StoreEvent::BindingInvalid { .. }))
        );
        assert_eq!(index.lookup(&web).map(|i| i.id), Some(id(301)));
        // Gone at last: nothing more to report.
        assert!(
            index
                .delete(id(300), Some("a"), Source::Observed)
                .is_empty()
        );
    }

    #[test]
    fn someone_elses_delete_is_a_lost_binding_ours_is_not() {
        let web = labels("k8s:app=web");
        let mut index = Index::default();
        assert!(
            index
                .apply(
                    parsed(300, "a", 1, 0, State::Binding(web.clone())),
                    Source::Observed
                )
                .is_empty()
        );
        assert_eq!(index.lookup(&web).map(|i| i.id), Some(id(300)));
        let events = index.delete(id(300), Some("a"), Source::Observed);
        assert_eq!(
            events,
            [StoreEvent::BindingLost {
                id: id(300),
                labels: web.clone()
            }]
        );
        assert!(index.lookup(&web).is_none());

        index.apply(
            parsed(301, "b", 2, 0, State::Binding(web.clone())),
            Source::Observed,
        );
        let tomb = State::Tombstone {
            labels: Some(web.clone()),
            labels_hash: web.stable_hash(),
            until_ms: 9,
        };
        // Our own tombstone write: no event; the watch's late copy of it: nothing new.
        assert!(
            index
                .apply(parsed(301, "b", 3, 0, tomb.clone()), Source::OwnWrite)
                .is_empty()
        );
        assert!(
            index
                .apply(parsed(301, "b", 3, 0, tomb), Source::Observed)
                .is_empty()
        );
        assert!(matches!(
            index.identity(id(301)).map(|i| i.state),
            Some(IdentityState::Quarantined { .. })
        ));
    }

    #[test]
    fn edited_labels_and_duplicates_are_invalid_and_stay_so() {
        let web = labels("k8s:app=web");
        let db = labels("k8s:app=db");
        let mut index = Index::default();
        index.apply(
            parsed(300, "a", 1, 10, State::Binding(web.clone())),
            Source::Observed,
        );
        let events = index.apply(
            parsed(300, "a", 2, 10, State::Binding(db.clone())),
            Source::Observed,
        );
        assert!(
            matches!(&events[..], [StoreEvent::BindingInvalid { id: i, found }] if *i == id(300) && found.contains("edited"))
        );
        // Edited back: still invalid (its id is blocked), and no second report.
        assert!(
            index
                .apply(
                    parsed(300, "a", 3, 10, State::Binding(web.clone())),
                    Source::Observed
                )
                .is_empty()
        );
        assert!(index.lookup(&web).is_none());

        // A younger object claiming a bound label set loses; an older one wins.
        index.apply(
            parsed(400, "c", 4, 10, State::Binding(db.clone())),
            Source::Observed,
        );
        let events = index.apply(
            parsed(401, "d", 5, 20, State::Binding(db.clone())),
            Source::Observed,
        );
        assert!(matches!(&events[..], [StoreEvent::BindingInvalid { id: i, .. }] if *i == id(401)));
        let events = index.apply(
            parsed(399, "e", 6, 5, State::Binding(db.clone())),
            Source::Observed,
        );
        assert!(matches!(&events[..], [StoreEvent::BindingInvalid { id: i, .. }] if *i == id(400)));
        assert_eq!(index.lookup(&db).map(|i| i.id), Some(id(399)));
        assert_eq!(index.invalid_count(), 3);
    }

    #[test]
    fn a_reset_forgets_what_disappeared_during_the_gap() {
        let web = labels("k8s:app=web");
        let db = labels("k8s:app=db");
        let mut index = Index::default();
        index.apply(
            parsed(300, "a", 1, 0, State::Binding(web.clone())),
            Source::Observed,
        );
        index.apply(
            parsed(301, "b", 2, 0, State::Binding(db.clone())),
            Source::Observed,
        );
        let events = index.reset(
            vec![parsed(301, "b", 2, 0, State::Binding(db))],
            vec!["web".into()],
        );
        assert_eq!(
            events,
            [StoreEvent::BindingLost {
                id: id(300),
                labels: web
            }]
        );
        assert_eq!(index.len(), 1);
        assert_eq!(index.invalid_count(), 1);
    }

    #[test]
    fn followers_see_binding_changes() -> Result<(), Box<dyn std::error::Error>> {
        let web = labels("k8s:app=web");
        let mut index = Index::default();
        let mut changes = index.subscribe();
        index.apply(
            parsed(300, "a", 1, 0, State::Binding(web.clone())),
            Source::Observed,
        );
        index.delete(id(300), None, Source::Observed);
        assert_eq!(
            changes.try_recv()?,
            WatchChange::Upsert(IdentityInfo {
                id: id(300),
                labels: Some(web.clone()),
                state: IdentityState::Live,
                refs: 0,
                holds: 0,
            })
        );
        assert_eq!(
            changes.try_recv()?,
            WatchChange::Removed {
                id: id(300),
                labels: web
            }
        );
        Ok(())
    }
}
