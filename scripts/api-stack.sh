#!/usr/bin/env bash
# scripts/api-stack.sh COMMAND [ARG...]: run COMMAND against a real gateway.
#
# Starts the local stack (Kafka, PostgreSQL), builds parsley-projector, parsley-gateway and
# parsley-demo (for `prepare` and `wait-ready`), creates the topics api.orders and
# api.payments and the database parsley_api (config/api.toml), runs a projector and a gateway
# on them in the background, waits until the gateway is ready and the projector holds every
# task, then runs COMMAND with:
#   PARSLEY_API_URL          the gateway's main listener (http://127.0.0.1:8790)
#   PARSLEY_API_ADMIN_URL    its admin listener
#   PARSLEY_API_ADMIN_TOKEN  the admin token of this run (admin routes on the main listener)
#   PARSLEY_API_MODEL, PARSLEY_API_ORDERS, PARSLEY_API_PAYMENTS  the model and its topics
# The projector and the gateway are stopped on exit, whatever the outcome; Kafka and
# PostgreSQL keep running. Exit status: COMMAND's (1 when the stack could not start).
# Used by scripts/api-fuzz.sh and clients/typescript's tests (scripts/client-tests.sh).
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"

[ "$#" -ge 1 ] || fail "usage: scripts/api-stack.sh COMMAND [ARG...]"

API_DATABASE="parsley_api"
CONFIG="$PARSLEY_ROOT/config/api.toml"
PROJECTOR_LOG="$LOG_DIR/api-projector.log"
GATEWAY_LOG="$LOG_DIR/api-gateway.log"
STOP_TIMEOUT=20
READY_TIMEOUT_S=90

PROJECTOR_PID=""
GATEWAY_PID=""

api_say() { printf '[api-stack] %s\n' "$*"; }

api_fail() { fail_showing api-stack "$1" "$PROJECTOR_LOG" "$GATEWAY_LOG"; }
trap 'api_fail "unexpected failure (exit $?) at ${BASH_SOURCE[0]}:$LINENO: $BASH_COMMAND"' ERR

# stop_service NAME PID: stops parsley-NAME started by this run (lib.sh's terminate).
stop_service() {
    terminate api-stack "$1" "$2" "$STOP_TIMEOUT"
    rm -f "$RUN_DIR/api-$1.pid"
}

cleanup() {
    local rc=$?
    trap - ERR
    stop_service gateway "$GATEWAY_PID"
    stop_service projector "$PROJECTOR_PID"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A projector or gateway an earlier, killed run left behind (named by its pid file and
# recognised by its command line) is stopped; nothing else is touched.
stop_leftover() {
    local name="$1" pidfile="$RUN_DIR/api-$1.pid" pid
    [ -s "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    if [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "parsley-$name"; then
        api_say "stopping the $name an earlier run left running (pid $pid)"
        stop_service "$name" "$pid"
    fi
    rm -f "$pidfile"
}

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null 2>&1 || api_fail "cargo not found"

bash scripts/services.sh up >/dev/null
mkdir -p "$LOG_DIR" "$RUN_DIR"
exec 8>"$RUN_DIR/api-stack.lock"
if command -v flock >/dev/null 2>&1; then
    flock -n 8 || api_fail "another scripts/api-stack.sh runs in this clone (lock: $RUN_DIR/api-stack.lock)"
fi
stop_leftover gateway
stop_leftover projector

api_say "building parsley-projector, parsley-gateway and parsley-demo"
cargo build -q -p parsley-projector -p parsley-gateway -p parsley-demo
BIN="${CARGO_TARGET_DIR:-$PARSLEY_ROOT/target}/debug"

export PARSLEY_CONFIG="$CONFIG"
export PARSLEY_KAFKA_BOOTSTRAP="$KAFKA_BOOTSTRAP"
export PARSLEY_DATABASE_URL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$API_DATABASE"
unset PARSLEY_TOKEN_KEYS_FILE DATABASE_URL
export NO_COLOR=1
RUN_ID="api-$(date +%Y%m%d-%H%M%S)"
OWNER="$RUN_ID-projector"

"$BIN/parsley-demo" prepare --run "$RUN_ID" 8>&- >"$LOG_DIR/api-prepare.log" 2>&1 ||
    api_fail "preparing the topics and the database failed (log: $LOG_DIR/api-prepare.log)"

# A throwaway token key and admin token for this run only; never written to disk.
TOKEN_KEYS="api:$(head -c 32 /dev/urandom | base64 | tr -d '\n')"
ADMIN_TOKEN="$(head -c 24 /dev/urandom | base64 | tr -d '\n/+=')"

: >"$PROJECTOR_LOG"
: >"$GATEWAY_LOG"
PARSLEY_OWNER="$OWNER" "$BIN/parsley-projector" run >>"$PROJECTOR_LOG" 2>&1 8>&- &
PROJECTOR_PID=$!
echo "$PROJECTOR_PID" >"$RUN_DIR/api-projector.pid"
PARSLEY_TOKEN_KEYS="$TOKEN_KEYS" PARSLEY_GATEWAY_ADMIN_TOKEN="$ADMIN_TOKEN" \
    "$BIN/parsley-gateway" >>"$GATEWAY_LOG" 2>&1 8>&- &
GATEWAY_PID=$!
echo "$GATEWAY_PID" >"$RUN_DIR/api-gateway.pid"

"$BIN/parsley-demo" wait-ready --owner "$OWNER" --timeout "$READY_TIMEOUT_S" --run "$RUN_ID" 8>&- \
    >>"$LOG_DIR/api-prepare.log" 2>&1 &
waiter=$!
while alive "$waiter"; do
    for pid in "$PROJECTOR_PID" "$GATEWAY_PID"; do
        if ! alive "$pid"; then
            kill -TERM "$waiter" 2>/dev/null || true
            api_fail "the projector or the gateway exited during start-up"
        fi
    done
    sleep 0.2
done
wait "$waiter" || api_fail "the projector or the gateway did not become ready within ${READY_TIMEOUT_S}s"
api_say "gateway ready at http://127.0.0.1:8790 (projector pid $PROJECTOR_PID, gateway pid $GATEWAY_PID; logs in $LOG_DIR/api-*.log)"

export PARSLEY_API_URL="http://127.0.0.1:8790"
export PARSLEY_API_ADMIN_URL="http://127.0.0.1:8791"
export PARSLEY_API_ADMIN_TOKEN="$ADMIN_TOKEN"
export PARSLEY_API_MODEL="shop" PARSLEY_API_ORDERS="api.orders" PARSLEY_API_PAYMENTS="api.payments"
rc=0
"$@" 8>&- || rc=$?
if ! alive "$GATEWAY_PID"; then
    GATEWAY_PID=""
    api_fail "the gateway died while the command ran"
fi
exit "$rc"
