use std::{io, process::ExitStatus};

/// What can go wrong setting up or using a lab.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: ExitStatus,
        stderr: String,
    },

    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },

    #[error("entering network namespace {netns}")]
    Setns {
        netns: String,
        #[source]
        source: nix::Error,
    },

    #[error("{0} addresses per lab at most")]
    LabFull(usize),
}

impl Error {
    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(io::Error) -> Self {
        let what = what.into();
        move |source| Self::Io { what, source }
    }
}
