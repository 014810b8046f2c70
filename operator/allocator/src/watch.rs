//! What IdentityService.Watch is told: every change of an identity's state,
//! references or holds, coalesced per identity between two drains of the effects.
//!
//! Nothing here is called where an identity changes. Every change goes through
//! [`super::identities::Identities::get_mut`] (or creates an entry), which notes the
//! id with what Watch was shown of it before; the drain compares and sends one
//! Upsert per identity that shows something new. A snapshot of 110 endpoints costs
//! one event per identity it changed, and a change undone within one event costs
//! none. Removed is queued where a binding goes, with its id and labels only.

use super::{Core, Effect, WatchChange, identities::Phase};

impl Core {
    /// Queues an Upsert, with the identity as it is now, for every identity touched
    /// since the last drain that shows a new state, reference count or hold count.
    /// A binding is first shown once persisted (so a Removed is owed from then on).
    ///
    /// The restart fence shows unwanted live identities as protected; when it ends,
    /// every one of them is released, so that change is seen as theirs too.
    pub(super) fn flush_watch(&mut self) {
        for (id, before) in self.ids.take_touched() {
            let Some(entry) = self.ids.get(id) else {
                // Gone: its Removed was queued when it went (if it had been shown).
                continue;
            };
            let show = if entry.announced {
                self.ids.changed_since(id, before)
            } else {
                !matches!(entry.phase, Phase::Creating { .. })
            };
            if !show {
                continue;
            }
            let info = self.info(id, entry);
            self.ids.mark_announced(id);
            self.fx.push(Effect::Watch(WatchChange::Upsert(info)));
        }
    }
}
