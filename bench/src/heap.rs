//! Who holds the operator's live heap: a heap profile from `/debug/pprof/heap`
//! (the operator runs with `--heap-profiling`; its profiles come symbolized), each
//! sampled allocation charged to the innermost frame of a crate that owns memory
//! (h2, hyper, tonic, rustls, a census module), past the frames of allocators,
//! containers, runtimes and codecs that allocate on someone else's behalf.

use std::{collections::HashMap, io::Read as _, net::SocketAddr};

use anyhow::{Context as _, bail};
use prost::Message as _;
use serde::Serialize;

use super::{
    report::{mib, say},
    sample::http_get,
};

/// The parts of pprof's `Profile` (perftools.profiles, profile.proto) read here.
#[derive(Clone, PartialEq, prost::Message)]
struct Profile {
    #[prost(message, repeated, tag = "1")]
    sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    sample: Vec<ProfileSample>,
    #[prost(message, repeated, tag = "4")]
    location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    string_table: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ValueType {
    #[prost(int64, tag = "1")]
    r#type: i64,
    #[prost(int64, tag = "2")]
    unit: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProfileSample {
    #[prost(uint64, repeated, tag = "1")]
    location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    value: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Location {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(message, repeated, tag = "4")]
    line: Vec<Line>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Line {
    #[prost(uint64, tag = "1")]
    function_id: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Function {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "2")]
    name: i64,
    #[prost(int64, tag = "4")]
    filename: i64,
}

/// Live bytes by owner, largest first.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Owners {
    pub(crate) total_bytes: u64,
    pub(crate) owners: Vec<(String, u64)>,
}

/// Crates that allocate for their caller: the owner is further out.
const ON_BEHALF: &[&str] = &[
    "std",
    "tikv-jemallocator",
    "tikv-jemalloc-sys",
    "jemalloc",
    "bytes",
    "hashbrown",
    "indexmap",
    "slab",
    "smallvec",
    "prost",
    "tokio",
    "tokio-util",
    "tokio-stream",
    "futures-util",
    "futures-core",
    "futures-channel",
    "tracing",
    "tracing-core",
    "http",
    "http-body",
    "http-body-util",
    "tower",
    "tower-layer",
    "tower-service",
    "parking_lot",
    "lock_api",
    "pin-project",
    "pin-project-lite",
    "rustc-demangle",
    "backtrace",
    "census-operator main",
    // Framing: the caller holds what it frames (the map's batches, a stream's answers).
    "census-transport wire",
];

/// The crate (and, for census's own crates, the module) a source file belongs to:
/// `h2`, `std`, `census-operator grpc/sync`; `None` when the file says nothing.
fn crate_of(file: &str) -> Option<String> {
    // The standard library, and the crates it vendors (its HashMap is hashbrown's).
    if file.starts_with("/rustc/") || file.starts_with("/rust/deps/") {
        return Some("std".to_owned());
    }
    if file.contains("jemalloc") && (file.ends_with(".c") || file.ends_with(".h")) {
        return Some("jemalloc".to_owned());
    }
    if let Some((_, rest)) = file.split_once("/registry/src/") {
        // index.crates.io-<hash>/<crate>-<version>/src/...
        let dir = rest.split('/').nth(1)?;
        let name = dir
            .rsplit_once('-')
            .filter(|(_, v)| v.starts_with(|c: char| c.is_ascii_digit()))
            .map_or(dir, |(n, _)| n);
        return Some(name.to_owned());
    }
    // A crate census vendors (operator/transport/vendor/h2): the crate it is, not census's.
    if let Some((_, rest)) = file.split_once("/vendor/") {
        return rest.split_once("/src/").map(|(name, _)| name.to_owned());
    }
    // A workspace crate: <dir>/src/<module path>.rs
    let (before, module) = file.rsplit_once("/src/")?;
    let dir = before.rsplit('/').next()?;
    let module = module.trim_end_matches(".rs").trim_end_matches("/mod");
    let module = module.split_once('/').map_or(module, |(m, sub)| {
        // Two levels where census's modules have them (grpc/sync, runtime/map).
        if matches!(m, "grpc" | "runtime") {
            module
        } else {
            let _ = sub;
            m
        }
    });
    Some(format!("census-{dir} {module}"))
}

/// The owner named for a frame of `function` in `file`, if it owns memory.
fn owner(function: &str, file: &str) -> Option<String> {
    let krate = crate_of(file).or_else(|| {
        // A symbol-table name: its path says the crate.
        let f = function.trim_start_matches('<');
        let head = f.split("::").next().filter(|h| *h != f)?;
        Some(head.replace('_', "-"))
    })?;
    // Constructors allocate for whoever calls them; and the linker folds identical
    // small functions, so a constructor's frame may even name another crate's.
    let bare = function.split('<').next().unwrap_or(function);
    if matches!(bare, "new" | "with_capacity" | "default" | "clone" | "from") {
        return None;
    }
    if ON_BEHALF.contains(&krate.as_str())
        || ON_BEHALF
            .iter()
            .any(|p| krate.starts_with(&format!("{p} ")))
        || function.starts_with("_rjem")
        || function.starts_with("__rust")
    {
        return None;
    }
    let module = krate.split_once(' ').map(|(_, m)| m);
    Some(match (krate.split(' ').next().unwrap_or(""), module) {
        ("h2", _) => "HTTP/2 connections (h2: frame buffers, HPACK, streams)".to_owned(),
        ("hyper" | "hyper-util", _) => "hyper (connections, requests)".to_owned(),
        ("tonic", _) => "tonic (calls, codecs, transport)".to_owned(),
        ("rustls" | "tokio-rustls", _) => "TLS (rustls)".to_owned(),
        ("census-operator", Some("grpc/sync")) => "EndpointSync streams (census)".to_owned(),
        ("census-operator", Some("grpc/endpoint_map" | "runtime/map")) => {
            "endpoint map (watchers, encoded batches and full maps)".to_owned()
        }
        ("census-operator", Some(m)) if m.starts_with("grpc") => {
            "census gRPC (transport, auth, quotas, other services)".to_owned()
        }
        ("census-allocator", _) => "allocator core (views, identities, indexes)".to_owned(),
        ("census-operator", Some("store")) | ("redb", _) => "store (redb)".to_owned(),
        ("census-proto", _) => {
            "endpoint keys, addresses and labels (census-proto domain values, held by the views)"
                .to_owned()
        }
        ("census-operator", Some(m)) if m.starts_with("runtime") => {
            "runtime (queues, timers, node streams)".to_owned()
        }
        (c, Some(m)) => format!("{c} {m}"),
        (c, None) => c.to_owned(),
    })
}

/// A saved profile's live heap by owner (gzipped pprof, as `/debug/pprof/heap`
/// serves it: from a bench run's `heap.pb.gz`, or a production operator's).
pub(crate) fn owners_of_file(path: &std::path::Path) -> anyhow::Result<Owners> {
    let body = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    decode(&body)
}

/// Prints `owners`, per node and per endpoint when they are known.
pub(crate) fn print(owners: &Owners, nodes: Option<usize>, endpoints: Option<u64>) {
    for (owner, bytes) in &owners.owners {
        let per = |n: Option<f64>, unit: &str| {
            n.map_or_else(String::new, |n| {
                format!("{:>8.0} B/{unit}  ", *bytes as f64 / n.max(1.0))
            })
        };
        say(format!(
            "  {:>9}  {}{}{owner}",
            mib(*bytes),
            per(nodes.map(|n| n as f64), "node"),
            per(endpoints.map(|e| e as f64), "endpoint"),
        ));
    }
}

/// The operator's live heap now, by owner, and the profile as served (gzipped pprof,
/// for `go tool pprof`).
pub(crate) async fn owners(admin: SocketAddr) -> anyhow::Result<(Owners, Vec<u8>)> {
    let (status, body) = http_get(admin, "/debug/pprof/heap").await?;
    if status != 200 {
        bail!(
            "GET /debug/pprof/heap: HTTP {status}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    Ok((decode(&body)?, body))
}

fn decode(gzipped: &[u8]) -> anyhow::Result<Owners> {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gzipped)
        .read_to_end(&mut raw)
        .context("the heap profile is not gzip")?;
    let profile = Profile::decode(&raw[..]).context("the heap profile is not pprof")?;
    classify(&profile)
}

fn classify(profile: &Profile) -> anyhow::Result<Owners> {
    let string = |i: i64| {
        usize::try_from(i)
            .ok()
            .and_then(|i| profile.string_table.get(i))
            .map_or("", String::as_str)
    };
    let names: HashMap<u64, (&str, &str)> = profile
        .function
        .iter()
        .map(|f| (f.id, (string(f.name), string(f.filename))))
        .collect();
    if names.is_empty() {
        bail!("the heap profile has no function names (is the operator's profile symbolized?)");
    }
    // Each location's frames, innermost first (pprof: inlined callees before callers).
    let frames: HashMap<u64, Vec<(&str, &str)>> = profile
        .location
        .iter()
        .map(|l| {
            let frames = l
                .line
                .iter()
                .map(|line| names.get(&line.function_id).copied().unwrap_or(("", "")))
                .collect();
            (l.id, frames)
        })
        .collect();
    let stack = |s: &ProfileSample| -> Vec<(&str, &str)> {
        s.location_id
            .iter()
            .flat_map(|id| frames.get(id).into_iter().flatten().copied())
            .collect()
    };
    // pprof puts the leaf first; some writers put the root first: the allocator's
    // own frames tell which end is the leaf.
    let allocating = |(f, file): &(&str, &str)| {
        f.starts_with("_rjem") || f.starts_with("__rust") || file.contains("jemalloc")
    };
    let (mut leaf_first, mut root_first) = (0, 0);
    for s in &profile.sample {
        let st = stack(s);
        if st.first().is_some_and(&allocating) {
            leaf_first += 1;
        }
        if st.last().is_some_and(&allocating) {
            root_first += 1;
        }
    }
    let mut by_owner: HashMap<String, u64> = HashMap::new();
    let mut total = 0;
    for s in &profile.sample {
        let bytes = s.value.first().copied().unwrap_or(0).max(0) as u64;
        let mut st = stack(s);
        if root_first > leaf_first {
            st.reverse();
        }
        let who = st
            .iter()
            .find_map(|(f, file)| owner(f, file))
            .unwrap_or_else(|| "other".to_owned());
        *by_owner.entry(who).or_default() += bytes;
        total += bytes;
    }
    let mut owners: Vec<(String, u64)> = by_owner.into_iter().collect();
    owners.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Ok(Owners {
        total_bytes: total,
        owners,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(stacks: &[(&[(&str, &str)], i64)]) -> Profile {
        let mut p = Profile {
            string_table: vec![String::new()],
            ..Profile::default()
        };
        for (stack, bytes) in stacks {
            let mut ids = Vec::new();
            for (name, file) in *stack {
                p.string_table.push((*name).to_owned());
                p.string_table.push((*file).to_owned());
                let id = p.function.len() as u64 + 1;
                p.function.push(Function {
                    id,
                    name: p.string_table.len() as i64 - 2,
                    filename: p.string_table.len() as i64 - 1,
                });
                p.location.push(Location {
                    id,
                    line: vec![Line { function_id: id }],
                });
                ids.push(id);
            }
            p.sample.push(ProfileSample {
                location_id: ids,
                value: vec![*bytes],
            });
        }
        p
    }

    #[test]
    fn a_vendored_crate_is_that_crate_not_censuss() {
        let file = "/work/main/operator/transport/vendor/h2/src/proto/streams/buffer.rs";
        assert_eq!(crate_of(file).as_deref(), Some("h2"));
    }

    #[test]
    fn an_allocation_is_charged_to_its_innermost_owner_past_the_containers() -> anyhow::Result<()> {
        const REG: &str = "/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f";
        let file = |krate: &str, path: &str| format!("{REG}/{krate}/src/{path}");
        let (bytes_mut, framed_read, server, raw, jemalloc) = (
            file("bytes-1.12.2", "bytes_mut.rs"),
            file("h2-0.4.20", "codec/framed_read.rs"),
            file("hyper-1.12.0", "proto/h2/server.rs"),
            file("tokio-1.54.1", "runtime/task/raw.rs"),
            "/work/main/target/release/build/tikv-jemalloc-sys-0/out/build/src/jemalloc.c",
        );
        let p = profile(&[
            (
                &[
                    ("_rjem_malloc", jemalloc),
                    ("finish_grow", "/rustc/0/library/alloc/src/raw_vec/mod.rs"),
                    ("reserve_inner", &bytes_mut),
                    (
                        "poll_next<hyper_util::rt::tokio::TokioIo<..>>",
                        &framed_read,
                    ),
                    ("poll<..>", &server),
                ],
                100,
            ),
            (
                &[
                    ("_rjem_malloc", jemalloc),
                    ("new<..>", &raw),
                    ("{closure#0}", "/work/main/operator/src/grpc/sync.rs"),
                    (
                        "serve<..>",
                        &file("tonic-0.14.9", "transport/server/mod.rs"),
                    ),
                ],
                30,
            ),
            (
                &[
                    ("_rjem_malloc", jemalloc),
                    ("insert", "/work/main/operator/allocator/src/map/index.rs"),
                ],
                7,
            ),
            // A folded constructor naming another crate is passed over.
            (
                &[
                    ("_rjem_malloc", jemalloc),
                    ("with_capacity", &bytes_mut),
                    ("new", &file("tonic-reflection-0.14.9", "server/mod.rs")),
                    ("endpoint_key_from_wire", "/work/main/proto/src/convert.rs"),
                ],
                3,
            ),
            // No file: the symbol's path names the crate.
            (
                &[
                    ("_rjem_malloc", ""),
                    ("redb::tree_store::page_store::x", ""),
                ],
                5,
            ),
        ]);
        let o = classify(&p)?;
        assert_eq!(o.total_bytes, 145);
        assert_eq!(
            o.owners,
            vec![
                (
                    "HTTP/2 connections (h2: frame buffers, HPACK, streams)".to_owned(),
                    100
                ),
                ("EndpointSync streams (census)".to_owned(), 30),
                ("allocator core (views, identities, indexes)".to_owned(), 7),
                ("store (redb)".to_owned(), 5),
                (
                    "endpoint keys, addresses and labels (census-proto domain values, held by the views)"
                        .to_owned(),
                    3
                ),
            ]
        );
        // The same stacks root first are read the same.
        let mut reversed = p;
        for s in &mut reversed.sample {
            s.location_id.reverse();
        }
        assert_eq!(classify(&reversed)?.owners, o.owners);
        Ok(())
    }
}
