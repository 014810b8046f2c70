//! `census bpf endpoints [list|show] [--local|--remote] | get <ip>`: the ENDPOINTS
//! map, address -> identity, flags and, for an endpoint on another node, that node
//! (named from NODES).

use std::{collections::BTreeMap, net::IpAddr};

use census_agent::bpf::NodeRecord;
use census_common::{EndpointKey, EndpointValue, flags};
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::{Ctx, args::parse_ip, error::CliError, operator::IdentityLabels, output::Table};

/// `census bpf endpoints`: without a verb, the list.
#[derive(Debug, Args)]
pub(crate) struct EndpointsArgs {
    #[command(subcommand)]
    command: Option<EndpointsCommand>,
}

#[derive(Debug, Subcommand)]
enum EndpointsCommand {
    /// Every entry, by address.
    #[command(visible_alias = "show")]
    List(ListArgs),
    /// The entry of one address.
    Get {
        /// An IPv4 or IPv6 address.
        ip: String,
    },
}

/// Which entries `list` shows.
#[derive(Debug, Default, Args)]
struct ListArgs {
    /// Only this node's entries: its endpoints and its own addresses (every
    /// entry without the `remote` flag).
    #[arg(long, conflicts_with = "remote")]
    local: bool,
    /// Only the entries of other nodes' endpoints and addresses (`remote`).
    #[arg(long)]
    remote: bool,
}

impl ListArgs {
    fn shows(&self, view: &EndpointView) -> bool {
        let remote = view.flag_bits & flags::REMOTE != 0;
        match (self.local, self.remote) {
            (true, _) => !remote,
            (_, true) => remote,
            _ => true,
        }
    }
}

/// One ENDPOINTS entry, as `-o json` prints it (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct EndpointView {
    /// `null` for a key census did not write (see `raw_key`).
    pub(crate) address: Option<IpAddr>,
    pub(crate) identity: u32,
    /// `local`, `remote`, `host`, and unknown bits in hex.
    pub(crate) flags: Vec<String>,
    pub(crate) flag_bits: u16,
    /// The index of the node a remote endpoint is on (NODES' key); `null` for
    /// the others.
    pub(crate) node: Option<u16>,
    /// That node's name, from NODES; `null` when NODES has no such node.
    pub(crate) node_name: Option<String>,
    /// The key's 20 bytes in hex, only when it holds no address census writes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) raw_key: Option<String>,
}

impl EndpointView {
    fn new(
        key: Option<&EndpointKey>,
        ip: Option<IpAddr>,
        value: EndpointValue,
        nodes: &BTreeMap<u16, NodeRecord>,
    ) -> Self {
        let node = (value.node != 0).then_some(value.node);
        Self {
            address: ip,
            identity: value.identity,
            flags: flag_names(value.flags),
            flag_bits: value.flags,
            node,
            node_name: node
                .and_then(|index| nodes.get(&index))
                .map(|record| record.name.clone()),
            raw_key: match (ip, key) {
                (None, Some(key)) => Some(raw_key(key)),
                _ => None,
            },
        }
    }
}

fn flag_names(bits: u16) -> Vec<String> {
    let mut names: Vec<String> = [
        (flags::LOCAL, "local"),
        (flags::REMOTE, "remote"),
        (flags::HOST, "host"),
    ]
    .into_iter()
    .filter(|(flag, _)| bits & flag != 0)
    .map(|(_, name)| name.to_owned())
    .collect();
    let unknown = bits & !flags::ALL;
    if unknown != 0 {
        names.push(format!("{unknown:#x}"));
    }
    names
}

fn raw_key(key: &EndpointKey) -> String {
    let mut hex = String::with_capacity(40);
    for byte in key.family.to_ne_bytes().into_iter().chain(key.octets()) {
        hex.push_str(&format!("{byte:02x}"));
    }
    hex
}

pub(super) async fn run(args: EndpointsArgs, ctx: &mut Ctx) -> Result<String, CliError> {
    let EndpointsArgs { command } = args;
    match command.unwrap_or(EndpointsCommand::List(ListArgs::default())) {
        EndpointsCommand::List(filter) => {
            let maps = ctx.maps()?;
            let nodes = maps.nodes()?;
            let mut views: Vec<EndpointView> = maps
                .endpoints()?
                .iter()
                .map(|(key, value)| EndpointView::new(Some(key), key.ip(), *value, &nodes))
                .filter(|view| filter.shows(view))
                .collect();
            // Addresses in order (IPv4 first); keys without one last.
            views.sort_by(|a, b| {
                (a.address.is_none(), a.address, &a.raw_key).cmp(&(
                    b.address.is_none(),
                    b.address,
                    &b.raw_key,
                ))
            });
            let labels = ctx.labels(views.iter().map(|view| view.identity)).await;
            ctx.render(&views, || table(&views, &labels))
        }
        EndpointsCommand::Get { ip } => {
            let ip = parse_ip(&ip)?;
            let maps = ctx.maps()?;
            let value = maps.endpoint(ip)?.ok_or_else(|| CliError::UnknownAddress {
                ip,
                dir: maps.dir().to_owned(),
            })?;
            let view = EndpointView::new(None, Some(ip), value, &maps.nodes()?);
            let labels = ctx.labels([view.identity]).await;
            ctx.render(&view, || table(std::slice::from_ref(&view), &labels))
        }
    }
}

fn table(endpoints: &[EndpointView], labels: &IdentityLabels) -> Table {
    // The NODE column only when some entry is on another node.
    let nodes = endpoints.iter().any(|endpoint| endpoint.node.is_some());
    let mut header = vec!["ADDRESS", "IDENTITY", "FLAGS"];
    if nodes {
        header.push("NODE");
    }
    if labels.shown() {
        header.push("LABELS");
    }
    let mut table = Table::new(header);
    for endpoint in endpoints {
        let address = match (&endpoint.address, &endpoint.raw_key) {
            (Some(ip), _) => ip.to_string(),
            (None, Some(key)) => format!("(key {key})"),
            (None, None) => String::new(),
        };
        let mut row = vec![
            address,
            endpoint.identity.to_string(),
            endpoint.flags.join(","),
        ];
        if nodes {
            row.push(node_cell(endpoint));
        }
        if labels.shown() {
            row.push(labels.cell(endpoint.identity));
        }
        table.row(row);
    }
    table
}

/// The node's name, or its index when NODES does not name it; empty for this
/// node's entries.
fn node_cell(endpoint: &EndpointView) -> String {
    match (&endpoint.node_name, endpoint.node) {
        (Some(name), _) => name.clone(),
        (None, Some(index)) => format!("#{index}"),
        (None, None) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{Format, render};

    fn fixture() -> Result<Vec<EndpointView>, std::net::AddrParseError> {
        let value = |identity, flags, node| EndpointValue {
            identity,
            flags,
            node,
        };
        let nodes = BTreeMap::from([(
            3,
            NodeRecord {
                name: "node-b".to_owned(),
                addresses: vec!["198.19.0.1".parse()?],
            },
        )]);
        let mut odd = EndpointKey::v4([10, 0, 0, 1]);
        odd.family = 9;
        let view = |ip: &str, value| -> Result<_, std::net::AddrParseError> {
            Ok(EndpointView::new(None, Some(ip.parse()?), value, &nodes))
        };
        Ok(vec![
            view("198.18.0.1", value(1, flags::HOST, 0))?,
            view("198.18.0.2", value(4711, flags::LOCAL, 0))?,
            view("2001:db8::2", value(4712, flags::REMOTE | 1 << 7, 3))?,
            EndpointView::new(Some(&odd), None, value(5, flags::LOCAL, 0), &nodes),
            // A node NODES does not name (yet).
            view("198.19.0.9", value(6, flags::REMOTE, 9))?,
        ])
    }

    #[test]
    fn filters_split_local_and_remote() -> Result<(), Box<dyn std::error::Error>> {
        let endpoints = fixture()?;
        let shown = |local, remote| -> Vec<Option<IpAddr>> {
            let filter = ListArgs { local, remote };
            endpoints
                .iter()
                .filter(|view| filter.shows(view))
                .map(|view| view.address)
                .collect()
        };
        assert_eq!(shown(false, false).len(), 5);
        assert_eq!(
            shown(true, false),
            [
                Some("198.18.0.1".parse()?),
                Some("198.18.0.2".parse()?),
                None
            ]
        );
        assert_eq!(
            shown(false, true),
            [Some("2001:db8::2".parse()?), Some("198.19.0.9".parse()?)]
        );
        Ok(())
    }

    #[test]
    fn table_with_labels() -> Result<(), Box<dyn std::error::Error>> {
        let endpoints = fixture()?;
        let labels = IdentityLabels::fixed(&[
            (1, &["reserved:host="]),
            (
                4711,
                &["k8s:app=web", "k8s:io.kubernetes.pod.namespace=shop"],
            ),
        ]);
        let out = render(Format::Table, false, &endpoints, || {
            table(&endpoints, &labels)
        })?;
        assert_eq!(
            out,
            "\
ADDRESS                                         IDENTITY  FLAGS        NODE    LABELS
198.18.0.1                                      1         host                 reserved:host=
198.18.0.2                                      4711      local                k8s:app=web,k8s:io.kubernetes.pod.namespace=shop
2001:db8::2                                     4712      remote,0x80  node-b  (unknown)
(key 090000000a000001000000000000000000000000)  5         local                (unknown)
198.19.0.9                                      6         remote       #9      (unknown)
"
        );
        Ok(())
    }

    #[test]
    fn numeric_table_without_headers() -> Result<(), Box<dyn std::error::Error>> {
        let endpoints = &fixture()?[1..2];
        let out = render(Format::Table, true, endpoints, || {
            table(endpoints, &IdentityLabels::none())
        })?;
        assert_eq!(out, "198.18.0.2  4711  local\n");
        Ok(())
    }

    #[test]
    fn json_and_yaml() -> Result<(), Box<dyn std::error::Error>> {
        let endpoints = fixture()?;
        let json = render(Format::Json, false, &endpoints[1..4], || unreachable!())?;
        assert_eq!(
            json,
            r#"[
  {
    "address": "198.18.0.2",
    "identity": 4711,
    "flags": [
      "local"
    ],
    "flag_bits": 1,
    "node": null,
    "node_name": null
  },
  {
    "address": "2001:db8::2",
    "identity": 4712,
    "flags": [
      "remote",
      "0x80"
    ],
    "flag_bits": 130,
    "node": 3,
    "node_name": "node-b"
  },
  {
    "address": null,
    "identity": 5,
    "flags": [
      "local"
    ],
    "flag_bits": 1,
    "node": null,
    "node_name": null,
    "raw_key": "090000000a000001000000000000000000000000"
  }
]
"#
        );
        let yaml = render(Format::Yaml, false, &endpoints[1], || unreachable!())?;
        assert_eq!(
            yaml,
            "address: 198.18.0.2\nidentity: 4711\nflags:\n- local\nflag_bits: 1\nnode: null\nnode_name: null\n"
        );
        Ok(())
    }
}
