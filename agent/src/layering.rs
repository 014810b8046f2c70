//! The agent's module layering, checked on its source: the `crate::` paths between
//! top-level modules outside test code form no circle, and the core names no
//! shell. Run alone with `cargo test -p census-agent --lib layering`.

use std::collections::BTreeSet;

use census_testkit::layering::{Modules, circle, tangles};

/// The modules the core may use: the source's event types (plain data) and nothing
/// that does I/O or speaks the wire.
const CORE_MAY_USE: &[&str] = &["source"];

fn agent() -> Modules {
    Modules::of_crate(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn no_module_of_the_agent_imports_in_a_circle() {
    let graph = agent().graph();
    assert!(graph.contains_key("core") && graph.contains_key("daemon"));
    assert_eq!(
        circle(&graph),
        None,
        "modules in circles: {:?}\n{graph:#?}",
        tangles(&graph)
    );
}

#[test]
fn the_core_names_no_shell() {
    let graph = agent().graph();
    assert!(graph.contains_key("core"), "the agent has no module `core`");
    let used = graph.get("core").cloned().unwrap_or_default();
    let allowed: BTreeSet<String> = CORE_MAY_USE.iter().map(|m| (*m).to_owned()).collect();
    assert!(used.is_subset(&allowed), "the core uses {used:?}");
}

#[test]
fn the_core_does_no_io_and_speaks_no_wire() {
    let modules = agent();
    let core = modules.files_of("core");
    assert!(!core.is_empty(), "no core found");
    for file in core {
        for word in [
            "tokio",
            "tonic",
            "pb::",
            "std::fs",
            "std::net::Tcp",
            "Instant",
            "SystemTime",
        ] {
            assert!(
                !file.code.contains(word),
                "{} uses {word}",
                file.path.display()
            );
        }
    }
}
