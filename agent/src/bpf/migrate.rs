//! Taking over the ENDPOINTS of an older layout ([`MIGRATES_FROM`]): its map
//! flags, size and value changed in layout 4, and a map's shape cannot change, so
//! a new ENDPOINTS is created and every entry copied into it, converted.
//!
//! The steps, each of which an agent killed at any point finishes or redoes at its
//! next start (it holds the pin lock throughout, so nothing else writes):
//!
//! 1. The old ENDPOINTS pin is renamed `ENDPOINTS-layout<N>` ([`source_pin`]); the
//!    layout map still says the old layout.
//! 2. The object is loaded: ENDPOINTS is missing, so the loader creates and pins a
//!    new one, empty; NODES is created beside it; FLOWS, INTERFACES and STATS are
//!    reused as they are.
//! 3. Every entry of the old map is copied into the new one.
//! 4. The layout map is stamped with this layout: from now on the new ENDPOINTS
//!    is the truth.
//! 5. The old map's pin is removed.
//!
//! Killed before 4, the next start finds the old map still pinned aside and the
//! old layout recorded: it drops the new map (a partial copy) and starts again at
//! 2. Killed between 4 and 5, it finds this layout recorded: the copy is complete,
//! and it only removes the old pin. The programs still attached from the old
//! agent keep reading the old map (it lives while they hold it) until the new
//! agent attaches its own in their place.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use aya::maps::{HashMap, MapData, MapInfo};
use census_common::{ENDPOINTS_MAP, EndpointKey, EndpointValue, MIGRATES_FROM};

use super::{
    Error,
    maps::{EndpointsMap, full_or, is_not_found},
    pins::{self, Layout, Pins},
};

/// ENDPOINTS of layouts 2 and 3: `identity: u32, flags: u32`.
type OldEndpointsMap = HashMap<MapData, EndpointKey, [u32; 2]>;

/// Where the ENDPOINTS of layout `from` waits while it is copied (bpffs refuses
/// names with a dot).
pub(super) fn source_pin(pins: &Pins, from: u32) -> PathBuf {
    pins.map(&format!("{ENDPOINTS_MAP}-layout{from}"))
}

/// The old ENDPOINTS pins a migration may have left beside the maps, any layout.
fn leftovers(pins: &Pins) -> Vec<(u32, PathBuf)> {
    MIGRATES_FROM
        .iter()
        .map(|&from| (from, source_pin(pins, from)))
        .filter(|(_, path)| path.exists())
        .collect()
}

/// A migration of ENDPOINTS under way: the old map's pin, set aside.
#[derive(Debug)]
pub(super) struct Migration {
    pub(super) from: u32,
    source: PathBuf,
    pin_dir: PathBuf,
}

/// Before the object is loaded: sets the old ENDPOINTS aside if `layout` is an
/// older one (step 1, or the restart of a migration killed before it completed),
/// or removes what a completed migration left.
pub(super) fn prepare(pins: &Pins, layout: Layout) -> Result<Option<Migration>, Error> {
    let Layout::Older(from) = layout else {
        // This layout is recorded: any copy was completed.
        for (from, path) in leftovers(pins) {
            remove_pin(&path)?;
            tracing::info!(
                pin = %path.display(),
                from,
                "removed the ENDPOINTS of layout {from} left by a completed migration"
            );
        }
        return Ok(None);
    };
    let source = source_pin(pins, from);
    let endpoints = pins.map(ENDPOINTS_MAP);
    let step = |step, source: Error| Error::Migration {
        map: ENDPOINTS_MAP,
        pin_dir: pins.dir().to_owned(),
        from,
        step,
        source: Box::new(source),
    };
    if source.exists() {
        check_old_shape(&source).map_err(|e| step("checking the ENDPOINTS set aside", e))?;
        if endpoints.exists() {
            // A copy that did not complete: start it again from the old map.
            remove_pin(&endpoints).map_err(|e| step("removing a partial copy", e))?;
            tracing::warn!(
                pin_dir = %pins.dir().display(),
                from,
                "a migration of ENDPOINTS did not complete: copying again"
            );
        }
    } else if endpoints.exists() {
        let info = MapInfo::from_pin(&endpoints).map_err(|source| Error::Map {
            map: ENDPOINTS_MAP,
            source,
        })?;
        if pins::shape_of(&info) != pins::old_endpoints_shape() {
            // Not the old map, and no old map aside: nothing to copy.
            return Ok(None);
        }
        fs::rename(&endpoints, &source).map_err(|error| {
            step(
                "setting the old ENDPOINTS aside",
                Error::Io {
                    operation: "renaming pin",
                    path: endpoints.clone(),
                    source: error,
                },
            )
        })?;
    } else {
        return Ok(None);
    }
    Ok(Some(Migration {
        from,
        source,
        pin_dir: pins.dir().to_owned(),
    }))
}

fn check_old_shape(path: &Path) -> Result<(), Error> {
    let info = MapInfo::from_pin(path).map_err(|source| Error::Map {
        map: ENDPOINTS_MAP,
        source,
    })?;
    let found = pins::shape_of(&info);
    let expected = pins::old_endpoints_shape();
    if found != expected {
        return Err(Error::PinnedMapMismatch {
            path: path.to_owned(),
            layout: census_common::LAYOUT_VERSION,
            expected,
            found,
        });
    }
    Ok(())
}

impl Migration {
    /// Step 3: copies every entry of the old map into `endpoints`, converted; how
    /// many.
    pub(super) fn copy_into(
        &self,
        endpoints: &mut EndpointsMap,
        max_entries: u32,
    ) -> Result<u64, Error> {
        let step = |step, source: Error| Error::Migration {
            map: ENDPOINTS_MAP,
            pin_dir: self.pin_dir.clone(),
            from: self.from,
            step,
            source: Box::new(source),
        };
        let map_error = |source| Error::Map {
            map: ENDPOINTS_MAP,
            source,
        };
        let old: OldEndpointsMap = MapData::from_pin(&self.source)
            .and_then(|data| OldEndpointsMap::try_from(aya::maps::Map::HashMap(data)))
            .map_err(|e| step("opening the ENDPOINTS set aside", map_error(e)))?;
        let mut copied = 0;
        for entry in old.iter() {
            let (key, [identity, flags]) = match entry {
                Ok(entry) => entry,
                Err(error) if is_not_found(&error) => continue,
                Err(error) => return Err(step("reading the old ENDPOINTS", map_error(error))),
            };
            let value = EndpointValue::from_layout3(identity, flags);
            endpoints.insert(key, value, 0).map_err(|source| {
                let error = full_or(
                    source,
                    ENDPOINTS_MAP,
                    max_entries,
                    "endpoints-max-entries",
                    || {
                        key.ip()
                            .map_or_else(|| format!("{key:?}"), |ip| ip.to_string())
                    },
                );
                step("copying into the new ENDPOINTS", error)
            })?;
            copied += 1;
        }
        Ok(copied)
    }

    /// Step 5, once the layout map says this layout: removes the old map's pin.
    pub(super) fn finish(self) -> Result<(), Error> {
        remove_pin(&self.source)
    }
}

/// Removes the pin at `path`; nothing if it is gone already.
pub(super) fn remove_pin(path: &Path) -> Result<(), Error> {
    match fs::remove_file(path) {
        Err(error) if error.kind() != io::ErrorKind::NotFound => Err(Error::Io {
            operation: "removing pin",
            path: path.to_owned(),
            source: error,
        }),
        _ => Ok(()),
    }
}
