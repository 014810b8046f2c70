//! `census node list | get <node>`: what the operator knows of each node and its agent's
//! session, from NodeService.

use std::time::SystemTime;

use census_proto::{domain::SessionId, pb};
use clap::Subcommand;
use serde::Serialize;

use super::{
    Ctx,
    args::parse_node,
    error::CliError,
    output::{Table, ago, nonzero, yes_no},
};

#[derive(Debug, Subcommand)]
pub(crate) enum NodeCommand {
    /// Every node the operator knows, by name.
    List,
    /// One node, every counter.
    Get {
        /// The node's name.
        node: String,
    },
}

/// One node, as `-o json` prints it (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct NodeView {
    pub(crate) name: String,
    /// Whether its agent's EndpointSync stream is open.
    pub(crate) connected: bool,
    /// Silent for longer than the node TTL.
    pub(crate) stale: bool,
    /// The agent's session, `<start time ns>-<nonce hex>`; `null` if none said Hello
    /// since the operator started.
    pub(crate) session: Option<String>,
    /// The last seq applied.
    pub(crate) last_seq: u64,
    /// ms since the Unix epoch; `null` if never.
    pub(crate) last_heard_ms: Option<u64>,
    /// ms since the Unix epoch; `null` if never.
    pub(crate) last_snapshot_ms: Option<u64>,
    pub(crate) endpoints: u64,
    pub(crate) holds: u32,
    pub(crate) corrections: u64,
    pub(crate) adoptions: u64,
    pub(crate) old_seq_ignored: u64,
    pub(crate) rebinds: u64,
}

impl From<pb::Node> for NodeView {
    fn from(node: pb::Node) -> Self {
        let pb::Node {
            name,
            session,
            connected,
            last_seq,
            last_heard_ms,
            last_snapshot_ms,
            stale,
            endpoints,
            holds,
            corrections,
            adoptions,
            old_seq_ignored,
            rebinds,
        } = node;
        Self {
            name,
            connected,
            stale,
            session: session.map(|s| {
                SessionId {
                    start_time_ns: s.start_time_ns,
                    nonce: s.nonce,
                }
                .to_string()
            }),
            last_seq,
            last_heard_ms: nonzero(last_heard_ms),
            last_snapshot_ms: nonzero(last_snapshot_ms),
            endpoints,
            holds,
            corrections,
            adoptions,
            old_seq_ignored,
            rebinds,
        }
    }
}

pub(crate) async fn run(command: NodeCommand, ctx: &mut Ctx) -> Result<String, CliError> {
    match command {
        NodeCommand::List => {
            let operator = ctx.operator().await?;
            let mut nodes: Vec<NodeView> = operator
                .list_nodes()
                .await?
                .into_iter()
                .map(NodeView::from)
                .collect();
            nodes.sort_by(|a, b| a.name.cmp(&b.name));
            ctx.render(&nodes, || list_table(&nodes, ctx.now))
        }
        NodeCommand::Get { node } => {
            let name = parse_node(&node)?;
            let operator = ctx.operator().await?;
            let node =
                operator
                    .get_node(name.as_str())
                    .await?
                    .ok_or_else(|| CliError::UnknownNode {
                        node: name.to_string(),
                        addr: operator.addr().clone(),
                    })?;
            let view = NodeView::from(node);
            ctx.render(&view, || detail_table(&view, ctx.now))
        }
    }
}

fn ms_ago(now: SystemTime, ms: Option<u64>) -> String {
    ago(now, ms.unwrap_or(0))
}

fn list_table(nodes: &[NodeView], now: SystemTime) -> Table {
    let mut table = Table::new([
        "NODE",
        "CONNECTED",
        "STALE",
        "LAST SNAPSHOT",
        "SEQ",
        "ENDPOINTS",
        "HOLDS",
        "CORRECTIONS",
        "ADOPTIONS",
        "SESSION",
    ]);
    for node in nodes {
        table.row(vec![
            node.name.clone(),
            yes_no(node.connected),
            yes_no(node.stale),
            ms_ago(now, node.last_snapshot_ms),
            node.last_seq.to_string(),
            node.endpoints.to_string(),
            node.holds.to_string(),
            node.corrections.to_string(),
            node.adoptions.to_string(),
            node.session.clone().unwrap_or_else(|| "-".to_owned()),
        ]);
    }
    table
}

/// One node as `field  value` lines.
fn detail_table(node: &NodeView, now: SystemTime) -> Table {
    let mut table = Table::new(Vec::<String>::new());
    let rows = [
        ("name", node.name.clone()),
        ("connected", yes_no(node.connected)),
        ("stale", yes_no(node.stale)),
        (
            "session",
            node.session.clone().unwrap_or_else(|| "-".into()),
        ),
        ("last heard", ms_ago(now, node.last_heard_ms)),
        ("last snapshot", ms_ago(now, node.last_snapshot_ms)),
        ("last seq", node.last_seq.to_string()),
        ("endpoints", node.endpoints.to_string()),
        ("holds", node.holds.to_string()),
        ("corrections", node.corrections.to_string()),
        ("adoptions", node.adoptions.to_string()),
        ("old seq ignored", node.old_seq_ignored.to_string()),
        ("rebinds", node.rebinds.to_string()),
    ];
    for (field, value) in rows {
        table.row(vec![format!("{field}:"), value]);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{Format, from_millis, render};

    const NOW_MS: u64 = 1_700_000_000_000;

    fn fixture() -> Vec<NodeView> {
        vec![
            NodeView::from(pb::Node {
                name: "node-a".into(),
                session: Some(pb::Session {
                    start_time_ns: 1_699_999_000_000_000_000,
                    nonce: 7,
                }),
                connected: true,
                last_seq: 12,
                last_heard_ms: NOW_MS - 2_000,
                last_snapshot_ms: NOW_MS - 12_000,
                stale: false,
                endpoints: 2,
                holds: 1,
                corrections: 0,
                adoptions: 2,
                old_seq_ignored: 0,
                rebinds: 0,
            }),
            NodeView::from(pb::Node {
                name: "node-b".into(),
                stale: true,
                ..pb::Node::default()
            }),
        ]
    }

    #[test]
    fn list_table() -> Result<(), CliError> {
        let nodes = fixture();
        let out = render(Format::Table, false, &nodes, || {
            super::list_table(&nodes, from_millis(NOW_MS))
        })?;
        assert_eq!(
            out,
            "\
NODE    CONNECTED  STALE  LAST SNAPSHOT  SEQ  ENDPOINTS  HOLDS  CORRECTIONS  ADOPTIONS  SESSION
node-a  yes        no     12s ago        12   2          1      0            2          1699999000000000000-0000000000000007
node-b  no         yes    never          0    0          0      0            0          -
"
        );
        Ok(())
    }

    #[test]
    fn detail_table() -> Result<(), CliError> {
        let node = &fixture()[0];
        let out = render(Format::Table, false, node, || {
            super::detail_table(node, from_millis(NOW_MS))
        })?;
        assert_eq!(
            out,
            "\
name:             node-a
connected:        yes
stale:            no
session:          1699999000000000000-0000000000000007
last heard:       2s ago
last snapshot:    12s ago
last seq:         12
endpoints:        2
holds:            1
corrections:      0
adoptions:        2
old seq ignored:  0
rebinds:          0
"
        );
        Ok(())
    }

    #[test]
    fn json_and_yaml() -> Result<(), CliError> {
        let nodes = fixture();
        let json = render(Format::Json, false, &nodes[..1], || unreachable!())?;
        assert_eq!(
            json,
            r#"[
  {
    "name": "node-a",
    "connected": true,
    "stale": false,
    "session": "1699999000000000000-0000000000000007",
    "last_seq": 12,
    "last_heard_ms": 1699999998000,
    "last_snapshot_ms": 1699999988000,
    "endpoints": 2,
    "holds": 1,
    "corrections": 0,
    "adoptions": 2,
    "old_seq_ignored": 0,
    "rebinds": 0
  }
]
"#
        );
        let yaml = render(Format::Yaml, false, &nodes[1], || unreachable!())?;
        assert_eq!(
            yaml,
            "\
name: node-b
connected: false
stale: true
session: null
last_seq: 0
last_heard_ms: null
last_snapshot_ms: null
endpoints: 0
holds: 0
corrections: 0
adoptions: 0
old_seq_ignored: 0
rebinds: 0
"
        );
        Ok(())
    }
}
