//! The stores against real files: op semantics (the same test body for the memory and
//! the redb store), durability, refusal of files census must not use, agreement with a
//! model under random op sequences, and crash safety with a child process that is
//! SIGKILLed while it writes.
//!
//! The on-disk layout is written out again here ([`layout`]), independently of the
//! store's code, so an accidental change of the format fails these tests.

use std::{
    collections::{BTreeMap, BTreeSet},
    error::Error,
    fs,
    io::{BufRead, BufReader, Read, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use census_operator::store::{
    Loaded, Store, StoreError, StoreOp, StoredIdentity, Tombstone,
    memory::MemoryStore,
    redb::{RedbOptions, RedbStore},
};
use census_proto::{
    domain::{IdentityId, NodeName},
    labels::{LabelLimits, LabelSet},
};
use proptest::prelude::*;

/// redb's page: the file's first one is its header.
const REDB_PAGE_BYTES: usize = 4096;

type TestResult<T = ()> = Result<T, Box<dyn Error>>;

fn labels(text: &str) -> TestResult<LabelSet> {
    Ok(LabelSet::parse(text.split(';'), &LabelLimits::default())?)
}

fn id(n: u32) -> TestResult<IdentityId> {
    IdentityId::new(n).ok_or_else(|| "id 0".into())
}

fn node(name: &str) -> TestResult<NodeName> {
    Ok(NodeName::new(name)?)
}

fn tombstone(id: IdentityId, labels: &LabelSet, until_ms: u64) -> Tombstone {
    Tombstone {
        id,
        labels_hash: labels.stable_hash(),
        until_ms,
    }
}

fn runtime() -> TestResult<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn open(path: &Path) -> Result<RedbStore, StoreError> {
    RedbStore::open(path, RedbOptions::default())
}

/// The v1 layout, as the file holds it.
mod layout {
    use redb::TableDefinition;

    pub(crate) const META: TableDefinition<'static, &[u8], &[u8]> = TableDefinition::new("meta");
    pub(crate) const SCHEMA_VERSION_KEY: &[u8] = b"schema_version";
    pub(crate) const IDENTITIES: TableDefinition<'static, u32, &[u8]> =
        TableDefinition::new("identities");
    pub(crate) const LABELS: TableDefinition<'static, &[u8], u32> = TableDefinition::new("labels");
    pub(crate) const TOMBSTONES: TableDefinition<'static, u32, &[u8]> =
        TableDefinition::new("tombstones");
}

/// Writes to a store file with redb directly, behind census's back.
fn raw_write(
    path: &Path,
    write: impl FnOnce(&redb::WriteTransaction) -> Result<(), redb::Error>,
) -> TestResult {
    let db = redb::Database::open(path)?;
    let txn = db.begin_write()?;
    write(&txn)?;
    txn.commit()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Op semantics, one body for both stores
// ---------------------------------------------------------------------------------------

async fn check_op_semantics(store: &dyn Store) -> TestResult {
    let (a, b) = (id(300)?, id(301)?);
    let (web, db) = (labels("k8s:app=web")?, labels("k8s:app=db")?);
    let create = |id, labels: &LabelSet| StoreOp::CreateIdentity {
        id,
        labels: labels.clone(),
    };

    // Create, and again: idempotent.
    assert_eq!(store.apply(vec![create(a, &web)]).await, vec![Ok(())]);
    assert_eq!(store.apply(vec![create(a, &web)]).await, vec![Ok(())]);

    // The id bound to other labels, or the labels bound to another id: both write
    // nothing, and name the store's binding (the core takes it).
    let results = store.apply(vec![create(a, &db), create(b, &web)]).await;
    match &results[..] {
        [
            Err(StoreError::IdBound {
                id: first,
                labels: expected,
                bound: found,
            }),
            Err(StoreError::LabelsBound {
                id: second, bound, ..
            }),
        ] => {
            assert_eq!((*first, *second, *bound), (a, b, a));
            assert_eq!(expected, "k8s:app=db");
            assert_eq!(found, &web);
        }
        other => return Err(format!("expected a conflict and labels bound, got {other:?}").into()),
    }
    let after_create = Loaded {
        identities: vec![StoredIdentity {
            id: a,
            labels: web.clone(),
        }],
        ..Loaded::default()
    };
    assert_eq!(store.load().await?, after_create);

    // Delete with other labels: refused, writing nothing (no tombstone either).
    let wrong = StoreOp::DeleteIdentity {
        id: a,
        labels: db.clone(),
        tombstone: tombstone(a, &db, 5),
    };
    assert!(matches!(
        &store.apply(vec![wrong]).await[..],
        [Err(StoreError::IdBound { .. })]
    ));
    assert_eq!(store.load().await?, after_create);

    // Delete, and again (gone already: success, and the tombstone is recorded anew).
    let delete = |until| StoreOp::DeleteIdentity {
        id: a,
        labels: web.clone(),
        tombstone: tombstone(a, &web, until),
    };
    assert_eq!(store.apply(vec![delete(1_000)]).await, vec![Ok(())]);
    assert_eq!(store.apply(vec![delete(2_000)]).await, vec![Ok(())]);
    let deleted = Loaded {
        tombstones: vec![tombstone(a, &web, 2_000)],
        ..Loaded::default()
    };
    assert_eq!(store.load().await?, deleted);

    // The labels are free again; creating the id again drops its tombstone.
    assert_eq!(store.apply(vec![create(b, &web)]).await, vec![Ok(())]);
    assert_eq!(store.apply(vec![create(a, &db)]).await, vec![Ok(())]);
    let recreated = store.load().await?;
    assert_eq!(
        recreated.identities,
        vec![
            StoredIdentity {
                id: a,
                labels: db.clone()
            },
            StoredIdentity {
                id: b,
                labels: web.clone()
            }
        ]
    );
    assert!(recreated.tombstones.is_empty());

    // Tombstones go, idempotently.
    let c = id(302)?;
    let drop_c = StoreOp::DeleteIdentity {
        id: c,
        labels: web.clone(),
        tombstone: tombstone(c, &web, 9),
    };
    assert_eq!(store.apply(vec![drop_c]).await, vec![Ok(())]);
    assert_eq!(store.load().await?.tombstones, vec![tombstone(c, &web, 9)]);
    let forget = StoreOp::DeleteTombstone { id: c };
    assert_eq!(
        store.apply(vec![forget.clone(), forget]).await,
        vec![Ok(()), Ok(())]
    );
    assert!(store.load().await?.tombstones.is_empty());

    // Nodes, idempotently, sorted by name.
    let put = |name| -> TestResult<StoreOp> { Ok(StoreOp::PutNode { node: node(name)? }) };
    let results = store
        .apply(vec![put("node-b")?, put("node-a")?, put("node-b")?])
        .await;
    assert_eq!(results, vec![Ok(()), Ok(()), Ok(())]);
    assert_eq!(
        store.load().await?.nodes,
        vec![node("node-a")?, node("node-b")?]
    );
    let gone = StoreOp::DeleteNode {
        node: node("node-b")?,
    };
    assert_eq!(
        store.apply(vec![gone.clone(), gone]).await,
        vec![Ok(()), Ok(())]
    );
    assert_eq!(store.load().await?.nodes, vec![node("node-a")?]);

    assert_eq!(store.apply(Vec::new()).await, Vec::new());
    Ok(())
}

#[tokio::test]
async fn op_semantics_memory() -> TestResult {
    check_op_semantics(&MemoryStore::new()).await
}

#[tokio::test]
async fn op_semantics_redb() -> TestResult {
    let dir = tempfile::tempdir()?;
    check_op_semantics(&open(&dir.path().join("census.redb"))?).await
}

/// One op of a batch is refused; the others are applied, in order.
async fn check_batch_with_conflict(store: &dyn Store) -> TestResult {
    let (a, b, x) = (id(300)?, id(301)?, id(400)?);
    let (web, db, one, two) = (
        labels("k8s:app=web")?,
        labels("k8s:app=db")?,
        labels("k8s:v=1")?,
        labels("k8s:v=2")?,
    );
    let results = store
        .apply(vec![
            StoreOp::CreateIdentity {
                id: a,
                labels: web.clone(),
            },
            StoreOp::CreateIdentity {
                id: b,
                labels: web.clone(),
            },
            StoreOp::PutNode {
                node: node("node-a")?,
            },
            StoreOp::CreateIdentity {
                id: b,
                labels: db.clone(),
            },
            // Later ops see the earlier ones of the same batch.
            StoreOp::CreateIdentity {
                id: x,
                labels: one.clone(),
            },
            StoreOp::DeleteIdentity {
                id: x,
                labels: one.clone(),
                tombstone: tombstone(x, &one, 7),
            },
            StoreOp::CreateIdentity {
                id: x,
                labels: two.clone(),
            },
        ])
        .await;
    assert_eq!(results.len(), 7);
    assert!(
        matches!(results[1], Err(StoreError::LabelsBound { id, bound, .. }) if id == b && bound == a)
    );
    for (i, result) in results.iter().enumerate().filter(|(i, _)| *i != 1) {
        assert_eq!(result, &Ok(()), "op {i}");
    }
    let expected = Loaded {
        identities: vec![
            StoredIdentity { id: a, labels: web },
            StoredIdentity { id: b, labels: db },
            StoredIdentity { id: x, labels: two },
        ],
        nodes: vec![node("node-a")?],
        tombstones: Vec::new(),
    };
    assert_eq!(store.load().await?, expected);
    Ok(())
}

#[tokio::test]
async fn batch_with_conflict_memory() -> TestResult {
    check_batch_with_conflict(&MemoryStore::new()).await
}

#[tokio::test]
async fn batch_with_conflict_redb() -> TestResult {
    let dir = tempfile::tempdir()?;
    check_batch_with_conflict(&open(&dir.path().join("census.redb"))?).await
}

// ---------------------------------------------------------------------------------------
// Durability
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn everything_survives_a_reopen() -> TestResult {
    let dir = tempfile::tempdir()?;
    // The directory does not exist yet: open creates it.
    let path = dir.path().join("state").join("census.redb");
    // More labels than the default limit: a stricter flag must not make them unreadable.
    let many: Vec<String> = (0..100).map(|i| format!("k8s:label-{i:03}=v")).collect();
    let many = LabelSet::parse(&many, &LabelLimits { max_labels: 200 })?;
    let web = labels("k8s:app=web;k8s:io.kubernetes.pod.namespace=prod")?;
    let gone = labels("k8s:app=gone")?;
    let ops = vec![
        StoreOp::CreateIdentity {
            id: id(65_535)?,
            labels: many,
        },
        StoreOp::CreateIdentity {
            id: id(256)?,
            labels: web,
        },
        StoreOp::CreateIdentity {
            id: id(999)?,
            labels: gone.clone(),
        },
        StoreOp::DeleteIdentity {
            id: id(999)?,
            labels: gone.clone(),
            tombstone: tombstone(id(999)?, &gone, u64::MAX),
        },
        StoreOp::PutNode {
            node: node("worker-2.example")?,
        },
        StoreOp::PutNode {
            node: node("worker-1")?,
        },
    ];
    let before = {
        let store = open(&path)?;
        assert!(store.apply(ops).await.iter().all(Result::is_ok));
        store.load().await?
    };
    assert_eq!(before.identities.len(), 2);
    assert_eq!(
        before.tombstones,
        vec![tombstone(id(999)?, &gone, u64::MAX)]
    );
    assert_eq!(
        before.nodes,
        vec![node("worker-1")?, node("worker-2.example")?]
    );

    let reopened = open(&path)?;
    assert_eq!(reopened.load().await?, before);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Refusal: files census must not use are refused and left as they were
// ---------------------------------------------------------------------------------------

/// Opens `path`, expecting a refusal, and checks that the file did not change.
fn refused(path: &Path) -> TestResult<StoreError> {
    let before = fs::read(path)?;
    let err = match open(path) {
        Ok(_) => return Err("the store opened a file it must refuse".into()),
        Err(err) => err,
    };
    assert_eq!(fs::read(path)?, before, "a refused file was modified");
    let shown = path.display().to_string();
    assert!(
        err.to_string().contains(&shown),
        "{err} does not name {shown}"
    );
    // Refusing again gives the same answer: nothing was "repaired" the first time.
    assert_eq!(open(path).err(), Some(err.clone()));
    Ok(err)
}

/// A store file with one identity, closed cleanly.
async fn store_file(dir: &Path) -> TestResult<PathBuf> {
    let path = dir.join("census.redb");
    let store = open(&path)?;
    let results = store
        .apply(vec![StoreOp::CreateIdentity {
            id: id(300)?,
            labels: labels("k8s:app=web")?,
        }])
        .await;
    assert_eq!(results, vec![Ok(())]);
    Ok(path)
}

#[tokio::test]
async fn other_schema_versions_are_refused() -> TestResult {
    for version in [2, 0] {
        let dir = tempfile::tempdir()?;
        let path = store_file(dir.path()).await?;
        raw_write(&path, |txn| {
            txn.open_table(layout::META)?
                .insert(layout::SCHEMA_VERSION_KEY, &u32::to_le_bytes(version)[..])?;
            Ok(())
        })?;
        let err = refused(&path)?;
        let expected = StoreError::Schema {
            path: path.display().to_string(),
            found: version,
            supported: 1,
        };
        assert_eq!(err, expected);
    }
    Ok(())
}

/// A deterministic stream of bytes that look random.
fn noise(len: usize, mut seed: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect()
}

#[test]
fn garbage_files_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    for (name, bytes) in [
        ("long", noise(256 * 1024, 7)),
        ("short", noise(100, 11)),
        ("one", vec![0]),
    ] {
        let path = dir.path().join(name);
        fs::write(&path, &bytes)?;
        let err = refused(&path)?;
        assert!(
            matches!(err, StoreError::Corrupt { .. } | StoreError::Open { .. }),
            "{name}: {err:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn damaged_contents_are_refused() -> TestResult {
    type Damage = fn(&redb::WriteTransaction) -> Result<(), redb::Error>;
    let cases: [(&str, Damage, &str); 6] = [
        (
            "a malformed label string",
            |txn| {
                txn.open_table(layout::IDENTITIES)?
                    .insert(777, &b"k8s:app=web;;bad"[..])?;
                txn.open_table(layout::LABELS)?
                    .insert(&b"k8s:app=web;;bad"[..], 777)?;
                Ok(())
            },
            "identity 777",
        ),
        (
            "a label string that is not canonical",
            |txn| {
                txn.open_table(layout::IDENTITIES)?
                    .insert(778, &b"k8s:z=1;k8s:a=2"[..])?;
                txn.open_table(layout::LABELS)?
                    .insert(&b"k8s:z=1;k8s:a=2"[..], 778)?;
                Ok(())
            },
            "identity 778",
        ),
        (
            "an identity missing from the index",
            |txn| {
                txn.open_table(layout::IDENTITIES)?
                    .insert(779, &b"k8s:app=lost"[..])?;
                Ok(())
            },
            "identity 779: its labels are missing from the label index",
        ),
        (
            "an index entry without identity",
            |txn| {
                txn.open_table(layout::LABELS)?
                    .insert(&b"k8s:app=ghost"[..], 780)?;
                Ok(())
            },
            "the label index has 2 entries for 1 identities",
        ),
        (
            "a tombstone of the wrong size",
            |txn| {
                txn.open_table(layout::TOMBSTONES)?
                    .insert(781, &[1, 2, 3][..])?;
                Ok(())
            },
            "tombstone of identity 781",
        ),
        (
            "a schema version of the wrong size",
            |txn| {
                txn.open_table(layout::META)?
                    .insert(layout::SCHEMA_VERSION_KEY, &[1, 0][..])?;
                Ok(())
            },
            "schema version has 2 bytes",
        ),
    ];
    for (what, damage, named) in cases {
        let dir = tempfile::tempdir()?;
        let path = store_file(dir.path()).await?;
        raw_write(&path, damage)?;
        match refused(&path)? {
            StoreError::Corrupt { detail, .. } => {
                assert!(detail.contains(named), "{what}: {detail}");
            }
            other => return Err(format!("{what}: expected Corrupt, got {other:?}").into()),
        }
    }
    Ok(())
}

#[test]
fn redb_files_of_other_programs_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let other = dir.path().join("other.redb");
    {
        let db = redb::Database::create(&other)?;
        let txn = db.begin_write()?;
        txn.open_table(redb::TableDefinition::<u64, u64>::new("counters"))?
            .insert(1, 2)?;
        txn.commit()?;
    }
    match refused(&other)? {
        StoreError::Corrupt { detail, .. } => {
            assert!(detail.contains("no `meta` table"), "{detail}");
        }
        err => return Err(format!("expected Corrupt, got {err:?}").into()),
    }

    // A `meta` table of other types.
    let typed = dir.path().join("typed.redb");
    {
        let db = redb::Database::create(&typed)?;
        let txn = db.begin_write()?;
        txn.open_table(redb::TableDefinition::<u64, u64>::new("meta"))?
            .insert(1, 1)?;
        txn.commit()?;
    }
    assert!(matches!(refused(&typed)?, StoreError::Corrupt { .. }));
    Ok(())
}

#[test]
fn a_second_open_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("census.redb");
    let first = open(&path)?;
    match refused(&path)? {
        StoreError::Open { detail, .. } => {
            assert!(detail.contains("already open"), "{detail}");
        }
        other => return Err(format!("expected Open, got {other:?}").into()),
    }
    drop(first);
    open(&path)?;
    Ok(())
}

#[test]
fn a_second_open_from_another_process_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("census.redb");
    let _first = open(&path)?;
    let output = child(Mode::Open, &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "child failed: {stdout} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("refused: cannot open store"), "{stdout}");
    assert!(stdout.contains("already open"), "{stdout}");
    Ok(())
}

/// A file left by a crash needs recovery, which redb does only in a writable open: the
/// store must decide on a recovered view and leave a refused file untouched.
#[tokio::test]
async fn files_left_by_a_crash_are_checked_without_writing() -> TestResult {
    for version in [1, 2] {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("census.redb");
        let status = child(Mode::Unclean(version), &path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        assert!(
            !status.success(),
            "the child is meant to die without closing the file"
        );
        assert!(
            matches!(
                redb::ReadOnlyDatabase::open(&path),
                Err(redb::DatabaseError::RepairAborted)
            ),
            "the file is meant to need recovery"
        );
        if version == 1 {
            let store = open(&path)?;
            let loaded = store.load().await?;
            assert_eq!(
                loaded.identities,
                vec![StoredIdentity {
                    id: id(300)?,
                    labels: labels("k8s:app=web")?
                }]
            );
        } else {
            let err = refused(&path)?;
            assert!(
                matches!(
                    err,
                    StoreError::Schema {
                        found: 2,
                        supported: 1,
                        ..
                    }
                ),
                "{err:?}"
            );
        }
    }
    Ok(())
}

/// Expects [`StoreError::Corrupt`] whose detail names `named` and whose message says
/// what to do.
fn assert_corrupt(err: &StoreError, named: &str) -> TestResult {
    let StoreError::Corrupt { detail, .. } = err else {
        return Err(format!("expected Corrupt ({named}), got {err:?}").into());
    };
    assert!(detail.contains(named), "{detail} does not say {named:?}");
    let message = err.to_string();
    for remedy in [
        "restore it from a backup",
        "move the file away to start empty",
    ] {
        assert!(
            message.contains(remedy),
            "{message} does not say {remedy:?}"
        );
    }
    Ok(())
}

/// A store file with `count` identities, a node and a tombstone, closed cleanly, and
/// what it holds.
async fn big_store_file(dir: &Path, count: u32) -> TestResult<(PathBuf, Loaded)> {
    let path = dir.join("census.redb");
    let store = open(&path)?;
    let mut ops = Vec::new();
    for n in 0..count {
        ops.push(StoreOp::CreateIdentity {
            id: id(1_000 + n)?,
            labels: labels(&format!("k8s:app=big-{n};k8s:padding={}", "p".repeat(40)))?,
        });
    }
    let gone = labels("k8s:app=gone")?;
    ops.push(StoreOp::DeleteIdentity {
        id: id(999)?,
        labels: gone.clone(),
        tombstone: tombstone(id(999)?, &gone, u64::MAX),
    });
    ops.push(StoreOp::PutNode {
        node: node("worker-1")?,
    });
    assert!(store.apply(ops).await.iter().all(Result::is_ok));
    let loaded = store.load().await?;
    assert_eq!(loaded.identities.len(), count as usize);
    Ok((path, loaded))
}

/// A new store appears at its path complete (it is built under a temporary name and
/// linked into place), and nothing else is left in the directory.
#[tokio::test]
async fn a_new_store_leaves_only_its_file() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("census.redb");
    let store = open(&path)?;
    assert_eq!(store.load().await?, Loaded::default());
    let names: Vec<_> = fs::read_dir(dir.path())?
        .map(|entry| entry.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    assert_eq!(names, vec![std::ffi::OsString::from("census.redb")]);
    drop(store);
    assert_eq!(open(&path)?.load().await?, Loaded::default());
    Ok(())
}

/// Only a path where nothing exists is created: an empty file may be what is left of a
/// store (a failed restore, a full disk), and census never writes a store into it.
#[test]
fn an_empty_file_is_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("census.redb");
    fs::write(&path, b"")?;
    assert_corrupt(&refused(&path)?, "empty")?;
    assert_eq!(fs::metadata(&path)?.len(), 0);
    Ok(())
}

#[tokio::test]
async fn truncated_files_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (path, _) = big_store_file(dir.path(), 2_000).await?;
    let whole = fs::read(&path)?;
    let len = whole.len();
    for cut in [len / 2, len / 4, len - 4096, 8192, 4096, 1024, 100, 9] {
        let cut_path = dir.path().join(format!("cut-{cut}.redb"));
        fs::write(&cut_path, &whole[..cut])?;
        let err = refused(&cut_path)?;
        assert!(
            matches!(err, StoreError::Corrupt { .. }),
            "cut to {cut} of {len} bytes: {err:?}"
        );
        assert_corrupt(&err, "")?;
    }
    Ok(())
}

#[test]
fn foreign_files_are_refused() -> TestResult {
    let dir = tempfile::tempdir()?;
    let json = serde_json_like();
    let mut magic_then_noise = b"redb\x1A\x0A\xA9\x0D\x0A".to_vec();
    magic_then_noise.extend(noise(8 * 1024, 23));
    for (name, bytes) in [
        ("census.json", json.into_bytes()),
        ("noise-4k", noise(4 * 1024, 17)),
        ("notes.txt", b"identities: see the cluster\n".to_vec()),
        ("magic-then-noise", magic_then_noise),
    ] {
        let path = dir.path().join(name);
        fs::write(&path, &bytes)?;
        let err = refused(&path)?;
        assert_corrupt(&err, "").map_err(|e| format!("{name}: {e}"))?;
    }
    Ok(())
}

/// A JSON document such as an export of identities, written by hand to stay free of a
/// JSON dependency.
fn serde_json_like() -> String {
    let entries: Vec<String> = (0..100)
        .map(|n| format!("{{\"id\": {}, \"labels\": [\"k8s:app=web-{n}\"]}}", 256 + n))
        .collect();
    format!("{{\"identities\": [{}]}}\n", entries.join(", "))
}

/// The first page (redb's header) intact, pages behind it damaged: redb trusts a file
/// that was closed cleanly and may panic reading it. Either way the open refuses it,
/// unchanged, and the test process lives on.
#[tokio::test]
async fn corrupted_pages_are_refused_without_panicking() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (path, original) = big_store_file(dir.path(), 2_000).await?;
    let whole = fs::read(&path)?;

    // Everything behind the header is noise.
    let mut damaged = whole.clone();
    damaged[REDB_PAGE_BYTES..].copy_from_slice(&noise(whole.len() - REDB_PAGE_BYTES, 29));
    let all = dir.path().join("all-pages.redb");
    fs::write(&all, &damaged)?;
    assert_corrupt(&refused(&all)?, "")?;

    // One page at a time, each page that holds anything: refused as it was, or (a page
    // redb does not read, such as a free one) opened with every identity intact.
    let mut refusals = 0;
    let used = (1..whole.len() / REDB_PAGE_BYTES).filter(|p| {
        whole[p * REDB_PAGE_BYTES..(p + 1) * REDB_PAGE_BYTES]
            .iter()
            .any(|byte| *byte != 0)
    });
    for page in used {
        let mut damaged = whole.clone();
        damaged[page * REDB_PAGE_BYTES..(page + 1) * REDB_PAGE_BYTES]
            .copy_from_slice(&noise(REDB_PAGE_BYTES, page as u64 + 1));
        let one = dir.path().join(format!("page-{page}.redb"));
        fs::write(&one, &damaged)?;
        let before = fs::read(&one)?;
        match open(&one) {
            Err(err) => {
                assert_eq!(
                    fs::read(&one)?,
                    before,
                    "page {page}: a refused file was modified"
                );
                assert_corrupt(&err, "").map_err(|e| format!("page {page}: {e}"))?;
                refusals += 1;
            }
            Ok(store) => {
                let loaded = store.load().await;
                assert_eq!(
                    loaded.as_ref().ok(),
                    Some(&original),
                    "page {page}: opened, but does not hold what was stored"
                );
            }
        }
    }
    assert!(refusals > 0, "no damaged page was refused");
    Ok(())
}

/// The file is damaged behind the open store's back, before it is loaded: the load
/// fails as corrupt, naming the file, rather than with a panic of its task.
#[tokio::test]
async fn a_file_damaged_after_the_open_fails_the_load() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (path, _) = big_store_file(dir.path(), 2_000).await?;
    let whole = fs::read(&path)?;
    // No page cache: the load reads the pages from the file, as it would for a store
    // larger than the cache.
    let options = RedbOptions {
        cache_bytes: 0,
        ..RedbOptions::default()
    };
    let store = RedbStore::open(&path, options)?;
    let mut damaged = whole.clone();
    damaged[REDB_PAGE_BYTES..].copy_from_slice(&noise(whole.len() - REDB_PAGE_BYTES, 31));
    fs::write(&path, &damaged)?;

    for attempt in 0..2 {
        match store.load().await {
            Err(err) => {
                let shown = path.display().to_string();
                assert!(
                    err.to_string().contains(&shown),
                    "{err} does not name {shown}"
                );
                assert_corrupt(&err, "").map_err(|e| format!("attempt {attempt}: {e}"))?;
            }
            Ok(loaded) => {
                let count = loaded.identities.len();
                return Err(format!(
                    "attempt {attempt}: loaded {count} identities from a damaged file"
                )
                .into());
            }
        }
    }
    drop(store);
    assert_eq!(
        fs::read(&path)?,
        damaged,
        "the damaged file was written after the failed load"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Random op sequences: both stores agree with a model
// ---------------------------------------------------------------------------------------

/// The documented semantics, written as plainly as possible.
#[derive(Debug, Default)]
struct Model {
    identities: BTreeMap<IdentityId, LabelSet>,
    tombstones: BTreeMap<IdentityId, Tombstone>,
    nodes: BTreeSet<NodeName>,
}

impl Model {
    fn apply(&mut self, op: &StoreOp) -> Result<(), &'static str> {
        match op {
            StoreOp::CreateIdentity { id, labels } => {
                // Every binding in these stores is valid: another one is named.
                if self.identities.get(id).is_some_and(|l| l != labels) {
                    return Err("id_bound");
                }
                if self.identities.iter().any(|(i, l)| l == labels && i != id) {
                    return Err("labels_bound");
                }
                self.identities.insert(*id, labels.clone());
                self.tombstones.remove(id);
            }
            StoreOp::DeleteIdentity {
                id,
                labels,
                tombstone,
            } => {
                if self.identities.get(id).is_some_and(|l| l != labels) {
                    return Err("id_bound");
                }
                self.identities.remove(id);
                self.tombstones.insert(
                    *id,
                    Tombstone {
                        id: *id,
                        ..*tombstone
                    },
                );
            }
            StoreOp::DeleteTombstone { id } => {
                self.tombstones.remove(id);
            }
            StoreOp::PutNode { node } => {
                self.nodes.insert(node.clone());
            }
            StoreOp::DeleteNode { node } => {
                self.nodes.remove(node);
            }
        }
        Ok(())
    }

    fn loaded(&self) -> Loaded {
        Loaded {
            identities: self
                .identities
                .iter()
                .map(|(id, labels)| StoredIdentity {
                    id: *id,
                    labels: labels.clone(),
                })
                .collect(),
            nodes: self.nodes.iter().cloned().collect(),
            tombstones: self.tombstones.values().copied().collect(),
        }
    }
}

#[derive(Debug, Clone)]
enum OpSpec {
    Create(u32, usize),
    Delete(u32, usize, u64),
    DeleteTombstone(u32),
    PutNode(usize),
    DeleteNode(usize),
}

const LABEL_POOL: [&str; 4] = [
    "k8s:app=web",
    "k8s:app=db",
    "k8s:app=web;k8s:tier=front",
    "k8s:app=cache",
];
const NODE_POOL: [&str; 3] = ["node-a", "node-b", "node-c"];

fn op_spec() -> impl Strategy<Value = OpSpec> {
    let id = 256..262u32;
    let set = 0..LABEL_POOL.len();
    prop_oneof![
        4 => (id.clone(), set.clone()).prop_map(|(id, set)| OpSpec::Create(id, set)),
        3 => (id.clone(), set, 0..3u64).prop_map(|(id, set, until)| OpSpec::Delete(id, set, until)),
        1 => id.prop_map(OpSpec::DeleteTombstone),
        1 => (0..NODE_POOL.len()).prop_map(OpSpec::PutNode),
        1 => (0..NODE_POOL.len()).prop_map(OpSpec::DeleteNode),
    ]
}

fn to_op(spec: &OpSpec) -> TestResult<StoreOp> {
    Ok(match *spec {
        OpSpec::Create(n, set) => StoreOp::CreateIdentity {
            id: id(n)?,
            labels: labels(LABEL_POOL[set])?,
        },
        OpSpec::Delete(n, set, until) => {
            let labels = labels(LABEL_POOL[set])?;
            StoreOp::DeleteIdentity {
                id: id(n)?,
                tombstone: tombstone(id(n)?, &labels, until),
                labels,
            }
        }
        OpSpec::DeleteTombstone(n) => StoreOp::DeleteTombstone { id: id(n)? },
        OpSpec::PutNode(n) => StoreOp::PutNode {
            node: node(NODE_POOL[n])?,
        },
        OpSpec::DeleteNode(n) => StoreOp::DeleteNode {
            node: node(NODE_POOL[n])?,
        },
    })
}

fn outcome(result: &Result<(), StoreError>) -> Result<(), &'static str> {
    result.as_ref().map_err(StoreError::cause).copied()
}

fn stores_agree_with_model(batches: &[Vec<OpSpec>]) -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("census.redb");
    // A tiny cache, so pages are evicted and read back.
    let options = RedbOptions {
        cache_bytes: 64 * 1024,
        ..RedbOptions::default()
    };
    runtime()?.block_on(async {
        let mut model = Model::default();
        let memory = MemoryStore::new();
        let redb = RedbStore::open(&path, options)?;
        for batch in batches {
            let ops = batch.iter().map(to_op).collect::<TestResult<Vec<_>>>()?;
            let expected: Vec<_> = ops.iter().map(|op| model.apply(op)).collect();
            let from_memory: Vec<_> = memory
                .apply(ops.clone())
                .await
                .iter()
                .map(outcome)
                .collect();
            let from_redb: Vec<_> = redb.apply(ops).await.iter().map(outcome).collect();
            assert_eq!(from_memory, expected, "memory store, batch {batch:?}");
            assert_eq!(from_redb, expected, "redb store, batch {batch:?}");
        }
        let expected = model.loaded();
        assert_eq!(memory.load().await?, expected);
        assert_eq!(redb.load().await?, expected);
        drop(redb);
        assert_eq!(
            RedbStore::open(&path, options)?.load().await?,
            expected,
            "after reopening"
        );
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_op_sequences(
        batches in prop::collection::vec(prop::collection::vec(op_spec(), 0..6), 1..8),
    ) {
        stores_agree_with_model(&batches).map_err(|err| TestCaseError::fail(err.to_string()))?;
    }
}

// ---------------------------------------------------------------------------------------
// Crash safety: a child applies batches and is SIGKILLed at random moments
// ---------------------------------------------------------------------------------------

const CHILD_ENV: &str = "CENSUS_STORE_TEST_CHILD";
const CHILD_PATH_ENV: &str = "CENSUS_STORE_TEST_PATH";
const CRASH_IDS: u32 = 40;

#[derive(Debug, Clone, Copy)]
enum Mode {
    /// Apply crash batches from the given index on, forever, acknowledging each.
    Crash(u64),
    /// Write a store of the given schema version and die without closing it.
    Unclean(u32),
    /// Try to open the store and say what happened.
    Open,
}

/// This test binary, running only [`child_process`].
fn child(mode: Mode, path: &Path) -> Command {
    let arg = match mode {
        Mode::Crash(from) => format!("crash:{from}"),
        Mode::Unclean(version) => format!("unclean:{version}"),
        Mode::Open => "open".to_owned(),
    };
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
    let mut command = Command::new(exe);
    command
        .args([
            "child_process",
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, arg)
        .env(CHILD_PATH_ENV, path)
        .stdin(Stdio::null());
    command
}

/// The id a crash batch works on, spread over the range.
fn crash_target(index: u64) -> u32 {
    let mixed = index.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    256 + (mixed % u64::from(CRASH_IDS)) as u32
}

fn crash_labels(n: u32) -> TestResult<LabelSet> {
    // Long enough that a batch touches several pages.
    labels(&format!("k8s:app=crash-{n};k8s:padding={}", "p".repeat(60)))
}

fn crash_node(n: u32) -> TestResult<NodeName> {
    node(&format!("node-{n}"))
}

/// Batch `index`, given the ids present before it: creates the target identity and its
/// node together, or deletes both together (writing a tombstone).
fn crash_batch(index: u64, present: &BTreeSet<u32>) -> TestResult<(Vec<StoreOp>, BTreeSet<u32>)> {
    let n = crash_target(index);
    let (ident, labels, node) = (id(n)?, crash_labels(n)?, crash_node(n)?);
    let mut after = present.clone();
    let ops = if after.remove(&n) {
        vec![
            StoreOp::DeleteIdentity {
                id: ident,
                tombstone: tombstone(ident, &labels, index),
                labels,
            },
            StoreOp::DeleteNode { node },
        ]
    } else {
        after.insert(n);
        vec![
            StoreOp::CreateIdentity { id: ident, labels },
            StoreOp::PutNode { node },
        ]
    };
    Ok((ops, after))
}

/// The batch a line of the child's output acknowledges. libtest may print the test's
/// name on the same line, before the first one.
fn ack_of(line: &str) -> Option<u64> {
    line.split_once("ack ")?.1.trim().parse().ok()
}

/// Checks what a crashed store holds and returns the ids present.
fn crash_state(loaded: &Loaded) -> TestResult<BTreeSet<u32>> {
    let mut present = BTreeSet::new();
    let mut seen_labels = BTreeSet::new();
    for identity in &loaded.identities {
        let n = identity.id.get();
        assert_eq!(
            identity.labels,
            crash_labels(n)?,
            "identity {n} holds labels of another"
        );
        assert!(
            seen_labels.insert(identity.labels.clone()),
            "labels of {n} bound twice"
        );
        present.insert(n);
    }
    let nodes: BTreeSet<u32> = loaded
        .nodes
        .iter()
        .map(|node| node.as_str().trim_start_matches("node-").parse())
        .collect::<Result<_, _>>()?;
    assert_eq!(
        nodes, present,
        "a batch was applied in part: identities and nodes disagree"
    );
    for stone in &loaded.tombstones {
        assert!(
            !present.contains(&stone.id.get()),
            "identity {} is live and tombstoned",
            stone.id
        );
    }
    Ok(present)
}

#[test]
fn batches_survive_sigkill() -> TestResult {
    const ROUNDS: usize = 10;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("census.redb");
    let runtime = runtime()?;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64;
    let mut delays = noise(ROUNDS, seed | 1).into_iter();
    let mut present = BTreeSet::new();
    let mut next: u64 = 0;
    let mut acked_total = 0;
    let mut needed_recovery = 0;
    for round in 0..ROUNDS {
        let mut process = child(Mode::Crash(next), &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let (stdout, mut stderr) = match (process.stdout.take(), process.stderr.take()) {
            (Some(out), Some(err)) => (out, err),
            _ => return Err("child without pipes".into()),
        };
        let (lines_tx, lines) = mpsc::channel();
        let reader = thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        // Kill at a random moment once it writes, sometimes right away, sometimes
        // while it opens (and repairs) the file.
        let delay = Duration::from_millis(u64::from(delays.next().unwrap_or(0)) % 250);
        let started = Instant::now();
        let mut log = Vec::new();
        if round % 3 != 0 {
            // Wait for the first acknowledged batch.
            loop {
                let Ok(line) = lines.recv_timeout(Duration::from_secs(20)) else {
                    let _ = process.kill();
                    process.wait()?;
                    let mut errors = String::new();
                    stderr.read_to_string(&mut errors)?;
                    return Err(format!(
                        "round {round}: the child acknowledged nothing: {log:?} {errors}"
                    )
                    .into());
                };
                let first_ack = ack_of(&line).is_some();
                log.push(line);
                if first_ack {
                    break;
                }
            }
        }
        thread::sleep(
            delay
                .saturating_sub(started.elapsed())
                .max(Duration::from_millis(5)),
        );
        process.kill()?;
        process.wait()?;
        let _ = reader.join();
        log.extend(lines.try_iter());
        let mut errors = String::new();
        stderr.read_to_string(&mut errors)?;
        assert!(
            !log.iter().any(|l| l.contains("error: ")),
            "seed {seed}: child failed: {log:?} {errors}"
        );

        let acked: Vec<u64> = log.iter().map(String::as_str).filter_map(ack_of).collect();
        let expected_acks: Vec<u64> = (next..next + acked.len() as u64).collect();
        assert_eq!(
            acked, expected_acks,
            "seed {seed}: acknowledgements out of order"
        );
        acked_total += acked.len();

        // The store holds every acknowledged batch, and maybe the one in flight.
        let mut acked_state = present.clone();
        for index in next..next + acked.len() as u64 {
            acked_state = crash_batch(index, &acked_state)?.1;
        }
        let in_flight = next + acked.len() as u64;
        let with_in_flight = crash_batch(in_flight, &acked_state)?.1;

        if matches!(
            redb::ReadOnlyDatabase::open(&path),
            Err(redb::DatabaseError::RepairAborted)
        ) {
            needed_recovery += 1;
        }
        let store = open(&path)
            .map_err(|err| format!("seed {seed}, round {round}: reopening failed: {err}"))?;
        let loaded = runtime.block_on(store.load())?;
        drop(store);
        present = crash_state(&loaded)?;
        if present == acked_state {
            next = in_flight;
        } else if present == with_in_flight {
            next = in_flight + 1;
        } else {
            return Err(format!(
                "seed {seed}, round {round}: the store holds {present:?}, expected {acked_state:?} \
                 (acknowledged) or {with_in_flight:?} (with the batch in flight)"
            )
            .into());
        }
    }
    assert!(acked_total > 0, "no child ever acknowledged a batch");
    assert!(needed_recovery > 0, "no kill ever left a file to recover");
    Ok(())
}

/// Runs as a child of the tests above (see [`child`]); a no-op otherwise.
#[test]
#[ignore = "a helper the tests run in a child process"]
fn child_process() -> TestResult {
    let (Ok(mode), Some(path)) = (std::env::var(CHILD_ENV), std::env::var_os(CHILD_PATH_ENV))
    else {
        return Ok(());
    };
    let path = PathBuf::from(path);
    let mut out = std::io::stdout();
    let result = match mode.split_once(':') {
        Some(("crash", from)) => crash_child(&path, from.parse()?, &mut out),
        Some(("unclean", version)) => unclean_child(&path, version.parse()?),
        _ if mode == "open" => {
            match open(&path) {
                Ok(_) => writeln!(out, "opened")?,
                Err(err) => writeln!(out, "refused: {err}")?,
            }
            Ok(())
        }
        _ => Err(format!("unknown child mode {mode:?}").into()),
    };
    if let Err(err) = &result {
        writeln!(out, "error: {err}")?;
        out.flush()?;
    }
    result
}

fn crash_child(path: &Path, from: u64, out: &mut std::io::Stdout) -> TestResult {
    let runtime = runtime()?;
    let store = open(path)?;
    let mut present = crash_state(&runtime.block_on(store.load())?)?;
    for index in from.. {
        let (ops, after) = crash_batch(index, &present)?;
        let results = runtime.block_on(store.apply(ops));
        if let Some(Err(err)) = results.iter().find(|r| r.is_err()) {
            return Err(format!("batch {index}: {err}").into());
        }
        present = after;
        writeln!(out, "ack {index}")?;
        out.flush()?;
    }
    Ok(())
}

fn unclean_child(path: &Path, version: u32) -> TestResult {
    let db = redb::Database::create(path)?;
    let txn = db.begin_write()?;
    txn.open_table(layout::META)?
        .insert(layout::SCHEMA_VERSION_KEY, &version.to_le_bytes()[..])?;
    txn.open_table(layout::IDENTITIES)?
        .insert(300, &b"k8s:app=web"[..])?;
    txn.open_table(layout::LABELS)?
        .insert(&b"k8s:app=web"[..], 300)?;
    txn.open_table(layout::TOMBSTONES)?;
    txn.open_table(redb::TableDefinition::<&[u8], ()>::new("nodes"))?;
    txn.commit()?;
    // Die with the database open, as a crash would.
    std::process::abort();
}
