//! A real census-operator in this process, on 127.0.0.1: its redb store in a
//! temporary directory, short timers, and typed calls to its services.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use census_operator::{
    config::Cli,
    daemon::{self, Running},
};
use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, identity_service_client::IdentityServiceClient,
        node_service_client::NodeServiceClient,
    },
};
use clap::Parser as _;
use tempfile::TempDir;
use tonic::{Status, transport::Channel};

use crate::{ANSWER_TIMEOUT, TestResult, fail, http_get, init_tracing, strings};

/// A real operator on 127.0.0.1 with its store in a directory of the test's.
#[derive(Debug)]
pub struct Operator {
    running: Running,
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    store_dir: PathBuf,
    // Dropped after the operator: the store file lives here (unless the test
    // passed a directory of its own).
    _dir: Option<TempDir>,
}

/// Flags every test operator gets unless the test passes them itself.
const DEFAULTS: &[(&str, &str)] = &[
    ("--grpc-listen", "127.0.0.1:0"),
    ("--admin-listen", "127.0.0.1:0"),
    // A fresh store would refuse new ids for a node TTL; tests opt in to that.
    ("--adoption-window", "0s"),
    ("--tick-interval", "50ms"),
];

/// The flags of an operator that agents under test talk to: snapshots every second
/// and a one-second grace period, so what an agent stops using goes quickly.
pub const FAST_AGENTS: &[&str] = &["--snapshot-interval", "1s", "--grace-period", "1s"];

/// How long a shutdown may take before the test fails.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(20);

impl Operator {
    /// Starts an operator with `args` (flags as on the command line) on top of the
    /// defaults (any port, no adoption window, 50 ms ticks), with its store in a
    /// temporary directory of its own.
    pub async fn start(args: &[&str]) -> TestResult<Self> {
        let dir = tempfile::tempdir()?;
        let store_dir = dir.path().to_owned();
        Self::launch(store_dir, Some(dir), args, &[]).await
    }

    /// Like [`Operator::start`], leaving out the defaults of the flags in `omit`.
    pub async fn start_without(omit: &[&str], args: &[&str]) -> TestResult<Self> {
        let dir = tempfile::tempdir()?;
        let store_dir = dir.path().to_owned();
        Self::launch(store_dir, Some(dir), args, omit).await
    }

    /// Like [`Operator::start`], with the store in `dir` (the test's, so a later
    /// operator can start on the same store).
    pub async fn start_in(dir: &Path, args: &[&str]) -> TestResult<Self> {
        Self::launch(dir.to_owned(), None, args, &[]).await
    }

    /// An operator that agents under test talk to, with its store in `dir`, on
    /// `port` (0: any), with [`FAST_AGENTS`].
    pub async fn for_agents(dir: &Path, port: u16) -> TestResult<Self> {
        let listen = format!("127.0.0.1:{port}");
        let mut args = vec!["--grpc-listen", &listen];
        args.extend_from_slice(FAST_AGENTS);
        Self::start_in(dir, &args).await
    }

    async fn launch(
        store_dir: PathBuf,
        dir: Option<TempDir>,
        args: &[&str],
        omit: &[&str],
    ) -> TestResult<Self> {
        init_tracing();
        let store = store_dir.join("census.redb");
        let store = store
            .to_str()
            .ok_or("the store directory's path is not UTF-8")?
            .to_owned();
        let mut argv: Vec<String> = vec!["census-operator".into(), "--store-path".into(), store];
        for (flag, value) in DEFAULTS {
            if !args.contains(flag) && !omit.contains(flag) {
                argv.push((*flag).into());
                argv.push((*value).into());
            }
        }
        argv.extend(args.iter().map(|a| (*a).to_owned()));
        let cli = Cli::try_parse_from(&argv)?;
        let running = daemon::start(cli).await?;
        Ok(Self {
            grpc_addr: running.grpc_addr,
            admin_addr: running.admin_addr,
            running,
            store_dir,
            _dir: dir,
        })
    }

    /// `http://` and the gRPC address, as agents and the CLI are configured.
    pub fn url(&self) -> String {
        format!("http://{}", self.grpc_addr)
    }

    /// The daemon itself, for tests that look inside.
    pub fn running(&self) -> &Running {
        &self.running
    }

    pub async fn channel(&self) -> TestResult<Channel> {
        let endpoint = Channel::from_shared(self.url())?.connect_timeout(ANSWER_TIMEOUT);
        Ok(endpoint.connect().await?)
    }

    pub async fn identities(&self) -> TestResult<IdentityServiceClient<Channel>> {
        Ok(IdentityServiceClient::new(self.channel().await?))
    }

    pub async fn nodes(&self) -> TestResult<NodeServiceClient<Channel>> {
        Ok(NodeServiceClient::new(self.channel().await?))
    }

    /// A Watch of the identities, from its full list on.
    pub async fn watch(&self) -> TestResult<IdentityWatch> {
        let stream = self
            .identities()
            .await?
            .watch(pb::WatchRequest {
                protocol_version: PROTOCOL_VERSION,
            })
            .await?
            .into_inner();
        Ok(IdentityWatch(stream))
    }

    /// Stops the operator the way the daemon does on SIGTERM; fails if that hangs.
    pub async fn shut_down(self) -> TestResult {
        let Self { running, _dir, .. } = self;
        tokio::time::timeout(SHUTDOWN_TIMEOUT, running.shut_down())
            .await
            .map_err(|_| format!("the operator did not shut down within {SHUTDOWN_TIMEOUT:?}"))?;
        Ok(())
    }

    /// Shuts down and starts again on the same store with `args`.
    pub async fn restart(self, args: &[&str]) -> TestResult<Self> {
        let Self {
            running,
            store_dir,
            _dir: dir,
            ..
        } = self;
        tokio::time::timeout(SHUTDOWN_TIMEOUT, running.shut_down())
            .await
            .map_err(|_| format!("the operator did not shut down within {SHUTDOWN_TIMEOUT:?}"))?;
        Self::launch(store_dir, dir, args, &[]).await
    }

    /// Allocates `labels` for `node` in `session`, not numbered (as an agent that
    /// numbers none); the gRPC answer as it is.
    pub async fn allocate(
        &self,
        node: &str,
        session: pb::Session,
        labels: &[&str],
    ) -> TestResult<Result<pb::Identity, Status>> {
        self.allocate_numbered(node, session, 0, labels).await
    }

    /// Allocates `labels` as the agent's allocation `allocation`; the gRPC answer
    /// as it is.
    pub async fn allocate_numbered(
        &self,
        node: &str,
        session: pb::Session,
        allocation: u64,
        labels: &[&str],
    ) -> TestResult<Result<pb::Identity, Status>> {
        let mut client = self.identities().await?;
        let answer = client
            .allocate(pb::AllocateRequest {
                protocol_version: PROTOCOL_VERSION,
                node: node.into(),
                session: Some(session),
                labels: strings(labels),
                allocation,
            })
            .await;
        Ok(match answer {
            Ok(resp) => Ok(resp
                .into_inner()
                .identity
                .ok_or("AllocateResponse without an identity")?),
            Err(status) => Err(status),
        })
    }

    /// Allocates and insists on success.
    pub async fn allocate_ok(
        &self,
        node: &str,
        session: pb::Session,
        labels: &[&str],
    ) -> TestResult<pb::Identity> {
        match self.allocate(node, session, labels).await? {
            Ok(identity) => Ok(identity),
            Err(status) => fail(format!("Allocate {labels:?} failed: {status:?}")),
        }
    }

    pub async fn get(&self, id: u32) -> TestResult<Result<pb::Identity, Status>> {
        let mut client = self.identities().await?;
        Ok(client
            .get(pb::GetRequest {
                protocol_version: PROTOCOL_VERSION,
                id,
            })
            .await
            .map(tonic::Response::into_inner))
    }

    pub async fn get_node(&self, name: &str) -> TestResult<Result<pb::Node, Status>> {
        let mut client = self.nodes().await?;
        Ok(client
            .get_node(pb::GetNodeRequest {
                protocol_version: PROTOCOL_VERSION,
                name: name.into(),
            })
            .await
            .map(tonic::Response::into_inner))
    }

    pub async fn get_node_ok(&self, name: &str) -> TestResult<pb::Node> {
        match self.get_node(name).await? {
            Ok(node) => Ok(node),
            Err(status) => fail(format!("GetNode {name} failed: {status:?}")),
        }
    }

    /// Every identity, quarantined ones too, in id order (all pages).
    pub async fn list_all(&self) -> TestResult<Vec<pb::Identity>> {
        self.list(&[], true).await
    }

    /// The identities whose labels include `selector`, in id order, read a few at a
    /// time so that paging is exercised.
    pub async fn list(
        &self,
        selector: &[&str],
        include_quarantined: bool,
    ) -> TestResult<Vec<pb::Identity>> {
        let mut client = self.identities().await?;
        let page_size = if selector.is_empty() { 1000 } else { 2 };
        let mut all = Vec::new();
        let mut page_token = String::new();
        loop {
            let page = client
                .list(pb::ListRequest {
                    protocol_version: PROTOCOL_VERSION,
                    page_size,
                    page_token,
                    selector: strings(selector),
                    include_quarantined,
                })
                .await?
                .into_inner();
            all.extend(page.identities);
            if page.next_page_token.is_empty() {
                return Ok(all);
            }
            page_token = page.next_page_token;
        }
    }

    /// What the operator shows of its state, without what moves by itself (when a
    /// node was last heard, whether its stream is open): equal before and after a
    /// refused request.
    pub async fn observe(&self) -> TestResult<Observed> {
        let identities = self.list_all().await?;
        let mut client = self.nodes().await?;
        let mut nodes = client
            .list_nodes(pb::ListNodesRequest {
                protocol_version: PROTOCOL_VERSION,
            })
            .await?
            .into_inner()
            .nodes;
        for node in &mut nodes {
            node.last_heard_ms = 0;
            node.connected = false;
        }
        Ok(Observed { identities, nodes })
    }

    /// GET on the admin port: status code and body.
    pub async fn admin_get(&self, path: &str) -> TestResult<(u16, String, String)> {
        http_get(self.admin_addr, path).await
    }
}

/// The operator's state as the services show it; see [`Operator::observe`].
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    pub identities: Vec<pb::Identity>,
    pub nodes: Vec<pb::Node>,
}

impl Observed {
    pub fn node(&self, name: &str) -> Option<&pb::Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    pub fn identity(&self, id: u32) -> Option<&pb::Identity> {
        self.identities.iter().find(|i| i.id == id)
    }
}

/// A channel to `addr` that connects on first use and reconnects after the
/// operator restarts on the same address.
pub fn lazy_channel(addr: SocketAddr) -> TestResult<Channel> {
    Ok(Channel::from_shared(format!("http://{addr}"))?
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy())
}

/// The operator's identity `id`, if it answers with one.
pub async fn identity(channel: &Channel, id: u32) -> Option<pb::Identity> {
    IdentityServiceClient::new(channel.clone())
        .get(pb::GetRequest {
            protocol_version: PROTOCOL_VERSION,
            id,
        })
        .await
        .ok()
        .map(tonic::Response::into_inner)
}

/// The operator's view of `node`, if it answers with one.
pub async fn node(channel: &Channel, name: &str) -> Option<pb::Node> {
    NodeServiceClient::new(channel.clone())
        .get_node(pb::GetNodeRequest {
            protocol_version: PROTOCOL_VERSION,
            name: name.to_owned(),
        })
        .await
        .ok()
        .map(tonic::Response::into_inner)
}

/// An IdentityService Watch stream.
#[derive(Debug)]
pub struct IdentityWatch(tonic::Streaming<pb::WatchEvent>);

impl IdentityWatch {
    /// The next event; fails if none comes within [`ANSWER_TIMEOUT`] or the watch ends.
    pub async fn next(&mut self) -> TestResult<pb::WatchEvent> {
        tokio::time::timeout(ANSWER_TIMEOUT, self.0.message())
            .await
            .map_err(|_| format!("no watch event within {ANSWER_TIMEOUT:?}"))??
            .ok_or_else(|| "the watch ended".into())
    }
}
