//! census-operator: the identity allocator daemon.

use std::process::ExitCode;

use census_operator::{
    config::{Cli, Command},
    daemon,
    store::kubernetes::crd,
};
use clap::Parser;

/// jemalloc, counting live heap bytes (census-daemon's `alloc` module says why).
#[global_allocator]
static GLOBAL: census_daemon::CountingJemalloc = census_daemon::CountingJemalloc::new();

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(error) = cli.log.init() {
        tracing::warn!("{error}");
    }
    match &cli.command {
        Some(Command::Crdgen { out }) => return crdgen(out.as_deref()),
        Some(Command::Certs(args)) => return certs(args),
        None => {}
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let running = match daemon::start(cli).await {
            Ok(r) => r,
            Err(e) => {
                tracing::error!("census-operator cannot start: {e}");
                return ExitCode::FAILURE;
            }
        };
        census_daemon::signal::shutdown().await;
        tracing::info!("shutting down");
        running.shut_down().await;
        ExitCode::SUCCESS
    })
}

/// `census-operator certs`: PEM files for mutual TLS; says what it wrote.
fn certs(args: &census_operator::certs::CertsArgs) -> ExitCode {
    use std::io::Write;
    match census_operator::certs::run(args) {
        Ok(written) => {
            let mut stdout = std::io::stdout();
            for path in written {
                let _ = writeln!(stdout, "wrote {}", path.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "census-operator certs: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `census-operator crdgen`: the Identity CRD as YAML.
fn crdgen(out: Option<&std::path::Path>) -> ExitCode {
    let yaml = match crd::crd_yaml() {
        Ok(yaml) => yaml,
        Err(e) => {
            tracing::error!("crdgen: cannot render the CRD: {e}");
            return ExitCode::FAILURE;
        }
    };
    let written = match out {
        Some(path) => std::fs::write(path, yaml).map_err(|e| format!("{}: {e}", path.display())),
        None => {
            use std::io::Write;
            std::io::stdout()
                .write_all(yaml.as_bytes())
                .map_err(|e| format!("stdout: {e}"))
        }
    };
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("crdgen: cannot write {e}");
            ExitCode::FAILURE
        }
    }
}
