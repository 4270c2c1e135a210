#!/usr/bin/env bash
# Measures the broker's resident memory per idle connection and per 100k queued 1 KB
# messages (figures for docs/performance.md). Needs release binaries and python3 with pika.
#
#   scripts/measure-rss.sh [CONNECTIONS]   (default 1000)
set -euo pipefail
cd "$(dirname "$0")/.."
conns=${1:-1000}
port=${PORT:-5690}
bin=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release
data=$(mktemp -d)
"$bin/ringmq-broker" --amqp-listen "127.0.0.1:$port" --data-dir "$data" >/dev/null 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; rm -rf "$data"' EXIT
sleep 0.5
rss() { awk '/VmRSS/ {print $2 * 1024}' "/proc/$pid/status"; }
base=$(rss)
python3 - "$port" "$conns" "$pid" <<'PY'
import sys, pika, time
port, n, pid = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
before = rss()
conns = [pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0)) for _ in range(n)]
chans = [c.channel() for c in conns]
time.sleep(1)
after = rss()
print(f"idle connections: {n}, RSS {before/2**20:.1f} MiB -> {after/2**20:.1f} MiB, {(after-before)/n/1024:.1f} KiB per connection (with one channel each)")
for c in conns:
    c.close()
PY
before=$(rss)
"$bin/ringmqctl" bench --uri "amqp://guest:guest@127.0.0.1:$port/%2f" --consumers 0 --count 100000 --size 1000 --seconds 5 --queue rss-test >/dev/null
sleep 0.5
after=$(rss)
echo "100k queued 1 KB messages: RSS $((before / 1048576)) MiB -> $((after / 1048576)) MiB, $(((after - before) / 1048576)) MiB per 100k ($(((after - before) / 100000)) B per message)"
echo "baseline RSS at start: $((base / 1048576)) MiB"
