#!/usr/bin/env bash
# What sessions cost and what a failover costs the application (issue #14's benchmark), on
# `ringmqctl local-cluster` of three release brokers, ROUNDS times (default 3), each on a
# fresh cluster:
#   plain      `ringmqctl bench` (raw frames, no sessions) on member 0;
#   failover   `ringmqctl bench --failover` (the failover client, sessions) on member 0;
#   kill       `ringmqctl bench --failover` on member 0, which — the clients' member and the
#              queue's primary — is killed with -9 a third of the way in: every client fails
#              over, and the queue's backup takes over.
# Prints each run, the median throughput of `failover` against `plain`, and the pauses the
# application saw across the kills (every producer's and consumer's, all rounds together:
# median, p99, longest), with lost, duplicates and out of order.
#
#   scripts/bench-failover.sh [SIZE] [SECONDS]     (ROUNDS=n, BASE_PORT=p, CLIENTS=n)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1000}; seconds=${2:-15}; rounds=${ROUNDS:-3}; base=${BASE_PORT:-7772}
clients=${CLIENTS:-2}
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
ctl=$target/release/ringmqctl
[ -x "$ctl" ] || { echo "no $ctl: run cargo build --release --bins first" >&2; exit 1; }
results=$(mktemp)
data=""; pid=""
stop_cluster() {
  if [ -n "$pid" ]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  [ -n "$data" ] && rm -rf "$data"
  pid=""; data=""
}
trap 'stop_cluster; rm -f "$results"' EXIT
start_cluster() {
  data=$(mktemp -d)
  "$ctl" local-cluster --members 3 --base-port "$base" --data-dir "$data" >"$data/out.log" 2>&1 &
  pid=$!
  for _ in $(seq 150); do grep -q "Ctrl-C" "$data/out.log" 2>/dev/null && break; sleep 0.2; done
  grep -q "Ctrl-C" "$data/out.log" || { echo "the local cluster did not start:" >&2; cat "$data/out.log" >&2; exit 1; }
}
# The PID of the member listening for AMQP on port $1: a child of the local cluster.
member_pid() {
  local child
  for child in $(cat /proc/"$pid"/task/*/children); do
    if tr '\0' ' ' </proc/"$child"/cmdline | grep -q -- "127.0.0.1:$1 "; then echo "$child"; return; fi
  done
  echo "no member on port $1" >&2; exit 1
}
uris="amqp://guest:guest@127.0.0.1:$base/%2f,amqp://guest:guest@127.0.0.1:$((base + 1))/%2f,amqp://guest:guest@127.0.0.1:$((base + 2))/%2f"
m0="amqp://guest:guest@127.0.0.1:$base/%2f"
common=(--seconds "$seconds" --size "$size" --confirm 256 --prefetch 256 --producers "$clients" --consumers "$clients" --json)
for r in $(seq "$rounds"); do
  start_cluster
  out=$("$ctl" bench --uri "$m0" --queue "plain-$r" "${common[@]}" 2>/dev/null | tail -1)
  echo "plain $out" | tee -a "$results" | cut -c1-160
  out=$("$ctl" bench --failover --uri "$uris" --queue "sessions-$r" "${common[@]}" 2>/dev/null | tail -1)
  echo "failover $out" | tee -a "$results" | cut -c1-160
  victim=$(member_pid "$base")
  "$ctl" bench --failover --uri "$uris" --queue "kill-$r" "${common[@]}" >"$data/kill.json" 2>"$data/kill.err" &
  bench=$!
  sleep $((seconds / 3))
  kill -9 "$victim"
  wait "$bench" || { echo "the bench through the kill failed:" >&2; cat "$data/kill.err" >&2; exit 1; }
  echo "kill $(tail -1 "$data/kill.json")" | tee -a "$results" | cut -c1-160
  stop_cluster
done
python3 - "$results" <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    name, doc = line.split(" ", 1)
    runs.setdefault(name, []).append(json.loads(doc))
plain = statistics.median(d["published_per_sec"] for d in runs["plain"])
failover = statistics.median(d["published_per_sec"] for d in runs["failover"])
print(f"published: plain bench median {plain:.0f} msg/s, --failover median {failover:.0f} msg/s ({failover / plain:.2f} of plain)")
pauses = sorted(p for d in runs["kill"] for p in d["pauses_ms"])
at = lambda q: pauses[round((len(pauses) - 1) * q)] if pauses else float("nan")
print(f"across {len(runs['kill'])} kills: {len(pauses)} pauses, median {at(0.5):.0f} ms, p99 {at(0.99):.0f} ms, longest {at(1.0):.0f} ms; "
      f"lost {sum(d['lost'] for d in runs['kill'])}, duplicates {sum(d['duplicates'] for d in runs['kill'])}, "
      f"out of order {sum(d['out_of_order'] for d in runs['kill'])}, failovers {sum(d['failovers'] for d in runs['kill'])}")
PY
