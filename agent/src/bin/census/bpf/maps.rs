//! `census bpf maps`: the pinned census maps and their layout version.

use census_agent::bpf::{PinnedMapInfo, map_type_name};
use serde::Serialize;

use crate::{Ctx, error::CliError, output::Table};

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
        }
    }
}

pub(super) fn run(ctx: &Ctx) -> Result<String, CliError> {
    let maps = ctx.maps()?;
    let views: Vec<MapView> = maps
        .maps()?
        .iter()
        .map(|info| MapView::new(info, maps.layout_version()))
        .collect();
    ctx.render(&views, || table(&views))
}

fn table(maps: &[MapView]) -> Table {
    let mut table = Table::new([
        "NAME", "ID", "TYPE", "KEY", "VALUE", "MAX", "ENTRIES", "LAYOUT", "PIN",
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
            layout_version: 2,
            pin: format!("/sys/fs/bpf/census/{name}"),
        };
        vec![
            map("CENSUS_META", 11, "array", 4, 4, 1, 1),
            map("ENDPOINTS", 12, "hash", 20, 8, 65536, 3),
            map("FLOWS", 13, "lru_percpu_hash", 8, 16, 65536, 2),
            map("INTERFACES", 14, "array", 4, 8, 65536, 2),
        ]
    }

    #[test]
    fn table() -> Result<(), CliError> {
        let maps = fixture();
        let out = render(Format::Table, false, &maps, || super::table(&maps))?;
        assert_eq!(
            out,
            "\
NAME         ID  TYPE             KEY  VALUE  MAX    ENTRIES  LAYOUT  PIN
CENSUS_META  11  array            4B   4B     1      1        2       /sys/fs/bpf/census/CENSUS_META
ENDPOINTS    12  hash             20B  8B     65536  3        2       /sys/fs/bpf/census/ENDPOINTS
FLOWS        13  lru_percpu_hash  8B   16B    65536  2        2       /sys/fs/bpf/census/FLOWS
INTERFACES   14  array            4B   8B     65536  2        2       /sys/fs/bpf/census/INTERFACES
"
        );
        Ok(())
    }

    #[test]
    fn json() -> Result<(), CliError> {
        let maps = &fixture()[1..2];
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
    "layout_version": 2,
    "pin": "/sys/fs/bpf/census/ENDPOINTS"
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
  layout_version: 2
  pin: /sys/fs/bpf/census/CENSUS_META
"
        );
        Ok(())
    }
}
