//! `census` against a real operator (in process, on loopback) and a fake agent admin
//! port, through the real binary: what it prints agrees with what the services say;
//! and every way it refuses or fails that needs no root (`errors`).

mod errors;
mod support;

use serde_json::{Value, json};
use support::{FakeAgent, Operator, TestResult, census, cli_session, closed_port, endpoint, hello};

const WEB: &[&str] = &["k8s:app=web", "k8s:io.kubernetes.pod.namespace=shop"];
const DB: &[&str] = &["k8s:app=db", "k8s:io.kubernetes.pod.namespace=shop"];
const CACHE: &[&str] = &["k8s:app=cache", "k8s:io.kubernetes.pod.namespace=other"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_list_agrees_with_the_operators_list() -> TestResult {
    let operator = Operator::start(&[]).await?;
    let _agent = hello(&operator, "node-a").await?;
    for labels in [WEB, DB, CACHE] {
        operator
            .allocate_ok("node-a", cli_session(), labels)
            .await?;
    }
    let op = &operator.url();

    for selector in [&[][..], &["k8s:io.kubernetes.pod.namespace=shop"]] {
        let mut args = vec!["identity", "list", "-o", "json", "--operator", op];
        let joined = selector.join(",");
        if !selector.is_empty() {
            args.extend(["--labels", &joined]);
        }
        let listed = census(&args, &[]).await?.json()?;
        let expected = operator.list(selector, false).await?;
        let listed = listed.as_array().ok_or("not a JSON array")?;
        assert_eq!(listed.len(), expected.len(), "{selector:?}: {listed:?}");
        for (cli, grpc) in listed.iter().zip(&expected) {
            assert_eq!(cli["id"], grpc.id, "{cli}");
            assert_eq!(cli["labels"], json!(grpc.labels), "{cli}");
            assert_eq!(cli["references"], grpc.references, "{cli}");
            assert_eq!(cli["holds"], grpc.holds, "{cli}");
            assert_eq!(cli["state"], "live", "{cli}");
            assert_eq!(cli["released_at_ms"], Value::Null, "{cli}");
        }
    }

    // The table shows the same identities, with their labels.
    let table = census(&["identity", "list", "--operator", op], &[]).await?;
    let table = table.expect_success()?;
    let mut lines = table.lines();
    assert_eq!(
        lines
            .next()
            .map(|l| l.split_whitespace().collect::<Vec<_>>()),
        Some(vec!["ID", "STATE", "REFS", "HOLDS", "LABELS"])
    );
    for identity in operator.list(&[], false).await? {
        let line = lines.next().ok_or("a row is missing")?;
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            cells,
            [
                identity.id.to_string().as_str(),
                "live",
                "0",
                "1",
                identity.labels.join(",").as_str()
            ],
            "{table}"
        );
    }

    // Lookup finds an identity by its labels, in any order, YAML too.
    let db = operator.list(&["k8s:app=db"], false).await?;
    let run = census(
        &[
            "identity",
            "lookup",
            "k8s:io.kubernetes.pod.namespace=shop",
            "k8s:app=db",
            "-o",
            "yaml",
            "--operator",
            op,
        ],
        &[],
    )
    .await?;
    let yaml = run.expect_success()?;
    let first = db.first().ok_or("db was not listed")?;
    assert!(yaml.starts_with(&format!("id: {}\n", first.id)), "{yaml}");
    operator.shut_down().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_list_shows_a_node_that_said_hello_with_its_endpoints() -> TestResult {
    let operator = Operator::start(&[]).await?;
    let mut agent = hello(&operator, "node-a").await?;
    let web = operator.allocate_ok("node-a", cli_session(), WEB).await?;
    let db = operator.allocate_ok("node-a", cli_session(), DB).await?;
    agent
        .snapshot(vec![
            endpoint("web-0", "198.18.0.2", &web),
            endpoint("db-0", "198.18.0.3", &db),
        ])
        .await?;
    let op = &operator.url();

    let nodes = census(&["node", "list", "-o", "json", "--operator", op], &[])
        .await?
        .json()?;
    let node = nodes
        .as_array()
        .and_then(|nodes| nodes.iter().find(|n| n["name"] == "node-a"))
        .ok_or_else(|| format!("node-a is not listed: {nodes}"))?;
    assert_eq!(node["endpoints"], 2, "{node}");
    assert_eq!(node["connected"], true, "{node}");
    assert_eq!(node["stale"], false, "{node}");
    assert_eq!(node["last_seq"], 1, "{node}");
    assert_eq!(
        node["session"], "1700000000000000000-0000000000000007",
        "{node}"
    );
    assert!(node["last_snapshot_ms"].as_u64().is_some(), "{node}");

    // The table, for people: the node, connected, with its 2 endpoints.
    let table = census(&["node", "list", "--operator", op], &[]).await?;
    let row = table
        .expect_success()?
        .lines()
        .find(|line| line.starts_with("node-a "))
        .ok_or("no row for node-a")?
        .split_whitespace()
        .collect::<Vec<_>>();
    // NODE CONNECTED STALE LAST SNAPSHOT(2 words + "ago") SEQ ENDPOINTS ...
    assert_eq!(&row[..3], ["node-a", "yes", "no"], "{row:?}");
    assert_eq!(row[4], "ago", "{row:?}");
    assert_eq!(&row[5..7], ["1", "2"], "{row:?}");

    let one = census(
        &["node", "get", "node-a", "-o", "json", "--operator", op],
        &[],
    )
    .await?
    .json()?;
    assert_eq!(&one, node);
    let detail = census(&["node", "get", "node-a", "--operator", op], &[]).await?;
    assert!(
        detail.expect_success()?.contains("\nendpoints:        2\n"),
        "{detail:#?}"
    );

    // The identities' reference counts follow the snapshot.
    let identities = census(&["identity", "list", "-o", "json", "--operator", op], &[])
        .await?
        .json()?;
    assert!(
        identities
            .as_array()
            .into_iter()
            .flatten()
            .all(|identity| identity["references"] == 1),
        "{identities}"
    );
    operator.shut_down().await?;
    Ok(())
}

/// What the agent's `GET /v1/endpoints` answers (docs/cli.md).
const AGENT_ENDPOINTS: &str = r#"{
  "node": "n1",
  "operator": {"address": "http://10.0.0.1:9460", "connected": true, "session": "1700000000000000000-0000000000000007", "last_ack_seq": 12, "error": null},
  "source": {"source": "file /etc/census/endpoints.yaml", "synced": true, "error": null},
  "endpoints": [
    {"namespace": "shop", "name": "web-0", "ips": ["198.18.0.2"], "interface": "lxc1", "identity": 256,
     "labels": ["k8s:app=web"], "state": "programmed", "error": null},
    {"namespace": "shop", "name": "db-0", "ips": ["198.18.0.3"], "interface": "lxc2", "identity": null,
     "labels": ["k8s:app=db"], "state": "waiting_for_identity", "error": null}
  ]
}"#;

const AGENT_VERSION: &str =
    r#"{"agent_version": "0.1.0", "protocol_version": 1, "layout_version": 1}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_list_shows_what_the_agent_manages() -> TestResult {
    let agent = FakeAgent::start(vec![("/v1/endpoints", 200, AGENT_ENDPOINTS.to_owned())]).await?;
    let json = census(
        &["endpoint", "list", "-o", "json", "--agent", &agent.addr],
        &[],
    )
    .await?
    .json()?;
    let original: Value = serde_json::from_str(AGENT_ENDPOINTS)?;
    assert_eq!(json["node"], original["node"]);
    assert_eq!(json["operator"], original["operator"]);
    assert_eq!(json["source"], original["source"]);
    // Sorted by namespace and name.
    assert_eq!(json["endpoints"][0], original["endpoints"][1]);
    assert_eq!(json["endpoints"][1], original["endpoints"][0]);

    let table = census(&["endpoint", "list"], &[("CENSUS_AGENT", &agent.addr)]).await?;
    assert_eq!(
        table.expect_success()?,
        "\
node n1, operator http://10.0.0.1:9460 connected, session 1700000000000000000-0000000000000007, last ack seq 12
endpoints from file /etc/census/endpoints.yaml, synced
NAMESPACE  NAME   IPS         INTERFACE  IDENTITY  STATE                 LABELS
shop       db-0   198.18.0.3  lxc2       -         waiting for identity  k8s:app=db
shop       web-0  198.18.0.2  lxc1       256       programmed            k8s:app=web
"
    );
    let bare = census(
        &["endpoint", "list", "--no-headers", "--agent", &agent.addr],
        &[],
    )
    .await?;
    assert_eq!(bare.expect_success()?.lines().count(), 2);
    Ok(())
}

/// The contract with the agent, checked against its own types: `census` reads what the
/// admin port serializes, and `-o json` prints it unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_list_reads_what_the_agents_admin_port_serves() -> TestResult {
    use census_agent::admin::api::{
        EndpointState, EndpointStatus, EndpointsResponse, Extra, OperatorStatus, VersionResponse,
    };
    let endpoints = EndpointsResponse {
        node: "n1".into(),
        operator: OperatorStatus {
            address: "http://127.0.0.1:9460".into(),
            connected: false,
            session: "1700000000000000000-00000000000000ff".into(),
            last_ack_seq: 12,
            error: Some("connection refused".into()),
            extra: Extra::new(),
        },
        endpoints: vec![
            EndpointStatus {
                namespace: "default".into(),
                name: "db-0".into(),
                ips: vec!["198.18.0.3".into()],
                interface: "vethdb0".into(),
                identity: None,
                labels: vec!["k8s:app=db".into()],
                state: EndpointState::WaitingForIdentity,
                error: Some("the operator is unreachable".into()),
                extra: Extra::new(),
            },
            EndpointStatus {
                namespace: "default".into(),
                name: "web-0".into(),
                ips: vec!["198.18.0.2".into(), "2001:db8::2".into()],
                interface: "vethweb0".into(),
                identity: Some(300),
                labels: vec!["k8s:app=web".into()],
                state: EndpointState::Programmed,
                error: None,
                extra: Extra::new(),
            },
        ],
        source: None,
        datapath: None,
        extra: Extra::new(),
    };
    let version = VersionResponse {
        agent_version: "9.9.9".into(),
        protocol_version: 1,
        layout_version: 1,
    };
    let agent = FakeAgent::start(vec![
        ("/v1/endpoints", 200, serde_json::to_string(&endpoints)?),
        ("/v1/version", 200, serde_json::to_string(&version)?),
    ])
    .await?;
    let printed = census(
        &["endpoint", "list", "-o", "json", "--agent", &agent.addr],
        &[],
    )
    .await?
    .json()?;
    assert_eq!(printed, serde_json::to_value(&endpoints)?);
    let table = census(&["endpoint", "list", "--agent", &agent.addr], &[]).await?;
    let table = table.expect_success()?;
    assert!(
        table.starts_with(
            "node n1, operator http://127.0.0.1:9460 disconnected, session \
             1700000000000000000-00000000000000ff, last ack seq 12 (connection refused)\n"
        ),
        "{table}"
    );
    assert!(
        table.contains("waiting for identity: the operator is unreachable"),
        "{table}"
    );
    let nowhere = closed_port().await?;
    let shown = census(
        &[
            "version",
            "-o",
            "json",
            "--agent",
            &agent.addr,
            "--operator",
            &nowhere,
        ],
        &[],
    )
    .await?
    .json()?;
    assert_eq!(shown["agent"]["version"], "9.9.9");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_shows_the_agent_and_the_operator_when_they_answer() -> TestResult {
    let operator = Operator::start(&[]).await?;
    let agent = FakeAgent::start(vec![("/v1/version", 200, AGENT_VERSION.to_owned())]).await?;
    let version = census(
        &[
            "version",
            "-o",
            "json",
            "--agent",
            &agent.addr,
            "--operator",
            &operator.url(),
        ],
        &[],
    )
    .await?
    .json()?;
    assert_eq!(version["cli"]["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(version["cli"]["protocol_version"], 1);
    assert_eq!(
        version["cli"]["layout_version"],
        census_agent::bpf::LAYOUT_VERSION
    );
    assert_eq!(version["agent"]["version"], "0.1.0");
    assert_eq!(version["agent"]["layout_version"], 1);
    assert_eq!(version["agent"]["error"], Value::Null);
    assert_eq!(version["operator"]["store"], "redb");
    assert_eq!(version["operator"]["id_range"], "256-65535");
    assert_eq!(version["operator"]["error"], Value::Null);
    operator.shut_down().await?;

    // Nobody answers: still a success, saying so.
    let nowhere = closed_port().await?;
    let run = census(
        &["version", "--agent", &nowhere, "--operator", &nowhere],
        &[],
    )
    .await?;
    let table = run.expect_success()?;
    let rows: Vec<&str> = table.lines().collect();
    assert_eq!(rows.len(), 4, "{table}");
    assert!(rows[1].starts_with("census  "), "{table}");
    assert!(
        rows[2].starts_with("agent  ") && rows[2].contains("unreachable"),
        "{table}"
    );
    assert!(
        rows[3].contains("unreachable: Connection refused"),
        "{table}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_for_every_shell() -> TestResult {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let run = census(&["completions", shell], &[]).await?;
        let script = run.expect_success()?;
        assert!(script.contains("identity"), "{shell}: {script}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_map_shows_the_operators_claims_of_an_address() -> TestResult {
    let operator = Operator::start(&[]).await?;
    let mut agent = hello(&operator, "node-a").await?;
    let web = operator.allocate_ok("node-a", cli_session(), WEB).await?;
    agent
        .snapshot(vec![endpoint("web-0", "198.18.0.2", &web)])
        .await?;
    let op = &operator.url();

    let shown = census(
        &[
            "endpoint",
            "map",
            "198.18.0.2",
            "-o",
            "json",
            "--operator",
            op,
        ],
        &[],
    )
    .await?
    .json()?;
    assert_eq!(shown["ip"], "198.18.0.2", "{shown}");
    let claim = &shown["claims"][0];
    assert_eq!(claim["node"], "node-a", "{shown}");
    assert_eq!(claim["name"], "web-0", "{shown}");
    assert_eq!(claim["kind"], "endpoint", "{shown}");
    assert_eq!(claim["identity"], web.id, "{shown}");
    assert_eq!(claim["winner"], true, "{shown}");
    assert_eq!(shown["conflicts"], 0, "{shown}");

    let table = census(&["endpoint", "map", "198.18.0.2", "--operator", op], &[]).await?;
    let table = table.expect_success()?;
    assert!(
        table.starts_with("198.18.0.2: 1 claim, 0 conflicts\n"),
        "{table}"
    );
    assert!(table.contains("web-0"), "{table}");

    census(&["endpoint", "map", "198.18.0.9", "--operator", op], &[])
        .await?
        .expect_failure(4, &["no endpoint or node claims 198.18.0.9"])?;
    census(&["endpoint", "map", "web-0", "--operator", op], &[])
        .await?
        .expect_failure(3, &["\"web-0\" is not an IPv4 or IPv6 address"])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_certificate_reads_an_operator_that_requires_mutual_tls() -> TestResult {
    use census_testkit::tls::{Certs, Client};
    let certs = Certs::generate(&["node-a"], &["cli"])?;
    let flags = certs.operator_flags()?;
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let operator = Operator::start(&flags).await?;
    let as_a = certs.target(operator.grpc_addr, Some(Client::Node("node-a")))?;
    let (_agent, _) = census_testkit::Agent::connect(&as_a, "node-a", cli_session()).await?;
    let op = &operator.url();
    let ca = certs.dir().join("ca.pem");
    let (cert, key) = certs.client_files(Client::Reader("cli"))?;
    let (ca, cert, key) = (
        ca.to_str().ok_or("not UTF-8")?,
        cert.to_str().ok_or("not UTF-8")?,
        key.to_str().ok_or("not UTF-8")?,
    );
    let listed = census(
        &[
            "node",
            "list",
            "-o",
            "json",
            "--operator",
            op,
            "--tls-ca",
            ca,
        ],
        &[("CENSUS_TLS_CERT", cert), ("CENSUS_TLS_KEY", key)],
    )
    .await?
    .json()?;
    assert!(listed.to_string().contains("node-a"), "{listed}");
    // Without a client certificate the operator refuses the handshake: the CLI says
    // so and names the flags to set, not "is census-operator running?".
    let refused = census(
        &[
            "node",
            "list",
            "-o",
            "json",
            "--operator",
            op,
            "--tls-ca",
            ca,
        ],
        &[],
    )
    .await?;
    refused.expect_failure(
        5,
        &[
            "refused the TLS handshake",
            "requires a client certificate",
            "--tls-cert",
            "--tls-key",
        ],
    )?;
    assert!(
        !refused.stderr.contains("is census-operator running"),
        "{refused:?}"
    );
    // Another CA's certificate: refused too, and said so.
    let other = Certs::generate(&[], &["cli"])?;
    let (cert, key) = other.client_files(Client::Reader("cli"))?;
    let (cert, key) = (
        cert.to_str().ok_or("not UTF-8")?,
        key.to_str().ok_or("not UTF-8")?,
    );
    census(
        &[
            "node",
            "list",
            "--operator",
            op,
            "--tls-ca",
            ca,
            "--tls-cert",
            cert,
            "--tls-key",
            key,
        ],
        &[],
    )
    .await?
    .expect_failure(5, &["refused the TLS handshake", "--tls-cert"])?;
    Ok(())
}
