//! census-agent: the node agent. `census-agent --endpoints-file FILE` runs it on a
//! file, `census-agent --node-name NODE` on the pods of NODE from the API server;
//! `census-agent uninstall` removes census's datapath from the node.

use std::{
    fs,
    path::{Path, PathBuf},
    process::ExitCode,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context as _, bail};
use census_agent::{
    bpf::{self, Datapath, Inspector},
    config::{AgentArgs, Cli, Command, DatapathArgs, SourceArgs, SourceChoice, UninstallArgs},
    daemon::{self, NodeHooks, Options},
    host::HostIps,
    source::{
        EndpointSource, FileSource, PodSource,
        kubernetes::{RouteLookup, Timing},
    },
};
use census_proto::domain::NodeName;
use clap::Parser;

/// jemalloc, counting live heap bytes (census-daemon's `alloc` module says why).
#[global_allocator]
static GLOBAL: census_daemon::CountingJemalloc = census_daemon::CountingJemalloc::new();

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(error) = cli.agent.log.init() {
        tracing::warn!("{error}");
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
        operator_tls,
        pin_dir,
        datapath,
        admin_listen,
        health_listen,
        admin_limits,
        source,
        reconcile_interval,
        reconnect_max_backoff,
        no_endpoint_map,
        test_drop_endpoint_deletes,
        log: _,
        profiling,
    } = args;
    let (node, planned) = plan_source(node_name, &source, reconcile_interval)?;
    let (datapath_options, reassert_order, node_hooks) = datapath_options(datapath);
    let (datapath, pinned) = load_datapath(&pin_dir, &datapath_options)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let census_daemon::ProfilingArgs { heap_profiling } = profiling;
        if heap_profiling {
            census_daemon::profiling::activate().await?;
            tracing::info!("jemalloc heap profiling is on: /debug/pprof/heap on the admin port");
        }
        let source =
            endpoint_source(planned, &node, reconcile_interval, reconnect_max_backoff).await?;
        let options = Options {
            node,
            operator: operator.to_string(),
            operator_auth: operator_tls.auth()?,
            admin_listen,
            health_listen,
            admin_limits,
            reconcile_interval,
            initial_backoff: Duration::from_millis(200),
            max_backoff: reconnect_max_backoff,
            session: daemon::new_session(),
            host_ips: HostIps::Discover,
            reassert_order,
            endpoint_map: !no_endpoint_map,
            drop_endpoint_deletes: test_drop_endpoint_deletes,
            // Attached as the agent starts, put back by every full pass.
            node_hooks: Some(node_hooks),
        };
        let running = daemon::start(options, datapath, Some(pinned), source).await?;
        census_daemon::signal::shutdown().await;
        tracing::info!("shutting down; the datapath stays in place");
        running.shut_down().await;
        Ok(())
    })
}

/// This node's name and its endpoint source, all but started. The file is checked
/// before the datapath is loaded; the API server's client needs the runtime.
fn plan_source(
    node_name: Option<NodeName>,
    source: &SourceArgs,
    reconcile_interval: Duration,
) -> anyhow::Result<(NodeName, Planned)> {
    let choice = source.choose()?;
    let node = match (node_name, &choice) {
        (Some(node), _) => node,
        // Watching the pods of a guessed name would find none and report an empty node.
        (None, SourceChoice::Kubernetes { .. }) => bail!(
            "the Kubernetes pod source needs this node's name: set CENSUS_NODE_NAME from the \
             downward API (fieldRef spec.nodeName) or pass --node-name"
        ),
        (None, SourceChoice::File(_)) => host_name()?,
    };
    let planned = match choice {
        SourceChoice::File(path) => Planned::File(FileSource::new(path, reconcile_interval)?),
        SourceChoice::Kubernetes { kubeconfig } => Planned::Kubernetes { kubeconfig },
    };
    Ok((node, planned))
}

/// What the datapath flags ask for: how it is loaded, whether census reasserts its
/// place in front, and the node's own hooks.
fn datapath_options(args: DatapathArgs) -> (bpf::DatapathOptions, bool, NodeHooks) {
    let DatapathArgs {
        attach_mode,
        flows_max_entries,
        service_flows_max_entries,
        service_flows6_max_entries,
        endpoints_max_entries,
        nodes_max_entries,
        reassert_order,
        datapath_log,
        node_ips,
        mark_bit,
        uplinks,
        cgroup_root,
    } = args;
    let options = bpf::DatapathOptions {
        attach_mode: attach_mode.into(),
        flows_max_entries: Some(flows_max_entries),
        service_flows_max_entries: Some(service_flows_max_entries),
        service_flows6_max_entries,
        endpoints_max_entries: Some(endpoints_max_entries),
        nodes_max_entries: Some(nodes_max_entries),
        datapath_log,
        node_addresses: node_ips.into_iter().collect(),
        mark_bit,
    };
    let node_hooks = NodeHooks {
        uplinks,
        cgroup_root,
    };
    (options, reassert_order, node_hooks)
}

/// The datapath loaded (or adopted) on the pins in `pin_dir`, and a reader of its
/// maps. Loading fails early and clearly: capabilities, bpffs, the verifier's log.
/// Another agent on these pins (the old pod of a DaemonSet being replaced) is
/// waited for.
fn load_datapath(
    pin_dir: &Path,
    options: &bpf::DatapathOptions,
) -> anyhow::Result<(Datapath, Inspector)> {
    let datapath = Datapath::open_waiting(pin_dir, options, |holder| {
        tracing::warn!(
            pin_dir = %pin_dir.display(),
            %holder,
            "another census agent holds these pins: waiting for it to exit"
        );
    })
    .with_context(|| format!("cannot load census's datapath in {}", pin_dir.display()))?;
    let pinned = Inspector::open(pin_dir)
        .with_context(|| format!("cannot open the maps pinned in {}", pin_dir.display()))?;
    Ok((datapath, pinned))
}

/// The endpoint source `planned`: the file, or the pods of `node` from the API
/// server.
async fn endpoint_source(
    planned: Planned,
    node: &NodeName,
    resync: Duration,
    max_backoff: Duration,
) -> anyhow::Result<Box<dyn EndpointSource>> {
    Ok(match planned {
        Planned::File(file) => Box::new(file),
        Planned::Kubernetes { kubeconfig } => {
            let client = kube_client(kubeconfig.as_deref()).await?;
            let timing = Timing {
                resync,
                max_backoff,
                ..Timing::default()
            };
            Box::new(PodSource::new(
                client,
                node.clone(),
                Arc::new(RouteLookup),
                timing,
            ))
        }
    })
}

/// The endpoint source, all but started.
enum Planned {
    File(FileSource),
    Kubernetes { kubeconfig: Option<PathBuf> },
}

/// A client for the API server: `kubeconfig` if given, else the pod's service
/// account in a cluster, else $KUBECONFIG or ~/.kube/config.
async fn kube_client(kubeconfig: Option<&Path>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading the kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("the kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no API server to watch pods on: not in a cluster, and no kubeconfig (pass --kubeconfig, or --endpoints-file for the file source)")?,
    };
    let url = config.cluster_url.clone();
    let pool = census_daemon::apiserver::Pool::default();
    let client = census_daemon::apiserver::client(config, pool, true)
        .with_context(|| format!("cannot make a client for the API server at {url}"))?;
    tracing::info!(%url, "watching this node's pods on the API server");
    Ok(client)
}

fn host_name() -> anyhow::Result<NodeName> {
    let path = Path::new("/proc/sys/kernel/hostname");
    let name = fs::read_to_string(path)
        .with_context(|| format!("reading the host name from {}", path.display()))?;
    let name = name.trim().to_lowercase();
    NodeName::new(&name).with_context(|| "the host name is not a valid node name: pass --node-name")
}
