# The broker image scripts/build-images.sh builds on a machine with no registry: FROM scratch,
# with a root file system the script assembles in the build context (rootfs/: the release
# binaries, exactly the shared libraries `ldd` lists and the dynamic loader, /etc/passwd and
# /etc/group naming the user ringmq, uid/gid 10001, and an empty /tmp). Not meant to be built by
# hand: run scripts/build-images.sh. With a registry, docker/broker.Dockerfile builds the same
# image from source.
FROM scratch
COPY rootfs/ /
# The default data dir is `data`, relative to the working directory: /data, a volume.
COPY --chown=10001:10001 data/ /data/
VOLUME ["/data"]
WORKDIR /
USER 10001:10001
# 5672 AMQP, 5671 AMQPS, 15672 admin HTTP, 25672 cluster. The broker binds 127.0.0.1 unless
# told otherwise: pass --amqp-listen 0.0.0.0:5672 --admin-listen 0.0.0.0:15672 (or a config).
EXPOSE 5672 5671 15672 25672
ENTRYPOINT ["/ringmq-broker"]
