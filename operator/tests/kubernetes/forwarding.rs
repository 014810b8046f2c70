//! A follower forwards NodeService calls to the leader over TLS, verified with
//! `--tls-ca`, carrying the caller's own bearer token: real operator replicas serving
//! TLS with the fake's ServiceAccount tokens (TokenReview), the leader reached by its
//! published pod IP with the serving certificate's first DNS name.

use census_proto::{
    PROTOCOL_VERSION,
    pb::{
        self, endpoint_sync_client::EndpointSyncClient, node_service_client::NodeServiceClient,
        operator_message,
    },
};
use census_testkit::{Operator, agent::hello, tls::Certs};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, transport::Channel};

use crate::{
    common::{TestResult, WAIT, fake},
    operator::{replica_args, seed_cluster, session, until_leader},
    tokenreview::{
        OPERATOR_TOKEN, SA, agent_pod, census_token, seed_agents, seed_operator_identity,
    },
};

/// `message` with `token` as the agent and the CLI send it.
fn bearer<T>(message: T, token: Option<&str>) -> TestResult<tonic::Request<T>> {
    let mut request = tonic::Request::new(message);
    if let Some(token) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse()?);
    }
    Ok(request)
}

async fn list_nodes(
    channel: &Channel,
    token: Option<&str>,
) -> TestResult<Result<Vec<String>, Status>> {
    let request = bearer(
        pb::ListNodesRequest {
            protocol_version: PROTOCOL_VERSION,
        },
        token,
    )?;
    let answer = tokio::time::timeout(
        WAIT,
        NodeServiceClient::new(channel.clone()).list_nodes(request),
    )
    .await?;
    Ok(answer.map(|r| r.into_inner().nodes.into_iter().map(|n| n.name).collect()))
}

async fn get_node(
    channel: &Channel,
    name: &str,
    token: Option<&str>,
) -> TestResult<Result<pb::Node, Status>> {
    let request = bearer(
        pb::GetNodeRequest {
            protocol_version: PROTOCOL_VERSION,
            name: name.into(),
        },
        token,
    )?;
    let answer = tokio::time::timeout(
        WAIT,
        NodeServiceClient::new(channel.clone()).get_node(request),
    )
    .await?;
    Ok(answer.map(tonic::Response::into_inner))
}

fn refused<T: std::fmt::Debug>(answer: Result<T, Status>, what: &str) -> TestResult<Status> {
    match answer {
        Ok(answer) => Err(format!("{what}: answered {answer:?}").into()),
        Err(status) => Ok(status),
    }
}

/// A replica of the fake cluster serving TLS with `certs`, bearer tokens for callers;
/// `extra` flags after the serving certificate's.
async fn replica(
    kubeconfig: &std::path::Path,
    pod: &str,
    certs: &Certs,
    extra: &[String],
) -> TestResult<Operator> {
    let mut args = replica_args(kubeconfig, pod, &[]);
    // --tls-cert and --tls-key, without --client-ca: bearer tokens.
    args.extend(certs.operator_flags()?.into_iter().take(4));
    args.extend(extra.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Operator::start(&args).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_forwards_node_calls_to_the_leader_over_tls_with_the_callers_token() -> TestResult
{
    let server = fake().await?;
    seed_cluster(&server, &["op-a", "op-b", "op-c"])?;
    seed_agents(&server)?;
    seed_operator_identity(&server)?;
    agent_pod(&server, "agent-1", SA, "node-1")?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    server.write_kubeconfig_with_token(&kubeconfig, OPERATOR_TOKEN)?;
    // A serving certificate for `localhost` (its first DNS name) and 127.0.0.1, the
    // replicas' published pod IP.
    let certs = Certs::generate(&[], &[])?;
    let ca = certs
        .dir()
        .join("ca.pem")
        .to_str()
        .ok_or("the certificates' directory is not UTF-8")?
        .to_owned();
    let with_ca = ["--tls-ca".to_owned(), ca];
    let leader = replica(&kubeconfig, "op-a", &certs, &with_ca).await?;
    until_leader(&leader).await?;
    let follower = replica(&kubeconfig, "op-b", &certs, &with_ca).await?;
    let no_ca = replica(&kubeconfig, "op-c", &certs, &[]).await?;
    for replica in [&follower, &no_ca] {
        crate::common::eventually("the replica follows op-a", WAIT, || async {
            Ok(matches!(
                replica.running().runtime.role(),
                census_operator::api::Role::Follower { leader: Some(l) }
                    if l.name == "op-a" && l.address.is_some()
            )
            .then_some(()))
        })
        .await?;
    }

    // node-1's agent says Hello to the leader over TLS with its token.
    let token = server.issue_token(&census_token("agent-1"))?;
    let to_leader = certs.target(leader.grpc_addr, None)?.channel().await?;
    let (tx, rx) = mpsc::channel(4);
    tx.send(hello("node-1", session(1))).await?;
    let mut stream = tokio::time::timeout(
        WAIT,
        EndpointSyncClient::new(to_leader).sync(bearer(ReceiverStream::new(rx), Some(&token))?),
    )
    .await??
    .into_inner();
    let reply = tokio::time::timeout(WAIT, stream.message()).await??;
    assert!(
        matches!(
            reply,
            Some(pb::OperatorMessage {
                body: Some(operator_message::Body::HelloReply(_))
            })
        ),
        "{reply:?}"
    );

    // The follower answers with the leader's nodes: the leader reviewed the
    // caller's own token.
    let to_follower = certs.target(follower.grpc_addr, None)?.channel().await?;
    assert_eq!(list_nodes(&to_follower, Some(&token)).await??, ["node-1"]);
    let node = get_node(&to_follower, "node-1", Some(&token)).await??;
    assert_eq!(node.name, "node-1");
    let unknown = refused(
        get_node(&to_follower, "node-9", Some(&token)).await?,
        "an unknown node",
    )?;
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");

    // Without a token the follower refuses the call itself and forwards nothing.
    let none = refused(list_nodes(&to_follower, None).await?, "no token")?;
    assert_eq!(none.code(), Code::Unauthenticated, "{none:?}");
    let none = refused(get_node(&to_follower, "node-1", None).await?, "no token")?;
    assert_eq!(none.code(), Code::Unauthenticated, "{none:?}");
    // A token of another audience, likewise.
    let wrong = server.issue_token(&census_fake_apiserver::TokenRequest::for_pod(
        "census-agent",
        SA,
        "agent-1",
    ))?;
    let refused_wrong = refused(
        list_nodes(&to_follower, Some(&wrong)).await?,
        "wrong audience",
    )?;
    assert_eq!(
        refused_wrong.code(),
        Code::Unauthenticated,
        "{refused_wrong:?}"
    );

    // Serving TLS without --tls-ca, a follower cannot verify the leader: it says so,
    // naming the leader and the flag, and never falls back to plain HTTP/2.
    let to_no_ca = certs.target(no_ca.grpc_addr, None)?.channel().await?;
    for answer in [
        list_nodes(&to_no_ca, Some(&token)).await?.map(|_| ()),
        get_node(&to_no_ca, "node-1", Some(&token))
            .await?
            .map(|_| ()),
    ] {
        let status = refused(answer, "a follower without --tls-ca")?;
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        let text = status.message();
        assert!(text.contains("--tls-ca") && text.contains("op-a"), "{text}");
        assert!(
            status.metadata().get("census-leader").is_some(),
            "{status:?}"
        );
    }

    drop(stream);
    drop(tx);
    no_ca.shut_down().await?;
    follower.shut_down().await?;
    leader.shut_down().await?;
    Ok(())
}
