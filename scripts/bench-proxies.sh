#!/usr/bin/env bash
# Publishing and consuming through a proxy against direct, in one run (issue #12's target:
# through a proxy >= 50% of direct for 1 KB messages). Starts `ringmqctl local-cluster` of
# three release brokers on fresh data, then ROUNDS times (default 3), alternating:
#   direct            producers and consumers on member 0, the queue on member 0;
#   publish via proxy producers on member 1, consumers on member 0, the queue on member 0;
#   consume via proxy producers on member 0, consumers on member 1, the queue on member 0;
# and prints each run's consumed/s and p99, and the median ratios to direct.
#
#   scripts/bench-proxies.sh [SIZE] [SECONDS]      (ROUNDS=n, BASE_PORT=p in the environment)
#
# QUEUE_ARGS (JSON) declares the queues with those arguments, e.g. '{"qpid.cluster.backups":0}'
# to measure the proxy path alone (without it every queue has the default backup).
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1000}; seconds=${2:-5}; rounds=${ROUNDS:-3}; base=${BASE_PORT:-7672}
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
ctl=$target/release/ringmqctl
[ -x "$ctl" ] || { echo "no $ctl: run cargo build --release --bins first" >&2; exit 1; }
data=$(mktemp -d)
"$ctl" local-cluster --members 3 --base-port "$base" --data-dir "$data" >"$data/out.log" 2>&1 &
pid=$!
trap 'kill -INT $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$data"' EXIT
for _ in $(seq 100); do grep -q "Ctrl-C" "$data/out.log" 2>/dev/null && break; sleep 0.2; done
grep -q "Ctrl-C" "$data/out.log" || { echo "the local cluster did not start:" >&2; cat "$data/out.log" >&2; exit 1; }
m0="amqp://guest:guest@127.0.0.1:$base/%2f"
m1="amqp://guest:guest@127.0.0.1:$((base + 1))/%2f"
run() { # name, extra args
  local name=$1; shift
  local q="bench-$name-$RANDOM"
  local out
  out=$("$ctl" bench --seconds "$seconds" --size "$size" --queue-uri "$m0" --queue "$q" --queue-args "${QUEUE_ARGS:-{\}}" --json "$@" 2>/dev/null | tail -1)
  python3 -c 'import json,sys; d=json.loads(sys.argv[2]); print(sys.argv[1], int(d["consumed_per_sec"]), d["latency_us"]["p99"])' "$name" "$out"
}
results=$(mktemp)
for r in $(seq "$rounds"); do
  run direct --uri "$m0" --consumer-uri "$m0" | tee -a "$results"
  run publish-via-proxy --uri "$m1" --consumer-uri "$m0" | tee -a "$results"
  run consume-via-proxy --uri "$m0" --consumer-uri "$m1" | tee -a "$results"
done
python3 - "$results" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    name, rate, _ = line.split()
    runs.setdefault(name, []).append(int(rate))
direct = statistics.median(runs["direct"])
for name, rates in runs.items():
    m = statistics.median(rates)
    print(f"{name:>18}: median {m:>9.0f} msg/s consumed  ({m / direct:.2f} of direct)")
PY
rm -f "$results"
