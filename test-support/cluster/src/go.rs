//! The upstream binaries, built from the pinning modules under
//! `test-support/control-plane/` with the machine's Go: built once per pin (the
//! modules' go.mod and go.sum, the Go version and the version stamps) into a directory
//! named after it, so a changed pin builds again and an unchanged one never does.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use crate::{Error, Say};

/// The Kubernetes components' module (k8s.io/kubernetes, pinned with its staging
/// modules and etcd) and kwok's, each in a module graph of its own.
const KUBERNETES_MODULE: &str = "test-support/control-plane";
const KWOK_MODULE: &str = "test-support/control-plane/kwok";

/// The Kubernetes programs, by package.
const KUBERNETES_PROGRAMS: [&str; 5] = [
    "k8s.io/kubernetes/cmd/kube-apiserver",
    "k8s.io/kubernetes/cmd/kube-controller-manager",
    "k8s.io/kubernetes/cmd/kube-scheduler",
    "k8s.io/kubernetes/cmd/kubectl",
    // etcd's server module's main package: `go build` names it `server`.
    "go.etcd.io/etcd/server/v3",
];

/// Where the built programs are, and what they are.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub dir: PathBuf,
    /// The Kubernetes release, e.g. `v1.36.3`.
    pub kubernetes: String,
    pub etcd: String,
    pub kwok: String,
}

impl Binaries {
    pub fn path(&self, program: Program) -> PathBuf {
        self.dir.join(program.file())
    }
}

/// One of the built programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    Etcd,
    KubeApiserver,
    KubeControllerManager,
    KubeScheduler,
    Kubectl,
    Kwok,
}

impl Program {
    pub const ALL: [Self; 6] = [
        Self::Etcd,
        Self::KubeApiserver,
        Self::KubeControllerManager,
        Self::KubeScheduler,
        Self::Kubectl,
        Self::Kwok,
    ];

    pub fn file(self) -> &'static str {
        match self {
            Self::Etcd => "etcd",
            Self::KubeApiserver => "kube-apiserver",
            Self::KubeControllerManager => "kube-controller-manager",
            Self::KubeScheduler => "kube-scheduler",
            Self::Kubectl => "kubectl",
            Self::Kwok => "kwok",
        }
    }
}

/// The Go this machine has (`go1.26.8`), checked against what the pinning modules
/// declare: an error says what to install.
pub fn check(repo: &Path) -> Result<String, Error> {
    let output = Command::new("go")
        .args(["env", "GOVERSION"])
        .output()
        .map_err(|source| Error::GoMissing { source })?;
    let found = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let need = go_directive(&repo.join(KUBERNETES_MODULE).join("go.mod"))?;
    if version_tuple(found.trim_start_matches("go")) < version_tuple(&need) {
        return Err(Error::GoTooOld { found, need });
    }
    Ok(found)
}

fn go_directive(go_mod: &Path) -> Result<String, Error> {
    let text = read(go_mod)?;
    text.lines()
        .find_map(|l| l.strip_prefix("go ").map(|v| v.trim().to_owned()))
        .ok_or_else(|| Error::Pin {
            file: go_mod.to_owned(),
            what: "no `go` directive",
        })
}

fn version_tuple(v: &str) -> Vec<u32> {
    v.split(['.', '-', 'r', 'c'])
        .map_while(|p| p.parse().ok())
        .collect()
}

/// The version a go.mod requires of `module` (`module vX.Y.Z` on a line of its own).
fn required(go_mod: &Path, module: &str) -> Result<String, Error> {
    let text = read(go_mod)?;
    text.lines()
        .map(str::trim)
        .map(|l| l.strip_prefix("require ").unwrap_or(l))
        .find_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some(module))
                .then(|| words.next().map(str::to_owned))
                .flatten()
        })
        .ok_or(Error::Pin {
            file: go_mod.to_owned(),
            what: "a pinned module is not required",
        })
}

fn read(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        what: "read",
        path: path.to_owned(),
        source,
    })
}

/// FNV-1a: a stable digest of the pins (std's hasher may change between releases).
fn digest(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for part in parts {
        for byte in part.iter().copied().chain([0xff]) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// The version stamps an unstamped build lacks (it would say v0.0.0-master).
fn ldflags(kubernetes: &str) -> String {
    let minor = kubernetes.split('.').nth(1).unwrap_or("0");
    let major = kubernetes
        .trim_start_matches('v')
        .split('.')
        .next()
        .unwrap_or("0");
    [
        "k8s.io/component-base/version",
        "k8s.io/client-go/pkg/version",
    ]
    .iter()
    .map(|pkg| {
        format!(
            "-X {pkg}.gitVersion={kubernetes} -X {pkg}.gitMajor={major} -X {pkg}.gitMinor={minor}"
        )
    })
    .collect::<Vec<_>>()
    .join(" ")
}

/// Builds the programs unless this pin's build is there already; says what it builds
/// and how long it took.
pub fn build(repo: &Path, target: &Path, say: Say<'_>) -> Result<Binaries, Error> {
    let go = check(repo)?;
    let k8s_mod = repo.join(KUBERNETES_MODULE).join("go.mod");
    let kwok_mod = repo.join(KWOK_MODULE).join("go.mod");
    let kubernetes = required(&k8s_mod, "k8s.io/kubernetes")?;
    let etcd = required(&k8s_mod, "go.etcd.io/etcd/server/v3")?;
    let kwok = required(&kwok_mod, "sigs.k8s.io/kwok")?;
    let flags = ldflags(&kubernetes);
    let files = [
        read(&k8s_mod)?,
        read(&repo.join(KUBERNETES_MODULE).join("go.sum"))?,
        read(&kwok_mod)?,
        read(&repo.join(KWOK_MODULE).join("go.sum"))?,
    ];
    let mut parts: Vec<&[u8]> = files.iter().map(String::as_bytes).collect();
    parts.extend([go.as_bytes(), flags.as_bytes()]);
    let dir = target
        .join("control-plane")
        .join(format!("{kubernetes}-{:016x}", digest(&parts)));
    let binaries = Binaries {
        dir: dir.clone(),
        kubernetes: kubernetes.clone(),
        etcd,
        kwok,
    };
    if Program::ALL.iter().all(|p| binaries.path(*p).is_file()) {
        return Ok(binaries);
    }
    let building = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&building);
    std::fs::create_dir_all(&building).map_err(|source| Error::Io {
        what: "create",
        path: building.clone(),
        source,
    })?;
    say(&format!(
        "building Kubernetes {kubernetes} (etcd {}, kubectl) and kwok {} with {go} into {} \
         (cold: 15-25 min on 2 cores; Go's caches make a rebuild about a minute)",
        binaries.etcd,
        binaries.kwok,
        dir.display()
    ));
    let started = Instant::now();
    let mut cmd = Command::new("go");
    cmd.current_dir(repo.join(KUBERNETES_MODULE))
        .env("CGO_ENABLED", "0")
        .args(["build", "-trimpath", "-ldflags", &flags, "-o"])
        .arg(&building)
        .args(KUBERNETES_PROGRAMS);
    run(cmd, "go build (Kubernetes, etcd)")?;
    rename(&building.join("server"), &building.join("etcd"))?;
    let mut cmd = Command::new("go");
    cmd.current_dir(repo.join(KWOK_MODULE))
        .env("CGO_ENABLED", "0")
        .args(["build", "-trimpath", "-o"])
        .arg(building.join("kwok"))
        .arg("sigs.k8s.io/kwok/cmd/kwok");
    run(cmd, "go build (kwok)")?;
    // kwok's node and pod stages (kwokctl's defaults), from the module it was built
    // from, so the stages match the binary.
    let mut cmd = Command::new("go");
    cmd.current_dir(repo.join(KWOK_MODULE)).args([
        "list",
        "-m",
        "-f",
        "{{.Dir}}",
        "sigs.k8s.io/kwok",
    ]);
    let source = PathBuf::from(output(cmd, "go list (kwok's source)")?.trim());
    let mut stages = String::new();
    for stage in [
        "node/fast/node-initialize.yaml",
        "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
        "pod/fast/pod-ready.yaml",
        "pod/fast/pod-complete.yaml",
        "pod/fast/pod-delete.yaml",
    ] {
        stages.push_str("---\n");
        stages.push_str(&read(&source.join("kustomize/stage").join(stage))?);
    }
    write(&building.join("kwok-stages.yaml"), &stages)?;
    let _ = std::fs::remove_dir_all(&dir);
    rename(&building, &dir)?;
    say(&format!(
        "built the control plane in {:.0?}",
        started.elapsed()
    ));
    Ok(binaries)
}

fn rename(from: &Path, to: &Path) -> Result<(), Error> {
    std::fs::rename(from, to).map_err(|source| Error::Io {
        what: "rename",
        path: from.to_owned(),
        source,
    })
}

pub(crate) fn write(path: &Path, contents: &str) -> Result<(), Error> {
    std::fs::write(path, contents).map_err(|source| Error::Io {
        what: "write",
        path: path.to_owned(),
        source,
    })
}

fn run(mut cmd: Command, what: &'static str) -> Result<(), Error> {
    let status = cmd
        .status()
        .map_err(|source| Error::Spawn { what, source })?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Failed {
            what,
            status,
            detail: String::new(),
        })
    }
}

fn output(mut cmd: Command, what: &'static str) -> Result<String, Error> {
    let out = cmd
        .output()
        .map_err(|source| Error::Spawn { what, source })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(Error::Failed {
            what,
            status: out.status,
            detail: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

/// Rewrites the Kubernetes pinning module for `release` (e.g. `v1.36.3`): one
/// `replace` per staging module that k8s.io/kubernetes's own go.mod lists, at the
/// matching `v0.X.Y`, then `go mod tidy`. What `cargo xtask cluster pin` runs.
pub fn pin(repo: &Path, release: &str, say: Say<'_>) -> Result<(), Error> {
    check(repo)?;
    let module = repo.join(KUBERNETES_MODULE);
    let mut cmd = Command::new("go");
    cmd.current_dir(&module).args([
        "mod",
        "download",
        "-json",
        &format!("k8s.io/kubernetes@{release}"),
    ]);
    let info: serde_json::Value =
        serde_json::from_str(&output(cmd, "go mod download (k8s.io/kubernetes)")?).map_err(
            |_| Error::Pin {
                file: module.join("go.mod"),
                what: "go mod download printed no JSON",
            },
        )?;
    let upstream = PathBuf::from(info["GoMod"].as_str().unwrap_or_default());
    let staging: Vec<String> = read(&upstream)?
        .lines()
        .filter(|l| l.contains("=> ./staging/"))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect();
    let staging_version = format!("v0.{}", release.trim_start_matches("v1."));
    let go = go_directive(&upstream)?;
    let mut text = format!(
        "// Pins the upstream Kubernetes components census's tests run against (etcd,\n\
         // kube-apiserver, kube-controller-manager, kube-scheduler, kubectl); no Go code.\n\
         // Written by `cargo xtask cluster pin {release}`: never `go get -u`.\n\
         module census.dev/control-plane\n\ngo {go}\n\nrequire k8s.io/kubernetes {release}\n\ntool (\n"
    );
    for program in KUBERNETES_PROGRAMS {
        text.push_str(&format!("\t{program}\n"));
    }
    text.push_str(
        ")\n\n// k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them\n\
         // with local paths, which a dependent module ignores: each is pinned here.\nreplace (\n",
    );
    for m in &staging {
        text.push_str(&format!("\t{m} => {m} {staging_version}\n"));
    }
    text.push_str(")\n");
    write(&module.join("go.mod"), &text)?;
    let mut cmd = Command::new("go");
    cmd.current_dir(&module).args(["mod", "tidy"]);
    run(cmd, "go mod tidy")?;
    say(&format!(
        "pinned Kubernetes {release} ({} staging modules at {staging_version}); commit go.mod and go.sum",
        staging.len()
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_compare_by_number() {
        assert!(version_tuple("1.26.8") >= version_tuple("1.26.0"));
        assert!(version_tuple("1.9") < version_tuple("1.26.0"));
        assert!(version_tuple("1.27rc1") > version_tuple("1.26.0"));
    }

    #[test]
    fn stamps_name_the_release() {
        let flags = ldflags("v1.36.3");
        assert!(flags.contains("k8s.io/component-base/version.gitVersion=v1.36.3"));
        assert!(flags.contains("gitMajor=1 "));
        assert!(flags.contains("gitMinor=36"));
    }

    #[test]
    fn the_digest_changes_with_any_pin() {
        assert_ne!(digest(&[b"a", b"bc"]), digest(&[b"ab", b"c"]));
        assert_eq!(digest(&[b"go.mod"]), digest(&[b"go.mod"]));
    }
}
