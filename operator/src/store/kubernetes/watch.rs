//! The watch of census's own Identity objects, into the index.
//!
//! Objects are read as `DynamicObject`s and parsed one by one, so a malformed object
//! is reported (and its id blocked), never a failed list. A restart of the watch
//! (`Init`, `InitApply`..., `InitDone`) becomes one reset of the index, which forgets
//! what disappeared while the watch was down.

use std::sync::Arc;

use futures::StreamExt;
use kube::runtime::{WatchStreamExt, watcher};
use tracing::{debug, warn};

use super::{PAGE, Shared, index::Source, object};

pub(super) async fn run(shared: Arc<Shared>) {
    let config = watcher::Config::default().page_size(PAGE);
    let stream = watcher(shared.reads.clone(), config).default_backoff();
    let mut stream = std::pin::pin!(stream);
    // Objects of a (re-)list, applied together at its end.
    let mut listing: Option<(Vec<object::Parsed>, Vec<String>)> = None;
    while let Some(event) = stream.next().await {
        let limits = &shared.cfg.limits;
        let events = match event {
            Ok(watcher::Event::Init) => {
                listing = Some((Vec::new(), Vec::new()));
                continue;
            }
            Ok(watcher::Event::InitApply(obj)) => {
                let (parsed, bad) = listing.get_or_insert_with(Default::default);
                match object::parse(&obj, limits) {
                    Ok(p) => parsed.push(p),
                    Err(e) => {
                        warn!("{e}; skipped");
                        bad.push(e.name);
                    }
                }
                continue;
            }
            Ok(watcher::Event::InitDone) => {
                let (parsed, bad) = listing.take().unwrap_or_default();
                debug!(objects = parsed.len(), "listed the Identity objects");
                let events = shared.index.write().reset(parsed, bad);
                shared.synced.send_replace(true);
                events
            }
            Ok(watcher::Event::Apply(obj)) => match object::parse(&obj, limits) {
                Ok(p) => shared.index.write().apply(p, Source::Observed),
                Err(e) => {
                    if shared.index.write().bad_name(&e.name, true) {
                        warn!("{e}; skipped");
                    }
                    Vec::new()
                }
            },
            Ok(watcher::Event::Delete(obj)) => match object::parse(&obj, limits) {
                Ok(p) => shared
                    .index
                    .write()
                    .delete(p.id, Some(&p.meta.uid), Source::Observed),
                Err(e) => {
                    shared.index.write().bad_name(&e.name, false);
                    Vec::new()
                }
            },
            Err(e) => {
                warn!(error = %e, "the watch of Identity objects failed; it resumes with backoff");
                continue;
            }
        };
        shared.emit(events).await;
    }
}
