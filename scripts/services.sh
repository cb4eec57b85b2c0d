#!/usr/bin/env bash
# Local MongoDB-compatible server (SecantusDB) and nats-server with JetStream.
#
#   scripts/services.sh [start|stop|status]     (default: start)
#
# Idempotent: installs what is missing (Debian's nats-server, SecantusDB from
# PyPI in a venv under .services/, SecantusDB's Rust build, which tests
# and the benchmark start on their own ports, and Debian's Prometheus, which
# tests start on their own ports too), starts what is not running,
# and waits until both answer. Ports: MONGO_PORT (27017) and NATS_PORT (4222).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MONGO_PORT="${MONGO_PORT:-27017}"
NATS_PORT="${NATS_PORT:-4222}"
SECANTUS_VERSION="0.7.0b3"

LOG_NAME=services
# shellcheck source=scripts/common.sh
. "$ROOT/scripts/common.sh"
VENV="$SERVICES_VENV"

install_nats() {
  command -v nats-server >/dev/null && return
  log "installing nats-server from Debian's packages"
  apt_install nats-server
}

install_secantus() {
  [ -x "$VENV/bin/secantusd-py" ] && return
  log "installing SecantusDB $SECANTUS_VERSION into $VENV"
  pip_install_into "$VENV" "SecantusDB==$SECANTUS_VERSION"
}

# The CloudEvents Python SDK and a JSON Schema validator that checks
# formats, which tests/cloudevents/read.py reads the relay's events with.
EVENT_READERS=(cloudevents==2.2.0 jsonschema==4.26.0 rfc3339-validator==0.1.4 rfc3986-validator==0.1.1)
install_event_readers() {
  "$VENV/bin/python" -c "import cloudevents.core, jsonschema, rfc3339_validator, rfc3986_validator" \
    2>/dev/null && return
  log "installing the CloudEvents SDK into $VENV"
  pip_install_into "$VENV" "${EVENT_READERS[@]}"
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

mongo_answers() {
  "$VENV/bin/python" - "$MONGO_PORT" <<'PY' >/dev/null 2>&1
import sys, pymongo
client = pymongo.MongoClient(f"mongodb://127.0.0.1:{sys.argv[1]}/?directConnection=true",
                             serverSelectionTimeoutMS=1000)
assert client.admin.command("hello").get("setName")
PY
}

nats_answers() {
  timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$NATS_PORT && head -c 4 <&3 | grep -q INFO" 2>/dev/null
}

wait_for() {
  local name="$1" check="$2" logfile="$3"
  for _ in $(seq 1 150); do
    if "$check"; then return 0; fi
    sleep 0.2
  done
  log "$name did not answer within 30 s; its log ($logfile) ends with:"
  tail -n 20 "$logfile" >&2 || true
  exit 1
}

start() {
  install_nats
  install_secantus
  install_event_readers
  install_secantus_rs
  install_prometheus
  mkdir -p "$STATE/mongo-data" "$STATE/nats-data"
  if alive "$STATE/mongo.pid" && mongo_answers; then
    log "SecantusDB already running on 127.0.0.1:$MONGO_PORT"
  else
    log "starting SecantusDB on 127.0.0.1:$MONGO_PORT"
    nohup "$VENV/bin/secantusd-py" --host 127.0.0.1 --port "$MONGO_PORT" \
      --storage-path "$STATE/mongo-data" >"$STATE/mongo.log" 2>&1 &
    echo $! >"$STATE/mongo.pid"
  fi
  if alive "$STATE/nats.pid" && nats_answers; then
    log "nats-server already running on 127.0.0.1:$NATS_PORT"
  else
    log "starting nats-server with JetStream on 127.0.0.1:$NATS_PORT"
    nohup nats-server -a 127.0.0.1 -p "$NATS_PORT" -js -sd "$STATE/nats-data" \
      >"$STATE/nats.log" 2>&1 &
    echo $! >"$STATE/nats.pid"
  fi
  wait_for SecantusDB mongo_answers "$STATE/mongo.log"
  wait_for nats-server nats_answers "$STATE/nats.log"
  log "ready: MONGODB_URI=mongodb://127.0.0.1:$MONGO_PORT NATS_URL=nats://127.0.0.1:$NATS_PORT"
}

stop_one() {
  local name="$1" pidfile="$2"
  if alive "$pidfile"; then
    local pid; pid="$(cat "$pidfile")"
    kill "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    log "stopped $name"
  fi
  rm -f "$pidfile"
}

status() {
  local rc=0
  if alive "$STATE/mongo.pid" && mongo_answers; then log "SecantusDB: running on $MONGO_PORT"; else log "SecantusDB: not running"; rc=1; fi
  if alive "$STATE/nats.pid" && nats_answers; then log "nats-server: running on $NATS_PORT"; else log "nats-server: not running"; rc=1; fi
  return $rc
}

case "${1:-start}" in
  start) start ;;
  stop) stop_one SecantusDB "$STATE/mongo.pid"; stop_one nats-server "$STATE/nats.pid" ;;
  status) status ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac
