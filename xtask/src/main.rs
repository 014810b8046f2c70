//! census's developer tasks: `cargo xtask <command>`.
//!
//! One module per command; each has an `Options` (clap `Args`) and a `run`.

mod bench;
mod bench_agent;
mod bench_classifier;
mod cluster;
mod cmd;
mod codegen;
mod demo;
mod disk;
mod ebpf;
mod images;
mod mutants;
mod privileged;
mod setup;
mod test;
mod test_kernel;

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
    /// The README's main job: set up, build, and run census on this machine (operator,
    /// agent, labelled pods in network namespaces, traffic, identities and counters), then
    /// clean up. Without root, runs the part that needs none. `--cluster`: the same story
    /// on a local Kubernetes control plane (Deployments, a burst of Jobs, identities
    /// back to the live set), as root and with Go.
    Demo(demo::Options),
    /// Install what building and testing the eBPF side needs (Debian packages,
    /// bpf-linker); idempotent.
    Setup(setup::Options),
    /// Build the eBPF object (agent-ebpf) with Debian's toolchain and bpf-linker.
    BuildEbpf(ebpf::Options),
    /// Build the privileged tests and run them as root.
    TestPrivileged(privileged::Options),
    /// Run the privileged suite on Debian 12's 6.1 kernel under qemu/KVM, as root; not
    /// part of `cargo xtask test`.
    TestKernel(test_kernel::Options),
    /// Measure the agent: reconcile throughput at 1,000 endpoints, endpoints-file-to-map
    /// latency (p50/p99), RSS at 110 endpoints; as root.
    BenchAgent(bench_agent::Options),
    /// Measure the classifier's cost per packet (BPF_PROG_TEST_RUN), as root.
    BenchClassifier(bench_classifier::Options),
    /// Run the whole test suite, as CI does (set-up, eBPF build, checks, tests, privileged suite).
    Test(test::Options),
    /// Regenerate the protobuf code under proto/src/generated/.
    Codegen(codegen::Options),
    /// Benchmark a real census-operator with simulated agents (presets: churn-short,
    /// churn-long, scale-1k, scale-5k, map-1k, map-5k, alloc, floor, gc, restart, abuse), or
    /// census as in a cluster on a real control plane, replaying the field reports, as
    /// root (seeds, seed-leak, seed-leak-short, seed-gc, seed-cache, seed-uid); results in
    /// results/.
    ///
    /// Builds census-bench (bench/) and the operator in release and runs it with these
    /// arguments.
    Bench(bench::Options),
    /// Build the operator and agent images (deploy/images/) from release binaries built
    /// here, on a Debian 12 base made with mmdebstrap, and smoke-run them with podman;
    /// as root. Not part of `cargo xtask test`.
    Images(images::Options),
    /// Mutation testing of the allocator core (cargo-mutants, installed if missing):
    /// by shard and time bound, carrying on from earlier runs; caught / missed /
    /// timeout / unviable. `--in-diff`: only the lines the change touches.
    Mutants(mutants::Options),
    /// A real Kubernetes control plane on loopback (etcd, kube-apiserver,
    /// kube-controller-manager, kube-scheduler, kwok), built from the pinned upstream
    /// modules in test-support/control-plane: up, down, status, env, pin.
    Cluster(cluster::Options),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Demo(options) => demo::run(options),
        Command::Setup(options) => setup::run(options),
        Command::BuildEbpf(options) => ebpf::run(options),
        Command::TestPrivileged(options) => privileged::run(options),
        Command::TestKernel(options) => test_kernel::run(options),
        Command::BenchAgent(options) => bench_agent::run(options),
        Command::BenchClassifier(options) => bench_classifier::run(options),
        Command::Test(options) => test::run(options),
        Command::Codegen(options) => codegen::run(options),
        Command::Bench(options) => bench::run(options),
        Command::Images(options) => images::run(options),
        Command::Mutants(options) => mutants::run(options),
        Command::Cluster(options) => cluster::run(options),
    }
}
