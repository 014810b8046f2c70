//! The rules by which the core's maps and queues give memory back, at their edges,
//! and a node's view giving back what a burst of deltas grew it to.

use super::{
    super::capacity::{oversized, room_for, unsettled},
    *,
};

#[test]
fn a_collection_shrinks_under_a_quarter_of_a_capacity_above_its_floor() {
    assert!(!oversized(0, 16, 16), "at the floor, even empty");
    assert!(oversized(0, 17, 16), "above it, empty");
    assert!(oversized(3, 17, 16), "3 of 17 is under a quarter");
    assert!(!oversized(4, 17, 16), "4 of 17 is not");
    assert!(!oversized(16, 64, 64));
    assert!(oversized(15, 65, 64));
    assert!(!oversized(16, 65, 64));
}

#[test]
fn a_map_at_rest_keeps_twice_its_entries_and_never_less_than_sixteen() {
    assert!(!unsettled(0, 16));
    assert!(unsettled(0, 17));
    assert!(!unsettled(20, 40));
    assert!(unsettled(20, 41));
}

#[test]
fn a_shrunk_queue_keeps_room_for_as_many_again() {
    assert_eq!(room_for(0), 0);
    assert_eq!(room_for(10), 20);
}

#[test]
fn a_view_gives_back_what_a_burst_of_deltas_grew_it_to() {
    let mut h = Harness::new(small_config());
    let (s, c) = connected(&mut h, N1, 10);
    let x = ok(h.allocate_now(N1, s, "app=a")).get();
    for i in 0..200u64 {
        ok(h.upsert(N1, c, i + 1, mk_endpoint(&format!("e{i}"), x, "app=a")));
    }
    let view = |h: &Harness| match h.alloc.nodes.get(&node(N1)) {
        Some(n) => (n.view.len(), n.view.capacity()),
        None => panic!("{N1} is gone"),
    };
    assert!(view(&h).1 >= 200);
    for i in 5..200u64 {
        ok(h.delete(N1, c, i + 200, &format!("e{i}")));
    }
    let (len, capacity) = view(&h);
    assert_eq!(len, 5);
    assert!(capacity < 32, "the view kept a capacity of {capacity}");
}
