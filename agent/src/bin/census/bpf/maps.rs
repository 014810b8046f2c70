//! `census bpf maps [list|show]`: the pinned census maps and their layout version,
//! with the programs' own counters (STATS) beside the maps they speak of.

use census_agent::bpf::{DatapathStats, PinnedMapInfo, map_type_name};
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::{Ctx, error::CliError, output::Table};

/// `census bpf maps`: without a verb, the list.
#[derive(Debug, Args)]
pub(crate) struct MapsArgs {
    #[command(subcommand)]
    command: Option<MapsCommand>,
}

#[derive(Debug, Subcommand)]
enum MapsCommand {
    /// Every pinned map.
    #[command(visible_alias = "show")]
    List,
}

/// One map, as `-o json` prints it (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct MapView {
    pub(crate) name: String,
    /// The kernel's map id.
    pub(crate) id: u32,
    /// As bpftool names it: `array`, `hash`, `lru_percpu_hash`.
    #[serde(rename = "type")]
    pub(crate) map_type: String,
    pub(crate) key_size: u32,
    pub(crate) value_size: u32,
    pub(crate) max_entries: u32,
    /// `BPF_F_*` creation flags (INTERFACES: `BPF_F_MMAPABLE`, 1024).
    pub(crate) flags: u32,
    /// Entries present now (an array has all of them; INTERFACES counts the
    /// slots in use).
    pub(crate) entries: u64,
    pub(crate) layout_version: u32,
    pub(crate) pin: String,
    /// What the programs counted about this map (FLOWS: `inserts`, `evictions`,
    /// `insert_failures`) or in it (STATS: every counter); absent for the others.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) counters: Option<Counters>,
}

/// The programs' counters shown with a map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub(crate) enum Counters {
    Flows {
        /// Identity pairs inserted.
        inserts: u64,
        /// Pairs evicted to make room (inserted and no longer present).
        evictions: u64,
        /// Inserts the kernel refused (those packets went uncounted).
        insert_failures: u64,
    },
    Stats {
        flow_inserts: u64,
        flow_insert_failures: u64,
        unparsable: u64,
        interface_misses: u64,
        log_suppressed: u64,
        service_marked: u64,
        marked_counted: u64,
    },
}

impl Counters {
    /// The counters of map `name`, if the programs count any about it.
    fn of(name: &str, stats: &DatapathStats, flow_pairs: u64) -> Option<Self> {
        match name {
            "FLOWS" => Some(Self::Flows {
                inserts: stats.flow_inserts,
                evictions: stats.flow_evictions(flow_pairs),
                insert_failures: stats.flow_insert_failures,
            }),
            "STATS" => Some(Self::Stats {
                flow_inserts: stats.flow_inserts,
                flow_insert_failures: stats.flow_insert_failures,
                unparsable: stats.unparsable,
                interface_misses: stats.interface_misses,
                log_suppressed: stats.log_suppressed,
                service_marked: stats.service_marked,
                marked_counted: stats.marked_counted,
            }),
            _ => None,
        }
    }

    /// `name=value ...`, for the table.
    fn cell(&self) -> String {
        let pairs: Vec<(&str, u64)> = match *self {
            Self::Flows {
                inserts,
                evictions,
                insert_failures,
            } => vec![
                ("inserts", inserts),
                ("evictions", evictions),
                ("insert_failures", insert_failures),
            ],
            Self::Stats {
                flow_inserts,
                flow_insert_failures,
                unparsable,
                interface_misses,
                log_suppressed,
                service_marked,
                marked_counted,
            } => vec![
                ("flow_inserts", flow_inserts),
                ("flow_insert_failures", flow_insert_failures),
                ("unparsable", unparsable),
                ("interface_misses", interface_misses),
                ("log_suppressed", log_suppressed),
                ("service_marked", service_marked),
                ("marked_counted", marked_counted),
            ],
        };
        let cells: Vec<String> = pairs
            .into_iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        cells.join(" ")
    }
}

impl MapView {
    fn new(info: &PinnedMapInfo, layout_version: u32) -> Self {
        Self {
            name: info.name.to_owned(),
            id: info.id,
            map_type: map_type_name(info.shape.map_type),
            key_size: info.shape.key_size,
            value_size: info.shape.value_size,
            max_entries: info.shape.max_entries,
            flags: info.shape.map_flags,
            entries: info.entries,
            layout_version,
            pin: info.pin.display().to_string(),
            counters: None,
        }
    }
}

pub(super) fn run(args: MapsArgs, ctx: &Ctx) -> Result<String, CliError> {
    let MapsArgs { command } = args;
    let (Some(MapsCommand::List) | None) = command;
    let maps = ctx.maps()?;
    let stats = maps.stats()?;
    let mut views: Vec<MapView> = Vec::new();
    for info in maps.maps()? {
        let mut view = MapView::new(&info, maps.layout_version());
        if let Some(stats) = &stats {
            view.counters = Counters::of(info.name, stats, info.entries);
        }
        views.push(view);
    }
    ctx.render(&views, || table(&views))
}

fn table(maps: &[MapView]) -> Table {
    let mut table = Table::new([
        "NAME", "ID", "TYPE", "KEY", "VALUE", "MAX", "ENTRIES", "LAYOUT", "PIN", "COUNTERS",
    ]);
    for map in maps {
        table.row(vec![
            map.name.clone(),
            map.id.to_string(),
            map.map_type.clone(),
            format!("{}B", map.key_size),
            format!("{}B", map.value_size),
            map.max_entries.to_string(),
            map.entries.to_string(),
            map.layout_version.to_string(),
            map.pin.clone(),
            map.counters
                .as_ref()
                .map(Counters::cell)
                .unwrap_or_default(),
        ]);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{Format, render};

    fn fixture() -> Vec<MapView> {
        let map = |name: &str, id, map_type: &str, key, value, max, entries| MapView {
            name: name.into(),
            id,
            map_type: map_type.into(),
            key_size: key,
            value_size: value,
            max_entries: max,
            flags: if name == "INTERFACES" { 1024 } else { 0 },
            entries,
            layout_version: 3,
            pin: format!("/sys/fs/bpf/census/{name}"),
            counters: None,
        };
        let stats = DatapathStats {
            flow_inserts: 5,
            flow_insert_failures: 1,
            unparsable: 0,
            interface_misses: 4,
            log_suppressed: 0,
            service_marked: 9,
            marked_counted: 8,
            ..DatapathStats::default()
        };
        let mut maps = vec![
            map("CENSUS_META", 11, "array", 4, 4, 1, 1),
            map("ENDPOINTS", 12, "hash", 20, 8, 65536, 3),
            map("FLOWS", 13, "lru_percpu_hash", 8, 16, 65536, 2),
            map("INTERFACES", 14, "array", 4, 8, 65536, 2),
            map("STATS", 15, "percpu_array", 4, 8, 16, 16),
        ];
        for map in &mut maps {
            map.counters = Counters::of(&map.name, &stats, map.entries);
        }
        maps
    }

    #[test]
    fn table() -> Result<(), CliError> {
        let maps = fixture();
        let out = render(Format::Table, false, &maps, || super::table(&maps))?;
        assert_eq!(
            out,
            "\
NAME         ID  TYPE             KEY  VALUE  MAX    ENTRIES  LAYOUT  PIN                             COUNTERS
CENSUS_META  11  array            4B   4B     1      1        3       /sys/fs/bpf/census/CENSUS_META
ENDPOINTS    12  hash             20B  8B     65536  3        3       /sys/fs/bpf/census/ENDPOINTS
FLOWS        13  lru_percpu_hash  8B   16B    65536  2        3       /sys/fs/bpf/census/FLOWS        inserts=5 evictions=3 insert_failures=1
INTERFACES   14  array            4B   8B     65536  2        3       /sys/fs/bpf/census/INTERFACES
STATS        15  percpu_array     4B   8B     16     16       3       /sys/fs/bpf/census/STATS        flow_inserts=5 flow_insert_failures=1 unparsable=0 interface_misses=4 log_suppressed=0 service_marked=9 marked_counted=8
"
        );
        Ok(())
    }

    #[test]
    fn json() -> Result<(), CliError> {
        let maps = &fixture()[1..3];
        let out = render(Format::Json, false, maps, || unreachable!())?;
        assert_eq!(
            out,
            r#"[
  {
    "name": "ENDPOINTS",
    "id": 12,
    "type": "hash",
    "key_size": 20,
    "value_size": 8,
    "max_entries": 65536,
    "flags": 0,
    "entries": 3,
    "layout_version": 3,
    "pin": "/sys/fs/bpf/census/ENDPOINTS"
  },
  {
    "name": "FLOWS",
    "id": 13,
    "type": "lru_percpu_hash",
    "key_size": 8,
    "value_size": 16,
    "max_entries": 65536,
    "flags": 0,
    "entries": 2,
    "layout_version": 3,
    "pin": "/sys/fs/bpf/census/FLOWS",
    "counters": {
      "inserts": 5,
      "evictions": 3,
      "insert_failures": 1
    }
  }
]
"#
        );
        Ok(())
    }

    #[test]
    fn yaml() -> Result<(), CliError> {
        let maps = &fixture()[..1];
        let out = render(Format::Yaml, false, maps, || unreachable!())?;
        assert_eq!(
            out,
            "\
- name: CENSUS_META
  id: 11
  type: array
  key_size: 4
  value_size: 4
  max_entries: 1
  flags: 0
  entries: 1
  layout_version: 3
  pin: /sys/fs/bpf/census/CENSUS_META
"
        );
        Ok(())
    }
}
