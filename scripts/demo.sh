#!/usr/bin/env bash
# Starts the local services and the relay, writes orders with their outbox
# messages for ~10 s, and prints what arrives on NATS with a latency summary
# (examples/demo.rs); then a consumer applies the orders to a projection
# through the inbox, and the whole stream is delivered to it a second time,
# which changes nothing (examples/consumer.rs). Last, the orders are
# replayed into a new stream (outbox-relay replay), and a new consumer
# builds its own projection from them.
#
#   scripts/demo.sh            (DEMO_RATE=300 DEMO_SECONDS=10 by default)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/services.sh start
export MONGODB_URI="${MONGODB_URI:-mongodb://127.0.0.1:${MONGO_PORT:-27017}}"
export NATS_URL="${NATS_URL:-nats://127.0.0.1:${NATS_PORT:-4222}}"
export DEMO_DATABASE="${DEMO_DATABASE:-demo}" DEMO_PREFIX="${DEMO_PREFIX:-demo}"

cargo build --release --locked --bin outbox-relay --example demo --example consumer
mkdir -p .services
target/release/outbox-relay run --mongodb-uri "$MONGODB_URI" --database "$DEMO_DATABASE" \
  --nats-url "$NATS_URL" --subject-prefix "$DEMO_PREFIX" --create-stream DEMO \
  >.services/demo-relay.log 2>&1 &
relay=$!
trap 'kill -TERM $relay 2>/dev/null; wait $relay 2>/dev/null || true' EXIT

# Wait for the relay to report that it is tailing (or to die trying).
for _ in $(seq 1 100); do
  grep -q "relay running" .services/demo-relay.log && break
  kill -0 $relay 2>/dev/null || { cat .services/demo-relay.log; exit 1; }
  sleep 0.1
done
echo "relay running (log: .services/demo-relay.log)"
target/release/examples/demo
echo
echo "consumer: applying the orders to a projection through the inbox"
DEMO_STREAM=DEMO target/release/examples/consumer
echo
echo "replay: the orders sent again into a stream of their own, for a new consumer"
target/release/outbox-relay replay --mongodb-uri "$MONGODB_URI" --database "$DEMO_DATABASE" \
  --nats-url "$NATS_URL" --subject-prefix "$DEMO_PREFIX" --type order.placed \
  --replay-prefix "${DEMO_PREFIX}_replay" --allow-subject "${DEMO_PREFIX}_replay.>" \
  --create-stream DEMO_REPLAY --log-format text 2>.services/demo-replay.log
DEMO_STREAM=DEMO_REPLAY DEMO_CONSUMER=rebuild \
  DEMO_SUBJECT="${DEMO_PREFIX}_replay.${DEMO_PREFIX}.order.placed" target/release/examples/consumer
