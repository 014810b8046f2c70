//! `census-operator certs`, run as a process: the files it writes, their modes,
//! what the certificates say, and its refusals.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::Path,
    process::{Command, Output},
};

use census_operator::certs::{NodeCa, node_files};
use census_proto::domain::NodeName;
use rustls_pki_types::{CertificateDer, ServerName, UnixTime, pem::PemObject};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn certs(dir: &Path, args: &[&str]) -> Result<Output, std::io::Error> {
    Command::new(env!("CARGO_BIN_EXE_census-operator"))
        .arg("certs")
        .arg("--out-dir")
        .arg(dir)
        .args(args)
        .output()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn mode(path: &Path) -> Result<u32, std::io::Error> {
    Ok(fs::metadata(path)?.permissions().mode() & 0o777)
}

fn der(path: &Path) -> Result<CertificateDer<'static>, Box<dyn std::error::Error>> {
    Ok(CertificateDer::from_pem_file(path)?)
}

fn node(name: &str) -> Result<NodeName, Box<dyn std::error::Error>> {
    Ok(NodeName::new(name)?)
}

/// Every file in a directory with its contents.
fn snapshot(dir: &Path) -> Result<Vec<(String, Vec<u8>)>, std::io::Error> {
    let mut files = fs::read_dir(dir)?
        .map(|e| {
            let e = e?;
            Ok((
                e.file_name().to_string_lossy().into_owned(),
                fs::read(e.path())?,
            ))
        })
        .collect::<Result<Vec<_>, std::io::Error>>()?;
    files.sort();
    Ok(files)
}

#[test]
fn writes_a_ca_a_serving_certificate_and_node_certificates() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("tls");
    let out = certs(
        &dir,
        &[
            "--dns",
            "census-operator-leader.census-system.svc",
            "--dns",
            "census-operator-leader.census-system.svc.cluster.local",
            "--ip",
            "10.96.0.20",
            "--node",
            "node-a",
            "--node",
            "node-b",
        ],
    )?;
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8(out.stdout)?;
    assert_eq!(stdout.lines().count(), 8, "{stdout}");

    for (file, want) in [
        ("ca.pem", 0o644),
        ("ca-key.pem", 0o600),
        ("server.pem", 0o644),
        ("server-key.pem", 0o600),
        ("node-node-a.pem", 0o644),
        ("node-node-a-key.pem", 0o600),
        ("node-node-b.pem", 0o644),
        ("node-node-b-key.pem", 0o600),
    ] {
        assert_eq!(mode(&dir.join(file))?, want, "{file}");
    }

    // The serving certificate verifies for its names and addresses, for servers.
    let ca = der(&dir.join("ca.pem"))?;
    let anchor = webpki::anchor_from_trusted_cert(&ca)?;
    let server = der(&dir.join("server.pem"))?;
    let server = webpki::EndEntityCert::try_from(&server)?;
    server.verify_for_usage(
        webpki::ALL_VERIFICATION_ALGS,
        &[anchor],
        &[],
        UnixTime::now(),
        webpki::KeyUsage::server_auth(),
        None,
        None,
    )?;
    for name in [
        "census-operator-leader.census-system.svc",
        "census-operator-leader.census-system.svc.cluster.local",
        "10.96.0.20",
    ] {
        server.verify_is_valid_for_subject_name(&ServerName::try_from(name)?)?;
    }
    assert!(
        server
            .verify_is_valid_for_subject_name(&ServerName::try_from("evil.example")?)
            .is_err()
    );

    // Each node certificate names its node, read back through the CA.
    let node_ca = NodeCa::from_pem(&fs::read(dir.join("ca.pem"))?)?;
    for name in ["node-a", "node-b"] {
        let (cert, _) = node_files(&dir, &node(name)?);
        assert_eq!(node_ca.node_of(&[der(&cert)?])?.as_str(), name);
    }
    // Only the CA is a CA.
    assert!(x509_parser::parse_x509_certificate(&ca)?.1.is_ca());
    let (a, _) = node_files(&dir, &node("node-a")?);
    let a = der(&a)?;
    assert!(!x509_parser::parse_x509_certificate(&a)?.1.is_ca());
    Ok(())
}

#[test]
fn existing_files_are_not_overwritten_without_force_and_the_ca_never() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path();
    let out = certs(dir, &["--node", "node-a"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let before = snapshot(dir)?;

    // Again: refused, naming the file, nothing changed (not even node-b's,
    // which did not exist).
    let out = certs(dir, &["--node", "node-b", "--node", "node-a"])?;
    assert!(!out.status.success());
    let err = stderr(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("node-node-a.pem exists; pass --force"),
        "{err}"
    );
    assert_eq!(snapshot(dir)?, before);

    // A new node is signed by the existing CA.
    let out = certs(dir, &["--node", "node-b"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let node_ca = NodeCa::from_pem(&fs::read(dir.join("ca.pem"))?)?;
    let (b, _) = node_files(dir, &node("node-b")?);
    assert_eq!(node_ca.node_of(&[der(&b)?])?.as_str(), "node-b");

    // --force replaces node-a's certificate and key, not the CA.
    let out = certs(dir, &["--node", "node-a", "--force"])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let after = snapshot(dir)?;
    let get = |files: &[(String, Vec<u8>)], name: &str| {
        files
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c.clone())
    };
    for unchanged in ["ca.pem", "ca-key.pem"] {
        assert_eq!(
            get(&after, unchanged),
            get(&before, unchanged),
            "{unchanged}"
        );
    }
    for changed in ["node-node-a.pem", "node-node-a-key.pem"] {
        assert_ne!(get(&after, changed), get(&before, changed), "{changed}");
    }
    assert_eq!(mode(&dir.join("node-node-a-key.pem"))?, 0o600);
    let (a, _) = node_files(dir, &node("node-a")?);
    assert_eq!(node_ca.node_of(&[der(&a)?])?.as_str(), "node-a");

    // Nothing left to do.
    let out = certs(dir, &[])?;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("nothing to write"),
        "{}",
        stderr(&out)
    );
    Ok(())
}

#[test]
fn bad_input_is_refused_and_writes_nothing() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("tls");
    for (args, says) in [
        (&["--dns", "not a name"][..], "is not a DNS name"),
        (&["--node", "Node_A"][..], "is not a DNS subdomain"),
        (
            &["--node", "a", "--node", "a"][..],
            "--node a is named twice",
        ),
        (&["--ip", "10.0.0.300"][..], "invalid value"),
        (
            &["--node", "a", "--days", "0"][..],
            "--days must be at least 1",
        ),
    ] {
        let out = certs(&dir, args)?;
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr(&out).contains(says), "{args:?}: {}", stderr(&out));
        assert!(!dir.exists(), "{args:?} wrote something");
    }

    // Half a CA is not completed behind the user's back.
    fs::create_dir(&dir)?;
    fs::write(dir.join("ca.pem"), "")?;
    let out = certs(&dir, &["--node", "a"])?;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("ca-key.pem does not"),
        "{}",
        stderr(&out)
    );
    assert_eq!(snapshot(&dir)?.len(), 1);
    Ok(())
}
