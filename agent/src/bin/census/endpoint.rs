//! `census endpoint list`: the endpoints the local agent manages, from its admin port
//! (`GET /v1/endpoints`).

use census_agent::admin::api::{EndpointState, EndpointsResponse, OperatorStatus, SourceStatus};
use clap::Subcommand;

use super::{Ctx, error::CliError, output::Table};

#[derive(Debug, Subcommand)]
pub(crate) enum EndpointCommand {
    /// Every endpoint on this node: addresses, interface, identity, labels, state.
    List,
}

pub(crate) async fn run(command: EndpointCommand, ctx: &mut Ctx) -> Result<String, CliError> {
    let EndpointCommand::List = command;
    let mut answer = ctx.agent().endpoints().await?;
    answer
        .endpoints
        .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    ctx.render(&answer, || table(&answer))
}

fn link_line(node: &str, link: &OperatorStatus) -> String {
    let OperatorStatus {
        address,
        connected,
        session,
        last_ack_seq,
        error,
        extra: _,
    } = link;
    let mut line = format!(
        "node {node}, operator {address} {}, session {session}, last ack seq {last_ack_seq}",
        if *connected {
            "connected"
        } else {
            "disconnected"
        }
    );
    if let Some(error) = error {
        line.push_str(&format!(" ({error})"));
    }
    line
}

fn source_line(source: &SourceStatus) -> String {
    let SourceStatus {
        source,
        synced,
        error,
        extra: _,
    } = source;
    let mut line = format!(
        "endpoints from {source}, {}",
        if *synced { "synced" } else { "not synced yet" }
    );
    if let Some(error) = error {
        line.push_str(&format!(", last read failed: {error}"));
    }
    line
}

/// `unknown`: a state of a newer agent than this `census`.
fn state_name(state: EndpointState) -> &'static str {
    match state {
        EndpointState::Programmed => "programmed",
        EndpointState::WaitingForIdentity => "waiting for identity",
        EndpointState::Error => "error",
        EndpointState::Unknown => "unknown",
    }
}

fn table(answer: &EndpointsResponse) -> Table {
    let mut table = Table::new([
        "NAMESPACE",
        "NAME",
        "IPS",
        "INTERFACE",
        "IDENTITY",
        "STATE",
        "LABELS",
    ]);
    table.preamble(link_line(&answer.node, &answer.operator));
    if let Some(source) = &answer.source {
        table.preamble(source_line(source));
    }
    for endpoint in &answer.endpoints {
        let mut state = state_name(endpoint.state).to_owned();
        if let Some(error) = &endpoint.error {
            state.push_str(": ");
            state.push_str(error);
        }
        table.row(vec![
            endpoint.namespace.clone(),
            endpoint.name.clone(),
            endpoint.ips.join(","),
            if endpoint.interface.is_empty() {
                "-".to_owned()
            } else {
                endpoint.interface.clone()
            },
            endpoint
                .identity
                .map_or_else(|| "-".to_owned(), |id| id.to_string()),
            state,
            endpoint.labels.join(","),
        ]);
    }
    table
}

#[cfg(test)]
mod tests {
    use census_agent::admin::api::Extra;

    use super::*;
    use crate::output::{Format, render};

    /// What the agent's `GET /v1/endpoints` answers (docs/cli.md).
    const AGENT_JSON: &str = r#"{
  "node": "n1",
  "operator": {"address": "http://10.0.0.1:9460", "connected": true, "session": "1700000000000000000-0000000000000007", "last_ack_seq": 12, "error": null},
  "source": {"source": "file /etc/census/endpoints.yaml", "synced": true, "error": "line 3: bad label", "checked_ms": 17},
  "endpoints": [
    {"namespace": "shop", "name": "web-0", "ips": ["198.18.0.2", "2001:db8::2"], "interface": "lxc1", "identity": 256,
     "labels": ["k8s:app=web", "k8s:io.kubernetes.pod.namespace=shop"], "state": "programmed", "error": null},
    {"namespace": "shop", "name": "db-0", "ips": ["198.18.0.3"], "interface": "lxc2", "identity": null,
     "labels": ["k8s:app=db"], "state": "waiting_for_identity", "error": null},
    {"namespace": "kube-system", "name": "dns", "ips": ["198.18.0.4"], "interface": "", "identity": 300,
     "labels": [], "state": "error", "error": "interface not found"}
  ]
}"#;

    fn fixture() -> Result<EndpointsResponse, serde_json::Error> {
        let mut answer: EndpointsResponse = serde_json::from_str(AGENT_JSON)?;
        answer
            .endpoints
            .sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        Ok(answer)
    }

    #[test]
    fn table_with_the_operator_link() -> Result<(), Box<dyn std::error::Error>> {
        let answer = fixture()?;
        let out = render(Format::Table, false, &answer, || table(&answer))?;
        assert_eq!(
            out,
            "\
node n1, operator http://10.0.0.1:9460 connected, session 1700000000000000000-0000000000000007, last ack seq 12
endpoints from file /etc/census/endpoints.yaml, synced, last read failed: line 3: bad label
NAMESPACE    NAME   IPS                     INTERFACE  IDENTITY  STATE                       LABELS
kube-system  dns    198.18.0.4              -          300       error: interface not found
shop         db-0   198.18.0.3              lxc2       -         waiting for identity        k8s:app=db
shop         web-0  198.18.0.2,2001:db8::2  lxc1       256       programmed                  k8s:app=web,k8s:io.kubernetes.pod.namespace=shop
"
        );
        let out = render(Format::Table, true, &answer, || table(&answer))?;
        assert!(out.starts_with("kube-system  dns"), "{out}");
        Ok(())
    }

    #[test]
    fn json_is_the_agents_shape() -> Result<(), Box<dyn std::error::Error>> {
        let answer = fixture()?;
        let json = render(Format::Json, false, &answer, || unreachable!())?;
        let reparsed: serde_json::Value = serde_json::from_str(&json)?;
        let original: serde_json::Value = serde_json::from_str(AGENT_JSON)?;
        assert_eq!(reparsed["node"], original["node"]);
        assert_eq!(reparsed["operator"], original["operator"]);
        assert_eq!(
            reparsed["source"], original["source"],
            "unknown fields are kept"
        );
        assert_eq!(reparsed["endpoints"][2], original["endpoints"][0]);
        assert_eq!(reparsed["endpoints"][0], original["endpoints"][2]);
        let yaml = render(Format::Yaml, false, &answer.operator, || unreachable!())?;
        assert_eq!(
            yaml,
            "\
address: http://10.0.0.1:9460
connected: true
session: 1700000000000000000-0000000000000007
last_ack_seq: 12
error: null
"
        );
        Ok(())
    }
    #[test]
    fn a_newer_agents_answer() -> Result<(), Box<dyn std::error::Error>> {
        let mut newer: serde_json::Value = serde_json::from_str(AGENT_JSON)?;
        newer["endpoints"][0]["state"] = "draining".into();
        newer["endpoints"][0]["weight"] = 3.into();
        let answer: EndpointsResponse = serde_json::from_value(newer)?;
        let out = render(Format::Table, false, &answer, || table(&answer))?;
        let row = "shop         web-0  198.18.0.2,2001:db8::2  lxc1       256       \
                   unknown                     k8s:app=web,k8s:io.kubernetes.pod.namespace=shop";
        assert!(out.lines().any(|line| line == row), "{out}");
        let json: serde_json::Value =
            serde_json::from_str(&render(Format::Json, false, &answer, || unreachable!())?)?;
        assert_eq!(json["endpoints"][0]["weight"], 3, "what it adds is kept");
        assert_eq!(
            answer.endpoints[0].extra,
            Extra::from([("weight".to_owned(), 3.into())])
        );
        Ok(())
    }
}
