//! `cargo xtask mutants`: mutation testing of the allocator core with cargo-mutants.
//!
//! Each mutant is a small change to the allocator core, `operator/allocator/src/`
//! (tests excluded); it is caught when the core's lib tests fail on it. The core is a
//! crate of its own, so a mutant rebuilds and tests only the core.
//!
//! A full run is hundreds of mutants at a build and a test run each, so a run can be
//! a shard (`--shard k/N`) and bounded (`--minutes`), and every run carries on from
//! the ones before, in any checkout: the ledger `operator/allocator/mutants.tsv` is
//! kept in the repository and holds every outcome seen. A mutant is filed there under
//! its name without its line and column, and its rank among the mutants of that name
//! (so an edit above it does not make it new); before a run, the ones caught are
//! handed to cargo-mutants' `--iterate` as previously caught. A mutant never run
//! counts as missed.
//!
//! `--in-diff` runs only the mutants in lines the current change touches (the working
//! tree against its merge base with `main`), bounded in time; `cargo xtask test` calls
//! it, and it does nothing when the change touches no allocator source file.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::{Command, ExitStatus},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::cmd;

/// What is mutated: the allocator core, not its tests.
const FILES: &str = "operator/allocator/src/**";
const EXCLUDE: &str = "**/tests/**";
/// Every outcome seen, kept in the repository (see the module documentation).
const LEDGER: &str = "operator/allocator/mutants.tsv";
/// The directory `FILES` is in, for `git diff`.
const DIR: &str = "operator/allocator/src";
/// How a mutant is tested: the core's lib tests (unit and model tests), in its own
/// package (cargo-mutants tests the package a mutant is in).
const TEST_ARGS: [&str; 1] = ["--lib"];
/// Mutants that cannot change behaviour, each with why (see docs/testing.md), as
/// regexes on the names `cargo mutants --list` shows.
const EQUIVALENT: &[(&str, &str)] = &[
    (
        r"map/index\.rs:\d+:\d+: replace (EndpointIndex::len -> usize with [01]|\+ with \* in EndpointIndex::len)$",
        "EndpointIndex::len only sizes map_full's vector ahead (a capacity hint)",
    ),
    (
        r"map/index\.rs:\d+:\d+: replace EndpointIndex::has_unnamed -> bool with true$",
        "has_unnamed only skips name_conflicts, which names nothing when nothing is unnamed",
    ),
    (
        r"gc\.rs:\d+:\d+: replace > with >= in Allocator::drop_node$",
        "a node's pending count is its requests waiting (an invariant): with none, there are none to answer",
    ),
    (
        r"identities\.rs:\d+:\d+: replace > with (<|==|>=) in Identities::take_requests_of$",
        "requests wait only on identities being created or deleted, and what Watch shows of those does not depend on their waiters",
    ),
    (
        r"map/index\.rs:\d+:\d+: delete match arm \((Some\(b\), Some\(a\)|None, None)\) in EndpointIndex::account$",
        "a fast path: take compares every address it is told of with its winner before",
    ),
    (
        r"map/index\.rs:\d+:\d+: delete field won from struct Edit expression in claim_in$",
        "won is read only with a conflict, and a claim on a vacant address meets none",
    ),
    (
        r"map/index\.rs:\d+:\d+: replace match guard m\.claims\[i\]\.identity == claim\.identity with false in claim_in$",
        "views claim only what changed: a claimant never claims an address again for the identity it holds it with",
    ),
    (
        r"map/index\.rs:\d+:\d+: replace match guard c\.same_claimant\(node, key\) with true in unclaim_in$",
        "a claimant unclaims only what it claimed, and a second claimant makes the slot contested, so a lone claim is the caller's",
    ),
    (
        r"map/index\.rs:\d+:29: replace > with >= in NodeTable::take$",
        "a node slot left without claims was queued as unused and freed just above, in the same take",
    ),
    (
        r"map/index\.rs:\d+:\d+: replace > with >= in NodeTable::in_use$",
        "slots without claims live only from an unclaim to the take that ends the same event, and the full map is read between events",
    ),
    (
        r"map/view\.rs:\d+:\d+: replace (!= with == in View::mark_seen|View::mark_seen -> Option<\(bool, &ViewEntry\)> with None)$",
        "the fast path for an unchanged snapshot: the full path builds the same view",
    ),
];

#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Options {
    /// Run only shard K of N (`K/N`, K from 0); a later run with the same shard
    /// carries on with what is left of it.
    #[arg(long, value_name = "K/N")]
    shard: Option<String>,
    /// Stop after this many minutes (what did not run counts as missed, and runs
    /// next time).
    #[arg(long)]
    minutes: Option<u64>,
    /// Only the mutants in lines changed against the merge base with `--base`;
    /// nothing to do when no allocator source file changed.
    #[arg(long)]
    in_diff: bool,
    /// The branch `--in-diff` compares with.
    #[arg(long, default_value = "main")]
    base: String,
    /// Start over: forget the ledger and the outcomes of earlier runs.
    #[arg(long)]
    fresh: bool,
    /// Only print the figures of the runs so far.
    #[arg(long)]
    report: bool,
    /// Mutants built and tested at once, each in its own copy of the tree (the
    /// core's tests are mostly one single-threaded model test).
    #[arg(long, default_value_t = 2)]
    jobs: usize,
}

/// The outcome of one mutant, as cargo-mutants files it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Caught,
    Missed,
    Timeout,
    Unviable,
}

impl Outcome {
    const ALL: [Self; 4] = [Self::Caught, Self::Missed, Self::Timeout, Self::Unviable];

    fn file(self) -> &'static str {
        match self {
            Self::Caught => "caught.txt",
            Self::Missed => "missed.txt",
            Self::Timeout => "timeout.txt",
            Self::Unviable => "unviable.txt",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Caught => "caught",
            Self::Missed => "missed",
            Self::Timeout => "timeout",
            Self::Unviable => "unviable",
        }
    }

    fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|o| o.name() == text)
    }
}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {
        shard,
        minutes,
        in_diff,
        base,
        fresh,
        report,
        jobs,
    } = options;
    let root = cmd::workspace_root();
    let dir = root.join("target").join("mutants");
    if in_diff {
        return run_in_diff(
            &root,
            &dir,
            &base,
            minutes.map(|m| Duration::from_secs(m * 60)),
        );
    }
    let ledger_path = root.join(LEDGER);
    if fresh {
        for stale in [
            dir.join("mutants.out"),
            dir.join("mutants.out.old"),
            ledger_path.clone(),
        ] {
            if stale.is_dir() {
                fs::remove_dir_all(&stale)
                    .with_context(|| format!("removing {}", stale.display()))?;
            } else if stale.is_file() {
                fs::remove_file(&stale).with_context(|| format!("removing {}", stale.display()))?;
            }
        }
    }
    let all = list(&root, None)?;
    if !report {
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        seed_previously_caught(&dir, &all, &read_ledger(&ledger_path)?)?;
        let mut command = mutants_command(&root)?;
        command
            .arg("--iterate")
            .arg("--output")
            .arg(&dir)
            .arg("--jobs")
            .arg(jobs.to_string());
        if let Some(shard) = &shard {
            command.args(["--shard", shard]);
        }
        command.arg("--").args(TEST_ARGS);
        let started = Instant::now();
        let status = run_bounded(&mut command, minutes.map(|m| Duration::from_secs(m * 60)))?;
        let mut ledger = read_ledger(&ledger_path)?;
        ledger.extend(by_key(&all, read_outcomes(&dir.join("mutants.out"))?));
        // Mutants of code that is gone are forgotten.
        let current: BTreeSet<String> = keys(&all).into_iter().collect();
        ledger.retain(|key, _| current.contains(key));
        write_ledger(&ledger_path, &ledger)?;
        say(&format!(
            "cargo-mutants ran for {:.0?} ({})",
            started.elapsed(),
            status.map_or_else(|| "stopped at the time bound".to_owned(), |s| s.to_string())
        ));
    }
    let ledger = read_ledger(&ledger_path)?;
    let outcomes = keys(&all)
        .into_iter()
        .zip(&all)
        .filter_map(|(key, name)| Some((name.clone(), *ledger.get(&key)?)))
        .collect();
    print_figures(&all, &outcomes, &format!("ledger {LEDGER}"));
    Ok(())
}

/// The ledger's key of each of `names` (in `--list` order): the name without its
/// line and column, then `#` and its rank among the mutants of that name.
fn keys(names: &[String]) -> Vec<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    names
        .iter()
        .map(|name| {
            let bare = without_position(name);
            let rank = seen.entry(bare.clone()).or_default();
            *rank += 1;
            format!("{bare} #{rank}")
        })
        .collect()
}

/// `operator/allocator/src/gc.rs:42:9: replace ...` -> `operator/allocator/src/gc.rs: replace ...`.
fn without_position(name: &str) -> String {
    let Some((file, rest)) = name.split_once(':') else {
        return name.to_owned();
    };
    let rest = rest.trim_start_matches(|c: char| c.is_ascii_digit() || c == ':');
    format!("{file}:{rest}")
}

/// `outcomes` (by cargo-mutants' names) filed under the ledger's keys.
fn by_key(all: &[String], mut outcomes: BTreeMap<String, Outcome>) -> BTreeMap<String, Outcome> {
    keys(all)
        .into_iter()
        .zip(all)
        .filter_map(|(key, name)| Some((key, outcomes.remove(name)?)))
        .collect()
}

/// Tells cargo-mutants' `--iterate` which of `all` the ledger has seen caught or
/// unviable, so it skips them.
fn seed_previously_caught(
    dir: &Path,
    all: &[String],
    ledger: &BTreeMap<String, Outcome>,
) -> anyhow::Result<()> {
    let out = dir.join("mutants.out");
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let caught: String = keys(all)
        .into_iter()
        .zip(all)
        .filter(|(key, _)| matches!(ledger.get(key), Some(Outcome::Caught | Outcome::Unviable)))
        .map(|(_, name)| format!("{name}\n"))
        .collect();
    // cargo-mutants reads these three; only the ledger's view of them counts.
    for stale in ["caught.txt", "unviable.txt"] {
        let path = out.join(stale);
        if path.is_file() {
            fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    let path = out.join("previously_caught.txt");
    fs::write(&path, caught).with_context(|| format!("writing {}", path.display()))
}

/// `cargo xtask test`'s step: the mutants of what the change touches in the
/// allocator, within 10 minutes.
pub(crate) fn in_diff_step() -> anyhow::Result<()> {
    let root = cmd::workspace_root();
    let dir = root.join("target").join("mutants");
    run_in_diff(&root, &dir, "main", Some(Duration::from_secs(600)))
}

/// The mutants of the lines the working tree changes against its merge base with
/// `base`, bounded by `limit` (default 10 minutes). Fails if one is missed.
fn run_in_diff(root: &Path, dir: &Path, base: &str, limit: Option<Duration>) -> anyhow::Result<()> {
    let output = Command::new("git")
        .current_dir(root)
        .args(["diff", "--merge-base", base, "--", DIR])
        .output()
        .context("running git diff")?;
    if !output.status.success() {
        bail!(
            "git diff --merge-base {base} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let diff = String::from_utf8(output.stdout).context("git diff printed non-UTF-8")?;
    let touched: Vec<&str> = diff
        .lines()
        .filter_map(|l| l.strip_prefix("+++ b/"))
        .filter(|path| !path.contains("/tests/"))
        .collect();
    if touched.is_empty() {
        say(&format!(
            "mutants: the change against {base} touches no allocator source file: nothing to do"
        ));
        return Ok(());
    }
    let dir = dir.join("in-diff");
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let patch = dir.join("change.diff");
    fs::write(&patch, &diff).with_context(|| format!("writing {}", patch.display()))?;
    let all = list(root, Some(&patch))?;
    say(&format!(
        "mutants: {} mutants in the lines changed in {}",
        all.len(),
        touched.join(", ")
    ));
    if all.is_empty() {
        return Ok(());
    }
    let mut command = mutants_command(root)?;
    command
        .arg("--in-diff")
        .arg(&patch)
        .arg("--output")
        .arg(&dir)
        .arg("--")
        .args(TEST_ARGS);
    run_bounded(
        &mut command,
        Some(limit.unwrap_or(Duration::from_secs(600))),
    )?;
    let outcomes = read_outcomes(&dir.join("mutants.out"))?;
    let (_, missed, _, _) = print_figures(&all, &outcomes, "this change");
    if missed > 0 {
        bail!(
            "{missed} mutants in the changed lines were not caught or not run: add a test \
             that catches each, or list an equivalent one in xtask/src/mutants.rs with why"
        );
    }
    Ok(())
}

/// `cargo mutants` over the allocator, installing cargo-mutants first if missing.
fn mutants_command(root: &Path) -> anyhow::Result<Command> {
    if cmd::find_program("cargo-mutants").is_none() {
        say(
            "cargo-mutants is not installed: installing it with `cargo install --locked cargo-mutants`",
        );
        cmd::run(cmd::host_cargo().args(["install", "--locked", "cargo-mutants"]))?;
    }
    // At the lowest CPU priority: a long run shares the machine with everything else.
    let mut command = match cmd::find_program("nice") {
        Some(nice) => {
            let mut c = Command::new(nice);
            c.args(["-n", "19"]).arg(cmd::host_cargo_program());
            c
        }
        None => cmd::host_cargo(),
    };
    // A failing property test would shrink its case first: a mutant needs only the
    // failure.
    command.env("PROPTEST_MAX_SHRINK_ITERS", "0");
    command.current_dir(root).args([
        "mutants",
        "--no-shuffle",
        "--file",
        FILES,
        "--exclude",
        EXCLUDE,
    ]);
    for (re, _) in EQUIVALENT {
        command.args(["--exclude-re", re]);
    }
    Ok(command)
}

/// The names of every mutant a run would test (of the lines in `diff`, if given).
fn list(root: &Path, diff: Option<&Path>) -> anyhow::Result<Vec<String>> {
    let mut command = mutants_command(root)?;
    command.arg("--list");
    if let Some(diff) = diff {
        command.arg("--in-diff").arg(diff);
    }
    let output = command.output().context("running cargo mutants --list")?;
    if !output.status.success() {
        bail!(
            "cargo mutants --list failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let text = String::from_utf8(output.stdout).context("cargo mutants printed non-UTF-8")?;
    // `--exclude-re` passes some mutants (deleted struct fields), so equivalent
    // mutants are also taken out of the figures here.
    let equivalent = regex::RegexSet::new(EQUIVALENT.iter().map(|(re, _)| *re))
        .context("the EQUIVALENT patterns")?;
    Ok(text
        .lines()
        .filter(|l| !l.is_empty() && !equivalent.is_match(l))
        .map(str::to_owned)
        .collect())
}

/// Runs `command`, killing it (and what it started) after `limit`. `None` if it was
/// stopped; the outcomes it wrote so far stay.
fn run_bounded(
    command: &mut Command,
    limit: Option<Duration>,
) -> anyhow::Result<Option<ExitStatus>> {
    use std::os::unix::process::CommandExt as _;

    cmd::announce(command);
    // Its own process group, so the builds and tests it started stop with it.
    command.process_group(0);
    let mut child = command.spawn().context("starting cargo mutants")?;
    let deadline = limit.map(|l| Instant::now() + l);
    loop {
        if let Some(status) = child.try_wait().context("waiting for cargo mutants")? {
            // Exit codes 2 (missed) and 3 (timeouts) are figures, not failures.
            return match status.code() {
                Some(0 | 2 | 3) => Ok(Some(status)),
                _ => bail!("cargo mutants failed: {status}"),
            };
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            say(
                "mutants: time is up; stopping cargo-mutants (what it did not run counts as missed)",
            );
            if let Ok(pid) = i32::try_from(child.id()) {
                // SIGINT first: cargo-mutants then writes what it has and cleans up.
                let group = nix::unistd::Pid::from_raw(pid);
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGINT);
                let grace = Instant::now() + Duration::from_secs(30);
                while child.try_wait().ok().flatten().is_none() && Instant::now() < grace {
                    std::thread::sleep(Duration::from_millis(200));
                }
                let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            }
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The outcomes in a cargo-mutants output directory (caught ones of earlier
/// iterations included).
fn read_outcomes(out: &Path) -> anyhow::Result<BTreeMap<String, Outcome>> {
    let mut outcomes = BTreeMap::new();
    let files = Outcome::ALL
        .into_iter()
        .map(|o| (o.file(), o))
        .chain([("previously_caught.txt", Outcome::Caught)]);
    for (file, outcome) in files {
        let path = out.join(file);
        if !path.is_file() {
            continue;
        }
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        for name in text.lines().filter(|l| !l.is_empty()) {
            // cargo-mutants counts unviable mutants as previously caught too.
            outcomes.entry(name.to_owned()).or_insert(outcome);
        }
    }
    Ok(outcomes)
}

fn read_ledger(path: &Path) -> anyhow::Result<BTreeMap<String, Outcome>> {
    if !path.is_file() {
        return Ok(BTreeMap::new());
    }
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut ledger = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let parsed = line
            .split_once('\t')
            .and_then(|(outcome, name)| Some((Outcome::parse(outcome)?, name)));
        let Some((outcome, name)) = parsed else {
            bail!(
                "{}:{}: not `<outcome>\\t<mutant>`: {line:?}",
                path.display(),
                n + 1
            );
        };
        ledger.insert(name.to_owned(), outcome);
    }
    Ok(ledger)
}

fn write_ledger(path: &Path, ledger: &BTreeMap<String, Outcome>) -> anyhow::Result<()> {
    let mut text = String::from(
        "# The outcome of every allocator mutant seen by `cargo xtask mutants`, by its name\n\
         # without line and column and its rank among mutants of that name. Written by\n\
         # xtask/src/mutants.rs; docs/testing.md says how the figures are read.\n",
    );
    text.extend(
        ledger
            .iter()
            .map(|(name, outcome)| format!("{}\t{name}\n", outcome.name())),
    );
    let tmp: PathBuf = path.with_extension("tsv.tmp");
    fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))
}

/// Prints caught / missed / timeout / unviable over `all` (a mutant without an
/// outcome counts as missed) and the missed ones; returns the four counts.
fn print_figures(
    all: &[String],
    outcomes: &BTreeMap<String, Outcome>,
    what: &str,
) -> (usize, usize, usize, usize) {
    let mut counts: BTreeMap<Outcome, usize> = BTreeMap::new();
    let mut missed = Vec::new();
    let mut not_run = 0;
    for name in all {
        match outcomes.get(name) {
            Some(&o) => {
                *counts.entry(o).or_default() += 1;
                if o == Outcome::Missed {
                    missed.push(name.as_str());
                }
            }
            None => not_run += 1,
        }
    }
    let get = |o| counts.get(&o).copied().unwrap_or(0);
    let (caught, timeout, unviable) = (
        get(Outcome::Caught),
        get(Outcome::Timeout),
        get(Outcome::Unviable),
    );
    let missed_total = get(Outcome::Missed) + not_run;
    let viable = all.len() - unviable;
    let pct = |n: usize| {
        if viable == 0 {
            100.0
        } else {
            n as f64 * 100.0 / viable as f64
        }
    };
    for name in &missed {
        say(&format!("MISSED {name}"));
    }
    say(&format!(
        "mutants ({what}): {} in all: {caught} caught, {missed_total} missed ({} run, {not_run} \
         not run), {timeout} timeout, {unviable} unviable; {:.1}% of the {viable} viable caught \
         ({:.1}% with timeouts)",
        all.len(),
        get(Outcome::Missed),
        pct(caught),
        pct(caught + timeout)
    ));
    (caught, missed_total, timeout, unviable)
}

#[expect(clippy::print_stdout, reason = "xtask reports what it did")]
fn say(line: &str) {
    println!("{line}");
}
