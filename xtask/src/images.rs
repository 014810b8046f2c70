//! `cargo xtask images`: builds the operator and agent images from
//! `deploy/images/*.Dockerfile` and smoke-runs them on this machine, as root.
//!
//! No registry is reachable here, so everything comes from Debian: podman, runc and
//! mmdebstrap are installed with apt (idempotently, as `cargo xtask setup` installs
//! its packages), and the base image is a minimal Debian 12 made with mmdebstrap from
//! the mirrors apt uses here (`census-base:bookworm`, made once). The images copy
//! binaries built on the host in release (a release build inside each image would
//! double the build time) into the Dockerfiles' own `runtime` stage
//! (`--build-arg BINARIES=prebuilt`), so what is run is what ships, bar the base.
//!
//! Debian's podman 4.3 runs on these machines with runc, cgroupfs and no default
//! ulimits (its defaults need CAP_SYS_RESOURCE, and crun refuses the cgroup layout):
//! its configuration is a containers.conf under `target/images/`, named by
//! `CONTAINERS_CONF` on each podman command, and /etc is left alone.
//!
//! The smoke run: the operator serves `/readyz` on its embedded redb store (the
//! image's default store path) and stops cleanly on SIGTERM; the agent, started
//! without capabilities, exits non-zero saying which capabilities it lacks. The
//! containers are removed afterwards; the images stay (they are the next run's cache).

use std::{
    fs,
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{cmd, ebpf, setup};

/// What building and running the images needs, from Debian 12.
const PACKAGES: [&str; 3] = ["podman", "runc", "mmdebstrap"];
/// The Debian release the set-up and the images target.
const SUITE: &str = "bookworm";
const BASE_IMAGE: &str = "localhost/census-base:bookworm";
const OPERATOR_IMAGE: &str = "localhost/census-operator:smoke";
const AGENT_IMAGE: &str = "localhost/census-agent:smoke";
const OPERATOR_CONTAINER: &str = "census-images-operator";
const AGENT_CONTAINER: &str = "census-images-agent";
/// Where apt's sources are.
const SOURCES_LIST: &str = "/etc/apt/sources.list";
const SOURCES_DIR: &str = "/etc/apt/sources.list.d";

const CONTAINERS_CONF: &str = "\
# Written by `cargo xtask images` (xtask/src/images.rs) and used through CONTAINERS_CONF.
# Debian's podman 4.3 on machines where crun refuses the cgroup layout and the default
# ulimits need CAP_SYS_RESOURCE.
[containers]
default_ulimits = []

[engine]
runtime = \"runc\"
cgroup_manager = \"cgroupfs\"
events_logger = \"file\"
";

#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Options {
    /// Make the base image (`census-base:bookworm`) again even if it exists.
    #[arg(long)]
    rebuild_base: bool,
}

/// An image to build: its Dockerfile, tag, and the files of its build context
/// (path in the image's file system, host binary), plus empty directories.
struct Image {
    name: &'static str,
    step: &'static str,
    dockerfile: &'static str,
    tag: &'static str,
    binaries: &'static [&'static str],
    empty_dirs: &'static [&'static str],
}

const IMAGES: [Image; 2] = [
    Image {
        name: "operator",
        step: "operator image",
        dockerfile: "deploy/images/operator.Dockerfile",
        tag: OPERATOR_IMAGE,
        binaries: &["census-operator"],
        empty_dirs: &["var/lib/census"],
    },
    Image {
        name: "agent",
        step: "agent image",
        dockerfile: "deploy/images/agent.Dockerfile",
        tag: AGENT_IMAGE,
        binaries: &["census-agent", "census"],
        empty_dirs: &[],
    },
];

#[expect(clippy::print_stdout, reason = "xtask reports each step")]
pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options { rebuild_base } = options;
    if !cmd::is_root() {
        bail!(
            "`cargo xtask images` installs Debian packages and runs podman as root: run it \
             as root"
        );
    }
    let root = cmd::workspace_root();
    let work = root.join("target").join("images");
    fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let conf = work.join("containers.conf");
    fs::write(&conf, CONTAINERS_CONF).with_context(|| format!("writing {}", conf.display()))?;
    let podman = Podman { conf };

    let started = Instant::now();
    let mut timings: Vec<(&str, Duration)> = Vec::new();
    let mut step =
        |name: &'static str, f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<()> {
            println!("\n==> {name}");
            let started = Instant::now();
            f().with_context(|| format!("step `{name}` failed"))?;
            timings.push((name, started.elapsed()));
            Ok(())
        };

    step("packages", &mut || {
        setup::install_packages(&PACKAGES, "cargo xtask images")
    })?;
    step("base image", &mut || base_image(&podman, rebuild_base))?;
    // The agent embeds the eBPF object; without it, it would fail for that reason first.
    step("eBPF build", &mut || {
        setup::run(setup::Options {})?;
        ebpf::build(ebpf::Profile::Release)
    })?;
    let mut binaries = Default::default();
    step("release build", &mut || {
        binaries = cmd::build_binaries(&[
            "build",
            "--release",
            "-p",
            "census-operator",
            "-p",
            "census-agent",
            "--bins",
        ])?;
        Ok(())
    })?;
    for image in &IMAGES {
        step(image.step, &mut || {
            build_image(&podman, &root, &work, image, &binaries)
        })?;
    }
    step("operator smoke run", &mut || smoke_operator(&podman))?;
    step("agent smoke run", &mut || smoke_agent(&podman))?;

    println!("\ntimings:");
    for (name, elapsed) in &timings {
        println!("  {name:<20} {:>7.1} s", elapsed.as_secs_f64());
    }
    println!(
        "  {:<20} {:>7.1} s",
        "total",
        started.elapsed().as_secs_f64()
    );
    println!("images: {OPERATOR_IMAGE}, {AGENT_IMAGE} (on {BASE_IMAGE})");
    Ok(())
}

/// podman with census's containers.conf.
struct Podman {
    conf: PathBuf,
}

impl Podman {
    fn command(&self) -> Command {
        let mut command = Command::new("podman");
        command.env("CONTAINERS_CONF", &self.conf);
        command
    }

    fn run(&self, args: &[&str]) -> anyhow::Result<()> {
        cmd::run(self.command().args(args))
    }

    /// Runs podman and returns its stdout, failing with its stderr.
    fn output(&self, args: &[&str]) -> anyhow::Result<String> {
        let output = self
            .command()
            .args(args)
            .output()
            .context("running podman")?;
        if !output.status.success() {
            bail!(
                "podman {} failed ({}): {}",
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    }

    fn image_exists(&self, image: &str) -> anyhow::Result<bool> {
        let status = self
            .command()
            .args(["image", "exists", image])
            .status()
            .context("running podman")?;
        Ok(status.success())
    }
}

/// A container, removed (killed first) on drop.
struct Container<'a> {
    podman: &'a Podman,
    name: &'static str,
}

impl Drop for Container<'_> {
    fn drop(&mut self) {
        let _removed = self
            .podman
            .command()
            .args(["rm", "--force", "--time", "0", self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Makes `census-base:bookworm` with mmdebstrap (minbase) from apt's mirrors, unless
/// it exists.
#[expect(clippy::print_stdout, reason = "xtask reports what it does")]
fn base_image(podman: &Podman, rebuild: bool) -> anyhow::Result<()> {
    if !rebuild && podman.image_exists(BASE_IMAGE)? {
        println!("  present     {BASE_IMAGE} (--rebuild-base makes it again)");
        return Ok(());
    }
    let mirrors = match host_mirrors() {
        Ok(mirrors) if !mirrors.is_empty() => mirrors,
        Ok(_) => {
            println!("  apt has no {SUITE} sources here; using deb.debian.org");
            vec![format!("deb http://deb.debian.org/debian {SUITE} main")]
        }
        Err(error) => bail!("reading apt's sources: {error:#}"),
    };
    println!("  making      {BASE_IMAGE} (mmdebstrap --variant=minbase) from:");
    for mirror in &mirrors {
        println!("                {mirror}");
    }
    let mut debootstrap = Command::new("mmdebstrap");
    debootstrap
        .args(["--variant=minbase", "--format=tar"])
        // Documentation and translations are of no use in an image.
        .args([
            "--dpkgopt=path-exclude=/usr/share/doc/*",
            "--dpkgopt=path-exclude=/usr/share/man/*",
            "--dpkgopt=path-exclude=/usr/share/locale/*",
        ])
        .args([SUITE, "-"])
        .args(&mirrors)
        .stdout(Stdio::piped());
    cmd::announce(&debootstrap);
    let mut debootstrap = debootstrap.spawn().context("running mmdebstrap")?;
    let tarball = debootstrap.stdout.take().context("mmdebstrap's stdout")?;
    let mut import = podman.command();
    import
        .args([
            "import",
            "--message",
            "census: Debian minbase by mmdebstrap",
        ])
        .args(["-", BASE_IMAGE])
        .stdin(tarball)
        .stdout(Stdio::null());
    cmd::announce(&import);
    let imported = import.status().context("running podman import")?;
    let made = debootstrap.wait().context("waiting for mmdebstrap")?;
    if !made.success() {
        bail!(
            "mmdebstrap failed ({made}): it needs a reachable Debian mirror (apt's sources: \
             {SOURCES_LIST}, {SOURCES_DIR}/)"
        );
    }
    if !imported.success() {
        bail!("podman import failed: {imported}");
    }
    println!("  made        {BASE_IMAGE}");
    Ok(())
}

/// apt's sources for Debian 12 on this machine (one-line and deb822 formats), as
/// mmdebstrap mirror arguments (`deb URI SUITE main`).
fn host_mirrors() -> anyhow::Result<Vec<String>> {
    let mut files = Vec::new();
    if Path::new(SOURCES_LIST).is_file() {
        files.push(PathBuf::from(SOURCES_LIST));
    }
    if let Ok(entries) = fs::read_dir(SOURCES_DIR) {
        let mut paths: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .collect();
        paths.sort();
        files.extend(paths);
    }
    let mut mirrors = Vec::new();
    for file in files {
        let Some(extension) = file.extension().and_then(|extension| extension.to_str()) else {
            continue;
        };
        let sources = match extension {
            "list" | "sources" => {
                fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?
            }
            // apt ignores other names (.disabled, .save, …), and so does this.
            _ => continue,
        };
        let found = if extension == "list" {
            one_line_sources(&sources)
        } else {
            deb822_sources(&sources)
        };
        for mirror in found {
            if !mirrors.contains(&mirror) {
                mirrors.push(mirror);
            }
        }
    }
    Ok(mirrors)
}

/// The Debian 12 entries of a one-line sources.list: `deb [options] URI SUITE COMPONENTS`.
fn one_line_sources(text: &str) -> Vec<String> {
    let mut mirrors = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default().trim();
        let Some(rest) = line.strip_prefix("deb ") else {
            continue;
        };
        let rest = rest.trim_start();
        // Options in brackets (`[signed-by=… arch=…]`) are mmdebstrap's to choose.
        let rest = match rest.strip_prefix('[') {
            Some(options) => options.split_once(']').map_or("", |(_, rest)| rest),
            None => rest,
        };
        let mut fields = rest.split_whitespace();
        if let (Some(uri), Some(suite)) = (fields.next(), fields.next())
            && is_target_suite(suite)
        {
            mirrors.push(mirror(uri, suite));
        }
    }
    mirrors
}

/// The Debian 12 entries of deb822 `.sources` stanzas (`Types`, `URIs`, `Suites`,
/// `Enabled`).
fn deb822_sources(text: &str) -> Vec<String> {
    let mut mirrors = Vec::new();
    for stanza in text.split("\n\n") {
        let (mut types, mut uris, mut suites, mut enabled) = ("", "", "", true);
        for line in stanza.lines() {
            // Comments, and continuation lines (a Signed-By key's armour).
            if line.starts_with('#') || line.starts_with([' ', '\t']) {
                continue;
            }
            let Some((field, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match field.trim().to_ascii_lowercase().as_str() {
                "types" => types = value,
                "uris" => uris = value,
                "suites" => suites = value,
                "enabled" => enabled = value != "no",
                _ => {}
            }
        }
        if !enabled || !types.split_whitespace().any(|kind| kind == "deb") {
            continue;
        }
        for uri in uris.split_whitespace() {
            for suite in suites.split_whitespace().filter(|s| is_target_suite(s)) {
                mirrors.push(mirror(uri, suite));
            }
        }
    }
    mirrors
}

/// `bookworm`, `bookworm-updates`, `bookworm-security` (not backports, not others).
fn is_target_suite(suite: &str) -> bool {
    matches!(
        suite.strip_prefix(SUITE),
        Some("" | "-updates" | "-security")
    )
}

fn mirror(uri: &str, suite: &str) -> String {
    format!("deb {uri} {suite} main")
}

/// Builds `image`'s `runtime` stage from the host's binaries: its build context is a
/// directory laid out as the image's file system.
#[expect(clippy::print_stdout, reason = "xtask reports what it builds")]
fn build_image(
    podman: &Podman,
    root: &Path,
    work: &Path,
    image: &Image,
    binaries: &std::collections::BTreeMap<String, PathBuf>,
) -> anyhow::Result<()> {
    let context = work.join(format!("{}-context", image.name));
    if context.exists() {
        fs::remove_dir_all(&context).with_context(|| format!("removing {}", context.display()))?;
    }
    let bin = context.join("usr/local/bin");
    fs::create_dir_all(&bin).with_context(|| format!("creating {}", bin.display()))?;
    for name in image.binaries {
        let built = binaries
            .get(*name)
            .with_context(|| format!("cargo built no {name}"))?;
        fs::copy(built, bin.join(name))
            .with_context(|| format!("copying {} into the build context", built.display()))?;
    }
    for dir in image.empty_dirs {
        let dir = context.join(dir);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let dockerfile = root.join(image.dockerfile);
    let dockerfile = dockerfile.to_string_lossy();
    let context = context.to_string_lossy();
    let previous = image_id(podman, image.tag)?;
    let before = all_images(podman)?;
    podman.run(&[
        "build",
        // Nothing may come from a registry: the base is local, the rest is COPY.
        "--pull=never",
        "--network=none",
        "--file",
        &dockerfile,
        "--build-arg",
        "BINARIES=prebuilt",
        "--build-arg",
        &format!("RUNTIME_BASE={BASE_IMAGE}"),
        "--target",
        "runtime",
        "--tag",
        image.tag,
        &context,
    ])?;
    // Each run would otherwise keep another copy of the binaries: the build's
    // intermediate images (podman refuses to remove those the new image is made of)
    // and the image this tag named before go.
    let built = image_id(podman, image.tag)?;
    let mut leftovers: Vec<String> = all_images(podman)?
        .into_iter()
        .filter(|id| !before.contains(id) && Some(id) != built.as_ref())
        .collect();
    leftovers.extend(previous.filter(|previous| Some(previous) != built.as_ref()));
    for id in leftovers {
        let _removed = podman
            .command()
            .args(["rmi", &id])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    let size = podman.output(&["image", "inspect", "--format", "{{.Size}}", image.tag])?;
    let megabytes = size.parse::<f64>().unwrap_or_default() / 1e6;
    println!("  built       {} ({megabytes:.0} MB)", image.tag);
    Ok(())
}

/// The operator's image: serves /readyz on its embedded redb store (the image's
/// default store path, owned by its user) and stops cleanly on SIGTERM.
#[expect(clippy::print_stdout, reason = "xtask reports what it checks")]
fn smoke_operator(podman: &Podman) -> anyhow::Result<()> {
    let version = podman.output(&[
        "run",
        "--rm",
        "--pull=never",
        "--network=none",
        OPERATOR_IMAGE,
        "--version",
    ])?;
    println!("  {version}");
    let grpc = free_port()?;
    let admin = free_port()?;
    let grpc_listen = format!("127.0.0.1:{grpc}");
    let admin_listen = format!("127.0.0.1:{admin}");
    let container = Container {
        podman,
        name: OPERATOR_CONTAINER,
    };
    let started = Instant::now();
    podman.output(&[
        "run",
        "--detach",
        "--replace",
        "--pull=never",
        "--name",
        container.name,
        "--network=host",
        OPERATOR_IMAGE,
        "--grpc-listen",
        &grpc_listen,
        "--admin-listen",
        &admin_listen,
    ])?;
    println!("  started     {OPERATOR_CONTAINER} (gRPC {grpc_listen}, admin {admin_listen})");
    let deadline = started + Duration::from_secs(30);
    let body = loop {
        if let Ok((200, body)) = http_get(admin, "/readyz") {
            break body;
        }
        if !container_running(podman, container.name)? {
            bail!(
                "the operator exited before it was ready:\n{}",
                logs(podman, container.name)
            );
        }
        if Instant::now() > deadline {
            bail!(
                "the operator was not ready within 30 s:\n{}",
                logs(podman, container.name)
            );
        }
        thread::sleep(Duration::from_millis(100));
    };
    println!(
        "  ready       after {:.1} s: {}",
        started.elapsed().as_secs_f64(),
        body.trim()
    );
    if !body.contains("store redb") {
        bail!("/readyz does not name the redb store: {body:?}");
    }
    TcpStream::connect(("127.0.0.1", grpc))
        .with_context(|| format!("connecting to the operator's gRPC port {grpc}"))?;

    // SIGTERM, and SIGKILL only if it has not stopped within 20 s (exit code 137).
    let stopping = Instant::now();
    podman.output(&["stop", "--time", "20", container.name])?;
    let stopped = stopping.elapsed();
    let exit = podman.output(&["inspect", "--format", "{{.State.ExitCode}}", container.name])?;
    let log = logs(podman, container.name);
    if exit != "0" {
        bail!("the operator exited with {exit} on SIGTERM, not 0:\n{log}");
    }
    if !log.contains("stopped") {
        bail!("the operator did not log that it stopped:\n{log}");
    }
    println!(
        "  stopped     on SIGTERM in {:.1} s, exit code 0",
        stopped.as_secs_f64()
    );
    Ok(())
}

/// The agent's image, without privileges: it must exit non-zero saying which
/// capabilities it lacks, before touching any pin.
#[expect(clippy::print_stdout, reason = "xtask reports what it checks")]
fn smoke_agent(podman: &Podman) -> anyhow::Result<()> {
    let version = podman.output(&[
        "run",
        "--rm",
        "--pull=never",
        "--network=none",
        "--entrypoint",
        "/usr/local/bin/census",
        AGENT_IMAGE,
        "--version",
    ])?;
    println!("  {version}");
    let container = Container {
        podman,
        name: AGENT_CONTAINER,
    };
    let started = Instant::now();
    let mut command = podman.command();
    command.args([
        "run",
        "--replace",
        "--pull=never",
        "--name",
        container.name,
        "--network=none",
        "--cap-drop=all",
        "--security-opt=no-new-privileges",
        AGENT_IMAGE,
        "--node-name",
        "images-smoke",
    ]);
    cmd::announce(&command);
    let output = command.output().context("running podman")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    let message = stderr.trim();
    if output.status.success() {
        bail!("the agent exited successfully without privileges:\n{message}");
    }
    let expected = "missing capabilities: CAP_BPF, CAP_NET_ADMIN, CAP_PERFMON";
    if !message.contains(expected) {
        bail!(
            "the agent failed ({}) without saying `{expected}`:\n{message}",
            output.status
        );
    }
    println!(
        "  refused     in {:.1} s ({}): {}",
        started.elapsed().as_secs_f64(),
        output.status,
        message.lines().last().unwrap_or_default()
    );
    Ok(())
}

/// The id of the image `tag` names, if any.
fn image_id(podman: &Podman, tag: &str) -> anyhow::Result<Option<String>> {
    if !podman.image_exists(tag)? {
        return Ok(None);
    }
    podman
        .output(&["image", "inspect", "--format", "{{.Id}}", tag])
        .map(Some)
}

/// Every image's id, intermediate ones included.
fn all_images(podman: &Podman) -> anyhow::Result<Vec<String>> {
    Ok(podman
        .output(&["images", "--all", "--quiet", "--no-trunc"])?
        .lines()
        // `sha256:<id>`; `image inspect` says `<id>`.
        .map(|id| id.strip_prefix("sha256:").unwrap_or(id).to_owned())
        .collect())
}

fn container_running(podman: &Podman, name: &str) -> anyhow::Result<bool> {
    Ok(podman.output(&["inspect", "--format", "{{.State.Running}}", name])? == "true")
}

fn logs(podman: &Podman, name: &str) -> String {
    match podman.command().args(["logs", name]).output() {
        Ok(output) => format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
        Err(error) => format!("(podman logs failed: {error})"),
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(census_cluster::listen_port()?)
}

/// An HTTP/1.0 GET to `port` on the loopback: (status, body).
fn http_get(port: u16, path: &str) -> anyhow::Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: census\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response.split_once("\r\n\r\n").context("no HTTP header")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|status| status.parse().ok())
        .context("no HTTP status")?;
    Ok((status, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_sources_keep_debian_12_suites_without_options() {
        let text = "\
# deb http://example.org/debian bookworm main
deb [signed-by=/usr/share/keyrings/debian.gpg arch=amd64] http://deb.debian.org/debian bookworm main contrib
deb http://security.debian.org/debian-security bookworm-security main # security
deb-src http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-backports main
deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main
deb http://deb.debian.org/debian trixie main
";
        assert_eq!(
            one_line_sources(text),
            [
                "deb http://deb.debian.org/debian bookworm main",
                "deb http://security.debian.org/debian-security bookworm-security main",
            ]
        );
    }

    #[test]
    fn deb822_sources_expand_uris_and_suites_and_skip_disabled_stanzas() {
        let text = "\
Types: deb deb-src
# a comment
URIs: http://deb.debian.org/debian http://mirror.example/debian
Suites: bookworm bookworm-updates bookworm-backports
Components: main
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 Suites: trixie
 -----END PGP PUBLIC KEY BLOCK-----

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Enabled: no

Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
";
        assert_eq!(
            deb822_sources(text),
            [
                "deb http://deb.debian.org/debian bookworm main",
                "deb http://deb.debian.org/debian bookworm-updates main",
                "deb http://mirror.example/debian bookworm main",
                "deb http://mirror.example/debian bookworm-updates main",
            ]
        );
    }
}
