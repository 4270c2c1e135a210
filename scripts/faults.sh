#!/usr/bin/env bash
# The fault suite (issue #16, docs/reliability.md): kills, pauses and partitions against a
# live cluster of real ringmq-broker members, each in its own network namespace behind a
# bridge this script's binary creates, with checkers that prove nothing confirmed is lost.
#
#   scripts/faults.sh [--short] [--seed HEX] [--members 3|4|5] [--only SCHEDULE] [--length S]
#
# --short runs every schedule briefly (a few minutes in all: the form CI runs); without it,
# the long form (90 s per schedule). Prints one table row per schedule and queue, and the
# seed (rerun a failing schedule exactly with --seed and --only). Exits 0 only when every
# checker passes. Needs root, `ip` (iproute2) and `nft` (nftables).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "scripts/faults.sh: needs root (it creates network namespaces): sudo -E $0 $*" >&2
    exit 2
fi
for tool in ip:iproute2 nft:nftables; do
    if ! command -v "${tool%%:*}" >/dev/null; then
        echo "scripts/faults.sh: needs ${tool%%:*}: apt-get install ${tool#*:}" >&2
        exit 2
    fi
done
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
cargo build --workspace --bins
exec "$CARGO_TARGET_DIR/debug/faults" "$@"
