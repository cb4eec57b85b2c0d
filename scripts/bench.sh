#!/usr/bin/env bash
# The delivery-latency benchmark, as published in BENCHMARKS.md.
#
#   scripts/bench.sh [outbox-relay bench flags...]
#
# Runs against the Rust build of SecantusDB (crate secantus-mdb, binary
# secantusd-rs), which updates documents fast enough for drain figures to
# measure the relay rather than the server; installs it when missing (needs
# Debian's cmake; about four minutes on two cores). Set BENCH_MONGODB_URI to
# measure against another server instead (for example a real replica set).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

ROOT="$(pwd)"
LOG_NAME=bench
# shellcheck source=scripts/common.sh
. scripts/common.sh
RS_PORT="${RS_PORT:-27018}"
scripts/services.sh start   # nats-server and the Rust build (the Python SecantusDB, unused here)
export NATS_URL="${NATS_URL:-nats://127.0.0.1:${NATS_PORT:-4222}}"

server_label="${BENCH_SERVER:-}"
if [ -z "${BENCH_MONGODB_URI:-}" ]; then
  install_secantus_rs
  mkdir -p "$STATE/mongo-rs-data"
  secantusd-rs --host 127.0.0.1 --port "$RS_PORT" --storage-path "$STATE/mongo-rs-data" \
    --cache-size 256M --oplog-max-entries 3000000 >"$STATE/mongo-rs.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
  BENCH_MONGODB_URI="mongodb://127.0.0.1:$RS_PORT"
  server_label="${server_label:-SecantusDB, Rust build (secantus-mdb $SECANTUS_RS_VERSION, cache 256M)}"
  for _ in $(seq 1 150); do
    "$STATE/venv/bin/python" -c "import pymongo,sys; pymongo.MongoClient('$BENCH_MONGODB_URI/?directConnection=true', serverSelectionTimeoutMS=500).admin.command('ping')" \
      >/dev/null 2>&1 && break
    kill -0 $server 2>/dev/null || { cat "$STATE/mongo-rs.log" >&2; exit 1; }
    sleep 0.2
  done
fi

cargo build --release --locked --bin outbox-relay
args=(--mongodb-uri "$BENCH_MONGODB_URI" --nats-url "$NATS_URL" --output bench-results)
[ -n "$server_label" ] && args+=(--server "$server_label")
target/release/outbox-relay bench "${args[@]}" "$@"
