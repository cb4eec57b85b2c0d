#!/usr/bin/env bash
# Validates the deployment files offline: the Kubernetes manifests against
# the Kubernetes schemas (strict: an unknown field is an error), the
# Compose file against the Compose specification's schema, and the
# Prometheus alerting rules with promtool (their syntax, then their unit
# tests, deploy/prometheus/alerts.test.yaml). Installs the first two
# validators from PyPI into a virtualenv under .services/, and promtool
# with Debian's prometheus package where it is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOG_NAME=deploy
# shellcheck source=scripts/common.sh
. "$ROOT/scripts/common.sh"
VENV="$STATE/deploy-venv"

if [ ! -x "$VENV/bin/check-jsonschema" ] || [ ! -x "$VENV/bin/kubernetes-validate" ]; then
  log "installing the validators into $VENV"
  pip_install_into "$VENV" 'kubernetes-validate==1.37.0' 'check-jsonschema==0.39.0'
fi

"$VENV/bin/kubernetes-validate" --strict --quiet "$ROOT"/deploy/kubernetes/*.yaml
"$VENV/bin/check-jsonschema" --builtin-schema vendor.compose-spec "$ROOT/deploy/compose.yaml"

command -v promtool >/dev/null || install_prometheus
promtool check rules "$ROOT/deploy/prometheus/alerts.yaml"
promtool test rules "$ROOT/deploy/prometheus/alerts.test.yaml"
