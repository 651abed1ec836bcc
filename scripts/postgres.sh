# PostgreSQL part of the local stack. Sourced by services.sh after lib.sh.
# shellcheck shell=bash
#
# A project-local cluster run by the `postgres` OS user (the server refuses to run as root):
#   data    $PG_BASE/data      (PG_BASE is .local/postgres, see pg_base below)
#   socket  $PG_BASE/run       (peer authentication for the postgres superuser)
#   log     .local/logs/postgres.log
# Clients use TCP on 127.0.0.1:5432 with a password (scram-sha-256). The user may create
# databases and roles (CREATEROLE: `parsley-projector migrate --create-roles` and its tests make
# the least-privilege roles); it is not a superuser.
#
# TLS beside it (no restart: a reload turns it on in a running cluster): `ssl = on` with the
# certificates of scripts/tls.sh (copied to $PG_BASE/tls, the server's own), and one more user,
# $PG_TLS_USER, that may log in over TLS only, with its password AND a client certificate whose
# CN is its name (hostssl ... clientcert=verify-full; hostnossl ... reject). It is a member of
# $PG_USER and acts as it (ALTER ROLE ... SET role), so both see and own the same objects. The
# plain user is unchanged.

PG_TLS_USER="parsley_tls"
PG_TLS_PASSWORD="parsley-tls-secret"

PG_LOG="$LOG_DIR/postgres.log"
PG_LOCATION_FILE="$LOCAL_DIR/postgres.location"

# pg_base: folder holding the cluster. Normally .local/postgres; if the postgres user cannot
# reach into the clone (a parent folder without the x bit for others, e.g. a clone under
# /root), `up` falls back to a folder under /var/tmp and records it in .local/postgres.location.
pg_base() {
    if [ -s "$PG_LOCATION_FILE" ]; then
        cat "$PG_LOCATION_FILE"
    else
        echo "$LOCAL_DIR/postgres"
    fi
}

pg_set_paths() {
    PG_BASE="$(pg_base)"
    PGDATA_DIR="$PG_BASE/data"
    PG_SOCKET_DIR="$PG_BASE/run"
    # A Unix socket path is limited to about 107 bytes; keep a margin for ".s.PGSQL.5432.lock".
    if [ "${#PG_SOCKET_DIR}" -gt 80 ]; then
        PG_SOCKET_DIR="/tmp/parsley-pg-$(printf '%s' "$PARSLEY_ROOT" | cksum | cut -d' ' -f1)"
    fi
}

# as_postgres CMD...: run a command as the postgres OS user from a folder it can read.
as_postgres() {
    (cd / && runuser -u postgres -- "$@")
}

# pg_find_bindir: folder with initdb, pg_ctl and postgres of the wanted major version
# (the one the data folder was made with, if any), else the newest installed.
pg_find_bindir() {
    local want="" d
    [ -s "$PGDATA_DIR/PG_VERSION" ] && want="$(cat "$PGDATA_DIR/PG_VERSION")"
    if [ -n "$want" ] && [ -x "/usr/lib/postgresql/$want/bin/pg_ctl" ]; then
        echo "/usr/lib/postgresql/$want/bin"
        return 0
    fi
    # shellcheck disable=SC2012  # fixed, plain folder names
    for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k5 -V -r); do
        if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && [ -x "$d/postgres" ]; then
            echo "$d"
            return 0
        fi
    done
    if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
        dirname "$(readlink -f "$(command -v pg_ctl)")"
        return 0
    fi
    return 1
}

pg_install() {
    pg_set_paths
    if PG_BIN="$(pg_find_bindir)"; then
        return 0
    fi
    say "PostgreSQL server binaries (initdb, pg_ctl) not found: installing Debian's postgresql"
    # Debian's package would create and start a system cluster on port 5432, which would
    # take the port this project needs: tell postgresql-common not to create one.
    mkdir -p /etc/postgresql-common/createcluster.d
    printf '# Written by %s/scripts: no system cluster, the project runs its own.\ncreate_main_cluster = false\n' \
        "$PARSLEY_ROOT" >/etc/postgresql-common/createcluster.d/parsley-no-main-cluster.conf
    apt_install postgresql
    PG_BIN="$(pg_find_bindir)" || fail "postgresql installed but initdb/pg_ctl still not found"
}

pg_pid() {
    head -n 1 "$PGDATA_DIR/postmaster.pid" 2>/dev/null || true
}

# pg_running: the pid in our data folder's postmaster.pid is a live postgres process working
# in that folder (a pid left by a killed server and reused by another process is not).
pg_running() {
    local pid
    pid="$(pg_pid)"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = postgres ] || return 1
    [ "$(readlink -f "/proc/$pid/cwd" 2>/dev/null)" = "$(readlink -f "$PGDATA_DIR")" ]
}

# pg_clear_stale_locks: only called when pg_running is false. A lock file naming a dead pid
# is left alone (the server sees it is stale and checks its old shared memory itself). One
# naming a live pid that is not our server (a pid reused after a crash or reboot) would make
# the server refuse to start: it is removed, but only while no process at all works in the
# data folder (no orphaned backend can still be attached to the old shared memory).
pg_clear_stale_locks() {
    local pid p
    pid="$(pg_pid)"
    [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
    for p in /proc/[0-9]*; do
        if [ "$(readlink -f "$p/cwd" 2>/dev/null)" = "$(readlink -f "$PGDATA_DIR")" ]; then
            fail "postgres: process ${p#/proc/} still works in $PGDATA_DIR but is not the server named by postmaster.pid; stop it first" "$PG_LOG"
        fi
    done
    warn "postgres: removing the stale $PGDATA_DIR/postmaster.pid (pid $pid is another process)"
    rm -f "$PGDATA_DIR/postmaster.pid" "$PG_SOCKET_DIR/.s.PGSQL.$PG_PORT.lock"
}

# pg_prepare_base: make sure the postgres user can own and reach the cluster folder.
pg_prepare_base() {
    id postgres >/dev/null 2>&1 || fail "the postgres OS user does not exist (is Debian's postgresql installed?)"
    if [ ! -s "$PG_LOCATION_FILE" ]; then
        mkdir -p "$LOCAL_DIR/postgres"
        chown postgres:postgres "$LOCAL_DIR/postgres"
        chmod 0700 "$LOCAL_DIR/postgres"
        if ! as_postgres test -w "$LOCAL_DIR/postgres"; then
            local alt
            alt="/var/tmp/parsley-postgres-$(printf '%s' "$PARSLEY_ROOT" | cksum | cut -d' ' -f1)"
            warn "the postgres user cannot reach $LOCAL_DIR (a parent folder is not traversable);"
            warn "keeping the cluster in $alt instead (recorded in $PG_LOCATION_FILE)"
            rmdir "$LOCAL_DIR/postgres" 2>/dev/null || true
            echo "$alt" >"$PG_LOCATION_FILE"
        fi
        pg_set_paths
    fi
    mkdir -p "$PG_BASE" "$PG_SOCKET_DIR"
    chown postgres:postgres "$PG_BASE" "$PG_SOCKET_DIR"
    chmod 0700 "$PG_BASE" "$PG_SOCKET_DIR"
    as_postgres test -w "$PG_BASE" || fail "the postgres user cannot write $PG_BASE"
}

pg_initdb() {
    [ -s "$PGDATA_DIR/PG_VERSION" ] && return 0
    local log="$LOG_DIR/postgres-initdb.log"
    say "initdb $PGDATA_DIR (log: $log)"
    rm -rf "$PGDATA_DIR"
    as_postgres "$PG_BIN/initdb" -D "$PGDATA_DIR" -U postgres -E UTF8 --locale=C \
        --auth-local=peer --auth-host=scram-sha-256 >"$log" 2>&1 ||
        fail "initdb failed" "$log"
    printf "\n# Project settings, rewritten by scripts/services.sh on every start.\ninclude_if_exists = 'parsley.conf'\n" \
        >>"$PGDATA_DIR/postgresql.conf"
}

pg_write_conf() {
    cat >"$PGDATA_DIR/parsley.conf" <<EOF
# Written by scripts/services.sh on every start; edits here are lost.
listen_addresses = '$PG_HOST'
port = $PG_PORT
unix_socket_directories = '$PG_SOCKET_DIR'
max_connections = 200
password_encryption = 'scram-sha-256'
log_line_prefix = '%m [%p] %q%u@%d '
log_timezone = 'UTC'
timezone = 'UTC'
ssl = on
ssl_cert_file = '$PG_BASE/tls/server.pem'
ssl_key_file = '$PG_BASE/tls/server.key'
ssl_ca_file = '$PG_BASE/tls/ca.pem'
EOF
    chown postgres:postgres "$PGDATA_DIR/parsley.conf"
}

# pg_tls_files: the server's copies of the certificates (the key must be the server's own, 0600).
pg_tls_files() {
    mkdir -p "$PG_BASE/tls"
    cp "$TLS_DIR/server.pem" "$TLS_DIR/server.key" "$TLS_DIR/ca.pem" "$PG_BASE/tls/"
    chown -R postgres:postgres "$PG_BASE/tls"
    chmod 0700 "$PG_BASE/tls"
    chmod 0600 "$PG_BASE/tls/server.key"
}

# pg_hba_tls: the TLS-only user's lines, first in pg_hba.conf (the first matching line wins).
pg_hba_tls() {
    local hba="$PGDATA_DIR/pg_hba.conf" marker="# parsley: the TLS-only user (scripts/postgres.sh)"
    grep -qxF "$marker" "$hba" && return 0
    local tmp="$hba.parsley"
    {
        echo "$marker"
        echo "hostnossl all $PG_TLS_USER all reject"
        echo "hostssl all $PG_TLS_USER 127.0.0.1/32 scram-sha-256 clientcert=verify-full"
        cat "$hba"
    } >"$tmp"
    chown postgres:postgres "$tmp"
    chmod 0600 "$tmp"
    mv "$tmp" "$hba"
}

# pg_reload: re-read parsley.conf and pg_hba.conf in a running cluster (never a restart).
pg_reload() {
    as_postgres "$PG_BIN/pg_ctl" -D "$PGDATA_DIR" reload >>"$PG_LOG" 2>&1 </dev/null ||
        fail "postgres: reloading the configuration failed" "$PG_LOG"
}

# shellcheck disable=SC2120  # extra psql arguments are optional
pg_psql_super() {
    as_postgres "$PG_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$PG_SOCKET_DIR" -p "$PG_PORT" \
        -U postgres -d postgres "$@"
}

pg_ensure_role_and_db() {
    local log="$LOG_DIR/postgres-setup.log"
    {
        # shellcheck disable=SC2119
        pg_psql_super <<EOF
DO \$\$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$PG_USER') THEN
    CREATE ROLE $PG_USER LOGIN CREATEDB CREATEROLE PASSWORD '$PG_PASSWORD';
  ELSE
    ALTER ROLE $PG_USER LOGIN CREATEDB CREATEROLE PASSWORD '$PG_PASSWORD';
  END IF;
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$PG_TLS_USER') THEN
    CREATE ROLE $PG_TLS_USER LOGIN PASSWORD '$PG_TLS_PASSWORD' IN ROLE $PG_USER;
  ELSE
    ALTER ROLE $PG_TLS_USER LOGIN PASSWORD '$PG_TLS_PASSWORD';
  END IF;
END
\$\$;
ALTER ROLE $PG_TLS_USER SET role = '$PG_USER';
SELECT 'CREATE DATABASE $PG_DB OWNER $PG_USER'
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '$PG_DB')\gexec
EOF
    } >"$log" 2>&1 || fail "creating role/database $PG_USER/$PG_DB failed" "$log" "$PG_LOG"
}

# pg_check: a real login over TCP with the project's URL.
pg_check() {
    PGPASSWORD="$PG_PASSWORD" PGCONNECT_TIMEOUT=5 "$PG_BIN/psql" -X -q -At \
        -h "$PG_HOST" -p "$PG_PORT" -U "$PG_USER" -d "$PG_DB" -c 'select 1' 2>/dev/null | grep -qx 1
}

# pg_tls_check: a login as the TLS-only user with the server verified and a client certificate.
pg_tls_check() {
    PGPASSWORD="$PG_TLS_PASSWORD" PGCONNECT_TIMEOUT=5 "$PG_BIN/psql" -X -q -At \
        "host=$PG_HOST port=$PG_PORT user=$PG_TLS_USER dbname=$PG_DB sslmode=verify-full sslrootcert=$TLS_DIR/ca.pem sslcert=$TLS_DIR/client.pem sslkey=$TLS_DIR/client.key" \
        -c 'select current_user' 2>&1
}

pg_up() {
    pg_prepare_base
    pg_tls_files
    if pg_running; then
        say "postgres: already running (pid $(pg_pid), data $PGDATA_DIR)"
        # TLS and the TLS-only user are switched on by a reload (a cluster from before them).
        pg_write_conf
        pg_hba_tls
        pg_reload
    else
        if port_open "$PG_PORT"; then
            fail "127.0.0.1:$PG_PORT is taken by a process that is not this project's cluster ($PGDATA_DIR):
$(who_listens "$PG_PORT")
    stop it (a Debian system cluster: pg_ctlcluster <version> main stop) or free the port"
        fi
        pg_initdb
        pg_clear_stale_locks
        pg_write_conf
        pg_hba_tls
        : >>"$PG_LOG"
        say "postgres: starting (log: $PG_LOG)"
        # The server inherits this redirection: its log goes to $PG_LOG, never to our stdout.
        as_postgres "$PG_BIN/pg_ctl" -D "$PGDATA_DIR" -w -t "$READY_TIMEOUT" start \
            >>"$PG_LOG" 2>&1 </dev/null ||
            fail "postgres did not start within ${READY_TIMEOUT}s" "$PG_LOG"
    fi
    local deadline=$(($(now_s) + READY_TIMEOUT))
    until "$PG_BIN/pg_isready" -q -h "$PG_HOST" -p "$PG_PORT" -t 2; do
        pg_running || fail "postgres exited during start" "$PG_LOG"
        [ "$(now_s)" -lt "$deadline" ] || fail "postgres not answering on $PG_HOST:$PG_PORT after ${READY_TIMEOUT}s" "$PG_LOG"
        sleep 0.5
    done
    pg_ensure_role_and_db
    pg_check || fail "cannot log in as $PG_USER at $PG_HOST:$PG_PORT/$PG_DB" "$PG_LOG"
    local out
    out="$(pg_tls_check)" && [ "$out" = "$PG_USER" ] ||
        fail "cannot log in over TLS as $PG_TLS_USER (acting as $PG_USER): ${out:-no answer}" "$PG_LOG"
    say "postgres: ready at $DATABASE_URL_LOCAL, and over TLS only as $PG_TLS_USER"
}

pg_down() {
    pg_set_paths
    if ! PG_BIN="$(pg_find_bindir)"; then
        say "postgres: not installed, nothing to stop"
        return 0
    fi
    if pg_running; then
        say "postgres: stopping (pid $(pg_pid))"
        as_postgres "$PG_BIN/pg_ctl" -D "$PGDATA_DIR" -m fast -w -t 60 stop >>"$PG_LOG" 2>&1 </dev/null ||
            fail "postgres did not stop within 60s" "$PG_LOG"
        say "postgres: stopped"
    else
        say "postgres: not running"
    fi
}

# pg_status: prints one line; returns 0 if running and answering.
pg_status() {
    pg_set_paths
    if ! PG_BIN="$(pg_find_bindir)"; then
        say "postgres: not installed (make services-up installs it)"
        return 1
    fi
    if pg_running; then
        if pg_check; then
            say "postgres: running, pid $(pg_pid), $DATABASE_URL_LOCAL, data $PGDATA_DIR, log $PG_LOG"
            return 0
        fi
        say "postgres: running (pid $(pg_pid)) but not answering logins; see $PG_LOG"
        return 1
    fi
    if port_open "$PG_PORT"; then
        say "postgres: stopped; 127.0.0.1:$PG_PORT is held by another process:"
        who_listens "$PG_PORT"
    else
        say "postgres: stopped (data $PGDATA_DIR)"
    fi
    return 1
}
