#!/usr/bin/env bash
# Builds the images ringmq/broker:dev and ringmq/operator:dev on a machine with Docker and no
# registry (nothing is pulled): FROM scratch, with root file systems assembled here from the
# release binaries and exactly the shared libraries `ldd` lists for them. For a machine with a
# registry, docker/broker.Dockerfile and docker/operator.Dockerfile build from source instead.
#
#   scripts/build-images.sh            # both images
#   scripts/build-images.sh broker     # only ringmq/broker:dev (or: operator)
#
# Steps: `cargo build --release` of ringmq-broker, ringmqctl and ringmq-operator (in
# $CARGO_TARGET_DIR, default ./target); debug info stripped from copies of them; a build
# context per image under $CARGO_TARGET_DIR/images/ with rootfs/ (the binaries, their
# libraries and the dynamic loader at the paths ldd names, /etc/passwd and /etc/group with the
# user ringmq, uid/gid 10001, /tmp; the operator also gets /etc/ssl/certs/ca-certificates.crt);
# then the classic builder (DOCKER_BUILDKIT=0: BuildKit's frontend image would be pulled) with
# docker/<image>.scratch.Dockerfile. Idempotent: unchanged binaries give unchanged layers.
# Prints the images' sizes at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "build-images: $*" >&2; }
die() {
    say "$*"
    exit 1
}

images=("$@")
[ ${#images[@]} -gt 0 ] || images=(broker operator)
for i in "${images[@]}"; do
    case $i in broker | operator) ;; *) die "unknown image '$i' (broker or operator)" ;; esac
done

command -v docker >/dev/null || die "docker is not installed"
docker info >/dev/null 2>&1 || die "the Docker daemon does not answer (docker info failed): start it, or run as a user in the docker group"
for tool in ldd objcopy; do
    command -v "$tool" >/dev/null || die "$tool is missing (apt-get install libc-bin binutils)"
done

target=${CARGO_TARGET_DIR:-$PWD/target}
uid=10001
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)

# Run from a test (cargo or nextest), the environment carries the test's CARGO_PKG_*,
# CARGO_MANIFEST_* and the like. Some build scripts (ring's) ask cargo to rebuild when those
# change (ring's build.rs reads CARGO_MANIFEST_DIR and CARGO_PKG_*), which would rebuild the TLS
# stack and everything above it, and again when run from a shell: drop them.
while read -r var; do
    case $var in
        CARGO_PKG_* | CARGO_MANIFEST_* | CARGO_CFG_* | CARGO_CRATE_NAME | CARGO_BIN_* | CARGO_PRIMARY_PACKAGE | CARGO_TARGET_TMPDIR | OUT_DIR | NEXTEST_*)
            unset "$var"
            ;;
    esac
done < <(compgen -e)

# Always all three binaries, in one invocation, whichever images are asked for: cargo unifies
# the dependencies' features over the packages of one build, so building the broker alone
# would compile the whole dependency tree a second time with other features.
cargo_args=(-p ringmq --bin ringmq-broker --bin ringmqctl -p ringmq-operator --bin ringmq-operator)
say "cargo build --release ${cargo_args[*]}"
cargo build --release --locked "${cargo_args[@]}"

# Copies `bin` (debug info stripped) to rootfs/, and every library ldd lists for it, and the
# dynamic loader, at the paths ldd names (symlinks resolved). Fails on a library ldd cannot find.
add_binary() {
    local rootfs=$1 bin=$2
    objcopy --strip-debug "$bin" "$rootfs/$(basename "$bin")"
    local deps
    deps=$(ldd "$bin") || die "ldd $bin failed"
    if grep -q 'not found' <<<"$deps"; then
        die "ldd cannot find a library of $bin: $deps"
    fi
    # Lines: `libx.so.1 => /lib/.../libx.so.1 (0x...)`, `/lib64/ld-linux-x86-64.so.2 (0x...)`,
    # and the kernel's `linux-vdso.so.1 (0x...)`, which is no file.
    local path
    for path in $(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$deps"); do
        mkdir -p "$rootfs$(dirname "$path")"
        cp -L "$path" "$rootfs$path"
    done
}

# A build context: rootfs/ with the user (home directory $2) and /tmp, and an empty data/.
new_context() {
    local ctx=$1 home=$2
    rm -rf "$ctx"
    mkdir -p "$ctx/rootfs/etc" "$ctx/rootfs/tmp" "$ctx/data"
    chmod 1777 "$ctx/rootfs/tmp"
    printf 'root:x:0:0:root:/:/sbin/nologin\nringmq:x:%s:%s:ringmq:%s:/sbin/nologin\n' "$uid" "$uid" "$home" >"$ctx/rootfs/etc/passwd"
    printf 'root:x:0:\nringmq:x:%s:\n' "$uid" >"$ctx/rootfs/etc/group"
}

release=$target/release
built=()
for i in "${images[@]}"; do
    ctx=$target/images/$i
    case $i in
        broker) new_context "$ctx" /data ;;
        operator) new_context "$ctx" / ;;
    esac
    case $i in
        broker)
            add_binary "$ctx/rootfs" "$release/ringmq-broker"
            add_binary "$ctx/rootfs" "$release/ringmqctl"
            ;;
        operator)
            add_binary "$ctx/rootfs" "$release/ringmq-operator"
            ca=/etc/ssl/certs/ca-certificates.crt
            [ -f "$ca" ] || die "$ca is missing (apt-get install ca-certificates)"
            mkdir -p "$ctx/rootfs/etc/ssl/certs"
            cp "$ca" "$ctx/rootfs/etc/ssl/certs/"
            ;;
    esac
    # The same bytes give the same layers: no timestamps in what the builder compares.
    find "$ctx" -exec touch -h -d @0 {} +
    tag=ringmq/$i:dev
    say "docker build $tag ($ctx)"
    DOCKER_BUILDKIT=0 docker build -q -f "docker/$i.scratch.Dockerfile" \
        --label "org.opencontainers.image.revision=$revision" \
        --label "org.opencontainers.image.source=ringmq" -t "$tag" "$ctx" >/dev/null
    built+=("$tag")
done

for tag in "${built[@]}"; do
    docker image ls --format '{{.Repository}}:{{.Tag}} {{.ID}} {{.Size}}' "$tag"
done
