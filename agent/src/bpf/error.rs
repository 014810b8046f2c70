//! The one error type of the BPF layer.

use std::{fmt, io, net::IpAddr, path::PathBuf};

use super::{Direction, maps::MapShape};

/// Everything that can go wrong between the agent and the kernel's BPF side.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the eBPF object is not built: run `cargo xtask build-ebpf`, then rebuild the agent")]
    ObjectNotBuilt,

    #[error("cannot read the capabilities of this process from {path}")]
    ReadCapabilities {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(
        "missing capabilities: {missing}; loading census's datapath needs CAP_BPF, \
         CAP_NET_ADMIN and CAP_PERFMON (run as root, or grant them to the agent)"
    )]
    MissingCapabilities { missing: CapabilityList },

    #[error(
        "{path} is not on a BPF file system (bpffs): bpffs is the host's to mount (`mount -t \
         bpf bpf /sys/fs/bpf` on the node; the DaemonSet mounts the host's /sys/fs/bpf into \
         the pod), so that pins outlive the agent's container"
    )]
    NotBpffs { path: PathBuf },

    #[error("mounting a BPF file system (bpffs) on {path} failed")]
    MountBpffs {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },

    #[error(
        "the pins in {pin_dir} are in use by another census agent ({holder}): two agents \
         on one node's pins undo each other's work; stop the other one (when moving the \
         agent to another namespace, delete the old DaemonSet)"
    )]
    PinDirLocked {
        pin_dir: PathBuf,
        holder: super::LockHolder,
    },

    #[error("{operation} {path} failed")]
    Io {
        operation: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(
        "the maps pinned in {pin_dir} have layout version {found}, this agent reads layout \
         {expected}: refusing to use them; remove them with `census-agent uninstall` (their \
         counters go with them), or run an agent of layout {found}"
    )]
    LayoutMismatch {
        pin_dir: PathBuf,
        found: u32,
        expected: u32,
    },

    #[error(
        "{path} is not census's layout-version map (expected {expected}, found {found}): \
         refusing to use the maps pinned beside it"
    )]
    UnrecognizedMeta {
        path: PathBuf,
        expected: MapShape,
        found: MapShape,
    },

    #[error(
        "maps are pinned in {pin_dir} but their layout version map {meta} is missing: \
         refusing to guess their layout; remove them with `census-agent uninstall`"
    )]
    UnversionedPins {
        pin_dir: PathBuf,
        meta: &'static str,
    },

    #[error(
        "the map pinned at {path} does not have layout {layout}'s shape (expected {expected}, \
         found {found}): refusing to use it"
    )]
    PinnedMapMismatch {
        path: PathBuf,
        layout: u32,
        expected: MapShape,
        found: MapShape,
    },

    #[error("loading the eBPF object failed")]
    Load(#[source] aya::EbpfError),

    #[error("the eBPF object has no {kind} named {name}")]
    MissingFromObject {
        kind: &'static str,
        name: &'static str,
    },

    #[error("the kernel refused program {program}: {source}\nverifier log:\n{verifier_log}")]
    ProgramRejected {
        program: &'static str,
        #[source]
        source: io::Error,
        verifier_log: String,
    },

    #[error("program {program}")]
    Program {
        program: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },

    #[error("map {map}")]
    Map {
        map: &'static str,
        #[source]
        source: aya::maps::MapError,
    },

    #[error("invalid interface name {name:?}: {reason}")]
    InvalidInterfaceName { name: String, reason: &'static str },

    #[error("interface {name} does not exist in this network namespace")]
    InterfaceNotFound {
        name: String,
        #[source]
        source: nix::Error,
    },

    #[error("attaching census to {interface} ({direction}) failed")]
    Attach {
        interface: String,
        direction: Direction,
        #[source]
        source: aya::programs::ProgramError,
    },

    #[error(
        "the object pinned at {path} is not a link census pins (link type {link_type}; census \
         pins TCX and cgroup links)"
    )]
    NotCensusLink { path: PathBuf, link_type: u32 },

    #[error("pinning the link of {interface} ({direction}) at {path} failed")]
    PinLink {
        interface: String,
        direction: Direction,
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },

    #[error("using the link of {interface} ({direction}) pinned at {path} failed")]
    LinkHandle {
        interface: String,
        direction: Direction,
        path: PathBuf,
        #[source]
        source: aya::programs::links::LinkError,
    },

    #[error("{operation} of the link pinned at {path} failed")]
    Link {
        operation: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("invalid endpoint {ip}: {reason}")]
    InvalidEndpoint { ip: IpAddr, reason: &'static str },

    #[error("invalid INTERFACES entry for interface {ifindex}: {reason}")]
    InvalidInterface { ifindex: u32, reason: &'static str },

    #[error("invalid NODES entry for node {index}: {reason}")]
    InvalidNode { index: u16, reason: &'static str },

    #[error(
        "{map} is full ({max_entries} entries): the entry of {key} was not written; \
         raise `census-agent --{flag}`"
    )]
    MapFull {
        map: &'static str,
        max_entries: u32,
        /// The entry not written (an address, a node index).
        key: String,
        /// The `census-agent` flag that sizes the map.
        flag: &'static str,
    },

    #[error(
        "SERVICES is full ({max_entries} entries): Service range {range} was not written; \
         packets to it are counted as to `world` where they leave their endpoint"
    )]
    ServicesFull {
        max_entries: u32,
        range: ipnet::IpNet,
    },

    #[error(
        "migrating {map} in {pin_dir} from layout {from} failed ({step}); the next start \
         of the agent finishes or redoes the migration"
    )]
    Migration {
        map: &'static str,
        pin_dir: PathBuf,
        from: u32,
        step: &'static str,
        #[source]
        source: Box<Error>,
    },

    #[error(
        "interface {ifindex} cannot have an INTERFACES entry: its slot {slot} holds interface \
         {holder}'s"
    )]
    InterfaceSlotTaken {
        ifindex: u32,
        slot: u32,
        holder: u32,
    },

    #[error("mapping map {map} into memory failed")]
    MapMemory {
        map: &'static str,
        #[source]
        source: io::Error,
    },

    #[error("enabling the kernel's BPF run-time statistics failed")]
    EnableStats {
        #[source]
        source: io::Error,
    },

    #[error(
        "kernel {release} is too old: census needs Linux 5.15 or later (TC filters; TCX \
         links from 6.6 are used where the kernel has them)"
    )]
    KernelTooOld { release: String },

    #[error("cannot tell the kernel's version from its release {release:?}")]
    UnknownKernel { release: String },

    #[error(
        "--attach-mode tcx: this kernel has no TCX links (Linux 6.6+); use --attach-mode \
         auto or tc"
    )]
    TcxUnavailable {
        #[source]
        source: io::Error,
    },

    #[error("{operation} on {interface} failed")]
    Netlink {
        operation: &'static str,
        interface: String,
        #[source]
        source: crate::netlink::Error,
    },

    #[error(
        "a TC filter with priority 1 is on {interface} ({direction}): census's filter \
         cannot run before it, so it does not attach there"
    )]
    NoRoomInFront {
        interface: String,
        direction: Direction,
    },

    #[error(
        "census attaches only to an endpoint's own veth or netkit device with an Ethernet \
         link type; {interface} is {}", describe_link(kind.as_deref(), *ethernet)
    )]
    UnsupportedInterface {
        interface: String,
        kind: Option<String>,
        ethernet: bool,
    },

    #[error(
        "{path} is not a cgroup v2 hierarchy: census counts the node's own sockets at the \
         root of its cgroup v2 hierarchy (`--cgroup-root`)"
    )]
    NotCgroup2 { path: PathBuf },

    #[error(
        "no cgroup v2 hierarchy is mounted (looked in {looked_in}): give its root with \
         `--cgroup-root`"
    )]
    NoCgroup2 { looked_in: String },

    #[error("attaching census's socket program to cgroup {cgroup} failed")]
    AttachCgroup {
        cgroup: PathBuf,
        #[source]
        source: aya::programs::ProgramError,
    },

    #[error("the socket program's attachment (to be pinned at {path}) is not a bpf link")]
    CgroupLinkHandle {
        path: PathBuf,
        #[source]
        source: aya::programs::links::LinkError,
    },

    #[error("pinning the link of census's socket program at {path} failed")]
    PinCgroupLink {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },

    #[error(
        "census counts Service requests leaving the node only on a device with an Ethernet \
         link type (its program reads an Ethernet header); uplink {interface} is {}",
        describe_link(kind.as_deref(), *ethernet)
    )]
    UnsupportedUplink {
        interface: String,
        kind: Option<String>,
        ethernet: bool,
    },

    #[error(
        "{interface} is an endpoint's interface (census counts its traffic there): it is \
         never an uplink"
    )]
    EndpointInterfaceAsUplink { interface: String },

    #[error(
        "{interface} is one of the node's own devices ({role}): census attaches only to an \
         endpoint's own device, where every packet is the endpoint's"
    )]
    NodeInterface { interface: String, role: NodeRole },

    #[error("pinning map {map} again at {path} failed")]
    Repin {
        map: &'static str,
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },

    #[error("reading the datapath's log (aya-log) failed")]
    DatapathLog {
        #[source]
        source: aya_log::Error,
    },

    #[error("starting the thread that forwards the datapath's log failed")]
    DatapathLogThread {
        #[source]
        source: io::Error,
    },

    #[error("running program {program} with BPF_PROG_TEST_RUN failed")]
    TestRun {
        program: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
}

fn describe_link(kind: Option<&str>, ethernet: bool) -> crate::netlink::link::Described<'_> {
    crate::netlink::link::Described { kind, ethernet }
}

/// Names of missing capabilities, for [`Error::MissingCapabilities`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapabilityList(pub Vec<&'static str>);

impl fmt::Display for CapabilityList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(", "))
    }
}

/// Why an interface is the node's, not an endpoint's ([`Error::NodeInterface`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRole {
    /// A default route leaves by it: the node's uplink.
    DefaultRoute,
    /// It holds this address of the node's (`--node-ip`).
    Address(IpAddr),
}

impl fmt::Display for NodeRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::DefaultRoute => f.write_str("a default route leaves by it: the node's uplink"),
            Self::Address(ip) => write!(f, "it holds the node's address {ip}"),
        }
    }
}
