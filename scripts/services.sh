#!/usr/bin/env bash
# The local stack: PostgreSQL and a single-node Apache Kafka (KRaft) on 127.0.0.1, plus their
# secured forms for the tests of secured clusters: PostgreSQL with TLS on and a TLS-only user,
# and a second single-node Kafka with a SASL_SSL listener (scripts/tls.sh makes the certificates).
#
#   scripts/services.sh up       install what is missing, start both, wait until they answer
#   scripts/services.sh down     stop what these scripts started
#   scripts/services.sh status   show what runs (exit 0 only if both answer)
#   scripts/services.sh reset    down, then delete all local data (.local/)
#
# Everything lives under .local/ in the repository (see docs/development.md).
set -Eeuo pipefail

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=scripts/postgres.sh
source "$PARSLEY_ROOT/scripts/postgres.sh"
# shellcheck source=scripts/kafka.sh
source "$PARSLEY_ROOT/scripts/kafka.sh"
# shellcheck source=scripts/tls.sh
source "$PARSLEY_ROOT/scripts/tls.sh"

print_env() {
    say "use:  export DATABASE_URL=$DATABASE_URL_LOCAL"
    say "      export PARSLEY_KAFKA_BOOTSTRAP=$KAFKA_BOOTSTRAP"
    say "secured: Kafka SASL_SSL at $KAFKA_SECURE_BOOTSTRAP (user $KAFKA_SASL_USER), PostgreSQL user $PG_TLS_USER over TLS"
    say "         only, CA and client certificate in $TLS_DIR (docs/operations.md, \"Secured clusters\")"
}

# The system libraries the workspace links: OpenSSL (librdkafka's TLS and SASL SCRAM, and
# sqlx's TLS to Postgres), found through pkg-config.
build_deps_install() {
    if ! command -v pkg-config >/dev/null 2>&1 || ! pkg-config --exists openssl; then
        say "build: installing libssl-dev and pkg-config (OpenSSL for Kafka and Postgres TLS)"
        apt_install libssl-dev pkg-config
    fi
}

cmd_up() {
    [ "$(id -u)" = 0 ] || id -un | grep -qx postgres ||
        fail "run as root: the scripts install packages and start PostgreSQL as the postgres user"
    command -v runuser >/dev/null 2>&1 || fail "runuser (util-linux) is needed to start PostgreSQL as the postgres user"
    mkdir -p "$LOG_DIR" "$RUN_DIR"
    local t0 t1 t2
    t0="$(now_s)"
    pg_install
    kafka_install
    build_deps_install
    tls_make
    t1="$(now_s)"
    say "install/check of prerequisites took $((t1 - t0))s"
    # The secured broker starts first and is waited for last: its start overlaps the others'.
    kafka_secure_start
    pg_up
    kafka_up
    kafka_secure_wait
    t2="$(now_s)"
    say "start/readiness took $((t2 - t1))s"
    printf 'install=%s\nstart=%s\n' "$((t1 - t0))" "$((t2 - t1))" >"$RUN_DIR/last-up-timings"
    print_env
}

cmd_down() {
    kafka_secure_down
    kafka_down
    pg_down
}

cmd_status() {
    local rc=0
    pg_status || rc=3
    kafka_status || rc=3
    kafka_secure_status || rc=3
    [ "$rc" = 0 ] && print_env
    return "$rc"
}

cmd_reset() {
    cmd_down
    pg_set_paths
    if [ "$PG_BASE" != "$LOCAL_DIR/postgres" ]; then
        say "removing $PG_BASE"
        rm -rf "$PG_BASE"
    fi
    say "removing $LOCAL_DIR"
    rm -rf "$LOCAL_DIR"
}

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status)
    rc=0
    cmd_status || rc=$?
    exit "$rc"
    ;;
reset) cmd_reset ;;
*)
    echo "usage: $0 up|down|status|reset" >&2
    exit 2
    ;;
esac
