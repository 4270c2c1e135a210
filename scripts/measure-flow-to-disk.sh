#!/usr/bin/env bash
# Measures flow-to-disk and recovery from a snapshot (figures for docs/persistence.md).
# Needs release binaries (cargo build --release -p ringmq --bins).
#
#   scripts/measure-flow-to-disk.sh [COUNT]   (default 1000000 messages of 1000 bytes)
#
# 1. COUNT transient messages into a non-durable queue with the default 64 MiB budget, then
#    one consumer drains it for 3 s: consumed/s and RSS; the same with the budget off.
# 2. COUNT persistent messages into a durable queue, SIGTERM, restart: the `recovery done`
#    line and RSS, then one consumer drains it for 3 s (bodies read from the journal).
set -euo pipefail
cd "$(dirname "$0")/.."
count=${1:-1000000}
port=${PORT:-5691}
admin=${ADMIN_PORT:-15691}
bin=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release
work=$(mktemp -d)
uri="amqp://guest:guest@127.0.0.1:$port/%2f"
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT

start() { # CONFIG_YAML DATA_DIR
  printf '%s\n' "$1" >"$work/ringmq.yaml"
  "$bin/ringmq-broker" --amqp-listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin" \
    --config "$work/ringmq.yaml" --data-dir "$2" >/dev/null 2>>"$work/broker.log" &
  pid=$!
  for _ in $(seq 1 600); do # at most 60 s (recovery included)
    grep -q "recovery done" "$work/broker.log" 2>/dev/null &&
      (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return
    sleep 0.1
  done
  echo "broker did not start" >&2
  exit 1
}
stop() {
  kill -TERM "$pid"
  wait "$pid" || true
  pid=""
}
rss() { awk '/VmRSS/ {printf "%.0f MiB", $2 / 1024}' "/proc/$pid/status"; }
consumed() { # QUEUE [--persistent]
  "$bin/ringmqctl" bench --uri "$uri" --producers 0 --consumers 1 --seconds 3 --queue "$@" --json |
    tail -1 | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["consumed_per_sec"]))'
}

for budget in 67108864 0; do
  : >"$work/broker.log"
  start "queue_memory_budget_bytes: $budget" "$work/t$budget"
  "$bin/ringmqctl" bench --uri "$uri" --consumers 0 --count "$count" --confirm 2000 --size 1000 \
    --seconds 120 --queue ftd >/dev/null
  echo "budget $budget: $count transient 1 KB queued, RSS $(rss)"
  echo "budget $budget: one consumer draining: $(consumed ftd) consumed/s, RSS $(rss)"
  stop
done

: >"$work/broker.log"
start "" "$work/p"
"$bin/ringmqctl" bench --uri "$uri" --consumers 0 --count "$count" --persistent --confirm 2000 \
  --size 1000 --seconds 120 --queue rec1m >/dev/null
echo "persistent: $count queued, RSS $(rss)"
stop
: >"$work/broker.log"
start "" "$work/p"
echo "restart: $(grep 'recovery done' "$work/broker.log"), RSS $(rss)"
echo "restart: one consumer draining: $(consumed rec1m --persistent) consumed/s, RSS $(rss)"
stop
rm -f "$work/p/snapshot"
: >"$work/broker.log"
start "" "$work/p"
echo "restart without snapshot: $(grep 'recovery done' "$work/broker.log"), RSS $(rss)"
stop
