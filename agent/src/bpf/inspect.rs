//! Read-only inspection of the maps an agent pinned, for the `census` CLI.
//!
//! [`Inspector::open`] loads nothing and writes nothing: it opens the pins, checks
//! the layout version recorded in `CENSUS_META` first and then the shape of every
//! map, and afterwards only looks entries up. It works while the agent is down, and
//! says precisely why it cannot read (nothing pinned, no permission, another layout,
//! a map of another shape), so the CLI can give each case its own exit code.
//! Every map is opened with `BPF_F_RDONLY` (aya 0.14's `MapData::from_pin` asks
//! for read-write; `sys::obj_get_read_only` does not), so the kernel itself
//! refuses any write through these descriptors.
//!
//! It reads the maps of this layout and of the older layouts an agent takes over
//! ([`MIGRATES_FROM`]): what a newer census reads of an older map is what that
//! map means, never a guess (STATS, new in layout 3, is absent from layout 2;
//! NODES, new in layout 4, from both, and their ENDPOINTS values have no node;
//! SERVICES, new in layout 5, from all three: they show none). While
//! an agent migrates ENDPOINTS, the old map set aside is read: it is complete, the
//! new one may not be yet.
#![forbid(unsafe_code)]

use std::{
    collections::BTreeMap,
    fmt, fs, io,
    net::IpAddr,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, HashMap, Map, MapData, MapError, MapInfo, MapType, PerCpuHashMap},
    sys::SyscallError,
};
use census_common::{
    CLIENTS_EPOCH_MAP, ENDPOINTS_MAP, EndpointKey, EndpointValue, FLOWS_MAP, FlowKey, FlowValue,
    INTERFACES_MAP, LAYOUT_VERSION, META_LAYOUT_INDEX, META_MAP, MIGRATES_FROM, NODES_MAP,
    SERVICE_FLOWS_LAYOUT7_MAP, SERVICE_FLOWS4_MAP, SERVICE_FLOWS6_MAP, SERVICES_MAP, STATS_MAP,
    filter::{ADDRESS_FILTER_MAP, AddressFilter},
};
use ipnet::IpNet;

use super::{
    DatapathStats, Error, Flow, Interface, MapShape,
    maps::{StatsMap, used_slots},
    migrate,
    nodes::{self, NodeRecord, NodesMap},
    pins::{self, Pins},
    privileges,
    service_flows::{ServiceFlow, ServiceFlowMaps, SplitMaps},
    services::{self, ServiceKind, ServicesMap},
    sys::{self, MappedArray},
    tc,
};

/// Why the pinned maps cannot be read. Nothing was written in any case.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("{path} does not exist")]
    MissingDir { path: PathBuf },

    #[error("{path} is not a directory")]
    NotADir { path: PathBuf },

    #[error("{path} is not on a BPF file system (bpffs)")]
    NotBpffs { path: PathBuf },

    #[error("map {map} is not pinned at {path}")]
    MissingMap { map: &'static str, path: PathBuf },

    #[error("no permission to read {path}")]
    PermissionDenied {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("maps are pinned in {pin_dir} but their layout version map {META_MAP} is missing")]
    Unversioned { pin_dir: PathBuf },

    #[error(
        "the maps pinned in {pin_dir} have layout version {found}, this build reads layout {expected}"
    )]
    LayoutMismatch {
        pin_dir: PathBuf,
        /// 0: the meta map exists but an agent has not stamped it yet.
        found: u32,
        expected: u32,
    },

    #[error(
        "the map pinned at {path} is not what layout {layout} expects: expected {expected}, found {found}"
    )]
    ShapeMismatch {
        path: PathBuf,
        layout: u32,
        expected: MapShape,
        found: MapShape,
    },

    #[error("reading the map pinned at {path} failed")]
    Map {
        path: PathBuf,
        #[source]
        source: MapError,
    },

    #[error("checking {path} failed")]
    Check {
        path: PathBuf,
        #[source]
        source: Box<Error>,
    },

    #[error("{operation} {path} failed")]
    Io {
        operation: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// One pinned map as the kernel describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct PinnedMapInfo {
    /// The name census gives it (the pin's file name).
    pub name: &'static str,
    /// The name the kernel knows it by (at most 15 bytes).
    pub kernel_name: String,
    pub pin: PathBuf,
    /// The kernel's map id.
    pub id: u32,
    pub shape: MapShape,
    /// Entries present now (for an array, every slot).
    pub entries: u64,
}

type EndpointsMap = HashMap<MapData, EndpointKey, EndpointValue>;
/// ENDPOINTS of layouts 2 and 3: `identity: u32, flags: u32`.
type OldEndpointsMap = HashMap<MapData, EndpointKey, [u32; 2]>;

/// ENDPOINTS, of this layout or an older one.
enum Endpoints {
    Current(EndpointsMap),
    Old(OldEndpointsMap),
}

impl Endpoints {
    fn keys(&self) -> Box<dyn Iterator<Item = Result<EndpointKey, MapError>> + '_> {
        match self {
            Self::Current(map) => Box::new(map.keys()),
            Self::Old(map) => Box::new(map.keys()),
        }
    }

    fn iter(
        &self,
    ) -> Box<dyn Iterator<Item = Result<(EndpointKey, EndpointValue), MapError>> + '_> {
        match self {
            Self::Current(map) => Box::new(map.iter()),
            Self::Old(map) => Box::new(map.iter().map(|entry| {
                entry.map(|(key, [identity, flags])| {
                    (key, EndpointValue::from_layout3(identity, flags))
                })
            })),
        }
    }

    fn get(&self, key: &EndpointKey) -> Result<EndpointValue, MapError> {
        match self {
            Self::Current(map) => map.get(key, 0),
            Self::Old(map) => map
                .get(key, 0)
                .map(|[identity, flags]| EndpointValue::from_layout3(identity, flags)),
        }
    }
}

type FlowsMap = PerCpuHashMap<MapData, FlowKey, FlowValue>;

/// The maps pinned in one directory, opened for reading after their layout version
/// and shapes were checked.
pub struct Inspector {
    dir: PathBuf,
    layout: u32,
    infos: Vec<(&'static str, PathBuf, MapInfo)>,
    endpoints: Endpoints,
    /// `None` in the maps of a layout before NODES existed.
    nodes: Option<NodesMap>,
    /// `None` in the maps of a layout before SERVICES existed.
    services: Option<ServicesMap>,
    /// INTERFACES' slots, mapped read-only.
    interfaces: MappedArray,
    flows: FlowsMap,
    /// `None` in the maps of a layout before SERVICE_FLOWS existed.
    service_flows: Option<ServiceFlowMaps>,
    /// `None` in the maps of a layout before STATS existed.
    stats: Option<StatsMap>,
}

impl fmt::Debug for Inspector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inspector")
            .field("dir", &self.dir)
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl Inspector {
    /// Opens the maps pinned in `dir` (by default
    /// [`DEFAULT_PIN_DIR`](super::DEFAULT_PIN_DIR)). Refuses, before reading any
    /// entry, maps of another layout version and maps of an unexpected kind or size.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, InspectError> {
        let dir = dir.as_ref().to_owned();
        check_dir(&dir)?;

        // The layout version first: a map of another layout is never interpreted.
        let meta_path = dir.join(META_MAP);
        if !exists(&meta_path)? {
            for map in pins::DATA_MAPS {
                if exists(&dir.join(map))? {
                    return Err(InspectError::Unversioned { pin_dir: dir });
                }
            }
            return Err(InspectError::MissingMap {
                map: META_MAP,
                path: meta_path,
            });
        }
        let (meta, meta_info) = open_map(META_MAP, &meta_path)?;
        let layout = read_layout(meta, &meta_path)?;
        if layout != LAYOUT_VERSION && !MIGRATES_FROM.contains(&layout) {
            return Err(InspectError::LayoutMismatch {
                pin_dir: dir,
                found: layout,
                expected: LAYOUT_VERSION,
            });
        }

        // Mid-migration, the old map set aside is the complete one.
        let aside = migrate::source_pin(&Pins::new(&dir), layout);
        let endpoints_path = if layout != LAYOUT_VERSION && exists(&aside)? {
            aside
        } else {
            dir.join(ENDPOINTS_MAP)
        };
        let (endpoints, endpoints_info) = open_map_in(layout, ENDPOINTS_MAP, &endpoints_path)?;
        let endpoints_error = |source| InspectError::Map {
            path: endpoints_path.clone(),
            source,
        };
        let endpoints = if pins::shape_of(&endpoints_info) == pins::old_endpoints_shape() {
            Endpoints::Old(OldEndpointsMap::try_from(endpoints).map_err(endpoints_error)?)
        } else {
            Endpoints::Current(EndpointsMap::try_from(endpoints).map_err(endpoints_error)?)
        };
        let flows_path = dir.join(FLOWS_MAP);
        let (flows, flows_info) = open_map(FLOWS_MAP, &flows_path)?;
        let flows = FlowsMap::try_from(flows).map_err(|source| InspectError::Map {
            path: flows_path.clone(),
            source,
        })?;
        let interfaces_path = dir.join(INTERFACES_MAP);
        let (interfaces, interfaces_info) = open_map(INTERFACES_MAP, &interfaces_path)?;
        let interfaces = map_slots(&interfaces, &interfaces_info, &interfaces_path)?;
        let mut infos = vec![
            (META_MAP, meta_path, meta_info),
            (ENDPOINTS_MAP, endpoints_path, endpoints_info),
            (FLOWS_MAP, flows_path, flows_info),
            (INTERFACES_MAP, interfaces_path, interfaces_info),
        ];
        // Maps later layouts added: STATS in 3, NODES in 4, SERVICES in 5,
        // SERVICE_FLOWS in 6 (one per family in 8), ADDRESS_FILTER in 7 and
        // CLIENTS_EPOCH in 8 (listed, not read: ADDRESS_FILTER is derived from
        // SERVICES and ENDPOINTS, CLIENTS_EPOCH counts their writes).
        let stats = open_since(&dir, layout, STATS_MAP, &mut infos)?;
        let nodes = open_since(&dir, layout, NODES_MAP, &mut infos)?;
        let services = open_since(&dir, layout, SERVICES_MAP, &mut infos)?;
        let service_flows = open_service_flows(&dir, layout, &mut infos)?;
        let _: Option<Array<MapData, AddressFilter>> =
            open_since(&dir, layout, ADDRESS_FILTER_MAP, &mut infos)?;
        let _: Option<Array<MapData, u64>> =
            open_since(&dir, layout, CLIENTS_EPOCH_MAP, &mut infos)?;
        Ok(Self {
            service_flows,
            dir,
            layout,
            infos,
            endpoints,
            nodes,
            services,
            interfaces,
            flows,
            stats,
        })
    }

    /// The directory the maps are pinned in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The layout version recorded with the maps: [`LAYOUT_VERSION`], or an older
    /// one of [`MIGRATES_FROM`] (other versions are refused).
    pub fn layout_version(&self) -> u32 {
        self.layout
    }

    /// The programs' own counters; `None` for maps of a layout without STATS.
    pub fn stats(&self) -> Result<Option<DatapathStats>, InspectError> {
        let Some(stats) = &self.stats else {
            return Ok(None);
        };
        DatapathStats::read(stats)
            .map(Some)
            .map_err(|source| self.map_error(STATS_MAP, source))
    }

    /// FLOWS' size: the pairs it holds before it evicts.
    pub fn flows_max_entries(&self) -> u32 {
        self.infos
            .iter()
            .find(|(name, _, _)| *name == FLOWS_MAP)
            .map_or(0, |(_, _, info)| info.max_entries())
    }

    /// The number of identity pairs in FLOWS.
    pub fn flow_pairs(&self) -> Result<u64, InspectError> {
        count(self.flows.keys(), &self.dir.join(FLOWS_MAP))
    }

    /// The names of the interfaces census is attached to, by ifindex, as the
    /// agent named them (in its network namespace, which need not be the
    /// caller's): from the link pins (a TCX link's interface, read from the
    /// kernel) and the records of TC filters. An interface whose link outlived it
    /// is left out.
    pub fn interface_names(&self) -> BTreeMap<u32, String> {
        let links = self.dir.join("links");
        let mut names = BTreeMap::new();
        for record in tc::records(&links).unwrap_or_default() {
            names.insert(record.ifindex, record.interface);
        }
        for entry in fs::read_dir(&links).into_iter().flatten().flatten() {
            let path = entry.path();
            let Some((interface, _)) = path
                .file_name()
                .and_then(|name| name.to_str())
                .and_then(pins::parse_link_name)
            else {
                continue;
            };
            let interface = interface.to_owned();
            if let Ok(fd) = sys::obj_get(&path)
                && let Ok(info) = sys::link_info(fd.as_fd())
                && info.link_type == sys::BPF_LINK_TYPE_TCX
                && info.tcx_ifindex != 0
            {
                names.insert(info.tcx_ifindex, interface);
            }
        }
        names
    }

    /// Every pinned map with its current number of entries (for INTERFACES, the
    /// slots in use).
    pub fn maps(&self) -> Result<Vec<PinnedMapInfo>, InspectError> {
        let mut maps = Vec::with_capacity(self.infos.len());
        for (name, pin, info) in &self.infos {
            let shape = pins::shape_of(info);
            let entries = match *name {
                ENDPOINTS_MAP => count(self.endpoints.keys(), pin)?,
                FLOWS_MAP => count(self.flows.keys(), pin)?,
                NODES_MAP => match &self.nodes {
                    Some(nodes) => count(nodes.keys(), pin)?,
                    None => 0,
                },
                SERVICES_MAP => match &self.services {
                    Some(services) => count(services.keys(), pin)?,
                    None => 0,
                },
                SERVICE_FLOWS4_MAP | SERVICE_FLOWS6_MAP | SERVICE_FLOWS_LAYOUT7_MAP => {
                    match (&self.service_flows, *name) {
                        (Some(ServiceFlowMaps::Split(maps)), SERVICE_FLOWS4_MAP) => {
                            count(maps.v4.keys(), pin)?
                        }
                        (Some(ServiceFlowMaps::Split(maps)), SERVICE_FLOWS6_MAP) => {
                            count(maps.v6.keys(), pin)?
                        }
                        (Some(ServiceFlowMaps::Layout7(map)), _) => count(map.keys(), pin)?,
                        _ => 0,
                    }
                }
                INTERFACES_MAP => used_slots(&self.interfaces).len() as u64,
                _ => u64::from(shape.max_entries),
            };
            maps.push(PinnedMapInfo {
                name,
                kernel_name: String::from_utf8_lossy(info.name()).into_owned(),
                pin: pin.clone(),
                id: info.id(),
                shape,
                entries,
            });
        }
        Ok(maps)
    }

    /// Every ENDPOINTS entry by raw key (`EndpointKey::ip` gives the address of the
    /// keys census writes). A key deleted while the map is walked may be missing.
    pub fn endpoints(&self) -> Result<BTreeMap<EndpointKey, EndpointValue>, InspectError> {
        let mut entries = BTreeMap::new();
        for entry in self.endpoints.iter() {
            match entry {
                Ok((key, value)) => {
                    entries.insert(key, value);
                }
                Err(error) if is_not_found(&error) => {}
                Err(source) => return Err(self.map_error(ENDPOINTS_MAP, source)),
            }
        }
        Ok(entries)
    }

    /// The ENDPOINTS entry of `ip`, if any.
    pub fn endpoint(&self, ip: IpAddr) -> Result<Option<EndpointValue>, InspectError> {
        match self.endpoints.get(&EndpointKey::from(ip)) {
            Ok(value) => Ok(Some(value)),
            Err(error) if is_not_found(&error) => Ok(None),
            Err(source) => Err(self.map_error(ENDPOINTS_MAP, source)),
        }
    }

    /// Every NODES entry, by index; empty in the maps of a layout without NODES.
    pub fn nodes(&self) -> Result<BTreeMap<u16, NodeRecord>, InspectError> {
        let Some(map) = &self.nodes else {
            return Ok(BTreeMap::new());
        };
        nodes::read_all(map).map_err(|error| match error {
            Error::Map { source, .. } => self.map_error(NODES_MAP, source),
            other => InspectError::Check {
                path: self.dir.join(NODES_MAP),
                source: Box::new(other),
            },
        })
    }

    /// Every SERVICES entry census writes, by range; empty in the maps of a layout
    /// without SERVICES.
    pub fn services(&self) -> Result<BTreeMap<IpNet, ServiceKind>, InspectError> {
        let Some(map) = &self.services else {
            return Ok(BTreeMap::new());
        };
        services::read_all(map).map_err(|error| match error {
            Error::Map { source, .. } => self.map_error(SERVICES_MAP, source),
            other => InspectError::Check {
                path: self.dir.join(SERVICES_MAP),
                source: Box::new(other),
            },
        })
    }

    /// Every Service counter, summed over CPUs (see
    /// [`Datapath::service_flows`](super::Datapath::service_flows)); empty in the
    /// maps of a layout without them.
    pub fn service_flows(&self) -> Result<Vec<ServiceFlow>, InspectError> {
        let Some(maps) = &self.service_flows else {
            return Ok(Vec::new());
        };
        maps.read_all()
            .map_err(|(map, source)| self.map_error(map, source))
    }

    /// Every used slot of INTERFACES, by slot: the interfaces census counts on
    /// and the endpoint behind each. Reading them takes no syscall.
    pub fn interfaces(&self) -> BTreeMap<u32, Interface> {
        used_slots(&self.interfaces)
    }

    /// Every identity pair's counters, summed over CPUs, ordered by pair. The walk
    /// is not atomic: a pair evicted meanwhile is missing, never counted twice.
    pub fn flows(&self) -> Result<Vec<Flow>, InspectError> {
        let mut flows = BTreeMap::new();
        for entry in self.flows.iter() {
            match entry {
                Ok((key, per_cpu)) => {
                    let flow = per_cpu.iter().fold(
                        Flow {
                            src_identity: key.src_identity,
                            dst_identity: key.dst_identity,
                            packets: 0,
                            bytes: 0,
                        },
                        |flow, value| Flow {
                            packets: flow.packets.wrapping_add(value.packets),
                            bytes: flow.bytes.wrapping_add(value.bytes),
                            ..flow
                        },
                    );
                    flows.insert(key, flow);
                }
                Err(error) if is_not_found(&error) => {}
                Err(source) => return Err(self.map_error(FLOWS_MAP, source)),
            }
        }
        Ok(flows.into_values().collect())
    }

    fn map_error(&self, map: &str, source: MapError) -> InspectError {
        InspectError::Map {
            path: self.dir.join(map),
            source,
        }
    }
}

/// Whether `path` exists; a permission error is an error, not a "no".
fn exists(path: &Path) -> Result<bool, InspectError> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(io_error("reading", path, source, None)),
    }
}

fn io_error(
    operation: &'static str,
    path: &Path,
    source: io::Error,
    map: Option<&'static str>,
) -> InspectError {
    let path = path.to_owned();
    match (source.kind(), map) {
        (io::ErrorKind::NotFound, Some(map)) => InspectError::MissingMap { map, path },
        (io::ErrorKind::NotFound, None) => InspectError::MissingDir { path },
        (io::ErrorKind::PermissionDenied, _) => InspectError::PermissionDenied { path, source },
        _ => InspectError::Io {
            operation,
            path,
            source,
        },
    }
}

/// `dir` is a directory of a bpffs, or the error that says what it is instead.
fn check_dir(dir: &Path) -> Result<(), InspectError> {
    match fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(InspectError::NotADir {
                path: dir.to_owned(),
            });
        }
        Err(source) => return Err(io_error("reading", dir, source, None)),
    }
    match privileges::is_bpffs(dir) {
        Ok(true) => {}
        Ok(false) => {
            return Err(InspectError::NotBpffs {
                path: dir.to_owned(),
            });
        }
        Err(Error::Io {
            operation,
            path,
            source,
        }) => return Err(io_error(operation, &path, source, None)),
        Err(source) => {
            return Err(InspectError::Check {
                path: dir.to_owned(),
                source: Box::new(source),
            });
        }
    }
    Ok(())
}

/// A map a later layout added: opened and typed when this layout has it or its
/// pin is there (an older layout's directory has none), its info kept in `infos`.
fn open_since<M>(
    dir: &Path,
    layout: u32,
    name: &'static str,
    infos: &mut Vec<(&'static str, PathBuf, MapInfo)>,
) -> Result<Option<M>, InspectError>
where
    M: TryFrom<Map, Error = MapError>,
{
    let path = dir.join(name);
    if layout != LAYOUT_VERSION && !exists(&path)? {
        return Ok(None);
    }
    let (map, info) = open_map(name, &path)?;
    let map = M::try_from(map).map_err(|source| InspectError::Map {
        path: path.clone(),
        source,
    })?;
    infos.push((name, path, info));
    Ok(Some(map))
}

/// The Service counters: this layout's two maps, or layouts 6 and 7's one (also
/// mid-migration, while the old map is the complete one); `None` before layout 6.
fn open_service_flows(
    dir: &Path,
    layout: u32,
    infos: &mut Vec<(&'static str, PathBuf, MapInfo)>,
) -> Result<Option<ServiceFlowMaps>, InspectError> {
    if layout != LAYOUT_VERSION && exists(&dir.join(SERVICE_FLOWS_LAYOUT7_MAP))? {
        let map = open_since(dir, layout, SERVICE_FLOWS_LAYOUT7_MAP, infos)?;
        return Ok(map.map(ServiceFlowMaps::Layout7));
    }
    let v4 = open_since(dir, layout, SERVICE_FLOWS4_MAP, infos)?;
    let v6 = open_since(dir, layout, SERVICE_FLOWS6_MAP, infos)?;
    Ok(v4
        .zip(v6)
        .map(|(v4, v6)| ServiceFlowMaps::Split(SplitMaps { v4, v6 })))
}

/// Opens the pin of `name`, checking the map's kind and sizes against this layout.
fn open_map(name: &'static str, path: &Path) -> Result<(Map, MapInfo), InspectError> {
    open_map_in(LAYOUT_VERSION, name, path)
}

/// Opens the pin of `name`, checking the map's kind and sizes against `layout`'s
/// or this one's (a migration killed midway leaves a map of this layout beside
/// the maps of the older one).
fn open_map_in(
    layout: u32,
    name: &'static str,
    path: &Path,
) -> Result<(Map, MapInfo), InspectError> {
    let map_error = |source| InspectError::Map {
        path: path.to_owned(),
        source,
    };
    let fd = sys::obj_get_read_only(path).map_err(|io_error| {
        // EPERM: this user may not use bpf(2) at all.
        let io_error = if io_error.raw_os_error() == Some(libc::EPERM) {
            io::Error::from(io::ErrorKind::PermissionDenied)
        } else {
            io_error
        };
        self::io_error("opening", path, io_error, Some(name))
    })?;
    let data = MapData::from_fd(fd).map_err(map_error)?;
    let info = data.info().map_err(map_error)?;
    let found = pins::shape_of(&info);
    if let Some(expected) = pins::expected_shape(name) {
        // The meta map's entry count may grow one day; its kind and sizes never change.
        let matches = if name == META_MAP {
            found.map_type == expected.map_type
                && found.key_size == expected.key_size
                && found.value_size == expected.value_size
                && found.max_entries >= 1
        } else {
            pins::shape_matches(name, &expected, &found)
                || pins::expected_shape_in(layout, name) == Some(found)
        };
        if !matches {
            return Err(InspectError::ShapeMismatch {
                path: path.to_owned(),
                layout: LAYOUT_VERSION,
                expected,
                found,
            });
        }
    }
    let map = Map::from_map_data(data).map_err(map_error)?;
    Ok((map, info))
}

/// Maps an opened INTERFACES' slots read-only.
///
/// The one descriptor opened read-write: the kernel maps a BPF map only shared,
/// and `mmap` turns a shared mapping of a read-only descriptor into a private one,
/// which BPF refuses. The mapping is `PROT_READ`, and the descriptor is closed as
/// soon as it is made.
fn map_slots(map: &Map, info: &MapInfo, path: &Path) -> Result<MappedArray, InspectError> {
    let Map::Array(_) = map else {
        return Err(InspectError::ShapeMismatch {
            path: path.to_owned(),
            layout: LAYOUT_VERSION,
            expected: pins::expected_shape(INTERFACES_MAP).unwrap_or(pins::shape_of(info)),
            found: pins::shape_of(info),
        });
    };
    let fd = sys::obj_get(path)
        .map_err(|source| io_error("opening", path, source, Some(INTERFACES_MAP)))?;
    MappedArray::new(fd.as_fd(), info.max_entries(), info.value_size())
        .map_err(|source| io_error("mapping", path, source, Some(INTERFACES_MAP)))
}

fn read_layout(meta: Map, path: &Path) -> Result<u32, InspectError> {
    let map_error = |source| InspectError::Map {
        path: path.to_owned(),
        source,
    };
    let meta: Array<MapData, u32> = Array::try_from(meta).map_err(map_error)?;
    meta.get(&META_LAYOUT_INDEX, 0).map_err(map_error)
}

fn count<K>(
    keys: impl Iterator<Item = Result<K, MapError>>,
    path: &Path,
) -> Result<u64, InspectError> {
    let mut entries = 0;
    for key in keys {
        match key {
            Ok(_) => entries += 1,
            Err(error) if is_not_found(&error) => {}
            Err(source) => {
                return Err(InspectError::Map {
                    path: path.to_owned(),
                    source,
                });
            }
        }
    }
    Ok(entries)
}

fn is_not_found(error: &MapError) -> bool {
    match error {
        MapError::KeyNotFound | MapError::ElementNotFound => true,
        MapError::SyscallError(SyscallError { io_error, .. }) => {
            io_error.kind() == io::ErrorKind::NotFound
        }
        _ => false,
    }
}

/// The kernel's name for a map type, as bpftool prints it (`lru_percpu_hash`).
pub fn map_type_name(map_type: Option<MapType>) -> String {
    let Some(map_type) = map_type else {
        return "unknown".to_owned();
    };
    let camel = format!("{map_type:?}").replace("PerCpu", "Percpu");
    let mut name = String::with_capacity(camel.len() + 4);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                name.push('_');
            }
            name.push(c.to_ascii_lowercase());
        } else {
            name.push(c);
        }
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_types_are_named_as_bpftool_names_them() {
        assert_eq!(map_type_name(Some(MapType::Hash)), "hash");
        assert_eq!(map_type_name(Some(MapType::Array)), "array");
        assert_eq!(
            map_type_name(Some(MapType::LruPerCpuHash)),
            "lru_percpu_hash"
        );
        assert_eq!(map_type_name(None), "unknown");
    }

    #[test]
    fn a_missing_directory_is_named() {
        let dir = std::env::temp_dir().join("census-inspect-test-missing/census");
        let result = Inspector::open(&dir);
        assert!(
            matches!(&result, Err(InspectError::MissingDir { path }) if *path == dir),
            "{result:?}"
        );
    }

    #[test]
    fn a_directory_off_bpffs_is_refused() {
        let dir = std::env::temp_dir();
        let result = Inspector::open(&dir);
        assert!(
            matches!(&result, Err(InspectError::NotBpffs { path }) if *path == dir),
            "{result:?}"
        );
    }
}
