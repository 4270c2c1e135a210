#!/usr/bin/env bash
# The latency floor of this machine for `ringmqctl bench --rate`: 16-byte stamps at RATE per
# second through a relay that only copies bytes (two loopback hops, as producer → broker →
# consumer), ROUNDS times. Compare its p99 with the broker's:
#
#   scripts/measure-loopback-floor.sh [RATE [COUNT [ROUNDS [PORT]]]]   (defaults 1000 10000 3 7790)
set -euo pipefail
cd "$(dirname "$0")"
rate=${1:-1000}; count=${2:-10000}; rounds=${3:-3}; port=${4:-7790}
work=$(mktemp -d); relay=""
trap '[ -n "$relay" ] && kill "$relay" 2>/dev/null; rm -rf "$work"' EXIT
rustc --edition 2021 -O -o "$work/loopback_floor" loopback_floor.rs
for _ in $(seq "$rounds"); do
  "$work/loopback_floor" relay "127.0.0.1:$port" &
  relay=$!
  sleep 0.3
  "$work/loopback_floor" client "127.0.0.1:$port" "$count" "$rate"
  wait "$relay" || true
  relay=""
done
