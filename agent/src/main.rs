//! census-agent: the node agent. `census-agent --endpoints-file FILE` runs it;
//! `census-agent uninstall` removes census's datapath from the node.

use std::{fs, path::Path, process::ExitCode, time::Duration};

use anyhow::{Context as _, bail};
use census_agent::{
    bpf::{self, Datapath, Inspector},
    config::{AgentArgs, Cli, Command, LogFormat, SourceArgs, UninstallArgs},
    daemon::{self, Options},
    host::HostIps,
    source::FileSource,
};
use census_proto::domain::NodeName;
use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = EnvFilter::try_new(&cli.agent.log.log).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.agent.log.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    let result = match cli.command {
        Some(Command::Uninstall(args)) => uninstall(args),
        None => run(cli.agent),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            #[expect(clippy::print_stderr, reason = "the one-line reason a daemon exits")]
            {
                eprintln!("census-agent: {error:#}");
            }
            ExitCode::FAILURE
        }
    }
}

#[expect(clippy::print_stdout, reason = "uninstall says what it removed")]
fn uninstall(args: UninstallArgs) -> anyhow::Result<()> {
    let UninstallArgs { pin_dir } = args;
    let removed = bpf::uninstall(&pin_dir)
        .with_context(|| format!("uninstalling census from {}", pin_dir.display()))?;
    if !removed.removed_dir {
        println!("nothing to remove: {} does not exist", pin_dir.display());
        return Ok(());
    }
    for link in &removed.links {
        println!("detached and unpinned {}", link.display());
    }
    for pin in &removed.pins {
        println!("removed {}", pin.display());
    }
    println!("removed {}", pin_dir.display());
    Ok(())
}

fn run(args: AgentArgs) -> anyhow::Result<()> {
    let AgentArgs {
        node_name,
        operator,
        pin_dir,
        admin_listen,
        source: SourceArgs { endpoints_file },
        reconcile_interval,
        reconnect_max_backoff,
        log: _,
    } = args;
    let node = match node_name {
        Some(node) => node,
        None => host_name()?,
    };
    let Some(endpoints_file) = endpoints_file else {
        bail!(
            "no endpoint source: pass --endpoints-file FILE (or CENSUS_ENDPOINTS_FILE); the \
             Kubernetes pod source is not built yet"
        );
    };
    let source = FileSource::new(endpoints_file, reconcile_interval)?;

    // Loading fails early and clearly: capabilities, bpffs, the verifier's log.
    let datapath = Datapath::open(&pin_dir)
        .with_context(|| format!("cannot load census's datapath in {}", pin_dir.display()))?;
    let pinned = Inspector::open(&pin_dir)
        .with_context(|| format!("cannot open the maps pinned in {}", pin_dir.display()))?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let options = Options {
            node,
            operator: operator.to_string(),
            admin_listen,
            reconcile_interval,
            initial_backoff: Duration::from_millis(200),
            max_backoff: reconnect_max_backoff,
            session: daemon::new_session(),
            host_ips: HostIps::Discover,
        };
        let running = daemon::start(options, datapath, Some(pinned), Box::new(source)).await?;
        wait_for_signal().await;
        tracing::info!("shutting down; the datapath stays in place");
        running.shut_down().await;
        Ok(())
    })
}

fn host_name() -> anyhow::Result<NodeName> {
    let path = Path::new("/proc/sys/kernel/hostname");
    let name = fs::read_to_string(path)
        .with_context(|| format!("reading the host name from {}", path.display()))?;
    let name = name.trim().to_lowercase();
    NodeName::new(&name).with_context(|| "the host name is not a valid node name: pass --node-name")
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("cannot install signal handlers; stop with SIGKILL");
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}
