//! Embeds the eBPF object built by `cargo xtask build-ebpf`, when it exists.
//!
//! The object is never built from here: it needs another toolchain (see
//! DESIGN.md, "Building the eBPF side"). Without it the agent still builds, with
//! the `census_ebpf_object` cfg unset, and `census_agent::bpf` fails at run time
//! with a message naming the command to run. `CENSUS_EBPF_OBJECT=<path>` embeds
//! another object instead, or, pointing at a missing file, builds the agent as if
//! the object were absent.

use std::{env, path::PathBuf};

const OBJECT_ENV: &str = "CENSUS_EBPF_OBJECT";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(census_ebpf_object)");
    println!("cargo::rerun-if-env-changed={OBJECT_ENV}");

    let object = match env::var_os(OBJECT_ENV) {
        Some(path) => PathBuf::from(path),
        None => {
            let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
            manifest_dir.join("../agent-ebpf/target/bpfel-unknown-none/release/census-ebpf")
        }
    };
    // A missing file makes cargo rerun this script on every build, which is what
    // lets the object be picked up as soon as it is built. (cargo compares
    // modification times: an older copy put back in place needs a `touch`.)
    println!("cargo::rerun-if-changed={}", object.display());

    if object.is_file() {
        println!("cargo::rustc-cfg=census_ebpf_object");
        println!(
            "cargo::rustc-env=CENSUS_EBPF_OBJECT_PATH={}",
            object.display()
        );
    } else {
        println!(
            "cargo::warning=the eBPF object is not built ({} is missing): the agent builds, \
             but loading the datapath fails until you run `cargo xtask build-ebpf`",
            object.display()
        );
    }
}
