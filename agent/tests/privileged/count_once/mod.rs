//! Each packet counted once in the cluster, with both identities after address
//! translation (docs/design.md, "Counting traffic once"): two nodes' datapaths,
//! each attached to its own pods, kube-proxy's iptables rules on both nodes, and
//! the sum of both nodes' FLOWS compared with what each path's row says.
//!
//! Each node's datapath knows the Service range (SERVICES, as the operator sends
//! it) and has its uplink program on the link between the nodes, as the agent
//! attaches it to a node's uplinks. Before the rule, a request through a Service
//! was counted as (client, world) where it left the client, and its reply,
//! arriving from the Service address, was counted again on the client's node when
//! its backend was on the other node.
//!
//! The rows of host-network backends are in [`host_network`], those with the
//! world outside the cluster (a pod reaching it, NodePorts) in [`world`], and
//! those of a VXLAN overlay in [`overlay`]; the lab and the exchanges they share
//! are here.

mod host_network;
mod overlay;
mod service_flows;
mod world;

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    num::NonZeroU16,
    time::Duration,
};

use census_agent::bpf::{Datapath, Endpoint, Interface, ServiceKind, identity};
use census_netlab::{
    Cluster, Netns, Pod, Routing, Side, WORLD_LINK, World,
    kube_proxy::{self, Protocol, Service, service_ip},
    udp_echo, udp_echo_through,
};

use super::support::{Fallible, PinDir, TestResult, endpoint_flows, frame_len, open_datapath};

const COUNT: usize = 20;
const PAYLOAD: usize = 64;
const WAIT: Duration = Duration::from_secs(1);
/// How long the lab waits for its links' start-up chatter before a test begins.
const SETTLE: Duration = Duration::from_millis(300);
const NODE_A: NonZeroU16 = NonZeroU16::new(1).unwrap();
const NODE_B: NonZeroU16 = NonZeroU16::new(2).unwrap();
/// The Service's port, and the port its endpoints listen on.
const SERVICE_PORT: u16 = 8053;
const TARGET_PORT: u16 = 5353;

/// (source identity, destination identity) -> (packets, bytes), over every node.
type Counts = BTreeMap<(u32, u32), (u64, u64)>;

/// What a [`Lab`] is made of besides its pods.
#[derive(Debug, Clone, Copy, Default)]
struct Shape {
    /// How the nodes route each other's pods: the uplink program is on the
    /// device they are routed over (the VXLAN device in an overlay, never its
    /// underlay), as the agent attaches it.
    routing: Routing,
    /// A [`World`] behind node A, its link one of node A's uplinks.
    world: bool,
}

impl Shape {
    const OVERLAY: Self = Self {
        routing: Routing::Vxlan,
        world: false,
    };
    const WITH_WORLD: Self = Self {
        routing: Routing::Direct,
        world: true,
    };
}

/// Two nodes, pods on each with an identity of their own, both nodes' datapaths
/// attached to their own pods and their uplinks, knowing every pod (their own
/// LOCAL, the others' REMOTE with their node) and the Service range, and
/// kube-proxy's fixed chains on both.
struct Lab {
    cluster: Cluster,
    world: Option<World>,
    pods: Vec<(Side, Pod, u32)>,
    datapaths: [Datapath; 2],
    _pins: [PinDir; 2],
    /// What FLOWS held when the lab was ready.
    before: Counts,
}

impl Lab {
    /// `pods`: the side and identity of each pod to create.
    fn new(pods: &[(Side, u32)]) -> Fallible<Self> {
        Self::with(Shape::default(), pods)
    }

    /// [`Lab::new`], shaped as `shape` says.
    fn with(shape: Shape, pods: &[(Side, u32)]) -> Fallible<Self> {
        Self::named(shape, ("count-a", "count-b"), pods)
    }

    /// [`Lab::with`], its nodes' namespaces named after `names`.
    fn named(shape: Shape, names: (&str, &str), pods: &[(Side, u32)]) -> Fallible<Self> {
        let mut cluster = Cluster::with_routing(names.0, names.1, shape.routing)?;
        let world = shape
            .world
            .then(|| World::behind(cluster.node(Side::A).ns()))
            .transpose()?;
        let pins = [PinDir::new(), PinDir::new()];
        let mut datapaths = [
            open_datapath(pins[0].path())?,
            open_datapath(pins[1].path())?,
        ];
        let mut created = Vec::new();
        for &(side, identity) in pods {
            created.push((side, cluster.add_pod(side)?, identity));
        }
        for (at, datapath) in [Side::A, Side::B].into_iter().zip(&mut datapaths) {
            for (side, pod, identity) in &created {
                let endpoint = if *side == at {
                    let attached = cluster
                        .node(at)
                        .ns()
                        .run(|| datapath.attach(&pod.host_interface))??;
                    // As the agent does once attached.
                    datapath.set_interface(Interface {
                        ifindex: attached.ifindex,
                        identity: Some(*identity),
                    })?;
                    Endpoint::local(*identity)
                } else {
                    Endpoint::remote(*identity, node_index(*side))
                };
                datapath.upsert_endpoint(pod.ipv4.into(), endpoint)?;
                datapath.upsert_endpoint(pod.ipv6.into(), endpoint)?;
            }
            // The node's own addresses, and the other node's, as the endpoint map
            // gives them.
            let own = cluster.node(at);
            for address in [own.uplink_ip(false), own.pod_gateway(false)] {
                datapath.upsert_endpoint(address, Endpoint::host())?;
            }
            let other = cluster.node(at.other());
            datapath.upsert_endpoint(
                other.uplink_ip(false),
                Endpoint::remote(identity::REMOTE_NODE, node_index(at.other())),
            )?;
            let services = ipnet::IpNet::new(service_ip(0).into(), 24)?;
            datapath.upsert_service(services, ServiceKind::ClusterIpRange)?;
            let mut uplinks = vec![cluster.pod_route_device()];
            if world.is_some() && at == Side::A {
                uplinks.push(WORLD_LINK);
                datapath.upsert_endpoint(World::NODE_IP.into(), Endpoint::host())?;
            }
            for uplink in uplinks {
                cluster
                    .node(at)
                    .ns()
                    .run(|| datapath.attach_uplink(uplink))??;
            }
            datapath.attach_sockets(&census_agent::bpf::find_cgroup2_root()?)?;
            kube_proxy::install(cluster.node(at).ns())?;
        }
        let mut lab = Self {
            cluster,
            world,
            pods: created,
            datapaths,
            _pins: pins,
            before: Counts::new(),
        };
        // The pods' links came up moments ago: the MLD reports they (and the
        // nodes' side of their veths) send then, all at once, are not a test's
        // packets. Whatever landed before the test's traffic is left out.
        std::thread::sleep(SETTLE);
        lab.before = lab.totals()?;
        Ok(lab)
    }

    /// The world behind node A, in a lab shaped with one.
    fn world(&self) -> Fallible<&World> {
        self.world
            .as_ref()
            .ok_or_else(|| "a lab without a world".into())
    }

    fn pod(&self, identity: u32) -> Fallible<&Pod> {
        self.pods
            .iter()
            .find(|(_, _, id)| *id == identity)
            .map(|(_, pod, _)| pod)
            .ok_or_else(|| format!("no pod of identity {identity}").into())
    }

    /// Adds `service` on both nodes, as kube-proxy does on every node.
    fn add_service(&self, service: &Service) -> TestResult {
        for side in [Side::A, Side::B] {
            kube_proxy::add(self.cluster.node(side).ns(), service)?;
        }
        Ok(())
    }

    /// Every node's FLOWS summed since the lab was made (the link-local
    /// `world -> world` chatter of the namespaces left out).
    fn counts(&self) -> Fallible<Counts> {
        let mut counts = self.totals()?;
        for (pair, (packets, bytes)) in &self.before {
            if let Some(sum) = counts.get_mut(pair) {
                sum.0 -= packets;
                sum.1 -= bytes;
            }
        }
        counts.retain(|_, (packets, _)| *packets > 0);
        Ok(counts)
    }

    /// Every node's FLOWS summed.
    fn totals(&self) -> Fallible<Counts> {
        let mut counts = Counts::new();
        for datapath in &self.datapaths {
            for flow in endpoint_flows(datapath)? {
                let sum = counts
                    .entry((flow.src_identity, flow.dst_identity))
                    .or_default();
                sum.0 += flow.packets;
                sum.1 += flow.bytes;
            }
        }
        Ok(counts)
    }
}

fn node_index(side: Side) -> NonZeroU16 {
    match side {
        Side::A => NODE_A,
        Side::B => NODE_B,
    }
}

/// `COUNT` datagrams each way, each of one `PAYLOAD`-byte UDP frame.
fn each_way(pairs: &[(u32, u32)]) -> Counts {
    let bytes = COUNT as u64 * frame_len(PAYLOAD, false);
    pairs
        .iter()
        .map(|&pair| (pair, (COUNT as u64, bytes)))
        .collect()
}

const CLIENT: u32 = 1000;
const BACKEND: u32 = 1001;

/// `COUNT` exchanges between a client pod on node A and a backend pod on
/// `backend_side`, addressed directly: each way counted once, with both pods.
/// Returns the lab, for what a row checks besides.
fn direct_exchange_is_counted_once(shape: Shape, backend_side: Side) -> Fallible<Lab> {
    let lab = Lab::with(shape, &[(Side::A, CLIENT), (backend_side, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    assert_eq!(
        echo(
            (&client.ns, client.ipv4.into()),
            (&backend.ns, backend.ipv4.into())
        )?,
        COUNT
    );
    assert_eq!(
        lab.counts()?,
        each_way(&[(CLIENT, BACKEND), (BACKEND, CLIENT)])
    );
    Ok(lab)
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_request_and_its_reply_between_pods_of_one_node_are_counted_once() -> TestResult {
    direct_exchange_is_counted_once(Shape::default(), Side::A).map(drop)
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_request_and_its_reply_across_nodes_are_counted_once() -> TestResult {
    direct_exchange_is_counted_once(Shape::default(), Side::B).map(drop)
}

/// A ClusterIP Service whose one endpoint is `backend`.
fn cluster_ip(name: &str, n: u8, backend: &Pod) -> Service {
    Service {
        name: name.to_owned(),
        address: SocketAddrV4::new(service_ip(n), SERVICE_PORT),
        protocol: Protocol::Udp,
        endpoints: vec![SocketAddrV4::new(backend.ipv4, TARGET_PORT)],
        masquerade_all: false,
        node_port: None,
    }
}

/// `COUNT` exchanges from `from` (its namespace and address) straight to `to`.
fn echo(from: (&Netns, IpAddr), to: (&Netns, IpAddr)) -> Fallible<usize> {
    Ok(udp_echo(from.0, from.1, to.0, to.1, COUNT, PAYLOAD, WAIT)?)
}

/// `COUNT` exchanges from `client` through `service` to `backend`.
fn through(client: &Pod, service: &Service, backend: &Pod) -> Fallible<usize> {
    Ok(udp_echo_through(
        &client.ns,
        IpAddr::V4(client.ipv4),
        SocketAddr::V4(service.address),
        &backend.ns,
        SocketAddr::new(backend.ipv4.into(), TARGET_PORT),
        COUNT,
        PAYLOAD,
        WAIT,
    )?)
}

/// `COUNT` exchanges from a client pod on node A through a ClusterIP whose
/// endpoint is a pod on `backend_side`: (client, backend) and (backend, client).
/// Returns the lab, for what a row checks besides.
fn service_exchange_is_counted_client_to_backend(
    shape: Shape,
    backend_side: Side,
    n: u8,
) -> Fallible<Lab> {
    let lab = Lab::with(shape, &[(Side::A, CLIENT), (backend_side, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = cluster_ip(&format!("svc{n}"), n, backend);
    lab.add_service(&service)?;
    assert_eq!(through(client, &service, backend)?, COUNT);
    assert_eq!(
        lab.counts()?,
        each_way(&[(CLIENT, BACKEND), (BACKEND, CLIENT)])
    );
    Ok(lab)
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_service_request_to_a_pod_of_the_same_node_is_counted_client_to_backend() -> TestResult {
    service_exchange_is_counted_client_to_backend(Shape::default(), Side::A, 1).map(drop)
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_service_request_to_a_pod_of_another_node_is_counted_client_to_backend() -> TestResult {
    service_exchange_is_counted_client_to_backend(Shape::default(), Side::B, 2).map(drop)
}

/// `COUNT` exchanges between node `from`'s own socket and a pod on node A: the
/// request counted where the node's socket sent it, as (host, pod) on that node,
/// the reply where it left the pod, as (pod, host) or (pod, remote-node).
fn node_exchange_is_counted_once(from: Side) -> TestResult {
    let lab = Lab::new(&[(Side::A, CLIENT)])?;
    let pod = lab.pod(CLIENT)?;
    let node = lab.cluster.node(from);
    // The address a node's socket sends from toward that pod.
    let source = if from == Side::A {
        node.pod_gateway(false)
    } else {
        node.uplink_ip(false)
    };
    assert_eq!(
        echo((node.ns(), source), (&pod.ns, pod.ipv4.into()))?,
        COUNT
    );
    let reply_to = if from == Side::A {
        identity::HOST
    } else {
        identity::REMOTE_NODE
    };
    assert_eq!(
        lab.counts()?,
        each_way(&[(identity::HOST, CLIENT), (CLIENT, reply_to)])
    );
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_node_and_a_pod_of_its_own_are_counted_once_each_way() -> TestResult {
    node_exchange_is_counted_once(Side::A)
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_node_and_a_pod_of_another_node_are_counted_once_each_way() -> TestResult {
    node_exchange_is_counted_once(Side::B)
}

/// The sum `COUNT` exchanges through `service` gave, each way `COUNT` once:
/// `request` and `reply` the pairs they were counted as.
fn counted_as(lab: &Lab, request: (u32, u32), reply: (u32, u32)) -> TestResult {
    assert_eq!(lab.counts()?, each_way(&[request, reply]));
    Ok(())
}

/// A pod reaching itself through a Service (kube-proxy masquerades the hairpin
/// to the node's address): the request counted where it enters the pod, as the
/// pod's own (the interface it came in by names the sender, not the masqueraded
/// source); the reply where it leaves, to the node's address it was sent from.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_hairpin_is_counted_once_each_way() -> TestResult {
    let lab = Lab::new(&[(Side::A, CLIENT)])?;
    let client = lab.pod(CLIENT)?;
    let service = cluster_ip("hairpin", 3, client);
    lab.add_service(&service)?;
    assert_eq!(through(client, &service, client)?, COUNT);
    counted_as(&lab, (CLIENT, CLIENT), (CLIENT, identity::HOST))
}

/// kube-proxy's `--masquerade-all`: every request through the Service leaves
/// with the node's address. Counted once each way: the request with its client
/// (by the interface it came in by), the reply to the address it was sent from
/// (this node's, or the other node's where the backend is there).
fn masquerade_all_is_counted_once(backend_side: Side, n: u8) -> TestResult {
    let lab = Lab::new(&[(Side::A, CLIENT), (backend_side, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = Service {
        masquerade_all: true,
        ..cluster_ip(&format!("masq{n}"), n, backend)
    };
    lab.add_service(&service)?;
    assert_eq!(through(client, &service, backend)?, COUNT);
    let reply_to = if backend_side == Side::A {
        identity::HOST
    } else {
        identity::REMOTE_NODE
    };
    counted_as(&lab, (CLIENT, BACKEND), (BACKEND, reply_to))
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn masquerade_all_to_a_pod_of_the_same_node_is_counted_once_each_way() -> TestResult {
    masquerade_all_is_counted_once(Side::A, 4)
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn masquerade_all_to_a_pod_of_another_node_is_counted_once_each_way() -> TestResult {
    masquerade_all_is_counted_once(Side::B, 5)
}

/// A datagram of three fragments each way through a Service to a pod of the
/// same node: netfilter reassembles it for the DNAT and fragments it again, each
/// fragment keeping the mark; the Service is matched on the address alone, so
/// the two fragments without ports are marked too. Each way three packets a
/// datagram, with the client and the backend, never more.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_fragmented_datagram_through_a_service_is_counted_once_per_fragment() -> TestResult {
    /// 3,008 bytes of UDP over a 1,500-byte MTU: 1,480 + 1,480 + 48 bytes of IP
    /// payload, each fragment with its Ethernet and IPv4 headers.
    const DATAGRAM: usize = 3000;
    const FRAGMENT_FRAMES: u64 = (14 + 20 + 1480) * 2 + (14 + 20 + 48);
    let lab = Lab::new(&[(Side::A, CLIENT), (Side::A, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = cluster_ip("frag", 6, backend);
    lab.add_service(&service)?;
    let replies = udp_echo_through(
        &client.ns,
        IpAddr::V4(client.ipv4),
        SocketAddr::V4(service.address),
        &backend.ns,
        SocketAddr::new(backend.ipv4.into(), TARGET_PORT),
        COUNT,
        DATAGRAM,
        WAIT,
    )?;
    assert_eq!(replies, COUNT);
    let each = (3 * COUNT as u64, COUNT as u64 * FRAGMENT_FRAMES);
    assert_eq!(
        lab.counts()?,
        Counts::from([((CLIENT, BACKEND), each), ((BACKEND, CLIENT), each)])
    );
    Ok(())
}

/// Marks lost are counted in the units FLOWS counts packets in: segments, not skbs.
/// A 4 MiB TCP transfer through a ClusterIP under a rule that rewrites the whole
/// mark (`CONNMARK --restore-mark`): every request segment loses the mark, and
/// `marks_lost` grows by about one per 1,500-byte frame, not one per 64 KiB skb.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn marks_lost_under_gso_are_counted_in_segments() -> TestResult {
    const LEN: usize = 4 << 20;
    const MAX_FRAME: u64 = 1514;
    let lab = Lab::new(&[(Side::A, CLIENT), (Side::A, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = Service {
        protocol: Protocol::Tcp,
        ..cluster_ip("lost", 9, backend)
    };
    lab.add_service(&service)?;
    let node = lab.cluster.node(Side::A).ns();
    let output = node.output(
        "iptables",
        &[
            "-t",
            "mangle",
            "-A",
            "PREROUTING",
            "-j",
            "CONNMARK",
            "--restore-mark",
        ],
    )?;
    if !output.status.success() {
        return Err(format!("iptables: {}", String::from_utf8_lossy(&output.stderr)).into());
    }
    let listener = backend
        .ns
        .run(|| TcpListener::bind(SocketAddr::new(backend.ipv4.into(), TARGET_PORT)))??;
    let server = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut stream, _) = listener.accept()?;
        let mut received = vec![0u8; LEN];
        stream.read_exact(&mut received)?;
        Ok(received.len())
    });
    let mut stream = client
        .ns
        .run(|| TcpStream::connect(SocketAddr::V4(service.address)))??;
    stream.write_all(&vec![7u8; LEN])?;
    assert_eq!(server.join().map_err(|_| "server panicked")??, LEN);
    drop(stream);
    std::thread::sleep(Duration::from_millis(200));
    let lost = lab.datapaths[0].stats()?.marks_lost();
    crate::two_node::report(&format!("marks lost for a 4 MiB transfer: {lost}"));
    assert!(
        lost * MAX_FRAME >= LEN as u64,
        "{lost} marks lost for {LEN} B sent through the Service: skbs counted, not segments"
    );
    Ok(())
}

/// One TCP connection through a ClusterIP to a pod of the other node, 4 MiB
/// each way: counted at the uplink (request) and where the reply leaves the
/// backend, with the two pods only, and in segments (`gso_segs` per skb), not
/// skbs: no counted packet is on average larger than a 1,500-byte MTU frame.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_tcp_connection_through_a_service_across_nodes_is_counted_in_segments() -> TestResult {
    const LEN: usize = 4 << 20;
    const MAX_FRAME: u64 = 1514;
    let lab = Lab::new(&[(Side::A, CLIENT), (Side::B, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = Service {
        protocol: Protocol::Tcp,
        ..cluster_ip("tcp", 7, backend)
    };
    lab.add_service(&service)?;
    let listener = backend
        .ns
        .run(|| TcpListener::bind(SocketAddr::new(backend.ipv4.into(), TARGET_PORT)))??;
    // The backend sends back what it received.
    let server = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut stream, _) = listener.accept()?;
        let mut received = vec![0u8; LEN];
        stream.read_exact(&mut received)?;
        stream.write_all(&received)?;
        Ok(received.len())
    });
    let mut stream = client
        .ns
        .run(|| TcpStream::connect(SocketAddr::V4(service.address)))??;
    stream.write_all(&vec![7u8; LEN])?;
    let mut back = vec![0u8; LEN];
    stream.read_exact(&mut back)?;
    drop(stream);
    assert_eq!(server.join().map_err(|_| "server panicked")??, LEN);
    // The FINs and last ACKs.
    std::thread::sleep(Duration::from_millis(200));

    let counts = lab.counts()?;
    let pairs: Vec<(u32, u32)> = counts.keys().copied().collect();
    assert_eq!(pairs, [(CLIENT, BACKEND), (BACKEND, CLIENT)], "{counts:?}");
    for (pair, (packets, bytes)) in &counts {
        assert!(*bytes >= LEN as u64, "{pair:?}: {bytes} B for {LEN} B sent");
        assert!(
            *bytes <= packets * MAX_FRAME,
            "{pair:?}: {packets} packets for {bytes} B: skbs counted, not segments"
        );
    }
    Ok(())
}

/// Marked packets sent and counted, over both nodes.
fn marks(lab: &Lab) -> Fallible<(u64, u64)> {
    let mut sum = (0, 0);
    for datapath in &lab.datapaths {
        let stats = datapath.stats()?;
        sum.0 += stats.service_marked;
        sum.1 += stats.marked_counted;
    }
    Ok(sum)
}

/// Every marked request is counted once translated; a foreign rule that
/// rewrites the whole mark (`CONNMARK --restore-mark` without a mask, restoring a
/// connection mark of 0) takes the bit off: those requests go uncounted, and the
/// datapath's counters report them as marks lost.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_rule_that_rewrites_the_whole_mark_shows_as_marks_lost() -> TestResult {
    let lab = Lab::new(&[(Side::A, CLIENT), (Side::A, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = cluster_ip("marks", 8, backend);
    lab.add_service(&service)?;
    assert_eq!(through(client, &service, backend)?, COUNT);
    assert_eq!(marks(&lab)?, (COUNT as u64, COUNT as u64));
    let stats = lab.datapaths[0].stats()?;
    assert_eq!(stats.marks_lost(), 0);

    let node = lab.cluster.node(Side::A).ns();
    let mangle = |args: &[&str]| -> TestResult {
        let output = node.output("iptables", args)?;
        if !output.status.success() {
            return Err(format!(
                "iptables {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            )
            .into());
        }
        Ok(())
    };
    mangle(&[
        "-t",
        "mangle",
        "-A",
        "PREROUTING",
        "-j",
        "CONNMARK",
        "--restore-mark",
    ])?;
    assert_eq!(through(client, &service, backend)?, COUNT);
    assert_eq!(marks(&lab)?, (2 * COUNT as u64, COUNT as u64));
    assert_eq!(lab.datapaths[0].stats()?.marks_lost(), COUNT as u64);
    // The requests went uncounted (nothing counted them as the client's, nor
    // twice); the replies were counted as always.
    assert_eq!(
        lab.counts()?,
        Counts::from([
            (
                (CLIENT, BACKEND),
                each_way(&[(CLIENT, BACKEND)])[&(CLIENT, BACKEND)]
            ),
            ((BACKEND, CLIENT), {
                let (packets, bytes) = each_way(&[(BACKEND, CLIENT)])[&(BACKEND, CLIENT)];
                (2 * packets, 2 * bytes)
            }),
        ])
    );
    Ok(())
}
