//! `census version`: this CLI's versions, and the agent's (`GET /v1/version`) and the
//! operator's (`NodeService.GetVersion`) when they answer. An unreachable peer is shown,
//! not an error: this command always succeeds.

use census_common::LAYOUT_VERSION;
use census_proto::PROTOCOL_VERSION;
use serde::Serialize;

use super::{Ctx, error::CliError, output::Table};

/// `census version -o json` (docs/cli.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct VersionView {
    pub(crate) cli: CliVersion,
    pub(crate) agent: AgentVersionView,
    pub(crate) operator: OperatorVersionView,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct CliVersion {
    pub(crate) version: String,
    pub(crate) protocol_version: u32,
    pub(crate) layout_version: u32,
}

/// The agent's versions; every field but `address` is `null` when it did not answer,
/// and `error` then says why.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct AgentVersionView {
    pub(crate) address: String,
    pub(crate) version: Option<String>,
    pub(crate) protocol_version: Option<u32>,
    /// The layout version of the maps it writes.
    pub(crate) layout_version: Option<u32>,
    pub(crate) error: Option<String>,
}

/// The operator's versions, as [`AgentVersionView`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct OperatorVersionView {
    pub(crate) address: String,
    pub(crate) version: Option<String>,
    pub(crate) protocol_version: Option<u32>,
    /// `redb` or `kubernetes`.
    pub(crate) store: Option<String>,
    /// The id range, `FIRST-LAST`.
    pub(crate) id_range: Option<String>,
    pub(crate) error: Option<String>,
}

pub(crate) async fn run(ctx: &mut Ctx) -> Result<String, CliError> {
    let agent = ctx.agent();
    let (agent_answer, operator_answer) = tokio::join!(agent.version(), async {
        ctx.operator().await?.version().await
    });
    let agent = match agent_answer {
        Ok(v) => AgentVersionView {
            address: agent.addr().to_string(),
            version: Some(v.agent_version),
            protocol_version: Some(v.protocol_version),
            layout_version: Some(v.layout_version),
            error: None,
        },
        Err(error) => AgentVersionView {
            address: agent.addr().to_string(),
            error: Some(why(&error)),
            ..AgentVersionView::default()
        },
    };
    let operator_address = ctx.global.operator.to_string();
    let operator = match operator_answer {
        Ok(v) => OperatorVersionView {
            address: operator_address,
            version: Some(v.operator_version),
            protocol_version: Some(v.protocol_version),
            store: Some(v.store),
            id_range: Some(v.id_range),
            error: None,
        },
        Err(error) => OperatorVersionView {
            address: operator_address,
            error: Some(why(&error)),
            ..OperatorVersionView::default()
        },
    };
    let view = VersionView {
        cli: CliVersion {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            protocol_version: PROTOCOL_VERSION,
            layout_version: LAYOUT_VERSION,
        },
        agent,
        operator,
    };
    ctx.render(&view, || table(&view))
}

/// Why a peer did not answer, short: the address is shown beside it.
fn why(error: &CliError) -> String {
    match error {
        CliError::AgentUnreachable { reason, .. }
        | CliError::OperatorUnreachable { reason, .. } => {
            format!("unreachable: {reason}")
        }
        other => other.one_line(),
    }
}

fn table(view: &VersionView) -> Table {
    let mut table = Table::new([
        "COMPONENT",
        "VERSION",
        "PROTOCOL",
        "LAYOUT",
        "ADDRESS",
        "DETAIL",
    ]);
    table.row(vec![
        "census".into(),
        view.cli.version.clone(),
        view.cli.protocol_version.to_string(),
        view.cli.layout_version.to_string(),
        String::new(),
        String::new(),
    ]);
    let agent = &view.agent;
    table.row(vec![
        "agent".into(),
        version_cell(agent.version.as_ref()),
        dash(agent.protocol_version),
        dash(agent.layout_version),
        agent.address.clone(),
        agent.error.clone().unwrap_or_default(),
    ]);
    let operator = &view.operator;
    let detail = match (&operator.error, &operator.store, &operator.id_range) {
        (Some(error), _, _) => error.clone(),
        (None, Some(store), Some(range)) => format!("store {store}, ids {range}"),
        _ => String::new(),
    };
    table.row(vec![
        "operator".into(),
        version_cell(operator.version.as_ref()),
        dash(operator.protocol_version),
        "-".into(),
        operator.address.clone(),
        detail,
    ]);
    table
}

fn version_cell(version: Option<&String>) -> String {
    version.map_or_else(|| "unreachable".to_owned(), Clone::clone)
}

fn dash(value: Option<u32>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::{Format, render};

    fn fixture() -> VersionView {
        VersionView {
            cli: CliVersion {
                version: "0.1.0".into(),
                protocol_version: 1,
                layout_version: 1,
            },
            agent: AgentVersionView {
                address: "http://127.0.0.1:9462".into(),
                error: Some("cannot reach the agent".into()),
                ..AgentVersionView::default()
            },
            operator: OperatorVersionView {
                address: "http://127.0.0.1:9460".into(),
                version: Some("0.1.0".into()),
                protocol_version: Some(1),
                store: Some("redb".into()),
                id_range: Some("256-65535".into()),
                error: None,
            },
        }
    }

    #[test]
    fn table() -> Result<(), CliError> {
        let view = fixture();
        let out = render(Format::Table, false, &view, || super::table(&view))?;
        assert_eq!(
            out,
            "\
COMPONENT  VERSION      PROTOCOL  LAYOUT  ADDRESS                DETAIL
census     0.1.0        1         1
agent      unreachable  -         -       http://127.0.0.1:9462  cannot reach the agent
operator   0.1.0        1         -       http://127.0.0.1:9460  store redb, ids 256-65535
"
        );
        Ok(())
    }

    #[test]
    fn json() -> Result<(), CliError> {
        let view = fixture();
        let json = render(Format::Json, false, &view, || unreachable!())?;
        assert_eq!(
            json,
            r#"{
  "cli": {
    "version": "0.1.0",
    "protocol_version": 1,
    "layout_version": 1
  },
  "agent": {
    "address": "http://127.0.0.1:9462",
    "version": null,
    "protocol_version": null,
    "layout_version": null,
    "error": "cannot reach the agent"
  },
  "operator": {
    "address": "http://127.0.0.1:9460",
    "version": "0.1.0",
    "protocol_version": 1,
    "store": "redb",
    "id_range": "256-65535",
    "error": null
  }
}
"#
        );
        Ok(())
    }
}
