#!/usr/bin/env bash
# Builds the container image outbox-relay:latest and outbox-relay:<version>
# from the Dockerfile, with podman or docker, whichever is present.
#
#   scripts/image.sh             compiles in the Dockerfile's Rust stage
#   scripts/image.sh --offline   no registry: the stripped binary built here
#                                (cargo build --profile dist) and a runtime
#                                base made here from Debian's packages
#                                (mmdebstrap), through the same Dockerfile
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG_NAME=image
# shellcheck source=scripts/common.sh
. "$ROOT/scripts/common.sh"
cd "$ROOT"

offline=false
case "${1:-}" in
  --offline) offline=true ;;
  "") ;;
  *) log "unknown argument $1 (usage: scripts/image.sh [--offline])"; exit 2 ;;
esac

VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)"
REVISION="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
SOURCE="$(git remote get-url origin 2>/dev/null || true)"

# Offline, podman: it imports the base made here, and the image tests
# (tests/image) run its containers; it and runc are installed where missing.
if $offline; then
  missing=()
  for tool in podman runc mmdebstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} from Debian's packages"
    apt_install "${missing[@]}"
  fi
fi
if command -v podman >/dev/null; then
  engine=(podman)
  # crun refuses some hosts' hybrid cgroups; runc, where present, does not.
  if command -v runc >/dev/null; then engine+=(--runtime runc); fi
elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  engine=(docker)
else
  log "neither podman nor a running docker engine is here: install one, or use --offline"
  exit 1
fi

args=(--build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION"
      --build-arg "SOURCE=$SOURCE" -t outbox-relay:latest -t "outbox-relay:$VERSION")
if $offline; then
  BASE=localhost/outbox-relay-base:bookworm
  if ! "${engine[@]}" image exists "$BASE" 2>/dev/null; then
    mkdir -p "$STATE"
    log "making the runtime base $BASE from Debian's packages"
    mmdebstrap --quiet --variant=minbase --include=ca-certificates \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' bookworm "$STATE/image-base.tar"
    "${engine[@]}" import "$STATE/image-base.tar" "$BASE" >/dev/null
    rm -f "$STATE/image-base.tar"
  fi
  log "building the stripped binary"
  cargo build --profile dist --locked --bin outbox-relay
  # The build context takes it from target/dist, wherever cargo builds.
  target_dir="$(cargo metadata --no-deps --format-version 1 |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
  built="$target_dir/dist/outbox-relay"
  if [ "$(realpath "$built")" != "$(realpath -m target/dist/outbox-relay)" ]; then
    mkdir -p target/dist
    cp "$built" target/dist/outbox-relay
  fi
  args+=(--build-arg BINARY=prebuilt --build-arg "RUNTIME_IMAGE=$BASE")
fi
log "building outbox-relay:$VERSION with ${engine[0]}"
"${engine[@]}" build "${args[@]}" .
