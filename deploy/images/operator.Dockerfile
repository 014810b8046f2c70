# census-operator. Build from the repository root:
#   docker build -f deploy/images/operator.Dockerfile -t census-operator .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p census-operator --bin census-operator

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/census-operator /usr/local/bin/census-operator
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/census-operator"]
