//! `census`: bpftool-style inspection of a node's pinned maps, the local agent and the
//! operator. Everything lives in [`census_agent::cli`].
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    census_agent::cli::main()
}
