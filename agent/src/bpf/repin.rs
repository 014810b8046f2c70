//! Putting the pins back when they are removed under a running agent
//! (`census-agent uninstall`, or someone deleting the pin directory): the agent
//! still holds every map, so their entries and counters are intact; only the
//! pins (and the links, which the full pass attaches again) are gone.

use super::{Datapath, Error, lock::PinLock, privileges};

/// What [`Datapath::ensure_pinned`] put back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Repinned {
    /// The pin directory was created again (and locked again).
    pub directory: bool,
    /// Maps pinned again.
    pub maps: usize,
}

impl Repinned {
    pub fn is_empty(&self) -> bool {
        !self.directory && self.maps == 0
    }
}

impl Datapath {
    /// Makes sure the pin directory, its `links/` and every map pin exist, pinning
    /// again what was removed (the maps this agent holds, with their content), and
    /// holds the lock of the directory now there. Fails when they cannot be put
    /// back: no bpffs there any more, or another agent took the new directory.
    pub fn ensure_pinned(&mut self) -> Result<Repinned, Error> {
        let mut done = Repinned::default();
        let dir = self.pins.dir().to_owned();
        if !dir.exists() || !self.lock.is_on(&dir) {
            privileges::ensure_bpffs(&dir)?;
            self.pins.create()?;
            self.lock = PinLock::acquire(&dir)?;
            done.directory = true;
        } else {
            self.pins.create()?;
        }
        for (name, data) in &self.pinned {
            let path = self.pins.map(name);
            if path.exists() {
                continue;
            }
            data.pin(&path).map_err(|source| Error::Repin {
                map: name,
                path: path.clone(),
                source,
            })?;
            done.maps += 1;
        }
        if !done.is_empty() {
            tracing::warn!(
                pin_dir = %dir.display(),
                maps = done.maps,
                "census's pins were removed under the running agent: pinned its maps again; the full pass attaches the programs again"
            );
        }
        Ok(done)
    }
}
