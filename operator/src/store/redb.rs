//! The embedded store: one redb file, the default when census runs without a cluster.
//!
//! # Layout (schema version 1)
//!
//! | table        | key                      | value                                      |
//! |--------------|--------------------------|--------------------------------------------|
//! | `meta`       | `b"schema_version"`      | `u32`, little-endian (4 bytes)             |
//! | `identities` | id (`u32`)               | canonical label string (UTF-8 bytes)       |
//! | `labels`     | canonical label string   | id (`u32`): the unique index of identities |
//! | `nodes`      | node name (UTF-8 bytes)  | `()`                                       |
//! | `tombstones` | id (`u32`)               | labels hash, until (ms): 2 x `u64` LE      |
//!
//! Strings are stored as bytes and decoded here, so a damaged string is reported as
//! corruption instead of making redb panic. Every value is checked when the file is
//! opened (label strings with [`LabelSet::from_canonical`], the index against the
//! identities, value sizes).
//!
//! # Refusal never writes
//!
//! A writable redb open changes the file (its header records the open; a file left by
//! a crash is repaired). So an existing file is first checked without writing: through a
//! read-only open, or, for a file that needs recovery (which redb will not open
//! read-only), through a copy-on-write view ([`scratch`]). Only a file that passes is
//! opened for writing.

mod scratch;

use std::{
    fs::{self, File},
    io,
    panic::{self, AssertUnwindSafe},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
};

use ::redb::{
    Builder, Database, DatabaseError, Durability, ReadTransaction, ReadableDatabase, ReadableTable,
    ReadableTableMetadata, StorageError, Table, TableDefinition, TableError, TableHandle,
    WriteTransaction,
};
use census_proto::{
    domain::{IdentityId, NodeName},
    labels::{LabelLimits, LabelSet},
};

use self::scratch::Scratch;
use super::{
    BoxFuture, Loaded, Store, StoreError, StoreOp, StoredIdentity, Tombstone,
    memory::{View, Write, plan},
};

/// The schema version this build reads and writes.
pub const SCHEMA_VERSION: u32 = 1;

/// The default bound of redb's page cache.
pub const DEFAULT_CACHE_BYTES: usize = 16 * 1024 * 1024;

const META: TableDefinition<'static, &[u8], &[u8]> = TableDefinition::new("meta");
const SCHEMA_VERSION_KEY: &[u8] = b"schema_version";
const IDENTITIES: TableDefinition<'static, u32, &[u8]> = TableDefinition::new("identities");
const LABELS: TableDefinition<'static, &[u8], u32> = TableDefinition::new("labels");
const NODES: TableDefinition<'static, &[u8], ()> = TableDefinition::new("nodes");
const TOMBSTONES: TableDefinition<'static, u32, &[u8]> = TableDefinition::new("tombstones");
const TOMBSTONE_LEN: usize = 16;

/// How to open a [`RedbStore`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedbOptions {
    /// Memory redb may use to cache pages of the file.
    pub cache_bytes: usize,
    /// Limits label sets are checked against when the file is read. Generous on
    /// purpose: a stricter `--max-labels` must never make stored identities unreadable.
    pub load_limits: LabelLimits,
}

impl Default for RedbOptions {
    fn default() -> Self {
        Self {
            cache_bytes: DEFAULT_CACHE_BYTES,
            load_limits: LabelLimits { max_labels: 1024 },
        }
    }
}

/// The embedded store. Cheap to clone: clones share one open database.
#[derive(Debug, Clone)]
pub struct RedbStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    /// The path as error messages show it.
    shown: String,
    options: RedbOptions,
    /// `None` after a failed write: redb refuses writes until the file is reopened, which
    /// the next call does.
    db: Mutex<Option<Database>>,
}

impl RedbStore {
    /// Opens the store at `path`, creating the file (and its directory) if it does not
    /// exist. Refuses, without changing a byte of it, a file of another schema version
    /// ([`StoreError::Schema`]), one that is not a census store or whose contents do not
    /// decode ([`StoreError::Corrupt`]), and one it cannot open, e.g. because another
    /// process has it open ([`StoreError::Open`]).
    ///
    /// Blocking: reads the whole file once to check it.
    pub fn open(path: &Path, options: RedbOptions) -> Result<Self, StoreError> {
        let shown = path.display().to_string();
        let db = match fs::metadata(path) {
            Ok(meta) if meta.len() > 0 => {
                check_existing(path, &shown, &options)?;
                open_writable(path, &shown, &options, false)?
            }
            // An empty file holds nothing to lose (e.g. a crash right after creating it).
            Ok(_) => open_writable(path, &shown, &options, true)?,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                    fs::create_dir_all(parent).map_err(|err| StoreError::Open {
                        path: shown.clone(),
                        detail: format!("cannot create directory {}: {err}", parent.display()),
                    })?;
                }
                open_writable(path, &shown, &options, true)?
            }
            Err(err) => {
                return Err(StoreError::Open {
                    path: shown,
                    detail: err.to_string(),
                });
            }
        };
        init_or_check(&db, &shown).map_err(|err| at_open(err, &shown))?;
        tracing::debug!(path = %shown, cache_bytes = options.cache_bytes, "opened redb store");
        Ok(Self {
            inner: Arc::new(Inner {
                path: path.to_owned(),
                shown,
                options,
                db: Mutex::new(Some(db)),
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }
}

impl Store for RedbStore {
    fn load(&self) -> BoxFuture<'_, Result<Loaded, StoreError>> {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move {
            tokio::task::spawn_blocking(move || inner.load_blocking())
                .await
                .unwrap_or_else(|err| Err(task_failed(&err)))
        })
    }

    fn apply(&self, ops: Vec<StoreOp>) -> BoxFuture<'_, Vec<Result<(), StoreError>>> {
        let inner = Arc::clone(&self.inner);
        Box::pin(async move {
            if ops.is_empty() {
                return Vec::new();
            }
            let count = ops.len();
            tokio::task::spawn_blocking(move || inner.apply_blocking(&ops))
                .await
                .unwrap_or_else(|err| vec![Err(task_failed(&err)); count])
        })
    }

    fn kind(&self) -> &'static str {
        "redb"
    }
}

fn task_failed(err: &tokio::task::JoinError) -> StoreError {
    StoreError::Unavailable {
        cause: "panic",
        detail: format!("the redb task failed: {err}"),
    }
}

impl Inner {
    fn lock_db(&self) -> MutexGuard<'_, Option<Database>> {
        match self.db.lock() {
            Ok(guard) => guard,
            Err(poisoned) => {
                // A panic in the middle of a write: do not trust the handle, reopen.
                let mut guard = poisoned.into_inner();
                *guard = None;
                self.db.clear_poison();
                guard
            }
        }
    }

    /// The open database, reopening it after a failed write.
    fn database<'g>(&self, guard: &'g mut Option<Database>) -> Result<&'g Database, StoreError> {
        let db = match guard.take() {
            Some(db) => db,
            None => {
                let db = open_writable(&self.path, &self.shown, &self.options, false)
                    .map_err(unavailable_now)?;
                init_or_check(&db, &self.shown)?;
                tracing::info!(path = %self.shown, "reopened redb store");
                db
            }
        };
        Ok(guard.insert(db))
    }

    fn load_blocking(&self) -> Result<Loaded, StoreError> {
        let mut guard = self.lock_db();
        let db = self.database(&mut guard)?;
        let txn = db.begin_read().map_err(|err| io_error(&err))?;
        Ok(read_all(&txn, &self.shown, &self.options.load_limits)?.unwrap_or_default())
    }

    fn apply_blocking(&self, ops: &[StoreOp]) -> Vec<Result<(), StoreError>> {
        let mut guard = self.lock_db();
        let outcome = self
            .database(&mut guard)
            .and_then(|db| write_batch(db, ops, &self.shown));
        match outcome {
            Ok(results) => results,
            Err(err) => {
                tracing::warn!(
                    path = %self.shown,
                    ops = ops.len(),
                    error = %err,
                    "redb write failed; reopening"
                );
                *guard = None;
                vec![Err(err); ops.len()]
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Opening
// ---------------------------------------------------------------------------------------

fn builder(options: &RedbOptions) -> Builder {
    let mut builder = Builder::new();
    builder.set_cache_size(options.cache_bytes);
    builder
}

fn open_writable(
    path: &Path,
    shown: &str,
    options: &RedbOptions,
    create: bool,
) -> Result<Database, StoreError> {
    let builder = builder(options);
    let db = if create {
        builder.create(path)
    } else {
        builder.open(path)
    };
    db.map_err(|err| open_failure(shown, err))
}

/// Checks an existing file without writing to it.
fn check_existing(path: &Path, shown: &str, options: &RedbOptions) -> Result<(), StoreError> {
    let check = || -> Result<(), StoreError> {
        match builder(options).open_read_only(path) {
            Ok(db) => check_contents(&db, shown, &options.load_limits),
            Err(DatabaseError::RepairAborted) => {
                // Left by a crash. Recover a copy-on-write view of it and check that.
                tracing::info!(
                    path = %shown,
                    "store was not closed cleanly; checking a recovered view before repairing it"
                );
                let scratch =
                    File::open(path)
                        .and_then(Scratch::new)
                        .map_err(|err| StoreError::Open {
                            path: shown.to_owned(),
                            detail: err.to_string(),
                        })?;
                let db = builder(options)
                    .create_with_backend(scratch)
                    .map_err(|err| open_failure(shown, err))?;
                check_contents(&db, shown, &options.load_limits)
            }
            Err(err) => Err(open_failure(shown, err)),
        }
    };
    // redb may panic on a file altered behind its back rather than return an error.
    match panic::catch_unwind(AssertUnwindSafe(check)) {
        Ok(result) => result.map_err(|err| at_open(err, shown)),
        Err(panic) => Err(StoreError::Corrupt {
            path: shown.to_owned(),
            detail: format!("redb failed reading it: {}", panic_message(panic.as_ref())),
        }),
    }
}

fn check_contents(
    db: &impl ReadableDatabase,
    shown: &str,
    limits: &LabelLimits,
) -> Result<(), StoreError> {
    let txn = db.begin_read().map_err(|err| io_error(&err))?;
    read_all(&txn, shown, limits).map(|_| ())
}

/// Writes the schema version into a database without tables; checks it otherwise.
fn init_or_check(db: &Database, shown: &str) -> Result<(), StoreError> {
    let found = {
        let txn = db.begin_read().map_err(|err| io_error(&err))?;
        schema_version(&txn, shown)?
    };
    match found {
        Some(SCHEMA_VERSION) => Ok(()),
        Some(found) => Err(StoreError::Schema {
            path: shown.to_owned(),
            found,
            supported: SCHEMA_VERSION,
        }),
        None => {
            let txn = db.begin_write().map_err(|err| io_error(&err))?;
            let created = (|| -> Result<(), StorageError> {
                txn.open_table(META)
                    .map_err(storage_of)?
                    .insert(SCHEMA_VERSION_KEY, &SCHEMA_VERSION.to_le_bytes()[..])?;
                txn.open_table(IDENTITIES).map_err(storage_of)?;
                txn.open_table(LABELS).map_err(storage_of)?;
                txn.open_table(NODES).map_err(storage_of)?;
                txn.open_table(TOMBSTONES).map_err(storage_of)?;
                Ok(())
            })();
            created.map_err(|err| storage_error(shown, err))?;
            txn.commit().map_err(|err| io_error(&err))?;
            tracing::info!(path = %shown, version = SCHEMA_VERSION, "initialized redb store");
            Ok(())
        }
    }
}

fn storage_of(err: TableError) -> StorageError {
    match err {
        TableError::Storage(err) => err,
        other => StorageError::Corrupted(other.to_string()),
    }
}

/// Errors of a writable or read-only open.
fn open_failure(shown: &str, err: DatabaseError) -> StoreError {
    let open = |detail: String| StoreError::Open {
        path: shown.to_owned(),
        detail,
    };
    let corrupt = |detail: String| StoreError::Corrupt {
        path: shown.to_owned(),
        detail,
    };
    match err {
        DatabaseError::DatabaseAlreadyOpen => open(
            "it is already open, by another process or another handle in this one \
             (one operator per file)"
                .to_owned(),
        ),
        DatabaseError::UpgradeRequired(version) => open(format!(
            "it uses redb file format {version}, which this build cannot read"
        )),
        DatabaseError::Storage(StorageError::Corrupted(detail)) => {
            corrupt(format!("not a readable redb database: {detail}"))
        }
        // redb reports a file that is not a database (wrong magic number) as invalid data.
        DatabaseError::Storage(StorageError::Io(err)) => match err.kind() {
            io::ErrorKind::InvalidData => corrupt(err.to_string()),
            io::ErrorKind::UnexpectedEof => {
                corrupt("not a redb database: the file is too short".to_owned())
            }
            _ => open(format!("I/O error: {err}")),
        },
        other => open(other.to_string()),
    }
}

/// At open, a store that cannot be read is one that cannot be opened.
fn at_open(err: StoreError, shown: &str) -> StoreError {
    match err {
        StoreError::Unavailable { detail, .. } => StoreError::Open {
            path: shown.to_owned(),
            detail,
        },
        other => other,
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic")
}

// ---------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------

fn io_error(err: &impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable {
        cause: "io",
        detail: err.to_string(),
    }
}

fn unavailable_now(err: StoreError) -> StoreError {
    match err {
        StoreError::Open { detail, .. } => StoreError::Unavailable {
            cause: "io",
            detail,
        },
        other => other,
    }
}

fn storage_error(shown: &str, err: StorageError) -> StoreError {
    match err {
        StorageError::Corrupted(detail) => StoreError::Corrupt {
            path: shown.to_owned(),
            detail,
        },
        other => io_error(&other),
    }
}

fn open_read<K: ::redb::Key + 'static, V: ::redb::Value + 'static>(
    txn: &ReadTransaction,
    table: TableDefinition<'_, K, V>,
    shown: &str,
) -> Result<::redb::ReadOnlyTable<K, V>, StoreError> {
    let name = table.name().to_owned();
    txn.open_table(table)
        .map_err(|err| table_error(shown, &name, err))
}

fn table_error(shown: &str, name: &str, err: TableError) -> StoreError {
    match err {
        TableError::Storage(err) => storage_error(shown, err),
        TableError::TableDoesNotExist(_) => StoreError::Corrupt {
            path: shown.to_owned(),
            detail: format!("table `{name}` is missing"),
        },
        other => StoreError::Corrupt {
            path: shown.to_owned(),
            detail: format!("table `{name}`: {other}"),
        },
    }
}

/// The schema version, or `None` for a database without any table (new).
fn schema_version(txn: &ReadTransaction, shown: &str) -> Result<Option<u32>, StoreError> {
    let storage = |err| storage_error(shown, err);
    let empty = txn.list_tables().map_err(storage)?.next().is_none()
        && txn
            .list_multimap_tables()
            .map_err(storage)?
            .next()
            .is_none();
    if empty {
        return Ok(None);
    }
    let corrupt = |detail: String| StoreError::Corrupt {
        path: shown.to_owned(),
        detail,
    };
    let meta = match txn.open_table(META) {
        Ok(meta) => meta,
        Err(TableError::TableDoesNotExist(_)) => {
            return Err(corrupt(
                "it has no `meta` table: not a census store".to_owned(),
            ));
        }
        Err(err) => return Err(table_error(shown, META.name(), err)),
    };
    let raw = meta
        .get(SCHEMA_VERSION_KEY)
        .map_err(storage)?
        .ok_or_else(|| corrupt("its `meta` table has no schema version".to_owned()))?;
    let bytes: [u8; 4] = raw.value().try_into().map_err(|_| {
        corrupt(format!(
            "its schema version has {} bytes, expected 4",
            raw.value().len()
        ))
    })?;
    Ok(Some(u32::from_le_bytes(bytes)))
}

/// Reads and checks everything; `None` for a database without any table.
fn read_all(
    txn: &ReadTransaction,
    shown: &str,
    limits: &LabelLimits,
) -> Result<Option<Loaded>, StoreError> {
    match schema_version(txn, shown)? {
        None => return Ok(None),
        Some(SCHEMA_VERSION) => {}
        Some(found) => {
            return Err(StoreError::Schema {
                path: shown.to_owned(),
                found,
                supported: SCHEMA_VERSION,
            });
        }
    }
    let storage = |err| storage_error(shown, err);
    let corrupt = |detail: String| StoreError::Corrupt {
        path: shown.to_owned(),
        detail,
    };

    let mut identities = Vec::new();
    for entry in open_read(txn, IDENTITIES, shown)?.iter().map_err(storage)? {
        let (key, value) = entry.map_err(storage)?;
        let id = IdentityId::new(key.value())
            .ok_or_else(|| corrupt("identity 0 is stored; 0 is not an id".to_owned()))?;
        let text = std::str::from_utf8(value.value()).map_err(|err| {
            corrupt(format!(
                "identity {id}: its label string is not UTF-8 ({err})"
            ))
        })?;
        let labels = LabelSet::from_canonical(text, limits)
            .map_err(|err| corrupt(format!("identity {id}: its labels do not decode: {err}")))?;
        identities.push(StoredIdentity { id, labels });
    }

    let index = open_read(txn, LABELS, shown)?;
    for identity in &identities {
        match index
            .get(identity.labels.as_str().as_bytes())
            .map_err(storage)?
        {
            Some(bound) if bound.value() == identity.id.get() => {}
            Some(bound) => {
                return Err(corrupt(format!(
                    "identity {}: the label index binds its labels to identity {}",
                    identity.id,
                    bound.value()
                )));
            }
            None => {
                return Err(corrupt(format!(
                    "identity {}: its labels are missing from the label index",
                    identity.id
                )));
            }
        }
    }
    let indexed = index.len().map_err(storage)?;
    if indexed != identities.len() as u64 {
        return Err(corrupt(format!(
            "the label index has {indexed} entries for {} identities",
            identities.len()
        )));
    }

    let mut nodes = Vec::new();
    for entry in open_read(txn, NODES, shown)?.iter().map_err(storage)? {
        let (key, _) = entry.map_err(storage)?;
        let name = std::str::from_utf8(key.value())
            .map_err(|err| corrupt(format!("a node name is not UTF-8 ({err})")))
            .and_then(|text| NodeName::new(text).map_err(|err| corrupt(err.to_string())))?;
        nodes.push(name);
    }

    let mut tombstones = Vec::new();
    for entry in open_read(txn, TOMBSTONES, shown)?.iter().map_err(storage)? {
        let (key, value) = entry.map_err(storage)?;
        let id = IdentityId::new(key.value())
            .ok_or_else(|| corrupt("a tombstone of identity 0 is stored".to_owned()))?;
        let tombstone = decode_tombstone(id, value.value()).ok_or_else(|| {
            corrupt(format!(
                "tombstone of identity {id}: {} bytes, expected {TOMBSTONE_LEN}",
                value.value().len()
            ))
        })?;
        tombstones.push(tombstone);
    }

    Ok(Some(Loaded {
        identities,
        nodes,
        tombstones,
    }))
}

fn encode_tombstone(tombstone: &Tombstone) -> [u8; TOMBSTONE_LEN] {
    let mut out = [0; TOMBSTONE_LEN];
    out[..8].copy_from_slice(&tombstone.labels_hash.to_le_bytes());
    out[8..].copy_from_slice(&tombstone.until_ms.to_le_bytes());
    out
}

fn decode_tombstone(id: IdentityId, bytes: &[u8]) -> Option<Tombstone> {
    let bytes: &[u8; TOMBSTONE_LEN] = bytes.try_into().ok()?;
    let (hash, until) = bytes.split_at(8);
    Some(Tombstone {
        id,
        labels_hash: u64::from_le_bytes(hash.try_into().ok()?),
        until_ms: u64::from_le_bytes(until.try_into().ok()?),
    })
}

// ---------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------

/// The tables of one write transaction.
struct Tables<'txn> {
    shown: &'txn str,
    identities: Table<'txn, u32, &'static [u8]>,
    labels: Table<'txn, &'static [u8], u32>,
    nodes: Table<'txn, &'static [u8], ()>,
    tombstones: Table<'txn, u32, &'static [u8]>,
}

impl<'txn> Tables<'txn> {
    fn open(txn: &'txn WriteTransaction, shown: &'txn str) -> Result<Self, StoreError> {
        let table_error = |err: TableError| storage_error(shown, storage_of(err));
        Ok(Self {
            shown,
            identities: txn.open_table(IDENTITIES).map_err(table_error)?,
            labels: txn.open_table(LABELS).map_err(table_error)?,
            nodes: txn.open_table(NODES).map_err(table_error)?,
            tombstones: txn.open_table(TOMBSTONES).map_err(table_error)?,
        })
    }

    fn write(&mut self, write: &Write<'_>) -> Result<(), StorageError> {
        match *write {
            Write::PutIdentity { id, labels } => {
                self.identities
                    .insert(id.get(), labels.as_str().as_bytes())?;
                self.labels.insert(labels.as_str().as_bytes(), id.get())?;
            }
            Write::RemoveIdentity { id, labels } => {
                self.identities.remove(id.get())?;
                self.labels.remove(labels.as_str().as_bytes())?;
            }
            Write::PutTombstone { id, tombstone } => {
                self.tombstones
                    .insert(id.get(), &encode_tombstone(tombstone)[..])?;
            }
            Write::RemoveTombstone { id } => {
                self.tombstones.remove(id.get())?;
            }
            Write::PutNode { node } => {
                self.nodes.insert(node.as_str().as_bytes(), ())?;
            }
            Write::RemoveNode { node } => {
                self.nodes.remove(node.as_str().as_bytes())?;
            }
        }
        Ok(())
    }
}

impl View for Tables<'_> {
    fn labels_of(&self, id: IdentityId) -> Result<Option<String>, StoreError> {
        let found = self
            .identities
            .get(id.get())
            .map_err(|err| storage_error(self.shown, err))?;
        Ok(found.map(|labels| String::from_utf8_lossy(labels.value()).into_owned()))
    }

    fn id_of(&self, labels: &LabelSet) -> Result<Option<IdentityId>, StoreError> {
        let found = self
            .labels
            .get(labels.as_str().as_bytes())
            .map_err(|err| storage_error(self.shown, err))?;
        found
            .map(|id| {
                IdentityId::new(id.value()).ok_or_else(|| StoreError::Corrupt {
                    path: self.shown.to_owned(),
                    detail: format!("the label index binds {labels} to identity 0"),
                })
            })
            .transpose()
    }
}

/// Applies `ops` in one durable transaction. `Err` if the batch as a whole failed (then
/// nothing of it was committed, or the outcome is unknown).
fn write_batch(
    db: &Database,
    ops: &[StoreOp],
    shown: &str,
) -> Result<Vec<Result<(), StoreError>>, StoreError> {
    let mut txn = db.begin_write().map_err(|err| io_error(&err))?;
    txn.set_durability(Durability::Immediate)
        .map_err(|err| io_error(&err))?;
    let results = match apply_ops(&txn, ops, shown) {
        Ok(results) => results,
        Err(err) => {
            if let Err(abort) = txn.abort() {
                tracing::warn!(
                    path = %shown,
                    error = %abort,
                    "aborting a failed redb transaction failed"
                );
            }
            return Err(err);
        }
    };
    txn.commit().map_err(|err| io_error(&err))?;
    Ok(results)
}

fn apply_ops(
    txn: &WriteTransaction,
    ops: &[StoreOp],
    shown: &str,
) -> Result<Vec<Result<(), StoreError>>, StoreError> {
    let mut tables = Tables::open(txn, shown)?;
    let mut results = Vec::with_capacity(ops.len());
    for op in ops {
        match plan(op, &tables) {
            Ok(writes) => {
                for write in &writes {
                    // A write that fails fails the whole transaction, so no op is left
                    // half-written.
                    tables
                        .write(write)
                        .map_err(|err| storage_error(shown, err))?;
                }
                results.push(Ok(()));
            }
            Err(err @ StoreError::Conflict { .. }) => results.push(Err(err)),
            Err(err) => return Err(err),
        }
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use ::redb::{StorageBackend, backends::InMemoryBackend};

    use super::*;

    /// A database in memory whose writes fail while `failing` is set.
    #[derive(Debug)]
    struct Flaky {
        inner: InMemoryBackend,
        failing: Arc<AtomicBool>,
    }

    impl Flaky {
        fn check(&self) -> io::Result<()> {
            if self.failing.load(Ordering::SeqCst) {
                return Err(io::Error::other("injected write failure"));
            }
            Ok(())
        }
    }

    impl StorageBackend for Flaky {
        fn len(&self) -> io::Result<u64> {
            self.inner.len()
        }

        fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
            self.inner.read(offset, out)
        }

        fn set_len(&self, len: u64) -> io::Result<()> {
            self.check()?;
            self.inner.set_len(len)
        }

        fn sync_data(&self) -> io::Result<()> {
            self.check()?;
            self.inner.sync_data()
        }

        fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
            self.check()?;
            self.inner.write(offset, data)
        }
    }

    fn op(n: u32) -> Result<StoreOp, Box<dyn std::error::Error>> {
        let id = IdentityId::new(n).ok_or("id 0")?;
        let labels = LabelSet::parse([format!("k8s:app=a{n}")], &LabelLimits::default())?;
        Ok(StoreOp::CreateIdentity { id, labels })
    }

    #[test]
    fn a_failed_commit_fails_every_op_and_reopens() -> Result<(), Box<dyn std::error::Error>> {
        let failing = Arc::new(AtomicBool::new(false));
        let backend = Flaky {
            inner: InMemoryBackend::new(),
            failing: Arc::clone(&failing),
        };
        let db = Builder::new().create_with_backend(backend)?;
        init_or_check(&db, "memory")?;
        let dir = tempfile::tempdir()?;
        let inner = Inner {
            // Nothing there: the reopen after the failure fails too, transiently.
            path: dir.path().join("missing.redb"),
            shown: "memory".to_owned(),
            options: RedbOptions::default(),
            db: Mutex::new(Some(db)),
        };
        assert_eq!(inner.apply_blocking(&[op(300)?]), vec![Ok(())]);

        failing.store(true, Ordering::SeqCst);
        let results = inner.apply_blocking(&[op(301)?, op(302)?]);
        assert_eq!(results.len(), 2);
        for result in results {
            assert!(
                matches!(result, Err(StoreError::Unavailable { cause: "io", .. })),
                "{result:?}"
            );
        }
        assert!(inner.lock_db().is_none(), "the failed handle is dropped");

        failing.store(false, Ordering::SeqCst);
        let results = inner.apply_blocking(&[op(303)?]);
        assert!(
            matches!(&results[..], [Err(err)] if err.is_transient()),
            "{results:?}"
        );
        Ok(())
    }

    #[test]
    fn tombstones_round_trip() -> Result<(), Box<dyn std::error::Error>> {
        let id = IdentityId::new(70_000).ok_or("id 0")?;
        let tombstone = Tombstone {
            id,
            labels_hash: u64::MAX - 3,
            until_ms: 1_700_000_000_000,
        };
        assert_eq!(
            decode_tombstone(id, &encode_tombstone(&tombstone)),
            Some(tombstone)
        );
        assert_eq!(decode_tombstone(id, &[0; 15]), None);
        Ok(())
    }
}
