# census-agent (and the census CLI). Build from the repository root:
#   docker build -f deploy/images/agent.Dockerfile -t census-agent .
#
# Debian 12 (bookworm), the release `cargo xtask setup` targets. Userspace builds with
# an exact rustup toolchain; the eBPF programs with Debian's rustc-web 1.96 (LLVM 22)
# and bpf-linker 0.13, which `cargo xtask setup` installs and `cargo xtask build-ebpf`
# uses (RUSTC_BOOTSTRAP=1 for -Z build-std=core) to build the object the agent
# embeds. `cargo xtask images` builds the same `runtime` stage from binaries built on
# the host (BINARIES=prebuilt) on a Debian base made with mmdebstrap, and smoke-runs it.

# The userspace toolchain; it overrides rust-toolchain.toml's `stable`, so the image
# never fetches whatever stable is the day it is built.
ARG RUST_VERSION=1.95.0
# Where the runtime stage takes the binaries from: `build` (compiled below) or
# `prebuilt` (the build context is a directory laid out as the image's file system:
# usr/local/bin/census-agent and usr/local/bin/census).
ARG BINARIES=build
ARG RUNTIME_BASE=gcr.io/distroless/cc-debian12

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
ARG RUST_VERSION
ENV RUSTUP_TOOLCHAIN=${RUST_VERSION}
WORKDIR /src
COPY . .
RUN cargo xtask setup && cargo xtask build-ebpf \
 && cargo build --release --locked -p census-agent --bin census-agent --bin census \
 && mkdir -p /out/usr/local/bin \
 && cp target/release/census-agent target/release/census /out/usr/local/bin/

FROM scratch AS prebuilt
COPY . /out/

FROM ${BINARIES} AS binaries

# The one definition of what ships. The agent runs as root with CAP_BPF, CAP_NET_ADMIN
# and CAP_PERFMON and the host's bpffs (deploy/agent/daemonset.yaml).
FROM ${RUNTIME_BASE} AS runtime
COPY --from=binaries /out/usr/local/bin/ /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/census-agent"]
