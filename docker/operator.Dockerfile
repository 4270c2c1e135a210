# The operator image for a machine with registry access: builds ringmq-operator from source in
# rust:1.88-bookworm (the workspace's rust-version) and runs it on distroless cc-debian12
# (glibc, libgcc, CA certificates; no shell), as uid 10001, like the image
# scripts/build-images.sh assembles FROM scratch. Build from the repository root:
#
#     docker build -f docker/operator.Dockerfile -t ringmq/operator:dev .
#
# NOT BUILT IN THIS PROJECT'S CI: its machines have no registry, so neither base image can be
# pulled there; scripts/build-images.sh is what is built and tested.
FROM docker.io/library/rust:1.88-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p ringmq-operator --bin ringmq-operator \
 && objcopy --strip-debug target/release/ringmq-operator /ringmq-operator

FROM gcr.io/distroless/cc-debian12
COPY --from=build /ringmq-operator /
WORKDIR /
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["/ringmq-operator"]
