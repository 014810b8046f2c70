//! How collections give memory back: the rules every map and queue of the core
//! follows once a burst is over, kept in one place so they agree and can be tested
//! at their edges.

use std::collections::HashMap;

/// Shrinks a map that is using under a quarter of its capacity.
///
/// It shrinks to the smallest capacity that holds its entries, the capacity the map
/// would have had if it had only ever grown to them, so memory after a burst comes
/// back to where it would have been without it. The quarter threshold keeps a map
/// that hovers around a size from growing and shrinking over and over.
pub(crate) fn shrink_map<K: std::hash::Hash + Eq, V>(map: &mut HashMap<K, V>) {
    if oversized(map.len(), map.capacity(), 16) {
        map.shrink_to_fit();
    }
}

/// Whether a collection of `len` items in `capacity` gives memory back: it uses under
/// a quarter of a capacity above `floor` (below it, shrinking is not worth a
/// reallocation).
pub(crate) fn oversized(len: usize, capacity: usize, floor: usize) -> bool {
    capacity > floor && len < capacity / 4
}

/// Gives a map at rest the capacity a map built for its entries would have.
///
/// For maps that are sometimes rebuilt to size and sometimes grown entry by entry
/// (a node's view: a changed snapshot rebuilds it, deltas grow it): called when the
/// map is known to be at rest, so its capacity ends up depending on its length
/// alone and not on which path changed it last. A map built for its entries holds
/// under twice their number, so one call settles it and the next finds nothing to do.
pub(crate) fn settle_map<K: std::hash::Hash + Eq, V>(map: &mut HashMap<K, V>) {
    if unsettled(map.len(), map.capacity()) {
        map.shrink_to_fit();
    }
}

/// Whether a map of `len` entries in `capacity` holds more than one built for them
/// would: twice their number, and never less than 16.
pub(crate) fn unsettled(len: usize, capacity: usize) -> bool {
    capacity > 2 * len.max(8)
}

/// The capacity a queue of `len` items shrinks to: room for as many again, so the
/// pushes that follow do not reallocate at once.
pub(crate) fn room_for(len: usize) -> usize {
    len * 2
}
