# The operator image scripts/build-images.sh builds on a machine with no registry: FROM scratch,
# with a root file system the script assembles in the build context (rootfs/: the release
# binary, exactly the shared libraries `ldd` lists and the dynamic loader, /etc/passwd and
# /etc/group naming the user ringmq, uid/gid 10001, and the CA bundle). Not meant to be built
# by hand: run scripts/build-images.sh. With a registry, docker/operator.Dockerfile builds the
# same image from source.
FROM scratch
COPY rootfs/ /
WORKDIR /
USER 10001:10001
# /metrics and /healthz (METRICS_ADDR, the chart sets 0.0.0.0:8080).
EXPOSE 8080
ENTRYPOINT ["/ringmq-operator"]
