//! `cargo xtask test-kernel`: the privileged suite on Debian 12's own 6.1 kernel,
//! which has no TCX, so the agent attaches with a clsact qdisc and TC filters.
//!
//! The kernel is not installed: its package (the one `linux-image-amd64` depends on,
//! or `--kernel-package`) and `busybox-static` are fetched with `apt-get download`
//! and unpacked with `dpkg-deb -x` under `target/test-kernel/`, and `depmod` indexes
//! the unpacked modules there, so /boot, /lib/modules and what the host boots are
//! left alone. The suite is built on the host exactly as `cargo xtask
//! test-privileged` builds it ([`privileged::Suite`]).
//!
//! qemu boots that kernel with a small initramfs (busybox and the modules that reach
//! the root: virtio, 9p, overlay) that mounts the host's `/` read-only over virtio-9p
//! with a tmpfs overlay on top and switches to it. There a second script mounts
//! proc, sys, bpffs and cgroup2, binds the unpacked modules at
//! `/lib/modules/<release>` (so the kernel's own module loading, through the host's
//! `modprobe`, finds veth, sch_ingress, cls_bpf, nf_tables, …), runs each test
//! executable as `test-privileged` does with `CENSUS_TEST_ATTACH_MODE=tc`, writes
//! each exit status to a second, writable 9p share, and powers off. The guest's
//! console is this command's output; its exit status is the suite's.
//!
//! KVM is used where `/dev/kvm` is hardware virtualisation. A `/dev/kvm` from
//! kvm-pvm (these VMs) runs only kernels built as PVM guests, and Debian's is not
//! one: it hangs before its first message. There qemu emulates the CPU (TCG),
//! several times slower but the same kernel.

use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::OsString,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{cmd, privileged, setup};

/// qemu, and kmod: `depmod` indexes the unpacked modules, and the guest's kernel
/// loads modules with the host's `modprobe`.
const PACKAGES: [&str; 2] = ["qemu-system-x86", "kmod"];
/// The package whose dependency names Debian 12's current kernel image.
const KERNEL_METAPACKAGE: &str = "linux-image-amd64";
/// The modules that reach the root file system, loaded by the initramfs (their
/// dependencies first, from `modules.dep`).
const INITRAMFS_MODULES: [&str; 5] = ["virtio_pci", "9pnet_virtio", "9p", "overlay", "virtio_rng"];
/// Tests this kernel cannot run, each with why.
const SKIPS: [(&str, &str); 3] = [
    (
        "switching_attach_modes_leaves_one_program_per_hook",
        "attaches with TCX on purpose (6.6+)",
    ),
    ("needs_other_kernel::a_netkit_pod_device", "netkit is 6.7+"),
    (
        "kwok::",
        "needs the real Kubernetes control plane, which runs on the host, not in the VM",
    ),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Accel {
    /// KVM where /dev/kvm is hardware virtualisation, else TCG.
    Auto,
    Kvm,
    /// qemu's CPU emulation.
    Tcg,
}

#[derive(Debug, clap::Args)]
pub(crate) struct Options {
    /// Do not (re)build the eBPF object first.
    #[arg(long)]
    no_build_ebpf: bool,
    /// The kernel image package (default: the one `linux-image-amd64` depends on).
    #[arg(long)]
    kernel_package: Option<String>,
    /// How qemu runs the guest.
    #[arg(long, value_enum, default_value_t = Accel::Auto)]
    accel: Accel,
    /// How the suite is compiled (default: `release` under TCG, where debug code
    /// misses the tests' deadlines; `dev`, as `test-privileged` builds it, under KVM).
    #[arg(long, value_enum)]
    profile: Option<privileged::Profile>,
    /// Stop the guest after this many minutes.
    #[arg(long, default_value_t = 120)]
    timeout_minutes: u64,
    /// Passed to the test executables (a test name filter, `--nocapture`, …).
    #[arg(last = true)]
    test_args: Vec<OsString>,
}

#[expect(clippy::print_stdout, reason = "xtask reports each step")]
pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        no_build_ebpf,
        kernel_package,
        accel,
        profile,
        timeout_minutes,
        test_args,
    } = options;
    if !cmd::is_root() {
        bail!(
            "`cargo xtask test-kernel` installs qemu, and the guest shares this machine's \
             root file system as root: run it as root"
        );
    }
    let started = Instant::now();
    setup::install_packages(&PACKAGES, "cargo xtask test-kernel")?;
    let (accel, why) = choose_accel(accel)?;
    println!("accelerator: {why}");

    let cache = target_dir().join("test-kernel");
    let package = match kernel_package {
        Some(package) => package,
        None => kernel_package_of_metapackage()?,
    };
    let kernel = Kernel::unpacked(&cache, &package)?;
    let busybox = busybox(&cache)?;
    println!("kernel: {package} ({})", kernel.release);

    let profile = profile.unwrap_or(match accel {
        Accel::Tcg => privileged::Profile::Release,
        Accel::Kvm | Accel::Auto => privileged::Profile::Dev,
    });
    let suite = privileged::Suite::build(no_build_ebpf, profile, privileged::Selection::Packages)?;
    let skip: Vec<&str> = SKIPS.iter().map(|&(name, _)| name).collect();
    let commands = suite.commands("tc", &skip, &test_args);

    let results = cache.join("results");
    if results.exists() {
        fs::remove_dir_all(&results).with_context(|| format!("removing {}", results.display()))?;
    }
    fs::create_dir_all(&results).with_context(|| format!("creating {}", results.display()))?;
    let stage2 = stage2_script(&kernel, &commands, suite.agent())?;
    let initramfs = cache.join("initramfs.cpio");
    fs::write(&initramfs, initramfs_archive(&kernel, &busybox, &stage2)?)
        .with_context(|| format!("writing {}", initramfs.display()))?;
    for (name, why) in SKIPS {
        println!("skipped on this kernel: {name} ({why})");
    }

    let mut qemu = qemu_command(accel, &kernel, &initramfs, &results);
    boot(&mut qemu, Duration::from_secs(timeout_minutes * 60))?;
    let outcome = read_results(&results);
    println!(
        "test-kernel took {:.0?} (build, boot and suite)",
        started.elapsed()
    );
    outcome
}

/// The accelerator to use, and a sentence saying why.
fn choose_accel(accel: Accel) -> anyhow::Result<(Accel, String)> {
    match accel {
        Accel::Kvm => Ok((Accel::Kvm, "KVM (--accel kvm)".to_owned())),
        Accel::Tcg => Ok((
            Accel::Tcg,
            "TCG, qemu's CPU emulation (--accel tcg)".to_owned(),
        )),
        Accel::Auto => {
            if !Path::new("/dev/kvm").exists() {
                return Ok((Accel::Tcg, "TCG: there is no /dev/kvm".to_owned()));
            }
            if Path::new("/sys/module/kvm_pvm").exists() {
                return Ok((
                    Accel::Tcg,
                    "TCG: this /dev/kvm is kvm-pvm, which runs only PVM guest kernels \
                     (Debian's hangs at boot); several times slower than KVM"
                        .to_owned(),
                ));
            }
            let cpuinfo = fs::read_to_string("/proc/cpuinfo").context("reading /proc/cpuinfo")?;
            let hardware = cpuinfo
                .lines()
                .filter(|line| line.starts_with("flags"))
                .flat_map(str::split_whitespace)
                .any(|flag| flag == "vmx" || flag == "svm");
            if hardware {
                Ok((Accel::Kvm, "KVM".to_owned()))
            } else {
                Ok((
                    Accel::Tcg,
                    "TCG: the CPU has neither vmx nor svm, so /dev/kvm is not hardware \
                     virtualisation"
                        .to_owned(),
                ))
            }
        }
    }
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| cmd::workspace_root().join("target"), PathBuf::from)
}

/// The kernel image package `linux-image-amd64` depends on (Debian 12: 6.1).
fn kernel_package_of_metapackage() -> anyhow::Result<String> {
    let output = Command::new("apt-cache")
        .args(["depends", KERNEL_METAPACKAGE])
        .output()
        .context("running apt-cache")?;
    if !output.status.success() {
        bail!(
            "apt-cache depends {KERNEL_METAPACKAGE} failed: {}",
            output.status
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let package = stdout
        .lines()
        .filter_map(|line| line.trim().strip_prefix("Depends: "))
        .find(|name| name.starts_with("linux-image-"))
        .with_context(|| {
            format!("apt-cache names no kernel image {KERNEL_METAPACKAGE} depends on")
        })?;
    if !package.starts_with("linux-image-6.1.") {
        bail!(
            "{KERNEL_METAPACKAGE} depends on {package}, not a 6.1 kernel (is this Debian 12?): \
             name one with --kernel-package"
        );
    }
    Ok(package.to_owned())
}

/// Downloads the Debian packages into `dir` and unpacks each into `root`, saying so;
/// retries the download once after `apt-get update` (the lists may be stale).
#[expect(clippy::print_stdout, reason = "xtask reports what it installs")]
fn download_and_unpack(dir: &Path, packages: &[&str], root: &Path) -> anyhow::Result<()> {
    println!(
        "  downloading {} (unpacked under {}, not installed)",
        packages.join(" "),
        root.display()
    );
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let download = || {
        cmd::run(
            Command::new("apt-get")
                .current_dir(dir)
                // The download directory is root's, not _apt's.
                .args(["-o", "APT::Sandbox::User=root", "download"])
                .args(packages),
        )
    };
    if download().is_err() {
        cmd::run(Command::new("apt-get").arg("update"))?;
        download()?;
    }
    if root.exists() {
        fs::remove_dir_all(root).with_context(|| format!("removing {}", root.display()))?;
    }
    for package in packages {
        let deb = fs::read_dir(dir)?
            .filter_map(Result::ok)
            .map(|entry| entry.path())
            .find(|path| {
                path.file_name()
                    .and_then(|name| name.to_str())
                    .is_some_and(|name| {
                        name.starts_with(&format!("{package}_")) && name.ends_with(".deb")
                    })
            })
            .with_context(|| {
                format!(
                    "apt-get download left no {package}_*.deb in {}",
                    dir.display()
                )
            })?;
        cmd::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(root))?;
        fs::remove_file(&deb).with_context(|| format!("removing {}", deb.display()))?;
    }
    Ok(())
}

/// An unpacked kernel image package.
#[derive(Debug)]
struct Kernel {
    /// `uname -r` of it, e.g. `6.1.0-57-amd64`.
    release: String,
    vmlinuz: PathBuf,
    /// `<root>/lib/modules/<release>`, indexed by depmod.
    modules: PathBuf,
}

impl Kernel {
    /// The kernel of `package` unpacked under `cache`, downloaded and indexed the
    /// first time.
    #[expect(clippy::print_stdout, reason = "xtask reports each check")]
    fn unpacked(cache: &Path, package: &str) -> anyhow::Result<Self> {
        println!("Kernel {package}:");
        let root = cache.join(package);
        let ready = root.join(".census-ready");
        if ready.exists() {
            println!("  present     unpacked in {}", root.display());
        } else {
            download_and_unpack(&cache.join("debs"), &[package], &root)?;
        }
        let modules_dir = root.join("lib/modules");
        let release = fs::read_dir(&modules_dir)
            .with_context(|| format!("reading {}", modules_dir.display()))?
            .filter_map(Result::ok)
            .filter_map(|entry| entry.file_name().into_string().ok())
            .next()
            .with_context(|| format!("{package} has no lib/modules/<release>"))?;
        let kernel = Self {
            vmlinuz: root.join("boot").join(format!("vmlinuz-{release}")),
            modules: modules_dir.join(&release),
            release,
        };
        if !ready.exists() {
            // The package's postinst would run depmod; here it indexes the unpacked tree.
            cmd::run(
                Command::new("depmod")
                    .arg("--basedir")
                    .arg(&root)
                    .arg("--filesyms")
                    .arg(
                        root.join("boot")
                            .join(format!("System.map-{}", kernel.release)),
                    )
                    .arg(&kernel.release),
            )?;
            fs::write(&ready, "").with_context(|| format!("writing {}", ready.display()))?;
        }
        Ok(kernel)
    }

    /// `names` and the modules they depend on, each once, dependencies first, as
    /// paths relative to [`Kernel::modules`].
    fn modules_with_dependencies(&self, names: &[&str]) -> anyhow::Result<Vec<String>> {
        let path = self.modules.join("modules.dep");
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let dependencies: BTreeMap<&str, Vec<&str>> = text
            .lines()
            .filter_map(|line| line.split_once(':'))
            .map(|(module, deps)| (module, deps.split_whitespace().collect()))
            .collect();
        // Module names do not tell `-` from `_` (virtio_rng is virtio-rng.ko).
        let by_name = |name: &str| {
            let file = format!("/{name}.ko").replace('-', "_");
            dependencies
                .keys()
                .copied()
                .find(|module| module.replace('-', "_").ends_with(&file))
                .with_context(|| format!("no module {name} in {}", path.display()))
        };
        fn visit<'a>(
            module: &'a str,
            dependencies: &BTreeMap<&'a str, Vec<&'a str>>,
            seen: &mut BTreeSet<&'a str>,
            order: &mut Vec<String>,
        ) {
            if !seen.insert(module) {
                return;
            }
            for dependency in dependencies.get(module).into_iter().flatten() {
                visit(dependency, dependencies, seen, order);
            }
            order.push(module.to_owned());
        }
        let (mut seen, mut order) = (BTreeSet::new(), Vec::new());
        for name in names {
            visit(by_name(name)?, &dependencies, &mut seen, &mut order);
        }
        Ok(order)
    }
}

/// A static busybox for the initramfs, unpacked from `busybox-static` (which is not
/// installed: it would replace a `busybox` package).
#[expect(clippy::print_stdout, reason = "xtask reports each check")]
fn busybox(cache: &Path) -> anyhow::Result<PathBuf> {
    println!("busybox-static:");
    let root = cache.join("busybox-static");
    let busybox = root.join("bin/busybox");
    if busybox.is_file() {
        println!("  present     {}", busybox.display());
    } else {
        download_and_unpack(&cache.join("debs"), &["busybox-static"], &root)?;
    }
    Ok(busybox)
}

/// `'…'`-quotes `text` for sh.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

fn utf8(text: &std::ffi::OsStr) -> anyhow::Result<&str> {
    text.to_str()
        .with_context(|| format!("{text:?} is not UTF-8, which the guest's script needs"))
}

/// The initramfs's `/init`: modules, the host's root read-only with a tmpfs over it,
/// then the second stage there. Any failure powers the guest off at once (the
/// missing results say so).
const STAGE1: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() {
    echo "census-test-kernel: $*"
    echo o > /proc/sysrq-trigger
    sleep 60
}
for module in $(cat /modules/order); do
    insmod "/modules/$module" || fail "insmod $module failed"
done
mkdir -p /lower /rw /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 census-root /lower \
    || fail "cannot mount the host's root (virtio-9p)"
mount -t tmpfs -o mode=0755 tmpfs /rw
mkdir /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot \
    || fail "cannot put an overlay on the host's root"
cp /stage2 /newroot/census-stage2 || fail "cannot write to the overlay"
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /census-stage2
"#;

/// The second stage, run as init on the host's root: mounts, modules, the commands
/// (each exit status to the results share as `<status> <label>`, then `done`), off.
fn stage2_script(kernel: &Kernel, commands: &[Command], agent: &Path) -> anyhow::Result<String> {
    let modules = quote(utf8(kernel.modules.as_os_str())?);
    let cwd = std::env::current_dir().context("the current directory")?;
    let mut script = format!(
        r#"#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
# The kernel's module loading runs the host's modprobe, which looks here.
mkdir -p /lib/modules/{release}
mount --bind {modules} /lib/modules/{release}
mount -t tmpfs -o mode=1777 tmpfs /tmp
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /dev/pts /dev/shm /run/census-results
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t 9p -o trans=virtio,version=9p2000.L census-results /run/census-results
ip link set lo up
# This process's open-file limit (init's default is 1024).
ulimit -n {nofile}
echo "census-test-kernel: in the guest, Linux $(uname -r), $(nproc) CPUs"
cd {cwd}
# The agent alone (no operator, no endpoints) in attach mode auto: it must pass
# its kernel check and choose TC filters here.
auto_picks_tc() {{
    dir=$(mktemp -d)
    echo '[]' > "$dir/endpoints.json"
    "$1" --node-name test-kernel --endpoints-file "$dir/endpoints.json" \
        --pin-dir /sys/fs/bpf/census-test-kernel --attach-mode auto --log info \
        2> "$dir/agent.log" &
    agent=$!
    for _ in $(seq 120); do
        grep -q 'census datapath loaded' "$dir/agent.log" && break
        kill -0 "$agent" 2> /dev/null || break
        sleep 1
    done
    kill "$agent" 2> /dev/null
    wait "$agent"
    cat "$dir/agent.log"
    "$1" uninstall --pin-dir /sys/fs/bpf/census-test-kernel
    sed 's/\x1b\[[0-9;]*m//g' "$dir/agent.log" | grep -q 'census datapath loaded.*attach_mode=tc'
}}
suite() {{
    label=$1
    shift
    echo "==> $label"
    "$@"
    echo "$? $label" >> /run/census-results/status
}}
"#,
        release = kernel.release,
        nofile = open_file_limit()?,
        cwd = quote(utf8(cwd.as_os_str())?),
    );
    let forwarded = forwarded_env()?;
    for command in commands {
        script.push_str(&suite_line(command, &forwarded)?);
        script.push('\n');
    }
    // The suite's harness knows TCX and TC, not `auto`: this is the agent's own
    // choice on this kernel, from its log.
    let _ = writeln!(
        script,
        "suite 'census-agent --attach-mode auto picks tc' auto_picks_tc {}",
        quote(utf8(agent.as_os_str())?)
    );
    script.push_str(
        "echo done >> /run/census-results/status\n\
         sync\n\
         echo o > /proc/sysrq-trigger\n\
         sleep 60\n",
    );
    Ok(script)
}

/// The host's `RUST_BACKTRACE` and `RUST_LOG`, as `NAME=value` for the guest's
/// commands.
fn forwarded_env() -> anyhow::Result<Vec<String>> {
    let mut forwarded = Vec::new();
    for name in ["RUST_BACKTRACE", "RUST_LOG"] {
        if let Some(value) = std::env::var_os(name) {
            forwarded.push(format!("{name}={}", quote(utf8(&value)?)));
        }
    }
    Ok(forwarded)
}

/// The stage-2 line that runs `command` as a suite, labelled by its program and
/// attach mode, with the `forwarded` variables and its own.
fn suite_line(command: &Command, forwarded: &[String]) -> anyhow::Result<String> {
    let program = Path::new(command.get_program());
    let mode = command
        .get_envs()
        .find(|(name, _)| *name == "CENSUS_TEST_ATTACH_MODE")
        .and_then(|(_, value)| value)
        .map_or("", |value| value.to_str().unwrap_or(""));
    let label = format!(
        "{} ({mode})",
        program.file_name().map_or_else(
            || program.display().to_string(),
            |name| name.to_string_lossy().into_owned()
        )
    );
    let mut line = format!("suite {} env", quote(&label));
    for assignment in forwarded {
        let _ = write!(line, " {assignment}");
    }
    for (name, value) in command.get_envs() {
        if let Some(value) = value {
            let _ = write!(line, " {}={}", utf8(name)?, quote(utf8(value)?));
        }
    }
    let _ = write!(line, " {}", quote(utf8(program.as_os_str())?));
    for arg in command.get_args() {
        let _ = write!(line, " {}", quote(utf8(arg)?));
    }
    Ok(line)
}

/// The soft open-file limit of this process, from `/proc/self/limits`.
fn open_file_limit() -> anyhow::Result<u64> {
    let limits = fs::read_to_string("/proc/self/limits").context("reading /proc/self/limits")?;
    limits
        .lines()
        .find_map(|line| line.strip_prefix("Max open files"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|soft| soft.parse().ok())
        .context("no open-file limit in /proc/self/limits")
}

/// A newc cpio archive (what the kernel unpacks as its initramfs).
#[derive(Debug, Default)]
struct Cpio {
    bytes: Vec<u8>,
    inode: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) -> anyhow::Result<()> {
        self.inode += 1;
        let size = u32::try_from(data.len()).context("a file too large for cpio")?;
        let name_size = u32::try_from(name.len() + 1).context("a name too long for cpio")?;
        let fields = [self.inode, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, name_size, 0];
        self.bytes.extend_from_slice(b"070701");
        for field in fields {
            self.bytes
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.bytes.extend_from_slice(name.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
        Ok(())
    }

    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }

    fn dir(&mut self, name: &str) -> anyhow::Result<()> {
        self.entry(name, 0o040_755, &[])
    }

    fn file(&mut self, name: &str, executable: bool, data: &[u8]) -> anyhow::Result<()> {
        self.entry(name, if executable { 0o100_755 } else { 0o100_644 }, data)
    }

    fn finish(mut self) -> anyhow::Result<Vec<u8>> {
        self.inode = 0;
        self.entry("TRAILER!!!", 0, &[])?;
        Ok(self.bytes)
    }
}

fn initramfs_archive(kernel: &Kernel, busybox: &Path, stage2: &str) -> anyhow::Result<Vec<u8>> {
    let mut cpio = Cpio::default();
    for dir in ["bin", "dev", "proc", "sys", "modules"] {
        cpio.dir(dir)?;
    }
    let read = |path: &Path| fs::read(path).with_context(|| format!("reading {}", path.display()));
    cpio.file("bin/busybox", true, &read(busybox)?)?;
    cpio.file("init", true, STAGE1.as_bytes())?;
    cpio.file("stage2", true, stage2.as_bytes())?;
    let mut order = String::new();
    for module in kernel.modules_with_dependencies(&INITRAMFS_MODULES)? {
        let name = Path::new(&module)
            .file_name()
            .and_then(|name| name.to_str())
            .with_context(|| format!("module path {module}"))?
            .to_owned();
        cpio.file(
            &format!("modules/{name}"),
            false,
            &read(&kernel.modules.join(&module))?,
        )?;
        order.push_str(&name);
        order.push('\n');
    }
    cpio.file("modules/order", false, order.as_bytes())?;
    cpio.finish()
}

fn qemu_command(accel: Accel, kernel: &Kernel, initramfs: &Path, results: &Path) -> Command {
    let mut qemu = Command::new("qemu-system-x86_64");
    match accel {
        Accel::Kvm | Accel::Auto => qemu.args(["-accel", "kvm", "-cpu", "host"]),
        Accel::Tcg => qemu.args(["-accel", "tcg,thread=multi", "-cpu", "max"]),
    };
    qemu.args([
        "-m",
        "4G",
        "-smp",
        "2",
        "-nographic",
        "-no-reboot",
        "-nic",
        "none",
    ])
    .args(["-device", "virtio-rng-pci"])
    .arg("-kernel")
    .arg(&kernel.vmlinuz)
    .arg("-initrd")
    .arg(initramfs)
    .args(["-append", "console=ttyS0 panic=-1 quiet"])
    .args([
        "-virtfs",
        "local,path=/,mount_tag=census-root,security_model=none,readonly=on,multidevs=remap",
    ])
    .arg("-virtfs")
    .arg(format!(
        "local,path={},mount_tag=census-results,security_model=none",
        results.display()
    ))
    // The console is output only: a terminal on stdin would be put in raw mode.
    .stdin(Stdio::null());
    qemu
}

/// Runs the guest, its console on this process's output, killing it after `timeout`.
fn boot(qemu: &mut Command, timeout: Duration) -> anyhow::Result<()> {
    cmd::announce(qemu);
    let mut child = qemu.spawn().context("running qemu-system-x86_64")?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().context("waiting for qemu")? {
            if !status.success() {
                bail!("qemu failed: {status}");
            }
            return Ok(());
        }
        if Instant::now() > deadline {
            child.kill().context("stopping qemu")?;
            child.wait().context("waiting for qemu")?;
            bail!("the guest ran past {timeout:?}: stopped (raise --timeout-minutes?)");
        }
        thread::sleep(Duration::from_millis(500));
    }
}

/// The guest's exit statuses: fine when every command passed and the guest finished.
#[expect(clippy::print_stdout, reason = "xtask reports the results")]
fn read_results(results: &Path) -> anyhow::Result<()> {
    let path = results.join("status");
    let text = fs::read_to_string(&path).unwrap_or_default();
    println!("\nresults on the 6.1 kernel:");
    let mut failed = Vec::new();
    let mut done = false;
    for line in text.lines() {
        if line == "done" {
            done = true;
            continue;
        }
        let (status, label) = line.split_once(' ').unwrap_or((line, ""));
        let passed = status == "0";
        println!("  {:<8} {label}", if passed { "passed" } else { "FAILED" });
        if !passed {
            failed.push(format!("{label} (exit status {status})"));
        }
    }
    if !done {
        bail!("the guest stopped before the suite finished (see its console above)");
    }
    if !failed.is_empty() {
        bail!("failed on the 6.1 kernel: {}", failed.join(", "));
    }
    Ok(())
}
