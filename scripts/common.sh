# Shared by the scripts that install what they need: sourced, not run.
# Each script sets LOG_NAME before sourcing.

log() { printf '%s: %s\n' "${LOG_NAME:-scripts}" "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    log "need root to run: $*"; exit 1; fi
}

# Installs Debian packages, quietly.
apt_install() {
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$@" >/dev/null
}
