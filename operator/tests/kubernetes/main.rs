//! The Kubernetes side of the operator against the in-repo fake API server (real
//! HTTP/JSON over loopback, real kube clients): the Identity store, garbage collection
//! per item, node admission, leader election (in-process replicas and two real
//! operator processes), the deploy/ manifests and the RBAC they grant. `real` runs the
//! same scenarios against the real control plane (census-cluster), and `in_cluster`
//! deploys census there as in a cluster.

mod common;
mod deploy;
mod faults_real;
mod forwarding;
mod gc;
mod ha;
mod in_cluster;
mod kubectl;
mod leader_slice;
mod leadership;
mod manifests;
mod node_addresses;
mod operator;
mod real;
mod service_addresses;
mod store;
mod tokenreview;
