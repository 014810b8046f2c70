//! The watch of census's own Identity objects, into the index.
//!
//! Objects are read as `DynamicObject`s and parsed one by one, so a malformed object
//! is reported (and its id blocked), never a failed list. A list after a lost watch
//! (`census_daemon::watch`) becomes one reset of the index, which forgets what
//! disappeared while the watch was down.

use std::sync::Arc;

use kube::api::DynamicObject;
use tracing::{debug, warn};

use census_daemon::watch::{self, Watched};

use super::{Shared, index::Source, object};

pub(super) async fn run(shared: Arc<Shared>) {
    let api = shared.reads.clone();
    let identities = IdentityWatch {
        shared,
        listing: (Vec::new(), Vec::new()),
    };
    watch::drive(api, &watch::Config::default(), identities).await;
}

/// The Identity objects' watch, into the index; what it changes goes to the core.
struct IdentityWatch {
    shared: Arc<Shared>,
    /// Objects of a (re-)list, applied together at its end: the parsed, and the
    /// names of those that could not be.
    listing: (Vec<object::Parsed>, Vec<String>),
}

impl Watched<DynamicObject> for IdentityWatch {
    const WHAT: &'static str = "Identity objects";

    fn relist(&mut self) {
        self.listing = (Vec::new(), Vec::new());
    }

    fn list(&mut self, obj: DynamicObject) {
        let (parsed, bad) = &mut self.listing;
        match object::parse(&obj, &self.shared.cfg.limits) {
            Ok(p) => parsed.push(p),
            Err(e) => {
                warn!("{e}; skipped");
                bad.push(e.name);
            }
        }
    }

    async fn listed(&mut self) {
        let (parsed, bad) = std::mem::take(&mut self.listing);
        debug!(objects = parsed.len(), "listed the Identity objects");
        let events = self.shared.index.write().reset(parsed, bad);
        self.shared.synced.send_replace(true);
        self.shared.emit(events).await;
    }

    async fn apply(&mut self, obj: DynamicObject) {
        let events = match object::parse(&obj, &self.shared.cfg.limits) {
            Ok(p) => self.shared.index.write().apply(p, Source::Observed),
            Err(e) => {
                if self.shared.index.write().bad_name(&e.name, true) {
                    warn!("{e}; skipped");
                }
                Vec::new()
            }
        };
        self.shared.emit(events).await;
    }

    async fn delete(&mut self, obj: DynamicObject) {
        let events = match object::parse(&obj, &self.shared.cfg.limits) {
            Ok(p) => self
                .shared
                .index
                .write()
                .delete(p.id, Some(&p.meta.uid), Source::Observed),
            Err(e) => {
                self.shared.index.write().bad_name(&e.name, false);
                Vec::new()
            }
        };
        self.shared.emit(events).await;
    }
}
