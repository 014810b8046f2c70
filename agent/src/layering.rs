//! The agent's module layering, checked on its source: the `crate::` paths between
//! top-level modules outside test code form no circle. Run alone with
//! `cargo test -p census-agent --lib layering`. What the core may use is its own
//! crate's manifest (`agent/core`: no tokio, aya, kube or tonic), which the
//! compiler enforces.

use census_testkit::layering::{Modules, circle, tangles};

fn agent() -> Modules {
    Modules::of_crate(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn no_module_of_the_agent_imports_in_a_circle() {
    let graph = agent().graph();
    assert!(graph.contains_key("reconcile") && graph.contains_key("daemon"));
    assert_eq!(
        circle(&graph),
        None,
        "modules in circles: {:?}\n{graph:#?}",
        tangles(&graph)
    );
}
