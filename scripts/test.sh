#!/usr/bin/env bash
# Runs every check CI runs: services, formatting, lints, and all tests
# against the real servers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/services.sh start
scripts/writers.sh
scripts/validate-deploy.sh
export MONGODB_URI="${MONGODB_URI:-mongodb://127.0.0.1:${MONGO_PORT:-27017}}"
export NATS_URL="${NATS_URL:-nats://127.0.0.1:${NATS_PORT:-4222}}"
# The Rust build of SecantusDB, which services.sh installed: tests that
# need a dead client's transaction to end start a private one.
export SECANTUSD_RS="${SECANTUSD_RS:-$(command -v secantusd-rs)}"

rustup component list --installed 2>/dev/null | grep -q rustfmt || rustup component add rustfmt
rustup component list --installed 2>/dev/null | grep -q clippy || rustup component add clippy

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
# The library as a service embeds it: without the command line or the benchmark.
cargo clippy --lib --no-default-features --locked -- -D warnings
# The image's tests are not among --all-targets (they need the image).
cargo clippy --test image --locked -- -D warnings
rm -f target/fault-report.jsonl
cargo test --all-targets --locked
# README's Rust snippets and the rustdoc examples.
cargo test --doc --locked
# The container image, built here without a registry, run as users run it.
scripts/image.sh --offline
cargo test --test image --locked
if [ -f target/fault-report.jsonl ]; then
  echo "fault and operations figures (tests/faults.rs, tests/failpoints/, tests/operations.rs):"
  cat target/fault-report.jsonl
fi
