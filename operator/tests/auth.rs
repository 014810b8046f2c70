//! Mutual TLS and node binding over real gRPC on loopback, with certificates made
//! by `census-operator certs`: a node's certificate speaks for that node only, a
//! reader's reads only, anything else is refused at the handshake or
//! UNAUTHENTICATED, and a refused call changes nothing.

use std::{process::Stdio, time::Duration};

use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, endpoint_map_client::EndpointMapClient,
        identity_service_client::IdentityServiceClient, node_service_client::NodeServiceClient,
    },
};
use census_testkit::{
    ANSWER_TIMEOUT, Agent, Operator, TestResult, endpoint, expect_status, fail, hello, open_stream,
    session, strings,
    tls::{Certs, Client, Secured},
};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tonic::{Code, Status, transport::Channel};

/// An operator with mutual TLS on 127.0.0.1, and its certificates.
async fn secured(nodes: &[&str], readers: &[&str]) -> TestResult<(Operator, Certs)> {
    let certs = Certs::generate(nodes, readers)?;
    let flags = certs.operator_flags()?;
    let args: Vec<&str> = flags.iter().map(String::as_str).collect();
    Ok((Operator::start(&args).await?, certs))
}

async fn allocate(
    channel: Channel,
    node: &str,
    session: pb::Session,
    labels: &[&str],
) -> TestResult<Result<pb::AllocateResponse, Status>> {
    let answer = tokio::time::timeout(
        ANSWER_TIMEOUT,
        IdentityServiceClient::new(channel).allocate(pb::AllocateRequest {
            protocol_version: PROTOCOL_VERSION,
            node: node.into(),
            session: Some(session),
            labels: strings(labels),
            allocation: 0,
        }),
    )
    .await
    .map_err(|_| "Allocate did not answer")?;
    Ok(answer.map(tonic::Response::into_inner))
}

async fn map_watch(
    channel: Channel,
    node: &str,
    session: pb::Session,
) -> TestResult<Result<tonic::Streaming<pb::EndpointMapBatch>, Status>> {
    let answer = tokio::time::timeout(
        ANSWER_TIMEOUT,
        EndpointMapClient::new(channel).watch(pb::EndpointMapWatchRequest {
            protocol_version: PROTOCOL_VERSION,
            node: node.into(),
            session: Some(session),
        }),
    )
    .await
    .map_err(|_| "EndpointMap.Watch did not answer")?;
    Ok(answer.map(tonic::Response::into_inner))
}

/// What the operator knows, as a reader sees it: the nodes with their sessions
/// and endpoint counts, and every identity with its labels.
async fn state(reader: &Secured) -> TestResult<(Vec<String>, Vec<(u32, Vec<String>)>)> {
    let channel = reader.channel().await?;
    let nodes = NodeServiceClient::new(channel.clone())
        .list_nodes(pb::ListNodesRequest {
            protocol_version: PROTOCOL_VERSION,
        })
        .await?
        .into_inner()
        .nodes
        .into_iter()
        // Everything but the clocks.
        .map(|n| {
            format!(
                "{} {:?} connected={} seq={} endpoints={} holds={}",
                n.name, n.session, n.connected, n.last_seq, n.endpoints, n.holds
            )
        })
        .collect();
    let identities = IdentityServiceClient::new(channel)
        .list(pb::ListRequest {
            protocol_version: PROTOCOL_VERSION,
            include_quarantined: true,
            ..pb::ListRequest::default()
        })
        .await?
        .into_inner()
        .identities
        .into_iter()
        .map(|i| (i.id, i.labels))
        .collect();
    Ok((nodes, identities))
}

#[tokio::test]
async fn a_node_certificate_speaks_for_its_own_node_only() -> TestResult {
    let (op, certs) = secured(&["node-a", "node-b"], &["cli"]).await?;
    let addr = op.grpc_addr;
    let as_a = certs.target(addr, Some(Client::Node("node-a")))?;
    let reader = certs.target(addr, Some(Client::Reader("cli")))?;

    // node-a, as itself: Hello, Allocate, the map's Watch.
    let (mut agent, _) = Agent::connect(&as_a, "node-a", session(10)).await?;
    let web = allocate(
        as_a.channel().await?,
        "node-a",
        session(10),
        &["k8s:app=web"],
    )
    .await?
    .map_err(|s| format!("node-a's own Allocate refused: {s:?}"))?
    .identity
    .ok_or("no identity")?;
    let answer = agent
        .snapshot(vec![endpoint(
            "default",
            "web",
            &["10.0.0.1"],
            web.id,
            &["k8s:app=web"],
        )])
        .await?;
    assert!(answer.ack.rejected.is_empty(), "{answer:?}");
    if let Err(status) = map_watch(as_a.channel().await?, "node-a", session(10)).await? {
        return fail(format!("node-a's own map Watch refused: {status:?}"));
    }
    let before = state(&reader).await?;

    // node-a's certificate, claiming node-b: refused before anything is looked at,
    // even a session that would outrank every other.
    let taken_over = open_stream(&as_a, vec![hello("node-b", session(u64::MAX))]).await?;
    expect_status(
        taken_over.map(|_| ()),
        Code::PermissionDenied,
        &["node node-a", "node node-b"],
    )?;
    expect_status(
        allocate(
            as_a.channel().await?,
            "node-b",
            session(u64::MAX),
            &["k8s:app=x"],
        )
        .await?,
        Code::PermissionDenied,
        &["node node-a", "node node-b"],
    )?;
    expect_status(
        map_watch(as_a.channel().await?, "node-b", session(u64::MAX))
            .await?
            .map(|_| ()),
        Code::PermissionDenied,
        &["node node-b"],
    )?;
    assert_eq!(
        state(&reader).await?,
        before,
        "a refused call changed the operator's state"
    );

    // No lockout: the real node-b connects, in an ordinary session.
    let as_b = certs.target(addr, Some(Client::Node("node-b")))?;
    let (_b, _) = Agent::connect(&as_b, "node-b", session(1)).await?;
    allocate(as_b.channel().await?, "node-b", session(1), &["k8s:app=x"])
        .await?
        .map_err(|s| format!("node-b's own Allocate refused: {s:?}"))?;
    op.shut_down().await
}

#[tokio::test]
async fn a_reader_certificate_reads_but_never_speaks_for_a_node() -> TestResult {
    let (op, certs) = secured(&["node-a"], &["cli"]).await?;
    let reader = certs.target(op.grpc_addr, Some(Client::Reader("cli")))?;
    let as_a = certs.target(op.grpc_addr, Some(Client::Node("node-a")))?;
    let (_agent, _) = Agent::connect(&as_a, "node-a", session(10)).await?;
    allocate(
        as_a.channel().await?,
        "node-a",
        session(10),
        &["k8s:app=web"],
    )
    .await?
    .map_err(|s| format!("node-a's own Allocate refused: {s:?}"))?;

    let (nodes, identities) = state(&reader).await?;
    assert_eq!(nodes.len(), 1, "{nodes:?}");
    assert!(
        identities
            .iter()
            .any(|(_, labels)| labels.contains(&"k8s:app=web".to_owned())),
        "{identities:?}"
    );
    let channel = reader.channel().await?;
    NodeServiceClient::new(channel.clone())
        .get_version(pb::GetVersionRequest {
            protocol_version: PROTOCOL_VERSION,
        })
        .await?;
    let mut watch = IdentityServiceClient::new(channel.clone())
        .watch(pb::WatchRequest {
            protocol_version: PROTOCOL_VERSION,
        })
        .await?
        .into_inner();
    assert!(watch.message().await?.is_some(), "the Watch sent nothing");

    let before = state(&reader).await?;
    expect_status(
        open_stream(&reader, vec![hello("node-a", session(u64::MAX))])
            .await?
            .map(|_| ()),
        Code::PermissionDenied,
        &["reader cli", "node node-a"],
    )?;
    expect_status(
        allocate(channel.clone(), "node-a", session(10), &["k8s:app=x"]).await?,
        Code::PermissionDenied,
        &["reader cli"],
    )?;
    expect_status(
        map_watch(channel, "node-a", session(10)).await?.map(|_| ()),
        Code::PermissionDenied,
        &["reader cli"],
    )?;
    assert_eq!(state(&reader).await?, before);
    op.shut_down().await
}

/// A call on `target` that must not get through: refused at the TLS handshake (the
/// connection fails), or answered UNAUTHENTICATED / UNAVAILABLE by the transport.
async fn refused_before_any_service(target: &Secured) -> TestResult {
    let channel = match target.channel().await {
        // TLS 1.2 and some TLS 1.3 orders: the handshake itself fails.
        Err(_) => return Ok(()),
        Ok(channel) => channel,
    };
    let answer = tokio::time::timeout(
        ANSWER_TIMEOUT,
        NodeServiceClient::new(channel).list_nodes(pb::ListNodesRequest {
            protocol_version: PROTOCOL_VERSION,
        }),
    )
    .await
    .map_err(|_| "ListNodes did not answer")?;
    match answer {
        Ok(answer) => fail(format!("ListNodes answered: {answer:?}")),
        // TLS 1.3: the server checks the client's certificate after the client
        // finished its half of the handshake; the first call sees the alert.
        Err(status)
            if matches!(
                status.code(),
                Code::Unavailable | Code::Unknown | Code::Unauthenticated
            ) =>
        {
            Ok(())
        }
        Err(status) => fail(format!("an unexpected refusal: {status:?}")),
    }
}

#[tokio::test]
async fn no_certificate_or_another_cas_is_refused() -> TestResult {
    let (op, certs) = secured(&["node-a"], &["cli"]).await?;
    let reader = certs.target(op.grpc_addr, Some(Client::Reader("cli")))?;
    let before = state(&reader).await?;

    // No client certificate.
    refused_before_any_service(&certs.target(op.grpc_addr, None)?).await?;
    // Another CA's certificate for node-a, the operator's CA trusted.
    let other = Certs::generate(&["node-a"], &[])?;
    let (cert, key) = other.client_files(Client::Node("node-a"))?;
    let forged = Secured {
        addr: op.grpc_addr,
        tls: certs
            .client(None)?
            .identity(tonic::transport::Identity::from_pem(
                std::fs::read(cert)?,
                std::fs::read(key)?,
            )),
    };
    refused_before_any_service(&forged).await?;
    let hello = open_stream(&forged, vec![hello("node-a", session(u64::MAX))]).await;
    assert!(
        !matches!(hello, Ok(Ok(_))),
        "another CA's certificate said Hello"
    );
    // Plain HTTP/2 to the TLS port.
    let plain = Channel::from_shared(op.url())?
        .connect_timeout(ANSWER_TIMEOUT)
        .connect()
        .await?;
    let answer = tokio::time::timeout(
        ANSWER_TIMEOUT,
        NodeServiceClient::new(plain).list_nodes(pb::ListNodesRequest {
            protocol_version: PROTOCOL_VERSION,
        }),
    )
    .await
    .map_err(|_| "ListNodes did not answer")?;
    assert!(answer.is_err(), "plain HTTP/2 was answered: {answer:?}");

    assert_eq!(state(&reader).await?, before);
    op.shut_down().await
}

/// A client certificate for `node` signed by an intermediate CA that the CA of
/// `certs` signed (with clientAuth, as a stolen CA key could make one): the chain's
/// PEM (leaf, then the intermediate) and the leaf's key.
fn through_an_intermediate(certs: &Certs, node: &str) -> TestResult<(String, String)> {
    use rcgen::{
        BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
        KeyUsagePurpose, SanType,
    };
    let ca = Issuer::from_ca_cert_pem(
        &std::fs::read_to_string(certs.dir().join("ca.pem"))?,
        KeyPair::from_pem(&std::fs::read_to_string(certs.dir().join("ca-key.pem"))?)?,
    )?;
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate()?;
    let intermediate = p.signed_by(&key, &ca)?;
    let intermediate_ca = Issuer::new(p, key);
    let mut leaf = CertificateParams::new(Vec::<String>::new())?;
    leaf.is_ca = IsCa::ExplicitNoCa;
    leaf.subject_alt_names = vec![SanType::URI(format!("census://node/{node}").try_into()?)];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    let key = KeyPair::generate()?;
    let leaf = leaf.signed_by(&key, &intermediate_ca)?;
    Ok((leaf.pem() + &intermediate.pem(), key.serialize_pem()))
}

/// `census-operator certs` writes its CA `pathlen:0`: a certificate minted by an
/// intermediate CA under it names no node. The TLS handshake takes the chain
/// (rustls does not read a trust anchor's constraints); the operator refuses every
/// call on it UNAUTHENTICATED, saying why, and nothing changes.
#[tokio::test]
async fn a_certificate_from_an_intermediate_ca_speaks_for_no_node() -> TestResult {
    let (op, certs) = secured(&["node-a"], &["cli"]).await?;
    let reader = certs.target(op.grpc_addr, Some(Client::Reader("cli")))?;
    let before = state(&reader).await?;
    let (chain, key) = through_an_intermediate(&certs, "node-a")?;
    let chained = Secured {
        addr: op.grpc_addr,
        tls: certs
            .client(None)?
            .identity(tonic::transport::Identity::from_pem(chain, key)),
    };
    let hello = open_stream(&chained, vec![hello("node-a", session(u64::MAX))]).await?;
    expect_status(
        hello.map(|_| ()),
        Code::Unauthenticated,
        &["signed by the CA itself"],
    )?;
    expect_status(
        allocate(
            chained.channel().await?,
            "node-a",
            session(1),
            &["k8s:app=web"],
        )
        .await?,
        Code::Unauthenticated,
        &["signed by the CA itself"],
    )?;
    assert_eq!(state(&reader).await?, before);
    // The real node-a still connects.
    let as_a = certs.target(op.grpc_addr, Some(Client::Node("node-a")))?;
    Agent::connect(&as_a, "node-a", session(1)).await?;
    op.shut_down().await
}

fn operator_binary() -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_census-operator"));
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

#[tokio::test]
async fn without_tls_a_non_loopback_listen_is_refused_at_start() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = dir.path().join("census.redb");
    let output = tokio::time::timeout(
        ANSWER_TIMEOUT,
        operator_binary()
            .args([
                "--grpc-listen",
                "0.0.0.0:0",
                "--admin-listen",
                "127.0.0.1:0",
            ])
            .arg("--store-path")
            .arg(&store)
            .output(),
    )
    .await
    .map_err(|_| "the operator did not exit")??;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success(), "it started: {said}");
    for flag in [
        "--grpc-listen 0.0.0.0:0",
        "--tls-cert",
        "--tls-key",
        "--client-ca",
    ] {
        assert!(said.contains(flag), "the error should name {flag}: {said}");
    }
    assert!(!store.exists(), "the store was opened before the refusal");
    Ok(())
}

#[tokio::test]
async fn without_tls_the_operator_says_it_runs_unauthenticated_on_loopback() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut child = operator_binary()
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--store-path")
        .arg(dir.path().join("census.redb"))
        .spawn()?;
    let logs = child.stderr.take().ok_or("no stderr")?;
    let mut lines = BufReader::new(logs).lines();
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await? {
            if line.contains("unauthenticated on loopback") {
                return Ok::<_, std::io::Error>(Some(line));
            }
        }
        Ok(None)
    })
    .await
    .map_err(|_| "the operator never said it runs unauthenticated")??;
    child.kill().await?;
    match found {
        Some(line) => {
            assert!(line.contains("127.0.0.1"), "{line}");
            Ok(())
        }
        None => fail("the operator exited without saying it runs unauthenticated"),
    }
}

/// The claims of `ip` in the endpoint map, as a reader sees them: (node, pod name
/// or empty for a node address, identity), the winner first; none when nothing
/// claims it.
async fn claims(reader: &Secured, ip: &str) -> TestResult<Vec<(String, String, u32)>> {
    let answer = EndpointMapClient::new(reader.channel().await?)
        .lookup(pb::EndpointMapLookupRequest {
            protocol_version: PROTOCOL_VERSION,
            ip: ip.into(),
        })
        .await;
    let found = match answer {
        Ok(found) => found.into_inner(),
        Err(status) if status.code() == Code::NotFound => return Ok(Vec::new()),
        Err(status) => return Err(status.into()),
    };
    Ok(found
        .claims
        .into_iter()
        .map(|c| (c.node, c.name, c.identity))
        .collect())
}

#[tokio::test]
async fn a_node_certificate_vouches_for_the_node_addresses_its_hello_may_claim() -> TestResult {
    /// The reserved `remote-node` identity.
    const REMOTE_NODE: u32 = 6;
    let (op, certs) = secured(&["node-a", "node-b", "node-c"], &["cli"]).await?;
    certs.node_with_addresses("node-a", &["198.19.0.1"])?;
    certs.node_with_addresses("node-b", &["198.19.0.2", "2001:db8:ff::2"])?;
    let addr = op.grpc_addr;
    let reader = certs.target(addr, Some(Client::Reader("cli")))?;

    // node-b: its own address, and a pod.
    let as_b = certs.target(addr, Some(Client::Node("node-b")))?;
    let (mut b, _) =
        Agent::connect_with_addresses(&as_b, "node-b", session(1), &["198.19.0.2"]).await?;
    let web = allocate(
        as_b.channel().await?,
        "node-b",
        session(1),
        &["k8s:app=web"],
    )
    .await?
    .map_err(|s| format!("node-b's Allocate refused: {s:?}"))?
    .identity
    .ok_or("no identity")?;
    let answer = b
        .snapshot(vec![endpoint(
            "default",
            "web-b",
            &["198.18.0.20"],
            web.id,
            &["k8s:app=web"],
        )])
        .await?;
    assert!(answer.ack.rejected.is_empty(), "{answer:?}");

    // node-a's Hello names its own address, node-b's and node-b's pod's: its
    // certificate vouches for the first only. The Hello is accepted (an agent
    // reports every address of its interfaces), the others are not claimed.
    let as_a = certs.target(addr, Some(Client::Node("node-a")))?;
    let (_a, _) = Agent::connect_with_addresses(
        &as_a,
        "node-a",
        session(1),
        &["198.19.0.1", "198.19.0.2", "198.18.0.20"],
    )
    .await?;
    let node_b = |name: &str, id| ("node-b".to_owned(), name.to_owned(), id);
    let deadline = tokio::time::Instant::now() + ANSWER_TIMEOUT;
    while claims(&reader, "198.19.0.1").await?.is_empty() {
        if tokio::time::Instant::now() > deadline {
            return fail("node-a's certified address never entered the map");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        claims(&reader, "198.19.0.1").await?,
        vec![("node-a".to_owned(), String::new(), REMOTE_NODE)]
    );
    assert_eq!(
        claims(&reader, "198.19.0.2").await?,
        vec![node_b("", REMOTE_NODE)],
        "node-a claimed node-b's address"
    );
    assert_eq!(
        claims(&reader, "198.18.0.20").await?,
        vec![node_b("web-b", web.id)],
        "node-a claimed node-b's pod"
    );
    let (_, _, metrics) = op.admin_get("/metrics").await?;
    assert!(
        metrics
            .lines()
            .any(|l| l == "census_rejected_entries_total{reason=\"uncertified_address\"} 2"),
        "the addresses left out are not counted:\n{}",
        metrics
            .lines()
            .filter(|l| l.contains("rejected_entries"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // A certificate without addresses (written before `--node-ip`) vouches for
    // none: node-c connects, and claims nothing.
    let as_c = certs.target(addr, Some(Client::Node("node-c")))?;
    let (_c, _) =
        Agent::connect_with_addresses(&as_c, "node-c", session(1), &["198.19.0.3"]).await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(claims(&reader, "198.19.0.3").await?, vec![]);
    op.shut_down().await
}
