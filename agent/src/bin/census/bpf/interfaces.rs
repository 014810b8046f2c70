//! `census bpf interfaces [list|show]`: the INTERFACES map, the interfaces census
//! counts on and the identity of the endpoint behind each.
//!
//! Interface names are the agent's, read from its link pins (the interface a TCX
//! link is attached to, the record of a TC filter), never looked up in this
//! command's network namespace: the agent's interfaces need not be there, and an
//! index there may name another interface.

use std::collections::BTreeMap;

use census_agent::bpf::Interface;
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::{Ctx, error::CliError, operator::IdentityLabels, output::Table};

/// `census bpf interfaces`: without a verb, the list.
#[derive(Debug, Args)]
pub(crate) struct InterfacesArgs {
    #[command(subcommand)]
    command: Option<InterfacesCommand>,
}

#[derive(Debug, Subcommand)]
enum InterfacesCommand {
    /// Every interface with an entry, by ifindex.
    #[command(visible_alias = "show")]
    List,
}

/// One INTERFACES entry, as `-o json` prints it (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct InterfaceView {
    pub(crate) ifindex: u32,
    /// Its name where the agent attached to it (from census's link pins), `null`
    /// when no pinned link names it.
    pub(crate) interface: Option<String>,
    /// The identity of the endpoint behind it; `null`: no single identity (the
    /// classifier looks the packet's address up).
    pub(crate) identity: Option<u32>,
    /// The map slot holding the entry (`ifindex % 65536` for every entry census
    /// writes).
    pub(crate) slot: u32,
}

impl InterfaceView {
    fn new(slot: u32, entry: Interface, name: Option<String>) -> Self {
        Self {
            ifindex: entry.ifindex,
            interface: name,
            identity: entry.identity,
            slot,
        }
    }
}

pub(super) async fn run(args: InterfacesArgs, ctx: &mut Ctx) -> Result<String, CliError> {
    let InterfacesArgs { command } = args;
    let (Some(InterfacesCommand::List) | None) = command;
    let maps = ctx.maps()?;
    let names = maps.interface_names();
    let views = views(&maps.interfaces(), |ifindex| names.get(&ifindex).cloned());
    let labels = ctx
        .labels(views.iter().filter_map(|view| view.identity))
        .await;
    ctx.render(&views, || table(&views, &labels))
}

/// The entries by ifindex, each named by `name_of`.
fn views(
    slots: &BTreeMap<u32, Interface>,
    name_of: impl Fn(u32) -> Option<String>,
) -> Vec<InterfaceView> {
    let mut views: Vec<InterfaceView> = slots
        .iter()
        .map(|(slot, entry)| InterfaceView::new(*slot, *entry, name_of(entry.ifindex)))
        .collect();
    views.sort_by_key(|view| (view.ifindex, view.slot));
    views
}

fn table(interfaces: &[InterfaceView], labels: &IdentityLabels) -> Table {
    let mut header = vec!["IFINDEX", "INTERFACE", "IDENTITY"];
    if labels.shown() {
        header.push("LABELS");
    }
    let mut table = Table::new(header);
    for view in interfaces {
        let mut row = vec![
            view.ifindex.to_string(),
            view.interface.clone().unwrap_or_else(|| "-".to_owned()),
            view.identity
                .map_or_else(|| "- (by address)".to_owned(), |id| id.to_string()),
        ];
        if labels.shown() {
            row.push(view.identity.map(|id| labels.cell(id)).unwrap_or_default());
        }
        table.row(row);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{Format, render};

    fn fixture() -> Vec<InterfaceView> {
        let entry = |ifindex, identity| Interface { ifindex, identity };
        let slots = BTreeMap::from([
            (12, entry(12, Some(4711))),
            (7, entry(7, None)),
            (4464, entry(70_000, Some(4712))),
        ]);
        views(&slots, |ifindex| {
            (ifindex != 70_000).then(|| format!("lxc{ifindex}"))
        })
    }

    #[test]
    fn table_with_labels() -> Result<(), CliError> {
        let interfaces = fixture();
        let labels = IdentityLabels::fixed(&[(4711, &["k8s:app=web"])]);
        let out = render(Format::Table, false, &interfaces, || {
            table(&interfaces, &labels)
        })?;
        assert_eq!(
            out,
            "\
IFINDEX  INTERFACE  IDENTITY        LABELS
7        lxc7       - (by address)
12       lxc12      4711            k8s:app=web
70000    -          4712            (unknown)
"
        );
        Ok(())
    }

    #[test]
    fn json() -> Result<(), CliError> {
        let interfaces = &fixture()[..2];
        let out = render(Format::Json, false, interfaces, || unreachable!())?;
        assert_eq!(
            out,
            r#"[
  {
    "ifindex": 7,
    "interface": "lxc7",
    "identity": null,
    "slot": 7
  },
  {
    "ifindex": 12,
    "interface": "lxc12",
    "identity": 4711,
    "slot": 12
  }
]
"#
        );
        Ok(())
    }
}
