//! `census bpf nodes [list|show]`: the NODES map, the other nodes of the cluster
//! that remote ENDPOINTS entries name, by index, with their addresses.

use std::net::IpAddr;

use census_agent::bpf::NodeRecord;
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::{Ctx, error::CliError, output::Table};

/// `census bpf nodes`: without a verb, the list.
#[derive(Debug, Args)]
pub(crate) struct NodesArgs {
    #[command(subcommand)]
    command: Option<NodesCommand>,
}

#[derive(Debug, Subcommand)]
enum NodesCommand {
    /// Every node, by index.
    #[command(visible_alias = "show")]
    List,
}

/// One NODES entry, as `-o json` prints it (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct NodeView {
    /// The index remote ENDPOINTS entries name it by.
    pub(crate) index: u16,
    pub(crate) name: String,
    pub(crate) addresses: Vec<IpAddr>,
}

impl NodeView {
    fn new(index: u16, record: NodeRecord) -> Self {
        Self {
            index,
            name: record.name,
            addresses: record.addresses,
        }
    }
}

pub(super) fn run(args: NodesArgs, ctx: &Ctx) -> Result<String, CliError> {
    let NodesArgs { command } = args;
    let (Some(NodesCommand::List) | None) = command;
    let maps = ctx.maps()?;
    let views: Vec<NodeView> = maps
        .nodes()?
        .into_iter()
        .map(|(index, record)| NodeView::new(index, record))
        .collect();
    ctx.render(&views, || table(&views))
}

fn table(nodes: &[NodeView]) -> Table {
    let mut table = Table::new(["INDEX", "NAME", "ADDRESSES"]);
    for node in nodes {
        let addresses: Vec<String> = node.addresses.iter().map(IpAddr::to_string).collect();
        table.row(vec![
            node.index.to_string(),
            node.name.clone(),
            addresses.join(","),
        ]);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{Format, render};

    fn fixture() -> Result<Vec<NodeView>, std::net::AddrParseError> {
        Ok(vec![
            NodeView::new(
                1,
                NodeRecord {
                    name: "node-a".to_owned(),
                    addresses: vec!["198.18.0.1".parse()?, "2001:db8::1".parse()?],
                },
            ),
            NodeView::new(
                7,
                NodeRecord {
                    name: "node-b".to_owned(),
                    addresses: vec![],
                },
            ),
        ])
    }

    #[test]
    fn table_and_json() -> Result<(), Box<dyn std::error::Error>> {
        let nodes = fixture()?;
        let out = render(Format::Table, false, &nodes, || table(&nodes))?;
        assert_eq!(
            out,
            "\
INDEX  NAME    ADDRESSES
1      node-a  198.18.0.1,2001:db8::1
7      node-b
"
        );
        let json = render(Format::Json, false, &nodes[..1], || unreachable!())?;
        assert_eq!(
            json,
            r#"[
  {
    "index": 1,
    "name": "node-a",
    "addresses": [
      "198.18.0.1",
      "2001:db8::1"
    ]
  }
]
"#
        );
        Ok(())
    }
}
