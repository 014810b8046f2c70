//! The `census` command line: bpftool-style inspection of this node's pinned maps
//! (read straight from bpffs, so they work while the agent and the operator are down),
//! the local agent (its admin port) and the operator (gRPC).
//!
//! One file per verb; every failure is a [`error::CliError`] with its own exit code.
//! The maps are read with [`census_agent::bpf::Inspector`] and the agent's answers are
//! [`census_agent::admin::api`]'s types, the ones its admin port serializes: the CLI
//! uses nothing else of the agent library.
#![forbid(unsafe_code)]

mod admin;
mod args;
mod bpf;
mod completions;
mod endpoint;
mod error;
mod identity;
mod node;
mod operator;
mod output;
mod tls_probe;
mod version;

use std::{
    io::{self, Write as _},
    process::ExitCode,
    time::SystemTime,
};

use census_agent::{
    bpf::Inspector,
    client::{AccessFiles, TlsFiles},
};
use clap::{CommandFactory as _, Parser, Subcommand};
use serde::Serialize;

use self::{
    admin::Agent,
    args::Global,
    error::{CliError, EXIT_CODES, Exit},
    operator::{IdentityLabels, Operator},
    output::{Format, Table},
};

/// bpftool-style inspection of census: this node's pinned maps, the local agent and the
/// operator.
#[derive(Debug, Parser)]
#[command(
    name = "census",
    version,
    about = "Inspect census: this node's pinned BPF maps, the local agent and the operator",
    after_help = EXIT_CODES,
    propagate_version = true
)]
pub(crate) struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// This node's pinned census maps, read directly (the agent may be down).
    #[command(subcommand)]
    Bpf(bpf::BpfCommand),
    /// Identities, from the operator.
    #[command(subcommand)]
    Identity(identity::IdentityCommand),
    /// Nodes and their agents' sessions, from the operator.
    #[command(subcommand)]
    Node(node::NodeCommand),
    /// Endpoints: those the local agent manages (its admin port), and the operator's
    /// cluster-wide endpoint map.
    #[command(subcommand)]
    Endpoint(endpoint::EndpointCommand),
    /// Versions of this CLI, and of the agent and the operator when they are reachable.
    Version,
    /// A shell completion script, on stdout.
    Completions(completions::Completions),
}

/// What every verb gets: the global flags, the time tables measure ages from, and
/// notes for stderr.
#[derive(Debug)]
pub(crate) struct Ctx {
    global: Global,
    now: SystemTime,
    notes: Vec<String>,
}

impl Ctx {
    fn new(global: Global) -> Self {
        Self {
            global,
            now: SystemTime::now(),
            notes: Vec::new(),
        }
    }

    fn render<T: Serialize + ?Sized>(
        &self,
        value: &T,
        table: impl FnOnce() -> Table,
    ) -> Result<String, CliError> {
        output::render(self.global.output, self.global.no_headers, value, table)
    }

    async fn operator(&self) -> Result<Operator, CliError> {
        Operator::connect(&self.global.operator, &self.tls(), self.global.timeout).await
    }

    fn tls(&self) -> AccessFiles {
        AccessFiles {
            tls: TlsFiles {
                ca: self.global.tls_ca.clone(),
                cert: self.global.tls_cert.clone(),
                key: self.global.tls_key.clone(),
            },
            token_file: self.global.token_file.clone(),
        }
    }

    fn agent(&self) -> Agent {
        Agent::new(&self.global.agent, self.global.timeout)
    }

    fn maps(&self) -> Result<Inspector, CliError> {
        Ok(Inspector::open(&self.global.bpffs)?)
    }

    /// The labels of `ids`, when a table will show them: not with `-n`, JSON or YAML.
    async fn labels(&mut self, ids: impl IntoIterator<Item = u32>) -> IdentityLabels {
        if self.global.output != Format::Table || self.global.numeric {
            return IdentityLabels::none();
        }
        IdentityLabels::look_up(
            &self.global.operator,
            &self.tls(),
            self.global.timeout,
            ids,
            &mut self.notes,
        )
        .await
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => {
            // Help and --version are "errors" that go to stdout and exit 0.
            let _ = error.print();
            return if error.use_stderr() {
                Exit::Usage.into()
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(source) => return fail(&CliError::Runtime { source }),
    };
    let Cli { global, command } = cli;
    let mut ctx = Ctx::new(global);
    let result = runtime.block_on(run(command, &mut ctx));
    for note in &ctx.notes {
        let _ = writeln!(io::stderr(), "note: {note}");
    }
    match result.and_then(|out| write_stdout(&out)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => fail(&error),
    }
}

async fn run(command: Command, ctx: &mut Ctx) -> Result<String, CliError> {
    match command {
        Command::Bpf(command) => bpf::run(command, ctx).await,
        Command::Identity(command) => identity::run(command, ctx).await,
        Command::Node(command) => node::run(command, ctx).await,
        Command::Endpoint(command) => endpoint::run(command, ctx).await,
        Command::Version => version::run(ctx).await,
        Command::Completions(completions) => completions::run(&completions, &mut Cli::command()),
    }
}

fn fail(error: &CliError) -> ExitCode {
    let _ = writeln!(io::stderr(), "error: {}", error.one_line());
    error.exit().into()
}

/// Writes the output; a closed pipe (`census ... | head`) is not an error.
fn write_stdout(out: &str) -> Result<(), CliError> {
    let mut stdout = io::stdout().lock();
    match stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(error) if error.kind() != io::ErrorKind::BrokenPipe => {
            Err(CliError::Output { source: error })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_flags_go_anywhere() -> Result<(), clap::Error> {
        let cli = Cli::try_parse_from([
            "census", "bpf", "flows", "list", "-o", "json", "-n", "--bpffs", "/x",
        ])?;
        assert_eq!(cli.global.output, Format::Json);
        assert!(cli.global.numeric);
        assert_eq!(cli.global.bpffs, std::path::Path::new("/x"));
        Ok(())
    }

    #[test]
    fn help_lists_the_exit_codes() {
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("Exit codes:"), "{help}");
        assert!(help.contains("12  the operator or agent failed"), "{help}");
    }
}
