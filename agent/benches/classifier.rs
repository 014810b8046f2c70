//! Cost of census's classifier per packet, measured in the kernel with
//! `BPF_PROG_TEST_RUN`: the mean the kernel reports over `repeat` runs, median of
//! `rounds` such means, each shown as a ratio to an empty TC program measured the
//! same way in the same run. A row's programs (census's, its floor, its
//! references) are measured one round of each in turn, and a ratio is the median
//! of the rounds' ratios: on a shared machine memory can slow for seconds at a
//! time, and programs measured one after the other would each see another
//! machine.
//!
//! A test run does not attach anything (`BPF_PROG_TEST_RUN` runs the loaded
//! program on a packet of its own), so the figures are the same whether the agent
//! attaches with TCX or with TC filters: both call the same program the same way
//! (the hook's own cost, equal for census and any other program, is not in them).
//!
//! One packet run many times keeps its addresses and their map entries in the
//! CPU's caches, which hides the size of ENDPOINTS. So every run here has another
//! peer: a cycler program (`agent-ebpf/src/bench.rs`) rewrites the peer's address
//! with the next of `--peers` addresses (at least 10,000 with ENDPOINTS at 512k
//! entries) and tail-calls the classifier. The floor is the same cycler
//! tail-calling an empty program: `x floor` is measured / floor, like for like;
//! the empty program alone is shown too. A second reference is the same cycler
//! tail-calling one lookup of the peer in a map made and filled as ENDPOINTS is
//! (`x lookup`): at 512k entries and 10k peers that lookup's memory traffic, not
//! census's code, is most of the cost, and no classifier that names the peer by
//! its address avoids it.
//!
//! Peers are local (flagged LOCAL, as the endpoints of this node) or remote
//! (flagged REMOTE), IPv4 and IPv6, with identities from a pool of 4,096 (so
//! FLOWS holds thousands of pairs, as on a busy node). ENDPOINTS holds 110 entries
//! (a node's worth, every one of them cycled through) or 524,288 (the cluster-wide
//! default). Each table is measured with the datapath's log off and on (debug:
//! every event sent, rate-limited); the row whose interface has no INTERFACES
//! entry while its endpoint is LOCAL raises an event on every packet.
//!
//! The paths of the rule for Services (docs/design.md, "Counting traffic once")
//! have rows too: a packet leaving a pod for a Service address (ENDPOINTS miss,
//! SERVICES hit: marked, not counted), one for an address in neither map (counted
//! as world), and a marked packet where it is counted: entering a pod (E) and
//! leaving by an uplink (U), each clearing the mark. SERVICES holds a ClusterIP
//! range per family (10.96.0.0/12, a /108) and 64 LoadBalancer addresses each; the
//! Service and world peers are cycled through as the others are. A test run keeps
//! its packet between runs, mark included: the first run of a marked packet clears
//! the mark, and the other runs would measure the unmarked path. So the marked rows
//! (and their floor and lookup) are measured one run per test run (`repeat` 1,
//! `--repeat` / 100 test runs a round), each run with the mark set from the
//! context; the kernel's timer around a single run adds its own cost to every
//! figure of those rows alike, floor included. Every row of these paths checks
//! STATS: each run marked, counted a marked packet, or marked nothing, as its path
//! says.
//!
//! A peer reference sits beside the hash lookup: the same cycler tail-calling one
//! lookup of the peer in `BENCH_IPCACHE`, the same addresses in a
//! longest-prefix-match trie (each a /32 or /128), the structure Cilium's ipcache
//! uses (`lpm`, `x lpm`; measured with the log off).
//!
//! The root cgroup's programs (`census_sockets`, `census_sockets_ingress`: the
//! node's own sockets and every pod's, and SERVICE_FLOWS4/6) have rows of their own
//! after the tables: an unmarked packet a socket receives (nearly every packet a
//! node's sockets receive) and one it sends, a Service request and a Service
//! reply, each as a ratio to an empty `cgroup_skb` program measured in the same
//! run (no cycler: a cgroup program cannot tail-call a TC one, so each row runs on
//! one packet, its map entries in the CPU's caches). Each checks SERVICE_FLOWS4/6:
//! the Service rows count every run, the others none.
//!
//! Needs root: run it with `cargo xtask bench-classifier`. Without root (as in
//! `cargo bench --workspace`) it says so and exits successfully.
//!
//! Arguments (after `--`): `--repeat N` runs per measurement (default 1,000,000),
//! `--rounds N` measurements per scenario, the median is reported (default 5),
//! `--peers N` peers cycled through at 512k entries (default 16,384). Run without
//! `--bench` (by `cargo test --benches`), it only checks that every scenario runs,
//! with a few repetitions.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    process::ExitCode,
    time::Duration,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, HashMap, MapData, PerCpuArray, ProgramArray,
        lpm_trie::{Key, LpmTrie},
    },
    programs::{CgroupSkb, ProgramFd, SchedClassifier, TestRun as _, TestRunOptions},
};
use census_common::{
    ENDPOINTS_MAP, EndpointKey, EndpointValue, FlowValue, INTERFACES_MAP, InterfaceValue,
    MARK_BIT_DEFAULT, PROGRAM_EGRESS, PROGRAM_INGRESS, PROGRAM_SOCKETS, PROGRAM_SOCKETS_INGRESS,
    PROGRAM_UPLINK, SERVICE_FLOWS4_MAP, SERVICE_FLOWS6_MAP, SERVICES_MAP, STATS_MAP,
    ServiceFlowKey4, ServiceFlowKey6, ServiceKey,
    filter::{ADDRESS_FILTER_MAP, AddressFilter},
    flags, interface_slot, service, stats,
};
use census_netlab::packet;

/// The interface a test run's packet is on (`skb->ifindex`): the loopback.
const LOOPBACK: u32 = 1;
/// Pod A's host-side interface, as the interface a packet arrived on.
const POD_A_INTERFACE: u32 = 50;
/// An interface without an entry (the node's uplink, say).
const UPLINK: u32 = 2;
/// The endpoints behind the loopback in the scenarios.
const POD_A: u32 = 1000;
const POD_B: u32 = 1001;
/// ENDPOINTS' size for the cluster-wide scenarios, and its entries then.
const CLUSTER_ENTRIES: u32 = 524_288;
/// A node's worth of endpoints.
const NODE_ENTRIES: u32 = 110;
/// Peers' identities come from a pool this large.
const IDENTITY_POOL: u32 = 4_096;
/// ENDPOINTS entries for the memory and write-throughput figures (the cluster of
/// the performance targets: 5,000 nodes of 110 pods), in a map sized to hold them.
const MEMORY_ENTRIES: u32 = 550_000;
const MEMORY_MAX_ENTRIES: u32 = 1 << 20;
/// What census aims for at 512k entries and 10k peers, log off.
const TARGET_RATIO: f64 = 3.0;
/// The bench object's map shaped as ENDPOINTS.
const BENCH_ENDPOINTS: &str = "BENCH_ENDPOINTS";

/// The first address of each peer range (host order, last 32 bits for IPv6).
const V4_LOCAL: u32 = u32::from_be_bytes([10, 0, 0, 0]);
const V4_REMOTE: u32 = u32::from_be_bytes([10, 128, 0, 0]);
const V6_LOCAL: u32 = 0x0100_0000;
const V6_REMOTE: u32 = 0x8000_0000;
const V6_PREFIX: [u16; 6] = [0x2001, 0xdb8, 0, 0, 0, 0];
/// Service peers: in the ClusterIP ranges, never in ENDPOINTS (kubeadm's default
/// 10.96.0.0/12; for IPv6 a /108, the longest prefix Kubernetes allows).
const V4_SERVICE: u32 = u32::from_be_bytes([10, 96, 0, 0]);
const V4_SERVICE_BITS: u8 = 12;
const V6_SERVICE: u32 = 0x4000_0000;
const V6_SERVICE_BITS: u8 = 108;
/// World peers: in neither ENDPOINTS nor SERVICES.
const V4_WORLD: u32 = u32::from_be_bytes([10, 192, 0, 0]);
const V6_WORLD: u32 = 0xc000_0000;
/// LoadBalancer addresses in SERVICES besides the ranges, per family (from
/// 203.0.113.0 and 2001:db8:1::), so that the trie is not one node.
const LOAD_BALANCERS: u32 = 64;
/// What census aims for on the root cgroup: an ordinary socket packet, and a
/// Service request or reply, as a ratio to an empty `cgroup_skb` program.
const SOCKET_TARGET_RATIO: f64 = 1.5;
const SERVICE_TARGET_RATIO: f64 = 3.0;
/// A marked row's test runs per round are `--repeat` divided by this.
const SINGLE_RUN_DIVISOR: u32 = 100;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Family {
    V4,
    V6,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Peer {
    Local,
    Remote,
    /// An address in a SERVICES range, in no ENDPOINTS entry.
    Service,
    /// An address in neither map.
    World,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Hook {
    Ingress,
    Egress,
    Uplink,
}

/// What STATS must show after a scenario's runs: the path taken.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    /// Not checked (the rows from before the Service paths).
    Any,
    /// Every run marked the packet (a Service address at ingress).
    Marked,
    /// Every run counted a marked packet and cleared the mark.
    CountedMarked,
    /// No run marked the packet.
    NotMarked,
}

struct Scenario {
    name: String,
    hook: Hook,
    family: Family,
    peer: Peer,
    /// The context's `ingress_ifindex`.
    from: u32,
    /// Whether the loopback has its INTERFACES entry.
    interface_entry: bool,
    /// Whether the packet carries census's mark (set from the context, one run
    /// per test run: the program clears it).
    marked: bool,
    path: Path,
    /// Judged against the target.
    judged: bool,
}

fn scenarios() -> Vec<Scenario> {
    let mut all = Vec::new();
    for family in [Family::V4, Family::V6] {
        all.extend(pair_scenarios(family));
        all.extend(path_scenarios(family));
    }
    all.push(Scenario {
        name: "IPv4 ingress, no INTERFACES entry, LOCAL source (an event per packet)".to_owned(),
        hook: Hook::Ingress,
        family: Family::V4,
        peer: Peer::Local,
        from: 0,
        interface_entry: false,
        marked: false,
        path: Path::Any,
        judged: false,
    });
    all
}

/// The rows judged against the target: a pair counted, or skipped where another
/// hook counts it.
fn pair_scenarios(family: Family) -> Vec<Scenario> {
    let v = if family == Family::V4 { "IPv4" } else { "IPv6" };
    let mut all = Vec::new();
    for (hook, peer, from, what) in [
        (
            Hook::Ingress,
            Peer::Local,
            0,
            "ingress, to a local peer (counted)",
        ),
        (
            Hook::Ingress,
            Peer::Remote,
            0,
            "ingress, to a remote peer (counted)",
        ),
        (
            Hook::Egress,
            Peer::Remote,
            UPLINK,
            "egress, from a remote pod (skipped: counted where sent)",
        ),
        (
            Hook::Egress,
            Peer::Local,
            POD_A_INTERFACE,
            "egress, from a local peer (skipped: counted leaving it)",
        ),
    ] {
        all.push(Scenario {
            name: format!("{v} {what}"),
            hook,
            family,
            peer,
            from,
            interface_entry: true,
            marked: false,
            path: Path::Any,
            judged: true,
        });
    }
    all
}

/// The rows of the other paths: Service addresses, the world, the mark.
fn path_scenarios(family: Family) -> Vec<Scenario> {
    let v = if family == Family::V4 { "IPv4" } else { "IPv6" };
    let mut all = Vec::new();
    for (hook, peer, from, marked, path, what) in [
        (
            Hook::Ingress,
            Peer::Service,
            0,
            false,
            Path::Marked,
            "ingress, to a Service address (marked, not counted)",
        ),
        (
            Hook::Ingress,
            Peer::World,
            0,
            false,
            Path::NotMarked,
            "ingress, to the world (counted)",
        ),
        (
            Hook::Egress,
            Peer::Local,
            POD_A_INTERFACE,
            true,
            Path::CountedMarked,
            "egress, marked, from a local pod (counted) [1 run/test run]",
        ),
        (
            Hook::Uplink,
            Peer::Remote,
            POD_A_INTERFACE,
            true,
            Path::CountedMarked,
            "uplink, marked, to a remote pod (counted) [1 run/test run]",
        ),
        (
            Hook::Uplink,
            Peer::Remote,
            POD_A_INTERFACE,
            false,
            Path::NotMarked,
            "uplink, not marked (skipped: counted leaving its pod)",
        ),
    ] {
        all.push(Scenario {
            name: format!("{v} {what}"),
            hook,
            family,
            peer,
            from,
            interface_entry: true,
            marked,
            path,
            // One run per test run: the timer's own cost is in the floor too,
            // which makes the ratio smaller; not judged against the target.
            judged: !marked,
        });
    }
    all
}

#[expect(
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a benchmark's report"
)]
fn main() -> ExitCode {
    if !nix::unistd::geteuid().is_root() {
        println!("classifier bench skipped: it needs root (run `cargo xtask bench-classifier`)");
        return ExitCode::SUCCESS;
    }
    let objects = Objects::locate();
    if !objects.census.is_file() || !objects.bench.is_file() {
        println!(
            "classifier bench skipped: the eBPF objects are not built (`cargo xtask build-ebpf`)"
        );
        return ExitCode::SUCCESS;
    }
    match run(&objects) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("classifier bench failed: {error}");
            ExitCode::FAILURE
        }
    }
}

type Fallible<T> = Result<T, Box<dyn std::error::Error>>;

struct Objects {
    census: PathBuf,
    bench: PathBuf,
}

impl Objects {
    /// The objects `cargo xtask build-ebpf` builds (`CENSUS_EBPF_OBJECT` names
    /// another census object, as for the agent's build).
    fn locate() -> Self {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../agent-ebpf/target/bpfel-unknown-none/release");
        let census = std::env::var_os("CENSUS_EBPF_OBJECT")
            .map_or_else(|| dir.join("census-ebpf"), PathBuf::from);
        Self {
            census,
            bench: dir.join("census-ebpf-bench"),
        }
    }
}

struct Options {
    repeat: u32,
    rounds: usize,
    peers: u32,
    /// ENDPOINTS entries written from userspace for the memory and write figures.
    memory_entries: u32,
    /// Only the root cgroup's rows (`--sockets-only`).
    sockets_only: bool,
    /// The order the cyclers visit the peers in (`--order`).
    order: Order,
}

/// The order the cyclers visit the peers in: each once per cycle either way.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    /// By address: each run's peer is the last one's next address, so a lookup
    /// in a trie walks nearly the same nodes as the one before it.
    Address,
    /// A stride of about 0.618 of the peers (prime to their count): each run's
    /// peer is far from the last one's, as the peers of real traffic are.
    Scattered,
}

impl Order {
    /// The cyclers' stride through `peers` peers: prime to `peers`, so that
    /// every peer is visited once per cycle.
    fn stride(self, peers: u32) -> u32 {
        let peers = peers.max(1);
        match self {
            Self::Address => 1,
            Self::Scattered => {
                #[expect(clippy::cast_possible_truncation, reason = "below `peers`")]
                let mut stride = (u64::from(peers) * 618 / 1000) as u32 | 1;
                while gcd(stride, peers) != 1 {
                    stride += 2;
                }
                stride % peers
            }
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Address => "by address",
            Self::Scattered => "scattered",
        }
    }
}

fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// census's programs and maps, loaded without pins, ENDPOINTS sized for the
/// cluster, with the datapath log at `log_level` (aya-log's `AYA_LOG_LEVEL`).
struct Census {
    ebpf: Ebpf,
}

impl Census {
    fn load(object: &[u8], log_level: u8) -> Fallible<Self> {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(ENDPOINTS_MAP, CLUSTER_ENTRIES)
            .override_global("AYA_LOG_LEVEL", &log_level, true)
            .load(object)?;
        for name in [PROGRAM_INGRESS, PROGRAM_EGRESS, PROGRAM_UPLINK] {
            let program: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or_else(|| format!("no program {name}"))?
                .try_into()?;
            program.load()?;
        }
        for name in [PROGRAM_SOCKETS, PROGRAM_SOCKETS_INGRESS] {
            let program: &mut CgroupSkb = ebpf
                .program_mut(name)
                .ok_or_else(|| format!("no program {name}"))?
                .try_into()?;
            program.load()?;
        }
        Ok(Self { ebpf })
    }

    fn socket_program(&self, name: &str) -> Fallible<&CgroupSkb> {
        Ok(self
            .ebpf
            .program(name)
            .ok_or_else(|| format!("no program {name}"))?
            .try_into()?)
    }

    /// The packets of SERVICE_FLOWS4 and SERVICE_FLOWS6, every entry summed over
    /// CPUs.
    fn service_packets(&self) -> Fallible<u64> {
        fn sum<K: aya::Pod>(map: &aya::maps::Map) -> Fallible<u64> {
            let flows: aya::maps::PerCpuHashMap<&MapData, K, FlowValue> =
                aya::maps::PerCpuHashMap::try_from(map)?;
            let mut sum = 0;
            for entry in flows.iter() {
                let (_, values) = entry?;
                sum += values.iter().map(|v| v.packets).sum::<u64>();
            }
            Ok(sum)
        }
        let map = |name| self.ebpf.map(name).ok_or(format!("no {name}"));
        Ok(sum::<ServiceFlowKey4>(map(SERVICE_FLOWS4_MAP)?)?
            + sum::<ServiceFlowKey6>(map(SERVICE_FLOWS6_MAP)?)?)
    }

    fn endpoints(&mut self) -> Fallible<HashMap<&mut MapData, EndpointKey, EndpointValue>> {
        let map = self.ebpf.map_mut(ENDPOINTS_MAP).ok_or("no ENDPOINTS")?;
        Ok(HashMap::try_from(map)?)
    }

    /// SERVICES as the agent writes it: each family's ClusterIP range and
    /// [`LOAD_BALANCERS`] LoadBalancer addresses.
    fn fill_services(&mut self) -> Fallible<()> {
        let map = self.ebpf.map_mut(SERVICES_MAP).ok_or("no SERVICES")?;
        let mut services: LpmTrie<&mut MapData, EndpointKey, u32> = LpmTrie::try_from(map)?;
        let mut keys = Vec::new();
        let mut insert = |ip: IpAddr, bits: u8, kind: u32| {
            let key = ServiceKey::range(EndpointKey::from(ip), bits);
            keys.push(key);
            services.insert(&Key::new(key.prefix_len, key.address), kind, 0)
        };
        insert(
            peer_ip(Family::V4, V4_SERVICE),
            V4_SERVICE_BITS,
            service::CLUSTER_IP_RANGE,
        )?;
        insert(
            peer_ip(Family::V6, V6_SERVICE),
            V6_SERVICE_BITS,
            service::CLUSTER_IP_RANGE,
        )?;
        for i in 0..LOAD_BALANCERS {
            let v4 = u32::from_be_bytes([203, 0, 113, 0]) + i;
            insert(Ipv4Addr::from(v4).into(), 32, service::LOAD_BALANCER_IP)?;
            let v6 = Ipv6Addr::from((0x2001_0db8_0001_u128 << 80) | u128::from(i));
            insert(v6.into(), 128, service::LOAD_BALANCER_IP)?;
        }
        let filter = AddressFilter::build(&AddressFilter::OFF, keys, []);
        let map = self
            .ebpf
            .map_mut(ADDRESS_FILTER_MAP)
            .ok_or("no ADDRESS_FILTER")?;
        let mut array: Array<&mut MapData, AddressFilter> = Array::try_from(map)?;
        array.set(0, filter, 0)?;
        Ok(())
    }

    /// STATS' `index`, summed over CPUs.
    fn stat(&self, index: u32) -> Fallible<u64> {
        let map = self.ebpf.map(STATS_MAP).ok_or("no STATS")?;
        let stats: PerCpuArray<&MapData, u64> = PerCpuArray::try_from(map)?;
        Ok(stats.get(&index, 0)?.iter().sum())
    }

    /// (packets marked, marked packets counted), from STATS.
    fn marks(&self) -> Fallible<(u64, u64)> {
        Ok((
            self.stat(stats::SERVICE_MARKED)?,
            self.stat(stats::MARKED_COUNTED)?,
        ))
    }

    fn set_interface(&mut self, ifindex: u32, identity: Option<u32>) -> Fallible<()> {
        let map = self.ebpf.map_mut(INTERFACES_MAP).ok_or("no INTERFACES")?;
        let mut interfaces: Array<&mut MapData, InterfaceValue> = Array::try_from(map)?;
        let value = match identity {
            Some(identity) => InterfaceValue { ifindex, identity },
            None => InterfaceValue::EMPTY,
        };
        interfaces.set(interface_slot(ifindex), value, 0)?;
        Ok(())
    }

    fn program(&self, hook: Hook) -> Fallible<&SchedClassifier> {
        let name = match hook {
            Hook::Ingress => PROGRAM_INGRESS,
            Hook::Egress => PROGRAM_EGRESS,
            Hook::Uplink => PROGRAM_UPLINK,
        };
        Ok(self
            .ebpf
            .program(name)
            .ok_or_else(|| format!("no program {name}"))?
            .try_into()?)
    }
}

/// The cyclers and the empty program.
struct Bench {
    ebpf: Ebpf,
}

impl Bench {
    fn load(object: &[u8]) -> Fallible<Self> {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(BENCH_ENDPOINTS, CLUSTER_ENTRIES)
            .load(object)?;
        for name in [
            "bench_empty",
            "bench_lookup_src",
            "bench_lookup_dst",
            "bench_lpm_src",
            "bench_lpm_dst",
            "bench_cycle_v4_src",
            "bench_cycle_v4_dst",
            "bench_cycle_v6_src",
            "bench_cycle_v6_dst",
        ] {
            let program: &mut SchedClassifier = ebpf
                .program_mut(name)
                .ok_or_else(|| format!("no program {name}"))?
                .try_into()?;
            program.load()?;
        }
        for name in [
            "bench_cgroup_empty",
            "bench_cgroup_counter",
            "bench_cgroup_counter6",
            "bench_cgroup_service_floor",
            "bench_cgroup_call",
            "bench_cgroup_client",
            "bench_cgroup_slot",
        ] {
            let program: &mut CgroupSkb = ebpf
                .program_mut(name)
                .ok_or_else(|| format!("no program {name}"))?
                .try_into()?;
            program.load()?;
        }
        Ok(Self { ebpf })
    }

    fn cgroup_empty(&self) -> Fallible<&CgroupSkb> {
        self.cgroup("bench_cgroup_empty")
    }

    /// One of the `cgroup_skb` references (`bench_cgroup_*`).
    fn cgroup(&self, name: &str) -> Fallible<&CgroupSkb> {
        Ok(self
            .ebpf
            .program(name)
            .ok_or_else(|| format!("no program {name}"))?
            .try_into()?)
    }

    /// The peer reference: BENCH_ENDPOINTS' addresses in a trie.
    fn ipcache(&mut self) -> Fallible<LpmTrie<&mut MapData, EndpointKey, EndpointValue>> {
        let map = self
            .ebpf
            .map_mut("BENCH_IPCACHE")
            .ok_or("no BENCH_IPCACHE")?;
        Ok(LpmTrie::try_from(map)?)
    }

    /// The LPM program looking up the peer's address in `scenario`'s packets.
    fn lpm(hook: Hook) -> &'static str {
        match hook {
            Hook::Ingress | Hook::Uplink => "bench_lpm_dst",
            Hook::Egress => "bench_lpm_src",
        }
    }

    fn program(&self, name: &str) -> Fallible<&SchedClassifier> {
        Ok(self
            .ebpf
            .program(name)
            .ok_or_else(|| format!("no program {name}"))?
            .try_into()?)
    }

    /// The reference map, made as ENDPOINTS is.
    fn endpoints(&mut self) -> Fallible<HashMap<&mut MapData, EndpointKey, EndpointValue>> {
        let map = self
            .ebpf
            .map_mut(BENCH_ENDPOINTS)
            .ok_or("no BENCH_ENDPOINTS")?;
        Ok(HashMap::try_from(map)?)
    }

    /// The program looking up the peer's address in `scenario`'s packets.
    fn lookup(hook: Hook) -> &'static str {
        match hook {
            Hook::Ingress | Hook::Uplink => "bench_lookup_dst",
            Hook::Egress => "bench_lookup_src",
        }
    }

    /// The cycler of the peer's address in `scenario`'s packets.
    fn cycler(hook: Hook, family: Family) -> &'static str {
        match (hook, family) {
            (Hook::Ingress | Hook::Uplink, Family::V4) => "bench_cycle_v4_dst",
            (Hook::Egress, Family::V4) => "bench_cycle_v4_src",
            (Hook::Ingress | Hook::Uplink, Family::V6) => "bench_cycle_v6_dst",
            (Hook::Egress, Family::V6) => "bench_cycle_v6_src",
        }
    }

    /// Makes the cyclers tail-call `target` and cycle through `peers` words from
    /// `first`, in `order`.
    fn aim(
        &mut self,
        target: &ProgramFd,
        (peers, first): (u32, u32),
        order: Order,
    ) -> Fallible<()> {
        let fd = target;
        {
            let map = self.ebpf.map_mut("BENCH_TARGET").ok_or("no BENCH_TARGET")?;
            let mut targets: ProgramArray<&mut MapData> = ProgramArray::try_from(map)?;
            targets.set(0, fd, 0)?;
        }
        let map = self.ebpf.map_mut("BENCH_CONFIG").ok_or("no BENCH_CONFIG")?;
        let mut config: Array<&mut MapData, u32> = Array::try_from(map)?;
        config.set(0, peers.max(1), 0)?;
        config.set(1, first, 0)?;
        config.set(2, order.stride(peers), 0)?;
        Ok(())
    }
}

fn peer_ip(family: Family, word: u32) -> IpAddr {
    match family {
        Family::V4 => Ipv4Addr::from(word).into(),
        Family::V6 => {
            let [a, b, c, d, e, f] = V6_PREFIX;
            #[expect(clippy::cast_possible_truncation, reason = "the halves of a u32")]
            let (high, low) = ((word >> 16) as u16, word as u16);
            Ipv6Addr::new(a, b, c, d, e, f, high, low).into()
        }
    }
}

fn first_word(family: Family, peer: Peer) -> u32 {
    match (family, peer) {
        (Family::V4, Peer::Local) => V4_LOCAL,
        (Family::V4, Peer::Remote) => V4_REMOTE,
        (Family::V6, Peer::Local) => V6_LOCAL,
        (Family::V6, Peer::Remote) => V6_REMOTE,
        (Family::V4, Peer::Service) => V4_SERVICE,
        (Family::V6, Peer::Service) => V6_SERVICE,
        (Family::V4, Peer::World) => V4_WORLD,
        (Family::V6, Peer::World) => V6_WORLD,
    }
}

/// ENDPOINTS' peers of one kind in one family, for a map of `entries` in all:
/// (first word, count).
fn peers_of(entries: u32, family: Family, peer: Peer) -> (u32, u32) {
    // A quarter of the map per (family, kind), the remainder to the first ones:
    // at 110 entries, 28, 28, 27 and 27. Service and world peers are in no map:
    // as many of them as of local peers, like for like.
    let kind = u32::from(family == Family::V6) * 2 + u32::from(peer == Peer::Remote);
    let count = entries / 4 + u32::from(kind < entries % 4);
    (first_word(family, peer), count)
}

/// Fills the LPM reference with what [`fill`] writes into ENDPOINTS, each
/// address a /32 or /128.
fn fill_ipcache(
    ipcache: &mut LpmTrie<&mut MapData, EndpointKey, EndpointValue>,
    entries: u32,
    already: u32,
) -> Fallible<()> {
    fill_with(entries, already, |key, value| {
        let bits = if key.family == census_common::family::IPV4 {
            32
        } else {
            128
        };
        let key = ServiceKey::range(key, bits);
        ipcache.insert(&Key::new(key.prefix_len, key.address), value, 0)?;
        Ok(())
    })
}

/// Fills `endpoints` (census's ENDPOINTS, or the reference map) with `entries`
/// entries: local and remote peers of both families.
fn fill(
    endpoints: &mut HashMap<&mut MapData, EndpointKey, EndpointValue>,
    entries: u32,
    already: u32,
) -> Fallible<()> {
    fill_with(entries, already, |key, value| {
        endpoints.insert(key, value, 0)?;
        Ok(())
    })
}

/// Gives `write` the entries [`fill`] writes.
fn fill_with(
    entries: u32,
    already: u32,
    mut write: impl FnMut(EndpointKey, EndpointValue) -> Fallible<()>,
) -> Fallible<()> {
    for family in [Family::V4, Family::V6] {
        // Service and world peers are in no ENDPOINTS entry.
        for (peer, flags) in [(Peer::Local, flags::LOCAL), (Peer::Remote, flags::REMOTE)] {
            let (first, count) = peers_of(entries, family, peer);
            let (_, done) = peers_of(already, family, peer);
            for i in done..count {
                let value = EndpointValue {
                    identity: 256 + i % IDENTITY_POOL,
                    flags,
                    // Remote peers are on node 1.
                    node: u16::from(peer == Peer::Remote),
                };
                write(EndpointKey::from(peer_ip(family, first + i)), value)?;
            }
        }
    }
    Ok(())
}

fn context(ingress_ifindex: u32, mark: u32) -> [u8; 44] {
    // `struct __sk_buff` (uapi, stable): mark at 8, ingress_ifindex at 36,
    // ifindex at 40.
    let mut ctx = [0; 44];
    ctx[8..12].copy_from_slice(&mark.to_ne_bytes());
    ctx[36..40].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    ctx[40..].copy_from_slice(&LOOPBACK.to_ne_bytes());
    ctx
}

/// How a measurement runs its program.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Runs {
    /// `repeat` runs in one test run (the kernel's mean).
    Repeated,
    /// One run per test run, `repeat` / [`SINGLE_RUN_DIVISOR`] test runs (their
    /// mean): each run gets the context's mark afresh.
    Single,
}

/// The median of `rounds` means of `repeat` runs of `program`, and how many
/// runs it made in all (warm-up included).
fn measure(
    program: &SchedClassifier,
    frame: &[u8],
    ctx: &[u8],
    options: &Options,
    warm_up: u32,
    runs: Runs,
) -> Fallible<(Duration, u64)> {
    let mut total = warm(program, (frame, ctx), warm_up, runs)?;
    let mut means = Rounds::default();
    for _ in 0..options.rounds {
        let (mean, made) = round(program, (frame, ctx), options, runs)?;
        means.0.push(mean);
        total += made;
    }
    Ok((means.median(), total))
}

/// One test run of `repeat` runs of `program` over `frame`, which must let it
/// go (TC_ACT_UNSPEC): their mean.
fn test_run(
    program: &SchedClassifier,
    (frame, ctx): (&[u8], &[u8]),
    repeat: u32,
) -> Fallible<Duration> {
    let result = program.test_run(TestRunOptions {
        data_in: Some(frame),
        ctx_in: Some(ctx),
        repeat,
        ..TestRunOptions::default()
    })?;
    if result.return_value.cast_signed() != -1 {
        return Err(format!("returned {} instead of TC_ACT_UNSPEC", result.return_value).into());
    }
    Ok(result.duration)
}

/// At least 1,000 runs of `program` (every peer seen once: their FLOWS pairs
/// exist, as in steady state), not measured; how many.
fn warm(
    program: &SchedClassifier,
    packet: (&[u8], &[u8]),
    warm_up: u32,
    runs: Runs,
) -> Fallible<u64> {
    let warm_up = warm_up.max(1_000);
    match runs {
        Runs::Repeated => {
            test_run(program, packet, warm_up)?;
        }
        Runs::Single => {
            for _ in 0..warm_up {
                test_run(program, packet, 1)?;
            }
        }
    }
    Ok(u64::from(warm_up))
}

/// One round: the mean of `repeat` runs of `program` (see [`Runs`]), and how
/// many runs it made.
fn round(
    program: &SchedClassifier,
    packet: (&[u8], &[u8]),
    options: &Options,
    runs: Runs,
) -> Fallible<(Duration, u64)> {
    match runs {
        Runs::Repeated => Ok((
            test_run(program, packet, options.repeat)?,
            u64::from(options.repeat),
        )),
        Runs::Single => {
            let calls = (options.repeat / SINGLE_RUN_DIVISOR).max(1);
            let mut sum = Duration::ZERO;
            for _ in 0..calls {
                sum += test_run(program, packet, 1)?;
            }
            Ok((sum / calls, u64::from(calls)))
        }
    }
}

/// One program's round means, in the order they were taken.
#[derive(Default, Clone)]
struct Rounds(Vec<Duration>);

impl Rounds {
    fn median(&self) -> Duration {
        let mut means = self.0.clone();
        means.sort();
        means.get(means.len() / 2).copied().unwrap_or_default()
    }

    /// The median over rounds of this program's mean over `other`'s in the same
    /// round: the two were measured side by side, so what changed between rounds
    /// (another tenant's memory traffic on a shared machine) weighs on both.
    fn over(&self, other: &Self) -> f64 {
        let mut ratios: Vec<f64> = self
            .0
            .iter()
            .zip(&other.0)
            .map(|(a, b)| a.as_secs_f64() / b.as_secs_f64().max(1e-12))
            .collect();
        ratios.sort_by(f64::total_cmp);
        ratios.get(ratios.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// Checks that `runs` runs of `scenario` took its path: STATS' marks went from
/// `before` to `after`.
fn check_path(
    scenario: &Scenario,
    runs: u64,
    before: (u64, u64),
    after: (u64, u64),
) -> Fallible<()> {
    let (marked, counted) = (after.0 - before.0, after.1 - before.1);
    let took = match scenario.path {
        Path::Any => true,
        Path::Marked => marked == runs && counted == 0,
        Path::CountedMarked => counted == runs && marked == 0,
        Path::NotMarked => marked == 0 && counted == 0,
    };
    if took {
        Ok(())
    } else {
        Err(format!(
            "{}: {runs} runs marked {marked} packets and counted {counted} marked ones: not the \
             path {:?}",
            scenario.name, scenario.path
        )
        .into())
    }
}

struct Row {
    name: String,
    entries: u32,
    peers: u32,
    /// census's classifier, its floor and its references, one round of each in
    /// turn.
    measured: Rounds,
    floor: Rounds,
    /// The cycler and one lookup of the peer in a map like ENDPOINTS.
    lookup: Rounds,
    /// The cycler and one lookup of the peer in an LPM trie of the same
    /// addresses (measured with the log off).
    lpm: Option<Rounds>,
    /// Whether the peer is in ENDPOINTS (and the LPM reference): a local or
    /// remote peer, not a Service or world address.
    in_maps: bool,
    judged: bool,
}

/// The addresses the frames are made of.
struct Addresses {
    pod_a4: IpAddr,
    pod_a6: IpAddr,
    remote_seed: IpAddr,
    remote_seed6: IpAddr,
}

impl Addresses {
    fn new() -> Fallible<Self> {
        Ok(Self {
            pod_a4: "198.18.1.2".parse()?,
            pod_a6: "2001:2:0:1::2".parse()?,
            remote_seed: "198.19.0.1".parse()?,
            // In the peers' prefix: the cyclers rewrite only the address's last word.
            remote_seed6: peer_ip(Family::V6, 1),
        })
    }
}

/// What the judged rows at [`CLUSTER_ENTRIES`] entries, log off, come to: the
/// worst ratio to the floor, and census over one hash lookup and over one LPM
/// lookup of a peer the maps hold, lowest and highest.
#[derive(Default)]
struct Verdicts {
    worst: Option<(f64, f64, String)>,
    lookup_range: Option<(f64, f64)>,
    lpm_range: Option<(f64, f64)>,
}

impl Verdicts {
    fn judge(&mut self, row: &Row) {
        let ratio = row.measured.over(&row.floor);
        let over_lookup = row.measured.over(&row.lookup);
        let over_lpm = row.lpm.as_ref().map(|lpm| row.measured.over(lpm));
        if !row.judged || row.entries != CLUSTER_ENTRIES {
            return;
        }
        if self.worst.as_ref().is_none_or(|(w, _, _)| ratio > *w) {
            self.worst = Some((ratio, over_lookup, row.name.clone()));
        }
        if row.in_maps {
            let over_lpm = over_lpm.unwrap_or(f64::NAN);
            let (lo, hi) = self.lookup_range.unwrap_or((over_lookup, over_lookup));
            self.lookup_range = Some((lo.min(over_lookup), hi.max(over_lookup)));
            let (lo, hi) = self.lpm_range.unwrap_or((over_lpm, over_lpm));
            self.lpm_range = Some((lo.min(over_lpm), hi.max(over_lpm)));
        }
    }

    #[expect(clippy::print_stdout, reason = "a benchmark's report")]
    fn print(&self) {
        if let (Some((lookup_lo, lookup_hi)), Some((lpm_lo, lpm_hi))) =
            (self.lookup_range, self.lpm_range)
        {
            println!();
            println!(
                "peers in the maps at {CLUSTER_ENTRIES} entries, log off, judged rows: census is {lookup_lo:.2}x \
                 to {lookup_hi:.2}x one hash lookup of the peer (target within 1.3x: {}), \
                 {lpm_lo:.2}x to {lpm_hi:.2}x one LPM lookup of the peer in a trie of the same \
                 addresses, as Cilium's ipcache (target at or under 1x: {})",
                if lookup_hi <= 1.3 { "met" } else { "MISSED" },
                if lpm_hi <= 1.0 { "met" } else { "MISSED" },
            );
        }
        if let Some((ratio, over_lookup, name)) = &self.worst {
            let verdict = if *ratio <= TARGET_RATIO {
                "within"
            } else {
                "OVER"
            };
            println!();
            println!(
                "worst case at {CLUSTER_ENTRIES} entries, log off: {ratio:.2}x the floor ({name}): \
                 {verdict} the {TARGET_RATIO}x target; {over_lookup:.2}x one lookup of the peer in a \
                 map like ENDPOINTS"
            );
        }
    }
}

#[expect(clippy::print_stdout, reason = "a benchmark's report")]
fn run(objects: &Objects) -> Fallible<()> {
    let options = parse_args()?;
    let census_object = std::fs::read(&objects.census)?;
    let bench_object = std::fs::read(&objects.bench)?;
    let mut bench = Bench::load(&bench_object)?;
    let addrs = Addresses::new()?;
    if options.sockets_only {
        return socket_rows(&census_object, &mut bench, &options);
    }

    println!(
        "census classifier, BPF_PROG_TEST_RUN ({} runs x {} rounds, median), peers visited {}; no \
         attachment is involved, so TCX and TC modes run the same program at the same cost",
        options.repeat,
        options.rounds,
        options.order.name()
    );
    let empty = bench.program("bench_empty")?;
    let frame4 = packet::udp_frame(addrs.pod_a4, addrs.remote_seed, 64).ok_or("frame")?;
    let (empty_ns, _) = measure(empty, &frame4, &context(0, 0), &options, 0, Runs::Repeated)?;
    println!("empty TC program: {} ns/packet", empty_ns.as_nanos());

    let mut verdicts = Verdicts::default();
    for (log_name, log_level) in [("off", 0u8), ("on (debug)", aya_log::Level::Debug as u8)] {
        let mut census = Census::load(&census_object, log_level)?;
        census.fill_services()?;
        let mut rows = Vec::new();
        let mut filled = 0;
        for entries in [NODE_ENTRIES, CLUSTER_ENTRIES] {
            fill(&mut census.endpoints()?, entries, filled)?;
            if log_level == 0 {
                fill(&mut bench.endpoints()?, entries, filled)?;
                fill_ipcache(&mut bench.ipcache()?, entries, filled)?;
            }
            filled = entries;
            for scenario in scenarios() {
                let at = Setting {
                    entries,
                    log_level,
                    options: &options,
                    addrs: &addrs,
                };
                rows.push(scenario_row(&mut census, &mut bench, &scenario, &at)?);
            }
        }
        print_rows(log_name, &rows);
        if log_level == 0 {
            rows.iter().for_each(|row| verdicts.judge(row));
        }
    }
    socket_rows(&census_object, &mut bench, &options)?;
    endpoints_memory(&census_object, options.memory_entries)?;
    verdicts.print();
    Ok(())
}

/// What a scenario is measured at: ENDPOINTS entries, the datapath log level.
struct Setting<'a> {
    entries: u32,
    log_level: u8,
    options: &'a Options,
    addrs: &'a Addresses,
}

/// The frame a scenario sends: from the local pod or to it, its local side looked
/// up by interface or, without an INTERFACES entry, by address (`first`, a LOCAL
/// endpoint).
fn scenario_frame(scenario: &Scenario, addrs: &Addresses, first: u32) -> Fallible<Vec<u8>> {
    let (src, dst) = match (scenario.hook, scenario.family) {
        (Hook::Ingress | Hook::Uplink, Family::V4) => (addrs.pod_a4, addrs.remote_seed),
        (Hook::Ingress | Hook::Uplink, Family::V6) => (addrs.pod_a6, addrs.remote_seed6),
        (Hook::Egress, Family::V4) => (addrs.remote_seed, addrs.pod_a4),
        (Hook::Egress, Family::V6) => (addrs.remote_seed6, addrs.pod_a6),
    };
    let mut frame = packet::udp_frame(src, dst, 64).ok_or("frame")?;
    if !scenario.interface_entry {
        // The local side is looked up by address: make it a LOCAL endpoint.
        let local_ip = peer_ip(scenario.family, first);
        frame = match scenario.hook {
            Hook::Ingress | Hook::Uplink => packet::udp_frame(local_ip, dst, 64),
            Hook::Egress => packet::udp_frame(src, local_ip, 64),
        }
        .ok_or("frame")?;
    }
    Ok(frame)
}

/// One scenario measured: census's program, the cycler alone (the floor), one
/// hash lookup and (log off) one LPM lookup of the peer, each behind the cycler.
fn scenario_row(
    census: &mut Census,
    bench: &mut Bench,
    scenario: &Scenario,
    at: &Setting<'_>,
) -> Fallible<Row> {
    let options = at.options;
    let (first, available) = peers_of(at.entries, scenario.family, scenario.peer);
    let peers = if at.entries == CLUSTER_ENTRIES {
        options.peers.min(available)
    } else {
        available
    };
    census.set_interface(POD_A_INTERFACE, Some(POD_A))?;
    let local = match scenario.hook {
        Hook::Ingress | Hook::Uplink => POD_A,
        Hook::Egress => POD_B,
    };
    census.set_interface(LOOPBACK, scenario.interface_entry.then_some(local))?;
    let frame = scenario_frame(scenario, at.addrs, first)?;
    let mark = if scenario.marked { MARK_BIT_DEFAULT } else { 0 };
    let runs = if scenario.marked {
        Runs::Single
    } else {
        Runs::Repeated
    };
    let ctx = context(scenario.from, mark);
    let cycler = Bench::cycler(scenario.hook, scenario.family);
    // census's classifier, the floor and the references, one round of each in
    // turn: a shared machine's memory can slow for a while, and each ratio is
    // taken between rounds measured side by side.
    let mut targets = vec![
        census.program(scenario.hook)?.fd()?.try_clone()?,
        bench.program("bench_empty")?.fd()?.try_clone()?,
        bench
            .program(Bench::lookup(scenario.hook))?
            .fd()?
            .try_clone()?,
    ];
    if at.log_level == 0 {
        targets.push(
            bench
                .program(Bench::lpm(scenario.hook))?
                .fd()?
                .try_clone()?,
        );
    }
    let marks = census.marks()?;
    let packet = (frame.as_slice(), ctx.as_slice());
    let mut made = 0;
    for (i, target) in targets.iter().enumerate() {
        bench.aim(target, (peers, first), options.order)?;
        let warm_up = if i == 0 { peers * 2 } else { 0 };
        let warmed = warm(bench.program(cycler)?, packet, warm_up, runs)?;
        if i == 0 {
            made += warmed;
        }
    }
    let mut rounds = vec![Rounds::default(); targets.len()];
    for _ in 0..options.rounds {
        for (i, target) in targets.iter().enumerate() {
            bench.aim(target, (peers, first), options.order)?;
            let (mean, runs) = round(bench.program(cycler)?, packet, options, runs)?;
            rounds[i].0.push(mean);
            if i == 0 {
                made += runs;
            }
        }
    }
    check_path(scenario, made, marks, census.marks()?)?;
    let mut rounds = rounds.into_iter();
    let (Some(measured), Some(floor), Some(lookup)) = (rounds.next(), rounds.next(), rounds.next())
    else {
        return Err("a target without rounds".into());
    };
    let lpm = rounds.next();
    Ok(Row {
        name: scenario.name.clone(),
        entries: at.entries,
        peers,
        measured,
        floor,
        lookup,
        lpm,
        in_maps: matches!(scenario.peer, Peer::Local | Peer::Remote),
        judged: scenario.judged,
    })
}

#[expect(clippy::print_stdout, reason = "a benchmark's report")]
fn print_rows(log_name: &str, rows: &[Row]) {
    println!();
    println!("datapath log {log_name}:");
    println!(
        "  {:<72} {:>8} {:>7} {:>6} {:>6} {:>8} {:>7} {:>9} {:>6} {:>6}",
        "scenario",
        "entries",
        "peers",
        "ns",
        "floor",
        "x floor",
        "lookup",
        "x lookup",
        "lpm",
        "x lpm"
    );
    for row in rows {
        let ratio = row.measured.over(&row.floor);
        let over_lookup = row.measured.over(&row.lookup);
        let over_lpm = row.lpm.as_ref().map(|lpm| row.measured.over(lpm));
        println!(
            "  {:<72} {:>8} {:>7} {:>6} {:>6} {:>7.2}x {:>7} {:>8.2}x {:>6} {:>6}",
            row.name,
            row.entries,
            row.peers,
            row.measured.median().as_nanos(),
            row.floor.median().as_nanos(),
            ratio,
            row.lookup.median().as_nanos(),
            over_lookup,
            row.lpm
                .as_ref()
                .map_or_else(|| "-".to_owned(), |lpm| lpm.median().as_nanos().to_string()),
            over_lpm.map_or_else(|| "-".to_owned(), |x| format!("{x:.2}x")),
        );
    }
}

/// `repeat` runs of a root cgroup program over `frame`, which it must pass; their
/// mean.
fn socket_run(program: &CgroupSkb, frame: &[u8], repeat: u32) -> Fallible<Duration> {
    let result = program.test_run(TestRunOptions {
        data_in: Some(frame),
        ctx_in: Some(&context(0, 0)),
        repeat,
        ..TestRunOptions::default()
    })?;
    if result.return_value != 1 {
        return Err(format!("returned {} instead of 1 (pass)", result.return_value).into());
    }
    Ok(result.duration)
}

/// After 1,000 runs of warm-up each, `rounds` means of `repeat` runs of each of
/// `programs`, one round of each in turn.
fn socket_rounds<const N: usize>(
    programs: [&CgroupSkb; N],
    frame: &[u8],
    options: &Options,
) -> Fallible<[Rounds; N]> {
    for program in programs {
        socket_run(program, frame, 1_000)?;
    }
    let mut rounds: [Rounds; N] = std::array::from_fn(|_| Rounds::default());
    for _ in 0..options.rounds {
        for (program, rounds) in programs.iter().zip(&mut rounds) {
            rounds.0.push(socket_run(program, frame, options.repeat)?);
        }
    }
    Ok(rounds)
}

/// A root cgroup row: the program, the packet's source and destination, whether
/// SERVICE_FLOWS4/6 count it, its target ratio, what it is.
type SocketCase = (&'static str, IpAddr, IpAddr, bool, f64, &'static str);

fn socket_cases(family: Family) -> [SocketCase; 4] {
    let local = peer_ip(family, first_word(family, Peer::Local) + 1);
    let remote = peer_ip(family, first_word(family, Peer::Remote) + 1);
    let service = peer_ip(family, first_word(family, Peer::Service) + 1);
    [
        (
            PROGRAM_SOCKETS_INGRESS,
            remote,
            local,
            false,
            SOCKET_TARGET_RATIO,
            "ingress, an unmarked packet to a pod's socket (skipped)",
        ),
        (
            PROGRAM_SOCKETS,
            local,
            remote,
            false,
            SOCKET_TARGET_RATIO,
            "egress, a pod's socket's packet to a pod (skipped)",
        ),
        (
            PROGRAM_SOCKETS,
            local,
            service,
            true,
            SERVICE_TARGET_RATIO,
            "egress, a Service request (SERVICE_FLOWS4/6)",
        ),
        (
            PROGRAM_SOCKETS_INGRESS,
            service,
            local,
            true,
            SERVICE_TARGET_RATIO,
            "ingress, a Service reply (SERVICE_FLOWS4/6)",
        ),
    ]
}

/// The root cgroup's programs: each row as a ratio to an empty `cgroup_skb`
/// program, on census's maps filled for the cluster, SERVICES as in the tables.
#[expect(clippy::print_stdout, reason = "a benchmark's report")]
fn socket_rows(object: &[u8], bench: &mut Bench, options: &Options) -> Fallible<()> {
    let mut census = Census::load(object, 0)?;
    census.fill_services()?;
    fill(&mut census.endpoints()?, CLUSTER_ENTRIES, 0)?;
    println!();
    println!(
        "root cgroup programs (census_sockets egress, census_sockets_ingress ingress), ENDPOINTS \
         at {CLUSTER_ENTRIES} entries, one packet each, ratio to an empty cgroup_skb program:"
    );
    println!(
        "  {:<64} {:>6} {:>6} {:>8} {:>7}",
        "scenario", "ns", "empty", "x empty", "target"
    );
    let mut missed = Vec::new();
    for family in [Family::V4, Family::V6] {
        let v = if family == Family::V4 { "IPv4" } else { "IPv6" };
        for (program, src, dst, counts, target, what) in socket_cases(family) {
            let frame = packet::udp_frame(src, dst, 64).ok_or("frame")?;
            let before = census.service_packets()?;
            let [measured, empty] = socket_rounds(
                [census.socket_program(program)?, bench.cgroup_empty()?],
                &frame,
                options,
            )?;
            let runs = 1_000 + u64::from(options.repeat) * options.rounds as u64;
            let counted = census.service_packets()? - before;
            let want = if counts { runs } else { 0 };
            if counted != want {
                return Err(format!(
                    "{v} {what}: {runs} runs counted {counted} packets in SERVICE_FLOWS4/6, not {want}"
                )
                .into());
            }
            let ratio = measured.over(&empty);
            let name = format!("{v} {what}");
            if ratio > target {
                missed.push(format!("{name} ({ratio:.2}x)"));
            }
            println!(
                "  {:<64} {:>6} {:>6} {:>7.2}x {:>6.1}x",
                name,
                measured.median().as_nanos(),
                empty.median().as_nanos(),
                ratio,
                target
            );
        }
    }
    service_floor(bench, options)?;
    if missed.is_empty() {
        println!("root cgroup programs: every row within its target");
    } else {
        println!("root cgroup programs: OVER target: {}", missed.join("; "));
    }
    Ok(())
}

/// What a counted Service packet's parts cost, measured on an IPv4 Service
/// request: the update of a counter in a map made as SERVICE_FLOWS4 (a 12-byte
/// key) and as SERVICE_FLOWS6 (24 bytes), alone, and after one ENDPOINTS-like
/// lookup of the client (BENCH_ENDPOINTS at [`CLUSTER_ENTRIES`], holding it: what
/// a socket's first Service packet costs before its client is kept); then what
/// a Service packet's cost is made of: one kernel helper call that does nearly
/// nothing, the read of the client's CLIENTS entry, and a counter reached without
/// a hashed key (a per-CPU array slot). Each beside the empty program.
#[expect(clippy::print_stdout, reason = "a benchmark's report")]
fn service_floor(bench: &mut Bench, options: &Options) -> Fallible<()> {
    fill(&mut bench.endpoints()?, CLUSTER_ENTRIES, 0)?;
    let local = peer_ip(Family::V4, first_word(Family::V4, Peer::Local) + 1);
    let service = peer_ip(Family::V4, first_word(Family::V4, Peer::Service) + 1);
    let frame = packet::udp_frame(local, service, 64).ok_or("frame")?;
    for (program, what) in [
        (
            "bench_cgroup_counter",
            "the counter update alone (SERVICE_FLOWS4, 12-byte key)",
        ),
        (
            "bench_cgroup_counter6",
            "the counter update alone (SERVICE_FLOWS6, 24-byte key)",
        ),
        (
            "bench_cgroup_service_floor",
            "one ENDPOINTS lookup of the client + the SERVICE_FLOWS4 update",
        ),
        (
            "bench_cgroup_call",
            "one kernel helper call that only reads a per-CPU word",
        ),
        ("bench_cgroup_client", "the client's CLIENTS entry read"),
        (
            "bench_cgroup_slot",
            "a counter in a per-CPU array slot (no key hashed)",
        ),
    ] {
        let [measured, empty] = socket_rounds(
            [bench.cgroup(program)?, bench.cgroup_empty()?],
            &frame,
            options,
        )?;
        println!(
            "  {:<64} {:>6} {:>6} {:>7.2}x",
            format!("IPv4 reference: {what}"),
            measured.median().as_nanos(),
            empty.median().as_nanos(),
            measured.over(&empty),
        );
    }
    Ok(())
}

/// The kernel memory of ENDPOINTS (not preallocated) empty and with `entries`
/// remote entries, as the kernel accounts it (`memlock` in the map's fdinfo), and
/// the rate at which userspace writes them (one `bpf(2)` update each, as the agent
/// does).
#[expect(clippy::print_stdout, reason = "a benchmark's report")]
fn endpoints_memory(object: &[u8], entries: u32) -> Fallible<()> {
    let mut ebpf = EbpfLoader::new()
        .map_max_entries(ENDPOINTS_MAP, MEMORY_MAX_ENTRIES)
        .load(object)?;
    let map = ebpf.map_mut(ENDPOINTS_MAP).ok_or("no ENDPOINTS")?;
    let mut endpoints: HashMap<&mut MapData, EndpointKey, EndpointValue> = HashMap::try_from(map)?;
    let fd = {
        use aya::maps::IterableMap as _;
        use std::os::fd::{AsFd as _, AsRawFd as _};
        endpoints.map().fd().as_fd().as_raw_fd()
    };
    let memlock = || -> Fallible<u64> {
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
        info.lines()
            .find_map(|line| line.strip_prefix("memlock:"))
            .ok_or("no memlock in fdinfo")?
            .trim()
            .parse()
            .map_err(Into::into)
    };
    let empty = memlock()?;
    let start = std::time::Instant::now();
    for i in 0..entries {
        let value = EndpointValue {
            identity: 256 + i % IDENTITY_POOL,
            flags: flags::REMOTE,
            node: (1 + i / 110) as u16,
        };
        let ip = IpAddr::V4(Ipv4Addr::from(V4_REMOTE + i));
        endpoints.insert(EndpointKey::from(ip), value, 0)?;
    }
    let elapsed = start.elapsed();
    let filled = memlock()?;
    let per_entry = (filled - empty) as f64 / f64::from(entries.max(1));
    println!();
    println!(
        "ENDPOINTS memory (max_entries {MEMORY_MAX_ENTRIES}, BPF_F_NO_PREALLOC, fdinfo memlock):          {:.1} MiB empty, {:.1} MiB with {entries} entries ({per_entry:.0} B per entry)",
        empty as f64 / 1_048_576.0,
        filled as f64 / 1_048_576.0,
    );
    println!(
        "ENDPOINTS writes from userspace: {entries} new entries in {:.0} ms ({:.0} entries/s)",
        elapsed.as_secs_f64() * 1e3,
        f64::from(entries) / elapsed.as_secs_f64().max(1e-9)
    );
    let start = std::time::Instant::now();
    for i in 0..entries {
        let value = EndpointValue {
            identity: 300 + i % IDENTITY_POOL,
            flags: flags::REMOTE,
            node: 1,
        };
        let ip = IpAddr::V4(Ipv4Addr::from(V4_REMOTE + i));
        endpoints.insert(EndpointKey::from(ip), value, 0)?;
    }
    let elapsed = start.elapsed();
    println!(
        "ENDPOINTS rewrites from userspace: {entries} entries in {:.0} ms ({:.0} entries/s)",
        elapsed.as_secs_f64() * 1e3,
        f64::from(entries) / elapsed.as_secs_f64().max(1e-9)
    );
    Ok(())
}

fn parse_args() -> Fallible<Options> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: smoke test.
    let benchmarking = args.iter().any(|arg| arg == "--bench" || arg == "--repeat");
    let mut options = if benchmarking {
        Options {
            repeat: 1_000_000,
            rounds: 5,
            peers: 16_384,
            memory_entries: MEMORY_ENTRIES,
            sockets_only: false,
            order: Order::Address,
        }
    } else {
        Options {
            repeat: 100,
            rounds: 1,
            peers: 16_384,
            memory_entries: 1_000,
            sockets_only: false,
            order: Order::Address,
        }
    };
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--repeat" => options.repeat = value()?.parse()?,
            "--rounds" => options.rounds = value()?.parse()?,
            "--peers" => options.peers = value()?.parse()?,
            "--sockets-only" => options.sockets_only = true,
            "--order" => {
                options.order = match value()?.as_str() {
                    "address" => Order::Address,
                    "scattered" => Order::Scattered,
                    other => {
                        return Err(
                            format!("--order takes address or scattered, not {other:?}").into()
                        );
                    }
                }
            }
            // Anything else (a filter) is ignored.
            _ => {}
        }
    }
    if options.repeat == 0 || options.rounds == 0 || options.peers < 10_000 {
        return Err("--repeat and --rounds must be positive, --peers at least 10000".into());
    }
    Ok(options)
}
