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
//! a crash is repaired). So an existing file is first checked without writing, through
//! a copy-on-write view ([`scratch`]) where redb's writes (the record of the open, the
//! repair of a file left by a crash) stay in memory: redb's integrity check (checksums
//! of every page in use, its allocation records), then census's reading of everything.
//! Only a file that passes is opened for writing.
//!
//! Only a path where nothing exists is created. Anything else that is there (an empty
//! file, a truncated one, another program's) may be what is left of someone's
//! identities, so it is refused like a damaged store. A new store is built under a
//! temporary name and linked into place complete, so a crash never leaves a
//! half-initialized file at the path.
//!
//! redb trusts a file that was closed cleanly and may panic, rather than return an
//! error, on a page damaged behind its back. The calls into redb while opening and
//! loading run under [`unwound`], which reports such a panic as corruption of the file.

mod scratch;

use std::{
    fs::{self, File, OpenOptions},
    io,
    panic::{self, AssertUnwindSafe},
    path::{Path, PathBuf},
    process,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
};

use ::redb::{
    Builder, Database, DatabaseError, Durability, ReadTransaction, ReadableDatabase, ReadableTable,
    ReadableTableMetadata, StorageError, Table, TableDefinition, TableError, TableHandle,
    WriteTransaction, backends::FileBackend,
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
    /// Batches take turns in the order `apply` was called, and a batch keeps its turn
    /// until it has committed, even if its caller stopped waiting (the writer's
    /// timeout): so no later batch commits before a timed-out one that is still
    /// running (a late delete cannot undo the create that followed it), and a batch
    /// whose caller gave up before its turn is never written at all. tokio's mutex
    /// is fair (FIFO), unlike the one around the database.
    turns: Arc<tokio::sync::Mutex<()>>,
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
    /// Opens the store at `path`. Only where nothing exists is a store created (and its
    /// directory). An existing file is refused, without changing a byte of it, if it is
    /// empty, truncated, damaged, not a census store, or its contents do not decode
    /// ([`StoreError::Corrupt`]), if it has another schema version
    /// ([`StoreError::Schema`]), and if it cannot be opened, e.g. because another process
    /// has it open ([`StoreError::Open`]).
    ///
    /// Blocking: reads and verifies the whole file once.
    pub fn open(path: &Path, options: RedbOptions) -> Result<Self, StoreError> {
        let shown = path.display().to_string();
        let created = match fs::metadata(path) {
            Ok(_) => None,
            Err(err) if err.kind() == io::ErrorKind::NotFound => create(path, &shown, &options)?,
            Err(err) => {
                return Err(StoreError::Open {
                    path: shown,
                    detail: err.to_string(),
                });
            }
        };
        let db = match created {
            Some(db) => db,
            // Also when another process created the file first.
            None => open_existing(path, &shown, &options)?,
        };
        tracing::debug!(path = %shown, cache_bytes = options.cache_bytes, "opened redb store");
        Ok(Self {
            inner: Arc::new(Inner {
                path: path.to_owned(),
                shown,
                options,
                db: Mutex::new(Some(db)),
            }),
            turns: Arc::default(),
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
        let turns = Arc::clone(&self.turns);
        Box::pin(async move {
            if ops.is_empty() {
                return Vec::new();
            }
            let count = ops.len();
            // See `turns`: the turn moves into the blocking task and ends with it.
            let turn = turns.lock_owned().await;
            tokio::task::spawn_blocking(move || {
                let results = inner.apply_blocking(&ops);
                drop(turn);
                results
            })
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
            None => self.reopen()?,
        };
        Ok(guard.insert(db))
    }

    /// Opens the file again after its handle was dropped (a failed write, a panic), with
    /// the same check as the first open.
    fn reopen(&self) -> Result<Database, StoreError> {
        let db = open_existing(&self.path, &self.shown, &self.options).map_err(unavailable_now)?;
        tracing::info!(path = %self.shown, "reopened redb store");
        Ok(db)
    }

    fn load_blocking(&self) -> Result<Loaded, StoreError> {
        let mut guard = self.lock_db();
        let db = match guard.take() {
            Some(db) => db,
            None => self.reopen()?,
        };
        let (shown, limits) = (self.shown.as_str(), &self.options.load_limits);
        // The handle moves into the closure, so a panic drops it while unwinding, when
        // redb writes nothing; the next call reopens the file through the open's check.
        let (db, loaded) = unwound(shown, move || {
            let loaded = db
                .begin_read()
                .map_err(|err| io_error(&err))
                .and_then(|txn| read_all(&txn, shown, limits));
            Ok((db, loaded))
        })?;
        *guard = Some(db);
        loaded
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

/// Opens an existing file for writing, once [`check_existing`] passed it.
fn open_existing(path: &Path, shown: &str, options: &RedbOptions) -> Result<Database, StoreError> {
    check_existing(path, shown, options)?;
    // It reads what the check read (and repairs a file left by a crash as the check's
    // view was repaired): a panic here means the file changed in between.
    unwound(shown, || {
        builder(options)
            .open(path)
            .map_err(|err| open_failure(shown, err))
    })
}

/// Checks an existing file without writing to it.
fn check_existing(path: &Path, shown: &str, options: &RedbOptions) -> Result<(), StoreError> {
    let corrupt = |detail: String| StoreError::Corrupt {
        path: shown.to_owned(),
        detail,
    };
    let len = fs::metadata(path)
        .map_err(|err| StoreError::Open {
            path: shown.to_owned(),
            detail: err.to_string(),
        })?
        .len();
    if len == 0 {
        return Err(corrupt(
            "the file is empty (0 bytes); census creates a store only where no file exists"
                .to_owned(),
        ));
    }
    unwound(shown, || {
        // A read-only open first, held until the end: it takes the file's lock, so a file
        // another process has open is refused as such rather than read while it changes.
        let _lock = match builder(options).open_read_only(path) {
            Ok(db) => Some(db),
            // Left by a crash; the view below is recovered like a writable open would.
            Err(DatabaseError::RepairAborted) => {
                tracing::info!(
                    path = %shown,
                    "store was not closed cleanly; checking a recovered view before repairing it"
                );
                None
            }
            Err(err) => return Err(open_failure(shown, err)),
        };
        let scratch = File::open(path)
            .and_then(Scratch::new)
            .map_err(|err| StoreError::Open {
                path: shown.to_owned(),
                detail: err.to_string(),
            })?;
        let mut db = builder(options)
            .create_with_backend(scratch)
            .map_err(|err| open_failure(shown, err))?;
        // A plain read trusts the pages; the check verifies them, and the allocation
        // records a writable open would trust (and allocate by) but reads never touch.
        // Failed-but-repaired would mean falling back to what an older commit left.
        if !db
            .check_integrity()
            .map_err(|err| open_failure(shown, err))?
        {
            return Err(corrupt(
                "redb's integrity check failed: pages in use or its allocation records do \
                 not match their checksums"
                    .to_owned(),
            ));
        }
        let txn = db.begin_read().map_err(|err| io_error(&err))?;
        read_all(&txn, shown, &options.load_limits).map(drop)
    })
    .map_err(|err| at_open(err, shown))
}

/// Tells apart the temporary files of creations running at once in this process.
static CREATIONS: AtomicU64 = AtomicU64::new(0);

/// Creates a store where nothing exists; `None` if a file appeared there meanwhile.
///
/// The store is built under a temporary name in the same directory and linked into place
/// once it holds census's tables, so the path never names a half-initialized file. A
/// crash may leave the temporary name (`.<name>.creating-*`) behind: before the link it
/// names a store without identities, after it a second name of the store, so removing
/// it loses nothing. The link fails if the path exists, so a file another process
/// created meanwhile is never replaced; the caller checks and opens it like any
/// existing file.
fn create(path: &Path, shown: &str, options: &RedbOptions) -> Result<Option<Database>, StoreError> {
    let open_error = |detail: String| StoreError::Open {
        path: shown.to_owned(),
        detail,
    };
    let name = path
        .file_name()
        .ok_or_else(|| open_error("the path does not name a file".to_owned()))?;
    let dir = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir)
        .map_err(|err| open_error(format!("cannot create directory {}: {err}", dir.display())))?;
    let temp = dir.join(format!(
        ".{}.creating-{}-{}",
        name.to_string_lossy(),
        process::id(),
        CREATIONS.fetch_add(1, Ordering::Relaxed)
    ));
    let created = create_at(&temp, path, shown, options);
    // After a link, `path` names the file too; without one, it holds nothing.
    if let Err(err) = fs::remove_file(&temp)
        && err.kind() != io::ErrorKind::NotFound
    {
        tracing::warn!(path = %temp.display(), error = %err, "cannot remove the temporary file of a new store");
    }
    let created = created.map_err(|err| at_open(err, shown))?;
    if created.is_some() {
        // Commits to the file are durable only once its name is.
        File::open(dir)
            .and_then(|dir| dir.sync_all())
            .map_err(|err| open_error(format!("cannot sync directory {}: {err}", dir.display())))?;
        tracing::info!(path = %shown, version = SCHEMA_VERSION, "created redb store");
    }
    Ok(created)
}

fn create_at(
    temp: &Path,
    path: &Path,
    shown: &str,
    options: &RedbOptions,
) -> Result<Option<Database>, StoreError> {
    let open_error = |detail: String| StoreError::Open {
        path: shown.to_owned(),
        detail,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(temp)
        .map_err(|err| open_error(format!("cannot create {}: {err}", temp.display())))?;
    let backend = FileBackend::new(file).map_err(|err| open_failure(shown, err))?;
    let db = builder(options)
        .create_with_backend(backend)
        .map_err(|err| open_failure(shown, err))?;
    init(&db, shown)?;
    match fs::hard_link(temp, path) {
        Ok(()) => Ok(Some(db)),
        Err(err) if err.kind() == io::ErrorKind::AlreadyExists => Ok(None),
        Err(err) => Err(open_error(format!(
            "cannot link the new store {} into place: {err}",
            temp.display()
        ))),
    }
}

/// Writes the schema version and the tables into a new database.
fn init(db: &Database, shown: &str) -> Result<(), StoreError> {
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
    txn.commit().map_err(|err| io_error(&err))
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

/// Runs `redb_calls` (calls into redb while opening or loading), reporting a panic as
/// [`StoreError::Corrupt`] of the file.
///
/// Catching the panic is sound here: what the calls change is redb state they create
/// or are handed by value (handles, transactions, a scratch view), which is dropped while
/// unwinding, and redb's close writes nothing while its thread panics. So no handle that
/// saw the damage survives, nothing half-updated is left behind, and the file is not
/// written. Only this call is covered; the process's panic hook stays as it is.
fn unwound<T>(
    shown: &str,
    redb_calls: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    panic::catch_unwind(AssertUnwindSafe(redb_calls)).unwrap_or_else(|panic| {
        Err(StoreError::Corrupt {
            path: shown.to_owned(),
            detail: format!(
                "redb panicked reading it: {}",
                bounded(panic_message(panic.as_ref()))
            ),
        })
    })
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic")
}

/// The longest panic message an error carries: enough for redb's, one log line.
const PANIC_MESSAGE_MAX: usize = 200;

fn bounded(message: &str) -> String {
    census_proto::text::cut(message, PANIC_MESSAGE_MAX).into_owned()
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

/// The schema version.
fn schema_version(txn: &ReadTransaction, shown: &str) -> Result<u32, StoreError> {
    let storage = |err| storage_error(shown, err);
    let corrupt = |detail: String| StoreError::Corrupt {
        path: shown.to_owned(),
        detail,
    };
    let empty = txn.list_tables().map_err(storage)?.next().is_none()
        && txn
            .list_multimap_tables()
            .map_err(storage)?
            .next()
            .is_none();
    if empty {
        // census writes its tables before a new file takes the store's name.
        return Err(corrupt(
            "it is a redb database without any table: not a census store".to_owned(),
        ));
    }
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
    Ok(u32::from_le_bytes(bytes))
}

/// Reads and checks everything.
fn read_all(
    txn: &ReadTransaction,
    shown: &str,
    limits: &LabelLimits,
) -> Result<Loaded, StoreError> {
    match schema_version(txn, shown)? {
        SCHEMA_VERSION => {}
        found => {
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

    Ok(Loaded {
        identities,
        nodes,
        tombstones,
    })
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
            Err(
                err @ (StoreError::Conflict { .. }
                | StoreError::IdBound { .. }
                | StoreError::LabelsBound { .. }),
            ) => {
                results.push(Err(err));
            }
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

    /// A database in memory whose writes wait while `closed` is set.
    #[derive(Debug)]
    struct Gated {
        inner: InMemoryBackend,
        closed: Arc<AtomicBool>,
    }

    impl Gated {
        fn wait(&self) {
            while self.closed.load(Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }

    impl StorageBackend for Gated {
        fn len(&self) -> io::Result<u64> {
            self.inner.len()
        }

        fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
            self.inner.read(offset, out)
        }

        fn set_len(&self, len: u64) -> io::Result<()> {
            self.wait();
            self.inner.set_len(len)
        }

        fn sync_data(&self) -> io::Result<()> {
            self.wait();
            self.inner.sync_data()
        }

        fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
            self.wait();
            self.inner.write(offset, data)
        }
    }

    fn gated_store() -> Result<(RedbStore, Arc<AtomicBool>), Box<dyn std::error::Error>> {
        let closed = Arc::new(AtomicBool::new(false));
        let backend = Gated {
            inner: InMemoryBackend::new(),
            closed: Arc::clone(&closed),
        };
        let db = Builder::new().create_with_backend(backend)?;
        init(&db, "memory")?;
        let store = RedbStore {
            inner: Arc::new(Inner {
                path: PathBuf::from("memory"),
                shown: "memory".to_owned(),
                options: RedbOptions::default(),
                db: Mutex::new(Some(db)),
            }),
            turns: Arc::default(),
        };
        Ok((store, closed))
    }

    fn delete(op: &StoreOp) -> StoreOp {
        let StoreOp::CreateIdentity { id, labels } = op.clone() else {
            unreachable!("a create");
        };
        StoreOp::DeleteIdentity {
            id,
            tombstone: Tombstone {
                id,
                labels_hash: labels.stable_hash(),
                until_ms: u64::MAX,
            },
            labels,
        }
    }

    const GIVE_UP: std::time::Duration = std::time::Duration::from_millis(100);

    /// A writer stops waiting for a delete whose commit is under way (its timeout);
    /// the core then re-creates the identity. The late delete commits first, the
    /// create after it: the binding the core serves is in the store.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_timed_out_batch_still_running_commits_before_the_next()
    -> Result<(), Box<dyn std::error::Error>> {
        let (store, closed) = gated_store()?;
        let x = op(300)?;
        assert_eq!(store.apply(vec![x.clone()]).await, vec![Ok(())]);
        closed.store(true, Ordering::SeqCst);
        let late = tokio::time::timeout(GIVE_UP, store.apply(vec![delete(&x)])).await;
        assert!(late.is_err(), "the delete is stuck in its commit");
        let store = Arc::new(store);
        let again = tokio::spawn({
            let store = Arc::clone(&store);
            let x = x.clone();
            async move { store.apply(vec![x]).await }
        });
        tokio::time::sleep(GIVE_UP).await;
        assert!(
            !again.is_finished(),
            "the create waits for the delete's commit"
        );
        closed.store(false, Ordering::SeqCst);
        assert_eq!(again.await?, vec![Ok(())]);
        let loaded = store.load().await?;
        assert_eq!(
            loaded.identities.len(),
            1,
            "the re-created binding: {loaded:?}"
        );
        Ok(())
    }

    /// A writer stops waiting for a delete that has not had its turn yet: it is never
    /// written, so the binding the core goes on serving stays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_timed_out_batch_that_never_had_its_turn_is_never_written()
    -> Result<(), Box<dyn std::error::Error>> {
        let (store, closed) = gated_store()?;
        let store = Arc::new(store);
        let x = op(300)?;
        assert_eq!(store.apply(vec![x.clone()]).await, vec![Ok(())]);
        closed.store(true, Ordering::SeqCst);
        let busy_op = op(301)?;
        let busy = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.apply(vec![busy_op]).await }
        });
        tokio::time::sleep(GIVE_UP).await;
        let gave_up = tokio::time::timeout(GIVE_UP, store.apply(vec![delete(&x)])).await;
        assert!(gave_up.is_err(), "the delete waits behind the busy batch");
        closed.store(false, Ordering::SeqCst);
        assert_eq!(busy.await?, vec![Ok(())]);
        assert_eq!(store.apply(vec![op(302)?]).await, vec![Ok(())]);
        let loaded = store.load().await?;
        let ids: Vec<u32> = loaded.identities.iter().map(|s| s.id.get()).collect();
        assert_eq!(ids, [300, 301, 302], "300 was never deleted");
        assert!(loaded.tombstones.is_empty());
        Ok(())
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
        init(&db, "memory")?;
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
