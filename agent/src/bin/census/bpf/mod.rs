//! `census bpf`: the maps pinned on this node, read straight from bpffs (read-only,
//! nothing loaded), so these verbs work while the agent and the operator are down.

mod endpoints;
mod flows;
mod interfaces;
mod maps;

use clap::Subcommand;

use super::{Ctx, error::CliError};

#[derive(Debug, Subcommand)]
pub(crate) enum BpfCommand {
    /// The pinned maps: name, type, key and value size, max and current entries,
    /// layout version, pin path.
    Maps,
    /// The ENDPOINTS map: address -> identity, flags.
    #[command(subcommand)]
    Endpoints(endpoints::EndpointsCommand),
    /// The INTERFACES map: the interfaces census counts on -> the identity of the
    /// endpoint behind each.
    #[command(subcommand)]
    Interfaces(interfaces::InterfacesCommand),
    /// The FLOWS map: packets and bytes per (source, destination) identity pair,
    /// summed over CPUs.
    #[command(subcommand)]
    Flows(flows::FlowsCommand),
}

pub(crate) async fn run(command: BpfCommand, ctx: &mut Ctx) -> Result<String, CliError> {
    match command {
        BpfCommand::Maps => maps::run(ctx),
        BpfCommand::Endpoints(command) => endpoints::run(command, ctx).await,
        BpfCommand::Interfaces(command) => interfaces::run(command, ctx).await,
        BpfCommand::Flows(command) => flows::run(command, ctx).await,
    }
}
