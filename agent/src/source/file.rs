//! The file endpoint source: a JSON (`.json`) or YAML (`.yaml`, `.yml`) list of
//! endpoints, for running census without a cluster.
//!
//! ```yaml
//! - namespace: default
//!   name: web-0
//!   ips: [198.18.1.2, "2001:2:0:1::2"]
//!   labels: {app: web}
//!   service_account: web        # default: "default"
//!   interface: vethweb0         # the host side, in the agent's network namespace
//! ```
//!
//! The file is re-read when its directory changes (inotify, through `notify`; the
//! directory rather than the file, so that editors' and Kubernetes ConfigMaps'
//! rename-into-place updates are seen) and every `resync` interval as a safety net.
//! A read that fails (missing file, bad syntax, an invalid entry, an empty file) is
//! reported as [`SourceEvent::Failed`] naming the file and the problem, and the last
//! good set stays in force. An empty file is refused rather than read as "no
//! endpoints": a writer that truncates before it writes would otherwise wipe the node
//! for a moment. `[]` means no endpoints.

use std::{
    collections::{BTreeMap, HashMap},
    fs, io,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use census_proto::{
    domain::{EndpointKey, NameError, UnusableIp, canonical_ips, check_usable_ip},
    labels::{LabelError, LabelFilter, LabelLimits, LabelSet},
};
use notify::{RecursiveMode, Watcher as _};
use serde::Deserialize;
use tokio::sync::{mpsc, watch};
use tracing::{Instrument as _, debug, info, info_span, warn};

use super::{BoxFuture, EndpointSource, HostInterface, SourceEndpoint, SourceEvent, SourceFailure};

/// Changes in the directory closer together than this are read once.
const DEBOUNCE: Duration = Duration::from_millis(20);

/// The service account of an entry that names none, as in Kubernetes.
const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// Syntax of the endpoints file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Yaml,
}

impl Format {
    /// The format named by `path`'s extension.
    pub fn of(path: &Path) -> Option<Self> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("json") => Some(Self::Json),
            Some("yaml" | "yml") => Some(Self::Yaml),
            _ => None,
        }
    }
}

/// Why the endpoints file could not be used. Every message starts with the file.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{}: unknown format: the name must end in .json, .yaml or .yml", path.display())]
    UnknownFormat { path: PathBuf },
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{}: the file is empty (write `[]` for no endpoints)", path.display())]
    Empty { path: PathBuf },
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{}: invalid YAML: {source}", path.display())]
    Yaml {
        path: PathBuf,
        #[source]
        source: serde_yaml_ng::Error,
    },
    #[error("{}: endpoint {index} ({name}): {problem}", path.display())]
    Invalid {
        path: PathBuf,
        /// Position in the list, from 0.
        index: usize,
        /// `namespace/name` as written.
        name: String,
        problem: EntryProblem,
    },
}

impl FileError {
    /// A bounded metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::UnknownFormat { .. } => "format",
            Self::Read { .. } => "read",
            Self::Empty { .. } => "empty",
            Self::Json { .. } | Self::Yaml { .. } => "parse",
            Self::Invalid { .. } => "invalid",
        }
    }
}

/// What is wrong with one entry of the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntryProblem {
    #[error("{0}")]
    Name(#[from] NameError),
    #[error("ips[{index}]: {value:?} is not an IPv4 or IPv6 address")]
    Ip { index: usize, value: String },
    #[error("ips[{index}]: {ip} is {what}: no endpoint has it")]
    UnusableIp {
        index: usize,
        ip: IpAddr,
        what: UnusableIp,
    },
    #[error("ips: at least one address is needed")]
    NoIps,
    #[error("labels: {0}")]
    Labels(#[from] LabelError),
    #[error("interface {name:?} {reason}")]
    Interface { name: String, reason: &'static str },
    #[error("the same namespace/name as endpoint {first}")]
    DuplicateKey { first: usize },
    #[error("address {ip} is also endpoint {first}'s")]
    DuplicateIp { ip: IpAddr, first: usize },
}

/// One entry as written in the file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    namespace: String,
    name: String,
    #[serde(default)]
    ips: Vec<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    service_account: Option<String>,
    interface: String,
}

/// Parses the content of an endpoints file of `format`; errors name `path`.
pub fn parse(path: &Path, format: Format, bytes: &[u8]) -> Result<Vec<SourceEndpoint>, FileError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(FileError::Empty {
            path: path.to_owned(),
        });
    }
    let entries: Vec<Entry> = match format {
        Format::Json => serde_json::from_slice(bytes).map_err(|source| FileError::Json {
            path: path.to_owned(),
            source,
        })?,
        Format::Yaml => serde_yaml_ng::from_slice(bytes).map_err(|source| FileError::Yaml {
            path: path.to_owned(),
            source,
        })?,
    };
    let mut keys: HashMap<EndpointKey, usize> = HashMap::with_capacity(entries.len());
    let mut ips: HashMap<IpAddr, usize> = HashMap::with_capacity(entries.len());
    let mut endpoints = Vec::with_capacity(entries.len());
    for (index, entry) in entries.into_iter().enumerate() {
        let invalid = |problem: EntryProblem| FileError::Invalid {
            path: path.to_owned(),
            index,
            name: format!("{}/{}", entry.namespace, entry.name),
            problem,
        };
        let endpoint = check_entry(&entry).map_err(invalid)?;
        if let Some(&first) = keys.get(&endpoint.key) {
            return Err(invalid(EntryProblem::DuplicateKey { first }));
        }
        for ip in &endpoint.ips {
            if let Some(&first) = ips.get(ip) {
                return Err(invalid(EntryProblem::DuplicateIp { ip: *ip, first }));
            }
            ips.insert(*ip, index);
        }
        keys.insert(endpoint.key.clone(), index);
        endpoints.push(endpoint);
    }
    Ok(endpoints)
}

fn check_entry(entry: &Entry) -> Result<SourceEndpoint, EntryProblem> {
    let key = EndpointKey::new(&entry.namespace, &entry.name)?;
    let mut ips = Vec::with_capacity(entry.ips.len());
    for (index, text) in entry.ips.iter().enumerate() {
        let ip = text.trim().parse().map_err(|_| EntryProblem::Ip {
            index,
            value: census_proto::text::cut(text, 64).into_owned(),
        })?;
        check_usable_ip(ip).map_err(|what| EntryProblem::UnusableIp { index, ip, what })?;
        ips.push(ip);
    }
    if ips.is_empty() {
        return Err(EntryProblem::NoIps);
    }
    let service_account = entry
        .service_account
        .clone()
        .unwrap_or_else(|| DEFAULT_SERVICE_ACCOUNT.to_owned());
    // The syntax of every label (and of the namespace and service account as label
    // values) is checked here, with nothing filtered out, so that a bad file is
    // refused as a whole; the label filter and the label limit are the operator's
    // and are applied by the agent.
    let keep_all = LabelFilter::new(Vec::new(), Vec::new(), false);
    let unlimited = LabelLimits {
        max_labels: usize::MAX / 8,
    };
    LabelSet::for_pod(
        &entry.labels,
        &entry.namespace,
        &service_account,
        &keep_all,
        &unlimited,
    )?;
    check_interface(&entry.interface)?;
    Ok(SourceEndpoint {
        key,
        ips: canonical_ips(ips),
        labels: entry.labels.clone(),
        service_account,
        interface: HostInterface::Named(entry.interface.clone()),
    })
}

/// The checks the kernel makes of an interface name (`dev_valid_name`).
fn check_interface(name: &str) -> Result<(), EntryProblem> {
    let reason = if name.is_empty() {
        Some("is empty")
    } else if name.len() > 15 {
        Some("is longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("is not a name")
    } else if name
        .chars()
        .any(|c| c == '/' || c == ':' || c == '\0' || c.is_whitespace())
    {
        Some("contains '/', ':', NUL or whitespace")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(EntryProblem::Interface {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// The file source; see the module documentation.
#[derive(Debug, Clone)]
pub struct FileSource {
    path: PathBuf,
    format: Format,
    resync: Duration,
}

impl FileSource {
    /// A source reading `path` (whose extension gives the format), re-read at
    /// least every `resync`.
    pub fn new(path: impl Into<PathBuf>, resync: Duration) -> Result<Self, FileError> {
        let path = path.into();
        let format =
            Format::of(&path).ok_or_else(|| FileError::UnknownFormat { path: path.clone() })?;
        Ok(Self {
            path,
            format,
            resync,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads and parses the file once.
    pub fn read(&self) -> Result<Vec<SourceEndpoint>, FileError> {
        let bytes = fs::read(&self.path).map_err(|source| FileError::Read {
            path: self.path.clone(),
            source,
        })?;
        parse(&self.path, self.format, &bytes)
    }

    async fn watch(self, events: mpsc::Sender<SourceEvent>, mut shutdown: watch::Receiver<bool>) {
        let (changed_tx, mut changed) = mpsc::channel::<()>(1);
        let mut watcher = None;
        let mut state = ReadState::default();
        let mut resync = tokio::time::interval(self.resync);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if watcher.is_none() {
                watcher = self.start_watcher(changed_tx.clone());
            }
            if let Some(event) = state.reread(&self)
                && events.send(event).await.is_err()
            {
                return;
            }
            tokio::select! {
                _ = resync.tick() => {}
                Some(()) = changed.recv() => {
                    // Let a burst of changes (write, rename, chmod) settle.
                    tokio::time::sleep(DEBOUNCE).await;
                    while changed.try_recv().is_ok() {}
                }
                () = crate::shutdown::stopped(&mut shutdown) => return,
            }
        }
    }

    /// Watches the file's directory; `None` (and a warning) if that fails, in which
    /// case the periodic re-read still sees changes.
    fn start_watcher(&self, changed: mpsc::Sender<()>) -> Option<notify::RecommendedWatcher> {
        let dir = match self.path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
            _ => PathBuf::from("."),
        };
        let handler = move |event: notify::Result<notify::Event>| {
            if event.is_ok() {
                // Full means a read is already due.
                let _ = changed.try_send(());
            }
        };
        let result = notify::recommended_watcher(handler)
            .and_then(|mut w| w.watch(&dir, RecursiveMode::NonRecursive).map(|()| w));
        match result {
            Ok(watcher) => {
                debug!(dir = %dir.display(), "watching for changes");
                Some(watcher)
            }
            Err(error) => {
                warn!(
                    dir = %dir.display(),
                    %error,
                    resync = ?self.resync,
                    "cannot watch the endpoints file's directory; re-reading it periodically only"
                );
                None
            }
        }
    }
}

/// What the last read gave, to send only what changed.
#[derive(Debug, Default)]
struct ReadState {
    /// The bytes of the last read, good or bad.
    last_bytes: Option<Vec<u8>>,
    /// The last failure reported, until a good read.
    failed: Option<String>,
    /// The last good set sent.
    sent: Option<Vec<SourceEndpoint>>,
}

impl ReadState {
    fn reread(&mut self, source: &FileSource) -> Option<SourceEvent> {
        let result = fs::read(&source.path)
            .map_err(|e| FileError::Read {
                path: source.path.clone(),
                source: e,
            })
            .and_then(|bytes| {
                if self.last_bytes.as_deref() == Some(bytes.as_slice()) && self.failed.is_none() {
                    return Ok(None);
                }
                let parsed = parse(&source.path, source.format, &bytes);
                self.last_bytes = Some(bytes);
                parsed.map(Some)
            });
        match result {
            Ok(None) => None,
            Ok(Some(set)) => {
                let recovered = self.failed.take().is_some();
                if !recovered && self.sent.as_ref() == Some(&set) {
                    return None;
                }
                info!(endpoints = set.len(), "read the endpoints file");
                self.sent = Some(set.clone());
                Some(SourceEvent::Reset(set))
            }
            Err(error) => {
                let detail = error.to_string();
                if self.failed.as_ref() == Some(&detail) {
                    return None;
                }
                warn!(error = %detail, "the endpoints file is not usable; the last good set stays in force");
                self.failed = Some(detail.clone());
                if matches!(error, FileError::Read { .. }) {
                    self.last_bytes = None;
                }
                Some(SourceEvent::Failed(SourceFailure {
                    kind: error.kind(),
                    detail,
                }))
            }
        }
    }
}

impl EndpointSource for FileSource {
    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }

    fn run(
        self: Box<Self>,
        events: mpsc::Sender<SourceEvent>,
        shutdown: watch::Receiver<bool>,
    ) -> BoxFuture {
        let span = info_span!("source", file = %self.path.display());
        Box::pin((*self).watch(events, shutdown).instrument(span))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    const YAML: &str = "
- namespace: default
  name: web-0
  ips: [198.18.1.2, '2001:2:0:1::2']
  labels: {app: web, pod-template-hash: abc}
  service_account: web
  interface: vethweb0
- namespace: default
  name: db-0
  ips: [198.18.2.2]
  interface: vethdb0
";

    fn parse_str(name: &str, text: &str) -> Result<Vec<SourceEndpoint>, FileError> {
        let path = Path::new(name);
        let format = Format::of(path).ok_or("no format");
        parse(path, format.unwrap_or(Format::Json), text.as_bytes())
    }

    fn message(result: Result<Vec<SourceEndpoint>, FileError>) -> String {
        result.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn reads_yaml() -> TestResult {
        let set = parse_str("/etc/census/endpoints.yaml", YAML)?;
        assert_eq!(set.len(), 2);
        let web = &set[0];
        assert_eq!(web.key.as_str(), "default/web-0");
        assert_eq!(web.ips.len(), 2);
        assert_eq!(web.labels.get("app").map(String::as_str), Some("web"));
        assert_eq!(web.service_account, "web");
        assert_eq!(web.interface.name(), Some("vethweb0"));
        assert_eq!(set[1].service_account, "default");
        assert!(set[1].labels.is_empty());
        Ok(())
    }

    #[test]
    fn reads_json_the_same() -> TestResult {
        let json = r#"[
          {"namespace": "default", "name": "web-0", "ips": ["2001:2:0:1::2", "198.18.1.2"],
           "labels": {"app": "web", "pod-template-hash": "abc"}, "service_account": "web",
           "interface": "vethweb0"},
          {"namespace": "default", "name": "db-0", "ips": ["198.18.2.2"], "interface": "vethdb0"}
        ]"#;
        assert_eq!(
            parse_str("e.json", json)?,
            parse_str("e.yml", YAML)?,
            "addresses are sorted, formats agree"
        );
        Ok(())
    }

    #[test]
    fn errors_name_the_file_and_the_problem() {
        let cases = [
            (
                "/x/e.json",
                "[{",
                "/x/e.json: invalid JSON: EOF while parsing",
            ),
            ("/x/e.yaml", "- namespace: [", "/x/e.yaml: invalid YAML: "),
            (
                "/x/e.yaml",
                "  \n",
                "/x/e.yaml: the file is empty (write `[]` for no endpoints)",
            ),
            (
                "/x/e.yaml",
                "- {namespace: default, name: a, ips: [1.2.3.4], interface: x, lables: {}}",
                "/x/e.yaml: invalid YAML: .[0]: unknown field `lables`",
            ),
            (
                "/x/e.yaml",
                "- {namespace: Default, name: a, ips: [1.2.3.4], interface: x}",
                "/x/e.yaml: endpoint 0 (Default/a): namespace \"Default\" is not a DNS label",
            ),
            (
                "/x/e.yaml",
                "- {namespace: d, name: a, ips: [1.2.3.4, nope], interface: x}",
                "/x/e.yaml: endpoint 0 (d/a): ips[1]: \"nope\" is not an IPv4 or IPv6 address",
            ),
            (
                "/x/e.yaml",
                "- {namespace: d, name: a, ips: [198.18.0.1, 127.0.0.1], interface: x}",
                "/x/e.yaml: endpoint 0 (d/a): ips[1]: 127.0.0.1 is a loopback address: no endpoint has it",
            ),
            (
                "/x/e.yaml",
                "- {namespace: d, name: a, ips: ['fe80::1'], interface: x}",
                "/x/e.yaml: endpoint 0 (d/a): ips[0]: fe80::1 is a link-local address",
            ),
            (
                "/x/e.yaml",
                "- {namespace: d, name: a, interface: x}",
                "/x/e.yaml: endpoint 0 (d/a): ips: at least one address is needed",
            ),
            (
                "/x/e.yaml",
                "- {namespace: d, name: a, ips: [1.2.3.4], labels: {'-bad': x}, interface: x}",
                "/x/e.yaml: endpoint 0 (d/a): labels: label \"k8s:-bad=x\"",
            ),
            (
                "/x/e.yaml",
                "- {namespace: d, name: a, ips: [1.2.3.4], interface: a-very-long-interface}",
                "/x/e.yaml: endpoint 0 (d/a): interface \"a-very-long-interface\" is longer than 15 bytes",
            ),
            (
                "/x/e.yaml",
                "- {namespace: d, name: a, ips: [1.2.3.4], interface: x}\n- {namespace: d, name: a, ips: [1.2.3.5], interface: y}",
                "/x/e.yaml: endpoint 1 (d/a): the same namespace/name as endpoint 0",
            ),
            (
                "/x/e.yaml",
                "- {namespace: d, name: a, ips: [1.2.3.4], interface: x}\n- {namespace: d, name: b, ips: [1.2.3.4], interface: y}",
                "/x/e.yaml: endpoint 1 (d/b): address 1.2.3.4 is also endpoint 0's",
            ),
        ];
        for (name, text, want) in cases {
            let got = message(parse_str(name, text));
            assert!(got.starts_with(want), "{got:?} should start with {want:?}");
        }
    }

    /// `::ffff:a.b.c.d` is the IPv4 address: the same address as `a.b.c.d` in
    /// another entry, and read as IPv4.
    #[test]
    fn an_ipv4_mapped_address_is_its_ipv4_address() -> TestResult {
        let set = parse_str(
            "e.yaml",
            "- {namespace: d, name: a, ips: ['::ffff:198.18.9.9', 198.18.9.9], interface: x}",
        )?;
        let want: IpAddr = [198, 18, 9, 9].into();
        assert_eq!(set.first().map(|e| &*e.ips), Some(&[want][..]));
        let both = "- {namespace: d, name: a, ips: ['::ffff:198.18.9.9'], interface: x}\n- {namespace: d, name: b, ips: [198.18.9.9], interface: y}";
        let got = message(parse_str("/x/e.yaml", both));
        assert!(
            got.starts_with("/x/e.yaml: endpoint 1 (d/b): address 198.18.9.9 is also endpoint 0's"),
            "{got:?}"
        );
        Ok(())
    }

    #[test]
    fn an_empty_list_is_no_endpoints() -> TestResult {
        assert!(parse_str("e.json", "[]")?.is_empty());
        assert!(parse_str("e.yaml", "[]")?.is_empty());
        Ok(())
    }

    #[test]
    fn unknown_extensions_are_refused() {
        let err = FileSource::new("/x/endpoints.txt", Duration::from_secs(1))
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("/x/endpoints.txt: unknown format: the name must end in .json, .yaml or .yml")
        );
    }

    fn write(path: &Path, text: &str) -> TestResult {
        // Written beside and renamed into place, as careful writers do.
        let tmp = path.with_extension("tmp");
        let mut file = fs::File::create(&tmp)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        fs::rename(&tmp, path)?;
        Ok(())
    }

    async fn next(events: &mut mpsc::Receiver<SourceEvent>) -> Result<SourceEvent, String> {
        tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .map_err(|_| "no event within 10 s".to_owned())?
            .ok_or_else(|| "the source stopped".to_owned())
    }

    #[tokio::test]
    async fn reloads_on_change_and_keeps_the_last_good_set() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("endpoints.yaml");
        write(&path, YAML)?;
        // A long resync: changes must be seen through the watcher.
        let source = Box::new(FileSource::new(&path, Duration::from_secs(3600))?);
        let (tx, mut events) = mpsc::channel(8);
        let (stop, shutdown) = watch::channel(false);
        let task = tokio::spawn(source.run(tx, shutdown));

        let SourceEvent::Reset(first) = next(&mut events).await? else {
            return Err("the first event is the full set".into());
        };
        assert_eq!(first.len(), 2);

        write(
            &path,
            "- {namespace: default, name: web-0, ips: [oops], interface: x}",
        )?;
        match next(&mut events).await? {
            SourceEvent::Failed(failure) => {
                assert_eq!(failure.kind, "invalid");
                assert!(
                    failure
                        .detail
                        .starts_with(&format!("{}: endpoint 0", path.display()))
                );
            }
            other => return Err(format!("expected a failure, got {other:?}").into()),
        }

        let one = "- {namespace: default, name: web-0, ips: [198.18.1.2], interface: vethweb0}";
        write(&path, one)?;
        let SourceEvent::Reset(after) = next(&mut events).await? else {
            return Err("a good file is read again".into());
        };
        assert_eq!(after.len(), 1);

        // The same content again sends nothing; a change sends the new set.
        write(&path, one)?;
        write(&path, "[]")?;
        assert_eq!(next(&mut events).await?, SourceEvent::Reset(Vec::new()));

        let _ = stop.send(true);
        task.await?;
        Ok(())
    }

    #[tokio::test]
    async fn a_missing_file_is_a_failure_then_read_when_it_appears() -> TestResult {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("endpoints.json");
        let source = Box::new(FileSource::new(&path, Duration::from_millis(100))?);
        let (tx, mut events) = mpsc::channel(8);
        let (stop, shutdown) = watch::channel(false);
        let task = tokio::spawn(source.run(tx, shutdown));
        match next(&mut events).await? {
            SourceEvent::Failed(failure) => {
                assert_eq!(failure.kind, "read");
                assert!(failure.detail.contains("cannot read"), "{}", failure.detail);
            }
            other => return Err(format!("expected a failure, got {other:?}").into()),
        }
        write(&path, "[]")?;
        assert_eq!(next(&mut events).await?, SourceEvent::Reset(Vec::new()));
        let _ = stop.send(true);
        task.await?;
        Ok(())
    }
}
