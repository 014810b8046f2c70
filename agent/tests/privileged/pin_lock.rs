//! One agent per pin directory: a second `Datapath` on the same pins is refused,
//! naming the holder; a second `census-agent` process waits until the first exits,
//! then takes the pins over.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use census_agent::bpf::{Datapath, Error};
use census_netlab::{ChildGuard, Lab};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::support::{Fallible, PinDir, TestResult, eventually};

const WAIT: Duration = Duration::from_secs(20);
const LOADED: &str = "census datapath loaded";
const WAITING: &str = "another census agent holds these pins: waiting for it to exit";

/// A `census-agent` on an empty endpoints file, in the lab's node namespace, its
/// log in `dir/<name>.log`.
fn spawn_agent(
    lab: &Lab,
    pins: &PinDir,
    dir: &Path,
    name: &str,
) -> Fallible<(ChildGuard, PathBuf)> {
    let endpoints = dir.join("endpoints.yaml");
    fs::write(&endpoints, "[]\n")?;
    let log = dir.join(format!("{name}.log"));
    let mut command = Command::new(env!("CARGO_BIN_EXE_census-agent"));
    command
        .args(["--node-name", "lock-node"])
        // Nobody listens there: the agent runs fail-static, which is all this needs.
        .args(["--operator", "http://127.0.0.1:9"])
        .arg("--pin-dir")
        .arg(pins.path())
        .args(["--admin-listen", "127.0.0.1:0"])
        .arg("--endpoints-file")
        .arg(&endpoints)
        .args(["--attach-mode", super::support::attach_mode_arg()])
        .args(["--log", "info", "--log-format", "text"])
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log)?);
    Ok((lab.node().spawn(&mut command)?, log))
}

fn log_has(log: &Path, needle: &str) -> Fallible<bool> {
    Ok(fs::read_to_string(log)?.contains(needle))
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_second_datapath_on_the_same_pins_is_refused_naming_the_holder() -> TestResult {
    let pins = PinDir::new();
    let first = Datapath::open(pins.path())?;
    match Datapath::open(pins.path()) {
        Err(Error::PinDirLocked { pin_dir, holder }) => {
            assert_eq!(pin_dir, pins.path());
            assert_eq!(holder.pid, Some(std::process::id()));
        }
        other => return Err(format!("expected PinDirLocked, got {other:?}").into()),
    }
    drop(first);
    drop(Datapath::open(pins.path())?);
    Ok(())
}

#[test]
#[ignore = "needs root: cargo xtask test-privileged"]
fn a_second_agent_waits_for_the_first_and_takes_the_pins_over() -> TestResult {
    let pins = PinDir::new();
    let lab = Lab::new()?;
    let dir = tempfile::tempdir()?;
    let (mut a, a_log) = spawn_agent(&lab, &pins, dir.path(), "a")?;
    let a_pid = a.child().id();
    assert!(
        eventually(WAIT, || log_has(&a_log, LOADED))?,
        "the first agent did not load: {}",
        fs::read_to_string(&a_log)?
    );

    let (mut b, b_log) = spawn_agent(&lab, &pins, dir.path(), "b")?;
    assert!(
        eventually(WAIT, || log_has(&b_log, WAITING))?,
        "the second agent did not wait: {}",
        fs::read_to_string(&b_log)?
    );
    let waiting = fs::read_to_string(&b_log)?;
    assert!(
        waiting.contains(&format!("pid {a_pid}")),
        "the holder is not named: {waiting}"
    );
    assert!(!waiting.contains(LOADED), "both agents loaded: {waiting}");
    assert_eq!(b.child().try_wait()?, None, "the second agent exited");

    // The first agent dies (as a pod deleted with SIGKILL after its grace period):
    // the kernel drops its lock, the second one loads the pins at once.
    kill(Pid::from_raw(i32::try_from(a_pid)?), Signal::SIGKILL)?;
    a.child().wait()?;
    assert!(
        eventually(WAIT, || log_has(&b_log, LOADED))?,
        "the second agent did not take over: {}",
        fs::read_to_string(&b_log)?
    );
    assert_eq!(b.child().try_wait()?, None, "the second agent exited");
    kill(
        Pid::from_raw(i32::try_from(b.child().id())?),
        Signal::SIGKILL,
    )?;
    b.child().wait()?;
    Ok(())
}
