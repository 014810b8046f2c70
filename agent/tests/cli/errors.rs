//! Every way `census` refuses or fails that needs no root, run through the real
//! binary: each is one line on stderr naming the problem and what to do, nothing on
//! stdout, and its own exit code (the table in `census --help` and docs/cli.md).
//! The map errors that need real pinned maps (another layout, another shape, no
//! permission) are in the privileged suite (`tests/privileged/cli.rs`).

use crate::support::{
    FakeAgent, FakeOperator, Operator, TestResult, census, cli_session, closed_port, hello,
};
use tonic::Status;

const MALFORMED: i32 = 3;
const NOT_FOUND: i32 = 4;
const OPERATOR_UNREACHABLE: i32 = 5;
const AGENT_UNREACHABLE: i32 = 6;
const NO_PINS: i32 = 7;
const INCOMPATIBLE: i32 = 11;
const PEER_FAILED: i32 = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_pin_directory_exits_7() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("census");
    let missing = missing.to_str().ok_or("tempdir is not UTF-8")?;
    // As with bpftool, every group lists with `list`, `show` or no verb at all.
    for verb in [
        &["bpf", "maps"][..],
        &["bpf", "maps", "list"],
        &["bpf", "maps", "show"],
        &["bpf", "endpoints"],
        &["bpf", "endpoints", "list"],
        &["bpf", "endpoints", "show"],
        &["bpf", "endpoints", "get", "198.18.0.2"],
        &["bpf", "interfaces"],
        &["bpf", "interfaces", "list"],
        &["bpf", "interfaces", "show"],
        &["bpf", "flows"],
        &["bpf", "flows", "--sort", "bytes"],
        &["bpf", "flows", "list"],
        &["bpf", "flows", "show", "--identity", "2"],
    ] {
        let mut args = verb.to_vec();
        args.extend(["--bpffs", missing]);
        census(&args, &[]).await?.expect_failure(
            NO_PINS,
            &[
                &format!("no census maps at {missing}: the directory does not exist"),
                "--bpffs (CENSUS_BPFFS)",
            ],
        )?;
    }
    // The environment variable works as the flag does.
    census(&["bpf", "maps"], &[("CENSUS_BPFFS", missing)])
        .await?
        .expect_failure(NO_PINS, &[missing])?;
    assert!(!dir.path().join("census").exists(), "nothing was created");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_that_is_not_bpffs_exits_7() -> TestResult {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("ENDPOINTS"), b"not a map")?;
    let path = dir.path().to_str().ok_or("tempdir is not UTF-8")?;
    census(&["bpf", "maps", "--bpffs", path], &[])
        .await?
        .expect_failure(NO_PINS, &["not on a BPF file system (bpffs)", path])?;
    assert_eq!(std::fs::read(dir.path().join("ENDPOINTS"))?, b"not a map");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_operator_exits_5() -> TestResult {
    let operator = closed_port().await?;
    for verb in [
        &["identity", "list"][..],
        &["identity", "get", "256"],
        &["identity", "lookup", "k8s:app=web"],
        &["node", "list"],
        &["node", "get", "node-a"],
    ] {
        let mut args = verb.to_vec();
        args.extend(["--operator", &operator]);
        census(&args, &[]).await?.expect_failure(
            OPERATOR_UNREACHABLE,
            &[
                &format!("cannot reach the operator at {operator}"),
                "refused",
                "--operator (CENSUS_OPERATOR)",
            ],
        )?;
    }
    census(&["node", "list"], &[("CENSUS_OPERATOR", &operator)])
        .await?
        .expect_failure(OPERATOR_UNREACHABLE, &[&operator])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_agent_exits_6() -> TestResult {
    let agent = closed_port().await?;
    census(&["endpoint", "list", "--agent", &agent], &[])
        .await?
        .expect_failure(
            AGENT_UNREACHABLE,
            &[
                &format!("cannot reach the agent at {agent}"),
                "refused",
                "--agent (CENSUS_AGENT)",
            ],
        )?;
    census(&["endpoint", "list"], &[("CENSUS_AGENT", &agent)])
        .await?
        .expect_failure(AGENT_UNREACHABLE, &[&agent])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_input_exits_3_before_asking_anyone() -> TestResult {
    // Nothing listens at these addresses and no maps are pinned there: input is
    // checked first.
    let operator = closed_port().await?;
    let dir = tempfile::tempdir()?;
    let bpffs = dir.path().join("nothing");
    let bpffs = bpffs.to_str().ok_or("tempdir is not UTF-8")?;
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["identity", "lookup", "k8s:-x=y"],
            &["malformed labels \"k8s:-x=y\"", "source:key=value"],
        ),
        (
            &["identity", "lookup", "app=web"],
            &["malformed labels \"app=web\""],
        ),
        (
            &["identity", "lookup", "k8s:a=1,k8s:a=2"],
            &["malformed labels", "the same key two values"],
        ),
        (
            &["identity", "list", "--labels", "k8s:app"],
            &["malformed labels \"k8s:app\""],
        ),
        (
            &["identity", "get", "web"],
            &["\"web\" is not an identity", "a number"],
        ),
        (&["identity", "get", "0"], &["\"0\" is not an identity"]),
        (
            &["node", "get", "Node_A"],
            &["node name \"Node_A\" is not a DNS subdomain"],
        ),
        (
            &["bpf", "endpoints", "get", "198.18.0"],
            &["\"198.18.0\" is not an IPv4 or IPv6 address"],
        ),
        (
            &["bpf", "flows", "list", "--identity", "web"],
            &["\"web\" is not an identity"],
        ),
    ];
    for (verb, needles) in cases {
        let mut args = verb.to_vec();
        args.extend(["--operator", &operator, "--bpffs", bpffs]);
        census(&args, &[])
            .await?
            .expect_failure(MALFORMED, needles)?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_errors_exit_2() -> TestResult {
    for args in [
        &["bpf", "programs"][..],
        &["identity", "list", "-o", "xml"],
        &["node", "list", "--operator", "https://operator:9460"],
        &["bpf", "flows", "list", "--sort", "age"],
        &["bpf", "flows", "--sort", "bytes", "list"],
        &["bpf", "maps", "dump"],
        &["identity", "lookup"],
        &["node", "list", "--timeout", "soon"],
    ] {
        let run = census(args, &[]).await?;
        assert_eq!(run.code, Some(2), "{args:?}: {run:#?}");
        assert!(run.stdout.is_empty(), "{args:?}: {run:#?}");
        assert!(run.stderr.starts_with("error: "), "{args:?}: {run:#?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_ids_labels_and_nodes_exit_4() -> TestResult {
    let operator = Operator::start(&[]).await?;
    let _agent = hello(&operator, "node-a").await?;
    let web = operator
        .allocate_ok("node-a", cli_session(), &["k8s:app=web"])
        .await?;
    let op = &operator.url();
    let unknown_id = (web.id + 1000).to_string();
    census(&["identity", "get", &unknown_id, "--operator", op], &[])
        .await?
        .expect_failure(
            NOT_FOUND,
            &[
                &format!("identity {unknown_id} is not known to the operator at {op}"),
                "census identity list",
            ],
        )?;
    census(
        &["identity", "lookup", "k8s:app=nope", "--operator", op],
        &[],
    )
    .await?
    .expect_failure(NOT_FOUND, &["no identity has the labels k8s:app=nope"])?;
    census(&["node", "get", "node-z", "--operator", op], &[])
        .await?
        .expect_failure(
            NOT_FOUND,
            &[
                "node node-z is not known to the operator",
                "census node list",
            ],
        )?;
    // What exists is found.
    let run = census(
        &[
            "identity",
            "get",
            &web.id.to_string(),
            "--operator",
            op,
            "-o",
            "json",
        ],
        &[],
    )
    .await?;
    assert_eq!(run.json()?["labels"], serde_json::json!(["k8s:app=web"]));
    operator.shut_down().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn labels_the_operator_refuses_exit_3() -> TestResult {
    // Valid syntax, but nothing is left after the operator's label filter.
    let operator = Operator::start(&[]).await?;
    census(
        &[
            "identity",
            "lookup",
            "k8s:pod-template-hash=abc",
            "--operator",
            &operator.url(),
        ],
        &[],
    )
    .await?
    .expect_failure(
        MALFORMED,
        &["the operator at", "refused the request", "label filter"],
    )?;
    operator.shut_down().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_protocol_version_exits_11_and_other_refusals_12() -> TestResult {
    let mismatch = FakeOperator::start(Status::failed_precondition(
        "protocol version mismatch: the peer speaks version 1, this side speaks version 2",
    ))
    .await?;
    census(&["node", "list", "--operator", &mismatch.addr], &[])
        .await?
        .expect_failure(
            INCOMPATIBLE,
            &[
                "speaks another protocol version",
                "this side speaks version 2",
                "census CLI of the operator's release",
            ],
        )?;
    let broken = FakeOperator::start(Status::internal("the store is on fire\nreally")).await?;
    census(&["node", "list", "--operator", &broken.addr], &[])
        .await?
        .expect_failure(
            PEER_FAILED,
            &["failed the request", "the store is on fire; really"],
        )?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_failures_exit_12() -> TestResult {
    let failing = FakeAgent::start(vec![(
        "/v1/endpoints",
        500,
        "the datapath is gone".to_owned(),
    )])
    .await?;
    census(&["endpoint", "list", "--agent", &failing.addr], &[])
        .await?
        .expect_failure(
            PEER_FAILED,
            &[
                "answered GET /v1/endpoints with HTTP 500",
                "the datapath is gone",
            ],
        )?;
    let garbled = FakeAgent::start(vec![("/v1/endpoints", 200, "{\"node\":".to_owned())]).await?;
    census(&["endpoint", "list", "--agent", &garbled.addr], &[])
        .await?
        .expect_failure(
            PEER_FAILED,
            &["sent an answer census cannot read", "GET /v1/endpoints"],
        )?;
    let old = FakeAgent::start(vec![]).await?;
    census(&["endpoint", "list", "--agent", &old.addr], &[])
        .await?
        .expect_failure(PEER_FAILED, &["HTTP 404"])?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn help_documents_every_exit_code() -> TestResult {
    let run = census(&["--help"], &[]).await?;
    let help = run.expect_success()?;
    for code in 0..=12 {
        assert!(
            help.contains(&format!("\n{code:>4}  ")),
            "exit code {code} is not documented: {help}"
        );
    }
    Ok(())
}
