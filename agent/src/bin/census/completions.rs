//! `census completions <shell>`: a completion script for the shell, on stdout.

use clap::Args;
use clap_complete::Shell;

use super::error::CliError;

#[derive(Debug, Args)]
pub(crate) struct Completions {
    /// The shell to complete in.
    shell: Shell,
}

pub(crate) fn run(
    completions: &Completions,
    command: &mut clap::Command,
) -> Result<String, CliError> {
    let mut script = Vec::new();
    clap_complete::generate(completions.shell, command, "census", &mut script);
    Ok(String::from_utf8_lossy(&script).into_owned())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;
    use crate::Cli;

    #[test]
    fn every_shell_gets_a_script_naming_the_verbs() -> Result<(), CliError> {
        for shell in [
            Shell::Bash,
            Shell::Zsh,
            Shell::Fish,
            Shell::Elvish,
            Shell::PowerShell,
        ] {
            let script = run(&Completions { shell }, &mut Cli::command())?;
            assert!(script.contains("census"), "{shell}");
            assert!(script.contains("endpoints"), "{shell}");
        }
        Ok(())
    }
}
