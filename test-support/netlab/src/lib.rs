//! Network namespaces, veth pairs and traffic for census's privileged tests.
//!
//! A [`Lab`] is one "node" network namespace (forwarding enabled inside it only)
//! and "pods", each a namespace whose `eth0` is one end of a veth pair whose host
//! side lives in the node namespace, as a CNI sets pods up. Addresses come from
//! the benchmarking ranges 198.18.0.0/15 and 2001:2::/48, and routes only lead
//! from pod to pod through the node: the namespaces have no other interface, so
//! nothing leaves the lab.
//!
//! A [`Cluster`] is two such nodes joined by a veth pair and routed to each other,
//! each with its own pods, for what spans nodes; [`kube_proxy`] gives its nodes
//! Services the way kube-proxy's iptables mode does, and a [`World`] is a namespace
//! outside the cluster behind one of its nodes. A [`Masquerade`] is a router
//! namespace between two namespaces that source-NATs what one sends the other.
//!
//! Every namespace is a guard: dropping it (also while a failing test unwinds)
//! deletes it, and its veths with it. Names are unique per process and call
//! (`census-<pid>-<n>-…`), so tests can run in parallel.
//!
//! Code runs inside a namespace on a dedicated thread that entered it with
//! `setns(2)` ([`Netns::run`]); processes are spawned from such a thread
//! ([`Netns::spawn`]), never with `ip netns exec`, which remounts `/sys` and
//! hides the BPF file system.
//!
//! [`certs`] makes the certificates for mutual TLS between a lab's processes.
//!
//! Everything else here needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN).

pub mod certs;
mod cluster;
mod error;
mod forward;
pub mod kube_proxy;
mod lab;
mod nat;
mod netns;
pub mod packet;
mod traffic;
mod world;

pub use cluster::{Cluster, ClusterNode, Routing, Side, UPLINK, VXLAN};
pub use error::Error;
pub use forward::{Forward, Target};
pub use lab::{Lab, Pod};
pub use nat::{Masquerade, TO_ROUTER};
pub use netns::{ChildGuard, Netns, add_veth, ip_in, unique_name};
pub use traffic::{
    UdpReceiver, UdpSender, exchange_udp, udp_echo, udp_echo_between, udp_echo_through,
};
pub use world::{WORLD_LINK, World};
