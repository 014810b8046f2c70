//! Which Service (docs/design.md, "Which Service"): the root cgroup's programs
//! count SERVICE_FLOWS4/6 per (client, Service address, port, protocol,
//! direction), where a request still carries the Service address its client
//! dialled and its reply carries it back, in the lab of the count-once rows
//! with kube-proxy's rules. Each row checks the Service counters and that FLOWS
//! holds what the count-once row of the same path holds: counting a Service
//! packet changes nothing of FLOWS.
//!
//! The lab's namespaces are named `svc-*`.

use std::{
    collections::BTreeMap,
    io::{Read as _, Write as _},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    time::Duration,
};

use census_agent::bpf::{Endpoint, ServiceDirection, identity};
use census_netlab::{Side, UdpReceiver, kube_proxy::Protocol, udp_echo_between};

use super::{
    BACKEND, CLIENT, COUNT, Counts, Lab, PAYLOAD, Shape, TARGET_PORT, WAIT, cluster_ip, each_way,
    through,
};
use crate::support::{Fallible, TestResult, bpftool, bytes, frame_len, hex, path_str};

const UDP: u8 = 17;
const TCP: u8 = 6;

/// (client, Service address, port, protocol, direction) -> (packets, bytes),
/// over both nodes.
type ServiceCounts = BTreeMap<(u32, IpAddr, u16, u8, ServiceDirection), (u64, u64)>;

impl Lab {
    /// A lab of `svc-*` namespaces.
    fn for_services(pods: &[(Side, u32)]) -> Fallible<Self> {
        Self::named(Shape::default(), ("svc-a", "svc-b"), pods)
    }

    /// Every node's SERVICE_FLOWS4/6 summed.
    fn service_counts(&self) -> Fallible<ServiceCounts> {
        let mut counts = ServiceCounts::new();
        for datapath in &self.datapaths {
            for flow in datapath.service_flows()? {
                let sum = counts
                    .entry((
                        flow.client_identity,
                        flow.service,
                        flow.port,
                        flow.protocol,
                        flow.direction,
                    ))
                    .or_default();
                sum.0 += flow.packets;
                sum.1 += flow.bytes;
            }
        }
        Ok(counts)
    }
}

/// `COUNT` UDP datagrams of `PAYLOAD` bytes each way between `client` and the
/// Service at `service`.
fn udp_each_way(client: u32, service: SocketAddr) -> ServiceCounts {
    let each = (COUNT as u64, COUNT as u64 * frame_len(PAYLOAD, false));
    [ServiceDirection::Request, ServiceDirection::Reply]
        .into_iter()
        .map(|direction| ((client, service.ip(), service.port(), UDP, direction), each))
        .collect()
}

/// A pod on node A calling a ClusterIP whose backend is on `backend_side`:
/// the Service counted each way for the client; FLOWS as the count-once row.
fn a_pod_calling_a_cluster_ip(backend_side: Side, n: u8) -> TestResult {
    let lab = Lab::for_services(&[(Side::A, CLIENT), (backend_side, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = cluster_ip(&format!("svc{n}"), n, backend);
    lab.add_service(&service)?;
    assert_eq!(through(client, &service, backend)?, COUNT);
    assert_eq!(
        lab.service_counts()?,
        udp_each_way(CLIENT, service.address.into())
    );
    assert_eq!(
        lab.counts()?,
        each_way(&[(CLIENT, BACKEND), (BACKEND, CLIENT)])
    );
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_pod_calling_a_cluster_ip_with_its_backend_on_its_node_counts_the_service() -> TestResult {
    a_pod_calling_a_cluster_ip(Side::A, 21)
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_pod_calling_a_cluster_ip_with_its_backend_on_another_node_counts_the_service() -> TestResult {
    a_pod_calling_a_cluster_ip(Side::B, 22)
}

/// A UDP socket on the client's address, kept open across exchanges, and the
/// backend's server on its target port.
fn open_socket_and_server(
    client: &census_netlab::Pod,
    backend: &census_netlab::Pod,
) -> Fallible<(UdpReceiver, UdpReceiver)> {
    let server = UdpReceiver::bind_addr(
        &backend.ns,
        SocketAddr::new(backend.ipv4.into(), TARGET_PORT),
    )?;
    Ok((UdpReceiver::bind(&client.ns, client.ipv4.into())?, server))
}

/// A client relabelled while its socket stays open (a pod whose labels changed
/// gets another identity, ENDPOINTS is rewritten): the Service packets that
/// socket sends and receives after the change count for the new identity, none
/// more for the old. The client kept for its address (CLIENTS) is not used past
/// an ENDPOINTS write.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_relabelled_client_s_open_socket_counts_for_its_new_identity() -> TestResult {
    const RELABELLED: u32 = 1077;
    let mut lab = Lab::for_services(&[(Side::A, CLIENT), (Side::B, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = cluster_ip("svcrelabel", 29, backend);
    lab.add_service(&service)?;
    let (socket, server) = open_socket_and_server(client, backend)?;
    let target = SocketAddr::V4(service.address);
    let exchange = || udp_echo_between(&socket, target, &server, COUNT, PAYLOAD, WAIT);
    assert_eq!(exchange()?, COUNT);
    let address = IpAddr::V4(client.ipv4);
    lab.datapaths[0].upsert_endpoint(address, Endpoint::local(RELABELLED))?;
    assert_eq!(exchange()?, COUNT);
    let mut expected = udp_each_way(CLIENT, target);
    expected.extend(udp_each_way(RELABELLED, target));
    assert_eq!(lab.service_counts()?, expected);
    Ok(())
}

/// A pod reaching itself through its Service: the Service counted each way for
/// the pod; FLOWS as the hairpin row (the reply attributed to the node's
/// address).
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_hairpin_counts_the_service_for_its_client() -> TestResult {
    let lab = Lab::for_services(&[(Side::A, CLIENT)])?;
    let client = lab.pod(CLIENT)?;
    let service = cluster_ip("svchair", 23, client);
    lab.add_service(&service)?;
    assert_eq!(through(client, &service, client)?, COUNT);
    assert_eq!(
        lab.service_counts()?,
        udp_each_way(CLIENT, service.address.into())
    );
    assert_eq!(
        lab.counts()?,
        each_way(&[(CLIENT, CLIENT), (CLIENT, identity::HOST)])
    );
    Ok(())
}

/// `--masquerade-all`: the masquerade happens after the socket layer, so the
/// Service is counted for its client; FLOWS as the masquerade-all row.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn masquerade_all_counts_the_service_for_its_client() -> TestResult {
    let lab = Lab::for_services(&[(Side::A, CLIENT), (Side::B, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = census_netlab::kube_proxy::Service {
        masquerade_all: true,
        ..cluster_ip("svcmasq", 24, backend)
    };
    lab.add_service(&service)?;
    assert_eq!(through(client, &service, backend)?, COUNT);
    assert_eq!(
        lab.service_counts()?,
        udp_each_way(CLIENT, service.address.into())
    );
    assert_eq!(
        lab.counts()?,
        each_way(&[(CLIENT, BACKEND), (BACKEND, identity::REMOTE_NODE)])
    );
    Ok(())
}

/// A datagram of three fragments each way: the socket layer sees it whole,
/// before the IP layer fragments it (and after it is reassembled), so the
/// Service counts one packet of the whole datagram's length a datagram; FLOWS
/// counts its three fragments, as the count-once row.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_fragmented_datagram_counts_the_service_once_per_datagram() -> TestResult {
    const DATAGRAM: usize = 3000;
    const FRAGMENT_FRAMES: u64 = (14 + 20 + 1480) * 2 + (14 + 20 + 48);
    let lab = Lab::for_services(&[(Side::A, CLIENT), (Side::A, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = cluster_ip("svcfrag", 25, backend);
    lab.add_service(&service)?;
    let replies = census_netlab::udp_echo_through(
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
    let address = SocketAddr::V4(service.address);
    let each = (COUNT as u64, COUNT as u64 * frame_len(DATAGRAM, false));
    assert_eq!(
        lab.service_counts()?,
        ServiceCounts::from([
            (
                (
                    CLIENT,
                    address.ip(),
                    address.port(),
                    UDP,
                    ServiceDirection::Request
                ),
                each
            ),
            (
                (
                    CLIENT,
                    address.ip(),
                    address.port(),
                    UDP,
                    ServiceDirection::Reply
                ),
                each
            ),
        ])
    );
    let fragments = (3 * COUNT as u64, COUNT as u64 * FRAGMENT_FRAMES);
    assert_eq!(
        lab.counts()?,
        Counts::from([
            ((CLIENT, BACKEND), fragments),
            ((BACKEND, CLIENT), fragments)
        ])
    );
    Ok(())
}

/// One TCP connection from `client_ns` at `client_ip` (a pod's, or a node's
/// own) to `service`, `len` bytes each way, the backend echoing them.
fn tcp_transfer(
    client_ns: &census_netlab::Netns,
    service: SocketAddr,
    backend: &census_netlab::Pod,
    len: usize,
) -> TestResult {
    let listener = backend
        .ns
        .run(|| TcpListener::bind(SocketAddr::new(backend.ipv4.into(), TARGET_PORT)))??;
    let server = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut stream, _) = listener.accept()?;
        let mut received = vec![0u8; len];
        stream.read_exact(&mut received)?;
        stream.write_all(&received)?;
        Ok(received.len())
    });
    let mut stream = client_ns.run(|| TcpStream::connect(service))??;
    stream.write_all(&vec![7u8; len])?;
    let mut back = vec![0u8; len];
    stream.read_exact(&mut back)?;
    drop(stream);
    assert_eq!(server.join().map_err(|_| "server panicked")??, len);
    // The FINs and last ACKs.
    std::thread::sleep(Duration::from_millis(200));
    Ok(())
}

/// 2 MB each way over TCP through a ClusterIP to a pod of the other node: the
/// Service's request and reply counters hold exactly what FLOWS holds for
/// (client, backend) and (backend, client), segments and bytes; FLOWS as the
/// count-once TCP row (the two pairs only, counted in segments).
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_2_mb_tcp_transfer_counts_the_service_in_flows_units() -> TestResult {
    const LEN: usize = 2_000_000;
    const MAX_FRAME: u64 = 1514;
    let lab = Lab::for_services(&[(Side::A, CLIENT), (Side::B, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = census_netlab::kube_proxy::Service {
        protocol: Protocol::Tcp,
        ..cluster_ip("svctcp", 26, backend)
    };
    lab.add_service(&service)?;
    let address = SocketAddr::V4(service.address);
    tcp_transfer(&client.ns, address, backend, LEN)?;

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
    let key = |direction| (CLIENT, address.ip(), address.port(), TCP, direction);
    assert_eq!(
        lab.service_counts()?,
        ServiceCounts::from([
            (key(ServiceDirection::Request), counts[&(CLIENT, BACKEND)]),
            (key(ServiceDirection::Reply), counts[&(BACKEND, CLIENT)]),
        ])
    );
    Ok(())
}

/// A host-network client (a socket of node A) over TCP through a ClusterIP to
/// a pod of its node: kube-proxy translates the node's own packets in OUTPUT,
/// before the root cgroup's egress, so the Service address comes from the
/// socket (connected to it); counted for `host`. FLOWS as for a node talking to
/// its pod: (host, pod) at its sockets, (pod, host) where the reply leaves the
/// pod; the Service counters hold exactly those.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_host_network_client_counts_the_service_as_host() -> TestResult {
    let lab = Lab::for_services(&[(Side::A, BACKEND)])?;
    let backend = lab.pod(BACKEND)?;
    let service = census_netlab::kube_proxy::Service {
        protocol: Protocol::Tcp,
        ..cluster_ip("svchost", 27, backend)
    };
    lab.add_service(&service)?;
    let address = SocketAddr::V4(service.address);
    // A node routes Service addresses somewhere (its default route, in a
    // cluster): the route is looked up before kube-proxy's DNAT.
    let node = lab.cluster.node(Side::A).ns();
    node.ip(&[
        "route",
        "add",
        "198.19.96.0/24",
        "dev",
        census_netlab::UPLINK,
    ])?;
    tcp_transfer(node, address, backend, 64 * 1024)?;

    let counts = lab.counts()?;
    let pairs: Vec<(u32, u32)> = counts.keys().copied().collect();
    assert_eq!(
        pairs,
        [(identity::HOST, BACKEND), (BACKEND, identity::HOST)],
        "{counts:?}"
    );
    let key = |direction| (identity::HOST, address.ip(), address.port(), TCP, direction);
    assert_eq!(
        lab.service_counts()?,
        ServiceCounts::from([
            (
                key(ServiceDirection::Request),
                counts[&(identity::HOST, BACKEND)]
            ),
            (
                key(ServiceDirection::Reply),
                counts[&(BACKEND, identity::HOST)]
            ),
        ])
    );
    Ok(())
}

/// Two Services in front of one backend: counted apart, by address; FLOWS
/// holds both exchanges under the one pair each way.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn two_services_in_front_of_one_backend_are_counted_apart() -> TestResult {
    let lab = Lab::for_services(&[(Side::A, CLIENT), (Side::B, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let first = cluster_ip("svcone", 28, backend);
    let second = cluster_ip("svctwo", 29, backend);
    lab.add_service(&first)?;
    lab.add_service(&second)?;
    assert_eq!(through(client, &first, backend)?, COUNT);
    assert_eq!(through(client, &second, backend)?, COUNT);
    let mut expected = udp_each_way(CLIENT, first.address.into());
    expected.extend(udp_each_way(CLIENT, second.address.into()));
    assert_eq!(lab.service_counts()?, expected);
    let (packets, bytes) = each_way(&[(CLIENT, BACKEND)])[&(CLIENT, BACKEND)];
    let twice = (2 * packets, 2 * bytes);
    assert_eq!(
        lab.counts()?,
        Counts::from([((CLIENT, BACKEND), twice), ((BACKEND, CLIENT), twice)])
    );
    Ok(())
}

/// The highest id of a BPF map on the machine now (0 if none): the maps made
/// after this have higher ids.
fn last_map_id() -> Fallible<u32> {
    let maps = bpftool(None, &["map", "list"])?;
    Ok(maps
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|map| map["id"].as_u64())
        .max()
        .map_or(Ok(0), u32::try_from)?)
}

/// The ENDPOINTS key of `address`, and its CLIENTS entry's index as bpftool
/// takes it (`hex`, then the bytes).
fn clients_slot(address: IpAddr) -> (census_common::EndpointKey, Vec<String>) {
    use census_common::{ClientCache, EndpointKey, filter::Probe as _};
    let key = EndpointKey::from(address);
    let mut slot = vec!["hex".to_owned()];
    slot.extend(hex(&ClientCache::slot(key.hash()).to_le_bytes()));
    (key, slot)
}

/// The CLIENTS entry (`census_common::ClientCache`) of `address` in the lab's
/// maps made after `since` that holds `client` for it (the other node's holds
/// the address too, as no client of its own): the map, and the entry's stamp.
fn clients_entry(since: u32, address: IpAddr, client: u32) -> Fallible<(u32, u64)> {
    use census_common::ClientCache;
    let (key, slot) = clients_slot(address);
    let maps = bpftool(None, &["map", "list"])?;
    for map in maps.as_array().into_iter().flatten() {
        let id = u32::try_from(map["id"].as_u64().ok_or("a map without id")?)?;
        if id <= since || map["name"].as_str() != Some(census_common::CLIENTS_MAP) {
            continue;
        }
        let id_arg = id.to_string();
        let mut args = vec!["map", "lookup", "id", id_arg.as_str(), "key"];
        args.extend(slot.iter().map(String::as_str));
        let value = bytes(&bpftool(None, &args)?["value"])?;
        let (stamp, rest) = value.split_at(8);
        let stamp = u64::from_le_bytes(stamp.try_into()?);
        if rest.get(..20) == Some(&key_bytes(&key)[..]) && ClientCache::client(stamp) == client {
            return Ok((id, stamp));
        }
    }
    Err(format!("no CLIENTS entry holds {client} for {address}").into())
}

/// An ENDPOINTS key's 20 bytes as they sit in a map.
fn key_bytes(key: &census_common::EndpointKey) -> Vec<u8> {
    let mut bytes = key.family.to_le_bytes().to_vec();
    bytes.extend(key.octets());
    bytes
}

/// Writes the CLIENTS entry of `address` in map `id`: the address beside `stamp`.
fn write_clients_entry(id: u32, address: IpAddr, stamp: u64) -> Fallible<()> {
    let (key, slot) = clients_slot(address);
    let mut value = stamp.to_le_bytes().to_vec();
    value.extend(key_bytes(&key));
    value.extend([0; 4]);
    let id_arg = id.to_string();
    let mut args = vec!["map", "update", "id", id_arg.as_str(), "key"];
    args.extend(slot.iter().map(String::as_str));
    args.extend(["value", "hex"]);
    let value = hex(&value);
    args.extend(value.iter().map(String::as_str));
    let status = std::process::Command::new("bpftool").args(&args).status()?;
    if !status.success() {
        return Err(format!("bpftool map update of CLIENTS {id} failed: {status}").into());
    }
    Ok(())
}

/// A Service packet's client is kept by address in CLIENTS, an array every CPU
/// writes without a lock; an entry holding the client's address beside a stamp
/// written for another address (what two CPUs writing one entry at once can
/// leave) is not taken: the packets still count for the client. The same entry
/// with a stamp made for the client's own address is taken (an identity written
/// there is what the packets then count for), which shows the test reaches the
/// entry the program reads.
#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_kept_client_beside_another_address_s_stamp_is_not_taken() -> TestResult {
    use census_common::{ClientCache, EndpointKey, filter::Probe as _};
    const PLANTED: u32 = 1099;
    let since = last_map_id()?;
    let lab = Lab::for_services(&[(Side::A, CLIENT), (Side::B, BACKEND)])?;
    let (client, backend) = (lab.pod(CLIENT)?, lab.pod(BACKEND)?);
    let service = cluster_ip("svckept", 30, backend);
    lab.add_service(&service)?;
    let (socket, server) = open_socket_and_server(client, backend)?;
    let target = SocketAddr::V4(service.address);
    let exchange = || udp_echo_between(&socket, target, &server, COUNT, PAYLOAD, WAIT);
    assert_eq!(exchange()?, COUNT);
    let address = IpAddr::V4(client.ipv4);
    let (map, _) = clients_entry(since, address, CLIENT)?;
    // Node A's epoch: the client is its pod.
    let epoch_pin = lab._pins[0].path().join(census_common::CLIENTS_EPOCH_MAP);
    let epoch = bpftool(
        None,
        &[
            "map",
            "lookup",
            "pinned",
            path_str(&epoch_pin)?,
            "key",
            "0",
            "0",
            "0",
            "0",
        ],
    )?;
    let epoch = u64::from_le_bytes(bytes(&epoch["value"])?.as_slice().try_into()?);
    // What a CPU writing another address's client there stamps.
    let other = EndpointKey::from(IpAddr::from([198, 18, 99, 99])).hash();
    write_clients_entry(map, address, ClientCache::stamp(epoch, other, PLANTED))?;
    assert_eq!(exchange()?, COUNT);
    let mut expected = udp_each_way(CLIENT, target);
    for count in expected.values_mut() {
        *count = (count.0 * 2, count.1 * 2);
    }
    assert_eq!(lab.service_counts()?, expected, "a torn entry taken");
    let hash = EndpointKey::from(address).hash();
    write_clients_entry(map, address, ClientCache::stamp(epoch, hash, PLANTED))?;
    assert_eq!(exchange()?, COUNT);
    expected.extend(udp_each_way(PLANTED, target));
    assert_eq!(
        lab.service_counts()?,
        expected,
        "the entry the program reads"
    );
    Ok(())
}
