//! `census bpf flows [list|show]`: the FLOWS map, packets and bytes per (source identity,
//! destination identity), summed over CPUs.

use census_agent::bpf::Flow;
use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;

use crate::{Ctx, args::parse_identity, error::CliError, operator::IdentityLabels, output::Table};

/// `census bpf flows`: without a verb, the list.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct FlowsArgs {
    #[command(subcommand)]
    command: Option<FlowsCommand>,
    #[command(flatten)]
    list: ListArgs,
}

#[derive(Debug, Subcommand)]
enum FlowsCommand {
    /// Every identity pair's counters, summed over CPUs.
    #[command(visible_alias = "show")]
    List(ListArgs),
}

#[derive(Debug, Args)]
pub(crate) struct ListArgs {
    /// Largest first by this counter (default: by source, then destination identity).
    #[arg(long, value_enum)]
    sort: Option<SortBy>,
    /// Only pairs with this identity as source or destination.
    #[arg(long, value_name = "ID")]
    identity: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SortBy {
    Packets,
    Bytes,
}

/// One identity pair, as `-o json` prints it (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct FlowView {
    pub(crate) src_identity: u32,
    pub(crate) dst_identity: u32,
    /// Packets, GSO segments counted one by one.
    pub(crate) packets: u64,
    /// Bytes: every segment's link-layer bytes (a GSO packet's repeated headers
    /// included).
    pub(crate) bytes: u64,
}

impl From<Flow> for FlowView {
    fn from(flow: Flow) -> Self {
        let Flow {
            src_identity,
            dst_identity,
            packets,
            bytes,
        } = flow;
        Self {
            src_identity,
            dst_identity,
            packets,
            bytes,
        }
    }
}

pub(super) async fn run(args: FlowsArgs, ctx: &mut Ctx) -> Result<String, CliError> {
    let FlowsArgs { command, list } = args;
    let ListArgs { sort, identity } = match command {
        Some(FlowsCommand::List(list)) => list,
        None => list,
    };
    let identity = identity.as_deref().map(parse_identity).transpose()?;
    let maps = ctx.maps()?;
    let mut flows: Vec<FlowView> = maps
        .flows()?
        .into_iter()
        .map(FlowView::from)
        .filter(|flow| identity.is_none_or(|id| flow.src_identity == id || flow.dst_identity == id))
        .collect();
    sort_flows(&mut flows, sort);
    let labels = ctx
        .labels(
            flows
                .iter()
                .flat_map(|flow| [flow.src_identity, flow.dst_identity]),
        )
        .await;
    ctx.render(&flows, || table(&flows, &labels))
}

fn sort_flows(flows: &mut [FlowView], sort: Option<SortBy>) {
    let pair = |flow: &FlowView| (flow.src_identity, flow.dst_identity);
    match sort {
        None => flows.sort_by_key(pair),
        Some(SortBy::Packets) => {
            flows.sort_by(|a, b| b.packets.cmp(&a.packets).then(pair(a).cmp(&pair(b))));
        }
        Some(SortBy::Bytes) => {
            flows.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(pair(a).cmp(&pair(b))));
        }
    }
}

fn table(flows: &[FlowView], labels: &IdentityLabels) -> Table {
    let mut header = vec!["SRC", "DST", "PACKETS", "BYTES"];
    if labels.shown() {
        header.extend(["SRC LABELS", "DST LABELS"]);
    }
    let mut table = Table::new(header);
    for flow in flows {
        let mut row = vec![
            flow.src_identity.to_string(),
            flow.dst_identity.to_string(),
            flow.packets.to_string(),
            flow.bytes.to_string(),
        ];
        if labels.shown() {
            row.push(labels.cell(flow.src_identity));
            row.push(labels.cell(flow.dst_identity));
        }
        table.row(row);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{Format, render};

    fn fixture() -> Vec<FlowView> {
        let flow = |src_identity, dst_identity, packets, bytes| FlowView {
            src_identity,
            dst_identity,
            packets,
            bytes,
        };
        vec![
            flow(4711, 4712, 50, 7100),
            flow(2, 4712, 3, 9000),
            flow(4712, 4711, 50, 7000),
        ]
    }

    #[test]
    fn sorted_by_pair_packets_or_bytes() {
        let order = |sort| {
            let mut flows = fixture();
            sort_flows(&mut flows, sort);
            flows
                .iter()
                .map(|f| (f.src_identity, f.dst_identity))
                .collect::<Vec<_>>()
        };
        assert_eq!(order(None), [(2, 4712), (4711, 4712), (4712, 4711)]);
        assert_eq!(
            order(Some(SortBy::Packets)),
            [(4711, 4712), (4712, 4711), (2, 4712)]
        );
        assert_eq!(
            order(Some(SortBy::Bytes)),
            [(2, 4712), (4711, 4712), (4712, 4711)]
        );
    }

    #[test]
    fn table_with_labels() -> Result<(), CliError> {
        let mut flows = fixture();
        sort_flows(&mut flows, None);
        let labels = IdentityLabels::fixed(&[
            (2, &["reserved:world="]),
            (4711, &["k8s:app=web"]),
            (4712, &["k8s:app=db"]),
        ]);
        let out = render(Format::Table, false, &flows, || table(&flows, &labels))?;
        assert_eq!(
            out,
            "\
SRC   DST   PACKETS  BYTES  SRC LABELS       DST LABELS
2     4712  3        9000   reserved:world=  k8s:app=db
4711  4712  50       7100   k8s:app=web      k8s:app=db
4712  4711  50       7000   k8s:app=db       k8s:app=web
"
        );
        Ok(())
    }

    #[test]
    fn json_and_yaml() -> Result<(), CliError> {
        let flows = &fixture()[..1];
        let json = render(Format::Json, false, flows, || unreachable!())?;
        assert_eq!(
            json,
            r#"[
  {
    "src_identity": 4711,
    "dst_identity": 4712,
    "packets": 50,
    "bytes": 7100
  }
]
"#
        );
        let yaml = render(Format::Yaml, false, flows, || unreachable!())?;
        assert_eq!(
            yaml,
            "- src_identity: 4711\n  dst_identity: 4712\n  packets: 50\n  bytes: 7100\n"
        );
        let empty: &[FlowView] = &[];
        assert_eq!(
            render(Format::Json, false, empty, || unreachable!())?,
            "[]\n"
        );
        Ok(())
    }
}
