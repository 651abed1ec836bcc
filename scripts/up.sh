#!/usr/bin/env bash
# scripts/up.sh up|down|status: leave a projector and a gateway running in the background on
# the local stack, to try the HTTP API by hand (`make up`, `make down`).
#
# up:     starts Kafka and PostgreSQL (scripts/services.sh), builds parsley-projector,
#         parsley-gateway and parsley-demo, creates the topics local.orders and local.payments
#         (4 partitions each) and the database parsley_local (config/local.toml), starts the
#         projector and the gateway detached from this shell, waits until the gateway is ready
#         and the projector holds every task, and prints curl examples: a write, a read with
#         the returned token, and a 503 while the projector is frozen.
#         The token key and the admin token are made once and kept in .local/run/ (mode 600),
#         so tokens stay valid across `make down` and `make up`.
# down:   stops them (SIGTERM, then SIGKILL after 20 s) — and a projector and gateway that
#         `make demo KEEP=1` left running. Kafka and PostgreSQL keep running
#         (`make services-down` stops them).
# status: says which are running.
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"

CONFIG="$PARSLEY_ROOT/config/local.toml"
DATABASE="parsley_local"
STOP_TIMEOUT=20
READY_TIMEOUT_S=90
GATEWAY_URL="http://127.0.0.1:8080"
ADMIN_URL="http://127.0.0.1:9091"

up_say() { printf '[up] %s\n' "$*"; }
up_fail() { fail_showing up "$1" "$LOG_DIR/up-projector.log" "$LOG_DIR/up-gateway.log"; }

# running PIDFILE NAME / stop PIDFILE NAME: lib.sh's running_binary / stop_binary for
# parsley-NAME.
running() { running_binary "$1" "parsley-$2"; }
stop() { stop_binary up "$1" "parsley-$2" "$STOP_TIMEOUT"; }

cmd_up() {
    if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    command -v cargo >/dev/null 2>&1 || up_fail "cargo not found"
    bash scripts/services.sh up
    mkdir -p "$LOG_DIR" "$RUN_DIR"
    if running "$RUN_DIR/up-gateway.pid" gateway >/dev/null && running "$RUN_DIR/up-projector.pid" projector >/dev/null; then
        up_say "already running (make down stops them)"
        examples
        return
    fi
    stop "$RUN_DIR/up-gateway.pid" gateway
    stop "$RUN_DIR/up-projector.pid" projector

    up_say "building parsley-projector, parsley-gateway and parsley-demo (debug profile)"
    cargo build -q -p parsley-projector -p parsley-gateway -p parsley-demo
    local bin="${CARGO_TARGET_DIR:-$PARSLEY_ROOT/target}/debug"

    local_binaries_env "$CONFIG" "$DATABASE"
    "$bin/parsley-demo" prepare --run local >"$LOG_DIR/up-prepare.log" 2>&1 ||
        up_fail "preparing the topics and the database failed (log: $LOG_DIR/up-prepare.log)"

    local keys="$RUN_DIR/up-token-keys" admin="$RUN_DIR/up-admin-token"
    token_keys_file "$keys" local
    kept_secret "$admin" 24

    local owner
    owner="local-$(hostname)-$$"
    printf '\n---- %s: parsley-projector run (owner %s) ----\n' "$(date -Is)" "$owner" >>"$LOG_DIR/up-projector.log"
    PARSLEY_OWNER="$owner" setsid nohup "$bin/parsley-projector" run \
        >>"$LOG_DIR/up-projector.log" 2>&1 </dev/null &
    echo $! >"$RUN_DIR/up-projector.pid"
    printf '\n---- %s: parsley-gateway ----\n' "$(date -Is)" >>"$LOG_DIR/up-gateway.log"
    PARSLEY_TOKEN_KEYS_FILE="$keys" PARSLEY_GATEWAY_ADMIN_TOKEN="$(cat "$admin")" setsid nohup "$bin/parsley-gateway" \
        >>"$LOG_DIR/up-gateway.log" 2>&1 </dev/null &
    echo $! >"$RUN_DIR/up-gateway.pid"

    "$bin/parsley-demo" wait-ready --owner "$owner" --timeout "$READY_TIMEOUT_S" --run local \
        >>"$LOG_DIR/up-prepare.log" 2>&1 &
    local waiter=$!
    while alive "$waiter"; do
        running "$RUN_DIR/up-projector.pid" projector >/dev/null || {
            kill -TERM "$waiter" 2>/dev/null || true
            stop "$RUN_DIR/up-gateway.pid" gateway
            up_fail "parsley-projector exited during start-up (log: $LOG_DIR/up-projector.log)"
        }
        running "$RUN_DIR/up-gateway.pid" gateway >/dev/null || {
            kill -TERM "$waiter" 2>/dev/null || true
            stop "$RUN_DIR/up-projector.pid" projector
            up_fail "parsley-gateway exited during start-up (log: $LOG_DIR/up-gateway.log)"
        }
        sleep 0.2
    done
    wait "$waiter" || up_fail "the projector or the gateway did not become ready within ${READY_TIMEOUT_S}s"
    up_say "parsley-projector (pid $(cat "$RUN_DIR/up-projector.pid"), log $LOG_DIR/up-projector.log)"
    up_say "parsley-gateway   (pid $(cat "$RUN_DIR/up-gateway.pid"), log $LOG_DIR/up-gateway.log) at $GATEWAY_URL"
    examples
}

examples() {
    cat <<EXAMPLES

Model shop (config/local.toml, database $DATABASE): local.orders replace a document,
local.payments merge into it. Try:

  # 1. Write an order; the answer's Parsley-Session header is your session token.
  TOKEN=\$(curl -s -D - -o /dev/null -X POST $GATEWAY_URL/v1/topics/local.orders/records \\
      -H 'content-type: application/json' -d '{"key": "o-1", "value": {"item": "teapot", "total": 30}}' \\
      | tr -d '\r' | sed -n 's/^parsley-session: //Ip')

  # 2. Read it back with the token: served only once the read model covers your write.
  curl -s -H "Parsley-Session: \$TOKEN" $GATEWAY_URL/v1/models/shop/documents/o-1; echo

  # 3. A payment written with the token carries the order as its cause.
  curl -s -X POST $GATEWAY_URL/v1/topics/local.payments/records -H "Parsley-Session: \$TOKEN" \\
      -H 'content-type: application/json' -d '{"key": "o-1", "value": {"paid": 30}}'; echo

  # 4. Freeze the projector, write, and read: 503 with the gap and Retry-After, never stale.
  kill -STOP \$(cat $RUN_DIR/up-projector.pid)
  TOKEN=\$(curl -s -D - -o /dev/null -X POST $GATEWAY_URL/v1/topics/local.orders/records \\
      -H 'content-type: application/json' -d '{"key": "o-2", "value": {"item": "mug"}}' \\
      | tr -d '\r' | sed -n 's/^parsley-session: //Ip')
  curl -si -H "Parsley-Session: \$TOKEN" $GATEWAY_URL/v1/models/shop/documents/o-2; echo
  kill -CONT \$(cat $RUN_DIR/up-projector.pid)   # and the same read is served

  # What the projector is doing (admin listener, loopback only):
  curl -s $ADMIN_URL/v1/status; echo

make down stops the projector and the gateway; make services-down stops Kafka and PostgreSQL.
EXAMPLES
}

cmd_down() {
    mkdir -p "$RUN_DIR"
    stop "$RUN_DIR/up-gateway.pid" gateway
    stop "$RUN_DIR/up-projector.pid" projector
    stop "$RUN_DIR/demo-gateway.pid" gateway
    stop "$RUN_DIR/demo-projector.pid" projector
}

cmd_status() {
    local name pid
    for name in projector gateway; do
        if pid="$(running "$RUN_DIR/up-$name.pid" "$name")"; then
            up_say "parsley-$name: running (pid $pid)"
        else
            up_say "parsley-$name: stopped"
        fi
    done
}

case "${1:-}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    *) up_fail "usage: scripts/up.sh up|down|status" ;;
esac
