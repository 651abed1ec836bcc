#!/usr/bin/env bash
# `make kubernetes-check` (and a phase of `make test`): the manifests of deploy/kubernetes/
# validated against the Kubernetes API's schemas, then held to the house rules a schema
# cannot state (scripts/kubernetes-policy.py). Both checks prove they can fail: a manifest
# with a misspelt field must be refused by the schema validator, and each rule broken in a
# copy must be reported by the policy check.
#
# The validator is kubernetes-validate (PyPI; it ships the API's JSON schemas for each
# Kubernetes version, so nothing is fetched at run time), installed into
# .local/kubernetes-venv on first use. With KUBERNETES_CHECK_OPTIONAL=1 (`make test` on a
# developer's machine; never in CI) a failed install is a warning, not a failure.
#   KUBERNETES_VERSION=<x.y.z>   the API version validated against (default: the validator's)
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"

VALIDATE_VERSION="1.37.0"
VENV="$LOCAL_DIR/kubernetes-venv"
MANIFESTS=(deploy/kubernetes/*.yaml)

k8s_say() { printf '[kubernetes] %s\n' "$*"; }

if ! "$VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -qx "$VALIDATE_VERSION"; then
    mkdir -p "$LOG_DIR"
    k8s_say "installing kubernetes-validate $VALIDATE_VERSION into $VENV (log: $LOG_DIR/kubernetes-install.log)"
    if ! { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "kubernetes-validate==$VALIDATE_VERSION"; } \
        >"$LOG_DIR/kubernetes-install.log" 2>&1; then
        if [ "${KUBERNETES_CHECK_OPTIONAL:-0}" = 1 ]; then
            warn "SKIPPED the Kubernetes manifests' check: kubernetes-validate could not be installed (no Python 3 venv or no PyPI?); see $LOG_DIR/kubernetes-install.log (in CI this fails the run)"
            exit 0
        fi
        fail "installing kubernetes-validate failed" "$LOG_DIR/kubernetes-install.log"
    fi
fi

version=()
[ -n "${KUBERNETES_VERSION:-}" ] && version=(--kubernetes-version "$KUBERNETES_VERSION")
k8s_say "validating ${MANIFESTS[*]} (strict: unknown fields refused)"
"$VENV/bin/kubernetes-validate" --strict "${version[@]}" "${MANIFESTS[@]}" ||
    fail "the Kubernetes manifests do not validate"

# The validator must refuse what is wrong: the gateway's Deployment with a misspelt field.
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
sed 's/terminationGracePeriodSeconds:/terminationGracePeriodSecond:/' deploy/kubernetes/gateway.yaml >"$scratch/broken.yaml"
if "$VENV/bin/kubernetes-validate" --strict --quiet "${version[@]}" "$scratch/broken.yaml" >/dev/null 2>&1; then
    fail "kubernetes-validate accepted a Deployment with a misspelt field: the check cannot fail"
fi

"$VENV/bin/python" scripts/kubernetes-policy.py --self-test "${MANIFESTS[@]}" ||
    fail "the Kubernetes manifests break the house rules (scripts/kubernetes-policy.py)"
k8s_say "the manifests validate and follow the rules"
