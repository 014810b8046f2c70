//! Loading the object: maps reused from their pins (or created and pinned), and
//! both programs verified by the kernel.

use std::{
    collections::BTreeSet,
    fmt,
    net::IpAddr,
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, IterableMap as _, Map, MapData},
    programs::{ProgramError, SchedClassifier, TestRun as _, TestRunOptions},
};
use census_common::{
    CLIENTS_EPOCH_MAP, ENDPOINTS_MAP, ENDPOINTS_MAX_ENTRIES, FLOWS_MAP, INTERFACES_MAP,
    MARK_BIT_GLOBAL, META_MAP, NODES_MAP, NODES_MAX_ENTRIES, PROGRAM_UPLINK, SERVICE_FLOWS4_MAP,
    SERVICE_FLOWS6_MAP, SERVICES_MAP, STATS_MAP, filter::ADDRESS_FILTER_MAP,
};

use super::log::{DatapathLog, LogForwarder};
use super::{
    AttachMode, AttachModeChoice, Direction, Error,
    filter::Filter,
    lock::{LockHolder, PinLock},
    maps::{self as datapath_maps, EndpointsMap, FlowsMap, InterfacesMap, StatsMap},
    migrate,
    nodes::NodesMap,
    object,
    pins::{self, Layout, Pins},
    privileges,
    service_flows::{self, SplitMaps},
    services::{self, MarkBit, ServicesMap},
    sockets::{SocketHook, socket_program},
    sys,
};

/// census's datapath on this node: the loaded programs and the pinned maps.
///
/// Dropping it closes this process's descriptors only: maps and links stay
/// pinned, and the programs keep running on the interfaces they are attached to.
/// [`uninstall`](super::uninstall) removes everything.
///
/// It holds the pin directory's lock: no other `Datapath` opens the same pins while
/// it lives, in this process or another.
pub struct Datapath {
    pub(super) pins: Pins,
    pub(super) lock: PinLock,
    pub(super) ebpf: Ebpf,
    pub(super) mode: AttachMode,
    /// Every pinned map, by name, to pin again if the pins are removed under the
    /// running agent ([`Datapath::ensure_pinned`]).
    pub(super) pinned: Vec<(&'static str, MapData)>,
    pub(super) endpoints: EndpointsMap,
    pub(super) interfaces: InterfacesMap,
    pub(super) flows: FlowsMap,
    pub(super) stats: StatsMap,
    pub(super) nodes: NodesMap,
    pub(super) services: ServicesMap,
    pub(super) service_flows: SplitMaps,
    /// CLIENTS_EPOCH, mapped: bumped after each write to ENDPOINTS.
    pub(super) clients_epoch: sys::MappedCounter,
    /// ADDRESS_FILTER and what it is built from; read-only methods learn from
    /// what they read (ENDPOINTS' HOST entries, SERVICES).
    pub(super) filter: Mutex<Filter>,
    /// ENDPOINTS' and NODES' sizes, as created (for the errors of a full map).
    pub(super) endpoints_max_entries: u32,
    pub(super) nodes_max_entries: u32,
    /// Whether the last write of a new ENDPOINTS entry failed because the map was
    /// full: the first such failure is logged as a warning, the others not until a
    /// write succeeds again.
    pub(super) endpoints_full: bool,
    /// The node's own addresses ([`Options::node_addresses`]).
    pub(super) node_addresses: BTreeSet<IpAddr>,
    /// Forwards the programs' aya-log records into `tracing` while logging is on.
    _log: Option<LogForwarder>,
}

impl fmt::Debug for Datapath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Datapath")
            .field("pin_dir", &self.pins.dir())
            .finish_non_exhaustive()
    }
}

impl Datapath {
    /// Loads census's programs, reusing the maps pinned in `pin_dir` (by default
    /// [`DEFAULT_PIN_DIR`](super::DEFAULT_PIN_DIR)) or creating and pinning them.
    ///
    /// Fails clearly, before loading anything, without the needed capabilities,
    /// on a kernel before 5.15, without a BPF file system (the host's to mount), or
    /// when the pinned maps are of another layout version; fails with the
    /// verifier's log when the kernel refuses a program. Already attached links
    /// are adopted by [`Datapath::attach`]. Fails with [`Error::PinDirLocked`]
    /// when another `Datapath` holds the pins (in another agent, or this process).
    pub fn open(pin_dir: impl AsRef<Path>) -> Result<Self, Error> {
        Self::open_with(pin_dir.as_ref(), &Options::default(), PinLock::acquire)
    }

    /// [`Datapath::open`] with `options` (attach mode, FLOWS' size).
    pub fn open_with_options(pin_dir: impl AsRef<Path>, options: &Options) -> Result<Self, Error> {
        Self::open_with(pin_dir.as_ref(), options, PinLock::acquire)
    }

    /// Like [`Datapath::open`], but when another agent holds the pins, tells
    /// `on_busy` who, then waits until it exits (a DaemonSet's pod replacing another
    /// one on the node takes over the moment the old agent is gone).
    pub fn open_waiting(
        pin_dir: impl AsRef<Path>,
        options: &Options,
        on_busy: impl FnOnce(&LockHolder),
    ) -> Result<Self, Error> {
        Self::open_with(pin_dir.as_ref(), options, |dir| {
            PinLock::acquire_waiting(dir, on_busy)
        })
    }

    fn open_with(
        pin_dir: &Path,
        options: &Options,
        lock: impl FnOnce(&Path) -> Result<PinLock, Error>,
    ) -> Result<Self, Error> {
        let pins = Pins::new(pin_dir);
        let (bytes, mode) = preflight(&pins, options)?;
        // Before anything pinned is read: the holder may be migrating it.
        let lock = lock(pins.dir())?;
        let layout = pins::check_layout(&pins)?;
        let migration = migrate::prepare(&pins, layout)?;

        let map_pins: Vec<(&'static str, PathBuf)> = pins::MAPS
            .into_iter()
            .map(|name| (name, pins.map(name)))
            .collect();
        let mut ebpf = load_object(bytes, &map_pins, options)?;
        let mut meta: Array<MapData, u32> = take_map(&mut ebpf, META_MAP)?;
        let (stats, flows) = take_flows(&mut ebpf, &pins, layout)?;
        let mut endpoints: EndpointsMap = take_map(&mut ebpf, ENDPOINTS_MAP)?;
        let nodes: NodesMap = take_map(&mut ebpf, NODES_MAP)?;
        let services: ServicesMap = take_map(&mut ebpf, SERVICES_MAP)?;
        let mut service_flows = SplitMaps {
            v4: take_map(&mut ebpf, SERVICE_FLOWS4_MAP)?,
            v6: take_map(&mut ebpf, SERVICE_FLOWS6_MAP)?,
        };
        let clients_epoch = clients_epoch(&mut ebpf)?;
        let filter = Filter::open(
            take_map(&mut ebpf, ADDRESS_FILTER_MAP)?,
            services::read_all(&services)?
                .into_keys()
                .map(services::service_key),
            || datapath_maps::host_keys(&endpoints),
        )?;
        let endpoints_max_entries = max_entries(ENDPOINTS_MAP, endpoints.map())?;
        let nodes_max_entries = max_entries(NODES_MAP, nodes.map())?;
        bring_to_layout(
            &pins,
            (layout, migration),
            (&mut endpoints, endpoints_max_entries),
            &mut service_flows,
            &mut meta,
        )?;
        let interfaces = ebpf
            .take_map(INTERFACES_MAP)
            .ok_or(Error::MissingFromObject {
                kind: "map",
                name: INTERFACES_MAP,
            })
            .and_then(InterfacesMap::new)?;
        let log = match options.datapath_log {
            DatapathLog::Off => None,
            level => Some(LogForwarder::start(&mut ebpf, level)?),
        };
        let pinned = reopen_pins(&map_pins, options)?;
        tracing::info!(
            pin_dir = %pins.dir().display(),
            reused = layout != Layout::Fresh,
            attach_mode = %mode,
            datapath_log = %options.datapath_log,
            "census datapath loaded"
        );
        Ok(Self {
            pins,
            lock,
            ebpf,
            mode,
            pinned,
            endpoints,
            interfaces,
            flows,
            stats,
            nodes,
            services,
            service_flows,
            clients_epoch,
            filter: Mutex::new(filter),
            endpoints_max_entries,
            nodes_max_entries,
            endpoints_full: false,
            node_addresses: options.node_addresses.clone(),
            _log: log,
        })
    }

    /// ADDRESS_FILTER's keeper, for a write.
    pub(super) fn filter_mut(&mut self) -> &mut Filter {
        self.filter
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// ADDRESS_FILTER's keeper, for what a read learns.
    pub(super) fn filter_lock(&self) -> MutexGuard<'_, Filter> {
        self.filter.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The directory everything is pinned in.
    pub fn pin_dir(&self) -> &Path {
        self.pins.dir()
    }

    /// How this datapath attaches to interfaces.
    pub fn attach_mode(&self) -> AttachMode {
        self.mode
    }

    /// The loaded classifier of `direction`.
    pub(super) fn classifier(&self, direction: Direction) -> Result<&SchedClassifier, Error> {
        let program = direction.program();
        self.ebpf
            .program(program)
            .ok_or(Error::MissingFromObject {
                kind: "program",
                name: program,
            })?
            .try_into()
            .map_err(|source| Error::Program { program, source })
    }

    /// The kernel's run statistics of the program of `direction`.
    pub fn program_stats(&self, direction: Direction) -> Result<ProgramStats, Error> {
        let program = direction.program();
        let classifier = self.classifier(direction)?;
        let info = classifier
            .info()
            .map_err(|source| Error::Program { program, source })?;
        Ok(ProgramStats {
            run_count: info.run_count(),
            run_time: info.run_time(),
        })
    }

    /// Runs the program of `direction` on `packet` (an Ethernet frame) as seen
    /// on the interfaces of `context`, `repeat` times in the kernel
    /// (`BPF_PROG_TEST_RUN`), against the live maps: counted packets land in
    /// FLOWS. For benchmarks and tests.
    pub fn test_run(
        &mut self,
        direction: Direction,
        packet: &[u8],
        context: TestContext,
        repeat: u32,
    ) -> Result<TestRunOutcome, Error> {
        let program = direction.program();
        let classifier = self.classifier(direction)?;
        let ctx = context.to_sk_buff();
        let result = classifier
            .test_run(TestRunOptions {
                data_in: Some(packet),
                ctx_in: Some(&ctx),
                repeat,
                ..TestRunOptions::default()
            })
            .map_err(|source| Error::TestRun { program, source })?;
        Ok(TestRunOutcome {
            // TC verdicts are signed; census returns TC_ACT_UNSPEC (-1).
            return_value: result.return_value.cast_signed(),
            mean_duration: result.duration,
        })
    }
}

/// How [`Datapath::open_with_options`] loads the datapath.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// TCX, TC filters, or TCX where the kernel has it (probed).
    pub attach_mode: AttachModeChoice,
    /// FLOWS' entries when it is created (the object's 65,536 if `None`); a FLOWS
    /// map already pinned keeps its size (and its counters).
    pub flows_max_entries: Option<u32>,
    /// Entries of SERVICE_FLOWS4 and of SERVICE_FLOWS6 when they are created
    /// ([`SERVICE_FLOWS_MAX_ENTRIES`](census_common::SERVICE_FLOWS_MAX_ENTRIES)
    /// if `None`); a pinned one keeps its size and counters.
    pub service_flows_max_entries: Option<u32>,
    /// SERVICE_FLOWS6's entries when it is created, where they differ from
    /// `service_flows_max_entries` (an IPv4-only cluster's); a pinned one keeps
    /// its size and counters.
    pub service_flows6_max_entries: Option<u32>,
    /// ENDPOINTS' entries when it is created
    /// ([`ENDPOINTS_MAX_ENTRIES`](census_common::ENDPOINTS_MAX_ENTRIES) if `None`).
    pub endpoints_max_entries: Option<u32>,
    /// NODES' entries when it is created
    /// ([`NODES_MAX_ENTRIES`](census_common::NODES_MAX_ENTRIES) if `None`).
    pub nodes_max_entries: Option<u32>,
    /// The least severe of the programs' aya-log events forwarded into `tracing`
    /// (off by default).
    pub datapath_log: DatapathLog,
    /// The node's own addresses (`--node-ip`; Kubernetes gives them to a pod as
    /// `status.hostIPs`): [`Datapath::attach`] refuses a device holding one.
    pub node_addresses: BTreeSet<IpAddr>,
    /// census's bit of `skb->mark` (`--mark-bit`): set on a packet for a Service
    /// address until it is counted.
    pub mark_bit: MarkBit,
}

impl Options {
    /// SERVICE_FLOWS6's size: its own, else the one both families take.
    fn service_flows6_entries(&self) -> Option<u32> {
        self.service_flows6_max_entries
            .or(self.service_flows_max_entries)
    }
}

/// Cumulative run statistics of one program, kept by the kernel while run-time
/// statistics are enabled (see [`enable_run_time_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProgramStats {
    pub run_count: u64,
    pub run_time: Duration,
}

impl ProgramStats {
    /// Mean run time per run between `earlier` and `self`; `None` without runs.
    pub fn mean_since(&self, earlier: &Self) -> Option<Duration> {
        let runs = self.run_count.checked_sub(earlier.run_count)?;
        let time = self.run_time.checked_sub(earlier.run_time)?;
        let runs = u32::try_from(runs).ok().filter(|&runs| runs > 0)?;
        Some(time / runs)
    }
}

/// Makes the kernel account run time and count of every BPF program
/// (`BPF_ENABLE_STATS`) for as long as the returned descriptor is open. It
/// costs two clock reads per program run.
pub fn enable_run_time_stats() -> Result<OwnedFd, Error> {
    aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(|source| Error::EnableStats {
        source: source.io_error,
    })
}

/// Where [`Datapath::test_run`]'s packet is: the `__sk_buff` fields the kernel
/// lets a test run set that the program reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TestContext {
    /// The interface the program runs on (`skb->ifindex`): 0 or 1 is the
    /// loopback; any other must exist in this thread's network namespace.
    pub ifindex: u32,
    /// The interface the packet arrived on (`skb->ingress_ifindex`): any value,
    /// 0 for a packet the node sent itself.
    pub ingress_ifindex: u32,
}

impl TestContext {
    /// Offsets in `struct __sk_buff` (uapi `linux/bpf.h`, stable ABI).
    const INGRESS_IFINDEX: usize = 36;
    const IFINDEX: usize = 40;

    /// The head of a `struct __sk_buff`, zero but for these fields; the kernel
    /// takes a shorter context than the whole struct and zero-fills the rest.
    fn to_sk_buff(self) -> [u8; Self::IFINDEX + 4] {
        let mut ctx = [0; Self::IFINDEX + 4];
        ctx[Self::INGRESS_IFINDEX..Self::INGRESS_IFINDEX + 4]
            .copy_from_slice(&self.ingress_ifindex.to_ne_bytes());
        ctx[Self::IFINDEX..].copy_from_slice(&self.ifindex.to_ne_bytes());
        ctx
    }
}

/// The result of [`Datapath::test_run`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TestRunOutcome {
    pub return_value: i32,
    /// The kernel's mean run time of one repetition.
    pub mean_duration: Duration,
}

/// What loading needs before any pin is read: the object, a kernel and privileges
/// that can load it, bpffs, the attach mode; the pin directory is created.
fn preflight(pins: &Pins, options: &Options) -> Result<(&'static [u8], AttachMode), Error> {
    let bytes = object::bytes()?;
    super::probe::check_kernel()?;
    privileges::check_capabilities()?;
    privileges::ensure_bpffs(pins.dir())?;
    let mode = options.attach_mode.resolve()?;
    pins.create()?;
    Ok((bytes, mode))
}

/// The object loaded with its maps pinned at `map_pins` and sized, its globals set,
/// and every program verified by the kernel.
fn load_object(
    bytes: &[u8],
    map_pins: &[(&'static str, PathBuf)],
    options: &Options,
) -> Result<Ebpf, Error> {
    let mut loader = EbpfLoader::new();
    configure(&mut loader, map_pins, options);
    // aya-log-ebpf's default is every level on: always say which.
    let log_level = options.datapath_log.aya_level();
    loader.override_global(aya_log::LEVEL, &log_level, true);
    let mark_bit = options.mark_bit.get();
    loader.override_global(MARK_BIT_GLOBAL, &mark_bit, true);
    let mut ebpf = loader.load(bytes).map_err(Error::Load)?;
    for direction in Direction::BOTH {
        load_program(&mut ebpf, direction.program())?;
    }
    load_program(&mut ebpf, PROGRAM_UPLINK)?;
    for hook in SocketHook::BOTH {
        load_socket_program(&mut ebpf, hook)?;
    }
    Ok(ebpf)
}

/// STATS and FLOWS; taken over from an older `layout`, the flow pairs present
/// count as inserted.
fn take_flows(ebpf: &mut Ebpf, pins: &Pins, layout: Layout) -> Result<(StatsMap, FlowsMap), Error> {
    let mut stats: StatsMap = take_map(ebpf, STATS_MAP)?;
    let flows: FlowsMap = take_map(ebpf, FLOWS_MAP)?;
    if let Layout::Older(from) = layout {
        // Pairs inserted before STATS existed count as inserted, so evictions
        // (inserts less pairs present) stay exact.
        let present = datapath_maps::count_flows(&flows)?;
        datapath_maps::seed_flow_inserts(&mut stats, present)?;
        tracing::info!(
            pin_dir = %pins.dir().display(),
            from,
            to = census_common::LAYOUT_VERSION,
            flow_pairs = present,
            "took over the maps of an older layout, entries and counters kept"
        );
    }
    Ok((stats, flows))
}

/// The size `map` was created with.
fn max_entries(map: &'static str, data: &MapData) -> Result<u32, Error> {
    data.info()
        .map(|info| info.max_entries())
        .map_err(|source| Error::Map { map, source })
}

/// The pins brought to this layout: a `migration`'s ENDPOINTS entries copied into
/// `endpoints`, an older layout's SERVICE_FLOWS copied into `service_flows`, the
/// layout stamped in `meta`, then what the copies read removed.
fn bring_to_layout(
    pins: &Pins,
    (layout, migration): (Layout, Option<migrate::Migration>),
    (endpoints, endpoints_max_entries): (&mut EndpointsMap, u32),
    service_flows: &mut SplitMaps,
    meta: &mut Array<MapData, u32>,
) -> Result<(), Error> {
    if let Some(migration) = &migration {
        let copied = migration.copy_into(endpoints, endpoints_max_entries)?;
        tracing::info!(
            pin_dir = %pins.dir().display(),
            from = migration.from,
            entries = copied,
            "copied ENDPOINTS into a map of this layout"
        );
    }
    // Only before this layout is stamped: after, the new maps count on, and the
    // old map is a leftover to remove, not to copy again.
    if let Layout::Older(from) = layout {
        let copied = service_flows::copy_layout7(pins, service_flows)?;
        if copied > 0 {
            tracing::info!(
                pin_dir = %pins.dir().display(),
                from,
                entries = copied,
                "copied SERVICE_FLOWS into SERVICE_FLOWS4 and SERVICE_FLOWS6"
            );
        }
    }
    pins::stamp_layout(meta)?;
    if let Some(migration) = migration {
        migration.finish()?;
    }
    service_flows::remove_layout7(pins)
}

/// CLIENTS_EPOCH, mapped for the agent's writes.
fn clients_epoch(ebpf: &mut Ebpf) -> Result<sys::MappedCounter, Error> {
    let map = ebpf
        .map(CLIENTS_EPOCH_MAP)
        .ok_or(Error::MissingFromObject {
            kind: "map",
            name: CLIENTS_EPOCH_MAP,
        })?;
    let Map::Array(data) = map else {
        return Err(Error::MissingFromObject {
            kind: "array map",
            name: CLIENTS_EPOCH_MAP,
        });
    };
    sys::MappedCounter::new(data.fd().as_fd()).map_err(|source| Error::MapMemory {
        map: CLIENTS_EPOCH_MAP,
        source,
    })
}

fn load_socket_program(ebpf: &mut Ebpf, hook: SocketHook) -> Result<(), Error> {
    socket_program(ebpf, hook)?
        .load()
        .map_err(|source| rejected(hook.program(), source))
}

/// The loader's maps: where each is pinned, and the sizes asked for.
fn configure<'a>(
    loader: &mut EbpfLoader<'a>,
    map_pins: &'a [(&'static str, PathBuf)],
    options: &Options,
) {
    for (name, path) in map_pins {
        loader.map_pin_path(name, path.as_path());
    }
    if let Some(entries) = options.flows_max_entries {
        loader.map_max_entries(FLOWS_MAP, entries);
    }
    if let Some(entries) = options.service_flows_max_entries {
        loader.map_max_entries(SERVICE_FLOWS4_MAP, entries);
    }
    if let Some(entries) = options.service_flows6_entries() {
        loader.map_max_entries(SERVICE_FLOWS6_MAP, entries);
    }
    loader.map_max_entries(
        ENDPOINTS_MAP,
        options
            .endpoints_max_entries
            .unwrap_or(ENDPOINTS_MAX_ENTRIES),
    );
    loader.map_max_entries(
        NODES_MAP,
        options.nodes_max_entries.unwrap_or(NODES_MAX_ENTRIES),
    );
}

/// Every pinned map opened again from its pin, for inspection; a pin whose size
/// differs from the one asked for is warned about (the pin's is kept).
fn reopen_pins(
    map_pins: &[(&'static str, PathBuf)],
    options: &Options,
) -> Result<Vec<(&'static str, MapData)>, Error> {
    let mut pinned = Vec::new();
    for (name, path) in map_pins {
        let data = MapData::from_pin(path).map_err(|source| Error::Map { map: name, source })?;
        pinned.push((*name, data));
    }
    pins::warn_size(&pinned, FLOWS_MAP, options.flows_max_entries);
    pins::warn_size(
        &pinned,
        SERVICE_FLOWS4_MAP,
        options.service_flows_max_entries,
    );
    pins::warn_size(
        &pinned,
        SERVICE_FLOWS6_MAP,
        options.service_flows6_entries(),
    );
    pins::warn_size(&pinned, ENDPOINTS_MAP, options.endpoints_max_entries);
    pins::warn_size(&pinned, NODES_MAP, options.nodes_max_entries);
    Ok(pinned)
}

fn load_program(ebpf: &mut Ebpf, name: &'static str) -> Result<(), Error> {
    let classifier: &mut SchedClassifier = ebpf
        .program_mut(name)
        .ok_or(Error::MissingFromObject {
            kind: "program",
            name,
        })?
        .try_into()
        .map_err(|source| Error::Program {
            program: name,
            source,
        })?;
    classifier.load().map_err(|source| rejected(name, source))
}

/// The error of loading `program`: the verifier's log when the kernel refused it.
fn rejected(program: &'static str, source: ProgramError) -> Error {
    match source {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => Error::ProgramRejected {
            program,
            source: io_error,
            verifier_log: verifier_log.to_string(),
        },
        source => Error::Program { program, source },
    }
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, Error>
where
    T: TryFrom<Map, Error = aya::maps::MapError>,
{
    let map = ebpf
        .take_map(name)
        .ok_or(Error::MissingFromObject { kind: "map", name })?;
    T::try_from(map).map_err(|source| Error::Map { map: name, source })
}
