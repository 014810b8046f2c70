//! Guards and independent observers (bpftool) for the privileged tests.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, Mutex},
    time::Duration,
};

use aya::programs::{SchedClassifier, TcAttachType};
use census_agent::bpf::{
    AttachModeChoice, Datapath, DatapathOptions, Endpoint, Flow, identity, interface_slot,
    uninstall,
};
use census_netlab::{Lab, Netns, Pod, UdpReceiver, UdpSender, exchange_udp, unique_name};
use nix::net::if_::if_nametoindex;
use serde_json::Value;

pub(crate) type Fallible<T> = Result<T, Box<dyn std::error::Error>>;
pub(crate) type TestResult = Fallible<()>;
/// Each hook's name and the names of the programs on it, in order.
pub(crate) type Hooks = Vec<(String, Vec<String>)>;

/// The attach mode the privileged suite runs in: `CENSUS_TEST_ATTACH_MODE` (`tcx`
/// or `tc`; xtask runs the suite once in each), TCX by default.
pub(crate) fn attach_mode() -> AttachModeChoice {
    match std::env::var("CENSUS_TEST_ATTACH_MODE").as_deref() {
        Ok("tc") => AttachModeChoice::Tc,
        Ok("auto") => AttachModeChoice::Auto,
        _ => AttachModeChoice::Tcx,
    }
}

/// Whether the suite's datapaths attach with TC filters: `tc`, or `auto` on a
/// kernel without TCX (before 6.6).
pub(crate) fn tc_mode() -> bool {
    match attach_mode() {
        AttachModeChoice::Tc => true,
        AttachModeChoice::Auto => !kernel_at_least(6, 6).unwrap_or(false),
        AttachModeChoice::Tcx => false,
    }
}

/// `--attach-mode` for an agent process of the suite.
pub(crate) fn attach_mode_arg() -> &'static str {
    match attach_mode() {
        AttachModeChoice::Auto => "auto",
        _ if tc_mode() => "tc",
        _ => "tcx",
    }
}

/// Whether the running kernel is at least `major.minor` (from `uname -r`).
pub(crate) fn kernel_at_least(major: u32, minor: u32) -> Fallible<bool> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(found_major)), Some(Ok(found_minor))) => {
            Ok((found_major, found_minor) >= (major, minor))
        }
        _ => Err(format!("cannot read the kernel version from {release:?}").into()),
    }
}

/// Opens the datapath in `pins` in the suite's attach mode.
pub(crate) fn open_datapath(pins: &Path) -> Fallible<Datapath> {
    open_with(pins, DatapathOptions::default())
}

/// [`open_datapath`] with `options` (their attach mode replaced by the suite's).
pub(crate) fn open_with(pins: &Path, options: DatapathOptions) -> Fallible<Datapath> {
    let options = DatapathOptions {
        attach_mode: attach_mode(),
        ..options
    };
    Ok(Datapath::open_with_options(pins, &options)?)
}

/// A pin directory of its own, `/sys/fs/bpf/census-test-<pid>-<n>`, uninstalled
/// on drop: links detached, pins and directory removed, also when a test fails.
#[derive(Debug)]
pub(crate) struct PinDir(PathBuf);

impl PinDir {
    pub(crate) fn new() -> Self {
        Self(PathBuf::from("/sys/fs/bpf").join(unique_name("census-test")))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }

    pub(crate) fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Err(error) = uninstall(&self.0) {
            #[expect(
                clippy::print_stderr,
                reason = "a guard's drop cannot return its error"
            )]
            {
                eprintln!("uninstalling {}: {error}", self.0.display());
            }
        }
    }
}

/// Runs bpftool with `-j` (in `ns` if given) and parses its output.
pub(crate) fn bpftool(ns: Option<&Netns>, args: &[&str]) -> Fallible<Value> {
    let mut all = vec!["-j"];
    all.extend_from_slice(args);
    let output = match ns {
        Some(ns) => ns.output("bpftool", &all)?,
        None => {
            let output = Command::new("bpftool").args(&all).output()?;
            if !output.status.success() {
                return Err(format!(
                    "bpftool {}: {}",
                    all.join(" "),
                    String::from_utf8_lossy(&output.stderr)
                )
                .into());
            }
            output
        }
    };
    Ok(serde_json::from_slice(&output.stdout)?)
}

/// Ids of the programs named `name` that are loaded, per `bpftool prog show`.
pub(crate) fn program_ids(name: &str) -> Fallible<Vec<u32>> {
    let programs = bpftool(None, &["prog", "show"])?;
    Ok(programs
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["name"] == name)
        .filter_map(|p| p["id"].as_u64())
        .filter_map(|id| u32::try_from(id).ok())
        .collect())
}

/// Ids of the programs named `name` that use the map pinned at `map`: the
/// copies one datapath loaded, whatever other tests or agents on this machine
/// have loaded (a namespace deleted by an earlier test frees its programs only
/// when the kernel's cleanup work gets to it).
pub(crate) fn program_ids_using(name: &str, map: &Path) -> Fallible<Vec<u32>> {
    let map_id = bpftool(None, &["map", "show", "pinned", path_str(map)?])?["id"].clone();
    let programs = bpftool(None, &["prog", "show"])?;
    Ok(programs
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["name"] == name)
        .filter(|p| {
            p["map_ids"]
                .as_array()
                .is_some_and(|ids| ids.contains(&map_id))
        })
        .filter_map(|p| p["id"].as_u64())
        .filter_map(|id| u32::try_from(id).ok())
        .collect())
}

/// A TCX link running one of census's programs, per bpftool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CensusLink {
    pub(crate) link_id: u32,
    pub(crate) program: String,
    /// Where it is pinned (`bpftool -f`).
    pub(crate) pinned: Vec<String>,
}

/// Every TCX link running a census program on this machine, by link id, per
/// `bpftool -f link show` and `bpftool prog show`. (Debian 12's bpftool 7.1
/// predates TCX in `bpftool net` and shows TCX links as type 11 without their
/// interface.)
pub(crate) fn census_tcx_links() -> Fallible<Vec<CensusLink>> {
    let programs = bpftool(None, &["prog", "show"])?;
    let name_of = |id: &Value| {
        programs
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| &p["id"] == id)
            .and_then(|p| p["name"].as_str())
            .map(str::to_owned)
    };
    let mut links = Vec::new();
    for link in bpftool(None, &["-f", "link", "show"])?
        .as_array()
        .into_iter()
        .flatten()
    {
        let is_tcx = link["type"] == 11 || link["type"] == "tcx";
        let Some(program) = name_of(&link["prog_id"]) else {
            continue;
        };
        if !is_tcx || !program.starts_with("census_") {
            continue;
        }
        links.push(CensusLink {
            link_id: u32::try_from(link["id"].as_u64().ok_or("link without id")?)?,
            program,
            pinned: link["pinned"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p.as_str().map(str::to_owned))
                .collect(),
        });
    }
    links.sort_by_key(|l| l.link_id);
    Ok(links)
}

/// The names of the programs on each hook of `interface` (in the node namespace),
/// in order, as the kernel reports them: TCX programs (`BPF_PROG_QUERY`) and, in
/// TC mode, the TC filters' programs (`tc -j filter show`) after them (a clsact
/// hook runs TCX programs first).
pub(crate) fn hook_programs(lab: &Lab, interface: &str) -> Fallible<Hooks> {
    let mut hooks = tcx_hook_programs(lab, interface)?;
    for (hook, programs) in &mut hooks {
        programs.extend(
            tc_filters(lab, interface, hook)?
                .into_iter()
                .map(|f| f.name),
        );
    }
    Ok(hooks)
}

/// A TC filter, as `tc -j filter show` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TcFilter {
    pub(crate) priority: u64,
    /// The bpf program's name, or the filter's kind.
    pub(crate) name: String,
}

/// The TC filters on `hook` (`ingress`, `egress`) of `interface` in the node
/// namespace, in the order they run, per iproute2's `tc` (independent of census's
/// netlink code).
pub(crate) fn tc_filters(lab: &Lab, interface: &str, hook: &str) -> Fallible<Vec<TcFilter>> {
    let output = lab
        .node()
        .output("tc", &["-j", "filter", "show", "dev", interface, hook])?;
    if !output.status.success() {
        return Err(format!(
            "tc filter show dev {interface} {hook}: {}",
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    let text = String::from_utf8_lossy(&output.stdout);
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let filters: Value = serde_json::from_str(&text)?;
    let mut found: Vec<TcFilter> = filters
        .as_array()
        .into_iter()
        .flatten()
        // A priority's classifier itself has no options; its filters do.
        .filter(|f| f.get("options").is_some())
        .map(|f| TcFilter {
            priority: f["pref"].as_u64().unwrap_or(0),
            name: f["options"]["prog"]["name"]
                .as_str()
                .or_else(|| f["options"]["bpf_name"].as_str())
                .or_else(|| f["kind"].as_str())
                .unwrap_or("?")
                .to_owned(),
        })
        .collect();
    // A u32 filter is listed with its hash tables: one filter.
    found.dedup();
    Ok(found)
}

/// The names of the programs on each TCX hook of `interface` (in the node
/// namespace), in order, as the kernel reports them (`BPF_PROG_QUERY`); none in
/// TC mode on a kernel without TCX (before 6.6 the query answers `EINVAL`).
pub(crate) fn tcx_hook_programs(lab: &Lab, interface: &str) -> Fallible<Hooks> {
    let query = || -> Result<Hooks, aya::programs::ProgramError> {
        let mut hooks = Vec::new();
        for (hook, attach_type) in [
            ("ingress", TcAttachType::Ingress),
            ("egress", TcAttachType::Egress),
        ] {
            let programs = match SchedClassifier::query_tcx(interface, attach_type) {
                Ok((_, programs)) => programs,
                // A kernel before 6.6 has no TCX hook to query: no TCX program.
                Err(aya::programs::ProgramError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::EINVAL) && tc_mode() =>
                {
                    Vec::new()
                }
                Err(error) => return Err(error),
            };
            let names = programs
                .iter()
                .map(|p| p.name_as_str().unwrap_or("?").to_owned())
                .collect();
            hooks.push((hook.to_owned(), names));
        }
        Ok(hooks)
    };
    Ok(lab.node().run(query)??)
}

/// Exactly one census program on each hook of each pod's host side: the kernel
/// lists exactly census_ingress on ingress and census_egress on egress, and
/// bpftool sees exactly one census link pinned for each hook, running that
/// hook's program (in TC mode: one filter, and one record of it).
pub(crate) fn assert_one_census_program_per_hook(
    pins: &PinDir,
    lab: &Lab,
    pods: &[&Pod],
) -> TestResult {
    let links = census_tcx_links()?;
    for pod in pods {
        for (hook, programs) in hook_programs(lab, &pod.host_interface)? {
            let program = format!("census_{hook}");
            assert_eq!(
                programs,
                vec![program.clone()],
                "{} {hook}",
                pod.host_interface
            );
            if tc_mode() {
                let prefix = format!("{}-{hook}:tc:", pod.host_interface);
                let records = std::fs::read_dir(pins.join("links"))?
                    .filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .count();
                assert_eq!(records, 1, "{prefix}*");
                continue;
            }
            let pin = pins
                .join("links")
                .join(format!("{}-{hook}", pod.host_interface));
            let pinned_here: Vec<_> = links
                .iter()
                .filter(|l| l.pinned.iter().any(|p| Path::new(p) == pin))
                .collect();
            assert_eq!(pinned_here.len(), 1, "{}: {links:?}", pin.display());
            assert_eq!(pinned_here[0].program, program);
        }
    }
    Ok(())
}

/// The counters of one identity pair: (packets, bytes), zeros if absent.
pub(crate) fn flow(datapath: &Datapath, src: u32, dst: u32) -> Fallible<(u64, u64)> {
    Ok(datapath
        .flow(src, dst)?
        .map_or((0, 0), |flow| (flow.packets, flow.bytes)))
}

/// `datapath`'s flows with at least one end known: without the `world -> world`
/// pair, which is the namespaces' own link-local traffic (IPv6 MLD reports and
/// router solicitations, sent by the kernel on its own timers, up to seconds after
/// an interface comes up). A test's packets always have a known end.
pub(crate) fn endpoint_flows(datapath: &Datapath) -> Fallible<Vec<Flow>> {
    Ok(datapath
        .flows()?
        .into_iter()
        .filter(|f| !(f.src_identity == identity::WORLD && f.dst_identity == identity::WORLD))
        .collect())
}

/// Pins a new map made by bpftool (not by census) at `path`.
pub(crate) fn create_map(
    path: &Path,
    map_type: &str,
    key_size: u32,
    value_size: u32,
) -> TestResult {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("no map name")?;
    let status = Command::new("bpftool")
        .args(["map", "create", path_str(path)?, "type", map_type])
        .args([
            "key",
            &key_size.to_string(),
            "value",
            &value_size.to_string(),
        ])
        .args(["entries", "16", "name", name])
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("bpftool map create {}: {status}", path.display()).into())
    }
}

pub(crate) fn path_str(path: &Path) -> Fallible<&str> {
    path.to_str()
        .ok_or_else(|| format!("{} is not UTF-8", path.display()).into())
}

/// `bytes` as bpftool takes them after `hex`: two hex digits each.
pub(crate) fn hex(bytes: &[u8]) -> Vec<String> {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The bytes of a bpftool JSON byte array (`["0x04", "0x00", ...]`).
pub(crate) fn bytes(value: &Value) -> Fallible<Vec<u8>> {
    value
        .as_array()
        .ok_or_else(|| format!("not a byte array: {value}"))?
        .iter()
        .map(|byte| {
            let hex = byte.as_str().and_then(|b| b.strip_prefix("0x"));
            let hex = hex.ok_or_else(|| format!("not a byte: {byte}"))?;
            Ok(u8::from_str_radix(hex, 16)?)
        })
        .collect()
}

/// The little-endian u32 at `offset` of a bpftool JSON byte array.
pub(crate) fn u32_at(value: &Value, offset: usize) -> Fallible<u32> {
    let bytes = bytes(value)?;
    let word = bytes
        .get(offset..offset + 4)
        .ok_or_else(|| format!("no u32 at {offset} in {value}"))?;
    Ok(u32::from_le_bytes(word.try_into()?))
}

/// Polls `check` until it holds or `timeout` passes (the kernel frees programs
/// and links asynchronously after their last reference goes).
pub(crate) fn eventually(
    timeout: Duration,
    check: impl FnMut() -> Fallible<bool>,
) -> Fallible<bool> {
    census_testkit::wait_for(timeout, check)
}

/// Opens the datapath in `pins` and attaches it to both hooks of each pod's
/// host-side interface, from inside the node namespace.
pub(crate) fn open_attached(pins: &PinDir, lab: &Lab, pods: &[&Pod]) -> Fallible<Datapath> {
    let mut datapath = open_datapath(pins.path())?;
    for pod in pods {
        lab.node().run(|| datapath.attach(&pod.host_interface))??;
    }
    Ok(datapath)
}

/// Registers `pod`'s IPv4 and IPv6 addresses as a local endpoint of `identity`.
pub(crate) fn register(datapath: &mut Datapath, pod: &Pod, identity: u32) -> Fallible<()> {
    datapath.upsert_endpoint(pod.ipv4.into(), Endpoint::local(identity))?;
    datapath.upsert_endpoint(pod.ipv6.into(), Endpoint::local(identity))?;
    Ok(())
}

/// Sends `count` UDP datagrams of `payload` bytes from `from` (bound to
/// `source` in namespace `from_ns`) to `to` in lock step; returns how many
/// arrived.
pub(crate) fn send(
    from_ns: &Netns,
    source: IpAddr,
    to: &Pod,
    v6: bool,
    count: usize,
    payload: usize,
) -> Fallible<usize> {
    let receiver = UdpReceiver::bind(&to.ns, to.ip(v6))?;
    let sender = UdpSender::bind(from_ns, source)?;
    Ok(exchange_udp(&sender, &receiver, count, payload)?)
}

/// Link-layer bytes of one UDP datagram of `payload` bytes: Ethernet, IP, UDP.
pub(crate) fn frame_len(payload: usize, v6: bool) -> u64 {
    let ip_header = if v6 { 40 } else { 20 };
    (14 + ip_header + 8 + payload) as u64
}

/// The index of `pod`'s host-side interface, in the node namespace.
pub(crate) fn host_ifindex(lab: &Lab, pod: &Pod) -> Fallible<u32> {
    Ok(lab
        .node()
        .run(|| if_nametoindex(pod.host_interface.as_str()))??)
}

/// The INTERFACES slot of interface `ifindex` as bpftool reads it (parsed from
/// its bytes, independently of census's types): `Some((identity))` when the slot
/// holds `ifindex`'s entry (identity 0: none), `None` when it holds nothing or
/// another interface's.
pub(crate) fn interface_entry_by_bpftool(pins: &Path, ifindex: u32) -> Fallible<Option<u32>> {
    let path = pins.join("INTERFACES");
    let key: Vec<String> = interface_slot(ifindex)
        .to_le_bytes()
        .iter()
        .map(ToString::to_string)
        .collect();
    let mut args = vec!["map", "lookup", "pinned", path_str(&path)?, "key"];
    args.extend(key.iter().map(String::as_str));
    let entry = bpftool(None, &args)?;
    let value = bytes(&entry["value"])?;
    if value.len() != 8 {
        return Err(format!("an INTERFACES value of {} bytes: {entry}", value.len()).into());
    }
    let held = u32_at(&entry["value"], 0)?;
    (held == ifindex)
        .then(|| u32_at(&entry["value"], 4))
        .transpose()
}

/// Lets `pod` send with `other`'s addresses (IPv4 and IPv6) as sources, and the
/// node forward such packets (no reverse-path filter): what a pod that spoofs
/// another's address does.
pub(crate) fn spoof_addresses_of(lab: &Lab, pod: &Pod, other: &Pod) -> TestResult {
    pod.ns
        .ip(&["addr", "add", &format!("{}/32", other.ipv4), "dev", "eth0"])?;
    pod.ns.ip(&[
        "addr",
        "add",
        &format!("{}/128", other.ipv6),
        "dev",
        "eth0",
        "nodad",
    ])?;
    lab.node().sysctl("net.ipv4.conf.all.rp_filter", "0")?;
    lab.node().sysctl(
        &format!("net.ipv4.conf.{}.rp_filter", pod.host_interface),
        "0",
    )?;
    Ok(())
}

/// A subscriber that keeps every line, and the lines it kept.
pub(crate) fn capture() -> (tracing::Dispatch, Arc<Mutex<Vec<u8>>>) {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let writer = Capture(Arc::clone(&lines));
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    (tracing::Dispatch::new(subscriber), lines)
}

#[derive(Clone)]
pub(crate) struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
