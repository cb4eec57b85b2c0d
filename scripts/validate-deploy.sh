#!/usr/bin/env bash
# Validates the deployment files offline: the Kubernetes manifests against
# the Kubernetes schemas (strict: an unknown field is an error), and the
# Compose file against the Compose specification's schema. Installs both
# validators from PyPI into a virtualenv under .services/.
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
