//! `census bpf`: the maps pinned on this node, read straight from bpffs (read-only,
//! nothing loaded), so these verbs work while the agent and the operator are down.
//!
//! As with bpftool, every group takes `list` and its synonym `show`, and the bare
//! group is its list: `census bpf flows` is `census bpf flows list`.

mod endpoints;
mod flows;
mod interfaces;
mod maps;
mod nodes;
mod services;

use clap::Subcommand;

use super::{Ctx, error::CliError};

#[derive(Debug, Subcommand)]
pub(crate) enum BpfCommand {
    /// The pinned maps: name, type, key and value size, max and current entries,
    /// layout version, pin path; FLOWS' inserts, evictions and refused inserts.
    Maps(maps::MapsArgs),
    /// The ENDPOINTS map: address -> identity, flags, and the node of a remote
    /// endpoint.
    Endpoints(endpoints::EndpointsArgs),
    /// The NODES map: the other nodes remote endpoints are on -> name, addresses.
    Nodes(nodes::NodesArgs),
    /// The SERVICES map: the cluster's Service addresses (ClusterIP ranges,
    /// LoadBalancer and external IPs) -> kind; `flows`: the SERVICE_FLOWS4 and SERVICE_FLOWS6 maps,
    /// packets and bytes per client and Service.
    Services(services::ServicesArgs),
    /// The INTERFACES map: the interfaces census counts on -> the identity of the
    /// endpoint behind each.
    Interfaces(interfaces::InterfacesArgs),
    /// The FLOWS map: packets and bytes per (source, destination) identity pair,
    /// summed over CPUs.
    Flows(flows::FlowsArgs),
}

pub(crate) async fn run(command: BpfCommand, ctx: &mut Ctx) -> Result<String, CliError> {
    match command {
        BpfCommand::Maps(args) => maps::run(args, ctx),
        BpfCommand::Endpoints(args) => endpoints::run(args, ctx).await,
        BpfCommand::Nodes(args) => nodes::run(args, ctx),
        BpfCommand::Services(args) => services::run(args, ctx).await,
        BpfCommand::Interfaces(args) => interfaces::run(args, ctx).await,
        BpfCommand::Flows(args) => flows::run(args, ctx).await,
    }
}
