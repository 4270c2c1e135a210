#!/usr/bin/env bash
# A fragmented queue's throughput with 1, 2 and 3 members beside a normal (one-primary)
# queue on the same cluster (issue #15). For each N, starts `ringmqctl local-cluster` of N
# release brokers on fresh data, then ROUNDS times (default 3), alternating:
#   normal      one queue with its primary on member 0;
#   fragmented  one queue declared with qpid.cluster.fragmented;
# each with N producers and N consumers, producer and consumer i on member i (`bench
# --spread`), persistent 1 KB messages under confirms (window 256), BACKUPS backups per
# queue (default 1; a one-member cluster has none to keep). Prints each run's consumed/s and
# p99, the medians, and the scaling factor over one member.
#
#   scripts/bench-fragmented.sh [SIZE] [SECONDS]   (ROUNDS=n, BASE_PORT=p, MEMBERS="1 2 3", BACKUPS=k)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-1000}; seconds=${2:-5}; rounds=${ROUNDS:-3}; base=${BASE_PORT:-7672}
target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
ctl=$target/release/ringmqctl
[ -x "$ctl" ] || { echo "no $ctl: run cargo build --release --bins first" >&2; exit 1; }
results=$(mktemp)
pid=""; data=""
stop() { if [ -n "$pid" ]; then kill -INT "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true; fi; [ -z "$data" ] || rm -rf "$data"; pid=""; data=""; }
trap 'stop; rm -f "$results"' EXIT
for n in ${MEMBERS:-1 2 3}; do
  data=$(mktemp -d)
  "$ctl" local-cluster --members "$n" --base-port "$base" --data-dir "$data" >"$data/out.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do grep -q "Ctrl-C" "$data/out.log" 2>/dev/null && break; sleep 0.2; done
  grep -q "Ctrl-C" "$data/out.log" || { echo "the local cluster did not start:" >&2; cat "$data/out.log" >&2; exit 1; }
  uris=$(for i in $(seq 0 $((n - 1))); do printf 'amqp://guest:guest@127.0.0.1:%d/%%2f,' $((base + i)); done)
  uris=${uris%,}
  run() { # name, queue arguments
    local out
    out=$("$ctl" bench --seconds "$seconds" --size "$size" --spread "$uris" --producers "$n" \
      --consumers "$n" --confirm 256 --persistent --queue-args "$2" --json 2>/dev/null | tail -1)
    python3 -c 'import json,sys; d=json.loads(sys.argv[3]); print(sys.argv[1], sys.argv[2], int(d["consumed_per_sec"]), d["latency_us"]["p99"])' "$n" "$1" "$out"
  }
  for _ in $(seq "$rounds"); do
    k=${BACKUPS:-1}
    run normal "{\"qpid.cluster.backups\":$k}" | tee -a "$results"
    run fragmented "{\"qpid.cluster.backups\":$k,\"qpid.cluster.fragmented\":true}" | tee -a "$results"
  done
  stop
done
python3 - "$results" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    n, name, rate, _ = line.split()
    runs.setdefault((name, int(n)), []).append(int(rate))
one = {name: statistics.median(r) for (name, n), r in runs.items() if n == 1}
for (name, n), rates in sorted(runs.items()):
    m = statistics.median(rates)
    base = one.get(name)
    scale = f"  x{m / base:.2f} of 1 member" if base else ""
    print(f"{n} member(s) {name:>10}: median {m:>9.0f} msg/s consumed{scale}")
PY
