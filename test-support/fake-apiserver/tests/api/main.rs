//! Integration tests: the fake API server against a real `kube::Client` and
//! `kube::runtime::watcher`, checked against the Kubernetes API conventions.

mod common;
mod crud;
mod events_and_deletion;
mod faults;
mod kubeconfig;
mod kubectl;
mod list;
mod list_source;
mod pods;
mod seeding;
mod tokenreview;
mod watch;
