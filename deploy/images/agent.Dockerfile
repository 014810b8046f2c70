# census-agent (and the census CLI). Build from the repository root:
#   docker build -f deploy/images/agent.Dockerfile -t census-agent .
# The eBPF programs need Debian's rustc-web 1.96 (LLVM 22) and bpf-linker; `cargo xtask
# setup` installs them and `cargo xtask build-ebpf` builds the object the agent embeds.
FROM rust:1.95-trixie AS build
WORKDIR /src
COPY . .
RUN cargo xtask setup && cargo xtask build-ebpf \
 && cargo build --release --locked -p census-agent --bin census-agent --bin census

FROM gcr.io/distroless/cc-debian13
COPY --from=build /src/target/release/census-agent /usr/local/bin/census-agent
COPY --from=build /src/target/release/census /usr/local/bin/census
ENTRYPOINT ["/usr/local/bin/census-agent"]
