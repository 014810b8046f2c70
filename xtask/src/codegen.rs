//! `cargo xtask codegen`: regenerates the protobuf code committed under
//! `proto/src/generated/` (the staleness test in `proto/tests/codegen.rs` does the
//! generating, with `CENSUS_UPDATE_GENERATED=1`, so there is one generator).

use crate::cmd;

#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct Options {}

pub(crate) fn run(options: Options) -> anyhow::Result<()> {
    let Options {} = options;
    cmd::run(
        cmd::host_cargo()
            .current_dir(cmd::workspace_root())
            .env("CENSUS_UPDATE_GENERATED", "1")
            .args([
                "test",
                "--quiet",
                "--package",
                "census-proto",
                "--test",
                "codegen",
            ]),
    )
}
