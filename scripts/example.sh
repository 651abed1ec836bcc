#!/usr/bin/env bash
# scripts/example.sh up NAME | down | status: run one of examples/ by hand on the local stack
# (`make example NAME=order-totals`, `make example-down`).
#
# up NAME: starts Kafka and PostgreSQL (scripts/services.sh), builds what the example runs
#          (parsley-projector, or the example's own binary, and parsley-gateway), creates its
#          topics when missing (4 partitions, `parsley-projector create-topics`) and the
#          database parsley_examples, starts its projector and a gateway on its configuration
#          detached from this shell (gateway at 127.0.0.1:8080), waits until the gateway is
#          ready, and prints curl examples. Logs in .local/logs/example-*.log.
# down:    stops them (SIGTERM, then SIGKILL after 20 s). Kafka and PostgreSQL keep running.
# status:  says which are running.
#
# One example at a time, and not beside `make up` (they share the gateway's ports).
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$PARSLEY_ROOT"

DATABASE="parsley_examples"
STOP_TIMEOUT=20
READY_TIMEOUT_S=90
GATEWAY_URL="http://127.0.0.1:8080"
PROJECTOR_PID="$RUN_DIR/example-projector.pid"
GATEWAY_PID="$RUN_DIR/example-gateway.pid"

ex_say() { printf '[example] %s\n' "$*"; }
ex_fail() { fail_showing example "$1" "$LOG_DIR/example-projector.log" "$LOG_DIR/example-gateway.log"; }

# The examples: a folder of examples/ with a parsley.toml, and the binary running its model.
projector_binary() {
    case "$1" in
        order-totals) echo parsley-projector ;;
        custom-projection) echo custom-projection ;;
        *)
            printf '[example] FAILED: no example named %s: NAME=order-totals or NAME=custom-projection\n' "${1:-(none)}" >&2
            exit 1
            ;;
    esac
}

stop_all() {
    local binary
    for binary in parsley-projector custom-projection; do
        if running_binary "$PROJECTOR_PID" "$binary" >/dev/null; then
            stop_binary example "$PROJECTOR_PID" "$binary" "$STOP_TIMEOUT"
        fi
    done
    rm -f "$PROJECTOR_PID"
    stop_binary example "$GATEWAY_PID" parsley-gateway "$STOP_TIMEOUT"
}

cmd_up() {
    local name="$1" binary config
    projector_binary "$name" >/dev/null
    binary="$(projector_binary "$name")"
    config="examples/$name/parsley.toml"
    if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    fi
    command -v cargo >/dev/null 2>&1 || ex_fail "cargo not found"
    bash scripts/services.sh up
    mkdir -p "$LOG_DIR" "$RUN_DIR"
    stop_all

    ex_say "building parsley-projector, parsley-gateway and the examples (debug profile)"
    cargo build -q -p parsley-projector -p parsley-gateway -p parsley-examples
    local bin="${CARGO_TARGET_DIR:-$PARSLEY_ROOT/target}/debug"

    local_binaries_env "$config" "$DATABASE"

    PGPASSWORD="$PG_PASSWORD" psql -X -q -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d "$PG_DB" -v ON_ERROR_STOP=1 \
        >"$LOG_DIR/example-prepare.log" 2>&1 <<SQL ||
SELECT 'CREATE DATABASE $DATABASE' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '$DATABASE')\gexec
SQL
        ex_fail "creating the database $DATABASE failed (log: $LOG_DIR/example-prepare.log)"
    "$bin/parsley-projector" create-topics --partitions 4 | tee -a "$LOG_DIR/example-prepare.log" |
        sed 's/^/[example] /' || ex_fail "creating the topics failed (log: $LOG_DIR/example-prepare.log)"

    local keys="$RUN_DIR/example-token-keys"
    token_keys_file "$keys" example
    printf '\n---- %s: %s run (%s) ----\n' "$(date -Is)" "$binary" "$config" >>"$LOG_DIR/example-projector.log"
    local run=(run) # the example's own binary runs its model without a subcommand
    [ "$binary" = parsley-projector ] || run=()
    PARSLEY_OWNER="example-$(hostname)-$$" setsid nohup "$bin/$binary" --config "$config" "${run[@]}" \
        >>"$LOG_DIR/example-projector.log" 2>&1 </dev/null &
    echo $! >"$PROJECTOR_PID"
    printf '\n---- %s: parsley-gateway (%s) ----\n' "$(date -Is)" "$config" >>"$LOG_DIR/example-gateway.log"
    PARSLEY_TOKEN_KEYS_FILE="$keys" setsid nohup "$bin/parsley-gateway" --config "$config" \
        >>"$LOG_DIR/example-gateway.log" 2>&1 </dev/null &
    echo $! >"$GATEWAY_PID"

    local deadline=$(($(now_s) + READY_TIMEOUT_S))
    until curl -fsS -o /dev/null "$GATEWAY_URL/readyz" 2>/dev/null; do
        running_binary "$PROJECTOR_PID" "$binary" >/dev/null || {
            stop_all
            ex_fail "$binary exited during start-up (log: $LOG_DIR/example-projector.log)"
        }
        running_binary "$GATEWAY_PID" parsley-gateway >/dev/null || {
            stop_all
            ex_fail "parsley-gateway exited during start-up (log: $LOG_DIR/example-gateway.log)"
        }
        [ "$(now_s)" -lt "$deadline" ] || {
            stop_all
            ex_fail "the gateway was not ready within ${READY_TIMEOUT_S}s"
        }
        sleep 0.3
    done
    ex_say "$binary (pid $(cat "$PROJECTOR_PID"), log $LOG_DIR/example-projector.log)"
    ex_say "parsley-gateway (pid $(cat "$GATEWAY_PID"), log $LOG_DIR/example-gateway.log) at $GATEWAY_URL"
    usage "$name"
}

usage() {
    local query
    case "$1" in
        order-totals) query="totals/queries/customer_total?customer=ada" ;;
        custom-projection) query="order-events/queries/events?customer=ada" ;;
    esac
    cat <<EXAMPLES

Example $1 ($PARSLEY_CONFIG, database $DATABASE). Try:

  # 1. Write an order for customer ada; the answer's Parsley-Session header is your token.
  TOKEN=\$(curl -s -D - -o /dev/null -X POST $GATEWAY_URL/v1/topics/orders/records \\
      -H 'content-type: application/json' -d '{"key": "ada", "value": {"order": "o-1", "amount": 12.5, "status": "placed"}}' \\
      | tr -d '\r' | sed -n 's/^parsley-session: //Ip')

  # 2. Read through the model's named query with the token: served once it covers your write.
  curl -s -H "Parsley-Session: \$TOKEN" '$GATEWAY_URL/v1/models/$query'; echo

  # 3. A payment written with the token carries the order as its cause.
  TOKEN=\$(curl -s -D - -o /dev/null -X POST $GATEWAY_URL/v1/topics/payments/records -H "Parsley-Session: \$TOKEN" \\
      -H 'content-type: application/json' -d '{"key": "ada", "value": {"payment": "p-1", "order": "o-1", "amount": 5, "status": "paid"}}' \\
      | tr -d '\r' | sed -n 's/^parsley-session: //Ip')
  curl -s -H "Parsley-Session: \$TOKEN" '$GATEWAY_URL/v1/models/$query'; echo

make example-down stops the projector and the gateway; make services-down stops Kafka and PostgreSQL.
EXAMPLES
}

cmd_status() {
    local binary pid
    for binary in parsley-projector custom-projection parsley-gateway; do
        local pidfile="$PROJECTOR_PID"
        [ "$binary" = parsley-gateway ] && pidfile="$GATEWAY_PID"
        if pid="$(running_binary "$pidfile" "$binary")"; then
            ex_say "$binary: running (pid $pid)"
        fi
    done
}

case "${1:-}" in
    up) cmd_up "${2:-}" ;;
    down) mkdir -p "$RUN_DIR" && stop_all ;;
    status) cmd_status ;;
    *) ex_fail "usage: scripts/example.sh up NAME | down | status" ;;
esac
