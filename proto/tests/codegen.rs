//! The generated protobuf code is committed; this test regenerates it and fails when
//! the committed copy is stale. `cargo xtask codegen` rewrites it (it runs this test
//! with `CENSUS_UPDATE_GENERATED=1`).

use std::{fs, path::Path};

use prost::Message;

#[test]
fn generated_code_is_fresh() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let generated = root.join("src/generated");
    let fds = protox::compile(["census/v1/census.proto"], [root.join("proto")])?;

    let out = tempfile::tempdir()?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // The messages alone without the `grpc` feature (the agent's core).
        .client_mod_attribute(".", "#[cfg(feature = \"grpc\")]")
        .server_mod_attribute(".", "#[cfg(feature = \"grpc\")]")
        .emit_rerun_if_changed(false)
        .out_dir(out.path())
        .compile_fds(fds.clone())?;

    let files = [
        ("census.v1.rs", fs::read(out.path().join("census.v1.rs"))?),
        ("census.v1.bin", fds.encode_to_vec()),
    ];
    let update = std::env::var_os("CENSUS_UPDATE_GENERATED").is_some();
    let mut stale = Vec::new();
    for (name, fresh) in files {
        let path = generated.join(name);
        if fs::read(&path).ok().as_deref() == Some(fresh.as_slice()) {
            continue;
        }
        if update {
            fs::write(&path, fresh)?;
        } else {
            stale.push(name);
        }
    }
    assert!(
        stale.is_empty(),
        "generated code is stale ({}): run `cargo xtask codegen` and commit the result",
        stale.join(", ")
    );
    Ok(())
}
