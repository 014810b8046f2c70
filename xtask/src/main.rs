//! census's developer tasks: `cargo xtask <command>`.
//!
//! One module per command; each has an `Options` (clap `Args`) and a `run`.

mod bench_classifier;
mod cmd;
mod codegen;
mod ebpf;
mod privileged;
mod setup;
mod test;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "census's developer tasks"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Install what building and testing the eBPF side needs (Debian packages,
    /// bpf-linker); idempotent.
    Setup(setup::Options),
    /// Build the eBPF object (agent-ebpf) with Debian's toolchain and bpf-linker.
    BuildEbpf(ebpf::Options),
    /// Build the privileged tests and run them as root.
    TestPrivileged(privileged::Options),
    /// Measure the classifier's cost per packet (BPF_PROG_TEST_RUN), as root.
    BenchClassifier(bench_classifier::Options),
    /// Run the whole test suite, as CI does (set-up, eBPF build, checks, tests, privileged suite).
    Test(test::Options),
    /// Regenerate the protobuf code under proto/src/generated/.
    Codegen(codegen::Options),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Setup(options) => setup::run(options),
        Command::BuildEbpf(options) => ebpf::run(options),
        Command::TestPrivileged(options) => privileged::run(options),
        Command::BenchClassifier(options) => bench_classifier::run(options),
        Command::Test(options) => test::run(options),
        Command::Codegen(options) => codegen::run(options),
    }
}
