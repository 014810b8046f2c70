//! The operator's module layering, checked on its source: the `crate::` paths between
//! top-level modules outside test code form no circle; only `grpc` speaks the wire
//! (`census_proto::pb`, `tonic`); the gRPC layer reaches the operator only through
//! `api`; the runtime serves no network; the writers report over a channel, not into
//! the runtime. Run alone with `cargo test -p census-operator --lib layering`.

use std::collections::BTreeSet;

use census_testkit::layering::{Modules, circle, tangles};

/// The paths that are the wire: generated messages and the gRPC library.
const WIRE: &[&str] = &["census_proto::pb", "tonic", "tonic::Status"];

fn operator() -> Modules {
    Modules::of_crate(env!("CARGO_MANIFEST_DIR"))
}

fn uses(modules: &Modules, module: &str) -> BTreeSet<String> {
    modules.uses(module)
}

fn subset(of: &[&str]) -> BTreeSet<String> {
    of.iter().map(|m| (*m).to_owned()).collect()
}

#[test]
fn no_module_of_the_operator_imports_in_a_circle() {
    let graph = operator().graph();
    assert!(graph.contains_key("runtime") && graph.contains_key("grpc"));
    assert_eq!(
        circle(&graph),
        None,
        "modules in circles: {:?}\n{graph:#?}",
        tangles(&graph)
    );
}

#[test]
fn only_grpc_speaks_the_wire() {
    operator().files_of("grpc");
    let named = operator().naming_outside(&["grpc"], WIRE);
    assert!(named.is_empty(), "outside grpc: {named:?}");
}

/// `certs` is the verification of a presented client chain (a pure function of
/// certificates, no operator state): authentication at the wire needs it.
#[test]
fn grpc_reaches_the_operator_only_through_its_api() {
    let used = uses(&operator(), "grpc");
    assert!(
        used.is_subset(&subset(&["api", "certs", "metrics"])),
        "grpc uses {used:?}"
    );
}

#[test]
fn the_runtime_serves_no_network() {
    let named = operator().naming("runtime", &["tokio::net", "tonic"]);
    assert!(named.is_empty(), "the runtime names {named:?}");
}

#[test]
fn the_writers_report_over_a_channel() {
    let used = uses(&operator(), "writer");
    assert!(
        used.is_subset(&subset(&["store", "metrics"])),
        "writer uses {used:?}"
    );
}

#[test]
#[should_panic(expected = "has no module `gprc`")]
fn a_check_of_a_module_that_is_not_there_fails() {
    let _ = uses(&operator(), "gprc");
}
