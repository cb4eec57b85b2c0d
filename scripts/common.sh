# Shared by the scripts that install what they need: sourced, not run.
# Each script sets ROOT (the checkout) and LOG_NAME before sourcing.

# Where the local services and the tools keep their state.
STATE="${OUTBOX_SERVICES_DIR:-$ROOT/.services}"
# The services' virtualenv: SecantusDB, and pymongo with it.
SERVICES_VENV="$STATE/venv"

log() { printf '%s: %s\n' "${LOG_NAME:-scripts}" "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    log "need root to run: $*"; exit 1; fi
}

# Installs Debian packages, quietly. (The variable goes through env, which
# sudo would drop.)
apt_install() {
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Makes a Python virtualenv at $1 and installs the rest of the arguments
# into it with pip (Debian's python3-venv first, where venv is missing).
pip_install_into() {
  local venv="$1"
  shift
  mkdir -p "$(dirname "$venv")"
  if ! python3 -m venv "$venv" 2>/dev/null; then
    apt_install python3-venv
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install -q --disable-pip-version-check "$@"
}

# SecantusDB's Rust build (crate secantus-mdb, binary secantusd-rs): the
# benchmark's server, and the one the inbox's crash test starts, since it
# ends a dead client's open transaction after 60 s as MongoDB does (the
# Python build never does while a write waits on it). Installed with cargo
# when missing or of another version: needs Debian's cmake, and takes
# about four minutes on two cores.
SECANTUS_RS_VERSION="0.5.3-beta.193"
install_secantus_rs() {
  if command -v secantusd-rs >/dev/null \
    && secantusd-rs --version 2>/dev/null | grep -qF "$SECANTUS_RS_VERSION"; then
    return
  fi
  log "installing SecantusDB's Rust build (secantus-mdb $SECANTUS_RS_VERSION)"
  command -v cmake >/dev/null || apt_install cmake
  cargo install secantus-mdb --version "$SECANTUS_RS_VERSION" --ignore-rust-version --locked
}

# Debian's Prometheus (2.42), with promtool: validate-deploy.sh checks and
# unit-tests the alerting rules with promtool, and the end-to-end test of
# the rules and the dashboard (tests/servers/prometheus.rs) starts a
# Prometheus of its own on a free port. No daemon is wanted: the package
# is installed with services barred from starting (policy-rc.d, where none
# bars them already), and one systemd started anyway is stopped and
# disabled.
install_prometheus() {
  command -v prometheus >/dev/null && command -v promtool >/dev/null && return
  log "installing Prometheus from Debian's packages"
  local policy=/usr/sbin/policy-rc.d barred=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee "$policy" >/dev/null
    as_root chmod +x "$policy"
    barred=yes
  fi
  apt_install --no-install-recommends prometheus
  if [ -n "$barred" ]; then as_root rm -f "$policy"; fi
  if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
    as_root systemctl disable --now prometheus
  fi
  if command -v update-rc.d >/dev/null && [ -e /etc/init.d/prometheus ]; then
    as_root update-rc.d prometheus disable >/dev/null 2>&1 || true
  fi
}
