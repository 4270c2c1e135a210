#!/usr/bin/env bash
# Starts one broker binary on a fresh data dir, runs `ringmqctl bench` against it once and
# prints "consumed/s p99_us". For A/B runs of two builds, alternate calls with each binary.
#
#   scripts/bench-broker.sh BROKER_BINARY PORT SIZE [SECONDS [BENCH OPTIONS...]]
#   e.g. scripts/bench-broker.sh target/release/ringmq-broker 5680 1000 10 --confirm 100 --persistent
#   RINGMQCTL=path/to/ringmqctl overrides the release ringmqctl of this workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$1; port=$2; size=$3; seconds=${4:-5}
shift $(($# < 4 ? $# : 4))
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
ctl=${RINGMQCTL:-$target/release/ringmqctl}
data=$(mktemp -d)
"$bin" --amqp-listen "127.0.0.1:$port" --admin-listen 127.0.0.1:0 --data-dir "$data" >/dev/null 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$data"' EXIT
sleep 1
out=$("$ctl" bench --uri "amqp://guest:guest@127.0.0.1:$port/%2f" --seconds "$seconds" --size "$size" "$@" --json 2>/dev/null | tail -1)
python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(int(d["consumed_per_sec"]), d["latency_us"]["p99"])' "$out"
