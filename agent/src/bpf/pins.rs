//! Where census pins its maps and links, the layout version guarding them, and
//! uninstall.
//!
//! ```text
//! <pin dir>/CENSUS_META            array[1] of u32: the layout version
//! <pin dir>/ENDPOINTS              address -> identity + flags + node, not preallocated
//! <pin dir>/NODES                  node index -> name + addresses, not preallocated
//! <pin dir>/INTERFACES             array[ifindex % 65536] of (ifindex, identity), mmapable
//! <pin dir>/FLOWS                  (src identity, dst identity) -> packets, bytes
//! <pin dir>/STATS                  per-CPU array of u64: the program's own counters
//! <pin dir>/SERVICE_FLOWS4         (client identity, IPv4 Service address, port,
//!                                  protocol, direction) -> packets, bytes
//! <pin dir>/SERVICE_FLOWS6         the same, of IPv6 Service addresses
//! <pin dir>/CLIENTS_EPOCH          array[1] of u64, mmapable: bumped after each
//!                                  ENDPOINTS write (the sockets' cached clients)
//! <pin dir>/links/<if>-ingress     TCX link of census_ingress on interface <if>
//! <pin dir>/links/<if>-egress      TCX link of census_egress on interface <if>
//! <pin dir>/links/<if>-<direction>:tc:<ifindex>:<priority>:<handle>/
//!                                  (a directory) census's TC filter on <if>, in TC mode
//! <pin dir>/ENDPOINTS-layout<N>    only while an older layout's ENDPOINTS is migrated
//! <pin dir>/SERVICE_FLOWS          only while layout 6 or 7's Service counters are
//!                                  copied into SERVICE_FLOWS4 and SERVICE_FLOWS6
//! ```

use std::{
    fs, io,
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use aya::maps::{Array, MapData, MapError, MapInfo, MapType};
use census_common::{
    CLIENTS_EPOCH_MAP, CLIENTS_EPOCH_MAP_FLAGS, ENDPOINTS_COPIED_FROM, ENDPOINTS_MAP,
    ENDPOINTS_MAP_FLAGS, ENDPOINTS_MAX_ENTRIES, EndpointKey, EndpointValue, FLOWS_MAP,
    FLOWS_MAX_ENTRIES, FlowKey, FlowValue, INTERFACES_MAP, INTERFACES_MAP_FLAGS,
    INTERFACES_MAX_ENTRIES, InterfaceValue, LAYOUT_VERSION, META_LAYOUT_INDEX, META_MAP,
    META_MAX_ENTRIES, MIGRATES_FROM, NODES_MAP, NODES_MAP_FLAGS, NODES_MAX_ENTRIES, NodeValue,
    SERVICE_FLOWS_LAYOUT7_MAP, SERVICE_FLOWS_MAX_ENTRIES, SERVICE_FLOWS4_MAP, SERVICE_FLOWS6_MAP,
    SERVICES_MAP, SERVICES_MAP_FLAGS, SERVICES_MAX_ENTRIES, STATS_MAP, STATS_MAX_ENTRIES,
    ServiceFlowKey4, ServiceFlowKey6, ServiceFlowKeyLayout7, ServiceKey,
    filter::{ADDRESS_FILTER_MAP, AddressFilter, FILTER_MAP_MAX_ENTRIES},
};

use super::{Direction, Error, maps::MapShape, privileges, sys};

/// Where the agent pins everything by default.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/census";

const LINKS_DIR: &str = "links";

/// Every map census pins, the layout version map first.
pub(super) const MAPS: [&str; 11] = [
    META_MAP,
    ENDPOINTS_MAP,
    FLOWS_MAP,
    INTERFACES_MAP,
    STATS_MAP,
    NODES_MAP,
    SERVICES_MAP,
    SERVICE_FLOWS4_MAP,
    SERVICE_FLOWS6_MAP,
    ADDRESS_FILTER_MAP,
    CLIENTS_EPOCH_MAP,
];
/// The maps of [`MAPS`] that a layout version guards.
pub(super) const DATA_MAPS: [&str; 10] = [
    ENDPOINTS_MAP,
    FLOWS_MAP,
    INTERFACES_MAP,
    STATS_MAP,
    NODES_MAP,
    SERVICES_MAP,
    SERVICE_FLOWS4_MAP,
    SERVICE_FLOWS6_MAP,
    ADDRESS_FILTER_MAP,
    CLIENTS_EPOCH_MAP,
];
/// The maps a layout sizes as the agent is told (`--*-max-entries`): any size is
/// that map.
const SIZED_MAPS: [&str; 6] = [
    ENDPOINTS_MAP,
    FLOWS_MAP,
    NODES_MAP,
    SERVICE_FLOWS4_MAP,
    SERVICE_FLOWS6_MAP,
    SERVICE_FLOWS_LAYOUT7_MAP,
];

/// Paths under one pin directory.
#[derive(Debug, Clone)]
pub(super) struct Pins {
    dir: PathBuf,
}

impl Pins {
    pub(super) fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
        }
    }

    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    pub(super) fn map(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub(super) fn links_dir(&self) -> PathBuf {
        self.dir.join(LINKS_DIR)
    }

    pub(super) fn link(&self, interface: &str, direction: Direction) -> PathBuf {
        self.links_dir().join(format!("{interface}-{direction}"))
    }

    /// Creates the pin directory and its `links/`.
    pub(super) fn create(&self) -> Result<(), Error> {
        let links = self.links_dir();
        fs::create_dir_all(&links).map_err(|source| Error::Io {
            operation: "creating pin directory",
            path: links,
            source,
        })
    }
}

/// Splits a link pin's file name into interface and direction.
pub(super) fn parse_link_name(name: &str) -> Option<(&str, Direction)> {
    let (interface, direction) = name.rsplit_once('-')?;
    let direction = match direction {
        "ingress" => Direction::Ingress,
        "egress" => Direction::Egress,
        "uplink" => Direction::Uplink,
        _ => return None,
    };
    (!interface.is_empty()).then_some((interface, direction))
}

/// The shape this layout gives each pinned map.
pub(super) fn expected_shape(map: &str) -> Option<MapShape> {
    let shape = |map_type, key: usize, value: usize, max_entries| MapShape {
        map_type: Some(map_type),
        key_size: key as u32,
        value_size: value as u32,
        max_entries,
        map_flags: 0,
    };
    match map {
        META_MAP => Some(shape(MapType::Array, 4, 4, META_MAX_ENTRIES)),
        ENDPOINTS_MAP => Some(MapShape {
            map_flags: ENDPOINTS_MAP_FLAGS,
            ..shape(
                MapType::Hash,
                size_of::<EndpointKey>(),
                size_of::<EndpointValue>(),
                ENDPOINTS_MAX_ENTRIES,
            )
        }),
        NODES_MAP => Some(MapShape {
            map_flags: NODES_MAP_FLAGS,
            ..shape(
                MapType::Hash,
                size_of::<u32>(),
                size_of::<NodeValue>(),
                NODES_MAX_ENTRIES,
            )
        }),
        FLOWS_MAP => Some(shape(
            MapType::LruPerCpuHash,
            size_of::<FlowKey>(),
            size_of::<FlowValue>(),
            FLOWS_MAX_ENTRIES,
        )),
        SERVICE_FLOWS4_MAP => Some(shape(
            MapType::LruPerCpuHash,
            size_of::<ServiceFlowKey4>(),
            size_of::<FlowValue>(),
            SERVICE_FLOWS_MAX_ENTRIES,
        )),
        SERVICE_FLOWS6_MAP => Some(shape(
            MapType::LruPerCpuHash,
            size_of::<ServiceFlowKey6>(),
            size_of::<FlowValue>(),
            SERVICE_FLOWS_MAX_ENTRIES,
        )),
        // Not a map of this layout: layouts 6 and 7's, taken over by a copy.
        SERVICE_FLOWS_LAYOUT7_MAP => Some(shape(
            MapType::LruPerCpuHash,
            size_of::<ServiceFlowKeyLayout7>(),
            size_of::<FlowValue>(),
            SERVICE_FLOWS_MAX_ENTRIES,
        )),
        CLIENTS_EPOCH_MAP => Some(MapShape {
            map_flags: CLIENTS_EPOCH_MAP_FLAGS,
            ..shape(MapType::Array, size_of::<u32>(), size_of::<u64>(), 1)
        }),
        ADDRESS_FILTER_MAP => Some(shape(
            MapType::Array,
            size_of::<u32>(),
            size_of::<AddressFilter>(),
            FILTER_MAP_MAX_ENTRIES,
        )),
        STATS_MAP => Some(shape(
            MapType::PerCpuArray,
            size_of::<u32>(),
            size_of::<u64>(),
            STATS_MAX_ENTRIES,
        )),
        SERVICES_MAP => Some(MapShape {
            map_flags: SERVICES_MAP_FLAGS,
            ..shape(
                MapType::LpmTrie,
                size_of::<ServiceKey>(),
                size_of::<u32>(),
                SERVICES_MAX_ENTRIES,
            )
        }),
        INTERFACES_MAP => Some(MapShape {
            map_flags: INTERFACES_MAP_FLAGS,
            ..shape(
                MapType::Array,
                size_of::<u32>(),
                size_of::<InterfaceValue>(),
                INTERFACES_MAX_ENTRIES,
            )
        }),
        _ => None,
    }
}

/// ENDPOINTS as layouts 2 and 3 made it: a preallocated hash of 65,536 entries,
/// `identity: u32, flags: u32`.
pub(super) fn old_endpoints_shape() -> MapShape {
    MapShape {
        map_type: Some(MapType::Hash),
        key_size: size_of::<EndpointKey>() as u32,
        value_size: 8,
        max_entries: 65_536,
        map_flags: 0,
    }
}

/// Whether `found` is the shape of layouts 6 and 7's SERVICE_FLOWS (any size).
pub(super) fn is_layout7_service_flows(found: &MapShape) -> bool {
    expected_shape(SERVICE_FLOWS_LAYOUT7_MAP)
        .is_some_and(|expected| shape_matches(SERVICE_FLOWS_LAYOUT7_MAP, &expected, found))
}

/// The shape `map` has in the maps of layout `layout` (this one or one of
/// [`MIGRATES_FROM`]).
pub(super) fn expected_shape_in(layout: u32, map: &str) -> Option<MapShape> {
    if map == ENDPOINTS_MAP && ENDPOINTS_COPIED_FROM.contains(&layout) {
        return Some(old_endpoints_shape());
    }
    expected_shape(map)
}

/// Whether a pinned map of shape `found` is `map` of this layout. The sizes of
/// FLOWS, ENDPOINTS and NODES are the agent's to choose (`--flows-max-entries`,
/// ...), so any size is that map.
pub(super) fn shape_matches(map: &str, expected: &MapShape, found: &MapShape) -> bool {
    if SIZED_MAPS.contains(&map) {
        return found.max_entries > 0
            && MapShape {
                max_entries: expected.max_entries,
                ..*found
            } == *expected;
    }
    found == expected
}

/// Says so when `map` is pinned with another size than asked for: the pinned map,
/// and its content, stay.
pub(super) fn warn_size(
    pinned: &[(&'static str, MapData)],
    map: &'static str,
    wanted: Option<u32>,
) {
    let Some(wanted) = wanted else { return };
    let Some(info) = pinned
        .iter()
        .find(|(name, _)| *name == map)
        .and_then(|(_, data)| data.info().ok())
    else {
        return;
    };
    if info.max_entries() != wanted {
        tracing::warn!(
            map,
            pinned = info.max_entries(),
            wanted,
            "{map} is pinned with another size; it keeps it (and its content) until `census-agent uninstall`"
        );
    }
}

pub(super) fn shape_of(info: &MapInfo) -> MapShape {
    MapShape {
        map_type: info.map_type().ok(),
        key_size: info.key_size(),
        value_size: info.value_size(),
        max_entries: info.max_entries(),
        map_flags: info.map_flags(),
    }
}

fn meta_error(source: MapError) -> Error {
    Error::Map {
        map: META_MAP,
        source,
    }
}

/// What the pin directory holds before the object is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Layout {
    /// Nothing pinned yet: the loader creates and pins every map.
    Fresh,
    /// Maps of this layout (or a meta map not stamped yet): reuse them.
    Current,
    /// Maps of an older layout this one takes over ([`MIGRATES_FROM`]): reuse
    /// them (ENDPOINTS is copied into a new map, see `migrate`), create the maps
    /// it lacks, then stamp this layout.
    Older(u32),
}

/// Reads the layout version pinned in `pins` and checks every pinned map has
/// the shape this layout expects, before anything is loaded: a newer or older
/// agent's maps are refused, never misread.
pub(super) fn check_layout(pins: &Pins) -> Result<Layout, Error> {
    let meta_path = pins.map(META_MAP);
    if !meta_path.exists() {
        if DATA_MAPS.iter().any(|map| pins.map(map).exists()) {
            return Err(Error::UnversionedPins {
                pin_dir: pins.dir().to_owned(),
                meta: META_MAP,
            });
        }
        return Ok(Layout::Fresh);
    }

    let found = pinned_layout(&meta_path)?;
    let layout = if MIGRATES_FROM.contains(&found) {
        Layout::Older(found)
    } else {
        Layout::Current
    };
    if found != 0 && found != LAYOUT_VERSION && layout == Layout::Current {
        return Err(Error::LayoutMismatch {
            pin_dir: pins.dir().to_owned(),
            found,
            expected: LAYOUT_VERSION,
        });
    }
    for map in DATA_MAPS {
        let path = pins.map(map);
        if !path.exists() {
            continue;
        }
        let info = MapInfo::from_pin(&path).map_err(|source| Error::Map { map, source })?;
        let found = shape_of(&info);
        // An older layout's ENDPOINTS is copied into one of this layout; a migration
        // killed midway left one of this layout beside it.
        if map == ENDPOINTS_MAP
            && let Layout::Older(from) = layout
            && expected_shape_in(from, map) == Some(found)
        {
            continue;
        }
        if let Some(expected) = expected_shape(map)
            && !shape_matches(map, &expected, &found)
        {
            return Err(Error::PinnedMapMismatch {
                path,
                layout: LAYOUT_VERSION,
                expected,
                found,
            });
        }
    }
    Ok(layout)
}

/// The layout version recorded in the meta map pinned at `path` (0: not stamped).
fn pinned_layout(path: &Path) -> Result<u32, Error> {
    let info = MapInfo::from_pin(path).map_err(meta_error)?;
    let found = shape_of(&info);
    // Only the kind and sizes are frozen; the entry count may grow one day.
    if let Some(expected) = expected_shape(META_MAP)
        && (found.map_type != expected.map_type
            || found.key_size != expected.key_size
            || found.value_size != expected.value_size
            || found.max_entries < 1)
    {
        return Err(Error::UnrecognizedMeta {
            path: path.to_owned(),
            expected,
            found,
        });
    }
    let meta: Array<MapData, u32> = MapData::from_pin(path)
        .and_then(|data| Array::try_from(aya::maps::Map::Array(data)))
        .map_err(meta_error)?;
    meta.get(&META_LAYOUT_INDEX, 0).map_err(meta_error)
}

/// Records this layout's version in the meta map.
pub(super) fn stamp_layout(meta: &mut Array<MapData, u32>) -> Result<(), Error> {
    let current = meta.get(&META_LAYOUT_INDEX, 0).map_err(meta_error)?;
    if current != LAYOUT_VERSION {
        meta.set(META_LAYOUT_INDEX, LAYOUT_VERSION, 0)
            .map_err(meta_error)?;
    }
    Ok(())
}

/// What [`uninstall`] removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Uninstalled {
    /// Links detached from their interface (or found already defunct).
    pub links: Vec<PathBuf>,
    /// Other pins removed (maps).
    pub pins: Vec<PathBuf>,
    /// Whether the pin directory existed.
    pub removed_dir: bool,
}

/// Detaches every program census attached from `pin_dir`'s links, removes every
/// pin and the directory. Idempotent: a missing directory is not an error. Needs
/// the same capabilities as [`Datapath::open`](super::Datapath::open).
///
/// Links are detached explicitly (`BPF_LINK_DETACH`) before their pin is
/// removed, so no program stays attached for a moment after this returns, even
/// if another process holds the link open.
pub fn uninstall(pin_dir: impl AsRef<Path>) -> Result<Uninstalled, Error> {
    let pins = Pins::new(pin_dir.as_ref());
    let mut done = Uninstalled::default();
    if !pins.dir().exists() {
        return Ok(done);
    }
    privileges::check_capabilities()?;
    // Never delete anything on a file system that is not bpffs.
    if !privileges::is_bpffs(pins.dir())? {
        return Err(Error::NotBpffs {
            path: pins.dir().to_owned(),
        });
    }
    let links = pins.links_dir();
    // An agent still running may pin a link again between the listing and the
    // directory's removal (its full pass re-asserts the node's hooks): list again, a
    // few times, before giving up.
    let mut rounds = 0;
    while links.exists() {
        for path in read_dir(&links)? {
            let record = path
                .file_name()
                .and_then(|name| name.to_str())
                .and_then(|name| super::tc::TcRecord::parse(&links, name));
            match record {
                // Its filter is deleted if its interface is in this network namespace.
                Some(record) => record.remove()?,
                None => detach_and_unpin(&path)?,
            }
            done.links.push(path);
        }
        rounds += 1;
        match remove_dir(&links) {
            Err(Error::Io { source, .. })
                if source.kind() == io::ErrorKind::DirectoryNotEmpty && rounds < 5 => {}
            other => other?,
        }
    }
    for path in read_dir(pins.dir())? {
        if path.is_dir() {
            // Not census's: leave it, and the directory with it.
            return Err(Error::Io {
                operation: "removing pin directory (it holds a directory census did not create)",
                path,
                source: io::Error::from(io::ErrorKind::DirectoryNotEmpty),
            });
        }
        remove_file(&path)?;
        done.pins.push(path);
    }
    remove_dir(pins.dir())?;
    done.removed_dir = true;
    Ok(done)
}

/// Opens the TCX link pinned at `path` and reads its info.
pub(super) fn open_tcx_link(path: &Path) -> Result<(OwnedFd, sys::LinkInfo), Error> {
    open_link(path, &[sys::BPF_LINK_TYPE_TCX])
}

/// Opens the link pinned at `path`, one of census's kinds (`link_types`), and
/// reads its info.
pub(super) fn open_link(
    path: &Path,
    link_types: &[u32],
) -> Result<(OwnedFd, sys::LinkInfo), Error> {
    let link_error = |operation| {
        move |source| Error::Link {
            operation,
            path: path.to_owned(),
            source,
        }
    };
    let fd = sys::obj_get(path).map_err(link_error("opening"))?;
    let info = sys::link_info(fd.as_fd()).map_err(link_error("reading the info"))?;
    if !link_types.contains(&info.link_type) {
        return Err(Error::NotCensusLink {
            path: path.to_owned(),
            link_type: info.link_type,
        });
    }
    Ok((fd, info))
}

/// Detaches the link pinned at `path` from its hook now (a link whose interface
/// is gone is already detached) and removes the pin.
pub(super) fn detach_and_unpin(path: &Path) -> Result<(), Error> {
    let fd = open_link(path, &[sys::BPF_LINK_TYPE_TCX, sys::BPF_LINK_TYPE_CGROUP])?.0;
    sys::link_detach(fd.as_fd()).map_err(|source| Error::Link {
        operation: "detaching",
        path: path.to_owned(),
        source,
    })?;
    remove_file(path)
}

fn read_dir(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let io_error = |source| Error::Io {
        operation: "reading directory",
        path: dir.to_owned(),
        source,
    };
    let mut paths = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_error)? {
        paths.push(entry.map_err(io_error)?.path());
    }
    paths.sort();
    Ok(paths)
}

fn remove_file(path: &Path) -> Result<(), Error> {
    match fs::remove_file(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(Error::Io {
            operation: "removing pin",
            path: path.to_owned(),
            source: error,
        }),
        _ => Ok(()),
    }
}

fn remove_dir(path: &Path) -> Result<(), Error> {
    match fs::remove_dir(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(Error::Io {
            operation: "removing directory",
            path: path.to_owned(),
            source: error,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_names_round_trip() {
        let pins = Pins::new(Path::new("/sys/fs/bpf/census"));
        let path = pins.link("lxc-a-b", Direction::Egress);
        assert_eq!(path, Path::new("/sys/fs/bpf/census/links/lxc-a-b-egress"));
        let name = path.file_name().and_then(|name| name.to_str());
        assert_eq!(
            name.and_then(parse_link_name),
            Some(("lxc-a-b", Direction::Egress))
        );
    }

    #[test]
    fn rejects_foreign_link_names() {
        for name in ["eth0", "eth0-sideways", "-ingress", ""] {
            assert_eq!(parse_link_name(name), None, "{name}");
        }
    }

    #[test]
    fn endpoints_has_one_shape_per_layout_and_any_size() -> Result<(), &'static str> {
        let current = expected_shape(ENDPOINTS_MAP).ok_or("no shape")?;
        assert_eq!(current.map_flags, 1, "BPF_F_NO_PREALLOC");
        for older in ENDPOINTS_COPIED_FROM {
            assert_eq!(
                expected_shape_in(older, ENDPOINTS_MAP),
                Some(old_endpoints_shape())
            );
        }
        // Layout 4's ENDPOINTS is this layout's: taken over in place.
        assert_eq!(expected_shape_in(4, ENDPOINTS_MAP), Some(current));
        assert_eq!(
            expected_shape_in(LAYOUT_VERSION, ENDPOINTS_MAP),
            Some(current)
        );
        assert!(!shape_matches(
            ENDPOINTS_MAP,
            &current,
            &old_endpoints_shape()
        ));
        let bigger = MapShape {
            max_entries: 1 << 20,
            ..current
        };
        assert!(shape_matches(ENDPOINTS_MAP, &current, &bigger));
        let preallocated = MapShape {
            map_flags: 0,
            ..current
        };
        assert!(!shape_matches(ENDPOINTS_MAP, &current, &preallocated));
        let nodes = expected_shape(NODES_MAP).ok_or("no shape")?;
        assert_eq!(
            (nodes.key_size, nodes.value_size, nodes.map_flags),
            (4, 580, 1)
        );
        Ok(())
    }

    #[test]
    fn every_pinned_map_has_a_shape() {
        for map in MAPS {
            assert!(expected_shape(map).is_some(), "{map}");
        }
        assert_eq!(expected_shape("OTHER"), None);
    }
}
