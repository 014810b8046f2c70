//! `census bpf services [list|show]`: the SERVICES map, the cluster's Service
//! addresses (ClusterIP ranges, LoadBalancer and external IPs) as the agent wrote
//! them from the operator's set. A packet leaving an endpoint for one of them is
//! counted where it is seen translated, not where it leaves. Maps of a layout
//! before SERVICES (4 and older) show none.
//!
//! `census bpf services flows`: the SERVICE_FLOWS4 and SERVICE_FLOWS6 maps, packets and bytes per
//! (client identity, Service address, port, protocol, direction), summed over
//! CPUs; each address named `namespace/name` by the local agent (its admin
//! port) when the operator named it, `null` (`-` in the table) otherwise or when
//! the agent does not answer. Maps of a layout before 6 show none.

use std::{collections::BTreeMap, net::IpAddr};

use census_agent::bpf::{ServiceFlow, ServiceKind, protocol_name};
use clap::{Args, Subcommand};
use ipnet::IpNet;
use serde::Serialize;

use crate::{Ctx, error::CliError, output::Table};

/// `census bpf services`: without a verb, the list.
#[derive(Debug, Args)]
pub(crate) struct ServicesArgs {
    #[command(subcommand)]
    command: Option<ServicesCommand>,
}

#[derive(Debug, Subcommand)]
enum ServicesCommand {
    /// Every Service range, IPv4 first, by address then prefix length.
    #[command(visible_alias = "show")]
    List,
    /// Packets and bytes per client and Service (SERVICE_FLOWS4/6), named by the
    /// local agent.
    Flows,
}

/// One SERVICE_FLOWS4/6 entry, as `-o json` prints it (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ServiceFlowView {
    pub(crate) client_identity: u32,
    pub(crate) address: IpAddr,
    pub(crate) port: u16,
    /// `TCP`, `UDP`, `SCTP`, or the IP protocol's number.
    pub(crate) protocol: String,
    /// `request` or `reply`.
    pub(crate) direction: &'static str,
    /// `namespace/name`; `null` when unknown.
    pub(crate) service: Option<String>,
    pub(crate) packets: u64,
    pub(crate) bytes: u64,
}

impl ServiceFlowView {
    fn new(flow: ServiceFlow, names: &BTreeMap<IpAddr, String>) -> Self {
        Self {
            client_identity: flow.client_identity,
            address: flow.service,
            port: flow.port,
            protocol: protocol_name(flow.protocol).into_owned(),
            direction: flow.direction.name(),
            service: names.get(&flow.service).cloned(),
            packets: flow.packets,
            bytes: flow.bytes,
        }
    }
}

/// One SERVICES entry, as `-o json` prints it (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct ServiceView {
    /// CIDR form: `10.96.0.0/12`, `203.0.113.7/32`.
    pub(crate) range: String,
    /// `cluster-ip-range`, `load-balancer-ip` or `external-ip`.
    pub(crate) kind: &'static str,
}

impl ServiceView {
    fn new(range: IpNet, kind: ServiceKind) -> Self {
        Self {
            range: range.to_string(),
            kind: kind.name(),
        }
    }
}

pub(super) async fn run(args: ServicesArgs, ctx: &Ctx) -> Result<String, CliError> {
    let ServicesArgs { command } = args;
    if let Some(ServicesCommand::Flows) = command {
        return flows(ctx).await;
    }
    let maps = ctx.maps()?;
    let views: Vec<ServiceView> = maps
        .services()?
        .into_iter()
        .map(|(range, kind)| ServiceView::new(range, kind))
        .collect();
    ctx.render(&views, || table(&views))
}

async fn flows(ctx: &Ctx) -> Result<String, CliError> {
    let flows = ctx.maps()?.service_flows()?;
    // Names are the agent's: without it, every address is shown unnamed.
    let names: BTreeMap<IpAddr, String> = match ctx.agent().services().await {
        Ok(answer) => answer
            .cluster_ips
            .into_iter()
            .map(|named| (named.address, named.service))
            .collect(),
        Err(_) => BTreeMap::new(),
    };
    let views: Vec<ServiceFlowView> = flows
        .into_iter()
        .map(|flow| ServiceFlowView::new(flow, &names))
        .collect();
    ctx.render(&views, || flows_table(&views))
}

fn flows_table(flows: &[ServiceFlowView]) -> Table {
    let mut table = Table::new([
        "CLIENT",
        "SERVICE",
        "ADDRESS",
        "PROTOCOL",
        "DIRECTION",
        "PACKETS",
        "BYTES",
    ]);
    for flow in flows {
        let address = std::net::SocketAddr::new(flow.address, flow.port);
        table.row(vec![
            flow.client_identity.to_string(),
            flow.service
                .as_ref()
                .map_or_else(|| "-".to_owned(), |name| format!("{name}:{}", flow.port)),
            address.to_string(),
            flow.protocol.clone(),
            flow.direction.to_owned(),
            flow.packets.to_string(),
            flow.bytes.to_string(),
        ]);
    }
    table
}

fn table(services: &[ServiceView]) -> Table {
    let mut table = Table::new(["RANGE", "KIND"]);
    for service in services {
        table.row(vec![service.range.clone(), service.kind.to_owned()]);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{Format, render};

    fn fixture() -> Result<Vec<ServiceView>, ipnet::AddrParseError> {
        Ok(vec![
            ServiceView::new("10.96.0.0/12".parse()?, ServiceKind::ClusterIpRange),
            ServiceView::new("203.0.113.7/32".parse()?, ServiceKind::LoadBalancerIp),
            ServiceView::new("2001:db8::7/128".parse()?, ServiceKind::ExternalIp),
        ])
    }

    #[test]
    fn table_and_json() -> Result<(), Box<dyn std::error::Error>> {
        let services = fixture()?;
        let out = render(Format::Table, false, &services, || table(&services))?;
        assert_eq!(
            out,
            "\
RANGE            KIND
10.96.0.0/12     cluster-ip-range
203.0.113.7/32   load-balancer-ip
2001:db8::7/128  external-ip
"
        );
        let json = render(Format::Json, false, &services[..1], || unreachable!())?;
        assert_eq!(
            json,
            r#"[
  {
    "range": "10.96.0.0/12",
    "kind": "cluster-ip-range"
  }
]
"#
        );
        let empty = render(Format::Table, false, &[] as &[ServiceView], || table(&[]))?;
        assert_eq!(empty, "RANGE  KIND\n");
        Ok(())
    }

    #[test]
    fn flows_table_and_json_name_what_the_agent_named() -> Result<(), Box<dyn std::error::Error>> {
        let flow = |service: &str, direction| ServiceFlow {
            client_identity: 1000,
            service: service.parse().unwrap_or(IpAddr::from([0; 4])),
            port: 8053,
            protocol: 17,
            direction,
            packets: 20,
            bytes: 2120,
        };
        let names = BTreeMap::from([("10.96.0.10".parse()?, "shop/web".to_owned())]);
        let views: Vec<ServiceFlowView> = [
            flow("10.96.0.10", census_agent::bpf::ServiceDirection::Request),
            flow("10.96.0.11", census_agent::bpf::ServiceDirection::Reply),
        ]
        .into_iter()
        .map(|f| ServiceFlowView::new(f, &names))
        .collect();
        let out = render(Format::Table, false, &views, || flows_table(&views))?;
        assert_eq!(
            out,
            "\
CLIENT  SERVICE        ADDRESS          PROTOCOL  DIRECTION  PACKETS  BYTES
1000    shop/web:8053  10.96.0.10:8053  UDP       request    20       2120
1000    -              10.96.0.11:8053  UDP       reply      20       2120
"
        );
        let json = render(Format::Json, false, &views[1..], || unreachable!())?;
        assert!(json.contains("\"service\": null"), "{json}");
        Ok(())
    }
}
