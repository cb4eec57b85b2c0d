#!/usr/bin/env bash
# Installs what the writers in other languages (examples/writers/) need to
# run and be tested: Node.js and npm from Debian's packages where missing,
# the Node writer's locked dependencies, and pymongo in the services'
# virtualenv (scripts/services.sh makes it).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

LOG_NAME=writers
# shellcheck source=scripts/common.sh
. "$ROOT/scripts/common.sh"
VENV="$SERVICES_VENV"

missing=()
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]} from Debian's packages"
  apt_install "${missing[@]}"
fi

node_major="$(node -p 'process.versions.node.split(".")[0]')"
if [ "$node_major" -lt 18 ]; then
  log "Node.js $(node --version) is too old for the Node.js writer: it needs 18 or later"
  exit 1
fi

NODE_DIR="$ROOT/examples/writers/node"
STAMP="$NODE_DIR/node_modules/.installed-from-lock"
if ! cmp -s "$NODE_DIR/package-lock.json" "$STAMP" 2>/dev/null; then
  log "installing the Node.js writer's dependencies"
  npm ci --prefix "$NODE_DIR" --no-audit --no-fund --loglevel=error >/dev/null
  cp "$NODE_DIR/package-lock.json" "$STAMP"
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "no virtualenv at $VENV: run scripts/services.sh start first"
  exit 1
fi
if ! "$VENV/bin/python" -c 'import pymongo' 2>/dev/null; then
  log "installing pymongo into $VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check 'pymongo>=4.6,<5'
fi
