//! Integration tests: the fake API server against a real `kube::Client` and
//! `kube::runtime::watcher`, checked against the Kubernetes API conventions.

mod common;
mod crud;
mod faults;
mod kubeconfig;
mod list;
mod seeding;
mod watch;
