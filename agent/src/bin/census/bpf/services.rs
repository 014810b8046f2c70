//! `census bpf services [list|show]`: the SERVICES map, the cluster's Service
//! addresses (ClusterIP ranges, LoadBalancer and external IPs) as the agent wrote
//! them from the operator's set. A packet leaving an endpoint for one of them is
//! counted where it is seen translated, not where it leaves. Maps of a layout
//! before SERVICES (4 and older) show none.

use census_agent::bpf::ServiceKind;
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

pub(super) fn run(args: ServicesArgs, ctx: &Ctx) -> Result<String, CliError> {
    let ServicesArgs { command } = args;
    let (Some(ServicesCommand::List) | None) = command;
    let maps = ctx.maps()?;
    let views: Vec<ServiceView> = maps
        .services()?
        .into_iter()
        .map(|(range, kind)| ServiceView::new(range, kind))
        .collect();
    ctx.render(&views, || table(&views))
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
}
