# census-operator. Build from the repository root:
#   docker build -f deploy/images/operator.Dockerfile -t census-operator .
#
# Debian 12 (bookworm), the release `cargo xtask setup` targets, with an exact Rust
# toolchain. `cargo xtask images` builds the same `runtime` stage from binaries built
# on the host (BINARIES=prebuilt) on a Debian base made with mmdebstrap, and
# smoke-runs it.

# The userspace toolchain; it overrides rust-toolchain.toml's `stable`, so the image
# never fetches whatever stable is the day it is built.
ARG RUST_VERSION=1.95.0
# Where the runtime stage takes the binaries from: `build` (compiled below) or
# `prebuilt` (the build context is a directory laid out as the image's file system:
# usr/local/bin/census-operator, var/lib/census/).
ARG BINARIES=build
ARG RUNTIME_BASE=gcr.io/distroless/cc-debian12:nonroot

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
ARG RUST_VERSION
ENV RUSTUP_TOOLCHAIN=${RUST_VERSION}
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p census-operator --bin census-operator \
 && mkdir -p /out/usr/local/bin /out/var/lib/census \
 && cp target/release/census-operator /out/usr/local/bin/

FROM scratch AS prebuilt
COPY . /out/

FROM ${BINARIES} AS binaries

# The one definition of what ships: the binary, and the embedded store's default
# directory (--store redb, /var/lib/census/census.redb) owned by the user it runs as.
FROM ${RUNTIME_BASE} AS runtime
COPY --from=binaries /out/usr/local/bin/ /usr/local/bin/
COPY --from=binaries --chown=65532:65532 /out/var/lib/census/ /var/lib/census/
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/census-operator"]
