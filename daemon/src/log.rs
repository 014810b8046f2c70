//! The daemons' logging flags and `tracing` set-up: one filter flag, text or JSON
//! lines on stderr.

use clap::{Args, ValueEnum};
use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log filter, in `tracing` EnvFilter syntax.
    #[arg(long, env = "CENSUS_LOG", default_value = "info")]
    pub log: String,
    #[arg(long, env = "CENSUS_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// Why the log filter was not taken as given.
#[derive(Debug, thiserror::Error)]
#[error("--log {filter:?} is not a valid filter ({source}); logging at info")]
pub struct LogFilterError {
    filter: String,
    source: tracing_subscriber::filter::ParseError,
}

impl LogArgs {
    /// Installs the global subscriber. A filter that does not parse falls back to
    /// `info`, and the error is returned so the daemon can log it once the subscriber
    /// is up: a typo in a flag must not leave a node agent without logs.
    pub fn init(&self) -> Result<(), LogFilterError> {
        let (filter, error) = match self.filter() {
            Ok(filter) => (filter, None),
            Err(error) => (EnvFilter::new("info"), Some(error)),
        };
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr);
        match self.log_format {
            LogFormat::Text => builder.init(),
            LogFormat::Json => builder.json().init(),
        }
        error.map_or(Ok(()), Err)
    }

    fn filter(&self) -> Result<EnvFilter, LogFilterError> {
        EnvFilter::try_new(&self.log).map_err(|source| LogFilterError {
            filter: self.log.clone(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        log: LogArgs,
    }

    #[test]
    fn defaults_to_info_as_text() -> Result<(), clap::Error> {
        let Cli { log } = Cli::try_parse_from(["daemon"])?;
        assert_eq!(log.log, "info");
        assert_eq!(log.log_format, LogFormat::Text);
        let Cli { log } = Cli::try_parse_from(["daemon", "--log-format", "json"])?;
        assert_eq!(log.log_format, LogFormat::Json);
        Ok(())
    }

    #[test]
    fn a_bad_filter_is_named_in_the_error() -> Result<(), clap::Error> {
        let Cli { log } = Cli::try_parse_from(["daemon", "--log", "census_operator=debug,warn"])?;
        assert!(log.filter().is_ok());
        let Cli { log } = Cli::try_parse_from(["daemon", "--log", "census=loud"])?;
        let error = log
            .filter()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("\"census=loud\""), "{error}");
        assert!(error.ends_with("logging at info"), "{error}");
        Ok(())
    }
}
