# The broker image for a machine with registry access: builds ringmq-broker and ringmqctl from
# source in rust:1.88-bookworm (the workspace's rust-version) and runs them on distroless
# cc-debian12 (glibc, libgcc; no shell), as uid 10001, like the image scripts/build-images.sh
# assembles FROM scratch. Build from the repository root:
#
#     docker build -f docker/broker.Dockerfile -t ringmq/broker:dev .
#
# NOT BUILT IN THIS PROJECT'S CI: its machines have no registry, so neither base image can be
# pulled there; scripts/build-images.sh is what is built and tested (tests/tests/images.rs).
FROM docker.io/library/rust:1.88-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p ringmq --bin ringmq-broker --bin ringmqctl \
 && objcopy --strip-debug target/release/ringmq-broker /ringmq-broker \
 && objcopy --strip-debug target/release/ringmqctl /ringmqctl \
 && mkdir -p /empty

FROM gcr.io/distroless/cc-debian12
COPY --from=build /ringmq-broker /ringmqctl /
COPY --from=build --chown=10001:10001 /empty /data
VOLUME ["/data"]
WORKDIR /
USER 10001:10001
EXPOSE 5672 5671 15672 25672
ENTRYPOINT ["/ringmq-broker"]
