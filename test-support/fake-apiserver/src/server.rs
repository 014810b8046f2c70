//! The server: listener, connections, lifecycle (down/up, shutdown on drop),
//! and the test-facing handle with direct store access.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    sync::{Arc, atomic::AtomicUsize},
    time::Duration,
};

use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use parking_lot::Mutex;
use serde::{Serialize, de::DeserializeOwned};
use serde_json::Value;
use tokio::{net::TcpListener, sync::watch};

use crate::{
    error::Error,
    faults::{FaultState, Faults},
    http,
    log::{RequestLog, RequestRecord, Requests},
    resource::{Gvr, ResourceSpec},
    store::{ObjKey, Store},
};

/// Tunables; the defaults suit tests.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// How often watches that allow bookmarks get a BOOKMARK (the real
    /// server: about once a minute).
    pub bookmark_interval: Duration,
    /// How many changes are kept for watch resumption before the oldest are
    /// compacted (a resume from before them gets 410 Gone).
    pub history_limit: usize,
    /// How many undelivered events a watch may fall behind before the server
    /// closes it, as the real watch cache does with slow watchers.
    pub watch_buffer: usize,
    /// Seed for generated UIDs and names and for probabilistic faults.
    pub seed: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            bookmark_interval: Duration::from_secs(1),
            history_limit: 10_000,
            watch_buffer: 100_000,
            seed: 0,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Availability {
    Up,
    Refusing,
    Hanging,
}

/// State shared by the handle, the connections and the watch tasks.
pub(crate) struct Shared {
    pub(crate) store: Mutex<Store>,
    pub(crate) config: ServerConfig,
    pub(crate) log: RequestLog,
    pub(crate) faults: FaultState,
    pub(crate) availability: watch::Sender<Availability>,
    /// Bumped to close every connection.
    pub(crate) conn_epoch: watch::Sender<u64>,
    /// Bumped to abort every watch stream.
    pub(crate) watch_epoch: watch::Sender<u64>,
    pub(crate) shutdown: watch::Sender<bool>,
    pub(crate) open_watches: AtomicUsize,
    pub(crate) addr: SocketAddr,
    /// The ServiceAccount tokens issued, for TokenReview (`tokenreview`).
    pub(crate) issued_tokens: Mutex<crate::tokenreview::Issued>,
}

impl Shared {
    /// Wait while the server is hanging (returns at once when up).
    pub(crate) async fn wait_serving(&self) {
        let mut rx = self.availability.subscribe();
        // An error means the server is gone; stop waiting.
        let _ = rx.wait_for(|a| *a != Availability::Hanging).await;
    }
}

/// A fake Kubernetes API server on a random loopback port. Dropping it stops
/// the server and closes every connection.
pub struct FakeApiServer {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for FakeApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeApiServer")
            .field("addr", &self.shared.addr)
            .finish_non_exhaustive()
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.shared.shutdown.send_replace(true);
    }
}

impl FakeApiServer {
    /// Start with the default [`ServerConfig`]. Must run inside a tokio runtime.
    pub async fn start() -> Result<Self, Error> {
        Self::start_with(ServerConfig::default()).await
    }

    /// Start with a chosen configuration.
    pub async fn start_with(config: ServerConfig) -> Result<Self, Error> {
        let bind = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let listener = TcpListener::bind(bind)
            .await
            .map_err(|source| Error::Bind { addr: bind, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| Error::Bind { addr: bind, source })?;
        let issued_tokens = Mutex::new(crate::tokenreview::Issued::new(config.seed));
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(
                config.history_limit,
                config.watch_buffer,
                config.seed,
            )),
            faults: FaultState::new(config.seed),
            config,
            log: RequestLog::new(),
            availability: watch::Sender::new(Availability::Up),
            conn_epoch: watch::Sender::new(0),
            watch_epoch: watch::Sender::new(0),
            shutdown: watch::Sender::new(false),
            open_watches: AtomicUsize::new(0),
            addr,
            issued_tokens,
        });
        tokio::spawn(accept_loop(Arc::clone(&shared), listener));
        tracing::info!(%addr, "fake apiserver listening");
        Ok(Self { shared })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.shared.addr)
    }

    /// A kube config for this server (namespace `default`).
    pub fn kube_config(&self) -> Result<kube::Config, Error> {
        let url = self.url();
        let uri = url
            .parse::<::http::Uri>()
            .map_err(|source| Error::Url { url, source })?;
        Ok(kube::Config::new(uri))
    }

    /// A kube client for this server.
    pub fn client(&self) -> Result<kube::Client, Error> {
        kube::Client::try_from(self.kube_config()?).map_err(|source| Error::Client {
            source: Box::new(source),
        })
    }

    /// Write a kubeconfig file pointing at this server, for other processes.
    pub fn write_kubeconfig(&self, path: impl AsRef<Path>) -> Result<(), Error> {
        let path = path.as_ref();
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        );
        std::fs::write(path, text).map_err(|source| Error::WriteKubeconfig {
            path: path.to_owned(),
            source,
        })
    }

    /// Accept a bearer token for a user, as the real server's static token
    /// file (`--token-auth-file`) does; the user is in `groups` and
    /// `system:authenticated`. Requests without a token are
    /// `system:anonymous`; an unknown token gets 401.
    pub fn add_token(&self, token: &str, username: &str, groups: &[&str]) {
        self.shared
            .store
            .lock()
            .admission
            .tokens
            .add(token, username, groups);
    }

    /// Issue a bound ServiceAccount token as the TokenRequest API does for a
    /// pod's projected token volume; `TokenReview` answers for it
    /// (see [`crate::TokenRequest`]). Fails as the real API does when the
    /// ServiceAccount or the pod is missing, or the pod runs as another
    /// ServiceAccount.
    pub fn issue_token(&self, request: &crate::TokenRequest) -> Result<String, Error> {
        let store = self.shared.store.lock();
        let mut issued = self.shared.issued_tokens.lock();
        Ok(crate::tokenreview::issue(
            &store,
            &mut issued,
            request,
            std::time::SystemTime::now(),
        )?)
    }

    /// A kube client that authenticates with a bearer token (see [`Self::add_token`]).
    pub fn client_with_token(&self, token: &str) -> Result<kube::Client, Error> {
        let mut config = self.kube_config()?;
        config.auth_info.token = Some(token.to_owned().into());
        kube::Client::try_from(config).map_err(|source| Error::Client {
            source: Box::new(source),
        })
    }

    /// Write a kubeconfig file whose user authenticates with a bearer token.
    pub fn write_kubeconfig_with_token(
        &self,
        path: impl AsRef<Path>,
        token: &str,
    ) -> Result<(), Error> {
        let path = path.as_ref();
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\nusers:\n- name: fake\n  user:\n    token: {token}\n",
            self.url()
        );
        std::fs::write(path, text).map_err(|source| Error::WriteKubeconfig {
            path: path.to_owned(),
            source,
        })
    }

    /// Write a kubeconfig file whose user impersonates `username` (kubeconfig
    /// `as`/`as-groups`, sent as `Impersonate-User`/`Impersonate-Group`): the way
    /// to name a user to a client such as kubectl, which sends no bearer token
    /// over plain HTTP.
    pub fn write_kubeconfig_as(
        &self,
        path: impl AsRef<Path>,
        username: &str,
        groups: &[&str],
    ) -> Result<(), Error> {
        let path = path.as_ref();
        let groups: Vec<String> = groups.iter().map(|g| format!("\"{g}\"")).collect();
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
             current-context: fake\nusers:\n- name: fake\n  user:\n    as: \"{username}\"\n    as-groups: [{}]\n",
            self.url(),
            groups.join(", ")
        );
        std::fs::write(path, text).map_err(|source| Error::WriteKubeconfig {
            path: path.to_owned(),
            source,
        })
    }

    /// The fault-injection handle.
    pub fn faults(&self) -> Faults {
        Faults {
            shared: Arc::clone(&self.shared),
        }
    }

    /// A snapshot of the request log.
    pub fn requests(&self) -> Requests {
        self.shared.log.snapshot()
    }

    /// Empty the request log.
    pub fn clear_requests(&self) {
        self.shared.log.clear();
    }

    /// Wait until a logged request satisfies `pred` (including ones already
    /// logged); `None` on timeout.
    pub async fn wait_for_request(
        &self,
        pred: impl Fn(&RequestRecord) -> bool,
        timeout: Duration,
    ) -> Option<RequestRecord> {
        self.shared.log.wait_for(pred, timeout).await
    }

    /// How many watch streams are open.
    pub fn open_watches(&self) -> usize {
        self.shared
            .open_watches
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The current (global) resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store.lock().rv()
    }

    // ---- direct store access -------------------------------------------

    /// Serve another resource, e.g. a CRD's, without creating a CRD object.
    pub fn register_resource(&self, spec: ResourceSpec) {
        self.shared.store.lock().register(spec);
    }

    fn resolve(&self, gvr: &Gvr) -> Result<usize, Error> {
        self.shared
            .store
            .lock()
            .resolve(gvr)
            .ok_or_else(|| Error::UnknownResource { gvr: gvr.clone() })
    }

    /// Create or replace an object directly (no HTTP, no create rules: the
    /// status is kept as given). Its `apiVersion`/`kind` pick the resource;
    /// a missing namespace is `default` and is created if needed. Watches see
    /// it. Returns the stored object.
    pub fn insert(&self, obj: impl Serialize) -> Result<Value, Error> {
        let obj = serde_json::to_value(obj)?;
        let stored = self.shared.store.lock().seed(obj)?;
        Ok((*stored).clone())
    }

    /// Insert many objects under one lock (fast seeding); returns how many.
    pub fn insert_many<T: Serialize>(
        &self,
        objs: impl IntoIterator<Item = T>,
    ) -> Result<usize, Error> {
        let values = objs
            .into_iter()
            .map(serde_json::to_value)
            .collect::<Result<Vec<_>, _>>()?;
        let mut store = self.shared.store.lock();
        let n = values.len();
        for v in values {
            store.seed(v)?;
        }
        Ok(n)
    }

    /// One object, as stored.
    pub fn get(&self, gvr: &Gvr, namespace: Option<&str>, name: &str) -> Option<Value> {
        let store = self.shared.store.lock();
        let res = store.resolve(gvr)?;
        store
            .get(res, &ObjKey::new(namespace.unwrap_or_default(), name))
            .ok()
            .map(|o| (*o).clone())
    }

    /// One object of a kube-rs typed resource (cluster-scoped: `namespace` None).
    pub fn get_as<K>(&self, namespace: Option<&str>, name: &str) -> Result<Option<K>, Error>
    where
        K: kube::Resource<DynamicType = ()> + DeserializeOwned,
    {
        self.get(&Gvr::of::<K>(), namespace, name)
            .map(serde_json::from_value)
            .transpose()
            .map_err(Error::from)
    }

    /// All objects of a resource, sorted by namespace and name.
    pub fn list(&self, gvr: &Gvr) -> Vec<Value> {
        let store = self.shared.store.lock();
        store
            .resolve(gvr)
            .map(|res| store.all(res).iter().map(|o| (**o).clone()).collect())
            .unwrap_or_default()
    }

    /// How many objects a resource holds.
    pub fn count(&self, gvr: &Gvr) -> usize {
        let store = self.shared.store.lock();
        store.resolve(gvr).map_or(0, |res| store.count(res))
    }

    /// Delete an object at once, ignoring finalizers (watches see DELETED);
    /// returns its last state.
    pub fn delete(&self, gvr: &Gvr, namespace: Option<&str>, name: &str) -> Option<Value> {
        let mut store = self.shared.store.lock();
        let res = store.resolve(gvr)?;
        store
            .remove(res, &ObjKey::new(namespace.unwrap_or_default(), name))
            .map(|o| (*o).clone())
    }

    /// Edit an object behind every client's back: a new resourceVersion and
    /// a MODIFIED event, no validation.
    pub fn modify(
        &self,
        gvr: &Gvr,
        namespace: Option<&str>,
        name: &str,
        edit: impl FnOnce(&mut Value),
    ) -> Result<Value, Error> {
        let res = self.resolve(gvr)?;
        let key = ObjKey::new(namespace.unwrap_or_default(), name);
        let obj = self.shared.store.lock().modify(res, &key, edit)?;
        Ok((*obj).clone())
    }

    /// Set an annotation behind every client's back.
    pub fn annotate(
        &self,
        gvr: &Gvr,
        namespace: Option<&str>,
        name: &str,
        key: &str,
        value: &str,
    ) -> Result<Value, Error> {
        let res = self.resolve(gvr)?;
        let obj_key = ObjKey::new(namespace.unwrap_or_default(), name);
        let obj = self
            .shared
            .store
            .lock()
            .annotate(res, &obj_key, key, value)?;
        Ok((*obj).clone())
    }
}

async fn accept_loop(shared: Arc<Shared>, listener: TcpListener) {
    let router = http::router(Arc::clone(&shared));
    let mut listener = Some(listener);
    let mut availability = shared.availability.subscribe();
    let mut shutdown = shared.shutdown.subscribe();
    loop {
        if *shutdown.borrow() {
            return;
        }
        let refusing = *availability.borrow_and_update() == Availability::Refusing;
        if refusing {
            listener = None;
        } else if listener.is_none() {
            match TcpListener::bind(shared.addr).await {
                Ok(l) => listener = Some(l),
                Err(error) => {
                    tracing::warn!(%error, addr = %shared.addr, "fake apiserver cannot re-bind; retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            }
        }
        let accepted = async {
            match &listener {
                Some(l) => l.accept().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = availability.changed() => {}
            accepted = accepted => match accepted {
                Ok((stream, _)) => {
                    let service = TowerToHyperService::new(router.clone());
                    tokio::spawn(serve_connection(Arc::clone(&shared), stream, service));
                }
                Err(error) => tracing::warn!(%error, "fake apiserver accept failed"),
            },
        }
    }
}

async fn serve_connection(
    shared: Arc<Shared>,
    stream: tokio::net::TcpStream,
    service: TowerToHyperService<axum::Router>,
) {
    let mut epoch = shared.conn_epoch.subscribe();
    let mut shutdown = shared.shutdown.subscribe();
    let conn =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::select! {
        result = conn => {
            if let Err(error) = result {
                tracing::debug!(%error, "fake apiserver connection ended with an error");
            }
        }
        _ = epoch.changed() => {}
        _ = shutdown.changed() => {}
    }
}
