#!/usr/bin/env bash
# `make demo`: start the local stack, build the projector, the gateway and the demo driver,
# run the projector and the gateway in the background on config/demo.toml and the demo's own
# database, and play the scripted session (demo/, `parsley-demo`):
#   1. a payment held until the Kafka transaction holding its order commits;
#   2. read-your-writes through the gateway, a stamped write, a tampered token;
#   3. with the projector stopped, a session's read refused with its gap; served after restart.
# Exits 0 only if every step's expectation held. Kafka and PostgreSQL keep running afterwards;
# the projector and the gateway are stopped on exit, whatever the outcome — unless KEEP=1 and
# every step held: then they keep running (`make down` stops them).
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"

DEMO_DATABASE="parsley_demo"
CONFIG="$PARSLEY_ROOT/config/demo.toml"
PROJECTOR_LOG="$LOG_DIR/demo-projector.log"
GATEWAY_LOG="$LOG_DIR/demo-gateway.log"
SESSION_FILE="$RUN_DIR/demo-session.json"
STOP_TIMEOUT=20     # seconds a service gets to stop after SIGTERM
READY_TIMEOUT_S=90  # seconds the projector and the gateway get to become ready

PROJECTOR_PID=""
GATEWAY_PID=""
STARTED_LOGS=()

demo_say() { printf '[demo] %s\n' "$*"; }

# demo_fail MESSAGE: say what failed, show the tails of the logs of the services this run
# started, exit 1 (the EXIT trap stops them).
demo_fail() { fail_showing demo "$1" "${STARTED_LOGS[@]}"; }
trap 'demo_fail "unexpected failure (exit $?) at ${BASH_SOURCE[0]}:$LINENO: $BASH_COMMAND"' ERR

# stop_service NAME PID: stops parsley-NAME started by this run (lib.sh's terminate).
stop_service() {
    terminate demo "$1" "$2" "$STOP_TIMEOUT"
    rm -f "$RUN_DIR/demo-$1.pid"
}

cleanup() {
    local rc=$?
    trap - ERR
    if [ -n "$GATEWAY_PID$PROJECTOR_PID" ]; then
        demo_say "stopping the gateway and the projector (Kafka and PostgreSQL keep running)"
    fi
    stop_service gateway "$GATEWAY_PID"
    stop_service projector "$PROJECTOR_PID"
    rm -f "$SESSION_FILE"
    exit "$rc"
}
trap cleanup EXIT
trap 'printf "[demo] interrupted\n" >&2; exit 130' INT
trap 'printf "[demo] terminated\n" >&2; exit 143' TERM

# stop_leftover NAME: a projector or gateway an earlier, killed demo left running (named by
# its pid file and recognised by its command line) is stopped; nothing else is touched.
stop_leftover() {
    local name="$1" pidfile="$RUN_DIR/demo-$1.pid" pid cmdline
    [ -s "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    if [ -r "/proc/$pid/cmdline" ]; then
        cmdline="$(tr '\0' ' ' <"/proc/$pid/cmdline")"
        if [[ "$cmdline" == *"parsley-$name"* ]]; then
            demo_say "stopping the $name an earlier demo left running (pid $pid)"
            stop_service "$name" "$pid"
        fi
    fi
    rm -f "$pidfile"
}

# ---- tools ----
if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null 2>&1 || demo_fail "cargo not found: a Rust toolchain is needed to build the demo"
# The bundled librdkafka is built from C sources by its configure script and make.
if ! command -v cc >/dev/null 2>&1 || ! command -v make >/dev/null 2>&1; then
    say "a C compiler and make are needed to build librdkafka"
    apt_install build-essential
fi

t0="$(now_s)"
bash scripts/services.sh up
mkdir -p "$LOG_DIR" "$RUN_DIR"

# One demo at a time: both would use the same gateway port and transactional.id.
exec 9>"$RUN_DIR/demo.lock"
if command -v flock >/dev/null 2>&1; then
    flock -n 9 || demo_fail "another \`make demo\` is running in this clone (lock: $RUN_DIR/demo.lock)"
fi
stop_leftover gateway
stop_leftover projector

demo_say "building parsley-projector, parsley-gateway and parsley-demo (debug profile)"
t1="$(now_s)"
cargo build -p parsley-projector -p parsley-gateway -p parsley-demo
t2="$(now_s)"
BIN="${CARGO_TARGET_DIR:-$PARSLEY_ROOT/target}/debug"

export PARSLEY_CONFIG="$CONFIG"
export PARSLEY_KAFKA_BOOTSTRAP="$KAFKA_BOOTSTRAP"
export PARSLEY_DATABASE_URL="postgres://$PG_USER:$PG_PASSWORD@$PG_HOST:$PG_PORT/$DEMO_DATABASE"
unset PARSLEY_TOKEN_KEYS PARSLEY_TOKEN_KEYS_FILE
export NO_COLOR=1   # plain log files
RUN_ID="$(date +%Y%m%d-%H%M%S)"

# The children never inherit the lock's descriptor (9): only this script holds the lock.
demo() { "$BIN/parsley-demo" "$@" --run "$RUN_ID" 9>&-; }

echo
echo "Parsley demo, run $RUN_ID: model shop in database $DEMO_DATABASE, configuration config/demo.toml"
demo prepare || demo_fail "preparing the topics and the demo database failed"

# A throwaway token key for this session only; never printed, never written to disk.
TOKEN_KEYS="demo:$(head -c 32 /dev/urandom | base64 | tr -d '\n')"

start_projector() {
    local owner="demo-$RUN_ID-$1"
    printf '\n---- %s: parsley-projector run (owner %s) ----\n' "$(date -Is)" "$owner" >>"$PROJECTOR_LOG"
    PARSLEY_OWNER="$owner" "$BIN/parsley-projector" run >>"$PROJECTOR_LOG" 2>&1 9>&- &
    PROJECTOR_PID=$!
    echo "$PROJECTOR_PID" >"$RUN_DIR/demo-projector.pid"
    PROJECTOR_OWNER="$owner"
}

: >"$PROJECTOR_LOG"
: >"$GATEWAY_LOG"
STARTED_LOGS=("$PROJECTOR_LOG" "$GATEWAY_LOG")
start_projector 1
PARSLEY_TOKEN_KEYS="$TOKEN_KEYS" "$BIN/parsley-gateway" >>"$GATEWAY_LOG" 2>&1 9>&- &
GATEWAY_PID=$!
echo "$GATEWAY_PID" >"$RUN_DIR/demo-gateway.pid"
demo_say "started parsley-projector (pid $PROJECTOR_PID, log $PROJECTOR_LOG)"
demo_say "started parsley-gateway (pid $GATEWAY_PID, log $GATEWAY_LOG)"

# Wait for readiness, and stop waiting as soon as either service exits (a port in use, a bad
# configuration): its log says why.
"$BIN/parsley-demo" wait-ready --owner "$PROJECTOR_OWNER" --timeout "$READY_TIMEOUT_S" --run "$RUN_ID" 9>&- &
waiter=$!
while alive "$waiter"; do
    for service in projector gateway; do
        pid="$PROJECTOR_PID"
        [ "$service" = gateway ] && pid="$GATEWAY_PID"
        if ! alive "$pid"; then
            kill -TERM "$waiter" 2>/dev/null || true
            wait "$waiter" 2>/dev/null || true
            rc=0
            wait "$pid" || rc=$?
            if [ "$service" = gateway ]; then GATEWAY_PID=""; else PROJECTOR_PID=""; fi
            demo_fail "parsley-$service exited during start-up (exit status $rc)"
        fi
    done
    sleep 0.2
done
wait "$waiter" || demo_fail "the projector or the gateway did not become ready within ${READY_TIMEOUT_S}s"
t3="$(now_s)"

demo held-effect || demo_fail "part 1 (a held effect released by its cause's commit) did not go as expected"
demo read-your-writes || demo_fail "part 2 (read-your-writes through the gateway) did not go as expected"

echo
demo_say "stopping the projector (SIGTERM) for part 3"
stop_service projector "$PROJECTOR_PID"
PROJECTOR_PID=""
demo outage --state "$SESSION_FILE" || demo_fail "part 3 (a read while the projector is stopped) did not go as expected"
start_projector 2
demo_say "started parsley-projector again (pid $PROJECTOR_PID)"
demo recover --state "$SESSION_FILE" || demo_fail "part 3 (the read after the projector's restart) did not go as expected"
t4="$(now_s)"

echo
if [ "${KEEP:-}" = 1 ]; then
    # Left running for the user (make demo KEEP=1); `make down` stops them.
    demo_say "KEEP=1: parsley-projector (pid $PROJECTOR_PID) and parsley-gateway (pid $GATEWAY_PID) keep running,"
    demo_say "  the gateway at http://127.0.0.1:8780 (admin: http://127.0.0.1:8781/v1/status), model shop on"
    demo_say "  demo.orders and demo.payments; \`make down\` stops them (\`make up\` starts its own, with curl examples)"
else
    demo_say "stopping the gateway and the projector (Kafka and PostgreSQL keep running)"
    stop_service gateway "$GATEWAY_PID"
    stop_service projector "$PROJECTOR_PID"
fi
GATEWAY_PID="" PROJECTOR_PID=""
printf 'make demo: every expectation held. services up %ss, build %ss, start %ss, session %ss; total %ss\n' \
    "$((t1 - t0))" "$((t2 - t1))" "$((t3 - t2))" "$((t4 - t3))" "$((t4 - t0))"
