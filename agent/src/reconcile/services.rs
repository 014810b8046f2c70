//! SERVICES: the cluster's Service address ranges and their kinds. It is written
//! range by range as the operator's set changes, only where it differs from what
//! this agent wrote; the full pass compares it with the set and repairs every
//! difference, once the operator has given a set (until then a previous run's
//! entries stay).

use std::collections::BTreeMap;

use census_proto::domain::{ServiceKind, ServiceSet};
use ipnet::IpNet;
use tracing::{debug, warn};

use super::{PassReport, Reconciler};
use crate::{
    agent_core::Desired,
    bpf::{self, Datapath},
};

const SERVICES: &str = "SERVICES";

/// SERVICES as reconcile drives it.
pub(crate) trait ServicesPort {
    /// Every entry census writes, by range.
    fn read_services(&self) -> Result<BTreeMap<IpNet, ServiceKind>, bpf::Error>;
    /// Writes (creates or replaces) the entry of `range`.
    fn write_service(&mut self, range: IpNet, kind: ServiceKind) -> Result<(), bpf::Error>;
    /// Removes the entry of `range`; `false` if there was none.
    fn delete_service(&mut self, range: IpNet) -> Result<bool, bpf::Error>;
}

impl ServicesPort for Datapath {
    fn read_services(&self) -> Result<BTreeMap<IpNet, ServiceKind>, bpf::Error> {
        self.services()
    }

    fn write_service(&mut self, range: IpNet, kind: ServiceKind) -> Result<(), bpf::Error> {
        self.upsert_service(range, kind)
    }

    fn delete_service(&mut self, range: IpNet) -> Result<bool, bpf::Error> {
        Datapath::delete_service(self, range)
    }
}

/// What SERVICES holds (a previous run's, at start), for the core: in force until
/// the operator's first set. Empty if it cannot be read.
pub(crate) fn pinned_services<M: ServicesPort + ?Sized>(maps: &M) -> ServiceSet {
    match maps.read_services() {
        Ok(found) => found.into_iter().collect(),
        Err(error) => {
            warn!(%error, "cannot read SERVICES at start");
            ServiceSet::new()
        }
    }
}

impl Reconciler {
    /// Brings each SERVICES entry of `changes` to what it should be (`None`: no
    /// entry), writing only what differs from what this agent wrote; the failures.
    pub(crate) fn apply_services<M: ServicesPort + ?Sized>(
        &mut self,
        maps: &mut M,
        changes: &BTreeMap<IpNet, Option<ServiceKind>>,
    ) -> Vec<(IpNet, bpf::Error)> {
        let mut failures = Vec::new();
        for (range, want) in changes {
            match want {
                Some(kind) if self.services.get(range) == Some(kind) => {}
                Some(kind) => match maps.write_service(*range, *kind) {
                    Ok(()) => {
                        self.services.insert(*range, *kind);
                    }
                    Err(error) => {
                        self.services.remove(range);
                        failures.push((*range, self.write_failed(SERVICES, error)));
                    }
                },
                // An entry this agent did not write may be a previous run's.
                None => match maps.delete_service(*range) {
                    Ok(_) => {
                        self.services.remove(range);
                    }
                    Err(error) => failures.push((*range, self.write_failed(SERVICES, error))),
                },
            }
        }
        failures
    }

    /// SERVICES entries written by this agent.
    #[cfg(test)]
    pub(super) fn written_services(&self) -> &BTreeMap<IpNet, ServiceKind> {
        &self.services
    }

    /// Brings SERVICES to the operator's set: writes what it lacks or holds
    /// otherwise, removes what the set does not name. Nothing before the operator
    /// has given a set.
    pub(super) fn repair_services<M: ServicesPort + ?Sized>(
        &mut self,
        maps: &mut M,
        desired: &Desired,
        report: &mut PassReport,
    ) {
        let Some(want) = &desired.services else {
            return;
        };
        let actual = match maps.read_services() {
            Ok(actual) => actual,
            Err(error) => {
                warn!(%error, "cannot read SERVICES; the full pass skips it");
                self.write_failed(SERVICES, error);
                return;
            }
        };
        for (range, kind) in want.iter() {
            let have = actual.get(&range).copied();
            if have == Some(kind) {
                self.services.insert(range, kind);
                continue;
            }
            let repair = self.services.get(&range) == Some(&kind);
            match maps.write_service(range, kind) {
                Ok(()) => {
                    if repair {
                        warn!(%range, found = ?have, wanted = %kind, "repaired a SERVICES entry changed behind the agent's back");
                        report.repaired += 1;
                        self.metrics.map_repairs.inc();
                    } else {
                        report.written += 1;
                    }
                    self.services.insert(range, kind);
                }
                Err(error) => {
                    self.services.remove(&range);
                    let error = self.write_failed(SERVICES, error);
                    warn!(%range, %error, "writing SERVICES failed");
                    report.service_errors.push((range, error));
                }
            }
        }
        for range in actual.keys().filter(|range| want.get(range).is_none()) {
            match maps.delete_service(*range) {
                Ok(_) => {
                    debug!(%range, "removed a SERVICES entry nothing wants");
                    report.removed += 1;
                    self.metrics.map_removals.inc();
                }
                Err(error) => {
                    let error = self.write_failed(SERVICES, error);
                    warn!(%range, %error, "cannot remove a SERVICES entry nothing wants");
                    report.service_errors.push((*range, error));
                }
            }
        }
        self.services.retain(|range, _| want.get(range).is_some());
    }
}
